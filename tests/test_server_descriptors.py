"""``cacheseek serve`` and its file descriptors (RLIMIT_NOFILE), on a real server process
started under a low limit, as ``ulimit -n`` or systemd's default would leave it: the start
raises the soft limit to the hard one and says so, and warns where the hard one is low too;
running out then (idle clients holding every descriptor) is said in the log and counted in
``/v1/stats`` and ``/metrics``, and the server takes connections again once those close."""

from __future__ import annotations

import re
import resource
import socket
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from cacheseek import descriptors
from server_helpers import Server, batch_body, raw_chain  # noqa: E402

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def soft_limit_of(pid: int) -> int:
    lines = Path(f"/proc/{pid}/limits").read_text().splitlines()
    [line] = [line for line in lines if line.startswith("Max open files")]
    return int(line.split()[3])


def wait_for(what, timeout: float = 30.0):
    """``what()`` once it is true (polled), else the test fails."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            assert got, f"not so after {timeout} s"
            return got
        time.sleep(0.05)


@pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD <= 2048, reason="needs a hard RLIMIT_NOFILE over 2048")
def test_the_start_raises_the_soft_limit_to_the_hard_one_and_says_it(tmp_path):
    hard = HARD if HARD != resource.RLIM_INFINITY else 1 << 20
    with Server(tmp_path, nofile=(256, HARD)) as srv:
        assert srv.proc is not None
        assert soft_limit_of(srv.proc.pid) >= min(hard, 1 << 20) > 256
        said = srv.output()
        assert f"file descriptors: up to {soft_limit_of(srv.proc.pid):,} (RLIMIT_NOFILE; soft limit raised from 256" \
            in said
        figures = httpx.get(srv.url + "/v1/stats").json()["descriptors"]
        assert figures["limit"] == soft_limit_of(srv.proc.pid)
        assert figures["exhausted"] == {"accept": 0, "check": 0, "disk_read": 0, "disk_write": 0}
        assert 0 < figures["open"] < 256
        assert "WARNING: file descriptors" not in said


def test_with_the_hard_limit_low_too_the_start_warns(tmp_path):
    with Server(tmp_path, nofile=(64, 64)) as srv:
        said = srv.output()
        assert "file descriptors: up to 64 (RLIMIT_NOFILE; hard limit 64)" in said
        assert "WARNING: file descriptors: the process may hold only 64 (RLIMIT_NOFILE, hard limit 64), fewer than " \
               "the 1,024 a server should have" in said
        assert "systemd LimitNOFILE=, docker run --ulimit nofile=N:N" in said


@pytest.mark.parametrize("loop", ["auto", "asyncio"])  # auto: uvloop, whose libuv drops connections unreported
def test_running_out_is_said_and_counted_and_passes_once_connections_close(tmp_path, loop):
    limit = 64
    crowd: list[socket.socket] = []
    with Server(tmp_path, "--loop", loop, nofile=(limit, limit)) as srv:  # (the hard limit low too: none to raise)
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # connected before the crowd
            chain = raw_chain(1, 4)
            assert client.post("/v1/blocks", content=batch_body([f for _, f in chain])).status_code == 200

            def exhausted() -> dict[str, int]:
                return client.get("/v1/stats").json()["descriptors"]["exhausted"]

            try:
                for _ in range(limit + 16):  # idle clients: each connection the server takes holds a descriptor
                    crowd.append(socket.create_connection(("127.0.0.1", srv.port)))
                # asyncio reports each failed accept; under uvloop only the server's own check sees it
                place = "accept" if loop == "asyncio" else "check"
                wait_for(lambda: exhausted()[place] > 0)
                answers = client.post("/v1/blocks", content=batch_body([f for _, f in raw_chain(2, 4)])).json()
                assert {a["status"] for a in answers} == {"failed"}
                assert exhausted()["disk_write"] > 0
                metrics = client.get("/metrics").text
                assert re.search(r'^cacheseek_fds_exhausted_total\{place="disk_write"\} [1-9]', metrics, re.M), metrics
                assert f"cacheseek_fds_limit {float(limit)}" in metrics
            finally:
                for s in crowd:
                    s.close()
            log = wait_for(lambda: "out of file descriptors at a disk write" in srv.output() and srv.output())
            assert "out of file descriptors at " + {"accept": "accept", "check": "the server's check"}[place] in log
            assert f"the process holds all {limit} it may hold (RLIMIT_NOFILE, ulimit -n, hard limit {limit})" in log
            assert "docs/operations.md, File descriptors" in log

            # Once the crowd's connections close, new clients are answered and writes are stored again.
            def new_client_answered() -> bool:
                try:
                    return httpx.get(srv.url + "/healthz", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(new_client_answered)
            answers = client.post("/v1/blocks", content=batch_body([f for _, f in raw_chain(3, 4)])).json()
            assert {a["status"] for a in answers} == {"stored"}


def test_an_unlimited_hard_limit_raises_the_soft_one_as_far_as_the_system_takes(monkeypatch):
    """(A hard limit of RLIM_INFINITY needs privilege to set, so the calls are stood in for:
    Linux refuses a soft limit past fs.nr_open, macOS past OPEN_MAX.)"""
    limits = [(1024, resource.RLIM_INFINITY)]
    asked = []

    def setrlimit(which, value):
        assert which == resource.RLIMIT_NOFILE
        asked.append(value[0])
        if value[0] > 10240:
            raise ValueError("current limit exceeds maximum limit")
        limits.append(value)

    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    got = descriptors.raise_soft_limit(1 << 20)
    assert got == descriptors.Limit(soft=8192, hard=None, was=1024) and got.raised
    assert limits[-1] == (8192, resource.RLIM_INFINITY) and asked[0] == 1 << 20
    # A soft limit already at the cap, or unlimited, is kept.
    limits.append((resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert descriptors.raise_soft_limit(1 << 20) == descriptors.Limit(soft=1 << 20, hard=None, was=1 << 20)
    assert len(limits) == 3


def test_a_first_write_with_no_descriptor_free_leaves_later_writes_working(tmp_path):
    """The first write imports what the frame check needs: made with no descriptor free, that
    import failed half-way and every write after it was a 500 until a restart."""
    limit = 64
    crowd: list[socket.socket] = []
    with Server(tmp_path, nofile=(limit, limit)) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            assert client.get("/healthz").status_code == 200  # connected before the crowd; no write yet
            try:
                for _ in range(limit + 16):
                    crowd.append(socket.create_connection(("127.0.0.1", srv.port)))
                wait_for(lambda: client.get("/v1/stats").json()["descriptors"]["exhausted"]["check"] > 0)
                r = client.post("/v1/blocks", content=batch_body([f for _, f in raw_chain(1, 4)]))
                assert r.status_code == 200 and {a["status"] for a in r.json()} == {"failed"}, r.text
            finally:
                for s in crowd:
                    s.close()
            wait_for(lambda: client.get("/v1/stats").json()["descriptors"]["open"] < limit // 2)
            r = client.post("/v1/blocks", content=batch_body([f for _, f in raw_chain(2, 4)]))
            assert r.status_code == 200 and {a["status"] for a in r.json()} == {"stored"}, r.text
