"""Precision policies: a codec per block position. Keys (a policy never shares a block with
a uniform codec or another policy), frames (each names its own codec), round trips through
every path (in place, put, disk, a real server) equal bit for bit to per-block uniform
decodes, and bad policies refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.block_format import BlockFormat
from cacheseek.decode import BatchDecoder, decode_frames
from cacheseek.errors import FrameError
from cacheseek.hashing import hash_token_blocks
from cacheseek.prefix_keys import PrefixKeys
from cacheseek.quant import setting_from_spec
from cacheseek.store.device_staging import staging_pool
from cacheseek.store.tier import BlockFrame
from server_helpers import Server
from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

POLICY = cs.PrecisionPolicy(first=cs.KIVI(bits=8), first_blocks=2, rest=cs.KIVI(k_bits=4, v_bits=2))
RAW_HEAD = cs.PrecisionPolicy(first=cs.Raw(), rest=cs.KIVI(bits=2))

CODECS = [cs.Raw(), cs.KIVI(bits=8), cs.KIVI(bits=4), cs.KIVI(bits=2), cs.KIVI(k_bits=4, v_bits=2),
          cs.KIVI(bits=2, group_size=64), cs.KIVI(k_bits=4, v_bits=2, v_clip=2)]


def _uniform_decode(policy, kv, blocks: int):
    """K and V of ``blocks`` blocks, each encoded and decoded alone by its position's codec."""
    ks, vs = [], []
    for i in range(blocks):
        codec = policy.codec_at(i) if isinstance(policy, cs.PrecisionPolicy) else policy
        k = torch.stack([k[:, i * BLOCK:(i + 1) * BLOCK] for k, _ in kv])
        v = torch.stack([v[:, i * BLOCK:(i + 1) * BLOCK] for _, v in kv])
        dk, dv = codec.decode(codec.encode(k, v), "cpu")
        ks.append(dk)
        vs.append(dv)
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _assert_equal_to_uniform(got, policy, kv, blocks: int) -> None:
    assert got.num_blocks == blocks
    k_ref, v_ref = _uniform_decode(policy, kv, blocks)
    for layer, (k, v) in enumerate(got.layers):
        assert torch.equal(k[0].cpu(), k_ref[layer]), f"layer {layer} K"
        assert torch.equal(v[0].cpu(), v_ref[layer]), f"layer {layer} V"


def _cache(policy=POLICY, **tiers):
    tiers.setdefault("pin_memory", False)
    return cs.PrefixCache(model_id="m", layout=LAYOUT, codec=policy, block_tokens=BLOCK, tiers=cs.TierConfig(**tiers))


# -- the setting -------------------------------------------------------------------------


def test_spec_round_trips_and_names_each_part():
    spec = POLICY.spec()
    assert spec == {"name": "policy", "version": 1, "first": cs.KIVI(bits=8).spec(), "first_blocks": 2,
                    "rest": cs.KIVI(k_bits=4, v_bits=2).spec()}
    assert setting_from_spec(spec) == POLICY
    assert setting_from_spec(cs.KIVI(bits=2).spec()) == cs.KIVI(bits=2)
    assert [POLICY.codec_at(i) for i in range(4)] == [cs.KIVI(bits=8)] * 2 + [cs.KIVI(k_bits=4, v_bits=2)] * 2


@pytest.mark.parametrize("kw, match", [
    ({"first": cs.KIVI(bits=8), "rest": cs.KIVI(bits=8)}, "same codec"),
    ({"first": cs.Raw(), "rest": cs.KIVI(bits=2), "first_blocks": 0}, "first_blocks"),
    ({"first": cs.Raw(), "rest": cs.KIVI(bits=2), "first_blocks": True}, "first_blocks"),
    ({"first": cs.Raw(), "rest": cs.KIVI(bits=2), "first_blocks": 1.5}, "first_blocks"),
    ({"first": "int8", "rest": cs.KIVI(bits=2)}, "PrecisionPolicy.first: expected a codec"),
    ({"first": cs.Raw(), "rest": RAW_HEAD}, "PrecisionPolicy.rest: expected a codec"),
])
def test_bad_policies_are_refused_with_the_reason(kw, match):
    with pytest.raises(cs.ConfigError, match=match):
        cs.PrecisionPolicy(**kw)


