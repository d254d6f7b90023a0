"""vLLM engines with the CacheSeek connector, on SmolLM2-135M, one engine per process.

    python tests/vllm_runs.py '{"scenario": "share", "extra": {"codec": "raw", ...}}'

prints ``RESULT {json}`` as its last line; ``python tests/vllm_runs.py --serve`` runs many,
each in a process forked from one that imported vLLM once. tests/test_vllm_connector.py and
benchmarks/vllm_ttft.py run it under a Python that has vLLM (``CACHESEEK_VLLM_PYTHON``, or
their own), because vLLM's CPU worker binds the threads of its process and keeps its
connector in a process-wide global: one engine per process keeps both out of the tests.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a scenario
reads both connectors' counters (the scheduler's, and the worker's that vLLM registers as
its KV transfer group) besides vLLM's own metrics.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of pages; the default takes most of the machine's memory
    # One OpenMP thread, unbound: on a shared two-core machine vLLM's default (two threads
    # bound to the cores) spends most of a decode step waiting at OpenMP barriers.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

RUN_FLUSH_SECONDS = 120  # for the saves a remote cache sends in the background
CONNECTOR = {"kv_connector": "CacheSeekConnector", "kv_connector_module_path": "cacheseek.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
QUESTIONS = ("\n\nQuestion: which function turns a Python object into a JSON string?\nAnswer:",
             "\n\nQuestion: what does the decoder do with a duplicate key?\nAnswer:",
             "\n\nQuestion: how are NaN and Infinity handled?\nAnswer:",
             "\n\nQuestion: which class parses JSON text?\nAnswer:")


def model_path() -> str:
    from cacheseek.integrations import smollm2

    return str(smollm2.checkpoint_path())


def build_llm(extra: dict[str, Any] | None, *, max_model_len: int = 4096, **more: Any) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(more)
    if extra is not None:
        kw["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": extra}
    return LLM(model=model_path(), dtype="float32", max_model_len=max_model_len, enforce_eager=True,
               max_num_seqs=4, disable_log_stats=False, seed=0, **kw)


def prompts(llm: Any, prefix_tokens: int) -> tuple[list[int], list[list[int]]]:
    """A shared prefix of ``prefix_tokens`` tokens of real text, and one prompt per question."""
    from cacheseek.integrations.texts import stdlib_document

    tok = llm.get_tokenizer()
    ids = tok(stdlib_document("json") + "\n\n" + stdlib_document("argparse")).input_ids
    if len(ids) < prefix_tokens:
        raise RuntimeError(f"the text has {len(ids)} tokens, fewer than {prefix_tokens}")
    prefix = list(ids[:prefix_tokens])
    return prefix, [prefix + list(tok(q, add_special_tokens=False).input_ids) for q in QUESTIONS]


class Engine:
    """One LLM and what it did: each call's output tokens, its cached tokens, and the change
    in vLLM's external-hit counter."""

    def __init__(self, llm: Any, max_tokens: int) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.cold = SamplingParams(max_tokens=max_tokens, temperature=0.0, skip_reading_prefix_cache=True)

    def external_hits(self) -> int:
        return int(sum(m.value for m in self.llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"))

    def run(self, prompt: list[int], *, read: bool = True, cache_salt: str | None = None,
            lora: Any = None) -> dict[str, Any]:
        """Greedy tokens of ``prompt`` (under the ``lora`` request's adapter); ``read=False``:
        without any cache (vLLM's or ours)."""
        hits = self.external_hits()
        t0 = time.perf_counter()
        inp: dict[str, Any] = {"prompt_token_ids": prompt}
        if cache_salt is not None:
            inp["cache_salt"] = cache_salt
        out = self.llm.generate([inp], self.params if read else self.cold, use_tqdm=False, lora_request=lora)[0]
        seconds = time.perf_counter() - t0
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                "external": self.external_hits() - hits, "seconds": seconds}

    def drain(self) -> None:
        """Step the engine while it keeps finished requests' pages for the connector (a
        server's: until a lost save of theirs is sent again, ``resave_hold_seconds``):
        ``generate`` returns once its requests finish, a server's engine loop steps on."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        deadline = time.monotonic() + RUN_FLUSH_SECONDS
        while scheduler.has_finished_requests():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM still holds finished requests' pages {RUN_FLUSH_SECONDS} s on")
            self.llm.llm_engine.step()

    def reset(self) -> None:
        self.drain()  # (pages in use stop vLLM's reset)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    def stats(self) -> dict[str, dict[str, Any]]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        worker = get_kv_transfer_group()._worker
        if hasattr(worker.cache, "flush"):  # a remote cache's saves go in the background: counted once answered
            worker.cache.flush(timeout=RUN_FLUSH_SECONDS)
            worker.take_sent()
        return {"scheduler": scheduler.stats(), "worker": get_kv_transfer_group().stats()}


def loaded_and_uncached(eng: Engine, prompt: list[int]) -> dict[str, Any]:
    """``prompt`` as the cache serves it, then computed without any cache, and how far they agree."""
    loaded, baseline = eng.run(prompt), eng.run(prompt, read=False)
    return {"loaded": loaded, "baseline": baseline, "agreement": agreement(loaded["tokens"], baseline["tokens"])}


def agreement(got: list[int], want: list[int]) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(got, want))
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"equal": got == want, "matching": same, "of": len(want), "first_divergence": first}


# -- scenarios ------------------------------------------------------------------------------


def share(job: dict[str, Any]) -> dict[str, Any]:
    """One engine: prompt 0 computed and stored, vLLM's cache reset, prompt 1 loads the shared
    prefix from CacheSeek; each compared with the same prompt computed without any cache.

    With ``corrupt_block`` (a disk-only embedded cache): that block's file is then damaged
    on disk, and prompt 2 is looked up (all blocks are still indexed), loaded up to the bad
    block, and the rest recomputed by vLLM. Then again, with prompts 1 and 2 in one step
    (``shared_blocks_of_a_failed_load``)."""
    more = {"kv_cache_dtype": job["kv_cache_dtype"]} if "kv_cache_dtype" in job else {}
    eng = Engine(build_llm(job["extra"], **more), job.get("max_tokens", 16))
    prefix, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    out: dict[str, Any] = {"prefix_tokens": len(prefix), "prompt_tokens": len(ps[1])}
    connector = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector
    out["layout"] = connector.layout.to_dict()
    out["codec"] = connector.config.codec.spec()
    out["stored"] = eng.run(ps[0], read=False)
    out["after_store"] = eng.stats()
    # A reset of the connector's cache too (vLLM's, after a weight update say): the store
    # keeps its blocks, and vLLM is told so.
    out["connector_reset"] = eng.llm.reset_prefix_cache(reset_connector=True)
    eng.reset()
    out.update(loaded_and_uncached(eng, ps[1]))
    out["after_load"] = eng.stats()
    out["prometheus"] = {m.name: m.value for m in eng.llm.get_metrics() if m.name.startswith("vllm:cacheseek_")}
    if job.get("layerwise_checks"):
        out["layerwise"] = layerwise_checks(eng, ps)
    if job.get("layerwise_save_checks"):
        out["layerwise_save"] = layerwise_save_checks(eng)
    if job.get("salts"):
        # vLLM's cache_salt is part of CacheSeek's keys: a salted prompt finds nothing of the
        # unsalted one's blocks, stores its own, and another prompt with that salt finds them.
        eng.reset()
        out["salt_b"] = eng.run(ps[3], cache_salt="tenant-b")
        eng.reset()
        out["salt_b_again"] = eng.run(ps[1], cache_salt="tenant-b")
        eng.reset()
        out["salt_c"] = eng.run(ps[1], cache_salt="tenant-c")
        out["after_salts"] = eng.stats()
        # vLLM's own cache holding the first 256 tokens (two of its blocks, from a prompt that
        # leaves the prefix at token 300): CacheSeek loads from token 256 on, into the pages
        # after vLLM's own. Holding 128 (the prefix left at token 200): its hit ends inside a
        # store block, so nothing is offered and vLLM computes the rest.
        junk = list(range(5000, 5100))
        for name, cut in (("own_256", 300), ("own_128", 200)):
            eng.reset()
            eng.run(prefix[:cut] + junk, read=False)
            out[name] = eng.run(ps[1])
            out[name]["agreement"] = agreement(out[name]["tokens"], out["baseline"]["tokens"])
        out["after_own"] = eng.stats()
    if "corrupt_block" in job:
        cache = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.cache
        bad = cache.block_hashes(prefix)[job["corrupt_block"]]
        damage = functools.partial(damage_frame, job["extra"]["tiers"]["disk_path"])
        damage(bad)
        eng.reset()
        out["partial"] = rounds(eng, ps, [2])[0]
        out["after_partial"] = eng.stats()
        out["shared"] = shared_blocks_of_a_failed_load(eng, ps, prefix, damage, bad, job["corrupt_block"])
        out["after_shared"] = eng.stats()
        out["aborted"] = aborted_after_a_failed_load(eng, ps, damage, bad)
    return out


def preemption(job: dict[str, Any]) -> dict[str, Any]:
    """Four prompts at once (a question, then a 600-token prefix: they share no block) in 12
    pages of 128 tokens, with vLLM's own prefix cache off: vLLM preempts requests as they
    decode, and a preempted request, admitted again, finds its prompt only in CacheSeek
    (saved as it was computed) and loads it. Then each prompt alone without any cache."""
    from vllm import SamplingParams

    llm = build_llm(job["extra"], max_model_len=1024, num_gpu_blocks_override=12, enable_prefix_caching=False,
                    max_num_batched_tokens=512)
    prefix, _ = prompts(llm, 600)
    tok = llm.get_tokenizer()
    ps = [list(tok(q, add_special_tokens=False).input_ids) + prefix for q in QUESTIONS]
    params = SamplingParams(max_tokens=60, temperature=0.0)
    cold = SamplingParams(max_tokens=60, temperature=0.0, skip_reading_prefix_cache=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                               use_tqdm=False)]
    out: dict[str, Any] = {"preemptions": sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"),
                           "stats": Engine(llm, 1).stats()}
    want = [list(llm.generate([{"prompt_token_ids": p}], cold, use_tqdm=False)[0].outputs[0].token_ids) for p in ps]
    out["agreement"] = [agreement(a, b) for a, b in zip(got, want)]
    return out


def write_kv_adapter(path: Path, seed: int, rank: int = 8) -> None:
    """A LoRA adapter for SmolLM2 in PEFT's format, random, on k_proj and v_proj: its KV is
    not the base model's."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(30):
        for name in ("k_proj", "v_proj"):
            pre = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[pre + ".lora_A.weight"] = torch.randn(rank, 576, generator=gen) * 0.06
            weights[pre + ".lora_B.weight"] = torch.randn(192, rank, generator=gen) * 0.06
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["k_proj", "v_proj"],
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))


