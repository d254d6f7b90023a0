"""Two ``cacheseek serve`` processes sharing one real redis-server, and Redis dying under a server."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time

import httpx
import pytest
import torch

import cacheseek as cs
from redis_servers import RedisServer, needs_redis
from server_helpers import Server, raw_frame
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for

pytestmark = [needs_redis, pytest.mark.slow]

SECRET = "shared-namespace-secret-for-tests"


def _env(redis: RedisServer, **extra: str) -> dict[str, str]:
    return {"CACHESEEK_REDIS_URL": redis.url, "CACHESEEK_REDIS_BYTES": "256MiB",
            "CACHESEEK_REDIS_BREAKER_BASE_SECONDS": "0.2", "CACHESEEK_REDIS_BREAKER_CAP_SECONDS": "0.4",
            "CACHESEEK_REDIS_CONNECT_TIMEOUT_SECONDS": "0.3", "CACHESEEK_REDIS_SOCKET_TIMEOUT_SECONDS": "0.5",
            "CACHESEEK_NAMESPACE_SECRET": SECRET, **extra}


def _remote(srv: Server, codec=None, **kw) -> cs.RemoteCache:
    return cs.RemoteCache(srv.url, model_id="shared", layout=LAYOUT, codec=codec or cs.Raw(), block_tokens=BLOCK, **kw)


def _redis_stats(srv: Server) -> dict:
    tiers = httpx.get(srv.url + "/v1/stats", timeout=10).json()["tiers"]
    return {t["name"]: t for t in tiers}["redis"]


def _no_500(srv: Server) -> None:
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'status="500"' not in metrics, [line for line in metrics.splitlines() if 'status="5' in line]


def test_a_prefix_ingested_through_one_server_materializes_through_another(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        # A: a cpu tier over Redis (write-through). B: Redis is its only tier.
        with Server(tmp_path / "a", disk=False, env=_env(redis)) as a, \
                Server(tmp_path / "b", disk=False, cpu_bytes="0", env=_env(redis)) as b:
            toks, kv = tokens_for(30, 5 * BLOCK + 3), make_kv(5 * BLOCK + 3, 30)
            res = _remote(a).ingest(toks, kv)
            assert (res.stored, res.failed, res.errors) == (5, 0, {})
            via_b = _remote(b)
            assert via_b.lookup(toks) == 5 * BLOCK
            got = via_b.materialize(toks)
            assert_prefix_equal(got, kv, 5 * BLOCK)
            assert got.tiers == ["redis"] * 5

            # KIVI int4 frames: B decodes exactly what an embedded cache decodes.
            codec = cs.KIVI(bits=4, group_size=32)
            toks4, kv4 = tokens_for(31, 3 * BLOCK), make_kv(3 * BLOCK, 31)
            _remote(a, codec).ingest(toks4, kv4)
            local = cs.PrefixCache(model_id="shared", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                                   tiers=cs.TierConfig(cpu_bytes="8MiB", pin_memory=False))
            local.ingest(toks4, kv4)
            remote_got, local_got = _remote(b, codec).materialize(toks4), local.materialize(toks4)
            assert remote_got.num_tokens == 3 * BLOCK
            for (k, v), (k0, v0) in zip(remote_got.layers, local_got.layers):
                assert torch.equal(k, k0) and torch.equal(v, v0)

            # A tenant namespace (the servers share namespace_secret) is shared, and isolated.
            toks_t, kv_t = tokens_for(32, 2 * BLOCK), make_kv(2 * BLOCK, 32)
            _remote(a, namespace="tenant-x").ingest(toks_t, kv_t)
            assert_prefix_equal(_remote(b, namespace="tenant-x").materialize(toks_t), kv_t, 2 * BLOCK)
            assert _remote(b).lookup(toks_t) == 0 and _remote(b, namespace="tenant-y").lookup(toks_t) == 0

            # Raw HTTP: B streams the whole chain that A stored.
            last = _remote(a).keys.block_hashes(toks)[-1].hex()
            r = httpx.get(f"{b.url}/v1/prefixes/{last}", timeout=30)
            assert r.status_code == 200 and r.headers["x-cacheseek-blocks"] == "5"

            stats = _redis_stats(b)
            assert stats["blocks"] == 5 + 3 + 2 and stats["breaker"]["state"] == "closed"
            assert _redis_stats(a)["blocks"] == stats["blocks"]  # one shared index
            _no_500(a)
            _no_500(b)
    finally:
        redis.stop()


def test_redis_killed_during_ingest_through_a_server_never_gives_a_500(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        with Server(tmp_path / "a", disk=False, env=_env(redis)) as a:
            remote = _remote(a)
            results, errors = [], []
            stop = threading.Event()

            def ingest_loop() -> None:
                seed = 2000
                try:
                    while not stop.is_set():
                        toks, kv = tokens_for(seed, 2 * BLOCK), make_kv(2 * BLOCK, seed)
                        results.append((seed, remote.ingest(toks, kv)))
                        seed += 1
                except BaseException as exc:  # a 5xx raises RemoteError: surfaced below
                    errors.append(exc)

            worker = threading.Thread(target=ingest_loop)
            worker.start()
            while len(results) < 3 and worker.is_alive():
                time.sleep(0.01)
            redis.kill()
            killed_at = len(results)  # the ingest in flight now may have been written before the kill
            time.sleep(1.0)
            stop.set()
            worker.join(timeout=60)
            assert not errors, errors[0]
            after = [r for _, r in results[killed_at + 1 :]]
            # Redis is the only persistent tier: with it down nothing is durable, so nothing is
            # acknowledged (no 5xx, no exception: each block reported failed, with why); the cpu
            # tier took every block all the same, and serves it (below).
            assert after and all(r.failed == 2 and r.stored == 0 for r in after)
            assert any("redis" in r.errors for r in after)
            stats = _redis_stats(a)
            assert stats["dropped_writes"] >= 2 and stats["breaker"]["state"] in ("open", "half_open")
            metrics = httpx.get(a.url + "/metrics", timeout=10).text
            assert "cacheseek_redis_dropped_writes_total" in metrics and "cacheseek_redis_breaker_open" in metrics
            # The Redis tier's figures are the last ones read, and say so.
            assert 'cacheseek_redis_index_stale{tier="redis"} 1.0' in metrics
            # Reads keep working from the cpu tier; with the breaker open they pay no timeout.
            start = time.perf_counter()
            for seed, _ in results:
                toks, kv = tokens_for(seed, 2 * BLOCK), make_kv(2 * BLOCK, seed)
                assert_prefix_equal(remote.materialize(toks), kv, 2 * BLOCK)
            for _ in range(20):
                assert remote.lookup(tokens_for(9999, 2 * BLOCK)) == 0
            assert time.perf_counter() - start < 30

            redis.start()  # the same port, empty
            time.sleep(0.6)  # past the breaker's capped backoff
            toks, kv = tokens_for(7000, 2 * BLOCK), make_kv(2 * BLOCK, 7000)
            res = remote.ingest(toks, kv)
            assert res.stored == 2 and res.errors == {}, res
            assert _redis_stats(a)["breaker"]["state"] == "closed"
            assert _redis_stats(a)["blocks"] == 2  # the new blocks landed in the restarted Redis
            assert 'cacheseek_redis_index_stale{tier="redis"} 0.0' in httpx.get(a.url + "/metrics", timeout=10).text
            _no_500(a)
    finally:
        redis.stop()


def test_an_admin_chain_delete_ends_on_links_that_skip_positions(tmp_path):
    """Redis keeps no index of children, so on a server whose blocks are only in Redis a
    link is checked from the child's end only: a block stored before its parent can name a
    parent that is stored later at another position, closing a cycle of links. A chain
    delete walked up that cycle for good (and the server then ignored SIGTERM), and a pin
    for a million steps; both climb only to a parent one position down, as a chain read does."""
    from server_helpers import raw_frame

    with _server_over_redis(tmp_path, cpu_bytes="0", admin=True) as (redis, srv, c):
        h, k = bytes([0xE1]) * 16, bytes([0xF1]) * 16
        _, child = raw_frame(60, block_hash=k, parent=h, position=1)
        _, parent = raw_frame(61, block_hash=h, parent=k, position=2)
        assert c.put(f"/v1/blocks/{k.hex()}", content=child).status_code == 201
        assert c.put(f"/v1/blocks/{h.hex()}", content=parent).status_code == 201
        # A pin reads the chain as a read does: not whole (a million Redis round trips before).
        r = c.put(f"/v1/admin/pins/{k.hex()}", headers={"authorization": "Bearer adm"})
        assert r.status_code == 404 and "not stored whole" in r.json()["error"], r.text
        r = c.delete(f"/v1/admin/chains/{k.hex()}", headers={"authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["deleted_blocks"] == 1, r.text
        assert c.get(f"/v1/blocks/{k.hex()}").status_code == 404
        assert c.get(f"/v1/blocks/{h.hex()}").status_code == 200  # not an ancestor of k: kept
        _no_500(srv)


ADMIN = {"authorization": "Bearer adm"}


@contextlib.contextmanager
def _server_over_redis(tmp_path, *, cpu_bytes: str, admin: bool = False):
    """A real redis-server and one server over it (no disk tier; the admin token "adm" with
    ``admin``): yields (redis, server, client); the Redis is killed after."""
    redis = RedisServer(tmp_path / "redis").start()
    token = ("--admin-token", "adm") if admin else ()
    try:
        with Server(tmp_path / "s", *token, disk=False, cpu_bytes=cpu_bytes, env=_env(redis)) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as c:
            yield redis, srv, c
    finally:
        redis.kill()


@contextlib.contextmanager
def _redis_unreachable(redis: RedisServer, c: httpx.Client, srv: Server):
    """Redis paused and the server's breaker open (nothing is sent to Redis) for the block."""
    redis.pause()
    try:
        _open_breaker(c, srv)
        yield
    finally:
        redis.resume()


