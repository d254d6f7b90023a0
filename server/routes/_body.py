"""Reading request bodies under a limit, and the OpenAPI descriptions of binary bodies."""

from __future__ import annotations

from fastapi import Request

from ..errors import BadRequest, TooLarge
from cacheseek.wire import BATCH_CONTENT_TYPE, FRAME_CONTENT_TYPE

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


async def read_frame_body(request: Request, limit: int) -> bytearray:
    """The whole body in one buffer (allocated once when the length is declared)."""
    length = declared_length(request, limit, "max_frame_bytes")
    buf = bytearray(length) if length is not None else bytearray()
    filled = 0
    async for chunk in request.stream():
        n = len(chunk)
        if length is None:
            if len(buf) + n > limit:
                raise TooLarge(f"body exceeds max_frame_bytes ({limit})")
            buf += chunk
        else:
            buf[filled : filled + n] = chunk
        filled += n
    if length is not None and filled != length:  # pragma: no cover - the HTTP layer enforces it
        raise BadRequest(f"body ended after {filled} of {length} bytes")
    return buf
