"""KIVI's V rotation (``v_rotate``): a fixed signed Hadamard rotation of the head dimension
before V is quantized and after it is decoded. The rotation alone is exact up to fp32
rounding and deterministic; the stored format is unchanged; the spec (so the keys) differs
only when it is on; every encode and decode path applies it, the Triton kernels (in the
interpreter on a machine without CUDA) bit for bit as the torch reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import ConfigError, InputError
from cacheseek.hashing import hash_token_blocks
from cacheseek.prefix_keys import PrefixKeys
from cacheseek.quant import codec_from_spec, rotation
from cacheseek.quant import kivi_reference as ref
from cacheseek.quant import backend
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS
from store_helpers import tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16 = torch.float16
PLAIN = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64)
ROT = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_rotate=True)


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _v(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """V-like rows: Gaussian, varying scale per token, two outlier channels in every token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * (0.1 + 3 * torch.rand(*shape[:-1], 1, generator=gen))
    x[..., [3, shape[-1] - 5]] *= 15
    return x.to(dtype)


# -- the rotation alone ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8, 64, 128, 256])
def test_rotation_is_the_signed_hadamard_matrix_and_orthonormal(n):
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))
    h = _hadamard(n)
    assert torch.allclose(rotation.fwht(x).double(), x.double() @ h, atol=1e-4)
    r = torch.diag(rotation.signs(n, "cpu").double()) @ h / math.sqrt(n)
    assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64))
    assert torch.allclose(rotation.rotate(x).double(), x.double() @ r, atol=1e-5)
    assert torch.allclose(rotation.unrotate(x).double(), x.double() @ r.T, atol=1e-5)


def test_round_trip_is_exact_on_small_integers_and_within_fp32_rounding_otherwise():
    # For n = 64 the normalisation is 1/8 (a power of two): integer inputs stay exact sums.
    x = torch.randint(-1000, 1000, (4, 9, 64), generator=torch.Generator().manual_seed(1)).float()
    assert torch.equal(rotation.unrotate(rotation.rotate(x)), x)
    y = torch.randn(4, 9, 128, generator=torch.Generator().manual_seed(2)) * 50
    back = rotation.unrotate(rotation.rotate(y))
    assert float((back - y).abs().max()) <= 1e-5 * float(y.abs().max())


# Bits of sha256("cacheseek/kivi/v_rotate/n=64/0"), each byte least significant bit first.
GOLDEN_SIGNS_64 = "0010110110011010101010011000100101100101010000011111111101110100"


def test_signs_are_fixed_by_the_hash_golden():
    # Stored V codes depend on these signs, and the spec names no version of them: a change
    # here would make every stored v_rotate block decode wrongly under the same keys.
    bits = rotation.sign_bits(64)
    assert "".join(map(str, bits)) == GOLDEN_SIGNS_64
    assert rotation.sign_bits(512)[:64] != bits  # each size has its own (n is in the hash input)
    assert len(rotation.sign_bits(512)) == 512
    assert torch.equal(rotation.signs(64, "cpu"), torch.tensor([1.0 - 2 * b for b in bits]))



def test_rotation_refuses_a_head_dim_that_is_not_a_power_of_two():
    assert [n for n in range(1, 300) if rotation.supported(n)] == [2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError, match="power of two"):
        rotation.rotate(torch.zeros(2, 80))


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([4, 32, 64, 128]), rows=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_rotation_keeps_norms_inverts_and_treats_rows_alone(n, rows, seed, scale):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * scale
    y = rotation.rotate(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(rotation.unrotate(y), x, rtol=0, atol=1e-5 * scale * math.sqrt(n))
    # Row by row the same bits as all rows at once (no cross-row sums: the same on any device).
    assert torch.equal(torch.cat([rotation.rotate(x[i:i + 1]) for i in range(rows)]), y)


# -- the codec: spec, keys, format ----------------------------------------------------------------


def test_off_by_default_keeps_the_spec_and_on_adds_the_field():
    assert PLAIN == cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_rotate=False)
    assert "v_rotate" not in PLAIN.spec() and "v_rotate" not in repr(PLAIN)
    assert ROT.spec() == {**PLAIN.spec(), "v_rotate": True}
    assert "v_rotate=True" in repr(ROT)
    assert ROT.fingerprint() != PLAIN.fingerprint()
    assert codec_from_spec(ROT.spec()) == ROT and codec_from_spec(PLAIN.spec()) == PLAIN
    both = cs.KIVI(k_bits=4, v_bits=2, v_clip=2, v_rotate=True)
    assert codec_from_spec(both.spec()) == both and both.spec()["v_clip"] == 2
    layout = cs.KVLayout(30, 3, 64, "float32")
    assert ROT.encoded_nbytes(layout, 2048) == PLAIN.encoded_nbytes(layout, 2048)


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_bad_v_rotate_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="v_rotate"):
        cs.KIVI(v_rotate=bad)


