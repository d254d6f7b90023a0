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


def printed_columns(stdout: str) -> set[str]:
    """The column names of every table ``benchmarks.report.table`` printed."""
    lines = stdout.splitlines()
    return {c.strip() for head, rule in zip(lines, lines[1:]) if head.startswith("| ") and rule.startswith("|-")
            for c in head.strip("|").split("|")}


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


@pytest.mark.slow  # ~15 s on a quiet 2-core box (a 29 MB block through Raw and KIVI, twice each)
def test_device_staging_runs_on_a_cpu_with_pooled_over_plain_per_row(tmp_path):
    """The pool and the plain way (a pool of cap 0) in one run; each row carries pooled over
    plain of the same bytes or codec, in the JSON and in the printed table."""
    proc = run_benchmark("device_staging", "--device", "cpu", "--blocks", "1", "--reps", "1", "--buffer-reps", "10",
                         out=tmp_path)
    doc = json.loads((tmp_path / "device_staging.json").read_text())
    buffers, paths = doc["buffers"], doc["paths"]
    cases = ("pool take + release", "torch.empty + record_stream")
    assert [(r["case"], r["bytes"]) for r in buffers] == [(c, nbytes) for nbytes in (1 << 20, 64 << 20) for c in cases]
    for pooled, plain in zip(buffers[::2], buffers[1::2]):
        assert pooled["vs_plain"] == pytest.approx(pooled["us_per_buffer"] / plain["us_per_buffer"])
        assert plain["vs_plain"] == 1.0
    assert [(r["codec"], r["staging"]) for r in paths] == [
        (codec, mode) for codec in ("raw", "kivi") for mode in ("pool", "plain (cap 0)")]
    for pooled, plain in zip(paths[::2], paths[1::2]):
        # On the host nothing is staged: the ingest encodes into the tier's slots and the
        # materialize decodes each frame from its own bytes (on a GPU both stage).
        assert plain["one_off"] == pooled["one_off"] == 0
        for key in ("ingest", "materialize"):
            assert pooled[f"{key}_vs_plain"] == pytest.approx(pooled[f"{key}_ms"] / plain[f"{key}_ms"])
            assert plain[f"{key}_vs_plain"] == 1.0
    assert {"vs_plain", "ingest_vs_plain", "materialize_vs_plain"} <= printed_columns(proc.stdout)


@pytest.mark.slow  # ~10 s on a quiet 2-core box
@pytest.mark.parametrize("decode", [False, True])
def test_layerwise_host_runs_on_a_cpu_against_a_plain_copy_of_its_bytes(decode, tmp_path):
    """Every row is against a plain copy of the load's stored bytes measured in the same run;
    with ``--decode``, also against the contiguous materialize of the same run."""
    proc = run_benchmark("layerwise_host", "--blocks", "2", "--repeats", "2", *(["--decode"] if decode else []),
                         out=tmp_path)
    doc = json.loads((tmp_path / "layerwise_host.json").read_text())
    rows = {r["step"].split(":")[0]: r for r in doc["rows"]}
    base = rows["baseline"]
    assert doc["baseline"]["ms"] == base["ms"] > 0 and base["vs_copy"] == 1.0
    assert doc["baseline"]["bytes"] > 0 and doc["blocks"] == 2 and len(doc["issue_per_group"]) > 1
    handle = rows["materialize(layerwise) -> handle"]
    assert len(handle["runs_ms"]) == 2
    for r in doc["rows"]:
        assert r["vs_copy"] == pytest.approx(r["ms"] / base["ms"])
    if decode:
        contiguous = rows["materialize (contiguous, all layers)"]
        assert contiguous["vs_contiguous"] == 1.0 and "... -> layer 0 ready (wait(0))" in rows
        assert all(r["vs_contiguous"] == pytest.approx(r["ms"] / contiguous["ms"]) for r in doc["rows"])
        assert "vs_contiguous" in printed_columns(proc.stdout)
    else:
        assert all("vs_contiguous" not in r for r in doc["rows"])
    assert "vs_copy" in printed_columns(proc.stdout)