@pytest.mark.parametrize("spec", [
    {**POLICY.spec(), "extra": 1},
    {**POLICY.spec(), "version": 2},
    {**POLICY.spec(), "rest": {"name": "zstd"}},
    {**POLICY.spec(), "first": POLICY.spec()},
])
def test_bad_policy_specs_are_refused(spec):
    with pytest.raises(cs.ConfigError):
        setting_from_spec(spec)


def test_a_policy_whose_part_does_not_fit_the_layout_is_refused_at_construction():
    bad = cs.PrecisionPolicy(first=cs.Raw(), rest=cs.KIVI(bits=2, group_size=64))
    with pytest.raises(cs.ConfigError):
        _cache(bad)  # blocks of 32 tokens cannot hold K groups of 64


# -- keys --------------------------------------------------------------------------------

_codec = st.sampled_from(CODECS)


@st.composite
def _setting(draw):
    if draw(st.booleans()):
        return draw(_codec)
    first, rest = draw(_codec), draw(_codec)
    if first == rest:
        return first
    return cs.PrecisionPolicy(first=first, first_blocks=draw(st.integers(1, 4)), rest=rest)


@given(a=_setting(), b=_setting(), seed=st.integers(0, 3))
def test_different_settings_never_share_a_key(a, b, seed):
    def chain(setting):
        keys = PrefixKeys.create(namespace="", model_id="m", layout=LAYOUT, codec=setting, block_tokens=64)
        return keys.root, hash_token_blocks(keys.root, tokens_for(seed, 4 * 64), 64)

    (ra, ha), (rb, hb) = chain(a), chain(b)
    if a.spec() == b.spec():
        assert (ra, ha) == (rb, hb)
    else:
        assert ra != rb
        assert not set(ha) & set(hb)


def test_a_policy_cache_does_not_find_a_uniform_chain_in_the_same_store(tmp_path):
    toks, kv = tokens_for(1, 4 * BLOCK), make_kv(4 * BLOCK, 1)
    with _cache(cs.KIVI(k_bits=4, v_bits=2), disk_path=tmp_path, cpu_bytes=0) as uniform:
        uniform.ingest(toks, kv)
    with _cache(POLICY, disk_path=tmp_path, cpu_bytes=0) as mixed:
        assert mixed.lookup(toks) == 0
        mixed.ingest(toks, kv)
        assert mixed.lookup(toks) == 4 * BLOCK


# -- frames and round trips ---------------------------------------------------------------


@pytest.mark.parametrize("policy", [POLICY, RAW_HEAD], ids=["int8-head", "raw-head"])
@pytest.mark.parametrize("tiers", [{"cpu_bytes": "8MiB"}, {"cpu_bytes": 0, "disk": True}],
                         ids=["in-place", "put-disk"])
def test_mixed_chain_round_trip_equals_per_block_uniform_decode(policy, tiers, tmp_path):
    tiers = dict(tiers)
    if tiers.pop("disk", False):
        tiers["disk_path"] = tmp_path
    toks, kv = tokens_for(2, 5 * BLOCK + 7), make_kv(5 * BLOCK + 7, 2)
    with _cache(policy, **tiers) as cache:
        assert cache.ingest(toks, kv).stored == 5
        hashes = cache.block_hashes(toks)
        for i, h in enumerate(hashes):  # each frame names the codec of its position
            frame, _ = cache.store.get(h)
            assert frame.meta.codec == policy.codec_at(i).spec()
            assert frame.meta.position == i
            frame.release()
        _assert_equal_to_uniform(cache.materialize(toks), policy, kv, 5)
        # A prefix that ends inside the first segment, and one just past it.
        _assert_equal_to_uniform(cache.materialize(toks, max_tokens=BLOCK), policy, kv, 1)
        _assert_equal_to_uniform(cache.materialize(toks, max_tokens=3 * BLOCK), policy, kv, 3)
        assert cache.stats()["codec"] == policy.spec()


