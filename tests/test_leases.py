"""Memory lifetimes: leases on CPU-tier slots and pooled buffers (``store.lease``).

A slot is never reused while leased; a lease is released exactly once; it is released on
every error path (a decode error, an exception in a ``with`` block, a client that goes
away in the middle of a streamed response from a real server); the counts are in stats."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

import cacheseek as cs
from cacheseek.store.arena import HostArena
from cacheseek.store.cpu import CpuTier
from cacheseek.errors import StorageError
from cacheseek.store.direct_io import SLAB_BYTES, BufferPool
from cacheseek.store.lease import LeaseError, LeaseLedger, release_all
from server_helpers import Server, raw_chain
from store_helpers import BLOCK, make_cache, make_kv, raw_frame, switching_at_lines, tokens_for



def _leases(tier: CpuTier) -> dict:
    return tier.lease_stats()


def test_a_leased_slot_is_never_reused_while_leased():
    key1, f1 = raw_frame(1)
    tier = CpuTier(3 * f1.nbytes)
    for i in (1, 2, 3):  # fill the budget
        tier.put(*raw_frame(i))
    reader = tier.get(key1)
    snapshot = bytes(reader.host)
    assert _leases(tier)["leases_active"] == 1 and _leases(tier)["leased_bytes"] == f1.nbytes
    for i in range(4, 12):  # evict everything, many times over, and write new data
        tier.put(*raw_frame(i))
    assert not tier.contains(key1)  # the record is gone from the index at once
    assert bytes(reader.host) == snapshot  # but its memory was not reused
    stats = _leases(tier)
    assert stats["held_slots"] == 1 and stats["held_bytes"] >= f1.nbytes
    reader.release()
    stats = _leases(tier)
    assert stats["held_slots"] == 0 and stats["leases_active"] == 0 and stats["leased_bytes"] == 0
    # Released: the slot is reused by the next writes.
    for i in range(12, 16):
        tier.put(*raw_frame(i))
    assert tier.stats().extra["held_slots"] == 0


def test_the_arena_reuses_a_freed_slot_only_after_its_last_lease():
    arena = HostArena(1 << 20)
    slot = arena.allocate(4096)
    a, b = arena.lease(slot), arena.lease(slot)
    arena.free(slot)
    assert arena.held == 1
    assert arena.allocate(1 << 20, grow=False) is None  # the held slot's room is not free
    a.release()
    assert arena.held == 1
    with b:
        pass
    assert arena.held == 0
    assert arena.allocate(1 << 20, grow=False) is not None  # all of it free again
    with pytest.raises(RuntimeError, match="freed twice"):
        arena.free(slot)
    with pytest.raises(RuntimeError, match="freed"):
        arena.lease(slot)


def test_a_lease_is_released_exactly_once_and_a_double_release_is_an_error_that_is_counted():
    calls = []
    ledger = LeaseLedger()
    lease = ledger.grant(10, lambda: calls.append(1))
    assert ledger.stats()["leases_active"] == 1 and ledger.stats()["leased_bytes"] == 10
    lease.release()
    with pytest.raises(LeaseError, match="twice"):
        lease.release()
    with lease:  # a with block over a released lease releases nothing
        pass
    assert calls == [1]
    assert ledger.stats() == {"leases_active": 0, "leased_bytes": 0, "leases_granted": 1, "lease_double_releases": 1}


def test_a_lease_is_released_when_the_with_block_raises():
    key, frame = raw_frame(1)
    tier = CpuTier(2 * frame.nbytes)
    tier.put(key, frame)
    with pytest.raises(ZeroDivisionError):
        with tier.get(key) as got:
            assert bytes(got.host) == bytes(frame.host)
            1 / 0
    assert got.lease.released and _leases(tier)["leases_active"] == 0
    with pytest.raises(LeaseError):
        got.release()  # the with block released it: once
    assert _leases(tier)["lease_double_releases"] == 1


def test_pooled_buffers_are_leases_too():
    pool = BufferPool(keep_bytes=1 << 20)
    lease = pool.take(5000)
    assert pool.stats()["leases_active"] == 1 and pool.stats()["leased_bytes"] == lease.buffer.nbytes
    lease.release()
    with pytest.raises(LeaseError):
        lease.release()
    stats = pool.stats()
    assert stats["leases_active"] == 0 and stats["buffers_free"] == 1 and stats["lease_double_releases"] == 1


def test_kept_pieces_hold_their_pool_to_its_keep_bytes_counting_each_slab_they_keep_mapped():
    """Small buffers are pieces of 4 MiB slabs, and a kept piece keeps its whole slab mapped.
    Counted at their own bytes, 2,000 pieces of 128 KiB given back in an order that left one
    in each slab kept every slab: 1 GiB mapped under a keep of 16 MiB. The slabs kept pieces
    hold are what the keep bounds now; the pieces past it go."""
    keep = 16 << 20
    pool = BufferPool(keep_bytes=keep, pieces_up_to=256 << 10)
    leases = [pool.take(128 << 10) for _ in range(2000)]
    slabs = {id(lease.buffer._slab) for lease in leases}
    assert len(slabs) * SLAB_BYTES > 10 * keep  # (the pieces span ~63 slabs)
    for lease in leases[::32] + [lease for i, lease in enumerate(leases) if i % 32]:
        lease.release()
    kept = {id(b._slab) for bucket in pool._free.values() for b in bucket}
    stats = pool.stats()
    assert len(kept) * SLAB_BYTES <= keep and stats["kept_bytes"] == len(kept) * SLAB_BYTES, stats
    assert stats["buffers_free"] >= keep // (128 << 10) // 2  # (still a keep's worth of pieces to reuse)
    again = [pool.take(128 << 10) for _ in range(stats["buffers_free"])]  # (reused: none made)
    assert pool.made == 2000 and pool.stats()["kept_bytes"] == 0
    for lease in again:
        lease.release()


def test_write_through_reads_the_stored_copy_under_a_lease(tmp_path):
    key, frame = raw_frame(1)
    store = cs.TierConfig(cpu_bytes=4 * frame.nbytes, disk_path=tmp_path / "d", pin_memory=False,
                          write_through=["disk"]).build()
    try:
        assert store.put(key, frame).stored
        assert bytes(store.tier("disk").get(key).to_bytes()) == bytes(frame.host)
        assert store.tier("cpu").lease_stats()["leases_active"] == 0
        assert store.tier("cpu").lease_stats()["leases_granted"] == 1  # the write-through's
    finally:
        store.close()


def test_materialize_releases_every_lease_on_a_decode_error(monkeypatch):
    cache = make_cache(cpu="4MiB")
    toks = tokens_for(1, 4 * BLOCK)
    cache.ingest(toks, make_kv(4 * BLOCK, 1))
    cpu = cache.store.tier("cpu")
    from cacheseek import decode

    real_add = decode.BatchDecoder.add
    seen = []

    def failing_add(self, frame):
        seen.append(frame)
        if len(seen) == 3:
            raise RuntimeError("decode failed")
        return real_add(self, frame)

    monkeypatch.setattr(decode.BatchDecoder, "add", failing_add)
    with pytest.raises(RuntimeError, match="decode failed"):
        cache.materialize(toks)
    stats = cpu.lease_stats()
    assert stats["leases_granted"] >= 3 and stats["leases_active"] == 0 and stats["lease_double_releases"] == 0
    monkeypatch.setattr(decode.BatchDecoder, "add", real_add)
    assert cache.materialize(toks).num_tokens == 4 * BLOCK
    assert cpu.lease_stats()["leases_active"] == 0
    cache.close()


def _cpu(c: httpx.Client) -> dict:
    return c.get("/v1/stats").json()["tiers"][0]


def _wait_released(c: httpx.Client, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        cpu = _cpu(c)
        if cpu["leases_active"] == 0 or time.monotonic() > deadline:
            return cpu
        time.sleep(0.05)


@pytest.mark.parametrize("http", ["auto", "h11"])
def test_a_client_that_goes_away_mid_stream_releases_the_leases(tmp_path, http):
    chain = raw_chain(7, 16, block=2048)  # 16 frames of ~2 MiB: far more than the socket buffers
    with Server(tmp_path, "--http", http, cpu_bytes="128MiB", disk=False) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        for h, f in chain:
            assert c.put(f"/v1/blocks/{h.hex()}", content=f).status_code == 201
        granted = _cpu(c)["leases_granted"]
        for attempt in range(3):
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET /v1/prefixes/{chain[-1][0].hex()} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = sock.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 15  # the server blocks mid-stream, holding leases
            while (held := _cpu(c))["leases_active"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held["leases_active"] >= 1 and held["leased_bytes"] > 0
            sock.close()
            cpu = _wait_released(c)
            assert cpu["leases_active"] == 0 and cpu["leased_bytes"] == 0, cpu
            assert cpu["lease_double_releases"] == 0
        assert _cpu(c)["leases_granted"] > granted
        # A single block, cut off too.
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"GET /v1/blocks/{chain[0][0].hex()} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
        assert _wait_released(c)["leases_active"] == 0
        # And whole answers are exact, with nothing left leased.
        body = c.get(f"/v1/prefixes/{chain[-1][0].hex()}").content
        assert len(body) == sum(8 + len(f) for _, f in chain)
        assert c.get(f"/v1/blocks/{chain[3][0].hex()}").content == chain[3][1]
        assert _wait_released(c)["leases_active"] == 0


def test_an_arena_held_by_readers_refuses_a_put_without_emptying_the_tier():
    # Every stored slot leased: evicting frees no room (a leased slot is held until its
    # reader lets go), so evicting block after block would empty the tier and still fail.
    _, f = raw_frame(0)
    tier = CpuTier(1 << 20)  # one 1 MiB chunk, the whole arena
    count = (1 << 20) // f.nbytes
    for i in range(count):
        tier.put(*raw_frame(i))
    readers = tier.get_many([raw_frame(i)[0] for i in range(count)])
    try:
        with pytest.raises(StorageError, match="no contiguous room.*still leased"):
            tier.put(*raw_frame(count))
        # The budget asked for one victim; the others stay.
        assert tier.stats().blocks == count - 1 and tier.stats().evictions == 1
    finally:
        for frame in readers:
            frame.release()
    tier.put(*raw_frame(count))  # released: the room is there again
    assert tier.contains(raw_frame(count)[0])


def test_a_full_tier_whose_chunks_end_in_a_gap_evicts_its_victim_without_walking_every_slot(monkeypatch):
    """Frames that leave a gap at each chunk's end no frame fits (raw Llama-3-8B frames fit
    15 to a 1 GiB chunk, not 16): a full tier's budget has room on every put while its arena
    has none. The next victim, unleased and as large, makes the room; ``could_fit``'s walk
    over every slot ran on each such put. A leased victim still takes the walk (its slot is
    held, not freed), and the put evicts past it."""
    _, f = raw_frame(0)
    chunk = 1 << 20
    stride = (f.nbytes + 63) // 64 * 64
    per_chunk = chunk // stride
    chunks = 16
    assert chunks * (chunk - per_chunk * stride) > stride  # the gaps hold a frame's worth of the budget
    tier = CpuTier(chunks * chunk, chunk_bytes=chunk)
    held = chunks * per_chunk
    for i in range(held):
        tier.put(*raw_frame(i))
    walks = []
    could_fit = HostArena.could_fit
    monkeypatch.setattr(HostArena, "could_fit", lambda self, *a: walks.append(1) or could_fit(self, *a))
    for i in range(held, held + 10):
        tier.put(*raw_frame(i))
    assert walks == [] and tier.stats().blocks == held and tier.stats().evictions == 10
    victim = tier._index.victim()  # (a read does not touch: it stays the victim)
    (reader,) = tier.get_many([victim])
    try:
        tier.put(*raw_frame(held + 10))
        assert walks == [1] and tier.stats().evictions == 12  # the leased victim, then the next
        assert bytes(reader.host[-16:]) == bytes([victim[-1]]) * 16  # the reader's bytes, not reused
        assert tier.contains(raw_frame(held + 10)[0]) and not tier.contains(victim)
    finally:
        reader.release()


def test_a_dropped_handles_release_that_fails_is_logged_not_swallowed(caplog):
    """A handle's ``__del__`` gives its memory back through the finalizer, which has nobody
    to raise to: a release that failed was swallowed whole, and the memory it held stayed
    lent with nothing to say why. It is logged with its traceback now, on the finalizer's
    thread (a collection's) as in the thread that dropped the handle."""
    import logging

    from cacheseek.store.lease import Finalizer

    def release_that_fails() -> None:
        raise RuntimeError("the tier was closed under the handle")

    fin = Finalizer()
    with caplog.at_level(logging.ERROR, logger="cacheseek.store"):
        fin.ready()
        fin.submit(release_that_fails)
        assert fin.settle(timeout=10)
        fin.run(release_that_fails)
    failed = [r for r in caplog.records if "dropped handle failed" in r.getMessage()]
    assert len(failed) == 2
    assert all(r.exc_info and "the tier was closed" in str(r.exc_info[1]) for r in failed)
    assert "release_that_fails" in failed[0].getMessage()
    ran = []
    fin.submit(lambda: ran.append(1))  # (the thread goes on after a failure)
    assert fin.settle(timeout=10) and ran == [1]


def _race(n: int, work) -> list:
    """``work()`` in ``n`` threads lined up on a barrier; what each returned or raised."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = work()
        except BaseException as exc:  # noqa: BLE001 - compared by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a release deadlocked"
    return out


@pytest.fixture
def tight_switching():
    """Threads switched at every line of ``store/lease.py``'s code."""
    import cacheseek.store.lease as lease_module

    with switching_at_lines(lease_module):
        yield


def test_a_lease_released_by_two_threads_at_once_is_given_back_once(tight_switching):
    """``Lease.release`` checked its flag and set it without a lock: two threads releasing
    one lease at once could both pass the check and both give the slot's lease back, so the
    slot went back to the arena while another reader's lease still held it (its bytes
    reused under the reader), the ledger's counts went below the truth, or one thread got
    an AttributeError from the lender (the token already cleared). Now exactly one release
    gives it back; the other raises ``LeaseError`` and is counted, every time."""
    arena = HostArena(1 << 20)
    for _ in range(1500):
        slot = arena.allocate(4096)
        other = arena.lease(slot)  # another reader of the same slot
        lease = arena.lease(slot)
        arena.free(slot)  # evicted while leased: held until the last lease goes
        before = arena.ledger.double_releases
        out = _race(2, lease.release)
        assert sorted(type(o).__name__ for o in out) == ["LeaseError", "NoneType"], out
        assert arena.ledger.double_releases == before + 1
        assert arena.held == 1 and slot.leases == 1, "the slot went back while another reader held it"
        assert arena.ledger.active == 1 and arena.ledger.active_bytes == slot.nbytes
        with pytest.raises(LeaseError):
            lease.release()
        other.release()
        assert arena.held == 0 and arena.ledger.active == 0 and arena.ledger.active_bytes == 0


def test_with_blocks_and_release_all_on_a_lease_another_thread_releases_do_not_raise(tight_switching):
    """``with lease:`` and ``release_all`` skip a lease released already, but read the flag
    and released apart: with another thread releasing the same lease meanwhile, they raised
    ``LeaseError`` (or released it twice). Now the skip and the release are one step."""
    ledger = LeaseLedger()
    given: list[int] = []
    for i in range(1500):
        lease = ledger.grant(10, lambda i=i: given.append(i))

        def exit_block(lease=lease) -> None:
            with lease:
                pass

        out = _race(2, exit_block if i % 2 else (lambda lease=lease: release_all([lease])))
        assert out == [None, None], out
        assert given[-1] == i and len(given) == i + 1
    assert ledger.stats() == {"leases_active": 0, "leased_bytes": 0, "leases_granted": 1500, "lease_double_releases": 0}


# -- an interrupt (Ctrl-C) in the middle of a call -------------------------------------------


def _cpu_and_disk(tmp_path, cpu_bytes="1MiB"):
    from store_helpers import LAYOUT

    return cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes=cpu_bytes, disk_path=tmp_path / "d", disk_bytes="4MiB",
                                              promote_on_hit=False))


