"""Shared fixtures for store tests: deterministic KV and caches over real files."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import cacheseek as cs
from cacheseek.store.disk import allocation_unit, block_charge
from cacheseek.store.frame import build_frame, plan_frame
from cacheseek.store.tier import BlockFrame

LAYOUT = cs.KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16")
BLOCK = 32
RAW_BUFFERS = [("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))]


def disk_charge(nbytes: int) -> int:
    """What a disk tier under the temp directory counts for a frame of ``nbytes``: its files
    in whole file-system blocks (``disk.block_charge``)."""
    return block_charge(nbytes, allocation_unit(Path(tempfile.gettempdir())))


def raw_frame(i: int) -> tuple[bytes, BlockFrame]:
    """(key, frame) of a Raw root block of LAYOUT whose every byte is ``i`` (``i % 256`` past 255,
    whose keys are ``i`` in 16 bytes)."""
    key = bytes([i]) * 16 if i < 256 else i.to_bytes(16, "big")
    meta = plan_frame(block_hash=key, parent_hash=b"\x00" * 16, position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(), buffers=RAW_BUFFERS)
    half = meta.tensors[0].nbytes
    return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([i % 256]) * half] * 2)))


def chain(seed: int, blocks: int, tokens: int = BLOCK) -> list[tuple[bytes, bytes]]:
    """``blocks`` linked Raw frames (key, frame bytes) of ``tokens`` each, head first, their
    bytes from ``seed``."""
    out: list[tuple[bytes, bytes]] = []
    parent = bytes(16)
    buffers = [(name, dtype, (*shape[:2], tokens, shape[3])) for name, dtype, shape in RAW_BUFFERS]
    for position in range(blocks):
        key = seed.to_bytes(8, "big") + position.to_bytes(8, "big")
        meta = plan_frame(block_hash=key, parent_hash=parent, position=position, layout=LAYOUT,
                          block_tokens=tokens, codec=cs.Raw().spec(), buffers=buffers)
        rng = random.Random(seed * 1000 + position)
        out.append((key, bytes(build_frame(meta, [rng.randbytes(t.nbytes) for t in meta.tensors]))))
        parent = key
    return out


def as_other_version(frame: bytes, version: int = 2) -> bytes:
    """``frame`` as another release might write it: its header with another format version
    and a field this release does not know, under a valid header checksum (whole, not damaged)."""
    import msgpack
    import xxhash

    from cacheseek.store.frame import ALIGN, PREAMBLE, parse_frame

    meta = parse_frame(frame)
    header = msgpack.packb({**meta.header_dict(), "v": version, "added_later": [1, 2]}, use_bin_type=True)
    head = PREAMBLE.pack(b"CSKF", len(header), xxhash.xxh3_64_intdigest(header)) + header
    head += bytes(-len(head) % ALIGN)
    return head + bytes(frame[meta.payload_offset:])


def make_kv(tokens: int, seed: int, layout: cs.KVLayout = LAYOUT, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    return [
        (torch.randn(shape, generator=gen).to(layout.torch_dtype).to(device),
         torch.randn(shape, generator=gen).to(layout.torch_dtype).to(device))
        for _ in range(layout.num_layers)
    ]


def block_parents(root: bytes, hashes: list[bytes]) -> list[bytes]:
    """The parent hash of each block of a chain starting at ``root``."""
    return [root, *hashes[:-1]]


def tokens_for(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def make_cache(tmp_path=None, *, codec=None, model_id="m", cpu="1MiB", disk=None, gpu=0, layout=LAYOUT,
               block=BLOCK, write_through=None, namespace="", disk_bytes="1GiB", **kw):
    tiers = cs.TierConfig(gpu_bytes=gpu, cpu_bytes=cpu, disk_path=disk, disk_bytes=disk_bytes,
                          write_through=write_through, **kw)
    return cs.PrefixCache(model_id=model_id, layout=layout, codec=codec or cs.Raw(), block_tokens=block,
                          tiers=tiers, namespace=namespace)


def assert_prefix_equal(got: cs.Materialized, kv, tokens: int) -> None:
    assert got.num_tokens == tokens
    for (k, v), (k0, v0) in zip(got.layers, kv):
        assert torch.equal(k[0].cpu(), k0[:, :tokens].cpu())
        assert torch.equal(v[0].cpu(), v0[:, :tokens].cpu())


def fail_layer_group(monkeypatch, group: int = 1):
    """Every layer-wise load's decode of layer group ``group`` raises ``RuntimeError("injected
    decode failure")`` (after the groups before it ran); returns the real ``run_group``."""
    from cacheseek.layerwise import LayerwiseDecoder

    real = LayerwiseDecoder.run_group

    def run_group(self, g, timing=False):
        if g == group:
            raise RuntimeError("injected decode failure")
        return real(self, g, timing)

    monkeypatch.setattr(LayerwiseDecoder, "run_group", run_group)
    return real


