"""``TieredStore``: an ordered list of tiers and the policy between them.

- Ingest goes to the top tier, and writes through to the tiers named in ``write_through``.
  A frame the top tier cannot take goes to the next tier down instead (when that tier is
  not written through anyway): a full top tier never refuses what a lower one has room for.
- A tier that evicts to make room hands its victims down to the next tier (demotion),
  unless that tier already holds them.
- A hit below the top is copied up into every faster tier (promotion), if enabled.
- A block on its way down (evicted from one tier, not yet in the next) is not missed by a
  read: a ``get`` that finds a key nowhere while such a write ran waits for it and looks
  again (``store.moves``). A delete meanwhile misses it, and the demotion takes the copy
  it put below away again: a deleted block never comes back.
- A tier with an admission threshold (``admit_after``) takes a block only once it has been
  used that many times (the ingest is the first use): a write-through skips it until then,
  and the tier above hands it down when it evicts it, if it has been used enough by then.
- Uses are marked tail-first along a chain, and every tier's eviction index gives up a leaf
  of its prefix forest (``store.eviction``), so a chain's tail is evicted before its head
  and the surviving part of a chain is always a usable prefix.
- A pinned chain (``pin``) is never evicted from any tier that holds it, now or later; a
  tier full of pinned blocks refuses writes (``StorageError``) instead.
- ``Residency`` tracks which tiers hold each block, so that ``stats()`` counts every block
  once store-wide (and, per tier, the blocks no faster tier holds).

Acknowledgements (``durability``): with a persistent tier (disk, Redis) on top or written
through, a put's ``stored``/``present`` mean the block is whole and committed in a
persistent tier (``DURABLE``: on disk, fsynced and renamed into place; or SET in Redis)
when the put returns; a block only in memory there counts as neither (``failed``, with the
tiers' reasons), even if faster tiers hold it and serve it. Without one (a memory-only or
write-back store, ``MEMORY``) they mean committed in the tier that took it, readable until
evicted, lost with the process. ``present_many`` answers "present" in the same sense.

Torch-free: frames whose bytes are still on a device are moved to the host (through
``store.device``, imported only then) before a host-only tier sees them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Generator, Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from itertools import compress
from operator import not_
from typing import Any, TypeVar

from ..errors import ConfigError, StorageError
from .admission import UseFilter
from .eviction import SoftSpare
from .frame import FrameMeta
from .lease import Lease, release_all
from .moves import MAX_WALKS, Moves
from .pins import Pin, PinTable
from .prefetch import Prefetch, Prefetcher
from .residency import Residency
from .tier import BlockFrame, BlockInfo, ClosingIterator, MemoryTier, Spared, TierPutResult, Reservation, Tier


DURABLE = "durable"
MEMORY = "memory"
# Deletes remembered for reads in flight (``TieredStore._deleted_since``); a read older than
# these treats its blocks as possibly deleted, and does not promote them.
RECENT_DELETES = 4096
# Blocks a drain writes in one call where the tier below has room for them all (one group
# commit on disk): the most a second SIGINT waits for (a time limit: fewer, near its end).
DRAIN_BATCH = 16

T = TypeVar("T")

log = logging.getLogger("cacheseek.store")


@dataclass(slots=True)
class StorePutResult:
    """What happened to one block, at the store's acknowledgement level (``durability``):
    ``stored``, committed there by this call; ``present``, committed there already (or by a
    concurrent write of it, which this call waited for); neither: failed. ``errors``: the
    tiers that failed, with why (a failed tier fails the block only if no tier that gives
    the acknowledgement took it)."""

    stored: bool = False
    present: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    def note(self, result: TierPutResult, tier: str, acknowledges: bool) -> None:
        if result.error is not None:
            self.errors[tier] = str(result.error)
        elif acknowledges:
            if result.stored is not None:
                self.stored, self.present = True, False
            elif not self.stored:
                self.present = True


@dataclass(slots=True)
class DrainReport:
    """A drain's figures (``TieredStore.drain``), so far or at its end. ``tier``: where it
    wrote (None: no persistent tier below a memory one, nothing to do); ``blocks``/``bytes``:
    the blocks only the memory tiers held when it began. Each of them ends ``written`` (in
    ``tier`` now), ``skipped`` (not admitted by the tier's filter, a tail whose head was not
    written, or gone from memory meanwhile), ``failed`` (the tier refused it: the first
    one's error in ``first_error``), or ``left``: not reached when the drain stopped (``stopped``: "time limit",
    "cut", or "no room": the next write would have evicted a block the drain wrote, or gone
    past the tier's budget). ``charged``: what the tier's budget counts for the written ones.
    ``handed_on``/``handed_on_bytes``: of the written ones, those ``tier`` refused (its filter,
    a failed write, no room) that the persistent tier below it (``handed_on_to``) took.
    ``not_admitted``/``not_admitted_bytes``: the blocks a tier's admission filter did not
    admit, skipped or handed on (each also in that filter's ``not_admitted``, once).
    ``evicted``: blocks ``tier`` held before the drain that its writes evicted to make room
    (handed down as any eviction's, where a tier below takes them)."""

    tier: str | None = None
    blocks: int = 0
    bytes: int = 0
    written: int = 0
    written_bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    failed: int = 0
    failed_bytes: int = 0
    left: int = 0
    left_bytes: int = 0
    stopped: str | None = None
    seconds: float = 0.0
    charged: int = 0
    first_error: str | None = None  # (of the failed ones: one line for them all, not one each)
    handed_on: int = 0
    handed_on_bytes: int = 0
    handed_on_to: str | None = None
    not_admitted: int = 0
    not_admitted_bytes: int = 0
    evicted: int = 0

    def add(self, outcome: str, nbytes: int, n: int = 1) -> None:
        """``n`` blocks of ``nbytes`` more ``written``, ``skipped``, ``failed`` or
        ``not_admitted`` (-1: one less)."""
        setattr(self, outcome, getattr(self, outcome) + n)
        setattr(self, f"{outcome}_bytes", getattr(self, f"{outcome}_bytes") + n * nbytes)


@dataclass(slots=True)
class _DrainTarget:
    """A persistent tier a drain writes into (``TieredStore._drain_into``): its level, the
    bytes the drain may charge there (its budget less its pins) and has charged, how long
    its slowest write so far took a block, and whether a persistent tier below takes what
    it refuses (``hand_on``: then kept in ``passed``, for that tier)."""

    level: int
    budget: int
    hand_on: bool
    charged: int = 0
    block_seconds: float | None = None
    passed: list[tuple[bytes, BlockInfo]] = field(default_factory=list)
    passed_keys: set[bytes] = field(default_factory=set)

    def pass_on(self, key: bytes, info: BlockInfo) -> None:
        self.passed.append((key, info))
        self.passed_keys.add(key)


@dataclass(slots=True)
class _DrainRun:
    """What a drain's writes into each tier share (``TieredStore.drain``)."""

    report: DrainReport
    memory: list[Tier]  # the tiers it copies from
    written: dict[bytes, int]  # blocks a tail may follow -> bytes of the drain's (0: below already)
    plan: dict[bytes, BlockInfo]  # the blocks to write
    started: float
    shown: float  # the last progress call
    deadline: float | None
    stop: Callable[[], bool] | None
    progress: Callable[[DrainReport], None] | None
    every_seconds: float


def _budget_of(tier: Tier) -> Callable[[], int]:
    """The tier's budget, read when asked (it may be resized)."""
    return lambda: tier.capacity_bytes



class DeleteFailed(StorageError):
    """A ``delete_many`` that a tier failed part way (a disk that could not remove a block's
    files, or sync its directory after): ``results`` holds the answers of the keys before
    the failing one, whose deletes may not be durable yet; that key and the rest are kept
    where they were. Retried, it deletes what is left and syncs what was not synced."""

    def __init__(self, message: str, results: list[bool | None]) -> None:
        super().__init__(message)
        self.results = results


def _delete_copy(tier: Tier, key: bytes) -> None:
    """Delete a copy a move just made where a delete had been (or that nothing reaches): a
    tier that cannot is logged, not raised, since the move must finish; the copy stays, as
    a block a restart or a read finds."""
    try:
        tier.delete(key)
    except StorageError as exc:
        log.warning("block %s: its copy in the %s tier could not be deleted: %s", key.hex(), tier.name, exc)

class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_through: Iterable[str] = (),
        promote_on_hit: bool = True,
        admit_after: dict[str, int] | None = None,
        clock: Callable[[], float] = time.time,
        max_prefetches: int = 4,
    ) -> None:
        if not tiers:
            raise ConfigError("tiers: at least one tier is needed")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")
        write_through = set(write_through)
        unknown = write_through - set(names[1:])
        if unknown:
            raise ConfigError(f"write_through: {sorted(unknown)} are not tiers below the top ({names[1:]})")
        admit_after = {k: v for k, v in (admit_after or {}).items() if v > 1}
        bad = set(admit_after) - set(names[1:])
        if bad:
            raise ConfigError(f"admit_after: {sorted(bad)} are not tiers below the top ({names[1:]})")
        self.tiers = list(tiers)
        self.write_through = write_through
        self.promote_on_hit = promote_on_hit
        self.filters = {t.name: UseFilter(admit_after[t.name], _budget_of(t), t.charge)
                        for t in self.tiers if t.name in admit_after}
        for i, tier in enumerate(self.tiers):
            below = self.tiers[i + 1] if i + 1 < len(self.tiers) else None
            tier.demote_evicted = below is not None and (below.name not in write_through or below.name in self.filters)
        self.moves = Moves() if any(t.demote_evicted for t in self.tiers) else None
        self.residency = Residency(len(self.tiers))
        for i, tier in enumerate(self.tiers):
            tier.watch(self.residency.watch(i))
        self.pin_table = PinTable(clock)
        # Held from a pin table change until the tiers have applied it: a pin, an unpin and an
        # expiry of the same blocks interleaved would leave the tiers' pins other than the
        # table's (a block pinned with no pin left, or a pin whose blocks an expiry unpinned).
        self._pin_lock = threading.Lock()
        # Deletes, numbered: a read that began before a delete of its block must not promote
        # it (store it again above) once that delete has gone by.
        self._delete_lock = threading.Lock()
        self._deletes = 0
        self._deleting: set[int] = set()  # the numbers of deletes still going through the tiers
        self._recent_deletes: deque[tuple[int, bytes]] = deque(maxlen=RECENT_DELETES)
        # Deletes that found nothing while a demotion may have had their block on its way down
        # (write-back): number -> whether a demotion then deleted the block it landed.
        self._in_transit: dict[int, bool] = {}
        # The tiers every put reaches, and of those the ones whose commit an acknowledgement
        # means: a tier with an admission threshold skips new blocks, so it acknowledges none.
        reached = [self.tiers[0], *(t for t in self.tiers[1:] if t.name in write_through)]
        durable = [t.name for t in reached if t.persistent and t.name not in self.filters]
        self.durability = DURABLE if durable else MEMORY
        self._acknowledging = set(durable) if durable else {t.name for t in self.tiers}
        self.prefetcher = Prefetcher(self, max_prefetches)

    @property
    def indexes_in_memory(self) -> bool:
        """Whether lookups and touches are pure in-memory work (no tier does I/O for them)."""
        return all(t.index_in_memory for t in self.tiers)

    @property
    def in_memory(self) -> bool:
        """Whether every tier keeps its frames in this process's memory, so that puts (with
        their evictions) do no I/O."""
        return all(not t.persistent and t.index_in_memory for t in self.tiers)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    # -- writes --------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> StorePutResult:
        return self.put_many([(key, frame)])[0]

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, room_for: int = 0,
                 spare: Container[bytes] = ()) -> list[StorePutResult]:
        """Store blocks in the top tier (or, what it cannot take, in the next one) and every
        write-through tier; each outcome at the store's acknowledgement level. ``room_for``:
        frame bytes of the caller's later writes of the same call (a server's batch put in
        groups, an ingest's later batches), evicted for now in the top tier and each
        write-through tier (as each charges them), so that they do not evict these.
        ``spare``: the stored blocks of the chain these extend (an ingest's found prefix),
        never their victims in a memory top tier (``_top_spare``)."""
        if self.pin_table.due():
            self.expire_pins()
        for use_filter in self.filters.values():
            if items:
                # Sized now, not at the first frame that goes down to its tier: until then its
                # window was 0, never halved, and kept a count for every key ever ingested.
                use_filter.size_from(items[0][1].nbytes)
            use_filter.use(key for key, _ in items)  # an ingest is a block's first use
        with self._moving():
            return self._put_many(items, self._deletes_done(), room_for, self._top_spare(spare))

    def _top_spare(self, spare: Container[bytes]) -> Container[bytes]:
        """What a write spares in the top tier. A chain longer than that tier evicts as it goes
        (its puts come tail first, so its head stays); its stored prefix, touched before the
        puts but older than each of them, went first, and the tier was left holding a tail
        no lookup can reach. Spared, the chain's own new tail goes instead. Only where the top
        tier is the store's one tier, and a memory tier: below it, its victims are kept
        (demoted, or written through already), so the chain stays whole across the tiers; and
        a disk top tier sparing a write's blocks stores it frame by frame, each making its own
        room, where its call's frames must not evict each other (``put_many``). A ``SoftSpare``
        goes to any top tier, and to the write-through tiers (``_write_through``): a server's
        body sparing its write's earlier bodies, which its room would otherwise take first
        (ARC's only once-used blocks) and which it still gives up where nothing else is left,
        as ``room_for``'s room is made in each of those tiers."""
        if isinstance(spare, SoftSpare):
            return spare
        return spare if len(self.tiers) == 1 and isinstance(self.tiers[0], MemoryTier) else ()

    def _moving(self) -> AbstractContextManager[None]:
        """Around a write whose evictions may be demoted (see ``store.moves``)."""
        return nullcontext() if self.moves is None else self.moves.moving()

    def _put_many(self, items: list[tuple[bytes, BlockFrame]], since: int, room_for: int = 0,
                  spare: Container[bytes] = ()) -> list[StorePutResult]:
        outcomes = [StorePutResult() for _ in items]
        top = self.tiers[0]
        current = items if top.accepts_device_frames else [(k, _on_host(f)) for k, f in items]
        written, refused = [], []
        held: list[Lease | None] = []  # leases on the stored copies, released once written through
        results: list[TierPutResult] = []
        demoted = 0
        try:
            try:
                # A write-through reads the top tier's stored copies: leased until it is done.
                results = top.put_many(current, lease_stored=bool(self.write_through),
                                       room_for=_room_in(top, room_for, current), spare=spare)
                for (key, frame), result, outcome in zip(current, results, outcomes):
                    _hold(result, held)
                    outcome.note(result, top.name, top.name in self._acknowledging)
                    written.append((key, _host_copy(result.stored, frame), outcome))
                    if result.error is not None:
                        refused.append((key, frame, outcome))
                self._demote(0, _victims(results), since)  # (all at once: see ``_demote``)
                demoted = len(results)
            except BaseException:
                self._demote_orphans(top, results[demoted:], since)
                raise
            self._fall_through(refused, since)
            self._write_through(written, held, since, room_for, spare)
        finally:
            release_all(held)
        return outcomes

    def _fall_through(self, refused: list[tuple[bytes, BlockFrame, StorePutResult]], since: int) -> None:
        """Frames the top tier could not take (full of blocks being read, a frame larger than
        its budget) go to the next tier, unless it is written through anyway."""
        if not refused or len(self.tiers) < 2 or self.tiers[1].name in self.write_through:
            return
        below = self.tiers[1]
        frames = [(key, frame if below.accepts_device_frames else _on_host(frame)) for key, frame, _ in refused]
        results = below.put_many(frames)
        for (_, _, outcome), result in zip(refused, results):
            outcome.note(result, below.name, below.name in self._acknowledging)
        self._demote(1, _victims(results), since)

    def _write_through(self, items: list[tuple[bytes, BlockFrame, StorePutResult]], held: list[Lease | None],
                       since: int, room_for: int = 0, spare: Container[bytes] = (), *, top_next: bool = False) -> None:
        """Put ``items`` into each write-through tier in turn, each from the host copy the tier
        before it stored (rather than from the device again). A tier's admission filter
        holds back only that tier's writes: a block it does not admit goes on to the tiers
        below from the copy it had. The leases on the stored copies go into ``held``: the
        caller releases them once this returns. ``room_for``: as ``put_many``'s, made in
        each of these tiers too: else a call written in pieces has its later pieces evict
        its earlier ones there, acknowledged durable and gone. ``top_next``: the top tier
        takes ``items`` after this (frames received in place: ``commit_many``). ``spare``: a
        ``SoftSpare`` is spared in each of these tiers too (``_top_spare``); no other is."""
        items = list(items)
        soft = spare if isinstance(spare, SoftSpare) else ()
        sources = [self.tiers[0]]  # tiers whose stored copies ``items`` now point into
        for level, tier in enumerate(self.tiers[1:], start=1):
            if tier.name not in self.write_through or not items:
                continue
            for source in sources:  # this tier reads their host copies
                failed = source.settle()
                if failed:
                    items = self._without_failed(items, failed, source)
            sources = []
            use_filter = self.filters.get(tier.name)
            chosen = list(range(len(items))) if use_filter is None else \
                self._admitted(use_filter, items, level, top_next=top_next)
            if not chosen:
                continue
            frames = [(items[i][0], items[i][1] if tier.accepts_device_frames else _on_host(items[i][1]))
                      for i in chosen]
            results = tier.put_many(frames, lease_stored=True, room_for=_room_in(tier, room_for, frames), spare=soft)
            for i, (key, frame), result in zip(chosen, frames, results):
                outcome = items[i][2]
                _hold(result, held)
                outcome.note(result, tier.name, tier.name in self._acknowledging)
                items[i] = (key, _host_copy(result.stored, frame), outcome)
            self._demote(level, _victims(results), since)
            sources = [tier]

    def _without_failed(self, items: list[tuple[bytes, BlockFrame, StorePutResult]], failed: set[bytes],
                        tier: Tier) -> list[tuple[bytes, BlockFrame, StorePutResult]]:
        """``items`` less those whose copies into ``tier`` failed (``settle``): nothing below
        may write them from those bytes. A top tier's acknowledgement was the only one the
        outcome had: it is withdrawn."""
        first = tier is self.tiers[0]
        kept = []
        for key, frame, outcome in items:
            if key not in failed:
                kept.append((key, frame, outcome))
                continue
            outcome.errors[tier.name] = f"{tier.name} tier: the device copy into host memory failed"
            if first:
                outcome.stored = outcome.present = False
        return kept

    def _admitted(self, use_filter: UseFilter, items: list[tuple[bytes, BlockFrame, StorePutResult]],
                  level: int, *, top_next: bool = False) -> list[int]:
        """The indexes of the ``items`` the filter of the tier at ``level`` admits. A refusal
        is counted only where it is the block's last chance: one that a tier above holds is
        handed down when evicted and decided again then (``_demote``), and counted twice it
        made the refusals (and the bytes not written) about twice the blocks spared. So is
        one the top tier takes right after (``top_next``), as yet in none."""
        out = []
        above = [t for t in self.tiers[:level] if t.index_in_memory]
        for i, (key, frame, _) in enumerate(items):
            use_filter.size_from(frame.nbytes)
            if use_filter.admits(key):
                out.append(i)
            elif not top_next and not any(t.contains(key) for t in above):
                use_filter.refuse(frame.nbytes)
        return out

    def _demote(self, level: int, evicted: list[tuple[bytes, BlockFrame | None]], since: int,
                spare: Container[bytes] = ()) -> None:
        """Hand ``evicted`` down to the tier below ``level``. ``since``: the deletes done
        before the write that evicted them began (``_deletes_done``). A victim is in no tier
        while it moves, so a delete meanwhile misses it: a copy below that such a delete may
        have missed is deleted again, else the block would come back after its delete.
        ``spare``: a read's promotion made the room (``_promote_up``): the room the victims
        take below spares the same blocks."""
        if level + 1 >= len(self.tiers):
            return
        below = self.tiers[level + 1]
        use_filter = self.filters.get(below.name)
        moving: list[tuple[bytes, BlockFrame]] = []
        down: list[tuple[bytes, BlockFrame | None]] = []  # for the tier below that one
        for key, frame in evicted:
            if frame is None or below.contains(key):
                continue
            if use_filter is not None:
                use_filter.size_from(frame.nbytes)
                if not use_filter.admits(key):
                    use_filter.refuse(frame.nbytes)
                    # The filter holds back only this tier's write: a tier further down that
                    # would have had the block from it (write-back) still gets it now.
                    if below.demote_evicted:
                        down.append((key, frame))
                    continue
            moving.append((key, frame if below.accepts_device_frames else _on_host(frame)))
        # One call for all of them: a disk commits them as a group, its fsyncs overlapping.
        # Put one at a time, a write-back POST whose body evicted n blocks waited for 3n
        # fsyncs in a row, and under a loaded disk it was slower than a write-through one.
        results = _put_sparing(below, moving, spare) if moving else []
        for (key, frame), result in zip(moving, results):
            if result.stored is not None:
                self._landed(below, key, since)
            # A failure is in the result (counted by the tier), with whatever the put evicted
            # first: handed down all the same.
            down.extend(result.evicted)
            if result.error is not None:
                # Refused there (a failing disk, one full of pinned blocks): the block goes on
                # down too. Dropped here, an acknowledged block would leave the store before
                # its last tier, which may well have room.
                down.append((key, frame))
        if down:
            self._demote(level + 1, down, since, spare)

    def _landed(self, tier: Tier, key: bytes, since: int) -> bool:
        """After a put from above stored ``key`` in ``tier`` (a demotion, a drain): counted as
        a demotion, or deleted again if a delete after ``since`` may have missed it on its
        way (False), else the block would come back after its delete."""
        if self._deleted_since(key, since):
            _delete_copy(tier, key)
            self._landed_after_delete(key, since)
            return False
        tier.count(demotions=1)
        return True

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: bytes, *, promote: bool | None = None, join_prefetches: bool = True,
            spare: Container[bytes] = ()) -> tuple[BlockFrame, str] | None:
        """The frame from the fastest tier holding it, and that tier's name. A block a
        prefetch is promoting is waited for, then read from memory (``join_prefetches``).
        The caller releases the frame's lease (``frame.release()``, ``with frame:``).

        ``spare``: the chain this read is one block of (a caller that reads a chain a block
        at a time: the server's prefix stream): the promotion evicts none of its blocks, in
        the tiers it goes up into nor in those its victims go down into (else it could evict
        the chain's next block, held in memory alone, before the caller reached it). Where
        there is no room but theirs, the block is not promoted: served from where it is."""
        promote = self.promote_on_hit if promote is None else promote
        if join_prefetches:
            for fut in self.prefetcher.waiting([key]).values():
                fut.result()
                self.prefetcher.note_waited(1)
        since = self._deletes_done()
        mark = None if self.moves is None else self.moves.mark()
        got = self._get_one(key, promote, since, spare)
        if got is None and mark is not None and self.moves is not None and self.moves.overlapped(mark):
            got = self._get_one(key, promote, since, spare)
        return got

    def _get_one(self, key: bytes, promote: bool, since: int,
                 spare: Container[bytes] = ()) -> tuple[BlockFrame, str] | None:
        for level, tier in enumerate(self.tiers):
            frame = tier.get(key)
            if frame is None:
                continue
            if promote and level > 0:
                self._promote_held(key, frame, level, since, spare)
            return frame, tier.name
        return None

    def get_many(self, keys: Sequence[bytes], *, promote: bool | None = None) -> list[tuple[BlockFrame, str] | None]:
        """Like :meth:`get` for each key, asking each tier once for all the keys still missing."""
        promote = self.promote_on_hit if promote is None else promote
        out: list[tuple[BlockFrame, str] | None] = [None] * len(keys)
        since = self._deletes_done()
        mark = None if self.moves is None else self.moves.mark()
        missing = self._get_missing(keys, list(range(len(keys))), out, promote, since)
        if missing and mark is not None and self.moves is not None and self.moves.overlapped(mark):
            self._get_missing(keys, missing, out, promote, since)
        return out

    def _get_missing(self, keys: Sequence[bytes], missing: list[int], out: list, promote: bool,
                     since: int) -> list[int]:
        """Fill ``out[i]`` for the ``missing`` keys found in a tier; the rest's indices."""
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            frames = tier.get_many([keys[i] for i in missing])
            for i, frame in zip(missing, frames):
                if frame is None:
                    continue
                if promote and level > 0:
                    self._promote_held(keys[i], frame, level, since)
                out[i] = (frame, tier.name)
            missing = [i for i in missing if out[i] is None]
        return missing

    def stream(self, keys: Sequence[bytes], *, where: Sequence[str] | None = None, promote: bool | None = None,
               leased: bool = True, join_prefetches: bool = True) -> ClosingIterator[tuple[BlockFrame, str] | None]:
        """Like :meth:`get_many`, but each frame is handed out, in order, as soon as it and the
        ones before it are in hand: every tier's reads start now (the disk tier keeps many in
        flight), and the caller works on the first frames while the later ones land.

        ``where``: the tier each key is in (``locate``'s answer; default: asked now); only
        ``keys[:len(where)]`` are read. A block whose promotion a prefetch has in flight is
        waited for and then read from memory, not read again (``join_prefetches``). A block
        gone from its tier since is looked for in the others. The caller releases each
        frame's ``lease`` (where it has one) once done with its bytes; ``leased=False``: disk
        frames get buffers of their own, not pooled ones. Close the iterator if you stop
        early: reads not handed out are cancelled or given back.

        ``keys`` are read as one chain: the promotions evict none of them (as ``get``'s
        ``spare``), so a block held only in memory is still there when the read reaches it."""
        promote = self.promote_on_hit if promote is None else promote
        since = self._deletes_done()
        names = list(self.locate(keys) if where is None else where)
        keys = list(keys[: len(names)])
        waiting = self.prefetcher.waiting(keys) if join_prefetches else {}
        level_of = {t.name: i for i, t in enumerate(self.tiers)}
        # The tiers above the one holding a block could not serve it: a miss there, as a get
        # counts it (a PrefixCache's reads left a CPU tier at 0 misses while the disk served all).
        levels = [level_of[name] for name in names]
        for i, tier in enumerate(self.tiers):
            if above := sum(level > i for level in levels):
                tier.count(misses=above)
        streams: dict[str, ClosingIterator[BlockFrame | None]] = {}
        for tier in self.tiers:
            mine = [k for k, name in zip(keys, names) if name == tier.name and k not in waiting]
            if mine:
                streams[tier.name] = tier.stream(mine, leased=leased)
        return _Merged(self._merge(keys, names, streams, waiting, level_of, promote, join_prefetches, since),
                       streams)

    def _merge(self, keys: list[bytes], names: list[str], streams: dict[str, ClosingIterator[BlockFrame | None]],
               waiting: dict[bytes, Any], level_of: dict[str, int], promote: bool, join: bool, since: int
               ) -> Generator[tuple[BlockFrame, str] | None, None, None]:
        # ``keys``, which this read's promotions spare: made at the first block that may be
        # promoted (a read from the top tier alone makes none).
        spare: frozenset[bytes] = frozenset()
        try:
            for key, name in zip(keys, names):
                fut = waiting.get(key)
                frame = next(streams[name], None) if fut is None else None
                level = level_of[name]
                if promote and not spare and (frame is None or level > 0):
                    spare = frozenset(keys)
                if fut is not None:
                    fut.result()  # the prefetch's read of it: landed (and promoted) or given up
                    self.prefetcher.note_waited(1)
                    yield self.get(key, promote=promote, join_prefetches=False, spare=spare)
                    continue
                if frame is None:  # gone from there since: any other tier
                    yield self.get(key, promote=promote, join_prefetches=join, spare=spare)
                    continue
                if promote and level > 0:
                    self._promote_held(key, frame, level, since, spare)
                yield frame, name
        finally:
            for it in streams.values():
                close = getattr(it, "close", None)
                if close is not None:
                    close()

    def prefetch(self, keys: Sequence[bytes]) -> Prefetch | None:
        """Start promoting the stored prefix of ``keys`` from the capacity tiers into memory,
        in the background; returns at once (``store.prefetch``: a handle, or None when there
        is nothing to do or too many prefetches are in flight)."""
        return self.prefetcher.start(keys)

    def _promote_held(self, key: bytes, frame: BlockFrame, level: int, since: int,
                      spare: Container[bytes] = ()) -> None:
        """``_promote`` a frame the caller is about to get: released here if that fails."""
        try:
            self._promote(key, frame, level, since, spare)
        except BaseException:
            frame.release()
            raise

    def _promote(self, key: bytes, frame: BlockFrame, level: int, since: int, spare: Container[bytes] = ()) -> None:
        with self._moving():
            self._promote_up(key, frame, level, since, spare)

    def _promote_up(self, key: bytes, frame: BlockFrame, level: int, since: int,
                    spare: Container[bytes] = ()) -> None:
        # A block goes up only beside its parent, and stays only if its parent was not what
        # made room for it: else it would be a tail with no head there, and once the tiers
        # below gave the head up, a block stored that no lookup reaches (a chain longer than
        # a tier, read whole, promoted its tail over its own middle).
        # ``spare`` (the chain being read): not evicted for the copy, nor for its victims on
        # their way down; a tier with no room but theirs refuses it (``Spared``).
        parent, root = frame.meta.parent_hash, frame.meta.position == 0
        for upper in range(level):
            tier = self.tiers[upper]
            if not root and not tier.holds_with_room(parent, frame.meta.nbytes, spare):
                continue
            # put_many, not put: a put that fails after evicting (an arena whose slots readers
            # hold, a device out of memory) still hands back its victims, which go down below.
            # Its parent spared too: checked as the first victim only, a frame larger than
            # the blocks it evicts took several, the parent among them (frames of several
            # sizes: models or codecs beside each other), and the copy was dropped after.
            sparing = spare if root else _SparedToo(parent, spare)
            try:
                result = _put_sparing(tier, [(key, frame if tier.accepts_device_frames else _on_host(frame))],
                                      sparing)[0]
            except StorageError:
                continue
            if isinstance(result.error, Spared):
                tier.count(promotions_spared=1)
            if result.stored is not None:
                # A delete since the read began (``since``) went by this tier before the put: the
                # copy would bring back a block the delete answered for.
                if not root and any(victim == parent for victim, _ in result.evicted) \
                        or self._deleted_since(key, since):
                    _delete_copy(tier, key)
                else:
                    tier.count(promotions=1)
            self._demote(upper, result.evicted, since, spare)

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        """The fastest tier holding each key of the longest stored prefix of ``keys``."""
        n = len(keys)
        where: list[str | None] = [None] * n
        missing = list(range(n))
        for tier in self.tiers:
            if not missing:
                break
            found = tier.contains_many(keys if len(missing) == n else [keys[i] for i in missing])
            if len(missing) == n and all(found):  # the usual answer: all of it in the top tier
                return [tier.name] * n
            for i in compress(missing, found):
                where[i] = tier.name
            missing = list(compress(missing, map(not_, found)))
        return where[: missing[0]] if missing else where  # type: ignore[return-value]

    def locate_many(self, chains: Sequence[Sequence[bytes]]) -> list[list[str]]:
        """``locate`` of each of ``chains``, as that many calls of it would answer, with each
        tier asked once for the keys of all of them (a block shared by several chains once):
        one round trip per networked tier (Redis) for a whole batch, not one per chain."""
        where: list[list[str | None]] = [[None] * len(c) for c in chains]
        missing = [(c, i) for c, chain in enumerate(chains) for i in range(len(chain))]
        for tier in self.tiers:
            if not missing:
                break
            asked = list(dict.fromkeys(chains[c][i] for c, i in missing))
            held = {k for k, hit in zip(asked, tier.contains_many(asked)) if hit}
            left = []
            for c, i in missing:
                if chains[c][i] in held:
                    where[c][i] = tier.name
                else:
                    left.append((c, i))
            missing = left
        out = []
        for found in where:  # each chain's longest prefix found in some tier
            n = found.index(None) if None in found else len(found)
            out.append(found[:n])
        return out  # type: ignore[return-value]

    def present_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is "present" in the sense of a put's answer: whole and committed
        where an acknowledgement needs it (a persistent tier, in a ``DURABLE`` store). A block
        only in memory there is not: a put of it writes it through (or waits for its write)."""
        if self.durability == MEMORY:
            return self.contains_many(keys)
        # (``Tier.present_many``: a disk tier whose files went answers not present, so the
        # block is sent and written again rather than acknowledged with nothing on disk.)
        return self.contains_many(keys, [t for t in self.tiers if t.name in self._acknowledging], committed=True)

    def contains_many(self, keys: Sequence[bytes], tiers: Sequence[Tier] | None = None, *,
                      committed: bool = False) -> list[bool]:
        """Whether any tier (of ``tiers``, default all) holds each key (``committed``: in
        the sense of a put's "present", ``Tier.present_many``)."""
        present = [False] * len(keys)
        for tier in self.tiers if tiers is None else tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            ask = tier.present_many if committed else tier.contains_many
            for i, hit in zip(todo, ask([keys[i] for i in todo])):
                present[i] = hit
        return present

    def info(self, key: bytes, *, strict: bool = False) -> BlockInfo | None:
        """The block's sizes, parent and position from the fastest tier holding it.
        ``strict``: a tier that could not be asked (and no faster one holds the block)
        raises ``TierUnavailable`` rather than answering None."""
        for tier in self.tiers:
            info = tier.info_or_raise(key) if strict else tier.info(key)
            if info is not None:
                return info
        return None

    def mark_moves(self) -> tuple[int, int] | None:
        """Taken before a walk of the tiers' indexes (``info``) that must not miss a block on
        its way down, as a read must not: after a miss, ``moved_since`` says whether to walk
        again. (``info`` itself does not wait: most of its misses are genuine, and cheap.)"""
        return None if self.moves is None else self.moves.mark()

    def moved_since(self, mark: tuple[int, int] | None) -> bool:
        """Whether a block may have been on its way down during a walk begun at ``mark``;
        if so, once those moves are over (``Moves.overlapped``): walk again."""
        return mark is not None and self.moves is not None and self.moves.overlapped(mark)

    def chain(self, key: bytes, *, limit: int = 1 << 20, strict: bool = False) -> list[bytes] | None:
        """Every block of the chain ending at ``key``, head first; None if any link is missing
        (a block on its way down a tier is not missing: see ``mark_moves``). ``strict``: a
        link that only a tier that could not be asked may hold raises ``TierUnavailable``."""
        return self.walk_past_moves(lambda: self._chain(key, limit, strict))

    def walk_past_moves(self, walk: Callable[[], T], missed: Callable[[T], bool] = lambda out: out is None) -> T:
        """``walk()`` of the tiers' indexes, again while it ``missed`` a block and a block may
        have been on its way down during it (``mark_moves``): under steady eviction each walk
        of many blocks can meet another of them in transit; at most ``MAX_WALKS`` walks."""
        for _ in range(MAX_WALKS - 1):
            mark = self.mark_moves()
            out = walk()
            if not missed(out) or not self.moved_since(mark):
                return out
        return walk()

    def _chain(self, key: bytes, limit: int, strict: bool = False) -> list[bytes] | None:
        out: list[bytes] = []
        info = self.info(key, strict=strict)
        while info is not None and len(out) < limit:
            out.append(key)
            if info.position == 0:
                return out[::-1]
            key, child = info.parent, info
            info = self.info(key, strict=strict)
            # A parent at another position is not this chain's: such links (refused where a tier
            # indexes children, possible in Redis) can close a cycle, walked until ``limit``.
            if info is not None and info.position != child.position - 1:
                return None
        return None

    def touch_chain(self, keys: Sequence[bytes], *, count_use: bool = True) -> None:
        """Mark a chain used again (a hit, or an ingest that found it stored): the head ends
        up the most recent use, so the tail is evicted first. ``count_use=False``: recency
        only, not a use for admission: an ingest's touch of blocks it found stored (a request
        that read them and then stores its prompt touches them twice; it used them once, and
        a block the ingest computed again was not reused at all)."""
        rev = list(reversed(keys))
        if count_use and self.filters:
            # Sized here too: a store reopened over a disk tier that serves only reads made
            # no put to size them, and kept a count of every block read, never halved.
            info = self.residency.info(rev[0]) if rev else None
            for use_filter in self.filters.values():
                if info is not None:
                    use_filter.size_from(info.nbytes)
                use_filter.use(rev)
        for tier in self.tiers:
            tier.touch(rev)

    def delete(self, key: bytes, *, all_or_nothing: bool = False) -> bool | None:
        """Delete ``key`` from every tier: True if one held it; None if a tier could not be
        asked (its copy, if any, is still there, and comes back once that tier answers: the
        others' copies are gone, but the block is not), whatever the others held; else False.
        A block on its way down a tier (write-back) is deleted where it lands, and counts as held.

        ``all_or_nothing``: the tiers without a local index (Redis) are asked first, and if
        one cannot be, no other tier's copy is deleted (None): a caller that finds what to
        delete in the local indexes (a flush by owner, a chain's descendants) finds the block
        there again when it retries, rather than a copy in Redis that no local index names
        and that is served again once Redis answers. (A Redis that timed out may have run
        the delete all the same: the retry deletes the rest.)"""
        mark = self.mark_moves()
        number = None
        try:
            # (numbered inside the ``try``: an interrupt as the lock was let go left the delete
            # in progress for good, every later write's ``since`` frozen before it, and every
            # block demoted since deleted where it landed)
            with self._delete_lock:  # numbered before any tier forgets it (see ``_deleted_since``)
                self._deletes += 1
                number = self._deletes
                self._deleting.add(number)
                self._recent_deletes.append((number, key))
                if mark is not None:
                    self._in_transit[number] = False
            try:
                deleted, unknown = False, False
                tiers = self.tiers
                if all_or_nothing:
                    tiers = sorted(tiers, key=lambda t: t.index_in_memory)  # (stable: top-down within each)
                for tier in tiers:
                    done = tier.delete(key)
                    deleted, unknown = deleted or bool(done), unknown or done is None
                    if unknown and all_or_nothing:
                        break
            finally:
                with self._delete_lock:
                    self._deleting.discard(number)
            if not deleted and self.moved_since(mark):  # (waits for the moves that overlapped)
                deleted = self._in_transit[number]
        finally:
            if number is not None:
                with self._delete_lock:
                    self._deleting.discard(number)
                    self._in_transit.pop(number, None)
        return None if unknown else deleted

    def delete_quietly(self, keys: Iterable[bytes], why: str) -> None:
        """``delete`` of each of ``keys``, for a caller that must not fail on it: the library's
        undo of the blocks a call stored before it found its input bad (its ``InputError`` is
        the answer, and every block goes), a foreign block dropped on a read. A tier that
        fails one (``StorageError``: a disk that cannot remove or sync the files) is logged
        and the others still go."""
        for key in keys:
            try:
                self.delete(key)
            except StorageError as exc:
                log.warning("block %s, deleted as %s, may still be stored: %s", key.hex(), why, exc)

    def drop_foreign(self, key: bytes, tier: str, why: str) -> None:
        """Count in ``tier``'s ``corrupt`` and delete from every tier a block read whole (its
        checksums good, its header naming it) that its reader found to be no block of its
        configuration (``BlockFormat.check_fetched``: another codec, layout or block size).
        Keys are made from the configuration, so only damage or a forger puts one there:
        left, every read ended the prefix at it (promoted first, into memory too), and every
        lookup promised the blocks past it."""
        self.tier(tier).count(corrupt=1)
        log.warning("block %s from the %s tier is no block of this cache's configuration (%s): not served, deleted",
                    key.hex(), tier, why)
        self.delete_quietly([key], "no block of this configuration")  # (a read: the block is a miss, no error)

    def _landed_after_delete(self, key: bytes, since: int) -> None:
        """A demotion deleted ``key`` where it landed, for a delete after ``since`` that had
        missed it: that delete found the block."""
        with self._delete_lock:
            for number, deleted in reversed(self._recent_deletes):
                if number <= since:
                    return
                if deleted == key and number in self._in_transit:
                    self._in_transit[number] = True

    def trim(self) -> None:
        """Trim each tier holding more than its budget (a disk tier opened with
        ``trim_at_open=False`` over a directory fuller than a smaller ``disk_bytes``), its
        victims handed down as any eviction's: a restart with a smaller budget must not
        lose blocks the tier below would have taken."""
        with self._moving():
            for level, tier in enumerate(self.tiers):
                self._demote(level, tier.trim(), self._deletes_done())

    def delete_many(self, keys: Sequence[bytes], *, all_or_nothing: bool = False) -> list[bool | None]:
        """``delete`` of each of ``keys``, in their order, made durable together: each tier
        syncs the deletes once at the end (``Tier.batched_deletes``), not once per block.
        A tier that fails a delete (``StorageError``: a disk that could not remove or sync
        a block's files) ends it there: ``DeleteFailed``, with the answers so far."""
        results: list[bool | None] = []
        try:
            with ExitStack() as stack:
                for tier in self.tiers:
                    stack.enter_context(tier.batched_deletes())
                for key in keys:
                    results.append(self.delete(key, all_or_nothing=all_or_nothing))
        except DeleteFailed:
            raise
        except StorageError as exc:
            raise DeleteFailed(str(exc), results) from None
        return results

    def drain(self, *, seconds: float | None = None, stop: Callable[[], bool] | None = None,
              progress: Callable[[DrainReport], None] | None = None, every_seconds: float = 5.0) -> DrainReport:
        """Write the blocks only the memory tiers hold (write-back: not demoted yet) down to the
        first persistent tier (disk, else Redis), so that a store opened again over it finds
        them: a clean shutdown's last step before ``close``. They are copied (the memory
        tiers keep theirs, and their reads count as no hit), in the order that keeps the most
        if it is cut short: pinned blocks first, then those the memory tiers would keep
        longest, the top tier's before the next one's, each chain's head before its tails
        (``_drain_plan``).

        The tier below is written as a demotion would write it, its budget and admission
        filter as they are: a block its filter does not admit is skipped, as is a tail whose
        head was not written (no prefix lookup would reach it). It makes room as it always
        does, giving up its own victims (handed further down, as any eviction's), but never a
        block this drain wrote or a drained tail hangs from: a write whose first victim would
        be one (the tier full of the drain's blocks and pinned ones, or a policy that ranks
        its own blocks above the new ones) stops the drain ("no room"; one that took such a
        block all the same, a larger frame needing several victims, stops it too, the block
        counted as left, or handed on: below), and it writes at most the tier's budget less
        its pinned bytes (a tier without a local index, Redis, cannot name its victim; its
        LRU gives up the drain's own blocks only past that). Blocks are written
        ``DRAIN_BATCH`` at a time where the tier has free room for them (one group commit on
        disk), else one by one.

        Where a second persistent tier lies below the first (Redis under disk), what the
        first refuses goes on to it, as a demotion's would, rather than stay behind: blocks
        its filter does not admit, those it failed to write (a disk error, a disk full of
        pinned blocks), the tails of such blocks, and, once it has no room, the rest. They
        are written there after the first tier's, in the same order, under that tier's
        budget and filter (``DrainReport.handed_on``).

        ``seconds``: how long it may run (None: to its end); ``stop``: asked between writes,
        True ends it ("cut"). Near the time limit the writes shrink to the blocks the tier
        has been writing in the time left (as slow as its slowest write so far), so the limit
        is overrun by about one block's write at most. Either way every block written is
        whole, and the rest is left (``DrainReport.left``). ``progress`` is called with the
        figures so far once the blocks to write are known, then every ``every_seconds``. A
        store with no persistent tier below a memory one has nothing to drain (``tier`` None)."""
        started = time.monotonic()
        report = DrainReport()
        levels = [i for i, t in enumerate(self.tiers) if t.persistent]
        if not levels or levels[0] == 0:
            return report
        memory = self.tiers[: levels[0]]
        report.tier = self.tiers[levels[0]].name
        plan, heads_below = self._drain_plan(memory, self.tiers[levels[0]:])
        report.blocks, report.bytes = len(plan), sum(info.nbytes for _, info in plan)
        if progress is not None:
            progress(report)
        run = _DrainRun(report=report, memory=memory, started=started, shown=started, stop=stop,
                        deadline=None if seconds is None else started + seconds,
                        progress=progress, every_seconds=every_seconds,
                        # The blocks a tail may follow (written now, or below already: 0 bytes of the drain's).
                        written=dict.fromkeys(heads_below, 0), plan=dict(plan))
        rank = {key: i for i, (key, _) in enumerate(plan)}
        todo = plan
        for n, level in enumerate(levels):
            target = self.tiers[level]
            at = _DrainTarget(level, budget=target.capacity_bytes - target.stats().pinned_bytes,
                              hand_on=n + 1 < len(levels))
            before = report.written, report.written_bytes
            self._drain_into(at, deque(todo), run)
            if n == 0:
                report.charged = at.charged
            else:
                report.handed_on += report.written - before[0]
                report.handed_on_bytes += report.written_bytes - before[1]
            if report.stopped is not None or not at.passed:
                break
            report.handed_on_to = self.tiers[levels[n + 1]].name
            todo = sorted(at.passed, key=lambda item: rank[item[0]])  # (heads before their tails again)
        report.left = report.blocks - report.written - report.skipped - report.failed
        report.left_bytes = report.bytes - report.written_bytes - report.skipped_bytes - report.failed_bytes
        report.seconds = time.monotonic() - started
        return report

    def _drain_into(self, at: _DrainTarget, todo: deque[tuple[bytes, BlockInfo]], run: _DrainRun) -> None:
        """Write ``todo`` (a drain's, in order) into the tier at ``at.level`` until done, or
        stopped (``run.report.stopped``); what the tier refuses goes to ``at.passed`` where a
        tier below takes it (``at.hand_on``), else it is counted skipped or failed."""
        report, written = run.report, run.written
        use_filter = self.filters.get(self.tiers[at.level].name)
        while todo:
            if run.stop is not None and run.stop():
                report.stopped = "cut"
                return
            size = DRAIN_BATCH
            if run.deadline is not None:
                left = run.deadline - time.monotonic()
                if left <= 0:
                    report.stopped = "time limit"
                    return
                # No more than the tier has been writing in the time left (one block while
                # that is not known yet): a slow disk's batch overran the limit by a batch.
                size = 1 if at.block_seconds is None else max(1, min(DRAIN_BATCH, int(left / at.block_seconds)))
            batch: list[tuple[bytes, BlockInfo]] = []
            coming = set()  # heads of this batch: written together with their tails
            while todo and len(batch) < size:
                key, info = todo.popleft()
                follows = not info.position or info.parent in written or info.parent in coming
                refused = use_filter is not None and not use_filter.admits(key)
                if use_filter is not None and refused:
                    # Counted as a demotion's refusal is: the drain is the block's last chance
                    # at this tier before the stop, whether it then goes on to the tier below
                    # (counted there only if that tier's own filter refuses it too) or is skipped.
                    use_filter.refuse(info.nbytes)
                    report.add("not_admitted", info.nbytes)
                if at.hand_on and (refused or not follows and info.parent in at.passed_keys):
                    at.pass_on(key, info)
                elif refused or not follows:
                    report.add("skipped", info.nbytes)
                else:
                    batch.append((key, info))
                    coming.add(key)
            began = time.monotonic()
            done, room = self._drain_batch(at, batch, run)
            if batch:
                took = (time.monotonic() - began) / len(batch)
                at.block_seconds = took if at.block_seconds is None else max(at.block_seconds, took)
            if not room:
                if not at.hand_on:
                    report.stopped = "no room"
                    return
                for key, info in [*batch[done:], *todo]:
                    at.pass_on(key, info)
                return
            if run.progress is not None and time.monotonic() - run.shown >= run.every_seconds:
                run.shown = time.monotonic()
                report.seconds = run.shown - run.started
                run.progress(report)

    def _drain_plan(self, memory: list[Tier], below: list[Tier]) -> tuple[list[tuple[bytes, BlockInfo]], set[bytes]]:
        """The blocks ``memory`` holds and no tier of ``below`` does, in the order a drain
        writes them (``drain``), and the parents of those among them that ``below`` holds."""
        pinned: list[bytes] = []
        rest: list[bytes] = []
        for tier in memory:
            for key in tier.keep_order():
                (pinned if self.pin_table.covered(key) else rest).append(key)
        ranked = list(dict.fromkeys(pinned + rest))
        infos: dict[bytes, BlockInfo] = {}
        for key, held in zip(ranked, self.contains_many(ranked, below)):
            info = None if held else self.info(key)
            if info is not None:
                infos[key] = info
        order: list[bytes] = []
        placed: set[bytes] = set()
        for key in infos:  # each block after its ancestors, the chain ranked as its best block
            path = []
            while key in infos and key not in placed:
                path.append(key)
                placed.add(key)
                if infos[key].position == 0:
                    break
                key = infos[key].parent
            order += reversed(path)
        parents = list({info.parent for info in infos.values() if info.position and info.parent not in infos})
        heads_below = set(compress(parents, self.contains_many(parents, below)))
        return [(key, infos[key]) for key in order], heads_below

    def _drain_batch(self, at: _DrainTarget, batch: list[tuple[bytes, BlockInfo]], run: _DrainRun) -> tuple[int, bool]:
        """Write ``batch`` (a drain's, in order) into the tier at ``at.level``: together where it
        has free room for them all, else one by one, each only if it would not evict a block
        the drain wrote or builds on (``run.written``) nor take the drain past ``at.budget``
        bytes. How many of the batch it dealt with, and False when the next could not be
        written, or one took such a block all the same (a frame that needed several victims)."""
        tier = self.tiers[at.level]
        charges = [tier.charge(info.nbytes) for _, info in batch]
        if at.charged + sum(charges) <= at.budget and tier.victim_for(sum(charges))[0]:
            return len(batch), self._drain_group(at, batch, run)
        for i, (item, charge) in enumerate(zip(batch, charges)):
            fits, victim = tier.victim_for(charge)
            if at.charged + charge > at.budget or not fits and (victim is None or victim in run.written):
                return i, False
            if not self._drain_group(at, [item], run):
                return i + 1, False
        return len(batch), True

    def _drain_group(self, at: _DrainTarget, group: list[tuple[bytes, BlockInfo]], run: _DrainRun) -> bool:
        """Copy ``group`` from the memory tiers into the tier at ``at.level`` in one call; False
        if that evicted a block of ``run.written`` there (taken off it, and off the figures)."""
        level, report, written = at.level, run.report, run.written
        tier = self.tiers[level]
        infos = dict(group)
        kept = True
        with self._moving():
            since = self._deletes_done()
            frames = []
            for key, info in group:
                frame = next((f for t in run.memory if (f := t.peek(key)) is not None), None)
                if frame is None:  # gone from memory since the plan: deleted, or evicted (demoted) meanwhile
                    report.add("skipped", info.nbytes)
                else:
                    frames.append((key, frame))
            try:
                results = tier.put_many([(k, f if tier.accepts_device_frames else _on_host(f)) for k, f in frames])
            finally:
                for _, frame in frames:
                    frame.release()
            for (key, _), result in zip(frames, results):
                info = infos[key]
                for victim, _ in result.evicted:
                    if not written.get(victim):
                        report.evicted += 1  # (a block the tier held before the drain: its room)
                    if victim in written:
                        kept = False
                        nbytes = written.pop(victim)
                        if nbytes:
                            report.add("written", nbytes, -1)
                            at.charged -= tier.charge(nbytes)
                            if at.hand_on:  # (memory holds it still; handed down already, most likely)
                                at.pass_on(victim, run.plan[victim])
                self._demote(level, result.evicted, since)  # (its own victims, handed down as any eviction's)
                if result.error is not None:
                    if at.hand_on:
                        at.pass_on(key, info)
                        continue
                    report.add("failed", info.nbytes)
                    report.first_error = report.first_error or f"block {key.hex()}: {result.error}"
                    continue
                orphan = info.position and info.parent not in written  # its head (of this group) was not
                if orphan and result.stored is not None:
                    _delete_copy(tier, key)  # (a tail no lookup reaches)
                if orphan and at.hand_on and info.parent in at.passed_keys:
                    at.pass_on(key, info)  # (after its head, to the tier below)
                elif orphan or result.stored is not None and not self._landed(tier, key, since):
                    report.add("skipped", info.nbytes)  # (or deleted while on its way)
                else:  # (stored None: the tier had it already)
                    written[key] = info.nbytes
                    report.add("written", info.nbytes)
                    at.charged += tier.charge(info.nbytes)
        return kept

    def settle_moves(self) -> None:
        """Wait until the blocks on their way down now (evicted from one tier, not yet in the
        next, so in none) are in a tier again or gone for good (see ``store.moves``): a caller
        that lists blocks by what the tiers hold, to delete them, lists again after this."""
        if self.moves is not None:
            self.moves.settle()

    def _deleted_since(self, key: bytes, since: int) -> bool:
        """Whether ``key`` may have been deleted after the ``since``-th delete (a read that
        began then asks, after its promotion's put: a delete numbered before that put reached
        the tier, or reaches it after, and removes the copy itself)."""
        if self._deletes == since:  # (the usual answer: no delete at all meanwhile)
            return False
        with self._delete_lock:
            recent = self._recent_deletes
            if recent[0][0] > since + 1:  # deletes after ``since`` forgotten: one may be of ``key``
                return True
            for number, deleted in reversed(recent):
                if number <= since:
                    return False
                if deleted == key:
                    return True
            return False

    def _deletes_done(self) -> int:
        """Taken before a read looks at the tiers: the deletes that had all gone through every
        tier (a delete still on its way may have left the block in a tier the read reaches)."""
        with self._delete_lock:
            return min(self._deleting) - 1 if self._deleting else self._deletes

    def children(self, key: bytes) -> list[bytes]:
        """Blocks whose parent is ``key``, in any tier with a local index."""
        out: dict[bytes, None] = {}
        for tier in self.tiers:
            out.update(dict.fromkeys(tier.children(key)))
        return list(out)

    def descendants(self, key: bytes) -> list[bytes]:
        """Every block below ``key`` in its prefix tree (tiers with a local index), parents first."""
        out: list[bytes] = []
        seen = {key}  # (a cycle of links, which the server refuses to store, ends here too)
        todo = [key]
        while todo:
            nxt = [c for k in todo for c in self.children(k) if c not in seen]
            seen.update(nxt)
            out += nxt
            todo = nxt
        return out

    # -- pins ------------------------------------------------------------------------------

    def pin(self, key: bytes, *, ttl_seconds: float | None = None, expires_at: float | None = None,
            pinned_at: float | None = None) -> Pin | None:
        """Keep the chain ending at ``key`` out of eviction in every tier (those holding it
        now, and any it reaches later) for ``ttl_seconds`` (None: until :meth:`unpin`), or
        until ``expires_at`` (seconds since the epoch); ``pinned_at``: ``PinTable.add``'s.
        None if the chain is not complete.
        Raises ``TierUnavailable`` when a tier that may hold a link of it (or that must take
        the pin: Redis) could not be asked; then nothing is pinned anywhere."""
        # Strict: a link only Redis holds, asked while Redis is down, is not a chain "not
        # stored" (a 404 to a server's client), but an outage to retry.
        keys = self.chain(key, strict=True)
        if keys is None:
            return None
        with self._pin_lock:
            pin, newly = self.pin_table.add(keys, ttl_seconds=ttl_seconds, expires_at=expires_at,
                                            pinned_at=pinned_at)
            tried: list[Tier] = []
            try:
                for tier in self.tiers if newly else ():
                    tried.append(tier)  # (one that fails may have pinned part of it: undone too)
                    tier.pin(newly)
                # A put on another thread may have evicted a link between the walk above and
                # the tiers taking the pin. Pinned now, the blocks stored stay: a second walk is
                # conclusive, and a chain no longer whole is not pinned (its blocks past the gap
                # held out of eviction, unreachable).
                whole = not newly or self.chain(key, strict=True) == keys
            except BaseException:
                # A tier that could not pin (Redis unreachable): the pin is undone everywhere, so
                # that pinning again sends it again, rather than finding it pinned already.
                _, freed = self.pin_table.remove(pin.key)
                for tier in tried:
                    tier.unpin(freed)
                raise
            if not whole:
                _, freed = self.pin_table.remove(pin.key)
                self._unpin(freed)
                return None
            return pin

    def unpin(self, key: bytes) -> Pin | None:
        """Drop the pin named ``key`` (the chain's last block); None if there was none."""
        with self._pin_lock:
            pin, freed = self.pin_table.remove(key)
            self._unpin(freed)
        return pin

    def pins(self) -> list[Pin]:
        self.expire_pins()
        return self.pin_table.pins()

    def expire_pins(self) -> None:
        if not self.pin_table.due():  # (the usual answer, without waiting for a pin in flight)
            return
        with self._pin_lock:
            self._unpin(self.pin_table.expire())

    def _unpin(self, keys: list[bytes]) -> None:
        if keys:
            for tier in self.tiers:
                tier.unpin(keys)

    # -- stats ---------------------------------------------------------------------------

    def lost_tiers(self) -> dict[str, str]:
        """Tier name -> why it gave up the storage under it (``Tier.lost``), looked at now:
        such a tier serves and stores nothing until the store is opened again."""
        return {tier.name: why for tier in self.tiers if (why := tier.lost()) is not None}

    def unwritable_tiers(self) -> dict[str, str]:
        """Tier name -> why it cannot write now (``Tier.read_only``), of the tiers every write
        goes through to (``write_through``): while one cannot, every write is refused."""
        return {tier.name: why for tier in self.tiers
                if tier.name in self.write_through and (why := tier.read_only()) is not None}

    def stats(self) -> dict[str, Any]:
        """Per tier: its own figures, plus ``unique_*`` (blocks no faster tier holds; None
        for a tier without a local index, such as Redis). Store-wide: ``used_bytes``,
        ``blocks`` and ``raw_bytes`` count each distinct block once, over the tiers with a
        local index (a shared Redis tier stands apart: its own figures, in its entry);
        ``stored_bytes`` adds every tier's copies; ``compression_ratio`` is raw over encoded
        bytes of the distinct blocks (of Redis's, when no local tier holds any)."""
        self.expire_pins()
        unique = self.residency.unique()
        tiers = [t.stats().to_dict() for t in self.tiers]
        local = [t.index_in_memory for t in self.tiers]
        for entry, figures, has_index in zip(tiers, unique, local):
            entry["unique_blocks"] = figures.blocks if has_index else None
            entry["unique_bytes"] = figures.bytes if has_index else None
            entry["unique_raw_bytes"] = figures.raw_bytes if has_index else None
            if entry["name"] in self.filters:
                entry["admission"] = self.filters[entry["name"]].describe()
        used = sum(f.bytes for f in unique)
        raw = sum(f.raw_bytes for f in unique)
        shared = [t for t, has_index in zip(tiers, local) if not has_index]
        ratio_of = (used, raw) if used else (sum(t["used_bytes"] for t in shared), sum(t["raw_bytes"] for t in shared))
        return {
            "tiers": tiers,
            "durability": self.durability,
            "write_through": sorted(self.write_through),
            "promote_on_hit": self.promote_on_hit,
            "used_bytes": used,
            "blocks": sum(f.blocks for f in unique),
            "raw_bytes": raw,
            # (Encoded bytes: a disk tier's ``used_bytes`` counts its files' whole file-system blocks.)
            "stored_bytes": sum(t.get("frame_bytes", t["used_bytes"]) for t in tiers),
            "shared_tiers": [t["name"] for t in shared],
            "compression_ratio": ratio_of[1] / ratio_of[0] if ratio_of[0] else None,
            "pins": len(self.pin_table),
            "prefetch": self.prefetcher.stats(),
        }

    # -- frames written in place -------------------------------------------------------

    def reserve(self, nbytes: int) -> Reservation | None:
        """Room in the top tier for a frame the caller writes in place and then passes to
        ``commit`` or ``abort`` (see ``Tier.reserve``); None: use ``put_many``."""
        return self.tiers[0].reserve(nbytes)

    def reserve_run(self, nbytes: int, count: int, *, grow: bool = False,
                    partial: bool = False) -> list[Reservation] | None:
        """``count`` reservations laid end to end in the top tier (see ``Tier.reserve_run``)."""
        return self.tiers[0].reserve_run(nbytes, count, grow=grow, partial=partial)

    def commit(self, key: bytes, reservation: Reservation, meta: FrameMeta) -> StorePutResult:
        """Publish a filled reservation in the top tier, then write it through as ``put_many``
        does. If the top tier got the key meanwhile, its writer wrote it through."""
        return self.commit_many([(key, reservation, meta)])[0]

    def commit_many(self, items: list[tuple[bytes, Reservation, FrameMeta]], *, sealed: bool = True,
                    landing: Any = None, room_for: int = 0, spare: Container[bytes] = ()) -> list[StorePutResult]:
        """:meth:`commit` for several reservations, in order (``sealed=False``: checksums
        not computed yet). The write-through tiers are written from the reserved bytes first,
        then the top tier publishes them: a block the top tier holds already (a concurrent
        writer's, whose own write-through may still be in flight) is still written through,
        or waited for, so its outcome means what a put's does. ``landing``: device copies
        into the payloads still in flight (see ``CpuTier.commit_many``); with write-through
        tiers, waited for here, since they read the bytes now. ``room_for``: bytes of the
        caller's later commits, evicted for now in the top tier (``CpuTier.commit_many``) and
        each write-through tier, as ``put_many``'s; ``spare`` as ``put_many``'s."""
        if landing is not None and self.write_through:
            try:
                landing.wait()
            except Exception as exc:  # nothing landed: nothing to publish or write through
                top = self.tiers[0]
                for _, reservation, _ in items:
                    top.abort(reservation)
                top.count(write_errors=len(items))
                why = f"{top.name} tier: the device copy into host memory failed: {exc}"
                return [StorePutResult(errors={top.name: why}) for _ in items]
            landing = None
        if self.pin_table.due():
            self.expire_pins()
        for use_filter in self.filters.values():
            if items:
                use_filter.size_from(items[0][2].nbytes)  # (as put_many's)
            use_filter.use(key for key, _, _ in items)
        outcomes = [StorePutResult() for _ in items]
        top = self.tiers[0]
        with self._moving():
            since = self._deletes_done()
            if self.write_through:
                top.settle()
                held: list[Lease | None] = []
                try:
                    self._write_through([(key, BlockFrame(meta, host=reservation.view(), sealed=sealed), outcome)
                                         for (key, reservation, meta), outcome in zip(items, outcomes)], held, since,
                                        room_for, spare, top_next=True)
                finally:
                    release_all(held)
            results: list[TierPutResult] = []
            demoted = 0
            try:
                results = top.commit_many(items, sealed=sealed, landing=landing, room_for=room_for,
                                          spare=self._top_spare(spare))
                for result, outcome in zip(results, outcomes):
                    outcome.note(result, top.name, top.name in self._acknowledging)
                self._demote(0, _victims(results), since)
                demoted = len(results)
            except BaseException:
                self._demote_orphans(top, results[demoted:], since)
                raise
        return outcomes

    def _demote_orphans(self, top: Tier, results: list[TierPutResult], since: int) -> None:
        """After an interrupted write: the victims it evicted from ``top`` and did not hand down
        (those ``top`` kept, its call cut short, and those of ``results`` not yet handed down)
        go down now. Else a write-back store lost acknowledged blocks to a Ctrl-C: they were
        in no tier."""
        orphans = top.take_orphans() + _victims(results)
        if orphans:
            self._demote(0, orphans, since)

    def abort(self, reservation: Reservation) -> None:
        self.tiers[0].abort(reservation)

    def close(self) -> None:
        self.prefetcher.close()
        for tier in self.tiers:
            tier.close()


class _Merged:
    """``TieredStore.stream``'s frames, and ``close()`` that closes the tiers' streams even when
    no frame was asked for: their reads start when ``stream`` is called, and a generator
    closed before it started runs no ``finally`` (a disk stream's pooled buffers stayed
    lent for good)."""

    __slots__ = ("_frames", "_streams")

    def __init__(self, frames: Generator[tuple[BlockFrame, str] | None, None, None],
                 streams: dict[str, ClosingIterator[BlockFrame | None]]) -> None:
        self._frames, self._streams = frames, streams

    def __iter__(self) -> _Merged:
        return self

    def __next__(self) -> tuple[BlockFrame, str] | None:
        return next(self._frames)

    def close(self) -> None:
        try:
            self._frames.close()
        finally:
            for it in self._streams.values():  # (idempotent: closed already where the frames' own finally ran)
                close = getattr(it, "close", None)
                if close is not None:
                    close()


def _room_in(tier: Tier, room_for: int, frames: list[tuple[bytes, BlockFrame]]) -> int:
    """``room_for`` (bytes of frames as the top tier counts them) as ``tier``'s budget counts
    them: in frames the size of the largest of ``frames`` (a call's frames are of one size,
    give or take a header byte), each charged as the tier charges one (the disk: its
    file-system blocks, with its sidecar's)."""
    if not room_for or not frames:
        return room_for
    size = max(frame.nbytes for _, frame in frames)
    charge = tier.charge(size)
    return room_for if charge == size else -(-room_for // size) * charge


class _SparedToo:
    """``spare`` and one more key (a promoted block's parent)."""

    __slots__ = ("key", "spare")

    def __init__(self, key: bytes, spare: Container[bytes]) -> None:
        self.key, self.spare = key, spare

    def __contains__(self, key: object) -> bool:
        return key == self.key or key in self.spare


def _put_sparing(tier: Tier, items: list[tuple[bytes, BlockFrame]], spare: Container[bytes]) -> list[TierPutResult]:
    """``tier.put_many(items)``, evicting none of ``spare`` (asked only where there is one)."""
    return tier.put_many(items, spare=spare) if spare else tier.put_many(items)


def _victims(results: list[TierPutResult]) -> list[tuple[bytes, BlockFrame | None]]:
    """What the puts of ``results`` evicted, in order."""
    return [victim for result in results for victim in result.evicted]


def _hold(result: TierPutResult, held: list[Lease | None]) -> None:
    if result.stored is not None and result.stored.lease is not None:
        held.append(result.stored.lease)


def _host_copy(stored: BlockFrame | None, frame: BlockFrame) -> BlockFrame:
    """What the next tier copies from: a tier's stored host copy if it made one."""
    return stored if stored is not None and stored.host is not None else frame


def _on_host(frame: BlockFrame) -> BlockFrame:
    if frame.host is not None:
        return frame
    from .device import frame_to_host

    return frame_to_host(frame)


__all__ = ["DURABLE", "MEMORY", "DrainReport", "StorePutResult", "TierPutResult", "TieredStore"]