def lora(job: dict[str, Any]) -> dict[str, Any]:
    """Real LoRA adapters (two, random, on K and V) in one engine: prompt 0 under adapter
    ``a`` stored; vLLM's cache reset before each run: prompt 1 on the base model, under ``a``
    (compared with itself without any cache), under ``b``."""
    from vllm.lora.request import LoRARequest

    root = Path(job["workdir"])
    adapters = {}
    for i, name in enumerate(("a", "b"), start=1):
        write_kv_adapter(root / name, seed=i)
        adapters[name] = LoRARequest(name, i, str(root / name))
    eng = Engine(build_llm(job["extra"], enable_lora=True, max_lora_rank=8, max_loras=2), job.get("max_tokens", 16))
    _, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    out: dict[str, Any] = {"stored_a": eng.run(ps[0], read=False, lora=adapters["a"])}
    for name, adapter in (("base", None), ("a", adapters["a"]), ("b", adapters["b"])):
        eng.reset()
        out[name] = eng.run(ps[1], lora=adapter)
    out["a_uncached"] = eng.run(ps[1], read=False, lora=adapters["a"])
    out["stats"] = eng.stats()
    return out


def planned_ahead(job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's asynchronous scheduling (its default on a GPU; the CPU build turns it off, so it
    is turned back on here) and a chunked prefill (256 tokens a step): a load that falls short
    in step s is learnt of only after step s + 1 is planned, which runs the request's next
    chunk over the pages the load left unwritten (filled with a stand-in for other requests'
    KV first). The largest difference of each stored block's K from what it held before the
    damage, after the request; and the output against the prompt computed without a cache."""
    import torch

    turn_on_async_scheduling()
    eng = Engine(build_llm(job["extra"], enable_chunked_prefill=True, max_num_batched_tokens=256), 4)
    prefix, ps = prompts(eng.llm, 1800)
    head = prefix[:1024]
    eng.run(head, read=False)
    cache = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.cache
    with torch.inference_mode():
        want = cache.materialize(head)
    damage_frame(job["extra"]["tiers"]["disk_path"], cache.block_hashes(head)[job["corrupt_block"]])
    eng.reset()
    fill_pages()
    before = eng.stats()
    got = eng.run(ps[1])
    worker = minus_worker(eng.stats(), before)
    with torch.inference_mode():
        now = cache.materialize(head)
    diff = k_diff_per_block(want, now, cache.block_tokens)
    baseline = eng.run(ps[1], read=False)
    return {"async_scheduling": bool(eng.llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "blocks": [want.num_blocks, now.num_blocks], "k_diff": diff, "worker": worker, "got": got,
            "agreement": agreement(got["tokens"], baseline["tokens"])}


def turn_on_async_scheduling() -> None:
    """vLLM's asynchronous scheduling for the engines built after this (the CPU build turns
    it off)."""
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__

    def with_async_scheduling(cls: Any, config: Any) -> None:
        check(cls, config)
        config.scheduler_config.async_scheduling = True

    cpu.CpuPlatform.check_and_update_config = classmethod(with_async_scheduling)


def fill_pages(value: float = 3.0) -> None:
    """Every page of the engine filled with ``value``: a stand-in for other requests' KV
    where a load leaves pages unwritten."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    for k, v in get_kv_transfer_group()._worker.pages.views:
        k.fill_(value)
        v.fill_(value)


def k_diff_per_block(want: Any, got: Any, block: int) -> list[float]:
    """The largest difference of K, over every layer, per block the two prefixes share."""
    return [max(float((a[..., b * block:(b + 1) * block, :] - c[..., b * block:(b + 1) * block, :]).abs().max())
                for (a, _), (c, _) in zip(want.layers, got.layers)) for b in range(min(want.num_blocks, got.num_blocks))]


