"""Compile the KIVI kernels for sm_90 (H100/H200) on a machine WITHOUT a GPU.

    python scripts/kernels_sm90.py [--all-configs] [--quick]

The Triton interpreter runs the kernels' logic on CPU but not the GPU compiler, which
rejects things the interpreter accepts (a shape-mismatched div_rn, a non-constexpr
global). This compiles each kernel ahead of time with triton's bundled ptxas and prints
what the cubin says: registers, stack (spills), SASS instructions per element (static
count, slow paths included, so an upper bound), barriers and shuffles. That is a proxy
to compare configs before spending GPU time, not a timing. Exit status 1 on any
compile failure. Needs TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
import warnings

# Triton 3.9 warns that its fp-fusion default will change; every compile here sets it.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("kernels_sm90: unset TRITON_INTERPRET (the interpreter cannot compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from cacheseek.kernels import configs  # noqa: E402
from cacheseek.kernels import kivi as K  # noqa: E402
from cacheseek.kernels import paged as P  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KERNELS = {
    ("k", "quantize"): K._quantize_k_kernel,
    ("k", "dequantize"): K._dequantize_k_kernel,
    ("v", "quantize"): K._quantize_v_kernel,
    ("v", "dequantize"): K._dequantize_v_kernel,
}
# what the JIT specializes at run time for contiguous 16-byte-aligned buffers and D % 16 == 0
_DIVISIBLE = {"D", "sx_a", "sx_c", "sx_t", "sq_a", "sq_c", "ss_a", "ss_c", "sm_a", "sm_c", "so_a", "so_c", "so_t",
              "sx_p", "so_p", "s_h", "s_t", "s_p", "sr_a", "sr_c", "sr_t"}


_PTRS = {"xt_ptr": "*i64", "ot_ptr": "*i64", "pgt_ptr": "*i64", "q_ptr": "*i32", "pt_ptr": "*i32", "blk_ptr": "*i32"}


def compile_kernel(side, op, *, bits, group, head_dim, x_dtype="fp16", stats_dtype="fp16", masked=False, cfg=None,
                   table=False, page=0, clip=0):
    """Compile one kernel; returns (compiled kernel, config). ``table``: the KV side read or
    written through a table of layer offsets (``X_TABLE`` / ``O_TABLE``); ``page`` > 0: in
    pages of that many tokens (``PAGE``); ``clip``: V quantize's range search (``CLIP``)."""
    cfg = cfg or configs.pick(side, op, group, head_dim, 256)
    fn = KERNELS[side, op].fn  # under the heuristics wrapper
    consts = {"BITS": bits, "MASKED": masked, "PAGE": page, **cfg.kwargs}
    if side == "k":
        consts["PAGE_WORDS"] = page > 0 and page % (32 // bits) == 0
    align = 16 * 8 // int(x_dtype[-2:])
    if op == "quantize":
        consts.update(X_TABLE=table, X_ALIGN=align, CHECK=table)
        if side == "v":
            consts["WORD_BIAS"] = K._word_bias_value(bits)
            consts["CLIP"] = clip
    else:
        consts.update(O_TABLE=table, O_ALIGN=align, SOFT_BF16=False)
    d_pad = configs.padded_head_dim(head_dim)
    consts.update({"G": group} if side == "k" else {"GP": min(group, d_pad), "D_PAD": d_pad})
    ptrs = {**_PTRS, "x_ptr": f"*{x_dtype}", "o_ptr": f"*{x_dtype}", "s_ptr": f"*{stats_dtype}",
            "m_ptr": f"*{stats_dtype}"}
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i64" if n == "bad_addr" else "i32")
                 for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs or n in _DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False}
    return triton.compile(src, target=TARGET, options=options), cfg


def compile_pages_copy(*, to_pages: bool, page: int, head_dim: int = 128, x_dtype: str = "fp16", nan_bits: int = 0):
    """Raw's gather from pages (``to_pages`` false) or scatter into them; fp8 as the kernels
    take it: ``x_dtype="u8"`` and its ``nan_bits`` (kernels.layers.byte_view)."""
    fn = P._pages_copy_kernel
    d_pad = configs.padded_head_dim(head_dim)
    consts = {"BLOCK_T": 8192 // d_pad, "D_PAD": d_pad, "ALIGN": 16 * 8 // int(x_dtype.lstrip("fpu")), "PAGE": page,
              "TO_PAGES": to_pages, "MASKED": False, "NAN_BITS": nan_bits}
    ptrs = {**_PTRS, "pg_ptr": f"*{x_dtype}", "r_ptr": f"*{x_dtype}"}
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i64" if n == "bad_addr" else "i32")
                 for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs or n in _DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": 4, "enable_fp_fusion": False})


def cubin_stats(kernel) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    return {"regs": int(re.search(r"REG:(\d+)", res).group(1)), "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
            "sass": sum(ops.values()), "bar": ops["BAR"], "shfl": ops["SHFL"]}


