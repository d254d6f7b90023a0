"""``IdlePool``: at most ``max_workers`` threads, each gone once idle, queued work cancelled at
shutdown, errors through the futures."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from cacheseek.idle_pool import IdlePool


def test_threads_stay_bounded_exit_when_idle_and_shutdown_cancels_the_queue():
    pool = IdlePool(2, idle_seconds=0.2, thread_name_prefix="test-idle")
    gate, running = threading.Event(), threading.Semaphore(0)

    def held(x: int) -> int:
        running.release()
        assert gate.wait(5)
        return x * 2

    futures = [pool.submit(held, i) for i in range(4)]
    assert running.acquire(timeout=5) and running.acquire(timeout=5)
    assert pool.threads == 2 and not running.acquire(timeout=0.1)  # two run, two queued
    gate.set()
    assert [f.result(5) for f in futures] == [0, 2, 4, 6]
    # The two queued calls' starts, taken now: left counted, they would pass for the starts
    # awaited below before those calls began (and the shutdown would cancel them).
    assert running.acquire(timeout=5) and running.acquire(timeout=5) and not running.acquire(timeout=0)
    workers = [t for t in threading.enumerate() if t.name.startswith("test-idle")]
    for t in workers:
        t.join(5)
    assert pool.threads == 0 and not any(t.is_alive() for t in workers)
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)  # (a thread started again)
    gate.clear()
    futures = [pool.submit(held, i) for i in range(3)]
    assert running.acquire(timeout=5) and running.acquire(timeout=5)
    pool.shutdown(cancel_futures=True)
    gate.set()
    assert [f.result(5) for f in futures[:2]] == [0, 2]
    with pytest.raises(CancelledError):
        futures[2].result(5)
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit(held, 9)
    for t in [t for t in threading.enumerate() if t.name.startswith("test-idle")]:
        t.join(5)
    assert pool.threads == 0


def test_a_thread_that_could_not_be_started_is_not_counted(monkeypatch):
    """A thread was counted before it was started: an interrupt there (or "can't start new
    thread") kept a thread that never ran in the count, and with the pool at its bound every
    later call waited for ever."""
    pool = IdlePool(max_workers=1, idle_seconds=5, thread_name_prefix="t")
    real = threading.Thread.start
    armed = [True]

    def interrupted(self):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.submit(lambda: 1)
    assert pool.threads == 0
    assert pool.submit(lambda: 2).result(timeout=10) == 2
    pool.shutdown()


def test_a_thread_interrupted_in_its_start_after_it_began_keeps_its_count(monkeypatch):
    """``Thread.start`` waits for the thread to begin: an interrupt in that wait, the thread
    running, was taken as "never started" and its count given back, and the thread gave it
    back again when it ended: the count went to -1, one thread past ``max_workers`` for good."""
    import time

    pool = IdlePool(max_workers=1, idle_seconds=0.2, thread_name_prefix="t")
    real = threading.Thread.start
    armed = [True]

    def begun_then_interrupted(self):
        real(self)
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", begun_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.submit(lambda: 1)
    assert pool.threads == 1  # (it runs: its count is its own to give back)
    deadline = time.monotonic() + 10
    while pool.threads and time.monotonic() < deadline:  # idles out
        time.sleep(0.05)
    assert pool.threads == 0
    assert pool.submit(lambda: 2).result(timeout=10) == 2
    pool.shutdown()
