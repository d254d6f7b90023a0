"""The vLLM connector against a server that hangs or trickles (a real server on loopback
behind tests/fault_proxy.py): how long a new request and an in-step load wait for it.
No vLLM: its Request is read through attributes, as tests/test_vllm_pages.py does."""

from __future__ import annotations

import threading
import logging
import time
from types import SimpleNamespace

import torch

import cacheseek as cs
from cacheseek.integrations.vllm.config import ConnectorConfig
from cacheseek.integrations.vllm.guard import StoreGuard
from cacheseek.integrations.vllm.pages import PageFormat, VllmPages
from cacheseek.integrations.vllm.plan import LoadSpec, StepPlan
from cacheseek.integrations.vllm.scheduler import SchedulerSide
from cacheseek.integrations.vllm.stores import close_cache, open_cache
from cacheseek.integrations.vllm.worker import WorkerSide
from fault_proxy import FaultProxy
from server_helpers import Server

H, D, L = 2, 16, 3
LAYOUT = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
STEP = 0.05  # how often vLLM's scheduler asks about a request it has not admitted


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                           mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)


def store(srv: Server, tokens: list[int]) -> None:
    """The first 96 of ``tokens`` (3 blocks of 32) into the server, straight (no proxy)."""
    config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32})
    cache = open_cache(config, LAYOUT, "m", cs.Shard())
    cache.ingest(tokens[:96], [(x, x + 1) for x in (torch.randn(1, H, 96, D) for _ in range(L))])
    close_cache(config, cache)


def scheduler(config: ConnectorConfig) -> tuple[SchedulerSide, object]:
    """A scheduler side as the connector builds it for ``config``."""
    cache = open_cache(config, LAYOUT, "m", cs.Shard())
    sched = SchedulerSide([cache], block_tokens=32, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                          block_ids=lambda req_id: [], lookup_wait_seconds=config.lookup_wait_seconds,
                          lookup_deadline_seconds=config.lookup_deadline)
    return sched, cache


def held_back(sched: SchedulerSide, req: SimpleNamespace, limit: float = 60.0) -> tuple[float, int | None]:
    """Ask about ``req`` every step until it is answered: how long it was held back, and the
    tokens offered (None: still held back after ``limit`` seconds)."""
    t0 = time.monotonic()
    while (got := sched.matched_tokens(req, 0)) is None and time.monotonic() - t0 < limit:
        time.sleep(STEP)
    return time.monotonic() - t0, got


def test_a_new_request_waits_for_a_hung_server_its_lookup_deadline_not_the_clients_timeout(tmp_path):
    """The server stops answering (the proxy swallows every request): the next new request
    is held back ("not yet") for lookup_deadline_seconds (0.5 s by default), then scheduled
    as a miss, and the guard rests the server, so the requests after it are not looked up
    at all (a miss at once). Each waited out the client's timeout (10 s) before."""
    tokens = list(range(3000, 3097))
    with Server(tmp_path) as srv, FaultProxy(srv.port) as proxy:
        store(srv, tokens)
        config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32,
                                             "retry_after_seconds": 30, "retry_cap_seconds": 30})
        assert config.lookup_deadline == 0.5 and config.timeout_seconds == 10
        sched, cache = scheduler(config)
        assert held_back(sched, request("before", tokens))[1] == 96
        proxy.mode = "blackhole"
        waited, got = held_back(sched, request("hung", tokens), limit=30)
        assert got == 0 and waited < 5, (waited, got)  # 10 s (the client's timeout) before
        assert sched.stats.lookups_late == 1 and sched.stats.lookup_errors == 0
        assert sched.guard.breaker.state == "open"
        # The guard resting: the next requests are misses at once, no lookup sent.
        lookups = sched.stats.lookups
        for i in range(3):
            assert held_back(sched, request(f"next{i}", tokens))[1] == 0
        assert sched.stats.lookups == lookups and sched.stats.lookup_skipped == 3
        sched.close()
        close_cache(config, cache)


def test_a_late_lookups_answer_is_never_offered_and_a_trickle_rests_the_guard(tmp_path):
    """A server whose answers trickle (a byte every 20 ms: each read well within the
    client's timeout, the lookup's answer whole after seconds): the request goes on as a
    miss at its deadline; once the late answer (a hit) has come, vLLM, asking again before
    it admits the request, is still told 0, and the step's plan loads nothing: a request
    scheduled as a miss is never loaded. The trickle is a failure to the guard (it rests),
    not a success that let every new request wait seconds for its lookup."""
    tokens = list(range(5000, 5097))
    with Server(tmp_path) as srv, FaultProxy(srv.port, trickle_seconds=0.02) as proxy:
        store(srv, tokens)
        config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32,
                                             "lookup_deadline_seconds": 0.3, "retry_after_seconds": 30,
                                             "retry_cap_seconds": 30})
        sched, cache = scheduler(config)
        assert held_back(sched, request("warm", tokens))[1] == 96  # (the pooled connection the trickle takes)
        answers: list[int] = []
        answered = threading.Event()
        locate = cache.locate

        def locate_and_tell(keys):
            found = locate(keys)
            answers.append(found.num_tokens)
            answered.set()
            return found

        cache.locate = locate_and_tell  # (the lookup threads call it: to know when the late answer came)
        proxy.mode = "trickle"
        slow = request("slow", tokens)
        waited, got = held_back(sched, slow)
        assert got == 0 and waited < 5, (waited, got)  # the whole trickled answer, seconds, before
        assert sched.stats.lookups_late == 1 and sched.guard.breaker.state == "open"
        # The late lookup still runs on its thread: its answer, a hit, comes, and is not used.
        assert answered.wait(60) and answers == [96]
        assert sched.matched_tokens(slow, 0) == 0
        sched.after_alloc(slow, 0)
        new = [SimpleNamespace(req_id="slow", num_computed_tokens=0)]
        plan = sched.plan(SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens={"slow": 97},
                                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))
        assert plan.loads == [] and sched.stats.lookup_hit_tokens == 0
        sched.close()
        close_cache(config, cache)


