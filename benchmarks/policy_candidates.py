"""Eviction policies tried against issue 19's goal and not adopted: kept so that their
figures in docs/hit-rate.md can be made again (``python -m benchmarks.policy_sim
--candidates``). They are ``EvictionIndex`` subclasses, so they run under the store's
chain invariant (victims are leaves) exactly as ``lru`` and ``arc`` do, but they are not
in ``POLICIES``: none beat ARC on the Mooncake trace by more than a point or two without
losing more on another shape. Constants are the literature's, none fitted to a trace:
TinyLFU's sample of 10 x the cache's entries, S3-FIFO's 10% small queue and a ghost as
large as the main queue, Hawkeye's 3-bit counters and OPTgen window of 8 x the cache.
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


class _MaxTree:
    """Occupancy over a circular window of ``size`` time slots: add to a range, the maximum
    of a range (a bottom-up segment tree with lazy adds; O(log size) an operation)."""

    def __init__(self, size: int) -> None:
        size = 1 << max(0, size - 1).bit_length()  # a power of two: lazy pushes need a full tree
        self.n = size
        self.h = size.bit_length()
        self.t = [0] * (2 * size)
        self.d = [0] * size

    def _apply(self, p: int, v: int) -> None:
        self.t[p] += v
        if p < self.n:
            self.d[p] += v

    def _build(self, p: int) -> None:
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            t[p] = max(t[2 * p], t[2 * p + 1]) + d[p]

    def _push(self, p: int) -> None:
        d = self.d
        for s in range(self.h, 0, -1):
            i = p >> s
            if i and d[i]:
                self._apply(2 * i, d[i])
                self._apply(2 * i + 1, d[i])
                d[i] = 0

    def add(self, lo: int, hi: int, v: int) -> None:
        """Add ``v`` to slots [lo, hi) (lo < hi <= size)."""
        lo += self.n
        hi += self.n
        l0, r0 = lo, hi
        while lo < hi:
            if lo & 1:
                self._apply(lo, v)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, v)
            lo >>= 1
            hi >>= 1
        self._build(l0)
        self._build(r0 - 1)

    def max(self, lo: int, hi: int) -> int:
        lo += self.n
        hi += self.n
        self._push(lo)
        self._push(hi - 1)
        t = self.t
        best = -(1 << 62)
        while lo < hi:
            if lo & 1:
                best = max(best, t[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = max(best, t[hi])
            lo >>= 1
            hi >>= 1
        return best


class Hawkeye(EvictionIndex):
    """Hawkeye (Jain and Lin, ISCA'16) without a PC. OPTgen replays Belady's MIN online
    over the last 8 x capacity accesses (an occupancy vector: a block's reuse would have
    been a hit iff the cache never filled between its two uses); each verdict trains a
    3-bit saturating counter of the signature of the block's previous access, and an
    access is cache-friendly if its counter's top bit is set. An access without a reuse
    within the window detrains its signature when it leaves the window (OPT missed it).
    The signature is what is visible at the access: the request's length, the block's
    position in its chain and its uses within the window (each bucketed by log2, no cut
    fitted; ``FEATURES`` also takes ``idle``, the time since its last use in capacities).

    Cache-averse blocks are evicted first (oldest first), friendly ones in recency order
    (RRIP's aging of friendly lines without the 3-bit cap), and picking a friendly victim
    detrains its signature. A request's accesses are told apart from the store's double
    touch of a hit (the hit's ``touch_chain``, then the ingest's) by segments: a run of
    touches and the adds after them is one request, each block counted once. The request's
    length (its tail's position) is known at its first add, so its touched blocks are
    classified then; until that they stay friendly and most recent, so that the room made
    for the request's new blocks does not take its own hit prefix. O(log capacity) an
    access (OPTgen's segment tree)."""

    name = "hawkeye"
    WINDOW = 8  # OPTgen's history, in cache capacities (the paper's 8x)
    COUNTER_MAX = 7  # 3-bit counters
    FRIENDLY_AT = 4  # top bit set
    FEATURES = ("length", "position", "uses")

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.averse: OrderedDict[bytes, None] = OrderedDict()
        self.friendly: OrderedDict[bytes, None] = OrderedDict()
        self.counters: dict[tuple, int] = {}
        self.sig: dict[bytes, tuple] = {}  # stored blocks: signature of their last access
        # key -> [time, signature or None (pending), uses, idle], in access order
        self.history: OrderedDict[bytes, list] = OrderedDict()
        self.occ: _MaxTree | None = None
        self.window = 0
        self.clock = 0
        self.seg: dict[bytes, list] = {}  # this request's accesses
        self.pending: list[tuple[bytes, list, int]] = []  # touched, to classify at the first add
        self.seg_len = 0
        self.adding = False

    def _train(self, sig: tuple | None, up: bool) -> None:
        if sig is None:
            return
        c = self.counters.get(sig, self.FRIENDLY_AT)
        self.counters[sig] = min(c + 1, self.COUNTER_MAX) if up else max(c - 1, 0)

    def _friendly(self, sig: tuple) -> bool:
        return self.counters.get(sig, self.FRIENDLY_AT) >= self.FRIENDLY_AT

    def _signature(self, length: int, position: int, uses: int, idle: int) -> tuple:
        cap = max(1, self.window // self.WINDOW)
        feats = {"length": length.bit_length(), "position": (position + 1).bit_length(),
                 "uses": uses.bit_length(), "idle": (idle // cap).bit_length() if idle >= 0 else -1}
        return tuple(feats[f] for f in self.FEATURES)

    def _access(self, key: bytes, nbytes: int) -> list:
        """OPTgen on one access of ``key``; its history entry (signature still to set)."""
        if self.occ is None:
            self.window = self.WINDOW * max(1, self.capacity_bytes // max(1, nbytes))
            self.occ = _MaxTree(self.window)
        w, now, occ, hist = self.window, self.clock, self.occ, self.history
        while hist:
            old = next(iter(hist))
            if hist[old][0] > now - w:
                break
            self._train(hist.pop(old)[1], False)  # no reuse within the window: OPT missed it
        slot = now % w
        stale = occ.max(slot, slot + 1)
        if stale:
            occ.add(slot, slot + 1, -stale)
        prev = hist.pop(key, None)
        uses, idle = 0, -1
        if prev is not None:
            t0, sig0, uses = prev[0], prev[1], prev[2]
            idle = now - t0
            s0 = t0 % w
            spans = [(s0, slot)] if s0 < slot else [(s0, w), (0, slot)] if slot else [(s0, w)]
            if max(occ.max(a, b) for a, b in spans if a < b) + nbytes <= self.capacity_bytes:
                for a, b in spans:
                    if a < b:
                        occ.add(a, b, nbytes)
                self._train(sig0, True)
            else:
                self._train(sig0, False)
        entry = [now, None, uses + 1, idle]
        hist[key] = entry
        self.clock = now + 1
        return entry

    def _classify(self, key: bytes, entry: list, position: int, length: int) -> None:
        sig = entry[1] = self._signature(length, position, entry[2] - 1, entry[3])
        if key in self._entries and key not in self._pinned:
            self.sig[key] = sig
            self._place(key, self._friendly(sig))

    def _end_request(self) -> None:
        for key, entry, position in self.pending:
            self._classify(key, entry, position, self.seg_len)
        self.pending.clear()
        self.seg.clear()
        self.seg_len = 0
        self.adding = False

    def _observe_add(self, key: bytes, info: BlockInfo) -> None:
        if not self.adding:
            self.seg_len = max(self.seg_len, info.position + 1)
            self.adding = True
            for k, entry, position in self.pending:
                self._classify(k, entry, position, self.seg_len)
            self.pending.clear()
        entry = self.seg.get(key)
        if entry is None:
            entry = self.seg[key] = self._access(key, info.nbytes)
        self._classify(key, entry, info.position, self.seg_len)

    def _observe_touch(self, key: bytes) -> bool:
        """Whether this touch is the request's first access of ``key``."""
        if self.adding:
            self._end_request()
        if key in self.seg:
            return False
        info = self._entries[key]
        entry = self.seg[key] = self._access(key, info.nbytes)
        self.seg_len = max(self.seg_len, info.position + 1)
        self.pending.append((key, entry, info.position))
        return True

    def _place(self, key: bytes, friendly: bool) -> None:
        src, dst = (self.averse, self.friendly) if friendly else (self.friendly, self.averse)
        src.pop(key, None)
        dst[key] = None
        dst.move_to_end(key)

    def _admit(self, key: bytes, info: BlockInfo) -> None:
        self.friendly[key] = None
        self._observe_add(key, info)

    def _used(self, key: bytes) -> None:
        if self._observe_touch(key):
            self._place(key, True)

    def _forget(self, key: bytes, info: BlockInfo, evicted: bool) -> None:
        if key in self.averse:
            del self.averse[key]
        else:
            del self.friendly[key]
        self.sig.pop(key, None)

    def _pick(self) -> bytes | None:
        if self.averse:
            return next(iter(self.averse))
        key = next(iter(self.friendly), None)
        if key is not None:
            self._train(self.sig.get(key), False)  # a friendly block aged out: detrain
        return key


CANDIDATES: dict[str, Callable[[int], EvictionIndex]] = {
    cls.name: cls for cls in (LfuAged, LfuDa, S3Fifo, ArcLongGhosts, LruSeen, ArcSeen, Lirs, Hawkeye)
}
