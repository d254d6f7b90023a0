"""Real servers for tests: ``cacheseek serve`` as a subprocess on a free loopback port, with
real files, always stopped; and valid frames built directly (no torch needed)."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cacheseek.layout import KVLayout
from cacheseek.quant import Raw
from cacheseek.quant.payload import BUFFER_DTYPES
from cacheseek.store.frame import build_frame, plan_frame

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
BLOCK = 32  # a Raw frame of LAYOUT holds 32 KiB of payload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cacheseek_command() -> list[str]:
    script = Path(sys.executable).parent / "cacheseek"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cacheseek.server.cli"]


class Server:
    """One ``cacheseek serve`` process. ``with Server(tmp_path) as srv: srv.url``."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None, disk: bool = True,
                 cpu_bytes: str = "64MiB", verify: ssl.SSLContext | bool = True,
                 max_file_bytes: int | None = None, nofile: tuple[int, int] | None = None) -> None:
        self.root = Path(root)
        # RLIMIT_FSIZE on the server: a file write past it fails (EFBIG), as on a full disk
        self.max_file_bytes = max_file_bytes
        # RLIMIT_NOFILE (soft, hard) the server starts under, as a shell's ulimit -n would leave it
        self.nofile = nofile
        self.disk_path = self.root / "disk"
        self.port = free_port()
        self.verify = verify  # for https: the CA bundle that signed the server's certificate
        self.url = f"{'https' if '--tls-cert' in args else 'http'}://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--cpu-bytes", cpu_bytes, "--log-level", "warning",
                     "--disk-path", str(self.disk_path), "--disk-bytes", "1GiB" if disk else "0", *args]
        # PYTHONFAULTHANDLER: a server that hangs on SIGTERM is sent SIGABRT (stop()), and its
        # log then holds every thread's stack, for the failure's message.
        self.env = {**os.environ, "XDG_CACHE_HOME": str(self.root / "xdg"), "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = self.root / f"server-{self.port}.log"

    def start(self, timeout: float = 30.0) -> Server:
        self.root.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([*cacheseek_command(), "serve", *self.args], stdout=logf, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, preexec_fn=self._limits)
        logf.close()
        deadline = time.monotonic() + timeout
        # One client for every poll: each new one loads the CA bundle (~25 ms of CPU), which
        # a poll every 50 ms paid over and over while the server it waits for wanted the CPU.
        with httpx.Client(timeout=1.0, verify=self.verify) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"cacheseek serve exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.get(self.url + "/readyz").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"cacheseek serve not ready after {timeout}s:\n{self.output()}")

    def _limits(self) -> None:
        if self.nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)
        if self.max_file_bytes is not None:
            import resource
            import signal

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (else the write kills the process)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_file_bytes, self.max_file_bytes))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful), then, if it hangs, SIGABRT (its threads' stacks into the log)
        and SIGKILL. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self.kill()
            raise RuntimeError(f"cacheseek serve ignored SIGTERM for {timeout}s (its stacks at the end):\n"
                               f"{self.output()}") from None

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill() if exc[0] is not None else self.stop()


def bodies(client: httpx.Client | str) -> dict[str, float]:
    """The server's request bodies in flight, from ``/metrics``: ``in_flight_bytes``, ``refused``."""
    text = (client.get("/metrics") if isinstance(client, httpx.Client) else httpx.get(client + "/metrics")).text
    names = {"cacheseek_http_body_bytes_in_flight": "in_flight_bytes", "cacheseek_http_bodies_refused_total": "refused"}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


def raw_frame(seed: int, *, position: int = 0, parent: bytes | None = None, block_hash: bytes | None = None,
              layout: KVLayout = LAYOUT, block: int = BLOCK, hash_size: int = 16, codec=None) -> tuple[bytes, bytes]:
    """A valid frame (Raw by default) with deterministic payload bytes: (block hash, frame bytes)."""
    codec = codec or Raw()
    block_hash = block_hash or secrets.token_bytes(hash_size)
    parent = parent if parent is not None else bytes(hash_size)
    template = codec.template((layout.num_layers, layout.num_kv_heads, block, layout.head_dim), layout.dtype)
    buffers = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    meta = plan_frame(block_hash=block_hash, parent_hash=parent, position=position, layout=layout,
                      block_tokens=block, codec=codec.spec(), buffers=buffers)
    rng = random.Random(seed)
    return block_hash, bytes(build_frame(meta, [_random_buffer(rng, e) for e in meta.tensors]))


def _random_buffer(rng: random.Random, entry) -> bytes:
    """Random bytes; a quantizer's stats (a KIVI scale or min) finite and not negative, as
    the server requires: each element's top byte (little-endian: its last) keeps neither the
    sign nor the top exponent bit."""
    data = bytearray(rng.randbytes(entry.nbytes))
    if entry.name.endswith((".scale", ".min")):
        size = BUFFER_DTYPES[entry.dtype]
        data[size - 1 :: size] = bytes(b & 0x3F for b in data[size - 1 :: size])
    return bytes(data)


def raw_chain(seed: int, blocks: int, **kw) -> list[tuple[bytes, bytes]]:
    """``blocks`` frames linked by parent hashes, positions 0..blocks-1."""
    out: list[tuple[bytes, bytes]] = []
    parent = None
    for i in range(blocks):
        h, frame = raw_frame(seed * 1000 + i, position=i, parent=parent, **kw)
        out.append((h, frame))
        parent = h
    return out


def batch_body(frames: list[bytes]) -> bytes:
    return b"".join(len(f).to_bytes(8, "little") + f for f in frames)


def split_batch(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(body):
        n = int.from_bytes(body[i : i + 8], "little")
        out.append(body[i + 8 : i + 8 + n])
        i += 8 + n
    assert i == len(body)
    return out


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def metrics_after_traffic(root: Path, *args: str) -> str:
    """``/metrics`` of a server over a real Redis tier (``args``: more of its settings) after
    one of each kind of call: a batch ingest, a lookup, a prefix read and a rejected frame,
    so that every series the server can show has been made."""
    return figures_after_traffic(root, *args)[0]


def figures_after_traffic(root: Path, *args: str) -> tuple[str, dict]:
    """``/metrics`` and ``/v1/stats`` of the server of ``metrics_after_traffic``, read one
    after the other after its traffic (a prefetch too)."""
    from redis_servers import RedisServer

    redis = RedisServer(root / "redis").start()
    try:
        with Server(root, "--redis-url", redis.url, "--redis-bytes", "64MiB", *args) as srv, \
                httpx.Client(base_url=srv.url) as c:
            chain = raw_chain(1, 3)
            head = {"X-CacheSeek-Model": "m", "X-CacheSeek-Block-Tokens": "32"}
            c.post("/v1/blocks", content=batch_body([f for _, f in chain]), headers=head)
            c.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain]}, headers=head)
            c.get(f"/v1/prefixes/{chain[-1][0].hex()}", headers=head)
            c.put(f"/v1/blocks/{chain[0][0].hex()}", content=b"not a frame")  # frames_rejected
            c.post("/v1/prefetch", json={"hashes": [h.hex() for h, _ in chain]}, headers=head)
            return c.get("/metrics").text, c.get("/v1/stats").json()
    finally:
        redis.stop()


def write_tls_files(root: Path) -> Path:
    """A test CA and a certificate for 127.0.0.1 and localhost signed by it, as PEM files in
    ``root``: ca.pem, cert.pem (the chain) and key.pem. Skips the test without trustme."""
    import pytest

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    cert.private_key_pem.write_to_path(str(root / "key.pem"))
    (root / "cert.pem").write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    return root
