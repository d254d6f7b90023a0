"""Does reuse pay? A per-call decision from measured read and prefill speeds.

Reusing a stored prefix costs its materialize time (read from a tier, move the compact
payload, decode on the device); not reusing costs recomputing those tokens. Both are
measured, not assumed: ``prefill_with_reuse`` reports every materialize and every forward
pass it runs, and the planner keeps an exponential moving average of

- read speed, in tokens per second, per tier (only from reads served by one tier alone;
  before the first, it may be seeded from the tier's read throughput in ``cache.stats()``,
  which leaves out the move and decode: the first measured read replaces the seed),
- prefill speed, in tokens per second (only from forwards of at least
  ``min_prefill_tokens`` tokens: shorter ones are dominated by per-call overhead and would
  understate what a prefill of the reused span costs).

Speeds are in tokens, not bytes: a planner serves one cache (one layout and one codec), so
bytes per token is a constant there. A tier never measured yet is tried (that read measures
it); after that, a tier whose predicted read time exceeds the predicted recompute time is
skipped, and the decision says so. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(slots=True)
class Rate:
    """An exponential moving average of a throughput, in units per second.

    ``samples`` counts measurements; a rate with none is a seed, replaced by the first one."""

    per_s: float | None = None
    samples: int = 0

    def observe(self, units: float, seconds: float, weight: float) -> None:
        if units <= 0 or seconds <= 0:
            return
        rate = units / seconds
        per_s = self.per_s
        self.per_s = rate if self.samples == 0 or per_s is None else (1 - weight) * per_s + weight * rate
        self.samples += 1


@dataclass(frozen=True, slots=True)
class ReuseDecision:
    """Whether to reuse, why, and the two predictions behind it (seconds; None if unknown)."""

    reuse: bool
    reason: str
    predicted_read_s: float | None = None
    predicted_recompute_s: float | None = None


@dataclass(slots=True)
class ReusePlanner:
    """Measured speeds for one (model, cache) pair, and the decision they imply.

    ``margin`` > 1 demands that reuse be predicted that many times faster than recompute;
    ``weight`` is the moving average's weight of the newest sample.
    """

    margin: float = 1.0
    weight: float = 0.5
    min_prefill_tokens: int = 128
    prefill: Rate = field(default_factory=Rate)
    reads: dict[str, Rate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ConfigError(f"margin: must be > 0, got {self.margin!r}")
        if not 0 < self.weight <= 1:
            raise ConfigError(f"weight: must be in (0, 1], got {self.weight!r}")

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward pass that computed ``tokens`` new tokens in ``seconds``."""
        if tokens >= self.min_prefill_tokens:
            self.prefill.observe(tokens, seconds, self.weight)

    def observe_read(self, tiers: Sequence[str], tokens: int, seconds: float) -> None:
        """A materialize of ``tokens`` tokens whose blocks came from ``tiers`` (one per block)."""
        if tiers and len(set(tiers)) == 1:
            self.reads.setdefault(tiers[0], Rate()).observe(tokens, seconds, self.weight)

    def seed_read(self, tier: str, tokens_per_s: float) -> None:
        """A first guess of a tier's read speed, used until a read of it is measured."""
        if tokens_per_s > 0 and tier not in self.reads:
            self.reads[tier] = Rate(per_s=tokens_per_s)

    def unmeasured(self, tiers: Sequence[str]) -> list[str]:
        """Tiers of ``tiers`` with no read speed at all (not even a seed)."""
        return sorted({t for t in tiers if self.reads.get(t, Rate()).per_s is None})

    def decide(self, tiers: Sequence[str], tokens: int) -> ReuseDecision:
        """Reuse ``tokens`` tokens whose blocks sit in ``tiers`` (one entry per block), or not."""
        if tokens <= 0 or not tiers:
            return ReuseDecision(False, "nothing stored for this prompt")
        unmeasured = self.unmeasured(tiers)
        if unmeasured:
            return ReuseDecision(True, f"read speed of tier {', '.join(unmeasured)} not measured yet: reusing measures it")
        per_block = tokens / len(tiers)
        read_s = 0.0
        for t in tiers:
            rate = self.reads[t].per_s
            assert rate is not None  # (unmeasured: answered above)
            read_s += per_block / rate
        if self.prefill.per_s is None:
            return ReuseDecision(True, "prefill speed not measured yet: reusing", read_s, None)
        recompute_s = tokens / self.prefill.per_s
        if read_s * self.margin < recompute_s:
            return ReuseDecision(True, f"read {read_s:.3g} s < recompute {recompute_s:.3g} s", read_s, recompute_s)
        return ReuseDecision(
            False,
            f"reading {tokens} tokens from {'/'.join(sorted(set(tiers)))} is predicted to take {read_s:.3g} s, "
            f"recomputing them {recompute_s:.3g} s: recomputing",
            read_s, recompute_s,
        )
