"""What a write-back server's writes wait for when every write evicts to disk: the latency of
``POST /v1/blocks`` with ``--no-write-through`` against the same POST written through, on a
loaded disk.

    python -m benchmarks.write_back [--seconds 24] [--blocks 4] [--disk-load 2] [--cpu-load 2]
                                    [--baseline REF]

Each server has a CPU tier of 8 frames (no reserve) over a disk tier, so every write of
``--blocks`` fresh frames evicts as many. Written through, the disk takes a POST's frames in
one group commit before the answer. Written back, the answer waits only for the demotion of
the frames it evicted, the disk's copy of blocks acknowledged earlier. ``--disk-load``
processes write 128 MiB and fsync it, over and over, in the folder the servers' disks are in;
``--cpu-load`` processes spin (a busy host: a test run, another service). One client posts to
each server in turn, in rounds of 2 s, so that the load falls on all of them alike; the
first round of each is not counted. The in-run baseline is the write-through server; with
``--baseline REF``, the write-back server also runs from the code of git ref ``REF`` (see
``benchmarks.server``). Rows: the POSTs' p50, p99 and worst latency (ms), and each one's p50
and p99 over the write-through server's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from cacheseek.layout import KVLayout
from cacheseek.quant import Raw

from .report import table, write_json
from .server import BATCH_TYPE, Proc, chain_frames, export_tree, start_cacheseek

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16")
BLOCK = 128  # tokens: a Raw frame of ~256 KiB
CPU_FRAMES = 8
ROUND_S = 2.0


def _disk_load(path: str, stop_at: float) -> None:
    chunk = os.urandom(1 << 20)
    while time.time() < stop_at:
        with open(path, "wb") as f:
            for _ in range(128):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(path)


def _cpu_load(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def _chain(seed: int, n: int) -> list[tuple[bytes, bytes]]:
    return chain_frames(n, seed, layout=LAYOUT, block=BLOCK, codec=Raw())


def _post(c: httpx.Client, chain: list[tuple[bytes, bytes]]) -> float:
    body = b"".join(len(f).to_bytes(8, "little") + f for _, f in chain)
    t0 = time.perf_counter()
    c.post("/v1/blocks", content=body, headers={"content-type": BATCH_TYPE}).raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=24.0, help="posting time per server")
    ap.add_argument("--blocks", type=int, default=4, help="frames per POST (each evicts as many)")
    ap.add_argument("--disk-load", type=int, default=2, help="processes writing and fsyncing beside the servers")
    ap.add_argument("--cpu-load", type=int, default=2, help="processes spinning beside the servers")
    ap.add_argument("--baseline", metavar="REF", default=None, help="also run the write-back server from git ref REF")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the servers' disks (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.blocks < 1 or args.seconds < 2 * ROUND_S:
        ap.error(f"--blocks must be at least 1 and --seconds at least {2 * ROUND_S:g}")

    frame_bytes = len(_chain(0, 1)[0][1])
    common = ("--cpu-bytes", str(CPU_FRAMES * frame_bytes), "--cpu-reserve-bytes", "0", "--disk-bytes", "1GiB")
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        setups: dict[str, tuple[tuple[str, ...], Path | None]] = {
            "write-through": ((), None), "write-back": (("--no-write-through",), None)}
        if args.baseline:
            setups[f"write-back @ {args.baseline}"] = (("--no-write-through",),
                                                        export_tree(args.baseline, tmp / "baseline-tree"))
        procs: list[Proc] = []
        urls = {}
        try:
            for i, (label, (extra, tree)) in enumerate(setups.items()):
                proc, urls[label] = start_cacheseek(tmp, f"disk{i}", *common, *extra, tree=tree)
                procs.append(proc)
            rounds = int(args.seconds // ROUND_S) + 1
            stop_at = time.time() + rounds * ROUND_S * len(urls) + 30
            ctx = mp.get_context("fork")
            load = [ctx.Process(target=_disk_load, args=(str(tmp / f"load{i}"), stop_at), daemon=True)
                    for i in range(args.disk_load)]
            load += [ctx.Process(target=_cpu_load, args=(stop_at,), daemon=True) for _ in range(args.cpu_load)]
            for p in load:
                p.start()
            latencies: dict[str, list[float]] = {label: [] for label in urls}
            clients = {label: httpx.Client(base_url=url, timeout=120) for label, url in urls.items()}
            seed = 0
            try:
                for r in range(rounds):
                    for label, c in clients.items():
                        end = time.perf_counter() + ROUND_S
                        while time.perf_counter() < end:
                            seed += 1
                            took = _post(c, _chain(seed, args.blocks))
                            if r:  # (the first round warms the server and fills its CPU tier)
                                latencies[label].append(took)
                    print(f"round {r + 1}/{rounds}: "
                          + ", ".join(f"{k} {len(v)} POSTs" for k, v in latencies.items()), flush=True)
            finally:
                for c in clients.values():
                    c.close()
                for p in load:
                    p.terminate()
                    p.join()
        finally:
            for proc in procs:
                proc.stop()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    base = latencies["write-through"]
    rows = []
    for label, xs in latencies.items():
        rows.append({"server": label, "posts": len(xs), "p50_ms": statistics.median(xs) * 1e3,
                     "p99_ms": pct(xs, 0.99), "max_ms": max(xs) * 1e3,
                     "p50_vs_write_through": statistics.median(xs) / statistics.median(base),
                     "p99_vs_write_through": pct(xs, 0.99) / pct(base, 0.99)})
    cols = ["server", "posts", "p50_ms", "p99_ms", "max_ms", "p50_vs_write_through", "p99_vs_write_through"]
    print(table(rows, cols, f"POST of {args.blocks} frames ({frame_bytes / 1024:.0f} KiB each), every one evicting "
                            f"as many; {args.disk_load} disk and {args.cpu_load} CPU load processes"))
    path = write_json("write_back", {"blocks": args.blocks, "frame_bytes": frame_bytes, "seconds": args.seconds,
                                     "disk_load": args.disk_load, "cpu_load": args.cpu_load,
                                     "baseline": args.baseline, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
