"""Smoke runs of the real-model benchmarks on a tiny random Llama (CPU, seconds).

They keep ``benchmarks/ttft.py`` (run for real on an H200) and ``benchmarks/quality.py``
(run for real on SmolLM2) working end to end; their numbers here mean nothing.
"""

from __future__ import annotations

import pytest
import torch

import cacheseek as cs

transformers = pytest.importorskip("transformers")

from benchmarks import quality, ttft  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return ttft.build_model(ttft.TINY, torch.device("cpu"), torch.float32)


def test_ttft_times_every_tier_and_codec_and_says_what_pays(tiny, tmp_path):
    rows = ttft.run_context(tiny, 512, ["gpu", "cpu", "disk"], ["raw", "int4"], 1, tmp_path,
                            torch.device("cpu"), log=lambda msg: None)
    assert [(r["tier"], r["codec"]) for r in rows] == [
        ("gpu", "raw"), ("gpu", "int4"), ("cpu", "raw"), ("cpu", "int4"), ("disk", "raw"), ("disk", "int4")]
    assert all(r["note"] == "no GPU" for r in rows[:2])
    for r in rows[2:]:
        # the suffix forward over KV already in the model's cache, beside each cell's runs
        assert r["suffix_only_s"] > 0 and r["ceiling"] == pytest.approx(r["full_s"] / r["suffix_only_s"])
        assert r["reuse_s"] > 0 and r["planner"] in ("reuse", "skip")
        assert r["pays"] == (r["reuse_s"] < r["full_s"])
        assert r["note"] == ("" if r["pays"] else "SLOWER than recompute")
    assert rows[3]["stored_gb"] < rows[2]["stored_gb"]  # int4 stores fewer bytes than raw
    assert list(tmp_path.iterdir()) == []  # disk tier folders are removed


def test_quality_rows_compare_each_codec_with_recomputed_kv(tiny, monkeypatch):
    monkeypatch.setattr(quality, "GREEDY", 8)
    ids = torch.randint(0, ttft.TINY["vocab_size"], (128 + quality.CONTINUATION,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    vs = quality.variants()
    rows = quality.measure_prefix(tiny, ids, 128, vs)
    assert len(rows) == len(vs)
    raw = rows[0]
    assert raw["codec"] == "raw" and raw["kl_mean"] == 0 and raw["top1"] == 1 and raw["greedy_prefix"] == 8
    assert raw["ppl_reused"] == raw["ppl_recomputed"]
    int2 = next(r for r in rows if r["codec"] == "int2" and r["group"] == 128)
    assert int2["kl_mean"] > next(r for r in rows if r["codec"] == "int4" and r["group"] == 128)["kl_mean"]
    summary = quality.summarize(rows, vs)
    assert [s["bits/elem"] for s in summary[:2]] == [32, 9]


def test_precision_policies_go_through_the_store_and_count_every_block(tiny, monkeypatch):
    monkeypatch.setattr(quality, "GREEDY", 4)
    ids = torch.randint(0, ttft.TINY["vocab_size"], (128 + quality.CONTINUATION,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    vs = [v for v in quality.precision_variants() if v.label in ("raw", "int2", "int8@0+int2", "int2+int8@last")
          and v.group in (None, 32)]
    rows = quality.measure_prefix(tiny, ids, 128, vs)
    by = {r["codec"]: r for r in rows}
    assert by["raw"]["kl_mean"] == 0
    # Two blocks of 64: the int8 first block (or last) costs what it stores.
    assert by["int8@0+int2"]["bits_per_elem"] == by["int2+int8@last"]["bits_per_elem"]
    assert by["int2"]["bits_per_elem"] < by["int8@0+int2"]["bits_per_elem"] < by["raw"]["bits_per_elem"]
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    policy = next(v for v in vs if v.label == "int8@0+int2")
    assert quality.bits_per_element(policy, layout, 2048) == pytest.approx((9 + 31 * 3) / 32)


def test_more_variants_fit_their_goals_bit_budgets():
    """--variants: the goal-1 policy stores at most 3.5 bits, the goal-2 ones fewer than int4's 5."""
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    bits = {(v.label, v.group): quality.bits_per_element(v, layout, 2048) for v in quality.more_variants()}
    assert bits[("k8(G128)v2(G64)@0+k4(G128)v2(G64)", 128)] == pytest.approx((5.375 + 15 * 3.375) / 16) == 3.5
    assert bits[("int4", 32)] == 5
    for key in (("int4", 64), ("int8@0+int4", 64), ("int8@0+k4(G32)v4(G64)", 64), ("int8@0+k4(G128)v4(G64)", 128)):
        assert 4.5 <= bits[key] < 5
    assert bits[("int8@0+int4", 64)] == pytest.approx((9 + 31 * 4.5) / 32)


def test_clip_variants_store_the_near_miss_bits():
    """--clip: V's range search changes no stored byte: every row counts the near miss's bits."""
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    bits = {v.label: quality.bits_per_element(v, layout, 2048) for v in quality.clip_variants() if v.label != "raw"}
    near_miss = (5 + 15 * 3.375) / 16
    assert bits.pop("k4(G128)v2(G64,clip2)") == 3.375
    assert len(bits) == 5 and all(b == pytest.approx(near_miss) for b in bits.values()) and near_miss <= 3.5


def test_rotate_variants_store_the_near_miss_bits():
    """--rotate: V's rotation changes no stored byte either: the --clip policy's bits."""
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")
    vs = [v for v in quality.rotate_variants() if v.label != "raw"]
    bits = {v.label: quality.bits_per_element(v, layout, 2048) for v in vs}
    assert bits.pop("k4(G128)v2(G64,clip2,rot)") == 3.375
    assert len(bits) == 4 and all(b == pytest.approx((5 + 15 * 3.375) / 16) for b in bits.values())
    assert sum(v.codec.codec_at(1).v_rotate for v in vs if v.kind == "policy") == 3


def test_a_uniform_variant_in_blocks_of_128_reuses_whole_blocks_only():
    # A retrieval context is whole 64-token blocks: with blocks of 128 an odd last 64 stays
    # recomputed (as a policy's chain leaves it), instead of failing K's group of 128.
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    gen = torch.Generator().manual_seed(4)
    layers = [(torch.randn(2, 192, 64, generator=gen), torch.randn(2, 192, 64, generator=gen)) for _ in range(2)]
    variant = quality.clip_variants()[-1]
    assert variant.kind == "uniform" and variant.block == 128
    out = quality.reuse(variant, layout, list(range(192)), layers)
    for (k, v), (rk, rv) in zip(out, layers):
        assert k.shape == rk.shape and torch.equal(k[:, 128:], rk[:, 128:]) and torch.equal(v[:, 128:], rv[:, 128:])
        assert not torch.equal(k[:, :128], rk[:, :128]) and not torch.equal(v[:, :128], rv[:, :128])
