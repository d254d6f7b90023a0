"""``GET /v1/prefixes/{hash}``: materialize by prefix hash, the chain's frames streamed in order
(from ``?start=N`` on: an engine holding the chain's head in its own pages needs only the rest)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool
import anyio

from cacheseek.batch_body import BATCH_CONTENT_TYPE, LENGTH
from cacheseek.store.lease import Lease

from ..deps import Hash, Reader, Service
from ..errors import BadRequest
from ..head import is_head
from ..leased_response import LeasedStreamingResponse, ResponseCut, SentLeases, copied_tail
from ..metrics import clean_label, client_headers
from ..protocol import BODY_GONE
from ._body import BINARY, ERROR

router = APIRouter(prefix="/v1/prefixes", tags=["prefixes"])

START_HEADER = "x-cacheseek-start"  # the position the answer streams from: a client knows it was honoured
Start = Annotated[str | None, Query(description="the position of the first block to stream (default 0); the whole "
                                                "chain is still checked and touched")]


class ChainBroken(ResponseCut):
    """A block of the chain vanished (evicted, or found corrupt) after the answer began.
    The response is cut short; the client keeps the whole frames before the cut."""


@router.get(
    "/{hash}", response_class=Response,
    responses={200: {"description": "the chain's frames from position start on, each preceded by its length "
                                    "(u64 LE); X-CacheSeek-Blocks says how many, X-CacheSeek-Start from where",
                     "content": {BATCH_CONTENT_TYPE: BINARY}},
               400: {"description": "a start that is not an integer >= 0, or past the chain's last block", **ERROR},
               404: {"description": "the chain ending at hash is not complete", **ERROR}},
)
async def get_prefix(caller: Reader, hash: Hash, request: Request, service: Service,
                     start: Start = None) -> Response:
    """Walk the chain ending at ``hash`` back through the stored parent hashes to position 0,
    then stream its frames from position ``start`` on, head first. A frame is read (from
    disk, say) while the one before it is being sent. A frame's lease is held until the
    transport has sent past its bytes (``SentLeases``: a slow reader holds a few, not the
    chain); the last ``TAIL_COPY`` bytes go from a copy. The whole chain is touched, the
    frames not sent too: the engine uses them, from its own pages."""
    first = _position(start)
    whole = await run_in_threadpool(service.chain, caller.namespace, hash)
    if first >= len(whole):
        raise BadRequest(f"start: {start:.40} is past the chain's last block (position {len(whole) - 1})")
    chain = whole[first:]
    total = service.stream_nbytes(chain)
    headers = {"content-length": str(total), "x-cacheseek-blocks": str(len(chain)), START_HEADER: str(first)}
    if is_head(request):  # the answer's headers, from the index: no frame fetched, counted or touched
        return Response(media_type=BATCH_CONTENT_TYPE, headers=headers)
    namespace = caller.namespace
    # (blocks may come up from Redis, written by another replica: owned by these names)
    service.owners.heard(namespace, clean_label(client_headers(request.headers)[0]))
    metrics = service.metrics
    traffic = metrics.for_request(namespace, request.headers)
    if traffic is not None:
        traffic.materialize_requests += 1

    leases: list[Lease | None] = []  # every frame's fetched; those not released sooner, by the response when it is over
    # The chain, which a frame's promotion from below (disk into memory) must not evict: the
    # next frames are taken one by one, and one held in memory alone would be gone before
    # this read reached it. Made at the first frame read below memory (one from memory alone
    # promotes nothing).
    spare: frozenset[bytes] | None = None

    def stored(key: bytes):
        nonlocal spare
        if spare is None:
            spare = frozenset(k for k, _ in whole)
        got = service.get_stored(key, leases, spare=spare)
        return got[0] if got is not None else None

    def fetch(key: bytes) -> asyncio.Future:
        # A frame in host memory is taken at once; one elsewhere (disk) is read in a worker thread.
        frame = service.get_in_memory(key, leases)
        if frame is not None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(frame)
            return done
        return asyncio.ensure_future(run_in_threadpool(stored, key))

    sent = SentLeases(request.scope)  # each frame's lease released once the transport is past its bytes
    idle_s = request.app.state.settings.body_idle_timeout_seconds
    # A send to a client gone returns at once: woken by the disconnection, the body would run
    # through every frame in memory (fetched, counted as hits and as sent) before the
    # cancellation reached it.
    gone = request.scope.get("extensions", {}).get(BODY_GONE, lambda: False)

    async def body():
        pending = fetch(chain[0][0])
        try:
            for i, (key, info) in enumerate(chain):
                # Shielded: cancelled, the future would not stop its worker thread, which would
                # add the frame's lease to ``leases`` after the response had released them.
                frame = await asyncio.shield(pending)
                if gone():
                    break
                if i + 1 < len(chain):
                    pending = fetch(chain[i + 1][0])
                if frame is None or frame.meta.nbytes != info.nbytes:
                    # The cut closes the connection: what it still sends is no view (or, the
                    # client taking none of it, aborts it with the views).
                    out = await sent.drained(idle_s)
                    raise ChainBroken(f"block at position {info.position} vanished while streaming", abort=not out)
                segments = service.wire_segments(namespace, frame)
                head = memoryview(segments[0])
                offset = frame.meta.payload_offset
                # The length and the header go in one write; the payload goes as a view.
                yield sent.wrote(LENGTH.pack(info.nbytes) + bytes(head[:offset] if len(segments) == 1 else head))
                sent.release_sent()
                payload = head[offset:] if len(segments) == 1 else segments[1]
                if not sent.views:  # no mark of what the transport has sent: a copy, and the slot is free
                    payload = bytes(payload)
                    frame.release()
                payload = memoryview(payload).cast("B")
                for piece in copied_tail(payload, total - sent.written - payload.nbytes):  # the end: a copy
                    yield sent.wrote(piece)
                    sent.release_sent()
                sent.hold(frame.lease)
                metrics.frame_bytes_sent += info.nbytes
                if traffic is not None:
                    traffic.materialize_blocks += 1
                    traffic.materialize_bytes += info.nbytes
        finally:
            # A read in flight is waited for, not cancelled (a worker thread runs it to the
            # end either way): its frame's lease is then in ``leases``, for the response.
            with anyio.CancelScope(shield=True):
                await asyncio.gather(pending, return_exceptions=True)
        keys = [key for key, _ in whole]
        if service.store.indexes_in_memory:
            service.touch_chain(keys)  # index updates only
        else:
            await run_in_threadpool(service.touch_chain, keys)  # a Redis round trip

    return LeasedStreamingResponse(body(), leases=leases, media_type=BATCH_CONTENT_TYPE, headers=headers)


def _position(start: str | None) -> int:
    if start is None:
        return 0
    # Digits only: int() would also take " 3", "+3", "3_0" and other scripts' digits.
    if not (start.isascii() and start.isdigit()):
        raise BadRequest(f"start: {start!r:.40} is not an integer >= 0 (a block position)")
    return int(start) if len(start) < 20 else 1 << 64  # (past any chain; int() refuses 4,300 digits)
