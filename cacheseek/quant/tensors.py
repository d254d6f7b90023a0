"""Moving payload buffers between host bytes, host tensors and devices (torch side).

The schemas in ``payload`` are torch-free; this module is where a bytes-like buffer
becomes a tensor and back, without copying where it can avoid it.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InputError
from .payload import EncodedLayer

TORCH_DTYPES: dict[str, torch.dtype] = {
    "int32": torch.int32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

KV_TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
FP8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


POOL_FLAGS = True  # validity flags come from the pool below (False: a new tensor each)
_FLAGS: dict[tuple[int, ...], list[torch.Tensor]] = {}  # pinned flags given back, by shape
_FLAGS_LOCK = threading.Lock()
_FLAGS_KEPT = 64  # per shape


def host_flags(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """Validity flags for a kernel to clear (bool, all True), in host memory: pinned when
    ``pinned`` (a GPU kernel writes them through their mapped address). Pinned ones come
    from flags given back (:func:`give_back_flags`) where there are some: a pinned
    allocation costs the host more than the launch it serves."""
    if pinned and POOL_FLAGS:
        with _FLAGS_LOCK:
            free = _FLAGS.get(shape)
            flags = free.pop() if free else None
        if flags is not None:
            return flags.fill_(True)
    return torch.ones(shape, dtype=torch.bool, pin_memory=pinned)


def give_back_flags(flags: torch.Tensor) -> None:
    """Pinned flags (bool, host memory, not a view), read for the last time: the kernels
    that wrote them have run. The caller vouches for the pinning (``is_pinned`` can stall
    the host for milliseconds)."""
    if not POOL_FLAGS or flags.dtype != torch.bool or flags.device.type != "cpu" or flags._base is not None:
        return
    with _FLAGS_LOCK:
        free = _FLAGS.setdefault(tuple(flags.shape), [])
        if len(free) < _FLAGS_KEPT:
            free.append(flags)


def host_view(t: torch.Tensor) -> memoryview:
    """A flat byte memoryview over a contiguous CPU tensor, without copying.

    The view keeps the tensor alive. torch tensors do not export the buffer protocol
    themselves, and numpy is not a dependency, so this goes through ctypes.
    """
    if t.device.type != "cpu":
        raise ValueError(f"host_view: tensor is on {t.device}; move it to the CPU first")
    if not t.is_contiguous():
        raise ValueError("host_view: tensor must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    arr = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    arr._owner = t  # type: ignore[attr-defined]  # the memoryview holds arr, arr holds t
    return memoryview(arr).cast("B")


def as_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``buf`` (a tensor or a host bytes-like object) as a tensor of ``dtype`` and ``shape``."""
    tdtype = TORCH_DTYPES[dtype]
    if isinstance(buf, torch.Tensor):
        if buf.dtype != tdtype:
            buf = buf.view(torch.uint8).view(tdtype) if buf.is_contiguous() else buf.contiguous().view(tdtype)
        return buf.view(shape) if buf.is_contiguous() else buf.reshape(shape)
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=tdtype)
    with warnings.catch_warnings():
        # frombuffer warns on read-only buffers (bytes); we never write through these views.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=tdtype).view(shape)


def _tensors(encoded: EncodedLayer) -> list[torch.Tensor]:
    return [as_tensor(buf, spec.dtype, spec.shape) for _, spec, buf in encoded.named_buffers()]


def to_device(encoded: EncodedLayer, device: torch.device | str) -> EncodedLayer:
    """The compact buffers on ``device`` (non-blocking where the source is pinned)."""
    device = torch.device(device)
    moved = [t if t.device == device else t.to(device, non_blocking=True) for t in _tensors(encoded)]
    return encoded.with_buffers(moved)


def to_host(encoded: EncodedLayer, *, pin: bool = True) -> EncodedLayer:
    """The compact buffers as contiguous CPU tensors, ready to read when this returns.

    Device buffers are copied into pinned memory with non-blocking copies and one
    synchronization at the end; ``pin=False`` or a CPU-only build uses pageable memory.
    """
    pin = pin and torch.cuda.is_available()
    out = []
    synced: set[torch.device] = set()
    for t in _tensors(encoded):
        if t.device.type == "cpu":
            out.append(t.contiguous())
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        synced.add(t.device)
        out.append(host)
    for device in synced:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return encoded.with_buffers(out)


