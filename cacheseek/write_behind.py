"""Writes that finish after their call returns: ``RemoteCache``'s ``wait=False`` ingests.

The call itself reads the KV: it encodes the blocks and moves their compact frames to host
memory, so the caller's tensors or pages are its own again when it returns. What is left,
the server's lookup of which blocks are new and the upload of those, runs on one sender
thread per cache, one write after another in the order the calls were made, each answered
through a ``Future``. An engine's step then pays for the encode and one copy, not for two
round trips and the upload of its new KV.

What waits is bounded: at most ``max_bytes`` of frames queued or being sent. A write that
would pass the bound is not queued (the caller answers it at once, its blocks failed): a
cache that cannot keep up with the server drops writes rather than stall its caller or
grow without limit. ``flush`` waits for the writes queued so far; ``close`` for all of
them, then stops the thread.

At interpreter exit, the writes of a cache never closed get ``exit_timeout`` seconds in all,
then the exchange under way is cut and those still queued fail unsent: they are best-effort,
and a process on its way out must not wait out a server that answers a byte at a time. The
cut is the sender thread's alone, and its failures are not the breaker's: the hooks run when
the main thread ends, and threads the program left running may go on calling the cache.
Python's own exit hook for executors (``concurrent.futures.thread``) runs every queued item
to its end, each exchange up to ``exchange_timeout``: a process exiting without ``close()``
hung for minutes. This module's hook runs before it (``threading._shutdown`` calls the hooks
of ``threading._register_atexit`` in reverse order of registration, and this module imports
``concurrent.futures.thread``, whose hook registers at its import, before registering its own).

A write that fails (its sender raised: the future holds the error) is counted
(``writes_failed``, ``last_error``), and the first of a run of failures is logged, so a
caller that drops its futures still learns that its writes are not being stored.
"""

from __future__ import annotations

import concurrent.futures.thread  # (its exit hook registers now: before this module's, below)
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from .store.lease import Handover

log = logging.getLogger("cacheseek.remote")  # (the cache's logger: the writes are RemoteCache's)

_open: weakref.WeakSet[WriteBehind] = weakref.WeakSet()  # those whose sender runs: the exit hook's


def _at_exit() -> None:
    """Before Python's own hook drains the senders' queues: give each one its ``exit_timeout``,
    all at once, then cut what is left (that hook then runs the rest, each failing unsent)."""
    try:
        start = time.monotonic()
        behinds = [b for b in list(_open) if b.stats()["writes_pending"]]
        for b in behinds:
            b._cut_off_at(start + b.exit_timeout, sender_only=True)
        for b in behinds:
            uncut = 0
            if not b.flush(max(start + b.exit_timeout - time.monotonic(), 0.0)):
                uncut = b._cut_off_at(time.monotonic(), sender_only=True)
            # (counted, not the flush's answer: the cut comes due when the flush's wait ends, and
            # writes it failed (answered as misses) often drained the queue just before it did)
            dropped = b.dropped_at_exit()
            if dropped and uncut:
                # (through a proxy, an exchange waiting for its answer's head cannot be cut:
                # the line said "dropped" while that write went on being sent for minutes)
                log.warning("%s never closed: at interpreter exit, %d writes in the background (ingest wait=False) "
                            "were not answered within its exit_timeout (%s s): those queued are dropped, but the "
                            "one being sent through a proxy cannot be cut before its answer begins, and exit "
                            "waits for it (up to the cache's timeout for each read)", b.owner, dropped,
                            b.exit_timeout)
            elif dropped:
                log.warning("%s never closed: at interpreter exit, %d writes in the background (ingest wait=False) "
                            "not answered within its exit_timeout (%s s) are dropped", b.owner, dropped,
                            b.exit_timeout)
    except Exception:  # (raised here, it would skip the hooks after this one: the threads' joins)
        log.exception("the write-behind exit hook failed; queued writes are sent to their end")


# (threading's hooks run in reverse order of registration: this one before concurrent.futures',
# imported above. Private, as concurrent.futures' own use of it: absent, exit drains as before.)
getattr(threading, "_register_atexit", lambda hook: None)(_at_exit)


