"""What the scheduler side tells the worker side each step: which prefixes to load into
which pages, and which to store from them. Plain data (vLLM sends it to the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadSpec:
    """Load the stored prefix ``token_ids`` (tokens ``[0, end)``) and write its tokens
    ``[start, end)`` into the request's pages; tokens before ``start`` are in vLLM's own
    prefix cache already."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int

    @property
    def end(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SaveSpec:
    """Store the full blocks of ``token_ids`` (a prompt prefix) from the request's pages."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


__all__ = ["LoadSpec", "SaveSpec", "StepPlan"]
