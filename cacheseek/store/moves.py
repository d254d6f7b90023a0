"""``Moves``: the writes of a store that may hand evicted blocks down a tier, so that a
read never misses a block on its way down.

A tier evicts a victim under its own lock and hands it back; the store then puts it into
the tier below (demotion). Between the two the block is in neither tier, for as long as
the write below takes (a file written, a Redis round trip). A write-back store promises
that an acknowledged block can be read until it leaves the last tier, so a read that finds
a key nowhere asks ``Moves`` whether any such write overlapped it, waits for those writes
to end, and looks once more. A read that no write overlapped is a genuine miss and waits
for nothing, so a store without demotion (write-through everywhere) pays nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# How long a read waits for the writes that overlapped it before it gives the miss as it
# is: far longer than a demotion (a frame written to disk or Redis), short enough that a
# wedged tier below cannot hold readers.
WAIT_S = 5.0
# How many times a walk of many blocks (a chain) looks again: under steady eviction each look
# can meet another of its blocks on the way down, each one settled by the look after it.
MAX_WALKS = 8


class Moves:
    """Count the writes that may demote (``moving``) so that a read can tell whether one
    overlapped it (``mark``, then ``overlapped``)."""

    def __init__(self) -> None:
        # Taken through the plain lock: ``Condition.__exit__`` is Python, and an interrupt at
        # its start left the lock held (every other thread's write blocked).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._started = 0
        self._active: set[int] = set()

    @contextmanager
    def moving(self) -> Iterator[None]:
        """Around a write that may evict from one tier and put the victims into the next."""
        ticket = None
        try:  # (entered inside the ``try``: an interrupt as the lock is let go leaves no write running)
            with self._lock:
                ticket = self._started
                self._started += 1
                self._active.add(ticket)
            yield
        finally:
            if ticket is not None:
                with self._lock:
                    self._active.discard(ticket)
                    self._cond.notify_all()

    def mark(self) -> tuple[int, int]:
        """Taken before a read looks at the tiers: (writes started, writes running)."""
        with self._lock:
            return self._started, len(self._active)

    def overlapped(self, mark: tuple[int, int], timeout: float = WAIT_S) -> bool:
        """After a read missed: whether a write that may demote ran at some point since
        ``mark`` (already running then, or started since); if so, wait until every write
        started before now has ended (or ``timeout``), and the read should look again."""
        started, running = mark
        with self._lock:
            upto = self._started
            if not running and upto == started:
                return False
            self._wait_before(upto, timeout)
            return True

    def settle(self, timeout: float = WAIT_S) -> None:
        """Wait until every write started before now has ended (or ``timeout``): the blocks
        they had on their way down are in the next tier, or gone for good."""
        with self._lock:
            self._wait_before(self._started, timeout)

    def _wait_before(self, upto: int, timeout: float) -> None:
        self._cond.wait_for(lambda: all(t >= upto for t in self._active), timeout)
