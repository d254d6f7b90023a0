"""A leaner request-body path for uvicorn's httptools protocol.

uvicorn appends every body piece to a bytearray, hands the app ``bytes(that)`` (a second
copy), and stops reading once 64 KiB wait unread, resuming when the app asks for more. For
10 MB frames that is two extra passes over every byte and a pause and wake-up per 64 KiB,
which on a busy host made a bare uvicorn app that discards bodies slower than
``redis-server`` taking the same bytes. Here the pieces are kept as they arrive and given to
the app one by one as they are (never copied or joined), and reading pauses only past
``high_water`` bytes waiting.

This overrides two methods of uvicorn's classes; ``protocol_class()`` checks that they look
as expected and otherwise returns None, and the server falls back to plain ``httptools``.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

HIGH_WATER = 1 << 20


def protocol_class(high_water: int = HIGH_WATER) -> type | None:
    try:
        from uvicorn.protocols.http import httptools_impl as impl
    except ImportError:  # no httptools
        return None
    cycle_cls = getattr(impl, "RequestResponseCycle", None)
    proto_cls = getattr(impl, "HttpToolsProtocol", None)
    if cycle_cls is None or proto_cls is None or not _looks_as_expected(impl):
        return None

    class PiecesCycle(cycle_cls):  # type: ignore[misc, valid-type]
        pieces: deque[bytes]
        waiting: int

        async def receive(self) -> Any:
            if self.waiting_for_100_continue and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False
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

    class PiecesProtocol(proto_cls):  # type: ignore[misc, valid-type]
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = getattr(self, "cycle", None)
            if cycle is not None and type(cycle) is cycle_cls:
                cycle.__class__ = PiecesCycle
                cycle.pieces = deque()
                cycle.waiting = 0

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if not isinstance(cycle, PiecesCycle):
                return super().on_body(body)
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return None
            cycle.pieces.append(body)
            cycle.waiting += len(body)
            if cycle.waiting > high_water:
                self.flow.pause_reading()
            cycle.message_event.set()
            return None

    return PiecesProtocol


def _looks_as_expected(impl: Any) -> bool:
    """The methods replaced here still do what they did in the uvicorn this was written for."""
    try:
        on_body = inspect.getsource(impl.HttpToolsProtocol.on_body)
        receive = inspect.getsource(impl.RequestResponseCycle.receive)
    except (OSError, TypeError, AttributeError):
        return False
    return ("self.cycle.body += body" in on_body and "pause_reading" in on_body
            and "bytes(self.body)" in receive and "resume_reading" in receive)
