"""Benchmarks that are measured on an H200 but document a CPU smoke mode run end to end on
a CPU with tiny shapes, so that an API they call cannot change under them unnoticed. Their
figures here mean nothing; the rows and the JSON they write are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(module: str, *args: str, out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.mark.slow  # ~12 s each on a quiet 2-core box, 40 s while other work runs (a subprocess importing torch)
@pytest.mark.parametrize("paged", [False, True])
def test_layerwise_save_tiny_runs_on_a_cpu(paged, tmp_path):
    """``--tiny`` is documented as a smoke run on a CPU or a GPU: the stand-in forward, the
    whole ingest after it and the layer-wise writer (``ingest_layerwise``, or
    ``ingest_batch(..., layerwise=True)`` from pages) each run and store the prompt."""
    run_benchmark("layerwise_save", "--tiny", *(["--paged"] if paged else []), out=tmp_path)
    doc = json.loads((tmp_path / ("layerwise_save_paged.json" if paged else "layerwise_save.json")).read_text())
    rows = doc["rows"]
    assert doc["shape"] == "tiny"
    assert sorted({(r["codec"], r["case"]) for r in rows}) == [
        (codec, case) for codec in ("int4", "raw") for case in ("forward", "layerwise p=4", "whole")]
    assert all(r["kv"] == ("vllm pages" if paged else "layers") for r in rows)
    for r in rows:
        assert r["total_ms"] > 0 and r["forward_ms"] > 0 and len(r["ms_each"]) == doc["reps"]
        # save_ms is against the forward-only case of the same codec, measured in the same run
        forward = next(f for f in rows if f["codec"] == r["codec"] and f["case"] == "forward")
        assert r["save_ms"] == pytest.approx(r["total_ms"] - forward["total_ms"])
        if r["case"].startswith("layerwise"):
            assert r["mode"] and r["put_ms"] > 0  # the writer ran, one put_layer per layer


def test_trace_replay_quick_runs_sections_1_and_2_and_plots_beside_its_json(tmp_path, capsys):
    """``--quick`` is "sections 1 and 2 only": the goal's twelve store replays (section 5)
    made it take minutes. A run with ``--out`` draws its plot there, not over the committed
    docs/hit-rate.png."""
    from benchmarks import trace_replay

    trace = tmp_path / "trace.jsonl"  # the default trace's first requests: seconds, not minutes
    with (ROOT / "benchmarks" / "traces" / "mooncake_synthetic.jsonl").open() as f:
        trace.write_text("".join(line for _, line in zip(range(150), f)))
    docs_plot = ROOT / "docs" / "hit-rate.png"
    before = docs_plot.read_bytes()
    out = tmp_path / "out"
    assert trace_replay.main(["--trace", str(trace), "--quick", "--cpu-gib", "0.2", "--out", str(out)]) == 0
    doc = json.loads((out / "trace_replay.json").read_text())
    assert doc["anchor"] and doc["anchor_store_counting"] and doc["plan"]
    assert "goal" not in doc and "admission" not in doc and "shapes" not in doc
    assert {r["codec"] for r in doc["plan"]} == {"int4"}
    assert doc["vs_lru"] == [round(a["block_hit_rate"] / b["block_hit_rate"], 3) if b["block_hit_rate"] else None
                             for a, b in zip([r for r in doc["plan"] if r["policy"] == "arc"],
                                             [r for r in doc["plan"] if r["policy"] == "lru"])]
    if trace_replay.pyplot() is not None:
        assert (out / "hit-rate.png").read_bytes()[:4] == b"\x89PNG"
        assert f"plot: {out / 'hit-rate.png'}" in capsys.readouterr().out
    assert docs_plot.read_bytes() == before


def test_server_baseline_serves_an_exported_tree_of_this_layout(tmp_path):
    """``benchmarks.server --baseline REF`` runs ``cacheseek serve`` from ``git archive REF``.
    Its launcher loaded cacheseek.kernels from a top-level kernels/, which no tree has since
    the kernels moved into cacheseek/kernels/, so the baseline server never came up (60 s,
    then "did not come up")."""
    import httpx

    from benchmarks import server

    tree = server.export_tree("HEAD", tmp_path / "tree")
    proc, url = server.start_cacheseek(tmp_path, "baseline", "--cpu-bytes", "64MiB", "--disk-bytes", "0", tree=tree)
    try:
        assert httpx.get(url + "/readyz").status_code == 200
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, (tmp_path / "baseline.log").read_text()[-2000:]
