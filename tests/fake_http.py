"""A raw-socket HTTP/1.1 server on loopback that answers what a test scripts, for clients'
error paths: bad heads, early closes, gateways' answers, odd bodies."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterable

# A reply script: (request number on its connection, request head) -> bytes to send (or
# pieces of them, sent as the iterable yields them: a slow server), and whether to close the
# connection after sending them (None: close without answering).
Script = Callable[[int, bytes], tuple[bytes | Iterable[bytes] | None, bool]]


class FakeServer:
    """A raw socket server on loopback; every connection follows ``script``."""

    def __init__(self, script: Script, *, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> None:
        self.script = script
        self.tls = tls
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{'localhost' if self.tls else '127.0.0.1'}:{self.port}"

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _handle(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            buf = b""
            for n in range(1000):
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                    if name.strip().lower() == b"transfer-encoding":
                        while not buf.endswith(b"0\r\n\r\n"):
                            buf += conn.recv(65536)
                        buf = b""
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                self.requests.append(head)
                reply, close = self.script(n, head)
                if isinstance(reply, bytes):
                    conn.sendall(reply)
                elif reply is not None:
                    for piece in reply:
                        conn.sendall(piece)
                if close or reply is None:
                    return
        except (OSError, ssl.SSLError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        """Stop accepting, and wait for the connections' threads to end (their clients
        closed first): a thread that closed its connection later, in a test after this one,
        freed a descriptor under it (``high_fds``'s test then got one below 1024)."""
        self._stop = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept: close alone leaves it blocked for good)
        except OSError:
            pass
        self._accept.join(5)
        self.listener.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
