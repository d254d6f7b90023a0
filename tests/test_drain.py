"""``TieredStore.drain``: what only the memory tiers of a write-back store hold, written down
to the first persistent tier (disk, else Redis) so that a store opened again finds it; over
real files and a real redis-server. (The server's shutdown runs it: test_server_drain.py.)"""

from __future__ import annotations

import random

import pytest
import torch

import cacheseek as cs
from cacheseek.store.eviction import make_index
from cacheseek.store.tier import BlockFrame, BlockInfo
from redis_servers import RedisServer, needs_redis
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, chain, disk_charge, make_cache, make_kv, tokens_for

FRAME_BYTES = LAYOUT.raw_nbytes(BLOCK) + 1024  # a Raw frame with its header, rounded up


def put_chain(store, blocks: list[tuple[bytes, bytes]]) -> None:
    from cacheseek.store.frame import parse_frame

    results = store.put_many([(k, BlockFrame(parse_frame(f), host=memoryview(f))) for k, f in blocks])
    assert all(r.stored for r in results)


def write_back(tmp_path, *, cpu=64 << 20, disk_bytes="1GiB", eviction="lru", **kw):
    return cs.TierConfig(cpu_bytes=cpu, disk_path=tmp_path / "disk", disk_bytes=disk_bytes, write_through=(),
                         eviction=eviction, **kw).build()


def found_after_reopen(store, tmp_path, blocks: list[tuple[bytes, bytes]], **config) -> list[bytes]:
    """``found`` in the persistent tiers of ``store`` closed and opened again (alone): its
    disk under ``tmp_path``, or those of ``config`` (``TierConfig``'s arguments)."""
    store.close()
    again = cs.TierConfig(cpu_bytes=0, **(config or {"disk_path": tmp_path / "disk"})).build()
    try:
        return found(again, blocks)
    finally:
        again.close()


