"""The CPU tier's host arena mapping its memory: a chunk at a time as allocations need it
(the default), or the whole capacity at construction (``map_at_start``, which a pinned
tier's first fill wants: page-locking a chunk inside an ingest stalls it); and what it does
when the OS maps (or pins) no more: a capped arena, the tier evicting within it, the frames
it has no room for stored by the tier below."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.store import arena as arena_module
from cacheseek.store.arena import HostArena
from cacheseek.store.cpu import CpuTier
from store_helpers import BLOCK, LAYOUT, make_kv, raw_frame, tokens_for

MiB = 1 << 20


def test_map_at_start_maps_the_capacity_and_allocations_never_grow_it():
    arena = HostArena(3 * MiB + MiB // 2, chunk_bytes=MiB, map_at_start=True)
    assert arena.reserved_bytes == 4 * MiB  # 3 x 1 MiB + a last chunk of the 1 MiB minimum
    chunks = list(arena._chunks)
    slots = [arena.allocate(MiB // 4) for _ in range(14)]
    assert all(s is not None for s in slots)
    assert arena._chunks == chunks and arena.reserved_bytes == 4 * MiB


def test_by_default_chunks_are_mapped_as_allocations_need_them():
    arena = HostArena(3 * MiB, chunk_bytes=MiB)
    assert arena.reserved_bytes == 0
    arena.allocate(MiB // 2)
    assert arena.reserved_bytes == MiB
    arena.allocate(MiB // 2)
    arena.allocate(MiB // 2)
    assert arena.reserved_bytes == 2 * MiB


def test_a_cache_built_with_cpu_map_at_start_fills_without_mapping_more():
    tiers = dict(cpu_bytes="8MiB", pin_memory=False)
    toks, kv = tokens_for(3, 4 * BLOCK), make_kv(4 * BLOCK, 3)
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(**tiers, cpu_map_at_start=True)) as cache:
        mapped = cache.stats()["tiers"][0]["arena_bytes"]
        assert mapped >= 8 * MiB
        assert cache.ingest(toks, kv).stored == 4
        assert cache.stats()["tiers"][0]["arena_bytes"] == mapped
        got = cache.materialize(toks)
        assert got.num_tokens == 4 * BLOCK
        for (k, v), (k0, v0) in zip(got.layers, kv):
            assert k[0].equal(k0[:, : 4 * BLOCK]) and v[0].equal(v0[:, : 4 * BLOCK])
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(**tiers)) as lazy:
        assert lazy.stats()["tiers"][0]["arena_bytes"] == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 96), st.booleans(), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 600))
def test_could_fit_says_exactly_whether_freeing_the_unleased_slots_makes_the_room(ops, ask):
    # Slots of 1-96 KiB fill a 2 x 1 MiB arena (some freed, some leased); ``could_fit`` over
    # every slot still allocated must answer what freeing them all and allocating does.
    arena = HostArena(2 * MiB, chunk_bytes=MiB, map_at_start=True)
    live, leases = [], []
    for kib, free_it, lease_it in ops:
        slot = arena.allocate(kib * 1024)
        if slot is None:
            continue
        if lease_it:
            leases.append(arena.lease(slot))
        if free_it:
            arena.free(slot)
        else:
            live.append(slot)
    answer = arena.could_fit(ask * 1024, live)
    for slot in live:
        arena.free(slot)
    assert answer == (arena.allocate(ask * 1024) is not None)


def _mmap_failing_after(monkeypatch, maps: int) -> list[int]:
    """The arena's mmap maps ``maps`` chunks, then fails as under RLIMIT_AS (ENOMEM) until
    the list it returns is given an item (the OS has memory again)."""
    real, calls, freed = arena_module.mmap.mmap, [0], []

    def mmap(fileno: int, nbytes: int):
        calls[0] += 1
        if calls[0] > maps and not freed:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fileno, nbytes)

    monkeypatch.setattr(arena_module, "mmap", types.SimpleNamespace(
        mmap=mmap, PAGESIZE=arena_module.mmap.PAGESIZE, MADV_DONTNEED=arena_module.mmap.MADV_DONTNEED))
    return freed


def test_a_tier_whose_next_chunk_cannot_be_mapped_evicts_within_what_it_mapped(monkeypatch, caplog):
    freed = _mmap_failing_after(monkeypatch, 1)
    clock = [1000.0]
    monkeypatch.setattr(arena_module.time, "monotonic", lambda: clock[0])
    key, frame = raw_frame(0)
    tier = CpuTier(4 << 20, chunk_bytes=1 << 20)  # room in the budget for 4 chunks
    per_chunk = (1 << 20) // arena_module.slot_stride(frame.nbytes)
    stored = []
    with caplog.at_level("WARNING", logger="cacheseek.store"):
        for i in range(3 * per_chunk):
            key, frame = raw_frame(i + 1)
            tier.put(key, frame)  # never raises: past the first chunk, each put evicts for its room
            stored.append(key)
    assert tier.stats().extra["arena_bytes"] == 1 << 20
    capped = tier.stats().extra["arena_capped"]
    assert capped is not None and "Cannot allocate memory" in capped
    assert tier.stats().blocks == per_chunk and tier.stats().evictions == 2 * per_chunk
    assert all(tier.contains(k) for k in stored[-per_chunk:])
    warned = [r for r in caplog.records if "could not be mapped" in r.getMessage()]
    assert len(warned) == 1 and "1.00 MiB" in warned[0].getMessage()  # once, with the size and the reason
    # Mapping is tried again once the retry period passed, not at every put before it.
    freed.append(True)
    tier.put(*raw_frame(10_000))
    assert tier.stats().extra["arena_capped"] is not None
    clock[0] += arena_module.GROW_RETRY_SECONDS
    tier.put(*raw_frame(10_001))
    assert tier.stats().extra["arena_capped"] is None and tier.stats().extra["arena_bytes"] == 2 << 20


def test_a_tier_that_cannot_map_any_chunk_refuses_frames_with_a_reason(monkeypatch):
    _mmap_failing_after(monkeypatch, 0)
    tier = CpuTier(8 << 20, chunk_bytes=1 << 20)
    with pytest.raises(cs.StorageError, match="host memory short: the OS refused"):
        tier.put(*raw_frame(1))
    assert tier.reserve(1024) is None
    assert tier.stats().blocks == 0 and tier.stats().write_errors == 1


def test_a_chunk_that_cannot_be_pinned_is_mapped_unpinned(monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    real_empty, tries = torch.empty, []

    def empty(*args, pin_memory=False, **kw):
        if pin_memory:
            tries.append(1)
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    arena = HostArena(3 << 20, pin=True, chunk_bytes=1 << 20)
    with caplog.at_level("WARNING", logger="cacheseek.store"):
        slots = [arena.allocate(1 << 19) for _ in range(6)]
    assert all(s is not None for s in slots) and arena.reserved_bytes == 3 << 20
    assert not arena.pinned and arena.capped is None
    assert len(tries) == 1  # a refused pin is not asked again for each later chunk
    assert [r for r in caplog.records if "could not be pinned" in r.getMessage()]


_UNDER_RLIMIT_AS = textwrap.dedent("""
    import json, resource, sys, time
    import cacheseek as cs
    from cacheseek.store import arena
    sys.path.insert(0, sys.argv[2])
    from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

    arena.GROW_RETRY_SECONDS = 0.5
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="2GiB", disk_path=sys.argv[1], disk_bytes="64MiB"))
    vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))  # room for threads, not for a 1 GiB chunk
    out = {"results": []}
    for i in range(6):
        r = cache.ingest(tokens_for(i, 4 * BLOCK), make_kv(4 * BLOCK, i))
        out["results"].append([r.stored, r.failed, {k: str(v) for k, v in r.errors.items()}])
    tiers = {t["name"]: t for t in cache.stats()["tiers"]}
    out["capped"] = tiers["cpu"]["arena_capped"]
    out["cpu_blocks"], out["disk_blocks"] = tiers["cpu"]["blocks"], tiers["disk"]["blocks"]
    out["read_back"] = cache.materialize(tokens_for(0, 4 * BLOCK)).num_tokens
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    time.sleep(0.6)
    cache.ingest(tokens_for(99, 4 * BLOCK), make_kv(4 * BLOCK, 99))
    tiers = {t["name"]: t for t in cache.stats()["tiers"]}
    out["capped_after"], out["cpu_blocks_after"] = tiers["cpu"]["arena_capped"], tiers["cpu"]["blocks"]
    cache.close()
    print(json.dumps(out))
