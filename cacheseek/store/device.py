"""Frames on devices (torch side): device buffers into host frames, host frames onto devices.

Only embedded mode comes here; the server's tiers never import torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ..quant.tensors import host_view
from .frame import header_prefix, seal_frame
from .tier import BlockFrame


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


def start_payload_copy(frame: BlockFrame, view: memoryview) -> set[torch.device]:
    """Issue non-blocking copies of a frame's device payload (or per-buffer device
    tensors) into the payload area of its host ``view``; return the devices to wait on."""
    meta = frame.meta
    dst = _host_tensor(view)
    base = meta.payload_offset
    if frame.device_payload is not None:
        dst[base : base + meta.payload_nbytes].copy_(frame.device_payload, non_blocking=True)
        return {frame.device_payload.device}
    if frame.device_entries is None:
        raise RuntimeError("frame has neither host bytes nor device buffers")
    devices: set[torch.device] = set()
    for entry, src in zip(meta.tensors, frame.device_entries, strict=True):
        copy_entry(dst[base + entry.offset : base + entry.offset + entry.nbytes], src)
        devices.update(_devices(src))
    return devices


def wait_for(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def copy_payloads_to_host(work: list[tuple[BlockFrame, memoryview]]) -> None:
    """Copy several frames' payloads to their host views: all copies in flight at once,
    then one wait per device."""
    devices: set[torch.device] = set()
    for frame, view in work:
        devices |= start_payload_copy(frame, view)
    wait_for(devices)


def frame_to_host(frame: BlockFrame) -> BlockFrame:
    """A sealed host copy of a frame whose bytes live on a device."""
    if frame.host is not None:
        return frame
    out = bytearray(frame.meta.nbytes)
    view = memoryview(out)
    view[: frame.meta.payload_offset] = header_prefix(frame.meta)
    copy_payloads_to_host([(frame, view)])
    meta = seal_frame(frame.meta, out)
    return BlockFrame(meta, host=view, sealed=True)


def payload_on_device(frame: BlockFrame, device: torch.device) -> torch.Tensor:
    """The frame's payload as one uint8 tensor on ``device`` (copied only if needed)."""
    meta = frame.meta
    src = frame.device_payload
    if src is not None and src.device == device:
        # A row of an encoder's batch buffer would pin the whole batch in memory: own it.
        whole = src.untyped_storage().nbytes() == src.numel() and src.storage_offset() == 0
        return src if whole else src.clone()
    out = torch.empty(meta.payload_nbytes, dtype=torch.uint8, device=device)
    if frame.device_payload is not None:
        out.copy_(frame.device_payload, non_blocking=True)
    elif frame.device_entries is not None:
        for entry, src in zip(meta.tensors, frame.device_entries, strict=True):
            copy_entry(out[entry.offset : entry.offset + entry.nbytes], src)
    else:
        out.copy_(_host_tensor(frame.payload_view()), non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the host view may be released after return
    return out


def as_host_tensor(buf: Any) -> torch.Tensor:
    return _host_tensor(memoryview(buf).cast("B"))


__all__ = ["as_host_tensor", "copy_entry", "copy_payloads_to_host", "start_payload_copy", "wait_for", "frame_to_host", "host_view", "payload_on_device"]
