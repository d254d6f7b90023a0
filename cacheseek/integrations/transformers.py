"""Hugging Face transformers: KV in and out of a ``DynamicCache``, and prefill with reuse.

    from cacheseek.integrations.transformers import prefill_with_reuse, greedy_continue
    res = prefill_with_reuse(model, cache, input_ids)      # reuses the stored prefix, stores new blocks
    out = greedy_continue(model, res.cache, res.logits, max_new_tokens=32)

Works with transformers 4.5x and 5.x. Which keyword a model's forward takes for its cache
(``cache=`` in recent 5.x releases, ``past_key_values=`` before) and which output field holds
it are read from the forward's signature and the output object, never from a version string.

Limits, stated plainly:

- Batch size 1. A batch needs per-row prefix lengths (ragged KV) and padding masks.
- Decoder-only models whose cache is a ``DynamicCache`` of full-attention layers holding K
  after RoPE (Llama, Mistral, Qwen2, SmolLM2 ...). A sliding-window layer keeps only its
  window of the materialized prefix, and its prompt's KV is stored as the forward makes it
  (after a reused prefix longer than the window, not at all: ``ingest_skipped_reason``);
  encoder-decoder, linear-attention/recurrent (Mamba) and multimodal caches are not handled
  (recurrent, linear-attention, shared and indexed layers are refused before anything runs).
- A RoPE that rescales by each forward's length (``dynamic``, ``longrope``) is refused: the
  K it caches depend on that length, not on the prefix alone.
- The stored layout's dtype must be the model's KV dtype: nothing is cast silently.
- Token ids only: the prompt must be tokenized identically for a hit (exact-prefix reuse).
- A model spread over devices (``device_map``) gets each layer's prefix on that layer's
  device (read to layer 0's device, then copied), and its prompt's KV copied to layer 0's
  device to be stored; it loads whole, not layer-wise.
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, InputError, LoadError
from ..hashing import token_block_bytes
from ..kv_input import kv_layers
from ..layerwise import LayerwiseLoad
from ..layout import KVLayout
from .planner import ReuseDecision, ReusePlanner

# -- the model's cache keyword, found from its signature ---------------------------------

_CACHE_KWARGS = ("cache", "past_key_values")


# The parameter names of a forward, per function (the class's, or a wrapper set on the
# instance, as accelerate's hooks are): inspect.signature costs ~25 us a call, twice per
# forward, on the path to the first token and on every generated token.
_FORWARD_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forward_params(model: Any) -> Any:
    forward_fn = model.forward
    key = getattr(forward_fn, "__func__", forward_fn)
    try:
        return _FORWARD_PARAMS[key]
    except KeyError:
        pass
    except TypeError:  # (not weakly referable: asked every time)
        return inspect.signature(forward_fn).parameters
    params = _FORWARD_PARAMS[key] = inspect.signature(forward_fn).parameters
    return params


def cache_kwarg(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``"cache"`` or ``"past_key_values"``."""
    params = _forward_params(model)
    for name in _CACHE_KWARGS:
        if name in params:
            return name
    raise ConfigError(
        f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: not a decoder with a KV cache"
    )


def output_cache(out: Any) -> Any:
    """The cache a forward returned, from ``out.cache`` (5.x) or ``out.past_key_values``."""
    for name in _CACHE_KWARGS:
        value = getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("the model returned no KV cache (was use_cache disabled?)")


def forward(model: Any, input_ids: torch.Tensor, cache: Any = None, *, last_only: bool = False) -> tuple[torch.Tensor, Any]:
    """One forward pass over ``input_ids`` [B, T] on top of ``cache``: (logits, cache).

    Logits are [B, T, V], or [B, 1, V] with ``last_only`` where the model can skip the LM
    head for the other positions (``logits_to_keep``); the last row's values are the same
    either way only up to GEMM blocking, so compare like with like.
    """
    kwargs: dict[str, Any] = {"use_cache": True}
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    if last_only:
        keep = _logits_kwarg(model)
        if keep is not None:
            kwargs[keep] = 1
    with torch.no_grad():
        out = model(input_ids=input_ids, **kwargs)
    return out.logits, output_cache(out)


def _logits_kwarg(model: Any) -> str | None:
    params = _forward_params(model)
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)


# -- DynamicCache in and out -------------------------------------------------------------


