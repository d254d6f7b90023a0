import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import cacheseek as cs
from cacheseek.errors import InputError
from cacheseek.store.cpu import CpuTier
from cacheseek.store.frame import build_frame, parse_frame, plan_frame
from cacheseek.store.tier import BlockFrame
from cacheseek.units import format_size
from kivi_bounds import error_bound
from store_helpers import (BLOCK, LAYOUT, as_other_version, assert_prefix_equal, disk_charge, make_cache, make_kv,
                           tokens_for)

FRAME = LAYOUT.raw_nbytes(BLOCK) + 1024  # a Raw frame with its header, rounded up
TIER_SETUPS = {
    "cpu": dict(cpu="4MiB"),
    "disk": dict(cpu=0, disk=True),
    "cpu+disk": dict(cpu="4MiB", disk=True),
}
if torch.cuda.is_available():
    TIER_SETUPS["gpu"] = dict(gpu="4MiB", cpu=0)
    TIER_SETUPS["gpu+cpu+disk"] = dict(gpu="4MiB", cpu="4MiB", disk=True)


def _setup(tmp_path, name, **kw):
    opts = dict(TIER_SETUPS[name])
    if opts.pop("disk", False):
        opts["disk"] = tmp_path / "disk"
    return make_cache(**opts, **kw)


@pytest.mark.parametrize("setup", list(TIER_SETUPS))
def test_raw_roundtrip_is_bit_exact_through_each_tier(tmp_path, setup):
    toks, kv = tokens_for(0, 5 * BLOCK + 7), make_kv(5 * BLOCK + 7, 0)
    cache = _setup(tmp_path, setup)
    res = cache.ingest(toks, kv)
    assert (res.blocks, res.stored, res.present, res.failed, res.tokens) == (5, 5, 0, 0, 5 * BLOCK)
    assert cache.lookup(toks) == 5 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, 5 * BLOCK)
    if torch.cuda.is_available():
        got = cache.materialize(toks, device="cuda")
        assert got.layers[0][0].device.type == "cuda"
        assert_prefix_equal(got, kv, 5 * BLOCK)
    again = cache.ingest(toks, kv)
    assert (again.stored, again.present) == (0, 5)
    cache.close()
    if "disk" in setup:
        restarted = _setup(tmp_path, setup)
        assert restarted.lookup(toks) == 5 * BLOCK
        assert_prefix_equal(restarted.materialize(toks), kv, 5 * BLOCK)


def test_raw_is_exact_through_demotion_and_promotion(tmp_path):
    toks, kv = tokens_for(1, 8 * BLOCK), make_kv(8 * BLOCK, 1)
    cache = make_cache(cpu=3 * FRAME, disk=tmp_path / "d", write_through=())  # write-back: disk fills by demotion
    cache.ingest(toks, kv)
    # The head stays in the fast tier; the tail was demoted.
    assert cache.locate(toks).tiers == ["cpu"] * 3 + ["disk"] * 5
    stats = {t["name"]: t for t in cache.stats()["tiers"]}
    assert stats["disk"]["demotions"] == 5 and stats["cpu"]["evictions"] == 5
    # The write's victims went down as one group commit, their fsyncs overlapping: one by
    # one, a write-back ingest waited for three fsyncs in a row per block it evicted.
    assert stats["disk"]["group_commits"] == {"batches": 1, "frames": 5, "dir_fsyncs": 5}
    assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    # The CPU tier could not serve the 5 blocks the disk did: its misses, as a server's reads
    # count them (a PrefixCache's left it at 0).
    stats = {t["name"]: t for t in cache.stats()["tiers"]}
    assert (stats["cpu"]["hits"], stats["cpu"]["misses"]) == (3, 5)
    assert (stats["disk"]["hits"], stats["disk"]["misses"]) == (5, 0)
    # Its tail is not promoted over its own head (a tail with no head in the CPU tier).
    assert cache.locate(toks).tiers == ["cpu"] * 3 + ["disk"] * 5
    other, kv_other = tokens_for(2, 3 * BLOCK), make_kv(3 * BLOCK, 2)
    cache.ingest(other, kv_other)  # pushes the head down too
    assert cache.locate(toks).tiers == ["disk"] * 8
    assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    stats = {t["name"]: t for t in cache.stats()["tiers"]}
    assert stats["cpu"]["promotions"] == 3  # the head, over the other chain, which went down
    assert stats["cpu"]["used_bytes"] <= stats["cpu"]["capacity_bytes"]
    assert cache.locate(toks).tiers == ["cpu"] * 3 + ["disk"] * 5
    assert cache.locate(other).tiers == ["disk"] * 3
    assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    assert_prefix_equal(cache.materialize(other), kv_other, 3 * BLOCK)


def test_a_read_waits_for_a_block_on_its_way_down_instead_of_missing_it(tmp_path, monkeypatch):
    """Write-back: a put that evicts a block from the CPU tier hands it to the disk tier, and
    while that write is under way the block is in neither. A ``get`` or ``get_many`` of it
    then waits for the demotion and finds it on disk, byte for byte; once no write runs, a
    miss is answered at once."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    a, b, c = raw_frame(1), raw_frame(2), raw_frame(3)
    size = a[1].nbytes
    cpu, disk = CpuTier(2 * size), DiskTier(tmp_path / "d", 20 * size, fsync=False)
    store = TieredStore([cpu, disk])  # nothing written through: the disk fills by demotion
    store.put_many([a, b])
    entered, release = threading.Event(), threading.Event()
    real_put = disk.put_many

    def slow_put(items, **kw):  # the demotion's write, held until the readers have looked
        entered.set()
        release.wait(10)
        return real_put(items, **kw)

    monkeypatch.setattr(disk, "put_many", slow_put)
    writer = threading.Thread(target=store.put_many, args=([c],))
    writer.start()
    assert entered.wait(10)
    victim = next(item for item in (a, b) if not cpu.contains(item[0]))
    assert not disk.contains(victim[0])  # in neither tier now
    got_one, got_many = [], []
    readers = [threading.Thread(target=lambda: got_one.append(store.get(victim[0], promote=False))),
               threading.Thread(target=lambda: got_many.extend(store.get_many([victim[0]], promote=False)))]
    for r in readers:
        r.start()
    time.sleep(0.3)
    assert all(r.is_alive() for r in readers)  # waiting for the demotion, not answering a miss
    release.set()
    for r in readers + [writer]:
        r.join(10)
    want = bytes(victim[1].payload_view())
    for frame, tier in (got_one[0], got_many[0]):
        assert tier == "disk" and bytes(frame.payload_view()) == want
        frame.release()
    t0 = time.perf_counter()
    assert store.get(b"\x07" * 16) is None and store.get_many([b"\x07" * 16]) == [None]
    assert time.perf_counter() - t0 < 1.0
    store.close()


@pytest.mark.parametrize("codec", [cs.KIVI(bits=4, group_size=32), cs.KIVI(k_bits=2, v_bits=8, group_size=32)])
def test_kivi_roundtrip_within_the_codec_bound(tmp_path, codec):
    toks, kv = tokens_for(2, 4 * BLOCK), make_kv(4 * BLOCK, 2)
    first = make_cache(codec=codec, cpu="1MiB", disk=tmp_path / "d")
    first.ingest(toks, kv)
    for cache in (first, lambda: make_cache(codec=codec, cpu=0, disk=tmp_path / "d")):
        if callable(cache):
            first.close()  # one owner per directory: the restart comes after the close
            cache = cache()
        got = cache.materialize(toks)
        for (k_hat, v_hat), (k, v) in zip(got.layers, kv):
            ref_k = codec.encode(k, v)
            bk = error_bound(k, ref_k.k.scale, ref_k.k.offset, bits=codec.k_bits, group=codec.k_group, axis=-2,
                             out_dtype=k.dtype)
            bv = error_bound(v, ref_k.v.scale, ref_k.v.offset, bits=codec.v_bits, group=codec.v_group, axis=-1,
                             out_dtype=v.dtype)
            assert ((k_hat[0].double() - k.double()).abs() <= bk).all()
            assert ((v_hat[0].double() - v.double()).abs() <= bv).all()
    assert cache.stats()["compression_ratio"] == pytest.approx(
        LAYOUT.raw_nbytes(BLOCK) / (codec.encoded_nbytes(LAYOUT, BLOCK) + 1024), rel=0.05)


def test_lookup_stops_at_the_first_changed_block():
    toks, kv = tokens_for(3, 6 * BLOCK + 5), make_kv(6 * BLOCK + 5, 3)
    cache = make_cache()
    cache.ingest(toks, kv)
    assert cache.lookup(toks) == 6 * BLOCK
    changed = list(toks)
    changed[2 * BLOCK + 17] += 1
    assert cache.lookup(changed) == 2 * BLOCK
    assert cache.materialize(changed).num_tokens == 2 * BLOCK
    tail = list(toks)
    tail[-1] += 1  # inside the partial block: not keyed
    assert cache.lookup(tail) == 6 * BLOCK
    assert cache.lookup(toks[: 3 * BLOCK + 1]) == 3 * BLOCK
    assert cache.materialize(toks, max_tokens=4 * BLOCK - 1).num_tokens == 3 * BLOCK
    # any integer a caller holds, as page ids are taken (a numpy one was refused)
    np = pytest.importorskip("numpy")
    n = 4 * BLOCK - 1
    for given in (np.int64(n), np.int32(n), np.array(n), torch.tensor(n)):
        assert cache.materialize(toks, max_tokens=given).num_tokens == 3 * BLOCK, repr(given)
    for bad in (40.0, "40", True, np.bool_(True), torch.tensor(True), torch.tensor([40]), np.float64(40.0)):
        with pytest.raises(cs.InputError, match="max_tokens: expected an int"):
            cache.materialize(toks, max_tokens=bad)


def test_another_codec_model_or_namespace_gets_no_hits(tmp_path):
    toks, kv = tokens_for(4, 3 * BLOCK), make_kv(3 * BLOCK, 4)
    disk = tmp_path / "shared"
    make_cache(codec=cs.KIVI(bits=4), disk=disk).ingest(toks, kv)
    assert make_cache(codec=cs.KIVI(bits=4), cpu=0, disk=disk).lookup(toks) == 3 * BLOCK
    for other in (
        dict(codec=cs.KIVI(bits=8)),
        dict(codec=cs.KIVI(bits=4, group_size=64), block=2 * BLOCK),
        dict(codec=cs.KIVI(bits=4, stats_dtype="float32")),
        dict(codec=cs.Raw()),
        dict(codec=cs.KIVI(bits=4), model_id="other-model"),
        dict(codec=cs.KIVI(bits=4), namespace="tenant-b"),
        dict(codec=cs.KIVI(bits=4), block=2 * BLOCK),
    ):
        with make_cache(cpu=0, disk=disk, **other) as cache:
            assert cache.lookup(toks) == 0, other
            assert cache.materialize(toks).num_tokens == 0


def test_budgets_hold_and_chains_lose_their_tails_first():
    cache = make_cache(cpu=6 * FRAME)
    toks_a, kv_a = tokens_for(5, 4 * BLOCK), make_kv(4 * BLOCK, 5)
    toks_b, kv_b = tokens_for(6, 4 * BLOCK), make_kv(4 * BLOCK, 6)
    cache.ingest(toks_a, kv_a)
    cache.ingest(toks_b, kv_b)
    tier = cache.stats()["tiers"][0]
    assert tier["used_bytes"] <= tier["capacity_bytes"] and tier["blocks"] == 6 and tier["evictions"] == 2
    assert cache.lookup(toks_b) == 4 * BLOCK
    assert cache.lookup(toks_a) == 2 * BLOCK  # A's tail went, A's head is still usable
    assert_prefix_equal(cache.materialize(toks_a), kv_a, 2 * BLOCK)
    # Using A makes it recent: B's tail goes next.
    toks_c, kv_c = tokens_for(7, 2 * BLOCK), make_kv(2 * BLOCK, 7)
    cache.ingest(toks_c, kv_c)
    assert cache.lookup(toks_a) == 2 * BLOCK and cache.lookup(toks_b) == 2 * BLOCK and cache.lookup(toks_c) == 2 * BLOCK
    for _ in range(20):
        seed = 100 + _
        cache.ingest(tokens_for(seed, 3 * BLOCK), make_kv(3 * BLOCK, seed))
        tier = cache.stats()["tiers"][0]
        assert tier["used_bytes"] <= tier["capacity_bytes"]


@pytest.mark.parametrize("cpu, reserve", [(FRAME // 2, None), (FRAME * 95 // 100, None), (FRAME // 2, 2 * FRAME)])
def test_a_frame_larger_than_the_budget_is_reported_not_stored(cpu, reserve):
    """Also where the reserve a reservation may use holds the frame: its commit stored it past
    the budget (the tail of a chain, its head refused: a block that no lookup reaches)."""
    cache = make_cache(cpu=cpu, **({} if reserve is None else {"cpu_reserve_bytes": reserve}))
    res = cache.ingest(tokens_for(8, 3 * BLOCK), make_kv(3 * BLOCK, 8))
    assert (res.stored, res.failed) == (0, 3) and "exceeds the whole budget" in res.errors["cpu"]
    tier = cache.stats()["tiers"][0]
    assert tier["blocks"] == tier["used_bytes"] == 0


def test_concurrent_ingest_and_materialize_lose_nothing(tmp_path):
    cache = make_cache(cpu="64MiB", disk=tmp_path / "d")
    shared = tokens_for(9, 2 * BLOCK)
    shared_kv = make_kv(2 * BLOCK, 9)
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(6):
                seed = 1000 + w * 10 + i
                suffix = tokens_for(seed, 2 * BLOCK)
                toks = shared + suffix
                own = make_kv(2 * BLOCK, seed)
                kv = [(torch.cat([a, c], 1), torch.cat([b, d], 1)) for (a, b), (c, d) in zip(shared_kv, own)]
                cache.ingest(toks, kv)
                assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    stats = {t["name"]: t for t in cache.stats()["tiers"]}
    assert stats["cpu"]["blocks"] == 2 + 8 * 6 * 2 == stats["disk"]["blocks"]
    cache.close()
    restarted = make_cache(cpu=0, disk=tmp_path / "d")
    assert restarted.lookup(shared) == 2 * BLOCK


def _frame_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.frame"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_disk_frame_is_a_counted_miss_and_is_deleted(tmp_path, damage):
    toks, kv = tokens_for(10, 3 * BLOCK), make_kv(3 * BLOCK, 10)
    make_cache(cpu=0, disk=tmp_path / "d").ingest(toks, kv)
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    target = next(p for p in _frame_files(tmp_path / "d") if cache.store.info(bytes.fromhex(p.stem)).position == 1)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[-100] ^= 0x40
        target.write_bytes(data)
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1000])
    else:
        target.unlink()
    got = cache.materialize(toks)
    assert_prefix_equal(got, kv, BLOCK)  # the prefix ends before the damaged block
    disk = cache.stats()["tiers"][0]
    assert disk["corrupt"] == 1 and disk["blocks"] == 2
    assert not target.exists() and not target.with_suffix(".meta").exists()
    assert cache.lookup(toks) == BLOCK


def test_restart_removes_temp_files_orphans_and_bad_sidecars(tmp_path):
    toks, kv = tokens_for(11, 3 * BLOCK), make_kv(3 * BLOCK, 11)
    make_cache(cpu=0, disk=tmp_path / "d").ingest(toks, kv)
    frames = _frame_files(tmp_path / "d")
    shard = frames[0].parent
    (shard / ".tmp-deadbeef.frame-0123abcd").write_bytes(b"partial")
    orphan = shard / ("ab" * 16 + ".frame")
    orphan.write_bytes(b"no sidecar")
    frames[1].with_suffix(".meta").write_bytes(b"\xc1garbage")
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    removed = cache.stats()["tiers"][0]["removed_at_start"]
    assert removed == {"temp": 1, "orphan": 1, "bad_sidecar": 1}
    assert not orphan.exists() and not frames[1].exists()
    assert cache.store.tier("disk").check() == {"ok": 2, "corrupt": 0, "unreadable": 0, "other_version": 0}


def test_restart_touches_nothing_the_tier_did_not_write(tmp_path):
    """A disk path pointed at a folder in use, a shard symlinked elsewhere, odd entries in a
    shard: recovery removes only the tier's own files, and none of them stops the start."""
    root, elsewhere = tmp_path / "d", tmp_path / "elsewhere"
    toks, kv = tokens_for(13, 2 * BLOCK), make_kv(2 * BLOCK, 13)
    make_cache(cpu=0, disk=root).ingest(toks, kv)
    shard = _frame_files(root)[0].parent
    theirs = [root / "go" / "main.meta", root / "go" / "scene.frame", root / "go" / ".tmp-build",
              elsewhere / "a.meta", elsewhere / "video.frame", elsewhere / ".tmp-upload", shard / "notes.txt",
              shard / "frame.frame"]
    for path in theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the cache's")
    (root / "ee").rmdir()
    (root / "ee").symlink_to(elsewhere)
    (shard / ("cd" * 16 + ".meta")).mkdir()  # a directory named as a sidecar
    (shard / ".tmp-whatever").mkdir()
    cache = make_cache(cpu=0, disk=root)
    assert cache.stats()["tiers"][0]["removed_at_start"] == {"temp": 0, "orphan": 0, "bad_sidecar": 0}
    assert all(path.read_bytes() == b"not the cache's" for path in theirs)
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)


