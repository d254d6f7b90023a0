"""``PrefixCache``: the embedded cache a worker holds. Tiers live in this process."""

from __future__ import annotations

from typing import Any

from . import ingest_in_place
from .config import TierConfig
from .decode import BatchDecoder
from .encode import iter_encoded
from .errors import FrameError, InputError
from .hashing import DEFAULT_ALGO, SINGLE, Shard, digest_size
from .kv_input import check_layers, kv_layers
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .prefix_cache_base import PrefixCacheBase
from .results import IngestResult, Located, Materialized
from .store.prefetch import Prefetch
from .store.tiered import StorePutResult

__all__ = ["IngestResult", "Located", "Materialized", "Prefetch", "PrefixCache"]



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
        shard: Shard = SINGLE,
    ) -> None:
        super().__init__(model_id=model_id, layout=layout, codec=codec, block_tokens=block_tokens,
                         namespace=namespace, hash_algo=hash_algo, max_batch_bytes=max_batch_bytes, shard=shard)
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
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``.

        Frames flow from the tiers into the decoder as each lands (``TieredStore.stream``):
        disk reads are many in flight, and each frame's copy to ``device`` starts as soon as
        it has been read and verified, while the next ones are still being read. A block a
        prefetch is promoting is waited for, not read twice. Frames lent in pooled buffers
        are released once their copies have landed."""
        self._num_keys(keys)
        device = self._device(device)
        hashes = self.block_hashes(keys)
        located = self.store.locate(self._limit(hashes, max_tokens))
        if not located:
            return self._nothing(device)
        decoder = BatchDecoder(self.block_format, len(located), device)
        tiers: list[str] = []
        frames = self.store.stream(hashes[: len(located)], where=located, leased=True)
        added: list = []  # frames added to the decoder, in order; the first ``released`` given back
        released = 0
        try:
            for key, got in zip(hashes, frames):
                if got is None:
                    break  # evicted or found corrupt since locate: the prefix ends here
                frame, tier = got
                try:
                    self.block_format.check_fetched(frame.meta, key)
                except FrameError:
                    frame.release()
                    break
                decoder.add(frame)  # its copy to the device starts now
                added.append(frame)
                tiers.append(tier)
                # Buffers whose copies have landed go back to the pool at once, so a long
                # chain reuses a few pooled buffers instead of holding one per block.
                copied = decoder.copied()
                for done in added[released:copied]:
                    done.release()
                released = max(released, copied)
        finally:
            frames.close()  # reads not handed out: cancelled or given back
        try:
            if not tiers:
                return self._nothing(device)
            k, v = decoder.finish(wait=False)
            self.store.touch_chain(hashes[: len(tiers)])
            return self._materialized(k, v, tiers, device)  # while the last copies land
        finally:
            decoder.wait()  # no copy reads the frames' memory any more
            for frame in added[released:]:
                frame.release()

    def prefetch(self, keys: Any) -> Prefetch | None:
        """Start promoting the stored prefix of ``keys`` from disk or Redis into memory (the
        CPU tier, and the GPU tier where there is one) in the background, and return at
        once: a ``Prefetch`` handle (``wait(timeout)``, ``done()``, ``blocks`` being
        promoted), or None when there is nothing to promote (nothing stored, or the chain is
        in memory already: that costs one lookup) or ``max_prefetches`` are in flight. A
        ``materialize`` that comes meanwhile waits only for the blocks still on their way."""
        self._num_keys(keys)
        return self.store.prefetch(self.block_hashes(keys))

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {**self._config_stats(), **self.store.stats()}

    def close(self) -> None:
        self.store.close()
