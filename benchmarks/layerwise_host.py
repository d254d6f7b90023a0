"""Host time of a layer-wise load before the consumer can start: what ``materialize(...,
layerwise=True)`` costs the calling thread until it returns the handle, and until layer 0
is ready, against the contiguous ``materialize`` (on a GPU that host time is the gap
between the load's start and the forward's first layer; see docs/engine.md).

Llama-3-8B KV layout (32 layers, 8 KV heads, head dim 128, bf16), KIVI int4 (group 32),
blocks of 256 tokens in the CPU tier. Runs on a CPU (the host-side Python and torch calls
are the same code as on a GPU, where the copies and decodes are queued instead of run):

    python -m benchmarks.layerwise_host --blocks 64 --repeats 7 [--profile] [--decode]

On a CPU the copies are memcpys (on a GPU, queued), so the handle's time here includes the
bytes of group 0 moved; ``issue per group`` times what issuing one layer group costs the
thread that issues it with the byte moves and decodes stubbed out (the cutting of views and
building of the copy lists, the host work a GPU pays per group besides the copy launches).
``--decode`` also times layer 0 ready and the contiguous materialize (slow on a CPU).

In-run baseline: a plain copy of the load's stored bytes (the int4 payloads of its frames,
as one buffer) onto the device: from pinned memory on a GPU, a memcpy on a CPU. Every load
of these frames moves at least those bytes before its consumer has all of its layers, and
the copy is cheap on both (unlike the contiguous materialize on a CPU, which decodes on the
calling thread), so every run has it. ``vs_copy`` is a row's ms over the copy's: the
handle's row says what share of merely moving the load's bytes the consumer waits before it
can start. With ``--decode``, ``vs_contiguous`` is a row's ms over the contiguous
materialize's (all layers ready), measured in the same run. The table and JSON
(``layerwise_host.json`` in ``--out``) hold the rows; the lines per group follow.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from pathlib import Path
from unittest import mock

import torch

import cacheseek as cs
from cacheseek import layerwise

from .report import table, write_json

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


def issue_per_group(cache: cs.PrefixCache, toks: list[int], device: torch.device,
                    repeats: int) -> list[tuple[tuple[int, int], float]]:
    """Median ms of ``run_group(g)`` per group, with the byte moves and decodes stubbed out."""
    hashes = cache.block_hashes(toks)
    times: dict[int, list[float]] = {}
    noop = staticmethod(lambda dst, src: None)
    with mock.patch.object(layerwise.LayerwiseDecoder, "_copy_list", noop), \
            mock.patch.object(layerwise.LayerwiseDecoder, "_decode_layers", lambda *a, **k: None):
        for _ in range(repeats):
            decoder, _ = layerwise.load(cache.block_format, cache.store, [(hashes, cache.store.locate(hashes))], device)
            for g in range(len(decoder.groups)):
                t0 = time.perf_counter()
                decoder.run_group(g)
                times.setdefault(g, []).append((time.perf_counter() - t0) * 1e3)
            decoder.release_all()
    return [(decoder.groups[g], statistics.median(ms)) for g, ms in sorted(times.items())]


def cut_per_load(cache: cs.PrefixCache, toks: list[int], device: torch.device,
                 repeats: int) -> tuple[float, float]:
    """Median ms to cut the views of every frame of the load, as the GPU path does: into the
    pieces of every layer group (what ``add`` did per frame before its handle could be
    returned), and into group 0's only (what it does now; the rest is cut by the issuer)."""
    from cacheseek.store.device import as_host_tensor

    hashes = cache.block_hashes(toks)
    got = [g for g in cache.store.get_many(hashes)]
    frames = [frame for frame, _ in got]
    decoder = layerwise.LayerwiseDecoder(cache.block_format, len(frames), device,
                                         layerwise.layer_groups(LAYOUT.num_layers))
    decoder._start(frames[0].meta)
    decoder._plan_pieces(frames[0].meta)
    nbytes = frames[0].meta.payload_nbytes
    rows = [(decoder._staging[j], as_host_tensor(f.payload_view())[:nbytes]) for j, f in enumerate(frames)]
    L, entries = LAYOUT.num_layers, frames[0].meta.tensors
    starts = {e.offset + l0 * (e.nbytes // L) for e in entries for l0, _ in decoder.groups} | {
        e.offset + e.nbytes for e in entries}
    every = sorted(starts - {0})  # the cuts into every group's pieces (what add made per frame before)
    index = {c: i + 1 for i, c in enumerate(every)} | {0: 0}
    idx0 = [index[e.offset] for e in entries]
    cuts0, first = decoder._plans[0]

    def every_group() -> None:
        for dst, src in rows:
            d, s = dst.tensor_split(every), src.tensor_split(every)
            [d[i] for i in idx0], [s[i] for i in idx0]

    def group_0() -> None:  # the staging's side is cut once per load (as _plan_pieces does), not per frame
        cols = decoder._staging.tensor_split(cuts0, dim=1)
        first_dst = [cols[i].unbind(0) for i in first]
        for j, (_, src) in enumerate(rows):
            s = src.tensor_split(cuts0)
            [r[j] for r in first_dst], [s[i] for i in first]

    out = (time_ms(every_group, repeats)[0], time_ms(group_0, repeats)[0])
    for frame in frames:
        frame.release()
    decoder.release_all()  # its staging (leased at _start)
    return out


def copy_ms(cache: cs.PrefixCache, toks: list[int], device: torch.device, repeats: int) -> tuple[float, int]:
    """Median ms of one plain copy of the load's stored payload bytes onto ``device`` (pinned
    on a GPU), and that byte count: the baseline."""
    got = cache.store.get_many(cache.block_hashes(toks))
    nbytes = sum(frame.meta.payload_nbytes for frame, _ in got)
    for frame, _ in got:
        frame.release()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)  # touched: the copy must not meet pages mapped on first use
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    copy()  # warm-up
    return time_ms(copy, repeats)[0], nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="cProfile of the call until the handle")
    ap.add_argument("--decode", action="store_true", help="also time layer 0 ready and the contiguous load")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default benchmarks/results)")
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

    def discard() -> None:
        """Give the loads' memory back without decoding the rest (slow on a CPU)."""
        for load in loads:
            load._closed = True
            if load._decoder is not None:
                load._decoder.release_all()
        loads.clear()

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
    handle_all = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        handle_all.append(time_ms(handle, 1)[0])
        discard()
    handle_all = handle_all[1:]
    handle_ms = statistics.median(handle_all)
    stubbed = []
    with mock.patch.object(layerwise.LayerwiseDecoder, "_copy_list", staticmethod(lambda dst, src: None)):
        for _ in range(args.repeats + 1):
            stubbed.append(time_ms(handle, 1)[0])
            discard()
    stubbed_ms = statistics.median(stubbed[1:])
    issue = issue_per_group(cache, toks[:n], device, args.repeats)
    cut_all, cut_first = cut_per_load(cache, toks[:n], device, args.repeats)
    base_ms, base_bytes = copy_ms(cache, toks[:n], device, args.repeats)
    rows = [
        {"step": "block_hashes", "ms": hashes_ms},
        {"step": "locate", "ms": locate_ms},
        {"step": "materialize(layerwise) -> handle", "ms": handle_ms, "runs_ms": handle_all},
        {"step": "... with the byte moves stubbed", "ms": stubbed_ms},
        {"step": f"cut views of {args.blocks} frames: every group", "ms": cut_all},
        {"step": f"cut views of {args.blocks} frames: group 0 only", "ms": cut_first},
    ]
    if args.decode:
        first_ms, _ = time_ms(first_layer, args.repeats)
        contiguous_ms, _ = time_ms(contiguous, max(1, args.repeats // 2))
        rows += [{"step": "... -> layer 0 ready (wait(0))", "ms": first_ms},
                 {"step": "materialize (contiguous, all layers)", "ms": contiguous_ms}]
    rows.append({"step": f"baseline: plain copy of the load's {base_bytes / 1e6:.1f} MB", "ms": base_ms})
    for row in rows:
        row["vs_copy"] = row["ms"] / base_ms
        if args.decode:
            row["vs_contiguous"] = row["ms"] / contiguous_ms
    path = write_json("layerwise_host", {
        "device": str(device), "blocks": args.blocks, "tokens": n, "codec": "int4", "repeats": args.repeats,
        "baseline": {"kind": "pinned copy" if device.type == "cuda" else "memcpy", "bytes": base_bytes,
                     "ms": base_ms},
        "rows": rows, "issue_per_group": [{"layers": list(g), "ms": ms} for g, ms in issue]}, args.out)
    print(f"wrote {path}")
    print(table(rows, ["step", "ms", "vs_copy"] + (["vs_contiguous"] if args.decode else []),
                f"device {device}, {args.blocks} blocks of {BLOCK} tokens ({n} tokens), int4, CPU tier; "
                f"median of {args.repeats} (ms); vs_copy: over the plain copy of the same bytes, same run"))
    print(f"  handle runs: {', '.join(f'{x:.1f}' for x in handle_all)}")
    print("  issue per group, copies and decodes stubbed (group: layers, ms):")
    for (l0, l1), ms in issue:
        print(f"      [{l0:2d}, {l1:2d})  {ms:7.3f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        loads.append(cache.materialize(toks, device=device, max_tokens=n, layerwise=True))
        prof.disable()
        discard()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
