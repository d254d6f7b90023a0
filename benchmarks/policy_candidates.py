"""Eviction policies tried against issue 19's goal and not adopted: kept so that their
figures in docs/hit-rate.md can be made again (``python -m benchmarks.policy_sim
--candidates``). They are ``EvictionIndex`` subclasses, so they run under the store's
chain invariant (victims are leaves) exactly as ``lru`` and ``arc`` do, but they are not
in ``POLICIES``: none beat ARC on the Mooncake trace by more than a point or two without
losing more on another shape. Constants are the literature's, none fitted to a trace:
TinyLFU's sample of 10 x the cache's entries, S3-FIFO's 10% small queue and a ghost as
large as the main queue.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from cacheseek.store.eviction import ArcIndex, EvictionIndex, LruIndex
from cacheseek.store.tier import BlockInfo

SAMPLE_FACTOR = 10  # TinyLFU (Einziger et al., 2017): history of 10 x the cache's entries


class _History:
    """The last ``SAMPLE_FACTOR x capacity`` distinct keys used (evicted ones included)."""

    def __init__(self, capacity: int) -> None:
        self.limit = SAMPLE_FACTOR * max(1, capacity)
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def note(self, key: bytes) -> bool:
        """Record a use; whether the key was in the history before it."""
        keys = self.keys
        seen = key in keys
        keys[key] = None
        if seen:
            keys.move_to_end(key)
        elif len(keys) > self.limit:
            keys.popitem(last=False)
        return seen


class LfuAged(EvictionIndex):
    """LFU over use counts that remember evicted blocks, every count (and every cached
    block's rank) halved once 10 x capacity uses have been counted (TinyLFU's reset);
    ties go to the least recently used. O(log n) an operation, O(n) each reset."""

    name = "lfu-aged"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.counts: dict[bytes, int] = {}
        self.rank: dict[bytes, tuple[int, int]] = {}
        self.heap: list[tuple[tuple[int, int], bytes]] = []
        self.seq = 0
        self.since = 0
        self.window = 0

    def _count(self, key: bytes, info: BlockInfo | None = None) -> None:
        if not self.window and info is not None:
            self.window = SAMPLE_FACTOR * max(1, self.capacity_bytes // max(1, info.nbytes))
        c = self.counts[key] = self.counts.get(key, 0) + 1
        self.seq += 1
        self.rank[key] = r = (c, self.seq)
        heapq.heappush(self.heap, (r, key))
        self.since += 1
        if self.window and self.since >= self.window:
            self.since = 0
            self.counts = {k: v >> 1 for k, v in self.counts.items() if v > 1}
            self.rank = {k: (r[0] >> 1, r[1]) for k, r in self.rank.items()}
            self.heap = [(r, k) for k, r in self.rank.items()]
            heapq.heapify(self.heap)

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        self._count(key, info)

    def _used(self, key: bytes) -> None:
        self._count(key)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        del self.rank[key]
        if not evicted:
            self.counts.pop(key, None)

    def _pick(self) -> bytes | None:
        heap, rank = self.heap, self.rank
        while heap and rank.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale
        return heap[0][1] if heap else None


class LfuDa(EvictionIndex):
    """LFU with dynamic aging (Arlitt et al., 2000; GDSF with equal sizes): rank = L + uses,
    L the last victim's rank, so a newcomer competes with aged blocks; an evicted block's
    uses are remembered (a ghost count, bounded as the TinyLFU history)."""

    name = "lfu-da"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.aging = 0.0
        self.uses: dict[bytes, int] = {}
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.rank: dict[bytes, tuple[float, int]] = {}
        self.heap: list[tuple[tuple[float, int], bytes]] = []
        self.seq = 0

    def _rerank(self, key: bytes) -> None:
        self.seq += 1
        self.rank[key] = r = (self.aging + self.uses[key], self.seq)
        heapq.heappush(self.heap, (r, key))

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        self.uses[key] = self.ghosts.pop(key, 0) + 1
        self._rerank(key)

    def _used(self, key: bytes) -> None:
        self.uses[key] += 1
        self._rerank(key)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        r = self.rank.pop(key)
        n = self.uses.pop(key)
        if evicted:
            self.aging = max(self.aging, r[0])
            self.ghosts[key] = n
            if len(self.ghosts) > SAMPLE_FACTOR * max(1, len(self._entries)):
                self.ghosts.popitem(last=False)

    def _pick(self) -> bytes | None:
        heap, rank = self.heap, self.rank
        while heap and rank.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][1] if heap else None


class S3Fifo(EvictionIndex):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the blocks) that new blocks
    enter, a main FIFO with reinsertion (2-bit use counter), and a ghost FIFO of keys
    evicted from the small queue, as large as the main queue; a ghost enters main."""

    name = "s3fifo"
    SMALL_SHARE = 0.1

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.small: OrderedDict[bytes, None] = OrderedDict()
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        if self.ghost.pop(key, 0) is None:
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def _used(self, key: bytes) -> None:
        self.freq[key] = min(self.freq[key] + 1, 3)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        del self.freq[key]
        if key in self.small:
            del self.small[key]
            if evicted:
                self.ghost[key] = None
                while len(self.ghost) > max(1, len(self.main)):
                    self.ghost.popitem(last=False)
        else:
            del self.main[key]

    def _pick(self) -> bytes | None:
        while True:  # moves blocks between the queues as S3-FIFO's eviction does
            if self.small and (len(self.small) >= self.SMALL_SHARE * len(self.freq) or not self.main):
                key = next(iter(self.small))
                if self.freq[key] > 0:
                    del self.small[key]
                    self.main[key] = None
                    self.freq[key] = 0
                    continue
                return key
            if not self.main:
                return None
            key = next(iter(self.main))
            if self.freq[key] > 0:
                self.main.move_to_end(key)
                self.freq[key] -= 1
                continue
            return key


