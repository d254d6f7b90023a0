"""The worker side: carry out a step's plan against the pages vLLM registered.

Each step is two calls on the engine surface, whatever the number of requests in it: a
``materialize_into_batch`` for every load, and an ``ingest_batch`` for every save, after
the forward (``wait_for_save``). Both read and write vLLM's pages in place (``cs.KVPages``),
decoded and encoded there: no contiguous copy of the KV.

A step's load runs one of two ways (``ConnectorConfig.layerwise_load``):

- **layer by layer** (``layerwise_load`` true, or "auto" where vLLM's pages are on a GPU; an
  embedded cache only): ``start_load_kv`` starts the
  load as one ``LayerwiseLoad`` (the frames fetched, the decodes issued: on a GPU queued on
  side streams, an event per layer group; on a CPU each group decoded when a layer of it is
  first waited for), and each attention layer's ``wait_for_layer_load`` waits for its
  layer on the forward's stream, so the forward of layer ``i`` overlaps the load of the
  layers after it. The handle is closed (its staging and frames given back) at the end
  of the step: ``wait_for_save``, or at the latest when vLLM asks for the failed blocks or
  the next step starts;
- **whole** (the default): every layer written before the forward starts (``start_load_kv``).

A step's saves likewise (``ConnectorConfig.layerwise_save``): **layer by layer**, the
writer (``ingest_batch(..., layerwise=True)``) is made at the step's first
``save_kv_layer`` (the requests hashed, CPU-tier slots reserved for their new blocks:
not in ``start_load_kv``, which vLLM calls after the forward in a step without a
synchronous load), each attention layer's ``save_kv_layer`` encodes that layer of them
into the slots, and ``wait_for_save`` checks and commits; or **whole** (the default): one
``ingest_batch`` in ``wait_for_save``. A layer-wise save that cannot finish as such (a
layer never fed, a load of one of its requests failed, the writer raised) is dropped for a
whole save of the same requests in ``wait_for_save``: the pages still hold their KV then.

With a remote cache and ``background_loads``, and with any cache under vLLM's
asynchronous scheduling (connector.py), a step's hits are loaded between steps
instead (an embedded cache's inside ``start_load_kv``, no thread): ``start_load_kv`` hands them to a loader thread (one
``materialize_into_batch``, decoded on a stream of its own and waited for there) and
returns; ``get_finished`` reports each request once its load is done, whatever it wrote,
its missing blocks in ``get_block_ids_with_load_errors`` in the same pass; vLLM holds the
request back meanwhile and runs the others.

Every load follows the scheduler's ``locate`` of its request, the lookup a server counts
for its hit rate: loads say so (``located=True``), so a hit is counted once, as a miss is.

With a remote cache (``background_saves``, the default) a whole save returns once the
step's new blocks are encoded and their frames are in host memory: the pages are vLLM's
again, and the server's lookup and the upload follow on the client's sender thread
(``RemoteCache.ingest_batch(..., wait=False)``). Its outcome is counted when it is
known, at a later step (or at shutdown, which sends what is queued).

Neither ever raises into vLLM: a load that falls short, for any reason (the call raised,
the server is down, a block was evicted or found corrupt since the lookup), reports the
vLLM blocks from the first missing token to the end of the load, and vLLM (with
``kv_load_failure_policy: "recompute"``) rolls the request back to the block before and
computes the rest. A layer-wise load that fails part way (a layer group's decode raised)
has written some layers of its blocks and not others: every block of every load of the
step is reported, from each load's start, even if the forward has read some layers of
them by then (the step's output for those requests is then discarded by vLLM, as for any
failed load; see docs/vllm.md). A save starts where the request's earlier saves ended
(``SaveSpec.start``: chunked prefill stores each chunk's blocks once). A save that fails
is dropped (its blocks go again with the request's next save, ``_resave_from``; a last
save's are sent again from its pages once it has finished, below); so is the save of a
request whose load failed in the same step, because its new KV was computed over the
missing blocks, and of any request whose blocks include those (a prefix hit vLLM gave it on
the blocks being loaded).

A request's last save has no next one. With a server (``resave_hold_seconds``), vLLM keeps
a finished request's pages for the workers (``request_finished`` returned True; the
scheduler names it in ``StepPlan.held``): each worker reports it (``get_finished``'s
finished sending) at once where its saves were stored, else once its answers have come and
a save of it that failed has been sent again from those pages, once, when the guard lets it
(a failure rests the guard ``retry_after_seconds``); ``resave_hold_seconds`` after it
finished at the latest, sent again or not.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from ...pages import PagedRequest
from ...store.breaker import Ticket
from ...store.streams import on_stream, work_stream
from .guard import StoreGuard, log
from .pages import VllmPages
from .plan import LoadSpec, SaveSpec, StepPlan
from .stats import ConnectorStats

@dataclass(slots=True)
class RunningLoad:
    """A step's layer-wise load while the forward runs: the handle it waits on per layer."""

    specs: list[LoadSpec]
    handle: Any  # a LayerwiseLoad over every load of the step
    written: list[int]  # per load, the end of what the handle writes into its pages
    waited: list[bool]  # per layer: the forward waited for it (wait_for_layer_load)
    seconds: float = 0.0  # host time in the load's calls (start, waits, close)
    error: BaseException | None = None
    read_before_error: bool = False  # the forward had read some layers when it failed
    missing: list[int] = field(default_factory=list)  # layers the forward never waited for


