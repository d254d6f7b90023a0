"""Sizing tiers from a trace: replay it for each codec and budget, next to the references.

Shared by ``benchmarks/trace_replay.py`` and ``cacheseek plan``. One row per (codec, CPU
budget, policy): hit rates (blocks and tokens), hits per tier, real bytes written and read
per tier, evictions, and the references (Belady's optimum, the infinite cache) at the most
distinct blocks the tiers hold together (:func:`reference_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..host_memory import memory_limit
from ..layout import KVLayout
from ..quant import KIVI, Raw
from ..store.disk import DEFAULT_ALLOC_UNIT, block_charge
from ..units import format_size
from . import reference
from .format import Request
from .replay import (CPU_BLOCK_BOOKKEEPING, DISK_BLOCK_BOOKKEEPING, ProgressBar, ReplayResult, ReplaySpec,
                     ReplayStopped, StandInFrames, arena_slack, check_block_tokens, check_disk_room, frame_nbytes,
                     replay)

LAYOUTS: dict[str, KVLayout] = {
    "llama-3-8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16"),
    "llama-3-70b": KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, dtype="float16"),
    "qwen2.5-7b": KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
    "smollm2-135m": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16"),
}

CODECS: dict[str, Callable[[], Any]] = {
    "raw": Raw,
    "int8": lambda: KIVI(bits=8, group_size=32),
    "int4": lambda: KIVI(bits=4, group_size=32),
    "int2": lambda: KIVI(bits=2, group_size=32),
}


def layout_of(text: str) -> KVLayout:
    """A named layout, or ``LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]``."""
    if text in LAYOUTS:
        return LAYOUTS[text]
    parts = text.split(",")
    try:
        dims = [int(p) for p in parts[:3]] if len(parts) in (3, 4) else None
    except ValueError:
        dims = None
    if dims is not None:
        try:
            return KVLayout(dims[0], dims[1], dims[2], *(parts[3:] or ["float16"]))
        except ConfigError as exc:  # a zero dimension, an unknown dtype: say which
            raise ConfigError(f"layout: {text!r}: {exc}") from None
    raise ConfigError(f"layout: {text!r} is neither one of {sorted(LAYOUTS)} nor LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]")


def default_codecs(layout: KVLayout) -> list[str]:
    """The codecs ``cacheseek plan`` replays unless told: raw alone for fp8 KV, which KIVI
    does not encode."""
    return ["raw"] if layout.fp8 else list(CODECS)


def codec_of(name: str) -> Any:
    if name not in CODECS:
        raise ConfigError(f"codec: {name!r} is not one of {sorted(CODECS)}")
    return CODECS[name]()


@dataclass
class PlanRow:
    codec: str
    cpu_bytes: int
    disk_bytes: int
    frame_nbytes: int
    cpu_blocks: int
    disk_blocks: int
    reference_blocks: int
    policy: str
    result: ReplayResult
    belady: reference.RefResult
    infinite: reference.RefResult
    stand_in_nbytes: int

    def real_bytes(self, stand_in: int) -> int:
        return stand_in // self.stand_in_nbytes * self.frame_nbytes

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        tiers = {}
        for t in r.tiers:
            entry = {"hits": r.hits_by_tier.get(t["name"], 0), "bytes_written": self.real_bytes(t["bytes_in"]),
                     "bytes_read": self.real_bytes(t["bytes_out"]), "evictions": t["evictions"],
                     "promotions": t["promotions"], "demotions": t["demotions"], "blocks_at_end": t["blocks"]}
            if "admission" in t:
                adm = dict(t["admission"])
                adm["not_admitted_bytes"] = self.real_bytes(adm.get("not_admitted_bytes", 0))
                entry["admission"] = adm
            tiers[t["name"]] = entry
        return {
            "codec": self.codec, "policy": self.policy, "cpu_bytes": self.cpu_bytes, "disk_bytes": self.disk_bytes,
            "frame_nbytes": self.frame_nbytes, "cpu_blocks": self.cpu_blocks, "disk_blocks": self.disk_blocks,
            "reference_blocks": self.reference_blocks,
            "disk_admit_after_uses": r.spec.disk_admit_after_uses, "full_blocks_only": r.spec.full_blocks_only,
            "block_hit_rate": r.block_hit_rate, "token_hit_rate": r.token_hit_rate,
            "hit_blocks": r.hit_blocks, "requested_blocks": r.requested_blocks,
            "hit_tokens": r.hit_tokens, "requested_tokens": r.requested_tokens,
            "belady_block_hit_rate": self.belady.block_hit_rate, "belady_token_hit_rate": self.belady.token_hit_rate,
            "infinite_block_hit_rate": self.infinite.block_hit_rate,
            "infinite_token_hit_rate": self.infinite.token_hit_rate,
            "of_belady": r.block_hit_rate / self.belady.block_hit_rate if self.belady.block_hit_rate else None,
            "tiers": tiers, "replay_seconds": round(r.seconds, 2),
        }


def reference_blocks(spec: ReplaySpec) -> int:
    """The most distinct blocks the tiers of ``spec`` hold together: the references' budget.
    Written through and admitting every block (the store's default, and the plan's), the
    disk takes every block the CPU tier takes and sees every use, so the smaller tier holds
    blocks the larger one holds too: the larger tier's count. Exactly so under LRU (the
    smaller tier holds the most recently used of the larger one's); ARC's tiers, each
    adapting to its own size, part a little (docs/hit-rate.md). Written back, or holding new
    blocks back from the disk until used again (``disk_admit_after_uses`` > 1), the CPU
    tier hands the disk its victims, each block in one tier: both tiers' counts together."""
    if spec.write_through and spec.disk_admit_after_uses <= 1:
        return max(spec.cpu_blocks, spec.disk_blocks)
    return spec.cpu_blocks + spec.disk_blocks


