"""``cacheseek serve`` and its file descriptors (RLIMIT_NOFILE), on a real server process
started under a low limit, as ``ulimit -n`` or systemd's default would leave it: the start
raises the soft limit to the hard one and says so, and warns where the hard one is low too."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from cacheseek import descriptors
from server_helpers import Server  # noqa: E402

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def soft_limit_of(pid: int) -> int:
    lines = Path(f"/proc/{pid}/limits").read_text().splitlines()
    [line] = [line for line in lines if line.startswith("Max open files")]
    return int(line.split()[3])


@pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD <= 2048, reason="needs a hard RLIMIT_NOFILE over 2048")
def test_the_start_raises_the_soft_limit_to_the_hard_one_and_says_it(tmp_path):
    hard = HARD if HARD != resource.RLIM_INFINITY else 1 << 20
    with Server(tmp_path, nofile=(256, HARD)) as srv:
        assert srv.proc is not None
        assert soft_limit_of(srv.proc.pid) >= min(hard, 1 << 20) > 256
        said = srv.output()
        assert f"file descriptors: up to {soft_limit_of(srv.proc.pid):,} (RLIMIT_NOFILE; soft limit raised from 256" \
            in said
        assert "WARNING: file descriptors" not in said


def test_with_the_hard_limit_low_too_the_start_warns(tmp_path):
    with Server(tmp_path, nofile=(64, 64)) as srv:
        said = srv.output()
        assert "file descriptors: up to 64 (RLIMIT_NOFILE; hard limit 64)" in said
        assert "WARNING: file descriptors: the process may hold only 64 (RLIMIT_NOFILE, hard limit 64), fewer than " \
               "the 1,024 a server should have" in said
        assert "systemd LimitNOFILE=, docker run --ulimit nofile=N:N" in said


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
