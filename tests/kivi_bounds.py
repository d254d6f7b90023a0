"""Shared helpers for codec tests: the per-element error bound KIVI promises."""

from __future__ import annotations

import torch

# Half an ulp of each output dtype, relative: decoded values are rounded to it at the end.
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def group_view(x: torch.Tensor, group: int, axis: int) -> torch.Tensor:
    """x with ``axis`` split into [ngroups, group] (ragged tail padded by replication), last."""
    xt = x.movedim(axis, -1).double()
    n = xt.shape[-1]
    ng = -(-n // group)
    pad = ng * group - n
    if pad:
        xt = torch.cat([xt, xt[..., -1:].expand(*xt.shape[:-1], pad)], -1)
    return xt.reshape(*xt.shape[:-1], ng, group)


def error_bound(x, scale, mn, *, bits, group, axis, out_dtype):
    """Per-element bound on |x - decode(encode(x))|: half a step of the *stored* scale,
    plus what rounding the stats to their dtype moved the grid by, plus output rounding."""
    g = group_view(x, group, axis)
    true_min, true_max = g.amin(-1), g.amax(-1)
    s = scale.movedim(axis, -1).double()
    m = mn.movedim(axis, -1).double()
    qmax = (1 << bits) - 1
    per_group = torch.maximum(s / 2, (m - true_min).clamp(min=0))
    per_group = torch.maximum(per_group, (true_max - (m + qmax * s)).clamp(min=0))
    per_group = per_group * (1 + 1e-6) + 1e-7 * (true_max.abs() + true_min.abs())
    n = x.shape[axis]
    bound = per_group.repeat_interleave(group, -1)[..., :n].movedim(-1, axis)
    # the decoded value is rounded to out_dtype; it lies within `bound` of x
    return bound + HALF_ULP[out_dtype] * (x.double().abs() + bound) * 1.01
