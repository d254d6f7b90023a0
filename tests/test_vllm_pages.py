"""The vLLM connector's parts that need no vLLM: its settings, its views of vLLM's pages,
and the worker side's loads and saves between pages and a real ``PrefixCache``.
(tests/test_vllm_connector.py drives all of it from a real vLLM engine.)"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import ConfigError, InputError
from cacheseek.integrations.vllm.config import ConnectorConfig
from cacheseek.integrations.vllm.guard import StoreGuard
from cacheseek.integrations.vllm.pages import PageFormat, VllmPages, kv_views
from cacheseek.integrations.vllm.plan import LoadSpec, SaveSpec, StepPlan
from cacheseek.integrations.vllm.stores import close_cache, open_cache
from cacheseek.integrations.vllm.worker import WorkerSide
from store_helpers import fail_layer_group

H, D, L = 2, 16, 3


# -- settings ---------------------------------------------------------------------------


def test_config_defaults_to_embedded_int4():
    cfg = ConnectorConfig.from_extra({})
    assert not cfg.remote and cfg.codec == cs.KIVI(bits=4, group_size=32) and cfg.block_tokens == 256
    assert cfg.tiers.cpu_bytes == "4GiB"


def test_loads_are_whole_steps_by_default_and_layerwise_on_request():
    default = ConnectorConfig.from_extra({})
    assert not default.loads_layerwise("cuda") and not default.may_load_layerwise  # vLLM keeps its full graphs
    auto = ConnectorConfig.from_extra({"layerwise_load": "auto"})
    assert auto.loads_layerwise("cuda") and not auto.loads_layerwise("cpu") and auto.may_load_layerwise
    on, off = ConnectorConfig.from_extra({"layerwise_load": True}), ConnectorConfig.from_extra({"layerwise_load": False})
    assert on.loads_layerwise("cpu") and on.loads_layerwise("cuda")
    assert not off.loads_layerwise("cuda") and not off.may_load_layerwise
    # a server's frames hold every layer of a block: its loads are whole steps
    remote = ConnectorConfig.from_extra({"url": "http://127.0.0.1:1", "layerwise_load": True})
    assert not remote.loads_layerwise("cuda") and not remote.may_load_layerwise


def test_saves_are_whole_steps_by_default_and_layerwise_on_request():
    default = ConnectorConfig.from_extra({})
    assert not default.saves_layerwise("cuda") and not default.may_work_layerwise  # vLLM keeps its full graphs
    auto = ConnectorConfig.from_extra({"layerwise_save": "auto"})
    assert auto.saves_layerwise("cuda") and not auto.saves_layerwise("cpu") and auto.may_work_layerwise
    assert not auto.may_load_layerwise  # loads stay whole
    assert ConnectorConfig.from_extra({"layerwise_save": True}).saves_layerwise("cpu")
    remote = ConnectorConfig.from_extra({"url": "http://127.0.0.1:1", "layerwise_save": True})
    assert not remote.saves_layerwise("cuda") and not remote.may_work_layerwise


def test_a_remote_calls_whole_exchange_and_a_lookups_deadline_default_from_the_other_keys():
    """exchange_timeout_seconds bounds one whole HTTP exchange (3 x timeout_seconds, 30 s at
    least, unless given); lookup_deadline_seconds a request's wait for its lookup (0.5 s, or
    lookup_wait_seconds where that is longer, unless given)."""
    default = ConnectorConfig.from_extra({"url": "http://h:1"})
    assert (default.exchange_timeout, default.lookup_deadline) == (30.0, 0.5)
    derived = ConnectorConfig.from_extra({"url": "http://h:1", "timeout_seconds": 2, "lookup_wait_seconds": 5})
    assert (derived.exchange_timeout, derived.lookup_deadline) == (30.0, 5.0)  # (30 s at least)
    slow = ConnectorConfig.from_extra({"url": "http://h:1", "timeout_seconds": 20})
    assert slow.exchange_timeout == 60.0
    given = ConnectorConfig.from_extra({"url": "http://h:1", "timeout_seconds": 2, "exchange_timeout_seconds": 1,
                                        "lookup_deadline_seconds": 0.2})
    assert (given.exchange_timeout, given.lookup_deadline) == (1.0, 0.2)


def test_config_remote_and_embedded_tiers():
    remote = ConnectorConfig.from_extra({"codec": "int8", "url": "http://127.0.0.1:8080", "token": "s3cr3t-t0ken",
                                         "model_id": "m", "block_tokens": 128, "timeout_seconds": 2})
    assert remote.remote and remote.codec == cs.KIVI(bits=8) and remote.timeout_seconds == 2.0
    assert "s3cr3t-t0ken" not in repr(remote)  # the token stays out of logs
    embedded = ConnectorConfig.from_extra({"codec": "raw", "tiers": {"cpu_bytes": "1GiB", "disk_path": "/tmp/x",
                                                                     "write_through": ["disk"]}})
    assert embedded.codec == cs.Raw() and embedded.tiers.write_through == ("disk",)
    spec = ConnectorConfig.from_extra({"codec": cs.KIVI(k_bits=2, v_bits=4).spec()})
    assert spec.codec == cs.KIVI(k_bits=2, v_bits=4)


@pytest.mark.parametrize("extra, names", [
    ("int4", "expected a JSON object"),
    ({"codecs": "int4"}, "unknown keys ['codecs']"),
    ({"codec": "int3"}, "codec: must be one of"),
    ({"group_size": 0}, "group_size: must be a positive int"),
    ({"group_size": 24}, "group_size"),
    # a spec names its own groups: another group_size beside it was dropped without a word
    ({"codec": cs.KIVI(bits=4, group_size=64).spec(), "group_size": 32}, "group_size: a codec spec"),
    ({"codec": "raw", "group_size": 64}, "group_size: only the KIVI codecs"),
    ({"block_tokens": "256"}, "block_tokens: must be a positive int"),
    ({"url": "127.0.0.1:8080"}, "url: expected http://host:port"),
    ({"url": "http://h:1", "tiers": {}}, "either url (remote) or tiers (embedded)"),
    ({"token": "t"}, "token: only a remote cache"),
    ({"tiers": {"cpu": "1GiB"}}, "tiers: unknown keys ['cpu']"),
    ({"tiers": "1GiB"}, "tiers: expected an object"),
    ({"tiers": {"write_through": 5}}, "tiers.write_through: expected a list of tier names, got 5"),
    ({"tiers": {"write_through": "disk"}}, "tiers.write_through: expected a list of tier names, got 'disk'"),
    ({"tiers": {"write_through": ["disk", 1]}}, "tiers.write_through: expected a list of tier names"),
    ({"timeout_seconds": 0}, "timeout_seconds: must be a positive number"),
    ({"retry_after_seconds": 10, "retry_cap_seconds": 5}, "retry_cap_seconds"),
    ({"model_id": 7}, "model_id: must be a string"),
    # (a templated "${MODEL_ID}" left empty was taken, and each engine keyed under its own
    # weights path: engines with other folders stopped sharing, silently)
    ({"model_id": ""}, "kv_connector_extra_config.model_id: must be a non-empty string"),
    ({"layerwise_load": "no"}, 'layerwise_load: must be true, false or "auto"'),
    ({"layerwise_save": 2}, 'layerwise_save: must be true, false or "auto"'),
    ({"url": "http://h:1", "background_saves": "yes"}, "background_saves: must be true or false"),
    ({"background_saves": True}, "background_saves: only a remote cache"),
    ({"max_pending_bytes": "1GiB"}, "max_pending_bytes: only a remote cache"),
    ({"url": "http://h:1", "max_pending_bytes": "lots"}, "max_pending_bytes: cannot read 'lots'"),
    ({"url": "http://h:1", "max_pending_bytes": 0}, "max_pending_bytes: must be > 0"),
    ({"lookup_wait_seconds": 0.1}, "lookup_wait_seconds: only a remote cache"),
    ({"background_loads": False}, "background_loads: only a remote cache"),
    ({"url": "http://h:1", "background_loads": 1}, "background_loads: must be true or false"),
    ({"url": "http://h:1", "lookup_wait_seconds": 0}, "lookup_wait_seconds: must be a positive number"),
    # JSON's Infinity (and 1e10) passed, and the first lookup raised OverflowError in vLLM's scheduler
    ({"url": "http://h:1", "lookup_wait_seconds": float("inf")}, "lookup_wait_seconds: must be a positive number "
                                                                 "of seconds, at most 1,000,000, got inf"),
    ({"url": "http://h:1", "lookup_wait_seconds": 1e10}, "lookup_wait_seconds: must be a positive number"),
    ({"retry_after_seconds": float("inf")}, "retry_after_seconds: must be a positive number"),
    ({"timeout_seconds": float("nan")}, "timeout_seconds: must be a positive number"),
    ({"resave_hold_seconds": 1}, "resave_hold_seconds: only a remote cache"),
    ({"url": "http://h:1", "resave_hold_seconds": -1}, "resave_hold_seconds: must be a number of seconds >= 0"),
    ({"exchange_timeout_seconds": 30}, "exchange_timeout_seconds: only a remote cache"),
    ({"url": "http://h:1", "exchange_timeout_seconds": 0}, "exchange_timeout_seconds: must be a positive number"),
    ({"url": "http://h:1", "exchange_timeout_seconds": float("inf")}, "exchange_timeout_seconds: must be a positive"),
    ({"url": "http://h:1", "exchange_timeout_seconds": "30"}, "exchange_timeout_seconds: must be a positive number"),
    ({"lookup_deadline_seconds": 0.5}, "lookup_deadline_seconds: only a remote cache"),
    ({"url": "http://h:1", "lookup_deadline_seconds": 0}, "lookup_deadline_seconds: must be a positive number"),
    ({"url": "http://h:1", "lookup_deadline_seconds": True}, "lookup_deadline_seconds: must be a positive number"),
    # (the scheduler would wait for the lookup past the deadline that makes it a miss)
    ({"url": "http://h:1", "lookup_wait_seconds": 1, "lookup_deadline_seconds": 0.5},
     "lookup_deadline_seconds: must be >= lookup_wait_seconds (1.0), got 0.5"),
])
def test_config_errors_name_the_key(extra, names):
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ConnectorConfig.from_extra(extra)


def test_tiers_over_the_memory_of_a_small_host_are_named_as_the_connectors(monkeypatch):
    """On a host (or in a container) with less than 4.5 GiB, the connector's default tiers
    (``{"cpu_bytes": "4GiB"}`` and its 512 MiB reserve) are refused as the cache is built
    inside vLLM's engine start: the error said "cpu_bytes: ... give less" to a user who
    never wrote cpu_bytes, nor where it is given. Said now as the connector's key, and,
    where none was given, as its default."""
    from cacheseek import host_memory

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    monkeypatch.setattr(host_memory, "memory_limit", lambda: (3 << 30, "the limit of its cgroup, memory.max"))
    with pytest.raises(ConfigError) as refused:
        open_cache(ConnectorConfig.from_extra({}), layout, "m", cs.Shard())
    said = str(refused.value)
    assert said.startswith("kv_connector_extra_config.tiers.cpu_bytes: 4.00 GiB and its reserve"), said
    assert "3.00 GiB (the limit of its cgroup, memory.max)" in said
    assert said.endswith('(the default tiers, {"cpu_bytes": "4GiB"}: give tiers a smaller cpu_bytes)'), said
    with pytest.raises(ConfigError) as refused:
        open_cache(ConnectorConfig.from_extra({"tiers": {"cpu_bytes": "8GiB"}}), layout, "m", cs.Shard())
    said = str(refused.value)
    assert said.startswith("kv_connector_extra_config.tiers.cpu_bytes: 8.00 GiB") and "default" not in said, said
    config = ConnectorConfig.from_extra({"codec": "raw", "tiers": {"cpu_bytes": "1GiB"}})
    cache = open_cache(config, layout, "m", cs.Shard())  # (1 GiB and its 128 MiB fit in 3 GiB)
    close_cache(config, cache)


def test_two_ranks_never_share_a_block_and_one_worker_keys_as_any_front():
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    config = ConnectorConfig.from_extra({"codec": "raw", "tiers": {"cpu_bytes": "1MiB"}})

    def root(shard: cs.Shard) -> bytes:
        cache = open_cache(config, layout, "m", shard)
        try:
            return cache.root
        finally:
            close_cache(config, cache)

    assert len({root(cs.Shard(tp_rank=r, tp_size=4)) for r in range(4)}) == 4
    with cs.PrefixCache(model_id="m", layout=layout, codec=cs.Raw(), tiers=cs.TierConfig(cpu_bytes="1MiB")) as plain:
        assert root(cs.Shard()) == plain.root  # one worker keys as any other front of the model
    with pytest.raises(ConfigError, match="tp_rank"):
        cs.Shard(tp_rank=4, tp_size=4)


# -- page views ---------------------------------------------------------------------------


def layer_tensor(pages: int, page_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, H, page_tokens, 2 * D, generator=g)


def test_channel_split_is_flash_attention_view():
    t = layer_tensor(5, 16)
    k, v = kv_views(t, PageFormat("channel", D, 16, 16))
    # vLLM's FLASH_ATTN: kv_cache.transpose(1, 2).split(head_size, dim=-1) -> [P, N, H, D] each
    fk, fv = t.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(k.transpose(1, 2), fk) and torch.equal(v.transpose(1, 2), fv)
    assert k.data_ptr() == t.data_ptr()  # a view, not a copy


def test_token_split_is_cpu_attention_view():
    t = layer_tensor(5, 32)
    k, v = kv_views(t, PageFormat("token", D, 32, 32))
    # vLLM's CPU_ATTN: kv_cache.view(P, H, 2N, D).chunk(2, dim=2), into which its kernels
    # write K column-major ([D, N] per page and head: cpu_attn_vec.hpp) and V row-major
    ck, cv = t.view(5, H, 64, D).chunk(2, dim=2)
    assert torch.equal(k, ck.reshape(5, H, D, 32).transpose(2, 3)) and torch.equal(v, cv)
    k[1, 0, 3] = 7.0
    assert ck[1, 0].reshape(D, 32)[:, 3].eq(7.0).all()  # writes land in the pages, channel by channel
    assert k.data_ptr() == t.data_ptr()  # a view, not a copy
    # The engine surface takes them on a CPU: K and V interleave per page and head
    pages = VllmPages([t, layer_tensor(5, 32, seed=1)], PageFormat("token", D, 32, 32))
    assert pages.engine.page_size == 32


def test_cpu_pages_whose_k_and_v_share_memory_are_refused():
    """K and V views of other strides (vLLM's CPU pages) are taken where each page and
    head holds all of K, then all of V; overlapping ones are refused, not written twice."""
    t = layer_tensor(5, 32)
    n = 32
    k = t.as_strided((5, H, n, D), (t.stride(0), t.stride(1), 1, n))
    v = t.as_strided((5, H, n, D), (t.stride(0), t.stride(1), D, 1), n * D - D)  # V one row into K
    with pytest.raises(InputError, match="shares memory"):
        cs.KVPages([k], [v], layout="HND")
    v = t.as_strided((5, H, n, D), (t.stride(0), t.stride(1), D, 1), n * D)
    cs.KVPages([k], [v], layout="HND")


def test_page_format_checks():
    with pytest.raises(ConfigError, match="kv_split"):
        PageFormat("nhd", D, 16, 16)
    with pytest.raises(ConfigError, match="does not divide"):
        PageFormat("channel", D, 16, 12)
    with pytest.raises(InputError, match="expected"):
        kv_views(torch.zeros(2, H, 16, D), PageFormat("channel", D, 16, 16))


def test_page_table_follows_block_ids_through_split_blocks():
    pages = VllmPages([layer_tensor(12, 16)], PageFormat("channel", D, 32, 16))  # a vLLM block spans 2 pages
    assert pages.page_table([4, 1, 5], 70) == [8, 9, 2, 3, 10]
    assert pages.page_table([4, 1, 5], 64) == [8, 9, 2, 3]
    with pytest.raises(InputError, match="do not fit"):
        pages.page_table([4, 1], 70)
    assert isinstance(pages.engine, cs.KVPages) and pages.engine.page_size == 16
    assert pages.engine.k[0].data_ptr() == pages.views[0][0].data_ptr()  # the engine surface reads vLLM's memory


def tokens_of(pages: VllmPages, block_ids: list[int], start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) ``[H, T, D]`` of tokens ``[start, end)`` of a request (a test's own
    reading of the pages, independent of the engine surface)."""
    t = torch.arange(start, end)
    page = torch.tensor(pages.page_table(block_ids, end))[t // pages.fmt.page_tokens]
    off = t % pages.fmt.page_tokens
    return [(k.transpose(0, 1)[:, page, off], v.transpose(0, 1)[:, page, off]) for k, v in pages.views]


# -- the worker side between pages and a real PrefixCache -------------------------------


def worker(codec=None, block_tokens: int = 32) -> tuple[WorkerSide, cs.PrefixCache]:
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec or cs.Raw(), block_tokens=block_tokens,
                           tiers=cs.TierConfig(cpu_bytes="64MiB"))
    side = WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({"codec": "raw"}), "worker"))
    return side, cache


