"""Reference hit rates for a trace, computed on block ids alone (no store): the infinite
cache (the trace's ceiling), Belady's optimal policy for a prefix cache, and a plain LRU
(the store's replay must agree with it).

Counting: per block in arrival order; a request hits the longest prefix of its ``hash_ids``
that is cached, then every block of the request is cached (a request's KV exists once it
has been computed; the references may decline to keep it, as ``belady`` does).

Belady for a prefix cache. A block is useful at a later request only if its whole prefix
is cached then too. We compute MIN (evict the block whose next request is farthest in the
future; a block that no later request names is farthest of all) with two refinements:
ties go to the deeper block, and a new block whose next use is at least as far as every
cached block's is not admitted (bypass). Why it is optimal for prefix hits: a block's next
use is never earlier than its parent's (every request naming it names its parent), so
with deeper-first ties a child always leaves before its parent, the cached set stays
closed under prefixes, and every cached block of a request lies in its hit prefix: prefix
hits equal plain hits. MIN with bypass maximizes plain hits over every policy, and for any
policy prefix hits are at most plain hits; so no policy gets more prefix hits.
``belady_prefix`` checks the equality as it runs.

Two countings (``full_blocks_only``). The issue's: every block of a request is cached,
its partial last block too. The store's: ``PrefixCache`` hashes and stores full blocks
only (the suffix after the last full block is recomputed, as in vLLM and SGLang), so a
request's partial last block (``input_length`` not a multiple of ``block_tokens``) is
requested and counted but never cached and never a hit. The references and the replay
take the same flag, so their comparisons stay fair.

``min_fifo_ties`` is MIN without those refinements (ties to the earliest cached block,
every block admitted): the figures quoted in issue 19 (26.5% / 45.6% / 49.1%) are of this
kind; it can evict a head before its tail and so wastes room on unreachable tails.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .format import Request

NEVER = 1 << 62
Observer = Callable[[int, int], None]  # (request index, its prefix hits)


@dataclass(frozen=True, slots=True)
class RefResult:
    name: str
    budget_blocks: int | None
    hit_blocks: int
    requested_blocks: int
    hit_tokens: int
    requested_tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.name, "budget_blocks": self.budget_blocks, "hit_blocks": self.hit_blocks,
                "requested_blocks": self.requested_blocks, "block_hit_rate": self.block_hit_rate,
                "hit_tokens": self.hit_tokens, "requested_tokens": self.requested_tokens,
                "token_hit_rate": self.token_hit_rate}


def block_tokens_of(req: Request, block_tokens: int) -> list[int]:
    """Tokens each block of ``req`` covers: ``block_tokens``, the last one what is left."""
    n = len(req.hash_ids)
    if not n:
        return []
    last = req.input_length - (n - 1) * block_tokens
    last = block_tokens if not 0 < last <= block_tokens else last
    return [block_tokens] * (n - 1) + [last]


def distinct_blocks(trace: Sequence[Request], block_tokens: int = 512, full_blocks_only: bool = False) -> int:
    """How many blocks a cache of ``trace`` can hold at most: its distinct stored ids."""
    return len({x for req in trace for x in req.hash_ids[: cached_blocks(req, block_tokens, full_blocks_only)]})


def cached_blocks(req: Request, block_tokens: int, full_blocks_only: bool) -> int:
    """How many leading blocks of ``req`` a cache may hold: all of them, or, with
    ``full_blocks_only``, all but a partial last block (a trace without ``input_length``
    has none: every block counts as full)."""
    n = len(req.hash_ids)
    if not full_blocks_only or not n:
        return n
    last = req.input_length - (n - 1) * block_tokens
    return n - 1 if 0 < last < block_tokens else n


def hit_tokens(req: Request, hits: int, block_tokens: int) -> int:
    if hits <= 0:
        return 0
    return sum(block_tokens_of(req, block_tokens)[:hits])


def requested_tokens(req: Request, block_tokens: int) -> int:
    return sum(block_tokens_of(req, block_tokens))


def totals(name: str, budget: int | None, trace: Sequence[Request], hits: list[int], block_tokens: int) -> RefResult:
    """A result from the hit prefix length of each request of ``trace``."""
    return RefResult(name, budget, sum(hits), sum(len(r.hash_ids) for r in trace),
                     sum(hit_tokens(r, h, block_tokens) for r, h in zip(trace, hits)),
                     sum(requested_tokens(r, block_tokens) for r in trace))


def prefix_hits(ids: Sequence[int], cached) -> int:
    """How many of ``ids``, from the first, are in ``cached``: a request's prefix hit."""
    n = 0
    for x in ids:
        if x not in cached:
            break
        n += 1
    return n


