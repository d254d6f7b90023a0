"""Admission to a tier by use count: a block is written there only once it has been used
``threshold`` times (NVIDIA Dynamo's KVBM offloads to disk this way by default, to spare
SSD writes on blocks that are never used again).

Counts are kept TinyLFU-style (Einziger et al., 2017): every count is halved once
``window`` uses have been counted since the last halving, so old popularity fades and the
table stays bounded (about ``window`` keys). ``window`` is ten times the number of blocks
the filtered tier holds, TinyLFU's sample size: its budget now (a disk tier's comes down
when the filesystem turns out fuller than it knew) over the first frame's size as that
budget counts it (``Tier.charge``: a disk tier's blocks take whole file-system blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

SAMPLE_FACTOR = 10  # TinyLFU: sample size W = 10 x the cache's entries


class UseFilter:
    """Counts uses per block hash; thread-safe (the store's callers may be many threads)."""

    def __init__(self, threshold: int, capacity_bytes: Callable[[], int],
                 charge: Callable[[int], int] = lambda n: n) -> None:
        self.threshold = threshold
        self.capacity_bytes = capacity_bytes  # the tier's budget, read as it is now
        self.charge = charge  # the bytes the tier's budget counts for a frame of n bytes
        self._block_charge = 0  # the first frame's charge: until it comes, no window
        self._counts: dict[bytes, int] = {}
        self._since_halving = 0
        self.refused = 0
        self.refused_bytes = 0
        self._lock = threading.Lock()

    def size_from(self, frame_nbytes: int) -> None:
        if not self._block_charge and frame_nbytes > 0:
            self._block_charge = self.charge(frame_nbytes)

    @property
    def window(self) -> int:
        """Uses between halvings: 10 x the blocks the tier holds at its budget now (0: no
        frame seen yet)."""
        if not self._block_charge:
            return 0
        return SAMPLE_FACTOR * max(1, self.capacity_bytes() // self._block_charge)

    def use(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            counts = self._counts
            n = 0
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
                n += 1
            self._since_halving += n
            window = self.window
            if window and self._since_halving >= window:
                self._halve()

    def admits(self, key: bytes) -> bool:
        return self._counts.get(key, 0) >= self.threshold  # one dict read: atomic

    def refuse(self, nbytes: int) -> None:
        with self._lock:
            self.refused += 1
            self.refused_bytes += nbytes

    def _halve(self) -> None:
        self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}
        self._since_halving = 0

    def describe(self) -> dict:
        return {"admit_after_uses": self.threshold, "window": self.window, "tracked_keys": len(self._counts),
                "not_admitted": self.refused, "not_admitted_bytes": self.refused_bytes}
