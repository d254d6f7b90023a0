"""Throughput of the Triton KIVI kernels against the memory roofline and the torch reference.

    python -m benchmarks.kernels [--quick] [--sweep] [--out DIR]
    python -m benchmarks.kernels --clip [--out DIR]    # V quantize with the range search (v_clip)
    python -m benchmarks.kernels --rotate [--out DIR]  # KIVI's V rotation (v_rotate): encode/decode cost
    python -m benchmarks.kernels --mixed [--out DIR]   # a precision policy's chain vs the uniform codec's
    python -m benchmarks.kernels --plot-only benchmarks/results/h200/kernels.json --out docs

On CUDA, for K (per-channel groups) and V (per-token groups) of fp16 KV shaped
[32 layers, 8 KV heads, 4096 tokens, 128] (Llama-3-8B, 268 MB), at 2/4/8 bits with G=32
and 4 bits with G=128:

- quantize and dequantize time: CUDA events around each call, median over many calls,
  inputs rotating over 4 distinct sets (>1 GB, well past the 60 MB L2);
- GB/s of raw fp16 KV processed, bytes actually moved (read + write: fp16 values, int32
  codes, stats) and their GB/s, and that as a fraction of the device-to-device copy
  bandwidth measured in the same run (a large ``dst.copy_(src)``, read + write counted);
- the torch reference (``cacheseek.quant.kivi_reference``) on the same data, and the
  speedup;
- one 256-token block [32, 8, 256, 128] (16 MB): per-call latency including the Python
  launch, host time per call, and GPU time per call from a CUDA-graph replay;
- the store's strided case: 16 blocks quantized from a [n, L, H, B, D] view of the KV
  tensor, and dequantized from payloads at a fixed stride in one buffer into such a view.

First it checks the kernels against the reference (outputs poisoned first) and prints
PASS or FAIL. ``--sweep`` also times every candidate launch config (int4, G=32 and 128)
and prints which is fastest. Writes kernels.json (+ kernels.png) to --out; the table
comes last. Without CUDA it runs a tiny interpreter smoke test and exits.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (cacheseek.kernels imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cacheseek import kernels  # noqa: E402
from cacheseek.kernels import configs  # noqa: E402
from cacheseek.kernels import kivi as kk  # noqa: E402
from cacheseek.quant import kivi_reference as ref  # noqa: E402
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS  # noqa: E402

from .report import add_plot_only, bars, legend_outside, plot_only, pyplot, redraw, save, source_line  # noqa: E402
from .report import table, write_json  # noqa: E402

DEVICE = "cuda"
SHAPE = (32, 8, 4096, 128)  # layers, KV heads, tokens, head dim
BLOCK = (32, 8, 256, 128)
N_SETS = 4
F16 = torch.float16
SIDES = {"K": AXIS_TOKENS, "V": AXIS_CHANNELS}
CASES = [(2, 32), (4, 32), (8, 32), (4, 128)]  # (bits, group)


# -- timing ------------------------------------------------------------------------------


def gpu_time(fn: Callable[[int], Any], *, reps: int, warmup: int = 3, n_sets: int = N_SETS) -> float:
    """Median seconds of one ``fn(i)`` call (i rotates over the input sets), CUDA events."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i % n_sets)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(nbytes // 2, dtype=F16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    t = gpu_time(lambda i: dst.copy_(src), reps=reps, n_sets=1)
    del src, dst
    return 2 * nbytes / t


def _poison_allocator(nbytes: int) -> None:
    # The caching allocator hands freed blocks back out: fill one first, so an output
    # element the kernel fails to write shows up as 0xFF bytes (NaN, -1), not a lucky 0.
    torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).fill_(0xFF)


# -- correctness -------------------------------------------------------------------------


def check_correctness(device: str, shape: tuple[int, ...]) -> list[str]:
    """Kernels vs reference on ``shape``; returns the failures (empty: PASS)."""
    failures = []
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    x[..., [3, 17]] *= 15
    x = x.to(F16).to(device)
    for side, axis in SIDES.items():
        for bits, group in CASES:
            name = f"{side} int{bits} G{group}"
            if device != "cpu":
                _poison_allocator(4 * x.nbytes)
            got = kernels.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=F16)
            want = ref.quantize(x, bits=bits, group=group, axis=axis, stats_dtype=F16)
            for part, a, b in zip(("codes", "scale", "min"), got, want):
                if not torch.equal(a, b):
                    failures.append(f"{name} quantize: {part} differ in {int((a != b).sum())} of {a.numel()}")
            out = torch.full_like(x, float("nan"))
            kernels.dequantize(*want, bits=bits, group=group, axis=axis, shape=x.shape, dtype=F16, out=out)
            if not torch.equal(out, ref.dequantize(*want, bits=bits, group=group, axis=axis, shape=x.shape, dtype=F16)):
                failures.append(f"{name} dequantize: differs from the reference ({int(out.isnan().sum())} unwritten)")
    return failures


