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
