"""A leaner request-body path for uvicorn's httptools protocol.

uvicorn appends every body piece to a bytearray, hands the app ``bytes(that)`` (a second
copy), and stops reading once 64 KiB wait unread, resuming when the app asks for more. For
10 MB frames that is two extra passes over every byte and a pause and wake-up per 64 KiB,
which on a busy host made a bare uvicorn app that discards bodies slower than
``redis-server`` taking the same bytes. Here the pieces are kept as they arrive and given to
the app one by one as they are (never copied or joined, but for pieces under ``SMALL_PIECE``,
a chunked body's tiny chunks, gathered so that a queue of them costs about its bytes), and
reading pauses only past ``high_water`` bytes waiting.

Even so, each byte of a body is copied three times before the app sees it (the event loop's
read buffer into a ``bytes``, httptools into another ``bytes``, the app into its buffer).
So the app may also ask for the body to be written straight into memory it names: the
ASGI scope's extension ``BODY_INTO`` is ``async receive_into(view, on_data=None, deadline=None) -> int``,
which fills ``view`` with the next body bytes (fewer only where the body ends, the client
goes, or the event loop's clock passes ``deadline``), calling ``on_data(piece)`` with each piece of ``view`` as soon as it is filled (to
hash it while it is in cache, say).
Once the bytes already parsed are used up, the connection is switched to a buffered protocol
(``asyncio.BufferedProtocol``, which uvloop and asyncio both serve with ``recv_into``) that
reads the rest of the body into ``view`` directly: one copy, by the kernel, as
``redis-server`` does. httptools never sees those bytes, so when the body is done its parser
is replaced by a fresh one for the next request. This needs the body's length up front
(Content-Length); a chunked body goes through the pieces.

A request's line and headers may take at most ``MAX_HEAD_BYTES`` (64 KiB), and so may the
trailers of a chunked body: longer ones are answered 431 and the connection closed
(httptools and uvicorn buffer them whole, with no bound of their own). At most ``MAX_PIPELINED``
requests of a connection wait behind the one being answered: the next is answered 429, after
those, and the connection closed; so is an HTTP/1.1 request without one Host header (400). The protocol also holds each connection to time limits (``ConnectionLimits``): a request's
headers must arrive within ``header_timeout_seconds`` of its first byte (or of the connection's
opening), and while the server is reading a body, the body must not go ``body_idle_timeout_seconds``
without a byte nor average less than ``body_min_bytes_per_second`` bytes a second (slowloris); and
while a response waits for its client to read (writing paused), the client must take some of it
within ``body_idle_timeout_seconds``, and, once it has waited that long, average at least
``body_min_bytes_per_second``. A connection that breaks them is closed, and the app sees
its client gone.

This overrides methods of uvicorn's classes, which are not a public interface: uvicorn and
httptools are pinned to the range this was tested with (pyproject.toml), and
``protocol_class()`` checks the versions and that every method it replaces or relies on
still reads as expected. Otherwise it returns None with the reason (``fast_path_problem``),
the server falls back to uvicorn's own protocol (httptools, or h11 without it), says so at
start (a warning) and in ``/readyz`` (``receive_path``), and the test suite fails
(``tests/test_protocol.py``).
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import json
import logging
import struct
import sys
import termios
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

HIGH_WATER = 1 << 20
MAX_HEAD_BYTES = 64 << 10  # a request's line and headers, or its trailers (httptools and uvicorn keep them whole)
MAX_PIPELINED = 128  # requests of one connection waiting behind the one being answered
SCRATCH = 256 << 10  # read size when the app wants pieces of a body the protocol has taken over
# Body pieces below SMALL_PIECE are gathered into one of up to GATHER bytes: a chunked body of
# 2-byte chunks, held as they came (a bytes object and a deque slot each) for a route not
# reading yet, cost 28 MiB of a connection's memory for the 1 MiB of high_water.
SMALL_PIECE = 4 << 10
GATHER = 64 << 10
BODY_INTO = "cacheseek.body_into"  # key in scope["extensions"]
BODY_GONE = "cacheseek.body_gone"  # () -> bool: the client went away (or was cut off) mid-request
BODY_CUT = "cacheseek.body_cut"  # () -> str | None: why the server cut the client off mid-body (too slow)
# (abort=False) -> None: end a response begun, on purpose, by closing the connection (abort:
# dropping what the transport still holds, unsent).
CUT_SHORT = "cacheseek.cut_short"
# () -> int: bytes written to the connection and not sent yet (0 once it is gone). The
# transport may hold them by reference (uvloop, asyncio from 3.12): a response releases a
# frame's memory once its bytes are past them (server/leased_response.py).
UNSENT = "cacheseek.unsent"
# The releases this module was tested with ([low, high)): pyproject.toml pins the same range.
UVICORN_RANGE = ((0, 54), (0, 55))
HTTPTOOLS_RANGE = ((0, 9), (0, 10))
TICK_S = 1.0  # how often a body's progress is checked
# After a refusal's answer, how long what the client still sends is read and dropped before
# the connection is closed (the answer's end already signalled by a FIN): closed at once
# with its bytes unread, the kernel answered them with a reset, which could destroy the
# answer before the client read it (a pipelining client lost its 429 in 2 runs of 3).
LINGER_S = 2.0

log = logging.getLogger("cacheseek.server")


def header_error(headers: Any, http_version: str | None) -> str | None:
    """Why a request's headers are refused, or None: an HTTP/1.1 request carries exactly one
    Host (RFC 9112 3.2), and any request at most one Authorization, Content-Type and each
    ``X-CacheSeek-*`` header. Twice, a front before this server (a gateway that adds a
    tenant's namespace beside the client's own, say) may have read the other one.
    ``headers``: (name, value) pairs, names lower-case bytes."""
    hosts = 0
    seen: set[bytes] = set()
    twice: bytes | None = None
    for name, _ in headers:
        if name == b"host":
            hosts += 1
        elif name == b"authorization" or name == b"content-type" or name.startswith(b"x-cacheseek-"):
            if name in seen and twice is None:
                twice = name
            seen.add(name)
    if hosts > 1 or (hosts == 0 and http_version == "1.1"):
        return f"an HTTP/1.1 request needs exactly one Host header, this one has {hosts}"
    if twice is not None:
        return (f"the {twice[:64].decode('latin-1')} header appears more than once; a request carries it at most "
                "once")
    return None


class HeadFieldsOnly:
    """Mixed in before uvicorn's httptools protocol: header fields count only while
    ``in_head`` (the subclass keeps it). httptools reports a chunked body's trailer fields
    through ``on_header`` too, and uvicorn appends them to the list that is the scope's
    headers: one that came in the same read as the head authorized the request or chose its
    namespace (RFC 9110 6.5.1 forbids it). Past the head, they are dropped."""

    in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            super().on_header(name, value)  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_seconds: float = 10.0
    body_idle_timeout_seconds: float = 10.0
    body_min_bytes_per_second: int = 64 << 10  # bytes per second, averaged once a body has run body_idle_timeout_seconds; 0: off


def fast_path_problem() -> str | None:
    """Why ``protocol_class()`` would return None, or None when the fast path is on."""
    try:
        import httptools
        import uvicorn
        from uvicorn.protocols.http import httptools_impl as impl
    except ImportError as exc:  # no httptools
        return f"cannot import uvicorn's httptools protocol: {exc}"
    for name, version, (low, high) in (("uvicorn", uvicorn.__version__, UVICORN_RANGE),
                                       ("httptools", httptools.__version__, HTTPTOOLS_RANGE)):
        release = _release(version)
        if release is None or not low <= release < high:
            return (f"{name} {version} is outside the tested range >={'.'.join(map(str, low))},"
                    f"<{'.'.join(map(str, high))}")
    return _unexpected(impl)


def protocol_class(high_water: int = HIGH_WATER, limits: ConnectionLimits = ConnectionLimits(),
                   on_refused: Callable[[int, str, str], None] | None = None) -> type | None:
    """The fast path's protocol class, or None where it cannot run (``fast_path_problem``).
    ``on_refused(status, reason, peer)``: told of each request the protocol answers itself,
    refused before any route (a malformed request, a head over its bound, a body coding not
    decoded, too many pipelined): the app's middleware never sees those."""
    if fast_path_problem() is not None:
        return None
    import httptools
    from uvicorn.protocols.http import httptools_impl as impl

    cycle_cls = impl.RequestResponseCycle
    proto_cls = impl.HttpToolsProtocol

    class PiecesCycle(cycle_cls):  # type: ignore[misc, valid-type]
        pieces: deque[Any]
        waiting: int
        protocol: Any
        body_length: int | None  # from Content-Length; None when chunked or unreadable
        seen: int  # body bytes the parser has given
        reader: BodyTakeover | None
        waiting_for_100_continue: bool  # (uvicorn's, declared: the base is dynamic)

        async def receive(self) -> Any:
            self._continue()
            if not self.pieces and not self.disconnected and not self.response_complete:
                self.flow.resume_reading()
                await self.message_event.wait()
                self.message_event.clear()
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            body = self.pieces.popleft() if self.pieces else b""
            if type(body) is bytearray:  # (gathered small pieces: ASGI's body is bytes)
                body = bytes(body)
            self.waiting -= len(body)
            if self.waiting <= high_water:
                self.flow.resume_reading()
            return {"type": "http.request", "body": body, "more_body": bool(self.pieces) or self.more_body}

        async def receive_into(self, view: Any, on_data: Callable[[memoryview], None] | None = None,
                               deadline: float | None = None) -> int:
            """Fill ``view`` with the next body bytes; fewer only where the body ends, the
            client goes, or the event loop's clock passes ``deadline``. The ``BODY_INTO`` extension."""
            self._continue()
            view = memoryview(view).cast("B")
            total, filled = view.nbytes, 0
            loop = self.protocol.loop
            while filled < total:
                if self.pieces:
                    n = self._take_piece(view[filled:])
                    if on_data is not None:
                        on_data(view[filled : filled + n])
                    filled += n
                    continue
                if self.disconnected or self.response_complete or not self.more_body:
                    break
                if deadline is not None and loop.time() >= deadline:
                    break
                reader = self.reader or self._take_over()
                if reader is None:  # length unknown: wait for pieces
                    self.flow.resume_reading()
                    # (the deadline only wakes the wait: a cancelled wait would do as well here,
                    # but a timer is what BodyTakeover needs, and one way is easier to follow)
                    timer = loop.call_at(deadline, self.message_event.set) if deadline is not None else None
                    await self.message_event.wait()
                    self.message_event.clear()
                    if timer is not None:
                        timer.cancel()
                    continue
                filled += await reader.read_into(view[filled : filled + min(total - filled, reader.left)], on_data,
                                                 deadline)
            return filled

        async def send(self, message: Any) -> None:
            if message["type"] == "http.response.start" and self.waiting_for_100_continue and self.more_body:
                # Answered under ``Expect: 100-continue`` before the body was asked for: the
                # client, sent no 100, may send its body or not (RFC 9110, 10.1.1), and the
                # next request could not be told from a body to skip. The answer ends the connection.
                self.keep_alive = False
            await super().send(message)

        def _continue(self) -> None:
            if self.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False

        def add_piece(self, piece: bytes | memoryview) -> None:
            """Queue body bytes for the app (``piece`` is not used after: a view's memory may be
            reused). A small one joins the small ones before it, in one ``bytearray``, so what a
            queue of them holds is about their bytes; a large one is kept as it is."""
            pieces = self.pieces
            if len(piece) < SMALL_PIECE:
                last = pieces[-1] if pieces else None
                # (a bytearray only while whole: one the app took part of is a memoryview now)
                if type(last) is bytearray and len(last) < GATHER:
                    last += piece
                else:
                    pieces.append(bytearray(piece))
            else:
                pieces.append(piece if type(piece) is bytes else bytes(piece))
            self.waiting += len(piece)

        def _take_piece(self, view: memoryview) -> int:
            piece = self.pieces[0]
            n = min(len(piece), view.nbytes)
            view[:n] = memoryview(piece)[:n]
            if n == len(piece):
                self.pieces.popleft()
            else:
                self.pieces[0] = memoryview(piece)[n:]
            self.waiting -= n
            return n

        def _take_over(self) -> BodyTakeover | None:
            """Switch the connection to reading the rest of the body ourselves (every byte
            received so far has been parsed: the parser stands inside this body)."""
            if self.body_length is None or self.body_length <= self.seen:
                return None
            self.reader = BodyTakeover(self.protocol, self, self.body_length - self.seen, high_water,
                                       self.protocol.watch)
            self.transport.set_protocol(self.reader)
            return self.reader

    class PiecesProtocol(HeadFieldsOnly, proto_cls):  # type: ignore[misc, valid-type]
        watch: Watchdog
        pipeline: deque[Any]  # (uvicorn's, declared: the base is dynamic)
        timeout_keep_alive_task: asyncio.TimerHandle | None  # (uvicorn's)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.in_message = False  # the parser is inside a request (begun, not complete)
            self.in_head = True  # the bytes that come are a request's line and headers (or precede them)
            self.head_epoch = 0  # changes whenever a head begins or ends, or a request completes
            self.head_bytes = 0
            self.in_trailers = False  # after a chunk's size line, before any of its data: trailers, if it was the last
            self.chunk_epoch = 0  # changes with each chunk's size line and each piece of body
            self.watch = Watchdog(self, limits)
            self.watch.expect_headers()
            self.open_cycles: list[Any] = []  # requests whose responses are not complete yet
            self.fed = b""  # the bytes data_received is parsing
            # After a request the parser refused: nothing more is read, and its error response
            # (None: none, the request was answered already) waits for the responses before it.
            self.refused = False
            self.deferred: bytes | None = None

        def connection_lost(self, exc: Exception | None) -> None:
            self.watch.stop()
            super().connection_lost(exc)
            # uvicorn cancels the idle keep-alive timer only for a connection that ended
            # cleanly: after a reset it held this protocol (its last request's scope and
            # cycle) until it fired, keepalive_timeout_seconds on, one per reset connection.
            self._unset_keepalive_if_required()
            # uvicorn tells only the newest request's cycle. A response still being sent when
            # a pipelined request's headers came in would write on into the closed transport
            # (uvloop raises: its route failed, logged as a bug) and fetch its frames to the end.
            for cycle in self.open_cycles:
                if not cycle.response_complete and not cycle.disconnected:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self.open_cycles.clear()

        def pause_writing(self) -> None:
            super().pause_writing()
            self.watch.send_paused()

        def resume_writing(self) -> None:
            super().resume_writing()
            self.watch.send_resumed()

        def send_400_response(self, msg: str) -> None:
            # A request too malformed to parse (a Content-Length that is not a number, a bad
            # request line) reaches no route: its 400 is JSON all the same, as every error is.
            self.send_error_and_close(b"400 Bad Request", f"malformed HTTP request: {msg}")

        def send_error_and_close(self, status: bytes, error: str) -> None:
            """Answer the request the parser refused and close the connection, in its turn: a
            response still being sent for a request before it (pipelined) is sent whole first.
            Written at once, the error went into the middle of that response's body, which was
            then cut short."""
            self.refused = True
            if on_refused is not None:
                try:
                    on_refused(int(status.split(b" ", 1)[0]), error,
                               f"{self.client[0]}:{self.client[1]}" if self.client else "a client")
                except Exception:  # noqa: BLE001 - counting must never cost the connection its answer
                    log.exception("counting a refused request failed")
            self.flow.pause_reading()
            # (No head or body comes any more: the send limits alone stay, for the responses
            # still to go.)
            self.watch.refused()
            cycle = getattr(self, "cycle", None)
            refused_cycle = None if self.in_head else cycle  # inside a body: that request's; else a new one's
            if refused_cycle is not None and refused_cycle.response_started:
                # Its body is malformed past the point the route answered: a second response
                # would be read as the next request's. The connection ends after the first.
                refused_cycle.keep_alive = False
                self.deferred = None
                if refused_cycle.response_complete:
                    self._linger()
                return
            body = json.dumps({"error": error}).encode()
            content = [b"HTTP/1.1 " + status + b"\r\n"]
            for name, value in self.server_state.default_headers:
                content += [name, b": ", value, b"\r\n"]
            content += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                        b"\r\nconnection: close\r\n\r\n", body]
            self.deferred = b"".join(content)
            if refused_cycle is not None:  # (queued behind another's response, it must never start)
                self.pipeline = type(self.pipeline)(p for p in self.pipeline if p[0] is not refused_cycle)
            if not self._answers_before(refused_cycle):
                self._send_deferred()

        def _answers_before(self, refused_cycle: Any) -> bool:
            """Whether a request before the refused one still has a response to send."""
            return any(c is not refused_cycle and not c.response_complete and not c.disconnected
                       for c in self.open_cycles)

        def _send_deferred(self) -> None:
            content, self.deferred = self.deferred, None
            for cycle in self.open_cycles:  # the refused request's route, if it runs, is told its client is gone
                if not cycle.response_complete and not cycle.disconnected:
                    cycle.disconnected = True
                    cycle.message_event.set()
            if content is not None and not self.transport.is_closing():
                self.transport.write(content)
            self._linger()

        def _linger(self) -> None:
            """End the connection after what is written: a FIN once it is sent, then what the
            client still sends is read and dropped (``data_received``: refused) until it closes
            too or ``LINGER_S`` passed. (TLS has no half-close: closed at once, as before.)"""
            transport = self.transport
            if transport.is_closing():
                return
            try:
                half_close = transport.can_write_eof()
            except NotImplementedError:
                half_close = False
            if not half_close:
                transport.close()
                return
            transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(LINGER_S, transport.close)

        def on_response_complete(self) -> None:
            if not self.refused:
                super().on_response_complete()
                return
            # Nothing more is read; the requests queued before the refused one are answered in
            # turn (it left the queue when refused), then its error.
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            elif not self._answers_before(None if self.in_head else getattr(self, "cycle", None)):
                self._send_deferred()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_message = True
            self.in_head, self.head_bytes = True, 0
            self.head_epoch += 1
            self.watch.expect_headers()

        def data_received(self, data: bytes) -> None:
            if self.refused:  # (the parser is past a request it could not parse)
                return
            epoch, chunk_epoch, in_trailers = self.head_epoch, self.chunk_epoch, self.in_trailers
            self.fed = data  # (for _unsupported_upgrade_warning; not kept: a read is up to 256 KiB)
            try:
                super().data_received(data)
            finally:
                self.fed = b""
            if self.refused:
                return
            # Bytes of one head (or of trailers) and nothing else (no head or chunk began or
            # ended within them): counted. A read in which one began is not, so no body byte
            # is, and a head may pass the bound by one read.
            counted = (self.in_head or in_trailers and self.in_trailers and chunk_epoch == self.chunk_epoch) \
                and epoch == self.head_epoch and not self.transport.is_closing()
            if counted:
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    self.send_error_and_close(b"431 Request Header Fields Too Large",
                                              f"request line and headers (or trailers) over {MAX_HEAD_BYTES} bytes")
                    return
            # uvicorn cancels the keep-alive timer on any byte, and re-arms it only when a
            # response completes. Bytes between requests that begin none (a bare CRLF) left
            # an idle connection with no timer at all, open for good: they count as the
            # first bytes of the next request's headers instead.
            if not self.in_message and self.timeout_keep_alive_task is None and self._between_requests():
                self.watch.expect_headers()

        def _unsupported_upgrade_warning(self) -> None:
            # Called where uvicorn catches the parser's HttpParserUpgrade for an upgrade it does
            # not make, and drops the bytes after that request's head: a request pipelined
            # behind it was never answered (its client waited for the keep-alive timeout). The
            # request was served as any other; the bytes after it are parsed as the next one.
            # (One with a body never gets here: on_headers_complete refused it.)
            super()._unsupported_upgrade_warning()
            upgrade = sys.exc_info()[1]
            if isinstance(upgrade, httptools.HttpParserUpgrade) and upgrade.args and not self.transport.is_closing():
                rest = self.fed[upgrade.args[0] :]
                if rest:
                    self.data_received(rest)

        def _between_requests(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return (not self.transport.is_closing() and not self.pipeline
                    and (cycle is None or cycle.response_complete))

        def on_headers_complete(self) -> None:
            if self.refused:
                return
            refused = coding_error(self.headers)
            if refused is not None:
                # uvicorn decodes no coding but chunked framing, and passed the body on as it
                # came: bytes the client said were gzip went to the route (and to the store)
                # as if they were the frame.
                self.send_error_and_close(*refused)
                return
            if len(self.pipeline) >= MAX_PIPELINED:
                # uvicorn queues every request pipelined behind the one being answered, and
                # parses a whole read past the first (thousands of tiny GETs) whenever a
                # response resumes reading: a client sending without reading its answers
                # queued without end, each queued request a pass over those before it on the
                # event loop (open_cycles), which held every client and SIGTERM.
                self.send_error_and_close(b"429 Too Many Requests", f"over {MAX_PIPELINED} requests pipelined on "
                                          "one connection, waiting for their answers: the connection ends after those")
                return
            wrong_headers = header_error(self.headers, self.parser.get_http_version())
            if wrong_headers:
                # Neither was refused: a request without Host was served, and one with two,
                # which a front before this server may have read as the other.
                self.send_error_and_close(b"400 Bad Request", wrong_headers)
                return
            if self.parser.should_upgrade() and not self._should_upgrade() and _body_length(self.headers) != 0:
                # httptools skips the body of a request asking for an upgrade (its bytes are the
                # new protocol's), and this server upgrades to none: the route would read no
                # body, and the body's bytes would be parsed as the next request (one smuggled
                # past a front that forwards the header). Refused before any of them is read.
                self.send_error_and_close(b"400 Bad Request", "a request asking for an upgrade (Connection: upgrade) "
                                          "cannot have a body: this server upgrades to no other protocol")
                return
            super().on_headers_complete()
            self.in_head = self.in_trailers = False
            self.head_epoch += 1
            cycle = getattr(self, "cycle", None)
            body_length = _body_length(self.headers)
            self.watch.headers_done(expect_body=body_length != 0)
            if cycle is not None and type(cycle) is cycle_cls:
                self.open_cycles = [c for c in self.open_cycles if not c.response_complete]
                self.open_cycles.append(cycle)
                cycle.__class__ = PiecesCycle
                pieces_cycle = cast("PiecesCycle", cycle)  # (the same object, its class swapped)
                pieces_cycle.pieces = deque()
                pieces_cycle.waiting = 0
                pieces_cycle.protocol = self
                pieces_cycle.body_length = body_length
                pieces_cycle.seen = 0
                pieces_cycle.reader = None
                # (ASGI's typing has an extension's value a dict; these are the server's callables)
                extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
                extensions[BODY_INTO] = pieces_cycle.receive_into
                extensions[BODY_GONE] = lambda: cycle.disconnected
                extensions[BODY_CUT] = lambda: self.watch.body_cut
                extensions[CUT_SHORT] = lambda abort=False: self.cut_short(cycle, abort)
                extensions[UNSENT] = self.transport.get_write_buffer_size

        def cut_short(self, cycle: Any, abort: bool = False) -> None:
            """The ``CUT_SHORT`` extension: the response's client sees its connection closed
            before the declared length; uvicorn, told the client is gone, logs nothing."""
            cycle.disconnected = True
            cycle.message_event.set()
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

        def on_message_complete(self) -> None:
            if self.refused:
                return
            super().on_message_complete()
            self.watch.body_done()
            self.message_done()

        def message_done(self) -> None:
            """The request's last byte is in (parsed, or read by a ``BodyTakeover``)."""
            self.in_message = self.in_trailers = False
            self.in_head, self.head_bytes = True, 0
            self.head_epoch += 1
            # Answered before its body came (a 4xx, a 503): the response's keep-alive timer
            # was cancelled by the body's bytes. The connection is idle again now.
            if self.timeout_keep_alive_task is None and self._between_requests():
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

        def on_chunk_header(self) -> None:
            self.in_trailers, self.head_bytes = True, 0
            self.chunk_epoch += 1

        def on_body(self, body: bytes) -> None:
            if self.refused:  # (a refused request's body is never a route's)
                return
            self.watch.received(len(body))
            self.in_trailers = False
            self.chunk_epoch += 1
            cycle = self.cycle
            if not isinstance(cycle, PiecesCycle):
                return super().on_body(body)
            cycle.seen += len(body)
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return None
            cycle.add_piece(body)
            if cycle.waiting > high_water:
                self.flow.pause_reading()
            cycle.message_event.set()
            return None

        def fresh_parser(self) -> None:
            """A new parser, set up as uvicorn sets up its own, for the next request."""
            self.parser = httptools.HttpRequestParser(self)
            try:
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:  # httptools < 0.6.3
                pass

    return PiecesProtocol


def plain_protocol_class() -> type | None:
    """uvicorn's own httptools protocol (``--http httptools``, or the fast path off), but for
    a chunked body's trailer fields, which it made request headers (``HeadFieldsOnly``); None where httptools does not import (uvicorn then takes h11, which
    keeps trailers apart)."""
    try:
        from uvicorn.protocols.http import httptools_impl as impl

        base = impl.HttpToolsProtocol
    except (ImportError, AttributeError):
        return None

    class NoTrailerFields(HeadFieldsOnly, base):  # type: ignore[misc, valid-type]
        def on_message_begin(self) -> None:
            self.in_head = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self.in_head = False
            super().on_headers_complete()

    return NoTrailerFields


class BodyTakeover(asyncio.BufferedProtocol):
    """The connection's protocol while the rest of one request body is read: bytes go by
    ``recv_into`` straight into the view the app named, or, when the app asked for pieces
    (or has answered already), into a scratch buffer. It never offers room past the body, so
    the next request's bytes stay in the socket for the HTTP protocol, which it puts back
    (with a fresh parser) when the body is done."""

    def __init__(self, protocol: Any, cycle: Any, left: int, high_water: int, watch: Watchdog) -> None:
        self.protocol = protocol
        self.watch = watch
        self.cycle = cycle
        self.left = left
        self.high_water = high_water
        self.target: memoryview | None = None
        self.on_data: Callable[[memoryview], None] | None = None
        self.filled = 0
        self.scratch: bytearray | None = None

    async def read_into(self, target: memoryview, on_data: Callable[[memoryview], None] | None = None,
                        deadline: float | None = None) -> int:
        """Fill ``target`` (at most ``left`` bytes) from the socket, calling ``on_data`` with
        each piece received; fewer bytes if the client goes, or once the event loop's clock
        passes ``deadline`` (reading is then paused until the next call)."""
        cycle = self.cycle
        self.target, self.on_data, self.filled = target, on_data, 0
        self.protocol.flow.resume_reading()
        loop = self.protocol.loop
        # A timer, not a cancelled wait: the bytes the kernel wrote into the target before a
        # cancellation would be lost from the count.
        timer = loop.call_at(deadline, cycle.message_event.set) if deadline is not None else None
        try:
            while self.target is not None and not cycle.disconnected and not cycle.response_complete:
                if deadline is not None and loop.time() >= deadline:
                    # Nothing more is read until asked: what arrives meanwhile waits in the
                    # socket, not in a buffer no budget counts.
                    self.protocol.flow.pause_reading()
                    break
                await cycle.message_event.wait()
                cycle.message_event.clear()
        finally:
            self.target = self.on_data = None  # never written into after this returns
            if timer is not None:
                timer.cancel()
        return self.filled

    # -- asyncio.BufferedProtocol ----------------------------------------------------------

    def get_buffer(self, sizehint: int) -> Any:
        if self.target is not None:
            return self.target[self.filled :]
        self.scratch = bytearray(min(self.left, SCRATCH))
        return self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        cycle = self.cycle
        self.left -= nbytes
        self.watch.received(nbytes)
        # Bytes of a body are activity, as uvicorn's data_received counts them: an answer sent
        # before the body ended armed the idle keep-alive timer, which would close the
        # connection under a client still sending the body (it is re-armed once the body is done).
        self.protocol._unset_keepalive_if_required()
        if self.target is not None:
            if self.on_data is not None:
                self.on_data(self.target[self.filled : self.filled + nbytes])
            self.filled += nbytes
            if self.filled == self.target.nbytes:
                self.target = None
                if self.left:
                    self.protocol.flow.pause_reading()  # until the app asks for more
                cycle.message_event.set()
        elif not cycle.response_complete:  # else the answer is out: the rest is skipped
            assert self.scratch is not None  # (made by get_buffer, which asyncio calls before this)
            cycle.add_piece(memoryview(self.scratch)[:nbytes])
            if cycle.waiting > self.high_water:
                self.protocol.flow.pause_reading()
            cycle.message_event.set()
        if self.left == 0:
            self._finish()

    def _finish(self) -> None:
        protocol, cycle = self.protocol, self.cycle
        cycle.reader = None
        cycle.more_body = False
        self.watch.body_done()
        protocol.fresh_parser()
        protocol.transport.set_protocol(protocol)
        protocol.message_done()
        cycle.message_event.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.protocol.eof_received()

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()


def _queued(transport: Any) -> int:
    """Response bytes the client has not taken: those the transport holds, and those the
    socket's kernel buffer holds (unsent or unacknowledged). The transport's alone shrink
    only when the kernel buffer, megabytes on a fast link, has room again: a client
    reading steadily at a few hundred KiB/s showed no progress for seconds at a time."""
    return transport.get_write_buffer_size() + _kernel_unsent(transport)


def _kernel_unsent(transport: Any) -> int:
    """SIOCOUTQ (Linux's TIOCOUTQ on a socket); 0 where it cannot be asked."""
    try:
        fd = transport.get_extra_info("socket").fileno()
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):
        return 0


