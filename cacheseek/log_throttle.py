"""How often a repeated event is said in the log: the first at once, then at most once per
period, with how many came since the last line (a full disk fails every write, a hostile
client sends malformed requests by the thousand: a line each buried the rest of the log)."""

from __future__ import annotations

import threading
import time


class LogThrottle:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._said_at = float("-inf")
        self._since = 0

    def due(self) -> int:
        """Count one event; how many to say now (this one and those held back since the last
        line), or 0 while the period since that line runs."""
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if now - self._said_at < self.seconds:
                return 0
            count, self._since, self._said_at = self._since, 0, now
            return count