def test_saved_pages_load_into_other_pages_bit_exact():
    fmt = PageFormat("token", D, 32, 32)
    side, cache = worker()
    side.register(VllmPages([layer_tensor(8, 32, seed=i) for i in range(L)], fmt))
    tokens = list(range(1000, 1100))  # 3 full blocks of 32, and 4 tokens
    plan = StepPlan(saves=[SaveSpec("a", tokens[:96], [2, 7, 4, 1])])
    side.start_step(plan)
    side.finish_step(plan)
    assert side.stats.saves == 1 and side.stats.save_blocks_stored == 3
    src = side.pages
    other = VllmPages([torch.zeros(8, H, 32, 2 * D) for _ in range(L)], fmt)
    side.register(other)
    side.start_step(StepPlan(loads=[LoadSpec("b", tokens[:96], [0, 3, 5], start=32)]))
    assert side.take_failed_blocks() == set() and side.stats.load_tokens == 64
    for (k, v), (ok, ov) in zip(tokens_of(src, [2, 7, 4], 32, 96), tokens_of(other, [0, 3, 5], 32, 96)):
        assert torch.equal(k, ok) and torch.equal(v, ov)
    assert not other.views[0][0][0].any() and not other.views[0][1][0].any()  # before `start`: vLLM's, not written
    cache.close()


class CountingCache:
    """A real PrefixCache, with the batched calls it receives counted."""

    def __init__(self, cache: cs.PrefixCache) -> None:
        self.cache, self.calls, self.located = cache, [], []

    def materialize_into_batch(self, requests, pages, **kw):
        self.calls.append(("load", len(requests)))
        self.located.append(kw.get("located"))
        return self.cache.materialize_into_batch(requests, pages, **kw)

    def ingest_batch(self, requests, pages):
        self.calls.append(("save", len(requests)))
        return self.cache.ingest_batch(requests, pages)


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_a_step_is_one_batched_call_each_way(codec):
    fmt = PageFormat("channel", D, 16, 16)  # vLLM blocks of 16 tokens, store blocks of 32
    side, cache = worker(codec)
    src = VllmPages([layer_tensor(32, 16, seed=i) for i in range(L)], fmt)
    side.register(src)
    counted = CountingCache(cache)
    side.cache = counted
    a, b = list(range(64)), list(range(500, 564))
    salted = cs.ExtraKeys(cache_salt="tenant-7")
    plan = StepPlan(saves=[SaveSpec("a", a, [0, 1, 2, 3]), SaveSpec("b", b, [4, 5, 6, 7]),
                           SaveSpec("c", a, [8, 9, 10, 11], extra=salted)])
    side.finish_step(plan)
    assert counted.calls == [("save", 3)] and side.stats.save_calls == 1
    assert side.stats.save_blocks_stored == 6  # a's blocks again under the salt: other keys
    dst = VllmPages([torch.zeros(32, H, 16, 2 * D) for _ in range(L)], fmt)
    side.register(dst)
    # Two loads sharing vLLM's own first block (pages 20, 21: its prefix hit) in one call.
    loads = [LoadSpec("x", a, [20, 21, 12, 13], start=32), LoadSpec("y", a, [20, 21, 14, 15], start=32),
             LoadSpec("z", b, [16, 17, 18, 19], start=0)]
    side.start_step(StepPlan(loads=loads))
    assert counted.calls[-1] == ("load", 3) and side.stats.load_calls == 1
    assert counted.located == [True]  # (the scheduler's locate counted these requests)
    assert side.take_failed_blocks() == set() and side.stats.load_tokens == 32 + 32 + 64
    want = cache.materialize(a, device="cpu")
    for layer, ((k, v), (wk, wv)) in enumerate(zip(tokens_of(dst, [20, 21, 12, 13], 32, 64), want.layers)):
        assert torch.equal(k, wk[0][:, 32:64]) and torch.equal(v, wv[0][:, 32:64])
    for (k, v), (ok, ov) in zip(tokens_of(dst, [20, 21, 12, 13], 32, 64), tokens_of(dst, [20, 21, 14, 15], 32, 64)):
        assert torch.equal(k, ok) and torch.equal(v, ov)
    assert not dst.views[0][0][20:22].any()  # vLLM's shared pages: not written
    if isinstance(codec, cs.Raw):
        for (k, v), (sk, sv) in zip(tokens_of(dst, [16, 17, 18, 19], 0, 64), tokens_of(src, [4, 5, 6, 7], 0, 64)):
            assert torch.equal(k, sk) and torch.equal(v, sv)
    cache.close()


