"""KV into the CPU tier in place: the embedded ingest path (GPU KV; host KV the same way).

The blocks of a batch get a run of CPU-tier slots, reserved together (laid end to end at
one stride, nothing published yet). They are encoded on the GPU into a staging buffer
laid out exactly like that run, payloads at the same offsets, and one device-to-host copy
moves the whole run (two for a long run: the head end last and small). Once a piece has
landed and the codec's NaN/Inf flags have passed, each slot gets its header and is
committed. The call's last piece is copied frame by frame, payloads only, so its headers
can be written while it is in flight: it is committed without waiting for it, as a put of
device frames is (readers wait for the copy), and the call returns ~0.1-0.2 ms sooner,
the time a commit takes. So a batch costs the host a
reservation, two kernel launches and a copy, not a copy and a put per block, and a bad
input publishes nothing: a full tier evicts only at commit, having lent the call its
reserve (``TierConfig.cpu_reserve_bytes``), and every run launched is checked before the
first is committed. The first commit evicts for the whole call (``room_for``), so that no
later piece of it evicts an earlier one. A call larger than the reserve commits its first
runs for room before its last are encoded: before that first commit, the KV of the blocks
not launched yet is checked for NaN and Inf (a pass over it on its device), so that such
a value costs the tier nothing; so is KV beyond the magnitudes its codec always encodes
(``safe_magnitudes``: a KIVI group range beyond fp16 stats, say), which the codec's own
encode then judges. On the host, the slots themselves are encoded into.

The chain's last blocks are launched before the keys are known (``guess_tail``), so the
copy engine starts while the host hashes the prompt; later batches double in size
(``batching.growing``), each launched once the one before is queued, so its encoding (on
a side stream) overlaps the copy before it, and the host commits landed pieces while
later ones are copied.

    host    launch tail | hash, plan | reserve+launch b1 | ... | commit tail | commit b1 ...
    encode      [k0]                      [k1]
    to_host          [copy tail ...........][copy b1 ..........................]
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import batching
from .block_format import BlockFormat
from .encode import check_encodable, encode_into, flags_to_host
from .errors import InputError
from .quant.tensors import give_back_flags
from .quant.policy import single_codec
from .staging import payload_views
from .store.arena import slot_stride
from .store.device import reservation_span
from .store.device_staging import staging_pool
from .store.frame import FrameMeta, header_prefix
from .store.streams import current_stream, on_stream, work_stream
from .store.tier import Reservation
from .store.tiered import StorePutResult, TieredStore

GUESS_ON = ("cuda",)  # devices whose ingests launch the chain's tail before hashing (guess_tail)


def applies(store: TieredStore, device: torch.device) -> bool:
    """Whether an ingest of KV on ``device`` can go in place into ``store``'s top tier."""
    return device.type in ("cuda", "cpu") and store.tiers[0].lends_runs


@dataclass(slots=True)
class _Run:
    """Consecutive blocks in flight: encoded into staging, copied into their reservations."""

    first: int  # index of the first block in the call's chain
    metas: list[FrameMeta]
    reservations: list[Reservation]
    flags: Any  # the codec's validity flags, in host memory once the first piece has landed
    codec: Any  # the run's codec (a run holds blocks of one codec, under a precision policy too)
    # Frames [a, b) of the run per copy, in landing order, with the event that marks it
    # landed (None: nothing in flight, the KV was in host memory).
    pieces: list[tuple[int, int, torch.cuda.Event | None]]
    skip: list[bool] | None = None  # blocks found stored after all (a guessed run): given back
    checked: bool = False  # flags checked
    encoded: torch.cuda.Event | None = None  # the run's encode done (its flags written)
    # The last piece was copied frame by frame, payloads only: its headers may be written
    # while it is in flight, so the call's last commit need not wait for it (commit_oldest).
    exact_last: bool = False