def _refused_until_redis_answers(r: httpx.Response) -> None:
    assert r.status_code == 503 and "could not be reached" in r.json()["error"], r.text
    assert r.headers["retry-after"] == "1"


def _deleted_once_redis_answers(c: httpx.Client, h: bytes) -> None:
    """The DELETE of ``h`` sent again until the breaker lets calls through: then it is done
    (404: the DEL sent while Redis hung landed after all), and ``h`` is served by no tier."""
    r = _until_redis_answers(lambda: c.delete(f"/v1/blocks/{h.hex()}"))
    assert r.status_code in (204, 404), r.text
    assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404


def test_a_delete_while_redis_is_unreachable_is_a_503_not_a_404(tmp_path):
    """A block only Redis holds, deleted while Redis hangs: the server cannot say whether it
    is gone, so it answers 503 (retry), not 404 (which told the client it was not stored).
    The hung Redis runs the DEL it was sent once it wakes: the retry finds nothing."""
    from server_helpers import raw_frame

    with _server_over_redis(tmp_path, cpu_bytes="0") as (redis, srv, c):
        h, frame = raw_frame(70)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        redis.pause()
        try:
            _refused_until_redis_answers(c.delete(f"/v1/blocks/{h.hex()}"))
        finally:
            redis.resume()
        _deleted_once_redis_answers(c, h)
        assert c.delete(f"/v1/blocks/{h.hex()}").status_code == 404
        _no_500(srv)