def test_a_load_that_falls_short_reports_its_blocks_and_drops_the_requests_save():
    fmt = PageFormat("channel", D, 16, 16)  # vLLM blocks of 16 tokens, store blocks of 32
    side, cache = worker()
    side.register(VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], fmt))
    tokens = list(range(96))
    cache.ingest(tokens[:32], side.pages.engine.at([0, 1]))  # only block 0 is stored
    plan = StepPlan(loads=[LoadSpec("r", tokens[:64], [3, 4, 5, 6], start=0)],
                    saves=[SaveSpec("r", tokens, [3, 4, 5, 6, 10, 11]), SaveSpec("s", tokens[:32], [8, 9])])
    side.start_step(plan)
    side.finish_step(plan)
    assert side.take_failed_blocks() == {5, 6}  # tokens [32, 64): vLLM recomputes from block 5
    assert side.take_failed_blocks() == set()  # reported once
    st = side.stats
    assert (st.load_failures, st.load_tokens, st.load_failed_tokens, st.load_failed_blocks) == (1, 32, 32, 2)
    assert st.saves_skipped == 1 and st.saves == 1  # r's KV was computed over missing blocks; s's is fine
    cache.close()


# -- the worker side, layer by layer ------------------------------------------------------


def pages_like(fmt: PageFormat, num_pages: int, seed: int = 0) -> VllmPages:
    """vLLM's pages (random), the layer tensors kept as ``.tensors``."""
    tensors = [layer_tensor(num_pages, fmt.page_tokens, seed=100 + seed + i) for i in range(L)]
    pages = VllmPages(tensors, fmt)
    pages.tensors = tensors
    return pages


def layerwise_step(side: WorkerSide, plan: StepPlan, layers=range(L)) -> set[int]:
    """One step as vLLM runs it: start_load_kv, each attention layer's wait_for_layer_load
    in order, wait_for_save, get_block_ids_with_load_errors."""
    side.start_step(plan)
    for i in layers:
        side.wait_layer(i)
    side.finish_step(plan)
    return side.take_failed_blocks()


def nothing_lent(cache: cs.PrefixCache) -> bool:
    from cacheseek.store.device_staging import staging_pool

    return (cache.store.tier("cpu").lease_stats()["leases_active"] == 0
            and staging_pool(torch.device("cpu")).stats()["leases_active"] == 0)


def stored_steps(codec, page: int = 16):
    """A worker whose cache holds prompts a and b (saved from pages), and a step loading them
    (x and y from block 1, sharing vLLM's own first block; z whole) into fresh pages."""
    fmt = PageFormat("channel", D, 16, page)  # vLLM blocks of 16 tokens, store blocks of 32
    side, cache = worker(codec)
    side.register(pages_like(fmt, 32 * 16 // page))
    a, b = list(range(64)), list(range(500, 564))
    side.save([SaveSpec("a", a, [0, 1, 2, 3]), SaveSpec("b", b, [4, 5, 6, 7])])
    loads = [LoadSpec("x", a, [20, 21, 12, 13], start=32), LoadSpec("y", a, [20, 21, 14, 15], start=32),
             LoadSpec("z", b, [16, 17, 18, 19], start=0)]
    return side, cache, fmt, StepPlan(loads=loads, saves=[SaveSpec("z", b, [16, 17, 18, 19])])


@pytest.mark.parametrize("page", [16, 8])
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_a_layerwise_step_writes_what_a_whole_step_writes(codec, page):
    side, cache, fmt, plan = stored_steps(codec, page)
    whole, lw = pages_like(fmt, 32 * 16 // page, seed=7), pages_like(fmt, 32 * 16 // page, seed=7)
    side.register(whole)
    side.start_step(plan)
    side.finish_step(plan)
    assert side.take_failed_blocks() == set() and side.stats.load_layerwise_calls == 0
    side.layerwise = True
    side.register(lw)
    before = [t.clone() for t in lw.tensors]
    side.start_step(plan)
    # On a CPU a layer group is decoded when the forward first waits for a layer of it:
    # nothing is in the pages yet.
    assert all(torch.equal(a, b) for a, b in zip(before, lw.tensors))
    side.wait_layer(0)
    assert not torch.equal(before[0], lw.tensors[0]) and torch.equal(before[1], lw.tensors[1])
    for i in range(1, L):
        side.wait_layer(i)
    side.finish_step(plan)
    assert side.take_failed_blocks() == set()
    assert all(torch.equal(a, b) for a, b in zip(whole.tensors, lw.tensors))
    st = side.stats
    assert (st.load_calls, st.load_layerwise_calls, st.loads, st.load_failures) == (2, 1, 6, 0)
    assert st.load_tokens == 2 * (32 + 32 + 64) and st.saves_skipped == 0
    assert nothing_lent(cache)
    cache.close()


def test_a_layerwise_load_that_fails_mid_forward_reports_every_block(monkeypatch):
    """Layer group 1's decode raises after the forward read layer 0: no error reaches vLLM;
    every block each load was to write is reported (from its start: vLLM's own first block
    stays), the loads' saves are dropped, and the store's memory is given back."""
    from cacheseek.layerwise import LayerwiseDecoder

    side, cache, fmt, plan = stored_steps(cs.KIVI(bits=4, group_size=32))
    side.layerwise = True
    side.register(pages_like(fmt, 32))
    real = fail_layer_group(monkeypatch, 1)
    assert layerwise_step(side, plan) == {12, 13, 14, 15, 16, 17, 18, 19}
    st = side.stats
    assert (st.loads, st.load_failures, st.load_late_failures, st.load_tokens) == (0, 3, 3, 0)
    assert st.load_failed_tokens == 32 + 32 + 64 and st.load_failed_blocks == 8
    assert st.saves_skipped == 1 and st.saves == 2  # (the two of stored_steps)
    assert nothing_lent(cache)
    monkeypatch.setattr(LayerwiseDecoder, "run_group", real)
    assert layerwise_step(side, plan) == set() and side.stats.loads == 3  # the next step loads
    cache.close()


def test_layers_the_forward_never_waited_for_are_recomputed_and_loads_go_whole():
    side, cache, fmt, plan = stored_steps(cs.Raw())
    side.layerwise = True
    side.register(pages_like(fmt, 32))
    assert layerwise_step(side, plan, layers=[0]) == {12, 13, 14, 15, 16, 17, 18, 19}
    assert side.stats.load_late_failures == 0 and not side.layerwise and nothing_lent(cache)
    assert layerwise_step(side, plan, layers=[]) == set() and side.stats.loads == 3  # whole from now on
    cache.close()


def test_a_layerwise_load_left_open_is_closed_by_the_next_step():
    side, cache, fmt, plan = stored_steps(cs.Raw())
    side.layerwise = True
    side.register(pages_like(fmt, 32))
    side.start_step(plan)
    for i in range(L):
        side.wait_layer(i)
    side.start_step(StepPlan())  # vLLM never called wait_for_save: closed here, counted once
    assert side.take_failed_blocks() == set() and side.stats.loads == 3 and nothing_lent(cache)
    side.start_step(plan)
    side.end_load()  # (the connector's shutdown): nothing lent, the layers not waited for reported
    assert side.take_failed_blocks() and nothing_lent(cache)
    cache.close()


def save_step(side: WorkerSide, plan: StepPlan, layers=range(L)) -> None:
    """One step as vLLM 0.32 runs it: start_load_kv before the forward if the step loads
    (synchronously), after it if not; each attention layer's save_kv_layer (once vLLM wrote
    its pages); wait_for_save."""
    if plan.loads:
        side.start_step(plan)
    for i in layers:
        side.save_layer(i, plan)
    if not plan.loads:
        side.start_step(plan)
    side.finish_step(plan)


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_a_layerwise_save_stores_what_a_whole_save_stores(codec, monkeypatch):
    from cacheseek import layerwise_save

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)  # so small a step saves into slots too
    fmt = PageFormat("channel", D, 16, 16)
    a, b = list(range(64)), list(range(500, 596))
    plan = StepPlan(saves=[SaveSpec("a", a, [0, 1, 2, 3]), SaveSpec("b", b, [4, 5, 6, 7, 8, 9])])
    pages = pages_like(fmt, 16, seed=3)
    whole, whole_cache = worker(codec)
    whole.register(pages)
    save_step(whole, plan)
    side, cache = worker(codec)
    side.layerwise_save = True
    side.register(pages)
    save_step(side, plan)
    st = side.stats
    assert (st.save_calls, st.save_layerwise_calls, st.save_layerwise_fallbacks, st.saves) == (1, 1, 0, 2)
    assert st.save_blocks_stored == whole.stats.save_blocks_stored == 5
    for keys in (a, b):
        want = [bytes(f[0].payload_view()) for f in whole_cache.store.get_many(whole_cache.block_hashes(keys))]
        assert [bytes(f[0].payload_view()) for f in cache.store.get_many(cache.block_hashes(keys))] == want

    # a layer vLLM never fed (an attention path without the hook): the step saves whole
    c = list(range(900, 964))
    save_step(side, StepPlan(saves=[SaveSpec("c", c, [10, 11, 12, 13])]), layers=[0])
    assert (st.save_layerwise_calls, st.save_layerwise_fallbacks, st.save_calls) == (1, 1, 2)
    assert cache.lookup(c) == 64
    # a step that never reaches wait_for_save: its slots are given back by the next step's
    # first layer, whose own save then runs layer by layer
    d, e = list(range(1200, 1264)), list(range(1300, 1364))
    side.save_layer(0, StepPlan(saves=[SaveSpec("d", d, [10, 11, 12, 13])]))
    assert cache.stats()["tiers"][0]["reservation_bytes"] > 0
    save_step(side, StepPlan(saves=[SaveSpec("e", e, [10, 11, 12, 13])]))
    assert cache.lookup(d) == 0 and cache.lookup(e) == 64
    assert cache.stats()["tiers"][0]["reservation_bytes"] == 0
    assert (st.save_layerwise_calls, st.save_layerwise_fallbacks) == (2, 2)
    assert side.last_save_fallback == "the step never reached wait_for_save"
    # start_load_kv before the layers (a step with a synchronous load): the same
    plan = StepPlan(saves=[SaveSpec("f", list(range(1400, 1464)), [10, 11, 12, 13])])
    side.start_step(plan)
    for i in range(L):
        side.save_layer(i, plan)
    side.finish_step(plan)
    assert st.save_layerwise_calls == 3 and cache.lookup(list(range(1400, 1464))) == 64
    cache.close(), whole_cache.close()


@pytest.mark.parametrize("layerwise_save", [False, True], ids=["whole", "layerwise"])
def test_a_request_sharing_the_blocks_of_a_load_that_fell_short_is_not_saved(layerwise_save, monkeypatch):
    """vLLM hands the blocks a load is about to write to a request scheduled after it in the
    same step, as that request's own prefix hit (vLLM 0.32, seen in a real engine: r loads
    into blocks 3-6, q is scheduled on them, its save names them). r's load falls short: q's
    forward read the unwritten pages too, so its save would store them, and the KV computed
    over them, under the right keys: a later request would load that. Nothing of it is
    saved; another request's save is."""
    from cacheseek import layerwise_save as lws

    monkeypatch.setattr(lws, "MIN_SAVE_BYTES", 0)
    fmt = PageFormat("channel", D, 16, 16)  # vLLM blocks of 16 tokens, store blocks of 32
    side, cache = worker()
    side.layerwise_save = layerwise_save
    side.register(VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], fmt))
    tokens, other = list(range(96)), list(range(500, 532))
    cache.ingest(tokens[:32], side.pages.engine.at([0, 1]))  # only block 0 is stored
    plan = StepPlan(loads=[LoadSpec("r", tokens[:64], [3, 4, 5, 6], start=0)],
                    saves=[SaveSpec("q", tokens, [3, 4, 5, 6, 10, 11]), SaveSpec("s", other, [8, 9])])
    save_step(side, plan)
    assert side.take_failed_blocks() == {5, 6}
    st = side.stats
    assert st.saves_skipped == 1 and st.saves == 1 and cache.lookup(other) == 32
    assert cache.lookup(tokens) == 32  # block 0 only: nothing computed over the pages of blocks 5 and 6
    assert cache.stats()["tiers"][0]["reservation_bytes"] == 0
    # a save of only the blocks before the ones the load left unwritten is saved
    plan = StepPlan(loads=[LoadSpec("r", tokens[:64], [3, 4, 5, 6], start=0)],
                    saves=[SaveSpec("q", tokens[:32], [3, 4, 5, 6, 10, 11])])
    save_step(side, plan)
    assert st.saves == 2 and st.saves_skipped == 1
    cache.close()