def damage_frame(disk_path: str, block: bytes) -> None:
    """Flip the payload's tail of ``block``'s frame on disk: its checksum no longer holds."""
    frame = next(Path(disk_path).rglob(f"{block.hex()}.frame"))
    data = bytearray(frame.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    frame.write_bytes(bytes(data))


def shared_blocks_of_a_failed_load(eng: Engine, ps: list[list[int]], prefix: list[int], damage_block: Any,
                                   bad: bytes, index: int) -> dict[str, Any]:
    """Prompts 1 and 2 in one step, block ``index`` damaged again: vLLM gives prompt 2 the
    blocks prompt 1 is loading as its own prefix hit, so both forwards read the pages the
    load leaves unwritten (here filled with a stand-in for other requests' KV first). The
    largest difference of the stored prefix's K from what it held before, after the step."""
    import torch

    cache = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.cache
    with torch.inference_mode():
        want = cache.materialize(prefix)
    damage_block(bad)
    eng.reset()
    fill_pages()
    before = eng.stats()
    outs = eng.llm.generate([{"prompt_token_ids": ps[1]}, {"prompt_token_ids": ps[2]}], eng.params, use_tqdm=False)
    with torch.inference_mode():
        got = cache.materialize(prefix)
    diff = k_diff_per_block(want, got, cache.block_tokens)
    return {"blocks": [want.num_blocks, got.num_blocks], "k_diff": diff, "index": index,
            "worker": minus_worker(eng.stats(), before), "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def aborted_after_a_failed_load(eng: Engine, ps: list[list[int]], damage_block: Any, bad: bytes) -> dict[str, Any]:
    """The block damaged again; prompt 1 runs one step: its load stops at the block, and
    vLLM ("recompute") rolls it back, keeping the blocks it was to load in its own prefix
    cache for the request to recompute in place. The request is aborted before its next
    step. Prompt 2 then (vLLM's own hit on the prefix), and prompt 3 with vLLM's cache
    reset (loaded from the store only): each compared with itself without any cache."""
    damage_block(bad)
    eng.reset()
    fill_pages()
    before = eng.stats()
    engine = eng.llm.llm_engine
    engine.add_request("aborted", {"prompt_token_ids": ps[1]}, eng.params)
    engine.step()
    engine.abort_request(["aborted"])
    out: dict[str, Any] = {"after": eng.run(ps[2])}
    eng.reset()
    out["store_only"] = eng.run(ps[3])
    out["worker"] = minus_worker(eng.stats(), before)
    for name, i in (("after", 2), ("store_only", 3)):
        out[name]["agreement"] = agreement(out[name]["tokens"], eng.run(ps[i], read=False)["tokens"])
    return out


def sharers(job: dict[str, Any]) -> dict[str, Any]:
    """Prompt 0 stored; block ``corrupt_block`` of the prefix damaged on disk. Prompts 1 and
    2 added at once: prompt 1 loads the prefix (its load stops at the bad block), and vLLM
    gives prompt 2 the blocks prompt 1 is loading as its own prefix hit in the same step,
    so both forwards read pages the load never wrote (filled with a stand-in for other
    requests' KV first). vLLM ("recompute") rolls prompt 1 back to the bad block and
    prompt 2 to where it stood before the step, counting the shared blocks as computed:
    prompt 1 is to recompute them. Per case, both outputs against each prompt computed
    without any cache: ``together`` (both run on), ``first_aborted`` (prompt 1 aborted
    after that step, so nothing recomputes the shared blocks before prompt 2 reads them)."""
    if job.get("async_scheduling"):
        turn_on_async_scheduling()
    eng = Engine(build_llm(job["extra"], **job.get("llm", {})), job.get("max_tokens", 16))
    prefix, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    eng.run(ps[0], read=False)
    cache = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.cache
    bad = cache.block_hashes(prefix)[job["corrupt_block"]]
    want = {i: eng.run(ps[i], read=False)["tokens"] for i in (1, 2)}
    engine = eng.llm.llm_engine
    out: dict[str, Any] = {}
    for case in job.get("cases", ("together", "first_aborted")):
        damage_frame(job["extra"]["tiers"]["disk_path"], bad)
        eng.reset()
        fill_pages()
        before = eng.stats()
        a, b = f"{case}-1", f"{case}-2"
        engine.add_request(a, {"prompt_token_ids": ps[1]}, eng.params)
        if case != "alone":
            engine.add_request(b, {"prompt_token_ids": ps[2]}, eng.params)
        tokens: dict[str, list[int]] = {a: [], b: []}
        cached: dict[str, int] = {}
        first = True
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.outputs:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    cached[o.request_id] = o.num_cached_tokens or 0
            if first and case == "first_aborted":
                engine.abort_request([a])
            first = False
        after = eng.stats()
        res = {"worker": minus_worker(after, before), "cached": cached,
               "second": agreement(tokens[b], want[2]) if case != "alone" else None,
               "rollbacks": after["scheduler"]["load_failure_rollbacks"] - before["scheduler"]["load_failure_rollbacks"]}
        if case != "first_aborted":
            res["first"] = agreement(tokens[a], want[1])
        out[case] = res
    return out


def layerwise_checks(eng: Engine, ps: list[list[int]]) -> dict[str, Any]:
    """Prompt 1 loaded layer by layer (the forward waiting for each layer in
    ``wait_for_layer_load``) and whole (every layer before the forward), vLLM's cache reset
    before each: the greedy tokens, and the loaded tokens' KV as the pages hold it after the
    step, of both. Then prompt 2 with layer group 2's decode failing once (after the forward
    read layers 0-2): the worker's counters, and its output against itself computed."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from cacheseek.layerwise import LayerwiseDecoder

    side = get_kv_transfer_group()._worker
    captured: list[list[torch.Tensor]] = []
    finish = side.finish_step

    def finish_step(plan: Any) -> None:
        finish(plan)  # the load closed, the pages of its tokens as the forward left them
        pages = side.pages
        for spec in plan.loads:
            t = torch.arange(spec.start, spec.end)
            page = torch.tensor(pages.page_table(spec.block_ids, spec.end))[t // pages.fmt.page_tokens]
            off = t % pages.fmt.page_tokens
            captured.append([x[page, :, off].clone() for k, v in pages.views for x in (k, v)])

    side.finish_step = finish_step
    out: dict[str, Any] = {}
    try:
        runs = {}
        for name, layerwise in (("layerwise", True), ("whole", False)):
            side.layerwise = layerwise
            captured.clear()
            eng.reset()
            before = eng.stats()
            runs[name] = (eng.run(ps[1]), list(captured))
            after = eng.stats()
            out[name] = {"run": runs[name][0], "worker": minus_worker(after, before), "captured": len(captured)}
        (lw, lw_kv), (whole, whole_kv) = runs["layerwise"], runs["whole"]
        out["tokens_equal"] = lw["tokens"] == whole["tokens"]
        out["pages_equal"] = len(lw_kv) == len(whole_kv) == 1 and all(
            torch.equal(a, b) for a, b in zip(lw_kv[0], whole_kv[0]))
    finally:
        side.finish_step = finish
        side.layerwise = True
    real, fired = LayerwiseDecoder.run_group, []

    def run_group(self: Any, g: int, timing: bool = False) -> Any:
        if g == 2 and not fired:
            fired.append(g)
            raise RuntimeError("injected: layer group 2's decode failed")
        return real(self, g, timing)

    LayerwiseDecoder.run_group = run_group
    before = eng.stats()
    try:
        out["failed"] = rounds(eng, ps, [2])[0]
    finally:
        LayerwiseDecoder.run_group = real
    out["failed"]["fired"] = bool(fired)
    out["failed"]["worker"] = minus_worker(eng.stats(), before)
    return out


def layerwise_save_checks(eng: Engine) -> dict[str, Any]:
    """A prompt new to every cache, computed twice (vLLM's cache reset, nothing read), its
    blocks saved by the worker into a fresh embedded cache with a CPU tier each time: layer
    by layer (each attention layer's ``save_kv_layer`` feeding the step's writer) and whole
    (``wait_for_save``). The worker's counters of both, and their stored frames compared
    byte for byte."""
    import cacheseek as cs
    from cacheseek import layerwise_save

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    original, floor = side.cache, layerwise_save.MIN_SAVE_BYTES
    layerwise_save.MIN_SAVE_BYTES = 0  # a few blocks of SmolLM2 are far below the default
    prompt = list(range(7000, 7000 + 3 * original.block_tokens + 40))
    out: dict[str, Any] = {}
    frames = {}
    try:
        for name, on in (("layerwise", True), ("whole", False)):
            cache = cs.PrefixCache(model_id="layerwise-save", layout=original.layout, codec=original.codec,
                                   block_tokens=original.block_tokens,
                                   tiers=cs.TierConfig(cpu_bytes="256MiB", pin_memory=False))
            side.cache, side.layerwise_save = cache, on
            try:
                eng.reset()
                before = eng.stats()
                eng.run(prompt, read=False)
                out[name] = {"worker": minus_worker(eng.stats(), before), "fallback": side.last_save_fallback}
                got = cache.store.get_many(cache.block_hashes(prompt))
                frames[name] = [None if f is None else bytes(f[0].payload_view()) for f in got]
                out[name]["blocks"] = sum(f is not None for f in frames[name])
            finally:
                cache.close()
        out["frames_equal"] = frames["layerwise"] == frames["whole"] and None not in frames["whole"]
    finally:
        side.cache, side.layerwise_save, layerwise_save.MIN_SAVE_BYTES = original, False, floor
    return out


def minus_worker(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before["worker"][k] for k, v in after["worker"].items()}


def store(job: dict[str, Any]) -> dict[str, Any]:
    """Compute prompt 0 (its prefix is stored) and exit. ``fail_first_save``: the worker's
    first save is refused (the prompt's only one: its last); vLLM keeps the finished
    request's pages, and the save goes again from them once the guard lets it."""
    eng = Engine(build_llm(job["extra"]), job.get("max_tokens", 16))
    _, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    if job.get("fail_first_save"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group()._worker
        side.cache = FailFirstSave(side.cache)
    out = {"stored": eng.run(ps[0], read=False)}
    eng.drain()
    out["after_store"] = eng.stats()
    # Prompt 0 again: vLLM's own prefix cache serves it whole, and its save (from token 0)
    # asks the server first: every block found stored, none encoded.
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    before = get_kv_transfer_group()._worker.cache.client_stats()["write_behind"]
    out["repeat"] = eng.run(ps[0])
    eng.drain()
    out["after_repeat"] = eng.stats()
    after = get_kv_transfer_group()._worker.cache.client_stats()["write_behind"]
    out["repeat_write_behind"] = {k: after[k] - before[k] for k in ("writes_queued", "lookups_first_late")}
    return out


def load(job: dict[str, Any]) -> dict[str, Any]:
    """A fresh engine (nothing in vLLM's cache): prompt 1, then prompt 1 without any cache.

    With ``kill_pid`` (the server's): prompts 2 and 3 are then run (vLLM's cache reset
    before each) and compared with themselves without any cache; the server is SIGKILLed
    mid-run, inside prompt 2's step, after its lookup found the prefix and before the
    worker's load: the load fails, vLLM is told its blocks and recomputes them."""
    eng = Engine(build_llm(job["extra"]), job.get("max_tokens", 16))
    _, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    if "url" in job["extra"]:
        # Each lookup answered 50 ms late: on a loaded machine one could finish within the
        # scheduler's wait (1 us in the tests) before the wait began, and the deferral path
        # vLLM takes ("not yet", asked again) would not run.
        sched = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        sched.caches = [SlowLocate(c) for c in sched.caches]
    out: dict[str, Any] = loaded_and_uncached(eng, ps[1])
    out["after_load"] = eng.stats()
    if job.get("fail_first_load"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group()._worker
        real, side.cache = side.cache, FailFirstLoad(side.cache)
        out["failed_load"] = rounds(eng, ps, [2])[0]
        out["failed_load_calls"] = side.cache.calls
        side.cache = real
        out["after_failed_load"] = eng.stats()
    if "kill_pid" in job:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group()._worker
        side.cache = KillBeforeLoad(side.cache, job["kill_pid"], job["extra"]["url"])
        out["after_kill"] = rounds(eng, ps, [2, 3])
        out["killed_in_load"] = side.cache.killed
        out["after_kill_stats"] = eng.stats()
    return out


def tensor_parallel(job: dict[str, Any]) -> dict[str, Any]:
    """Tensor parallelism over three worker processes (vLLM's multiprocessing executor; one
    of SmolLM2's three KV heads each), through a server: prompt 0 computed and stored (each
    rank its own shard of the heads, under its own keys), vLLM's cache reset, prompt 1 loads
    the prefix on every rank; compared with prompt 1 computed without any cache. The
    workers live in their own processes: their counters are read as vLLM hands them to the
    scheduler, summed over the ranks."""
    # Each rank's pages: 256 MiB, not VLLM_CPU_KVCACHE_SPACE's whole GiB (its least), which
    # vLLM's CPU build takes over kv_cache_memory_bytes: 3 GiB of the engine's 6.5 GB (PSS),
    # beside another engine on a CI runner. 16K tokens of one KV head: 4 prompts of 4,096.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    llm = build_llm(job["extra"], tensor_parallel_size=job.get("tp", 3), distributed_executor_backend="mp",
                    kv_cache_memory_bytes=256 << 20)
    workers = workers_counted(llm)
    eng = Engine(llm, job.get("max_tokens", 8))
    _, ps = prompts(eng.llm, job.get("prefix_tokens", 1100))
    out: dict[str, Any] = {"stored": eng.run(ps[0], read=False)}
    # The ranks' saves go in the background, from their own processes: wait until the
    # server holds every rank's blocks of the prefix before asking for it.
    stored_blocks(job["extra"]["url"], job.get("tp", 3) * (job.get("prefix_tokens", 1100) // 256))
    eng.reset()
    out.update(loaded_and_uncached(eng, ps[1]))
    out["scheduler"] = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector.stats()
    out["workers"] = dict(workers)
    return out


def tiny_model(path: Path, arch: str = "deepseek_v2") -> None:
    """A model of random weights written to ``path`` once, with no tokenizer (prompts go in
    as token ids): ``deepseek_v2``, 3 dense layers with an MLA latent of 512 + 64 per token
    (the width of DeepSeek-V2/V3's), or ``llama``, 4 layers of 2 KV heads of 64. The same
    seed, the same weights: every engine of a test computes one KV."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

    common = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
    if arch == "llama":
        model_cls, config = LlamaForCausalLM, LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **common)
    else:
        model_cls, config = DeepseekV2ForCausalLM, DeepseekV2Config(
            num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=128, **common)
    torch.manual_seed(0)
    tmp = path.with_name(path.name + f".{os.getpid()}")
    model_cls(config).to(torch.float32).save_pretrained(tmp, safe_serialization=True)
    try:
        tmp.rename(path)
    except OSError:  # (another engine wrote it first: the same weights)
        pass


def tiny_engine(path: Path, extra: dict[str, Any], max_tokens: int, kv_role: str = "kv_both", dtype: str = "float32",
                **more: Any) -> Engine:
    """An ``Engine`` on a ``tiny_model``: prompts of token ids, every run decoding
    ``max_tokens`` (random weights give an end-of-text token at any step)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=dtype, max_model_len=2048, enforce_eager=True, max_num_seqs=4, seed=0,
              skip_tokenizer_init=True, disable_log_stats=False,
              kv_transfer_config={**CONNECTOR, "kv_role": kv_role, "kv_connector_extra_config": extra}, **more)
    eng = Engine(llm, max_tokens)
    eng.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.cold = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, skip_reading_prefix_cache=True)
    return eng


def mla(job: dict[str, Any]) -> dict[str, Any]:
    """An MLA model (``tiny_model``), raw: prompt 0 computed and stored, vLLM's cache
    reset, prompt 1 loads the shared prefix; compared with prompt 1 computed without any
    cache. ``tp``: that many worker processes (a server's url in the extra); ``store``
    false: prompt 1 only, its prefix stored by another engine before. Also what the
    connector makes of its settings: the layout and codec, and int4 refused. ``backend``: vLLM's
    MLA attention backend (default CPU_MLA: vLLM would pick AMX_MLA where the CPU has AMX,
    which takes bf16 weights only), in ``dtype`` (default float32)."""
    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.config import ConnectorConfig
    from cacheseek.integrations.vllm.connector import _codec_for

    path = Path(job["model_dir"])
    tiny_model(path)
    tp = job.get("tp", 1)
    more: dict[str, Any] = {}
    if tp > 1:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        more = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp", "kv_cache_memory_bytes": 128 << 20}
    eng = tiny_engine(path, job["extra"], job.get("max_tokens", 16), dtype=job.get("dtype", "float32"),
                      attention_backend=job.get("backend", "CPU_MLA"), **more)
    llm = eng.llm
    workers = workers_counted(llm)
    prefix = [3 + (i * 37) % 500 for i in range(job.get("prefix_tokens", 640))]
    ps = [prefix + [3 + (q * 101 + i * 13) % 500 for i in range(24)] for q in range(2)]
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    out: dict[str, Any] = {"layout": connector.layout.to_dict(), "codec": connector.config.codec.spec(),
                           "scheduler_caches": len(connector._caches), "backend": attention_backends(llm)}
    try:
        _codec_for(ConnectorConfig.from_extra({"codec": "int4"}), connector.layout, {"codec": "int4"}, mla=True)
    except ConfigError as exc:
        out["int4"] = str(exc)
    if job.get("store", True):
        out["stored"] = eng.run(ps[0], read=False)
        if "url" in job["extra"]:
            stored_blocks(job["extra"]["url"], len(prefix) // job["extra"]["block_tokens"])
        eng.reset()
    out.update(loaded_and_uncached(eng, ps[1]))
    if tp == 1:
        out["after_load"] = eng.stats()
    out["scheduler"] = connector.stats()
    out["workers"] = dict(workers)
    return out


def prefill_decode(job: dict[str, Any]) -> dict[str, Any]:
    """Disaggregated prefill through a server, one side per process (``tiny_model`` llama):
    ``kv_producer`` computes a prompt for one token, and the server's blocks are counted the
    moment that answer is back; ``kv_consumer`` (a fresh engine) then serves the same prompt
    for 16 tokens, its prefix loaded, and again with no cache."""
    path = Path(job["model_dir"])
    tiny_model(path, "llama")
    role = job["kv_role"]
    eng = tiny_engine(path, job["extra"], 1 if role == "kv_producer" else 16, kv_role=role)
    prompt = [3 + (i * 37) % 500 for i in range(job.get("prompt_tokens", 660))]
    connector = eng.llm.llm_engine.engine_core.engine_core.scheduler.connector
    out: dict[str, Any] = {"background_saves": connector.config.background_saves}
    if role == "kv_producer":
        import httpx

        out["first"] = eng.run(prompt)
        out["blocks_on_answer"] = httpx.get(job["extra"]["url"] + "/v1/stats", timeout=30).json()["tiers"][0]["blocks"]
    else:
        out.update(loaded_and_uncached(eng, prompt))
    out["stats"] = eng.stats()
    return out


def attention_backends(llm: Any) -> list[str] | None:
    """The attention backends of the model's layers, where its worker runs in this process
    (None where the workers are processes of their own)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed.kv_transfer import has_kv_transfer_group
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    if not has_kv_transfer_group():
        return None
    layers = get_layers_from_vllm_config(llm.llm_engine.vllm_config, AttentionLayerBase)
    return sorted({layer.get_attn_backend().get_name() for layer in layers.values()})


def workers_counted(llm: Any) -> dict[str, float]:
    """The workers' connector counters (``ConnectorStats`` fields), summed over the ranks,
    kept up to date: each step's output carries every worker's changes since the last
    (``get_kv_connector_stats``), which vLLM adds up across the ranks before its scheduler
    reads them. Counted here as the scheduler takes the step's output."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    totals: dict[str, float] = {}
    take = scheduler.update_from_output

    def counted(scheduler_output: Any, model_output: Any) -> Any:
        connector_output = getattr(model_output, "kv_connector_output", None)
        stats = getattr(connector_output, "kv_connector_stats", None)
        for name, value in (stats.data if stats is not None else {}).items():
            totals[name] = totals.get(name, 0) + value
        return take(scheduler_output, model_output)

    scheduler.update_from_output = counted
    return totals


def stored_blocks(url: str, want: int) -> None:
    import httpx

    deadline = time.monotonic() + RUN_FLUSH_SECONDS
    while (held := httpx.get(url + "/v1/stats", timeout=30).json()["tiers"][0]["blocks"]) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server holds {held} blocks, not {want}, {RUN_FLUSH_SECONDS} s after the saves")
        time.sleep(0.1)


class FailFirstLoad:
    """The worker's ``RemoteCache``, its first load raising (the scheduler's lookups, in the
    scheduler's own cache, go on finding the prefix)."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.calls = cache, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def materialize_into_batch(self, requests: Any, pages: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: the worker's first load failed")
        return self.cache.materialize_into_batch(requests, pages, **kw)


class FailFirstSave:
    """The worker's ``RemoteCache``, its first save refused as a server that is down for a
    moment refuses it (the sender's future fails), later ones sent."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.calls = cache, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def ingest_batch(self, requests: Any, pages: Any, **kw: Any) -> Any:
        from concurrent.futures import Future

        from cacheseek.errors import RemoteUnavailable

        self.calls += 1
        if self.calls > 1:
            return self.cache.ingest_batch(requests, pages, **kw)
        refused: Future = Future()
        refused.set_exception(RemoteUnavailable("injected: the server refused the first save", url="(test)"))
        return refused


class SlowLocate:
    """A cache whose ``locate`` answers 50 ms late."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def locate(self, keys: Any) -> Any:
        time.sleep(0.05)
        return self.cache.locate(keys)


class KillBeforeLoad:
    """The worker's ``RemoteCache``, with the server SIGKILLed just before the first load
    (the real call then runs against a dead server)."""

    def __init__(self, cache: Any, pid: int, url: str) -> None:
        self.cache, self.pid, self.url, self.killed = cache, pid, url, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def materialize_into_batch(self, requests: Any, pages: Any, **kw: Any) -> Any:
        if not self.killed:
            import socket
            from urllib.parse import urlsplit

            os.kill(self.pid, signal.SIGKILL)
            where = urlsplit(self.url)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until its port refuses connections
                try:
                    socket.create_connection((where.hostname, where.port), timeout=0.2).close()
                except OSError:
                    break
                time.sleep(0.05)
            self.killed = True
        return self.cache.materialize_into_batch(requests, pages, **kw)


def rounds(eng: Engine, ps: list[list[int]], which: list[int]) -> list[dict[str, Any]]:
    out = []
    for i in which:
        eng.reset()
        got, want = eng.run(ps[i]), eng.run(ps[i], read=False)
        out.append({"prompt": i, "got": got, "want": want, "agreement": agreement(got["tokens"], want["tokens"])})
    return out


def ttft(job: dict[str, Any]) -> dict[str, Any]:
    """Time to first token of prompts sharing a prefix, for benchmarks/vllm_ttft.py. With a
    connector, prompt 0 stores the prefix first. ``reset`` (default true): vLLM's own prefix
    cache is emptied before each timed prompt; false: it holds the prefix (its warm case)."""
    from vllm import SamplingParams

    eng = Engine(build_llm(job.get("extra"), max_model_len=job.get("max_model_len", 4096)), 1)
    prefix, ps = prompts(eng.llm, job["prefix_tokens"])
    warm_up = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
    eng.llm.generate([{"prompt_token_ids": list(range(100, 164))}], warm_up, use_tqdm=False)
    eng.run(ps[0], read=job.get("extra") is None)  # stores the prefix (connector), or fills vLLM's cache
    before = eng.stats() if job.get("extra") is not None else None
    rows = []
    for i in range(job.get("repeats", 3)):
        if job.get("reset", True):
            eng.reset()
        rows.append(eng.run(ps[1 + i % (len(ps) - 1)]))
    out: dict[str, Any] = {"prefix_tokens": len(prefix), "prompt_tokens": len(ps[1]), "runs": rows}
    if before is not None:
        out["before"], out["after"] = before, eng.stats()
    return out


def steps(job: dict[str, Any]) -> dict[str, Any]:
    """For benchmarks/vllm_remote_load.py: a request decoding while another's prefix is
    loaded from the server. Prompt 0 stores the prefix; vLLM's cache is emptied; request
    "decoding" (a short prompt, ``decode_tokens`` tokens) runs a few steps, then request
    "loading" (prompt 1: the prefix and a question) arrives. Per step of the engine: its
    seconds and which requests got a token. Returns the steps and when "loading" got its
    token."""
    from vllm import SamplingParams

    eng = Engine(build_llm(job["extra"], max_model_len=job.get("max_model_len", 4096)), 1)
    _, ps = prompts(eng.llm, job["prefix_tokens"])
    eng.run(ps[0], read=False)
    eng.stats()  # (the save answered)
    eng.reset()
    engine = eng.llm.llm_engine
    engine.add_request("decoding", {"prompt_token_ids": list(range(200, 232))},
                       SamplingParams(max_tokens=job.get("decode_tokens", 64), temperature=0.0, ignore_eos=True))
    rows: list[dict[str, Any]] = []

    def step() -> None:
        t0 = time.perf_counter()
        outs = engine.step()
        rows.append({"seconds": time.perf_counter() - t0,
                     "tokens": sorted(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)})

    for _ in range(job.get("steps_before", 6)):
        step()
    arrived = len(rows)
    engine.add_request("loading", {"prompt_token_ids": ps[1]}, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        step()
    first = next(i for i, r in enumerate(rows) if "loading" in r["tokens"])
    return {"steps": rows, "arrived": arrived, "loading_token_step": first,
            "loading_seconds": sum(r["seconds"] for r in rows[arrived : first + 1]), "stats": eng.stats()}


def keys(job: dict[str, Any]) -> dict[str, Any]:
    """The connector's scheduler and worker sides driven with vLLM's own ``Request``,
    ``LoRARequest``, ``MultiModalFeatureSpec`` and ``SchedulerOutput`` objects (no model):
    prompts with the same tokens under other LoRA adapters, cache salts or images are
    stored in one step, then looked up and loaded. Returns, per variant, the tokens its
    lookup found and whether the KV loaded into fresh pages is that variant's own."""
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    import cacheseek as cs
    from cacheseek.integrations.vllm.config import ConnectorConfig
    from cacheseek.integrations.vllm.guard import StoreGuard
    from cacheseek.integrations.vllm.pages import PageFormat, VllmPages
    from cacheseek.integrations.vllm.scheduler import SchedulerSide
    from cacheseek.integrations.vllm.worker import WorkerSide

    B, L, H, D, PAGE = 32, 2, 2, 16, 16
    cache = cs.PrefixCache(model_id="keys", layout=cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D,
                                                               dtype="float32"),
                           codec=cs.Raw(), block_tokens=B, tiers=cs.TierConfig(cpu_bytes="16MiB"))
    config = ConnectorConfig.from_extra({"codec": "raw"})
    blocks: dict[str, list[int]] = {}
    sched = SchedulerSide([cache], block_tokens=B, load=True, save=True, guard=StoreGuard(config, "scheduler"),
                          block_ids=lambda rid: blocks[rid])
    worker = WorkerSide(cache, guard=StoreGuard(config, "worker"))
    layers = [torch.randn(128, H, PAGE, 2 * D, generator=torch.Generator().manual_seed(i)) for i in range(L)]
    worker.register(VllmPages(layers, PageFormat("channel", D, PAGE, PAGE)))
    tokens = list(range(1000, 1100))  # 3 store blocks before the last token, 7 vLLM blocks

    def image(h: str) -> Any:
        return MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                     mm_position=PlaceholderRange(offset=40, length=20))

    def embeds(mixed: bool) -> dict[str, Any]:
        """Prompt embeddings with the same token ids beside them: vLLM's mixed mode (positions
        50 on take an embedding, their ids are placeholders), or ids given with embeddings
        for every position. Their KV is the embeddings', which the ids do not name."""
        mask = [i < 50 for i in range(len(tokens))] if mixed else None
        return {"prompt_embeds": torch.randn(len(tokens), 8), "prompt_is_token_ids": mask}

    variants = {
        "plain": {}, "lora_sql": {"lora_request": LoRARequest("sql", 1, "/adapters/sql")},
        "lora_chat": {"lora_request": LoRARequest("chat", 2, "/adapters/chat")},
        # the name "sql" pointed at another adapter (vLLM keys its own blocks by name and path)
        "lora_sql_repointed": {"lora_request": LoRARequest("sql", 4, "/adapters/sql-v2")},
        "salt_a": {"cache_salt": "tenant-a"}, "salt_b": {"cache_salt": "tenant-b"},
        "image_1": {"mm_features": [image("img-1")]}, "image_2": {"mm_features": [image("img-2")]},
        "embeds_mixed": embeds(True), "embeds_with_ids": embeds(False),
        "lora_unnamed": {"lora_request": LoRARequest("", 3, "/adapters/unnamed")},  # (vLLM takes it)
    }
    stored = ("plain", "lora_sql", "salt_a", "image_1", "embeds_mixed")  # (the last is not saved)
    free = iter(range(128))

    def step(reqs: list[Any], scheduled: int) -> Any:
        new = [NewRequestData.from_request(r, (blocks[r.request_id],)) for r in reqs]
        out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
                              num_scheduled_tokens={r.request_id: scheduled for r in reqs},
                              total_num_scheduled_tokens=scheduled * len(reqs), scheduled_spec_decode_tokens={},
                              scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
        return sched.plan(out)

    # Step 1: each stored variant computed (no hit) and saved, in one batched call.
    reqs = []
    for name in stored:
        req = Request(f"store-{name}", tokens, SamplingParams(max_tokens=1), None, **variants[name])
        assert sched.matched_tokens(req, 0) == 0
        blocks[req.request_id] = [next(free) for _ in range(7)]
        sched.after_alloc(req, 0)
        reqs.append(req)
    plan = step(reqs, len(tokens))
    worker.start_step(plan)
    worker.finish_step(plan)
    out: dict[str, Any] = {"save_calls": worker.stats.save_calls, "saves": worker.stats.saves,
                           "stored_blocks": worker.stats.save_blocks_stored, "found": {}, "own_kv": {}}

    def kv_of(rid: str, a: int, n: int) -> list[torch.Tensor]:
        t = torch.arange(a, n)
        page = torch.tensor(blocks[rid])[t // PAGE]
        return [x.transpose(0, 1)[:, page, t % PAGE] for k, v in worker.pages.views for x in (k, v)]

    # Step 2: every variant looked up (vLLM's get_num_new_matched_tokens), the hits loaded.
    reqs = []
    for name, kw in variants.items():
        req = Request(f"load-{name}", tokens, SamplingParams(max_tokens=1), None, **kw)
        hit = sched.matched_tokens(req, 0)
        out["found"][name] = hit
        blocks[req.request_id] = [next(free) for _ in range(7)]
        sched.after_alloc(req, hit)
        req.num_computed_tokens = hit
        if hit:
            reqs.append(req)
    plan = step(reqs, 4)
    worker.start_step(plan)
    out["load_calls"], out["loads"] = worker.stats.load_calls, worker.stats.loads
    out["failed_blocks"] = sorted(worker.take_failed_blocks())
    for req in reqs:
        name = req.request_id.removeprefix("load-")
        n = out["found"][name]
        own = f"store-{name}" if name in stored else "store-plain"
        # An image keys the blocks its placeholders overlap ([40, 60): blocks 1 and 2), as in
        # vLLM: block 0 of an image prompt is the plain prompt's block, stored once.
        first = B if name.startswith("image") else 0
        same = [torch.equal(a, b) for a, b in zip(kv_of(req.request_id, first, n), kv_of(own, first, n))]
        same += [torch.equal(a, b) for a, b in zip(kv_of(req.request_id, 0, first), kv_of("store-plain", 0, first))]
        out["own_kv"][name] = all(same)
        if name == "lora_sql":  # and not the plain prompt's: the pages of each store differ
            out["sql_is_plain"] = all(torch.equal(a, b) for a, b in zip(kv_of(req.request_id, 0, n),
                                                                        kv_of("store-plain", 0, n)))
    out["scheduler"] = sched.stats.to_dict()
    cache.close()
    return out


def specs(job: dict[str, Any]) -> dict[str, Any]:
    """Which of vLLM's KV cache specs (one group of 2 layers) the connector takes, and the
    ConfigError of each it refuses. vLLM keeps a sliding-window or chunked-local group's
    blocks only within the window: it hands the null block in place of the others, both
    as a request's own prefix hit and for external tokens."""
    import torch
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec)

    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.connector import _layout

    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    kinds = {
        "full": FullAttentionSpec(**common),
        "full_computed_as_sliding": FullAttentionSpec(**common, sliding_window=128),  # (vLLM's promoted SWA)
        "sliding_window": SlidingWindowSpec(**common, sliding_window=128),
        "chunked_local": ChunkedLocalAttentionSpec(**common, attention_chunk_size=128),
        "mla": MLAAttentionSpec(**{**common, "num_kv_heads": 1, "head_size": 576}),
        "mla_odd": MLAAttentionSpec(**{**common, "num_kv_heads": 1, "head_size": 575}),
    }
    out: dict[str, Any] = {}
    for name, spec in kinds.items():
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["l.0.attn", "l.1.attn"], spec)])
        try:
            layout, _ = _layout(config, CacheConfig())
            out[name] = layout.to_dict() if name.startswith("mla") else layout.num_layers
        except ConfigError as exc:
            out[name] = str(exc)
    out["fp8"] = fp8_specs()
    return out


def executor(job: dict[str, Any]) -> dict[str, Any]:
    """The connector (scheduler side) made on the config vLLM makes for one worker (its
    platform's changes applied; no model loaded), with V1 multiprocessing on (vLLM's
    default) and off, embedded and remote: each ConfigError, or "ok"."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.connector import CacheSeekConnector

    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["l.0.attn", "l.1.attn"], spec)])
    out: dict[str, Any] = {}
    for name, multiprocessing, more in (("default", "1", {}), ("off", "0", {}),
                                        ("off_mp_asked", "0", {"distributed_executor_backend": "mp"})):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
        for kind, extra in (("embedded", {"codec": "raw", "tiers": {"cpu_bytes": "64MiB"}}),
                            ("remote", {"codec": "raw", "url": "http://127.0.0.1:1"})):
            config = EngineArgs(model=model_path(), dtype="float32", max_model_len=1024,
                                kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": extra},
                                **more).create_engine_config()
            out.setdefault(name, {"backend": config.parallel_config.distributed_executor_backend})
            try:
                connector = CacheSeekConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
                out[name][kind] = "ok"
                connector.shutdown()
            except ConfigError as exc:
                out[name][kind] = str(exc)
    return out


def fp8_specs() -> dict[str, Any]:
    """vLLM's KV cache specs and cache configs of each --kv-cache-dtype (its fp8 pages are
    uint8): the KV dtype the connector reads the pages as, or the ConfigError it refuses
    with; the codec it stores them with, given none, raw or int4; and its check of vLLM's
    CPU kernel writing fp8 pages (the bytes and where they are)."""
    import types

    import torch
    from vllm.config import CacheConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.config import ConnectorConfig
    from cacheseek.integrations.vllm.connector import _codec_for, _kv_dtype, _layout, check_cpu_pages
    from cacheseek.integrations.vllm.pages import PageFormat

    def attempt(f: Any) -> Any:
        try:
            return f()
        except ConfigError as exc:
            return "ConfigError: " + str(exc)

    def layout_of(cache_dtype: str, spec_dtype: Any = None, **cache: Any) -> Any:
        spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64,
                                 dtype=spec_dtype or STR_DTYPE_TO_TORCH_DTYPE.get(cache_dtype, torch.float32))
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["l.0.attn", "l.1.attn"], spec)])
        return _layout(config, CacheConfig(cache_dtype=cache_dtype, **cache))[0]

    fp8_names = ("fp8", "fp8_e4m3", "fp8_e5m2")
    out: dict[str, Any] = {"spec_dtypes": {d: str(STR_DTYPE_TO_TORCH_DTYPE[d]) for d in fp8_names}}
    for cache_dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "int8_per_token_head"):
        out[cache_dtype] = attempt(lambda: layout_of(cache_dtype).dtype)
    out["auto_uint8"] = attempt(lambda: layout_of("auto", torch.uint8).dtype)
    out["fp8_spec_float16"] = attempt(lambda: layout_of("fp8", torch.float16).dtype)
    out["skip_layers"] = attempt(lambda: layout_of("fp8", kv_cache_dtype_skip_layers=["0"]).dtype)
    # vLLM 0.32 fixes the scales at weight loading (no per-run calculation); a vLLM whose
    # cache config calculates them per run is refused
    out["has_calculate_kv_scales"] = any(f == "calculate_kv_scales" for f in vars(CacheConfig()))
    scales = types.SimpleNamespace(cache_dtype="fp8", calculate_kv_scales=True, kv_cache_dtype_skip_layers=[])
    out["calculate_kv_scales"] = attempt(lambda: _kv_dtype(torch.uint8, "fp8", scales))
    fp8 = layout_of("fp8_e5m2")
    codecs = {}
    for name, extra in (("none", {}), ("raw", {"codec": "raw"}), ("int4", {"codec": "int4"}),
                        ("group_size", {"group_size": 32})):
        codecs[name] = attempt(lambda: _codec_for(ConnectorConfig.from_extra(extra), fp8, extra).codec.spec())
    codecs["auto_none"] = _codec_for(ConnectorConfig.from_extra({}), layout_of("auto"), {}).codec.spec()
    out["codecs"] = codecs
    fmt = PageFormat("token", 64, 128, 128)
    out["cpu_pages"] = {
        cache_dtype: attempt(lambda: check_cpu_pages(fmt, torch.float32, cache_dtype, kv_dtype=kv) or "ok")
        for cache_dtype, kv in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}
    # the kernel's e5m2 bytes read as e4m3: refused
    out["cpu_pages"]["wrong_encoding"] = attempt(
        lambda: check_cpu_pages(fmt, torch.float32, "fp8_e5m2", kv_dtype=torch.float8_e4m3fn) or "ok")
    out["fp8_supported_here"] = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    return out


def admission(job: dict[str, Any]) -> dict[str, Any]:
    """The scheduler side asked as vLLM asks while it cannot admit a request (no free
    blocks: ``get_num_new_matched_tokens`` each step, no ``update_state_after_alloc``),
    then admitted, preempted and asked again; with vLLM's own hit ending inside a store
    block (16 tokens of a block of 32) and on its boundary. Returns the counters."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    import cacheseek as cs
    from cacheseek.integrations.vllm.config import ConnectorConfig
    from cacheseek.integrations.vllm.guard import StoreGuard
    from cacheseek.integrations.vllm.scheduler import SchedulerSide

    cache = cs.PrefixCache(model_id="admission", layout=cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16,
                                                                    dtype="float32"),
                           codec=cs.Raw(), block_tokens=32, tiers=cs.TierConfig(cpu_bytes="16MiB"))
    out: dict[str, Any] = {}
    for own in (16, 32):
        sched = SchedulerSide([cache], block_tokens=32, load=True, save=True,
                              guard=StoreGuard(ConnectorConfig.from_extra({"codec": "raw"}), "scheduler"),
                              block_ids=lambda rid: [])
        req = Request(f"r{own}", list(range(100)), SamplingParams(max_tokens=1), None)
        for _ in range(3):  # three steps without a free block
            sched.matched_tokens(req, own)
        sched.after_alloc(req, 0)  # admitted
        sched.matched_tokens(req, own)  # preempted, asked again before it is admitted again
        out[f"own_{own}"] = {k: sched.stats.to_dict()[k] for k in ("lookups", "lookup_unaligned")}
    # Requests counted by kind once each, however often vLLM preempts and admits them again.
    sched = SchedulerSide([cache], block_tokens=32, load=True, save=True,
                          guard=StoreGuard(ConnectorConfig.from_extra({"codec": "raw"}), "scheduler"),
                          block_ids=lambda rid: [])
    salted = Request("salted", list(range(100)), SamplingParams(max_tokens=1), None, cache_salt="s")
    plain = Request("plain", list(range(100)), SamplingParams(max_tokens=1), None)
    for _ in range(3):  # admitted, preempted, admitted again...
        for req in (salted, plain):
            sched.matched_tokens(req, 0)
            sched.after_alloc(req, 0)
    out["readmitted"] = {k: sched.stats.to_dict()[k] for k in ("requests_keyed", "requests_unsupported")}
    sched.finished(salted)
    sched.after_alloc(Request("salted", list(range(50)), SamplingParams(max_tokens=1), None, cache_salt="t"), 0)
    out["id_reused"] = sched.stats.to_dict()["requests_keyed"]
    cache.close()
    return out


