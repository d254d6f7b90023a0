"""Payloads laid out at a fixed stride in one byte buffer, seen as a codec's batched buffers.

The encoder writes n blocks into the rows of a staging buffer (or straight into a run of
CPU-tier slots), and the decoder reads n blocks out of one: either way the codec sees its
buffers as ``[n, L, H, ...]`` views over the rows, one view per buffer, whatever n is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .quant.tensors import TORCH_DTYPES
from .store.frame import TensorEntry

STAGING_ALIGN = 256  # bytes: each row starts where a device copy runs at full speed


def staging_stride(payload_nbytes: int) -> int:
    """Bytes between the rows of a staging buffer holding payloads of ``payload_nbytes``."""
    return (payload_nbytes + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN


def payload_views(buf: torch.Tensor, tensors: Sequence[TensorEntry], count: int, stride: int,
                  offset: int = 0) -> list[torch.Tensor]:
    """The buffers ``tensors`` of ``count`` payloads laid out at ``stride`` bytes in ``buf``,
    the first at byte ``offset``, as ``[count, ...]`` views (e.g. a codec's buffers in the
    rows of a staging buffer)."""
    typed: dict[torch.dtype, torch.Tensor] = {}  # one view of ``buf`` per dtype, not one per buffer
    out = []
    base = buf.storage_offset() * buf.element_size()
    for dtype, size, strides, start in _view_plan(tuple(tensors), offset, count, stride):
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buf.view(dtype)
        out.append(whole.as_strided(size, strides, base // dtype.itemsize + start))
    return out


@functools.lru_cache(maxsize=256)
def _view_plan(tensors: tuple[TensorEntry, ...], offset: int, count: int, stride: int) -> list[tuple]:
    """(dtype, size, strides, storage offset in elements) of each buffer's ``[count, ...]``
    view: worked out once per layout and count (it is most of a view's cost)."""
    plan = []
    for e in tensors:
        dtype = TORCH_DTYPES[e.dtype]
        item = dtype.itemsize
        inner = [1] * len(e.shape)
        for i in range(len(e.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * e.shape[i + 1]
        plan.append((dtype, (count, *e.shape), (stride // item, *inner), (offset + e.offset) // item))
    return plan


__all__ = ["STAGING_ALIGN", "payload_views", "staging_stride"]
