"""Domain errors of the service, and the one table that maps every error to an HTTP status.

Routes and the service raise these (or the library's own ``FrameError``/``InputError``/
``StorageError``); nothing else builds an error status. Every error answer is JSON
``{"error": reason}``, with the exception's ``fields`` beside it where it has them. Anything
not in the table is a bug: a 500, logged with its traceback.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from cacheseek.batch_body import BatchFormatError, BatchTooLarge
from cacheseek.errors import FrameError, InputError, StorageError, TierUnavailable
from cacheseek.log_throttle import LogThrottle

from .openapi import ANSWERS_422
from .protocol import BODY_CUT

log = logging.getLogger("cacheseek.server")

BUSY_HEADER = "X-CacheSeek-Busy"  # on a 503 that is back-pressure, not the service starting or stopping


class ServiceError(Exception):
    """An expected failure of a request; ``str(exc)`` is the reason given to the client, and
    ``fields`` (those not None) go beside it in the answer: what a client acts on (a limit's
    name and value, a batch's frame index), so that it need not parse the sentence."""

    def __init__(self, reason: str = "", **fields: Any) -> None:
        super().__init__(reason)
        self.fields = {name: value for name, value in fields.items() if value is not None}


class BadRequest(ServiceError):
    """A malformed hash, namespace or header."""


class BadFrame(BadRequest):
    """A client's frame that is malformed, truncated, fails its checksum, or contradicts its chain."""


class BadLookup(ServiceError):
    """A lookup body that is valid JSON of the wrong shape (beyond what its model checks)."""


class HashMismatch(ServiceError):
    """The frame's header names another block than the URL."""


class TooLarge(ServiceError):
    """A body or frame over its limit."""


class Unauthenticated(ServiceError):
    """No bearer token where tokens are configured."""


class Forbidden(ServiceError):
    """A token that is wrong, or not allowed this request (read token on a write, other namespace)."""


class NotFound(ServiceError):
    """No such block, or the chain ending at it is not complete."""


class NotReady(ServiceError):
    """The service is starting or shutting down."""


class Busy(ServiceError):
    """Request bodies in flight are at ``max_inflight_body_bytes``: retry later."""


class TierUnreachable(ServiceError):
    """A tier that may hold the block could not be reached (a delete cannot say it is gone)."""


class ClientGone(BadRequest):
    """The client closed the connection before its body ended. The answer reaches no one; it
    is not an error of the server, and it is not logged as one. Counted as 499 (nginx's
    "client closed request"): a 400 told operators of a malformed request that never was."""


class BodyTooSlow(ClientGone):
    """The server cut the client off before its body ended: no byte for
    ``body_idle_timeout_seconds``, or under ``body_min_bytes_per_second``. Counted as 408."""


# error class -> HTTP status; the most specific class in an exception's MRO wins.
STATUS: dict[type[Exception], int] = {
    BadRequest: 400,
    FrameError: 400,
    InputError: 400,
    BatchFormatError: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    HashMismatch: 409,
    TooLarge: 413,
    BatchTooLarge: 413,
    RequestValidationError: 422,
    BadLookup: 422,
    ClientGone: 499,
    BodyTooSlow: 408,
    ClientDisconnect: 499,  # the client went away mid-body (starlette's own reading of a body)
    NotReady: 503,
    Busy: 503,
    TierUnreachable: 503,
    TierUnavailable: 503,  # a tier (Redis) could not be asked: an outage to retry, not a full store
    StorageError: 507,  # no tier could take the block: the store is full or its disk fails
}


def status_of(exc: BaseException) -> int | None:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return None


def error_response(status: int, reason: str, *, busy: bool = False,
                   fields: dict[str, Any] | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": "1"} if status == 503 else None
    if busy:  # a 503 from a server that is up: clients do not take it for an outage
        headers = {**(headers or {}), BUSY_HEADER: "max_inflight_body_bytes"}
    extra = {name: value for name, value in (fields or {}).items() if name != "error"}
    return JSONResponse({"error": reason, **extra}, status_code=status, headers=headers)


# A stored key is a namespace's mask XOR the client's hash: a tier's reason that names one
# (a disk file's name in an OSError, a Redis key) gives a tenant its mask, and with it every
# block of the default namespace (whose mask is zero). None reaches a client; the log keeps them.
_STORED_KEYS = re.compile(r"[0-9a-fA-F]{32,}|[0-9a-fA-F]{8,}$")  # (and a key's head where a reason was cut)


def without_keys(text: str) -> str:
    """A tier's reason as a client may read it: every run of 32 or more hex digits hidden."""
    return _STORED_KEYS.sub("<key>", text)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RequestValidationError):
        parts = []
        for err in exc.errors():
            where, kind = tuple(err.get("loc", ())), err.get("type")
            if kind == "json_invalid":  # FastAPI's loc names the character; pydantic's message, the line
                at = f" at character {where[1]}" if where[:1] == ("body",) and len(where) > 1 else ""
                why = (err.get("ctx") or {}).get("error")
                parts.append(f"body: not valid JSON{at}" + (f": {why}" if why else ""))
                continue
            loc = ".".join(str(p) for p in where if p != "body")
            if not loc and where[:1] == ("body",):
                # The body as a whole: not a JSON object, or not sent as JSON (curl -d sends a form)
                hint = " (a JSON object, sent as Content-Type: application/json)" \
                    if kind in ("model_attributes_type", "dict_type") else ""
                parts.append(f"body: {err.get('msg')}{hint}")
                continue
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "; ".join(parts) or "invalid request body"
    if isinstance(exc, ClientDisconnect):
        return "the client went away before its body ended"
    if isinstance(exc, (StorageError, TierUnavailable)) and not isinstance(exc, ServiceError):
        return without_keys(str(exc)) or type(exc).__name__  # (a tier's own: see without_keys)
    return str(exc) or type(exc).__name__


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    status = status_of(exc)
    if status is None:  # pragma: no cover - registered only for classes in the table
        return await _handle_bug(request, exc)
    if status == 422 and (request.url.path, request.method.lower()) not in ANSWERS_422:
        status = 400  # FastAPI's validation of a body or parameter: bad input, as every other route says it
    if isinstance(exc, ClientDisconnect):  # (a body Starlette read: cut off as too slow, or abandoned)
        cut = (request.scope.get("extensions") or {}).get(BODY_CUT)
        if cut is not None and cut():
            return error_response(408, f"the server cut the client off before its body ended: {cut()}")
    return error_response(status, _reason(exc), busy=isinstance(exc, Busy), fields=getattr(exc, "fields", None))


async def _handle_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Starlette's own: unknown route (404), wrong method (405).
    headers = exc.headers
    if exc.status_code == 405:
        # Starlette names the methods of the first route on the path only (PUT for
        # /v1/blocks/{hash}, which GET and DELETE serve too); Allow lists the resource's.
        headers = {**(headers or {}), "Allow": ", ".join(_allowed(request))}
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=headers)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed(request: Request) -> list[str]:
    """The methods some route takes at the request's path."""
    routes = request.app.router.routes
    allowed = [method for method in _METHODS
               if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]
    if "GET" in allowed and "HEAD" not in allowed:  # every GET route answers HEAD (server.head)
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


