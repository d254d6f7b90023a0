"""``BulkTransport``: an httpx transport for HTTP/1.1 bulk transfers with few copies.

httpx's default stack (httpcore + h11) reads a response in 64 KiB pieces, copies each
into h11's buffer, out of it, and joins them at the end: four passes over every byte, and
Python work per 64 KiB. For 10 MB frames that costs more than the network, and h11 costs
~0.1 ms per exchange (a tenth of a lookup). This transport keeps httpx's API
(``httpx.Client(transport=BulkTransport())``: the same requests, responses, timeouts and
errors) and moves bodies with plain sockets instead:

- request bodies are sent chunk by chunk with scatter-gather ``sendmsg`` (no joins of large
  chunks). Each chunk is sent, or copied, before the body's stream is asked for the next:
  a stream may reuse a chunk's memory as soon as it is resumed (``RemoteCache`` sends each
  frame from a reused buffer). httpx's own transport, which takes proxied requests, also
  writes each chunk before it asks for the next;
- response bodies are read with ``recv_into`` straight into fresh buffers of up to
  ``chunk_bytes`` that are handed out as they fill (one copy, from the kernel), so a
  consumer may keep views of them.

What it holds to, since it is hand-written (each case is tested against a fake server in
``tests/test_transport.py``):

- Response heads are parsed strictly (``_parse_head``): a status line that is not
  ``HTTP/1.x NNN`` (NNN from 100), a header line without a name, a ``Content-Length`` that is not digits
  (or two that differ), ``Transfer-Encoding`` other than ``chunked``, or both framings at
  once, is an ``httpx.RemoteProtocolError``. Interim answers (100, 102, 103) are skipped;
  101 is an error (no upgrade is ever asked for).
- Each request holds one ``_Lease`` (a pool slot and a socket), given back exactly once:
  to the pool after a whole body on a connection that stays open, else closed. No error
  path leaks a slot.
- A request that fails on a reused keep-alive connection before any byte of an answer
  came (the server closed it while idle: the stale-connection race) is sent again once, on
  a new connection, if it is idempotent (GET, HEAD, PUT, DELETE, OPTIONS, or marked with
  the ``cacheseek_idempotent`` extension) and its body can be sent again (bytes, or a
  stream with ``replayable = True``).
- A new connection is made within the connect timeout in all, its name's lookup included,
  its addresses tried staggered, the one that connected last first (``cacheseek.connect``).
- ``https`` is carried here too, with the client's ``ssl.SSLContext`` (``verify``: a bool,
  a CA bundle path, or a context). A proxy (``proxy=``, or ``HTTP(S)_PROXY``/``ALL_PROXY``
  from the environment unless ``NO_PROXY`` covers the host, with ``trust_env``) sends the
  request through httpx's own transport with the same TLS settings: honoured, at httpx's
  speed, its exchange deadline and cutoff applied at its start, to each read and write and
  between its answer's pieces, but not to a head the proxy trickles (``_through_proxy``). Any other scheme is refused (``httpx.UnsupportedProtocol``).
- A URL of the wrong scheme is said so, in the error's message (its type unchanged): an
  ``http`` answer that is a TLS record, or a fresh ``http`` connection closed before any
  answer by a server that a TLS handshake then reaches (asked on that error path only),
  says to use ``https://``; a handshake answered by no TLS record, to use ``http://``.
"""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from .connect import open_socket

BODY_EXTENSION = "cacheseek_body"
IDEMPOTENT_EXTENSION = "cacheseek_idempotent"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
_HEAD_LIMIT = 64 * 1024
_SMALL = 64 * 1024  # request chunks below this are gathered into one send
_TOKEN = re.compile(rb"\A[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_DIGITS = re.compile(rb"\A[0-9]+\Z")
_STATUS = re.compile(rb"\AHTTP/1\.([01]) ([0-9]{3})(?: .*)?\Z")
_TLS_RECORD_TYPES = (0x15, 0x16)  # alert, handshake: what a TLS server may answer a plain request with
def _redacted_proxy(proxy: str) -> str:
    """A proxy URL with its password hidden (``http://user:***@host:port``)."""
    scheme, sep, rest = proxy.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}{userinfo.partition(':')[0] + ':***@' if at else ''}{hosts}"


_PROBE_SECONDS = 1.0  # the most a handshake asking whether a server speaks TLS may take (error path only)
_SPEAKS_HTTPS = "speaks https, not http: use an https:// URL"
_SPEAKS_HTTP = "does not speak TLS (plain http, most likely): use an http:// URL"


