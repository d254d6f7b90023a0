"""Real redis-server processes for tests: one standalone server, or a 3-master cluster.

Every server binds 127.0.0.1 on a free port (never 6379), keeps nothing on disk, runs in
a temporary directory, and is stopped (by its own pid) when the test is done.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server/redis-cli not installed (scripts/test.sh installs Debian's redis-server and redis-tools)",
)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000 free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port == 6379 or (cluster_bus and (port + 10000 > 65535 or not _port_free(port + 10000))):
            continue
        return port
    raise RuntimeError("no free port found")


class RedisServer:
    """One redis-server process. ``kill()`` is a SIGKILL; ``start()`` again reuses the port."""

    def __init__(self, workdir: Path, port: int | None = None, *, cluster: bool = False, extra: tuple[str, ...] = ()):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.port = port or free_port(cluster_bus=cluster)
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_seconds: float = 10.0) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.workdir / f"redis-{self.port}.log"), "--io-threads", "1",
                *self.extra]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / f"redis-{self.port}.log")
                raise RuntimeError(f"redis-server exited: {log.read_text() if log.exists() else ''}")
            if self.cli("PING", check=False).strip() == "PONG":
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def cli(self, *args: str, check: bool = True) -> str:
        out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=10)
        if check and out.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {out.stderr}")
        return out.stdout

    def kill(self) -> None:
        """SIGKILL, as a crash would; everything in memory is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, then nothing answers (a hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


class RedisCluster3:
    """Three masters, no replicas, every slot covered."""

    def __init__(self, workdir: Path):
        self.nodes = [RedisServer(Path(workdir) / f"n{i}", cluster=True) for i in range(3)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_seconds: float = 30.0) -> RedisCluster3:
        try:
            for node in self.nodes:
                node.start()
            out = subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}\n{out.stderr}")
            deadline = time.monotonic() + timeout_seconds
            while time.monotonic() < deadline:
                if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in self.nodes):
                    return self
                time.sleep(0.1)
            raise RuntimeError("cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def flush(self) -> None:
        for node in self.nodes:
            node.cli("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
