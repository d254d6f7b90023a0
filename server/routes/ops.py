"""Operations: ``/v1/stats`` (JSON), ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..deps import Reader, Service
from ..errors import NotReady
from ..metrics import PROMETHEUS_CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get("/v1/stats")
async def stats(caller: Reader, service: Service, request: Request) -> JSONResponse:
    """The figures ``/metrics`` shows, as JSON (docs/operations.md): per tier as stored and as
    unique blocks, store-wide distinct bytes and compression, traffic (lookups, hit rate,
    ingest, materialize) per namespace and model, usage per namespace and model, request
    latencies. A tenant's token sees only its own namespace's traffic and usage."""
    metrics = request.app.state.metrics
    return JSONResponse(await run_in_threadpool(metrics.figures, caller.namespace if caller.bound else None))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {PROMETHEUS_CONTENT_TYPE: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
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


@router.get("/readyz", responses={503: {"description": "starting or shutting down"}})
async def readyz(request: Request) -> dict[str, str]:
    """Readiness: the store is open and the server is not shutting down."""
    if getattr(request.app.state, "service", None) is None or getattr(request.app.state, "closing", False):
        raise NotReady("the store is not open")
    return {"status": "ready", **KERNELS}