def test_a_layerwise_save_drops_the_request_whose_load_failed(monkeypatch):
    from cacheseek import layerwise_save

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    fmt = PageFormat("channel", D, 16, 16)
    side, cache = worker()
    side.layerwise_save = True
    side.register(VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], fmt))
    tokens = list(range(96))
    cache.ingest(tokens[:32], side.pages.engine.at([0, 1]))  # only block 0 is stored
    plan = StepPlan(loads=[LoadSpec("r", tokens[:64], [3, 4, 5, 6], start=0)],
                    saves=[SaveSpec("r", tokens, [3, 4, 5, 6, 10, 11]), SaveSpec("s", tokens[:32] + [7] * 32,
                                                                                    [8, 9, 12, 13])])
    save_step(side, plan)
    assert side.take_failed_blocks() == {5, 6}
    st = side.stats
    assert (st.saves_skipped, st.saves, st.save_layerwise_calls, st.save_layerwise_fallbacks) == (1, 1, 0, 1)
    assert cache.lookup(tokens) == 32 and cache.lookup(tokens[:32] + [7] * 32) == 64  # s saved whole
    assert cache.stats()["tiers"][0]["reservation_bytes"] == 0
    cache.close()


def test_a_store_that_raises_fails_no_request():
    fmt = PageFormat("channel", D, 16, 16)
    side, cache = worker()
    side.register(VllmPages([layer_tensor(4, 16)], fmt))  # one layer where the cache has three
    plan = StepPlan(loads=[LoadSpec("r", list(range(32)), [0, 1], start=0)],
                    saves=[SaveSpec("s", list(range(32)), [2, 3])])
    side.start_step(plan)
    side.finish_step(plan)
    assert side.take_failed_blocks() == {0, 1}
    assert side.stats.save_failures == 1 and side.stats.load_failures == 1
    cache.close()


def test_remote_saves_go_in_the_background_by_default():
    remote = ConnectorConfig.from_extra({"url": "http://h:1", "max_pending_bytes": "512MiB"})
    assert remote.saves_in_background and remote.max_pending_bytes == 512 << 20
    assert not ConnectorConfig.from_extra({"url": "http://h:1", "background_saves": False}).saves_in_background
    assert not ConnectorConfig.from_extra({}).saves_in_background  # embedded: stored within the call


def test_a_background_save_stores_the_pages_as_they_were_and_is_counted_later(tmp_path):
    """A remote worker's whole save returns before the server has answered; vLLM reuses
    the pages at once; the server then holds the KV the pages held at the save (loaded
    into other pages, bit for bit), and the save is counted at the next step."""
    from server_helpers import Server

    fmt = PageFormat("channel", D, 16, 16)
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    tokens = list(range(2000, 2096))
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32})
        cache = open_cache(config, layout, "m", cs.Shard())
        side = WorkerSide(cache, guard=StoreGuard(config, "worker"), background_saves=config.saves_in_background)
        side.register(VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], fmt))
        want = [(k.clone(), v.clone()) for k, v in tokens_of(side.pages, [0, 1, 2, 3, 4, 5], 0, 96)]
        plan = StepPlan(saves=[SaveSpec("s", tokens, [0, 1, 2, 3, 4, 5])])
        side.start_step(plan)
        side.finish_step(plan)
        for k, v in side.pages.views:  # the next step overwrites the pages
            k.zero_()
            v.zero_()
        assert side.stats.save_calls == 1 and side.stats.saves == 0  # not answered yet, or not counted yet
        assert cache.flush(timeout=60)
        side.start_step(StepPlan())
        assert side.stats.saves == 1 and side.stats.save_blocks_stored == 3 and side.stats.save_failures == 0
        side.register(VllmPages([torch.zeros(16, H, 16, 2 * D) for _ in range(L)], fmt))
        side.start_step(StepPlan(loads=[LoadSpec("l", tokens, [9, 10, 11, 12, 13, 14], start=0)]))
        assert side.take_failed_blocks() == set() and side.stats.load_tokens == 96
        for (k, v), (wk, wv) in zip(tokens_of(side.pages, [9, 10, 11, 12, 13, 14], 0, 96), want):
            assert torch.equal(k, wk) and torch.equal(v, wv)
        close_cache(config, cache)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh tests-behind)"))])
