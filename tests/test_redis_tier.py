"""The redis tier against real redis-server processes: one server, and a 3-master cluster."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import unquote
from pathlib import Path

import pytest
import torch

import cacheseek as cs
from cacheseek.errors import StorageError
from cacheseek.store.breaker import CircuitBreaker, ConstantBackoff
from cacheseek.store.frame import build_frame, plan_frame
from cacheseek.store.redis_client import RedisTimeouts, parse_redis_url
from cacheseek.store import redis_memory
from cacheseek.store.redis_index import DROP_STALE_SCRIPT
from cacheseek.store.redis_keys import RedisKeys
from cacheseek.store.redis_tier import RedisTier
from cacheseek.store.tier import BlockFrame
from redis_servers import RedisCluster3, RedisServer, ReplyLosingProxy, free_port, needs_redis
from store_helpers import BLOCK, LAYOUT, as_other_version, assert_prefix_equal, make_cache, make_kv, tokens_for

pytestmark = needs_redis

FRAME = LAYOUT.raw_nbytes(BLOCK) + 1024  # a Raw frame with its header, rounded up
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(server):
    server.cli("FLUSHALL")
    return server.url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster3(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


def rcache(url, *, cpu=0, **kw):
    """A PrefixCache over ``url`` (fast breaker settings for tests)."""
    kw.setdefault("redis_bytes", "64MiB")
    kw.setdefault("redis_breaker_base_seconds", 0.2)
    kw.setdefault("redis_breaker_cap_seconds", 0.4)
    return make_cache(cpu=cpu, redis_url=url, **kw)


def redis_stats(cache) -> dict:
    return {t["name"]: t for t in cache.stats()["tiers"]}["redis"]


class CountingClient:
    """Wraps a redis-py client; counts round trips (a pipeline's execute is one)."""

    def __init__(self, inner):
        self.inner = inner
        self.round_trips = 0

    def pipeline(self, *args, **kwargs):
        return _CountingPipeline(self, self.inner.pipeline(*args, **kwargs))

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.round_trips += 1
            return attr(*args, **kwargs)

        return call


class _CountingPipeline:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    def execute(self, *args, **kwargs):
        self.owner.round_trips += 1
        return self.inner.execute(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def count_round_trips(cache) -> CountingClient:
    tier = cache.store.tier("redis")
    counting = CountingClient(tier._connection())
    tier._client = counting
    return counting


# -- round trips through PrefixCache -------------------------------------------------------

SETUPS = {
    "redis": dict(cpu=0),
    "cpu+redis write-through": dict(cpu="4MiB"),
    "cpu+redis write-back": dict(cpu=3 * FRAME, write_through=()),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_raw_roundtrip_is_bit_exact(redis_url, setup):
    toks, kv = tokens_for(0, 6 * BLOCK + 7), make_kv(6 * BLOCK + 7, 0)
    cache = rcache(redis_url, **SETUPS[setup])
    res = cache.ingest(toks, kv)
    assert (res.blocks, res.stored, res.failed, res.errors) == (6, 6, 0, {})
    redis = redis_stats(cache)
    if setup == "cpu+redis write-back":
        # The cpu tier kept the head; the tail was demoted into Redis.
        assert cache.locate(toks).tiers == ["cpu"] * 3 + ["redis"] * 3
        assert redis["demotions"] == 3
    else:
        assert redis["blocks"] == 6 and redis["bytes_in"] == redis["used_bytes"]
    assert cache.lookup(toks) == 6 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, 6 * BLOCK)
    assert cache.lookup(toks) == 6 * BLOCK  # promotions moved blocks up and down; none was lost
    assert_prefix_equal(cache.materialize(toks), kv, 6 * BLOCK)
    again = cache.ingest(toks, kv)
    assert (again.stored, again.present) == (0, 6)
    cache.close()
    # A new process (here: a new client) finds every block Redis holds, exactly.
    fresh = rcache(redis_url)
    hashes = fresh.block_hashes(toks)
    if setup == "cpu+redis write-back":  # Redis holds what the cpu tier pushed out
        assert sum(fresh.store.contains_many(hashes)) == redis_stats(fresh)["blocks"] >= 3
    else:
        assert_prefix_equal(fresh.materialize(toks), kv, 6 * BLOCK)
        assert fresh.store.chain(hashes[-1]) == hashes


def test_kivi_frames_from_redis_decode_like_the_cpu_tier(redis_url):
    codec = cs.KIVI(bits=4, group_size=32)
    toks, kv = tokens_for(1, 4 * BLOCK), make_kv(4 * BLOCK, 1)
    rcache(redis_url, codec=codec).ingest(toks, kv)
    local = make_cache(codec=codec, cpu="4MiB")
    local.ingest(toks, kv)
    got, want = rcache(redis_url, codec=codec).materialize(toks), local.materialize(toks)
    assert got.num_tokens == want.num_tokens == 4 * BLOCK
    for (k, v), (k0, v0) in zip(got.layers, want.layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_round_trips_do_not_grow_with_the_chain(redis_url):
    toks, kv = tokens_for(2, 8 * BLOCK), make_kv(8 * BLOCK, 2)
    cache = rcache(redis_url)
    counter = count_round_trips(cache)
    cache.store.put_many([(f.meta.block_hash, f) for f in _frames(cache, toks, kv)])
    assert counter.round_trips == 3
    counter.round_trips = 0
    assert cache.lookup(toks) == 8 * BLOCK
    assert counter.round_trips == 1
    counter.round_trips = 0
    changed = list(toks)
    changed[5 * BLOCK] += 1
    assert cache.lookup(changed) == 5 * BLOCK
    assert counter.round_trips == 1
    counter.round_trips = 0
    cache.store.touch_chain(cache.block_hashes(toks))
    assert counter.round_trips == 1
    counter.round_trips = 0
    assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    assert counter.round_trips == 3  # locate, every frame, touch


@pytest.mark.parametrize("setup", ["redis", "cpu+redis write-back"])
def test_a_batch_lookup_asks_redis_once_and_answers_as_one_lookup_per_chain(redis_url, setup):
    """``locate_batch`` (and the server's lookup of several chains) asked Redis once per
    chain. Chains of other lengths, one sharing another's head, one never stored, one with a
    block gone from the middle, one held in part by the cpu tier (write-back): the same
    answers as one ``locate`` each, from one round trip, each shared block asked once."""
    import redis as redis_py

    cache = rcache(redis_url, **SETUPS[setup])
    long, gap = tokens_for(40, 6 * BLOCK + 7), tokens_for(41, 4 * BLOCK)
    for toks in (long, gap):
        cache.ingest(toks, make_kv(len(toks), 0))
    forked = long[: 3 * BLOCK] + tokens_for(42, 2 * BLOCK)  # shares 3 blocks with ``long``; the rest not stored
    assert cache.store.delete(cache.block_hashes(gap)[2])  # (as if evicted, or expired)
    prompts = [long, forked, tokens_for(43, 3 * BLOCK), gap, tokens_for(44, BLOCK - 1), long[: 2 * BLOCK]]
    r = redis_py.Redis.from_url(redis_url)
    counter = count_round_trips(cache)

    def exists_calls():
        return r.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)

    r.config_resetstat()
    one_each = [cache.locate(p) for p in prompts]
    each_trips, each_exists = counter.round_trips, exists_calls()
    counter.round_trips = 0
    r.config_resetstat()
    batched = cache.locate_batch(prompts)
    batch_exists = exists_calls()
    assert batched == one_each
    assert counter.round_trips == 1 < each_trips
    assert batch_exists < each_exists
    chains = [cache.block_hashes(p) for p in prompts]
    assert cache.store.locate_many(chains) == [cache.store.locate(c) for c in chains]
    assert [len(x.tiers) for x in one_each][1:] == [3, 0, 2, 0, 2]
    if setup == "redis":
        assert one_each[0].tiers == ["redis"] * 6
        assert each_trips == 5 and each_exists == 6 + 5 + 3 + 4 + 2  # one round trip a chain, an EXISTS a block
        assert batch_exists == 6 + 2 + 3 + 4  # each block once
    else:
        assert {t for x in one_each for t in x.tiers} == {"cpu", "redis"}  # (``gap``'s tail is in the cpu tier)
    cache.close()


def _frames(cache, toks, kv):
    from cacheseek.encode import encode_blocks

    hashes = cache.block_hashes(toks)
    return encode_blocks(cache.block_format, kv, first_block=0, hashes=hashes, parents=cache.keys.parents(hashes))


def test_another_process_reads_what_this_one_wrote(redis_url, tmp_path):
    toks, kv = tokens_for(3, 3 * BLOCK), make_kv(3 * BLOCK, 3)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from store_helpers import make_cache, make_kv, tokens_for, BLOCK
        cache = make_cache(cpu=0, redis_url={redis_url!r}, redis_bytes="64MiB")
        res = cache.ingest(tokens_for(3, 3 * BLOCK), make_kv(3 * BLOCK, 3))
        assert res.stored == 3, res
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    cache = rcache(redis_url)
    assert cache.lookup(toks) == 3 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
    assert redis_stats(cache)["blocks"] == 3  # the shared index counts the other process's blocks


# -- budget and TTL ------------------------------------------------------------------------


def test_the_budget_holds_and_chains_lose_their_tails_first(redis_url):
    cache = rcache(redis_url, redis_bytes=6 * FRAME)
    toks_a, kv_a = tokens_for(5, 4 * BLOCK), make_kv(4 * BLOCK, 5)
    toks_b, kv_b = tokens_for(6, 4 * BLOCK), make_kv(4 * BLOCK, 6)
    cache.ingest(toks_a, kv_a)
    cache.ingest(toks_b, kv_b)
    redis = redis_stats(cache)
    assert redis["used_bytes"] <= redis["capacity_bytes"] and redis["blocks"] == 6 and redis["evictions"] == 2
    assert cache.lookup(toks_b) == 4 * BLOCK
    assert cache.lookup(toks_a) == 2 * BLOCK  # A's tail went, its head is still usable
    assert_prefix_equal(cache.materialize(toks_a), kv_a, 2 * BLOCK)
    toks_c, kv_c = tokens_for(7, 2 * BLOCK), make_kv(2 * BLOCK, 7)
    cache.ingest(toks_c, kv_c)  # A was used last: B's tail goes now
    assert (cache.lookup(toks_a), cache.lookup(toks_b), cache.lookup(toks_c)) == (2 * BLOCK, 2 * BLOCK, 2 * BLOCK)
    tier = cache.store.tier("redis")
    assert tier.check() == {"ok": 6, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}


def test_clients_sharing_a_namespace_share_one_budget(redis_url, server):
    caches = [rcache(redis_url, redis_bytes=5 * FRAME) for _ in range(3)]
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(4):
                seed = 200 + 10 * w + i
                caches[w].ingest(tokens_for(seed, 2 * BLOCK), make_kv(2 * BLOCK, seed))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    totals = [redis_stats(c) for c in caches]
    assert len({(t["used_bytes"], t["blocks"]) for t in totals}) == 1  # one shared view
    assert totals[0]["used_bytes"] <= 5 * FRAME and totals[0]["blocks"] == 5
    frames = [k for k in server.cli("KEYS", "cacheseek:default:{*}").split() if k]
    assert len(frames) == 5  # what Redis holds is what the index counts
    assert sum(t["evictions"] for t in totals) == 3 * 4 * 2 - 5


def test_a_frame_larger_than_the_budget_is_refused_and_counted(redis_url):
    cache = rcache(redis_url, redis_bytes=FRAME // 2)
    res = cache.ingest(tokens_for(8, BLOCK), make_kv(BLOCK, 8))
    assert (res.stored, res.failed) == (0, 1) and "exceeds" in res.errors["redis"]
    assert redis_stats(cache)["write_errors"] == 1


def test_a_batch_larger_than_the_budget_keeps_its_head(redis_url):
    cache = rcache(redis_url, redis_bytes=3 * FRAME)
    toks, kv = tokens_for(9, 5 * BLOCK), make_kv(5 * BLOCK, 9)
    res = cache.ingest(toks, kv)
    assert res.failed == 0
    assert cache.lookup(toks) == 3 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
    assert cache.store.tier("redis").check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}


def test_ttl_expires_blocks_unused_that_long(redis_url, server):
    cache = rcache(redis_url, redis_ttl_seconds=1.5)
    toks, kv = tokens_for(10, 2 * BLOCK), make_kv(2 * BLOCK, 10)
    cache.ingest(toks, kv)
    key = RedisKeys().frame(cache.block_hashes(toks)[0])
    assert 0 < int(server.cli("PTTL", key)) <= 1500
    time.sleep(0.8)
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)  # a use restarts the TTL
    time.sleep(0.8)
    assert cache.lookup(toks) == 2 * BLOCK  # 1.6 s after the write, 0.8 s after the use
    time.sleep(1.6)
    assert cache.lookup(toks) == 0
    assert cache.materialize(toks).num_tokens == 0
    redis = redis_stats(cache)  # the index drops expired entries too
    assert (redis["blocks"], redis["used_bytes"]) == (0, 0)


def test_without_ttl_nothing_expires(redis_url, server):
    cache = rcache(redis_url)
    toks = tokens_for(11, BLOCK)
    cache.ingest(toks, make_kv(BLOCK, 11))
    assert int(server.cli("PTTL", RedisKeys().frame(cache.block_hashes(toks)[0]))) == -1


# -- isolation and corruption ----------------------------------------------------------------


def test_namespaces_and_prefixes_are_isolated(redis_url):
    toks, kv = tokens_for(12, 2 * BLOCK), make_kv(2 * BLOCK, 12)
    a = rcache(redis_url, redis_namespace="tenant-a")
    a.ingest(toks, kv)
    assert rcache(redis_url, redis_namespace="tenant-a").lookup(toks) == 2 * BLOCK
    for other in (dict(redis_namespace="tenant-b"), dict(redis_prefix="other"), dict(namespace="cache-ns")):
        cache = rcache(redis_url, **{"redis_namespace": "tenant-a", **other})
        same_hash = "namespace" not in other
        assert (cache.block_hashes(toks) == a.block_hashes(toks)) == same_hash
        assert cache.lookup(toks) == 0, other
        assert cache.materialize(toks).num_tokens == 0
        assert redis_stats(cache)["blocks"] == (2 if other == dict(namespace="cache-ns") else 0)
        assert cache.store.tier("redis").keys() == ([] if same_hash else a.store.tier("redis").keys())


@pytest.mark.parametrize("damage", ["garbage", "flip", "truncate", "other-block"])
def test_a_corrupt_value_is_a_counted_miss_and_is_deleted(redis_url, server, damage):
    toks, kv = tokens_for(13, 3 * BLOCK), make_kv(3 * BLOCK, 13)
    cache = rcache(redis_url)
    cache.ingest(toks, kv)
    hashes = cache.block_hashes(toks)
    tier = cache.store.tier("redis")
    client = tier._connection()
    name = RedisKeys().frame(hashes[1])
    value = client.get(name)
    if damage == "garbage":
        value = b"not a frame at all"
    elif damage == "flip":
        value = value[:-100] + bytes([value[-100] ^ 0x40]) + value[-99:]
    elif damage == "truncate":
        value = value[:-1000]
    else:
        value = client.get(RedisKeys().frame(hashes[2]))
    client.set(name, value)
    got = cache.materialize(toks)
    assert_prefix_equal(got, kv, BLOCK)  # the prefix ends before the bad block
    redis = redis_stats(cache)
    assert redis["corrupt"] == 1 and redis["blocks"] == 2
    assert client.exists(name) == 0
    assert cache.lookup(toks) == BLOCK


def test_a_frame_of_another_format_version_is_a_counted_miss_and_stays(redis_url):
    """A rolling upgrade: two releases share one Redis. A frame the other one wrote, whole,
    is a miss here (counted ``foreign_version``, not ``corrupt``) and stays where it is for
    that release: deleted, each release emptied the shared tier of the other's frames.
    Neither served, nor promoted, nor read again and again."""
    toks, kv = tokens_for(21, 3 * BLOCK), make_kv(3 * BLOCK, 21)
    writer = rcache(redis_url)
    writer.ingest(toks, kv)
    hashes = writer.block_hashes(toks)
    client = writer.store.tier("redis")._connection()
    name = RedisKeys().frame(hashes[1])
    theirs = as_other_version(client.get(name))
    client.set(name, theirs)
    cache = rcache(redis_url, cpu="4MiB")  # (a CPU tier above: a hit below is promoted into it)
    tier = cache.store.tier("redis")
    counted = []
    for _ in range(3):
        assert_prefix_equal(cache.materialize(toks), kv, BLOCK)  # the prefix ends before it
        redis = redis_stats(cache)
        counted.append(redis["foreign_version"])
        assert redis["corrupt"] == 0
        assert client.get(name) == theirs and redis["blocks"] == 3  # kept, and counted in the shared budget
    # (the first materialize reads it twice: where it was located, and once more from any tier,
    # as any block found missing where it was located; then it is remembered as the other
    # release's, and a lookup no longer finds it)
    assert counted == [2, 2, 2]
    assert not cache.store.tier("cpu").contains(hashes[1])
    assert tier.info(hashes[1]) is None and client.get(name) == theirs
    assert redis_stats(cache)["corrupt"] == 0


def _version_rewritten(frame: bytes, version: int = 2) -> bytes:
    """``frame`` with only its header's ``v`` changed (under a valid header checksum): another
    release's frame of the block at the same length, as a release that changed the format alone
    and left the header's size writes it (headers are padded to 64 bytes)."""
    import msgpack
    import xxhash

    from cacheseek.store.frame import PREAMBLE

    data = bytearray(frame)
    magic, header_len, _ = PREAMBLE.unpack_from(data)
    header = msgpack.packb({**msgpack.unpackb(bytes(data[16 : 16 + header_len]), raw=False), "v": version},
                           use_bin_type=True)
    assert len(header) == header_len
    data[16 : 16 + header_len] = header
    PREAMBLE.pack_into(data, 0, magic, header_len, xxhash.xxh3_64_intdigest(header))
    return bytes(data)


def test_another_releases_frames_of_a_prefix_in_use_are_written_over_by_its_next_save(redis_url):
    """A rolling upgrade or a rollback: a hot prompt's frames in the shared Redis are the other
    release's. This release's read missed them (``foreign_version``), and its save after the miss
    found them "stored" (a value of the frame's length), stored none of its own and touched them
    in the shared LRU: while the prompt was in use they never aged out, and it missed for good
    (12 rounds of the audit's run: 0 of 256 tokens each). Now the save writes this release's
    frames over them, counted at their size, and the next load hits."""
    toks, kv = tokens_for(23, 4 * BLOCK), make_kv(4 * BLOCK, 23)
    writer = rcache(redis_url, redis_bytes="1MiB")
    assert writer.ingest(toks, kv).stored == 4
    writer.close()
    client = writer.store.tier("redis")._connection()
    names = [RedisKeys().frame(h) for h in writer.block_hashes(toks)]
    theirs = {name: _version_rewritten(client.get(name)) for name in names}
    for name, value in theirs.items():  # (the other release wrote them; its index counts them)
        client.set(name, value)
    cache = rcache(redis_url, redis_bytes="1MiB")
    tier = cache.store.tier("redis")
    before = {name: client.zscore(tier.keys_of.lru, name[name.index("{") + 1 : -1]) for name in names}
    assert cache.materialize(toks).num_tokens == 0  # (the lookup found them; the read missed)
    assert redis_stats(cache)["foreign_version"] >= 1
    # Not stored, for this release: neither found by a lookup nor touched.
    assert cache.lookup(toks) == 0
    tier.touch(writer.block_hashes(toks))
    assert {name: client.zscore(tier.keys_of.lru, name[name.index("{") + 1 : -1]) for name in names} == before
    res = cache.ingest(toks, kv)
    assert (res.stored, res.present) == (4, 0), res
    for name in names:
        assert client.get(name) != theirs[name]
    assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)
    assert cache.lookup(toks) == 4 * BLOCK
    stats = redis_stats(cache)
    assert stats["used_bytes"] == sum(client.strlen(name) for name in names)
    assert tier.check() == {"ok": 4, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    cache.close()


def test_a_save_writes_over_another_releases_frame_this_process_never_read(redis_url):
    """Another process read the other release's frame; this one never did. Its save's first
    question (``present_many``, an ``EXISTS``) answered present, and its put found a value of the
    frame's length and answered "already there" (stored=None), keeping the other release's frame:
    now both read the value's first bytes (the put in the same round trip as its length), and the
    frame is written. One of another length too (the other release
    counted it at its own): the shared index counts the frame written, at its size."""
    frames = [_frame(i) for i in (60, 61, 62)]
    tier = RedisTier(redis_url, 64 << 20)
    c = tier._connection()
    try:
        tier.put_many(frames)
        same, longer, ours = frames
        c.set(tier.keys_of.frame(same[0]), _version_rewritten(same[1].to_bytes()))
        assert tier.delete(longer[0])  # counted anew below, as the other release's put counted it
        theirs = as_other_version(longer[1].to_bytes()) + bytes(512)  # (its payload laid out its own way)
        c.set(tier.keys_of.frame(longer[0]), theirs)
        other = RedisTier(redis_url, 64 << 20)  # the other release's put, as its index script counts
        other._index.queue(other._connection(), add=[(RedisKeys.member(longer[0]), len(theirs),
                                                      longer[1].meta.raw_nbytes)])
        other.close()
        assert tier.contains_many([k for k, _ in frames]) == [True] * 3  # (never read here: found by EXISTS)
        # A save's first question (an ingest's, a server's before it writes what it received)
        # reads each value's first bytes: another release's frame is not this block stored.
        assert tier.present_many([k for k, _ in frames]) == [False, False, True]
        results = tier.put_many(frames)
        assert [r.stored is not None for r in results] == [True, True, False]  # (``ours``: already there)
        for key, frame in frames:
            assert c.get(tier.keys_of.frame(key)) == frame.to_bytes()
        assert tier.stats().used_bytes == sum(f.nbytes for _, f in frames)
        assert tier.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()


def test_a_block_remembered_as_another_releases_is_touched_again_once_a_read_finds_this_releases(redis_url):
    """A read that finds another release's frame remembers its block (not stored, for this
    release: not touched). Another process's save then writes this release's frame over it:
    the next read here hits, and touches move the block in the shared LRU again. Before, the
    block stayed remembered: hit after hit here, its place in the LRU never moved."""
    key, frame = _frame(63)
    tier, other = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    c = tier._connection()
    member = RedisKeys.member(key)
    try:
        tier.put(key, frame)
        c.set(tier.keys_of.frame(key), _version_rewritten(frame.to_bytes()))
        assert tier.get(key) is None and tier.stats().foreign_version == 1
        assert other.present_many([key]) == [False] and other.put(key, frame).stored is not None
        got = tier.get(key)
        assert got is not None and bytes(got.host) == frame.to_bytes()
        c.zadd(tier.keys_of.lru, {member: 1}, xx=True)
        tier.touch([key])
        assert float(c.zscore(tier.keys_of.lru, member)) > 1
    finally:
        tier.close()
        other.close()


def test_a_value_larger_than_any_frame_is_a_corrupt_miss_never_read_whole(redis_url, caplog):
    """A value under a frame's name larger than the largest frame the reader makes (the
    cache's configuration; a server's max_frame_bytes) is damage: each read took it whole
    (up to Redis's 512 MB) before parsing it. Now at most one byte past the bound is read,
    and the value is counted corrupt and deleted, and said in the log (a server sharing the
    Redis with a larger ``max_frame_bytes`` may have written it)."""
    caplog.set_level(logging.WARNING, "cacheseek.store.redis")
    toks, kv = tokens_for(22, 3 * BLOCK), make_kv(3 * BLOCK, 22)
    cache = rcache(redis_url)
    cache.ingest(toks, kv)
    hashes = cache.block_hashes(toks)
    bound = cache.block_format.max_frame_nbytes()
    counting = count_round_trips(cache)
    replies: list[int] = []
    execute = _CountingPipeline.execute

    def measuring(self, *args, **kwargs):
        out = execute(self, *args, **kwargs)
        replies.extend(len(r) for r in out if isinstance(r, bytes))
        return out

    client = counting.inner
    name = RedisKeys().frame(hashes[1])
    client.set(name, client.get(name) + bytes(4 << 20))
    try:
        _CountingPipeline.execute = measuring
        assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    finally:
        _CountingPipeline.execute = execute
    assert replies and max(replies) <= bound + 1
    assert redis_stats(cache)["corrupt"] == 1 and client.exists(name) == 0
    assert cache.lookup(toks) == BLOCK
    said = [r.getMessage() for r in caplog.records if "found bad and deleted" in r.getMessage()]
    assert len(said) == 1 and f"block {hashes[1].hex()}, larger than the largest frame read here, {bound} bytes" \
        in said[0]


def test_info_reads_the_header_and_a_bad_header_is_dropped(redis_url):
    toks, kv = tokens_for(14, 2 * BLOCK), make_kv(2 * BLOCK, 14)
    cache = rcache(redis_url)
    cache.ingest(toks, kv)
    h0, h1 = cache.block_hashes(toks)
    tier = cache.store.tier("redis")
    info = tier.info(h1)
    assert (info.parent, info.position, info.raw_nbytes) == (h0, 1, LAYOUT.raw_nbytes(BLOCK))
    assert info.nbytes == tier.get(h1).nbytes
    assert tier.info(b"\x07" * 16) is None
    tier._connection().setrange(RedisKeys().frame(h1), 20, b"\xff\xff")  # inside the msgpack header
    assert tier.info(h1) is None
    assert redis_stats(cache)["corrupt"] == 1 and not tier.contains(h1)


def test_check_finds_ghosts_and_orphans_and_fixes_them(redis_url):
    toks, kv = tokens_for(15, 3 * BLOCK), make_kv(3 * BLOCK, 15)
    cache = rcache(redis_url)
    cache.ingest(toks, kv)
    h = cache.block_hashes(toks)
    tier = cache.store.tier("redis")
    c = tier._connection()
    keys = RedisKeys()
    c.delete(keys.frame(h[2]))  # a ghost: an interrupted write (long ago: see the grace below)
    c.zadd(keys.lru, {h[2].hex(): 1}, xx=True)
    tier._index.queue(c, forget=[h[1].hex()])  # an orphan: an eviction whose DEL was lost
    assert tier.check() == {"ok": 1, "ghosts": 1, "orphans": 1, "wrong_size": 0, "stale_owner_tags": 0}
    tier.check(fix=True)
    assert tier.check() == {"ok": 2, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    redis = redis_stats(cache)
    assert redis["blocks"] == 2 and redis["used_bytes"] == 2 * tier.info(h[0]).nbytes


def test_check_finds_owner_tags_of_blocks_no_longer_counted_and_fix_removes_them(redis_url):
    """A release before owner tags shares the namespace: its evictions drop a block from the
    index but not its tag in ``{prefix:ns}:owner`` (its script knows no such hash). Such tags
    stayed for good, outside the budget, and ``redis-check`` said the namespace was clean.
    Now ``check`` counts them (``stale_owner_tags``; redis-check exits 1), and ``fix``
    removes them, each only while its block is still uncounted: a put of one between the
    scan and the repair keeps its tag."""
    from server_helpers import cacheseek_command

    frames = [_frame(i) for i in range(70, 75)]
    tier = RedisTier(redis_url, 64 << 20)
    tier.owner_tag = lambda key: "tenA"
    c = tier._connection()
    try:
        tier.put_many(frames)
        members = [RedisKeys.member(k) for k, _ in frames]
        for m in members[:3]:  # evicted by the older release: index entry and frame gone, tag left
            tier._index.queue(c, forget=[m])
            c.delete(tier.keys_of.frame_of_member(m))
            c.hset(tier.keys_of.owners, m, "tenA")
        assert tier.check() == {"ok": 2, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 3}
        command = [*cacheseek_command(), "redis-check", "--redis-url", redis_url, "--redis-bytes", "64MiB"]
        found = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert found.returncode == 1 and json.loads(found.stdout)["found"]["stale_owner_tags"] == 3, found.stderr
        # One of them is put again (counted, tagged) between the check's scan and its repair.
        real = tier._index.drop_stale_owner_tags

        def put_first(client, stale):
            assert sorted(stale) == sorted(members[:3])
            tier.put_many([frames[0]])
            return real(client, stale)

        tier._index = _IndexWith(tier._index, drop_stale_owner_tags=put_first)
        assert tier.check(fix=True)["stale_owner_tags"] == 3
        assert c.hget(tier.keys_of.owners, members[0]) == b"tenA"  # the put's own tag, kept
        assert sorted(c.hkeys(tier.keys_of.owners)) == sorted(m.encode() for m in [members[0], *members[3:]])
        assert tier.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert tier.owned(lambda tag: tag == "tenA") and len(tier.owned(lambda tag: tag == "tenA")) == 3
    finally:
        tier.close()


class _IndexWith:
    """A ``SharedIndex`` with some methods replaced (it is a frozen dataclass)."""

    def __init__(self, inner, **methods):
        self._inner, self._methods = inner, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._inner, name)


def test_redis_refusing_writes_is_counted_without_opening_the_breaker(redis_url, server):
    cache = rcache(redis_url, cpu="4MiB")
    used = int(server.cli("INFO", "memory").split("used_memory:")[1].split()[0])
    server.cli("CONFIG", "SET", "maxmemory", str(used + 2 * FRAME))
    server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    try:
        toks, kv = tokens_for(16, 8 * BLOCK), make_kv(8 * BLOCK, 16)
        res = cache.ingest(toks, kv)
        # Redis is this cache's only persistent tier: what it refused is not durable, so not
        # acknowledged, though the cpu tier took every block and serves it.
        assert res.stored == 0 and res.failed == 8 and "maxmemory" in res.errors["redis"]
        redis = redis_stats(cache)
        assert redis["dropped_writes"] >= 1 and redis["rejected_errors"] >= 1
        assert redis["breaker"]["state"] == "closed"
        assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    finally:
        server.cli("CONFIG", "SET", "maxmemory", "0")
    assert cache.store.tier("redis").check()["ghosts"] == 0  # refused SETs were uncounted


# -- the index and the frames under races ------------------------------------------------------


class _HookedClient(CountingClient):
    """Runs ``after(n)`` once the n-th round trip (a pipeline or a direct call) is answered."""

    def __init__(self, inner, after):
        super().__init__(inner)
        self.after = after

    def pipeline(self, *args, **kwargs):
        return _HookedPipeline(self, self.inner.pipeline(*args, **kwargs))

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            reply = attr(*args, **kwargs)
            self.after(self.round_trips)
            return reply

        return call


class _HookedPipeline(_CountingPipeline):
    def execute(self, *args, **kwargs):
        replies = super().execute(*args, **kwargs)
        self.owner.after(self.owner.round_trips)
        return replies


def test_a_block_pinned_by_another_process_during_a_put_keeps_its_frame(redis_url):
    writer, other = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    key, frame = _frame(40)
    # The other process pins the block after this put's SET, before its check of the index.
    writer._client = _HookedClient(writer._connection(), lambda n: n == 2 and other.pin([key]))
    try:
        assert writer.put(key, frame).stored is not None
        s = other.stats()
        assert (s.blocks, s.pinned_blocks) == (1, 1)
        assert other.get(key) is not None  # counted, pinned, and stored: not taken for evicted
        assert other.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        writer.close()
        other.close()


def test_a_put_finding_its_block_expired_in_the_index_writes_it_again(redis_url):
    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(41)
    try:
        tier.put(key, frame)
        # The index's entry ran out before the frame's expiry (the index clock is set one
        # round trip before the SET's PX): the next put prunes it and counts it anew.
        c = tier._connection()
        c.zadd(tier.keys_of.lru, {RedisKeys.member(key): 1}, xx=True)
        again = tier.put(key, _frame(41)[1])
        assert again.error is None
        assert tier.get(key) is not None  # not deleted with the other expired entries
        assert int(c.pttl(tier.keys_of.frame(key))) > 50_000
        assert tier.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()


def test_a_refused_rewrite_of_an_expired_block_leaves_no_uncounted_value(redis_url, server):
    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(55)
    c = tier._connection()
    try:
        tier.put(key, frame)
        c.zadd(tier.keys_of.lru, {RedisKeys.member(key): 1}, xx=True)  # expired in the index
        used = int(server.cli("INFO", "memory").split("used_memory:")[1].split()[0])
        server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        # Well under what is used: the rewrite is refused (OOM) even if Redis frees a little
        # meanwhile (at exactly what INFO said, a write fitted once in CI).
        server.cli("CONFIG", "SET", "maxmemory", str(used // 2))
        try:
            with pytest.raises(StorageError, match="maxmemory"):
                tier.put(key, _frame(55)[1])
        finally:
            server.cli("CONFIG", "SET", "maxmemory", "0")
        assert not c.exists(tier.keys_of.frame(key))  # not left behind, uncounted
        assert tier.check() == {"ok": 0, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()


def test_a_write_of_a_stored_block_restarts_its_expiry_unless_pinned(redis_url):
    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    (key, frame), (pinned, pframe) = _frame(42), _frame(43)
    c = tier._connection()
    try:
        tier.put_many([(key, frame), (pinned, pframe)])
        tier.pin([pinned])
        c.pexpire(tier.keys_of.frame(key), 1000)  # as if written 59 s ago
        assert tier.put(key, _frame(42)[1]).stored is None  # present: not sent again
        assert int(c.pttl(tier.keys_of.frame(key))) > 50_000
        assert tier.put(pinned, _frame(43)[1]).stored is None
        assert int(c.pttl(tier.keys_of.frame(pinned))) == -1  # a pinned frame keeps no expiry
        c.delete(tier.keys_of.frame(pinned))  # a pinned ghost, written again
        assert tier.put(pinned, _frame(43)[1]).stored is not None
        assert int(c.pttl(tier.keys_of.frame(pinned))) == -1
    finally:
        tier.close()


@pytest.mark.parametrize("stored_before", [False, True], ids=["new", "present"])
def test_a_pin_made_during_a_put_with_a_ttl_leaves_the_frame_without_expiry(redis_url, stored_before):
    # The other process pins the block after this put looked at the index (round trip 1),
    # before its SET with PX (new block) or its PEXPIRE (stored block) lands.
    writer, other = RedisTier(redis_url, 64 << 20, ttl_seconds=60), RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(48 + stored_before)
    c = writer._connection()
    try:
        if stored_before:
            writer.put(key, frame)
        writer._client = _HookedClient(writer._connection(), lambda n: n == 1 and other.pin([key]))
        writer.put(key, _frame(48 + stored_before)[1])
        assert int(c.pttl(writer.keys_of.frame(key))) == -1  # pinned: it must not expire
        assert other.get(key) is not None and other.stats().pinned_blocks == 1
        other.unpin([key])
        assert int(c.pttl(writer.keys_of.frame(key))) > 50_000  # unpinned: it expires again
    finally:
        writer.close()
        other.close()


def test_a_touch_leaves_a_block_pinned_by_another_process_without_expiry(redis_url):
    mine, other = RedisTier(redis_url, 64 << 20, ttl_seconds=60), RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(50)
    c = mine._connection()
    try:
        mine.put(key, frame)
        other.pin([key])  # this process has not seen that pin yet
        counter = mine._client = CountingClient(mine._connection())
        mine.touch([key])
        assert int(c.pttl(mine.keys_of.frame(key))) == -1
        assert counter.round_trips == 2  # the touch, with its check; then the PERSIST it found needed
        counter.round_trips = 0
        mine.touch([_frame(51)[0]])  # nothing pinned to find: the touch alone
        assert counter.round_trips == 1
        # and an unpin here, while the other process pins again, leaves the pin's frame alone
        mine.pin([key])
        mine._client = _HookedClient(mine._connection(), lambda n: n == 1 and other.pin([key]))
        mine.unpin([key])  # the index's unpin, then the other's pin, then this PEXPIRE
        assert other.stats().pinned_blocks == 1
        assert int(c.pttl(mine.keys_of.frame(key))) == -1
    finally:
        mine.close()
        other.close()


def test_a_touch_restarts_the_expiry_of_a_block_whose_pin_is_gone(redis_url, server):
    """This process's view of the pins can be stale: another process unpinned the block since,
    or Redis was flushed (or restarted) under a pin this process made. A touch restarts such a
    block's expiry all the same: it skipped the PEXPIRE, so a chain in use expired under its
    reader while the index went on counting it."""
    mine, other = RedisTier(redis_url, 64 << 20, ttl_seconds=60), RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(52)
    name = mine.keys_of.frame(key)
    c = mine._connection()
    try:
        mine.put(key, frame)
        other.pin([key])
        mine.stats()  # this process learns the other's pin
        other.unpin([key])
        c.pexpire(name, 5000)  # (time passing: the expiry runs down)
        mine.touch([key])
        assert int(c.pttl(name)) > 50_000
        mine.pin([key])
        server.cli("FLUSHALL")  # the pin is gone with everything else
        mine.put(key, frame)
        c.pexpire(name, 5000)
        mine.touch([key])
        assert int(c.pttl(name)) > 50_000
        mine.pin([key])  # pinned again: its frame keeps no expiry
        mine.touch([key])
        assert int(c.pttl(name)) == -1
    finally:
        mine.close()
        other.close()


def test_a_put_that_pushes_blocks_out_hands_their_frames_down_when_asked(redis_url):
    # A Redis tier above another (demote_evicted): each victim comes back with its frame.
    frames = [_frame(i) for i in range(51, 54)]
    tier = RedisTier(redis_url, 2 * frames[0][1].nbytes + 10, ttl_seconds=60)
    tier.demote_evicted = True
    try:
        tier.put_many(frames[:2])
        out = tier.put_many(frames[2:])[0]
        assert out.error is None and [k for k, _ in out.evicted] == [frames[0][0]]
        victim = out.evicted[0][1]
        assert victim is not None and bytes(victim.host) == bytes(frames[0][1].host)
    finally:
        tier.close()


@pytest.mark.parametrize("server_start", [False, True])
def test_a_restart_with_a_smaller_disk_budget_hands_what_it_trims_down_to_redis(redis_url, tmp_path, server_start):
    """A disk over Redis, write-back: the disk hands what it evicts down to Redis. A restart
    with a smaller ``disk_bytes`` trims the directory to it; the blocks it trimmed were
    deleted, not handed down, though Redis had room. Embedded (trimmed as the store is
    built) and as the server does it (built untrimmed, then ``store.trim()``)."""
    toks, kv = tokens_for(41, 6 * BLOCK), make_kv(6 * BLOCK, 41)
    cache = rcache(redis_url, disk=tmp_path / "d", disk_bytes=8 * FRAME, write_through=())
    assert cache.ingest(toks, kv).stored == 6
    assert cache.locate(toks).tiers == ["disk"] * 6
    keys = cache.block_hashes(toks)
    cache.close()
    config = cs.TierConfig(cpu_bytes=0, disk_path=tmp_path / "d", disk_bytes=3 * FRAME + FRAME // 2,
                           redis_url=redis_url, redis_bytes="64MiB", write_through=())
    if server_start:
        store = config.build(trim_disk_at_open=False)
        store.trim()
    else:
        store = config.build()
    try:
        disk, redis = store.tiers
        assert disk.stats().blocks == 3 and disk.stats().evictions == 3
        assert redis.stats().demotions == 3
        assert store.locate(keys) == ["disk"] * 3 + ["redis"] * 3  # the tails went down, the heads stayed
    finally:
        store.close()


def test_a_disk_victim_that_cannot_be_read_to_hand_down_to_redis_stays_on_disk(redis_url, tmp_path, monkeypatch):
    """A disk over Redis, write-back: a block the disk evicts goes down to Redis, read from
    its file first. A read that found no descriptor (EMFILE, once) lost the victim: deleted
    from the disk, never in Redis. It stays on the disk now; the ingest that needed its room
    goes to Redis instead (not acknowledged: the disk is the durable tier)."""
    import errno
    import os

    from cacheseek.store import direct_io

    cache = rcache(redis_url, disk=tmp_path / "d", disk_bytes=3 * FRAME + FRAME // 2, write_through=())
    a, kv_a = tokens_for(40, 3 * BLOCK), make_kv(3 * BLOCK, 40)
    b, kv_b = tokens_for(41, BLOCK), make_kv(BLOCK, 41)
    assert cache.ingest(a, kv_a).stored == 3  # the disk is full
    real = os.open

    def no_descriptor_once(path, flags, *args, **kw):
        if not str(path).endswith(".frame"):  # a frame file's read, not its write (a temp file)
            return real(path, flags, *args, **kw)
        monkeypatch.setattr(direct_io.os, "open", real)
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(direct_io.os, "open", no_descriptor_once)
    res = cache.ingest(b, kv_b)
    assert (res.stored, res.failed) == (0, 1) and "could not be read" in res.errors["disk"]
    assert cache.locate(a).tiers == ["disk"] * 3 and cache.locate(b).tiers == ["redis"]
    disk = {t["name"]: t for t in cache.stats()["tiers"]}["disk"]
    assert (disk["evictions"], disk["read_errors"], disk["write_errors"]) == (0, 1, 1)
    assert_prefix_equal(cache.materialize(a), kv_a, 3 * BLOCK)
    # The descriptor back: the next ingest that needs room hands the victim down to Redis.
    assert cache.ingest(tokens_for(42, BLOCK), make_kv(BLOCK, 42)).stored == 1
    assert redis_stats(cache)["demotions"] == 1
    assert cache.lookup(a) == 3 * BLOCK and cache.lookup(b) == BLOCK
    cache.close()


def test_a_read_forgets_a_ghost_idle_past_the_grace_and_no_other(redis_url):
    tier = RedisTier(redis_url, 64 << 20)
    frames = [_frame(i) for i in range(44, 48)]
    old, fresh, pinned, back = [k for k, _ in frames]
    c = tier._connection()
    try:
        tier.put_many(frames)
        tier.pin([pinned])
        for k in (old, fresh, pinned, back):  # gone from Redis (maxmemory, expiry), still counted
            c.delete(tier.keys_of.frame(k))
        for k in (old, back):  # untouched for longer than any write takes
            c.zadd(tier.keys_of.lru, {RedisKeys.member(k): 1}, xx=True)
        # ``back``'s write, stalled past the grace, lands between the read and the repair.
        real = tier._pipelined

        def pipelined(client, command, names, **kw):
            if command == "exists":
                c.set(tier.keys_of.frame(back), frames[3][1].to_bytes())
            return real(client, command, names, **kw)

        tier._pipelined = pipelined
        assert tier.get_many([old, fresh, pinned, back]) == [None] * 4
        del tier._pipelined
        # ``fresh`` may be a write in flight, ``pinned`` is kept by its pin, ``back`` is stored.
        assert sorted(tier.keys()) == sorted([fresh, pinned, back])
        assert tier.check() == {"ok": 1, "ghosts": 2, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert tier.stats().blocks == 3
    finally:
        tier.close()


def test_redis_check_fix_while_a_put_is_in_flight_keeps_the_write(redis_url):
    # A put counts its block, then SETs its frame a round trip later. ``check(fix=True)`` run
    # between the two (redis-check --fix while servers write) saw a ghost, forgot it, and the
    # put, finding its block no longer counted, deleted the frame it had just acknowledged.
    writer, checker = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    key, frame = _frame(50)
    counted, go = threading.Event(), threading.Event()
    real = writer._settle

    def settle(client, update, **kw):
        if kw.get("victims") is False and not counted.is_set():  # the put's, after its index add
            counted.set()
            assert go.wait(10)
        return real(client, update, **kw)

    writer._settle = settle
    results = []
    put = threading.Thread(target=lambda: results.append(writer.put_many([(key, frame)])[0]))
    try:
        put.start()
        assert counted.wait(10)
        assert checker.check() == {"ok": 0, "ghosts": 1, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}  # (a write in flight looks like one)
        checker.check(fix=True)
        go.set()
        put.join(10)
        assert results and results[0].error is None and results[0].stored is not None
        got = checker.get(key)
        assert got is not None and bytes(got.host) == frame.to_bytes()
        assert checker.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        # An old ghost still goes (and a pinned one, which no write is filling: see below).
        (old, old_frame), (pinned, pinned_frame) = _frame(51), _frame(52)
        checker.put_many([(old, old_frame), (pinned, pinned_frame)])
        checker.pin([pinned])
        c = checker._connection()
        for k in (old, pinned):
            c.delete(checker.keys_of.frame(k))
        c.zadd(checker.keys_of.lru, {RedisKeys.member(old): 1}, xx=True)  # idle past the grace
        assert checker.check(fix=True) == {"ok": 1, "ghosts": 2, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert checker.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        go.set()
        put.join(10)
        writer.close()
        checker.close()


def test_two_frames_of_different_sizes_under_one_hash_are_counted_as_stored(redis_url):
    # Two processes store different frames under one block hash (a writer with a bug, or a
    # client that lies): the second, finding a value of another length, writes over it. The
    # index kept the first one's size, so the shared budget counted bytes other than those
    # stored (a larger frame overran it unseen), and no check saw it.
    first, second = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    key, small = _frame(53)
    meta = plan_frame(block_hash=key, parent_hash=bytes(16), position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(), buffers=[("k", "float16", (3, 2, BLOCK, 128)), ("v", "float16", (3, 2, BLOCK, 128))])
    large = BlockFrame(meta, host=memoryview(build_frame(meta, [b"\x07" * meta.tensors[0].nbytes] * 2)))
    assert large.nbytes > small.nbytes
    c = first._connection()
    try:
        assert first.put(key, small).stored is not None
        assert second.put(key, large).stored is not None  # (another length: written over)
        assert bytes(first.get(key).host) == large.to_bytes()
        stored = int(c.strlen(first.keys_of.frame(key)))
        assert first.stats().used_bytes == second.stats().used_bytes == stored
        assert first.put(key, small).stored is not None  # and back
        stored = int(c.strlen(first.keys_of.frame(key)))
        assert stored == small.nbytes and second.stats().used_bytes == stored
        second.pin([key])
        assert second.put(key, large).stored is not None  # a pinned block's size is counted as pinned
        st = first.stats()
        assert st.used_bytes == st.pinned_bytes == large.nbytes and st.blocks == 1
    finally:
        first.close()
        second.close()


def _sized(i: int, variant: int) -> tuple[bytes, BlockFrame]:
    """A frame of block ``i``, one of several sizes under the same hash (``variant`` 0 is
    ``_frame(i)``'s size; each next one holds 49152 bytes more), as the soak's writers store."""
    key, dim = i.to_bytes(16, "big"), 64 * (1 + variant)
    meta = plan_frame(block_hash=key, parent_hash=bytes(16), position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(), buffers=[("k", "float16", (3, 2, BLOCK, dim)), ("v", "float16", (3, 2, BLOCK, dim))])
    return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([(i + variant) % 256]) * meta.tensors[0].nbytes] * 2)))


def _stored_bytes(tier: RedisTier) -> int:
    c = tier._connection()
    return sum(int(c.strlen(n)) for n in c.scan_iter(match=tier.keys_of.frame_pattern))


def _between_count_and_set(tier: RedisTier, then) -> None:
    """Run ``then()`` once, in ``tier``'s next put, after its index script counted its frames
    and before its SETs."""
    real = tier._settle

    def settle(client, update, **kw):
        if kw.get("victims") is False:  # (the put's, after its index add)
            tier._settle = real
            then()
        return real(client, update, **kw)

    tier._settle = settle


def test_a_snapshot_restored_between_a_puts_count_and_its_set_is_counted_as_stored_by_check(tmp_path):
    # The soak's failure (used_bytes one 49 KB frame over what Redis held, after
    # check(fix=True)): a put counts its frame at its own size one round trip before its SET
    # replaces the value of another size stored under the hash. A snapshot taken between the
    # two, restored, holds the old value counted at the new size; the check saw the block
    # counted and stored, "ok", and left the total over by the difference.
    srv = RedisServer(tmp_path / "r").start()
    tier = RedisTier(srv.url, 64 << 20)
    (key, small), (_, wide) = _sized(60, 0), _sized(60, 1)
    try:
        tier.put(key, small)
        _between_count_and_set(tier, lambda: srv.cli("SAVE"))
        assert tier.put(key, wide).stored is not None
        tier.close()
        srv.kill()
        srv.start()  # (loads the snapshot: ``small`` stored, counted at ``wide``'s size)
        tier = RedisTier(srv.url, 64 << 20)
        assert tier.stats().used_bytes == wide.nbytes and _stored_bytes(tier) == small.nbytes
        report = tier.check(fix=True, ghost_grace_seconds=0)
        assert tier.stats().used_bytes == _stored_bytes(tier) == small.nbytes
        assert report == {"ok": 0, "ghosts": 0, "orphans": 0, "wrong_size": 1, "stale_owner_tags": 0}
        assert tier.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert bytes(tier.get(key).host) == small.to_bytes()
    finally:
        tier.close()
        srv.stop()


def test_writers_of_frames_of_different_sizes_whose_sets_cross_are_counted_as_stored_by_check(redis_url):
    # No fault: A counts its frame, B counts another of another size under the same hash and
    # writes it, then A's SET lands. A's value is stored, counted at B's size (under, here;
    # over, the other way round), and each put's own checks find its block counted and there.
    a, b = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    (key, small), (_, wide) = _sized(61, 0), _sized(61, 1)
    try:
        _between_count_and_set(a, lambda: b.put(key, small))
        assert a.put(key, wide).stored is not None
        assert bytes(b.get(key).host) == wide.to_bytes()
        assert a.stats().used_bytes == small.nbytes and _stored_bytes(a) == wide.nbytes
        # Used within the grace: it may be a put in flight (counted, its SET not landed), left.
        assert a.check(fix=True) == {"ok": 0, "ghosts": 0, "orphans": 0, "wrong_size": 1, "stale_owner_tags": 0}
        assert a.check()["wrong_size"] == 1
        a._connection().zadd(a.keys_of.lru, {RedisKeys.member(key): 1}, xx=True)  # idle past the grace
        a.check(fix=True)
        assert a.stats().used_bytes == b.stats().used_bytes == _stored_bytes(a) == wide.nbytes
        assert a.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        a.close()
        b.close()


def test_check_leaves_a_pinned_wrong_size_until_unpinned_and_one_a_put_counted_again(redis_url):
    tier, other = RedisTier(redis_url, 64 << 20), RedisTier(redis_url, 64 << 20)
    c = tier._connection()
    (held, held_wide), (_, held_small) = _sized(62, 1), _sized(62, 0)
    (key, wide), (_, small), (_, widest) = _sized(63, 1), _sized(63, 0), _sized(63, 2)
    try:
        tier.put_many([(held, held_wide), (key, wide)])
        tier.pin([held])
        for k, f in ((held, held_small), (key, small)):  # values counted at another size
            c.set(tier.keys_of.frame(k), f.to_bytes())
        c.zadd(tier.keys_of.lru, {RedisKeys.member(key): 1}, xx=True)  # idle past the grace
        # Between the check's scan and its repair, another process puts ``key`` at a third size.
        real = tier.info

        def info(k):
            found = real(k)
            if k == key:
                other.put(key, widest)
            return found

        tier.info = info
        assert tier.check(fix=True, ghost_grace_seconds=0) == {"ok": 0, "ghosts": 0, "orphans": 0, "wrong_size": 2, "stale_owner_tags": 0}
        del tier.info
        st = tier.stats()
        # ``key`` is left as that put counted it, not counted at the size the scan read; the
        # pinned ``held`` as it was: with no LRU entry to age, a put of it in flight (counted,
        # its SET not landed) looks the same, and counted at once, the fix would make the
        # wrong size it meant to mend.
        assert st.used_bytes == held_wide.nbytes + widest.nbytes and st.pinned_bytes == held_wide.nbytes
        assert tier.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 1, "stale_owner_tags": 0}
        # Unpinned, and idle past the grace: counted at its value's size.
        tier.unpin([held])
        c.zadd(tier.keys_of.lru, {RedisKeys.member(held): 1}, xx=True)
        assert tier.check(fix=True) == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 1, "stale_owner_tags": 0}
        st = tier.stats()
        assert st.pinned_bytes == 0 and st.used_bytes == held_small.nbytes + widest.nbytes == _stored_bytes(tier)
        assert tier.check() == {"ok": 2, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()
        other.close()


def test_pins_redis_lost_to_a_restore_within_the_lease_are_made_again(tmp_path):
    # Redis restarted from a snapshot taken within this process's lease: the lease is there,
    # the pins made after the snapshot are not. Each renewal found its lease held, so the
    # process went on believing it pinned blocks that nothing kept from eviction.
    srv = RedisServer(tmp_path / "r").start()
    tier = RedisTier(srv.url, 64 << 20, pin_lease_seconds=60)
    frames = [_frame(i) for i in range(54, 58)]
    keys = [k for k, _ in frames]
    try:
        tier.put_many(frames)
        tier.pin(keys[:1])
        srv.cli("SAVE")  # the snapshot: one pin, and the lease
        tier.pin(keys[1:])
        srv.kill()
        srv.start()  # (loads the snapshot)
        tier._renew_lease()  # what the lease keeper runs
        st = tier.stats()
        assert st.pinned_blocks == 4 and st.pinned_bytes == sum(f.nbytes for _, f in frames)
        assert sorted(tier.keys()[:4]) == sorted(keys)  # (pinned first)
        tier.unpin(keys)
        assert tier.stats().pinned_blocks == 0  # and a count check does not pin again what is unpinned
        tier._renew_lease()
        assert tier.stats().pinned_blocks == 0
    finally:
        tier.close()
        srv.stop()


_SOAK_WORKER = textwrap.dedent("""
    import json, random, sys, time
    sys.path.insert(0, {here!r})
    import cacheseek as cs
    from cacheseek.store.frame import build_frame, plan_frame
    from cacheseek.store.redis_tier import RedisTier
    from cacheseek.store.tier import BlockFrame
    from store_helpers import BLOCK, LAYOUT

    def frame(i, variant):  # two frames per hash, of different bytes and sizes
        key, dim = (i + 200).to_bytes(16, "big"), 64 * (1 + variant)
        meta = plan_frame(block_hash=key, parent_hash=bytes(16), position=0, layout=LAYOUT, block_tokens=BLOCK,
                          codec=cs.Raw().spec(), buffers=[("k", "float16", (3, 2, BLOCK, dim)), ("v", "float16", (3, 2, BLOCK, dim))])
        return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([i + variant]) * meta.tensors[0].nbytes] * 2)))

    url, budget, seed, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    tier, rnd = RedisTier(url, budget, pin_lease_seconds=2), random.Random(seed)
    valid = {{frame(i, v)[1].to_bytes() for i in range(64) for v in range(2)}}
    bad = hits = 0
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i, op = rnd.randrange(64), rnd.random()
        key = (i + 200).to_bytes(16, "big")
        if op < 0.4:
            tier.put_many([frame(i, rnd.randrange(2))])
        elif op < 0.85:
            got = tier.get(key)
            if got is not None:
                hits += 1
                bad += bytes(got.host) not in valid or got.meta.block_hash != key
        elif op < 0.95:
            try:
                tier.pin([key])
                if rnd.random() < 0.8:
                    tier.unpin([key])
            except Exception:
                pass  # (Redis restarting: a pin that cannot reach it raises)
        else:
            tier.delete(key)
    tier.close()
    print(json.dumps({{"bad": bad, "hits": hits}}))
""")


@pytest.mark.slow
def test_soak_processes_sharing_a_namespace_through_redis_restarts_serve_no_wrong_frame(tmp_path):
    # Three processes put, read, pin, unpin and delete 64 hashes, each stored as one of two
    # frames, over a budget of 30 small frames, while Redis is killed and restarted empty, then
    # restored from a snapshot. No read serves bytes no writer stored under its hash, and
    # afterwards the index counts what is stored, within the budget.
    srv = RedisServer(tmp_path / "r").start()
    script = tmp_path / "worker.py"
    script.write_text(_SOAK_WORKER.format(here=str(HERE)))
    budget = 30 * _frame(0)[1].nbytes
    procs = [subprocess.Popen([sys.executable, str(script), srv.url, str(budget), str(seed), "8"],
                              stdout=subprocess.PIPE, text=True) for seed in range(3)]
    try:
        for p in procs:  # (imports take seconds on a busy machine: the faults wait for the work)
            assert p.stdout.readline().strip() == "ready"
        time.sleep(2)  # (the workers run on a clock of their own: this only spaces the faults)
        srv.kill()
        srv.start()
        time.sleep(2)
        srv.cli("SAVE")
        time.sleep(1)
        srv.kill()
        srv.start()
        outs = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
        assert all(o["bad"] == 0 for o in outs) and sum(o["hits"] for o in outs) > 0, outs
        tier = RedisTier(srv.url, budget, pin_lease_seconds=2)
        try:
            # The workers' pins go with their leases (2 s): until then they may hold more than
            # the budget (pins are never evicted, and a restore brings back older ones).
            deadline = time.monotonic() + 20
            while tier.stats().pinned_blocks and time.monotonic() < deadline:
                time.sleep(0.1)
            tier.check(fix=True, ghost_grace_seconds=0)  # (a kill between a put's steps: ghosts, orphans)
            assert tier.check() == {"ok": tier.stats().blocks, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
            c = tier._connection()
            stored = sum(int(c.strlen(n)) for n in c.scan_iter(match=tier.keys_of.frame_pattern))
            assert tier.stats().used_bytes == stored <= budget
        finally:
            tier.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        srv.stop()


# -- faults --------------------------------------------------------------------------------


def _fault_tier(url: str, **kw) -> RedisTier:
    return RedisTier(url, 64 << 20, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3),
                     breaker=CircuitBreaker(failure_threshold=2, backoff=ConstantBackoff(kw.pop("backoff", 0.3))), **kw)


def _emptied_url(where: str, request) -> str:
    """The URL of the module's one Redis (``standalone``) or its cluster, flushed."""
    if where == "standalone":
        return request.getfixturevalue("redis_url")
    cluster = request.getfixturevalue("cluster")
    cluster.flush()
    return cluster.url


def _frame(i: int) -> tuple[bytes, BlockFrame]:
    key = i.to_bytes(16, "big")
    meta = plan_frame(block_hash=key, parent_hash=bytes(16), position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(), buffers=[("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))])
    half = meta.tensors[0].nbytes
    return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([i % 256]) * half] * 2)))


def test_redis_down_from_the_start_costs_nothing_and_service_resumes(tmp_path):
    srv = RedisServer(tmp_path / "r")  # not started yet
    tier = _fault_tier(srv.url)
    key, frame = _frame(1)
    try:
        with pytest.raises(StorageError):
            tier.put(key, frame)
        assert tier.get(key) is None and tier.contains_many([key]) == [False] and tier.info(key) is None
        start = time.perf_counter()
        for _ in range(200):  # the breaker is open: no connection attempts
            assert tier.get(key) is None
        assert time.perf_counter() - start < 0.2
        s = tier.stats()
        assert s.extra["breaker"]["state"] == "open" and s.extra["refused_by_breaker"] >= 200
        assert s.extra["dropped_writes"] == 1 and s.write_errors == 1 and s.extra["index_stale"]
        srv.start()
        time.sleep(0.35)
        assert tier.put(key, frame).stored is not None  # the probe succeeds: closed again
        assert tier.get(key).to_bytes() == frame.to_bytes()
        assert tier.stats().extra["breaker"]["state"] == "closed"
    finally:
        tier.close()
        srv.stop()


def test_a_hung_redis_times_out_then_the_breaker_answers_at_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "cacheseek.store.redis")
    srv = RedisServer(tmp_path / "r").start()
    tier = _fault_tier(srv.url, backoff=0.5)
    key, frame = _frame(2)
    try:
        tier.put(key, frame)
        srv.pause()
        for _ in range(2):  # each pays the 0.3 s socket timeout; the second opens the breaker
            start = time.perf_counter()
            assert tier.get(key) is None
            assert 0.25 < time.perf_counter() - start < 2.0
        start = time.perf_counter()
        for _ in range(100):  # refused at once, without I/O
            assert tier.get(key) is None and tier.contains_many([key]) == [False]
        assert time.perf_counter() - start < 0.25
        s = tier.stats()
        assert s.extra["timeouts"] == 2 and s.extra["breaker"]["state"] == "open"
        # Said once as it began (not per call), and once as it ended.
        began = [r.getMessage() for r in caplog.records if "cannot be reached" in r.getMessage()]
        assert len(began) == 1 and f"Redis at {srv.url}" in began[0] and "circuit breaker is open" in began[0]
        srv.resume()
        time.sleep(0.55)
        assert tier.get(key) is not None
        ended = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
        assert len(ended) == 1 and re.search(r"answers again, after \d+\.\d s", ended[0])
    finally:
        tier.close()
        srv.stop()


