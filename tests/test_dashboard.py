"""The dashboard and the API docs in a real headless Chromium, against a real server with
traffic: nothing is loaded from anywhere but the server, and the figures shown are the
figures of ``/v1/stats``.

``CACHESEEK_DASHBOARD_SCREENSHOT=docs/dashboard.png`` also saves the page as shown (the
screenshot in docs/operations.md is made this way)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from browser import Browser, needs_chromium
from server_helpers import Server, batch_body, raw_chain

pytestmark = needs_chromium


def _traffic(url: str, stop: threading.Event, seconds: float) -> None:
    """Ingest, lookups (some hits, some misses) and materializes from two tenants, two models."""
    import cacheseek as cs

    int4 = cs.KIVI(bits=4, group_size=32)
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url) as c:
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            ns, model, codec = ("team-a", "llama-3-8b", int4) if i % 3 else ("team-b", "qwen2.5-7b", None)
            head = {"X-CacheSeek-Namespace": ns, "X-CacheSeek-Model": model, "X-CacheSeek-Block-Tokens": "32"}
            chain = raw_chain(1000 + i % 7, 4, codec=codec)
            c.post("/v1/blocks", content=batch_body([f for _, f in chain]), headers=head)
            asked = [h.hex() for h, _ in chain] + ([("%032x" % i)] if i % 2 else [])
            c.post("/v1/lookup", json={"hashes": asked}, headers={**head, "X-CacheSeek-Tokens": str(32 * len(asked) + 7)})
            c.get(f"/v1/prefixes/{chain[-1][0].hex()}", headers=head)
            i += 1
            time.sleep(0.05)


def test_the_dashboard_shows_the_stats_and_loads_nothing_from_elsewhere(tmp_path):
    with Server(tmp_path, cpu_bytes="4MiB") as srv, Browser() as browser:
        stop = threading.Event()
        feeder = threading.Thread(target=_traffic, args=(srv.url, stop, 8.0))
        feeder.start()
        try:
            browser.goto(srv.url + "/dashboard")
            browser.wait_for("Number(document.body.dataset.refreshes) >= 3", timeout=60)
        finally:
            stop.set()
            feeder.join(30)
        # Traffic over: two more refreshes, then the page and /v1/stats must agree.
        n = browser.js("Number(document.body.dataset.refreshes)")
        browser.wait_for(f"Number(document.body.dataset.refreshes) >= {n + 2}", timeout=30)
        shown = browser.js("[...document.querySelectorAll('[data-stat]')].map(e => [e.dataset.stat, e.dataset.value, e.textContent])")
        tiers = browser.js("[...document.querySelectorAll('#tiers [data-field]')].map("
                           "e => [e.closest('tr').dataset.tier, e.dataset.field, e.dataset.value])")
        usage = browser.js("[...document.querySelectorAll('#namespaces [data-namespace]')].map("
                           "e => [e.dataset.namespace, e.dataset.model, e.dataset.value])")
        health = browser.js("document.getElementById('health').textContent")
        stats = httpx.get(srv.url + "/v1/stats").json()

        assert len(shown) >= 15
        for path, value, text in shown:
            expected = stats
            for part in path.split("."):
                expected = expected[part]
            if expected is None:
                assert value == "" and text == "-", path
            else:
                assert float(value) == pytest.approx(float(expected), rel=1e-9), (path, value, expected)
                assert text not in ("", "-"), path
        assert stats["traffic"]["lookups"] > 0 and stats["traffic"]["token_hit_rate"] is not None
        by_tier = {t["name"]: t for t in stats["tiers"]}
        assert {(t, f) for t, f, _ in tiers} == {(t, f) for t in by_tier for f in ("used_bytes", "unique_bytes", "blocks")}
        for tier, field, value in tiers:
            assert int(value) == by_tier[tier][field], (tier, field)
        assert sorted((ns, m, int(v)) for ns, m, v in usage) == sorted(
            (u["namespace"], u["model"], u["used_bytes"]) for u in stats["namespaces"])
        assert {ns for ns, _, _ in usage} == {"team-a", "team-b"} and health == "healthy"
        assert browser.js("document.getElementById('links-need-token').hidden") is True  # (no tokens here)
        # Four charts drawn, none still waiting for data.
        assert browser.js("[...document.querySelectorAll('canvas')].length") == 4

        requests = browser.requests
        assert requests and all(u.startswith(srv.url) or u.startswith("data:") for u in requests), requests
        assert not browser.console_errors, browser.console_errors
        target = os.environ.get("CACHESEEK_DASHBOARD_SCREENSHOT")
        browser.screenshot(Path(target) if target else tmp_path / "dashboard.png")


def test_the_charts_across_a_server_restart_hold_no_negative_rate(tmp_path):
    """A restart starts every counter again: the refresh after it took the difference with
    the last process's figures (negative lookups, bytes and latency counts per second)."""
    first = Server(tmp_path / "a", cpu_bytes="4MiB").start()
    with Browser() as browser:
        try:
            stop = threading.Event()
            _traffic(first.url, stop, 3.0)
            browser.goto(first.url + "/dashboard")
            browser.wait_for("Number(document.body.dataset.refreshes) >= 2", timeout=60)
        finally:
            first.stop()
        second = Server(tmp_path / "b", cpu_bytes="4MiB")  # the same port, so the page polls it
        second.port, second.url = first.port, first.url
        second.args[second.args.index("--port") + 1] = str(first.port)
        with second:
            n = browser.js("Number(document.body.dataset.refreshes)")
            browser.wait_for(f"Number(document.body.dataset.refreshes) >= {n + 2}", timeout=60)
            rates = browser.js("[...state.points.hits, ...state.points.io].flatMap(p => Object.values(p.v))")
        assert rates and all(r is None or r >= 0 for r in rates), rates


def test_api_docs_render_offline(tmp_path):
    with Server(tmp_path, disk=False) as srv, Browser() as browser:
        browser.goto(srv.url + "/docs")
        # Swagger UI rendered the document: its title and the lookup route are on the page.
        browser.wait_for("document.querySelector('.swagger-ui .info .title') !== null", timeout=60)
        browser.wait_for("document.body.innerText.includes('/v1/lookup')", timeout=30)
        assert "CacheSeek" in browser.js("document.querySelector('.swagger-ui .info .title').textContent")
        requests = browser.requests
        assert any(u.endswith("/openapi.json") for u in requests)
        assert all(u.startswith(srv.url) or u.startswith("data:") for u in requests), requests


def test_the_dashboard_asks_once_for_a_read_token(tmp_path):
    with Server(tmp_path, "--read-token", "r3ad", "--write-token", "wr1te", disk=False) as srv, Browser() as browser:
        browser.goto(srv.url + "/dashboard")
        browser.wait_for("!document.getElementById('login').hidden", timeout=60)
        assert browser.js("document.body.dataset.refreshes") == "0"
        # The footer's links to /v1/stats and /metrics send no token: said, not a bare 401
        assert browser.js("document.getElementById('links-need-token').hidden") is False
        assert httpx.get(srv.url + "/metrics").status_code == 401
        submit = "document.getElementById('token').value = {!r}; document.getElementById('login').requestSubmit(); 1"
        browser.js(submit.format("wr0ng"))
        browser.wait_for("document.getElementById('login-error').textContent === 'token not accepted'")
        browser.js(submit.format("r3ad"))
        browser.wait_for("Number(document.body.dataset.refreshes) >= 2", timeout=30)
        assert browser.js("document.getElementById('login').hidden") is True
        assert browser.js("document.getElementById('health').textContent") == "healthy"
