"""KIVI in plain torch: the specification the Triton kernels must match, on any device.

Quantize, along ``axis`` of ``x`` in groups of ``group`` elements (the last may be ragged):

    mn, mx  = group min / max                           (fp32)
    scale   = (mx - mn) / (2^bits - 1)                  (fp32, IEEE division)
    s, m    = scale, mn rounded to stats_dtype          (what is stored)
    code    = clamp(round_half_even((x - m) / s), 0, 2^bits - 1)    if s > 0 else 0
    x_hat   = code * s + m

Codes are packed little-endian into int32 words along ``axis``: element j of a word sits in
bits [j*bits, (j+1)*bits). A constant group stores s = 0 and decodes exactly to m.

With ``clip`` = c > 0 (V only: the codec's ``v_clip``), the encoder tries c + 1 ranges per
group and stores the one whose decode has the least squared error; decoding is unchanged:

    range 0 = [mn, mx] (as above); range i = 1..c: d = (mx - mn) * f_i, [mn + d, mx - d]
    f_i     = float32(i * CLIP_STEP)          (each step shrinks the range by 2 * 2.5%)
    s_i, m_i, codes_i, x_hat_i as above, from range i's low end and (hi - lo) / (2^bits - 1)
    err_i   = sum over the group's real elements of float64(x_hat_i - x)^2   (fp32 difference)
    kept    = the first i with the least err_i; range 0 if s_0 or m_0 is not finite

Values beyond a shrunk range clamp to its end codes. The fp64 sum makes the choice the same
whatever order an implementation adds in, except where two ranges' errors agree to ~1e-15.

A group whose own range the stats cannot hold (s_0 or m_0 Inf: a min below fp16's -65504,
say) keeps range 0, so it is rejected as without the search: a shrunk range may fit, but
would clamp the values the stats cannot reach to it, and whether a group is stored would
then depend on ``clip`` and on how far the group reaches.
"""

from __future__ import annotations

import torch

CLIP_STEP = 0.025  # each end of a group's range moves in by this share of it per clip step
MAX_CLIP = 6


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_word = 32 // bits
    *lead, n = codes.shape
    c = codes.reshape(*lead, n // per_word, per_word).to(torch.int64)
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    # Fold into the int32 range (two's complement) before narrowing.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def _unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _plus_zero(t: torch.Tensor) -> torch.Tensor:
    """Zero's sign made canonical (+0), as the kernels do (-0 + +0 is +0): which of -0.0 and
    +0.0 a min/max reduction returns depends on its order, and the stored bytes must not."""
    return t + 0.0


def _codes_for(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: int, stats_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, stored scale, stored min) of groups ``g`` [..., n, G] over ranges [lo, hi]."""
    # A tensor divisor: torch divides by a Python scalar through its reciprocal on CUDA,
    # which is not the IEEE quotient the codec specifies (and the CPU computes).
    scale_s = ((hi - lo) / torch.full_like(hi, qmax)).to(stats_dtype)
    mn_s = lo.to(stats_dtype)
    s = scale_s.float().unsqueeze(-1)
    m = mn_s.float().unsqueeze(-1)
    positive = s > 0
    codes = torch.round((g - m) / torch.where(positive, s, torch.ones_like(s))).clamp_(0, qmax)
    codes = torch.where(positive, codes, torch.zeros_like(codes))
    codes = torch.nan_to_num_(codes, nan=0.0)  # garbage in is rejected by the caller's check
    return codes, scale_s, mn_s


def quantize(
    x: torch.Tensor, *, bits: int, group: int, axis: int, stats_dtype: torch.dtype, clip: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return contiguous ``(qdata int32, scale, min)`` on ``x``'s device; ``clip``: the
    range search above (0: off)."""
    if not 0 <= clip <= MAX_CLIP:
        raise ValueError(f"clip: must be 0 to {MAX_CLIP}, got {clip!r}")
    if clip and axis not in (-1, x.dim() - 1):
        raise ValueError("clip: only V (axis=-1, groups of channels) has a range search")
    xt = x.movedim(axis, -1).float()
    *lead, n = xt.shape
    ngroups = -(-n // group)
    pad = ngroups * group - n
    if pad:
        # Replicating the last element leaves the ragged group's min and max unchanged.
        xt = torch.cat([xt, xt[..., -1:].expand(*lead, pad)], dim=-1)
    g = xt.reshape(*lead, ngroups, group)
    mn = _plus_zero(g.amin(-1))
    mx = _plus_zero(g.amax(-1))
    qmax = (1 << bits) - 1
    codes, scale_s, mn_s = _codes_for(g, mn, mx, qmax, stats_dtype)
    if clip:
        real = torch.arange(ngroups * group, device=g.device).reshape(ngroups, group) < n  # not padding

        def error(codes, scale_s, mn_s):
            diff = codes * scale_s.float().unsqueeze(-1) + mn_s.float().unsqueeze(-1) - g
            return torch.where(real, diff.double().square(), 0.0).sum(-1)

        err = error(codes, scale_s, mn_s)
        held = torch.isfinite(scale_s) & torch.isfinite(mn_s)  # range 0 fits the stats (else rejected)
        width = mx - mn
        for i in range(1, clip + 1):
            d = width * torch.tensor(i * CLIP_STEP, dtype=torch.float32, device=g.device)
            c_i, s_i, m_i = _codes_for(g, mn + d, mx - d, qmax, stats_dtype)
            e_i = error(c_i, s_i, m_i)
            better = (e_i < err) & held
            codes = torch.where(better.unsqueeze(-1), c_i, codes)
            scale_s, mn_s = torch.where(better, s_i, scale_s), torch.where(better, m_i, mn_s)
            err = torch.where(better, e_i, err)
    codes = codes.reshape(*lead, ngroups * group)[..., :n]
    q = _pack_last(codes, bits)
    return (
        q.movedim(-1, axis).contiguous(),
        scale_s.movedim(-1, axis).contiguous(),
        mn_s.movedim(-1, axis).contiguous(),
    )


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor,
    *,
    bits: int,
    group: int,
    axis: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild ``x_hat`` of ``shape`` and ``dtype`` on the buffers' device (or into ``out``)."""
    n = shape[axis]
    codes = _unpack_last(q.movedim(axis, -1), bits).float()
    s = scale.movedim(axis, -1).float().repeat_interleave(group, dim=-1)[..., :n]
    m = mn.movedim(axis, -1).float().repeat_interleave(group, dim=-1)[..., :n]
    x = codes * s + m
    # A group holding the dtype's max may store a scale rounded up, and code * s + m then
    # passes the max by a fraction: capped, not cast (fp16, bf16) or added (fp32) to Inf.
    # Only the top: code * s >= 0, so x >= m, the group's stored min, which is finite.
    x = x.clamp_(max=torch.finfo(dtype).max)  # (x is a new tensor: no second one)
    x = x.to(dtype).movedim(-1, axis)
    if out is None:
        return x.contiguous()
    out.copy_(x)
    return out
