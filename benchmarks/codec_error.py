"""Reconstruction error and compression of KIVI for each bits x group size.

    python -m benchmarks.codec_error [--tokens 1024] [--out DIR]
    python -m benchmarks.codec_error --plot-only benchmarks/results/codec_error.json --out docs

Data: Gaussian K/V, and K with outlier channels (4 of 128 channels scaled x15, as real
keys have). Error is ||x - x_hat|| / ||x|| over the whole tensor. The in-run baseline is the
same quantizer applied to K per token (V's grouping) instead of per channel: the ratio
column shows what KIVI's per-channel keys buy on outlier data.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.quant import kivi_reference as ref
from cacheseek.quant.payload import AXIS_CHANNELS

from .report import add_plot_only, bars, legend_outside, plot_only, pyplot, redraw, save, source_line, table, write_json


def _data(kind: str, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(8, tokens, 128, generator=gen)
    v = torch.randn(8, tokens, 128, generator=gen)
    if kind == "outlier":
        k[..., [3, 17, 90, 111]] *= 15
    return k.to(torch.float16), v.to(torch.float16)


def _rel(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return ((x.float() - x_hat.float()).norm() / x.float().norm()).item()


def run(tokens: int) -> list[dict]:
    layout = cs.KVLayout(1, 8, 128, "float16")
    rows = []
    for kind in ("gaussian", "outlier"):
        k, v = _data(kind, tokens)
        for bits in (8, 4, 2):
            for group in (32, 64, 128):
                codec = cs.KIVI(bits=bits, group_size=group)
                k_hat, v_hat = codec.decode(codec.encode(k, v))
                q, s, m = ref.quantize(k, bits=bits, group=group, axis=AXIS_CHANNELS, stats_dtype=torch.float16)
                k_tok = ref.dequantize(q, s, m, bits=bits, group=group, axis=AXIS_CHANNELS, shape=k.shape, dtype=k.dtype)
                rows.append({
                    "data": kind, "bits": bits, "group": group,
                    "k_err": _rel(k, k_hat), "v_err": _rel(v, v_hat),
                    "k_err_per_token": _rel(k, k_tok),
                    "k_vs_per_token": _rel(k, k_hat) / _rel(k, k_tok),
                    "compression": layout.raw_nbytes(tokens) / codec.encoded_nbytes(layout, tokens),
                })
    return rows


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """Relative error of K and V per bits x group, on Gaussian and on outlier-channel data,
    beside K grouped per token (the in-run baseline)."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), sharey=True)
    for ax, kind, title in zip(axes, ("gaussian", "outlier"), ("Gaussian K and V", "K with 4 outlier channels (x15)")):
        rows = [r for r in doc["rows"] if r["data"] == kind]
        bars(ax, [f"int{r['bits']} G{r['group']} ({r['compression']:.1f}x)" for r in rows],
             {"K, per channel (KIVI)": [r["k_err"] for r in rows],
              "V, per token (KIVI)": [r["v_err"] for r in rows],
              "K grouped per token (baseline)": [r["k_err_per_token"] for r in rows]},
             fmt="{:.2g}", colors=["tab:blue", "tab:orange", "0.6"], log=True)
        ax.set_title(title)
        ax.set_xlabel("bits, group size G (compression vs fp16)")
    axes[0].set_ylabel("relative error ||x - x_hat|| / ||x|| (log)")
    legend_outside(axes[1])
    return save(fig, out_dir, "codec_error", note=source_line(doc),
                title=f"KIVI reconstruction error, fp16 stats: 8 heads x {doc['tokens']} tokens x 128 channels "
                      "(torch reference)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    rows = run(args.tokens)
    cols = ["data", "bits", "group", "k_err", "v_err", "k_err_per_token", "k_vs_per_token", "compression"]
    print(table(rows, cols, "KIVI reconstruction error ||x - x_hat|| / ||x|| (fp16 stats)"))
    path = write_json("codec_error", {"tokens": args.tokens, "rows": rows}, args.out)
    print(f"wrote {path}")
    redraw(plot, path)


if __name__ == "__main__":
    main()