class BulkTransport(httpx.BaseTransport):
    def __init__(self, *, max_connections: int = 16, chunk_bytes: int = 16 << 20,
                 verify: bool | str | os.PathLike | ssl.SSLContext = True, proxy: str | None = None,
                 trust_env: bool = True, exchange_timeout: float | None = None) -> None:
        """``exchange_timeout``: the longest one exchange may take, from its request's first
        byte to its answer's last (None: no bound); a new connection's connect and TLS
        handshake are held to what is left of it too. httpx's timeouts bound each read and
        write alone, so a peer that sends a byte now and then within them would otherwise
        hold the caller for good. Through a proxy (httpx's transport) it is applied less
        tightly: at the exchange's start, to each read and write (held to what was left of it
        then) and between the pieces of its answer, so a proxy that trickles an answer's head
        is held to the read timeout per byte only (``_through_proxy``)."""
        self.chunk_bytes = chunk_bytes
        self.exchange_timeout = exchange_timeout
        self.ssl_context = ssl_context(verify)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: dict[tuple[str, str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._proxy = proxy
        self._trust_env = trust_env
        self._max_connections = max_connections
        self._proxied: dict[str, httpx.HTTPTransport] = {}
        self._env_proxies: dict[tuple[str, str], str | None] = {}
        self._closed = False
        self._cutoff: float | None = None  # (time.monotonic()) no exchange runs past it: ``cut_off_at``
        self._thread_cutoffs: dict[int, float] = {}  # (thread ident) as ``_cutoff``, for that thread's exchanges
        self._leases: set[_Lease] = set()  # the exchanges under way, for a cutoff that is due now
        self._proxied_threads: list[int] = []  # (thread idents) proxied exchanges under way, one entry each

    # -- httpx.BaseTransport ---------------------------------------------------------------

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:  # (else a new connection would be made, used once and closed)
            raise RuntimeError("this BulkTransport is closed")
        scheme = request.url.scheme
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"BulkTransport carries http and https, not {scheme!r}", request=request)
        if "host" not in request.headers:
            # httpx.Request(stream=...) adds no default headers: HTTP/1.1 requires Host, and
            # strict parsers (h11, proxies) refuse a request without it.
            request.headers["Host"] = request.url.netloc.decode("ascii")
        proxy = self._proxy_for(request.url)
        if proxy is not None:
            return self._through_proxy(proxy, request)
        retry = _may_resend(request)
        try:
            return self._exchange(request, fresh=False)
        except _Stale as stale:
            if not retry:
                raise stale.error from None
        return self._exchange(request, fresh=True)

    def cut_off_at(self, when: float, *, thread: int | None = None) -> int:
        """No exchange runs past ``when`` (``time.monotonic()``): one under way is held to
        it at its next read or write, and one begun after it fails at once
        (``httpx.ReadTimeout``), unsent. ``RemoteCache.close()`` bounds the sending of its
        queued writes so. A ``when`` already past also cuts the exchanges under way now: their
        sockets are shut down, so a read blocked for up to its ``timeout`` returns at once.
        ``thread`` (an ident): only that thread's exchanges (interpreter exit cuts a cache's
        sender so, while threads the program left running go on calling it). Through a
        proxy, an exchange begun after ``when`` fails at once too, and one under way ends at
        the next piece of its answer, but one still waiting for its answer's head cannot be
        cut: the number of those (of the threads concerned) is returned, for a caller that
        says what it cut."""
        with self._lock:
            if thread is None:
                self._cutoff = when if self._cutoff is None else min(self._cutoff, when)
            else:
                self._thread_cutoffs[thread] = min(self._thread_cutoffs.get(thread, when), when)
            now = time.monotonic()
            leases = [lease for lease in self._leases
                      if (cutoff := self._cutoff_for(lease.thread)) is not None and cutoff <= now]
            uncut = sum(1 for t in self._proxied_threads if thread is None or t == thread)
        for lease in leases:
            lease.abort()
        return uncut

    def _cutoff_for(self, thread: int) -> float | None:
        """The cutoff over an exchange of ``thread``'s (None: none)."""
        mine = self._thread_cutoffs.get(thread) if self._thread_cutoffs else None
        if mine is None or (self._cutoff is not None and self._cutoff <= mine):
            return self._cutoff
        return mine

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for socks in self._idle.values():
                for s in socks:
                    _close(s)
            self._idle.clear()
            proxied, self._proxied = list(self._proxied.values()), {}
        for transport in proxied:
            transport.close()

    # -- one exchange on one connection ----------------------------------------------------

    def _exchange(self, request: httpx.Request, *, fresh: bool) -> httpx.Response:
        """Send ``request`` and read the head of its answer. Raises ``_Stale`` when a reused
        connection turned out closed before any byte of an answer (the caller may resend)."""
        timeouts = request.extensions.get("timeout", {})
        pool = timeouts.get("pool")
        cutoff = self._cutoff_for(threading.get_ident())
        if cutoff is not None:
            left = max(cutoff - time.monotonic(), 0.0)
            pool = left if pool is None else min(pool, left)
        if not self._slots.acquire(timeout=pool):
            if cutoff is not None and time.monotonic() >= cutoff:
                raise httpx.ReadTimeout(_Lease.cut_off_error(), request=request)
            raise httpx.PoolTimeout("no free connection in the pool", request=request)
        # (the slot given back by one ``try`` from here: an interrupt as the lease was made,
        # or as the lock was let go, kept the slot for good, and after max_connections of
        # them every call waited out the pool timeout)
        lease: _Lease | None = None
        try:
            lease = _Lease(self, _pool_key(request.url), timeouts)
            with self._lock:
                self._leases.add(lease)
        except BaseException:
            if lease is None:
                self._slots.release()
            else:
                lease.release(reusable=False)
            raise
        try:
            lease.pace()  # (past the cutoff: nothing is sent, and no connection made for it)
            lease.sock, reused = self._connect(lease.key, lease.connect_timeouts(timeouts), request, fresh=fresh)
            send_error: BaseException | None = None
            lease.sock.settimeout(timeouts.get("write"))
            try:
                self._send(lease, request)
            except (BrokenPipeError, ConnectionResetError) as exc:
                send_error = exc  # the server may have answered early (413, 401): read that answer
            except TimeoutError as exc:  # (a body the server stopped reading: not a read that timed out)
                raise _as_httpx(lease.explain(exc), request, reading=False) from None
            lease.sock.settimeout(timeouts.get("read"))
            try:
                status, headers, rest, keep_alive = _read_head(lease, request)
            except _NoAnswer as exc:
                cause = send_error or exc.cause
                if not reused and not lease.aborted and lease.key[0] == "http":
                    cause = _if_tls(cause, lease, timeouts)
                error = _as_httpx(lease.explain(cause), request, reading=send_error is None)
                if reused and not lease.aborted:
                    raise _Stale(error) from None
                raise error from None
            if send_error is not None:
                keep_alive = False
        except BaseException as exc:
            lease.release(reusable=False)
            if isinstance(exc, _Stale):
                raise
            raise _as_httpx(lease.explain(exc), request, reading=True) from None
        try:
            body = _Body(lease, request, status, headers, rest, keep_alive)
        except BaseException as exc:
            lease.release(reusable=False)
            raise _as_httpx(exc, request, reading=True) from None
        # httpx wraps the stream; the extension gives readers that know their record sizes
        # (``cacheseek.batch_body.iter_frames``) the body's ``read_exactly``.
        return httpx.Response(status, headers=headers, stream=body,
                              extensions={"http_version": b"HTTP/1.1", BODY_EXTENSION: body})

    # -- connections -----------------------------------------------------------------------

    def _connect(self, key: tuple[str, str, int], timeouts: dict, request: httpx.Request, *,
                 fresh: bool) -> tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(key, [])
                while idle:
                    sock = idle.pop()
                    if _alive(sock):
                        return sock, True
                    _close(sock)
        scheme, host, port = key
        thread = threading.get_ident()

        def cut_off() -> bool:  # (a close() from another thread while this one connects)
            cutoff = self._cutoff_for(thread)
            return cutoff is not None and cutoff <= time.monotonic()

        try:
            sock = open_socket(host, port, timeouts.get("connect"), cut_off=cut_off)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc), request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            try:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                _close(sock)
                # (OpenSSL's reason where the answer to its hello was no TLS record, the server's
                # plain HTTP "400 Bad Request" most likely: "wrong version number", from 3.2
                # "record layer failure", as urllib3 reads them)
                plain = any(r in str(exc) for r in ("WRONG_VERSION_NUMBER", "record layer failure"))
                hint = f": {_authority(host, port)} {_SPEAKS_HTTP}" if plain else ""
                raise httpx.ConnectError(f"TLS handshake with {_authority(host, port)} failed: {exc}{hint}",
                                         request=request) from None
            except TimeoutError as exc:
                _close(sock)
                raise httpx.ConnectTimeout(str(exc), request=request) from None
            except OSError as exc:
                _close(sock)
                raise httpx.ConnectError(str(exc), request=request) from None
        return sock, False

    def _give_back(self, key: tuple[str, str, int], sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                if self._closed:
                    _close(sock)
                else:
                    self._idle.setdefault(key, []).append(sock)
        self._slots.release()

    # -- proxies ---------------------------------------------------------------------------

    def _proxy_for(self, url: httpx.URL) -> str | None:
        """The proxy for ``url``'s scheme and host, read from the environment once for each
        (as httpx reads it once per client), or None."""
        if self._proxy is not None:
            return self._proxy
        if not self._trust_env:
            return None
        key = (url.scheme, url.host)
        try:
            return self._env_proxies[key]
        except KeyError:
            pass
        proxy = None
        host = url.host
        # NO_PROXY (and the platform's own list); an entry with a port matches that port only
        bypass = urllib.request.proxy_bypass(host) or (
            url.port is not None and ":" not in host and urllib.request.proxy_bypass(f"{host}:{url.port}"))
        if not bypass:
            proxies = urllib.request.getproxies()
            proxy = proxies.get(url.scheme) or proxies.get("all")
            if proxy and "://" not in proxy:
                proxy = f"http://{proxy}"  # (HTTP_PROXY=host:port, as httpx and curl read it)
        self._env_proxies[key] = proxy
        return proxy

    def check_proxy(self, url: str) -> None:
        """Make now the proxy transport a request to ``url`` would go through, if any: a
        proxy URL httpx cannot use (an unknown scheme; socks5 without httpx's socks extra)
        is a ``ValueError`` naming it and where it came from, not an error of every call."""
        target = httpx.URL(url)
        proxy = self._proxy_for(target)
        if proxy is None:
            return
        source = "proxy" if self._proxy is not None else f"the environment's {target.scheme.upper()}_PROXY or ALL_PROXY"
        try:
            self._proxy_transport(proxy)
        except (ValueError, ImportError, httpx.InvalidURL) as exc:
            raise ValueError(f"{source}: {_redacted_proxy(proxy)!r} cannot carry a request ({exc})") from None

    def _proxy_transport(self, proxy: str) -> httpx.HTTPTransport:
        with self._lock:
            if self._closed:
                raise RuntimeError("this BulkTransport is closed")
            transport = self._proxied.get(proxy)
            if transport is None:
                transport = self._proxied[proxy] = httpx.HTTPTransport(
                    verify=self.ssl_context, proxy=proxy, limits=httpx.Limits(max_connections=self._max_connections))
        return transport

    def _through_proxy(self, proxy: str, request: httpx.Request) -> httpx.Response:
        """``request`` through httpx's transport, which knows neither ``exchange_timeout`` nor
        ``cut_off_at``: both are checked as the exchange starts (past them, nothing is sent),
        each read and write is held to what is left then, and the answer's body is checked
        between its pieces. What cannot be bounded so: an answer's head that the proxy
        trickles, each byte within the read timeout."""
        thread = threading.get_ident()
        started = time.monotonic()
        deadline = None if self.exchange_timeout is None else started + self.exchange_timeout
        cutoff = self._cutoff_for(thread)
        due = deadline if cutoff is None or (deadline is not None and deadline <= cutoff) else cutoff
        if due is not None:
            left = due - started
            if left <= 0:
                raise httpx.ReadTimeout(_Lease.cut_off_error(), request=request)
            held = {name: left if value is None else min(value, left)
                    for name, value in request.extensions.get("timeout", {}).items()}
            request.extensions = {**request.extensions, "timeout": {"connect": left, "read": left, "write": left,
                                                                    "pool": left, **held}}
        with self._lock:
            self._proxied_threads.append(thread)
        try:
            response = self._proxy_transport(proxy).handle_request(request)
        except BaseException:
            self._proxy_done(thread)
            raise
        response.stream = _ProxiedBody(self, response.stream, request, thread, deadline)
        return response

    def _proxy_done(self, thread: int) -> None:
        with self._lock:
            self._proxied_threads.remove(thread)

    def _proxy_due(self, thread: int, deadline: float | None) -> str | None:
        """Why a proxied exchange of ``thread``'s is over (None: it is not)."""
        now = time.monotonic()
        cutoff = self._cutoff_for(thread)
        if cutoff is not None and cutoff <= now:
            return _Lease.cut_off_error()
        if deadline is not None and deadline <= now:
            return f"the exchange took longer than its limit of {self.exchange_timeout} s (exchange_timeout)"
        return None

    # -- the request -----------------------------------------------------------------------

    def _send(self, lease: _Lease, request: httpx.Request) -> None:
        sock = lease.sock
        assert sock is not None
        target = request.url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1".encode()]
        chunked = False
        for name, value in request.headers.raw:
            if name.lower() == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
            lines.append(name + b": " + value)
        pending: list[Any] = [b"\r\n".join(lines) + b"\r\n\r\n"]
        pending_bytes = len(pending[0])
        send = _sendall_each if isinstance(sock, ssl.SSLSocket) else _sendmsg_all  # no sendmsg over TLS
        assert isinstance(request.stream, httpx.SyncByteStream)  # (a sync request: as httpx's transport asserts)
        for chunk in request.stream:
            view = memoryview(chunk).cast("B")
            if not view.nbytes:
                continue
            if chunked:
                pending.append(b"%x\r\n" % view.nbytes)
            # A small chunk waits for more before the send: held as a copy, since the stream
            # may reuse its memory once asked for the next. A large one goes out below, now.
            pending.append(view if view.nbytes >= _SMALL else bytes(view))
            if chunked:
                pending.append(b"\r\n")
            pending_bytes += view.nbytes
            if pending_bytes >= _SMALL:
                send(sock, pending, lease.pace_write)
                pending, pending_bytes = [], 0
        if chunked:
            pending.append(b"0\r\n\r\n")
        if pending:
            send(sock, pending, lease.pace_write)


class _Lease:
    """One request's pool slot and socket, given back exactly once (``release``)."""

    __slots__ = ("transport", "key", "sock", "released", "aborted", "thread", "deadline", "read_timeout",
                 "write_timeout")

    def __init__(self, transport: BulkTransport, key: tuple[str, str, int], timeouts: dict) -> None:
        self.transport = transport
        self.key = key
        self.sock: socket.socket | None = None
        self.released = False
        self.aborted = False  # a cutoff that came due shut its socket down: what failed then, failed for it
        self.thread = threading.get_ident()  # (whose exchange: a cutoff may be one thread's)
        limit = transport.exchange_timeout
        self.deadline = None if limit is None else time.monotonic() + limit
        self.read_timeout = timeouts.get("read")
        self.write_timeout = timeouts.get("write")

    def _due(self) -> float | None:
        """When this exchange must be over: its own deadline, or the transport's cutoff
        (``cut_off_at``, which may come while it runs) where that is sooner."""
        cutoff = self.transport._cutoff_for(self.thread)
        if cutoff is None or (self.deadline is not None and self.deadline <= cutoff):
            return self.deadline
        return cutoff

    def pace(self, write: bool = False) -> None:
        """Before each blocking call on the socket: its timeout becomes the operation's own,
        cut to what is left of the exchange's deadline (``TimeoutError`` once that passed)."""
        due = self._due()
        if due is None:
            return
        left = due - time.monotonic()
        if left <= 0:
            raise self._past()
        if self.sock is None:  # (before the connection is made)
            return
        op = self.write_timeout if write else self.read_timeout
        self.sock.settimeout(left if op is None else min(op, left))

    def connect_timeouts(self, timeouts: dict) -> dict:
        """``timeouts`` with the connect's (and a TLS handshake's) cut to the exchange's
        deadline: a command with one deadline for its answer (``cacheseek admin``) keeps it."""
        due = self._due()
        if due is None:
            return timeouts
        left = max(due - time.monotonic(), 1e-3)
        connect = timeouts.get("connect")
        return {**timeouts, "connect": left if connect is None else min(connect, left)}

    def pace_write(self) -> None:
        self.pace(write=True)

    def explain(self, exc: BaseException) -> BaseException:
        """``exc``, or for a socket timeout that the deadline cut short (or any error of a
        socket that a cutoff shut down), an error that says so."""
        if self.aborted:
            return TimeoutError(self.cut_off_error())
        due = self._due()
        if isinstance(exc, TimeoutError) and due is not None and time.monotonic() >= due - 1e-3:
            return self._past()
        return exc

    def abort(self) -> None:
        """End the exchange now, from another thread: the thread blocked on its socket wakes
        (end of stream, or an error), and sees the cutoff's error (``explain``)."""
        self.aborted = True
        sock = self.sock
        if sock is not None:
            try:
                # (socket.socket's own: SSLSocket.shutdown would drop the TLS object under
                # the thread still reading through it)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _past(self) -> TimeoutError:
        if self._due() != self.deadline:
            return TimeoutError(self.cut_off_error())
        return TimeoutError(f"the exchange took longer than its limit of {self.transport.exchange_timeout} s "
                            "(exchange_timeout)")

    @staticmethod
    def cut_off_error() -> str:
        return ("cut off: the transport's time for exchanges is over (cut_off_at: a close(), or the "
                "interpreter's exit, that waited its limit)")

    def release(self, *, reusable: bool) -> None:
        if self.released:
            return
        self.released = True
        with self.transport._lock:
            self.transport._leases.discard(self)
        sock, self.sock = self.sock, None
        if sock is not None and (not reusable or self.aborted):
            _close(sock)
            sock = None
        self.transport._give_back(self.key, sock)


class _Body(httpx.SyncByteStream):
    """The response body, read as it is iterated; the connection goes back to the pool when
    the body has been read whole on a connection that stays open (else it is closed)."""

    def __init__(self, lease: _Lease, request: httpx.Request, status: int, headers: list[tuple[bytes, bytes]],
                 rest: bytes, keep_alive: bool) -> None:
        self._lease = lease
        self._sock = lease.sock
        self._request = request
        self._rest = rest
        self._reusable = keep_alive
        self._done = False
        self._length, self._chunked = _framing(headers, status, request.method)
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
            raise _as_httpx(self._lease.explain(exc), self._request, reading=True) from None
        finally:
            self.close()

    @property
    def sized(self) -> bool:
        """Whether the body's length is known (Content-Length): ``read_exactly`` works."""
        return not self._chunked and self._length is not None

    def read_exactly(self, n: int, into: memoryview | None = None) -> bytearray | memoryview | None:
        """The next ``n`` bytes of a body of known length (``sized``), read straight into one
        new buffer, or into the first ``n`` bytes of ``into`` (writable memory of the caller's:
        a reused buffer, which spares fresh memory's page faults); None at the end of the
        body. For readers that know their record sizes (frames)."""
        if self._chunked or self._length is None:  # (not ``sized``)
            raise RuntimeError("read_exactly needs a body of known length")
        if self._length == 0:
            self._done = True
            self.close()
            return None
        if self._sock is None:
            raise httpx.StreamClosed()
        if n > self._length:
            self._reusable = False
            self.close()
            raise httpx.RemoteProtocolError(f"{n} bytes wanted, {self._length} left in the body",
                                            request=self._request)
        if into is None:
            buf: bytearray | memoryview = bytearray(n)
            view = memoryview(buf)
        else:
            if len(into) < n:
                raise ValueError(f"into: {len(into)} bytes, {n} wanted")
            buf = view = into[:n]
        got = min(len(self._rest), n)
        view[:got] = self._rest[:got]
        self._rest = self._rest[got:]
        try:
            while got < n:
                self._lease.pace()
                k = self._sock.recv_into(view[got:])
                if not k:
                    raise ConnectionResetError("connection closed inside the body")
                got += k
        except OSError as exc:
            self._reusable = False
            self.close()
            raise _as_httpx(self._lease.explain(exc), self._request, reading=True) from None
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
        if sock is None:
            raise httpx.StreamClosed()
        chunk_bytes = self._lease.transport.chunk_bytes
        while remaining is None or remaining > 0:
            size = chunk_bytes if remaining is None else min(remaining, chunk_bytes)
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                self._lease.pace()
                n = sock.recv_into(view[got:])
                if not n:
                    if remaining is None:
                        break
                    raise ConnectionResetError(f"connection closed with {remaining - got} bytes of the body missing")
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
        if self._sock is None:
            raise httpx.StreamClosed()
        reader = _LineReader(self._sock, self._rest, self._lease.pace)
        while True:
            line = reader.line()
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                while reader.line():  # trailers, then the empty line
                    pass
                self._rest = bytes(reader.buf)  # anything past the body: the connection is not reused
                return
            # Handed on as it arrives, not whole: the size is the peer's word (up to 2**64
            # bytes), and a reader that stops at a limit of its own must not hold it all first.
            while size:
                piece = reader.some(min(size, self._lease.transport.chunk_bytes))
                size -= len(piece)
                yield piece
            if reader.line():
                raise ValueError("chunk data longer than its size")

    def close(self) -> None:
        if self._sock is None:
            return
        self._sock = None
        self._lease.release(reusable=self._done and self._reusable and not self._rest)


class _ProxiedBody(httpx.SyncByteStream):
    """A proxied answer's body (httpx's stream), ended between two pieces once its exchange
    is past its deadline or the transport's cutoff (``httpx.ReadTimeout``; its connection
    closed with it, by httpx)."""

    def __init__(self, transport: BulkTransport, stream: Any, request: httpx.Request, thread: int,
                 deadline: float | None) -> None:
        self._transport, self._stream, self._request = transport, stream, request
        self._thread, self._deadline = thread, deadline
        self._open = True

    def __iter__(self) -> Iterator[bytes]:
        for piece in self._stream:
            why = self._transport._proxy_due(self._thread, self._deadline)
            if why is not None:
                self.close()
                raise httpx.ReadTimeout(why, request=self._request)
            yield piece

    def close(self) -> None:
        if self._open:
            self._open = False
            self._transport._proxy_done(self._thread)
        self._stream.close()


class _LineReader:
    def __init__(self, sock: socket.socket, rest: bytes, pace: Callable[[], None]) -> None:
        self.sock = sock
        self.buf = bytearray(rest)
        self.pace = pace

    def _fill(self) -> None:
        self.pace()
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("connection closed inside a chunked body")
        self.buf += data

    def line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > _HEAD_LIMIT:
                raise ValueError("chunk header too long")
            self._fill()
        out = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return out

    def some(self, n: int) -> bytes:
        """Up to ``n`` bytes: those buffered, else what one read brings."""
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


class _NoAnswer(Exception):
    """The connection ended (or was reset) before any byte of an answer arrived."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Stale(Exception):
    """A reused connection was found closed before any answer: ``error`` if not resent."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _read_head(lease: _Lease, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    """The final answer's status, headers, the bytes read past its head, and whether the
    connection may stay open; interim (1xx) answers are read and dropped."""
    sock = lease.sock
    assert sock is not None
    buf = b""
    while True:
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > _HEAD_LIMIT:
                raise httpx.RemoteProtocolError("response head over 64 KiB", request=request)
            lease.pace()
            try:
                data = sock.recv(1 << 16)
            except (ConnectionResetError, ConnectionAbortedError) as exc:
                if not buf:
                    raise _NoAnswer(exc) from None
                raise
            if not data:
                if not buf:
                    raise _NoAnswer(ConnectionResetError("connection closed before a response"))
                raise ConnectionResetError("connection closed inside a response head")
            if not buf and data[0] in _TLS_RECORD_TYPES and not isinstance(sock, ssl.SSLSocket):
                # (no HTTP answer starts so) else the head was read on to the close
                raise httpx.RemoteProtocolError(f"the answer is a TLS record (byte 0x{data[0]:02x}), not HTTP: "
                                                f"{_authority(lease.key[1], lease.key[2])} {_SPEAKS_HTTPS}",
                                                request=request)
            buf += data
        status, headers, keep_alive = _parse_head(buf[:end], request)
        buf = buf[end + 4 :]
        if status >= 200:
            return status, headers, buf, keep_alive
        if status == 101:
            raise httpx.RemoteProtocolError("101 Switching Protocols, but no upgrade was asked for", request=request)
        # 100 Continue, 102 Processing, 103 Early Hints: the final answer follows.


def _if_tls(cause: BaseException, lease: _Lease, timeouts: dict) -> BaseException:
    """``cause`` (a plain connection closed before any answer), said with what to do where the
    server speaks TLS: one that does closes on a plain request's first bytes without a word.
    Asked with a handshake of its own on this error path only (nothing is sent over it), so a
    plain server that closed (a crash, a restart) is not said to be one."""
    _, host, port = lease.key
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE  # (whether it speaks TLS, not whom)
    connect = lease.connect_timeouts(timeouts).get("connect")
    try:
        with open_socket(host, port, min(connect or _PROBE_SECONDS, _PROBE_SECONDS)) as raw, \
                probe.wrap_socket(raw, server_hostname=host):
            pass
    except ssl.SSLError as exc:
        if "ALERT" not in (exc.reason or ""):  # (an alert is TLS too: a client certificate asked for, say)
            return cause
    except OSError:
        return cause
    return type(cause)(f"{cause}: {_authority(host, port)} {_SPEAKS_HTTPS}")


def _authority(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets ("::1:8080" read as an
    address of more groups)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_head(head: bytes, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bool]:
    lines = head.split(b"\r\n")
    match = _STATUS.match(lines[0])
    if match is None:
        raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}", request=request)
    minor, status = match.group(1), int(match.group(2))
    if status < 100:  # (RFC 9110 section 15: 100 to 599) else read as an interim answer and skipped
        raise httpx.RemoteProtocolError(f"status {match.group(2).decode()} is not an HTTP status", request=request)
    headers = []
    connection = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}", request=request)
        value = value.strip(b" \t")
        if name.lower() == b"connection":
            connection += b"," + value.lower()
        headers.append((name, value))
    tokens = {t.strip() for t in connection.split(b",")}
    keep_alive = b"keep-alive" in tokens if minor == b"0" else b"close" not in tokens
    return status, headers, keep_alive


def _framing(headers: list[tuple[bytes, bytes]], status: int, method: str) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked) of a response body; ``ValueError`` where the head
    does not say one thing (RFC 9112 section 6.3)."""
    lengths, encodings = set(), []
    for name, value in headers:
        lname = name.lower()
        if lname == b"content-length":
            for part in value.split(b","):
                part = part.strip()
                if not _DIGITS.match(part) or len(part) > 18:
                    raise ValueError(f"bad Content-Length {value[:40]!r}")
                lengths.add(int(part))
        elif lname == b"transfer-encoding":
            encodings += [e.strip().lower() for e in value.split(b",")]
    if status in (204, 304) or 100 <= status < 200 or method == "HEAD":
        return 0, False
    if len(lengths) > 1:
        raise ValueError(f"Content-Length headers that differ: {sorted(lengths)}")
    if encodings:
        if encodings != [b"chunked"]:
            raise ValueError(f"unsupported Transfer-Encoding {b', '.join(encodings)[:40]!r}")
        if lengths:
            raise ValueError("both Content-Length and Transfer-Encoding")
        return None, True
    return (lengths.pop() if lengths else None), False


def _may_resend(request: httpx.Request) -> bool:
    idempotent = request.extensions.get(IDEMPOTENT_EXTENSION, request.method in IDEMPOTENT_METHODS)
    stream = request.stream
    return bool(idempotent) and (isinstance(stream, httpx.ByteStream) or getattr(stream, "replayable", False))


def _pool_key(url: httpx.URL) -> tuple[str, str, int]:
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


def ssl_context(verify: bool | str | os.PathLike | ssl.SSLContext) -> ssl.SSLContext:
    """The TLS settings of ``verify``: True (the system's CAs), False (no verification: for
    tests only), a CA bundle file (or directory), or a context used as given."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify is True:
        return ssl.create_default_context()
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if isinstance(verify, (str, os.PathLike)):
        path = os.fspath(verify)
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        if os.path.isfile(path):
            return ssl.create_default_context(cafile=path)
        from .errors import ConfigError

        raise ConfigError(f"verify: no CA bundle file or directory at {path!r}")
    from .errors import ConfigError

    raise ConfigError(f"verify: a bool, a CA bundle path or an ssl.SSLContext, not {type(verify).__name__}")


def _sendmsg_all(sock: socket.socket, buffers: list[Any], pace: Callable[[], None]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        pace()
        sent = sock.sendmsg(views[:512])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _sendall_each(sock: socket.socket, buffers: list[Any], pace: Callable[[], None]) -> None:
    small = [b for b in buffers if memoryview(b).nbytes < _SMALL]
    if len(small) == len(buffers):
        pace()
        sock.sendall(b"".join(bytes(b) if not isinstance(b, bytes) else b for b in buffers))
        return
    for b in buffers:
        pace()  # (sendall's timeout bounds the whole call)
        sock.sendall(b)


def _alive(sock: socket.socket) -> bool:
    """A pooled connection is usable if the server has not closed it: nothing is readable
    (over TLS, readable records that hold no data, such as session tickets, are fine)."""
    try:
        # poll, not select: select refuses descriptors past FD_SETSIZE (1024), which a process
        # with many files open hands out, and every pooled connection was then taken for closed.
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        readable = poller.poll(0)  # (POLLHUP and POLLERR come whether asked for or not)
    except (OSError, ValueError):
        return False
    if not readable:
        return True
    if not isinstance(sock, ssl.SSLSocket):
        return False
    try:
        sock.setblocking(False)
        try:
            sock.recv(1)
        finally:
            sock.setblocking(True)
    except ssl.SSLWantReadError:
        return True
    except (OSError, ValueError):
        return False
    return False  # end of stream, or data nobody asked for


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
    if isinstance(exc, ssl.SSLError):
        return httpx.ReadError(f"TLS: {exc}", request=request)
    if isinstance(exc, (ConnectionError, ValueError)):
        return httpx.RemoteProtocolError(str(exc), request=request)
    if isinstance(exc, OSError):
        return (httpx.ReadError if reading else httpx.WriteError)(str(exc), request=request)
    return exc


__all__ = ["BODY_EXTENSION", "IDEMPOTENT_EXTENSION", "BulkTransport", "ssl_context"]
