"""Which tiers hold each block, so that store-wide figures count every block once.

A block written through to the disk tier while the CPU tier still holds it is stored twice,
and a tier's ``used_bytes`` counts it in both. ``Residency`` is told by every tier with a
local index (``EvictionIndex.observer``) of each block entering or leaving it, keeps one
bit per tier for each block, and from that:

- the *unique* figures of each tier: bytes, blocks and raw bytes of the blocks it holds
  that no faster tier holds (they add up to the store's distinct blocks);
- ``appeared``/``gone`` events for listeners: a block entering its first tier, and leaving
  its last (the server attributes blocks to namespaces and models with them).

A tier without a local index (Redis: shared by many processes, its index in Redis) reports
nothing here; its own figures stand apart.

Events arrive under the reporting tier's lock; this class takes its own lock inside it and
never calls back into a tier, so no lock order can deadlock. Listeners must be quick.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from .tier import BlockInfo


class ResidencyListener(Protocol):
    def appeared(self, key: bytes, info: BlockInfo) -> None:
        """``key`` entered the store (its first tier)."""

    def gone(self, key: bytes, info: BlockInfo) -> None:
        """``key`` left the store (its last tier)."""


@dataclass(slots=True)
class UniqueFigures:
    """A tier's blocks that no faster tier holds."""

    blocks: int = 0
    bytes: int = 0
    raw_bytes: int = 0


def _fastest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class _LevelWatch:
    """One tier's observer: its events, tagged with the tier's level."""

    __slots__ = ("_residency", "_level")

    def __init__(self, residency: Residency, level: int) -> None:
        self._residency = residency
        self._level = level

    def added(self, key: bytes, info: BlockInfo) -> None:
        self._residency.added(self._level, key, info)

    def removed(self, key: bytes, info: BlockInfo) -> None:
        self._residency.removed(self._level, key, info)


class Residency:
    def __init__(self, levels: int) -> None:
        self._lock = threading.Lock()
        self._held: dict[bytes, list] = {}  # key -> [tier bit mask, BlockInfo]
        self._unique = [UniqueFigures() for _ in range(levels)]
        self._listeners: list[ResidencyListener] = []

    def watch(self, level: int) -> _LevelWatch:
        return _LevelWatch(self, level)

    def listen(self, listener: ResidencyListener) -> list[tuple[bytes, BlockInfo]]:
        """Add ``listener``; returns the blocks held now (head first within each chain:
        by position), which it has not been told of."""
        with self._lock:
            self._listeners.append(listener)
            held = [(key, entry[1]) for key, entry in self._held.items()]
        held.sort(key=lambda item: item[1].position)
        return held

    def added(self, level: int, key: bytes, info: BlockInfo) -> None:
        bit = 1 << level
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                self._held[key] = [bit, info]
                self._count(level, info, 1)
                for listener in self._listeners:
                    listener.appeared(key, info)
                return
            before = _fastest(entry[0])
            entry[0] |= bit
            if level < before:
                self._count(before, entry[1], -1)
                self._count(level, entry[1], 1)

    def removed(self, level: int, key: bytes, info: BlockInfo) -> None:
        bit = 1 << level
        with self._lock:
            entry = self._held.get(key)
            if entry is None or not entry[0] & bit:
                return
            before = _fastest(entry[0])
            entry[0] &= ~bit
            if not entry[0]:
                del self._held[key]
                self._count(level, entry[1], -1)
                for listener in self._listeners:
                    listener.gone(key, entry[1])
                return
            if before == level:
                self._count(level, entry[1], -1)
                self._count(_fastest(entry[0]), entry[1], 1)

    def _count(self, level: int, info: BlockInfo, sign: int) -> None:
        figures = self._unique[level]
        figures.blocks += sign
        figures.bytes += sign * info.nbytes
        figures.raw_bytes += sign * info.raw_nbytes

    def info(self, key: bytes) -> BlockInfo | None:
        """A block's info if any local tier holds it (no tier lock taken)."""
        entry = self._held.get(key)  # one dict read: atomic under the GIL
        return entry[1] if entry is not None else None

    def unique(self) -> list[UniqueFigures]:
        with self._lock:
            return [UniqueFigures(f.blocks, f.bytes, f.raw_bytes) for f in self._unique]

    def __len__(self) -> int:
        return len(self._held)


__all__ = ["Residency", "ResidencyListener", "UniqueFigures"]
