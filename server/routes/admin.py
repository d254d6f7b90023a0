"""``/v1/admin``: usage per namespace and model, flushes, chain deletes and pins, behind ``admin_token``.

Every route needs ``Authorization: Bearer <admin_token>``: without a token 401, with another
token (a tenant's, the write token) 403, and with no ``admin_token`` configured the routes
are off (403). A refused call changes nothing. Chain and pin routes take the namespace from
``X-CacheSeek-Namespace`` (default ``""``), as the block routes do.
"""

from __future__ import annotations

import email.message
import hashlib
import hmac
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from ..admin import AdminOps
from ..auth import NAMESPACE_HEADER, header_value
from ..config import NAMESPACE_PATTERN
from ..deps import Credentials, Hash, NamespaceHeader, service_of
from ..errors import BadRequest, Forbidden, NotReady, Unauthenticated
from ._body import ERROR, small_body

router = APIRouter(prefix="/v1/admin", tags=["admin"])

REFUSED: dict[int | str, dict[str, Any]] = {401: {"description": "no bearer token", **ERROR},
           403: {"description": "not the admin token, or admin routes are off (no admin_token)", **ERROR}}


async def admin_ops(request: Request, credentials: Credentials) -> AdminOps:
    """The admin operations, for a caller holding the admin token."""
    expected = request.app.state.settings.admin_token
    if expected is None:
        raise Forbidden("admin routes are off: the server has no admin_token")
    if credentials is None or not credentials.credentials:
        raise Unauthenticated("the admin token is required (Authorization: Bearer <admin_token>)")
    given = hashlib.sha256(credentials.credentials.encode()).digest()
    if not hmac.compare_digest(given, hashlib.sha256(expected.get_secret_value().encode()).digest()):
        raise Forbidden("not the admin token")
    service_of(request)  # 503 while starting or stopping
    ops = getattr(request.app.state, "admin", None)
    if ops is None:
        raise NotReady("the store is not open")
    return ops


Admin = Annotated[AdminOps, Depends(admin_ops)]


def _namespace(header: str | None) -> str:
    header = header_value(header)
    if header is not None and not NAMESPACE_PATTERN.match(header):
        raise BadRequest(f"{NAMESPACE_HEADER}: 0-128 printable ASCII characters, no spaces")
    return header or ""


PIN_TTL_MAX_SECONDS = 10 * 365 * 86400  # (1e308 was taken, and its expiry printed in 309 digits)


class PinRequest(BaseModel):
    # strict: a JSON true or "5" is no number of seconds (taken for 1 s and 5 s, a pin lapsed at once)
    model_config = ConfigDict(extra="forbid", strict=True)
    ttl_seconds: float | None = Field(None, gt=0, le=PIN_TTL_MAX_SECONDS,
                                      description="unpinned after this long (at most ten years); null: until unpinned")


PIN_BODY_BYTES = 4096  # {"ttl_seconds": 3600} is 20 bytes
PIN_BODY = {"requestBody": {"required": False, "content": {"application/json": {
    "schema": {"anyOf": [PinRequest.model_json_schema(), {"type": "null"}]}}}}}


def _pin_request(body: bytes, content_type: str | None) -> PinRequest | None:
    """A pin's body as FastAPI would read it for a ``PinRequest | None`` parameter (none, or
    JSON null: no expiry), with its errors. The route reads the body itself: FastAPI reads a
    body parameter whole, unbounded, before the dependency that checks the token."""
    if not body:
        return None
    value: Any = body
    kind = email.message.Message()
    kind["content-type"] = content_type or "application/json"
    if kind.get_content_maintype() == "application" and (
            kind.get_content_subtype() == "json" or kind.get_content_subtype().endswith("+json")):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": exc.msg}}]) from None
        except UnicodeDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.start),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": "not UTF-8"}}]) from None
        except RecursionError:  # ("[" * 1000: a 500 otherwise)
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": "nested too deeply"}}]) from None
    if value is None:
        return None
    if not isinstance(value, dict):  # (pydantic's own message would name the class)
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": None,
                                       "msg": "Input should be a valid dictionary or object to extract fields from"}])
    try:
        return PinRequest.model_validate(value)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


