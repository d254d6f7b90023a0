"""A pinned CPU tier's first fill: each ingest's time while the tier maps and page-locks
its memory, against the same calls once that memory is mapped, and against a first fill
of a tier built with ``cpu_map_at_start`` (its memory mapped when the cache is built), in
one run.

    python -m benchmarks.first_fill [--gib 8] [--blocks 64] [--out DIR]   # needs CUDA

Llama-3-8B blocks of 256 tokens, int4, KV on the GPU; each call stores a prompt nothing of
which is stored yet. First fill: an empty tier, until it holds ``--gib``; each new 1 GiB
chunk is page-locked (~0.5 s a GiB) inside the ingest that first needs it, under the tier's
lock. Refill: every block deleted, the same number of fresh prompts into the chunks now
mapped. Mapped at start: a new cache with ``TierConfig(cpu_map_at_start=True)`` (the time
its construction took is ``map_s``), then as many fresh prompts. torch keeps freed pinned
memory for reuse, so its cache is emptied before each new cache (where torch can), or the
memory would be page-locked already. Prints the calls' median, 90th percentile and worst
ms per pass and writes first_fill.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cacheseek as cs

from .report import table, write_json

LAYOUT = cs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
BLOCK = 256


def _pass(cache, kv, prompts) -> list[float]:
    times = []
    for prompt in prompts:
        torch.cuda.synchronize()
        t = time.perf_counter()
        cache.ingest(prompt, kv)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def _row(name: str, times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    return {"pass": name, "calls": len(ms), "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "worst_ms": ms[-1], "total_s": sum(ms) / 1e3, "ms_each": [round(t * 1e3, 2) for t in times]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8, help="the CPU tier's size")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per prompt (64: 16K tokens)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (an unpinned tier maps its memory lazily, at no cost)")
    tokens = args.blocks * BLOCK
    kv = [(torch.randn(8, tokens, 128, device="cuda", dtype=torch.float16),
           torch.randn(8, tokens, 128, device="cuda", dtype=torch.float16)) for _ in range(LAYOUT.num_layers)]
    codec = cs.KIVI(bits=4, group_size=32)
    warm = cs.PrefixCache(model_id="warm", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes=1 << 30))
    warm.ingest(list(range(2 * BLOCK)), [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv])  # kernels compiled
    warm.close()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    cache = cs.PrefixCache(model_id="fill", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=args.gib << 30))
    calls = max(1, (args.gib << 30) // codec.encoded_nbytes(LAYOUT, tokens))
    prompts = [[(i * 1_000_003 + j) % 120_000 for j in range(tokens)] for i in range(2 * calls)]
    first = _pass(cache, kv, prompts[:calls])
    for prompt in prompts[:calls]:
        for key in cache.block_hashes(prompt):
            cache.store.delete(key)
    refill = _pass(cache, kv, prompts[calls:])
    tier = cache.stats()["tiers"][0]
    cache.close()
    del cache
    if empty is not None:
        empty()
    t = time.perf_counter()
    mapped = cs.PrefixCache(model_id="fill", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                            tiers=cs.TierConfig(cpu_bytes=args.gib << 30, cpu_map_at_start=True))
    map_s = time.perf_counter() - t
    at_start = _pass(mapped, kv, [[(i * 7_000_003 + j) % 120_000 for j in range(tokens)] for i in range(calls)])
    mapped.close()
    rows = [_row("first fill", first), _row("refill (memory mapped)", refill),
            _row("first fill, mapped at start", at_start) | {"map_s": map_s}]
    for r in rows:
        r["vs_refill_median"] = r["median_ms"] / rows[1]["median_ms"]
    path = write_json("first_fill", {"gib": args.gib, "blocks": args.blocks, "pinned": tier.get("pinned"),
                                     "host_cache_emptied": empty is not None, "rows": rows}, args.out)
    print(table(rows, ["pass", "calls", "median_ms", "p90_ms", "worst_ms", "total_s", "vs_refill_median", "map_s"],
                f"\nFresh {tokens}-token int4 prompts into a {args.gib} GiB pinned CPU tier"))
    for r in rows:
        print(f"  {r['pass']}: ms each {r['ms_each']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
