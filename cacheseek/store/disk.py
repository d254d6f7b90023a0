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

Group commit (``put_many``, on by default): a batch keeps the same order, stage by stage
for all its frames: every data file written, then all fsynced (several at once), then
renamed; then every sidecar written, all fsynced (several at once: the filesystem's
journal commits concurrent fsyncs together), then renamed; then one fsync per shard
directory touched.
Only then does any block of the batch enter the index or count as present, so a crash at
any point leaves, per block, nothing, an orphan, or a whole committed block, as one frame
at a time does; the batch is acknowledged as durable exactly as one frame is. A batch of n
frames costs n data fsyncs, n sidecar fsyncs that overlap, and one directory fsync per
shard instead of n. ``group_commit=False`` commits one frame at a time (a benchmark's
baseline).

Frames being written cannot be evicted, so a batch larger than the room the tier can free
is committed in parts: once the frames it has claimed leave no room for the next, those
are committed (and become evictable) before the rest claim theirs. The bytes on disk stay
within the budget, and a frame that does not fit is written, acknowledged, then evicted
(handed to the tier below), as with one frame at a time. Writers in other threads may
still claim room together that only their commits free: each write, once indexed, evicts
until the budget holds again.

Reads (``get_many``, ``stream``) run many at a time (``store.direct_io``): whole files,
O_DIRECT into 4 KiB-aligned buffers where the filesystem enforces it (``read_path`` in the
stats says which path ran), the checksum computed in the reading thread as each lands.
``stream`` hands frames out in order as each lands, in pooled buffers (page-locked with
``pin=True``) lent with a lease the caller releases once its copy to the device is done.

At start the index is rebuilt from the sidecars alone (no payload is read), temp files and
orphans are removed (blocks of another sidecar version are another release's: left alone,
not indexed, but charged to the budget and the first evicted), and blocks are re-indexed in
the order of the sidecars' modification times, each chain tail first (the eviction policy's
history of uses does not survive a restart).
Every read verifies the payload checksum, and that the frame's header says what its
sidecar told the index: a corrupt or truncated frame, or a sidecar that disagrees with it,
is a miss, and it is deleted and counted (``corrupt``), and so is a block whose file the
device fails to read (EIO: a bad sector; counted in ``read_errors`` too), so that a put of
it writes it again; one not read for want of a descriptor or memory is kept; a frame of another format version is a miss that
sets the block aside as one of another sidecar version (counted in ``foreign_version``).
A read that failed because its block was evicted or deleted after
it was looked up is a plain miss that removes nothing: the block may have been written
again, and acknowledged, since. A victim handed down to the tier below is read first;
where no descriptor or memory is left for that read it stays, and the write that needed
its room is refused (``_evict_one`` says why).