@pytest.mark.slow  # ~10 s on a quiet 2-core box
def test_store_breakdown_runs_on_a_cpu_against_a_plain_copy_of_the_kv(tmp_path):
    """Each stage against a plain copy of the same raw KV on its side (the copy's rows are in
    the table), as benchmarks/store.py's ratios; the whole calls' rows read as its ones."""
    proc = run_benchmark("store_breakdown", "--codec", "int4", "--blocks", "1", "--reps", "1", out=tmp_path)
    doc = json.loads((tmp_path / "store_breakdown_int4_cpu.json").read_text())
    base, rows = doc["baseline"], {r["stage"]: r for r in doc["rows"]}
    assert base["kind"] == "memcpy" and doc["codec"] == "int4" and doc["blocks"] == 1
    assert {"whole ingest (new blocks)", "whole materialize", "ingest: hash blocks",
            "materialize: decoder.finish (decode)"} <= set(rows)
    sides = {"ingest": 0, "materialize": 0}
    for name, r in rows.items():
        side = "ingest" if "ingest" in name else "materialize"
        sides[side] += 1
        assert r["vs_copy"] == pytest.approx(r["raw_GBps"] / base[f"{side}_gbps"])
        if name.startswith("baseline"):
            assert r["vs_copy"] == pytest.approx(1.0)
    assert sides == {"ingest": 6, "materialize": 6}
    assert "vs_copy" in printed_columns(proc.stdout)


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


def test_host_codec_tiny_runs_every_codec_against_a_memcpy_of_the_same_run(tmp_path):
    """``benchmarks.host_codec --tiny`` (~2 s): every codec's encode, decode, ingest and
    materialize of CPU KV, each against the run's own memcpy; ``--compare`` of the JSON it
    wrote gives new / old per row (1 against itself), in the JSON and the printed tables."""
    proc = run_benchmark("host_codec", "--tiny", out=tmp_path)
    doc = json.loads((tmp_path / "host_codec.json").read_text())
    assert doc["shape"] == "tiny" and doc["raw_bytes"] == 2 * 2 * 2 * 256 * 64 * 2
    copy = doc["baseline"]["memcpy_gbps"]
    assert copy > 0 and len(doc["baseline"]["memcpy_ms_each"]) == 2 * doc["reps"]
    assert [r["codec"] for r in doc["rows"]] == ["raw", "int8", "int4", "int2"]
    for r in doc["rows"]:
        for op in ("encode", "decode", "ingest", "materialize"):
            assert r[f"{op}_gbps"] > 0 and len(r[f"{op}_ms_each"]) == doc["reps"]
            assert r[f"{op}_x_memcpy"] == pytest.approx(r[f"{op}_gbps"] / copy)
    assert {"codec", "encode_gbps", "materialize_x_memcpy"} <= printed_columns(proc.stdout)
    old = tmp_path / "old.json"
    (tmp_path / "host_codec.json").rename(old)
    proc = run_benchmark("host_codec", "--tiny", "--codecs", "int4", "--compare", str(old), out=tmp_path)
    row = json.loads((tmp_path / "host_codec.json").read_text())["rows"][0]
    assert row["encode_old_gbps"] == doc["rows"][2]["encode_gbps"]
    assert row["decode_speedup"] == pytest.approx(row["decode_gbps"] / doc["rows"][2]["decode_gbps"])
    assert "materialize_speedup" in printed_columns(proc.stdout)


@pytest.mark.slow  # ~10 s: two servers, a client and a disk-load process, 3 rounds of 2 s each
def test_write_back_posts_to_both_servers_in_turn_under_load(tmp_path):
    """Both servers are posted to in every counted round, and each row carries its p50 and
    p99 over the write-through server's of the same run."""
    proc = run_benchmark("write_back", "--seconds", "4", "--blocks", "2", "--disk-load", "1", "--cpu-load", "0",
                         out=tmp_path)
    doc = json.loads((tmp_path / "write_back.json").read_text())
    rows = {r["server"]: r for r in doc["rows"]}
    assert sorted(rows) == ["write-back", "write-through"] and doc["disk_load"] == 1
    assert rows["write-through"]["p50_vs_write_through"] == 1
    for r in rows.values():
        assert r["posts"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    back, through = rows["write-back"], rows["write-through"]
    assert back["p50_vs_write_through"] == pytest.approx(back["p50_ms"] / through["p50_ms"])
    assert {"server", "p50_ms", "p99_ms", "p50_vs_write_through"} <= printed_columns(proc.stdout)
