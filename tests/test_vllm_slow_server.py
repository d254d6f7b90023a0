"""The vLLM connector against a server that hangs or trickles (a real server on loopback
behind tests/fault_proxy.py): how long an in-step load waits for it.
No vLLM: its Request is read through attributes, as tests/test_vllm_pages.py does."""

from __future__ import annotations

import threading
import time

import torch

import cacheseek as cs
from cacheseek.integrations.vllm.config import ConnectorConfig
from cacheseek.integrations.vllm.guard import StoreGuard
from cacheseek.integrations.vllm.pages import PageFormat, VllmPages
from cacheseek.integrations.vllm.plan import LoadSpec, StepPlan
from cacheseek.integrations.vllm.stores import close_cache, open_cache
from cacheseek.integrations.vllm.worker import WorkerSide
from fault_proxy import FaultProxy
from server_helpers import Server

H, D, L = 2, 16, 3
LAYOUT = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")


def store(srv: Server, tokens: list[int]) -> None:
    """The first 96 of ``tokens`` (3 blocks of 32) into the server, straight (no proxy)."""
    config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32})
    cache = open_cache(config, LAYOUT, "m", cs.Shard())
    cache.ingest(tokens[:96], [(x, x + 1) for x in (torch.randn(1, H, 96, D) for _ in range(L))])
    close_cache(config, cache)


def test_an_in_step_load_from_a_trickling_server_ends_within_its_exchange_timeout(tmp_path):
    """A worker's load inside the step (background_loads off, the default) from a server
    whose answer trickles, a byte every 50 ms, each read within timeout_seconds (1 s): the
    load gives up after exchange_timeout_seconds (by default 3 x timeout_seconds: 3 s), its
    blocks reported for vLLM to recompute. Before, the connector left RemoteCache's default
    bound of 600 s: every running request stalled behind the step for up to 10 minutes."""
    tokens = list(range(4000, 4096))
    with Server(tmp_path) as srv, FaultProxy(srv.port) as proxy:
        store(srv, tokens)
        config = ConnectorConfig.from_extra({"codec": "raw", "url": proxy.url, "block_tokens": 32,
                                             "timeout_seconds": 1})
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