def test_a_load_between_steps_returns_at_once_and_is_reported_when_its_pages_are_written(tmp_path, device):
    """A remote worker's loads between steps (vLLM's asynchronous loads): the step's call
    returns while the server is stopped (SIGSTOP); the load is reported done only once its
    pages hold the stored KV, bit for bit; a load against a dead server is reported done
    too, with every block of it failed, in the same pass."""
    import os
    import signal
    import time

    from server_helpers import Server

    fmt = PageFormat("channel", D, 16, 16)
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    tokens = list(range(4000, 4096))
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32, "timeout_seconds": 30})
        assert not config.loads_in_background  # (off by default)
        cache = open_cache(config, layout, "m", cs.Shard())
        side = WorkerSide(cache, guard=StoreGuard(config, "worker"), background_loads=True)
        src = [layer_tensor(16, 16, seed=i) for i in range(L)]
        want = [(k.clone(), v.clone()) for k, v in tokens_of(VllmPages(src, fmt), [0, 1, 2, 3, 4, 5], 0, 96)]
        side.register(VllmPages([t.to(device) for t in src], fmt))
        side.finish_step(StepPlan(saves=[SaveSpec("s", tokens, [0, 1, 2, 3, 4, 5])]))
        dest = [torch.zeros(16, H, 16, 2 * D, device=device) for _ in range(L)]
        side.register(VllmPages(dest, fmt))
        plan = StepPlan(background_loads=[LoadSpec("l", tokens, [9, 10, 11, 12, 13, 14], start=32)])
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            side.start_step(plan)
            assert time.monotonic() - t0 < 1 and side.take_loaded() == set()  # the step did not wait
            side.finish_step(plan)
            assert side.take_loaded() == set()
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not (done := side.take_loaded()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == {"l"} and side.take_failed_blocks() == set()
        assert side.stats.loads == 1 and side.stats.load_tokens == 64 and side.stats.load_background_calls == 1
        got = tokens_of(VllmPages([t.cpu() for t in dest], fmt), [9, 10, 11, 12, 13, 14], 0, 96)
        for layer, ((k, v), (wk, wv)) in enumerate(zip(got, want)):
            assert torch.equal(k[:, 32:], wk[:, 32:]) and torch.equal(v[:, 32:], wv[:, 32:]), layer
            assert not k[:, :32].any()  # before `start`: vLLM's own, not written
        # A load stuck on a stopped server: close waits its timeout, not the client's (30 s).
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            side.start_step(StepPlan(background_loads=[LoadSpec("stuck", tokens, [1, 2, 3, 4, 5, 6], start=0)]))
            t0 = time.monotonic()
            side.close(timeout=0.5)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        close_cache(config, cache)
    # The server gone: reported done, every block of the load failed, in the same pass.
    side = WorkerSide(open_cache(config, layout, "m", cs.Shard()), guard=StoreGuard(config, "worker"),
                      background_loads=True)
    side.register(VllmPages([torch.zeros(16, H, 16, 2 * D) for _ in range(L)], fmt))
    side.start_step(StepPlan(background_loads=[LoadSpec("gone", tokens, [1, 2, 3, 4, 5, 6], start=0)]))
    deadline = time.monotonic() + 30
    while not (done := side.take_loaded()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == {"gone"} and side.take_failed_blocks() == {1, 2, 3, 4, 5, 6}
    assert side.stats.load_failures == 1 and side.stats.load_failed_tokens == 96
    close_cache(config, side.cache)
    side.close()


def test_a_load_between_steps_that_finds_nothing_answers_the_resting_guards_probe(tmp_path):
    """The worker's guard open (a save failed), then its wait over: the next call is its
    probe. A load between steps whose prefix is gone from the server (evicted since the
    lookup) is an answer: the guard closes, and the next steps call the server again. Only
    a load the guard refused (no call made) tells it nothing. The probe's answer was
    dropped when the load wrote nothing, and the guard refused every load and save for
    its probe timeout (60 s) with the server up."""
    import time

    from server_helpers import Server

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32, "timeout_seconds": 30,
                                             "retry_after_seconds": 0.05, "retry_cap_seconds": 0.05})
        cache = open_cache(config, layout, "m", cs.Shard())
        side = WorkerSide(cache, guard=StoreGuard(config, "worker"), background_loads=True)
        side.register(VllmPages([torch.zeros(16, H, 16, 2 * D) for _ in range(L)], PageFormat("channel", D, 16, 16)))
        side.guard.failure("save", RuntimeError("the server restarted"))
        assert not side.guard.allow()  # resting
        time.sleep(0.1)
        side.start_step(StepPlan(background_loads=[LoadSpec("gone", list(range(96)), [1, 2, 3, 4, 5, 6], start=0)]))
        deadline = time.monotonic() + 30
        while not (done := side.take_loaded()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == {"gone"} and side.take_failed_blocks() == {1, 2, 3, 4, 5, 6}
        assert side.guard.breaker.state == "closed" and side.guard.allow()
        # Refused (the guard open again): no call, no answer; reported failed all the same.
        side.guard.failure("save", RuntimeError("down again"))
        side.start_step(StepPlan(background_loads=[LoadSpec("refused", list(range(96)), [1, 2, 3, 4, 5, 6], start=0)]))
        assert side.take_loaded() == {"refused"} and side.take_failed_blocks() == {1, 2, 3, 4, 5, 6}
        assert side.guard.breaker.state == "open"
        side.close()
        close_cache(config, cache)


def test_a_load_between_steps_that_cannot_be_planned_is_a_failed_load_not_vllms_error():
    """A load whose page table cannot be made (fewer blocks than its tokens need) raised out
    of ``start_load_kv`` into vLLM, and was never reported finished (vLLM held the request
    and its blocks for good). It is a failed load, reported with its blocks."""
    config = ConnectorConfig.from_extra({"codec": "raw", "url": "http://127.0.0.1:9", "block_tokens": 32})
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    side = WorkerSide(open_cache(config, layout, "m", cs.Shard()), guard=StoreGuard(config, "worker"),
                      background_loads=True)
    side.register(VllmPages([torch.zeros(16, H, 16, 2 * D) for _ in range(L)], PageFormat("channel", D, 16, 16)))
    side.start_step(StepPlan(background_loads=[LoadSpec("short", list(range(96)), [1, 2, 3], start=0)]))
    side.close()  # (waits for the loader)
    assert side.take_loaded() == {"short"} and side.take_failed_blocks() == {1, 2, 3}
    assert side.stats.load_failures == 1
    close_cache(config, side.cache)


def worker_of_a_dead_server(**side: bool) -> tuple[ConnectorConfig, object, WorkerSide]:
    """A remote worker whose server is down (a loopback port nobody listens on), its guard
    resting a minute after a failure; pages registered."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ConnectorConfig.from_extra({"codec": "raw", "url": f"http://127.0.0.1:{port}", "block_tokens": 32,
                                         "timeout_seconds": 1, "retry_after_seconds": 60, "retry_cap_seconds": 60})
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    cache = open_cache(config, layout, "m", cs.Shard())
    worker = WorkerSide(cache, guard=StoreGuard(config, "worker"), **side)
    worker.register(VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], PageFormat("channel", D, 16, 16)))
    return config, cache, worker


def test_a_background_save_to_a_server_that_is_down_is_counted_failed_and_rests():
    config, cache, side = worker_of_a_dead_server(background_saves=True)
    plan = StepPlan(saves=[SaveSpec("s", list(range(64)), [4, 5, 6, 7])])
    side.start_step(plan)
    side.finish_step(plan)
    assert cache.flush(timeout=60)
    side.start_step(StepPlan())
    assert side.stats.save_failures == 1 and side.stats.saves == 0
    assert not side.guard.allow()  # resting: the next saves make no call
    close_cache(config, cache)


def test_a_remote_lookup_never_holds_the_scheduler_longer_than_its_wait(tmp_path):
    """vLLM's scheduler asks for a request's hit; with the server stopped (SIGSTOP: it
    accepts, never answers) the ask returns None ("not yet": vLLM asks again at its next
    step) after lookup_wait_seconds, not after the client's timeout. Once the server runs
    again, the next ask gets the hit. vLLM's Request is read through its attributes only."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import SchedulerSide
    from server_helpers import Server

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    tokens = list(range(3000, 3097))  # 3 full blocks of 32, and a token
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32, "timeout_seconds": 30,
                                             "lookup_wait_seconds": 0.2})
        caches = [open_cache(config, layout, "m", cs.Shard(rank, 2)) for rank in range(2)]
        for cache in caches:
            k = [torch.randn(1, H, 96, D) for _ in range(L)]
            cache.ingest(tokens[:96], [(x, x + 1) for x in k])
        sched = SchedulerSide(caches, block_tokens=32, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                              block_ids=lambda req_id: [], lookup_wait_seconds=config.lookup_wait_seconds)

        def request(req_id):
            return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                                   mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)

        assert sched.matched_tokens(request("answered"), 0) == 96  # both ranks, at once, within the wait
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert sched.matched_tokens(request("stalled"), 0) is None
            assert sched.matched_tokens(request("stalled"), 0) is None  # asked again: still running, not sent twice
            waited = time.monotonic() - t0
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert 0.4 <= waited < 5, waited
        deadline = time.monotonic() + 30
        while (hit := sched.matched_tokens(request("stalled"), 0)) is None and time.monotonic() < deadline:
            pass
        assert hit == 96
        assert sched.stats.lookups == 2 and sched.stats.lookups_deferred >= 2 and sched.stats.lookup_errors == 0
        sched.close()
        for cache in caches:
            close_cache(config, cache)


def test_a_lookup_whose_request_is_gone_before_its_answer_still_answers_the_guards_probe(tmp_path):
    """The scheduler's guard resting after a failure, its wait over: the next lookup is its
    probe. Its request is aborted while the lookup runs (the server slow: SIGSTOP), so vLLM
    never asks for it again; its answer still reaches the guard, which closes, and the next
    request gets its hit. Dropped with the request, the answer never came, and the guard
    refused every lookup for its probe timeout (60 s): no hits, the server up."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import SchedulerSide
    from server_helpers import Server

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    tokens = list(range(5000, 5097))  # 3 full blocks of 32, and a token
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32, "timeout_seconds": 30,
                                             "lookup_wait_seconds": 0.05, "retry_after_seconds": 0.05,
                                             "retry_cap_seconds": 0.05})
        cache = open_cache(config, layout, "m", cs.Shard())
        cache.ingest(tokens[:96], [(x, x + 1) for x in (torch.randn(1, H, 96, D) for _ in range(L))])
        sched = SchedulerSide([cache], block_tokens=32, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                              block_ids=lambda req_id: [], lookup_wait_seconds=config.lookup_wait_seconds)

        def request(req_id):
            return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                                   mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)

        sched.guard.failure("lookup", RuntimeError("the server restarted"))
        time.sleep(0.1)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            assert sched.matched_tokens(request("aborted"), 0) is None  # the probe, unanswered yet
            sched.finished(request("aborted"))
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while (hit := sched.matched_tokens(request("next"), 0)) != 96 and time.monotonic() < deadline:
            sched.finished(request("next"))  # (a miss: forget it, ask afresh)
            time.sleep(0.05)
        assert hit == 96 and sched.guard.breaker.state == "closed"
        sched.close()
        close_cache(config, cache)


def _fake_request(req_id: str, tokens: list[int]):
    """What the scheduler side reads of a vLLM Request."""
    from types import SimpleNamespace

    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                           mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)


def _first_step(sched, req_id: str, computed: int, total: int):
    """The plan of a step that schedules ``req_id`` for the first time, ``computed`` tokens
    in (vLLM's hit), to the end of its ``total`` tokens."""
    from types import SimpleNamespace

    new = [SimpleNamespace(req_id=req_id, num_computed_tokens=computed)]
    return sched.plan(SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens={req_id: total - computed},
                                      scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))


@contextmanager
def _scheduler_over_a_server(tmp_path, tokens):
    """A scheduler side over a real server that holds the first 96 ``tokens`` (3 blocks of
    32), its loads between steps, each request given pages 0-6."""
    from cacheseek.integrations.vllm.scheduler import SchedulerSide
    from server_helpers import Server

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "raw", "url": srv.url, "block_tokens": 32, "timeout_seconds": 30,
                                             "lookup_wait_seconds": 5})
        cache = open_cache(config, layout, "m", cs.Shard())
        cache.ingest(tokens[:96], [(x, x + 1) for x in (torch.randn(1, H, 96, D) for _ in range(L))])
        sched = SchedulerSide([cache], block_tokens=32, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                              block_ids=lambda req_id: list(range(7)), lookup_wait_seconds=config.lookup_wait_seconds,
                              background_loads=True)
        try:
            yield sched
        finally:
            sched.close()
            close_cache(config, cache)


def test_a_request_whose_load_between_steps_failed_whole_computes_instead_of_loading_again(tmp_path):
    """vLLM's asynchronous load that failed from its first block (the worker's guard
    resting, a chain the worker cannot read): vLLM frees the request's blocks and asks
    for its hit again before ever running it (_update_waiting_for_remote_kv). Offered
    again, the load failed again for as long as the cause lasted, the request never ran
    (a livelock); it is offered nothing now and computes. A request vLLM ran and then
    preempted is looked up afresh, as before."""
    from types import SimpleNamespace

    tokens = list(range(6000, 6097))  # 3 full blocks of 32, and a token
    with _scheduler_over_a_server(tmp_path, tokens) as sched:
        req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                              mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)

        def step(scheduled=None):
            new = [SimpleNamespace(req_id="r", num_computed_tokens=scheduled)] if scheduled is not None else []
            return sched.plan(SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens={"r": 97} if new else {},
                                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))

        assert sched.matched_tokens(req, 0) == 96
        sched.after_alloc(req, 96)
        assert [spec.req_id for spec in step().background_loads] == ["r"]
        # The load failed whole; vLLM freed the blocks and asks again.
        assert sched.matched_tokens(req, 0) == 0
        sched.after_alloc(req, 0)
        plan = step(scheduled=0)
        assert not plan.background_loads and [len(spec.token_ids) for spec in plan.saves] == [96]
        assert sched.stats.lookups == 1
        # Ran, then preempted: its hit is looked up again.
        assert sched.matched_tokens(req, 0) == 96 and sched.stats.lookups == 2