@pytest.mark.slow
def test_redis_killed_during_ingest_no_error_escapes_and_new_ingests_land_after_restart(tmp_path):
    srv = RedisServer(tmp_path / "r").start()
    cache = rcache(srv.url, cpu="64MiB", redis_connect_timeout_seconds=0.3, redis_socket_timeout_seconds=0.5)
    try:
        results, errors = [], []
        stop = threading.Event()

        def ingest_loop() -> None:
            seed = 1000
            try:
                # Bounded, so that every block fits the CPU tier (64 MiB holds ~650 calls'
                # worth): with Redis down, a block evicted from it would be gone.
                while not stop.is_set() and seed < 1400:
                    toks, kv = tokens_for(seed, 2 * BLOCK), make_kv(2 * BLOCK, seed)
                    results.append((seed, cache.ingest(toks, kv)))
                    seed += 1
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=ingest_loop)
        worker.start()
        while len(results) < 5:
            time.sleep(0.01)
        srv.kill()  # SIGKILL mid-stream
        killed_at = len(results)  # the ingest in flight now may have been written before the kill
        time.sleep(0.5)
        stop.set()
        worker.join(timeout=30)
        assert not errors, errors[0]
        after = [r for _, r in results[killed_at + 1 :]]
        # Redis is the only persistent tier: with it down nothing is durable, so nothing is
        # acknowledged (no 5xx, no exception: each block reported failed, with why); the cpu
        # tier took every block all the same, and serves it (below).
        assert after and all(r.failed == 2 and r.stored == 0 for r in after)
        assert any("redis" in r.errors for r in after)
        redis = redis_stats(cache)
        assert redis["dropped_writes"] >= 2 and redis["breaker"]["state"] in ("open", "half_open")
        for seed, _ in results:  # every block is still served, from the cpu tier
            toks, kv = tokens_for(seed, 2 * BLOCK), make_kv(2 * BLOCK, seed)
            assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)

        srv.start()  # the same port, empty (no persistence)
        time.sleep(0.45)  # past the breaker's capped backoff
        toks, kv = tokens_for(5000, 2 * BLOCK), make_kv(2 * BLOCK, 5000)
        res = cache.ingest(toks, kv)
        assert res.stored == 2 and res.errors == {}, res
        assert redis_stats(cache)["breaker"]["state"] == "closed"
        only_redis = rcache(srv.url)
        assert_prefix_equal(only_redis.materialize(toks), kv, 2 * BLOCK)
    finally:
        stop.set()
        cache.close()
        srv.stop()