class Watchdog:
    """A connection's time limits: headers within ``header_timeout_seconds``; a body that the
    server is reading gets a byte at least every ``body_idle_timeout_seconds`` and averages at least
    ``body_min_bytes_per_second`` bytes a second once it has run that long. Time while the server has
    paused reading (the app is busy, or its buffers are full) does not count. A response the
    client stops reading (writing paused, the transport's buffer not shrinking) is cut off after
    ``body_idle_timeout_seconds``, and so is one it reads at less than ``body_min_bytes_per_second``
    on average once writing has been paused that long: its route holds the leases of the frames
    it has handed to the transport until the response is over, and a client that kept the
    connection open without reading (or reading a few bytes now and then) held them, and the
    CPU tier's slots, for good."""

    __slots__ = ("protocol", "limits", "loop", "header_timer", "tick_timer", "bytes", "seen", "active_s",
                 "last_tick", "progress_at", "reading_body", "send_timer", "send_left", "send_progress_at",
                 "send_since", "send_taken", "body_cut")

    def __init__(self, protocol: Any, limits: ConnectionLimits) -> None:
        self.protocol = protocol
        self.limits = limits
        self.loop = protocol.loop
        self.header_timer: asyncio.TimerHandle | None = None
        self.tick_timer: asyncio.TimerHandle | None = None
        self.reading_body = False
        self.bytes = self.seen = 0
        self.active_s = self.last_tick = self.progress_at = 0.0
        self.send_timer: asyncio.TimerHandle | None = None
        self.send_left = 0
        self.send_progress_at = self.send_since = 0.0
        self.send_taken = 0
        self.body_cut: str | None = None  # (the connection ends with the cut: one per connection)

    def expect_headers(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout_seconds, self._headers_due)

    def _headers_due(self) -> None:
        self.header_timer = None
        if self.protocol.flow.read_paused:
            # The server is not reading (a pipelined request waits for the response before
            # it): no fault of the client's. Once reading resumes, the head gets a whole
            # header_timeout_seconds.
            self.header_timer = self.loop.call_later(TICK_S, self._headers_due_paused)
            return
        self._cut(f"headers not complete within {self.limits.header_timeout_seconds:g} s")

    def _headers_due_paused(self) -> None:
        self.header_timer = None
        if self.protocol.flow.read_paused:
            self.header_timer = self.loop.call_later(TICK_S, self._headers_due_paused)
        else:
            self.expect_headers()

    def headers_done(self, *, expect_body: bool) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        if expect_body:
            now = self.loop.time()
            self.reading_body = True
            self.bytes = self.seen = 0
            self.active_s = 0.0
            self.last_tick = self.progress_at = now
            if self.tick_timer is None:
                self.tick_timer = self.loop.call_later(TICK_S, self._tick)

    def received(self, nbytes: int) -> None:
        self.bytes += nbytes

    def body_done(self) -> None:
        self.reading_body = False
        if self.tick_timer is not None:
            self.tick_timer.cancel()
            self.tick_timer = None

    def refused(self) -> None:
        self.body_done()
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def stop(self) -> None:
        self.body_done()
        self.send_resumed()
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def send_paused(self) -> None:
        """The transport holds more unsent bytes than its high-water mark: the client is not
        keeping up with the response."""
        if self.send_timer is None:
            transport = self.protocol.transport
            self.send_left = _queued(transport) if transport is not None else 0
            self.send_progress_at = self.send_since = self.loop.time()
            self.send_taken = 0
            self.send_timer = self.loop.call_later(TICK_S, self._send_tick)

    def send_resumed(self) -> None:
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def _send_tick(self) -> None:
        self.send_timer = None
        transport = self.protocol.transport
        if transport is None or transport.is_closing():
            return
        now = self.loop.time()
        left = _queued(transport)
        limits, why = self.limits, None
        if left < self.send_left:
            # (writing is paused, so the app adds nothing: what left the buffer, the client took)
            self.send_taken += self.send_left - left
            self.send_left, self.send_progress_at = left, now
        elif now - self.send_progress_at >= limits.body_idle_timeout_seconds:
            why = f"no response byte taken for {limits.body_idle_timeout_seconds:g} s"
        paused = now - self.send_since
        if why is None and limits.body_min_bytes_per_second and paused >= limits.body_idle_timeout_seconds \
                and self.send_taken < limits.body_min_bytes_per_second * paused:
            why = (f"response taken at {self.send_taken / paused:.0f} B/s, under body_min_bytes_per_second "
                   f"({limits.body_min_bytes_per_second})")
        if why is not None:
            client = self.protocol.client
            log.info("closing the connection of %s: %s", f"{client[0]}:{client[1]}" if client else "a client", why)
            self.stop()
            # abort, not close: close waits to flush the bytes this client does not take.
            transport.abort()
            return
        self.send_timer = self.loop.call_later(TICK_S, self._send_tick)

    def _tick(self) -> None:
        self.tick_timer = None
        if not self.reading_body:
            return
        now = self.loop.time()
        elapsed, self.last_tick = now - self.last_tick, now
        limits = self.limits
        if self.bytes > self.seen or self.protocol.flow.read_paused:
            self.seen = self.bytes
            self.progress_at = now  # the server not reading is no fault of the client's
        else:
            if now - self.progress_at >= limits.body_idle_timeout_seconds:
                return self._cut_body(f"no body byte for {limits.body_idle_timeout_seconds:g} s")
        if not self.protocol.flow.read_paused:
            self.active_s += elapsed
        if limits.body_min_bytes_per_second and self.active_s >= limits.body_idle_timeout_seconds \
                and self.bytes < limits.body_min_bytes_per_second * self.active_s:
            return self._cut_body(f"body arriving at {self.bytes / self.active_s:.0f} B/s, under body_min_bytes_per_second "
                             f"({limits.body_min_bytes_per_second})")
        self.tick_timer = self.loop.call_later(TICK_S, self._tick)

    def _cut_body(self, why: str) -> None:
        self.body_cut = why  # (its route answers 408, not the 499 of a client that went away)
        self._cut(why)

    def _cut(self, why: str) -> None:
        self.header_timer = None
        self.stop()
        transport = self.protocol.transport
        if transport is not None and not transport.is_closing():
            client = self.protocol.client
            log.info("closing the connection of %s: %s", f"{client[0]}:{client[1]}" if client else "a client", why)
            transport.close()


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def coding_error(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, str] | None:
    """(status, reason) for a request whose body has a coding this server does not decode: a
    transfer coding other than chunked (501, RFC 9112 6.1), or, with a body, a content coding
    other than identity (415, RFC 9110 15.5.16); else None. Names lowercased."""
    has_body = _body_length(headers) != 0
    for name, value in headers:
        if name not in (b"transfer-encoding", b"content-encoding"):
            continue
        codings = [c.strip().lower() for c in value.split(b",")]
        if name == b"transfer-encoding" and any(c != b"chunked" for c in codings):
            return (b"501 Not Implemented", f"Transfer-Encoding {value.decode('latin-1')!r:.80}: this server decodes "
                                            "no transfer coding but chunked")
        if name == b"content-encoding" and has_body and any(c not in (b"identity", b"") for c in codings):
            return (b"415 Unsupported Media Type", f"Content-Encoding {value.decode('latin-1')!r:.80}: bodies are "
                                                   "taken as they come; send them unencoded")
    return None