def test_a_delete_that_cannot_reach_redis_is_a_503_even_when_the_cpu_tier_held_the_block(tmp_path):
    """A block in the CPU tier and in Redis, deleted while Redis cannot be reached (its
    breaker open: the DEL is never sent). The CPU tier's copy went, so the server answered
    204; Redis still held the block, and once it answered again a GET served the block the
    client had been told was deleted. A delete is done only once every tier that may hold
    the block has answered: until then it is a 503 (retry), whatever the other tiers held."""
    from server_helpers import raw_frame

    with _server_over_redis(tmp_path, cpu_bytes="1MiB") as (redis, srv, c):
        h, frame = raw_frame(71)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        with _redis_unreachable(redis, c, srv):
            _refused_until_redis_answers(c.delete(f"/v1/blocks/{h.hex()}"))
        _deleted_once_redis_answers(c, h)  # (not served again from Redis)
        assert c.post("/v1/lookup", json={"hashes": [h.hex()]}).json()["matched"] == 0
        _no_500(srv)


@pytest.mark.parametrize("cpu_bytes", ["0", "1MiB"])
def test_an_admin_chain_delete_that_cannot_reach_redis_is_a_503(tmp_path, cpu_bytes):
    """A chain in Redis (and, with a CPU tier, there too), deleted by an admin while Redis
    cannot be reached (its breaker open). Only in Redis, the walk found nothing and the answer
    was 404 "not stored"; in both tiers, 200 with the CPU tier's blocks counted deleted. Either
    way Redis kept the chain, and served it again once it answered. A chain delete that could
    not ask Redis is a 503 (retry); the retry, once Redis answers, deletes what is left."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes=cpu_bytes, admin=True) as (redis, srv, c):
        chain = raw_chain(72, 3)
        for h, frame in chain:
            assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        last = chain[-1][0].hex()
        with _redis_unreachable(redis, c, srv):
            r = c.delete(f"/v1/admin/chains/{last}", headers=ADMIN)
            assert r.status_code == 503 and "could not be reached" in r.json()["error"], r.text
            assert r.headers["retry-after"] == "1"
        r = _until_redis_answers(lambda: c.delete(f"/v1/admin/chains/{last}", headers=ADMIN))
        assert r.status_code == 200 and r.json()["deleted_blocks"] >= 1, r.text
        for h, _ in chain:
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404
        _no_500(srv)


def _open_breaker(c: httpx.Client, srv: Server) -> None:
    """With Redis paused: misses that time out open the server's breaker (then nothing is sent)."""
    while _redis_stats(srv)["breaker"]["state"] == "closed":
        assert c.get(f"/v1/blocks/{'ab' * 16}").status_code == 404


def _until_redis_answers(send, deadline_seconds: float = 10.0) -> httpx.Response:
    """``send()`` again while it answers 503 (the breaker lets calls through once it probes)."""
    deadline = time.monotonic() + deadline_seconds
    while (r := send()).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    return r


@pytest.mark.parametrize("cpu_bytes", ["0", "1MiB"])
def test_a_pin_that_cannot_reach_redis_is_a_503_and_pins_nothing(tmp_path, cpu_bytes):
    """A chain pinned while Redis cannot be reached. Only in Redis, the walk of the chain
    missed every link and the answer was 404 "not stored whole"; in the CPU tier too, the
    Redis pin failed and the answer was 507, a full store. Either way the client was told
    something other than the truth, an outage: both are a 503 (retry), nothing pinned."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes=cpu_bytes, admin=True) as (redis, srv, c):
        chain = raw_chain(73, 3)
        for h, frame in chain:
            assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        last = chain[-1][0].hex()
        with _redis_unreachable(redis, c, srv):
            _refused_until_redis_answers(c.put(f"/v1/admin/pins/{last}", headers=ADMIN))
            assert c.get("/v1/admin/pins", headers=ADMIN).json() == []
        r = _until_redis_answers(lambda: c.put(f"/v1/admin/pins/{last}", headers=ADMIN))
        assert r.status_code == 200 and r.json()["blocks"] == 3, r.text
        assert _redis_stats(srv)["pinned_blocks"] == 3
        _no_500(srv)


def test_a_flush_that_cannot_reach_redis_is_a_503_and_its_retry_deletes_the_redis_copies(tmp_path):
    """A model flushed while Redis cannot be reached (its breaker open: no DEL is sent). The
    flush deleted the CPU tier's copies and answered 200 with every block counted deleted;
    Redis kept them, and served them again once it answered, though nothing named them any
    more: no later flush could find them. Now such blocks are kept in every tier and the
    answer is a 503; the retry, once Redis answers, deletes them everywhere."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes="1MiB", admin=True) as (redis, srv, c):
        chain = raw_chain(74, 3)
        for h, frame in chain:
            r = c.put(f"/v1/blocks/{h.hex()}", content=frame, headers={"X-CacheSeek-Model": "m"})
            assert r.status_code == 201
        with _redis_unreachable(redis, c, srv):
            r = c.post("/v1/admin/flush", params={"model": "m"}, headers=ADMIN)
            assert r.status_code == 503 and "could not be reached" in r.json()["error"], r.text
            assert r.headers["retry-after"] == "1"
            for h, _ in chain:  # kept where they were, for the retry to find
                assert c.get(f"/v1/blocks/{h.hex()}").status_code == 200
        r = _until_redis_answers(lambda: c.post("/v1/admin/flush", params={"model": "m"}, headers=ADMIN))
        assert r.status_code == 200 and r.json()["deleted_blocks"] == 3, r.text
        for h, _ in chain:  # from Redis too
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404
        assert _redis_stats(srv)["blocks"] == 0
        _no_500(srv)


