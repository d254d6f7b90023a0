"""A write-back ``cacheseek serve`` (``--no-write-through``) stopped cleanly writes what only its
CPU tier holds down to disk, or Redis (``shutdown_drain_seconds``), so that a restart finds it:
real servers on loopback, signalled as an operator would, restarted over the same files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from redis_servers import RedisServer, needs_redis
from server_helpers import Server, batch_body, cacheseek_command, raw_chain

SUMMARY = re.compile(r"shutdown: wrote ([\d,]+) of ([\d,]+) blocks .* left behind ([\d,]+) ")


def ingest(srv: Server, chains: list[list[tuple[bytes, bytes]]]) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for blocks in chains:
            r = c.post("/v1/blocks", content=batch_body([f for _, f in blocks]))
            assert r.status_code == 200 and all(x["status"] == "stored" for x in r.json()), r.text
        tiers = {t["name"]: t for t in c.get("/v1/stats").json()["tiers"]}
    below = tiers.get("disk") or tiers["redis"]
    assert below["blocks"] == 0  # write-back: all of it in the CPU tier only


def summary(output: str) -> tuple[int, int, int]:
    """(written, of, left behind) from the shutdown's summary line."""
    found = SUMMARY.findall(output)
    assert len(found) == 1, output
    return tuple(int(n.replace(",", "")) for n in found[0])  # type: ignore[return-value]


def served(srv: Server, chains: list[list[tuple[bytes, bytes]]]) -> int:
    """How many blocks ``srv`` serves, each byte for byte as sent; a chain's are a prefix of it."""
    count = 0
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for blocks in chains:
            statuses = []
            for h, frame in blocks:
                r = c.get(f"/v1/blocks/{h.hex()}")
                statuses.append(r.status_code)
                if r.status_code == 200:
                    assert r.content == frame
                    count += 1
            assert statuses == sorted(statuses), f"a tail without its head: {statuses}"  # 200s, then 404s
    return count


WRITE_BACK = ("--no-write-through", "--log-level", "info", "--cpu-bytes", "128MiB")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_write_back_server_stopped_cleanly_keeps_its_memory_for_the_restart(tmp_path, sig):
    """Without the drain, a SIGTERM lost every block the CPU tier had not demoted yet (here all
    of them: a restart answered 404 for each). A SIGHUP (a closed terminal) killed the process
    the same way, undrained and unsaid: it stops it as SIGTERM does."""
    chains = [raw_chain(seed, 4) for seed in range(1, 6)]
    srv = Server(tmp_path, *WRITE_BACK).start()
    try:
        ingest(srv, chains)
        srv.proc.send_signal(sig)
        assert srv.proc.wait(30) == 0, srv.output()
    finally:
        srv.kill()
    with Server(tmp_path, *WRITE_BACK) as again:
        assert served(again, chains) == 20
    assert summary(srv.output()) == (20, 20, 0)


def test_a_stopped_server_ends_without_the_interpreters_finalization_and_loses_nothing(tmp_path):
    """Once its store is closed and its log flushed, ``cacheseek serve`` ends at once
    (``cli.run``): an exit hook of this interpreter (a sitecustomize's) never runs, the
    shutdown's summary is in the log, exit code 0, and a restart serves every block."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "if sys.argv[1:2] == ['serve']:\n"
        "    atexit.register(lambda: open(os.environ['EXIT_HOOK_FILE'], 'w').close())\n")
    hook = tmp_path / "finalized"
    hooked = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
              "EXIT_HOOK_FILE": str(hook)}
    # (the hook works: ``serve --help`` exits from its parser, through the finalization)
    subprocess.run([*cacheseek_command(), "serve", "--help"], env={**os.environ, **hooked}, capture_output=True,
                   check=True)
    assert hook.exists()
    hook.unlink()
    chains = [raw_chain(seed, 4) for seed in range(7, 9)]
    srv = Server(tmp_path, *WRITE_BACK, env=hooked).start()
    try:
        ingest(srv, chains)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.output()
    finally:
        srv.kill()
    assert summary(srv.output()) == (8, 8, 0) and not hook.exists()
    with Server(tmp_path, *WRITE_BACK) as again:
        assert served(again, chains) == 8


def test_the_shutdown_summary_says_how_many_blocks_the_disk_filter_held_back(tmp_path):
    """A drain skipped the blocks the disk's filter did not admit without counting them as
    refused anywhere: the summary's "skipped" mixed them with tails and blocks gone."""
    chains = [raw_chain(8, 3)]  # ingested once: used once, under a filter admitting twice-used blocks
    with Server(tmp_path, *WRITE_BACK, "--disk-admit-after-uses", "2") as srv:
        ingest(srv, chains)
    assert summary(srv.output()) == (0, 3, 0)
    assert "(3 not admitted by its filter, disk_admit_after_uses)" in srv.output()


