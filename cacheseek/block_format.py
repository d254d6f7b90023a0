"""``BlockFormat``: the frames of one cache configuration (a codec, a KV layout, a block size).

It plans each block's frame (the header a block's payload is written under) and checks
that a frame fetched from a tier or a server is one of this configuration's. Laying out a
frame's buffers and packing its header costs ~0.1 ms, so it is done once per hash size as
a template, and each block's frame is derived from it (``replan_frame``: a few µs).

Under a ``PrecisionPolicy`` the codec depends on the block's position: a policy's format
holds one uniform format per codec (``at(position)``), plans each block with its own
codec's template, and checks a fetched frame against the codec of the position it is
fetched for. Encoders and decoders cut their launches at ``boundaries`` so a launch holds
blocks of one codec.
Torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .errors import FrameError
from .layout import KVLayout
from .quant.codec import KVLayerCodec, same_spec
from .quant.policy import PrecisionPolicy, single_codec
from .store.frame import FrameMeta, plan_frame, replan_frame

MAX_POSITION = 1 << 62  # the largest ``pos`` a frame header may hold (``frame.parse_header``)
MAX_TEMPLATES = 8  # one per (hash size, parent hash size): a cache uses one or two
PLACEHOLDER_CHUNK = 64  # positions planned together for the guessed tail (``placeholder_run``)
PLACEHOLDER_CHUNKS = 256  # chunks kept at most (16K positions: blocks of a 4M-token prompt at 256)


class BlockFormat:
    """How blocks of ``block_tokens`` tokens of ``layout`` are framed once ``codec`` encodes them."""

    __slots__ = ("block_tokens", "codec", "codec_spec", "layout", "policy", "_parts", "_lock", "_placeholders",
                 "_templates")

    def __init__(self, codec: KVLayerCodec | PrecisionPolicy, layout: KVLayout, block_tokens: int) -> None:
        """``codec``: a codec, or a ``PrecisionPolicy`` (then ``codec`` is the policy,
        ``policy`` is set, and ``at(position)`` gives the uniform format of a position)."""
        self.codec, self.layout, self.block_tokens = codec, layout, block_tokens
        self.codec_spec = codec.spec()
        self.policy = codec if isinstance(codec, PrecisionPolicy) else None
        self._parts: tuple[BlockFormat, ...] = ()  # a policy's: (first's, rest's)
        if self.policy is not None:
            self._parts = tuple(BlockFormat(part, layout, block_tokens) for part in self.policy.codecs())
        self._templates: OrderedDict[tuple[int, int], FrameMeta] = OrderedDict()
        # (hash size, chunk) -> the placeholder frames of that chunk's positions
        self._placeholders: dict[tuple[int, int], tuple[FrameMeta, ...]] = {}
        self._lock = threading.Lock()  # taken only to add a template

    @property
    def uniform(self) -> bool:
        """One codec for every position."""
        return self.policy is None

    def at(self, position: int) -> BlockFormat:
        """The uniform format of the block at ``position`` (this one when uniform)."""
        if self.policy is None:
            return self
        return self._parts[0] if position < self.policy.first_blocks else self._parts[1]

    def parts(self) -> tuple[BlockFormat, ...]:
        """The uniform formats of every codec this one uses (itself when uniform)."""
        return (self,) if self.policy is None else self._parts

    def boundaries(self) -> tuple[int, ...]:
        """Positions where the codec changes (none when uniform)."""
        return () if self.policy is None else self.policy.boundaries()

    def segments(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[start, stop)`` (positions of consecutive blocks) cut where the codec changes."""
        cuts = [b for b in self.boundaries() if start < b < stop]
        edges = [start, *cuts, stop]
        return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]

    def planned_payload(self) -> FrameMeta:
        """A frame of this (uniform) format as planned, for its payload's layout: the buffers'
        offsets and ``payload_nbytes``, the same under every key."""
        if self.policy is not None:
            raise RuntimeError("planned_payload: a policy's payload depends on the position; use at(position)")
        return self._template(0, 0)

    def max_frame_nbytes(self) -> int:
        """The largest frame of this format: any codec of it, 32-byte hashes, the largest
        position a header may hold (its header is the longest). A stored file larger than
        this is no block of this configuration."""
        return max(part.plan(block_hash=bytes(32), parent_hash=bytes(32), position=MAX_POSITION).nbytes
                   for part in self.parts())

    def plan(self, *, block_hash: bytes, parent_hash: bytes, position: int) -> FrameMeta:
        """The frame of one block as the codec encodes it (unsealed: no checksum yet)."""
        if self.policy is not None:
            return self.at(position).plan(block_hash=block_hash, parent_hash=parent_hash, position=position)
        return replan_frame(self._template(len(block_hash), len(parent_hash)), block_hash=block_hash,
                            parent_hash=parent_hash, position=position)

    def plan_run(self, first: int, hashes: Sequence[bytes], parents: Sequence[bytes],
                 positions: Sequence[int] | None = None) -> list[FrameMeta]:
        """The frames of consecutive blocks ``first, first + 1, ...`` keyed ``hashes``; or,
        with ``positions``, of blocks at those positions (blocks of several requests' chains)."""
        if not hashes:
            return []
        if self.policy is not None:
            if positions is None:
                positions = range(first, first + len(hashes))
            return [self.plan(block_hash=h, parent_hash=p, position=pos)
                    for h, p, pos in zip(hashes, parents, positions, strict=True)]
        template = self._template(len(hashes[0]), len(parents[0]))
        if positions is not None:
            return [replan_frame(template, block_hash=h, parent_hash=p, position=pos)
                    for h, p, pos in zip(hashes, parents, positions, strict=True)]
        return [replan_frame(template, block_hash=h, parent_hash=p, position=first + i)
                for i, (h, p) in enumerate(zip(hashes, parents, strict=True))]

    def placeholder_run(self, first: int, count: int, hash_size: int) -> list[FrameMeta]:
        """``plan_run`` of blocks ``first..first + count`` under all-zero keys of ``hash_size``
        bytes: the sizes and payload layout of frames whose keys are not known yet (the
        in-place ingest's guessed tail). Each position's frame depends on nothing else, so
        they are planned and kept in chunks of ``PLACEHOLDER_CHUNK`` positions, the chunks a
        run touches only (planning costs the host ~5-10 us a frame: kept per (first, count),
        prompts of many lengths missed; planned from position 0, a long prompt's first call
        took 100 ms)."""
        out: list[FrameMeta] = []
        pos, end = first, first + count
        while pos < end:
            c = pos // PLACEHOLDER_CHUNK
            base = c * PLACEHOLDER_CHUNK
            chunk = self._placeholders.get((hash_size, c))
            if chunk is None:
                unknown = [bytes(hash_size)] * PLACEHOLDER_CHUNK
                chunk = tuple(self.plan_run(base, unknown, unknown))  # (unlocked: planning takes the lock)
                with self._lock:
                    while len(self._placeholders) >= PLACEHOLDER_CHUNKS:
                        self._placeholders.pop(next(iter(self._placeholders)))  # the oldest
                    self._placeholders[(hash_size, c)] = chunk
            out += chunk[pos - base : min(end, base + PLACEHOLDER_CHUNK) - base]
            pos = base + PLACEHOLDER_CHUNK
        return out

    def _template(self, hash_size: int, parent_size: int) -> FrameMeta:
        key = (hash_size, parent_size)
        template = self._templates.get(key)
        if template is not None:
            return template
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        encoded = single_codec(self.codec).template((L, H, self.block_tokens, D), self.layout.dtype)
        specs = [(name, spec.dtype, spec.shape) for name, spec, _ in encoded.named_buffers()]
        template = plan_frame(block_hash=bytes(hash_size), parent_hash=bytes(parent_size), position=0,
                              layout=self.layout, block_tokens=self.block_tokens, codec=self.codec_spec,
                              buffers=specs)
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        return template

    def check_fetched(self, meta: FrameMeta, key: bytes, position: int) -> None:
        """Raise ``FrameError`` unless ``meta`` (a frame fetched from a tier or a server) is
        block ``key``, fetched for ``position`` of its chain, in this configuration."""
        if meta.block_hash != key:
            raise FrameError("frame names another block")
        if self.policy is not None:
            # The codec of the place the block is fetched for, not of the position its header
            # claims: a header claiming another one parses and names that one's codec, and
            # the decoder, which lays the block out by its place, then raised instead of missing.
            self.at(position).check_fetched(meta, key, position)
            return
        # (a frame planned here holds this spec itself; a parsed one, a copy to compare type-strictly)
        codec_ok = meta.codec is self.codec_spec or same_spec(meta.codec, self.codec_spec)
        if not codec_ok or meta.layout != self.layout or meta.block_tokens != self.block_tokens:
            raise FrameError("frame was written with another codec, layout or block size")
        # The buffers too, as this codec lays them out: a parsed header is only checked to be
        # self-consistent, and the decoder, which sizes its staging from them, raised
        # FrameError out of materialize for one that was not the codec's (the block missed
        # nothing: the prefix ends before it).
        planned = self._template(0, 0).tensors
        if meta.tensors is not planned and meta.tensors != planned:
            raise FrameError("frame buffers are not laid out as this codec lays them out")


__all__ = ["BlockFormat"]