def test_a_mixed_chain_is_decoded_out_of_one_staging_lease_given_back_after():
    # The parts of a mixed chain share one staging buffer: one take per decode that stages
    # its frames, as for a uniform chain, and none left lent once it returns, or once a
    # decode fails. (On the host, frames whose buffers are aligned, as a tier's are, are
    # decoded from their own bytes and take none; misaligned copies go through staging.)
    toks, kv = tokens_for(9, 5 * BLOCK), make_kv(5 * BLOCK, 9)
    pool = staging_pool(torch.device("cpu"))
    fmt = BlockFormat(POLICY, LAYOUT, BLOCK)

    def takes() -> int:
        got = pool.stats()
        return got["buffers_made"] + got["reused"] + got["one_off"]

    def misaligned(frame: BlockFrame) -> BlockFrame:  # its bytes at an odd address
        buf = bytearray(1 + len(frame.host))
        buf[1:] = frame.host
        return BlockFrame(frame.meta, host=memoryview(buf)[1:])

    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        cache.ingest(toks, kv)
        before = takes()
        got = cache.materialize(toks)
        _assert_equal_to_uniform(got, POLICY, kv, 5)
        assert takes() == before
        hashes = cache.block_hashes(toks)
        stored = [cache.store.get(h)[0] for h in hashes]
        try:
            odd = [misaligned(frame) for frame in stored]
        finally:
            for frame in stored:
                frame.release()
        k, v = decode_frames(fmt, odd, torch.device("cpu"))
        assert all(torch.equal(k[i], got.layers[i][0][0]) and torch.equal(v[i], got.layers[i][1][0])
                   for i in range(LAYOUT.num_layers))
        assert takes() == before + 1
        assert pool.stats()["leases_active"] == 0
        decoder = BatchDecoder(fmt, 5, torch.device("cpu"))
        try:
            decoder.add(odd[0])
            assert pool.stats()["leases_active"] == 1
            with pytest.raises(FrameError, match="disagree"):
                decoder.add(odd[2])  # position 2's frame (the rest's codec) where int8's belongs
        finally:
            decoder.close()
        assert pool.stats()["leases_active"] == 0


def test_ingest_of_an_extension_stores_only_the_new_blocks_with_the_rest_codec():
    toks, kv = tokens_for(3, 6 * BLOCK), make_kv(6 * BLOCK, 3)
    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        head = [(k[:, : 3 * BLOCK], v[:, : 3 * BLOCK]) for k, v in kv]
        assert cache.ingest(toks[: 3 * BLOCK], head).stored == 3
        result = cache.ingest(toks, kv)
        assert (result.present, result.stored) == (3, 3)
        _assert_equal_to_uniform(cache.materialize(toks), POLICY, kv, 6)


def test_a_frame_with_its_positions_wrong_codec_is_refused():
    fmt = BlockFormat(POLICY, LAYOUT, BLOCK)
    key, parent = bytes(range(16)), bytes(16)
    first = fmt.plan(block_hash=key, parent_hash=parent, position=0)
    fmt.check_fetched(first, key, 0)
    assert first.codec == cs.KIVI(bits=8).spec()
    moved = BlockFormat(cs.KIVI(bits=8), LAYOUT, BLOCK).plan(block_hash=key, parent_hash=parent, position=5)
    with pytest.raises(FrameError, match="another codec"):
        fmt.check_fetched(moved, key, 5)


def test_a_frame_whose_header_claims_another_position_ends_the_prefix():
    # Block 0's frame (the first codec) stored under block 2's key, its header saying pos 0:
    # it parses, and its codec is position 0's. It must be checked against the codec of the
    # place it is fetched for (a miss there), not raise in the decoder that lays block 2 out.
    from cacheseek.store.frame import build_frame, parse_frame, plan_frame
    from cacheseek.store.tier import BlockFrame

    toks, kv = tokens_for(5, 3 * BLOCK), make_kv(3 * BLOCK, 5)
    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        assert cache.ingest(toks, kv).stored == 3
        h = cache.block_hashes(toks)
        frame, _ = cache.store.get(h[0])
        meta, payload = frame.meta, bytes(frame.payload_view())
        frame.release()
        forged = plan_frame(block_hash=h[2], parent_hash=h[1], position=0, layout=meta.layout,
                            block_tokens=BLOCK, codec=meta.codec,
                            buffers=[(e.name, e.dtype, e.shape) for e in meta.tensors])
        data = build_frame(forged, [payload[e.offset:e.offset + e.nbytes] for e in meta.tensors])
        cache.store.delete(h[2])
        assert cache.store.put(h[2], BlockFrame(parse_frame(data), host=memoryview(data), sealed=True)).stored
        _assert_equal_to_uniform(cache.materialize(toks), POLICY, kv, 2)
    fmt = BlockFormat(POLICY, LAYOUT, BLOCK)
    with pytest.raises(FrameError, match="another codec"):
        fmt.check_fetched(forged, h[2], 2)


