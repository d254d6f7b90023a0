"""Reading request bodies under the limits, and the OpenAPI descriptions of binary bodies.

Memory follows the bytes that arrive, not the ``Content-Length`` a client declares: a frame
is received into a CPU-tier reservation (room the tier lends beyond its budget; the pages
are touched only as bytes land), or into an anonymous mapping of its own (committed page
by page as bytes land, unmapped when dropped), or, without a length (chunked), into pieces
of at most ``PIECE`` bytes allocated as the bytes come. Every byte is counted in the
server's ``BodyBudget`` before it is read, a step (``STEP``, or a piece) at a time, and what a
step did not get is given back: counted once a step had arrived whole, frames still arriving
(every frame under 16 MiB: every real block) were not counted at all, and any number of slow
uploads held memory past ``max_inflight_body_bytes``.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable
from typing import Any

from fastapi import Request

from cacheseek.batch_body import BATCH_CONTENT_TYPE, FRAME_CONTENT_TYPE
from cacheseek.store.tier import Reservation

from ..errors import BadRequest, BodyTooSlow, ClientGone, TooLarge
from ..limits import BodyBytes
from ..protocol import BODY_CUT, BODY_GONE, BODY_INTO

PIECE = 1 << 20  # a buffered body grows by pieces of this size, each allocated once its bytes are due
# Bytes received into a frame's memory per budget check. Each step is counted before it is
# read, so a body holds its step of the budget while its bytes come: it begins at FIRST_STEP
# and doubles up to STEP while the body fills each step within FAST_STEP_S. A step not
# filled by then ends there (what it did not get is given back), and the next is the size of
# what came in that second, at least MIN_STEP. A fast client reaches 16 MiB steps within its
# first 16 MiB; a slow one that keeps above body_min_bytes_per_second holds about a second
# of its bytes, a fast one that slows down the same within a second, and one that stalls
# 64 KiB until it is cut off. At 16 MiB a body from the first byte, 128 slow uploads held the
# default 2 GiB and every other write was refused; judged only at a step's end, a client that
# slowed after a fast start held 16 MiB for as long as it kept above the minimum rate.
STEP = 16 << 20
FIRST_STEP = 64 << 10
MIN_STEP = 64 << 10
FAST_STEP_S = 1.0

BINARY = {"schema": {"type": "string", "format": "binary"}}
FRAME_BODY = {"requestBody": {"required": True, "content": {FRAME_CONTENT_TYPE: BINARY},
                              "description": "one block frame"}}
BATCH_BODY = {"requestBody": {"required": True, "content": {BATCH_CONTENT_TYPE: BINARY, FRAME_CONTENT_TYPE: BINARY},
                              "description": "frames, each preceded by its length as a u64 little-endian"}}
ERROR = {"content": {"application/json": {"schema": {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "string", "description": "why, for people (its wording may change)"},
    "limit": {"type": "string", "description": "the setting the request passed: max_body_bytes, max_frame_bytes, "
                                               "max_lookup_hashes or max_chain_blocks"},
    "limit_value": {"type": "integer", "description": "that setting's value on this server"},
    "frame": {"type": "integer", "description": "POST /v1/blocks: the index of the frame refused, from 0"}}}}}}


def declared_length(request: Request, limit: int, what: str, fields: dict[str, Any] | None = None) -> int | None:
    """The Content-Length, checked against ``limit`` before a byte of the body is read.
    ``fields``: those of the 413 (default: ``what`` is the setting ``limit`` is, named)."""
    header = request.headers.get("content-length")
    if header is None:
        return None
    # The whitespace after a field value is not part of it (RFC 9112, 5): the parser read
    # the number past it, and so does this.
    header = header.rstrip(" \t")
    if not header.isascii() or not header.isdigit():
        raise BadRequest(f"Content-Length {header!r:.40} is not a number")
    # Any number of zeros may lead (the parser reads the number past them), and int() refuses
    # 4,300 digits; what is left past 19 digits is over any limit (and refused by the parser).
    digits = header.lstrip("0")
    length = int(digits or "0") if len(digits) < 20 else 1 << 64
    if length > limit:
        raise TooLarge(f"body of {length} bytes exceeds {what} ({limit})",
                       **(fields if fields is not None else {"limit": what, "limit_value": limit}))
    return length


async def small_body(request: Request, limit: int, what: str, fields: dict[str, Any] | None = None) -> bytes:
    """A small body (a lookup's, a pin's), whole: refused (413) once it passes ``limit``
    bytes, declared or as it arrives. Read by the route, after its caller was checked,
    never by FastAPI before its dependencies (a body parameter is read whole, unbounded,
    before the token is looked at). ``fields``: those of its 413 (the setting it follows from)."""
    length = declared_length(request, limit, what, fields or {})
    budget = request.app.state.body_budget
    if length is not None:
        budget.admit()
    # Counted in the bytes in flight as it arrives, as a frame's body is: many slow small
    # bodies would otherwise hold memory that max_inflight_body_bytes never sees.
    held = BodyBytes(budget)
    try:
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise TooLarge(f"body exceeds {limit} bytes, {what}", **(fields or {}))
            held.take(len(chunk))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        held.settle(held.held, stored=True)  # read whole or refused: not an aborted upload to trim after


class RequestBody:
    """A request body, read into buffers the caller names: straight from the socket where
    the server offers that (``server.protocol.BODY_INTO``: one copy, by the kernel), else
    copied out of the ASGI messages."""

    def __init__(self, request: Request) -> None:
        extensions = request.scope.get("extensions") or {}
        self._into = extensions.get(BODY_INTO)
        self._gone_check = extensions.get(BODY_GONE)
        self._cut_check = extensions.get(BODY_CUT)
        self._receive = request.receive
        self._rest = memoryview(b"")
        self._more = True
        self._gone = False
        self._next: asyncio.Future[Any] | None = None  # a message asked for and not yet taken
        self.received = 0
        self.step = FIRST_STEP  # (see STEP)

    @property
    def gone(self) -> bool:
        """The client went away (or was cut off) before the body ended."""
        return self._gone or (self._gone_check is not None and self._gone_check())

    def gone_error(self, what: str) -> ClientGone:
        """The error for a body that ended at ``what`` because the client went (499), or
        because the server cut it off as too slow (408, with the reason)."""
        why = self._cut_check() if self._cut_check is not None else None
        if why:
            return BodyTooSlow(f"the server cut the client off {what}: {why}")
        return ClientGone(f"the client went away {what}")

    async def read_into(self, buf: Any, on_data: Callable[[memoryview], None] | None = None,
                        deadline: float | None = None) -> int:
        """Fill ``buf`` with the next body bytes; fewer only where the body ends (or the client
        goes), or once the event loop's clock passes ``deadline`` with the body still coming.
        ``on_data`` gets each piece of ``buf`` as soon as it is filled."""
        view = memoryview(buf).cast("B")
        if self._into is not None:
            n = await self._into(view, on_data, deadline)
        else:
            n = 0
            while n < view.nbytes:
                if not self._rest.nbytes:
                    if not self._more:
                        break
                    if self._next is None:
                        self._next = asyncio.ensure_future(self._receive())
                    if deadline is not None and not self._next.done():
                        # Waited for, never cancelled: a message cancelled on its way is lost.
                        await asyncio.wait((self._next,), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
                        if not self._next.done():
                            break
                    message = await self._next
                    self._next = None
                    if message["type"] == "http.disconnect":
                        self._gone, self._more = True, False
                        break
                    self._more = message.get("more_body", False)
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


async def _read_exactly(body: RequestBody, view: memoryview, length: int, held: BodyBytes,
                        on_data: Callable[[memoryview], None]) -> None:
    """Fill ``view[:length]`` from the body a step at a time, each step counted in the budget
    before it is read."""
    loop = asyncio.get_running_loop()
    filled = 0
    while filled < length:
        step = min(body.step, length - filled)
        held.take(step)
        deadline = loop.time() + FAST_STEP_S
        n = await body.read_into(view[filled : filled + step], on_data, deadline)
        filled += n
        if n == step:
            if step == body.step:  # (a frame's short last step tells nothing of the rate)
                body.step = min(step * 2, STEP)
            continue
        held.unread(step - n)
        if body.gone or loop.time() < deadline:
            raise _short(body, filled, length)
        # Not filled within its second: the next step is what came in it (the client's rate).
        body.step = max(MIN_STEP, min(body.step // 2, -(-n // MIN_STEP) * MIN_STEP))


async def receive_frame(body: RequestBody, length: int | None, limit: int, held: BodyBytes,
                        reservation: Reservation | None, on_data: Callable[[memoryview], None]) -> Any:
    """Receive one frame of ``length`` bytes (None: to the end of the body, at most
    ``limit``) into ``reservation`` (returns None) or into a writable buffer of its own
    (returned: an anonymous mmap for a frame over ``PIECE``, else a bytearray).
    Every byte is counted in the budget as it arrives, a step at a time; a body that ends early is
    ``ClientGone`` when its client went away, else a ``BadRequest``."""
    if reservation is not None:
        assert length is not None
        # The reservation is the lease: its view is valid until its commit or abort.
        await _read_exactly(body, reservation.view(), length, held, on_data)
        return None
    if length is not None and length > PIECE:
        # A buffer of its own, mapped for the declared length but committed by the OS page by
        # page as the bytes land (nothing is zero-filled ahead, and a client that stalls costs
        # what it sent); unmapped, so given back to the OS, when the frame is dropped.
        buf = mmap.mmap(-1, length)
        view = memoryview(buf)
        try:
            await _read_exactly(body, view, length, held, on_data)
        finally:
            view.release()
        return buf
    loop = asyncio.get_running_loop()
    pieces: list[bytearray] = []
    total = 0
    while length is None or total < length:
        want = PIECE if length is None else min(PIECE, length - total)
        if length is None and total + want > limit:
            want = limit - total + 1  # one byte past the limit tells an over-long body from one that ends there
        # The byte past the limit (an over-long body's probe) is not taken: with limits that
        # are all one size, it passed the in-flight cap, and every such body was a 503.
        taken = want if length is not None or total + want <= limit else want - 1
        held.take(taken)
        piece = bytearray(want)
        deadline = loop.time() + FAST_STEP_S
        n = await body.read_into(piece, on_data, deadline)
        if n < taken:
            held.unread(taken - n)
        total += n
        if n < want:
            # A copy, not a resize in place: a resize raises BufferError while anything still
            # holds a view of the buffer (a profiler walking objects, a frame kept by a
            # traceback), and a client that went away was answered 500.
            piece = piece[:n]
        if n:
            pieces.append(piece)
        if length is None and total > limit:
            raise TooLarge(f"body exceeds max_frame_bytes ({limit})", limit="max_frame_bytes", limit_value=limit)
        if n < want:
            if not body.gone and loop.time() >= deadline:
                continue  # a slow body holds the piece's count for a second at most
            if length is not None or body.gone:
                raise _short(body, total, length)
            break
    if len(pieces) == 1:
        return pieces[0]
    return bytearray().join(pieces)


def _short(body: RequestBody, filled: int, length: int | None) -> BadRequest:
    of = f" of {length}" if length is not None else ""
    if body.gone:
        return body.gone_error(f"after {filled}{of} bytes of its body")
    return BadRequest(f"body ended after {filled}{of} bytes")
