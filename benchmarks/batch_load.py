"""An engine's batch over HTTP: ``RemoteCache.materialize_into_batch`` and ``locate_batch``
against the same calls made the way they were made before, in one run, over loopback to one
``cacheseek serve`` (a CPU tier only).

    python -m benchmarks.batch_load [--requests 8] [--blocks 4] [--block-tokens 32] [--reps 30]

``--requests`` prompts of ``--blocks`` full blocks each (Raw frames of a small layout, so
that the round trips, not the bytes, are what is measured) are stored, then loaded into an
engine's pages (``cs.KVPages``, NHD, on the CPU) by three clients taking turns, over
loopback as it is and (``--rtt-ms``) through a proxy that delays every byte by half the
round-trip time each way, as a link between hosts would:

- ``in series``: a lookup per request, then a ``GET /v1/prefixes`` per request, one after
  another (2N round trips in series), as ``materialize_into_batch`` ran before: the same
  client with its lookup of several chains off and ``max_concurrent_fetches=1``;
- ``one lookup, GETs at once``: one lookup of every request's chain, then the N ``GET``s at
  once over the client's pool (``max_concurrent_fetches``, default 8), as it runs now;

And ``locate`` of each prompt, one call after another, against one ``locate_batch`` of them
all. Times are the median (and p90) of ``--reps`` calls each; ``ratio`` is in series over
batched (above 1: batched is faster). Writes ``batch_load.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cacheseek as cs
from cacheseek.layout import KVLayout

from .report import table, write_json
from .server import free_port, start_cacheseek


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), statistics.quantiles(xs, n=10)[-1]


def _delay_proxy(listen_port: int, upstream_port: int, one_way_s: float, ready: Any) -> None:
    """A TCP proxy on loopback that delivers every byte ``one_way_s`` after it arrived, in
    each direction (a link's latency, not its bandwidth: chunks are not held back by each
    other). Runs in a process of its own, so its work does not share the client's GIL."""
    import asyncio

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(1 << 20):
                loop.call_at(loop.time() + one_way_s, writer.write, data)
            await asyncio.sleep(one_way_s)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def _measure(url: str, layout: KVLayout, B: int, requests: list[Any], prompts: list[Any], dest: cs.KVPages,
             reps: int) -> dict[str, dict[str, list[float]]]:
    def client(**kw: Any) -> cs.RemoteCache:
        return cs.RemoteCache(url, model_id="batch-load", layout=layout, codec=cs.Raw(), block_tokens=B,
                              trust_env=False, **kw)

    with client(max_concurrent_fetches=1) as in_series, client(max_concurrent_fetches=1) as one_lookup, \
            client() as batched:
        in_series._chain_lookups = False  # (each request looked up alone, as before)
        clients = {BEFORE: in_series, "one lookup, GETs in series": one_lookup, "one lookup, GETs at once (now)": batched}
        times: dict[str, dict[str, list[float]]] = {name: {"load": [], "locate": []} for name in clients}
        for rep in range(reps + 2):  # (the first two rounds warm the pools: not counted)
            for name, cache in clients.items():  # (taking turns: load from elsewhere falls on each alike)
                load = _timed(lambda: cache.materialize_into_batch(requests, dest))
                if cache is in_series:
                    locate = _timed(lambda: [cache.locate(p) for p in prompts])
                else:
                    locate = _timed(lambda: cache.locate_batch(prompts))
                if rep >= 2:
                    times[name]["load"].append(load)
                    times[name]["locate"].append(locate)
        got = batched.materialize_into_batch(requests, dest)
        assert all(x.num_blocks == x.num_tokens // B > 0 for x in got), got
    return times


BEFORE = "in series (before)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4, help="full blocks per request")
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rtt-ms", default="0,1", help="round-trip times to add, comma-separated (0: loopback as is; "
                                                     "else through a proxy delaying each direction by half)")
    ap.add_argument("--out", type=Path, default=None, help="folder for batch_load.json (default benchmarks/results)")
    args = ap.parse_args()
    import multiprocessing

    layout = KVLayout(num_layers=args.layers, num_kv_heads=2, head_dim=64, dtype="float16")
    N, B, page = args.requests, args.block_tokens, 16
    tokens = args.blocks * B
    per_request = -(-tokens // page)
    gen = torch.Generator().manual_seed(0)

    def pages_of() -> cs.KVPages:
        shape = (N * per_request, page, layout.num_kv_heads, layout.head_dim)
        k = [torch.randn(*shape, generator=gen).half() for _ in range(layout.num_layers)]
        v = [torch.randn(*shape, generator=gen).half() for _ in range(layout.num_layers)]
        return cs.KVPages(k, v, layout="NHD")

    prompts = [torch.randint(0, 32000, (tokens,), generator=gen).tolist() for _ in range(N)]
    tables = [list(range(r * per_request, (r + 1) * per_request)) for r in range(N)]
    requests = [cs.PagedRequest(p, t) for p, t in zip(prompts, tables)]
    trips = {BEFORE: (2 * N, N), "one lookup, GETs in series": (N + 1, 1), "one lookup, GETs at once (now)": (N + 1, 1)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_cacheseek(Path(tmp), "batch_load", "--cpu-bytes", "1GiB", "--disk-bytes", "0")
        try:
            with cs.RemoteCache(url, model_id="batch-load", layout=layout, codec=cs.Raw(), block_tokens=B,
                                trust_env=False) as writer:
                stored = writer.ingest_batch(requests, pages_of())
                assert all(r.stored == args.blocks for r in stored), stored
            dest = pages_of()
            for rtt in (float(x) for x in args.rtt_ms.split(",")):
                proxy = None
                if rtt > 0:
                    port, ready = free_port(), multiprocessing.Event()
                    proxy = multiprocessing.Process(target=_delay_proxy, daemon=True,
                                                    args=(port, int(url.rsplit(":", 1)[1]), rtt / 2e3, ready))
                    proxy.start()
                    assert ready.wait(30), "the delaying proxy did not start"
                try:
                    times = _measure(f"http://127.0.0.1:{port}" if proxy else url, layout, B, requests, prompts, dest,
                                     args.reps)
                finally:
                    if proxy is not None:
                        proxy.terminate()
                        proxy.join(10)
                base_load, base_locate = (statistics.median(times[BEFORE][k]) for k in ("load", "locate"))
                for name, t in times.items():
                    load, load_p90 = _stats(t["load"])
                    locate, locate_p90 = _stats(t["locate"])
                    rows.append({"rtt_ms": rtt, "client": name, "load_round_trips": trips[name][0], "load_ms": load,
                                 "load_p90_ms": load_p90, "load_ratio": base_load / load,
                                 "locate_round_trips": trips[name][1], "locate_ms": locate,
                                 "locate_p90_ms": locate_p90, "locate_ratio": base_locate / locate})
        finally:
            proc.stop()
    print(table(rows, ["rtt_ms", "client", "load_round_trips", "load_ms", "load_p90_ms", "load_ratio",
                       "locate_round_trips", "locate_ms", "locate_p90_ms", "locate_ratio"],
                f"materialize_into_batch and locate of {N} requests of {args.blocks} Raw blocks of {B} tokens "
                f"({layout.num_layers} layers), loopback, median of {args.reps}; ratio: before / this"))
    write_json("batch_load", {"requests": N, "blocks": args.blocks, "block_tokens": B, "layers": args.layers,
                              "reps": args.reps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
