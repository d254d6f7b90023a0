"""The tier interface, the frame handle tiers pass around, and per-tier statistics.

Tiers are dumb storage with a byte budget and an eviction order (``store.eviction``);
policy between tiers (write-through, demotion, promotion) belongs to ``TieredStore``. Every tier is thread-safe on its own.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, TypeVar

from ..errors import StorageError
from .eviction import DEFAULT_POLICY, EvictionIndex, make_index
from .frame import FrameMeta, header_prefix, payload_checksum

STREAM_CHUNK = 16  # keys asked of a tier at once by the default stream

_T_co = TypeVar("_T_co", covariant=True)


class ClosingIterator(Iterator[_T_co], Protocol[_T_co]):
    """An iterator its consumer closes when it stops early (a tier's ``stream``): reads
    not handed out are cancelled or given back."""

    def close(self) -> None: ...


@dataclass(slots=True)
class BlockFrame:
    """One stored block: its header, plus its bytes wherever they are.

    ``host`` is the whole frame on the host (a memoryview). ``device_payload`` is the
    payload bytes as a uint8 tensor on a device, and ``device_entries`` the per-buffer
    tensors fresh from an encoder; either may stand in for ``host`` in embedded mode.
    A frame whose payload checksum has not been computed yet (``sealed`` False) carries
    zeros in its header's checksum field; :meth:`wire_segments` seals a copy of the header.
    ``lease`` (``store.lease.Lease``): set when ``host`` lies in memory lent by a tier (a
    CPU-tier slot, a disk stream's pooled read buffer). Whoever got the frame releases it
    exactly once (``release()``, or ``with frame:``) when done with the bytes; until then
    the tier does not reuse that memory. ``host`` must not be used after the release.
    """

    meta: FrameMeta
    host: Any = None
    device_payload: Any = None
    device_entries: list[Any] | None = None
    sealed: bool = True
    # Preamble + header with the real checksum, once computed for an unsealed host frame.
    sealed_prefix: bytes | None = None
    lease: Any = None
    # Where ``host`` starts in this process's memory, when its tier knows it (a CPU-tier
    # slot): a kernel that reads a pinned frame in place needs no tensor made over it.
    host_address: int | None = None

    def release(self) -> None:
        """Release the lease on this frame's bytes, if it has one (then exactly once: a
        second release raises ``LeaseError``)."""
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> BlockFrame:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lease is not None:
            self.lease.release_if_held()

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    def payload_view(self) -> memoryview:
        return memoryview(self.host).cast("B")[self.meta.payload_offset :]

    def wire_segments(self) -> list[Any]:
        """The sealed frame as [header prefix, payload] without copying the payload."""
        if self.host is None:
            raise RuntimeError("frame has no host bytes; move it to the host first")
        view = memoryview(self.host).cast("B")
        if self.sealed and self.sealed_prefix is None:
            return [view]
        payload = view[self.meta.payload_offset :]
        if self.sealed_prefix is None:
            self.meta = replace(self.meta, checksum=payload_checksum(payload))
            self.sealed_prefix = header_prefix(self.meta)
            self.sealed = True
        return [self.sealed_prefix, payload]

    def to_bytes(self) -> bytes:
        return b"".join(bytes(s) if not isinstance(s, bytes) else s for s in self.wire_segments())


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a tier's index keeps per block: enough to budget, to walk chains, to rank."""

    nbytes: int
    raw_nbytes: int
    parent: bytes
    position: int
    # What the tier's budget counts for the block where its storage takes more than the
    # frame (the disk tier: whole file-system blocks, and its sidecar's); 0: ``nbytes``.
    charged_nbytes: int = 0

    @property
    def charge(self) -> int:
        """The bytes the tier's budget counts for this block."""
        return self.charged_nbytes or self.nbytes


@dataclass(slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int = 0
    blocks: int = 0
    raw_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    admissions: int = 0  # blocks newly stored here (ingest, write-through, promotion, demotion)
    promotions: int = 0
    # Promotions into this tier not made: its only room was the chain being read (``spare``),
    # the block served from the tier below instead.
    promotions_spared: int = 0
    demotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    corrupt: int = 0
    # Frames of another format version found (another release's, sharing the storage): a
    # miss that keeps them (``FrameVersionError``), where a corrupt frame is deleted.
    foreign_version: int = 0
    # Reads that failed for want of a descriptor, memory, or an I/O error: nothing removed (but a
    # victim read to hand it down after an I/O error: ``DiskTier._evict_one``).
    read_errors: int = 0
    write_errors: int = 0
    read_seconds: float = 0.0
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        # The codec's ratio, over encoded bytes: a tier whose budget counts more than its frames
        # (the disk's whole file-system blocks) reports theirs as ``frame_bytes``.
        encoded = self.extra.get("frame_bytes", self.used_bytes)
        out["compression_ratio"] = self.raw_bytes / encoded if encoded else None
        out["read_gbps"] = self.bytes_out / self.read_seconds / 1e9 if self.read_seconds > 0 else None
        out.update(extra)
        return out


class Spared(StorageError):
    """A write refused because its room would have cost a block its call spares (``spare``:
    the chain a read promotes for): an expected outcome, not a write error. The read serves
    the block from the tier below it, where it still is."""


@dataclass(slots=True)
class TierPutResult:
    """``stored``: the frame as this tier now holds it (None if it was already there).
    ``evicted``: blocks pushed out to make room, with their frames when demotion wants them.
    ``error``: why this frame could not be stored (batch puts only; single puts raise)."""

    stored: BlockFrame | None
    evicted: list[tuple[bytes, BlockFrame | None]] = field(default_factory=list)
    error: Exception | None = None


@dataclass(eq=False, slots=True)
class Reservation:
    """Room for one frame in a tier's own memory, lent to a writer that fills it in place
    (a server receiving a request body) and then commits it or gives it back. Nothing stored
    changes before the commit. ``slot`` is the tier's handle; None once committed or aborted."""

    nbytes: int
    slot: Any

    def view(self) -> memoryview:
        """The reserved bytes, for the holder of the reservation: valid until it is committed
        or aborted (the reservation is the writer's lease on the slot; an abort makes the slot
        reusable at once, so a view must not be written after it)."""
        if self.slot is None:
            raise RuntimeError("this reservation was already committed or aborted")
        return self.slot.view(self.nbytes)


class Tier(ABC):
    """Storage for frames under a byte budget. Implementations are thread-safe."""

    name: str
    persistent: bool = False
    # Whether put() takes frames whose bytes are still on a device (else the store moves
    # them to the host first).
    accepts_device_frames: bool = False
    # Whether reserve_run() lends runs of slots in host memory (filled by one device copy).
    lends_runs: bool = False
    # Set by TieredStore: whether put() should hand back the frames it evicts.
    demote_evicted: bool = False
    # Whether contains/contains_many/touch read only an index in this process's memory
    # (no I/O: callers may run them in an event loop). False for a networked tier.
    index_in_memory: bool = True

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._stats = TierStats(name=name, capacity_bytes=capacity_bytes)

    @abstractmethod
    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        """Store ``frame`` (evicting blocks to fit, in the tier's eviction order). Raises ``StorageError`` if it cannot."""

    @abstractmethod
    def get(self, key: bytes) -> BlockFrame | None:
        """The frame, or None on a miss. A corrupt frame is a miss: deleted and counted. The
        caller releases the frame's ``lease`` (``frame.release()``) once done with it."""

    def peek(self, key: bytes) -> BlockFrame | None:
        """``get`` for the store's own copies (a drain's), which no client asked for: the
        memory tiers count them as neither hit nor miss. (Here, for a tier that does not
        override it: ``get``.)"""
        return self.get(key)

    @abstractmethod
    def delete(self, key: bytes) -> bool | None:
        """True: deleted; False: not held here; None: the tier could not be reached, so
        whether it held the block is not known (it may hold it still)."""

    @abstractmethod
    def info(self, key: bytes) -> BlockInfo | None: ...

    def info_or_raise(self, key: bytes) -> BlockInfo | None:
        """``info``, but a tier that could not be asked raises ``TierUnavailable`` where
        ``info`` answers None (a miss): for a caller that must not take an outage for an
        absent block (a pin, which would answer "not stored")."""
        return self.info(key)

    @abstractmethod
    def keys(self) -> list[bytes]: ...

    def take_orphans(self) -> list[tuple[bytes, BlockFrame | None]]:
        """The victims of writes that were interrupted after they evicted them (they could not
        return them): the store hands them down as it would have, else a write-back store lost
        acknowledged blocks to a Ctrl-C. Given once."""
        return []

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, lease_stored: bool = False,
                 room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """Store several frames; a failure is reported in its result, not raised.
        ``lease_stored``: a ``stored`` frame that lies in this tier's memory carries a lease
        on it (the caller reads it, and releases it); else it may be read only until this
        tier can evict it (no other thread uses the tier meanwhile). ``room_for``: bytes of
        the caller's later writes of the same call, evicted for now by the memory and disk
        tiers (``_make_room``); Redis evicts for each frame as it comes. ``spare``: blocks
        this call must not evict (``EvictionIndex.victim``); a frame with no room without
        them fails with ``Spared``. A tier without a local index (Redis), which does not
        choose its victims, ignores it."""
        out = []
        for key, frame in items:
            try:
                out.append(self.put(key, frame))
            except StorageError as exc:
                out.append(TierPutResult(stored=None, error=exc))
        return out

    def reserve(self, nbytes: int) -> Reservation | None:
        """Room for a frame of ``nbytes`` that the caller writes in place, then passes to
        ``commit`` or ``abort``. None: this tier takes frames only through ``put``, or it has
        no room without evicting (the caller then uses ``put``)."""
        return None

    def reserve_run(self, nbytes: int, count: int, *, grow: bool = False,
                    partial: bool = False) -> list[Reservation] | None:
        """Room for ``count`` frames of ``nbytes`` laid end to end in this tier's memory (a
        run one device copy fills), or None, as :meth:`reserve`. ``partial``: a shorter run
        when that is all there is room for now."""
        return None

    def commit(self, key: bytes, reservation: Reservation, meta: FrameMeta) -> TierPutResult:
        raise RuntimeError(f"{self.name} tier: lends no reservations")

    def commit_many(self, items: list[tuple[bytes, Reservation, FrameMeta]], *, sealed: bool = True,
                    landing: Any = None, room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        raise RuntimeError(f"{self.name} tier: lends no reservations")

    def abort(self, reservation: Reservation) -> None:
        raise RuntimeError(f"{self.name} tier: lends no reservations")

    def get_many(self, keys: list[bytes]) -> list[BlockFrame | None]:
        """Frames for ``keys``, None for each miss. A networked tier overrides this with
        one round trip for the lot."""
        return [self.get(k) for k in keys]

    def stream(self, keys: list[bytes], *, leased: bool = True) -> ClosingIterator[BlockFrame | None]:
        """Frames for ``keys`` in order, each handed out as soon as it is in hand (None for a
        miss). This default asks ``get_many`` for ``STREAM_CHUNK`` keys at a time (one round
        trip each for a networked tier), so the caller starts on the first frames before the
        last are fetched; the disk tier keeps many reads in flight instead. The caller
        releases each frame's ``lease`` (where it has one) once done with its bytes.
        ``leased=False``: a disk frame gets a buffer of its own rather than a pooled one
        (frames in a memory tier's slots carry their lease either way)."""
        for start in range(0, len(keys), STREAM_CHUNK):
            got = self.get_many(keys[start : start + STREAM_CHUNK])
            try:
                for i in range(len(got)):
                    frame, got[i] = got[i], None  # the caller's from here: it releases it
                    yield frame
            finally:  # closed early: the frames fetched and not handed out are released here
                for frame in got:
                    if frame is not None:
                        frame.release()

    def contains(self, key: bytes) -> bool:
        return self.info(key) is not None

    def charge(self, nbytes: int) -> int:
        """The bytes the budget counts for a frame of ``nbytes`` (``BlockInfo.charge``)."""
        return nbytes

    def holds_with_room(self, parent: bytes, nbytes: int, spare: Container[bytes] = ()) -> bool:
        """Whether a chain's block whose parent is ``parent`` may be promoted into this tier
        (``IndexedTier``: the parent stored here, and not the victim that would make room,
        ``spare`` spared)."""
        return self.contains(parent)

    def victim_for(self, nbytes: int) -> tuple[bool, bytes | None]:
        """Whether a frame of ``nbytes`` fits here without evicting anything, and if not, the
        block the tier would give up first to make room (None: every block is pinned). A tier
        without a local index (Redis) cannot tell: (True, None)."""
        return True, None

    def keep_order(self) -> list[bytes]:
        """The blocks held here, those the tier would keep longest first (pinned ones first);
        a tier without a local index: ``keys()``."""
        return self.keys()

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def present_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is held here in the sense of a put's "present" (its
        acknowledgement): ``contains_many``, unless the tier can tell its copy is gone."""
        return self.contains_many(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark blocks used again, in order (the last is the most recent use)."""

    def pin(self, keys: Iterable[bytes]) -> None:
        """Never evict ``keys`` (whole chains from their head), held now or stored later."""
        raise StorageError(f"{self.name} tier: pins are not supported")

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Give pinned ``keys`` back to eviction."""

    def children(self, key: bytes) -> list[bytes]:
        """Blocks held here whose parent is ``key`` (a tier without a local index: none known)."""
        return []

    def watch(self, observer: Any) -> None:
        """Tell ``observer`` (an ``eviction.IndexObserver``) of every block entering or
        leaving this tier; blocks held now are reported at once. A tier without a local
        index has nothing to report."""

    def trim(self) -> list[tuple[bytes, BlockFrame | None]]:
        """Evict until the budget holds (a tier opened over more than it); the victims, as a
        put's ``evicted``. A tier that can never hold more than its budget has none."""
        return []

    def batched_deletes(self) -> AbstractContextManager:
        """Deletes this thread makes inside the ``with`` are made durable together at its
        end, where the tier must sync them (the disk's directory fsyncs): a flush of many
        blocks pays once per directory touched, not once per block."""
        return nullcontext()

    def settle(self) -> set[bytes]:
        """Return once every frame stored so far can be read from where this tier keeps
        it (a tier that leaves device copies in flight waits for them); the keys dropped
        because their copies failed."""
        return set()

    def stats(self) -> TierStats:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> TierStats:
        return replace(self._stats, extra=dict(self._stats.extra))

    def count(self, **deltas: int) -> None:
        """Add to counters from outside (the store counts promotions and demotions)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def lost(self) -> str | None:
        """Why the tier gave up the storage under it for good (its directory deleted under
        it: ``DiskTier.lost``), looked at now; None while it holds it. A tier whose backend
        can come back (Redis) is never lost: its calls fail until it answers."""
        return None

    def read_only(self) -> str | None:
        """Why the tier cannot write now while it still serves what it holds (a disk whose
        filesystem went read-only: ``DiskTier.read_only``); None while it can."""
        return None

    def close(self) -> None:
        return None


class IndexedTier(Tier):
    """A tier whose index (sizes, chain links, eviction order) lives in this process, in an
    ``EvictionIndex`` of the named ``policy`` under the tier's lock. Subclasses keep the
    bytes and report extras."""

    def __init__(self, name: str, capacity_bytes: int, *, policy: str = DEFAULT_POLICY) -> None:
        super().__init__(name, capacity_bytes)
        self._index: EvictionIndex = make_index(policy, capacity_bytes)

    def info(self, key: bytes) -> BlockInfo | None:
        with self._lock:
            return self._index.get(key)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:  # once for all keys: a lookup of a long chain takes one lock
            return self._index.contains_many(keys)

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._index.keys()

    def touch(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._index.touch(keys)

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._index.pin(keys)
            self._sync_counts()

    def unpin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._index.unpin(keys)
            self._sync_counts()

    def children(self, key: bytes) -> list[bytes]:
        with self._lock:
            return self._index.children(key)

    def holds_with_room(self, parent: bytes, nbytes: int, spare: Container[bytes] = ()) -> bool:
        """Whether ``parent`` is stored here and a frame of ``nbytes`` would not evict it first
        (``spare`` spared): where a chain's next block may go up without leaving a tail with
        no head."""
        with self._lock:
            held = self._index.get(parent)
            if held is None:
                return False
            # Room beside the parent and the pinned blocks at all: else the copy evicted
            # others for nothing before it found the parent in its way (frames of several
            # sizes, one larger than the blocks it evicts).
            beside = self._index.pinned_bytes + (0 if self._index.is_pinned(parent) else held.charge)
            if self.charge(nbytes) > self.capacity_bytes - beside:
                return False
            fits, victim = self._victim_for(nbytes, spare)
            return fits or victim != parent

    def victim_for(self, nbytes: int) -> tuple[bool, bytes | None]:
        with self._lock:
            return self._victim_for(nbytes)

    def _victim_for(self, nbytes: int, spare: Container[bytes] = ()) -> tuple[bool, bytes | None]:
        if self._index.used_bytes + self._writing_bytes() + self.charge(nbytes) <= self.capacity_bytes:
            return True, None
        return False, self._index.victim(spare)

    def _writing_bytes(self) -> int:
        """Bytes of frames being written, not yet indexed, that hold room (under the lock)."""
        return 0

    def keep_order(self) -> list[bytes]:
        with self._lock:
            return self._index.keep_order()

    def watch(self, observer: Any) -> None:
        with self._lock:
            self._index.observer = observer
            if observer is not None:
                for key in self._index.keys():
                    observer.added(key, self._index.get(key))

    def _fits_beside_pins(self, nbytes: int, *, in_flight: int = 0) -> bool:
        """Whether ``nbytes`` can fit beside the pinned blocks (``in_flight``: pinned ones being
        written), which are never evicted. Asked before evicting anything for a frame: one
        that cannot fit would otherwise cost the tier its evictable blocks for nothing."""
        return self._index.pinned_bytes + in_flight + nbytes <= self.capacity_bytes

    def _spared(self, nbytes: int) -> Spared:
        """Why a frame does not fit once nothing but the blocks its call spares (and pinned
        ones) is left to evict."""
        return Spared(f"{self.name} tier: no room for a {nbytes}-byte frame without evicting blocks this write "
                      "spares (the chain it reads, or the stored head of the chain it extends)")

    def _no_room(self, nbytes: int, *, in_flight: int = 0) -> StorageError:
        """Why a frame does not fit once nothing more may be evicted (everything left is pinned;
        ``in_flight``: bytes of pinned blocks being written)."""
        idx = self._index
        coming = f", {in_flight} more on their way" if in_flight else ""
        return StorageError(
            f"{self.name} tier: no room for a {nbytes}-byte frame: {idx.pinned_bytes} of {self.capacity_bytes} "
            f"bytes are pinned ({idx.pinned_blocks} blocks{coming}), and pinned blocks are never evicted")

    def _extra(self) -> dict[str, Any]:
        """Tier-specific figures for ``stats()`` (called under the lock)."""
        return {}

    def _sync_counts(self) -> None:
        self._stats.used_bytes = self._index.used_bytes
        self._stats.raw_bytes = self._index.raw_bytes
        self._stats.blocks = len(self._index)
        self._stats.pinned_blocks = self._index.pinned_blocks
        self._stats.pinned_bytes = self._index.pinned_bytes
        self._stats.extra = {**self._extra(), "eviction": self._index.describe()}

    def stats(self) -> TierStats:
        with self._lock:
            self._sync_counts()
            return self._snapshot()


class MemoryTier(IndexedTier):
    """An indexed tier in memory (CPU, GPU): a call's frames make their room together
    (``_make_room``), each victim given up by ``_evict_one``."""

    @abstractmethod
    def _evict_one(self, spare: Container[bytes] = ()) -> list[tuple[bytes, BlockFrame | None]] | None:
        """Evict the index's victim (under the lock; ``spare`` spared); the evicted (key, frame)
        pairs. None: nothing left that may be evicted (every block pinned or spared)."""

    def _make_room(self, items: list[tuple[bytes, int]], results: list[TierPutResult], extra: int = 0,
                   spare: Container[bytes] = ()) -> None:
        """Evict for every new frame of a call, ``items`` (key, bytes), and ``extra`` bytes more
        (the rest of the caller's own writes, still on their way), before the first is added,
        so that none of them is a victim of the next. Added one by one, each evicting for
        itself, a call's frames would be ARC's only T1 blocks once every older block has
        been used again (T2), and give up each other: the call would answer "stored" for
        blocks already gone (and, for frames whose copy is in flight, wait for it). Victims
        go in the first new frame's result; a call that cannot fit whole (larger than the
        budget, or than the room beside the pins) leaves each frame to evict for itself.
        Under the lock, in tiers whose ``_evict_one()`` returns its victims. ``spare``: as
        ``put_many``'s (a call that cannot fit beside them leaves each frame to its own try)."""
        new = {key: n for key, n in items if key not in self._index}
        need = sum(new.values()) + extra
        if not new or need > self.capacity_bytes or not self._fits_beside_pins(need):
            return
        first = next(r for (key, _), r in zip(items, results) if key in new)
        while self._index.used_bytes + need > self.capacity_bytes and (gone := self._evict_one(spare)) is not None:
            first.evicted += gone

