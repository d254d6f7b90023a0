"""Materialize throughput from the Redis tier: Raw against KIVI int4 and int2 frames.

    python -m benchmarks.redis_tier [--blocks 4] [--reps 5] [--codecs raw,int4,int2] [--url redis://...] [--device cuda]
    python -m benchmarks.redis_tier --plot-only benchmarks/results/redis_tier.json --out docs

A PrefixCache whose only tier is Redis (a redis-server started here on a free loopback
port, unless ``--url`` names one). Blocks are Llama-3-8B shaped: 32 layers x 8 KV heads x
256 tokens x 128, fp16 (33.5 MB of raw KV each). Throughput is GB/s of *raw KV
represented*, so codecs compare on the same work: the same tokens of KV reach the caller.

Three timings per codec, each the median of ``--reps`` runs:
- transfer: the Redis tier's ``get_many`` of the chain: one pipelined GET, every frame
  parsed and its checksum verified (what crosses the network, and nothing else);
- decode: ``decode_frames`` of those frames on the target device (``--device``: the GPU
  when there is one, where the Triton kernels decode; on a CPU the torch reference);
- materialize: the whole ``PrefixCache.materialize`` (lookup, transfer, decode, touch).

In-run baseline: the Raw codec (fp16 bytes unchanged) through the same path; ratios above 1
mean the codec moves the same KV faster than Raw.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.decode import decode_frames

from .report import add_plot_only, bars, legend_outside, plot_only, pyplot, redraw, save, source_line, table, write_json
from .store import BLOCK, CODECS, LAYOUT  # the same Llama-3-8B blocks and codecs as the store benchmark


@contextmanager
def local_redis():
    """A throwaway redis-server on a free loopback port; stopped (by pid) on exit."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: install Debian's redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", tmp, "--loglevel", "warning"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            client = redis.Redis(port=port)
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _median_seconds(fn, reps: int) -> float:
    times = []
    for i in range(reps + 1):  # the first run warms up
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synced(fn, device: torch.device):
    def run():
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out
    return run


