"""The circuit breaker and its backoffs, on a fake clock."""

import threading

import pytest

from cacheseek.errors import ConfigError
from cacheseek.store.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, ConstantBackoff, ExponentialBackoff


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_exponential_backoff_doubles_up_to_its_cap():
    b = ExponentialBackoff(base_seconds=0.5, cap_seconds=4.0)
    assert [b.compute(n) for n in range(0, 7)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.compute(10_000) == 4.0  # no overflow for a breaker open for days
    assert ExponentialBackoff(base_seconds=1, cap_seconds=100, factor=3).compute(3) == 9
    assert ConstantBackoff(2.5).compute(1) == ConstantBackoff(2.5).compute(9) == 2.5


@pytest.mark.parametrize("kw", [dict(base_seconds=0), dict(base_seconds=2, cap_seconds=1), dict(factor=0.5)])
def test_bad_backoffs_name_the_setting(kw):
    with pytest.raises(ConfigError, match="backoff"):
        ExponentialBackoff(**kw)


def test_opens_after_the_threshold_and_refuses_until_the_backoff_passes():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=3, backoff=ExponentialBackoff(base_seconds=1, cap_seconds=8), clock=clock)
    for _ in range(2):
        assert br.allow()
        br.record_failure()
    assert br.state == CLOSED
    assert br.allow()
    br.record_failure()
    assert br.state == OPEN
    assert not br.allow() and not br.allow()
    assert br.stats().rejected_total == 2
    assert br.stats().retry_in_seconds == pytest.approx(1.0)
    clock.advance(0.999)
    assert not br.allow()
    clock.advance(0.001)
    assert br.allow()  # the probe
    assert br.state == HALF_OPEN
    assert not br.allow()  # only one probe at a time


def test_a_failed_probe_reopens_with_a_longer_backoff_and_a_success_closes():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=1, backoff=ExponentialBackoff(base_seconds=1, cap_seconds=4), clock=clock)
    br.record_failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not br.allow():
            clock.advance(0.25)
        waits.append(clock.now - start)
        br.record_failure()  # the probe fails
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert br.stats().trips == 5 and br.stats().opened_total == 5
    clock.advance(4)
    assert br.allow()
    br.record_success()
    s = br.stats()
    assert (s.state, s.consecutive_failures, s.trips) == (CLOSED, 0, 0)
    assert br.allow() and br.allow()
    br.record_failure()  # threshold 1: one failure opens it again, at the base backoff
    assert br.state == OPEN and br.stats().retry_in_seconds == pytest.approx(1.0)


def test_a_call_that_was_never_sent_counts_neither_way_and_hands_the_probe_on():
    """A call the caller itself could not send (its connection pool full) says nothing of
    the backend: no failure toward the threshold, and a probe's turn goes to the next call."""
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=2, backoff=ConstantBackoff(1), clock=clock)
    for _ in range(5):
        assert br.allow()
        br.record_unsent()
    assert br.state == CLOSED and br.stats().consecutive_failures == 0
    br.record_failure()
    br.record_failure()
    assert br.state == OPEN
    clock.advance(1)
    assert br.allow() and br.state == HALF_OPEN
    br.record_unsent()
    assert br.state == OPEN and br.allow()  # the next call probes at once, not a backoff later
    br.record_success()
    assert br.state == CLOSED


def test_a_success_resets_the_failure_count():
    br = CircuitBreaker(failure_threshold=3, clock=FakeClock())
    for _ in range(5):
        br.record_failure()
        br.record_failure()
        br.record_success()
    assert br.state == CLOSED


def test_a_probe_that_never_reports_is_replaced_after_the_probe_timeout():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(2.0), probe_timeout_seconds=10.0, clock=clock)
    br.record_failure()
    clock.advance(2)
    assert br.allow()  # this probe's caller vanishes
    assert not br.allow()
    clock.advance(2)
    assert not br.allow()  # (a probe in flight for longer than the backoff is no reason for another)
    clock.advance(7)
    assert not br.allow()
    clock.advance(1)  # the probe's timeout since it went
    assert br.allow()
    br.record_success()
    assert br.state == CLOSED


def test_late_failures_while_open_do_not_extend_the_open_period():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(1.0), clock=clock)
    br.record_failure()
    clock.advance(0.9)
    br.record_failure()  # a call allowed before the breaker opened fails now
    clock.advance(0.1)
    assert br.allow()


def test_threads_see_one_probe():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(1.0), clock=clock)
    br.record_failure()
    clock.advance(1)
    allowed = []
    barrier = threading.Barrier(8)

    def ask() -> None:
        barrier.wait()
        allowed.append(br.allow())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 7 + [True]


def test_bad_threshold_is_a_config_error():
    with pytest.raises(ConfigError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ConfigError, match="probe_timeout_seconds"):
            CircuitBreaker(probe_timeout_seconds=bad)


def test_a_call_allowed_before_the_breaker_opened_is_not_taken_for_the_probe():
    """A hung backend: calls allowed while closed each time out late. Taken as the half-open
    probe's outcome, each late failure re-opened the breaker (one more trip, a doubled
    backoff) while the probe was in flight, and a late success closed an open breaker."""
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=3, backoff=ExponentialBackoff(base_seconds=1, cap_seconds=30), clock=clock)
    early = [br.allow_call() for _ in range(8)]
    assert all(early)
    clock.advance(10)
    for t in early[:3]:
        br.record_failure(t)
    assert br.state == OPEN and br.stats().trips == 1
    clock.advance(1)
    probe = br.allow_call()
    assert probe is not None and br.state == HALF_OPEN
    for t in early[3:7]:
        br.record_failure(t)  # late, from before the open
    assert br.state == HALF_OPEN and br.stats().trips == 1 and br.stats().opened_total == 1
    assert br.allow_call() is None  # still one probe at a time
    br.record_unsent(early[7])  # a stale unsent hands no probe's turn on
    assert br.state == HALF_OPEN
    br.record_success(probe)
    assert br.state == CLOSED and br.stats().trips == 0
    # the probe fails instead: one more trip, and a stale success does not close it
    for t in [br.allow_call() for _ in range(3)]:
        br.record_failure(t)
    stale = [br.allow_call()]  # refused (open): None
    assert stale == [None]
    clock.advance(1)
    probe = br.allow_call()
    br.record_failure(probe)
    assert br.state == OPEN and br.stats().trips == 2
    older = early[0]
    br.record_success(older)
    assert br.state == OPEN and br.stats().trips == 2


def test_reports_without_a_ticket_keep_the_old_rules():
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(1), clock=clock)
    assert br.allow() and br.allow()
    br.record_failure()
    clock.advance(1)
    assert br.allow() and br.state == HALF_OPEN
    br.record_failure()  # no ticket: as the probe's
    assert br.state == OPEN and br.stats().opened_total == 2
