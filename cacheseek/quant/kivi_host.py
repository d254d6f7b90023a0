"""KIVI on the host: ``kivi_reference``'s arithmetic, bit for bit, in fewer passes over memory.

KV on the CPU is encoded and decoded here (``quant.backend.ops_for``). The reference is the
specification, written for clarity: it moves the grouped axis last (a transposed copy of
K), widens the whole tensor to fp32, repeats the stats to full size, packs through int64
and moves the axis back (another copy). On a CPU those passes over memory, not the
arithmetic, are the cost. Here every value goes through the same operations, in the same
dtypes and the same order, as in the reference:

- encode: group min and max of the KV widened to fp32 (``+ 0.0`` makes a zero's sign
  canonical, as there); scale and min in fp32, rounded to the stats dtype; ``(fp32(x) -
  m) / s`` (an IEEE fp32 division), rounded half to even, clamped to the code range.
- decode: ``fp32(code) * s``, rounded, ``+ m``, rounded (two fp32 roundings, no FMA),
  capped at the dtype's max, rounded once to the dtype.

What differs is only where the values live:

- K's groups run along tokens (dim -2): they are reduced and broadcast along that dim
  where it lies, with no transposed copy; the stats are broadcast as views, never repeated.
- The work goes in chunks of rows small enough (``CHUNK_ELEMENTS``) that each step's
  temporaries stay in the L2 cache, written into buffers made once per call.
- Codes are packed and unpacked as bytes: an int32 word is four little-endian bytes, and
  element j of a word sits in bits ``[j * bits, (j + 1) * bits)``, so for int8 the bytes
  are the codes, and for int4/int2 each byte holds ``8 / bits`` codes, lowest first.
- Codes are rounded by an fp32 addition that leaves them in the low byte of its bits
  (see ``quantize``): torch's float-to-uint8 conversion is slow on a CPU.
- The decode's cap at the dtype's max is skipped when no group can reach it (its top,
  ``qmax * s + m`` in fp32, is within it: ``code * s + m`` grows with the code when s >= 0).
- The encode writes its codes and stats where the caller wants them (``out``: e.g. a
  layer's place in the staging rows of a batch), not into fresh tensors copied there after.

It hands a call to the reference where that is simpler than being fast: V's range search
(``clip``), a ragged last group, a big-endian host, a tensor not on the CPU, and an encode
whose stats are not all finite (its input is rejected; the reference's codes make the result the same anyway).
"""

from __future__ import annotations

import sys

import torch

from . import kivi_reference as ref
from .tensors import all_finite, copy_into

# KV values per chunk: 1 MB of fp32 temporaries, split over the threads' L2 caches. On the
# 2-core VM (1 MB of L2 a core) 2^16 ran at half the speed and 2^17 at 0.7-0.8x (each op's
# fixed cost), 2^18 to 2^22 alike (benchmarks.host_codec).
CHUNK_ELEMENTS = 1 << 18
_LITTLE_ENDIAN = sys.byteorder == "little"
_ROUNDER = 1.5 * 2**23  # y + this, for 0 <= y < 2^22, is round_half_even(y) + this, exactly


