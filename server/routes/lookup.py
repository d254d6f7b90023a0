"""``POST /v1/lookup``: the longest stored prefix of a chain, with the tier of each block."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ..deps import Reader, Service, Settings
from ..errors import BadLookup
from ._body import ERROR

router = APIRouter(prefix="/v1", tags=["lookup"])

HexHash = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-f]{32}|[0-9a-f]{64})$")]


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hashes: list[HexHash] = Field(description="block hashes in chain order, lowercase hex")
    each: bool = Field(False, description="also answer, for every hash, whether it is stored at all")


class LookupResponse(BaseModel):
    matched: int = Field(description="blocks of the longest stored prefix")
    tiers: list[str] = Field(description="the fastest tier holding each of those blocks")
    present: list[bool] | None = Field(None, description="with each=true: whether each hash is stored")


@router.post("/lookup", responses={200: {"model": LookupResponse}, 422: {"description": "bad body", **ERROR}})
async def lookup(caller: Reader, body: LookupRequest, service: Service, settings: Settings) -> JSONResponse:
    if len(body.hashes) > settings.max_lookup_hashes:
        raise BadLookup(f"hashes: {len(body.hashes)} given, at most {settings.max_lookup_hashes}")
    sizes = {len(h) for h in body.hashes}
    if len(sizes) > 1:
        raise BadLookup("hashes: all of one size (32 or 64 hex digits)")
    hashes = [bytes.fromhex(h) for h in body.hashes]
    # In the event loop, not a worker thread: a lookup reads only the tiers' in-memory indexes
    # (microseconds for hundreds of hashes), and a thread hand-off would cost more than that.
    return JSONResponse(service.lookup(caller.namespace, hashes, body.each))