Deletes are durable when they return: the shard directory is fsynced after the unlinks
(once per shard for a ``batched_deletes``, a flush of many blocks); also for a block
evicted from the shard before, which would otherwise come back as one. Evictions alone are
not synced: a block one brings back after a power cut is whole and valid, a cached block.
An eviction takes its victims out of the index under the tier's lock, and unlinks their
files once it has let the lock go (``_settle_removals``): a lookup takes that lock (in a
server's event loop), and a batch's victims unlinked under it, on a disk where an unlink
takes tens of milliseconds, froze every request for seconds. A write takes the room its
victims free once their files are gone; until then other writers count them as held (they
evict for them rather than take their room), but not a trim's victims, which make room for
blocks already written. A put or delete of such a block waits for them: its files have the
same names, and the late unlink would take the new ones. A call unlinks its victims before
it waits on any other thread, and unlinks nothing once the directory is given up (``lost``).
A delete that cannot remove the block's sidecar (a read-only or failing filesystem, EPERM)
raises ``StorageError`` and keeps the block held, as it still is on disk; one whose shard
cannot be synced after raises too (gone, not durably: the shard stays owed, and the next
delete there, or a retry, syncs it). Evictions stay best effort, logged (``_settle_removals``).

A block is "present" (``contains``, a put that finds it) only once its sidecar is renamed
into place: whole and committed. A put of a block whose write is in flight in another
thread waits for that one write and answers as it ended (present, or its error): a block
is never acknowledged while it could still be lost.

One process owns a directory: the tier holds an exclusive ``flock`` on ``<root>/.lock``
(with the owner's pid in it) from open to close, so a second server or embedded cache on
the same directory fails at start instead of budgeting the same bytes twice and missing
the other's blocks. The budget is checked against the filesystem at start: one larger
than the free space plus what the tier already holds, less a headroom of 5% of the two
(``FREE_SPACE_HEADROOM``), is clamped to that, with a warning naming ``disk_bytes``, so
the tier evicts rather than failing writes with ENOSPC. What
the headroom does not cover (the directories, other writers) a write finds out: on ENOSPC
the budget comes down to what is held and the write goes again, evicting; a budget below
``disk_bytes`` is fitted to the filesystem again every ``REFIT_SECONDS``.

The budget counts what a block takes on the filesystem (``charge``): its frame and its
sidecar, each rounded up to the filesystem's allocation unit, not its frame bytes alone
(a quarter more for 32 KiB frames). Writes, evictions, pins, the rebuild at start and the
fit to the filesystem all count the same charge; ``frame_bytes`` in the stats is the
frames' own bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Container, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ..descriptors import note_if_exhausted
from ..errors import ConfigError, FrameError, FrameVersionError, StorageError
from ..log_throttle import LogThrottle
from ..units import format_size
from .direct_io import (PROBE_NAME, BufferPool, ReadDone, ReadFailed, ReadPool, ReadStream, probe_read_path, round_up,
                        start_threads)
from .frame import HASH_SIZES, FrameMeta, parse_frame
from .eviction import DEFAULT_POLICY, SoftSpare
from .tier import BlockFrame, BlockInfo, ClosingIterator, IndexedTier, TierPutResult

log = logging.getLogger("cacheseek.store")

SIDECAR_VERSION = 1
_SIDECAR_KEYS = {"v", "hash", "parent", "pos", "nbytes", "raw_nbytes", "checksum"}
LOCK_NAME = ".lock"
# What the tier (and the server beside it) creates is its owner's alone: a block's KV gives
# back its prompt's text. Passed at creation, so no umask widens them (it only narrows).
FILE_MODE = 0o600
DIR_MODE = 0o700
READ_DEPTH = 16  # whole-file reads in flight
LOGGED_AT_START = 32  # blocks named one by one among those recovery drops (then a count)
# Opening a directory of millions of blocks reads every sidecar (minutes, before the port
# opens): how far it has got is logged this often.
RECOVERY_PROGRESS_SECONDS = 5.0
WRITE_DEPTH = 8  # files written (and fsynced) at once by a group commit
STREAM_KEEP_BYTES = 1 << 30  # read buffers kept for reuse by streams
# Of the space the tier may use (what it holds plus the filesystem's free space), the part
# left free, for the shard directories, the server's state files beside them (owners, pins)
# and other writers, when a budget is clamped to it. A share of that sum, not of the free
# space alone: the tier's own writes and evictions move bytes between the two and leave the
# sum alone, so fitting again every ``REFIT_SECONDS`` finds the same budget. A share of the
# free space handed 95% of what the last fit left free to the tier at every fit, and filled
# the filesystem within seconds.
FREE_SPACE_HEADROOM = 0.05
# A block is charged what its two files take: each rounded up to the filesystem's allocation
# unit (statvfs's ``f_frsize``), taken where it is a power of two in this range, else 4 KiB
# (ext4's and XFS's): a network filesystem may report its transfer size there (1 MiB).
ALLOC_UNIT_RANGE = (512, 64 << 10)
DEFAULT_ALLOC_UNIT = 4096
# How often, at most, a budget below ``disk_bytes`` is fitted to the filesystem again (one
# statvfs: space another writer gave back, or the tier's own overhead, grows or shrinks it).
REFIT_SECONDS = 1.0
LOWERED_LOG_SECONDS = 60.0  # a budget lowered by other writers' files: said at most this often
# How often, at most, a call looks whether the tier's directory is still the one it opened
# (one stat of the root, one fstat of the lock file, one stat of each shard directory:
# ``_shards_changed``): deleted, replaced or emptied under a running
# tier, its blocks were counted and its writes made without the lock (``DiskTier.lost``).
ROOT_CHECK_SECONDS = 1.0
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# ``read_only``'s answer (what ``/readyz`` and the stats say: no path, no key; the log has those)
READ_ONLY = "its filesystem is read-only (EROFS): writes and deletes are refused"
# The only entries recovery touches: shard directories, and in them the tier's own files.
# Anything else (a directory pointed at a folder already in use, a symlinked shard) is
# left alone: the tier deletes nothing it did not write.
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_OWN_FILE = re.compile(r"((?:[0-9a-f]{2})+)\.(frame|meta)")
_OWN_TEMP = re.compile(r"\.tmp-(?:[0-9a-f]{2})+\.(?:frame|meta)-[0-9a-f]{8}")


class _OtherVersion:
    """A sidecar of another format version: ``_load_sidecar`` leaves it, and its frame, alone."""


_OTHER_VERSION = _OtherVersion()


def _sidecar(key: bytes, meta: FrameMeta) -> bytes:
    """The commit record of ``key``'s frame, read back at start by ``_load_sidecar``."""
    return msgpack.packb({
        "v": SIDECAR_VERSION, "hash": key, "parent": meta.parent_hash, "pos": meta.position,
        "nbytes": meta.nbytes, "raw_nbytes": meta.raw_nbytes, "checksum": meta.checksum,
    }, use_bin_type=True)


@dataclass(slots=True)
class _InFlight:
    """One block's write in progress: later puts of the same block wait on ``done``."""

    done: threading.Event = field(default_factory=threading.Event)
    error: StorageError | None = None
    nbytes: int = 0  # its charge (``DiskTier.charge``), counted as in flight
    pinned_nbytes: int = 0  # its bytes, while the block is pinned (before it arrived, or since)


@dataclass(slots=True)
class _Removal:
    """An evicted block's files, out of the index and being unlinked outside the lock: a put
    of the same block waits on ``done`` (else the late unlink removed its new files), and the
    budget counts ``nbytes`` as held until they are gone."""

    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    # Held for other writers' room (``_removing_elsewhere``): a victim evicted for a write,
    # until that write takes its room; not a trim's (``_trim``), which makes room for none.
    counted: bool = True


@dataclass(slots=True)
class _Pending:
    """One frame of a group commit, from its claim to its commit (or failure)."""

    key: bytes
    frame: BlockFrame
    segments: list
    sidecar: bytes
    data_path: Path
    side_path: Path
    flight: _InFlight
    evicted: list
    index: int = 0
    data_tmp: Path | None = None
    side_tmp: Path | None = None
    error: StorageError | None = None

    def fail(self, tier: str, exc: BaseException) -> None:
        self.error = _write_error(tier, self.data_path, exc)


def _attempt(op, pending: _Pending) -> tuple[object, BaseException | None]:
    try:
        return op(pending), None
    except Exception as exc:  # reported per write; an interrupt propagates
        return None, exc


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # flushes the file's dirty pages, whichever descriptor wrote them
    finally:
        os.close(fd)


def _try_fsync_dir(path: Path) -> BaseException | None:
    try:
        fsync_dir(path)
    except OSError as exc:
        return exc
    return None


class _NoSpace(StorageError):
    """A write the filesystem had no room for (ENOSPC, EDQUOT), whatever the budget said."""


class _Unreadable(StorageError):
    """The next victim could not be read to hand it down, for want of a descriptor or memory:
    it stays, and so no room is made."""


class _ReadOnlyFs(StorageError):
    """A write the filesystem refused as read-only (EROFS: remounted so after an error),
    in ``folder``."""

    folder: Path | None = None


def _write_error(tier: str, path: Path, exc: BaseException) -> StorageError:
    note_if_exhausted("disk_write", exc)  # (the cause, connections holding every descriptor, said apart)
    errno_ = exc.errno if isinstance(exc, OSError) else None
    kind = _NoSpace if errno_ in _NO_SPACE else _ReadOnlyFs if errno_ == errno.EROFS else StorageError
    error = kind(f"{tier} tier: writing {path.name} failed: {exc}")
    if isinstance(error, _ReadOnlyFs):
        error.folder = path.parent
    return error


class _Closed(StorageError):
    """A call on the tier after ``close``."""


class _Lost(_Closed):
    """A call on a tier whose directory was deleted or replaced while it had it open
    (``DiskTier.lost``): refused as after ``close``, for the same reason (the directory is
    not this tier's to write)."""


class DiskInUse(ConfigError):
    """The disk tier's directory is owned (locked) by another process or tier."""


class DiskTier(IndexedTier):
    persistent = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, name: str = "disk", fsync: bool = True,
                 policy: str = DEFAULT_POLICY, group_commit: bool = True, read_depth: int = READ_DEPTH,
                 pin: bool = False, trim_at_open: bool = True, max_frame_bytes: int | None = None):
        """``max_frame_bytes``: the largest frame the tier's owner writes or reads (a cache's
        configuration makes frames of one size; a server takes none larger than its limit).
        A data file larger than it is not read, whatever its sidecar says: a sidecar and a
        sparse file agreeing on 64 GiB made every read of the block take 64 GiB of memory."""
        super().__init__(name, capacity_bytes, policy=policy)
        self.max_frame_bytes = max_frame_bytes
        # The calls changing the directory now (writes, deletes, trims: on their callers'
        # threads): ``close`` waits for them before it gives the directory up, else another
        # opener scans it mid-write (and removes a block being written as an orphan), and
        # refuses the ones that come after.
        # Taken through the plain lock (``with self._calls_lock``), whose let-go is one C call:
        # ``Condition.__exit__`` is Python, and an interrupt at its start left the lock held.
        self._calls_lock = threading.Lock()
        self._calls = threading.Condition(self._calls_lock)
        self._active = 0
        self._closed = False
        self.root = Path(root).expanduser()
        self._root_str = str(self.root)
        self.fsync = fsync
        self.group_commit = group_commit
        self.requested_bytes = capacity_bytes
        self._fitted_at = 0.0  # when the budget was last fitted to the filesystem
        self._lowered_said = LogThrottle(LOWERED_LOG_SECONDS)
        self._writing: dict[bytes, _InFlight] = {}
        # Evicted blocks whose files are still being unlinked: an eviction takes a victim out
        # of the index under the lock, and unlinks its files after letting it go
        # (``_settle_removals``); a slow disk (10-50 ms an unlink) held every lookup behind a
        # batch's hundreds of unlinks. ``_doomed``: this thread's, not yet unlinked.
        self._removing: dict[bytes, _Removal] = {}
        self._removing_bytes = 0
        self._removing_counted = 0  # (of those bytes, the ones ``_Removal.counted``)
        self._doomed = threading.local()
        self._reserved = 0
        self._reserved_pinned = 0  # of ``_reserved``: blocks pinned before they arrived
        self._group = {"batches": 0, "frames": 0, "dir_fsyncs": 0}
        self._trim_at_open = trim_at_open
        # Per shard directory (by the hash's first byte): its unlinks so far, and how many of
        # them a directory fsync has made durable. A delete syncs its shard before it
        # returns (``_sync_unlinks``); evictions alone are not synced (``_settle_removals``).
        self._unlinks = [0] * 256
        self._synced = [0] * 256
        # Per shard, the keys a delete removed whose unlinks are not known durable yet (key:
        # the shard's unlink count then): a retry of such a delete, the block no longer
        # held, must sync strictly too (``delete``). Pruned as the shard syncs that far.
        self._deleted_unsynced: list[dict[bytes, int]] = [{} for _ in range(256)]
        self._batch = threading.local()  # ``batched_deletes``: the shards owed a sync at its end
        # Blocks of another format version (another release's, over the same directory): key ->
        # what their files take, oldest first. Left alone, not read, not in the index, but
        # charged to the budget, and the first to go when room is needed (``_shed_others``).
        self._others: dict[bytes, int] = {}
        self._others_bytes = 0
        self._others_evicted = 0
        try:
            created = not self.root.is_dir()
            self.root.mkdir(DIR_MODE, parents=True, exist_ok=True)  # (its missing parents as ``mkdir -p`` makes them)
            if created and fsync:
                fsync_dir(self.root.parent)  # a new directory's entry is its parent's to make durable
            if not created and (mode := stat.S_IMODE(self.root.stat().st_mode)) & 0o002:
                # Left as the operator made it. Read access alone shows others only fixed names
                # (the tier's own entries are the owner's), but write access lets them swap a
                # shard directory for their own: blocks planted, or written where they choose.
                # A group's access is a choice (a team's directory, Kubernetes' fsGroup), not said.
                log.warning("%s tier at %s: every local user may write in this directory (mode %o): they "
                            "could replace what the tier stores; chmod o-w it", name, self.root, mode)
        except OSError as exc:
            raise StorageError(f"{name} tier: cannot create {self.root}: {exc}") from None
        # Released by close(); the finalizer only covers a tier dropped without one.
        self._lock_fd = _lock_directory(self.root)
        self._unlock = weakref.finalize(self, _unlock_directory, self._lock_fd)
        # The directory as opened, to tell it from one deleted or put in its place (``lost``).
        self._root_id = _dir_id(self.root)
        self._lost: str | None = None
        self._root_checked = time.monotonic()
        self._read_only: str | None = None  # (``read_only``)
        self._read_only_at = self.root  # (the folder a write was refused in: ``_accepts_writes`` tries it)
        self._writable_checked = 0.0
        self._shard_ids: dict[str, tuple[int, int]] = {}  # (``_shards_changed``: filled once all are made)
        self.alloc_unit = allocation_unit(self.root)
        try:
            self._recover()
            self._fit_budget_to_filesystem()
            for stale in self.root.glob(f"{glob.escape(PROBE_NAME)}-*"):
                _unlink(stale)  # a probe a kill -9 interrupted (this process owns the directory now)
            self._make_shards()
            self._shard_ids = {f"{self._root_str}/{i:02x}": _dir_id(Path(f"{self._root_str}/{i:02x}"))
                               for i in range(256)}
        except OSError as exc:  # (a directory that cannot be read or grown: full, read-only, no permission)
            self.close()
            raise StorageError(f"{name} tier: cannot open {self.root}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.read_path = probe_read_path(self.root)
        # Both pools' threads start now (``start_threads``): one started under load, at a
        # limit of tasks, failed the call that needed it with a RuntimeError (a 500).
        self._writers = ThreadPoolExecutor(max_workers=WRITE_DEPTH, thread_name_prefix="cacheseek-write")
        try:
            start_threads(self._writers, WRITE_DEPTH, f"the {name} tier's writes")
            # Plain reads hand their buffers over for good (the frames' views keep them); streams
            # lend pooled buffers, pinned when a GPU copies out of them, and get them back.
            self._reads = ReadPool(self.read_path, depth=read_depth, buffers=BufferPool(keep_bytes=0),
                                   max_bytes=max_frame_bytes)
        except BaseException as exc:
            self.close()
            if isinstance(exc, StorageError):
                raise StorageError(f"{name} tier: cannot open {self.root}: {exc}") from None
            raise
        self._stream_buffers = BufferPool(pin=pin, keep_bytes=STREAM_KEEP_BYTES)

    def charge(self, nbytes: int) -> int:
        """What the budget counts for a block of an ``nbytes`` frame (``block_charge``).
        Counted by frame bytes alone, a directory of 32 KiB frames held a quarter more than
        ``disk_bytes``."""
        return block_charge(nbytes, self.alloc_unit)

    def _writing_bytes(self) -> int:
        # (counted as held, as ``_make_room`` counts them; so are other threads' victims whose
        # files are not yet unlinked: they are still on the filesystem)
        return self._reserved + self._removing_elsewhere()

    def _removing_elsewhere(self) -> int:
        """Bytes of blocks other threads evicted to make room for a write and have yet to
        unlink. Under the lock. Such a thread takes the room (``_hold_room``) only once they
        are gone (``_put_one``): counted beside its reservation, they were the same room
        twice, and a writer meanwhile evicted a block more. A trim's victims are not counted
        (``_trim``). This thread's own are not either: it unlinks them before it writes, and
        counted, each eviction loop would give up every block."""
        return self._removing_counted - getattr(self._doomed, "counted", 0)

    def _doom(self, key: bytes, nbytes: int, *, counted: bool = True) -> None:
        """Mark ``key``'s files (``nbytes`` charged) for this thread to unlink once it lets the
        lock go (``_settle_removals``). Under the lock, with the block already out of the index
        (or of ``_others``). ``counted``: held for other writers' room meanwhile (a victim
        evicted for a write: see ``_removing_elsewhere``)."""
        assert key not in self._removing  # (out of the index: no second eviction finds it)
        removal = self._removing[key] = _Removal(nbytes)
        removal.counted = counted
        self._removing_bytes += nbytes
        self._doomed.keys = [*getattr(self._doomed, "keys", ()), key]
        if counted:
            self._removing_counted += nbytes
            self._doomed.counted = getattr(self._doomed, "counted", 0) + nbytes

    def _doomed_count(self) -> int:
        """How many blocks this thread has marked and not yet unlinked (``_doom``)."""
        return len(getattr(self._doomed, "keys", ()))

    def _uncount(self, since: int) -> None:
        """This thread's victims marked after its first ``since`` no longer count as held
        for other writers (a trim's: see ``_trim``). Under the lock."""
        for key in self._doomed.keys[since:] if since < self._doomed_count() else ():
            removal = self._removing[key]
            if removal.counted:
                removal.counted = False
                self._removing_counted -= removal.nbytes
                self._doomed.counted -= removal.nbytes

    def _settle_removals(self) -> None:
        """Unlink the files of the blocks this thread evicted (``_doom``), outside the lock,
        then let the puts waiting on them go. Not under the lock. Called in a ``finally``
        wherever a call that evicted lets the lock go, before it writes (its victims' room
        must be free first) or waits on another thread (whose put of a victim may be what it
        waits on: neither went on), and at the end of every call (``_open_call``).

        Once the tier gave its directory up (``lost``) nothing is unlinked: the directory
        there now is another's, and may hold the same blocks. A block whose unlink an
        interrupt cut short is not left marked (the puts of it, and the budget of every
        other thread, waited on this thread's next call, which may never come): its files
        are charged to the budget as a block of another version is (``_others``), removed
        when room is needed, written over by a put of it, removed by a delete of it."""
        keys = getattr(self._doomed, "keys", None)
        if not keys:
            return
        done = 0
        try:
            for key in keys:
                for path in self._paths(key)[::-1]:  # the commit record first: a crash leaves an orphan
                    if self._lost is None:  # (looked at before each: a batch's unlinks take seconds)
                        _unlink(path)
                done += 1
        finally:
            # (the thread's marks are cleared last, and a key already settled is passed over:
            # a second interrupt in here leaves the rest to the next settle, ``_open_call``'s)
            with self._lock:
                for i, key in enumerate(keys):
                    removal = self._removing.pop(key, None)
                    if removal is None:
                        continue
                    self._removing_bytes -= removal.nbytes
                    if removal.counted:
                        self._removing_counted -= removal.nbytes
                        self._doomed.counted -= removal.nbytes
                    if i < done:
                        if self._lost is None:
                            self._unlinks[key[0]] += 1
                    elif self._lost is None:
                        self._others[key] = removal.nbytes
                        self._others_bytes += removal.nbytes
                    removal.done.set()
                self._doomed.keys, self._doomed.counted = [], 0

    @contextmanager
    def _open_call(self) -> Iterator[None]:
        """Around a call that changes the directory (see ``_calls``); ``_Closed`` after ``close``,
        ``_Lost`` once the directory is no longer the one opened (``lost``)."""
        self._check_root_if_due()
        counted = False
        try:
            # (counted inside the ``try``: an interrupt raised as the lock is let go, past the
            # count, left the call counted for good, and ``close`` waited for it for ever)
            with self._calls_lock:
                if self._closed:
                    raise self._closed_error()
                if self._lost is not None:
                    raise self._lost_error()
                self._active += 1
                counted = True
            yield
        finally:
            if counted:
                try:
                    self._settle_removals()  # (what a call evicted is unlinked before ``close`` may return)
                finally:
                    with self._calls_lock:
                        self._active -= 1
                        if not self._active:
                            self._calls.notify_all()

    def _closed_error(self) -> _Closed:
        return _Closed(f"{self.name} tier: closed ({self.root})")

    # -- the directory under the tier ----------------------------------------------------

    def lost(self) -> str | None:
        """Why the tier gave its directory up, looked at now: it was deleted, another was put
        in its place, or its lock file or a shard directory was removed (the contents
        deleted by hand: ``rm -rf DIR/*`` leaves the lock), while the tier had it open;
        else None.

        Given up for good: every block it indexed is forgotten (a miss, not counted as
        corrupt), writes and deletes are refused (``StorageError``). Going on, it counted
        blocks that were gone, and wrote into a directory made again at the path without
        holding its lock, beside a second process that found none. A restart opens the
        directory there is then (``cacheseek serve``'s ``/readyz`` answers 503 meanwhile)."""
        if self._lost is None and not self._closed:
            self._root_checked = time.monotonic()
            if (why := self._root_changed()) is not None:
                self._give_up(why)
        return self._lost

    def _root_changed(self) -> str | None:
        try:
            if _dir_id(self.root) != self._root_id:
                return "replaced by another directory"
            if os.fstat(self._lock_fd).st_nlink == 0:
                return f"emptied (its lock file {LOCK_NAME} was deleted)"
        except FileNotFoundError:
            return "deleted"
        except OSError:
            return None  # (no answer: an I/O error, a permission taken away, says nothing of which directory)
        return self._shards_changed()

    def _shards_changed(self) -> str | None:
        """Why the directory counts as emptied by hand, if a shard directory is gone or
        another: ``rm -rf DIR/*``, the usual way to clear a cache, leaves the dot-files, the
        lock among them, so the lock's link count says nothing of it, and the tier went on
        offering every block it had indexed (each found missing only when read, and counted
        as damage). A stat of each of the 256, about a third of a millisecond, at most once a
        second. A shard the tier makes again (a write finding its own gone) looks first."""
        for path, ident in self._shard_ids.items():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return f"emptied (its shard directory {path[-2:]} was deleted)"
            except OSError:
                return None  # (no answer: see ``_root_changed``)
            if (st.st_dev, st.st_ino) != ident:
                return f"emptied (its shard directory {path[-2:]} was replaced)"
        return None

    def _check_root_if_due(self) -> None:
        if self._lost is None and time.monotonic() - self._root_checked >= ROOT_CHECK_SECONDS:
            self.lost()

    def _give_up(self, why: str) -> None:
        with self._lock:
            if self._lost is not None:
                return
            self._lost = why
            blocks, held = len(self._index), self._index.used_bytes
            for key in self._index.keys():
                self._index.remove(key)  # (the store's residency hears of each: not served from here)
            self._others.clear()
            self._others_bytes = 0
            self._sync_counts()
        log.error("%s tier: its directory %s was %s while the tier had it open: the tier gives it up, its %d blocks "
                  "(%s) forgotten, nothing more read or written there; restart to open the directory that is there now",
                  self.name, self.root, why, blocks, format_size(held))

    def read_only(self) -> str | None:
        """Why the tier cannot write now, while it still serves what it holds: its last
        write (or delete) was refused as on a read-only filesystem (EROFS: ext4's
        ``errors=remount-ro`` after an I/O error). None once a write commits again (the
        filesystem remounted read-write), and while none was refused.

        While set, asking looks again (at most once every ``ROOT_CHECK_SECONDS``): a probe
        file created, written and removed (no fsync) in the folder the write was refused
        in; accepted, the state clears. A write-through server's ``/readyz`` asks it: not
        ready, it is sent no writes, so waiting for a write to commit kept it out of a load
        balancer's pool for good once the filesystem was remounted read-write."""
        if (self._read_only is not None and self._lost is None and not self._closed
                and time.monotonic() - self._writable_checked >= ROOT_CHECK_SECONDS):
            self._writable_checked = time.monotonic()
            if self._accepts_writes(self._read_only_at):
                with self._lock:
                    self._writable_again()
        return self._read_only

    def _accepts_writes(self, folder: Path) -> bool:
        """Whether ``folder``'s filesystem is no longer read-only: an empty file made and
        removed at once (named as a write's temporary file, which the next open removes if a
        crash leaves it). No bytes are written: a filesystem writable again but full (or
        over a quota) refused them, and stayed "read-only" for good, though the tier's own
        writes evict to make room. Only a refusal as read-only (or of permission) says it
        still is."""
        path = folder / f".tmp-00.frame-{secrets.token_hex(4)}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as exc:
            return exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return True

    def _write_failed(self, error: StorageError) -> None:
        """Count a failed write (not one the filesystem had no room for: it goes again, and
        counts if it fails again), and note a read-only filesystem. Under the lock."""
        if isinstance(error, _NoSpace):
            return
        self._stats.write_errors += 1
        if isinstance(error, _ReadOnlyFs) and self._read_only is None:
            self._went_read_only(str(error), error.folder)

    def _went_read_only(self, why: str, folder: Path | None) -> None:
        """Under the lock. Said once, as an error: every write from now on fails the same
        way (a write-through server answers each 507, and ``/readyz`` 503), until the
        filesystem is made writable again, which the next write that commits notices, or
        ``read_only``'s probe of ``folder`` (the root if None)."""
        self._read_only = READ_ONLY
        self._read_only_at = folder or self.root
        self._writable_checked = time.monotonic()
        log.error("%s tier at %s: its filesystem is read-only (%s): every write and delete is refused, reads go "
                  "on; remount it read-write (after fsck, if the kernel remounted it read-only after an error)",
                  self.name, self.root, why)

    def _writable_again(self) -> None:
        """Under the lock: a write committed."""
        if self._read_only is not None:
            self._read_only = None
            log.info("%s tier at %s: writes commit again (the filesystem is writable)", self.name, self.root)

    def _lost_error(self) -> _Lost:
        return _Lost(f"{self.name} tier: its directory {self.root} was {self._lost} while open: nothing is written "
                     "there until a restart opens it again")

    def _too_large(self, nbytes: int) -> StorageError:
        # A budget fitted below disk_bytes is the filesystem's doing (full: other writers, or
        # the headroom): said, else a 507 blamed the setting, or the frame.
        why = "" if self.capacity_bytes >= self.requested_bytes else (
            f", lowered from disk_bytes ({self.requested_bytes}) to what the filesystem has room for, full or smaller")
        return StorageError(f"{self.name} tier: a {nbytes}-byte frame ({self.charge(nbytes)} bytes on disk, with its "
                            f"sidecar) exceeds the budget ({self.capacity_bytes}{why})")

    def close(self) -> None:
        """Give the directory up (another process may then open it), once the writes,
        deletes and trims in flight on other threads are done; later ones are refused."""
        with self._calls_lock:
            self._closed = True
            while self._active:
                self._calls.wait()
        if hasattr(self, "_reads"):
            self._reads.close()
        if hasattr(self, "_writers"):
            self._writers.shutdown(wait=True)
        self._unlock()  # closes the lock file's descriptor (once), which releases the flock

    def _fit_budget_to_filesystem(self) -> None:
        """Clamp the budget to what the filesystem can hold: free space (less a headroom)
        plus the bytes this tier already holds. Logged as a warning naming the setting."""
        self._refit(at_start=True)
        if self._trim_at_open:
            self.trim()

    def _refit(self, *, at_start: bool = False, full: bool = False) -> None:
        """The budget fitted to the filesystem: the bytes held (and being unlinked, all as
        charged: ``charge``) plus its free space, less a headroom of
        ``FREE_SPACE_HEADROOM`` of that sum, at most ``disk_bytes``. ``full``: a
        write just found no room (other writers, the directories: what the headroom did not
        cover), so the budget is what is held now, and the write that goes again evicts for
        its room.
        Fitted again every ``REFIT_SECONDS`` while below ``disk_bytes``,
        so it grows back when another writer frees space (the tier's own evictions move
        bytes from held to free: they change nothing)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return
        # Full: the budget is what is held, so that the write going again evicts at least
        # its own charge, the units its files will take.
        free = 0 if full else st.f_bavail * st.f_frsize
        with self._lock:
            self._fitted_at = time.monotonic()
            # The writes in flight are in ``free`` for what they have yet to write and in
            # neither for what they have written, until they commit: the true room lies between
            # the fit without them (``room``) and the fit with them held (``ceiling``). The
            # budget comes down only where it is over the ceiling, and goes up only where it is
            # under the floor: counted in both, a refit under load raised it past the headroom
            # (even the filesystem's size); counted in neither, it lowered it by what had been
            # written, and the next commit evicted cached blocks down to that for good.
            held = self._index.used_bytes + self._others_bytes + self._removing_bytes
            headroom = 0 if full else int((held + free) * FREE_SPACE_HEADROOM)
            room = min(self.requested_bytes, held + free - headroom)
            before = self.capacity_bytes
            if not full:
                flying = self._reserved
                ceiling = min(self.requested_bytes,
                              held + flying + free - int((held + flying + free) * FREE_SPACE_HEADROOM))
                if room <= before <= ceiling:
                    return
                room = ceiling if before > ceiling else room
            if room == before or (at_start and room > before):
                return
            self.capacity_bytes = self._stats.capacity_bytes = room
            # ARC's target and ghost lists are sized by the budget: the index follows it.
            self._index.resize(room)
        if at_start:
            log.warning("disk_bytes: %s asked for the %s tier at %s, but its filesystem has %s free (%s already "
                        "stored here), less a headroom of %d%% of the two (%s) kept free for the server's state "
                        "files and other writers: the budget is clamped to %s", format_size(before), self.name,
                        self.root, format_size(free), format_size(held), round(FREE_SPACE_HEADROOM * 100),
                        format_size(headroom), format_size(room))
        elif full:
            log.warning("%s tier at %s: the filesystem is full (%s held here, %s free): the budget is lowered "
                        "from %s to %s; disk_bytes asked for %s", self.name, self.root, format_size(held),
                        format_size(st.f_bavail * st.f_frsize), format_size(before), format_size(room),
                        format_size(self.requested_bytes))
        elif room == self.requested_bytes:
            log.info("%s tier at %s: the budget is disk_bytes (%s) again", self.name, self.root, format_size(room))
        elif room < before and self._lowered_said.due():
            # (other writers filling the filesystem: each refit may lower it, and the blocks
            # over it are evicted; said once a minute at most)
            log.warning("%s tier at %s: other writers are filling the filesystem (%s free): the budget is lowered "
                        "from %s to %s, and blocks over it evicted; disk_bytes asked for %s", self.name, self.root,
                        format_size(st.f_bavail * st.f_frsize), format_size(before), format_size(room),
                        format_size(self.requested_bytes))

    def _refit_if_due(self) -> None:
        if self.capacity_bytes < self.requested_bytes and time.monotonic() - self._fitted_at > REFIT_SECONDS:
            self._refit()

    # -- paths ---------------------------------------------------------------------------

    def _make_shards(self) -> None:
        """Every shard directory made now, their entries fsynced in the root once: a write
        then never makes one: one removed meanwhile gives the directory up as emptied by
        hand (``_shards_changed``), its blocks gone with it (``_shard_dir`` covers a check
        that could not answer)."""
        made = loose = 0
        for i in range(256):
            shard = self.root / f"{i:02x}"
            try:
                shard.mkdir(DIR_MODE)
                made += 1
            except FileExistsError:
                if not shard.is_dir():  # (a symlink to a directory is the operator's choice: it works)
                    # Every write of a block whose hash begins so would fail for good. Not
                    # moved aside: it is not the tier's, and may be someone's file.
                    raise StorageError(f"{self.name} tier: {shard} is in the way of a shard directory (blocks whose "
                                       "hashes begin with those two hex digits are kept there): move or remove "
                                       "it, then start again") from None
                loose += bool(shard.stat().st_mode & 0o007)
        if made and self.fsync:
            fsync_dir(self.root)
        if loose:
            # Said, not changed: a chmod of every file would hold the start for minutes on a
            # large directory, and its modes are the operator's to decide.
            log.warning("%s tier at %s: %d shard directories (an earlier release's, or made by hand) let every local "
                        "user read the blocks in them, whose KV gives back prompts: chmod -R go= %s",
                        self.name, self.root, loose, self.root)

    def _shard_dir(self, shard: Path) -> None:
        """Make a shard directory if it is not there; a new one's entry is fsynced in the
        root, since the shard's own fsync (after a write's renames) does not cover it."""
        try:
            shard.mkdir(DIR_MODE)
        except FileExistsError:
            return
        if self.fsync:
            fsync_dir(self.root)

    def _paths(self, key: bytes) -> tuple[Path, Path]:
        hexkey = key.hex()
        shard = self.root / hexkey[:2]
        return shard / f"{hexkey}.frame", shard / f"{hexkey}.meta"

    # -- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        found: list[tuple[float, bytes, BlockInfo]] = []
        removed = {"temp": 0, "orphan": 0, "bad_sidecar": 0}
        orphans: list[Path] = []
        foreign = other_version = over_limit = largest = 0
        others: list[tuple[float, bytes, int]] = []
        with os.scandir(self.root) as entries:
            shards = sorted(Path(e.path) for e in entries
                            if _SHARD_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
        said_at = time.monotonic()
        for done, shard in enumerate(shards, 1):
            names: dict[str, Path] = {}
            with os.scandir(shard) as entries:
                for e in entries:
                    if e.is_file(follow_symlinks=False) and (_OWN_FILE.fullmatch(e.name) or _OWN_TEMP.fullmatch(e.name)):
                        names[e.name] = Path(e.path)
                    else:
                        foreign += 1
            handled = set()
            for name, path in names.items():
                if name.startswith(".tmp-"):
                    _unlink(path)
                    removed["temp"] += 1
                elif name.endswith(".meta"):
                    entry = self._load_sidecar(path, names)
                    if isinstance(entry, _OtherVersion):  # (_OTHER_VERSION: its one instance)
                        other_version += 1  # (its data file too is left, as handled)
                        others.append(self._other_files(path))
                    elif isinstance(entry, str):
                        removed["bad_sidecar"] += 1
                        if removed["bad_sidecar"] <= LOGGED_AT_START:  # (said first: a crash now loses no word)
                            log.warning("%s tier: block %s dropped at start, its files removed: %s (%s)", self.name,
                                        path.stem, entry, path)
                        _unlink(path)
                        _unlink(path.with_suffix(".frame"))
                    elif self.max_frame_bytes is not None and entry[2].nbytes > self.max_frame_bytes:
                        # Whole, but larger than the owner reads now (a restart with a lower
                        # max_frame_bytes): set aside as another version's blocks are, not
                        # read as damage and deleted.
                        over_limit += 1
                        largest = max(largest, entry[2].nbytes)
                        others.append(self._other_files(path))
                    else:
                        found.append(entry)
                    handled.add(path.with_suffix(".frame").name)
            orphans += [path for name, path in names.items() if name.endswith(".frame") and name not in handled]
            if time.monotonic() - said_at >= RECOVERY_PROGRESS_SECONDS:
                said_at = time.monotonic()
                log.info("%s tier: opening %s: %d of %d shard directories read, %s blocks found", self.name,
                         self.root, done, len(shards), f"{len(found):,}")
        if removed["bad_sidecar"] > LOGGED_AT_START:
            log.warning("%s tier: %d blocks in all dropped at start for a bad sidecar (the first %d named above)",
                        self.name, removed["bad_sidecar"], LOGGED_AT_START)
        if removed["temp"] or orphans:
            # What a crash leaves of the writes it interrupted (a temp file, a data file whose
            # sidecar, the commit record, was never renamed in): never acknowledged. Said
            # before the orphans go, so that a crash meanwhile loses no word of them.
            named = ", ".join(p.stem for p in orphans[:LOGGED_AT_START]) + (
                f" and {len(orphans) - LOGGED_AT_START} more" if len(orphans) > LOGGED_AT_START else "")
            log.warning("%s tier: removed at start %d temp files and %d data files without a sidecar (writes "
                        "interrupted before their commit: never acknowledged)%s", self.name, removed["temp"],
                        len(orphans), f": blocks {named}" if orphans else "")
        for path in orphans:
            _unlink(path)
        removed["orphan"] = len(orphans)
        if foreign:
            log.warning("%s tier: %d entries in the shard directories of %s are not the tier's files: left alone",
                        self.name, foreign, self.root)
        if other_version:
            log.warning("%s tier: %d blocks in %s were written by another format version of the tier (sidecar "
                        "version other than %d): left alone and not read, but counted in the budget, and the first "
                        "evicted when room is needed", self.name, other_version, self.root, SIDECAR_VERSION)
        if over_limit:
            log.warning("%s tier: %d blocks in %s are larger than the largest frame read here (%d bytes: a server's "
                        "max_frame_bytes, a cache's frame size; the largest of them %d bytes): left alone and not "
                        "served (opened with a limit that takes them, they are served again), but counted in the "
                        "budget, and the first evicted when room is needed", self.name, over_limit, self.root,
                        self.max_frame_bytes, largest)
        for key, info in _oldest_first(found):
            self._index.add(key, info)
        for _, key, charge in sorted(others):
            self._others[key] = charge
            self._others_bytes += charge
        self._recovery = {"recovered_blocks": len(self._index), "removed_at_start": removed,
                          "other_version_at_start": other_version, "over_frame_limit_at_start": over_limit}
        if self._trim_at_open:
            self.trim()
            self._recovery["recovered_blocks"] = len(self._index)
        self._sync_counts()

    def _refuse_beside_pins(self, key: bytes, n: int) -> None:
        """Refuse ``n`` bytes for ``key``, before anything is evicted, when they cannot fit
        beside the pinned blocks. Under the lock.

        A block pinned before it arrives can never be evicted, nor can the other such blocks
        in flight: together with the pinned ones they must fit the budget, or concurrent
        writes of them would leave the tier over it for good (a trim evicts only unpinned
        blocks). An unpinned block may overshoot while others are in flight: the last write
        to be indexed trims the excess."""
        in_flight = self._reserved_pinned if self._index.is_pinned(key) else 0
        if not self._fits_beside_pins(n, in_flight=in_flight):
            self._stats.write_errors += 1
            raise self._no_room(n, in_flight=in_flight)

    def _hold_room(self, key: bytes, n: int) -> _InFlight:
        """Count ``n`` bytes of ``key`` as in flight (checked by ``_refuse_beside_pins``)."""
        self._reserved += n
        if self._index.is_pinned(key):
            self._reserved_pinned += n
            return _InFlight(nbytes=n, pinned_nbytes=n)
        return _InFlight(nbytes=n)

    def pin(self, keys: Iterable[bytes]) -> None:
        """Refused (``StorageError``, nothing pinned) when the blocks held here would not fit
        beside those pinned already: pinned blocks are never evicted, so the tier would stay
        over its budget for good. (A pin made again at a restart, over a tier not yet
        trimmed to a smaller budget, is the case: blocks held fit their budget otherwise.)"""
        keys = list(keys)
        with self._lock:
            index = self._index
            coming = sum(info.charge for key in set(keys)
                         if not index.is_pinned(key) and (info := index.get(key)) is not None)
            if coming and index.pinned_bytes + coming > self.capacity_bytes:
                raise StorageError(
                    f"{self.name} tier: cannot pin {coming} bytes beside the {index.pinned_bytes} pinned: the budget "
                    f"is {self.capacity_bytes} bytes, and pinned blocks are never evicted")
            self._repin_locked(index.pin, keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._repin(self._index.unpin, list(keys))

    def _repin(self, change: Callable[[list[bytes]], None], keys: list[bytes]) -> None:
        """``change`` (the index's pin or unpin) of ``keys``; blocks of them being written
        count as pinned in flight while they are pinned, whenever the pin came
        (``_refuse_beside_pins`` checks later writes against them)."""
        with self._lock:
            self._repin_locked(change, keys)

    def _repin_locked(self, change: Callable[[list[bytes]], None], keys: list[bytes]) -> None:
        change(keys)
        for key in keys:
            mine = self._writing.get(key)
            if mine is not None:
                pinned = mine.nbytes if self._index.is_pinned(key) else 0
                self._reserved_pinned += pinned - mine.pinned_nbytes
                mine.pinned_nbytes = pinned
        self._sync_counts()

    def _refused_at_commit(self, key: bytes, n: int) -> StorageError | None:
        """Why a written block cannot be indexed: it is pinned (maybe only since its write
        began) and does not fit beside the pinned blocks indexed meanwhile. Indexed, it
        would keep the tier over its budget for good (a trim evicts no pinned block). Under
        the lock. Or the directory was given up while it was written (``lost``)."""
        if self._lost is not None:
            return self._lost_error()
        if self._index.is_pinned(key) and not self._fits_beside_pins(n):
            return self._no_room(n)
        return None

    def _undo_write(self, key: bytes, mine: _InFlight, n: int, paths: tuple[Path, ...], error: StorageError, *,
                    renamed: bool = False) -> None:
        """A write that will not be indexed: its files removed while the block is still marked
        in flight (a new write of it must not lose its files to this removal), then its room
        given back, and whoever waits on it told. ``renamed``: its files were in place, their
        renames fsynced (a write refused at its commit), so their removal is synced as a
        delete's is: else a power cut brings back a block its put answered as failed."""
        for path in paths:  # the sidecar (the commit record) first
            _unlink(path)
        if renamed:
            with self._lock:
                self._unlinks[key[0]] += 1
                owed = {key[0]: self._unlinks[key[0]]}
            self._sync_unlinks(owed)
        mine.error = error
        with self._lock:
            del self._writing[key]
            self._release(mine, n)
            # A write the filesystem had no room for goes again (``_put_result``,
            # ``_commit_part``), which counts it only if it fails again: a frame stored on
            # its second try is no write error.
            self._write_failed(error)
        mine.done.set()

    def _release(self, mine: _InFlight, n: int) -> None:
        """The bytes ``_hold_room`` counted as in flight, given back (committed or failed)."""
        self._reserved -= n
        self._reserved_pinned -= mine.pinned_nbytes

    def _evict_one(self, evicted: list[tuple[bytes, BlockFrame | None]], spare: Container[bytes] = ()) -> bool:
        """Give up the policy's victim into ``evicted``, read first when the tier below takes
        demotions; False where only blocks ``spare`` names are left to give up. Under the
        lock, with something evictable; the victim's files are unlinked once the lock is let
        go (``_settle_removals``).

        A victim that cannot be read for want of a descriptor or memory is kept, and
        ``_Unreadable`` raised: it may be the only copy of an acknowledged block, and the
        shortage passes (every other victim would meet it too). One whose file is bad holds
        no block to hand down: dropped and counted corrupt. One the disk fails to read (an
        I/O error) is evicted without its bytes, counted in ``read_errors``: kept, it
        would hold the tier full for good, since no read of it succeeds either."""
        victim = self._index.victim(spare)
        if victim is None:
            assert spare  # (called only while the index holds an evictable block, under the lock)
            return False
        info = self._index.get(victim)
        assert info is not None  # (the index's own victim)
        frame_v = None
        if self.demote_evicted:
            try:
                frame_v = self._read_frame(victim)
            except ReadFailed as exc:
                if exc.shortage:
                    self._stats.read_errors += 1
                    log.warning("%s tier: block %s, the next to evict, could not be read to hand it down (%s); "
                                "it is kept", self.name, victim.hex(), exc)
                    raise _Unreadable(f"block {victim.hex()}, the next to evict, could not be read to hand it "
                                      f"down to the tier below ({exc}); it is kept") from None
                if isinstance(exc.cause, FrameVersionError):
                    self._stats.foreign_version += 1  # (another release's: evicted, not handed down)
                elif exc.damaged:
                    self._doom(victim, info.charge)
                    self._index.remove(victim)
                    self._stats.corrupt += 1
                    log.warning("%s tier: block %s, the next to evict, is damaged on disk (%s): not handed down, "
                                "its files removed", self.name, victim.hex(), exc)
                    return True
                else:
                    self._stats.read_errors += 1
                    log.warning("%s tier: evicting block %s, whose read failed (%s): not handed down", self.name,
                                victim.hex(), exc)
        self._doom(victim, info.charge)
        self._index.remove(victim, evicted=True)
        self._stats.evictions += 1
        evicted.append((victim, frame_v))
        return True

    def _make_room(self, n: int, evicted: list[tuple[bytes, BlockFrame | None]], spare: Container[bytes] = ()) -> None:
        """Evict (into ``evicted``) until ``n`` bytes more fit or nothing is left to evict.
        Under the lock. A victim kept for a shortage (``_evict_one``) refuses the write that
        needed its room: ``StorageError``, counted in ``write_errors``; so does a block of
        ``spare`` (``Spared``, not counted)."""
        self._shed_others(self._index.used_bytes + self._writing_bytes() + n)
        while self._index.used_bytes + self._writing_bytes() + n > self.capacity_bytes and self._index.evictable:
            try:
                gave_up = self._evict_one(evicted, spare)
            except _Unreadable as exc:
                self._stats.write_errors += 1
                raise StorageError(f"{self.name} tier: no room for a {n}-byte frame: {exc}") from None
            if not gave_up:
                raise self._spared(n)

    def _made_room(self, n: int, evicted: list[tuple[bytes, BlockFrame | None]], spare: Container[bytes] = ()) -> bool:
        """``_make_room``; whether it marked any block for removal (the caller then unlinks
        them, and looks again before it takes the room). Under the lock."""
        since = self._doomed_count()
        self._make_room(n, evicted, spare)
        return self._doomed_count() > since

    def _trim(self, evicted: list[tuple[bytes, BlockFrame | None]], spare: Container[bytes] = ()) -> None:
        """Evict until the budget holds again. Under the lock, after indexing a write: a
        claim cannot evict blocks still being written by other threads, so concurrent writes
        may together overshoot it; the last of them to be indexed evicts the excess. A
        victim kept for a shortage ends the trim: the tier stays over its budget until the
        next write trims, rather than lose a block (the write is committed: it stands).

        Blocks being unlinked are not counted, and its own victims count as held for no
        other writer (``_uncount``): they make room for blocks already indexed, so counted,
        every writer meanwhile evicted a block more for them, and the tier ended under its
        budget. Their files stay on the filesystem only until this thread unlinks them, as
        the overshoot they correct did."""
        since = self._doomed_count()
        try:
            self._shed_others(self._index.used_bytes)
            while self._index.used_bytes > self.capacity_bytes and self._index.evictable:
                try:
                    if not self._evict_one(evicted, spare):
                        return
                except _Unreadable:
                    return
        finally:
            self._uncount(since)

    def trim(self) -> list[tuple[bytes, BlockFrame | None]]:
        """Evict, least recently used first and never a pinned block, until the budget holds;
        the victims, read first when the tier below takes demotions, as any eviction's
        (``TieredStore.trim`` hands them down). Done at open, over a directory that holds
        more than the budget (a restart with a smaller ``disk_bytes``): inside the
        constructor nothing is below yet, so nothing is handed down; a tier opened with
        ``trim_at_open=False`` is trimmed by its owner once the pins a restart makes again
        are in place (trimmed before, a pinned chain the restart found was evicted first
        when it was the oldest, and its pin was lost) and the tiers below are there."""
        evicted: list[tuple[bytes, BlockFrame | None]] = []
        with self._open_call(), self._lock:
            self._trim(evicted)
            self._sync_counts()
        return evicted

    def _load_sidecar(self, path: Path, names: dict[str, Path]
                      ) -> tuple[float, bytes, BlockInfo] | _OtherVersion | str:
        """The block a sidecar commits, or why it is not one of this tier's (a str): every
        field of the type and range a write gives it, in the shard its hash names, beside a
        data file of its size. ``_OTHER_VERSION``: a sidecar with a version field other than
        ``SIDECAR_VERSION`` (an older or newer release over the same directory, after a
        rollback): not this tier's to judge, and not to delete."""
        try:
            size = path.stat().st_size
            if size > 4096:
                return f"the sidecar is {size} bytes, more than any the tier writes"
            try:
                side = msgpack.unpackb(path.read_bytes(), raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                return f"the sidecar ({size} bytes) is not msgpack: {exc}"
            if isinstance(side, dict) and type(side.get("v")) is int and side["v"] != SIDECAR_VERSION:
                return _OTHER_VERSION
            if not isinstance(side, dict) or set(side) != _SIDECAR_KEYS or side["v"] != SIDECAR_VERSION:
                return "the sidecar is not a map of the tier's fields"
            key, parent = side["hash"], side["parent"]
            if not (isinstance(key, bytes) and len(key) in HASH_SIZES and isinstance(parent, bytes)
                    and len(parent) == len(key)):
                return "the sidecar's hash or parent is not a block hash"
            if path.name != f"{key.hex()}.meta" or path.parent.name != key.hex()[:2]:
                return f"the sidecar names another block ({key.hex()})"
            numbers = [side["nbytes"], side["raw_nbytes"], side["pos"]]
            if not all(type(x) is int and 0 <= x < 1 << 62 for x in numbers):
                return "the sidecar's sizes or position are out of range"
            frame_name = f"{key.hex()}.frame"
            if frame_name not in names:
                return "its data file is missing"
            if (actual := names[frame_name].stat().st_size) != side["nbytes"]:
                return f"its data file is {actual} bytes, its sidecar says {side['nbytes']}"
            info = BlockInfo(nbytes=side["nbytes"], raw_nbytes=side["raw_nbytes"], parent=parent, position=side["pos"],
                             charged_nbytes=self.charge(side["nbytes"]))
            return path.stat().st_mtime, key, info
        except Exception as exc:  # whatever is wrong with one file, the tier starts without it
            return f"the sidecar cannot be read: {exc}"

    def _other_files(self, side_path: Path) -> tuple[float, bytes, int]:
        """(mtime, key, charge) of a block of another format version, from its files as they
        are (its sidecar's fields are another release's: not read)."""
        charge = 0
        mtime = 0.0
        for path in (side_path, side_path.with_suffix(".frame")):
            try:
                st = path.stat()
            except OSError:
                continue
            charge += round_up(max(st.st_size, 1), self.alloc_unit)
            mtime = max(mtime, st.st_mtime)
        return mtime, bytes.fromhex(side_path.stem), charge

    def _set_aside(self, key: bytes, info: BlockInfo) -> bool:
        """A block whose frame a read found of another format version (a sidecar of this one
        beside it: a release that changed the frame alone): out of the index, its files kept
        and still charged, as a block of another sidecar version is at start. Only if the
        index still holds the entry read (see ``_drop_if_unchanged``). Under the lock."""
        if self._index.get(key) is not info:
            return False
        self._index.remove(key)
        self._others[key] = info.charge
        self._others_bytes += info.charge
        return True

    def _forget_other(self, key: bytes) -> None:
        """``key``'s block of another version leaves the budget: written over (this release
        stores the block), or deleted. Under the lock."""
        charge = self._others.pop(key, None)
        if charge is not None:
            self._others_bytes -= charge

    def _shed_others(self, need: int) -> None:
        """Remove blocks of another format version, oldest first, until ``need`` (the bytes
        the caller counts: held, in flight and coming) fits beside those left. Under the lock.
        They go first: no read here can use them, and another release may never come back for
        them; left out of the budget, the directory held them on top of ``disk_bytes``."""
        while self._others and need + self._others_bytes > self.capacity_bytes:
            key = next(iter(self._others))
            charge = self._others[key]
            self._forget_other(key)
            self._doom(key, charge)
            self._others_evicted += 1

    # -- writes --------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        with self._open_call():
            result = self._put_result(key, frame)
        if result.error is not None:
            raise result.error
        return result

    def _put_result(self, key: bytes, frame: BlockFrame, spare: Container[bytes] = ()) -> TierPutResult:
        """One frame's put, its failure in the result with the blocks it evicted (handed
        down all the same: a put that fails after evicting must not lose its victims)."""
        self._refit_if_due()
        evicted: list[tuple[bytes, BlockFrame | None]] = []
        try:
            try:
                result = self._put_one(key, frame, evicted, spare)
            except _NoSpace:
                # The filesystem is fuller than the budget knew: the budget comes down to
                # what it can hold, and the write goes again, evicting for its room.
                self._refit(full=True)
                result = self._put_one(key, frame, evicted, spare)
        except StorageError as exc:
            if isinstance(exc, _NoSpace):  # (its second try: the first is not counted)
                self.count(write_errors=1)
            return TierPutResult(stored=None, evicted=evicted, error=exc)
        result.evicted = evicted
        return result

    def _put_one(self, key: bytes, frame: BlockFrame, evicted: list[tuple[bytes, BlockFrame | None]],
                 spare: Container[bytes] = ()) -> TierPutResult:
        """``put``, once; victims go into ``evicted`` (also when it raises), none of ``spare``."""
        segments = frame.wire_segments()  # seals the frame if it is not yet
        meta = frame.meta
        n = self.charge(meta.nbytes)
        if n > self.capacity_bytes:
            self.count(write_errors=1)
            raise self._too_large(meta.nbytes)
        data_path, side_path = self._paths(key)
        mine: _InFlight | None = None
        try:
            while mine is None:
                removal: _Removal | None = None
                pending: _InFlight | None = None
                try:
                    # (marked inside the ``try``: an interrupt as the lock was let go left the block in
                    # flight for good, its room held, and the next put of it, and close, waiting for ever)
                    with self._lock:
                        present = key in self._index and self._still_whole(key)
                        if present:
                            self._index.touch([key])
                        # (its old files still being unlinked: written now, they went with them)
                        elif (removal := self._removing.get(key)) is None and \
                                (pending := self._writing.get(key)) is None:
                            self._refuse_beside_pins(key, n)
                            self._forget_other(key)  # (its files are about to be written over)
                            # The room is taken once the victims are gone: see ``_removing_elsewhere``.
                            if not self._made_room(n, evicted, spare):
                                mine = self._writing[key] = self._hold_room(key, n)
                finally:
                    self._settle_removals()  # (the victims' room freed before this frame takes it)
                if present:
                    return TierPutResult(stored=None)
                if removal is not None:
                    removal.done.wait()
                elif pending is not None:
                    # Waited for outside the lock: that write takes the lock to commit.
                    answer = self._await(key, pending)
                    if answer is not None:
                        return answer
            self._write_atomic(data_path, segments)
            self._write_atomic(side_path, [_sidecar(key, meta)])
            if self.fsync:
                fsync_dir(data_path.parent)
        except BaseException as exc:
            if mine is None:  # (refused, or waited for another write: nothing of this one to undo)
                raise
            self._undo_write(key, mine, n, (side_path, data_path), _write_error(self.name, data_path, exc))
            if isinstance(exc, OSError):
                assert mine.error is not None  # (set by _undo_write)
                raise mine.error from None
            raise
        with self._lock:
            refused = self._refused_at_commit(key, n)
            if refused is None:
                del self._writing[key]
                self._release(mine, n)
                self._index.add(key, BlockInfo(meta.nbytes, meta.raw_nbytes, meta.parent_hash, meta.position, n))
                self._stats.bytes_in += meta.nbytes
                self._stats.admissions += 1
                self._writable_again()
                self._trim(evicted, spare)
                self._sync_counts()
        self._settle_removals()
        if refused is not None:
            self._undo_write(key, mine, n, (side_path, data_path), refused, renamed=True)
            raise refused
        mine.done.set()  # committed: the puts waiting for this write answer "present"
        return TierPutResult(stored=frame, evicted=evicted)  # now sealed: later tiers reuse it as is

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, lease_stored: bool = False,
                 room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """Store several frames, committed together (see the module's docstring); a failure
        is reported in its result, not raised. Every block is durable, or failed, on return.
        Room is made for all the new frames (and ``room_for`` bytes more: the caller's later
        writes of the same call) before the first is claimed (``_make_room_for_call``).
        ``spare``: blocks not to evict (``Tier.put_many``), for a promotion or its victims on
        their way down: one frame at a time, each making its own room. A ``SoftSpare`` (a
        server's body sparing its write's earlier bodies) is spared in the call's room
        instead, which the frames then find made (evicted last, it fails no frame)."""
        try:
            with self._open_call():
                if spare and not isinstance(spare, SoftSpare):
                    return [self._put_result(key, frame, spare) for key, frame in items]
                # A budget lowered for a full filesystem grows back before this call's room
                # is made: made against the old budget, it evicts what the filesystem has room for.
                self._refit_if_due()
                room = self._make_room_for_call(items, room_for, spare)
                results = self._put_group(items)
        except _Closed as exc:
            return [TierPutResult(stored=None, error=exc) for _ in items]
        if room and results:
            results[0].evicted[:0] = room
        return results

    def _make_room_for_call(self, items: list[tuple[bytes, BlockFrame]], room_for: int,
                            spare: Container[bytes] = ()) -> list[tuple[bytes, BlockFrame | None]]:
        """Evict for the charges of every new frame of a call and ``room_for`` bytes more, at
        once. Each frame evicting for itself as it came, a call's first frames were the next
        ones' victims once every older block had been read again (ARC's only once-used
        blocks: a server's batch, put in groups, answered "stored" for blocks already gone).
        A call that cannot fit whole leaves each frame to evict for itself, as does a victim
        that cannot be read (its error is the frame's own then, not the call's). ``spare``: a
        ``SoftSpare``, given up last (made for one frame too: its claim would not spare it)."""
        evicted: list[tuple[bytes, BlockFrame | None]] = []
        try:
            with self._lock:
                new = {key: self.charge(frame.meta.nbytes) for key, frame in items
                       if key not in self._index and key not in self._writing}
                need = sum(new.values()) + room_for
                if not new or len(new) == 1 and not room_for and not spare:
                    return evicted  # (one frame: its own claim makes the same room)
                if need > self.capacity_bytes or not self._fits_beside_pins(need):
                    return evicted
                self._shed_others(self._index.used_bytes + self._writing_bytes() + need)
                while self._index.used_bytes + self._writing_bytes() + need > self.capacity_bytes and \
                        self._index.evictable:
                    try:
                        if not self._evict_one(evicted, spare):
                            break  # (never, for a soft spare, while anything is evictable)
                    except _Unreadable:
                        break
        finally:
            self._settle_removals()
        return evicted

    def _put_group(self, items: list[tuple[bytes, BlockFrame]]) -> list[TierPutResult]:
        if not self.group_commit or len(items) < 2:
            return [self._put_result(key, frame) for key, frame in items]
        results: list[TierPutResult | None] = [None] * len(items)
        group: list[_Pending] = []
        held = 0  # bytes of ``group``, claimed but not yet committed
        waits: list[tuple[int, bytes, _InFlight]] = []
        claimed: _Pending | _InFlight | TierPutResult | None = None
        try:
            for i, (key, frame) in enumerate(items):
                evicted: list[tuple[bytes, BlockFrame | None]] = []
                claimed = None
                try:
                    claimed = self._claim(key, frame, evicted, held=held)
                    if claimed is None:
                        # Frames in flight cannot be evicted: what this batch holds must be
                        # committed (and so become evictable) before the rest can have room.
                        # (Kept in ``group`` until it returns: an interrupt as the commit began
                        # is then undone below, and ``_finish`` passes over what it finished.)
                        self._commit_part(group, results)
                        group, held = [], 0
                        claimed = self._claim(key, frame, evicted)
                        assert claimed is not None  # (None only where held > 0)
                except StorageError as exc:
                    results[i] = TierPutResult(stored=None, evicted=evicted, error=exc)
                    continue
                if isinstance(claimed, TierPutResult):
                    results[i] = claimed
                elif isinstance(claimed, _InFlight):
                    waits.append((i, key, claimed))  # being written by another thread, or earlier in this batch
                else:
                    claimed.index = i
                    group.append(claimed)
                    held += claimed.flight.nbytes
        except BaseException as exc:
            # A frame that could not even be claimed (no host bytes, an interrupt): the ones
            # claimed before it give their room back and wake their waiters, unwritten; so
            # does one claimed but not yet in the group (an interrupt between the two).
            if isinstance(claimed, _Pending) and all(p is not claimed for p in group):
                group.append(claimed)
            group = [p for p in group if not p.flight.done.is_set()]  # (those a commit finished: answered)
            for p in group:
                p.fail(self.name, exc)
            self._finish(group)
            raise
        self._commit_part(group, results)
        self._settle_removals()  # (none left marked while it waits on other threads: see ``_settle_removals``)
        for i, key, pending in waits:
            try:
                answer = self._await(key, pending)
            except StorageError as exc:
                results[i] = TierPutResult(stored=None, error=exc)
                continue
            results[i] = answer if answer is not None else self._put_result(key, items[i][1])
        return results  # type: ignore[return-value]

    def _commit_part(self, group: list[_Pending], results: list[TierPutResult | None]) -> None:
        """Commit ``group`` (a batch, or the part of one claimed so far) and answer for it.
        Writes the filesystem had no room for go again one by one, under a budget lowered
        to what it holds (``put``)."""
        if group:
            self._commit_group(group)
        if any(isinstance(p.error, _NoSpace) for p in group):
            self._refit(full=True)
        for p in group:
            stored: BlockFrame | None = p.frame
            if isinstance(p.error, _NoSpace):
                try:
                    p.error = None
                    # Present, where a put that waited on the first try stored it meanwhile:
                    # that put answered "stored", so this one must not.
                    stored = self._put_one(p.key, p.frame, p.evicted).stored
                except StorageError as exc:
                    p.error = exc
                    if isinstance(exc, _NoSpace):  # (its second try: the first is not counted)
                        self.count(write_errors=1)
            results[p.index] = TierPutResult(stored=stored, evicted=p.evicted) if p.error is None else \
                TierPutResult(stored=None, evicted=p.evicted, error=p.error)

    def _claim(self, key: bytes, frame: BlockFrame, evicted: list[tuple[bytes, BlockFrame | None]], *,
               held: int = 0) -> _Pending | _InFlight | TierPutResult | None:
        """Make room for one frame of a group (victims into ``evicted``) and mark its write in
        flight: a ``_Pending`` to write, the ``_InFlight`` write of it to wait for, or the
        answer already (present). None: still no room, and the caller's own frames not yet
        committed (``held`` bytes) are in the way."""
        segments = frame.wire_segments()  # seals the frame if it is not yet
        meta = frame.meta
        n = self.charge(meta.nbytes)
        if n > self.capacity_bytes:
            self.count(write_errors=1)
            raise self._too_large(meta.nbytes)
        data_path, side_path = self._paths(key)
        sidecar = _sidecar(key, meta)
        mine: _InFlight | None = None
        try:  # (marked inside it: see ``_put_one``)
            while True:
                answer: _Pending | _InFlight | TierPutResult | None = None
                removal: _Removal | None = None
                again = False
                try:
                    with self._lock:
                        if key in self._index and self._still_whole(key):
                            self._index.touch([key])
                            answer = TierPutResult(stored=None)
                        elif (removal := self._removing.get(key)) is not None:
                            pass  # (see ``_put_one``)
                        elif (pending := self._writing.get(key)) is not None:
                            answer = pending
                        else:
                            self._refuse_beside_pins(key, n)
                            self._forget_other(key)  # (its files are about to be written over)
                            if self._made_room(n, evicted):
                                again = True  # (the room taken once the victims are gone: see ``_put_one``)
                            elif held and self._index.used_bytes + self._writing_bytes() + n > self.capacity_bytes:
                                answer = None
                            else:
                                mine = self._writing[key] = self._hold_room(key, n)
                                answer = _Pending(key, frame, segments, sidecar, data_path, side_path, mine, evicted)
                finally:
                    self._settle_removals()
                if removal is not None:
                    removal.done.wait()
                elif not again:
                    return answer
        except BaseException as exc:
            if mine is not None:  # (nothing written yet: no file to remove)
                self._undo_write(key, mine, n, (), _write_error(self.name, data_path, exc))
            raise

    def _commit_group(self, group: list[_Pending]) -> None:
        """Write and commit ``group`` stage by stage (data, sidecars, directories), then index
        what was committed; every pending write ends here, committed or failed."""
        try:
            # Written first, all of them (page cache speed), then fsynced together: the device
            # sees the whole batch at once rather than one file's flush at a time.
            alive = self._stage(group, lambda p: self._write_temp(p.data_path, p.segments, sync=False), "data_tmp",
                                threads=False)
            if self.fsync:
                alive = self._stage(alive, lambda p: _fsync_file(p.data_tmp), None)
            alive = self._stage(alive, lambda p: os.replace(p.data_tmp, p.data_path), None, threads=False)
            alive = self._stage(alive, lambda p: self._write_temp(p.side_path, [p.sidecar], sync=False), "side_tmp",
                                threads=False)
            if self.fsync:
                alive = self._stage(alive, lambda p: _fsync_file(p.side_tmp), None)
            alive = self._stage(alive, lambda p: os.replace(p.side_tmp, p.side_path), None, threads=False)
            if self.fsync:
                shards: dict[Path, list[_Pending]] = {}
                for p in alive:
                    shards.setdefault(p.data_path.parent, []).append(p)
                failed = dict(zip(shards, self._writers.map(_try_fsync_dir, shards)))
                for shard, error in failed.items():
                    if error is not None:
                        for p in shards[shard]:
                            p.fail(self.name, error)
                self._group["dir_fsyncs"] += len(shards)
        except BaseException as exc:  # an interrupt: nothing of this group may be left half done
            for p in group:
                if p.error is None:
                    p.fail(self.name, exc)
            self._finish(group)
            raise
        self._finish(group)

    def _stage(self, group: list[_Pending], op, attr: str | None, *, threads: bool = True) -> list[_Pending]:
        """Run ``op`` on every pending write (several at once in threads, or in order); keep
        the result in ``attr``; a failure fails that write alone. The survivors, in order."""
        if not group:
            return group
        outcomes = self._writers.map(_attempt, [op] * len(group), group) if threads else \
            [_attempt(op, p) for p in group]
        alive = []
        for p, (value, error) in zip(group, outcomes):
            if error is not None:
                p.fail(self.name, error)
                continue
            if attr is not None:
                setattr(p, attr, value)
            alive.append(p)
        return alive

    def _write_temp(self, final: Path, segments: list, *, sync: bool = True) -> Path:
        """``segments`` into a new temp file beside ``final`` (fsynced, with ``sync`` and
        ``fsync``); its path."""
        tmp = final.parent / f".tmp-{final.name}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileNotFoundError:  # its shard removed behind the tier's back (all are made at open)
            # (a shard gone is the directory emptied by hand, ``_shards_changed``; or the whole
            # directory gone: a shard made now would be in another's)
            if self.lost() is not None:
                raise self._lost_error() from None
            self._shard_dir(final.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                for seg in segments:
                    view = memoryview(seg).cast("B")
                    while view.nbytes:  # raw writes may be short
                        view = view[f.write(view):]
                if sync and self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)
            raise
        return tmp

    def _finish(self, group: list[_Pending]) -> None:
        """Index the committed writes, undo the failed ones, and wake whoever waits on them."""
        refused: list[_Pending] = []
        settled: set[int] = set()  # (ids of the writes no longer in flight here)
        released: set[int] = set()  # (ids of those whose room is given back)
        try:
            for p in group:
                if p.error is not None:
                    for path in (p.side_path, p.side_tmp, p.data_path, p.data_tmp):  # commit record first
                        if path is not None:
                            _unlink(path)
            try:
                with self._lock:
                    committed = 0
                    for p in group:
                        if p.error is None and (error := self._refused_at_commit(p.key, p.flight.nbytes)) is not None:
                            p.error = error
                            refused.append(p)  # still in flight until its files are gone
                            continue
                        del self._writing[p.key]
                        self._release(p.flight, p.flight.nbytes)
                        released.add(id(p))
                        if p.error is not None:
                            settled.add(id(p))
                            self._write_failed(p.error)  # (one without room goes again: counted if it fails again)
                            continue
                        meta = p.frame.meta
                        self._index.add(p.key, BlockInfo(meta.nbytes, meta.raw_nbytes, meta.parent_hash, meta.position,
                                                         p.flight.nbytes))
                        settled.add(id(p))  # (after it is indexed: one interrupted before is answered failed)
                        self._stats.bytes_in += meta.nbytes
                        self._stats.admissions += 1
                        committed += 1
                        last = p
                    if committed:
                        self._writable_again()
                        self._trim(last.evicted)
                    self._group["batches"] += 1
                    self._group["frames"] += committed
                    self._sync_counts()
            finally:
                self._settle_removals()
            for p in refused:
                assert p.error is not None  # (refused: set at the commit, above)
                self._undo_write(p.key, p.flight, p.flight.nbytes, (p.side_path, p.data_path), p.error, renamed=True)
                settled.add(id(p))
        except BaseException as exc:
            # (an interrupt half way: the writes not reached are undone as failed, else they
            # stayed in flight for good, and the next put of one, and close, waited for ever)
            for p in group:
                if id(p) in settled:
                    continue
                p.error = p.error or _write_error(self.name, p.data_path, exc)
                with self._lock:
                    ours = self._writing.get(p.key) is p.flight
                    if not ours and id(p) not in released:  # (out of flight, its room not yet given back)
                        self._release(p.flight, p.flight.nbytes)
                # (one out of flight keeps its files: another write of the block may own those
                # paths now; whole and committed, a restart's scan indexes them)
                if ours:
                    self._undo_write(p.key, p.flight, p.flight.nbytes, (p.side_path, p.data_path), p.error)
            raise
        finally:
            for p in group:
                p.flight.error = p.error
                p.flight.done.set()

    def _await(self, key: bytes, pending: _InFlight) -> TierPutResult | None:
        """Wait for another thread's write of ``key`` and answer as it ended: present once
        committed, its error if it failed. None: it found the filesystem full, and goes
        again (``_put_result``, ``_commit_part``); the caller puts the block again too, and
        so finds it present once that try commits it, waits for it, or writes it itself.
        Answered "failed" then, a block its writer's second try stored would be on disk
        while the client was told it is not."""
        pending.done.wait()
        if isinstance(pending.error, _NoSpace):
            return None
        if pending.error is not None:
            raise StorageError(f"{pending.error} (a concurrent write of this block)")
        with self._lock:
            self._index.touch([key])
        return TierPutResult(stored=None)

    def _write_atomic(self, final: Path, segments: list) -> None:
        tmp = self._write_temp(final, segments)
        try:
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockFrame | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[bytes]) -> list[BlockFrame | None]:
        """Every frame read at once (``READ_DEPTH`` in flight), each verified as it lands."""
        return list(self.stream(keys, leased=False))

    def stream(self, keys: list[bytes], *, leased: bool = True) -> ClosingIterator[BlockFrame | None]:
        """The frames of ``keys`` in order (None for each miss), each handed out as soon as it
        and the ones before it have landed and been verified; the reads of all of them start
        now. ``leased``: frames lie in pooled buffers (page-locked where the tier was made
        with ``pin``), each with a ``lease`` the caller releases once done with its bytes;
        else each frame owns its buffer. A consumer that stops early should ``close()`` the
        iterator: reads not handed out are then cancelled or given back."""
        self._check_root_if_due()  # (given up: its index is empty, every key a miss)
        with self._calls_lock:  # (else the closed read pool's "cannot schedule new futures after shutdown")
            if self._closed:
                raise self._closed_error()
        with self._lock:
            infos = [self._index.get(k) for k in keys]
        items = [(self._paths(k)[0], info.nbytes, (k, info)) for k, info in zip(keys, infos) if info is not None]
        reads = self._reads.read_many(items, _check_frame, self._stream_buffers if leased else None)
        return _Stream(self._hand_out(keys, infos, reads, leased), reads)

    def _hand_out(self, keys: list[bytes], infos: list[BlockInfo | None], reads, leased: bool
                  ) -> Generator[BlockFrame | None, None, None]:
        hits = misses = nbytes = 0
        try:
            with reads:
                for key, info in zip(keys, infos):
                    if info is None:
                        misses += 1
                        yield None
                        continue
                    done = next(reads)
                    frame = self._landed(key, info, done, leased)
                    if frame is None:
                        misses += 1
                    else:
                        hits += 1
                        nbytes += info.nbytes
                    yield frame
        finally:
            with self._lock:
                self._stats.hits += hits
                self._stats.misses += misses
                self._stats.bytes_out += nbytes
                if hits:  # wall time of the reads, in flight together: what the device gave
                    self._stats.read_seconds += reads.last_landed - reads.started

    def _landed(self, key: bytes, info: BlockInfo, done: ReadDone | ReadFailed, leased: bool
                ) -> BlockFrame | None:
        """A read's frame, or None: its files dropped and counted when they are bad (corrupt,
        cut short, the data file gone while its sidecar stayed, or the device failing them:
        an I/O error, ``ReadFailed.io_error``); kept, and the read counted, when the read
        itself could not be made for want of a descriptor or memory: a moment's shortage
        must not delete acknowledged blocks. A block kept after an I/O error was advertised
        by every lookup and cut every prefix read at it, and a put of it answered "present"
        without writing it again: nothing but an eviction ended that."""
        if isinstance(done, ReadFailed) and isinstance(done.cause, FrameVersionError):
            with self._lock:
                self._stats.foreign_version += 1
                aside = self._set_aside(key, info)
                self._sync_counts()
            if aside:
                log.warning("%s tier: block %s was written by another format version (%s): not read, its files "
                            "kept (counted in the budget, the first evicted)", self.name, key.hex(), done)
            return None
        if isinstance(done, ReadFailed):
            bad = done.damaged or done.io_error
            if bad and self.lost() is not None:
                return None  # (the whole directory gone or replaced: not this block's damage)
            if done.io_error:
                with self._lock:
                    self._stats.read_errors += 1
            if bad:
                dropped = False
                try:
                    with self._open_call(), self._lock:  # (closed: the files are the next opener's to judge)
                        if dropped := self._drop_if_unchanged(key, info):
                            self._stats.corrupt += 1
                            self._sync_counts()
                except _Closed:
                    pass
                if dropped:
                    log.warning("%s tier: block %s is damaged on disk (%s): not served, its files removed%s", self.name,
                                key.hex(), done, " (the device failed its read: written again by the next put of it)"
                                if done.io_error else "")
            else:
                with self._lock:
                    self._stats.read_errors += 1
                log.warning("%s tier: reading block %s failed (%s); the block is kept", self.name, key.hex(), done)
            return None
        lease = done.lease
        if not leased and lease is not None:
            lease.release()  # a pool that keeps nothing: the frame's view owns the buffer now
            lease = None
        return BlockFrame(done.checked, host=done.view, sealed=True, lease=lease)

    def _read_frame(self, key: bytes, expected: int | None = None) -> BlockFrame:
        """Read and verify one frame (a victim handed down); ``ReadFailed`` says why not."""
        info = self._index.get(key)
        if expected is None:
            expected = info.nbytes if info is not None else None
        done = self._reads.submit(self._paths(key)[0], expected, _check_frame, (key, info)).result()
        if done.lease is not None:
            done.lease.release()
        return BlockFrame(done.checked, host=done.view, sealed=True)

    def _drop_if_unchanged(self, key: bytes, info: BlockInfo) -> bool:
        """Drop ``key``'s files and entry after a failed read, only if the index still holds
        the entry (``info``, the very object) that was read. Under the lock.

        Any other answer means the block was evicted or deleted since it was looked up, so the
        failure (often a file not found) says nothing about what is there now: perhaps the
        block written again and acknowledged, which must not be removed. The same entry, on
        the other hand, means nothing of this tier touched the files meanwhile (an entry
        leaves the index before its files go, under this lock, and no write of the block
        begins until they are gone; a block in the index is never being written), so the
        failure is the files' own: damage, or a data file lost while its sidecar stayed.
        Its files are unlinked once the lock is let go (``_settle_removals``), held for no
        other writer's room meanwhile: they made room for none."""
        if self._index.get(key) is not info:
            return False
        self._doom(key, info.charge, counted=False)
        self._index.remove(key)
        return True

    def _files_whole(self, key: bytes, info: BlockInfo) -> str | None:
        """None if ``key``'s files are there, the data file of its size; else what was
        found ("gone", "cut short"). Same-size damage is left to the checksum on read; an
        I/O error says nothing of the files (a read judges them, as it does)."""
        hexkey = key.hex()
        base = f"{self._root_str}/{hexkey[:2]}/{hexkey}"  # (not ``_paths``: Path objects cost more than the stats)
        try:
            data, side = os.stat(base + ".frame"), os.stat(base + ".meta")
            if not (stat.S_ISREG(data.st_mode) and stat.S_ISREG(side.st_mode)):
                return "gone"  # (a directory in a file's place: a restart takes nothing of it)
            if data.st_size == info.nbytes and side.st_size > 0:
                return None
            return "cut short"
        except (FileNotFoundError, NotADirectoryError):
            return "gone"
        except OSError:
            return None

    def _dropped_for_files(self, key: bytes, info: BlockInfo, found: str) -> bool:
        """Drop a held block whose files went behind the tier's back (``_files_whole``):
        answered "present" (a put's acknowledgement) with nothing on disk, every put of it
        was acknowledged while a restart, and every read, found nothing. Under the lock."""
        if not self._drop_if_unchanged(key, info):
            return False
        self._stats.corrupt += 1
        self._sync_counts()
        log.warning("%s tier: block %s was asked for as stored, but its files were %s behind the tier's back: "
                    "dropped, to be written again", self.name, key.hex(), found)
        return True

    def _still_whole(self, key: bytes) -> bool:
        """A put's check of a held block before it answers "present". Under the lock (a
        held block is never being written: its files cannot change here meanwhile)."""
        info = self._index.get(key)
        assert info is not None  # (held: indexed, under the lock)
        found = self._files_whole(key, info)
        return found is None or not self._dropped_for_files(key, info, found)

    def present_many(self, keys: list[bytes]) -> list[bool]:
        """``contains_many``, each held block's files looked at (two stats, outside the lock:
        a long chain's lookup must not hold it)."""
        with self._lock:
            infos = [self._index.get(k) for k in keys]
        out = []
        for key, info in zip(keys, infos):
            found = self._files_whole(key, info) if info is not None else "gone"
            if info is not None and found == "gone" and self.lost() is not None:
                out.append(False)  # (the directory emptied by hand: forgotten whole, not this block's damage)
                continue
            if info is not None and found is not None:
                try:
                    with self._open_call(), self._lock:  # (closed: the files are the next opener's to judge)
                        self._dropped_for_files(key, info, found)
                except _Closed:
                    pass
            out.append(found is None)
        return out

    def delete(self, key: bytes) -> bool:
        """Durable on return: the shard directory is fsynced after the unlinks (once for a
        whole ``batched_deletes``), else a power cut could bring the block back
        (``StorageError`` if it cannot be). A block not held here syncs its shard too when
        unlinks there are not yet durable: it may be one evicted (handed down, not synced)
        that would come back the same way; best effort, logged (evictions are), so a delete
        of a key the tier does not hold answers False and never raises (the library's own
        clean-ups delete blocks only a faster tier holds), unless it retries a delete of
        this key that removed its files but could not sync them. A tier that gave its
        directory up (``lost``) holds nothing: False."""
        self._check_root_if_due()
        if self._lost is not None:
            return False
        with self._open_call():
            while True:
                with self._lock:
                    # An eviction of it still unlinking: waited for, its unlinks are then counted,
                    # and so synced. Looked at under the lock: one that began after an earlier look
                    # (the block out of the index, its files still there) was not synced.
                    if (removal := self._removing.get(key)) is None:
                        held = self._index.get(key) is not None
                        deleted = held or key in self._others  # (another release's copy of the block: it goes too)
                        if deleted:
                            # Files first, the entry after: a delete that could not remove them
                            # raises with the block still held, as it is on disk (answered deleted,
                            # a restart brought it back: a tenant's delete undone).
                            self._remove_files(key)
                            if held:
                                self._index.remove(key)
                            else:
                                self._forget_other(key)
                            self._sync_counts()
                            if self.fsync:
                                self._deleted_unsynced[key[0]][key] = self._unlinks[key[0]]
                        owed = {key[0]: self._unlinks[key[0]]}
                        strict = key in self._deleted_unsynced[key[0]]  # (this delete's, or a failed one's)
                if removal is None:
                    break
                removal.done.wait()
            if strict:
                self._sync_unlinks(owed, strict=True)
            else:
                self._sync_unlinks(owed, batched=False)  # (other blocks' evictions: best effort)
        return deleted

    @contextmanager
    def batched_deletes(self) -> Iterator[None]:
        if getattr(self._batch, "owed", None) is not None:  # nested: the outer one syncs
            yield
            return
        self._batch.owed = {}
        done = False
        try:
            yield
            done = True
        finally:
            owed, self._batch.owed = self._batch.owed, None
            try:
                self._sync_unlinks(owed, strict=True)
            except StorageError as exc:
                if done:
                    raise
                # (the error in flight is the caller's answer; this one must not replace it)
                log.warning("%s", exc)

    def _sync_unlinks(self, owed: dict[int, int], *, strict: bool = False, batched: bool = True) -> None:
        """Make the unlinks counted in ``owed`` (shard: unlinks) durable: one fsync per shard
        not synced that far, or owed to the ``batched_deletes`` this thread is in. A shard
        that cannot be synced: ``strict`` (a delete), ``StorageError`` once every shard was
        tried, since a delete answered done must not come back after a power cut; else (a
        failed write's files removed) logged. Either way the shard stays owed, so the next
        delete there, or a retry of this one (the block no longer held), syncs it again.
        ``batched=False``: now, even inside a ``batched_deletes`` (whose sync is strict)."""
        if not self.fsync:
            return
        batch = getattr(self._batch, "owed", None) if batched else None
        if batch is not None:
            for shard, n in owed.items():
                batch[shard] = max(batch.get(shard, 0), n)
            return
        failed: list[str] = []
        for shard, n in owed.items():
            if self._synced[shard] >= n:
                continue  # (none owed, or another thread's fsync covered them)
            path = self.root / f"{shard:02x}"
            try:
                fsync_dir(path)
            except OSError as exc:
                log.warning("%s tier: cannot fsync %s after deleting from it: %s", self.name, path, exc)
                failed.append(f"shard {path.name}: {exc.strerror or exc}")  # (no path: see ``_remove_files``)
                continue
            with self._lock:
                self._synced[shard] = max(self._synced[shard], n)
                if pending := self._deleted_unsynced[shard]:
                    for done in [k for k, at in pending.items() if at <= n]:
                        del pending[done]
        if failed and strict:
            raise StorageError(f"{self.name} tier: a delete removed its files, but the directory could not be synced "
                               f"({'; '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}): not durable, a power cut "
                               "may bring the blocks back; retry the delete")

    def _remove_files(self, key: bytes) -> None:
        """A delete's unlinks, under the lock (synced by ``delete``). A sidecar that cannot be
        removed (a read-only or failing filesystem, EPERM) raises ``StorageError``, nothing
        removed, so the caller keeps the block held: it is still whole on disk, and a restart
        would serve it again. Once the sidecar (the commit record) is gone the block is,
        whatever befalls its data file (an orphan a restart removes).

        Evictions, and the removal of a damaged block, unlink outside the lock instead
        (``_doom``, ``_settle_removals``), best effort and not synced: they must finish (a
        write waits on their room), and what they leave is a whole block a restart takes
        back (recovery drops a half of one), or damage a read drops again."""
        data_path, side_path = self._paths(key)
        try:
            side_path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            # (no path: the reason reaches clients, a tenant's too; the log names it)
            log.warning("%s tier: cannot remove %s: %s", self.name, side_path, exc)
            error = StorageError(f"{self.name} tier: cannot delete block {key.hex()}: removing its sidecar failed: "
                                 f"{exc.strerror or exc}; the block is kept")
            if exc.errno == errno.EROFS and self._read_only is None:
                self._went_read_only(str(error), side_path.parent)
            raise error from None
        _unlink(data_path)
        self._unlinks[key[0]] += 1

    def _extra(self) -> dict:
        out = {"path": str(self.root), "requested_bytes": self.requested_bytes, "frame_bytes": self._index.frame_bytes,
               "alloc_unit": self.alloc_unit, "lost": self._lost, "read_only": self._read_only, **self._recovery, "other_version_blocks": len(self._others),
               "other_version_bytes": self._others_bytes, "other_version_evicted": self._others_evicted,
               "group_commit": self.group_commit, "group_commits": dict(self._group)}
        if hasattr(self, "_reads"):  # (not yet while recovering)
            out |= {**self._reads.stats(), "stream_buffers": self._stream_buffers.stats()}
        return out

    def check(self, *, fix: bool = False) -> dict[str, int]:
        """Post-mortem: read and verify every frame. With ``fix``, drop the bad ones (corrupt,
        or the data file missing); a frame that could not be read (``unreadable``: no
        descriptor or memory left, an I/O error) is kept, and so is one of another format
        version (``other_version``: with ``fix``, out of the index, its files charged).

        Each block is checked inside a call ``close`` waits for: closed meanwhile, the check
        ends after the block in hand with ``_Closed`` (a report of part of the tier would
        read as all of it), and never touches the files once the directory is another
        owner's (its fix removed a block the next owner had written again)."""
        report = {"ok": 0, "corrupt": 0, "unreadable": 0, "other_version": 0}
        with self._open_call():
            keys = self.keys()
        for key in keys:
            with self._open_call():
                self._check_one(key, fix, report)
        return report

    def _check_one(self, key: bytes, fix: bool, report: dict[str, int]) -> None:
        info = self.info(key)
        if info is None:
            return  # evicted or deleted since the listing
        data_path, _ = self._paths(key)
        try:
            st = data_path.stat()
            if not stat.S_ISREG(st.st_mode):  # (a named pipe's read waits for a writer)
                raise FrameError("not a regular file")
            if self.max_frame_bytes is not None and st.st_size > self.max_frame_bytes:
                raise FrameError("larger than any frame read here")
            meta = parse_frame(data_path.read_bytes(), verify=True)
            ok = meta.block_hash == key
            if ok:
                _check_sidecar_agrees(meta, info)
        except FrameVersionError:  # another release's: no damage; with ``fix``, set aside as a read does
            if fix:
                with self._lock:
                    self._set_aside(key, info)
                    self._sync_counts()
            report["other_version"] += 1
            return
        except (FileNotFoundError, FrameError):
            ok = False
        except (OSError, MemoryError):
            report["unreadable"] += 1
            return
        if not ok:
            with self._lock:
                if self._index.get(key) is not info:
                    return  # evicted or deleted while it was read: not damage
                if fix:
                    self._drop_if_unchanged(key, info)
                    self._sync_counts()
        report["ok" if ok else "corrupt"] += 1


def _oldest_first(found: list[tuple[float, bytes, BlockInfo]]) -> list[tuple[bytes, BlockInfo]]:
    """Recovered blocks in the order to index them, least recently used first: by the
    sidecars' times, but a block no older than anything below it in its chain and, at a
    tie, deeper blocks first, as ``touch_chain`` leaves a chain. In mtime order alone a
    chain's head (written first) is its oldest block: every eviction after a restart would
    walk the whole chain down to its tail, quadratic in its length."""
    times = {key: mtime for mtime, key, _ in found}
    for _, key, info in sorted(found, key=lambda e: -e[2].position):
        if info.position and info.parent in times and times[info.parent] < times[key]:
            times[info.parent] = times[key]
    order = sorted(found, key=lambda e: (times[e[1]], -e[2].position))
    return [(key, info) for _, key, info in order]


def _check_frame(view: memoryview, context: tuple[bytes, BlockInfo | None]) -> FrameMeta:
    """Parse and verify a frame read from disk (in the thread that read it), and check it
    against what its sidecar told the index (``info``)."""
    key, info = context
    meta = parse_frame(view, verify=True)
    if meta.block_hash != key:
        raise FrameError("frame header names another block")
    if info is not None:
        _check_sidecar_agrees(meta, info)
    return meta


def _check_sidecar_agrees(meta: FrameMeta, info: BlockInfo) -> None:
    """No checksum covers a sidecar: one damaged into another well-formed map was indexed as
    it read (a parent or position that sent chain walks, deletes and pins elsewhere, raw
    bytes that made the stats' compression ratio absurd). Its frame, checksummed, says."""
    if (meta.parent_hash, meta.position, meta.raw_nbytes) != (info.parent, info.position, info.raw_nbytes):
        raise FrameError("the sidecar disagrees with its frame (parent, position or raw size)")


# Lock descriptors this process holds. A child made by fork() shares their open file
# descriptions, and so the locks: the owner's kill -9 would leave the directory locked
# while any child lived. The child closes its copies at once (it must not use the tier).
_held_locks: set[int] = set()
# Held from a lock file's open until its descriptor is in ``_held_locks`` (and from its
# removal there until it is closed); a fork, in whatever thread, waits for it. Else a
# child forked in between kept a copy its at-fork hook did not know of, and with it the
# flock for its whole life.
_held_locks_change = threading.RLock()  # (re-entrant: a tier collected, its finalizer run, while a lock is taken)


def _drop_locks_in_child() -> None:
    for fd in _held_locks:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_locks.clear()
    _held_locks_change.release()  # (taken by the fork's ``before`` hook, in the thread that forked)


os.register_at_fork(before=_held_locks_change.acquire, after_in_parent=_held_locks_change.release,
                    after_in_child=_drop_locks_in_child)


def _dir_id(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _held_here(fd: int) -> bool:
    """Whether this process holds the lock on the file ``fd`` opened (another of its tiers: a
    pid in the file says less, another container's server may have the same one). Under
    ``_held_locks_change``."""
    mine = os.fstat(fd)
    for held in _held_locks:
        try:
            st = os.fstat(held)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return True
    return False


def _unlock_directory(fd: int) -> None:
    """Close a lock's descriptor, once, and only in the process that took it (a forked
    child's copy was closed at the fork, and its number may name another file since)."""
    with _held_locks_change:
        if fd in _held_locks:
            _held_locks.discard(fd)
            os.close(fd)


def _lock_directory(root: Path) -> int:
    """An exclusive ``flock`` on ``root/.lock``, with this process's pid written in it; the
    descriptor holds the lock until it is closed. Raises ``DiskInUse`` naming the holder."""
    path = root / LOCK_NAME
    with _held_locks_change:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            raise StorageError(f"disk tier: cannot open the lock file {path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                here = _held_here(fd)
            finally:
                os.close(fd)
            if here:  # (said as another process's, it named this one's pid)
                raise DiskInUse(f"disk_path: {root} is in use by another cache (or tier) in this process, open on it "
                                "now: one owns a disk tier's directory; close() that one first, or give each its "
                                "own") from None
            raise DiskInUse(f"disk_path: {root} is in use by another process (pid {holder}, holding {path}); "
                            "one process owns a disk tier's directory: give each server or cache its own") from None
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"disk tier: cannot lock {path}: {exc}") from None
        _held_locks.add(fd)
    # Written over the last holder's pid, then cut to length: truncating first gave back the
    # file's block, which a full filesystem may not give again.
    pid = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    except OSError as exc:  # (a full or read-only filesystem: said as the directory's, not as "tiers")
        _unlock_directory(fd)
        raise StorageError(f"disk tier: cannot write the lock file {path}: {exc.strerror or exc}") from None
    return fd


def block_charge(nbytes: int, unit: int) -> int:
    """What a block of an ``nbytes`` frame takes on a filesystem allocating ``unit`` bytes at
    a time: the frame and its sidecar (under 200 bytes), each rounded up to whole units."""
    return round_up(nbytes, unit) + unit


def allocation_unit(root: Path) -> int:
    """The unit ``root``'s filesystem allocates file space in (``ALLOC_UNIT_RANGE``)."""
    try:
        unit = os.statvfs(root).f_frsize
    except OSError:
        return DEFAULT_ALLOC_UNIT
    low, high = ALLOC_UNIT_RANGE
    if low <= unit <= high and unit & (unit - 1) == 0:
        return unit
    log.warning("disk tier at %s: its filesystem reports an allocation unit of %d bytes; blocks are charged in "
                "units of %d", root, unit, DEFAULT_ALLOC_UNIT)
    return DEFAULT_ALLOC_UNIT


def _unlink(path: Path) -> None:
    """Remove a file of the tier's; one that cannot be removed is logged, not raised: the
    callers are undoing or cleaning, and must finish (a write left marked in flight for
    good would hang every later put of its block)."""
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        log.warning("disk tier: cannot remove %s: %s", path, exc)



class _Stream:
    """A disk stream: its frames, and ``close()`` that gives back the reads not handed out
    even when none was asked for (a generator closed before it started runs no ``finally``,
    and the reads begin when the stream is made)."""

    __slots__ = ("_frames", "_reads")

    def __init__(self, frames: Generator[BlockFrame | None, None, None], reads: ReadStream) -> None:
        self._frames, self._reads = frames, reads

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> BlockFrame | None:
        return next(self._frames)

    def close(self) -> None:
        self._frames.close()
        self._reads.close()  # idempotent: done already where the frames' own ``with`` ran


def fsync_dir(path: Path) -> None:
    """Make the entries made, renamed or removed in the directory ``path`` durable (the
    server's state files use it too)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
