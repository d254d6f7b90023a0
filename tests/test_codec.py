import math
from dataclasses import replace

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import ConfigError, FrameError, InputError
from cacheseek.quant import EncodedLayer, codec_from_spec
from cacheseek.quant import kivi_reference as ref
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS
from cacheseek.quant.tensors import host_view, to_host
from kivi_bounds import error_bound

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def host_buffers(encoded: EncodedLayer) -> EncodedLayer:
    """``encoded`` with every buffer a flat byte memoryview on the host (torch-free from here on)."""
    host = to_host(encoded, pin=False)
    return host.with_buffers([host_view(buf) for _, _, buf in host.named_buffers()])


@st.composite
def kivi_cases(draw):
    k_bits = draw(st.sampled_from([2, 4, 8]))
    v_bits = draw(st.sampled_from([2, 4, 8]))
    k_group = draw(st.sampled_from([32, 64, 128]))
    v_group = draw(st.sampled_from([32, 64, 128]))
    dtype = draw(st.sampled_from(DTYPES))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    heads = draw(st.integers(1, 3))
    tokens = k_group * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([16, 48, 64, 80, 96, 128, 256]))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    constant_groups = draw(st.booleans())
    return dict(k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, dtype=dtype,
                shape=(*lead, heads, tokens, head_dim), seed=seed, magnitude=magnitude,
                constant_groups=constant_groups)


def _kv(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = case["shape"]
    k = torch.randn(shape, generator=gen) * case["magnitude"]
    v = torch.randn(shape, generator=gen) * case["magnitude"]
    if case["constant_groups"]:
        k[..., : case["k_group"], 0] = 0.375  # a whole K group (one channel, one token group)
        v[..., 0, : case["v_group"]] = -1.25  # a whole V group (one token, one channel group)
    return k.to(case["dtype"]), v.to(case["dtype"])


@given(kivi_cases())
def test_kivi_roundtrip_within_half_a_step(case):
    codec = cs.KIVI(k_bits=case["k_bits"], v_bits=case["v_bits"], k_group_size=case["k_group"],
                    v_group_size=case["v_group"])
    if case["shape"][-1] % (32 // case["v_bits"]):
        with pytest.raises(InputError, match="head_dim"):
            codec.encode(*_kv(case))
        return
    k, v = _kv(case)
    enc = codec.encode(k, v)
    k_hat, v_hat = codec.decode(enc)
    assert k_hat.shape == k.shape and v_hat.shape == v.shape
    assert k_hat.dtype == k.dtype and v_hat.dtype == v.dtype
    for x, x_hat, t, bits, group, axis in (
        (k, k_hat, enc.k, case["k_bits"], case["k_group"], AXIS_TOKENS),
        (v, v_hat, enc.v, case["v_bits"], case["v_group"], AXIS_CHANNELS),
    ):
        assert torch.isfinite(x_hat).all()
        bound = error_bound(x, t.scale, t.offset, bits=bits, group=group, axis=axis, out_dtype=x.dtype)
        err = (x.double() - x_hat.double()).abs()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        codes = ref._unpack_last(t.qdata.movedim(axis, -1), bits)
        assert codes.min() >= 0 and codes.max() <= (1 << bits) - 1
    if case["constant_groups"]:
        assert (k_hat[..., : case["k_group"], 0] == 0.375).all()
        assert (v_hat[..., 0, : case["v_group"]] == -1.25).all()


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 4, 8]))
def test_codes_fit_their_bits_and_words_pack_little_endian(seed, bits):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=gen)
    words = ref._pack_last(codes, bits)
    per = 32 // bits
    assert words.shape == (3, 64 // per) and words.dtype == torch.int32
    # element j of a word sits in bits [j*b, (j+1)*b)
    w = words[1, 0].item() & 0xFFFFFFFF
    assert [(w >> (j * bits)) & ((1 << bits) - 1) for j in range(per)] == codes[1, :per].tolist()
    assert torch.equal(ref._unpack_last(words, bits), codes.to(torch.int32))


def test_constant_groups_decode_exactly_never_nan():
    k = torch.full((2, 64, 64), 3.140625, dtype=torch.float16)
    v = torch.zeros((2, 64, 64), dtype=torch.float16)
    codec = cs.KIVI(bits=2, group_size=32)
    enc = codec.encode(k, v)
    assert (enc.k.scale == 0).all() and (enc.v.scale == 0).all()
    k_hat, v_hat = codec.decode(enc)
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v)