def test_a_chain_delete_retried_after_an_outage_deletes_the_descendants_redis_holds(tmp_path):
    """A chain deleted at its middle block while Redis cannot be reached: the first answer
    is a 503, as it should be, but the CPU tier's copies were gone; the retry walked the
    chain again and found its descendants only in the local indexes (Redis keeps no index
    of children), so it deleted the block and its ancestors and answered 200, while the
    tail stayed in Redis and was served. Now nothing is deleted where Redis could not be
    asked, and the retry finds the whole chain."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes="1MiB", admin=True) as (redis, srv, c):
        chain = raw_chain(75, 3)
        for h, frame in chain:
            assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        middle = chain[1][0].hex()
        with _redis_unreachable(redis, c, srv):
            _refused_until_redis_answers(c.delete(f"/v1/admin/chains/{middle}", headers=ADMIN))
        r = _until_redis_answers(lambda: c.delete(f"/v1/admin/chains/{middle}", headers=ADMIN))
        assert r.status_code == 200, r.text
        for h, _ in chain:  # the tail too: not served from Redis
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404
        assert r.json()["deleted_blocks"] == 3
        assert _redis_stats(srv)["blocks"] == 0
        _no_500(srv)


def test_pins_a_start_could_not_make_again_are_kept_and_made_once_redis_answers(tmp_path):
    """A server restarted while Redis hung could not make its pins again (the Redis pin
    failed): it logged so and dropped them. The chain stayed unpinned once Redis answered,
    and the next pin's save left them out of the pins file, so no later start made them
    either. Now they are kept in the file, and made again as soon as Redis answers."""
    from server_helpers import raw_chain

    redis = RedisServer(tmp_path / "redis").start()
    args = ("--admin-token", "adm")
    chain, other = raw_chain(76, 3), raw_chain(77, 2)

    def pinned(c: httpx.Client, *, waiting: bool = False) -> set[str]:
        return {p["hash"] for p in c.get("/v1/admin/pins", headers=ADMIN).json() if p["waiting"] is waiting}

    try:
        with Server(tmp_path / "s", *args, env=_env(redis)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            for h, frame in chain + other:
                assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
            r = c.put(f"/v1/admin/pins/{chain[-1][0].hex()}", headers=ADMIN)
            assert r.status_code == 200 and r.json()["saved"] is True, r.text
        srv = Server(tmp_path / "s", *args, env=_env(redis))
        redis.pause()
        try:
            srv.start()
            with httpx.Client(base_url=srv.url, timeout=10) as c:  # listed, as not made yet
                assert pinned(c, waiting=True) == {chain[-1][0].hex()} and pinned(c) == set()
        finally:
            redis.resume()
        try:
            with httpx.Client(base_url=srv.url, timeout=10) as c:
                deadline = time.monotonic() + 10
                while not pinned(c) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert pinned(c) == {chain[-1][0].hex()} and pinned(c, waiting=True) == set(), srv.output()
                assert c.put(f"/v1/admin/pins/{other[-1][0].hex()}", headers=ADMIN).status_code == 200
                assert _redis_stats(srv)["pinned_blocks"] == 5
        finally:
            srv.stop()
        with Server(tmp_path / "s", *args, env=_env(redis)) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            assert pinned(c) == {chain[-1][0].hex(), other[-1][0].hex()}  # both in the pins file
            _no_500(srv)
    finally:
        redis.kill()


def test_a_block_whose_delete_got_a_503_is_still_found_by_a_flush(tmp_path):
    """A block deleted while Redis could not be reached: the answer was a 503, as it should
    be, but the CPU tier's copy was gone, and with it the server's record of the block's
    owner. A client that did not retry and flushed its model once Redis answered got a 200,
    and Redis went on serving the block. Now a delete that cannot ask Redis deletes from no
    tier, so the block is still the model's, and the flush deletes it everywhere."""
    from server_helpers import raw_frame

    with _server_over_redis(tmp_path, cpu_bytes="1MiB", admin=True) as (redis, srv, c):
        h, frame = raw_frame(78)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame, headers={"X-CacheSeek-Model": "m"}).status_code == 201
        with _redis_unreachable(redis, c, srv):
            _refused_until_redis_answers(c.delete(f"/v1/blocks/{h.hex()}"))
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 200  # kept: nothing was deleted
        r = _until_redis_answers(lambda: c.post("/v1/admin/flush", params={"model": "m"}, headers=ADMIN))
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404  # not served from Redis
        assert r.json()["deleted_blocks"] == 1
        _no_500(srv)


def _put_chain(c: httpx.Client, chain, namespace: str, model: str) -> None:
    for h, frame in chain:
        r = c.put(f"/v1/blocks/{h.hex()}", content=frame,
                  headers={"X-CacheSeek-Namespace": namespace, "X-CacheSeek-Model": model})
        assert r.status_code == 201, r.text


def _served(c: httpx.Client, chain, namespace: str) -> list[int]:
    return [c.get(f"/v1/blocks/{h.hex()}", headers={"X-CacheSeek-Namespace": namespace}).status_code
            for h, _ in chain]


