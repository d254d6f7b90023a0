"""What the server counts, and the one snapshot that ``/v1/stats`` and ``/metrics`` both show.

Hot-path counting is plain Python: ints and lists bumped in the event loop (the middleware
and the routes count after their worker-thread hand-offs return), so a request costs a few
dict reads and no lock. ``prometheus_client`` is used only to render, at scrape time, from
a ``Collector`` over ``Metrics.figures()``: the figures a scrape shows are exactly those
``/v1/stats`` returns.

- Requests: per route template (``/v1/lookup`` included) and method, a latency histogram
  (time to the last byte sent) and counts per status.
- Traffic per owner, an owner being a (namespace, model) pair: the namespace from
  ``X-CacheSeek-Namespace`` (or the tenant token), the model from ``X-CacheSeek-Model``,
  which ``RemoteCache`` sends (the server sees only hashes: the model is the client's
  word). Label pairs are bounded (``metrics_max_owners``); beyond, traffic counts under
  ``_other``.
- Lookups: reuse lookups (no ``each``) count toward the hit rate: lookups, lookups that
  matched at least one block, blocks and tokens requested and matched. Tokens come from
  ``X-CacheSeek-Block-Tokens`` (and ``X-CacheSeek-Tokens``, the query's length, when the
  client sends it; else the whole blocks asked for). Ingest checks (``each=true``: which
  blocks are new) are counted apart, so writes do not dilute the hit rate. A lookup sent
  again for a query counted already (``X-CacheSeek-Again``) counts nothing.
- The store: per tier as stored and as unique blocks, pins, admissions, evictions,
  demotions, promotions, corrupt frames, the Redis breaker; per-owner usage.

``metrics_detail=False`` (setting) turns off the per-request part (middleware, traffic
counters); the store figures, read at scrape time, stay.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.types import Receive, Scope, Send

from cacheseek import __version__
from cacheseek.build import commit
from cacheseek.log_throttle import LogThrottle

from .auth import header_value

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
log = logging.getLogger("cacheseek.server")

OTHER = "_other"
UNMATCHED = "unmatched"
REFUSED = "refused"  # the route label of a request the protocol answered before any route
REFUSALS_LOG_SECONDS = 60.0
# Request methods labelled as they are; any other is OTHER. h11 (``--http h11``) takes any
# token as a method and answers it (a 404 or 405), so each made a label set of its own and a
# histogram that lived as long as the process: a client without a token grew /metrics and
# the server's memory without bound, one request per label.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})
MODEL_HEADER = "X-CacheSeek-Model"
BLOCK_TOKENS_HEADER = "X-CacheSeek-Block-Tokens"
TOKENS_HEADER = "X-CacheSeek-Tokens"
# On a lookup piece after a chain's first (RemoteCache splits chains past max_lookup_hashes):
# the position of its first block. The query is counted once, by its first piece.
CONTINUES_HEADER = "X-CacheSeek-Continues"
# On a lookup sent again for a query counted already (RemoteCache, after a prefix GET met a
# block evicted since its lookup): counted nothing, else one materialize counted as two queries.
AGAIN_HEADER = "X-CacheSeek-Again"
MAX_LABEL = 128


class Latency:
    """A fixed-bucket histogram in plain ints."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """Estimated by linear interpolation inside the bucket (as PromQL's histogram_quantile)."""
        return quantile(self.counts, q)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "sum_seconds": self.sum, "p50_seconds": self.quantile(0.5),
                "p90_seconds": self.quantile(0.9), "p99_seconds": self.quantile(0.99),
                "bucket_bounds_seconds": list(LATENCY_BUCKETS), "bucket_counts": list(self.counts)}


def quantile(counts: list[int], q: float) -> float | None:
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if seen + n >= rank and n:
            lo = LATENCY_BUCKETS[i - 1] if i > 0 else 0.0
            if i >= len(LATENCY_BUCKETS):
                return LATENCY_BUCKETS[-1]
            return lo + (LATENCY_BUCKETS[i] - lo) * (rank - seen) / n
        seen += n
    return LATENCY_BUCKETS[-1]


