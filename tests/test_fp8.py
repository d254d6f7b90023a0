"""fp8 KV (an engine's fp8 KV cache, vLLM's ``--kv-cache-dtype fp8*``): stored by Raw byte
for byte, through every path KV takes, with NaN and Inf refused as for the other dtypes.

torch has no arithmetic on the fp8 dtypes on the CPU (``equal``, ``isfinite``, ...), so KV
is made and compared as its bytes: random bit patterns, every finite one among them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.hashing import root_hash
from cacheseek.quant import backend as kivi_codec
from paged_helpers import (DEVICE, engine_pages, ingest_pages, page_tables, read_tokens, snapshot, stored_bytes,
                           unchanged, write_tokens)
from redis_servers import RedisServer, needs_redis
from server_helpers import Server
from store_helpers import BLOCK, tokens_for

FP8 = ["float8_e4m3fn", "float8_e5m2"]
# Bits all set exactly in each dtype's NaN and Inf (e4m3fn: no Inf, NaN is S.1111.111).
NAN_BITS = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7C}
L, H, D = 2, 2, 16  # small: the Triton interpreter is slow
T = 2 * BLOCK + 5  # a partial tail: not stored
# Few examples beyond the explicit ones (which cover each dtype, and each layout and mode):
# the Triton interpreter is slow, and every example holds every finite pattern already.
SMALL = settings(max_examples=2)
# (the backend fixture only sets an environment variable, the same for every example)
PAGED = settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def layout(dtype: str) -> cs.KVLayout:
    return cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype)


def finite_bytes(dtype: str, n: int, seed: int) -> torch.Tensor:
    """``n`` random finite bit patterns of ``dtype`` as uint8, every finite one among the first."""
    bits = NAN_BITS[dtype]
    every = torch.tensor([b for b in range(256) if b & bits != bits], dtype=torch.uint8)
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    x = torch.where(x & bits == bits, x ^ 0x04, x)  # (clears a bit of the mask: finite, e4m3fn too)
    x[: min(n, every.numel())] = every[: min(n, every.numel())]
    return x


def make_kv(dtype: str, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (H, tokens, D)
    flat = finite_bytes(dtype, 2 * L * H * tokens * D, seed).view(L, 2, *shape)
    flat = flat[torch.randperm(L, generator=torch.Generator().manual_seed(seed))]  # patterns spread over layers
    fp8 = getattr(torch, dtype)
    flat = flat.to(DEVICE)  # (on a GPU the compiled kernels take no CPU tensors)
    return [(flat[i, 0].view(fp8), flat[i, 1].view(fp8)) for i in range(L)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().contiguous().view(torch.uint8),
                                              b.cpu().contiguous().view(torch.uint8))


def assert_prefix(got, kv, tokens: int) -> None:
    assert got.num_tokens == tokens
    for (k, v), (k0, v0) in zip(got.layers, kv):
        assert same_bytes(k[0], k0[:, :tokens]) and same_bytes(v[0], v0[:, :tokens])


def make_cache(dtype: str, *, codec=None, cpu="1MiB", **kw) -> cs.PrefixCache:
    return cs.PrefixCache(model_id="m", layout=layout(dtype), codec=codec or cs.Raw(), block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes=cpu, pin_memory=False, **kw))


# -- the layout and keys ---------------------------------------------------------------------


def test_fp8_layouts_take_torch_dtypes_and_aliases_and_name_the_dtype_in_every_key():
    for dtype, names in {"float8_e4m3fn": [torch.float8_e4m3fn, "fp8_e4m3", "float8_e4m3", "e4m3"],
                         "float8_e5m2": [torch.float8_e5m2, "fp8_e5m2", "e5m2"]}.items():
        for name in names:
            lay = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=name)
            assert (lay.dtype, lay.itemsize, lay.torch_dtype) == (dtype, 1, getattr(torch, dtype))
            assert lay.raw_nbytes(3) == 2 * 3 * 8
    with pytest.raises(cs.ConfigError, match="float8_e4m3fn"):
        cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp8")  # e4m3 on CUDA, e4m3fnuz on ROCm
    with pytest.raises(cs.ConfigError):
        cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float8_e4m3fnuz)
    roots = set()
    for dtype in ["float16", *FP8]:
        lay = layout(dtype)
        assert lay.fingerprint() == f"L={L};H={H};D={D};dtype={dtype}".encode()
        roots.add(root_hash(namespace="", model_id="m", layout_fingerprint=lay.fingerprint(), block_tokens=BLOCK,
                            codec_fingerprint=cs.Raw().fingerprint()))
    assert len(roots) == 3


def test_blocks_of_one_fp8_dtype_are_never_found_under_the_other():
    toks = tokens_for(1, T)
    with make_cache("float8_e4m3fn") as e4m3, make_cache("float8_e5m2") as e5m2:
        assert e4m3.ingest(toks, make_kv("float8_e4m3fn", T, 1)).stored == 2
        assert e4m3.block_hashes(toks) != e5m2.block_hashes(toks)
    disk = Path(tempfile.mkdtemp())
    with make_cache("float8_e4m3fn", disk_path=disk) as a:
        a.ingest(toks, make_kv("float8_e4m3fn", T, 1))
    with make_cache("float8_e5m2", cpu=0, disk_path=disk) as b:  # one store under both
        assert b.lookup(toks) == 0


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("codec", [cs.KIVI(bits=4, group_size=32), cs.KIVI(bits=8, group_size=32),
                                   cs.PrecisionPolicy(first=cs.Raw(), rest=cs.KIVI(bits=4, group_size=32),
                                                      first_blocks=1)],
                         ids=["int4", "int8", "policy"])
def test_kivi_on_an_fp8_layout_is_refused_when_the_cache_is_built(dtype, codec):
    with pytest.raises(cs.ConfigError, match=rf"KIVI .*'k_bits'.* does not encode {dtype} KV; .*raw codec"):
        make_cache(dtype, codec=codec)
    kv = make_kv(dtype, BLOCK, 0)[0]
    with pytest.raises(cs.InputError, match=f"KIVI does not encode {dtype}"):
        cs.KIVI(bits=4, group_size=32).encode(*kv)  # (a codec used on its own)


def test_a_frame_saying_kivi_encoded_fp8_is_refused_as_a_frame_error():
    """A frame from elsewhere (a server's upload, a file) naming KIVI over an fp8 layout is
    malformed, as a codec that cannot encode its layout is: a FrameError (a 400, a miss),
    never a decode with fp8 outputs."""
    from cacheseek.store.frame import build_frame, check_codec_layout, parse_frame, plan_frame

    lay, kivi = layout("float8_e4m3fn"), cs.KIVI(bits=4, group_size=32)
    template = kivi.template((L, H, BLOCK, D), lay.dtype)  # (what KIVI would write, were fp8 its input)
    buffers = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    meta = plan_frame(block_hash=bytes(16), parent_hash=bytes(16), position=0, layout=lay, block_tokens=BLOCK,
                      codec=kivi.spec(), buffers=buffers)
    frame = build_frame(meta, [bytes(e.nbytes) for e in meta.tensors])
    with pytest.raises(cs.FrameError, match="cannot encode this layout .*raw codec"):
        check_codec_layout(parse_frame(frame))


# -- round trips -----------------------------------------------------------------------------


@SMALL
@given(dtype=st.sampled_from(FP8), seed=st.integers(0, 2**16))
@example(dtype="float8_e4m3fn", seed=0)
@example(dtype="float8_e5m2", seed=1)
def test_random_bit_patterns_round_trip_through_the_cpu_and_disk_tiers(dtype, seed):
    toks, kv = tokens_for(seed, T), make_kv(dtype, T, seed)
    with tempfile.TemporaryDirectory() as disk:
        with make_cache(dtype, disk_path=disk) as cache:
            assert cache.ingest(toks, kv).stored == 2
            got = cache.materialize(toks)
            assert got.tiers == ["cpu"] * 2
            assert_prefix(got, kv, 2 * BLOCK)
            with cache.materialize(toks, layerwise=True) as load:
                for i, (k0, v0) in enumerate(kv):
                    k, v = load.layer(i)
                    assert same_bytes(k[0], k0[:, : 2 * BLOCK]) and same_bytes(v[0], v0[:, : 2 * BLOCK])
        with make_cache(dtype, cpu=0, disk_path=disk) as fresh:
            got = fresh.materialize(toks)
            assert got.tiers == ["disk"] * 2
            assert_prefix(got, kv, 2 * BLOCK)


@pytest.mark.parametrize("dtype", FP8)
def test_a_layerwise_save_stores_the_bytes_a_whole_ingest_does(dtype, monkeypatch):
    from cacheseek import layerwise_save

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    toks, kv = tokens_for(3, 2 * BLOCK), make_kv(dtype, 2 * BLOCK, 3)
    with make_cache(dtype) as cache:
        writer = cache.ingest_layerwise(toks)
        for i, (k, v) in enumerate(kv):
            writer.put_layer(i, k, v)
        assert writer.finish().stored == 2
        assert_prefix(cache.materialize(toks), kv, 2 * BLOCK)


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """The copy kernels (interpreted on a CPU, fp8 moved as bytes) or the torch fallback."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, request.param)
    return request.param


@PAGED
@given(dtype=st.sampled_from(FP8), kind=st.sampled_from(["flash", "hnd"]), seed=st.integers(0, 2**16),
       layerwise=st.booleans())
@example(dtype="float8_e4m3fn", kind="flash", seed=0, layerwise=False)
@example(dtype="float8_e5m2", kind="hnd", seed=1, layerwise=True)
@example(dtype="float8_e4m3fn", kind="hnd", seed=2, layerwise=True)
@example(dtype="float8_e5m2", kind="flash", seed=3, layerwise=False)
def test_random_bit_patterns_round_trip_through_an_engines_pages(backend, dtype, kind, seed, layerwise):
    """vLLM's flash layout ([2, pages, page, H, D] per layer) and HND pages, one request and a
    batch, whole or layer by layer: the pages' bytes go in and come out as they were, as the
    contiguous path stores them."""
    page, num_pages = 16, 16
    fp8 = getattr(torch, dtype)
    sizes = [T, BLOCK]
    toks = [tokens_for(seed, n) for n in sizes[:1]] + [tokens_for(seed + 1, BLOCK)]
    kvs = [make_kv(dtype, n, seed + r) for r, n in enumerate(sizes)]
    pages, _ = engine_pages(kind, L, H, D, num_pages, page, fp8, seed=seed)
    tables = page_tables(sizes, page, num_pages, seed=seed)
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    with make_cache(dtype) as cache, make_cache(dtype) as contiguous:
        requests = [cs.PagedRequest(k, ids) for k, ids in zip(toks, tables)]
        got = ingest_pages(cache, requests, pages, layerwise)
        assert [r.stored for r in got] == [2, 1]
        for k, kv in zip(toks, kvs):
            contiguous.ingest(k, kv)
            assert stored_bytes(cache, k) == stored_bytes(contiguous, k)

        dest, dest_tensors = engine_pages(kind, L, H, D, num_pages, page, fp8, seed=seed + 7)
        dest_tables = page_tables(sizes, page, num_pages, seed=seed + 11)
        dest_requests = [cs.PagedRequest(k, ids) for k, ids in zip(toks, dest_tables)]
        if layerwise:
            with cache.materialize_into_batch(dest_requests, dest, layerwise=True) as load:
                assert load.num_blocks == 3
                for layer in range(L):
                    load.wait(layer)
        else:
            loaded = cache.materialize_into_batch(dest_requests, dest)
            assert [x.num_tokens for x in loaded] == [2 * BLOCK, BLOCK]
        for kv, ids, n in zip(kvs, dest_tables, [2 * BLOCK, BLOCK]):
            for (k, v), (k0, v0) in zip(read_tokens(dest, ids, n), kv):
                assert same_bytes(k, k0[:, :n]) and same_bytes(v, v0[:, :n])
        one = cache.materialize_into(toks[0], dest.at(dest_tables[1] + dest_tables[0][:2]))  # (one request)
        assert one.num_tokens == 2 * BLOCK
        for (k, v), (k0, v0) in zip(read_tokens(dest, dest_tables[1] + dest_tables[0][:2], 2 * BLOCK), kvs[0]):
            assert same_bytes(k, k0[:, : 2 * BLOCK]) and same_bytes(v, v0[:, : 2 * BLOCK])
        del dest_tensors


# -- NaN and Inf -----------------------------------------------------------------------------


def nonfinite_patterns(dtype: str) -> list[int]:
    bits = NAN_BITS[dtype]
    return [b for b in range(256) if b & bits == bits]  # e4m3fn: NaN, -NaN; e5m2: +-Inf and six NaNs


@pytest.mark.parametrize("dtype", FP8)
def test_the_bit_tests_agree_with_torchs_own_conversion_on_all_256_patterns(dtype):
    """The masks against an oracle they do not share (the tests above take NAN_BITS, the
    same constants): a pattern is refused exactly where torch's conversion to float32 is
    not finite, by the torch path's tests and by both copy kernels (fp8 moved as bytes)."""
    from cacheseek import kernels
    from cacheseek.quant.tensors import all_finite, finite_per_block

    fp8, dev = getattr(torch, dtype), torch.device(DEVICE)
    bits = torch.arange(256, dtype=torch.uint8)
    want = bits.view(fp8).float().isfinite()
    assert int((~want).sum()) == (2 if dtype == "float8_e4m3fn" else 8)
    x = bits.to(dev).view(fp8)
    assert torch.equal(finite_per_block(x.view(256, 1)).cpu(), want)
    assert [bool(all_finite(x[i : i + 1])) for i in range(256)] == want.tolist()
    # One block a pattern, each in its own page: one flag a pattern.
    ids = torch.arange(256, dtype=torch.int32)
    where = kernels.BlockPages.build(ids, torch.stack([ids, torch.zeros_like(ids)], 1), page_size=1, num_pages=256,
                                     block_tokens=1, device=dev)
    out = torch.empty(256, 1, 1, 1, 1, dtype=fp8, device=dev)
    ok = torch.ones(256, dtype=torch.bool, pin_memory=dev.type == "cuda")
    kernels.gather_pages(kernels.PagedLayers([x.view(256, 1, 1, 1)]), where, 0, 256, 1, out=out, ok_flags=ok)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    assert torch.equal(ok, want) and torch.equal(out.view(torch.uint8).flatten().cpu(), bits)
    # The layers' gather has one flag a launch: every finite pattern in one, each other alone.
    layer = torch.zeros(1, 256 + 16, 16, dtype=torch.uint8)  # [H, T, D]; 16-byte token rows
    bad = int((~want).sum())
    layer[0, : 256 - bad, 0] = bits[want]
    layer[0, 256 : 256 + bad, 0] = bits[~want]
    layer = layer.to(dev).view(fp8)
    got = []
    for t0, block in [(0, 256), *((256 + j, 1) for j in range(bad))]:
        flag = torch.ones(1, dtype=torch.bool, pin_memory=dev.type == "cuda")
        rows = torch.empty(1, 1, 1, block, 16, dtype=fp8, device=dev)
        kernels.gather_layers([layer], t0, 1, block, out=rows, ok_flag=flag)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        got.append(bool(flag))
    assert got == [True] + [False] * bad


@pytest.mark.parametrize("dtype", FP8)
def test_nan_and_inf_are_refused_and_nothing_is_stored(dtype, backend):
    """Every non-finite pattern, in K or in V, contiguous or in pages: refused as for 16-bit KV."""
    patterns = nonfinite_patterns(dtype)
    assert len(patterns) == (2 if dtype == "float8_e4m3fn" else 8)
    page, num_pages = 16, 8
    fp8 = getattr(torch, dtype)
    with make_cache(dtype) as cache:
        for i, bad in enumerate(patterns):
            toks, kv = tokens_for(100 + i, 2 * BLOCK), make_kv(dtype, 2 * BLOCK, i)
            side = i % 2
            kv[1][side].view(torch.uint8)[1, BLOCK + i % BLOCK, i % D] = bad  # block 1 of layer 1
            with pytest.raises(cs.InputError, match="NaN or Inf"):
                cache.ingest(toks, kv)
            pages, tensors = engine_pages("flash", L, H, D, num_pages, page, fp8, seed=i)
            write_tokens(pages, kv, list(range(4)))
            before = snapshot(tensors)
            with pytest.raises(cs.InputError, match="NaN or Inf"):
                cache.ingest(toks, pages.at(list(range(4))))
            assert unchanged(before, tensors)
            assert cache.lookup(toks) == 0
        assert cache.stats()["tiers"][0]["blocks"] == 0


def test_fp8_pages_held_as_uint8_are_refused_saying_how_to_view_them():
    """vLLM allocates fp8 caches as uint8 pages: given as they are, the error says what to do."""
    toks = tokens_for(9, 2 * BLOCK)
    for dtype in FP8:
        pages, tensors = engine_pages("flash", L, H, D, 8, 16, getattr(torch, dtype))
        raw = cs.KVPages.vllm([t.view(torch.uint8) for t in tensors])
        with make_cache(dtype) as cache:
            with pytest.raises(cs.InputError, match=rf"^pages: dtype torch.uint8, the cache's layout says {dtype} "
                                                    rf"\(fp8 pages held as uint8: make them of t.view\(torch.{dtype}\)\)$"):
                cache.ingest(toks, raw.at(list(range(8))))
            assert cache.lookup(toks) == 0
        del pages


# -- a server, Redis -------------------------------------------------------------------------


def test_fp8_round_trips_through_a_real_server_and_keeps_the_two_dtypes_apart(tmp_path):
    toks = tokens_for(5, T)
    with Server(tmp_path) as srv:
        caches = {dtype: cs.RemoteCache(srv.url, model_id="m", layout=layout(dtype), codec=cs.Raw(),
                                        block_tokens=BLOCK) for dtype in FP8}
        try:
            kvs = {dtype: make_kv(dtype, T, 5) for dtype in FP8}
            assert caches["float8_e4m3fn"].ingest(toks, kvs["float8_e4m3fn"]).stored == 2
            assert caches["float8_e5m2"].lookup(toks) == 0  # same tokens, the other dtype: other keys
            assert caches["float8_e5m2"].ingest(toks, kvs["float8_e5m2"]).stored == 2
            for dtype, cache in caches.items():
                assert_prefix(cache.materialize(toks), kvs[dtype], 2 * BLOCK)
            bad = make_kv("float8_e5m2", T, 6)
            bad[0][0].view(torch.uint8)[0, 0, 0] = 0x7C  # +Inf
            with pytest.raises(cs.InputError, match="NaN or Inf"):
                caches["float8_e5m2"].ingest(tokens_for(6, T), bad)
            assert caches["float8_e5m2"].lookup(tokens_for(6, T)) == 0
            with pytest.raises(cs.ConfigError, match="raw codec"):
                cs.RemoteCache(srv.url, model_id="m", layout=layout("float8_e4m3fn"),
                               codec=cs.KIVI(bits=4, group_size=32), block_tokens=BLOCK)
        finally:
            for cache in caches.values():
                cache.close()


@needs_redis
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_round_trips_through_redis(dtype, tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        toks, kv = tokens_for(8, T), make_kv(dtype, T, 8)
        with make_cache(dtype, cpu=0, redis_url=srv.url, redis_bytes="16MiB") as cache:
            assert cache.ingest(toks, kv).stored == 2
        with make_cache(dtype, cpu=0, redis_url=srv.url, redis_bytes="16MiB") as fresh:
            got = fresh.materialize(toks)
            assert got.tiers == ["redis"] * 2
            assert_prefix(got, kv, 2 * BLOCK)
    finally:
        srv.stop()
