"""Hit rate on a request trace: the store's eviction policies against LRU, Belady and the
infinite cache, per codec and CPU budget; the disk tier's admission; other trace shapes.

    python -m benchmarks.trace_replay [--trace PATH] [--layout llama-3-8b] [--codecs raw,int8,int4,int2]
                                      [--cpu-gib 16,32,64,128] [--policies arc,lru] [--quick]
    python -m benchmarks.trace_replay --plot-only benchmarks/results/trace_replay.json --out docs

The default trace is benchmarks/traces/mooncake_synthetic.jsonl: the synthetic trace of the
Mooncake FAST'25 release (kvcache-ai/Mooncake on GitHub, FAST25-release/traces/, Apache-2.0;
see benchmarks/traces/NOTICE.md), 3,993 requests. Any trace in that format goes with --trace. Writes benchmarks/results/trace_replay.json and docs/hit-rate.png
(with ``--out DIR``: DIR/trace_replay.json and DIR/hit-rate.png; ``--plot`` names the plot).

Sections:
1. the anchor: block-level LRU and MIN at 1,024 / 3,277 / 4,096 blocks (issue 19's figures),
   in the issue's counting (every block of a request stored) and the store's (a request's
   partial last block never stored nor hit: ``PrefixCache`` stores full blocks only);
2. per codec and CPU budget, each policy replayed through the real TieredStore;
3. the disk tier with and without admission after two uses (bytes written, hits);
4. synthetic traces of other shapes (cacheseek.trace.synth), policy against LRU and Belady;
5. issue 19's goal: each policy replayed through the store at the anchor budgets, in both
   countings, as a share of Belady's hit rate in the same counting.
The in-run baseline is LRU: "vs lru" is the default policy's hit rate over LRU's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cacheseek.trace import reference, synth
from cacheseek.trace.format import load_trace
from cacheseek.trace.plan import TABLE_COLUMNS, format_table, layout_of, plan, table_rows
from cacheseek.trace.replay import ReplaySpec, replay

from .report import add_plot_only, load, plot_only, pyplot, save, source_line, write_json

ROOT = Path(__file__).resolve().parent.parent
FULL_TRACE = ROOT / "benchmarks" / "traces" / "mooncake_synthetic.jsonl"
ANCHOR_BLOCKS = (1024, 3277, 4096)


def _pct(x: float) -> float:
    return round(100 * x, 2)


def anchor(trace, full_blocks_only: bool = False) -> list[dict]:
    f = full_blocks_only
    nxt = reference.next_uses(trace, full_blocks_only=f)
    rows = []
    for c in ANCHOR_BLOCKS:
        rows.append({"blocks": c, "lru %": _pct(reference.lru(trace, c, full_blocks_only=f).block_hit_rate),
                     "min, fifo ties %": _pct(reference.min_fifo_ties(trace, c, nxt=nxt, full_blocks_only=f).block_hit_rate),
                     "belady (prefix) %": _pct(reference.belady_prefix(trace, c, nxt=nxt, full_blocks_only=f).block_hit_rate),
                     "infinite %": _pct(reference.infinite(trace, full_blocks_only=f).block_hit_rate)})
    return rows


def goal(trace, policies) -> list[dict]:
    """Issue 19's goal: each policy through the store at the anchor budgets, both countings."""
    rows = []
    for counting, f in (("issue", False), ("store", True)):
        nxt = reference.next_uses(trace, full_blocks_only=f)
        for c in ANCHOR_BLOCKS:
            belady = reference.belady_prefix(trace, c, nxt=nxt, full_blocks_only=f).block_hit_rate
            row = {"counting": counting, "blocks": c, "belady %": _pct(belady)}
            for p in policies:
                r = replay(trace, ReplaySpec(cpu_blocks=c, policy=p, full_blocks_only=f))
                row[f"{p} %"] = _pct(r.block_hit_rate)
                row[f"{p} of belady"] = round(r.block_hit_rate / belady, 3) if belady else None
            rows.append(row)
    return rows


def policies_at_blocks(trace, policies, budgets) -> list[dict]:
    nxt = reference.next_uses(trace)
    rows = []
    for c in budgets:
        belady = reference.belady_prefix(trace, c, nxt=nxt).block_hit_rate
        row = {"blocks": c, "belady %": _pct(belady)}
        for p in policies:
            r = replay(trace, ReplaySpec(cpu_blocks=c, policy=p))
            row[f"{p} %"] = _pct(r.block_hit_rate)
            row[f"{p} of belady"] = round(r.block_hit_rate / belady, 3) if belady else None
            row[f"{p} seconds"] = round(r.seconds, 1)
        rows.append(row)
    return rows


def admission(trace, cpu_blocks: int, disk_blocks: int, policy: str) -> list[dict]:
    rows = []
    for admit in (1, 2):
        r = replay(trace, ReplaySpec(cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, policy=policy,
                                     disk_admit_after_uses=admit))
        disk = next(t for t in r.tiers if t["name"] == "disk")
        rows.append({"admit after uses": admit, "hit %": _pct(r.block_hit_rate),
                     "cpu hits": r.hits_by_tier.get("cpu", 0), "disk hits": r.hits_by_tier.get("disk", 0),
                     "disk blocks written": disk["bytes_in"] // _stand_in_nbytes(),
                     "disk evictions": disk["evictions"]})
    base = rows[0]["disk blocks written"]
    for row in rows:
        row["written vs every block"] = round(row["disk blocks written"] / base, 3) if base else None
    return rows


def _stand_in_nbytes() -> int:
    from cacheseek.trace.replay import StandInFrames

    return StandInFrames(512).nbytes


