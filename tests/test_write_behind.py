"""``RemoteCache`` ingests with ``wait=False`` against a real server: the call returns once
the KV is read, the lookup and the upload follow on the sender thread, in order; what they
store and count is what a waited ingest stores and counts; the backlog is bounded; close
sends what is queued; an outage is counted as for a waited ingest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import cacheseek as cs
from server_helpers import Server
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for


def _remote(srv, codec=None, **kw):
    return cs.RemoteCache(srv.url, model_id="behind", layout=LAYOUT, codec=codec or cs.KIVI(bits=4, group_size=32),
                          block_tokens=BLOCK, **kw)


def _paged(n_pages=24):
    from paged_helpers import engine_pages

    return engine_pages("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, n_pages, 16,
                        LAYOUT.torch_dtype)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("behind")) as server:
        yield server


def test_a_batch_sent_behind_stores_and_counts_what_a_waited_one_does(srv):
    """Two requests sharing a prefix, one of them half stored already: the future's results
    equal a waited call's on a twin namespace, the frames stored are the same bytes, and the
    pages were read before the call returned (overwritten at once, nothing of it is stored)."""
    from paged_helpers import page_tables, write_tokens

    shared = tokens_for(1, BLOCK)
    toks = [shared + tokens_for(2, 2 * BLOCK), shared + tokens_for(3, BLOCK)]
    tables = page_tables([3 * BLOCK, 2 * BLOCK], 16, 24, seed=5)
    got = {}
    for name in ("waited", "behind", "first"):  # (first: look_up_first=True)
        pages, tensors = _paged()
        kvs = [make_kv(3 * BLOCK, 1), make_kv(2 * BLOCK, 2)]
        for (k0, v0), (k1, v1) in zip(*kvs):  # one prefix: the same KV
            k1[:, :BLOCK], v1[:, :BLOCK] = k0[:, :BLOCK], v0[:, :BLOCK]
        for kv, ids in zip(kvs, tables):
            write_tokens(pages, kv, ids)
        requests = [cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)]
        with _remote(srv, namespace=name) as cache:
            head = cache.ingest(toks[0][: 2 * BLOCK], pages.at(tables[0]), wait=name == "waited")
            assert (head if name == "waited" else head.result(timeout=60)).stored == 2
            if name == "waited":
                results = cache.ingest_batch(requests, pages)
            else:
                future = cache.ingest_batch(requests, pages, wait=False, look_up_first=name == "first")
                for t in tensors:  # the engine reuses its pages as soon as the call returns
                    t.fill_(7.0)
                results = future.result(timeout=60)
                behind = cache.client_stats()["write_behind"]
                assert behind["writes_done"] == 2
                if name == "first":  # the 2 new blocks' frames alone waited: the 3 stored, not encoded
                    assert behind["pending_bytes_high"] == 2 * cache._pending_frame_bytes
            loaded = cache.materialize(toks[0])
            got[name] = ([(r.blocks, r.stored, r.present, r.failed, r.errors) for r in results],
                         [(k.clone(), v.clone()) for k, v in loaded.layers], loaded.num_tokens)
    assert got["behind"][0] == got["first"][0] == got["waited"][0] == [(3, 1, 2, 0, {}), (2, 1, 1, 0, {})]
    assert got["behind"][2] == got["first"][2] == got["waited"][2] == 3 * BLOCK
    for name in ("behind", "first"):
        for (kb, vb), (kw, vw) in zip(got[name][1], got["waited"][1]):
            assert kb.equal(kw) and vb.equal(vw)


def test_a_lookup_made_first_holds_the_call_no_longer_than_its_wait(tmp_path):
    """The server accepts and never answers (SIGSTOP): the lookup made first held the call
    for the client's whole timeout, inside an engine's step. Past ``look_up_wait`` the call
    encodes every block, as without ``look_up_first``, and returns; the write is sent once
    the server answers again."""
    from paged_helpers import page_tables, write_tokens

    toks = tokens_for(75, 3 * BLOCK)
    [table] = page_tables([3 * BLOCK], 16, 24, seed=8)
    pages, _ = _paged()
    write_tokens(pages, make_kv(3 * BLOCK, 75), table)
    with Server(tmp_path) as server, _remote(server, codec=cs.Raw(), timeout=30) as cache:
        cache.lookup(toks)  # (the connection open, the server warm)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            future = cache.ingest_batch([cs.PagedRequest(toks, table)], pages, wait=False, look_up_first=True,
                                        look_up_wait=0.2)
            held = time.monotonic() - t0
            # The next one, its lookup still out: none sent (late lookups would pile up,
            # each sent once the server answers again), every block encoded at once.
            t0 = time.monotonic()
            again = cache.ingest_batch([cs.PagedRequest(toks, table)], pages, wait=False, look_up_first=True,
                                       look_up_wait=5)
            held_again = time.monotonic() - t0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert 0.2 <= held < 5 and held_again < 2, (held, held_again)
        [r] = future.result(timeout=60)
        assert (r.stored, r.present) == (3, 0)
        [r] = again.result(timeout=60)
        assert r.stored + r.present == 3
        behind = cache.client_stats()["write_behind"]
        assert behind["lookups_first_late"] == 2 and behind["pending_bytes_high"] >= 3 * cache._pending_frame_bytes


def test_a_write_that_looks_up_first_meets_an_outage_as_a_waited_write_does(tmp_path):
    """``look_up_first``'s lookup is made in the call: the server gone, it raises there
    (``on_unavailable="raise"``), or answers every block failed at once ("miss"), nothing
    queued; and a write it leaves past ``max_pending_bytes`` counts failed only the blocks
    not found stored."""
    from paged_helpers import page_tables, write_tokens

    toks = tokens_for(70, 3 * BLOCK)
    [table] = page_tables([3 * BLOCK], 16, 24, seed=7)
    pages, _ = _paged()
    write_tokens(pages, make_kv(3 * BLOCK, 70), table)
    request = [cs.PagedRequest(toks, table)]
    with Server(tmp_path) as server:
        url = server.url
        with _remote(server, codec=cs.Raw()) as cache:
            assert cache.ingest(toks[: 2 * BLOCK], pages.at(table)).stored == 2
        with _remote(server, codec=cs.Raw(), max_pending_bytes=1) as cache:
            [r] = cache.ingest_batch(request, pages, wait=False, look_up_first=True).result(timeout=60)
            assert (r.blocks, r.present, r.stored, r.failed) == (3, 2, 0, 1) and "backlog" in r.errors
            assert cache.client_stats()["write_behind"]["blocks_refused"] == 1
    for mode in ("miss", "raise"):
        with cs.RemoteCache(url, model_id="behind", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                            on_unavailable=mode) as cache:
            if mode == "raise":
                with pytest.raises(cs.RemoteUnavailable):
                    cache.ingest_batch(request, pages, wait=False, look_up_first=True)
            else:
                future = cache.ingest_batch(request, pages, wait=False, look_up_first=True)
                assert future.done()
                [r] = future.result()
                assert (r.stored, r.failed) == (0, 3) and "server" in r.errors
                assert cache.client_stats()["dropped_blocks"] == 3
            assert cache.client_stats()["write_behind"]["writes_queued"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh tests-behind)"))])
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_contiguous_kv_is_read_before_the_call_returns(srv, device, codec):
    """The KV zeroed as soon as the call returns: what is stored is what it held."""
    toks, kv = tokens_for(10, 2 * BLOCK + 3), [(k.to(device), v.to(device)) for k, v in make_kv(2 * BLOCK + 3, 10)]
    with _remote(srv, codec=codec, namespace=f"contiguous-{device}-{codec.name}") as cache:
        with _remote(srv, codec=codec, namespace=f"contiguous-waited-{device}-{codec.name}") as waited:
            assert waited.ingest(toks, kv).stored == 2
            expected = [(k.cpu(), v.cpu()) for k, v in waited.materialize(toks, device="cpu").layers]
        future = cache.ingest(toks, kv, wait=False)
        for k, v in kv:
            k.zero_()
            v.zero_()
        result = future.result(timeout=60)
        assert (result.blocks, result.stored, result.present, result.failed) == (2, 2, 0, 0)
        got = cache.materialize(toks, device="cpu")
    assert got.num_tokens == 2 * BLOCK
    for (k, v), (ek, ev) in zip(got.layers, expected):
        assert k.equal(ek) and v.equal(ev)


def test_bad_input_raises_in_the_call_and_queues_nothing(srv):
    toks, kv = tokens_for(20, 2 * BLOCK), make_kv(2 * BLOCK, 20)
    kv[1][1][0, BLOCK + 1, 3] = float("nan")
    with _remote(srv, namespace="bad") as cache:
        with pytest.raises(cs.InputError, match="NaN or Inf"):
            cache.ingest(toks, kv, wait=False)
        with pytest.raises(cs.InputError, match="wait=False: not with layerwise=True"):
            cache.ingest_batch([cs.PagedRequest(toks, list(range(8)))], _paged()[0], layerwise=True, wait=False)
        stats = cache.client_stats()["write_behind"]
        assert stats["writes_queued"] == 0 and stats["pending_bytes"] == 0
        assert cache.lookup(toks) == 0


def test_past_max_pending_bytes_a_write_is_dropped_not_queued(tmp_path):
    """The server stopped (SIGSTOP) with one write in flight: the next write that would pass
    the bound is answered at once, its blocks failed; the first is stored once the server
    runs again, and the bound's room is given back."""
    toks = [tokens_for(30 + i, 2 * BLOCK) for i in range(3)]
    with Server(tmp_path) as server:
        with _remote(server, codec=cs.Raw(), timeout=60) as probe:
            frame = probe._pending_frame_bytes
            assert frame < probe.block_format.planned_payload().nbytes + 1024  # (it counted 64 KiB a frame more)
        with _remote(server, codec=cs.Raw(), timeout=60, max_pending_bytes=3 * frame) as cache:
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                first = cache.ingest(toks[0], make_kv(2 * BLOCK, 30), wait=False)
                refused = cache.ingest(toks[1], make_kv(2 * BLOCK, 31), wait=False)
                assert refused.done() and not first.done()
                r = refused.result()
                assert (r.stored, r.failed) == (0, 2)
                assert r.errors["backlog"] == (f"this write's 2 frames ({2 * frame} bytes at most) would pass "
                                               f"max_pending_bytes ({3 * frame}) beside the {2 * frame} bytes "
                                               "waiting to be sent: dropped")
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert first.result(timeout=60).stored == 2
            third = cache.ingest(toks[2], make_kv(2 * BLOCK, 32), wait=False).result(timeout=60)
            assert third.stored == 2
            stats = cache.client_stats()
            assert stats["write_behind"]["writes_refused"] == 1 and stats["write_behind"]["pending_bytes"] == 0
            # this client's own bound, no outage: not an outage's dropped_blocks (counted there in
            # either on_unavailable mode, where the docs said outages turned into misses)
            assert stats["write_behind"]["blocks_refused"] == 2 and stats["dropped_blocks"] == 0
            assert [cache.lookup(t) for t in toks] == [2 * BLOCK, 0, 2 * BLOCK]


