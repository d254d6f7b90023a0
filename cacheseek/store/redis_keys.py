"""Redis key names for one (prefix, namespace): the frames, and the shared index beside them.

    {prefix}:{namespace}:{<block hash hex>}       the frame (a string, one SET); hash tag = the block hash
    {prefix}:{namespace}:gen:{<block hash hex>}   in a cluster: the generation the frame was written at
    {<prefix>:<namespace>}:lru                    zset: block hash hex -> last-use clock (µs)
    {<prefix>:<namespace>}:size                   hash: block hash hex -> "<nbytes> <raw_nbytes>"
    {<prefix>:<namespace>}:totals                 hash: used, raw, blocks, clock, pinned_bytes, pinned_blocks
    {<prefix>:<namespace>}:pinned                 set: block hash hex of every pinned block (by any owner)
    {<prefix>:<namespace>}:pinners                zset: pin owner (one per process) -> end of its lease (µs)
    {<prefix>:<namespace>}:pins:<owner>           set: block hash hex of every block that owner pins
    {<prefix>:<namespace>}:gen                    in a cluster: hash: block hash hex -> generation (clock when counted anew)
    {<prefix>:<namespace>}:owner                  hash: block hash hex -> owner tag (opaque; set by the writer, gone with the entry)

Braces are Redis Cluster hash tags: only the text inside the first ``{...}`` picks the slot.
A frame's tag is its block hash, so the frames of one chain spread over every master; the
index keys share the tag ``<prefix>:<namespace>``, so one script can update them
atomically on the one master that owns that slot (see docs/redis.md for why the index is
not split per slot). The frame's own header carries its parent, position and sizes: there
is no per-block metadata key that could disagree with the frame.

Prefixes and namespaces are restricted to ``[A-Za-z0-9_.-]`` so that no two (prefix,
namespace) pairs can ever name the same key and no user text can open a hash tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .frame import HASH_SIZES

_PREFIX = re.compile(r"\A[A-Za-z0-9_.\-]{1,64}\Z")
_NAMESPACE = re.compile(r"\A[A-Za-z0-9_.\-]{0,64}\Z")


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = "cacheseek"
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not _PREFIX.match(self.prefix):
            raise ConfigError(f"redis_prefix: 1-64 characters of [A-Za-z0-9_.-], got {self.prefix!r}")
        if not isinstance(self.namespace, str) or not _NAMESPACE.match(self.namespace):
            raise ConfigError(f"redis_namespace: 0-64 characters of [A-Za-z0-9_.-], got {self.namespace!r}")

    def frame(self, key: bytes) -> str:
        return f"{self.prefix}:{self.namespace}:{{{key.hex()}}}"

    def frame_of_member(self, member: str) -> str:
        return f"{self.prefix}:{self.namespace}:{{{member}}}"

    def frame_gen(self, key: bytes) -> str:
        """The key beside a frame, in its slot, holding the generation it was written at (a
        cluster's fence: ``redis_index.DROP_STALE_SCRIPT``). Not matched by ``frame_pattern``."""
        return self.gen_of_member(key.hex())

    def gen_of_member(self, member: str) -> str:
        return f"{self.prefix}:{self.namespace}:gen:{{{member}}}"

    @staticmethod
    def member(key: bytes) -> str:
        """How the index names a block: its hash in lowercase hex (readable in redis-cli)."""
        return key.hex()

    @staticmethod
    def key(member: Any) -> bytes | None:
        """The block a member names (``member``'s inverse), or None for one no write of this
        tier made (another tool's, or garbage): skipped by the caller, not failing its call."""
        try:
            key = bytes.fromhex(member.decode() if isinstance(member, bytes) else member)
        except (ValueError, TypeError, UnicodeDecodeError):
            return None
        return key if len(key) in HASH_SIZES else None

    @property
    def frame_pattern(self) -> str:
        """A SCAN pattern matching every frame of this namespace (and nothing else)."""
        return f"{self.prefix}:{self.namespace}:{{*}}"

    @property
    def index_tag(self) -> str:
        return f"{{{self.prefix}:{self.namespace}}}"

    @property
    def lru(self) -> str:
        return f"{self.index_tag}:lru"

    @property
    def sizes(self) -> str:
        return f"{self.index_tag}:size"

    @property
    def totals(self) -> str:
        return f"{self.index_tag}:totals"

    @property
    def pinned(self) -> str:
        return f"{self.index_tag}:pinned"

    @property
    def gens(self) -> str:
        return f"{self.index_tag}:gen"

    @property
    def owners(self) -> str:
        """Who owns each counted block, as its writer tagged it (``RedisTier.owner_tag``):
        kept and dropped by the index script with the block's entry in ``sizes``, so an admin
        flush of any process finds the blocks every process wrote."""
        return f"{self.index_tag}:owner"

    @property
    def pinners(self) -> str:
        return f"{self.index_tag}:pinners"

    @property
    def owner_pins_prefix(self) -> str:
        """What an owner's pin set is named after (its owner id follows): the index script
        names the sets of owners other than its caller's from it, in the index's slot."""
        return f"{self.index_tag}:pins:"

    def owner_pins(self, owner: str) -> str:
        return f"{self.owner_pins_prefix}{owner}"

    @property
    def index(self) -> tuple[str, str, str, str, str, str]:
        return self.lru, self.sizes, self.totals, self.pinned, self.gens, self.pinners

    def call(self, call_id: str) -> str:
        """Where one index-script call keeps its reply for a while, should it be sent again
        (``redis_index.INDEX_SCRIPT``); in the index's slot."""
        return f"{self.index_tag}:call:{call_id}"


__all__ = ["RedisKeys"]