@dataclass(slots=True)
class Traffic:
    """One owner's counters (all ``_total`` counters in Prometheus)."""

    lookups: int = 0
    lookup_hits: int = 0  # lookups that matched at least one block
    lookup_blocks_requested: int = 0
    lookup_blocks_matched: int = 0
    lookup_tokens_requested: int = 0
    lookup_tokens_matched: int = 0
    ingest_checks: int = 0  # lookups with each=true: which blocks are new
    ingest_requests: int = 0
    ingest_blocks_stored: int = 0
    ingest_blocks_present: int = 0
    ingest_blocks_failed: int = 0
    ingest_bytes: int = 0  # frame bytes newly stored
    materialize_requests: int = 0  # GET /v1/prefixes and /v1/blocks answered
    materialize_blocks: int = 0
    materialize_bytes: int = 0

    def add(self, other: Traffic) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _positive(value: bytes | None) -> int | None:
    if not value or not value.isdigit() or len(value) > 12:
        return None
    return int(value) or None


_MODEL, _BLOCK_TOKENS, _TOKENS, _CONTINUES, _AGAIN = (
    h.lower().encode() for h in (MODEL_HEADER, BLOCK_TOKENS_HEADER, TOKENS_HEADER, CONTINUES_HEADER, AGAIN_HEADER))


def client_headers(headers: Any) -> tuple[str | None, int | None, int | None, int | None, bool]:
    """(model, block tokens, query tokens, the position a lookup piece continues a query at
    (None: it begins one), whether it is sent again for a query counted already) as the client
    named them, in one pass over
    the raw headers (a ``Headers.get`` scans them all once per name), cached on the
    request's ``Headers`` object."""
    cached = getattr(headers, "_cacheseek", None)
    if cached is not None:
        return cached
    model = block_tokens = tokens = continues = None
    again = False
    for name, value in headers.raw:
        if name[:12] != b"x-cacheseek-":
            continue
        if name == _MODEL:
            model = header_value(value.decode("latin-1"))
        elif name == _BLOCK_TOKENS:
            block_tokens = _positive(value)
        elif name == _TOKENS:
            tokens = _positive(value)
        elif name == _CONTINUES:
            continues = _positive(value)
        elif name == _AGAIN:
            again = _positive(value) is not None
    out = (model, block_tokens, tokens, continues, again)
    try:
        headers._cacheseek = out
    except AttributeError:  # a Headers class with slots: no cache, one more pass next time
        pass
    return out


def continues_query(position: int | None, requested: int, first_position: int | None,
                    open_tokens: int | None) -> bool:
    """Whether a lookup piece that says it continues a query at ``position`` is taken as
    one. A client's pieces start at multiples of its piece size, so never before the piece's
    own length; the first block, where stored (``first_position``), is at ``position``; and
    (``open_tokens``, with token figures counted) a query of the same owner is still open,
    its tokens not all matched. Else the piece counts as a query of its own."""
    if position is None or position < requested:
        return False
    if first_position is not None and first_position != position:
        return False
    return open_tokens is None or open_tokens > 0


def hit_rates(t: Traffic) -> dict[str, float | None]:
    return {
        "token_hit_rate": t.lookup_tokens_matched / t.lookup_tokens_requested if t.lookup_tokens_requested else None,
        "block_hit_rate": t.lookup_blocks_matched / t.lookup_blocks_requested if t.lookup_blocks_requested else None,
    }


def clean_label(value: str | None) -> str:
    if not value:
        return ""
    value = value[:MAX_LABEL]
    return value if value.isprintable() and value.isascii() else value.encode("ascii", "replace").decode()