_thread_shortage_said = LogThrottle(60.0)


def thread_shortage(exc: BaseException) -> bool:
    """A thread that could not be started (``threading.Thread.start``: the process at its
    limit of tasks, a container's ``pids.max`` or ``ulimit -u``), not a bug."""
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)


async def _handle_runtime(request: Request, exc: RuntimeError) -> JSONResponse:
    # A shortage that passes, as a full body budget is: a 503 to retry. The server's own
    # pools start their threads at open; this is a thread started as work comes (the
    # routes' thread pool), which answered 500, a "bug", and cut the connection.
    if not thread_shortage(exc):
        raise exc  # (a bug: ``_handle_bug``, as before)
    if _thread_shortage_said.due():
        log.warning("%s %s: %s: the process is at its limit of tasks (a container's pids limit, ulimit -u); "
                    "answered 503 (said at most once a minute)", request.method, request.url.path, exc)
    return error_response(503, "the server could not start a thread (at its limit of processes and threads): retry")


async def _handle_bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("bug: %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)


def install(app: FastAPI) -> None:
    for cls in STATUS:
        app.add_exception_handler(cls, _handle)
    app.add_exception_handler(ServiceError, _handle)
    # (Starlette calls a handler only with the class it is registered for; its stubs take any Exception)
    app.add_exception_handler(StarletteHTTPException, _handle_http)  # type: ignore[arg-type]
    app.add_exception_handler(RuntimeError, _handle_runtime)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _handle_bug)
