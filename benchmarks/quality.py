"""Quality drift per codec and precision policy on a real model: reused (stored, decoded)
prefix KV against recomputed; and a long-context retrieval check.

    python -m benchmarks.quality [--quick] [--threads N] [--out DIR]          # codecs: quality.json
    python -m benchmarks.quality --precision [--quick] [--no-retrieval] ...   # policies: precision.json
    python -m benchmarks.quality --plot-only benchmarks/results/quality.json --out docs   # redraw the plot
    python -m benchmarks.quality --precision --near-miss|--variants|--clip|--rotate ...
                                                  # precision_{near_miss,variants,clip,rotate}.json
    python -m benchmarks.quality --precision --rotate --extra    # 8 further prefixes: precision_rotate_extra.json
    python -m benchmarks.quality --plot-only benchmarks/results/precision{,_near_miss,_variants,_clip,_rotate}.json --out docs

Runs on one CPU thread by default: on a small shared machine, torch's OpenMP threads
spin-wait whenever one of them is descheduled, and 2 threads ran 2-5x slower than 1 there.

Model: SmolLM2-135M-Instruct (float32, CPU; fetched on first use, see
``cacheseek/integrations/smollm2.py``). Text: the standard library's docstrings
(``cacheseek/integrations/texts.py``), one module per document; each document gives a prefix
of P tokens (512, 1024 or 2048) and the C=128 tokens that follow it (the continuation).

For each prefix, the model prefills the P tokens once. Its cache is the reference
("recomputed"); every codec encodes that KV and decodes it back ("reused"), exactly what a
store round trip does. All rows then run the same continuation and greedy decode in one
batch, so every comparison is like with like (same kernels, same shapes):

- ``kl``: KL(recomputed || reused) of the next-token distributions, mean over the C positions;
- ``top1``: how often the two argmaxes agree over those positions;
- ``ppl``: perplexity of the continuation's tokens 2..C given the prefix, reused vs recomputed;
- ``greedy``: 64 greedy tokens after prefix + continuation: ``greedy_match`` is the share of
  positions with the same token, ``greedy_prefix`` the number of tokens before the first
  difference.

KIVI here quantizes the whole prefix (the storage use case); KIVI the paper keeps the most
recent tokens in full precision, which this does not.

``--precision`` measures precision policies and the retrieval check instead, into
precision.json (and docs/precision.png: quality against stored bits). Precision policies
(``cs.PrecisionPolicy``: a codec per block position) go through a real
``PrefixCache`` (ingest, materialize) with blocks of ``BLOCK`` = 64 tokens. Variants with
``last`` keep the chain's last stored block in ``last`` instead (not a policy a store can
key by: measured to answer whether it would help). ``bits/elem`` counts every stored bit of
the payload (codes and stats; a frame header adds 640 bytes to an int2 block, 0.23%) per K/V element of
a 2048-token prefix, against the model's float32 KV.

Retrieval (``--no-retrieval`` skips it): a pass key (5 digits) hidden in filler text at
several depths of contexts of several lengths; the context's full blocks are stored and
reused, the rest of it and the question are recomputed, and 8 greedy tokens must contain
the key. Raw (the recomputed cache, bit for bit) is the reference.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cacheseek as cs
from cacheseek.integrations import smollm2, texts
from cacheseek.integrations.transformers import dynamic_cache_layers, forward, kv_layout, to_dynamic_cache

from .report import add_plot_only, plot_only, pyplot, redraw, save, source_line, table, write_json

CONTINUATION = 128
GREEDY = 64
BLOCK = 64  # tokens per stored block (policies' positions; the prefixes are multiples of it)
BITS_AT = 2048  # prefix length the summary's bits/elem are counted at
RETRIEVAL_LENGTHS = (1024, 2048, 4096)
RETRIEVAL_DEPTHS = (0.25, 0.75)
RETRIEVAL_TOKENS = 8
# (module, prefix tokens): two documents per length, in a fixed order.
PREFIXES = (
    ("argparse", 512), ("json", 512),
    ("subprocess", 1024), ("http.client", 1024),
    ("logging", 2048), ("email.message", 2048),
)
QUICK = (("argparse", 512), ("subprocess", 1024), ("logging", 2048))
# ``--extra``: eight further documents, none of the above, for a check on prompts no setting
# was chosen on (written to *_extra.json; the retrieval check is the same, so it is skipped).
EXTRA = (
    ("functools", 512), ("csv", 512),
    ("pathlib", 1024), ("textwrap", 1024), ("zipfile", 1024),
    ("threading", 2048), ("inspect", 2048), ("os", 2048),
)


@dataclass(frozen=True)
class Variant:
    label: str
    codec: Any  # a codec, or a cs.PrecisionPolicy
    group: int | None
    last: Any = None  # the chain's last stored block in this codec instead (not a policy)
    block: int = BLOCK  # tokens per stored block

    @property
    def kind(self) -> str:
        return "uniform" if isinstance(self.codec, (cs.KIVI, cs.Raw)) and self.last is None else "policy"


def variants() -> list[Variant]:
    """The uniform codecs of quality.json."""
    out = [Variant("raw", cs.Raw(), None)]
    for group in (32, 128):
        out += [
            Variant("int8", cs.KIVI(bits=8, group_size=group), group),
            Variant("int4", cs.KIVI(bits=4, group_size=group), group),
            Variant("int2", cs.KIVI(bits=2, group_size=group), group),
            Variant("k2v4", cs.KIVI(k_bits=2, v_bits=4, group_size=group), group),
        ]
    return out


def precision_variants() -> list[Variant]:
    """precision.json: uniform codecs at G=32 (K and V bits apart both ways: which side is the
    more sensitive) and the bases at G=64; policies (first blocks int8 or Raw) and
    last-block variants over them."""
    out = [Variant("raw", cs.Raw(), None)]
    out += [Variant(name, cs.KIVI(k_bits=kb, v_bits=vb, group_size=32), 32)
            for name, kb, vb in (("int8", 8, 8), ("int4", 4, 4), ("int2", 2, 2), ("k2v4", 2, 4), ("k4v2", 4, 2))]
    out += [Variant(name, cs.KIVI(k_bits=kb, v_bits=vb, group_size=64), 64)
            for name, kb, vb in (("int2", 2, 2), ("k4v2", 4, 2))]
    i8 = cs.KIVI(bits=8, group_size=32)
    int2, k4v2 = cs.KIVI(bits=2, group_size=32), cs.KIVI(k_bits=4, v_bits=2, group_size=32)
    int2_64, k4v2_64 = cs.KIVI(bits=2, group_size=64), cs.KIVI(k_bits=4, v_bits=2, group_size=64)
    policy = cs.PrecisionPolicy
    out += [
        Variant("int8@0+int2", policy(first=i8, rest=int2), 32),
        Variant("raw@0+int2", policy(first=cs.Raw(), rest=int2), 32),
        Variant("int8@0,1+int2", policy(first=i8, first_blocks=2, rest=int2), 32),
        Variant("int8@0+int2+int8@last", policy(first=i8, rest=int2), 32, last=i8),
        Variant("int2+int8@last", int2, 32, last=i8),
        Variant("int8@0+k4v2", policy(first=i8, rest=k4v2), 32),
        Variant("raw@0+int2", policy(first=cs.Raw(), rest=int2_64), 64),
        Variant("int8@0+k4v2", policy(first=i8, rest=k4v2_64), 64),
    ]
    return out


def near_miss_variants() -> list[Variant]:
    """``--near-miss`` (precision_near_miss.json): the one policy family that fits 3.5 bits with
    4-bit keys on this model (head_dim 64 caps V's group at 64 channels: V int2 costs 2.5 bits):
    blocks of 128 tokens, K int4 G=128, V int2, the first block int4 or int8."""
    i8, i4 = cs.KIVI(bits=8, group_size=32), cs.KIVI(bits=4, group_size=32)
    k4v2_64 = cs.KIVI(k_bits=4, v_bits=2, group_size=64)
    k128 = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64)
    policy = cs.PrecisionPolicy
    return [
        Variant("raw", cs.Raw(), None),
        Variant("int4", cs.KIVI(bits=4, group_size=32), 32),
        Variant("k4v2", k4v2_64, 64),
        Variant("int8@0+k4v2", policy(first=i8, rest=k4v2_64), 64),
        Variant("k4(G128)v2(G64)", k128, 128, block=128),
        Variant("int4@0+k4(G128)v2(G64)", policy(first=i4, rest=k128), 128, block=128),
        Variant("int8@0+k4(G128)v2(G64)", policy(first=i8, rest=k128), 128, block=128),
    ]


def more_variants() -> list[Variant]:
    """``--variants`` (precision_variants.json): the variants still open after ``--near-miss``,
    each within its goal's bit budget at 2048 tokens (others were counted and left out; see
    docs/precision.md). Goal 1 (<= 3.5 bits): with a K int4 G=128 / V int2 G=64 rest (3.375
    bits) a first block of 128 tokens may spend at most 5.375 bits: K int8 G=128 / V int2
    G=64 is exactly that (3.500). Goal 2 (int4's quality at < 5 bits): an int8 first block
    over a 4-bit V rest with coarser K groups; uniform int4 G=64 as the control."""
    i8, i4 = cs.KIVI(bits=8, group_size=32), cs.KIVI(bits=4, group_size=32)
    k128 = cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64)
    k8v2 = cs.KIVI(k_bits=8, v_bits=2, k_group_size=128, v_group_size=64)
    k4v4_64 = cs.KIVI(bits=4, group_size=64)
    k4v4_32_64 = cs.KIVI(bits=4, k_group_size=32, v_group_size=64)
    k4v4_128_64 = cs.KIVI(bits=4, k_group_size=128, v_group_size=64)
    policy = cs.PrecisionPolicy
    return [
        Variant("raw", cs.Raw(), None),
        Variant("int4", i4, 32),
        Variant("k8(G128)v2(G64)@0+k4(G128)v2(G64)", policy(first=k8v2, rest=k128), 128, block=128),
        Variant("int4", k4v4_64, 64),
        Variant("int8@0+int4", policy(first=i8, rest=k4v4_64), 64),
        Variant("int8@0+k4(G32)v4(G64)", policy(first=i8, rest=k4v4_32_64), 64),
        Variant("int8@0+k4(G128)v4(G64)", policy(first=i8, rest=k4v4_128_64), 128, block=128),
    ]


def clip_variants() -> list[Variant]:
    """``--clip`` (precision_clip.json): the near miss (int4@0 + K int4 G=128 / V int2 G=64,
    blocks of 128) with V's encoder searching shrunk ranges (``KIVI(v_clip=...)``: the same
    stored bytes per block, so the same bits, and the same decoder), at 1, 2, 3 and 6
    steps of 5%; the rest alone at 2 steps as the control."""
    i4 = cs.KIVI(bits=4, group_size=32)
    policy = cs.PrecisionPolicy

    def rest(clip: int) -> cs.KIVI:
        return cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64, v_clip=clip)

    return [
        Variant("raw", cs.Raw(), None),
        Variant("int4@0+k4(G128)v2(G64)", policy(first=i4, rest=rest(0)), 128, block=128),
        *(Variant(f"int4@0+k4(G128)v2(G64,clip{c})", policy(first=i4, rest=rest(c)), 128, block=128)
          for c in (1, 2, 3, 6)),
        Variant("k4(G128)v2(G64,clip2)", rest(2), 128, block=128),
    ]


def rotate_variants() -> list[Variant]:
    """``--rotate`` (precision_rotate.json): the ``--clip`` policy (int4@0 + K int4 G=128 / V
    int2 G=64, ``v_clip=2``, blocks of 128) with V rotated before it is quantized
    (``KIVI(v_rotate=True)``: a fixed signed Hadamard rotation of the head dimension; the
    same stored bytes, so the same bits): the rest's V rotated, with and without the range
    search, and the first block's V rotated too."""
    policy = cs.PrecisionPolicy

    def rest(clip: int, rotate: bool) -> cs.KIVI:
        return cs.KIVI(k_bits=4, v_bits=2, k_group_size=128, v_group_size=64, v_clip=clip, v_rotate=rotate)

    i4, i4_rot = cs.KIVI(bits=4, group_size=32), cs.KIVI(bits=4, group_size=32, v_rotate=True)
    return [
        Variant("raw", cs.Raw(), None),
        Variant("int4@0+k4(G128)v2(G64,clip2)", policy(first=i4, rest=rest(2, False)), 128, block=128),
        Variant("int4@0+k4(G128)v2(G64,rot)", policy(first=i4, rest=rest(0, True)), 128, block=128),
        Variant("int4@0+k4(G128)v2(G64,clip2,rot)", policy(first=i4, rest=rest(2, True)), 128, block=128),
        Variant("int4(rot)@0+k4(G128)v2(G64,clip2,rot)", policy(first=i4_rot, rest=rest(2, True)), 128, block=128),
        Variant("k4(G128)v2(G64,clip2,rot)", rest(2, True), 128, block=128),
    ]


