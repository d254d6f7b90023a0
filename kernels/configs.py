"""Launch settings for the KIVI kernels, as data.

Two tile shapes (see the kernels in ``kivi.py``), both with the head dim D (contiguous in
K and V) innermost so that a warp's loads are coalesced along D:

- ``"k"`` (groups of G tokens per channel): a program owns ``GROUPS`` consecutive token
  groups of one row and ``BLOCK_D`` channels, ``VEC`` channels per thread. Each loop step
  is a ``[G, BLOCK_D]`` tile.
- ``"v"`` (groups of G channels per token): a program owns ``BLOCK_T`` tokens of one row
  and the whole (padded) head dim.

``pick`` is the default (deterministic; no first-call tuning stall in the store's ingest
path). ``candidates`` is what ``python -m benchmarks.kernels --sweep`` times on the GPU,
and what ``triton.autotune`` tries when ``CACHESEEK_KIVI_AUTOTUNE=1``.

The defaults target ~64 elements per thread per tile: enough loads in flight per SM to
cover HBM latency at 16-32 resident warps, and ~100 registers or fewer. Quantize K uses
VEC=2 with just enough warps to span BLOCK_D / 2 lanes (more for G > 32), so a thread
holds whole token groups and the group min/max and packing need no cross-thread
reduction; this was chosen from compiled-code statistics (instructions per element,
registers, barriers) on sm_90, not yet from H200 timings.
"""

from __future__ import annotations

import functools
import os

import triton

AUTOTUNE_ENV = "CACHESEEK_KIVI_AUTOTUNE"
_ELEMS_PER_THREAD = 64


def padded_head_dim(head_dim: int) -> int:
    return 1 << (max(head_dim, 16) - 1).bit_length()


def _k(block_d: int, vec: int, groups: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_D": block_d, "VEC": vec, "GROUPS": groups}, num_warps=warps)


def _v(block_t: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_T": block_t}, num_warps=warps)


def _k_warps(group: int, block_d: int) -> int:
    return max(1, min(8, group * block_d // (32 * _ELEMS_PER_THREAD)))


def k_impl() -> str:
    """Which K kernels run: "2d" (default) or "4d" (the first design, for comparison)."""
    return os.environ.get("CACHESEEK_KIVI_K_IMPL", "2d")


def _k2_tile(bits: int, group: int, head_dim_pad: int) -> tuple[int, int]:
    """(BLOCK_D, warps) for the 2-D K kernels: about 16 elements (two 16-byte fp16 vectors)
    per thread per [NW, BLOCK_D] tile, and BLOCK_D 64 once a group has more than 4 words
    per channel. From the H200 sweep (2026-11-30, int4): G=32 at BLOCK_D 128 and 1 warp ran
    2,364 GB/s against 1,844 at 2 warps; G=128 at BLOCK_D 64 and 2 warps 2,118 against
    1,045 at BLOCK_D 128 and 8 warps."""
    words = group * bits // 32
    block_d = min(head_dim_pad, 128 if words <= 4 else 64)
    return block_d, max(1, min(8, words * block_d // (32 * 16)))


@functools.lru_cache(maxsize=256)
def pick(side: str, op: str, group: int, head_dim: int, tokens: int, bits: int = 4) -> triton.Config:
    """The default config for ``side`` ("k"/"v") and ``op`` ("quantize"/"dequantize")."""
    dp = padded_head_dim(head_dim)
    if side == "k" and k_impl() == "2d":
        block_d, warps = _k2_tile(bits, group, dp)
        groups = 2 if group >= 64 and (tokens // group) % 2 == 0 else 1
        return _k(block_d, 8, groups, warps)
    if side == "k":
        block_d = min(dp, 128)
        warps = _k_warps(group, block_d)
        # Two small groups per program when that leaves no ragged tail (an unmasked
        # kernel); with G >= 64 the loop's extra registers cost more occupancy than the
        # program setup it saves (~190 vs ~115 registers at G=128 on sm_90).
        groups = 2 if group == 32 and (tokens // group) % 2 == 0 else 1
        return _k(block_d, 2 if op == "quantize" else 8, groups, warps)
    if side == "v":
        # 32 elements per thread: BLOCK_T 32 at D=128 ran 1,975 GB/s on the H200 sweep
        # (int4 G=32) against 1,723 at 64.
        warps = 4
        block_t = max(8, min(128, 32 * 32 * warps // dp))
        return _v(block_t, warps)
    raise ValueError(f"side: must be 'k' or 'v', got {side!r}")


def candidates(side: str, op: str, group: int, head_dim: int) -> list[triton.Config]:
    """Configs worth timing for this side, op, group size and head dim (``pick``'s among them)."""
    dp = padded_head_dim(head_dim)
    out: list[triton.Config] = []
    if side == "k" and k_impl() == "2d":
        for block_d in sorted({min(dp, 64), min(dp, 128)}):
            for warps in (1, 2, 4, 8):
                for groups in (1, 2, 4):
                    out.append(_k(block_d, 8, groups, warps))
    elif side == "k":
        vecs = (2, 8) if op == "quantize" else (8,)
        for block_d in sorted({min(dp, 64), min(dp, 128)}):
            for vec in vecs:
                base = _k_warps(group, block_d)
                for warps in sorted({base, min(8, 2 * base)}):
                    for groups in (1, 2):
                        out.append(_k(block_d, vec, groups, warps))
    elif side == "v":
        for warps in (4, 8):
            for per_thread in (32, 64):
                block_t = max(8, min(128, per_thread * 32 * warps // dp))
                out.append(_v(block_t, warps))
    else:
        raise ValueError(f"side: must be 'k' or 'v', got {side!r}")
    seen, unique = set(), []
    for cfg in out:
        key = (tuple(sorted(cfg.kwargs.items())), cfg.num_warps)
        if key not in seen:
            seen.add(key)
            unique.append(cfg)
    return unique


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"