def test_close_sends_what_is_queued_and_later_calls_raise(srv):
    toks = [tokens_for(40 + i, 3 * BLOCK) for i in range(4)]
    cache = _remote(srv, namespace="close")
    futures = [cache.ingest(t, make_kv(3 * BLOCK, 40 + i), wait=False) for i, t in enumerate(toks)]
    cache.close()
    assert all(f.done() and f.result().stored == 3 for f in futures)
    buffers = cache.client_stats()["write_buffers"]  # let go at close, still counted
    assert buffers["free_bytes"] == 0 and buffers["leases_granted"] >= 4 and buffers["leases_active"] == 0
    with pytest.raises(RuntimeError):
        cache.ingest(toks[0], make_kv(3 * BLOCK, 40), wait=False)
    with _remote(srv, namespace="close") as other:
        assert [other.lookup(t) for t in toks] == [3 * BLOCK] * 4


def test_flush_waits_for_every_write_made_before_it(srv):
    with _remote(srv, namespace="flush") as cache:
        futures = []
        threads = [threading.Thread(target=lambda i=i: futures.append(
            cache.ingest(tokens_for(50 + i, BLOCK), make_kv(BLOCK, 50 + i), wait=False))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert cache.flush(timeout=60)
        assert all(f.done() for f in futures)
        assert sum(f.result().stored for f in futures) == 4


def test_an_outage_is_counted_as_for_a_waited_write(tmp_path):
    """The server gone: with on_unavailable="miss" the future's blocks are failed and counted
    dropped; with "raise" the future holds the RemoteUnavailable."""
    toks = tokens_for(60, 2 * BLOCK)
    server = Server(tmp_path).start()
    url = server.url
    server.stop()
    for mode in ("miss", "raise"):
        with cs.RemoteCache(url, model_id="behind", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                            on_unavailable=mode) as cache:
            future = cache.ingest(toks, make_kv(2 * BLOCK, 60), wait=False)
            if mode == "miss":
                r = future.result(timeout=60)
                assert (r.stored, r.failed) == (0, 2) and "server" in r.errors
                assert cache.client_stats()["dropped_blocks"] == 2
            else:
                assert isinstance(future.exception(timeout=60), cs.RemoteUnavailable)


def test_a_queued_write_cannot_be_cancelled_and_leak_its_room(tmp_path):
    """A write queued behind one in flight (the server stopped): ``cancel()`` on its future
    cannot take it back, so it is sent, and its room and host buffers are given back. A
    cancelled one was never run: its room stayed taken for good (every later write past
    what was left refused), its buffers leased, ``flush``'s count of it pending forever."""
    toks = [tokens_for(70 + i, 2 * BLOCK) for i in range(2)]
    with Server(tmp_path) as server, _remote(server, codec=cs.Raw(), timeout=60) as cache:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            first = cache.ingest(toks[0], make_kv(2 * BLOCK, 70), wait=False)
            queued = cache.ingest(toks[1], make_kv(2 * BLOCK, 71), wait=False)
            assert not queued.cancel()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert first.result(timeout=60).stored == 2 and queued.result(timeout=60).stored == 2
        assert cache.flush(timeout=60)
        stats = cache.client_stats()["write_behind"]
        assert stats["pending_bytes"] == 0 and stats["writes_pending"] == 0
        assert cache._host_buffers.stats()["leases_active"] == 0
        assert [cache.lookup(t) for t in toks] == [2 * BLOCK] * 2


@pytest.mark.parametrize("lands", ["before", "after"])  # the executor's submit: before or after it took the write
def test_an_interrupt_as_a_write_is_queued_never_sends_another_writes_kv(srv, lands):
    """An interrupt (Ctrl-C) landing in the executor's ``submit`` after it had queued the
    write: the call gave the write's host buffers back, the queued send still read them, and
    the next ``wait=False`` ingest wrote its frames there, so the server stored that request's
    KV under this one's hashes and served it to every client. The write is now the caller's to
    take back, or the sender's to send, never both."""
    from cacheseek import write_behind
    from store_helpers import interrupting_executor

    seed = {"before": 300, "after": 310}[lands]
    toks = [tokens_for(seed + i, 4 * BLOCK) for i in range(3)]
    kvs = [make_kv(4 * BLOCK, seed + i) for i in range(3)]
    with _remote(srv, codec=cs.Raw()) as cache:
        gate = threading.Event()
        real_send = cache._send_behind

        def held_send(*args):
            assert gate.wait(30)  # a slow upload: the caller goes on meanwhile
            return real_send(*args)

        cache._send_behind = held_send
        behind = cache._behind
        interrupting = interrupting_executor(lands)
        interrupting.armed = False  # (the first write goes; the second is queued behind it)
        with behind._lock:
            behind._executor = interrupting(max_workers=1, thread_name_prefix="cacheseek-write-behind")
            write_behind._open.add(behind)
        first = cache.ingest(toks[0], kvs[0], wait=False)
        interrupting.armed = True
        with pytest.raises(KeyboardInterrupt):
            cache.ingest(toks[1], kvs[1], wait=False)
        third = cache.ingest(toks[2], kvs[2], wait=False)  # (reused the buffers the queued send read)
        gate.set()
        assert cache.flush(timeout=60)
        assert first.result().stored == 4 and third.result().stored == 4
        stats = cache.client_stats()["write_behind"]
        assert stats["pending_bytes"] == 0 and stats["writes_pending"] == 0, stats
        assert cache._host_buffers.stats()["leases_active"] == 0
        assert cache.lookup(toks[1]) == 0  # taken back: not sent
        assert_prefix_equal(cache.materialize(toks[2]), kvs[2], 4 * BLOCK)


def test_a_write_interrupted_before_its_handover_is_made_keeps_no_room(srv, monkeypatch):
    """The hand-over token was made after the write's room was taken and before the ``try``
    that gives it back: an interrupt there (a Python call) kept the room for good."""
    from cacheseek import remote as remote_mod

    class Interrupted:
        def __init__(self) -> None:
            raise KeyboardInterrupt

    with _remote(srv, codec=cs.Raw()) as cache:
        monkeypatch.setattr(remote_mod, "Handover", Interrupted)
        with pytest.raises(KeyboardInterrupt):
            cache.ingest(tokens_for(320, 2 * BLOCK), make_kv(2 * BLOCK, 320), wait=False)
        monkeypatch.undo()
        assert cache.client_stats()["write_behind"]["pending_bytes"] == 0


def test_a_second_close_from_another_thread_waits_for_the_queue_to_be_sent(tmp_path):
    """Two threads closing one cache: the second returned at once and closed the connections
    while the first was still sending the queue, whose writes then failed ("closed")."""
    toks = [tokens_for(70 + i, 2 * BLOCK) for i in range(2)]
    with Server(tmp_path) as server:
        cache = _remote(server, codec=cs.Raw(), timeout=60)
        futures = [cache.ingest(t, make_kv(2 * BLOCK, 70 + i), wait=False) for i, t in enumerate(toks)]
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            first = threading.Thread(target=cache.close)
            first.start()
            time.sleep(0.2)
            second = threading.Thread(target=cache.close)
            second.start()
            second.join(0.5)
            assert second.is_alive()  # waiting for the first, not closing under it
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        first.join(60)
        second.join(60)
        assert [f.result(timeout=1).stored for f in futures] == [2, 2]
        with _remote(server, codec=cs.Raw()) as other:
            assert [other.lookup(t) for t in toks] == [2 * BLOCK] * 2


def test_a_batch_dropped_for_the_backlog_counts_its_blocks_per_request(srv, caplog):
    """Every request's blocks failed, and ``write_behind.blocks_refused`` their sum, a block two
    requests share counted for both, as a waited ingest's outage counts its dropped blocks. A
    bound below one write refused every write, counted and never said: the first of a run is
    logged."""
    from paged_helpers import page_tables, write_tokens

    shared = tokens_for(80, BLOCK)
    toks = [shared + tokens_for(81, 2 * BLOCK), shared + tokens_for(82, BLOCK)]
    tables = page_tables([3 * BLOCK, 2 * BLOCK], 16, 24, seed=6)
    pages, _ = _paged()
    for kv, ids in zip([make_kv(3 * BLOCK, 80), make_kv(2 * BLOCK, 81)], tables):
        write_tokens(pages, kv, ids)
    with _remote(srv, namespace="backlog", max_pending_bytes=1) as cache:
        results = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages,
                                     wait=False).result(timeout=60)
        assert [(r.stored, r.failed) for r in results] == [(0, 3), (0, 2)]
        assert all("max_pending_bytes" in r.errors["backlog"] for r in results)
        assert cache.client_stats()["write_behind"]["blocks_refused"] == 5
        assert cache.client_stats()["dropped_blocks"] == 0
        again = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages, wait=False)
        assert [r.failed for r in again.result(timeout=60)] == [3, 2]
    said = [r.getMessage() for r in caplog.records if "was refused: it would pass max_pending_bytes (1)" in r.getMessage()]
    assert len(said) == 1, said  # (once a run: the second refusal in a row is counted, not said again)


