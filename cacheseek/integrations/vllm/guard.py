"""Calls into the store that must never fail a request.

An error (server down, timed out, a tier that failed) is logged and counted, and the
caller treats it as a miss: the scheduler offers no tokens, the worker reports the blocks
it could not load so vLLM recomputes them, a save is dropped. After a remote failure the
server is not asked again for a while (a circuit breaker, doubling its wait up to a cap),
so a server that is down or hangs costs one timeout, not one per request.
"""

from __future__ import annotations

import logging

from ...store.breaker import CircuitBreaker, ExponentialBackoff
from .config import ConnectorConfig

log = logging.getLogger("cacheseek.integrations.vllm")


class StoreGuard:
    def __init__(self, config: ConnectorConfig, side: str) -> None:
        self.side = side
        self.breaker = None
        if config.remote:
            backoff = ExponentialBackoff(base_seconds=config.retry_after_seconds, cap_seconds=config.retry_cap_seconds)
            self.breaker = CircuitBreaker(failure_threshold=1, backoff=backoff)

    def allow(self) -> bool:
        """Whether to call the store now (False while a failed server rests)."""
        return self.breaker is None or self.breaker.allow()

    def resting(self) -> bool:
        """Whether a failed server rests now (``allow`` would refuse); asks and counts nothing."""
        return self.rest_seconds() > 0

    def rest_seconds(self) -> float:
        """How long a failed server still rests (0: ``allow`` would let a call through)."""
        return 0.0 if self.breaker is None else self.breaker.stats().retry_in_seconds

    def success(self) -> None:
        if self.breaker is not None:
            self.breaker.record_success()

    def failure(self, what: str, exc: BaseException) -> None:
        if self.breaker is not None:
            self.breaker.record_failure()
        log.warning("cacheseek %s: %s failed (%s: %s); vLLM computes instead", self.side, what,
                    type(exc).__name__, exc)


__all__ = ["StoreGuard"]
