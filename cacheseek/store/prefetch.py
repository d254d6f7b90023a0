"""Prefetch: a chain promoted from the capacity tiers (disk, Redis) into memory in the background.

A scheduler knows a request's prompt while the request waits in its queue; a prefetch
started then reads the prompt's stored chain from the slow tiers into the memory tiers
(CPU, and GPU where there is one) while it waits, so the materialize that comes with the
request is served from memory.

- ``Prefetcher.start(keys)`` returns at once: a ``Prefetch`` handle, or None (``attempt``:
  a ``Refused`` saying why, as it was decided) when there is nothing to do (nothing
  stored, the chain already in memory: that costs one lookup) or
  the limit of prefetches in flight (``max_in_flight``) is reached (counted, never queued:
  a prefetch that cannot start at once is worth less than the one it would wait behind).
- Promotions in flight are shared: each block being promoted has a future in
  ``waiting``; a second prefetch of the same chain joins them, and a read of the store
  (``TieredStore.stream``) waits for such a block instead of reading it again, so a
  materialize that comes while a prefetch runs waits only for what is still missing.
- A prefetch never fails anything: a block that cannot be read or promoted is left where
  it was (a later read reads it there). An error raised in its thread (not a miss or a
  full tier, which tiers answer without raising) is counted (``errors``) and the first of a
  run of them logged with its traceback: swallowed, a prefetch that never worked looked
  like one that found no room.
- ``close()`` (the store's) stops each prefetch at the block it is on; the blocks it did not
  reach count as not promoted, and a reader waiting for one reads it where it is.

Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_any
from concurrent.futures import TimeoutError as FutureTimeout  # (not the built-in one before Python 3.11)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .lease import Handover

if TYPE_CHECKING:
    from .tiered import TieredStore


@dataclass(slots=True)
class Prefetch:
    """One prefetch started: ``blocks`` of the chain's stored prefix (``matched``) are being
    promoted into memory, ``joined`` of them by another prefetch already under way.
    ``wait(timeout)`` returns True once every one of them has landed (or been given up).
    A prefetch a server runs (``RemoteCache.prefetch``, ``on_server``) cannot be waited for
    here: the server's own reads of the chain wait for it there."""

    matched: int
    blocks: int
    joined: int
    on_server: bool = False
    started_at: float = field(default_factory=time.perf_counter)
    _futures: list[Future] = field(default_factory=list, repr=False)

    def _local(self) -> None:
        if self.on_server:
            raise RuntimeError("this prefetch runs in the server: a materialize through it waits for it there")

    def done(self) -> bool:
        self._local()
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> bool:
        self._local()
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self._futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(timeout=left)
            except FutureTimeout:
                return False
        return True

    @property
    def promoted(self) -> int:
        """Blocks promoted so far (of ``blocks``)."""
        self._local()
        return sum(1 for f in self._futures if f.done() and not f.cancelled() and f.result())

    def to_dict(self) -> dict[str, Any]:
        return {"matched": self.matched, "blocks": self.blocks, "joined": self.joined}


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a prefetch did not start: ``reason`` is ``nothing_stored``, ``no_memory_tier``,
    ``in_memory``, ``refused_busy`` (the names of their counts in ``Prefetcher.counts``) or
    ``closed``; ``matched``: blocks of the chain's stored prefix, as looked up."""

    reason: str
    matched: int = 0


log = logging.getLogger("cacheseek.store")


