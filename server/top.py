"""``cacheseek top --url URL``: the dashboard's figures in a terminal, refreshed every second.

Reads ``/v1/stats`` (a read token if the server has tokens: ``--token`` or
``CACHESEEK_TOKEN``); rates and latency percentiles are over the last refresh. Plain ANSI:
on a terminal each frame replaces the last; piped, frames follow one another.
"""

from __future__ import annotations

import math
import os
import ssl
import sys
import time
from typing import Any, TextIO

import httpx

from .admin_cli import (AnswerTooLarge, _size, answer_client, cacert_context, parse_json, printable, reason, tls_hint,
                        token_problem, url_problem, whole_answer)
from .metrics import LATENCY_BUCKETS, quantile

CLEAR = "\x1b[H\x1b[2J"
ANSWER_SECONDS = 10.0  # for each /v1/stats answer, whole


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x: float | None) -> str:
    # None: no block stored, nothing to compare (it read "0.00x", as if blocks grew to nothing)
    return "-" if x is None else f"{x:.2f}x"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.2f} ms"


def render(stats: dict[str, Any], prev: dict[str, Any] | None, dt: float, url: str) -> str:
    """One frame of text from two successive ``/v1/stats`` answers ``dt`` seconds apart."""
    if prev is not None and prev.get("started_at") != stats.get("started_at"):
        prev = None  # the server restarted: its counters started again, no rate spans the two
    t = stats.get("traffic", {})
    p = (prev or {}).get("traffic", {})

    def rate(key: str) -> float | None:
        return (t.get(key, 0) - p.get(key, 0)) / dt if prev is not None and dt > 0 else None

    lat = stats.get("lookup_latency") or {}
    recent = None
    if prev is not None and lat.get("bucket_counts"):
        before = (prev.get("lookup_latency") or {}).get("bucket_counts") or [0] * len(lat["bucket_counts"])
        recent = [a - b for a, b in zip(lat["bucket_counts"], before)]
    asked = (t.get("lookup_tokens_requested", 0) - p.get("lookup_tokens_requested", 0)) if prev is not None else 0
    found = (t.get("lookup_tokens_matched", 0) - p.get("lookup_tokens_matched", 0)) if prev is not None else 0
    breakers = [f"{x['name']} breaker {x['breaker']['state']}" for x in stats.get("tiers", []) if x.get("breaker")]
    lines = [
        f"cacheseek top  {url}  v{stats.get('version', '?')}  up {stats.get('uptime_seconds', 0):.0f} s  "
        + ("  ".join(breakers) or "no breakers"),
        "",
        f"hit rate (tokens)   {_pct(t.get('token_hit_rate')):>8} all   {_pct(found / asked if asked else None):>8} now"
        f"    blocks {_pct(t.get('block_hit_rate'))}",
        f"tokens reused       {t.get('lookup_tokens_matched', 0):>12,}   {_num(rate('lookup_tokens_matched'))}/s",
        f"lookups             {t.get('lookups', 0):>12,}   {_num(rate('lookups'))}/s",
        f"lookup latency      p50 {_ms(lat.get('p50_seconds'))}  p90 {_ms(lat.get('p90_seconds'))}  "
        f"p99 {_ms(lat.get('p99_seconds'))} (all)   "
        f"p50 {_ms(quantile(recent, 0.5) if recent else None)}  p99 {_ms(quantile(recent, 0.99) if recent else None)} (now)",
        f"ingest              {_size(t.get('ingest_bytes', 0)):>12}   {_size(rate('ingest_bytes'))}/s",
        f"materialize         {_size(t.get('materialize_bytes', 0)):>12}   {_size(rate('materialize_bytes'))}/s",
        f"stored (distinct)   {_size(stats.get('used_bytes')):>12}   {stats.get('blocks', 0):,} blocks   "
        f"compression {_ratio(stats.get('compression_ratio'))}   pins {stats.get('pins', 0)}",
        "",
        f"{'tier':<6}{'fill':>7}{'used':>12}{'budget':>12}{'unique':>12}{'blocks':>9}{'pinned':>8}"
        f"{'hits':>9}{'misses':>9}{'evicted':>9}{'corrupt':>8}",
    ]
    for tier in stats.get("tiers", []):
        fill = tier["used_bytes"] / tier["capacity_bytes"] if tier.get("capacity_bytes") else 0
        unique = "shared" if tier.get("unique_bytes") is None else _size(tier["unique_bytes"])
        lines.append(f"{tier['name']:<6}{_pct(fill):>7}{_size(tier['used_bytes']):>12}{_size(tier['capacity_bytes']):>12}"
                     f"{unique:>12}{tier['blocks']:>9,}{tier.get('pinned_blocks', 0):>8,}{tier['hits']:>9,}"
                     f"{tier['misses']:>9,}{tier['evictions']:>9,}{tier['corrupt']:>8,}")
    usage = stats.get("namespaces") or []
    if usage:
        lines += ["", f"{'namespace':<24}{'model':<24}{'blocks':>9}{'stored':>12}"]
        for u in usage[:10]:
            ns = "(unattributed)" if u["namespace"] is None else (u["namespace"] or "(default)")
            lines.append(f"{ns[:23]:<24}{(u['model'] or '-')[:23]:<24}{u['blocks']:>9,}{_size(u['used_bytes']):>12}")
    return "\n".join(printable(line) for line in lines)  # (names and the version are the server's words)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def run(url: str, *, token: str | None = None, interval: float = 1.0, iterations: int | None = None,
        out: TextIO | None = None, verify: ssl.SSLContext | None = None) -> int:
    # sys.stdout as it is now, not as it was at import (a test's capture, closed since)
    out = out if out is not None else sys.stdout
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    prev, prev_at, shown = None, 0.0, 0
    clear = CLEAR if out.isatty() else ""
    with answer_client(ANSWER_SECONDS, verify, base_url=url.rstrip("/"), headers=headers) as client:
        while iterations is None or shown < iterations:
            started = time.monotonic()
            try:
                response = whole_answer(client, "GET", "/v1/stats", ANSWER_SECONDS)
            except httpx.HTTPError as exc:
                print(f"cacheseek top: cannot reach {url}: {exc}{tls_hint(exc)}", file=sys.stderr)
                return 3
            except AnswerTooLarge as exc:
                print(f"cacheseek top: {url}/v1/stats answered with {exc}: is this a CacheSeek server?", file=sys.stderr)
                return 1
            if response.status_code in (401, 403):
                print(f"cacheseek top: {response.status_code}: {reason(response)} "
                      "(give a read token: --token or CACHESEEK_TOKEN)", file=sys.stderr)
                return 1
            try:
                if not response.is_success:
                    raise ValueError(response.status_code)
                stats = parse_json(response)
                now = time.monotonic()
                frame = render(stats, prev, now - prev_at, url)
            except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError, RecursionError):
                # A wrong port or a proxy's page: said as such, not a traceback.
                print(f"cacheseek top: {url}/v1/stats answered {response.status_code} with no CacheSeek stats "
                      f"({reason(response)}): is this a CacheSeek server?", file=sys.stderr)
                return 1
            out.write(clear + frame + "\n" + ("" if clear else "\n"))
            out.flush()
            prev, prev_at = stats, now
            shown += 1
            if iterations is not None and shown >= iterations:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("top", help="watch a server's figures in the terminal",
                       description="A terminal view of /v1/stats: hit rate, lookup latency, throughput, tiers, "
                                   "namespaces; refreshed every second.")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default http://127.0.0.1:8080)")
    p.add_argument("--token", default=os.environ.get("CACHESEEK_TOKEN"), help="a read token [env CACHESEEK_TOKEN]")
    p.add_argument("--cacert", metavar="FILE", default=None,
                   help="CA bundle (PEM) that signed an https server's certificate, a self-signed one too "
                        "(default: certifi's CA bundle, as httpx's, or SSL_CERT_FILE)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--iterations", type=int, default=None, help="stop after this many refreshes (default: never)")
    p.add_argument("--once", action="store_true", help="one refresh, then exit (--iterations 1)")
    p.set_defaults(func=lambda args: _main(args))


def _main(args: Any) -> int:
    if not (math.isfinite(args.interval) and args.interval > 0):  # (nan polled without a pause; inf cannot sleep)
        print(f"cacheseek top: --interval must be a finite number of seconds > 0, got {args.interval}", file=sys.stderr)
        return 2
    if args.iterations is not None and args.iterations < 1:
        print(f"cacheseek top: --iterations must be >= 1 (omit it: until Ctrl-C), got {args.iterations}",
              file=sys.stderr)
        return 2
    problem = url_problem(args.url)
    if problem:
        print(f"cacheseek top: --url: {problem}", file=sys.stderr)
        return 2
    problem = token_problem(args.token) if args.token else None
    if problem:
        print(f"cacheseek top: --token (or CACHESEEK_TOKEN) {problem}", file=sys.stderr)
        return 2
    try:
        verify = cacert_context(args.cacert)
    except ValueError as exc:
        print(f"cacheseek top: --cacert: {exc}", file=sys.stderr)
        return 2
    try:
        return run(args.url, token=args.token, interval=args.interval, iterations=1 if args.once else args.iterations,
                   verify=verify)
    except KeyboardInterrupt:
        return 0


__all__ = ["LATENCY_BUCKETS", "add_parser", "render", "run"]
