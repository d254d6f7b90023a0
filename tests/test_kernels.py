"""The Triton KIVI kernels against the torch reference (the specification).

On a machine without CUDA these run in the Triton interpreter (conftest sets
TRITON_INTERPRET=1), so shapes are tiny: one or two groups of tokens, one or two rows.
On a CUDA machine the same tests run natively.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import cacheseek as cs  # noqa: E402
from cacheseek import kernels  # noqa: E402
from cacheseek.errors import InputError  # noqa: E402
from cacheseek.kernels import _strides  # noqa: E402
from cacheseek.quant import backend  # noqa: E402
from cacheseek.quant import kivi_reference as ref  # noqa: E402
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS  # noqa: E402

# The interpreter runs masked-out lanes' arithmetic (inf - inf on padding) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_DIMS = [64, 80, 96, 128, 256]
AXES = [AXIS_TOKENS, AXIS_CHANNELS]
F16 = torch.float16


def _data(dtype, group: int, D: int, seed: int) -> torch.Tensor:
    """[1, T, D] (one or two token groups) with the cases that matter: Gaussian, outlier
    channels (x15), constant groups (also a ragged last V group), large values near 1e4
    and tiny ones near 1e-6 (fp16-subnormal stats)."""
    T = 2 * group if group < 128 else group
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=gen)
    x[..., [3, 17, D - 1]] *= 15  # outlier channels
    x[0, :group, 1] = 0.375  # one whole K group (channel 1, first token group)
    x[0, 0, :group] = -1.25  # one whole V group
    last = (D - 1) // group * group
    x[0, 1, last:] = 2.5  # the last (possibly ragged) V group
    x[0, 2, :] = torch.randn(D, generator=gen) * 1e-6  # tiny
    x[0, 3, :] = 1e4 + torch.randn(D, generator=gen) * 10  # large, narrow range
    x[0, 4:8, 5] = 1e4 * torch.randn(4, generator=gen)  # a large K outlier
    x[0, group:, 9] = 1e-6 * torch.randn(T - group, generator=gen)  # a tiny K group (if T > G)
    return x.to(dtype).to(DEVICE)


def _codes(q: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    return ref._unpack_last(q.movedim(axis, -1), bits).movedim(-1, axis)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    return (torch.nextafter(t, torch.full_like(t, math.inf)) - t).float()


def _expand_stats(st: torch.Tensor, group: int, axis: int, n: int) -> torch.Tensor:
    return st.movedim(axis, -1).float().repeat_interleave(group, -1)[..., :n].movedim(-1, axis)


def assert_matches_reference(x, *, bits, group, axis, stats_dtype):
    """Codes identical except at exact rounding ties, stats identical (within an ulp),
    decodes within one quantization step of the reference's (and of our own payload,
    bit-identical to the reference's decode of it)."""
    q, s, m = kernels.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=stats_dtype)
    rq, rs, rm = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=stats_dtype)
    for got, want in ((q, rq), (s, rs), (m, rm)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    for got, want in ((s, rs), (m, rm)):
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        if not bool(same.all()):
            assert bool(((got.float() - want.float()).abs() <= _ulp(want))[~same].all()), "stats differ"

    codes, rcodes = _codes(q, bits, axis), _codes(rq, bits, axis)
    diff = codes != rcodes
    if bool(diff.any()):
        assert diff.float().mean() < 1e-3, f"{int(diff.sum())} codes differ"
        assert bool(((codes - rcodes).abs()[diff] == 1).all())
        # a mismatch is only allowed where the reference's quotient is a tie (k + 1/2)
        n = x.shape[axis]
        quotient = (x.double() - _expand_stats(rm, group, axis, n)) / _expand_stats(rs, group, axis, n)
        assert bool(((quotient - quotient.floor() - 0.5).abs()[diff] < 1e-6).all()), "non-tie code mismatch"

    shape = tuple(x.shape)
    x_hat = kernels.dequantize(q, s, m, bits=bits, group=group, axis=axis, shape=shape, dtype=x.dtype)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert torch.equal(x_hat, ref.dequantize(q, s, m, bits=bits, group=group, axis=axis, shape=shape, dtype=x.dtype))
    want = ref.dequantize(rq, rs, rm, bits=bits, group=group, axis=axis, shape=shape, dtype=x.dtype)
    step = _expand_stats(rs, group, axis, x.shape[axis])
    assert bool(((x_hat.float() - want.float()).abs() <= step * 1.001 + _ulp(want.abs())).all())
    return q, s, m


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_matches_reference(bits, group, dtype, D):
    x = _data(dtype, group, D, seed=bits * 1000 + group + D)
    # fp32 stats where the values need them least often: keeps both dtypes exercised
    stats = torch.float32 if dtype == torch.float32 else F16
    for axis in AXES:
        assert_matches_reference(x, bits=bits, group=group, axis=axis, stats_dtype=stats)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [2, 8])
