"""The scheduler side: how many tokens of a request the store holds, and each step's plan.

vLLM asks ``matched_tokens`` when it admits a request, tells ``after_alloc`` how many of
the offered tokens it took (blocks are allocated for them), and asks ``plan`` once per
step for the metadata its workers receive. Requests and scheduler outputs are vLLM's own
objects, read through the few attributes named here.

- A hit is whole store blocks of the prompt, and always leaves the prompt's last token to
  compute (vLLM needs one to produce logits), so it ends at or before
  ``(len(prompt) - 1) // block_tokens * block_tokens``.
- With tensor parallelism each rank stores its own shard; a hit counts only the blocks
  every rank holds.
- Requests whose KV depends on more than their tokens are keyed by it too (``cs.Prompt``):
  the LoRA adapter's name and path, each multimodal input's content hash and placeholder range, the
  cache salt. Two requests that differ in any of these share no block. Requests with
  prompt embeddings (token ids beside them or not), or extra keys the store cannot take
  (an adapter with an empty name, an input with an empty hash or no tokens), are neither
  loaded nor saved.
- A load writes whole store blocks, so it must start on a store block boundary: when
  vLLM's own hit ends inside a store block, nothing is offered (``lookup_unaligned``), as
  writing that block would overwrite vLLM's own pages, which other requests share.
- A prompt's full blocks are saved as soon as the step that computes them has run (chunked
  prefill saves chunk by chunk, each save from where the last one ended: ``SaveSpec.start``).
  A request whose load failed is rolled back by vLLM; its blocks are saved again once
  recomputed.
- With a server (``lookup_wait_seconds`` set), a lookup runs on a thread of its own, every
  rank's at once, and ``matched_tokens`` waits for it that long at most: unanswered, it
  answers None, which vLLM takes as "ask again later" (it schedules other requests and
  asks at its next step). vLLM's scheduler, which every running request waits on, so
  never waits on the network for more than that, whatever the server does.
- A request waits for its own lookup ``lookup_deadline_seconds`` at most, from the first
  ask (time queued behind other lookups counts): a lookup still unanswered then is late,
  and the request goes on as a miss (0 tokens, ``lookups_late``). Its answer, whenever it
  comes, is not used: the request stays a miss until admitted. A lookup that ran three
  quarters of the deadline at least on its thread is a failure to the guard, which rests the server
  (``retry_after_seconds``, doubling), so while a server hangs or trickles each new request
  skips the lookup rather than waiting out a deadline of its own; the lookup that ends the
  rest is the guard's probe. One late for waiting for a thread rests nothing (``_late``).
- With ``background_loads`` (a server), a hit is offered as vLLM's asynchronous load: vLLM
  allocates the request's blocks and holds it back (WAITING_FOR_REMOTE_KVS) while the
  workers load between steps (``StepPlan.background_loads``), the other requests running
  on; the workers report it finished (``get_finished``), with any blocks that did not
  arrive, and vLLM schedules it from there.
- With ``resave_hold_seconds`` (a server), a finished request that saved anything keeps
  its pages (``request_finished`` returns True) until every worker reports it: at once
  where its saves were stored, else once a save of it that failed has been sent again from
  them (``StepPlan.held``; worker.py), at most that long.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ...errors import InputError
from ...hashing import ExtraKeys, MMInput
from ...store.breaker import Ticket
from .guard import StoreGuard
from .plan import LoadSpec, SaveSpec, StepPlan, request_keys
from .stats import ConnectorStats

MAX_PENDING_LOOKUPS = 4096  # lookups remembered for requests vLLM has not admitted yet
LOOKUP_THREADS = 8  # per rank: lookups of requests vLLM asks about in one step, in flight at once


@dataclass(frozen=True, slots=True)
class Hit:
    """What a lookup found: the stored tokens from the start, and the tier of each block."""

    tokens: int
    tiers: tuple[str, ...] = ()


NO_HIT = Hit(0)


@dataclass(slots=True)
class _Lookup:
    """A remote lookup under way: each rank's answer to come, the guard's ticket for its
    outcome, when it is late (``time.monotonic()``; None: never), and when each rank's
    began to run on a pool thread (None: queued still)."""

    ticket: Ticket
    answers: list[Future]
    late_at: float | None
    started: list[float | None]


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    supported: bool
    extra: ExtraKeys | None = None
    load_tokens: int = 0  # external tokens vLLM took: loaded when the request is first scheduled
    saved: int = 0  # tokens [0, saved) are stored, or being stored this step
    hit: Hit = NO_HIT
    loading: bool = False  # offered as a load between steps, not scheduled since
    saving: bool = False  # a save of it was planned (since it was last admitted)
    request: Any = None  # vLLM's Request (its num_computed_tokens is rolled back over a failed load's blocks)


def unsupported_reason(request: Any) -> str | None:
    """Why a request's KV cannot be keyed at all, or None."""
    # A prompt of embeddings may carry token ids too (vLLM's mixed mode: placeholder ids
    # where an embedding goes in, or ids given beside the embeddings): its KV depends on
    # the embeddings, which the ids do not name.
    if getattr(request, "prompt_token_ids", None) is None or getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    try:
        extra_keys(request)
    except InputError as exc:  # (vLLM takes an adapter named "", an input of no tokens, ...: never raise into it)
        return f"extra keys: {exc}"
    return None


