"""Pins: prefixes an operator keeps out of eviction, each for a while or until unpinned.

A pin names a chain by its last block and covers every block of it, head first, so that a
pinned prefix stays a usable prefix (a pinned block's ancestors are always pinned too, the
property ``eviction.EvictionIndex`` relies on). Two pins may share blocks (two documents
behind one system prompt): a block stays pinned while any pin covers it.

``PinTable`` is bookkeeping only: which pins exist, until when, and which keys each change
pins or frees. ``TieredStore`` applies those keys to its tiers.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True, slots=True)
class Pin:
    key: bytes  # the chain's last block: the pin's name
    keys: tuple[bytes, ...]  # the chain, head first
    pinned_at: float  # seconds since the epoch
    expires_at: float | None  # seconds since the epoch; None: until unpinned

    def to_dict(self) -> dict:
        return {"blocks": len(self.keys), "pinned_at": self.pinned_at, "expires_at": self.expires_at}


class PinTable:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._pins: dict[bytes, Pin] = {}
        self._covers: dict[bytes, int] = {}  # key -> how many pins cover it
        # (expires_at, key) of every pin with an expiry, soonest first. An entry whose pin was
        # unpinned or pinned again since is stale, and dropped when it comes up (or in a
        # rebuild): finding the next expiry scanned every pin on each pin and unpin.
        self._expiries: list[tuple[float, bytes]] = []
        self.next_expiry: float | None = None

    def add(self, keys: Sequence[bytes], *, ttl_seconds: float | None = None,
            expires_at: float | None = None, pinned_at: float | None = None) -> tuple[Pin, list[bytes]]:
        """Pin the chain ``keys`` (head first) for ``ttl_seconds`` (None: until unpinned), or
        until ``expires_at``. Pinning a chain again replaces its expiry and its ``pinned_at``.
        ``pinned_at``: when it was pinned, where that was before now (a pin made again from a
        server's pins file at start); None: now. Returns the pin and the keys it newly pins."""
        if not keys:
            raise InputError("pin: an empty chain")
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not math.isfinite(ttl_seconds)
                                        or ttl_seconds <= 0):
            raise InputError(f"ttl_seconds: must be a number of seconds > 0, got {ttl_seconds!r}")
        if expires_at is not None:
            if ttl_seconds is not None:
                raise InputError("pin: ttl_seconds or expires_at, not both")
            # (a NaN expiry never came due, and made next_expiry depend on the pins' order)
            if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) or not math.isfinite(expires_at):
                raise InputError(f"expires_at: must be a time in seconds since the epoch, got {expires_at!r}")
        if pinned_at is not None and (isinstance(pinned_at, bool) or not isinstance(pinned_at, (int, float))
                                      or not math.isfinite(pinned_at)):
            raise InputError(f"pinned_at: must be a time in seconds since the epoch, got {pinned_at!r}")
        now = self.clock()
        if expires_at is None and ttl_seconds is not None:
            expires_at = now + ttl_seconds
        with self._lock:
            old = self._pins.get(keys[-1])
            since = now if pinned_at is None else pinned_at
            if old is not None:  # pinned again: a new expiry, the same blocks
                pin = Pin(old.key, old.keys, since, expires_at)
                newly = []
            else:
                pin = Pin(keys[-1], tuple(keys), since, expires_at)
                newly = self._cover(pin.keys, +1)
            self._pins[pin.key] = pin
            if expires_at is not None and (old is None or old.expires_at != expires_at):
                heapq.heappush(self._expiries, (expires_at, pin.key))
            self._next()
        return pin, newly

    def remove(self, key: bytes) -> tuple[Pin | None, list[bytes]]:
        """Drop the pin named ``key``; returns it (None if there was none) and the keys no pin covers now."""
        with self._lock:
            pin = self._pins.pop(key, None)
            freed = self._cover(pin.keys, -1) if pin is not None else []
            self._next()
        return pin, freed

    def expire(self) -> list[bytes]:
        """Drop every pin past its expiry; returns the keys no pin covers now."""
        now = self.clock()
        with self._lock:
            if self.next_expiry is None or now < self.next_expiry:
                return []
            freed: list[bytes] = []
            heap = self._expiries
            while heap and heap[0][0] <= now:
                _, key = heapq.heappop(heap)
                pin = self._pins.get(key)
                if pin is not None and pin.expires_at is not None and pin.expires_at <= now:
                    del self._pins[key]
                    freed += self._cover(pin.keys, -1)
            self._next()
        return freed

    def due(self) -> bool:
        """Whether a pin has expired (one comparison: cheap enough for every write)."""
        nxt = self.next_expiry
        return nxt is not None and self.clock() >= nxt

    def get(self, key: bytes) -> Pin | None:
        return self._pins.get(key)

    def pins(self) -> list[Pin]:
        with self._lock:
            return list(self._pins.values())

    def covered(self, key: bytes) -> bool:
        return key in self._covers

    def __len__(self) -> int:
        return len(self._pins)

    def _cover(self, keys: Sequence[bytes], delta: int) -> list[bytes]:
        """Add ``delta`` to each key's cover count; returns the keys that crossed zero."""
        changed = []
        covers = self._covers
        for key in keys:
            n = covers.get(key, 0) + delta
            if n > 0:
                covers[key] = n
                if n == delta:
                    changed.append(key)
            else:
                covers.pop(key, None)
                changed.append(key)
        return changed

    def _stale(self, entry: tuple[float, bytes]) -> bool:
        pin = self._pins.get(entry[1])
        return pin is None or pin.expires_at != entry[0]

    def _next(self) -> None:
        heap = self._expiries
        # Stale entries (pins made again with another expiry, or unpinned) are dropped in one
        # pass once they outnumber the pins, so the heap stays within about twice the pins. A
        # set: a pin unpinned and made again with its old expiry has two live entries.
        if len(heap) > 2 * len(self._pins) + 16:
            heap[:] = list({entry for entry in heap if not self._stale(entry)})
            heapq.heapify(heap)
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        self.next_expiry = heap[0][0] if heap else None


__all__ = ["Pin", "PinTable"]
