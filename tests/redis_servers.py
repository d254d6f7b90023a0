"""Real redis-server processes for tests: one standalone server, or a 3-master cluster.

Every server binds 127.0.0.1 on a free port (never 6379), keeps nothing on disk, runs in
a temporary directory, and is stopped (by its own pid) when the test is done.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
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


def _end_stream(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class ReplyLosingProxy:
    """A loopback TCP proxy in front of a Redis. Once ``arm(marker)`` is called, the first
    request that carries ``marker`` is passed on, and its reply is lost: the client reads an
    end of stream once Redis has had time to run it, as after a connection lost once the
    server acted (``deliver=False``: the request never reaches Redis, as after a connection
    lost before it did). Every other byte is passed on as it comes."""

    def __init__(self, target_port: int, *, settle_seconds: float = 0.2):
        self.target_port = target_port
        self.settle_seconds = settle_seconds
        self.marker: bytes | None = None
        self.deliver = True
        self.lost = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def arm(self, marker: bytes, *, deliver: bool = True) -> None:
        with self._lock:
            self.marker, self.deliver = marker, deliver

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            state = {"deaf": False}  # set once this connection's reply is to be lost
            for args in ((client, upstream, True, state), (upstream, client, False, state)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool, state: dict) -> None:
        seen = b""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if not requests:
                    if not state["deaf"]:
                        dst.sendall(data)
                    continue
                seen = (seen + data)[-(1 << 16):]
                with self._lock:
                    if self.marker is not None and self.marker in seen:
                        self.marker = None
                        self.lost += 1
                        # No byte of the answer reaches the client. The rest of its request
                        # still reaches Redis, which runs it; then the client reads an end
                        # of stream (a connection error).
                        state["deaf"] = True
                        if not self.deliver:
                            break  # (the connection closes: Redis never sees the request)
                        threading.Timer(self.settle_seconds, _end_stream, args=(src,)).start()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
