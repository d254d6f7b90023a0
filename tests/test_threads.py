"""``PrefixCache`` from several threads at once (a worker with many request threads).

Eight threads ingest, materialize and look up overlapping and distinct prefixes, on a CPU
tier alone and on CPU + disk (written through, and with a CPU tier small enough to evict
and promote). What each thread gets is bit-identical to a single-threaded run, the stats
add up, every lease is released (CPU-tier slots and device staging), and nothing deadlocks
(each run has a timeout). The engine surface too: threads save layer by layer, load layer
by layer, and ingest from and load into one engine's shared pages (each its own page ids).
On a GPU (scripts/h200.sh tests-new), threads ingest and materialize device KV through one
cache at once, sharing the store's streams."""

from __future__ import annotations


import pytest
import torch

import cacheseek as cs
from cacheseek import layerwise_save
from cacheseek.store.device_staging import staging_pool
from paged_helpers import engine_tensors, kv_pages, read_tokens, write_tokens
from store_helpers import BLOCK, LAYOUT, make_cache, make_kv, run_threads, tokens_for

THREADS = 8
ROUNDS = 6


def _work(seed: int) -> tuple[list[int], list]:
    """A prompt and its KV: a shared head (blocks 0-1, same for every seed), then its own blocks."""
    head = tokens_for(0, 2 * BLOCK)
    own = tokens_for(100 + seed, 3 * BLOCK)
    kv_head = make_kv(2 * BLOCK, 0)
    kv_own = make_kv(3 * BLOCK, 100 + seed)
    kv = [(torch.cat([k0, k1], dim=1), torch.cat([v0, v1], dim=1)) for (k0, v0), (k1, v1) in zip(kv_head, kv_own)]
    return head + own, kv


def _run_one(cache, toks, kv, device=None) -> tuple[int, int, list[torch.Tensor]]:
    cache.ingest(toks, kv)
    located = cache.locate(toks).num_tokens
    got = cache.materialize(toks, device)
    return located, got.num_tokens, [t.clone() for k, v in got.layers for t in (k, v)]


