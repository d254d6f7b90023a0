"""Eviction policies: a tier's index of blocks, and the order it gives them up in.

A tier keeps one ``EvictionIndex`` under its lock: block hash -> ``BlockInfo``, byte
totals, and a policy that names the next victim. Policies are a table (``POLICIES``,
name -> class), chosen by ``TierConfig.eviction`` and the server's ``eviction`` setting.

Two events reach a policy: ``add`` (a block stored in this tier: its first use here) and
``touch`` (a later use: a hit served from it, or an ingest that found it stored). A tier
calls ``remove(key, evicted=True)`` for the victim it took, so a policy with history
(ARC's ghosts) remembers it; a plain delete forgets it.

Pins: ``pin(keys)`` takes blocks out of the policy (never chosen, never aged) until
``unpin``; a pinned key not stored here yet is pinned from the moment it arrives. The keys
pinned are always whole chains from their head (``TieredStore.pin``), so a pinned block's
ancestors are pinned too, and the walk down to a leaf below an unpinned block never meets
a pinned one. With every block pinned there is no victim: the tier refuses the write
(``StorageError``) rather than loop.

Spared blocks: ``victim(spare)`` names no block of ``spare``, for one call of the tier
(a read's promotions spare the chain it reads, which it has not all taken yet): the
policy's order walked past them, nothing changed in it. Where only spared (or pinned)
blocks are left to give up, there is no victim, and that call is refused. A ``SoftSpare``
yields instead: its blocks go last, not never (where only they, or blocks above them, are
left, the victim is the one ``victim()`` names), so a call that spares one is never refused
for it (a server's body sparing the write's earlier bodies: ``BlockService._put``).

The chain invariant, for every policy: a chain loses its tail before its head. A block's
uses are a subset of its parent's (a request that reaches a block passed through its whole
prefix), so a descendant is never worth more than its ancestor. ``victim`` therefore
walks down from whatever block the policy names to a leaf of this tier's prefix forest
(a block none of whose children are stored here) and gives up that leaf: the policy
chooses a subtree, the tree chooses the tail. The surviving blocks of a chain in a tier
are always a prefix of it (or, across tiers, found by ``locate`` tier by tier).

- ``lru``: least recently used (O(1) an operation).
- ``arc``: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), in bytes. Blocks
  seen once (T1) and blocks used again (T2) are kept in two LRU lists; a ghost list of
  each remembers recently evicted keys (no data), and a hit on a ghost moves the split
  ``p`` between the two towards the list that would have kept it. No parameter: ``p``
  adapts to the workload. One-off scans (a document read once) stay in T1 and cannot
  flush the reused blocks out of T2; a workload whose every reuse is a first reuse
  (short multi-turn chats) drives ``p`` up until ARC behaves as LRU. O(1) an operation.
  One simplification: ARC's tie rule ("evict from T1 when the incoming key is a T2 ghost
  and |T1| = p") is dropped, since a tier evicts before it knows what it admits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError

if TYPE_CHECKING:
    from .tier import BlockInfo


class SoftSpare(frozenset[bytes]):
    """A ``spare`` whose blocks are given up last rather than never: spared while the policy
    has any other victim, then evicted as if not spared (see the module doc). A call that
    spares one makes the room it would have made without it, so it fails no write."""

    __slots__ = ()


def strict(spare: Container[bytes]) -> Container[bytes]:
    """The blocks ``spare`` keeps whatever it costs the write: none of a ``SoftSpare``."""
    return () if isinstance(spare, SoftSpare) else spare


class EvictionIndex(ABC):
    """Block hash -> ``BlockInfo`` with byte totals, and the policy's next victim.

    Not locked: the owning tier holds its own lock around every call."""

    name = ""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: dict[bytes, BlockInfo] = {}
        # parent hash -> its children stored here (insertion-ordered), for leaf-first victims:
        # a lone child (most parents, in chains) in a tuple, a dict from the second one on (a
        # one-key dict per parent cost ~270 bytes a block)
        self._kids: dict[bytes, tuple[bytes] | dict[bytes, None]] = {}
        self.used_bytes = 0  # of the blocks' charges (``BlockInfo.charge``): what the budget counts
        self.frame_bytes = 0  # of the frames themselves
        self.raw_bytes = 0
        # Pinned keys, stored here or not (a pin covers a block that arrives later), and
        # the totals of those stored here.
        self._pinned: set[bytes] = set()
        self.pinned_blocks = 0
        self.pinned_bytes = 0
        # Told of every block that enters or leaves the index (``TieredStore``'s residency).
        self.observer: IndexObserver | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        return list(map(self._entries.__contains__, keys))

    def get(self, key: bytes) -> BlockInfo | None:
        return self._entries.get(key)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    @property
    def evictable(self) -> int:
        """Blocks the policy may give up (those not pinned)."""
        return len(self._entries) - self.pinned_blocks

    def add(self, key: bytes, info: BlockInfo) -> None:
        """Index a block stored in this tier (a key already indexed is re-sized, moved under its
        parent if that changed, and touched)."""
        old = self._entries.get(key)
        pinned = key in self._pinned
        if old is not None:
            self.used_bytes += info.charge - old.charge
            self.frame_bytes += info.nbytes - old.nbytes
            self.raw_bytes += info.raw_nbytes - old.raw_nbytes
            self._entries[key] = info
            if (old.parent, old.position) != (info.parent, info.position):
                # The child link moves with the block: a stale one would make victim() name a
                # block no longer below that parent, or one not stored here at all.
                self._unlink(key, old)
                self._link(key, info)
            if pinned:
                self.pinned_bytes += info.charge - old.charge
            else:
                self._resized(key, info)
                self._used(key)
            return
        self._entries[key] = info
        self.used_bytes += info.charge
        self.frame_bytes += info.nbytes
        self.raw_bytes += info.raw_nbytes
        self._link(key, info)
        if pinned:
            self.pinned_blocks += 1
            self.pinned_bytes += info.charge
            self._drop_ghost(key)  # stored again: no longer a block the tier gave up
        else:
            self._admit(key, info)
        if self.observer is not None:
            self.observer.added(key, info)

    def remove(self, key: bytes, *, evicted: bool = False) -> BlockInfo | None:
        """Drop a block from the index. ``evicted``: the tier gave it up to make room (a
        policy with history remembers it); else it was deleted (forgotten)."""
        info = self._entries.pop(key, None)
        if info is None:
            return None
        self.used_bytes -= info.charge
        self.frame_bytes -= info.nbytes
        self.raw_bytes -= info.raw_nbytes
        self._unlink(key, info)
        if key in self._pinned:
            self.pinned_blocks -= 1
            self.pinned_bytes -= info.charge
            if not evicted:
                self._drop_ghost(key)  # a plain delete forgets the block, pinned or not
        else:
            self._forget(key, info, evicted)
        if self.observer is not None:
            self.observer.removed(key, info)
        return info

    def _link(self, key: bytes, info: BlockInfo) -> None:
        if info.position:
            kids = self._kids.get(info.parent)
            if kids is None:
                self._kids[info.parent] = (key,)
            elif isinstance(kids, tuple):
                if kids[0] != key:
                    self._kids[info.parent] = {kids[0]: None, key: None}
            else:
                kids[key] = None

    def _unlink(self, key: bytes, info: BlockInfo) -> None:
        if info.position:
            kids = self._kids.get(info.parent)
            if isinstance(kids, tuple):
                if kids[0] == key:
                    del self._kids[info.parent]
            elif kids is not None:
                kids.pop(key, None)
                if not kids:
                    del self._kids[info.parent]

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` used, in order (the last one is the most recent use)."""
        entries = self._entries
        pinned = self._pinned
        for key in keys:
            if key in entries and key not in pinned:
                self._used(key)

    def victim(self, spare: Container[bytes] = ()) -> bytes | None:
        """The block to evict next: a leaf at or below the policy's choice (see the module
        doc); None when nothing may be evicted (empty, or every block pinned). ``spare``:
        blocks this call must not give up, as if pinned for it alone (the chain a read
        promotes for): the policy's first choice of the others, and a leaf below it none of
        them; None when every block is pinned or spared, or above one that is."""
        if spare:
            key = self._victim_sparing(spare)
            if key is not None or not isinstance(spare, SoftSpare):
                return key
        key = self._pick()
        if key is None:
            return None
        kids = self._kids
        pinned = self._pinned
        # At most one step per block: links whose positions disagree (frames from outside
        # the library, which the server checks) must not turn a cycle into a hang here.
        for _ in range(len(self._entries)):
            if key not in kids:
                break
            below = kids[key]
            nxt: bytes | None = next(iter(below))
            if pinned and nxt in pinned:  # never, for pins of whole chains; kept safe all the same
                nxt = next((k for k in below if k not in pinned), None)
                if nxt is None:
                    break
            key = nxt
        return key

    def _victim_sparing(self, spare: Container[bytes]) -> bytes | None:
        # The policy's order walked past the spared blocks (one step each: a read's chain is
        # short beside a tier); a choice whose every way down meets one is passed over too,
        # since giving it up would leave a spared block there with no parent.
        kids = self._kids
        pinned = self._pinned
        for key in self._pick_order():
            if key in spare:
                continue
            for _ in range(len(self._entries)):
                below = kids.get(key)
                if below is None:
                    return key
                nxt = next((k for k in below if k not in spare and k not in pinned), None)
                if nxt is None:
                    break
                key = nxt
        return None

    def keep_order(self) -> list[bytes]:
        """The blocks stored here, the ones this tier would keep longest first: the pinned
        ones (never given up), then the others in the reverse of the order the policy picks
        its victims in (a chain's head after its tail here: ``victim`` gives the leaf below
        a pick up first, which the caller orders itself)."""
        pinned = [key for key in self._entries if key in self._pinned]
        return pinned + list(reversed(list(self._pick_order())))

    def children(self, key: bytes) -> list[bytes]:
        """Blocks stored here whose parent is ``key``."""
        return list(self._kids.get(key, ()))

    # -- pins ---------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep ``keys`` out of eviction (stored here now, or whenever they arrive)."""
        for key in keys:
            if key in self._pinned:
                continue
            self._pinned.add(key)
            info = self._entries.get(key)
            if info is not None:
                self._forget(key, info, False)
                self.pinned_blocks += 1
                self.pinned_bytes += info.charge

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Give ``keys`` back to the policy, as newly used blocks."""
        for key in keys:
            if key not in self._pinned:
                continue
            self._pinned.discard(key)
            info = self._entries.get(key)
            if info is not None:
                self.pinned_blocks -= 1
                self.pinned_bytes -= info.charge
                self._admit(key, info)

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pinned

    def resize(self, capacity_bytes: int) -> None:
        """The tier's budget changed (a disk tier fitted to its filesystem)."""
        self.capacity_bytes = capacity_bytes

    # -- the policy ---------------------------------------------------------------------

    @abstractmethod
    def _admit(self, key: bytes, info: BlockInfo) -> None:
        """A new block (its first use in this tier)."""

    @abstractmethod
    def _used(self, key: bytes) -> None:
        """A later use of an indexed block."""

    @abstractmethod
    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        """A block left the index."""

    @abstractmethod
    def _pick(self) -> bytes | None:
        """The policy's choice of victim (``victim`` may give up a leaf below it instead)."""

    def _pick_order(self) -> Iterable[bytes]:
        """Every unpinned block, in the order successive ``_pick`` calls would name them
        (each taken out before the next), without changing anything. This default, for a
        policy that does not say: the order they were stored in."""
        return (key for key in self._entries if key not in self._pinned)

    def _resized(self, key: bytes, info: BlockInfo) -> None:
        """An indexed block was stored again with another size (rare: a replaced frame)."""

    def _drop_ghost(self, key: bytes) -> None:
        """Forget any history of ``key`` (a policy with ghosts drops its ghost)."""

    def describe(self) -> dict:
        return {"policy": self.name}