def infinite(trace: Sequence[Request], block_tokens: int = 512, full_blocks_only: bool = False) -> RefResult:
    seen: set[int] = set()
    hits = []
    for req in trace:
        ids = req.hash_ids[: cached_blocks(req, block_tokens, full_blocks_only)]
        hits.append(prefix_hits(ids, seen))
        seen.update(ids)
    return totals("infinite", None, trace, hits, block_tokens)


def lru(trace: Sequence[Request], budget_blocks: int, block_tokens: int = 512, full_blocks_only: bool = False,
        observe: Observer | None = None) -> RefResult:
    """LRU touching each request's blocks tail first (the head most recent), as the store
    does. ``observe(t, hits)``: told each request's hits before its blocks are cached."""
    order: OrderedDict[int, None] = OrderedDict()
    hits = []
    for t, req in enumerate(trace):
        ids = req.hash_ids[: cached_blocks(req, block_tokens, full_blocks_only)]
        hits.append(prefix_hits(ids, order))
        if observe is not None:
            observe(t, hits[-1])
        for x in reversed(ids):
            if x in order:
                order.move_to_end(x)
            else:
                order[x] = None
                if len(order) > budget_blocks:
                    order.popitem(last=False)
    return totals("lru-reference", budget_blocks, trace, hits, block_tokens)


def next_uses(trace: Sequence[Request], block_tokens: int = 512, full_blocks_only: bool = False) -> list[list[int]]:
    """For each request and block it may cache, the index of the next request naming that
    block among those it may cache (NEVER if none)."""
    out: list[list[int]] = [[] for _ in trace]
    last: dict[int, int] = {}
    for t in range(len(trace) - 1, -1, -1):
        ids = trace[t].hash_ids[: cached_blocks(trace[t], block_tokens, full_blocks_only)]
        out[t] = [last.get(x, NEVER) for x in ids]
        for x in ids:
            last[x] = t
    return out


def belady_prefix(trace: Sequence[Request], budget_blocks: int, block_tokens: int = 512,
                  nxt: list[list[int]] | None = None, full_blocks_only: bool = False,
                  observe: Observer | None = None) -> RefResult:
    """Optimal prefix hits at ``budget_blocks`` (see the module doc). ``nxt``: from
    ``next_uses`` with the same ``full_blocks_only``. ``observe(t, hits)``: told each
    request's hits before its blocks are cached."""
    nxt = nxt if nxt is not None else next_uses(trace, block_tokens, full_blocks_only)
    cached: dict[int, tuple[int, int]] = {}  # id -> its heap key (-next use, -position)
    heap: list[tuple[tuple[int, int], int]] = []
    hits = []
    for t, req in enumerate(trace):
        ids = req.hash_ids[: len(nxt[t])]
        n = prefix_hits(ids, cached)
        present = sum(1 for x in ids if x in cached)
        if present != n:
            raise RuntimeError(f"belady_prefix: request {t} has cached blocks outside its hit prefix")
        hits.append(n)
        if observe is not None:
            observe(t, n)
        for i, (x, nu) in enumerate(zip(ids, nxt[t])):
            key = (-nu, -i)
            if x not in cached and len(cached) >= budget_blocks:
                if not cached:
                    continue  # no room at all (a budget of 0)
                while heap[0][0] != cached.get(heap[0][1]):
                    heapq.heappop(heap)  # stale entry
                if key <= heap[0][0]:
                    continue  # next used no sooner than anything cached: not admitted
                del cached[heapq.heappop(heap)[1]]
            cached[x] = key
            heapq.heappush(heap, (key, x))
    return totals("belady", budget_blocks, trace, hits, block_tokens)


def min_fifo_ties(trace: Sequence[Request], budget_blocks: int, block_tokens: int = 512,
                  nxt: list[list[int]] | None = None, full_blocks_only: bool = False) -> RefResult:
    """MIN with every block admitted and ties to the block cached earliest (not prefix-aware)."""
    nxt = nxt if nxt is not None else next_uses(trace, block_tokens, full_blocks_only)
    cached: dict[int, tuple[int, int]] = {}
    heap: list[tuple[tuple[int, int], int]] = []
    hits = []
    seq = 0
    for t, req in enumerate(trace):
        ids = req.hash_ids[: len(nxt[t])]
        hits.append(prefix_hits(ids, cached))
        for x, nu in zip(ids, nxt[t]):
            if x not in cached:
                if budget_blocks < 1:
                    continue  # no room at all
                while len(cached) >= budget_blocks:
                    k, y = heapq.heappop(heap)
                    if cached.get(y) == k:
                        del cached[y]
                seq += 1
                key = (-nu, seq)
            else:
                key = (-nu, cached[x][1])
            cached[x] = key
            heapq.heappush(heap, (key, x))
    return totals("min-fifo-ties", budget_blocks, trace, hits, block_tokens)