def test_an_ingest_interrupted_in_its_write_through_gives_its_reservations_back(tmp_path, monkeypatch):
    """Ctrl-C during the disk write-through of an in-place ingest: the piece being committed
    was out of the call's pending work already, so nothing aborted its CPU-tier reservations,
    held against the budget for the life of the cache (10 interrupts: 1.1 MB of a 1 MiB tier)."""
    from cacheseek.store.disk import DiskTier

    cache = _cpu_and_disk(tmp_path)
    real = DiskTier.put_many
    calls = []

    def put_many(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(DiskTier, "put_many", put_many)
    toks, kv = tokens_for(301, 4 * BLOCK), make_kv(4 * BLOCK, 301)
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.ingest(toks, kv)
        assert cache.stats()["tiers"][0]["reservation_bytes"] == 0
        got = cache.ingest(toks, kv)
        assert got.stored + got.present == 4 and got.failed == 0
        cpu = cache.stats()["tiers"][0]
        assert cpu["reservation_bytes"] == 0 and cpu["blocks"] == 4
    finally:
        cache.close()


def test_a_load_interrupted_while_it_waits_for_a_disk_read_gives_the_read_buffer_back(tmp_path, monkeypatch):
    """Ctrl-C while a materialize waits for a disk read: the read was marked handed out
    before its result came, so the stream's close skipped it and its pooled buffer (page-
    locked memory beside a GPU) stayed lent for good."""
    import cacheseek.store.direct_io as dio

    cache = _cpu_and_disk(tmp_path, cpu_bytes="60KiB")  # the chain is read from disk
    toks, kv = tokens_for(302, 4 * BLOCK), make_kv(4 * BLOCK, 302)
    cache.ingest(toks, kv)
    armed = [True]

    class Interrupted:
        def __init__(self, fut):
            self.fut = fut

        def cancel(self):
            return self.fut.cancel()

        def result(self, timeout=None):
            got = self.fut.result(timeout)  # the read lands, then the wait is interrupted
            if armed.pop() if armed else False:
                raise KeyboardInterrupt
            return got

    real = dio.ReadPool.submit
    monkeypatch.setattr(dio.ReadPool, "submit", lambda self, *a, **kw: Interrupted(real(self, *a, **kw)))
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.materialize(toks)
        assert cache.stats()["tiers"][1]["stream_buffers"]["leases_active"] == 0
        assert cache.materialize(toks).num_tokens == 4 * BLOCK
        assert cache.stats()["tiers"][1]["stream_buffers"]["leases_active"] == 0
    finally:
        cache.close()


def test_a_cpu_put_interrupted_midway_keeps_no_lease_nor_slot(monkeypatch):
    """Ctrl-C while the second of three frames is copied into the CPU tier: the first's
    lease (a write-through put leases what it stores) went with the results the caller never
    got, and the second's slot was neither recorded nor freed (only an Exception freed it)."""
    import cacheseek.store.cpu as cpu
    from cacheseek.store.frame import parse_frame
    from cacheseek.store.tier import BlockFrame
    from store_helpers import chain

    tier = CpuTier(1 << 20)
    items = [(key, BlockFrame(parse_frame(raw), host=memoryview(raw))) for key, raw in chain(303, 3)]
    real, n = cpu._start_fill, []

    def start_fill(*a, **kw):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(cpu, "_start_fill", start_fill)
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(items, lease_stored=True)
    stats = tier.stats().extra
    assert _leases(tier)["leases_active"] == 0 and stats["held_slots"] == 0
    assert tier.stats().blocks == 1  # stored, unacknowledged: the caller never heard of it
    for key, _ in items:
        tier.delete(key)
    assert tier.stats().blocks == 0 and tier.stats().extra["held_bytes"] == 0
    tier.close()
