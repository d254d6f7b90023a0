"""RemoteCache's HTTP client: ``BulkTransport`` against httpx's own transport (httpcore + h11,
the maintained baseline), over loopback to one ``cacheseek serve`` (a CPU tier only).

    python -m benchmarks.client [--frames 16] [--reps 5] [--lookups 2000] [--device cpu] [--also NAME=FILE ...]

Ingest: one streamed ``POST /v1/blocks`` of ``--frames`` 10.5 MB int4 KIVI frames (as
RemoteCache sends them); materialize: one ``GET /v1/prefixes/{hash}`` of the same chain, each
frame read into a buffer of its own (``iter_frames``): a new one, or for ``bulk, reused
buffers`` one of a ``BufferPool`` that every rep gives back (as ``RemoteCache`` reads);
lookup: p50/p99 of ``POST /v1/lookup`` with 512 hashes as raw bytes, straight to the
transport (as RemoteCache sends it). Throughput is frame GB/s, the median of ``--reps``. The
transports take turns in rounds, so load from elsewhere on the host falls on each alike.
``--also old=path/to/transport.py`` adds the ``BulkTransport`` of another source file (an
earlier version, say) as a column.

Then ``RemoteCache`` itself, end to end from and to tensors on ``--device`` (``cuda``: the KV
on the GPU, each frame copied to and from page-locked host memory): a waited ``ingest`` of a
fresh prompt of ``--frames`` Raw blocks (Llama-3-8B's per-token KV, 64 tokens a block: 8.4 MB
frames; lookup, encode, each frame moved to host memory and sent) and a ``materialize`` of
it (lookup, GET, checks, decode), by a cache that keeps its host buffers between calls (the
default) and one that takes fresh memory for every frame (``read_buffer_bytes=0``, and a
write pool that keeps nothing), taking turns.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import torch

import cacheseek as cs
from cacheseek.batch_body import iter_frames
from cacheseek.layout import KVLayout
from cacheseek.quant import Raw
from cacheseek.remote import lookup_request
from cacheseek.store.direct_io import BufferPool
from cacheseek.transport import IDEMPOTENT_EXTENSION, BulkTransport

from .report import table, write_json
from .server import BATCH_TYPE, Proc, chain_frames, make_frame, start_cacheseek


def _load_transport(path: str) -> type:
    spec = importlib.util.spec_from_file_location(f"_transport_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.BulkTransport


def _body(frames: list[tuple[bytes, bytes]]):
    for _, f in frames:
        yield len(f).to_bytes(8, "little")
        yield f


def _ingest(c: httpx.Client, frames: list[tuple[bytes, bytes]]) -> float:
    for h, _ in frames:
        c.delete(f"/v1/blocks/{h.hex()}")
    total = sum(8 + len(f) for _, f in frames)
    t = time.perf_counter()
    c.post("/v1/blocks", content=_body(list(reversed(frames))),
           headers={"content-type": BATCH_TYPE, "content-length": str(total)}).raise_for_status()
    return (total - 8 * len(frames)) / (time.perf_counter() - t) / 1e9


def _materialize(c: httpx.Client, frames: list[tuple[bytes, bytes]], pool: BufferPool | None = None) -> float:
    leases = []

    def take(n: int) -> memoryview:
        leases.append(pool.take(n))
        return leases[-1].buffer.view(n)

    t = time.perf_counter()
    with c.stream("GET", f"/v1/prefixes/{frames[-1][0].hex()}") as r:
        got = list(iter_frames(r, max_frame_bytes=1 << 40, take=take if pool is not None else None))
    elapsed = time.perf_counter() - t
    assert r.status_code == 200 and len(got) == len(frames)
    for lease in leases:
        lease.release()
    return sum(len(f) for _, f in frames) / elapsed / 1e9


REMOTE_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
REMOTE_BLOCK = 64


def _remote_cache(url: str, *, fresh: bool) -> cs.RemoteCache:
    cache = cs.RemoteCache(url, model_id="client-bench", layout=REMOTE_LAYOUT, codec=cs.Raw(),
                           block_tokens=REMOTE_BLOCK, read_buffer_bytes=0 if fresh else "1GiB", trust_env=False)
    if fresh:
        cache._host_buffers = BufferPool(pin=True, keep_bytes=0)  # (no setting: max_pending_bytes is > 0)
    return cache


def _remote_calls(url: str, blocks: int, reps: int, device: str = "cpu") -> list[dict]:
    """A waited ``ingest`` of a fresh prompt, then its ``materialize``, by a cache that keeps
    its host buffers and one that does not, in turns."""
    caches = {"kept (default)": _remote_cache(url, fresh=False), "fresh": _remote_cache(url, fresh=True)}
    gen = torch.Generator().manual_seed(3)
    shape = (REMOTE_LAYOUT.num_kv_heads, blocks * REMOTE_BLOCK, REMOTE_LAYOUT.head_dim)
    kv = [(torch.randn(shape, generator=gen).half().to(device), torch.randn(shape, generator=gen).half().to(device))
          for _ in range(REMOTE_LAYOUT.num_layers)]
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in kv)
    times: dict[str, dict[str, list[float]]] = {name: {"ingest": [], "materialize": []} for name in caches}
    try:
        for rep in range(reps + 1):  # the first a warm-up: connections made, the server's pages touched
            for name, cache in caches.items():
                tokens = torch.randint(0, 50_000, (blocks * REMOTE_BLOCK,), generator=gen).tolist()  # a fresh prompt
                t = time.perf_counter()
                assert cache.ingest(tokens, kv).stored == blocks
                t1 = time.perf_counter()
                got = cache.materialize(tokens, device)
                if device != "cpu":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                assert got.num_tokens == len(tokens)
                if rep:
                    times[name]["ingest"].append(t1 - t)
                    times[name]["materialize"].append(t2 - t1)
    finally:
        for cache in caches.values():
            cache.close()
    rows = []
    for name, ts in times.items():
        row: dict[str, Any] = {"host_buffers": name}
        for call in ("ingest", "materialize"):
            row[f"{call}_ms"] = statistics.median(ts[call]) * 1e3
            row[f"{call}_kv_gbps"] = kv_bytes / statistics.median(ts[call]) / 1e9
        rows.append(row)
    for row in rows:
        for call in ("ingest", "materialize"):
            row[f"{call}_vs_fresh"] = rows[-1][f"{call}_ms"] / row[f"{call}_ms"]
    return rows


def _lookup_chain(c: httpx.Client, blocks: int) -> list[bytes]:
    small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16")
    chain, parent = [], bytes(16)
    for i in range(blocks):
        h, f = make_frame(900_000 + i, position=i, parent=parent, layout=small, block=32, codec=Raw())
        chain.append((h, f))
        parent = h
    total = sum(8 + len(f) for _, f in chain)
    c.post("/v1/blocks", content=_body(list(reversed(chain))),
           headers={"content-type": BATCH_TYPE, "content-length": str(total)}).raise_for_status()
    return [h for h, _ in chain]


def _lookups(transport: httpx.BaseTransport, url: str, keys: list[bytes], n: int) -> list[float]:
    path, content, headers = lookup_request(keys)
    out = []
    for i in range(n + 10):
        request = httpx.Request("POST", url + path, content=content, headers=headers,
                                extensions={"timeout": {"connect": 10, "read": 60, "write": 60, "pool": 60},
                                            IDEMPOTENT_EXTENSION: True})
        t = time.perf_counter()
        response = transport.handle_request(request)
        response.read()
        if i >= 10:
            out.append(time.perf_counter() - t)
    assert response.status_code == 200
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--lookup-blocks", type=int, default=512)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=FILE",
                    help="another BulkTransport, from a source file, as a further column")
    ap.add_argument("--device", default="cpu", help="where RemoteCache's KV lives and is materialized (cpu, cuda)")
    ap.add_argument("--out", type=Path, default=None, help="folder for client.json (default benchmarks/results)")
    args = ap.parse_args()
    makers: dict[str, Callable[[], httpx.BaseTransport]] = {
        "httpx": lambda: httpx.HTTPTransport(), "bulk": lambda: BulkTransport(trust_env=False),
        "bulk, reused buffers": lambda: BulkTransport(trust_env=False)}
    for spec in args.also:
        name, _, path = spec.partition("=")
        makers[name] = (lambda cls: (lambda: cls()))(_load_transport(path))
    frames = chain_frames(args.frames, 7)
    rates: dict[str, dict[str, list[float]]] = {n: {"ingest": [], "materialize": [], "lookup": []} for n in makers}
    with tempfile.TemporaryDirectory() as tmp:
        procs: list[Proc] = []
        try:
            budget = str(int(1.5 * sum(len(f) for _, f in frames)) + (256 << 20) + args.frames * (18 << 20))
            proc, url = start_cacheseek(Path(tmp), "client", "--cpu-bytes", budget, "--disk-bytes", "0")
            procs.append(proc)
            clients = {n: httpx.Client(base_url=url, timeout=300, transport=make()) for n, make in makers.items()}
            keys = _lookup_chain(clients["bulk"], args.lookup_blocks)
            pool = BufferPool(keep_bytes=1 << 40)
            for _ in range(args.reps):
                for name, c in clients.items():
                    rates[name]["ingest"].append(_ingest(c, frames))
                    rates[name]["materialize"].append(_materialize(c, frames, pool if "reused" in name else None))
            for _ in range(8):  # rounds
                for name, c in clients.items():
                    rates[name]["lookup"] += _lookups(c._transport, url, keys, args.lookups // 8)
            for c in clients.values():
                c.close()
            remote = _remote_calls(url, args.frames, args.reps, args.device)
        finally:
            for p in procs:
                p.stop()
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
    rows = []
    base = rates["httpx"]
    for name, r in rates.items():
        row = {"client": name, "ingest_gbps": statistics.median(r["ingest"]),
               "materialize_gbps": statistics.median(r["materialize"]),
               "lookup_p50_ms": q(r["lookup"], 50), "lookup_p99_ms": q(r["lookup"], 99)}
        row["ingest_vs_httpx"] = row["ingest_gbps"] / statistics.median(base["ingest"])
        row["materialize_vs_httpx"] = row["materialize_gbps"] / statistics.median(base["materialize"])
        row["lookup_p99_vs_httpx"] = row["lookup_p99_ms"] / q(base["lookup"], 99)
        rows.append(row)
    print(table(rows, ["client", "ingest_gbps", "materialize_gbps", "lookup_p50_ms", "lookup_p99_ms",
                       "ingest_vs_httpx", "materialize_vs_httpx", "lookup_p99_vs_httpx"]))
    print(table(remote, ["host_buffers", "ingest_ms", "ingest_kv_gbps", "ingest_vs_fresh", "materialize_ms",
                         "materialize_kv_gbps", "materialize_vs_fresh"],
                f"RemoteCache, a fresh prompt of {args.frames} Raw blocks of {REMOTE_BLOCK} tokens, from and to {args.device} tensors"))
    write_json("client", {"device": args.device, "frames": args.frames, "frame_bytes": len(frames[0][1]), "reps": args.reps,
                     "lookups": args.lookups, "lookup_blocks": args.lookup_blocks, "rows": rows,
                     "remote_cache": remote}, args.out)


if __name__ == "__main__":
    main()