def test_a_burst_of_new_requests_behind_a_trickling_server_waits_the_deadline_not_the_lookup_queue(tmp_path, caplog):
    """24 new requests at once, the server trickling: the scheduler's 8 lookup threads take
    8, the others queue behind them. Each request is held back about its deadline, then a
    miss; queued lookups past it never run. Before, each waited for its lookup and those
    queued before it: 13 s, 26 s and 40 s in groups of 8. The late lookups, failing
    together, are said in one log line, not one each."""
    caplog.set_level(logging.WARNING, "cacheseek.integrations.vllm")
    with Server(tmp_path) as srv, FaultProxy(srv.port, mode="trickle", trickle_seconds=0.05) as proxy:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32})
        sched, cache = scheduler(config)
        pending = {i: request(f"r{i}", list(range(i * 1000, i * 1000 + 97))) for i in range(24)}
        held: dict[int, float] = {}
        offered: set[int | None] = set()
        t0 = time.monotonic()
        while pending and time.monotonic() - t0 < 90:
            for i, req in list(pending.items()):
                got = sched.matched_tokens(req, 0)
                if got is not None:
                    held[i], _ = time.monotonic() - t0, pending.pop(i)
                    offered.add(got)
            time.sleep(STEP)
        assert not pending and offered == {0}
        assert max(held.values()) < 5, sorted(held.values())  # 40 s for the last 8 before
        assert sched.stats.lookups_late >= 1 and sched.guard.breaker.state == "open"
        said = [r.getMessage() for r in caplog.records if "lookup failed" in r.getMessage()]
        assert len(said) == 1 and "lookup_deadline_seconds" in said[0], said
        sched.close()
        close_cache(config, cache)


def test_a_burst_behind_a_slow_but_healthy_server_does_not_rest_it(tmp_path):
    """40 new requests at once, each lookup answered 0.2 s late (slow, not failing): the 8
    lookup threads serve about 40 a second, so the later requests pass their deadline
    waiting for a thread. Those are misses, their lookups never sent; the server is not
    rested, since none of its lookups took the deadline. Before, every late lookup was a
    failure: the burst rested a healthy server, and the requests after it were misses too."""
    tokens = list(range(97))
    with Server(tmp_path) as srv:
        store(srv, tokens)
        with FaultProxy(srv.port, mode="delay", delay_seconds=0.2) as proxy:
            config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32})
            sched, cache = scheduler(config)
            pending = {i: request(f"r{i}", tokens) for i in range(40)}
            offered: dict[int, int] = {}
            t0 = time.monotonic()
            while pending and time.monotonic() - t0 < 60:
                for i, req in list(pending.items()):
                    if (got := sched.matched_tokens(req, 0)) is not None:
                        offered[i] = got
                        del pending[i]
                time.sleep(STEP)
            assert not pending
            hits = sum(got == 96 for got in offered.values())
            assert hits >= 8 and set(offered.values()) <= {0, 96}, offered
            assert sched.guard.breaker.state == "closed", (sched.stats.lookups_late, hits)
            assert held_back(sched, request("after", tokens))[1] == 96  # (asked, not skipped: a hit)
            assert sched.stats.lookup_skipped == 0
            sched.close()
            close_cache(config, cache)


def test_an_in_step_load_from_a_trickling_server_ends_within_its_exchange_timeout(tmp_path):
    """A worker's load inside the step (background_loads off, the default) from a server
    whose answer trickles, a byte every 50 ms, each read within timeout_seconds (1 s): the
    load gives up after exchange_timeout_seconds (3 s here; by default 30 s at least), its
    blocks reported for vLLM to recompute. Before, the connector left RemoteCache's default
    bound of 600 s: every running request stalled behind the step for up to 10 minutes."""
    tokens = list(range(4000, 4096))
    with Server(tmp_path) as srv, FaultProxy(srv.port) as proxy:
        store(srv, tokens)
        config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32,
                                             "timeout_seconds": 1, "exchange_timeout_seconds": 3})
        assert config.exchange_timeout == 3.0
        cache = open_cache(config, LAYOUT, "m", cs.Shard())
        side = WorkerSide(cache, guard=StoreGuard(config, "worker"))
        side.register(VllmPages([torch.zeros(16, H, 16, 2 * D) for _ in range(L)], PageFormat("channel", D, 16, 16)))
        assert cache.lookup(tokens) == 96  # (the pooled connection the trickle takes)
        proxy.trickle_seconds, proxy.mode = 0.05, "trickle"
        took: list[float] = []

        def step() -> None:
            t0 = time.monotonic()
            side.start_step(StepPlan(loads=[LoadSpec("l", tokens, [1, 2, 3, 4, 5, 6], start=0)]))
            took.append(time.monotonic() - t0)

        worker = threading.Thread(target=step, daemon=True)
        worker.start()
        worker.join(60)
        assert took and took[0] < 30, took  # 600 s before (the test gave up at 60)
        assert side.take_failed_blocks() == {1, 2, 3, 4, 5, 6}
        assert side.stats.load_failures == 1 and side.stats.load_errors == 1
        proxy.mode = "pass"
        side.close()
        close_cache(config, cache)