def test_writes_that_fail_behind_the_call_are_counted_and_logged_once_per_run(srv, caplog):
    """A write whose sender raised (its future holds the error) was counted done like any
    other and logged nowhere, and a write whose blocks failed was counted nowhere: a caller
    that drops its futures (the point of wait=False) could not tell its writes were not
    stored. Both are counted now (``writes_failed`` with ``last_error``, ``blocks_failed``),
    and the first failure of a run is logged once."""
    toks = [tokens_for(100 + i, 2 * BLOCK) for i in range(3)]
    kvs = [make_kv(2 * BLOCK, 100 + i) for i in range(3)]
    # A frame no body of this client can hold: each write raises ConfigError on the sender.
    with caplog.at_level("WARNING", logger="cacheseek.remote"), \
            _remote(srv, codec=cs.Raw(), namespace="failing", max_body_bytes=1000) as cache:
        futures = [cache.ingest(t, kv, wait=False) for t, kv in zip(toks, kvs)]
        assert cache.flush(timeout=60)
        assert all(isinstance(f.exception(), cs.ConfigError) for f in futures)
        stats = cache.client_stats()["write_behind"]
        assert stats["writes_failed"] == 3 and stats["writes_done"] == 3, stats
        assert "ConfigError" in stats["last_error"] and "max_body_bytes" in stats["last_error"]
    logged = [r.getMessage() for r in caplog.records if "in the background" in r.getMessage()]
    assert len(logged) == 1 and "max_body_bytes" in logged[0]
    # An outage under "miss": no error, the blocks answered failed, and counted.
    from server_helpers import free_port

    with cs.RemoteCache(f"http://127.0.0.1:{free_port()}", model_id="behind", layout=LAYOUT, codec=cs.Raw(),
                        block_tokens=BLOCK, timeout=5, on_unavailable="miss") as cache:
        assert cache.ingest(toks[0], kvs[0], wait=False).result(timeout=60).failed == 2
        stats = cache.client_stats()["write_behind"]
        assert stats["blocks_failed"] == 2 and stats["writes_failed"] == 0, stats


