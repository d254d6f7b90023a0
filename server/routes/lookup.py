"""``POST /v1/lookup``: the longest stored prefix of a chain, with the tier of each block."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool

from ..deps import Reader, Service, Settings
from ..errors import BadLookup
from ._body import ERROR

router = APIRouter(prefix="/v1", tags=["lookup"])

HexHash = Annotated[str, StringConstraints(min_length=32, max_length=64)]
_LOWER_HEX = re.compile(r"[0-9a-f]*")


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hashes: list[HexHash] = Field(description="block hashes in chain order, lowercase hex, all 32 or all 64 digits")
    each: bool = Field(False, description="also answer, for every hash, whether it is stored at all")


class LookupResponse(BaseModel):
    matched: int = Field(description="blocks of the longest stored prefix")
    tiers: list[str] = Field(description="the fastest tier holding each of those blocks")
    present: list[bool] | None = Field(None, description="with each=true: whether each hash is stored")


@router.post("/lookup", responses={200: {"model": LookupResponse}, 422: {"description": "bad body", **ERROR}})
async def lookup(caller: Reader, body: LookupRequest, service: Service, settings: Settings) -> JSONResponse:
    if len(body.hashes) > settings.max_lookup_hashes:
        raise BadLookup(f"hashes: {len(body.hashes)} given, at most {settings.max_lookup_hashes}")
    hashes = _parse_hashes(body.hashes)
    if service.store.indexes_in_memory:
        # In the event loop, not a worker thread: a lookup reads only the tiers' in-memory indexes
        # (microseconds for hundreds of hashes), and a thread hand-off would cost more than that.
        return JSONResponse(service.lookup(caller.namespace, hashes, body.each))
    # A networked tier (Redis) answers in a round trip, or a timeout: never block the loop on it.
    return JSONResponse(await run_in_threadpool(service.lookup, caller.namespace, hashes, body.each))


def _parse_hashes(hexes: list[str]) -> list[bytes]:
    """All of one size, 32 or 64 lowercase hex digits (checked in one pass over the text)."""
    sizes = {len(h) for h in hexes}
    if not sizes <= {32, 64}:
        raise BadLookup("hashes: each is 32 or 64 hex digits")
    if len(sizes) > 1:
        raise BadLookup("hashes: all of one size (32 or 64 hex digits)")
    if not _LOWER_HEX.fullmatch("".join(hexes)):
        bad = next(i for i, h in enumerate(hexes) if not _LOWER_HEX.fullmatch(h))
        raise BadLookup(f"hashes.{bad}: not lowercase hex")
    return [bytes.fromhex(h) for h in hexes]
