"""Eviction policies on request traces in seconds: ``cacheseek.trace.blocksim`` drives each
policy's real ``EvictionIndex`` the way the store's replay does (same hits, block for
block, as ``benchmarks.trace_replay`` for a CPU tier alone), next to Belady's optimum.

    python -m benchmarks.policy_sim [--trace PATH] [--policies lru,arc] [--candidates]
                                    [--blocks 1024,3277,4096] [--countings issue,store]

Traces: the Mooncake synthetic trace (or --trace) and the synthetic shapes of
``cacheseek.trace.synth`` (seed 1). Countings: ``issue``, every block of a request stored
(issue 19's); ``store``, a request's partial last block requested but never stored nor hit
(``PrefixCache`` stores full blocks only). ``--candidates`` adds the policies tried and
not adopted (``benchmarks/policy_candidates.py``). Prints, per trace, counting and budget,
each policy's block hit rate and its share of Belady's; and, for the first trace at the
first budget, where Belady's hits come from (``belady_profile``) and how far a policy that
knows one bit of the future gets (``reuse_bit_bound``); at every budget, the best static
cache (``static_oracle``); and how a prefix's requests recur (``family_arrivals``); writes
benchmarks/results/policy_sim.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from cacheseek.store.eviction import POLICIES
from cacheseek.trace import blocksim, reference, synth
from cacheseek.trace.format import load_trace

from .policy_candidates import CANDIDATES
from .report import table, write_json

ROOT = Path(__file__).resolve().parent.parent
FULL_TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic.jsonl"
COUNTINGS = {"issue": False, "store": True}


def compare(trace, policies: dict, budgets, full_blocks_only: bool) -> list[dict]:
    nxt = reference.next_uses(trace, full_blocks_only=full_blocks_only)
    rows = []
    for c in budgets:
        best = reference.belady_prefix(trace, c, nxt=nxt, full_blocks_only=full_blocks_only).block_hit_rate
        row = {"blocks": c, "belady %": round(100 * best, 2)}
        for name, policy in policies.items():
            got = blocksim.simulate(trace, policy, c, full_blocks_only=full_blocks_only).block_hit_rate
            row[f"{name} %"] = round(100 * got, 2)
            row[f"{name} of belady"] = round(got / best, 3) if best else None
        rows.append(row)
    return rows


def belady_profile(trace, budget: int) -> dict:
    """Where Belady's hits come from at ``budget`` (issue counting): how long each hit block
    had been idle (requested blocks since its previous use), the hits per quarter of the
    trace (LRU's beside), and, per use count so far, how often Belady keeps a block until
    its next use (what an online policy would have to guess from the count)."""
    nxt = reference.next_uses(trace)
    last_use: dict[int, int] = {}
    uses: Counter = Counter()
    idle: Counter = Counter()
    quarters = [0, 0, 0, 0]
    kept_by_count: dict[int, list[int]] = {}
    pending: dict[int, int] = {}  # block -> its use count at its last access (awaiting its next)
    clock = 0

    def observe(t: int, n: int) -> None:  # Belady's hits of request t, before it caches its blocks
        nonlocal clock
        ids = trace[t].hash_ids
        quarters[4 * t // len(trace)] += n
        for i, x in enumerate(ids):
            if x in pending:
                kept_by_count.setdefault(pending.pop(x), [0, 0])[0] += i < n
            if i < n:
                idle[max(0, clock - last_use[x]).bit_length()] += 1
        for x, nu in zip(ids, nxt[t]):
            c = min(uses[x], 6)
            kept_by_count.setdefault(c, [0, 0])[1] += 1
            if nu < reference.NEVER:
                pending[x] = c
            uses[x] += 1
            last_use[x] = clock
        clock += len(ids)

    reference.belady_prefix(trace, budget, nxt=nxt, observe=observe)
    lru_quarters = [0, 0, 0, 0]

    def observe_lru(t: int, n: int) -> None:
        lru_quarters[4 * t // len(trace)] += n

    reference.lru(trace, budget, observe=observe_lru)
    total = sum(idle.values())
    return {"budget_blocks": budget, "belady_hits": total,
            "hits_idle_at_least_budget": round(sum(v for k, v in idle.items() if k and 1 << (k - 1) >= budget) / total, 3),
            "hits_by_idle_blocks_log2": {f"<{1 << k}": v for k, v in sorted(idle.items())},
            "belady_hits_per_quarter": quarters, "lru_hits_per_quarter": lru_quarters,
            "kept_until_next_use_by_prior_uses": {("6+" if c == 6 else str(c)): round(k / a, 3)
                                                  for c, (k, a) in sorted(kept_by_count.items())}}


def _bit_lru(trace, budget: int, soon) -> int:
    """Hits of an LRU that admits (at the MRU end) and keeps fresh only the accesses
    ``soon(t, i)`` says are reused soon; any other access moves its block to the LRU end."""
    order: dict[int, None] = {}
    hits = 0
    for t, req in enumerate(trace):
        ids = req.hash_ids
        n = reference.prefix_hits(ids, order)
        hits += n
        for i in range(len(ids) - 1, -1, -1):
            x = ids[i]
            if soon(t, i):
                order.pop(x, None)
                order[x] = None
                if len(order) > budget:
                    del order[next(iter(order))]
            elif x in order:  # to the LRU end: rebuild the front (rare next to the rest)
                del order[x]
                order = {x: None, **order}
    return hits


def reuse_bit_bound(trace, budget: int, horizons=(4, 8), thresholds=(0.1, 0.2, 0.3, 0.4, 0.5)) -> dict:
    """Share of Belady for an LRU told, at each access, one bit: is this block requested
    again within ``h x budget`` requested blocks? First the true bit (an oracle); then the
    bit guessed from what an online policy sees, the block's use count so far (0-7+) and
    how long it has been idle (log2 of requested blocks), with each class's probability of
    a reuse within the horizon measured over the whole trace in hindsight and compared
    with each threshold: the best a predictor on those two features can do."""
    nxt = reference.next_uses(trace)
    start = [0]
    for req in trace:
        start.append(start[-1] + len(req.hash_ids))
    uses: Counter = Counter()
    last: dict[int, int] = {}
    cls: list[list[tuple[int, int]]] = []
    for t, req in enumerate(trace):
        row = []
        for x in req.hash_ids:
            c = uses[x]
            row.append((min(c, 7), (start[t] - last[x]).bit_length() if c else -1))
        for x in req.hash_ids:
            uses[x] += 1
            last[x] = start[t]
        cls.append(row)
    best = reference.belady_prefix(trace, budget, nxt=nxt).hit_blocks
    out: dict = {"budget_blocks": budget, "oracle_bit": {}, "guessed_bit": {}}
    for h in horizons:
        horizon = h * budget
        bit = [[nu < reference.NEVER and start[nu] - start[t] <= horizon for nu in nxt[t]] for t in range(len(trace))]
        out["oracle_bit"][f"{h}x"] = round(_bit_lru(trace, budget, lambda t, i: bit[t][i]) / best, 3)
        seen: dict[tuple[int, int], list[int]] = {}
        for t in range(len(trace)):
            for i, k in enumerate(cls[t]):
                a = seen.setdefault(k, [0, 0])
                a[0] += bit[t][i]
                a[1] += 1
        prob = {k: a / n for k, (a, n) in seen.items()}
        out["guessed_bit"][f"{h}x"] = {str(th): round(_bit_lru(trace, budget, lambda t, i: prob[cls[t][i]] > th) / best, 3)
                                       for th in thresholds}
    return out


def static_oracle(trace, budgets) -> dict:
    """Block hit rate of the best *static* cache at each budget, as a share of Belady's:
    the blocks most used over the whole trace (perfect hindsight of every block's
    frequency; ties to the block seen first, so a parent comes before its children), a
    block a hit from its second request on. What a policy that ranks blocks by their
    rate of use could reach if it knew the rates exactly and paid nothing to learn them."""
    uses: Counter = Counter(x for req in trace for x in req.hash_ids)  # keys in order first seen
    ranked = sorted(uses, key=lambda x: -uses[x])  # stable: ties stay in that order
    nxt = reference.next_uses(trace)
    total = sum(len(req.hash_ids) for req in trace)
    out = {}
    for c in budgets:
        chosen = set(ranked[:c])
        present: set[int] = set()
        hits = 0
        for req in trace:
            hits += reference.prefix_hits(req.hash_ids, present)
            present.update(x for x in req.hash_ids if x in chosen)
        best = reference.belady_prefix(trace, c, nxt=nxt).hit_blocks
        out[str(c)] = {"hit %": round(100 * hits / total, 2), "of belady": round(hits / best, 3)}
    return out


def family_arrivals(trace) -> dict:
    """How a request's prefix recurs. A family: the requests whose chains start with the
    same block. Per family, the gaps between its requests in requested blocks; the
    coefficient of variation (std / mean) of each family's gaps, for families with at least
    three (1 for a memoryless, Poisson arrival; near 0 for a periodic one). A median near 1
    says that when a family returns is close to a coin toss at its rate: what the past can
    tell an online policy is the rate, which ``static_oracle`` already knows exactly."""
    clock = 0
    arrivals: dict[int, list[int]] = {}
    for req in trace:
        if req.hash_ids:
            arrivals.setdefault(req.hash_ids[0], []).append(clock)
        clock += len(req.hash_ids)
    cvs, gaps = [], []
    for times in arrivals.values():
        g = [b - a for a, b in zip(times, times[1:])]
        gaps += g
        if len(g) >= 3:
            mean = statistics.mean(g)
            cvs.append(statistics.pstdev(g) / mean if mean else 0.0)
    cvs.sort()
    gaps.sort()
    return {"families": len(arrivals), "single_request": sum(len(t) == 1 for t in arrivals.values()),
            "families_with_3_gaps": len(cvs), "median_gap_cv": round(cvs[len(cvs) // 2], 2) if cvs else None,
            "median_gap_blocks": gaps[len(gaps) // 2] if gaps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(FULL_TRACE))
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {sorted(POLICIES)}")
    ap.add_argument("--candidates", action="store_true", help=f"add {sorted(CANDIDATES)}")
    ap.add_argument("--blocks", default="1024,3277,4096")
    ap.add_argument("--countings", default="issue,store", help="issue, store or both")
    ap.add_argument("--no-shapes", action="store_true", help="the trace only")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    policies: dict = {}
    for name in args.policies.split(","):
        if name not in POLICIES:
            ap.error(f"unknown policy {name!r}; one of {sorted(POLICIES)}")
        policies[name] = name
    if args.candidates:
        policies.update(CANDIDATES)
    countings = args.countings.split(",")
    for c in countings:
        if c not in COUNTINGS:
            ap.error(f"unknown counting {c!r}; one of {sorted(COUNTINGS)}")
    budgets = [int(b) for b in args.blocks.split(",")]

    traces = {Path(args.trace).stem: load_trace(args.trace, 512)}  # simulated in blocks of 512 tokens
    if not args.no_shapes:
        traces.update({name: gen(seed=1) for name, gen in synth.GENERATORS.items()})
    doc: dict = {"trace": Path(args.trace).name, "policies": list(policies), "results": {}}
    for tname, trace in traces.items():
        for counting in countings:
            start = time.perf_counter()
            rows = compare(trace, policies, budgets, COUNTINGS[counting])
            doc["results"][f"{tname}/{counting}"] = rows
            cols = ["blocks", "belady %"] + [f"{p} of belady" for p in policies]
            print(table(rows, cols, f"{tname}, {counting} counting ({time.perf_counter() - start:.0f} s)"), flush=True)
    first = next(iter(traces.values()))
    doc["belady_profile"] = prof = belady_profile(first, budgets[0])
    print(f"Belady at {budgets[0]} blocks on {next(iter(traces))}: {prof['hits_idle_at_least_budget']:.0%} of its hits "
          f"come to blocks idle for at least {budgets[0]} requested blocks; hits per quarter "
          f"{prof['belady_hits_per_quarter']} (LRU {prof['lru_hits_per_quarter']}); kept until the next use, "
          f"by uses so far: {prof['kept_until_next_use_by_prior_uses']}")
    # the smallest and largest budget: one, when --blocks names one
    doc["reuse_bit_bound"] = [reuse_bit_bound(first, b) for b in dict.fromkeys((budgets[0], budgets[-1]))]
    for bound in doc["reuse_bit_bound"]:
        print(f"LRU told whether each access is reused within h x {bound['budget_blocks']} blocks, share of Belady: "
              f"true bit {bound['oracle_bit']}; guessed from use count and idle time {bound['guessed_bit']}")
    doc["static_oracle"] = static = static_oracle(first, budgets)
    print("best static cache (every block's frequency known in hindsight), by budget: "
          + "; ".join(f"{c}: {v['hit %']}% ({v['of belady']:.0%} of Belady)" for c, v in static.items()))
    doc["family_arrivals"] = fam = family_arrivals(first)
    print(f"families (requests with the same first block): {fam['families']}, {fam['single_request']} of them "
          f"a single request; median CV of a family's gaps {fam['median_gap_cv']} over {fam['families_with_3_gaps']} "
          f"families with 3+ gaps (1: memoryless); median gap {fam['median_gap_blocks']} requested blocks")
    path = write_json("policy_sim", doc, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
