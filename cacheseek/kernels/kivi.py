"""KIVI in Triton: fused quantize+pack and unpack+dequantize, int2/int4/int8.

Computes exactly ``cacheseek.quant.kivi_reference`` (the specification), for x of shape
``[..., T, D]``, in ONE launch per call over every leading dim (layers, heads, blocks):

    mn, mx  = group min / max                                   (fp32)
    scale   = (mx - mn) / (2^bits - 1)                          (fp32, IEEE division)
    s, m    = scale, mn rounded to the stats dtype              (what is stored)
    code    = clamp(round_half_even((x - m) / s), 0, 2^bits - 1)    if s > 0 else 0
    x_hat   = code * s + m

K (``axis=-2``) groups G consecutive tokens per channel; V (``axis=-1``) groups G
consecutive channels per token, the last group possibly ragged (D=80, G=64: 64 + 16).
Codes are packed little-endian along the grouped axis into int32 words (element j of a
word in bits [j*bits, (j+1)*bits)).

The kernels are bit-identical to the reference: every division is IEEE-rounded (see
``_quotient``), rounding is exact half-to-even, and decoding is mul then add, unfused.

V's encoder can also search ``clip`` shrunk ranges per group (the codec's ``v_clip``; see
``kivi_reference``): each candidate's squared error is summed in fp64 over the group's
tile in registers, so the choice matches the reference's whatever the order of the sums.

Layers per op: private ``@triton.jit`` kernels, host launchers (``_quantize``,
``_dequantize``: checks, allocation, grid, settings), and the public ``quantize`` /
``dequantize``.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from . import configs
from ._strides import Levels, collapse, contiguous_strides, may_overlap, unit_last
from .launch import CachedLaunch, on_device
from .layers import LayerTable, check_flag, layer_row
from .paged import BlockPages, PagedLayers, block_source, check_flags, check_where, page_offsets

AXIS_TOKENS = -2  # K
AXIS_CHANNELS = -1  # V
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATS_DTYPES = (torch.float16, torch.float32)
CLIP_STEP = 0.025  # as kivi_reference.CLIP_STEP
MAX_CLIP = 6
_CLIP_STEP = tl.constexpr(CLIP_STEP)

_INF = tl.constexpr(float("inf"))
# Float <-> small integer without I2F/F2I (quarter-rate on NVIDIA GPUs) or libdevice rint
# (which the interpreter lacks): for 0 <= c < 2^22, the fp32 sum c + 1.5 * 2^23 lands
# where the ulp is 1, so the adder itself rounds c half to even, and the integer sits in
# the low mantissa bits of the sum. Conversely 2^23 + k, built from bits, minus 2^23 is k.
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23, bits 0x4B400000
_TWO23 = tl.constexpr(8388608.0)  # 2^23
_TWO23_BITS = tl.constexpr(0x4B000000)


# -- device helpers ---------------------------------------------------------------------


@triton.jit
def _minmax_operands(x, ok, MASKED: tl.constexpr):
    """What to take the group min and max of (in x's own dtype: exact, and packed fp16 min/max
    is cheaper). Masked-out lanes (``ok`` false) never win."""
    # tl.max may drop NaN where torch's amax propagates it. Mapping NaN to +inf in the max
    # operand (+-Inf need nothing) makes the scale non-finite, and the codec's isfinite
    # check on the stats rejects the input, as with the reference.
    lo = x
    hi = tl.where(x == x, x, _INF)
    if MASKED:
        lo = tl.where(ok, lo, _INF)
        hi = tl.where(ok, hi, -_INF)
    return lo, hi


@triton.jit
def _plus_zero(x):
    """Zero's sign made canonical (+0), as the reference does: which of -0.0 and +0.0 a
    min/max reduction returns depends on its order, and the stored bytes must not.
    (-0 + +0 is +0 under round-to-nearest; +0 is not an additive identity, so nothing folds it.)"""
    return x + 0.0


@triton.jit
def _scale(mn, mx, QMAX: tl.constexpr, FP16_STATS: tl.constexpr):
    """scale = (mx - mn) / (2^bits - 1), IEEE-rounded like torch's division.

    One division per group, so div_rn costs nothing measurable; a reciprocal-and-fma
    shortcut here disagreed with torch's scale for a few groups on the H200."""
    rng = mx - mn
    return tl.math.div_rn(rng, tl.full(rng.shape, QMAX, tl.float32))


@triton.jit
def _divisor(s, FP16_STATS: tl.constexpr):
    """Per group, from the stored scale widened to fp32: (den, rcp) for ``_quotient``."""
    pos = s > 0
    if FP16_STATS:
        # s == 0 (a constant group) or NaN (rejected input): rcp = 0 makes every code 0,
        # which decodes exactly to m.
        den = tl.where(pos, s, 1.0)
        rcp = tl.where(pos, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), den), 0.0)
    else:
        den = tl.where(pos, s, _INF)  # x / inf = 0: the same, for div_rn
        rcp = den
    return den, rcp


@triton.jit
def _quotient(a, den, rcp, FP16_STATS: tl.constexpr):
    """IEEE-rounded a / den (exactly div_rn's result) for finite a.

    With fp16 stats, den has at most 11 significant bits. Then q = a * rcp (rcp = 1/den
    rounded) is within 2^-23 relative of a/den, e = a - q * den is exact in one fma, and
    q + e * rcp is within 2^-47 relative of a/den before its rounding. An fp32 midpoint M
    (25 significant bits, the last one set) is never hit exactly (den * M would need 25
    significant bits, a has 24), nor approached closer than 2^-36 relative (den * M has at
    most 36 bits), so the fma rounds to RN(a / den): three ops instead of a dozen for
    div_rn's fast path, check and slow-path branch. With fp32 stats (24-bit den) that
    margin is gone, so those use div_rn.
    """
    if FP16_STATS:
        q = a * rcp
        return tl.fma(tl.fma(-q, den, a), rcp, q)
    else:
        return tl.math.div_rn(a, den)


@triton.jit
def _codes(x, m, den, rcp, QMAX: tl.constexpr, FP16_STATS: tl.constexpr):
    """int32 codes of fp32 ``x``: clamp(round_half_even((x - m) / s), 0, QMAX) (see
    ``_biased_codes``)."""
    return _biased_codes(x, m, den, rcp, QMAX, FP16_STATS) & QMAX


@triton.jit
def _biased_codes(x, m, den, rcp, QMAX: tl.constexpr, FP16_STATS: tl.constexpr):
    """int32 codes of fp32 ``x``, each plus ``_RNE_BITS``: clamp(round_half_even((x - m) /
    s), 0, QMAX) + 0x4B400000; ``m``, ``den`` and ``rcp`` already broadcast to x's shape.
    The bias is taken off once per packed word (``_word_bias``), not once per element."""
    q = _quotient(x - m, den, rcp, FP16_STATS)
    # Clamping first is the same (integer bounds, monotone rounding) and keeps the magic
    # rounding in its exact range. The code is then the low bits of the sum.
    q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    return (q + _RNE_MAGIC).to(tl.int32, bitcast=True)


def _word_bias_value(bits: int) -> int:
    """sum over the codes of a word of (_RNE_BITS << j * bits), as a signed int32: what
    packing biased codes with + adds to the word (sums wrap mod 2^32, and the fields of
    the unbiased codes do not overlap, so subtracting it leaves exactly their OR)."""
    per = 32 // bits
    total = sum(0x4B400000 << (j * bits) for j in range(per)) % (1 << 32)
    return total - (1 << 32) if total >= 1 << 31 else total



