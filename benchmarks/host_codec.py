"""KV on the CPU (no GPU): each codec's encode and decode, and a CPU tier's whole ingest and
materialize, against a memcpy of the same KV measured in the same run.

    python -m benchmarks.host_codec [--tokens 1024] [--reps 7] [--codecs raw,int8,int4,int2] [--out DIR]
    python -m benchmarks.host_codec --tiny            (a smoke run: 2 layers, a few ms)
    python -m benchmarks.host_codec --compare OLD.json (adds OLD's figures and new / old per row)

KV is Llama-3-8B shaped (32 layers x 8 KV heads x head dim 128, fp16; 1024 tokens are 134
MB) in blocks of 256 tokens; KIVI with groups of 32. Throughput is GB/s of raw KV.

- encode / decode: ``codec.encode(k, v)`` of every layer stacked ([L, H, T, D]), and
  ``codec.decode(..., out=)`` into tensors made once (what the store runs per batch).
- ingest / materialize: ``PrefixCache.ingest`` of per-layer KV into a CPU tier (the
  previous call's blocks freed first, so every call writes into reused memory), and
  ``materialize(..., device="cpu")`` of the prompt stored.
- memcpy: ``dst.copy_(src)`` of the same bytes into a tensor made once; its median of the
  runs before and after the codecs (both kept in the JSON, with a fresh-allocation clone).

Medians of ``--reps`` calls after one warm-up each. On a shared machine the spread
(``*_ms_each`` in the JSON) says how far to trust a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import cacheseek as cs

from .report import table, write_json

CODECS = {
    "raw": cs.Raw(),
    "int8": cs.KIVI(bits=8, group_size=32),
    "int4": cs.KIVI(bits=4, group_size=32),
    "int2": cs.KIVI(bits=2, group_size=32),
}
FULL = dict(num_layers=32, num_kv_heads=8, head_dim=128)
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=64)
BLOCK = 256
OPS = ("encode", "decode", "ingest", "materialize")


def seconds(fn, reps: int, setup=None) -> list[float]:
    """Wall seconds of ``fn(i)`` for i in 1..reps, after a warm-up call (i = 0)."""
    times = []
    for i in range(reps + 1):
        if setup:
            setup(i)
        start = time.perf_counter()
        fn(i)
        if i:
            times.append(time.perf_counter() - start)
    return times


def memcpy(nbytes: int, reps: int) -> dict[str, list[float]]:
    src = torch.randn(nbytes // 2, dtype=torch.float16)
    dst = torch.empty_like(src)
    return {"memcpy": seconds(lambda i: dst.copy_(src), reps), "clone": seconds(lambda i: src.clone(), reps)}


def run_codec(name: str, layout: cs.KVLayout, kv: list, reps: int) -> dict[str, list[float]]:
    codec = CODECS[name]
    k = torch.stack([k for k, _ in kv])  # [L, 1, H, T, D]
    v = torch.stack([v for _, v in kv])
    encoded = codec.encode(k, v)
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    times = {
        "encode": seconds(lambda i: codec.encode(k, v), reps),
        "decode": seconds(lambda i: codec.decode(encoded, "cpu", out=(k_out, v_out)), reps),
    }
    tokens = k.shape[-2]
    # Two prompts' worth of blocks, like benchmarks.store's CPU tier (plus room for the tables).
    budget = 2 * (codec.encoded_nbytes(layout, tokens) + 4096 * (tokens // BLOCK)) + (64 << 20)
    cache = cs.PrefixCache(model_id="bench", layout=layout, codec=codec, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=budget))
    prompts = [[(i * 1_000_003 + j) % 120_000 for j in range(tokens)] for i in range(reps + 1)]
    try:
        def clear(i: int) -> None:
            for key in cache.block_hashes(prompts[i - 1]) if i else []:
                cache.store.delete(key)

        times["ingest"] = seconds(lambda i: cache.ingest(prompts[i], kv), reps, setup=clear)
        if cache.lookup(prompts[reps]) != tokens:
            raise RuntimeError(f"{name}: ingest stored {cache.lookup(prompts[reps])} of {tokens} tokens")
        times["materialize"] = seconds(lambda i: cache.materialize(prompts[reps], device="cpu"), reps)
    finally:
        cache.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of KV (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--tiny", action="store_true", help="2 layers x 2 heads x 64, 256 tokens, 2 reps: a smoke run")
    ap.add_argument("--compare", type=Path, default=None, help="an earlier run's JSON: its figures and new / old")
    ap.add_argument("--out", type=Path, default=None, help="directory for host_codec.json (default benchmarks/results)")
    args = ap.parse_args()
    tokens, reps = (BLOCK, 2) if args.tiny else (args.tokens, args.reps)
    if tokens % BLOCK:
        ap.error(f"--tokens: {tokens} is not a multiple of {BLOCK}")
    layout = cs.KVLayout(**(TINY if args.tiny else FULL), dtype="float16")
    torch.manual_seed(0)
    kv = [tuple(torch.randn(1, layout.num_kv_heads, tokens, layout.head_dim, dtype=torch.float16) for _ in "kv")
          for _ in range(layout.num_layers)]
    raw = layout.raw_nbytes(tokens)

    before = memcpy(raw, reps)
    measured = {name: run_codec(name, layout, kv, reps) for name in args.codecs.split(",")}
    after = memcpy(raw, reps)
    copy_s = statistics.median(before["memcpy"] + after["memcpy"])
    baseline = {"memcpy_gbps": raw / copy_s / 1e9,
                "memcpy_ms_each": [round(t * 1e3, 3) for t in before["memcpy"] + after["memcpy"]],
                "clone_gbps": raw / statistics.median(before["clone"] + after["clone"]) / 1e9}

    old = {r["codec"]: r for r in json.loads(args.compare.read_text())["rows"]} if args.compare else {}
    rows = []
    for name, times in measured.items():
        row: dict = {"codec": name}
        for op in OPS:
            t = statistics.median(times[op])
            row[f"{op}_gbps"] = raw / t / 1e9
            row[f"{op}_x_memcpy"] = copy_s / t
            row[f"{op}_ms_each"] = [round(s * 1e3, 3) for s in times[op]]
            if name in old:
                row[f"{op}_old_gbps"] = old[name][f"{op}_gbps"]
                row[f"{op}_speedup"] = row[f"{op}_gbps"] / old[name][f"{op}_gbps"]
        rows.append(row)

    shape = "tiny" if args.tiny else "llama-3-8b"
    payload = {"shape": shape, "layout": layout.to_dict(), "tokens": tokens, "block_tokens": BLOCK,
               "raw_bytes": raw, "reps": reps, "threads": torch.get_num_threads(), "baseline": baseline, "rows": rows}
    if args.compare:
        earlier = json.loads(args.compare.read_text())
        payload["compared_with"] = {"file": str(args.compare), "baseline": earlier["baseline"]}
    path = write_json("host_codec", payload, args.out)
    print(f"KV on the CPU, {shape} ({raw / 1e6:.1f} MB raw, {torch.get_num_threads()} threads): "
          f"memcpy {baseline['memcpy_gbps']:.2f} GB/s, clone {baseline['clone_gbps']:.2f} GB/s")
    columns = ["codec"] + [c for op in OPS for c in (f"{op}_gbps", f"{op}_x_memcpy")]
    print(table(rows, columns))
    if old:
        print(table(rows, ["codec"] + [c for op in OPS for c in (f"{op}_old_gbps", f"{op}_speedup")],
                    title=f"against {args.compare}"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
