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
value (NaN, Inf) in any layer stores nothing, and ``abort()`` (or a writer dropped
unfinished) gives the slots back. Blocks the tier had no room to reserve for (a full tier
lends new blocks only its reserve, ``TierConfig.cpu_reserve_bytes``) are stored at
``finish`` by a plain ``ingest`` of the layers, which are kept by reference. A bad value in
a block with a slot is found before anything is published, so it evicts nothing either;
one in a block without a slot is found by that ingest, after the slots' blocks were
published (evicting for them), which are then deleted again.

``PrefixCache.ingest_batch(requests, pages, layerwise=True)`` returns a
:class:`PagedLayerwiseSave`: the same for KV in an engine's pages, planned (checked,
hashed, reserved) when it is made, each ``put_layer(i)`` encoding layer ``i`` straight
from the pages, ``finish()`` returning one ``IngestResult`` per request.

Both keep the reference writer's behaviour (``layerwise.LayerwiseIngest``: every layer kept,
one ``ingest`` on ``finish``; paged: one ``ingest_batch``) where slots would not pay: no in-place top tier, KV on a GPU
without the Triton kernels, or less new KV than ``MIN_SAVE_BYTES``, where the launches per
layer (three for each run of slots) would cost the forward's host more than the save
they move out of ``finish``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from . import batching, ingest_in_place, paged_io
from .encode import encode_into, flags_to_host
from .errors import InputError
from .layerwise import LayerWriter, check_layer, check_layer_index, missing_layers_error
from .quant.backend import kernels_available
from .quant.tensors import give_back_flags
from .results import IngestResult, count_outcome, stored_prefix
from .staging import payload_views, staging_stride
from .store.arena import slot_stride
from .store.device import reservation_span
from .store.device_staging import staging_pool
from .store.frame import FrameMeta, TensorEntry, header_prefix
from .store.lease import finalizer
from .store.streams import current_stream, on_stream, work_stream
from .store.tier import Reservation

# New raw KV below which a save keeps the layers and ingests them on ``finish``: the
# in-place ingest's smallest batch (``batching.MIN_BATCH_BYTES``), below which the host's
# fixed costs outweigh the copies they would overlap.
MIN_SAVE_BYTES = batching.MIN_BATCH_BYTES
LAYER_ALIGN = 16  # bytes: each buffer's slice starts aligned in a layer's staging row
# Programs of each layer's store_ranges launch: SMs held while its stores cross the link,
# taken from the forward it overlaps (benchmarks/layerwise_save.py --programs measures it).
STORE_PROGRAMS = 4


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_at_a_time(method: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], _R]:
    """A writer's call under its lock: an ``abort()`` from another thread (a shutdown) gave
    the slots back while a ``put_layer`` was encoding into them, which then wrote into
    memory the tier could lend the next writer; now it waits for that layer."""

    @functools.wraps(method)
    def locked(self: Any, *args: _P.args, **kw: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kw)

    return locked


@dataclass(slots=True)
class _Run:
    """New blocks of one frame size and codec, in reserved slots laid end to end."""

    first: int  # the first block's row: its index in the chain (contiguous) or in the call's rows (paged)
    codec: Any
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