def test_a_restart_orders_each_chain_tail_first_for_eviction(tmp_path):
    """The sidecars' times make a chain's head its oldest block; indexed in that order, every
    eviction after a restart walked the whole chain to its tail (quadratic in its length).
    Recovery orders a chain as ``touch_chain`` leaves it: the policy's first pick is a leaf."""
    import os

    from cacheseek.store.disk import DiskTier

    toks, kv = tokens_for(15, 12 * BLOCK), make_kv(12 * BLOCK, 15)
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    cache.ingest(toks, kv)
    keys = cache.block_hashes(toks)
    cache.close()
    tier = DiskTier(tmp_path / "d", 1 << 30)
    try:
        for i, key in enumerate(keys):  # the head oldest, as a chain written head first leaves it
            os.utime(tier._paths(key)[1], (1_000_000 + i, 1_000_000 + i))
    finally:
        tier.close()
    tier = DiskTier(tmp_path / "d", 1 << 30)
    try:
        assert tier._index._pick() == tier._index.victim()  # a leaf at once: no walk
        frame_bytes = tier.stats().used_bytes // 12
    finally:
        tier.close()
    half = DiskTier(tmp_path / "d", 6 * frame_bytes)
    try:
        assert half.contains_many(keys) == [True] * 6 + [False] * 6  # the tail went, the head stayed
    finally:
        half.close()


def test_a_sidecar_that_is_not_the_tiers_is_dropped_at_start_and_never_indexed(tmp_path):
    import msgpack

    toks, kv = tokens_for(14, 3 * BLOCK), make_kv(3 * BLOCK, 14)
    make_cache(cpu=0, disk=tmp_path / "d").ingest(toks, kv)
    sidecars = sorted(p.with_suffix(".meta") for p in _frame_files(tmp_path / "d"))
    side = msgpack.unpackb(sidecars[0].read_bytes())
    sidecars[0].write_bytes(msgpack.packb({**side, "parent": 1 << 50}))  # a length, not a hash
    side = msgpack.unpackb(sidecars[1].read_bytes())
    sidecars[1].write_bytes(msgpack.packb({**side, "pos": -1}))
    # A whole block moved into another shard: its sidecar names a hash that shard cannot hold.
    key = msgpack.unpackb(sidecars[2].read_bytes())["hash"]
    other = sidecars[2].parent.parent / ("00" if key.hex()[:2] != "00" else "01")
    other.mkdir(exist_ok=True)
    for path in (sidecars[2], sidecars[2].with_suffix(".frame")):
        path.rename(other / path.name)
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    stats = cache.stats()["tiers"][0]
    assert stats["blocks"] == 0 and stats["used_bytes"] == 0
    assert stats["removed_at_start"]["bad_sidecar"] == 3
    assert not any((tmp_path / "d").rglob("*.meta"))


@pytest.mark.parametrize("stray", ["file", "dangling symlink"])
def test_a_file_where_a_shard_directory_goes_stops_the_start_naming_it(tmp_path, stray):
    """A regular file (or a link to nothing) named ``00`` in the disk path: every write of a
    block whose hash began with 00 failed for good, and the start said nothing. The start
    now fails naming it, and it is left as it was."""
    root = tmp_path / "d"
    toks, kv = tokens_for(17, 2 * BLOCK), make_kv(2 * BLOCK, 17)
    make_cache(cpu=0, disk=root).ingest(toks, kv)
    shutil.rmtree(root / "00")
    if stray == "file":
        (root / "00").write_bytes(b"someone's notes")
    else:
        (root / "00").symlink_to(tmp_path / "nowhere")
    with pytest.raises(cs.StorageError, match=r"d/00 is in the way of a shard directory"):
        make_cache(cpu=0, disk=root)
    assert (root / "00").read_bytes() == b"someone's notes" if stray == "file" else (root / "00").is_symlink()
    (root / "00").unlink()
    cache = make_cache(cpu=0, disk=root)  # the lock was given back; the blocks are all there
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)


def test_a_restart_leaves_another_format_versions_blocks_alone(tmp_path, caplog):
    """A rollback, or two releases taking turns over one directory: blocks whose sidecars
    carry another version are neither indexed nor deleted (they were, as bad sidecars, and
    the other release lost its cache); the log says so once, naming the directory."""
    import msgpack

    toks, kv = tokens_for(16, 3 * BLOCK), make_kv(3 * BLOCK, 16)
    make_cache(cpu=0, disk=tmp_path / "d").ingest(toks, kv)
    sidecars = sorted(p.with_suffix(".meta") for p in _frame_files(tmp_path / "d"))
    theirs = {}
    for path, version in zip(sidecars[:2], (2, 0)):
        side = msgpack.unpackb(path.read_bytes())
        path.write_bytes(msgpack.packb({**side, "v": version, "added_in_that_version": 1}))
        theirs[path] = path.read_bytes()
        theirs[path.with_suffix(".frame")] = path.with_suffix(".frame").read_bytes()
    with caplog.at_level("WARNING", logger="cacheseek.store"):
        cache = make_cache(cpu=0, disk=tmp_path / "d")
    assert all(path.exists() and path.read_bytes() == body for path, body in theirs.items())
    stats = cache.stats()["tiers"][0]
    assert stats["blocks"] == 1 and stats["other_version_at_start"] == 2
    assert stats["removed_at_start"] == {"temp": 0, "orphan": 0, "bad_sidecar": 0}
    warned = [r.getMessage() for r in caplog.records if "another format version" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "d") in warned[0] and "2 blocks" in warned[0]


