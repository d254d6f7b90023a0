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

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KERNELS = {
    ("k", "quantize"): K._quantize_k_kernel,
    ("k", "dequantize"): K._dequantize_k_kernel,
    ("v", "quantize"): K._quantize_v_kernel,
    ("v", "dequantize"): K._dequantize_v_kernel,
}
# what the JIT specializes at run time for contiguous 16-byte-aligned buffers and D % 16 == 0
_DIVISIBLE = {"D", "sx_a", "sx_c", "sx_t", "sq_a", "sq_c", "ss_a", "ss_c", "sm_a", "sm_c", "so_a", "so_c", "so_t"}


def compile_kernel(side, op, *, bits, group, head_dim, x_dtype="fp16", stats_dtype="fp16", masked=False, cfg=None,
                   table=False):
    """Compile one kernel; returns (compiled kernel, config). ``table``: quantize reading
    x through a table of layer addresses (``X_TABLE``)."""
    cfg = cfg or configs.pick(side, op, group, head_dim, 256)
    fn = KERNELS[side, op].fn  # under the heuristics wrapper
    consts = {"BITS": bits, "MASKED": masked, **cfg.kwargs}
    if op == "quantize":
        consts.update(X_TABLE=table, X_ALIGN=16 * 8 // int(x_dtype[-2:]), CHECK=table)
    d_pad = configs.padded_head_dim(head_dim)
    consts.update({"G": group} if side == "k" else {"GP": min(group, d_pad), "D_PAD": d_pad})
    if op == "dequantize":
        consts["SOFT_BF16"] = False
    ptrs = {"x_ptr": f"*{x_dtype}", "xt_ptr": "*i64", "o_ptr": f"*{x_dtype}", "q_ptr": "*i32", "s_ptr": f"*{stats_dtype}",
            "m_ptr": f"*{stats_dtype}"}
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i64" if n == "bad_addr" else "i32")
                 for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs or n in _DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False}
    return triton.compile(src, target=TARGET, options=options), cfg


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
    ap.add_argument("--quick", action="store_true", help="one compile per kernel")
    args = ap.parse_args()
    cases = []
    if args.all_configs:
        for (side, op), group in itertools.product(KERNELS, (32, 128)):
            for cfg in configs.candidates(side, op, group, 128):
                cases.append((side, op, 4, group, 128, "fp16", "fp16", False, cfg))
    elif args.quick:
        cases = [(side, op, 4, 32, 80, "bf16", "fp16", True, None) for side, op in KERNELS]
        cases += [(side, "quantize", 4, 32, 128, "fp16", "fp16", False, None, True) for side in ("k", "v")]
    else:
        dtypes, stats = ("fp16", "bf16", "fp32"), ("fp16", "fp32")
        for i, ((side, op), bits, group, d) in enumerate(
                itertools.product(KERNELS, (2, 4, 8), (32, 64, 128), (64, 80, 96, 128, 256))):
            table = op == "quantize" and i % 5 == 0
            cases.append((side, op, bits, group, d, dtypes[i % 3], stats[i // 3 % 2], bool(i % 2), None, table))
    failures = 0
    for side, op, bits, group, d, xd, sd, masked, cfg, *table in cases:
        table = bool(table and table[0])
        name = f"{side} {op:10s} b{bits} G{group:<3d} D{d:<3d} {xd}/{sd} masked={int(masked)} table={int(table)}"
        try:
            kernel, cfg = compile_kernel(side, op, bits=bits, group=group, head_dim=d, x_dtype=xd,
                                         stats_dtype=sd, masked=masked, cfg=cfg, table=table)
        except Exception as e:  # report every failure, then fail
            failures += 1
            print(f"FAIL {name}: {str(e)[-400:]}", flush=True)
            continue
        st = cubin_stats(kernel)
        per = st["sass"] / _elements_per_thread(side, group, d, cfg)
        spill = "  SPILLS" if st["stack"] else ""
        print(f"ok   {name} {cfg.kwargs} warps={cfg.num_warps} regs={st['regs']} instr/elem<={per:.1f} "
              f"bar={st['bar']} shfl={st['shfl']}{spill}", flush=True)
    print(f"{len(cases) - failures}/{len(cases)} compiled for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
