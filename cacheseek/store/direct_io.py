"""Whole files read at the device's speed: many reads in flight, O_DIRECT into aligned buffers.

The disk tier keeps one frame per file. A cold read of a chain is many whole-file reads;
one at a time through the page cache they reach a third of what the device gives. Here:

- ``probe_read_path(folder)`` finds out once which path the folder's filesystem allows:
  ``"o_direct"`` (O_DIRECT accepted and enforced: an unaligned read is refused, so reads
  bypass the page cache), ``"o_direct-unenforced"`` (O_DIRECT accepted but an unaligned read
  works too: the flag is ignored or emulated, as under gVisor, and the page cache may
  serve), or ``"buffered"`` (O_DIRECT refused, as on tmpfs). What ran is in the tier's
  stats, never guessed.
- O_DIRECT needs offsets, lengths and buffers aligned to the device's logical block; 4 KiB
  covers every device here. A frame file is read whole, its length rounded up to 4 KiB,
  into a 4 KiB-aligned buffer (the read ends at the end of the file).
- ``ReadPool`` runs ``depth`` reads at once in threads (``os.preadv`` releases the GIL), so
  the device's queue stays full; each read's ``check`` (the frame's checksum) runs in the
  thread that read it, on the buffer as it lands, while the other reads go on.
- ``BufferPool`` lends aligned buffers, page-locked when a GPU will copy out of them
  (``pin=True``: a pinned torch allocation, imported only then), so the copy to the device
  runs as DMA from the buffer the disk wrote. Each buffer is lent with a lease, released
  exactly once by its holder; until then the pool never reuses it.

Torch-free unless a pool pins.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..descriptors import note_if_exhausted
from ..errors import StorageError
from .lease import Lease, LeaseLedger

# A pool's pieces (``BufferPool(pieces_up_to=)``): cut from slabs of this size, at this alignment.
SLAB_BYTES = 4 << 20
PIECE_ALIGN = 64
DIRECT_ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (a page; >= any logical block here)
O_DIRECT = getattr(os, "O_DIRECT", 0)
READ_PATHS = ("o_direct", "o_direct-unenforced", "buffered")
PROBE_NAME = ".probe-direct-io"
# Read-buffer bytes one ``ReadStream`` keeps in flight (read or being read, not yet handed
# out), besides its count (twice the pool's depth). A count alone let a stream of 1 GiB frames
# hold 32 GiB while its consumer worked. 256 MiB still keeps seven of a Llama-3-8B raw block's
# 34 MB reads in flight; a larger frame streams one at a time, read while the consumer works
# on the one before.
READ_STREAM_BYTES = 256 << 20

log = logging.getLogger("cacheseek.store.direct_io")


def round_up(n: int, align: int = DIRECT_ALIGN) -> int:
    return (n + align - 1) // align * align


# -- which path the filesystem allows ------------------------------------------------------


def probe_read_path(folder: str | os.PathLike) -> str:
    """``"o_direct"``, ``"o_direct-unenforced"`` or ``"buffered"`` for files in ``folder``
    (see the module's docstring): a probe file is written, read back aligned and unaligned
    with O_DIRECT, and removed."""
    if not O_DIRECT:
        return "buffered"
    path = Path(folder) / f"{PROBE_NAME}-{os.getpid()}-{threading.get_ident()}"
    try:
        try:
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(b"\x5a" * (2 * DIRECT_ALIGN))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            # (a filesystem full at start, or read-only): the reads go buffered for the
            # tier's life, and its stats could not tell this from a filesystem refusing O_DIRECT.
            log.warning("%s: could not write its probe file (%s): reads go through the page cache (read_path "
                        "\"buffered\") until the tier is opened again", folder, exc)
            return "buffered"
        try:
            fd = os.open(path, os.O_RDONLY | O_DIRECT)
        except OSError:
            return "buffered"  # tmpfs and some network filesystems refuse the flag itself
        try:
            buf = AlignedBuffer(2 * DIRECT_ALIGN)
            try:
                if os.preadv(fd, [buf.view(DIRECT_ALIGN)], 0) != DIRECT_ALIGN:
                    return "buffered"
            except OSError:
                return "buffered"
            try:
                # One byte into an aligned buffer, from an unaligned offset: a filesystem that
                # really bypasses the page cache refuses it (EINVAL).
                os.preadv(fd, [buf.view(DIRECT_ALIGN + 1)[1:]], 1)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    return "o_direct"
                return "buffered"
            return "o_direct-unenforced"
        finally:
            os.close(fd)
    except OSError:
        return "buffered"
    finally:
        try:
            path.unlink()
        except OSError:
            pass


# -- aligned (and maybe pinned) buffers ----------------------------------------------------


class AlignedBuffer:
    """``nbytes`` (rounded up to 4 KiB) of page-aligned host memory: an anonymous mmap, or a
    slice of a pinned torch allocation (``pin=True`` with CUDA present)."""

    __slots__ = ("nbytes", "pinned", "_mem", "_keep", "_base")

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self.pinned = False
        self._keep: Any = None
        self._mem: Any = None
        if pin:
            self._pin()
        if self._mem is None:
            self._mem = mmap.mmap(-1, self.nbytes)  # page-aligned by construction
            self._base = ctypes.addressof(ctypes.c_ubyte.from_buffer(self._mem))

    def _pin(self) -> None:
        if not _cuda_present():
            return
        import torch

        try:
            keep = torch.empty(self.nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            # Page-locked memory refused (the host's limit, a driver error): the read still
            # lands, in pageable memory, and its copy to the device is slower. Raised, it
            # failed the read with a RuntimeError no caller expects (a 500 in the server).
            _warn_unpinned(exc)
            return
        skip = -keep.data_ptr() % DIRECT_ALIGN
        self._keep = keep[skip : skip + self.nbytes]
        self._base = self._keep.data_ptr()
        self._mem = (ctypes.c_ubyte * self.nbytes).from_address(self._base)
        self._mem._owner = keep  # every view of the buffer keeps the pinned allocation alive
        self.pinned = True

    def view(self, nbytes: int | None = None) -> memoryview:
        return memoryview(self._mem).cast("B")[: self.nbytes if nbytes is None else nbytes]

    @property
    def address(self) -> int:
        return self._base


class _Piece:
    """``nbytes`` of a slab (an ``AlignedBuffer``) from ``offset``: a buffer of its own to the
    pool and its holders, with the slab's pinning; the slab stays mapped while any piece does."""

    __slots__ = ("nbytes", "pinned", "_slab", "_offset")

    def __init__(self, slab: AlignedBuffer, offset: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.pinned = slab.pinned
        self._slab = slab
        self._offset = offset

    def view(self, nbytes: int | None = None) -> memoryview:
        end = self._offset + (self.nbytes if nbytes is None else nbytes)
        return self._slab.view()[self._offset : end]

    @property
    def address(self) -> int:
        return self._slab.address + self._offset


class BufferLease(Lease):
    """One pool buffer lent to a reader (a ``store.lease.Lease``): ``release()`` gives it
    back to the pool, exactly once."""

    __slots__ = ("buffer",)

    def __init__(self, pool: BufferPool, buffer: AlignedBuffer | _Piece) -> None:
        super().__init__(pool, buffer.nbytes, buffer)
        self.buffer = buffer


class BufferPool:
    """Aligned buffers lent and given back, kept for reuse up to ``keep_bytes`` in all (a
    pinned buffer costs a page-locking to make, so a materialize reuses the last one's).
    ``pieces_up_to``: a buffer of at most that many bytes is a piece of a ``SLAB_BYTES`` slab,
    64-byte aligned, not a mapping of its own (0: none are; the disk tier's ``O_DIRECT``
    reads need whole pages): a read of a chain of 70,000 small frames held a mapping
    each, past the kernel's ``vm.max_map_count`` (65,530), and mmap failed with ENOMEM."""

    def __init__(self, *, pin: bool = False, keep_bytes: int = 1 << 30, pieces_up_to: int = 0) -> None:
        self.pin = pin
        self.keep_bytes = keep_bytes
        self.pieces_up_to = pieces_up_to
        # Free buffers by size, and their sizes in order: a take finds its best fit by
        # bisection (a scan of the free list made a long chain's read quadratic: minutes).
        self._free: dict[int, list[AlignedBuffer | _Piece]] = {}
        self._sizes: list[int] = []
        self._free_count = 0
        self._free_bytes = 0
        # The memory free buffers keep mapped, held to ``keep_bytes``: a kept piece keeps its
        # whole slab (counted once, however many of its pieces are kept), not its own bytes
        # (counted so, pieces of 400 MiB of slabs stayed mapped under a keep of 1 MiB).
        self._kept_bytes = 0
        self._kept_pieces: dict[int, int] = {}  # id(slab) -> its pieces kept
        self._slab: AlignedBuffer | None = None  # the slab pieces are being cut from
        self._slab_used = 0
        self._lock = threading.Lock()
        self.made = 0
        self.pin_refused = False  # a buffer asked to be page-locked, with CUDA present, was not
        self.ledger = LeaseLedger()

    def take(self, nbytes: int) -> BufferLease:
        """A buffer of at least ``nbytes``. Raises ``OSError`` (ENOMEM) where the OS maps no
        more host memory."""
        piece = 0 < nbytes <= self.pieces_up_to
        need = round_up(nbytes, PIECE_ALIGN) if piece else round_up(max(nbytes, 1))
        with self._lock:
            # The smallest free buffer that fits; a much larger one stays for a larger frame.
            i = bisect.bisect_left(self._sizes, need)
            if i < len(self._sizes) and self._sizes[i] <= 2 * need:
                size = self._sizes[i]
                bucket = self._free[size]
                buf = bucket.pop()
                if not bucket:
                    del self._free[size], self._sizes[i]
                self._unkeep(buf)
                self.ledger.on_grant(buf.nbytes)
                return BufferLease(self, buf)
            if piece:
                made: AlignedBuffer | _Piece = self._cut(need)
                self.made += 1
                self.ledger.on_grant(made.nbytes)
                return BufferLease(self, made)
            self.made += 1
        buf = AlignedBuffer(need, pin=self.pin)
        with self._lock:
            self.pin_refused |= self.pin and not buf.pinned and _cuda_present()
            self.ledger.on_grant(buf.nbytes)
        return BufferLease(self, buf)

    def _cut(self, nbytes: int) -> _Piece:
        """A new piece from the current slab, or from a new one (under the lock)."""
        if self._slab is None or self._slab_used + nbytes > self._slab.nbytes:
            self._slab = AlignedBuffer(max(SLAB_BYTES, nbytes), pin=self.pin)
            self._slab_used = 0
            self.pin_refused |= self.pin and not self._slab.pinned and _cuda_present()
        piece = _Piece(self._slab, self._slab_used, nbytes)
        self._slab_used += nbytes
        return piece

    def lease_released(self, buf: AlignedBuffer | _Piece, nbytes: int) -> None:
        """A lease's buffer comes back: kept for reuse (up to ``keep_bytes``) or dropped."""
        with self._lock:
            self.ledger.on_release(nbytes)
            if self._kept_bytes + self._keeping(buf) <= self.keep_bytes:
                bucket = self._free.get(buf.nbytes)
                if bucket is None:
                    bucket = self._free[buf.nbytes] = []
                    bisect.insort(self._sizes, buf.nbytes)
                bucket.append(buf)
                self._free_count += 1
                self._free_bytes += buf.nbytes
                self._kept_bytes += self._keeping(buf)
                if isinstance(buf, _Piece):
                    self._kept_pieces[id(buf._slab)] = self._kept_pieces.get(id(buf._slab), 0) + 1

    def _keeping(self, buf: AlignedBuffer | _Piece) -> int:
        """The bytes keeping ``buf`` free would map on: a piece, its slab's where no other
        piece of it is kept (none where one is); a buffer, its own (under the lock)."""
        if isinstance(buf, _Piece):
            return 0 if self._kept_pieces.get(id(buf._slab)) else buf._slab.nbytes
        return buf.nbytes

    def _unkeep(self, buf: AlignedBuffer | _Piece) -> None:
        """``buf`` leaves the free buffers (taken again, or dropped; under the lock)."""
        self._free_count -= 1
        self._free_bytes -= buf.nbytes
        if isinstance(buf, _Piece):
            left = self._kept_pieces[id(buf._slab)] - 1
            if left:
                self._kept_pieces[id(buf._slab)] = left
            else:
                del self._kept_pieces[id(buf._slab)]
                self._kept_bytes -= buf._slab.nbytes
        else:
            self._kept_bytes -= buf.nbytes

    def keep_at_most(self, nbytes: int) -> None:
        """Keep no more than ``nbytes`` for reuse from now on: free buffers past it go now
        (the largest first), lent ones as they come back. The counts go on (leases lent stay
        counted)."""
        with self._lock:
            self.keep_bytes = nbytes
            while self._sizes and self._kept_bytes > nbytes:
                size = self._sizes[-1]
                bucket = self._free[size]
                self._unkeep(bucket.pop())
                if not bucket:
                    del self._free[size]
                    self._sizes.pop()
            if nbytes == 0:
                self._slab = None  # (mapped on while a piece of it is, lent or kept)

    def stats(self) -> dict[str, Any]:
        """``pinned``: whether its buffers are page-locked (asked for, CUDA present, and none
        refused). It said ``pin``, what was asked for: True on a host without CUDA, where
        nothing is page-locked."""
        with self._lock:
            pinned = self.pin and not self.pin_refused and _cuda_present()
            return {"buffers_made": self.made, "buffers_free": self._free_count, "free_bytes": self._free_bytes,
                    "kept_bytes": self._kept_bytes, "pinned": pinned, **self.ledger.stats()}


# -- reads in flight -----------------------------------------------------------------------


# What a read that could not be made ran short of (descriptors, memory, buffers): a state of
# the process or the system that passes, not of the file.
SHORTAGES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS})
# What the device says of the file's own blocks (a bad sector: EIO; a checksum the
# filesystem keeps, failing: EBADMSG, EUCLEAN), not of a moment's shortage: read again, it
# fails again.
MEDIA_ERRORS = frozenset({errno.EIO, errno.EBADMSG, errno.EUCLEAN})


