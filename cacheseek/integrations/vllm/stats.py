"""What the connector did, as counters: data, not log lines.

Each side (scheduler, worker) keeps its own ``ConnectorStats``; vLLM sums the deltas of
both into its "KV Transfer metrics" log line and into its Prometheus registry (counters
``vllm:cacheseek_<name>``, connector.py), and ``CacheSeekConnector.stats()`` returns a
side's totals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _counter(doc: str, kind: type = int) -> Any:
    return field(default=kind(), metadata={"doc": doc})


@dataclass(slots=True)
class ConnectorStats:
    """Counters of one side (each field's metadata["doc"] says what it counts: the
    Prometheus help text of ``vllm:cacheseek_<name>``)."""

    # scheduler side: how many tokens of each request the store holds
    lookups: int = _counter("requests looked up in the store")
    lookup_hit_tokens: int = _counter("tokens offered to vLLM as external hits")
    lookup_errors: int = _counter("the store could not answer (server down, timed out): counted as a miss")
    lookup_skipped: int = _counter("not asked: the server failed recently (breaker open)")
    lookups_deferred: int = _counter(
        "asks answered 'not yet': the server's answer took longer than lookup_wait_seconds")
    lookups_late: int = _counter(
        "lookups unanswered within lookup_deadline_seconds: the request went on as a miss, the server rests")
    lookup_unaligned: int = _counter("vLLM's own hit ends inside a store block: nothing offered (see docs/vllm.md)")
    requests_unsupported: int = _counter("prompt embeddings, extra keys that cannot be keyed: neither loaded nor saved")
    requests_keyed: int = _counter("requests keyed by more than their tokens (LoRA, multimodal, cache salt)")
    load_failure_rollbacks: int = _counter(
        "requests set back over blocks another's load failed to write (vLLM had not)")
    # worker side: loads
    load_calls: int = _counter("materialize_into_batch calls: one per step with loads")
    loads: int = _counter("requests whose prefix was loaded into pages")
    load_tokens: int = _counter("tokens written into pages")
    load_failures: int = _counter("requests whose load fell short (error, or blocks gone since the lookup)")
    load_errors: int = _counter("of load_failures, those whose call raised (server down or timed out, a decode failed)")
    loads_refused: int = _counter("of load_failures, those not asked: the server failed recently (breaker open)")
    load_failed_tokens: int = _counter("tokens vLLM was told to recompute")
    load_failed_blocks: int = _counter("vLLM blocks reported back to the scheduler")
    load_seconds: float = _counter(
        "host time in the loads' calls (layer-wise: start, the forward's waits, close)", float)
    load_background_calls: int = _counter("of load_calls, those run between steps (vLLM's asynchronous loads)")
    load_layerwise_calls: int = _counter(
        "of load_calls, those run layer by layer (waited for per layer in the forward)")
    load_late_failures: int = _counter(
        "of load_failures, layer-wise ones that failed after the forward read some layers")
    # worker side: saves
    save_calls: int = _counter("ingest_batch calls: one per step with saves")
    save_layerwise_calls: int = _counter("of save_calls, those fed layer by layer in the forward (save_kv_layer)")
    save_layerwise_fallbacks: int = _counter(
        "layer-wise saves dropped for a whole one (a layer not fed, a load failed)")
    saves: int = _counter("requests whose blocks were ingested")
    save_blocks_stored: int = _counter("blocks the saves stored (new to the store)")
    save_blocks_present: int = _counter(
        "blocks the saves found stored already (not encoded again, but for a background save's "
        "blocks computed in its step, which are encoded before the server's lookup)")
    save_lookups_first: int = _counter(
        "of save_calls in the background, those that asked the server before encoding: at least half the "
        "save's blocks were not computed in its step (vLLM's own prefix cache served them)")
    save_failures: int = _counter("saves dropped (the call raised: server down, bad KV; or blocks not acknowledged)")
    save_resends: int = _counter("failed saves sent again from a finished request's pages, which vLLM held for it")
    saves_skipped: int = _counter("saves dropped: their KV read blocks a load of the same step failed to write")
    save_seconds: float = _counter(
        "host time in the saves' calls (background saves: the encode and the copy to host memory)", float)

    @classmethod
    def docs(cls) -> dict[str, str]:
        """What each counter counts, by name."""
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}

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
