"""``KIVI(v_rotate=True)``'s rotation of V rows in one pass: ``cacheseek.quant.rotation``'s
fast Walsh-Hadamard transform with its signed scales, in registers, one read and one write.

The torch reference does log2(n) stages, each a pass over the whole tensor in fp32: on the
H200 it rotated V at ~35 GB/s, a fiftieth of the quantize kernel's speed. Here a program
holds ``BLOCK_R`` rows and runs the same stages on them: stage h pairs the elements h apart
in blocks of 2h, (a, b) -> (a + b, a - b), the same IEEE fp32 operations in the same order
as the reference for every output element (the scales a product of two fp32 values), so
the rows come out bit for bit as the reference's, then rounded once to the output's dtype.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import contextlib

import torch
import triton
import triton.language as tl

from .kivi import _interpreted, _round_to_bf16, _within


@triton.jit
def _capped(x, out_ty: tl.constexpr):
    """fp32 ``x`` within +-the largest finite value of ``out_ty``, NaN kept, zero's sign kept:
    the reference's clamp. (Not -_within(-_within(x)): Triton negates as 0 - x, which turns
    -0.0 into +0.0 on a GPU.)"""
    x = _within(x, out_ty)
    if out_ty == tl.float16:
        x = tl.maximum(x, -65504.0, propagate_nan=tl.PropagateNan.ALL)
    elif out_ty == tl.bfloat16:
        x = tl.maximum(x, -3.3895313892515355e38, propagate_nan=tl.PropagateNan.ALL)
    else:
        x = tl.maximum(x, -3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def _rotate_rows_kernel(x_ptr, c_ptr, o_ptr, R, N: tl.constexpr, LOG_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        SCALE_AFTER: tl.constexpr, SOFT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, N)
    ok = (rows < R)[:, None]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + cols)
    if not SCALE_AFTER:  # rotate: (x * c) H
        x = x * c[None, :]
    for s in tl.static_range(LOG_N):
        # Stage h = 2^s: in each block of 2h, element j pairs with j + h.
        y = tl.permute(tl.reshape(x, (BLOCK_R, N // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_R, N))
    if SCALE_AFTER:  # unrotate: (y H) * c, capped at the output's max of either sign (as the reference)
        x = x * c[None, :]
        x = _capped(x, o_ptr.dtype.element_ty)
    if SOFT_BF16:
        x = _round_to_bf16(x)
    tl.store(o_ptr + offs, x.to(o_ptr.dtype.element_ty), mask=ok)


MAX_N = 1024  # the widest row one program holds in registers; wider rows take the torch stages


def rotate_rows(x: torch.Tensor, scales: torch.Tensor, *, inverse: bool, dtype: torch.dtype) -> torch.Tensor:
    """``rotation.rotate(x)`` (``inverse=False``) or ``rotation.unrotate(x)`` of the rows of
    ``x`` (last dimension n, a power of two up to 1024), as a new contiguous tensor of
    ``dtype``: the reference's fp32 values rounded once. ``scales``: the rotation's signed
    scales (``rotation.scaled_signs(n, device)``, fp32, on ``x``'s device)."""
    n = x.shape[-1]
    if n < 2 or n & (n - 1) or n > MAX_N:
        raise ValueError(f"rotate_rows: the last dimension must be a power of two from 2 to {MAX_N}, got {n}")
    if scales.shape != (n,) or scales.dtype != torch.float32 or scales.device != x.device:
        raise ValueError(f"rotate_rows: scales must be [{n}] float32 on {x.device}")
    on_gpu = x.device.type == "cuda"
    if not on_gpu and isinstance(_rotate_rows_kernel, triton.runtime.JITFunction):
        raise RuntimeError("cacheseek.kernels: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows = src.numel() // n
    if rows == 0:
        return out
    block_r = max(1, min(64, 4096 // n))
    with torch.cuda.device(x.device) if on_gpu else contextlib.nullcontext():
        _rotate_rows_kernel[(triton.cdiv(rows, block_r),)](
            src, scales, out, rows, N=n, LOG_N=n.bit_length() - 1, BLOCK_R=block_r, SCALE_AFTER=inverse,
            SOFT_BF16=dtype == torch.bfloat16 and _interpreted(), num_warps=4,
            enable_fp_fusion=False,  # no fma of the scaling into a stage's add: the reference rounds both
        )
    return out


__all__ = ["MAX_N", "rotate_rows"]