def cpu_pages(job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's CPU attention kernel (``cpu_attn_reshape_and_cache``, with the ISA vLLM picks
    for SmolLM2's pages) writes known K and V for tokens across two pages, some inside a
    page; the connector's K and V views of that layer tensor, made as it makes them for
    CPU_ATTN, read back each token's K and V, and a token written through the views is
    where vLLM's kernel would have put it. Returns, per check, whether it held."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from cacheseek.integrations.vllm.connector import KV_SPLIT_OF_BACKEND
    from cacheseek.integrations.vllm.pages import PageFormat, kv_views

    P, H, N, D = 4, 3, 128, 64  # SmolLM2-135M: 3 KV heads of 64; vLLM's CPU pages of 128 tokens
    isa = _get_attn_isa(torch.float32, N, D, "auto")
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 1, 37, 127, 128, 200, 255, 300], dtype=torch.int64)
    key = torch.randn(len(slots), H, D, generator=g)
    value = torch.randn(len(slots), H, D, generator=g)
    layer = torch.zeros(P, H, N, 2 * D)
    kc, vc = layer.view(P, H, 2 * N, D).chunk(2, dim=2)  # as CPUAttentionBackendImpl hands them over
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    fmt = PageFormat(KV_SPLIT_OF_BACKEND["CPU_ATTN"], D, N, N)
    k, v = kv_views(layer, fmt)
    page, slot = slots // N, slots % N
    out = {"isa": isa, "k_read": torch.equal(k[page, :, slot], key), "v_read": torch.equal(v[page, :, slot], value)}
    # And the other way: a token written through the views, as vLLM's kernel writes it.
    mine = torch.zeros_like(layer)
    mk, mv = kv_views(mine, fmt)
    mk[page, :, slot], mv[page, :, slot] = key, value
    out["written_as_vllm"] = torch.equal(mine, layer)
    # The connector checks the layout against vLLM's kernel at start: the views it takes,
    # and refuses others (as it refuses AMX's tiles, which no view describes).
    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.connector import check_cpu_pages

    check_cpu_pages(fmt, torch.float32, "auto")
    try:
        check_cpu_pages(PageFormat("channel", D, N, N), torch.float32, "auto")
        out["other_layout_refused"] = False
    except ConfigError as exc:
        out["other_layout_refused"] = "lays out K and V" in str(exc)
    return out


