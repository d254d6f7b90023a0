"""KIVI's V range search (``v_clip``): the same stored format and decoder, a different
encoder, so a different spec and keys; the Triton kernels bit for bit equal to the torch
reference (in the interpreter on a machine without CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import ConfigError
from cacheseek.quant import codec_from_spec
from cacheseek.quant import kivi_reference as ref
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16 = torch.float16


def _v(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """V-like values: Gaussian tokens of varying scale, outlier channels, a constant group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * (0.1 + 3 * torch.rand(*shape[:-1], 1, generator=gen))
    x[..., [1, shape[-1] - 2]] *= 12
    x[..., 0, : min(32, shape[-1])] = 0.75
    return x.to(dtype)


def _group_sq_error(x, q, s, m, *, bits, group):
    """Per V group (last axis): sum of squared decode errors in fp64 over real elements."""
    x_hat = ref.dequantize(q, s, m, bits=bits, group=group, axis=-1, shape=tuple(x.shape), dtype=torch.float32)
    err = (x_hat.double() - x.double()).square()
    n = x.shape[-1]
    pad = -n % group
    err = torch.nn.functional.pad(err, (0, pad))
    return err.reshape(*err.shape[:-1], -1, group).sum(-1)


# -- codec: spec, keys, format -------------------------------------------------------------


def test_off_by_default_keeps_the_spec_and_the_fingerprint():
    plain = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64)
    assert plain == cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64, v_clip=0)
    assert "v_clip" not in plain.spec()
    clipped = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64, v_clip=2)
    assert clipped.spec() == {**plain.spec(), "v_clip": 2}
    assert clipped.fingerprint() != plain.fingerprint()
    assert codec_from_spec(clipped.spec()) == clipped
    assert codec_from_spec(clipped.spec()).fingerprint() == clipped.fingerprint()
    assert "v_clip=2" in repr(clipped) and "v_clip" not in repr(plain)
    # the same stored format: same buffers, same bytes per block
    layout = cs.KVLayout(30, 3, 64, "float32")
    assert clipped.encoded_nbytes(layout, 2048) == plain.encoded_nbytes(layout, 2048)
    assert clipped.template((3, 128, 64), "float32").nbytes == plain.template((3, 128, 64), "float32").nbytes


@pytest.mark.parametrize("bad", [-1, 7, True, 2.5, "2", None])
def test_bad_v_clip_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="v_clip"):
        cs.KIVI(v_clip=bad)


@pytest.mark.parametrize("bad", [0, 7, True, "2", None])
def test_spec_with_a_bad_v_clip_is_refused(bad):
    with pytest.raises(ConfigError, match="v_clip"):
        codec_from_spec({**cs.KIVI().spec(), "v_clip": bad})
    with pytest.raises(ConfigError, match="expected keys"):
        codec_from_spec({**cs.KIVI().spec(), "k_clip": 2})


def test_reference_refuses_a_clip_out_of_range_or_on_k():
    with pytest.raises(ValueError, match="clip"):
        ref.quantize(torch.zeros(1, 4, 64), bits=2, group=64, axis=-1, stats_dtype=F16, clip=7)
    with pytest.raises(ValueError, match="only V"):
        ref.quantize(torch.zeros(1, 64, 64), bits=2, group=64, axis=AXIS_TOKENS, stats_dtype=F16, clip=2)


def test_keys_only_v_changes_and_it_decodes_with_the_same_decoder():
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 128, 64, generator=gen), _v((2, 128, 64), seed=4)
    plain = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64)
    clipped = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64, v_clip=2)
    a, b = plain.encode(k, v), clipped.encode(k, v)
    bufs_a, bufs_b = [t for _, _, t in a.named_buffers()], [t for _, _, t in b.named_buffers()]
    for x, y in zip(bufs_a[:3], bufs_b[:3]):
        assert torch.equal(x, y)  # K untouched
    assert not torch.equal(bufs_a[4], bufs_b[4])  # V's scales moved (outlier-heavy groups shrink)
    k_hat, v_hat = clipped.decode(b)
    vq, vs, vm = bufs_b[3:]
    assert torch.equal(v_hat, ref.dequantize(vq, vs, vm, bits=2, group=64, axis=AXIS_CHANNELS, shape=(2, 128, 64),
                                             dtype=torch.float32))
    err_plain = _group_sq_error(v, *bufs_a[3:], bits=2, group=64)
    err_clip = _group_sq_error(v, *bufs_b[3:], bits=2, group=64)
    assert bool((err_clip <= err_plain).all()) and float(err_clip.sum()) < 0.9 * float(err_plain.sum())


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([32, 64, 128]), D=st.sampled_from([32, 64, 80, 128]),
       clip=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       stats=st.sampled_from([torch.float16, torch.float32]))
