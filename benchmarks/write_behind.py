"""What a remote save costs its caller: ``RemoteCache.ingest_batch`` from an engine's pages,
waited (``wait=True``: encode, lookup, upload, answer) against sent behind (``wait=False``:
the call returns once the frames are in host memory), through one ``cacheseek serve`` on
loopback (a CPU tier that every save makes evict).

    python -m benchmarks.write_behind [--tokens 4096,16384] [--codecs int4,raw] [--reps 5] [--tiny]

Each save is a fresh prompt (nothing of it stored yet) in vLLM's flash pages (page size 16,
pages scattered), as the vLLM connector's ``wait_for_save`` makes it. The two modes take
turns. Rows: the call's median time in each mode, the ratio (waited / behind: how much
less the caller waits), and for the behind mode how long the save took to be answered
(``future.result()``, measured from the call) with the sender idle before each call, so
that a call never waits behind the one before. Shapes as ``benchmarks.store`` (Llama-3-8B
unless ``--tiny``); KV on the GPU where there is one.

The second table is a save of a prompt the server holds whole (an engine's own prefix
cache served it, and an earlier request saved it: the vLLM connector's case for a repeated
prompt), sent behind as before (every block encoded, then found stored by the sender's
lookup) against ``look_up_first=True`` (one lookup in the call, nothing encoded), the two
taking turns on the prompt the fresh behind save stored.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cacheseek as cs

from .report import table, write_json
from .server import start_cacheseek
from .store_engine import CODECS, LLAMA, TINY, Prompts, fill_pages, scattered_ids, vllm_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--codecs", default="int4,raw")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a small shape (a smoke test on a CPU)")
    ap.add_argument("--out", type=Path, default=None, help="folder for write_behind.json (default benchmarks/results)")
    args = ap.parse_args()
    shape = TINY if args.tiny else LLAMA
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(t) for t in args.tokens.split(",")]
    codecs = args.codecs.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        biggest = max(CODECS[c].encoded_nbytes(shape.layout, shape.block) for c in codecs) * (max(sizes) // shape.block)
        proc, url = start_cacheseek(Path(tmp), "behind", "--cpu-bytes", str(3 * biggest + (64 << 20)),
                                    "--disk-bytes", "0")
        try:
            for codec in codecs:
                for tokens in sizes:
                    rows.append(_run(url, shape, codec, tokens, args.reps, device))
        finally:
            proc.stop()
    print(table(rows, ["codec", "tokens", "waited_ms", "behind_call_ms", "waited_vs_behind", "behind_answered_ms",
                       "payload_mb"], title=f"a save of a fresh prompt from pages, loopback server, KV on {device}"))
    print(table(rows, ["codec", "tokens", "stored_behind_call_ms", "stored_first_call_ms", "behind_vs_first"],
                title=f"a save of a prompt the server holds, sent behind: encoded first or looked up first, KV on {device}"))
    write_json("write_behind", {"shape": "tiny" if args.tiny else "llama-3-8b", "device": str(device),
                                "reps": args.reps, "rows": rows}, args.out)


def _run(url: str, shape, codec: str, tokens: int, reps: int, device: torch.device) -> dict:
    num_pages = tokens // shape.page
    pages, _ = vllm_pages(shape, num_pages, device)
    ids = scattered_ids(num_pages, 3)
    prompts = Prompts(tokens)
    waited, behind, answered = [], [], []
    stored: dict[str, list[float]] = {"behind": [], "first": []}
    with cs.RemoteCache(url, model_id=f"behind-{codec}-{tokens}", layout=shape.layout, codec=CODECS[codec],
                        block_tokens=shape.block, timeout=600, max_pending_bytes="64GiB") as cache:
        for rep in range(reps + 1):  # the first round warms both up
            for mode in ("waited", "behind"):
                fill_pages(pages, shape.kv(tokens, device, seed=rep), ids)
                request = [cs.PagedRequest(prompts(), ids)]
                _sync(device)
                t0 = time.perf_counter()
                if mode == "waited":
                    result = cache.ingest_batch(request, pages)[0]
                    t1 = time.perf_counter()
                else:
                    future = cache.ingest_batch(request, pages, wait=False)
                    t1 = time.perf_counter()
                    result = future.result()[0]
                    t2 = time.perf_counter()
                if result.stored != tokens // shape.block:
                    raise RuntimeError(f"{mode}: stored {result.stored} of {tokens // shape.block} blocks: {result}")
                if rep:
                    (waited if mode == "waited" else behind).append(t1 - t0)
                    if mode == "behind":
                        answered.append(t2 - t0)
            for mode in ("behind", "first"):  # the behind save's prompt, whole on the server now
                _sync(device)
                t0 = time.perf_counter()
                future = cache.ingest_batch(request, pages, wait=False, look_up_first=mode == "first")
                t1 = time.perf_counter()
                result = future.result()[0]
                if result.present != tokens // shape.block:
                    raise RuntimeError(f"stored, {mode}: {result.present} of {tokens // shape.block} blocks found")
                if rep:
                    stored[mode].append(t1 - t0)
    payload = CODECS[codec].encoded_nbytes(shape.layout, shape.block) * (tokens // shape.block)
    w, b = statistics.median(waited), statistics.median(behind)
    row = {"codec": codec, "tokens": tokens, "waited_ms": w * 1e3, "behind_call_ms": b * 1e3,
           "waited_vs_behind": w / b, "behind_answered_ms": statistics.median(answered) * 1e3,
           "payload_mb": payload / 1e6,
           "stored_behind_call_ms": statistics.median(stored["behind"]) * 1e3,
           "stored_first_call_ms": statistics.median(stored["first"]) * 1e3,
           "behind_vs_first": statistics.median(stored["behind"]) / statistics.median(stored["first"]),
           "waited_each_ms": [round(x * 1e3, 2) for x in waited],
           "behind_each_ms": [round(x * 1e3, 2) for x in behind]}
    print(f"  {codec} {tokens}: waited {row['waited_ms']:.1f} ms, behind {row['behind_call_ms']:.1f} ms "
          f"({row['waited_vs_behind']:.1f}x), answered after {row['behind_answered_ms']:.1f} ms; stored already: "
          f"behind {row['stored_behind_call_ms']:.1f} ms, looked up first {row['stored_first_call_ms']:.1f} ms",
          flush=True)
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
