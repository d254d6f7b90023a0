"""``POST /v1/lookup``: the longest stored prefix of a chain, with the tier of each block.

The body is JSON ``{"hashes": [hex, ...], "each": false}``, or (``Content-Type:
application/octet-stream``) the hashes as raw bytes end to end, which is what ``RemoteCache``
sends: ``?hash_bytes=32`` for SHA-256 hashes (default 16), ``?each=true``.

A worker looks up before every request it serves, so this route is kept lean: it takes no
FastAPI dependencies and no request model, and does by hand what they would (the caller as
``deps.reader`` finds it, the body checked as ``LookupRequest`` checks it, with the same
errors). It is served by a plain Starlette route placed before FastAPI's routes (``install``),
which skips FastAPI's routing and request handling too; the same function is also declared
as a FastAPI route, which is never reached, only so that the OpenAPI document describes it.
For 512 hashes this cut the app's time per lookup from about 760 to 160 µs (in process).
"""

from __future__ import annotations

import struct
from collections.abc import MutableMapping
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match, Route

from cacheseek.batch_body import FRAME_CONTENT_TYPE

from ..auth import NAMESPACE_HEADER
from ..deps import caller_of, service_of
from ..errors import BadLookup, TooLarge
from ..limits import BodyBytes
from ..metrics import client_headers
from ._body import BINARY, ERROR, declared_length

router = APIRouter(prefix="/v1", tags=["lookup"])

HexHash = Annotated[str, StringConstraints(min_length=32, max_length=64)]
HASH_BYTES = (16, 32)
_TRUE, _FALSE = ("true", "1"), ("false", "0", "")


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "yes" or 1 is not a bool
    hashes: list[HexHash] = Field(description="block hashes in chain order, lowercase hex, all 32 or all 64 digits")
    each: bool = Field(False, description="also answer, for every hash, whether it is stored at all")


class LookupResponse(BaseModel):
    matched: int = Field(description="blocks of the longest stored prefix")
    tiers: list[str] = Field(description="the fastest tier holding each of those blocks")
    present: list[bool] | None = Field(
        None, description="with each=true: whether each hash is stored as a PUT would answer \"present\": whole and "
                          "committed at the store's acknowledgement level (durable: on disk or in Redis)")
    durability: str | None = Field(None, description="with each=true: the acknowledgement level, durable or memory")
    max_body_bytes: int | None = Field(
        None, description="with each=true: the largest request body this server takes (POST /v1/blocks), so that a "
                          "writer splits its frames under it from its first body on")


LOOKUP_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {
        "application/json": {"schema": LookupRequest.model_json_schema()},
        FRAME_CONTENT_TYPE: BINARY,
    }, "description": "block hashes in chain order: JSON, or raw bytes end to end (application/octet-stream)"},
    "parameters": [
        {"name": "hash_bytes", "in": "query", "required": False,
         "description": "binary body only: the size of each hash (16: xxh3-128, 32: sha256)",
         "schema": {"type": "integer", "enum": list(HASH_BYTES), "default": 16}},
        {"name": "each", "in": "query", "required": False,
         "description": "binary body only: also answer whether each hash is stored at all",
         "schema": {"type": "boolean", "default": False}},
        {"name": NAMESPACE_HEADER, "in": "header", "required": False,
         "description": "tenant namespace (default ''); fixed by tenant-bound tokens", "schema": {"type": "string"}},
    ],
    "security": [{"HTTPBearer": []}],
}


@router.post("/lookup", openapi_extra=LOOKUP_DOC, response_model=None,
             responses={200: {"model": LookupResponse},
                        400: {"description": "a bad namespace header", **ERROR},
                        413: {"description": "a body longer than max_lookup_hashes hashes can be", **ERROR},
                        422: {"description": "a body that is not JSON of this shape, or not a whole number of hashes, "
                                             "a bad hash_bytes or each, too many hashes", **ERROR}})
