"""The Redis tier's shared index: byte accounting and LRU order, kept in Redis itself.

Many processes on many hosts write one namespace, so no process can hold the index in its
own memory. The index lives next to the frames (key names in ``redis_keys``) and changes
only through :data:`INDEX_SCRIPT`, a Lua script that runs atomically on the master owning
the index's hash tag. One call of the script, in this order:

1. prunes entries idle longer than the TTL (their frames expire on their own);
2. forgets blocks (deleted, or found corrupt);
3. touches blocks (marks them used, in order: the last is the most recent);
4. adds blocks with their sizes (a block already indexed is only touched; a block larger
   than the whole budget is refused);
5. evicts the least recently used blocks until ``used <= budget``, and returns them.

The clock is Redis's ``TIME`` in microseconds on the index's master, made strictly
increasing, so every process shares one recency order and the order of a batch is kept.

The index and the frames are updated by different commands (in Redis Cluster they live on
different masters, so nothing can make them one atomic step). The caller orders its steps
so that a failure in between leaves the index *over*-counting: a block is added to the
index before its frame is written (an interrupted write leaves a "ghost": counted, not
stored; the next put of that block writes it without counting it twice). The one
undercount: a victim the script dropped whose DEL never arrived stays stored, unaccounted
(an "orphan") until its TTL, until it is put again (adding adopts it), or until
``RedisTier.check(fix=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .redis_keys import RedisKeys

# Numbers are handed to redis.call() as Lua numbers, never concatenated into strings: Lua's
# tostring() keeps 14 significant digits, and a microsecond clock needs 16.
INDEX_SCRIPT = """
local lru, sizes, totals = KEYS[1], KEYS[2], KEYS[3]
local budget = tonumber(ARGV[1])
local ttl_us = tonumber(ARGV[2])
local prune_limit = tonumber(ARGV[3])
local n_forget, n_touch, n_add = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tot = redis.call('HMGET', totals, 'used', 'raw', 'blocks', 'clock')
local used = tonumber(tot[1] or 0)
local raw = tonumber(tot[2] or 0)
local blocks = tonumber(tot[3] or 0)
local clock = math.max(tonumber(tot[4] or 0), now)
local changed = false

local function drop(member)
  changed = true
  redis.call('ZREM', lru, member)
  local s = redis.call('HGET', sizes, member)
  if not s then return false end
  redis.call('HDEL', sizes, member)
  local n, r = string.match(s, '^(%d+) (%d+)$')
  used = used - tonumber(n)
  raw = raw - tonumber(r)
  blocks = blocks - 1
  return true
end

local expired = {}
if ttl_us > 0 then
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl_us, 'LIMIT', 0, prune_limit)
  for _, m in ipairs(old) do
    drop(m)
    expired[#expired + 1] = m
  end
end

local i = 7
for _ = 1, n_forget do
  drop(ARGV[i])
  i = i + 1
end

for _ = 1, n_touch do
  if redis.call('ZSCORE', lru, ARGV[i]) then
    changed = true
    clock = clock + 1
    redis.call('ZADD', lru, 'XX', clock, ARGV[i])
  end
  i = i + 1
end

local status = {}
for _ = 1, n_add do
  local m, n, r = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  changed = true
  clock = clock + 1
  if redis.call('HEXISTS', sizes, m) == 1 then
    redis.call('ZADD', lru, clock, m)
    status[#status + 1] = 0
  elseif tonumber(n) > budget then
    status[#status + 1] = -1
  else
    redis.call('HSET', sizes, m, n .. ' ' .. r)
    redis.call('ZADD', lru, clock, m)
    used = used + tonumber(n)
    raw = raw + tonumber(r)
    blocks = blocks + 1
    status[#status + 1] = 1
  end
end

local evicted = {}
while used > budget do
  local oldest = redis.call('ZRANGE', lru, 0, 0)
  if #oldest == 0 then
    -- Counts without entries cannot happen through this script; heal rather than loop.
    used, raw, blocks = 0, 0, 0
    break
  end
  drop(oldest[1])
  evicted[#evicted + 1] = oldest[1]
end

-- A call that changed nothing writes nothing: reading totals works under maxmemory OOM.
if changed then
  redis.call('HSET', totals, 'used', used, 'raw', raw, 'blocks', blocks, 'clock', clock)
end
return {status, evicted, expired, used, raw, blocks}
"""

PRUNE_LIMIT = 512  # expired entries dropped per call, so one call never runs long


@dataclass(frozen=True, slots=True)
class IndexTotals:
    used_bytes: int = 0
    raw_bytes: int = 0
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """What one script call did. ``added[i]``: 1 newly counted, 0 already indexed (now
    touched), -1 larger than the budget (not indexed). ``evicted`` and ``expired`` are
    member names whose frames the caller should delete."""

    added: tuple[int, ...]
    evicted: tuple[str, ...]
    expired: tuple[str, ...]
    totals: IndexTotals


@dataclass(frozen=True, slots=True)
class SharedIndex:
    """Builds script calls onto a redis-py client or pipeline, and reads their replies."""

    keys: RedisKeys
    budget_bytes: int
    ttl_us: int = 0  # 0: no TTL

    def queue(
        self,
        client: Any,
        *,
        add: Sequence[tuple[str, int, int]] = (),
        touch: Sequence[str] = (),
        forget: Sequence[str] = (),
    ) -> Any:
        """Queue (on a pipeline) or run (on a client) one call. ``add``: (member, nbytes,
        raw_nbytes). EVAL rather than EVALSHA: the script text is small next to a frame,
        and there is no NOSCRIPT to handle after a Redis restart or failover."""
        args: list[Any] = [self.budget_bytes, self.ttl_us, PRUNE_LIMIT, len(forget), len(touch), len(add)]
        args += forget
        args += touch
        for member, nbytes, raw_nbytes in add:
            args += [member, int(nbytes), int(raw_nbytes)]
        return client.execute_command("EVAL", INDEX_SCRIPT, 3, *self.keys.index, *args)

    @staticmethod
    def parse(reply: Any) -> IndexUpdate:
        status, evicted, expired, used, raw, blocks = reply
        return IndexUpdate(
            added=tuple(int(s) for s in status),
            evicted=tuple(_text(m) for m in evicted),
            expired=tuple(_text(m) for m in expired),
            totals=IndexTotals(int(used), int(raw), int(blocks)),
        )


def _text(member: Any) -> str:
    return member.decode() if isinstance(member, bytes) else str(member)


__all__ = ["INDEX_SCRIPT", "IndexTotals", "IndexUpdate", "SharedIndex"]