def _fast(shape: tuple[int, ...], bits: int, group: int, axis: int) -> bool:
    """Whether this module handles the call: axis is tokens (-2) or channels (-1) of
    [..., T, D], every group whole, and the host lays int32 words out little-endian."""
    if not _LITTLE_ENDIAN or len(shape) < 2 or axis not in (len(shape) - 2, len(shape) - 1):
        return False
    return shape[axis] % group == 0 and group % (32 // bits) == 0


def _chunks(shape: tuple[int, ...], group: int):
    """``(lead index, t0, t1)`` pieces of [..., T, D] of about ``CHUNK_ELEMENTS`` values:
    whole rows [T, D] of the innermost leading dim together, or a row cut into whole
    groups of tokens (a multiple of ``group``, so whole K groups and whole packed words)."""
    *lead, T, D = shape
    row = T * D
    if row >= CHUNK_ELEMENTS or not lead:
        step = max(group, CHUNK_ELEMENTS // (D * group) * group)
        for idx in _indices(lead):
            for t0 in range(0, T, step):
                yield idx, t0, min(t0 + step, T)
        return
    rows = max(1, CHUNK_ELEMENTS // row)
    for idx in _indices(lead[:-1]):
        for a in range(0, lead[-1], rows):
            yield (*idx, slice(a, min(a + rows, lead[-1]))), 0, T


def _indices(dims: list[int]):
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i, *rest)


def _rows(t: torch.Tensor, idx: tuple) -> torch.Tensor:
    """``t[idx]`` as [rows, ..., ...]: a leading dim of 1 where ``idx`` took plain ints."""
    piece = t[idx]
    return piece if idx and isinstance(idx[-1], slice) else piece.unsqueeze(0)


def quantize(
    x: torch.Tensor, *, bits: int, group: int, axis: int, stats_dtype: torch.dtype, clip: int = 0,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`kivi_reference.quantize`, the same bits. ``out``: ``(q, scale, min)`` to
    write them into, of the shapes and dtypes returned otherwise, any strides, not
    overlapping ``x`` (e.g. views of a staging buffer's rows: no copy out of fresh tensors
    afterwards); returned."""
    axis = axis % x.dim() if x.dim() else axis
    if clip or x.device.type != "cpu" or not _fast(tuple(x.shape), bits, group, axis):
        got = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=stats_dtype, clip=clip)
        return got if out is None else _into(got, out)
    tokens = axis == x.dim() - 2
    *lead, T, D = x.shape
    per_word = 32 // bits
    q_shape = (*lead, T // per_word, D) if tokens else (*lead, T, D // per_word)
    stats_shape = (*lead, T // group, D) if tokens else (*lead, T, D // group)
    if out is None:
        q, scale = torch.empty(q_shape, dtype=torch.int32), torch.empty(stats_shape, dtype=stats_dtype)
        mn_out = torch.empty_like(scale)
    else:
        _check_out(out, [(q_shape, torch.int32), (stats_shape, stats_dtype), (stats_shape, stats_dtype)])
        q, scale, mn_out = out
        if q.stride(-1) != 1:  # its words are written as bytes, through a view that needs it
            q = torch.empty(q_shape, dtype=torch.int32)
    qmax = (1 << bits) - 1
    work = torch.empty(min(x.numel(), _chunk_cap(x.shape, group)), dtype=torch.float32)
    codes_buf = torch.empty(work.numel(), dtype=torch.uint8)
    inf = torch.tensor(float("inf"))
    for idx, t0, t1 in _chunks(tuple(x.shape), group):
        xc = _rows(x, idx)[:, t0:t1]
        r, t = xc.shape[0], t1 - t0
        xf = work[: xc.numel()].view(r, t, D)
        xf.copy_(xc)  # fp32: exact, and torch's fp32 min and max are several times faster than fp16's
        if tokens:
            g = xf.unflatten(1, (t // group, group))  # [r, T/G, G, D]: a group is dim 2
            sc, mc = _rows(scale, idx)[:, t0 // group : t1 // group], _rows(mn_out, idx)[:, t0 // group : t1 // group]
        else:
            g = xf.unflatten(2, (D // group, group))  # [r, T, D/G, G]: a group is dim 3
            sc, mc = _rows(scale, idx)[:, t0:t1], _rows(mn_out, idx)[:, t0:t1]
        dim = 2 if tokens else 3
        mn = g.amin(dim).add_(0.0)  # + 0.0: a zero's sign canonical, as the reference's _plus_zero
        mx = g.amax(dim).add_(0.0)
        # A tensor divisor, as the reference (which keeps the IEEE quotient on CUDA too).
        sc.copy_((mx - mn) / torch.full_like(mx, qmax))
        mc.copy_(mn)
        s = sc.float()
        m = mc.float()
        # The reference divides by 1 where s is not > 0 and then zeroes those codes; dividing
        # by Inf there gives codes of 0 directly (finite stats: x - m is finite).
        divisor = torch.where(s > 0, s, inf)
        # Rounding then clamping to [0, qmax] is clamping then rounding (the ends are whole
        # numbers). Adding 1.5 * 2^23 rounds y in [0, 255] half to even (fp32's ulp there is
        # 1) and leaves round(y) in the low byte of the sum's bits: a cheaper round, and no
        # float-to-uint8 conversion (torch's is slow on the CPU), just the int32's low byte.
        g.sub_(m.unsqueeze(dim)).div_(divisor.unsqueeze(dim)).clamp_(0, qmax).add_(_ROUNDER)
        low_bytes = xf.view(torch.int32)  # an int32 to uint8 copy keeps the low byte
        if tokens:
            _pack_tokens(low_bytes, _rows(q, idx)[:, t0 // per_word : t1 // per_word], bits, codes_buf)
        else:
            _pack_channels(low_bytes, _rows(q, idx)[:, t0:t1], bits, codes_buf)
    if not bool(all_finite(scale) & all_finite(mn_out)):
        # Rejected input (NaN, Inf, a range beyond the stats): the reference's own output.
        got = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=stats_dtype)
        return got if out is None else _into(got, out)
    if out is not None and q is not out[0]:
        out[0].copy_(q)
        q = out[0]
    return q, scale, mn_out


def _check_out(out: tuple[torch.Tensor, ...], want: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """``ValueError`` unless ``out`` are CPU tensors of ``want``'s shapes and dtypes."""
    if len(out) != len(want):
        raise ValueError(f"out: expected {len(want)} tensors (q, scale, min), got {len(out)}")
    for name, t, (shape, dtype) in zip(("q", "scale", "min"), out, want):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"out: {name} must be {dtype} {list(shape)} on the CPU, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")


def _into(got: tuple[torch.Tensor, ...],
          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's ``got`` copied into ``out``; ``out``."""
    copy_into(got, out)
    return out


def _chunk_cap(shape: torch.Size, group: int) -> int:
    """The most values one piece of :func:`_chunks` holds."""
    *lead, T, D = shape
    row = T * D
    if row >= CHUNK_ELEMENTS or not lead:
        return min(T, max(group, CHUNK_ELEMENTS // (D * group) * group)) * D
    return min(lead[-1], max(1, CHUNK_ELEMENTS // row)) * row


def _bytes_of(codes: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Codes [..., n * per_byte at ``dim``, ...] (uint8) packed into bytes along ``dim``:
    code k of a byte in bits ``[k * bits, (k + 1) * bits)``."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    c = codes.unflatten(dim, (codes.shape[dim] // per_byte, per_byte))
    # The codes' bits do not overlap, so OR is a sum, and add's alpha shifts with no temporary.
    packed = torch.add(c.select(dim + 1, 0), c.select(dim + 1, 1), alpha=1 << bits)
    for k in range(2, per_byte):
        packed.add_(c.select(dim + 1, k), alpha=1 << (k * bits))
    return packed


def _pack_tokens(low_bytes: torch.Tensor, q: torch.Tensor, bits: int, codes_buf: torch.Tensor) -> None:
    """Codes (the low bytes of ``low_bytes``, int32 [r, T, D]) into words ``q`` [r,
    T/per_word, D] along tokens: byte j of word (w, d) holds channel d's codes of tokens
    ``(w * 4 + j) * per_byte ...``, lowest first."""
    r, T, D = low_bytes.shape
    words = q.view(torch.uint8).view(r, T * bits // 32, D, 4)
    if bits == 8:  # the codes are the bytes: narrowed straight into place
        words.transpose(2, 3).copy_(low_bytes.view(r, T // 4, 4, D))
        return
    codes = codes_buf[: low_bytes.numel()].view(r, T, D)
    codes.copy_(low_bytes)
    packed = _bytes_of(codes, 1, bits)  # [r, T/per_byte, D]: bytes in token order
    words.copy_(packed.view(r, T * bits // 32, 4, D).transpose(2, 3))


def _pack_channels(low_bytes: torch.Tensor, q: torch.Tensor, bits: int, codes_buf: torch.Tensor) -> None:
    """Codes (the low bytes of ``low_bytes``, int32 [r, T, D]) into words ``q`` [r, T,
    D/per_word] along channels: a row's bytes are its codes packed in channel order."""
    r, T, D = low_bytes.shape
    row_bytes = q.view(torch.uint8).view(r, T, D * bits // 8)
    if bits == 8:
        row_bytes.copy_(low_bytes)
        return
    codes = codes_buf[: low_bytes.numel()].view(r, T, D)
    codes.copy_(low_bytes)
    row_bytes.copy_(_bytes_of(codes, 2, bits))


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
    """As :func:`kivi_reference.dequantize`, the same bits."""
    shape = tuple(shape)
    axis = axis % len(shape) if shape else axis
    if (not _fast(shape, bits, group, axis) or (out is not None and (tuple(out.shape) != shape or out.dtype != dtype))
            or q.device.type != "cpu"):
        return ref.dequantize(q, scale, mn, bits=bits, group=group, axis=axis, shape=shape, dtype=dtype, out=out)
    tokens = axis == len(shape) - 2
    *lead, T, D = shape
    per_word = 32 // bits
    result = torch.empty(shape, dtype=dtype) if out is None else out
    top = torch.finfo(dtype).max
    s_all, m_all = scale.float(), mn.float()
    # Every code * s + m is at most qmax * s + m where s >= 0 (fp32 rounding keeps order),
    # so when that is within the dtype for every group, the reference's cap changes nothing.
    qmax = (1 << bits) - 1
    cap = not bool(((s_all >= 0) & (s_all * qmax + m_all <= top)).all())
    n = min(result.numel(), _chunk_cap(torch.Size(shape), group))
    work = torch.empty(n, dtype=torch.float32)
    bytes_buf = torch.empty(n * bits // 8, dtype=torch.uint8)
    codes_buf = torch.empty(n, dtype=torch.uint8)
    for idx, t0, t1 in _chunks(shape, group):
        oc = _rows(result, idx)[:, t0:t1]
        r, t = oc.shape[0], t1 - t0
        if tokens:
            words = _rows(q, idx)[:, t0 // per_word : t1 // per_word]
            s = _rows(s_all, idx)[:, t0 // group : t1 // group].unsqueeze(2)
            m = _rows(m_all, idx)[:, t0 // group : t1 // group].unsqueeze(2)
            # A word's bytes [r, T/per_word, D, 4] put in token order [r, T/per_word, 4, D].
            packed = bytes_buf[: r * t * D * bits // 8].view(r, t // per_word, 4, D)
            packed.copy_(words.contiguous().view(torch.uint8).view(r, t // per_word, D, 4).transpose(2, 3))
            codes = _codes_of(packed, 3, bits, codes_buf)  # [r, T/per_byte, per_byte, D]
            codes = codes.reshape(r, t // group, group, D)
        else:
            words = _rows(q, idx)[:, t0:t1]
            s = _rows(s_all, idx)[:, t0:t1].unsqueeze(3)
            m = _rows(m_all, idx)[:, t0:t1].unsqueeze(3)
            packed = words.contiguous().view(torch.uint8).view(r, t, D * bits // 8)
            codes = _codes_of(packed, 3, bits, codes_buf)  # [r, T, D/per_byte, per_byte]
            codes = codes.reshape(r, t, D // group, group)
        y = torch.mul(codes, s, out=work[: codes.numel()].view(codes.shape))  # fp32(code) * s, rounded
        y.add_(m)
        if cap:
            y.clamp_(max=top)
        oc.copy_(y.view(r, t, D))
    return result


def _codes_of(packed: torch.Tensor, dim: int, bits: int, codes_buf: torch.Tensor) -> torch.Tensor:
    """Bytes ``packed`` unpacked into codes (uint8, contiguous) with a new dim of
    ``8 / bits`` at ``dim``, lowest code first."""
    if bits == 8:
        return packed.unsqueeze(dim)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    out = codes_buf[: packed.numel() * per_byte].view(*packed.shape[:dim], per_byte, *packed.shape[dim:])
    if per_byte == 2:
        # int4: a mask and a shift, each into its code's slice (the top code needs no mask).
        # On the 2-core VM 1.1-1.3x one shift over a broadcast of the shifts; for int2's four
        # codes the broadcast below is 1.05-1.1x this.
        torch.bitwise_and(packed, mask, out=out.select(dim, 0))
        torch.bitwise_right_shift(packed, bits, out=out.select(dim, 1))
        return out
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(per_byte, *[1] * (packed.dim() - dim))
    torch.bitwise_right_shift(packed.unsqueeze(dim), shifts, out=out)
    return out.bitwise_and_(mask)