def test_a_first_save_covers_the_blocks_vllms_own_cache_served(tmp_path):
    """vLLM's own hit may hold blocks no save stored (an earlier turn's generated tokens,
    which are never saved): a first save that began where that hit ends left a hole in the
    stored chain, and nothing past it was reachable for another engine; and it never marked
    the stored head used, so under a full tier the new blocks evicted it. A first save
    covers the prompt from token 0 (the blocks found stored are not sent again)."""
    tokens = list(range(8000, 8097))  # 3 full blocks of 32, and a token
    with _scheduler_over_a_server(tmp_path, tokens) as sched:
        for req_id, local_hit in (("all", 96), ("part", 64)):
            req = _fake_request(req_id, tokens)
            sched.after_alloc(req, 0)  # (no external tokens taken: vLLM's own hit only)
            plan = _first_step(sched, req_id, local_hit, len(tokens))
            assert [(spec.start, len(spec.token_ids)) for spec in plan.saves] == [(0, 96)], req_id
            assert [spec.computed for spec in plan.saves] == [local_hit], req_id  # (looked up before encoding)
            sched.finished(req)


def test_a_background_save_of_blocks_vllms_own_cache_served_encodes_only_those_the_server_lacks(tmp_path):
    """A prompt vLLM's own prefix cache serves whole is saved from token 0 (the test above),
    and a background save encoded every block before its lookup: a repeated prompt was
    encoded whole on every request, to be found stored. A save holding blocks vLLM did not
    compute in its step looks up first (one round trip in the step) and encodes only what
    the server lacks: nothing at all for a prompt stored whole. A save of blocks all
    computed in the step (a fresh prompt, the next chunk) looks up after, as before."""
    from server_helpers import Server

    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    tokens = list(range(9000, 9097))  # 3 full blocks of 32, and a token
    pages = VllmPages([layer_tensor(16, 16, seed=i) for i in range(L)], PageFormat("channel", D, 16, 16))
    with Server(tmp_path) as srv:
        config = ConnectorConfig.from_extra({"codec": "int4", "url": srv.url, "block_tokens": 32,
                                             "timeout_seconds": 30})

        def save(spec: SaveSpec) -> tuple[WorkerSide, dict]:
            """``spec`` saved by a fresh worker (its client's figures its own); its stats and
            its client's write-behind figures once answered."""
            cache = open_cache(config, layout, "m", cs.Shard())
            # (a wait no loaded test machine outlasts: what is asked first is tested here, and
            # test_write_behind.py tests the wait)
            side = WorkerSide(cache, guard=StoreGuard(config, "worker"), background_saves=True, look_up_wait=30)
            side.register(pages)
            plan = StepPlan(saves=[spec])
            side.start_step(plan)
            side.finish_step(plan)
            assert cache.flush(timeout=60)
            side.start_step(StepPlan())  # (the answer counted)
            behind = cache.client_stats()["write_behind"]
            close_cache(config, cache)
            return side, behind

        # The first request computes its prompt: encoded, looked up after, stored.
        side, behind = save(SaveSpec("first", tokens[:64], list(range(6)), computed=0))
        assert (side.stats.save_lookups_first, side.stats.save_blocks_stored, behind["writes_queued"]) == (0, 2, 1)
        two_blocks = behind["pending_bytes_high"]
        # Served whole by vLLM's own cache: asked first, nothing encoded, nothing queued.
        side, behind = save(SaveSpec("again", tokens[:64], list(range(6)), computed=96))
        st = side.stats
        assert (st.save_lookups_first, st.saves, st.save_blocks_present, st.save_blocks_stored) == (1, 1, 2, 0)
        assert behind["writes_queued"] == 0 and behind["pending_bytes_high"] == 0
        # A turn that extends it: its stored 2 blocks found, the third (an answer vLLM cached
        # and no save stored) encoded alone and sent.
        side, behind = save(SaveSpec("extends", tokens[:96], list(range(6)), computed=96))
        st = side.stats
        assert (st.save_lookups_first, st.save_blocks_present, st.save_blocks_stored) == (1, 2, 1)
        one_block = behind["pending_bytes_high"]
        assert behind["writes_queued"] == 1 and 0 < one_block and 2 * one_block == two_blocks
        # The next chunk of a prompt (all of it computed in the step): no round trip first.
        side, _ = save(SaveSpec("chunk", tokens[:96], list(range(6)), start=64, computed=64))
        assert (side.stats.save_lookups_first, side.stats.save_blocks_present) == (0, 1)
        # A fresh prompt behind a shared block vLLM served (a system prompt): 1 block of 3 is
        # not worth a round trip in the step.
        side, _ = save(SaveSpec("shared head", tokens[:96], list(range(6)), computed=32))
        assert (side.stats.save_lookups_first, side.stats.save_blocks_present) == (0, 3)
        cache = open_cache(config, layout, "m", cs.Shard())
        assert cache.lookup(tokens) == 96
        close_cache(config, cache)


def test_a_request_admitted_after_its_load_between_steps_saves_nothing_it_loaded(tmp_path):
    """vLLM's asynchronous load done, vLLM admits the request again (update_state_after_alloc,
    no external tokens this time) and runs it from the loaded tokens. That admission started
    the request over: the step that ran it saved the loaded prefix again (every block
    encoded again and looked up, to be found present: on every rank, after every such
    load). A load that fell short is saved from where vLLM resumes it, as before."""
    from types import SimpleNamespace

    tokens = list(range(7000, 7097))  # 3 full blocks of 32, and a token
    with _scheduler_over_a_server(tmp_path, tokens) as sched:
        nothing = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                  scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))

        def request(req_id):
            return _fake_request(req_id, tokens)

        def step(req_id, computed):
            return _first_step(sched, req_id, computed, len(tokens))

        # vLLM resumes the request where its load ended: all of it, or (the worker reported
        # blocks 1 and 2) block 0
        for req_id, resumed_at, saved in (("whole", 96, []), ("short", 32, [96])):
            req = request(req_id)
            assert sched.matched_tokens(req, 0) == 96
            sched.after_alloc(req, 96)
            assert [spec.req_id for spec in sched.plan(nothing).background_loads] == [req_id]
            sched.after_alloc(req, 0)  # the load reported done: vLLM admits the request again
            plan = step(req_id, resumed_at)
            assert not plan.loads and not plan.background_loads
            assert [len(spec.token_ids) for spec in plan.saves] == saved, req_id
            sched.finished(req)
        # A load that fell short from its first block: vLLM frees the blocks and asks again.
        req = request("failed")
        assert sched.matched_tokens(req, 0) == 96
        sched.after_alloc(req, 96)
        sched.plan(nothing)
        assert sched.matched_tokens(req, 0) == 0
        sched.after_alloc(req, 0)
        assert [len(spec.token_ids) for spec in step("failed", 0).saves] == [96]
        assert sched.stats.lookup_hit_tokens == 3 * 96 and sched.stats.lookups == 3


def test_a_server_that_is_down_fails_no_request_and_rests():
    config, cache, side = worker_of_a_dead_server()
    tokens = list(range(64))
    for step in range(2):
        plan = StepPlan(loads=[LoadSpec(f"r{step}", tokens, [0, 1, 2, 3], start=0)],
                        saves=[SaveSpec(f"s{step}", tokens, [4, 5, 6, 7])])
        side.start_step(plan)
        side.finish_step(plan)
        assert side.take_failed_blocks() == {0, 1, 2, 3}  # vLLM recomputes the whole load
    st = side.stats
    assert st.load_failures == 2 and st.load_failed_tokens == 128 and st.save_failures == 2
    assert (st.load_errors, st.loads_refused) == (1, 1)  # step 1's call raised; step 2's was not made
    assert side.guard.breaker is not None and not side.guard.allow()  # resting: step 2 made no call
    close_cache(config, cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh tests-vllm)")
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_gpu_pages_load_what_the_contiguous_path_materializes(codec):
    fmt = PageFormat("channel", D, 16, 16)  # vLLM's FLASH_ATTN pages
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=64, tiers=cs.TierConfig(cpu_bytes="64MiB"))
    side = WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({}), "worker"))
    src = VllmPages([torch.randn(24, 16, H, 2 * D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(L)], fmt)
    side.register(src)
    tokens, blocks = list(range(128)), [5, 17, 2, 9, 11, 0, 23, 8]
    side.save([SaveSpec("a", tokens, blocks)])
    dst = VllmPages([torch.zeros(24, 16, H, 2 * D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(L)], fmt)
    side.register(dst)
    assert side.load([LoadSpec("b", tokens, [1, 3, 4, 6, 7, 10, 12, 13], start=0)]) == [128]
    want = cache.materialize(tokens, device="cuda")
    got = tokens_of(dst, [1, 3, 4, 6, 7, 10, 12, 13], 0, 128)
    for (k, v), (wk, wv) in zip(got, want.layers):
        assert torch.equal(k, wk[0]) and torch.equal(v, wv[0])
    if isinstance(codec, cs.Raw):
        for (k, v), (sk, sv) in zip(got, tokens_of(src, blocks, 0, 128)):
            assert torch.equal(k, sk) and torch.equal(v, sv)
    cache.close()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh vllm-layerwise)")
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_gpu_layerwise_step_reads_each_layer_after_its_wait_on_the_forwards_stream(codec):
    """On a GPU every layer group is issued in start_load (side streams, an event per
    group) and ``wait_layer`` only queues an event wait: a read of the layer's pages queued
    after it on the forward's stream (not the default stream) sees the whole load's bytes."""
    fmt = PageFormat("channel", D, 16, 16)
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=32,
                           tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=True))
    side = WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({}), "worker"), layerwise=True)

    def gpu_pages(seed: int) -> VllmPages:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return VllmPages([torch.randn(32, 16, H, 2 * D, device="cuda", dtype=torch.bfloat16, generator=g)
                          .transpose(1, 2) for _ in range(L)], fmt)

    side.register(gpu_pages(1))
    tokens = list(range(2000, 2128))
    side.save([SaveSpec("a", tokens, list(range(8)))])
    plan = StepPlan(loads=[LoadSpec("b", tokens, [20, 21, 8, 9, 10, 11, 12, 13], start=32)])
    whole = gpu_pages(2)
    side.register(whole)
    assert side.load(plan.loads) == [128]
    lw = gpu_pages(2)
    side.register(lw)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        side.start_step(plan)
        seen = []
        for i in range(L):
            side.wait_layer(i)
            seen.append(tokens_of(lw, [20, 21, 8, 9, 10, 11, 12, 13], 0, 128)[i])  # queued on `forward`
        side.finish_step(plan)
    torch.cuda.synchronize()
    assert side.take_failed_blocks() == set() and side.stats.load_layerwise_calls == 1
    for (k, v), (wk, wv) in zip(seen, tokens_of(whole, [20, 21, 8, 9, 10, 11, 12, 13], 0, 128)):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    side.start_step(StepPlan())  # a load left open at the step's end (still running then) is closed here
    assert side._unclosed is None and cache.store.tier("cpu").lease_stats()["leases_active"] == 0
    cache.close()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh tests-vllm-save)")
