"""``IdlePool``: a thread pool whose threads exit once idle.

``concurrent.futures.ThreadPoolExecutor`` keeps every thread it started until ``shutdown``:
a client that loaded one batch and then sat idle for hours held ``max_workers`` threads (and
their stacks) all that time. Making a pool per call instead would start the threads again
for every batch of a hot loop. Here a thread that finds no work for ``idle_seconds`` exits,
and the next ``submit`` starts one again: a hot loop keeps its threads, an idle client holds
none.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .store.lease import Handover

T = TypeVar("T")


class IdlePool:
    """``submit`` and ``shutdown`` as ``ThreadPoolExecutor`` has them, with at most
    ``max_workers`` threads, each gone after ``idle_seconds`` without work."""

    def __init__(self, max_workers: int, *, idle_seconds: float, thread_name_prefix: str) -> None:
        if max_workers < 1 or idle_seconds <= 0:
            raise ValueError(f"IdlePool: max_workers ({max_workers}) must be at least 1 and idle_seconds "
                             f"({idle_seconds}) more than 0")
        self.max_workers = max_workers
        self.idle_seconds = idle_seconds
        self._prefix = thread_name_prefix
        # Taken through the plain lock: ``Condition.__exit__`` is Python, and an interrupt at
        # its start left the lock held (every later fetch waited for ever).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[tuple[Future, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0  # alive (guarded by _cond)
        self._idle = 0  # alive and waiting for work
        self._started = 0  # ever, for thread names
        self._shutdown = False

    @property
    def threads(self) -> int:
        with self._lock:
            return self._threads

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """``fn(*args)`` on a thread of the pool. ``RuntimeError`` once shut down."""
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append((future, fn, args))
            # The waiting threads take the queued work first; a thread is started only for
            # work none of them will take (one notified may not have woken yet: it counts
            # as waiting until it has).
            if len(self._queue) > self._idle and self._threads < self.max_workers:
                self._threads += 1
                self._started += 1
                handover = Handover()
                try:
                    threading.Thread(target=self._work, args=(handover,), name=f"{self._prefix}_{self._started}",
                                     daemon=True).start()
                except BaseException:
                    # (an interrupt, or "can't start new thread": counted, a thread that never
                    # ran kept the pool full, and every later call waited for ever. One that
                    # began all the same, the interrupt in ``start``'s wait, keeps its count.)
                    if handover.claim():
                        self._threads -= 1
                        self._queue.remove((future, fn, args))
                    raise
            else:
                self._cond.notify()
        return future

    def shutdown(self, *, cancel_futures: bool = False) -> None:
        """No more work taken; with ``cancel_futures`` the queued work is cancelled. Waiting
        threads exit at once; one running a call exits once it returns. Does not wait."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            self._cond.notify_all()

    def _work(self, handover: Handover) -> None:
        if not handover.claim():
            return  # (its ``submit`` was interrupted, and took its count back)
        while True:
            with self._lock:
                while not self._queue and not self._shutdown:
                    self._idle += 1
                    woken = self._cond.wait(self.idle_seconds)
                    self._idle -= 1
                    if not woken and not self._queue:
                        break  # idle for idle_seconds: the thread goes
                if not self._queue:  # (idle, or shut down with nothing left to run)
                    self._threads -= 1
                    return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller's, through its future
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args  # (nothing of a call held while this thread waits for the next)
