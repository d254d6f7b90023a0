"""Pins and residency in the store: pinned chains survive eviction in every tier, a tier full
of pinned blocks refuses writes, and store-wide figures count each block once."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cacheseek.errors import InputError, StorageError
from cacheseek.store.cpu import CpuTier
from cacheseek.store.disk import DiskTier, allocation_unit, block_charge
from cacheseek.store.eviction import POLICIES, LruIndex, SoftSpare, make_index
from cacheseek.store.frame import parse_frame
from cacheseek.store.pins import PinTable
from cacheseek.store.redis_tier import RedisTier
from cacheseek.store.tier import BlockFrame, BlockInfo
from cacheseek.store.tiered import TieredStore
from redis_servers import RedisServer, needs_redis
from server_helpers import BLOCK, raw_chain, raw_frame

FRAME = len(raw_chain(0, 1)[0][1])
# What a disk tier under the temp directory counts for one: its files in whole file-system blocks.
DISK_FRAME = block_charge(FRAME, allocation_unit(Path(tempfile.gettempdir())))


def frames(seed: int, n: int) -> list[tuple[bytes, BlockFrame]]:
    out = []
    for h, data in raw_chain(seed, n):
        buf = bytearray(data)
        out.append((h, BlockFrame(parse_frame(buf), host=memoryview(buf))))
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def stored(store: TieredStore, keys) -> list[bool]:
    return store.contains_many(list(keys))


def indexed_chain(index, n: int) -> list[bytes]:
    """A chain of ``n`` blocks of 100 bytes added to an eviction index, head first; its keys."""
    chain = [bytes([i]) * 16 for i in range(n)]
    parent = bytes(16)
    for i, key in enumerate(chain):
        index.add(key, BlockInfo(100, 200, parent, i))
        parent = key
    return chain


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_index_never_names_a_pinned_victim(policy):
    index = make_index(policy, 10_000)
    chain = indexed_chain(index, 5)
    other = bytes([9]) * 16
    index.add(other, BlockInfo(100, 200, bytes(16), 0))
    index.pin(chain[:3])  # a whole chain from its head, as the store pins
    assert (index.pinned_blocks, index.pinned_bytes, index.evictable) == (3, 300, 3)
    index.touch(chain)  # touching pinned keys is harmless
    victims = []
    while (v := index.victim()) is not None:
        victims.append(v)
        index.remove(v, evicted=True)
    assert set(victims) == {chain[3], chain[4], other} and victims.index(chain[4]) < victims.index(chain[3])
    assert index.victim() is None and len(index) == 3
    index.unpin(chain[:3])
    assert index.evictable == 3 and index.victim() == chain[2]  # leaf first again


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_index_keeps_a_parents_children_through_forks_moves_and_removals(policy):
    # (a lone child is kept apart from a parent's several: each way in and out of both)
    index = make_index(policy, 10_000)
    root, a, b, c, other = (bytes([i]) * 16 for i in range(1, 6))
    index.add(root, BlockInfo(100, 200, bytes(16), 0))
    index.add(other, BlockInfo(100, 200, bytes(16), 0))
    for key in (a, a, b, c):  # (a twice: indexed again, not a second child)
        index.add(key, BlockInfo(100, 200, root, 1))
    assert index.children(root) == [a, b, c]
    index.remove(a)
    assert index.children(root) == [b, c]
    index.add(b, BlockInfo(100, 200, other, 1))  # moved under another parent
    assert index.children(root) == [c] and index.children(other) == [b]
    index.remove(c)
    index.add(c, BlockInfo(100, 200, root, 1))
    index.add(c, BlockInfo(100, 200, root, 1))
    assert index.children(root) == [c]
    index.add(a, BlockInfo(100, 200, root, 1))
    assert index.children(root) == [c, a]
    victims = []
    while (v := index.victim()) is not None:
        assert not index.children(v), "a victim with a child stored below it"
        victims.append(v)
        index.remove(v, evicted=True)
    assert sorted(victims) == sorted([root, a, b, c, other]) and not index._kids


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_index_names_no_spared_victim_and_changes_nothing_for_it(policy):
    """``victim(spare)``: a read's promotion spares the chain it reads. The policy's order is
    walked past the spared blocks (as past pinned ones, for that call alone), a block above
    a spared one is passed over too, and with only spared blocks left there is no victim."""
    index = make_index(policy, 10_000)
    chain = indexed_chain(index, 3)
    other = bytes([9]) * 16
    index.add(other, BlockInfo(100, 200, bytes(16), 0))  # the most recent: the chain's tail goes first
    order = index.keep_order()
    assert index.victim() == chain[2]
    assert index.victim(frozenset(chain)) == other
    for tail in (chain[1:], chain[2:]):  # the blocks above a spared tail stay above it
        assert index.victim(frozenset(tail)) == other
    assert index.victim(frozenset([other])) == chain[2]
    assert index.victim(frozenset([*chain, other])) is None
    assert index.keep_order() == order and index.victim() == chain[2]  # nothing changed in the policy


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_soft_spare_is_given_up_last_not_never(policy):
    """``SoftSpare`` (a server's body sparing its write's earlier bodies): spared while any
    other block may go, then the victim ``victim()`` names, so a call that spares one is
    never left without room for it."""
    index = make_index(policy, 10_000)
    chain = indexed_chain(index, 3)
    other = bytes([9]) * 16
    index.add(other, BlockInfo(100, 200, bytes(16), 0))
    assert index.victim(SoftSpare(chain)) == other
    assert index.victim(SoftSpare(chain[1:])) == other  # (the block above a spared tail is passed over too)
    assert index.victim(SoftSpare([*chain, other])) == index.victim() == chain[2]
    index.pin([other])
    assert index.victim(SoftSpare(chain)) == chain[2]  # only spared and pinned blocks left: the leaf, as before
    index.pin(chain)
    assert index.victim(SoftSpare(chain)) is None  # (pins still hold)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_tier_with_no_room_but_a_soft_spare_evicts_it_rather_than_refuse(tmp_path, tier):
    """Where only the blocks a ``SoftSpare`` names are left to give up, a write evicts them
    (leaf first) as it would have without it, in a put and in a commit; with a plain spare
    a memory tier refuses it (``Spared``)."""
    chain = frames(7, 4)
    size = chain[0][1].nbytes
    budget = 2 * block_charge(size, allocation_unit(tmp_path)) if tier == "disk" else 2 * size
    t = DiskTier(tmp_path / "d", budget, fsync=False) if tier == "disk" else CpuTier(budget, reserve_bytes=size)
    store = TieredStore([t])
    try:
        assert all(r.stored for r in store.put_many(chain[2:]))  # the tail, as a first body
        if tier == "cpu":  # (a disk top tier is given no plain spare: ``_top_spare``)
            assert [r.stored for r in store.put_many(chain[1:2], spare=frozenset(k for k, _ in chain[2:]))] == [False]
        soft = SoftSpare(k for k, _ in chain[2:])
        assert all(r.stored for r in store.put_many(chain[:2], spare=soft))
        assert t.contains(chain[0][0]) and t.contains(chain[1][0]) and not t.contains(chain[3][0])
        assert t.stats().write_errors == 0
        if tier == "cpu":  # a frame received in place, committed
            (key, frame), = frames(8, 1)
            reservation = store.reserve(size)
            assert reservation is not None
            reservation.view()[:] = frame.host
            assert store.commit_many([(key, reservation, frame.meta)], spare=SoftSpare([chain[0][0], chain[1][0]]))[0].stored
            assert t.contains(key) and t.contains(chain[0][0]) and not t.contains(chain[1][0])
    finally:
        store.close()


class IndexMachine(RuleBasedStateMachine):
    """An eviction index driven as a tier drives it (budgeted adds that evict leaf victims,
    touches, deletes, pins of whole chains through a ``PinTable``), checked after every step
    against a plain model: byte totals, pins, leaf-only unpinned victims, and for ARC its four
    lists (disjoint, sized, no ghost of a stored block, within ARC's bounds)."""

    policy = ""
    CAPACITY = 100
    # A forest of 12 blocks: 0-3 are heads, block i > 3 is a child of block i - 4.
    KEYS = [bytes([i]) * 16 for i in range(12)]

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index(self.policy, self.CAPACITY)
        self.held: dict[bytes, int] = {}
        self.pins = PinTable(lambda: 0.0)

    def _chain(self, i: int) -> list[bytes]:
        return [self.KEYS[j] for j in range(i % 4, i + 1, 4)]

    def _evict(self) -> None:
        victim = self.index.victim()
        assert victim in self.held and not self.index.is_pinned(victim)
        assert not self.index.children(victim), "a victim with children stored"
        self.index.remove(victim, evicted=True)
        del self.held[victim]

    @rule(i=st.integers(0, 11))
    def add(self, i):
        key, nbytes = self.KEYS[i], 5 + 3 * i  # a block's size never changes (its hash names its bytes)
        if key not in self.held:
            while self.index.used_bytes + nbytes > self.CAPACITY and self.index.evictable:
                self._evict()
        parent = self.KEYS[i - 4] if i >= 4 else bytes(16)
        self.index.add(key, BlockInfo(nbytes, 2 * nbytes, parent, i // 4))
        self.held[key] = nbytes

    @rule()
    def evict(self):
        if self.index.victim() is None:
            assert self.index.evictable == 0
        else:
            self._evict()

    @rule(mask=st.integers(0, (1 << 12) - 1))
    def victim_sparing(self, mask):
        """A victim that spares any set of blocks: an unpinned leaf outside it, none only where
        there is no such leaf, the policy's own victim where the set holds none of the blocks,
        and the index unchanged."""
        index = self.index
        spare = frozenset(k for i, k in enumerate(self.KEYS) if mask >> i & 1)
        order = index.keep_order()
        victim = index.victim(spare)
        leaves = {k for k in self.held if not index.is_pinned(k) and k not in spare and not index.children(k)}
        assert victim in leaves if leaves else victim is None
        if not spare & set(self.held):
            assert victim == index.victim()
        assert index.keep_order() == order

    @rule(i=st.integers(0, 11))
    def delete(self, i):
        self.index.remove(self.KEYS[i])
        self.held.pop(self.KEYS[i], None)

    @rule(i=st.integers(0, 11))
    def touch_chain(self, i):
        self.index.touch(reversed(self._chain(i)))

    @rule(i=st.integers(0, 11))
    def pin(self, i):
        self.index.pin(self.pins.add(self._chain(i))[1])

    @rule(i=st.integers(0, 11))
    def unpin(self, i):
        self.index.unpin(self.pins.remove(self.KEYS[i])[1])

    @invariant()
    def matches_the_model(self):
        index = self.index
        assert sorted(index.keys()) == sorted(self.held)
        assert index.used_bytes == sum(self.held.values()) and index.raw_bytes == 2 * index.used_bytes
        pinned = {k for k in self.held if self.pins.covered(k)}
        assert {k for k in self.held if index.is_pinned(k)} == pinned
        assert (index.pinned_blocks, index.pinned_bytes) == (len(pinned), sum(self.held[k] for k in pinned))
        for kids in index._kids.values():
            assert set(kids) <= set(self.held)
        if isinstance(index, LruIndex):
            assert set(index._order) == set(self.held) - pinned
            return
        t1, t2, b1, b2 = index._t1, index._t2, index._b1, index._b2
        assert not set(t1) & set(t2) and set(t1) | set(t2) == set(self.held) - pinned
        assert not (set(b1) | set(b2)) & set(self.held), "a ghost of a stored block"
        for lst, total in ((t1, index._t1_bytes), (t2, index._t2_bytes), (b1, index._b1_bytes), (b2, index._b2_bytes)):
            assert sum(lst.values()) == total
        assert all(n == self.held[k] for lst in (t1, t2) for k, n in lst.items())
        c = self.CAPACITY
        assert 0 <= index.p <= c
        assert not b1 or index._t1_bytes + index._b1_bytes <= c
        assert not b2 or index._t1_bytes + index._t2_bytes + index._b1_bytes + index._b2_bytes <= 2 * c


class ArcMachine(IndexMachine):
    policy = "arc"


class LruMachine(IndexMachine):
    policy = "lru"


TestArcIndexMachine = ArcMachine.TestCase
TestLruIndexMachine = LruMachine.TestCase
TestArcIndexMachine.settings = TestLruIndexMachine.settings = settings(max_examples=200, stateful_step_count=50,
                                                                      deadline=None)


def test_a_pinned_chain_outlives_pressure_in_every_tier_and_comes_back_after_unpin(tmp_path):
    cpu = CpuTier(4 * FRAME)
    store = TieredStore([cpu, DiskTier(tmp_path / "d", 6 * DISK_FRAME, fsync=False)], write_through=["disk"])
    pinned = frames(1, 3)
    store.put_many(pinned)
    pin = store.pin(pinned[-1][0], ttl_seconds=None)
    assert pin is not None and pin.keys == tuple(k for k, _ in pinned)
    for seed in range(2, 8):  # 12 more blocks: far over both budgets
        store.put_many(frames(seed, 2))
    assert all(stored(store, pin.keys))
    for tier in store.tiers:
        assert set(pin.keys) <= set(tier.keys()), tier.name
        assert tier.stats().pinned_blocks == 3
    stats = {t["name"]: t for t in store.stats()["tiers"]}
    assert stats["cpu"]["pinned_bytes"] == 3 * FRAME and stats["cpu"]["used_bytes"] <= cpu.capacity_bytes
    assert store.unpin(pin.key) is not None and store.unpin(pin.key) is None
    for seed in range(8, 14):
        store.put_many(frames(seed, 2))
    assert not any(stored(store, pin.keys))  # given back to eviction: gone under pressure


def test_a_chain_evicted_in_part_while_it_is_pinned_is_not_pinned(tmp_path):
    """A put on another thread evicts a link of the chain between the pin's walk of it and
    the tiers taking the pin: the pin was granted all the same (the docs: None, a 404 at
    the server, when the chain is not stored whole), and held the blocks past the gap out
    of eviction, unreachable. Now it is refused, and nothing of it stays pinned."""
    store = TieredStore([CpuTier(8 * FRAME), DiskTier(tmp_path / "d", 8 * DISK_FRAME, fsync=False)])
    chain = frames(1, 4)
    store.put_many(chain)
    keys = [k for k, _ in chain]
    add = store.pin_table.add

    def add_as_a_block_is_evicted(*args, **kw):
        out = add(*args, **kw)
        for tier in store.tiers:  # (the put's eviction, in every tier holding it)
            tier.delete(keys[1])
        return out

    store.pin_table.add = add_as_a_block_is_evicted
    assert store.pin(keys[-1], ttl_seconds=None) is None
    store.pin_table.add = add
    assert store.pins() == [] and all(t.stats().pinned_blocks == 0 for t in store.tiers)
    for seed in range(2, 14):  # pressure: the blocks past the gap are evictable again
        store.put_many(frames(seed, 2))
    assert not any(stored(store, [keys[0], *keys[2:]]))


def test_a_tier_full_of_pinned_blocks_refuses_writes_clearly():
    store = TieredStore([CpuTier(3 * FRAME)])
    chain = frames(1, 3)
    store.put_many(chain)
    store.pin(chain[-1][0])
    before = store.stats()
    outcome = store.put_many(frames(2, 1))[0]  # returns (no loop), stores nothing
    assert not outcome.stored and "pinned" in outcome.errors["cpu"]
    after = store.stats()
    assert after["blocks"] == before["blocks"] == 3 and after["tiers"][0]["write_errors"] == 1
    # The in-place path (reservations, as the server receives frames) refuses the same way.
    key, frame = frames(3, 1)[0]
    res = store.reserve(frame.nbytes)
    if res is not None:
        res.view()[:] = frame.host
        outcome = store.commit(key, res, frame.meta)
        assert not outcome.stored and "pinned" in outcome.errors["cpu"]
        assert store.stats()["tiers"][0]["reservation_bytes"] == 0
    with pytest.raises(StorageError, match="pinned"):
        store.tiers[0].put(*frames(4, 1)[0])


@pytest.mark.parametrize("group", [False, True], ids=["put", "group-commit"])
def test_disk_blocks_pinned_before_they_arrive_never_fill_it_past_its_budget(tmp_path, monkeypatch, group):
    # A pinned block's write is in flight in another thread when more pinned blocks arrive:
    # together they must fit, since none of them can be evicted once written.
    disk = DiskTier(tmp_path / "d", 3 * DISK_FRAME + 10, fsync=False)
    chain = frames(5, 4)
    disk._index.pin([k for k, _ in chain])  # as a pin of the chain's head does, before it arrives
    writing, release = threading.Event(), threading.Event()
    real = disk._write_atomic

    def slow(path, segments):
        if path.name.startswith(chain[0][0].hex()):
            writing.set()
            release.wait(10)
        real(path, segments)

    monkeypatch.setattr(disk, "_write_atomic", slow)
    first = threading.Thread(target=disk.put, args=chain[0])
    first.start()
    try:
        assert writing.wait(10)
        error = _the_rest_of_the_chain_but_its_last_fits(disk, chain, group)
        assert not group or "pinned" in error
    finally:
        release.set()
        first.join()
    _three_blocks_and_nothing_in_flight(disk)


def _the_rest_of_the_chain_but_its_last_fits(disk, chain, group) -> str:
    """``chain[1:]`` put (one by one, or as a group) while ``chain[0]``'s pinned write is in
    flight: two fit, the last is refused for the pinned bytes on their way; its error."""
    if group:
        outcomes = disk.put_many(chain[1:])
        assert [o.error is None for o in outcomes] == [True, True, False]
        error = str(outcomes[2].error)
    else:
        for key, frame in chain[1:3]:
            assert disk.put(key, frame).error is None
        with pytest.raises(StorageError) as refused:
            disk.put(*chain[3])
        error = str(refused.value)
    assert "on their way" in error
    return error


def _three_blocks_and_nothing_in_flight(disk) -> None:
    s = disk.stats()
    assert s.used_bytes <= disk.capacity_bytes and s.blocks == 3
    assert disk._reserved == disk._reserved_pinned == 0


def _hold_disk_writes(disk, monkeypatch, keys):
    """Writes of ``keys`` wait (in their thread) until the returned ``release`` is set;
    ``started[key]`` is set once a write of it has begun. Single puts and group commits."""
    held = {k.hex(): k for k in keys}
    started = {k: threading.Event() for k in keys}
    release = threading.Event()

    def hold(path):
        key = held.get(path.name.split(".")[0])
        if key is not None:
            started[key].set()
            release.wait(10)

    atomic, temp = disk._write_atomic, disk._write_temp
    monkeypatch.setattr(disk, "_write_atomic", lambda path, segments: (hold(path), atomic(path, segments))[1])
    monkeypatch.setattr(disk, "_write_temp", lambda final, segments, sync=True: (hold(final), temp(final, segments,
                                                                                                 sync=sync))[1])
    return started, release


@pytest.mark.parametrize("group", [False, True], ids=["put", "group-commit"])
def test_disk_blocks_pinned_while_they_are_written_count_as_pinned_in_flight(tmp_path, monkeypatch, group):
    # The pin comes after the first block's write began (not before it arrived): its bytes
    # count as pinned in flight all the same, and the fourth pinned block is refused.
    disk = DiskTier(tmp_path / "d", 3 * DISK_FRAME + 10, fsync=False)
    chain = frames(8, 4)
    started, release = _hold_disk_writes(disk, monkeypatch, [chain[0][0]])
    first = threading.Thread(target=disk.put, args=chain[0])
    first.start()
    try:
        assert started[chain[0][0]].wait(10)
        disk.pin([k for k, _ in chain])
        assert disk._reserved_pinned == DISK_FRAME
        _the_rest_of_the_chain_but_its_last_fits(disk, chain, group)
    finally:
        release.set()
        first.join()
    _three_blocks_and_nothing_in_flight(disk)
    # and an unpin while a write is in flight takes its bytes out of the count again
    started, release = _hold_disk_writes(disk, monkeypatch, [chain[3][0]])
    disk.unpin([k for k, _ in chain[:1]])
    late = threading.Thread(target=disk.put, args=chain[3])
    late.start()
    try:
        assert started[chain[3][0]].wait(10)
        assert disk._reserved_pinned == DISK_FRAME  # pinned since before it arrived
        disk.unpin([chain[3][0]])
        assert disk._reserved_pinned == 0
    finally:
        release.set()
        late.join()


@pytest.mark.parametrize("group", [False, True], ids=["put", "group-commit"])
def test_disk_refuses_at_commit_a_block_pinned_in_flight_that_no_longer_fits(tmp_path, monkeypatch, group):
    # Unpinned writes in flight may overshoot the budget together (the last one indexed
    # trims it). Pinned while in flight, they could not be trimmed: the write that would
    # leave the pinned blocks over the budget is refused at its commit, its files removed.
    disk = DiskTier(tmp_path / "d", 3 * DISK_FRAME + 10, fsync=False)
    d, e, h, g = frames(9, 4)
    started, release = _hold_disk_writes(disk, monkeypatch, [d[0], e[0], h[0]])
    outcomes = {}
    threads = [threading.Thread(target=lambda: outcomes.__setitem__("d", disk.put_many([d])))]
    if group:
        threads.append(threading.Thread(target=lambda: outcomes.__setitem__("eh", disk.put_many([e, h]))))
    else:
        threads += [threading.Thread(target=lambda: outcomes.__setitem__("e", disk.put_many([e]))),
                    threading.Thread(target=lambda: outcomes.__setitem__("h", disk.put_many([h])))]
    for t in threads:
        t.start()
    try:
        for key in (d[0], e[0]) if group else (d[0], e[0], h[0]):  # (a group writes its files in turn)
            assert started[key].wait(10)
        assert disk.put(*g).error is None  # 3 in flight + 1: over the budget, nothing to evict yet
        disk.pin([d[0], e[0], h[0], g[0]])
    finally:
        release.set()
        for t in threads:
            t.join()
    errors = [o.error for got in outcomes.values() for o in got]
    assert sum(err is not None for err in errors) == 1
    assert "pinned" in str(next(err for err in errors if err is not None))
    s = disk.stats()
    assert s.used_bytes <= disk.capacity_bytes and s.blocks == 3 and s.write_errors == 1
    assert disk._reserved == disk._reserved_pinned == 0 and not disk._writing
    kept = set(disk.keys())
    on_disk = {p.name.split(".")[0] for p in (tmp_path / "d").rglob("*") if p.is_file() and not p.name.startswith(".")}
    assert {k.hex() for k in kept} <= on_disk and len({p for p in on_disk if len(p) == 32}) == 3


@pytest.mark.parametrize("group", [False, True], ids=["put", "group-commit"])
def test_disk_syncs_the_shard_after_removing_a_write_refused_at_commit(tmp_path, monkeypatch, group):
    # A write refused at its commit has renamed its files into place (and fsynced its shard):
    # their removal is made durable as a delete's is, else a power cut brings them back.
    from cacheseek.store import disk as disk_mod

    a, b, x, y = frames(11, 4)
    batch = [x, y] if group else [x]
    disk = DiskTier(tmp_path / "d", (len(batch) + 1) * DISK_FRAME + 10)
    disk.put(*a)
    disk.pin([a[0]])
    shard_of = {k: disk._paths(k)[0].parent for k, _ in batch}
    seen: list[tuple[bytes, bool]] = []  # (key, its files there) at each fsync of its shard
    real = disk_mod.fsync_dir

    def spy(path):
        real(path)
        for k, _ in batch:
            if path == shard_of[k]:
                seen.append((k, any(p.exists() for p in disk._paths(k))))

    monkeypatch.setattr(disk_mod, "fsync_dir", spy)
    started, release = _hold_disk_writes(disk, monkeypatch, [x[0]])
    outcome = {}
    writer = threading.Thread(target=lambda: outcome.__setitem__("r", disk.put_many(batch)))
    writer.start()
    try:
        assert started[x[0]].wait(10)
        disk.pin([b[0]])
        assert disk.put(*b).error is None  # pinned, beside the writes in flight: over the budget
        disk.pin([k for k, _ in batch])
    finally:
        release.set()
        writer.join(10)
    refused = [k for (k, _), r in zip(batch, outcome["r"]) if r.error is not None]
    assert len(refused) == 1 and "pinned" in str(outcome["r"][[k for k, _ in batch].index(refused[0])].error)
    key = refused[0]
    assert not any(p.exists() for p in disk._paths(key))
    events = [there for k, there in seen if k == key]
    synced = events.index(True) if any(events) else None
    assert synced is not None, events  # its commit synced the renames
    assert not all(events[synced:]), events  # and the removal after them


@pytest.mark.parametrize("kind", ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU tier needs CUDA")), "disk"])
def test_a_frame_that_cannot_fit_beside_the_pins_evicts_nothing(tmp_path, kind):
    # Two pinned blocks and one evictable in room for three: a frame twice their size can
    # never fit beside the pins, so it is refused before the evictable block is given up.
    from cacheseek.store.gpu import GpuTier

    tier = {"cpu": lambda: CpuTier(3 * FRAME + 10), "gpu": lambda: GpuTier(3 * FRAME + 10),
            "disk": lambda: DiskTier(tmp_path / "d", 3 * DISK_FRAME + 10, fsync=False)}[kind]()
    chain = frames(6, 3)
    tier.put_many(chain)
    tier.pin([k for k, _ in chain[:2]])
    h, data = raw_frame(7, block=2 * BLOCK)
    big = (h, BlockFrame(parse_frame(bytearray(data)), host=memoryview(bytearray(data))))
    assert FRAME + 10 < big[1].nbytes <= 3 * FRAME  # more than the room beside the pins
    outcome = tier.put_many([big])[0]
    assert outcome.stored is None and "pinned" in str(outcome.error) and not outcome.evicted
    with pytest.raises(StorageError, match="pinned"):
        tier.put(*big)
    assert sorted(tier.keys()) == sorted(k for k, _ in chain)  # the evictable block is still here
    assert tier.stats().evictions == 0


def test_a_pin_reaches_blocks_that_arrive_later_and_expires(tmp_path):
    clock = Clock()
    cpu = CpuTier(3 * FRAME)
    store = TieredStore([cpu, DiskTier(tmp_path / "d", 20 * DISK_FRAME, fsync=False)], write_through=["disk"], clock=clock)
    chain = frames(1, 2)
    store.put_many(chain)
    pin = store.pin(chain[-1][0], ttl_seconds=60)
    assert pin.expires_at == clock.now + 60
    for seed in range(2, 6):
        store.put_many(frames(seed, 2))
    assert set(pin.keys) <= set(cpu.keys())
    # Evicted from the CPU tier by force (a delete), then promoted back: pinned there at once.
    cpu.delete(chain[1][0])
    assert store.get(chain[1][0]) is not None and chain[1][0] in cpu.keys()
    assert cpu.stats().pinned_blocks == 2
    clock.now += 30
    again = store.pin(chain[-1][0], ttl_seconds=60)  # pinned again: a new expiry, the same blocks
    assert again.expires_at == clock.now + 60 and again.keys == pin.keys
    clock.now += 31
    store.put_many(frames(8, 1))
    assert len(store.pins()) == 1 and cpu.stats().pinned_blocks == 2  # the first expiry is gone
    clock.now += 30
    store.put_many(frames(9, 1))  # a write notices the expiry
    assert store.pins() == [] and cpu.stats().pinned_blocks == 0


def test_a_chain_pinned_again_while_its_expiry_unpins_it_stays_pinned_in_the_tiers():
    """The pin table and the tiers were updated apart: an expiry took a pin out of the table,
    a new pin of the chain went in and pinned it in the tiers, then the expiry's unpin reached
    the tiers: the table held a pin whose blocks every tier would evict."""
    clock = Clock()

    class Tier(CpuTier):
        during_unpin = None

        def unpin(self, keys):
            hook, self.during_unpin = self.during_unpin, None
            if hook is not None:
                hook()
            super().unpin(keys)

    cpu = Tier(10 * FRAME)
    store = TieredStore([cpu], clock=clock)
    chain = frames(1, 2)
    store.put_many(chain)
    store.pin(chain[-1][0], ttl_seconds=60)
    clock.now += 61  # expired, not noticed yet
    again = threading.Thread(target=store.pin, args=(chain[-1][0],))  # pinned again, for good

    def pin_meanwhile():
        again.start()
        again.join(timeout=0.5)  # (it waits for this expiry to be applied first, where pins are serialized)

    cpu.during_unpin = pin_meanwhile
    store.expire_pins()
    again.join()
    assert [p.expires_at for p in store.pins()] == [None]
    assert cpu.stats().pinned_blocks == 2
    for seed in range(2, 12):  # pressure: the pinned chain stays
        store.put_many(frames(seed, 2))
    assert all(stored(store, [k for k, _ in chain]))


def test_overlapping_pins_keep_their_shared_head(tmp_path):
    store = TieredStore([CpuTier(40 * FRAME)])
    head = frames(1, 2)
    store.put_many(head)
    branches = []
    for seed in (2, 3):  # two chains behind one head
        key, data = raw_frame(seed, position=2, parent=head[-1][0])
        buf = bytearray(data)
        branches.append((key, BlockFrame(parse_frame(buf), host=memoryview(buf))))
    store.put_many(branches)
    store.pin(branches[0][0])
    store.pin(branches[1][0])
    assert store.tiers[0].stats().pinned_blocks == 4
    store.unpin(branches[0][0])
    assert store.tiers[0].stats().pinned_blocks == 3  # the head stays pinned for the other
    assert store.pin(b"\x77" * 16) is None  # not stored: nothing to pin
    with pytest.raises(InputError, match="ttl_seconds"):
        store.pin(head[-1][0], ttl_seconds=-1)


def test_a_disk_tiers_compression_ratio_is_over_its_frames_bytes(tmp_path):
    """The ratio is the codec's (raw over encoded bytes), the same for the same blocks in
    every tier: over the disk tier's used_bytes (whole file-system blocks, sidecars too), it
    read a quarter lower there for 32 KiB frames."""
    store = TieredStore([CpuTier(4 * FRAME), DiskTier(tmp_path / "d", 20 * DISK_FRAME, fsync=False)],
                        write_through=["disk"])
    try:
        store.put_many(frames(1, 3))
        cpu, disk = store.stats()["tiers"]
        assert disk["compression_ratio"] == pytest.approx(disk["raw_bytes"] / disk["frame_bytes"])
        assert disk["compression_ratio"] == pytest.approx(cpu["compression_ratio"])
    finally:
        store.close()


def test_store_wide_figures_count_a_block_held_twice_once(tmp_path):
    store = TieredStore([CpuTier(4 * FRAME), DiskTier(tmp_path / "d", 20 * DISK_FRAME, fsync=False)],
                        write_through=["disk"])
    first = frames(1, 3)
    store.put_many(first)
    stats = store.stats()
    cpu, disk = stats["tiers"]
    assert cpu["used_bytes"] == disk["frame_bytes"] == 3 * FRAME and disk["used_bytes"] == 3 * DISK_FRAME
    assert stats["stored_bytes"] == 6 * FRAME and stats["used_bytes"] == 3 * FRAME and stats["blocks"] == 3
    assert (cpu["unique_blocks"], disk["unique_blocks"]) == (3, 0)
    store.put_many(frames(2, 3))  # 6 blocks, the CPU tier holds 4: 2 are on disk only
    stats = store.stats()
    cpu, disk = stats["tiers"]
    assert (cpu["unique_blocks"], disk["unique_blocks"], stats["blocks"]) == (4, 2, 6)
    assert stats["used_bytes"] == 6 * FRAME and stats["stored_bytes"] == 10 * FRAME
    assert cpu["admissions"] == 6 and disk["admissions"] == 6 and cpu["evictions"] == 2
    assert stats["compression_ratio"] == pytest.approx(stats["raw_bytes"] / stats["used_bytes"])
    for key, _ in first:
        store.delete(key)
    stats = store.stats()
    assert stats["blocks"] == 3 and stats["used_bytes"] == 3 * FRAME


def test_residency_listeners_see_each_block_enter_and_leave_once(tmp_path):
    store = TieredStore([CpuTier(3 * FRAME), DiskTier(tmp_path / "d", 20 * DISK_FRAME, fsync=False)],
                        write_through=["disk"])
    seen: list[tuple[str, bytes]] = []

    class Listener:
        def appeared(self, key, info):
            seen.append(("in", key))

        def gone(self, key, info):
            seen.append(("out", key))

    store.put_many(frames(1, 2))
    held = store.residency.listen(Listener())
    assert [info.position for _, info in held] == [0, 1]
    chain = frames(2, 3)
    store.put_many(chain)  # the CPU tier evicts, the disk keeps them: no block leaves the store
    assert seen == [("in", k) for k, _ in chain]
    store.delete(chain[0][0])
    assert seen[-1] == ("out", chain[0][0])


@needs_redis
def test_redis_pins_skip_eviction_and_the_ttl_and_refuse_writes_when_full(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        redis = RedisTier(srv.url, 3 * FRAME, ttl_seconds=30)
        store = TieredStore([CpuTier(2 * FRAME), redis], write_through=["redis"])
        chain = frames(1, 2)
        store.put_many(chain)
        pin = store.pin(chain[-1][0])
        assert pin is not None and redis.stats().pinned_blocks == 2
        for key, _ in chain:  # no expiry on a pinned frame, and none put back by a touch
            assert srv.cli("PTTL", redis.keys_of.frame(key)).strip() == "-1"
        store.touch_chain([k for k, _ in chain])
        assert srv.cli("PTTL", redis.keys_of.frame(chain[0][0])).strip() == "-1"
        for seed in range(2, 6):
            store.put_many(frames(seed, 1))
        assert set(pin.keys) <= set(redis.keys())
        stats = redis.stats()
        assert stats.pinned_bytes == 2 * FRAME and stats.used_bytes <= redis.capacity_bytes
        # One unpinned block fits beside the two pinned ones; a batch of two cannot both stay.
        outcome = redis.put_many([frames(7, 1)[0]])[0]
        assert outcome.error is None
        store.unpin(pin.key)
        assert redis.stats().pinned_blocks == 0
        assert int(srv.cli("PTTL", redis.keys_of.frame(chain[0][0])).strip()) > 0
        # A tier full of pins refuses clearly.
        full = frames(8, 3)
        store.put_many(full)
        store.pin(full[-1][0])
        err = redis.put_many([frames(9, 1)[0]])[0].error
        assert err is not None and "pinned" in str(err)
        assert redis.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        srv.stop()


@needs_redis
def test_a_pin_or_unpin_redis_misses_is_sent_again_and_never_leaks(tmp_path):
    """A pin whose Redis step failed is undone everywhere (pinning again sends it); an unpin
    that could not reach Redis is owed, and sent by the next call that can: left there, such
    pins held the shared budget for good, and every process's writes were refused."""
    from cacheseek.store.breaker import CircuitBreaker, ConstantBackoff
    from cacheseek.store.redis_client import RedisTimeouts

    srv = RedisServer(tmp_path / "redis").start()
    try:
        redis = RedisTier(srv.url, 2 * FRAME, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3),
                          breaker=CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(0.2)))
        store = TieredStore([CpuTier(8 * FRAME), redis], write_through=["redis"])
        (x, fx), (y, fy) = frames(10, 1)[0], frames(11, 1)[0]
        store.put(x, fx)
        srv.pause()
        try:
            with pytest.raises(StorageError):
                store.pin(x)
        finally:
            srv.resume()
        assert store.pins() == [] and not store.tier("cpu")._index.is_pinned(x)  # undone everywhere
        time.sleep(0.3)  # (the breaker's backoff)
        # A Redis pin that fails after its index step (the frame's PERSIST, with a TTL) is
        # undone in Redis too.
        redis.ttl_seconds, redis._ttl_ms = 60, 60_000
        real = redis._pipelined

        def persist_fails(client, command, names, **kw):
            if command == "persist":
                raise ConnectionError("injected: the PERSIST did not get through")
            return real(client, command, names, **kw)
        redis._pipelined = persist_fails
        with pytest.raises(StorageError):
            store.pin(x)
        del redis._pipelined
        redis.ttl_seconds, redis._ttl_ms = None, None
        time.sleep(0.3)
        assert store.pins() == [] and redis.stats().pinned_blocks == 0
        assert store.pin(x) is not None and redis.stats().pinned_blocks == 1  # sent, this time
        store.put(y, fy)
        store.pin(y)
        srv.pause()
        try:
            store.unpin(x)
            store.unpin(y)
        finally:
            srv.resume()
        assert store.pins() == [] and redis.stats().extra["owed_unpins"] == 2
        time.sleep(0.3)
        stats = redis.stats()  # the first call through pays what is owed
        assert stats.pinned_blocks == 0 and stats.extra["owed_unpins"] == 0
        others = RedisTier(srv.url, 2 * FRAME)  # another process's writes find room
        assert all(r.error is None for r in others.put_many(frames(12, 2)))
    finally:
        srv.stop()


@needs_redis
def test_a_pin_or_a_whole_delete_that_cannot_ask_redis_says_so_and_changes_nothing(tmp_path):
    """With Redis killed, a pin of a chain only Redis held answered None, "not stored whole"
    (the walk took the outage for missing links), which a server turned into a 404: it
    raises ``TierUnavailable``, as a pin of a chain the CPU tier holds does (its Redis pin
    fails). A delete with ``all_or_nothing`` that cannot ask Redis deletes from no tier, so
    that a caller finding blocks in the local indexes finds them again when it retries."""
    from cacheseek.errors import TierUnavailable
    from cacheseek.store.breaker import CircuitBreaker, ConstantBackoff
    from cacheseek.store.redis_client import RedisTimeouts

    srv = RedisServer(tmp_path / "redis").start()
    try:
        redis = RedisTier(srv.url, 16 * FRAME, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3),
                          breaker=CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(0.2)))
        store = TieredStore([CpuTier(8 * FRAME), redis], write_through=["redis"])
        local, remote = frames(20, 2), frames(21, 2)
        for key, frame in local + remote:
            assert store.put(key, frame).stored
        for key, _ in remote:  # (only Redis holds this chain now)
            store.tier("cpu").delete(key)
        srv.kill()
        for chain in (remote, local):
            with pytest.raises(TierUnavailable):
                store.pin(chain[-1][0])
        assert store.pins() == [] and not any(store.tier("cpu")._index.is_pinned(k) for k, _ in local)
        assert store.delete(local[-1][0], all_or_nothing=True) is None
        assert store.tier("cpu").contains_many([k for k, _ in local]) == [True, True]  # kept, for the retry
        srv.start()  # (empty: no persistence)
        while redis.breaker.stats().retry_in_seconds > 0:  # (its backoff: then a probe goes through)
            time.sleep(0.02)
        assert store.delete(local[-1][0], all_or_nothing=True) is True
        assert store.contains_many([local[-1][0]]) == [False]
        assert store.pin(remote[-1][0]) is None  # gone with Redis's restart: now truly not stored
    finally:
        srv.stop()


@needs_redis
def test_an_unpin_owed_through_an_outage_is_sent_by_the_lease_keeper(tmp_path):
    """An unpin that could not reach Redis is owed; only a put or ``stats()`` sent it. A
    process that went on pinning other blocks but only read (an embedded cache serving
    hits) renewed its lease every fifth of it, and so kept the unpinned blocks pinned in
    Redis, out of every process's LRU, for as long as it lived. The keeper sends it."""
    from cacheseek.store.breaker import CircuitBreaker, ConstantBackoff
    from cacheseek.store.redis_client import RedisTimeouts

    srv = RedisServer(tmp_path / "redis").start()
    try:
        redis = RedisTier(srv.url, 16 * FRAME, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3),
                          breaker=CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(0.1)),
                          pin_lease_seconds=1.0)  # (renewed every 0.2 s)
        store = TieredStore([CpuTier(8 * FRAME), redis], write_through=["redis"])
        (x, fx), (y, fy) = frames(22, 1)[0], frames(23, 1)[0]
        for key, frame in ((x, fx), (y, fy)):
            store.put(key, frame)
            store.pin(key)
        srv.pause()
        try:
            assert redis.contains_many([x]) == [False]  # (timed out: the breaker opens, so the unpin is not sent)
            store.unpin(x)
        finally:
            srv.resume()
        assert redis._owed_unpins == {x}
        pinned = "{cacheseek:default}:pinned"
        deadline = time.monotonic() + 5
        while srv.cli("SISMEMBER", pinned, x.hex()).strip() != "0" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.cli("SISMEMBER", pinned, x.hex()).strip() == "0"  # no put, no stats() meanwhile
        assert srv.cli("SISMEMBER", pinned, y.hex()).strip() == "1" and not redis._owed_unpins
    finally:
        srv.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA (scripts/h200.sh pins-gpu)")