class Metrics:
    def __init__(self, *, detail: bool = True, max_owners: int = 64, tenants: Iterable[str] = ()) -> None:
        """``tenants``: the configured tenants' namespaces, whose traffic is counted as theirs
        past ``max_owners`` too (under their ``_other`` model at worst): a tenant reads only
        its own figures, and one first seen past the bound read zeros for the life of the
        process. Bounded by the settings, not by clients."""
        self.detail = detail
        self.max_owners = max_owners
        self._tenants = frozenset(clean_label(t) for t in tenants)
        self.started_at = time.time()
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency: dict[tuple[str, str], Latency] = {}
        self.statuses: dict[tuple[str, str, int], int] = {}  # (route, method, status code)
        self.traffic: dict[tuple[str, str], Traffic] = {}
        # A namespace's own model labels, at most a quarter of the pairs: past them its models
        # count under (namespace, "_other"), so one tenant naming many models (a header is the
        # client's word) cannot push every other tenant's traffic into ("_other", "_other").
        self.models_per_namespace = max(1, max_owners // 4)
        self._models: dict[str, int] = {}
        self.frames_rejected: dict[str, int] = {}
        self.frame_bytes_received = 0
        self.frame_bytes_sent = 0
        self._figures: Callable[[], dict[str, Any]] | None = None
        self._lock = threading.Lock()  # for the few counts made in worker threads
        # Per owner (by its Traffic's id: they live as long as this), the tokens its queries
        # asked for that their first pieces did not cover: what their continuing pieces may
        # still count as matched (``looked_up``).
        self._open_tokens: dict[int, int] = {}
        self._refusals_said = LogThrottle(REFUSALS_LOG_SECONDS)
        self._refusals_unsaid: dict[int, int] = {}
        self.registry.register(_Collector(self))

    # -- counting (event loop) ---------------------------------------------------------

    def refused(self, status: int, reason: str, peer: str) -> None:
        """A request the protocol answered itself, before any route (``protocol_class``'s
        ``on_refused``): counted as route ``refused``, and said in the log once a minute at
        most, with how many of each status since the last such line (uvicorn's own line for
        a malformed request, one a request from anyone, is dropped: ``cli``)."""
        self.request(REFUSED, OTHER, status, 0.0)
        self._refusals_unsaid[status] = self._refusals_unsaid.get(status, 0) + 1
        if not self._refusals_said.due():
            return
        counts, self._refusals_unsaid = self._refusals_unsaid, {}
        log.warning("requests refused before any route: %s since the last such line (one a minute at most); the "
                    "last from %s: %s %s", ", ".join(f"{n} x {code}" for code, n in sorted(counts.items())), peer,
                    status, reason)

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method)
        lat = self.latency.get(key)
        if lat is None:
            lat = self.latency[key] = Latency()
        lat.observe(seconds)
        skey = (route, method, status)
        self.statuses[skey] = self.statuses.get(skey, 0) + 1

    def owner(self, namespace: str, model: str | None) -> Traffic:
        """The counters of (namespace, model): a namespace's models past
        ``models_per_namespace``, or once ``max_owners`` pairs exist, count under its
        ``_other`` model; a namespace new once they exist, under ``_other`` in both."""
        # Looked up under the cleaned labels it is stored under: a model name that cleaning
        # changes (non-ASCII, over 128 characters) would otherwise start over every request.
        ns = clean_label(namespace)
        key = (ns, clean_label(model or ""))
        t = self.traffic.get(key)
        if t is None:
            full = len(self.traffic) >= self.max_owners
            models = self._models.get(ns, 0)
            if full and ns in self._tenants:
                full = False  # (a tenant's own pairs: a bound of their own, models_per_namespace each)
            if full and (ns, OTHER) not in self.traffic:  # (no pair made past the bound)
                key = (OTHER, OTHER)
            elif full or models >= self.models_per_namespace:
                key = (ns, OTHER)
            else:
                self._models[ns] = models + 1
            t = self.traffic.get(key)
            if t is None:
                t = self.traffic[key] = Traffic()
        return t

    def for_request(self, namespace: str, headers: Any) -> Traffic | None:
        """The counters of the caller's (namespace, model), or None with ``detail`` off.
        ``headers``: the request's (Starlette ``Headers``; its ``raw`` list is read once)."""
        if not self.detail:
            return None
        return self.owner(namespace, client_headers(headers)[0])

    def lookup_latency(self) -> dict[str, Any]:
        """The latency histogram of ``POST /v1/lookup`` (empty before the first lookup)."""
        lat = self.latency.get(("/v1/lookup", "POST"))
        return (lat or Latency()).to_dict()

    def rejected(self, reason: str) -> None:
        with self._lock:  # frames are checked in worker threads too
            self.frames_rejected[reason] = self.frames_rejected.get(reason, 0) + 1

    def ingested(self, traffic: Traffic | None, reports: list[Any]) -> None:
        """Count a PUT or POST /v1/blocks answer (``service.PutReport``s)."""
        stored = sum(r.nbytes for r in reports if r.status == "stored")
        self.frame_bytes_received += sum(r.nbytes for r in reports)  # stored, present or failed: all came in
        if traffic is None:
            return
        traffic.ingest_requests += 1
        for r in reports:
            if r.status == "stored":
                traffic.ingest_blocks_stored += 1
            elif r.status == "present":
                traffic.ingest_blocks_present += 1
            else:
                traffic.ingest_blocks_failed += 1
        traffic.ingest_bytes += stored

    def looked_up(self, traffic: Traffic | None, headers: Any, requested: int, matched: int, each: bool,
                  first_position: int | None = None, *, one_of_chains: bool = False,
                  chain_tokens: int | None = None) -> None:
        """Count a lookup of ``requested`` blocks whose longest stored prefix is ``matched``.
        A piece that continues a query (``X-CacheSeek-Continues``) adds its blocks to the
        query its first piece counted: no lookup, hit or requested tokens of its own (the
        first piece counted the query's tokens; counted again, the token hit rate fell).
        A lookup sent again for a query counted already (``X-CacheSeek-Again``) counts nothing.

        The header is the client's word, so it is held to what can be checked
        (``continues_query``; ``first_position``: where the piece's first block is stored,
        when it is), and a piece's matched tokens count only up to the tokens its owner's
        queries asked for and have not matched yet: a false header can hide its own lookup,
        never make the token hit rate pass 1 or count a token no query asked for.

        ``one_of_chains``: one chain of a lookup of several, a query of its own (no piece of
        another, nor sent again) of ``chain_tokens`` tokens where the client said."""
        if traffic is None:
            return
        _, block_tokens, tokens, continues, again = client_headers(headers)
        if one_of_chains:
            tokens, continues, again = chain_tokens, None, False
        open_tokens = self._open_tokens.get(id(traffic), 0)
        # (An ingest check counts no tokens: only the checks that need none apply to its pieces.)
        continues = continues_query(continues, requested, first_position,
                                    open_tokens if block_tokens and not each else None)
        if each:
            traffic.ingest_checks += not continues
            return
        if again:
            return
        if not continues:
            traffic.lookups += 1
            traffic.lookup_hits += matched > 0
        traffic.lookup_blocks_requested += requested
        traffic.lookup_blocks_matched += matched
        if block_tokens:
            matched_tokens = matched * block_tokens
            if not continues:
                # The query's tokens (the partial tail included) when the client says; at least the blocks asked.
                asked = max(tokens or 0, requested * block_tokens)
                traffic.lookup_tokens_requested += asked
                if matched == requested:  # whole: the client may go on with the query's next piece
                    open_tokens += asked - matched_tokens
            else:
                matched_tokens = min(matched_tokens, open_tokens)
                open_tokens -= matched_tokens
            traffic.lookup_tokens_matched += matched_tokens
            self._open_tokens[id(traffic)] = open_tokens

    # -- reading ---------------------------------------------------------------------------

    def watch(self, figures: Callable[[], dict[str, Any]]) -> None:
        """Where the store's side of the figures comes from (``BlockService.store_figures``)."""
        self._figures = figures

    def figures(self, namespace: str | None = None) -> dict[str, Any]:
        """Everything, as ``/v1/stats`` shows it. ``namespace``: only that namespace's traffic
        and usage (for a tenant-bound caller)."""
        out = dict(self._figures()) if self._figures is not None else {}
        # list(): one atomic copy under the GIL, while the event loop keeps counting
        # (A tenant never sees the overflow's counters, though "_other" is a valid namespace:
        # they are every other owner's past ``max_owners``.)
        owners = [(k, t) for k, t in list(self.traffic.items())
                  if namespace is None or k[0] == namespace and k != (OTHER, OTHER)]
        total = Traffic()
        for _, t in owners:
            total.add(t)
        out["uptime_seconds"] = time.time() - self.started_at
        out["started_at"] = self.started_at
        out["version"] = __version__
        out["commit"] = commit()
        out["metrics_detail"] = self.detail
        out["traffic"] = {**asdict(total), **hit_rates(total),
                          "by_owner": [{"namespace": k[0], "model": k[1], **asdict(t), **hit_rates(t)}
                                       for k, t in sorted(owners)]}
        if namespace is None:
            statuses = list(self.statuses.items())
            out["requests"] = [
                {"route": r, "method": m, **lat.to_dict(),
                 "statuses": {str(s): n for (r2, m2, s), n in statuses if (r2, m2) == (r, m)}}
                for (r, m), lat in sorted(list(self.latency.items()))
            ]
            out["frames_rejected"] = dict(self.frames_rejected)
            out["frame_bytes_received"] = self.frame_bytes_received
            out["frame_bytes_sent"] = self.frame_bytes_sent
        else:
            out["namespaces"] = [u for u in out.get("namespaces", []) if u["namespace"] == namespace]
            # Every namespace's lookups, as the per-route figures: their count and timing.
            out.pop("lookup_latency", None)
        return out

    def watch_bodies(self, stats: Callable[[], dict[str, int]]) -> None:
        """Report request bodies in flight (``server.limits.BodyBudget.stats``) at scrape time."""
        self.registry.register(_BodiesCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -- Prometheus -------------------------------------------------------------------------

# TierStats field -> (series suffix, help, kind)
_TIER_SERIES = {
    "hits": ("hits_total", "Reads served by the tier", "counter"),
    "misses": ("misses_total", "Reads the tier could not serve", "counter"),
    "evictions": ("evictions_total", "Blocks evicted to make room", "counter"),
    "admissions": ("admissions_total", "Blocks newly stored in the tier (ingest, write-through, promotion, demotion)",
                   "counter"),
    "promotions": ("promotions_total", "Blocks copied up into the tier on a hit below", "counter"),
    "promotions_spared": ("promotions_spared_total", "Promotions into the tier not made: its only room was the "
                          "chain being read (served from below)", "counter"),
    "demotions": ("demotions_total", "Blocks moved down into the tier on eviction above", "counter"),
    "corrupt": ("corrupt_frames_total", "Stored frames found corrupt (checksum, length, header): a miss, deleted",
                "counter"),
    "foreign_version": ("foreign_version_frames_total", "Stored frames of another format version (another "
                        "release's, sharing the storage): a miss, kept", "counter"),
    "read_errors": ("read_errors_total", "Reads that failed for want of a descriptor or memory, or an I/O error: "
                    "a miss, nothing removed", "counter"),
    "write_errors": ("write_errors_total", "Frames the tier failed to store", "counter"),
    "bytes_in": ("bytes_in_total", "Frame bytes written into the tier", "counter"),
    "bytes_out": ("bytes_out_total", "Frame bytes read from the tier", "counter"),
    "used_bytes": ("used_bytes", "Bytes held against the budget, every copy counted (disk: whole file-system blocks)",
                   "gauge"),
    "capacity_bytes": ("capacity_bytes", "Byte budget", "gauge"),
    "blocks": ("blocks", "Blocks held", "gauge"),
    "raw_bytes": ("raw_bytes", "Unencoded KV bytes the held blocks stand for", "gauge"),
    "unique_bytes": ("unique_bytes", "Encoded bytes of the blocks no faster tier holds (absent for Redis)", "gauge"),
    "unique_blocks": ("unique_blocks", "Blocks no faster tier holds (absent for Redis)", "gauge"),
    "pinned_bytes": ("pinned_bytes", "Bytes of pinned blocks (never evicted), as used_bytes counts them", "gauge"),
    "pinned_blocks": ("pinned_blocks", "Pinned blocks held", "gauge"),
}

# store-wide figure -> (series, help)
_STORE_SERIES = {
    "used_bytes": ("cacheseek_store_used_bytes", "Encoded bytes of the distinct blocks held by the local tiers"),
    "blocks": ("cacheseek_store_blocks", "Distinct blocks held by the local tiers"),
    "raw_bytes": ("cacheseek_store_raw_bytes", "Unencoded KV bytes the distinct blocks stand for"),
    "stored_bytes": ("cacheseek_store_stored_bytes", "Encoded bytes held, every tier's copy counted"),
    "compression_ratio": ("cacheseek_store_compression_ratio", "Unencoded over encoded bytes of the distinct blocks"),
    "pins": ("cacheseek_pins", "Pinned prefixes"),
}

# Redis tier figures (from its stats' extra fields) -> (series suffix, help)
_REDIS_COUNTERS = {
    "dropped_writes": ("dropped_writes_total", "Frames not written to Redis: it was down, slow, or refused them"),
    "timeouts": ("timeouts_total", "Redis calls that timed out"),
    "unavailable_errors": ("unavailable_errors_total", "Redis calls that failed to connect or were cut off"),
    "rejected_errors": ("rejected_errors_total", "Redis commands Redis answered with an error (OOM, ...)"),
    "refused_by_breaker": ("refused_by_breaker_total", "Redis calls skipped while the circuit breaker was open"),
    "foreign_index_errors": ("foreign_index_errors_total",
                             "Redis calls refused: a key of the shared index holds another type (named in the log)"),
}
BREAKER_STATES = ("closed", "open", "half_open")

# Traffic field -> (series, help); labels namespace, model
_TRAFFIC_SERIES = {
    "lookups": ("cacheseek_lookups_total", "Reuse lookups (POST /v1/lookup without each)"),
    "lookup_hits": ("cacheseek_lookup_hits_total", "Reuse lookups that matched at least one block"),
    "lookup_blocks_requested": ("cacheseek_lookup_blocks_requested_total", "Blocks asked for by reuse lookups"),
    "lookup_blocks_matched": ("cacheseek_lookup_blocks_matched_total", "Blocks of the longest stored prefix found"),
    "lookup_tokens_requested": ("cacheseek_lookup_tokens_requested_total",
                                "Tokens asked for by reuse lookups (clients that say their block size)"),
    "lookup_tokens_matched": ("cacheseek_lookup_tokens_matched_total", "Tokens covered by the stored prefixes found"),
    "ingest_checks": ("cacheseek_ingest_checks_total", "Lookups with each=true: which blocks of an ingest are new"),
    "ingest_requests": ("cacheseek_ingest_requests_total", "PUT and POST /v1/blocks answered"),
    "ingest_bytes": ("cacheseek_ingest_bytes_total", "Frame bytes newly stored"),
    "materialize_requests": ("cacheseek_materialize_requests_total", "GET /v1/prefixes and /v1/blocks answered"),
    "materialize_blocks": ("cacheseek_materialize_blocks_total", "Blocks sent to clients"),
    "materialize_bytes": ("cacheseek_materialize_bytes_total", "Frame bytes sent to clients"),
}


def _family(name: str, help_: str, labels: list[str], kind: str) -> Any:
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_, labels=labels)
    return GaugeMetricFamily(name, help_, labels=labels)


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        figures = m.figures()
        info = GaugeMetricFamily("cacheseek_build_info", "Version of the running server, and the commit it was "
                                 "built from (\"unknown\" outside a git checkout)", labels=["version", "commit"])
        info.add_metric([__version__, commit()], 1.0)
        yield info
        yield GaugeMetricFamily("cacheseek_start_time_seconds", "When the server started (Unix time)", value=m.started_at)
        yield from self._requests(m)
        yield from self._traffic(m)
        yield from self._store(figures)
        yield from self._descriptors(figures.get("descriptors"))

    def _descriptors(self, figures: dict[str, Any] | None) -> Iterator[Any]:
        if figures is None:  # (before the app's start)
            return
        for name, key, help_ in (
                ("cacheseek_fds_open", "open", "File descriptors the process holds (each connection holds one)"),
                ("cacheseek_fds_limit", "limit", "File descriptors the process may hold (RLIMIT_NOFILE soft limit, "
                                                 "raised to the hard one at start)")):
            if figures.get(key) is not None:
                yield GaugeMetricFamily(name, help_, value=float(figures[key]))
        exhausted = CounterMetricFamily("cacheseek_fds_exhausted", "Times the process found no file descriptor "
                                        "free (EMFILE, ENFILE), by where: accept, the once-a-second check, a disk "
                                        "read or write", labels=["place"])
        for place, n in figures["exhausted"].items():
            exhausted.add_metric([place], float(n))
        yield exhausted

    def _requests(self, m: Metrics) -> Iterator[Any]:
        rejected = CounterMetricFamily("cacheseek_frames_rejected", "Client frames rejected, by reason", labels=["reason"])
        for reason, n in sorted(list(m.frames_rejected.items())):
            rejected.add_metric([reason], n)
        yield rejected
        yield CounterMetricFamily("cacheseek_frame_bytes_received",
                                  "Frame bytes received in PUT and POST /v1/blocks (stored, present or failed)",
                                  value=m.frame_bytes_received)
        yield CounterMetricFamily("cacheseek_frame_bytes_sent", "Frame bytes streamed to clients", value=m.frame_bytes_sent)
        if not m.detail:
            return
        requests = CounterMetricFamily("cacheseek_http_requests", "HTTP requests answered",
                                       labels=["route", "method", "status"])
        for (route, method, status), n in sorted(list(m.statuses.items())):
            requests.add_metric([route, method, str(status)], n)
        yield requests
        latency = HistogramMetricFamily("cacheseek_http_request_duration_seconds",
                                        "Time from request to the last byte of the answer", labels=["route", "method"])
        for (route, method), lat in sorted(list(m.latency.items())):
            cumulative, buckets = 0, []
            for bound, n in zip([*LATENCY_BUCKETS, float("inf")], lat.counts):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            latency.add_metric([route, method], buckets, lat.sum)
        yield latency

    def _traffic(self, m: Metrics) -> Iterator[Any]:
        if not m.detail:
            return
        items = sorted(list(m.traffic.items()))
        for field, (name, help_) in _TRAFFIC_SERIES.items():
            family = CounterMetricFamily(name.removesuffix("_total"), help_, labels=["namespace", "model"])
            for (ns, model), t in items:
                family.add_metric([ns, model], getattr(t, field))
            yield family
        blocks = CounterMetricFamily("cacheseek_ingest_blocks", "Blocks sent by clients, by what became of them",
                                     labels=["namespace", "model", "outcome"])
        for (ns, model), t in items:
            for outcome in ("stored", "present", "failed"):
                blocks.add_metric([ns, model, outcome], getattr(t, f"ingest_blocks_{outcome}"))
        yield blocks

    def _store(self, figures: dict[str, Any]) -> Iterator[Any]:
        tiers = figures.get("tiers", [])
        for field, (suffix, help_, kind) in _TIER_SERIES.items():
            family = _family(f"cacheseek_tier_{suffix}", help_, ["tier"], kind)
            for tier in tiers:
                if tier.get(field) is not None:
                    family.add_metric([tier["name"]], float(tier[field]))
            yield family
        refusals = CounterMetricFamily("cacheseek_tier_admission_refusals",
                                       "Blocks a tier with an admission threshold did not take (used too few times)",
                                       labels=["tier"])
        for tier in tiers:
            if "admission" in tier:
                refusals.add_metric([tier["name"]], tier["admission"]["not_admitted"])
        yield refusals
        for field, (name, help_) in _STORE_SERIES.items():
            if figures.get(field) is not None:
                yield GaugeMetricFamily(name, help_, value=float(figures[field]))
        recovery = figures.get("recovery") or {}
        if recovery.get("seconds") is not None:
            yield GaugeMetricFamily("cacheseek_recovery_duration_seconds",
                                    "How long opening the store took (the disk tier's index rebuild)",
                                    value=recovery["seconds"])
        recovered = GaugeMetricFamily("cacheseek_tier_recovered_blocks", "Blocks found at start", labels=["tier"])
        recovered_bytes = GaugeMetricFamily("cacheseek_tier_recovered_bytes", "Bytes found at start", labels=["tier"])
        for name, got in (recovery.get("tiers") or {}).items():
            recovered.add_metric([name], got["blocks"])
            recovered_bytes.add_metric([name], got["bytes"])
        yield recovered
        yield recovered_bytes
        lost = GaugeMetricFamily("cacheseek_tier_lost", "1 once the tier gave up the storage under it (a disk "
                                 "directory deleted or replaced while the server ran: restart it), else 0",
                                 labels=["tier"])
        for tier in tiers:
            if "lost" in tier:
                lost.add_metric([tier["name"]], 0.0 if tier["lost"] is None else 1.0)
        yield lost
        read_only = GaugeMetricFamily("cacheseek_tier_read_only", "1 while the tier cannot write, its filesystem "
                                      "read-only (its last write or delete refused so: EROFS), else 0", labels=["tier"])
        for tier in tiers:
            if "read_only" in tier:
                read_only.add_metric([tier["name"]], 0.0 if tier["read_only"] is None else 1.0)
        yield read_only
        usage = _bounded_usage(figures.get("namespaces") or [], self.metrics.max_owners)
        for field, name, help_ in (("used_bytes", "cacheseek_namespace_used_bytes", "Encoded bytes of the owner's distinct blocks"),
                                   ("blocks", "cacheseek_namespace_blocks", "The owner's distinct blocks"),
                                   ("raw_bytes", "cacheseek_namespace_raw_bytes", "Unencoded KV bytes of the owner's blocks")):
            family = GaugeMetricFamily(name, help_, labels=["namespace", "model"])
            for labels, u in usage:
                family.add_metric(list(labels), u[field])
            yield family
        yield from self._redis(tiers)

    def _redis(self, tiers: list[dict[str, Any]]) -> Iterator[Any]:
        redis = [t for t in tiers if isinstance(t.get("breaker"), dict)]
        if not redis:
            return
        for field, (suffix, help_) in _REDIS_COUNTERS.items():
            family = CounterMetricFamily(f"cacheseek_redis_{suffix}".removesuffix("_total"), help_, labels=["tier"])
            for tier in redis:
                family.add_metric([tier["name"]], float(tier.get(field) or 0))
            yield family
        open_ = GaugeMetricFamily("cacheseek_redis_breaker_open",
                                  "1 while the Redis circuit breaker is open or half-open, else 0", labels=["tier"])
        state = GaugeMetricFamily("cacheseek_redis_breaker_state", "1 for the breaker's current state",
                                  labels=["tier", "state"])
        for tier in redis:
            now = tier["breaker"]["state"]
            open_.add_metric([tier["name"]], 0.0 if now == "closed" else 1.0)
            for s in BREAKER_STATES:
                state.add_metric([tier["name"], s], 1.0 if now == s else 0.0)
        yield open_
        yield state
        # The tier's blocks and bytes (cacheseek_tier_*) are the shared index's last values
        # while Redis cannot be asked: a flat line on a dashboard, told from a real one here.
        stale = GaugeMetricFamily("cacheseek_redis_index_stale",
                                  "1 while the tier's block and byte figures are the last ones read (Redis could "
                                  "not be asked), else 0", labels=["tier"])
        for tier in redis:
            stale.add_metric([tier["name"]], 1.0 if tier.get("index_stale") else 0.0)
        yield stale
        # A fill panel over this server's capacity_bytes showed a tier far from full while a
        # process of a smaller budget on the namespace emptied it down to that one.
        budget = GaugeMetricFamily("cacheseek_redis_budget_in_effect_bytes",
                                   "The smallest budget in use on the tier's namespace (this server's, or another "
                                   "process's below it): evictions keep the namespace to it", labels=["tier"])
        for tier in redis:
            budget.add_metric([tier["name"]], float(tier.get("budget_in_effect_bytes") or tier.get("capacity_bytes") or 0))
        yield budget


