"""Leases: memory lent to a reader or a copy, given back exactly once.

One API for every piece of memory that outlives the call that handed it out: a CPU-tier
slot read by a materialize or streamed by the server (``HostArena.lease``), a pooled read
buffer of the disk tier (``direct_io.BufferPool.take``), a staging buffer of the data path
on a device (``device_staging.DeviceStagingPool.take``: there release is stream-ordered). The lender decides
what release means (a slot becomes reusable once all its leases are released; a buffer
goes back to its pool); the holder only promises to release once, when done with the
bytes, in a ``with`` block or a ``finally``.

Rules:
- The bytes a lease covers stay valid, and are never reused by the lender, until it is
  released. Views of them taken while it is held must not be used after.
- ``release()`` a second time raises ``LeaseError`` (and is counted: ``double_releases``):
  a double release is a bug in the holder, and an error says where.
- ``with lease:`` releases on exit unless the block released it already.
- A lease dropped without a release keeps its memory lent for good; the ledger shows it
  (``active``, ``active_bytes``). Nothing is inferred from reference counts.

Torch-free, thread-safe: a lease may be released from any thread, and from two at once
(one gives it back; the other raises ``LeaseError``, or with ``with``/``release_all``
finds it released and does nothing).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger("cacheseek.store")

class LeaseError(RuntimeError):
    """A lease was released twice."""


class Lender(Protocol):
    """What lends memory with leases: ``ledger`` counts them, ``lease_released`` takes one back."""

    @property
    def ledger(self) -> LeaseLedger: ...

    def lease_released(self, token: Any, nbytes: int) -> None:
        """A lease on ``token`` (the lender's handle: a slot, a buffer) was released."""


class LeaseLedger:
    """The counts of one lender's leases (stats are data: read them with :meth:`stats`).
    A lender updates them under its own lock (``granted``, ``released``), so a lease costs no
    lock of its own; a ledger used on its own (:meth:`grant`) is its own lender."""

    __slots__ = ("_lock", "active", "active_bytes", "granted", "double_releases")

    def __init__(self) -> None:
        # Taken by each release's claim on its lease (``Lease._take``: held for a swap, never
        # around the lender's call), by double releases, and for leases granted by ``grant``.
        self._lock = threading.Lock()
        self.active = 0  # leases granted and not released
        self.active_bytes = 0  # bytes they cover
        self.granted = 0  # leases granted, ever
        self.double_releases = 0  # releases refused: the lease was released already

    @property
    def ledger(self) -> LeaseLedger:
        return self

    def on_grant(self, nbytes: int) -> None:
        """Count a lease granted (under the lender's lock)."""
        self.active += 1
        self.active_bytes += nbytes
        self.granted += 1

    def on_release(self, nbytes: int) -> None:
        """Count a lease released (under the lender's lock)."""
        self.active -= 1
        self.active_bytes -= nbytes

    def on_double_release(self) -> None:
        with self._lock:
            self.double_releases += 1

    def grant(self, nbytes: int, on_release: Callable[[], None]) -> Lease:
        """A lease on ``nbytes`` lent by this ledger itself: ``on_release`` runs once, at its release."""
        with self._lock:
            self.on_grant(nbytes)
        return Lease(self, nbytes, on_release)

    def lease_released(self, token: Any, nbytes: int) -> None:
        with self._lock:
            self.on_release(nbytes)
        token()

    def stats(self) -> dict[str, int]:
        """The counts (read under the lender's lock for a consistent set)."""
        return {"leases_active": self.active, "leased_bytes": self.active_bytes,
                "leases_granted": self.granted, "lease_double_releases": self.double_releases}


_GONE = object()  # ``Lease._take``'s answer once the token was taken

_Self = TypeVar("_Self", bound="Lease")  # (typing.Self: Python 3.11; the package runs on 3.10)


class Lease:
    """``nbytes`` of a lender's memory (``token``: the lender's handle on it), lent until
    :meth:`release`, exactly once."""

    __slots__ = ("nbytes", "_lender", "_token", "_released")

    def __init__(self, lender: Lender, nbytes: int, token: Any) -> None:
        self.nbytes = nbytes
        self._lender = lender
        self._token = token
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the memory back. Raises ``LeaseError`` if it was given back already."""
        token = self._take()
        if token is _GONE:
            self._lender.ledger.on_double_release()
            raise LeaseError(f"a lease on {self.nbytes} bytes was released twice (a lease is released exactly once)")
        self._lender.lease_released(token, self.nbytes)

    def release_if_held(self) -> bool:
        """Give the memory back unless it was given back already (by this thread or another);
        whether this call gave it back. For ``with`` and ``release_all``: a release that
        reads ``released`` and then releases raises when another thread releases between."""
        token = self._take()
        if token is _GONE:
            return False
        self._lender.lease_released(token, self.nbytes)
        return True

    def _take(self) -> Any:
        """The token, once: ``_GONE`` to every later caller, in whichever thread. Under the
        ledger's lock: two threads both past an unlocked check both gave the token back
        (a slot's lease count dropped for a lease another reader holds, freeing its bytes
        under it), or one gave back the None the other had left."""
        with self._lender.ledger._lock:
            if self._released:
                return _GONE
            self._released = True
            token, self._token = self._token, None
        return token

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release_if_held()

    def __repr__(self) -> str:
        return f"Lease({self.nbytes} bytes, {'released' if self._released else 'held'})"


_L = TypeVar("_L", bound="Lease | None")  # a list of StagingLease is not a list[Lease | None]


def release_all(leases: list[_L]) -> None:
    """Release every lease of ``leases`` not released yet (None entries skipped), even if one
    release raises; the first error is raised after all were tried. Empties the list."""
    error: BaseException | None = None
    for lease in leases:
        if lease is None:
            continue
        try:
            lease.release_if_held()
        except BaseException as exc:  # noqa: BLE001 - the others must still be released
            error = error or exc
    leases.clear()
    if error is not None:
        raise error


class Finalizer:
    """Where a handle's ``__del__`` gives its leases back when the cyclic garbage collector
    runs it. The collector runs in whichever thread allocated when it triggered, possibly
    one inside a tier call, holding that tier's lock, which a release takes again: released
    there, the thread deadlocked (and every call on the tier after it). ``__del__`` asks
    :meth:`in_collection` and then hands the release to a thread of this one's (``submit``:
    a ``SimpleQueue``'s put is safe in a finalizer); a handle dropped by its last reference
    (no cycle) still gives its memory back at once, in the thread that dropped it.
    ``ready()``: from ordinary code (a handle's constructor), since a finalizer cannot start
    a thread (that takes locks of ``threading``'s own)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._collecting = threading.local()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        self._collecting.on = phase == "start"

    def in_collection(self) -> bool:
        """Whether the cyclic collector is running in this thread (its finalizers, now)."""
        return getattr(self._collecting, "on", False)

    def ready(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        with self._start:
            if self._thread is None or not self._thread.is_alive():  # (none yet, or a forked child's)
                self._thread = threading.Thread(target=self._run, name="cacheseek-finalizer", daemon=True)
                self._thread.start()

    def submit(self, release: Callable[[], None]) -> None:
        self._queue.put(release)  # (no lock here: the collector may run in a thread holding any)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until what was submitted before has run (stats read then count it given
        back); False if it has not within ``timeout``."""
        self.ready()
        done = threading.Event()
        self._queue.put(done.set)  # (one thread, first in first out: run after the rest)
        return done.wait(timeout)

    def run(self, release: Callable[[], None]) -> None:
        """Run a dropped handle's ``release`` here: a finalizer has no caller to raise to, so
        a failure is logged with its traceback (the memory it held stays lent, and the
        ledger's ``active`` counts alone would not say why)."""
        try:
            release()
        except Exception:  # noqa: BLE001 - (logged: nobody to raise to)
            with contextlib.suppress(Exception):  # (logging itself may be gone at interpreter exit)
                log.exception("giving back the memory of a dropped handle failed (%s): its leases stay active",
                              getattr(release, "__qualname__", release))

    def _run(self) -> None:
        while True:
            self.run(self._queue.get())


finalizer = Finalizer()


class Handover:
    """Which side undoes work handed to another thread, decided once: the caller, if the call
    that queues the work raises before the worker begins it, else the worker. An interrupt
    can land after an executor has taken the work (in its ``submit``'s tail): a caller that
    then undid it (a write's host buffers given back, a prefetch's blocks no longer in
    flight) raced a worker that went on with it. ``list.pop`` is one step under the GIL:
    whichever side takes the token first owns the work, and the other leaves it be."""

    __slots__ = ("_token", "counted")

    def __init__(self) -> None:
        self._token = [True]
        self.counted = False  # (the work counted as queued: where abandoned, counted as done)

    def claim(self) -> bool:
        try:
            self._token.pop()
        except IndexError:
            return False
        return True


__all__ = ["Finalizer", "Handover", "Lease", "LeaseError", "LeaseLedger", "Lender", "finalizer", "release_all"]
