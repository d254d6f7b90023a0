"""What the connector did, as counters: data, not log lines.

Each side (scheduler, worker) keeps its own ``ConnectorStats``; vLLM sums the deltas of
both into its "KV Transfer metrics" log line, and ``CacheSeekConnector.stats()`` returns a
side's totals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class ConnectorStats:
    # scheduler side: how many tokens of each request the store holds
    lookups: int = 0
    lookup_hit_tokens: int = 0  # tokens offered to vLLM as external hits
    lookup_errors: int = 0  # the store could not answer (server down, timed out): counted as a miss
    lookup_skipped: int = 0  # not asked: the server failed recently (breaker open)
    lookups_deferred: int = 0  # asks answered "not yet": the server's answer took longer than lookup_wait_seconds
    lookup_unaligned: int = 0  # vLLM's own hit ends inside a store block: nothing offered (see docs/vllm.md)
    requests_unsupported: int = 0  # prompt embeddings, extra keys that cannot be keyed: neither loaded nor saved
    requests_keyed: int = 0  # requests keyed by more than their tokens (LoRA, multimodal, cache salt)
    load_failure_rollbacks: int = 0  # requests set back over blocks another's load failed to write (vLLM had not)
    # worker side: loads
    load_calls: int = 0  # materialize_into_batch calls: one per step with loads
    loads: int = 0  # requests whose prefix was loaded into pages
    load_tokens: int = 0  # tokens written into pages
    load_failures: int = 0  # requests whose load fell short (error, or blocks gone since the lookup)
    load_errors: int = 0  # of load_failures, those whose call raised (server down or timed out, a decode failed)
    loads_refused: int = 0  # of load_failures, those not asked: the server failed recently (breaker open)
    load_failed_tokens: int = 0  # tokens vLLM was told to recompute
    load_failed_blocks: int = 0  # vLLM blocks reported back to the scheduler
    load_seconds: float = 0.0  # host time in the loads' calls (layer-wise: start, the forward's waits, close)
    load_background_calls: int = 0  # of load_calls, those run between steps (vLLM's asynchronous loads)
    load_layerwise_calls: int = 0  # of load_calls, those run layer by layer (waited for per layer in the forward)
    load_late_failures: int = 0  # of load_failures, layer-wise ones that failed after the forward read some layers
    # worker side: saves
    save_calls: int = 0  # ingest_batch calls: one per step with saves
    save_layerwise_calls: int = 0  # of save_calls, those fed layer by layer in the forward (save_kv_layer)
    save_layerwise_fallbacks: int = 0  # layer-wise saves dropped for a whole one (a layer not fed, a load failed)
    saves: int = 0  # requests whose blocks were ingested
    save_blocks_stored: int = 0
    save_blocks_present: int = 0
    save_failures: int = 0  # saves dropped (the call raised: server down, bad KV; or blocks not acknowledged)
    save_resends: int = 0  # failed saves sent again from a finished request's pages, which vLLM held for it
    saves_skipped: int = 0  # saves dropped: their KV read blocks a load of the same step failed to write
    save_seconds: float = 0.0

    def to_dict(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def add(self, other: dict[str, int | float]) -> None:
        for name, value in other.items():
            if hasattr(self, name):
                setattr(self, name, getattr(self, name) + value)

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))

    def minus(self, earlier: dict[str, int | float]) -> dict[str, int | float]:
        """The counts since ``earlier`` (a ``to_dict()`` of this object)."""
        return {name: value - earlier.get(name, 0) for name, value in self.to_dict().items()}


__all__ = ["ConnectorStats"]