@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_gpu_layerwise_save_reads_each_layer_after_the_forward_wrote_it(codec, monkeypatch):
    """vLLM writes a layer's pages on its forward stream and then calls save_kv_layer: the
    save of that layer (on its own stream) must wait for those writes, never for the host.
    Each layer is written after a sleep on the forward stream, so a save that did not wait
    would store the zeros it found; it stores what a whole save of the written pages does."""
    from cacheseek import layerwise_save

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    fmt = PageFormat("channel", D, 16, 16)
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")

    def gpu_worker() -> tuple[WorkerSide, cs.PrefixCache]:
        cache = cs.PrefixCache(model_id="m", layout=layout, codec=codec, block_tokens=32,
                               tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=True))
        return WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({}), "worker")), cache

    g = torch.Generator(device="cuda").manual_seed(5)
    written = [torch.randn(16, 16, H, 2 * D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(L)]
    plan = StepPlan(saves=[SaveSpec("a", list(range(3000, 3096)), [3, 7, 1, 12, 0, 9]),
                           SaveSpec("b", list(range(4000, 4064)), [2, 4, 5, 6])])
    whole, whole_cache = gpu_worker()
    whole.register(VllmPages([t.transpose(1, 2) for t in written], fmt))
    save_step(whole, plan)
    side, cache = gpu_worker()
    side.layerwise_save = True
    raw = [torch.zeros_like(t) for t in written]
    side.register(VllmPages([t.transpose(1, 2) for t in raw], fmt))
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        for i in range(L):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the layer's "attention"
            raw[i].copy_(written[i])
            side.save_layer(i, plan)
        side.start_step(plan)  # vLLM 0.32, a step without a synchronous load: after the forward
        side.finish_step(plan)
    st = side.stats
    assert (st.save_layerwise_calls, st.save_layerwise_fallbacks, st.save_blocks_stored) == (1, 0, 5)
    for spec in plan.saves:
        want = [bytes(f[0].payload_view()) for f in whole_cache.store.get_many(whole_cache.block_hashes(spec.keys))]
        got = [bytes(f[0].payload_view()) for f in cache.store.get_many(cache.block_hashes(spec.keys))]
        assert len(got) == len(want) > 0 and got == want
    assert cache.stats()["tiers"][0]["reservation_bytes"] == 0
    cache.close(), whole_cache.close()


def test_data_path_benchmark_runs(tmp_path):
    from benchmarks import vllm_pages

    assert vllm_pages.main(["--tokens", "512", "--codecs", "raw", "--requests", "1,2", "--reps", "1",
                            "--layers", "2", "--out", str(tmp_path)]) == 0
    import json

    rows = json.loads((tmp_path / "vllm_pages.json").read_text())["rows"]
    assert {r["path"] for r in rows} >= {"connector save", "connector load", "connector load layer-wise",
                                         "engine ingest_batch", "engine materialize_into_batch",
                                         "baseline page copy D2H"}
    assert {r["requests"] for r in rows} == {1, 2}
    assert all(r["vs_baseline"] > 0 for r in rows if "forward" not in r["path"])  # (GPU only: forward rows)


def test_a_step_plan_with_extra_keys_survives_pickling():
    """vLLM's multiprocess executors send the connector's metadata to the workers pickled:
    the keys a worker builds from it are the scheduler's."""
    import pickle

    extra = cs.ExtraKeys(lora_id="sql", mm_inputs=(cs.MMInput("img-1", 40, 20),), cache_salt="tenant-7")
    plan = StepPlan(loads=[LoadSpec("r", list(range(96)), [0, 1], 32, extra)],
                    saves=[SaveSpec("s", list(range(64)), [2], None)])
    back = pickle.loads(pickle.dumps(plan))
    assert back.loads[0].keys.extra == extra and back.loads[0].start == 32
    assert back.saves[0].keys == list(range(64))  # no extra keys: plain token ids


def test_a_lora_name_pointed_at_another_adapter_keys_its_blocks_apart():
    """vLLM keys a LoRA request's blocks by the adapter's name and path (kv_cache_utils:
    "re-pointing a LoRA name at a different adapter does not reuse KV computed with the
    previous one"). Keyed by the name alone, a request under "sql" loaded the KV that
    another adapter, loaded earlier under that name, computed: another model's KV."""
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import extra_keys

    def request(name: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(lora_request=SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path),
                               mm_features=None, cache_salt=None)

    v1, v2 = extra_keys(request("sql", "/adapters/sql-v1")), extra_keys(request("sql", "/adapters/sql-v2"))
    assert v1 != v2 and v1 == extra_keys(request("sql", "/adapters/sql-v1"))
    assert extra_keys(request("chat", "/adapters/sql-v1")) != v1  # (the name still counts)
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=cs.Raw(), block_tokens=32,
                           tiers=cs.TierConfig(cpu_bytes="16MiB"))
    tokens = list(range(64))
    assert cache.block_hashes(cs.Prompt(tokens, lora_id=v1.lora_id)) != cache.block_hashes(
        cs.Prompt(tokens, lora_id=v2.lora_id))
    cache.close()


def test_the_default_model_id_keeps_engines_of_other_weights_apart():
    """Without a configured ``model_id`` the key is vLLM's model: two engines serving one
    repository at two revisions, or one with its weights quantized, computed other KV under
    one model_id and found each other's blocks. The weights' revision and quantization are
    part of the default now; an engine that sets neither keeps the plain model path."""
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.config import default_model_id

    def model(revision=None, quantization=None) -> SimpleNamespace:
        return SimpleNamespace(model="meta-llama/Llama-3.1-8B-Instruct", revision=revision, quantization=quantization)

    plain = default_model_id(model())
    assert plain == "meta-llama/Llama-3.1-8B-Instruct"  # (the keys of engines configured so before stay)
    ids = {plain, default_model_id(model(revision="0e9e39f")), default_model_id(model(revision="main2")),
           default_model_id(model(quantization="fp8")), default_model_id(model(revision="0e9e39f", quantization="fp8"))}
    assert len(ids) == 5
    assert default_model_id(model(revision="0e9e39f")) == default_model_id(model(revision="0e9e39f"))


@given(model=st.text("ab@+", min_size=1, max_size=6), revision=st.one_of(st.none(), st.text("ab@+", max_size=4)),
       quantization=st.one_of(st.none(), st.text("ab@+", max_size=4)))
def test_the_default_model_id_names_each_model_revision_and_quantization_apart(model, revision, quantization):
    """The default joined model, ``@revision`` and ``+quantization`` as they were: a model
    path or revision holding "@" or "+" spelled another triple's id, so a folder
    "/models/llama+fp8" of bf16 weights keyed as "/models/llama" quantized to fp8 online,
    and revision "v1+fp8" as revision "v1" quantized to fp8: one engine found the other's KV.
    Every other way to read the id back as model, revision and quantization gives another id
    (None and "" both say none); names free of "@" and "+" keep the plain form (their
    engines' stored blocks stay found)."""
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.config import default_model_id

    def of(m, r, q) -> str:
        return default_model_id(SimpleNamespace(model=m, revision=r, quantization=q))

    ours, text = (model, revision or None, quantization or None), of(model, revision, quantization)
    for at in [None, *(i for i, c in enumerate(text) if c == "@")]:
        for plus in [None, *(i for i, c in enumerate(text) if c == "+" and (at is None or i > at))]:
            end = len(text) if plus is None else plus
            other = (text[: at if at is not None else end], text[at + 1 : end] if at is not None else None,
                     text[plus + 1 :] if plus is not None else None)
            other = (other[0], other[1] or None, other[2] or None)
            if other != ours and other[0]:
                assert of(*other) != text, f"{other} has the id of {ours}: {text!r}"


def test_a_model_path_or_revision_holding_the_separators_is_not_another_models_id():
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.config import default_model_id

    def model(path, revision=None, quantization=None) -> str:
        return default_model_id(SimpleNamespace(model=path, revision=revision, quantization=quantization))

    assert model("/models/llama+fp8") != model("/models/llama", quantization="fp8")
    assert model("/models/llama@v2") != model("/models/llama", revision="v2")
    assert model("m", revision="v1+fp8") != model("m", revision="v1", quantization="fp8")
    assert model("m", revision="v1", quantization="fp8") == "m@v1+fp8"  # (the plain form, as before)


def test_a_vllm_request_has_the_keys_its_documented_prompt_has_in_every_cache():
    """design.md spells how a vLLM request's adapter, salt and images become a ``cs.Prompt``,
    so that an engine and a program using ``PrefixCache`` or ``RemoteCache`` share blocks:
    the connector's keys are that prompt's keys, in both caches."""
    import json
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.plan import request_keys
    from cacheseek.integrations.vllm.scheduler import extra_keys

    def feature(identifier: str, offset: int, length: int) -> SimpleNamespace:
        return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))

    tokens = list(range(1000, 1200))
    request = SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="sql", lora_int_id=3, lora_path="/adapters/sql-v1"),
        mm_features=[feature("img-a", 10, 40), feature("img-b", 90, 50)], cache_salt="tenant-7")
    documented = cs.Prompt(tokens, lora_id=json.dumps(["sql", "/adapters/sql-v1"]), cache_salt="tenant-7",
                           mm_inputs=[cs.MMInput("img-b", 90, 50), cs.MMInput("img-a", 10, 40)])
    layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32")
    config = {"model_id": "m", "layout": layout, "codec": cs.KIVI(bits=4, group_size=32), "block_tokens": 32}
    embedded = cs.PrefixCache(tiers=cs.TierConfig(cpu_bytes="16MiB"), **config)
    remote = cs.RemoteCache("http://127.0.0.1:9", **config)  # (hashing asks no server)
    try:
        want = embedded.block_hashes(documented)
        assert len(want) == 6 and want != embedded.block_hashes(tokens)
        for cache in (embedded, remote):
            assert cache.block_hashes(request_keys(tokens, extra_keys(request))) == want
            assert cache.block_hashes(documented) == want
    finally:
        embedded.close()
        remote.close()


def test_a_lora_path_given_as_a_path_object_keys_as_its_text():
    """vLLM takes a ``pathlib.Path`` as ``LoRARequest.lora_path`` (it only opens it), where the
    connector's JSON of name and path raised TypeError, out of the scheduler's lookup into
    vLLM's. A path keys as its text."""
    from pathlib import Path
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import extra_keys, unsupported_reason

    def request(path) -> SimpleNamespace:
        return SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=path),
                               mm_features=None, cache_salt=None, prompt_token_ids=[1, 2, 3], prompt_embeds=None)

    assert unsupported_reason(request(Path("/adapters/sql-v1"))) is None
    assert extra_keys(request(Path("/adapters/sql-v1"))) == extra_keys(request("/adapters/sql-v1"))