@pytest.mark.parametrize("bad", [False, 1, "true", None])
def test_spec_with_a_bad_v_rotate_is_refused(bad):
    with pytest.raises(ConfigError, match="v_rotate"):
        codec_from_spec({**cs.KIVI().spec(), "v_rotate": bad})


def test_keys_differ_with_the_rotation_on():
    layout = cs.KVLayout(2, 2, 64, "float16")

    def chain(codec):
        keys = PrefixKeys.create(namespace="", model_id="m", layout=layout, codec=codec, block_tokens=64)
        return keys.root, hash_token_blocks(keys.root, tokens_for(1, 3 * 64), 64)

    (ra, ha), (rb, hb) = chain(PLAIN), chain(ROT)
    assert ra != rb and not set(ha) & set(hb)
    policy = cs.PrecisionPolicy(first=cs.KIVI(bits=4), rest=ROT)
    assert chain(policy)[0] != chain(cs.PrecisionPolicy(first=cs.KIVI(bits=4), rest=PLAIN))[0]


def test_a_head_dim_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ConfigError, match="power of two"):
        cs.PrefixCache(model_id="m", layout=cs.KVLayout(2, 2, 80, "float16"), codec=ROT, block_tokens=64)
    cs.PrefixCache(model_id="m", layout=cs.KVLayout(2, 2, 80, "float16"), codec=PLAIN, block_tokens=64).close()
    with pytest.raises(InputError, match="power of two"):
        ROT.encode(torch.zeros(2, 64, 96), torch.zeros(2, 64, 96))


# -- the codec: what it computes -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("clip", [0, 2])
def test_codec_quantizes_the_rotated_v_and_rotates_the_decode_back(dtype, clip, monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    codec = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_clip=clip, v_rotate=True)
    plain = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_clip=clip)
    k, v = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(4)).to(dtype), _v((2, 64, 64), 5, dtype)
    got, base = codec.encode(k, v), plain.encode(k, v)
    bufs = [b for _, _, b in got.named_buffers()]
    for a, b in zip(bufs[:3], [b for _, _, b in base.named_buffers()][:3]):
        assert torch.equal(a, b)  # K untouched
    want = ref.quantize(rotation.rotate(v).to(dtype), bits=2, group=64, axis=AXIS_CHANNELS, stats_dtype=F16,
                        clip=clip)
    assert all(torch.equal(a, b) for a, b in zip(bufs[3:], want))
    k_hat, v_hat = codec.decode(got)
    y = ref.dequantize(*want, bits=2, group=64, axis=AXIS_CHANNELS, shape=(2, 64, 64), dtype=torch.float32)
    assert v_hat.dtype == dtype and torch.equal(v_hat, rotation.unrotate(y).to(dtype))
    assert torch.equal(k_hat, plain.decode(base)[0])
    # into a strided view of a larger output, as the decoders write
    out_k = torch.zeros(2, 3, 64, 64, dtype=dtype)
    out_v = torch.zeros(2, 3, 64, 64, dtype=dtype)
    codec.decode(got, out=(out_k[:, 1], out_v[:, 1]))
    assert torch.equal(out_v[:, 1], v_hat) and not out_v[:, 0].any() and not out_v[:, 2].any()


