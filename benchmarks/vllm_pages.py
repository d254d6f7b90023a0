"""The vLLM connector's own data path, without vLLM: saves from and loads into pages laid
out as vLLM 0.32's FLASH_ATTN keeps them, against the engine surface's calls and a plain
copy of those pages.

    python -m benchmarks.vllm_pages [--tokens 4096,16384] [--codecs raw,int4] [--requests 1,8] [--reps 5]

vLLM cannot be installed on the H200 machine (its wheel is larger than what travels
there), so this drives the connector's worker side (``WorkerSide.save`` / ``.load``, the
code ``CacheSeekConnector.wait_for_save`` and ``start_load_kv`` run, with one step's plan)
on synthetic pages: Llama-3-8B shape (32 layers, 8 KV heads, head dim 128, bf16), vLLM
blocks of 16 tokens, one ``[P, 16, 8, 256]`` tensor per layer (LBNHC: K and V side by
side per token and head), the requests' blocks scattered over twice as many pages. A step
of ``--requests`` requests splits ``--tokens`` among them; each save stores fresh prompts
(nothing of them is stored yet), into an embedded cache's pinned CPU tier.

Rows (GB/s of raw KV represented):
- ``connector save`` / ``connector load``: the connector's path: one ``ingest_batch`` /
  ``materialize_into_batch`` per step on ``cs.KVPages`` views of the pages, built from the
  step's plan (page tables from vLLM block ids, ``cs.PagedRequest`` per request).
- ``engine ingest_batch`` / ``engine materialize_into_batch``: the same calls made
  directly, page tables ready (what ``benchmarks.store --paged --batches`` measures):
  the connector's own cost is the difference.
- ``connector load layer-wise``: the same load as the connector runs it by default
  (``WorkerSide.start_load``, ``wait_layer`` per layer, ``end_load``), nothing between the
  waits. On a GPU also ``whole load, then forward`` against ``layer-wise load under the
  forward``: a stand-in forward (per layer one matmul through a Llama-3-8B layer's weights
  for a 256-token suffix) after the whole load, or between the layer waits, and
  ``forward alone`` (ms: how much of the load the overlap hides).
- baseline, measured in the same run: a plain copy of the requests' pages to pinned host
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
HIDDEN = 4096  # Llama-3-8B's, for the stand-in forward
SUFFIX = 256  # tokens the stand-in forward computes per layer (the prompt after the loaded prefix)
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


def stand_in_forward(device: torch.device, dtype: torch.dtype, suffix: int = SUFFIX):
    """A decoder layer's compute over a ``suffix``-token prompt tail, per layer: one matmul
    through as many weights as a Llama-3-8B layer has (4096 x 53248, 218M), queued on the
    current stream. The loaded prefix is not computed, so this is what a load can hide."""
    w = torch.randn(HIDDEN, 53248, dtype=dtype, device=device)
    x = torch.randn(suffix, w.shape[0], dtype=dtype, device=device)
    out = torch.empty(suffix, w.shape[1], dtype=dtype, device=device)

    def layer(i: int) -> None:
        torch.matmul(x, w, out=out)

    return layer


def fresh_prompt(tokens: int) -> list[int]:
    n = next(_prompts)
    return [(n * 7919 + i) % 50000 for i in range(tokens)]


def run(tokens: int, codec_name: str, reps: int, device: torch.device, layers: int, requests: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = cs.KVLayout(num_layers=layers, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype)
    per = tokens // requests
    blocks = tokens // PAGE
    g = torch.Generator().manual_seed(tokens)
    perm = torch.randperm(2 * blocks, generator=g)[:blocks].tolist()  # vLLM blocks == pages here
    block_ids = [perm[r * (per // PAGE) : (r + 1) * (per // PAGE)] for r in range(requests)]
    pages = VllmPages(flash_pages(2 * blocks, layers, dtype, device), PageFormat("channel", HEAD_DIM, PAGE, PAGE))
    raw_bytes = layout.raw_nbytes(tokens)
    budget = max(6 * raw_bytes, 1 << 30)
    cache = cs.PrefixCache(model_id="bench", layout=layout, codec=CODECS[codec_name], block_tokens=STORE_BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=budget))
    side = WorkerSide(cache, guard=StoreGuard(ConnectorConfig.from_extra({}), "worker"))
    side.register(pages)
    rows = []

    def row(what: str, seconds: float) -> None:
        rows.append({"tokens": tokens, "requests": requests, "codec": codec_name, "path": what, "ms": seconds * 1e3,
                     "gbps": raw_bytes / seconds / 1e9})

    def saves() -> list[SaveSpec]:
        return [SaveSpec(f"r{r}", fresh_prompt(per), ids) for r, ids in enumerate(block_ids)]

    row("connector save", timed(lambda: side.save(saves()), reps, device))
    stored = saves()
    side.save(stored)
    loads = [LoadSpec(s.req_id, s.token_ids, s.block_ids, start=0) for s in stored]
    row("connector load", timed(lambda: side.load(loads), reps, device))

    def layerwise_load(forward=None) -> None:
        # as in a vLLM step: start_load_kv, each attention layer's wait_for_layer_load (and
        # its compute), wait_for_save closing the load
        side.start_load(loads)
        for i in range(layers):
            side.wait_layer(i)
            if forward is not None:
                forward(i)
        side.end_load()

    row("connector load layer-wise", timed(layerwise_load, reps, device))
    if device.type == "cuda":
        forward = stand_in_forward(device, dtype)

        def whole_then_forward() -> None:
            side.load(loads)
            for i in range(layers):
                forward(i)

        row("forward alone (stand-in)", timed(lambda: [forward(i) for i in range(layers)], reps, device))
        row("whole load, then forward", timed(whole_then_forward, reps, device))
        row("layer-wise load under the forward", timed(lambda: layerwise_load(forward), reps, device))
    if side.stats.save_failures or side.stats.load_failures:
        raise RuntimeError(f"the connector failed a save or a load: {side.stats.to_dict()}")

    tables = [pages.page_table(ids, per) for ids in block_ids]

    def ingest() -> None:
        cache.ingest_batch([cs.PagedRequest(fresh_prompt(per), t) for t in tables], pages.engine)

    def materialize() -> None:
        got = cache.materialize_into_batch([cs.PagedRequest(s.token_ids, t) for s, t in zip(stored, tables)],
                                           pages.engine)
        if sum(x.num_tokens for x in got) != tokens:
            raise RuntimeError("the stored prefix was evicted during the run: give the CPU tier more room")

    row("engine ingest_batch", timed(ingest, reps, device))
    row("engine materialize_into_batch", timed(materialize, reps, device))
    cache.close()

    # Baseline: the requests' pages, as they are, to pinned host memory and back.
    index = torch.as_tensor(perm, device=device)
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
        if "forward" in r["path"]:
            continue  # (ms of a step: a load and a stand-in forward)
        kind = "load" if any(w in r["path"] for w in ("load", "materialize", "H2D")) else "save"
        r["vs_baseline"] = r["gbps"] / base[kind]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384", help="prefix lengths (multiples of 256)")
    ap.add_argument("--codecs", default="raw,int4")
    ap.add_argument("--requests", default="1,8", help="requests per step, splitting --tokens among them")
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
            for requests in (int(n) for n in args.requests.split(",")):
                if tokens % (requests * STORE_BLOCK):
                    raise SystemExit(f"--requests: {tokens} tokens do not split into {requests} whole store blocks")
                rows += run(tokens, codec, args.reps, device, args.layers, requests)
    print(table(rows, ["tokens", "requests", "codec", "path", "ms", "gbps", "vs_baseline"],
                title=f"vLLM connector data path on {device} ({args.layers} layers x {HEADS} heads x {HEAD_DIM}, "
                      f"pages of {PAGE} tokens, flash layout); GB/s of raw KV"))
    path = write_json("vllm_pages", {"device": str(device), "layers": args.layers, "rows": rows},
                      None if args.out is None else Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