def check_strided(n: int = 4) -> list[str]:
    """The store's zero-copy shapes: a block view in, payloads at a stride, a view out."""
    L, H, B, D = 4, 8, 256, 128
    base = torch.randn(L, H, n * B, D, device=DEVICE).to(F16)
    view = base.view(L, H, n, B, D).permute(2, 0, 1, 3, 4)
    failures = []
    for side, axis in SIDES.items():
        q, s, m = kernels.quantize(view, bits=4, group=32, axis=axis, stats_dtype=F16)
        want = ref.quantize(view, bits=4, group=32, axis=axis, stats_dtype=F16)
        if not all(torch.equal(a, b) for a, b in zip((q, s, m), want)):
            failures.append(f"{side} quantize of a block view differs")
        qv, sv, mv = (strided_copy(t, pad) for t, pad in ((q, 16), (s, 8), (m, 8)))
        out_base = torch.full_like(base, float("nan"))
        out = out_base.view(L, H, n, B, D).permute(2, 0, 1, 3, 4)
        kernels.dequantize(qv, sv, mv, bits=4, group=32, axis=axis, shape=view.shape, dtype=F16, out=out)
        if not torch.equal(out, ref.dequantize(q, s, m, bits=4, group=32, axis=axis, shape=view.shape, dtype=F16)):
            failures.append(f"{side} dequantize of strided payloads into a block view differs")
    return failures


