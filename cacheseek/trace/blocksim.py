"""The store's replay without the store: a tier's ``EvictionIndex`` driven directly, for
trying eviction policies in seconds rather than a full replay's tens of seconds.

Per request, the calls a CPU tier's index receives from ``TieredStore`` under the replay
(``cacheseek.trace.replay``): the hit is the longest indexed prefix; it is touched tail
first (``touch_chain``); the blocks of the call that were already stored are touched tail
first (the ingest's ``touch_chain``, before its puts); ``victim()`` is evicted until all
the missing blocks fit (room made for the whole call first, so that none of its blocks
evicts another), then they are added tail first, each after evicting until it fits
(``CpuTier.put_many``); the call's stored prefix is never one of its victims. Every block counts one unit of
bytes, so a budget is in blocks. For one CPU tier the result equals the store's replay
with the same policy, block for block (a test checks it); frames, leases and tiers below
are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..store.eviction import EvictionIndex, make_index
from ..store.tier import BlockInfo
from .format import Request
from .reference import RefResult, cached_blocks, prefix_hits, totals

ROOT = -1  # the parent of a chain's head (ids are non-negative)


def simulate(trace: Sequence[Request], policy: str | Callable[[int], EvictionIndex], budget_blocks: int, *,
             block_tokens: int = 512, full_blocks_only: bool = False) -> RefResult:
    """Hits of ``policy`` (a name in ``POLICIES``, or a factory of an index from a
    capacity) on ``trace`` with room for ``budget_blocks`` blocks."""
    # Keyed by the trace's int ids, not bytes: an index only hashes and compares its keys,
    # though its annotations name the stores' keys (bytes).
    index: Any = make_index(policy, budget_blocks) if isinstance(policy, str) else policy(budget_blocks)
    hits = []
    for req in trace:
        keys = req.hash_ids[: cached_blocks(req, block_tokens, full_blocks_only)]
        n = prefix_hits(keys, index)
        hits.append(n)
        if n:
            index.touch(keys[n - 1 :: -1])
        present = index.contains_many(keys)
        spare = frozenset(keys[: next((i for i, p in enumerate(present) if not p), len(keys))])
        if any(present):  # the ingest's touch_chain of what it found stored (the hit again too)
            index.touch([k for k, p in zip(reversed(keys), reversed(present)) if p])
        need = len({k for k, p in zip(keys, present) if not p})
        if need <= index.capacity_bytes:
            _evict_until(index, need, spare)
        for i in range(len(keys) - 1, -1, -1):
            if present[i]:
                continue
            key = keys[i]
            if key in index:  # stored meanwhile (a chain that names a block twice)
                index.touch((key,))
                continue
            _evict_until(index, 1, spare)
            if index.used_bytes + 1 <= index.capacity_bytes:
                index.add(key, BlockInfo(1, 1, keys[i - 1] if i else ROOT, i))  # type: ignore[arg-type]  # (int ids)
    name = policy if isinstance(policy, str) else getattr(index, "name", "custom")
    return totals(name, budget_blocks, trace, hits, block_tokens)


def _evict_until(index: EvictionIndex, need: int, spare: frozenset = frozenset()) -> None:
    """Evict ``victim(spare)`` until ``need`` more blocks fit (or nothing may be evicted)."""
    while index.used_bytes + need > index.capacity_bytes:
        victim = index.victim(spare)
        if victim is None:
            return
        index.remove(victim, evicted=True)
