"""What leased device staging costs: the pool (``store.device_staging``) against a plain
buffer per use (``torch.empty`` + ``record_stream``, what the data path did before).

    python -m benchmarks.device_staging [--device cuda] [--blocks 16] [--reps 9] [--out DIR]

1. Host time of one staging buffer, taken, marked used on a side stream and given back,
   against ``torch.empty`` + ``record_stream`` + drop (the allocator's way), per size.
2. ``ingest`` (of new blocks) and ``materialize`` of ``--blocks`` blocks (a 28-layer, 8-head,
   128-dim fp16 layout, 256-token blocks; Raw and KIVI int4) through a CPU tier, median ms,
   with the pool and with a pool of cap 0 (every take a one-off buffer: the plain way).

In-run baseline: the plain way, measured in the same process right after the pool. Each
row's ratio is pooled over plain of the same row (the same bytes; the same codec):
``vs_plain`` (host time per buffer), ``ingest_vs_plain`` and ``materialize_vs_plain``
(median ms); above 1 the pool is slower. The plain rows are 1 by definition.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.store import device_staging
from cacheseek.store.device_staging import DeviceStagingPool, staging_pool

from .report import table, write_json

LAYOUT = cs.KVLayout(num_layers=28, num_kv_heads=8, head_dim=128, dtype="float16")
BLOCK = 256


def _use_pool(device: torch.device, cap_bytes: int | None) -> None:
    """A fresh pool of ``device`` for what follows (cap None: the default)."""
    pool = DeviceStagingPool(device, cap_bytes=cap_bytes)
    for key in [k for k, p in device_staging._POOLS.items() if p.device == pool.device]:
        device_staging._POOLS[key] = pool
    device_staging._POOLS[pool.device] = pool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def buffer_rows(device: torch.device, reps: int) -> list[dict]:
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    rows = []
    for nbytes in (1 << 20, 64 << 20):
        _use_pool(device, None)
        pool = staging_pool(device)

        def pooled() -> None:
            lease = pool.take(nbytes)
            if side is not None:
                lease.used_on(side)
            lease.release()

        def plain() -> None:
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if side is not None:
                t.record_stream(side)
            del t

        for name, fn in (("pool take + release", pooled), ("torch.empty + record_stream", plain)):
            fn()
            _sync(device)
            us = min(timeit.repeat(fn, number=reps, repeat=5)) / reps * 1e6
            _sync(device)
            rows.append({"case": name, "bytes": nbytes, "us_per_buffer": us})
        pool_row, plain_row = rows[-2:]
        pool_row["vs_plain"] = pool_row["us_per_buffer"] / plain_row["us_per_buffer"]
        plain_row["vs_plain"] = 1.0
    return rows


def _median_ms(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def path_rows(device: torch.device, blocks: int, reps: int) -> list[dict]:
    rows = []
    tokens = blocks * BLOCK
    gen = torch.Generator().manual_seed(0)
    shape = (LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    kv = [(torch.randn(shape, generator=gen).half().to(device), torch.randn(shape, generator=gen).half().to(device))
          for _ in range(LAYOUT.num_layers)]
    for codec in (cs.Raw(), cs.KIVI(bits=4, group_size=32)):
        for mode, cap in (("pool", None), ("plain (cap 0)", 0)):
            _use_pool(device, cap)
            cache = cs.PrefixCache(model_id="bench", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                                   tiers=cs.TierConfig(cpu_bytes="4GiB", pin_memory=device.type == "cuda"))
            seq = iter(range(1 << 30))

            def ingest() -> None:  # new blocks each time: a fresh prompt
                cache.ingest([next(seq)] + list(range(tokens - 1)), kv)

            toks = list(range(tokens))
            cache.ingest(toks, kv)
            ingest_ms = _median_ms(ingest, device, reps)
            materialize_ms = _median_ms(lambda: cache.materialize(toks, device), device, reps)
            stats = staging_pool(device).stats()
            rows.append({"codec": codec.name, "staging": mode, "ingest_ms": ingest_ms, "materialize_ms": materialize_ms,
                         "buffers_made": stats["buffers_made"], "one_off": stats["one_off"],
                         "leases_active": stats["leases_active"]})
            cache.close()
        pool_row, plain_row = rows[-2:]
        for key in ("ingest", "materialize"):
            pool_row[f"{key}_vs_plain"] = pool_row[f"{key}_ms"] / plain_row[f"{key}_ms"]
            plain_row[f"{key}_vs_plain"] = 1.0
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--buffer-reps", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffers = buffer_rows(device, args.buffer_reps)
    paths = path_rows(device, args.blocks, args.reps)
    path = write_json("device_staging", {"device": str(device), "blocks": args.blocks, "reps": args.reps,
                                         "buffers": buffers, "paths": paths}, args.out)
    print(f"wrote {path}")
    print(table(buffers, ["case", "bytes", "us_per_buffer", "vs_plain"],
                f"One staging buffer, host time ({device}); vs_plain: pool / plain, same bytes"))
    print(table(paths, ["codec", "staging", "ingest_ms", "ingest_vs_plain", "materialize_ms", "materialize_vs_plain",
                        "buffers_made", "one_off", "leases_active"],
                f"{args.blocks} blocks of {BLOCK} tokens through a CPU tier ({device}), median of {args.reps}; "
                f"*_vs_plain: pool / plain (cap 0), same codec"))


if __name__ == "__main__":
    main()