def test_the_kept_range_never_decodes_worse_and_more_steps_never_hurt(bits, group, D, clip, seed, scale, stats):
    # The search keeps the least squared error per group among ranges that include min/max's:
    # never worse than min/max, and never worse with more steps (a superset of candidates).
    x = _v((2, 8, D), seed) * scale
    kw = dict(bits=bits, group=group, axis=-1, stats_dtype=stats)
    e0 = _group_sq_error(x, *ref.quantize(x, **kw), bits=bits, group=group)
    prev = e0
    for c in sorted({clip, min(clip + 1, 6)}):
        e = _group_sq_error(x, *ref.quantize(x, clip=c, **kw), bits=bits, group=group)
        # (the search adds in fp64 as here, up to the order of the sums)
        assert bool((e <= prev * (1 + 1e-9) + 1e-300).all())
        prev = e
    if group == 32:  # token 0's first group is constant: every candidate is min/max's range
        assert torch.equal(prev[..., 0, 0], e0[..., 0, 0])


def test_reference_ignores_ragged_padding():
    # D=80, G=64: the last group holds 16 channels; its padding (copies of the last) does
    # not count: the same choice as for those 16 channels alone.
    x = _v((3, 16, 80), seed=11)
    q, s, m = ref.quantize(x, bits=2, group=64, axis=-1, stats_dtype=F16, clip=3)
    q2, s2, m2 = ref.quantize(x[..., 64:].contiguous(), bits=2, group=32, axis=-1, stats_dtype=F16, clip=3)
    # a 16-channel tail in a 32 group: padded with 16 copies there too, ignored alike
    assert torch.equal(s[..., 1], s2[..., 0]) and torch.equal(m[..., 1], m2[..., 0])


# -- kernels: bit for bit the reference ------------------------------------------------------


def _kernels():
    pytest.importorskip("triton")
    from cacheseek import kernels

    return kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bits, group, D", [(2, 64, 64), (2, 64, 80), (2, 32, 128), (4, 32, 64), (4, 128, 64),
                                            (8, 64, 96)])
@pytest.mark.parametrize("clip", [1, 2, 6])
def test_kernel_matches_the_reference_bit_for_bit(dtype, bits, group, D, clip):
    kernels = _kernels()
    stats = torch.float32 if dtype == torch.float32 and clip == 6 else F16
    x = _v((2, 24, D), seed=bits * 100 + D + clip, dtype=dtype)
    x[0, 3] = 1e-6 * torch.randn(D).to(dtype)  # tiny (fp16-subnormal stats)
    x[1, 5] = (1e3 + torch.randn(D) * 10).to(dtype)  # large, narrow
    x = x.to(DEVICE)
    kw = dict(bits=bits, group=group, axis=AXIS_CHANNELS, stats_dtype=stats, clip=clip)
    got, want = kernels.quantize(x, **kw), ref.quantize(x, **kw)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_kernel_layers_and_pages_paths_match_the_reference():
    kernels = _kernels()
    from cacheseek.kernels import BlockPages, PagedLayers

    L, H, B, D, n = 2, 2, 64, 64, 2
    gen = torch.Generator().manual_seed(21)
    layers = [_v((H, (n + 1) * B, D), seed=30 + i).to(F16).to(DEVICE) for i in range(L)]
    want = ref.quantize(torch.stack(layers)[:, :, B:].unflatten(2, (n, B)).permute(2, 0, 1, 3, 4),
                        bits=2, group=64, axis=AXIS_CHANNELS, stats_dtype=F16, clip=2)
    out = tuple(torch.full_like(w, -1) for w in want)
    ok = torch.ones(1, dtype=torch.bool, pin_memory=DEVICE == "cuda")
    kernels.quantize_layers(layers, B, n, B, bits=2, group=64, axis=AXIS_CHANNELS, out=out, ok_flag=ok, clip=2)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert ok.item() and all(torch.equal(a, b) for a, b in zip(out, want))

    # the same blocks in an engine's pages of 16 tokens (NHD views [pages, page, H, D]), shuffled
    page, pages_per = 16, B // 16
    num = (n + 1) * pages_per
    order = torch.randperm(num, generator=gen).tolist()
    views = []
    for layer in layers:
        paged = torch.empty(num, page, H, D, dtype=F16, device=DEVICE)
        for p in range(num):
            paged[order[p]] = layer[:, p * page:(p + 1) * page].transpose(0, 1)
        views.append(paged)
    rows = torch.tensor([[b * pages_per, 0] for b in range(1, n + 1)], dtype=torch.int32)
    where = BlockPages.build(torch.tensor(order, dtype=torch.int32), rows, page_size=page, num_pages=num,
                             block_tokens=B, device=torch.device(DEVICE))
    got = tuple(torch.full_like(w, -1) for w in want)
    oks = torch.ones(n, dtype=torch.bool, pin_memory=DEVICE == "cuda")
    kernels.quantize_pages(PagedLayers(views), where, 0, n, B, bits=2, group=64, axis=AXIS_CHANNELS, out=got,
                           ok_flags=oks, clip=2)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert oks.all() and all(torch.equal(a, b) for a, b in zip(got, want))


