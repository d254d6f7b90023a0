"""SDPA for queries that follow a cached past: causal aligned bottom-right, no mask built.

A forward over the suffix after a reused prefix (``prefill_with_reuse``) has q queries and
past + q keys. transformers' ``sdpa`` attention builds a ``[q, past + q]`` boolean mask for
it, repeats K and V once per query-head group (GQA), and hands SDPA the mask, which rules
out the flash kernel. With a long past that is most of the suffix's time: on the H200, a
256-token suffix over 16K cached tokens of a Llama-3-8B-shaped model spends more in
attention than in its matmuls (docs/engine.md). Engines run this case on FlashAttention's
bottom-right causal alignment; SDPA has it too (``causal_lower_right``), with GQA heads
read in place.

    from cacheseek.integrations.suffix_attention import register
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=register())
    # or, on a loaded model: model.set_attn_implementation(register())

It applies only where the mask transformers would build is exactly that: no padding mask,
no sliding window, no mask function other than plain causal, and queries that end at the
last key (a ``DynamicCache``, and the caches ``prefill_with_reuse`` builds). Everything else
(padding, a static cache, sliding windows, a bias) gets transformers' own sdpa mask and
attention, so the results are transformers' results (tests/test_suffix_attention.py
checks both cases against ``sdpa``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

NAME = "cacheseek_sdpa"
_lock = threading.Lock()
_registered = False


def register() -> str:
    """Register the attention and its mask function with transformers (once); returns the
    name to pass as ``attn_implementation``. Raises ``ImportError`` naming what is missing
    where transformers or torch is too old for either."""
    global _registered
    with _lock:
        if not _registered:
            from torch.nn.attention.bias import causal_lower_right  # noqa: F401  (torch >= 2.2)
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface  # transformers >= 4.53

            AttentionInterface.register(NAME, _attention)
            AttentionMaskInterface.register(NAME, _mask)
            _registered = True
    return NAME


def _mask(batch_size: int, q_length: int | None = None, kv_length: int = 0, q_offset: Any = 0, kv_offset: Any = 0,
          mask_function: Any = None, attention_mask: Any = None, local_size: Any = None,
          allow_is_causal_skip: bool = True, cache_position: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """``None`` (no mask: :func:`_attention` aligns the causal mask bottom-right) where that is
    the mask; otherwise transformers' sdpa mask, always materialized, so that ``None`` reaching
    the attention means exactly this case.

    transformers 5 names the queries by ``q_length`` and ``q_offset``; transformers 4 passes
    their ``cache_position`` (a device tensor: not read here, which would make the host wait
    for the device) and sizes the keys from the cache, so that with a cache whose mask may
    be skipped (``allow_is_causal_skip``: not a static one) the queries end at the last key."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = (mask_function is causal_mask_function and attention_mask is None and local_size is None
             and allow_is_causal_skip and isinstance(q_offset, int) and isinstance(kv_offset, int))
    if q_length is None:  # transformers 4
        skip = plain and kv_offset == 0 and cache_position is not None and cache_position.dim() == 1
        queries = {"cache_position": cache_position}
    else:
        skip = plain and (q_length == 1 or q_offset + q_length == kv_offset + kv_length)
        queries = {"q_length": q_length, "q_offset": q_offset}
    if skip:
        return None
    return sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset,
                     mask_function=mask_function or causal_mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, **queries, **kwargs)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    if (attention_mask is not None or not causal or q_len == 1 or q_len > kv_len
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("sliding_window") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None and causal and 1 < q_len < kv_len:
            # ``_mask``'s None means bottom-right; transformers' sdpa, given none, passes
            # is_causal=True, which SDPA aligns top-left: a suffix after a past saw the wrong
            # keys (Gemma2's softcap under transformers 4 came here). The mask, built.
            from torch.nn.attention.bias import causal_lower_right

            attention_mask = causal_lower_right(q_len, kv_len)._materialize(query.device)[None, None]
            is_causal = False
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    if q_len == kv_len:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=p, is_causal=True,
                                                               scale=scaling, enable_gqa=gqa)
    elif _flash_direct(query, key, value, p, gqa):
        out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, p, is_causal=True,
                                                                  return_debug_mask=False, scale=scaling)[0]
    else:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q_len, kv_len)
        # No flash kernel to dispatch to off CUDA: the same mask, built (and no warning).
        mask = bias if query.device.type == "cuda" else bias._materialize(query.device)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, mask, dropout_p=p, scale=scaling,
                                                               enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


# Whether SDPA's flash kernel takes a (device, dtype, head dim, query heads, KV heads) case,
# with flash enabled or not: torch's own answer, asked once per case.
_flash_ok: dict[tuple, bool] = {}


def _flash_direct(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, gqa: bool) -> bool:
    """Whether to call the flash kernel directly, as ``causal_lower_right`` would dispatch it:
    torch's flash op aligns a causal mask bottom-right when there are fewer queries than
    keys. The same kernel and bytes, without the bias object, its ``__torch_function__``
    dispatch and its checks on every call: about 70 us of host time a layer on the H200
    (half the attention's), on a suffix forward bound by the host's launches. Only where
    the head dim needs no padding and every last dim is contiguous; the rest of what flash
    needs (dtype, head count, GPU, ``sdpa_kernel``'s choice) is torch's verdict."""
    if (query.device.type != "cuda" or dropout or query.shape[-1] % 8 or not query.numel() or key.dtype != query.dtype
            or value.dtype != query.dtype or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1):
        return False
    case = (query.device, query.dtype, query.shape[-1], query.shape[1], key.shape[1], value.shape[-1],
            torch.backends.cuda.flash_sdp_enabled(), query.requires_grad or key.requires_grad or value.requires_grad)
    ok = _flash_ok.get(case)
    if ok is None:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        ok = _flash_ok[case] = bool(can_use_flash_attention(SDPAParams(query, key, value, None, dropout, False, gqa)))
    return ok


__all__ = ["NAME", "register"]
