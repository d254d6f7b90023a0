"""Host time of a layer-wise load before the consumer can start: what ``materialize(...,
layerwise=True)`` costs the calling thread until it returns the handle, and until layer 0
is ready, against the contiguous ``materialize`` (on a GPU that host time is the gap
between the load's start and the forward's first layer; see docs/engine.md).

Llama-3-8B KV layout (32 layers, 8 KV heads, head dim 128, bf16), KIVI int4 (group 32),
blocks of 256 tokens in the CPU tier. Runs on a CPU (the host-side Python and torch calls
are the same code as on a GPU, where the copies and decodes are queued instead of run):

    python -m benchmarks.layerwise_host --blocks 64 --repeats 7 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import cacheseek as cs

LAYOUT = cs.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
BLOCK = 256


def build(blocks: int, device: str) -> tuple[cs.PrefixCache, list[int]]:
    codec = cs.KIVI(bits=4, group_size=32)
    T = blocks * BLOCK
    budget = int(codec.encoded_nbytes(LAYOUT, T) * 1.2) + (64 << 20)
    cache = cs.PrefixCache(model_id="lw-host", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=budget, pin_memory=device == "cuda"))
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 128_000, (T + 1,), generator=gen).tolist()
    # One block's KV repeated: the bytes do not matter here, the layout does (and it is quick).
    one = [(torch.randn(1, LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim, generator=gen).to(LAYOUT.torch_dtype),
            torch.randn(1, LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim, generator=gen).to(LAYOUT.torch_dtype))
           for _ in range(LAYOUT.num_layers)]
    kv = [(k.repeat(1, 1, blocks, 1).to(device), v.repeat(1, 1, blocks, 1).to(device)) for k, v in one]
    got = cache.ingest(toks[:T], kv)
    assert got.stored == blocks, got
    return cache, toks


def time_ms(fn, repeats: int) -> tuple[float, list[float]]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="cProfile of the call until the handle")
    args = ap.parse_args()
    device = torch.device(args.device)
    cache, toks = build(args.blocks, args.device)
    n = args.blocks * BLOCK

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loads: list = []

    def handle() -> None:
        loads.append(cache.materialize(toks, device=device, max_tokens=n, layerwise=True))

    def first_layer() -> None:
        with cache.materialize(toks, device=device, max_tokens=n, layerwise=True) as load:
            load.wait(0)
            loads.append(load)
            sync()

    def contiguous() -> None:
        cache.materialize(toks, device=device, max_tokens=n)
        sync()

    hashes_ms, _ = time_ms(lambda: cache.block_hashes(toks[:n]), args.repeats)
    locate_ms, _ = time_ms(lambda: cache.locate(toks[:n]), args.repeats)
    first_layer()  # warm-up (allocator, first decode)
    for load in loads:
        load.close()
    loads.clear()
    handle_ms, handle_all = time_ms(handle, args.repeats)
    for load in loads:
        load.close()
    loads.clear()
    first_ms, _ = time_ms(first_layer, args.repeats)
    loads.clear()
    contiguous_ms, _ = time_ms(contiguous, max(1, args.repeats // 2))
    print(f"device {device}, {args.blocks} blocks of {BLOCK} tokens ({n} tokens), int4, CPU tier; "
          f"median of {args.repeats} (ms)")
    print(f"  block_hashes                         {hashes_ms:8.2f}")
    print(f"  locate                               {locate_ms:8.2f}")
    print(f"  materialize(layerwise) -> handle     {handle_ms:8.2f}   (runs: {', '.join(f'{x:.1f}' for x in handle_all)})")
    print(f"  ... -> layer 0 ready (wait(0))       {first_ms:8.2f}")
    print(f"  materialize (contiguous, all layers) {contiguous_ms:8.2f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        load = cache.materialize(toks, device=device, max_tokens=n, layerwise=True)
        prof.disable()
        load.close()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