def strided_copy(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` ([n, ...]) inside one flat buffer at a fixed stride of numel + pad elements per
    block, as an as_strided view (how frames land in one device buffer)."""
    per = t[0].numel()
    buf = torch.zeros(t.shape[0] * (per + pad), dtype=t.dtype, device=t.device)
    view = torch.as_strided(buf, t.shape, (per + pad, *t[0].stride()))
    view.copy_(t)
    return view


# -- measurements ------------------------------------------------------------------------


def _encoded_nbytes(encoded) -> int:
    return sum(t.numel() * t.element_size() for t in encoded)


def measure_case(xs: list[torch.Tensor], side: str, bits: int, group: int, copy_bw: float, reps: int,
                 ref_reps: int) -> list[dict]:
    axis = SIDES[side]
    kw = dict(bits=bits, group=group, axis=axis)
    enc = [kernels.quantize(x, stats_dtype=F16, **kw) for x in xs]
    outs = [torch.empty_like(x) for x in xs]
    raw = xs[0].numel() * xs[0].element_size()
    moved = raw + _encoded_nbytes(enc[0])
    rows = []
    for op in ("quantize", "dequantize"):
        if op == "quantize":
            t = gpu_time(lambda i: kernels.quantize(xs[i], stats_dtype=F16, **kw), reps=reps)
            t_ref = gpu_time(lambda i: ref.quantize(xs[i], stats_dtype=F16, **kw), reps=ref_reps, warmup=1)
        else:
            t = gpu_time(lambda i: kernels.dequantize(*enc[i], shape=xs[i].shape, dtype=F16, out=outs[i], **kw),
                         reps=reps)
            t_ref = gpu_time(lambda i: ref.dequantize(*enc[i], shape=xs[i].shape, dtype=F16, **kw),
                             reps=ref_reps, warmup=1)
        rows.append({
            "case": f"{side} int{bits} G{group}", "op": op, "us": t * 1e6,
            "raw_GBps": raw / t / 1e9, "moved_MB": moved / 1e6, "moved_GBps": moved / t / 1e9,
            "pct_copy_bw": 100 * moved / t / copy_bw, "ref_raw_GBps": raw / t_ref / 1e9, "speedup": t_ref / t,
        })
    return rows


def measure_block(bits: int = 4, group: int = 32) -> list[dict]:
    """One 256-token Llama-3-8B block: is launch overhead small next to the work?"""
    xs = [torch.randn(BLOCK, device=DEVICE).to(F16) for _ in range(N_SETS)]
    rows = []
    for side, axis in SIDES.items():
        kw = dict(bits=bits, group=group, axis=axis)
        enc = [kernels.quantize(x, stats_dtype=F16, **kw) for x in xs]
        outs = [torch.empty_like(x) for x in xs]
        calls = {
            "quantize": lambda i: kernels.quantize(xs[i], stats_dtype=F16, **kw),
            "dequantize": lambda i: kernels.dequantize(*enc[i], shape=BLOCK, dtype=F16, out=outs[i], **kw),
        }
        for op, fn in calls.items():
            latency = _sync_latency(fn)
            host = _host_time(fn)
            gpu = _graph_time(fn)
            raw = xs[0].nbytes
            rows.append({"case": f"block {side} int{bits} G{group}", "op": op, "latency_us": latency * 1e6,
                         "host_us": host * 1e6, "gpu_us": gpu * 1e6 if gpu else "n/a",
                         "raw_GBps_gpu": raw / gpu / 1e9 if gpu else "n/a"})
    return rows


def _sync_latency(fn, reps: int = 50) -> float:
    """Wall time of one call, launch to completion, from an idle GPU (median)."""
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i % N_SETS)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_time(fn, reps: int = 200) -> float:
    """Python + launch time per call, back to back (the GPU queue absorbs the kernels)."""
    fn(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i % N_SETS)
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return host


def _graph_time(fn, calls: int = 20) -> float | None:
    """GPU time per call with the launch overhead removed: replay a CUDA graph of calls."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):
                fn(i % N_SETS)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % N_SETS)
        t = gpu_time(lambda i: graph.replay(), reps=10, n_sets=1)
        return t / calls
    except Exception as e:  # capture is best effort; the other columns still stand
        print(f"  (CUDA graph capture failed: {e!r})", file=sys.stderr)
        return None


def measure_strided(copy_bw: float, n: int = 16, reps: int = 30) -> list[dict]:
    """16 blocks of 256 tokens as the store sees them: a block view of one [L, H, n*B, D]
    KV tensor in; payloads at a fixed stride in one buffer, into such a view, out."""
    L, H, B, D = SHAPE[0], SHAPE[1], 256, SHAPE[3]
    bases = [torch.randn(L, H, n * B, D, device=DEVICE).to(F16) for _ in range(N_SETS)]
    views = [b.view(L, H, n, B, D).permute(2, 0, 1, 3, 4) for b in bases]
    shape = tuple(views[0].shape)
    rows = []
    for side, axis in SIDES.items():
        kw = dict(bits=4, group=32, axis=axis)
        enc = [kernels.quantize(v, stats_dtype=F16, **kw) for v in views]
        packed = [tuple(strided_copy(t, 64) for t in e) for e in enc]
        raw = bases[0].nbytes
        moved = raw + _encoded_nbytes(enc[0])
        t_q = gpu_time(lambda i: kernels.quantize(views[i], stats_dtype=F16, **kw), reps=reps)
        t_d = gpu_time(lambda i: kernels.dequantize(*packed[i], shape=shape, dtype=F16, out=views[i], **kw), reps=reps)
        for op, t in (("quantize", t_q), ("dequantize", t_d)):
            rows.append({"case": f"{n} strided blocks {side} int4 G32", "op": op, "us": t * 1e6,
                         "raw_GBps": raw / t / 1e9, "moved_MB": moved / 1e6, "moved_GBps": moved / t / 1e9,
                         "pct_copy_bw": 100 * moved / t / copy_bw})
    return rows


def sweep(xs: list[torch.Tensor], reps: int) -> list[dict]:
    """Every candidate config for int4 at G=32 and G=128 (D=128): which is fastest?"""
    rows = []
    raw = xs[0].nbytes
    for group in (32, 128):
        for side, axis in SIDES.items():
            kw = dict(bits=4, group=group, axis=axis)
            enc = [kernels.quantize(x, stats_dtype=F16, **kw) for x in xs]
            outs = [torch.empty_like(x) for x in xs]
            sk = side.lower()
            for op in ("quantize", "dequantize"):
                default = configs.pick(sk, op, group, SHAPE[3], SHAPE[2], 4)
                for cfg in configs.candidates(sk, op, group, SHAPE[3]):
                    if op == "quantize":
                        fn = lambda i, c=cfg: kk._quantize(xs[i], 4, group, axis, F16, config=c)  # noqa: E731
                    else:
                        fn = lambda i, c=cfg: kk._dequantize(*enc[i], 4, group, axis, xs[i].shape, F16,  # noqa: E731
                                                             out=outs[i], config=c)
                    t = gpu_time(fn, reps=reps)
                    rows.append({"case": f"{side} int4 G{group}", "op": op,
                                 "config": f"{cfg.kwargs} w{cfg.num_warps}",
                                 "default": "*" if _same(cfg, default) else "", "us": t * 1e6,
                                 "raw_GBps": raw / t / 1e9})
    return rows


def sweep_v(xs: list[torch.Tensor], reps: int) -> list[dict]:
    """V quantize, int4 G=32 (the goal's case), over ``configs.v_quantize_candidates`` (tiles
    and cache hints), on the full KV and on 16 strided blocks (the store's shape): which is
    fastest, and by how much over the default."""
    rows = []
    raw = xs[0].nbytes
    L, H, T, D = SHAPE
    n, B = 16, 256
    views = [x.view(L, H, n, B, D).permute(2, 0, 1, 3, 4) for x in xs]
    for group in (32,):
        default = configs.pick("v", "quantize", group, D, T, 4)
        for cfg in configs.v_quantize_candidates(group, D):
            row = {"case": f"V int4 G{group}", "config": f"{cfg.kwargs} w{cfg.num_warps}",
                   "default": "*" if _same(cfg, default) else ""}
            for name, inputs in (("full", xs), ("blocks", views)):
                t = gpu_time(lambda i, c=cfg: kk._quantize(inputs[i], 4, group, AXIS_CHANNELS, F16, config=c), reps=reps)
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_GBps"] = raw / t / 1e9
            rows.append(row)
            print(f"  {row['case']} {row['config']:70s} {row['full_GBps']:7.0f} / {row['blocks_GBps']:7.0f} GB/s "
                  f"{row['default']}", flush=True)
        group_rows = [r for r in rows if r["case"] == f"V int4 G{group}"]
        best = max(group_rows, key=lambda r: r["blocks_GBps"])
        base = next(r for r in group_rows if r["default"])
        print(f"  best for G{group} (16 strided blocks): {best['config']} {best['blocks_GBps']:.0f} GB/s, "
              f"{best['blocks_GBps'] / base['blocks_GBps']:.3f}x the default", flush=True)
    return rows


def measure_clip(copy_bw: float, reps: int = 30) -> list[dict]:
    """V quantize, int2 G=64 (the near miss's V) and int4 G=32, with the range search at 0
    (plain min/max), 1, 2, 3 and 6 steps (``KIVI(v_clip=...)``), on fp16 KV of head_dim 128
    (SHAPE) and 64 (SmolLM2's): GB/s of raw KV, the share of copy bandwidth of the bytes
    moved, and whether the codes and stats equal the reference's."""
    rows = []
    for D in (128, 64):
        shape = (*SHAPE[:-1], D)
        xs = [torch.randn(shape, device=DEVICE).to(F16) for _ in range(N_SETS)]
        raw = xs[0].nbytes
        for bits, group in ((2, 64), (4, 32)):
            base = None
            for clip in (0, 1, 2, 3, 6):
                kw = dict(bits=bits, group=group, axis=AXIS_CHANNELS, stats_dtype=F16, clip=clip)
                small = xs[0][:2, :, :512]
                exact = all(torch.equal(a, b) for a, b in zip(kernels.quantize(small, **kw), ref.quantize(small, **kw)))
                moved = raw + _encoded_nbytes(kernels.quantize(xs[0], **kw))
                t = gpu_time(lambda i: kernels.quantize(xs[i], **kw), reps=reps)
                base = base or t
                rows.append({"case": f"V int{bits} G{group} D{D}", "clip": clip, "us": t * 1e6,
                             "raw_GBps": raw / t / 1e9, "pct_copy_bw": 100 * moved / t / copy_bw,
                             "time_vs_clip0": t / base, "exact": exact})
                print(f"  {rows[-1]['case']} clip={clip}: {rows[-1]['raw_GBps']:,.0f} GB/s raw, "
                      f"{rows[-1]['pct_copy_bw']:.0f}% of copy, x{t / base:.2f} time, exact={exact}", flush=True)
        del xs
    return rows


def measure_rotate(copy_bw: float, reps: int = 30) -> list[dict]:
    """KIVI's V rotation (``KIVI(v_rotate=True)``: a signed Hadamard rotation of V's rows in
    torch, fp32, before the V quantize kernel; rotated back after V's dequantize): per case,
    V quantize and dequantize with and without it, the rotation alone, and a whole-codec
    encode and decode (K and V), on fp16 KV of head_dim 128 (SHAPE) and 64 (SmolLM2's): GB/s
    of raw KV, time against the plain kernel's, and whether the kernels' codes and decodes
    equal the torch reference's on the GPU."""
    import cacheseek as cs
    from cacheseek.quant import backend, rotation

    def exact_on_gpu(codec, k, v) -> bool:
        old = os.environ.get(backend.BACKEND_ENV)
        try:
            os.environ[backend.BACKEND_ENV] = "torch"
            want = codec.encode(k, v)
            want_kv = codec.decode(want)
            os.environ[backend.BACKEND_ENV] = "triton"
            got = codec.encode(k, v)
            got_kv = codec.decode(got)
        finally:
            if old is None:
                os.environ.pop(backend.BACKEND_ENV, None)
            else:
                os.environ[backend.BACKEND_ENV] = old
        return all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(got.named_buffers(), want.named_buffers())) \
            and all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))

    rows = []
    for D in (128, 64):
        shape = (*SHAPE[:-1], D)
        xs = [torch.randn(shape, device=DEVICE).to(F16) for _ in range(N_SETS)]
        for x in xs:
            x[..., [3, D - 5]] *= 15  # outlier channels
        raw = xs[0].nbytes

        def row(case: str, op: str, t: float, base: float, exact: Any = None) -> None:
            rows.append({"case": f"{case} D{D}", "op": op, "us": t * 1e6, "raw_GBps": raw / t / 1e9,
                         "time_vs_plain": t / base, "exact": exact})
            print(f"  {rows[-1]['case']:28s} {op:26s} {rows[-1]['raw_GBps']:8,.0f} GB/s raw, x{t / base:.2f} time"
                  + (f", exact={exact}" if exact is not None else ""), flush=True)

        t_rot = gpu_time(lambda i: rotation.rotate(xs[i]).to(F16), reps=reps)
        t_unrot = gpu_time(lambda i: rotation.unrotate(xs[i]).to(F16), reps=reps)
        row("rotation alone", "rotate (fp16 -> fp16)", t_rot, t_rot)
        row("rotation alone", "unrotate (fp16 -> fp16)", t_unrot, t_unrot)
        for bits, group, clip in ((2, 64, 0), (2, 64, 2), (4, 32, 0)):
            kw = dict(bits=bits, group=group, axis=AXIS_CHANNELS, stats_dtype=F16, clip=clip)
            codec = cs.KIVI(bits=4, group_size=32, v_bits=bits, v_group_size=group, v_clip=clip, v_rotate=True)
            case = f"V int{bits} G{group}" + (f" clip{clip}" if clip else "")
            small = xs[0][:2, :, :512]
            exact = exact_on_gpu(codec, small.contiguous(), small.contiguous())
            t_plain = gpu_time(lambda i: kernels.quantize(xs[i], **kw), reps=reps)
            t_rq = gpu_time(lambda i: kernels.quantize(codec._rotated(xs[i]), **kw), reps=reps)
            row(case, "quantize plain", t_plain, t_plain)
            row(case, "quantize rotated", t_rq, t_plain, exact)
            enc = [kernels.quantize(x, **kw) for x in xs]
            dq = dict(bits=bits, group=group, axis=AXIS_CHANNELS, shape=shape, dtype=F16)
            t_dplain = gpu_time(lambda i: kernels.dequantize(*enc[i], **dq), reps=reps)
            t_drot = gpu_time(lambda i: codec._dequantize_v(kernels, *enc[i], shape, F16), reps=reps)
            row(case, "dequantize plain", t_dplain, t_dplain)
            row(case, "dequantize rotated", t_drot, t_dplain, exact)
            del enc
            plain_codec = cs.KIVI(bits=4, group_size=32, v_bits=bits, v_group_size=group, v_clip=clip)
            t_e0 = gpu_time(lambda i: plain_codec.encode(xs[i], xs[(i + 1) % N_SETS]), reps=max(5, reps // 3))
            t_e1 = gpu_time(lambda i: codec.encode(xs[i], xs[(i + 1) % N_SETS]), reps=max(5, reps // 3))
            row(case + " + K int4 G32", "codec encode K+V plain", t_e0, t_e0)
            row(case + " + K int4 G32", "codec encode K+V rotated", t_e1, t_e0)
            e0, e1 = plain_codec.encode(xs[0], xs[1]), codec.encode(xs[0], xs[1])
            t_d0 = gpu_time(lambda i: plain_codec.decode(e0), reps=max(5, reps // 3))
            t_d1 = gpu_time(lambda i: codec.decode(e1), reps=max(5, reps // 3))
            row(case + " + K int4 G32", "codec decode K+V plain", t_d0, t_d0)
            row(case + " + K int4 G32", "codec decode K+V rotated", t_d1, t_d0)
            del e0, e1
        del xs
    return rows


def _device_time(fn: Callable[[int], Any], *, reps: int, n_sets: int = N_SETS) -> float:
    """Median seconds the device spends on ``fn(i)``'s work: a spin kernel queued before
    each call keeps the device busy while the host queues it, so the events time the
    device, not the host's launches."""
    for i in range(3):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(5_000_000)  # a few ms: longer than any call's host time
        start.record()
        fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


MIXED = {"int8@0+int2": ("int2", dict(bits=2, group_size=32)), "int8@0+k4v2": ("k4v2", dict(k_bits=4, v_bits=2, group_size=32))}


def measure_mixed(reps: int = 30) -> list[dict]:
    """A chain under a precision policy (first block int8, the rest int2 or K4/V2) against
    the same chain under the uniform codec: device time of the encode (per-layer KV read
    in place through the layer tables, into staging rows at each codec's stride: one
    launch pair per codec) and of the decode (staging rows into [L, H, n*B, D], a launch
    pair per codec), Llama-3-8B blocks of 256 tokens, 16 and 64 blocks; the uniform and the
    policy calls interleaved. The store's host work around these launches is
    ``benchmarks/store.py --mixed``'s."""
    import cacheseek as cs
    from cacheseek.block_format import BlockFormat
    from cacheseek.staging import payload_views, staging_stride

    layout = cs.KVLayout(num_layers=BLOCK[0], num_kv_heads=BLOCK[1], head_dim=BLOCK[3], dtype="float16")
    B = BLOCK[2]
    rows = []
    for n in (16, 64):
        T = n * B
        sets = [[(torch.randn(BLOCK[1], T, BLOCK[3], device=DEVICE, dtype=F16),
                  torch.randn(BLOCK[1], T, BLOCK[3], device=DEVICE, dtype=F16)) for _ in range(BLOCK[0])]
                for _ in range(2)]
        for policy_name, (uniform_name, kw) in MIXED.items():
            fmts = {uniform_name: BlockFormat(cs.KIVI(**kw), layout, B),
                    policy_name: BlockFormat(cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32), rest=cs.KIVI(**kw)),
                                             layout, B)}
            ops = {}
            for name, fmt in fmts.items():
                runs = []
                for a, b in fmt.segments(0, n):
                    part = fmt.at(a)
                    meta = part.planned_payload()
                    stride = staging_stride(meta.payload_nbytes)
                    buf = torch.empty((b - a, stride), dtype=torch.uint8, device=DEVICE)
                    runs.append((a, b, part.codec, payload_views(buf, meta.tensors, b - a, stride)))
                prepared = [runs[0][2].prepare_layers([k for k, _ in kv], [v for _, v in kv]) for kv in sets]
                k_out = torch.empty((BLOCK[0], BLOCK[1], T, BLOCK[3]), device=DEVICE, dtype=F16)
                v_out = torch.empty_like(k_out)
                as_blocks = (BLOCK[0], BLOCK[1], n, B, BLOCK[3])
                kb, vb = k_out.view(as_blocks).permute(2, 0, 1, 3, 4), v_out.view(as_blocks).permute(2, 0, 1, 3, 4)

                def encode(i: int, runs=runs, prepared=prepared) -> None:
                    for a, b, codec, views in runs:
                        codec.encode_layers_into(prepared[i], a * B, b - a, B, views)

                def decode(i: int, runs=runs, kb=kb, vb=vb) -> None:
                    for a, b, codec, views in runs:
                        codec.decode_buffers(views, (kb[a:b], vb[a:b]))

                ops[name] = (encode, decode)
            got: dict[str, dict[str, list[float]]] = {name: {"encode": [], "decode": []} for name in fmts}
            for rnd in range(4):  # A B B A ...: drift hits both alike
                for name in (fmts if rnd % 2 == 0 else reversed(list(fmts))):
                    for op, fn in zip(("encode", "decode"), ops[name]):
                        got[name][op].append(_device_time(fn, reps=max(5, reps // 4), n_sets=2))
            raw = layout.raw_nbytes(T)
            for op in ("encode", "decode"):
                t_u, t_p = (statistics.median(got[name][op]) for name in (uniform_name, policy_name))
                rows.append({"blocks": n, "uniform": uniform_name, "policy": policy_name, "op": op,
                             "uniform_us": t_u * 1e6, "policy_us": t_p * 1e6, "uniform_raw_GBps": raw / t_u / 1e9,
                             "policy_raw_GBps": raw / t_p / 1e9, "policy_speed_vs_uniform": t_u / t_p})
                print(f"  {n} blocks {policy_name} vs {uniform_name} {op}: {t_p * 1e6:,.0f} vs {t_u * 1e6:,.0f} us "
                      f"({t_u / t_p:.3f}x)", flush=True)
        del sets
    return rows


def _same(a, b) -> bool:
    return a.kwargs == b.kwargs and a.num_warps == b.num_warps


# -- entry point -------------------------------------------------------------------------


GOAL_GBPS = 2000  # int4, each way


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    """Quantize and dequantize GB/s per case: Triton against the torch reference, with the
    fraction of the copy bandwidth each kernel reaches."""
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, op in zip(axes, ("quantize", "dequantize")):
        rows = [r for r in doc["throughput"] if r["op"] == op]
        bars(ax, [r["case"] for r in rows],
             {"Triton kernel": [r["raw_GBps"] for r in rows],
              "torch reference (same GPU)": [r["ref_raw_GBps"] for r in rows]}, fmt="{:,.0f}")
        for x, r in enumerate(rows):
            ax.annotate(f"{r['pct_copy_bw']:.0f}% of copy bw", (x - 0.2, r["raw_GBps"] / 2), ha="center",
                        va="center", fontsize=7.5, color="white", rotation=90)
        ax.axhline(GOAL_GBPS, color="tab:red", ls="--", lw=1, label=f"goal for int4: {GOAL_GBPS:,} GB/s")
        ax.set_title(op)
        ax.set_xlabel("tensor, bits, group size G")
    axes[0].set_ylabel("GB/s of raw fp16 KV processed")
    legend_outside(axes[1])
    shape = "x".join(str(d) for d in doc["shape"])
    where = doc["machine"].get("gpu", "?")
    return save(fig, out_dir, "kernels", note=source_line(doc),
                title=f"KIVI kernels on fp16 KV [{shape}] (layers x heads x tokens x dim), {where}; "
                      f"copy bandwidth {doc['copy_GBps']:,.0f} GB/s")


def smoke_without_cuda() -> int:
    print("No CUDA device: the throughput benchmark needs an NVIDIA GPU. Running a tiny "
          "correctness smoke test in the Triton interpreter instead.")
    failures = check_correctness("cpu", (1, 1, 128, 64))
    print("correctness vs reference (interpreter):", "PASS" if not failures else "FAIL")
    for f in failures:
        print("  ", f)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="int4 G=32 only, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate launch config")
    ap.add_argument("--sweep-v", action="store_true", help="only the wide V-quantize sweep (tiles, cache hints)")
    ap.add_argument("--clip", action="store_true", help="only V quantize with its range search (v_clip) vs without")
    ap.add_argument("--rotate", action="store_true", help="only KIVI's V rotation (v_rotate): its encode/decode cost")
    ap.add_argument("--mixed", action="store_true", help="only a precision policy's chain vs the uniform codec's "
                                                           "(device time of encode and decode)")
    ap.add_argument("--out", type=Path, default=None, help="directory for kernels.json / kernels.png")
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return 0
    if not torch.cuda.is_available():
        return smoke_without_cuda()

    t_start = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()}")
    if args.sweep_v:
        xs = [torch.randn(SHAPE, device=DEVICE).to(F16) for _ in range(N_SETS)]
        rows = sweep_v(xs, reps=20)
        path = write_json("kernels_sweep_v", {"shape": list(SHAPE), "rows": rows, "triton": _triton_version()},
                          args.out)
        print(table(rows, ["case", "config", "default", "full_GBps", "blocks_GBps"],
                    title="\nV quantize, int4: every candidate; * = the default"))
        print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
        return 0
    if args.clip:
        copy_bw = copy_bandwidth()
        rows = measure_clip(copy_bw)
        path = write_json("kernels_clip", {"shape": list(SHAPE[:-1]), "copy_GBps": copy_bw / 1e9, "rows": rows,
                                           "triton": _triton_version()}, args.out)
        print(table(rows, ["case", "clip", "us", "raw_GBps", "pct_copy_bw", "time_vs_clip0", "exact"],
                    title=f"\nV quantize with the range search; copy bandwidth {copy_bw / 1e9:,.0f} GB/s"))
        print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
        return 0 if all(r["exact"] for r in rows) else 1
    if args.rotate:
        copy_bw = copy_bandwidth()
        rows = measure_rotate(copy_bw)
        path = write_json("kernels_rotate", {"shape": list(SHAPE[:-1]), "copy_GBps": copy_bw / 1e9, "rows": rows,
                                             "triton": _triton_version()}, args.out)
        print(table(rows, ["case", "op", "us", "raw_GBps", "time_vs_plain", "exact"],
                    title=f"\nKIVI's V rotation (v_rotate); copy bandwidth {copy_bw / 1e9:,.0f} GB/s"))
        print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
        return 0 if all(r["exact"] is not False for r in rows) else 1
    if args.mixed:
        rows = measure_mixed()
        path = write_json("kernels_mixed", {"block": list(BLOCK), "rows": rows, "triton": _triton_version()}, args.out)
        print(table(rows, ["blocks", "policy", "uniform", "op", "policy_us", "uniform_us", "policy_raw_GBps",
                           "policy_speed_vs_uniform"],
                    title="\nA precision policy's chain vs the uniform codec's: device time (goal: within 5%)"))
        print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")
        return 0
    failures = check_correctness(DEVICE, (4, 8, 512, 128)) + check_strided()
    print("correctness vs reference:", "PASS" if not failures else "FAIL")
    for f in failures:
        print("  ", f)

    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:,.0f} GB/s (read + write)")
    reps, ref_reps = (20, 2) if args.quick else (50, 5)
    cases = [(4, 32)] if args.quick else CASES
    xs = [torch.randn(SHAPE, device=DEVICE).to(F16) for _ in range(N_SETS)]
    for x in xs:
        x[..., [3, 17, 90, 111]] *= 15  # outlier channels, as real keys have

    rows = []
    for side in SIDES:
        for bits, group in cases:
            rows += measure_case(xs, side, bits, group, copy_bw, reps, ref_reps)
            print(f"  {rows[-2]['case']}: quantize {rows[-2]['raw_GBps']:,.0f} GB/s, "
                  f"dequantize {rows[-1]['raw_GBps']:,.0f} GB/s raw fp16", flush=True)
    block_rows = measure_block()
    strided_rows = measure_strided(copy_bw)
    sweep_rows = sweep(xs, reps=max(10, reps // 2)) if args.sweep else []
    del xs

    payload = {"shape": list(SHAPE), "dtype": "float16", "copy_GBps": copy_bw / 1e9,
               "correct": not failures, "failures": failures, "throughput": rows, "block": block_rows,
               "strided": strided_rows, "sweep": sweep_rows, "triton": _triton_version(),
               "seconds": time.perf_counter() - t_start}
    path = write_json("kernels", payload, args.out)
    redraw(plot, path)

    if sweep_rows:
        print(table(sweep_rows, ["case", "op", "config", "default", "us", "raw_GBps"],
                    title="\nCandidate configs (int4, D=128); * = the default"))
    print(table(block_rows, ["case", "op", "latency_us", "host_us", "gpu_us", "raw_GBps_gpu"],
                title=f"\nOne block {list(BLOCK)} fp16 ({2 * math.prod(BLOCK) / 2**20:.0f} MiB): latency incl. "
                      "launch, host time per call, GPU time per call (CUDA graph)"))
    print(table(strided_rows, ["case", "op", "us", "raw_GBps", "moved_GBps", "pct_copy_bw"],
                title="\nStrided blocks: [n, L, H, B, D] view in / payloads at a stride, view out"))
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    print(table(rows, ["case", "op", "us", "raw_GBps", "moved_MB", "moved_GBps", "pct_copy_bw", "ref_raw_GBps",
                       "speedup"],
                title=f"\nKIVI kernels on fp16 {list(SHAPE)} ({torch.cuda.get_device_name()}), copy bandwidth "
                      f"{copy_bw / 1e9:,.0f} GB/s; correctness: {'PASS' if not failures else 'FAIL'}"))
    return 1 if failures else 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