def _bounded_usage(usage: list[dict[str, Any]], max_owners: int) -> list[tuple[tuple[str, str], dict[str, int]]]:
    """Usage per (namespace, model) label pair, at most ``max_owners`` pairs: the rest (the
    smallest, as ``Owners.usage`` sorts) summed under ``_other``, as traffic is, so that the
    pairs still add up to the store's figures. Owners whose labels are one pair are summed
    into one series: "_other" is a namespace a tenant may take (beside the unattributed
    blocks' label, and the overflow's), and labels are cleaned; two series of one label set
    are a duplicate a scrape refuses."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for u in usage:
        labels = (clean_label(u["namespace"] if u["namespace"] is not None else OTHER), clean_label(u["model"]))
        if labels not in out and len(out) >= max_owners:
            labels = (OTHER, OTHER)
        got = out.setdefault(labels, {"used_bytes": 0, "blocks": 0, "raw_bytes": 0})
        for field in got:
            got[field] += u[field]
    return list(out.items())


class MetricsMiddleware:
    """Times every HTTP request until its last byte is sent, labelled by route template
    (``unmatched`` only for requests no route took: unknown paths)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._paths: dict[Any, str] | None = None  # endpoint -> path, for Starlette's plain routes

    def _label(self, scope: Scope) -> str:
        route = scope.get("route")  # FastAPI's routes (and the lookup route) name themselves
        if route is not None:
            return route.path
        endpoint = scope.get("endpoint")  # a plain Starlette route (/openapi.json) leaves its endpoint
        if endpoint is None:
            return UNMATCHED
        if self._paths is None:
            app = scope.get("app")
            routes = getattr(getattr(app, "router", None), "routes", [])
            self._paths = {r.endpoint: r.path for r in routes if hasattr(r, "endpoint") and hasattr(r, "path")}
        return self._paths.get(endpoint, UNMATCHED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            method = scope.get("method", "")
            self.metrics.request(self._label(scope), method if method in METHODS else OTHER, status,
                                 time.perf_counter() - start)


class _BodiesCollector(Collector):
    """Request bodies in flight (``server.limits.BodyBudget``), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        for name, key, help_ in (
                ("cacheseek_http_body_bytes_in_flight", "in_flight_bytes",
                 "Request-body bytes being received (the step each body reads: 64 KiB to 16 MiB) or received, not yet stored"),
                ("cacheseek_http_body_bytes_in_flight_peak", "peak_bytes", "Most request-body bytes in flight at once"),
                ("cacheseek_http_body_bytes_in_flight_limit", "limit_bytes", "max_inflight_body_bytes")):
            family = GaugeMetricFamily(name, help_)
            family.add_metric([], float(s[key]))
            yield family
        refused = CounterMetricFamily("cacheseek_http_bodies_refused",
                                      "Requests answered 503: bodies in flight at max_inflight_body_bytes")
        refused.add_metric([], float(s["refused"]))
        yield refused