def test_a_gpu_tier_keeps_pinned_chains_and_refuses_when_full_of_them():
    from cacheseek.store.gpu import GpuTier

    store = TieredStore([GpuTier(3 * FRAME)])
    keep = frames(1, 2)
    store.put_many(keep)
    store.pin(keep[-1][0])
    for seed in range(2, 6):
        store.put_many(frames(seed, 1))
    assert all(stored(store, [k for k, _ in keep]))
    store.pin(store.tiers[0].keys()[-1])  # the one unpinned block left: now every block is pinned
    outcome = store.put_many(frames(9, 1))[0]
    assert not outcome.stored and "pinned" in outcome.errors["gpu"]


def _pttl(srv: RedisServer, redis: RedisTier, key: bytes) -> int:
    return int(srv.cli("PTTL", redis.keys_of.frame(key)).strip())


@needs_redis
@pytest.mark.parametrize("how", ["unpin", "expiry"])
def test_redis_keeps_a_block_pinned_while_any_replica_pins_it(tmp_path, how):
    """Two replicas over one Redis namespace, each with its own CPU tier and pin table, pin
    chains that share a head. Redis's pinned set kept no count per replica: the first unpin
    (or expiry) of either took the shared blocks out, so Redis's LRU evicted (and its TTL
    expired) blocks the other replica still pinned. Now they stay until the last pin goes."""
    srv = RedisServer(tmp_path / "redis").start()
    try:
        clock = Clock()
        ra, rb = RedisTier(srv.url, 4 * FRAME, ttl_seconds=30), RedisTier(srv.url, 4 * FRAME, ttl_seconds=30)
        a = TieredStore([CpuTier(8 * FRAME), ra], write_through=["redis"], clock=clock)
        b = TieredStore([CpuTier(8 * FRAME), rb], write_through=["redis"])
        chain = frames(1, 3)
        a.put_many(chain)
        keys = [k for k, _ in chain]
        assert a.pin(keys[-1], ttl_seconds=60) is not None
        shared = b.pin(keys[1])  # the first two blocks, through the other replica
        assert shared is not None and rb.stats().pinned_blocks == 3
        if how == "unpin":
            a.unpin(keys[-1])
        else:
            clock.now += 61
            a.expire_pins()
        assert a.pins() == [] and rb.stats().pinned_blocks == 2 and ra.stats().pinned_blocks == 2
        assert [_pttl(srv, rb, k) for k in keys[:2]] == [-1, -1]  # no expiry while b pins them
        assert _pttl(srv, rb, keys[2]) > 0  # a's own tail expires again
        for seed in range(2, 8):  # Redis fills: its LRU evicts around b's pin
            a.put_many(frames(seed, 1))
        assert rb.contains_many(keys[:2]) == [True, True]
        assert rb.stats().used_bytes <= rb.capacity_bytes
        b.unpin(keys[1])
        assert rb.stats().pinned_blocks == 0 and _pttl(srv, rb, keys[0]) > 0
        for seed in range(8, 14):
            a.put_many(frames(seed, 1))
        assert rb.contains_many(keys[:2]) == [False, False]  # evictable again
    finally:
        srv.stop()


