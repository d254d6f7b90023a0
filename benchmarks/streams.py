"""What switching the current CUDA stream costs the host: the data path's ``on_stream`` scope
(through torch's C bindings, and through torch.cuda's calls) against ``torch.cuda.stream()``
and against two bare ``set_stream`` calls.

    python -m benchmarks.streams [--reps 20000] [--out DIR]

The data path switches streams around every copy launch it queues on a side stream (the
decoder's copies to the device, the CPU tier's copies to the host), so a scope must cost
about what the bare calls cost. Baseline, measured in the same run: ``set_stream(side)`` then
``set_stream(caller)``, with the caller's stream looked up once. Without CUDA, torch.cuda's
calls are replaced by stubs, which measures the helper's own Python work only.
"""

from __future__ import annotations

import argparse
import timeit
from pathlib import Path
from types import SimpleNamespace

import torch

from cacheseek.store import streams
from cacheseek.store.streams import on_stream

from .report import table, write_json


def _stub_cuda() -> None:
    """torch.cuda's stream calls as no-ops (a CPU-only machine has none to call)."""
    caller = SimpleNamespace(device_index=0, device=0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda device=None: caller
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.set_device = lambda index: None
    torch.cuda.stream = None  # nothing to compare against: the stubs say nothing of it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    real = torch.cuda.is_available()
    if real:
        side = torch.cuda.Stream()
    else:
        _stub_cuda()
        side = SimpleNamespace(device_index=0, device=0)
    caller = torch.cuda.current_stream()

    def bare() -> None:
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(caller)

    def scoped() -> None:
        with on_stream(side):
            pass

    def torch_context() -> None:
        with torch.cuda.stream(side):
            pass

    bindings = streams.BINDINGS
    cases = [("set_stream x2 (baseline)", bare, bindings), ("on_stream", scoped, bindings)]
    if real:
        if bindings is not None:
            cases.append(("on_stream, torch.cuda's calls", scoped, None))
        cases.append(("torch.cuda.stream()", torch_context, bindings))
    rows = []
    for name, fn, calls in cases:
        streams.BINDINGS = calls  # (on_stream through torch's C bindings, or torch.cuda's calls)
        try:
            fn()
            us = min(timeit.repeat(fn, number=args.reps, repeat=5)) / args.reps * 1e6
        finally:
            streams.BINDINGS = bindings
        rows.append({"scope": name, "us_per_use": us})
    base = rows[0]["us_per_use"]
    for row in rows:
        row["vs_baseline"] = row["us_per_use"] / base if base > 0 else None
    path = write_json("streams", {"cuda": real, "reps": args.reps, "rows": rows}, args.out)
    print(f"wrote {path}")
    print(table(rows, ["scope", "us_per_use", "vs_baseline"],
                f"Host cost of a stream switch ({'CUDA' if real else 'stubbed torch.cuda: the helper only'})"))


if __name__ == "__main__":
    main()