class ReadFailed(Exception):
    """A read could not give a whole file. ``damaged``: the file itself is bad (missing,
    another size than expected, short, or refused by its ``check``); else the read could
    not be made (no descriptor or memory left, an I/O error), which says nothing of the
    file. ``missing``: the file was not there. ``shortage``: not made for want of a
    descriptor or memory (``SHORTAGES``), which a moment later may be there again.
    ``io_error``: not made, the device failing the file (``MEDIA_ERRORS``: a bad sector),
    which the next read meets again; the caller judges it (the disk tier drops the block).
    ``cause``: what the read's ``check`` raised, where it refused the file (the caller may
    tell one kind of refusal from another: a frame of another format version is no damage)."""

    def __init__(self, reason: str, *, missing: bool = False, damaged: bool = True, shortage: bool = False,
                 cause: BaseException | None = None, io_error: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing
        self.damaged = damaged
        self.shortage = shortage
        self.cause = cause
        self.io_error = io_error

    @classmethod
    def not_made(cls, reason: str, exc: BaseException) -> ReadFailed:
        """A read that ``exc`` (an ``OSError`` or ``MemoryError``) kept from being made."""
        note_if_exhausted("disk_read", exc)  # (the cause, connections holding every descriptor, said apart)
        shortage = isinstance(exc, MemoryError) or isinstance(exc, OSError) and exc.errno in SHORTAGES
        io_error = isinstance(exc, OSError) and exc.errno in MEDIA_ERRORS
        return cls(reason, damaged=False, shortage=shortage, io_error=io_error)


@dataclass(slots=True)
class ReadDone:
    """A file read whole into ``lease``'s buffer: ``view`` is its ``nbytes`` bytes, ``checked``
    what the read's ``check`` returned for them, ``seconds`` the read alone."""

    view: memoryview
    lease: BufferLease | None
    checked: Any
    seconds: float
    path_taken: str
    finished: float  # time.perf_counter() when it landed and was checked


THREAD_START_SECONDS = 30.0  # (the pool's threads up at once: a start taking longer is a failure)


def start_threads(pool: ThreadPoolExecutor, n: int, what: str) -> None:
    """Start all ``n`` threads of ``pool`` now, or raise ``StorageError`` naming ``what``.

    An executor starts a thread as work comes while it has none idle; under a limit of
    tasks (a container's ``pids.max``, ``ulimit -u``) the one that could not start raised
    ``RuntimeError: can't start new thread`` out of the call that needed it (a server's
    500), and left that call's work queued for a later thread to run, unlooked for (a read
    whose buffer nobody gave back). Started at open, the threads are there for good, and a
    limit too low for them fails the open, where it is said."""
    gate = threading.Barrier(n + 1)  # (each thread held until all are up: none idle to reuse)
    try:
        for _ in range(n):
            pool.submit(gate.wait, THREAD_START_SECONDS)
        gate.wait(THREAD_START_SECONDS)
    except (RuntimeError, threading.BrokenBarrierError) as exc:
        gate.abort()  # (those started go idle; ``shutdown`` ends them)
        raise StorageError(f"cannot start the {n} threads of {what}: {exc or type(exc).__name__} (at the limit of "
                           "processes and threads: a container's pids limit, ulimit -u)") from None


class ReadPool:
    """Whole-file reads, ``depth`` at a time, each into an aligned buffer, each checked in
    the thread that read it. ``read_path`` is the probed path (``probe_read_path``).
    ``max_bytes``: a file larger than this is not read (``ReadFailed``, damaged) before any
    buffer is taken: a file's size is no more to be trusted than its bytes. ``stream_bytes``:
    the read-buffer bytes each ``ReadStream`` keeps in flight (``READ_STREAM_BYTES``)."""

    def __init__(self, read_path: str, *, depth: int = 16, buffers: BufferPool | None = None,
                 max_bytes: int | None = None, stream_bytes: int = READ_STREAM_BYTES) -> None:
        if read_path not in READ_PATHS:
            raise ValueError(f"read_path: one of {READ_PATHS}, got {read_path!r}")
        if depth < 1:
            raise ValueError(f"depth: at least 1, got {depth}")
        if stream_bytes < 1:
            raise ValueError(f"stream_bytes: at least 1, got {stream_bytes}")
        self.read_path = read_path
        self.depth = depth
        self.stream_bytes = stream_bytes
        self.buffers = buffers or BufferPool()
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="cacheseek-read")
        try:
            start_threads(self._pool, depth, "the disk reads")
        except BaseException:
            self._pool.shutdown(wait=True, cancel_futures=True)
            raise
        self.closed = False
        self._counts_lock = threading.Lock()
        self.direct_reads = 0
        self.buffered_reads = 0
        self.direct_refused = 0  # files whose O_DIRECT open or read failed (read buffered instead)

    def submit(self, path: Path, expected: int | None, check: Callable[[memoryview, Any], Any], context: Any = None,
               buffers: BufferPool | None = None) -> Future:
        """Start reading ``path`` whole (``expected`` bytes, if known), then ``check(view,
        context)`` in the same thread; the future gives a ``ReadDone`` or raises ``ReadFailed``
        (one not made, once the pool is closed: a stream its tier's ``close`` overtook ends in
        misses, rather than in the executor's "cannot schedule new futures after shutdown")."""
        try:
            return self._pool.submit(self._read, path, expected, check, context, buffers or self.buffers)
        except RuntimeError:
            if not self.closed:
                raise
            closed: Future = Future()
            closed.set_exception(ReadFailed(f"{path.name}: not read, the read pool is closed", damaged=False))
            return closed

    def read_many(self, items: Sequence[tuple[Path, int | None, Any]], check: Callable[[memoryview, Any], Any],
                  buffers: BufferPool | None = None) -> ReadStream:
        """Start reading every ``(path, expected size, context)``; see ``ReadStream``."""
        return ReadStream(self, items, check, buffers)

    def _read(self, path: Path, expected: int | None, check: Callable[[memoryview, Any], Any], context: Any,
              buffers: BufferPool) -> ReadDone:
        start = time.perf_counter()
        direct = self.read_path != "buffered"
        # O_NONBLOCK until the file is known to be a regular one: the open of a named pipe put
        # where a file was waits for a writer, and held the read (and its caller) for good.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (O_DIRECT if direct else 0))
        except FileNotFoundError:
            raise ReadFailed(f"{path.name}: not found", missing=True) from None
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise ReadFailed.not_made(f"{path.name}: {exc}", exc) from None
            with self._counts_lock:
                self.direct_refused += 1
            direct = False
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                raise ReadFailed(f"{path.name}: not found", missing=True) from None
            except OSError as exc2:
                raise ReadFailed.not_made(f"{path.name}: {exc2}", exc2) from None
        lease = None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ReadFailed(f"{path.name}: not a regular file")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            size = st.st_size
            if expected is not None and size != expected:
                raise ReadFailed(f"{path.name}: holds {size} bytes, {expected} expected")
            if self.max_bytes is not None and size > self.max_bytes:
                raise ReadFailed(f"{path.name}: holds {size} bytes, more than any frame read here ({self.max_bytes})")
            lease = buffers.take(size)
            try:
                got = _read_whole(fd, path, lease.buffer, size, direct)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise ReadFailed.not_made(f"{path.name}: {exc}", exc) from None
                with self._counts_lock:
                    self.direct_refused += 1
                direct = False
                os.close(fd)
                fd = -1  # (closed: if the open below fails, the number may be another thread's by then)
                fd = os.open(path, os.O_RDONLY)
                got = _read_whole(fd, path, lease.buffer, size, False)
            if got != size:
                raise ReadFailed(f"{path.name}: short read, {got} of {size} bytes")
            view = lease.buffer.view(size)
            try:
                checked = check(view, context)  # the checksum, on the buffer as it landed, in this thread
            except ReadFailed:
                raise
            except Exception as exc:
                raise ReadFailed(f"{path.name}: {exc}", cause=exc) from None
        except BaseException as exc:
            if lease is not None:
                lease.release()
            if isinstance(exc, ReadFailed):
                raise
            if isinstance(exc, (OSError, MemoryError)):  # (a buffer not to be had, a read cut off)
                raise ReadFailed.not_made(f"{path.name}: {exc!r}", exc) from None
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        with self._counts_lock:
            if direct:
                self.direct_reads += 1
            else:
                self.buffered_reads += 1
        end = time.perf_counter()
        return ReadDone(view, lease, checked, end - start, self.read_path if direct else "buffered", end)

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            return {"read_path": self.read_path, "read_depth": self.depth, "direct_reads": self.direct_reads,
                    "buffered_reads": self.buffered_reads, "direct_refused": self.direct_refused,
                    "read_buffers": self.buffers.stats()}

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