def test_fp32_stats_and_bf16_extremes(bits, dtype):
    x = _data(dtype, 32, 80, seed=bits)
    if dtype == torch.bfloat16:
        x[0, 8:12] *= 1e6  # ranges beyond fp16: fp32 stats hold them
    for axis in AXES:
        assert_matches_reference(x, bits=bits, group=32, axis=axis, stats_dtype=torch.float32)


@pytest.mark.parametrize("axis", AXES)
def test_round_half_to_even(axis):
    # One group of 32, range 0..3 at 2 bits: step 1, so x.5 values are exact ties.
    row = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5] + [1.0] * 27, device=DEVICE)
    x = row.view(1, 1, 32) if axis == AXIS_CHANNELS else row.view(1, 32, 1).expand(1, 32, 16).contiguous()
    q, s, m = kernels.quantize(x, bits=2, group=32, axis=axis, stats_dtype=F16)
    codes = _codes(q, 2, axis)
    first = codes[0, 0, :5] if axis == AXIS_CHANNELS else codes[0, :5, 0]
    assert first.tolist() == [0, 3, 0, 2, 2]


@pytest.mark.parametrize("axis", AXES)
def test_constant_groups_decode_exactly(axis):
    x = torch.full((1, 64, 80), 3.140625, dtype=F16, device=DEVICE)
    q, s, m = kernels.quantize(x, bits=4, group=64, axis=axis, stats_dtype=F16)
    assert bool((s == 0).all()) and bool((q == 0).all())
    x_hat = kernels.dequantize(q, s, m, bits=4, group=64, axis=axis, shape=x.shape, dtype=x.dtype)
    assert torch.equal(x_hat, x)


