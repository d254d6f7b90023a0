"""Leading dimensions as at most two strided levels, so one launch covers any batch view.

The store hands the kernels views, not copies: K/V of ``n`` blocks as a permuted
``[n, L, H, B, D]`` view of a ``[L, H, n*B, D]`` tensor, or payload buffers laid out at a
fixed stride in one device buffer. Every tensor of a call shares the leading shape but
has its own strides. Adjacent leading dims merge when they merge in *every* tensor of
the call (``stride[i] == stride[i+1] * shape[i+1]``); what is left must be at most two
levels ``(A, C)``, indexed as ``row = a * C + c``.

Pure functions of shapes and strides (no tensors), so launch plans can be cached.
"""

from collections.abc import Sequence
from dataclasses import dataclass


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


def collapse(lead: Sequence[int], strides: Sequence[Sequence[int]]) -> Levels | None:
    """``lead`` (the leading shape every tensor shares) as <= 2 levels, given each tensor's
    strides (at least its leading ones); None if they need three or more."""
    # Size-1 dims never move the address: skip them, whatever their stride.
    levels: list[tuple[int, list[int]]] = []  # (size, innermost stride per tensor), inner first
    for i in reversed(range(len(lead))):
        if lead[i] == 1:
            continue
        dim_strides = [s[i] for s in strides]
        if levels:
            size, inner = levels[-1]
            if all(s == st * size for s, st in zip(dim_strides, inner)):
                levels[-1] = (size * lead[i], inner)
                continue
        levels.append((lead[i], dim_strides))
    if len(levels) > 2:
        return None
    while len(levels) < 2:
        levels.append((1, [0] * len(strides)))
    (c_size, c_strides), (a_size, a_strides) = levels
    return Levels(A=a_size, C=c_size, strides=tuple(zip(a_strides, c_strides)))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def unit_last(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """The last dim is addressable as stride 1 (a dim of size 1 has no meaningful stride)."""
    return shape[-1] == 1 or stride[-1] == 1


def may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a view of ``shape`` and ``stride`` may share an address (an
    expanded dim, stride 0; or strides that interleave). False only where every stride,
    smallest first, passes the span of those below it: then no two indices meet."""
    span = 0
    for st, n in sorted((abs(st), n) for st, n in zip(stride, shape) if n > 1):
        if st <= span:
            return True
        span += (n - 1) * st
    return False