CONFIGS = {
    "cpu": dict(cpu="8MiB"),
    "cpu+disk": dict(cpu="8MiB", disk=True),
    "small-cpu+disk": dict(cpu="160KiB", disk=True),  # evicts, demotes and promotes all along
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_threads_get_what_one_thread_gets(tmp_path, config):
    kw = dict(CONFIGS[config])
    if kw.pop("disk", False):
        kw["disk"] = tmp_path / "disk"
    work = [_work(seed) for seed in range(THREADS)]

    # Single-threaded reference, in a cache of its own.
    ref_kw = dict(kw)
    if "disk" in ref_kw:
        ref_kw["disk"] = tmp_path / "ref"
    ref = make_cache(**ref_kw)
    expected = [_run_one(ref, toks, kv) for toks, kv in work]
    ref.close()

    cache = make_cache(**kw)
    staged = staging_pool(torch.device("cpu")).stats()["leases_active"]

    def worker(i: int) -> list:
        out = []
        for r in range(ROUNDS):
            # Each thread works on its own prompt and, every other round, a neighbour's
            # (so distinct threads ingest and read the very same blocks at once).
            j = i if r % 2 == 0 else (i + 1) % THREADS
            toks, kv = work[j]
            out.append((j, _run_one(cache, toks, kv)))
        return out

    results = run_threads(worker, THREADS)

    for per_thread in results:
        for j, (located, tokens, tensors) in per_thread:
            exp_located, exp_tokens, exp_tensors = expected[j]
            assert tokens == located == 5 * BLOCK or config.startswith("small"), (tokens, located)
            if tokens == exp_tokens:
                assert all(torch.equal(a, b) for a, b in zip(tensors, exp_tensors))
            else:  # a small tier: a shorter prefix (evicted meanwhile) is still exact
                n = tokens
                assert n % BLOCK == 0
                for a, b in zip(tensors, exp_tensors):
                    assert torch.equal(a[..., :n, :], b[..., :n, :])

    stats = cache.stats()
    cpu = stats["tiers"][0]
    assert cpu["leases_active"] == 0 and cpu["leased_bytes"] == 0 and cpu["lease_double_releases"] == 0
    assert cpu["held_slots"] == 0 and cpu["reservation_bytes"] == 0
    assert cpu["used_bytes"] <= cpu["capacity_bytes"]
    pools = {p["device"]: p for p in stats["device_staging"]}
    assert pools["cpu"]["leases_active"] == staged and pools["cpu"]["lease_double_releases"] == 0
    # Every block distinct store-wide: the shared head twice, each thread's own three.
    if not config.startswith("small"):
        assert stats["blocks"] == 2 + 3 * THREADS
        assert cpu["blocks"] == 2 + 3 * THREADS
    if "disk" in kw:
        disk = stats["tiers"][1]
        assert disk["blocks"] == 2 + 3 * THREADS  # written through: every block, once
    # A last single-threaded pass over the same cache agrees too.
    for j, (toks, kv) in enumerate(work):
        located, tokens, tensors = _run_one(cache, toks, kv)
        assert tokens == 5 * BLOCK or config.startswith("small")
        for a, b in zip(tensors, expected[j][2]):
            assert torch.equal(a[..., :tokens, :], b[..., :tokens, :])
    cache.close()


PAGE = 16
PROMPT_PAGES = 5 * BLOCK // PAGE  # a prompt of five blocks, in pages


def _paged_work(seed: int) -> tuple[list[int], list]:
    """A second prompt: the same shared head as ``_work``'s, then blocks of its own."""
    toks, kv = _work(seed)
    own = tokens_for(200 + seed, 3 * BLOCK)
    kv_own = make_kv(3 * BLOCK, 200 + seed)
    return toks[: 2 * BLOCK] + own, [(torch.cat([k[:, : 2 * BLOCK], k1], dim=1), torch.cat([v[:, : 2 * BLOCK], v1], dim=1))
                                     for (k, v), (k1, v1) in zip(kv, kv_own)]


def _run_engine(cache, pages, work, paged, j: int, dst: list[int], dst_lw: list[int]) -> dict:
    """What an engine's worker does with prompt ``j``: a layer-wise save (layers in reverse
    order, as an engine's hooks may), a layer-wise load, an ingest from the engine's pages
    and two loads into its own pages (whole and layer-wise). ``dst`` and ``dst_lw`` are
    scribbled over first, so a load that writes nothing cannot pass for one that did."""
    toks, kv = work[j]
    writer = cache.ingest_layerwise(toks)
    for i in reversed(range(LAYOUT.num_layers)):
        writer.put_layer(i, *kv[i])
    saved = writer.finish()
    with cache.materialize(toks, kv[0][0].device, layerwise=True) as load:
        layers = [tuple(t.clone() for t in load.layer(i)) for i in range(LAYOUT.num_layers)]
        loaded = load.num_tokens
    ptoks, src = paged[j]
    ingested = cache.ingest_batch([cs.PagedRequest(ptoks, src)], pages)[0]
    for ids in (dst, dst_lw):
        index = torch.tensor(ids)
        for side in (pages.k, pages.v):
            for t in side:
                t[index] = 7.0
    whole = cache.materialize_into_batch([cs.PagedRequest(ptoks, dst)], pages)[0]
    with cache.materialize_into_batch([cs.PagedRequest(ptoks, dst_lw)], pages, layerwise=True) as load:
        for i in range(LAYOUT.num_layers):
            load.wait(i)
        by_layer = load.requests[0]
    T = 5 * BLOCK
    return {"saved": saved.blocks, "loaded": loaded, "layers": layers, "ingested": ingested.blocks,
            "paged": (whole.num_tokens, by_layer.num_tokens),
            "pages": [t.clone() for ids in (dst, dst_lw) for kv_l in read_tokens(pages, ids, T) for t in kv_l]}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=lambda c: c.name)