def found(store, blocks: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys of ``blocks`` that ``store`` serves, each checked byte for byte."""
    out = []
    for key, frame in blocks:
        got = store.get(key)
        if got is not None:
            with got[0] as f:
                assert f.to_bytes() == frame, f"block {key.hex()} read back other than written"
            out.append(key)
    return out


def test_a_drain_writes_what_only_memory_holds_to_disk_and_a_reopened_store_finds_it(tmp_path):
    store = write_back(tmp_path)
    chains = [chain(seed, 5) for seed in range(6)]
    for c in chains:
        put_chain(store, c)
    assert store.tier("disk").stats().blocks == 0  # write-back: nothing demoted yet
    seen = []
    report = store.drain(progress=lambda r: seen.append((r.blocks, r.written)))
    assert (report.tier, report.blocks, report.written, report.skipped, report.failed, report.left) == \
        ("disk", 30, 30, 0, 0, 0)
    assert report.written_bytes == report.bytes == sum(len(f) for c in chains for _, f in c)
    assert report.stopped is None and seen[0] == (30, 0)  # the first call: the plan, nothing written yet
    assert store.tier("cpu").stats().blocks == 30  # copied: memory keeps its own
    assert store.drain().blocks == 0  # nothing left that only memory holds
    assert len(found_after_reopen(store, tmp_path, [b for c in chains for b in c])) == 30


def test_a_drain_reports_its_progress_batch_by_batch_when_asked_every_0_seconds(tmp_path):
    store = write_back(tmp_path)
    put_chain(store, chain(12, 40))
    seen = []
    report = store.drain(progress=lambda r: seen.append(r.written), every_seconds=0)
    assert seen == [0, 16, 32, 40] and report.written == 40  # the plan, then each write of DRAIN_BATCH
    store.close()


def test_an_embedded_write_back_cache_drained_before_close_is_found_by_the_next_one(tmp_path):
    toks, kv = tokens_for(3, 4 * BLOCK), make_kv(4 * BLOCK, 3)
    cache = make_cache(cpu="4MiB", disk=tmp_path / "disk", write_through=())
    assert cache.ingest(toks, kv).stored == 4
    assert cache.store.drain().written == 4
    cache.close()
    again = make_cache(cpu=0, disk=tmp_path / "disk")
    try:
        assert again.lookup(toks) == 4 * BLOCK
        assert_prefix_equal(again.materialize(toks), kv, 4 * BLOCK)
    finally:
        again.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_a_drain_writes_what_a_gpu_tier_alone_holds_to_disk(tmp_path, codec):
    """Blocks held in device memory only (a GPU tier over the CPU tier, write-back) are
    copied to the host on their way to disk; the next store finds them bit-exact."""
    toks, kv = tokens_for(5, 4 * BLOCK), make_kv(4 * BLOCK, 5)
    kv = [(k.cuda(), v.cuda()) for k, v in kv]
    cache = make_cache(codec=codec, gpu="64MiB", cpu="4MiB", disk=tmp_path / "disk", write_through=())
    assert cache.ingest(toks, kv).stored == 4
    assert [t.name for t in cache.store.tiers if t.stats().blocks] == ["gpu"]
    assert cache.store.drain().written == 4
    want = cache.materialize(toks, device="cpu")
    cache.close()
    again = make_cache(codec=codec, cpu=0, disk=tmp_path / "disk")
    try:
        assert again.lookup(toks) == 4 * BLOCK
        got = again.materialize(toks, device="cpu")
        assert all(torch.equal(a, b) for x, y in zip(got.layers, want.layers) for a, b in zip(x, y))
    finally:
        again.close()


def test_close_alone_does_not_drain(tmp_path):
    """The embedding application decides whether to pay for a drain: ``close`` writes nothing
    down, so what only memory held is gone (the loss a drain exists for)."""
    store = write_back(tmp_path)
    blocks = chain(1, 4)
    put_chain(store, blocks)
    assert found_after_reopen(store, tmp_path, blocks) == []


def _ranked_store(tmp_path, eviction):
    """Three chains in the CPU tier: A the oldest, then B, then C; A pinned; C's tail touched
    last (its head is then its least recently used block)."""
    store = write_back(tmp_path, eviction=eviction)
    a, b, c = chain(10, 3), chain(20, 3), chain(30, 3)
    for blocks in (a, b, c):
        put_chain(store, blocks)
    store.touch_chain([k for k, _ in b])
    store.tier("cpu").touch([c[2][0]])  # tail only: the tier ranks C's tail above its head
    assert store.pin(a[-1][0]) is not None
    return store, a, b, c


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_cut_drain_wrote_pinned_chains_then_the_best_each_head_before_its_tails(tmp_path, eviction, monkeypatch):
    """One block a call, cut after 5: A (pinned) first, then C (its tail is the CPU tier's most
    recent use, but its head goes down before it), B left behind. What is written is whole."""
    import cacheseek.store.tiered as tiered

    monkeypatch.setattr(tiered, "DRAIN_BATCH", 1)
    store, a, b, c = _ranked_store(tmp_path, eviction)
    order = store._drain_plan(store.tiers[:1], store.tiers[1:])[0]
    assert [k for k, _ in order[:6]] == [k for k, _ in a + c]
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 5

    report = store.drain(stop=stop)
    assert (report.written, report.left, report.stopped) == (5, 4, "cut")
    assert report.left_bytes == report.bytes - report.written_bytes
    assert found_after_reopen(store, tmp_path, a + b + c) == [k for k, _ in a + c[:2]]


def test_a_drain_out_of_time_writes_nothing_more_and_says_what_it_left(tmp_path):
    store = write_back(tmp_path)
    blocks = chain(2, 4)
    put_chain(store, blocks)
    report = store.drain(seconds=0)
    assert (report.written, report.left, report.left_bytes, report.stopped) == \
        (0, 4, sum(len(f) for _, f in blocks), "time limit")
    assert found_after_reopen(store, tmp_path, blocks) == []


def test_a_full_disk_gives_up_its_own_victims_never_a_block_the_drain_wrote(tmp_path):
    """The disk holds 4 old blocks and has room for 6: the drain of 8 takes the free room and the
    old blocks' (their victims, as the disk's policy gives them up), then stops where the next
    victim would be a block it wrote, rather than trade a better block for a worse one."""
    store = write_back(tmp_path, cpu=8 * FRAME_BYTES, disk_bytes=6 * disk_charge(FRAME_BYTES))
    old, x, y = chain(3, 4), chain(4, 4), chain(5, 4)
    for blocks in (old, x, y):
        put_chain(store, blocks)  # y evicts the old chain down to disk
    assert set(store.tier("disk").keys()) == {k for k, _ in old}
    report = store.drain()
    assert (report.blocks, report.written, report.left, report.stopped) == (8, 6, 2, "no room")
    assert report.evicted == 4  # the old blocks, evicted for the drain's room (its summary said nothing of them)
    assert not set(store.tier("disk").keys()) & {k for k, _ in old}
    assert found_after_reopen(store, tmp_path, old + x + y) == [k for k, _ in x[:2] + y]  # y (the most recent) whole, x's head


def test_a_tail_whose_head_is_on_disk_already_is_written_and_one_whose_head_is_nowhere_is_not(tmp_path):
    from cacheseek.store.frame import parse_frame

    store = write_back(tmp_path)
    (head, head_frame), (tail, tail_frame) = chain(14, 2)
    (_, _), (orphan, orphan_frame) = chain(15, 2)
    store.tier("disk").put(head, BlockFrame(parse_frame(head_frame), host=memoryview(head_frame)))
    for key, frame in ((tail, tail_frame), (orphan, orphan_frame)):
        store.tier("cpu").put(key, BlockFrame(parse_frame(frame), host=memoryview(frame)))
    report = store.drain()
    assert (report.blocks, report.written, report.skipped) == (2, 1, 1)
    assert found_after_reopen(store, tmp_path, [(head, head_frame), (tail, tail_frame), (orphan, orphan_frame)]) \
        == [head, tail]


def _arc_disk_with_an_old_block_seen_once_and_one_used_twice(tmp_path, units: int, **kw):
    """A write-back store whose ARC disk of ``units`` small blocks' room holds two old ones, one
    used twice (ARC's T2: it outranks any block seen once), and the disk's charge of a small block."""
    from cacheseek.store.frame import parse_frame

    store = write_back(tmp_path, eviction="arc", disk_bytes="1GiB")
    unit = store.tier("disk").charge(len(chain(0, 1)[0][1]))
    store.close()
    store = write_back(tmp_path, eviction="arc", disk_bytes=units * unit, **kw)
    once, twice = chain(16, 1), chain(17, 1)
    for key, frame in once + twice:
        store.tier("disk").put(key, BlockFrame(parse_frame(frame), host=memoryview(frame)))
    store.tier("disk").touch([twice[0][0]])
    return store, unit, once, twice


def test_under_arc_the_drain_stops_before_a_write_that_would_give_up_its_own_block(tmp_path):
    """The disk's policy may rank an old block above the drain's (ARC: used twice, against seen
    once): the write whose victim would be the drain's best block is not made, rather than
    trade it for a worse one."""
    store, _, once, twice = _arc_disk_with_an_old_block_seen_once_and_one_used_twice(tmp_path, 3)
    blocks = [chain(seed, 1)[0] for seed in (21, 22, 23)]
    for block in reversed(blocks):  # the first one the CPU tier's most recent
        put_chain(store, [block])
    report = store.drain()
    assert (report.blocks, report.written, report.left, report.stopped) == (3, 2, 1, "no room")
    assert found_after_reopen(store, tmp_path, once + twice + blocks) == [twice[0][0], *(k for k, _ in blocks[:2])]


def test_a_larger_frame_that_took_a_block_the_drain_wrote_stops_it_and_is_counted_so(tmp_path):
    """Mixed sizes under ARC: the disk's next victim (the old block seen once) is not the
    drain's, but a frame half as large again needs a second one, and ARC then gives up the
    drain's first block (seen once too) before the old block used twice. That block is not
    counted as written (it is left behind, in memory), and the drain stops there."""
    store, unit, once, twice = _arc_disk_with_an_old_block_seen_once_and_one_used_twice(tmp_path, 3)
    small, big = chain(18, 1), chain(19, 1, tokens=BLOCK + BLOCK // 2)
    assert unit < store.tier("disk").charge(len(big[0][1])) <= 2 * unit
    put_chain(store, big)
    put_chain(store, small)  # the CPU tier's most recent: drained first
    report = store.drain()
    assert (report.blocks, report.written, report.left, report.stopped) == (2, 1, 1, "no room")
    assert report.written_bytes == len(big[0][1]) and report.left_bytes == len(small[0][1])
    assert found_after_reopen(store, tmp_path, once + twice + small + big) == [twice[0][0], big[0][0]]


def test_a_drain_writes_no_more_than_the_disk_budget(tmp_path):
    """LRU: the old block goes first, so the cap alone keeps the drain's blocks: a frame that
    would take the drain past the budget is left (here the larger, less recent one)."""
    old, small, big = chain(20, 1), chain(21, 1), chain(22, 1, tokens=BLOCK + BLOCK // 2)
    store = write_back(tmp_path, cpu=len(big[0][1]) + len(small[0][1]) + len(old[0][1]) // 2,
                       disk_bytes=2 * disk_charge(len(small[0][1])))
    for blocks in (old, big, small):  # the small one evicts the old one down to disk
        put_chain(store, blocks)
    assert store.tier("disk").keys() == [old[0][0]] and len(store.tier("cpu").keys()) == 2
    report = store.drain()
    assert (report.blocks, report.written, report.left, report.stopped) == (2, 1, 1, "no room")
    assert found_after_reopen(store, tmp_path, old + small + big) == [old[0][0], small[0][0]]


def admission(store, tier: str = "disk") -> tuple[int, int]:
    """The tier's filter's refusals: (not_admitted, not_admitted_bytes)."""
    (entry,) = [t for t in store.stats()["tiers"] if t["name"] == tier]
    return entry["admission"]["not_admitted"], entry["admission"]["not_admitted_bytes"]


def test_a_drain_respects_the_disk_admission_filter_and_counts_its_refusals(tmp_path):
    """The blocks the filter held back were skipped, and not counted in the disk's
    not_admitted: the figure an operator reads for the writes it spared said none."""
    store = write_back(tmp_path, disk_admit_after_uses=2)
    used_twice, used_once = chain(6, 3), chain(7, 3)
    put_chain(store, used_twice)
    put_chain(store, used_once)
    store.touch_chain([k for k, _ in used_twice])
    assert admission(store) == (0, 0)
    report = store.drain()
    assert (report.blocks, report.written, report.skipped) == (6, 3, 3)
    refused = sum(len(f) for _, f in used_once)
    assert admission(store) == (3, refused)
    assert (report.not_admitted, report.not_admitted_bytes) == (3, refused)
    assert found_after_reopen(store, tmp_path, used_twice + used_once) == [k for k, _ in used_twice]


def test_a_store_without_a_persistent_tier_below_memory_has_nothing_to_drain(tmp_path):
    memory_only = cs.TierConfig(cpu_bytes=1 << 20, disk_path=None).build()
    put_chain(memory_only, chain(8, 2))
    assert memory_only.drain().tier is None
    memory_only.close()
    through = cs.TierConfig(cpu_bytes=1 << 20, disk_path=tmp_path / "disk", disk_bytes="1GiB").build()
    put_chain(through, chain(9, 2))  # written through: the disk has it already
    report = through.drain()
    assert (report.tier, report.blocks) == ("disk", 0)
    through.close()


@needs_redis
def test_a_drain_writes_to_redis_where_no_disk_is_below(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        config = dict(disk_path=None, redis_url=redis.url, redis_bytes="64MiB", redis_namespace="drain")
        store = cs.TierConfig(cpu_bytes=64 << 20, write_through=(), **config).build()
        blocks = chain(11, 5)
        put_chain(store, blocks)
        report = store.drain()
        assert (report.tier, report.written, report.left) == ("redis", 5, 0)
        assert found_after_reopen(store, tmp_path, blocks, **config) == [k for k, _ in blocks]
    finally:
        redis.stop()


@needs_redis
def test_a_drain_into_an_unreachable_redis_fails_each_block_and_says_why_once(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        store = cs.TierConfig(cpu_bytes=64 << 20, disk_path=None, write_through=(), redis_url=redis.url,
                              redis_bytes="64MiB", redis_connect_timeout_seconds=0.2,
                              redis_socket_timeout_seconds=0.2).build()
        put_chain(store, chain(13, 3))
        redis.stop()
        report = store.drain()
        assert (report.tier, report.blocks, report.written, report.failed, report.left) == ("redis", 3, 0, 3, 0)
        assert report.first_error is not None and "redis" in report.first_error.lower()
        assert store.tier("cpu").stats().blocks == 3  # (memory keeps its own)
        store.close()
    finally:
        redis.stop()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_keep_order_is_the_reverse_of_the_victims_the_policy_gives_up(policy):
    """``EvictionIndex.keep_order`` names the pinned blocks, then the others in the reverse of
    the order the index evicts them (ARC's T1/T2 split and target included), without changing
    anything."""
    rng = random.Random(7)
    index = make_index(policy, 40 * 100)
    for step in range(400):  # adds, uses, evictions: ghosts, hits on them, a moving target
        key = rng.randrange(80).to_bytes(16, "big")
        if key in index:
            index.touch([key])
            continue
        while index.used_bytes + 100 > index.capacity_bytes:
            index.remove(index.victim(), evicted=True)
        index.add(key, BlockInfo(100, 100, bytes(16), 0))
    pinned = index.keys()[:3]
    index.pin(pinned)
    order = index.keep_order()
    assert sorted(order) == sorted(index.keys()) and order[:3] == pinned
    victims = []
    while (victim := index.victim()) is not None:
        victims.append(victim)
        index.remove(victim, evicted=True)
    assert victims == order[3:][::-1]


def test_a_drains_copies_from_memory_count_as_no_hit(tmp_path):
    """The drain reads every block it writes from the CPU tier: counted as its hits, they
    showed an operator a burst of reads at shutdown that no client made."""
    store = write_back(tmp_path)
    put_chain(store, chain(24, 20))
    before = store.tier("cpu").stats()
    assert store.drain().written == 20
    after = store.tier("cpu").stats()
    assert (after.hits, after.misses, after.bytes_out) == (before.hits, before.misses, before.bytes_out)
    store.close()


def test_a_drain_on_a_slow_disk_overruns_its_time_limit_by_about_one_block(tmp_path, monkeypatch):
    """A disk taking 0.1 s a block (a slow or busy device; the delay is added before each
    real write): the time limit was asked only between writes of DRAIN_BATCH (16) blocks,
    so a limit of 0.35 s ran 1.6 s. Near the limit the writes now shrink to what fits in
    the time left, at the pace seen so far."""
    import time

    store = write_back(tmp_path)
    blocks = chain(25, 40)
    put_chain(store, blocks)
    disk = store.tier("disk")
    real = disk.put_many

    def slow(items, **kw):
        time.sleep(0.1 * len(items))
        return real(items, **kw)

    monkeypatch.setattr(disk, "put_many", slow)
    report = store.drain(seconds=0.35)
    assert report.stopped == "time limit" and 2 <= report.written < 40
    assert report.seconds < 0.35 + 0.25, report
    assert found_after_reopen(store, tmp_path, blocks) == [k for k, _ in blocks[: report.written]]


@needs_redis
def test_what_the_disk_refuses_in_a_drain_goes_on_to_redis_below_it(tmp_path, monkeypatch):
    """Disk (admitting blocks used twice) over Redis, both write-back: the drain counted a
    block the disk's filter held back skipped, and one whose write failed (EIO) failed, with
    its tails; all were lost at the stop though Redis below had room, where an eviction
    would have handed them on. They go on to Redis now, each chain whole."""
    from store_helpers import fail_disk_writes

    redis = RedisServer(tmp_path / "redis").start()
    try:
        config = dict(disk_path=tmp_path / "disk", disk_bytes="1GiB", redis_url=redis.url, redis_bytes="64MiB",
                      redis_namespace="drainon")
        store = cs.TierConfig(cpu_bytes=64 << 20, write_through=(), disk_admit_after_uses=2, **config).build()
        admitted, held_back, failing = chain(26, 3), chain(27, 3), chain(28, 3)
        for blocks in (admitted, held_back, failing):
            put_chain(store, blocks)
        store.touch_chain([k for k, _ in admitted])
        store.touch_chain([k for k, _ in failing])
        fail_disk_writes(monkeypatch, [failing[0][0]])  # the chain's head: its tails have nowhere to hang on disk
        report = store.drain()
        assert (report.written, report.skipped, report.failed, report.left) == (9, 0, 0, 0), report
        assert (report.handed_on, report.handed_on_to, report.stopped) == (6, "redis", None)
        # The held-back chain counted once, where the disk's filter refused it (the failed
        # writes are not its refusals), though Redis then took it.
        refused = sum(len(f) for _, f in held_back)
        assert admission(store) == (3, refused)
        assert (report.not_admitted, report.not_admitted_bytes) == (3, refused)
        assert set(store.tier("disk").keys()) == {k for k, _ in admitted}
        store.close()
        monkeypatch.undo()
        again = cs.TierConfig(cpu_bytes=0, **config).build()
        try:
            assert found(again, admitted + held_back + failing) == [k for k, _ in admitted + held_back + failing]
        finally:
            again.close()
    finally:
        redis.stop()


@needs_redis
def test_once_the_disk_has_no_room_a_drain_writes_the_rest_to_redis_below_it(tmp_path):
    """A disk with room for a block or two over Redis: the drain stopped ("no room") and the
    rest of the chain, which an eviction from the disk would have handed to Redis, was lost."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        config = dict(disk_path=tmp_path / "disk", disk_bytes=2 * disk_charge(FRAME_BYTES), redis_url=redis.url,
                      redis_bytes="64MiB", redis_namespace="drainroom")
        store = cs.TierConfig(cpu_bytes=64 << 20, write_through=(), **config).build()
        blocks = chain(29, 5)
        put_chain(store, blocks)
        report = store.drain()
        on_disk = len(store.tier("disk").keys())
        assert set(store.tier("disk").keys()) == {k for k, _ in blocks[:on_disk]} and on_disk >= 1
        assert (report.written, report.left, report.stopped, report.handed_on) == (5, 0, None, 5 - on_disk), report
        assert found_after_reopen(store, tmp_path, blocks, **config) == [k for k, _ in blocks]
    finally:
        redis.stop()


@needs_redis
def test_a_drained_block_the_disk_gave_up_for_a_larger_frame_is_counted_in_redis_below_it(tmp_path):
    """The larger-frame case above over Redis: the small block the disk gave up went down to
    Redis as its victim, and the rest of the drain with it; the small block is counted
    written (handed on), not left behind."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        config = dict(redis_url=redis.url, redis_bytes="64MiB", redis_namespace="drainbig")
        store, _, once, twice = _arc_disk_with_an_old_block_seen_once_and_one_used_twice(tmp_path, 3, **config)
        small, big = chain(30, 1), chain(31, 1, tokens=BLOCK + BLOCK // 2)
        put_chain(store, big)
        put_chain(store, small)
        report = store.drain()
        assert (report.written, report.left, report.stopped, report.handed_on) == (2, 0, None, 1), report
        assert store.tier("disk").contains(big[0][0]) and not store.tier("disk").contains(small[0][0])
        assert found_after_reopen(store, tmp_path, small + big, disk_path=tmp_path / "disk", **config) == \
            [small[0][0], big[0][0]]
    finally:
        redis.stop()
