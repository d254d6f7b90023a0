"""A batch's lookup through Redis: N ``PrefixCache.locate`` calls against one ``locate_batch``.

    python -m benchmarks.redis_lookup [--chains 32] [--blocks 8,64] [--shared 0.25] [--reps 50] [--url redis://...]

A PrefixCache whose only tier is Redis (a redis-server started here on a free loopback port,
unless ``--url`` names one), holding half of ``--chains`` chains of each length in
``--blocks`` (small blocks: a lookup reads no frame, only asks which exist); every chain
starts with the same ``--shared`` fraction of its blocks, as a batch sharing a system prompt
does. Per length: the N calls one after another (one round trip each), and one
``locate_batch`` (``TieredStore.locate_many``: one round trip, each distinct block asked
once), run in turn so that a loaded machine's noise falls on both; the median and the minimum
of ``--reps`` runs, and the ``EXISTS`` commands Redis ran for each (``INFO commandstats``).
Same answers checked first. On loopback a round trip is tens of µs, so the gain is the
smallest it can be: over a network each call saved is one network round trip.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import cacheseek as cs

from .redis_tier import local_redis
from .report import table, write_json

BLOCK = 16  # tokens a block
LAYOUT = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64)


def _interleaved(a: Any, b: Any, reps: int) -> tuple[list[float], list[float]]:
    """Milliseconds of ``a`` and of ``b`` over ``reps`` runs each, in turn, after one warm-up."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(reps + 1):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            if i:
                out.append((time.perf_counter() - start) * 1e3)
    return ta, tb


def _exists_calls(client: Any, fn: Any) -> int:
    client.config_resetstat()
    fn()
    return int(client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def run_case(url: str, chains: int, blocks: int, shared: float, reps: int, seed: int) -> dict[str, Any]:
    import redis

    cache = cs.PrefixCache(model_id=f"lookup-{seed}", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=0, redis_url=url, redis_bytes="1GiB"))
    try:
        gen = torch.Generator().manual_seed(seed)
        n_shared = int(blocks * shared)
        head = torch.randint(0, 50_000, (n_shared * BLOCK,), generator=gen).tolist()
        prompts = [head + torch.randint(0, 50_000, ((blocks - n_shared) * BLOCK,), generator=gen).tolist()
                   for _ in range(chains)]
        for p in prompts[: chains // 2]:
            kv = [(torch.zeros(LAYOUT.num_kv_heads, len(p), LAYOUT.head_dim, dtype=torch.float16),) * 2
                  for _ in range(LAYOUT.num_layers)]
            cache.ingest(p, kv)
        each = lambda: [cache.locate(p) for p in prompts]  # noqa: E731
        batch = lambda: cache.locate_batch(prompts)  # noqa: E731
        if batch() != each():
            raise SystemExit("locate_batch answered otherwise than one locate a chain")
        client = redis.Redis.from_url(url)
        each_exists, batch_exists = _exists_calls(client, each), _exists_calls(client, batch)
        client.close()
        te, tb = _interleaved(each, batch, reps)
    finally:
        cache.close()
    return {"chains": chains, "blocks": blocks, "shared_blocks": n_shared,
            "each_ms": statistics.median(te), "each_min_ms": min(te), "each_round_trips": chains,
            "each_exists": each_exists, "batch_ms": statistics.median(tb), "batch_min_ms": min(tb),
            "batch_round_trips": 1, "batch_exists": batch_exists,
            "speedup": statistics.median(te) / statistics.median(tb)}


@contextmanager
def _given(url: str):
    yield url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chains", type=int, default=32)
    ap.add_argument("--blocks", default="8,64", help="blocks a chain, one case per length (comma-separated)")
    ap.add_argument("--shared", type=float, default=0.25, help="fraction of each chain's blocks all chains share")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--url", default=None, help="an existing Redis (default: start one on a free loopback port)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    with (local_redis() if args.url is None else _given(args.url)) as url:
        for seed, blocks in enumerate(int(b) for b in args.blocks.split(",")):
            rows.append(run_case(url, args.chains, blocks, args.shared, args.reps, seed))
    where = "local redis-server on loopback" if args.url is None else "given Redis"
    path = write_json("redis_lookup", {"redis": where, "block_tokens": BLOCK, "rows": rows}, args.out)
    print(f"wrote {path}")
    print(table(rows, ["chains", "blocks", "shared_blocks", "each_ms", "each_min_ms", "each_exists", "batch_ms",
                       "batch_min_ms", "batch_exists", "speedup"],
                f"{args.chains} chains through Redis ({where}): {args.chains} locate calls against one "
                f"locate_batch; ms, median and min of {args.reps}"))


if __name__ == "__main__":
    main()
