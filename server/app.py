"""The FastAPI application: ``create_app(settings)`` or ``create_app(store=...)``."""

from __future__ import annotations

import asyncio
import glob
import importlib
import ipaddress
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from cacheseek import __version__, descriptors
from cacheseek.store.tiered import TieredStore

from . import errors, openapi
from .admin import PINS_FILE, AdminOps
from .auth import Authenticator
from .config import ServerSettings
from .head import HeadAsGet
from .limits import BodyBudget, trim_heap
from .metrics import Metrics, MetricsMiddleware
from .namespaces import KEY_FILE, SECRET_ID_FILE, Namespaces, load_secret
from .owners import OWNERS_FILE, Owners
from .protocol import CUT_SHORT, coding_error, header_error
from .routes import admin, blocks, dashboard, docs, lookup, ops, prefetch, prefixes
from .service import BlockService
from .store import build_store
from .summary import over_budget_lines, recovery_figures, store_lines

log = logging.getLogger("cacheseek.server")

DESCRIPTION = """Tiered KV-cache store for exact-prefix reuse.

Bodies are binary block frames (`application/octet-stream`), or several frames each preceded
by its length as a u64 little-endian (`application/vnd.cacheseek.frames`). Errors are JSON
`{"error": reason}`. See docs/http-api.md; operations (metrics, dashboard, admin) in
docs/operations.md."""


def _remove_stale_temp_files(disk: Path) -> None:
    """Temp files of the state kept beside the disk tier (owners, pins, the namespace key)
    that a kill -9 left mid-write. The server owns the directory (the disk tier's lock,
    taken when the store opened), so none is another process's write in progress."""
    for name in (OWNERS_FILE, PINS_FILE, KEY_FILE, SECRET_ID_FILE):
        for stale in disk.glob(f"{glob.escape(name)}.*.tmp"):
            try:
                stale.unlink()
            except OSError as exc:
                log.warning("cannot remove %s: %s", stale, exc)


async def refuse(send: Send, status: int, error: str) -> None:
    """A middleware's JSON refusal, the connection closed: the route never ran."""
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def query_error(query: bytes) -> str | None:
    """Why a query string is refused, or None: a parameter given twice. Each route reads one
    value of each (the last), where a front before this server may have checked the other
    (a flush's ``namespace``, say)."""
    seen: set[str] = set()
    for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return f"the query parameter {name[:64]!r} appears more than once; a request gives it at most once"
        seen.add(name)
    return None


class SingleHeaders:
    """An HTTP/1.1 request without exactly one Host header, or any request with a second
    Authorization, Content-Type or ``X-CacheSeek-*`` header (``header_error``) or a query
    parameter twice (``query_error``), is a JSON 400, the connection closed, the route not
    run (RFC 9112 3.2 for Host); a body coding the server does not decode, its 415 or 501
    (``coding_error``). server.protocol refuses headers before the body; uvicorn's
    own httptools protocol (``--http httptools``, or the fast path off) let them through, so a
    PUT without Host stored its frame there. (uvicorn's h11 refuses a wrong Host itself, with
    its plain-text 400, before any app runs.)"""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            wrong_headers = header_error(scope["headers"], scope.get("http_version"))
            if not wrong_headers and scope.get("query_string"):
                wrong_headers = query_error(scope["query_string"])
            if wrong_headers:
                await refuse(send, 400, wrong_headers)
                return
            # (server.protocol refuses these before the body; uvicorn's httptools took
            # "gzip, chunked" as chunked, and a gzip body as it came)
            coding = coding_error(scope["headers"])
            if coding is not None:
                await refuse(send, int(coding[0].split()[0]), coding[1])
                return
        await self.app(scope, receive, send)


# Methods a page of any origin may send (with a body a form or fetch(no-cors) can make) and
# whose effects the browser does not hold back: it only hides the answer from the page.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _authority(authority: str, scheme: str) -> tuple[str, int] | None:
    """(host, port) of a ``Host`` header or an origin's authority, the scheme's port when it
    names none; None when it cannot be read."""
    authority = authority.strip().lower()
    if authority.startswith("["):  # an IPv6 literal: its colons are inside the brackets
        end = authority.find("]")
        if end < 0:
            return None
        name, rest = authority[: end + 1], authority[end + 1:]
    else:
        name, colon, port = authority.partition(":")
        rest = colon + port
    if not rest:
        default = DEFAULT_PORTS.get(scheme)
        return (name, default) if default is not None else None
    port = rest[1:]
    # (isdigit() alone takes a latin-1 '\xb2', and int() refuses 4,300 digits and more)
    return (name, int(port)) if rest[0] == ":" and port.isascii() and port.isdigit() and len(port) <= 5 else None


