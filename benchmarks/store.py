"""Ingest and materialize throughput per tier and codec, against a plain copy.

    python -m benchmarks.store [--blocks 16] [--reps 5] [--codecs raw,int8,int4,int2] [--tiers gpu,cpu,disk]
    python -m benchmarks.store --plot-only benchmarks/results/h200/store.json --out docs
    python -m benchmarks.store --paged [--mla] | --batches | --fresh [--policy arc,lru] [--blocks 16,64] [--tiny]   (benchmarks/store_engine.py)
    python -m benchmarks.store --mixed [--blocks 16] [--reps 8] [--tiers gpu,cpu]

``--mixed``: a chain stored under a precision policy (its first block int8, the rest int2 or
K4/V2) against the same chain under the uniform low-bit codec, in the same run, per tier:
ingest (encode on the KV's device + copies) and materialize (copies + decode), the ratio of
the two (goal: the policy within 5%), medians of calls interleaved A B B A (the two caches
side by side in one process) so drift hits both alike.

Blocks are Llama-3-8B shaped: 32 layers x 8 KV heads x 256 tokens x 128, fp16 (33.5 MB
of raw KV each). Throughput is GB/s of *raw KV represented*. KV lives on the GPU when
there is one (ingest reads it there, materialize decodes there), else on the CPU.

In-run baseline: a plain copy of the same raw KV to the same place: with a GPU, a
device-to-pinned-host copy (ingest) and a pinned-host-to-device copy (materialize); on a
CPU-only machine, a memcpy. Ratios above 1 mean the store beats moving fp16 bytes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cacheseek as cs

from .report import add_plot_only, bars, legend_outside, plot_only, pyplot, redraw, save, source_line, table, write_json

LAYOUT = cs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
BLOCK = 256
CODECS = {
    "raw": cs.Raw(),
    "int8": cs.KIVI(bits=8, group_size=32),
    "int4": cs.KIVI(bits=4, group_size=32),
    "int2": cs.KIVI(bits=2, group_size=32),
    "k4v2": cs.KIVI(k_bits=4, v_bits=2, group_size=32),
    "int8@0+int2": cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32), rest=cs.KIVI(bits=2, group_size=32)),
    "int8@0+k4v2": cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32),
                                      rest=cs.KIVI(k_bits=4, v_bits=2, group_size=32)),
}
MIXED_PAIRS = (("int2", "int8@0+int2"), ("k4v2", "int8@0+k4v2"))  # (uniform, policy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, reps: int, device: torch.device, setup=None) -> float:
    return statistics.median(_seconds(fn, reps, device, setup))


def _seconds(fn, reps: int, device: torch.device, setup=None) -> list[float]:
    times = []
    for i in range(reps + 1):  # the first run warms up
        if setup:
            setup(i)
        _sync(device)
        start = time.perf_counter()
        fn(i)
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return times


def baseline(kv_device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of a plain copy of ``nbytes`` of fp16 KV to where the store would put it."""
    src = torch.randn(nbytes // 2, dtype=torch.float16, device=kv_device)
    if kv_device.type == "cuda":
        host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=True)
        d2h = _median_seconds(lambda i: host.copy_(src, non_blocking=True), reps, kv_device)
        h2d = _median_seconds(lambda i: src.copy_(host, non_blocking=True), reps, kv_device)
        return {"ingest_gbps": nbytes / d2h / 1e9, "materialize_gbps": nbytes / h2d / 1e9, "kind": "pinned D2H / H2D copy"}
    dst = torch.empty_like(src)
    t = _median_seconds(lambda i: dst.copy_(src), reps, kv_device)
    return {"ingest_gbps": nbytes / t / 1e9, "materialize_gbps": nbytes / t / 1e9, "kind": "memcpy"}