def plot(docs: list[dict], out_dir: Path, name: str = "hit-rate") -> Path | None:
    """Hit rate against the CPU budget from section 2: a line per codec and policy, Belady's
    optimum dashed, the infinite cache flat."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    rows = doc["plan"]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colors = dict(zip(codecs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = dict(zip(policies, ["-", ":", "-."]))
    for codec in codecs:
        mine = [r for r in rows if r["codec"] == codec]
        budgets = sorted({r["cpu_bytes"] for r in mine})
        gib = [b / (1 << 30) for b in budgets]
        for policy in policies:
            ys = [100 * next(r["block_hit_rate"] for r in mine if r["cpu_bytes"] == b and r["policy"] == policy)
                  for b in budgets]
            ax.plot(gib, ys, styles[policy], marker="o", color=colors[codec], label=f"{codec}, {policy}")
        ys = [100 * next(r["belady_block_hit_rate"] for r in mine if r["cpu_bytes"] == b) for b in budgets]
        ax.plot(gib, ys, "--", color=colors[codec], alpha=0.6, label=f"{codec}, Belady (optimum)")
    ax.axhline(100 * rows[0]["infinite_block_hit_rate"], color="black", lw=1, label="infinite cache")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["cpu_bytes"] / (1 << 30) for r in rows}))
    ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_ylim(0, 100 * rows[0]["infinite_block_hit_rate"] * 1.1)
    ax.set_xlabel("CPU tier budget (GiB, log scale)")
    ax.set_ylabel("hit rate (% of requested 512-token blocks)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    trace = Path(doc["trace"]).name
    return save(fig, out_dir, name, note=source_line(doc),
                title=f"Hit rate on {trace} ({doc['requests']:,} requests), {doc['layout']}, CPU tier only, "
                      "per codec and eviction policy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(FULL_TRACE), help="a trace in the Mooncake format (default: the Mooncake synthetic trace)")
    ap.add_argument("--layout", default="llama-3-8b")
    ap.add_argument("--codecs", default="raw,int8,int4,int2")
    ap.add_argument("--cpu-gib", default="16,32,64,128", help="CPU tier budgets in GiB")
    ap.add_argument("--policies", default="arc,lru")
    ap.add_argument("--quick", action="store_true", help="sections 1 and 2 only, one codec (int4)")
    ap.add_argument("--plot", default=None, help="where the plot goes (default: docs/hit-rate.png; with --out, "
                                                 "hit-rate.png beside the JSON)")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    add_plot_only(ap)
    args = ap.parse_args(argv)
    if args.plot_only:
        args.out = Path(args.out) if args.out else None
        plot_only(args, plot)
        return 0

    trace = load_trace(args.trace, 512)  # the replay counts blocks of 512 tokens
    policies = args.policies.split(",")
    codecs = ["int4"] if args.quick else args.codecs.split(",")
    layout = layout_of(args.layout)
    print(f"trace {args.trace}: {len(trace)} requests, {sum(len(r.hash_ids) for r in trace)} blocks", flush=True)

    root = Path(__file__).resolve().parents[1]
    where = Path(args.trace).resolve()
    shown = where.relative_to(root).as_posix() if where.is_relative_to(root) else where.name  # no host paths
    doc: dict = {"trace": shown, "requests": len(trace), "layout": args.layout, "policies": policies}
    doc["anchor"] = anchor(trace)
    print(format_table(doc["anchor"], list(doc["anchor"][0]), "1. block-level references (issue 19's anchor)"))
    doc["anchor_store_counting"] = anchor(trace, full_blocks_only=True)
    print(format_table(doc["anchor_store_counting"], list(doc["anchor_store_counting"][0]),
                       "1b. the same, a request's partial last block never stored nor hit (the store's counting)"))

    rows = plan(trace, layout=layout, codecs=codecs, cpu_bytes=[int(float(g) * (1 << 30)) for g in args.cpu_gib.split(",")],
                policies=policies)
    doc["plan"] = [r.to_dict() for r in rows]
    print(format_table(table_rows(rows), TABLE_COLUMNS, f"2. {args.layout}, CPU tier only, per codec and budget"))

    default, baseline = policies[0], "lru"
    ratios = [r.result.block_hit_rate for r in rows if r.policy == default]
    bases = [r.result.block_hit_rate for r in rows if r.policy == baseline]
    if len(ratios) == len(bases) and baseline in policies and default != baseline:
        doc["vs_lru"] = [round(a / b, 3) if b else None for a, b in zip(ratios, bases)]
        print(f"{default} vs lru (hit-rate ratio, same run): {doc['vs_lru']}")

    if not args.quick:
        doc["admission"] = admission(trace, 1024, 4096, default)
        print(format_table(doc["admission"], list(doc["admission"][0]),
                           f"3. cpu 1,024 + disk 4,096 blocks, write-through, {default}: disk admission"))
        doc["shapes"] = {}
        for name, gen in synth.GENERATORS.items():
            shaped = gen(seed=1)
            doc["shapes"][name] = policies_at_blocks(shaped, policies, ANCHOR_BLOCKS)
            print(format_table(doc["shapes"][name], list(doc["shapes"][name][0]), f"4. synthetic shape: {name} (seed 1)"))

        doc["goal"] = goal(trace, policies)
        print(format_table(doc["goal"], list(doc["goal"][0]),
                           "5. issue 19's goal: share of Belady through the store, both countings"))

    path = write_json("trace_replay", doc, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    # A run into a folder of its own (a --quick one, another trace) must not redraw the
    # committed docs/hit-rate.png from its rows.
    where = Path(args.plot) if args.plot else path.parent / "hit-rate.png" if args.out else ROOT / "docs" / "hit-rate.png"
    png = plot([load(path)], where.parent, where.stem)
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
