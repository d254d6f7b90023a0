"""The worker side: carry out a step's plan against the pages vLLM registered.

Each step is two calls on the engine surface, whatever the number of requests in it:
``materialize_into_batch`` for every load, before the forward that reads them (vLLM
calls ``start_load_kv`` first), and ``ingest_batch`` for every save, after it
(``wait_for_save``). Both read and write vLLM's pages in place (``cs.KVPages``), decoded
and encoded there: no contiguous copy of the KV.

Neither ever raises into vLLM: a load that falls short, for any reason (the call raised,
the server is down, a block was evicted or found corrupt since the lookup), reports the
vLLM blocks from the first missing token to the end of the load, and vLLM (with
``kv_load_failure_policy: "recompute"``) rolls the request back to the block before and
computes the rest. A save that fails is dropped; so is the save of a request whose load
failed in the same step, because its new KV was computed over the missing blocks.
"""

from __future__ import annotations

import time
from typing import Any

from ...pages import PagedRequest
from .guard import StoreGuard
from .pages import VllmPages
from .plan import LoadSpec, SaveSpec, StepPlan
from .stats import ConnectorStats


class WorkerSide:
    def __init__(self, cache: Any, *, guard: StoreGuard) -> None:
        self.cache = cache
        self.guard = guard
        self.stats = ConnectorStats()
        self.pages: VllmPages | None = None
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # this step's: their saves are dropped

    def register(self, pages: VllmPages) -> None:
        self.pages = pages

    def start_step(self, plan: StepPlan) -> None:
        self._failed_requests.clear()
        if plan.loads:
            self.load(plan.loads)

    def finish_step(self, plan: StepPlan) -> None:
        saves = []
        for spec in plan.saves:
            if spec.req_id in self._failed_requests:
                self.stats.saves_skipped += 1
            else:
                saves.append(spec)
        if saves:
            self.save(saves)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- one step's calls --------------------------------------------------------------

    def load(self, specs: list[LoadSpec]) -> list[int]:
        """Write the stored tokens ``[spec.start, spec.end)`` of every load into its pages, in
        one ``materialize_into_batch``; returns, per load, the end of what is in its pages
        (``spec.end`` when all of it arrived)."""
        pages = self._pages()
        t0 = time.perf_counter()
        written = [spec.start for spec in specs]
        if self.guard.allow():
            try:
                requests = [PagedRequest(spec.keys, pages.page_table(spec.block_ids, spec.end), max_tokens=spec.end,
                                         start=spec.start) for spec in specs]
                got = self.cache.materialize_into_batch(requests, pages.engine)
                written = [max(spec.start, min(g.num_tokens, spec.end)) for spec, g in zip(specs, got)]
                self.guard.success()
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes what did not arrive
                written = [spec.start for spec in specs]
                self.guard.failure("load", exc)
        self.stats.load_calls += 1
        self.stats.load_seconds += time.perf_counter() - t0
        for spec, end in zip(specs, written):
            self.stats.load_tokens += end - spec.start
            if end >= spec.end:
                self.stats.loads += 1
                continue
            block = pages.fmt.block_size
            failed = spec.block_ids[end // block : -(-spec.end // block)]
            self._failed_blocks.update(failed)
            self._failed_requests.add(spec.req_id)
            self.stats.load_failures += 1
            self.stats.load_failed_tokens += spec.end - end
            self.stats.load_failed_blocks += len(failed)
        return written

    def save(self, specs: list[SaveSpec]) -> None:
        """Store the full blocks of every save from its pages, in one ``ingest_batch``
        (blocks already stored are not encoded again)."""
        pages = self._pages()
        if not self.guard.allow():
            self.stats.save_failures += len(specs)
            return
        t0 = time.perf_counter()
        try:
            requests = [PagedRequest(spec.keys, pages.page_table(spec.block_ids, len(spec.token_ids)))
                        for spec in specs]
            results = self.cache.ingest_batch(requests, pages.engine)
            self.guard.success()
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss, not a failed request
            self.stats.save_failures += len(specs)
            self.guard.failure("save", exc)
        else:
            self.stats.saves += len(specs)
            for result in results:
                self.stats.save_blocks_stored += result.stored
                self.stats.save_blocks_present += result.present
                if result.failed:
                    self.stats.save_failures += 1
        self.stats.save_calls += 1
        self.stats.save_seconds += time.perf_counter() - t0

    def _pages(self) -> VllmPages:
        if self.pages is None:
            raise RuntimeError("cacheseek connector: vLLM ran a step before registering its KV caches")
        return self.pages


__all__ = ["WorkerSide"]
