"""Operations: ``/v1/stats`` (JSON), ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..deps import Reader, Scraper, Service
from ..errors import NotReady
from ..metrics import PROMETHEUS_CONTENT_TYPE
from ..protocol import BODY_INTO
from ._body import ERROR

router = APIRouter(tags=["operations"])


# Tier figures that tell where the server keeps its data: a path, a URL, or an error's text
# (redis-py's names the host and port it could not reach).
HOST_DETAILS = ("path", "url", "redis_url", "last_error")


def _without_host_details(figures: dict) -> None:
    for key in HOST_DETAILS:
        figures.pop(key, None)
    for value in figures.values():
        if isinstance(value, dict):  # (the Redis tier's breaker keeps a last_error too)
            _without_host_details(value)


@router.get("/v1/stats", responses={400: {"description": "a bad namespace header", **ERROR},
                                    401: {"description": "a token is required", **ERROR},
                                    403: {"description": "token not accepted", **ERROR}})
async def stats(caller: Reader, service: Service, request: Request) -> JSONResponse:
    """The figures ``/metrics`` shows, as JSON (docs/operations.md): per tier as stored and as
    unique blocks, store-wide distinct bytes and compression, traffic (lookups, hit rate,
    ingest, materialize) per namespace and model, usage per namespace and model, request
    latencies. A tenant's token sees only its own namespace's traffic and usage (the tiers' and
    the store's figures are the whole store's), and no host details (the disk tier's path)."""
    metrics = request.app.state.metrics
    out = await run_in_threadpool(metrics.figures, caller.namespace if caller.bound else None)
    if caller.bound:
        for tier in out.get("tiers", []):
            _without_host_details(tier)
    return JSONResponse(out)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {PROMETHEUS_CONTENT_TYPE: {"schema": {"type": "string"}}}},
                       401: {"description": "a token is required (the server has tokens, metrics_open off)", **ERROR},
                       403: {"description": "not metrics_token nor the read, write or admin token", **ERROR}})
async def metrics(_: Scraper, request: Request) -> Response:
    """Prometheus text: the figures of ``/v1/stats``, every namespace's and model's. Where the
    server has tokens it takes ``metrics_token`` or the read, write or admin token (not a
    tenant's), unless ``metrics_open``."""
    data = await run_in_threadpool(request.app.state.metrics.render)
    return Response(data, media_type=PROMETHEUS_CONTENT_TYPE)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


# The server stores and streams frames as they are: it never encodes or decodes KV, so it
# loads no kernels (nor torch). Clients say which kernels they run in their own stats().
KERNELS = {"kernels": "not used",
           "kernels_reason": "this server stores and streams encoded frames; clients encode and decode KV "
                             "(RemoteCache.stats() says which kernels a client runs)"}


@router.get("/readyz", responses={503: {"description": "starting, shutting down, a tier lost, or a written-through "
                                                     "tier that cannot write", **ERROR}})
async def readyz(request: Request) -> dict[str, str]:
    """Readiness: the store is open, every tier holds its storage (a disk tier whose directory
    was deleted or replaced under it gave it up: the server needs a restart), and the server
    is not shutting down. ``receive_path`` is
    ``in-place`` when request bodies are received by ``server.protocol`` (straight into the
    store's memory, with header and body timeouts), else ``plain`` (uvicorn's own protocol:
    the fast path is off)."""
    if getattr(request.app.state, "service", None) is None or getattr(request.app.state, "closing", False):
        raise NotReady("the store is not open")
    # (in a worker thread: it looks at the disk, and a tier giving its directory up forgets
    # its blocks one by one, about a second for 300,000)
    store = request.app.state.service.store
    if lost := await run_in_threadpool(store.lost_tiers):
        raise NotReady("; ".join(f"{name} tier: its storage was {why} under the running server: restart it"
                                 for name, why in lost.items()))
    # A tier every write goes through that refuses writes (its filesystem read-only) fails
    # every write (507) as surely as one that gave its directory up: out of rotation until
    # it takes a file again. (Reads of what it holds go on.) In a worker thread too: the
    # question probes the filesystem that just failed, which may stall.
    if unwritable := await run_in_threadpool(store.unwritable_tiers):
        raise NotReady("; ".join(f"{name} tier (written through): {why}"
                                 for name, why in unwritable.items()))
    in_place = BODY_INTO in (request.scope.get("extensions") or {})
    return {"status": "ready", "receive_path": "in-place" if in_place else "plain", **KERNELS}