class _SlotWriter(LayerWriter):
    """What both layer-wise saves share: the reserved runs of slots, a layer's encode and
    store into them, the check and the commit."""

    def __init__(self, cache: Any) -> None:
        self._lock = threading.RLock()  # (``_one_at_a_time``)
        self.cache, self.layout = cache, cache.layout
        self._mode: str | None = None  # "slots" or "reference"
        self._device: torch.device | None = None
        self._runs: list[_Run] = []
        self._flags: list[tuple[Any, Any]] = []  # (codec, validity flags) of every launch
        self._last: torch.cuda.Event | None = None  # the last layer's work on the save stream
        self._layers_put: list[bool] = [False] * self.layout.num_layers
        finalizer.ready()  # (a finalizer cannot start the thread its ``abort`` may need)

    @property
    def mode(self) -> str | None:
        """``"slots"`` (each layer written into reserved slots as it is put), ``"reference"``
        (the whole save on ``finish``), or None before it is chosen."""
        return self._mode

    @property
    def missing(self) -> list[int]:
        return [i for i, put in enumerate(self._layers_put) if not put]

    @_one_at_a_time
    def abort(self) -> None:
        """Drop what was put and give the reserved slots back: nothing is stored. Idempotent;
        from another thread, it waits for a layer being written."""
        if self._state == "open":
            self._state = "aborted"
        with contextlib.suppress(Exception):  # a failed launch writes nothing more either
            self._wait()
        self._give_back()
        self._dropped()

    def _dropped(self) -> None:
        """Let go of the layers kept (the contiguous writer's)."""

    def _open_in_cache(self, what: str) -> None:
        """``_open``, and the cache not closed since the writer was made: a closed cache
        raises for every call, and its writers' slots then went on being written and
        committed (``finish`` reported blocks stored in a cache that was closed). The
        slots are given back first."""
        self._open(what)
        if self.cache._closed:
            self.abort()
            self.cache._check_open()

    def __del__(self) -> None:
        # A writer dropped unfinished (its forward raised) must not keep tier memory reserved.
        if getattr(self, "_runs", None) and self._state == "open":
            if finalizer.in_collection():  # (maybe in a thread holding the tier's lock: see ``Finalizer``)
                finalizer.submit(self.abort)
                return
            finalizer.run(self.abort)

    def _wants_slots(self, device: torch.device, new_blocks: int) -> bool:
        fmt = self.cache.block_format
        return (new_blocks * self.layout.raw_nbytes(self.cache.block_tokens) >= MIN_SAVE_BYTES
                and ingest_in_place.applies(self.cache.store, device)
                and (device.type != "cuda" or kernels_available())
                and all(_layer_sliceable(part.planned_payload(), self.layout.num_layers) for part in fmt.parts()))

    def _reserve_all(self, device: torch.device, hashes: Sequence[bytes], parents: Sequence[bytes],
                     new: list[bool], positions: list[int] | None) -> None:
        """Reserve slots for the ``new`` blocks, tail first (where the tier runs out of
        room, the head is left to ``finish``); the mode is "slots" if any were reserved."""
        self._device = device
        fmt = self.cache.block_format
        try:
            for start, stop in reversed(list(batching.runs(new, len(hashes)))):
                part = None if positions is None else positions[start:stop]
                self._reserve(start, fmt.plan_run(start, hashes[start:stop], parents[start:stop], part),
                              positions)
        except _NoRoom:
            pass
        except BaseException:
            self._give_back()
            raise
        if self._runs and device.type == "cuda" and not getattr(self.cache.store.tiers[0], "host_mapped", False):
            # ``store_ranges`` writes the slots from the device, which reaches only page-locked
            # host memory: into a tier of pageable memory (``pin_memory=False``) its stores
            # were illegal addresses, which end the process's CUDA context. Such a tier is
            # written by ``finish``'s ingest instead (copies, which take pageable memory).
            self._give_back()
        self._mode = "slots" if self._runs else "reference"
        if self._runs and device.type == "cuda":
            self._stream = work_stream("save", device)

    def _reserve(self, start: int, metas: list[FrameMeta], positions: list[int] | None) -> None:
        stop = len(metas)
        while stop > 0:
            # A run holds frames of one size (a header grows a byte as positions grow) and
            # one codec (a precision policy changes it along the chain).
            size, codec = metas[stop - 1].nbytes, metas[stop - 1].codec
            lo = stop - 1
            while lo > 0 and metas[lo - 1].nbytes == size and metas[lo - 1].codec is codec:
                lo -= 1
            # (A fragmented tier lends the longest run it has: the rest goes in other runs.)
            got = self.cache.store.reserve_run(size, stop - lo, grow=True, partial=True)
            if got is None:
                raise _NoRoom
            lo = stop - len(got)
            first = start + lo
            position = first if positions is None else positions[first]
            self._runs.append(self._run(first, self.cache.block_format.at(position).codec, metas[lo:stop], got))
            stop = lo

    def _run(self, first: int, codec: Any, metas: list[FrameMeta], reservations: list[Reservation]) -> _Run:
        meta = metas[0]
        stride = slot_stride(meta.nbytes)
        host = reservation_span(reservations[0], 0, (len(metas) - 1) * stride + meta.nbytes)
        L, entries, offset = self.layout.num_layers, [], 0
        for e in meta.tensors:
            per_layer = e.nbytes // L
            entries.append(TensorEntry(e.name, e.dtype, (1, *e.shape[1:]), offset, per_layer))
            offset += -(-per_layer // LAYER_ALIGN) * LAYER_ALIGN
        run = _Run(first, codec, metas, reservations, host, stride, entries, staging_stride(offset))
        run.moves = tuple((part.offset, whole.offset, part.nbytes, part.nbytes)
                          for part, whole in zip(entries, meta.tensors, strict=True))
        device = self._device
        assert device is not None  # (set by _reserve_all, which makes the runs)
        if device.type == "cuda":
            from .kernels.layers import offsets_table

            base = host.data_ptr() + meta.payload_offset
            pairs = tuple(x for j in range(len(metas)) for x in (base + j * stride, j))
            run.table = offsets_table(device, pairs).view(-1, 2)
        return run

    def _save_layer(self, i: int, encode: Callable[[_Run, list[torch.Tensor]], Any]) -> None:
        """Layer ``i`` of every reserved block into its slots; ``encode(run, views)`` encodes
        the run's blocks of that layer into ``views`` (``[n, 1, H, ...]``) and returns the
        codec's flags. A launch that fails aborts the writer (its slots hold no whole layer)."""
        device = self._device
        assert device is not None  # (set by _reserve_all: a layer is saved only into reserved slots)
        try:
            if device.type != "cuda":
                # KV in host memory: the slots themselves are encoded into.
                for run in self._runs:
                    views = [view[:, i : i + 1] for view in payload_views(
                        run.host, run.metas[0].tensors, len(run.metas), run.stride, run.metas[0].payload_offset)]
                    self._flags.append((run.codec, encode(run, views)))
                return
            from . import kernels

            stream = self._stream
            stream.wait_stream(current_stream(device))  # the forward made the layer there
            with on_stream(stream):
                for run in self._runs:
                    n = len(run.metas)
                    # Given back once the launches are queued: the next layer's take on this
                    # stream reuses it after them, on the device.
                    with staging_pool(device).take(n * run.layer_row, stream=stream) as lease:
                        rows = lease.rows(n, run.layer_row)
                        flags = encode(run, payload_views(rows, run.layer_entries, n, run.layer_row))
                        self._flags.append((run.codec, flags_to_host(flags)))
                        kernels.store_ranges(rows, run.table, run.moves, step=i, programs=STORE_PROGRAMS)
                self._last = torch.cuda.Event()
                self._last.record(stream)
        except BaseException:
            self.abort()
            raise

    def _wait(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def _check(self) -> None:
        """Before a commit: every layer put, the last one's work done, every flag good;
        else ``InputError`` and nothing stored."""
        missing = self.missing
        if missing:
            self.abort()
            raise missing_layers_error(missing, len(self._layers_put))
        try:
            self._wait()
            for codec, flags in self._flags:
                codec.check_finite(flags, self.layout.dtype)
        except BaseException:
            self.abort()
            raise
        if self._device is not None and self._device.type == "cuda":
            for _, flags in self._flags:
                give_back_flags(flags)  # pinned, written by kernels that have run

    def _publish(self, count: Callable[[int, Any], None], spare: Container[bytes]) -> list[int]:
        """Commit every run (tail first), ``count(row, outcome)`` for each block; which rows
        were in a run. ``spare``: the chain's stored prefix, never the commits' victims."""
        store = self.cache.store
        saved: list[int] = []
        # Each commit evicts for the runs after it too: they must not evict this one's blocks.
        later = sum(r.nbytes for run in self._runs for r in run.reservations)
        for run in self._runs:  # tail first (reserved in that order)
            later -= sum(r.nbytes for r in run.reservations)
            for reservation, meta in zip(run.reservations, run.metas):
                reservation.view()[: meta.payload_offset] = header_prefix(meta)
            rows = range(run.first + len(run.metas) - 1, run.first - 1, -1)
            items = [(meta.block_hash, reservation, meta) for reservation, meta in zip(reversed(run.reservations),
                                                                                        reversed(run.metas))]
            for row, outcome in zip(rows, store.commit_many(items, sealed=False, room_for=later, spare=spare)):
                count(row, outcome)
            saved += rows
        return saved

    def _give_back(self) -> None:
        """Give back every slot not published (aborting a committed reservation is a no-op)."""
        runs, self._runs = self._runs, []
        for run in runs:
            for reservation in run.reservations:
                self.cache.store.abort(reservation)


class LayerwiseSave(_SlotWriter):
    """See the module doc. ``put_layer(i, k, v)`` (any order), then ``finish()`` with every
    layer put; ``abort()`` stores nothing. The same interface as ``LayerwiseIngest``."""

    def __init__(self, cache: Any, keys: Any) -> None:
        super().__init__(cache)
        self.keys = keys
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.layout.num_layers
        self._tokens: int | None = None
        self._hashes: list[bytes] = []
        self._found: list[bool] = []  # stored already when the save started

    @_one_at_a_time
    def put_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``i``'s K and V, ``[1, H, T, D]`` or ``[H, T, D]`` (T: the prompt's tokens,
        the same for every layer). Bad input raises ``InputError``; the writer stays usable
        (nothing of it was taken)."""
        self._open_in_cache("put_layer")
        k, v = check_layer(i, k, v, self.layout, self._layers, self._tokens)
        if self._mode is None:
            try:
                self._start(k.device, k.shape[-2])
            except InputError as exc:  # (the prompt against this layer's tokens: name the layer)
                raise InputError(f"layer {i}: {exc}") from None
        elif k.device != self._device:
            raise InputError(f"layer {i}: on {k.device}, earlier layers are on {self._device}")
        self._tokens = k.shape[-2]
        self._layers[i] = (k, v)
        self._layers_put[i] = True
        if self._mode == "slots":
            B, k3, v3 = self.cache.block_tokens, k[0], v[0]
            self._save_layer(i, lambda run, views: encode_into(
                run.codec, [(k3, v3)], run.codec.prepare_layers([k3], [v3]), run.first * B, len(run.metas), B, views))

    @_one_at_a_time
    def finish(self) -> IngestResult:
        """Publish the blocks and return the ``IngestResult``. A layer missing, or a NaN/Inf
        in any layer: ``InputError``, and nothing is stored."""
        self._open_in_cache("finish")
        self._check()
        self._state = "finished"
        if self._mode == "reference":
            layers, self._layers = self._layers, [None] * len(self._layers)
            return self.cache.ingest(self.keys, layers)
        try:
            return self._commit()
        finally:
            self._give_back()
            self._dropped()

    def _dropped(self) -> None:
        self._layers = [None] * len(self._layers)

    def _start(self, device: torch.device, tokens: int) -> None:
        """Choose the mode; for slots, reserve them for every new block that fits."""
        cache = self.cache
        cache.keys.check_ingest(self.keys, tokens)
        hashes = cache.block_hashes(self.keys)
        found = cache.store.present_many(hashes) if hashes else []
        self._device, self._hashes, self._found = device, hashes, found
        self._mode = "reference"
        if self._wants_slots(device, len(hashes) - sum(found)):
            self._reserve_all(device, hashes, cache.keys.parents(hashes), [not f for f in found], None)

    def _commit(self) -> IngestResult:
        store, hashes = self.cache.store, self._hashes
        result = IngestResult(blocks=len(hashes), stored=0, present=sum(self._found),
                              tokens=len(hashes) * self.cache.block_tokens, durability=store.durability)
        # A use of the blocks stored already, before the commits make room, which spare the
        # chain's stored prefix (as in ``ingest``).
        store.touch_chain([key for key, was in zip(hashes, self._found) if was], count_use=False)
        stored: list[bytes] = []
        saved = set(self._publish(lambda row, outcome: count_outcome(result, hashes[row], outcome, stored),
                                  frozenset(hashes[: stored_prefix(self._found)])))
        if not all(row in saved or f for row, f in enumerate(_still_stored(store, hashes, self._found))):
            # Blocks no slot was reserved for, or stored when the save started and gone since:
            # one ingest of the layers (it finds the blocks just published present, and stores
            # the rest).
            gone = _published_gone(store, stored)
            with _undone_on_bad_input(store, stored):
                _add_rest(result, self.cache.ingest(self.keys, self._layers), gone)
        return result


class PagedLayerwiseSave(_SlotWriter):
    """``ingest_batch`` of KV in an engine's pages, layer by layer: ``put_layer(i)`` once the
    forward has written layer ``i`` of the requests' pages (on the current stream), then
    ``finish()`` -> one ``IngestResult`` per request. The requests are planned, hashed and
    their slots reserved when the writer is made (``PrefixCache.ingest_batch(...,
    layerwise=True)``); bad requests raise there, and nothing is reserved."""

    def __init__(self, cache: Any, requests: list[Any], pages: Any) -> None:
        super().__init__(cache)
        self.requests, self.pages = requests, pages  # the caller's PagedRequests
        planned = paged_io.requests_of(requests)
        call = paged_io.plan_ingest(cache.keys, self.layout, pages, planned, single=False,
                                    starts=paged_io.starts_of(requests))
        paged_io.hash_requests(call, cache.keys, planned)
        hashes, parents, positions = call.flat()
        self._found = paged_io.look_up_from_starts(call, hashes, cache.store.present_many)
        self._results, present, self._copies = paged_io.ingest_results(call, self._found, cache.store.durability)
        keep = [i for i, p in enumerate(present) if not p]
        every = call.every_row()
        call.use_rows([every[i] for i in keep])
        self._call, self._all_hashes = call, hashes
        self._hashes = [hashes[i] for i in keep]
        self._mode = "reference"
        if keep and self._wants_slots(pages.device, len(keep)):
            self._reserve_all(pages.device, self._hashes, [parents[i] for i in keep], [True] * len(keep),
                              [positions[i] for i in keep])

    @_one_at_a_time
    def put_layer(self, i: int) -> None:
        """Layer ``i`` of the requests' pages is written (by work queued on the current
        stream): encode and store it. Any order; each layer once."""
        self._open_in_cache("put_layer")
        i = check_layer_index(i, self._layers_put)
        self._layers_put[i] = True
        if self._mode == "slots":
            source, B = self._call.rows_source(), self.cache.block_tokens

            def encode(run: _Run, views: list[torch.Tensor]) -> Any:
                flags = run.codec.encode_pages_into(source, run.first, len(run.metas), B, views, layers=(i, i + 1))
                source.launched.append((run.first, len(run.metas), flags))
                return flags

            self._save_layer(i, encode)

    @_one_at_a_time
    def finish(self) -> list[IngestResult]:
        """Publish the blocks; one ``IngestResult`` per request. A layer missing, or a NaN/Inf
        in any block: ``InputError`` naming the request, and nothing of the call is stored."""
        self._open_in_cache("finish")
        try:
            self._check()
        except InputError as exc:
            paged_io.raise_bad_input(self._call, exc)
        self._state = "finished"
        if self._mode == "reference":
            return self._ingest()
        try:
            return self._commit()
        finally:
            self._give_back()

    def _ingest(self) -> list[IngestResult]:
        """One ``ingest_batch`` of the requests as they were when the writer was made (their
        checked page tables and hashes), not as the caller's list holds them now: an engine
        may reuse the list, or a page table in it, during the forward."""
        self.cache._check_open()
        return self.cache._ingest_paged([], self.pages, single=False, planned=self._call)

    def _commit(self) -> list[IngestResult]:
        call, results, hashes = self._call, self._results, self._hashes
        spare = paged_io.touch_found(self.cache.store, call, self._found)
        stored: list[bytes] = []
        published: list[list[bytes]] = [[] for _ in results]  # per request, the blocks its rows stored

        def count(row: int, outcome: Any) -> None:
            count_outcome(results[call.request_of(row)], hashes[row], outcome, stored, self._copies.get(hashes[row], ()))
            if outcome.stored:
                published[call.request_of(row)].append(hashes[row])

        saved = set(self._publish(count, spare))
        if len(saved) < len(hashes) or _still_stored(self.cache.store, self._all_hashes, self._found) != self._found:
            # Blocks no slot was reserved for, or stored when the save was planned and gone
            # since: one ingest_batch of the requests (it finds the blocks just published
            # present, and stores the rest).
            gone = [_published_gone(self.cache.store, keys) for keys in published]
            with _undone_on_bad_input(self.cache.store, stored):
                rests = self._ingest()
            for result, rest, n in zip(results, rests, gone):
                _add_rest(result, rest, n)
        return results


@contextlib.contextmanager
def _undone_on_bad_input(store: Any, stored: list[bytes]) -> Any:
    """Around the ingest of the blocks no slot was reserved for, which checks them only
    now: a NaN or Inf there deletes the blocks the slots have just published, so the call
    stores nothing (the blocks evicted for them stay evicted)."""
    try:
        yield
    except InputError:
        store.delete_quietly(stored, "the undo of a write with bad input")
        raise


def _still_stored(store: Any, hashes: Sequence[bytes], found: list[bool]) -> list[bool]:
    """Of the blocks ``found`` stored when the save started, those stored still: the forward
    ran meanwhile, and one evicted or deleted since is the save's to store again (counted
    present, it was left a gap before the blocks published after it)."""
    if not any(found):
        return found
    now = iter(store.present_many([key for key, was in zip(hashes, found) if was]))
    return [was and next(now) for was in found]


def _published_gone(store: Any, keys: list[bytes]) -> int:
    """How many of the blocks ``keys`` the slots have just published are gone again: a
    later commit of the same save made room by evicting them (a tier smaller than the
    chain)."""
    return len(keys) - sum(store.present_many(keys)) if keys else 0


def _add_rest(result: IngestResult, rest: IngestResult, gone: int) -> None:
    """Count into ``result`` (the slots' commit) the ingest of the blocks that got no slot.
    It looks at every block again: it finds the published ones present, so its stored
    blocks are new beside the slots', and it writes again those whose commit failed, so its
    failed blocks are all the save's (added to the commit's, a block that failed both times
    counted twice). ``gone``: published blocks evicted before it looked, which it counts
    itself, stored again or failed (added to the commit's, stored 9 of 8 blocks)."""
    result.stored += rest.stored - gone
    result.failed = rest.failed
    result.present = result.blocks - result.stored - result.failed
    for tier, reason in rest.errors.items():
        result.errors.setdefault(tier, reason)


def _layer_sliceable(meta: FrameMeta, num_layers: int) -> bool:
    """Whether each codec buffer of ``meta`` is ``[L, ...]`` with each layer's slice a whole
    number of 4-byte words (what ``store_ranges`` moves), starting word-aligned."""
    return all(e.shape[0] == num_layers and e.nbytes % (4 * num_layers) == 0 and e.offset % 4 == 0
               and meta.payload_offset % 4 == 0 for e in meta.tensors)


class _NoRoom(Exception):
    pass


__all__ = ["MIN_SAVE_BYTES", "STORE_PROGRAMS", "LayerwiseSave", "PagedLayerwiseSave"]