def run_case(codec_name: str, url: str, kv, blocks: int, reps: int, device: torch.device) -> dict:
    codec = CODECS[codec_name]
    budget = (codec.encoded_nbytes(LAYOUT, BLOCK) + 4096) * blocks * 2
    tiers = cs.TierConfig(cpu_bytes=0, redis_url=url, redis_bytes=budget, redis_namespace=f"bench-{codec_name}",
                          redis_socket_timeout_seconds=60.0)
    cache = cs.PrefixCache(model_id="bench", layout=LAYOUT, codec=codec, block_tokens=BLOCK, tiers=tiers)
    tier = cache.store.tier("redis")
    tokens = blocks * BLOCK
    toks = list(range(tokens))
    for key in cache.block_hashes(toks):  # a clean namespace for every run
        cache.store.delete(key)
    start = time.perf_counter()
    res = cache.ingest(toks, kv)
    t_ingest = time.perf_counter() - start
    if res.stored != blocks or res.errors:
        raise RuntimeError(f"{codec_name}: ingest stored {res.stored} of {blocks} blocks: {res.errors}")
    hashes = cache.block_hashes(toks)

    def transfer():
        frames = tier.get_many(hashes)
        if any(f is None for f in frames):
            raise RuntimeError(f"{codec_name}: a frame went missing")
        return frames

    t_transfer = _median_seconds(transfer, reps)
    frames = transfer()
    t_decode = _median_seconds(_synced(lambda: decode_frames(cache.block_format, frames, device), device), reps)
    del frames

    def materialize():
        got = cache.materialize(toks, device=device)
        if got.num_tokens != tokens:
            raise RuntimeError(f"{codec_name}: materialized {got.num_tokens} of {tokens} tokens")

    t_mat = _median_seconds(_synced(materialize, device), reps)
    stats = cache.stats()["tiers"][0]
    wire = stats["used_bytes"]
    for key in hashes:
        cache.store.delete(key)
    cache.close()
    raw = LAYOUT.raw_nbytes(tokens)
    return {
        "codec": codec_name,
        "stored_mb_per_block": wire / blocks / 1e6,
        "compression": raw / wire,
        "transfer_ms": t_transfer * 1e3,
        "transfer_gbps": raw / t_transfer / 1e9,
        "wire_gbps": wire / t_transfer / 1e9,
        "decode_ms": t_decode * 1e3,
        "materialize_ms": t_mat * 1e3,
        "materialize_gbps": raw / t_mat / 1e9,
        "ingest_gbps": raw / t_ingest / 1e9,
    }


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """Transfer, decode and whole materialize per codec, in ms for the same KV."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    bars(ax, [f"{r['codec']} ({r['stored_mb_per_block']:.1f} MB/block)" for r in rows],
         {"transfer: pipelined GET + parse + checksum": [r["transfer_ms"] for r in rows],
          f"decode on {doc.get('device', 'cpu')}": [r["decode_ms"] for r in rows],
          "materialize, end to end": [r["materialize_ms"] for r in rows]}, fmt="{:,.0f} ms", log=True)
    ax.set_ylabel(f"ms for {doc['blocks']} blocks (log; lower is better)")
    ax.set_xlabel("codec (frame size)")
    legend_outside(ax)
    return save(fig, out_dir, "redis_tier", note=source_line(doc),
                title=f"Materialize from a Redis-only PrefixCache: {doc['blocks']} Llama-3-8B blocks of "
                      f"{doc['block_tokens']} tokens, {doc['redis']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codecs", default="raw,int4,int2")
    ap.add_argument("--url", default=None, help="an existing Redis (default: start one on a free loopback port)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where frames are decoded (default: the GPU when there is one)")
    ap.add_argument("--out", type=Path, default=None)
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    codecs = args.codecs.split(",")
    if codecs[0] != "raw":
        codecs = ["raw"] + [c for c in codecs if c != "raw"]  # Raw is the in-run baseline
    tokens = args.blocks * BLOCK
    gen = torch.Generator().manual_seed(0)
    device = torch.device(args.device)
    kv = [(torch.randn(8, tokens, 128, generator=gen, dtype=torch.float16).to(device),
           torch.randn(8, tokens, 128, generator=gen, dtype=torch.float16).to(device)) for _ in range(LAYOUT.num_layers)]
    with (local_redis() if args.url is None else _given(args.url)) as url:
        rows = []
        for codec in codecs:
            row = run_case(codec, url, kv, args.blocks, args.reps, device)
            rows.append(row)
            print(f"  {codec:5s} transfer {row['transfer_gbps']:6.2f} GB/s  decode {row['decode_ms']:8.1f} ms  "
                  f"materialize {row['materialize_gbps']:6.2f} GB/s", flush=True)
    base = rows[0]
    for row in rows:
        row["transfer_vs_raw"] = row["transfer_gbps"] / base["transfer_gbps"]
        row["materialize_vs_raw"] = row["materialize_gbps"] / base["materialize_gbps"]
    where = "local redis-server on loopback" if args.url is None else "given Redis"
    path = write_json("redis_tier", {"blocks": args.blocks, "block_tokens": BLOCK, "layout": LAYOUT.to_dict(),
                                     "redis": where, "baseline": "raw", "device": str(device), "rows": rows}, args.out)
    print(f"wrote {path}")
    redraw(plot, path)
    cols = ["codec", "stored_mb_per_block", "compression", "transfer_ms", "transfer_gbps", "wire_gbps",
            "transfer_vs_raw", "decode_ms", "materialize_ms", "materialize_gbps", "materialize_vs_raw"]
    print(table(rows, cols, f"Redis tier, {args.blocks} Llama-3-8B blocks of {BLOCK} tokens ({where}), "
                            f"decode on {device}; baseline Raw: {base['transfer_gbps']:.2f} GB/s transfer"))
    for row in rows[1:]:
        if row["codec"] == "int4":
            verdict = "MET" if row["materialize_vs_raw"] >= 2.5 else "NOT MET"
            print(f"goal (int4 materialize >= 2.5x Raw's, decode on {device}): {row['materialize_vs_raw']:.2f}x, {verdict}")


@contextmanager
def _given(url: str):
    yield url


if __name__ == "__main__":
    main()