def test_rotation_lowers_int2_error_on_outlier_channels():
    k, v = torch.randn(4, 128, 64), _v((4, 128, 64), 6)
    err = {}
    for name, codec in (("plain", PLAIN), ("rot", ROT)):
        err[name] = float((codec.decode(codec.encode(k, v))[1] - v).square().mean())
    assert err["rot"] < 0.6 * err["plain"], err


# -- the kernels and every path: the same bytes as the torch reference ----------------------------------


def _kernels():
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("clip", [0, 2])
def test_codec_through_the_kernels_equals_the_torch_path(dtype, clip, monkeypatch):
    _kernels()
    codec = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_clip=clip, v_rotate=True)
    k = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    v = _v((2, 64, 64), 8, dtype).to(DEVICE)
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    want = codec.encode(k, v)
    want_kv = codec.decode(want)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    got = codec.encode(k, v)
    for (_, _, a), (_, _, b) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(a, b)
    got_kv = codec.decode(got)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


def test_cache_in_place_ingest_through_layer_tables_equals_the_torch_path(monkeypatch):
    # The in-place ingest reads V through a layer table over rotated copies of the layers.
    _kernels()
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
    toks = tokens_for(3, 2 * 64 + 9)
    kv = [(torch.randn(2, 137, 64).half().to(DEVICE), _v((2, 137, 64), 10 + i, F16).to(DEVICE)) for i in range(2)]
    from cacheseek import kernels

    calls = []
    real = kernels.quantize_layers
    monkeypatch.setattr(kernels, "quantize_layers", lambda *a, **kw: calls.append(kw["axis"]) or real(*a, **kw))
    got = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv(backend.BACKEND_ENV, name)
        tiers = cs.TierConfig(cpu_bytes="8MiB", pin_memory=DEVICE == "cuda")
        with cs.PrefixCache(model_id="m", layout=layout, codec=ROT, block_tokens=64, tiers=tiers) as cache:
            assert cache.ingest(toks, kv).stored == 2
            frames = []
            for h in cache.block_hashes(toks):
                frame, _ = cache.store.get(h)
                frames.append(bytes(frame.payload_view()))
                frame.release()
            loaded = cache.materialize(toks, device=DEVICE)
            got[name] = (frames, [(k.cpu(), v.cpu()) for k, v in loaded.layers])
    assert sorted(calls) == sorted([AXIS_CHANNELS, AXIS_TOKENS])  # the layer-table launches ran (triton only)
    assert got["torch"][0] == got["triton"][0]
    for (ka, va), (kb, vb) in zip(got["torch"][1], got["triton"][1]):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # and it is the codec's own round trip of each block
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    for i, (k, v) in enumerate(kv):
        kk, vv = ROT.decode(ROT.encode(k[:, :128].cpu().contiguous(), v[:, :128].cpu().contiguous()))
        assert torch.equal(got["torch"][1][i][1][0], vv) and torch.equal(got["torch"][1][i][0][0], kk)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares a CUDA device with the CPU")
@pytest.mark.parametrize("n", [64, 128, 2048])
def test_rotation_and_codes_on_a_gpu_equal_the_cpus(n):
    # The rotation is elementwise fp32 (no device-dependent sums): the same bits on any
    # device, so a GPU's kernels store the codes the CPU reference stores. Rows wider
    # than the rotation kernel holds (2048) take the torch stages on the GPU.
    x = _v((3, 128, n), 12, F16)
    assert torch.equal(rotation.rotate(x.cuda()).cpu(), rotation.rotate(x))
    assert torch.equal(rotation.unrotate(x.cuda().float()).cpu(), rotation.unrotate(x.float()))
    codec = cs.KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=64, v_clip=2, v_rotate=True)
    k = torch.randn(3, 128, n, generator=torch.Generator().manual_seed(13)).half()
    on_gpu, on_cpu = codec.encode(k.cuda(), x.cuda()), codec.encode(k, x)
    for (_, _, a), (_, _, b) in zip(on_gpu.named_buffers(), on_cpu.named_buffers()):
        assert torch.equal(a.cpu(), b)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(codec.decode(on_gpu), codec.decode(on_cpu)))


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [2, 8, 64, 128, 256])
def test_the_rotation_kernel_gives_the_references_bits(n, dtype):
    # One pass in registers (kernels.rotate_rows, interpreted here, compiled on a GPU): the
    # same fp32 stages as the reference, rounded once to the output dtype.
    from cacheseek import kernels

    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 37, n, generator=gen) * 5).to(dtype).to(DEVICE)
    y = torch.randn(3, 37, n, generator=gen).to(DEVICE)
    c = rotation.scaled_signs(n, DEVICE)
    for out in (dtype, torch.float32):
        got = kernels.rotate_rows(x, c, inverse=False, dtype=out)
        assert got.dtype == out and torch.equal(got.cpu(), rotation.fwht(x.cpu().float() * c.cpu()).to(out))
        back = kernels.rotate_rows(y, c, inverse=True, dtype=out)
        assert torch.equal(back.cpu(), (rotation.fwht(y.cpu()) * c.cpu()).to(out))
    strided = x.transpose(0, 1)  # not contiguous: read as its rows all the same
    assert torch.equal(kernels.rotate_rows(strided, c, inverse=False, dtype=dtype).cpu(),
                       rotation.fwht(strided.cpu().float() * c.cpu()).to(dtype))


