"""``POST /v1/prefetch``: start promoting a chain from disk or Redis into memory, in the background.

A scheduler calls it when a request is queued, with the hashes of the request's prompt; the
server starts reading the chain's stored prefix out of its capacity tiers into its CPU tier
and answers at once (``store.prefetch``). A ``GET /v1/prefixes`` that comes while it runs
waits only for the blocks still on their way. The body is the lookup's (``/v1/lookup``):
JSON ``{"hashes": [hex, ...]}`` or the hashes as raw bytes end to end (``?hash_bytes=32``
for SHA-256), with the same limits, auth (a read token) and namespace.

The answer: 202 when a prefetch started (``blocks`` to promote, ``joined`` of them already
being promoted by another one), 200 when there was nothing to start (``reason``: nothing
stored, already in memory, or the limit of prefetches in flight reached).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from cacheseek.batch_body import FRAME_CONTENT_TYPE

from ..deps import caller_of, service_of
from ..errors import BadLookup
from ..metrics import clean_label, client_headers
from ._body import ERROR, small_body
from .lookup import LOOKUP_BODY, LOOKUP_DOC, _binary_hashes, _json_hashes, binary_only, hashes_limit

router = APIRouter(prefix="/v1", tags=["prefetch"])


class PrefetchResponse(BaseModel):
    started: bool = Field(description="a prefetch was started (or joined) for this chain")
    matched: int = Field(description="blocks of the chain's longest stored prefix")
    blocks: int = Field(description="of those, blocks being promoted into memory")
    joined: int = Field(description="of those, blocks another prefetch was promoting already")
    reason: str | None = Field(None, description="why nothing was started")


PREFETCH_DOC = {**LOOKUP_DOC, "parameters": [p for p in LOOKUP_DOC["parameters"] if p["name"] not in ("each", "chains")]}


@router.post("/prefetch", openapi_extra=PREFETCH_DOC, response_model=None,
             responses={202: {"model": PrefetchResponse, "description": "a prefetch started"},
                        200: {"model": PrefetchResponse, "description": "nothing to start (see reason)"},
                        413: {"description": "a body longer than max_lookup_hashes hashes can be", **ERROR},
                        422: {"description": "bad body", **ERROR}})
async def prefetch(request: Request) -> JSONResponse:
    """Start promoting the stored prefix of the chain ``hashes`` into memory; answers at once."""
    caller = caller_of(request, write=False)
    service = service_of(request)
    limit = request.app.state.settings.max_lookup_hashes
    body = await small_body(request, 72 * limit + 1024, LOOKUP_BODY, hashes_limit(limit))  # as the lookup: a body no larger than its hashes
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() == FRAME_CONTENT_TYPE:
        hashes, _, lengths = _binary_hashes(body, request, limit)
    else:
        binary_only(request)
        hashes, _, lengths = _json_hashes(body, limit)
    if lengths is not None:
        raise BadLookup("chains: a prefetch promotes one chain (hashes)")
    # (its blocks come up from below, perhaps written by another replica: owned by these names)
    service.owners.heard(caller.namespace, clean_label(client_headers(request.headers)[0]))
    if service.store.indexes_in_memory:
        found = service.prefetch(caller.namespace, hashes)  # a lookup and a hand-off: no I/O here
    else:
        found = await run_in_threadpool(service.prefetch, caller.namespace, hashes)
    return JSONResponse(found, status_code=202 if found["started"] else 200)