# -- Redis Cluster -------------------------------------------------------------------------


@pytest.mark.slow
def test_cluster_chains_span_masters_and_round_trip_exactly(cluster):
    cluster.flush()
    cache = rcache(cluster.url)
    toks, kv = tokens_for(20, 8 * BLOCK), make_kv(8 * BLOCK, 20)
    res = cache.ingest(toks, kv)
    assert (res.stored, res.errors) == (8, {})
    tier = cache.store.tier("redis")
    client = tier._connection()
    hashes = cache.block_hashes(toks)
    masters = {client.get_node_from_key(RedisKeys().frame(h)).name for h in hashes}
    slots = {client.keyslot(RedisKeys().frame(h)) for h in hashes}
    assert len(masters) >= 2 and len(slots) == 8
    assert cache.lookup(toks) == 8 * BLOCK
    assert_prefix_equal(rcache(cluster.url).materialize(toks), kv, 8 * BLOCK)
    assert cache.store.chain(hashes[-1]) == hashes
    # A lookup is still one pipelined round trip (grouped per master by redis-py).
    counter = count_round_trips(cache)
    assert cache.lookup(toks) == 8 * BLOCK and counter.round_trips == 1
    # The shared index lives in one slot and keeps the budget across slots.
    small = rcache(cluster.url, redis_namespace="small", redis_bytes=3 * FRAME)
    small.ingest(toks, kv)
    assert small.lookup(toks) == 3 * BLOCK
    assert small.store.tier("redis").check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    # Corruption on one master is found and dropped there.
    client.set(RedisKeys().frame(hashes[4]), b"garbage")
    assert cache.materialize(toks).num_tokens == 4 * BLOCK
    assert redis_stats(cache)["corrupt"] == 1 and client.exists(RedisKeys().frame(hashes[4])) == 0