def fail_disk_writes(monkeypatch, keys) -> None:
    """Every disk-tier write of a block of ``keys`` fails as a failing disk's does (EIO on
    creating its temp file); other blocks are written as ever."""
    import errno
    import os

    names = tuple(f".tmp-{key.hex()}." for key in keys)
    real = os.open

    def failing(path, flags, *args, **kw):
        if flags & os.O_CREAT and any(name in str(path) for name in names):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", failing)


@contextlib.contextmanager
def out_of_descriptors():
    """A context in which this process can open no file: RLIMIT_NOFILE lowered and every
    descriptor left under it taken (a burst of connections), as the kernel answers EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def run_threads(worker, n: int, timeout: float = 120) -> list:
    """``worker(i)`` for i < n, each in a thread of its own, all started together; their
    results, or the first error raised. Daemon threads joined with a deadline: a deadlock
    fails the test, not hangs it."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []
    results: list = [None] * n

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = worker(i)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s: a deadlock?"
    if errors:
        raise errors[0]
    return results


def run_on_a_tmpfs(tmp_path: Path, script: str, size: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the Python ``script`` on a real tmpfs of ``size`` ("512k", "4m"), mounted in a mount
    namespace of its own (unshare(1), util-linux: on every Debian; a machine that cannot make
    one fails here, it does not skip). The script's arguments: the mount point, the
    repository, the tests folder."""
    mount = tmp_path / "fs"
    mount.mkdir()
    path = tmp_path / "script.py"
    path.write_text(script)
    here = Path(__file__).parent
    return subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"',
                           str(mount), sys.executable, str(path), str(mount), str(here.parent), str(here)],
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def switching_at_lines(*modules):
    """Threads switched at every line of ``modules``' code (a tracer that gives up the GIL
    there, in threads started inside the block), so that a check-then-act in that code
    meets the same code in another thread nearly every time, not once in a million."""
    files = {m.__file__ for m in modules}

    def yield_at_lines(frame, event, arg):
        if event == "line":
            time.sleep(0)  # (releases the GIL: another thread runs its next line)
        return yield_at_lines

    def tracer(frame, event, arg):
        return yield_at_lines if frame.f_code.co_filename in files else None

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threading.settrace(tracer)
    try:
        yield
    finally:
        threading.settrace(None)
        sys.setswitchinterval(old)


class InterruptedAtRelease:
    """A lock (or condition) whose release raises ``KeyboardInterrupt`` once, when ``when()``
    is true as it is let go: where CPython runs a Ctrl-C's handler between two bytecodes,
    just past a ``with lock:`` block (the place a count or a mark taken inside it, with its
    ``try`` after the block, was left behind for good)."""

    def __init__(self, real, when=lambda: True) -> None:
        self.real, self.when, self.raised = real, when, False

    def __enter__(self):
        return self.real.__enter__()

    def __exit__(self, *exc):
        self.real.__exit__(*exc)
        if not self.raised and exc == (None, None, None) and self.when():
            self.raised = True
            raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.real, name)


def interrupting_executor(lands: str):
    """A ``ThreadPoolExecutor`` class whose first ``submit`` raises ``KeyboardInterrupt``, as a
    Ctrl-C landing in it would: ``lands`` "before" the work is queued, or "after" (as the
    ``submit`` returns, the work queued)."""
    from concurrent.futures import ThreadPoolExecutor

    class Interrupting(ThreadPoolExecutor):
        armed = True

        def submit(self, *args, **kwargs):
            if Interrupting.armed and lands == "before":
                Interrupting.armed = False
                raise KeyboardInterrupt
            future = super().submit(*args, **kwargs)
            if Interrupting.armed:
                Interrupting.armed = False
                raise KeyboardInterrupt
            return future

    return Interrupting