def test_nan_in_a_late_block_stores_nothing_of_the_call():
    toks, kv = tokens_for(4, 4 * BLOCK), make_kv(4 * BLOCK, 4)
    kv[1][1][0, 3 * BLOCK + 2, 5] = float("nan")
    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        with pytest.raises(cs.InputError):
            cache.ingest(toks, kv)
        assert cache.lookup(toks) == 0


def test_paged_calls_with_a_policy_are_refused_clearly():
    # vLLM's layout: per layer [2, pages, page_size, H, D]; 4 pages of 16 tokens = 2 blocks.
    pages = cs.KVPages.vllm([torch.randn(2, 4, 16, 2, 64).half() for _ in range(LAYOUT.num_layers)])
    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        with pytest.raises(cs.ConfigError, match="precision policy"):
            cache.ingest(tokens_for(5, 2 * BLOCK), pages.at([0, 1, 2, 3]))
        with pytest.raises(cs.ConfigError, match="precision policy"):
            cache.materialize_into(tokens_for(5, 2 * BLOCK), pages.at([0, 1, 2, 3]))
        assert cache.lookup(tokens_for(5, 2 * BLOCK)) == 0


def test_layerwise_loads_of_a_policy_chain_are_refused_clearly():
    toks, kv = tokens_for(7, 2 * BLOCK), make_kv(2 * BLOCK, 7)
    with _cache(POLICY, cpu_bytes="8MiB") as cache:
        assert cache.ingest(toks, kv).stored == 2
        with pytest.raises(cs.ConfigError, match="layer-wise loads: not supported with a precision policy"):
            cache.materialize(toks, layerwise=True)
        assert cache.materialize(toks).num_tokens == 2 * BLOCK  # the whole-chain load still works
    remote = cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=LAYOUT, codec=POLICY, block_tokens=BLOCK)
    with remote, pytest.raises(cs.ConfigError, match="layer-wise loads: not supported with a precision policy"):
        remote.materialize(toks, layerwise=True)  # (refused before anything is sent)


def test_the_triton_kernels_decode_a_mixed_chain_bit_for_bit(monkeypatch):
    # Interpreted on a CPU; on a GPU compiled, on CUDA tensors (the kernels refuse CPU tensors
    # outside the interpreter).
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    toks, kv = tokens_for(6, 3 * BLOCK), make_kv(3 * BLOCK, 6, device=device)
    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", "triton")
    policy = cs.PrecisionPolicy(first=cs.KIVI(bits=8), rest=cs.KIVI(bits=2))
    with _cache(policy, cpu_bytes="8MiB", pin_memory=device == "cuda") as cache:
        cache.ingest(toks, kv)
        got = cache.materialize(toks, device=device)
    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", "torch")
    _assert_equal_to_uniform(got, policy, [(k.cpu(), v.cpu()) for k, v in kv], 3)


# -- a real server ------------------------------------------------------------------------


def test_remote_cache_with_a_policy_through_a_real_server(tmp_path):
    toks, kv = tokens_for(7, 4 * BLOCK + 3), make_kv(4 * BLOCK + 3, 7)
    with Server(tmp_path / "srv") as srv:
        with cs.RemoteCache(srv.url, model_id="m", layout=LAYOUT, codec=POLICY, block_tokens=BLOCK) as remote:
            assert remote.ingest(toks, kv).stored == 4
            _assert_equal_to_uniform(remote.materialize(toks), POLICY, kv, 4)
            assert remote.lookup(toks) == 4 * BLOCK
        # The same tokens under the uniform codec of the policy's rest: no block shared.
        with cs.RemoteCache(srv.url, model_id="m", layout=LAYOUT, codec=POLICY.rest, block_tokens=BLOCK) as other:
            assert other.lookup(toks) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tiers", [{"cpu_bytes": "64MiB"}, {"gpu_bytes": "64MiB", "cpu_bytes": 0}],
                         ids=["in-place", "gpu-tier"])
def test_mixed_chain_on_a_gpu_equals_per_block_uniform_decode(tiers):
    toks = tokens_for(8, 12 * BLOCK + 3)
    kv = make_kv(12 * BLOCK + 3, 8, device="cuda")
    with _cache(POLICY, pin_memory=True, **tiers) as cache:
        assert cache.ingest(toks, kv).stored == 12
        got = cache.materialize(toks, device="cuda")
        _assert_equal_to_uniform(got, POLICY, [(k.cpu(), v.cpu()) for k, v in kv], 12)
