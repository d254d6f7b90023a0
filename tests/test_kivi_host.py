"""``quant.kivi_host`` (KIVI for KV on the CPU) against ``kivi_reference`` (the
specification the GPU kernels match), bit for bit: codes, stats and decoded values, over
random shapes, bits, groups, dtypes, stats dtypes, strides, chunk sizes and the values
where rounding decides (constant groups, ranges that underflow the stats, the dtype's max,
signed zeros), and NaN/Inf still refused with nothing stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import InputError
from cacheseek.quant import kivi_host as host
from cacheseek.quant import kivi_reference as ref
from cacheseek.quant.backend import ops_for

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KINDS = ("normal", "constant", "tiny", "huge", "zeros")
# Where ``quantize(..., out=)`` writes: rows with gaps between them (as a staging buffer's rows,
# a layer of [n, L, H, ...] views), or views whose last dim is not unit-stride.
INTO = ("rows", "transposed")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bytes (NaN and -0.0 included, which ``torch.equal`` would not tell)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@st.composite
def cases(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    # 16 (int2's word) and 8 too: more groups, and words, per chunk edge in small tensors
    group = draw(st.sampled_from([g for g in (8, 16, 32, 64, 128) if g % (32 // bits) == 0]))
    axis = draw(st.sampled_from([-2, -1]))
    per_word = 32 // bits
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    if axis == -2:  # K: tokens in whole groups, any head_dim
        shape = (*lead, group * draw(st.integers(1, 3)), draw(st.integers(1, 40)))
    else:  # V: head_dim in whole words; whole groups, or a ragged last one (the reference's path)
        shape = (*lead, draw(st.integers(1, 20)), per_word * draw(st.integers(1, max(1, 2 * group // per_word))))
    return dict(bits=bits, group=group, axis=axis, shape=shape, dtype=draw(st.sampled_from(DTYPES)),
                stats=draw(st.sampled_from([torch.float16, torch.float32])), kind=draw(st.sampled_from(KINDS)),
                seed=draw(st.integers(0, 2**31 - 1)), chunk=draw(st.sampled_from([64, 1000, host.CHUNK_ELEMENTS])),
                strided=draw(st.booleans()), into=draw(st.sampled_from(INTO)))


def values(case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case["seed"])
    shape, dtype = case["shape"], case["dtype"]
    x = torch.randn(shape, generator=gen)
    kind = case["kind"]
    if kind == "constant":  # groups of one value: s = 0, every code 0
        x = torch.where(torch.rand(shape, generator=gen) < 0.5, x.round(), torch.full(shape, 0.375))
    elif kind == "tiny":  # ranges whose scale underflows fp16 stats (s = 0 though the values differ)
        x = x * 1e-7
    elif kind == "huge":  # near the dtype's max: a rounded-up scale overshoots it on decode (the cap)
        top = torch.finfo(dtype).max
        x = torch.where(x > 0, torch.full(shape, top), x * top / 8)
    elif kind == "zeros":  # -0.0 and +0.0: the stored min's sign must not depend on reduction order
        x = torch.where(x > 0, torch.zeros(shape), -torch.zeros(shape))
    return x.to(dtype)


def strided(x: torch.Tensor, on: bool) -> torch.Tensor:
    """``x``, or the same values in a permuted copy seen through a view (as the encoder's
    stacked layers are): any strides in the leading dims."""
    if not on or x.dim() < 3:
        return x
    return x.transpose(0, -3).contiguous().transpose(0, -3)


@given(cases())
@settings(max_examples=300)  # ~1 s: a cheap net for the rounding cases
def test_host_codec_is_the_reference_bit_for_bit(case):
    kept = host.CHUNK_ELEMENTS
    host.CHUNK_ELEMENTS = case["chunk"]  # small chunks: many chunk edges in small tensors
    try:
        check_against_reference(case)
    finally:
        host.CHUNK_ELEMENTS = kept


def check_against_reference(case) -> None:
    x = strided(values(case), case["strided"])
    args = dict(bits=case["bits"], group=case["group"], axis=case["axis"])
    want = ref.quantize(x, **args, stats_dtype=case["stats"])
    got = host.quantize(x, **args, stats_dtype=case["stats"])
    for name, a, b in zip(("codes", "scale", "min"), want, got):
        assert same_bits(a, b), name
        assert b.is_contiguous()
    # into the caller's buffers, in place, and nothing around them
    bigs, outs = zip(*(destination(t, case["into"]) for t in want))
    around = [big.clone() for big in bigs]
    for big, t in zip(around, want):
        select(big, t.shape, case["into"]).copy_(t)
    got_into = host.quantize(x, **args, stats_dtype=case["stats"], out=outs)
    for name, a, b, big, whole in zip(("codes", "scale", "min"), want, outs, bigs, around):
        assert same_bits(a, b.contiguous()), name
        assert same_bits(big, whole), name
    assert all(a is b for a, b in zip(got_into, outs))
    if not all(bool(torch.isfinite(t).all()) for t in want[1:]):
        return  # a range beyond the stats: refused (test_nan_and_inf_are_refused_and_nothing_stored)
    decode = dict(**args, shape=x.shape, dtype=case["dtype"])
    expected = ref.dequantize(*want, **decode)
    assert same_bits(expected, host.dequantize(*got, **decode))
    # into a strided view of a larger tensor, as the batch decoder's blocks of [L, H, n * B, D]
    big = torch.full((*x.shape[:-2], x.shape[-2] + 3, x.shape[-1]), 7.0, dtype=case["dtype"])
    into = big[..., 1 : 1 + x.shape[-2], :]
    assert host.dequantize(*got, **decode, out=into) is into
    assert same_bits(expected, into)
    assert (big[..., :1, :] == 7).all() and (big[..., -2:, :] == 7).all()


def destination(t: torch.Tensor, into: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``t``'s shape and dtype inside a larger one, filled with a sentinel:
    (the larger one, the view)."""
    if into == "rows":  # gaps between the rows, and between the leading dims' entries
        big = torch.empty((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype)
        if t.dim() >= 3:
            big = torch.empty((2 * t.shape[0], *t.shape[1:-1], t.shape[-1] + 3), dtype=t.dtype)
    else:  # the dims in reverse order in memory: no unit stride in the last one (when it is > 1)
        big = torch.empty(t.shape[::-1], dtype=t.dtype)
    big.view(torch.uint8).fill_(0x5A)
    return big, select(big, t.shape, into)


def select(big: torch.Tensor, shape: tuple[int, ...], into: str) -> torch.Tensor:
    if into == "rows":
        view = big[..., 1 : 1 + shape[-1]]
        return view[::2] if len(shape) >= 3 else view
    return big.permute(*reversed(range(big.dim())))


def test_out_of_the_wrong_shape_or_dtype_is_refused():
    x = torch.randn(2, 64, 32, dtype=torch.float16)
    args = dict(bits=4, group=32, axis=-2, stats_dtype=torch.float16)
    q, s, m = host.quantize(x, **args)
    for bad in ([q[:1], s, m], [q, s.float(), m], [q, s, m[..., :-1]], [q, s]):
        with pytest.raises(ValueError, match="out"):
            host.quantize(x, **args, out=bad)
    with pytest.raises(ValueError, match="out"):  # the reference's path (a range search) checks them too
        host.quantize(x, **{**args, "axis": -1}, clip=1, out=[q, s, m])


def test_cpu_kv_takes_the_host_codec():
    assert ops_for(torch.zeros(1)) is host


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_and_nothing_stored(dtype, bad):
    """A NaN or an Inf anywhere (here in K, then in V) still raises InputError through the
    codec and through a cache on the CPU, which then holds nothing."""
    codec = cs.KIVI(bits=4, group_size=32)
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    for side in (0, 1):
        kv = [tuple(torch.randn(2, 64, 64, generator=gen).to(dtype) for _ in range(2)) for _ in range(2)]
        kv[1][side][1, 37, 5] = bad
        with pytest.raises(InputError):
            codec.encode(kv[1][0], kv[1][1])
        cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=32,
                               tiers=cs.TierConfig(cpu_bytes="64MiB"))
        try:
            with pytest.raises(InputError):
                cache.ingest(list(range(64)), kv)
            assert cache.lookup(list(range(64))) == 0
            assert cache.stats()["tiers"][0]["blocks"] == 0
        finally:
            cache.close()


