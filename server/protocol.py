"""A leaner request-body path for uvicorn's httptools protocol.

uvicorn appends every body piece to a bytearray, hands the app ``bytes(that)`` (a second
copy), and stops reading once 64 KiB wait unread, resuming when the app asks for more. For
10 MB frames that is two extra passes over every byte and a pause and wake-up per 64 KiB,
which on a busy host made a bare uvicorn app that discards bodies slower than
``redis-server`` taking the same bytes. Here the pieces are kept as they arrive and given to
the app one by one as they are (never copied or joined), and reading pauses only past
``high_water`` bytes waiting.

Even so, each byte of a body is copied three times before the app sees it (the event loop's
read buffer into a ``bytes``, httptools into another ``bytes``, the app into its buffer).
So the app may also ask for the body to be written straight into memory it names: the
ASGI scope's extension ``BODY_INTO`` is ``async receive_into(view, on_data=None) -> int``,
which fills ``view`` with the next body bytes (fewer only where the body ends or the client
goes), calling ``on_data(piece)`` with each piece of ``view`` as soon as it is filled (to
hash it while it is in cache, say).
Once the bytes already parsed are used up, the connection is switched to a buffered protocol
(``asyncio.BufferedProtocol``, which uvloop and asyncio both serve with ``recv_into``) that
reads the rest of the body into ``view`` directly: one copy, by the kernel, as
``redis-server`` does. httptools never sees those bytes, so when the body is done its parser
is replaced by a fresh one for the next request. This needs the body's length up front
(Content-Length); a chunked body goes through the pieces.

This overrides methods of uvicorn's classes; ``protocol_class()`` checks that they look as
expected and otherwise returns None, and the server falls back to plain ``httptools``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

HIGH_WATER = 1 << 20
SCRATCH = 256 << 10  # read size when the app wants pieces of a body the protocol has taken over
BODY_INTO = "cacheseek.body_into"  # key in scope["extensions"]


def protocol_class(high_water: int = HIGH_WATER) -> type | None:
    try:
        import httptools
        from uvicorn.protocols.http import httptools_impl as impl
    except ImportError:  # no httptools
        return None
    cycle_cls = getattr(impl, "RequestResponseCycle", None)
    proto_cls = getattr(impl, "HttpToolsProtocol", None)
    if cycle_cls is None or proto_cls is None or not _looks_as_expected(impl):
        return None

    class PiecesCycle(cycle_cls):  # type: ignore[misc, valid-type]
        pieces: deque[Any]
        waiting: int
        protocol: Any
        body_length: int | None  # from Content-Length; None when chunked or unreadable
        seen: int  # body bytes the parser has given
        reader: BodyTakeover | None

        async def receive(self) -> Any:
            self._continue()
            if not self.pieces and not self.disconnected and not self.response_complete:
                self.flow.resume_reading()
                await self.message_event.wait()
                self.message_event.clear()
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            body = self.pieces.popleft() if self.pieces else b""
            self.waiting -= len(body)
            if self.waiting <= high_water:
                self.flow.resume_reading()
            return {"type": "http.request", "body": body, "more_body": bool(self.pieces) or self.more_body}

        async def receive_into(self, view: Any, on_data: Callable[[memoryview], None] | None = None) -> int:
            """Fill ``view`` with the next body bytes; fewer only where the body ends or the
            client goes. The ``BODY_INTO`` extension."""
            self._continue()
            view = memoryview(view).cast("B")
            total, filled = view.nbytes, 0
            while filled < total:
                if self.pieces:
                    n = self._take_piece(view[filled:])
                    if on_data is not None:
                        on_data(view[filled : filled + n])
                    filled += n
                    continue
                if self.disconnected or self.response_complete or not self.more_body:
                    break
                reader = self.reader or self._take_over()
                if reader is None:  # length unknown: wait for pieces
                    self.flow.resume_reading()
                    await self.message_event.wait()
                    self.message_event.clear()
                    continue
                filled += await reader.read_into(view[filled : filled + min(total - filled, reader.left)], on_data)
            return filled

        def _continue(self) -> None:
            if self.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False

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
            self.reader = BodyTakeover(self.protocol, self, self.body_length - self.seen, high_water)
            self.transport.set_protocol(self.reader)
            return self.reader

    class PiecesProtocol(proto_cls):  # type: ignore[misc, valid-type]
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = getattr(self, "cycle", None)
            if cycle is not None and type(cycle) is cycle_cls:
                cycle.__class__ = PiecesCycle
                cycle.pieces = deque()
                cycle.waiting = 0
                cycle.protocol = self
                cycle.body_length = _body_length(self.headers)
                cycle.seen = 0
                cycle.reader = None
                cycle.scope.setdefault("extensions", {})[BODY_INTO] = cycle.receive_into

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if not isinstance(cycle, PiecesCycle):
                return super().on_body(body)
            cycle.seen += len(body)
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return None
            cycle.pieces.append(body)
            cycle.waiting += len(body)
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


class BodyTakeover(asyncio.BufferedProtocol):
    """The connection's protocol while the rest of one request body is read: bytes go by
    ``recv_into`` straight into the view the app named, or, when the app asked for pieces
    (or has answered already), into a scratch buffer. It never offers room past the body, so
    the next request's bytes stay in the socket for the HTTP protocol, which it puts back
    (with a fresh parser) when the body is done."""

    def __init__(self, protocol: Any, cycle: Any, left: int, high_water: int) -> None:
        self.protocol = protocol
        self.cycle = cycle
        self.left = left
        self.high_water = high_water
        self.target: memoryview | None = None
        self.on_data: Callable[[memoryview], None] | None = None
        self.filled = 0
        self.scratch: bytearray | None = None

    async def read_into(self, target: memoryview, on_data: Callable[[memoryview], None] | None = None) -> int:
        """Fill ``target`` (at most ``left`` bytes) from the socket, calling ``on_data`` with
        each piece received; fewer bytes if the client goes."""
        cycle = self.cycle
        self.target, self.on_data, self.filled = target, on_data, 0
        self.protocol.flow.resume_reading()
        try:
            while self.target is not None and not cycle.disconnected and not cycle.response_complete:
                await cycle.message_event.wait()
                cycle.message_event.clear()
        finally:
            self.target = self.on_data = None  # never written into after this returns
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
            piece = bytes(memoryview(self.scratch)[:nbytes])
            cycle.pieces.append(piece)
            cycle.waiting += nbytes
            if cycle.waiting > self.high_water:
                self.protocol.flow.pause_reading()
            cycle.message_event.set()
        if self.left == 0:
            self._finish()

    def _finish(self) -> None:
        protocol, cycle = self.protocol, self.cycle
        cycle.reader = None
        cycle.more_body = False
        protocol.fresh_parser()
        protocol.transport.set_protocol(protocol)
        cycle.message_event.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.protocol.eof_received()

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()


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


def _looks_as_expected(impl: Any) -> bool:
    """The methods replaced or relied on here still do what they did in the uvicorn this was
    written for."""
    try:
        on_body = inspect.getsource(impl.HttpToolsProtocol.on_body)
        receive = inspect.getsource(impl.RequestResponseCycle.receive)
        init = inspect.getsource(impl.HttpToolsProtocol.__init__)
        complete = inspect.getsource(impl.HttpToolsProtocol.on_message_complete)
        headers = inspect.getsource(impl.HttpToolsProtocol.on_headers_complete)
    except (OSError, TypeError, AttributeError):
        return False
    return ("self.cycle.body += body" in on_body and "pause_reading" in on_body
            and "bytes(self.body)" in receive and "resume_reading" in receive
            and "self.parser = httptools.HttpRequestParser(self)" in init
            and "self.cycle.more_body = False" in complete
            and "self.cycle = RequestResponseCycle(" in headers)