def test_a_write_that_meets_a_close_from_another_thread_raises_the_caches_closed_error(srv, monkeypatch):
    """An ``ingest(wait=False)`` under way while another thread closes the cache (past its
    check that the cache is open, before its write is queued) raised ``RuntimeError("the
    cache is closed")``, not the error every call after ``close()`` raises; its buffers and
    room are given back either way."""
    from cacheseek import remote as remote_module

    toks, kv = tokens_for(110, 2 * BLOCK), make_kv(2 * BLOCK, 110)
    cache = _remote(srv, codec=cs.Raw(), namespace="close-race")
    copy = remote_module.frames_to_host

    def closed_meanwhile(*args, **kw):
        out = copy(*args, **kw)
        closer = threading.Thread(target=cache.close)
        closer.start()
        closer.join(10)
        return out

    monkeypatch.setattr(remote_module, "frames_to_host", closed_meanwhile)
    with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
        cache.ingest(toks, kv, wait=False)
    stats = cache.client_stats()
    assert stats["write_buffers"]["leases_active"] == 0 and stats["write_behind"]["pending_bytes"] == 0


def test_close_with_writes_queued_for_a_server_that_dribbles_takes_one_exchange_timeout():
    """A server (or a front) that dribbles its answers, each read within ``timeout``: every
    queued write's lookup ran to ``exchange_timeout`` until the breaker opened, so ``close()``
    took ``failure_threshold`` (3) times ``exchange_timeout``, more with a lenient breaker.
    The writes still unsent ``exchange_timeout`` after ``close()`` began are dropped as in an
    outage, and it returns then."""
    from fake_http import FakeServer

    def dribble(n: int, head: bytes):
        def pieces():  # a byte every 50 ms: each read well within the 5 s timeout
            yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4000\r\n\r\n"
            for _ in range(4000):
                time.sleep(0.05)
                yield b" "
        return pieces(), True

    from cacheseek.store.breaker import CircuitBreaker

    lenient = CircuitBreaker(failure_threshold=100)
    with FakeServer(dribble) as front:
        cache = cs.RemoteCache(front.url, model_id="behind", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                               timeout=5, exchange_timeout=1.0, on_unavailable="miss", trust_env=False, breaker=lenient)
        futures = [cache.ingest(tokens_for(120 + i, 2 * BLOCK), make_kv(2 * BLOCK, 120 + i), wait=False)
                   for i in range(4)]
        start = time.monotonic()
        cache.close()
        took = time.monotonic() - start
        assert took < 1.8, took
        results = [f.result(timeout=1) for f in futures]
        assert all((r.stored, r.failed) == (0, 2) and "server" in r.errors for r in results), results
        stats = cache.client_stats()
        assert stats["write_behind"]["pending_bytes"] == 0 and stats["write_buffers"]["leases_active"] == 0


