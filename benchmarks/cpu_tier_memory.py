"""The memory a block held in the CPU tier costs beyond its frame's bytes (which is all that
``cpu_bytes`` counts): the tier's records, its arena slot, the eviction index and the
store's residency, per block.

    python -m benchmarks.cpu_tier_memory [--blocks 50000] [--chain 64] [--heads 1] [--trace]

Frames reach the tier as a server's do: a server's store and service (CPU tier only, in
this process), each frame parsed from its bytes (``parse_frame``) and put in chains of
``--chain`` blocks of one model. The figure is the process's RSS growth per block less the
frame (``--trace``: the Python heap's growth per block, by tracemalloc, with the lines that
allocate most; slower, and tracemalloc's own memory makes RSS meaningless then). One
head of head_dim 16, 16-token blocks, raw: a 1,408-byte frame, where the overhead is the
largest share of the memory.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import tracemalloc
from pathlib import Path

BLOCK_TOKENS = 16


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def _run(args: argparse.Namespace) -> None:
    from cacheseek.layout import KVLayout
    from cacheseek.quant import Raw
    from cacheseek.store.frame import build_frame, parse_frame, plan_frame
    from server.app import create_app
    from server.config import ServerSettings
    from server.service import Incoming

    layout = KVLayout(num_layers=1, num_kv_heads=args.heads, head_dim=16, dtype="float16")
    template = Raw().template((1, args.heads, BLOCK_TOKENS, 16), "float16")
    buffers = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]

    def frame(block_hash: bytes, parent: bytes, position: int) -> bytearray:
        meta = plan_frame(block_hash=block_hash, parent_hash=parent, position=position, layout=layout,
                          block_tokens=BLOCK_TOKENS, codec=Raw().spec(), buffers=buffers)
        return build_frame(meta, [bytes(e.nbytes) for e in meta.tensors])

    chains = -(-args.blocks // args.chain)
    frame_bytes = len(frame(bytes(16), bytes(16), 0))
    settings = ServerSettings(cpu_bytes=2 * (chains + 1) * args.chain * frame_bytes, disk_bytes=0,
                              disk_path=Path(tempfile.mkdtemp()) / "disk")
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        service = app.state.service

        def fill(first: int, count: int) -> None:
            for c in range(first, first + count):
                parent, batch = bytes(16), []
                for position in range(args.chain):
                    key = (c * args.chain + position + 1).to_bytes(16, "big")
                    buf = frame(key, parent, position)
                    batch.append(Incoming(buf, parse_frame(buf)))
                    parent = key
                service.put("", batch, model="m")

        fill(0, 1)  # the first chunk of the arena mapped, the code paths warm
        gc.collect()
        if args.trace:
            tracemalloc.start(1)
            before = tracemalloc.take_snapshot()
        rss0 = _rss()
        fill(1, chains)
        gc.collect()
        blocks = chains * args.chain
        rss = (_rss() - rss0) / blocks
        print(f"{blocks} blocks of {frame_bytes} B frames")
        if args.trace:
            stats = tracemalloc.take_snapshot().compare_to(before, "lineno")
            tracemalloc.stop()
            print(f"python heap: {sum(s.size_diff for s in stats) / blocks:.0f} B a block")
            for s in stats[:12]:
                where = s.traceback[0]
                print(f"  {s.size_diff / blocks:6.0f} B {s.count_diff / blocks:5.1f} objects  "
                      f"{where.filename.rsplit('/', 3)[-2:]}:{where.lineno}")
        else:
            print(f"RSS: {rss:.0f} B a block, {rss - frame_bytes:.0f} B beyond its frame")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=50_000)
    parser.add_argument("--chain", type=int, default=64, help="blocks per chain")
    parser.add_argument("--heads", type=int, default=1, help="KV heads (the frame grows with them)")
    parser.add_argument("--trace", action="store_true", help="the Python heap by tracemalloc instead of RSS")
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
