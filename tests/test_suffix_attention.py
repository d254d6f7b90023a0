"""The suffix attention (``cacheseek_sdpa``): transformers' sdpa results, without the mask.

A tiny random Llama runs each case twice, once under transformers' ``sdpa`` and once under
ours: a full prefill, a suffix after a cached past (the case it exists for), a decode step,
and a left-padded batch (which must take transformers' own path). The logits must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cacheseek as cs  # noqa: E402
from cacheseek.integrations import suffix_attention  # noqa: E402
from cacheseek.integrations.transformers import forward, kv_layout, prefill_with_reuse  # noqa: E402
from model_helpers import tiny_llama  # noqa: E402

ATOL = 2e-5


@pytest.fixture(scope="module")
def models():
    reference = tiny_llama(attn_implementation="sdpa")
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation(suffix_attention.register())
    assert ours.config._attn_implementation == suffix_attention.NAME
    return reference, ours


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_register_is_idempotent():
    assert suffix_attention.register() == suffix_attention.register() == "cacheseek_sdpa"


# transformers 4 hands a mask function the queries' cache_position, 5 their count and offset.
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5


def _mask(q_length: int, kv_length: int, q_offset: int = 0, **kw):
    """``suffix_attention._mask`` called as the installed transformers calls it."""
    from transformers.masking_utils import causal_mask_function

    kw = {"batch_size": 1, "mask_function": causal_mask_function} | kw
    if TRANSFORMERS_4:
        return suffix_attention._mask(cache_position=torch.arange(q_offset, q_offset + q_length), kv_length=kv_length,
                                      **kw)
    return suffix_attention._mask(q_length=q_length, kv_length=kv_length, q_offset=q_offset, **kw)


def test_mask_is_skipped_only_for_queries_ending_at_the_last_key():
    assert _mask(16, 80, 64) is None  # suffix after a past
    assert _mask(16, 16) is None  # a prefill
    assert _mask(1, 81, 80) is None  # a decode step
    # a static cache's prefill (keys past the queries' end): a real mask, never None.
    # (transformers 4 sizes the keys from the cache, and says a static one's mask may not
    # be skipped; 5 gives the queries' offset, which is checked.)
    static = _mask(16, 128, 0, allow_is_causal_skip=not TRANSFORMERS_4)
    assert static is not None and tuple(static.shape[-2:]) == (16, 128)
    assert bool(static[0, 0, 0, 0]) and not bool(static[0, 0, 0, 1])  # top-left causal
    padded = _mask(4, 4, attention_mask=torch.tensor([[False, True, True, True]]))
    assert padded is not None and not bool(padded[0, 0, 3, 0])
    # a sliding window (its mask function comes from the caller): never skipped
    assert _mask(16, 16, local_size=4) is not None


def test_prefill_suffix_and_decode_match_sdpa(models, monkeypatch):
    reference, ours = models
    import torch.nn.attention.bias as bias

    made = []
    real = bias.causal_lower_right
    monkeypatch.setattr(bias, "causal_lower_right", lambda *a: made.append(a) or real(*a))
    ids = _ids(96, 1)
    with torch.no_grad():
        full_ref, past_ref = forward(reference, ids[:, :80])
        full_ours, past_ours = forward(ours, ids[:, :80])
        assert torch.allclose(full_ref, full_ours, atol=ATOL)
        # a 16-token suffix over the 80 cached tokens: our bottom-right path
        suffix_ref, past_ref = forward(reference, ids[:, 80:], past_ref)
        suffix_ours, past_ours = forward(ours, ids[:, 80:], past_ours)
        assert torch.allclose(suffix_ref, suffix_ours, atol=ATOL)
        assert made == [(16, 96)] * 2  # both layers took the bottom-right path, the prefill did not need it
        # and it is not the top-left alignment (which would hide most of the past)
        assert not torch.allclose(suffix_ours, forward(reference, ids[:, 80:])[0], atol=1e-3)
        step_ref, _ = forward(reference, ids[:, 95:], past_ref)
        step_ours, _ = forward(ours, ids[:, 95:], past_ours)
        assert torch.allclose(step_ref, step_ours, atol=ATOL)


def test_a_padded_batch_takes_transformers_path(models):
    reference, ours = models
    ids = torch.cat([_ids(24, 2), _ids(24, 3)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    with torch.no_grad():
        a = reference(input_ids=ids, attention_mask=mask).logits
        b = ours(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a, b, atol=ATOL)


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_with_reuse_under_the_suffix_attention(models, layerwise):
    """Reuse of a stored prefix (whole, or layer by layer) gives the logits of a full
    prefill under sdpa."""
    reference, ours = models
    ids = _ids(2 * 64 + 20, 4)[0].tolist()
    with torch.no_grad():
        want, _ = forward(reference, torch.tensor([ids]), last_only=True)
    tiers = cs.TierConfig(cpu_bytes="16MiB", pin_memory=False)
    with cs.PrefixCache(model_id="t", layout=kv_layout(ours), codec=cs.Raw(), block_tokens=64, tiers=tiers) as cache:
        prefill_with_reuse(ours, cache, ids, reuse="never")
        res = prefill_with_reuse(ours, cache, ids, reuse="always", ingest=False, layerwise=layerwise)
    assert res.reused_tokens == 128
    assert torch.allclose(res.logits.reshape(-1), want.reshape(-1), atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel path needs CUDA")
def test_suffix_on_cuda_bf16_takes_the_flash_path_and_matches_sdpa(models):
    """On a GPU, bf16: the bottom-right causal suffix runs on SDPA's flash kernel (no mask),
    and agrees with transformers' masked sdpa within bf16 rounding."""
    reference, ours = (copy.deepcopy(m).to("cuda", torch.bfloat16) for m in models)
    ids = _ids(160, 5).cuda()
    with torch.no_grad():
        _, past_ref = forward(reference, ids[:, :128])
        _, past_ours = forward(ours, ids[:, :128])
        want, _ = forward(reference, ids[:, 128:], past_ref)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            got, _ = forward(ours, ids[:, 128:], past_ours)  # fails if flash cannot run it
    assert torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct flash call needs CUDA")
