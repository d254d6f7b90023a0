"""The Redis tier's shared index: byte accounting and LRU order, kept in Redis itself.

Many processes on many hosts write one namespace, so no process can hold the index in its
own memory. The index lives next to the frames (key names in ``redis_keys``) and changes
only through :data:`INDEX_SCRIPT`, a Lua script that runs atomically on the master owning
the index's hash tag. One call of the script, in this order:

1. prunes entries idle longer than the TTL (their frames expire on their own);
2. forgets blocks (deleted, or found corrupt), and ghosts a read found (only those idle
   longer than a grace, and never a pinned one); counts at their stored size blocks a
   check found counted at another (``RedisTier.check``: unpinned ones only once idle
   longer than a grace);
3. touches blocks (marks them used, in order: the last is the most recent), and says which
   of them are pinned;
4. pins and unpins blocks, for the caller's owner (below);
5. adds blocks with their sizes (a block already indexed is only touched, unless pinned; a block larger
   than the whole budget is refused, and so is one that would not fit beside the pinned
   blocks);
6. evicts the least recently used blocks until ``used <= budget``, and returns them.

A call sent again under its id (redis-py's retry after a connection error) does none of
this: it answers the first run's reply, kept for a minute when it holds victims, expired
entries, forgotten ghosts, blocks counted anew, blocks a lapsed lease let go, or a lost
lease (see :meth:`SharedIndex.queue`).

Pins: a pinned block is kept in the sizes hash (so it counts) but not in the LRU zset, so
neither eviction nor the TTL prune ever reaches it; the ``pinned`` set names every pinned
block, stored or not (a pin covers a block that arrives later). A pinned frame is written
without an expiry, and ``RedisTier`` takes the expiry off a frame it pins.

Pins have owners: each process (``RedisTier.owner``) pins into a set of its own, under a
lease (``pinners``: owner -> end of lease) that it renews while it holds pins, and the
``pinned`` set is the union of those sets. So a block two processes pin stays pinned until
both have unpinned it, and the pins of a process that died without unpinning go when its
lease runs out (every call lets go ``RELEASE_LIMIT`` pins of lapsed owners at most, first;
a lapsed owner stays in ``pinners`` until none is left). An index written before pins had
owners (a plain pinned set, no ``pin_owners`` marker in the totals) is taken over on its
first call as the pins of one owner, ``LEGACY_OWNER``, under one lease.

The clock is Redis's ``TIME`` in microseconds on the index's master, made strictly
increasing, so every process shares one recency order and the order of a batch is kept.

The index and the frames are updated by different commands (in Redis Cluster they live on
different masters, so nothing can make them one atomic step). The caller orders its steps
so that a failure in between leaves the index *over*-counting: a block is added to the
index before its frame is written (an interrupted write leaves a "ghost": counted, not
stored; the next put of that block writes it without counting it twice, and a read that
finds no value forgets it once it has been idle longer than a write could be in flight). The one
undercount: a victim the script dropped whose DEL never arrived stays stored, unaccounted
(an "orphan") until its TTL, until a touch finds it in use (with a TTL), until it is put
again (adding adopts it), or until ``RedisTier.check(fix=True)``. And a block counted at
another size than its stored value's: a put counts its frame's size one round trip before
its ``SET`` lands, so a snapshot restored in between, or two writers of frames of different
sizes under one hash whose ``SET``s land in the other order than their counts, leave a value
counted at the other's size (over or under) until the block is put again, or until
``RedisTier.check(fix=True)`` counts it at its stored length.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .redis_keys import RedisKeys

# The first word of the error a script answers for a key of the index that holds another
# type than the one it keeps there (``foreign_key`` reads the rest: the key, its type, the
# type wanted).
FOREIGN_KEY = "CACHESEEK_FOREIGN_INDEX_KEY"

# How long the smallest budget a call gave is kept as the one in effect without a call giving
# it again (see ``IndexTotals.budget_bytes``).
BUDGET_SEEN_SECONDS = 600

# Numbers are handed to redis.call() as Lua numbers, never concatenated into strings: Lua's
# tostring() keeps 14 significant digits, and a microsecond clock needs 16.
INDEX_SCRIPT = """
local lru, sizes, totals, pinned, gens, pinners, call = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local owners = KEYS[8]
local budget = tonumber(ARGV[1])
local ttl_us = tonumber(ARGV[2])
local prune_limit = tonumber(ARGV[3])
local n_forget, n_touch, n_add = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local n_pin, n_unpin = tonumber(ARGV[7]), tonumber(ARGV[8])
local n_repair, repair_idle_us = tonumber(ARGV[9]), tonumber(ARGV[10])
local keep_gens = ARGV[11] == '1'
local reply_ms = tonumber(ARGV[12])
local replay = ARGV[13] == '1'
local owner, lease_us, owned_prefix = ARGV[14], tonumber(ARGV[15]), ARGV[16]
local release_limit = tonumber(ARGV[17])
local own_count = tonumber(ARGV[18])
local n_resize = tonumber(ARGV[19])

