"""Every plot in docs/ is redrawn from a results JSON by the benchmark that owns it
(``--plot-only FILE.json``), without measuring anything."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# benchmark module -> the results it draws docs/<plot>.png from (as docs/performance.md says)
PLOTS = {
    "store": ["h200/store.json"],
    "kernels": ["h200/kernels.json"],
    "ttft": ["h200/ttft.json", "h200/ttft_fixed_cells.json"],
    "quality": ["quality.json"],
    "codec_error": ["codec_error.json"],
    "server": ["server.json"],
    "redis_tier": ["redis_tier.json"],
    "trace_replay": ["trace_replay.json"],
}
PNG_NAME = {"trace_replay": "hit-rate.png"}  # else the JSON's name
# docs/precision.png: the quick set's table, then the later runs' rows (docs/precision.md)
PRECISION = ["precision.json", "precision_near_miss.json", "precision_variants.json", "precision_clip.json",
             "precision_rotate.json"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_plot_only_redraws_the_docs_plot_from_json(name, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    files = [str(RESULTS / f) for f in PLOTS[name]]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--plot-only", *files, "--out", str(tmp_path)])
    module.main()
    png = tmp_path / PNG_NAME.get(name, f"{Path(PLOTS[name][0]).stem}.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {png}" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [png]  # a plot, and no JSON: nothing was measured
    assert (ROOT / "docs" / png.name).is_file()  # the committed plot this redraws


def test_ttft_plot_fills_failed_cells_from_a_later_file():
    from benchmarks import report, ttft

    docs = [report.load(RESULTS / f) for f in PLOTS["ttft"]]
    first = ttft.measured_cells(docs[:1])
    merged = ttft.measured_cells(docs)
    assert (4096, "cpu", "raw") not in first and (4096, "cpu", "raw") in merged
    # a cell the first file measured keeps its first measurement
    assert merged[(16384, "cpu", "int4")] is first[(16384, "cpu", "int4")]


def test_plot_only_redraws_the_precision_plot_from_json(tmp_path, monkeypatch, capsys):
    module = importlib.import_module("benchmarks.quality")
    monkeypatch.setattr(sys, "argv", ["quality.py", "--plot-only", *(str(RESULTS / f) for f in PRECISION),
                                      "--out", str(tmp_path)])
    module.main()
    png = tmp_path / "precision.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {png}" in capsys.readouterr().out


def test_precision_plot_adds_the_later_runs_rows_once(tmp_path, monkeypatch, capsys):
    """docs/precision.png: precision.json, then --near-miss and --variants rows numbered on;
    a row a later run repeats (same codec, group, bits) is drawn once."""
    module = importlib.import_module("benchmarks.quality")
    files = [RESULTS / f for f in ("precision.json", "precision_near_miss.json", "precision_variants.json")]
    monkeypatch.setattr(sys, "argv", ["quality.py", "--plot-only", *map(str, files), "--out", str(tmp_path)])
    drawn = []
    real = module.plot_bits
    monkeypatch.setattr(module, "plot_bits", lambda docs, out: drawn.append(docs) or real(docs, out))
    module.main()
    png = tmp_path / "precision.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {png}" in capsys.readouterr().out
    assert [d["benchmark"] for d in drawn[0]] == ["precision", "precision_near_miss", "precision_variants"]


def plot_commands(text: str) -> list[tuple[str, list[str]]]:
    """(benchmark, the results files it is given) of each ``--plot-only ... --out docs`` command
    in ``text``, paths relative to benchmarks/results/."""
    text = text.replace("$R/", "benchmarks/results/").replace("\\\n", " ").replace("\n", " ")
    return [(m.group(1), [f.removeprefix("benchmarks/results/") for f in m.group(2).split()])
            for m in re.finditer(r"python -m benchmarks\.(\w+)\s+--plot-only\s+((?:benchmarks/results/\S+\s+)+)--out docs",
                                 text)]


def test_the_docs_redraw_commands_give_each_plot_the_files_the_tests_redraw_it_from():
    """performance.md's block redraws every plot in docs/; its precision line gave only
    precision.json, so running it as shown dropped the later runs' rows (16-32) from
    docs/precision.png, which precision.md's own command draws from five files."""
    block = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").split("R=benchmarks/results", 1)[1]
    shown = sorted(plot_commands(block.split("```", 1)[0]))
    expected = sorted([(name, files) for name, files in PLOTS.items()] + [("quality", PRECISION)])
    assert shown == expected
    assert plot_commands((ROOT / "docs" / "precision.md").read_text(encoding="utf-8")) == [("quality", PRECISION)]