async def lookup(request: Request) -> JSONResponse:
    """The longest stored prefix of the chain ``hashes``, with the tier holding each block."""
    caller = caller_of(request, write=False)
    service = service_of(request)
    limit = request.app.state.settings.max_lookup_hashes
    # A lookup body is small: at most max_lookup_hashes hashes of 64 hex digits, JSON-quoted.
    body = await _small_body(request, 72 * limit + 1024)
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() == FRAME_CONTENT_TYPE:
        hashes, each = _binary_hashes(body, request, limit)
    else:
        hashes, each = _json_hashes(body, limit)
    if service.store.indexes_in_memory and not each:
        # In the event loop, not a worker thread: a lookup reads only the tiers' in-memory indexes
        # (microseconds for hundreds of hashes), and a thread hand-off would cost more than that.
        found = service.lookup(caller.namespace, hashes, each)
    else:
        # A networked tier (Redis) answers in a round trip, or a timeout: never block the loop on it.
        # Nor ``each`` (a writer's question before it sends): the disk tier looks at the files of
        # the blocks it holds (``DiskTier.present_many``), and a failing disk's stat can hang.
        found = await run_in_threadpool(service.lookup, caller.namespace, hashes, each)
    if each:  # what a writer asks before it sends its new blocks
        found["max_body_bytes"] = request.app.state.settings.max_body_bytes
    metrics = service.metrics
    if metrics.detail:
        first_position = None
        if found["matched"] and client_headers(request.headers)[3] is not None:
            # A piece that says it continues a query: where its first block is stored is checked
            # against where it says it starts (docs/operations.md).
            if service.store.indexes_in_memory:
                first_position = service.position(caller.namespace, hashes[0])
            else:
                first_position = await run_in_threadpool(service.position, caller.namespace, hashes[0])
        metrics.looked_up(metrics.for_request(caller.namespace, request.headers), request.headers, len(hashes),
                          found["matched"], each, first_position)
    return JSONResponse(found)


class _LabelledRoute(Route):
    """A plain Starlette route that names itself in the scope, as FastAPI's routes do, so
    that metrics label it by its path rather than as unmatched."""

    def matches(self, scope: Any) -> tuple[Match, MutableMapping[str, Any]]:
        match, child = super().matches(scope)
        if match != Match.NONE:
            child["route"] = self
        return match, child


async def _small_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it passes ``limit`` bytes, before or while it arrives."""
    length = declared_length(request, limit, "a lookup of max_lookup_hashes hashes")
    budget = request.app.state.body_budget
    if length is not None:
        budget.admit()
    # Counted in the bytes in flight as it arrives, as a frame's body is: many slow lookup
    # bodies would otherwise hold memory that max_inflight_body_bytes never sees.
    held = BodyBytes(budget)
    try:
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise TooLarge(f"body exceeds {limit} bytes, a lookup of max_lookup_hashes hashes")
            held.take(len(chunk))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        held.settle(held.held, stored=True)  # read whole or refused: not an aborted upload to trim after


def install(app: FastAPI) -> None:
    """The documented route (``router``), and in front of every route, the served one."""
    app.include_router(router)
    app.router.routes.insert(0, _LabelledRoute("/v1/lookup", lookup, methods=["POST"], include_in_schema=False))


_SPLIT = ": look a longer chain up in pieces, as RemoteCache(max_lookup_hashes=) does"


def _binary_hashes(body: bytes, request: Request, limit: int) -> tuple[list[bytes], bool]:
    query = request.query_params
    size = query.get("hash_bytes", "16")
    if size not in ("16", "32"):
        raise BadLookup(f"hash_bytes: {size!r:.20} is not 16 or 32")
    size_n = int(size)
    if len(body) % size_n:
        raise BadLookup(f"body: {len(body)} bytes are not a whole number of {size_n}-byte hashes")
    each = query.get("each", "false").lower()
    if each not in _TRUE + _FALSE:
        raise BadLookup(f"each: {each!r:.20} is not true or false")
    return _split(body, size_n, limit), each in _TRUE


def _json_hashes(body: bytes, limit: int) -> tuple[list[bytes], bool]:
    try:
        parsed = LookupRequest.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    hexes = parsed.hashes
    sizes = {len(h) for h in hexes}
    if not sizes <= {32, 64}:
        raise BadLookup("hashes: each is 32 or 64 hex digits")
    if len(sizes) > 1:
        raise BadLookup("hashes: all of one size (32 or 64 hex digits)")
    if len(hexes) > limit:
        raise BadLookup(f"hashes: {len(hexes)} given, at most {limit} (max_lookup_hashes){_SPLIT}")
    joined = "".join(hexes)
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        raw = b""
    if raw.hex() != joined:  # fromhex also takes upper case and spaces
        bad = next(i for i, h in enumerate(hexes) if h != h.lower() or not _is_hex(h))
        raise BadLookup(f"hashes.{bad}: not lowercase hex")
    return _split(raw, sizes.pop() // 2 if sizes else 16, limit), parsed.each


def _split(raw: bytes, size: int, limit: int) -> list[bytes]:
    n = len(raw) // size
    if n > limit:
        raise BadLookup(f"hashes: {n} given, at most {limit} (max_lookup_hashes){_SPLIT}")
    return list(struct.unpack(f"{size}s" * n, raw))


def _is_hex(h: str) -> bool:
    try:
        return len(bytes.fromhex(h)) * 2 == len(h)
    except ValueError:
        return False