-- Every key this call may read or write holds the type the script keeps there, or nothing.
-- One of another type (another app sharing the keyspace, or a SET by hand) failed the call
-- with WRONGTYPE part way, after its earlier writes (a script's writes are not undone), and
-- so every call of every process. Refused before any write instead, the key named (see
-- ``FOREIGN_KEY``); the key is left alone: it may be another app's data.
local function foreign(key, want)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= want then
    return redis.error_reply('@FOREIGN_KEY@ ' .. key .. ' ' .. kind .. ' ' .. want)
  end
  return nil
end
local refused = foreign(lru, 'zset') or foreign(sizes, 'hash') or foreign(totals, 'hash')
  or foreign(pinned, 'set') or (keep_gens and foreign(gens, 'hash')) or foreign(pinners, 'zset')
  or foreign(owners, 'hash') or foreign(call, 'string') or (owner ~= '' and foreign(owned_prefix .. owner, 'set'))
  or nil
if refused then return refused end

-- This call sent again (redis-py sends a pipeline again after a connection error, and the
-- first reply may have been lost after this ran): the first run's reply, not a second run.
-- A replay only asks for that reply (nil: none kept), and runs nothing.
local first = redis.call('GET', call)
if first then
  return cmsgpack.unpack(first)
elseif replay then
  return false
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tot = redis.call('HMGET', totals, 'used', 'raw', 'blocks', 'clock', 'pinned_bytes', 'pinned_blocks', 'pin_owners')
-- A total as this script writes it: digits (0 where none is written yet), else nil.
-- tonumber alone also takes "nan", "-inf", "inf", "-5" and "0x10": a used of NaN left the
-- budget unenforced for good, one of inf evicted every block not pinned on every call.
-- Digits too are nil from 2^53 on, where a Lua number (a double) is no longer exact: 20
-- digits read as 1e20, which clock + 1 left unchanged and Redis handed back as the integer
-- -2^63 (a generation a writer then stored beside its frame, "not digits" to the fence).
local function count(s)
  if not s then return 0 end
  if not string.match(s, '^%d+$') then return nil end
  local n = tonumber(s)
  if n >= 9007199254740992 then return nil end
  return n
end
local used = count(tot[1])
local raw = count(tot[2])
local blocks = count(tot[3])
local clock = math.max(count(tot[4]) or 0, now)
local pinned_bytes = count(tot[5])
local pinned_blocks = count(tot[6])
local changed = false
if not (used and raw and blocks and pinned_bytes and pinned_blocks) then
  -- Totals that are not counts (another tool wrote them): counted again from the sizes
  -- hash, once, rather than failing every call of every process for good.
  used, raw, blocks, pinned_bytes, pinned_blocks = 0, 0, 0, 0, 0
  local all = redis.call('HGETALL', sizes)
  for j = 1, #all, 2 do
    local n, r = string.match(all[j + 1], '^(%d+) (%d+)$')
    if n then
      used, raw, blocks = used + tonumber(n), raw + tonumber(r), blocks + 1
      if redis.call('SISMEMBER', pinned, all[j]) == 1 then
        pinned_bytes, pinned_blocks = pinned_bytes + tonumber(n), pinned_blocks + 1
      end
    end
  end
  changed = true
end

-- The smallest budget in use on this namespace, and when a call last gave it: every call
-- evicts down to its own caller's budget, so a process of a larger one is emptied down to
-- the smallest while its own figures said it was far from full. Kept so that each process
-- can say so. One not given again for @BUDGET_SEEN_US@ us gives way (its process may be
-- gone). Written with a call that writes anyway, but for a budget smaller than the one
-- kept: a read that writes fails under maxmemory OOM.
local seen = redis.call('HMGET', totals, 'budget_min', 'budget_min_at')
local budget_min, budget_min_at = count(seen[1]), count(seen[2])
local lapsed = not (budget_min and budget_min_at and budget_min > 0) or now - budget_min_at > @BUDGET_SEEN_US@
if not lapsed and budget < budget_min then
  changed = true
end
if lapsed or budget <= budget_min then
  budget_min, budget_min_at = budget, now
end

local function size_of(member)
  local s = redis.call('HGET', sizes, member)
  if not s then return nil end
  local n, r = string.match(s, '^(%d+) (%d+)$')
  return tonumber(n), tonumber(r)
end

-- A block's generation (kept only where asked: a cluster's fence): the clock when it was
-- last counted anew (0: counted before generations were kept). Returned with every block a
-- call adds, evicts or lets expire.
-- One that is not digits (another tool's: tonumber took "nan", "inf", "-5", "0x10", " 7"
-- and "1e3") says nothing of when the block was counted: the block gets a new one, newer
-- than any an eviction has let go. Handed back as read, such a value (-5, 16, or NaN and
-- inf as Redis's integer -2^63) went beside a frame written again, under which the late
-- delete of any earlier eviction took a frame the index counts.
local gen_of = {}
local function note_gen(member)
  if keep_gens then
    local g = count(redis.call('HGET', gens, member))
    if not g then
      changed = true
      clock = clock + 1
      redis.call('HSET', gens, member, clock)
      g = clock
    end
    gen_of[#gen_of + 1] = member
    gen_of[#gen_of + 1] = g
  end
end

local function drop(member)
  changed = true
  redis.call('ZREM', lru, member)
  local n, r = size_of(member)
  if keep_gens then redis.call('HDEL', gens, member) end
  redis.call('HDEL', owners, member)
  if not n then return false end
  redis.call('HDEL', sizes, member)
  used = used - n
  raw = raw - r
  blocks = blocks - 1
  if redis.call('SISMEMBER', pinned, member) == 1 then
    pinned_bytes = pinned_bytes - n
    pinned_blocks = pinned_blocks - 1
  end
  return true
end

-- Pins are held per owner (one per process), each owner under a lease it renews; the pinned
-- set is the union of the owners' sets, so a block stays pinned while any owner pins it, and
-- the pins of a process that died without unpinning go when its lease runs out.
-- Blocks a lapsed lease let go, back in the LRU: their frames expire again. Not the caller's
-- own unpins: it knows those, and gives their frames their expiry back itself. Listed, they
-- made the reply (kept a minute for a call sent again) as large as the unpin: 7 MB for
-- 100k blocks.
local released = {}
local function release(member, listed)
  if redis.call('SREM', pinned, member) == 1 then
    changed = true
    if listed then released[#released + 1] = member end
    local n = size_of(member)
    if n then
      clock = clock + 1
      redis.call('ZADD', lru, clock, member)
      pinned_bytes = pinned_bytes - n
      pinned_blocks = pinned_blocks - 1
    end
  end
end
-- Release those of ``members`` (in their order) that none of ``owners`` pins. One SDIFF
-- over a scratch set in the index's slot rather than a SISMEMBER per member and owner: a
-- 100k-block unpin beside 16 owners blocked Redis for 1.7 s that way.
local function release_unheld(members, owners, listed)
  if #owners > 0 and #members > 0 then
    local scratch = call .. ':held'
    redis.call('DEL', scratch)
    for j = 1, #members, 4096 do
      redis.call('SADD', scratch, unpack(members, j, math.min(j + 4095, #members)))
    end
    local sets = {scratch}
    for _, o in ipairs(owners) do sets[#sets + 1] = owned_prefix .. o end
    local free = {}
    for _, m in ipairs(redis.call('SDIFF', unpack(sets))) do free[m] = true end
    redis.call('DEL', scratch)
    for _, m in ipairs(members) do
      if free[m] then release(m, listed) end
    end
  else
    for _, m in ipairs(members) do release(m, listed) end
  end
end

-- The pin sets this call may read or write besides its caller's: the legacy owner's, and
-- where pins may be let go (a lapsed owner's, or an unpin's), every owner's. Checked before
-- the first write, as the index's own keys are.
local legacy = tot[7] ~= '1' and redis.call('SCARD', pinned) > 0
local lapsed = redis.call('ZRANGEBYSCORE', pinners, '-inf', now, 'LIMIT', 0, 8)
refused = legacy and foreign(owned_prefix .. 'legacy', 'set') or nil
if not refused and (#lapsed > 0 or n_unpin > 0) then
  for _, o in ipairs(redis.call('ZRANGE', pinners, 0, -1)) do
    refused = foreign(owned_prefix .. o, 'set')
    if refused then break end
  end
end
if refused then return refused end

-- An index written before pins had owners: its pinned set becomes the pins of one owner
-- (LEGACY_OWNER), under one lease from now, since no process renews it. The processes that
-- made those pins pin them again when they start (the server's pins file), under owners of
-- their own. The marker is written with the totals of this or any later call that pins.
if legacy then
  redis.call('SUNIONSTORE', owned_prefix .. 'legacy', owned_prefix .. 'legacy', pinned)
  redis.call('ZADD', pinners, now + lease_us, 'legacy')
  changed = true
end
-- Owners whose lease ran out (a process that died, or one cut off from Redis for longer):
-- their pins go, release_limit a call at most, so that no call's work nor its kept reply
-- grows with an owner's pins (a dead owner's 100k, let go in one call, blocked Redis for
-- 0.7 s and kept a 7 MB reply). A lapsed owner stays in ``pinners`` until its set is
-- empty, so its set stays part of the union meanwhile; its lease is lost all the same.
local release_left = release_limit
for _, o in ipairs(lapsed) do
  if release_left <= 0 then break end
  local members = redis.call('SPOP', owned_prefix .. o, release_left)
  release_left = release_left - #members
  changed = true
  if redis.call('EXISTS', owned_prefix .. o) == 0 then redis.call('ZREM', pinners, o) end
  local others = {}
  for _, p in ipairs(redis.call('ZRANGE', pinners, 0, -1)) do
    if p ~= o then others[#others + 1] = p end
  end
  release_unheld(members, others, true)
end
-- A lease is held while it has not run out: a lapsed owner still in ``pinners`` has lost
-- part of its pins already, or is about to.
local function lease_held(o)
  local ends = redis.call('ZSCORE', pinners, o)
  return ends and tonumber(ends) > now
end
-- The caller's own lease, renewed; lost if it ran out (its pins go: it pins them again,
-- which takes the lease anew. Not renewed here: with that pin failing, the next renewal
-- would find it held, and the pins the lapse took would never be made again).
local lease_lost = 0
if owner ~= '' then
  if lease_held(owner) then
    redis.call('ZADD', pinners, now + lease_us, owner)
    -- Held, yet fewer pins than the caller holds (it counts only pins answered, less those it
    -- is taking back): Redis lost some, restored from a snapshot taken within the lease. Lost
    -- all the same: the caller pins them again.
    if own_count > 0 and redis.call('SCARD', owned_prefix .. owner) < own_count then
      lease_lost = 1
    end
  elseif n_pin == 0 then
    lease_lost = 1
  end
end

local expired = {}
if ttl_us > 0 then
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl_us, 'LIMIT', 0, prune_limit)
  for _, m in ipairs(old) do
    note_gen(m)
    drop(m)
    expired[#expired + 1] = m
  end
end

local i = 20
for _ = 1, n_forget do
  drop(ARGV[i])
  i = i + 1
end

-- Ghosts a read found (no value): a write counts its block a moment before its SET lands,
-- and its add touched the block then, so only an entry idle longer than the grace is one
-- no write is still filling. A pinned block is not in the LRU zset: its pin keeps it.
-- Returned with their sizes, so that the caller can count one again if its value appears.
local repaired = {}
for _ = 1, n_repair do
  local m = ARGV[i]
  i = i + 1
  local score = redis.call('ZSCORE', lru, m)
  if score and tonumber(score) <= now - repair_idle_us then
    local s = redis.call('HGET', sizes, m)
    if s and drop(m) then
      repaired[#repaired + 1] = m
      repaired[#repaired + 1] = s
    end
  end
end

-- Blocks a check found counted at another size than their stored value's length (a snapshot
-- restored between a put's count and its SET, or two writers of frames of different sizes
-- under one hash whose SETs landed in the other order than their counts): counted at the
-- stored value's size, read from its header. Only an entry still as the check read it (no
-- put has counted the block again since) and, unpinned, idle at least the grace: a put counts
-- its block at its own size a round trip before its SET lands. A pinned one has no LRU entry
-- to age, so no way to tell a put in flight: left until it is unpinned (counted at once, a
-- put in flight made the wrong size it meant to mend). Not touched: a check changes no recency.
for _ = 1, n_resize do
  local m, seen, n, r = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  i = i + 4
  if redis.call('HGET', sizes, m) == seen then
    local old_n, old_r = size_of(m)
    local is_pinned = redis.call('SISMEMBER', pinned, m) == 1
    local score = redis.call('ZSCORE', lru, m)
    local idle = score and tonumber(score) <= now - repair_idle_us
    if old_n and idle and (old_n ~= n or old_r ~= r) then
      changed = true
      redis.call('HSET', sizes, m, n .. ' ' .. r)
      used, raw = used + n - old_n, raw + r - old_r
      if is_pinned then pinned_bytes = pinned_bytes + n - old_n end
    end
  end
end

-- Touched blocks the index does not count at all: orphans (stored, uncounted) or gone.
-- And the touched blocks pinned now (never in the LRU zset), for callers whose own view of
-- the pins may be stale.
local uncounted, held_now = {}, {}
for _ = 1, n_touch do
  if redis.call('ZSCORE', lru, ARGV[i]) then
    changed = true
    clock = clock + 1
    redis.call('ZADD', lru, 'XX', clock, ARGV[i])
  else
    if redis.call('HEXISTS', sizes, ARGV[i]) == 0 then
      uncounted[#uncounted + 1] = ARGV[i]
    end
    if redis.call('SISMEMBER', pinned, ARGV[i]) == 1 then
      held_now[#held_now + 1] = ARGV[i]
    end
  end
  i = i + 1
end

-- A pin or unpin is the caller's (owner): set operations, so one sent twice counts once.
if n_pin > 0 then
  if not lease_held(owner) then lease_lost = 1 end
  redis.call('ZADD', pinners, now + lease_us, owner)
  changed = true
end
for _ = 1, n_pin do
  local m = ARGV[i]
  i = i + 1
  -- Into the pinned set whether or not the owner's own set held the block already: the two
  -- can disagree (an older version's unpin changes the pinned set alone), and a pin made
  -- again is what puts that right.
  redis.call('SADD', owned_prefix .. owner, m)
  if redis.call('SADD', pinned, m) == 1 then
    local n = size_of(m)
    if n then
      redis.call('ZREM', lru, m)
      pinned_bytes = pinned_bytes + n
      pinned_blocks = pinned_blocks + 1
    end
  end
end

local others = {}  -- (the caller's own set no longer holds what it unpins)
if n_unpin > 0 then
  for _, o in ipairs(redis.call('ZRANGE', pinners, 0, -1)) do
    if o ~= owner then others[#others + 1] = o end
  end
end
local dropped = {}
for _ = 1, n_unpin do
  local m = ARGV[i]
  i = i + 1
  if redis.call('SREM', owned_prefix .. owner, m) == 1 then
    changed = true
    dropped[#dropped + 1] = m
  end
end
release_unheld(dropped, others, false)
if n_unpin > 0 and redis.call('EXISTS', owned_prefix .. owner) == 0 then
  redis.call('ZREM', pinners, owner)  -- (an owner with no pins left holds no lease)
end

-- status: 1 newly counted, 2 newly counted and pinned (write it without an expiry),
-- 0 already indexed, 3 already indexed and pinned (its frame keeps no expiry),
-- -1 larger than the budget, -2 no room beside the pinned blocks
local status = {}
local counted_anew = false
for _ = 1, n_add do
  local m, n, r, tag = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]
  i = i + 4
  local is_pinned = redis.call('SISMEMBER', pinned, m) == 1
  local old_n, old_r = size_of(m)
  if old_n then
    -- (One a writer that tags nothing counted: the first tag it is put with stands.)
    if tag ~= '' then redis.call('HSETNX', owners, m, tag) end
    note_gen(m)
    -- Counted at another size: the caller found a value of another length under its name
    -- (another frame claiming this hash, or a truncated one) and writes its own over it.
    -- Counted at the size written, or the budget would count bytes other than those stored.
    if old_n ~= n or old_r ~= r then
      changed = true
      redis.call('HSET', sizes, m, n .. ' ' .. r)
      used, raw = used + n - old_n, raw + r - old_r
      if is_pinned then pinned_bytes = pinned_bytes + n - old_n end
    end
    if is_pinned then
      status[#status + 1] = 3
    else
      changed = true
      clock = clock + 1
      redis.call('ZADD', lru, clock, m)
      status[#status + 1] = 0
    end
  elseif n > budget then
    status[#status + 1] = -1
  elseif pinned_bytes + n > budget then
    status[#status + 1] = -2
  else
    changed = true
    redis.call('HSET', sizes, m, n .. ' ' .. r)
    if tag ~= '' then redis.call('HSET', owners, m, tag) end
    clock = clock + 1
    if keep_gens then
      redis.call('HSET', gens, m, clock)
      gen_of[#gen_of + 1] = m
      gen_of[#gen_of + 1] = clock
    end
    counted_anew = true
    used = used + n
    raw = raw + r
    blocks = blocks + 1
    if is_pinned then
      pinned_bytes = pinned_bytes + n
      pinned_blocks = pinned_blocks + 1
      status[#status + 1] = 2
    else
      redis.call('ZADD', lru, clock, m)
      status[#status + 1] = 1
    end
  end
end

local evicted = {}
while used > budget do
  local oldest = redis.call('ZRANGE', lru, 0, 0)
  if #oldest == 0 then
    -- Only pinned blocks left (a budget lowered under them): they stay. Without pins,
    -- counts without entries cannot happen through this script; heal rather than loop.
    if pinned_blocks == 0 then
      used, raw, blocks = 0, 0, 0
    end
    break
  end
  note_gen(oldest[1])
  drop(oldest[1])
  evicted[#evicted + 1] = oldest[1]
end

-- A call that changed nothing writes nothing: reading totals works under maxmemory OOM.
if changed then
  redis.call('HSET', totals, 'used', used, 'raw', raw, 'blocks', blocks, 'clock', clock,
             'pinned_bytes', pinned_bytes, 'pinned_blocks', pinned_blocks, 'pin_owners', 1,
             'budget_min', budget_min, 'budget_min_at', budget_min_at)
end
local reply = {status, evicted, expired, used, raw, blocks, pinned_bytes, pinned_blocks, repaired, uncounted, gen_of,
               held_now, released, lease_lost, budget_min}
-- Kept only where a second run would answer otherwise (it would evict, expire and repair
-- nothing, and count nothing anew): those victims and entries are the caller's to delete.
-- A lost lease too: a pin takes the lease again, so a second run would find it held, and
-- the caller would never pin again what the lapse took.
if #evicted > 0 or #expired > 0 or #repaired > 0 or #released > 0 or counted_anew or lease_lost == 1 then
  redis.call('SET', call, cmsgpack.pack(reply), 'PX', reply_ms)
end
return reply
""".replace("@FOREIGN_KEY@", FOREIGN_KEY).replace("@BUDGET_SEEN_US@", str(BUDGET_SEEN_SECONDS * 1_000_000))

# The fence on a victim's DEL: delete a frame only while the index does not count its block.
# A process that evicts a block deletes its frame a round trip after its script; meanwhile
# another may have counted the block again and written it. On one Redis the check and the
# DEL are one atomic step, so a DEL however late never takes a value the index counts. In a
# cluster the frame and the index live on different masters, so no script holds both: there
# the fence is the frame's generation (DROP_STALE_SCRIPT, below).
# KEYS[1]: the sizes hash; KEYS[2..]: the frames; ARGV: their members, in the same order.
# A sizes hash of another type is refused as the index script refuses it, before any DEL.
DROP_UNCOUNTED_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('@FOREIGN_KEY@ ' .. KEYS[1] .. ' ' .. kind .. ' hash')
end
local n = 0
for i = 2, #KEYS do
  if redis.call('HEXISTS', KEYS[1], ARGV[i - 1]) == 0 then
    n = n + redis.call('DEL', KEYS[i])
  end
end
return n
""".replace("@FOREIGN_KEY@", FOREIGN_KEY)

# The removal of owner tags (``RedisKeys.owners``) of blocks the index does not count: a
# release before owner tags evicted with a script that knew no such hash, so each block of
# ours it let go kept its tag for good (``RedisTier.check`` finds them). Each goes only while
# the sizes hash still lacks its block, in the same script (both keys are the index's, in
# one slot): a put that counted the block again since the check's scan keeps its tag.
# KEYS[1]: the sizes hash; KEYS[2]: the owners hash; ARGV: the members.
DROP_STALE_OWNER_TAGS_SCRIPT = """
for i, want in ipairs({'hash', 'hash'}) do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind ~= 'none' and kind ~= want then
    return redis.error_reply('@FOREIGN_KEY@ ' .. KEYS[i] .. ' ' .. kind .. ' ' .. want)
  end
end
local n = 0
for _, m in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[1], m) == 0 then
    n = n + redis.call('HDEL', KEYS[2], m)
  end
end
return n
""".replace("@FOREIGN_KEY@", FOREIGN_KEY)

# The fence in a cluster. Each block counted anew gets a generation (the index's clock at
# that moment), and a writer stores it beside the frame (``RedisKeys.frame_gen``, in the
# frame's slot) before the frame itself. A victim's delete carries the generation the
# index had for it when it let the block go, and takes the frame only while the frame's
# generation is no newer: a process that counted the block again since wrote a newer one
# first, so a DEL however late leaves its value. The generation key expires
# ``GEN_FENCE_SECONDS`` after its write (no refresh, so none outlives it for long): a
# victim's delete that lands later than that after its eviction is not fenced.
# A generation key that is not digits (another tool's; plain tonumber took "nan", "-5" and
# "0x10" as no newer, and the delete of an older eviction took a frame written since), or
# digits from 2^53 on (no longer exact as a Lua number), or not a string at all (a GET of
# it failed the script with WRONGTYPE, and the call that evicted the block with it), says
# nothing of the frame's age: the delete leaves the frame (at worst an orphan, which a
# write counting it again, ``check(fix=True)`` or its expiry deals with).
# KEYS[1]: the frame; KEYS[2]: its generation key; ARGV[1]: the victim's generation.
DROP_STALE_SCRIPT = """
local s = redis.pcall('GET', KEYS[2])
if type(s) == 'table' then return 0 end
local g = 0
if s then
  if not string.match(s, '^%d+$') then return 0 end
  g = tonumber(s)
  if g >= 9007199254740992 then return 0 end
end
if g > tonumber(ARGV[1]) then return 0 end
return redis.call('DEL', KEYS[1], KEYS[2])
"""

GEN_FENCE_SECONDS = 600

# The fence on the delete of a value a read found bad (corrupt, or a key of another type):
# only that value goes. Another process may have put the block since the read (a value
# that is not the whole frame is written over) and been acknowledged; a plain DEL took its
# value. The value is named by its length and its first bytes as read (the whole of it for
# a frame's read, the header for ``info``'s). Its generation key, in a cluster, is left to
# expire: a write in flight may have just stored its own.
# KEYS[1]: the frame; ARGV[1]: its length as read (-1: a key of another type); ARGV[2]: its
# first bytes as read; ARGV[3]: '1' where the read took only the first ARGV[1] bytes of a
# longer value (one larger than any frame the reader reads): its length is at least that.
DROP_FOUND_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
local n = tonumber(ARGV[1])
if n < 0 then
  if kind == 'string' then return 0 end
elseif kind ~= 'string' then
  return 0
elseif ARGV[3] == '1' and redis.call('STRLEN', KEYS[1]) < n then
  return 0
elseif ARGV[3] ~= '1' and redis.call('STRLEN', KEYS[1]) ~= n then
  return 0
elseif #ARGV[2] > 0 and redis.call('GETRANGE', KEYS[1], 0, #ARGV[2] - 1) ~= ARGV[2] then
  return 0
end
return redis.call('DEL', KEYS[1])
"""

# How long a process's pins outlive its last renewal of them: the longest a process that died
# without unpinning keeps its pins in Redis. ``RedisTier`` renews every fifth of it.
PIN_LEASE_SECONDS = 300.0
LEGACY_OWNER = "legacy"  # the owner of the pins of an index written before pins had owners

PRUNE_LIMIT = 512  # expired entries dropped per call, so one call never runs long
# Pins of lapsed owners let go per call (and listed in its reply, kept for a call sent
# again): a dead owner's 100k pins go over many calls, each bounded.
RELEASE_LIMIT = 1024
# How long a script call's reply is kept for the same call sent again: redis-py sends a
# pipeline again at once after a connection error, so a minute is far more than it needs.
CALL_REPLY_SECONDS = 60
STALE_TAGS_PER_CALL = 1000  # owner tags one call of DROP_STALE_OWNER_TAGS_SCRIPT removes at most


@dataclass(frozen=True, slots=True)
class IndexTotals:
    used_bytes: int = 0
    raw_bytes: int = 0
    blocks: int = 0
    pinned_bytes: int = 0
    pinned_blocks: int = 0
    # The smallest budget a process sharing the namespace gave within BUDGET_SEEN_SECONDS:
    # the one every call evicts down to, in effect (0: not known, a reply of an older script).
    budget_bytes: int = 0


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """What one script call did. ``added[i]``: 1 newly counted, 2 newly counted and pinned
    (to be written without an expiry), 0 already indexed (now touched), 3 already indexed and
    pinned (not touched; its frame keeps no expiry), -1 larger than the budget, -2 no room
    beside the pinned blocks (neither indexed). ``evicted`` and ``expired`` are member names
    whose frames the caller should delete. ``repaired``: (member, nbytes, raw_nbytes) of the
    ghosts forgotten (see ``SharedIndex.queue``'s ``repair``). ``uncounted``: touched
    blocks the index does not count (orphans, if their frames are there). ``pinned``: touched
    blocks that are pinned. ``released``: blocks no owner pins any more since this call let
    go of pins of owners whose lease ran out (``RELEASE_LIMIT`` at most), back in the LRU:
    their frames are to expire again (so are those of
    the caller's own unpins, which it knows, not listed: a 100k-block unpin's reply would
    hold them all, kept a minute). ``lease_lost``: the caller's owner held no lease (it ran out, or Redis lost it):
    its pins are gone or going, to be sent again. ``gens``: the
    generation (see :data:`DROP_STALE_SCRIPT`) of every block added (its generation in the
    index now), evicted or expired (the one it had); empty unless ``SharedIndex.generations``."""

    added: tuple[int, ...]
    evicted: tuple[str, ...]
    expired: tuple[str, ...]
    totals: IndexTotals
    repaired: tuple[tuple[str, int, int], ...] = ()
    uncounted: tuple[str, ...] = ()
    gens: Mapping[str, int] = field(default_factory=dict)
    pinned: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    lease_lost: bool = False


@dataclass(frozen=True, slots=True)
class SharedIndex:
    """Builds script calls onto a redis-py client or pipeline, and reads their replies."""

    keys: RedisKeys
    budget_bytes: int
    ttl_us: int = 0  # 0: no TTL
    generations: bool = False  # keep each block's generation (a cluster's fence)
    pin_lease_us: int = int(PIN_LEASE_SECONDS * 1_000_000)

    def queue(
        self,
        client: Any,
        *,
        add: Sequence[tuple[str, int, int] | tuple[str, int, int, str]] = (),
        touch: Sequence[str] = (),
        forget: Sequence[str] = (),
        pin: Sequence[str] = (),
        unpin: Sequence[str] = (),
        repair: Sequence[str] = (),
        repair_idle_us: int = 0,
        resize: Sequence[tuple[str, bytes, int, int]] = (),
        owner: str = "",
        own_count: int = 0,
        call: str | None = None,
        replay: bool = False,
    ) -> Any:
        """Queue (on a pipeline) or run (on a client) one call. ``add``: (member, nbytes,
        raw_nbytes[, owner tag]); the tag is kept in ``keys.owners`` while the block is counted. ``repair``: blocks a read found without a value, forgotten if unpinned
        and idle at least ``repair_idle_us``. ``resize``: (member, its entry in ``keys.sizes`` as
        read, nbytes, raw_nbytes) of blocks counted at another size than their stored value's
        length (``RedisTier.check``), counted at that size if the entry is unchanged and, unless
        pinned, idle at least ``repair_idle_us`` (neither touched). ``owner``: whose pins ``pin`` and ``unpin``
        change (required with them); given alone, it renews that owner's lease. ``own_count``: how many
        blocks that owner pins, as it knows them (its pins answered, less its unpins sent):
        its set holding fewer says Redis lost some (``lease_lost``). EVAL rather than EVALSHA: the script text is
        small next to a frame, and there is no NOSCRIPT to handle after a Redis restart or
        failover.

        Each call carries an id of its own, under which the script keeps its reply when
        running it again would answer otherwise (victims, entries let expire, blocks counted
        anew, blocks a lapsed lease let go, a lost lease). redis-py sends a pipeline (or a command) again, once, after a connection
        error: when that error lost the reply of a script Redis had run, the second run
        evicted nothing, and the first run's victims were neither deleted nor counted
        (orphans). Dropping the client's retry would not save them (the reply is lost all the
        same; the call would fail instead), so the script answers a call sent again with
        the first run's reply, and the caller deletes its victims. ``call``: the id (else a
        new one); ``replay``: only ask for the reply kept under it (see :meth:`replay`)."""
        if (pin or unpin) and not owner:
            raise ValueError("SharedIndex.queue: pins and unpins need an owner")
        keys = (*self.keys.index, self.keys.call(call or self.new_call()), self.keys.owners)
        args: list[Any] = [self.budget_bytes, self.ttl_us, PRUNE_LIMIT, len(forget), len(touch), len(add),
                           len(pin), len(unpin), len(repair), int(repair_idle_us), int(self.generations),
                           CALL_REPLY_SECONDS * 1000, int(replay), owner, self.pin_lease_us,
                           self.keys.owner_pins_prefix, RELEASE_LIMIT, int(own_count), len(resize)]
        args += forget
        args += repair
        for member, seen, nbytes, raw_nbytes in resize:
            args += [member, seen, int(nbytes), int(raw_nbytes)]
        args += touch
        args += pin
        args += unpin
        for entry in add:
            args += [entry[0], int(entry[1]), int(entry[2]), entry[3] if len(entry) > 3 else ""]
        return client.execute_command("EVAL", INDEX_SCRIPT, len(keys), *keys, *args,
                                      **_routed(client, self.keys.lru))

    @staticmethod
    def new_call() -> str:
        return os.urandom(12).hex()

    def replay(self, client: Any, call: str) -> IndexUpdate | None:
        """What the call under id ``call`` did, if Redis ran it and kept its reply (for
        ``CALL_REPLY_SECONDS``, when it had victims, expired entries or blocks counted anew);
        None if not. Runs nothing: for a call whose reply a fault kept from its caller."""
        reply = self.queue(client, call=call, replay=True)
        return None if reply is None else self.parse(reply)

    def queue_drop_stale(self, client: Any, member: str, gen: int) -> Any:
        """Queue (or run) the fenced delete of one victim's frame in a cluster: it goes only
        if its stored generation is at most ``gen`` (see :data:`DROP_STALE_SCRIPT`)."""
        frame = self.keys.frame_of_member(member)
        return client.execute_command("EVAL", DROP_STALE_SCRIPT, 2, frame, self.keys.gen_of_member(member), int(gen),
                                      **_routed(client, frame))

    def queue_drop_uncounted(self, client: Any, members: Sequence[str]) -> Any:
        """Queue (or run) the fenced delete of the frames of ``members``: each goes only if
        the index does not count it (see :data:`DROP_UNCOUNTED_SCRIPT`). One Redis only."""
        frames = [self.keys.frame_of_member(m) for m in members]
        return client.execute_command("EVAL", DROP_UNCOUNTED_SCRIPT, 1 + len(frames), self.keys.sizes, *frames, *members)

    def drop_stale_owner_tags(self, client: Any, members: Sequence[str]) -> int:
        """Remove the owner tags of ``members`` that the index does not count (see
        :data:`DROP_STALE_OWNER_TAGS_SCRIPT`), in calls of ``STALE_TAGS_PER_CALL``; how many went."""
        removed = 0
        for start in range(0, len(members), STALE_TAGS_PER_CALL):
            part = members[start : start + STALE_TAGS_PER_CALL]
            removed += int(client.execute_command("EVAL", DROP_STALE_OWNER_TAGS_SCRIPT, 2, self.keys.sizes,
                                                  self.keys.owners, *part))
        return removed

    def drop_found(self, client: Any, member: str, length: int, head: bytes, *, at_least: bool = False) -> bool:
        """Delete the frame of ``member`` only if it is still the value a read found bad
        (see :data:`DROP_FOUND_SCRIPT`): ``length`` (-1: a key of another type; with
        ``at_least``, its least length: a value read only in part) and its first bytes
        ``head``. Whether it went."""
        frame = self.keys.frame_of_member(member)
        return bool(client.execute_command("EVAL", DROP_FOUND_SCRIPT, 1, frame, int(length), head,
                                           "1" if at_least else "0"))

    @staticmethod
    def parse(reply: Any) -> IndexUpdate:
        (status, evicted, expired, used, raw, blocks, pinned_bytes, pinned_blocks, repaired, uncounted, gens, held,
         released, lease_lost) = reply[:14]
        budget = reply[14] if len(reply) > 14 else 0  # (a reply kept by an older release's script has none)
        pairs = [(member_text(m), (s.decode() if isinstance(s, bytes) else str(s)).split())  # (sizes: digits)
                 for m, s in zip(repaired[::2], repaired[1::2])]
        return IndexUpdate(
            added=tuple(int(s) for s in status),
            evicted=member_texts(evicted),
            expired=member_texts(expired),
            totals=IndexTotals(int(used), int(raw), int(blocks), int(pinned_bytes), int(pinned_blocks), int(budget)),
            repaired=tuple((m, int(n), int(r)) for m, (n, r) in pairs if m is not None),
            uncounted=member_texts(uncounted),
            gens={t: int(g) for m, g in zip(gens[::2], gens[1::2]) if (t := member_text(m)) is not None},
            pinned=member_texts(held),
            released=member_texts(released),
            lease_lost=bool(lease_lost),
        )


def _routed(client: Any, key: str) -> dict[str, Any]:
    """Where a cluster client sends an EVAL on ``key``'s slot. redis-py's cluster pipeline
    asks a server (``COMMAND GETKEYS``, a round trip of its own per command) where a script
    goes unless it is told: 1.9 ms instead of 0.4 for a pipeline of 8 on loopback. Only in
    a pipeline, which sends the command again (routed by redis-py) if the slot has moved;
    a cluster client's own call finds the slot from the keys without asking. Nothing for
    one Redis, nor where the slot map has no node for it (redis-py then finds one)."""
    node_of = getattr(client, "get_node_from_key", None)
    if node_of is None or getattr(client, "command_stack", None) is None:
        return {}
    try:
        return {"target_nodes": node_of(key)}
    except Exception:  # (SlotNotCoveredError: a map being rebuilt)
        return {}


@dataclass(frozen=True, slots=True)
class ForeignKey:
    """A key of the index holding a value of another type than the index keeps there."""

    key: str
    kind: str  # its type (Redis's TYPE)
    want: str  # the type the index keeps there


def foreign_key(exc: BaseException) -> ForeignKey | None:
    """The key a script refused (its error reply, ``FOREIGN_KEY``), or None for another error."""
    words = str(exc).split()
    if FOREIGN_KEY not in words[:2]:  # (a client may prefix the reply's code)
        return None
    rest = words[words.index(FOREIGN_KEY) + 1 :]
    return ForeignKey(rest[0], rest[1], rest[2]) if len(rest) == 3 else None


def index_types(keys: RedisKeys) -> dict[str, str]:
    """The index's keys of fixed names, and the type each holds (``TYPE``'s word)."""
    return {keys.lru: "zset", keys.sizes: "hash", keys.totals: "hash", keys.pinned: "set", keys.gens: "hash",
            keys.pinners: "zset", keys.owners: "hash"}


def member_text(member: Any) -> str | None:
    """A member as text; None for one that is not UTF-8. The index's keys are bytes any tool
    may write, and such a member names no block this tier wrote: a victim or an expired
    entry of that kind raised UnicodeDecodeError out of the put whose script had counted
    its block already. (Such a member is dropped from the index by the script all the same.)"""
    if not isinstance(member, bytes):
        return str(member)
    try:
        return member.decode()
    except UnicodeDecodeError:
        return None


def member_texts(members: Any) -> tuple[str, ...]:
    return tuple(t for t in map(member_text, members) if t is not None)


__all__ = ["DROP_FOUND_SCRIPT", "DROP_STALE_OWNER_TAGS_SCRIPT", "DROP_STALE_SCRIPT", "DROP_UNCOUNTED_SCRIPT", "FOREIGN_KEY", "GEN_FENCE_SECONDS",
           "INDEX_SCRIPT", "ForeignKey", "IndexTotals", "IndexUpdate", "LEGACY_OWNER", "PIN_LEASE_SECONDS",
           "SharedIndex", "foreign_key", "index_types", "member_text", "member_texts"]