def _require_transformers() -> None:
    """``ModuleNotFoundError`` naming the extra to install where transformers is missing: the
    bare "No module named 'transformers'" out of ``got.to_dynamic_cache()`` (the README's
    Python API, in an install without the extra) did not say where it comes from."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"a DynamicCache (to_dynamic_cache) needs transformers, which the 'demo' extra installs: "
            f"pip install -e '.[demo]' in the checkout, or pip install 'transformers>=4.57' ({exc})",
            name="transformers") from None


def _new_dynamic_cache(config: Any = None) -> Any:
    """An empty ``DynamicCache`` for a model ``config`` (its layer types: sliding window and
    so on, on 5.x), or of plain full-attention layers without one."""
    _require_transformers()
    from transformers import DynamicCache

    return DynamicCache(**_dynamic_cache_kwargs(config))


# Per config (by identity): whether DynamicCache(config=...) makes full-attention
# DynamicLayers only, and the first of its layers that is neither full attention nor a
# sliding window (index, class), if any. Reading the layer types from a config costs
# transformers ~0.4 ms of attribute lookups per cache, on the path to the first token for
# every reused prompt; for such a config a DynamicCache() that appends a DynamicLayer per
# layer is the same cache.
_FULL_ATTENTION: dict[int, tuple[Any, bool, tuple[int, str] | None]] = {}


def _config_layers(config: Any) -> tuple[bool, tuple[int, str] | None]:
    """(all full attention, the first layer of another kind than full attention or a
    sliding window) of ``config``'s ``DynamicCache``; asked once per config."""
    if config is None or not _dynamic_cache_takes_config():
        return True, None
    known = _FULL_ATTENTION.get(id(config))
    if known is not None and known[0]() is config:
        return known[1], known[2]
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(DynamicCache(config=config), "layers", None)
    full = bool(layers) and all(_is_full_attention(layer) for layer in layers or ())
    other = next(((i, type(layer).__name__) for i, layer in enumerate(layers or ())
                  if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)), None)
    key = id(config)
    _FULL_ATTENTION[key] = (weakref.ref(config, lambda _: _FULL_ATTENTION.pop(key, None)), full, other)
    return full, other


def _dynamic_cache_kwargs(config: Any) -> dict[str, Any]:
    """What ``DynamicCache(...)`` needs for ``config``: nothing where the config's layers are
    all full attention (asked once per config), else the config."""
    return {} if _config_layers(config)[0] else {"config": config}


def _windowed(config: Any) -> bool:
    """Whether a model's ``DynamicCache`` has layers that keep less than every token (sliding
    window and the like; transformers 5.x). Asked once per config."""
    return bool(_dynamic_cache_kwargs(config))