def test_in_a_cluster_a_touch_leaves_a_block_pinned_by_another_process_without_expiry(cluster):
    cluster.flush()
    mine, other = RedisTier(cluster.url, 64 << 20, ttl_seconds=60), RedisTier(cluster.url, 64 << 20, ttl_seconds=60)
    keys = [_frame(i) for i in range(60, 64)]  # frames on several masters; the pins' set on one
    try:
        mine.put_many(keys)
        other.pin([keys[1][0], keys[3][0]])
        mine.touch([k for k, _ in keys])
        c = mine._connection()
        ttls = [int(c.pttl(mine.keys_of.frame(k))) for k, _ in keys]
        assert ttls[1] == ttls[3] == -1 and ttls[0] > 50_000 and ttls[2] > 50_000
    finally:
        mine.close()
        other.close()


def test_in_a_cluster_a_block_stays_pinned_while_any_process_pins_it(cluster):
    """Pins are counted per owner in the index's slot (the owners' sets share its hash tag),
    so the script reaches every owner's set on the one master: a block two processes pin
    stays pinned until both let go, and the pins of one that is gone lapse with its lease."""
    cluster.flush()
    mine = RedisTier(cluster.url, 64 << 20, ttl_seconds=60, pin_lease_seconds=0.5)
    other = RedisTier(cluster.url, 64 << 20, ttl_seconds=60, pin_lease_seconds=0.5)
    frames = [_frame(i) for i in range(64, 68)]  # frames on several masters
    keys = [k for k, _ in frames]
    try:
        mine.put_many(frames)
        mine.pin(keys)
        other.pin(keys[:2])
        mine.unpin(keys)
        c = mine._connection()
        assert other.stats().pinned_blocks == 2
        ttls = [int(c.pttl(mine.keys_of.frame(k))) for k in keys]
        assert ttls[0] == ttls[1] == -1 and ttls[2] > 50_000 and ttls[3] > 50_000
        other.close()  # gone without unpinning
        time.sleep(0.8)
        assert mine.stats().pinned_blocks == 0
        assert all(int(c.pttl(mine.keys_of.frame(k))) > 50_000 for k in keys[:2])
    finally:
        mine.close()
        other.close()


# -- configuration -------------------------------------------------------------------------


def test_urls_select_standalone_or_cluster():
    t = parse_redis_url("redis://:secret@127.0.0.1:7000/0")
    assert not t.cluster and t.redacted() == "redis://:***@127.0.0.1:7000/0"
    t = parse_redis_url("redis+cluster://user:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert t.cluster and t.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (t.username, t.password, t.tls) == ("user", "pw", False)
    assert t.redacted() == "redis+cluster://user:***@10.0.0.1:7000,10.0.0.2,[::1]:7002"
    assert parse_redis_url("rediss+cluster://h:1").tls
    for bad, match in [("http://x", "scheme"), ("localhost:6379", "expected"), ("redis://a:1,b:2", "cluster"),
                       ("redis+cluster://h:99999", "range"), ("redis+cluster://h:x", "port"),
                       ("redis+cluster://:1", "empty host")]:
        with pytest.raises(cs.ConfigError, match=match):
            parse_redis_url(bad)


def test_a_standalone_url_without_a_host_port_or_database_number_is_refused():
    """redis-py fills an empty host with localhost and skips a database that is not a number:
    a URL templated from an unset variable (redis://${REDIS_HOST}:6379) reached this host's
    Redis, or none, and a cluster URL of the same shape was refused."""
    for bad, match in [("redis://", "empty host"), ("redis://:6379", "empty host"),
                       ("rediss://:pw@:6380/0", "empty host"), ("redis://h:0", "port 0 out of range"),
                       ("redis://h:6379/cache", "database 'cache' is not a number")]:
        with pytest.raises(cs.ConfigError, match=match):
            parse_redis_url(bad)
    for good in ("redis://h", "redis://h:6379/", "redis://h:6379/3", "redis://[::1]:6379", "unix:///tmp/r.sock",
                 "unix:///tmp/r.sock?db=2"):
        assert not parse_redis_url(good).cluster


def test_a_standalone_url_redis_py_cannot_read_is_refused_up_front():
    """A port that is not one, or an option redis-py cannot read or does not take, was taken,
    and then every call raised ValueError or TypeError (a 500 from the server, and its stats
    failed): refused when parsed, as a cluster URL's port is."""
    key, frame = _frame(4)
    for bad, match in [("redis://127.0.0.1:notaport", "notaport"), ("redis://127.0.0.1:99999", "range"),
                       ("rediss://h:6380/0?socket_timeout=soon", "socket_timeout"), ("redis://h/0?db=zz", "db"),
                       ("redis://h:1?timeout=5", "timeout"), ("redis://h:1/0?protocol=7", "protocol")]:
        with pytest.raises(cs.ConfigError, match=match):
            parse_redis_url(bad)
    tier = _fault_tier("redis://127.0.0.1:1/0?socket_timeout=0.5")  # options it can read: fine
    try:
        assert tier.get(key) is None and tier.put_many([(key, frame)])[0].error is not None
    finally:
        tier.close()


@pytest.mark.parametrize("option", ["decode_responses=True", "decode_responses=false"])  # (redis-py: a str, truthy)
def test_a_url_option_that_makes_replies_str_is_refused_up_front(redis_url, option):
    """redis-py lets a URL's options win over the client's own: with ?decode_responses=True
    (common in other apps' Redis URLs) the tier was built, and every read of a frame raised
    UnicodeDecodeError out of it (a server's 500). Such an option is refused, named."""
    with pytest.raises(cs.ConfigError, match="option 'decode_responses' is not taken"):
        RedisTier(f"{redis_url}/0?{option}", 64 << 20)
    with pytest.raises(cs.ConfigError, match="option 'decode_responses' is not taken"):
        rcache(f"{redis_url}/0?socket_timeout=1&{option}")


@pytest.mark.parametrize("option", ["protocol=3", "encoding=utf-8&encoding_errors=replace", "encoding=latin-1"])
def test_url_options_that_keep_replies_bytes_are_taken(redis_url, option):
    tier = RedisTier(f"{redis_url}/0?{option}", 64 << 20)
    try:
        key, frame = _frame(150)
        assert tier.put(key, frame).error is None
        got = tier.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
    finally:
        tier.close()


def test_a_redis_tier_without_redis_py_is_refused_up_front(monkeypatch):
    """Without the redis extra, the tier was built, and every call (stats() too) raised
    ImportError: a server answered 500s."""
    monkeypatch.setitem(sys.modules, "redis", None)  # (not installed)
    with pytest.raises(cs.ConfigError, match=r"pip install -e '\.\[redis\]' in the checkout"):
        RedisTier("redis://127.0.0.1:1", 1 << 20)
    with pytest.raises(cs.ConfigError, match=r"pip install -e '\.\[redis\]' in the checkout"):
        rcache("redis://127.0.0.1:1")


def test_redis_settings_are_checked(redis_url):
    for kw, match in [(dict(redis_prefix="a:b"), "redis_prefix"), (dict(redis_namespace="{x}"), "redis_namespace"),
                      (dict(redis_ttl_seconds=0), "redis_ttl_seconds"), (dict(redis_bytes="lots"), "redis_bytes"),
                      # inf raised OverflowError; 1e16 s, taken, had Redis refuse every write's expiry
                      (dict(redis_ttl_seconds=float("inf")), "redis_ttl_seconds"),
                      (dict(redis_ttl_seconds=1e16), "redis_ttl_seconds"),
                      # inf crashed a server's start (a socket timeout cannot be inf) or its /v1/stats (JSON)
                      (dict(redis_connect_timeout_seconds=float("inf")), "connect_seconds"),
                      (dict(redis_socket_timeout_seconds=1e300), "socket_seconds"),
                      (dict(redis_breaker_base_seconds=float("inf"), redis_breaker_cap_seconds=float("inf")),
                       "cap_seconds"),
                      (dict(redis_socket_timeout_seconds=0), "socket_seconds"),
                      (dict(redis_breaker_failures=0), "failure_threshold"), (dict(redis_url="nope"), "redis_url")]:
        with pytest.raises(cs.ConfigError, match=match):
            rcache(kw.pop("redis_url", redis_url), **kw)
    store = make_cache(cpu="1MiB", disk=None, redis_url=redis_url).store
    assert store.tier_names == ["cpu", "redis"] and store.write_through == {"redis"}
    assert make_cache(cpu="1MiB", redis_url=redis_url, redis_bytes=0).store.tier_names == ["cpu"]


class _FailingClient:
    """Stands in for a redis-py client whose every command raises ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    def pipeline(self, *args, **kwargs):
        return self

    def __len__(self):
        return 1

    def execute(self, *args, **kwargs):
        raise self.exc

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            if name in ("exists", "get", "set", "strlen", "getrange", "delete", "pexpire"):
                return None  # queued on the "pipeline"
            raise self.exc

        return fail

    def close(self):
        pass


@pytest.mark.parametrize("error, kind", [
    ("ConnectionError", "unavailable"), ("BusyLoadingError", "unavailable"), ("ClusterDownError", "unavailable"),
    ("TryAgainError", "unavailable"), ("ReadOnlyError", "unavailable"), ("TimeoutError", "timeout"),
    ("OutOfMemoryError", "rejected"), ("ResponseError", "rejected"),
])
def test_every_redis_error_is_a_miss_or_a_counted_dropped_write(error, kind):
    import redis.exceptions

    tier = _fault_tier("redis://127.0.0.1:1")
    tier._client = _FailingClient(getattr(redis.exceptions, error)("injected"))
    key, frame = _frame(3)
    for _ in range(2):
        with pytest.raises(StorageError):
            tier.put(key, frame)
        assert tier.get(key) is None and tier.get_many([key]) == [None]
        assert tier.contains_many([key, key]) == [False, False] and tier.info(key) is None
        assert tier.keys() == [] and tier.delete(key) is None  # (not known: not "not held")
        tier.touch([key])
    s = tier.stats()
    assert s.extra["dropped_writes"] == 2 and s.write_errors == 2
    counter = {"unavailable": "unavailable_errors", "timeout": "timeouts", "rejected": "rejected_errors"}[kind]
    assert s.extra[counter] >= 1
    assert s.extra["breaker"]["state"] == ("closed" if kind == "rejected" else "open")


# -- values and index entries this tier did not write, and another process's late DELs ------


def _raw_frame_of(key: bytes, fill: int, layers: int, tokens: int) -> tuple[bytes, BlockFrame]:
    """A Raw frame of ``layers`` x 8 heads x ``tokens`` x 64 fp16, every payload byte ``fill``."""
    lay = cs.KVLayout(num_layers=layers, num_kv_heads=8, head_dim=64, dtype="float16")
    shape = (layers, 8, tokens, 64)
    meta = plan_frame(block_hash=key, parent_hash=bytes(16), position=0, layout=lay, block_tokens=tokens,
                      codec=cs.Raw().spec(), buffers=[("k", "float16", shape), ("v", "float16", shape)])
    half = meta.tensors[0].nbytes
    return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([fill % 256]) * half] * 2)))


def _big_frame(i: int) -> tuple[bytes, BlockFrame]:
    """~16 MB: a batch holding it takes a while to send, so its round trip 2 is slow."""
    return _raw_frame_of(i.to_bytes(16, "big"), i, 32, 256)


def test_a_block_another_process_evicts_while_this_one_puts_it_stays_stored(redis_url, server):
    """Process B's put evicts X in its index script; process A puts X before B's DEL of X
    lands. A's acknowledgement must mean X is stored: B deletes first (right after its
    script), A writes a block it counts anew even when a value is there, and checks after
    its SETs that what it wrote is still there."""
    import redis

    r = redis.Redis.from_url(server.url)
    x, w, y = _frame(61), _frame(62), _big_frame(63)
    budget = y[1].nbytes + x[1].nbytes + w[1].nbytes // 2  # Y evicts X, the oldest
    sizes = RedisKeys("cacheseek", "default").sizes
    for _ in range(5):
        r.flushall()
        a, b, c = (RedisTier(redis_url, budget) for _ in range(3))
        try:
            c.put(*x)
            c.put(*w)
            a.contains(x[0])  # (connected)
            putting = threading.Thread(target=b.put, args=y)
            putting.start()
            while r.hexists(sizes, RedisKeys.member(x[0])):  # until B's script has evicted X
                pass
            result = a.put(*x)
            putting.join(30)
            assert result.error is None
            got = a.get(x[0])
            assert got is not None and bytes(got.host) == bytes(x[1].host)
        finally:
            for t in (a, b, c):
                t.close()


def test_victims_whose_deletes_a_fault_kept_from_redis_are_deleted_by_the_next_call(redis_url, server):
    """A put's script evicts, then Redis stops answering (paused) before the victims' deletes
    land. Their frames stayed stored and uncounted (orphans outside the budget) for good,
    without a TTL. The deletes are owed now, and sent by the next call that reaches Redis."""
    import redis

    r = redis.Redis.from_url(server.url)
    frames = [_frame(i) for i in range(100, 104)]
    tier = RedisTier(redis_url, 3 * frames[0][1].nbytes, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3))
    try:
        tier.put_many(frames[:3])
        tier._client = _HookedClient(tier._connection(),
                                     lambda n: n == 1 and r.execute_command("CLIENT", "PAUSE", 800, "ALL"))
        with pytest.raises(StorageError):
            tier.put(*frames[3])  # its script evicted the oldest; its deletes time out
        tier._client = tier._client.inner
        time.sleep(0.9)
        stats = tier.stats()
        assert stats.extra["owed_drops"] == 0  # the stats' own call sent them
        assert stats.evictions == 1  # (counted, though the write that evicted failed)
        assert not r.exists(tier.keys_of.frame(frames[0][0]))
        assert tier.check() == {"ok": 2, "ghosts": 1, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}  # (the failed write's own entry: a ghost)
    finally:
        tier.close()


def test_a_refused_ingest_of_several_batches_evicts_nothing(redis_url):
    """A full Redis tier (the put path: it lends no slots to write in place), and an ingest
    whose head block holds Inf, in batches of 2 blocks tail first: the tail batches' puts
    evicted stored blocks before the head's encode refused the call, which then undid only
    its own blocks. (KIVI: the encode checks each batch's blocks alone, as on a GPU; Raw
    on the host checks whole layers at its first batch.)"""
    raw, codec = LAYOUT.raw_nbytes(BLOCK), cs.KIVI(bits=4)
    frame = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="1MiB")).block_format.planned_payload().nbytes
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK, max_batch_bytes=2 * raw,
                           tiers=cs.TierConfig(cpu_bytes=0, redis_url=redis_url, redis_bytes=4 * frame + frame // 2))
    held = tokens_for(22, 4 * BLOCK)
    assert cache.ingest(held, make_kv(4 * BLOCK, 22)).stored == 4  # the tier is full
    toks, kv = tokens_for(23, 6 * BLOCK), make_kv(6 * BLOCK, 23)
    kv[1][1][0, 3, 5] = float("inf")  # V of block 0, which goes last
    with pytest.raises(cs.InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert cache.lookup(held) == 4 * BLOCK and cache.lookup(toks) == 0
    assert cache.store.tier("redis").stats().evictions == 0
    cache.close()


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_victims_delete_that_lands_after_another_process_acknowledged_it_takes_nothing(
        where, request, monkeypatch):
    """Process B's index script evicts X, and B stalls before its DELs; process A puts X
    (all three round trips), then B's DEL lands. That DEL is fenced: on one Redis X is
    counted again, in a cluster A wrote a newer generation beside X; its value stays."""
    from cacheseek.store import redis_tier

    url = _emptied_url(where, request)
    x, w, y = _frame(71), _frame(72), _frame(73)
    budget = x[1].nbytes + w[1].nbytes + y[1].nbytes // 2  # Y evicts X, the oldest
    a, b, c = (RedisTier(url, budget, namespace="fence") for _ in range(3))
    parse = redis_tier.SharedIndex.parse
    stalled, go = threading.Event(), threading.Event()

    def parse_then_stall(reply):
        update = parse(reply)
        if threading.current_thread().name == "evictor" and update.evicted:
            stalled.set()
            go.wait(30)
        return update

    monkeypatch.setattr(redis_tier.SharedIndex, "parse", staticmethod(parse_then_stall))
    try:
        c.put(*x)
        c.put(*w)
        evictor = threading.Thread(target=b.put, args=y, name="evictor")
        evictor.start()
        assert stalled.wait(30)  # B's script has evicted X; its DELs wait
        assert a.put(*x).error is None
        go.set()
        evictor.join(30)
        got = a.get(x[0])
        assert got is not None and bytes(got.host) == bytes(x[1].host)
        assert a.check() == {"ok": 2, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}  # X and Y (A's put evicted W)
    finally:
        go.set()
        for t in (a, b, c):
            t.close()


def test_in_a_cluster_each_frame_has_a_generation_key_that_goes_with_it(cluster):
    """The fence's generation keys: written beside each frame (its slot), newer on each
    write that counts the block anew, with an expiry of their own and none left behind by
    an eviction or a delete; ``check`` does not take them for frames."""
    from cacheseek.store.redis_index import GEN_FENCE_SECONDS

    cluster.flush()
    frames = [_frame(i) for i in range(90, 95)]
    tier = RedisTier(cluster.url, 3 * frames[0][1].nbytes, namespace="gens")
    try:
        c = tier._connection()

        def gen(key):
            value = c.get(tier.keys_of.frame_gen(key))
            return None if value is None else int(value)

        tier.put_many(frames[:3])
        first = [gen(k) for k, _ in frames[:3]]
        assert all(g is not None for g in first) and first == sorted(set(first))  # one clock
        assert all(c.keyslot(tier.keys_of.frame_gen(k)) == c.keyslot(tier.keys_of.frame(k)) for k, _ in frames)
        assert 0 < c.pttl(tier.keys_of.frame_gen(frames[0][0])) <= GEN_FENCE_SECONDS * 1000
        tier.put_many(frames[3:])  # evicts the first two, generation keys too
        assert [gen(k) for k, _ in frames[:2]] == [None, None] and gen(frames[2][0]) == first[2]
        assert tier.delete(frames[3][0]) and gen(frames[3][0]) is None
        tier.put(*frames[0])  # counted anew: a newer generation than any before
        assert gen(frames[0][0]) > max(first) and tier.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        left = [k for node in cluster.nodes for k in node.cli("--scan", "--pattern", "cacheseek:gens:gen:*").split()]
        assert len(left) == 3
        # An orphan (uncounted, as a victim whose DEL never came) adopted is marked with the
        # generation it is counted again at.
        tier._index.queue(c, forget=[RedisKeys.member(frames[2][0])])
        assert tier.check(fix=True)["orphans"] == 1 and gen(frames[2][0]) > gen(frames[0][0])
    finally:
        tier.close()


def test_in_a_cluster_scripts_in_a_pipeline_are_routed_without_asking_a_server(cluster):
    """redis-py's cluster pipeline finds an EVAL's node with a COMMAND GETKEYS round trip of
    its own per script unless told; the tier names the node from the key's slot."""
    cluster.flush()
    for node in cluster.nodes:
        node.cli("CONFIG", "RESETSTAT")
    frames = [_frame(i) for i in range(100, 112)]
    tier = RedisTier(cluster.url, 4 * frames[0][1].nbytes, namespace="routed")
    try:
        for j in range(0, len(frames), 4):  # every put after the first evicts four
            assert all(r.error is None for r in tier.put_many(frames[j:j + 4]))
        tier.touch([k for k, _ in frames[-4:]])
        assert tier.check() == {"ok": 4, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()
    stats = "".join(node.cli("INFO", "commandstats") for node in cluster.nodes)
    assert "cmdstat_eval:" in stats and "getkeys" not in stats


def test_a_cluster_master_killed_and_restarted_costs_misses_and_redis_check_repairs_the_index(tmp_path):
    """The master holding the shared index (and some frames) is SIGKILLed: every call
    answers at once (misses, a refused write), none raises. Restarted empty, it serves again
    on its own; the frames on the other masters are then orphans of the lost index, which
    ``cacheseek redis-check`` reports (exit 1) and ``--fix`` counts again (exit 0)."""
    from server_helpers import cacheseek_command

    cluster = RedisCluster3(tmp_path / "cluster").start()
    tier = _fault_tier(cluster.url)
    frames = [_frame(i) for i in range(120, 132)]
    keys = [k for k, _ in frames]
    try:
        assert all(r.error is None for r in tier.put_many(frames))
        client = tier._connection()
        port_of = {k: client.get_node_from_key(tier.keys_of.frame(k)).port for k in keys}
        index_port = client.get_node_from_key(tier.keys_of.lru).port
        survivors = [k for k in keys if port_of[k] != index_port]
        assert 0 < len(survivors) < len(keys)
        master = next(n for n in cluster.nodes if n.port == index_port)
        master.kill()
        start = time.monotonic()
        assert tier.contains_many(keys) == [False] * len(keys)
        assert tier.get_many(keys) == [None] * len(keys)
        assert tier.put_many([_frame(140)])[0].error is not None
        assert time.monotonic() - start < 3.0
        master.start()
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in cluster.nodes):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        deadline = time.monotonic() + 10  # on its own: the breaker's next call is its probe
        while tier.put_many([_frame(141)])[0].error is not None:
            assert time.monotonic() < deadline, tier.stats().extra["last_error"]
            time.sleep(0.2)
        assert tier.contains_many(keys) == [k in survivors for k in keys]  # lost with the master: the others
        command = [*cacheseek_command(), "redis-check", "--redis-url", cluster.url, "--redis-bytes", "64MiB"]
        found = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert found.returncode == 1, found.stderr
        assert json.loads(found.stdout)["found"] == {"ok": 1, "ghosts": 0, "orphans": len(survivors), "wrong_size": 0,
                                                     "stale_owner_tags": 0}
        fixed = subprocess.run([*command, "--fix"], capture_output=True, text=True, timeout=120)
        assert fixed.returncode == 0, fixed.stderr
        assert json.loads(fixed.stdout)["after_fix"] == {"ok": 1 + len(survivors), "ghosts": 0, "orphans": 0,
                                                         "wrong_size": 0, "stale_owner_tags": 0}
        assert tier.stats().blocks == 1 + len(survivors)
        assert all(tier.get(k) is not None for k in survivors)
    finally:
        tier.close()
        cluster.stop()