def test_round_half_to_even():
    # One V group of 32 channels, range 0..3 at 2 bits: step 1, so x.5 values are exact ties.
    row = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5] + [1.0] * 27)
    q, s, m = ref.quantize(row.view(1, 1, 32), bits=2, group=32, axis=-1, stats_dtype=torch.float16)
    codes = ref._unpack_last(q, 2)[0, 0, :5].tolist()
    assert codes == [0, 3, 0, 2, 2]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_outlier_channels_reconstruct_better_per_channel_than_per_token(bits):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(8, 256, 128, generator=gen)
    k[..., [3, 17, 90, 111]] *= 15  # outlier channels, as real keys have
    k = k.to(torch.float16)
    codec = cs.KIVI(bits=bits, group_size=32)
    k_channel, _ = codec.decode(codec.encode(k, k))
    q, s, m = ref.quantize(k, bits=bits, group=32, axis=AXIS_CHANNELS, stats_dtype=torch.float16)
    k_token = ref.dequantize(q, s, m, bits=bits, group=32, axis=AXIS_CHANNELS, shape=k.shape, dtype=k.dtype)
    def rel_err(x):
        return ((x.float() - k.float()).norm() / k.float().norm()).item()

    def rel_err_per_channel(x):
        return (x.float() - k.float()).norm(dim=(0, 1)) / k.float().norm(dim=(0, 1))

    assert rel_err(k_channel) < rel_err(k_token)
    assert rel_err_per_channel(k_channel).mean() < 0.5 * rel_err_per_channel(k_token).mean()


@pytest.mark.parametrize("bits,group,expect_ratio", [(4, 32, 3.2), (2, 32, 16 / 3), (8, 32, 16 / 9), (4, 128, 16 / 4.25)])
def test_encoded_nbytes_matches_the_design_formula(bits, group, expect_ratio):
    layout = cs.KVLayout(32, 8, 128, "float16")
    codec = cs.KIVI(bits=bits, group_size=group)
    n = codec.encoded_nbytes(layout, 256)
    elements = 2 * 32 * 8 * 256 * 128
    assert n * 8 == elements * (bits + 32 / group)
    assert layout.raw_nbytes(256) / n == pytest.approx(expect_ratio)
    k = torch.randn(32, 8, 256, 128, dtype=torch.float16)
    assert codec.encode(k, k).nbytes == n


