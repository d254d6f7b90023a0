"""A loopback TCP proxy in front of a real server that can turn slow: the faults a client's
timeouts are for, made with real sockets.

Modes (``proxy.mode``, switchable while it runs):

- ``"pass"``: bytes go through as they come.
- ``"blackhole"``: a connection opened in this mode is accepted and never answered, and an
  open one's requests from then on are swallowed (the server never sees them).
- ``"trickle"``: the server's answers go on one byte every ``trickle_seconds``, each byte
  well within any read timeout, so only a bound on the whole exchange ends it.
- ``"delay"``: each piece of an answer goes on ``delay_seconds`` late: a server that is
  slow but answers (a lookup's small answer is one piece).

A connection takes the mode as each chunk moves, so a client's pooled connections turn
slow too.
"""

from __future__ import annotations

import socket
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port: int, mode: str = "pass", trickle_seconds: float = 0.1,
                 delay_seconds: float = 0.2) -> None:
        self.upstream_port = upstream_port
        self.mode = mode
        self.trickle_seconds = trickle_seconds
        self.delay_seconds = delay_seconds
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._keep(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.mode == "blackhole":
            _drain(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        self._keep(upstream)
        threading.Thread(target=self._pipe_up, args=(client, upstream), daemon=True).start()
        try:
            while data := upstream.recv(65536):
                if self.mode == "trickle":
                    for i in range(len(data)):
                        client.sendall(data[i:i + 1])
                        time.sleep(self.trickle_seconds)
                else:
                    if self.mode == "delay":
                        time.sleep(self.delay_seconds)
                    client.sendall(data)
        except OSError:
            pass
        _close(client)

    def _pipe_up(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                if self.mode != "blackhole":
                    upstream.sendall(data)
        except OSError:
            pass
        try:
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _close(sock)


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread blocked on it; close alone does not)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
