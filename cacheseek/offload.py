"""GPU KV into the CPU tier in place: the embedded ingest path when the KV is on a GPU.

The blocks of a batch get a run of CPU-tier slots, reserved together (laid end to end at
one stride, nothing published yet). They are encoded on the GPU into a staging buffer
laid out exactly like that run, payloads at the same offsets, and ONE device-to-host copy
moves the whole run. Once it has landed and the codec's NaN/Inf flags have passed, each
slot gets its header and the run is committed. So a batch costs the host a reservation,
two kernel launches and a copy, not a copy and a put per block, and a bad input publishes
nothing (a full tier evicts only at commit, into its reserve: ``TierConfig.cpu_reserve_bytes``).

Batches are launched back to back, each once the one before it is queued: the copy engine
runs while the host plans the next batch and commits the last, and each batch's encoding
(on a side stream) overlaps the copy of the batch before it. The first batch is small, so
the first copy starts early.

    host    plan+reserve b0 | launch b0 | plan+reserve b1 | launch b1 | ... | commit b0 | ...
    encode              [k0]                        [k1]
    to_host                 [copy b0 ..........][copy b1 ....................]
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .block_io import encode_into, flags_to_host, plan_block, true_runs
from .errors import InputError
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .quant.tensors import TORCH_DTYPES
from .store.arena import slot_stride
from .store.device import reservation_span, work_stream
from .store.frame import FrameMeta, header_prefix, replan_frame
from .store.tier import Reservation
from .store.tiered import PutOutcome, TieredStore

FIRST_BATCH_BYTES = 128 << 20  # raw KV in the first batch: its encoding is the only one not hidden


def applies(store: TieredStore, device: torch.device) -> bool:
    """Whether an ingest of KV on ``device`` can go in place into ``store``'s top tier."""
    return device.type in ("cuda", "cpu") and store.tiers[0].lends_runs


