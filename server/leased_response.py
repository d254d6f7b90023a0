"""A streamed response that holds leases on the memory it sends, until it is sent.

A route that streams stored frames without copying them hands the event loop views of
CPU-tier slots. The slots must not be reused while those bytes may still be read, so the
route keeps a ``Lease`` per frame in ``leases`` (appended as each frame is fetched, also
by worker threads) and ``LeasedStreamingResponse`` releases them all once the response is
over: sent whole, cut short by an error, or abandoned by a client that went away. The body
generator is closed first (its ``finally`` runs, shielded from cancellation), so a fetch it
still had in flight lands in ``leases`` before they are released.

After the last ``send`` returns, the event loop's transport may still hold the bytes it has
not written yet: uvloop keeps a view of them (not a copy), up to the transport's high-water
mark (64 KiB by default) beyond what the socket took. So the last ``TAIL_COPY`` bytes of a
response are sent from a copy (``copied_tail``), whichever frames they are of (frames smaller
than the high-water mark leave views of the frames before the last): when the response ends,
no view of a leased slot is left with the transport.

A response of many frames releases each frame's lease as soon as the transport has sent past
its bytes (``SentLeases``), not when the response is over: held to the end, a client reading
a long prefix slowly (above ``body_min_bytes_per_second``, so never cut off) would hold every
frame fetched so far, and the slots evicted under it could not be reused, shrinking the tier
for everyone. It holds what the transport and the look-ahead hold: a frame or two, or its
high-water mark's worth of small ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse

from cacheseek.store.lease import Lease, release_all

from .protocol import CUT_SHORT, UNSENT

log = logging.getLogger("cacheseek.server")

# Bytes at the end of a response sent from a copy: more than the transport buffers past
# the last send (its high-water mark, 64 KiB by default in asyncio and uvloop).
TAIL_COPY = 256 << 10
DRAIN_POLL_S = 0.01  # how often a response about to be cut short looks whether its leased bytes are out


class ResponseCut(RuntimeError):
    """Raised by a body to end its response short on purpose, a documented outcome (a frame
    evicted while its chain streams): the connection is closed, and no bug is logged.
    ``abort``: dropped with what the transport still holds (views of leased memory the
    client would not take), not closed after sending it."""

    def __init__(self, message: str, *, abort: bool = False) -> None:
        super().__init__(message)
        self.abort = abort


class LeasedStreamingResponse(StreamingResponse):
    """``StreamingResponse`` over ``content`` that releases ``leases`` when it is over.
    ``leases`` is the route's list: it may still grow while the body is sent."""

    def __init__(self, content: AsyncIterator[Any], *, leases: list[Lease | None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.leases = leases

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ResponseCut as exc:
            cut = scope.get("extensions", {}).get(CUT_SHORT)
            if cut is None:
                raise  # uvicorn's own protocol (the fast path is off): it closes the connection, logging
            log.info("%s %s: response cut short: %s", scope.get("method"), scope.get("path"), exc)
            cut(abort=exc.abort)
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()  # the body's own finally: fetches in flight land in ``leases``
            release_all(self.leases)


class SentLeases:
    """The leases of a response's frames, each released once the transport has sent past the
    frame's bytes. The body counts what it hands to ``send`` (``wrote``), names each frame's
    lease with the body offset where its last view ends (``hold``), and calls ``release_sent``
    whenever it resumes (each ``send`` returns once its bytes are written to the transport).
    The transport holds the last ``unsent()`` bytes written to the connection, so every body
    byte before ``written - unsent()`` is out; a lease over bytes before that mark is done with.

    Without the protocol's ``UNSENT`` (uvicorn's own protocol: the fast path off) there is no
    such mark: ``views`` is False, and the body sends copies and releases each lease at once."""

    __slots__ = ("unsent", "written", "held")

    def __init__(self, scope: Any) -> None:
        self.unsent: Callable[[], int] | None = scope.get("extensions", {}).get(UNSENT)
        self.written = 0  # body bytes handed to send
        self.held: deque[tuple[int, Any]] = deque()  # (body offset its bytes end at, lease), in order

    @property
    def views(self) -> bool:
        """Whether the body may send views of leased memory (else copies)."""
        return self.unsent is not None

    def wrote(self, chunk: Any) -> Any:
        self.written += memoryview(chunk).nbytes
        return chunk

    def hold(self, lease: Any) -> None:
        """``lease`` covers bytes the body has handed to ``send`` (all before ``written``)."""
        if lease is not None and not lease.released:
            self.held.append((self.written, lease))

    def sent(self) -> int:
        """Body bytes the transport has sent on (a lower bound: it also holds the headers)."""
        return self.written - self.unsent()  # type: ignore[misc]

    def release_sent(self) -> None:
        if not self.held:
            return
        sent = self.sent()
        while self.held and self.held[0][0] <= sent:
            lease = self.held.popleft()[1]
            if not lease.released:
                lease.release()

    async def drained(self, idle_s: float) -> bool:
        """Wait until every held lease's bytes are out (or the connection is gone, its buffer
        dropped), before a response closes its connection on purpose: a close sends what the
        transport still holds after the leases are released. False once ``idle_s`` passed
        with no byte of them sent: the connection must then be aborted, not closed. (The
        protocol's send limits watch only a transport past its high-water mark; the last
        frame may have left less than that, and a client that read no more held this wait,
        and the leases, for good.)"""
        loop = asyncio.get_running_loop()
        mark, since = -1, loop.time()
        while True:
            self.release_sent()
            if not self.held:
                return True
            sent = self.sent()
            if sent > mark:
                mark, since = sent, loop.time()
            elif loop.time() - since >= idle_s:
                return False
            await asyncio.sleep(DRAIN_POLL_S)


def copied_tail(segment: Any, after: int = 0) -> list[Any]:
    """A segment of a response followed by ``after`` bytes more, as [view of its head, copy
    of its bytes among the response's last ``TAIL_COPY``] (the view alone when none is)."""
    view = memoryview(segment).cast("B")
    cut = view.nbytes + after - TAIL_COPY
    if cut >= view.nbytes:
        return [view]
    if cut <= 0:
        return [bytes(view)]
    return [view[:cut], bytes(view[cut:])]


__all__ = ["LeasedStreamingResponse", "ResponseCut", "SentLeases", "TAIL_COPY", "copied_tail"]
