"""The FastAPI application: ``create_app(settings)`` or ``create_app(store=...)``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cacheseek import __version__
from cacheseek.store.tiered import TieredStore

from . import errors, openapi
from .auth import Authenticator
from .config import ServerSettings
from .limits import BodyBudget, trim_heap
from .metrics import Metrics, MetricsMiddleware
from .namespaces import Namespaces, load_secret
from .routes import blocks, lookup, ops, prefixes
from .service import BlockService
from .store import build_store

log = logging.getLogger("cacheseek.server")

DESCRIPTION = """Tiered KV-cache store for exact-prefix reuse.

Bodies are binary block frames (`application/octet-stream`), or several frames each preceded
by its length as a u64 little-endian (`application/vnd.cacheseek.frames`). Errors are JSON
`{"error": reason}`. See docs/http-api.md."""


def create_app(settings: ServerSettings | None = None, *, store: TieredStore | None = None) -> FastAPI:
    """The service over ``store`` (kept open: the caller owns it), or over a store built from
    ``settings`` when the app starts (closed, and so flushed, when it shuts down)."""
    settings = settings if settings is not None else ServerSettings.load()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store is None
        the_store = await run_in_threadpool(build_store, settings) if owned else store
        disk = settings.disk_path if settings.disk_bytes > 0 else None
        secret = settings.namespace_secret.get_secret_value().encode() if settings.namespace_secret else None
        namespaces = Namespaces(await run_in_threadpool(load_secret, secret, disk))
        metrics.watch_store(the_store.stats)
        app.state.service = BlockService(the_store, namespaces, metrics, max_chain_blocks=settings.max_chain_blocks)
        app.state.closing = False
        log.info("store open: tiers %s", the_store.tier_names)
        try:
            yield
        finally:
            # uvicorn has stopped accepting and let in-flight requests finish (SIGTERM).
            app.state.closing = True
            if owned:
                await run_in_threadpool(the_store.close)
                log.info("store closed")

    app = FastAPI(title="CacheSeek", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.auth = Authenticator(settings)
    app.state.service = None

    def release_memory() -> None:
        """After a burst of request bodies given back unstored: their memory back to the OS."""
        trim_heap()
        service = app.state.service
        if service is not None:
            service.release_free_memory()

    app.state.body_budget = BodyBudget(settings.max_inflight_body_bytes, release_memory)
    metrics.watch_bodies(app.state.body_budget.stats)
    for module in (blocks, prefixes, ops):
        app.include_router(module.router)
    lookup.install(app)
    errors.install(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    openapi.install(app)
    return app