class ReadStream:
    """Reads of many files in flight, handed out in the order given.

    Up to twice the pool's depth are queued at once (the device's queue stays full while
    the consumer works on what has landed), and no more than the pool's ``stream_bytes`` of
    buffers between them (their expected sizes, in whole pages; a file of unknown size counts
    as all of it), save that one is always in flight: a frame larger than that still streams,
    read while the consumer works on the one before. Each one handed out starts the next ones
    that fit; what the consumer holds once handed out is its own to bound. Iterating
    gives each file's ``ReadDone`` (or its ``ReadFailed``) as soon as it and the ones before
    it have landed. The reads start when the stream is made, not at the first ``next``.
    ``close()`` (or the end of a ``with``) cancels what has not started and gives back the
    buffers of reads that landed but were never handed out: a consumer that stops early
    leaves nothing behind. ``started``/``last_landed`` (perf_counter) time the whole.
    """

    def __init__(self, pool: ReadPool, items: Sequence[tuple[Path, int | None, Any]],
                 check: Callable[[memoryview, Any], Any], buffers: BufferPool | None) -> None:
        self._pool, self._check, self._buffers = pool, check, buffers
        self._items = list(items)
        self._todo = 0  # the index of the next item to submit
        self._futures: list[Future] = []
        self._sizes: list[int] = []  # the bytes each submitted read counts against ``stream_bytes``
        self._next = 0
        self._bytes_in_flight = 0
        self.started = time.perf_counter()
        self.last_landed = self.started
        self._fill()

    def _fill(self) -> None:
        """Submit the next reads while they fit: under twice the depth, and within
        ``stream_bytes`` unless none is in flight."""
        pool = self._pool
        while self._todo < len(self._items):
            path, expected, context = self._items[self._todo]
            size = pool.stream_bytes if expected is None else round_up(max(expected, 1))
            in_flight = len(self._futures) - self._next
            if in_flight and (in_flight >= 2 * pool.depth or self._bytes_in_flight + size > pool.stream_bytes):
                return
            self._futures.append(pool.submit(path, expected, self._check, context, self._buffers))
            self._sizes.append(size)
            self._bytes_in_flight += size
            self._todo += 1

    def __iter__(self) -> ReadStream:
        return self

    def __next__(self) -> ReadDone | ReadFailed:
        if self._next >= len(self._futures):
            raise StopIteration
        fut = self._futures[self._next]
        # The result taken before the read counts as handed out: an interrupt while it is
        # awaited leaves it to ``close``, which gives its buffer back (it was marked handed
        # out first, and its buffer stayed lent for good).
        try:
            done: ReadDone | ReadFailed = fut.result()
        except ReadFailed as exc:
            done = exc
        except CancelledError:  # (queued when the pool closed: its close cancels what has not begun)
            done = ReadFailed("not read, the read pool is closed", damaged=False)
        self._futures[self._next] = None  # type: ignore[call-overload]  # handed out: no longer ours
        self._bytes_in_flight -= self._sizes[self._next]
        self._next += 1
        try:
            self._fill()
        except BaseException:  # (an interrupt: the read handed out is given back, not lost)
            if isinstance(done, ReadDone) and done.lease is not None:
                done.lease.release()
            raise
        if isinstance(done, ReadDone):
            self.last_landed = max(self.last_landed, done.finished)
        return done

    def close(self) -> None:
        for fut in self._futures[self._next :]:
            if fut is None or fut.cancel():
                continue
            try:
                left = fut.result()
            except ReadFailed:
                continue
            if left.lease is not None:
                left.lease.release()
        self._futures = self._futures[: self._next]
        self._sizes = self._sizes[: self._next]
        self._bytes_in_flight = 0
        self._todo = len(self._items)

    def __enter__(self) -> ReadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_warned_unpinned = False


