"""Races around reads and background work: prefetches meeting a close, a delete, an ingest;
readers holding leases while the tiers evict under them. Real threads over real tiers (CPU,
disk in a temp directory); each test ends with the books checked (nothing lent, nothing in
flight, every block a prefetch started counted once)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from store_helpers import BLOCK, LAYOUT, make_cache, make_kv, raw_frame, run_threads, tokens_for

from cacheseek.store.cpu import CpuTier
from cacheseek.store.disk import DiskTier
from cacheseek.store.tiered import TieredStore

RUN_S = 2.0  # each stress test's threads run this long


def _on_disk_only(cache, toks) -> None:
    cpu = cache.store.tier("cpu")
    for key in cache.block_hashes(toks):
        cpu.delete(key)
    assert set(cache.locate(toks).tiers) == {"disk"}


def test_a_prefetch_that_meets_a_close_before_its_submit_leaves_the_counts_whole(tmp_path):
    """A prefetch past its check that the prefetcher is open, whose submit found the executor
    shut down by a ``close()`` in another thread (already done clearing what was in flight):
    its blocks were counted failed twice and its slot given back twice, so ``in_flight`` read
    -1 and ``failed_blocks`` more blocks than any prefetch had started."""
    chains = [(tokens_for(200 + i, 2 * BLOCK), make_kv(2 * BLOCK, 200 + i)) for i in range(2)]
    with make_cache(cpu="64MiB", disk=tmp_path / "d", max_prefetches=1) as cache:
        for toks, kv in chains:
            cache.ingest(toks, kv)
            _on_disk_only(cache, toks)
        prefetcher = cache.store.prefetcher
        assert cache.prefetch(chains[0][0]).wait(30)  # (its executor exists now)
        executor = prefetcher._executor
        real_submit = executor.submit

        closer = threading.Thread(target=prefetcher.close)

        def closed_meanwhile(*args, **kw):
            closer.start()
            # Bounded, not a synchronization: the close either ends here (the race) or waits
            # for the lock this submit runs under, and then finds the prefetch submitted.
            closer.join(0.5)
            return real_submit(*args, **kw)

        executor.submit = closed_meanwhile
        started = prefetcher.attempt(cache.block_hashes(chains[1][0]))
        closer.join(30)
        assert not closer.is_alive()
        stats = prefetcher.stats()
        assert stats["in_flight"] == 0 and stats["blocks_in_flight"] == 0, stats
        begun = 2 + (2 if hasattr(started, "blocks") else 0)
        assert stats["promoted_blocks"] + stats["failed_blocks"] == begun, (started, stats)


@pytest.mark.parametrize("lands", ["before", "after"])  # the executor's submit: before or after it queued the run
def test_a_prefetch_interrupted_as_it_is_queued_leaves_no_block_in_flight_and_counts_whole(tmp_path, lands):
    """The blocks were put in flight, then the run queued by the executor's ``submit`` (Python:
    its own locks, a thread started): an interrupt there left the blocks in flight for good,
    and every later ``get`` of them waited for ever; landing after the run was queued, it left
    ``in_flight`` at -1, one prefetch past ``max_prefetches`` for good."""
    from store_helpers import interrupting_executor

    size = raw_frame(1)[1].nbytes
    store = TieredStore([CpuTier(2 * size), DiskTier(tmp_path / "d", 1 << 26, fsync=False)])
    for i in range(1, 6):
        store.put(*raw_frame(i))
    key = raw_frame(1)[0]
    assert store.locate([key]) == ["disk"]
    prefetcher = store.prefetcher
    prefetcher._executor = interrupting_executor(lands)(prefetcher.max_in_flight, thread_name_prefix="cacheseek-prefetch")
    with pytest.raises(KeyboardInterrupt):
        store.prefetch([key])
    deadline = time.monotonic() + 10
    while prefetcher.stats()["in_flight"] and time.monotonic() < deadline:  # (a run that began goes on)
        time.sleep(0.01)
    stats = prefetcher.stats()
    assert stats["in_flight"] == 0 and stats["blocks_in_flight"] == 0, stats
    reader = threading.Thread(target=lambda: store.get(key)[0].release(), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a read waits for a prefetch that never ran"
    store.close()


def test_a_prefetch_interrupted_before_its_handover_is_made_publishes_nothing(tmp_path, monkeypatch):
    """The blocks were published as in flight before the hand-over token was made (a Python
    call, where an interrupt can land) and outside the ``try`` that undoes them."""
    from cacheseek.store import prefetch as prefetch_mod

    size = raw_frame(1)[1].nbytes
    store = TieredStore([CpuTier(2 * size), DiskTier(tmp_path / "d", 1 << 26, fsync=False)])
    for i in range(1, 6):
        store.put(*raw_frame(i))
    key = raw_frame(1)[0]

    class Interrupted:
        def __init__(self) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(prefetch_mod, "Handover", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.prefetch([key])
    stats = store.prefetcher.stats()
    assert stats["in_flight"] == 0 and stats["blocks_in_flight"] == 0, stats
    store.get(key)[0].release()
    store.close()


def test_a_lease_interrupted_as_it_is_made_is_not_counted(tmp_path, monkeypatch):
    """A lease on a CPU-tier slot was counted, then made: an interrupt as it was made left
    ``leases_active`` above 0 for good (the sign of a holder that dropped a lease unreleased,
    where no holder ever had it) and the slot held after its eviction."""
    from cacheseek.store import arena as arena_mod

    tier = CpuTier(4 * raw_frame(1)[1].nbytes)
    key, frame = raw_frame(1)
    tier.put(key, frame)
    real = arena_mod.Lease.__init__
    armed = [True]

    def interrupted(self, *args):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        real(self, *args)

    monkeypatch.setattr(arena_mod.Lease, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.get(key)
    monkeypatch.setattr(arena_mod.Lease, "__init__", real)
    assert tier.lease_stats()["leases_active"] == 0
    got = tier.get(key)
    got.lease.release()
    assert tier.lease_stats()["leases_active"] == 0


def test_a_prefetch_that_raises_in_its_thread_is_counted_and_logged_once_per_run(tmp_path, monkeypatch, caplog):
    """A prefetch fails nothing (what it could not promote stays below, and is read there),
    but an error in its thread (a bug in a promotion, a tier raising what it should have
    answered) was swallowed whole: counted as blocks not promoted, like a CPU tier that had
    no room, and logged nowhere, so a prefetch that never worked looked like a full tier.
    Now it is counted (``errors``) and the first of a run of them logged with its traceback."""
    from cacheseek.store.tiered import TieredStore

    chains = [(tokens_for(210 + i, 2 * BLOCK), make_kv(2 * BLOCK, 210 + i)) for i in range(3)]
    with make_cache(cpu="64MiB", disk=tmp_path / "d") as cache:
        for toks, kv in chains:
            cache.ingest(toks, kv)
            _on_disk_only(cache, toks)
        real = TieredStore._promote_up
        broken = threading.Event()
        broken.set()

        def promote(self, *args, **kw):
            if broken.is_set():
                raise AttributeError("a promotion's bug")
            return real(self, *args, **kw)

        monkeypatch.setattr(TieredStore, "_promote_up", promote)
        with caplog.at_level("WARNING", logger="cacheseek.store"):
            for toks, _ in chains[:2]:
                handle = cache.prefetch(toks)
                assert handle is not None and handle.wait(30) and handle.promoted == 0
            broken.clear()
            assert cache.prefetch(chains[2][0]).wait(30)
        stats = cache.stats()["prefetch"]
        assert stats["errors"] == 2 and stats["promoted_blocks"] == 2 and stats["failed_blocks"] == 4, stats
        logged = [r for r in caplog.records if "prefetch" in r.getMessage()]
        assert len(logged) == 1 and "a promotion's bug" in logged[0].getMessage(), [r.getMessage() for r in logged]
        assert logged[0].exc_info is not None  # (where it was raised)
        assert set(cache.locate(chains[2][0]).tiers) == {"cpu"}
        assert set(cache.locate(chains[0][0]).tiers) == {"disk"}  # (read from disk, as before)


def test_close_stops_a_prefetch_in_flight_after_the_block_it_is_on(tmp_path, monkeypatch):
    """``close()`` (a server shutting down) waited for every prefetch in flight to promote its
    whole chain, block after block, into a tier about to close: a few long chains on disk held
    the shutdown for as long as reading them all took. A run now stops at the next block once
    the prefetcher is closing; the blocks it did not reach count as not promoted."""
    from cacheseek.store.tiered import TieredStore

    n = 8
    toks, kv = tokens_for(220, n * BLOCK), make_kv(n * BLOCK, 220)
    cache = make_cache(cpu="64MiB", disk=tmp_path / "d")
    try:
        cache.ingest(toks, kv)
        _on_disk_only(cache, toks)
        prefetcher = cache.store.prefetcher
        real = TieredStore._promote_up
        promoting, promoted = threading.Event(), []

        def promote(self, key, *args, **kw):
            promoting.set()
            closing = prefetcher._closing
            assert closing.result(30) is None  # (the first block waits for the close to begin)
            promoted.append(key)
            return real(self, key, *args, **kw)

        monkeypatch.setattr(TieredStore, "_promote_up", promote)
        handle = cache.prefetch(toks)
        assert handle is not None and handle.blocks == n
        assert promoting.wait(30)
        closer = threading.Thread(target=cache.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        assert handle.done() and len(promoted) == 1, len(promoted)
        stats = cache.store.prefetcher.stats()
        assert stats["promoted_blocks"] + stats["failed_blocks"] == n and stats["in_flight"] == 0, stats
    finally:
        cache.close()


def test_readers_holding_frames_keep_their_bytes_while_other_threads_evict_delete_and_prefetch(tmp_path):
    """Six threads over a CPU tier of five frames above a small disk tier: puts that evict
    (and demote), deletes, prefetches, and reads that hold up to three frames at once while
    the others run. A held frame's bytes are compared when it is released, after the tier has
    evicted and reused slots under it (a slot reused while leased would read another
    frame's bytes). Then the books: nothing lent, no slot held, no prefetch in flight, every
    block a prefetch started counted once, and every block counted once store-wide."""
    frames = [raw_frame(i) for i in range(1, 40)]
    size = frames[0][1].nbytes
    cpu = CpuTier(5 * size + 100, chunk_bytes=1 << 20)
    store = TieredStore([cpu, DiskTier(tmp_path / "d", 12 * (size + 8192))])
    started: list = []
    deadline = time.monotonic() + RUN_S

    def worker(i: int) -> int:
        rnd = random.Random(i)
        held: list = []  # (frame, the bytes it must still hold)
        reads = 0
        try:
            while time.monotonic() < deadline:
                key, frame = rnd.choice(frames)
                op = rnd.random()
                if op < 0.35:
                    store.put(key, frame)
                elif op < 0.45:
                    store.delete(key)
                elif op < 0.55:
                    handle = store.prefetcher.attempt([key])
                    if hasattr(handle, "blocks"):
                        started.append(handle)
                elif (got := store.get(key)) is not None:
                    reads += 1
                    held.append((got[0], bytes(frame.host)))
                    if len(held) > 3:
                        old, want = held.pop(0)
                        assert bytes(old.host) == want, "a leased slot was reused under its reader"
                        old.release()
        finally:
            for old, want in held:
                assert bytes(old.host) == want, "a leased slot was reused under its reader"
                old.release()
        return reads

    assert sum(run_threads(worker, 6, timeout=60)) > 0
    assert all(h.wait(30) for h in started)
    prefetch = store.prefetcher.stats()
    assert prefetch["in_flight"] == 0 and prefetch["blocks_in_flight"] == 0 and prefetch["errors"] == 0, prefetch
    begun = sum(h.blocks - h.joined for h in started)
    assert prefetch["promoted_blocks"] + prefetch["failed_blocks"] == begun, (begun, prefetch)
    stats = store.stats()
    leases = cpu.lease_stats()
    assert leases["leases_active"] == 0 and leases["held_slots"] == 0 and leases["lease_double_releases"] == 0, leases
    assert stats["tiers"][1]["stream_buffers"]["leases_active"] == 0
    keys = [key for key, _ in frames]
    assert stats["blocks"] == sum(any(t.contains(k) for t in store.tiers) for k in keys)
    for tier, figures in zip(store.tiers, stats["tiers"]):
        assert figures["blocks"] == sum(tier.contains(k) for k in keys), tier.name
    store.close()


def test_prefetches_racing_deletes_and_ingests_bring_no_deleted_block_back(tmp_path):
    """Prefetches of chains on disk while another thread deletes some of those chains,
    ingests others (evicting through a CPU tier of six blocks) and two more materialize:
    a prefetch whose read began before a delete must not promote the block it read (it
    would come back after its delete). Once all is done, no deleted block is in any tier,
    and nothing is lent or in flight."""
    frame = LAYOUT.raw_nbytes(BLOCK) + 1024
    with make_cache(cpu=6 * frame, disk=tmp_path / "d", max_prefetches=2) as cache:
        live = [(tokens_for(230 + i, 4 * BLOCK), make_kv(4 * BLOCK, 230 + i)) for i in range(3)]
        doomed = [tokens_for(240 + i, 3 * BLOCK) for i in range(5)]
        for toks, kv in live:
            cache.ingest(toks, kv)
        for i, toks in enumerate(doomed):
            cache.ingest(toks, make_kv(3 * BLOCK, 240 + i))
        handles: list = []
        deleted = threading.Event()
        deadline = time.monotonic() + RUN_S

        def worker(i: int) -> None:
            rnd = random.Random(i)
            while time.monotonic() < deadline:
                if i == 0:
                    if not deleted.is_set() and time.monotonic() > deadline - RUN_S / 2:
                        for toks in doomed:
                            for key in cache.block_hashes(toks):
                                cache.store.delete(key)
                        deleted.set()
                    toks, kv = rnd.choice(live)
                    cache.ingest(toks, kv)
                elif i in (1, 2):
                    toks = rnd.choice([t for t, _ in live] + ([] if deleted.is_set() else doomed))
                    started = cache.store.prefetcher.attempt(cache.block_hashes(toks))
                    if hasattr(started, "blocks"):
                        handles.append(started)
                else:
                    toks, kv = rnd.choice(live)
                    got = cache.materialize(toks)
                    assert got.num_tokens % BLOCK == 0 and got.num_tokens <= 4 * BLOCK

        run_threads(worker, 5, timeout=60)
        assert deleted.is_set()
        assert all(h.wait(30) for h in handles)
        for toks in doomed:
            assert not any(t.contains(k) for k in cache.block_hashes(toks) for t in cache.store.tiers)
        stats = cache.stats()
        prefetch = stats["prefetch"]
        assert prefetch["in_flight"] == 0 and prefetch["blocks_in_flight"] == 0 and prefetch["errors"] == 0, prefetch
        assert prefetch["promoted_blocks"] + prefetch["failed_blocks"] == sum(h.blocks - h.joined for h in handles)
        cpu, disk = stats["tiers"]
        assert cpu["leases_active"] == 0 and cpu["held_slots"] == 0
        assert disk["stream_buffers"]["leases_active"] == 0


def test_a_block_deleted_between_a_prefetchs_read_and_its_promotion_stays_deleted(tmp_path, monkeypatch):
    """The delete goes by while the prefetch holds the block's bytes, read from disk and not
    yet put into memory: the promotion must not bring it back (the delete answered for it)."""
    toks, kv = tokens_for(250, 3 * BLOCK), make_kv(3 * BLOCK, 250)
    with make_cache(cpu="64MiB", disk=tmp_path / "d") as cache:
        cache.ingest(toks, kv)
        _on_disk_only(cache, toks)
        keys = cache.block_hashes(toks)
        real = TieredStore._promote_up

        def deleted_meanwhile(self, key, *args, **kw):
            if key == keys[1]:
                assert self.delete(key)
            return real(self, key, *args, **kw)

        monkeypatch.setattr(TieredStore, "_promote_up", deleted_meanwhile)
        handle = cache.prefetch(toks)
        assert handle is not None and handle.wait(30)
        assert [any(t.contains(k) for t in cache.store.tiers) for k in keys] == [True, False, True]
        assert cache.lookup(toks) == BLOCK
        # (the third stays on disk: a block goes up only beside its parent)
        assert cache.stats()["prefetch"]["promoted_blocks"] == 1


def test_a_server_streaming_prefixes_while_it_evicts_prefetches_and_loses_clients_keeps_its_books(tmp_path):
    """A real ``cacheseek serve`` with a CPU tier of ten frames over a disk tier: two clients
    read whole chains (each byte compared with what was stored), one starts reads and resets
    its connection after a few bytes, one sends prefetches, one stores new chains that evict
    the others from memory. Every whole answer must be the stored bytes; once all is done,
    no lease is active, no slot held, no prefetch in flight, and the log holds no traceback."""
    import socket
    import struct

    import httpx

    from server_helpers import LAYOUT as SERVER_LAYOUT
    from server_helpers import Server, batch_body, raw_chain

    chains = [raw_chain(300 + i, 12, layout=SERVER_LAYOUT, block=48) for i in range(6)]
    nbytes = len(chains[0][0][1])
    with Server(tmp_path, cpu_bytes=str(10 * nbytes)) as srv:
        for chain in chains:
            assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]),
                              timeout=30).status_code == 200
        deadline = time.monotonic() + RUN_S

        def worker(i: int) -> int:
            rnd = random.Random(i)
            whole = 0
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < deadline:
                    chain = rnd.choice(chains)
                    path = f"/v1/prefixes/{chain[-1][0].hex()}"
                    if i < 2:
                        answer = client.get(srv.url + path)
                        assert answer.status_code == 200  # (every chain stays on disk)
                        want = b"".join(struct.pack("<Q", len(f)) + f for _, f in chain)
                        assert answer.content == want, "a streamed frame's bytes changed under it"
                        whole += 1
                    elif i == 2:
                        with socket.socket() as sock:
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 10)
                            sock.connect(("127.0.0.1", srv.port))
                            sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                            sock.recv(rnd.randrange(1, 50_000))
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    elif i == 3:
                        client.post(srv.url + "/v1/prefetch", json={"hashes": [h.hex() for h, _ in chain]})
                    else:
                        other = raw_chain(rnd.randrange(1 << 30), 3, layout=SERVER_LAYOUT, block=48)
                        client.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in other]))
            return whole

        assert sum(run_threads(worker, 5, timeout=60)) > 0
        settled = time.monotonic() + 10  # (a reset connection's response ends on the server's own time)
        while True:
            stats = httpx.get(srv.url + "/v1/stats").json()
            cpu, disk = stats["tiers"]
            done = cpu["leases_active"] == 0 and stats["prefetch"]["in_flight"] == 0
            if done or time.monotonic() > settled:
                break
            time.sleep(0.05)
        assert cpu["leases_active"] == 0 and cpu["held_slots"] == 0 and cpu["lease_double_releases"] == 0, cpu
        assert disk["stream_buffers"]["leases_active"] == 0
        assert stats["prefetch"]["in_flight"] == 0 and stats["prefetch"]["errors"] == 0, stats["prefetch"]
        log = srv.output()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
