"""Leading dimensions as at most two strided levels, so one launch covers any batch view.

The store hands the kernels views, not copies: K/V of ``n`` blocks as a permuted
``[n, L, H, B, D]`` view of a ``[L, H, n*B, D]`` tensor, or payload buffers laid out at a
fixed byte stride in one device buffer. Every tensor of a call shares the leading shape
but has its own strides. Adjacent leading dims merge when they merge in *every* tensor of
the call (``stride[i] == stride[i+1] * shape[i+1]``); what is left must be at most two
levels ``(A, C)``, indexed as ``row = a * C + c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Levels:
    """Leading dims of a call as ``A`` outer x ``C`` inner rows; ``strides[k]`` is tensor
    k's ``(stride_a, stride_c)`` in elements."""

    A: int
    C: int
    strides: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return self.A * self.C


def collapse(lead: Sequence[int], tensors: Sequence[torch.Tensor]) -> Levels | None:
    """``lead`` (the leading shape every tensor shares) as <= 2 levels, or None if the
    tensors' strides need three or more."""
    nlead = len(lead)
    # Size-1 dims never move the address: drop them, whatever their stride.
    dims = [i for i in range(nlead) if lead[i] != 1]
    levels: list[tuple[int, list[int]]] = []  # (size, innermost stride per tensor), inner first
    for i in reversed(dims):
        strides = [t.stride(i) for t in tensors]
        if levels:
            size, inner = levels[-1]
            if all(s == st * size for s, st in zip(strides, inner)):
                levels[-1] = (size * lead[i], inner)
                continue
        levels.append((lead[i], strides))
    if len(levels) > 2:
        return None
    while len(levels) < 2:
        levels.append((1, [0] * len(tensors)))
    (c_size, c_strides), (a_size, a_strides) = levels
    return Levels(A=a_size, C=c_size, strides=tuple(zip(a_strides, c_strides)))


def unit_last(t: torch.Tensor) -> bool:
    """The last dim is addressable as stride 1 (a dim of size 1 has no meaningful stride)."""
    return t.shape[-1] == 1 or t.stride(-1) == 1
