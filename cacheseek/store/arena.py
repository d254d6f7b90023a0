"""Host memory for the CPU tier: chunks of frames, pinned when a GPU will read them.

Chunks are anonymous mmaps, committed lazily by the OS as frames land, so a large budget
costs nothing until it is used. With ``pin=True`` and CUDA present, each chunk is page-
locked (``cudaHostRegister``, or a pinned torch allocation as a fallback) so device copies
run at DMA speed; torch is imported only then.

A slot's bytes are lent with a lease (``HostArena.lease``, ``store.lease``). A slot freed
(evicted, deleted) while it is leased is *held*: its record is gone, but its memory is reused
only once its last lease is released, so an eviction never overwrites bytes a reader (or an
in-flight device copy, or a response being sent) is still using. Views taken without a lease
are valid only while the caller otherwise owns the slot (a reservation, the tier's lock).

Host memory the OS will not map (``ulimit -v``/RLIMIT_AS, ``vm.overcommit_memory=2``, a
pinned allocation refused) is a shortage, not a bug: a chunk that cannot be pinned is mapped
unpinned (and no later chunk is pinned), and one that cannot be mapped at all caps the
arena at what it has mapped (``capped`` says why; one warning), so allocations answer None
(the tier evicts within what is mapped, or refuses the frame, which falls through to the
tier below). Growth is tried again once ``GROW_RETRY_SECONDS`` have passed, not sooner.

Threads: the arena is guarded by its owner's lock (``lock``; the CPU tier passes its own),
which the caller holds around every call, so a read's lease costs no lock of its own. A
lease's release, which may come from any thread, takes that lock itself: never release a
lease while holding it.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..units import format_size
from .lease import Lease, LeaseLedger

log = logging.getLogger("cacheseek.store")

ALIGN = 64
# A capped arena tries to map again after this long: a failed mmap is cheap, but one per
# write while the OS still refuses would be a storm of syscalls (and of pinning attempts).
GROW_RETRY_SECONDS = 60.0


# The CPU tier's chunk: mapped (and pinned) at once, so not much larger; a frame must lie in one.
CHUNK_BYTES = 1 << 30


def cpu_chunk_bytes(max_frame_bytes: int | None) -> int:
    """The chunk for a CPU tier whose owner writes frames up to ``max_frame_bytes`` (None:
    not known): ``CHUNK_BYTES``, or more, so that every chunk holds the largest frame and the
    room an eviction makes in any of them serves it."""
    return max(CHUNK_BYTES, _align(max_frame_bytes or 0))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pow2_at_least(n: int) -> int:
    return 1 << max(20, (n - 1).bit_length())


def _chunk_size(n: int) -> int:
    """A chunk of at least ``n`` bytes: a power of two up to ``CHUNK_BYTES`` (a pinned torch
    allocation wastes nothing), whole MiB past it (a chunk for frames over a GiB: doubled, it
    mapped up to twice the frame, past the tier's budget)."""
    return _pow2_at_least(n) if n <= CHUNK_BYTES else -(-n // (1 << 20)) << 20


def slot_stride(nbytes: int) -> int:
    """Bytes between the starts of consecutive slots of a run of ``nbytes`` frames."""
    return _align(nbytes)


class _Chunk:
    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = False
        self._keep: Any = None
        self.base = 0
        self.pin_error: str | None = None  # why a chunk asked to be pinned is not
        if pin:
            self._try_pin()
        if not self.base:
            self._mmap = mmap.mmap(-1, nbytes)
            self._anchor = ctypes.c_ubyte.from_buffer(self._mmap)
            self.base = ctypes.addressof(self._anchor)
        # Every slot's view is a slice of this one (a ctypes array per slot, with the attribute
        # that kept its chunk, cost ~470 bytes a block). The array keeps the memory mapped
        # for as long as a view lives (the mmap, or the pinned tensor; not this chunk: no cycle).
        whole = (ctypes.c_ubyte * nbytes).from_address(self.base)
        whole._memory = self._keep if self._keep is not None else self._mmap  # type: ignore[attr-defined]
        self.view = memoryview(whole).cast("B")
        # sorted, coalesced free extents: offsets and sizes
        self.free_offsets: list[int] = [0]
        self.free_sizes: list[int] = [nbytes]

    def _try_pin(self) -> None:
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        # A pinned torch allocation: the caching host allocator rounds to powers of two,
        # so chunks are sized as powers of two by the arena to waste nothing.
        try:
            t = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        except Exception as exc:  # (CUDA's out of memory is a RuntimeError): an unpinned chunk serves, slower
            self.pin_error = f"{type(exc).__name__}: {exc}"
            return
        self._keep = t
        self.base = t.data_ptr()
        self.pinned = True

    def allocate(self, nbytes: int) -> int | None:
        for i, size in enumerate(self.free_sizes):
            if size >= nbytes:
                offset = self.free_offsets[i]
                if size == nbytes:
                    del self.free_offsets[i], self.free_sizes[i]
                else:
                    self.free_offsets[i] += nbytes
                    self.free_sizes[i] -= nbytes
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self.free_offsets, offset)
        # merge with the next extent
        if i < len(self.free_offsets) and offset + nbytes == self.free_offsets[i]:
            nbytes += self.free_sizes[i]
            del self.free_offsets[i], self.free_sizes[i]
        # merge with the previous extent
        if i > 0 and self.free_offsets[i - 1] + self.free_sizes[i - 1] == offset:
            self.free_sizes[i - 1] += nbytes
            return
        self.free_offsets.insert(i, offset)
        self.free_sizes.insert(i, nbytes)

    @property
    def free_bytes(self) -> int:
        return sum(self.free_sizes)


@dataclass(eq=False, slots=True)
class Slot:
    chunk: _Chunk
    offset: int
    nbytes: int  # bytes reserved (aligned)
    leases: int = 0  # leases not released yet (under the arena's lock)
    freed: bool = False  # given back while leased: reused once ``leases`` is 0

    def view(self, nbytes: int | None = None) -> memoryview:
        end = self.offset + (self.nbytes if nbytes is None else min(max(nbytes, 0), self.nbytes))  # (within the slot)
        return self.chunk.view[self.offset : end]

    @property
    def address(self) -> int:
        """Where the slot starts in this process's memory."""
        return self.chunk.base + self.offset

    def torch_view(self, nbytes: int) -> Any:
        """The slot's first ``nbytes`` as a slice of its chunk's pinned torch tensor, or None
        when the chunk is not one (a slice is cheaper to make than a tensor over the view)."""
        keep = self.chunk._keep
        return None if keep is None else keep[self.offset : self.offset + nbytes]

    def torch_span(self, start: int, stop: int) -> Any:
        """Bytes ``[start, stop)`` from this slot's start as a uint8 torch tensor; the span
        may run on into the slots after this one (a run reserved together), never past
        the chunk. Imports torch."""
        if not 0 <= start <= stop <= self.chunk.nbytes - self.offset:
            raise ValueError(f"span [{start}, {stop}) is outside this slot's chunk")
        keep = self.chunk._keep
        if keep is not None:
            return keep[self.offset + start : self.offset + stop]
        import torch

        if stop == start:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_ubyte * (stop - start)).from_address(self.chunk.base + self.offset + start)
        # the tensor keeps the chunk's memory alive (a ctypes array takes attributes; its stubs say none)
        buf._chunk = self.chunk  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)


