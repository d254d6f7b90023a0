"""Launch settings for the KIVI kernels, as data.

Two tile shapes (see the kernels in ``kivi.py``), both with the head dim D (contiguous in
K and V) innermost so that a warp's loads are coalesced along D:

- ``"k"`` (groups of G tokens per channel): a program owns ``GROUPS`` consecutive token
  groups of one row and ``BLOCK_D`` channels; each group is walked as PER [NW, BLOCK_D]
  tiles (NW = words per channel per group).
- ``"v"`` (groups of G channels per token): a program owns ``BLOCK_T`` tokens of one row
  and the whole (padded) head dim.

``pick`` is the default (deterministic; no first-call tuning stall in the store's ingest
path), chosen from a sweep on an H200 (numbers in the helpers' docstrings and in
docs/kernels.md). ``candidates`` is what ``python -m benchmarks.kernels --sweep`` times on
the GPU, and what ``triton.autotune`` tries when ``CACHESEEK_KIVI_AUTOTUNE=1``;
``v_quantize_candidates`` the wider V-quantize sweep of ``--sweep-v`` (tiles and cache hints).
"""

from __future__ import annotations

import functools
import os

import triton

AUTOTUNE_ENV = "CACHESEEK_KIVI_AUTOTUNE"


def padded_head_dim(head_dim: int) -> int:
    return 1 << (max(head_dim, 16) - 1).bit_length()


def _k(block_d: int, groups: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_D": block_d, "GROUPS": groups}, num_warps=warps)


def _v(block_t: int, warps: int, op: str = "dequantize", hints: tuple[str, str] = ("", "")) -> triton.Config:
    """V tiles; quantize also takes its cache hints: (eviction policy of the KV loads, cache
    modifier of the code stores), "" for none."""
    if op == "quantize":
        return triton.Config({"BLOCK_T": block_t, "X_EVICT": hints[0], "Q_CACHE": hints[1]}, num_warps=warps)
    return triton.Config({"BLOCK_T": block_t}, num_warps=warps)


# Cache hints the V quantize sweep tries: the KV is read once (evict first), the codes are
# written once and copied to the host next (streaming stores).
V_HINTS = (("", ""), ("evict_first", ""), ("evict_first", ".cs"), ("", ".cs"))


def _k_tile(bits: int, group: int, head_dim_pad: int) -> tuple[int, int]:
    """(BLOCK_D, warps) for the K kernels: about 16 elements (two 16-byte fp16 vectors)
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
    if side == "k":
        block_d, warps = _k_tile(bits, group, dp)
        groups = 2 if group >= 64 and (tokens // group) % 2 == 0 else 1
        return _k(block_d, groups, warps)
    if side == "v":
        # 32 elements per thread: BLOCK_T 32 at D=128 ran 1,975 GB/s on the H200 sweep
        # (int4 G=32) against 1,723 at 64.
        warps = 4
        block_t = max(8, min(128, 32 * 32 * warps // dp))
        return _v(block_t, warps, op)
    raise ValueError(f"side: must be 'k' or 'v', got {side!r}")


def candidates(side: str, op: str, group: int, head_dim: int) -> list[triton.Config]:
    """Configs worth timing for this side, op, group size and head dim (``pick``'s among them)."""
    dp = padded_head_dim(head_dim)
    out: list[triton.Config] = []
    if side == "k":
        for block_d in sorted({min(dp, 64), min(dp, 128)}):
            for warps in (1, 2, 4, 8):
                for groups in (1, 2, 4):
                    out.append(_k(block_d, groups, warps))
    elif side == "v":
        for warps in (4, 8):
            for per_thread in (32, 64):
                block_t = max(8, min(128, per_thread * 32 * warps // dp))
                out.append(_v(block_t, warps, op))
    else:
        raise ValueError(f"side: must be 'k' or 'v', got {side!r}")
    return _unique(out)


def v_quantize_candidates(group: int, head_dim: int) -> list[triton.Config]:
    """The wider V-quantize sweep (``benchmarks.kernels --sweep-v``): tiles of 16 to 64
    elements per thread on 2, 4 or 8 warps, each with every cache hint in ``V_HINTS``."""
    dp = padded_head_dim(head_dim)
    out = []
    for warps in (2, 4, 8):
        for per_thread in (16, 32, 64):
            block_t = max(8, min(128, per_thread * 32 * warps // dp))
            for hints in V_HINTS:
                out.append(_v(block_t, warps, "quantize", hints))
    return _unique(out)


def _unique(configs_: list[triton.Config]) -> list[triton.Config]:
    seen, unique = set(), []
    for cfg in configs_:
        key = (tuple(sorted(cfg.kwargs.items())), cfg.num_warps)
        if key not in seen:
            seen.add(key)
            unique.append(cfg)
    return unique


def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"
