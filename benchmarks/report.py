"""What every benchmark does at the end: print a table, write JSON, draw a plot if it can
(and redraw it later from the JSON: ``--plot-only FILE.json``)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": _cpus()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "") -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": command(), "machine": machine(), **payload}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def command() -> str:
    """The command line that ran this benchmark, as one would type it again."""
    module = Path(sys.argv[0]).stem
    return " ".join(["python -m benchmarks." + module, *sys.argv[1:]])


# -- plots ------------------------------------------------------------------------------
#
# Every benchmark that draws a plot has a ``plot(docs, out_dir)`` that draws it from what
# ``write_json`` wrote, so ``--plot-only FILE.json`` redraws it without measuring again.


def add_plot_only(ap: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--plot-only FILE.json``: redraw the plot from results, measure nothing; the PNG goes
    to ``--out`` (default: beside the JSON)."""
    ap.add_argument("--plot-only", nargs="+" if several else 1, type=Path, metavar="FILE.json", default=None,
                    help="redraw the plot from this JSON (measures nothing); the PNG goes to --out, "
                         "default beside the JSON" + ("; later files fill cells missing from earlier ones"
                                                       if several else ""))


def plot_only(args: argparse.Namespace, plot: Callable[[list[dict[str, Any]], Path], Path | None]) -> bool:
    """Run ``plot`` on the JSON files named by ``--plot-only``; False if there are none."""
    if not args.plot_only:
        return False
    docs = [load(f) for f in args.plot_only]
    png = plot(docs, args.out or Path(args.plot_only[0]).parent)
    print(f"wrote {png}" if png else "matplotlib is not installed: no plot")
    return True


def load(path: Path) -> dict[str, Any]:
    """A results JSON, with ``source``: its path (from the repository root when inside it)."""
    path = Path(path)
    doc = json.loads(path.read_text())
    try:
        doc["source"] = str(path.resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        doc["source"] = str(path)
    return doc


def redraw(plot: Callable[[list[dict[str, Any]], Path], Path | None], json_path: Path) -> None:
    """After a run: draw the plot from the JSON just written, beside it."""
    png = plot([load(json_path)], json_path.parent)
    if png:
        print(f"wrote {png}")


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def source_line(doc: dict[str, Any]) -> str:
    """Where a plot's figures come from: the JSON, when it was written, and on what machine."""
    m = doc.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpus', '?')}-core CPU"
    parts = [doc.get("source") or f"{doc.get('benchmark', '?')}.json", f"written {doc.get('when', '?')}",
             f"{where}, torch {m.get('torch', '?')}"]
    return "   ".join(parts)


def save(fig: Any, out_dir: Path, name: str, *, title: str, note: str = "") -> Path:
    """Title the figure, put ``note`` (the source of its figures) under it, and write
    ``name``.png with nothing cut off."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=12, fontweight="bold", y=1.0, va="bottom")
    if note:  # under everything drawn so far (tick labels included), wherever that ends
        renderer = fig.canvas.get_renderer()
        bottom = fig.get_tightbbox(renderer).y0 / fig.get_figheight()
        fig.text(0.5, bottom - 0.02, note, ha="center", va="top", fontsize=8, color="0.35")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def bars(ax: Any, labels: Sequence[str], series: dict[str, Sequence[float | None]], *, log: bool = False,
         fmt: str = "{:.3g}", colors: Sequence[str] | None = None, label_values: bool = True) -> None:
    """Grouped bars on ``ax``, each labelled with its value (room is left above the tallest
    for its label); a None value draws no bar."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (n - 1) / 2) * width for x in range(len(labels))]
        kept = [(x, v) for x, v in zip(xs, values) if v is not None]
        color = colors[i] if colors else None
        drawn = ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name, color=color)
        if label_values:
            ax.bar_label(drawn, labels=[fmt.format(v) for _, v in kept], fontsize=7, padding=1, rotation=90)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30 if max(map(len, labels), default=0) > 6 else 0,
                       ha="right" if max(map(len, labels), default=0) > 6 else "center")
    values = [v for vs in series.values() for v in vs if v is not None and v > 0]
    if not values:
        return
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 2, max(values) * 6)
    else:
        ax.set_ylim(0, max(values) * 1.2)


def legend_outside(ax: Any) -> None:
    """The legend to the right of the axes, where it cannot cover a bar."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
