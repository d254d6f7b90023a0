"""What a serving scheduler calls when a request is queued: prefetch its prefix where that pays.

A request waits in a scheduler's queue before its prefill runs; a stored prefix that lies in
a capacity tier (disk, Redis) can be promoted into memory meanwhile (``cache.prefetch``), so
that the materialize at prefill time reads memory. ``prefetch_queued`` decides and starts it:

- nothing stored, or the stored prefix already in memory: nothing to do (one lookup);
- with a ``ReusePlanner`` (the one ``prefill_with_reuse`` keeps per cache): only when reusing
  the prefix *from memory* is predicted to beat recomputing it; a prefix too short to be
  worth reading is not promoted, whatever tier holds it;
- else ``cache.prefetch(prompt)``: a ``Prefetch`` handle (embedded: ``wait``/``done``), or
  None when the cache started nothing (its limit of prefetches in flight).

The later ``prefill_with_reuse(..., prefetch=handle)`` needs nothing else: its materialize
waits only for the blocks still on their way, and the planner sees them in memory once they
have landed. Torch-free; works with ``PrefixCache`` and ``RemoteCache`` alike.
"""

from __future__ import annotations

from typing import Any

from .planner import ReusePlanner

MEMORY_TIERS = ("gpu", "cpu")


def prefetch_queued(cache: Any, prompt: Any, *, planner: ReusePlanner | None = None,
                    memory_tier: str = "cpu") -> Any:
    """Start promoting ``prompt``'s stored prefix into memory if it is in a capacity tier and
    reusing it from memory pays (see the module's docstring). A handle, or None."""
    located = cache.locate(prompt)
    if not located.num_tokens or all(t in MEMORY_TIERS for t in located.tiers):
        return None
    if planner is not None and not planner.decide([memory_tier] * len(located.tiers), located.num_tokens).reuse:
        return None
    return cache.prefetch(prompt)


__all__ = ["MEMORY_TIERS", "prefetch_queued"]
