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

A block is "present" (``contains``, a put that finds it) only once its sidecar is renamed
into place: whole and committed. A put of a block whose write is in flight in another
thread waits for that one write and answers as it ended (present, or its error): a block
is never acknowledged while it could still be lost.

One process owns a directory: the tier holds an exclusive ``flock`` on ``<root>/.lock``
(with the owner's pid in it) from open to close, so a second server or embedded cache on
the same directory fails at start instead of budgeting the same bytes twice and missing
the other's blocks. The budget is checked against the filesystem at start: one larger
than the free space (plus what the tier already holds) is clamped to it, with a warning
naming ``disk_bytes``, so the tier evicts rather than failing writes with ENOSPC.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ..errors import ConfigError, FrameError, StorageError
from ..units import format_size
from .frame import parse_frame
from .eviction import DEFAULT_POLICY
from .tier import BlockFrame, BlockInfo, IndexedTier, TierPutResult

log = logging.getLogger("cacheseek.store")

SIDECAR_VERSION = 1
_SIDECAR_KEYS = {"v", "hash", "parent", "pos", "nbytes", "raw_nbytes", "checksum"}
LOCK_NAME = ".lock"
# Of the free space, the part left for sidecars, file-system blocks and other writers when
# a budget is clamped to it.
FREE_SPACE_HEADROOM = 0.05


@dataclass(slots=True)
class _InFlight:
    """One block's write in progress: later puts of the same block wait on ``done``."""

    done: threading.Event = field(default_factory=threading.Event)
    error: StorageError | None = None


class DiskInUse(ConfigError):
    """The disk tier's directory is owned (locked) by another process or tier."""


class DiskTier(IndexedTier):
    persistent = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, name: str = "disk", fsync: bool = True,
                 policy: str = DEFAULT_POLICY):
        super().__init__(name, capacity_bytes, policy=policy)
        self.root = Path(root).expanduser()
        self.fsync = fsync
        self.requested_bytes = capacity_bytes
        self._writing: dict[bytes, _InFlight] = {}
        self._reserved = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"{name} tier: cannot create {self.root}: {exc}") from None
        # Released by close(); the finalizer only covers a tier dropped without one.
        self._unlock = weakref.finalize(self, os.close, _lock_directory(self.root))
        try:
            self._recover()
            self._fit_budget_to_filesystem()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the directory up (another process may then open it)."""
        self._unlock()  # closes the lock file's descriptor (once), which releases the flock

    def _fit_budget_to_filesystem(self) -> None:
        """Clamp the budget to what the filesystem can hold: free space (less a headroom)
        plus the bytes this tier already holds. Logged as a warning naming the setting."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        room = self._index.used_bytes + int(free * (1 - FREE_SPACE_HEADROOM))
        if self.capacity_bytes <= room:
            return
        log.warning("disk_bytes: %s asked for the %s tier at %s, but its filesystem has %s free (%s already "
                    "stored here): the budget is clamped to %s", format_size(self.capacity_bytes), self.name,
                    self.root, format_size(free), format_size(self._index.used_bytes), format_size(room))
        self.capacity_bytes = room
        self._stats.capacity_bytes = room
        self._evict_over_budget()

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
        self._evict_over_budget()
        self._recovery = {"recovered_blocks": len(self._index), "removed_at_start": removed}
        self._sync_counts()

    def _evict_over_budget(self) -> None:
        while self._index.used_bytes > self.capacity_bytes:
            victim = self._index.victim()
            self._remove_files(victim)
            self._index.remove(victim, evicted=True)
            self._stats.evictions += 1

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
            if key in self._index:
                self._index.touch([key])
                return TierPutResult(stored=None)
            pending = self._writing.get(key)
        if pending is not None:
            return self._await(key, pending)
        with self._lock:
            if key in self._index:  # written while the lock was let go
                self._index.touch([key])
                return TierPutResult(stored=None)
            if (pending := self._writing.get(key)) is not None:
                return self._await(key, pending)
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
            mine = self._writing[key] = _InFlight()
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
        except BaseException as exc:
            _unlink(side_path)
            _unlink(data_path)
            mine.error = StorageError(f"{self.name} tier: writing {data_path.name} failed: {exc}")
            with self._lock:
                del self._writing[key]
                self._reserved -= n
                self._stats.write_errors += 1
            mine.done.set()
            if isinstance(exc, OSError):
                raise mine.error from None
            raise
        with self._lock:
            del self._writing[key]
            self._reserved -= n
            self._index.add(key, BlockInfo(n, meta.raw_nbytes, meta.parent_hash, meta.position))
            self._stats.bytes_in += n
            self._stats.admissions += 1
            self._sync_counts()
        mine.done.set()  # committed: the puts waiting for this write answer "present"
        return TierPutResult(stored=frame, evicted=evicted)  # now sealed: later tiers reuse it as is

    def _await(self, key: bytes, pending: _InFlight) -> TierPutResult:
        """Wait for another thread's write of ``key`` and answer as it ended: present once
        committed, its error if it failed."""
        pending.done.wait()
        if pending.error is not None:
            raise StorageError(f"{pending.error} (a concurrent write of this block)")
        with self._lock:
            self._index.touch([key])
        return TierPutResult(stored=None)

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
        return {"path": str(self.root), "requested_bytes": self.requested_bytes, **self._recovery}

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


def _lock_directory(root: Path) -> int:
    """An exclusive ``flock`` on ``root/.lock``, with this process's pid written in it; the
    descriptor holds the lock until it is closed. Raises ``DiskInUse`` naming the holder."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(f"disk tier: cannot open the lock file {path}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise DiskInUse(f"disk_path: {root} is in use by another process (pid {holder}, holding {path}); "
                        "one process owns a disk tier's directory: give each server or cache its own") from None
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"disk tier: cannot lock {path}: {exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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
