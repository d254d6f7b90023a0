"""The suffix forward's host time: ``cacheseek_sdpa`` calling the flash kernel directly,
against the same attention through ``causal_lower_right`` (torch's bias object, which
dispatches to the same kernel), interleaved call by call in one process.

    python -m benchmarks.suffix_attention [--contexts 16384,32768] [--rounds 15] [--out DIR]

A Llama-3-8B-shaped model (random weights, bf16, as in ``benchmarks.ttft``) runs a 256-token
suffix over a past of ``context - 256`` random cached tokens. A forward this small is bound by
the host's Python launches (docs/engine.md), so what a layer's attention costs the host is
on the path to the first token. Reported per context and path: the host time until the
forward returns, and until the device is done (medians over ``--rounds``, after two
warm-ups), with the direct path over the bias path as a ratio; also the attention alone
(32 calls over one layer's K and V). The logits of both paths must be equal bit for bit.
Needs CUDA (the flash kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from cacheseek.integrations import suffix_attention
from cacheseek.integrations.transformers import forward, to_dynamic_cache

from .report import table, write_json
from .ttft import LLAMA3_8B, SUFFIX, build_model

PATHS = ("bias", "direct")


def _path(name: str) -> mock._patch | None:
    """The bias path: ``_flash_direct`` says no, so the attention builds the bias object."""
    return mock.patch.object(suffix_attention, "_flash_direct", lambda *a: False) if name == "bias" else None


def _timed(fn, name: str) -> tuple[float, float, object]:
    patch = _path(name)
    if patch is not None:
        patch.start()
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3, out
    finally:
        if patch is not None:
            patch.stop()


def run_context(model, context: int, rounds: int, gen: torch.Generator) -> list[dict]:
    cfg, dev = model.config, torch.device("cuda")
    past = context - SUFFIX
    shape = (1, cfg.num_key_value_heads, past, cfg.head_dim)
    layers = [(torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16),
               torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16))
              for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(0, cfg.vocab_size, (1, SUFFIX), generator=gen, device=dev)
    q = torch.randn(1, cfg.num_attention_heads, SUFFIX, cfg.head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    k = torch.cat([layers[0][0], layers[0][0][:, :, :SUFFIX]], dim=2)
    v = torch.cat([layers[0][1], layers[0][1][:, :, :SUFFIX]], dim=2)
    module = model.model.layers[0].self_attn

    def attention() -> torch.Tensor:
        for _ in range(cfg.num_hidden_layers):
            out = suffix_attention._attention(module, q, k, v, None, scaling=cfg.head_dim ** -0.5)[0]
        return out

    host = {(what, p): [] for what in ("forward", "attention") for p in PATHS}
    total = {key: [] for key in host}
    outs = {}
    for r in range(rounds + 2):
        for what in ("forward", "attention"):
            for p in (PATHS if r % 2 else PATHS[::-1]):
                if what == "forward":  # the same cached past every time, copied outside the timing
                    cache = to_dynamic_cache(layers)
                    fn = lambda: forward(model, ids, cache, last_only=True)[0]  # noqa: E731
                else:
                    fn = attention
                h, t, out = _timed(fn, p)
                if r == 0:
                    outs[(what, p)] = out
                if r >= 2:
                    host[(what, p)].append(h)
                    total[(what, p)].append(t)
        if r == 0:
            for what in ("forward", "attention"):
                if not torch.equal(outs[(what, "bias")], outs[(what, "direct")]):
                    raise SystemExit(f"{context} tokens, {what}: the direct call's output differs from the bias path's")
            outs.clear()
    rows = []
    for what in ("forward", "attention"):
        med = {p: (statistics.median(host[(what, p)]), statistics.median(total[(what, p)])) for p in PATHS}
        for p in PATHS:
            rows.append({"context": context, "what": what if what == "forward" else "attention x32", "path": p,
                         "host_ms": med[p][0], "total_ms": med[p][1],
                         "host_vs_bias": med[p][0] / med["bias"][0], "total_vs_bias": med[p][1] / med["bias"][1]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="16384,32768")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.suffix_attention needs CUDA (the flash kernel)")
    model = build_model(LLAMA3_8B, torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        rows += run_context(model, context, args.rounds, gen)
    print(table(rows, ["context", "what", "path", "host_ms", "total_ms", "host_vs_bias", "total_vs_bias"],
                f"{SUFFIX}-token suffix, Llama-3-8B shape, bf16: direct flash call vs causal_lower_right, "
                f"interleaved, median of {args.rounds}"))
    path = write_json("suffix_attention", {"model": "llama3-8b-shape (random)", "suffix": SUFFIX,
                                           "rounds": args.rounds, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