def reuse(variant: Variant, layout: cs.KVLayout, ids: list[int], layers: list) -> list:
    """The prefix KV ``layers`` [(K, V) [H, T, D]] as a store hands it back: a uniform codec's
    encode and decode (bit for bit what the store does); a policy through a real
    ``PrefixCache`` (ingest, materialize); ``last``: the last full block re-encoded with it."""
    if variant.kind == "uniform":
        # Whole blocks only (a retrieval context's stored part is whole 64-token blocks; with
        # blocks of 128 an odd last 64 stays recomputed, as a policy's chain leaves it).
        out = []
        for k, v in layers:
            n = k.shape[1] // variant.block * variant.block
            kk, vv = variant.codec.decode(variant.codec.encode(k[:, :n].contiguous(), v[:, :n].contiguous()), "cpu")
            out.append((torch.cat([kk, k[:, n:]], 1), torch.cat([vv, v[:, n:]], 1)))
        return out
    tokens = layers[0][0].shape[1]
    tiers = cs.TierConfig(cpu_bytes="4GiB", pin_memory=False)
    B = variant.block
    with cs.PrefixCache(model_id="quality", layout=layout, codec=variant.codec, block_tokens=B,
                        tiers=tiers) as cache:
        cache.ingest(ids[:tokens], layers)
        got = cache.materialize(ids[:tokens])
        out = [(k[0].clone(), v[0].clone()) for k, v in got.layers]
    stored = got.num_tokens
    out = [(torch.cat([k, rk[:, stored:]], 1), torch.cat([v, rv[:, stored:]], 1))
           for (k, v), (rk, rv) in zip(out, layers)]  # tokens after the last full block: recomputed
    if variant.last is not None and stored:
        a, b, c = stored - B, stored, variant.last
        for (k, v), (rk, rv) in zip(out, layers):
            k[:, a:b], v[:, a:b] = c.decode(c.encode(rk[:, a:b].contiguous(), rv[:, a:b].contiguous()), "cpu")
    return out