def test_a_disk_frame_of_another_format_version_is_a_counted_miss_kept_until_written_again(tmp_path):
    """A downgrade over one directory: a newer release wrote a frame of its own format version
    (its sidecar still of this one). Read here, it was damage: both files deleted, and the
    newer release, back, had lost them. Now it is a counted miss (``foreign_version``), its
    files kept and charged to the budget, out of the index (read once, not again at every
    request: lookups stop at it), and written over when this release stores the block."""
    import msgpack

    root = tmp_path / "d"
    toks, kv = tokens_for(23, 3 * BLOCK), make_kv(3 * BLOCK, 23)
    first = make_cache(cpu=0, disk=root)
    first.ingest(toks, kv)
    hashes = first.block_hashes(toks)
    first.close()
    frame_path = next(p for p in _frame_files(root) if p.stem == hashes[1].hex())
    side_path = frame_path.with_suffix(".meta")
    theirs = as_other_version(frame_path.read_bytes())
    frame_path.write_bytes(theirs)
    side_path.write_bytes(msgpack.packb({**msgpack.unpackb(side_path.read_bytes()), "nbytes": len(theirs)}))
    cache = make_cache(cpu=0, disk=root)
    assert cache.lookup(toks) == 3 * BLOCK  # (a sidecar of this version: indexed at start)
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    stats = cache.stats()["tiers"][0]
    assert (stats["foreign_version"], stats["corrupt"]) == (1, 0)
    assert frame_path.read_bytes() == theirs and side_path.exists()
    assert stats["other_version_blocks"] == 1 and stats["other_version_bytes"] == disk_charge(len(theirs))
    assert stats["blocks"] == 2 and cache.lookup(toks) == BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    assert cache.stats()["tiers"][0]["foreign_version"] == 1  # not read again
    cache.ingest(toks, kv)  # this release's frame of the block, over the other one's
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
    stats = cache.stats()["tiers"][0]
    assert stats["other_version_blocks"] == stats["other_version_bytes"] == 0 and stats["blocks"] == 3
    assert parse_frame(frame_path.read_bytes()).block_hash == hashes[1]


def test_a_disk_check_reports_a_frame_of_another_format_version_and_its_fix_keeps_it(tmp_path):
    """``check(fix=True)`` dropped another release's frame as corrupt, as reads did: it is
    reported apart now (``other_version``) and kept; the fix only sets it aside."""
    import msgpack

    root = tmp_path / "d"
    toks, kv = tokens_for(26, 2 * BLOCK), make_kv(2 * BLOCK, 26)
    first = make_cache(cpu=0, disk=root)
    first.ingest(toks, kv)
    hashes = first.block_hashes(toks)
    first.close()
    frame_path = next(p for p in _frame_files(root) if p.stem == hashes[1].hex())
    side_path = frame_path.with_suffix(".meta")
    theirs = as_other_version(frame_path.read_bytes())
    frame_path.write_bytes(theirs)
    side_path.write_bytes(msgpack.packb({**msgpack.unpackb(side_path.read_bytes()), "nbytes": len(theirs)}))
    cache = make_cache(cpu=0, disk=root)
    tier = cache.store.tier("disk")
    assert tier.check(fix=True) == {"ok": 1, "corrupt": 0, "unreadable": 0, "other_version": 1}
    assert frame_path.read_bytes() == theirs and side_path.exists()
    assert cache.lookup(toks) == BLOCK and cache.stats()["tiers"][0]["other_version_blocks"] == 1
    assert tier.check() == {"ok": 1, "corrupt": 0, "unreadable": 0, "other_version": 0}


def test_blocks_of_another_format_version_are_charged_and_evicted_first(tmp_path):
    """Blocks another release left in the directory (sidecars of another version) are left
    alone, but no longer outside the budget for good: they count in it, and are the first
    to go when room is needed, before any block this release reads. Uncounted, the
    directory held them on top of disk_bytes until someone removed them by hand."""
    import msgpack

    root = tmp_path / "d"
    toks, kv = tokens_for(24, 3 * BLOCK), make_kv(3 * BLOCK, 24)
    first = make_cache(cpu=0, disk=root)
    first.ingest(toks, kv)
    held = first.stats()["tiers"][0]["used_bytes"]
    first.close()
    sidecars = sorted(p.with_suffix(".meta") for p in _frame_files(root))
    for path in sidecars[:2]:
        path.write_bytes(msgpack.packb({**msgpack.unpackb(path.read_bytes()), "v": 2}))
    kept = sidecars[2]
    cache = make_cache(cpu=0, disk=root, disk_bytes=held)  # room for the three, no more
    assert cache.stats()["tiers"][0]["blocks"] == 1
    assert all(p.exists() and p.with_suffix(".frame").exists() for p in sidecars)
    before = cache.stats()["tiers"][0]
    other, other_kv = tokens_for(25, 2 * BLOCK), make_kv(2 * BLOCK, 25)
    cache.ingest(other, other_kv)
    assert_prefix_equal(cache.materialize(other), other_kv, 2 * BLOCK)
    assert not any(p.exists() or p.with_suffix(".frame").exists() for p in sidecars[:2])
    assert kept.exists() and bytes.fromhex(kept.stem) in cache.store.tier("disk").keys()
    assert before["other_version_blocks"] == 2 and before["used_bytes"] + before["other_version_bytes"] == held
    stats = cache.stats()["tiers"][0]
    assert stats["other_version_blocks"] == 0 and stats["other_version_evicted"] == 2
    assert stats["used_bytes"] <= held


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda kv, toks: (toks, kv[:2]), "layers"),
        (lambda kv, toks: (toks, [(k[:1], v[:1]) for k, v in kv]), "shape"),
        (lambda kv, toks: (toks, [(k.float(), v.float()) for k, v in kv]), "dtype"),
        (lambda kv, toks: (toks[:-1], kv), "token_ids"),
        (lambda kv, toks: ([], kv), "empty"),
        (lambda kv, toks: (toks, []), "no layers"),
        (lambda kv, toks: (toks, [(k, v[:, :-1]) for k, v in kv]), "tokens"),
        (lambda kv, toks: (toks, [(k.unsqueeze(0).expand(2, -1, -1, -1), v) for k, v in kv]), "batch size"),
        (lambda kv, toks: (toks, "kv"), "DynamicCache"),
        (lambda kv, toks: ([b"x"] * 5, kv), "block_keys"),
        (lambda kv, toks: (toks, [(k.to("meta"), v.to("meta")) for k, v in kv]), "meta"),
    ],
)
def test_bad_input_raises_and_changes_nothing(tmp_path, bad, match):
    toks, kv = tokens_for(12, 4 * BLOCK), make_kv(4 * BLOCK, 12)
    cache = make_cache(disk=tmp_path / "d")
    cache.ingest(toks[: 2 * BLOCK], [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv])
    before = cache.stats()
    with pytest.raises(InputError, match=match):
        cache.ingest(*bad(kv, toks))
    assert cache.stats() == before


def test_nan_anywhere_stores_nothing(tmp_path):
    toks, kv = tokens_for(13, 4 * BLOCK), make_kv(4 * BLOCK, 13)
    kv[2][1][1, 3 * BLOCK + 5, 7] = float("nan")  # in the last block only
    cache = make_cache(codec=cs.KIVI(bits=4), disk=tmp_path / "d")
    with pytest.raises(InputError, match="NaN"):
        cache.ingest(toks, kv)
    assert cache.lookup(toks) == 0 and cache.stats()["used_bytes"] == 0


def test_block_keys_and_batched_shapes():
    cache = make_cache()
    kv = make_kv(3 * BLOCK, 14)
    keys = [b"frame-0", b"frame-1+action", b"frame-2"]
    res = cache.ingest(keys, [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv])
    assert res.stored == 3
    assert cache.lookup(keys) == 3 * BLOCK
    assert cache.lookup([b"frame-0", b"other"]) == BLOCK
    assert_prefix_equal(cache.materialize(keys[:2]), kv, 2 * BLOCK)


def test_ingest_takes_an_hf_dynamic_cache():
    transformers = pytest.importorskip("transformers")
    toks, kv = tokens_for(15, 2 * BLOCK), make_kv(2 * BLOCK, 15)
    hf = transformers.DynamicCache()
    for i, (k, v) in enumerate(kv):
        hf.update(k.unsqueeze(0), v.unsqueeze(0), i)
    cache = make_cache()
    assert cache.ingest(toks, hf).stored == 2
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)


def test_ingest_takes_the_self_attention_part_of_an_encoder_decoder_cache():
    """transformers 4 hands GPTBigCode (a decoder-only model) an EncoderDecoderCache: every
    prefill_with_reuse of it ran the whole forward, then ingest refused the cache."""
    transformers = pytest.importorskip("transformers")
    toks, kv = tokens_for(16, 2 * BLOCK), make_kv(2 * BLOCK, 16)
    self_part, cross = transformers.DynamicCache(), transformers.DynamicCache()
    for i, (k, v) in enumerate(kv):
        self_part.update(k.unsqueeze(0), v.unsqueeze(0), i)
    cache = make_cache()
    assert cache.ingest(toks, transformers.EncoderDecoderCache(self_part, cross)).stored == 2
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)
    for i, (k, v) in enumerate(kv):  # cross-attention KV (an encoder-decoder model's): not a prefix's
        cross.update(k.unsqueeze(0), v.unsqueeze(0), i)
    with pytest.raises(cs.InputError, match="^kv: an encoder-decoder cache with cross-attention KV"):
        cache.ingest(tokens_for(17, 2 * BLOCK), transformers.EncoderDecoderCache(self_part, cross))


