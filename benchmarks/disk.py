"""The disk tier against the disk: cold materialize vs a plain O_DIRECT read, and group commit.

    python -m benchmarks.disk [--blocks 64] [--codecs raw,int4,int2] [--reps 3] [--disk-dir /tmp]
    python -m benchmarks.disk --plot-only benchmarks/results/disk.json --out docs

Frames are Llama-3-8B blocks of 256 tokens (32 layers x 8 KV heads x 128, fp16): one block
is encoded for real per codec and its payload reused under every hash of a ``--blocks``
chain (the bytes on disk are what the codec writes; encoding is not what is measured).

Reads, per codec, on the same files in the same run, each cold:
- ``sequential O_DIRECT`` (the baseline): each file read whole, one after the other, with
  O_DIRECT into one 4 KiB-aligned buffer: what the device gives one plain reader;
- ``dd iflag=direct`` over the same files (where dd and O_DIRECT work), for reference;
- ``tier stream``: ``TieredStore.stream`` of the chain from a disk-only store (reads in
  flight, checksums verified, frames handed out in order), nothing decoded;
- ``materialize``: ``PrefixCache.materialize`` of the chain onto the GPU (or the CPU), the
  whole call: reads, checks, copies and decode.
"Cold": the page cache is bypassed (O_DIRECT, where the filesystem enforces it) and the
files' pages are dropped before every read all the same (``posix_fadvise(DONTNEED)`` per
file, and ``/proc/sys/vm/drop_caches`` where this process may write it); the JSON says
which applied. GB/s are of frame bytes read; ``vs O_DIRECT`` is the ratio to the baseline.

Ingest: the same frames put into a fresh disk tier with one group commit per batch
(``put_many``, the default) and one commit per frame (``group_commit=False``), in turns;
frames per second and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.store import direct_io
from cacheseek.store.disk import DiskTier
from cacheseek.store.frame import header_prefix, parse_frame, payload_checksum, replan_frame
from cacheseek.store.tier import BlockFrame

from .report import add_plot_only, bars, legend_outside, plot_only, pyplot, redraw, save, source_line, table, write_json
from .store import BLOCK, CODECS, LAYOUT


def chain_frames(codec_name: str, blocks: int, device: torch.device) -> tuple[cs.PrefixCache, list[int], list]:
    """A memory-only cache for ``codec_name``, token ids of a ``blocks``-block chain, and
    its frames: one block encoded for real, its payload under every hash of the chain."""
    codec = CODECS[codec_name]
    one = cs.PrefixCache(model_id="disk-bench", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                         tiers=cs.TierConfig(cpu_bytes="1GiB", pin_memory=False))
    gen = torch.Generator(device=device).manual_seed(0)
    kv = [(torch.randn(8, BLOCK, 128, device=device, generator=gen, dtype=torch.float16),
           torch.randn(8, BLOCK, 128, device=device, generator=gen, dtype=torch.float16))
          for _ in range(LAYOUT.num_layers)]
    first = list(range(BLOCK))
    one.ingest(first, kv)
    frame, _ = one.store.get(one.block_hashes(first)[0])
    segments = frame.wire_segments()
    payload = bytes(memoryview(frame.host).cast("B")[frame.meta.payload_offset:])
    checksum = payload_checksum(payload)
    del segments
    frame.release()
    ids = [(i * 7919) % 120_000 for i in range(blocks * BLOCK)]
    hashes = one.block_hashes(ids)
    parents = one.keys.parents(hashes)
    frames = []
    for pos, (h, p) in enumerate(zip(hashes, parents)):
        meta = replace(replan_frame(frame.meta, block_hash=h, parent_hash=p, position=pos), checksum=checksum)
        body = bytearray(header_prefix(meta) + payload)
        frames.append((h, BlockFrame(parse_frame(body), host=memoryview(body), sealed=True)))
    return one, ids, frames


def drop_caches_allowed() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def make_cold(files: list[Path], use_drop_caches: bool) -> None:
    os.sync()
    for f in files:
        direct_io.drop_cached(f)
    if use_drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")


def sequential_direct(files: list[Path]) -> tuple[float, str]:
    """Seconds to read every file whole, one after the other, O_DIRECT into one aligned
    buffer (buffered where the filesystem refuses O_DIRECT), and the path taken."""
    biggest = max(f.stat().st_size for f in files)
    buf = direct_io.AlignedBuffer(biggest)
    taken = "o_direct"
    start = time.perf_counter()
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | direct_io.O_DIRECT)
        except OSError:
            fd, taken = os.open(f, os.O_RDONLY), "buffered"
        try:
            size = os.fstat(fd).st_size
            got = 0
            while got < size:
                n = os.preadv(fd, [buf.view(direct_io.round_up(size))[got:]], got)
                if n <= 0:
                    raise RuntimeError(f"{f}: short read")
                got += n
        finally:
            os.close(fd)
    return time.perf_counter() - start, taken


def dd_direct(files: list[Path]) -> float | None:
    """Seconds for ``dd iflag=direct`` to read every file (None where dd or O_DIRECT fails)."""
    dd = shutil.which("dd")
    if dd is None:
        return None
    start = time.perf_counter()
    for f in files:
        done = subprocess.run([dd, f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True)
        if done.returncode != 0:
            return None
    return time.perf_counter() - start


def run_codec(codec_name: str, blocks: int, reps: int, root: Path, device: torch.device, drop: bool,
              ingest_reps: int) -> dict:
    one, ids, frames = chain_frames(codec_name, blocks, device)
    nbytes = sum(f.nbytes for _, f in frames)
    row: dict = {"codec": codec_name, "blocks": blocks, "frame_mb": frames[0][1].nbytes / 1e6, "gb": nbytes / 1e9}

    # -- ingest: group commit against one commit per frame, in turns -----------------------
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(ingest_reps):
        for group in (True, False) if rep % 2 == 0 else (False, True):
            where = root / f"ingest-{codec_name}-{group}-{rep}"
            tier = DiskTier(where, 2 * nbytes + (1 << 30), group_commit=group)
            t = time.perf_counter()
            results = tier.put_many(frames)
            times[group].append(time.perf_counter() - t)
            if any(r.error for r in results):
                raise RuntimeError(f"ingest failed: {[str(r.error) for r in results if r.error][:2]}")
            tier.close()
            shutil.rmtree(where, ignore_errors=True)
    g, s = statistics.median(times[True]), statistics.median(times[False])
    row |= {"ingest_group_fps": blocks / g, "ingest_single_fps": blocks / s, "group_vs_single": s / g,
            "ingest_group_gbps": nbytes / g / 1e9, "ingest_single_gbps": nbytes / s / 1e9}

    # -- cold reads of the same files --------------------------------------------------------
    disk = root / f"read-{codec_name}"
    cache = cs.PrefixCache(model_id="disk-bench", layout=LAYOUT, codec=CODECS[codec_name], block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=0, disk_path=disk, disk_bytes=2 * nbytes + (1 << 30),
                                               pin_memory=device.type == "cuda"))
    if any(r.error for r in cache.store.tier("disk").put_many(frames)):
        raise RuntimeError("writing the read set failed")
    hashes = [h for h, _ in frames]
    files = [cache.store.tier("disk")._paths(h)[0] for h in hashes]
    seq, dd, stream, mat = [], [], [], []
    path_taken = "?"
    for _ in range(reps):
        make_cold(files, drop)
        t, path_taken = sequential_direct(files)
        seq.append(t)
        make_cold(files, drop)
        d = dd_direct(files)
        if d is not None:
            dd.append(d)
        make_cold(files, drop)
        t = time.perf_counter()
        it = cache.store.stream(hashes, where=["disk"] * len(hashes), promote=False)
        got = 0
        for item in it:
            if item is None:
                raise RuntimeError("a frame went missing")
            item[0].release()
            got += 1
        stream.append(time.perf_counter() - t)
        make_cold(files, drop)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = cache.materialize(ids, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        mat.append(time.perf_counter() - t)
        if out.num_tokens != len(ids):
            raise RuntimeError(f"materialized {out.num_tokens} of {len(ids)} tokens")
        del out
    stats = cache.stats()["tiers"][0]
    cache.close()
    one.close()
    shutil.rmtree(disk, ignore_errors=True)
    base = nbytes / statistics.median(seq) / 1e9
    row |= {
        "read_path": stats["read_path"], "baseline_path": path_taken,
        "sequential_direct_gbps": base,
        "dd_direct_gbps": nbytes / statistics.median(dd) / 1e9 if dd else None,
        "stream_gbps": nbytes / statistics.median(stream) / 1e9,
        "materialize_gbps": nbytes / statistics.median(mat) / 1e9,
        "materialize_ms": statistics.median(mat) * 1e3,
        "seconds_each": {"sequential": seq, "dd": dd, "stream": stream, "materialize": mat},
    }
    row["stream_vs_direct"] = row["stream_gbps"] / base
    row["materialize_vs_direct"] = row["materialize_gbps"] / base
    return row


def plot(docs: list[dict], out_dir: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    doc = docs[0]
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    bars(ax, [f"{r['codec']} ({r['frame_mb']:.1f} MB frames)" for r in rows],
         {"sequential O_DIRECT (baseline)": [r["sequential_direct_gbps"] for r in rows],
          "tier stream (reads in flight, verified)": [r["stream_gbps"] for r in rows],
          "materialize (whole call)": [r["materialize_gbps"] for r in rows]}, fmt="{:.2f}")
    ax.set_ylabel("GB/s of frame bytes, cold")
    legend_outside(ax)
    where = doc["machine"].get("gpu") or f"{doc['machine'].get('cpus', '?')}-core CPU"
    return save(fig, out_dir, "disk", note=source_line(doc),
                title=f"Disk tier, cold reads of a {doc['blocks']}-block chain against a plain O_DIRECT read "
                      f"({doc['filesystem']}), {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    ap.add_argument("--blocks", type=int, default=64 if cuda else 16)
    ap.add_argument("--codecs", default="raw,int4,int2" if cuda else "raw,int4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ingest-reps", type=int, default=4)
    ap.add_argument("--disk-dir", type=Path, default=None)
    ap.add_argument("--drop-caches", action="store_true",
                    help="also write /proc/sys/vm/drop_caches before each cold read (drops every process's clean "
                         "pages: only on a machine of your own)")
    ap.add_argument("--out", type=Path, default=None)
    add_plot_only(ap)
    args = ap.parse_args()
    if plot_only(args, plot):
        return
    from .ttft import filesystem

    device = torch.device("cuda" if cuda else "cpu")
    drop = args.drop_caches and drop_caches_allowed()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        root = Path(tmp)
        fs = filesystem(root)
        print(f"disk under {root} ({fs}); read path {direct_io.probe_read_path(root)}; "
              f"drop_caches {'on' if drop else 'off'}", flush=True)
        for codec in args.codecs.split(","):
            row = run_codec(codec, args.blocks, args.reps, root, device, drop, args.ingest_reps)
            rows.append(row)
            print(f"  {codec:4s} O_DIRECT {row['sequential_direct_gbps']:.2f} GB/s, stream {row['stream_gbps']:.2f} "
                  f"({row['stream_vs_direct']:.2f}x), materialize {row['materialize_gbps']:.2f} "
                  f"({row['materialize_vs_direct']:.2f}x); ingest {row['ingest_group_fps']:.1f} vs "
                  f"{row['ingest_single_fps']:.1f} frames/s ({row['group_vs_single']:.2f}x)", flush=True)
    cold = ("O_DIRECT (enforced) + " if rows and rows[0]["read_path"] == "o_direct" else "") + \
        "posix_fadvise(DONTNEED) per file" + (" + drop_caches" if drop else "")
    path = write_json("disk", {"blocks": args.blocks, "block_tokens": BLOCK, "layout": LAYOUT.to_dict(),
                               "device": str(device), "filesystem": fs, "cold": cold, "rows": rows}, args.out)
    print(f"wrote {path}")
    redraw(plot, path)
    cols = ["codec", "frame_mb", "gb", "read_path", "sequential_direct_gbps", "dd_direct_gbps", "stream_gbps",
            "stream_vs_direct", "materialize_gbps", "materialize_vs_direct", "ingest_group_fps", "ingest_single_fps",
            "group_vs_single"]
    print(table(rows, cols, f"Disk tier, {args.blocks} blocks, cold ({cold}), {fs}, decode on {device}"))
    for r in rows:
        verdict = "MET" if r["materialize_vs_direct"] >= 0.8 else "NOT MET"
        print(f"goal ({r['codec']}: cold materialize >= 80% of sequential O_DIRECT): "
              f"{r['materialize_vs_direct']:.0%}, {verdict}")


if __name__ == "__main__":
    main()