def _text_config(config: Any) -> Any:
    """A model config's decoder part (a multimodal config's text config; else the config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _window(config: Any) -> int:
    """Tokens a windowed layer keeps after a forward (its window less one; 0 where the
    config names no window, so nothing reused is taken to be whole)."""
    text = _text_config(config)
    window = getattr(text, "sliding_window", None)
    return max(int(window) - 1, 0) if isinstance(window, int) else 0


def _windowed_cache_over(past: Any, config: Any, writer: Any) -> Any:
    """A writer's cache holding ``past``'s prefix (every token of it: shorter than every
    window), so the forward hands the writer whole layers, prefix and prompt."""
    cache = layerwise_cache(None, config, None)
    with torch.no_grad():
        for i, (k, v) in enumerate(kv_layers(past)):
            cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
    cache._cs_writer = writer
    return cache


@functools.lru_cache(maxsize=1)
def _dynamic_cache_takes_config() -> bool:
    from transformers import DynamicCache

    return "config" in inspect.signature(DynamicCache.__init__).parameters


def _is_full_attention(layer: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def to_dynamic_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], config: Any = None) -> Any:
    """A ``DynamicCache`` holding ``layers`` [(K, V)], each [1, H, T, D] or [H, T, D].

    With a model ``config`` (5.x), the cache gets the model's layer types (sliding window
    and so on); without one, plain full-attention layers. The tensors are copied once.
    """
    if not layers:
        raise InputError("layers: empty; nothing to build a cache from")
    cache = _new_dynamic_cache(config)
    with torch.no_grad():
        for i, (k, v) in enumerate(layers):
            k = k.unsqueeze(0) if k.dim() == 3 else k
            v = v.unsqueeze(0) if v.dim() == 3 else v
            cache.update(k, v, i)
    return cache


_LAYERWISE_CLASS: Any = None


def layerwise_cache(load: Any = None, config: Any = None, writer: Any = None, *, num_tokens: int | None = None) -> Any:
    """A ``DynamicCache`` over a ``LayerwiseLoad``: layer ``i`` holds the loaded prefix, and
    the forward's first ``update`` of layer ``i`` makes the current stream wait for that
    layer first (``load.wait(i)``; on a GPU the host does not wait), so the load of later
    layers overlaps the compute of earlier ones. The prefix tensors are taken as they are
    (no copy); the forward's ``update`` concatenates onto them as usual. ``writer``: a
    ``LayerwiseIngest`` that is given each layer (prefix and new tokens) as the forward
    produces it. ``load=None``: an empty cache (only the writer). ``num_tokens``: the
    prefix's first tokens only (views), where fewer than the load's."""
    global _LAYERWISE_CLASS
    if _LAYERWISE_CLASS is None:
        _LAYERWISE_CLASS = _make_layerwise_class()
    return _LAYERWISE_CLASS(load, config, writer, num_tokens)


def _make_layerwise_class() -> Any:
    from transformers import DynamicCache

    class LayerwiseDynamicCache(DynamicCache):
        """See ``layerwise_cache``."""

        def __init__(self, load: Any, config: Any, writer: Any, num_tokens: int | None = None) -> None:
            super().__init__(**_dynamic_cache_kwargs(config))
            self._cs_load, self._cs_writer = load, writer
            self._cs_pending: set[int] = set()
            n = load.num_tokens if load is not None else 0
            n = n if num_tokens is None else min(n, num_tokens)
            if n:
                _fill_without_copy(self, load.num_layers, lambda i: _first(load.layer(i, wait=False), n), n)
                self._cs_pending = set(range(load.num_layers))

        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            if layer_idx in self._cs_pending:
                self._cs_pending.discard(layer_idx)
                self._cs_load.wait(layer_idx)  # raises LoadError if this layer's load failed
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if self._cs_writer is not None:
                self._cs_writer.put_layer(layer_idx, keys, values)
            return keys, values

        def detach_layerwise(self) -> None:
            """Stop waiting and writing: drop the load and the writer."""
            for i in sorted(self._cs_pending):  # layers the forward never updated: loaded
                self._cs_load.wait(i)
            self._cs_load, self._cs_writer, self._cs_pending = None, None, set()

    return LayerwiseDynamicCache


def _fill_without_copy(cache: Any, num_layers: int, get: Any, num_tokens: int) -> None:
    """Put each layer's prefix tensors (``get(i)`` -> (K, V), [1, H, T, D]; a layer-wise
    load's maybe not loaded yet: nothing reads them here) into the cache's layers as they
    are: transformers 5.x layer objects, or the 4.x lists. The forward's first ``update``
    of a layer concatenates the new tokens into a tensor of its own, so the cache returned
    after a forward shares nothing with them."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # 5.x: a layer object per layer
        from transformers.cache_utils import DynamicLayer

        for i in range(num_layers):
            if i == len(layers):
                layers.append(DynamicLayer())
            layer = layers[i]
            if type(layer) is not DynamicLayer:
                raise ConfigError(f"layer {i} is a {type(layer).__name__}: layer-wise reuse takes full-attention "
                                  "DynamicLayer caches only")
            k, v = get(i)
            # (DynamicLayer sets these in lazy_initialization; transformers' class declares no dtype)
            layer.dtype, layer.device = k.dtype, k.device  # type: ignore[attr-defined]
            layer.keys, layer.values = k, v
            layer.is_initialized = True
        return
    if not hasattr(cache, "key_cache"):
        raise ConfigError(f"{type(cache).__name__}: neither layer objects nor key_cache lists; cannot fill it")
    for i in range(num_layers):  # 4.x: lists of tensors
        k, v = get(i)
        cache.key_cache.append(k)
        cache.value_cache.append(v)
    if hasattr(cache, "_seen_tokens"):
        cache._seen_tokens = num_tokens


