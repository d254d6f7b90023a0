"""``/v1/blocks``: one frame in (PUT), several frames in (POST), one frame out (GET), DELETE."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cacheseek.store.frame import PayloadChecksum
from cacheseek.store.lease import Lease, release_all
from cacheseek.store.tier import Reservation
from cacheseek.batch_body import FRAME_CONTENT_TYPE, LENGTH, BatchFormatError, check_frame_length

from ..config import ServerSettings
from ..deps import Hash, Reader, Service, Settings, Writer
from ..errors import BadFrame, BadRequest, ClientGone
from ..head import is_head
from ..leased_response import LeasedStreamingResponse, copied_tail
from ..limits import FRAME_MIN_BYTES, BodyBudget, BodyBytes
from ..metrics import clean_label, client_headers
from ..service import Incoming
from ._body import BATCH_BODY, BINARY, ERROR, FRAME_BODY, RequestBody, declared_length, receive_frame

router = APIRouter(prefix="/v1/blocks", tags=["blocks"])
# A PUT's frame up to this size is committed into memory in the event loop (its check ~0.1 ms).
INLINE_COMMIT_BYTES = 4 << 20

RESULT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["hash", "status", "durability", "errors"],
    "properties": {"hash": {"type": "string"}, "status": {"type": "string", "enum": ["stored", "present", "failed"]},
                   "durability": {"type": "string", "enum": ["durable", "memory"]},
                   "errors": {"type": "object", "additionalProperties": {"type": "string"},
                              "description": "tier -> why it did not store the block"}}}


def _put_result(status: str) -> dict[str, Any]:
    example = {"hash": "00" * 16, "status": status, "durability": "durable", "errors": {}}
    return {"content": {"application/json": {"schema": RESULT_SCHEMA, "example": example}}}


BATCH_RESULT = {"content": {"application/json": {"schema": {"type": "array", "items": RESULT_SCHEMA}, "example": [
    {"hash": "00" * 16, "status": "stored", "durability": "durable", "errors": {}},
    {"hash": "11" * 16, "status": "present", "durability": "durable", "errors": {}}]}}}
PUT_FAILED = {"content": {"application/json": {"schema": {
    **RESULT_SCHEMA, "required": ["error"],
    "properties": {"error": {"type": "string"}, **RESULT_SCHEMA["properties"]}}}}}


@router.put(
    "/{hash}", status_code=201, openapi_extra=FRAME_BODY,
    responses={200: {"description": "already stored", **_put_result("present")},
               201: {"description": "stored", **_put_result("stored")},
               400: {"description": "malformed or truncated frame, bad hash or header", **ERROR},
               409: {"description": "the frame's header hash is not the URL's", **ERROR},
               413: {"description": "over max_frame_bytes", **ERROR},
               503: {"description": "request bodies in flight are at max_inflight_body_bytes", **ERROR},
               507: {"description": "no tier could store it: the error, and the result as for 200/201 "
                                    "(status failed, errors per tier)", **PUT_FAILED}},
)
async def put_block(caller: Writer, hash: Hash, request: Request, service: Service, settings: Settings) -> JSONResponse:
    """Store one frame under its hash. Nothing is stored unless the frame is whole and valid."""
    length = declared_length(request, settings.max_frame_bytes, "max_frame_bytes")
    model = clean_label(client_headers(request.headers)[0])
    budget: BodyBudget = request.app.state.body_budget
    budget.admit()
    held = BodyBytes(budget)
    # Room in the top tier's reserve, where the frame will live: its pages are touched only
    # as the bytes land. None: no length declared, or the reserve is lent out.
    reservation = service.store.reserve(length) if length else None
    # The payload is hashed piece by piece as it lands, while each piece is in cache.
    checksum = PayloadChecksum()
    try:
        buf = await receive_frame(RequestBody(request), length, settings.max_frame_bytes, held, reservation,
                                  checksum.feed)
        if reservation is None:
            # One hand-off to a worker thread for the check and the store (a copy, evictions, disk I/O).
            report = await run_in_threadpool(partial(service.check_and_put, caller.namespace, buf, hash,
                                                     checksum.digest(), model=model))
        else:
            commit = partial(service.check_and_commit, caller.namespace, reservation, hash, checksum.digest(),
                             model=model)
            # What is left (parse the header, check its stats, publish) takes ~0.1 ms for a
            # frame up to INLINE_COMMIT_BYTES: a thread hand-off costs as much, unless storing
            # does I/O (a disk or Redis tier) or the frame's stats are many (a pass of ~0.1 s
            # a GiB that would hold every other request). (A PUT's room spares no earlier
            # bodies: no walk of the chain here, BlockService.put's ``body``.)
            inline = service.store.in_memory and (length or 0) <= INLINE_COMMIT_BYTES
            report = commit() if inline else await run_in_threadpool(commit)
        held.settle(held.held, stored=report.status == "stored")
    except BadFrame as exc:
        exc.fields.pop("frame", None)  # (a batch's index: a PUT's one frame is the URL's)
        raise
    finally:
        if reservation is not None:
            service.store.abort(reservation)  # nothing, once committed
        held.close()
    service.metrics.ingested(service.metrics.for_request(caller.namespace, request.headers), [report])
    if report.status == "failed":
        # The batch's result for the frame, and the sentence: the reasons were a Python dict's
        # repr inside the sentence, which a client in another language could not read.
        said = "; ".join(f"{tier}: {reason}" for tier, reason in report.errors.items())
        return JSONResponse({"error": "no tier could store the block" + (f": {said}" if said else ""),
                             **report.to_dict()}, status_code=507)
    return JSONResponse(report.to_dict(), status_code=201 if report.status == "stored" else 200)


@router.post(
    "", openapi_extra=BATCH_BODY,
    responses={200: {"description": "one result per frame, in order: status stored, present or failed",
                     **BATCH_RESULT},
               400: {"description": "a malformed or truncated frame, or a body that ends mid-frame", **ERROR},
               413: {"description": "a frame over max_frame_bytes or a body over max_body_bytes", **ERROR},
               503: {"description": "request bodies in flight are at max_inflight_body_bytes", **ERROR}},
)
async def post_blocks(caller: Writer, request: Request, service: Service, settings: Settings) -> JSONResponse:
    """Store a batch of length-prefixed frames, streamed: each frame is received straight
    into the top tier's memory where there is room (else into a buffer of its own), hashed
    as it lands, and checked as soon as it is whole. If any frame is bad, nothing is stored."""
    declared_length(request, settings.max_body_bytes, "max_body_bytes")
    budget: BodyBudget = request.app.state.body_budget
    budget.admit()
    held = BodyBytes(budget)
    body = RequestBody(request)
    frames: list[Incoming] = []
    reservations: list[Reservation] = []
    try:
        while (length := await _next_length(body, len(frames), settings)) is not None:
            where = f"frame {len(frames)}"
            if length < FRAME_MIN_BYTES:  # (given back with the request's other bytes)
                held.take(FRAME_MIN_BYTES - length)
            checksum = PayloadChecksum()
            reservation = service.store.reserve(length)
            if reservation is not None:
                reservations.append(reservation)
            try:
                buf = await receive_frame(body, length, length, held, reservation, checksum.feed)
            except BadRequest as exc:
                if isinstance(exc, ClientGone):
                    raise
                raise BatchFormatError(f"{where}: {exc}", frame=len(frames)) from None
            # With the checksum computed as the frame arrived, what is left of the check
            # (~0.1 ms, no I/O) costs less here than a hand-off to a worker thread.
            try:
                if reservation is not None:
                    frames.append(service.check_client_reserved(reservation, where=where,
                                                                payload_digest=checksum.digest(), values=False))
                else:
                    frames.append(service.check_client_frame(buf, where=where, payload_digest=checksum.digest(),
                                                             values=False))
            except BadFrame as exc:
                exc.fields["frame"] = len(frames)
                raise
            del buf
        model = clean_label(client_headers(request.headers)[0])
        reports = await run_in_threadpool(partial(service.put, caller.namespace, frames, model=model,
                                                  check_values=True))
        stored = sum(frame.meta.nbytes for frame, report in zip(frames, reports) if report.status == "stored")
        held.settle(stored, stored=True)
    finally:
        for reservation in reservations:
            service.store.abort(reservation)  # nothing, once committed
        held.close()
    service.metrics.ingested(service.metrics.for_request(caller.namespace, request.headers), reports)
    return JSONResponse([r.to_dict() for r in reports])


async def _next_length(body: RequestBody, index: int, settings: ServerSettings) -> int | None:
    """The length prefix of frame ``index``, checked against the limits; None at the end of the body."""
    head = bytearray(LENGTH.size)
    filled = await body.read_into(head)
    if filled == 0 and not body.gone:
        return None
    if filled < LENGTH.size:
        if body.gone:
            raise body.gone_error(f"inside the length prefix of frame {index}")
        raise BatchFormatError(f"frame {index}: body ended inside a length prefix", frame=index)
    (length,) = LENGTH.unpack(head)
    check_frame_length(index, length, body.received, max_frame_bytes=settings.max_frame_bytes,
                       max_body_bytes=settings.max_body_bytes)
    return length


@router.get(
    "/{hash}", response_class=Response,
    responses={200: {"description": "the frame", "content": {FRAME_CONTENT_TYPE: BINARY}},
               404: {"description": "not stored", **ERROR}},
)
async def get_block(caller: Reader, hash: Hash, request: Request, service: Service) -> Response:
    """The frame of one block, from the fastest tier holding it (the payload is not copied,
    but for its last ``TAIL_COPY`` bytes; its slot is leased until the response is over)."""
    if is_head(request):  # the frame's length and tier, from the index: no frame fetched, leased or counted
        if service.store.indexes_in_memory:
            nbytes, tier = service.head(caller.namespace, hash)
        else:
            nbytes, tier = await run_in_threadpool(service.head, caller.namespace, hash)
        return Response(media_type=FRAME_CONTENT_TYPE, headers={"content-length": str(nbytes), "x-cacheseek-tier": tier})
    leases: list[Lease | None] = []  # released by the response, or here if there is none
    try:
        got = service.get_nowait(caller.namespace, hash, leases)  # in host memory: no I/O, no thread hand-off
        if got is None:
            # (it may come up from Redis, written by another replica: owned by these names)
            service.owners.heard(caller.namespace, clean_label(client_headers(request.headers)[0]))
            got = await run_in_threadpool(service.get, caller.namespace, hash, leases)
    except BaseException:
        release_all(leases)
        raise
    segments, tier = got
    nbytes = sum(memoryview(s).nbytes for s in segments)
    segments = [*segments[:-1], *copied_tail(segments[-1])]
    metrics = service.metrics
    metrics.frame_bytes_sent += nbytes
    traffic = metrics.for_request(caller.namespace, request.headers)
    if traffic is not None:
        traffic.materialize_requests += 1
        traffic.materialize_blocks += 1
        traffic.materialize_bytes += nbytes

    async def body():
        for segment in segments:
            yield segment
        # A read is a use, as a prefix's is: no tier's read marks it (the reads of a chain are
        # marked together, head last), so a block read one by one, however often, was its
        # tier's first victim, and its Redis copy expired at its TTL.
        if service.store.indexes_in_memory:
            service.touch_block(caller.namespace, hash)
        else:
            await run_in_threadpool(service.touch_block, caller.namespace, hash)  # a Redis round trip

    return LeasedStreamingResponse(body(), leases=leases, media_type=FRAME_CONTENT_TYPE,
                                   headers={"content-length": str(nbytes), "x-cacheseek-tier": tier})


@router.delete("/{hash}", status_code=204, response_class=Response,
               responses={204: {"description": "deleted"}, 404: {"description": "not stored", **ERROR},
                          503: {"description": "a tier that may hold it (Redis) could not be reached: retry", **ERROR},
                          507: {"description": "the disk could not remove (or sync away) its files: kept, or not "
                                "durably gone; retry", **ERROR}})
async def delete_block(caller: Writer, hash: Hash, service: Service) -> Response:
    await run_in_threadpool(service.delete, caller.namespace, hash)
    return Response(status_code=204)