@pytest.mark.parametrize("flash", [True, False])
def test_cuda_suffix_calls_flash_directly_with_the_bias_paths_bytes(monkeypatch, flash):
    """Where flash may run, the suffix calls its kernel directly (no ``causal_lower_right``
    object) and gets the bytes the bias path gets; where ``sdpa_kernel`` rules flash out,
    it goes through the bias as before."""
    import torch.nn.attention.bias as bias
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Module:
        training, is_causal = False, True

    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 8, 48, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    backends = [SDPBackend.FLASH_ATTENTION] if flash else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, bias.causal_lower_right(48, 1000),
                                                                enable_gqa=True).transpose(1, 2)
        made = []
        real = bias.causal_lower_right
        monkeypatch.setattr(bias, "causal_lower_right", lambda *a: made.append(a) or real(*a))
        got, _ = suffix_attention._attention(Module(), q, k, v, None)
    assert made == ([] if flash else [(48, 1000)])
    assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("extra", [{"softcap": 50.0}, {"sliding_window": 4096}], ids=["softcap", "window"])
def test_a_suffix_handed_to_transformers_sdpa_keeps_the_bottom_right_causal_mask(extra):
    """A model that passes softcap= (Gemma2 under transformers 4) or a window went to
    transformers' sdpa with no mask, which passes is_causal=True: SDPA aligns that top-left,
    so a suffix of 20 queries after 70 cached keys attended to the wrong keys (logits off by
    0.36 on a small Gemma2; greedy tokens changed)."""
    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    try:
        got, _ = suffix_attention._attention(module, q, k, v, None, scaling=0.25, **extra)
    except ValueError as exc:
        # Recent transformers 5 releases refuse a softcap under sdpa (Gemma2 takes eager
        # there): the call says so rather than attend without it. Earlier ones (5.17, and 4,
        # in CI) take it, and the mask is what is checked.
        assert "softcap" in extra and "does not support `softcap`" in str(exc), exc
        return
    mask = causal_lower_right(20, 90)._materialize(q.device)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            mask, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(got, want)