class Case:
    """One codec in one tier: a ``PrefixCache`` sized for two chains, and ``reps + 1``
    prompts made before any clock starts (a worker has its token ids at hand). Call ``i``
    of ``ingest`` stores prompt ``i`` after freeing prompt ``i - 1``'s blocks, so every
    call writes into reused memory; ``materialize`` loads the last prompt stored."""

    def __init__(self, codec_name: str, tier: str, kv, kv_device: torch.device, blocks: int, reps: int,
                 disk_root: Path, batch_bytes: str = "1GiB", policy: str = "arc") -> None:
        codec = CODECS[codec_name]
        frame_guess = max(c.encoded_nbytes(LAYOUT, BLOCK) for c in getattr(codec, "codecs", lambda: [codec])()) + 4096
        budget = frame_guess * blocks * 2 + (64 << 20)
        cfg = {
            "gpu": cs.TierConfig(gpu_bytes=budget, cpu_bytes=0, eviction=policy),
            "cpu": cs.TierConfig(cpu_bytes=budget, eviction=policy),
            "disk": cs.TierConfig(cpu_bytes=0, disk_path=disk_root / f"{codec_name.replace('@', '_')}-{policy}",
                                  disk_bytes=budget, eviction=policy),
        }[tier]
        self.name, self.tier, self.kv, self.kv_device = codec_name, tier, kv, kv_device
        self.cache = cs.PrefixCache(model_id="bench", layout=LAYOUT, codec=codec, block_tokens=BLOCK, tiers=cfg,
                                    max_batch_bytes=batch_bytes)
        self.tokens = blocks * BLOCK
        self.prompts = [[(i * 1_000_003 + j) % 120_000 for j in range(self.tokens)] for i in range(reps + 1)]
        self.stored: list[int] | None = None

    def clear(self, i: int) -> None:
        """Free the previous call's blocks (call ``i - 1``'s)."""
        for key in self.cache.block_hashes(self.prompts[i - 1]) if i else []:
            self.cache.store.delete(key)

    def ingest(self, i: int) -> None:
        self.cache.ingest(self.prompts[i], self.kv)
        self.stored = self.prompts[i]

    def check(self) -> None:
        if self.stored is None or self.cache.lookup(self.stored) != self.tokens:
            got = 0 if self.stored is None else self.cache.lookup(self.stored)
            raise RuntimeError(f"{self.name}/{self.tier}: ingest stored {got} of {self.tokens} tokens")

    def materialize(self, i: int) -> None:
        self.cache.materialize(self.stored, device=self.kv_device)

    def summary(self, ingest_s: list[float], materialize_s: list[float]) -> dict:
        t_ingest, t_mat = statistics.median(ingest_s), statistics.median(materialize_s)
        stats = self.cache.stats()["tiers"][0]
        raw = LAYOUT.raw_nbytes(self.tokens)
        return {
            "codec": self.name, "tier": self.tier,
            "ingest_gbps": raw / t_ingest / 1e9, "materialize_gbps": raw / t_mat / 1e9,
            "ingest_ms": t_ingest * 1e3, "materialize_ms": t_mat * 1e3,
            "ingest_ms_each": [round(t * 1e3, 3) for t in ingest_s],
            "materialize_ms_each": [round(t * 1e3, 3) for t in materialize_s],
            "stored_mb_per_block": stats["used_bytes"] / max(1, stats["blocks"]) / 1e6,
            "compression": stats["compression_ratio"],
        }


def run_case(codec_name: str, tier: str, kv, kv_device: torch.device, blocks: int, reps: int, disk_root: Path,
             batch_bytes: str = "1GiB", policy: str = "arc") -> dict:
    case = Case(codec_name, tier, kv, kv_device, blocks, reps, disk_root, batch_bytes, policy)
    try:
        ingest_s = _seconds(case.ingest, reps, kv_device, setup=case.clear)
        case.check()
        materialize_s = _seconds(case.materialize, reps, kv_device)
        return case.summary(ingest_s, materialize_s)
    finally:
        case.cache.close()


def _interleaved(cases: list[Case], op: str, reps: int, device: torch.device) -> list[list[float]]:
    """Seconds of ``op`` per call, per case, the cases' calls alternated A B B A ...: drift
    of the machine (clocks, other tenants) between calls hits every case alike."""
    times: list[list[float]] = [[] for _ in cases]
    for i in range(reps + 1):  # the first round warms up
        order = range(len(cases)) if i % 2 == 0 else reversed(range(len(cases)))
        for c in order:
            case = cases[c]
            if op == "ingest":
                case.clear(i)
            _sync(device)
            start = time.perf_counter()
            getattr(case, op)(i)
            _sync(device)
            if i:
                times[c].append(time.perf_counter() - start)
    return times


