"""What a Redis tier's budget asks of Redis's own memory settings (``INFO memory``).

The budget (``redis_bytes``) counts frame bytes. Redis keeps each frame in one allocation of
its allocator, jemalloc by default, which rounds a large allocation up to one of four size
classes per power of two (1.25, 1.5, 1.75 and 2 times it). A frame is a power-of-two payload
plus its header, just past a power of two: the worst case, a quarter more (a 33.5 MB
Llama-3-8B block takes 40 MiB). With Redis's per-key overhead, the index (a hash field and a
sorted-set entry a block) and the scripts' replies, a namespace at its budget takes up to
``JEMALLOC_FACTOR`` x ``redis_bytes`` + ``FIXED_BYTES`` of Redis; with the C library's
allocator (large allocations are mapped whole pages), ``OTHER_FACTOR``.

Below that ``maxmemory``, Redis fills before the budget does: under ``noeviction`` every write
is refused from then on (the budget, never reached, evicts nothing), and under ``volatile-*``
Redis evicts frames behind the index, a chain's head before its tail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

JEMALLOC_FACTOR = 1.3  # 1.25 for the size classes, the rest for keys, the index and fragmentation
OTHER_FACTOR = 1.1
FIXED_BYTES = 64 << 20  # the scripts' replies kept for a minute, Redis's own buffers


def maxmemory_needed(redis_bytes: int, allocator: str = "jemalloc") -> int:
    """The ``maxmemory`` a namespace of ``redis_bytes`` needs under ``allocator``
    (``INFO memory``'s ``mem_allocator``)."""
    factor = JEMALLOC_FACTOR if allocator.startswith("jemalloc") else OTHER_FACTOR
    return int(redis_bytes * factor) + FIXED_BYTES


def sizing_problems(memory: Mapping[str, Any], redis_bytes: int, where: str = "Redis") -> list[str]:
    """What is wrong for a budget of ``redis_bytes`` with one Redis's ``INFO memory``
    (``maxmemory`` 0: no limit, nothing to say of it)."""
    out = []
    policy = str(memory.get("maxmemory_policy", ""))
    if policy.startswith("allkeys-"):
        out.append(f"{where}'s maxmemory-policy is {policy}: Redis may evict the shared index itself and lose the "
                   "accounting of the whole namespace; use noeviction, or volatile-lru with a ttl (docs/redis.md)")
    try:
        maxmemory = int(memory.get("maxmemory", 0))
    except (TypeError, ValueError):
        return out
    allocator = str(memory.get("mem_allocator", "jemalloc"))
    needed = maxmemory_needed(redis_bytes, allocator)
    if 0 < maxmemory < needed:
        mib = 1 << 20
        fill = "every write is refused once it is full" if policy == "noeviction" else \
            "Redis evicts frames behind the index once it is full"
        out.append(f"{where}'s maxmemory ({maxmemory / mib:,.0f} MiB) is below what redis_bytes "
                   f"({redis_bytes / mib:,.0f} MiB) takes there ({needed / mib:,.0f} MiB with {allocator.split('-')[0]}: "
                   f"a frame takes up to a quarter more in Redis's allocator than its bytes): Redis fills before the "
                   f"budget does, and {fill}. Raise maxmemory or lower redis_bytes (docs/redis.md)")
    return out
