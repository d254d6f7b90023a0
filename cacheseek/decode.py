"""Block frames -> KV on the target device: ``BatchDecoder``, the materialize path shared by
PrefixCache and RemoteCache.

The payloads of n blocks land in one device staging buffer at a fixed stride (one copy per
block, host-to-device when they come from host memory), are viewed as [n, L, H, ...] with
``as_strided``, and one codec call decodes them straight into the [L, H, n*B, D] outputs.
Full-precision KV is only ever built on the target device. The staging buffer is leased
from the device's pool (``store.device_staging``) at the first frame copied into it and given
back once the last decode is queued (``finish``), or by ``close`` on any path: a decoder is
closed in a ``finally`` (``decode_frames`` does). On the host, a frame whose buffers are
aligned is decoded from its own bytes, so a materialize of such frames leases none.

Under a precision policy (``BlockFormat.policy``) a chain mixes codecs by position: the
decoder lays each codec's run of positions out in the same staging buffer (one lease, rows
at that codec's stride) and cuts each chunk's decode where the codec changes, so a policy
costs an extra launch per codec change, not extra staging, streams or host work per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .block_format import BlockFormat
from .errors import FrameError
from .quant.policy import single_codec
from .quant.tensors import TORCH_DTYPES
from .staging import payload_views, staging_stride
from .store.device import as_host_tensor, copy_entry
from .store.device_staging import StagingLease, staging_pool
from .store.frame import FrameMeta
from .store.streams import current_stream, on_stream, work_stream
from .store.tier import BlockFrame


@dataclass(slots=True)
class _Run:
    """Blocks ``[j0, j1)`` of a decoder, of one codec: their staging rows and the codec's
    buffers over them (``[j1 - j0, ...]`` views), made at the decoder's first frame."""

    j0: int
    j1: int
    fmt: BlockFormat
    tensors: tuple = ()  # the frames' payload layout (every frame of the run must have it)
    payload_nbytes: int = 0
    rows: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)


