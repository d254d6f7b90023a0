"""Prometheus series: per-route latency and counts (an ASGI middleware), rejected frames,
and the store's per-tier figures, read from ``TieredStore.stats()`` at scrape time.

Each app has its own registry, so several apps can live in one process (tests, benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# TierStats field -> (series suffix, help, kind)
_TIER_SERIES = {
    "hits": ("hits_total", "Reads served by the tier", "counter"),
    "misses": ("misses_total", "Reads the tier could not serve", "counter"),
    "evictions": ("evictions_total", "Blocks evicted to make room", "counter"),
    "promotions": ("promotions_total", "Blocks copied up into the tier on a hit below", "counter"),
    "demotions": ("demotions_total", "Blocks moved down into the tier on eviction above", "counter"),
    "corrupt": ("checksum_failures_total", "Stored frames found corrupt (a miss, deleted)", "counter"),
    "write_errors": ("write_errors_total", "Frames the tier failed to store", "counter"),
    "bytes_in": ("bytes_in_total", "Frame bytes written into the tier", "counter"),
    "bytes_out": ("bytes_out_total", "Frame bytes read from the tier", "counter"),
    "used_bytes": ("used_bytes", "Encoded bytes held", "gauge"),
    "capacity_bytes": ("capacity_bytes", "Byte budget", "gauge"),
    "blocks": ("blocks", "Blocks held", "gauge"),
    "raw_bytes": ("raw_bytes", "Unencoded KV bytes the held blocks stand for", "gauge"),
}


# Redis tier figures (from its stats' extra fields) -> (series suffix, help)
_REDIS_COUNTERS = {
    "dropped_writes": ("dropped_writes_total", "Frames not written to Redis: it was down, slow, or refused them"),
    "timeouts": ("timeouts_total", "Redis calls that timed out"),
    "unavailable_errors": ("unavailable_errors_total", "Redis calls that failed to connect or were cut off"),
    "rejected_errors": ("rejected_errors_total", "Redis commands Redis answered with an error (OOM, ...)"),
    "refused_by_breaker": ("refused_by_breaker_total", "Redis calls skipped while the circuit breaker was open"),
}


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        tiers = self._stats()["tiers"]
        for field, (suffix, help_, kind) in _TIER_SERIES.items():
            name = f"cacheseek_tier_{suffix}"
            family = (CounterMetricFamily(name.removesuffix("_total"), help_, labels=["tier"]) if kind == "counter"
                      else GaugeMetricFamily(name, help_, labels=["tier"]))
            for tier in tiers:
                family.add_metric([tier["name"]], float(tier.get(field) or 0))
            yield family
        redis = [t for t in tiers if isinstance(t.get("breaker"), dict)]
        if not redis:
            return
        for field, (suffix, help_) in _REDIS_COUNTERS.items():
            family = CounterMetricFamily(f"cacheseek_redis_{suffix}".removesuffix("_total"), help_, labels=["tier"])
            for tier in redis:
                family.add_metric([tier["name"]], float(tier.get(field) or 0))
            yield family
        family = GaugeMetricFamily("cacheseek_redis_breaker_open",
                                   "1 while the Redis circuit breaker is open or half-open, else 0", labels=["tier"])
        for tier in redis:
            family.add_metric([tier["name"]], 0.0 if tier["breaker"]["state"] == "closed" else 1.0)
        yield family


class _BodiesCollector(Collector):
    """Request bodies in flight (``server.limits.BodyBudget``), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        for name, key, help_ in (
                ("cacheseek_http_body_bytes_in_flight", "in_flight_bytes", "Request-body bytes received, not yet stored"),
                ("cacheseek_http_body_bytes_in_flight_peak", "peak_bytes", "Most request-body bytes in flight at once"),
                ("cacheseek_http_body_bytes_in_flight_limit", "limit_bytes", "max_inflight_body_bytes")):
            family = GaugeMetricFamily(name, help_)
            family.add_metric([], float(s[key]))
            yield family
        family = CounterMetricFamily("cacheseek_http_bodies_refused",
                                     "Requests answered 503: bodies in flight at max_inflight_body_bytes")
        family.add_metric([], float(s["refused"]))
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("cacheseek_http_requests", "HTTP requests answered",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("cacheseek_http_request_duration_seconds",
                                 "Time from request to the last byte of the answer",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.frames_rejected = Counter("cacheseek_frames_rejected", "Client frames rejected, by reason",
                                       ["reason"], registry=self.registry)
        self.frame_bytes_received = Counter("cacheseek_frame_bytes_received", "Frame bytes accepted from clients",
                                            registry=self.registry)
        self.frame_bytes_sent = Counter("cacheseek_frame_bytes_sent", "Frame bytes streamed to clients",
                                        registry=self.registry)
        self._store_collector: _StoreCollector | None = None

    def watch_store(self, stats: Callable[[], dict[str, Any]]) -> None:
        if self._store_collector is not None:
            self.registry.unregister(self._store_collector)
        self._store_collector = _StoreCollector(stats)
        self.registry.register(self._store_collector)

    def watch_bodies(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_BodiesCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Times every HTTP request until its last byte is sent, labelled by route template."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.latency.labels(path, method).observe(time.perf_counter() - start)
            self.metrics.requests.labels(path, method, str(status)).inc()
