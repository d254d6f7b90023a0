"""``BulkTransport``: an httpx transport for plain-HTTP/1.1 bulk transfers with few copies.

httpx's default stack (httpcore + h11) reads a response in 64 KiB pieces, copies each
into h11's buffer, out of it, and joins them at the end: four passes over every byte, and
Python work per 64 KiB. For 10 MB frames that costs more than the network. This transport
keeps httpx's API (``httpx.Client(transport=BulkTransport())``: the same requests,
responses, timeouts and errors) and moves bodies with plain sockets instead:

- request bodies are sent chunk by chunk with scatter-gather ``sendmsg`` (no joins);
- response bodies are read with ``recv_into`` straight into fresh buffers of up to
  ``chunk_bytes`` that are handed out as they fill (one copy, from the kernel), so a
  consumer may keep views of them.

Connections are kept alive and pooled per host (at most ``max_connections`` at once); a
pooled connection the server has closed is noticed before it is reused. Only ``http://``
is handled here; anything else goes to httpx's own transport.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

BODY_EXTENSION = "cacheseek_body"
_HEAD_LIMIT = 64 * 1024
_SMALL = 64 * 1024  # request chunks below this are gathered into one send


class BulkTransport(httpx.BaseTransport):
    def __init__(self, *, max_connections: int = 16, chunk_bytes: int = 16 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._fallback: httpx.HTTPTransport | None = None
        self._closed = False

    # -- httpx.BaseTransport ---------------------------------------------------------------

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.HTTPTransport()
            return self._fallback.handle_request(request)
        timeouts = request.extensions.get("timeout", {})
        host, port = request.url.host, request.url.port or 80
        if not self._slots.acquire(timeout=timeouts.get("pool")):
            raise httpx.PoolTimeout("no free connection in the pool", request=request)
        try:
            sock = self._connect(host, port, timeouts, request)
        except BaseException:
            self._slots.release()
            raise
        send_error: BaseException | None = None
        try:
            sock.settimeout(timeouts.get("write"))
            try:
                self._send(sock, request)
            except (BrokenPipeError, ConnectionResetError) as exc:
                send_error = exc  # the server may have answered early (413, 401): read that answer
            sock.settimeout(timeouts.get("read"))
            status, headers, rest = _read_head(sock)
        except BaseException as exc:
            _close(sock)
            self._slots.release()
            if send_error is not None:
                raise _as_httpx(send_error, request, reading=False) from None
            raise _as_httpx(exc, request, reading=True) from None
        body = _Body(self, sock, (host, port), request, status, headers, rest)
        if send_error is not None:
            body._reusable = False
        # httpx wraps the stream; the extension gives readers that know their record sizes
        # (``cacheseek.batch_body.iter_frames``) the body's ``read_exactly``.
        return httpx.Response(status, headers=headers, stream=body,
                              extensions={"http_version": b"HTTP/1.1", BODY_EXTENSION: body})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for socks in self._idle.values():
                for s in socks:
                    _close(s)
            self._idle.clear()
        if self._fallback is not None:
            self._fallback.close()

    # -- connections -----------------------------------------------------------------------

    def _connect(self, host: str, port: int, timeouts: dict, request: httpx.Request) -> socket.socket:
        with self._lock:
            idle = self._idle.get((host, port), [])
            while idle:
                sock = idle.pop()
                if _alive(sock):
                    return sock
                _close(sock)
        try:
            sock = socket.create_connection((host, port), timeout=timeouts.get("connect"))
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc), request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _release(self, key: tuple[str, int], sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                if self._closed:
                    _close(sock)
                else:
                    self._idle.setdefault(key, []).append(sock)
        self._slots.release()

    # -- the request -----------------------------------------------------------------------

    def _send(self, sock: socket.socket, request: httpx.Request) -> None:
        target = request.url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1".encode()]
        chunked = False
        for name, value in request.headers.raw:
            if name.lower() == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
            lines.append(name + b": " + value)
        pending: list[Any] = [b"\r\n".join(lines) + b"\r\n\r\n"]
        pending_bytes = len(pending[0])
        for chunk in request.stream:
            view = memoryview(chunk).cast("B")
            if not view.nbytes:
                continue
            if chunked:
                pending.append(b"%x\r\n" % view.nbytes)
            pending.append(view)
            if chunked:
                pending.append(b"\r\n")
            pending_bytes += view.nbytes
            if pending_bytes >= _SMALL:
                _sendmsg_all(sock, pending)
                pending, pending_bytes = [], 0
        if chunked:
            pending.append(b"0\r\n\r\n")
        if pending:
            _sendmsg_all(sock, pending)


class _Body(httpx.SyncByteStream):
    """The response body, read as it is iterated; the connection goes back to the pool when
    the body has been read whole (else it is closed)."""

    def __init__(self, transport: BulkTransport, sock: socket.socket, key: tuple[str, int], request: httpx.Request,
                 status: int, headers: list[tuple[bytes, bytes]], rest: bytes) -> None:
        self._transport = transport
        self._sock: socket.socket | None = sock
        self._key = key
        self._request = request
        self._rest = rest
        self._reusable = True
        self._done = False
        self._length: int | None = None
        self._chunked = False
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                self._length = int(value)
            elif lname == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif lname == b"connection" and value.lower() == b"close":
                self._reusable = False
        if status in (204, 304) or 100 <= status < 200 or request.method == "HEAD":
            self._length = 0
        if self._length is None and not self._chunked:
            self._reusable = False  # read to the end of the connection

    def __iter__(self) -> Iterator[bytes]:
        try:
            if self._chunked:
                yield from self._iter_chunked()
            else:
                yield from self._iter_length()
            self._done = True
        except (OSError, ValueError) as exc:
            self._reusable = False
            raise _as_httpx(exc, self._request, reading=True) from None
        finally:
            self.close()

    def read_exactly(self, n: int) -> bytearray | None:
        """The next ``n`` bytes of a body of known length, read straight into one new buffer;
        None at the end of the body. For readers that know their record sizes (frames)."""
        if self._chunked or self._length is None:
            raise RuntimeError("read_exactly needs a body of known length")
        if self._length == 0:
            self._done = True
            self.close()
            return None
        if self._sock is None:
            raise httpx.StreamClosed()
        if n > self._length:
            raise httpx.RemoteProtocolError(f"{n} bytes wanted, {self._length} left in the body",
                                            request=self._request)
        buf = bytearray(n)
        view = memoryview(buf)
        got = min(len(self._rest), n)
        view[:got] = self._rest[:got]
        self._rest = self._rest[got:]
        try:
            while got < n:
                k = self._sock.recv_into(view[got:])
                if not k:
                    raise httpx.RemoteProtocolError("connection closed inside the body", request=self._request)
                got += k
        except OSError as exc:
            self._reusable = False
            self.close()
            raise _as_httpx(exc, self._request, reading=True) from None
        self._length -= n
        if self._length == 0:
            self._done = True
            self.close()
        return buf

    def _iter_length(self) -> Iterator[Any]:
        remaining = self._length
        if self._rest:
            head = self._rest[:remaining] if remaining is not None else self._rest
            self._rest = b""
            if remaining is not None:
                remaining -= len(head)
            yield head
        sock = self._sock
        while remaining is None or remaining > 0:
            size = self._transport.chunk_bytes if remaining is None else min(remaining, self._transport.chunk_bytes)
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                n = sock.recv_into(view[got:])
                if not n:
                    if remaining is None:
                        break
                    raise httpx.RemoteProtocolError(
                        f"connection closed with {remaining - got} bytes of the body missing", request=self._request)
                got += n
            if remaining is None:
                if got:
                    yield view[:got]
                if got < size:
                    return
                continue
            remaining -= got
            yield view

    def _iter_chunked(self) -> Iterator[bytes]:
        reader = _LineReader(self._sock, self._rest)
        while True:
            size = int(reader.line().split(b";")[0].strip(), 16)
            if size == 0:
                while reader.line():  # trailers, then the empty line
                    pass
                return
            yield reader.exactly(size)
            reader.line()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._done and self._reusable:
            self._transport._release(self._key, sock)
        else:
            _close(sock)
            self._transport._release(self._key, None)


class _LineReader:
    def __init__(self, sock: socket.socket, rest: bytes) -> None:
        self.sock = sock
        self.buf = bytearray(rest)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ValueError("connection closed inside a chunked body")
        self.buf += data

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > _HEAD_LIMIT:
                raise ValueError("chunk header too long")
            self._fill()
        out = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _read_head(sock: socket.socket) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > _HEAD_LIMIT:
            raise ValueError("response head too long")
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("connection closed before a response")
        buf += data
    head, rest = buf[:end], buf[end + 4 :]
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError(f"bad header line {line[:80]!r}")
        headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers, rest


def _sendmsg_all(sock: socket.socket, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _alive(sock: socket.socket) -> bool:
    """A pooled connection is usable if the server has not closed it (nothing is readable)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _as_httpx(exc: BaseException, request: httpx.Request, reading: bool) -> BaseException:
    if isinstance(exc, httpx.HTTPError):
        return exc
    if isinstance(exc, TimeoutError):
        return (httpx.ReadTimeout if reading else httpx.WriteTimeout)(str(exc) or "timed out", request=request)
    if isinstance(exc, (ConnectionError, ValueError)):
        return httpx.RemoteProtocolError(str(exc), request=request)
    if isinstance(exc, OSError):
        return (httpx.ReadError if reading else httpx.WriteError)(str(exc), request=request)
    return exc


__all__ = ["BulkTransport"]