class Prefetcher:
    """Background promotions for one ``TieredStore``, at most ``max_in_flight`` at once."""

    def __init__(self, store: TieredStore, max_in_flight: int = 4) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            from ..errors import ConfigError

            raise ConfigError(f"max_prefetches: must be an int >= 1, got {max_in_flight!r}")
        self._store = weakref.ref(store)  # no cycle: a store dropped unclosed is freed at once
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._waiting: dict[bytes, Future] = {}
        self._running = 0
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._closing: Future = Future()  # set by close(): a run waiting for another's block gives up
        self.counts = {"started": 0, "joined": 0, "in_memory": 0, "nothing_stored": 0, "refused_busy": 0,
                       "no_memory_tier": 0, "promoted_blocks": 0, "failed_blocks": 0, "waited_for": 0, "errors": 0}
        self._failing = False  # the last run raised: the next error is counted, not logged again

    def start(self, keys: Sequence[bytes]) -> Prefetch | None:
        """Promote the stored prefix of ``keys`` into memory in the background (see the
        module's docstring). Returns at once."""
        started = self.attempt(keys)
        return started if isinstance(started, Prefetch) else None

    def attempt(self, keys: Sequence[bytes]) -> Prefetch | Refused:
        """``start``, saying why when nothing started (read from the state it decided on, not
        worked out afterwards: a prefetch finishing meanwhile changes nothing in it)."""
        store = self._store()
        if store is None:
            return Refused("closed")
        where = store.locate(keys)
        if not where:
            self._count("nothing_stored")
            return Refused("nothing_stored")
        memory = {t.name for t in store.tiers if not t.persistent}
        if not memory:
            self._count("no_memory_tier")
            return Refused("no_memory_tier", len(where))
        todo = [(k, name) for k, name in zip(keys, where) if name not in memory]
        if not todo:
            self._count("in_memory")  # what a prefetch of a chain in memory costs: this lookup
            return Refused("in_memory", len(where))
        with self._lock:
            if self._closed:  # (an executor made now would run on closed tiers, and never be shut down)
                return Refused("closed", len(where))
            joined = [self._waiting[k] for k, _ in todo if k in self._waiting]
            mine = [(k, name) for k, name in todo if k not in self._waiting]
            if not mine:
                self.counts["joined"] += 1
                return Prefetch(matched=len(where), blocks=len(todo), joined=len(joined), _futures=joined)
            if self._running >= self.max_in_flight:
                self.counts["refused_busy"] += 1
                return Refused("refused_busy", len(where))
            # A block goes up only beside its parent (``TieredStore._promote_up``): one whose
            # parent another prefetch is promoting goes up once that has landed, not before
            # (read then, it found no parent in memory and stayed below: a prefetch joining a
            # chain's head left its own tail on disk).
            parent_of = dict(zip(keys[1:], keys))
            after = [self._waiting.get(p) if (p := parent_of.get(k)) is not None else None for k, _ in mine]
            futures: list[Future] = [Future() for _ in mine]
            for fut in futures:
                fut.set_running_or_notify_cancel()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="cacheseek-prefetch")
            # Submitted under the lock that ``close`` takes first (the run settles nothing before
            # this lock is let go): submitted outside it, past the check above, a prefetch could
            # meet a close that had shut the executor down and settled these blocks and the
            # slot, and then settle them again (``in_flight`` -1, blocks counted failed twice).
            # Published and counted inside the ``try``, and undone by whichever side claims
            # ``handover`` first: an interrupt in the executor's ``submit`` (Python, taking its
            # own locks, starting a thread) left these blocks in flight for good, every reader
            # of them waiting for ever; landing after the run was queued, ``in_flight`` at -1.
            handover = Handover()
            counted = False
            try:
                for (k, _), fut in zip(mine, futures):
                    self._waiting[k] = fut
                self._running += 1
                counted = True
                self._executor.submit(self._run, mine, futures, after, handover)
            except BaseException as exc:
                if handover.claim():  # (no reader has seen these futures: the lock is still held)
                    for (k, _), fut in zip(mine, futures):
                        if self._waiting.get(k) is fut:
                            del self._waiting[k]
                        fut.set_result(False)
                    if counted:
                        self._running -= 1
                if isinstance(exc, RuntimeError):  # (the interpreter is exiting: no new thread runs now)
                    return Refused("closed", len(where))
                raise
            self.counts["started"] += 1
        return Prefetch(matched=len(where), blocks=len(todo), joined=len(joined), _futures=joined + futures)

    def waiting(self, keys: Sequence[bytes]) -> dict[bytes, Future]:
        """The promotions in flight among ``keys``: a reader waits for these instead of
        reading them again."""
        with self._lock:
            if not self._waiting:
                return {}
            return {k: self._waiting[k] for k in keys if k in self._waiting}

    def note_waited(self, n: int) -> None:
        self._count("waited_for", n)

    def _run(self, mine: list[tuple[bytes, str]], futures: list[Future], after: list[Future | None],
             handover: Handover) -> None:
        if not handover.claim():
            return  # (taken back by the call that queued it, interrupted as it did)
        keys = [k for k, _ in mine]
        results = [False] * len(mine)
        try:
            store = self._store()
            if store is None:
                return
            memory = [t for t in store.tiers if not t.persistent]
            stream = store.stream(keys, where=[name for _, name in mine], promote=True, leased=False,
                                       join_prefetches=False)
            try:
                for i in range(len(mine)):
                    before = after[i]
                    if before is not None:  # (its read is under way meanwhile: the stream's reads start at once)
                        wait_any((before, self._closing), return_when=FIRST_COMPLETED)
                    # Closing (a server shutting down): the rest of a long chain is not promoted
                    # into tiers about to close; ``close`` waits only for the block under way.
                    if self._closing.done():
                        break
                    try:
                        got = next(stream)
                    except StopIteration:
                        break
                    if got is not None:
                        got[0].release()  # promoted by the stream: the bytes are not read here
                        # Read does not mean promoted: a memory tier may have refused the copy
                        # (full of pinned blocks or of this chain's own, the parent not there):
                        # it counts only if memory holds it now.
                        results[i] = store.contains_many([keys[i]], memory)[0]
                    if i < len(mine) - 1:  # (the last lands with the slot given back: ``finally``)
                        self._settle([mine[i]], [futures[i]], [results[i]])
            finally:
                stream.close()
        except Exception as exc:  # a prefetch fails nothing: what was not promoted stays where it was
            with self._lock:
                self.counts["errors"] += 1
                first, self._failing = not self._failing, True
            if first:
                log.warning("a prefetch raised in its thread (%s: %s): its blocks stay where they were; the errors "
                            "that follow are counted in the prefetch stats (errors) until one runs through",
                            type(exc).__name__, exc, exc_info=True)
        else:
            with self._lock:  # (runs on several threads: a failure's read-and-set is under it)
                self._failing = False
        finally:
            self._settle(mine, futures, results, last=True)

    def _settle(self, mine: list[tuple[bytes, str]], futures: list[Future], results: list[bool], *,
                last: bool = False) -> None:
        """Land ``futures``; ``last``: the run is over, its slot given back in the same hold
        of the lock (a waiter woken by a block landing then finds the slot free: a caller that
        waited for a prefetch and started the next was refused as busy otherwise)."""
        with self._lock:
            for (key, _), fut, ok in zip(mine, futures, results):
                if fut.done():
                    continue
                if self._waiting.get(key) is fut:
                    del self._waiting[key]
                self.counts["promoted_blocks" if ok else "failed_blocks"] += 1
                fut.set_result(ok)
            if last:
                self._running -= 1

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "in_flight": self._running, "blocks_in_flight": len(self._waiting),
                    "max_in_flight": self.max_in_flight}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._closing.done():
                self._closing.set_result(None)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        # A prefetch cancelled before its thread took it up never settles its blocks: a
        # reader waiting for one of them would wait for good.
        with self._lock:
            left = list(self._waiting.values())
            self._waiting.clear()
            self._running = 0
            for fut in left:
                if not fut.done():
                    self.counts["failed_blocks"] += 1
                    fut.set_result(False)


__all__ = ["Prefetch", "Prefetcher"]