def test_threads_saving_and_loading_layer_by_layer_and_through_pages_get_what_one_thread_gets(codec, device,
                                                                                               monkeypatch):
    """Eight threads drive the engine surface of one cache at once (the CPU tier's slots
    reserved by layer-wise saves, the loads' staging, one engine's pages shared by all,
    each thread on page ids of its own; on a GPU the store's streams too): each call gets
    what it gets alone, bit for bit, and every slot, reservation and lease is given back."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)  # saves write into reserved slots
    work = [(toks, [(k.to(device), v.to(device)) for k, v in kv]) for toks, kv in (_work(s) for s in range(THREADS))]
    num_pages = 3 * PROMPT_PAGES * THREADS
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist()
    ids = [[perm[(3 * i + r) * PROMPT_PAGES: (3 * i + r + 1) * PROMPT_PAGES] for r in range(3)] for i in range(THREADS)]

    def engine():
        pages = kv_pages("flash", engine_tensors("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                                                 num_pages, PAGE, LAYOUT.torch_dtype, device=device))
        paged = []
        for i in range(THREADS):
            ptoks, pkv = _paged_work(i)
            write_tokens(pages, pkv, ids[i][0])
            paged.append((ptoks, ids[i][0]))
        return pages, paged

    pages, paged = engine()
    with make_cache(codec=codec, cpu="8MiB") as ref:
        expected = [_run_engine(ref, pages, work, paged, j, ids[j][1], ids[j][2]) for j in range(THREADS)]
    for j, got in enumerate(expected):
        assert got["saved"] == got["ingested"] == 5 and got["loaded"] == 5 * BLOCK
        assert got["paged"] == (5 * BLOCK, 5 * BLOCK)
        if codec.name == "raw":  # the KV itself
            toks, kv = work[j]
            assert all(torch.equal(a[0], b) for a, b in zip([t for kv_l in got["layers"] for t in kv_l],
                                                             [t for kv_l in kv for t in kv_l]))
            want = [t.to(device) for kv_l in _paged_work(j)[1] for t in kv_l]
            assert all(torch.equal(a, b) for a, b in zip(got["pages"], want + want))

    pages, paged = engine()
    cache = make_cache(codec=codec, cpu="8MiB")

    def worker(i: int) -> list:
        out = []
        for r in range(ROUNDS):
            j = i if r % 2 == 0 else (i + 1) % THREADS  # a neighbour's prompts every other round
            out.append((j, _run_engine(cache, pages, work, paged, j, ids[i][1], ids[i][2])))
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        return out

    for per_thread in run_threads(worker, THREADS):
        for j, got in per_thread:
            want = expected[j]
            assert (got["saved"], got["loaded"], got["ingested"], got["paged"]) == \
                (want["saved"], want["loaded"], want["ingested"], want["paged"])
            assert all(torch.equal(a, b) for kv_a, kv_b in zip(got["layers"], want["layers"]) for a, b in zip(kv_a, kv_b))
            assert all(torch.equal(a, b) for a, b in zip(got["pages"], want["pages"]))
    stats = cache.stats()
    cpu = stats["tiers"][0]
    assert cpu["leases_active"] == 0 and cpu["lease_double_releases"] == 0
    assert cpu["held_slots"] == 0 and cpu["reservation_bytes"] == 0
    assert stats["blocks"] == 2 + 3 * THREADS + 3 * THREADS  # the head once, each prompt's own blocks once
    cache.close()


GPU_CONFIGS = {
    "cpu": dict(cpu="64MiB"),  # in-place ingest into CPU-tier slots; decodes from them
    "gpu+cpu": dict(gpu="32MiB", cpu="64MiB"),  # the put path's pooled staging; hits on the GPU tier
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=lambda c: c.name)
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_threads_on_a_gpu_share_the_streams_and_get_bit_exact_kv(config, codec):
    """Threads ingest GPU KV and materialize it on the GPU through one cache at once: the
    store's long-lived streams and the device's staging pool are shared by all of them."""
    dev = torch.device("cuda", torch.cuda.current_device())
    work = [(toks, [(k.to(dev), v.to(dev)) for k, v in kv]) for toks, kv in (_work(s) for s in range(THREADS))]
    ref = make_cache(codec=codec, **GPU_CONFIGS[config])
    expected = [_run_one(ref, toks, kv, dev) for toks, kv in work]
    ref.close()
    torch.cuda.synchronize(dev)
    if codec.name == "raw":  # the KV itself, bit for bit
        for (toks, kv), (_, tokens, tensors) in zip(work, expected):
            assert tokens == 5 * BLOCK
            assert all(torch.equal(a[0], b) for a, b in zip(tensors, [t for kv_l in kv for t in kv_l]))

    cache = make_cache(codec=codec, **GPU_CONFIGS[config])
    staged = staging_pool(dev).stats()["leases_active"]

    def worker(i: int) -> list:
        out = []
        for r in range(ROUNDS):
            j = i if r % 2 == 0 else (i + 1) % THREADS
            toks, kv = work[j]
            out.append((j, _run_one(cache, toks, kv, dev)))
        torch.cuda.current_stream(dev).synchronize()
        return out

    results = run_threads(worker, THREADS)
    torch.cuda.synchronize(dev)
    for per_thread in results:
        for j, (located, tokens, tensors) in per_thread:
            assert tokens == located == expected[j][1] == 5 * BLOCK
            assert all(torch.equal(a, b) for a, b in zip(tensors, expected[j][2]))
    stats = cache.stats()
    cpu = next(t for t in stats["tiers"] if t["name"] == "cpu")
    assert cpu["leases_active"] == 0 and cpu["held_slots"] == 0 and cpu["reservation_bytes"] == 0
    assert stats["blocks"] == 2 + 3 * THREADS
    pool = next(p for p in stats["device_staging"] if p["device"] == str(dev))
    assert pool["leases_active"] == staged and pool["lease_double_releases"] == 0
    assert pool["pooled_bytes"] <= pool["cap_bytes"]
    cache.close()