class IndexObserver(Protocol):
    """Told, under the tier's lock, of each block entering or leaving an index: keep it quick."""

    def added(self, key: bytes, info: BlockInfo) -> None: ...

    def removed(self, key: bytes, info: BlockInfo) -> None: ...


class LruIndex(EvictionIndex):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity_bytes: int = 0) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        self._order[key] = None

    def _used(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        del self._order[key]

    def _pick(self) -> bytes | None:
        return next(iter(self._order), None)  # O(1): evicting n blocks must not cost n^2

    def _pick_order(self) -> Iterable[bytes]:
        return iter(self._order)


class ArcIndex(EvictionIndex):
    """Adaptive Replacement Cache, sizes in bytes (see the module doc)."""

    name = "arc"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        # key -> charge (bytes the budget counts), each in LRU order (oldest first)
        self._t1: OrderedDict[bytes, int] = OrderedDict()  # stored, used once here
        self._t2: OrderedDict[bytes, int] = OrderedDict()  # stored, used again
        self._b1: OrderedDict[bytes, int] = OrderedDict()  # ghosts evicted from T1
        self._b2: OrderedDict[bytes, int] = OrderedDict()  # ghosts evicted from T2
        self._t1_bytes = self._t2_bytes = self._b1_bytes = self._b2_bytes = 0
        self.p = 0.0  # target bytes of T1
        self.ghost_hits = 0

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        n = info.charge
        c = self.capacity_bytes
        # ARC's step is |B2| / |B1| (or the reverse) with the ghost hit still in its list: taken
        # without it, the last ghost of a list divided by max(0, 1) byte and moved p a whole
        # budget at once (to c, or to 0).
        ghost = self._b1.pop(key, None)
        if ghost is not None:  # would have been a hit with a larger T1: grow it
            self.p = min(c, self.p + n * max(self._b2_bytes / max(self._b1_bytes, 1), 1.0))
            self._b1_bytes -= ghost
            self.ghost_hits += 1
            self._t2[key] = n
            self._t2_bytes += n
        else:
            ghost = self._b2.pop(key, None)
            if ghost is not None:  # would have been a hit with a larger T2: shrink T1
                self.p = max(0.0, self.p - n * max(self._b1_bytes / max(self._b2_bytes, 1), 1.0))
                self._b2_bytes -= ghost
                self.ghost_hits += 1
                self._t2[key] = n
                self._t2_bytes += n
            else:
                self._t1[key] = n
                self._t1_bytes += n
        self._trim_ghosts()  # after a ghost hit too: a block may come back larger than its ghost

    def _used(self, key: bytes) -> None:
        n = self._t1.pop(key, None)
        if n is not None:
            self._t1_bytes -= n
            self._t2[key] = n
            self._t2_bytes += n
        else:
            self._t2.move_to_end(key)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        n = self._t1.pop(key, None)
        if n is not None:
            self._t1_bytes -= n
            if evicted:
                self._b1[key] = n
                self._b1_bytes += n
        else:
            n = self._t2.pop(key)
            self._t2_bytes -= n
            if evicted:
                self._b2[key] = n
                self._b2_bytes += n
        if evicted:
            self._trim_ghosts()

    def _resized(self, key: bytes, info: BlockInfo) -> None:
        for lst, attr in ((self._t1, "_t1_bytes"), (self._t2, "_t2_bytes")):
            old = lst.get(key)
            if old is not None:
                lst[key] = info.charge
                setattr(self, attr, getattr(self, attr) + info.charge - old)
        self._trim_ghosts()  # a block stored again larger: the ghosts give up the room, as on an add

    def resize(self, capacity_bytes: int) -> None:
        super().resize(capacity_bytes)
        # The target and the ghost lists are bounded by the budget: a smaller one applies now,
        # not only once the policy happens to grow p or trim its ghosts again.
        self.p = min(self.p, capacity_bytes)
        self._trim_ghosts()

    def _drop_ghost(self, key: bytes) -> None:
        n = self._b1.pop(key, None)
        if n is not None:
            self._b1_bytes -= n
        n = self._b2.pop(key, None)
        if n is not None:
            self._b2_bytes -= n

    def _trim_ghosts(self) -> None:
        """ARC's bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c."""
        c = self.capacity_bytes
        while self._b1 and self._t1_bytes + self._b1_bytes > c:
            self._b1_bytes -= self._b1.popitem(last=False)[1]
        while self._b2 and self._t1_bytes + self._t2_bytes + self._b1_bytes + self._b2_bytes > 2 * c:
            self._b2_bytes -= self._b2.popitem(last=False)[1]

    def _pick(self) -> bytes | None:
        if self._t1 and (self._t1_bytes > self.p or not self._t2):
            return next(iter(self._t1))
        return next(iter(self._t2), None)

    def _pick_order(self) -> Iterable[bytes]:
        # ``_pick`` with T1 shrinking as its blocks go (p moves only on a ghost hit, at an add).
        t1, t2 = iter(self._t1.items()), iter(self._t2)
        t1_bytes, left1, left2 = self._t1_bytes, len(self._t1), len(self._t2)
        while left1 or left2:
            if left1 and (t1_bytes > self.p or not left2):
                key, n = next(t1)
                t1_bytes, left1 = t1_bytes - n, left1 - 1
                yield key
            else:
                left2 -= 1
                yield next(t2)

    def describe(self) -> dict:
        return {"policy": self.name, "t1_bytes": self._t1_bytes, "t2_bytes": self._t2_bytes,
                "target_t1_bytes": int(self.p), "ghost_bytes": self._b1_bytes + self._b2_bytes,
                "ghost_hits": self.ghost_hits}


POLICIES: dict[str, type[EvictionIndex]] = {"lru": LruIndex, "arc": ArcIndex}
DEFAULT_POLICY = "arc"


def check_policy(name: str, *, what: str = "eviction") -> str:
    if name not in POLICIES:
        raise ConfigError(f"{what}: unknown eviction policy {name!r}; one of {sorted(POLICIES)}")
    return name


def make_index(policy: str, capacity_bytes: int) -> EvictionIndex:
    return POLICIES[check_policy(policy)](capacity_bytes)


__all__ = ["DEFAULT_POLICY", "POLICIES", "ArcIndex", "EvictionIndex", "IndexObserver", "LruIndex", "SoftSpare", "check_policy",
           "make_index", "strict"]