def test_a_flush_on_one_replica_deletes_the_tenants_blocks_another_wrote_to_redis(tmp_path):
    """Two servers over one Redis, neither with a CPU tier: A writes a tenant's chains, B
    flushes the tenant. B's owners had never seen the tenant (no local index holds Redis's
    blocks), so the flush answered 404, and with a CPU tier of its own 200 with 0 deleted,
    while every block stayed in Redis, served by both. Now each block's owner is kept beside
    it in the shared index, and a flush on any replica deletes it from Redis: one model's
    leaves the tenant's other models and other tenants; during an outage it is a 503 and
    deletes nothing."""
    from server_helpers import raw_chain

    redis = RedisServer(tmp_path / "redis").start()
    try:
        with Server(tmp_path / "a", disk=False, cpu_bytes="0", env=_env(redis)) as a, \
                Server(tmp_path / "b", "--admin-token", "adm", disk=False, cpu_bytes="0", env=_env(redis)) as b, \
                httpx.Client(base_url=a.url, timeout=10) as ca, httpx.Client(base_url=b.url, timeout=10) as cb:
            t_m1, t_m2, u_m1 = raw_chain(81, 3), raw_chain(82, 2), raw_chain(83, 2)
            _put_chain(ca, t_m1, "t", "m1")
            _put_chain(ca, t_m2, "t", "m2")
            _put_chain(ca, u_m1, "u", "m1")

            redis.pause()
            try:
                _open_breaker(cb, b)
                r = cb.post("/v1/admin/flush", params={"namespace": "t"}, headers=ADMIN)
                assert r.status_code == 503 and "none was deleted" in r.json()["error"], r.text
            finally:
                redis.resume()
            r = _until_redis_answers(lambda: cb.post("/v1/admin/flush", params={"namespace": "t", "model": "m1"},
                                                     headers=ADMIN))
            assert r.status_code == 200 and r.json()["deleted_blocks"] == 3, r.text
            for c in (ca, cb):
                assert _served(c, t_m1, "t") == [404] * 3
                assert _served(c, t_m2, "t") == [200] * 2 and _served(c, u_m1, "u") == [200] * 2

            r = cb.post("/v1/admin/flush", params={"namespace": "t"}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["deleted_blocks"] == 2, r.text
            assert _served(ca, t_m2, "t") == [404] * 2 and _served(ca, u_m1, "u") == [200] * 2
            assert cb.post("/v1/admin/flush", params={"namespace": "t"}, headers=ADMIN).status_code == 404
            # A model across namespaces: u's m1 (t's is gone already).
            r = cb.post("/v1/admin/flush", params={"model": "m1"}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["deleted_blocks"] == 2, r.text
            assert _served(ca, u_m1, "u") == [404] * 2
            assert _redis_stats(b)["blocks"] == 0
            assert redis.cli("HLEN", "{cacheseek:default}:owner").strip() == "0"  # (gone with the entries)
            _no_500(a)
            _no_500(b)
    finally:
        redis.kill()


def test_a_flush_through_a_replica_of_another_namespace_secret_says_it_needs_the_same(tmp_path):
    """Owner tags are keyed with namespace_secret, in the default namespace too: replicas
    without a shared one find nothing the other wrote, and the 404 said "no blocks were ever
    stored", which the docs (shared secret "if clients use tenant namespaces") did not explain."""
    from server_helpers import raw_chain

    redis = RedisServer(tmp_path / "redis").start()
    env = {k: v for k, v in _env(redis).items() if k != "CACHESEEK_NAMESPACE_SECRET"}
    try:
        with Server(tmp_path / "a", disk=False, cpu_bytes="0", env=env) as a, \
                Server(tmp_path / "b", "--admin-token", "adm", disk=False, cpu_bytes="0", env=env) as b, \
                httpx.Client(base_url=a.url, timeout=10) as ca, httpx.Client(base_url=b.url, timeout=10) as cb:
            chain = raw_chain(84, 2)
            _put_chain(ca, chain, "", "m1")
            r = cb.post("/v1/admin/flush", params={"namespace": ""}, headers=ADMIN)
            assert r.status_code == 404, r.text
            assert r.json()["error"] == ("no blocks were ever stored for namespace '' through this server; blocks "
                                         "other replicas wrote to Redis are found only where every replica has the "
                                         "same namespace_secret"), r.text
            assert _served(cb, chain, "") == [200] * 2
    finally:
        redis.kill()


def _usage(c: httpx.Client) -> list[tuple]:
    return [(n["namespace"], n["model"], n["blocks"]) for n in c.get("/v1/stats").json()["namespaces"] if n["blocks"]]


def _read_chain(c: httpx.Client, chain, namespace: str, model: str | None) -> int:
    headers = {"X-CacheSeek-Namespace": namespace, **({"X-CacheSeek-Model": model} if model is not None else {})}
    return c.get(f"/v1/prefixes/{chain[-1][0].hex()}", headers=headers).status_code


def test_blocks_a_replica_reads_from_redis_are_its_readers_and_a_flush_of_every_replica_takes_them(tmp_path):
    """Two replicas with CPU tiers over one Redis: A writes a tenant's chain, B reads it (its
    CPU tier takes the blocks up from Redis). B counted them unattributed (it never saw the
    chain's root), so the documented flush of every replica, A first, left them: A's flush
    deleted the Redis copies and their owner tags, and B answered "nothing to flush" while it
    went on serving the tenant's KV. Now a block comes up with its owner tag, read in the
    same round trip: B counts it under the tenant and model, and flushes it."""
    from server_helpers import cacheseek_command, raw_chain

    redis = RedisServer(tmp_path / "redis").start()
    try:
        with Server(tmp_path / "a", "--admin-token", "adm", disk=False, env=_env(redis)) as a, \
                Server(tmp_path / "b", "--admin-token", "adm", disk=False, env=_env(redis)) as b, \
                httpx.Client(base_url=a.url, timeout=10) as ca, httpx.Client(base_url=b.url, timeout=10) as cb:
            chain, other = raw_chain(101, 5), raw_chain(102, 2)
            _put_chain(ca, chain, "x", "m")
            _put_chain(ca, other, "y", "m")
            assert _usage(cb) == []
            assert _read_chain(cb, chain, "x", "m") == 200 and _read_chain(cb, other, "y", "m") == 200
            assert sorted(_usage(cb)) == [("x", "m", 5), ("y", "m", 2)]
            assert {t["name"]: t["blocks"] for t in cb.get("/v1/stats").json()["tiers"]}["cpu"] == 7
            namespaces = cb.get("/v1/admin/namespaces", headers=ADMIN).json()
            assert {n["namespace"]: n["blocks"] for n in namespaces} == {"x": 5, "y": 2}, namespaces

            flushed = subprocess.run([*cacheseek_command(), "admin", "--url", a.url, "--url", b.url, "--token", "adm",
                                      "--json", "flush", "--namespace", "x"], capture_output=True, text=True,
                                     timeout=60)
            assert flushed.returncode == 0 and flushed.stdout.count('"deleted_blocks": 5') == 2, flushed
            assert "nothing to flush" not in flushed.stderr, flushed.stderr
            for c in (ca, cb):
                assert _read_chain(c, chain, "x", "m") == 404 and _served(c, chain, "x") == [404] * 5
                assert _read_chain(c, other, "y", "m") == 200
            assert _usage(cb) == [("y", "m", 2)]
            _no_500(a)
            _no_500(b)
    finally:
        redis.kill()


def test_a_replica_restarted_without_a_disk_reads_back_its_blocks_under_their_owner(tmp_path):
    """The stateless shape (CPU tier and Redis, no disk, so no owners file): after a restart,
    every block the replica read back from Redis was counted unattributed, and once Redis let
    go of them (another replica's flush, its TTL, its LRU) its own flush no longer found them.
    Now they are counted under the owner tag they came with. A replica that never heard the
    writer's names (its reader named no model) counts them unattributed, but a flush of their
    namespace and model still takes them there, Redis's copies gone first."""
    from server_helpers import raw_chain

    redis = RedisServer(tmp_path / "redis").start()
    try:
        chain, unnamed = raw_chain(103, 4), raw_chain(104, 3)
        with Server(tmp_path / "a", disk=False, env=_env(redis)) as a, httpx.Client(base_url=a.url, timeout=10) as c:
            _put_chain(c, chain, "x", "m")
            _put_chain(c, unnamed, "x", "m")
            assert _usage(c) == [("x", "m", 7)]
        with Server(tmp_path / "a2", "--admin-token", "adm", disk=False, env=_env(redis)) as a, \
                Server(tmp_path / "b", "--admin-token", "adm", disk=False, env=_env(redis)) as b, \
                httpx.Client(base_url=a.url, timeout=10) as c, httpx.Client(base_url=b.url, timeout=10) as cb:
            assert _usage(c) == []
            assert _read_chain(c, chain, "x", "m") == 200
            assert _usage(c) == [("x", "m", 4)]
            # B never heard of model "m": the tag its blocks come with names nobody it knows.
            assert _read_chain(cb, unnamed, "x", None) == 200
            assert _usage(cb) == [(None, "", 3)]

            # Redis's copies gone (a flush through another replica), B's held still.
            r = c.post("/v1/admin/flush", params={"namespace": "x"}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["deleted_blocks"] == 7, r.text
            assert _redis_stats(a)["blocks"] == 0 and _usage(c) == []
            assert _read_chain(cb, unnamed, "x", None) == 200
            r = cb.post("/v1/admin/flush", params={"namespace": "x", "model": "m"}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["deleted_blocks"] == 3, r.text
            assert _read_chain(cb, unnamed, "x", None) == 404 and _usage(cb) == []
            _no_500(a)
            _no_500(b)
    finally:
        redis.kill()


def test_a_replica_with_a_disk_keeps_the_owner_of_blocks_it_read_from_redis_across_a_restart(tmp_path):
    """B (CPU, disk and Redis) reads a chain A wrote: its copies are counted under the tag
    they came with, but the tag was kept only in memory, and the owners file named no root
    of the chain (B never wrote it). After B restarted over its disk, they were nobody's, so
    the flush of every replica, A first, left B serving them: A's flush took Redis's copies
    and tags, and B's answered 404. Now the root a tag named an owner of is kept in the
    owners file, and the chain recovered from disk is attributed through it."""
    from server_helpers import raw_chain

    def tiers(c: httpx.Client) -> dict[str, int]:
        return {t["name"]: t["blocks"] for t in c.get("/v1/stats").json()["tiers"]}

    redis = RedisServer(tmp_path / "redis").start()
    try:
        chain = raw_chain(105, 5)
        with Server(tmp_path / "a", "--admin-token", "adm", disk=False, env=_env(redis)) as a, \
                httpx.Client(base_url=a.url, timeout=10) as ca:
            _put_chain(ca, chain, "x", "m")
            with Server(tmp_path / "b", "--admin-token", "adm", env=_env(redis)) as b, \
                    httpx.Client(base_url=b.url, timeout=10) as cb:
                assert _read_chain(cb, chain, "x", "m") == 200
                assert _usage(cb) == [("x", "m", 5)] and tiers(cb)["disk"] == 5
            with Server(tmp_path / "b", "--admin-token", "adm", env=_env(redis)) as b, \
                    httpx.Client(base_url=b.url, timeout=10) as cb:
                assert tiers(cb) == {"cpu": 0, "disk": 5, "redis": 5}
                assert _usage(cb) == [("x", "m", 5)]
                r = ca.post("/v1/admin/flush", params={"namespace": "x"}, headers=ADMIN)
                assert r.status_code == 200 and r.json()["deleted_blocks"] == 5, r.text
                r = cb.post("/v1/admin/flush", params={"namespace": "x"}, headers=ADMIN)
                assert r.status_code == 200 and r.json()["deleted_blocks"] == 5, r.text
                assert _read_chain(cb, chain, "x", "m") == 404 and _served(cb, chain, "x") == [404] * 5
                assert _usage(cb) == []
                _no_500(a)
                _no_500(b)
    finally:
        redis.kill()


def test_a_flush_takes_the_blocks_evicted_from_the_cpu_tier_into_redis_alone(tmp_path):
    """A tenant's chain written through a small CPU tier, then pushed out of it by another
    tenant's writes: Redis alone held it, no local index named it, and a flush of the
    tenant deleted nothing and left it served. Now the flush finds it in Redis."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes="1MiB", admin=True) as (redis, srv, c):
        mine = raw_chain(91, 3)
        _put_chain(c, mine, "t", "m")
        seed = 92
        while any(n["namespace"] == "t" and n["blocks"] for n in
                  c.get("/v1/admin/namespaces", headers=ADMIN).json()):
            _put_chain(c, raw_chain(seed, 4), "u", "m")  # (each write evicts t's oldest first)
            seed += 1
            assert seed < 200, "the CPU tier never let go of t's blocks"
        # (Not read meanwhile: a read would promote them into the CPU tier, owned again.)
        r = c.post("/v1/admin/flush", params={"namespace": "t"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["deleted_blocks"] == 3, r.text
        assert _served(c, mine, "t") == [404] * 3
        _no_500(srv)


def test_a_frame_another_release_wrote_to_the_shared_redis_is_a_counted_miss_and_stays(tmp_path):
    """A rolling upgrade: this server shares its Redis with another release that writes frames
    of another format version. Each is a miss here, counted in ``foreign_version`` (stats and
    /metrics), never a 500 and never deleted: deleting them, each release emptied the shared
    tier of the other's frames."""
    import prom_strict
    import redis as redis_py
    from server_helpers import raw_frame
    from store_helpers import as_other_version

    with _server_over_redis(tmp_path, cpu_bytes="0") as (redis, srv, c):
        h, frame = raw_frame(71)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        client = redis_py.Redis.from_url(redis.url)
        (name,) = [k for k in client.keys("*") if h.hex().encode() in k and b":gen:" not in k]
        theirs = as_other_version(client.get(name))
        client.set(name, theirs)
        for _ in range(2):
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404
        stats = _redis_stats(srv)
        assert stats["foreign_version"] >= 2 and stats["corrupt"] == 0
        families = prom_strict.parse(c.get("/metrics").text)
        assert prom_strict.value(families, "cacheseek_tier_foreign_version_frames_total", tier="redis") \
            == stats["foreign_version"]
        assert client.get(name) == theirs
        _no_500(srv)


def test_a_redis_value_over_the_servers_max_frame_bytes_is_a_corrupt_miss_never_read_whole(tmp_path):
    """The server hands max_frame_bytes to its Redis tier as to its disk tier: a value under a
    frame's name larger than it (damaged, or put there by hand) is a counted corrupt miss,
    deleted, not a value every read of the block takes whole (up to Redis's 512 MB)."""
    import redis as redis_py
    from server_helpers import raw_frame

    redis = RedisServer(tmp_path / "redis").start()
    try:
        env = _env(redis, CACHESEEK_MAX_FRAME_BYTES="1MiB")
        with Server(tmp_path / "s", disk=False, cpu_bytes="0", env=env) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as c:
            h, frame = raw_frame(72)
            assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
            client = redis_py.Redis.from_url(redis.url)
            (name,) = [k for k in client.keys("*") if h.hex().encode() in k and b":gen:" not in k]
            client.set(name, frame + bytes(4 << 20))
            sent = client.info("stats")["total_net_output_bytes"]
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 404
            # (what Redis sent the server for that read: at most 1 MiB and a byte of the value)
            assert client.info("stats")["total_net_output_bytes"] - sent < (1 << 20) + (256 << 10)
            assert _redis_stats(srv)["corrupt"] == 1 and client.exists(name) == 0
            _no_500(srv)
    finally:
        redis.stop()


def test_a_lookup_of_several_chains_asks_redis_for_each_block_once(tmp_path):
    """``POST /v1/lookup`` with ``chains`` asked Redis once per chain (one round trip and an
    ``EXISTS`` per block of each). Now one pipeline for all of them, each block once, with
    the answers of one lookup per chain."""
    from server_helpers import raw_chain

    with _server_over_redis(tmp_path, cpu_bytes="0") as (redis, srv, c):
        stored, other = raw_chain(95, 4), raw_chain(96, 3)
        _put_chain(c, stored, "t", "m")
        _put_chain(c, other, "t", "m")
        hexes = [[h.hex() for h, _ in chain] for chain in (stored, other, raw_chain(97, 2))]
        chains = [hexes[0], hexes[0][:2], hexes[2], hexes[1], hexes[1][:1] + hexes[2]]
        ns = {"X-CacheSeek-Namespace": "t"}
        one_each = [c.post("/v1/lookup", json={"hashes": chain}, headers=ns).json() for chain in chains]
        assert [a["matched"] for a in one_each] == [4, 2, 0, 3, 1]

        def exists_calls() -> int:
            stats = redis.cli("INFO", "commandstats")
            return sum(int(part.split("=")[1]) for line in stats.splitlines() if line.startswith("cmdstat_exists:")
                       for part in line.split(":")[1].split(",") if part.startswith("calls="))

        redis.cli("CONFIG", "RESETSTAT")
        r = c.post("/v1/lookup", json={"chains": chains}, headers=ns)
        assert r.status_code == 200, r.text
        assert [{"matched": a["matched"], "tiers": a["tiers"]} for a in r.json()["chains"]] == one_each
        assert exists_calls() == 4 + 2 + 3 < sum(map(len, chains))  # each block once
        _no_500(srv)


def test_the_start_banner_says_when_redis_could_not_be_asked_what_it_holds(tmp_path):
    """Redis down at start: the banner said "holds 0 blocks" as fact (it held 3 here)."""
    from server_helpers import raw_frame

    redis = RedisServer(tmp_path / "redis").start()
    try:
        with Server(tmp_path / "a", disk=False, cpu_bytes="0", env=_env(redis)) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as c:
            for i in range(3):
                h, frame = raw_frame(90 + i)
                assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        with Server(tmp_path / "b", disk=False, cpu_bytes="0", env=_env(redis)) as srv:
            assert "        holds 3 blocks, " in srv.output(), srv.output()
        redis.pause()
        try:
            with Server(tmp_path / "c", disk=False, cpu_bytes="0", env=_env(redis)) as srv:
                out = srv.output()
        finally:
            redis.resume()
        assert "holds 0 blocks" not in out, out
        assert "        holds ? blocks: Redis could not be asked at start (" in out, out
    finally:
        redis.kill()


def test_a_server_whose_redis_bytes_is_below_what_the_shared_redis_holds_says_so_at_start(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        with Server(tmp_path / "a", disk=False, cpu_bytes="0", env=_env(redis)) as a:
            toks, kv = tokens_for(33, 4 * BLOCK), make_kv(4 * BLOCK, 33)
            assert _remote(a).ingest(toks, kv).stored == 4
            held = _redis_stats(a)["used_bytes"]
        small = Server(tmp_path / "b", disk=False, cpu_bytes="0", env=_env(redis))
        small.args += ["--redis-bytes", str(held // 2)]
        with small as b:
            evicted = _redis_stats(b)["evictions"]
            assert 0 < evicted < 4 and _redis_stats(b)["blocks"] == 4 - evicted
            assert f"its {evicted} least recently used blocks were evicted at start, for every server sharing it" \
                   in b.output(), b.output()
    finally:
        redis.stop()


def test_a_start_without_a_kept_namespace_secret_over_redis_warns_that_named_namespaces_are_lost_at_restart(tmp_path):
    """No namespace_secret and no disk tier to keep a key: the process's random key masked its
    named namespaces' blocks in Redis, unreachable from the next start on, and nothing said so.
    A given secret, or a disk tier (its .namespace-key kept), says nothing."""
    said = "named namespaces (any namespace but the default \"\") become unreachable at its next restart"
    redis = RedisServer(tmp_path / "redis").start()
    try:
        env = {k: v for k, v in _env(redis).items() if k != "CACHESEEK_NAMESPACE_SECRET"}
        with Server(tmp_path / "a", disk=False, cpu_bytes="0", env=env) as srv:
            out = srv.output()
        assert out.count(said) == 1 and "Set namespace_secret, the same on every server sharing the Redis" in out, out
        with Server(tmp_path / "b", disk=False, cpu_bytes="0", env=_env(redis)) as srv:
            assert said not in srv.output(), srv.output()
        with Server(tmp_path / "c", env=env) as srv:  # a disk tier: its key file keeps the key
            assert said not in srv.output(), srv.output()
            assert (srv.disk_path / ".namespace-key").exists()
    finally:
        redis.kill()


def test_a_block_read_one_by_one_restarts_its_redis_expiry_and_is_not_the_lru_victim(tmp_path):
    """``GET /v1/blocks/{hash}`` marked nothing used in Redis: a block read every half second
    expired at its TTL, and one read ten times was the shared LRU's first victim."""
    blocks = [raw_frame(60 + i) for i in range(5)]
    budget = 4 * len(blocks[0][1]) + 100
    redis = RedisServer(tmp_path / "redis").start()
    try:
        env = _env(redis, CACHESEEK_REDIS_BYTES=str(budget), CACHESEEK_REDIS_TTL_SECONDS="2")
        with Server(tmp_path / "s", disk=False, cpu_bytes="0", env=env) as srv, \
                httpx.Client(base_url=srv.url, timeout=10) as c:
            for h, frame in blocks[:4]:
                assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
            for _ in range(8):  # 4 s: twice the TTL
                assert c.get(f"/v1/blocks/{blocks[0][0].hex()}").content == blocks[0][1]
                time.sleep(0.5)
            assert [c.head(f"/v1/blocks/{h.hex()}").status_code for h, _ in blocks[:4]] == [200, 404, 404, 404]
            for h, frame in blocks[1:4]:  # the budget full again
                assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
            assert c.get(f"/v1/blocks/{blocks[0][0].hex()}").status_code == 200
            assert c.put(f"/v1/blocks/{blocks[4][0].hex()}", content=blocks[4][1]).status_code == 201
            held = [c.head(f"/v1/blocks/{h.hex()}").status_code for h, _ in blocks]
            assert held == [200, 404, 200, 200, 200], held  # the least recently used went: the second
            _no_500(srv)
    finally:
        redis.kill()


def test_a_start_says_when_redis_maxmemory_is_too_small_for_redis_bytes(tmp_path):
    """Redis filled before the budget (each frame takes up to a quarter more in its allocator)
    and refused every write from then on; nothing read maxmemory to say so."""
    redis = RedisServer(tmp_path / "redis", extra=("--maxmemory", "300mb", "--maxmemory-policy", "noeviction")).start()
    try:
        with Server(tmp_path / "s", disk=False, cpu_bytes="0", env=_env(redis)) as srv:  # redis_bytes 256 MiB
            assert "redis tier: Redis's maxmemory (300 MiB) is below what redis_bytes (256 MiB) takes there" \
                   in srv.output(), srv.output()
        redis.cli("CONFIG", "SET", "maxmemory", "400mb")
        with Server(tmp_path / "t", disk=False, cpu_bytes="0", env=_env(redis)) as srv:
            assert "maxmemory" not in srv.output(), srv.output()
    finally:
        redis.kill()