def _cuda_present() -> bool:
    """Whether page-locked memory can be had: torch imports and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _warn_unpinned(exc: BaseException) -> None:
    global _warned_unpinned
    if not _warned_unpinned:
        _warned_unpinned = True
        log.warning("read buffers: page-locked memory refused (%s); reading into pageable memory", exc)


def _read_whole(fd: int, path: Path, buf: AlignedBuffer | _Piece, size: int, direct: bool) -> int:
    """Read ``size`` bytes from offset 0 into ``buf`` (whole pages: a pool without pieces);
    with O_DIRECT every request is aligned (the last one rounded up: the file's end cuts it
    short). Returns the bytes read."""
    got = 0
    limit = round_up(size) if direct else size
    while got < size:
        n = os.preadv(fd, [buf.view(limit)[got:]], got)
        if n <= 0:
            break
        got += n
        if direct and got % DIRECT_ALIGN and got < size:
            # A short O_DIRECT read that ends unaligned cannot go on aligned: finish buffered.
            return got + _read_rest_buffered(path, buf, got, size)
    return min(got, size)


def _read_rest_buffered(path: Path, buf: AlignedBuffer | _Piece, start: int, size: int) -> int:
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        view = buf.view(size)[start:]
        got = 0
        while got < view.nbytes:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        return got


def drop_cached(path: str | os.PathLike) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (a cold read next)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


__all__ = [
    "AlignedBuffer", "BufferLease", "BufferPool", "DIRECT_ALIGN", "READ_PATHS", "READ_STREAM_BYTES", "ReadDone",
    "ReadFailed", "ReadPool", "ReadStream", "drop_cached", "probe_read_path", "round_up",
]
