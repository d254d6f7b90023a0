"""CUDA streams of the data path: one long-lived stream per purpose and device, and a scope
that makes one current and gives the caller's back.

``with on_stream(stream):`` is ``torch.cuda.stream(stream)`` without its cost: that
context manager checks and saves more than this path needs (~20 µs a use on the H200 host,
more than the copy it wraps), while this one is two ``set_stream`` calls and a lookup of
the caller's stream and device. Either way no call returns with the thread's current stream
(or device) changed, even when the work inside raises.

Where torch exposes them (CUDA builds), both go through torch's own C bindings for the
current stream and device (the ones ``torch.cuda.current_stream`` and ``set_stream`` wrap):
the Python wrappers cost 3-30 µs a call on the H200 host, depending on how busy the host
is, against under 1 µs for the bindings, and the data path asks several times per call.
``current_stream(device)`` is the same shortcut for code that needs the stream itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class _Bindings(NamedTuple):
    get_stream: Any  # device index -> (stream id, device index, device type)
    set_stream: Any  # (stream_id=, device_index=, device_type=): also makes that device current
    get_device: Any  # () -> the current device's index


def _bindings() -> _Bindings | None:
    try:
        c = torch._C
        return _Bindings(c._cuda_getCurrentStream, c._cuda_setStream, c._cuda_getDevice)
    except AttributeError:  # a CPU build, or a torch that renamed them: torch.cuda's calls
        return None


BINDINGS = _bindings()  # None: torch.cuda's Python calls (also how a benchmark measures both)

_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def work_stream(purpose: str, device: torch.device) -> torch.cuda.Stream:
    """One long-lived stream per purpose and device ("encode", "to_host", "to_device").
    Long-lived, so the caching allocator recycles the buffers made on it (a fresh stream per
    call would cudaMalloc them anew), and apart from the caller's, so this work never holds
    up the compute queued after it."""
    key = (purpose, device)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS.setdefault(key, torch.cuda.Stream(device))
    return stream


def current_stream(device: Any = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` (``device``: a ``torch.device``, an index, or None
    for the current device) for less host time."""
    calls = BINDINGS
    if calls is None:
        return torch.cuda.current_stream(device)
    if device is None:
        index = calls.get_device()
    elif isinstance(device, int):
        index = device
    elif device.type != "cuda":
        raise ValueError(f"current_stream: expected a CUDA device, got {device}")  # as torch.cuda's
    else:
        index = device.index if device.index is not None else calls.get_device()
    stream_id, index, device_type = calls.get_stream(index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=device_type)


class on_stream:  # noqa: N801 - used as a context manager, named like one
    """``with on_stream(stream):`` runs its body with ``stream`` current on its device, then
    makes the caller's stream (and device, if it was another) current again, even on error."""

    __slots__ = ("_calls", "_caller", "_device", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def __enter__(self) -> torch.cuda.Stream:
        stream = self._stream
        calls = self._calls = BINDINGS
        if calls is not None:
            current = calls.get_device()
            self._caller = calls.get_stream(stream.device_index)  # (id, device, type) to put back
            self._device = None if current == stream.device_index else current
            calls.set_stream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
            return stream
        caller = torch.cuda.current_stream()  # the current device's
        if caller.device_index == stream.device_index:
            self._caller, self._device = caller, None
        else:  # a stream of another device: that device's current stream, and ours to restore
            self._caller, self._device = torch.cuda.current_stream(stream.device), caller.device_index
        torch.cuda.set_stream(stream)  # (also makes the stream's device current)
        return stream

    def __exit__(self, *exc: object) -> None:
        caller = self._caller
        if self._calls is not None:
            self._calls.set_stream(stream_id=caller[0], device_index=caller[1], device_type=caller[2])
        else:
            torch.cuda.set_stream(caller)
        if self._device is not None:
            torch.cuda.set_device(self._device)


__all__ = ["BINDINGS", "current_stream", "on_stream", "work_stream"]