@needs_redis
def test_a_replica_gone_without_unpinning_leaves_its_redis_pins_one_lease_later(tmp_path):
    """A replica's pins are its own, under a lease it renews while it lives: one that dies
    (or is cut off from Redis) without unpinning does not keep its pins for good, while the
    pins of a replica that lives on outlast many leases, and a lapsed lease is taken again."""
    srv = RedisServer(tmp_path / "redis").start()
    try:
        ra = RedisTier(srv.url, 4 * FRAME, ttl_seconds=30, pin_lease_seconds=0.5)
        rb = RedisTier(srv.url, 4 * FRAME, ttl_seconds=30, pin_lease_seconds=0.5)
        a = TieredStore([CpuTier(8 * FRAME), ra], write_through=["redis"])
        b = TieredStore([CpuTier(8 * FRAME), rb], write_through=["redis"])
        chain = frames(1, 3)
        a.put_many(chain)
        keys = [k for k, _ in chain]
        a.pin(keys[-1])
        b.pin(keys[0])
        time.sleep(1.5)  # three leases: both renew theirs
        assert rb.stats().pinned_blocks == 3
        ra.close()  # gone: no unpin, no more renewals
        time.sleep(0.8)
        assert rb.stats().pinned_blocks == 1  # a's pins lapsed; b's (the head) holds
        assert _pttl(srv, rb, keys[0]) == -1 and _pttl(srv, rb, keys[2]) > 0
        assert a.pins() != []  # (a's own table keeps its pin: a restart makes it again)
        # A replica whose lease lapsed while it lived (cut off from Redis) pins again.
        rb._lease_stop.set()  # (its renewals held up)
        time.sleep(0.8)
        RedisTier(srv.url, 4 * FRAME).stats()  # another process's call drops the lapsed lease
        assert rb._connection().scard(rb.keys_of.pinned) == 0
        assert rb.stats().pinned_blocks == 1 and _pttl(srv, rb, keys[0]) == -1  # its next call
        b.unpin(keys[0])
        assert rb.stats().pinned_blocks == 0
        r = rb._connection()
        assert r.exists(rb.keys_of.pinners, rb.keys_of.owner_pins(rb.owner), rb.keys_of.pinned) == 0
    finally:
        srv.stop()


