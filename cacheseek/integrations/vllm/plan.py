"""What the scheduler side tells the worker side each step: which prefixes to load into
which pages, and which to store from them. Plain data (vLLM sends it to the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...hashing import ExtraKeys
from ...prefix_keys import Prompt


def request_keys(token_ids: list[int], extra: ExtraKeys | None) -> Any:
    """The cache keys of a request's tokens: a ``Prompt`` when its KV depends on more than
    its tokens (a LoRA adapter, multimodal inputs, a cache salt), else the token ids."""
    if not extra:
        return token_ids
    return Prompt(token_ids, lora_id=extra.lora_id, mm_inputs=extra.mm_inputs, cache_salt=extra.cache_salt)


@dataclass(slots=True)
class LoadSpec:
    """Load the stored prefix ``token_ids`` (tokens ``[0, end)``) and write its tokens
    ``[start, end)`` into the request's pages; tokens before ``start`` (a whole number of
    store blocks) are in vLLM's own prefix cache already."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    extra: ExtraKeys | None = None

    @property
    def end(self) -> int:
        return len(self.token_ids)

    @property
    def keys(self) -> Any:
        return request_keys(self.token_ids, self.extra)


@dataclass(slots=True)
class SaveSpec:
    """Store the full blocks of ``token_ids`` (a prompt prefix) from the request's pages,
    from token ``start`` on (a whole number of store blocks): those before it an earlier
    step's save stored (chunked prefill saves chunk by chunk), so they are hashed only.
    ``computed``: the tokens vLLM had computed before the step (its own prefix-cache hit,
    a load, earlier steps); the save's blocks below it were not computed now, so an
    earlier request likely stored them: they are looked up before they are encoded."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    extra: ExtraKeys | None = None
    start: int = 0
    computed: int = 0

    @property
    def keys(self) -> Any:
        return request_keys(self.token_ids, self.extra)


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Loads of requests vLLM holds back until they are done (WAITING_FOR_REMOTE_KVS): run
    # between steps, reported finished through get_finished.
    background_loads: list[LoadSpec] = field(default_factory=list)
    # Requests vLLM finished and keeps the pages of until every worker reports them
    # (``request_finished`` returned True): (req_id, their vLLM block ids, the tokens those
    # hold). A save of theirs that failed is sent again from those pages, once.
    held: list[tuple[str, list[int], int]] = field(default_factory=list)


__all__ = ["LoadSpec", "SaveSpec", "StepPlan", "request_keys"]
