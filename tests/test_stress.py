"""Random operations from many threads on one ``PrefixCache``, then the invariants.

Threads ingest, materialize (whole, layer by layer, into pages), prefetch, delete, pin and
unpin, and abandon layer-wise saves and loads half-way, on chains that share heads, over
tiers small enough to evict and demote all along (CPU -> disk, and CPU -> disk -> Redis).
Every hit must decode to exactly what was ingested for those tokens; once the threads are
done, nothing is lent or pinned, each tier's used bytes and block counts are what its blocks
add up to, and a disk directory reopened holds only whole blocks that decode. The same with
a disk failing one write in ten, through a Redis restart, with the cache closed while the
threads work, and with chains deleted while reads promote them.
``CACHESEEK_STRESS_SEED`` and ``CACHESEEK_STRESS_ROUNDS`` vary the runs; the ``slow`` ones
run longer, with other seeds."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import cacheseek as cs
from cacheseek import layerwise_save
from cacheseek.store.lease import finalizer
from paged_helpers import engine_tensors, kv_pages, read_tokens, write_tokens
from redis_servers import RedisServer, needs_redis
from store_helpers import BLOCK, LAYOUT, make_cache, make_kv, run_threads, tokens_for

THREADS = 6
TIMEOUT_S = 120
ROUNDS = int(os.environ.get("CACHESEEK_STRESS_ROUNDS", "60"))
SEED = int(os.environ.get("CACHESEEK_STRESS_SEED", "7"))
GROUPS = 3  # chains of a group share their first two blocks
PER_GROUP = 3
HEAD, OWN = 2, 3  # blocks


def _chains() -> list[tuple[list[int], list]]:
    out = []
    for g in range(GROUPS):
        head, kv_head = tokens_for(500 + g, HEAD * BLOCK), make_kv(HEAD * BLOCK, 500 + g)
        for c in range(PER_GROUP):
            seed = 600 + g * PER_GROUP + c
            own, kv_own = tokens_for(seed, OWN * BLOCK), make_kv(OWN * BLOCK, seed)
            kv = [(torch.cat([k0, k1], dim=1), torch.cat([v0, v1], dim=1))
                  for (k0, v0), (k1, v1) in zip(kv_head, kv_own)]
            out.append((head + own, kv))
    return out


BAD = [(tokens_for(900 + i, (HEAD + OWN) * BLOCK), make_kv((HEAD + OWN) * BLOCK, 900 + i)) for i in range(2)]


def _exact(layers, kv, tokens: int) -> None:
    """``layers`` (per layer, (k, v) of [heads, tokens, dim] or with a leading batch of 1)
    are ``kv``'s first ``tokens``."""
    assert tokens % BLOCK == 0
    for (k, v), (k0, v0) in zip(layers, kv):
        k, v = (k[0], v[0]) if k.dim() == 4 else (k, v)
        assert torch.equal(k[:, :tokens].cpu(), k0[:, :tokens]), "a hit decoded to other bytes"
        assert torch.equal(v[:, :tokens].cpu(), v0[:, :tokens]), "a hit decoded to other bytes"


