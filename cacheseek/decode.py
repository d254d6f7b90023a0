"""Block frames -> KV on the target device: ``BatchDecoder``, the materialize path shared by
PrefixCache and RemoteCache.

The payloads of n blocks land in one device staging buffer at a fixed stride (one copy per
block, host-to-device when they come from host memory), are viewed as [n, L, H, ...] with
``as_strided``, and one codec call decodes them straight into the [L, H, n*B, D] outputs.
Full-precision KV is only ever built on the target device. The staging buffer is leased
from the device's pool (``store.device_staging``) at the first frame and given back once the
last decode is queued (``finish``), or by ``close`` on any path: a decoder is closed in a
``finally`` (``decode_frames`` does).

Under a precision policy (``BlockFormat.policy``) a chain mixes codecs by position:
``MixedDecoder`` gives each codec's run of positions its own ``BatchDecoder`` (its own
staging rows and launches), all decoding into one [L, H, n*B, D] output, in one pass over
the frames as they land. ``make_decoder`` picks the decoder a format needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .block_format import BlockFormat
from .errors import FrameError
from .staging import payload_views, staging_stride
from .store.device import as_host_tensor, copy_entry
from .store.device_staging import StagingLease, staging_pool
from .store.frame import FrameMeta
from .store.streams import on_stream, work_stream
from .store.tier import BlockFrame


class BatchDecoder:
    """Decodes up to ``max_blocks`` consecutive blocks into [L, H, n*B, D] K and V on ``device``.

    ``add`` starts a frame's copy into a staging buffer at once. On a GPU the copies run on
    a side stream and every ``chunk_blocks`` blocks are decoded as soon as they have landed,
    so decoding overlaps the transfer of the next blocks; ``finish`` decodes the rest.
    The host's work per block is a copy launch: the staging views are made once, and each
    chunk costs one codec call.
    """

    def __init__(self, fmt: BlockFormat, max_blocks: int, device: torch.device, *, chunk_blocks: int = 8,
                 sink: Any = None, blocks_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``sink(j0, j1, buffers)``: decodes blocks ``[j0, j1)`` (``buffers``: the codec's
        buffers as ``[j1 - j0, L, H, ...]`` staging views) where the caller wants them, e.g.
        into an engine's pages; then ``finish`` returns nothing. Default: into [L, H, n*B, D].
        ``blocks_out``: K and V views ``[max_blocks, L, H, B, D]`` to decode into (a
        ``MixedDecoder``'s part); ``finish`` then returns nothing either."""
        if not fmt.uniform:
            raise RuntimeError("BatchDecoder decodes blocks of one codec; use make_decoder for a precision policy")
        self._sink = sink
        self._blocks_out = blocks_out
        self.codec, self.layout, self.block_tokens = fmt.codec, fmt.layout, fmt.block_tokens
        self.max_blocks, self.device = max_blocks, device
        self._copy_stream = work_stream("to_device", device) if device.type == "cuda" else None
        self._chunk = chunk_blocks
        self._meta0: FrameMeta | None = None
        self._lease: StagingLease | None = None  # the staging buffer's, from _start until finish or close
        self._staging: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []  # the codec's buffers of every staging row
        # The frames added, in order; their memory stays the caller's, who holds each
        # frame's lease until ``copied()`` (or ``wait``) says its copy is done.
        self._frames: list[BlockFrame] = []
        self._copied_events: list = []  # one per frame added on a GPU: its copy has been issued
        self._copied = 0
        self._decoded = 0
        self._k: torch.Tensor | None = None  # made at the first decode: the first copy starts sooner
        self._v: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._frames)

    def _start(self, meta: FrameMeta) -> None:
        """Lay out the staging rows for frames like ``meta``, and check the codec agrees."""
        L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
        template = self.codec.template((self.max_blocks, L, H, B, D), self.layout.dtype)
        for (name, spec, _), entry in zip(template.named_buffers(), meta.tensors, strict=True):
            if entry.name != name or entry.dtype != spec.dtype or (self.max_blocks, *entry.shape) != spec.shape:
                raise FrameError(f"frame buffer {entry.name} does not match the codec's {name}")
        stride = staging_stride(meta.payload_nbytes)
        # Taken for the current stream (the decodes'); the copies run on the copy stream,
        # after it (the wait below).
        self._lease = staging_pool(self.device).take(self.max_blocks * stride)
        self._staging = self._lease.rows(self.max_blocks, stride)
        self._views = payload_views(self._staging, meta.tensors, self.max_blocks, stride)
        self._meta0 = meta
        if self._copy_stream is not None:
            self._lease.used_on(self._copy_stream)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def add(self, frame: BlockFrame) -> None:
        if len(self._frames) >= self.max_blocks:
            raise RuntimeError(f"BatchDecoder holds {self.max_blocks} blocks already")
        if self._meta0 is None:
            self._start(frame.meta)
        elif frame.meta.tensors != self._meta0.tensors:
            raise FrameError("frames of one chain disagree on their payload layout")
        elif self._staging is None:
            raise RuntimeError("BatchDecoder.add after finish or close (its staging was given back)")
        dst = self._staging[len(self._frames)]
        if self._copy_stream is None:
            self._copy(frame, dst)
        else:
            with on_stream(self._copy_stream):
                self._copy(frame, dst)
                landed = torch.cuda.Event()
                landed.record(self._copy_stream)
                self._copied_events.append(landed)
        self._frames.append(frame)
        pending, left = len(self._frames) - self._decoded, self.max_blocks - len(self._frames)
        # Near the end, smaller chunks: the decode of the last one is not hidden behind copies.
        if pending >= self._chunk or pending >= self._chunk // 2 and left < self._chunk:
            self._decode_pending()

    def copied(self) -> int:
        """How many of the frames added (in order) have been copied off their memory: a
        caller may release the leases of those (a CPU-tier slot, a disk read's pooled
        buffer) while the later ones are still being read. Asks the device without waiting."""
        if self._copy_stream is None:
            return len(self._frames)  # copies on the CPU are done when add returns
        events = self._copied_events
        while self._copied < len(events) and events[self._copied].query():
            events[self._copied] = None
            self._copied += 1
        return self._copied

    def _copy(self, frame: BlockFrame, dst: torch.Tensor) -> None:
        if frame.device_payload is not None:
            dst[: self._meta0.payload_nbytes].copy_(frame.device_payload, non_blocking=True)
        elif frame.device_entries is not None:
            for entry, src in zip(frame.meta.tensors, frame.device_entries, strict=True):
                copy_entry(dst[entry.offset : entry.offset + entry.nbytes], src)
        else:
            dst[: self._meta0.payload_nbytes].copy_(as_host_tensor(frame.payload_view()), non_blocking=True)

    def flush(self) -> None:
        """Decode the blocks added and not decoded yet now (once they have landed)."""
        self._decode_pending()

    def _decode_pending(self) -> None:
        j0, j1 = self._decoded, len(self._frames)
        if j1 == j0:
            return
        if self._copy_stream is not None:
            landed = torch.cuda.Event()
            landed.record(self._copy_stream)
            current = torch.cuda.current_stream(self.device)
            current.wait_event(landed)
            self._lease.used_on(current)  # (the stream it was taken for, unless the caller switched)
        if self._sink is not None:
            self._sink(j0, j1, [v[j0:j1] for v in self._views])
            self._decoded = j1
            return
        L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
        if self._k is None and self._blocks_out is not None:
            self._k, self._v = self._k_blocks, self._v_blocks = self._blocks_out
        elif self._k is None:
            self._k = torch.empty((L, H, self.max_blocks * B, D), dtype=self.layout.torch_dtype, device=self.device)
            self._v = torch.empty_like(self._k)
            as_blocks = (L, H, self.max_blocks, B, D)
            self._k_blocks = self._k.view(as_blocks).permute(2, 0, 1, 3, 4)
            self._v_blocks = self._v.view(as_blocks).permute(2, 0, 1, 3, 4)
        template = self.codec.template((j1 - j0, L, H, B, D), self.layout.dtype)
        out = (self._k_blocks[j0:j1], self._v_blocks[j0:j1])
        self.codec.decode(template.with_buffers([v[j0:j1] for v in self._views]), self.device, out=out)
        self._decoded = j1

    def finish(self, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks added, [L, H, n*B, D] (views: the last blocks may be unused),
        decoded on the current stream. ``wait=False``: the caller calls :meth:`wait` before
        the frames added may be released (their copies may still be in flight)."""
        n = len(self._frames)
        if n == 0:
            raise RuntimeError("BatchDecoder.finish: no frames were added")
        self._decode_pending()
        self._release_staging()  # every decode out of it is queued
        if wait:
            self.wait()
        if self._sink is not None or self._blocks_out is not None:
            return None, None
        tokens = n * self.block_tokens
        if n == self.max_blocks:
            return self._k, self._v
        return self._k[:, :, :tokens], self._v[:, :, :tokens]

    def wait(self) -> None:
        """Return once every copy out of the frames added is done: their leases may be released."""
        if self._copy_stream is not None and self._frames:
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)  # this decoder's copies, queued before now
            copied.synchronize()
        self._frames.clear()
        self._copied_events.clear()
        self._copied = 0

    def close(self) -> None:
        """Wait for the copies out of the frames added (their leases may then be released),
        and give the staging buffer back if ``finish`` did not (it is reused only after the
        work queued on it: no host wait). Idempotent; for a ``finally``."""
        try:
            self.wait()
        finally:
            self._release_staging()

    def _release_staging(self) -> None:
        lease = self._lease
        if lease is not None:
            self._lease = None
            self._staging, self._views = None, []
            lease.release()


class MixedDecoder:
    """``BatchDecoder``'s interface for a chain whose codec changes by position (a
    ``PrecisionPolicy``): blocks ``first_position, first_position + 1, ...`` are added in
    chain order; each codec's run of positions has its own ``BatchDecoder`` (blocks of each
    codec decoded together, a launch per chunk), all writing into one [L, H, n*B, D]."""

    def __init__(self, fmt: BlockFormat, max_blocks: int, device: torch.device, *, first_position: int = 0,
                 chunk_blocks: int = 8) -> None:
        L, H, D, B = fmt.layout.num_layers, fmt.layout.num_kv_heads, fmt.layout.head_dim, fmt.block_tokens
        self.block_tokens, self.max_blocks = B, max_blocks
        self._k = torch.empty((L, H, max_blocks * B, D), dtype=fmt.layout.torch_dtype, device=device)
        self._v = torch.empty_like(self._k)
        as_blocks = (L, H, max_blocks, B, D)
        k_blocks = self._k.view(as_blocks).permute(2, 0, 1, 3, 4)
        v_blocks = self._v.view(as_blocks).permute(2, 0, 1, 3, 4)
        self._parts: list[tuple[int, BatchDecoder]] = []  # (first row, decoder) per codec run
        for a, b in fmt.segments(first_position, first_position + max_blocks):
            j0, j1 = a - first_position, b - first_position
            self._parts.append((j0, BatchDecoder(fmt.at(a), j1 - j0, device, chunk_blocks=chunk_blocks,
                                                 blocks_out=(k_blocks[j0:j1], v_blocks[j0:j1]))))
        self._added = 0
        self._part = 0

    def __len__(self) -> int:
        return self._added

    def add(self, frame: BlockFrame) -> None:
        if self._added >= self.max_blocks:
            raise RuntimeError(f"MixedDecoder holds {self.max_blocks} blocks already")
        while len(self._parts[self._part][1]) == self._parts[self._part][1].max_blocks:
            self._part += 1
        part = self._parts[self._part][1]
        part.add(frame)
        self._added += 1
        if len(part) == part.max_blocks:
            part.flush()  # a run complete (the first blocks'): decoded while later copies land

    def copied(self) -> int:
        """As ``BatchDecoder.copied``: frames copied off their memory, counted in order."""
        done = 0
        for _, part in self._parts:
            got = part.copied()
            done += got
            if got < part.max_blocks:
                break
        return min(done, self._added)

    def finish(self, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if self._added == 0:
            raise RuntimeError("MixedDecoder.finish: no frames were added")
        for _, part in self._parts:
            if len(part):
                part.finish(wait=False)
        if wait:
            self.wait()
        tokens = self._added * self.block_tokens
        if self._added == self.max_blocks:
            return self._k, self._v
        return self._k[:, :, :tokens], self._v[:, :, :tokens]

    def wait(self) -> None:
        for _, part in self._parts:
            part.wait()

    def close(self) -> None:
        """``BatchDecoder.close`` of every part (all of them, even if one raises)."""
        error: BaseException | None = None
        for _, part in self._parts:
            try:
                part.close()
            except BaseException as exc:  # noqa: BLE001 - the others must still be closed
                error = error or exc
        if error is not None:
            raise error


def make_decoder(fmt: BlockFormat, max_blocks: int, device: torch.device, *, first_position: int = 0,
                 chunk_blocks: int = 8) -> BatchDecoder | MixedDecoder:
    """The decoder of blocks ``first_position..`` of a chain in ``fmt`` (into [L, H, n*B, D])."""
    if fmt.uniform:
        return BatchDecoder(fmt, max_blocks, device, chunk_blocks=chunk_blocks)
    return MixedDecoder(fmt, max_blocks, device, first_position=first_position, chunk_blocks=chunk_blocks)


def decode_frames(fmt: BlockFormat, frames: Sequence[BlockFrame],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode n consecutive blocks (a chain's, from its first) into K and V of shape
    [L, H, n*B, D] on ``device``."""
    decoder = make_decoder(fmt, len(frames), device)
    try:
        for frame in frames:
            decoder.add(frame)
        return decoder.finish()
    finally:
        decoder.close()


__all__ = ["BatchDecoder", "MixedDecoder", "decode_frames", "make_decoder"]
