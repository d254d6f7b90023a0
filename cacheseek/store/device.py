"""Frames on devices (torch side): device buffers into host frames, host frames onto devices.

Only embedded mode comes here; the server's tiers never import torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..quant.tensors import host_view
from .device_staging import is_staging
from .frame import header_prefix, seal_frame
from .streams import current_stream, on_stream, work_stream
from .tier import BlockFrame, Reservation


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def copy_entry(dst: torch.Tensor, src: Any) -> None:
    """Copy one payload buffer into the uint8 range ``dst``, non-blocking.

    ``src`` is a tensor, or a list of tensors laid end to end (the Raw codec hands over
    per-layer slices of the caller's KV this way, so nothing is staged on the device)."""
    if isinstance(src, (list, tuple)):
        offset = 0
        for piece in src:
            n = piece.numel() * piece.element_size()
            dst[offset : offset + n].view(piece.dtype).view(piece.shape).copy_(piece, non_blocking=True)
            offset += n
        if offset != dst.numel():
            raise RuntimeError(f"buffer pieces hold {offset} bytes, the entry needs {dst.numel()}")
        return
    src = _bytes_of(src)
    if src.numel() != dst.numel():
        raise RuntimeError(f"device buffer holds {src.numel()} bytes, the entry needs {dst.numel()}")
    dst.copy_(src, non_blocking=True)


def _devices(src: Any) -> list[torch.device]:
    return [p.device for p in src] if isinstance(src, (list, tuple)) else [src.device]


def _host_tensor(view: memoryview) -> torch.Tensor:
    if not view.readonly:
        return torch.frombuffer(view, dtype=torch.uint8)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer on read-only views
        return torch.frombuffer(view, dtype=torch.uint8)


class HostCopies:
    """Copies of frames' device payloads into host views, on each device's to-host stream.

    :meth:`add` starts a frame's copies at once (host-resident sources are copied before
    it returns), after the work already queued on the current stream (which made the
    payloads), and keeps the payloads' memory from reuse until they are done, whoever
    frees it. :meth:`issue` marks the copies started so far with an event per device. A
    host view filled this way must not be read, freed or reused before :meth:`wait`
    returns (``wait`` raises whatever error the copies hit)."""

    __slots__ = ("_events", "_synced", "_unmarked")

    def __init__(self) -> None:
        self._synced: set[torch.device] = set()  # devices whose to-host stream waited for the caller's
        self._unmarked: set[torch.device] = set()  # devices with copies after their last event
        self._events: list[torch.cuda.Event] = []

    def add(self, frame: BlockFrame, view: memoryview, host: torch.Tensor | None = None) -> None:
        """Start copying ``frame``'s payload into ``view`` (``host``: the same bytes as a
        uint8 tensor, if the caller has one)."""
        meta = frame.meta
        dst = host if host is not None else _host_tensor(view)
        base = meta.payload_offset
        if frame.device_payload is not None:
            pairs = [(dst[base : base + meta.payload_nbytes], frame.device_payload)]
        elif frame.device_entries is not None:
            pairs = [(dst[base + e.offset : base + e.offset + e.nbytes], src)
                     for e, src in zip(meta.tensors, frame.device_entries, strict=True)]
        else:
            raise RuntimeError("frame has neither host bytes nor device buffers")
        started: list[torch.cuda.Stream] = []
        for target, src in pairs:
            device = _devices(src)[0]
            if device.type != "cuda":
                copy_entry(target, src)
                continue
            stream = work_stream("to_host", device)
            if device not in self._synced:
                stream.wait_stream(current_stream(device))  # the payloads were made there
                self._synced.add(device)
            try:
                with on_stream(stream):
                    copy_entry(target, src)
            except BaseException:
                # A bad buffer (or a list of pieces that does not fill its entry) after copies
                # into this view have started: the caller frees the view at once, so they
                # must have run first.
                for s in (*started, stream):
                    with contextlib.suppress(Exception):
                        s.synchronize()
                raise
            started.append(stream)
            # These stay on record_stream: a payload here may be a plain tensor its owner
            # frees at any time (the caller's KV slices, ``encode_blocks``'s frames, a GPU
            # tier's record being evicted), and only the allocator can hold its memory until
            # this stream is done. A leased staging buffer (``device_staging``) is held by
            # its lease instead: its holder names this stream at the release.
            for piece in src if isinstance(src, (list, tuple)) else [src]:
                piece.record_stream(stream)
            self._unmarked.add(device)

    def issue(self) -> None:
        """Mark the copies started so far."""
        for device in self._unmarked:
            event = torch.cuda.Event()
            event.record(work_stream("to_host", device))
            self._events.append(event)
        self._unmarked.clear()

    def done(self) -> bool:
        return not self._unmarked and all(e.query() for e in self._events)

    def wait(self) -> None:
        self.issue()
        for e in self._events:
            e.synchronize()


def copy_payloads_to_host(work: list[tuple[BlockFrame, memoryview]]) -> None:
    """Copy several frames' payloads to their host views: all copies in flight at once,
    then one wait."""
    copies = HostCopies()
    for frame, view in work:
        copies.add(frame, view)
    copies.wait()


def frame_to_host(frame: BlockFrame) -> BlockFrame:
    """A sealed host copy of a frame whose bytes live on a device."""
    return frames_to_host([frame])[0]


def frames_to_host(frames: list[BlockFrame], *, take: Callable[[int], memoryview] | None = None,
                   seal: bool = True) -> list[BlockFrame]:
    """Host copies of ``frames`` (those in host memory already as they are): every copy in
    flight at once, then one wait. ``take(nbytes)``: the memory a frame is copied into
    (reused buffers: a fresh allocation costs its page faults, more than the copy); by
    default a new ``bytearray``. ``seal=False``: not checksummed yet (``BlockFrame.sealed``
    False: ``wire_segments`` checksums it as it is sent)."""
    outs = [None if f.host is not None else take(f.meta.nbytes) if take else memoryview(bytearray(f.meta.nbytes))
            for f in frames]
    work = []
    for frame, out in zip(frames, outs):
        if out is not None:
            out[: frame.meta.payload_offset] = header_prefix(frame.meta)
            work.append((frame, out))
    copy_payloads_to_host(work)
    return [frame if out is None else BlockFrame(seal_frame(frame.meta, out), host=out, sealed=True) if seal
            else BlockFrame(frame.meta, host=out, sealed=False) for frame, out in zip(frames, outs)]


def payload_on_device(frame: BlockFrame, device: torch.device) -> torch.Tensor:
    """The frame's payload as one uint8 tensor on ``device`` (copied only if needed)."""
    meta = frame.meta
    src = frame.device_payload
    if src is not None and src.device == device:
        # A row of an encoder's batch buffer would pin the whole batch in memory, and a
        # leased staging buffer goes back to its pool: own a copy.
        whole = src.untyped_storage().nbytes() == src.numel() and src.storage_offset() == 0
        if whole and not is_staging(src):
            return src
        if device.type == "cuda":
            # The clone reads ``src`` on this stream; a plain tensor's owner may free it
            # meanwhile, so the allocator is told (record_stream stays for those). A leased
            # staging buffer's holder marks this stream at its release.
            src.record_stream(current_stream(device))
        return src.clone()
    out = torch.empty(meta.payload_nbytes, dtype=torch.uint8, device=device)
    if frame.device_payload is not None:
        out.copy_(frame.device_payload, non_blocking=True)
    elif frame.device_entries is not None:
        for entry, src in zip(meta.tensors, frame.device_entries, strict=True):
            copy_entry(out[entry.offset : entry.offset + entry.nbytes], src)
    else:
        out.copy_(_host_tensor(frame.payload_view()), non_blocking=True)
        if device.type == "cuda":
            current_stream(device).synchronize()  # the host view may be released after return
    return out


def reservation_span(reservation: Reservation, start: int, stop: int) -> torch.Tensor:
    """Bytes ``[start, stop)`` from the start of a CPU-tier reservation as a uint8 tensor
    (pinned where the tier is); the span may run on into the reservations lent after it
    in the same run (``TieredStore.reserve_run``)."""
    if reservation.slot is None:
        raise RuntimeError("this reservation was already committed or aborted")
    return reservation.slot.torch_span(start, stop)


def as_host_tensor(buf: Any) -> torch.Tensor:
    return _host_tensor(memoryview(buf).cast("B"))


__all__ = [
    "HostCopies",
    "as_host_tensor",
    "copy_entry",
    "copy_payloads_to_host",
    "frame_to_host",
    "frames_to_host",
    "host_view",
    "payload_on_device",
    "reservation_span",
]
