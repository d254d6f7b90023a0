"""What a remote load costs the requests already running, in a real vLLM (PyPI's CPU build)
serving SmolLM2-135M through one ``cacheseek serve`` on loopback.

    python -m benchmarks.vllm_remote_load [--prefix-tokens 2048] [--codec raw] [--decode-tokens 64]

One engine per configuration and process (tests/vllm_runs.py, scenario ``steps``): prompt 0
stores a prefix; vLLM's own cache is emptied; a request decodes, and a few steps later a
request whose prompt holds that prefix arrives. Per configuration, the decoding request's
gaps between tokens: the longest one after the second request arrived (the step that
loaded its prefix, when the load runs inside a step) against the median gap before it;
and how long the loading request took to its token.

- ``in the step`` (``background_loads: false``): the load runs in ``start_load_kv`` of the
  step that first computes the request; every running request waits for the fetch.
- ``between steps`` (``background_loads: true``, the default with a server): vLLM's
  asynchronous load; the request is held back while a loader thread fetches and decodes
  its prefix, and the other requests run on.

Runs under a Python that has vLLM (``CACHESEEK_VLLM_PYTHON``, else this one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from .report import table, write_json
from .server import start_cacheseek
from .vllm_ttft import engine_run

CONFIGS = {"in the step": False, "between steps": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--codec", default="raw")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="folder for vllm_remote_load.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    python = os.environ.get("CACHESEEK_VLLM_PYTHON") or sys.executable
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, background in CONFIGS.items():
            proc, url = start_cacheseek(Path(tmp), name.replace(" ", "-"), "--cpu-bytes", "2GiB", "--disk-bytes", "0")
            try:
                print(f"running {name} ...", flush=True)
                res = engine_run({"scenario": "steps", "prefix_tokens": args.prefix_tokens,
                                  "decode_tokens": args.decode_tokens,
                                  "extra": {"codec": args.codec, "model_id": "smollm2-135m", "url": url,
                                            "timeout_seconds": 60, "background_loads": background}}, python)
            finally:
                proc.stop()
            raw[name] = res
            steps, arrived = res["steps"], res["arrived"]
            decoding = [i for i, r in enumerate(steps) if "decoding" in r["tokens"]]
            gaps = {i: sum(steps[j]["seconds"] for j in range(a + 1, i + 1)) for a, i in zip(decoding, decoding[1:])}
            before = [g for i, g in gaps.items() if i < arrived]
            after = [g for i, g in gaps.items() if arrived <= i <= res["loading_token_step"] + 2]
            worker = res["stats"]["worker"]
            rows.append({"config": name, "decode_gap_before_ms": statistics.median(before) * 1e3,
                         "longest_gap_while_loading_ms": max(after) * 1e3,
                         "longest_vs_before": max(after) / statistics.median(before),
                         "loading_request_to_token_ms": res["loading_seconds"] * 1e3,
                         "load_calls": worker["load_calls"], "background": worker["load_background_calls"],
                         "load_tokens": worker["load_tokens"]})
    print(table(rows, ["config", "decode_gap_before_ms", "longest_gap_while_loading_ms", "longest_vs_before",
                       "loading_request_to_token_ms", "load_calls", "background", "load_tokens"],
                title=f"a decoding request while another loads a {args.prefix_tokens}-token prefix ({args.codec}) "
                      "from a server on loopback"))
    write_json("vllm_remote_load", {"prefix_tokens": args.prefix_tokens, "codec": args.codec,
                                    "decode_tokens": args.decode_tokens, "load_average": os.getloadavg(),
                                    "rows": rows, "raw": raw}, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
