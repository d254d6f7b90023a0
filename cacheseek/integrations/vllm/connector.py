"""``CacheSeekConnector``: vLLM's v1 KV connector interface over a CacheSeek cache.

vLLM builds one instance per role: in the scheduler (``SchedulerSide``: lookups and the
step plan) and in each worker (``WorkerSide``: loads into and saves from the pages). This
class is only the adapter between vLLM's calls and those two.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import ConfigError
from ...hashing import Shard
from ...layout import KV_DTYPES, KVLayout, dtype_name
from ...quant import Raw
from .config import ConnectorConfig, default_model_id
from .guard import StoreGuard
from .pages import PageFormat, VllmPages, kv_views
from .plan import StepPlan
from .scheduler import SchedulerSide
from .stats import ConnectorStats
from .stores import check_at_start, close_cache, open_cache
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("cacheseek.vllm")

# embedded tier -> vLLM's name for where hit tokens came from (a server's are all "external")
HIT_SOURCE_OF_TIER = {"gpu": CacheHitSource.DEVICE, "cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
# executors that run the worker in the scheduler's process, as an embedded cache needs
SAME_PROCESS_EXECUTORS = (None, "uni", "external_launcher")
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# How long shutdown waits for loads between steps still running (pages being written) before it goes on.
SHUTDOWN_LOAD_SECONDS = 10.0

# attention backend -> how its pages hold K and V (see pages.py). An MLA backend's pages hold
# one latent per token, row after row: its halves are read as K and V ("channel", H = 1).
# (AMX_MLA packs its weights for AMX, not its cache: amx_mla.py views it as [tokens, 1, C].)
KV_SPLIT_OF_BACKEND = {"CPU_ATTN": "token", "FLASH_ATTN": "channel", "TRITON_ATTN": "channel"}
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA")
KV_SPLIT_OF_BACKEND.update(dict.fromkeys(MLA_BACKENDS, "channel"))


class CacheSeekMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class CacheSeekStats(KVConnectorStats):
    """Counter deltas of one interval (``ConnectorStats`` fields), summed across workers."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value
                for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CacheSeekPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus registry, beside vLLM's own: a counter
    ``vllm:cacheseek_<name>`` per ``ConnectorStats`` field (``..._total`` in the exposition),
    labelled as vLLM labels its engine's metrics, fed each interval's deltas of both sides."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:cacheseek_{name}", documentation=f"CacheSeek: {doc}",
                                                  labelnames=labelnames)
                          for name, doc in ConnectorStats.docs().items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is not None and value > 0:  # (deltas: a counter never goes down)
                counter.labels(*labels).inc(value)


