"""``PrefixCache``: the embedded cache a worker holds. Tiers live in this process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .block_io import BatchDecoder, check_frame, check_layers, iter_encoded
from .config import TierConfig
from .errors import FrameError, InputError
from .hashing import DEFAULT_ALGO, BlockHash
from .kv_input import kv_layers
from .layout import KVLayout
from .prefix_keys import PrefixKeys, is_block_keys  # noqa: F401  (is_block_keys: kept importable from here)
from .quant.codec import KVLayerCodec
from .quant.kivi import KIVI
from .units import parse_size


@dataclass(slots=True)
class IngestResult:
    """``blocks``: full blocks in the input; ``stored``: newly written; ``present``: already
    stored (not encoded again); ``failed``: stored nowhere; ``errors``: tier -> reason."""

    blocks: int
    stored: int
    present: int
    tokens: int
    failed: int = 0
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Located:
    """The longest stored prefix, and the fastest tier holding each of its blocks."""

    num_blocks: int
    num_tokens: int
    tiers: list[str]


@dataclass(slots=True)
class Materialized:
    """KV of the longest stored prefix, decoded on ``device``.

    ``layers[i]`` is (K, V), each [1, H, num_tokens, D]; empty when nothing matched.
    """

    num_tokens: int
    num_blocks: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    tiers: list[str]
    device: torch.device

    def to_dynamic_cache(self) -> Any:
        """An HF ``DynamicCache`` holding this KV, ready to continue generation."""
        from .integrations.transformers import to_dynamic_cache

        return to_dynamic_cache(self.layers)


FETCH_BLOCKS = 16  # blocks fetched per call to the store while materializing


class PrefixCache:
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
        self.model_id = model_id
        self.layout = layout
        self.codec = codec if codec is not None else KIVI(bits=4, group_size=32)
        self.block_tokens = block_tokens
        self.namespace = namespace
        self.hash_algo = hash_algo
        self.keys = PrefixKeys.create(namespace=namespace, model_id=model_id, layout=layout, codec=self.codec,
                                      block_tokens=block_tokens, hash_algo=hash_algo)
        self.root = self.keys.root
        self._codec_spec = self.codec.spec()
        self._batch_blocks = max(1, parse_size(max_batch_bytes, name="max_batch_bytes") // layout.raw_nbytes(block_tokens))
        self.store = (tiers or TierConfig()).build()

    # -- keys ----------------------------------------------------------------------------

    def block_hashes(self, keys: Any) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``keys`` (token ids, or one bytes per block)."""
        return self.keys.block_hashes(keys)

    def _num_keys(self, keys: Any) -> int:
        """Tokens named by ``keys``; raises on an empty input."""
        return self.keys.num_tokens(keys)

    # -- the three calls -----------------------------------------------------------------

    def ingest(self, keys: Any, kv: Any) -> IngestResult:
        """Store the full blocks of ``kv`` that are not stored yet. Nothing is stored if the
        input is bad (wrong layout, lengths that disagree, NaN/Inf)."""
        layers = kv_layers(kv)
        self.keys.check_ingest(keys, check_layers(layers, self.layout))
        hashes = self.block_hashes(keys)
        result = IngestResult(blocks=len(hashes), stored=0, present=0, tokens=len(hashes) * self.block_tokens)
        if not hashes:
            return result
        present = self.store.contains_many(hashes)
        result.present = sum(present)
        # Batches go tail first, so when a chain overflows a tier its head stays and its
        # tail is evicted; on a GPU each batch's encoding overlaps the previous one's copies.
        # A bad batch (NaN, Inf) undoes the batches this call stored before it.
        stored: list[bytes] = []
        try:
            for batch in iter_encoded(self.codec, self.layout, self.block_tokens, layers, hashes,
                                      self.keys.parents(hashes), present, self._batch_blocks, tail_first=True):
                items = [(frame.meta.block_hash, frame) for frame in reversed(batch)]
                for (key, _), outcome in zip(items, self.store.put_many(items)):
                    if outcome.stored:
                        result.stored += 1
                        stored.append(key)
                    elif outcome.present:
                        result.present += 1
                    else:
                        result.failed += 1
                    for tier, reason in outcome.errors.items():
                        result.errors.setdefault(tier, reason)
        except InputError:
            for key in stored:
                self.store.delete(key)
            raise
        self.store.touch_chain(hashes)
        return result

    def locate(self, keys: Any) -> Located:
        self._num_keys(keys)
        tiers = self.store.locate(self.block_hashes(keys))
        return Located(num_blocks=len(tiers), num_tokens=len(tiers) * self.block_tokens, tiers=tiers)

    def lookup(self, keys: Any) -> int:
        """Tokens covered by stored full blocks, from the start."""
        return self.locate(keys).num_tokens

    def materialize(self, keys: Any, device: Any = None, *, max_tokens: int | None = None) -> Materialized:
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``."""
        self._num_keys(keys)
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        hashes = self.block_hashes(keys)
        limit = len(hashes) if max_tokens is None else max(0, max_tokens) // self.block_tokens
        located = self.store.locate(hashes[:limit])
        if not located:
            return Materialized(0, 0, [], [], device)
        decoder = BatchDecoder(self.codec, self.layout, self.block_tokens, len(located), device)
        tiers: list[str] = []
        for key, got in self._fetch(hashes[: len(located)]):
            if got is None:
                break  # evicted or found corrupt since locate: the prefix ends here
            frame, tier = got
            try:
                check_frame(frame.meta, key=key, codec_spec=self._codec_spec, layout=self.layout,
                            block_tokens=self.block_tokens)
            except FrameError:
                break
            decoder.add(frame)  # its copy to the device starts now
            tiers.append(tier)
        if not tiers:
            return Materialized(0, 0, [], [], device)
        k, v = decoder.finish()
        self.store.touch_chain(hashes[: len(tiers)])
        layers = [(k[i].unsqueeze(0), v[i].unsqueeze(0)) for i in range(self.layout.num_layers)]
        return Materialized(len(tiers) * self.block_tokens, len(tiers), layers, tiers, device)

    def _fetch(self, keys: list[bytes]):
        """(key, (frame, tier) or None) in chain order. Each tier is asked once per
        ``FETCH_BLOCKS`` keys (one Redis round trip), so the device copies of one batch
        overlap the fetch of the next; a caller that stops early fetches no further."""
        for start in range(0, len(keys), FETCH_BLOCKS):
            chunk = keys[start : start + FETCH_BLOCKS]
            yield from zip(chunk, self.store.get_many(chunk))

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "namespace": self.namespace, "codec": self._codec_spec,
                "block_tokens": self.block_tokens, **self.store.stats()}

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