@triton.jit
def _decode(codes, s, m):
    """x_hat = code * s + m in fp32 (launched without fp fusion: rounded as torch does);
    ``codes`` int32 in [0, 2^22), ``s`` and ``m`` fp32, broadcastable."""
    c = (codes | _TWO23_BITS).to(tl.float32, bitcast=True) - _TWO23
    return c * s + m


@triton.jit
def _within(x, out_ty: tl.constexpr):
    """fp32 ``x`` capped at the largest finite value of ``out_ty``, as the torch reference
    does: a group holding the dtype's max may store a scale rounded up, and code * s + m
    then passes the max by a fraction, which the cast (fp16, bf16) or the add itself (fp32)
    makes Inf. Only the top: code * s >= 0, so x >= m, the group's stored min, which is
    finite. NaN stays NaN, as under torch.clamp (one min.NaN instruction, not a compare and
    a select)."""
    if out_ty == tl.float16:
        x = tl.minimum(x, 65504.0, propagate_nan=tl.PropagateNan.ALL)
    elif out_ty == tl.bfloat16:
        x = tl.minimum(x, 3.3895313892515355e38, propagate_nan=tl.PropagateNan.ALL)
    else:
        x = tl.minimum(x, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def _clip_error(x, s_st, m_st, ok, QMAX: tl.constexpr, FP16_STATS: tl.constexpr, MASKED: tl.constexpr):
    """Per group of V's tile ``x`` [BLOCK_T, NGP, GP] (fp32): sum of float64(decode(codes)
    - x)^2 over the real lanes, for stored stats ``s_st``, ``m_st`` [BLOCK_T, NGP]."""
    den, rcp = _divisor(s_st.to(tl.float32), FP16_STATS)
    s_b = tl.broadcast_to(s_st.to(tl.float32)[:, :, None], x.shape)
    m_b = tl.broadcast_to(m_st.to(tl.float32)[:, :, None], x.shape)
    codes = _codes(x, m_b, tl.broadcast_to(den[:, :, None], x.shape), tl.broadcast_to(rcp[:, :, None], x.shape),
                   QMAX, FP16_STATS)
    diff = (_decode(codes, s_b, m_b) - x).to(tl.float64)
    sq = diff * diff
    if MASKED:
        sq = tl.where(ok, sq, 0.0)
    return tl.sum(sq, axis=2)


@triton.jit
def _flag_if_nonfinite(s, m, ok, bad_addr, MASKED: tl.constexpr):
    """Store a 0 (not finite) at host address ``bad_addr`` if a stored scale or min among
    the valid lanes is NaN or Inf, as NaN/Inf inputs and ranges beyond the stats dtype
    leave them. The host reads it after the launch's event, with no copy and no extra
    launch; programs that find nothing write nothing."""
    sf = s.to(tl.float32)
    mf = m.to(tl.float32)
    bad = ((sf - sf) != 0.0) | ((mf - mf) != 0.0)  # inf - inf and nan - nan are nan
    if MASKED:
        bad = bad & ok
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(bad_addr.to(tl.pointer_type(tl.int8)), 0)


@triton.jit
def _round_to_bf16(x):
    """fp32 ``x`` rounded half-to-even to bf16 precision, still fp32. Only for the
    interpreter, whose fp32 -> bf16 cast truncates (GPUs round to nearest even)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def _k_masked(args) -> bool:
    return args["D"] % args["BLOCK_D"] != 0 or (args["T"] // args["G"]) % args["GROUPS"] != 0


def _v_masked(args) -> bool:
    return args["D"] != args["D_PAD"] or args["T"] % args["BLOCK_T"] != 0


# -- K: groups of G tokens per channel ---------------------------------------------------
# A program owns GROUPS consecutive token groups of one row and BLOCK_D channels. For a
# group, the NW int32 words per channel are rows w of a [NW, BLOCK_D] tile, and code j of
# word w is token w * PER + j. So the kernel walks j = 0..PER-1 over [NW, BLOCK_D] tiles
# of x (rows w * PER + j, contiguous along D: 16-byte vector loads): the min/max over j
# and the packing into words are elementwise in registers, and only the min/max over the
# NW rows of a group is a (small) reduction across threads. Each tile is read twice, once
# for the stats and once for the codes; the second read hits L1/L2, not HBM.


@triton.heuristics({"MASKED": _k_masked})
@triton.jit
def _quantize_k_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, xt_ptr, bad_addr, pt_ptr, blk_ptr,
    C, T, D, XH,
    sx_a, sx_c, sx_t,
    sq_a, sq_c, sq_t,
    ss_a, ss_c, ss_t,
    sx_p,
    BITS: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr,
    X_TABLE: tl.constexpr, X_ALIGN: tl.constexpr, CHECK: tl.constexpr, PAGE: tl.constexpr, PAGE_WORDS: tl.constexpr,
    MASKED: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    NW: tl.constexpr = G // PER
    QMAX: tl.constexpr = (1 << BITS) - 1
    FP16_STATS: tl.constexpr = s_ptr.dtype.element_ty == tl.float16 if _FMA_ROUNDS_ONCE else False  # (_quotient)
    # Elementwise min/max in x's dtype (exact, packed for fp16); bf16 goes through fp32
    # (also exact) since the interpreter compares bf16 wrongly.
    MM_DTYPE: tl.constexpr = tl.float32 if x_ptr.dtype.element_ty == tl.bfloat16 else x_ptr.dtype.element_ty

    pid = tl.program_id(0)
    n_groups = T // G
    n_d = tl.cdiv(D, BLOCK_D)
    n_t = tl.cdiv(n_groups, GROUPS)
    d_tile = pid % n_d
    t_tile = (pid // n_d) % n_t
    row = pid // (n_d * n_t)
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)

    d = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    w = tl.arange(0, NW).to(tl.int64)
    x_row = layer_row(x_ptr, xt_ptr, a, c, XH, sx_a, sx_c, X_TABLE, X_ALIGN)
    q_row = q_ptr + a * sq_a + c * sq_c
    stat_row = a * ss_a + c * ss_c
    # In pages (PAGE > 0: the page size), block a's tokens are found through its page table.
    pt_base, pt_off, bad_addr = block_source(blk_ptr, a, bad_addr, PAGE)

    for i in range(GROUPS):
        grp = (t_tile * GROUPS + i).to(tl.int64)
        d_ok = d < tl.where(grp < n_groups, D, 0)
        ok = tl.broadcast_to(d_ok[None, :], (NW, BLOCK_D))
        tok = grp * G + w[:, None] * PER  # token j = 0 of each word
        if PAGE > 0:
            x_ptrs = x_row + page_offsets(tok, T, sx_t, sx_p, pt_ptr, pt_base, pt_off, PAGE) + d[None, :]
        else:
            x_ptrs = x_row + tok * sx_t + d[None, :]

        if MASKED:
            x = tl.load(x_ptrs, mask=ok, other=0.0)
        else:
            x = tl.load(x_ptrs)
        lo, hi = _minmax_operands(x.to(MM_DTYPE), ok, MASKED)
        for j in tl.static_range(1, PER):
            if PAGE > 0 and not PAGE_WORDS:
                x_j = x_row + page_offsets(tok + j, T, sx_t, sx_p, pt_ptr, pt_base, pt_off, PAGE) + d[None, :]
            else:  # (PAGE_WORDS: a word's tokens are consecutive slots of one page)
                x_j = x_ptrs + j * sx_t
            if MASKED:
                x = tl.load(x_j, mask=ok, other=0.0)
            else:
                x = tl.load(x_j)
            l, h = _minmax_operands(x.to(MM_DTYPE), ok, MASKED)
            lo = tl.minimum(lo, l)
            hi = tl.maximum(hi, h)
        mn = _plus_zero(tl.min(lo, axis=0).to(tl.float32))  # [BLOCK_D]
        scale = _scale(mn, _plus_zero(tl.max(hi, axis=0).to(tl.float32)), QMAX, FP16_STATS)
        s_st = scale.to(s_ptr.dtype.element_ty)  # the codes are computed from these stored values
        m_st = mn.to(m_ptr.dtype.element_ty)
        if CHECK:
            _flag_if_nonfinite(s_st, m_st, d_ok, bad_addr, MASKED)
        den, rcp = _divisor(s_st.to(tl.float32), FP16_STATS)
        m_b = tl.broadcast_to(m_st.to(tl.float32)[None, :], (NW, BLOCK_D))
        den_b = tl.broadcast_to(den[None, :], (NW, BLOCK_D))
        rcp_b = tl.broadcast_to(rcp[None, :], (NW, BLOCK_D))

        words = tl.zeros((NW, BLOCK_D), tl.int32)
        for j in tl.static_range(PER):
            if PAGE > 0 and not PAGE_WORDS:
                x_j = x_row + page_offsets(tok + j, T, sx_t, sx_p, pt_ptr, pt_base, pt_off, PAGE) + d[None, :]
            else:  # (PAGE_WORDS: a word's tokens are consecutive slots of one page)
                x_j = x_ptrs + j * sx_t
            if MASKED:
                x = tl.load(x_j, mask=ok, other=0.0)
            else:
                x = tl.load(x_j)
            # Bit fields do not overlap: OR them in (the top field of an 8- or 2-bit word
            # reaches the sign bit, which int32 two's complement keeps exact). (Adding biased
            # codes instead, as V does, saves an AND per element but costs K registers.)
            words = words | (_codes(x.to(tl.float32), m_b, den_b, rcp_b, QMAX, FP16_STATS) << (j * BITS))

        stat_off = stat_row + grp * ss_t + d
        q_ptrs = q_row + (grp * NW + w[:, None]) * sq_t + d[None, :]
        if MASKED:
            tl.store(s_ptr + stat_off, s_st, mask=d_ok)
            tl.store(m_ptr + stat_off, m_st, mask=d_ok)
            tl.store(q_ptrs, words, mask=ok)
        else:
            tl.store(s_ptr + stat_off, s_st)
            tl.store(m_ptr + stat_off, m_st)
            tl.store(q_ptrs, words)


@triton.heuristics({"MASKED": _k_masked})
@triton.jit
def _dequantize_k_kernel(
    q_ptr, s_ptr, m_ptr, o_ptr, ot_ptr, pt_ptr, blk_ptr,
    C, T, D, OH,
    sq_a, sq_c, sq_t,
    ss_a, ss_c, ss_t,
    sm_a, sm_c, sm_t,
    so_a, so_c, so_t,
    so_p,
    BITS: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr, GROUPS: tl.constexpr,
    SOFT_BF16: tl.constexpr, O_TABLE: tl.constexpr, O_ALIGN: tl.constexpr, PAGE: tl.constexpr,
    PAGE_WORDS: tl.constexpr, MASKED: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    NW: tl.constexpr = G // PER
    QMAX: tl.constexpr = (1 << BITS) - 1

    pid = tl.program_id(0)
    n_groups = T // G
    n_d = tl.cdiv(D, BLOCK_D)
    n_t = tl.cdiv(n_groups, GROUPS)
    d_tile = pid % n_d
    t_tile = (pid // n_d) % n_t
    row = pid // (n_d * n_t)
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)

    d = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    w = tl.arange(0, NW).to(tl.int64)
    q_row = q_ptr + a * sq_a + c * sq_c
    s_row = s_ptr + a * ss_a + c * ss_c
    m_row = m_ptr + a * sm_a + c * sm_c
    # With O_TABLE the output is a model's layers (or an engine's per-layer pages), as the
    # quantize kernels read them; with PAGE > 0, block a's tokens go where its page table says.
    o_row = layer_row(o_ptr, ot_ptr, a, c, OH, so_a, so_c, O_TABLE, O_ALIGN)
    pt_base, pt_off, _ = block_source(blk_ptr, a, 0, PAGE)

    for i in range(GROUPS):
        grp = (t_tile * GROUPS + i).to(tl.int64)
        d_ok = d < tl.where(grp < n_groups, D, 0)
        ok = tl.broadcast_to(d_ok[None, :], (NW, BLOCK_D))
        q_ptrs = q_row + (grp * NW + w[:, None]) * sq_t + d[None, :]
        if MASKED:
            words = tl.load(q_ptrs, mask=ok, other=0)
            s = tl.load(s_row + grp * ss_t + d, mask=d_ok, other=0.0).to(tl.float32)
            m = tl.load(m_row + grp * sm_t + d, mask=d_ok, other=0.0).to(tl.float32)
        else:
            words = tl.load(q_ptrs)
            s = tl.load(s_row + grp * ss_t + d).to(tl.float32)
            m = tl.load(m_row + grp * sm_t + d).to(tl.float32)
        s_b = tl.broadcast_to(s[None, :], (NW, BLOCK_D))
        m_b = tl.broadcast_to(m[None, :], (NW, BLOCK_D))
        tok = grp * G + w[:, None] * PER
        if PAGE > 0:
            o_ptrs = o_row + page_offsets(tok, T, so_t, so_p, pt_ptr, pt_base, pt_off, PAGE) + d[None, :]
        else:
            o_ptrs = o_row + tok * so_t + d[None, :]
        for j in tl.static_range(PER):
            x = _within(_decode((words >> (j * BITS)) & QMAX, s_b, m_b), o_ptr.dtype.element_ty)
            if SOFT_BF16:
                x = _round_to_bf16(x)
            x = x.to(o_ptr.dtype.element_ty)
            if PAGE > 0 and not PAGE_WORDS:
                o_j = o_row + page_offsets(tok + j, T, so_t, so_p, pt_ptr, pt_base, pt_off, PAGE) + d[None, :]
            else:  # (PAGE_WORDS: a word's tokens are consecutive slots of one page)
                o_j = o_ptrs + j * so_t
            if MASKED:
                tl.store(o_j, x, mask=ok)
            else:
                tl.store(o_j, x)


# -- V: groups of G channels per token ---------------------------------------------------
# A program owns BLOCK_T tokens of one row and the whole head dim padded to D_PAD, as a
# [BLOCK_T, NGP, GP] tile (channel = g * GP + e; GP = min(G, D_PAD) is a group's width in
# the tile): stats reduce over GP, and a reshape to [BLOCK_T, NGP, WPG, PER] packs words
# (it splits the contiguous dim, so it stays within a thread's registers).
# Lanes at channels >= D are masked, so a ragged last group only sees its real elements.
# MASKED (constexpr) is false when D == D_PAD and BLOCK_T divides T: no masks.


@triton.heuristics({"MASKED": _v_masked})
@triton.jit
def _quantize_v_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, xt_ptr, bad_addr, pt_ptr, blk_ptr,
    C, T, D, XH,
    sx_a, sx_c, sx_t,
    sq_a, sq_c, sq_t,
    ss_a, ss_c, ss_t,
    sx_p,
    BITS: tl.constexpr, GP: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    X_TABLE: tl.constexpr, X_ALIGN: tl.constexpr, CHECK: tl.constexpr, PAGE: tl.constexpr,
    X_EVICT: tl.constexpr, Q_CACHE: tl.constexpr, WORD_BIAS: tl.constexpr, CLIP: tl.constexpr, MASKED: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GP // PER
    NGP: tl.constexpr = D_PAD // GP
    QMAX: tl.constexpr = (1 << BITS) - 1
    FP16_STATS: tl.constexpr = s_ptr.dtype.element_ty == tl.float16 if _FMA_ROUNDS_ONCE else False  # (_quotient)
    # As K's kernel: bf16 goes through fp32 (exact) for the min/max, since the interpreter
    # compares bf16 wrongly (NaN == NaN held there, so a NaN in bf16 V went unflagged).
    MM_DTYPE: tl.constexpr = tl.float32 if x_ptr.dtype.element_ty == tl.bfloat16 else x_ptr.dtype.element_ty

    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    t_tile = pid % n_t
    row = pid // n_t
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)

    t = (t_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    g = tl.arange(0, NGP)
    d = g[:, None] * GP + tl.arange(0, GP)[None, :]  # [NGP, GP]
    word = g[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [NGP, WPG]: index along packed D
    t_ok = t < T
    ok = t_ok[:, None, None] & (d < D)[None, :, :]
    x_row = layer_row(x_ptr, xt_ptr, a, c, XH, sx_a, sx_c, X_TABLE, X_ALIGN)
    pt_base, pt_off, bad_addr = block_source(blk_ptr, a, bad_addr, PAGE)
    if PAGE > 0:
        x_ptrs = x_row + page_offsets(t, T, sx_t, sx_p, pt_ptr, pt_base, pt_off, PAGE)[:, None, None] + d[None, :, :]
    else:
        x_ptrs = x_row + t[:, None, None] * sx_t + d[None, :, :]
    # X_EVICT, Q_CACHE: cache hints ("" for none) the launch sweep tries (configs.candidates).
    if MASKED:
        x = tl.load(x_ptrs, mask=ok, other=0.0, eviction_policy=X_EVICT)
    else:
        x = tl.load(x_ptrs, eviction_policy=X_EVICT)

    lo, hi = _minmax_operands(x.to(MM_DTYPE), ok, MASKED)
    mn = _plus_zero(tl.min(lo, axis=2).to(tl.float32))  # [BLOCK_T, NGP]
    mx = _plus_zero(tl.max(hi, axis=2).to(tl.float32))
    scale = _scale(mn, mx, QMAX, FP16_STATS)
    s_st = scale.to(s_ptr.dtype.element_ty)  # the codes are computed from these stored values
    m_st = mn.to(m_ptr.dtype.element_ty)
    if CLIP > 0:
        # Range i: [mn + d, mx - d], d = (mx - mn) * float32(i * CLIP_STEP); keep the first
        # with the least fp64 squared error (NaN errors never win: such input is rejected).
        # A group whose own range the stats cannot hold keeps it, rejected as without the
        # search (its Inf error lost to any shrunk range that fit).
        xf = x.to(tl.float32)
        err = _clip_error(xf, s_st, m_st, ok, QMAX, FP16_STATS, MASKED)
        s0 = s_st.to(tl.float32)
        m0 = m_st.to(tl.float32)
        held = ((s0 - s0) == 0.0) & ((m0 - m0) == 0.0)  # finite: inf - inf and nan - nan are nan
        width = mx - mn
        for i in tl.static_range(1, CLIP + 1):
            dd = width * (i * _CLIP_STEP)
            lo_i = mn + dd
            s_i = _scale(lo_i, mx - dd, QMAX, FP16_STATS).to(s_ptr.dtype.element_ty)
            m_i = lo_i.to(m_ptr.dtype.element_ty)
            e_i = _clip_error(xf, s_i, m_i, ok, QMAX, FP16_STATS, MASKED)
            better = (e_i < err) & held
            s_st = tl.where(better, s_i, s_st)
            m_st = tl.where(better, m_i, m_st)
            err = tl.where(better, e_i, err)
    if CHECK:
        _flag_if_nonfinite(tl.reshape(s_st, (BLOCK_T * NGP,)), tl.reshape(m_st, (BLOCK_T * NGP,)),
                           tl.reshape(t_ok[:, None] & (g * GP < D)[None, :], (BLOCK_T * NGP,)), bad_addr, MASKED)
    den, rcp = _divisor(s_st.to(tl.float32), FP16_STATS)
    codes = _biased_codes(x.to(tl.float32),
                   tl.broadcast_to(m_st.to(tl.float32)[:, :, None], x.shape),
                   tl.broadcast_to(den[:, :, None], x.shape),
                   tl.broadcast_to(rcp[:, :, None], x.shape), QMAX, FP16_STATS)
    codes = tl.reshape(codes, (BLOCK_T, NGP, WPG, PER))
    # (sums wrap mod 2^32: less the bias, the word is the OR of the codes' fields)
    words = tl.sum(codes << (tl.arange(0, PER) * BITS)[None, None, None, :], axis=3) - WORD_BIAS  # [BLOCK_T, NGP, WPG]

    stat_off = a * ss_a + c * ss_c + t[:, None] * ss_t + g[None, :]
    q_ptrs = q_ptr + a * sq_a + c * sq_c + t[:, None, None] * sq_t + word[None, :, :]
    if MASKED:
        stat_ok = t_ok[:, None] & (g * GP < D)[None, :]
        tl.store(s_ptr + stat_off, s_st, mask=stat_ok)
        tl.store(m_ptr + stat_off, m_st, mask=stat_ok)
        tl.store(q_ptrs, words, mask=t_ok[:, None, None] & (word * PER < D)[None, :, :], cache_modifier=Q_CACHE)
    else:
        tl.store(s_ptr + stat_off, s_st)
        tl.store(m_ptr + stat_off, m_st)
        tl.store(q_ptrs, words, cache_modifier=Q_CACHE)


@triton.heuristics({"MASKED": _v_masked})
@triton.jit
def _dequantize_v_kernel(
    q_ptr, s_ptr, m_ptr, o_ptr, ot_ptr, pt_ptr, blk_ptr,
    C, T, D, OH,
    sq_a, sq_c, sq_t,
    ss_a, ss_c, ss_t,
    sm_a, sm_c, sm_t,
    so_a, so_c, so_t,
    so_p,
    BITS: tl.constexpr, GP: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SOFT_BF16: tl.constexpr, O_TABLE: tl.constexpr, O_ALIGN: tl.constexpr, PAGE: tl.constexpr,
    MASKED: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GP // PER
    NGP: tl.constexpr = D_PAD // GP
    QMAX: tl.constexpr = (1 << BITS) - 1

    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    t_tile = pid % n_t
    row = pid // n_t
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)

    t = (t_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    g = tl.arange(0, NGP)
    d = g[:, None] * GP + tl.arange(0, GP)[None, :]
    word = g[:, None] * WPG + tl.arange(0, WPG)[None, :]
    t_ok = t < T
    q_ptrs = q_ptr + a * sq_a + c * sq_c + t[:, None, None] * sq_t + word[None, :, :]
    s_ptrs = s_ptr + a * ss_a + c * ss_c + t[:, None] * ss_t + g[None, :]
    m_ptrs = m_ptr + a * sm_a + c * sm_c + t[:, None] * sm_t + g[None, :]
    o_row = layer_row(o_ptr, ot_ptr, a, c, OH, so_a, so_c, O_TABLE, O_ALIGN)
    pt_base, pt_off, _ = block_source(blk_ptr, a, 0, PAGE)
    if PAGE > 0:
        o_ptrs = o_row + page_offsets(t, T, so_t, so_p, pt_ptr, pt_base, pt_off, PAGE)[:, None, None] + d[None, :, :]
    else:
        o_ptrs = o_row + t[:, None, None] * so_t + d[None, :, :]
    if MASKED:
        words = tl.load(q_ptrs, mask=t_ok[:, None, None] & (word * PER < D)[None, :, :], other=0)
        stat_ok = t_ok[:, None] & (g * GP < D)[None, :]
        s = tl.load(s_ptrs, mask=stat_ok, other=0.0).to(tl.float32)
        m = tl.load(m_ptrs, mask=stat_ok, other=0.0).to(tl.float32)
    else:
        words = tl.load(q_ptrs)
        s = tl.load(s_ptrs).to(tl.float32)
        m = tl.load(m_ptrs).to(tl.float32)
    codes = (words[:, :, :, None] >> (tl.arange(0, PER) * BITS)[None, None, None, :]) & QMAX
    codes = tl.reshape(codes, (BLOCK_T, NGP, GP))
    x = _within(_decode(codes, s[:, :, None], m[:, :, None]), o_ptr.dtype.element_ty)
    if SOFT_BF16:
        x = _round_to_bf16(x)
    x = x.to(o_ptr.dtype.element_ty)
    if MASKED:
        tl.store(o_ptrs, x, mask=t_ok[:, None, None] & (d < D)[None, :, :])
    else:
        tl.store(o_ptrs, x)


# -- host launchers ----------------------------------------------------------------------
# Everything a launch needs that depends only on shapes, strides, dtypes and settings is
# worked out once per such combination (``_quantize_plan``, ``_dequantize_plan``, cached):
# a call then costs the output allocations and the Triton launch, which matters for
# block-sized calls (a 16 MB block is a few microseconds of GPU time).


def _interpreted() -> bool:
    # Under TRITON_INTERPRET=1 (read when this module was imported) @triton.jit returns an
    # interpreter object instead of a JITFunction.
    return not isinstance(_decode, triton.runtime.JITFunction)


def _triton_version() -> tuple[int, int]:
    got = re.match(r"(\d+)\.(\d+)", triton.__version__)  # ("3.9.0+git...", "3.10rc1": the first two numbers)
    return (int(got[1]), int(got[2])) if got else (0, 0)


# ``_quotient`` divides exactly by way of the reciprocal only with an fma that rounds once,
# as GPUs' does. Triton's interpreter multiplied, then added (rounding twice) before 3.9;
# under it the kernels divide with div_rn, as they do with fp32 stats: the same codes.
_FMA_ROUNDS_ONCE = tl.constexpr(not _interpreted() or _triton_version() >= (3, 9))


@dataclass(frozen=True, slots=True)
class _Launch:
    kernel: Any  # a JITFunction, or an Autotuner over one
    grid: Any  # a tuple, or a callable of the config (autotune)
    scalars: tuple[int, ...]  # C, T, D and each tensor's (stride_a, stride_c, stride_t)
    options: dict[str, Any]  # constexprs and launch options

    cached: CachedLaunch | None = None  # a plain JIT kernel's later launches, past Triton's binding

    def __call__(self, *tensors: Any) -> None:
        """``tensors``: the kernel's arguments, a tensor first; ints where it takes a host
        pointer (a flag's ``data_ptr``) or a scalar."""
        device = tensors[0].device
        if device.type == "cpu" and not _interpreted():
            raise RuntimeError("cacheseek.kernels: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
        on_device(device, self._launch, tensors)

    def _launch(self, tensors: tuple) -> None:
        if self.cached is not None:
            self.cached(*tensors)
        else:
            self.kernel[self.grid](*tensors, *self.scalars, **self.options)


@dataclass(frozen=True, slots=True)
class _QuantizePlan:
    q_shape: tuple[int, ...]
    stats_shape: tuple[int, ...]
    launch: _Launch | None  # None: nothing to do (empty input)
    copy_input: bool = False  # x needs .contiguous() first (then plan again)


@dataclass(frozen=True, slots=True)
class _DequantizePlan:
    launch: _Launch | None
    copy_inputs: bool = False  # q, scale, mn need .contiguous() first (then plan again)
    via_temp: bool = False  # decode into a fresh tensor, then out.copy_ (out cannot be written directly)


def _check_clip(clip: int, axis: int) -> None:
    if isinstance(clip, bool) or clip not in range(MAX_CLIP + 1):
        raise ValueError(f"clip: must be 0 to {MAX_CLIP}, got {clip!r}")
    if clip and axis != AXIS_CHANNELS:
        raise ValueError("clip: only V (axis=-1, groups of channels) has a range search")


def _check_args(bits: int, group: int, axis: int, ndim: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits: must be one of {list(BITS)}, got {bits!r}")
    if group not in GROUPS:
        raise ValueError(f"group: must be one of {list(GROUPS)}, got {group!r}")
    if ndim < 2:
        raise ValueError(f"x: expected [..., T, D], got {ndim} dims")
    axis = axis - ndim if axis >= 0 else axis
    if axis not in (AXIS_TOKENS, AXIS_CHANNELS):
        raise ValueError(f"axis: must be -2 (K, groups of tokens) or -1 (V, groups of channels), got {axis}")
    return axis


def _shapes(shape: tuple[int, ...], bits: int, group: int, axis: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(packed codes shape, stats shape) of x of ``shape``; raises if it cannot be packed."""
    *lead, T, D = shape
    per = 32 // bits
    if axis == AXIS_TOKENS:
        if T % group:
            raise ValueError(f"x: T={T} is not a multiple of the K group size {group}")
        return (*lead, T // per, D), (*lead, T // group, D)
    if D % per:
        raise ValueError(f"x: D={D} cannot be packed {per} codes per int32 word at {bits} bits")
    return (*lead, T, D // per), (*lead, T, -(-D // group))


def _grid(side: str, rows: int, T: int, D: int, group: int):
    """Programs for a config's block sizes (a callable, as triton.autotune wants)."""
    if side == "k":
        return lambda meta: (rows * triton.cdiv(T // group, meta["GROUPS"]) * triton.cdiv(D, meta["BLOCK_D"]),)
    return lambda meta: (rows * triton.cdiv(T, meta["BLOCK_T"]),)


_KERNELS = {
    ("k", "quantize"): (_quantize_k_kernel, _k_masked),
    ("k", "dequantize"): (_dequantize_k_kernel, _k_masked),
    ("v", "quantize"): (_quantize_v_kernel, _v_masked),
    ("v", "dequantize"): (_dequantize_v_kernel, _v_masked),
}


@functools.cache
def _tuned(side: str, op: str, group: int, D: int):
    # One autotuner per (kernel, group, D); it re-tunes per (T, BITS) and argument dtypes
    # (and V's encoder per CLIP: the range search adds compute per group).
    kernel = _KERNELS[side, op][0]
    key = ["T", "D", "BITS"] + (["CLIP"] if (side, op) == ("v", "quantize") else [])
    return triton.autotune(configs=configs.candidates(side, op, group, D), key=key)(kernel)


def _make_launch(side: str, op: str, lv: Levels, T: int, D: int, strides: list[tuple[int, ...]],
                 consts: dict[str, Any], group: int, config: triton.Config | None, *,
                 dtype: torch.dtype, table_rows: int = 0, align: int | None = None, page: int = 0,
                 page_stride: int = 0, page_words: bool = False) -> _Launch:
    """``strides``: each tensor's full strides, in kernel argument order; ``dtype``: the KV's
    (quantize's input, dequantize's output). ``table_rows`` > 0 when the KV side is a model's
    layers read or written through a layer table (``layers.layer_row``), with ``align``
    (elements) the alignment of its layers; ``page`` > 0 (the page size) when it is in
    pages (``paged``), ``page_stride`` the elements from one page to the next, and
    ``page_words`` whether every block starts at a slot that is a multiple of 32 // bits."""
    scalars = (lv.C, T, D, max(1, table_rows), *(x for k, st in enumerate(strides) for x in (*lv.strides[k], st[-2])),
               page_stride)
    align = 16 // dtype.itemsize if align is None else align
    if op == "quantize":
        consts = {**consts, "X_TABLE": table_rows > 0, "X_ALIGN": align, "CHECK": table_rows > 0, "PAGE": page}
    else:
        consts = {**consts, "O_TABLE": table_rows > 0, "O_ALIGN": align, "PAGE": page}
    if side == "k":  # whether each code word's tokens lie in one page (one page lookup per word)
        if consts.pop("CLIP", 0):
            raise ValueError("clip: only V (axis=-1, groups of channels) has a range search")
        consts["PAGE_WORDS"] = page > 0 and page % (32 // consts["BITS"]) == 0 and page_words
    elif op == "quantize":
        consts["WORD_BIAS"] = _word_bias_value(consts["BITS"])
        consts["CLIP"] = consts.get("CLIP", 0)
    if side == "v":
        d_pad = configs.padded_head_dim(D)
        consts = {**consts, "GP": min(group, d_pad), "D_PAD": d_pad}
    else:
        consts = {**consts, "G": group}
    # No FMA contraction: dequantize rounds code * s and then + m, as torch does (bit-
    # identical decodes); quantize's fmas are explicit.
    options = {**consts, "enable_fp_fusion": False}
    grid = _grid(side, lv.rows, T, D, group)
    kernel, masked = _KERNELS[side, op]
    if config is None and configs.autotune_enabled() and not _interpreted():
        return _Launch(_tuned(side, op, group, D), grid, scalars, options)  # MASKED by triton.heuristics
    cfg = config if config is not None else configs.pick(side, op, group, D, T, consts["BITS"])
    options.update(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                   MASKED=masked({"T": T, "D": D, **consts, **cfg.kwargs}))
    fn, grid = kernel.fn, grid(cfg.kwargs)  # .fn: past the heuristics wrapper
    return _Launch(fn, grid, scalars, options, None if _interpreted() else CachedLaunch(fn, grid, scalars, options))


@functools.lru_cache(maxsize=1024)
def _quantize_plan(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, bits: int, group: int,
                   axis: int, stats_dtype: torch.dtype, config: triton.Config | None,
                   autotune: bool, clip: int = 0) -> _QuantizePlan:
    axis = _check_args(bits, group, axis, len(shape))
    _check_clip(clip, axis)
    if dtype not in X_DTYPES:
        raise ValueError(f"x: dtype must be one of {X_DTYPES}, got {dtype}")
    if stats_dtype not in STATS_DTYPES:
        raise ValueError(f"stats_dtype: must be one of {STATS_DTYPES}, got {stats_dtype}")
    q_shape, st_shape = _shapes(shape, bits, group, axis)
    if math.prod(shape) == 0:
        return _QuantizePlan(q_shape, st_shape, None)
    *lead, T, D = shape
    # outputs are allocated contiguous; scale and min alike
    strides = [stride, contiguous_strides(q_shape), contiguous_strides(st_shape)]
    lv = collapse(lead, strides) if unit_last(shape, stride) else None
    if lv is None:  # three or more strided levels: one copy rather than one launch per level
        return _QuantizePlan(q_shape, st_shape, None, copy_input=True)
    side = "k" if axis == AXIS_TOKENS else "v"
    launch = _make_launch(side, "quantize", lv, T, D, strides, {"BITS": bits, "CLIP": clip}, group, config,
                          dtype=dtype)
    return _QuantizePlan(q_shape, st_shape, launch)


@functools.lru_cache(maxsize=1024)
def _layers_plan(layer_shape: tuple[int, ...], layer_stride: tuple[int, ...], dtype: torch.dtype, n: int,
                 block: int, outs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...], bits: int,
                 group: int, axis: int, config: triton.Config | None, autotune: bool, clip: int = 0) -> _Launch | None:
    """The launch for :func:`quantize_layers` (None when there is nothing to do)."""
    if len(layer_shape) != 3 or layer_stride[-1] != 1:
        raise ValueError(f"layers: expected [H, T, D] tensors with unit last stride, got {layer_shape} {layer_stride}")
    if dtype not in X_DTYPES:
        raise ValueError(f"layers: dtype must be one of {X_DTYPES}, got {dtype}")
    H, _, D = layer_shape
    axis = _check_args(bits, group, axis, 5)
    _check_clip(clip, axis)
    L = outs[0][0][1]
    _check_rows("out", n, L, H, block, D, outs, bits, group, axis)
    if n * L * H * block * D == 0:
        return None
    (_, qst, _), (_, sst, _), _ = outs
    sx_h, sx_t, _ = layer_stride
    lv = Levels(A=n, C=L * H, strides=((block * sx_t, sx_h), (qst[0], qst[2]), (sst[0], sst[2])))
    strides = [(sx_t, 1), qst, sst]
    side = "k" if axis == AXIS_TOKENS else "v"
    return _make_launch(side, "quantize", lv, block, D, strides, {"BITS": bits, "CLIP": clip}, group, config,
                        dtype=dtype, table_rows=H)


def _check_rows(name: str, n: int, L: int, H: int, block: int, D: int,
                bufs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...], bits: int, group: int,
                axis: int) -> None:
    """``bufs``: (shape, strides, dtype) of the codes, scale and min of ``n`` blocks of ``L``
    layers, as ``[n, L, H, ...]`` views whose layers and heads merge into one level (the
    kernels index rows as (block, layer x head))."""
    q_shape, st_shape = _shapes((n, L, H, block, D), bits, group, axis)
    (qs, qst, qdt), (ss, sst, sdt), (ms, mst, mdt) = bufs
    for part, shape, want in (("q", qs, q_shape), ("scale", ss, st_shape), ("mn", ms, st_shape)):
        if shape != want:
            raise ValueError(f"{name} {part}: expected shape {want}, got {shape}")
    if qdt != torch.int32 or sdt not in STATS_DTYPES or mdt != sdt:
        raise ValueError(f"{name}: expected int32 codes and matching stats dtypes, got {qdt}, {sdt}, {mdt}")
    if sst != mst:
        raise ValueError(f"{name}: scale and mn must have the same strides")
    for part, shape, st in (("q", qs, qst), ("scale", ss, sst)):
        if not unit_last(shape, st) or (H > 1 and L > 1 and st[1] != st[2] * H) or (H == 1 and L > 1
                                                                                    and st[1] != st[2]):
            raise ValueError(f"{name} {part}: strides {st} cannot be indexed as [block, layer x head] rows")


PageGeometry = tuple  # (L, H, D, strides, dtype, align, page size, slot align): what a plan depends on


@functools.lru_cache(maxsize=1024)
def _pages_plan(op: str, geometry: PageGeometry, n: int, block: int,
                bufs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...], bits: int, group: int,
                axis: int, config: triton.Config | None, autotune: bool, clip: int = 0) -> _Launch | None:
    """The launch for :func:`quantize_pages` or :func:`dequantize_pages` (None: nothing to do)."""
    L, H, D, (s_p, s_t, s_h), dtype, align, page, slot_align = geometry
    if dtype not in X_DTYPES:
        raise ValueError(f"pages: dtype must be one of {X_DTYPES}, got {dtype}")
    axis = _check_args(bits, group, axis, 5)
    _check_clip(clip, axis)
    _check_rows("out" if op == "quantize" else "encoded", n, L, H, block, D, bufs, bits, group, axis)
    if n * L * H * block * D == 0:
        return None
    (_, qst, _), (_, sst, _), (_, mst, _) = bufs
    side = "k" if axis == AXIS_TOKENS else "v"
    pages = ((0, s_h), (s_t, 1))  # (a, c) strides and full strides: the page table places each block
    if op == "quantize":
        lv = Levels(A=n, C=L * H, strides=(pages[0], (qst[0], qst[2]), (sst[0], sst[2])))
        return _make_launch(side, op, lv, block, D, [pages[1], qst, sst], {"BITS": bits, "CLIP": clip}, group, config,
                            dtype=dtype, table_rows=H, align=align, page=page, page_stride=s_p,
                            page_words=slot_align % (32 // bits) == 0)
    lv = Levels(A=n, C=L * H, strides=((qst[0], qst[2]), (sst[0], sst[2]), (mst[0], mst[2]), pages[0]))
    consts = {"BITS": bits, "SOFT_BF16": dtype == torch.bfloat16 and _interpreted()}
    return _make_launch(side, op, lv, block, D, [qst, sst, mst, pages[1]], consts, group, config,
                        dtype=dtype, table_rows=H, align=align, page=page, page_stride=s_p,
                        page_words=slot_align % (32 // bits) == 0)


def _geometry(pages: PagedLayers, where: BlockPages) -> PageGeometry:
    return (len(pages), pages.heads, pages.head_dim, pages.strides, pages.dtype, pages.align, where.page_size,
            where.slot_align)


@functools.lru_cache(maxsize=1024)
def _dequantize_plan(shape: tuple[int, ...], bufs: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...],
                     out: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None, dtype: torch.dtype, bits: int,
                     group: int, axis: int, config: triton.Config | None, autotune: bool) -> _DequantizePlan:
    """``bufs``: (shape, strides, dtype) of q, scale and mn; ``out``: the same for out."""
    axis = _check_args(bits, group, axis, len(shape))
    if dtype not in X_DTYPES:
        raise ValueError(f"dtype: must be one of {X_DTYPES}, got {dtype}")
    q_shape, st_shape = _shapes(shape, bits, group, axis)
    for name, (got, _, _), want in zip(("q", "scale", "mn"), bufs, (q_shape, st_shape, st_shape)):
        if got != want:
            raise ValueError(f"{name}: expected shape {want} for x of shape {shape}, got {got}")
    if bufs[0][2] != torch.int32:
        raise ValueError(f"q: expected int32 code words, got {bufs[0][2]}")
    if bufs[1][2] not in STATS_DTYPES or bufs[2][2] not in STATS_DTYPES:
        raise ValueError(f"scale, mn: dtype must be one of {STATS_DTYPES}, got {bufs[1][2]}, {bufs[2][2]}")
    if out is not None and (out[0] != shape or out[2] != dtype or not unit_last(out[0], out[1])
                            or may_overlap(out[0], out[1])):
        # The reference's semantics: out.copy_ casts, and refuses an out whose elements share
        # memory (programs writing one address race: the last one's decode would be kept).
        return _DequantizePlan(None, via_temp=True)
    if math.prod(shape) == 0:
        return _DequantizePlan(None)
    *lead, T, D = shape
    out_strides = out[1] if out is not None else contiguous_strides(shape)
    strides = [st for _, st, _ in bufs] + [out_strides]
    lv = collapse(lead, strides) if all(unit_last(sh, st) for sh, st, _ in bufs) else None
    if lv is None:
        packed = [contiguous_strides(sh) for sh, _, _ in bufs] + [out_strides]
        if collapse(lead, packed) is None:  # out itself has three strided levels
            return _DequantizePlan(None, via_temp=True)
        return _DequantizePlan(None, copy_inputs=True)
    side = "k" if axis == AXIS_TOKENS else "v"
    # The interpreter's fp32 -> bf16 cast truncates; the kernel then rounds itself.
    consts = {"BITS": bits, "SOFT_BF16": dtype == torch.bfloat16 and _interpreted()}
    return _DequantizePlan(_make_launch(side, "dequantize", lv, T, D, strides, consts, group, config, dtype=dtype))


def _quantize(x: torch.Tensor, bits: int, group: int, axis: int, stats_dtype: torch.dtype,
              config: triton.Config | None = None, clip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    autotune = configs.autotune_enabled()
    plan = _quantize_plan(tuple(x.shape), x.stride(), x.dtype, bits, group, axis, stats_dtype, config, autotune,
                          clip)
    if plan.copy_input:
        x = x.contiguous()
        plan = _quantize_plan(tuple(x.shape), x.stride(), x.dtype, bits, group, axis, stats_dtype, config,
                              autotune, clip)
    q = torch.empty(plan.q_shape, dtype=torch.int32, device=x.device)
    scale = torch.empty(plan.stats_shape, dtype=stats_dtype, device=x.device)
    mn = torch.empty(plan.stats_shape, dtype=stats_dtype, device=x.device)
    if plan.launch is not None:
        plan.launch(x, q, scale, mn, x, 0, x, x)  # no layer table, flag or pages (x stands in): unread
    return q, scale, mn


def _dequantize(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, group: int, axis: int,
                shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None = None,
                config: triton.Config | None = None) -> torch.Tensor:
    if scale.device != q.device or mn.device != q.device:
        raise ValueError(f"q, scale, mn: on different devices ({q.device}, {scale.device}, {mn.device})")
    shape = tuple(int(n) for n in shape)
    autotune = configs.autotune_enabled()

    def plan_for(q, scale, mn) -> _DequantizePlan:
        bufs = tuple((tuple(t.shape), t.stride(), t.dtype) for t in (q, scale, mn))
        out_desc = None if out is None else (tuple(out.shape), out.stride(), out.dtype)
        return _dequantize_plan(shape, bufs, out_desc, dtype, bits, group, axis, config, autotune)

    plan = plan_for(q, scale, mn)
    if plan.copy_inputs:
        q, scale, mn = q.contiguous(), scale.contiguous(), mn.contiguous()
        plan = plan_for(q, scale, mn)
    if plan.via_temp or (out is not None and out.device != q.device):
        assert out is not None  # (via_temp: planned only for an out that cannot be written directly)
        out.copy_(_dequantize(q, scale, mn, bits, group, axis, shape, dtype, config=config))
        return out
    target = out if out is not None else torch.empty(shape, dtype=dtype, device=q.device)
    if plan.launch is not None:
        plan.launch(q, scale, mn, target, target, target, target)  # no layer table or pages: unread
    return target


# -- public API --------------------------------------------------------------------------


def quantize(x: torch.Tensor, *, bits: int, group: int, axis: int, stats_dtype: torch.dtype,
             clip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI-quantize ``x`` ([..., T, D]) along ``axis``: contiguous ``(q int32, scale, min)``,
    as ``kivi_reference.quantize`` (``clip``: V's range search, 0 to off). ``x`` may be a
    strided view (see ``_strides``)."""
    return _quantize(x, bits, group, axis, stats_dtype, clip=clip)


@triton.jit
def _store_to_host_kernel(src_ptr, dst_addr, N: tl.constexpr, NP: tl.constexpr):
    i = tl.arange(0, NP)
    dst = dst_addr.to(tl.pointer_type(tl.uint8))
    tl.store(dst + i, tl.load(src_ptr + i, mask=i < N), mask=i < N)


def store_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Write the bytes of a small CUDA tensor into pinned host memory ``dst`` with a kernel
    (through its mapped address), on the current stream. Unlike a copy, this does not
    queue behind the device-to-host copies in flight on the copy engine: a host that waits
    on an event recorded after it reads ``dst`` as soon as the kernel is done."""
    # (Pinning is not checked: is_pinned() can stall for milliseconds. Pageable memory has
    # no device mapping, and the kernel would fault.)
    if src.device.type != "cuda" or dst.device.type != "cpu":
        raise ValueError("store_to_host: src must be a CUDA tensor and dst pinned host memory")
    n = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() != n or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"store_to_host: {n} contiguous source bytes need as many contiguous destination bytes")
    if n:
        with torch.cuda.device(src.device):
            _store_to_host_kernel[(1,)](src.view(torch.uint8), dst.data_ptr(), N=n, NP=triton.next_power_of_2(n))


def quantize_layers(layers: "LayerTable | list[torch.Tensor]", t0: int, n: int, block: int, *, bits: int,
                    group: int, axis: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    ok_flag: torch.Tensor, clip: int = 0) -> None:
    """KIVI-quantize tokens ``[t0, t0 + n * block)`` of every layer, as ``n`` blocks, into
    ``out = (q, scale, min)`` of shapes ``[n, L, H, ...]`` (e.g. views of a staging buffer,
    each block a row at its own stride). ``layers`` are L separate ``[H, T, D]`` tensors of
    one dtype, device and strides (or their :class:`LayerTable`): the kernel reads them
    through a table of their offsets, in one launch, with no stacked copy. The same codes
    as ``quantize`` of the stacked ``[n, L, H, block, D]`` view.

    ``ok_flag``: one byte of host memory (pinned when the layers are on a GPU: the kernel
    writes it through its mapped address) that the kernel sets to 0 if any stored scale or
    min is NaN or Inf; the caller sets it to 1 before, and reads it once the launch is done."""
    table = layers if isinstance(layers, LayerTable) else LayerTable(layers)
    table.check_blocks(t0, n, block)
    if len(out) != 3 or out[0].dim() != 5 or out[0].shape[1] != len(table):
        raise ValueError(f"out: expected (q, scale, min) of [n, L, H, ...] with L = {len(table)}")
    if any(o.device != table.device for o in out):  # (the kernel writes them through its pointers)
        raise ValueError(f"out: expected (q, scale, min) on the layers' device {table.device}, "
                         f"got {', '.join(str(o.device) for o in out)}")
    check_flag(ok_flag)
    outs = tuple((tuple(o.shape), o.stride(), o.dtype) for o in out)
    launch = _layers_plan(table.shape, table.stride, table.dtype, n, block, outs, bits, group, axis, None,
                          configs.autotune_enabled(), clip)
    if launch is not None:
        launch(table.layers[0][:, t0:], *out, table.offsets, ok_flag.data_ptr(), table.offsets, table.offsets)


def quantize_pages(pages: PagedLayers, where: BlockPages, first: int, n: int, block: int, *, bits: int, group: int,
                   axis: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ok_flags: torch.Tensor,
                   clip: int = 0) -> None:
    """KIVI-quantize blocks ``[first, first + n)`` of ``where`` (``block`` tokens each, read in
    place from every layer of ``pages``, one side of an engine's paged KV cache) into ``out
    = (q, scale, min)`` of shapes ``[n, L, H, ...]`` (views of staging rows), in one launch:
    the same codes as ``quantize`` of those blocks stacked contiguously.

    ``ok_flags``: ``n`` bytes of host memory (pinned when the pages are on a GPU), one per
    block, that the kernel sets to 0 where a stored scale or min is NaN or Inf; the caller
    sets them to 1 before, and reads them once the launch is done."""
    check_flags(ok_flags, n)
    check_where(pages, where, block)
    blk = where.rows(first, n)
    bufs = tuple((tuple(o.shape), o.stride(), o.dtype) for o in out)
    launch = _pages_plan("quantize", _geometry(pages, where), n, block, bufs, bits, group, axis, None,
                         configs.autotune_enabled(), clip)
    if launch is not None:
        _same_device(pages, out)
        launch(pages.base, *out, pages.offsets, ok_flags.data_ptr(), where.page_ids, blk)


def dequantize_pages(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, *, bits: int, group: int, axis: int,
                     pages: PagedLayers, where: BlockPages, first: int, n: int, block: int) -> None:
    """Decode ``n`` blocks (``q, scale, mn`` of shapes ``[n, L, H, ...]``, e.g. views of the
    staging rows their payloads landed in) straight into the pages of blocks ``[first,
    first + n)`` of ``where``, every layer of ``pages``, in one launch: the same values as
    ``dequantize`` into a contiguous tensor."""
    check_where(pages, where, block)
    bufs = tuple((tuple(t.shape), t.stride(), t.dtype) for t in (q, scale, mn))
    blk = where.rows(first, n)
    launch = _pages_plan("dequantize", _geometry(pages, where), n, block, bufs, bits, group, axis, None,
                         configs.autotune_enabled())
    if launch is not None:
        _same_device(pages, (q, scale, mn))
        launch(q, scale, mn, pages.base, pages.offsets, where.page_ids, blk)


def _same_device(pages: PagedLayers, tensors) -> None:
    if any(t.device != pages.device for t in tensors):
        raise ValueError(f"pages on {pages.device}, staging on {[str(t.device) for t in tensors]}: must be one device")


def dequantize(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, *, bits: int, group: int, axis: int,
               shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild ``x_hat`` of ``shape`` and ``dtype`` (into ``out`` when given, which may be a
    strided view), as ``kivi_reference.dequantize``."""
    return _dequantize(q, scale, mn, bits, group, axis, tuple(shape), dtype, out)