def _payload_views(buf: torch.Tensor, meta: FrameMeta, count: int, stride: int) -> list[torch.Tensor]:
    """The codec's buffers of ``count`` frames laid out like ``meta`` at ``stride`` in ``buf``
    (which starts where the first frame does), as ``[count, ...]`` views."""
    typed: dict[torch.dtype, torch.Tensor] = {}  # one view of ``buf`` per dtype, not one per buffer
    out = []
    base = buf.storage_offset()
    for dtype, size, strides, offset in _view_plan(meta.tensors, meta.payload_offset, count, stride):
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buf.view(dtype)
        out.append(whole.as_strided(size, strides, base // dtype.itemsize + offset))
    return out


@functools.lru_cache(maxsize=256)
def _view_plan(tensors: tuple, payload_offset: int, count: int, stride: int) -> list[tuple]:
    """(dtype, size, strides, storage offset in elements) of each buffer's ``[count, ...]``
    view: worked out once per layout and count (it is most of a view's cost)."""
    plan = []
    for e in tensors:
        dtype = TORCH_DTYPES[e.dtype]
        item = dtype.itemsize
        inner = [1] * len(e.shape)
        for i in range(len(e.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * e.shape[i + 1]
        plan.append((dtype, (count, *e.shape), (stride // item, *inner), (payload_offset + e.offset) // item))
    return plan


@dataclass(slots=True)
class _Run:
    """Consecutive blocks in flight: encoded into staging, copied into their reservations."""

    first: int  # index of the first block in the call's chain
    metas: list[FrameMeta]
    reservations: list[Reservation]
    flags: Any  # the codec's validity flags, in host memory once ``landed`` has passed
    landed: torch.cuda.Event | None  # None: nothing in flight (KV in host memory)


class _Offload:
    def __init__(self, store: TieredStore, codec: KVLayerCodec, layout: KVLayout, block_tokens: int,
                 layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.store, self.codec, self.layout, self.block_tokens, self.layers = store, codec, layout, block_tokens, layers
        self.device = layers[0][0].device
        self.prepared = codec.prepare_layers([k for k, _ in layers], [v for _, v in layers])
        if self.device.type == "cuda":
            self.caller_stream = torch.cuda.current_stream(self.device)
            self.encode_stream = work_stream("encode", self.device)
            self.copy_stream = work_stream("to_host", self.device)
            self.encode_stream.wait_stream(self.caller_stream)  # the KV was made there
        self.pending: deque[_Run] = deque()
        self.outcomes: list[PutOutcome | None] = []
        self.committed: list[bytes] = []

    def launch(self, first: int, metas: list[FrameMeta], reservations: list[Reservation]) -> None:
        meta, count = metas[0], len(metas)
        stride = slot_stride(meta.nbytes)
        start, span = meta.payload_offset, (count - 1) * stride + meta.payload_nbytes
        host = reservation_span(reservations[0], 0, start + span)
        t0 = first * self.block_tokens
        if self.device.type != "cuda":
            # KV in host memory: the slots themselves are the staging, encoded in place.
            flags = encode_into(self.codec, self.layers, self.prepared, t0, count, self.block_tokens,
                                _payload_views(host, meta, count, stride))
            self.pending.append(_Run(first, metas, reservations, flags, None))
            return
        # set_stream, not stream contexts: a context costs ~20 µs, more than the copy's launch.
        torch.cuda.set_stream(self.encode_stream)
        try:
            staging = torch.empty(start + span, dtype=torch.uint8, device=self.device)
            flags = flags_to_host(encode_into(self.codec, self.layers, self.prepared, t0, count, self.block_tokens,
                                              _payload_views(staging, meta, count, stride)))
            encoded = torch.cuda.Event()
            encoded.record(self.encode_stream)
            # The slots' headers are copied over too (staging garbage between payloads): each
            # is written once the copy has landed, in commit_oldest().
            self.copy_stream.wait_event(encoded)
            torch.cuda.set_stream(self.copy_stream)
            host[start:].copy_(staging[start:], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.copy_stream)
        finally:
            torch.cuda.set_stream(self.caller_stream)
        staging.record_stream(self.copy_stream)  # freed now, reused only after the copy
        self.pending.append(_Run(first, metas, reservations, flags, landed))

    def commit_oldest(self) -> None:
        run = self.pending[0]
        if run.landed is not None:
            run.landed.synchronize()
        self.codec.check_finite(run.flags)
        self.pending.popleft()
        for meta, reservation in zip(run.metas, run.reservations):
            reservation.view()[: meta.payload_offset] = header_prefix(meta)
        # Tail first within the batch (as the chain's batches go): a chain that overflows
        # the tier loses its tail, not its head.
        order = range(len(run.metas) - 1, -1, -1)
        items = [(run.metas[i].block_hash, run.reservations[i], run.metas[i]) for i in order]
        for i, outcome in zip(order, self.store.commit_many(items, sealed=False)):
            self.outcomes[run.first + i] = outcome
            if outcome.stored:
                self.committed.append(run.metas[i].block_hash)

    def reserve(self, nbytes: int, count: int) -> list[Reservation] | None:
        """A run of ``count`` slots, committing landed batches to make room; fewer slots
        if the tier's memory is fragmented; None when not even one slot is free."""
        while True:
            got = self.store.reserve_run(nbytes, count, grow=True)
            if got is not None:
                return got
            if self.pending:
                self.commit_oldest()  # frees reservation room (and evicts, at commit)
            elif count > 1:
                count = (count + 1) // 2
            else:
                return None

    def abandon(self) -> None:
        """Give back every reservation not committed, once no copy writes into it."""
        while self.pending:
            run = self.pending.popleft()
            if run.landed is not None:
                with contextlib.suppress(Exception):  # a failed copy writes nothing more either
                    run.landed.synchronize()
            for reservation in run.reservations:
                self.store.abort(reservation)


def ingest_in_place(store: TieredStore, codec: KVLayerCodec, layout: KVLayout, block_tokens: int,
                    layers: list[tuple[torch.Tensor, torch.Tensor]], hashes: Sequence[bytes],
                    parents: Sequence[bytes], present: Sequence[bool], batch_blocks: int) -> list[PutOutcome | None]:
    """Store every block not ``present`` (see the module doc); the outcome of each block,
    None for those not handled here: already present, or no room could be reserved for
    them (the caller stores those through ``put_many``). Raises ``InputError`` on NaN or
    Inf, having published nothing of this call."""
    work = _Offload(store, codec, layout, block_tokens, layers)
    work.outcomes = [None] * len(hashes)
    missing = [not p for p in present]
    raw_block = layout.raw_nbytes(block_tokens)
    batches = list(true_runs(missing, batch_blocks))
    if not batches:
        return work.outcomes
    batches.reverse()  # the chain's end first
    if work.device.type == "cuda":
        batches = _growing(batches, max(1, FIRST_BATCH_BYTES // raw_block))
    first = batches[0][0]
    template = plan_block(codec, layout, block_tokens, block_hash=hashes[first], parent_hash=parents[first],
                          position=first)
    try:
        try:
            for start, stop in batches:
                metas = [replan_frame(template, block_hash=hashes[i], parent_hash=parents[i], position=i)
                         for i in range(start, stop)]
                stop -= start  # the batch's frames [0, stop) left to launch, its end first
                while stop > 0:
                    # Frames of a run share one size (a header grows a byte as positions grow).
                    size = metas[stop - 1].nbytes
                    lo = stop - 1
                    while lo > 0 and metas[lo - 1].nbytes == size:
                        lo -= 1
                    reservations = work.reserve(size, stop - lo)
                    if reservations is None:
                        raise _NoRoom
                    lo = stop - len(reservations)
                    work.launch(start + lo, metas[lo:stop], reservations)
                    stop = lo
        except _NoRoom:
            pass  # the blocks not launched are left to the caller
        while work.pending:
            work.commit_oldest()
    except BaseException as exc:
        work.abandon()
        if isinstance(exc, InputError):
            for key in work.committed:  # this call's earlier batches
                store.delete(key)
        raise
    return work.outcomes


def _growing(batches: list[tuple[int, int]], first: int) -> list[tuple[int, int]]:
    """``batches`` (tail first) with the first cut into batches of ``first`` blocks, then
    twice as many, and so on: the copy engine starts after a short encode, and each batch's
    copy lasts long enough for the host to launch the next (a launch costs the same for
    any size)."""
    start, stop = batches[0]
    out = []
    size = first
    while stop - start > size + size // 2:
        out.append((stop - size, stop))
        stop -= size
        size *= 2
    return [*out, (start, stop), *batches[1:]]


class _NoRoom(Exception):
    pass


__all__ = ["applies", "ingest_in_place"]
