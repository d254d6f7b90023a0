"""The ``cpu`` tier: frames in host memory (pinned when a GPU reads them), under a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StorageError
from .arena import HostArena, Slot
from .frame import FrameMeta, header_prefix
from .tier import BlockFrame, BlockInfo, IndexedTier, PutResult, Reservation


@dataclass(slots=True)
class _Record:
    slot: Slot
    meta: FrameMeta
    sealed: bool


class CpuTier(IndexedTier):
    """Host-memory tier. Frames fresh from a device encoder are copied straight from the
    device into their slot (one copy, no staging) and stay unsealed: their checksum is
    computed only when they leave memory (disk, Redis, HTTP)."""

    accepts_device_frames = True

    def __init__(self, capacity_bytes: int, *, pin: bool = False, name: str = "cpu", chunk_bytes: int = 1 << 30):
        super().__init__(name, capacity_bytes)
        self._arena = HostArena(capacity_bytes, pin=pin, chunk_bytes=chunk_bytes)
        self._records: dict[bytes, _Record] = {}
        self._reserved_bytes = 0  # slots lent out by reserve(), not yet committed or aborted

    # -- writes ------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> PutResult:
        result = self.put_many([(key, frame)])[0]
        if result.error is not None:
            raise result.error
        return result

    def put_many(self, items: list[tuple[bytes, BlockFrame]]) -> list[PutResult]:
        """Store several frames. Each frame's device copy starts as soon as its slot is
        reserved, so bookkeeping overlaps the transfers; a group is waited on once (a group
        holds at most half the budget, so later frames can still evict earlier ones). A
        frame that cannot be stored gets ``error`` set; the others proceed."""
        results = [PutResult(stored=None) for _ in items]
        with self._lock:
            pending: list[tuple[bytes, BlockFrame, Slot, PutResult]] = []
            pending_keys: set[bytes] = set()
            pending_bytes = 0
            devices: set = set()
            for (key, frame), result in zip(items, results):
                if key in self._records or key in pending_keys:
                    self._index.touch([key])
                    continue
                if pending and pending_bytes + frame.nbytes > self.capacity_bytes // 2:
                    self._finish(pending, devices)
                    pending, pending_keys, pending_bytes, devices = [], set(), 0, set()
                try:
                    slot = self._reserve(frame.nbytes, result.evicted, pending_bytes)
                except StorageError as exc:
                    self._stats.write_errors += 1
                    result.error = exc
                    continue
                try:
                    devices |= _start_fill(frame, slot)
                except Exception as exc:  # a failed device copy: this frame only
                    self._arena.free(slot)
                    self._stats.write_errors += 1
                    result.error = StorageError(f"{self.name} tier: copy into host memory failed: {exc}")
                    continue
                pending.append((key, frame, slot, result))
                pending_keys.add(key)
                pending_bytes += slot.nbytes
            self._finish(pending, devices)
            self._sync_counts()
        return results

    def _finish(self, pending: list[tuple[bytes, BlockFrame, Slot, PutResult]], devices: set) -> None:
        """Wait for a group's device copies, then publish its frames."""
        if devices:
            from .device import wait_for

            try:
                wait_for(devices)
            except Exception as exc:
                for _, _, slot, result in pending:
                    self._arena.free(slot)
                    result.error = StorageError(f"{self.name} tier: copy into host memory failed: {exc}")
                self._stats.write_errors += len(pending)
                return
        for key, frame, slot, result in pending:
            sealed = frame.sealed and frame.host is not None
            self._records[key] = _Record(slot, frame.meta, sealed)
            self._index.add(key, _info(frame.meta))
            self._stats.bytes_in += frame.nbytes
            result.stored = BlockFrame(frame.meta, host=slot.view(frame.nbytes), sealed=sealed)

    def _reserve(self, nbytes: int, evicted: list[tuple[bytes, BlockFrame | None]], pending_bytes: int) -> Slot:
        """A slot for ``nbytes``, evicting LRU blocks (into ``evicted``) until the budget
        (counting ``pending_bytes`` reserved but not yet committed) and the arena have room."""
        if nbytes > self.capacity_bytes:
            raise StorageError(f"{self.name} tier: a {nbytes}-byte frame exceeds the whole budget ({self.capacity_bytes})")
        while self._index.used_bytes + pending_bytes + nbytes > self.capacity_bytes and len(self._index):
            evicted += self._evict_one()
        slot = self._arena.allocate(nbytes)
        while slot is None and len(self._index):
            evicted += self._evict_one()
            slot = self._arena.allocate(nbytes)
        if slot is None:
            raise StorageError(
                f"{self.name} tier: no contiguous room for a {nbytes}-byte frame "
                f"(chunk {self._arena.chunk_bytes} bytes; {self._arena.zombies} slots still being read)"
            )
        return slot

    def _evict_one(self) -> list[tuple[bytes, BlockFrame | None]]:
        victim = next(self._index.oldest(), None)
        if victim is None:
            return []
        rec = self._records.pop(victim)
        self._index.remove(victim)
        self._stats.evictions += 1
        frame = BlockFrame(rec.meta, host=rec.slot.view(rec.meta.nbytes), sealed=rec.sealed) if self.demote_evicted else None
        self._arena.free(rec.slot)  # a zombie until `frame` (if any) is dropped
        return [(victim, frame)]

    # -- reads -------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockFrame | None:
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._stats.bytes_out += rec.meta.nbytes
            return BlockFrame(rec.meta, host=rec.slot.view(rec.meta.nbytes), sealed=rec.sealed)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is None:
                return False
            self._index.remove(key)
            self._arena.free(rec.slot)
            self._sync_counts()
            return True

    def _extra(self) -> dict:
        return {"pinned": self._arena.pinned, "arena_bytes": self._arena.reserved_bytes,
                "zombie_slots": self._arena.zombies, "reservation_bytes": self._reserved_bytes}

    # -- frames written in place (the server receives a request body straight into a slot) --

    def reserve(self, nbytes: int) -> Reservation | None:
        """A slot for a frame of ``nbytes``, found without evicting anything or growing the
        arena: a frame that turns out bad must change nothing. None when the budget
        (counting other reservations) or the memory already mapped has no room; the caller
        then goes through ``put``, which makes room."""
        with self._lock:
            if self._index.used_bytes + self._reserved_bytes + nbytes > self.capacity_bytes:
                return None
            slot = self._arena.allocate(nbytes, grow=False)
            if slot is None:
                return None
            self._reserved_bytes += slot.nbytes
            return Reservation(nbytes, slot)

    def commit(self, key: bytes, reservation: Reservation, meta: FrameMeta) -> PutResult:
        """Publish a reservation filled with the whole (checked, sealed) frame ``meta``
        describes. ``put`` does not count reservations, so it may have used their room since:
        LRU blocks are evicted now, as ``put`` would have. A key stored meanwhile keeps its
        frame, and the reservation is given back."""
        if meta.nbytes != reservation.nbytes:
            raise RuntimeError(f"{self.name} tier: a {meta.nbytes}-byte frame in a {reservation.nbytes}-byte reservation")
        result = PutResult(stored=None)
        with self._lock:
            slot = self._take_back(reservation)
            if key in self._records:
                self._index.touch([key])
                self._arena.free(slot)
                return result
            while self._index.used_bytes + meta.nbytes > self.capacity_bytes and len(self._index):
                result.evicted += self._evict_one()
            self._records[key] = _Record(slot, meta, True)
            self._index.add(key, _info(meta))
            self._stats.bytes_in += meta.nbytes
            self._sync_counts()
            result.stored = BlockFrame(meta, host=slot.view(meta.nbytes), sealed=True)
        return result

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation back unpublished (a bad frame, a client gone); idempotent."""
        with self._lock:
            if reservation.slot is not None:
                self._arena.free(self._take_back(reservation))

    def _take_back(self, reservation: Reservation) -> Slot:
        slot, reservation.slot = reservation.slot, None
        if slot is None:
            raise RuntimeError(f"{self.name} tier: this reservation was already committed or aborted")
        self._reserved_bytes -= slot.nbytes
        return slot



def _info(meta: FrameMeta) -> BlockInfo:
    return BlockInfo(nbytes=meta.nbytes, raw_nbytes=meta.raw_nbytes, parent=meta.parent_hash, position=meta.position)


def _start_fill(frame: BlockFrame, slot: Slot) -> set:
    """Write a frame into its slot: host bytes by memcpy (done on return), device buffers by
    non-blocking copies straight into the (pinned) slot; returns the devices to wait on."""
    view = slot.view(frame.nbytes)
    if frame.host is not None:
        if frame.sealed_prefix is not None:
            view[: len(frame.sealed_prefix)] = frame.sealed_prefix
            view[len(frame.sealed_prefix) :] = frame.payload_view()
        else:
            view[:] = memoryview(frame.host).cast("B")
        return set()
    from .device import start_payload_copy

    view[: frame.meta.payload_offset] = header_prefix(frame.meta)
    return start_payload_copy(frame, view)
