"""The worker side: carry out a step's plan against the pages vLLM registered.

Loads run before the forward that reads them (vLLM calls ``start_load_kv`` first when a
step has synchronous loads), saves after it (``wait_for_save``). Neither ever raises into
vLLM: a load that falls short, for any reason, reports the vLLM blocks from the first
missing token to the end of the load, and vLLM (with ``kv_load_failure_policy:
"recompute"``) rolls the request back to the block before and computes the rest. A save
that fails is dropped; so is the save of a request whose load failed in the same step,
because its new KV was computed over the missing blocks.
"""

from __future__ import annotations

import time
from typing import Any

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
        for spec in plan.loads:
            self.load(spec)

    def finish_step(self, plan: StepPlan) -> None:
        for spec in plan.saves:
            if spec.req_id in self._failed_requests:
                self.stats.saves_skipped += 1
                continue
            self.save(spec)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- one request -------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> int:
        """Write the stored tokens ``[spec.start, spec.end)`` into pages; returns the end
        of what was written (``spec.end`` when all of it was)."""
        pages = self._pages()
        t0 = time.perf_counter()
        written = spec.start
        if self.guard.allow():
            try:
                if pages.engine is not None and spec.start == 0:
                    # Decoded straight into the pages. (With vLLM's own hit before `start`,
                    # the stopgap below writes from `start` on: materialize_into writes
                    # whole blocks from token 0, and those pages are vLLM's shared ones.)
                    dest = pages.engine.at(pages.page_table(spec.block_ids, spec.end))
                    written = self.cache.materialize_into(spec.token_ids, dest, max_tokens=spec.end).num_tokens
                else:
                    got = self.cache.materialize(spec.token_ids, device=pages.device, max_tokens=spec.end)
                    if got.num_tokens > spec.start:
                        pages.scatter(pages.slots(spec.block_ids, spec.start, got.num_tokens), got.layers, first=0)
                        written = got.num_tokens
                self.guard.success()
            except Exception as exc:  # noqa: BLE001 - vLLM recomputes what did not arrive
                written = spec.start
                self.guard.failure("load", exc)
        self.stats.load_seconds += time.perf_counter() - t0
        self.stats.load_tokens += written - spec.start
        if written >= spec.end:
            self.stats.loads += 1
            return written
        block = pages.fmt.block_size
        failed = spec.block_ids[written // block : -(-spec.end // block)]
        self._failed_blocks.update(failed)
        self._failed_requests.add(spec.req_id)
        self.stats.load_failures += 1
        self.stats.load_failed_tokens += spec.end - written
        self.stats.load_failed_blocks += len(failed)
        return written

    def save(self, spec: SaveSpec) -> None:
        pages = self._pages()
        if not self.guard.allow():
            self.stats.save_failures += 1
            return
        t0 = time.perf_counter()
        try:
            n = len(spec.token_ids)
            if pages.engine is not None:
                kv = pages.engine.at(pages.page_table(spec.block_ids, n))  # encoded from the pages in place
            else:
                kv = pages.gather(pages.slots(spec.block_ids, 0, n))
            result = self.cache.ingest(spec.token_ids, kv)
            self.guard.success()
        except Exception as exc:  # noqa: BLE001 - a lost save is a future miss, not a failed request
            self.stats.save_failures += 1
            self.guard.failure("save", exc)
        else:
            self.stats.saves += 1
            self.stats.save_blocks_stored += result.stored
            self.stats.save_blocks_present += result.present
            if result.failed:
                self.stats.save_failures += 1
        self.stats.save_seconds += time.perf_counter() - t0

    def _pages(self) -> VllmPages:
        if self.pages is None:
            raise RuntimeError("cacheseek connector: vLLM ran a step before registering its KV caches")
        return self.pages


__all__ = ["WorkerSide"]