def _body_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length of a request (names lowercased), or None when it is chunked or unreadable."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
    return length if length is not None else 0


def _unexpected(impl: Any) -> str | None:
    """None when every method and attribute of uvicorn's that this module replaces or relies
    on still reads as it did in the releases it was tested with; else what differs."""
    proto, cycle = getattr(impl, "HttpToolsProtocol", None), getattr(impl, "RequestResponseCycle", None)
    if proto is None or cycle is None:
        return "uvicorn's httptools protocol classes are gone"
    needed = {
        (proto, "__init__"): ("self.parser = httptools.HttpRequestParser(self)", "self.loop =", "self.cycle",
                              "self.transport", "self.flow", "self.client", "self.headers"),
        (proto, "connection_made"): ("self.transport = transport", "self.flow = FlowControl(transport)"),
        (proto, "connection_lost"): ("self.cycle.disconnected = True", "self.cycle.message_event.set()"),
        (proto, "on_message_begin"): ("self.headers = []",),
        (proto, "on_header"): ("self.headers.append(",),
        (proto, "on_headers_complete"): ("self.cycle = RequestResponseCycle(",),
        (proto, "on_body"): ("self.cycle.body += body", "pause_reading", "self._should_upgrade()"),
        (proto, "on_message_complete"): ("self.cycle.more_body = False",),
        (proto, "eof_received"): (),
        (proto, "data_received"): ("self._unset_keepalive_if_required()", "self.parser.feed_data(data)",
                                   "except httptools.HttpParserUpgrade:", "self._unsupported_upgrade_warning()"),
        (proto, "_unsupported_upgrade_warning"): (),
        (proto, "_unset_keepalive_if_required"): ("self.timeout_keep_alive_task.cancel()",),
        (proto, "on_response_complete"): ("if self.pipeline:", "self.timeout_keep_alive_task = self.loop.call_later(",
                                          "self.timeout_keep_alive_handler", "self.server_state.total_requests += 1",
                                          "cycle, app = self.pipeline.pop()", "self._start_asgi_task(cycle, app)"),
        (proto, "pause_writing"): (),
        (proto, "resume_writing"): (),
        (cycle, "__init__"): ("self.disconnected", "self.response_complete", "self.more_body", "self.message_event",
                              "self.waiting_for_100_continue", "self.transport", "self.flow", "self.scope",
                              "self.response_started", "self.keep_alive"),
        (cycle, "receive"): ("bytes(self.body)", "resume_reading", "waiting_for_100_continue"),
        (cycle, "send"): ("self.waiting_for_100_continue = False", "if not self.keep_alive:"),
    }
    try:
        from uvicorn.protocols.http.flow_control import FlowControl

        flow = inspect.getsource(FlowControl)
        for cls_, name in needed:
            text = inspect.getsource(getattr(cls_, name))
            for expected in needed[(cls_, name)]:
                if expected not in text:
                    return f"uvicorn's {cls_.__name__}.{name} no longer has {expected!r}"
    except (OSError, TypeError, AttributeError, ImportError) as exc:
        return f"cannot read uvicorn's source: {exc}"
    if "self.read_paused" not in flow:
        return "uvicorn's FlowControl has no read_paused"
    return None