def kl_per_position(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position, from logits [T, V] (in float64)."""
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean cross-entropy of ``targets`` [T] under ``logits`` [T, V]."""
    return math.exp(torch.nn.functional.cross_entropy(logits.double(), targets).item())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def bits_per_element(variant: Any, layout: cs.KVLayout, tokens: int) -> float:
    """Stored bits per K/V element of a ``tokens``-token prefix: codes plus stats, from the
    codecs' own byte counts, block by block (``BLOCK``) for a policy or a ``last`` variant."""
    codec, last, B = (variant.codec, variant.last, variant.block) if isinstance(variant, Variant) \
        else (variant, None, BLOCK)
    if isinstance(codec, cs.PrecisionPolicy):
        nbytes = codec.chain_nbytes(layout, B, tokens // B)
        if last is not None:
            nbytes += last.encoded_nbytes(layout, B) - codec.codec_at(tokens // B - 1).encoded_nbytes(layout, B)
    else:
        nbytes = codec.encoded_nbytes(layout, tokens)
        if last is not None:
            nbytes += last.encoded_nbytes(layout, B) - codec.encoded_nbytes(layout, B)
    return 8 * nbytes / (layout.raw_nbytes(tokens) / layout.itemsize)



def batched_cache(model: Any, rows_layers: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> Any:
    """One ``DynamicCache`` holding each row's per-layer (K, V) as a batch row."""
    stacked = [(torch.stack([r[i][0] for r in rows_layers]), torch.stack([r[i][1] for r in rows_layers]))
               for i in range(len(rows_layers[0]))]
    return to_dynamic_cache(stacked, model.config)


def greedy_tokens(model: Any, step: torch.Tensor, cache: Any, n: int) -> list[list[int]]:
    """``n`` greedy tokens per batch row, from the last position's logits ``step`` ([batch, vocab])."""
    out: list[list[int]] = [[] for _ in range(step.shape[0])]
    for i in range(n):
        tok = step.argmax(-1)
        for b, t in enumerate(tok.tolist()):
            out[b].append(int(t))
        if i == n - 1:
            break
        logits, cache = forward(model, tok[:, None], cache)
        step = logits[:, -1].float()
    return out

def measure_prefix(model: Any, ids: list[int], prefix: int, vs: list[Variant]) -> list[dict]:
    """One prefix: every variant's row against the recomputed reference (row 0 of the batch)."""
    layout = kv_layout(model)
    x = torch.tensor([ids[: prefix + CONTINUATION]])
    _, ref_cache = forward(model, x[:, :prefix])
    ref_layers = [(k.contiguous(), v.contiguous()) for k, v in dynamic_cache_layers(ref_cache)]
    del ref_cache
    rows_layers = [ref_layers]
    for variant in vs:
        rows_layers.append(reuse(variant, layout, ids, ref_layers))
    batch = len(rows_layers)
    cache = batched_cache(model, rows_layers)
    del rows_layers
    cont = x[:, prefix:].expand(batch, -1)
    logits, cache = forward(model, cont, cache)
    logits = logits.float()
    greedy = greedy_tokens(model, logits[:, -1], cache, GREEDY)
    del cache

    targets = cont[0, 1:]
    ppl_ref = perplexity(logits[0, :-1], targets)
    rows = []
    for b, variant in enumerate(vs, start=1):
        kl = kl_per_position(logits[0], logits[b])
        match = sum(x == y for x, y in zip(greedy[0], greedy[b]))
        rows.append({
            "codec": variant.label, "group": variant.group or "-", "prefix": prefix,
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1": (logits[0].argmax(-1) == logits[b].argmax(-1)).float().mean().item(),
            "ppl_recomputed": ppl_ref, "ppl_reused": perplexity(logits[b, :-1], targets),
            "greedy_match": match / GREEDY, "greedy_prefix": common_prefix(greedy[0], greedy[b]),
            "bits_per_elem": bits_per_element(variant, layout, prefix), "kind": variant.kind,
        })
    return rows


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


def retrieval_prompt(tokenizer: Any, length: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """(context ids, question ids): ``length`` tokens in all, the key's sentence at ``depth``."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    q = tokenizer(QUESTION, add_special_tokens=False).input_ids
    per = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    fixed = len(tokenizer(INTRO + needle).input_ids) + len(q)
    reps = max(1, (length - fixed) // per)
    at = round(depth * reps)
    text = INTRO + FILLER * at + needle + FILLER * (reps - at)
    return tokenizer(text).input_ids, q


def measure_retrieval(model: Any, tokenizer: Any, length: int, depth: float, key: int, vs: list[Variant]) -> list[dict]:
    """One pass-key trial: every variant's reused context (its full blocks) against the key."""
    layout = kv_layout(model)
    ctx, q = retrieval_prompt(tokenizer, length, depth, key)
    ids = ctx + q
    stored = len(ctx) // BLOCK * BLOCK
    x = torch.tensor([ids])
    _, ref_cache = forward(model, x[:, :stored])
    ref_layers = [(k.contiguous(), v.contiguous()) for k, v in dynamic_cache_layers(ref_cache)]
    del ref_cache
    rows_layers = [ref_layers] + [reuse(v, layout, ids, ref_layers) for v in vs]
    batch = len(rows_layers)
    cache = batched_cache(model, rows_layers)
    del rows_layers
    logits, cache = forward(model, x[:, stored:].expand(batch, -1), cache, last_only=True)
    out = greedy_tokens(model, logits[:, -1].float(), cache, RETRIEVAL_TOKENS)
    del cache
    texts_out = [tokenizer.decode(t) for t in out]
    return [{"codec": v.label, "group": v.group or "-", "length": len(ids), "stored": stored, "depth": depth,
             "key": key, "found": str(key) in texts_out[b], "answer": texts_out[b],
             "recomputed_found": str(key) in texts_out[0]}
            for b, v in enumerate(vs, start=1)]


def summarize(rows: list[dict], vs: list[Variant], layout: cs.KVLayout | None = None,
              retrieval: list[dict] | None = None) -> list[dict]:
    out = []
    for variant in vs:
        mine = [r for r in rows if r["codec"] == variant.label and r["group"] == (variant.group or "-")]
        ppl_ref = sum(math.log(r["ppl_recomputed"]) for r in mine) / len(mine)
        ppl_use = sum(math.log(r["ppl_reused"]) for r in mine) / len(mine)
        bits = bits_per_element(variant, layout, BITS_AT) if layout is not None else mine[0]["bits_per_elem"]
        extra = {}
        if retrieval:
            group = variant.group or "-"
            got = [r["found"] for r in retrieval if r["codec"] == variant.label and r["group"] == group]
            extra["retrieval %"] = 100 * sum(got) / len(got)
        out.append({
            "codec": variant.label, "group": variant.group or "-", "kind": variant.kind, "bits/elem": bits, **extra,
            "KL mean": sum(r["kl_mean"] for r in mine) / len(mine),
            "KL max": max(r["kl_max"] for r in mine),
            "top-1 %": 100 * sum(r["top1"] for r in mine) / len(mine),
            "ppl recomputed": math.exp(ppl_ref), "ppl reused": math.exp(ppl_use),
            "ppl Δ %": 100 * (math.exp(ppl_use - ppl_ref) - 1),
            "greedy match %": 100 * sum(r["greedy_match"] for r in mine) / len(mine),
            "greedy same-prefix": sum(r["greedy_prefix"] for r in mine) / len(mine),
        })
    return out


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """KL drift, top-1 and greedy agreement per codec variant (precision.json: ``plot_bits``)."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    if doc.get("benchmark", "").startswith("precision"):
        return plot_bits(docs, out_dir)
    summary = doc["summary"]
    labels = [f"{r['codec']}" + (f" G{r['group']}" if r["group"] != "-" else "") for r in summary]
    xs = range(len(labels))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(13, 0.75 * len(summary)), 5.2))
    floor = 1e-9
    drawn = ax1.bar(xs, [max(r["KL mean"], floor) for r in summary], color="tab:red")
    ax1.bar_label(drawn, labels=["0 (exact)" if r["KL mean"] == 0 else f"{r['KL mean']:.2g}" for r in summary],
                  fontsize=7, padding=1)
    ax1.set_yscale("log")
    ax1.set_ylim(floor, 10)
    ax1.set_ylabel("KL(recomputed || reused), nats/token (log)")
    ax1.set_title("next-token distribution drift (lower is better)")
    width = 0.4
    top1 = ax2.bar([x - width / 2 for x in xs], [r["top-1 %"] for r in summary], width, label="top-1 agreement")
    greedy = ax2.bar([x + width / 2 for x in xs], [r["greedy match %"] for r in summary], width,
                     label=f"greedy {doc['greedy']}-token match")
    for drawn in (top1, greedy):
        ax2.bar_label(drawn, fmt="%.0f", fontsize=6.5, padding=1)
    ax2.set_ylim(0, 112)
    ax2.set_ylabel("% of positions equal to recomputed KV's")
    ax2.set_title("agreement with recomputed KV (higher is better)")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=30, ha="right")
        ax.set_xlabel("codec, group size G")
    lengths = sorted({r["prefix"] for r in doc["rows"]})
    return save(fig, out_dir, "quality", note=source_line(doc),
                title=f"Reused prefix KV per codec against recomputed KV: SmolLM2-135M-Instruct, "
                      f"{len(doc['documents'])} stdlib-docstring prefixes of {lengths[0]}-{lengths[-1]} tokens")


def plot_bits(docs: list[dict], out_dir: Path) -> Path | None:
    """Quality (KL, top-1) against stored bits per element: one numbered point per codec and
    policy, the numbers listed beside the plots. Later files (``--near-miss``, ``--variants``)
    add their rows after the first's, numbered on; a row already drawn (same codec, group and
    bits) is drawn once, from the first file that has it."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    summary, seen = [], set()
    for d in docs:
        for r in d["summary"]:
            key = (r["codec"], r["group"], round(r["bits/elem"], 4))
            if r["codec"] != "raw" and key not in seen:
                seen.add(key)
                summary.append(r)
    names = [r["codec"] + (f" G{r['group']}" if r["group"] != "-" else "") for r in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 6.4))
    for ax, key, ylabel in ((ax1, "KL mean", "KL(recomputed || reused), nats/token (log; lower is better)"),
                            (ax2, "top-1 %", "top-1 agreement with recomputed KV, % (higher is better)")):
        for i, r in enumerate(summary, start=1):
            policy = r.get("kind") == "policy"
            ax.scatter(r["bits/elem"], r[key], marker="D" if policy else "o", s=42,
                       color="tab:orange" if policy else "tab:blue", edgecolor="black", linewidth=0.5, zorder=3)
            ax.annotate(str(i), (r["bits/elem"], r[key]), textcoords="offset points",
                        xytext=(4 + 9 * (i % 2), 2 - 8 * (i % 3 == 0)), fontsize=8, fontweight="bold")
        ax.axvline(3.5, color="0.4", linestyle=":", linewidth=1, label="3.5 bits")
        ax.set_xscale("log", base=2)
        ax.set_xticks([2.5, 3, 3.5, 4, 5, 6, 9])
        ax.set_xticklabels(["2.5", "3", "3.5", "4", "5", "6", "9"])
        ax.set_xlabel(f"stored bits per K/V element (codes + stats; {doc.get('bits_at_tokens', 2048)}-token prefix; "
                      "log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.axhline(0.02, color="tab:red", linestyle="--", linewidth=1, label="goal: KL <= 0.02")
    ax2.axhline(95, color="tab:red", linestyle="--", linewidth=1, label="goal: top-1 >= 95%")
    int4 = next((r for r in summary if r["codec"] == "int4" and r["group"] == 32), None)
    if int4 is not None:
        ax1.axhline(int4["KL mean"], color="tab:green", linestyle="-.", linewidth=1, label="int4 G32")
        ax2.axhline(int4["top-1 %"], color="tab:green", linestyle="-.", linewidth=1, label="int4 G32")
    for ax in (ax1, ax2):
        ax.scatter([], [], marker="o", color="tab:blue", label="uniform codec")
        ax.scatter([], [], marker="D", color="tab:orange", label="precision policy / last-block variant")
        ax.legend(fontsize=8, loc="lower right" if ax is ax2 else "lower left")
    key_text = f"blocks of {doc.get('block_tokens', BLOCK)} tokens\n(128 where K's group is 128)\n\n"
    key_text += "\n".join(f"{i:2d}  {n}  ({r['bits/elem']:.2f} b)" for i, (n, r) in enumerate(zip(names, summary), 1))
    fig.text(0.915, 0.5, key_text, fontsize=8.5, va="center", ha="left", family="monospace")
    fig.subplots_adjust(right=0.9)
    lines = [source_line(d) for d in docs]  # two sources a line: the note stays within the plots' width
    note = "\n".join("; ".join(lines[i:i + 2]) for i in range(0, len(lines), 2))
    return save(fig, out_dir, "precision", note=note,
                title="Quality against stored bits per element, per codec and precision policy: "
                      "SmolLM2-135M-Instruct, reused vs recomputed prefix KV")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one prefix per length (3 instead of 6)")
    ap.add_argument("--extra", action="store_true", help="eight further prefixes instead (no retrieval check)")
    ap.add_argument("--precision", action="store_true", help="precision policies and the retrieval check")
    ap.add_argument("--near-miss", action="store_true", help="with --precision: the variants around 3.5 bits")
    ap.add_argument("--variants", action="store_true", help="with --precision: the variants after --near-miss")
    ap.add_argument("--clip", action="store_true", help="with --precision: the near miss with V's range search")
    ap.add_argument("--rotate", action="store_true", help="with --precision: the --clip policy with V rotated")
    ap.add_argument("--no-retrieval", action="store_true", help="skip the pass-key retrieval check")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see above)")
    ap.add_argument("--out", type=Path, default=None)
    add_plot_only(ap, several=True)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = smollm2.load(progress=print)
    layout = kv_layout(model)
    vs = variants()
    if args.precision:
        vs = (near_miss_variants() if args.near_miss else more_variants() if args.variants
              else clip_variants() if args.clip else rotate_variants() if args.rotate else precision_variants())
    rows, docs = [], {}
    prefixes = EXTRA if args.extra else QUICK if args.quick else PREFIXES
    for module, prefix in prefixes:
        doc = texts.stdlib_document(module)
        ids = tokenizer(doc).input_ids
        if len(ids) < prefix + CONTINUATION:
            raise SystemExit(f"{module}: {len(ids)} tokens, fewer than {prefix + CONTINUATION}")
        docs[module] = {"tokens": len(ids), "sha256_16": texts.fingerprint(doc)}
        t = time.perf_counter()
        rows += measure_prefix(model, ids, prefix, vs)
        print(f"  {module:14s} prefix {prefix:5d}: {time.perf_counter() - t:5.1f} s", flush=True)
    retrieval: list[dict] = []
    if args.precision and not args.no_retrieval and not args.extra:
        for length in RETRIEVAL_LENGTHS:
            for j, depth in enumerate(RETRIEVAL_DEPTHS):
                key = 10000 + (length * 7 + j * 7919) % 90000
                t = time.perf_counter()
                retrieval += measure_retrieval(model, tokenizer, length, depth, key, vs)
                print(f"  pass key  {length:5d} tokens, depth {depth:.2f}: {time.perf_counter() - t:5.1f} s",
                      flush=True)
    summary = summarize(rows, vs, layout if args.precision else None, retrieval)
    cols = ["codec", "group", "kind", "bits/elem", "KL mean", "KL max", "top-1 %", "ppl recomputed", "ppl reused",
            "ppl Δ %", "greedy match %", "greedy same-prefix"] + (["retrieval %"] if retrieval else [])
    seconds = time.perf_counter() - t0
    payload = {
        "model": smollm2.MODEL_ID, "layout": layout.to_dict(), "continuation": CONTINUATION, "greedy": GREEDY,
        "documents": docs, "threads": torch.get_num_threads(), "seconds": seconds,
        "block_tokens": BLOCK, "bits_at_tokens": BITS_AT,
        "retrieval_setup": {"lengths": RETRIEVAL_LENGTHS, "depths": RETRIEVAL_DEPTHS, "tokens": RETRIEVAL_TOKENS},
        "summary": summary, "rows": rows, "retrieval": retrieval,
    }
    name = "quality"
    if args.precision:
        name = ("precision_near_miss" if args.near_miss else "precision_variants" if args.variants
                else "precision_clip" if args.clip else "precision_rotate" if args.rotate else "precision")
    if args.extra:
        name += "_extra"
    path = write_json(name, payload, args.out)
    print(f"wrote {path}")
    redraw(plot, path)
    n = len(prefixes)
    print(table(summary, cols, f"Reused vs recomputed prefix KV, SmolLM2-135M fp32, {n} prefixes of 512-2048 "
                               f"tokens, {CONTINUATION}-token continuation, {GREEDY} greedy tokens ({seconds:.0f} s)"))


if __name__ == "__main__":
    main()