def _elements_per_thread(side, group, head_dim, cfg) -> int:
    if side == "k":
        tile = group * cfg.kwargs["BLOCK_D"]
    else:
        tile = cfg.kwargs["BLOCK_T"] * configs.padded_head_dim(head_dim)
    return max(1, tile // (32 * cfg.num_warps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all-configs", action="store_true", help="every candidate config, int4, D=128")
    ap.add_argument("--quick", action="store_true", help="one compile per kernel, and the paged forms")
    ap.add_argument("--paged", action="store_true", help="each kernel contiguous and in pages of 16 and 1 (int4)")
    ap.add_argument("--sweep-v", action="store_true", help="every V-quantize candidate of the wide sweep")
    args = ap.parse_args()
    cases = []
    if args.all_configs:
        for (side, op), group in itertools.product(KERNELS, (32, 128)):
            for cfg in configs.candidates(side, op, group, 128):
                cases.append((side, op, 4, group, 128, "fp16", "fp16", False, cfg))
    elif args.sweep_v:
        for group in (32, 128):
            for cfg in configs.v_quantize_candidates(group, 128):
                cases.append(("v", "quantize", 4, group, 128, "fp16", "fp16", False, cfg, True))
    elif args.paged:
        # the contiguous and the paged form of each kernel side by side (int4, D=128):
        # registers and instructions per element, what reading through pages costs
        for (side, op), page in itertools.product(KERNELS, (0, 16, 1)):
            cases.append((side, op, 4, 32, 128, "fp16", "fp16", False, None, True, page))
    elif args.quick:
        cases = [(side, op, 4, 32, 80, "bf16", "fp16", True, None) for side, op in KERNELS]
        cases += [(side, "quantize", 4, 32, 128, "fp16", "fp16", False, None, True) for side in ("k", "v")]
        # in an engine's pages: vLLM's page size and a token pool
        cases += [(side, op, 4, 32, 128, "bf16", "fp16", False, None, True, page)
                  for side, op in KERNELS for page in (16, 1)]
        # V's range search (KIVI v_clip=2), int2 G=64 through a layer table
        cases.append(("v", "quantize", 2, 64, 64, "fp16", "fp16", False, None, True, 0, 2))
    else:
        dtypes, stats = ("fp16", "bf16", "fp32"), ("fp16", "fp32")
        for i, ((side, op), bits, group, d) in enumerate(
                itertools.product(KERNELS, (2, 4, 8), (32, 64, 128), (64, 80, 96, 128, 256))):
            table = op == "quantize" and i % 5 == 0
            cases.append((side, op, bits, group, d, dtypes[i % 3], stats[i // 3 % 2], bool(i % 2), None, table))
    failures = 0
    for side, op, bits, group, d, xd, sd, masked, cfg, *rest in cases:
        table = bool(rest and rest[0])
        page = rest[1] if len(rest) > 1 else 0
        clip = rest[2] if len(rest) > 2 else 0
        name = (f"{side} {op:10s} b{bits} G{group:<3d} D{d:<3d} {xd}/{sd} masked={int(masked)} table={int(table)} "
                f"page={page}" + (f" clip={clip}" if clip else ""))
        try:
            kernel, cfg = compile_kernel(side, op, bits=bits, group=group, head_dim=d, x_dtype=xd,
                                         stats_dtype=sd, masked=masked, cfg=cfg, table=table, page=page, clip=clip)
        except Exception as e:  # report every failure, then fail
            failures += 1
            print(f"FAIL {name}: {str(e)[-400:]}", flush=True)
            continue
        st = cubin_stats(kernel)
        per = st["sass"] / _elements_per_thread(side, group, d, cfg)
        spill = "  SPILLS" if st["stack"] else ""
        print(f"ok   {name} {cfg.kwargs} warps={cfg.num_warps} regs={st['regs']} instr/elem<={per:.1f} "
              f"bar={st['bar']} shfl={st['shfl']}{spill}", flush=True)
    if args.quick or args.paged:
        copies = [(to_pages, page, "fp16", 0) for to_pages, page in itertools.product((False, True), (16, 1))]
        copies += [(False, 16, "u8", 0x7F), (False, 16, "u8", 0x7C)]  # fp8 KV: e4m3fn's and e5m2's NaN/Inf bits
        for to_pages, page, xd, nan_bits in copies:
            name = f"raw {'scatter' if to_pages else 'gather '} page={page}"
            name += f" u8 nan_bits={nan_bits:#x}" if nan_bits else ""
            cases.append(name)
            try:
                st = cubin_stats(compile_pages_copy(to_pages=to_pages, page=page, x_dtype=xd, nan_bits=nan_bits))
            except Exception as e:
                failures += 1
                print(f"FAIL {name}: {str(e)[-400:]}", flush=True)
                continue
            print(f"ok   {name} regs={st['regs']} instr/elem<={st['sass'] / 64:.1f}", flush=True)
    print(f"{len(cases) - failures}/{len(cases)} compiled for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