class CacheSeekConnector(KVConnectorBase_V1):
    """Loads stored prefixes into vLLM's pages and stores the prompts vLLM computes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra = transfer.kv_connector_extra_config
        self.config = ConnectorConfig.from_extra(extra)
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                'kv_transfer_config.kv_load_failure_policy: CacheSeekConnector needs "recompute" (vLLM\'s '
                f'default "fail" would fail a request whose load falls short), got {transfer.kv_load_failure_policy!r}'
            )
        self.layout, self._layer_names = _layout(kv_cache_config, vllm_config.cache_config)
        # An MLA model's latent is the same on every tensor-parallel rank (not split by
        # heads): one copy is stored, under keys of no rank, and only rank 0 saves it.
        self.mla = _is_mla(kv_cache_config)
        self.config = _codec_for(self.config, self.layout, extra or {}, mla=self.mla)
        if transfer.kv_role == "kv_producer" and self.config.remote and "background_saves" not in (extra or {}):
            # A producer (disaggregated prefill) computes prompts for consumers: its saves
            # are stored before the step's tokens go back, so a consumer asked next finds them.
            log.info("CacheSeekConnector: kv_producer: saves stored within the step (background_saves false)")
            self.config = dataclasses.replace(self.config, background_saves=False)
        self._block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                raise ConfigError(f"CacheSeekConnector: {name}={getattr(parallel, name)} is not supported yet")
        tp_size = parallel.tensor_parallel_size
        check_one_process(self.config, parallel)
        self.model_id = model_id = self.config.model_id or default_model_id(vllm_config.model_config)
        load = transfer.kv_role in ("kv_both", "kv_consumer")
        save = transfer.kv_role in ("kv_both", "kv_producer")
        self._caches: list[Any] = []
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reported: dict[str, int | float] = {}
        # With vLLM's asynchronous scheduling every load goes through vLLM's asynchronous
        # loads (held back until done; an embedded cache's runs inside start_load_kv): vLLM
        # 0.32 rolls a request whose load fell short in the step that finished its prompt
        # back over the tokens it had already planned after it, and the next step fed their
        # placeholders to the model (an IndexError that stopped the engine). A request held
        # back has nothing planned: its failed blocks are settled before it first runs.
        planned_ahead = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        background_loads = self.config.loads_in_background or (load and planned_ahead)
        if role == KVConnectorRole.SCHEDULER:
            # one cache per rank: a hit counts only the blocks every rank holds
            ranks = 1 if self.mla else tp_size
            self._caches = [open_cache(self.config, self.layout, model_id, self._shard(parallel, r))
                            for r in range(ranks)]
            if self.config.remote:
                check_at_start(self._caches[0], write=save)
            self._scheduler = SchedulerSide(self._caches, block_tokens=self.config.block_tokens, load=load,
                                            save=save, guard=StoreGuard(self.config, "scheduler"),
                                            block_ids=self._block_ids,
                                            lookup_wait_seconds=self.config.lookup_wait_seconds if self.config.remote
                                            else None,
                                            lookup_deadline_seconds=self.config.lookup_deadline if self.config.remote
                                            else None, background_loads=background_loads,
                                            hold_finished=save and self.config.resave_hold > 0)
        else:
            rank = _tp_rank() if tp_size > 1 else 0
            self._caches = [open_cache(self.config, self.layout, model_id, self._shard(parallel, rank))]
            # With asynchronous scheduling vLLM plans each step before it has seen how the
            # previous one ended: a load's failure must also drop the next step's saves.
            self._worker = WorkerSide(self._caches[0], guard=StoreGuard(self.config, "worker"),
                                      planned_ahead=planned_ahead, background_saves=self.config.saves_in_background,
                                      background_loads=background_loads,
                                      loader_thread=self.config.loads_in_background,
                                      resave_hold_seconds=self.config.resave_hold,
                                      saves=save and not (self.mla and rank > 0),
                                      look_up_wait=self.config.lookup_wait_seconds)
        self._layer_index: dict[str, int] = {}  # attention layer name -> its index in the pages

    def _shard(self, parallel: Any, tp_rank: int) -> Shard:
        """The ``cs.Shard`` in a rank's keys: its own (pipeline parallelism is refused at
        start, so its stage is always 0 of 1), or for an MLA model's latent, which every rank
        holds whole, none: every rank and every tensor-parallel size share its blocks."""
        if self.mla:
            return Shard()
        return Shard(tp_rank=tp_rank, tp_size=parallel.tensor_parallel_size,
                     pp_rank=0, pp_size=getattr(parallel, "pipeline_parallel_size", 1))

    # -- what callers can read -------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """This side's totals since it started (``ConnectorStats`` fields)."""
        return self._side().stats.to_dict()

    @property
    def cache(self) -> Any:
        """The cache this side talks to (for a remote scheduler with tensor parallelism: rank 0's)."""
        return self._caches[0]

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted((n for n in kv_caches if n in self._layer_names), key=extract_layer_index)
        if len(names) != self.layout.num_layers:
            raise ConfigError(f"CacheSeekConnector: vLLM registered {len(names)} of the model's "
                              f"{self.layout.num_layers} attention layers' KV caches")
        layers = [kv_caches[n] for n in names]
        if self.layout.fp8 and layers[0].dtype in (torch.uint8, self.layout.torch_dtype):
            # vLLM allocates fp8 pages as uint8 (its STR_DTYPE_TO_TORCH_DTYPE): the same
            # bytes, seen as the fp8 dtype its cache dtype names (_layout).
            layers = [t.view(self.layout.torch_dtype) for t in layers]
        elif self.layout.fp8:
            raise ConfigError(f"CacheSeekConnector: an {self.layout.dtype} KV cache, but vLLM registered "
                              f"{layers[0].dtype} pages")
        self._layer_index = {n: i for i, n in enumerate(names)}
        fmt = PageFormat(kv_split=self._kv_split(names), head_dim=self.layout.head_dim,
                         block_size=self._block_size, page_tokens=layers[0].shape[2])
        if fmt.kv_split == "token":
            cache_dtype = self._vllm_config.cache_config.cache_dtype
            if self.layout.fp8:
                check_cpu_pages(fmt, self._vllm_config.model_config.dtype, cache_dtype, kv_dtype=layers[0].dtype)
            else:
                check_cpu_pages(fmt, layers[0].dtype, cache_dtype)
        side = self._worker_side()
        side.register(VllmPages(layers, fmt))
        side.layerwise = self.config.loads_layerwise(layers[0].device.type)
        side.layerwise_save = self.config.saves_layerwise(layers[0].device.type)

    def _kv_split(self, names: list[str]) -> str:
        layers = get_layers_from_vllm_config(self._vllm_config, AttentionLayerBase, names)
        backends = {layer.get_attn_backend().get_name() for layer in layers.values()}
        splits = {KV_SPLIT_OF_BACKEND.get(b) for b in backends}
        split = splits.pop() if len(splits) == 1 else None
        if split is None:
            raise ConfigError(f"CacheSeekConnector: attention backend(s) {sorted(backends)}: pages are understood "
                              f"for {sorted(KV_SPLIT_OF_BACKEND)} only")
        return split

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_step(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # vLLM calls this in each attention layer before it reads the layer's pages (and
        # only in a step with connector metadata). With a layer-wise load running, the
        # forward's stream waits for that layer; a layer the connector does not load (not of
        # its KV cache group) has nothing to wait for. Never raises (worker.py).
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._worker_side().wait_layer(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # vLLM calls this in each attention layer once the layer's pages are written. With
        # layer-wise saves, the step's new blocks of that layer are encoded into their
        # reserved slots now, on a side stream; else the saves run whole in wait_for_save.
        # Never raises (worker.py).
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._worker_side().save_layer(index, self._plan())

    def wait_for_save(self) -> None:
        self._worker_side().finish_step(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Loads between steps that are done; their missing blocks go out in
        # get_block_ids_with_load_errors, which vLLM asks next, in the same pass.
        # Finished requests whose pages vLLM held for this worker (request_finished): freed
        # once a lost save of theirs has been sent again from them (worker.py).
        worker = self._worker_side()
        worker.forget(finished_req_ids)
        return worker.take_released() or None, worker.take_loaded() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._side()
        delta = side.stats.minus(self._reported)
        self._reported = side.stats.to_dict()
        stats = CacheSeekStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CacheSeekStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return CacheSeekPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A layer-wise load is waited for in each attention layer (wait_for_layer_load), and
        # a layer-wise save is fed there (save_kv_layer): a full CUDA graph replays the
        # forward without that Python, so vLLM must run piecewise graphs (its attention
        # outside the graph). "layerwise_load" and "layerwise_save" false (the defaults)
        # keep full graphs, with whole-step loads and saves.
        return ConnectorConfig.from_extra(extra_config).may_work_layerwise

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.end_load()
            self._worker.end_save()
            self._worker.close(timeout=SHUTDOWN_LOAD_SECONDS)
        if self._scheduler is not None:
            self._scheduler.close()
        for cache in self._caches:
            close_cache(self.config, cache)  # (a remote cache sends its queued saves first)
        if self._worker is not None:
            self._worker.take_sent()
        self._caches = []

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update, say).
        The prefixes stored under this ``model_id`` stay, for this engine and every other
        that shares the store: vLLM is told the reset did not happen (False). The base
        class's answer, None, reads as done, and the engine went on loading KV that the
        old weights computed."""
        log.warning("CacheSeekConnector: vLLM asked to reset the connector's cache; the prefixes stored under "
                    "model_id %r stay (for every engine sharing them). After a weight update, give the engines "
                    "a new model_id (on a server, `cacheseek admin flush --model` deletes the old one's blocks)",
                    self.model_id)
        return False

    # -- scheduler side ---------------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save lost to a preemption is a future miss

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._scheduler_side()
        n = side.matched_tokens(request, num_computed_tokens)
        return n, bool(n) and side.background_loads  # (vLLM's asynchronous load: see scheduler.py)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        counts: dict[CacheHitSource, int] = {}
        for tier, n in self._scheduler_side().hit_tiers(request, num_external_tokens).items():
            source = CacheHitSource.EXTERNAL_UNSPECIFIED if self.config.remote else HIT_SOURCE_OF_TIER.get(
                tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + n
        return counts

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return CacheSeekMetadata(self._scheduler_side().plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # vLLM's "recompute" policy keeps the blocks of a load that fell short in its own
        # prefix cache, for the request to recompute them in place; a request admitted before
        # that (or at all, if the first one is aborted or preempted first) took them as its
        # own hit and read pages the load never wrote, and its save stored them in CacheSeek
        # under the prefix's keys. They leave vLLM's prefix cache now, with every block after
        # them that a request computed over them.
        # vLLM rolled back only the first request holding each block; another that holds it
        # (its prefix hit in the same step) recomputes it too (scheduler.py).
        invalid = connector_output.invalid_block_ids
        if invalid and self._kv_cache_manager is not None:
            side = self._scheduler_side()
            side.roll_back_sharers(invalid, self._block_size)
            self._kv_cache_manager.evict_blocks(side.blocks_after(invalid))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: vLLM keeps the pages until every worker reports the request (get_finished),
        # for a save of it that failed to be sent again from them.
        return self._scheduler_side().finished(request, block_ids), None

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before scheduling"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    # -- plumbing ---------------------------------------------------------------------------

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheSeekMetadata)
        return meta.plan

    def _side(self) -> SchedulerSide | WorkerSide:
        side = self._scheduler or self._worker
        assert side is not None
        return side

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("CacheSeekConnector: a scheduler-side call on the worker-side connector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("CacheSeekConnector: a worker-side call on the scheduler-side connector")
        return self._worker


def check_cpu_pages(fmt: PageFormat, dtype: torch.dtype, cache_dtype: str, *,
                    kv_dtype: torch.dtype | None = None) -> None:
    """``ConfigError`` unless vLLM's CPU attention kernel, with the ISA it picks for these
    pages, keeps each token's K and V where the connector's views (pages.py) read and
    write them. Its layout is the ISA's (AMX packs K and V in tiles) and has changed
    between releases; read wrong, whole pages still went out and came back bit for bit,
    but a load ending inside a page scrambled it. ``dtype``: the model's; ``kv_dtype``: the
    fp8 dtype of an fp8 cache, whose encoding the kernel must write too (values it holds
    exactly, under scales of 1: the bytes are the kernel's, not a rounding's)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    n, d, heads = fmt.page_tokens, fmt.head_dim, 2
    try:
        isa = _get_attn_isa(dtype, fmt.block_size, d, cache_dtype)  # (as vLLM picks it: by its block size)
        layer = torch.zeros(2, heads, n, 2 * d, dtype=dtype if kv_dtype is None else torch.uint8)  # (vLLM's fp8 pages)
        slots = torch.tensor([0, 1, n - 1, n + n // 2 + 1], dtype=torch.int64)
        gen = torch.Generator().manual_seed(0)
        if kv_dtype is None:
            kv = want = torch.randn(2, len(slots), heads, d, generator=gen).to(dtype)
            quant: dict[str, Any] = {}
        else:
            bits = torch.randint(0, 256, (2, len(slots), heads, d), dtype=torch.uint8, generator=gen)
            nan_bits = 0x7F if kv_dtype == torch.float8_e4m3fn else 0x7C
            bits = torch.where((bits & nan_bits == nan_bits) | (bits == 0x80), bits ^ 0x04, bits)  # finite, no -0
            want = bits.view(kv_dtype)
            kv = want.float().to(dtype)  # (exact: the model's dtypes hold every finite fp8 value)
            quant = {"k_scale": 1.0, "v_scale": 1.0, "kv_cache_dtype": cache_dtype}
        key_cache, value_cache = layer.view(2, heads, 2 * n, d).chunk(2, dim=2)  # (as CPUAttentionBackendImpl)
        ops.cpu_attn_reshape_and_cache(kv[0], kv[1], key_cache, value_cache, slots, isa, **quant)
    except Exception as exc:  # noqa: BLE001 - a vLLM without this kernel: its layout cannot be checked
        raise ConfigError(f"CacheSeekConnector: vLLM's CPU attention pages could not be checked "
                          f"({type(exc).__name__}: {exc})") from None
    k, v = kv_views(layer, fmt)
    page, slot = slots // n, slots % n
    same = (lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))) if kv_dtype else torch.equal
    if not (same(k[page, :, slot], want[0]) and same(v[page, :, slot], want[1])):
        encoding = f", or its {cache_dtype} bytes are not {kv_dtype}" if kv_dtype is not None else ""
        raise ConfigError(f"CacheSeekConnector: vLLM's CPU attention ISA {isa!r} lays out K and V in pages of "
                          f"{n} tokens otherwise than the connector reads them (the vec ISAs: K column-major, "
                          f"V row-major){encoding}; not supported")


# vLLM's --kv-cache-dtype of an fp8 cache -> the fp8 dtype its pages hold. vLLM allocates
# them as uint8 (vllm/utils/torch_utils.py, STR_DTYPE_TO_TORCH_DTYPE), so the spec's dtype
# does not say which. "fp8" is e4m3 (vllm/config/cache.py), of the platform's encoding:
# e4m3fn on CUDA and the CPU, e4m3fnuz on some ROCm GPUs (refused: not a KV dtype here).
FP8_CACHE_DTYPES = {"fp8": None, "fp8_e4m3": None, "fp8_e5m2": "float8_e5m2"}  # None: the platform's e4m3
# Cache dtypes whose pages hold the model's own dtype.
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "half", "float")


def check_one_process(config: ConnectorConfig, parallel: Any) -> None:
    """``ConfigError`` for an embedded cache (no ``url``) whose scheduler and worker vLLM
    runs in different processes (``parallel``: vLLM's ``ParallelConfig``, as its platform
    left it), saying what to change."""
    if config.remote:
        return
    tp_size = parallel.tensor_parallel_size
    if tp_size > 1:
        raise ConfigError(
            f"kv_connector_extra_config: tensor_parallel_size={tp_size} runs workers in other processes than "
            "the scheduler, which an embedded cache cannot serve; give a server url"
        )
    backend = parallel.distributed_executor_backend
    if backend in SAME_PROCESS_EXECUTORS:
        return
    why = (f"kv_connector_extra_config: distributed_executor_backend={backend!r} runs the worker in another "
           "process than the scheduler, which an embedded cache cannot serve")
    from vllm.platforms import current_platform

    # vLLM's CPU build makes its uniprocess executor "mp" while V1 multiprocessing is on,
    # its default (vllm/platforms/cpu.py, whose test of the variable this is): a user who
    # asked for no executor got this refusal, told only to give a url, though setting the
    # variable keeps the worker with the scheduler.
    if backend == "mp" and current_platform.is_cpu() and os.environ.get(MULTIPROCESSING_ENV, "1") == "1":
        raise ConfigError(
            f"{why}: vLLM's CPU build runs even one worker under 'mp' while V1 multiprocessing is on (its "
            f"default); set {MULTIPROCESSING_ENV}=0 in the engine's environment (for vllm serve too), with no "
            "distributed_executor_backend, or give a server url"
        )
    raise ConfigError(f"{why}; give a server url")


def _kv_dtype(spec_dtype: Any, cache_dtype: str, cache_config: Any) -> str:
    """The KV dtype of vLLM's pages, from its KV cache spec and ``--kv-cache-dtype``."""
    if cache_dtype in PLAIN_CACHE_DTYPES:
        try:
            return dtype_name(spec_dtype)
        except ConfigError:
            raise ConfigError(f"CacheSeekConnector: KV cache dtype {spec_dtype}; CacheSeek stores "
                              f"{sorted(KV_DTYPES)}") from None
    if cache_dtype not in FP8_CACHE_DTYPES:
        raise ConfigError(f"CacheSeekConnector: --kv-cache-dtype {cache_dtype} is not supported (its pages hold "
                          f"codes or scales CacheSeek does not read); use auto or one of {sorted(FP8_CACHE_DTYPES)}")
    if getattr(cache_config, "calculate_kv_scales", False):
        # Scales computed from each run's first batch: the same bytes would mean other KV
        # in another engine, or after a restart.
        raise ConfigError("CacheSeekConnector: calculate_kv_scales is on; an fp8 KV cache is stored only under "
                          "scales fixed by the model's checkpoint (or vLLM's default of 1.0)")
    if getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        raise ConfigError("CacheSeekConnector: kv_cache_dtype_skip_layers leaves some layers unquantized; "
                          "one KV dtype for every layer is supported")
    name = FP8_CACHE_DTYPES[cache_dtype]
    if name is None:
        from vllm.platforms import current_platform

        name = str(current_platform.fp8_dtype()).removeprefix("torch.")
        if name != "float8_e4m3fn":
            raise ConfigError(f"CacheSeekConnector: --kv-cache-dtype {cache_dtype} is {name} on this platform; "
                              "CacheSeek stores fp8 as float8_e4m3fn or float8_e5m2")
    if str(spec_dtype).removeprefix("torch.") not in ("uint8", name):
        raise ConfigError(f"CacheSeekConnector: --kv-cache-dtype {cache_dtype}, but vLLM's KV cache spec says "
                          f"{spec_dtype}")
    return name


def _codec_for(config: ConnectorConfig, layout: KVLayout, extra: Any, *, mla: bool = False) -> ConnectorConfig:
    """``config`` with a codec that stores ``layout``'s KV: an fp8 cache, or an MLA model's
    latent, given no codec (the default, int4) gets raw; one given KIVI is refused, naming
    the setting. (KIVI encodes no fp8; on a latent, whose halves it would take for K and V,
    its quality is not measured.)"""
    if not (layout.fp8 or mla):
        return config
    what = "an MLA latent cache" if mla else f"a {layout.dtype} KV cache"
    if isinstance(extra, dict) and "codec" not in extra and "group_size" not in extra:
        log.info("CacheSeekConnector: %s: stored with the raw codec (no codec was set)", what)
        return dataclasses.replace(config, codec=Raw())
    if mla and not isinstance(config.codec, Raw):
        raise ConfigError(f"kv_connector_extra_config.codec: {what} is stored raw; KIVI's quality on a latent "
                          "is not measured (set \"codec\": \"raw\")")
    try:
        config.codec.check_layout(layout, config.block_tokens)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config.codec: {exc} (set \"codec\": \"raw\")") from None
    return config


def _layout(kv_cache_config: KVCacheConfig, cache_config: Any) -> tuple[KVLayout, set[str]]:
    """The ``KVLayout`` of the model's one group of full-attention layers."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"CacheSeekConnector: {len(groups)} KV cache groups (a hybrid model); one is supported")
    spec = groups[0].kv_cache_spec
    # A sliding-window or chunked-local group (every layer windowed) holds only the
    # window's blocks: vLLM hands its null block in place of the others, in a request's
    # own prefix hit and for external tokens, so a save would store the null block's page
    # under a prefix block's key and a load would write into it. (Windowed layers beside
    # full ones vLLM allocates in full, without its hybrid allocator: a FullAttentionSpec.)
    if not isinstance(spec, FullAttentionSpec):
        raise ConfigError(f"CacheSeekConnector: KV cache spec {type(spec).__name__}; only full attention "
                          "is supported (no sliding-window or chunked-local groups)")
    dtype = _kv_dtype(spec.dtype, str(getattr(cache_config, "cache_dtype", "auto")), cache_config)
    num_layers = len(groups[0].layer_names)
    if isinstance(spec, MLAAttentionSpec):
        # one latent of head_size elements per token (kv_lora_rank + rope dim), no V of its own
        if spec.num_kv_heads != 1 or spec.head_size % 2:
            raise ConfigError(f"CacheSeekConnector: an MLA cache of {spec.num_kv_heads} heads of {spec.head_size}; "
                              "one latent of an even size per token is supported")
        return KVLayout.mla(num_layers, spec.head_size, dtype), set(groups[0].layer_names)
    if spec.head_size_v != spec.head_size:
        raise ConfigError(f"CacheSeekConnector: K head size {spec.head_size} != V head size {spec.head_size_v}")
    layout = KVLayout(num_layers=num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, dtype=dtype)
    return layout, set(groups[0].layer_names)


def _is_mla(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the model's one group is an MLA latent cache (``_layout`` checked the rest)."""
    return isinstance(kv_cache_config.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


__all__ = ["CacheSeekConnector", "CacheSeekMetadata", "CacheSeekStats", "check_cpu_pages", "check_one_process"]
