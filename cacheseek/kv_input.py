"""What workers hand us (an HF cache, or per-layer K/V): turned into per-layer [H, T, D]
views (``kv_layers``), and checked against a cache's layout (``check_layers``).

transformers is never imported: a ``DynamicCache`` is recognised by shape (``.layers`` with
``.keys``/``.values`` in 4.5x and 5.x, or ``.key_cache``/``.value_cache`` in older releases).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import InputError
from .layout import KVLayout


def _pairs(kv: Any) -> list[tuple[Any, Any]]:
    inner = getattr(kv, "self_attention_cache", None)
    if inner is not None:
        # An EncoderDecoderCache, which transformers 4 hands a decoder-only model too
        # (GPTBigCode's): its self-attention part, where the cross-attention part is empty.
        cross = getattr(kv, "cross_attention_cache", None)
        if cross is not None and cross.get_seq_length() > 0:
            raise InputError("kv: an encoder-decoder cache with cross-attention KV; only a decoder-only model's KV "
                             "is stored (the prefix does not determine the cross-attention's)")
        kv = inner
    layers = getattr(kv, "layers", None)
    if layers is not None and all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        for i, layer in enumerate(layers):
            # A sliding-window layer (Mistral, Gemma, Qwen2's) past its window keeps the last
            # tokens only: refused as a length that disagreed with the ids, it said nothing of why.
            seen, kept = getattr(layer, "cumulative_length", None), getattr(layer.keys, "shape", None)
            if isinstance(seen, int) and kept is not None and len(kept) >= 2 and seen > kept[-2]:
                raise InputError(f"kv: layer {i} is a sliding-window layer that keeps its last {kept[-2]} of {seen} "
                                 "tokens; the store needs every token's KV (prefill_with_reuse stores such a model's "
                                 "prompt as its forward makes it, before the window drops any)")
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(kv, "key_cache") and hasattr(kv, "value_cache"):
        return list(zip(kv.key_cache, kv.value_cache, strict=True))
    if isinstance(kv, (list, tuple)):
        out = []
        for i, item in enumerate(kv):
            if not isinstance(item, (list, tuple)) or len(item) < 2:
                raise InputError(f"kv[{i}]: expected a (K, V) pair, got {type(item).__name__}")
            out.append((item[0], item[1]))
        return out
    raise InputError(
        f"kv: expected an HF DynamicCache, a sequence of per-layer (K, V) or one request's pages "
        f"(pages.at(page_ids)), got {type(kv).__name__}"
    )


def kv_layers(kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V), each [H, T, D] (a batch dim of 1 is dropped as a view)."""
    pairs = _pairs(kv)
    # The usual inputs, checked in one pass: per-layer [H, T, D] (nothing to do) or an HF
    # cache's [1, H, T, D] (one view each). The loop below says what is wrong otherwise.
    if pairs and all(type(k) is torch.Tensor and type(v) is torch.Tensor for k, v in pairs):
        dims = {t.dim() for pair in pairs for t in pair}
        if dims == {3}:
            return _detached(pairs)
        if dims == {4} and all(k.shape[0] == 1 and v.shape[0] == 1 for k, v in pairs):
            return _detached([(k[0], v[0]) for k, v in pairs])
    out = []
    for i, (k, v) in enumerate(pairs):
        for name, t in (("K", k), ("V", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"kv layer {i} {name}: expected a tensor, got {type(t).__name__}")
            if t.dim() == 4 and t.shape[0] != 1:
                raise InputError(f"kv layer {i} {name}: batch size {t.shape[0]}; only batch size 1 is supported")
            if t.dim() not in (3, 4):
                raise InputError(f"kv layer {i} {name}: expected [H, T, D] or [1, H, T, D], got {list(t.shape)}")
        k = k[0] if k.dim() == 4 else k
        v = v[0] if v.dim() == 4 else v
        out.append((k, v))
    if not out:
        raise InputError("kv: holds no layers")
    return _detached(out)


def _detached(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV from a forward run without ``no_grad`` requires grad: storing it needs none (the
    encode's in-place steps would refuse it). Views without it, sharing the memory."""
    if any(k.requires_grad or v.requires_grad for k, v in pairs):
        return [(k.detach(), v.detach()) for k, v in pairs]
    return pairs


def check_layers(layers: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout) -> int:
    """Check per-layer [H, T, D] K/V against ``layout``; return T."""
    if len(layers) != layout.num_layers:
        raise InputError(f"kv: {len(layers)} layers, the cache's layout has {layout.num_layers}")
    want_dtype = layout.torch_dtype
    k0 = layers[0][0]
    tokens = k0.shape[-2] if k0.dim() == 3 else -1
    shape, device = (layout.num_kv_heads, tokens, layout.head_dim), k0.device
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"kv layer 0 K: on {device}, which holds no data the cache can read; expected cpu or cuda")
    if all(k.shape == shape and v.shape == shape and k.dtype == want_dtype and v.dtype == want_dtype
           and k.device == device and v.device == device for k, v in layers):
        return tokens  # the usual case, checked in one pass; the loop below says what is wrong
    for i, (k, v) in enumerate(layers):
        for name, t in (("K", k), ("V", v)):
            if t.dim() != 3 or t.shape[0] != layout.num_kv_heads or t.shape[2] != layout.head_dim:
                raise InputError(
                    f"kv layer {i} {name}: shape {list(t.shape)}, the layout needs "
                    f"[{layout.num_kv_heads}, T, {layout.head_dim}]"
                )
            if t.shape[1] != tokens:
                raise InputError(f"kv layer {i} {name}: {t.shape[1]} tokens, layer 0 has {tokens}")
            if t.dtype != want_dtype:
                raise InputError(f"kv layer {i} {name}: dtype {t.dtype}, the layout says {layout.dtype}")
            if t.device != k0.device:
                raise InputError(f"kv layer {i} {name}: on {t.device}, layer 0 K is on {k0.device}")
    raise AssertionError("unreachable: the fast check failed, so one of the checks above must")


__all__ = ["check_layers", "kv_layers"]