@needs_redis
def test_an_index_pinned_before_pins_had_owners_is_taken_over_not_misread(tmp_path):
    """An index an older version wrote has a plain pinned set: its pins stay pinned (counted,
    out of the LRU) for one lease, owned by none of the processes, unless one pins them again."""
    srv = RedisServer(tmp_path / "redis").start()
    try:
        old = RedisTier(srv.url, 4 * FRAME, ttl_seconds=30)
        chain = frames(1, 2)
        old.put_many(chain)
        keys = [k for k, _ in chain]
        old.pin(keys)
        old.close()
        # What the older version left: the pinned set and its totals, no owners, no marker.
        r = old._connection()
        r.delete(old.keys_of.pinners, old.keys_of.owner_pins(old.owner))
        r.hdel(old.keys_of.totals, "pin_owners")
        new = RedisTier(srv.url, 4 * FRAME, ttl_seconds=30, pin_lease_seconds=0.5)
        store = TieredStore([CpuTier(8 * FRAME), new], write_through=["redis"])
        assert new.stats().pinned_blocks == 2
        assert sorted(r.smembers(new.keys_of.owner_pins("legacy"))) == sorted(k.hex().encode() for k in keys)
        store.pin(keys[0])  # this process pins the head again, under its own lease
        for seed in range(2, 8):  # the legacy pins are not evicted meanwhile
            new.put_many(frames(seed, 1))
        assert new.contains_many(keys) == [True, True]
        time.sleep(0.8)  # the legacy lease runs out: the head stays pinned, the tail goes back
        assert new.stats().pinned_blocks == 1
        assert _pttl(srv, new, keys[0]) == -1 and _pttl(srv, new, keys[1]) > 0
    finally:
        srv.stop()


