"""Reading request bodies under a limit, and the OpenAPI descriptions of binary bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request

from cacheseek.batch_body import BATCH_CONTENT_TYPE, FRAME_CONTENT_TYPE

from ..errors import BadRequest, TooLarge
from ..protocol import BODY_INTO

BINARY = {"schema": {"type": "string", "format": "binary"}}
FRAME_BODY = {"requestBody": {"required": True, "content": {FRAME_CONTENT_TYPE: BINARY},
                              "description": "one block frame"}}
BATCH_BODY = {"requestBody": {"required": True, "content": {BATCH_CONTENT_TYPE: BINARY, FRAME_CONTENT_TYPE: BINARY},
                              "description": "frames, each preceded by its length as a u64 little-endian"}}
ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}}}}}}


def declared_length(request: Request, limit: int, what: str) -> int | None:
    """The Content-Length, checked against ``limit`` before a byte of the body is read."""
    header = request.headers.get("content-length")
    if header is None:
        return None
    try:
        length = int(header)
    except ValueError:
        raise BadRequest(f"Content-Length {header!r:.40} is not a number") from None
    if length > limit:
        raise TooLarge(f"body of {length} bytes exceeds {what} ({limit})")
    return length


class RequestBody:
    """A request body, read into buffers the caller names: straight from the socket where
    the server offers that (``server.protocol.BODY_INTO``: one copy, by the kernel), else
    copied out of the ASGI messages."""

    def __init__(self, request: Request) -> None:
        self._into = request.scope.get("extensions", {}).get(BODY_INTO)
        self._receive = request.receive
        self._rest = memoryview(b"")
        self._more = True
        self.received = 0

    async def read_into(self, buf: Any, on_data: Callable[[memoryview], None] | None = None) -> int:
        """Fill ``buf`` with the next body bytes; fewer only where the body ends (or the client
        goes). ``on_data`` gets each piece of ``buf`` as soon as it is filled."""
        view = memoryview(buf).cast("B")
        if self._into is not None:
            n = await self._into(view, on_data)
        else:
            n = 0
            while n < view.nbytes:
                if not self._rest.nbytes:
                    if not self._more:
                        break
                    message = await self._receive()
                    self._more = message["type"] == "http.request" and message.get("more_body", False)
                    self._rest = memoryview(message.get("body", b"")).cast("B")
                    continue
                k = min(self._rest.nbytes, view.nbytes - n)
                view[n : n + k] = self._rest[:k]
                self._rest = self._rest[k:]
                if on_data is not None:
                    on_data(view[n : n + k])
                n += k
        self.received += n
        return n


async def read_frame_body(request: Request, limit: int,
                          on_data: Callable[[memoryview], None] | None = None) -> bytearray:
    """The whole body in one buffer (allocated once when the length is declared); ``on_data``
    gets each piece as it arrives."""
    length = declared_length(request, limit, "max_frame_bytes")
    if length is not None:
        buf = bytearray(length)
        filled = await RequestBody(request).read_into(buf, on_data)
        if filled != length:
            raise BadRequest(f"body ended after {filled} of {length} bytes")
        return buf
    buf = bytearray()
    async for chunk in request.stream():
        if len(buf) + len(chunk) > limit:
            raise TooLarge(f"body exceeds max_frame_bytes ({limit})")
        buf += chunk
        if on_data is not None:
            on_data(memoryview(chunk))
    return buf