def test_kernels_refuse_a_clip_on_k():
    kernels = _kernels()
    with pytest.raises(ValueError, match="clip"):
        kernels.quantize(torch.zeros(1, 64, 64, device=DEVICE), bits=4, group=64, axis=AXIS_TOKENS,
                         stats_dtype=F16, clip=2)
    with pytest.raises(ValueError, match="clip"):
        kernels.quantize(torch.zeros(1, 64, 64, device=DEVICE), bits=4, group=64, axis=AXIS_CHANNELS,
                         stats_dtype=F16, clip=9)


def test_codec_through_the_kernels_equals_the_torch_path(monkeypatch):
    _kernels()
    from cacheseek.quant import backend

    codec = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_clip=2)
    k = torch.randn(2, 64, 80, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    v = _v((2, 64, 80), seed=6, dtype=torch.bfloat16).to(DEVICE)
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    want = codec.encode(k, v)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    got = codec.encode(k, v)
    for (_, _, a), (_, _, b) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # (the interpreter's, at -Inf)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("low", [-66048.0, -70000.0])
def test_a_group_whose_range_the_stats_cannot_hold_is_rejected_whatever_the_clip(monkeypatch, dtype, low):
    # fp16 stats cannot hold the min of a group reaching below -65504 (its range 0 stores m =
    # -Inf, so the codec rejects the KV), but a shrunk range's low end can fit: the search took
    # it (its error beat range 0's Inf), clamping the values below it, so whether the KV was
    # stored depended on v_clip and on how far the group reached (-66048 from clip 1 on,
    # -70000 from clip 3). Range 0 is kept for such a group, rejected as with v_clip=0.
    kernels = _kernels()
    from cacheseek.quant import backend

    x = _v((2, 4, 64), seed=9, dtype=dtype)
    x[0, 1, 7] = low  # row (0, 1) is one group of 64 channels
    x = x.to(DEVICE)
    for clip in range(ref.MAX_CLIP + 1):
        kw = dict(bits=4, group=64, axis=AXIS_CHANNELS, stats_dtype=F16, clip=clip)
        want, got = ref.quantize(x, **kw), kernels.quantize(x, **kw)
        _, s, m = want
        assert not (torch.isfinite(s[0, 1]).all() and torch.isfinite(m[0, 1]).all()), clip
        for a, b in zip(got, want):
            a, b = a.clone(), b.clone()
            a[0, 1] = b[0, 1] = 0  # (the rejected group's codes are no one's)
            assert torch.isfinite(b.float()).all() and torch.equal(a, b), clip  # every other group alike
        k = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(clip)).to(dtype).to(DEVICE)
        v = torch.cat([x, x[:, :1].expand(2, 60, 64)], dim=1)  # 64 tokens: K's group
        for name in ("torch", "triton"):
            monkeypatch.setenv(backend.BACKEND_ENV, name)
            with pytest.raises(cs.InputError, match=r"^v: a group whose min or range/levels is beyond float16 stats "
                                                     r"\(finite values past 65504: use stats_dtype='float32'\); "
                                                     r"input rejected$"):
                cs.KIVI(bits=4, group_size=64, v_clip=clip).encode(k, v)
