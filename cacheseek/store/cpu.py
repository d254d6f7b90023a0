"""The ``cpu`` tier: frames in host memory (pinned when a GPU reads them), under a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StorageError
from .arena import HostArena, Slot
from .frame import FrameMeta, header_prefix
from .tier import BlockFrame, BlockInfo, LruIndex, PutResult, Tier


@dataclass(slots=True)
class _Record:
    slot: Slot
    meta: FrameMeta
    sealed: bool


class CpuTier(Tier):
    """Host-memory tier. Frames fresh from a device encoder are copied straight from the
    device into their slot (one copy, no staging) and stay unsealed: their checksum is
    computed only when they leave memory (disk, Redis, HTTP)."""

    accepts_device_frames = True

    def __init__(self, capacity_bytes: int, *, pin: bool = False, name: str = "cpu", chunk_bytes: int = 256 << 20):
        super().__init__(name, capacity_bytes)
        self._arena = HostArena(capacity_bytes, pin=pin, chunk_bytes=chunk_bytes)
        self._index = LruIndex()
        self._records: dict[bytes, _Record] = {}

    # -- writes ------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> PutResult:
        result = self.put_many([(key, frame)])[0]
        if result.error is not None:
            raise result.error
        return result

    def put_many(self, items: list[tuple[bytes, BlockFrame]]) -> list[PutResult]:
        """Store several frames. Device copies are issued together and synchronized once
        per group (a group holds at most half the budget, so later frames of a batch can
        still evict earlier ones). A frame that cannot be stored gets ``error`` set."""
        results = [PutResult(stored=None) for _ in items]
        with self._lock:
            pending: list[tuple[bytes, BlockFrame, Slot, PutResult]] = []
            pending_keys: set[bytes] = set()
            pending_bytes = 0
            for (key, frame), result in zip(items, results):
                if key in self._records or key in pending_keys:
                    self._index.touch([key])
                    continue
                if pending and pending_bytes + frame.nbytes > self.capacity_bytes // 2:
                    self._commit(pending)
                    pending, pending_keys, pending_bytes = [], set(), 0
                try:
                    slot = self._reserve(frame.nbytes, result.evicted, pending_bytes)
                except StorageError as exc:
                    self._stats.write_errors += 1
                    result.error = exc
                    continue
                pending.append((key, frame, slot, result))
                pending_keys.add(key)
                pending_bytes += slot.nbytes
            self._commit(pending)
            self._sync_counts()
        return results

    def _commit(self, pending: list[tuple[bytes, BlockFrame, Slot, PutResult]]) -> None:
        try:
            _fill_slots([(frame, slot) for _, frame, slot, _ in pending])
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

    def info(self, key: bytes) -> BlockInfo | None:
        with self._lock:
            return self._index.get(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is None:
                return False
            self._index.remove(key)
            self._arena.free(rec.slot)
            self._sync_counts()
            return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._index.keys()

    def touch(self, keys) -> None:
        with self._lock:
            self._index.touch(keys)

    def _sync_counts(self) -> None:
        self._stats.used_bytes = self._index.used_bytes
        self._stats.raw_bytes = self._index.raw_bytes
        self._stats.blocks = len(self._index)
        self._stats.extra = {
            "pinned": self._arena.pinned,
            "arena_bytes": self._arena.reserved_bytes,
            "zombie_slots": self._arena.zombies,
        }

    def stats(self):
        with self._lock:
            self._sync_counts()
            return self._snapshot()


def _info(meta: FrameMeta) -> BlockInfo:
    return BlockInfo(nbytes=meta.nbytes, raw_nbytes=meta.raw_nbytes, parent=meta.parent_hash, position=meta.position)


def _fill_slots(copies: list[tuple[BlockFrame, Slot]]) -> None:
    """Write each frame into its slot: host bytes by memcpy, device buffers by one device
    copy per buffer straight into the (pinned) slot, all synchronized once at the end."""
    device_work = []
    for frame, slot in copies:
        view = slot.view(frame.nbytes)
        if frame.host is not None:
            if frame.sealed_prefix is not None:
                view[: len(frame.sealed_prefix)] = frame.sealed_prefix
                view[len(frame.sealed_prefix) :] = frame.payload_view()
            else:
                view[:] = memoryview(frame.host).cast("B")
        else:
            view[: frame.meta.payload_offset] = header_prefix(frame.meta)
            device_work.append((frame, view))
    if device_work:
        from .device import copy_payloads_to_host

        copy_payloads_to_host(device_work)
