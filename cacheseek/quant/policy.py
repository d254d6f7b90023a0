"""``PrecisionPolicy``: which codec stores a block, by the block's position along its chain.

    cs.PrecisionPolicy(first=cs.KIVI(bits=8), first_blocks=1, rest=cs.KIVI(k_bits=4, v_bits=2))

The first ``first_blocks`` blocks of every chain (the attention sinks every later token
reads) are stored with ``first``, every later block with ``rest``. A position is a
property of the block's key (the chain's root and every token before it decide it), so a
block shared by many prompts always sits at the same position and is stored once, with
one codec. A chain's *last* block has no such property: a longer prompt extends it, so
"the last block" is not a rule a store can key by (docs/precision.md measures it anyway).

The policy is a cache's codec setting, never a frame's: every frame names the one codec
that encoded it, and a reader checks that codec against ``codec_at(position)``, the
position it fetches the block for. The
policy's spec is part of the root hash (``fingerprint``), so a policy chain never shares a
block with a uniform chain, nor with another policy's. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..layout import KVLayout
from .codec import KVLayerCodec, canonical_fingerprint
from .registry import codec_from_spec

NAME = "policy"
VERSION = 1
MAX_FIRST_BLOCKS = 1 << 16
_SPEC_KEYS = {"name", "version", "first", "first_blocks", "rest"}


@dataclass(frozen=True, init=False)
class PrecisionPolicy:
    """Blocks ``[0, first_blocks)`` of a chain with ``first``, the rest with ``rest``."""

    first: KVLayerCodec
    first_blocks: int
    rest: KVLayerCodec

    name = NAME

    def __init__(self, *, first: KVLayerCodec, rest: KVLayerCodec, first_blocks: int = 1) -> None:
        for what, codec in (("first", first), ("rest", rest)):
            if isinstance(codec, PrecisionPolicy) or not isinstance(codec, KVLayerCodec):
                raise ConfigError(f"PrecisionPolicy.{what}: expected a codec (cs.KIVI(...) or cs.Raw()), "
                                  f"got {codec!r:.200}")
        if isinstance(first_blocks, bool) or not isinstance(first_blocks, int) \
                or not 1 <= first_blocks <= MAX_FIRST_BLOCKS:
            raise ConfigError(f"PrecisionPolicy.first_blocks: must be an int in [1, {MAX_FIRST_BLOCKS}], "
                              f"got {first_blocks!r}")
        if first.spec() == rest.spec():
            raise ConfigError(f"PrecisionPolicy: first and rest are the same codec ({first!r}); "
                              "use that codec itself (its blocks are keyed apart from a policy's)")
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "first_blocks", first_blocks)
        object.__setattr__(self, "rest", rest)

    def __repr__(self) -> str:
        return f"PrecisionPolicy(first={self.first!r}, first_blocks={self.first_blocks}, rest={self.rest!r})"

    # -- identity ---------------------------------------------------------------------

    def spec(self) -> dict[str, Any]:
        return {"name": NAME, "version": VERSION, "first": self.first.spec(), "first_blocks": self.first_blocks,
                "rest": self.rest.spec()}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> PrecisionPolicy:
        if not isinstance(spec, dict) or set(spec) != _SPEC_KEYS or spec.get("name") != NAME:
            raise ConfigError(f"policy spec: expected keys {sorted(_SPEC_KEYS)} and name {NAME!r}, "
                              f"got {spec!r:.200}")
        if type(spec["version"]) is not int or spec["version"] != VERSION:
            raise ConfigError(f"policy spec: unsupported version {spec['version']!r:.40}")
        return cls(first=codec_from_spec(spec["first"]), first_blocks=spec["first_blocks"],
                   rest=codec_from_spec(spec["rest"]))

    def fingerprint(self) -> bytes:
        return canonical_fingerprint(self.spec())

    # -- positions --------------------------------------------------------------------

    def codec_at(self, position: int) -> KVLayerCodec:
        """The codec that stores the block at ``position`` (0: the chain's first block)."""
        return self.first if position < self.first_blocks else self.rest

    def boundaries(self) -> tuple[int, ...]:
        """Positions where the codec changes: a launch never spans one."""
        return (self.first_blocks,)

    def codecs(self) -> tuple[KVLayerCodec, KVLayerCodec]:
        return (self.first, self.rest)

    # -- what a cache asks of its codec setting ----------------------------------------

    def check_layout(self, layout: KVLayout, block_tokens: int) -> None:
        for codec in self.codecs():
            codec.check_layout(layout, block_tokens)

    def encoded_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        """Bytes of ``num_tokens`` tokens stored with ``rest`` (the steady state of a long chain)."""
        return self.rest.encoded_nbytes(layout, num_tokens)

    def chain_nbytes(self, layout: KVLayout, block_tokens: int, num_blocks: int) -> int:
        """Encoded bytes of the first ``num_blocks`` blocks of a chain."""
        head = min(num_blocks, self.first_blocks)
        return (self.first.encoded_nbytes(layout, head * block_tokens)
                + self.rest.encoded_nbytes(layout, (num_blocks - head) * block_tokens))


def codec_at(codec: Any, position: int) -> KVLayerCodec:
    """The codec of the block at ``position`` under a codec setting (a codec or a policy)."""
    return codec.codec_at(position) if isinstance(codec, PrecisionPolicy) else codec


def setting_from_spec(spec: Any) -> KVLayerCodec | PrecisionPolicy:
    """A codec setting from its spec: a codec's (``codec_from_spec``) or a policy's. Frames
    never carry a policy's spec (``codec_from_spec`` alone reads those)."""
    if isinstance(spec, dict) and spec.get("name") == NAME:
        return PrecisionPolicy.from_spec(spec)
    return codec_from_spec(spec)


__all__ = ["PrecisionPolicy", "codec_at", "setting_from_spec"]


def single_codec(setting: KVLayerCodec | PrecisionPolicy) -> KVLayerCodec:
    """``setting`` when it is one codec: what a uniform ``BlockFormat`` (a policy's
    ``at(position)``) holds. A policy here is a caller's bug: one launch encodes or decodes
    with one codec."""
    if isinstance(setting, PrecisionPolicy):
        raise RuntimeError(f"one codec expected, got a precision policy ({setting!r}); cut at fmt.segments")
    return setting