def extra_keys(request: Any) -> ExtraKeys | None:
    """What decides a vLLM request's KV besides its tokens (as vLLM's own prefix cache keys
    it): the LoRA adapter's name and path, multimodal inputs (content hash, placeholder
    range), the cache salt; None when nothing does."""
    lora = getattr(request, "lora_request", None)
    mm = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        mm.append(MMInput(hash=str(feature.identifier), offset=int(pos.offset), length=int(pos.length)))
    extra = ExtraKeys(lora_id=_lora_id(lora) if lora is not None else None, mm_inputs=tuple(mm),
                      cache_salt=getattr(request, "cache_salt", None) or None)
    return extra if extra else None


def _lora_id(lora: Any) -> str:
    """A LoRA adapter's name and path, as vLLM's own block hashes take them: a name pointed
    at another adapter (unloaded and loaded again, or on another engine) must not find the
    blocks the first one computed. An unnamed adapter stays unkeyable (``""``)."""
    name, path = lora.lora_name, getattr(lora, "lora_path", None)
    # (str: vLLM takes a pathlib.Path too, which JSON refuses; it keys as its text)
    return json.dumps([name, str(path) if path else ""]) if name else name


class SchedulerSide:
    def __init__(
        self,
        caches: list[Any],
        *,
        block_tokens: int,
        load: bool,
        save: bool,
        guard: StoreGuard,
        block_ids: Callable[[str], list[int]],
        lookup_wait_seconds: float | None = None,
        lookup_deadline_seconds: float | None = None,
        background_loads: bool = False,
        hold_finished: bool = False,
    ) -> None:
        self.caches = caches  # one per tensor-parallel rank (their keys differ)
        # None: each lookup in the call (an embedded cache answers from memory); else the
        # most the call waits for a lookup running on its own thread (see the module doc).
        self.lookup_wait = lookup_wait_seconds
        # The most a request waits for its lookup in all, over every ask (None: until the
        # client's own timeouts end it); past it the request goes on as a miss.
        self.lookup_deadline = lookup_deadline_seconds
        self._running: OrderedDict[str, _Lookup] = OrderedDict()  # req_id -> its ranks' lookups
        self._abandoned: list[_Lookup] = []  # lookups of requests finished before their answer
        self._pool: ThreadPoolExecutor | None = None
        # A hit is loaded between steps (vLLM's asynchronous load: the request waits, the
        # others run), not inside the step that first computes the request.
        self.background_loads = background_loads
        self._to_load: list[tuple[str, int, int]] = []  # (req_id, start, end) admitted since the last plan
        # A finished request that saved keeps its pages until the workers report it (a failed
        # save of it is sent again from them): those finished since the last plan.
        self.hold_finished = hold_finished
        self._held: list[tuple[str, list[int], int]] = []
        self.block_tokens = block_tokens
        self.load = load
        self.save = save
        self.guard = guard
        self.block_ids = block_ids
        self.stats = ConnectorStats()
        self._requests: dict[str, _Request] = {}
        self._lookups: OrderedDict[str, Hit] = OrderedDict()  # req_id -> what the store holds, until admitted
        self._unaligned: OrderedDict[str, None] = OrderedDict()  # req_ids counted in lookup_unaligned, until admitted

    # -- admission ---------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit) that can be loaded; None
        while the store's answer is awaited (``lookup_wait_seconds`` an ask at most, until
        ``lookup_deadline_seconds``)."""
        if not self.load or getattr(request, "skip_reading_prefix_cache", False):
            return 0
        if unsupported_reason(request) is not None:
            return 0
        prompt = request.prompt_token_ids
        limit = self._limit(prompt)
        if limit <= num_computed_tokens:
            return 0  # nothing the store could add: spare the lookup
        state = self._requests.get(request.request_id)
        if state is not None and state.loading:
            # Asked again before vLLM ever ran it: its load between steps failed from the
            # first block, and vLLM freed its blocks (_update_waiting_for_remote_kv).
            # Offered again, the load fails again for as long as its cause lasts (the
            # worker's guard resting, a chain the worker cannot read) and the request never
            # runs: it computes instead, as after a failed load within a step.
            return 0
        if num_computed_tokens % self.block_tokens:
            # (vLLM asks again each step it cannot admit the request: counted once)
            if request.request_id not in self._unaligned:
                self.stats.lookup_unaligned += 1
                _remember(self._unaligned, request.request_id, None)
            return 0  # a load would rewrite vLLM's own pages in the block its hit ends in
        hit = self._lookups.get(request.request_id)
        if hit is None:
            keys = lambda: request_keys(list(prompt[:limit]), extra_keys(request))  # noqa: E731
            if self.lookup_wait is None:
                hit = self._lookup(keys())
            else:
                hit = self._awaited(request.request_id, keys, self.lookup_wait)
            if hit is None:
                return None
            _remember(self._lookups, request.request_id, hit)
        return max(0, min(hit.tokens, limit) - num_computed_tokens)

    def _limit(self, prompt: list[int]) -> int:
        """The longest hit worth offering: whole blocks, leaving the last token to compute."""
        return (len(prompt) - 1) // self.block_tokens * self.block_tokens

    def _lookup(self, keys: Any) -> Hit:
        ticket = self.guard.allow()
        if ticket is None:
            self.stats.lookup_skipped += 1
            return NO_HIT
        self.stats.lookups += 1
        try:
            found = [cache.locate(keys) for cache in self.caches]
        except Exception as exc:  # noqa: BLE001 - a store that cannot answer is a miss, never a failed request
            return self._failed(exc, ticket)
        return self._found(found, ticket)

    def _awaited(self, req_id: str, keys: Callable[[], Any], wait_seconds: float) -> Hit | None:
        """The request's lookup, started on the pool if it is not running yet (every rank's
        at once), waited for ``wait_seconds`` (``lookup_wait``) at most: None if unanswered by then,
        a miss once it is late (``lookup_deadline``). The counts and the guard are kept
        here, in vLLM's scheduler thread."""
        self._hear_abandoned()
        lookup = self._running.get(req_id)
        if lookup is None:
            ticket = self.guard.allow()
            if ticket is None:
                self.stats.lookup_skipped += 1
                return NO_HIT
            self.stats.lookups += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(LOOKUP_THREADS * len(self.caches), thread_name_prefix="cacheseek-lookup")
            asked = keys()
            late_at = None if self.lookup_deadline is None else time.monotonic() + self.lookup_deadline
            started: list[float | None] = [None] * len(self.caches)
            answers = [self._pool.submit(_timed, cache.locate, asked, started, rank)
                       for rank, cache in enumerate(self.caches)]
            lookup = _Lookup(ticket, answers, late_at, started)
            self._abandoned += _remember(self._running, req_id, lookup)
        if lookup.late_at is not None:
            wait_seconds = max(0.0, min(wait_seconds, lookup.late_at - time.monotonic()))
        if wait(lookup.answers, timeout=wait_seconds).not_done:
            if lookup.late_at is None or time.monotonic() < lookup.late_at:
                self.stats.lookups_deferred += 1
                return None
            del self._running[req_id]
            return self._late(lookup)
        del self._running[req_id]
        try:
            return self._found([f.result() for f in lookup.answers], lookup.ticket)
        except Exception as exc:  # noqa: BLE001 - a store that cannot answer is a miss, never a failed request
            return self._failed(exc, lookup.ticket)

    def _late(self, lookup: _Lookup) -> Hit:
        """A lookup past its deadline: a miss, remembered as the request's until it is
        admitted (forgotten here, its answer is never offered, so vLLM never loads a request
        it scheduled as a miss). What it tells the guard depends on why it is late. A rank's
        lookup that has run three quarters of the deadline at least on its thread is the server's slowness: a
        failure, so the server rests and the next requests skip their lookups rather than
        each wait out its deadline. One that waited for a thread (a burst of new requests
        behind the pool's 8) says nothing of the server: queued still, it is cancelled and
        never sent; running, its outcome is told when it ends, as a finished request's is.
        (Taken as a failure, a burst against a healthy server rested it, and the requests
        after were misses too.)"""
        self.stats.lookups_late += 1
        assert self.lookup_deadline is not None
        assert lookup.late_at is not None
        # Begun within the deadline's first quarter, and unanswered: the server's slowness (it
        # has run three quarters of the deadline at least). "Run the whole deadline" missed a
        # hung server by the few ms a pool thread takes to start.
        began_by = lookup.late_at - self.lookup_deadline * 3 / 4  # (asked at late_at - deadline)
        if any(not answer.done() and began is not None and began <= began_by
               for answer, began in zip(lookup.answers, lookup.started)):
            for answer in lookup.answers:
                answer.cancel()
            late = TimeoutError(f"no answer within lookup_deadline_seconds ({self.lookup_deadline} s); the request "
                                "goes on as a miss")
            self.guard.failure("lookup", late, lookup.ticket)
            return NO_HIT
        cancelled = [answer.cancel() for answer in lookup.answers if not answer.done()]  # (every rank's: no all())
        if all(cancelled):
            self.guard.unsent(lookup.ticket)
        else:  # (one running, or begun since: told when it ends, a rank cancelled meanwhile no news)
            self._abandoned.append(lookup)
        return NO_HIT

    def _hear_abandoned(self) -> None:
        """Tell the guard how the lookups of requests finished before their answer ended:
        one may be the resting guard's probe, which, unanswered, kept it refusing every
        lookup for its probe timeout."""
        left = []
        for lookup in self._abandoned:
            if not all(f.done() for f in lookup.answers):
                left.append(lookup)
                continue
            ran = [f for f in lookup.answers if not f.cancelled()]  # (a late lookup's queued ranks: cancelled)
            if (exc := next((f.exception() for f in ran if f.exception() is not None), None)) is not None:
                self.guard.failure("lookup", exc, lookup.ticket)
            elif ran:
                self.guard.success(lookup.ticket)
            else:
                self.guard.unsent(lookup.ticket)
        self._abandoned = left

    def _found(self, found: list[Any], ticket: Ticket) -> Hit:
        self.guard.success(ticket)
        shortest = min(found, key=lambda f: f.num_tokens)
        return Hit(shortest.num_tokens, tuple(shortest.tiers))

    def _failed(self, exc: BaseException, ticket: Ticket) -> Hit:
        self.stats.lookup_errors += 1
        self.guard.failure("lookup", exc, ticket)
        return NO_HIT

    def close(self) -> None:
        """Stop the lookup threads (those running finish on their own, unawaited)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM admitted ``request`` and took ``num_external_tokens`` of the offered hit."""
        state = self._requests.get(request.request_id)
        if state is not None and state.loading and not num_external_tokens:
            # Admitted again once its load between steps has ended (whole, short, or failed
            # from the first block and asked again): it goes on from what the load wrote,
            # which the store holds. Started over, its first step saved the loaded prefix
            # again (encoded and looked up on every rank, to be found present); plan()
            # sets ``saved`` back to where vLLM resumes it.
            self._unaligned.pop(request.request_id, None)
            return
        hit = self._lookups.pop(request.request_id, NO_HIT)
        self._unaligned.pop(request.request_id, None)
        supported = unsupported_reason(request) is None
        extra = extra_keys(request) if supported else None
        if request.request_id not in self._requests:  # (a preempted request admitted again: one request)
            if not supported:
                self.stats.requests_unsupported += 1
            elif extra is not None:
                self.stats.requests_keyed += 1
        prompt = list(request.prompt_token_ids) if supported else []
        # A request admitted again after a preemption starts over.
        state = self._requests[request.request_id] = _Request(prompt, supported, extra,
                                                              load_tokens=num_external_tokens, hit=hit,
                                                              request=request)
        self.stats.lookup_hit_tokens += num_external_tokens
        if self.background_loads and num_external_tokens and supported:
            end = min(hit.tokens, self._limit(prompt))  # where the offered hit, so the load, ends
            self._to_load.append((request.request_id, end - num_external_tokens, end))
            state.load_tokens, state.saved, state.loading = 0, end, True

    def hit_tiers(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """Of the last ``num_external_tokens`` of the request's hit, how many each tier holds."""
        state = self._requests.get(request.request_id)
        if state is None or not num_external_tokens:
            return {}
        end = min(state.hit.tokens, self._limit(state.prompt))  # where the offered hit, so the load, ends
        start = end - num_external_tokens
        counts: dict[str, int] = {}
        for i, tier in enumerate(state.hit.tiers):
            a, b = max(start, i * self.block_tokens), min(end, (i + 1) * self.block_tokens)
            if b > a:
                counts[tier] = counts.get(tier, 0) + b - a
        return counts

    def finished(self, request: Any, block_ids: Sequence[int] = ()) -> bool:
        """vLLM finished ``request``, whose computed tokens ``block_ids`` hold; whether vLLM
        is to keep those pages until the workers report it (``hold_finished``: it saved)."""
        running = self._running.pop(request.request_id, None)
        if running is not None:
            self._abandoned.append(running)  # (its answer still goes to the guard)
            self._hear_abandoned()
        self._lookups.pop(request.request_id, None)
        self._unaligned.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        # (no blocks: preempted, then finished before it ran again; its pages are gone)
        if not (self.hold_finished and state is not None and state.saving and block_ids):
            return False
        tokens = min(int(request.num_computed_tokens), len(state.prompt))
        self._held.append((request.request_id, list(block_ids), tokens))
        return True

    def blocks_after(self, invalid: set[int]) -> set[int]:
        """The vLLM blocks ``invalid`` and, for each request holding one, every block of its
        after the first (computed over it)."""
        out = set(invalid)
        for req_id in self._requests:
            try:
                ids = self.block_ids(req_id)
            except Exception:  # noqa: BLE001 - (a request vLLM no longer holds blocks for)
                continue
            first = next((i for i, b in enumerate(ids) if b in invalid), None)
            if first is not None:
                out.update(ids[first:])
        return out

    def roll_back_sharers(self, invalid: set[int], block_size: int) -> int:
        """Set every request that counts one of the ``invalid`` vLLM blocks (``block_size``
        tokens each) as computed back to the first of them; how many were set back.

        vLLM ("recompute", ``Scheduler._update_requests_with_invalid_blocks``) rolls back
        only the first request holding a reported block; another that holds it (it took
        the blocks a load was about to write as its own prefix hit, in the same step) is
        set back to where it stood before the step, the block still counted as computed,
        for the first to recompute. Aborted, preempted or outrun (a chunked recompute)
        first, nothing writes it before the other reads it again. Each recomputes it now
        (twice in one forward at worst, into the same pages); called after vLLM's own
        rollback, the first request's count is already there."""
        rolled = 0
        for req_id, state in self._requests.items():
            request = state.request
            if request is None:
                continue
            try:
                ids = self.block_ids(req_id)
            except Exception:  # noqa: BLE001 - (a request vLLM no longer holds blocks for)
                continue
            computed = -(-request.num_computed_tokens // block_size)
            first = next((i for i, b in enumerate(ids[:computed]) if b in invalid), None)
            if first is not None and request.num_computed_tokens > first * block_size:
                request.num_computed_tokens = first * block_size
                rolled += 1
        self.stats.load_failure_rollbacks += rolled
        return rolled

    # -- each step ---------------------------------------------------------------------

    def plan(self, scheduler_output: Any) -> StepPlan:
        """Loads for requests scheduled with an external hit, saves for prompts whose full
        blocks this step completes."""
        plan = StepPlan()
        for req_id, start, end in self._to_load:
            state = self._requests.get(req_id)
            if state is not None:  # (not finished meanwhile)
                plan.background_loads.append(LoadSpec(req_id, state.prompt[:end], self.block_ids(req_id), start=start,
                                                      extra=state.extra))
        self._to_load.clear()
        plan.held, self._held = self._held, []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not state.supported:
                continue
            before = computed.get(req_id)
            if before is None:
                continue
            state.loading = False
            if state.load_tokens:
                # vLLM counts the loaded tokens as computed already: they end at `before`.
                plan.loads.append(LoadSpec(req_id, state.prompt[:before], self.block_ids(req_id),
                                           start=before - state.load_tokens, extra=state.extra))
                state.load_tokens = 0
                state.saved = max(state.saved, before)  # the store holds them
            elif before < state.saved:
                # vLLM rolled the request back (a load failed): save what it recomputes.
                state.saved = before // self.block_tokens * self.block_tokens
            if not self.save:
                continue
            full = min(before + scheduled, len(state.prompt)) // self.block_tokens * self.block_tokens
            if full > state.saved:
                # From where the earlier steps' saves ended: each chunk's blocks are encoded
                # and sent once, not the whole prefix again (a save that failed is the
                # worker's to send again: WorkerSide.save).
                start = state.saved // self.block_tokens * self.block_tokens
                plan.saves.append(SaveSpec(req_id, state.prompt[:full], self.block_ids(req_id), extra=state.extra,
                                           start=start, computed=before))
                state.saved = full
                state.saving = True
        return plan


def _timed(locate: Callable[[Any], Any], asked: Any, started: list[float | None], rank: int) -> Any:
    """``locate(asked)`` on a pool thread, its start noted: how long a late lookup waited for
    a thread, and how long the server took, are told apart (``_late``)."""
    started[rank] = time.monotonic()
    return locate(asked)


def _remember(pending: OrderedDict[str, Any], req_id: str, value: Any) -> list[Any]:
    """Keep ``value`` for a request vLLM has not admitted yet, the oldest dropped past
    ``MAX_PENDING_LOOKUPS`` (a request vLLM never admits nor finishes); the values dropped."""
    pending[req_id] = value
    dropped = []
    while len(pending) > MAX_PENDING_LOOKUPS:
        dropped.append(pending.popitem(last=False)[1])
    return dropped


__all__ = ["SchedulerSide", "extra_keys", "unsupported_reason"]
