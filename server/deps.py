"""Typed dependencies of the routes: the service, the caller, the limits, a block hash.

All are `async def`: FastAPI runs a plain `def` dependency in a worker thread, and a thread
hand-off per dependency costs more than everything these do."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cacheseek.errors import InputError
from cacheseek.hashing import BlockHash, from_hex

from .auth import NAMESPACE_HEADER, Authenticator, Caller
from .config import ServerSettings
from .errors import BadRequest, NotReady
from .service import BlockService

async def get_service(request: Request) -> BlockService:
    service = getattr(request.app.state, "service", None)
    if service is None or getattr(request.app.state, "closing", False):
        raise NotReady("the store is not open")
    return service


async def get_settings(request: Request) -> ServerSettings:
    return request.app.state.settings


async def _authenticator(request: Request) -> Authenticator:
    return request.app.state.auth


bearer = HTTPBearer(auto_error=False, description="read or write token, when the server has tokens")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
NamespaceHeader = Annotated[str | None, Header(
    alias=NAMESPACE_HEADER, description="tenant namespace (default ''); fixed by tenant-bound tokens")]


async def reader(
    auth: Annotated[Authenticator, Depends(_authenticator)],
    credentials: Credentials,
    namespace: NamespaceHeader = None,
) -> Caller:
    return auth.caller(credentials.credentials if credentials else None, namespace, write=False)


async def writer(
    auth: Annotated[Authenticator, Depends(_authenticator)],
    credentials: Credentials,
    namespace: NamespaceHeader = None,
) -> Caller:
    return auth.caller(credentials.credentials if credentials else None, namespace, write=True)


async def block_hash(hash: Annotated[str, Path(description="block hash, 32 or 64 lowercase hex digits")]) -> BlockHash:
    try:
        return from_hex(hash)
    except InputError as exc:
        raise BadRequest(str(exc)) from None


Service = Annotated[BlockService, Depends(get_service)]
Settings = Annotated[ServerSettings, Depends(get_settings)]
Reader = Annotated[Caller, Depends(reader)]
Writer = Annotated[Caller, Depends(writer)]
Hash = Annotated[BlockHash, Depends(block_hash)]
