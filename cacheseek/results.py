"""What the caches (``PrefixCache``, ``RemoteCache``) return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class IngestResult:
    """``blocks``: full blocks in the input; ``stored``: newly written; ``present``: already
    stored (not encoded again); ``failed``: not stored; ``errors``: tier -> reason.

    Stored and present are at the level ``durability`` names, the store's acknowledgement:
    ``"durable"`` (a persistent tier is on top or written through: the block is whole and
    committed on disk or in Redis when the call returns, and survives a crash) or
    ``"memory"`` (committed in the tier that took it, lost with the process). A block that
    did not reach that level counts as failed, even if a faster tier holds and serves it."""

    blocks: int
    stored: int
    present: int
    tokens: int
    failed: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    durability: str = "durable"


def stored_prefix(found: Sequence[bool]) -> int:
    """How many blocks of a chain are stored from its head on (``found``: each block's)."""
    return next((i for i, was in enumerate(found) if not was), len(found))


def count_outcome(result: IngestResult, key: bytes, outcome: Any, stored: list[bytes],
                  copies: Sequence[IngestResult] = ()) -> None:
    """Count one block's ``StorePutResult`` into ``result``; ``stored`` collects the keys
    newly written (a call undoes them if a later batch of it is refused). ``copies``: the
    results of the other requests of a batch that hold the block too (written once, for
    the first): present in each if this write stored it, failed if it did not."""
    if outcome.stored:
        result.stored += 1
        stored.append(key)
    elif outcome.present:
        result.present += 1
    else:
        result.failed += 1
    for tier, reason in outcome.errors.items():
        result.errors.setdefault(tier, reason)
    for copy in copies:
        if outcome.stored or outcome.present:
            copy.present += 1
        else:
            copy.failed += 1
        for tier, reason in outcome.errors.items():
            copy.errors.setdefault(tier, reason)


@dataclass(slots=True)
class Located:
    """The longest stored prefix, and the fastest tier holding each of its blocks."""

    num_blocks: int
    num_tokens: int
    tiers: list[str]


@dataclass(slots=True)
class Loaded:
    """What ``materialize_into`` wrote into a request's pages: the first ``num_tokens``
    tokens (``num_blocks`` full blocks, from the tiers named), queued on the pages' device's
    current stream; the pages of later tokens are untouched."""

    num_tokens: int = 0
    num_blocks: int = 0
    tiers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Materialized:
    """KV of the longest stored prefix, decoded on ``device``.

    ``layers[i]`` is (K, V), each [1, H, num_tokens, D]; empty when nothing matched.
    """

    num_tokens: int
    num_blocks: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    tiers: list[str]
    device: torch.device

    def to_dynamic_cache(self) -> Any:
        """An HF ``DynamicCache`` holding this KV, ready to continue generation."""
        from .integrations.transformers import to_dynamic_cache

        return to_dynamic_cache(self.layers)


FETCH_BLOCKS = 16  # blocks fetched per call to the store while materializing