EXIT_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    if {futures_first!r}:
        import concurrent.futures.thread  # (its exit hook registered before cacheseek is imported)
    import cacheseek as cs
    from cacheseek.store.breaker import CircuitBreaker
    from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for
    cache = cs.RemoteCache({url!r}, model_id="behind", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           exchange_timeout={exchange_timeout!r}, on_unavailable="miss", trust_env=False,
                           breaker=CircuitBreaker(failure_threshold=100), namespace="exit", **{extra!r})
    futures = [cache.ingest(tokens_for(300 + i, 2 * BLOCK), make_kv(2 * BLOCK, 300 + i), wait=False)
               for i in range(4)]
    if not {futures_first!r}:
        from concurrent.futures import ThreadPoolExecutor  # (another user of the executors, after the cache)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(int).result()
    print("QUEUED", flush=True)
    sys.stdin.readline()  # (the test's word that the server holds an exchange under way)
    # exits here, the cache never closed
""")


def _exit_child(url: str, *, futures_first: bool, exchange_timeout: float, **extra) -> subprocess.Popen:
    extra.setdefault("timeout", 5)
    script = EXIT_CHILD.format(here=str(Path(__file__).resolve().parent), url=url, futures_first=futures_first,
                               exchange_timeout=exchange_timeout, extra=extra)
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("futures_first", "answer"), [(True, "dribbled"), (False, "silent")],
                         ids=["futures-imported-first-dribbled", "futures-used-after-silent"])
def test_a_process_that_never_closes_its_cache_exits_within_exit_timeout_against_a_slow_server(futures_first, answer):
    """``wait=False`` writes queued for a server that dribbles its answers (or sends none,
    its read timeout 5 s away), and the process exits without ``close()``: Python's own exit
    drained the sender's queue, each write's exchange running to ``exchange_timeout`` (here
    30 s, 600 by default) until the breaker opened (a lenient one here: never), so the
    process hung for minutes. It exits once ``exit_timeout`` (5 s by default) has passed,
    whether concurrent.futures was imported before cacheseek or used after the cache was made."""
    stop, asked = threading.Event(), threading.Event()

    def slow(n: int, head: bytes):
        asked.set()
        def pieces():  # a byte every 50 ms: each read well within the 5 s timeout
            yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4000\r\n\r\n"
            for _ in range(4000):
                if stop.wait(0.05 if answer == "dribbled" else 4.0):
                    return
                if answer == "dribbled":
                    yield b" "
        return pieces(), True

    from fake_http import FakeServer

    with FakeServer(slow) as front:
        child = _exit_child(front.url, futures_first=futures_first, exchange_timeout=30.0,
                            timeout=30 if answer == "silent" else 5)
        try:
            assert child.stdout.readline() == "QUEUED\n", child.stderr.read()
            assert asked.wait(10)  # an exchange under way at exit: its read is what must end
            child.stdin.write("exit\n")
            child.stdin.flush()
            queued = time.monotonic()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail("the process still ran 20 s after its last line, draining its queued writes")
            took = time.monotonic() - queued
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, child.stderr.read()
        # exit_timeout 5 s; the exchange under way cut at once then, and the interpreter's own
        # teardown (torch loaded) after it: up to 5.6 s more on a 2-core box under a full
        # suite's load. Draining instead takes exchange_timeout (30 s) a write: past the 20 s wait.
        assert 4.5 < took < 15.0, took
        assert front.requests, "the queued writes were never begun"
        assert "dropped" in child.stderr.read()
        stop.set()


def test_a_process_that_never_closes_its_cache_still_sends_its_queued_writes_to_a_server_that_answers(srv):
    """The exit bound drops only what a slow server leaves unanswered: against one that
    answers, the writes queued at exit are stored, as before."""
    child = _exit_child(srv.url, futures_first=False, exchange_timeout=30.0)
    try:
        out, err = child.communicate("exit\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0 and out == "QUEUED\n", err
    assert "dropped" not in err, err
    with _remote(srv, codec=cs.Raw(), namespace="exit") as cache:
        assert [cache.lookup(tokens_for(300 + i, 2 * BLOCK)) for i in range(4)] == [2 * BLOCK] * 4


LEFT_RUNNING_CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {here!r})
    import cacheseek as cs
    from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for
    cache = cs.RemoteCache({url!r}, model_id="behind", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           namespace="left-running", trust_env=False, exit_timeout=0)

    def worker():
        while threading.main_thread().is_alive():  # (until the main thread has ended: the exit hooks ran)
            time.sleep(0.01)
        toks = tokens_for(400, 2 * BLOCK)
        print("STORED", cache.ingest(toks, make_kv(2 * BLOCK, 400)).stored, cache.lookup(toks), flush=True)
        cache.close()

    threading.Thread(target=worker).start()
    futures = [cache.ingest(tokens_for(410 + i, 2 * BLOCK), make_kv(2 * BLOCK, 410 + i), wait=False)
               for i in range(4)]
""")


