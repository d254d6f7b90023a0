"""``POST /v1/lookup``: the longest stored prefix of a chain, with the tier of each block.

The body is JSON ``{"hashes": [hex, ...], "each": false}``, or (``Content-Type:
application/octet-stream``) the hashes as raw bytes end to end, which is what ``RemoteCache``
sends: ``?hash_bytes=32`` for SHA-256 hashes (default 16), ``?each=true``.

Several chains in one body (an engine admitting a batch of requests asks for all of them in
one round trip): JSON ``{"chains": [[hex, ...], ...]}``, or the binary body with
``?chains=3,5,2`` (each chain's length, in order; the hashes of all of them end to end).
The answer is ``{"chains": [{"matched", "tiers"}, ...]}``, each chain answered as a lookup of
it alone would be, and counted as one (its tokens: ``X-CacheSeek-Tokens: 300,512,...``).

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
from ..errors import BadLookup
from ..metrics import TOKENS_HEADER, client_headers
from ._body import BINARY, ERROR, small_body

router = APIRouter(prefix="/v1", tags=["lookup"])

HexHash = Annotated[str, StringConstraints(min_length=32, max_length=64)]
HASH_BYTES = (16, 32)
_TRUE, _FALSE = ("true", "1"), ("false", "0", "")
LOOKUP_BODY = "a lookup of max_lookup_hashes hashes"  # what a lookup's body is bounded by, as a 413 says


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "yes" or 1 is not a bool
    hashes: list[HexHash] | None = Field(
        None, description="block hashes in chain order, lowercase hex, all 32 or all 64 digits (this or chains)")
    chains: list[list[HexHash]] | None = Field(
        None, description="several chains, each looked up as hashes is, in one round trip (this or hashes; not "
                          "with each); all their hashes of one size, at most max_lookup_hashes in all")
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


class ChainAnswer(BaseModel):
    matched: int = Field(description="blocks of the chain's longest stored prefix")
    tiers: list[str] = Field(description="the fastest tier holding each of those blocks")


class ChainsResponse(BaseModel):
    chains: list[ChainAnswer] = Field(description="for a lookup of several chains: each one's answer, in order")


LOOKUP_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {
        "application/json": {"schema": LookupRequest.model_json_schema()},
        FRAME_CONTENT_TYPE: BINARY,
    }, "description": "block hashes in chain order: JSON, or raw bytes end to end (application/octet-stream)"},
    "parameters": [
        {"name": "hash_bytes", "in": "query", "required": False,
         "description": "binary body only (with a JSON body, a 422): the size of each hash (16: xxh3-128, 32: "
                        "sha256)",
         "schema": {"type": "integer", "enum": list(HASH_BYTES), "default": 16}},
        {"name": "each", "in": "query", "required": False,
         "description": "binary body only (with a JSON body, a 422): also answer whether each hash is stored at "
                        "all",
         "schema": {"type": "boolean", "default": False}},
        {"name": "chains", "in": "query", "required": False,
         "description": "binary body only (with a JSON body, a 422): the body holds several chains end to end, "
                        "of these lengths (in hashes, comma-separated, in order); answered {\"chains\": [...]}",
         "schema": {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"}},
        {"name": NAMESPACE_HEADER, "in": "header", "required": False,
         "description": "tenant namespace (default ''); fixed by tenant-bound tokens", "schema": {"type": "string"}},
    ],
    "security": [{"HTTPBearer": []}],
}


@router.post("/lookup", openapi_extra=LOOKUP_DOC, response_model=None,
             responses={200: {"model": LookupResponse | ChainsResponse},
                        400: {"description": "a bad namespace header", **ERROR},
                        413: {"description": "a body longer than max_lookup_hashes hashes can be", **ERROR},
                        422: {"description": "a body that is not JSON of this shape, or not a whole number of hashes, "
                                             "a bad hash_bytes, each or chains, too many hashes", **ERROR}})
async def lookup(request: Request) -> JSONResponse:
    """The longest stored prefix of the chain ``hashes`` (or of each of ``chains``), with the
    tier holding each block."""
    caller = caller_of(request, write=False)
    service = service_of(request)
    limit = request.app.state.settings.max_lookup_hashes
    # A lookup body is small: at most max_lookup_hashes hashes of 64 hex digits, JSON-quoted.
    body = await small_body(request, 72 * limit + 1024, LOOKUP_BODY, hashes_limit(limit))
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() == FRAME_CONTENT_TYPE:
        hashes, each, lengths = _binary_hashes(body, request, limit)
    else:
        binary_only(request)
        hashes, each, lengths = _json_hashes(body, limit)
    if lengths is not None:
        return await _lookup_chains(request, caller.namespace, hashes, lengths)
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


async def _lookup_chains(request: Request, namespace: str, hashes: list[bytes], lengths: list[int]) -> JSONResponse:
    """Several chains (``hashes`` cut at ``lengths``), each answered and counted as a lookup of
    it alone: what N lookups would answer, in one round trip."""
    service = service_of(request)
    chains, at = [], 0
    for n in lengths:
        chains.append(hashes[at : at + n])
        at += n

    def look() -> list[dict[str, Any]]:
        return service.lookup_chains(namespace, chains)  # (one Redis round trip for all of them)

    # (as a lookup of one chain: in the loop when the indexes are in memory, else a thread)
    found = look() if service.store.indexes_in_memory else await run_in_threadpool(look)
    metrics = service.metrics
    if metrics.detail:
        traffic = metrics.for_request(namespace, request.headers)
        tokens = _chain_tokens(request.headers.get(TOKENS_HEADER), len(chains))
        for chain, answer, asked in zip(chains, found, tokens):
            metrics.looked_up(traffic, request.headers, len(chain), answer["matched"], False, one_of_chains=True,
                              chain_tokens=asked)
    return JSONResponse({"chains": found})


def _chain_tokens(header: str | None, n: int) -> list[int | None]:
    """Each chain's tokens from ``X-CacheSeek-Tokens: 300,512,...`` (the client's word, for the
    figures only): one whole number per chain, or none known."""
    parts = header.split(",") if header else []
    if len(parts) != n or not all(p.isascii() and p.isdigit() and len(p) <= 12 for p in parts):
        return [None] * n
    return [int(p) or None for p in parts]


class _LabelledRoute(Route):
    """A plain Starlette route that names itself in the scope, as FastAPI's routes do, so
    that metrics label it by its path rather than as unmatched."""

    def matches(self, scope: Any) -> tuple[Match, MutableMapping[str, Any]]:
        match, child = super().matches(scope)
        if match != Match.NONE:
            child["route"] = self
        return match, child


def install(app: FastAPI) -> None:
    """The documented route (``router``), and in front of every route, the served one."""
    app.include_router(router)
    app.router.routes.insert(0, _LabelledRoute("/v1/lookup", lookup, methods=["POST"], include_in_schema=False))


_SPLIT = ": look a longer chain up in pieces, as RemoteCache(max_lookup_hashes=) does"


# What a binary body's query says, and where a JSON body says it instead.
_IN_JSON = {"hash_bytes": "its hashes' size by their digits (32 or 64)", "each": 'each in the body ("each": true)',
            "chains": 'several chains in the body ("chains": [[...], ...])'}


def binary_only(request: Request) -> None:
    """A JSON body's lookup refuses the query parameters that only a binary body reads: they
    were ignored, so ``?chains=`` with a JSON body got one chain's answer (which a client takes
    for an older server's, asking each chain alone from then on), and ``?each=bogus``, a 422 on
    a binary body, was a 200."""
    for name, instead in _IN_JSON.items():
        if name in request.query_params:
            raise BadLookup(f"{name}: a query parameter of a binary body (Content-Type: {FRAME_CONTENT_TYPE}) only; "
                            f"a JSON body gives {instead}")


def _shown(value: str) -> str:
    """A query value in an error, quoted whole, cut to 20 characters."""
    return repr(value if len(value) <= 20 else value[:20] + "...")


def _binary_hashes(body: bytes, request: Request, limit: int) -> tuple[list[bytes], bool, list[int] | None]:
    query = request.query_params
    size = query.get("hash_bytes", "16")
    if size not in ("16", "32"):
        raise BadLookup(f"hash_bytes: {_shown(size)} is not 16 or 32")
    size_n = int(size)
    if len(body) % size_n:
        raise BadLookup(f"body: {len(body)} bytes are not a whole number of {size_n}-byte hashes")
    each = query.get("each", "false").lower()
    if each not in _TRUE + _FALSE:
        raise BadLookup(f"each: {_shown(each)} is not true or false")
    hashes = _split(body, size_n, limit)
    given = query.get("chains")
    return hashes, each in _TRUE, None if given is None else _chain_lengths(given, len(hashes), each in _TRUE, limit)


# Chains in one body, at most (RemoteCache's LOOKUP_CHAINS: it sends no more). Each chain is
# a lookup of its own in the event loop: 65,536 empty chains, a 262 KB body, held every other
# client ~0.5 s.
MAX_CHAINS = 1024


def hashes_limit(limit: int) -> dict[str, Any]:
    """The fields of an answer refused for ``max_lookup_hashes`` (a 413 for the body, a 422 for the hashes)."""
    return {"limit": "max_lookup_hashes", "limit_value": limit}


def _too_many_chains(given: str, limit: int) -> BadLookup:
    return BadLookup(f"chains: {given} given, at most {min(MAX_CHAINS, limit):,} in a body (no more than "
                     f"max_lookup_hashes, and {MAX_CHAINS:,} at most: look more up in several)")


def _chain_lengths(given: str, total: int, each: bool, limit: int) -> list[int]:
    """``?chains=3,5,2``: each chain's length, in hashes; they must add up to the body's."""
    if each:
        raise BadLookup("each: not with chains (a writer asks about one list of blocks)")
    if given.count(",") >= min(MAX_CHAINS, limit):  # (counted before the split: a long query is not made a list)
        raise _too_many_chains(f"{given.count(',') + 1:,}", limit)
    parts = given.split(",")
    lengths = []
    for i, part in enumerate(parts):
        if not (part.isascii() and part.isdigit() and len(part) <= 12):
            raise BadLookup(f"chains[{i}]: {_shown(part)} is not a whole number of hashes")
        lengths.append(int(part))
    if sum(lengths) != total:
        raise BadLookup(f"chains: {len(lengths)} lengths add up to {sum(lengths)} hashes, but the body holds {total}")
    return lengths


def _json_hashes(body: bytes, limit: int) -> tuple[list[bytes], bool, list[int] | None]:
    # Every chain opens a "[", and no hash holds one: more than MAX_CHAINS + 1 of them is too
    # many chains (or not a lookup at all), found before the body is parsed (700,000 empty
    # chains were parsed whole, ~0.6 s, to be refused).
    if body.count(b"[") > min(MAX_CHAINS, limit) + 1:
        raise _too_many_chains(f"more than {min(MAX_CHAINS, limit):,}", limit)
    try:
        parsed = LookupRequest.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    if (parsed.hashes is None) == (parsed.chains is None):
        raise BadLookup("body: give hashes (one chain) or chains (several), not both or neither")
    lengths = None
    if parsed.chains is not None:
        if parsed.each:
            raise BadLookup("each: not with chains (a writer asks about one list of blocks)")
        if len(parsed.chains) > min(MAX_CHAINS, limit):
            raise _too_many_chains(f"{len(parsed.chains):,}", limit)
        lengths = [len(chain) for chain in parsed.chains]
        if sum(lengths) > limit:
            raise BadLookup(f"hashes: {sum(lengths)} given in all chains, at most {limit} (max_lookup_hashes){_SPLIT}",
                            **hashes_limit(limit))
        hexes = [h for chain in parsed.chains for h in chain]
    else:
        hexes = parsed.hashes or []
    sizes = {len(h) for h in hexes}
    if not sizes <= {32, 64}:
        raise BadLookup("hashes: each is 32 or 64 hex digits")
    if len(sizes) > 1:
        raise BadLookup("hashes: all of one size (32 or 64 hex digits)")
    if len(hexes) > limit:
        raise BadLookup(f"hashes: {len(hexes)} given, at most {limit} (max_lookup_hashes){_SPLIT}",
                        **hashes_limit(limit))
    joined = "".join(hexes)
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        raw = b""
    if raw.hex() != joined:  # fromhex also takes upper case and spaces
        bad = next(i for i, h in enumerate(hexes) if h != h.lower() or not _is_hex(h))
        raise BadLookup(f"{_where(bad, lengths)}: not lowercase hex")
    return _split(raw, sizes.pop() // 2 if sizes else 16, limit), parsed.each, lengths


def _where(i: int, lengths: list[int] | None) -> str:
    """How an error names hash ``i`` of the body: ``hashes.3``, or ``chains.1.0``."""
    if lengths is None:
        return f"hashes.{i}"
    for c, n in enumerate(lengths):
        if i < n:
            return f"chains.{c}.{i}"
        i -= n
    return f"hashes.{i}"  # (not reached: i is one of the body's)


def _split(raw: bytes, size: int, limit: int) -> list[bytes]:
    n = len(raw) // size
    if n > limit:
        raise BadLookup(f"hashes: {n} given, at most {limit} (max_lookup_hashes){_SPLIT}", **hashes_limit(limit))
    return list(struct.unpack(f"{size}s" * n, raw))


def _is_hex(h: str) -> bool:
    try:
        return len(bytes.fromhex(h)) * 2 == len(h)
    except ValueError:
        return False
