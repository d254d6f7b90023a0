"""Layer-wise saves against a whole ingest after the forward: what a save adds to a prefill.

    python -m benchmarks.layerwise_save [--tokens 4096,16384] [--codecs int4,raw] [--reps 6] [--out DIR]
    python -m benchmarks.layerwise_save --paged    # the same from vLLM's pages (ingest_batch(..., layerwise=True))
    python -m benchmarks.layerwise_save --tiny     # a smoke run (CPU or GPU, seconds)

A stand-in forward of a Llama-3-8B-shaped model runs on the GPU: per layer, bf16 GEMMs
(8192 x 8192) for as long as a real layer's prefill takes at that length (3.8 ms at 4K
and 18.5 ms at 16K on the H200: the full prefill of ``benchmarks/ttft.py`` over 32 layers,
``--layer-ms`` to change it). They hold the SMs as a forward does, so the save's kernels
compete with it. The prompt's KV is fresh (cloned before the clock) and new to a full CPU
tier (every call evicts; its reserve holds one call, as in ``benchmarks/store.py --fresh``).
Three cases, interleaved call by call, medians:

- ``forward``: the stand-in forward alone;
- ``whole``: the forward, then ``cache.ingest`` of every layer (what a save costs today
  without a layer-wise writer: the encode and copies of the whole prompt after the forward);
- ``layerwise p=N``: ``cache.ingest_layerwise`` (its store launches of N programs): ``put_layer(i)`` after layer ``i``'s GEMMs are
  queued (its encode and copies then overlap the layers after it), ``finish()`` after the
  forward.

``--paged``: the KV is in vLLM's flash pages (pages of 16 tokens in a random order), one
request per call: ``ingest_batch`` after the forward against ``ingest_batch(...,
layerwise=True)`` fed ``put_layer(i)``, as the vLLM connector's ``save_kv_layer`` does.

Per case: the forward's device time (start to its last GEMM, from events) and the call's
time to return (host, after a sync). ``save_ms`` = a case's time to return less the
forward-only case's: what the save adds to the prefill. ``overlap_gain`` = the whole
ingest's save_ms / the layer-wise one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek import layerwise_save

from . import store_engine as se
from .report import table, write_json

LAYER_MS = {4096: 3.8, 16384: 18.5}  # a Llama-3-8B layer's prefill on the H200 (ttft.json / 32 layers)
GEMM = 8192
TINY_GEMM = 128  # the stand-in's GEMMs on a CPU (--tiny): 8192 squared would take seconds each


class StandIn:
    """A forward of ``layers`` layers, each ``reps`` GEMMs (bf16 of ``size`` squared), on
    the current stream."""

    def __init__(self, device: torch.device, layer_ms: float, size: int = GEMM) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.out = torch.empty_like(self.a)
        torch.matmul(self.a, self.a, out=self.out)
        with Span(device) as span:
            for _ in range(10):
                torch.matmul(self.a, self.a, out=self.out)
        self.gemm_ms = span.ms() / 10
        self.reps = max(1, round(layer_ms / self.gemm_ms))

    def layer(self) -> None:
        for _ in range(self.reps):
            torch.matmul(self.a, self.a, out=self.out)


class Span:
    """The device time between entering and leaving (CUDA events on a GPU; on a CPU, where
    the work is done when its call returns, the host's clock)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def __enter__(self) -> "Span":
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: str, cache, prompt, kv, forward: StandIn, pages=None) -> dict:
    """One call: ``kv`` per layer, or with ``pages`` = (KVPages, page ids) the same KV in
    an engine's pages."""
    if case.startswith("layerwise"):
        layerwise_save.STORE_PROGRAMS = int(case.partition("p=")[2] or layerwise_save.STORE_PROGRAMS)
    device = forward.a.device
    requests = None if pages is None else [cs.PagedRequest(prompt, pages[1])]
    sync(device)
    t = time.perf_counter()
    writer, result = None, None
    put_s = 0.0
    with Span(device) as span:
        if case.startswith("layerwise"):
            writer = cache.ingest_layerwise(prompt) if pages is None else \
                cache.ingest_batch(requests, pages[0], layerwise=True)
        for i, (k, v) in enumerate(kv):
            forward.layer()
            if writer is not None:
                p = time.perf_counter()
                if pages is None:
                    writer.put_layer(i, k, v)
                else:
                    writer.put_layer(i)  # the layer is in the pages already (the forward wrote it)
                put_s += time.perf_counter() - p
    mode = None
    if writer is not None:
        mode = writer.mode
        result = writer.finish()
    elif case == "whole":
        result = cache.ingest(prompt, kv) if pages is None else cache.ingest_batch(requests, pages[0])
    sync(device)
    total = time.perf_counter() - t
    if isinstance(result, list):  # ingest_batch's, of its one request
        result = result[0]
    if result is not None and result.stored != len(kv[0][0][0]) // cache.block_tokens:
        raise RuntimeError(f"{case}: stored {result.stored} blocks: {result}")
    return {"total_ms": total * 1e3, "forward_ms": span.ms(), "put_ms": put_s * 1e3, "mode": mode}


