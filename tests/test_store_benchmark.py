"""The store benchmark's engine modes (``--paged``, ``--paged --mla``, ``--batches``, ``--fresh``,
``--fresh --policy arc,lru``; run for real
on an H200 by ``scripts/h200.sh``) run end to end on a CPU with tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--paged", "--paged --mla", "--batches", "--fresh", "--fresh --policy arc,lru"])
def test_store_engine_modes_run_on_a_cpu(mode, tmp_path):
    """The store benchmark's engine modes (run for real on an H200) with tiny shapes."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.store", *mode.split(), "--tiny", "--blocks", "1", "--reps", "1",
                           "--codecs", "raw,int4", "--out", str(tmp_path)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (out,) = tmp_path.glob("store_*.json")
    doc = json.loads(out.read_text())
    rows = [r for key, value in doc.items() if isinstance(value, list) for r in value if isinstance(r, dict)]
    assert rows and all(r["gbps"] > 0 for r in rows)
    if "--mla" in mode:  # the latent's layout, in MLA latent pages
        assert doc["layout"]["num_kv_heads"] == 1 and out.name == "store_paged_mla.json"
        assert {r["kv"] for r in rows} == {"contiguous", "MLA latent pages of 16"}
    if "--policy" in mode:  # every policy, both calls, each with its ratio to LRU and the same evictions
        assert sorted((r["policy"], r["op"]) for r in rows if r["codec"] == "int4") == [
            ("arc", "ingest"), ("arc", "materialize"), ("lru", "ingest"), ("lru", "materialize")]
        assert all(r["vs_lru"] > 0 and r["evictions"] > 0 for r in rows)