class HostArena:
    """Slots for frames in host memory, up to ``capacity_bytes`` in ``chunk_bytes`` chunks
    (a frame larger than that in a chunk of its own: the CPU tier's owner passes a
    ``chunk_bytes`` at least its largest frame, so that room evicted in any chunk serves it).
    ``lock``: the owner's lock, held by the caller around every call (see the module doc)."""

    def __init__(self, capacity_bytes: int, *, pin: bool = False, chunk_bytes: int = CHUNK_BYTES,
                 lock: threading.Lock | None = None, map_at_start: bool = False) -> None:
        """``map_at_start``: map (and, pinned, page-lock) the whole capacity now, rather than a
        chunk at a time inside the allocation that first needs it (~0.5 s a GiB pinned, under
        the owner's lock: a pinned tier's first fill stalls on it)."""
        self.capacity_bytes = capacity_bytes
        self.pin = pin
        # The largest chunk (``_chunk_size``):
        self.chunk_bytes = _chunk_size(min(chunk_bytes, max(capacity_bytes, 1)))
        self._chunks: list[_Chunk] = []
        self._lock = lock if lock is not None else threading.Lock()
        self._held = 0  # slots freed while leased
        self._held_bytes = 0
        self.ledger = LeaseLedger()
        # Why the arena maps no more than it has (the OS refused a chunk), or None.
        self.capped: str | None = None
        self._retry_at = 0.0
        self._pin_failed = False
        while map_at_start and self.reserved_bytes < capacity_bytes:
            if self._grow(self._next_chunk_bytes(0)) is None:
                break

    @property
    def reserved_bytes(self) -> int:
        return sum(c.nbytes for c in self._chunks)

    @property
    def limit_bytes(self) -> int:
        """The most this arena maps: its capacity, or more where a chunk rounded past it
        (what it has mapped while ``capped``)."""
        return max(self.capacity_bytes if self.capped is None else 0, self.reserved_bytes)

    def _may_grow(self) -> bool:
        return self.reserved_bytes < self.capacity_bytes and (self.capped is None or time.monotonic() >= self._retry_at)

    def _grow(self, nbytes: int) -> _Chunk | None:
        """A new chunk of ``nbytes``, or None (the arena capped) when the OS will not map it."""
        pin = self.pin and not self._pin_failed
        try:
            chunk = _Chunk(nbytes, pin)
        except (OSError, MemoryError) as exc:
            if self.capped is None:
                log.warning("host memory: a %s chunk for the CPU tier could not be mapped (%s: %s): the tier keeps "
                            "to the %s it has mapped of %s asked for (evicting within it; frames it has no room for "
                            "go to the tier below); mapping more is tried again in %.0f s", format_size(nbytes),
                            type(exc).__name__, exc, format_size(self.reserved_bytes),
                            format_size(self.capacity_bytes), GROW_RETRY_SECONDS)
            self.capped = (f"the OS refused to map a {format_size(nbytes)} chunk past {format_size(self.reserved_bytes)} "
                           f"({type(exc).__name__}: {exc})")
            self._retry_at = time.monotonic() + GROW_RETRY_SECONDS
            return None
        if chunk.pin_error is not None:
            self._pin_failed = True
            log.warning("host memory: a %s chunk for the CPU tier could not be pinned (%s): it and every later chunk "
                        "are unpinned (device copies from them are slower)", format_size(nbytes), chunk.pin_error)
        if self.capped is not None:
            log.info("host memory: the CPU tier's arena maps again past %s", format_size(self.reserved_bytes))
            self.capped = None
        self._chunks.append(chunk)
        return chunk

    @property
    def pinned(self) -> bool:
        return bool(self._chunks) and all(c.pinned for c in self._chunks)

    @property
    def held(self) -> int:
        """Slots freed while leased: their memory is reused once their leases are released."""
        return self._held

    def lease_stats(self) -> dict[str, int]:
        return {**self.ledger.stats(), "held_slots": self._held, "held_bytes": self._held_bytes}

    def lease(self, slot: Slot, nbytes: int | None = None) -> Lease:
        """A lease on ``slot`` (``nbytes`` of it, for the counts): the slot is not reused
        until it is released, even if freed meanwhile. Raises if the slot was freed already."""
        nbytes = slot.nbytes if nbytes is None else nbytes
        if slot.freed:
            raise RuntimeError("arena: a lease on a slot that was freed")
        lease = Lease(self, nbytes, slot)  # (made before it is counted: an interrupt in it counts nothing)
        slot.leases += 1
        ledger = self.ledger
        ledger.active += 1  # ledger.on_grant, inlined: this is every read's cost
        ledger.active_bytes += nbytes
        ledger.granted += 1
        return lease

    def lease_released(self, slot: Slot, nbytes: int) -> None:
        """(``Lease.release``: takes the owner's lock.)"""
        ledger = self.ledger
        with self._lock:
            ledger.active -= 1  # ledger.on_release, inlined
            ledger.active_bytes -= nbytes
            slot.leases -= 1
            if slot.leases == 0 and slot.freed:
                self._held -= 1
                self._held_bytes -= slot.nbytes
                slot.chunk.free(slot.offset, slot.nbytes)

    def allocate(self, nbytes: int, *, grow: bool = True) -> Slot | None:
        """A slot of at least ``nbytes``, or None when no contiguous room is left (in the
        chunks already mapped, with ``grow=False``)."""
        run = self.allocate_run(nbytes, 1, grow=grow)
        return run[0] if run is not None else None

    def allocate_run(self, nbytes: int, count: int, *, grow: bool = True,
                     partial: bool = False) -> list[Slot] | None:
        """``count`` slots of at least ``nbytes`` each, laid end to end at a stride of
        ``slot_stride(nbytes)`` (one device copy can fill them all), or None when no
        contiguous room for all of them is left. Each slot is freed on its own.
        ``partial``: when there is not, as many as the largest free extent holds (None only
        when not even one fits)."""
        need = _align(nbytes)
        if partial:
            count = min(count, max(1, self.chunk_bytes // need))
        # One frame larger than a chunk (a big block: a video frame, 256 tokens of a large
        # MHA model) gets a chunk of its own size; a run only spans chunks of ``chunk_bytes``.
        if count < 1 or count > 1 and need * count > self.chunk_bytes:
            return None
        for chunk in self._chunks:
            offset = chunk.allocate(need * count)
            if offset is not None:
                return [self._slot(chunk, offset + i * need, need) for i in range(count)]
        # The byte budget is the tier's to enforce (it counts frames, not chunks); the arena
        # only needs room for it: chunks until they cover the budget, the last one partly.
        # (None from ``_grow``: the OS maps no more, and the callers' "no room" path runs)
        if grow and self._may_grow() and self._may_map(size := self._next_chunk_bytes(need * count)) \
                and (new := self._grow(size)) is not None:
            offset = new.allocate(need * count)
            assert offset is not None
            return [self._slot(new, offset + i * need, need) for i in range(count)]
        if partial:
            fits = max((size // need for chunk in self._chunks for size in chunk.free_sizes), default=0)
            if 0 < fits < count:
                return self.allocate_run(nbytes, fits, grow=False)
        return None

    def could_fit(self, nbytes: int, slots: list[Slot]) -> bool:
        """Whether freeing ``slots`` (those no lease holds) would leave ``nbytes`` of contiguous
        room in some chunk: asked before evicting block after block for room the arena cannot
        give (slots held by readers, reservations) and failing with the tier emptied."""
        need = _align(nbytes)
        if self._may_grow() and self._may_map(self._next_chunk_bytes(need)):
            return True  # a new chunk
        if need > max((chunk.nbytes for chunk in self._chunks), default=0):
            return False  # (a frame larger than every chunk: no walk over the slots)
        freeable: dict[int, list[tuple[int, int]]] = {}
        for slot in slots:
            if not slot.leases and not slot.freed:
                freeable.setdefault(id(slot.chunk), []).append((slot.offset, slot.nbytes))
        for chunk in self._chunks:
            extents = sorted([*zip(chunk.free_offsets, chunk.free_sizes), *freeable.get(id(chunk), ())])
            start = end = -1
            for offset, size in extents:
                if offset != end:
                    start = offset
                end = offset + size
                if end - start >= need:
                    return True
        return False

    def _next_chunk_bytes(self, need: int) -> int:
        """The next chunk's size: a power of two no larger than the capacity left (a 4.5 GiB
        capacity maps 4 x 1 GiB + 512 MiB, not 5 GiB), unless ``need`` bytes need more; past
        ``chunk_bytes`` only for one frame larger than it (a chunk of its own, whole MiB)."""
        if need > self.chunk_bytes:
            return -(-need // (1 << 20)) << 20
        left = self.capacity_bytes - self.reserved_bytes
        return min(self.chunk_bytes, max(1 << (left.bit_length() - 1), _chunk_size(need)))

    def _may_map(self, size: int) -> bool:
        """Whether a new chunk of ``size`` may be mapped. One of up to ``chunk_bytes`` may pass
        the capacity by its rounding (the last one: a power of two); one for a single frame
        larger than that only where the capacity holds it (doubled and unchecked, a 1.5 GiB
        tier mapped 3 GiB for one 1.1 GiB frame)."""
        return size <= self.chunk_bytes or self.reserved_bytes + size <= self.capacity_bytes

    def _slot(self, chunk: _Chunk, offset: int, nbytes: int) -> Slot:
        return Slot(chunk, offset, nbytes)

    def free(self, slot: Slot) -> None:
        """Give a slot back: reused at once, or (while leased) once its last lease is released."""
        if slot.freed:
            raise RuntimeError("arena: a slot freed twice")
        slot.freed = True
        if slot.leases:
            self._held += 1
            self._held_bytes += slot.nbytes
        else:
            slot.chunk.free(slot.offset, slot.nbytes)

    def release_free(self) -> int:
        """``madvise(MADV_DONTNEED)`` the whole pages of every free extent of the unpinned
        chunks: the OS takes those pages back (RSS falls) and hands out zeroed ones when they
        are written again. Returns the bytes released."""
        released = 0
        page = mmap.PAGESIZE
        for chunk in self._chunks:
            if chunk.pinned or not hasattr(chunk, "_mmap"):
                continue
            for offset, size in zip(chunk.free_offsets, chunk.free_sizes):
                start = -(-offset // page) * page
                end = (offset + size) // page * page
                if end > start:
                    chunk._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
                    released += end - start
        return released
