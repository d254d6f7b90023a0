"""``PrefixCache``: the embedded cache a worker holds. Tiers live in this process."""

from __future__ import annotations

from typing import Any

from . import ingest_in_place
from .config import TierConfig
from .decode import BatchDecoder
from .encode import iter_encoded
from .errors import FrameError, InputError
from .hashing import DEFAULT_ALGO, digest_size
from .kv_input import check_layers, kv_layers
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .prefix_cache_base import PrefixCacheBase
from .results import IngestResult, Located, Materialized
from .store.tiered import StorePutResult

__all__ = ["IngestResult", "Located", "Materialized", "PrefixCache"]

FETCH_BLOCKS = 16  # blocks fetched per call to the store while materializing


def _count(result: IngestResult, key: bytes, outcome: StorePutResult, stored: list[bytes]) -> None:
    if outcome.stored:
        result.stored += 1
        stored.append(key)
    elif outcome.present:
        result.present += 1
    else:
        result.failed += 1
    for tier, reason in outcome.errors.items():
        result.errors.setdefault(tier, reason)


class PrefixCache(PrefixCacheBase):
    """Stores and returns KV for prefix blocks, keyed by a chained hash of their content."""

    def __init__(
        self,
        *,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec | None = None,
        block_tokens: int = 256,
        tiers: TierConfig | None = None,
        namespace: str = "",
        hash_algo: str = DEFAULT_ALGO,
        max_batch_bytes: int | str = "1GiB",
    ) -> None:
        super().__init__(model_id=model_id, layout=layout, codec=codec, block_tokens=block_tokens,
                         namespace=namespace, hash_algo=hash_algo, max_batch_bytes=max_batch_bytes)
        self.store = (tiers or TierConfig()).build()

    # -- the three calls -----------------------------------------------------------------

    def ingest(self, keys: Any, kv: Any) -> IngestResult:
        """Store the full blocks of ``kv`` that are not stored yet. Nothing is stored if the
        input is bad (wrong layout, lengths that disagree, NaN/Inf).

        With a persistent tier written through (a ``disk_path``, the default write-through),
        a block counted stored or present is on disk (fsynced) when this returns; without
        one, in memory. ``IngestResult.durability`` says which."""
        layers = kv_layers(kv)
        tokens = check_layers(layers, self.layout)
        self.keys.check_ingest(keys, tokens)
        in_place = None
        if ingest_in_place.applies(self.store, layers[0][0].device):
            # KV on a GPU, host memory on top: blocks go straight into reserved CPU-tier
            # slots, and the chain's tail is on its way before the prompt is even hashed.
            in_place = ingest_in_place.InPlaceIngest(self.store, self.block_format, layers)
            in_place.guess_tail(tokens // self.block_tokens, digest_size(self.hash_algo))
        try:
            hashes = self.block_hashes(keys)
            present = found = self.store.present_many(hashes)
        except BaseException:
            if in_place is not None:
                in_place.abandon()
            raise
        result = IngestResult(blocks=len(hashes), stored=0, present=sum(present), tokens=len(hashes) * self.block_tokens,
                              durability=self.store.durability)
        if not hashes:
            if in_place is not None:
                in_place.abandon()  # (nothing was launched: fewer tokens than a block)
            return result
        parents = self.keys.parents(hashes)
        stored: list[bytes] = []
        if in_place is not None:
            outcomes = in_place.run(hashes, parents, present, self._batch_blocks)
            for key, outcome in zip(hashes, outcomes):
                if outcome is not None:
                    _count(result, key, outcome, stored)
            present = [p or o is not None for p, o in zip(present, outcomes)]
        # The rest (any other tiers or devices, or blocks the top tier had no room to
        # reserve for) go through put_many. Batches go tail first, so when a chain overflows
        # a tier its head stays and its tail is evicted; on a GPU each batch's encoding
        # overlaps the previous one's copies. A bad batch (NaN, Inf) undoes the batches this
        # call stored before it.
        try:
            for batch in iter_encoded(self.block_format, layers, hashes, parents, present, self._batch_blocks,
                                      tail_first=True):
                items = [(frame.meta.block_hash, frame) for frame in reversed(batch)]
                for (key, _), outcome in zip(items, self.store.put_many(items)):
                    _count(result, key, outcome, stored)
        except InputError:
            for key in stored:
                self.store.delete(key)
            raise
        # A use of the blocks that were stored already; the ones this call stored were put
        # tail first, so the head is still the most recent either way.
        self.store.touch_chain([key for key, was in zip(hashes, found) if was])
        return result

    def locate(self, keys: Any) -> Located:
        self._num_keys(keys)
        tiers = self.store.locate(self.block_hashes(keys))
        return Located(num_blocks=len(tiers), num_tokens=len(tiers) * self.block_tokens, tiers=tiers)

    def materialize(self, keys: Any, device: Any = None, *, max_tokens: int | None = None) -> Materialized:
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``."""
        self._num_keys(keys)
        device = self._device(device)
        hashes = self.block_hashes(keys)
        located = self.store.locate(self._limit(hashes, max_tokens))
        if not located:
            return self._nothing(device)
        decoder = BatchDecoder(self.block_format, len(located), device)
        tiers: list[str] = []
        for key, got in self._fetch(hashes[: len(located)]):
            if got is None:
                break  # evicted or found corrupt since locate: the prefix ends here
            frame, tier = got
            try:
                self.block_format.check_fetched(frame.meta, key)
            except FrameError:
                break
            decoder.add(frame)  # its copy to the device starts now
            tiers.append(tier)
        if not tiers:
            return self._nothing(device)
        k, v = decoder.finish(wait=False)
        self.store.touch_chain(hashes[: len(tiers)])
        result = self._materialized(k, v, tiers, device)  # while the last copies land
        decoder.wait()  # the frames' host memory may be reused once we return
        return result

    def _fetch(self, keys: list[bytes]):
        """(key, (frame, tier) or None) in chain order. Each tier is asked once per
        ``FETCH_BLOCKS`` keys (one Redis round trip), so the device copies of one batch
        overlap the fetch of the next; a caller that stops early fetches no further."""
        for start in range(0, len(keys), FETCH_BLOCKS):
            chunk = keys[start : start + FETCH_BLOCKS]
            yield from zip(chunk, self.store.get_many(chunk))

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {**self._config_stats(), **self.store.stats()}

    def close(self) -> None:
        self.store.close()