""")


def test_an_embedded_cache_under_rlimit_as_stores_on_disk_what_host_memory_cannot_hold(tmp_path):
    """A real RLIMIT_AS: the CPU tier's 1 GiB chunk cannot be mapped (mmap ENOMEM). Every
    ingest is stored, on disk, none raises; once the limit is lifted the tier maps again."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # (glibc's 64 MiB per-thread heaps count against RLIMIT_AS)
    proc = subprocess.run([sys.executable, "-c", _UNDER_RLIMIT_AS, str(tmp_path / "disk"), os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # stored (on disk), the CPU tier's refusal said in ``errors`` as a tier's
    assert [(stored, failed, sorted(errors)) for stored, failed, errors in out["results"]] == [(4, 0, ["cpu"])] * 6
    assert "host memory short" in out["results"][0][2]["cpu"]
    assert out["capped"] is not None and "Cannot allocate memory" in out["capped"]
    assert out["cpu_blocks"] == 0 and out["disk_blocks"] == 24 and out["read_back"] == 4 * BLOCK
    assert out["capped_after"] is None and out["cpu_blocks_after"] == 4
    assert proc.stderr.count("could not be mapped") == 1


def test_a_frame_larger_than_a_chunk_gets_a_chunk_of_its_own():
    # (a frame over the 1 GiB chunk, a big block, at a scale a test can afford): it was "no
    # contiguous room" in an empty tier whatever the budget.
    arena = HostArena(16 * MiB, chunk_bytes=MiB)
    small = arena.allocate(MiB // 2)
    big = arena.allocate(3 * MiB)
    assert small is not None and big is not None and big.chunk.nbytes == 3 * MiB  # (whole MiB: not doubled)
    big.view()[:] = b"\x07" * big.nbytes
    assert bytes(big.view()[-4:]) == b"\x07" * 4
    arena.free(big)
    again = arena.allocate(3 * MiB)  # the freed chunk serves the next one, no new mapping
    assert again is not None and again.chunk is big.chunk and arena.reserved_bytes == 4 * MiB
    # A chunk of its own is mapped only where the capacity holds it: 4 MiB mapped of 16, so
    # 13 MiB more is refused (it passed the budget by as much), 12 MiB taken.
    assert arena.allocate(13 * MiB) is None and arena.reserved_bytes == 4 * MiB
    assert arena.allocate(12 * MiB) is not None and arena.reserved_bytes == 16 * MiB


def test_a_tier_stores_and_serves_a_frame_larger_than_its_chunks():
    tier = CpuTier(64 * MiB, chunk_bytes=MiB, pin=False)
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=1024,
                        tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False)) as cache:
        toks, kv = tokens_for(5, 1024), make_kv(1024, 5)
        cache.ingest(toks, kv)
        key = next(iter(cache.store.tiers[0]._records))
        frame = cache.store.tiers[0].get(key)
        assert frame.meta.nbytes > 1.5 * MiB
        tier.put(key, frame)
        frame.lease.release()
    got = tier.get(key)
    assert bytes(got.host) == bytes(frame.host) and tier.stats().write_errors == 0
    got.lease.release()


def test_a_tier_built_for_frames_over_a_gib_maps_chunks_that_hold_them():
    # (nothing is mapped until a frame lands: a 3 GiB budget costs no memory here)
    store = cs.TierConfig(cpu_bytes="3GiB", pin_memory=False, cpu_reserve_bytes=0).build(max_frame_bytes=1208 << 20)
    try:
        # (whole MiB past a GiB: a power of two, 2 GiB, mapped up to twice the frame)
        assert store.tiers[0]._arena.chunk_bytes == 1208 << 20 and store.tiers[0]._arena.reserved_bytes == 0
    finally:
        store.close()


def test_a_frame_larger_than_every_chunk_of_a_mapped_budget_says_so():
    tier = CpuTier(4 * MiB, chunk_bytes=MiB, pin=False, map_at_start=True)
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=1024,
                        tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False)) as cache:
        cache.ingest(tokens_for(6, 1024), make_kv(1024, 6))
        key = next(iter(cache.store.tiers[0]._records))
        frame = cache.store.tiers[0].get(key)
        with pytest.raises(cs.StorageError, match="larger than the tier's largest slot"):
            tier.put(key, frame)
        frame.lease.release()