def test_exit_cuts_only_the_sender_and_a_thread_left_running_goes_on_using_the_cache(srv):
    """The exit hooks run when the main thread ends, while threads the program left running
    go on: the cut at exit is the sender's alone, so a waited call from such a thread, after
    it, is sent and answered (``exit_timeout=0``: a cut of every exchange would fail it)."""
    script = LEFT_RUNNING_CHILD.format(here=str(Path(__file__).resolve().parent), url=srv.url)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout == f"STORED 2 {2 * BLOCK}\n", (child.stdout, child.stderr[-2000:])


def test_writes_the_exit_cut_ended_are_reported_dropped_though_the_queue_drained(monkeypatch, caplog):
    """At exit, the cut comes due as the exit hook's wait for the queue ends: writes it failed
    (answered as misses: ``on_unavailable="miss"``) could drain the queue just before that wait
    returned (a thread woken late, under load), and the hook took that for every write answered:
    4 writes dropped, and not a line said so (test_a_process_that_never_closes... failed so, 2 of
    8 runs under CPU load). Here the hook's wait wakes after the sender has failed them all."""
    from cacheseek import write_behind as wb

    cut: dict[str, float] = {}

    def cut_off(when: float, thread: int | None = None) -> None:
        cut.setdefault("when", when)

    def send():
        while "when" not in cut or time.monotonic() < cut["when"]:  # (held until the cut, as an exchange is)
            time.sleep(0.005)
        return "missed"

    real_wait = wb.wait

    def woken_late(fs, timeout=None):
        real_wait(fs, timeout=timeout)
        real_wait(fs, timeout=10)  # (the sender, running meanwhile, ends every write)
        return real_wait(fs, timeout=0)

    behind = wb.WriteBehind(1 << 20, owner="late", exit_timeout=0.2, cut_off=cut_off)
    monkeypatch.setattr(wb, "_open", {behind})
    monkeypatch.setattr(wb, "wait", woken_late)
    futures = []
    for _ in range(4):
        assert behind.reserve(1)
        futures.append(behind.submit(1, send))
    with caplog.at_level("WARNING", logger="cacheseek.remote"):
        wb._at_exit()
    assert all(f.result(timeout=5) == "missed" for f in futures)
    assert "late never closed: at interpreter exit, 4 writes" in caplog.text and "dropped" in caplog.text
    behind.close()


