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
each policy's block hit rate and its share of Belady's; writes
benchmarks/results/policy_sim.json.
"""

from __future__ import annotations

import argparse
import sys
import time
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

    traces = {Path(args.trace).stem: load_trace(args.trace)}
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
    path = write_json("policy_sim", doc, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