def test_a_pin_takes_one_expiry_and_a_finite_one():
    """Given both, ``expires_at`` won without a word; and it was never checked: a NaN expiry
    never came due (and made ``next_expiry`` depend on the pins' order)."""
    table = PinTable(lambda: 100.0)
    for kw, said in ((dict(ttl_seconds=10, expires_at=200.0), "^pin: ttl_seconds or expires_at, not both$"),
                     (dict(expires_at=float("nan")), "^expires_at: must be a time in seconds since the epoch"),
                     (dict(expires_at=True), "^expires_at: "), (dict(expires_at="soon"), "^expires_at: ")):
        with pytest.raises(InputError, match=said):
            table.add([b"k" * 16], **kw)
    assert table.pins() == []
    pin, newly = table.add([b"k" * 16], expires_at=150)
    assert pin.expires_at == 150 and newly == [b"k" * 16] and table.next_expiry == 150


def test_a_pin_made_again_keeps_the_time_it_was_made_and_refuses_one_that_is_no_time():
    """A pin made again from a server's pins file takes the time it was first made
    (``pinned_at``); without one it was stamped now, and every restart reset it."""
    table = PinTable(lambda: 100.0)
    for bad in (float("nan"), float("inf"), True, "yesterday"):
        with pytest.raises(InputError, match="^pinned_at: must be a time in seconds since the epoch"):
            table.add([b"k" * 16], pinned_at=bad)
    assert table.pins() == []
    assert table.add([b"k" * 16], expires_at=150, pinned_at=40.0)[0].pinned_at == 40.0
    assert table.add([b"j" * 16])[0].pinned_at == 100.0
    assert table.add([b"k" * 16])[0].pinned_at == 100.0  # pinned again by an operator: since now