def test_with_the_drain_off_the_memory_is_lost_as_before(tmp_path):
    chains = [raw_chain(7, 4)]
    with Server(tmp_path, *WRITE_BACK, "--shutdown-drain-seconds", "0") as srv:
        ingest(srv, chains)
    assert "shutdown: wr" not in srv.output()
    with Server(tmp_path, *WRITE_BACK) as again:
        assert served(again, chains) == 0


def test_a_drain_out_of_time_leaves_whole_blocks_and_says_how_many_it_left(tmp_path):
    chains = [raw_chain(seed, 8) for seed in range(100, 220)]  # 960 blocks, 32 MiB, fsynced in groups of 16
    with Server(tmp_path, *WRITE_BACK, "--shutdown-drain-seconds", "0.02") as srv:
        ingest(srv, chains)
    written, of, left = summary(srv.output())
    assert of == 960 and left > 0 and written + left == 960
    assert "WARNING" in next(line for line in srv.output().splitlines() if "shutdown: wrote" in line)
    assert "the time limit ran out (shutdown_drain_seconds 0.02 s)" in srv.output()
    with Server(tmp_path, *WRITE_BACK) as again:
        assert served(again, chains) == written


def test_a_second_sigint_stops_the_drain_and_keeps_what_it_wrote(tmp_path):
    chains = [raw_chain(seed, 8) for seed in range(300, 500)]  # 1600 blocks, 52 MiB: seconds of fsyncs
    srv = Server(tmp_path, *WRITE_BACK, "--shutdown-drain-seconds", "300").start()
    try:
        ingest(srv, chains)
        srv.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "shutdown: writing 1,600 blocks" not in srv.output():
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.output()
            time.sleep(0.005)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0, srv.output()
    finally:
        srv.kill()
    output = srv.output()
    written, of, left = summary(output)
    assert "a second SIGINT stopped it" in output and left > 0 and written + left == of == 1600, output
    assert "Traceback" not in output and "Application shutdown complete" in output
    with Server(tmp_path, *WRITE_BACK) as again:
        assert served(again, chains) == written


@needs_redis
def test_a_write_back_server_over_redis_drains_into_redis(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    args = (*WRITE_BACK, "--redis-url", redis.url, "--redis-bytes", "64MiB")
    chains = [raw_chain(seed, 4) for seed in range(400, 403)]
    try:
        with Server(tmp_path / "a", *args, disk=False) as srv:
            ingest(srv, chains)
        with Server(tmp_path / "b", *args, disk=False) as again:  # (another host: nothing of its own)
            assert served(again, chains) == 12
        assert summary(srv.output()) == (12, 12, 0) and "to the redis tier" in srv.output()
    finally:
        redis.stop()


@needs_redis
def test_what_the_disk_refuses_at_a_clean_stop_goes_on_to_redis(tmp_path):
    """A disk that admits blocks only after two uses, over Redis: each block used once was
    counted skipped by the drain and lost at the stop, though an eviction would have handed
    it to Redis. The drain hands it on, and a restart (another host's disk) serves it."""
    redis = RedisServer(tmp_path / "redis").start()
    args = (*WRITE_BACK, "--redis-url", redis.url, "--redis-bytes", "64MiB", "--disk-admit-after-uses", "2")
    chains = [raw_chain(seed, 4) for seed in range(410, 413)]
    try:
        with Server(tmp_path / "a", *args) as srv:
            ingest(srv, chains)
        assert summary(srv.output()) == (12, 12, 0), srv.output()
        assert "(12 of them, which it refused, to the redis tier below it)" in srv.output()
        with Server(tmp_path / "b", *args) as again:
            assert served(again, chains) == 12
    finally:
        redis.stop()


def test_the_setting_takes_seconds_from_its_flag_and_variable_and_refuses_a_negative(monkeypatch):
    from pydantic import ValidationError

    from server.config import ServerSettings

    assert ServerSettings().shutdown_drain_seconds == 30
    monkeypatch.setenv("CACHESEEK_SHUTDOWN_DRAIN_SECONDS", "2.5")
    assert ServerSettings.load().shutdown_drain_seconds == 2.5
    assert ServerSettings.load(shutdown_drain_seconds=0).shutdown_drain_seconds == 0
    with pytest.raises(ValidationError, match="shutdown_drain_seconds"):
        ServerSettings.load(shutdown_drain_seconds=-1)


def test_a_server_started_under_nohup_outlives_its_terminal(tmp_path):
    """SIGHUP stops the server as SIGTERM does, but not where it was ignored when the server
    started (nohup): the handler took it over, and a logout stopped a server run to outlive it."""
    srv = Server(tmp_path, *WRITE_BACK)
    srv._limits = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (as nohup leaves it: inherited)
    srv.start()
    try:
        srv.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert srv.proc.poll() is None and httpx.get(srv.url + "/readyz", timeout=5).status_code == 200
    finally:
        srv.stop()
