"""Probe: can kernels read/write pinned host memory (zero-copy) as fast as the copy engine?"""
import statistics

import torch
import triton
import triton.language as tl
from cacheseek.kernels import kivi as K

import cacheseek as cs
from cacheseek.staging import payload_views
from cacheseek.store.frame import plan_frame

dev = torch.device("cuda")

def timeit(fn, reps=7):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)

@triton.jit
def copy_k(src, dst, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(ITERS):
        offs = (pid * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

N = 537 * 1024 * 1024 // 4 // 4 * 4
d = torch.randn(N, device=dev).view(torch.int32)
h = torch.empty(N, dtype=torch.int32, pin_memory=True)
d2 = torch.empty_like(d)
GB = N * 4 / 1e9
t = timeit(lambda: h.copy_(d, non_blocking=True)); print(f"copy engine D2H pinned: {GB/t:.1f} GB/s")
t = timeit(lambda: d2.copy_(h, non_blocking=True)); print(f"copy engine H2D pinned: {GB/t:.1f} GB/s")
for BLOCK, ITERS, W in [(1024, 1, 4), (4096, 1, 4), (4096, 4, 8), (8192, 1, 8), (2048, 8, 4)]:
    grid = (triton.cdiv(N, BLOCK * ITERS),)
    t = timeit(lambda: copy_k[grid](d, h, N, BLOCK=BLOCK, ITERS=ITERS, num_warps=W))
    ok = torch.equal(h[:1000].cuda(), d[:1000])
    t2 = timeit(lambda: copy_k[grid](h, d2, N, BLOCK=BLOCK, ITERS=ITERS, num_warps=W))
    print(f"kernel B{BLOCK} I{ITERS} W{W}: D2H store {GB/t:.1f} GB/s (ok {ok}), H2D load {GB/t2:.1f} GB/s")

# quantize_layers into device staging vs host rows
L, H, D, B, n = 32, 8, 128, 256, 16
kv = [(torch.randn(H, n * B, D, device=dev, dtype=torch.float16), torch.randn(H, n * B, D, device=dev, dtype=torch.float16)) for _ in range(L)]
raw = 2 * L * H * n * B * D * 2 / 1e9
layout = cs.KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16")
for name in ("int4", "int2", "int8"):
    codec = cs.KIVI(bits=int(name[3:]), group_size=32)
    tmpl = codec.template((L, H, B, D), "float16")
    specs = [(nm, sp.dtype, sp.shape) for nm, sp, _ in tmpl.named_buffers()]
    meta = plan_frame(block_hash=b"\0" * 32, parent_hash=b"\0" * 32, position=0, layout=layout, block_tokens=B,
                      codec=codec.spec(), buffers=specs)
    stride = (meta.payload_offset + meta.payload_nbytes + 63) // 64 * 64
    prepared = codec.prepare_layers([k for k, _ in kv], [v for _, v in kv])
    for where in ("cuda", "pinned"):
        buf = torch.empty((n, stride), dtype=torch.uint8, device=dev) if where == "cuda" else torch.empty((n, stride), dtype=torch.uint8, pin_memory=True)
        views = payload_views(buf, meta.tensors, n, stride, meta.payload_offset)
        try:
            t = timeit(lambda: codec.encode_layers_into(prepared, 0, n, B, views))
            extra = ""
            if where == "cuda":
                hb = torch.empty((n, stride), dtype=torch.uint8, pin_memory=True)
                t_all = timeit(lambda: (codec.encode_layers_into(prepared, 0, n, B, views), hb.copy_(buf, non_blocking=True)))
                dbuf = buf
                extra = f"; + one D2H copy: {t_all*1e3:.2f} ms = {raw/t_all:.0f} GB/s raw"
            else:
                same = torch.equal(buf.cuda()[:, meta.payload_offset:meta.payload_offset + meta.payload_nbytes], dbuf[:, meta.payload_offset:meta.payload_offset + meta.payload_nbytes])
                extra = f"; identical to device: {same}"
            print(f"{name} quantize_layers -> {where}: {t*1e3:.2f} ms = {raw/t:.0f} GB/s raw, payload {meta.payload_nbytes*n/1e6:.0f} MB{extra}")
        except Exception as e:
            print(f"{name} quantize_layers -> {where}: FAILED {type(e).__name__}: {e}")
    # decode: from device staging vs straight from pinned host
    hbuf = torch.empty((n, stride), dtype=torch.uint8, pin_memory=True); hbuf.copy_(dbuf)
    k_out = torch.empty((L, H, n * B, D), dtype=torch.float16, device=dev); v_out = torch.empty_like(k_out)
    as_blocks = (L, H, n, B, D)
    outs = (k_out.view(as_blocks).permute(2, 0, 1, 3, 4), v_out.view(as_blocks).permute(2, 0, 1, 3, 4))
    tm = codec.template((n, L, H, B, D), "float16")
    for where, src in (("cuda", dbuf), ("pinned", hbuf)):
        bufs = payload_views(src, meta.tensors, n, stride, meta.payload_offset)
        def dec():
            for side, (q, s, m), out, bits, grp, axis in (("k", bufs[0:3], outs[0], codec.k_bits, codec.k_group, -2), ("v", bufs[3:6], outs[1], codec.v_bits, codec.v_group, -1)):
                desc = tuple((tuple(x.shape), x.stride(), x.dtype) for x in (q, s, m))
                plan = K._dequantize_plan((n, L, H, B, D), desc, (tuple(out.shape), out.stride(), out.dtype), torch.float16, bits, grp, axis, None, False)
                la = plan.launch
                la.kernel[la.grid](q, s, m, out, *la.scalars, **la.options)
        try:
            t = timeit(dec)
            extra = ""
            if where == "cuda":
                t_all = timeit(lambda: (dbuf.copy_(hbuf, non_blocking=True), dec()))
                ref = k_out.clone()
                extra = f"; H2D copy + decode: {t_all*1e3:.2f} ms = {raw/t_all:.0f} GB/s raw"
            else:
                extra = f"; identical: {torch.equal(ref, k_out)}"
            print(f"{name} dequantize <- {where}: {t*1e3:.2f} ms = {raw/t:.0f} GB/s raw{extra}")
        except Exception as e:
            print(f"{name} dequantize <- {where}: FAILED {type(e).__name__}: {e}")