@pytest.mark.parametrize("stats", [F16, torch.float32], ids=str)
@pytest.mark.parametrize("axis", AXES)
def test_zero_groups_store_plus_zero_stats_on_both_backends(axis, stats):
    # Groups of zeros of both signs, in every arrangement the reductions could see: which
    # sign a min or max returns depends on its order, so each backend could store another.
    gen = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (1, 64, 128), generator=gen).bool()
    x = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0)).to(F16)
    x[0, :32, :32] = -0.0  # all negative zeros
    x[0, 32:, 32:64] = 0.0  # all positive zeros
    x = x.to(DEVICE)
    got = kernels.quantize(x, bits=4, group=32, axis=axis, stats_dtype=stats)
    want = ref.quantize(x, bits=4, group=32, axis=axis, stats_dtype=stats)
    bits = torch.int16 if stats == F16 else torch.int32
    for g, w in zip(got, want):
        assert torch.equal(g.view(bits) if g.is_floating_point() else g, w.view(bits) if w.is_floating_point() else w)
    _, s, m = got
    assert not bool(torch.signbit(s).any()) and not bool(torch.signbit(m).any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stats", ["float16", "float32"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["k", "v"])
def test_codec_rejects_nan_and_inf_through_the_kernels(monkeypatch, where, bad, stats, dtype):
    # (bf16 V with a NaN was accepted in the interpreter, whose bf16 NaN == NaN holds)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    k = torch.randn(1, 64, 64, device=DEVICE).to(dtype)
    v = torch.randn(1, 64, 64, device=DEVICE).to(dtype)
    (k if where == "k" else v)[0, 33, 7] = bad
    with pytest.raises(InputError, match="NaN or Inf"):
        cs.KIVI(bits=4, group_size=32, stats_dtype=stats).encode(k, v)


def test_codec_dispatches_to_the_kernels_and_matches_the_torch_path(monkeypatch):
    calls = []
    for name in ("quantize", "dequantize"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, spy)
    codec = cs.KIVI(k_bits=2, v_bits=4, k_group_size=32, v_group_size=64)
    k = torch.cat([_data(torch.bfloat16, 32, 80, seed=1), _data(torch.bfloat16, 32, 80, seed=3)])
    v = _data(torch.bfloat16, 64, 80, seed=2)[:, :64].expand(2, 64, 80)

    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    want = codec.encode(k, v)
    want_k, want_v = codec.decode(want)
    assert calls == []

    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    assert backend.backend_for(k) == "triton"
    got = codec.encode(k, v)
    got_k, got_v = codec.decode(got)
    assert calls == ["quantize", "quantize", "dequantize", "dequantize"]
    for (_, _, a), (_, _, b) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(a, b)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


# -- strided views: the store's zero-copy pipeline ---------------------------------------

L, H, N, B, D = 2, 2, 3, 64, 64  # layers, heads, blocks, block tokens, head dim


def _blocks_view(base: torch.Tensor) -> torch.Tensor:
    """[N, L, H, B, D] view of a [L, H, >= N*B, D] tensor: block i is tokens [i*B, (i+1)*B)."""
    return base[:, :, : N * B].view(L, H, N, B, D).permute(2, 0, 1, 3, 4)


def test_block_view_is_two_strided_levels_without_a_copy():
    x = _blocks_view(torch.empty(L, H, N * B, D))
    q_strides = _strides.contiguous_strides((N, L, H, B // 8, D))
    levels = _strides.collapse(x.shape[:-2], [x.stride(), q_strides])
    assert levels is not None and (levels.A, levels.C) == (N, L * H)
    assert levels.strides == ((B * D, N * B * D), (L * H * B // 8 * D, B // 8 * D))
    # three strided levels need a copy
    y = _three_levels(torch.empty(2, 3, 2, B, D))
    assert _strides.collapse(y.shape[:-2], [y.stride(), _strides.contiguous_strides(y.shape)]) is None


def _three_levels(base: torch.Tensor) -> torch.Tensor:
    """[2, 2, 2, T, D] out of a [2, 3, 2, T, D] tensor, with leading strides that merge
    nowhere: (TD, 6TD, 2TD)."""
    return base.permute(2, 0, 1, 3, 4)[:, :, :2]


@pytest.mark.parametrize("axis,bits,group", [(AXIS_TOKENS, 4, 32), (AXIS_CHANNELS, 2, 64)])
def test_quantize_a_block_view_of_the_kv_tensor(axis, bits, group):
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(L, H, N * B, D, generator=gen).to(F16).to(DEVICE)
    x = _blocks_view(base)
    assert not x.is_contiguous()
    got = kernels.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=F16)
    want = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=F16)
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)


@pytest.mark.parametrize("axis,bits,group,dtype", [(AXIS_TOKENS, 4, 32, F16), (AXIS_CHANNELS, 2, 64, F16),
                                                   (AXIS_TOKENS, 8, 32, torch.bfloat16), (AXIS_CHANNELS, 4, 32, torch.float32)])
def test_quantize_layers_reads_separate_layer_tensors_into_staging_rows(axis, bits, group, dtype):
    # A model's layers are separate [H, T, D] tensors (with room after T, as a growing
    # cache has); blocks 1..N of them go into rows of a staging buffer at a padded stride.
    gen = torch.Generator().manual_seed(13)
    layers = [torch.randn(H, (N + 2) * B, D, generator=gen).to(dtype).to(DEVICE)[:, : (N + 1) * B] for _ in range(L)]
    want = ref.quantize(torch.stack(layers)[:, :, B:].unflatten(2, (N, B)).permute(2, 0, 1, 3, 4),
                        bits=bits, group=group, axis=axis, stats_dtype=F16)
    out = tuple(_packed_at_stride(torch.full_like(w, -1), pad) for w, pad in zip(want, (5, 3, 3)))
    # scale and min share strides: give them the same padding
    ok = _ok_flag()
    kernels.quantize_layers(layers, B, N, B, bits=bits, group=group, axis=axis, out=out, ok_flag=ok)
    for a, b in zip(out, want):
        assert torch.equal(a, b)
    _sync()
    assert ok.item()


def _ok_flag() -> torch.Tensor:
    return torch.ones(1, dtype=torch.bool, pin_memory=DEVICE == "cuda")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e30])
