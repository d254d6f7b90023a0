"""The ``disk`` tier: one data file and one sidecar per frame, crash-safe, checksummed.

Layout: ``<root>/<first two hex digits>/<hash>.frame`` and ``<hash>.meta``.

Write order, and why:
1. the frame goes to a temp file in the same shard, is fsynced, then renamed to ``.frame``;
2. the sidecar goes to a temp file, is fsynced, then renamed to ``.meta``: the sidecar is
   the commit record; a ``.frame`` without one is an orphan of an interrupted write;
3. the shard directory is fsynced, so both renames survive a power cut.
Writing the data file in place instead would let a crash leave a torn frame under its
final name; a checksum would catch it on read, but the index would already have served
it to lookups. With this order, anything the index knows is whole.

At start the index is rebuilt from the sidecars alone (no payload is read), temp files and
orphans are removed, and blocks are re-indexed in the order of the sidecars' modification
times (the eviction policy's history of uses does not survive a restart).
Every read verifies the payload checksum: a corrupt or truncated frame is a miss, and it
is deleted and counted.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import msgpack

from ..errors import FrameError, StorageError
from .frame import parse_frame
from .eviction import DEFAULT_POLICY
from .tier import BlockFrame, BlockInfo, IndexedTier, TierPutResult

SIDECAR_VERSION = 1
_SIDECAR_KEYS = {"v", "hash", "parent", "pos", "nbytes", "raw_nbytes", "checksum"}


class DiskTier(IndexedTier):
    persistent = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, name: str = "disk", fsync: bool = True,
                 policy: str = DEFAULT_POLICY):
        super().__init__(name, capacity_bytes, policy=policy)
        self.root = Path(root).expanduser()
        self.fsync = fsync
        self._writing: set[bytes] = set()
        self._reserved = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"{name} tier: cannot create {self.root}: {exc}") from None
        self._recover()

    # -- paths ---------------------------------------------------------------------------

    def _paths(self, key: bytes) -> tuple[Path, Path]:
        hexkey = key.hex()
        shard = self.root / hexkey[:2]
        return shard / f"{hexkey}.frame", shard / f"{hexkey}.meta"

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        found: list[tuple[float, bytes, BlockInfo]] = []
        removed = {"temp": 0, "orphan": 0, "bad_sidecar": 0}
        for shard in sorted(p for p in self.root.iterdir() if p.is_dir() and len(p.name) == 2):
            names = {p.name: p for p in shard.iterdir()}
            handled = set()
            for name, path in names.items():
                if name.startswith(".tmp-"):
                    _unlink(path)
                    removed["temp"] += 1
                elif name.endswith(".meta"):
                    entry = self._load_sidecar(path, names)
                    if entry is None:
                        _unlink(path)
                        _unlink(path.with_suffix(".frame"))
                        removed["bad_sidecar"] += 1
                    else:
                        found.append(entry)
                    handled.add(path.with_suffix(".frame").name)
            for name, path in names.items():
                if name.endswith(".frame") and name not in handled:
                    _unlink(path)
                    removed["orphan"] += 1
        for _, key, info in sorted(found, key=lambda e: e[0]):
            self._index.add(key, info)
        evicted = 0
        while self._index.used_bytes > self.capacity_bytes:
            victim = self._index.victim()
            self._remove_files(victim)
            self._index.remove(victim, evicted=True)
            evicted += 1
        self._stats.evictions += evicted
        self._recovery = {"recovered_blocks": len(self._index), "removed_at_start": removed}
        self._sync_counts()

    def _load_sidecar(self, path: Path, names: dict[str, Path]) -> tuple[float, bytes, BlockInfo] | None:
        try:
            data = path.read_bytes()
            side = msgpack.unpackb(data, raw=False)
            if not isinstance(side, dict) or set(side) != _SIDECAR_KEYS or side["v"] != SIDECAR_VERSION:
                return None
            key = side["hash"]
            if not isinstance(key, bytes) or path.name != f"{key.hex()}.meta":
                return None
            frame_name = f"{key.hex()}.frame"
            if frame_name not in names or names[frame_name].stat().st_size != side["nbytes"]:
                return None
            info = BlockInfo(nbytes=int(side["nbytes"]), raw_nbytes=int(side["raw_nbytes"]),
                             parent=bytes(side["parent"]), position=int(side["pos"]))
            return path.stat().st_mtime, key, info
        except (OSError, ValueError, TypeError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None

    # -- writes --------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        segments = frame.wire_segments()  # seals the frame if it is not yet
        meta = frame.meta
        n = meta.nbytes
        if n > self.capacity_bytes:
            self.count(write_errors=1)
            raise StorageError(f"{self.name} tier: a {n}-byte frame exceeds the budget ({self.capacity_bytes})")
        evicted: list[tuple[bytes, BlockFrame | None]] = []
        with self._lock:
            if key in self._index or key in self._writing:
                self._index.touch([key])
                return TierPutResult(stored=None)
            while self._index.used_bytes + self._reserved + n > self.capacity_bytes and self._index.evictable:
                victim = self._index.victim()
                frame_v = self._read_frame(victim) if self.demote_evicted else None
                self._remove_files(victim)
                self._index.remove(victim, evicted=True)
                self._stats.evictions += 1
                evicted.append((victim, frame_v))
            if self._index.used_bytes + n > self.capacity_bytes and self._index.pinned_blocks:
                self._stats.write_errors += 1
                raise self._no_room(n)
            self._writing.add(key)
            self._reserved += n
        data_path, side_path = self._paths(key)
        try:
            data_path.parent.mkdir(exist_ok=True)
            self._write_atomic(data_path, segments)
            sidecar = msgpack.packb({
                "v": SIDECAR_VERSION, "hash": key, "parent": meta.parent_hash, "pos": meta.position,
                "nbytes": n, "raw_nbytes": meta.raw_nbytes, "checksum": meta.checksum,
            }, use_bin_type=True)
            self._write_atomic(side_path, [sidecar])
            if self.fsync:
                _fsync_dir(data_path.parent)
        except OSError as exc:
            _unlink(side_path)
            _unlink(data_path)
            with self._lock:
                self._writing.discard(key)
                self._reserved -= n
                self._stats.write_errors += 1
            raise StorageError(f"{self.name} tier: writing {data_path.name} failed: {exc}") from None
        with self._lock:
            self._writing.discard(key)
            self._reserved -= n
            self._index.add(key, BlockInfo(n, meta.raw_nbytes, meta.parent_hash, meta.position))
            self._stats.bytes_in += n
            self._stats.admissions += 1
            self._sync_counts()
        return TierPutResult(stored=frame, evicted=evicted)  # now sealed: later tiers reuse it as is

    def _write_atomic(self, final: Path, segments: list) -> None:
        tmp = final.parent / f".tmp-{final.name}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                for seg in segments:
                    view = memoryview(seg).cast("B")
                    while view.nbytes:  # raw writes may be short
                        written = f.write(view)
                        view = view[written:]
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockFrame | None:
        with self._lock:
            info = self._index.get(key)
        if info is None:
            self.count(misses=1)
            return None
        start = time.perf_counter()
        frame = self._read_frame(key, expected=info.nbytes)
        elapsed = time.perf_counter() - start
        if frame is None:
            return None
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_out += info.nbytes
            self._stats.read_seconds += elapsed
        return frame

    def _read_frame(self, key: bytes, expected: int | None = None) -> BlockFrame | None:
        """Read and verify one frame. Corrupt or truncated: delete, count, None."""
        data_path, _ = self._paths(key)
        try:
            with open(data_path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if expected is not None and size != expected:
                    raise FrameError(f"file holds {size} bytes, the sidecar says {expected}")
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:  # raw reads may be short
                    n = f.readinto(view[got:])
                    if not n:
                        raise FrameError(f"short read: {got} of {size} bytes")
                    got += n
            meta = parse_frame(buf, verify=True)
            if meta.block_hash != key:
                raise FrameError("frame header names another block")
        except FileNotFoundError:
            with self._lock:
                self._stats.misses += 1
                if key in self._index:  # indexed but its data file is gone: drop the sidecar too
                    self._remove_files(key)
                    self._index.remove(key)
                    self._stats.corrupt += 1
                    self._sync_counts()
            return None
        except (OSError, FrameError):
            with self._lock:
                self._remove_files(key)
                self._index.remove(key)
                self._stats.corrupt += 1
                self._stats.misses += 1
                self._sync_counts()
            return None
        return BlockFrame(meta, host=view, sealed=True)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if self._index.remove(key) is None:
                return False
            self._remove_files(key)
            self._sync_counts()
            return True

    def _remove_files(self, key: bytes) -> None:
        data_path, side_path = self._paths(key)
        _unlink(side_path)  # the commit record goes first: a crash leaves an orphan, not a torn block
        _unlink(data_path)

    def _extra(self) -> dict:
        return {"path": str(self.root), **self._recovery}

    def check(self, *, fix: bool = False) -> dict[str, int]:
        """Post-mortem: read and verify every frame. With ``fix``, drop the bad ones."""
        report = {"ok": 0, "corrupt": 0}
        for key in self.keys():
            data_path, _ = self._paths(key)
            try:
                meta = parse_frame(data_path.read_bytes(), verify=True)
                ok = meta.block_hash == key
            except (OSError, FrameError):
                ok = False
            report["ok" if ok else "corrupt"] += 1
            if not ok and fix:
                self.delete(key)
        return report


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