def _first(kv: tuple[torch.Tensor, torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` tokens of a layer's (K, V) [1, H, T, D]: views, or the tensors themselves."""
    k, v = kv
    return (k, v) if k.shape[-2] == n else (k[..., :n, :], v[..., :n, :])


def _cache_over(got: Any, config: Any, num_tokens: int | None = None,
                devices: list[torch.device] | None = None) -> Any:
    """A ``DynamicCache`` over a ``Materialized`` prefix's own tensors, for one forward on top
    of it (``prefill_with_reuse``): not copied first as ``to_dynamic_cache`` does (a copy of
    the whole prefix on the device, and a cache update a layer on the host), since that
    forward replaces every layer's tensors with its own. Models whose cache has other than
    full-attention layers get the copy. ``num_tokens``: the prefix's first tokens only.
    ``devices``: each layer's device (``layer_devices``), where the prefix is copied to."""
    n = got.num_tokens if num_tokens is None else min(got.num_tokens, num_tokens)
    layers = got.layers
    if devices is not None:
        # Sliced first: a prefix cut to fewer tokens moves only those.
        layers = [tuple(t.to(d) for t in _first(kv, n)) for kv, d in zip(layers, devices, strict=True)]
    cache = _new_dynamic_cache(config)
    try:
        _fill_without_copy(cache, len(layers), lambda i: _first(layers[i], n), n)
    except ConfigError:
        return to_dynamic_cache([_first(layer, n) for layer in layers], config)
    return cache


def cache_length(cache: Any) -> int:
    """Tokens held by a cache (0 for an empty one)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def kv_layout(model_or_config: Any, dtype: Any = None) -> KVLayout:
    """The ``KVLayout`` of a decoder's cache, from its config (dtype: the model's unless given)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = _text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if dtype is None:
        dtype = model_dtype(model_or_config) if hasattr(model_or_config, "parameters") else text.dtype
    return KVLayout(text.num_hidden_layers, kv_heads, head_dim, dtype)


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


def layer_devices(model: Any) -> list[torch.device] | None:
    """The device each decoder layer runs on, and so holds its KV on, for a model spread over
    several devices (loaded with a ``device_map``: accelerate's hooks, ``hf_device_map``);
    None for a model on one device (the usual case, answered from the map alone)."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, Mapping) or len({str(d) for d in device_map.values()}) < 2:
        return None
    text = _text_config(model.config)
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                   and len(m) == text.num_hidden_layers), None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} is spread over devices ({sorted({str(d) for d in device_map.values()})}) "
                          f"and has no list of its {text.num_hidden_layers} decoder layers to tell where each runs")
    devices = []
    for i, layer in enumerate(layers):
        # accelerate's hook runs the layer on its execution device, which for a layer whose
        # weights are offloaded is not where its parameters lie.
        where = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)
        if where is None:
            param = next(layer.parameters(), None)
            where = param.device if param is not None else None
        if where is None or torch.device(where).type == "meta":
            raise ConfigError(f"{type(model).__name__}: cannot tell which device decoder layer {i} runs on "
                              "(no execution device, no parameters on a device)")
        devices.append(torch.device("cuda", where) if isinstance(where, int) else torch.device(where))
    return devices if len(set(devices)) > 1 else None


class _WriterOn:
    """A layer-wise writer handed every layer on one device: the layers of a model spread over
    devices are copied there first (the store takes one device's KV per call)."""

    def __init__(self, writer: Any, device: torch.device) -> None:
        self._writer, self._device = writer, device

    def put_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Any:
        return self._writer.put_layer(layer, keys.to(self._device), values.to(self._device))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


# -- prefill with reuse ------------------------------------------------------------------


@dataclass(slots=True)
class PrefillTimings:
    """Seconds spent in each step; ``ttft_s`` is the time to the last position's logits."""

    locate_s: float = 0.0
    materialize_s: float = 0.0
    forward_s: float = 0.0
    ingest_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class PrefillResult:
    """What ``prefill_with_reuse`` did.

    ``logits``: [vocab] at the prompt's last position (its argmax is the first new token).
    ``cache``: a ``DynamicCache`` holding every prompt token, ready to continue generation.
    ``reused_tokens`` came from the store, ``computed_tokens`` were run through the model.
    ``tiers``: the tier each reused block came from. ``skipped_reason`` says why nothing was
    reused when a stored prefix was there (predicted slower than recompute) or when reuse
    was turned off (``reuse="never"``). ``ingest_skipped_reason`` says why the prompt was not
    stored although ``ingest`` was asked for (a sliding-window model after a reused prefix).
    """

    logits: torch.Tensor
    cache: Any
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    stored_blocks: int
    tiers: list[str]
    timings: PrefillTimings
    decision: ReuseDecision | None = None
    skipped_reason: str | None = None
    ingest_errors: dict[str, str] = field(default_factory=dict)
    prefetched_blocks: int = 0
    ingest_skipped_reason: str | None = None

    @property
    def next_token(self) -> int:
        return int(self.logits.argmax())


REUSE_MODES = ("auto", "always", "never")
_planners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_planner(cache: Any) -> ReusePlanner:
    """The planner kept for ``cache`` (one per cache object, dropped with it)."""
    planner = _planners.get(cache)
    if planner is None:
        planner = _planners[cache] = ReusePlanner()
    return planner


def prefill_with_reuse(
    model: Any,
    cache: Any,
    input_ids: Any,
    *,
    planner: ReusePlanner | None = None,
    reuse: str = "auto",
    ingest: bool = True,
    prefetch: Any = None,
    layerwise: bool = False,
) -> PrefillResult:
    """Prefill a prompt, reusing its longest stored prefix when that pays.

    1. ``cache.locate`` the prompt; at least one token is always left to compute.
    2. Ask ``planner`` (default: the one kept per cache) whether reading the prefix from the
       tiers that hold it is predicted faster than recomputing it; if not, recompute and say
       why in ``skipped_reason``.
    3. ``cache.materialize`` the prefix onto the model's device, build a ``DynamicCache``,
       and run the model on the rest of the prompt only.
    4. ``cache.ingest`` the prompt's full blocks (those already stored are not re-encoded).

    ``cache`` is a ``PrefixCache`` or a ``RemoteCache``; its layout must match the model's.
    ``reuse``: ``"auto"`` (ask the planner), ``"always"`` (reuse whatever is stored: for
    benchmarks that time every tier), or ``"never"`` (the no-reuse baseline, through the same
    code path). Only the last position's logits are computed. ``prefetch``: the handle of a
    ``cache.prefetch`` (or ``integrations.prefetch.prefetch_queued``) started when the request
    was queued; nothing waits for it here: the lookup sees the blocks it has promoted in
    memory, and the materialize waits only for those still on their way (its ``blocks`` are
    reported in ``prefetched_blocks``).

    ``layerwise``: the prefix is loaded layer by layer (``cache.materialize(...,
    layerwise=True)``) into a cache whose layer ``i`` waits for its load inside the forward
    (``layerwise_cache``), so the load overlaps the forward; the prompt's layers go to a
    ``cache.ingest_layerwise`` writer as the forward makes them, stored after the first
    token. The logits and the cache are the same as without it. A load that fails part way
    (``LoadError``) is recomputed: the whole prompt runs through the model, and
    ``skipped_reason`` says why. ``timings.materialize_s`` is then the time to start the
    load (the rest overlaps the forward), and the planner learns no read speed from it.

    A model spread over devices (a ``device_map``) reads the prefix to its layer 0's device
    and copies each layer to its own; its prompt's KV is copied to layer 0's device to be
    stored. ``layerwise=True`` is refused for it (``ConfigError``), and for a model with
    sliding-window layers.
    """
    if reuse not in REUSE_MODES:
        raise ConfigError(f"reuse: must be one of {REUSE_MODES}, got {reuse!r}")
    t0 = time.perf_counter()
    device = model_device(model)
    devices = layer_devices(model)
    if devices is not None and layerwise:
        raise ConfigError(f"layerwise=True: {type(model).__name__} is spread over {sorted({str(d) for d in devices})}, "
                          "and a layer-wise load goes to one device; load it whole (layerwise=False)")
    if layerwise and _windowed(model.config):
        # (refused here, before anything runs: a miss ran, and the hit that followed it
        # was refused, so a server failed every repeat of a prompt it had served once)
        raise ConfigError(f"layerwise=True: {type(model).__name__} has sliding-window layers, which keep only their "
                          "window, where a layer-wise load hands each layer's whole prefix to the forward; "
                          "load it whole (layerwise=False), which takes the window it needs")
    kv_device = devices[0] if devices is not None else device
    ids, packed = _token_ids(input_ids)
    _check_vocabulary(model, packed)
    _check_model(model)
    _check_layout(model, cache)
    planner = planner if planner is not None else default_planner(cache)
    timings = PrefillTimings()

    reused, tiers, past, decision, skipped = 0, [], None, None, None
    load: LayerwiseLoad | None = None
    writer: Any = None  # the cache's layer-wise writer (or a _WriterOn over it)
    # A prompt stored whole (its length a multiple of the block) is read whole and cut one
    # token short: its last token is computed, for the logits, and not a whole block of it.
    # `have`: the tokens read (whole blocks).
    most, have = len(ids) - 1, 0
    # The ids after the located prefix on the device (from token `past_start` on), made
    # before a layer-wise load starts; only those: a tensor of 16K ids costs the host ~1 ms.
    prompt, past_start = None, 0
    # The prompt is hashed once for the lookup, the load and the save (each would hash it
    # again: ~0.4 ms of host time per 16K tokens, before the first token).
    keys = _hashed(cache, ids, packed) if ingest or (reuse != "never" and len(ids) > 1) else ids
    if reuse != "never" and len(ids) > 1:
        located = cache.locate(keys)
        timings.locate_s = time.perf_counter() - t0
        if reuse == "auto":
            if located.num_tokens and planner.unmeasured(located.tiers):
                _seed_from_stats(planner, cache)
            decision = planner.decide(located.tiers, located.num_tokens)
        else:
            decision = ReuseDecision(bool(located.num_tokens), "reuse forced by the caller")
        if located.num_tokens and not decision.reuse:
            skipped = decision.reason
        elif located.num_tokens and layerwise:
            t = time.perf_counter()
            # Everything the forward needs but the load is made first: from the load's start
            # on, the host's time is on the path to layer 0 (the forward starts on the handle).
            writer = cache.ingest_layerwise(keys) if ingest else None
            past_start = min(located.num_tokens, most)
            prompt = torch.tensor([ids[past_start:]], dtype=torch.long, device=device)
            load = cache.materialize(keys, device=device, layerwise=True, located=True)
            if load.num_tokens:
                have, tiers = load.num_tokens, list(load.tiers)
                reused = min(have, most)
            else:
                load.close()
                load = None
            timings.materialize_s = time.perf_counter() - t
        elif located.num_tokens:
            t = time.perf_counter()
            got = cache.materialize(keys, device=kv_device, located=True)
            if got.num_tokens:
                have, tiers = got.num_tokens, list(got.tiers)
                reused = min(have, most)
                past = _cache_over(got, model.config, reused, devices)
            del got
            _sync(device, devices)
            timings.materialize_s = time.perf_counter() - t
            planner.observe_read(tiers, have, timings.materialize_s)
    elif reuse == "never":
        skipped = "reuse disabled by the caller"

    # A sliding-window layer keeps only its window once the forward is over, so the prompt's
    # KV is whole only inside the forward: a writer takes each layer there. After a reused
    # prefix even the forward sees only the window of it, and nothing can be stored.
    capture = ingest and not layerwise and _windowed(model.config)
    ingest_skipped = None
    if capture and reused and reused >= _window(model.config):
        capture = False
        block = getattr(cache, "block_tokens", 0) or 1
        ingest_skipped = "nothing new to store" if len(ids) // block <= have // block else (
            "not stored: the model has sliding-window layers, which hold only their window of the "
            f"{reused} reused tokens, so the blocks after them have no whole KV to store")

    t = time.perf_counter()
    # Whatever raises from here on (a cache of other than full-attention layers refused, the
    # forward, its recompute) gives back what the load and the writer hold: the load's
    # frames are CPU-tier slots, the writer's reserved slots.
    try:
        if layerwise or capture:
            if writer is None and ingest:
                writer = cache.ingest_layerwise(keys)
                if devices is not None:
                    writer = _WriterOn(writer, kv_device)
            if capture and past is not None:  # the reused prefix, within every window: copied in
                past = _windowed_cache_over(past, model.config, writer)
            else:
                past = layerwise_cache(load, model.config, writer, num_tokens=reused)
        if prompt is not None and reused >= past_start:  # (a load may end short of the lookup)
            suffix = prompt[:, reused - past_start:]
        else:
            suffix = torch.tensor([ids[reused:]], dtype=torch.long, device=device)
        try:
            logits, past = forward(model, suffix, past, last_only=True)
        except LoadError as exc:  # a layer-wise load that failed part way: recompute the prompt
            skipped = f"layer-wise load failed, recomputed: {exc}"
            reused, tiers = 0, []
            if writer is not None:
                writer.abort()
                writer = cache.ingest_layerwise(keys)
            suffix = torch.tensor([ids], dtype=torch.long, device=device)
            logits, past = forward(model, suffix, layerwise_cache(None, model.config, writer), last_only=True)
    except BaseException:
        if writer is not None:
            writer.abort()  # gives back the CPU-tier slots a layer-wise save holds
        if load is not None:
            # Nobody reads the layers the forward did not reach: not decoded (``close`` would
            # decode them all first, on a CPU in this thread), and the error raised as it is.
            abandoned, load = load, None
            abandoned.abandon()
        raise
    finally:
        if load is not None:
            load.close()  # after the forward's launches: only gives the store's memory back
    if layerwise or capture:
        past.detach_layerwise()  # a plain DynamicCache from here on (generation goes on with it)
    last = logits[0, -1]
    _sync(device, devices)
    timings.forward_s = time.perf_counter() - t
    timings.ttft_s = time.perf_counter() - t0
    planner.observe_prefill(len(ids) - reused, timings.forward_s)

    stored, errors = 0, {}
    if ingest and ingest_skipped is None:
        t = time.perf_counter()
        if writer is not None:
            result = writer.finish()
        elif devices is not None:  # (the store takes one device's KV per call)
            result = cache.ingest(keys, [(k.to(kv_device), v.to(kv_device)) for k, v in kv_layers(past)])
        else:
            result = cache.ingest(keys, past)
        stored, errors = result.stored, dict(getattr(result, "errors", {}) or {})
        timings.ingest_s = time.perf_counter() - t
    timings.total_s = time.perf_counter() - t0
    return PrefillResult(
        logits=last, cache=past, prompt_tokens=len(ids), reused_tokens=reused,
        computed_tokens=len(ids) - reused, stored_blocks=stored, tiers=tiers, timings=timings,
        decision=decision, skipped_reason=skipped, ingest_errors=errors,
        prefetched_blocks=getattr(prefetch, "blocks", 0) if prefetch is not None else 0,
        ingest_skipped_reason=ingest_skipped,
    )


def _seed_from_stats(planner: ReusePlanner, cache: Any) -> None:
    """Seed unmeasured tiers' read speeds from ``cache.stats()`` (bytes/s -> tokens/s)."""
    codec, layout, block = (getattr(cache, a, None) for a in ("codec", "layout", "block_tokens"))
    if codec is None or layout is None or not block:
        return
    bytes_per_token = codec.encoded_nbytes(layout, block) / block
    for tier in cache.stats().get("tiers", []):
        gbps = tier.get("read_gbps")
        if gbps:
            planner.seed_read(tier["name"], gbps * 1e9 / bytes_per_token)


def _token_ids(input_ids: Any) -> tuple[list[int], bytes]:
    """The prompt's ids as this module's own list, and packed (``token_block_bytes``: the
    pack that checks them is the one hashing needs)."""
    if isinstance(input_ids, Mapping):
        # (iterated, a tokenizer's output gave its key names as the ids)
        raise InputError(f"input_ids: a {type(input_ids).__name__} (a tokenizer's output?); pass its ['input_ids'] "
                         "(batch size 1, no padding: prefill_with_reuse takes no attention mask)")
    if isinstance(input_ids, (str, bytes, bytearray, memoryview)):
        # (iterated, bytes gave their byte values as the ids)
        raise InputError(f"input_ids: a {type(input_ids).__name__}, not token ids (tokenize it first)")
    if not isinstance(input_ids, torch.Tensor) and hasattr(input_ids, "shape") and hasattr(input_ids, "tolist"):
        # A numpy array: read as a tensor is (its list() of a [1, T] array is one row).
        try:
            input_ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"input_ids: expected token ids, got an array torch cannot read ({exc})") from None
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise InputError(f"input_ids: batch size {input_ids.shape[0]}; only batch size 1 is supported")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise InputError(f"input_ids: expected [T] or [1, T], got {list(input_ids.shape)}")
        if input_ids.dtype == torch.bool:
            raise InputError("input_ids: a tensor of bools, not token ids")  # (tolist() reads them as 0 and 1)
        ids, from_tensor = input_ids.tolist(), True
    else:
        try:
            ids, from_tensor = list(input_ids), False  # this module's own list (HashedKeys keeps it)
        except TypeError:
            raise InputError(f"input_ids: expected token ids (a list or a tensor), got {type(input_ids).__name__}") \
                from None
    if ids and not from_tensor and isinstance(ids[0], (list, tuple)):  # rows, as a tokenizer gives a batch
        if len(ids) != 1:
            raise InputError(f"input_ids: batch size {len(ids)}; only batch size 1 is supported")
        ids = list(ids[0])
    if not ids:
        raise InputError("input_ids: empty prompt")
    # Every id an int in the int32 range (InputError otherwise), in one pack: an int() per
    # id took ~1 ms of host time per 16K tokens, on the path to the first token.
    return ids, token_block_bytes(ids, from_tensor=from_tensor)


def _check_vocabulary(model: Any, packed: bytes) -> None:
    """``InputError`` for an id the model's embedding has no row for, before anything runs:
    the forward's lookup fails on a CPU, and on a GPU asserts on the device, which ends the
    process's CUDA context. (One pass over the ids packed already: tens of microseconds of host
    time for 16K tokens.)"""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None)
    if not isinstance(vocab, int):
        return
    ids = torch.frombuffer(bytearray(packed), dtype=torch.int32)
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0 or hi >= vocab:
        j = int(((ids < 0) | (ids >= vocab)).nonzero()[0])
        raise InputError(f"input_ids[{j}]: token {int(ids[j])} is outside the model's vocabulary of {vocab}")


def _hashed(cache: Any, ids: list[int], packed: bytes) -> Any:
    """``ids`` hashed once by ``cache``'s keys (``HashedKeys``), or as they are for a cache
    without ``keys.hashed``. ``ids`` is this module's own list: nothing changes it after.
    ``packed``: the ids packed by ``_token_ids``, hashed without packing them again."""
    hashed = getattr(getattr(cache, "keys", None), "hashed", None)
    return hashed(ids, packed=packed) if hashed is not None else ids


# Per model: the RoPE type of its first rotary embedding whose frequencies follow the
# length of each forward, or None (read once: a walk over every module).
_LENGTH_ROPE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _length_dependent_rope(model: Any) -> str | None:
    """The RoPE type of ``model`` that rescales its frequencies by each forward's length
    (transformers' ``dynamic_rope_update``: a type naming "dynamic", and "longrope"), or None."""
    try:
        return _LENGTH_ROPE[model]
    except KeyError:
        pass
    except TypeError:  # (not weakly referable: read every time)
        return _read_length_rope(model)
    found = _LENGTH_ROPE[model] = _read_length_rope(model)
    return found


def _read_length_rope(model: Any) -> str | None:
    for module in model.modules() if hasattr(model, "modules") else ():
        kinds = getattr(module, "rope_type", None)
        for kind in kinds.values() if isinstance(kinds, dict) else (kinds,):
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return kind
    return None


def _check_model(model: Any) -> None:
    """``ConfigError`` for a model whose prompt's KV the store cannot hold as the forward
    made it, before anything is looked up or run."""
    name = type(model).__name__
    if getattr(model, "_is_stateful", False):  # transformers 4's mark of a recurrent state
        raise ConfigError(f"{name} keeps a recurrent state beside its KV (Mamba-like layers): prefill_with_reuse "
                          "handles caches of full-attention and sliding-window layers only")
    config = getattr(model, "config", None)
    text = _text_config(config)
    if getattr(text, "kv_lora_rank", None):
        # (transformers' cache of an MLA layer holds its latent and its rope part, of two
        # widths, no per-head K and V: none of it is a layout's, and the prompt would have run)
        raise ConfigError(f"{name}: an MLA model (kv_lora_rank {text.kv_lora_rank}): its cache holds a latent per "
                          "token, not per-head K and V; prefill_with_reuse handles K/V caches only (MLA latents are "
                          "stored through cs.KVPages.mla, as the vLLM connector does)")
    other = _config_layers(config)[1]
    if other is not None:
        i, kind = other
        raise ConfigError(f"{name}: layer {i} keeps a {kind}, not per-token KV of full or sliding-window attention "
                          "(linear attention, a recurrent state, shared or indexed KV): prefill_with_reuse handles "
                          "caches of full-attention and sliding-window layers only")
    rope = _length_dependent_rope(model)
    if rope is not None:
        raise ConfigError(f"{name}: RoPE type {rope!r} rescales its frequencies by the length of each forward, so "
                          "a stored prefix's K depend on the forward that computed them, not on the prefix alone: "
                          "reusing them would not give a plain prefill's logits")


def _check_layout(model: Any, cache: Any) -> None:
    layout = getattr(cache, "layout", None)
    if layout is None:
        return
    want = kv_layout(model)
    if layout != want:
        raise ConfigError(f"cache layout {layout} does not match the model's KV layout {want}")
    # Under autocast the projections' outputs take its dtype while RoPE's tables keep the
    # model's (K and V of two dtypes): KV no layout describes, and a stored prefix would be
    # concatenated with them (promoted) instead of the KV a prefill makes there.
    device_type = model_device(model).type
    if torch.is_autocast_enabled(device_type):
        cast = torch.get_autocast_dtype(device_type)
        if kv_layout(model, cast) != layout:
            raise ConfigError(f"autocast to {str(cast).removeprefix('torch.')}: the model's KV are not the layout's "
                              f"{layout.dtype} (leave autocast, or load the model in {str(cast).removeprefix('torch.')} "
                              "with a layout of that dtype)")


def _sync(device: torch.device, devices: list[torch.device] | None = None) -> None:
    for d in {device, *(devices or ())}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


# -- greedy continuation -----------------------------------------------------------------


@dataclass(slots=True)
class Generated:
    """Greedy tokens; ``logits`` holds each step's [vocab] logits when asked for."""

    tokens: list[int]
    logits: list[torch.Tensor]
    seconds: float


def greedy_continue(
    model: Any,
    cache: Any,
    logits: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    keep_logits: bool = False,
) -> Generated:
    """Greedy decoding from a prefilled ``cache`` whose last position gave ``logits`` [vocab].

    The first token is ``argmax(logits)``; each next one comes from a forward pass of the
    previous token on the growing cache. Stops after ``max_new_tokens`` or at an EOS token.
    The ``cache`` is extended in place, up to (not including) the last token returned.
    """
    t0 = time.perf_counter()
    device = model_device(model)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        if keep_logits:
            kept.append(logits)
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos or step == max_new_tokens - 1:
            break
        out, cache = forward(model, torch.tensor([[token]], device=device), cache)
        logits = out[0, -1]
    return Generated(tokens, kept, time.perf_counter() - t0)


def dynamic_cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) [H, T, D] views of a ``DynamicCache`` (batch size 1)."""
    return kv_layers(cache)
