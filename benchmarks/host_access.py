"""A kernel reading or writing pinned host memory in place, against the copy engine.

    python -m benchmarks.host_access [--mb 64,256] [--reps 10] [--out DIR]     # needs CUDA
    python -m benchmarks.host_access --ranges        # also kernels.copy_ranges by its program count

Pinned host memory (the CPU tier's chunks are pinned torch allocations) is mapped into
the device's address space, so a kernel can load from it and store to it directly, with
no staging buffer and no copy launch per piece. Whether that can replace the copies
(the decode reading a CPU-tier frame in place, the encode writing a slot in place) depends
on the bandwidth a kernel's loads and stores reach over the link. This measures it: a
Triton kernel copying between device memory and a pinned host tensor, both directions,
against ``copy_(non_blocking=True)`` of the same bytes in the same run.

``--ranges``: ``kernels.copy_ranges`` reading a layer group's slices of 64 frames (4 slices
of 512 KiB each, as int4 KV of 16K tokens, one layer) at several program counts, against
the copy engine moving the same bytes as one copy; and, for each count, how much it slows
a compute-bound matmul running at the same time on another stream (what a layer-wise load
does to the forward it overlaps with).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .report import table, write_json


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    def run(src: torch.Tensor, dst: torch.Tensor, block: int) -> None:
        n = src.numel()
        copy_words[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)

    return run


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def ranges_rows(reps: int) -> list[dict]:
    from cacheseek import kernels

    frames, slices, piece = 64, 4, 512 << 10
    frame_bytes = slices * piece
    host = [torch.randint(0, 255, (frame_bytes,), dtype=torch.uint8).pin_memory() for _ in range(frames)]
    table_ = torch.tensor([(t.data_ptr(), j) for j, t in enumerate(host)], dtype=torch.int64, device="cuda")
    dst = torch.empty((frames, frame_bytes), dtype=torch.uint8, device="cuda")
    ranges = [(i * piece, piece) for i in range(slices)]
    whole = torch.cat(host).pin_memory()
    flat = dst.view(-1)
    nbytes = frames * frame_bytes
    engine = _time(lambda: flat.copy_(whole, non_blocking=True), reps)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def matmuls() -> None:
        for _ in range(8):
            a @ a

    def matmul_s(before=None) -> float:
        """Seconds of the matmuls on the current stream (device clock), with ``before()``
        queued first on another stream."""
        torch.cuda.synchronize()
        if before is not None:
            with torch.cuda.stream(side):
                before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        matmuls()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    matmul_s()
    alone = min(matmul_s() for _ in range(reps))
    out = []
    for programs in (8, 16, 32, 64, 128, 1 << 20):
        copy = lambda: kernels.copy_ranges(table_, dst, ranges, programs=programs)  # noqa: E731
        t = _time(copy, reps)
        assert torch.equal(dst.view(-1).cpu(), whole), "copy_ranges lost bytes"

        def copies() -> None:
            for _ in range(8):
                copy()

        matmul_s(copies)
        during = min(matmul_s(copies) for _ in range(reps))
        out.append({"programs": programs if programs < 1 << 20 else "one per chunk", "gbps": nbytes / t / 1e9,
                    "vs_engine": engine / t, "matmul_ms_alone": alone * 1e3, "matmul_ms_during": during * 1e3,
                    "matmul_slowdown": during / alone})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="16,64,256")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blocks", default="1024,4096")
    ap.add_argument("--ranges", action="store_true", help="also kernels.copy_ranges by its program count")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    copy = _kernel()
    rows = []
    for mb in (int(m) for m in args.mb.split(",")):
        words = mb * (1 << 20) // 4
        dev = torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device="cuda")
        host = torch.empty(words, dtype=torch.int32, pin_memory=True)
        back = torch.empty_like(dev)
        nbytes = words * 4
        engine_d2h = _time(lambda: host.copy_(dev, non_blocking=True), args.reps)
        engine_h2d = _time(lambda: back.copy_(host, non_blocking=True), args.reps)
        for block in (int(b) for b in args.blocks.split(",")):
            kernel_d2h = _time(lambda: copy(dev, host, block), args.reps)
            assert torch.equal(host, dev.cpu()), "kernel write to pinned host memory lost bytes"
            back.zero_()
            kernel_h2d = _time(lambda: copy(host, back, block), args.reps)
            assert torch.equal(back, dev), "kernel read of pinned host memory lost bytes"
            for direction, kernel, engine in (("device->host", kernel_d2h, engine_d2h),
                                              ("host->device", kernel_h2d, engine_h2d)):
                rows.append({"mb": mb, "block": block, "direction": direction,
                             "kernel_gbps": nbytes / kernel / 1e9, "copy_engine_gbps": nbytes / engine / 1e9,
                             "kernel_vs_engine": engine / kernel})
    print(table(rows, ["mb", "block", "direction", "kernel_gbps", "copy_engine_gbps", "kernel_vs_engine"],
                f"Kernel loads/stores on pinned host memory vs the copy engine ({torch.cuda.get_device_name()})"))
    ranges = ranges_rows(args.reps) if args.ranges else []
    if ranges:
        print(table(ranges, ["programs", "gbps", "vs_engine", "matmul_ms_alone", "matmul_ms_during", "matmul_slowdown"],
                    "kernels.copy_ranges: 64 frames x 4 slices of 512 KiB, by program count"))
    path = write_json("host_access", {"rows": rows, "ranges": ranges, "reps": args.reps}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