def test_redis_check_refuses_an_unreachable_redis_and_bad_settings():
    from server_helpers import cacheseek_command

    port = free_port()
    for args, match in [(["--redis-url", f"redis://127.0.0.1:{port}"], "redis"),
                        (["--redis-url", "http://x"], "scheme"),
                        (["--redis-url", f"redis://127.0.0.1:{port}", "--redis-bytes", "lots"], "redis-bytes")]:
        done = subprocess.run([*cacheseek_command(), "redis-check", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and match in done.stderr.lower() and not done.stdout, (args, done.stderr)


def test_an_empty_redis_namespace_setting_means_the_default(redis_url, monkeypatch):
    """CACHESEEK_REDIS_NAMESPACE= (empty, as a manifest rendering an unset variable writes it)
    selected the namespace "": that server's data and budget were shared with none of its
    peers on "default". It means the default now, as every other empty setting, for a
    server and for redis-check."""
    import os

    from cacheseek.server.config import ServerSettings
    from cacheseek.server.store import build_store
    from server_helpers import cacheseek_command

    key, frame = _frame(160)
    peer = RedisTier(redis_url, 64 << 20)  # a peer on the default namespace
    try:
        peer.put(key, frame)
    finally:
        peer.close()
    monkeypatch.setenv("CACHESEEK_REDIS_URL", redis_url)
    monkeypatch.setenv("CACHESEEK_REDIS_NAMESPACE", "")
    settings = ServerSettings(cpu_bytes=0, disk_bytes=0)
    assert settings.redis_namespace == "default"
    store = build_store(settings)
    try:
        assert store.tier("redis").contains_many([key]) == [True]
    finally:
        store.close()
    env = {**os.environ, "CACHESEEK_REDIS_URL": redis_url, "CACHESEEK_REDIS_NAMESPACE": ""}
    done = subprocess.run([*cacheseek_command(), "redis-check"], capture_output=True, text=True, timeout=60, env=env)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["namespace"] == "default" and report["found"]["ok"] == 1, done.stderr


def test_redis_check_fix_refuses_to_evict_a_namespace_down_to_a_smaller_budget(redis_url):
    """`redis-check --fix` run with a budget below what the namespace holds (its default
    16 GiB against servers at 200 GiB: CACHESEEK_REDIS_BYTES not set in the operator's
    shell) evicted the namespace down to it to adopt one orphan, and said "repaired" (exit 0)
    with no word of the evictions. It refuses now, changing nothing, unless --evict is given
    with the budget; and what a repair evicts is in its JSON."""
    import os

    from server_helpers import cacheseek_command

    frames = [_frame(i) for i in range(170, 182)]
    size = frames[0][1].nbytes
    tier = RedisTier(redis_url, 100 * size)  # the servers' budget
    try:
        tier.put_many(frames[:-1])
        tier._connection().set(tier.keys_of.frame(frames[-1][0]), bytes(frames[-1][1].host))  # an orphan
        assert tier.check() == {"ok": 11, "ghosts": 0, "orphans": 1, "wrong_size": 0, "stale_owner_tags": 0}
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHESEEK_")}

        def redis_check(*args):
            return subprocess.run([*cacheseek_command(), "redis-check", "--redis-url", redis_url, *args],
                                  capture_output=True, text=True, timeout=60, env=env)

        done = redis_check("--redis-bytes", str(4 * size), "--fix")
        assert done.returncode == 2 and not done.stdout, done.stdout
        assert "holds" in done.stderr and "--evict" in done.stderr and f"{12 * size:,} bytes" in done.stderr
        assert tier.check() == {"ok": 11, "ghosts": 0, "orphans": 1, "wrong_size": 0, "stale_owner_tags": 0}  # (nothing changed)
        done = redis_check("--fix", "--evict")  # (the default budget: never one to evict down to)
        assert done.returncode == 2 and "--redis-bytes" in done.stderr
        assert tier.check() == {"ok": 11, "ghosts": 0, "orphans": 1, "wrong_size": 0, "stale_owner_tags": 0}

        done = redis_check("--redis-bytes", str(100 * size), "--fix")  # the servers' budget: adopts
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["evicted"] == 0 and report["after_fix"]["orphans"] == 0, done.stderr
        tier._index.queue(tier._connection(), forget=[RedisKeys.member(frames[0][0])])  # an orphan again
        done = redis_check("--redis-bytes", str(4 * size), "--fix", "--evict")  # asked for: evicts, and says so
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["evicted"] == 8, done.stdout
        assert report["after_fix"] == {"ok": 4, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()


def test_a_write_whose_value_is_deleted_after_its_set_is_written_again(redis_url):
    """A DEL of another process's landing right after this process's SET (the window round
    trip 3 closes): the value is found gone while the index counts it, and written again."""
    tier = RedisTier(redis_url, 64 << 20)
    key, frame = _frame(64)
    queue_set = tier._queue_set
    late = []

    def set_then_deleted(pipe, batch, i, status):
        queue_set(pipe, batch, i, status)
        if not late:
            late.append(1)
            pipe.delete(tier.keys_of.frame(key))  # lands after our SET, as a late DEL would
    try:
        tier._queue_set = set_then_deleted
        assert tier.put(key, frame).stored is not None
        del tier._queue_set
        got = tier.get(key)
        assert late and got is not None and bytes(got.host) == bytes(frame.host)
    finally:
        tier.close()


def test_a_write_whose_value_is_deleted_and_cannot_be_written_again_is_not_acknowledged(redis_url, server):
    """Round trip 3 finds the value gone (another process's late DEL), and the SET that writes
    it again times out: the put answered "stored" for a block it had just found missing."""
    import redis

    r = redis.Redis.from_url(server.url)
    tier = RedisTier(redis_url, 64 << 20, timeouts=RedisTimeouts(connect_seconds=0.3, socket_seconds=0.3))
    key, frame = _frame(68)
    name = tier.keys_of.frame(key)

    def after(n):
        if n == 2:
            r.delete(name)  # lands after our SET, as a late DEL would
        elif n == 3:
            r.execute_command("CLIENT", "PAUSE", 800, "ALL")  # the SET again times out

    tier._client = _HookedClient(tier._connection(), after)
    try:
        with pytest.raises(StorageError):
            tier.put(key, frame)
        time.sleep(0.9)
        assert not r.exists(name) and tier.stats().extra["dropped_writes"] == 1
    finally:
        tier.close()


def test_a_value_that_is_not_the_whole_frame_is_written_over_and_never_fails_a_read(redis_url, server):
    import redis

    from cacheseek.store.tiered import TieredStore

    r = redis.Redis.from_url(server.url)
    tier = RedisTier(redis_url, 64 << 20)
    store = TieredStore([tier])
    frames = [_frame(i) for i in (65, 66, 67)]
    name = [tier.keys_of.frame(k) for k, _ in frames]
    try:
        store.put_many(frames)
        r.set(name[0], r.getrange(name[0], 0, 999))  # truncated (a bad restore, a tool)
        first = store.put(*frames[0])
        assert first.stored and r.strlen(name[0]) == frames[0][1].nbytes  # written over, not "present"
        r.delete(name[1])
        r.hset(name[1], "not", "a frame")  # a key of another type under a frame's name
        got = tier.get_many([k for k, _ in frames])
        assert [g is not None for g in got] == [True, False, True]  # that block's miss alone
        assert r.exists(name[1]) == 0 and tier.stats().corrupt == 1  # and the value is gone
        r.hset(name[1], "not", "a frame")
        assert store.put(*frames[1]).stored and tier.get(frames[1][0]) is not None  # written over
    finally:
        tier.close()


def test_index_entries_this_tier_did_not_write_neither_fail_a_call_nor_stop_writes(redis_url, server):
    import redis

    r = redis.Redis.from_url(server.url)
    tier = RedisTier(redis_url, 3 * _frame(0)[1].nbytes, ttl_seconds=60)
    keys = tier.keys_of
    try:
        for i in (70, 71):
            tier.put(*_frame(i))
        r.zadd(keys.lru, {"not-a-hash": 0})  # the oldest: the next eviction's victim
        r.hset(keys.sizes, "not-a-hash", "1 1")
        r.sadd(keys.pinned, "also-not-a-hash")
        for i in (72, 73, 74):  # each evicts
            assert tier.put(*_frame(i)).stored is not None
        tier.stats()
        assert tier.stats().extra["breaker"]["state"] == "closed"
        assert all(isinstance(k, bytes) and len(k) == 16 for k in tier.keys())
        assert tier.check()["ok"] >= 1
        r.hset(keys.totals, "used", "garbage")  # totals another tool wrote
        assert tier.put(*_frame(75)).stored is not None  # counted again from the sizes, not failing
        assert tier.stats().used_bytes == int(r.hget(keys.totals, "used"))
    finally:
        tier.close()


def test_a_password_in_the_url_query_is_masked():
    for url in ("redis://127.0.0.1:6379/0?password=s3cret&db=1", "redis://u:s3cret@127.0.0.1:6379/0"):
        assert "s3cret" not in parse_redis_url(url).redacted()
    # an "@" in the query's password read as the userinfo's end: its tail was shown
    assert parse_redis_url("redis://myhost:6379/0?password=p@ssw0rd").redacted() == \
        "redis://myhost:6379/0?password=***"
    assert parse_redis_url("redis://u:pw@h:6379/0?password=top@secret&db=1").redacted() == \
        "redis://u:***@h:6379/0?password=***&db=1"


@pytest.mark.parametrize("char", ["?", "#", "/", "@", ":", "%3F"])
def test_a_password_with_url_characters_is_never_shown(char):
    """A cluster URL takes a password with ``?`` in it, and its redaction split the query
    off first, so stats and the start banner showed it whole; a standalone URL with one
    unencoded was refused with urllib's message, which quotes the password."""
    password = f"Hunter2{char}Secret"
    cluster = parse_redis_url(f"redis+cluster://:{password}@10.0.0.1:7000,10.0.0.2:7001")
    assert cluster.password == unquote(password)
    assert cluster.redacted() == "redis+cluster://:***@10.0.0.1:7000,10.0.0.2:7001"
    assert parse_redis_url(f"redis+cluster://admin:{password}@h:1").redacted() == "redis+cluster://admin:***@h:1"
    url = f"redis://:{password}@127.0.0.1:6379/0"
    try:
        target = parse_redis_url(url)
    except cs.ConfigError as exc:
        assert char in "?#/" and "Secret" not in str(exc) and "Hunter2" not in str(exc), exc
        assert str(exc).endswith("must be percent-encoded in the URL (%2F, %3F, %23, %40)"), exc
    else:
        assert char not in "?#/" and target.redacted() == "redis://:***@127.0.0.1:6379/0"


def test_in_a_cluster_a_hung_master_is_not_retried(cluster):
    """redis-py's cluster client retried timeouts, each after reloading the slot map: a
    call to a hung master cost 3-5 socket timeouts before the breaker heard of it. Now it is
    the timeout, and the one slot-map read redis-py makes after it."""
    cluster.flush()
    tier = RedisTier(cluster.url, 64 << 20, timeouts=RedisTimeouts(connect_seconds=0.5, socket_seconds=0.5),
                     breaker=CircuitBreaker(failure_threshold=3, backoff=ConstantBackoff(30)))
    frames = [_frame(i) for i in range(80, 86)]
    try:
        tier.put_many(frames)
        client = tier._connection()
        hung = cluster.nodes[0]
        key = next(k for k, _ in frames if client.get_node_from_key(tier.keys_of.frame(k)).port == hung.port)
        hung.pause()
        try:
            for _ in range(2):
                start = time.monotonic()
                assert tier.contains(key) is False
                assert time.monotonic() - start < 1.4  # two 0.5 s timeouts at most
        finally:
            hung.resume()
    finally:
        tier.close()


def test_an_orphan_a_chain_in_use_touches_is_counted_again(redis_url):
    """A victim whose DEL never arrived (its client died) is stored, uncounted: an orphan.
    A touch of it (a hit, an ingest finding the chain stored) counts it again from its
    header; else a chain in use kept it outside the budget for good (each touch restarting
    its TTL)."""
    from cacheseek.store.redis_index import SharedIndex

    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    frames = [_frame(i) for i in range(90, 94)]
    try:
        tier.put_many(frames)
        orphan = frames[-1][0]
        # The script call an eviction makes, without its DEL.
        SharedIndex(tier.keys_of, tier.capacity_bytes, 60_000_000).queue(tier._connection(),
                                                                          forget=[RedisKeys.member(orphan)])
        assert tier.check()["orphans"] == 1 and tier.stats().blocks == 3
        tier.touch([k for k, _ in frames])
        stats = tier.stats()
        assert tier.check() == {"ok": 4, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert stats.blocks == 4 and stats.used_bytes == sum(f.nbytes for _, f in frames)
        tier.touch([_frame(95)[0]])  # a block stored nowhere: nothing to count
        assert tier.stats().blocks == 4
    finally:
        tier.close()


def test_a_read_answered_busy_keeps_the_block(redis_url, server):
    """BUSY (another client's long script) says nothing of the value: a miss, counted, and
    the block kept; only a key of another type under the frame's name is dropped."""
    import redis

    r = redis.Redis.from_url(server.url)
    r.config_set("lua-time-limit", 10)  # BUSY for other clients 10 ms into a script
    tier = RedisTier(redis_url, 64 << 20)
    key, frame = _frame(96)
    try:
        tier.put(key, frame)
        script = ("local t=redis.call('TIME'); local s=t[1]*1e6+t[2]; "
                  "while true do t=redis.call('TIME'); if t[1]*1e6+t[2]-s > 300000 then break end end return 1")
        busy = threading.Thread(target=lambda: redis.Redis.from_url(server.url).eval(script, 0))
        busy.start()
        time.sleep(0.1)
        try:
            assert tier.get(key) is None
        finally:
            busy.join(10)
        stats = tier.stats()
        assert stats.corrupt == 0 and stats.extra["read_errors"] >= 1 and "BUSY" in stats.extra["last_error"]
        got = tier.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
    finally:
        r.config_set("lua-time-limit", 5000)
        tier.close()


def test_after_a_failover_behind_one_name_the_tier_writes_to_the_new_master(tmp_path):
    """The master behind the URL's name is demoted to a replica (REPLICAOF, as a failover
    does without killing clients) and the name now leads to the new one. Redis answers
    READONLY on the pooled connections, which stayed open: every breaker probe reused one,
    and the tier never wrote again until its process restarted. Such an answer drops the
    idle connections, so the next call opens a new one, to the new master."""
    old, new = RedisServer(tmp_path / "old").start(), RedisServer(tmp_path / "new").start()
    name = ReplyLosingProxy(old.port)  # (never armed: a name whose new connections can be sent elsewhere)
    tier = RedisTier(name.url, 64 << 20,
                     breaker=CircuitBreaker(failure_threshold=3, backoff=ConstantBackoff(0.2)))
    try:
        assert tier.put(*_frame(120)).error is None
        old.cli("REPLICAOF", "127.0.0.1", str(new.port))
        name.target_port = new.port
        results = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.error is None for r in results):
            results.append(tier.put_many([_frame(121 + len(results))])[0])
            time.sleep(0.05)
        assert any(r.error is None for r in results), [str(r.error) for r in results[-3:]]
        assert "READONLY" in str(results[0].error) or "read only" in str(results[0].error)
        assert len(results) <= 2  # (the call after the first refusal reached the new master)
        assert tier.stats().extra["breaker"]["state"] == "closed"
        assert int(new.cli("DBSIZE").strip()) > 0
    finally:
        tier.close()
        name.close()
        old.stop()
        new.stop()


class _InterruptingClient(CountingClient):
    """Raises KeyboardInterrupt (Ctrl-C landing in a round trip) in the n-th pipeline
    (direct calls not counted): before it is sent (``sent=False``) or once Redis has answered it."""

    def __init__(self, inner, n, *, sent):
        super().__init__(inner)
        self.n, self.sent = n, sent
        self.pipelines = 0

    def pipeline(self, *args, **kwargs):
        return _InterruptingPipeline(self, self.inner.pipeline(*args, **kwargs))


class _InterruptingPipeline(_CountingPipeline):
    def execute(self, *args, **kwargs):
        self.owner.pipelines += 1
        hit = self.owner.pipelines == self.owner.n
        if hit and not self.owner.sent:
            raise KeyboardInterrupt
        replies = self.inner.execute(*args, **kwargs)
        if hit:
            raise KeyboardInterrupt
        return replies


def test_interrupts_during_redis_calls_are_no_failures_of_redis(redis_url):
    """A KeyboardInterrupt in a Redis round trip counted as a Redis failure: three opened
    the breaker on a healthy Redis (no fault counted, nothing logged), and the next read
    missed. An interrupt says nothing of Redis: the breaker stays closed."""
    tier = RedisTier(redis_url, 64 << 20)
    key, frame = _frame(130)
    try:
        tier.put(key, frame)
        inner = tier._connection()
        for _ in range(4):
            tier._client = _InterruptingClient(inner, 1, sent=False)
            with pytest.raises(KeyboardInterrupt):
                tier.get(key)
        tier._client = inner
        breaker = tier.breaker.stats()
        assert breaker.state == "closed" and breaker.consecutive_failures == 0
        got = tier.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
    finally:
        tier.close()


def _fill_then_interrupt_a_put(tier: RedisTier, frames, trip: int, sent: bool):
    """Fill the tier with ``frames[:4]``, then put the rest with a KeyboardInterrupt at
    round trip ``trip`` (``_InterruptingClient``): the tier's own client, to put back."""
    tier.put_many(frames[:4])
    inner = tier._connection()
    tier._client = _InterruptingClient(inner, trip, sent=sent)
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(frames[4:])
    return inner


@pytest.mark.parametrize("trip, sent", [(1, True), (2, False)], ids=["script-answered", "deletes-unsent"])
def test_a_put_interrupted_after_its_script_evicted_owes_the_victims_deletes(redis_url, trip, sent):
    """Ctrl-C in a put after the index script evicted (its reply read, or before the
    victims' deletes were sent) left the victims stored and counted nowhere (orphans,
    outside the budget, reclaimed by nothing but redis-check --fix), where a lost
    connection at the same point leaves them owed. Now an interrupt does too."""
    frames = [_frame(i) for i in range(131, 139)]
    tier = RedisTier(redis_url, 4 * frames[0][1].nbytes)
    try:
        inner = _fill_then_interrupt_a_put(tier, frames, trip, sent)
        tier._client = inner
        assert tier.breaker.stats().consecutive_failures == 0
        stats = tier.stats()  # (pays what is owed)
        assert stats.extra["owed_drops"] == 0 and stats.extra["owed_replies"] == 0
        assert tier.check(ghost_grace_seconds=0)["orphans"] == 0
    finally:
        tier.close()


def test_a_put_interrupted_as_it_reads_its_scripts_answer_owes_that_answer(redis_url):
    """An interrupt after the index script answered (it evicted) and before its victims were
    settled (as the answer was parsed, or its totals noted) left them stored and counted
    nowhere: orphans. The answer is owed now, as a lost one is, and read again by the next call."""
    tier = RedisTier(redis_url, int(_frame(1)[1].nbytes * 2.5))
    try:
        for i in (1, 2):
            assert tier.put(*_frame(i)).error is None
        noted = tier._note_totals

        def interrupted(totals):
            tier._note_totals = noted
            raise KeyboardInterrupt

        tier._note_totals = interrupted
        with pytest.raises(KeyboardInterrupt):
            tier.put(*_frame(3))  # its script evicts frame 1
        assert tier.stats().extra["owed_replies"] == 0  # (paid)
        assert tier.check(ghost_grace_seconds=0)["orphans"] == 0
    finally:
        tier.close()


@pytest.mark.parametrize("trip, sent", [(1, True), (2, False)], ids=["script-answered", "deletes-unsent"])
def test_owed_deletes_whose_sending_is_interrupted_stay_owed(redis_url, trip, sent):
    """What a put's interrupt left owed (its script's reply, or its victims' deletes) was taken
    out of what is owed as the next call sent it: a second interrupt there forgot it, and the
    victims stayed stored, counted nowhere. They stay owed until sent."""
    frames = [_frame(i) for i in range(225, 233)]
    tier = RedisTier(redis_url, 4 * frames[0][1].nbytes)
    try:
        inner = _fill_then_interrupt_a_put(tier, frames, trip, sent)
        tier._client = _InterruptingClient(inner, 1, sent=False)  # (the stats' first payment)
        with pytest.raises(KeyboardInterrupt):
            tier.stats()
        tier._client = inner
        stats = tier.stats()
        assert stats.extra["owed_drops"] == 0 and stats.extra["owed_replies"] == 0
        assert tier.check(ghost_grace_seconds=0)["orphans"] == 0
    finally:
        tier.close()


def test_an_unpin_interrupted_is_owed(redis_url, monkeypatch):
    """An unpin cut short by Ctrl-C took the block out of this process's pins, and left the
    pin in Redis under its owner, whose lease the keeper renews: the block stayed pinned in
    the shared budget for as long as the process lived. It is owed now, as after a fault."""
    from cacheseek.store.redis_index import SharedIndex

    tier = RedisTier(redis_url, 64 << 20)
    (a, fa), (b, fb) = _frame(140), _frame(141)
    try:
        tier.put(a, fa)
        tier.put(b, fb)
        tier.pin([a, b])
        real = SharedIndex.queue

        def interrupted(self, client, **kw):
            if kw.get("unpin"):
                raise KeyboardInterrupt
            return real(self, client, **kw)

        monkeypatch.setattr(SharedIndex, "queue", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tier.unpin([a])
        monkeypatch.setattr(SharedIndex, "queue", real)
        assert tier.breaker.stats().consecutive_failures == 0
        stats = tier.stats()  # (pays the owed unpin)
        assert stats.extra["owed_unpins"] == 0 and stats.pinned_blocks == 1
        assert not tier._connection().sismember(tier.keys_of.pinned, RedisKeys.member(a))
    finally:
        tier.close()


def test_a_script_whose_reply_is_lost_and_that_redis_py_sends_again_deletes_the_first_runs_victims(redis_url, server):
    """redis-py sends a pipeline again, once, after a connection error. When the reply was
    lost after Redis had run the index script, the script ran twice: the second run evicted
    nothing (the first had), so the first run's victims were never deleted (orphans, outside
    the budget) nor counted. A script called again under its call id answers the first
    run's reply."""
    from cacheseek.store.redis_index import INDEX_SCRIPT

    proxy = ReplyLosingProxy(server.port)
    frames = [_frame(i) for i in range(110, 114)]
    tier = RedisTier(proxy.url, 3 * frames[0][1].nbytes)
    try:
        tier.put_many(frames[:3])
        proxy.arm(INDEX_SCRIPT.strip().splitlines()[0].encode())
        assert tier.put(*frames[3]).error is None  # (sent again by redis-py, and answered)
        assert proxy.lost == 1
        stats = tier.stats()
        assert stats.evictions == 1 and stats.blocks == 3
        assert tier.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}  # frame 110 went, with its entry
    finally:
        tier.close()
        proxy.close()


def test_a_pin_sent_again_after_its_reply_was_lost_still_says_the_lease_was_lost(redis_url, server):
    """A process whose pin lease ran out (another process's call dropped its pins) learns so
    from its next pin, and pins again what it held. When that pin's reply was lost and
    redis-py sent it again, the second run found the lease the first had just made and
    answered that none was lost: the pins the process held before stayed out of Redis (in
    its LRU, their frames expiring) while it went on holding them."""
    proxy = ReplyLosingProxy(server.port)
    a = RedisTier(proxy.url, 64 << 20, ttl_seconds=60, pin_lease_seconds=0.3)
    b = RedisTier(server.url, 64 << 20, ttl_seconds=60)
    frames = [_frame(i) for i in range(120, 122)]
    held, later = (k for k, _ in frames)
    try:
        a.put_many(frames)
        a.pin([held])
        a._lease_stop.set()  # (its renewals held up: cut off for longer than the lease)
        a._lease_keeper.join(5)
        time.sleep(0.6)
        b.stats()  # another process's call drops the lapsed lease, and a's pin with it
        r = b._connection()
        assert not r.sismember(b.keys_of.pinned, RedisKeys.member(held))
        proxy.arm(RedisKeys.member(later).encode())
        a.pin([later])  # (its reply lost, sent again by redis-py, and answered)
        assert proxy.lost == 1
        assert {m.decode() for m in r.smembers(b.keys_of.pinned)} == {RedisKeys.member(held), RedisKeys.member(later)}
        assert r.pttl(a.keys_of.frame(held)) == -1
    finally:
        a.close()
        b.close()
        proxy.close()


def test_an_unpin_beside_many_owners_costs_redis_no_lookup_per_block_and_owner(redis_url):
    """An unpin (or a lapsed lease) released a block only if no other owner pinned it, and
    asked every owner's set about every block (and read the lease zset again for each
    block): one script call, blocking Redis, grew with blocks x owners (a 100k-block unpin
    beside 16 owners: 1.7 s). It is one SDIFF a call now; what it releases is the same, back
    in the LRU in the order unpinned."""
    from cacheseek.store.redis_index import SharedIndex

    tier = RedisTier(redis_url, 64 << 20)
    r = tier._connection()
    index = SharedIndex(RedisKeys("cacheseek", "owners"), 1 << 40, 0)
    members = [f"{i:032x}" for i in range(2000)]
    try:
        index.queue(r, add=[(m, 10, 10) for m in members])
        index.queue(r, pin=members, owner="mine")
        for o in range(16):
            index.queue(r, pin=members[o :: 100], owner=f"other{o}")  # every 100th block, each
        r.config_resetstat()
        update = SharedIndex.parse(index.queue(r, unpin=members, owner="mine"))
        held = {m for o in range(16) for m in members[o :: 100]}
        assert [m.decode() for m in r.zrange(index.keys.lru, 0, -1)] == [m for m in members if m not in held]
        assert {m.decode() for m in r.smembers(index.keys.pinned)} == held
        assert update.totals.pinned_blocks == len(held)
        calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
        assert calls.get("cmdstat_sismember", 0) + calls.get("cmdstat_zrange", 0) < len(members)
        assert r.keys("*:held") == []  # (the scratch set goes with the call)
    finally:
        tier.close()


def test_a_dead_owners_many_pins_go_a_bounded_number_a_call(redis_url):
    """The pins of an owner whose lease ran out all went in the next script call, each
    listed in its reply, kept a minute for the call sent again: a dead owner's 100k pins
    blocked Redis for 0.7 s in that one call and kept a 7 MB reply. They go RELEASE_LIMIT a
    call now, the owner lapsed in ``pinners`` until its set is empty; meanwhile the pinned
    set stays the union of the owners' sets, a block another owner pins stays pinned, and
    a call sent again answers the same."""
    from cacheseek.store.redis_index import RELEASE_LIMIT, SharedIndex

    tier = RedisTier(redis_url, 64 << 20)
    r = tier._connection()
    keys = RedisKeys("cacheseek", "lapsed")
    index = SharedIndex(keys, 1 << 40, 0, pin_lease_us=300_000)
    members = [f"{i:064x}" for i in range(2 * RELEASE_LIMIT + 500)]
    held = set(members[::7])  # also pinned by an owner that lives on
    try:
        index.queue(r, add=[(m, 10, 10) for m in members])
        index.queue(r, pin=members, owner="dead")
        SharedIndex(keys, 1 << 40, 0).queue(r, pin=sorted(held), owner="alive")
        time.sleep(0.5)
        released: list[str] = []
        for _ in range(3):
            call = SharedIndex.new_call()
            update = SharedIndex.parse(index.queue(r, call=call))
            assert 0 < len(update.released) <= RELEASE_LIMIT
            assert r.memory_usage(keys.call(call)) < 100 * RELEASE_LIMIT  # (64-hex members)
            assert SharedIndex.parse(index.queue(r, call=call)).released == update.released  # sent again
            released += update.released
            owned = {m.decode() for m in r.smembers(keys.owner_pins("dead"))}
            pinned = {m.decode() for m in r.smembers(keys.pinned)}
            assert pinned == owned | held and not pinned & set(released)
            assert update.totals.pinned_blocks == len(pinned)
            assert r.zcard(keys.lru) == len(released)
            if owned:
                assert r.zscore(keys.pinners, "dead") is not None  # lapsed, still part of the union
        assert sorted(released) == sorted(set(members) - held)
        assert r.zscore(keys.pinners, "dead") is None and not r.exists(keys.owner_pins("dead"))
        assert {m.decode() for m in r.smembers(keys.pinned)} == held
    finally:
        tier.close()


def test_an_owner_back_while_its_lapsed_pins_go_learns_its_lease_was_lost(redis_url):
    """A lapsed owner's pins go a bounded number a call (RELEASE_LIMIT), so an owner back
    from a long cut-off may find part of them gone: its renewal says the lease was lost (and
    renews nothing) until a pin takes it again, then the pins it makes again hold."""
    from cacheseek.store.redis_index import RELEASE_LIMIT, SharedIndex

    tier = RedisTier(redis_url, 64 << 20)
    r = tier._connection()
    keys = RedisKeys("cacheseek", "back")
    index = SharedIndex(keys, 1 << 40, 0, pin_lease_us=300_000)
    members = [f"{i:064x}" for i in range(3 * RELEASE_LIMIT)]
    try:
        index.queue(r, add=[(m, 10, 10) for m in members])
        index.queue(r, pin=members, owner="back")
        time.sleep(0.5)
        first = SharedIndex.parse(index.queue(r))  # another process's call: some go
        assert 0 < len(first.released) < len(members)
        renewal = SharedIndex.parse(index.queue(r, owner="back"))
        assert renewal.lease_lost and len(first.released) + len(renewal.released) < len(members)
        assert SharedIndex.parse(index.queue(r, owner="back")).lease_lost  # (still: renewed nothing)
        again = SharedIndex.parse(index.queue(r, pin=members, owner="back"))
        assert again.lease_lost
        assert r.scard(keys.pinned) == len(members) and r.zcard(keys.lru) == 0
        assert not SharedIndex.parse(index.queue(r, owner="back")).lease_lost  # held again
    finally:
        tier.close()


def test_a_hung_redis_gets_one_probe_at_a_time(tmp_path):
    """docs/redis.md: only one probe is in flight at a time. The probe was replaced once it
    had been out for the backoff, so with a backoff shorter than the socket timeout (the
    defaults: 1 s and 2 s) a hung Redis got a second probe while the first still waited,
    and the call that carried it paid the whole timeout."""
    srv = RedisServer(tmp_path / "r").start()
    tier = RedisTier(srv.url, 64 << 20, timeouts=RedisTimeouts(connect_seconds=1.0, socket_seconds=1.0),
                     breaker=CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(0.2)))
    key, frame = _frame(3)
    try:
        tier.put(key, frame)
        srv.pause()
        assert tier.get(key) is None  # times out: open
        time.sleep(0.25)
        probe = threading.Thread(target=tier.get, args=(key,))
        probe.start()  # the probe: waits for its timeout
        time.sleep(0.4)  # (twice the backoff, half the timeout)
        assert probe.is_alive()
        start = time.perf_counter()
        assert tier.get(key) is None
        assert time.perf_counter() - start < 0.3  # refused at once, not a second probe
        probe.join(5)
        s = tier.stats().extra
        assert s["timeouts"] == 2 and s["refused_by_breaker"] >= 1
    finally:
        srv.stop()
        tier.close()


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_corrupt_values_delete_spares_a_rewrite_that_landed_since_the_read(where, request, monkeypatch):
    """Process A reads a block's value and finds it corrupt (truncated); before A drops it,
    process B puts the block (written over: not the whole frame) and is acknowledged. A's
    delete was a plain DEL, with the index entry forgotten: B's value went. It is fenced now:
    A deletes only the value it found bad, and forgets the entry only if it did."""
    from cacheseek.store import redis_tier

    url = _emptied_url(where, request)
    a, b = (RedisTier(url, 64 << 20, namespace="corrupt") for _ in range(2))
    key, frame = _frame(81)
    parse = redis_tier.parse_frame
    stalled, go = threading.Event(), threading.Event()

    def parse_then_stall(data, **kw):
        try:
            return parse(data, **kw)
        except redis_tier.FrameError:
            if threading.current_thread().name == "reader":
                stalled.set()
                go.wait(30)
            raise

    monkeypatch.setattr(redis_tier, "parse_frame", parse_then_stall)
    try:
        b.put(key, frame)
        client = b._connection()
        name = b.keys_of.frame(key)
        client.set(name, client.getrange(name, 0, 999))
        reader = threading.Thread(target=a.get, args=(key,), name="reader")
        reader.start()
        assert stalled.wait(30)  # A has read the bad value; its delete waits
        assert b.put(key, frame).error is None  # written over, acknowledged
        go.set()
        reader.join(30)
        assert a.stats().corrupt == 1
        got = b.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
        assert b.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        go.set()
        a.close()
        b.close()


def test_a_puts_script_whose_reply_a_fault_kept_gets_its_victims_deleted_by_the_next_call(redis_url, server):
    """A put's script ran and evicted, and its reply was lost (a connection error redis-py
    did not retry, or a timeout): the put failed knowing nothing of its victims, which
    stayed stored and uncounted (orphans) for good, without a TTL. The reply is kept under
    the call's id; the next call that reaches Redis asks for it and deletes the victims."""
    from cacheseek.store.redis_index import INDEX_SCRIPT

    proxy = ReplyLosingProxy(server.port)
    frames = [_frame(i) for i in range(120, 124)]
    tier = RedisTier(proxy.url, 3 * frames[0][1].nbytes, client_retries=0)
    try:
        tier.put_many(frames[:3])
        proxy.arm(INDEX_SCRIPT.strip().splitlines()[0].encode())
        with pytest.raises(StorageError):
            tier.put(*frames[3])
        assert proxy.lost == 1
        stats = tier.stats()  # (reaches Redis: asks for the lost reply)
        assert tier.check() == {"ok": 2, "ghosts": 1, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}  # (the failed write's own entry: a ghost)
        assert stats.evictions == 1 and stats.extra["owed_replies"] == 0
        assert tier.put(*frames[3]).error is None
        assert tier.check() == {"ok": 3, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
    finally:
        tier.close()
        proxy.close()


# -- what every script call leaves to do ---------------------------------------------------


def _pin_as(tier: RedisTier, keys, owner: str, lease_seconds: float) -> None:
    """Pin ``keys`` as another process would (the index, then PERSIST), under a short lease."""
    from cacheseek.store.redis_index import SharedIndex

    index = SharedIndex(tier.keys_of, tier.capacity_bytes, tier._index.ttl_us, pin_lease_us=round(lease_seconds * 1e6))
    r = tier._connection()
    index.queue(r, pin=[RedisKeys.member(k) for k in keys], owner=owner)
    for k in keys:
        r.persist(tier.keys_of.frame(k))


@pytest.mark.parametrize("call", ["pin_again", "delete", "corrupt_read"])
def test_every_call_that_meets_a_lapsed_lease_gives_its_frames_their_expiry_back(redis_url, call):
    """Any script call drops the pins of owners whose lease ran out and says which blocks
    no owner pins any more. The pin that takes a lost lease again, a delete and the forget
    of a corrupt value took no notice: those frames kept no expiry (in the LRU, unpinned)
    until the TTL prune dropped their entries."""
    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60, pin_lease_seconds=0.3)
    frames = [_frame(i) for i in range(130, 141)]
    keys = [k for k, _ in frames]
    r = tier._connection()
    try:
        tier.put_many(frames)
        if call == "pin_again":
            tier.pin([keys[0]])
            tier._lease_stop.set()  # (its renewals held up: cut off for longer than the lease)
            tier._lease_keeper.join(5)
            # Eight owners whose leases end after this one's: a call drops eight lapsed owners,
            # so this process's next call drops its own and seven, and its pin again the eighth.
            for o in range(8):
                _pin_as(tier, [keys[1 + o]], f"gone{o}", 0.3 + 0.01 * o)
            released = keys[8]
        else:
            _pin_as(tier, [keys[9]], "gone", 0.3)
            released = keys[9]
        time.sleep(0.6)
        if call == "pin_again":
            tier.stats()
            assert int(r.pttl(tier.keys_of.frame(keys[0]))) == -1  # pinned again
        elif call == "delete":
            assert tier.delete(keys[10])
        else:
            name = tier.keys_of.frame(keys[10])
            r.setrange(name, r.strlen(name) - 8, b"\xff" * 4)
            assert tier.get(keys[10]) is None and tier.stats().corrupt == 1
        assert r.scard(tier.keys_of.pinned) == (1 if call == "pin_again" else 0)
        assert int(r.pttl(tier.keys_of.frame(released))) > 50_000
    finally:
        tier.close()


@contextlib.contextmanager
def _held_by_a_lapsed_pin(server, redis_url, namespace, frames):
    """A tier behind a ``ReplyLosingProxy`` (TTL 60 s, no client retry) holding ``frames``,
    the first of them pinned by another owner whose lease has just run out: the next script
    call lets go of that pin. Yields (the proxy, the tier, a direct connection). A namespace
    of its own, so that no other test's tier renewing a lease lets go of the pin first."""
    proxy = ReplyLosingProxy(server.port)
    tier = RedisTier(proxy.url, 64 << 20, ttl_seconds=60, client_retries=0, namespace=namespace)
    other = RedisTier(redis_url, 64 << 20)
    r = other._connection()
    try:
        tier.put_many(frames)
        _pin_as(tier, [frames[0][0]], "gone", 0.3)
        assert int(r.pttl(tier.keys_of.frame(frames[0][0]))) == -1
        time.sleep(0.6)
        yield proxy, tier, r
    finally:
        tier.close()
        other.close()
        proxy.close()


def test_a_put_that_fails_after_its_script_still_gives_what_a_lapsed_lease_let_go_its_expiry(redis_url, server):
    """A put's script call drops the pins of owners whose lease ran out and lists the blocks
    no owner pins any more; their frames got their expiry back only after the put's SETs.
    With those failing (the connection lost), nothing else listed them: their frames kept
    no expiry, unpinned, until the TTL prune dropped their entries. They are settled before
    the SETs now."""
    (held, fh), (new, fn) = _frame(170), _frame(171)
    with _held_by_a_lapsed_pin(server, redis_url, "settle", [(held, fh)]) as (proxy, tier, r):
        name = tier.keys_of.frame(new).encode()
        proxy.arm(b"SET\r\n$%d\r\n%s" % (len(name), name))  # (the SETs' round trip: its reply lost)
        assert tier.put_many([(new, fn)])[0].error is not None
        assert proxy.lost == 1 and not tier._owed_replies  # (the script's reply came back)
        assert not r.sismember(tier.keys_of.pinned, RedisKeys.member(held))
        assert int(r.pttl(tier.keys_of.frame(held))) > 50_000


def test_a_touch_that_loses_its_expiry_round_trip_owes_the_released_frames_their_expiry(redis_url, server):
    """A touch's script let go of a lapsed owner's pin and listed the block; the round trip
    that gives its frame its expiry back was lost on its way (the connection lost). Nothing else
    listed the block: its frame kept no expiry, unpinned, until the TTL prune. It is owed
    now, and given back by the next call that finds Redis answering."""
    (held, fh), (used, fu) = _frame(172), _frame(173)
    with _held_by_a_lapsed_pin(server, redis_url, "owed-expiry", [(held, fh), (used, fu)]) as (proxy, tier, r):
        name = tier.keys_of.frame(held).encode()
        # (the round trip giving the expiry back: lost on its way, never run)
        proxy.arm(b"PEXPIRE\r\n$%d\r\n%s" % (len(name), name), deliver=False)
        tier.touch([used])  # its script lets go of the lapsed pin
        assert proxy.lost == 1 and not r.sismember(tier.keys_of.pinned, RedisKeys.member(held))
        assert int(r.pttl(tier.keys_of.frame(held))) == -1
        tier.stats()  # Redis answers again: what was owed is given back
        assert int(r.pttl(tier.keys_of.frame(held))) > 50_000 and not tier._owed_expiries


def test_a_call_from_the_process_with_the_smaller_budget_deletes_what_it_evicts(redis_url):
    """Each call evicts down to its caller's budget, so the smallest in use wins; a touch,
    a pin, an unpin or a lease renewal that evicted dropped the victims' entries and left
    their frames stored, uncounted (orphans)."""
    big = RedisTier(redis_url, 64 << 20)
    frames = [_frame(i) for i in range(142, 146)]
    small = RedisTier(redis_url, 2 * frames[0][1].nbytes)
    try:
        big.put_many(frames)
        small.touch([frames[-1][0]])  # evicts the two least recently used
        assert small.stats().evictions == 2
        assert small.check() == {"ok": 2, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}
        assert big.contains_many([k for k, _ in frames]) == [False, False, True, True]
    finally:
        big.close()
        small.close()


def test_a_process_of_a_larger_budget_learns_the_smaller_one_in_effect_and_says_so_once(redis_url, caplog):
    """Two deployments on one namespace with different budgets: the larger one's blocks were
    evicted down to the smaller budget (by the other's calls: a metrics scrape's stats()
    is enough) while its own figures said it was a fifth full with no eviction, and nobody
    was told. The smallest budget in use is kept in Redis: each process reports it as the
    budget in effect, and the larger one logs it, once."""
    frames = [_frame(i) for i in range(190, 220)]
    size = frames[0][1].nbytes
    big, small = RedisTier(redis_url, 100 * size), RedisTier(redis_url, 10 * size)
    try:
        assert big.stats().extra["budget_in_effect_bytes"] == 100 * size
        big.put_many(frames[:20])
        small.stats()  # (evicts down to its budget)
        with caplog.at_level(logging.WARNING, logger="cacheseek.store.redis"):
            big.put_many(frames[20:25])
            stats = big.stats()
            big.put_many(frames[25:])
            big.stats()
        assert stats.extra["budget_in_effect_bytes"] == 10 * size
        assert small.stats().extra["budget_in_effect_bytes"] == 10 * size
        said = [r.getMessage() for r in caplog.records if "used a budget of" in r.getMessage()]
        assert len(said) == 1 and f"{10 * size:,}" in said[0] and f"{100 * size:,}" in said[0], said
    finally:
        big.close()
        small.close()


def test_close_during_a_lease_renewal_leaves_no_command_to_run_after_it(tmp_path):
    """``close`` stopped the lease keeper without waiting for it: a renewal in flight (here
    held up by a pause of Redis's writes) had its connection closed under it, redis-py sent
    it again on a new connection, and the renewal ran after ``close`` returned, leaving that
    connection open for good. (A server of its own: the module's counts the commands of
    tiers other tests leave to the garbage collector, their keepers still renewing.)"""
    import redis

    own = RedisServer(tmp_path).start()
    redis_url = own.url
    tier = RedisTier(redis_url, 64 << 20, pin_lease_seconds=0.5)  # renewed every 0.1 s
    key, frame = _frame(146)
    watcher = redis.Redis.from_url(redis_url)

    def evals() -> int:
        return watcher.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)

    try:
        tier.put(key, frame)
        tier.pin([key])
        watcher.execute_command("CLIENT", "PAUSE", 800, "WRITE")  # (scripts wait; reads run)
        time.sleep(0.3)  # a renewal is waiting in Redis
        tier.close()
        closed_at = evals()
        time.sleep(1.0)  # the pause is over
        assert evals() == closed_at
        assert watcher.info("clients")["connected_clients"] == 1  # this test's own
    finally:
        watcher.execute_command("CLIENT", "UNPAUSE")
        watcher.close()
        tier.close()
        own.stop()


@pytest.mark.parametrize("client_retries", [1, 0])
def test_an_unpin_keeps_no_reply_the_size_of_its_blocks_and_one_sent_again_still_restarts_their_expiry(
        redis_url, server, client_retries):
    """An unpin's reply listed every block it released, and the script kept it a minute for
    the call sent again: 7 MB for a 100k-block unpin. The unpinning process knows those
    blocks, and now restarts their expiry itself. So an unpin whose reply was lost and that
    was sent again, by redis-py or (without its retry) as an owed unpin, gives its frames
    their expiry back: sent again as an owed unpin, it released nothing and they kept none."""
    proxy = ReplyLosingProxy(server.port)
    tier = RedisTier(proxy.url, 64 << 20, ttl_seconds=60, client_retries=client_retries)
    other = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    frames = [_frame(i) for i in range(150, 153)]
    keys = [k for k, _ in frames]
    r = other._connection()
    try:
        tier.put_many(frames)
        tier.pin(keys)
        other.pin(keys[2:])  # pinned by another process too: its frame keeps no expiry
        proxy.arm(b"EVAL")
        tier.unpin(keys)
        assert proxy.lost == 1
        assert tier.stats().pinned_blocks == 1  # (an owed unpin is sent again first)
        assert [int(r.pttl(tier.keys_of.frame(k))) > 50_000 for k in keys] == [True, True, False]
        assert int(r.pttl(tier.keys_of.frame(keys[2]))) == -1
        kept = [r.get(k) for k in r.keys("*:call:*")]
        assert not any(RedisKeys.member(k).encode() in reply for k in keys for reply in kept if reply)
    finally:
        tier.close()
        other.close()
        proxy.close()


def test_a_pin_made_again_repairs_a_pinned_set_that_lost_the_block(redis_url):
    """An owner's pin set and the pinned set can disagree (a process of the older version,
    sharing the namespace, unpins for everyone in the pinned set alone). Pinning again, the
    owner found the block in its own set and did nothing: the block stayed in the LRU,
    evictable, while the process held its pin."""
    tier = RedisTier(redis_url, 64 << 20, ttl_seconds=60)
    key, frame = _frame(160)
    m = RedisKeys.member(key)
    r = tier._connection()
    try:
        tier.put(key, frame)
        tier.pin([key])
        # the older version's unpin: out of the pinned set, back in the LRU, uncounted as pinned
        r.srem(tier.keys_of.pinned, m)
        r.zadd(tier.keys_of.lru, {m: int(r.hget(tier.keys_of.totals, "clock")) + 1})
        r.hset(tier.keys_of.totals, mapping={"pinned_bytes": 0, "pinned_blocks": 0})
        r.pexpire(tier.keys_of.frame(key), 60_000)
        tier.pin([key])
        assert r.sismember(tier.keys_of.pinned, m) and r.zscore(tier.keys_of.lru, m) is None
        stats = tier.stats()
        assert (stats.pinned_blocks, stats.pinned_bytes) == (1, frame.nbytes)
        assert int(r.pttl(tier.keys_of.frame(key))) == -1
    finally:
        tier.close()


def test_stats_reads_the_whole_pinned_set_only_now_and_then(tmp_path, monkeypatch):
    """With a TTL, every ``stats()`` read the whole pinned set (``SMEMBERS``): 7 MB for 100k
    pins, at every metrics scrape. It reads it every ``PIN_REFRESH_SECONDS`` at most; a
    touch still leaves another process's pin without an expiry, checked against Redis."""
    import redis

    from cacheseek.store import redis_tier

    own = RedisServer(tmp_path).start()
    pinner = RedisTier(own.url, 64 << 20, ttl_seconds=60)
    tier = RedisTier(own.url, 64 << 20, ttl_seconds=60)
    watcher = redis.Redis.from_url(own.url)

    def smembers() -> int:
        return watcher.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0)

    try:
        frames = [_frame(i) for i in range(160, 164)]
        tier.put_many(frames)
        before = smembers()
        for _ in range(20):
            tier.stats()
        assert smembers() - before == 1
        pinner.pin([frames[0][0]])  # another process's pin, which this one has not read
        tier.touch([k for k, _ in frames])
        assert watcher.pttl(tier.keys_of.frame(frames[0][0])) == -1  # the pin keeps no expiry
        assert watcher.pttl(tier.keys_of.frame(frames[1][0])) > 0
        monkeypatch.setattr(redis_tier, "PIN_REFRESH_SECONDS", 0.0)
        tier.stats()
        assert smembers() - before == 2 and frames[0][0] in tier._pinned
    finally:
        watcher.close()
        pinner.close()
        tier.close()
        own.stop()


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_owner_tags_are_found_by_any_process_and_go_with_evictions_and_deletes(where, request):
    """The owner tag a writer gives each block is kept beside its index entry, found by
    another process (``owned``), and dropped when any process evicts or deletes the block:
    an admin flush finds a tenant's blocks there whoever wrote them, and no stale ones."""
    url = _emptied_url(where, request)
    frame_nbytes = _frame(0)[1].nbytes
    writer = RedisTier(url, 4 * frame_nbytes)
    writer.owner_tag = lambda key: "t.m1" if key[-1] % 2 else "u.m1"
    other = RedisTier(url, 4 * frame_nbytes)  # tags nothing
    try:
        assert all(r.error is None for r in writer.put_many([_frame(i) for i in range(1, 5)]))
        assert sorted(other.owned(lambda tag: tag.startswith("t."))) == [_frame(1)[0], _frame(3)[0]]
        assert sorted(other.owned(lambda tag: tag.endswith(".m1"))) == [_frame(i)[0] for i in range(1, 5)]
        assert other.delete(_frame(3)[0])
        # Another process's writes push out the two oldest (1 and 2): their tags go with them.
        assert all(r.error is None for r in other.put_many([_frame(i) for i in range(5, 8)]))
        assert other.owned(lambda tag: tag.startswith("t.")) == []
        assert writer.owned(lambda tag: True) == [_frame(4)[0]]
    finally:
        writer.close()
        other.close()