def test_quantize_layers_clears_the_host_flag_for_stats_that_are_not_finite(axis, bad):
    gen = torch.Generator().manual_seed(17)
    layers = [torch.randn(H, 3 * B, D, generator=gen).to(torch.float32).to(DEVICE) for _ in range(L)]
    layers[1][0, 0, 5] = bad  # block 0: outside the range quantized below
    want = ref.quantize(torch.zeros(N - 1, L, H, B, D, device=DEVICE), bits=4, group=32, axis=axis, stats_dtype=F16)
    out = tuple(torch.empty_like(w) for w in want)
    ok = _ok_flag()
    kernels.quantize_layers(layers, B, N - 1, B, bits=4, group=32, axis=axis, out=out, ok_flag=ok)
    _sync()
    assert ok.item(), "a bad value outside the blocks quantized cleared the flag"
    layers[1][1, 2 * B + 7, 9] = bad  # inside the last block (1e30: a range fp16 stats cannot hold)
    kernels.quantize_layers(layers, B, N - 1, B, bits=4, group=32, axis=axis, out=out, ok_flag=ok)
    _sync()
    assert not ok.item()


def test_quantize_layers_rejects_mismatched_layers_and_outputs():
    layers = [torch.zeros(H, 2 * B, D, dtype=F16, device=DEVICE) for _ in range(L)]
    q, s, m = ref.quantize(torch.zeros(1, L, H, B, D, dtype=F16, device=DEVICE), bits=4, group=32, axis=AXIS_TOKENS,
                           stats_dtype=F16)
    with pytest.raises(ValueError, match="layers\\[1\\]"):
        kernels.quantize_layers([layers[0], layers[1][:, :B]], 0, 1, B, bits=4, group=32, axis=AXIS_TOKENS,
                                out=(q[:, :2], s[:, :2], m[:, :2]), ok_flag=_ok_flag())
    with pytest.raises(ValueError, match="outside"):
        kernels.quantize_layers(layers, B, 2, B, bits=4, group=32, axis=AXIS_TOKENS, out=(q, s, m), ok_flag=_ok_flag())
    with pytest.raises(ValueError, match="out q"):
        kernels.quantize_layers(layers, 0, 1, B, bits=4, group=32, axis=AXIS_CHANNELS, out=(q, s, m),
                                ok_flag=_ok_flag())


OTHER = "cpu" if DEVICE == "cuda" else "meta"  # a device the layers are not on


