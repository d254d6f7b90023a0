"""Positions of blocks being written: what a write is checked against besides the store.

``BlockService.put`` checks each frame's position against its parent's and its children's,
then stores it. Two requests checked at the same moment each saw a store without the
other's frames, and both stored: a block P at position 3 beside a child of P at position 1.
So a write *claims* its frames (stored key, stored parent, position) before it looks at the
store, and gives the claim back once its store is done, whatever came of it (stored, found
present, failed). A claim that contradicts one another write holds is refused, by the rules
the store is checked by: a block at another position than it is being written at, a parent
being written at a position other than one above, a child being written at one other than
one below. Of two contradicting writes, the later claimant either meets the earlier's claim
here, or claimed after the earlier's store was done, and its look at the store then finds
the earlier's blocks.

A claim takes a few dict operations per frame under one lock, never I/O: unrelated writes
wait on each other no longer than that, and the checks against the store, which may ask
Redis, run outside it. Concurrent writers of the same blocks at the same positions (clients
sharing a prompt) contradict nothing, and all pass.

One process only: servers sharing a Redis tier do not see each other's claims (docs/redis.md).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

Claimed = tuple[bytes, bytes, int]  # (stored key, stored parent key, position)


@dataclass(frozen=True, slots=True)
class Conflict:
    """Why entry ``index`` of a claim was refused: block ``other`` (a stored key) is being
    written at ``position``, as the same block (``what`` "self"), as its parent ("parent"),
    or as a child of it ("child")."""

    index: int
    what: str  # "self" | "parent" | "child"
    other: bytes
    position: int


class PositionClaims:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[bytes, tuple[int, int]] = {}  # key -> (position, writes claiming it)
        self._children: dict[bytes, Counter[bytes]] = {}  # parent key -> its claimed children

    def claim(self, entries: Sequence[Claimed]) -> Conflict | None:
        """Claim every entry, or none (the first contradiction, returned). The entries must
        agree with each other (``BlockService`` checks a batch first)."""
        with self._lock:
            for i, (key, parent, position) in enumerate(entries):
                conflict = self._contradiction(key, parent, position)
                if conflict is not None:
                    return Conflict(i, *conflict)
            at, children = self._at, self._children
            for key, parent, position in entries:
                at[key] = (position, at.get(key, (position, 0))[1] + 1)
                children.setdefault(parent, Counter())[key] += 1
        return None

    def release(self, entries: Sequence[Claimed]) -> None:
        """Give back what ``claim`` took for ``entries`` (once, after the write is done)."""
        at, children = self._at, self._children
        with self._lock:
            for key, parent, _ in entries:
                position, count = at[key]
                if count > 1:
                    at[key] = (position, count - 1)
                else:
                    del at[key]
                kids = children[parent]
                kids[key] -= 1
                if kids[key] == 0:
                    del kids[key]
                    if not kids:
                        del children[parent]

    def _contradiction(self, key: bytes, parent: bytes, position: int) -> tuple[str, bytes, int] | None:
        held = self._at.get(key)
        if held is not None and held[0] != position:
            return "self", key, held[0]
        if position > 0:  # (a position-0 block's parent is its chain's root, not a block)
            held = self._at.get(parent)
            if held is not None and held[0] != position - 1:
                return "parent", parent, held[0]
        for child in self._children.get(key, ()):
            child_position = self._at[child][0]
            if child_position != position + 1:
                return "child", child, child_position
        return None

    def __len__(self) -> int:
        """Blocks claimed now."""
        return len(self._at)


__all__ = ["Claimed", "Conflict", "PositionClaims"]