@dataclass(slots=True)
class HeldRequest:
    """A finished request whose pages vLLM keeps until this worker reports it."""

    block_ids: list[int]
    tokens: int  # of its prompt, computed into those pages
    deadline: float  # (time.monotonic()) reported by then, whatever is still unsaved
    resent: bool = False


@dataclass(slots=True)
class RunningSave:
    """A step's layer-wise save while the forward runs: the writer each layer is fed to."""

    plan: StepPlan  # the step's (the connector metadata bound for it)
    writer: Any  # a PagedLayerwiseSave over every save of the step; None: the step saves whole
    specs: list[SaveSpec] = field(default_factory=list)  # the plan's saves, from where each must start
    ticket: Ticket | None = None  # the guard's, for the writer's outcome
    seconds: float = 0.0  # host time in the save's calls (start, the layers, finish)
    error: BaseException | None = None


class WorkerSide:
    def __init__(self, cache: Any, *, guard: StoreGuard, layerwise: bool = False,
                 layerwise_save: bool = False, planned_ahead: bool = False, background_saves: bool = False,
                 background_loads: bool = False, loader_thread: bool = True,
                 resave_hold_seconds: float = 0.0, saves: bool = True, look_up_wait: float = 0.01) -> None:
        self.cache = cache
        # The most a background save's lookup made first holds the step (a server slower
        # than this: every block encoded, as without it). vLLM's forward waits for it.
        self.look_up_wait = look_up_wait
        # False: this worker stores nothing (an MLA model's ranks past 0: rank 0 stores the
        # latent they all hold); its loads run as any worker's.
        self.saves = saves
        self.guard = guard
        self.background_saves = background_saves  # a whole save's upload left to the cache's sender
        self._sending: list[tuple[list[SaveSpec], Ticket, Future]] = []  # those saves, until their answer is counted
        # Per request, the first token of a save that failed (or was dropped) and that no
        # save since has covered: a save starts at the scheduler's SaveSpec.start (where its
        # earlier saves ended), so what they lost is sent again from here by its next one.
        self._resave_from: dict[str, int] = {}
        # A finished request's lost save is sent again from its pages, which vLLM keeps for
        # this long at most (0: it frees them at once, and a last save's loss stands).
        self.resave_hold_seconds = resave_hold_seconds
        self._last_save: dict[str, SaveSpec] = {}  # per running request, its latest save (hold on)
        self._held: dict[str, HeldRequest] = {}
        self.background_loads = background_loads
        self._loading: list[tuple[list[LoadSpec], Ticket | None, Future]] = []  # loads between steps, until reported
        self._loader: ThreadPoolExecutor | None = None
        # False: the loads between steps run inside start_load_kv (an embedded cache under
        # vLLM's asynchronous scheduling, connector.py), reported done at the step's end.
        self.loader_thread = loader_thread
        self.layerwise = layerwise  # a step's load as one LayerwiseLoad, waited for per layer
        self.layerwise_save = layerwise_save  # a step's saves fed layer by layer (save_kv_layer)
        self._saving: RunningSave | None = None
        self.last_save_fallback: str | None = None  # why the last layer-wise save was saved whole
        self.stats = ConnectorStats()
        self.pages: VllmPages | None = None
        self._running: RunningLoad | None = None
        self._unclosed: Any = None  # a finished step's LayerwiseLoad on a GPU, closed at the next step
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # this step's: their saves are dropped
        self._unwritten: set[int] = set()  # this step's vLLM blocks a load failed to write
        # vLLM's asynchronous scheduling plans step s + 1 before it learns that a load of step
        # s fell short: s + 1 still runs the request on (its next chunk, over the unwritten
        # pages) and shares the blocks with others as written. Its saves are judged by step
        # s's failures too; from s + 2 on, vLLM has rolled the requests back.
        self.planned_ahead = planned_ahead
        self._carried: tuple[set[str], set[int]] = (set(), set())  # the previous step's failures

    def register(self, pages: VllmPages) -> None:
        self.pages = pages

    def start_step(self, plan: StepPlan) -> None:
        self.end_load()  # (ended by the previous step's wait_for_save already, normally)
        self.take_sent()
        if self.planned_ahead:
            self._carried = (self._failed_requests, self._unwritten)
            self._failed_requests, self._unwritten = set(), set()
        else:
            self._failed_requests.clear()
            self._unwritten.clear()
        if plan.loads:
            if self.layerwise:
                self.start_load(plan.loads)
            else:
                self.load(plan.loads)
        if plan.background_loads:
            self._load_in_background(plan.background_loads)
        deadline = time.monotonic() + self.resave_hold_seconds
        for req_id, block_ids, tokens in plan.held:
            self._held[req_id] = HeldRequest(block_ids, tokens, deadline)

    def finish_step(self, plan: StepPlan) -> None:
        self.end_load()  # before the saves: a load that failed drops its request's save
        self.take_sent()
        if not self.saves:
            return
        saves = []
        for spec in plan.saves:
            if self.resave_hold_seconds:
                self._last_save[spec.req_id] = spec
            if self._reads_unwritten(spec):
                self.stats.saves_skipped += 1
                self._lost([spec])
            else:
                saves.append(spec)
        if self._finish_save(plan):
            return
        if saves:
            self.save(saves)

    def _reads_unwritten(self, spec: SaveSpec) -> bool:
        """Whether the KV ``spec`` would store was computed over pages a load of this step
        (planned ahead: or of the previous step) failed to write: its own load's, or another
        request's whose blocks it shares (vLLM hands the blocks a load is about to write to
        a request scheduled after it in the same step, as its own prefix hit; it then
        recomputes them, but its saves would store what the forward read, under the right
        keys)."""
        upto = -(-len(spec.token_ids) // self._pages().fmt.block_size)
        for failed, unwritten in ((self._failed_requests, self._unwritten), self._carried):
            if spec.req_id in failed or not unwritten.isdisjoint(spec.block_ids[:upto]):
                return True
        return False

    def take_failed_blocks(self) -> set[int]:
        self.end_load()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- a step's load, layer by layer ---------------------------------------------------

    def start_load(self, specs: list[LoadSpec]) -> None:
        """Start the step's loads as one layer-wise ``materialize_into_batch``; the forward
        then waits per layer (``wait_layer``) and ``end_load`` closes it. A call that raises
        fails every load, as in ``load``."""
        pages = self._pages()
        t0 = time.perf_counter()
        self.stats.load_layerwise_calls += 1
        nothing = [spec.start for spec in specs]
        ticket = self.guard.allow()
        if ticket is None:
            self.stats.loads_refused += len(specs)
            self._account(specs, nothing, time.perf_counter() - t0)
            return
        try:
            handle = self.cache.materialize_into_batch(self._requests(specs, pages), pages.engine, layerwise=True,
                                                          located=True)
            written = [max(spec.start, min(got.num_tokens, spec.end)) for spec, got in zip(specs, handle.requests)]
            self.guard.success(ticket)
        except Exception as exc:  # noqa: BLE001 - vLLM recomputes what did not arrive
            self.stats.load_errors += len(specs)
            self.guard.failure("load", exc, ticket)
            self._account(specs, nothing, time.perf_counter() - t0)
            return
        if written == nothing:  # nothing to write (every prefix gone since the lookup)
            handle.close()
            self._account(specs, written, time.perf_counter() - t0)
            return
        self._running = RunningLoad(specs, handle, written, [False] * pages.num_layers,
                                    seconds=time.perf_counter() - t0)

    def wait_layer(self, layer: int) -> None:
        """Make the forward wait for ``layer`` of the step's load (on a GPU an event wait on
        its current stream; on a CPU the layer's group is decoded now if it is not yet).
        Never raises: a failure marks the load, ``end_load`` reports it."""
        run = self._running
        if run is None or run.error is not None:
            return
        t0 = time.perf_counter()
        try:
            run.handle.wait(layer)
            run.waited[layer] = True
        except Exception as exc:  # noqa: BLE001 - reported as failed blocks, recomputed by vLLM
            run.error = exc
            run.read_before_error = any(run.waited)
        run.seconds += time.perf_counter() - t0

    def end_load(self) -> None:
        """End the step's layer-wise load and count it; a load that failed, or whose layers
        the forward did not all wait for, reports every block it was to write. The handle is
        closed (every layer in, the store's memory given back) here, or, on a GPU whose last
        groups are still running, when the next step starts: every group is issued by then,
        so its failures are known, and the forward's stream waits for each layer; the host
        need not wait for the device at the end of the step."""
        self._close_unclosed()
        run, self._running = self._running, None
        if run is None:
            return
        t0 = time.perf_counter()
        run.error = run.error or run.handle.error
        if run.error is None and not all(run.waited):
            # The forward did not call wait_for_layer_load for these layers (an attention
            # path without vLLM's hook): it may have read their pages before they were
            # written. Recompute, and load whole from now on.
            run.missing = [i for i, w in enumerate(run.waited) if not w]
            run.error = RuntimeError(f"vLLM did not wait for layers {run.missing[:8]} of a layer-wise load; "
                                     "loading whole steps from now on")
            self.layerwise = False
        if run.error is None and run.handle.device.type == "cuda" and not run.handle.done():
            self._unclosed = run.handle
        else:
            try:
                run.handle.close()
            except Exception as exc:  # noqa: BLE001
                run.error = run.error or exc
            run.error = run.error or run.handle.error
        written = run.written
        if run.error is not None:
            self.stats.load_errors += len(run.specs)
            self.guard.failure("layer-wise load", run.error)
            written = [spec.start for spec in run.specs]
            if run.read_before_error:
                self.stats.load_late_failures += sum(w > spec.start for w, spec in zip(run.written, run.specs))
        self._account(run.specs, written, run.seconds + time.perf_counter() - t0)

    def _close_unclosed(self) -> None:
        handle, self._unclosed = self._unclosed, None
        if handle is not None:
            try:
                handle.close()
            except Exception as exc:  # noqa: BLE001 - (a device error: vLLM's own next call meets it)
                self.guard.failure("closing a layer-wise load", exc)

    # -- loads between steps -------------------------------------------------------------

    def _load_in_background(self, specs: list[LoadSpec]) -> None:
        """Start loading ``specs`` on the loader thread (the forward runs on meanwhile)."""
        pages = self._pages()
        ticket = self.guard.allow()
        if ticket is None:  # (no call made: the guard hears nothing of it)
            self._loading.append((specs, None, _done(([spec.start for spec in specs], _REFUSED, 0.0))))
            return
        if not self.loader_thread:
            self._loading.append((specs, ticket, _done(self._load_between_steps(specs, pages))))
            return
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheseek-load")
        self._loading.append((specs, ticket, self._loader.submit(self._load_between_steps, specs, pages)))

    def _load_between_steps(self, specs: list[LoadSpec], pages: VllmPages
                            ) -> tuple[list[int], BaseException | None, float]:
        """On the loader thread: the loads' ends (as ``load``'s), the error, if any, and
        the seconds. On a GPU the decodes run on a stream of this thread's, waited for here:
        what is reported finished is in its pages."""
        t0 = time.perf_counter()
        try:
            requests = self._requests(specs, pages)  # (raising here too is a failed load, never vLLM's error)
            if pages.device.type == "cuda":
                stream = work_stream("load_between_steps", pages.device)
                with on_stream(stream):
                    got = self.cache.materialize_into_batch(requests, pages.engine, located=True)
                stream.synchronize()
            else:
                got = self.cache.materialize_into_batch(requests, pages.engine, located=True)
            written = [max(spec.start, min(g.num_tokens, spec.end)) for spec, g in zip(specs, got)]
            return written, None, time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - vLLM recomputes what did not arrive
            return [spec.start for spec in specs], exc, time.perf_counter() - t0

    def take_loaded(self) -> set[str]:
        """The requests whose loads between steps are done, counted (a load that fell short
        reports its blocks in ``take_failed_blocks``, which vLLM asks next, in the same pass)."""
        done: set[str] = set()
        waiting = []
        for specs, ticket, future in self._loading:
            if not future.done():
                waiting.append((specs, ticket, future))
                continue
            written, error, seconds = future.result()
            # A call that wrote nothing (the prefix gone since the lookup) is an answer all
            # the same: the resting guard's probe, if it was one, which unanswered kept the
            # guard refusing every call for its probe timeout.
            if error is None:
                self.guard.success(ticket)
            elif error is _REFUSED:
                self.stats.loads_refused += len(specs)
            else:
                # (how long it ran: a timeout's, or at once, tells a slow server from a refusal)
                self.stats.load_errors += len(specs)
                self.guard.failure(f"load between steps ({len(specs)} requests, {seconds:.1f} s)", error, ticket)
            self._account(specs, written, seconds)
            self.stats.load_background_calls += 1
            done.update(spec.req_id for spec in specs)
        self._loading = waiting
        return done

    def close(self, timeout: float | None = None) -> None:
        """Wait for the loads between steps still running (their pages are being written),
        ``timeout`` seconds at most (None: for good): a load stuck on a hung server is bounded
        only by the client's timeouts, up to its exchange timeout for one that trickles
        bytes, and an engine shutting down should not wait that long."""
        if self._loader is None:
            return
        wait([future for _, _, future in self._loading], timeout=timeout)
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- one step's calls --------------------------------------------------------------

    def load(self, specs: list[LoadSpec]) -> list[int]:
        """Write the stored tokens ``[spec.start, spec.end)`` of every load into its pages, in
        one ``materialize_into_batch``; returns, per load, the end of what is in its pages
        (``spec.end`` when all of it arrived)."""
        pages = self._pages()
        t0 = time.perf_counter()
        written = [spec.start for spec in specs]
        ticket = self.guard.allow()
        if ticket is None:
            self.stats.loads_refused += len(specs)
        else:
            try:
                got = self.cache.materialize_into_batch(self._requests(specs, pages), pages.engine, located=True)
                written = [max(spec.start, min(g.num_tokens, spec.end)) for spec, g in zip(specs, got)]
                self.guard.success(ticket)
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes what did not arrive
                written = [spec.start for spec in specs]
                self.stats.load_errors += len(specs)
                self.guard.failure("load", exc, ticket)
        self._account(specs, written, time.perf_counter() - t0)
        return written

    @staticmethod
    def _requests(specs: list[LoadSpec], pages: VllmPages) -> list[PagedRequest]:
        return [PagedRequest(spec.keys, pages.page_table(spec.block_ids, spec.end), max_tokens=spec.end,
                             start=spec.start) for spec in specs]

    def _account(self, specs: list[LoadSpec], written: list[int], seconds: float) -> None:
        """Count a step's loads; a load that ended short of ``spec.end`` reports its vLLM
        blocks from the first token not written to the end of the load."""
        pages = self._pages()
        self.stats.load_calls += 1
        self.stats.load_seconds += seconds
        for spec, end in zip(specs, written):
            self.stats.load_tokens += end - spec.start
            if end >= spec.end:
                self.stats.loads += 1
                continue
            block = pages.fmt.block_size
            failed = spec.block_ids[end // block : -(-spec.end // block)]
            self._failed_blocks.update(failed)
            self._unwritten.update(failed)
            self._failed_requests.add(spec.req_id)
            self.stats.load_failures += 1
            self.stats.load_failed_tokens += spec.end - end
            self.stats.load_failed_blocks += len(failed)

    def save(self, specs: list[SaveSpec]) -> None:
        """Store the full blocks of every save from its pages, from its start on (or from
        where an earlier save of its request was lost), in one ``ingest_batch`` (blocks
        already stored are not encoded again)."""
        pages = self._pages()
        specs = self._resaved(specs)
        ticket = self.guard.allow()
        if ticket is None:
            self.stats.save_failures += len(specs)
            self._lost(specs)
            return
        t0 = time.perf_counter()
        try:
            if self.background_saves:
                first = self._mostly_served(specs)
                self.stats.save_lookups_first += first
                self._sending.append((specs, ticket, self.cache.ingest_batch(
                    self._save_requests(specs, pages), pages.engine, wait=False, look_up_first=first,
                    look_up_wait=self.look_up_wait)))
            else:
                self._saved(specs, self.cache.ingest_batch(self._save_requests(specs, pages), pages.engine), ticket)
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss, not a failed request
            self._save_failed(specs, exc, ticket)
        self.stats.save_calls += 1
        self.stats.save_seconds += time.perf_counter() - t0

    def _mostly_served(self, specs: list[SaveSpec]) -> bool:
        """Whether at least half the blocks ``specs`` save were not computed in the step
        (vLLM's own prefix cache served them): an earlier request most likely stored them,
        and one round trip before encoding spares encoding them. A shared system prompt's
        block or two before a fresh prompt is not worth the round trip in the step."""
        B = self.cache.block_tokens
        served = saved = 0
        for spec in specs:
            end, start = len(spec.token_ids) // B, spec.start // B
            saved += max(0, end - start)
            served += max(0, min(spec.computed // B, end) - start)
        return served > 0 and 2 * served >= saved

    def take_sent(self) -> None:
        """Count the background saves whose answer has come (in the worker's thread, as
        every other count)."""
        waiting = []
        for specs, ticket, future in self._sending:
            if not future.done():
                waiting.append((specs, ticket, future))
            elif (error := future.exception()) is not None:
                self._save_failed(specs, error, ticket)
            else:
                self._saved(specs, future.result(), ticket)
        self._sending = waiting

    def _saved(self, specs: list[SaveSpec], results: list[Any], ticket: Ticket) -> None:
        self.guard.success(ticket)
        self._account_save(specs, results)

    def _save_failed(self, specs: list[SaveSpec], exc: BaseException, ticket: Ticket | None) -> None:
        self.stats.save_failures += len(specs)
        self._lost(specs)
        self.guard.failure("save", exc, ticket)

    def _resaved(self, specs: list[SaveSpec]) -> list[SaveSpec]:
        """``specs``, each starting where an earlier save of its request was lost, if that
        is before its own start."""
        out = []
        for spec in specs:
            lost = self._resave_from.get(spec.req_id)
            out.append(replace(spec, start=lost) if lost is not None and lost < spec.start else spec)
        return out

    def _lost(self, specs: list[SaveSpec]) -> None:
        """The blocks of ``specs`` are not stored (a save failed, or was dropped): the next
        save of each request sends them again."""
        for spec in specs:
            self._resave_from[spec.req_id] = min(spec.start, self._resave_from.get(spec.req_id, spec.start))
        while len(self._resave_from) > MAX_RESAVES:  # (requests never reported finished)
            del self._resave_from[next(iter(self._resave_from))]

    def _stored(self, spec: SaveSpec) -> None:
        """``spec`` was stored whole: a loss of its request's from ``spec.start`` on is made
        good (later tokens are the scheduler's next saves'); one from before it, which a
        save made before that loss was known did not cover, is not."""
        if self._resave_from.get(spec.req_id, -1) >= spec.start:
            del self._resave_from[spec.req_id]

    def forget(self, req_ids: set[str]) -> None:
        """vLLM finished ``req_ids``: no save of theirs comes again (those whose pages it
        holds for this worker: once they are released, ``take_released``)."""
        for req_id in req_ids:
            if req_id not in self._held:
                self._resave_from.pop(req_id, None)
                self._last_save.pop(req_id, None)
        while len(self._last_save) > MAX_RESAVES:  # (requests never reported finished)
            del self._last_save[next(iter(self._last_save))]

    def take_released(self) -> set[str]:
        """The finished requests whose pages vLLM may free now: their saves' answers have
        come and a lost one has been sent again (and answered), or their time is up."""
        if not self._held:
            return set()
        self.take_sent()
        now = time.monotonic()
        released = set()
        for req_id, held in list(self._held.items()):
            if now < held.deadline and self._settling(req_id, held):
                continue
            del self._held[req_id]
            self._resave_from.pop(req_id, None)
            self._last_save.pop(req_id, None)
            released.add(req_id)
        return released

    def _settling(self, req_id: str, held: HeldRequest) -> bool:
        """Whether ``req_id``'s pages are still wanted: a save of it awaits its answer, or
        one that failed is to be sent again (once the guard lets it, if that is before the
        hold ends), or just was."""
        if any(spec.req_id == req_id for specs, _, _ in self._sending for spec in specs):
            return True
        lost, spec = self._resave_from.get(req_id), self._last_save.get(req_id)
        if lost is None or spec is None or held.resent:
            return False
        end = min(len(spec.token_ids), held.tokens)  # (the save stores its whole store blocks)
        if end <= lost:
            return False  # (nothing whole of what was lost is in the pages vLLM kept)
        rest = self.guard.rest_seconds()
        if rest > 0:
            # A server resting past the hold (down, its wait grown) gets no resend in time:
            # the pages go back now, so that an outage does not hold every finished
            # request's pages for the whole hold.
            return time.monotonic() + rest < held.deadline
        held.resent = True
        self.stats.save_resends += 1
        self.save([SaveSpec(req_id, spec.token_ids[:end], held.block_ids, extra=spec.extra, start=lost)])
        return True

    # -- a step's saves, layer by layer --------------------------------------------------

    def save_layer(self, layer: int, plan: StepPlan) -> None:
        """vLLM has written layer ``layer`` of the step's pages: encode it into the slots.
        The step's first call makes the writer (the requests hashed, slots reserved for
        their new blocks). Never raises: a save that goes wrong is saved whole in
        ``wait_for_save``."""
        if not (self.layerwise_save and self.saves and plan.saves):
            return
        running = self._saving
        if running is not None and running.plan is not plan:
            self.end_save()  # a step that never reached wait_for_save
            running = None
        if running is None:
            running = self._saving = self._start_save(plan)
        if running.writer is None or running.error is not None:
            return
        t0 = time.perf_counter()
        try:
            running.writer.put_layer(layer)
        except Exception as exc:  # noqa: BLE001 - dropped for a whole save in wait_for_save
            running.error = exc
            running.writer.abort()
        running.seconds += time.perf_counter() - t0

    def _start_save(self, plan: StepPlan) -> RunningSave:
        """The step's writer; where it would not write into slots (nothing new worth them),
        or cannot be made, none: the step saves whole in ``wait_for_save``."""
        running = RunningSave(plan, None, self._resaved(plan.saves))
        pages = self._pages()
        running.ticket = self.guard.allow()
        if running.ticket is None:
            return running  # (wait_for_save's whole save counts it)
        t0 = time.perf_counter()
        try:
            running.writer = self.cache.ingest_batch(self._save_requests(running.specs, pages), pages.engine,
                                                     layerwise=True)
        except Exception as exc:  # noqa: BLE001 - the whole save in wait_for_save reports what is wrong
            self._fell_back(f"the writer could not be made: {type(exc).__name__}: {exc}")
            return running
        if running.writer.mode != "slots":
            running.writer.abort()
            running.writer = None
        running.seconds = time.perf_counter() - t0
        return running

    def _finish_save(self, plan: StepPlan) -> bool:
        """Finish the step's layer-wise save; False if there is none or it had to be
        dropped (the caller then saves whole)."""
        running, self._saving = self._saving, None
        if running is None or running.writer is None:
            return False
        if running.plan is not plan:  # (another step's, never finished)
            self._drop(running, "the step never reached wait_for_save")
            return False
        t0 = time.perf_counter()
        failed = [spec.req_id for spec in running.plan.saves if self._reads_unwritten(spec)]
        if running.error is None and not failed:
            try:
                results = running.writer.finish()
            except Exception as exc:  # noqa: BLE001 - a layer never fed, NaN: the whole save decides
                running.error = exc
            else:
                self.guard.success(running.ticket)
                self._account_save(running.specs, results)
                self.stats.save_calls += 1
                self.stats.save_layerwise_calls += 1
                self.stats.save_seconds += running.seconds + time.perf_counter() - t0
                return True
        self._drop(running, f"{failed[:4]} read blocks a load failed to write in this step" if failed else
                   f"{type(running.error).__name__}: {running.error}")
        return False

    def _drop(self, running: RunningSave, reason: str) -> None:
        running.writer.abort()
        self._fell_back(reason)

    def _fell_back(self, reason: str) -> None:
        self.stats.save_layerwise_fallbacks += 1
        self.last_save_fallback = reason
        log.info("cacheseek worker: a layer-wise save is saved whole instead (%s)", reason)

    def end_save(self) -> None:
        """Drop a layer-wise save still running (a step that never reached wait_for_save)."""
        running, self._saving = self._saving, None
        if running is not None and running.writer is not None:
            self._drop(running, "the step never reached wait_for_save")

    def _account_save(self, specs: list[SaveSpec], results: list[Any]) -> None:
        self.stats.saves += len(specs)
        for spec, result in zip(specs, results, strict=True):
            self.stats.save_blocks_stored += result.stored
            self.stats.save_blocks_present += result.present
            if result.failed:
                self.stats.save_failures += 1
                self._lost([spec])
            else:
                self._stored(spec)

    @staticmethod
    def _save_requests(specs: list[SaveSpec], pages: VllmPages) -> list[PagedRequest]:
        return [PagedRequest(spec.keys, pages.page_table(spec.block_ids, len(spec.token_ids)), start=spec.start)
                for spec in specs]

    def _pages(self) -> VllmPages:
        if self.pages is None:
            raise RuntimeError("cacheseek connector: vLLM ran a step before registering its KV caches")
        return self.pages


MAX_RESAVES = 4096  # requests with a lost save remembered (vLLM reports each finished: forget)
_REFUSED = RuntimeError("not asked: the server failed recently")  # a load the guard refused


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


__all__ = ["RunningLoad", "RunningSave", "WorkerSide"]