class InPlaceIngest:
    """One ingest of GPU (or host) KV into the top tier's reserved slots: ``guess_tail``
    (optional, before the keys are known), then ``run``; ``abandon`` if the call fails
    between the two."""

    def __init__(self, store: TieredStore, fmt: BlockFormat, layers: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 *, source: Any = None) -> None:
        """The KV: per-layer ``layers``, or ``source`` (a ``pages.PagedSource``: the call's
        blocks in an engine's pages; block ``i`` of the chain is its row ``i``)."""
        if source is None and layers is None:
            raise TypeError("InPlaceIngest: the KV is per-layer layers or a paged source; got neither")
        self.store, self.format, self.source = store, fmt, source
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = layers if layers is not None else []
        self.layout, self.block_tokens = fmt.layout, fmt.block_tokens
        # codec.prepare_key() -> its prepare_layers, once per key: a policy's parts may share
        # it (empty: paged KV, read through the pages instead)
        self.prepared: dict[Any, Any] = {}
        self.device = source.device if source is not None else self.layers[0][0].device
        if source is None:
            for part in fmt.parts():
                codec = single_codec(part.codec)
                key = codec.prepare_key()
                if key not in self.prepared:
                    self.prepared[key] = codec.prepare_layers([k for k, _ in self.layers],
                                                              [v for _, v in self.layers])
        if self.device.type == "cuda":
            self.encode_stream = work_stream("encode", self.device)
            self.copy_stream = work_stream("to_host", self.device)
            self.encode_stream.wait_stream(current_stream(self.device))  # the KV was made there
        self.pending: deque[_Run] = deque()
        self.outcomes: list[StorePutResult | None] = []
        self.committed: list[bytes] = []
        self.guessed: tuple[int, int] | None = None  # blocks launched by guess_tail
        self.unlaunched = 0  # blocks of the call's batches not launched yet (see commit_oldest)
        self.missing: list[bool] = []  # per block of the call: to be stored (not present)
        self.launched: list[tuple[int, int]] = []  # blocks [a, b) of each run launched
        self.rest_checked = False  # the blocks not launched were checked, before a commit for room
        self.spare: Container[bytes] = ()  # the chain's stored prefix (``run``)

    # -- before the keys are known ----------------------------------------------------------

    def guess_tail(self, num_blocks: int, hash_size: int) -> None:
        """Launch the chain's last blocks before hashing: an ingest's tail is new in the usual
        case (a prompt's prefix came from the cache, its suffix was just computed), and the
        copy engine then starts without waiting for the host to hash the prompt. Blocks
        that turn out stored are given back once their copy has landed. Only on a GPU, and
        only for calls long enough that the first batch is not all of it."""
        block_raw = self.layout.raw_nbytes(self.block_tokens)
        first = batching.first_batch_blocks(block_raw)
        if self.device.type not in GUESS_ON or num_blocks < 2 * first:
            return
        count = batching.guessed_tail_blocks(num_blocks, block_raw)
        start = num_blocks - count
        # The real keys go into the headers at commit: same sizes.
        metas = self.format.placeholder_run(start, count, hash_size)
        if len({m.nbytes for m in metas}) != 1 or any(m.codec is not metas[0].codec for m in metas):
            return  # a header grows a byte (or the codec changes) within these blocks: not worth a second run
        # A tier whose free room lies in pieces lends a shorter run: the chain's last blocks.
        reservations = self.store.reserve_run(metas[0].nbytes, count, grow=True, partial=True)
        if reservations is None:
            return
        start = num_blocks - len(reservations)
        self.launch(start, metas[count - len(reservations):], reservations)
        self.guessed = (start, num_blocks)

    # -- the call ---------------------------------------------------------------------------

    def run(self, hashes: Sequence[bytes], parents: Sequence[bytes], present: Sequence[bool],
            batch_blocks: int, positions: Sequence[int] | None = None, *,
            spare: Container[bytes] = ()) -> list[StorePutResult | None]:
        """Store every block not ``present`` (see the module doc); the outcome of each block,
        None for those not handled here: already present, or no room could be reserved for
        them (the caller stores those through ``put_many``). Raises ``InputError`` on NaN or
        Inf, having published nothing of this call. ``positions``: each block's position in
        its own chain, when the blocks are several requests' (default: its index).
        ``spare``: the chain's stored prefix, which the commits must not evict
        (``TieredStore.put_many``)."""
        self.spare = spare
        self.outcomes = [None] * len(hashes)
        missing = [not p for p in present]
        self.missing = list(missing)
        if self.guessed is not None:
            g0, g1 = self.guessed
            guessed = self.pending[0]
            guessed.metas = self.format.plan_run(g0, hashes[g0:g1], parents[g0:g1], _part(positions, g0, g1))
            guessed.skip = [present[i] for i in range(g0, g1)]
            missing[g0:g1] = [False] * (g1 - g0)
        batches = list(batching.runs(missing, batch_blocks))
        batches.reverse()  # the chain's end first
        if batches and self.device.type == "cuda":
            first = batching.first_batch_blocks(self.layout.raw_nbytes(self.block_tokens))
            batches = batching.growing(batches, first if self.guessed is None else 2 * max(first, g1 - g0))
        self.unlaunched = sum(stop - start for start, stop in batches)
        try:
            try:
                for i, (start, stop) in enumerate(batches):
                    self._launch_batch(start, self.format.plan_run(start, hashes[start:stop], parents[start:stop],
                                                                   _part(positions, start, stop)),
                                       last=i == len(batches) - 1)
            except _NoRoom:
                pass  # the blocks not launched are left to the caller
            while self.pending:
                self.commit_oldest(last=len(self.pending) == 1 and len(self.pending[0].pieces) == 1)
        except BaseException as exc:
            self.abandon()
            if isinstance(exc, InputError):  # this call's earlier batches go (logged if one cannot)
                self.store.delete_quietly(self.committed, "the undo of a write with bad input")
            raise
        return self.outcomes

    def _launch_batch(self, start: int, metas: list[FrameMeta], *, last: bool = False) -> None:
        """``last``: the call's last batch; its last piece is copied frame by frame
        (``_Run.exact_last``)."""
        stop = len(metas)  # the batch's frames [0, stop) left to launch, its end first
        while stop > 0:
            # Frames of a run share one size (a header grows a byte as positions grow) and one
            # codec (a precision policy changes it along the chain).
            size, codec = metas[stop - 1].nbytes, metas[stop - 1].codec
            lo = stop - 1
            while lo > 0 and metas[lo - 1].nbytes == size and metas[lo - 1].codec is codec:
                lo -= 1
            reservations = self.reserve(size, stop - lo)
            if reservations is None:
                raise _NoRoom
            lo = stop - len(reservations)
            self.launch(start + lo, metas[lo:stop], reservations, exact_last=last and lo == 0)
            self.unlaunched -= stop - lo
            stop = lo

    def launch(self, first: int, metas: list[FrameMeta], reservations: list[Reservation], *,
               exact_last: bool = False) -> None:
        """Encode blocks ``first..`` into ``reservations`` (a run) and queue their copies; on
        failure the reservations are given back. ``exact_last``: copy the last piece frame
        by frame, payloads only (see ``_Run.exact_last``)."""
        try:
            self._launch(first, metas, reservations, exact_last)
            self.launched.append((first, first + len(metas)))
        except BaseException:
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    self.copy_stream.synchronize()  # no copy may still write into the slots
            for reservation in reservations:
                self.store.abort(reservation)
            raise

    def _launch(self, first: int, metas: list[FrameMeta], reservations: list[Reservation], exact_last: bool) -> None:
        meta, count = metas[0], len(metas)
        stride = slot_stride(meta.nbytes)
        start, span = meta.payload_offset, (count - 1) * stride + meta.payload_nbytes
        host = reservation_span(reservations[0], 0, start + span)
        split = batching.copy_pieces(count)
        if self.device.type != "cuda":
            # KV in host memory: the slots themselves are the staging, encoded in place
            # (the pieces are only committed in turn).
            flags = self._encode(first, count, payload_views(host, meta.tensors, count, stride, meta.payload_offset))
            self.pending.append(_Run(first, metas, reservations, flags, self.format.at(first).codec,
                                     [(a, b, None) for a, b in split]))
            return
        pieces: list[tuple[int, int, torch.cuda.Event | None]] = []
        # The staging is leased for the encode stream and used by the copy stream after it;
        # given back as soon as the copies are queued (reused only after them, on the device).
        with staging_pool(self.device).take(start + span, stream=self.encode_stream) as lease:
            lease.used_on(self.copy_stream)
            staging = lease.tensor
            views = lease.memo(("payload", tuple(meta.tensors), count, stride, meta.payload_offset),
                               lambda: payload_views(staging, meta.tensors, count, stride, meta.payload_offset))
            with on_stream(self.encode_stream):
                flags = flags_to_host(self._encode(first, count, views))
                encoded = torch.cuda.Event()
                encoded.record(self.encode_stream)
            # The slots' headers are copied over too (staging garbage between payloads): each
            # is written once the copy has landed, in commit_oldest().
            self.copy_stream.wait_event(encoded)
            with on_stream(self.copy_stream):
                for k, (a, b) in enumerate(split):
                    if exact_last and k == len(split) - 1:
                        spans = [(start + i * stride, start + i * stride + meta.payload_nbytes) for i in range(a, b)]
                    else:
                        spans = [(start + a * stride, start + (b - 1) * stride + meta.payload_nbytes)]
                    for lo, hi in spans:
                        host[lo:hi].copy_(staging[lo:hi], non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(self.copy_stream)
                    pieces.append((a, b, landed))
        self.pending.append(_Run(first, metas, reservations, flags, self.format.at(first).codec, pieces,
                                 encoded=encoded, exact_last=exact_last))

    def _encode(self, first: int, count: int, views: list[torch.Tensor]) -> Any:
        """Blocks ``first..first+count`` (of one codec) into ``views``; the codec's flags."""
        codec = single_codec(self.format.at(first).codec)
        if self.source is not None:
            return self.source.encode(codec, first, count, views)
        return encode_into(codec, self.layers, self.prepared[codec.prepare_key()], first * self.block_tokens, count,
                           self.block_tokens, views)

    def commit_oldest(self, *, last: bool = False) -> None:
        """Wait for the oldest piece in flight, then publish its frames. ``last``: the
        call's last piece; if it was copied frame by frame (``_Run.exact_last``) and nothing
        below the top tier reads the bytes at commit, it is published while still in flight,
        as a put of device frames is: its readers wait for the copy (``CopyLanding``), and
        the call returns without waiting for it. Every run launched is checked first."""
        self._check_launched()
        run = self.pending[0]
        a, b, landed = run.pieces[0]
        landing = None
        # (Never a guessed run's: a block found stored is given back, and its slot must not
        # be reused while a copy may still write into it.)
        if last and run.exact_last and run.skip is None and landed is not None and not self.store.write_through:
            landing = CopyLanding(landed)
        elif landed is not None:
            landed.synchronize()
        run.pieces.pop(0)
        if not run.pieces:
            self.pending.popleft()
        # Out of ``pending`` now, so the call's ``abandon`` no longer sees this piece: a
        # commit that raises (an interrupt in a write-through's fsync) gives back here what
        # it did not publish, or the tier kept those bytes reserved for good. (An abort of a
        # reservation committed or aborted already does nothing.)
        try:
            skip = run.skip or [False] * len(run.metas)
            for i in range(a, b):
                if skip[i]:
                    self.store.abort(run.reservations[i])
                else:
                    run.reservations[i].view()[: run.metas[i].payload_offset] = header_prefix(run.metas[i])
            # Tail first within the batch (as the chain's batches go): a chain that overflows
            # the tier loses its tail, not its head.
            order = [i for i in range(b - 1, a - 1, -1) if not skip[i]]
            items = [(run.metas[i].block_hash, run.reservations[i], run.metas[i]) for i in order]
            # Room is made for the rest of the call as well (pieces in flight, and batches not
            # launched yet, each block as large as the largest payload the format makes under
            # this run's largest header: batches go tail first, so theirs are no larger), so
            # that it does not evict these.
            later = sum(r.reservations[i].nbytes for r in self.pending for c, d, _ in r.pieces for i in range(c, d)
                        if not (r.skip and r.skip[i]))
            if self.unlaunched:
                header = max(m.nbytes - m.payload_nbytes for m in run.metas)
                later += self.unlaunched * (max(f.planned_payload().payload_nbytes for f in self.format.parts()) + header)
            for i, outcome in zip(order, self.store.commit_many(items, sealed=False, landing=landing, room_for=later,
                                                                spare=self.spare)):
                self.outcomes[run.first + i] = outcome
                if outcome.stored:
                    self.committed.append(run.metas[i].block_hash)
        except BaseException:
            for i in range(a, b):
                self.store.abort(run.reservations[i])
            raise

    def _check_launched(self) -> None:
        """Check the NaN/Inf flags of every run launched so far, before the first of them
        is committed: a commit evicts, and a bad value in a later run must not cost the
        tier the blocks an earlier run's commit would evict. (The encodes finish long
        before the copies they feed land, so this waits for nothing a commit would not.)"""
        for run in self.pending:
            if run.checked:
                continue
            if run.encoded is not None:
                run.encoded.synchronize()
            try:
                run.codec.check_finite(run.flags, self.layout.dtype)
            except InputError:
                if self.source is None:
                    # The flags cannot tell a NaN from a range the stats cannot hold; the
                    # run's values can, as the codec's own encode names them.
                    end = run.first + len(run.metas)
                    check_encodable(self.format, self.layers, [i >= run.first for i in range(end)])
                raise
            run.checked = True
            if run.encoded is not None:  # pinned flags, written by kernels that have run: reusable
                give_back_flags(run.flags)

    def reserve(self, nbytes: int, count: int) -> list[Reservation] | None:
        """A run of up to ``count`` slots: as many as the tier lends now (its memory
        fragmented, or its reserve short of the whole call), committing landed batches
        only when it lends none, since waiting for a copy to land stalls the encodes and
        copies behind it and a shorter run does not; None when nothing is in flight and not
        even one slot is free."""
        while True:
            got = self.store.reserve_run(nbytes, count, grow=True, partial=True)
            if got is not None or not self.pending:
                return got
            if self.unlaunched and not self.rest_checked:
                self._check_rest()  # a commit evicts: not for a call a later block rejects
            self.commit_oldest()  # frees reservation room (and evicts, at commit)

    def _check_rest(self) -> None:
        """``InputError`` if the KV of a block to be stored and not launched yet is KV its
        codec refuses (NaN, Inf, a group range its stats cannot hold); the launched ones
        carry their codec's flags, checked before any commit."""
        self.rest_checked = True
        launched = [False] * len(self.missing)
        for a, b in self.launched:
            launched[a:b] = [True] * (b - a)
        rest = [not done and todo for todo, done in zip(self.missing, launched)]
        if self.source is None:
            check_encodable(self.format, self.layers, rest)
            return
        for a, b in batching.runs(rest, len(rest)):
            for c, d in self.format.segments(a, b):
                self.source.check_values(self.format.at(c).codec, c, d - c)

    def abandon(self) -> None:
        """Give back every reservation not committed, once no copy writes into it."""
        while self.pending:
            run = self.pending.popleft()
            for _, _, landed in run.pieces:
                if landed is not None:
                    with contextlib.suppress(Exception):  # a failed copy writes nothing more either
                        landed.synchronize()
            for reservation in run.reservations:
                self.store.abort(reservation)  # (idempotent: some may be given back already)


class CopyLanding:
    """A device-to-host copy still in flight, as a CPU-tier record's ``landing``: the tier
    waits for it before it reads, evicts or deletes the frame."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def _part(positions: Sequence[int] | None, start: int, stop: int) -> Sequence[int] | None:
    return None if positions is None else positions[start:stop]


class _NoRoom(Exception):
    pass


__all__ = ["InPlaceIngest", "applies"]
