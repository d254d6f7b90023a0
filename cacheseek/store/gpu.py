"""The ``gpu`` tier: compact payloads kept in device memory (embedded mode only).

A hit costs a decode and nothing else: no copy crosses PCIe.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from ..errors import StorageError
from .device import payload_on_device
from .frame import FrameMeta
from .eviction import DEFAULT_POLICY, strict
from .tier import BlockFrame, BlockInfo, MemoryTier, TierPutResult


@dataclass(slots=True)
class _Record:
    payload: torch.Tensor
    meta: FrameMeta
    sealed: bool


class GpuTier(MemoryTier):
    accepts_device_frames = True

    def __init__(self, capacity_bytes: int, *, device: str | torch.device = "cuda", name: str = "gpu",
                 policy: str = DEFAULT_POLICY):
        super().__init__(name, capacity_bytes, policy=policy)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._records: dict[bytes, _Record] = {}

    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        result = TierPutResult(stored=None)
        with self._lock:
            self._put(key, frame, result)
        if result.error is not None:
            raise result.error
        return result

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, lease_stored: bool = False,
                 room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """As ``Tier.put_many``, with room made for all of the call's new frames (and
        ``room_for`` bytes more) before the first is added (``_make_room``), so that none of
        them is a victim of the next."""
        results = [TierPutResult(stored=None) for _ in items]
        with self._lock:
            self._make_room([(key, frame.nbytes) for key, frame in items], results, room_for, spare)
        for (key, frame), result in zip(items, results):
            with self._lock:
                self._put(key, frame, result, spare)
        return results

    def _put(self, key: bytes, frame: BlockFrame, result: TierPutResult, spare: Container[bytes] = ()) -> None:
        """Store one frame into ``result`` (under the lock). A frame refused after blocks were
        evicted for it (the device out of memory) keeps them in ``result.evicted``: raised
        with them, they would be in no tier, never handed down."""
        if key in self._records:
            self._index.touch([key])
            return
        if frame.nbytes > self.capacity_bytes:
            self._stats.write_errors += 1
            result.error = StorageError(f"{self.name} tier: a {frame.nbytes}-byte frame exceeds the budget "
                                        f"({self.capacity_bytes})")
            return
        if not self._fits_beside_pins(frame.nbytes):
            self._stats.write_errors += 1
            result.error = self._no_room(frame.nbytes)
            return
        while self._index.used_bytes + frame.nbytes > self.capacity_bytes and \
                (gone := self._evict_one(spare)) is not None:
            result.evicted += gone
        if self._index.used_bytes + frame.nbytes > self.capacity_bytes:
            if not strict(spare):
                self._stats.write_errors += 1
            result.error = self._spared(frame.nbytes) if strict(spare) else self._no_room(frame.nbytes)
            return
        try:
            payload = payload_on_device(frame, self.device)
        except torch.OutOfMemoryError as exc:
            self._stats.write_errors += 1
            result.error = StorageError(f"{self.name} tier: device out of memory: {exc}")
            return
        sealed = frame.sealed and frame.device_entries is None
        self._records[key] = _Record(payload, frame.meta, sealed)
        self._index.add(key, BlockInfo(frame.meta.nbytes, frame.meta.raw_nbytes, frame.meta.parent_hash, frame.meta.position))
        self._stats.bytes_in += frame.nbytes
        self._stats.admissions += 1
        self._sync_counts()
        result.stored = BlockFrame(frame.meta, device_payload=payload, sealed=sealed)

    def _evict_one(self, spare: Container[bytes] = ()) -> list[tuple[bytes, BlockFrame | None]] | None:
        victim = self._index.victim(spare)
        if victim is None:
            return None
        rec = self._records.pop(victim)
        self._index.remove(victim, evicted=True)
        self._stats.evictions += 1
        frame = BlockFrame(rec.meta, device_payload=rec.payload, sealed=rec.sealed) if self.demote_evicted else None
        return [(victim, frame)]

    def get(self, key: bytes) -> BlockFrame | None:
        return self._read(key, counted=True)

    def peek(self, key: bytes) -> BlockFrame | None:
        return self._read(key, counted=False)

    def _read(self, key: bytes, *, counted: bool) -> BlockFrame | None:
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                self._stats.misses += counted
                return None
            if counted:
                self._stats.hits += 1
                self._stats.bytes_out += rec.meta.nbytes
            return BlockFrame(rec.meta, device_payload=rec.payload, sealed=rec.sealed)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if self._records.pop(key, None) is None:
                return False
            self._index.remove(key)
            self._sync_counts()
            return True

    def _extra(self) -> dict:
        return {"device": str(self.device)}
