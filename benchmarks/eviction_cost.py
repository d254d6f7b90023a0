"""What an eviction policy costs per operation: the index's insert, touch and evict, each
policy against LRU in the same run.

    python -m benchmarks.eviction_cost [--blocks 4096] [--chain 64] [--rounds 5]

The index is driven the way a tier drives it: chains of ``--chain`` blocks are added tail
first (as the store puts them), an earlier chain is touched tail first (a hit), and victims
are evicted to make room for the next chain, so every eviction is real work (walk to a
leaf, drop it, keep ghosts). Times
are nanoseconds per operation, the median of ``--rounds``; the in-run baseline is LRU.
``evict_spare_ns`` repeats each round with every eviction sparing the chain the last hit
touched, as a one-tier store spares the prefix an ingest found stored. The
store benchmark (``benchmarks.store --policy arc,lru``) measures the same cost end to end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from cacheseek.store.eviction import POLICIES, make_index
from cacheseek.store.tier import BlockInfo

from .report import table, write_json

FRAME = 10 << 20  # bytes a block counts for (only the ratio to the budget matters)


def _chains(count: int, length: int, seed: int) -> list[list[tuple[bytes, BlockInfo]]]:
    out = []
    for c in range(count):
        parent = b"\0" * 16
        chain = []
        for pos in range(length):
            key = (seed * 1_000_003 + c * 4099 + pos).to_bytes(16, "little")
            chain.append((key, BlockInfo(FRAME, 2 * FRAME, parent, pos)))
            parent = key
        out.append(chain)
    return out


def one_round(policy: str, blocks: int, chain: int, seed: int, spare: bool = False) -> dict[str, float]:
    index = make_index(policy, blocks * FRAME)
    spared: set[bytes] = set()  # with ``spare``: the chain the last hit touched, as a one-tier store spares a found prefix
    chains = _chains(4 * blocks // chain, chain, seed)
    t_add = t_touch = t_evict = 0.0
    n_add = n_touch = n_evict = 0
    clock = time.perf_counter_ns
    for i, blocks_of in enumerate(chains):
        while index.used_bytes + chain * FRAME > index.capacity_bytes and len(index):
            t0 = clock()
            victim = index.victim(spared)
            if victim is None:  # everything left is spared: as the store, give the spare up
                victim = index.victim()
            index.remove(victim, evicted=True)
            t_evict += clock() - t0
            n_evict += 1
        t0 = clock()
        for key, info in reversed(blocks_of):  # tail first, as the store puts a chain
            index.add(key, info)
        t_add += clock() - t0
        n_add += len(blocks_of)
        # a hit on an earlier chain still held (every third chain back), touched tail first
        if i >= 3:
            keys = [k for k, _ in chains[i - 3] if k in index]
            t0 = clock()
            index.touch(reversed(keys))
            t_touch += clock() - t0
            n_touch += len(keys)
            if spare:
                spared = set(keys)
    return {"add_ns": t_add / max(n_add, 1), "touch_ns": t_touch / max(n_touch, 1),
            "evict_ns": t_evict / max(n_evict, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096, help="blocks the index holds")
    ap.add_argument("--chain", type=int, default=64, help="blocks per chain")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    spared: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(args.rounds):  # policies take turns, so load from elsewhere falls on all alike
        for p in policies:
            samples[p].append(one_round(p, args.blocks, args.chain, seed=r))
            spared[p].append(one_round(p, args.blocks, args.chain, seed=r, spare=True)["evict_ns"])
    rows: list[dict[str, Any]] = []
    base = {op: statistics.median(s[op] for s in samples["lru"]) for op in ("add_ns", "touch_ns", "evict_ns")} \
        if "lru" in samples else None
    for p in policies:
        row: dict[str, Any] = {"policy": p}
        for op in ("add_ns", "touch_ns", "evict_ns"):
            row[op] = statistics.median(s[op] for s in samples[p])
            if base:
                row[op.replace("_ns", " vs lru")] = row[op] / base[op]
        # An eviction that spares the chain the last hit found (a one-tier store's ingest of
        # a prompt whose prefix it holds), against the same policy's plain eviction.
        row["evict_spare_ns"] = statistics.median(spared[p])
        row["spare vs plain"] = row["evict_spare_ns"] / row["evict_ns"]
        rows.append(row)
    cols = ["policy", "add_ns", "touch_ns", "evict_ns"] + (["add vs lru", "touch vs lru", "evict vs lru"] if base else [])
    cols += ["evict_spare_ns", "spare vs plain"]
    print(table(rows, cols, title=f"eviction index cost per operation ({args.blocks} blocks, chains of {args.chain})"))
    from pathlib import Path

    path = write_json("eviction_cost", {"blocks": args.blocks, "chain": args.chain, "rounds": args.rounds,
                                        "rows": rows}, Path(args.out) if args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
