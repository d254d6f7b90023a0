"""What request bodies may hold: a cap on body bytes in flight over all requests, and the
memory given back once a burst of bodies is gone.

Memory follows bytes that arrive, never bytes that are declared: a body's bytes are counted
here as they are received (into a CPU-tier reservation or a buffer of their own) and given
back when the frame is stored or the request ends. A request whose bytes would pass the cap
is answered 503 (``Busy``), and the rest of its body is skipped as it comes (the connection lives
on for the next request); nothing already stored changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

from .errors import Busy

log = logging.getLogger("cacheseek.server")

TRIM_AFTER_BYTES = 64 << 20  # bodies given back unstored before memory is handed to the OS
# A batch's frame costs the server ~2.3 KiB beside its bytes until the batch is stored (its
# parsed header, checksum and bookkeeping, measured on CPython 3.11): a frame counts at least
# this many body bytes, or a batch of many tiny frames held 6x its body. (Only below it: a
# body of real frames, each far larger, counts its bytes, so one at max_body_bytes still fits.)
FRAME_MIN_BYTES = 4096


class BodyBudget:
    """Request-body bytes received and not yet stored, over every request, under ``limit``.

    ``release_memory`` (called with no lock held, on the caller's thread) runs once the bytes in
    flight fall to zero after at least ``TRIM_AFTER_BYTES`` were given back unstored (aborted
    uploads, rejected frames): it hands freed memory back to the OS."""

    def __init__(self, limit: int, release_memory: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self.refused = 0
        self._dropped = 0  # bytes given back unstored since memory was last released
        self._release_memory = release_memory
        # The routes call in from the event loop, between awaits; the lock keeps the
        # counts whole for a caller on a worker thread all the same (cheap, uncontended).
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Refuse a new body at once when the cap is already reached (no byte of it read)."""
        if self.in_flight >= self.limit:
            with self._lock:
                self.refused += 1
            raise Busy(f"{self.in_flight} bytes of request bodies are in flight "
                       f"(max_inflight_body_bytes {self.limit}); retry later")

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` just received; ``Busy`` (and nothing counted) past the cap."""
        with self._lock:
            if self.in_flight + nbytes > self.limit:
                self.refused += 1
                raise Busy(f"request bodies in flight would pass max_inflight_body_bytes ({self.limit}); retry later")
            self.in_flight += nbytes
            self.peak = max(self.peak, self.in_flight)

    def give(self, nbytes: int, *, stored: bool) -> None:
        """Uncount ``nbytes`` of a body: stored (they now count as the tier's) or dropped."""
        if nbytes <= 0:
            return
        with self._lock:
            self.in_flight -= nbytes
            if not stored:
                self._dropped += nbytes
            release = self.in_flight == 0 and self._dropped >= TRIM_AFTER_BYTES
            if release:
                self._dropped = 0
        if release and self._release_memory is not None:
            self._release_memory()

    def stats(self) -> dict[str, int]:
        return {"in_flight_bytes": self.in_flight, "peak_bytes": self.peak, "limit_bytes": self.limit,
                "refused": self.refused}


class BodyBytes:
    """One request's share of the budget: what it has taken, given back once (``close``)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0

    def take(self, nbytes: int) -> None:
        self.budget.take(nbytes)
        self.held += nbytes

    def settle(self, nbytes: int, *, stored: bool) -> None:
        """Give back ``nbytes`` of what this request holds (a frame stored, or dropped)."""
        nbytes = min(nbytes, self.held)
        self.held -= nbytes
        self.budget.give(nbytes, stored=stored)

    def unread(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken for a read that did not get them (a body that ended):
        no memory held them, so nothing for ``release_memory`` to hand back."""
        self.settle(nbytes, stored=True)

    def close(self) -> None:
        """Give back whatever is still held: the request ended without storing it."""
        self.settle(self.held, stored=False)


def trim_heap() -> bool:
    """``malloc_trim(0)``: glibc returns the free pages of its heaps to the OS (the server
    raises glibc's mmap threshold so frame buffers are reused warm, which also keeps them
    after a burst). False where this is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
