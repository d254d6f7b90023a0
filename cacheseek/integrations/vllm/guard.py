"""Calls into the store that must never fail a request.

An error (server down, timed out, a tier that failed) is logged and counted, and the
caller treats it as a miss: the scheduler offers no tokens, the worker reports the blocks
it could not load so vLLM recomputes them, a save is dropped. After a remote failure the
server is not asked again for a while (a circuit breaker, doubling its wait up to a cap),
so a server that is down or hangs costs one timeout, not one per request. ``allow`` gives
a ticket to hand back with the call's outcome: a call allowed before the server last failed
that fails late (each waits out its timeout) is no news of the server now, and, taken as
the resting guard's probe, doubled its rest while the probe ran.
"""

from __future__ import annotations

import logging

from ...log_throttle import LogThrottle
from ...store.breaker import CircuitBreaker, ExponentialBackoff, Ticket
from ...tls import untrusted_certificate
from .config import ConnectorConfig

log = logging.getLogger("cacheseek.integrations.vllm")

LOG_SECONDS = 10.0  # a failure is said at once, then at most once per this many seconds


class StoreGuard:
    def __init__(self, config: ConnectorConfig, side: str) -> None:
        self.side = side
        self.breaker = None
        if config.remote:
            backoff = ExponentialBackoff(base_seconds=config.retry_after_seconds, cap_seconds=config.retry_cap_seconds)
            self.breaker = CircuitBreaker(failure_threshold=1, backoff=backoff)
        # Calls allowed before the server failed fail together (a burst of new requests'
        # lookups behind a hung server, each late at its deadline): a line each buried the log.
        self._said = LogThrottle(LOG_SECONDS)

    def allow(self) -> Ticket | None:
        """A ticket if the store may be called now (hand it to ``success`` or ``failure``),
        None while a failed server rests."""
        return _EMBEDDED if self.breaker is None else self.breaker.allow_call()

    def rest_seconds(self) -> float:
        """How long a failed server still rests (0: ``allow`` would let a call through)."""
        return 0.0 if self.breaker is None else self.breaker.stats().retry_in_seconds

    def success(self, ticket: Ticket | None = None) -> None:
        if self.breaker is not None:
            self.breaker.record_success(ticket)

    def unsent(self, ticket: Ticket | None = None) -> None:
        """An allowed call that was never made (cancelled while it waited for a thread):
        neither a success nor a failure; a probe's turn goes to the next call."""
        if self.breaker is not None:
            self.breaker.record_unsent(ticket)

    def failure(self, what: str, exc: BaseException, ticket: Ticket | None = None) -> None:
        if self.breaker is not None:
            self.breaker.record_failure(ticket)
        # RemoteCache's own advice names its verify=, which a vLLM user never calls
        hint = ("; the server's TLS certificate is not trusted: give kv_connector_extra_config.ca_bundle the CA "
                "bundle (PEM) that signed it, or set SSL_CERT_FILE" if untrusted_certificate(exc) else "")
        count = self._said.due()
        if count:
            also = f" (and {count - 1} more failed calls since the last line)" if count > 1 else ""
            log.warning("cacheseek %s: %s failed (%s: %s)%s%s; vLLM computes instead", self.side, what,
                        type(exc).__name__, exc, hint, also)


_EMBEDDED = Ticket(0)  # (an embedded cache has no breaker: every call allowed)

__all__ = ["StoreGuard"]