@router.get("/namespaces", responses=REFUSED)
async def namespaces(ops: Admin) -> list[dict]:
    """Every namespace holding blocks (or ever written): blocks, encoded and raw bytes, per model too.
    ``namespace`` null: blocks whose chain could not be traced to a writer."""
    return await run_in_threadpool(ops.namespaces)


@router.get("/models", responses=REFUSED)
async def models(ops: Admin) -> list[dict]:
    """Every model (as clients name it in ``X-CacheSeek-Model``) with its usage, per namespace too."""
    return await run_in_threadpool(ops.models)


UNREACHABLE: dict[int | str, dict[str, Any]] = {503: {"description": "a tier that may hold its blocks (Redis) could not be reached: nothing done "
                                   "for those; retry", **ERROR},
                                                507: {"description": "the disk could not remove (or sync away) a block's "
                                                      "files: it and the rest kept; retry", **ERROR}}


@router.post("/flush", responses={**REFUSED, 404: {"description": "no such namespace or model", **ERROR},
                                  400: {"description": "neither namespace nor model given", **ERROR}, **UNREACHABLE})
async def flush(ops: Admin,
                namespace: Annotated[str | None, Query(description="the namespace to flush ('' is the default one)")] = None,
                model: Annotated[str | None, Query(description="the model to flush (with namespace: only there)")] = None,
                ) -> dict:
    """Delete every block of a namespace, of a model, or of a model within a namespace."""
    if namespace is None and model is None:
        raise BadRequest("flush: give namespace, model, or both")
    return await run_in_threadpool(lambda: ops.flush(namespace=namespace, model=model))


@router.delete("/chains/{hash}", responses={**REFUSED, 404: {"description": "not stored", **ERROR}, **UNREACHABLE})
async def delete_chain(ops: Admin, hash: Hash, namespace: NamespaceHeader = None) -> dict:
    """Delete the chain ending at ``hash``: the block, every block extending it, and the
    ancestors no other stored chain goes through."""
    return await run_in_threadpool(ops.delete_chain, _namespace(namespace), hash)


@router.get("/pins", responses=REFUSED)
async def pins(ops: Admin) -> list[dict]:
    """Every pin: namespace, hash (the chain's last block), blocks, bytes, since and until when."""
    return await run_in_threadpool(ops.pins)


@router.put("/pins/{hash}", openapi_extra=PIN_BODY,
            responses={**REFUSED, 404: {"description": "the chain is not stored whole", **ERROR},
                       413: {"description": f"a body over {PIN_BODY_BYTES} bytes", **ERROR},
                       503: {"description": "a tier that may hold the chain or must keep the pin "
                                            "(Redis) could not be reached: nothing pinned; retry", **ERROR}})
async def pin(ops: Admin, hash: Hash, request: Request, namespace: NamespaceHeader = None) -> dict:
    """Never evict the chain ending at ``hash`` (every block of it, in every tier), until
    unpinned or for ``ttl_seconds``. Pinning a pinned chain again sets its new expiry, and
    its ``pinned_at`` to now."""
    body = _pin_request(await small_body(request, PIN_BODY_BYTES, "a pin's body"),
                        request.headers.get("content-type"))
    ttl = body.ttl_seconds if body is not None else None
    return await run_in_threadpool(lambda: ops.pin(_namespace(namespace), hash, ttl))


@router.delete("/pins/{hash}", responses={**REFUSED, 404: {"description": "no such pin", **ERROR}})
async def unpin(ops: Admin, hash: Hash, namespace: NamespaceHeader = None) -> dict:
    """Give the chain back to eviction."""
    return await run_in_threadpool(ops.unpin, _namespace(namespace), hash)


__all__ = ["router"]