def check_kv(k: Any, v: Any, *, min_rank: int = 3) -> None:
    """Reject K/V pairs no codec can encode, naming what is wrong."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < min_rank:
            raise InputError(f"{name}: expected rank >= {min_rank} ([..., H, T, D]), got shape {list(t.shape)}")
        if t.dtype not in KV_TORCH_DTYPES:
            raise InputError(f"{name}: dtype must be float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, "
                             f"got {t.dtype}")
    if k.shape != v.shape:
        raise InputError(f"k and v: shapes differ, {list(k.shape)} vs {list(v.shape)}")
    if k.dtype != v.dtype:
        raise InputError(f"k and v: dtypes differ, {k.dtype} vs {v.dtype}")
    if k.device != v.device:
        raise InputError(f"k and v: devices differ, {k.device} vs {v.device}")


def check_out(out: Any, encoded: EncodedLayer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` of a decode: K and V tensors of exactly the layer's shape and dtype on the
    decode's device (a larger one took the layer by broadcasting; a wrong dtype, a cast)."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError(f"out: expected (k, v) tensors, got {type(out).__name__}")
    shape, dtype = tuple(encoded.k.shape), TORCH_DTYPES[encoded.k.dtype]
    for name, t in zip(("k", "v"), out):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"out[{name}]: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise InputError(f"out[{name}]: expected {list(shape)} {dtype} on {device}, "
                             f"got {list(t.shape)} {t.dtype} on {t.device}")
        # torch's own test, which its copies refuse on (the reference's and the kernels' way
        # to say it); the host decode writes in chunks, and each wrote over the one before.
        if torch._debug_has_internal_overlap(t) == 1:
            raise InputError(f"out[{name}]: more than one element refers to a single memory location "
                             f"(strides {list(t.stride())}: an expanded tensor?); give one of its own")
    return out[0], out[1]


def copy_into(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``srcs`` copied into ``dsts`` (any strides), each checked first to be of its source's
    shape and dtype (``copy_`` would broadcast and cast); ``ValueError`` naming ``out``
    otherwise. Returns ``dsts``: an encode's fresh buffers put where its caller wants them."""
    if len(dsts) != len(srcs):
        raise ValueError(f"out: expected {len(srcs)} buffers, got {len(dsts)}")
    for i, (dst, src) in enumerate(zip(dsts, srcs)):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"out[{i}]: expected {src.dtype} {list(src.shape)}, got {dst.dtype} {list(dst.shape)}")
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)
    return tuple(dsts)


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Exponent bits of each float dtype, seen as an integer: all ones means Inf or NaN, so a
# value is finite exactly when its bits masked stay below the mask. e4m3fn has no Inf and
# one NaN per sign, S.1111.111: its mask is every bit but the sign. torch has no arithmetic
# on the fp8 dtypes on the CPU (isfinite, equal, ...), so they always take the bit test.
_EXPONENT_MASKS = {
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7C),
}


def finite_per_block(t: torch.Tensor) -> torch.Tensor:
    """``[n]`` bools for ``t`` of shape ``[n, ...]`` (any strides): no NaN and no Inf in block
    ``i`` (the exponent-bit test of :func:`all_finite` on the CPU)."""
    dims = tuple(range(1, t.dim()))
    if (t.device.type != "cpu" and t.dtype not in FP8_TORCH_DTYPES) or t.dtype not in _EXPONENT_MASKS \
            or not t.numel():
        return torch.isfinite(t).flatten(1).all(1) if t.numel() else torch.ones(t.shape[0], dtype=torch.bool)
    int_dtype, mask = _EXPONENT_MASKS[t.dtype]
    return t.view(int_dtype).bitwise_and(mask).amax(dim=dims) < mask


def within(t: torch.Tensor, bound: float, *, dim: int | None = None) -> torch.Tensor:
    """A bool tensor (0-d, or one per index of ``dim``): every value of ``t`` lies in
    ``[-bound, bound]``, so none is NaN or Inf either (NaN reaches the min and the max)."""
    lo, hi = torch.aminmax(t) if dim is None else torch.aminmax(t.flatten(dim + 1), dim=dim + 1)
    return (lo >= -bound) & (hi <= bound)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN and no Inf in ``t`` (no host sync until it is read).

    On the CPU, reading the exponent bits as integers is several times faster than
    ``isfinite`` on half types, which go through a slow scalar path there (a view of
    another dtype of the same size keeps any strides, so a slice takes it too).
    """
    if t.device.type != "cpu" and t.dtype not in FP8_TORCH_DTYPES:
        return torch.isfinite(t).all()
    int_dtype, mask = _EXPONENT_MASKS[t.dtype]
    return t.view(int_dtype).bitwise_and(mask).max() < mask if t.numel() else torch.tensor(True, device=t.device)