def chunked_steps(sched, req_id: str, prompt_len: int, chunk: int):
    """vLLM's scheduler outputs for one request whose prompt runs in chunks of ``chunk``."""
    from types import SimpleNamespace

    for before in range(0, prompt_len, chunk):
        first = before == 0
        yield sched.plan(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=0)] if first else [],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[] if first else [req_id],
                                                  num_computed_tokens=[] if first else [before]),
            num_scheduled_tokens={req_id: min(chunk, prompt_len - before)}))


def test_a_chunked_prompt_saves_each_block_once():
    """Chunked prefill saves chunk by chunk, each save from where the last one ended: the
    prompt's blocks are hashed whole, but each is looked up and encoded once (it was the
    whole prefix again every chunk: 1 + 2 + ... + n blocks' worth for n chunks)."""
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import SchedulerSide

    side, cache = worker()
    side.register(VllmPages([layer_tensor(8, 32, seed=i) for i in range(L)], PageFormat("token", D, 32, 32)))
    sched = SchedulerSide([cache], block_tokens=32, load=True, save=True,
                          guard=StoreGuard(ConnectorConfig.from_extra({"codec": "raw"}), "scheduler"),
                          block_ids=lambda req_id: [2, 7, 4, 1, 5])
    tokens = list(range(3000, 3133))  # 4 full blocks of 32, and 5 tokens
    req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                          mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)
    assert sched.matched_tokens(req, 0) == 0
    sched.after_alloc(req, 0)
    saves = []
    for plan in chunked_steps(sched, "r", len(tokens), 40):
        saves += [(spec.start, len(spec.token_ids)) for spec in plan.saves]
        side.start_step(plan)
        side.finish_step(plan)
    assert saves == [(0, 32), (32, 64), (64, 96), (96, 128)]
    st = side.stats
    assert (st.saves, st.save_blocks_stored, st.save_blocks_present, st.save_failures) == (4, 4, 0, 0)
    assert cache.lookup(tokens) == 128  # the chain, whole
    cache.close()


class HeldSaves:
    """A real PrefixCache whose ``ingest_batch(wait=False)`` answers when the test says
    (``answer``), as a server's sender thread would; the starts of every call recorded."""

    def __init__(self, cache: cs.PrefixCache) -> None:
        self.cache, self.starts, self.held = cache, [], []
        self.block_tokens = cache.block_tokens

    def ingest_batch(self, requests, pages, *, wait=True, look_up_first=False, look_up_wait=None):
        from concurrent.futures import Future

        self.starts.append([r.start for r in requests])
        future = Future()
        self.held.append((requests, pages, future))
        return future

    def answer(self, i: int, ok: bool) -> None:
        requests, pages, future = self.held[i]
        if ok:
            future.set_result(self.cache.ingest_batch(requests, pages))
        else:
            future.set_exception(RuntimeError("the server went away"))


def test_the_blocks_of_a_lost_save_are_sent_again_by_the_requests_next_save():
    """A save from where the last one ended must not leave a lost save's blocks unsent: the
    worker sends them again with the request's next save (here background saves, one
    answered after the next was made), until one that covers them is stored."""
    inner, cache = worker()
    held = HeldSaves(cache)
    side = WorkerSide(held, guard=inner.guard, background_saves=True)
    side.register(VllmPages([layer_tensor(8, 32, seed=i) for i in range(L)], PageFormat("token", D, 32, 32)))
    tokens = list(range(5000, 5160))
    blocks = [2, 7, 4, 1, 5]

    def step(start, end):
        plan = StepPlan(saves=[SaveSpec("r", tokens[:end], blocks, start=start)])
        side.start_step(plan)
        side.finish_step(plan)

    step(0, 32)
    step(32, 64)  # made before the first is answered
    held.answer(0, ok=False)
    held.answer(1, ok=True)
    step(64, 96)  # the first save's block goes again
    held.answer(2, ok=True)
    step(96, 128)
    held.answer(3, ok=True)
    side.start_step(StepPlan())
    assert held.starts == [[0], [32], [0], [96]]
    assert cache.lookup(tokens) == 128
    st = side.stats
    assert (st.save_failures, st.saves, st.save_blocks_stored, st.save_blocks_present) == (1, 3, 4, 1)
    cache.close()


def test_a_finished_requests_lost_last_save_is_sent_again_from_the_pages_vllm_kept():
    """A request's last save has no next one to carry a lost save's blocks. vLLM keeps a
    finished request's pages for the workers (the scheduler names it in ``StepPlan.held``);
    the worker reports it once its save's answer has come and, that save refused, once
    it has sent the blocks again from those pages; one whose saves were stored, at once."""
    inner, cache = worker()
    held = HeldSaves(cache)
    side = WorkerSide(held, guard=inner.guard, background_saves=True, resave_hold_seconds=60)
    side.register(VllmPages([layer_tensor(8, 32, seed=i) for i in range(L)], PageFormat("token", D, 32, 32)))
    tokens, stored_tokens = list(range(6000, 6096)), list(range(7000, 7064))
    plan = StepPlan(saves=[SaveSpec("r", tokens, [2, 7, 4]), SaveSpec("q", stored_tokens, [1, 5])])
    side.start_step(plan)
    side.finish_step(plan)
    held.answer(0, ok=False)  # (both in one call: refused together)
    plan = StepPlan(saves=[SaveSpec("q", stored_tokens, [1, 5])])  # q's next save carries its loss
    side.start_step(plan)
    side.finish_step(plan)
    held.answer(1, ok=True)
    # both finished; vLLM keeps their pages until the workers report them
    side.start_step(StepPlan(held=[("r", [2, 7, 4], 100), ("q", [1, 5], 64)]))
    side.forget({"r", "q"})
    assert side.take_released() == {"q"}  # stored: its pages go back at once
    assert [r.start for r in held.held[2][0]] == [0] and cache.lookup(tokens) == 0  # r's blocks sent again
    assert side.take_released() == set()  # until that answer comes
    held.answer(2, ok=True)
    assert side.take_released() == {"r"}
    assert cache.lookup(tokens) == 96 and cache.lookup(stored_tokens) == 64
    st = side.stats
    assert (st.save_failures, st.save_resends, st.save_blocks_stored) == (2, 1, 5)
    assert side.take_released() == set() and not side._resave_from
    cache.close()


def _failed_last_save(hold: float, retry_after: float):
    """A worker whose request "r" saved once, refused; r finished, its pages held."""
    _, cache = worker()
    held = HeldSaves(cache)
    guard = StoreGuard(ConnectorConfig.from_extra({"codec": "raw", "url": "http://127.0.0.1:1",
                                                   "retry_after_seconds": retry_after}), "worker")
    side = WorkerSide(held, guard=guard, background_saves=True, resave_hold_seconds=hold)
    side.register(VllmPages([layer_tensor(8, 32, seed=i) for i in range(L)], PageFormat("token", D, 32, 32)))
    plan = StepPlan(saves=[SaveSpec("r", list(range(6000, 6064)), [2, 7])])
    side.start_step(plan)
    side.finish_step(plan)
    held.answer(0, ok=False)
    side.start_step(StepPlan(held=[("r", [2, 7], 64)]))
    side.forget({"r"})
    return cache, held, guard, side


def test_a_finished_request_waits_for_the_guard_within_its_hold_and_goes_after_it_unanswered():
    """The guard resting after the failure, the resend waits for it (the pages kept), is
    sent once it may be, and vLLM gets the pages back at the hold's end all the same if
    its answer has not come."""
    cache, held, guard, side = _failed_last_save(hold=0.8, retry_after=0.2)
    assert side.take_released() == set() and guard.rest_seconds() > 0
    time.sleep(0.3)
    assert side.take_released() == set() and held.starts == [[0], [0]]  # sent again, awaiting its answer
    time.sleep(0.6)
    assert side.take_released() == {"r"} and side.stats.save_resends == 1
    held.answer(1, ok=True)
    cache.close()


def test_a_finished_request_is_released_at_once_when_the_server_rests_past_its_hold():
    """A server down long enough that the guard's rest outlasts the hold: no resend could
    go in time, so the pages go back at once (an outage must not hold every finished
    request's pages for the whole hold)."""
    cache, held, guard, side = _failed_last_save(hold=0.5, retry_after=1.0)
    assert guard.rest_seconds() > 0 and side.take_released() == {"r"}
    assert len(held.starts) == 1 and side.stats.save_resends == 0
    cache.close()


def test_a_lookup_from_before_the_guard_opened_that_fails_late_is_not_its_probe():
    """A hung server: a lookup allowed before the guard opened fails long after, while the
    guard's probe runs. Taken as the probe's failure, it opened the guard again (its rest
    doubled) and the probe's own success came to a guard that had moved on."""
    import threading
    import time
    from types import SimpleNamespace

    from cacheseek.integrations.vllm.scheduler import SchedulerSide

    class Cache:  # each locate waits for its turn, then answers as told
        def __init__(self):
            self.turns = []

        def locate(self, keys):
            gate, outcome = self.turns.pop(0)
            gate.wait(10)
            if isinstance(outcome, BaseException):
                raise outcome
            return SimpleNamespace(num_tokens=outcome, tiers=["cpu"] * (outcome // 32))

    config = ConnectorConfig.from_extra({"codec": "raw", "url": "http://127.0.0.1:9", "block_tokens": 32,
                                         "lookup_wait_seconds": 0.01, "retry_after_seconds": 0.2,
                                         "retry_cap_seconds": 10})
    cache = Cache()
    sched = SchedulerSide([cache], block_tokens=32, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                          block_ids=lambda req_id: [], lookup_wait_seconds=config.lookup_wait_seconds)
    tokens = list(range(100, 197))

    def request(req_id):
        return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                               mm_features=None, cache_salt=None, skip_reading_prefix_cache=False)

    def matched(req_id):
        deadline = time.monotonic() + 10
        while (hit := sched.matched_tokens(request(req_id), 0)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return hit

    slow, fast, probe = threading.Event(), threading.Event(), threading.Event()
    cache.turns += [(slow, TimeoutError("slow: timed out")), (fast, TimeoutError("timed out")),
                    (probe, 96)]
    assert sched.matched_tokens(request("early"), 0) is None  # allowed, hangs
    fast.set()
    assert matched("fails") == 0 and sched.guard.breaker.state == "open"
    time.sleep(0.25)
    assert sched.matched_tokens(request("probe"), 0) is None  # the probe, running
    slow.set()  # the early lookup fails now, late
    assert matched("early") == 0 and sched.stats.lookup_errors == 2
    breaker = sched.guard.breaker.stats()
    assert breaker.state == "half_open" and breaker.trips == 1 and breaker.opened_total == 1
    probe.set()
    assert matched("probe") == 96 and sched.guard.breaker.state == "closed"
    sched.close()
