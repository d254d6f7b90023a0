"""Layer-wise saves: a prompt's new blocks written into the CPU tier as the forward makes each layer.

``PrefixCache.ingest_layerwise(keys)`` returns a :class:`LayerwiseSave`. On the first
``put_layer`` (when the device and the prompt's length are known) it hashes the keys,
finds the blocks not stored yet and reserves CPU-tier slots for them (laid end to end in
runs, nothing published). Then each ``put_layer(i, k, v)`` encodes layer ``i`` of those
blocks and writes its slices straight into the slots: on a GPU, one encode launch per side
into a small staging buffer, then one ``kernels.store_ranges`` launch that stores every
block's slices of that layer through the slots' mapped addresses, all on a side stream
that waits only for the stream the layer was made on. The copies of layer ``i`` thus
overlap the forward of the layers after it, and ``finish()`` is left with the last layer's
work, the NaN/Inf check and the commit (headers, publication, eviction), not the encode
and copy of the whole prompt.

A block is published whole or not at all: nothing is visible before ``finish``, a bad
value (NaN, Inf) in any layer publishes nothing and evicts nothing, and ``abort()`` (or a
writer dropped unfinished) gives the slots back. Blocks the tier had no room to reserve
for (a full tier lends new blocks only its reserve, ``TierConfig.cpu_reserve_bytes``) are
stored at ``finish`` by a plain ``ingest`` of the layers, which are kept by reference.

It keeps the reference writer's behaviour (``layerwise.LayerwiseIngest``: every layer kept,
one ``ingest`` on ``finish``) where slots would not pay: no in-place top tier, KV on a GPU
without the Triton kernels, or less new KV than ``MIN_SAVE_BYTES``, where the launches per
layer (three for each run of slots) would cost the forward's host more than the save
they move out of ``finish``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from . import batching, ingest_in_place
from .encode import encode_into, flags_to_host
from .errors import InputError
from .layerwise import check_layer, missing_layers_error
from .quant.backend import kernels_available
from .quant.tensors import give_back_flags
from .results import IngestResult, count_outcome
from .staging import payload_views, staging_stride
from .store.arena import slot_stride
from .store.device import reservation_span
from .store.device_staging import staging_pool
from .store.frame import FrameMeta, TensorEntry, header_prefix
from .store.streams import on_stream, work_stream
from .store.tier import Reservation

# New raw KV below which a save keeps the layers and ingests them on ``finish``: the
# in-place ingest's smallest batch (``batching.MIN_BATCH_BYTES``), below which the host's
# fixed costs outweigh the copies they would overlap.
MIN_SAVE_BYTES = batching.MIN_BATCH_BYTES
LAYER_ALIGN = 16  # bytes: each buffer's slice starts aligned in a layer's staging row
# Programs of each layer's store_ranges launch: SMs held while its stores cross the link,
# taken from the forward it overlaps (benchmarks/layerwise_save.py --programs measures it).
STORE_PROGRAMS = 4


@dataclass(slots=True)
class _Run:
    """New blocks of one frame size and codec, in reserved slots laid end to end."""

    first: int  # the first block's index in the chain
    metas: list[FrameMeta]
    reservations: list[Reservation]
    host: torch.Tensor  # the slots as one host span, from the first slot's start
    stride: int  # bytes between the slots
    layer_entries: list[TensorEntry]  # one layer of each codec buffer, packed in a staging row
    layer_row: int  # bytes of that staging row (at its stride)
    table: Any = None  # on a GPU: (payload address, row) of each block, on the device
    # Each buffer's slice of layer i: (its offset in the staging row, its offset in the
    # payload at layer 0, its size, the step to layer i): the same for every layer and call.
    moves: tuple = ()


class LayerwiseSave:
    """See the module doc. ``put_layer(i, k, v)`` (any order), then ``finish()`` with every
    layer put; ``abort()`` stores nothing. The same interface as ``LayerwiseIngest``."""

    def __init__(self, cache: Any, keys: Any) -> None:
        self.cache, self.keys, self.layout = cache, keys, cache.layout
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.layout.num_layers
        self._tokens: int | None = None
        self._state = "open"
        self._mode: str | None = None  # "slots" or "reference", chosen on the first put_layer
        self._device: torch.device | None = None
        self._hashes: list[bytes] = []
        self._found: list[bool] = []  # stored already when the save started
        self._runs: list[_Run] = []
        self._flags: list[tuple[Any, Any]] = []  # (codec, validity flags) of every launch
        self._last: torch.cuda.Event | None = None  # the last layer's work on the save stream

    @property
    def mode(self) -> str | None:
        """``"slots"`` (each layer written into reserved slots as it is put), ``"reference"``
        (layers kept, one ``ingest`` on ``finish``), or None before the first ``put_layer``."""
        return self._mode

    # -- the writer ---------------------------------------------------------------------

    def put_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``i``'s K and V, ``[1, H, T, D]`` or ``[H, T, D]`` (T: the prompt's tokens,
        the same for every layer). Bad input raises ``InputError``; the writer stays usable
        (nothing of it was taken)."""
        if self._state != "open":
            raise RuntimeError(f"LayerwiseSave.put_layer: the writer is {self._state}")
        k, v = check_layer(i, k, v, self.layout, self._layers, self._tokens)
        if self._mode is None:
            self._start(k.device, k.shape[-2])
        elif k.device != self._device:
            raise InputError(f"layer {i}: on {k.device}, earlier layers are on {self._device}")
        self._tokens = k.shape[-2]
        self._layers[i] = (k, v)
        if self._mode == "slots":
            try:
                self._save_layer(i, k[0], v[0])
            except BaseException:
                self.abort()  # a launch that failed part way: its slots hold no whole layer
                raise

    @property
    def missing(self) -> list[int]:
        return [i for i, kv in enumerate(self._layers) if kv is None]

    def finish(self) -> IngestResult:
        """Publish the blocks and return the ``IngestResult``. A layer missing, or a NaN/Inf
        in any layer: ``InputError``, and nothing is stored."""
        if self._state != "open":
            raise RuntimeError(f"LayerwiseSave.finish: the writer is {self._state}")
        missing = self.missing
        if missing:
            self.abort()
            raise missing_layers_error(missing, len(self._layers))
        if self._mode == "reference":
            layers, self._layers = self._layers, [None] * len(self._layers)
            self._state = "finished"
            return self.cache.ingest(self.keys, layers)
        try:
            self._wait()
            for codec, flags in self._flags:
                codec.check_finite(flags)
        except BaseException:
            self.abort()
            raise
        if self._device.type == "cuda":
            for _, flags in self._flags:
                give_back_flags(flags)  # pinned, written by kernels that have run
        self._state = "finished"
        try:
            return self._commit()
        finally:
            self._give_back()
            self._layers = [None] * len(self._layers)

    def abort(self) -> None:
        """Drop every layer put and give the reserved slots back: nothing is stored. Idempotent."""
        if self._state == "open":
            self._state = "aborted"
        with contextlib.suppress(Exception):  # a failed launch writes nothing more either
            self._wait()
        self._give_back()
        self._layers = [None] * len(self._layers)

    def __enter__(self) -> LayerwiseSave:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._state == "open":
            self.abort()  # an exception, or left without finish(): nothing is stored

    def __del__(self) -> None:
        # A writer dropped unfinished (its forward raised) must not keep tier memory reserved.
        if getattr(self, "_runs", None) and self._state == "open":
            with contextlib.suppress(Exception):
                self.abort()

    # -- slots ----------------------------------------------------------------------------

    def _start(self, device: torch.device, tokens: int) -> None:
        """Choose the mode; for slots, reserve them for every new block that fits."""
        cache = self.cache
        cache.keys.check_ingest(self.keys, tokens)
        hashes = cache.block_hashes(self.keys)
        store, fmt = cache.store, cache.block_format
        found = store.present_many(hashes) if hashes else []
        new = len(hashes) - sum(found)
        self._device, self._hashes, self._found = device, hashes, found
        self._mode = "reference"
        if (not new or new * self.layout.raw_nbytes(cache.block_tokens) < MIN_SAVE_BYTES
                or not ingest_in_place.applies(store, device)
                or device.type == "cuda" and not kernels_available()
                or not all(_layer_sliceable(part.planned_payload(), self.layout.num_layers) for part in fmt.parts())):
            return
        parents = cache.keys.parents(hashes)
        try:
            # Tail first, as an ingest's batches go: where the tier runs out of room it is the
            # chain's head that is left to finish's ingest, and published last (most recent).
            for start, stop in reversed(list(batching.runs([not f for f in found], len(hashes)))):
                self._reserve(start, fmt.plan_run(start, hashes[start:stop], parents[start:stop]))
        except _NoRoom:
            pass
        except BaseException:
            self._give_back()
            raise
        if self._runs:
            self._mode = "slots"
            if device.type == "cuda":
                self._stream = work_stream("save", device)

    def _reserve(self, start: int, metas: list[FrameMeta]) -> None:
        stop = len(metas)
        while stop > 0:
            # A run holds frames of one size (a header grows a byte as positions grow) and
            # one codec (a precision policy changes it along the chain).
            size, codec = metas[stop - 1].nbytes, metas[stop - 1].codec
            lo = stop - 1
            while lo > 0 and metas[lo - 1].nbytes == size and metas[lo - 1].codec is codec:
                lo -= 1
            count, got = stop - lo, None
            while got is None and count:
                got = self.cache.store.reserve_run(size, count, grow=True)
                count //= 2
            if got is None:
                raise _NoRoom
            lo = stop - len(got)
            self._runs.append(self._run(start + lo, metas[lo:stop], got))
            stop = lo

    def _run(self, first: int, metas: list[FrameMeta], reservations: list[Reservation]) -> _Run:
        meta = metas[0]
        stride = slot_stride(meta.nbytes)
        host = reservation_span(reservations[0], 0, (len(metas) - 1) * stride + meta.nbytes)
        L, entries, offset = self.layout.num_layers, [], 0
        for e in meta.tensors:
            per_layer = e.nbytes // L
            entries.append(TensorEntry(e.name, e.dtype, (1, *e.shape[1:]), offset, per_layer))
            offset += -(-per_layer // LAYER_ALIGN) * LAYER_ALIGN
        run = _Run(first, metas, reservations, host, stride, entries, staging_stride(offset))
        run.moves = tuple((part.offset, whole.offset, part.nbytes, part.nbytes)
                          for part, whole in zip(entries, meta.tensors, strict=True))
        if self._device.type == "cuda":
            from .kernels.layers import offsets_table

            base = host.data_ptr() + meta.payload_offset
            pairs = tuple(x for j in range(len(metas)) for x in (base + j * stride, j))
            run.table = offsets_table(self._device, pairs).view(-1, 2)
        return run

    def _save_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode layer ``i`` (``[H, T, D]``) of every reserved block into its slots."""
        B = self.cache.block_tokens
        if self._device.type != "cuda":
            # KV in host memory: the slots themselves are encoded into.
            for run in self._runs:
                codec = self.cache.block_format.at(run.first).codec
                views = [view[:, i : i + 1] for view in payload_views(
                    run.host, run.metas[0].tensors, len(run.metas), run.stride, run.metas[0].payload_offset)]
                flags = encode_into(codec, [(k, v)], codec.prepare_layers([k], [v]), run.first * B, len(run.metas), B,
                                    views)
                self._flags.append((codec, flags))
            return
        from . import kernels

        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self._device))  # the forward made the layer there
        with on_stream(stream):
            for run in self._runs:
                codec = self.cache.block_format.at(run.first).codec
                n = len(run.metas)
                # Given back once the launches are queued: the next layer's take on this
                # stream reuses it after them, on the device.
                with staging_pool(self._device).take(n * run.layer_row, stream=stream) as lease:
                    rows = lease.rows(n, run.layer_row)
                    views = payload_views(rows, run.layer_entries, n, run.layer_row)
                    flags = encode_into(codec, [(k, v)], codec.prepare_layers([k], [v]), run.first * B, n, B, views)
                    self._flags.append((codec, flags_to_host(flags)))
                    kernels.store_ranges(rows, run.table, run.moves, step=i, programs=STORE_PROGRAMS)
            self._last = torch.cuda.Event()
            self._last.record(stream)

    def _wait(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def _commit(self) -> IngestResult:
        store, hashes = self.cache.store, self._hashes
        result = IngestResult(blocks=len(hashes), stored=0, present=sum(self._found),
                              tokens=len(hashes) * self.cache.block_tokens, durability=store.durability)
        stored: list[bytes] = []
        saved = [False] * len(hashes)
        for run in self._runs:  # tail first (reserved in that order)
            for reservation, meta in zip(run.reservations, run.metas):
                reservation.view()[: meta.payload_offset] = header_prefix(meta)
            items = [(meta.block_hash, reservation, meta) for reservation, meta in zip(reversed(run.reservations),
                                                                                        reversed(run.metas))]
            for (key, _, _), outcome in zip(items, store.commit_many(items, sealed=False)):
                count_outcome(result, key, outcome, stored)
            saved[run.first : run.first + len(run.metas)] = [True] * len(run.metas)
        if not all(s or f for s, f in zip(saved, self._found)):
            # Blocks no slot was reserved for: one ingest of the layers (it finds the blocks
            # just published present, and stores the rest).
            rest = self.cache.ingest(self.keys, self._layers)
            result.stored += rest.stored
            result.failed += rest.failed
            result.present = result.blocks - result.stored - result.failed
            for tier, reason in rest.errors.items():
                result.errors.setdefault(tier, reason)
        store.touch_chain([key for key, was in zip(hashes, self._found) if was])
        return result

    def _give_back(self) -> None:
        """Give back every slot not published (aborting a committed reservation is a no-op)."""
        runs, self._runs = self._runs, []
        for run in runs:
            for reservation in run.reservations:
                self.cache.store.abort(reservation)


def _layer_sliceable(meta: FrameMeta, num_layers: int) -> bool:
    """Whether each codec buffer of ``meta`` is ``[L, ...]`` with each layer's slice a whole
    number of 4-byte words (what ``store_ranges`` moves), starting word-aligned."""
    return all(e.shape[0] == num_layers and e.nbytes % (4 * num_layers) == 0 and e.offset % 4 == 0
               and meta.payload_offset % 4 == 0 for e in meta.tensors)


class _NoRoom(Exception):
    pass


__all__ = ["MIN_SAVE_BYTES", "STORE_PROGRAMS", "LayerwiseSave"]