def _loopback(name: str) -> bool:
    name = name.removeprefix("[").removesuffix("]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cross_origin(headers: Any, scheme: str, server: Any = None) -> str | None:
    """The ``Origin`` a browser sent with a request from a page of another origin (or an
    opaque one, ``null``), or None: no Origin (not a browser's cross-origin request) or the
    page's own server. ``server``: the (address, port) the request came in on; on a loopback
    address the page must be of a loopback name too. A page whose name its owner made resolve
    to 127.0.0.1 (DNS rebinding) is of the server's origin for the browser, Host and Origin
    alike, and no browser reaches a loopback address but from its own host, where the
    server's own pages are localhost's."""
    origin = host = None
    for name, value in headers:
        if name == b"origin":
            origin = value.decode("latin-1")
        elif name == b"host":
            host = value.decode("latin-1")
    if origin is None:
        return None
    o_scheme, sep, o_authority = origin.partition("://")
    o_scheme = o_scheme.lower()
    if sep and host is not None and "/" not in o_authority and o_scheme == scheme:
        theirs = _authority(o_authority, o_scheme)
        if theirs is not None and theirs == _authority(host, scheme):
            if not (server and _loopback(str(server[0]))) or _loopback(theirs[0]):
                return None
    return origin


class SameOrigin:
    """A request that changes something (any method but GET, HEAD, OPTIONS) sent by a page of
    another origin is a JSON 403, the connection closed, the route not run. A browser sends
    such a request without asking first (no CORS preflight) when it is a POST with a body
    typed as text, a form or nothing (``fetch(url, {method: "POST", mode: "no-cors", body})``),
    and the server read any body as frames: any web page a user on the server's network (or
    its host, for the default loopback address) opened could store blocks in a server
    without tokens, their KV served to inference as a cached prefix's, or start prefetches.
    It cannot read the answer, and never needed to. Browsers name the page's origin in
    ``Origin`` on every request but GET and HEAD; clients that are not browsers (RemoteCache,
    curl) send none and are let through, as is a page of the server itself (the dashboard,
    /docs). On a loopback address, a page must be of a loopback name (``cross_origin``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") not in SAFE_METHODS:
            origin = cross_origin(scope["headers"], scope.get("scheme", "http"), scope.get("server"))
            if origin is not None:
                await refuse(send, 403, f"a request from a page of another origin ({origin[:100]!r}) "
                                        "may not change anything")
                return
        await self.app(scope, receive, send)


class CutAtShutdown:
    """A request still running when uvicorn's graceful shutdown runs out
    (``graceful_timeout_seconds``) is cancelled: uvicorn logged a traceback for each, which an
    operator reads as a crash. Here each is one line, and its connection is closed: the client
    sees it end (no answer, or an answer cut short), so nothing it was not answered is taken
    as stored. Uvicorn cancels request tasks only then (and asyncio.run, after it): a
    cancellation out of the app is a cut, never a bug."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            cut = (scope.get("extensions") or {}).get(CUT_SHORT)
            if cut is None:
                raise  # uvicorn's own protocol (the fast path is off): nothing to close it with
            client = scope.get("client")
            log.warning("shutdown: cut %s %s from %s, still running at the end of the shutdown's wait "
                        "(graceful_timeout_seconds, or a second SIGINT): %s",
                        scope.get("method"), scope.get("path"), f"{client[0]}:{client[1]}" if client else "a client",
                        "its response cut short" if started else "not answered (nothing of it acknowledged)")
            cut(abort=True)


DESCRIPTOR_CHECK_SECONDS = 1.0


def _accept_shortage_said(previous: Callable[..., Any] | None) -> Callable[[Any, dict[str, Any]], None]:
    """An event loop exception handler that takes the asyncio loop's report of an accept
    failed for want of a descriptor ("socket.accept() out of system resource", each retry,
    a second apart, with its traceback) as ``descriptors.EXHAUSTION``'s, which counts it and
    names the limit; any other report goes to ``previous`` (or the loop's default)."""

    def handle(loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        shortage = isinstance(exc, OSError) and exc.errno in descriptors.EXHAUSTED
        if shortage and "accept" in str(context.get("message", "")):
            descriptors.EXHAUSTION.note("accept", exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    return handle


async def _check_descriptors() -> None:
    """Whether a descriptor can be had, once a second: under uvloop (the default loop), libuv
    closes a connection it cannot take for want of one and reports it nowhere."""
    while True:
        await asyncio.sleep(DESCRIPTOR_CHECK_SECONDS)
        descriptors.EXHAUSTION.check()


def create_app(settings: ServerSettings | None = None, *, store: TieredStore | None = None,
               opened_seconds: float | None = None, announce: Callable[[str], None] | None = None) -> FastAPI:
    """The service over ``store`` (kept open: the caller owns it), or over a store built from
    ``settings`` when the app starts (closed, and so flushed, when it shuts down).
    ``opened_seconds``: how long building ``store`` took, for the recovery figures.
    ``announce``: where the start-up summary goes (``cacheseek serve`` prints it)."""
    settings = settings if settings is not None else ServerSettings.load()
    metrics = Metrics(detail=settings.metrics_detail, max_owners=settings.metrics_max_owners, tenants=settings.tenants)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # numpy, which each write's frame check uses (store.frame.check_stat_values imports it
        # where called, the library having no need of it), is imported before any write: first
        # imported by a write that found no file descriptor free, it was left half loaded, and
        # every write after it failed ("cannot load module more than once per process") until
        # a restart.
        importlib.import_module("numpy")
        owned = store is None
        start = time.perf_counter()
        the_store = store if store is not None else await run_in_threadpool(build_store, settings)
        opened = time.perf_counter() - start if opened_seconds is None else opened_seconds
        disk = settings.disk_path if settings.disk_bytes > 0 else None
        if disk is not None:
            _remove_stale_temp_files(Path(disk))
        secret = settings.namespace_secret.get_secret_value().encode() if settings.namespace_secret else None
        redis = settings.redis_url is not None and settings.redis_bytes > 0
        namespaces = Namespaces(await run_in_threadpool(load_secret, secret, disk, shared_tier=redis))
        owners = Owners(disk, directory_held=lambda: not the_store.lost_tiers())
        service = BlockService(the_store, namespaces, metrics, max_chain_blocks=settings.max_chain_blocks, owners=owners)
        app.state.admin = AdminOps(service, disk)
        await run_in_threadpool(app.state.admin.restore_pins)
        opened_over = await run_in_threadpool(service.stats)  # what the tiers held when opened, before the trim
        await run_in_threadpool(the_store.trim)  # (its victims handed down)
        first = await run_in_threadpool(service.stats)
        recovery = recovery_figures(opened_over, opened, first)
        for line in over_budget_lines(opened_over, recovery):
            log.warning("%s", line)
        if redis:
            from cacheseek.store.redis_tier import RedisTier

            for tier in the_store.tiers:
                if isinstance(tier, RedisTier):
                    for line in await run_in_threadpool(tier.sizing_problems) or ():
                        log.warning("redis tier: %s", line)
        metrics.watch(lambda: {**service.stats(), "recovery": recovery, "lookup_latency": metrics.lookup_latency(),
                               "descriptors": descriptors.figures()})
        app.state.service = service
        app.state.closing = False
        if announce is not None:
            announce("\n".join(store_lines(settings, first, recovery)))
        loop = asyncio.get_running_loop()
        handler = loop.get_exception_handler()
        loop.set_exception_handler(_accept_shortage_said(handler))
        checking = asyncio.create_task(_check_descriptors())
        try:
            yield
        finally:
            checking.cancel()
            loop.set_exception_handler(handler)
            # uvicorn has stopped accepting and let in-flight requests finish (SIGTERM).
            app.state.closing = True
            await run_in_threadpool(app.state.admin.close)
            # Write-back: what only memory holds goes down to disk (or Redis) before the store closes.
            await run_in_threadpool(service.drain_at_shutdown, settings.shutdown_drain_seconds,
                                    app.state.shutdown_cut)
            if owned:
                await run_in_threadpool(the_store.close)
                log.info("store closed")

    app = FastAPI(title="CacheSeek", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # /docs is served from the package (routes.docs)
                  # A path with a "/" after it is an unknown route (a JSON 404), not an empty 307
                  # to the same path on whatever host the Host header names.
                  redirect_slashes=False)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.auth = Authenticator(settings)
    app.state.service = None
    app.state.admin = None
    # Set by a second SIGINT (``cacheseek serve``): the shutdown's drain stops there.
    app.state.shutdown_cut = threading.Event()

    def release_memory() -> None:
        """After a burst of request bodies given back unstored: their memory back to the OS."""
        trim_heap()
        service = app.state.service
        if service is not None:
            service.release_free_memory()

    app.state.body_budget = BodyBudget(settings.max_inflight_body_bytes, release_memory)
    metrics.watch_bodies(app.state.body_budget.stats)
    for module in (blocks, prefixes, prefetch, ops, admin, dashboard, docs):
        app.include_router(module.router)
    lookup.install(app)
    errors.install(app)
    app.add_middleware(HeadAsGet)  # (inside the metrics', which count HEAD as HEAD)
    if settings.metrics_detail:
        app.add_middleware(MetricsMiddleware, metrics=metrics)
    openapi.install(app)
    app.add_middleware(SameOrigin)  # (outside the metrics' too, and before any body is read)
    app.add_middleware(SingleHeaders)  # (outside the metrics': as server.protocol's refusals, not a route's answer)
    app.add_middleware(CutAtShutdown)  # (outermost: a cut anywhere below is caught)
    return app