PROXIED_EXIT_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import cacheseek as cs
    from cacheseek.store.breaker import CircuitBreaker
    from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for
    # (the proxy from HTTP_PROXY, as trust_env takes it by default)
    cache = cs.RemoteCache("http://cacheseek-behind.invalid:8080", model_id="behind", layout=LAYOUT, codec=cs.Raw(),
                           block_tokens=BLOCK, timeout=5, exchange_timeout=60, exit_timeout=1,
                           on_unavailable="miss", breaker=CircuitBreaker(failure_threshold=100))
    futures = [cache.ingest(tokens_for(500 + i, 2 * BLOCK), make_kv(2 * BLOCK, 500 + i), wait=False)
               for i in range(4)]
    print("QUEUED", flush=True)
    sys.stdin.readline()
    # exits here, the cache never closed
""")


def test_exit_through_a_proxy_sends_no_write_after_the_cut_and_says_what_it_could_not_cut():
    """Through a proxy (``HTTP_PROXY``, taken by default) the cut at exit applied to nothing:
    every queued write was sent to its end after a line that said they "are dropped" (105 s
    with exit_timeout=3). The writes queued after the cut now fail unsent, and the line says
    that the one under way, its answer's head trickled by the proxy, cannot be cut."""
    from fake_http import FakeServer

    asked = threading.Event()

    def trickling_proxy(n: int, head: bytes):
        asked.set()
        answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

        def pieces():  # a byte every 100 ms, the head too: each read within the 5 s timeout
            for i in range(len(answer)):
                time.sleep(0.1)
                yield answer[i : i + 1]
        return pieces(), True

    with FakeServer(trickling_proxy) as proxy:
        env = {**os.environ, "HTTP_PROXY": f"http://127.0.0.1:{proxy.port}", "NO_PROXY": "", "no_proxy": ""}
        script = PROXIED_EXIT_CHILD.format(here=str(Path(__file__).resolve().parent))
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout.readline() == "QUEUED\n", child.stderr.read()
            assert asked.wait(10)
            child.stdin.write("exit\n")
            child.stdin.flush()
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        err = child.stderr.read()
        assert child.returncode == 0, err
        assert "through a proxy cannot be cut" in err, err
        assert len(proxy.requests) == 1, proxy.requests  # the writes after the cut: never sent
        assert proxy.requests[0].startswith(b"POST http://cacheseek-behind.invalid:8080/v1/lookup")