SCENARIOS = {f.__name__: f for f in (share, sharers, planned_ahead, preemption, lora, store, load, tensor_parallel, ttft, keys, specs,
                                               executor, admission, steps, cpu_pages, mla,
                                               prefill_decode)}


# What every engine process imports (vLLM's engine, CPU worker and model code, the
# connector): ~10 CPU-s of each engine process on a two-core machine, paid once by `serve`.
PRELOAD = ("vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.entrypoints.launchers.cli_args",
           "vllm.model_executor.layers.quantization.online.base", "compressed_tensors",
           "cacheseek.integrations.vllm.connector", "cacheseek.prefix_cache", "cacheseek.integrations.smollm2",
           "cacheseek.integrations.texts")


def run_job(job: dict[str, Any]) -> None:
    """One scenario; its ``RESULT`` line on stdout, then this process ends."""
    if job.get("stacks_after"):  # a run that hangs says where before its caller kills it
        import faulthandler

        faulthandler.dump_traceback_later(float(job["stacks_after"]), exit=False)
    result = SCENARIOS[job["scenario"]](job)
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's engine teardown on CPU adds seconds and nothing a test needs


def serve() -> None:
    """Jobs from stdin, one JSON line each (``{"id": ..., "job": {...}, "out": PATH, "err":
    PATH}``), each run in a child forked from this process once PRELOAD is imported. The
    child writes its stdout and stderr to ``out`` and ``err`` and leads a process group of
    its own, so that a caller killing a run that hangs takes its tensor-parallel workers
    too. This prints ``started ID PID`` and ``exited ID RC`` (a signal's as its negative
    number). stdin's end (the caller gone) kills the runs left and ends it."""
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork keeps only the forking thread, with the others' locks held
        raise RuntimeError(f"importing vLLM started threads {threading.enumerate()}: no fork is safe here")
    running: dict[int, str] = {}
    pending = b""

    def say(*words: object) -> None:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()

    while True:
        ready, _, _ = select.select([0], [], [], 0.2 if running else None)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            say("exited", running.pop(pid), os.waitstatus_to_exitcode(status))
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(req)
            try:  # (here too: the caller may kill the group before the child has made it)
                os.setpgid(pid, pid)
            except OSError:  # (the child made it first, or has run and gone)
                pass
            running[pid] = req["id"]
            say("started", req["id"], pid)
    for pid in running:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _child(req: dict[str, Any]) -> None:
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, to in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, to)
            os.close(fd)
        run_job(req["job"])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def main() -> None:
    if sys.argv[1] == "--serve":
        serve()
    else:
        run_job(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