class WriteBehind:
    def __init__(self, max_bytes: int, *, owner: str = "WriteBehind", exit_timeout: float = 5.0,
                 cut_off: Callable[..., int | None] | None = None) -> None:
        """``owner``: the cache's name, for the error of a write queued after ``close``.
        ``cut_off(when, thread=None)``: no exchange (of ``thread``'s alone, an ident, where
        given) runs past ``when`` (``time.monotonic()``), those under way cut at once once it
        is past (``BulkTransport.cut_off_at``); at interpreter exit, the sender's,
        ``exit_timeout`` seconds from its start (threads the program left running may go on
        calling the cache); it answers how many exchanges under way it could not end (a
        proxied one waiting for its answer). None: exit waits for the writes, as ``close`` does."""
        self.max_bytes = max_bytes
        self.owner = owner
        self.exit_timeout = exit_timeout
        self._cut_off = cut_off
        self._sender: int | None = None  # the sender thread's ident, once it ran a write
        self._exit_cut: float | None = None  # the sender's cutoff at interpreter exit, for writes it begins later
        self._cut_done = 0  # writes done once the cut at exit came due: dropped by it
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._futures: set[Future] = set()
        self._executor: ThreadPoolExecutor | None = None  # started by the first write
        self._closed = False
        self._sent = threading.Event()  # close() has sent everything queued
        self.counts = {"writes_queued": 0, "writes_done": 0, "writes_refused": 0, "blocks_refused": 0,
                       "writes_failed": 0, "blocks_failed": 0, "pending_bytes_high": 0, "lookups_first_late": 0}
        self.last_error = ""
        self._failing = False  # the last write done failed: the next failure is not logged again
        self._refusing = False  # the last write offered was refused for the bound: said once a run

    def reserve(self, nbytes: int, blocks: int = 0) -> bool:
        """Room for a write of ``nbytes`` of frames (``blocks`` of them), taken now (False:
        the bound would be passed; the write is not to be queued, and counted refused). Given
        back by ``release`` or, once submitted, when the write is done."""
        with self._lock:
            if self._pending_bytes + nbytes <= self.max_bytes:
                self._pending_bytes += nbytes
                self.counts["pending_bytes_high"] = max(self.counts["pending_bytes_high"], self._pending_bytes)
                self._refusing = False
                return True
            self.counts["writes_refused"] += 1
            self.counts["blocks_refused"] += blocks
            first, self._refusing = not self._refusing, True
            pending = self._pending_bytes
        if first:  # (a bound below one write's frames refused every write, counted and never said)
            log.warning("%s: a write in the background (ingest wait=False) of %d bytes of frames was refused: it "
                        "would pass max_pending_bytes (%d) beside the %d bytes waiting to be sent; its blocks are "
                        "answered failed (client_stats()['write_behind']['blocks_refused']; said once a run)",
                        self.owner, nbytes, self.max_bytes, pending)
        return False

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def submit(self, nbytes: int, send: Callable[[], Any], handover: Handover | None = None) -> Future:
        """Queue ``send`` (room for ``nbytes`` reserved already); its answer, or what it
        raised, in the returned future. A queued write is sent: the future is running from
        the start, so ``cancel()`` answers False (the executor's own future, cancelled,
        skipped the write and with it the return of its room and its host buffers). A caller
        that gives the room back when this raises claims ``handover`` first (see ``Handover``)."""
        handover = handover if handover is not None else Handover()
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                # (a write under way in one thread while another closed the cache: the error
                # of any call after close)
                raise RuntimeError(f"{self.owner}: closed (close() was called, or its with block ended); "
                                   "make a new one")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheseek-write-behind")
                _open.add(self)
            self._executor.submit(self._run, send, nbytes, future, handover)
            self._futures.add(future)
            self.counts["writes_queued"] += 1
            handover.counted = True
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)

    def _run(self, send: Callable[[], Any], nbytes: int, future: Future, handover: Handover) -> None:
        if not handover.claim():  # taken back by its caller, interrupted as it queued it: not sent
            with self._lock:
                if handover.counted:
                    self.counts["writes_done"] += 1
            future.set_exception(RuntimeError("not sent: the call that queued this write was interrupted, "
                                              "and took it back"))
            return
        with self._lock:
            self._sender = threading.get_ident()
            exit_cut = self._exit_cut
        if exit_cut is not None and self._cut_off is not None:  # (the exit hook came before this thread ran)
            self._cut_off(exit_cut, thread=self._sender)
        try:
            result = send()
        except BaseException as exc:  # (the future holds it, as the executor's would)
            self._done(nbytes, exc)
            future.set_exception(exc)
        else:
            self._done(nbytes)
            future.set_result(result)

    def _done(self, nbytes: int, error: BaseException | None = None) -> None:
        """Before the future is done: whoever waited for it sees the room given back, and
        the write counted."""
        with self._lock:
            self._pending_bytes -= nbytes
            self.counts["writes_done"] += 1
            if self._exit_cut is not None and time.monotonic() >= self._exit_cut:
                self._cut_done += 1  # (ended by the cut at exit: failed, or answered as a miss)
            first = error is not None and not self._failing
            self._failing = error is not None
            if error is not None:
                self.counts["writes_failed"] += 1
                self.last_error = f"{type(error).__name__}: {error}"
        if first:
            log.warning("a write in the background (ingest wait=False) failed, %s; its future holds the error, and "
                        "the failures that follow are counted in client_stats()['write_behind'] until one succeeds",
                        self.last_error)

    def count_late_lookup(self) -> None:
        """A write's lookup made first (``look_up_first``) not answered within its wait: the
        write encoded every block instead."""
        with self._lock:
            self.counts["lookups_first_late"] += 1

    def count_failed_blocks(self, n: int) -> None:
        """Blocks a write answered failed (the server's reports, or an outage's drop)."""
        with self._lock:
            self.counts["blocks_failed"] += n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every write queued before this call; False if ``timeout`` seconds
        passed first."""
        with self._lock:
            futures = list(self._futures)
        return not wait(futures, timeout=timeout).not_done

    def close(self, timeout: float | None = None) -> None:
        """Send everything queued, then stop the sender; with ``timeout`` (and ``cut_off``),
        what is not answered ``timeout`` seconds from now is cut, and fails. A second caller
        (another thread) returns once the first has: returning at once, its caller closed the
        connections under the writes still being sent."""
        with self._lock:
            first = not self._closed
            executor, self._executor, self._closed = self._executor, None, True
        if not first:
            self._sent.wait()
            return
        try:
            if executor is not None:
                if timeout is not None:
                    self._cut_off_at(time.monotonic() + timeout)
                    if not self.flush(timeout):
                        # (an exchange under way is held to the cutoff at its next read, which
                        # a read blocked for up to the cache's timeout would not reach soon)
                        self._cut_off_at(time.monotonic())
                executor.shutdown(wait=True)
        finally:
            _open.discard(self)
            self._sent.set()

    def dropped_at_exit(self) -> int:
        """The writes the cut at interpreter exit drops: those it ended, and those still queued."""
        with self._lock:
            return self._cut_done + self.counts["writes_queued"] - self.counts["writes_done"]

    def exiting_here(self) -> bool:
        """Whether this is the sender, cut at interpreter exit (its failures are the cut's)."""
        return self._exit_cut is not None and threading.get_ident() == self._sender

    def _cut_off_at(self, when: float, *, sender_only: bool = False) -> int:
        """The exchanges under way that the cut could not end (``cut_off``'s answer)."""
        if self._cut_off is None:
            return 0
        if not sender_only:
            return self._cut_off(when) or 0
        with self._lock:
            self._exit_cut = when if self._exit_cut is None else min(self._exit_cut, when)
            sender = self._sender
        if sender is not None:  # (else the sender applies it as it begins its next write)
            return self._cut_off(when, thread=sender) or 0
        return 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "writes_pending": self.counts["writes_queued"] - self.counts["writes_done"],
                    "pending_bytes": self._pending_bytes, "max_pending_bytes": self.max_bytes,
                    "last_error": self.last_error}


__all__ = ["WriteBehind"]