def test_quantize_layers_refuses_outputs_or_a_flag_it_cannot_write_before_the_launch():
    """``out`` was checked for its shapes and dtypes, not its device: outputs on another
    device than the layers were written through pointers the kernel cannot use (on a GPU
    into host memory: an illegal address that ends the process's CUDA context), or,
    interpreted, failed deep in Triton. A flag of a dtype wider than a byte had its first
    byte cleared, which a float 1.0 reads as still set (a NaN found and not reported). Now
    each is a ``ValueError`` naming it, before the launch: nothing is written."""
    layers = [torch.zeros(H, 2 * B, D, dtype=F16, device=DEVICE) for _ in range(L)]
    q, s, m = (torch.full_like(t, -1) for t in ref.quantize(
        torch.zeros(1, L, H, B, D, dtype=F16, device=DEVICE), bits=4, group=32, axis=AXIS_TOKENS, stats_dtype=F16))
    for out in ((q.to(OTHER), s.to(OTHER), m.to(OTHER)), (q, s.to(OTHER), m)):
        with pytest.raises(ValueError, match=f"out: .*on the layers' device {DEVICE}"):
            kernels.quantize_layers(layers, 0, 1, B, bits=4, group=32, axis=AXIS_TOKENS, out=out, ok_flag=_ok_flag())
    with pytest.raises(ValueError, match="ok_flag"):
        kernels.quantize_layers(layers, 0, 1, B, bits=4, group=32, axis=AXIS_TOKENS, out=(q, s, m),
                                ok_flag=torch.ones(1, dtype=torch.float32, pin_memory=DEVICE == "cuda"))
    assert all(bool((t == -1).all()) for t in (q, s, m))  # nothing written
    rows = torch.full((1, L, H, B, D), -1.0, dtype=F16, device=DEVICE)
    with pytest.raises(ValueError, match="ok_flag"):  # (the Raw codec's gather: the same flag)
        kernels.gather_layers(layers, 0, 1, B, out=rows, ok_flag=torch.ones(1, dtype=torch.float32))
    assert bool((rows == -1).all())


