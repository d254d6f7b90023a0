"""What the server's own counting costs per request, in CPU time, metrics on against off.

    python -m benchmarks.metrics_cost [--calls 2000] [--rounds 6]

Two apps in this process, one with ``metrics_detail`` on (per-route latency histograms,
traffic per namespace and model) and one with it off, each over a CPU tier; requests are
handed to each app as ASGI calls (no sockets), in alternating rounds, and each call's
process CPU time is measured (``time.process_time``: this process only, so other
processes on a shared host change it far less than wall time). Requests: a lookup of a
512-block chain as ``RemoteCache`` sends it (binary, with its model and block-size
headers), a PUT of one 64 KiB frame, a GET of it, and a GET of a 16-block prefix.
In-run baseline: the same calls with metrics off; the table gives on/off per request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from cacheseek.layout import KVLayout
from cacheseek.quant import Raw
from cacheseek.server.app import create_app
from cacheseek.server.config import ServerSettings
from cacheseek.store.frame import build_frame, plan_frame

from .report import table, write_json

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16")
BLOCK = 32
HEADERS = [(b"x-cacheseek-model", b"llama-3-8b"), (b"x-cacheseek-block-tokens", b"32"),
           (b"x-cacheseek-namespace", b"team-a")]


def frame(seed: int, position: int = 0, parent: bytes = bytes(16)) -> tuple[bytes, bytes]:
    rng = random.Random(seed)
    h = rng.randbytes(16)
    template = Raw().template((LAYOUT.num_layers, LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim), LAYOUT.dtype)
    meta = plan_frame(block_hash=h, parent_hash=parent, position=position, layout=LAYOUT, block_tokens=BLOCK,
                      codec=Raw().spec(), buffers=[(n, s.dtype, s.shape) for n, s, _ in template.named_buffers()])
    return h, bytes(build_frame(meta, [rng.randbytes(e.nbytes) for e in meta.tensors]))


def chain(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    out, parent = [], bytes(16)
    for i in range(n):
        h, f = frame(seed * 10_000 + i, i, parent)
        out.append((h, f))
        parent = h
    return out


async def call(app, method: str, path: str, body: bytes = b"", headers: list | None = None,
               query: bytes = b"") -> tuple[int, float]:
    """One request through ``app``; returns (status, process CPU seconds)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(b"host", b"bench"), (b"content-length", str(len(body)).encode()), *(headers or [])],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = False
    status = 0

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    t = time.process_time()
    await app(scope, receive, send)
    return status, time.process_time() - t


async def run(calls: int, rounds: int) -> list[dict]:
    apps = {}
    tmp = Path(tempfile.mkdtemp())
    contexts = []
    for name, detail in (("on", True), ("off", False)):
        settings = ServerSettings(cpu_bytes="512MiB", disk_bytes=0, disk_path=tmp / name, metrics_detail=detail)
        app = create_app(settings)
        ctx = app.router.lifespan_context(app)
        await ctx.__aenter__()
        contexts.append(ctx)
        apps[name] = app
    long_chain = chain(512, 1)
    prefix = chain(16, 2)
    one = frame(99)
    lookup_body = b"".join(h for h, _ in long_chain)
    for app in apps.values():
        for h, f in long_chain + prefix:
            status, _ = await call(app, "PUT", f"/v1/blocks/{h.hex()}", f,
                                   [(b"content-type", b"application/octet-stream"), *HEADERS])
            assert status == 201, status
    requests = {
        "lookup 512 blocks": lambda app: call(app, "POST", "/v1/lookup", lookup_body,
                                              [(b"content-type", b"application/octet-stream"), *HEADERS]),
        "PUT one frame": lambda app: call(app, "PUT", f"/v1/blocks/{one[0].hex()}", one[1],
                                          [(b"content-type", b"application/octet-stream"), *HEADERS]),
        "GET one frame": lambda app: call(app, "GET", f"/v1/blocks/{one[0].hex()}", headers=HEADERS),
        "GET 16-block prefix": lambda app: call(app, "GET", f"/v1/prefixes/{prefix[-1][0].hex()}", headers=HEADERS),
    }
    times = {(r, v): [] for r in requests for v in apps}
    per_round = max(1, calls // rounds)
    for rnd in range(rounds):
        order = list(apps) if rnd % 2 == 0 else list(reversed(apps))
        for name in order:
            app = apps[name]
            for req, make in requests.items():
                for i in range(per_round + 20):
                    if req == "PUT one frame":  # a new block each time: always a store, never "present"
                        await call(app, "DELETE", f"/v1/blocks/{one[0].hex()}", headers=HEADERS)
                    status, cpu = await make(app)
                    assert status in (200, 201), (req, status)
                    if i >= 20:
                        times[(req, name)].append(cpu)
    for ctx in contexts:
        await ctx.__aexit__(None, None, None)
    rows = []
    for req in requests:
        on, off = statistics.median(times[(req, "on")]), statistics.median(times[(req, "off")])
        rows.append({"request": req, "on_us": on * 1e6, "off_us": off * 1e6, "on_over_off": on / off,
                     "cost_us": (on - off) * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="calls per request kind and setting")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(run(args.calls, args.rounds))
    path = write_json("metrics_cost", {"calls": args.calls, "rounds": args.rounds, "rows": rows}, args.out)
    print(table(rows, ["request", "on_us", "off_us", "on_over_off", "cost_us"],
                f"Process CPU time per request (median of {args.calls}), metrics on against off, "
                f"{args.rounds} alternating rounds"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
