"""Typed dependencies of the routes: the service, the caller, the limits, a block hash.

All are `async def`: FastAPI runs a plain `def` dependency in a worker thread, and a thread
hand-off per dependency costs more than everything these do. ``service_of`` and ``caller_of``
do the same work as plain calls, for a route that takes no dependencies (``/v1/lookup``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from cacheseek.errors import InputError
from cacheseek.hashing import BlockHash, from_hex

from .auth import NAMESPACE_HEADER, Authenticator, Caller
from .config import ServerSettings
from .errors import BadRequest, NotReady
from .service import BlockService

def service_of(request: Request) -> BlockService:
    service = getattr(request.app.state, "service", None)
    if service is None or getattr(request.app.state, "closing", False):
        raise NotReady("the store is not open")
    return service


async def get_service(request: Request) -> BlockService:
    return service_of(request)


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


async def scraper(auth: Annotated[Authenticator, Depends(_authenticator)], credentials: Credentials) -> None:
    auth.scraper(credentials.credentials if credentials else None)


def caller_of(request: Request, *, write: bool) -> Caller:
    """What ``reader``/``writer`` give, read from the headers as ``HTTPBearer(auto_error=False)``
    and the namespace ``Header`` read them."""
    authorization = request.headers.get("authorization")
    scheme, credentials = get_authorization_scheme_param(authorization)
    token = credentials if authorization and scheme and credentials and scheme.lower() == "bearer" else None
    return request.app.state.auth.caller(token, request.headers.get(NAMESPACE_HEADER), write=write)


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
Scraper = Annotated[None, Depends(scraper)]