def test_cache_on_the_cpu_decodes_what_the_reference_does():
    """Through a CPU tier (ingest, materialize) the KV that comes back is the reference's
    decode of the reference's encode, for each codec side."""
    torch.manual_seed(3)
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    kv = [(torch.randn(2, 128, 64).half(), torch.randn(2, 128, 64).half()) for _ in range(2)]
    codec = cs.KIVI(k_bits=4, v_bits=2, group_size=32)
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=64,
                           tiers=cs.TierConfig(cpu_bytes="64MiB"))
    try:
        cache.ingest(list(range(128)), kv)
        got = cache.materialize(list(range(128)), device="cpu")
    finally:
        cache.close()
    for layer, (k, v) in enumerate(kv):
        for side, x, bits, axis in ((0, k, 4, -2), (1, v, 2, -1)):
            enc = ref.quantize(x, bits=bits, group=32, axis=axis, stats_dtype=torch.float16)
            want = ref.dequantize(*enc, bits=bits, group=32, axis=axis, shape=x.shape, dtype=x.dtype)
            assert same_bits(want, got.layers[layer][side].reshape(want.shape))


def test_a_scale_rounded_up_past_the_max_is_capped_as_the_reference_caps_it():
    """A group from fp16's max down to -1886: its fp16 scale rounds up, and its top code
    decodes past 65520 (fp16's Inf) unless capped. The host skips the cap only where no
    group can reach the max; this one can."""
    top = torch.finfo(torch.float16).max
    x = torch.tensor([[top] + [-top * 23 / 4000] * 31], dtype=torch.float16)
    q, s, m = host.quantize(x, bits=2, group=32, axis=-1, stats_dtype=torch.float16)
    assert float(s.float() * 3 + m.float()) > 65520  # uncapped, the top code would be Inf
    args = dict(bits=2, group=32, axis=-1, shape=x.shape, dtype=torch.float16)
    got = host.dequantize(q, s, m, **args)
    assert same_bits(ref.dequantize(q, s, m, **args), got)
    assert got[0, 0] == top


@pytest.mark.parametrize("codec", [cs.KIVI(bits=4, group_size=32), cs.KIVI(k_bits=8, v_bits=2, v_clip=2),
                                   cs.Raw()], ids=["int4", "int8-int2-clip", "raw"])
def test_encode_deferred_into_buffers_holds_the_bytes_of_a_plain_encode(codec):
    """``encode_deferred(out=)`` (the host ingest's way into staging rows) writes what a
    plain encode returns into the caller's buffers, views with gaps between their rows here,
    and the result holds those buffers; the wrong number of them is refused."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 3, 64, 32, generator=gen).half() for _ in "kv")
    want = [b for _, _, b in codec.encode(k, v).named_buffers()]
    outs = [destination(t, "rows")[1] for t in want]
    layer, finite = codec.encode_deferred(k, v, out=outs)
    assert bool(finite.all())
    assert all(a is b for (_, _, a), b in zip(layer.named_buffers(), outs))
    assert all(same_bits(a, b.contiguous()) for a, b in zip(want, outs))
    with pytest.raises(ValueError, match="out"):
        codec.encode_deferred(k, v, out=outs[:-1])