class ArcLongGhosts(ArcIndex):
    """ARC whose ghost lists remember 10 x capacity (TinyLFU's sample) instead of 1 x."""

    name = "arc-ghosts-10x"

    def _trim_ghosts(self) -> None:
        c = SAMPLE_FACTOR * self.capacity_bytes
        while self._b1 and self._t1_bytes + self._b1_bytes > c:
            self._b1_bytes -= self._b1.popitem(last=False)[1]
        while self._b2 and self._t1_bytes + self._t2_bytes + self._b1_bytes + self._b2_bytes > 2 * c:
            self._b2_bytes -= self._b2.popitem(last=False)[1]


class LruSeen(LruIndex):
    """LRU in which a block not among the last 10 x capacity keys used enters at the LRU
    end (LIP, Qureshi et al., ISCA'07: a bypass in effect); one seen before enters at the
    MRU end."""

    name = "lru-lip-unseen"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.history: _History | None = None

    def _hist(self, info: BlockInfo | None) -> _History:
        if self.history is None:
            self.history = _History(self.capacity_bytes // max(1, info.nbytes if info else 1))
        return self.history

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        self._order[key] = None
        if not self._hist(info).note(key):
            self._order.move_to_end(key, last=False)

    def _used(self, key: bytes) -> None:
        self._order.move_to_end(key)
        self._hist(None).note(key)


class ArcSeen(ArcIndex):
    """ARC in which a block not among the last 10 x capacity keys used enters T1 at its
    LRU end (as ``LruSeen``)."""

    name = "arc-lip-unseen"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.history: _History | None = None

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        if self.history is None:
            self.history = _History(self.capacity_bytes // max(1, info.nbytes))
        seen = self.history.note(key)
        super()._admit(key, info)
        if not seen and key in self._t1:
            self._t1.move_to_end(key, last=False)

    def _used(self, key: bytes) -> None:
        super()._used(key)
        if self.history is not None:
            self.history.note(key)


class Lirs(EvictionIndex):
    """LIRS (Jiang and Zhang, SIGMETRICS'02), in bytes. A block is ranked by its
    inter-reference recency (the distinct blocks used between its last two uses). Blocks
    of low IRR (LIR) hold 99% of the tier and leave only by falling to the bottom of the
    recency stack ``S``; the others (HIR) pass through the last 1% in FIFO order, and an
    HIR block used again while still in ``S`` becomes LIR, the bottom LIR block becoming
    HIR in its place. Evicted HIR blocks stay in ``S`` as non-resident entries (up to
    twice the tier's bytes, as common implementations bound them), so that one coming
    back soon enough is admitted as LIR. Made for loops longer than the cache, where LRU
    keeps nothing: the shape of Belady's late hits on the Mooncake trace."""

    name = "lirs"
    HIR_SHARE = 0.01  # the paper's share of the cache for resident HIR blocks
    NONRESIDENT = 2  # non-resident entries kept, in capacities' bytes

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.stack: OrderedDict[bytes, None] = OrderedDict()  # S: recency order, bottom first
        self.lir: dict[bytes, int] = {}  # resident LIR blocks: nbytes
        self.hir: OrderedDict[bytes, int] = OrderedDict()  # Q: resident HIR blocks, FIFO
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()  # non-resident blocks still in S
        self.lir_bytes = self.ghost_bytes = 0
        self.lir_capacity = capacity_bytes * (1 - self.HIR_SHARE)

    def _prune(self) -> None:
        """Pop non-LIR entries off the bottom of S (its bottom is always LIR)."""
        stack = self.stack
        while stack:
            key = next(iter(stack))
            if key in self.lir:
                return
            del stack[key]
            n = self.ghosts.pop(key, None)
            if n is not None:
                self.ghost_bytes -= n

    def _make_lir(self, key: bytes, n: int) -> None:
        self.lir[key] = n
        self.lir_bytes += n
        while self.lir_bytes > self.lir_capacity and len(self.lir) > 1:
            bottom = next(iter(self.stack))  # LIR (pruned): it becomes resident HIR
            del self.stack[bottom]
            m = self.lir.pop(bottom)
            self.lir_bytes -= m
            self.hir[bottom] = m
            self._prune()

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        n = info.nbytes
        ghost = self.ghosts.pop(key, None)
        if ghost is not None:  # back while still in S: its IRR beats the bottom LIR's recency
            self.ghost_bytes -= ghost
            self.stack.move_to_end(key)
            self._make_lir(key, n)
        elif self.lir_bytes + n <= self.lir_capacity:  # LIR room left (a tier filling up)
            self.stack[key] = None
            self._make_lir(key, n)
        else:
            self.stack[key] = None
            self.hir[key] = n

    def _used(self, key: bytes) -> None:
        stack = self.stack
        if key in self.lir:
            bottom = next(iter(stack)) == key
            stack.move_to_end(key)
            if bottom:
                self._prune()
        elif key in stack:  # resident HIR, used again within S's reach: LIR
            stack.move_to_end(key)
            self._make_lir(key, self.hir.pop(key))
        else:
            stack[key] = None
            self.hir.move_to_end(key)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        n = self.lir.pop(key, None)
        if n is not None:
            self.lir_bytes -= n
            del self.stack[key]
            self._prune()
            return
        n = self.hir.pop(key)
        if key not in self.stack:
            return
        if not evicted:
            del self.stack[key]
            return
        self.ghosts[key] = n
        self.ghost_bytes += n
        while self.ghost_bytes > self.NONRESIDENT * self.capacity_bytes:
            old, m = self.ghosts.popitem(last=False)
            self.ghost_bytes -= m
            del self.stack[old]

    def _resized(self, key: bytes, info: BlockInfo) -> None:
        if key in self.lir:
            self.lir_bytes += info.nbytes - self.lir[key]
            self.lir[key] = info.nbytes
        else:
            self.hir[key] = info.nbytes

    def _pick(self) -> bytes | None:
        if self.hir:
            return next(iter(self.hir))
        return next(iter(self.stack), None)  # every block LIR: S's bottom, the least recent


CANDIDATES: dict[str, Callable[[int], EvictionIndex]] = {
    cls.name: cls for cls in (LfuAged, LfuDa, S3Fifo, ArcLongGhosts, LruSeen, ArcSeen, Lirs)
}