def test_index_members_and_owner_tags_that_are_not_utf8_are_skipped(redis_url):
    """The shared index is bytes any tool may write. A member of the LRU zset or the pinned
    set, or an owner tag, that is not UTF-8 names no block of this tier; it was decoded
    strictly, so the put whose eviction passed it raised UnicodeDecodeError (after its
    script had counted the block: a ghost), as did an admin flush's ``owned``, ``keys``
    and ``check``."""
    from store_helpers import raw_frame

    frames = [raw_frame(i + 1) for i in range(4)]
    n = frames[0][1].nbytes
    tier = RedisTier(redis_url, 2 * n + n // 2)
    keys = RedisKeys()
    c = tier._connection()
    c.zadd(keys.lru, {b"\xff\xfe": 0})  # the least recently used "block": the first victim
    c.sadd(keys.pinned, b"\xc3\x28")
    c.hset(keys.sizes, b"\xc3\x28", "10 10")
    c.hset(keys.owners, "ab" * 16, b"\xff")
    for key, frame in frames:
        assert tier.put(key, frame).stored is not None
    assert tier.keys() == [key for key, _ in frames[2:]]
    assert tier.owned(lambda tag: True) == []
    assert tier.check()["ghosts"] == 0
    assert [tier.get(key) is not None for key, _ in frames] == [False, False, True, True]


class _ExpiringBetween:
    """A client whose pipelines run command by command on the real Redis, the frame ``name``
    deleted right after its STRLEN: as a TTL that runs out between a pipeline's commands."""

    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def pipeline(self, *args, **kwargs):
        return _StepPipeline(self)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class _StepPipeline:
    def __init__(self, owner):
        self.owner, self.queued = owner, []

    def __getattr__(self, command):
        def queue(*args, **kwargs):
            self.queued.append((command, args, kwargs))
            return self
        return queue

    def execute(self, *args, **kwargs):
        out = []
        for command, a, kw in self.queued:
            out.append(getattr(self.owner.inner, command)(*a, **kw))
            if command == "strlen" and a[0] == self.owner.name:
                self.owner.inner.delete(self.owner.name)
        return out


def test_a_frame_that_expires_between_its_length_and_its_header_is_a_miss(redis_url):
    """``info`` asks a frame's length and its first bytes in one pipeline, and Redis may let
    the value expire between the two: a length of a whole frame came with an empty head,
    whose preamble raised struct.error out of ``info`` (a chain walk's: a 500 on the
    server). It is a miss, not damage."""
    from store_helpers import raw_frame

    tier = RedisTier(redis_url, 64 << 20)
    key, frame = raw_frame(9)
    tier.put(key, frame)
    tier._client = _ExpiringBetween(tier._connection(), RedisKeys().frame(key))
    assert tier.info(key) is None
    stats = tier.stats()
    assert stats.corrupt == 0 and stats.extra["breaker"]["consecutive_failures"] == 0


@pytest.mark.parametrize("field, written", [*(("used", w) for w in ("nan", "-inf", "inf", "1e30", "-5", "0x10")),
                                            ("clock", "nan")])
def test_totals_that_are_numbers_of_no_count_are_counted_again(redis_url, field, written):
    """The shared totals are read with Lua's tonumber, which takes "nan", "inf", "-5" and
    "0x10" as numbers: a used of NaN or -inf (another tool's, or damage) left the budget
    unenforced for good (every block kept, the used bytes reported as -2**63), and inf or
    1e30 evicted every block not pinned, each call, for as long as one was pinned; a clock
    of NaN made Redis refuse every block's ZADD (no write landed). Only
    digits are a total; anything else is counted again from the sizes, as a total that is
    no number is."""
    from store_helpers import raw_frame

    frames = [raw_frame(i + 1) for i in range(6)]
    n = frames[0][1].nbytes
    tier = RedisTier(redis_url, 3 * n)
    c = tier._connection()
    try:
        tier.put(*frames[0])
        tier.pin([frames[0][0]])
        c.hset(tier.keys_of.totals, field, written)
        for key, frame in frames[1:]:
            tier.put(key, frame)
        stats = tier.stats()
        assert (stats.used_bytes, stats.blocks) == (3 * n, 3), (written, stats.used_bytes, stats.blocks)
        assert [tier.get(key) is not None for key, _ in frames] == [True] + [False] * 3 + [True] * 2
    finally:
        tier.close()


@contextlib.contextmanager
def _one_block_in_a_cluster(cluster, seed: int, namespace: str):
    """A tier over the flushed ``cluster`` holding one block (``_frame(seed)``); yields (the
    tier, a connection, the block's key, its frame), and closes the tier."""
    cluster.flush()
    key, frame = _frame(seed)
    tier = RedisTier(cluster.url, 64 << 20, namespace=namespace)
    try:
        tier.put(key, frame)
        yield tier, tier._connection(), key, frame
    finally:
        tier.close()


# What tonumber takes and the script never writes; and digits from 2^53 on, which a Lua
# number holds inexactly (20 digits read as 1e20, handed back by Redis as -2^63).
GEN_NOT_OURS = ["nan", "inf", "-5", "0x10", " 7", "1e3", "9007199254740993", "9" * 20]


@pytest.mark.parametrize("value", GEN_NOT_OURS)
def test_in_a_cluster_a_frames_generation_not_written_by_a_tier_fences_a_victims_delete_off(cluster, value):
    """A victim's delete in a cluster takes a frame only while the generation beside it is
    no newer than the victim's. One another tool wrote ("nan", "-5", "0x10", read by plain
    ``tonumber``) compared as no newer: the delete of an older eviction took a frame a
    newer write had stored. Such a generation says nothing about the frame's age: the
    delete leaves it (at worst an orphan, adopted or expired as any other)."""
    with _one_block_in_a_cluster(cluster, 101, "genfence") as (tier, c, key, frame):
        gen_key = tier.keys_of.frame_gen(key)
        written = int(c.get(gen_key))
        older = written - 1  # the generation an earlier eviction of this block let go
        assert c.execute_command("EVAL", DROP_STALE_SCRIPT, 2, tier.keys_of.frame(key), gen_key, older) == 0
        c.set(gen_key, value)
        assert c.execute_command("EVAL", DROP_STALE_SCRIPT, 2, tier.keys_of.frame(key), gen_key, older) == 0
        got = tier.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
        assert c.get(gen_key) == value.encode()  # the delete changed nothing
        # The fence as the tier sends it, unchanged for a generation it wrote.
        c.set(gen_key, written)
        assert c.execute_command("EVAL", DROP_STALE_SCRIPT, 2, tier.keys_of.frame(key), gen_key, written) == 2  # frame and generation
        assert tier.get(key) is None and c.get(gen_key) is None


@pytest.mark.parametrize("value", GEN_NOT_OURS)
def test_in_a_cluster_a_generation_in_the_index_not_written_by_a_tier_gets_a_new_one(cluster, value):
    """The index's generation of a counted block that another tool overwrote: the script
    handed it back read by plain ``tonumber`` (-5, 16, and NaN or inf as Redis's integer
    -2^63), and a writer storing the block again wrote that beside its frame, under which
    the late delete of any earlier eviction took the frame the index counts. The script now
    reads digits only: such a block gets a new generation, newer than any an eviction has
    let go, and the writer's fence holds."""
    with _one_block_in_a_cluster(cluster, 102, "genindex") as (tier, c, key, frame):
        member, gen_key = RedisKeys.member(key), tier.keys_of.frame_gen(key)
        first = int(c.get(gen_key))
        c.hset(tier.keys_of.gens, member, value)
        c.delete(tier.keys_of.frame(key))  # its value lost (evicted by Redis, a failover): counted, absent
        assert tier.put(key, frame).error is None  # written again under the index's entry
        now = c.get(gen_key)
        assert now is not None and now.isdigit() and int(now) > first
        assert int(c.hget(tier.keys_of.gens, member)) == int(now)  # the index keeps what the writer wrote
        # The late delete of an eviction before the first write: fenced off.
        assert c.execute_command("EVAL", DROP_STALE_SCRIPT, 2, tier.keys_of.frame(key), gen_key, first) == 0
        got = tier.get(key)
        assert got is not None and bytes(got.host) == bytes(frame.host)
        assert tier.check() == {"ok": 1, "ghosts": 0, "orphans": 0, "wrong_size": 0, "stale_owner_tags": 0}


def test_in_a_cluster_a_victims_generation_key_of_another_type_leaves_its_frame_and_fails_nothing(cluster):
    """A generation key that is not a string (another tool's hash under its name) made the
    fenced delete's GET fail with WRONGTYPE, which the call that evicted the block raised
    as Redis refusing it: here a pin that had landed (the rest of its settling skipped).
    Such a key says nothing of the frame's age, as one that is not digits: the delete
    leaves the frame (an orphan until adopted, fixed or expired) and the call succeeds."""
    with _one_block_in_a_cluster(cluster, 103, "gentype") as (tier, c, key, frame):
        other = _frame(104)
        tier.put(*other)
        gen_key = tier.keys_of.frame_gen(key)
        c.delete(gen_key)
        c.hset(gen_key, "gen", 1)
        small = RedisTier(cluster.url, frame.nbytes, namespace="gentype")  # room for one block
        try:
            small.pin([other[0]])  # its call evicts down to its budget: the older block goes
            assert small.stats().blocks == 1 and other[0] in small.keys()
        finally:
            small.close()
        assert tier.get(key) is not None and c.type(gen_key) == b"hash"
        assert tier.check() == {"ok": 1, "ghosts": 0, "orphans": 1, "wrong_size": 0, "stale_owner_tags": 0}


# -- a key of the index holding another type ---------------------------------------------

def _dump_all(r) -> dict:
    return {k: r.dump(k) for k in r.keys("*")}


@pytest.mark.parametrize("which", ["sizes", "lru", "pinned", "owners"])
def test_a_key_of_the_index_holding_another_type_is_named_and_left_alone_and_changes_nothing(
        redis_url, which, caplog):
    """Another app's value (or a SET by hand) under a key of the index failed every call of
    every process with a bare WRONGTYPE, some after part of their writes. Now each call that
    needs the index is refused before any write with an error naming the key and what to do,
    logged once; the key and everything else stay as they were, stored blocks are still
    served, and once the key is gone the tier works again."""
    import logging

    import redis as redis_py

    from cacheseek.store.redis_tier import ForeignIndexKey

    cache = rcache(redis_url)
    toks, kv = tokens_for(50, 3 * BLOCK), make_kv(3 * BLOCK, 50)
    assert cache.ingest(toks, kv).stored == 3
    tier = cache.store.tier("redis")
    key = getattr(tier.keys_of, which)
    r = redis_py.Redis.from_url(redis_url)
    r.delete(key)
    r.set(key, b"another app's value")
    before = _dump_all(r)
    with caplog.at_level(logging.ERROR, logger="cacheseek.store.redis"):
        res = cache.ingest(tokens_for(51, 2 * BLOCK), make_kv(2 * BLOCK, 51))
        assert res.stored == 0 and key in res.errors["redis"] and "DEL" in res.errors["redis"], res
        assert "WRONGTYPE" not in res.errors["redis"]
        assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)  # (its touch refused, quietly)
        assert cache.locate_batch([toks]) == [cache.locate(toks)]
        if which in ("sizes", "pinned"):  # (read by plain commands, not the script: found all the same)
            with pytest.raises(ForeignIndexKey, match=key):
                tier.check()
        extra = redis_stats(cache)
    assert _dump_all(r) == before
    assert r.get(key) == b"another app's value"
    logged = [rec for rec in caplog.records if key in rec.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR, [rec.getMessage() for rec in caplog.records]
    assert extra["foreign_index_key"] == key and extra["foreign_index_errors"] >= 2
    r.delete(key)
    again = cache.ingest(tokens_for(51, 2 * BLOCK), make_kv(2 * BLOCK, 51))
    assert (again.stored, again.errors) == (2, {})
    cache.close()


def test_the_index_script_refuses_a_foreign_key_before_any_write_of_an_unpin(redis_url):
    """An unpin beside another owner whose pin set was another type: the script took the
    block out of the caller's set, then failed at the other's (a script's writes stay), so
    the pin was half undone. And a generations hash of another type (a cluster's fence)
    failed every put. Both now refused first, the key named, nothing changed."""
    import redis as redis_py
    from redis.exceptions import ResponseError

    from cacheseek.store.redis_index import ForeignKey, SharedIndex, foreign_key

    r = redis_py.Redis.from_url(redis_url)
    index = SharedIndex(RedisKeys("t", "foreign"), 1 << 20, generations=True)
    m = "ab" * 16
    index.queue(r, add=[(m, 10, 10)])
    index.queue(r, pin=[m], owner="mine")
    index.queue(r, pin=[m], owner="other")
    r.delete(index.keys.owner_pins("other"))
    r.set(index.keys.owner_pins("other"), b"x")
    before = _dump_all(r)
    with pytest.raises(ResponseError) as refused:
        index.queue(r, unpin=[m], owner="mine")
    assert foreign_key(refused.value) == ForeignKey(index.keys.owner_pins("other"), "string", "set")
    assert _dump_all(r) == before
    r.delete(index.keys.owner_pins("other"))
    r.delete(index.keys.gens)
    r.rpush(index.keys.gens, b"x")
    with pytest.raises(ResponseError) as refused:
        index.queue(r, add=[("cd" * 16, 10, 10)])
    assert foreign_key(refused.value) == ForeignKey(index.keys.gens, "list", "hash")
    assert not r.hexists(index.keys.sizes, "cd" * 16)


# -- Redis's own memory settings ------------------------------------------------------------------


def _mib_frame(i: int) -> tuple[bytes, BlockFrame]:
    """1 MiB of payload and a header: just past a power of two, as every real block's frame."""
    return _raw_frame_of((1 << 100 | i).to_bytes(16, "big"), i, 8, 64)


def _used_memory(srv: RedisServer) -> int:
    return int(re.search(r"^used_memory:(\d+)", srv.cli("INFO", "memory"), re.M).group(1))


@pytest.mark.parametrize("factor", [1.1, redis_memory.JEMALLOC_FACTOR])
def test_a_namespace_at_its_budget_fits_the_documented_maxmemory_and_not_the_old_one(tmp_path, factor):
    """The budget counts frame bytes; Redis's allocator rounds each frame, just past a power of
    two, up by a quarter. At the old rule (maxmemory = budget x 1.1, less the fixed pad that hid
    it at small budgets) Redis filled before the budget, and under noeviction every write was
    refused from then on, the budget never reached; at the documented one it holds."""
    budget = 64 << 20
    srv = RedisServer(tmp_path / "r").start()
    try:
        srv.cli("CONFIG", "SET", "maxmemory", str(_used_memory(srv) + int(budget * factor) + (2 << 20)))
        srv.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        tier = RedisTier(srv.url, budget)
        try:
            refused = sum(r.error is not None for i in range(3 * 64) for r in tier.put_many([_mib_frame(i)]))
            stats = tier.stats()
        finally:
            tier.close()
        if factor == 1.1:
            assert refused > 64, refused  # every write once Redis was full: about two thirds
            assert stats.evictions == 0
        else:
            assert refused == 0 and stats.evictions > 64 and stats.used_bytes <= budget
    finally:
        srv.kill()


def test_a_maxmemory_below_the_budgets_need_or_an_allkeys_policy_is_reported(tmp_path, caplog):
    budget = 256 << 20
    srv = RedisServer(tmp_path / "r").start()
    tier = RedisTier(srv.url, budget)
    try:
        needed = redis_memory.maxmemory_needed(budget)
        srv.cli("CONFIG", "SET", "maxmemory", str(needed))
        srv.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        assert tier.sizing_problems() == []
        srv.cli("CONFIG", "SET", "maxmemory", str(int(budget * 1.1) + (64 << 20)))  # the old rule
        (line,) = tier.sizing_problems()
        assert "maxmemory (346 MiB) is below what redis_bytes (256 MiB) takes there (397 MiB with jemalloc" in line
        assert "every write is refused once it is full" in line
        srv.cli("CONFIG", "SET", "maxmemory", "0")  # no limit: nothing to say of it
        srv.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        (line,) = tier.sizing_problems()
        assert "maxmemory-policy is allkeys-lru: Redis may evict the shared index itself" in line
        # A user whose ACL denies INFO: not asked, and no fault counted (a healthy setup)
        srv.cli("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info")
        limited = RedisTier(srv.url.replace("redis://", "redis://noinfo:pw@"), budget)
        try:
            assert limited.sizing_problems() is None
            faults = limited.stats().extra
            assert faults["rejected_errors"] == 0 and not faults["last_error"], faults
        finally:
            limited.close()
        srv.kill()
        assert tier.sizing_problems() is None  # not asked: nothing said
    finally:
        tier.close()
        srv.kill()


class _SteppedPipeline:
    """A pipeline whose commands are sent one at a time, ``between(i)`` run after the i-th:
    another client's commands landing between a non-transactional pipeline's, as Redis allows."""

    def __init__(self, inner, between):
        self.inner, self.between = inner, between

    def execute(self, raise_on_error=True):
        client, stack, out = self.inner.inner_client, list(self.inner.command_stack), []
        self.inner.reset()
        for i, (args, options) in enumerate(stack):
            try:
                out.append(client.execute_command(*args, **options))
            except Exception as exc:  # (in place, as the pipeline answers with raise_on_error=False)
                out.append(exc)
            self.between(i)
        return out

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _SteppedClient:
    def __init__(self, inner, between):
        self.inner, self.between = inner, between

    def pipeline(self, *args, **kwargs):
        pipe = self.inner.pipeline(*args, **kwargs)
        pipe.inner_client = self.inner
        return _SteppedPipeline(pipe, self.between)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_read_racing_a_delete_never_finds_a_frame_without_its_owner_tag(redis_url, monkeypatch):
    """Another process deletes a block (its frame, then its owner tag) while a read's pipeline
    is half sent. The read asked for the frames first and the tags after, so it could find the
    frame and not its tag: the block was promoted nobody's, and a flush of its namespace on
    this replica passed it by. Now the tags are asked first: a frame found comes with its tag
    (or, the delete having landed first, is not found)."""
    tier = RedisTier(redis_url, 64 << 20)
    tier.owner_tag = lambda key: "tenA"
    told: list[tuple[bytes, str]] = []
    tier.tags_read = lambda found, *heads: told.extend(found)
    key, frame = _frame(80)
    other = tier._connection()
    try:
        tier.put_many([(key, frame)])

        def delete_after_first(i: int) -> None:
            if i == 0:
                other.delete(tier.keys_of.frame(key))
                other.hdel(tier.keys_of.owners, RedisKeys.member(key))

        monkeypatch.setattr(tier, "_connection", lambda: _SteppedClient(other, delete_after_first))
        got = tier.get_many([key])
        assert got[0] is None or told == [(key, "tenA")], (got, told)
    finally:
        tier.close()


def test_a_read_gets_its_frames_when_redis_cannot_answer_for_the_owner_tags(redis_url, monkeypatch):
    """The owner tags are one hash, so on one node of a cluster: its slot moving, or its node
    down, answered the HMGET with an error of the kind that means unavailable, and the whole
    read failed with it (every block a miss and a read error) though the frames' nodes had
    answered. Now the tags are set aside first: such an error is "no tags", the frames stand."""
    tier = RedisTier(redis_url, 64 << 20)
    tier.owner_tag = lambda key: "tenA"
    told: list = []
    tier.tags_read = lambda found, *heads: told.append(found)
    frames = [_frame(i) for i in range(81, 84)]
    try:
        tier.put_many(frames)
        real = tier._connection()

        class TagsNodeDown:
            def pipeline(self, *args, **kwargs):
                pipe = real.pipeline(*args, **kwargs)
                # (Redis itself answers the error: a script's reply of MASTERDOWN, in HMGET's place.)
                pipe.hmget = lambda name, keys: pipe.eval("return redis.error_reply('MASTERDOWN node of the tags')", 0)
                return pipe

            def __getattr__(self, name):
                return getattr(real, name)

        monkeypatch.setattr(tier, "_connection", lambda: TagsNodeDown())
        got = tier.get_many([k for k, _ in frames])
        assert all(f is not None for f in got) and told == []
        assert tier.stats().extra["read_errors"] == 0
    finally:
        tier.close()