def measure(shape: se.Shape, tokens: int, codec: str, reps: int, layer_ms: float, device: torch.device,
            programs: list[int], paged: bool = False) -> list[dict]:
    blocks = tokens // shape.block
    template = shape.kv(tokens, device)
    forward = StandIn(device, layer_ms, GEMM if device.type == "cuda" else TINY_GEMM)
    pages = None
    if paged:
        num_pages = tokens // shape.page
        kv_pages, _ = se.vllm_pages(shape, num_pages, device)
        ids = se.scattered_ids(num_pages, seed=tokens)
        se.fill_pages(kv_pages, template, ids)
        pages = (kv_pages, ids)
    cache = se.make_cache(shape, codec, blocks)
    prompts = se.Prompts(tokens)
    for _ in range(4):  # fill the tier: every measured call evicts
        cache.ingest(prompts(), template)
    cases = ("forward", "whole", *(f"layerwise p={p}" for p in programs))
    got: dict[str, list[dict]] = {c: [] for c in cases}
    for i in range(reps + 1):
        for case in cases if i % 2 else reversed(cases):
            kv = [(k.clone(), v.clone()) for k, v in template]  # a forward's fresh KV
            row = run_case(case, cache, prompts(), kv, forward, pages)
            if i:
                got[case].append(row)
            del kv
    cache.close()
    base = statistics.median(r["total_ms"] for r in got["forward"])
    rows = []
    for case in cases:
        total = statistics.median(r["total_ms"] for r in got[case])
        rows.append({"tokens": tokens, "codec": codec, "kv": "vllm pages" if paged else "layers", "case": case, "mode": got[case][0]["mode"] or "",
                     "forward_ms": statistics.median(r["forward_ms"] for r in got[case]), "total_ms": total,
                     "save_ms": total - base, "put_ms": statistics.median(r["put_ms"] for r in got[case]),
                     "ms_each": [round(r["total_ms"], 2) for r in got[case]]})
    for row in rows[2:]:
        row["overlap_gain"] = rows[1]["save_ms"] / row["save_ms"] if row["save_ms"] > 0 else float("inf")
    for r in rows:
        r["layer_ms"], r["gemms_per_layer"], r["gemm_ms"] = layer_ms, forward.reps, forward.gemm_ms
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--codecs", default="int4,raw")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--layer-ms", type=float, default=None, help="stand-in layer time (default: by length, see doc)")
    ap.add_argument("--programs", default=str(layerwise_save.STORE_PROGRAMS),
                    help="programs of the layer-wise store launch, one case each (e.g. 4,16,64)")
    ap.add_argument("--paged", action="store_true", help="the KV in vLLM's pages: ingest_batch(..., layerwise=True)")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: a 2-layer shape, short layers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("needs a CUDA device: the stand-in forward and the save's overlap are GPU work "
                         "(--tiny runs on a CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, token_list = se.LLAMA, [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        shape, token_list, args.reps = se.TINY, [4 * se.TINY.block], 2
        layerwise_save.MIN_SAVE_BYTES = 0  # so small a save would otherwise keep its layers for finish
    rows = []
    for tokens in token_list:
        for codec in args.codecs.split(","):
            layer_ms = args.layer_ms or (0.2 if args.tiny else LAYER_MS.get(tokens, 3.8 * tokens / 4096))
            print(f"{tokens} tokens, {codec}, stand-in layer {layer_ms} ms", flush=True)
            rows += measure(shape, tokens, codec, args.reps, layer_ms, device,
                            [int(p) for p in args.programs.split(",")], args.paged)
    cols = ["tokens", "codec", "kv", "case", "mode", "forward_ms", "total_ms", "save_ms", "put_ms", "overlap_gain"]
    print(table(rows, cols, "\nA prefill's save: whole ingest after the forward vs layer-wise (medians, ms)"))
    for r in rows:
        print(f"  {r['tokens']} {r['codec']} {r['case']}: ms each {r['ms_each']}")
    path = write_json("layerwise_save_paged" if args.paged else "layerwise_save",
                      {"shape": "tiny" if args.tiny else "llama-3-8b", "reps": args.reps, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
