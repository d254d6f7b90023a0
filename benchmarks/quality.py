"""Quality drift per codec on a real model: reused (encoded, decoded) prefix KV against recomputed.

    python -m benchmarks.quality [--quick] [--threads N] [--out DIR]
    python -m benchmarks.quality --plot-only benchmarks/results/quality.json --out docs   # redraw the plot

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
# (module, prefix tokens): two documents per length, in a fixed order.
PREFIXES = (
    ("argparse", 512), ("json", 512),
    ("subprocess", 1024), ("http.client", 1024),
    ("logging", 2048), ("email.message", 2048),
)
QUICK = (("argparse", 512), ("subprocess", 1024), ("logging", 2048))


@dataclass(frozen=True)
class Variant:
    label: str
    codec: Any
    group: int | None


def variants() -> list[Variant]:
    out = [Variant("raw", cs.Raw(), None)]
    for group in (32, 128):
        out += [
            Variant("int8", cs.KIVI(bits=8, group_size=group), group),
            Variant("int4", cs.KIVI(bits=4, group_size=group), group),
            Variant("int2", cs.KIVI(bits=2, group_size=group), group),
            Variant("k2v4", cs.KIVI(k_bits=2, v_bits=4, group_size=group), group),
        ]
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


def bits_per_element(codec: Any, layout: cs.KVLayout, tokens: int) -> float:
    """Stored bits per K/V element: codes plus stats, from the codec's own byte count."""
    return 8 * codec.encoded_nbytes(layout, tokens) / (layout.raw_nbytes(tokens) / layout.itemsize)


def measure_prefix(model: Any, ids: list[int], prefix: int, vs: list[Variant]) -> list[dict]:
    """One prefix: every variant's row against the recomputed reference (row 0 of the batch)."""
    layout = kv_layout(model)
    x = torch.tensor([ids[: prefix + CONTINUATION]])
    _, ref_cache = forward(model, x[:, :prefix])
    ref_layers = [(k.contiguous(), v.contiguous()) for k, v in dynamic_cache_layers(ref_cache)]
    del ref_cache
    rows_layers = [ref_layers]
    for variant in vs:
        codec = variant.codec
        rows_layers.append([codec.decode(codec.encode(k, v), "cpu") for k, v in ref_layers])
    batch = len(rows_layers)
    stacked = [
        (torch.stack([r[i][0] for r in rows_layers]), torch.stack([r[i][1] for r in rows_layers]))
        for i in range(len(ref_layers))
    ]
    del rows_layers
    cache = to_dynamic_cache(stacked, model.config)
    del stacked
    cont = x[:, prefix:].expand(batch, -1)
    logits, cache = forward(model, cont, cache)
    logits = logits.float()

    greedy = [[] for _ in range(batch)]
    step = logits[:, -1]
    for i in range(GREEDY):
        tok = step.argmax(-1)
        for b in range(batch):
            greedy[b].append(int(tok[b]))
        if i == GREEDY - 1:
            break
        out, cache = forward(model, tok[:, None], cache)
        step = out[:, -1].float()
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
            "bits_per_elem": bits_per_element(variant.codec, layout, prefix),
        })
    return rows


def summarize(rows: list[dict], vs: list[Variant]) -> list[dict]:
    out = []
    for variant in vs:
        mine = [r for r in rows if r["codec"] == variant.label and r["group"] == (variant.group or "-")]
        ppl_ref = sum(math.log(r["ppl_recomputed"]) for r in mine) / len(mine)
        ppl_use = sum(math.log(r["ppl_reused"]) for r in mine) / len(mine)
        out.append({
            "codec": variant.label, "group": variant.group or "-", "bits/elem": mine[0]["bits_per_elem"],
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
    """KL drift, top-1 and greedy agreement per codec variant."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    summary = doc["summary"]
    labels = [f"{r['codec']}" + (f" G{r['group']}" if r["group"] != "-" else "") for r in summary]
    xs = range(len(labels))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one prefix per length (3 instead of 6)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see above)")
    ap.add_argument("--out", type=Path, default=None)
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = smollm2.load(progress=print)
    layout = kv_layout(model)
    vs = variants()
    rows, docs = [], {}
    for module, prefix in QUICK if args.quick else PREFIXES:
        doc = texts.stdlib_document(module)
        ids = tokenizer(doc).input_ids
        if len(ids) < prefix + CONTINUATION:
            raise SystemExit(f"{module}: {len(ids)} tokens, fewer than {prefix + CONTINUATION}")
        docs[module] = {"tokens": len(ids), "sha256_16": texts.fingerprint(doc)}
        t = time.perf_counter()
        rows += measure_prefix(model, ids, prefix, vs)
        print(f"  {module:14s} prefix {prefix:5d}: {time.perf_counter() - t:5.1f} s", flush=True)
    summary = summarize(rows, vs)
    cols = ["codec", "group", "bits/elem", "KL mean", "KL max", "top-1 %", "ppl recomputed", "ppl reused",
            "ppl Δ %", "greedy match %", "greedy same-prefix"]
    seconds = time.perf_counter() - t0
    payload = {
        "model": smollm2.MODEL_ID, "layout": layout.to_dict(), "continuation": CONTINUATION, "greedy": GREEDY,
        "documents": docs, "threads": torch.get_num_threads(), "seconds": seconds,
        "summary": summary, "rows": rows,
    }
    path = write_json("quality", payload, args.out)
    print(f"wrote {path}")
    redraw(plot, path)
    n = len(QUICK if args.quick else PREFIXES)
    print(table(summary, cols, f"Reused vs recomputed prefix KV, SmolLM2-135M fp32, {n} prefixes of 512-2048 "
                               f"tokens, {CONTINUATION}-token continuation, {GREEDY} greedy tokens ({seconds:.0f} s)"))


if __name__ == "__main__":
    main()