def run_mixed(kv, kv_device: torch.device, blocks: int, reps: int, tiers: list[str], disk_root: Path) -> list[dict]:
    """Each (uniform, policy) pair per tier, their calls interleaved; the policy's speed
    over the uniform's (medians)."""
    rows = []
    for uniform, mixed in MIXED_PAIRS:
        for tier in tiers:
            cases = [Case(name, tier, kv, kv_device, blocks, reps, disk_root / tier) for name in (uniform, mixed)]
            try:
                ingest_s = _interleaved(cases, "ingest", reps, kv_device)
                for case in cases:
                    case.check()
                materialize_s = _interleaved(cases, "materialize", reps, kv_device)
                got = [case.summary(i_s, m_s) for case, i_s, m_s in zip(cases, ingest_s, materialize_s)]
            finally:
                for case in cases:
                    case.cache.close()
            u, m = got
            row = {"uniform": uniform, "policy": mixed, "tier": tier, "blocks": blocks,
                   "uniform_ingest_gbps": u["ingest_gbps"], "policy_ingest_gbps": m["ingest_gbps"],
                   "ingest_ratio": m["ingest_gbps"] / u["ingest_gbps"],
                   "uniform_materialize_gbps": u["materialize_gbps"], "policy_materialize_gbps": m["materialize_gbps"],
                   "materialize_ratio": m["materialize_gbps"] / u["materialize_gbps"],
                   "uniform_mb_per_block": u["stored_mb_per_block"], "policy_mb_per_block": m["stored_mb_per_block"],
                   "uniform_ms_each": {"ingest": u["ingest_ms_each"], "materialize": u["materialize_ms_each"]},
                   "policy_ms_each": {"ingest": m["ingest_ms_each"], "materialize": m["materialize_ms_each"]}}
            rows.append(row)
            print(f"  {mixed:12s} vs {uniform:5s} {tier:5s}: ingest {row['ingest_ratio']:.3f}x, "
                  f"materialize {row['materialize_ratio']:.3f}x", flush=True)
    return rows


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """Ingest and materialize GB/s per codec and tier, with the plain copy drawn across."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    rows, base = doc["rows"], doc["baseline"]
    policies = sorted({r.get("policy") for r in rows} - {None})
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(rows)), 4.6))
    bars(ax, [f"{r['codec']} / {r['tier']}" + (f" / {r['policy']}" if len(policies) > 1 else "") for r in rows],
         {"ingest (KV to the tier)": [r["ingest_gbps"] for r in rows],
          "materialize (tier to KV)": [r["materialize_gbps"] for r in rows]}, log=True)
    ax.set_ylabel("GB/s of raw fp16 KV represented (log)")
    ax.set_xlabel("codec / tier" + (" / eviction policy" if len(policies) > 1 else ""))
    ax.axhline(base["ingest_gbps"], color="0.3", ls="--", lw=1,
               label=f"{base['kind']}: {base['ingest_gbps']:.1f} / {base['materialize_gbps']:.1f} GB/s")
    legend_outside(ax)
    raw_gb = cs.KVLayout.from_dict(doc["layout"]).raw_nbytes(doc["blocks"] * doc["block_tokens"]) / 1e9
    where = doc["machine"].get("gpu") or "CPU"
    return save(fig, out_dir, "store", note=source_line(doc),
                title=f"Store throughput: {doc['blocks']} Llama-3-8B blocks of {doc['block_tokens']} tokens "
                      f"({raw_gb:.2f} GB of fp16 KV on the {'GPU' if doc['kv_device'].startswith('cuda') else 'CPU'}), {where}"
                      + (f", {policies[0]} eviction" if len(policies) == 1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--blocks", default="16" if cuda else "2", help="blocks per call (engine modes: a list, 16,64)")
    ap.add_argument("--reps", type=int, default=5 if cuda else 2)
    ap.add_argument("--codecs", default="raw,int8,int4,int2")
    ap.add_argument("--tiers", default="gpu,cpu,disk" if cuda else "cpu,disk")
    ap.add_argument("--disk-dir", type=Path, default=None)
    ap.add_argument("--batch-bytes", default="1GiB", help="PrefixCache max_batch_bytes (ingest batch size)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--policy", default="arc", help="eviction policies, comma-separated (arc,lru: both, "
                                                    "interleaved per case; the ratio to the last is printed)")
    ap.add_argument("--paged", action="store_true", help="contiguous vs vLLM-paged KV (store_engine.py)")
    ap.add_argument("--mla", action="store_true", help="--paged: DeepSeek-V3's MLA latent pages, not Llama's")
    ap.add_argument("--batches", action="store_true", help="8 requests of 2K tokens: one batched call vs 8")
    ap.add_argument("--fresh", action="store_true", help="a fresh prompt and fresh KV per call, a full tier")
    ap.add_argument("--tiny", action="store_true", help="engine modes: a tiny layout (a CPU smoke test)")
    ap.add_argument("--mixed", action="store_true", help="precision policy chains vs the uniform low-bit codec")
    ap.add_argument("--staging-cap", type=int, default=None, metavar="MIB",
                    help="the device staging pool's cap in MiB (default: store/device_staging.py's)")
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    if args.staging_cap is not None:
        if args.staging_cap <= 0:
            ap.error(f"--staging-cap: expected MiB > 0, got {args.staging_cap}")
        from cacheseek.store import device_staging  # (set before any pool is made)

        device_staging.DEFAULT_CAP_BYTES["cuda"] = args.staging_cap << 20
    if args.paged or args.batches or args.fresh:
        return engine_modes(args, cuda)
    args.blocks = int(args.blocks)
    kv_device = torch.device("cuda" if cuda else "cpu")
    tokens = args.blocks * BLOCK
    gen = torch.Generator(device=kv_device).manual_seed(0)
    kv = [
        (torch.randn(8, tokens, 128, device=kv_device, generator=gen, dtype=torch.float16),
         torch.randn(8, tokens, 128, device=kv_device, generator=gen, dtype=torch.float16))
        for _ in range(LAYOUT.num_layers)
    ]
    raw = LAYOUT.raw_nbytes(tokens)
    if args.mixed:
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
            rows = run_mixed(kv, kv_device, args.blocks, args.reps, args.tiers.split(","), Path(tmp))
        path = write_json("store_mixed", {"blocks": args.blocks, "block_tokens": BLOCK, "layout": LAYOUT.to_dict(),
                                          "kv_device": str(kv_device), "reps": args.reps, "rows": rows}, args.out)
        print(f"wrote {path}")
        print(table(rows, ["policy", "uniform", "tier", "uniform_ingest_gbps", "policy_ingest_gbps", "ingest_ratio",
                           "uniform_materialize_gbps", "policy_materialize_gbps", "materialize_ratio",
                           "uniform_mb_per_block", "policy_mb_per_block"],
                    f"Precision policy vs uniform codec, {args.blocks} Llama-3-8B blocks of {BLOCK} tokens, "
                    f"KV on {kv_device}; medians of {args.reps} calls each, interleaved"))
        return
    base = baseline(kv_device, raw, args.reps)
    print(f"baseline ({base['kind']}, {raw / 1e9:.2f} GB): ingest-side {base['ingest_gbps']:.1f} GB/s, "
          f"materialize-side {base['materialize_gbps']:.1f} GB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        for codec in args.codecs.split(","):
            for tier in args.tiers.split(","):
              per_policy = []
              for policy in args.policy.split(","):
                row = run_case(codec, tier, kv, kv_device, args.blocks, args.reps, Path(tmp), args.batch_bytes, policy)
                row["policy"] = policy
                row["ingest_vs_copy"] = row["ingest_gbps"] / base["ingest_gbps"]
                row["materialize_vs_copy"] = row["materialize_gbps"] / base["materialize_gbps"]
                per_policy.append(row)
                rows.append(row)
                if len(per_policy) > 1:
                    ref = per_policy[-1]
                    for r in per_policy[:-1]:
                        r["ingest_vs_" + ref["policy"]] = r["ingest_gbps"] / ref["ingest_gbps"]
                        r["materialize_vs_" + ref["policy"]] = r["materialize_gbps"] / ref["materialize_gbps"]
                        print(f"  {codec:5s} {tier:5s} {r['policy']} vs {ref['policy']}: ingest "
                              f"{r['ingest_vs_' + ref['policy']]:.3f}x, materialize "
                              f"{r['materialize_vs_' + ref['policy']]:.3f}x", flush=True)
                print(f"  {codec:5s} {tier:5s} {policy:4s} ingest {row['ingest_gbps']:7.1f} GB/s ({row['ingest_vs_copy']:.2f}x)  "
                      f"materialize {row['materialize_gbps']:7.1f} GB/s ({row['materialize_vs_copy']:.2f}x)  "
                      f"ms each: {row['ingest_ms_each']} / {row['materialize_ms_each']}", flush=True)
    path = write_json("store", {"blocks": args.blocks, "block_tokens": BLOCK, "layout": LAYOUT.to_dict(),
                                "kv_device": str(kv_device), "baseline": base, "rows": rows}, args.out)
    redraw(plot, path)
    cols = ["codec", "tier", "policy", "ingest_gbps", "ingest_vs_copy", "materialize_gbps", "materialize_vs_copy",
            "stored_mb_per_block", "compression"]
    print(f"wrote {path}")
    print(table(rows, cols, f"Store throughput, {args.blocks} Llama-3-8B blocks of {BLOCK} tokens, KV on {kv_device}; "
                            f"baseline {base['kind']}: {base['ingest_gbps']:.1f} / {base['materialize_gbps']:.1f} GB/s"))


def engine_modes(args, cuda: bool) -> None:
    """``--paged``, ``--batches``, ``--fresh``: see ``benchmarks/store_engine.py``."""
    from . import store_engine as se

    device = torch.device("cuda" if cuda else "cpu")
    if args.mla and not args.paged:
        raise SystemExit("--mla: with --paged")
    if args.mla:
        shape = se.TINY_MLA if args.tiny or not cuda else se.DEEPSEEK
    else:
        shape = se.TINY if args.tiny or not cuda else se.LLAMA
    codecs = [c for c in args.codecs.split(",") if c in se.CODECS]
    blocks = [int(b) for b in str(args.blocks).split(",")]
    out: dict = {"layout": shape.layout.to_dict(), "block_tokens": shape.block, "page_size": shape.page,
                 "kv_device": str(device), "reps": args.reps, "staging_cap_mib": args.staging_cap}
    cols = ["case", "ms", "gbps"]
    if args.paged:
        for n in blocks:
            print(f"paged: {n} blocks of {shape.block} tokens, {'MLA latent' if shape.mla else 'vLLM'} pages of "
                  f"{shape.page}", flush=True)
            out[f"paged_{n}"] = se.run_paged(shape, n, codecs, args.reps, device)
            print(table(out[f"paged_{n}"], cols + ["paged_vs_contiguous"], f"\nPaged vs contiguous, {n} blocks"))
        name = "store_paged_mla" if shape.mla else "store_paged"
    elif args.batches:
        request_tokens = 8 * shape.block  # 2K tokens of Llama blocks
        print(f"batches: 8 requests of {request_tokens} tokens", flush=True)
        out["batches"] = se.run_batches(shape, 8, request_tokens, codecs, args.reps, device)
        print(table(out["batches"], cols + ["batch_vs_calls"], "\nOne batched call vs one call per request"))
        name = "store_batches"
    elif len(args.policy.split(",")) > 1:
        policies = args.policy.split(",")
        for n in blocks:
            print(f"policies {policies}: {n} blocks of {shape.block} tokens, fresh prompts", flush=True)
            out[f"policies_{n}"] = se.run_policies(shape, n, codecs, args.reps, device, policies)
            print(table(out[f"policies_{n}"], cols + ["policy", f"vs_{policies[-1]}", "evictions"],
                        f"\nEviction policies, fresh prompts, {n} blocks"))
        name = "store_policies"
    else:
        for n in blocks:
            print(f"fresh: {n} blocks of {shape.block} tokens", flush=True)
            out[f"fresh_{n}"] = se.run_fresh(shape, n, codecs, args.reps, device)
            print(table(out[f"fresh_{n}"], cols + ["vs_pinned_copy", "evictions"], f"\nFresh prompts, {n} blocks"))
        name = "store_fresh"
    print(f"wrote {write_json(name, out, args.out)}")


if __name__ == "__main__":
    main()