def test_the_rotation_kernel_refuses_bad_arguments():
    from cacheseek import kernels

    c = rotation.scaled_signs(64, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        kernels.rotate_rows(torch.zeros(2, 48), rotation.scaled_signs(64, "cpu")[:48], inverse=False, dtype=F16)
    with pytest.raises(ValueError, match="scales"):
        kernels.rotate_rows(torch.zeros(2, 64, device=DEVICE), c.double().to(DEVICE), inverse=False, dtype=F16)


@pytest.mark.parametrize("bits", [2, 4])
def test_a_decode_is_capped_at_the_dtype_max_after_the_rotation_back(bits, monkeypatch):
    # fp16 V holding +-65504 (its max) is accepted: rotated, it is 65504 / 8 in every
    # channel. Each group's quantization error, rotated back, adds up on the one channel
    # and passed 65520, which the fp16 cast made +-Inf: a decode must stay finite, capped
    # at the dtype's max as the plain decode is.
    monkeypatch.setenv(backend.BACKEND_ENV, "torch")
    codec = cs.KIVI(bits=bits, group_size=32, v_rotate=True)
    k = torch.zeros(1, 32, 64, dtype=F16)
    v = torch.zeros(1, 32, 64, dtype=F16)
    v[..., 0] = 65504.0
    v[0, 1, 5] = -65504.0
    _, v_hat = codec.decode(codec.encode(k, v))
    assert bool(torch.isfinite(v_hat).all()) and v_hat.abs().max() == 65504.0


def test_the_rotation_kernel_caps_a_rotation_back_as_the_reference_does():
    from cacheseek import kernels

    y = torch.full((2, 64), 65504 / 8 * 1.001)  # rotated back: +-1.001 * 65504 in channel 0
    y[1] *= -1
    c = rotation.scaled_signs(64, DEVICE)
    want = rotation.unrotate(y, F16)
    assert bool(torch.isfinite(want).all()) and want.abs().max() == 65504.0
    assert torch.equal(kernels.rotate_rows(y.to(DEVICE), c, inverse=True, dtype=F16).cpu(), want)


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16, torch.float32], ids=str)
def test_the_rotation_kernel_keeps_the_sign_of_zero_as_the_reference_does(dtype):
    # A row that rotates back to zeros is +0 times the signed scales: -0.0 where a sign is
    # negative. The kernel's lower cap was -cap(-x), and Triton negates as 0 - x, which
    # made every -0.0 +0.0 on a GPU (the interpreter negates truly): its decodes of low-bit
    # V differed from the reference's in those bits (equal as numbers, not as the bytes
    # the kernels promise).
    from cacheseek import kernels

    y = torch.zeros(3, 64)
    y[1, 5] = -0.0
    y[2] = torch.arange(64.0) - 31.5  # most channels nonzero, as a check on the rest
    c = rotation.scaled_signs(64, DEVICE)
    want = rotation.unrotate(y, dtype)
    assert bool(torch.signbit(want[0]).any())
    got = kernels.rotate_rows(y.to(DEVICE), c, inverse=True, dtype=dtype).cpu()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
