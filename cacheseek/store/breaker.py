"""A circuit breaker, and the backoff that decides how long it stays open.

A backend that is down (or hangs) would otherwise make every request pay a connect or
socket timeout. The breaker counts consecutive failures and, past a threshold, refuses
calls at once for a while:

    closed ──(failure_threshold consecutive failures)──▶ open
    open ──(backoff.compute(trips) seconds later: the next call is the probe)──▶ half_open
    half_open ──(probe succeeds)──▶ closed        half_open ──(probe fails)──▶ open, trips + 1

While half-open, only the probe goes through; every other call is refused as if open,
however long the probe takes (a hung backend holds it for a whole timeout, often longer
than the backoff). A probe that never reports back (its caller died) is replaced by a new
one after ``probe_timeout_seconds`` (longer than any call should take), so the breaker
cannot wedge half-open.

A call allowed before the breaker last opened may report long after (a hung backend: each
call waits out its own timeout). Its outcome says nothing of the backend now, and taken as
the probe's it re-opened a half-open breaker (one more trip: a doubled backoff) while the
probe was still in flight, once per such call. Callers that hold the :class:`Ticket`
``allow_call`` gives and hand it back to ``record_*`` have such late reports ignored.

Backoffs are value objects with one method, ``compute(failures) -> seconds`` (the
redis-py shape); the clock is injected, so tests drive time by hand.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class Backoff(Protocol):
    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (``failures >= 1``)."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantBackoff:
    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ConfigError(f"backoff seconds: must be >= 0, got {self.seconds!r}")

    def compute(self, failures: int) -> float:
        return self.seconds


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """``base_seconds * factor ** (failures - 1)``, capped at ``cap_seconds``."""

    base_seconds: float = 1.0
    cap_seconds: float = 30.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        # A finite cap: an infinite one kept a breaker open for good, its retry_in_seconds inf
        # (no JSON number: a server's /v1/stats answered 500).
        if not (self.base_seconds > 0 and math.isfinite(self.cap_seconds) and self.cap_seconds >= self.base_seconds
                and self.factor >= 1):
            raise ConfigError(
                "backoff: need base_seconds > 0, a finite cap_seconds >= base_seconds and factor >= 1, got "
                f"base_seconds={self.base_seconds!r}, cap_seconds={self.cap_seconds!r}, factor={self.factor!r}"
            )

    def compute(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        # Stop growing before the float overflows: the cap is reached long before.
        exponent = min(failures - 1, 64)
        return min(self.cap_seconds, self.base_seconds * self.factor**exponent)


@dataclass(frozen=True, slots=True, eq=False)
class Ticket:
    """An allowed call, for its report: how many times the breaker had opened when it was
    allowed (a report of a call allowed before the last open is stale)."""

    opened: int


@dataclass(frozen=True, slots=True)
class BreakerStats:
    state: str
    consecutive_failures: int
    trips: int  # times opened since the last success (the backoff's ``failures``)
    opened_total: int
    rejected_total: int
    retry_in_seconds: float  # until the next probe is let through; 0 unless open

    def to_dict(self) -> dict[str, object]:
        return {
            "state": self.state, "consecutive_failures": self.consecutive_failures, "trips": self.trips,
            "opened_total": self.opened_total, "rejected_total": self.rejected_total,
            "retry_in_seconds": round(self.retry_in_seconds, 3),
        }


class CircuitBreaker:
    """Thread-safe. Callers ask :meth:`allow_call` (or :meth:`allow`) before a call, then
    report exactly one of :meth:`record_success`, :meth:`record_failure` or
    :meth:`record_unsent` for every allowed call, with its ticket where they have it."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        backoff: Backoff | None = None,
        probe_timeout_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(failure_threshold, int) and failure_threshold >= 1):
            raise ConfigError(f"failure_threshold: must be an int >= 1, got {failure_threshold!r}")
        if isinstance(probe_timeout_seconds, bool) or not (isinstance(probe_timeout_seconds, (int, float))
                                                           and probe_timeout_seconds > 0):
            raise ConfigError(f"probe_timeout_seconds: must be a number of seconds > 0, got {probe_timeout_seconds!r}")
        self.probe_timeout_seconds = probe_timeout_seconds
        self.failure_threshold = failure_threshold
        self.backoff = backoff if backoff is not None else ExponentialBackoff()
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._trips = 0
        self._opened_at = 0.0
        self._probe_at = 0.0
        self._opened_total = 0
        self._rejected_total = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def allow_call(self) -> Ticket | None:
        """A ticket if a call may go to the backend now (hand it to its ``record_*``), else
        None. A refused call is counted."""
        with self._lock:
            ticket = Ticket(self._opened_total)
            if self._state == CLOSED:
                return ticket
            now = self._clock()
            wait = self.backoff.compute(self._trips)
            if self._state == OPEN and now - self._opened_at >= wait:
                self._state = HALF_OPEN
                self._probe_at = now
                return ticket
            if self._state == HALF_OPEN and now - self._probe_at >= max(wait, self.probe_timeout_seconds):
                self._probe_at = now  # the last probe never reported: let another through
                return ticket
            self._rejected_total += 1
            return None

    def allow(self) -> bool:
        """Whether a call may go to the backend now (``allow_call`` without its ticket)."""
        return self.allow_call() is not None

    def _stale(self, ticket: Ticket | None) -> bool:
        # (under the lock) allowed before the last open: its outcome is no news of the backend now
        return ticket is not None and ticket.opened != self._opened_total

    def record_success(self, ticket: Ticket | None = None) -> None:
        with self._lock:
            if self._stale(ticket):
                return
            self._state = CLOSED
            self._failures = 0
            self._trips = 0

    def record_unsent(self, ticket: Ticket | None = None) -> None:
        """An allowed call that never reached the backend (the caller's own limit: a full
        connection pool): neither a success nor a failure. A probe's turn goes to the next call."""
        with self._lock:
            if self._state == HALF_OPEN and not self._stale(ticket):
                self._state = OPEN  # opened at least a backoff ago: the next allow() probes

    def record_failure(self, ticket: Ticket | None = None) -> None:
        with self._lock:
            if self._stale(ticket):
                return
            self._failures += 1
            if self._state == HALF_OPEN or (self._state == CLOSED and self._failures >= self.failure_threshold):
                self._open()
            # Already open (a call reported without its ticket, allowed before the breaker
            # opened, failed late): the open period is not extended for it.

    def _open(self) -> None:
        self._state = OPEN
        self._trips += 1
        self._opened_at = self._clock()
        self._opened_total += 1

    def stats(self) -> BreakerStats:
        with self._lock:
            retry_in = 0.0
            if self._state == OPEN:
                retry_in = max(0.0, self._opened_at + self.backoff.compute(self._trips) - self._clock())
            return BreakerStats(
                state=self._state, consecutive_failures=self._failures, trips=self._trips,
                opened_total=self._opened_total, rejected_total=self._rejected_total, retry_in_seconds=retry_in,
            )


__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "Backoff", "BreakerStats", "CircuitBreaker", "ConstantBackoff",
           "ExponentialBackoff", "Ticket"]