def test_a_block_in_the_cpu_tier_costs_under_1_5_kib_of_python_objects_beside_its_frame():
    """``cpu_bytes`` counts frames only, so what the tier keeps per block beside the frame is
    memory no budget sees: 2.9 KiB a block of Python objects here once (a parsed header's
    layout, codec and tensor table per block, a copy of the header, a ctypes array per slot,
    a dict of children per parent), 0.9 KiB now (the bound leaves room for other Python
    versions' object sizes). Chains of one model's frames, parsed from their bytes as a
    server's are; the Python heap's growth over the puts, per block."""
    import gc
    import tracemalloc

    from cacheseek.store.frame import build_frame, parse_frame, plan_frame
    from cacheseek.store.tier import BlockFrame

    # small frames (1,408 bytes), where the overhead weighs most
    layout = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16")
    buffers = [(name, "float16", (1, 1, 16, 16)) for name in ("k", "v")]
    chains = []
    for c in range(65):
        parent, frames = bytes(16), []
        for position in range(64):
            key = (c * 64 + position + 1).to_bytes(16, "big")
            meta = plan_frame(block_hash=key, parent_hash=parent, position=position, layout=layout, block_tokens=16,
                              codec=cs.Raw().spec(), buffers=buffers)
            frames.append((key, bytes(build_frame(meta, [bytes(e.nbytes) for e in meta.tensors]))))
            parent = key
        chains.append(frames)
    tier = CpuTier(8 * MiB, chunk_bytes=8 * MiB)

    def put(frames):
        for key, data in frames:
            tier.put(key, BlockFrame(parse_frame(data), host=memoryview(data)))

    put(chains[0])  # (the arena's first chunk mapped)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for c in chains[1:]:
            put(c)
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / (64 * 64)
    finally:
        tracemalloc.stop()
    assert tier.stats().blocks == 65 * 64
    assert per_block < 1536, f"{per_block:.0f} bytes of Python objects a block beside its frame"


def test_the_cpu_tier_keeps_no_packed_header_of_a_planned_frame():
    # (a planned frame's meta carries its packed header, to write it once; the tier holds
    # the header in the frame's own bytes, for as long as it holds the block)
    tier = CpuTier(4 * MiB, chunk_bytes=MiB)
    key, frame = raw_frame(7)
    assert frame.meta.packed_header is not None
    tier.put(key, frame)
    with tier.get(key) as got:
        assert got.meta.packed_header is None and got.meta == frame.meta
        assert bytes(got.host) == bytes(frame.host)