class BatchDecoder:
    """Decodes up to ``max_blocks`` consecutive blocks into [L, H, n*B, D] K and V on ``device``.

    ``add`` starts a frame's copy into a staging buffer at once. On a GPU the copies run on
    a side stream and every ``chunk_blocks`` blocks are decoded as soon as they have landed,
    so decoding overlaps the transfer of the next blocks; ``finish`` decodes the rest.
    The host's work per block is a copy launch: the staging views are made once, and each
    chunk costs one codec call (one per codec in it, under a precision policy).
    """

    def __init__(self, fmt: BlockFormat, max_blocks: int, device: torch.device, *, chunk_blocks: int = 8,
                 sink: Any = None, first_position: int = 0) -> None:
        """``sink(j0, j1, buffers)``: decodes blocks ``[j0, j1)`` (``buffers``: the codec's
        buffers as ``[j1 - j0, L, H, ...]`` staging views) where the caller wants them, e.g.
        into an engine's pages; then ``finish`` returns nothing. Default: into [L, H, n*B, D].
        ``first_position``: the chain position of the first block (under a precision
        policy, the codec of each block depends on it)."""
        if sink is not None and not fmt.uniform:
            raise RuntimeError("BatchDecoder: a sink takes blocks of one codec, not a precision policy's")
        self._sink = sink
        self.codec, self.layout, self.block_tokens = fmt.codec, fmt.layout, fmt.block_tokens
        self.max_blocks, self.device = max_blocks, device
        self._runs = [_Run(a - first_position, b - first_position, fmt.at(a))
                      for a, b in fmt.segments(first_position, first_position + max_blocks)]
        # The run of each block (a list index per add, not a search).
        self._run_of = [r for r, run in enumerate(self._runs) for _ in range(run.j1 - run.j0)]
        self._copy_stream = work_stream("to_device", device) if device.type == "cuda" else None
        self._chunk = chunk_blocks
        self._meta0: FrameMeta | None = None
        # The staging buffer's, from the first frame that needs it (_take_staging) until finish or close.
        self._lease: StagingLease | None = None
        self._released = False  # finish or close gave the staging back (or would have): no more adds
        self._staging: torch.Tensor | None = None  # (one codec: its rows [max_blocks, stride])
        self._views: list[torch.Tensor] = []  # (one codec: its buffers over every staging row)
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
        """``_plan`` and ``_take_staging``: the first frame of a decoder that stages them all."""
        self._plan(meta)
        self._take_staging()

    def _plan(self, meta: FrameMeta) -> None:
        """The payload layout of every codec run (the first run's like ``meta``, the first
        frame's), checked against the codec."""
        L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
        first = self._runs[0]
        template = single_codec(first.fmt.codec).template((first.j1 - first.j0, L, H, B, D), self.layout.dtype)
        for (name, spec, _), entry in zip(template.named_buffers(), meta.tensors, strict=True):
            if entry.name != name or entry.dtype != spec.dtype or (first.j1 - first.j0, *entry.shape) != spec.shape:
                raise FrameError(f"frame buffer {entry.name} does not match the codec's {name}")
        first.tensors, first.payload_nbytes = meta.tensors, meta.payload_nbytes
        for run in self._runs[1:]:
            planned = run.fmt.planned_payload()
            run.tensors, run.payload_nbytes = planned.tensors, planned.payload_nbytes
        self._meta0 = meta

    def _take_staging(self) -> None:
        """Lease the staging and lay every run's rows out in it (one lease, each run's rows at
        its codec's stride): at the first frame that is copied into staging."""
        shapes = [(run.j1 - run.j0, staging_stride(run.payload_nbytes)) for run in self._runs]
        # Taken for the current stream (the decodes'); the copies run on the copy stream,
        # after it (the wait below).
        self._lease = staging_pool(self.device).take(sum(n * stride for n, stride in shapes))
        for run, rows, (n, stride) in zip(self._runs, self._lease.row_blocks(shapes), shapes):
            run.rows, run.views = rows, payload_views(rows, run.tensors, n, stride)
        self._staging, self._views = self._runs[0].rows, self._runs[0].views
        if self._copy_stream is not None:
            self._lease.used_on(self._copy_stream)
            self._copy_stream.wait_stream(current_stream(self.device))

    def add(self, frame: BlockFrame) -> None:
        j = len(self._frames)
        if j >= self.max_blocks:
            raise RuntimeError(f"BatchDecoder holds {self.max_blocks} blocks already")
        if self._released:
            raise RuntimeError("BatchDecoder.add after finish or close (its staging was given back)")
        if self._meta0 is None:
            self._plan(frame.meta)
        run = self._runs[self._run_of[j]]
        if frame.meta.tensors != run.tensors:
            raise FrameError("frames of one chain disagree on their payload layout")
        if self._host_decode(j, run, frame):
            self._frames.append(frame)
            return
        if self._lease is None:
            # Taken here, not at the first frame: on the host, frames decoded from their own
            # bytes never need it (a GPU's first frame is copied, so it is taken at once).
            self._take_staging()
        assert run.rows is not None  # laid out by _take_staging, kept until the staging is released
        dst = run.rows[j - run.j0]
        if self._copy_stream is None:
            self._copy(frame, dst)
        else:
            with on_stream(self._copy_stream):
                self._copy(frame, dst)
                landed = torch.cuda.Event()
                landed.record(self._copy_stream)
                self._copied_events.append(landed)
        self._frames.append(frame)
        pending, left = j + 1 - self._decoded, self.max_blocks - j - 1
        # Near the end, smaller chunks: the decode of the last one is not hidden behind copies.
        if pending >= self._chunk or pending >= self._chunk // 2 and left < self._chunk:
            self._decode_pending()

    def _host_decode(self, j: int, run: _Run, frame: BlockFrame) -> bool:
        """On the host (no sink), decode frame ``j`` from its own bytes into its block of
        K and V now, and say so: copying it into staging first would be a second pass over
        its bytes (for Raw, the whole KV once more) for nothing. False, staging it, where
        earlier frames wait in staging, or its buffers are not aligned for their dtypes."""
        if self._sink is not None or self._copy_stream is not None or self.device.type != "cpu" \
                or self._decoded != j or frame.device_entries is not None:
            return False
        if frame.device_payload is not None:
            payload = frame.device_payload
            if payload.device.type != "cpu":
                return False
        else:
            payload = as_host_tensor(frame.payload_view())
        base = payload.data_ptr()
        buffers = []
        for e in run.tensors:
            dtype = TORCH_DTYPES[e.dtype]
            if (base + e.offset) % dtype.itemsize:
                return False
            buffers.append(payload[e.offset : e.offset + e.nbytes].view(dtype).view(1, *e.shape))
        k_blocks, v_blocks = self._outputs()
        single_codec(run.fmt.codec).decode_buffers(buffers, (k_blocks[j : j + 1], v_blocks[j : j + 1]))
        self._decoded = j + 1
        return True

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
            dst[: frame.meta.payload_nbytes].copy_(frame.device_payload, non_blocking=True)
        elif frame.device_entries is not None:
            for entry, src in zip(frame.meta.tensors, frame.device_entries, strict=True):
                copy_entry(dst[entry.offset : entry.offset + entry.nbytes], src)
        else:
            dst[: frame.meta.payload_nbytes].copy_(as_host_tensor(frame.payload_view()), non_blocking=True)

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
            current = current_stream(self.device)
            current.wait_event(landed)
            assert self._lease is not None  # frames were added, and the staging is released only after them
            self._lease.used_on(current)  # (the stream it was taken for, unless the caller switched)
        if self._sink is not None:
            self._sink(j0, j1, [v[j0:j1] for v in self._views])
            self._decoded = j1
            return
        k_blocks, v_blocks = self._outputs()
        for run in self._runs:  # one for a codec; under a policy, the chunk is cut where it changes
            a, b = max(j0, run.j0), min(j1, run.j1)
            if a >= b:
                continue
            # (The views were checked against the codec's template at _start.)
            single_codec(run.fmt.codec).decode_buffers([v[a - run.j0 : b - run.j0] for v in run.views],
                                         (k_blocks[a:b], v_blocks[a:b]))
        self._decoded = j1

    def _outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V's blocks, [n, L, H, B, D] views of [L, H, n*B, D] made at the first decode
        (so that the first copy starts sooner)."""
        if self._k is None:
            L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
            self._k = torch.empty((L, H, self.max_blocks * B, D), dtype=self.layout.torch_dtype, device=self.device)
            self._v = torch.empty_like(self._k)
            as_blocks = (L, H, self.max_blocks, B, D)
            self._k_blocks = self._k.view(as_blocks).permute(2, 0, 1, 3, 4)
            self._v_blocks = self._v.view(as_blocks).permute(2, 0, 1, 3, 4)
        return self._k_blocks, self._v_blocks

    def finish(self, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
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
        if self._sink is not None:
            return None, None
        k, v = self._k, self._v
        assert k is not None and v is not None  # made by the first decode, which _decode_pending ran
        tokens = n * self.block_tokens
        if n == self.max_blocks:
            return k, v
        return k[:, :, :tokens], v[:, :, :tokens]

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
        self._released = True
        lease = self._lease
        if lease is not None:
            self._lease = None
            self._staging, self._views = None, []
            for run in self._runs:
                run.rows, run.views = None, []
            lease.release()


def decode_frames(fmt: BlockFormat, frames: Sequence[BlockFrame],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode n consecutive blocks (a chain's, from its first) into K and V of shape
    [L, H, n*B, D] on ``device``."""
    decoder = BatchDecoder(fmt, len(frames), device)
    try:
        for frame in frames:
            decoder.add(frame)
        k, v = decoder.finish()
        assert k is not None and v is not None  # (no sink: decoded into K and V)
        return k, v
    finally:
        decoder.close()


__all__ = ["BatchDecoder", "decode_frames"]
