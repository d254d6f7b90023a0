"""Races around reads and background work: prefetches meeting a close, a delete, an ingest;
readers holding leases while the tiers evict under them. Real threads over real tiers (CPU,
disk in a temp directory); each test ends with the books checked (nothing lent, nothing in
flight, every block a prefetch started counted once)."""

from __future__ import annotations

import threading

from store_helpers import BLOCK, make_cache, make_kv, tokens_for


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