class _NoWalk(dict):
    """A pin table's dict of pins that refuses to be walked."""

    def values(self):
        raise AssertionError("walked every pin")

    items = keys = __iter__ = values


def test_pins_expire_in_order_of_their_expiries_and_an_unpinned_one_never_comes_back():
    """The next expiry was found by a scan of every pin on each pin and unpin (~5 us per live
    pin per call at thousands of pins); it is kept in a heap now, whose entries for pins
    unpinned or pinned again since are stale. Against a model: each step of the clock
    expires exactly the pins due, a pin unpinned or pinned again with a later expiry is not
    expired by its old entry, and the heap stays within about twice the pins."""
    import random

    rng = random.Random(7)
    now = [0.0]
    table = PinTable(lambda: now[0])
    model: dict[bytes, float | None] = {}  # pin -> its expiry
    keys = [i.to_bytes(16, "big") for i in range(300)]
    for step in range(3000):
        key = rng.choice(keys)
        what = rng.random()
        if what < 0.55:
            expires = None if rng.random() < 0.2 else now[0] + rng.choice([1, 2, 3, 5, 8, 13, 40, 100])
            table.add([b"head" * 4, key], expires_at=expires)
            model[key] = expires
        elif what < 0.8:
            pin, _ = table.remove(key)
            assert (pin is not None) == (key in model)
            model.pop(key, None)
        else:
            now[0] += rng.choice([0.5, 1, 3])
            due = {k for k, e in model.items() if e is not None and e <= now[0]}
            freed = table.expire()
            for k in due:
                del model[k]
            assert {k for k in freed if k != b"head" * 4} == due
            assert (b"head" * 4 in freed) == (bool(due) and not model)
        assert {p.key: p.expires_at for p in table.pins()} == model
        live = [e for e in model.values() if e is not None]
        assert table.next_expiry == (min(live) if live else None)
        assert table.due() == (bool(live) and now[0] >= min(live))
        assert len(table._expiries) <= 2 * len(model) + 17
    table._pins = _NoWalk(table._pins)  # (a pin, an unpin and an expiry walk none of the others)
    for key in (b"x" * 16, b"y" * 16):
        table.add([b"head" * 4, key], ttl_seconds=1)
    table.remove(b"x" * 16)
    now[0] += 1000
    assert b"y" * 16 in table.expire() and table.get(b"x" * 16) is None and table.get(b"y" * 16) is None
