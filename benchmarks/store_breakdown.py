"""Where ingest and materialize spend their time, stage by stage (a diagnostic for benchmarks/store.py).

    python -m benchmarks.store_breakdown [--codec int4] [--blocks 16] [--tier cpu] [--profile] [--trace DIR] [--host]
                                         [--out DIR]

Each stage is timed with a device synchronization on both sides, so stages that overlap
in normal operation (host bookkeeping and device copies) are shown serialized here: the
sum is an upper bound of the real time. ``--profile`` adds a cProfile of one normal call;
``--trace DIR`` writes a Chrome trace (torch.profiler, CPU and CUDA) of one ingest and one
materialize, and prints the device timeline of each: kernels and copies, per stream.
``--host`` prints the host's timeline of one ingest and one materialize: when each step
of the path ran and for how long (timers around the functions in ``HOST_STEPS``, about a
microsecond each; no profiler, whose overhead per op would distort exactly this).
``--fresh`` makes those calls as a server's are: a fresh prompt and freshly made KV each,
into a CPU tier already full (it holds four calls; every ingest evicts).

In-run baseline: a plain copy of the same raw KV to where the store puts it, as in
benchmarks/store.py (``baseline``): with a GPU a pinned device-to-host copy for the ingest
stages and a pinned host-to-device copy for the materialize stages, on a CPU a memcpy; both
are rows of the table. ``vs_copy`` is a stage's raw GB/s over its side's copy (the copy's
time over the stage's), so the whole calls' rows read as benchmarks/store.py's
``ingest_vs_copy`` / ``materialize_vs_copy``, and a stage's row says how many times over
the link's speed that stage alone would let the call run. JSON:
``store_breakdown_CODEC_TIER.json`` (rows and baseline) in ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.decode import BatchDecoder
from cacheseek.encode import encode_blocks

from .report import table, write_json
from .store import BLOCK, CODECS, LAYOUT, baseline


def _timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", default="int4", choices=sorted(CODECS))
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--tier", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", type=Path, default=None, help="folder for Chrome traces (CUDA only)")
    ap.add_argument("--host", action="store_true", help="print the host timeline of one ingest and one materialize")
    ap.add_argument("--fresh", action="store_true", help="--host with fresh KV per call into a full tier")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default benchmarks/results)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    codec = CODECS[args.codec]
    n, tokens = args.blocks, args.blocks * BLOCK
    kv = [(torch.randn(8, tokens, 128, device=device, dtype=torch.float16),
           torch.randn(8, tokens, 128, device=device, dtype=torch.float16)) for _ in range(LAYOUT.num_layers)]
    budget = 4 * n * LAYOUT.raw_nbytes(BLOCK)
    tiers = cs.TierConfig(cpu_bytes=budget) if args.tier == "cpu" else cs.TierConfig(gpu_bytes=budget, cpu_bytes=0)
    cache = cs.PrefixCache(model_id="bd", layout=LAYOUT, codec=codec, block_tokens=BLOCK, tiers=tiers)
    stages: dict[str, list[float]] = {}

    def rec(name, secs):
        stages.setdefault(name, []).append(secs)

    for rep in range(args.reps + 1):
        toks = [(rep * 7919 + j) % 120_000 for j in range(tokens)]
        hashes, t = _timed(device, lambda: cache.block_hashes(toks))
        rec("ingest: hash blocks", t)
        _, t = _timed(device, lambda: cache.store.contains_many(hashes))
        rec("ingest: contains_many", t)
        frames, t = _timed(device, lambda: encode_blocks(cache.block_format, kv, first_block=0, hashes=hashes,
                                                         parents=cache.keys.parents(hashes)))
        rec("ingest: encode_blocks (stack, encode, stage, plan)", t)
        items = [(f.meta.block_hash, f) for f in reversed(frames)]
        _, t = _timed(device, lambda: cache.store.put_many(items))
        rec("ingest: store.put_many (tier copies)", t)
        located, t = _timed(device, lambda: cache.store.locate(hashes))
        rec("materialize: locate", t)
        got, t = _timed(device, lambda: [cache.store.get(h) for h in hashes])
        rec("materialize: store.get x n", t)
        dec = BatchDecoder(cache.block_format, n, device)
        _, t = _timed(device, lambda: [dec.add(f) for f, _ in got])
        rec("materialize: decoder.add x n (copies to device)", t)
        _, t = _timed(device, dec.finish)
        rec("materialize: decoder.finish (decode)", t)
        for f, _ in got:
            f.release()  # the slots' leases: copies have landed (finish waited)
        fresh = [(rep * 31 + 5 + j) % 120_000 for j in range(tokens)]
        _, t = _timed(device, lambda: cache.ingest(fresh, kv))
        rec("whole ingest (new blocks)", t)
        _, t = _timed(device, lambda: cache.materialize(toks, device=device))
        rec("whole materialize", t)
        for h in cache.block_hashes(fresh) + hashes:
            cache.store.delete(h)
        if rep == 0:
            stages.clear()  # warm-up
    raw = LAYOUT.raw_nbytes(tokens)
    rows = [{"stage": k, "ms": statistics.median(v) * 1e3, "us_per_block": statistics.median(v) / n * 1e6,
             "raw_GBps": raw / statistics.median(v) / 1e9} for k, v in stages.items()]
    base = baseline(device, raw, args.reps)
    for side, label in (("ingest", "pinned D2H copy" if device.type == "cuda" else "memcpy"),
                        ("materialize", "pinned H2D copy" if device.type == "cuda" else "memcpy")):
        secs = raw / (base[f"{side}_gbps"] * 1e9)
        rows.append({"stage": f"baseline ({side} side): {label} of the raw KV", "ms": secs * 1e3,
                     "us_per_block": secs / n * 1e6, "raw_GBps": base[f"{side}_gbps"]})
    for row in rows:
        side = "ingest" if "ingest" in row["stage"] else "materialize"
        row["vs_copy"] = row["raw_GBps"] / base[f"{side}_gbps"]
    if args.profile:
        toks = [(999 * 7919 + j) % 120_000 for j in range(tokens)]
        for name, fn in (("ingest", lambda: cache.ingest(toks, kv)), ("materialize", lambda: cache.materialize(toks, device=device))):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            prof.disable()
            print(f"--- cProfile: {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    if args.trace is not None and device.type == "cuda":
        toks = [(1234 * 7919 + j) % 120_000 for j in range(tokens)]
        for name, fn in (("ingest", lambda: cache.ingest(toks, kv)), ("materialize", lambda: cache.materialize(toks, device=device))):
            path = _trace(fn, args.trace / f"trace-{args.codec}-{args.tier}-{name}.json")
            print(f"--- device timeline: {name} ({path})")
            print(_timeline(path))
    if args.host and args.fresh:
        frame = codec.encoded_nbytes(LAYOUT, BLOCK) + 4096
        cache.close()
        cache = cs.PrefixCache(model_id="bd-fresh", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                               tiers=cs.TierConfig(cpu_bytes=4 * n * frame, cpu_reserve_bytes=n * frame))
        for rep in range(7):  # four calls fill the tier; the last of the rest is shown
            toks = [(8642 * 7919 + rep * 13 + j) % 120_000 for j in range(tokens)]
            fresh_kv = [(k.clone(), v.clone()) for k, v in kv]  # made by a prefill just now
            lines = {name: _host_timeline(fn, device) for name, fn in
                     (("ingest (fresh prompt, fresh KV, full tier)", lambda: cache.ingest(toks, fresh_kv)),
                      ("materialize", lambda: cache.materialize(toks, device=device)))}
        for name, text in lines.items():
            print(f"--- host timeline: {name}")
            print(text)
        print(f"evictions: {cache.stats()['tiers'][0]['evictions']}")
    elif args.host:
        for rep in range(3):  # the last of three: warm
            toks = [(4321 * 7919 + rep * 13 + j) % 120_000 for j in range(tokens)]
            lines = {name: _host_timeline(fn, device) for name, fn in
                     (("ingest", lambda: cache.ingest(toks, kv)), ("materialize", lambda: cache.materialize(toks, device=device)))}
        for name, text in lines.items():
            print(f"--- host timeline: {name}")
            print(text)
    path = write_json(f"store_breakdown_{args.codec}_{args.tier}",
                      {"codec": args.codec, "tier": args.tier, "blocks": n, "reps": args.reps, "device": str(device),
                       "baseline": base, "rows": rows}, args.out)
    print(f"wrote {path}")
    print(table(rows, ["stage", "ms", "us_per_block", "raw_GBps", "vs_copy"],
                f"{args.codec} -> {args.tier} tier, {n} Llama-3-8B blocks, KV on {device}; "
                f"vs_copy: GB/s over a plain {base['kind']} of the same KV, same run"))


HOST_STEPS = [
    "cacheseek.prefix_cache:kv_layers", "cacheseek.prefix_cache:check_layers",
    "cacheseek.prefix_cache_base:PrefixCacheBase.block_hashes", "cacheseek.store.tiered:TieredStore.contains_many",
    "cacheseek.ingest_in_place:InPlaceIngest.__init__", "cacheseek.ingest_in_place:InPlaceIngest.guess_tail",
    "cacheseek.block_format:BlockFormat.plan", "cacheseek.block_format:BlockFormat.plan_run",
    "cacheseek.ingest_in_place:InPlaceIngest.reserve", "cacheseek.ingest_in_place:InPlaceIngest.launch",
    "cacheseek.ingest_in_place:reservation_span", "cacheseek.ingest_in_place:payload_views",
    "cacheseek.ingest_in_place:encode_into", "cacheseek.kernels.kivi:quantize_layers",
    "cacheseek.kernels.layers:gather_layers", "cacheseek.ingest_in_place:InPlaceIngest.commit_oldest",
    "cacheseek.ingest_in_place:header_prefix", "cacheseek.store.tiered:TieredStore.commit_many",
    "cacheseek.store.tiered:TieredStore.touch_chain", "cacheseek.store.tiered:TieredStore.locate",
    "cacheseek.store.tiered:TieredStore.get_many", "cacheseek.block_format:BlockFormat.check_fetched",
    "cacheseek.decode:BatchDecoder.__init__", "cacheseek.decode:BatchDecoder.add",
    "cacheseek.decode:BatchDecoder._decode_pending", "cacheseek.decode:BatchDecoder.finish",
    "cacheseek.kernels.kivi:dequantize", "cacheseek.prefix_cache_base:PrefixCacheBase._materialized",
    "cacheseek.kernels.layers:LayerTable.__init__", "cacheseek.store.cpu:CpuTier._evict_one",
    "cacheseek.store.cpu:CpuTier.reserve_run",
]


def _host_timeline(fn, device) -> str:
    """Run ``fn`` with timers around ``HOST_STEPS``; their start and duration, nested."""
    import functools
    import importlib

    events: list[tuple[str, int, float, float]] = []
    depth = [0]
    patched = []

    def timed(name, f):
        @functools.wraps(f)
        def wrapper(*a, **kw):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                events.append((name, depth[0], t, time.perf_counter()))
                depth[0] -= 1
        return wrapper

    for spec in HOST_STEPS:
        mod_name, qual = spec.split(":")
        owner = importlib.import_module(mod_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, timed(qual, original))
        patched.append((owner, attr, original))
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t_ret = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_end = time.perf_counter()
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
    lines = [f"{'start us':>9} {'dur us':>8}  step"]
    for name, level, a, b in sorted(events, key=lambda e: e[2]):
        lines.append(f"{(a - t0) * 1e6:9.1f} {(b - a) * 1e6:8.1f}  {'  ' * (level - 1)}{name}")
    lines.append(f"returned after {(t_ret - t0) * 1e6:.1f} us; device idle after {(t_end - t0) * 1e6:.1f} us")
    return "\n".join(lines)


def _trace(fn, path: Path) -> Path:
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


def _timeline(path: Path) -> str:
    """Device events of a Chrome trace, in start order, with times from the first host event."""
    import json

    events = json.loads(path.read_text())["traceEvents"]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    t0 = min((e["ts"] for e in host), default=0)
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    # The host's side: when it launched, copied and waited (what keeps the device fed or not).
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
             and any(w in e["name"] for w in ("Launch", "Memcpy", "Synchronize"))]
    host_calls = {id(e) for e in calls}
    lines = [f"{'start us':>9} {'dur us':>8} {'stream':>6}  name"]
    for e in sorted(dev + calls, key=lambda e: e["ts"]):
        stream = "host" if id(e) in host_calls else e.get("args", {}).get("stream", e.get("tid"))
        lines.append(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} {stream!s:>6}  {e['name'][:70]}")
    end = max((e["ts"] + e["dur"] for e in dev), default=t0)
    lines.append(f"device busy until {end - t0:.1f} us after the call started")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
