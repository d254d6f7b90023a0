"""Time to first token in a real vLLM (PyPI's CPU build) serving SmolLM2-135M, when a 2K-token
prompt's prefix is stored in CacheSeek, against vLLM computing it (its own prefix cache cold).

    python -m benchmarks.vllm_ttft [--prefix-tokens 2048] [--repeats 3] [--codecs raw,int4] [--loads layerwise,whole]

Runs under a Python that has vLLM (``CACHESEEK_VLLM_PYTHON``, else this one), one engine
per configuration and process (tests/vllm_runs.py, scenario ``ttft``):

- ``vllm cold``: no connector, vLLM's prefix cache emptied before each prompt: the whole
  prompt is computed. The in-run baseline.
- ``vllm warm``: no connector, vLLM's prefix cache holding the prefix: the best case, when
  the prefix never left the engine's own pages.
- ``cacheseek <codec>``: the connector (embedded, CPU tier), the prefix stored by a first
  prompt, vLLM's prefix cache emptied before each timed prompt: the prefix comes from
  CacheSeek; ``cacheseek <codec> layer-wise`` loads it layer by layer inside the forward
  (``layerwise_load: true``, the default only on a GPU), ``cacheseek <codec> whole`` every
  layer before the forward (``false``, what "auto" does on a CPU). On a CPU nothing
  overlaps: a layer group is decoded when the forward first waits for it.

TTFT is the wall time of ``LLM.generate`` for one output token (the prefill, the load and
one sampling step), median over ``--repeats`` prompts that share the prefix and differ in
their last ~15 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .report import table, write_json

ROOT = Path(__file__).resolve().parent.parent
LOAD_MODES = {"layerwise": True, "whole": False}  # --loads -> kv_connector_extra_config.layerwise_load
LOAD_LABELS = {"layerwise": "layer-wise", "whole": "whole"}
RUNNER = ROOT / "tests" / "vllm_runs.py"


def engine_run(job: dict, python: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([python, str(RUNNER), json.dumps(job)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{job} failed ({done.returncode}):\n" + "\n".join((done.stdout + done.stderr).splitlines()[-40:]))
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codecs", default="raw,int4")
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--loads", default="layerwise,whole",
                    help="the connector's loads: layer by layer (its default) and/or whole steps")
    ap.add_argument("--out", default=None, help="folder for vllm_ttft.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    python = os.environ.get("CACHESEEK_VLLM_PYTHON") or sys.executable
    common = {"scenario": "ttft", "prefix_tokens": args.prefix_tokens, "repeats": args.repeats}
    configs = {"vllm cold": {}, "vllm warm": {"reset": False}}
    for codec in args.codecs.split(","):
        for mode in args.loads.split(","):
            if mode not in LOAD_MODES:
                raise SystemExit(f"--loads: {mode!r} is not one of {', '.join(LOAD_MODES)}")
            configs[f"cacheseek {codec} {LOAD_LABELS[mode]}"] = {"extra": {
                "codec": codec, "model_id": "smollm2-135m", "block_tokens": args.block_tokens,
                "tiers": {"cpu_bytes": "2GiB"}, "layerwise_load": LOAD_MODES[mode]}}
    rows, raw = [], {}
    load_before = os.getloadavg()
    for name, job in configs.items():
        print(f"running {name} ...", flush=True)
        res = engine_run({**common, **job}, python)
        raw[name] = res
        runs = res["runs"]
        row = {"config": name, "prompt_tokens": res["prompt_tokens"],
               "ttft_s": statistics.median(r["seconds"] for r in runs),
               "cached_tokens": runs[-1]["cached"], "external_tokens": runs[-1]["external"],
               "computed_tokens": res["prompt_tokens"] - runs[-1]["cached"]}
        if "after" in res:
            worker = {k: res["after"]["worker"][k] - res["before"]["worker"][k] for k in res["after"]["worker"]}
            row["load_ms"] = 1e3 * worker["load_seconds"] / max(1, worker["loads"])
            row["load_failures"] = worker["load_failures"]
        rows.append(row)
    cold = rows[0]["ttft_s"]
    for row in rows:
        row["speedup"] = cold / row["ttft_s"]
        row["prefill_saved"] = f"{1 - row['computed_tokens'] / row['prompt_tokens']:.0%}"
    print(table(rows, ["config", "prompt_tokens", "ttft_s", "speedup", "computed_tokens", "external_tokens",
                       "prefill_saved", "load_ms"],
                title=f"vLLM {args.prefix_tokens}-token stored prefix, SmolLM2-135M float32 on the CPU "
                      "(speedup against vLLM cold, same run)"))
    machine = {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "note": "a shared machine: other jobs ran beside this one, so the figures are slower than an idle "
                       "machine's; the speedups are against vllm cold in the same run"}
    path = write_json("vllm_ttft", {"prefix_tokens": args.prefix_tokens, "repeats": args.repeats, "machine": machine,
                                    "rows": rows, "runs": raw}, None if args.out is None else Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
