"""The vLLM connector's own data path, without vLLM: saves from and loads into pages laid
out as vLLM 0.32's FLASH_ATTN keeps them, against a plain copy of those pages.

    python -m benchmarks.vllm_pages [--tokens 4096,16384] [--codecs raw,int4] [--reps 5]

vLLM cannot be installed on the H200 machine (its wheel is larger than what travels
there), so this drives the connector's worker side (``WorkerSide.save`` / ``.load``, the
code ``CacheSeekConnector.wait_for_save`` and ``start_load_kv`` run) on synthetic pages:
Llama-3-8B shape (32 layers, 8 KV heads, head dim 128, bf16), vLLM blocks of 16 tokens,
one ``[P, 16, 8, 256]`` tensor per layer (LBNHC: K and V side by side per token and head),
the request's blocks scattered over twice as many pages. Each call stores a fresh prompt
(nothing of it is stored yet), into an embedded cache's pinned CPU tier.

Rows (GB/s of raw KV represented):
- ``connector save`` / ``connector load``: the connector's path. Until the engine surface's
  paged ingest and ``materialize_into`` land, it gathers the pages into contiguous
  ``[H, T, D]`` tensors before ``ingest`` and scatters ``materialize``'s result into the
  pages after it (the stopgap in integrations/vllm/pages.py).
- ``contiguous ingest`` / ``contiguous materialize``: the same KV already contiguous: what
  the stopgap's gather and scatter add is the difference.
- baseline, measured in the same run: a plain copy of the request's pages to pinned host
  memory and back (a page gather plus one D2H copy; one H2D copy plus a page scatter),
  what a connector that moves bf16 pages unencoded does at best.
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import count
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.integrations.vllm.config import ConnectorConfig
from cacheseek.integrations.vllm.guard import StoreGuard
from cacheseek.integrations.vllm.pages import PageFormat, VllmPages
from cacheseek.integrations.vllm.plan import LoadSpec, SaveSpec
from cacheseek.integrations.vllm.worker import WorkerSide

from .report import table, write_json

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
STORE_BLOCK = 256
CODECS = {"raw": cs.Raw(), "int8": cs.KIVI(bits=8, group_size=32), "int4": cs.KIVI(bits=4, group_size=32),
          "int2": cs.KIVI(bits=2, group_size=32)}
_prompts = count(1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    times = []
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flash_pages(num_pages: int, layers: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Per layer, vLLM's logical ``[P, H, N, 2D]`` view of an LBNHC ``[P, N, H, 2D]`` tensor."""
    return [torch.randn(num_pages, PAGE, HEADS, 2 * HEAD_DIM, dtype=dtype, device=device).transpose(1, 2)
            for _ in range(layers)]


def fresh_prompt(tokens: int) -> list[int]:
    n = next(_prompts)
    return [(n * 7919 + i) % 50000 for i in range(tokens)]


def run(tokens: int, codec_name: str, reps: int, device: torch.device, layers: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = cs.KVLayout(num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype)
    blocks = tokens // PAGE
    g = torch.Generator().manual_seed(tokens)
    block_ids = torch.randperm(2 * blocks, generator=g)[:blocks].tolist()  # vLLM blocks == pages here
    pages = VllmPages(flash_pages(2 * blocks, layers, dtype, device), PageFormat("channel", HEAD_DIM, PAGE, PAGE))
    raw_bytes = layout.raw_nbytes(tokens)
    budget = max(4 * raw_bytes, 1 << 30)
    cache = cs.PrefixCache(model_id="bench", layout=layout, codec=CODECS[codec_name], block_tokens=STORE_BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=budget))
    side = WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({}), "worker"))
    side.register(pages)
    rows = []

    def row(what: str, seconds: float) -> None:
        rows.append({"tokens": tokens, "codec": codec_name, "path": what, "ms": seconds * 1e3,
                     "gbps": raw_bytes / seconds / 1e9})

    row("connector save", timed(lambda: side.save(SaveSpec("r", fresh_prompt(tokens), block_ids)), reps, device))
    stored = fresh_prompt(tokens)
    side.save(SaveSpec("r", stored, block_ids))
    row("connector load", timed(lambda: side.load(LoadSpec("r", stored, block_ids, start=0)), reps, device))
    if side.stats.save_failures or side.stats.load_failures:
        raise RuntimeError(f"the connector failed a save or a load: {side.stats.to_dict()}")

    def materialize() -> None:
        if cache.materialize(stored, device=device).num_tokens != tokens:
            raise RuntimeError("the stored prefix was evicted during the run: give the CPU tier more room")

    row("contiguous materialize", timed(materialize, reps, device))
    contiguous = pages.gather(pages.slots(block_ids, 0, tokens))
    row("contiguous ingest", timed(lambda: cache.ingest(fresh_prompt(tokens), contiguous), reps, device))
    del contiguous
    cache.close()

    # Baseline: the request's pages, as they are, to pinned host memory and back.
    index = torch.as_tensor(block_ids, device=device)
    pin = device.type == "cuda"
    host = [torch.empty((blocks, PAGE, HEADS, 2 * HEAD_DIM), dtype=dtype, pin_memory=pin) for _ in range(layers)]
    physical = [t.transpose(1, 2) for t in flash_pages(2 * blocks, layers, dtype, device)]

    def d2h() -> None:
        for h, t in zip(host, physical):
            h.copy_(t.index_select(0, index), non_blocking=True)

    def h2d() -> None:
        for h, t in zip(host, physical):
            t.index_copy_(0, index, h.to(device, non_blocking=True))

    row("baseline page copy D2H", timed(d2h, reps, device))
    row("baseline page copy H2D", timed(h2d, reps, device))
    base = {"save": rows[-2]["gbps"], "load": rows[-1]["gbps"]}
    for r in rows:
        kind = "load" if any(w in r["path"] for w in ("load", "materialize", "H2D")) else "save"
        r["vs_baseline"] = r["gbps"] / base[kind]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384", help="prefix lengths (multiples of 256)")
    ap.add_argument("--codecs", default="raw,int4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LAYERS, help="fewer for a quick run on a CPU")
    ap.add_argument("--out", default=None, help="folder for vllm_pages.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        if tokens % STORE_BLOCK:
            raise SystemExit(f"--tokens: {tokens} is not a multiple of {STORE_BLOCK}")
        for codec in args.codecs.split(","):
            rows += run(tokens, codec, args.reps, device, args.layers)
    print(table(rows, ["tokens", "codec", "path", "ms", "gbps", "vs_baseline"],
                title=f"vLLM connector data path on {device} ({args.layers} layers x {HEADS} heads x {HEAD_DIM}, "
                      f"pages of {PAGE} tokens, flash layout); GB/s of raw KV"))
    path = write_json("vllm_pages", {"device": str(device), "layers": args.layers, "rows": rows},
                      None if args.out is None else Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