def test_encoded_nbytes_counts_the_ragged_group():
    layout = cs.KVLayout(1, 1, 80, "float16")
    codec = cs.KIVI(bits=4, group_size=32)
    # K: 32 tokens x 80 channels at 4 bits + 80 fp16 (scale, min); V: 3 groups per token.
    assert codec.encoded_nbytes(layout, 32) == (32 * 80 // 2 + 80 * 4) + (32 * 80 // 2 + 32 * 3 * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_roundtrip_is_byte_identical(dtype):
    k = torch.randn(3, 2, 40, 80).to(dtype)
    v = torch.randn(3, 2, 40, 80).to(dtype)
    enc = host_buffers(cs.Raw().encode(k, v))
    wire = EncodedLayer.unpackb(enc.packb())
    k2, v2 = cs.Raw().decode(wire)
    assert k2.dtype == dtype
    assert bytes(host_view(k2.contiguous())) == bytes(host_view(k))
    assert bytes(host_view(v2.contiguous())) == bytes(host_view(v))


def test_encoded_layer_msgpack_roundtrip_decodes_identically():
    k = torch.randn(2, 64, 96, dtype=torch.bfloat16)
    v = torch.randn(2, 64, 96, dtype=torch.bfloat16)
    codec = cs.KIVI(k_bits=2, v_bits=4, group_size=64)
    enc = codec.encode(k, v)
    blob = host_buffers(enc).packb()
    assert isinstance(msgpack.unpackb(blob), dict)
    back = EncodedLayer.unpackb(blob)
    assert back.codec == codec.spec() and back.k.shape == enc.k.shape
    a, b = codec.decode(enc), codec.decode(back)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("side, field, value", [
    ("k", "dtype", "int8"), ("v", "bits", 64), ("v", "stats_dtype", None), ("k", "axis", -1), ("k", "pad", -1),
    ("v", "group", 10**9), ("v", "dtype", [1, 2]), ("k", "bits", 2), ("v", "pad", 3),
    # (an OverflowError, a ValueError from zip or dict, before)
    ("k", "bits", math.inf), ("v", "shape", [2, math.inf, 32]), ("k", "buffers", "first two"),
    ("v", "buffers", "one more"), ("v", "dtype", "float32"), (None, "codec", "ab"), (None, "codec", [["name", "kivi"]]),
])
def test_an_encoded_layer_whose_fields_are_not_an_encodes_is_a_frame_error(side, field, value):
    """Every field as an encode writes it, or a FrameError: a decoder sizes its work from
    them (a KeyError, ZeroDivisionError or a torch shape error before)."""
    codec = cs.KIVI(bits=4, group_size=32)
    blob = host_buffers(codec.encode(torch.randn(2, 32, 32).half(), torch.randn(2, 32, 32).half())).packb()
    wire = msgpack.unpackb(blob, raw=False)
    _set_wire_field(wire, side, field, value)
    with pytest.raises(FrameError):
        codec.decode(EncodedLayer.unpackb(msgpack.packb(wire, use_bin_type=True)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("codec, shape", [(cs.KIVI(bits=4), (2, 40, 32)), (cs.KIVI(bits=4, v_rotate=True), (2, 32, 48))],
                         ids=["ragged-k-group", "rotate-head-dim-48"])
def test_an_encoded_layer_of_a_shape_no_encode_makes_is_a_frame_error(monkeypatch, backend, codec, shape):
    """A layer whose fields and buffers agree with the codec's template, of a shape its
    encode refuses (40 tokens against a K group of 32; head_dim 48 under v_rotate): the
    torch reference decoded the ragged K group, the kernels raised a ValueError, and the
    rotation a ValueError on either."""
    from cacheseek.quant.backend import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, backend)
    x = torch.randn(shape).half()
    buffers = [*ref.quantize(x, bits=4, group=32, axis=AXIS_TOKENS, stats_dtype=torch.float16),
               *ref.quantize(x, bits=4, group=32, axis=AXIS_CHANNELS, stats_dtype=torch.float16)]
    blob = host_buffers(codec.template(shape, "float16").with_buffers(buffers)).packb()
    with pytest.raises(FrameError, match="head_dim|k_group_size"):
        codec.decode(EncodedLayer.unpackb(blob))


def _set_wire_field(wire, side, field, value):
    if value == "first two":
        value = wire[side][field][:2]
    elif value == "one more":
        value = [*wire[side][field], b""]
    (wire if side is None else wire[side])[field] = value


@pytest.mark.parametrize("side, field, value", [
    ("v", "shape", [1, 32, 32]), ("v", "dtype", "float32"), ("k", "bits", 3), ("k", "axis", -1),
    ("v", "buffers", "one more"), ("k", "shape", [2, 32, math.inf]),
])
def test_a_raw_layer_whose_fields_are_not_an_encodes_is_a_frame_error(side, field, value):
    """Raw's decode checks the layer against its template as KIVI's does: it returned K and
    V of other shapes or dtypes before, as the fields said."""
    k, v = torch.randn(2, 32, 32).half(), torch.randn(2, 32, 32).half()
    wire = msgpack.unpackb(host_buffers(cs.Raw().encode(k, v)).packb(), raw=False)
    if field == "shape" and value == [1, 32, 32]:
        wire[side]["buffers"] = [bytes(wire[side]["buffers"][0])[: 1 * 32 * 32 * 2]]
    if field == "dtype":
        wire[side].update(shape=[2, 32, 16], bits=32)
    _set_wire_field(wire, side, field, value)
    with pytest.raises(FrameError):
        cs.Raw().decode(EncodedLayer.unpackb(msgpack.packb(wire, use_bin_type=True)))


def test_codec_from_spec_roundtrips_and_is_strict():
    for codec in (cs.KIVI(bits=8, group_size=128, stats_dtype="float32"), cs.KIVI(k_bits=2, v_bits=4), cs.Raw()):
        assert codec_from_spec(codec.spec()) == codec
        assert codec_from_spec(codec.spec()).fingerprint() == codec.fingerprint()
    with pytest.raises(ConfigError, match="unknown codec"):
        codec_from_spec({"name": "zstd"})
    with pytest.raises(ConfigError, match="version"):
        codec_from_spec({**cs.KIVI().spec(), "version": 2})
    # Values equal to a valid one but of another type (4.0 == 4, True == 1) would rebuild a
    # codec whose spec, so its key, differs from the one that wrote the frame.
    kivi, policy = cs.KIVI(bits=4).spec(), cs.PrecisionPolicy(first=cs.KIVI(bits=8), rest=cs.KIVI(bits=4)).spec()
    for bad in ({**kivi, "k_bits": 4.0}, {**kivi, "v_group": 32.0}, {**kivi, "version": True},
                {**kivi, "stats_dtype": "torch.float16"}, {**kivi, "v_clip": 2.0}, {**kivi, b"junk": 1},
                {"name": "raw", "version": 1.0}, {"name": "raw", "version": True}, {**policy, "version": 1.0},
                {**kivi, "k_bits": None}, {**kivi, "v_group": None}):
        with pytest.raises(ConfigError):
            codec_from_spec(bad)
    for bad_args in ({"bits": 4.0}, {"group_size": 32.0}, {"v_clip": True}, {"k_bits": True}, {"v_bits": 2.0},
                     {"k_group_size": 64.0}, {"v_group_size": True}, {"v_clip": 1.0}, {"v_rotate": 1}):
        with pytest.raises(ConfigError):
            cs.KIVI(**bad_args)
    for first_blocks in (1.0, True):
        with pytest.raises(ConfigError, match="first_blocks"):
            cs.PrecisionPolicy(first=cs.KIVI(bits=8), rest=cs.KIVI(bits=4), first_blocks=first_blocks)


@pytest.mark.parametrize("dtype, stats, low", [(torch.float16, "float16", 0.0), (torch.float32, "float32", 0.1)],
                         ids=["fp16", "fp32"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_dtypes_max_decodes_finite_and_alike_on_both_backends(monkeypatch, bits, dtype, stats, low):
    """A group holding the dtype's max is finite, so accepted; its scale may be rounded up,
    and code * s + m then passes the max: clamped to it, never decoded to Inf. (fp32 KV with
    fp32 stats was not clamped: its max in a K group whose other tokens are at 0.1x the max
    decoded to Inf, at every bits.)"""
    from cacheseek.quant.backend import BACKEND_ENV

    top = torch.finfo(dtype).max
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: the kernels interpreted)
    k = torch.full((1, 32, 32), low * top, dtype=dtype, device=device)
    k[0, 0, :] = top  # one token at the max in every K group
    v = torch.full((1, 32, 32), -low * top, dtype=dtype, device=device)
    v[0, :, 0] = -top  # one channel at minus the max in every V group
    decoded = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        codec = cs.KIVI(bits=bits, stats_dtype=stats)
        enc = codec.encode(k, v)
        k_hat, v_hat = (t.cpu() for t in codec.decode(enc, device))
        assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all(), backend
        bound = error_bound(k.cpu(), enc.k.scale.cpu(), enc.k.offset.cpu(), bits=bits, group=32, axis=-2,
                            out_dtype=k.dtype)
        assert ((k.cpu().double() - k_hat.double()).abs() <= bound).all(), backend
        decoded[backend] = (k_hat, v_hat)
    assert all(torch.equal(a, b) for a, b in zip(decoded["torch"], decoded["triton"]))


def test_fp32_stats_hold_ranges_beyond_fp16():
    k = torch.randn(1, 64, 64) * 1e6
    with pytest.raises(InputError, match="stats"):
        cs.KIVI(bits=8, group_size=32).encode(k, k)
    codec = cs.KIVI(bits=8, group_size=32, stats_dtype="float32")
    k_hat, _ = codec.decode(codec.encode(k, k))
    assert ((k_hat - k).norm() / k.norm()) < 0.01


def test_extreme_bf16_values_are_rejected_with_fp16_stats_not_stored_as_inf():
    k = torch.randn(1, 64, 64).to(torch.bfloat16)
    k[0, 5, 5] = torch.finfo(torch.bfloat16).max
    with pytest.raises(InputError, match="float32"):
        cs.KIVI(bits=4, group_size=32).encode(k, k.clone())


def _just_within(bound: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` at most ``bound`` (a positive ``bound`` rounded to
    ``dtype`` may lie above it; one step down its bits is the next value below)."""
    x = torch.tensor(bound, dtype=torch.float64).to(dtype)
    if x.double() > bound:
        bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
        x = (x.view(bits) - 1).view(dtype)
    return float(x)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.sampled_from(["float16", "float32"]), st.booleans(),
       st.sampled_from([0, 3]), st.sampled_from(["float16", "bfloat16", "float32"]),
       st.sampled_from(["torch", "triton"]), st.integers(0, 2**31 - 1))
def test_kv_within_the_safe_magnitudes_always_encodes(bits, stats, rotate, clip, dtype, backend, seed):
    """``safe_magnitudes`` promises what the in-place ingest's check relies on: finite KV
    within them is never refused, whatever its groups' ranges (each group here spans both
    extremes; V rows all at the extreme, one with equal signs that the rotation aligns).
    Where it promises every finite value, the dtype's own extremes are what it gets."""
    from cacheseek.quant.backend import BACKEND_ENV

    codec = cs.KIVI(bits=bits, group_size=32, stats_dtype=stats, v_rotate=rotate, v_clip=clip)
    bounds = codec.safe_magnitudes(dtype, 64)
    torch_dtype = getattr(torch, dtype)
    top = torch.finfo(torch_dtype).max
    kb, vb = (_just_within(b, torch_dtype) for b in bounds) if bounds else (top, top)
    gen = torch.Generator().manual_seed(seed)
    k = (torch.rand(1, 2, 64, 64, generator=gen) * 2 - 1).mul(kb).to(torch_dtype)
    k[..., ::32, :], k[..., 1::32, :] = kb, -kb  # every K group spans [-kb, kb]
    signs = torch.randint(0, 2, (1, 2, 64, 64), generator=gen) * 2 - 1
    v = (signs * vb).to(torch_dtype)
    v[..., 0, :] = vb  # one row of equal signs: the rotation's worst case, sqrt(head_dim) growth
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # (CPU: interpreted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BACKEND_ENV, backend)
        codec.encode(k.to(device), v.to(device))  # no InputError


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: cs.KIVI(bits=3), "bits"),
        (lambda: cs.KIVI(bits=4, k_bits=16), "k_bits"),
        (lambda: cs.KIVI(bits=4, v_bits=1), "v_bits"),
        (lambda: cs.KIVI(group_size=48), "group_size"),
        (lambda: cs.KIVI(k_group_size=16), "k_group_size"),
        (lambda: cs.KIVI(v_group_size=256), "v_group_size"),
        (lambda: cs.KIVI(stats_dtype="bfloat16"), "stats_dtype"),
        (lambda: cs.KVLayout(0, 1, 64), "num_layers"),
        (lambda: cs.KVLayout(1, 1, 64, "int8"), "dtype"),
        (lambda: cs.KIVI(group_size=64).check_layout(cs.KVLayout(1, 1, 64), 96), "block_tokens"),
        (lambda: cs.KIVI(bits=2).check_layout(cs.KVLayout(1, 1, 40), 64), "head_dim"),
        # A cache given a codec's name, a codec class or a layout's tuple (not an AttributeError)
        (lambda: cs.PrefixCache(model_id="m", layout=cs.KVLayout(1, 1, 64), codec="int4"), "^codec: .*'int4'"),
        (lambda: cs.PrefixCache(model_id="m", layout=cs.KVLayout(1, 1, 64), codec=cs.KIVI), "^codec: "),
        (lambda: cs.PrefixCache(model_id="m", layout=(1, 1, 64)), r"^layout: .*\(1, 1, 64\)"),
        (lambda: cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=None), "^layout: "),
    ],
)
def test_bad_config_names_the_parameter(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def _t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "k, v, match",
    [
        (_t(64, 64), _t(64, 64), "rank"),
        (_t(1, 64, 64, dtype=torch.float16).to(torch.int32), _t(1, 64, 64), "dtype"),
        (_t(1, 64, 64), _t(1, 32, 64), "shapes differ"),
        (_t(1, 64, 64), _t(1, 64, 64, dtype=torch.bfloat16), "dtypes differ"),
        (_t(1, 48, 64), _t(1, 48, 64), "k_group_size"),
        (_t(1, 64, 40), _t(1, 64, 40), "head_dim"),
        ([1, 2], _t(1, 64, 64), "k: expected a torch.Tensor"),
    ],
)
def test_bad_kv_names_the_problem(k, v, match):
    with pytest.raises(InputError, match=match):
        cs.KIVI(bits=2, group_size=32).encode(k, v)


@pytest.mark.parametrize("codec", [cs.KIVI(bits=4), cs.KIVI(bits=8, stats_dtype="float32"), cs.Raw()])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_and_inf_are_rejected(codec, bad, where):
    k, v = _t(2, 64, 64), _t(2, 64, 64)
    (k if where == "k" else v)[1, 33, 7] = bad
    with pytest.raises(InputError, match="NaN or Inf"):
        codec.encode(k, v)


def test_decode_rejects_another_codecs_payload():
    k = _t(1, 64, 64)
    enc = cs.KIVI(bits=4).encode(k, k)
    with pytest.raises(InputError, match="codec"):
        cs.KIVI(bits=2).decode(enc)


# Values equal to the spec's under == (4.0 == 4, True == 1) but of another type: no codec's spec
# (the constructors refuse them), so a frame or layer saying so was not made by this codec.
TYPE_ONLY = [("k_bits", 4.0), ("v_group", 32.0), ("version", 1.0), ("version", True), ("v_clip", True),
             ("v_clip", 1.0), ("v_rotate", 1)]


@pytest.mark.parametrize("field, value", TYPE_ONLY)
def test_a_fetched_frame_whose_codec_spec_differs_only_in_type_ends_the_prefix(field, value):
    from cacheseek.block_format import BlockFormat
    from cacheseek.store.frame import build_frame, parse_frame, plan_frame
    from cacheseek.store.tier import BlockFrame
    from store_helpers import BLOCK, LAYOUT, make_cache, make_kv, tokens_for

    codec = cs.KIVI(bits=4, group_size=32, v_clip=1, v_rotate=True)
    toks, kv = tokens_for(8, 3 * BLOCK), make_kv(3 * BLOCK, 8)
    with make_cache(codec=codec) as cache:
        assert cache.ingest(toks, kv).stored == 3
        h = cache.block_hashes(toks)
        frame, _ = cache.store.get(h[2])
        meta, payload = frame.meta, bytes(frame.payload_view())
        frame.release()
        assert meta.codec[field] == value  # equal under ==: what let it through
        forged = plan_frame(block_hash=h[2], parent_hash=h[1], position=2, layout=meta.layout, block_tokens=BLOCK,
                            codec={**meta.codec, field: value},
                            buffers=[(e.name, e.dtype, e.shape) for e in meta.tensors])
        data = build_frame(forged, [payload[e.offset:e.offset + e.nbytes] for e in meta.tensors])
        cache.store.delete(h[2])
        assert cache.store.put(h[2], BlockFrame(parse_frame(data), host=memoryview(data), sealed=True)).stored
        assert cache.lookup(toks) == 3 * BLOCK  # stored, but not this codec's frame:
        assert cache.materialize(toks).num_blocks == 2  # the prefix ends before it, as at any mismatch
    with pytest.raises(FrameError, match="another codec"):
        BlockFormat(codec, LAYOUT, BLOCK).check_fetched(parse_frame(data), h[2], 2)
    raw = BlockFormat(cs.Raw(), LAYOUT, BLOCK)
    planned = raw.plan(block_hash=h[0], parent_hash=h[0], position=0)
    raw.check_fetched(replace(planned, codec={"name": "raw", "version": 1}), h[0], 0)  # a parsed copy: fine
    for version in (1.0, True):
        with pytest.raises(FrameError, match="another codec"):
            raw.check_fetched(replace(planned, codec={"name": "raw", "version": version}), h[0], 0)


@pytest.mark.parametrize("field, value", TYPE_ONLY)
def test_decode_refuses_a_layer_whose_codec_spec_differs_only_in_type(field, value):
    codec = cs.KIVI(bits=4, group_size=32, v_clip=1, v_rotate=True)
    k = _t(1, 64, 64)
    wire = msgpack.unpackb(host_buffers(codec.encode(k, k)).packb(), raw=False)
    wire["codec"][field] = value
    with pytest.raises(InputError, match="codec"):
        codec.decode(EncodedLayer.unpackb(msgpack.packb(wire, use_bin_type=True)))
    wire = msgpack.unpackb(host_buffers(cs.Raw().encode(k, k)).packb(), raw=False)
    wire["codec"]["version"] = 1.0
    with pytest.raises(InputError, match="codec"):
        cs.Raw().decode(EncodedLayer.unpackb(msgpack.packb(wire, use_bin_type=True)))


def test_backend_env_forces_torch(monkeypatch):
    from cacheseek.quant.backend import backend_for

    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", "torch")
    assert backend_for(torch.empty(1)) == "torch"
    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", "auto")
    assert backend_for(torch.empty(1)) == "torch"  # CPU tensors always take the reference
    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", "fast")
    with pytest.raises(ConfigError, match="CACHESEEK_KIVI_BACKEND"):
        backend_for(torch.empty(1))


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=2), cs.KIVI(k_bits=4, v_bits=2, group_size=32),
                                   cs.KIVI(bits=4, v_rotate=True)], ids=["raw", "int2", "k4v2", "int4-rotate"])
def test_decode_buffers_writes_what_decode_returns(codec):
    # The decoders' path (staging views straight into strided outputs) against decode().
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(3, 2, 2, 32, 64, generator=gen).half() for _ in range(2))
    encoded = codec.encode(k, v)
    want_k, want_v = codec.decode(encoded)
    out_k = torch.full((2, 2, 3 * 32, 64), 7.0).half()  # [L, H, n*B, D], written as [n, L, H, B, D]
    out_v = torch.full_like(out_k, 7.0)
    as_blocks = (2, 2, 3, 32, 64)
    codec.decode_buffers([b for _, _, b in encoded.named_buffers()],
                         (out_k.view(as_blocks).permute(2, 0, 1, 3, 4), out_v.view(as_blocks).permute(2, 0, 1, 3, 4)))
    assert torch.equal(out_k.view(as_blocks).permute(2, 0, 1, 3, 4), want_k)
    assert torch.equal(out_v.view(as_blocks).permute(2, 0, 1, 3, 4), want_v)


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_decode_into_out_takes_only_the_layers_own_shape_and_dtype(codec):
    """``decode(out=)`` into a larger tensor broadcast the layer over it, and into another
    dtype cast it: refused, ``out`` left as it was; the layer's own shape, strided, works."""
    k, v = _t(2, 64, 64, dtype=torch.float32), _t(2, 64, 64, dtype=torch.float32)
    encoded = codec.encode(k, v)
    want_k, want_v = codec.decode(encoded)
    for shape, dtype in (((3, 2, 64, 64), torch.float32), ((2, 64, 64), torch.float16), ((1, 64, 64), torch.float32)):
        out = (torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype))
        with pytest.raises(InputError, match=r"^out\[k\]: expected \[2, 64, 64\] torch.float32 on cpu"):
            codec.decode(encoded, out=out)
        assert all((t == 7).all() for t in out)
    with pytest.raises(InputError, match=r"^out: expected \(k, v\)"):
        codec.decode(encoded, out=torch.empty(2, 64, 64))
    wide = torch.zeros(2, 2, 64, 64), torch.zeros(2, 2, 64, 64)
    codec.decode(encoded, out=(wide[0][:, 1], wide[1][:, 1]))
    assert torch.equal(wide[0][:, 1], want_k) and torch.equal(wide[1][:, 1], want_v)
    # An expanded out (its rows one memory): the host decode wrote its chunks over each other,
    # and out[0] held row 1's decode; the reference and the kernels refuse it, as now here.
    expanded = torch.zeros(1, 64, 64).expand(2, 64, 64)
    with pytest.raises(InputError, match=r"^out\[k\]: more than one element refers to a single memory location"):
        codec.decode(encoded, out=(expanded, torch.empty(2, 64, 64)))
    assert (expanded == 0).all()


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(k_bits=4, v_bits=2)], ids=["raw", "kivi"])
@pytest.mark.parametrize("shape", [[1 << 62, 1 << 62, 0, 32], [1 << 40, 1 << 40, 1 << 40, 0], [1, 0, 1 << 62, 32],
                                   [(1 << 63) - 1, 2, 0, 32]])
def test_an_encoded_layer_of_no_elements_and_huge_dimensions_is_a_frame_error(codec, shape):
    """A shape with a zero among dimensions of 2**40 to 2**63 holds no element, so buffers of
    no byte agree with it; torch then raised RuntimeError (its strides overflow) or
    "numel: integer multiplication overflow" out of ``decode``."""
    template = codec.template(tuple(shape), "float16")
    wire = {"codec": template.codec,
            **{side: {**t.meta(), "buffers": [b""] * len(t.buffer_specs())}
               for side, t in (("k", template.k), ("v", template.v))}}
    with pytest.raises(FrameError, match="shape"):
        codec.decode(EncodedLayer.unpackb(msgpack.packb(wire, use_bin_type=True)))


def _refusal(codec, layout, k, v) -> list[str]:
    """The InputError of each path that can refuse ``k, v`` (one layer): the codec's encode,
    a PrefixCache's ingest (the flags only: ``check_finite`` with the layout's dtype), and
    the check before a multi-part ingest (``encode.check_tokens``)."""
    from cacheseek.encode import check_tokens

    said = []
    with pytest.raises(InputError) as e:
        codec.encode(k, v)
    said.append(str(e.value))
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=32)
    with pytest.raises(InputError) as e:
        cache.ingest(list(range(k.shape[-2])), [(k, v)])
    said.append(str(e.value))
    assert cache.lookup(list(range(k.shape[-2]))) == 0
    with pytest.raises(InputError) as e:
        check_tokens(codec, [(k, v)], layout, 0, k.shape[-2])
    said.append(str(e.value))
    return said


@pytest.mark.parametrize("stats", ["float16", "float32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_in_fp16_kv_is_named_as_such_on_every_path_never_sent_to_fp32_stats(stats, bad):
    """fp16 KV cannot pass fp16 stats' range: its only cause of refusal is NaN or Inf, and
    fp32 stats (another key, twice the stats' bytes) would fail again. Every path says so,
    in the same words."""
    layout = cs.KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype="float16")
    codec = cs.KIVI(bits=4, stats_dtype=stats)
    k, v = torch.randn(2, 64, 64, dtype=torch.float16), torch.randn(2, 64, 64, dtype=torch.float16)
    k[1, 40, 3] = bad
    for said in _refusal(codec, layout, k, v):
        assert said.startswith("k: holds NaN or Inf; input rejected"), said
    k[1, 40, 3], v[0, 3, 5] = 0.0, bad
    for said in _refusal(codec, layout, k, v):
        assert said.startswith("v: holds NaN or Inf; input rejected"), said


@pytest.mark.parametrize("stats", ["float16", "float32"])
def test_fp16_v_that_overflows_once_rotated_is_named_as_such_whatever_the_stats(stats):
    """A finite fp16 V row aligned with v_rotate's signs grows by sqrt(head_dim) past 65504:
    the rotation is the cause, which fp32 stats cannot help."""
    from cacheseek.quant.rotation import signs

    layout = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16")
    codec = cs.KIVI(bits=4, stats_dtype=stats, v_rotate=True)
    k, v = torch.randn(1, 32, 64, dtype=torch.float16), torch.randn(1, 32, 64, dtype=torch.float16)
    v[0, 3] = 20000.0 * signs(64, "cpu").sign().to(torch.float16)
    for said in _refusal(codec, layout, k, v):
        assert said.startswith("v: rows that overflow float16 once rotated (v_rotate grows a row by up to "
                               "sqrt(head_dim)); input rejected"), said


def test_finite_kv_beyond_fp16_stats_is_sent_to_fp32_stats_and_nan_in_it_is_not():
    layout = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16")
    k, v = torch.randn(1, 32, 64, dtype=torch.bfloat16), torch.randn(1, 32, 64, dtype=torch.bfloat16)
    k[0, 5, 7] = -1e6  # a K group's min, beyond fp16
    said = _refusal(cs.KIVI(bits=4), layout, k, v)
    want = ("k: a group whose min or range/levels is beyond float16 stats (finite values past 65504: use "
            "stats_dtype='float32'); input rejected")
    assert all(said.startswith(want) for said in said), said
    cs.KIVI(bits=4, stats_dtype="float32").encode(k, v)  # which fp32 stats do hold
    k[0, 5, 7] = float("nan")
    for said in _refusal(cs.KIVI(bits=4), layout, k, v):
        assert said.startswith("k: holds NaN or Inf; input rejected"), said


@pytest.mark.parametrize("codec, dtype, said", [
    (cs.KIVI(bits=4), "float16", "v: holds NaN or Inf; input rejected"),
    (cs.KIVI(bits=4, stats_dtype="float32"), "float16", "v: holds NaN or Inf; input rejected"),
    (cs.KIVI(bits=4, v_rotate=True), "float16", "v: holds NaN or Inf, or rows that overflow float16 once rotated "
                                                "(v_rotate grows a row by up to sqrt(head_dim)); input rejected"),
    (cs.KIVI(bits=4), "bfloat16", "v: holds NaN or Inf, or a group whose min or range/levels is beyond float16 stats "
                                  "(finite values past 65504: use stats_dtype='float32'); input rejected"),
    (cs.KIVI(bits=4, stats_dtype="float32"), "float32",
     "v: holds NaN or Inf, or a group whose range is beyond float32 stats; input rejected"),
])
def test_flags_alone_name_every_cause_the_kv_dtype_leaves_and_no_other(codec, dtype, said):
    """Where only the flags are at hand (a paged or layer-wise ingest), the message names
    what the KV's dtype leaves possible: for fp16 KV, NaN or Inf (and v_rotate's rows)."""
    with pytest.raises(InputError) as e:
        codec.check_finite(torch.tensor([[True, True], [True, True], [True, False], [True, True]]), dtype)
    assert str(e.value) == said


@pytest.mark.parametrize("dtype, make, bits, fp16_steps", [
    (torch.float32, lambda x: 1000 + 1e-3 * x, 4, 4.0),
    (torch.float32, lambda x: 1000 + 1e-3 * x, 8, 100.0),
    (torch.bfloat16, lambda x: 1e-5 * x, 8, 20.0),
    (torch.float16, lambda x: 1e-5 * x, 8, 20.0),
])
def test_fp16_stats_lose_steps_inside_fp16_range_where_precision_md_says_fp32_stats_do_not(dtype, make, bits,
                                                                                           fp16_steps):
    """docs/precision.md, "The stats dtype": fp32 KV at a large offset with a small range,
    and int8 groups of tiny ranges (a subnormal fp16 scale), lose many quantization steps to
    fp16 stats, and none to fp32 stats."""
    k = make(torch.randn(1, 1, 32, 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    step = (k.float().amax(-2) - k.float().amin(-2)).max().item() / ((1 << bits) - 1)
    errors = []
    for stats in ("float16", "float32"):
        codec = cs.KIVI(bits=bits, stats_dtype=stats)
        decoded, _ = codec.decode(codec.encode(k, k.clone()))
        errors.append((decoded.float() - k.float()).abs().max().item() / step)
    assert errors[0] > fp16_steps and errors[1] <= 0.55, errors
