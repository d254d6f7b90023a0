"""The ``cpu`` tier: frames in host memory (pinned when a GPU reads them), under a byte budget."""

from __future__ import annotations

import contextlib
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError
from .arena import CHUNK_BYTES, HostArena, Slot
from .lease import Lease, release_all
from .arena import slot_stride as _aligned
from .frame import FrameMeta, header_prefix
from .eviction import DEFAULT_POLICY, strict
from .tier import BlockFrame, BlockInfo, MemoryTier, Spared, TierPutResult, Reservation


@dataclass(slots=True)
class _Record:
    slot: Slot
    meta: FrameMeta
    sealed: bool
    # Device copies into the slot still in flight (``device.Landing``); None once landed.
    landing: Any = None


class CpuTier(MemoryTier):
    """Host-memory tier. Frames fresh from a device encoder are copied straight from the
    device into their slot (one copy, no staging) and stay unsealed: their checksum is
    computed only when they leave memory (disk, Redis, HTTP).

    Device copies are not waited for: a frame is indexed at once, and whatever reads,
    demotes or frees its slot waits for its copies first (:meth:`settle` waits for all).

    Every frame ``get`` hands out (and each ``stored`` frame of ``put_many(...,
    lease_stored=True)``) carries a ``lease`` on its slot, which the receiver releases once
    done with the bytes. An evicted or deleted block leaves the index at once; its slot is reused only
    once its leases are all released (``held_slots`` in the stats until then)."""

    accepts_device_frames = True
    lends_runs = True

    def __init__(self, capacity_bytes: int, *, pin: bool = False, name: str = "cpu", chunk_bytes: int = CHUNK_BYTES,
                 reserve_bytes: int = 0, policy: str = DEFAULT_POLICY, map_at_start: bool = False):
        super().__init__(name, capacity_bytes, policy=policy)
        # Reservations (frames still arriving) may take ``reserve_bytes`` beyond the budget:
        # a full tier then receives a frame in place and evicts for it at commit, rather
        # than evicting before the frame is known to be good, or buffering it.
        self.reserve_bytes = reserve_bytes
        # The arena is guarded by this tier's lock: a read's lease costs no lock of its own.
        # ``map_at_start``: the budget's memory (and the reserve's) mapped, pinned: page-locked,
        # now rather than by the ingests that first fill it.
        self._arena = HostArena(capacity_bytes + reserve_bytes, pin=pin, chunk_bytes=chunk_bytes, lock=self._lock,
                                map_at_start=map_at_start)
        self._records: dict[bytes, _Record] = {}
        self._landing: dict[bytes, _Record] = {}  # records whose copies may be in flight
        self._orphans: list[tuple[bytes, BlockFrame | None]] = []  # (see ``take_orphans``)
        self._reserved_bytes = 0  # slots lent out by reserve(), not yet committed or aborted

    # -- writes ------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        result = self.put_many([(key, frame)])[0]  # ``stored``: readable until evicted
        if result.error is not None:
            raise result.error
        return result

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, lease_stored: bool = False,
                 room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """Store several frames. Host bytes are copied before this returns; device
        payloads are copied on their device's to-host stream, and this returns once the
        copies are issued. A frame that cannot be stored gets ``error`` set; the others
        proceed. ``lease_stored``: each ``stored`` frame carries a lease on its slot.
        ``spare``: blocks not to evict (``Tier.put_many``)."""
        results = [TierPutResult(stored=None) for _ in items]
        dropped_leases: list[Lease | None] = []  # of frames whose copies failed: released once the lock is dropped
        try:
            self._put_many_locked(items, results, dropped_leases, lease_stored, room_for, spare)
        except BaseException:
            # An interrupt: the caller gets no results, so the leases on what this call
            # stored so far are given back here (they were held for good); the frames stay
            # stored, unacknowledged. Its victims are kept for the store to hand down.
            self._keep_orphans(results)
            release_all([r.stored.lease for r in results if r.stored is not None])
            release_all(dropped_leases)
            raise
        release_all(dropped_leases)  # (a release takes this tier's lock)
        return results

    def _put_many_locked(self, items: list[tuple[bytes, BlockFrame]], results: list[TierPutResult],
                         dropped_leases: list[Lease | None], lease_stored: bool, room_for: int, spare: Container[bytes]) -> None:
        with self._lock:
            self._forget_landed()
            self._make_room([(key, frame.nbytes) for key, frame in items], results, room_for, spare)
            copies = None  # device copies of this call, issued together
            try:
                for (key, frame), result in zip(items, results):
                    if key in self._records:
                        self._index.touch([key])
                        continue
                    try:
                        slot = self._reserve(frame.nbytes, result.evicted, spare)
                    except StorageError as exc:
                        self._stats.write_errors += not isinstance(exc, Spared)
                        result.error = exc
                        continue
                    view = slot.view(frame.nbytes)
                    try:
                        landing = _start_fill(frame, slot, view, copies)
                    except Exception as exc:  # a bad device buffer: this frame only
                        self._arena.free(slot)
                        self._stats.write_errors += 1
                        result.error = StorageError(f"{self.name} tier: copy into host memory failed: {exc}")
                        continue
                    except BaseException:  # (an interrupt: the call ends, its slot with it)
                        self._arena.free(slot)
                        raise
                    sealed = frame.sealed and frame.host is not None
                    self._records[key] = rec = _Record(slot, frame.meta.without_packed_header(), sealed, landing)
                    if landing is not None:
                        self._landing[key] = rec
                        copies = landing
                    self._index.add(key, _info(frame.meta))
                    self._stats.bytes_in += frame.nbytes
                    self._stats.admissions += 1
                    result.stored = BlockFrame(frame.meta, host=view, sealed=sealed,
                                               lease=self._arena.lease(slot, frame.nbytes) if lease_stored else None)
            finally:
                if copies is not None:
                    try:
                        copies.issue()
                    except Exception as exc:
                        dropped = self._drop_landing(copies)
                        for (key, _), result in zip(items, results):
                            if key in dropped:
                                if result.stored is not None:
                                    dropped_leases.append(result.stored.lease)
                                result.stored = None
                                result.error = StorageError(f"{self.name} tier: copy into host memory failed: {exc}")
            self._sync_counts()

    def settle(self) -> set[bytes]:
        """Wait until every frame put so far is in host memory; the keys of those whose
        copies failed (each dropped and counted as a write error)."""
        failed = set()
        with self._lock:
            for key in list(self._landing):
                rec = self._records.get(key)
                if rec is not None and not self._landed(key, rec):
                    failed.add(key)
            self._landing.clear()
            self._sync_counts()
        return failed

    def _landed(self, key: bytes, rec: _Record) -> bool:
        """Wait for ``rec``'s device copies. False (and the record dropped) if they failed."""
        if rec.landing is None:
            return True
        try:
            rec.landing.wait()
        except Exception:
            self._records.pop(key, None)
            self._landing.pop(key, None)
            self._index.remove(key)
            self._arena.free(rec.slot)
            self._stats.write_errors += 1
            return False
        rec.landing = None
        self._landing.pop(key, None)
        return True

    def _drop_landing(self, landing: Any) -> set[bytes]:
        """Drop every record filled by ``landing`` (its copies could not be issued)."""
        dropped = set()
        for key, rec in list(self._landing.items()):
            if rec.landing is landing:
                rec.landing = None
                self._landing.pop(key)
                self._records.pop(key)
                self._index.remove(key)
                self._arena.free(rec.slot)
                self._stats.write_errors += 1
                dropped.add(key)
        return dropped

    def _forget_landed(self) -> None:
        """Drop finished landings, so later reads skip their waits."""
        for key, rec in list(self._landing.items()):
            if rec.landing is None or rec.landing.done():
                rec.landing = None
                del self._landing[key]

    def _reserve(self, nbytes: int, evicted: list[tuple[bytes, BlockFrame | None]],
                 spare: Container[bytes] = ()) -> Slot:
        """A slot for ``nbytes``, evicting blocks (into ``evicted``; none of ``spare``) until
        the budget and the arena have room."""
        if nbytes > self.capacity_bytes:
            raise StorageError(f"{self.name} tier: a {nbytes}-byte frame exceeds the whole budget ({self.capacity_bytes})")
        if not self._fits_beside_pins(nbytes):
            raise self._no_room(nbytes)
        while self._index.used_bytes + nbytes > self.capacity_bytes and (gone := self._evict_one(spare)) is not None:
            evicted += gone
        if self._index.used_bytes + nbytes > self.capacity_bytes:
            raise self._spared(nbytes) if strict(spare) else self._no_room(nbytes)
        slot = self._arena.allocate(nbytes)
        if slot is None and (self._victim_makes_room(nbytes, spare)
                             or self._arena.could_fit(nbytes, self._evictable_slots(spare))):
            while slot is None and (gone := self._evict_one(spare)) is not None:
                evicted += gone
                slot = self._arena.allocate(nbytes)
        if slot is None:
            capped = f"; host memory short: {self._arena.capped}" if self._arena.capped is not None else ""
            if _aligned(nbytes) > self._arena.chunk_bytes:
                raise StorageError(
                    f"{self.name} tier: a {nbytes}-byte frame is larger than the tier's largest slot (its chunks "
                    f"of {self._arena.chunk_bytes} bytes) and the budget is mapped already in smaller chunks: build "
                    f"the tier with chunk_bytes at least the largest frame (TierConfig.build's max_frame_bytes), "
                    f"or use smaller blocks (block_tokens){capped}")
            raise StorageError(
                f"{self.name} tier: no contiguous room for a {nbytes}-byte frame "
                f"(chunk {self._arena.chunk_bytes} bytes; {self._arena.held} evicted slots still leased, "
                f"{self._reserved_bytes} bytes reserved for frames arriving{capped})"
            )
        return slot

    def _victim_makes_room(self, nbytes: int, spare: Container[bytes] = ()) -> bool:
        """Whether evicting the next victim alone gives ``nbytes`` of room: its slot is as
        large and no reader leases it. The common case of a full tier whose chunks end in a
        gap no frame fits (the budget counts frames, the arena whole chunks), where
        ``could_fit``'s walk over every slot cost each put time in proportion to the tier."""
        victim = self._index.victim(spare)
        rec = self._records.get(victim) if victim is not None else None
        return rec is not None and not rec.slot.leases and not rec.slot.freed and rec.slot.nbytes >= _aligned(nbytes)

    def _evictable_slots(self, spare: Container[bytes] = ()) -> list[Slot]:
        pinned = self._index.is_pinned
        spare = strict(spare)  # (a soft spare's blocks are evicted too, once nothing else is left)
        return [rec.slot for key, rec in self._records.items() if not pinned(key) and key not in spare]

    def _evict_one(self, spare: Container[bytes] = ()) -> list[tuple[bytes, BlockFrame | None]] | None:
        victim = self._index.victim(spare)
        if victim is None:
            return None
        rec = self._records[victim]
        if not self._landed(victim, rec):
            return []  # dropped: its copy failed, so there is nothing to demote
        del self._records[victim]
        self._index.remove(victim, evicted=True)
        self._stats.evictions += 1
        frame = None
        if self.demote_evicted:
            # The move to the next tier takes a copy, not the slot: the slot is free for the
            # frame being made room for now, rather than after the demotion (disk I/O) ends.
            frame = BlockFrame(rec.meta, host=memoryview(bytearray(rec.slot.view(rec.meta.nbytes))), sealed=rec.sealed)
        self._arena.free(rec.slot)
        return [(victim, frame)]

    # -- reads -------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockFrame | None:
        """The frame in its slot, with a ``lease`` on the slot: the caller releases it
        (``frame.release()``, or ``with frame:``) once done with the bytes. Until then the
        slot is not reused, even if the block is evicted or deleted meanwhile."""
        return self._read(key, counted=True)

    def peek(self, key: bytes) -> BlockFrame | None:
        return self._read(key, counted=False)

    def _read(self, key: bytes, *, counted: bool) -> BlockFrame | None:
        with self._lock:
            rec = self._records.get(key)
            if rec is None or not self._landed(key, rec):
                self._stats.misses += counted
                return None
            if counted:
                self._stats.hits += 1
                self._stats.bytes_out += rec.meta.nbytes
            return BlockFrame(rec.meta, host=rec.slot.view(rec.meta.nbytes), sealed=rec.sealed,
                              lease=self._arena.lease(rec.slot, rec.meta.nbytes), host_address=rec.slot.address)

    def get_many(self, keys: list[bytes]) -> list[BlockFrame | None]:
        """``get`` of each key under one lock (a stream asks 16 at a time); each frame leased."""
        out: list[BlockFrame | None] = []
        with self._lock:
            for key in keys:
                rec = self._records.get(key)
                if rec is None or not self._landed(key, rec):
                    self._stats.misses += 1
                    out.append(None)
                    continue
                self._stats.hits += 1
                self._stats.bytes_out += rec.meta.nbytes
                out.append(BlockFrame(rec.meta, host=rec.slot.view(rec.meta.nbytes), sealed=rec.sealed,
                                      lease=self._arena.lease(rec.slot, rec.meta.nbytes), host_address=rec.slot.address))
        return out

    def delete(self, key: bytes) -> bool:
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return False
            if not self._landed(key, rec):
                return True  # dropped there
            del self._records[key]
            self._index.remove(key)
            self._arena.free(rec.slot)
            self._sync_counts()
            return True

    def close(self) -> None:
        self.settle()  # the arena's memory must outlive the copies into it

    def _extra(self) -> dict:
        return {"pinned": self._arena.pinned, "arena_bytes": self._arena.reserved_bytes, "arena_capped": self._arena.capped,
                "reservation_bytes": self._reserved_bytes, **self._arena.lease_stats()}

    @property
    def host_mapped(self) -> bool:
        """Whether every slot is in pinned memory, mapped into the GPUs' address space: a
        kernel may read a frame where it is (``kernels.copy_ranges``)."""
        return self._arena.pinned

    def lease_stats(self) -> dict[str, int]:
        """Leases on this tier's slots: active, bytes, granted, double releases, and the
        slots evicted while leased (``held_slots``, ``held_bytes``)."""
        with self._lock:
            return self._arena.lease_stats()

    # -- frames written in place (the server receives a request body straight into a slot) --

    def reserve(self, nbytes: int) -> Reservation | None:
        """A slot for a frame of ``nbytes``, found without evicting anything: a frame that
        turns out bad must change nothing stored. None when the budget plus ``reserve_bytes``
        (counting other reservations) or the arena has no room; the caller then goes through
        ``put``, which makes room. Only a tier whose budget is all mapped (a full cache) maps
        more for a reservation, into the reserve: the arena never maps more than the budget
        and the reserve together, and a tier with room never grows for a frame not yet good."""
        run = self.reserve_run(nbytes, 1)
        return run[0] if run is not None else None

    def reserve_run(self, nbytes: int, count: int, *, grow: bool = False,
                    partial: bool = False) -> list[Reservation] | None:
        """Like :meth:`reserve`, for ``count`` frames of ``nbytes`` in slots laid end to end
        at ``arena.slot_stride(nbytes)`` (one device copy fills them all), or None. ``grow``
        lets the arena map memory for them, up to the budget and the reserve together (for
        a caller whose frames are good unless its own device says otherwise: nothing else
        is lost if they are not). ``partial``: fewer than ``count`` when that is all the
        budget or the arena's contiguous room lends now (None only for none at all)."""
        with self._lock:
            limit = self.capacity_bytes + self.reserve_bytes
            if partial:
                count = min(count, (limit - self._index.used_bytes - self._reserved_bytes) // max(nbytes, 1))
            if count < 1 or self._index.used_bytes + self._reserved_bytes + nbytes * count > limit:
                return None
            # Frames that may be held for long (a server receiving from a slow client) get only
            # the arena's room beyond the budget (the reserve, and whatever a chunk rounded past
            # it): a whole budget of stored blocks always fits beside them, so a put never evicts
            # for a reservation while the budget has room.
            lendable = self._arena.limit_bytes - self.capacity_bytes
            if not grow and partial:
                count = min(count, (lendable - self._reserved_bytes) // _aligned(nbytes))
            if count < 1 or not grow and self._reserved_bytes + _aligned(nbytes) * count > lendable:
                return None
            grow = grow or self.reserve_bytes > 0 and self._arena.reserved_bytes >= self.capacity_bytes
            slots = self._arena.allocate_run(nbytes, count, grow=grow, partial=partial)
            if slots is None:
                return None
            self._reserved_bytes += sum(slot.nbytes for slot in slots)
            return [Reservation(nbytes, slot) for slot in slots]

    def commit(self, key: bytes, reservation: Reservation, meta: FrameMeta) -> TierPutResult:
        """Publish a reservation filled with the whole (checked, sealed) frame ``meta``
        describes. ``put`` does not count reservations, so it may have used their room since:
        blocks are evicted now, as ``put`` would have. A key stored meanwhile keeps its
        frame, and the reservation is given back."""
        return self.commit_many([(key, reservation, meta)])[0]

    def commit_many(self, items: list[tuple[bytes, Reservation, FrameMeta]], *, sealed: bool = True,
                    landing: Any = None, room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """:meth:`commit` for several frames, in order, under one lock. ``sealed=False``:
        the frames' checksums are still zero (computed when they leave memory).
        ``landing``: device copies into the frames' payloads still in flight (``wait()``,
        ``done()``, as ``device.HostCopies``); reads, evictions and deletes of these frames
        wait for it first, as for frames put from a device. ``room_for``: bytes of the
        caller's later commits (the rest of one ingest), evicted for now as well, so that
        they do not evict these (see ``_make_room``). ``spare``: blocks not to evict (a frame
        that does not fit without them is given back, its error ``Spared``)."""
        for _, reservation, meta in items:
            if meta.nbytes != reservation.nbytes:
                raise RuntimeError(f"{self.name} tier: a {meta.nbytes}-byte frame in a {reservation.nbytes}-byte reservation")
        results = [TierPutResult(stored=None) for _ in items]
        try:
            return self._commit_many_locked(items, results, sealed, landing, room_for, spare)
        except BaseException:
            self._keep_orphans(results)  # (an interrupt: see ``put_many``)
            raise

    def _keep_orphans(self, results: list[TierPutResult]) -> None:
        with self._lock:
            self._orphans.extend(victim for result in results for victim in result.evicted)

    def take_orphans(self) -> list[tuple[bytes, BlockFrame | None]]:
        with self._lock:
            orphans, self._orphans = self._orphans, []
        return orphans

    def _commit_many_locked(self, items: list[tuple[bytes, Reservation, FrameMeta]], results: list[TierPutResult],
                            sealed: bool, landing: Any, room_for: int, spare: Container[bytes]) -> list[TierPutResult]:
        with self._lock:
            if landing is not None:
                self._forget_landed()  # (the earlier calls' last pieces: their records stay few)
            self._make_room([(key, meta.nbytes) for key, _, meta in items], results, room_for, spare)
            for (key, reservation, meta), result in zip(items, results):
                slot = self._take_back(reservation)
                if key in self._records:
                    self._index.touch([key])
                    self._free_landed(slot, landing)
                    continue
                if self._fits_beside_pins(meta.nbytes):
                    while self._index.used_bytes + meta.nbytes > self.capacity_bytes and \
                            (gone := self._evict_one(spare)) is not None:
                        result.evicted += gone
                # Still past the budget with nothing left to evict: pinned or spared blocks, or
                # a frame larger than the whole budget (a reservation may hold one: it lends the reserve).
                if self._index.used_bytes + meta.nbytes > self.capacity_bytes:
                    self._free_landed(slot, landing)
                    if meta.nbytes > self.capacity_bytes:
                        result.error = StorageError(f"{self.name} tier: a {meta.nbytes}-byte frame exceeds the "
                                                    f"whole budget ({self.capacity_bytes})")
                    elif strict(spare) and self._fits_beside_pins(meta.nbytes):
                        result.error = self._spared(meta.nbytes)
                    else:
                        result.error = self._no_room(meta.nbytes)
                    self._stats.write_errors += not isinstance(result.error, Spared)
                    continue
                self._records[key] = rec = _Record(slot, meta.without_packed_header(), sealed, landing)
                if landing is not None:
                    self._landing[key] = rec
                self._index.add(key, _info(meta))
                self._stats.bytes_in += meta.nbytes
                self._stats.admissions += 1
                result.stored = BlockFrame(meta, host=slot.view(meta.nbytes), sealed=sealed)
            self._sync_counts()
        return results

    def _free_landed(self, slot: Slot, landing: Any) -> None:
        """Give back a slot not published, once no device copy still writes into it (a
        commit in flight of a key stored meanwhile, or refused for room: rare, so waited
        for here rather than kept for later)."""
        if landing is not None:
            with contextlib.suppress(Exception):  # a failed copy writes nothing more
                landing.wait()
        self._arena.free(slot)

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation back unpublished (a bad frame, a client gone); idempotent."""
        with self._lock:
            if reservation.slot is not None:
                self._arena.free(self._take_back(reservation))

    def release_free(self) -> int:
        """Hand the pages of the arena's free memory back to the OS (after a burst of
        aborted reservations, say); they are faulted in again when reused. Returns bytes."""
        with self._lock:
            return self._arena.release_free()

    def _take_back(self, reservation: Reservation) -> Slot:
        slot, reservation.slot = reservation.slot, None
        if slot is None:
            raise RuntimeError(f"{self.name} tier: this reservation was already committed or aborted")
        self._reserved_bytes -= slot.nbytes
        return slot



def _info(meta: FrameMeta) -> BlockInfo:
    return BlockInfo(nbytes=meta.nbytes, raw_nbytes=meta.raw_nbytes, parent=meta.parent_hash, position=meta.position)


def _start_fill(frame: BlockFrame, slot: Slot, view: memoryview, copies: Any) -> Any:
    """Write a frame into its slot's ``view``. Host bytes are copied before this returns
    (None). Device buffers are queued on ``copies`` (a ``device.HostCopies``, made when
    None), which is returned: the slot is filled once it has landed."""
    if frame.host is not None:
        if frame.sealed_prefix is not None:
            view[: len(frame.sealed_prefix)] = frame.sealed_prefix
            view[len(frame.sealed_prefix) :] = frame.payload_view()
        else:
            view[:] = memoryview(frame.host).cast("B")
        return None
    if copies is None:
        from .device import HostCopies

        copies = HostCopies()
    view[: frame.meta.payload_offset] = header_prefix(frame.meta)
    copies.add(frame, view, slot.torch_view(frame.nbytes))
    return copies