def test_cpu_slots_being_read_are_never_reused():
    tier = CpuTier(2 * FRAME)
    meta = plan_frame(block_hash=b"\x01" * 16, parent_hash=b"\x00" * 16, position=0, layout=LAYOUT,
                      block_tokens=BLOCK, codec=cs.Raw().spec(),
                      buffers=[("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))])
    half = meta.tensors[0].nbytes
    first = build_frame(meta, [b"\x11" * half, b"\x22" * half])
    tier.put(b"\x01" * 16, BlockFrame(meta, host=memoryview(first)))
    reader = tier.get(b"\x01" * 16)  # a reader holds a lease on the slot
    held = reader.host
    snapshot = bytes(held)
    for i in range(2, 8):  # churn far past the budget
        key = bytes([i]) * 16
        meta_i = plan_frame(block_hash=key, parent_hash=b"\x00" * 16, position=0, layout=LAYOUT,
                            block_tokens=BLOCK, codec=cs.Raw().spec(),
                            buffers=[("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))])
        tier.put(key, BlockFrame(meta_i, host=memoryview(build_frame(meta_i, [bytes([i]) * half] * 2))))
    assert bytes(held) == snapshot
    assert tier.stats().extra["held_slots"] == 1 and tier.stats().extra["leases_active"] == 1
    reader.release()
    assert tier.stats().extra["held_slots"] == 0 and tier.stats().extra["leased_bytes"] == 0
    tier.put(b"\x09" * 16, BlockFrame(meta_i, host=memoryview(build_frame(meta_i, [b"\x09" * half] * 2))))


def _sealed(key: bytes, fill: int) -> tuple[object, bytearray]:
    meta = plan_frame(block_hash=key, parent_hash=b"\x00" * 16, position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(),
                      buffers=[("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))])
    half = meta.tensors[0].nbytes
    frame = build_frame(meta, [bytes([fill]) * half] * 2)
    return parse_frame(frame), frame


def _tier_state(tier: CpuTier) -> dict:
    return tier.stats().to_dict()


def test_a_reservation_changes_nothing_until_committed_and_nothing_when_aborted():
    tier = CpuTier(4 * FRAME)
    meta0, frame0 = _sealed(b"\x10" * 16, 0x10)
    assert tier.reserve(len(frame0)) is None  # no memory mapped yet: reserving never grows the arena
    tier.put(b"\x10" * 16, BlockFrame(meta0, host=memoryview(frame0)))
    before = _tier_state(tier)
    meta, frame = _sealed(b"\x11" * 16, 0x11)
    res = tier.reserve(len(frame))
    res.view()[: len(frame) - 5] = frame[:-5]  # a body cut short
    lent = _tier_state(tier)
    assert lent.pop("reservation_bytes") >= len(frame) and tier.info(b"\x11" * 16) is None
    assert lent == {k: v for k, v in before.items() if k != "reservation_bytes"}
    tier.abort(res)
    tier.abort(res)  # idempotent
    assert _tier_state(tier) == before  # the slot is free again

    res = tier.reserve(len(frame))
    res.view()[:] = frame
    result = tier.commit(b"\x11" * 16, res, meta)
    assert bytes(result.stored.host) == bytes(frame) and not result.evicted
    assert bytes(tier.get(b"\x11" * 16).host) == bytes(frame)
    after = _tier_state(tier)
    assert after["blocks"] == 2 and after["bytes_in"] == before["bytes_in"] + len(frame)
    tier.abort(res)  # after a commit: nothing
    assert tier.get(b"\x11" * 16) is not None
    with pytest.raises(RuntimeError, match="already"):
        res.view()


def test_reservations_never_evict_and_commits_make_room_as_put_does():
    tier = CpuTier(3 * FRAME)
    frames = [_sealed(bytes([i]) * 16, i) for i in range(1, 6)]
    for meta, frame in frames[:2]:
        tier.put(meta.block_hash, BlockFrame(meta, host=memoryview(frame)))
    meta, frame = frames[2]
    res = tier.reserve(len(frame))
    assert res is not None
    assert tier.reserve(len(frame)) is None  # the budget counts the reservation: no room without evicting
    # put does not count reservations: it fills the budget, and the commit makes room.
    tier.put(frames[3][0].block_hash, BlockFrame(frames[3][0], host=memoryview(frames[3][1])))
    res.view()[:] = frame
    result = tier.commit(meta.block_hash, res, meta)
    assert result.stored is not None and [k for k, _ in result.evicted] == [frames[0][0].block_hash]
    assert tier.stats().used_bytes <= tier.capacity_bytes
    # A key stored while its frame was being received keeps its stored frame.
    meta4, frame4 = frames[4]
    assert tier.delete(frames[1][0].block_hash)
    res = tier.reserve(len(frame4))
    tier.put(meta4.block_hash, BlockFrame(meta4, host=memoryview(frame4)))
    res.view()[:] = frame4
    assert tier.commit(meta4.block_hash, res, meta4).stored is None
    assert tier.stats().extra["held_slots"] == 0


def test_a_full_tier_lends_its_reserve_and_evicts_only_at_commit():
    tier = CpuTier(3 * FRAME, reserve_bytes=2 * FRAME)
    frames = [_sealed(bytes([i]) * 16, i) for i in range(1, 8)]
    for meta, frame in frames[:3]:
        tier.put(meta.block_hash, BlockFrame(meta, host=memoryview(frame)))
    full = _tier_state(tier)
    assert full["used_bytes"] > 2 * FRAME  # no room left in the budget
    (m1, f1), (m2, f2), (m3, f3) = frames[3:6]
    a, b = tier.reserve(len(f1)), tier.reserve(len(f2))
    assert a is not None and b is not None  # from the reserve: nothing evicted for them
    assert tier.reserve(len(f3)) is None  # the reserve is used up
    lent = _tier_state(tier)
    assert lent.pop("reservation_bytes") >= len(f1) + len(f2)
    assert {k: v for k, v in lent.items() if k not in ("arena_bytes",)} == {
        k: v for k, v in full.items() if k not in ("arena_bytes", "reservation_bytes")}
    tier.abort(b)  # a bad frame: changes nothing stored
    a.view()[:] = f1
    result = tier.commit(m1.block_hash, a, m1)
    assert result.stored is not None and [k for k, _ in result.evicted] == [frames[0][0].block_hash]
    state = _tier_state(tier)
    assert state["used_bytes"] <= tier.capacity_bytes and state["reservation_bytes"] == 0
    assert state["arena_bytes"] <= tier.capacity_bytes + tier.reserve_bytes + (1 << 20)
    assert bytes(tier.get(m1.block_hash).host) == bytes(f1)


def test_a_committed_reservation_is_written_through(tmp_path):
    store = cs.TierConfig(cpu_bytes=4 * FRAME, disk_path=tmp_path / "d", pin_memory=False).build()
    meta0, frame0 = _sealed(b"\x20" * 16, 0x20)
    store.put(meta0.block_hash, BlockFrame(meta0, host=memoryview(frame0)))
    meta, frame = _sealed(b"\x21" * 16, 0x21)
    res = store.reserve(len(frame))
    res.view()[:] = frame
    outcome = store.commit(meta.block_hash, res, meta)
    assert outcome.stored and not outcome.errors
    assert bytes(store.tier("disk").get(meta.block_hash).to_bytes()) == bytes(frame)
    assert cs.TierConfig(cpu_bytes=0, disk_path=tmp_path / "e").build().reserve(len(frame)) is None  # disk on top


def test_unwritable_disk_is_reported_and_the_cache_keeps_serving(tmp_path):
    root = tmp_path / "d"
    cache = make_cache(cpu="4MiB", disk=root)
    shutil.rmtree(root)
    root.write_text("the disk tier's directory is gone")
    toks, kv = tokens_for(16, 2 * BLOCK), make_kv(2 * BLOCK, 16)
    res = cache.ingest(toks, kv)
    # Not on disk, so not acknowledged (the store's level is "durable"); memory still serves it.
    assert res.durability == "durable" and res.stored == 0 and res.failed == 2 and "disk" in res.errors
    assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)
    assert cache.stats()["tiers"][1]["write_errors"] == 2


@pytest.mark.slow
def test_disk_full_is_reported_and_the_cache_keeps_serving(tmp_path):
    # A real EFBIG from the kernel: the file-size limit stops every frame write.
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from store_helpers import make_cache, make_kv, tokens_for, assert_prefix_equal, BLOCK
        cache = make_cache(cpu="4MiB", disk={str(tmp_path / 'd')!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        toks, kv = tokens_for(17, 3 * BLOCK), make_kv(3 * BLOCK, 17)
        res = cache.ingest(toks, kv)
        assert res.stored == 0 and res.failed == 3 and "disk" in res.errors, res
        assert "File too large" in res.errors["disk"], res.errors
        assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
        disk = cache.stats()["tiers"][1]
        assert disk["write_errors"] == 3 and disk["blocks"] == 0, disk
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert not list((tmp_path / "d").glob("*/.tmp-*"))


@pytest.mark.parametrize("group_commit", [True, False])
def test_a_write_that_finds_the_disk_full_and_goes_again_is_no_write_error(tmp_path, group_commit):
    """On ENOSPC the budget comes down and the write goes again, evicting: a frame stored
    on its second try did not fail (``write_errors`` counts frames a tier failed to store:
    a group commit counted every frame of the batch, all stored); one that fails again
    counts once."""
    import errno

    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame

    class FillingDisk(DiskTier):
        full = 0  # writes still to fail with ENOSPC

        def _write_temp(self, final, segments, *, sync=True):
            if self.full:
                self.full -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return super()._write_temp(final, segments, sync=sync)

    tier = FillingDisk(tmp_path, 1 << 20, fsync=False, group_commit=group_commit)
    try:
        tier.put_many([raw_frame(i) for i in range(6)])
        tier.full = 4 if group_commit else 1  # the first try of each frame of a batch; of one frame
        results = tier.put_many([raw_frame(i) for i in range(10, 14)])
        assert [r.error for r in results] == [None] * 4 and all(r.stored is not None for r in results)
        stats = tier.stats()
        assert stats.write_errors == 0 and stats.blocks == 6
        tier.full = 1 << 30  # full for good: each frame fails twice, and counts once
        results = tier.put_many([raw_frame(20), raw_frame(21)])
        assert all(r.error is not None for r in results)
        assert tier.stats().write_errors == 2
    finally:
        tier.close()


def test_a_put_that_waited_on_a_write_stored_on_its_second_try_answers_present(tmp_path):
    """A put of a block whose write is in flight answers as that write ended. One the
    filesystem had no room for goes again and stores the block: the puts that waited on its
    first try answered "failed" for a block on disk. In one batch (the block twice) and from
    two threads, on real files."""
    import errno

    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame

    class FillingDisk(DiskTier):
        full = 0  # writes still to fail with ENOSPC
        first_try = None  # (entered, waiter_waits): the first try holds until the other put waits

        def _write_temp(self, final, segments, *, sync=True):
            if self.first_try is not None:
                entered, waiter_waits = self.first_try
                self.first_try = None
                entered.set()
                assert waiter_waits.wait(10)
            if self.full:
                self.full -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return super()._write_temp(final, segments, sync=sync)

        def _await(self, key, pending):
            self.waiting.set()
            return super()._await(key, pending)

    tier = FillingDisk(tmp_path, 1 << 20, fsync=False)
    tier.waiting = threading.Event()
    try:
        tier.put_many([raw_frame(i) for i in range(6)])  # (victims for the tries that go again)
        key, frame = raw_frame(30)
        tier.full = 1
        results = tier.put_many([(key, frame), (key, frame)])
        assert [r.error for r in results] == [None, None], results
        assert tier.contains(key) and tier.stats().write_errors == 0

        key, frame = raw_frame(31)
        entered = threading.Event()
        tier.first_try, tier.full = (entered, tier.waiting), 1
        tier.waiting.clear()
        answers = {}
        writer = threading.Thread(target=lambda: answers.setdefault("writer", tier._put_result(key, frame)))
        writer.start()
        assert entered.wait(10)
        answers["waiter"] = tier._put_result(key, frame)
        writer.join(10)
        assert {name: r.error for name, r in answers.items()} == {"writer": None, "waiter": None}, answers
        assert tier.contains(key) and tier.get(key) is not None and tier.stats().write_errors == 0
    finally:
        tier.close()


def test_a_batch_whose_retry_finds_its_block_stored_by_a_waiter_answers_present(tmp_path):
    """A group commit's frame the filesystem had no room for goes again; meanwhile a put in
    another thread that waited on its first try stored the block itself. Exactly one of the
    two answers "stored": the batch's retry found the block present (it answered "stored"
    too, whatever its retry found). On real files."""
    import errno

    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame

    key, frame = raw_frame(40)

    class FillingDisk(DiskTier):
        def _write_temp(self, final, segments, *, sync=True):
            if final.name == f"{key.hex()}.frame" and not self.failed.is_set():
                assert self.waiting.wait(10)  # the other put waits on this first try
                self.failed.set()
                raise OSError(errno.ENOSPC, "No space left on device")
            return super()._write_temp(final, segments, sync=sync)

        def _await(self, k, pending):
            self.waiting.set()
            return super()._await(k, pending)

        def _refit(self, *, at_start=False, full=False):
            if full:
                assert self.waiter_done.wait(10)  # its retry comes once the waiter stored it
            super()._refit(at_start=at_start, full=full)

    tier = FillingDisk(tmp_path, 1 << 20, fsync=False)
    tier.waiting, tier.failed, tier.waiter_done = threading.Event(), threading.Event(), threading.Event()
    try:
        answers = {}
        batch = threading.Thread(target=lambda: answers.setdefault("batch", tier.put_many([(key, frame), raw_frame(41)])))
        batch.start()
        while not tier._writing.get(key):
            time.sleep(0.001)
        answers["waiter"] = tier._put_result(key, frame)
        tier.waiter_done.set()
        batch.join(10)
        assert not batch.is_alive()
        outcomes = [answers["batch"][0], answers["waiter"]]
        assert [r.error for r in outcomes] == [None, None], outcomes
        assert sum(r.stored is not None for r in outcomes) == 1, outcomes
        stats = tier.stats()
        assert stats.admissions == 2 and stats.blocks == 2 and stats.write_errors == 0
    finally:
        tier.close()


def test_tier_config_errors_name_the_setting(tmp_path):
    with pytest.raises(cs.ConfigError, match="no tier"):
        make_cache(cpu=0)
    with pytest.raises(cs.ConfigError, match="cpu_bytes"):
        make_cache(cpu="lots")
    with pytest.raises(cs.ConfigError, match="write_through"):
        make_cache(cpu="1MiB", write_through=("cpu",))
    with pytest.raises(cs.ConfigError, match="block_tokens"):
        make_cache(codec=cs.KIVI(group_size=64), block=32)
    for bad in (5, b"/tmp/x", ""):  # (a number raised TypeError; an empty path meant the current directory)
        with pytest.raises(cs.ConfigError, match="disk_path"):
            make_cache(cpu=0, disk=bad)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(cs.StorageError, match="cannot create"):
        make_cache(disk=blocker / "sub")


def test_a_gpu_tier_where_torch_sees_no_such_cuda_device_is_a_config_error(tmp_path, monkeypatch):
    """The README's example run as shown on a machine without a GPU (``gpu_bytes="8GiB"``,
    torch's CPU build) raised ``AssertionError: Torch not compiled with CUDA enabled`` from
    inside torch: a ``ConfigError`` naming ``gpu_bytes`` and what to do, before any tier is
    made; so is a ``gpu_device`` past the devices torch sees."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(cs.ConfigError, match="gpu_bytes: .* no CUDA device .* gpu_bytes=0"):
        make_cache(gpu="64MiB", cpu="1MiB", disk=tmp_path / "d")
    assert not (tmp_path / "d").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(cs.ConfigError, match="gpu_device: 'cuda:1' .* 1 CUDA device"):
        make_cache(gpu="64MiB", gpu_device="cuda:1")
    with pytest.raises(cs.ConfigError, match="gpu_device"):
        make_cache(gpu="64MiB", gpu_device="not-a-device")


def test_a_cpu_tier_over_the_memory_the_process_may_use_is_a_config_error(tmp_path, monkeypatch):
    """The server refused such a budget, the library took it: the tier's memory is mapped
    lazily, so ``cpu_bytes="64GiB"`` on a 24 GiB host built, and the process was killed for
    memory once traffic filled it. Refused now, in the server's words, before any tier is
    made; a budget that fits (with its reserve) exactly is built and stores."""
    from cacheseek.host_memory import memory_limit
    from cacheseek.store import cpu as cpu_module

    limit, where = memory_limit()
    assert limit > 0, where  # (Linux: the machine's memory, or its cgroup's limit)
    made = []

    class Recorded(cpu_module.CpuTier):
        def __init__(self, capacity_bytes, **kw):
            made.append(capacity_bytes)
            super().__init__(capacity_bytes, **kw)

    monkeypatch.setattr(cpu_module, "CpuTier", Recorded)
    reserve = 1 << 20
    with pytest.raises(cs.ConfigError) as refused:
        make_cache(cpu=limit - reserve + 1, cpu_reserve_bytes=reserve, disk=tmp_path / "d", pin_memory=False)
    said = str(refused.value)
    assert said.startswith("cpu_bytes: ") and "(cpu_reserve_bytes 1.00 MiB) are more than the memory this process " \
        f"may use, {format_size(limit)} ({where}): it would be killed for memory" in said, said
    assert made == [] and not (tmp_path / "d").exists()  # nothing made, nothing written
    cache = make_cache(cpu=limit - reserve, cpu_reserve_bytes=reserve, pin_memory=False)
    try:
        assert made == [limit - reserve]
        toks = tokens_for(23, 2 * BLOCK)
        assert cache.ingest(toks, make_kv(2 * BLOCK, 23)).stored == 2
        assert cache.lookup(toks) == 2 * BLOCK
    finally:
        cache.close()


@pytest.mark.parametrize("bad", [{"redis_url": "bogus://x"}, {"write_through": ["nope"]}])
def test_a_build_that_fails_at_a_later_tier_gives_back_the_tiers_made(tmp_path, monkeypatch, bad):
    """A bad ``redis_url`` (or ``write_through``) is found once the CPU and disk tiers are
    made: the error left them open, held by its traceback (a notebook keeps the last one),
    so the same cache built again with the setting fixed was refused its own directory
    ("in use by another process", this process's pid), and the CPU tier's memory kept."""
    from cacheseek.store import cpu as cpu_module

    closed = []

    class Recorded(cpu_module.CpuTier):
        def close(self):
            closed.append(self.name)
            super().close()

    monkeypatch.setattr(cpu_module, "CpuTier", Recorded)
    with pytest.raises(cs.ConfigError) as refused:
        make_cache(disk=tmp_path / "d", pin_memory=False, **bad)
    assert closed == ["cpu"], refused.value  # (refused.value, its traceback with it, still held)
    cache = make_cache(disk=tmp_path / "d", pin_memory=False)
    try:
        toks = tokens_for(29, BLOCK)
        assert cache.ingest(toks, make_kv(BLOCK, 29)).stored == 1
    finally:
        cache.close()


def test_environment_has_no_stray_tmp_files(tmp_path):
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    cache.ingest(tokens_for(18, 2 * BLOCK), make_kv(2 * BLOCK, 18))
    names = [p.name for p in (tmp_path / "d").rglob("*") if p.is_file() and p.name != ".lock"]
    assert len(names) == 4 and all(n.endswith((".frame", ".meta")) for n in names)
    assert os.listdir(tmp_path / "d")


def test_nan_in_the_head_undoes_the_tail_batches_already_stored(tmp_path):
    toks, kv = tokens_for(19, 6 * BLOCK), make_kv(6 * BLOCK, 19)
    kv[0][0][1, 3, 5] = float("inf")  # block 0; batches go tail first, so this one fails last
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.KIVI(bits=4), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="4MiB", disk_path=tmp_path / "d"),
                           max_batch_bytes=2 * LAYOUT.raw_nbytes(BLOCK))
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert cache.stats()["used_bytes"] == 0 and cache.lookup(toks) == 0
    assert not list((tmp_path / "d").glob("*/*.frame"))


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=2, group_size=32)])
def test_many_batches_and_decode_chunks_give_the_same_kv(codec):
    toks, kv = tokens_for(20, 11 * BLOCK + 3), make_kv(11 * BLOCK + 3, 20)
    one = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                         tiers=cs.TierConfig(cpu_bytes="8MiB"), max_batch_bytes="1GiB")
    many = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes="8MiB"), max_batch_bytes=3 * LAYOUT.raw_nbytes(BLOCK))
    assert one.ingest(toks, kv).stored == many.ingest(toks, kv).stored == 11
    a, b = one.materialize(toks), many.materialize(toks)
    assert a.num_tokens == b.num_tokens == 11 * BLOCK
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_cpu_tier_holds_its_whole_budget_whatever_the_chunk_size():
    # 7 frames fill a chunk's worth of slots but not the budget: the arena must grow.
    budget = 10 * FRAME
    tier_cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                                tiers=cs.TierConfig(cpu_bytes=budget))
    tier_cache.store.tiers[0]._arena.chunk_bytes = 4 * FRAME  # small chunks: frames straddle their ends
    toks, kv = tokens_for(21, 9 * BLOCK), make_kv(9 * BLOCK, 21)
    assert tier_cache.ingest(toks, kv).stored == 9
    tier = tier_cache.stats()["tiers"][0]
    assert tier["evictions"] == 0 and tier["blocks"] == 9
    assert tier_cache.lookup(toks) == 9 * BLOCK


@pytest.mark.parametrize("fails", [False, True])
def test_a_put_of_a_block_being_written_waits_for_that_write(tmp_path, fails):
    import errno

    from cacheseek.store.disk import DiskTier

    class SlowDisk(DiskTier):
        """The first frame write is held at a gate (a slow fsync), and fails if ``fails``."""

        gate, entered = threading.Event(), threading.Event()

        def _write_atomic(self, final, segments):
            if final.suffix == ".frame" and not self.entered.is_set():
                self.entered.set()
                assert self.gate.wait(10)
                if fails:  # (not ENOSPC: a write the filesystem had no room for goes again)
                    raise OSError(errno.EIO, "Input/output error")
            super()._write_atomic(final, segments)

    tier = SlowDisk(tmp_path, 1 << 20)
    meta, frame = _sealed(b"\x30" * 16, 0x30)
    key = meta.block_hash
    answers: dict[str, object] = {}

    def put(name: str) -> None:
        try:
            answers[name] = tier.put(key, BlockFrame(meta, host=memoryview(frame)))
        except cs.StorageError as exc:
            answers[name] = exc

    first = threading.Thread(target=put, args=("first",))
    first.start()
    assert tier.entered.wait(10)
    second = threading.Thread(target=put, args=("second",))
    second.start()
    second.join(0.3)
    # Not whole yet: neither present nor answered.
    assert second.is_alive() and not tier.contains(key) and tier.get(key) is None
    tier.gate.set()
    first.join(10)
    second.join(10)
    if fails:
        assert isinstance(answers["first"], cs.StorageError) and isinstance(answers["second"], cs.StorageError)
        assert "Input/output error" in str(answers["second"]) and "concurrent write" in str(answers["second"])
        assert not tier.contains(key)
    else:
        assert answers["first"].stored is not None and answers["second"].stored is None  # present
        assert bytes(tier.get(key).to_bytes()) == bytes(frame)
    tier.close()


def test_puts_and_deletes_of_one_block_racing_never_hang_the_disk_tier(tmp_path):
    """A put that found another thread's write of its block in flight used to wait for it
    holding the tier's lock, which that write needs to commit: every disk call hung."""
    from cacheseek.store.disk import DiskTier

    tier = DiskTier(tmp_path, 1 << 20, fsync=False)
    meta, frame = _sealed(b"\x31" * 16, 0x31)
    key = meta.block_hash
    stop = time.monotonic() + 3.0
    errors: list[BaseException] = []

    def writer(deletes: bool) -> None:
        try:
            while time.monotonic() < stop:
                if deletes:
                    tier.delete(key)
                else:
                    tier.put(key, BlockFrame(meta, host=memoryview(frame)))
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i % 3 == 2,), daemon=True) for i in range(9)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a put or delete of the block hung"
    assert not errors, errors
    tier.put(key, BlockFrame(meta, host=memoryview(frame)))
    assert bytes(tier.get(key).to_bytes()) == bytes(frame)
    stats = tier.stats()
    assert (stats.blocks, stats.to_dict()["frame_bytes"], stats.used_bytes) == (1, len(frame), tier.charge(len(frame)))
    tier.close()


def test_a_disk_stream_closed_before_its_first_frame_gives_its_reads_back(tmp_path):
    """The reads start when the stream is made; a generator closed before it started ran no
    ``finally``, so its pooled buffers stayed lent for good (a materialize whose chain lost
    its head between the lookup and the read did this)."""
    from cacheseek.store.disk import DiskTier

    tier = DiskTier(tmp_path, 1 << 20)
    keys = []
    for i in range(3):
        meta, frame = _sealed(bytes([0x40 + i]) * 16, 0x40 + i)
        tier.put(meta.block_hash, BlockFrame(meta, host=memoryview(frame)))
        keys.append(meta.block_hash)
    for taken in (0, 1, 3):
        stream = tier.stream(keys, leased=True)
        for frame in (next(stream) for _ in range(taken)):
            frame.release()
        stream.close()
        buffers = tier.stats().extra["stream_buffers"]
        assert buffers["leases_active"] == 0 and buffers["lease_double_releases"] == 0, (taken, buffers)
    tier.close()


def test_a_store_stream_closed_before_its_first_frame_gives_the_tiers_reads_back(tmp_path):
    """``TieredStore.stream`` starts every tier's reads when it is called, but handed out a
    generator: closed before its first frame, it ran no ``finally``, so the disk stream under
    it was never closed and its pooled buffers stayed lent for good."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    cpu, disk = CpuTier(2 * FRAME), DiskTier(tmp_path / "d", 1 << 30, fsync=False)
    store = TieredStore([cpu, disk], write_through=["disk"])
    items = [raw_frame(i) for i in range(1, 7)]  # the last ones in the CPU tier, all on disk
    store.put_many(items)
    keys = [key for key, _ in items]
    assert set(store.locate(keys)) == {"cpu", "disk"}
    for taken in (0, 1, 6):
        stream = store.stream(keys, promote=False)
        for frame, _ in (next(stream) for _ in range(taken)):
            frame.release()
        stream.close()
        stream.close()  # (idempotent)
        assert disk.stats().extra["stream_buffers"]["leases_active"] == 0, taken
        assert cpu.lease_stats()["leases_active"] == 0, taken
    store.close()


@pytest.mark.parametrize("eviction", ["arc", "lru"])
def test_a_read_s_promotions_do_not_evict_the_blocks_of_its_chain_it_has_not_reached(tmp_path, eviction):
    """A chain's head on disk, its tail in a full CPU tier and nowhere else (the disk's
    admission kept it out, say): promoting the head made room in the CPU tier, its victim
    the chain's own last block, before the read reached it: the read served 2 of the 3
    blocks its lookup had found."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import chain

    cpu, disk = CpuTier(3 * FRAME, policy=eviction), DiskTier(tmp_path / "d", 1 << 30, fsync=False)
    store = TieredStore([cpu, disk], write_through=["disk"])
    blocks, other = chain(1, 3), chain(2, 1)
    as_frames = [(key, BlockFrame(parse_frame(f), host=memoryview(f))) for key, f in blocks + other]
    disk.put_many(as_frames[:1])
    cpu.put_many(as_frames[1:])  # the tail, then another chain: the tail the least recent
    keys = [key for key, _ in blocks]
    assert store.locate(keys) == ["disk", "cpu", "cpu"]
    stream = store.stream(keys)
    got = []
    for item in stream:
        assert item is not None, f"block {len(got)} of the chain: gone before the read reached it"
        frame, tier = item
        assert frame.to_bytes() == blocks[len(got)][1]
        frame.release()
        got.append(tier)
    stream.close()
    assert got == ["disk", "cpu", "cpu"]
    assert cpu.lease_stats()["leases_active"] == 0
    store.close()


@pytest.mark.parametrize("eviction", ["arc", "lru"])
def test_a_promotion_with_no_room_but_its_chain_s_is_skipped_and_the_block_served_from_below(tmp_path, eviction):
    """A read a block at a time (the server's prefix stream) names its chain (``spare``): its
    head's promotion into a CPU tier that holds nothing but the chain's tail does not evict
    the tail; the head is served from disk, not promoted, and no write failed. Without the
    chain named, the same read evicts the tail (a plain ``get``: its tier's policy as ever)."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import chain

    for spared in (True, False):
        cpu = CpuTier(2 * FRAME, policy=eviction)
        disk = DiskTier(tmp_path / f"d{spared}", 1 << 30, fsync=False)
        store = TieredStore([cpu, disk], write_through=["disk"])
        blocks = [(key, BlockFrame(parse_frame(f), host=memoryview(f))) for key, f in chain(1, 3)]
        keys = [key for key, _ in blocks]
        disk.put_many(blocks[:1])
        cpu.put_many(blocks[1:])
        frame, tier = store.get(keys[0], spare=frozenset(keys) if spared else ())
        frame.release()
        assert tier == "disk"
        stats = cpu.stats()
        if spared:
            assert cpu.keys() == keys[1:] and (stats.promotions, stats.write_errors, stats.evictions) == (0, 0, 0)
            assert stats.promotions_spared == 1  # (an operator's one sign of it)
            assert store.locate(keys) == ["disk", "cpu", "cpu"]
        else:
            assert keys[0] in cpu.keys() and keys[2] not in cpu.keys() and stats.promotions == 1
            assert stats.promotions_spared == 0
        store.close()


@pytest.mark.parametrize("eviction", ["arc", "lru"])
def test_a_promotion_s_victims_on_their_way_down_spare_the_chain_being_read(tmp_path, eviction):
    """Write-back: promoting a chain's head into the CPU tier handed its victim down to a full
    disk, whose own victim was the chain's tail, held there alone: a read of the chain a
    block at a time lost its tail to its own head's promotion. The disk now gives up a block
    of no chain being read instead."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import chain

    cpu = CpuTier(FRAME, policy=eviction)
    disk = DiskTier(tmp_path / "d", 3 * disk_charge(FRAME), fsync=False, policy=eviction)
    store = TieredStore([cpu, disk])  # write-back: what the CPU tier evicts goes down to the disk
    frames = {key: BlockFrame(parse_frame(f), host=memoryview(f)) for key, f in chain(1, 2) + chain(2, 1) + chain(3, 1)}
    (head, tail, other, in_memory) = frames
    disk.put_many([(key, frames[key]) for key in (head, tail)])
    disk.put_many([(other, frames[other])])  # the most recent on disk: the chain's tail the first to go
    cpu.put_many([(in_memory, frames[in_memory])])
    keys = [head, tail]
    assert store.locate(keys) == ["disk", "disk"]
    got = [store.get(key, spare=frozenset(keys)) for key in keys]
    assert got[1] is not None, "the chain's tail was lost to its head's promotion"
    assert [tier for _, tier in got] == ["disk", "disk"]
    assert got[1][0].to_bytes() == bytes(frames[tail].host)
    for frame, _ in got:
        frame.release()
    assert cpu.keys() == [head] and sorted(disk.keys()) == sorted([head, tail, in_memory])
    store.close()


@pytest.mark.parametrize("eviction", ["arc", "lru"])
def test_reading_a_chain_longer_than_the_cpu_tier_promotes_no_tail_over_its_head(tmp_path, eviction):
    """Promoted one by one, a chain's blocks read from disk evicted their own parents from the
    CPU tier: it held a middle and a tail with no head, and once the disk gave the head up
    (another ingest), blocks stored that no lookup reaches."""
    cache = make_cache(cpu=5 * FRAME, disk=tmp_path / "disk", disk_bytes=9 * disk_charge(FRAME), eviction=eviction)
    a, kv_a = tokens_for(3, 8 * BLOCK), make_kv(8 * BLOCK, 3)
    hashes = cache.block_hashes(a)
    cpu = cache.store.tiers[0]

    def cpu_holds() -> list[bool]:
        return cpu.contains_many(hashes)

    assert cache.ingest(a, kv_a).stored == 8
    assert cpu_holds() == [True] * 5 + [False] * 3
    for _ in range(3):  # read whole, again and again: nothing of its head is given up for its tail
        assert_prefix_equal(cache.materialize(a), kv_a, 8 * BLOCK)
        assert cpu_holds() == [True] * 5 + [False] * 3
    b = tokens_for(1, 8 * BLOCK)
    cache.ingest(b, make_kv(8 * BLOCK, 1))
    stored = [cache.store.contains_many([h])[0] for h in hashes]
    usable = cache.locate(a).num_blocks
    assert stored == [True] * usable + [False] * (8 - usable)  # whatever is left of A is a usable prefix
    cache.close()


@pytest.mark.parametrize("order", ["parent_between", "no_room_beside_parent"])
def test_a_larger_promoted_block_evicts_neither_its_parent_nor_others_for_nothing(tmp_path, order):
    """Frames of several sizes in one store (models or codecs side by side): a block read from
    disk and promoted was checked against its first victim only. Larger than the blocks it
    evicts, it took several, its parent among them, and was dropped after: the CPU tier
    emptied of X, A and Y, nothing promoted. Its parent is spared now, and a copy that has no
    room beside its parent evicts nothing."""
    import hashlib

    from cacheseek.store.frame import build_frame, plan_frame, seal_frame
    from cacheseek.store.tiered import TieredStore
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tier import BlockFrame

    def frame(name: str, parent: bytes | None, payload: int) -> tuple[bytes, BlockFrame]:
        key = hashlib.blake2b(name.encode(), digest_size=16).digest()
        meta = plan_frame(block_hash=key, parent_hash=parent or bytes(16), position=0 if parent is None else 1,
                          layout=LAYOUT, block_tokens=16, codec={"name": "stand-in"},
                          buffers=[("kv", "uint8", (payload,))])
        buf = build_frame(meta, [bytes([len(name)]) * payload])
        return key, BlockFrame(seal_frame(meta, buf), host=memoryview(buf), sealed=True)

    a, x, y = frame("A", None, 64), frame("X", None, 64), frame("Y", None, 64)
    b = frame("B", a[0], 700)
    small = a[1].nbytes
    # Its room: two of the three small blocks (X and Y, or X and its parent A, in LRU order);
    # or more than there is beside its parent.
    free = b[1].nbytes - small - small // 2 if order == "parent_between" else small // 2
    cpu = CpuTier(3 * small + free, chunk_bytes=1 << 20, policy="lru")
    store = TieredStore([cpu, DiskTier(tmp_path / "d", 1 << 20, fsync=False)], write_through=["disk"])
    store.put_many([b])
    for item in (x, a, y):
        store.put_many([item])
    assert cpu.contains_many([x[0], a[0], y[0], b[0]]) == [True, True, True, False]
    got, tier = store.get(b[0], promote=True)
    got.release()
    assert tier == "disk"
    if order == "parent_between":  # X and Y make its room, its parent stays: promoted beside it
        assert cpu.contains_many([a[0], b[0]]) == [True, True] and cpu.stats().promotions == 1
    else:  # no room beside its parent at all: nothing evicted for it
        assert cpu.contains_many([x[0], a[0], y[0], b[0]]) == [True, True, True, False]
        assert cpu.stats().promotions == 0
    store.close()


def test_a_promotion_that_finds_no_room_after_evicting_hands_its_victims_down(tmp_path):
    """A promotion into a CPU tier whose slots readers all hold evicted a block for budget
    room, then found no slot and failed: the victim, evicted, was never handed to the disk
    (write-back), so an acknowledged block was stored nowhere."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    cpu = CpuTier(1 << 20, chunk_bytes=1 << 20)  # no reserve: the arena is the budget
    disk = DiskTier(tmp_path / "d", 64 << 20, fsync=False)
    store = TieredStore([cpu, disk])  # write-back: the CPU tier's victims go down to the disk
    cold, cold_frame = raw_frame(200)
    disk.put(cold, cold_frame)
    hot = [raw_frame(i) for i in range(1, 1 + (1 << 20) // cold_frame.nbytes)]
    assert all(r.stored for r in store.put_many(hot))
    readers = [cpu.get(key) for key, _ in hot]  # every slot is leased
    frame, tier = store.get(cold)  # a disk hit: promoted, with no slot free for it
    assert tier == "disk"
    frame.release()
    for reader in readers:
        reader.release()
    evicted = cpu.stats().evictions
    assert evicted >= 1
    assert all(store.contains_many([key for key, _ in hot]))  # each victim is on the disk now
    assert disk.stats().demotions == evicted
    store.close()


def test_a_victim_a_middle_tier_refuses_goes_on_to_the_tier_below_it(tmp_path):
    """Write-back over three tiers: a block the CPU tier evicted and the disk refused (a
    failing disk; one full of pinned blocks) was dropped, though the tier below had room:
    an acknowledged block gone before it left the last tier."""
    import errno

    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    class FailingDisk(DiskTier):
        def _write_temp(self, final, segments, *, sync=True):
            raise OSError(errno.EIO, "Input/output error")

    size = raw_frame(0)[1].nbytes
    cpu, disk = CpuTier(2 * size), FailingDisk(tmp_path / "d", 10 * size, fsync=False)
    below = CpuTier(10 * size, name="below")
    store = TieredStore([cpu, disk, below])  # nothing written through: victims go down
    blocks = [raw_frame(i) for i in (1, 2, 3)]
    assert all(r.stored for r in store.put_many(blocks[:2]))
    assert all(r.stored for r in store.put_many(blocks[2:]))  # evicts one of the first two
    assert cpu.stats().evictions == 1 and disk.stats().write_errors == 1
    for key, frame in blocks:
        got = store.get(key, promote=False)
        assert got is not None, "an acknowledged block was lost on its way down"
        assert bytes(got[0].payload_view()) == bytes(frame.payload_view())
        got[0].release()
    assert below.stats().demotions == 1
    store.close()


def test_a_victim_the_disk_cannot_read_to_hand_down_is_kept(tmp_path):
    """Write-back below a disk: a put that makes room reads each victim to hand it down. Out
    of file descriptors, that read failed, and the victim was deleted all the same, in no
    tier: an acknowledged block lost for a moment's shortage. It stays on the disk now, and
    the put that needed its room is refused (and goes down to the tier below instead)."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import out_of_descriptors, raw_frame

    size = raw_frame(0)[1].nbytes
    disk, below = DiskTier(tmp_path / "d", 3 * disk_charge(size), fsync=False), CpuTier(10 * size, name="below")
    store = TieredStore([disk, below])  # nothing written through: the disk's victims go down
    blocks = [raw_frame(i) for i in (1, 2, 3, 4)]
    assert all(r.stored for r in store.put_many(blocks[:3]))  # acknowledged: on disk, durable
    with out_of_descriptors():
        outcome = store.put(*blocks[3])
    assert not outcome.stored and "could not be read" in outcome.errors["disk"]
    assert "Too many open files" in outcome.errors["disk"]
    for key, frame in blocks:
        got = store.get(key, promote=False)
        assert got is not None, "a block was lost on its way down"
        assert bytes(got[0].payload_view()) == bytes(frame.payload_view())
        got[0].release()
    assert [store.locate([key]) for key, _ in blocks] == [["disk"]] * 3 + [["below"]]
    stats = disk.stats()
    assert (stats.blocks, stats.evictions, stats.read_errors, stats.write_errors, stats.corrupt) == (3, 0, 1, 1, 0)
    # Descriptors again: the victim is read, handed down, and the put takes its room.
    fresh = raw_frame(5)
    assert store.put(*fresh).stored
    assert disk.stats().evictions == 1 and below.stats().demotions == 1
    assert all(store.contains_many([key for key, _ in [*blocks, fresh]]))
    store.close()


@pytest.mark.parametrize("fault", ["corrupt", "io-error"])
def test_a_victim_whose_bytes_cannot_be_had_goes_without_them_and_the_put_is_stored(tmp_path, monkeypatch, fault):
    """A victim whose file fails its checksum holds no block to hand down: it goes, counted
    corrupt (not evicted). One the disk fails to read (EIO) goes too, counted in
    ``read_errors``: kept, it would hold the tier full, no read of it succeeding either.
    Either way the put that needed the room is stored."""
    import errno

    from cacheseek.store import direct_io
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    size = raw_frame(0)[1].nbytes
    disk, below = DiskTier(tmp_path / "d", 3 * disk_charge(size), fsync=False), CpuTier(10 * size, name="below")
    store = TieredStore([disk, below])
    blocks = [raw_frame(i) for i in (1, 2, 3, 4)]
    assert all(r.stored for r in store.put_many(blocks[:3]))
    victim = blocks[0][0]  # the least recently used
    data = disk._paths(victim)[0]
    if fault == "corrupt":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        def failing_read(*args, **kw):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(direct_io.os, "preadv", failing_read)
    assert store.put(*blocks[3]).stored
    monkeypatch.undo()
    assert not store.contains_many([victim])[0] and not data.exists()
    stats = disk.stats()
    assert (stats.corrupt, stats.evictions, stats.read_errors) == ((1, 0, 0) if fault == "corrupt" else (0, 1, 1))
    assert below.stats().demotions == 0 and all(store.contains_many([key for key, _ in blocks[1:]]))
    store.close()


def test_a_gpu_tier_put_that_runs_out_of_device_memory_hands_its_victims_down(monkeypatch):
    """A GPU-tier put that evicted for room and then found the device out of memory raised,
    and the blocks it had evicted went with the exception: in no tier, never demoted. (A GPU
    tier on the CPU device, its allocation failing as a full GPU's does.)"""
    import cacheseek.store.gpu as gpu_mod
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    frame_bytes = raw_frame(1)[1].nbytes
    gpu, cpu = gpu_mod.GpuTier(3 * frame_bytes, device="cpu"), CpuTier(1 << 20)
    store = TieredStore([gpu, cpu])  # the GPU tier's victims go down to the CPU tier
    first = [raw_frame(i) for i in (1, 2, 3)]
    assert all(r.stored for r in store.put_many(first))

    def out_of_memory(frame, device):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(gpu_mod, "payload_on_device", out_of_memory)
    # More than the budget in one call: each frame makes its own room, then fails.
    outcomes = store.put_many([raw_frame(i) for i in (9, 10, 11, 12)])
    assert all(o.stored and "out of memory" in o.errors["gpu"] for o in outcomes)
    assert gpu.stats().evictions == 1
    assert all(store.contains_many([key for key, _ in first]))  # the victim is in the CPU tier
    assert cpu.stats().demotions == 1
    with pytest.raises(cs.StorageError, match="out of memory"):
        gpu.put(*raw_frame(13))


@pytest.mark.parametrize("read", ["get", "get_many", "stream"])
def test_a_read_in_flight_does_not_bring_back_a_block_deleted_before_its_promotion(tmp_path, read):
    """A read took a block from the disk, a delete then removed it from every tier (answered
    True: a 204), and the read's promotion put it into the CPU tier: the deleted block was
    stored and served again, though nobody wrote it."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    class Cpu(CpuTier):
        before_put = None

        def put_many(self, items, **kw):
            hook, self.before_put = self.before_put, None
            if hook is not None:
                hook()  # the delete, between the read and its promotion
            return super().put_many(items, **kw)

    cpu, disk = Cpu(1 << 20), DiskTier(tmp_path / "d", 1 << 30, fsync=False)
    store = TieredStore([cpu, disk], write_through=["disk"])
    gone, kept = raw_frame(5), raw_frame(6)
    disk.put(*gone)
    disk.put(*kept)
    deleted = []
    cpu.before_put = lambda: deleted.append(store.delete(gone[0]))
    if read == "get":
        got = [store.get(gone[0])]
    elif read == "get_many":
        got = store.get_many([gone[0]])
    else:
        stream = store.stream([gone[0]], where=["disk"])
        got = list(stream)
        stream.close()
    assert deleted == [True] and got[0][1] == "disk"  # the read had it before the delete
    got[0][0].release()
    assert store.contains_many([gone[0]]) == [False] and cpu.keys() == []
    frame, tier = store.get(kept[0])  # a read with no delete meanwhile promotes as before
    frame.release()
    assert tier == "disk" and cpu.keys() == [kept[0]] and cpu.stats().promotions == 1
    store.close()


def test_an_interrupted_delete_leaves_no_delete_in_progress_to_undo_later_demotions(tmp_path):
    """A delete is numbered under the store's lock, so that a block on its way down is not
    stored below once deleted; the ``try`` that ended it began after the lock was let go. An
    interrupt there left the delete in progress for good: a block deleted and stored again
    was deleted where its demotion landed, and once 4,096 more deletes had gone by, every
    block the CPU tier evicted was lost on its way to the disk, without a word."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import RECENT_DELETES, TieredStore
    from store_helpers import InterruptedAtRelease, raw_frame

    size = raw_frame(1)[1].nbytes
    cpu, disk = CpuTier(4 * size), DiskTier(tmp_path / "d", 1 << 30, fsync=False)
    store = TieredStore([cpu, disk])  # write-back: the CPU tier's victims go down to the disk
    real = store._delete_lock
    store._delete_lock = InterruptedAtRelease(real)
    with pytest.raises(KeyboardInterrupt):
        store.delete(raw_frame(200)[0])
    store._delete_lock = real
    assert store._deleting == set() and store._in_transit == {}
    again = raw_frame(7)
    store.put(*again)
    store.delete(again[0])
    store.put(*again)
    for i in range(20, 30):  # evicts it from the CPU tier: handed down to the disk
        store.put(*raw_frame(i))
    assert not cpu.contains(again[0]) and disk.contains(again[0])
    for i in range(RECENT_DELETES + 1):
        store.delete(i.to_bytes(16, "big"))
    blocks = [raw_frame(i) for i in range(300, 320)]
    for key, frame in blocks:
        store.put(key, frame)
    assert all(store.get(key) is not None for key, _ in blocks)
    store.close()


def test_a_write_interrupted_after_it_evicted_hands_its_victims_down(tmp_path, monkeypatch):
    """A write-back store hands the CPU tier's victims down to the disk. A write interrupted
    (Ctrl-C) after the CPU tier had evicted for it, at its second frame's copy, lost them: the
    tier could not return them, and acknowledged blocks were in no tier."""
    from cacheseek.store import cpu as cpu_mod
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    size = raw_frame(1)[1].nbytes
    store = TieredStore([CpuTier(4 * size), DiskTier(tmp_path / "d", 1 << 26, fsync=False)])
    old = [raw_frame(i) for i in range(1, 5)]
    for key, frame in old:
        store.put(key, frame)
    real = cpu_mod._start_fill
    calls = [0]

    def fill(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt  # the call's victims are already evicted
        return real(*args)

    monkeypatch.setattr(cpu_mod, "_start_fill", fill)
    with pytest.raises(KeyboardInterrupt):
        store.put_many([raw_frame(10), raw_frame(11)])
    monkeypatch.setattr(cpu_mod, "_start_fill", real)
    for key, _ in old:
        got = store.get(key)
        assert got is not None, store.locate([key])
        got[0].release()
    assert store.tiers[0].take_orphans() == []
    store.close()


@pytest.mark.parametrize("write", ["put_many", "commit_many"])
def test_a_block_deleted_while_it_moves_down_a_tier_is_not_stored_below(tmp_path, write):
    """A put evicted X from the CPU tier and was handing it down to the disk when a delete
    of X ran: X was in neither tier, the delete answered False (a 404), and the demotion
    then stored X on disk, where every later read found it."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    class Disk(DiskTier):
        before_put = None

        def put_many(self, items, **kw):
            hook, self.before_put = self.before_put, None
            if hook is not None:
                hook()  # the delete, while the victim is in no tier
            return super().put_many(items, **kw)

    moved, kept, new = raw_frame(7), raw_frame(8), raw_frame(9)
    cpu = CpuTier(2 * moved[1].nbytes, reserve_bytes=moved[1].nbytes)  # (room to reserve one more)
    disk = Disk(tmp_path / "d", 1 << 30, fsync=False)
    store = TieredStore([cpu, disk])  # write-back: the CPU tier's victims go down to the disk
    store.put_many([moved, kept])
    deleted = []
    disk.before_put = lambda: deleted.append(store.delete(moved[0]))
    if write == "put_many":
        assert store.put_many([new])[0].stored
    else:
        reservation = store.reserve(new[1].nbytes)
        reservation.view()[:] = new[1].host
        assert store.commit_many([(new[0], reservation, new[1].meta)])[0].stored
    assert deleted == [False]  # the delete found X in no tier
    assert store.contains_many([moved[0]]) == [False] and disk.keys() == []
    assert store.get(moved[0]) is None and cpu.stats().evictions == 1
    store.put(*new)  # a write with no delete meanwhile demotes as before
    assert sorted(store.contains_many([kept[0], new[0]])) == [True, True]
    store.close()


def test_blocks_whose_head_is_gone_are_a_prefix_again_once_the_chain_is_ingested_again(tmp_path):
    """Stored blocks whose head no tier holds are unreachable, not lost: an ingest of the
    chain writes the missing head alone, and the whole prefix is served again."""
    toks, kv = tokens_for(16, 4 * BLOCK), make_kv(4 * BLOCK, 16)
    cache = make_cache(cpu="64MiB", disk=tmp_path / "d")
    cache.ingest(toks, kv)
    head = cache.block_hashes(toks)[0]
    for name in ("cpu", "disk"):
        cache.store.tier(name).delete(head)
    assert cache.lookup(toks) == 0
    again = cache.ingest(toks, kv)
    assert (again.stored, again.present) == (1, 3)
    assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)


def test_kv_that_requires_grad_is_stored_as_it_is(tmp_path):
    """KV from a forward run without no_grad: the encode's in-place steps refused it."""
    toks, kv = tokens_for(17, 2 * BLOCK), make_kv(2 * BLOCK, 17)
    cache = make_cache(codec=cs.KIVI(bits=4, group_size=32))
    grads = [(k.float().requires_grad_().half(), v.clone().requires_grad_()) for k, v in kv]
    assert cache.ingest(toks, grads).stored == 2
    want = make_cache(codec=cs.KIVI(bits=4, group_size=32))
    want.ingest(toks, kv)
    for (k, v), (k0, v0) in zip(cache.materialize(toks).layers, want.materialize(toks).layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("device", ["meta", "not-a-device", "cuda:past-the-last"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_onto_a_device_that_holds_no_data_is_refused(device, layerwise):
    """A CUDA device this process does not have (no CUDA at all: torch's AssertionError,
    naming nothing; an index past the last GPU) is refused as one that holds no data."""
    if device == "cuda:past-the-last":
        device = f"cuda:{torch.cuda.device_count()}"
    toks, kv = tokens_for(18, 2 * BLOCK), make_kv(2 * BLOCK, 18)
    cache = make_cache()
    cache.ingest(toks, kv)
    with pytest.raises(InputError, match="^device: "):
        cache.materialize(toks, device=device, layerwise=layerwise)
    assert cache.stats()["tiers"][0]["leases_active"] == 0


def test_every_call_after_close_raises_and_stores_nothing(tmp_path):
    """After ``close`` an ingest of new blocks failed half-way (the disk tier's writer pool
    shut down: "cannot schedule new futures after shutdown") while lookups and materializes
    went on reading the closed tiers. Every call but ``stats`` and ``close`` now raises one
    clear error before it touches anything."""
    toks, kv = tokens_for(90, 4 * BLOCK), make_kv(4 * BLOCK, 90)
    new = tokens_for(91, 4 * BLOCK)
    cache = make_cache(cpu="4MiB", disk=tmp_path / "disk")
    assert cache.ingest(toks, kv).stored == 4
    cache.close()
    calls = {
        "ingest": lambda: cache.ingest(new, kv),
        "ingest_layerwise": lambda: cache.ingest_layerwise(new),
        "ingest_batch": lambda: cache.ingest_batch([cs.PagedRequest(new, [0])], None),
        "materialize_into_batch": lambda: cache.materialize_into_batch([cs.PagedRequest(toks, [0])], None),
        "materialize_into": lambda: cache.materialize_into(toks, None),
        "ingest not waited for": lambda: cache.ingest(new, kv, wait=False),
        "lookup": lambda: cache.lookup(toks),
        "locate_batch": lambda: cache.locate_batch([toks, new]),
        "locate": lambda: cache.locate(toks),
        "materialize": lambda: cache.materialize(toks),
        "materialize layer-wise": lambda: cache.materialize(toks, layerwise=True),
        "prefetch": lambda: cache.prefetch(toks),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"^PrefixCache: closed \(close\(\) was called"):
            call()
    assert cache.stats()["model_id"] == "m"
    cache.close()  # (again: nothing)
    with make_cache(cpu="4MiB", disk=tmp_path / "disk") as reopened:
        assert (reopened.lookup(toks), reopened.lookup(new)) == (4 * BLOCK, 0)


def test_a_hit_then_the_ingest_of_the_same_prompt_is_one_use_for_disk_admission(tmp_path):
    """A request that reads its prefix and then stores its prompt touches the prefix twice
    (the read, and the ingest finding it stored): one use. Admitted after 3 uses, a block
    ingested once and read back once has 2, so the CPU tier's eviction drops it; a second
    read makes 3, and it goes to disk."""
    cache = make_cache(cpu=2 * FRAME, disk=tmp_path / "d", disk_admit_after_uses=3, eviction="lru")
    disk = cache.store.tier("disk")
    toks, kv = tokens_for(40, BLOCK), make_kv(BLOCK, 40)
    (key,) = cache.block_hashes(toks)

    def request_and_evict(seed: int) -> None:
        assert cache.materialize(toks).num_tokens == BLOCK
        assert cache.ingest(toks, kv).present == 1
        for s in (seed, seed + 1):  # two fresh blocks push it out of the 2-block CPU tier
            cache.ingest(tokens_for(s, BLOCK), make_kv(BLOCK, s))
        assert not cache.store.tier("cpu").contains(key)

    cache.ingest(toks, kv)  # use 1
    request_and_evict(41)  # use 2: not admitted, dropped
    assert not disk.contains(key) and cache.lookup(toks) == 0
    cache.ingest(toks, kv)  # use 3 (the cache lost it: computed again)
    request_and_evict(43)  # use 4
    assert disk.contains(key) and cache.lookup(toks) == BLOCK


def test_the_admission_counts_stay_bounded_before_any_block_reaches_the_filtered_tier(tmp_path):
    """Disk admission's use counts are halved every ``window`` uses, a window sized from the
    first frame the filter saw. It saw frames only when one went down to its tier: while the
    CPU tier never filled (blocks deleted or flushed as they go), the window stayed 0 and
    the counts kept every key ever ingested, one entry per block for the life of the process."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    disk = DiskTier(tmp_path / "d", 8 * disk_charge(raw_frame(0)[1].nbytes))
    store = TieredStore([CpuTier(64 << 20), disk], admit_after={"disk": 2})
    try:
        for i in range(1000, 3000):
            key, frame = raw_frame(i)
            store.put(key, frame)
            store.delete(key)
        use_filter = store.filters["disk"]
        assert use_filter.window == 80 and use_filter.describe()["tracked_keys"] <= use_filter.window
    finally:
        store.close()


def test_the_admission_counts_stay_bounded_on_a_store_that_only_serves_reads(tmp_path):
    """A store reopened over a disk tier that serves its blocks and takes no put: hits count
    uses, and the filter's window was sized only by a put, so it stayed 0 and the counts
    were never halved, one entry per block read for the life of the process."""
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    nbytes = raw_frame(0)[1].nbytes
    frames = [raw_frame(i) for i in range(4000, 4008)]
    store = TieredStore([DiskTier(tmp_path / "d", 8 * disk_charge(nbytes))])
    store.put_many(frames)
    store.close()
    store = TieredStore([CpuTier(64 << 20), DiskTier(tmp_path / "d", 8 * disk_charge(nbytes))], admit_after={"disk": 2})
    try:
        use_filter = store.filters["disk"]
        for _ in range(50):
            for key, _ in frames:
                store.touch_chain([key])  # a hit, as a materialize's
        assert use_filter.window == 80 and use_filter.describe()["tracked_keys"] <= len(frames)
        assert use_filter._since_halving < use_filter.window  # halved on the way: 400 uses
    finally:
        store.close()


def test_a_delete_of_a_block_on_its_way_down_finds_it(tmp_path, monkeypatch):
    """Write-back: a block evicted from the CPU tier is in no tier until the disk has it. Its
    delete then was deleted where it landed, but answered "not held" (a DELETE's 404)."""
    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame

    store = cs.TierConfig(cpu_bytes=2 * FRAME, disk_path=tmp_path / "d", write_through=(), eviction="lru").build()
    try:
        (first, f1), (second, f2), (third, f3) = raw_frame(1), raw_frame(2), raw_frame(3)
        store.put_many([(first, f1)])
        store.put_many([(second, f2)])
        landing, release = threading.Event(), threading.Event()
        real = DiskTier.put_many

        def held_put(tier, items):
            if any(key == first for key, _ in items):
                landing.set()
                release.wait(30)
            return real(tier, items)

        monkeypatch.setattr(DiskTier, "put_many", held_put)
        writer = threading.Thread(target=store.put_many, args=([(third, f3)],))  # evicts `first` down
        writer.start()
        assert landing.wait(30) and not store.tier("cpu").contains(first)
        threading.Timer(0.3, release.set).start()  # lands while the delete waits for it
        assert store.delete(first) is True
        writer.join(30)
        assert not store.tier("disk").contains(first) and store.get(first) is None
        assert store.delete(first) is False  # and a delete of what is nowhere says so
    finally:
        store.close()


def test_a_stream_read_lands_in_pageable_memory_when_page_locked_memory_is_refused(tmp_path, monkeypatch, caplog):
    """``pin=True`` on a host whose pinned allocations fail (its locked-memory limit, a driver
    error): torch raises a RuntimeError, which escaped the read (a 500 in the server, the
    stream ended early). The read lands in pageable memory instead, and says so once."""
    from cacheseek.store import direct_io
    from cacheseek.store.disk import DiskTier

    real_empty = torch.empty

    def refusing_empty(*args, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kw)

    tier = DiskTier(tmp_path, 1 << 20, pin=True)
    keys, frames = [], []
    for i in range(3):
        meta, frame = _sealed(bytes([0x50 + i]) * 16, 0x50 + i)
        tier.put(meta.block_hash, BlockFrame(meta, host=memoryview(frame)))
        keys.append(meta.block_hash)
        frames.append(bytes(frame))
    monkeypatch.setattr(torch, "empty", refusing_empty)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(direct_io, "_warned_unpinned", False)
    with caplog.at_level("WARNING", logger="cacheseek.store.direct_io"):
        got = []
        for frame in tier.stream(keys, leased=True):
            got.append(bytes(frame.host))
            frame.release()
    assert got == frames
    assert caplog.text.count("page-locked memory refused") == 1
    assert tier.stats().extra["stream_buffers"]["leases_active"] == 0
    tier.close()