def test_offset_tables_made_by_threads_at_once_past_the_cache_limit_never_raise():
    """``offsets_table`` keeps the last 64 device tables, dropping the oldest as it adds one,
    with no lock: two threads adding at once (a server's ingests) each checked the size and
    then added, so the cache grew past its bound (device memory kept for good), or both took
    the same oldest key and the second pop raised ``KeyError`` out of its ingest. Now the
    drop and the add are one step."""
    import threading

    from cacheseek.kernels import layers as layer_tables
    from store_helpers import switching_at_lines

    layer_tables._OFFSET_TABLES.clear()
    for i in range(64):  # full: every new table drops one
        layer_tables.offsets_table(torch.device("cpu"), (-1, -i - 1))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def make(t: int) -> None:
        barrier.wait()
        try:
            for i in range(200):
                offsets = (t, i)
                got = layer_tables.offsets_table(torch.device("cpu"), offsets)
                assert got.tolist() == list(offsets)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    with switching_at_lines(layer_tables):
        threads = [threading.Thread(target=make, args=(t,), daemon=True) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors
    assert len(layer_tables._OFFSET_TABLES) == 64


# -- gather_layers: the Raw codec's read of the layers in place ----------------------------


@pytest.mark.parametrize("dtype,head_dim", [(F16, 128), (torch.bfloat16, 80), (torch.float32, 64)], ids=str)
def test_gather_layers_copies_blocks_of_separate_layers_into_staging_rows(dtype, head_dim):
    # Layers with room after T (a growing cache); blocks 1..N go into rows at a padded
    # stride, and nothing outside the rows' blocks is written.
    gen = torch.Generator().manual_seed(19)
    layers = [torch.randn(H, (N + 2) * B, head_dim, generator=gen).to(dtype).to(DEVICE)[:, : (N + 1) * B]
              for _ in range(L)]
    want = torch.stack(layers)[:, :, B:].unflatten(2, (N, B)).permute(2, 0, 1, 3, 4)
    out = _packed_at_stride(torch.full((N, L, H, B, head_dim), -7.0, dtype=dtype, device=DEVICE), 9)  # pads: 0
    ok = _ok_flag()
    kernels.gather_layers(layers, B, N, B, out=out, ok_flag=ok)
    _sync()
    assert torch.equal(out, want) and ok.item()
    padding = out.as_strided((N, 9), (out.stride(0), 1), out.storage_offset() + L * H * B * head_dim)
    assert bool((padding == 0).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_gather_layers_clears_the_host_flag_for_nan_and_inf(bad):
    layers = [torch.randn(H, 3 * B, D, generator=torch.Generator().manual_seed(i)).to(F16).to(DEVICE) for i in range(L)]
    layers[1][0, 0, 5] = bad  # block 0: outside the blocks gathered below
    out = torch.empty(N - 1, L, H, B, D, dtype=F16, device=DEVICE)
    ok = _ok_flag()
    kernels.gather_layers(layers, B, N - 1, B, out=out, ok_flag=ok)
    _sync()
    assert ok.item(), "a bad value outside the blocks gathered cleared the flag"
    layers[L - 1][H - 1, 3 * B - 1, D - 1] = bad  # the very last element gathered
    kernels.gather_layers(layers, B, N - 1, B, out=out, ok_flag=ok)
    _sync()
    assert not ok.item()


def test_gather_layers_rejects_mismatched_outputs():
    layers = [torch.zeros(H, 2 * B, D, dtype=F16, device=DEVICE) for _ in range(L)]
    out = torch.empty(1, L, H, B, D, dtype=F16, device=DEVICE)
    with pytest.raises(ValueError, match="outside"):
        kernels.gather_layers(layers, B, 2, B, out=out, ok_flag=_ok_flag())
    with pytest.raises(ValueError, match="out: expected"):
        kernels.gather_layers(layers, 0, 1, B, out=out.float(), ok_flag=_ok_flag())
    with pytest.raises(ValueError, match="strides"):
        kernels.gather_layers(layers, 0, 1, B, out=out.transpose(1, 2).contiguous().transpose(1, 2), ok_flag=_ok_flag())


def _packed_at_stride(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` ([N, ...]) copied into one flat buffer at a fixed stride of numel + pad per
    block (as frames land in one device buffer), returned as an as_strided view."""
    per = t[0].numel()
    buf = torch.full((N * (per + pad),), 0, dtype=t.dtype, device=t.device)
    view = torch.as_strided(buf, t.shape, (per + pad, *t[0].stride()))
    view.copy_(t)
    return view


@pytest.mark.parametrize("axis,bits,group", [(AXIS_TOKENS, 8, 64), (AXIS_CHANNELS, 4, 32)])
@pytest.mark.parametrize("dtype", [F16, torch.bfloat16], ids=str)
def test_dequantize_strided_payloads_into_a_block_view(axis, bits, group, dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(N, L, H, B, D, generator=gen).to(dtype).to(DEVICE)
    q, s, m = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=F16)
    qv, sv, mv = _packed_at_stride(q, 5), _packed_at_stride(s, 3), _packed_at_stride(m, 7)
    assert not qv.is_contiguous()

    guard = 6  # tokens after the blocks that must stay untouched
    base = torch.full((L, H, N * B + guard, D), math.nan, dtype=dtype, device=DEVICE)
    base[:, :, N * B:] = -7.0
    out = _blocks_view(base)
    got = kernels.dequantize(qv, sv, mv, bits=bits, group=group, axis=axis, shape=x.shape, dtype=dtype, out=out)
    assert got is out
    want = ref.dequantize(q, s, m, bits=bits, group=group, axis=axis, shape=x.shape, dtype=dtype)
    assert not bool(torch.isnan(base[:, :, : N * B]).any()), "an element of out was not written"
    assert torch.equal(out, want)
    assert bool((base[:, :, N * B:] == -7.0).all()), "wrote outside out"


def test_three_strided_levels_fall_back_to_a_copy_and_stay_correct():
    gen = torch.Generator().manual_seed(3)
    x = _three_levels(torch.randn(2, 3, 2, 32, 64, generator=gen).to(F16).to(DEVICE))
    for axis in AXES:
        assert_matches_reference(x, bits=4, group=32, axis=axis, stats_dtype=F16)
    out_base = torch.full((2, 3, 2, 32, 64), math.nan, dtype=F16, device=DEVICE)
    out = _three_levels(out_base)
    q, s, m = kernels.quantize(x, bits=4, group=32, axis=AXIS_CHANNELS, stats_dtype=F16)
    kernels.dequantize(q, s, m, bits=4, group=32, axis=AXIS_CHANNELS, shape=x.shape, dtype=F16, out=out)
    assert torch.equal(out, ref.dequantize(q, s, m, bits=4, group=32, axis=AXIS_CHANNELS, shape=x.shape, dtype=F16))
    assert bool(torch.isnan(out_base[:, 2:]).all())



@pytest.mark.parametrize("axis", AXES)
def test_an_out_whose_elements_overlap_is_refused_as_the_reference_refuses_it(axis):
    """``out`` expanded from one row (stride 0): the reference's ``out.copy_`` refuses it;
    the kernel wrote every row's decode into the one row, the last program's winning, and
    returned it as the decode. Now the kernels refuse it the same way, through the copy."""
    x = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(4)).to(F16).to(DEVICE)
    q, s, m = ref.quantize(x, bits=4, group=32, axis=axis, stats_dtype=F16)
    for out in (torch.zeros(1, 2, 64, 64, dtype=F16, device=DEVICE).expand(2, 2, 64, 64),
                torch.zeros(2, 2, 1, 64, dtype=F16, device=DEVICE).expand(2, 2, 64, 64)):
        with pytest.raises(RuntimeError, match="single memory location"):
            ref.dequantize(q, s, m, bits=4, group=32, axis=axis, shape=x.shape, dtype=F16, out=out)
        with pytest.raises(RuntimeError, match="single memory location"):
            kernels.dequantize(q, s, m, bits=4, group=32, axis=axis, shape=x.shape, dtype=F16, out=out)

def test_leading_dims_of_any_rank_and_empty_inputs():
    x = _data(F16, 32, 64, seed=5)
    for t in (x[0], x.reshape(1, 2, 1, 32, 64)):
        assert_matches_reference(t, bits=4, group=32, axis=AXIS_TOKENS, stats_dtype=F16)
    empty = torch.empty(0, 2, 32, 64, dtype=F16, device=DEVICE)
    q, s, m = kernels.quantize(empty, bits=4, group=32, axis=AXIS_CHANNELS, stats_dtype=F16)
    assert q.shape == (0, 2, 32, 8) and s.shape == (0, 2, 32, 2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: kernels.quantize(x, bits=3, group=32, axis=-1, stats_dtype=F16), "bits"),
        (lambda x: kernels.quantize(x, bits=4, group=48, axis=-1, stats_dtype=F16), "group"),
        (lambda x: kernels.quantize(x, bits=4, group=32, axis=0, stats_dtype=F16), "axis"),
        (lambda x: kernels.quantize(x[:, :40], bits=4, group=32, axis=-2, stats_dtype=F16), "T=40"),
        (lambda x: kernels.quantize(x[..., :36], bits=4, group=32, axis=-1, stats_dtype=F16), "D=36"),
        (lambda x: kernels.quantize(x, bits=4, group=32, axis=-1, stats_dtype=torch.bfloat16), "stats_dtype"),
        (lambda x: kernels.dequantize(torch.zeros(1, 64, 4, dtype=torch.int32, device=x.device),
                                      torch.zeros(1, 64, 2, dtype=F16, device=x.device),
                                      torch.zeros(1, 64, 2, dtype=F16, device=x.device),
                                      bits=4, group=32, axis=-1, shape=(1, 64, 64), dtype=F16), "q: expected shape"),
    ],
)
def test_bad_arguments_name_the_problem(call, match):
    x = torch.zeros(1, 64, 64, dtype=F16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        call(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above compiles the kernels")
def test_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter accepts code the GPU compiler rejects; compile ahead of time with
    # triton's bundled ptxas (a separate process: this one imported triton interpreted).
    script = Path(__file__).resolve().parents[1] / "scripts" / "kernels_sm90.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), "--quick"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    # the four kernels, quantize through a layer table, each kernel in pages of 16 and of 1,
    # V quantize with its range search (v_clip), and Raw's gather and scatter in pages (the
    # gather of fp8, as bytes, with each fp8's NaN/Inf bits too)
    assert "21/21 compiled for sm_90" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="writes pinned host memory from a CUDA kernel")
def test_store_to_host_writes_pinned_memory_from_the_device():
    src = torch.tensor([True, False, True], device="cuda")
    dst = torch.zeros(3, dtype=torch.bool, pin_memory=True)
    kernels.store_to_host(src, dst)
    torch.cuda.synchronize()
    assert dst.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="pinned host memory"):
        kernels.store_to_host(src, torch.zeros(3, dtype=torch.bool, device="cuda"))
