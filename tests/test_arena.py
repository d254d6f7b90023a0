"""The CPU tier's host arena mapping its memory: a chunk at a time as allocations need it
(the default), or the whole capacity at construction (``map_at_start``, which a pinned
tier's first fill wants: page-locking a chunk inside an ingest stalls it)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.store.arena import HostArena
from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

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