def plan(trace: Sequence[Request], *, layout: KVLayout, codecs: Sequence[str], cpu_bytes: Sequence[int],
         disk_bytes: int = 0, policies: Sequence[str] = ("arc", "lru"), disk_admit_after_uses: int = 1,
         block_tokens: int = 512, progress: bool = True, full_blocks_only: bool = False,
         stop: Callable[[], bool] | None = None) -> list[PlanRow]:
    """Replay ``trace`` for every codec x CPU budget x policy (the disk budget fixed).
    ``full_blocks_only``: the store's counting, a request's partial last block never stored
    (``cacheseek.trace.replay``), in the replay and the references alike. ``stop()``, asked
    before each reference and each replay's request, ends the plan with ``ReplayStopped``."""

    def check_stop() -> None:
        if stop is not None and stop():
            raise ReplayStopped("stopped before the replays were done")

    check_block_tokens(block_tokens)
    # Every budget is checked before the first replay, so a bad one costs no replay time.
    nbytes_of = {name: frame_nbytes(layout, codec_of(name), block_tokens) for name in codecs}
    stand_in = StandInFrames(block_tokens).nbytes
    distinct = reference.distinct_blocks(trace, block_tokens, full_blocks_only)
    for codec_name, nbytes in nbytes_of.items():
        charge = block_charge(nbytes, DEFAULT_ALLOC_UNIT)
        for cpu in cpu_bytes:
            if cpu // nbytes + disk_bytes // charge == 0:
                raise ConfigError(
                    f"cpu_bytes {cpu} (disk_bytes {disk_bytes}) holds 0 blocks of a {nbytes}-byte {codec_name} frame "
                    f"({block_tokens} tokens a block); give cpu_bytes at least {nbytes} or disk_bytes at least "
                    f"{charge} (the frame and its sidecar in whole 4 KiB file-system blocks)")
            # The replay keeps each block it holds in memory: a stand-in frame and the tiers'
            # bookkeeping (a disk tier's too), for at most the trace's distinct blocks. Past
            # the memory this process may use it would be killed; said here, before any replay.
            cpu_held = min(cpu // nbytes, distinct)
            disk_held = min(disk_bytes // charge, distinct)
            held = cpu_held * stand_in
            need = held + arena_slack(held, stand_in) + cpu_held * CPU_BLOCK_BOOKKEEPING \
                + disk_held * DISK_BLOCK_BOOKKEEPING
            limit, where = memory_limit()
            if limit and need > limit:
                disk = (f" and disk_bytes {disk_bytes} ({format_size(disk_bytes)}) {disk_bytes // charge:,}"
                        if disk_bytes else "")
                raise ConfigError(
                    f"cpu_bytes {cpu} ({format_size(cpu)}) holds {cpu // nbytes:,} blocks of a {nbytes}-byte "
                    f"{codec_name} frame{disk}; of the trace's {distinct:,} distinct blocks the replay would hold "
                    f"{cpu_held:,} in the CPU tier" + (f" and {disk_held:,} on disk" if disk_bytes else "") +
                    f", more than it can: it keeps {stand_in + CPU_BLOCK_BOOKKEEPING} bytes in memory for a CPU-tier "
                    f"block (a {stand_in}-byte stand-in and the tier's bookkeeping)"
                    + (f" and {DISK_BLOCK_BOOKKEEPING} for a disk-tier block" if disk_bytes else "") +
                    f", {format_size(need)} in all, and this process may use {format_size(limit)} ({where}); "
                    "give a smaller cpu_bytes" + (" or disk_bytes" if disk_bytes else ""))
    check_stop()
    check_disk_room(max(disk_bytes // block_charge(n, DEFAULT_ALLOC_UNIT) for n in nbytes_of.values()), block_tokens)
    check_stop()
    nxt = reference.next_uses(trace, block_tokens, full_blocks_only)
    inf = reference.infinite(trace, block_tokens, full_blocks_only)
    rows = []
    belady_cache: dict[int, reference.RefResult] = {}
    for codec_name in codecs:
        nbytes = nbytes_of[codec_name]
        for cpu in cpu_bytes:
            # A disk tier charges a block its frame and sidecar in whole allocation units
            # (4 KiB, ext4's and XFS's), as its budget counts them.
            cpu_blocks, disk_blocks = cpu // nbytes, disk_bytes // block_charge(nbytes, DEFAULT_ALLOC_UNIT)
            for policy in policies:
                spec = ReplaySpec(cpu_blocks=cpu_blocks, disk_blocks=disk_blocks, policy=policy,
                                  disk_admit_after_uses=disk_admit_after_uses, full_blocks_only=full_blocks_only)
                ref = reference_blocks(spec)
                check_stop()
                if ref not in belady_cache:
                    belady_cache[ref] = reference.belady_prefix(trace, max(ref, 1), block_tokens, nxt=nxt,
                                                                full_blocks_only=full_blocks_only)
                label = f"{codec_name} cpu={_gib(cpu)} {policy}"
                bar = ProgressBar(f"{label:<28}") if progress else None
                result = replay(trace, spec, block_tokens=block_tokens, progress=bar, stop=stop)
                rows.append(PlanRow(codec_name, cpu, disk_bytes, nbytes, cpu_blocks, disk_blocks, ref, policy, result,
                                    belady_cache[ref], inf, stand_in))
    return rows


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g}GiB"


TABLE_COLUMNS = ("codec", "cpu", "ref blocks", "policy", "hit % (blocks)", "hit % (tokens)", "belady %", "of belady",
                 "infinite %", "cpu hits", "disk hits", "written GiB", "read GiB", "evictions")


def table_rows(rows: Sequence[PlanRow]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        d = row.to_dict()
        tiers = d["tiers"]
        out.append({
            "codec": row.codec, "cpu": _gib(row.cpu_bytes), "ref blocks": row.reference_blocks,
            "policy": row.policy, "hit % (blocks)": 100 * d["block_hit_rate"],
            "hit % (tokens)": 100 * d["token_hit_rate"], "belady %": 100 * d["belady_block_hit_rate"],
            "of belady": d["of_belady"], "infinite %": 100 * d["infinite_block_hit_rate"],
            "cpu hits": tiers.get("cpu", {}).get("hits", 0), "disk hits": tiers.get("disk", {}).get("hits", 0),
            "written GiB": sum(t["bytes_written"] for t in tiers.values()) / (1 << 30),
            "read GiB": sum(t["bytes_read"] for t in tiers.values()) / (1 << 30),
            "evictions": sum(t["evictions"] for t in tiers.values()),
        })
    return out


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> str:
    def fmt(v: Any) -> str:
        if v is None:  # a share of nothing (Belady hits nothing: a trace without reuse)
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def plot_format_problem(path: str) -> str | None:
    """Why :func:`plot` could not draw into ``path`` (its suffix names no format, or one
    matplotlib does not write), or None. Without matplotlib (the plot is then skipped) a
    name without a suffix is refused all the same: the same command must not pass here
    and fail where matplotlib is installed."""
    suffix = Path(path).suffix.lstrip(".").lower()
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return None if suffix else "no suffix names the format; give one (png, svg, pdf, ...)"
    formats = ", ".join(sorted(FigureCanvasAgg.get_supported_filetypes()))
    if not suffix:
        # matplotlib would pick its default format and add that suffix: another file than
        # the one named, written over if it exists.
        return f"no suffix names the format; give one matplotlib writes ({formats})"
    if suffix not in FigureCanvasAgg.get_supported_filetypes():
        return f"format {suffix!r} is not one matplotlib writes ({formats})"
    return None


def plot(rows: Sequence[PlanRow], path: str, title: str) -> bool:
    """Hit rate against the CPU budget: one line per codec and policy, Belady's dashed, the
    infinite cache flat. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    codecs = list(dict.fromkeys(r.codec for r in rows))
    policies = list(dict.fromkeys(r.policy for r in rows))
    colors = dict(zip(codecs, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = dict(zip(policies, ["-", ":", "-."]))
    for codec in codecs:
        mine = [r for r in rows if r.codec == codec]
        xs = sorted({r.cpu_bytes for r in mine})
        gib = [x / (1 << 30) for x in xs]
        for policy in policies:
            ys = [100 * next(r.result.block_hit_rate for r in mine if r.cpu_bytes == x and r.policy == policy) for x in xs]
            ax.plot(gib, ys, styles[policy], marker="o", color=colors[codec], label=f"{codec} {policy}")
        ys = [100 * next(r.belady.block_hit_rate for r in mine if r.cpu_bytes == x) for x in xs]
        ax.plot(gib, ys, "--", color=colors[codec], alpha=0.6, label=f"{codec} Belady")
    ax.axhline(100 * rows[0].infinite.block_hit_rate, color="black", linewidth=1, label="infinite cache")
    positive = [r.cpu_bytes / (1 << 30) for r in rows if r.cpu_bytes > 0]
    if len(positive) == len(rows):
        ax.set_xscale("log", base=2)
    else:  # a disk-only row (CPU budget 0): a log axis drops it, or has no point at all
        ax.set_xscale("symlog", base=2, linthresh=min(positive, default=1.0))
    ax.set_xlabel("CPU tier budget (GiB)")
    ax.set_ylabel("hit rate (% of requested blocks)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
