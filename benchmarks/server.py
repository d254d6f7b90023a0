"""The HTTP service over loopback against Redis: ingest and materialize throughput, lookup latency.

    python -m benchmarks.server [--frames 24] [--reps 3] [--clients 1,8] [--lookups 2000]
                                [--baseline main] [--tls] [--cpu-reserve 1GiB] [--no-full] [--no-disk]
    python -m benchmarks.server --plot-only benchmarks/results/server.json --out docs
    python -m benchmarks.server --frames 24 --reps 3 --compare-metrics

``--compare-metrics`` (no Redis needed) measures the cost of the server's own counting instead: two CPU-tier
servers, one with ``--metrics-detail`` (the default: per-route latency histograms, traffic
per namespace and model) and one with ``--no-metrics-detail`` (the store's figures only),
take turns rep by rep, one client each, on the same frames; the table gives each figure's
ratio, on over off (the in-run baseline).

Frames are int4 KIVI frames (G=32, fp16 stats) of Llama-3-8B-shaped blocks: 32 layers x 8 KV
heads x 256 tokens x 128, 10.5 MB each, built directly (valid headers and checksums over
random payload bytes; the server never decodes). Each client process sends or fetches its
own ``--frames`` frames; throughput is frame GB/s over all clients, median of ``--reps``.

In-run baseline: redis-py ``SET``/``GET`` of the same frames against a local
``redis-server`` (in memory, no persistence), which is what a user would do instead. The
headline CacheSeek server runs a CPU tier only (in memory too), with its default budget and
reserve (4 GiB and 512 MiB; more if the frames need it), room for every frame;
a second one has a CPU tier already full of other frames, so every frame ingested evicts
one (a cache in steady state; it lends frames being received 256 MiB beyond its budget, the
default reserve of a 2 GiB tier, and evicts for them when they commit); a third runs the
disk tier alone (write-through, fsync), for reference. Lookup: p50/p99 of ``POST
/v1/lookup`` for a 512-block chain over a keep-alive connection, sent by ``RemoteCache``
(the hashes as raw bytes), and as JSON through httpx (Redis: ``EXISTS`` of the same 512
keys through redis-py); the three take turns, in rounds.

Before and after in one run: ``--baseline REF`` also serves the CPU tier from the code of git
ref ``REF`` (its tree exported with ``git archive`` into a temporary folder, run by this
Python), and ``--tls`` from this code over HTTPS (a self-signed certificate made with the
``openssl`` command; its clients use httpx's own transport with that certificate as CA).
The servers take turns within each repetition, and their lookups within each round, so that
load from elsewhere on a shared host falls on all of them alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from cacheseek.layout import KVLayout
from cacheseek.quant import KIVI, Raw
from cacheseek.remote import RemoteCache
from cacheseek.store.frame import build_frame, plan_frame
from cacheseek.transport import BulkTransport
from cacheseek.batch_body import iter_frames

from .report import add_plot_only, bars, plot_only, pyplot, redraw, save, source_line, table, write_json

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
BLOCK = 256
CODEC = KIVI(bits=4, group_size=32)
BATCH_TYPE = "application/vnd.cacheseek.frames"
FULL_FRAMES = 4  # the full CPU tier holds this many frames
FULL_RESERVE = 256 << 20  # and may lend this much beyond its budget to frames being received


def make_frame(seed: int, *, position: int = 0, parent: bytes = bytes(16), layout: KVLayout = LAYOUT,
               block: int = BLOCK, codec=CODEC) -> tuple[bytes, bytes]:
    rng = random.Random(seed)
    h = rng.randbytes(16)
    template = codec.template((layout.num_layers, layout.num_kv_heads, block, layout.head_dim), layout.dtype)
    meta = plan_frame(block_hash=h, parent_hash=parent, position=position, layout=layout, block_tokens=block,
                      codec=codec.spec(), buffers=[(n, s.dtype, s.shape) for n, s, _ in template.named_buffers()])
    payload = os.urandom(meta.payload_nbytes)  # fast; every buffer is a slice of it
    bufs, view = [], memoryview(payload)
    for e in meta.tensors:
        bufs.append(view[e.offset : e.offset + e.nbytes])
    return h, bytes(build_frame(meta, bufs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up in {timeout}s")


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# Runs ``cacheseek serve`` from another checkout's tree (argv[1]), with this Python. The
# package maps top-level folders into cacheseek: server/ always, kernels/ in trees from before
# the kernels moved into cacheseek/kernels/ (f4b93e3); a tree without one imports its own.
BASELINE_LAUNCHER = """
import importlib.util, os, sys
root = sys.argv.pop(1)
sys.path.insert(0, root)
import cacheseek
for name, folder in (("cacheseek.server", "server"), ("cacheseek.kernels", "kernels")):
    if not os.path.isfile(f"{root}/{folder}/__init__.py"):
        continue
    spec = importlib.util.spec_from_file_location(name, f"{root}/{folder}/__init__.py",
                                                  submodule_search_locations=[f"{root}/{folder}"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
from cacheseek.server.cli import main
for module in (cacheseek, sys.modules["cacheseek.server"], sys.modules["cacheseek.server.cli"]):
    assert module.__file__.startswith(root), module.__file__
sys.exit(main())
"""


def export_tree(ref: str, into: Path) -> Path:
    """The files of git ref ``ref`` of this repository, under ``into``."""
    repo = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def start_cacheseek(tmp: Path, name: str, *args: str, tree: Path | None = None,
                    tls: tuple[Path, Path] | None = None) -> tuple[Proc, str]:
    """``cacheseek serve`` from this code, or (``tree``) from an exported checkout."""
    port = free_port()
    script = Path(sys.executable).parent / "cacheseek"
    if tree is not None:
        cmd = [sys.executable, "-c", BASELINE_LAUNCHER, str(tree)]
    else:
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "cacheseek.server.cli"]
    args = ("--max-inflight-body-bytes", "8GiB", *args)  # (at least --max-body-bytes, or serve refuses)
    if tls is not None:
        args = (*args, "--tls-cert", str(tls[0]), "--tls-key", str(tls[1]))
    proc = Proc([*cmd, "serve", "--port", str(port), "--log-level", "warning", "--disk-path", str(tmp / name),
                 "--max-body-bytes", "8GiB", *args], tmp / f"{name}.log")
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=str(tls[0])) if tls else True
    wait_until(lambda: httpx.get(url + "/readyz", verify=verify).status_code == 200, f"cacheseek serve ({name})")
    return proc, url


def start_redis(tmp: Path) -> tuple[Proc, int]:
    import redis

    port = free_port()
    proc = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(tmp), "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"],
                tmp / "redis.log")
    wait_until(lambda: redis.Redis(port=port).ping(), "redis-server")
    return proc, port


# -- client work, run in child processes ---------------------------------------------------------

_FRAMES: list[tuple[bytes, bytes]] = []  # set before forking; children share it copy-on-write


def _chain_body(frames: list[tuple[bytes, bytes]]):
    for _, f in frames:
        yield len(f).to_bytes(8, "little")
        yield f


def _client(job: tuple[str, str, int, int, int]) -> int:
    """One client: do ``op`` on its slice of frames; returns frame bytes moved."""
    system, target, start, count, go_at = job
    mine = _FRAMES[start : start + count]
    moved = sum(len(f) for _, f in mine)
    if system == "redis":
        import redis

        r = redis.Redis(port=int(target.split(":")[1]), socket_timeout=120)
        r.ping()
        _sleep_until(go_at)
        op = target.split(":")[0]
        for h, f in mine:
            if op == "set":
                r.set(h, f)
            else:
                got = r.get(h)
                assert got is not None and len(got) == len(f)
        return moved
    op, url = target.split("|")
    # Over TLS, httpx's own transport (BulkTransport speaks plain HTTP), trusting the bench's certificate.
    kw = {"verify": _bench_ca()} if url.startswith("https") else {"transport": BulkTransport()}
    with httpx.Client(base_url=url, timeout=300, **kw) as c:
        c.get("/healthz")
        _sleep_until(go_at)
        if op == "put":
            for h, f in mine:
                c.put(f"/v1/blocks/{h.hex()}", content=f).raise_for_status()
        elif op == "batch":
            total = sum(8 + len(f) for _, f in mine)
            c.post("/v1/blocks", content=_chain_body(mine), headers={"content-type": BATCH_TYPE,
                                                                   "content-length": str(total)}).raise_for_status()
        elif op == "get":
            for h, f in mine:
                with c.stream("GET", f"/v1/blocks/{h.hex()}") as got:
                    n = sum(len(chunk) for chunk in got.iter_raw())
                assert got.status_code == 200 and n == len(f)
        elif op == "prefix":  # as RemoteCache reads it: each frame into a buffer of its own
            with c.stream("GET", f"/v1/prefixes/{mine[-1][0].hex()}") as got:
                frames = list(iter_frames(got, max_frame_bytes=1 << 40))
            assert got.status_code == 200 and sum(len(f) for f in frames) == moved, got.status_code
        else:
            raise ValueError(op)
    return moved


def _bench_ca() -> ssl.SSLContext:
    """Trust the benchmark's self-signed certificate (its path is in CACHESEEK_BENCH_CA)."""
    return ssl.create_default_context(cafile=os.environ["CACHESEEK_BENCH_CA"])


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


def run_clients(pool_size: int, system: str, target: str, per_client: int, reps: int,
                before: Callable[[], None] | None = None) -> float:
    """GB/s of frame bytes moved by ``pool_size`` client processes (median of ``reps``)."""
    rates = []
    with mp.get_context("fork").Pool(pool_size) as pool:
        for _ in range(reps):
            if before:
                before()
            go_at = time.time() + 0.3  # every process is connected and waiting by then
            jobs = [(system, target, i * per_client, per_client, go_at) for i in range(pool_size)]
            moved = sum(pool.map(_client, jobs))
            rates.append(moved / (time.time() - go_at) / 1e9)
    return statistics.median(rates)


# -- the measurements ----------------------------------------------------------------------------


def chain_frames(n: int, seed: int, **shape: Any) -> list[tuple[bytes, bytes]]:
    """A chain of ``n`` frames; ``shape``: ``make_frame``'s layout, block and codec."""
    out, parent = [], bytes(16)
    for i in range(n):
        h, f = make_frame(seed * 100_000 + i, position=i, parent=parent, **shape)
        out.append((h, f))
        parent = h
    return out


def client_chains(clients: int, per_client: int) -> list[tuple[bytes, bytes]]:
    """One chain of ``per_client`` frames for each client, laid end to end."""
    return [x for c in range(clients) for x in chain_frames(per_client, 1000 * clients + c)]


def cacheseek_rows(urls: dict[str, str], clients: list[int], per: int, reps: int, *,
                   filler: list[tuple[bytes, bytes]] | None = None) -> list[dict]:
    """Ingest and materialize rows of each server (label -> url), taking turns within each
    repetition; with ``filler``, ingest only, into a tier refilled with ``filler`` before each run."""
    rows = []

    def clear(url: str) -> None:
        verify = _bench_ca() if url.startswith("https") else True
        with httpx.Client(base_url=url, timeout=300, verify=verify) as c:
            for h, _ in _FRAMES:
                c.delete(f"/v1/blocks/{h.hex()}")
            if filler:
                total = sum(8 + len(f) for _, f in filler)
                c.post("/v1/blocks", content=_chain_body(filler),
                       headers={"content-type": BATCH_TYPE, "content-length": str(total)}).raise_for_status()

    ops = [("ingest_put_gbps", "put", True), ("ingest_batch_gbps", "batch", True)]
    if filler is None:
        ops += [("materialize_get_gbps", "get", False), ("materialize_prefix_gbps", "prefix", False)]
    for n in clients:
        rates: dict[str, dict[str, list[float]]] = {label: {key: [] for key, _, _ in ops} for label in urls}
        for key, op, clears in ops:
            for _ in range(reps):
                for label, url in urls.items():
                    before = (lambda url=url: clear(url)) if clears else None
                    rates[label][key].append(run_clients(n, "cacheseek", f"{op}|{url}", per, 1, before=before))
        for label in urls:
            row = {"system": label, "clients": n}
            row.update({key: statistics.median(r) for key, r in rates[label].items()})
            row.update({key.replace("_gbps", "_all"): r for key, r in rates[label].items()})
            rows.append(row)
            print(f"  {label:30s} {n} client(s): " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                             if k.endswith("gbps")), flush=True)
    return rows


def redis_rows(port: int, clients: list[int], per: int, reps: int) -> list[dict]:
    import redis

    rows = []
    for n in clients:
        row = {"system": "redis-server (redis-py)", "clients": n}
        row["ingest_put_gbps"] = run_clients(n, "redis", f"set:{port}", per, reps,
                                             before=lambda: redis.Redis(port=port).flushall())
        row["materialize_get_gbps"] = run_clients(n, "redis", f"get:{port}", per, reps)
        rows.append(row)
        print(f"  redis                  {n} client(s): ingest {row['ingest_put_gbps']:.2f}  "
              f"materialize {row['materialize_get_gbps']:.2f}", flush=True)
    return rows


def lookup_latency(url: str, redis_port: int | None, blocks: int, n: int, rounds: int = 8,
                   others: dict[str, str] | None = None) -> dict:
    """p50/p99 of one lookup of a ``blocks``-long stored chain (small frames: lookups never
    read payloads). The three clients take turns, ``n / rounds`` calls each per round, so
    that load from elsewhere on the host falls on all of them alike (no Redis client when
    ``redis_port`` is None)."""

    small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16")
    chain, parent = [], bytes(16)
    for i in range(blocks):
        h, f = make_frame(900_000 + i, position=i, parent=parent, layout=small, block=32, codec=Raw())
        chain.append((h, f))
        parent = h
    keys = [h for h, _ in chain]
    body = {"hashes": [h.hex() for h in keys]}
    r = None
    if redis_port is not None:
        import redis

        r = redis.Redis(port=redis_port)
        for h, f in chain:
            r.set(h, f)
    remote = RemoteCache(url, model_id="bench", layout=small, codec=Raw(), block_tokens=32)
    others = others or {}
    total = sum(8 + len(f) for _, f in chain)
    extra_calls, opened = {}, []
    for label, other in others.items():
        if other.startswith("https"):  # RemoteCache's binary body, sent through httpx's own transport
            client = httpx.Client(base_url=other, verify=_bench_ca())
            raw = b"".join(keys)
            extra_calls[label] = lambda client=client: client.post(
                "/v1/lookup", content=raw, headers={"content-type": "application/octet-stream"}).json()["matched"]
        else:
            client = httpx.Client(base_url=other, transport=BulkTransport())
            other_remote = RemoteCache(other, model_id="bench", layout=small, codec=Raw(), block_tokens=32)
            opened.append(other_remote)
            extra_calls[label] = lambda rc=other_remote: rc._lookup(keys)["matched"]
        opened.append(client)
        client.post("/v1/blocks", content=_chain_body(list(reversed(chain))),
                    headers={"content-length": str(total)}).raise_for_status()
    with httpx.Client(base_url=url, transport=BulkTransport()) as c:
        c.post("/v1/blocks", content=_chain_body(list(reversed(chain))),
               headers={"content-length": str(total)}).raise_for_status()
        # RemoteCache's own lookup (hashes computed once, as its ingest and materialize do),
        # a JSON body through httpx, as any other client would send it, and Redis.
        calls = {"binary": lambda: remote._lookup(keys)["matched"],
                 "json": lambda: c.post("/v1/lookup", json=body).json()["matched"], **extra_calls}
        if r is not None:
            calls["redis"] = lambda: r.exists(*keys)
        times: dict[str, list[float]] = {form: [] for form in calls}
        for _ in range(rounds):
            for form, call in calls.items():
                for i in range(n // rounds + 10):
                    t = time.perf_counter()
                    got = call()
                    if i >= 10:
                        times[form].append(time.perf_counter() - t)
                assert got == blocks, form
    remote.close()
    for thing in opened:
        thing.close()
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
    out = {"blocks": blocks, "lookups": n, "p50_ms": q(times["binary"], 50), "p99_ms": q(times["binary"], 99),
           "json_p50_ms": q(times["json"], 50), "json_p99_ms": q(times["json"], 99)}
    if r is not None:
        out |= {"redis_exists_p50_ms": q(times["redis"], 50), "redis_exists_p99_ms": q(times["redis"], 99)}
    for label in others:
        out[label] = {"p50_ms": q(times[label], 50), "p99_ms": q(times[label], 99)}
    return out


REDIS = "redis-server (redis-py)"


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """Ingest and materialize GB/s of each server beside Redis, for 1 and for 8 clients."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    rows = doc["rows"]
    clients = sorted({r["clients"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    short = {REDIS: "redis-server", "cacheseek (cpu tier)": "cacheseek cpu", "cacheseek (cpu tier, full)":
             "cacheseek cpu, full", "cacheseek (disk, fsync)": "cacheseek disk"}
    by = {(r["system"], r["clients"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    panels = (("ingest", {"PUT, one frame a request (Redis: SET)": "ingest_put_gbps",
                          "POST, a batch of frames": "ingest_batch_gbps"}),
              ("materialize", {"GET, one frame a request (Redis: GET)": "materialize_get_gbps",
                               "GET of a whole prefix": "materialize_prefix_gbps"}))
    for ax, (what, columns) in zip(axes, panels):
        keep = [s for s in systems if any(by.get((s, n), {}).get(c) for n in clients for c in columns.values())]
        labels = [f"{short.get(s, s)}, {n} client{'s' if n > 1 else ''}" for n in clients for s in keep]
        bars(ax, labels, {name: [by.get((s, n), {}).get(column) for n in clients for s in keep]
                          for name, column in columns.items()}, fmt="{:.2f}")
        ax.set_title(f"{what} (higher is better)")
        ax.set_xlabel("server (tiers), concurrent clients")
        for i in range(1, len(clients)):
            ax.axvline(i * len(keep) - 0.5, color="0.7", lw=0.8)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=2, fontsize=9, frameon=False)
        ax.set_ylabel("GB/s of frames over loopback, all clients")
    lk = doc["lookup"]
    note = (f"{source_line(doc)}\nlookup of a {lk['blocks']}-block chain ({lk['lookups']} calls): p50 "
            f"{lk['p50_ms']:.2f} ms, p99 {lk['p99_ms']:.2f} ms; Redis EXISTS of the same keys: p50 "
            f"{lk['redis_exists_p50_ms']:.2f} ms, p99 {lk['redis_exists_p99_ms']:.2f} ms")
    return save(fig, out_dir, "server", note=note,
                title=f"cacheseek serve against redis-server: int4 frames of {doc['frame_mb']:.1f} MB "
                      f"(Llama-3-8B blocks of {doc['block_tokens']} tokens), loopback")


def main() -> None:
    global _FRAMES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=24, help="frames per client (8-client runs: a third each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--lookup-blocks", type=int, default=512)
    ap.add_argument("--no-disk", action="store_true", help="skip the disk-tier server")
    ap.add_argument("--no-full", action="store_true", help="skip the full-tier server")
    ap.add_argument("--baseline", metavar="REF", default=None,
                    help="also serve the CPU tier from git ref REF (e.g. main): before and after in one run")
    ap.add_argument("--tls", action="store_true", help="also serve the CPU tier over HTTPS")
    ap.add_argument("--cpu-reserve", default=None, metavar="SIZE",
                    help="cpu_reserve_bytes of the CPU-tier servers (default: theirs, an eighth of the budget)")
    ap.add_argument("--tmp", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compare-metrics", action="store_true",
                    help="measure metrics on against metrics off (see the module doc) instead")
    add_plot_only(ap)
    args = ap.parse_args()
    if args.compare_metrics:
        compare_metrics(args)
        return
    if plot_only(args, plot):
        return
    clients = [int(c) for c in args.clients.split(",")]
    if not shutil.which("redis-server"):
        sys.exit("redis-server is not on PATH: it is the baseline")
    per = {n: max(2, args.frames if n == 1 else args.frames // 3) for n in clients}
    need = max(n * per[n] for n in clients)
    frame_mb = len(make_frame(0)[1]) / 1e6
    # The server's own default budget (4 GiB, and so its default reserve for frames being
    # received, 512 MiB), or more where the frames need it: room for every frame.
    budget = f"{max(4 << 30, int(need * frame_mb * 1e6 * 1.2) + (256 << 20))}"
    rows: list[dict] = []
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmpdir:
        tmp = Path(tmpdir)
        try:
            rproc, rport = start_redis(tmp)
            procs.append(rproc)
            cpu_args = ("--cpu-bytes", budget, "--disk-bytes", "0")
            if args.cpu_reserve:
                cpu_args += ("--cpu-reserve-bytes", args.cpu_reserve)
            cs_proc, cs_url = start_cacheseek(tmp, "cpu", *cpu_args)
            procs.append(cs_proc)
            urls = {"cacheseek (cpu tier)": cs_url}
            others: dict[str, str] = {}
            if args.baseline:
                tree = export_tree(args.baseline, tmp / "baseline-tree")
                base_proc, base_url = start_cacheseek(tmp, "baseline", *cpu_args, tree=tree)
                procs.append(base_proc)
                urls[f"cacheseek@{args.baseline} (cpu tier)"] = others[f"binary@{args.baseline}"] = base_url
            if args.tls:
                cert_key = self_signed(tmp)
                os.environ["CACHESEEK_BENCH_CA"] = str(cert_key[0])  # the client processes inherit it
                tls_proc, tls_url = start_cacheseek(tmp, "tls", *cpu_args, tls=cert_key)
                procs.append(tls_proc)
                urls["cacheseek (cpu tier, TLS)"] = others["binary_tls"] = tls_url
            for n in clients:
                t0 = time.time()
                _FRAMES = client_chains(n, per[n])  # the client processes fork with these
                print(f"{n} client(s): {len(_FRAMES)} int4 frames of {frame_mb:.2f} MB built in "
                      f"{time.time() - t0:.1f}s", flush=True)
                rows += redis_rows(rport, [n], per[n], args.reps)
                rows += cacheseek_rows(urls, [n], per[n], args.reps)
            lookup = lookup_latency(cs_url, rport, args.lookup_blocks, args.lookups, others=others)
            print(f"  lookup of a {args.lookup_blocks}-block chain: p50 {lookup['p50_ms']:.3f} ms, "
                  f"p99 {lookup['p99_ms']:.3f} ms (JSON body: p50 {lookup['json_p50_ms']:.3f} ms, "
                  f"p99 {lookup['json_p99_ms']:.3f} ms)" + "".join(
                      f"; {label}: p50 {lookup[label]['p50_ms']:.3f} ms, p99 {lookup[label]['p99_ms']:.3f} ms"
                      for label in others), flush=True)
            for proc in procs[1:]:
                proc.stop()
            if not args.no_full:
                full_budget = str(int(FULL_FRAMES * frame_mb * 1e6) + (1 << 20))
                # A small budget, so that it is full from the start, with the reserve for frames in
                # flight that a 2 GiB tier has by default (an eighth of the budget).
                full_proc, full_url = start_cacheseek(tmp, "full", "--cpu-bytes", full_budget, "--disk-bytes", "0",
                                                      "--cpu-reserve-bytes", str(FULL_RESERVE))
                procs.append(full_proc)
                filler = chain_frames(FULL_FRAMES, 999)
                for n in clients:
                    _FRAMES = client_chains(n, per[n])
                    rows += cacheseek_rows({"cacheseek (cpu tier, full)": full_url}, [n], per[n], args.reps,
                                           filler=filler)
                full_proc.stop()
            if not args.no_disk:
                disk_proc, disk_url = start_cacheseek(tmp, "disk", "--cpu-bytes", "0", "--disk-bytes", budget)
                procs.append(disk_proc)
                for n in clients:
                    _FRAMES = client_chains(n, per[n])
                    rows += cacheseek_rows({"cacheseek (disk, fsync)": disk_url}, [n], per[n], max(1, args.reps - 1))
        finally:
            for p in procs:
                p.stop()
    by = {(r["system"], r["clients"]): r for r in rows}
    for r in rows:
        base = by.get(("redis-server (redis-py)", r["clients"]))
        if base and r["system"] != "redis-server (redis-py)":
            for key in ("ingest_put_gbps", "ingest_batch_gbps"):
                r[key.replace("_gbps", "_vs_redis")] = r[key] / base["ingest_put_gbps"]
            for key in ("materialize_get_gbps", "materialize_prefix_gbps"):
                if key in r:
                    r[key.replace("_gbps", "_vs_redis")] = r[key] / base["materialize_get_gbps"]
    path = write_json("server", {"frame_mb": frame_mb, "frames_per_client": per, "codec": CODEC.spec(),
                                 "layout": LAYOUT.to_dict(), "block_tokens": BLOCK, "rows": rows, "lookup": lookup},
                      args.out)
    print(f"wrote {path}")
    redraw(plot, path)
    print(f"lookup, {lookup['blocks']}-block chain, {lookup['lookups']} calls: p50 {lookup['p50_ms']:.3f} ms, "
          f"p99 {lookup['p99_ms']:.3f} ms (JSON body: p50 {lookup['json_p50_ms']:.3f} ms, p99 "
          f"{lookup['json_p99_ms']:.3f} ms; redis EXISTS of the same keys: p50 {lookup['redis_exists_p50_ms']:.3f} ms, "
          f"p99 {lookup['redis_exists_p99_ms']:.3f} ms)")
    cols = ["system", "clients", "ingest_put_gbps", "ingest_put_vs_redis", "ingest_batch_gbps", "ingest_batch_vs_redis",
            "materialize_get_gbps", "materialize_get_vs_redis", "materialize_prefix_gbps", "materialize_prefix_vs_redis"]
    print(table(rows, cols, f"Server vs Redis over loopback: int4 Llama-3-8B frames of {frame_mb:.1f} MB, GB/s of frames "
                            f"(median of {args.reps}); ratios against redis-py SET (ingest) and GET (materialize)"))
    compare = [label for label in (f"cacheseek@{args.baseline} (cpu tier)" if args.baseline else None,
                                   "cacheseek (cpu tier, TLS)" if args.tls else None) if label]
    if compare:
        metrics = ["ingest_put_gbps", "ingest_batch_gbps", "materialize_get_gbps", "materialize_prefix_gbps"]
        ratio_rows = []
        for label in compare:
            for n in clients:
                new, other = by[("cacheseek (cpu tier)", n)], by[(label, n)]
                ratio_rows.append({"this code vs": label, "clients": n,
                                   **{m.removesuffix("_gbps"): new[m] / other[m] for m in metrics}})
            key = f"binary@{args.baseline}" if "@" in label else "binary_tls"
            ratio_rows.append({"this code vs": label, "clients": "-",
                               "lookup_p99": lookup[key]["p99_ms"] / lookup["p99_ms"]})
        write_json("server_compare", {"ratios": ratio_rows, "lookup": lookup}, args.out)
        print(table(ratio_rows, ["this code vs", "clients"] + [m.removesuffix("_gbps") for m in metrics] + ["lookup_p99"],
                    "This code against the other server: throughput ratios, and lookup_p99 = the other's p99 / this "
                    "code's (>1: this code is faster)"))


def compare_metrics(args: argparse.Namespace) -> None:
    """Ingest, materialize and lookup with the server's detailed metrics on and off, in turns."""
    global _FRAMES
    per = max(2, args.frames)
    frame_mb = len(make_frame(0)[1]) / 1e6
    budget = f"{int(per * frame_mb * 1e6 * 1.2) + (256 << 20)}"
    variants = {"on": "--metrics-detail", "off": "--no-metrics-detail"}
    ops = ("ingest_put_gbps", "ingest_batch_gbps", "materialize_get_gbps", "materialize_prefix_gbps")
    got: dict[str, dict[str, list[float]]] = {v: {k: [] for k in (*ops, "lookup_p50_ms", "lookup_p99_ms")}
                                               for v in variants}
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmpdir:
        tmp = Path(tmpdir)
        try:
            urls = {}
            for v, flag in variants.items():
                proc, urls[v] = start_cacheseek(tmp, f"metrics-{v}", "--cpu-bytes", budget, "--disk-bytes", "0", flag)
                procs.append(proc)
            _FRAMES = client_chains(1, per)
            for rep in range(args.reps):
                order = list(variants) if rep % 2 == 0 else list(reversed(variants))  # neither always goes first
                for v in order:
                    row = cacheseek_rows({f"metrics {v}": urls[v]}, [1], per, 1)[0]
                    for k in ops:
                        got[v][k].append(row[k])
                    lookup = lookup_latency(urls[v], None, args.lookup_blocks, max(200, args.lookups // args.reps))
                    got[v]["lookup_p50_ms"].append(lookup["p50_ms"])
                    got[v]["lookup_p99_ms"].append(lookup["p99_ms"])
                    print(f"  rep {rep} metrics {v}: lookup p50 {lookup['p50_ms']:.3f} ms", flush=True)
        finally:
            for p in procs:
                p.stop()
    rows = []
    for k in got["on"]:
        on, off = statistics.median(got["on"][k]), statistics.median(got["off"][k])
        # For throughput, on/off below 1 is a cost; for latency, above 1 is.
        rows.append({"figure": k, "metrics_on": on, "metrics_off": off, "on_over_off": on / off,
                     "runs_on": got["on"][k], "runs_off": got["off"][k]})
    path = write_json("server_metrics", {"frame_mb": frame_mb, "frames": per, "reps": args.reps, "rows": rows},
                      args.out)
    print(f"wrote {path}")
    print(table(rows, ["figure", "metrics_on", "metrics_off", "on_over_off"],
                f"Metrics on against off: int4 Llama-3-8B frames of {frame_mb:.1f} MB, {per} per run, 1 client, "
                f"median of {args.reps} alternating reps (GB/s; lookup of a {args.lookup_blocks}-block chain in ms)"))


if __name__ == "__main__":
    main()