@pytest.fixture(autouse=True)
def saves_in_slots(monkeypatch):
    """Layer-wise saves of these small chains write into reserved CPU-tier slots, as a long
    prompt's do (else they keep the layers and ingest them whole on ``finish``)."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)


class _Ops:
    """One thread's random operations; ``pinned``: the pins it holds (unpinned at its end)."""

    def __init__(self, cache, chains, rng: random.Random, pages=None, page_ids=None) -> None:
        self.cache, self.chains, self.rng = cache, chains, rng
        self.pages, self.page_ids = pages, page_ids
        self.pinned: list[bytes] = []
        self.abandoned: list = []
        self.prefetches: list = []

    def pick(self):
        toks, kv = self.rng.choice(self.chains)
        n = self.rng.randint(1, HEAD + OWN) * BLOCK
        return toks[:n], [(k[:, :n], v[:, :n]) for k, v in kv], n

    def ingest(self) -> None:
        toks, kv, _ = self.pick()
        self.cache.ingest(toks, kv)

    def materialize(self) -> None:
        toks, kv, n = self.pick()
        got = self.cache.materialize(toks)
        assert got.num_tokens <= n
        _exact(got.layers, kv, got.num_tokens)

    def materialize_layerwise(self) -> None:
        toks, kv, n = self.pick()
        load = self.cache.materialize(toks, layerwise=True)
        if self.rng.random() < 0.3:  # abandoned after one layer: never closed, dropped
            if load.num_tokens:
                load.layer(0)
            self.abandoned.append(load)
            if len(self.abandoned) > 2:
                self.abandoned.pop(0)
            return
        with load:
            assert load.num_tokens <= n
            if load.num_tokens:
                _exact([load.layer(i) for i in range(LAYOUT.num_layers)], kv, load.num_tokens)

    def save_layerwise(self) -> None:
        toks, kv, _ = self.pick()
        writer = self.cache.ingest_layerwise(toks)
        layers = list(range(LAYOUT.num_layers))
        self.rng.shuffle(layers)
        if self.rng.random() < 0.3:  # abandoned half-way: never finished
            for i in layers[: len(layers) // 2]:
                writer.put_layer(i, *kv[i])
            self.abandoned.append(writer)
            if len(self.abandoned) > 2:
                self.abandoned.pop(0)
            return
        for i in layers:
            writer.put_layer(i, *kv[i])
        writer.finish()

    def into_pages(self) -> None:
        if self.pages is None:
            return self.materialize()
        toks, kv, n = self.pick()
        ids = self.page_ids[: n // PAGE]
        index = torch.tensor(ids)
        for side in (self.pages.k, self.pages.v):
            for t in side:
                t[index] = 7.0
        got = self.cache.materialize_into_batch([cs.PagedRequest(toks, ids)], self.pages)[0]
        m = got.num_tokens
        assert m <= n
        if m:
            _exact(read_tokens(self.pages, ids, m), kv, m)

    def ingest_pages(self) -> None:
        if self.pages is None:
            return self.ingest()
        toks, kv, n = self.pick()
        ids = self.page_ids[: n // PAGE]
        write_tokens(self.pages, kv, ids)
        self.cache.ingest_batch([cs.PagedRequest(toks, ids)], self.pages)

    def bad_ingest(self) -> None:
        """KV with a NaN in one block, of tokens no good ingest stores: refused, nothing stored
        (``BAD``'s chains are checked absent at the end)."""
        toks, kv = self.rng.choice(BAD)
        n = self.rng.randint(1, HEAD + OWN) * BLOCK
        at = self.rng.randrange(n)
        bad = [(k[:, :n].clone(), v[:, :n]) for k, v in kv]
        bad[self.rng.randrange(len(bad))][0][0, at, 0] = float("nan")
        with pytest.raises(cs.InputError):
            if self.pages is not None and self.rng.random() < 0.5:
                ids = self.page_ids[: n // PAGE]
                write_tokens(self.pages, bad, ids)
                self.cache.ingest_batch([cs.PagedRequest(toks[:n], ids)], self.pages)
            else:
                self.cache.ingest(toks[:n], bad)

    def prefetch(self) -> None:
        toks, _, _ = self.pick()
        handle = self.cache.prefetch(toks)
        if handle is not None:
            self.prefetches.append(handle)
            if self.rng.random() < 0.5:
                assert handle.wait(30)

    def delete(self) -> None:
        toks, _, n = self.pick()
        hashes = self.cache.block_hashes(toks)
        self.cache.store.delete(self.rng.choice(hashes))

    def pin(self) -> None:
        if self.pinned and self.rng.random() < 0.5:
            self.cache.store.unpin(self.pinned.pop())
            return
        toks, _, _ = self.pick()
        ttl = 0.05 if self.rng.random() < 0.3 else None  # (left to expire, racing the others' pins)
        try:
            pin = self.cache.store.pin(self.cache.block_hashes(toks)[-1], ttl_seconds=ttl)
        except cs.StorageError:
            return
        if pin is not None and ttl is None:
            self.pinned.append(pin.key)

    def locate(self) -> None:
        toks, _, n = self.pick()
        assert self.cache.locate(toks).num_tokens <= n

    OPS = ["ingest", "ingest", "materialize", "materialize", "materialize_layerwise", "save_layerwise",
           "into_pages", "ingest_pages", "prefetch", "delete", "pin", "locate", "bad_ingest"]

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            getattr(self, self.rng.choice(self.OPS))()
        for key in self.pinned:
            self.cache.store.unpin(key)
        self.pinned.clear()
        self.abandoned.clear()
        assert all(handle.wait(30) for handle in self.prefetches)


PAGE = 16


def _check_invariants(cache, disk: Path | None) -> None:
    gc.collect()  # abandoned loads and saves: what they held goes with them
    assert finalizer.settle(30)  # (given back on its thread, where the collector found them)
    store = cache.store
    store.settle_moves()
    deadline = time.monotonic() + 30  # (pins with a TTL expire on their own)
    while store.pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = cache.stats()
    assert stats["pins"] == 0
    assert stats["prefetch"]["in_flight"] == 0 and stats["prefetch"]["blocks_in_flight"] == 0
    for tier in store.tiers:
        entry = tier.stats().to_dict()
        name = entry["name"]
        assert entry["pinned_blocks"] == 0 and entry["pinned_bytes"] == 0, (name, entry)
        if tier.index_in_memory:
            keys = tier.keys()
            infos = [tier.info(k) for k in keys]
            assert all(i is not None for i in infos)
            assert entry["blocks"] == len(keys), (name, entry["blocks"], len(keys))
            assert entry["used_bytes"] == sum(i.charge for i in infos), (name, entry)
            assert entry["raw_bytes"] == sum(i.raw_nbytes for i in infos), (name, entry)
            assert entry["used_bytes"] <= entry["capacity_bytes"], (name, entry)
        for lent in ("leases_active", "leased_bytes", "held_slots", "held_bytes", "reservation_bytes",
                     "lease_double_releases"):
            assert entry.get(lent, 0) == 0, (name, lent, entry)
        for pool in ("read_buffers", "stream_buffers"):
            if pool in entry:
                assert entry[pool]["leases_active"] == 0 and entry[pool]["lease_double_releases"] == 0, (name, pool)
        if name == "redis":
            report = tier.check()
            assert report["ghosts"] == 0 and report["orphans"] == 0, report
            keys = tier.keys()
            infos = [tier.info(k) for k in keys]
            assert entry["blocks"] == len(keys) == report["ok"], (entry, report)
            assert entry["used_bytes"] == sum(i.nbytes for i in infos), entry
            assert entry["used_bytes"] <= entry["capacity_bytes"], entry
    local = [t for t in store.tiers if t.index_in_memory]
    distinct = set().union(*(t.keys() for t in local))
    assert stats["blocks"] == len(distinct)
    for pool in stats["device_staging"]:
        assert pool["lease_double_releases"] == 0
    if disk is not None:
        tier = store.tier("disk")
        frames = sorted(p for p in disk.rglob("*") if p.is_file() and p.suffix == ".frame")
        assert {bytes.fromhex(p.stem) for p in frames} == set(tier.keys())
        assert tier.stats().to_dict()["frame_bytes"] == sum(p.stat().st_size for p in frames)


def _decode_all(cache, chains) -> None:
    """Every chain's stored prefix decodes to what was ingested; nothing of a refused
    ingest's is stored."""
    for toks, kv in chains:
        got = cache.materialize(toks)
        _exact(got.layers, kv, got.num_tokens)
    for toks, _ in BAD:
        assert cache.locate(toks).num_blocks == 0, "a refused ingest left blocks stored"


CONFIGS = {
    "write-through": dict(cpu="160KiB", disk_bytes="320KiB"),
    "write-back": dict(cpu="160KiB", disk_bytes="320KiB", write_through=[]),
    "write-back+redis": dict(cpu="160KiB", disk_bytes="240KiB", write_through=[], redis_bytes="400KiB",
                             redis_breaker_base_seconds=0.2, redis_breaker_cap_seconds=0.4),
}


def _failing_disk(monkeypatch, disk: Path, seed: int, rate: float = 0.1) -> None:
    """One in ``1 / rate`` of the disk tier's new files (temp data files and sidecars) fails
    to be made, as a failing disk's EIO."""
    import errno

    rng, lock, real = random.Random(seed), threading.Lock(), os.open
    root = str(disk)

    def failing(path, flags, *args, **kw):
        if flags & os.O_CREAT and str(path).startswith(root) and "/.tmp-" in str(path):
            with lock:
                fail = rng.random() < rate
            if fail:
                raise OSError(errno.EIO, "Input/output error (injected)")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", failing)


@pytest.mark.parametrize("write_through", [None, []], ids=["write-through", "write-back"])
def test_random_operations_on_a_failing_disk_keep_the_books_true(tmp_path, monkeypatch, write_through):
    """As above, with one disk write in ten failing: the failed blocks are failed, not
    half-there; the tiers' used bytes and blocks stay what their blocks add up to."""
    chains = _chains()
    disk = tmp_path / "d"
    kw = dict(cpu="160KiB", disk_bytes="320KiB", write_through=write_through)
    cache = make_cache(disk=disk, **kw)
    _failing_disk(monkeypatch, disk, SEED)
    pages = kv_pages("nhd", engine_tensors("nhd", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                                           THREADS * (HEAD + OWN) * BLOCK // PAGE, PAGE, LAYOUT.torch_dtype,
                                           device="cpu"))
    per = (HEAD + OWN) * BLOCK // PAGE

    def worker(i: int) -> None:
        _Ops(cache, chains, random.Random(SEED * 1000 + 100 + i), pages,
             list(range(i * per, (i + 1) * per))).run(ROUNDS)

    try:
        run_threads(worker, THREADS)
        assert cache.stats()["tiers"][1]["write_errors"] > 0  # (the faults did happen)
        _check_invariants(cache, disk)
        _decode_all(cache, chains)
        assert not [p for p in disk.rglob(".tmp-*")]
    finally:
        cache.close()
    monkeypatch.undo()
    with make_cache(disk=disk, **kw) as reopened:
        _check_invariants(reopened, disk)
        _decode_all(reopened, chains)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("config", [*(c for c in CONFIGS if "redis" not in c),
                                    *(pytest.param(c, marks=needs_redis) for c in CONFIGS if "redis" in c)])
def test_random_operations_from_threads_keep_every_hit_exact_and_the_books_true(tmp_path, config, request):
    _random_operations(tmp_path, request, config, SEED, ROUNDS)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 3))
@pytest.mark.parametrize("config", [*(c for c in CONFIGS if "redis" not in c),
                                    *(pytest.param(c, marks=needs_redis) for c in CONFIGS if "redis" in c)])
def test_random_operations_longer_and_with_other_seeds(tmp_path, config, seed, request):
    _random_operations(tmp_path, request, config, SEED * 100 + seed, 5 * ROUNDS)


def _random_operations(tmp_path, request, config: str, seed: int, rounds: int) -> None:
    chains = _chains()
    disk = tmp_path / "d"
    kw = dict(CONFIGS[config])
    if "redis_bytes" in kw:
        server = request.getfixturevalue("redis_server")
        server.cli("FLUSHALL")
        kw["redis_url"] = server.url
    cache = make_cache(disk=disk, **kw)
    pages = kv_pages("nhd", engine_tensors("nhd", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                                           THREADS * (HEAD + OWN) * BLOCK // PAGE, PAGE, LAYOUT.torch_dtype,
                                           device="cpu"))
    per = (HEAD + OWN) * BLOCK // PAGE

    def worker(i: int) -> None:
        ops = _Ops(cache, chains, random.Random(seed * 1000 + i), pages, list(range(i * per, (i + 1) * per)))
        ops.run(rounds)

    try:
        run_threads(worker, THREADS)
        _check_invariants(cache, disk)
        _decode_all(cache, chains)
    finally:
        cache.close()
    reopened = make_cache(disk=disk, **kw)
    try:
        _check_invariants(reopened, disk)
        _decode_all(reopened, chains)
    finally:
        reopened.close()


@pytest.mark.parametrize("write_through", [None, []], ids=["write-through", "write-back"])
def test_a_cache_closed_while_threads_work_leaves_a_directory_that_reopens_whole(tmp_path, write_through):
    """Threads ingest, read and delete while another closes the cache: each call either
    does its work or raises ``RuntimeError`` (``StorageError`` from the store's own calls);
    none hangs. The directory then opens in a new
    cache with no torn or temporary file kept, and every block in it decodes exactly."""
    chains = _chains()
    disk = tmp_path / "d"
    kw = dict(cpu="160KiB", disk_bytes="320KiB", write_through=write_through)
    cache = make_cache(disk=disk, **kw)
    going = threading.Barrier(THREADS + 1)
    unexpected: list[BaseException] = []

    def worker(i: int) -> None:
        ops = _Ops(cache, chains, random.Random(SEED * 1000 + 50 + i))
        going.wait()
        try:
            for _ in range(1000):
                getattr(ops, ops.rng.choice(["ingest", "ingest", "materialize", "prefetch", "delete"]))()
        except (RuntimeError, cs.StorageError):
            pass  # closed under it (the store's own calls, such as a delete: "disk tier: closed")
        except BaseException as exc:  # noqa: BLE001 - reported below
            unexpected.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    going.wait()
    deadline = time.monotonic() + 30
    while cache.stats()["tiers"][1]["admissions"] < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.close()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread hung on the closed cache"
    assert not unexpected, unexpected
    reopened = make_cache(disk=disk, **kw)
    try:
        _check_invariants(reopened, disk)
        _decode_all(reopened, chains)
        assert not [p for p in disk.rglob("*") if p.is_file() and p.suffix not in (".frame", ".meta")
                    and not p.name.startswith(".")], sorted(disk.rglob("*"))
    finally:
        reopened.close()


def test_closing_waits_for_a_disk_write_in_flight_before_giving_the_directory_up(tmp_path, monkeypatch):
    """``close()`` with an ingest's disk write in flight (on the ingest's thread) returned at
    once and unlocked the directory: a second cache opened it mid-write and removed the
    half-written block as an orphan, and the ingest then failed on the closed tier's writer
    pool with a bare "cannot schedule new futures after shutdown". Now close waits for the
    write; the directory stays locked until the block is whole, and a later open finds it."""
    from cacheseek.store.disk import DiskInUse, DiskTier

    disk = tmp_path / "d"
    cache = make_cache(cpu="8MiB", disk=disk)
    toks, kv = tokens_for(1, 2 * BLOCK), make_kv(2 * BLOCK, 1)
    reached, release = threading.Event(), threading.Event()
    real = DiskTier._write_temp

    def held(self, final, segments, **kw):  # the sidecars, the commit records, wait
        if final.suffix == ".meta":
            reached.set()
            release.wait(30)
        return real(self, final, segments, **kw)

    monkeypatch.setattr(DiskTier, "_write_temp", held)
    results: list = []
    ingest = threading.Thread(target=lambda: results.append(cache.ingest(toks, kv)), daemon=True)
    ingest.start()
    assert reached.wait(30)
    closer = threading.Thread(target=cache.close, daemon=True)
    closer.start()
    closer.join(1.0)
    try:
        assert closer.is_alive(), "close() returned while a disk write was in flight"
        with pytest.raises(DiskInUse):  # (the directory is still this cache's)
            make_cache(cpu="8MiB", disk=disk)
    finally:
        release.set()
        closer.join(30)
        ingest.join(30)
    assert not closer.is_alive() and not ingest.is_alive()
    assert results and results[0].stored == 2, results
    monkeypatch.undo()
    with make_cache(cpu="8MiB", disk=disk) as reopened:
        assert reopened.locate(toks).tiers == ["disk", "disk"]
        _exact(reopened.materialize(toks).layers, kv, 2 * BLOCK)
        _check_invariants(reopened, disk)


@pytest.mark.parametrize("write_through", [None, []], ids=["write-through", "write-back"])
def test_a_deleted_chain_does_not_come_back_through_reads_promoting_it(tmp_path, write_through):
    """Threads materialize and prefetch chains held on disk only (each read promotes them
    into the CPU tier, which evicts and demotes) while another deletes them, block by block:
    once the deletes and reads are over, no tier holds any of those blocks (a promotion that
    read a block before its delete must not store it again after)."""
    chains = _chains()
    disk = tmp_path / "d"
    cache = make_cache(disk=disk, cpu="160KiB", disk_bytes="2MiB", write_through=write_through)
    try:
        for round_ in range(4):
            for toks, kv in chains:
                cache.ingest(toks, kv)
            cpu = cache.store.tier("cpu")
            for key in cpu.keys():
                if not cache.store.tier("disk").contains(key):
                    continue
                cpu.delete(key)
            doomed = [toks for toks, _ in chains[round_ % 3 :: 3]]
            keys = {k for toks in doomed for k in cache.block_hashes(toks)}
            stop = threading.Event()

            def reader(i: int) -> None:
                rng = random.Random(SEED * 1000 + 200 + round_ * 10 + i)
                while not stop.is_set():
                    toks, kv = rng.choice(chains)
                    if rng.random() < 0.5:
                        handle = cache.prefetch(toks)
                        if handle is not None:
                            assert handle.wait(30)
                    else:
                        got = cache.materialize(toks)
                        _exact(got.layers, kv, got.num_tokens)

            def deleter() -> None:
                try:
                    for key in sorted(keys):
                        assert cache.store.delete(key) is not None
                finally:
                    stop.set()

            run_threads(lambda i: deleter() if i == 0 else reader(i), THREADS)
            cache.store.settle_moves()
            back = {t.name: [k.hex()[:8] for k in keys if t.contains(k)] for t in cache.store.tiers}
            assert not any(back.values()), f"round {round_}: deleted blocks came back: {back}"
            for toks in doomed:
                assert cache.locate(toks).num_blocks == 0
            _check_invariants(cache, disk)
    finally:
        cache.close()


@needs_redis
def test_random_operations_through_a_redis_restart_keep_every_hit_exact_and_the_books_true(tmp_path, redis_server):
    """The write-back CPU -> disk -> Redis store of the first test, its Redis killed while the
    threads work and started again (empty) half-way: no call fails for it, every hit stays
    exact, and once Redis answers again its index and its frames agree."""
    redis_server.cli("FLUSHALL")
    chains = _chains()
    disk = tmp_path / "d"
    kw = dict(CONFIGS["write-back+redis"], redis_url=redis_server.url)
    cache = make_cache(disk=disk, **kw)
    done = [0] * THREADS

    def worker(i: int) -> None:
        ops = _Ops(cache, chains, random.Random(SEED * 1000 + 300 + i))
        for n in range(ROUNDS):
            getattr(ops, ops.rng.choice(ops.OPS))()
            done[i] = n + 1
        ops.run(0)

    def outage() -> None:
        deadline = time.monotonic() + 60
        while sum(done) < THREADS * ROUNDS // 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        redis_server.kill()
        while sum(done) < THREADS * ROUNDS // 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        redis_server.start()

    try:
        run_threads(lambda i: outage() if i == THREADS else worker(i), THREADS + 1)
        tier = cache.store.tier("redis")
        deadline = time.monotonic() + 30
        while tier.stats().to_dict()["breaker"]["state"] != "closed" and time.monotonic() < deadline:
            cache.locate(chains[0][0])
            time.sleep(0.05)
        figures = tier.stats().to_dict()
        assert figures["admissions"] > 0 and figures["unavailable_errors"] + figures["refused_by_breaker"] > 0
        _check_invariants(cache, disk)
        _decode_all(cache, chains)
    finally:
        cache.close()


def test_the_stores_reads_after_close_say_the_disk_tier_is_closed(tmp_path):
    """The store's own reads (the server's path: a ``PrefixCache`` refuses them before) of a
    closed disk tier raised a bare "cannot schedule new futures after shutdown"."""
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    toks, kv = tokens_for(1, 2 * BLOCK), make_kv(2 * BLOCK, 1)
    cache.ingest(toks, kv)
    keys = cache.block_hashes(toks)
    cache.close()
    with pytest.raises(cs.StorageError, match="disk tier: closed"):
        cache.store.get(keys[0])
    with pytest.raises(cs.StorageError, match="disk tier: closed"):
        cache.store.stream(keys)
    with pytest.raises(cs.StorageError, match="disk tier: closed"):
        cache.store.delete(keys[0])
