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
response are sent from a copy (``copied_tail``): when the response ends, no view of a leased
slot is left with the transport.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse

from cacheseek.store.lease import Lease, release_all

from .protocol import CUT_SHORT

log = logging.getLogger("cacheseek.server")

# Bytes at the end of a response sent from a copy: more than the transport buffers past
# the last send (its high-water mark, 64 KiB by default in asyncio and uvloop).
TAIL_COPY = 256 << 10


class ResponseCut(RuntimeError):
    """Raised by a body to end its response short on purpose, a documented outcome (a frame
    evicted while its chain streams): the connection is closed, and no bug is logged."""


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
            cut()
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()  # the body's own finally: fetches in flight land in ``leases``
            release_all(self.leases)


def copied_tail(segment: Any) -> list[Any]:
    """The last segment of a response as [view of its head, copy of its last ``TAIL_COPY`` bytes]."""
    view = memoryview(segment).cast("B")
    if view.nbytes <= TAIL_COPY:
        return [bytes(view)]
    cut = view.nbytes - TAIL_COPY
    return [view[:cut], bytes(view[cut:])]


__all__ = ["LeasedStreamingResponse", "ResponseCut", "TAIL_COPY", "copied_tail"]
