"""Bytes at rest are untrusted: frames and sidecars damaged or forged on disk (and values in
Redis), read through the real embedded ``PrefixCache`` over real files and a real
redis-server, and through a real server and ``RemoteCache``. A damaged block is a miss
(the prefix ends before it), counted in ``corrupt``, and removed; never decoded, never an
exception, never read into a buffer its files' own say-so sized."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.store.frame import ALIGN, MAGIC, PREAMBLE, parse_frame, payload_checksum
from store_helpers import BLOCK, assert_prefix_equal, make_cache, make_kv, tokens_for
from redis_servers import needs_redis

RAW = cs.Raw()


def _stored(tmp_path: Path, seed: int, codec=RAW, blocks: int = 3):
    """A chain of ``blocks`` blocks written to a disk tier under ``tmp_path/d``, the cache closed."""
    toks, kv = tokens_for(seed, blocks * BLOCK), make_kv(blocks * BLOCK, seed)
    cache = make_cache(cpu=0, disk=tmp_path / "d", codec=codec)
    cache.ingest(toks, kv)
    keys = cache.block_hashes(toks)
    cache.close()
    return toks, kv, keys


def _files(tmp_path: Path, key: bytes) -> tuple[Path, Path]:
    h = key.hex()
    frame = tmp_path / "d" / h[:2] / f"{h}.frame"
    return frame, frame.with_suffix(".meta")


def _reseal(data: bytes, mutate) -> bytes:
    """``data`` (a frame) with its header changed by ``mutate`` and every checksum made good
    again: a frame no checksum can tell from one its writer meant."""
    meta = parse_frame(data)
    header = meta.header_dict()
    mutate(header)
    payload = bytes(data[meta.payload_offset:])
    header["checksum"] = payload_checksum(payload)
    raw = msgpack.packb(header, use_bin_type=True)
    head = PREAMBLE.pack(MAGIC, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw
    return head + bytes(-len(head) % ALIGN) + payload


def _disk(cache) -> dict:
    return next(t for t in cache.stats()["tiers"] if t["name"] == "disk")


OTHER_CONFIG = {
    "codec": lambda h: h.update(codec=cs.KIVI(bits=4, group_size=32).spec()),
    "codec value type": lambda h: h["codec"].update(version=1.0),
    "layout": lambda h: h["layout"].update(dtype="bfloat16"),
    "block size": lambda h: h.update(block_tokens=2 * BLOCK),
}


def _materialized(cache, toks, kv, layerwise: bool, tokens: int) -> list[str]:
    if not layerwise:
        got = cache.materialize(toks)
        assert_prefix_equal(got, kv, tokens)
        return got.tiers
    load = cache.materialize(toks, layerwise=True)
    assert load.num_tokens == tokens
    for i, (k0, v0) in enumerate(kv):
        load.wait(i)
        k, v = load.layer(i)
        assert torch.equal(k[0].cpu(), k0[:, :tokens]) and torch.equal(v[0].cpu(), v0[:, :tokens])
    return load.tiers


@pytest.mark.parametrize("cpu, layerwise", [(0, False), ("4MiB", False), ("4MiB", True)])
@pytest.mark.parametrize("other", list(OTHER_CONFIG))
def test_a_whole_frame_of_another_configuration_under_a_blocks_name_is_a_counted_miss_and_goes(tmp_path, cpu,
                                                                                              layerwise, other):
    """Checksums good, the header naming the block, but another codec's (layout's, block
    size's): every read ended the prefix there, and nothing counted it or took it out (with
    a CPU tier, it was promoted first, and stayed there too), so ``lookup`` promised the
    whole chain on every call."""
    toks, kv, keys = _stored(tmp_path, 21)
    frame, side = _files(tmp_path, keys[1])
    frame.write_bytes(_reseal(frame.read_bytes(), OTHER_CONFIG[other]))
    fields = msgpack.unpackb(side.read_bytes())
    side.write_bytes(msgpack.packb({**fields, "checksum": parse_frame(frame.read_bytes()).checksum}))
    cache = make_cache(cpu=cpu, disk=tmp_path / "d")
    assert cache.lookup(toks) == 3 * BLOCK  # (only a read can tell)
    assert _materialized(cache, toks, kv, layerwise, BLOCK) == ["disk"]
    assert _disk(cache)["corrupt"] == 1
    assert not frame.exists() and not side.exists()
    assert cache.lookup(toks) == BLOCK
    assert not any(cache.store.contains_many([keys[1]]))  # in no tier: the CPU copy went too
    assert _materialized(cache, toks, kv, layerwise, BLOCK) in (["disk"], ["cpu"])
    assert _disk(cache)["corrupt"] == 1
    cache.close()


def _swap_last_axes(header: dict) -> None:
    shape = header["tensors"][0]["shape"]
    shape[-1], shape[-2] = shape[-2], shape[-1]  # the same bytes, laid out otherwise


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("position", [0, 1])
def test_a_stored_frame_whose_buffers_are_not_the_codecs_ends_the_prefix_and_goes(tmp_path, layerwise, position):
    """Checksums good, the header naming the block with this codec, layout and block size,
    but a buffer's shape not the codec's: ``check_fetched`` let it by, and the decoder's own
    check raised ``FrameError`` out of ``materialize`` (the first block's, or "frames of one
    chain disagree" for a later one) instead of ending the prefix before it."""
    toks, kv, keys = _stored(tmp_path, 27)
    frame, side = _files(tmp_path, keys[position])
    frame.write_bytes(_reseal(frame.read_bytes(), _swap_last_axes))
    cache = make_cache(cpu="4MiB", disk=tmp_path / "d")
    if position == 0 and layerwise:
        assert cache.materialize(toks, layerwise=True).num_tokens == 0
    elif position == 0:
        assert cache.materialize(toks).num_tokens == 0
    else:
        assert _materialized(cache, toks, kv, layerwise, BLOCK) == ["disk"]
    assert _disk(cache)["corrupt"] == 1
    assert not frame.exists() and not side.exists()
    assert cache.lookup(toks) == position * BLOCK
    cache.close()


@pytest.mark.parametrize("field, value", [
    ("parent", b"\x55" * 16),  # another chain's block: deletes and pins walk the wrong way
    ("pos", 7),
    ("raw_nbytes", 1 << 61),  # the stats' raw bytes and compression ratio
])
def test_a_sidecar_that_disagrees_with_its_frame_is_damage_found_on_read(tmp_path, field, value):
    """The sidecar is well formed (so the start indexes it) but says of its block what its
    frame does not: the index held that, the read served the block, nothing counted it."""
    toks, kv, keys = _stored(tmp_path, 22)
    frame, side = _files(tmp_path, keys[1])
    side.write_bytes(msgpack.packb({**msgpack.unpackb(side.read_bytes()), field: value}))
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    assert cache.store.tier("disk").check() == {"ok": 2, "corrupt": 1, "unreadable": 0, "other_version": 0}
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)  # the prefix ends before it
    disk = _disk(cache)
    assert disk["corrupt"] == 1 and disk["blocks"] == 2
    assert not frame.exists() and not side.exists()
    assert disk["raw_bytes"] == 2 * cache.layout.raw_nbytes(BLOCK)
    cache.close()


def test_a_block_whose_files_claim_an_absurd_size_is_not_read_into_memory(tmp_path, monkeypatch):
    """A sidecar and a (sparse) data file that agree on 512 MiB, within the budget: the start
    indexed it, and every read allocated and filled a buffer of that size (a sidecar of
    2^36 bytes over a sparse file is 64 GiB of memory) before the frame's header could say
    anything. No frame of the cache's configuration is that large: the start sets it aside
    (not indexed, never read, its files kept and charged, the first evicted), and the
    prefix ends before it."""
    from cacheseek.store import direct_io

    toks, kv, keys = _stored(tmp_path, 23)
    frame, side = _files(tmp_path, keys[1])
    absurd = 512 << 20
    with open(frame, "r+b") as f:
        f.truncate(absurd)  # sparse: no disk space taken
    side.write_bytes(msgpack.packb({**msgpack.unpackb(side.read_bytes()), "nbytes": absurd}))
    taken = []
    real_take = direct_io.BufferPool.take
    monkeypatch.setattr(direct_io.BufferPool, "take", lambda self, n: taken.append(n) or real_take(self, n))
    cache = make_cache(cpu=0, disk=tmp_path / "d", disk_bytes="2GiB")
    assert _disk(cache)["capacity_bytes"] >= absurd + (1 << 20), "the test needs 512 MiB free where tmp_path lies"
    assert cache.lookup(toks) == BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    assert taken and max(taken) < 1 << 20
    disk = _disk(cache)
    assert (disk["corrupt"], disk["blocks"], disk["over_frame_limit_at_start"], disk["other_version_blocks"]) == \
        (0, 2, 1, 1)
    assert frame.exists() and side.exists()
    cache.close()


def test_the_server_reads_no_data_file_larger_than_its_largest_frame(tmp_path):
    """A restarted server whose disk holds blocks larger than its ``--max-frame-bytes`` (a
    sidecar and a sparse data file agreeing on 64 MiB; or whole blocks, kept before the limit
    was lowered) does not read them: they are set aside at start, kept and charged, not
    served (the prefix ends before them), not counted damaged; opened again with a limit that
    takes them, the whole ones are served again (a lower limit deleted them as damage)."""
    import httpx

    from server_helpers import Server, raw_chain

    chain = raw_chain(24, 3)
    srv = Server(tmp_path, cpu_bytes="0")
    with srv:
        for h, body in chain:
            assert httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=body).status_code == 201
    name = chain[1][0].hex()
    frame = srv.disk_path / name[:2] / f"{name}.frame"
    side = frame.with_suffix(".meta")
    sparse = srv.disk_path / "ff" / ("ff" * 16 + ".frame")
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)
    sparse.with_suffix(".meta").write_bytes(msgpack.packb({**msgpack.unpackb(side.read_bytes()), "nbytes": 64 << 20,
                                                           "hash": bytes.fromhex("ff" * 16)}))
    small = Server(tmp_path, "--max-frame-bytes", str(len(chain[0][1]) - 1), cpu_bytes="0")
    with small, httpx.Client(base_url=small.url, timeout=30) as client:
        assert client.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain]}).json()["matched"] == 0
        assert client.get(f"/v1/blocks/{name}").status_code == 404
        disk = next(t for t in client.get("/v1/stats").json()["tiers"] if t["name"] == "disk")
        assert (disk["corrupt"], disk["blocks"], disk["over_frame_limit_at_start"]) == (0, 0, 4)
        assert disk["other_version_blocks"] == 4  # (set aside: charged, the first evicted)
    assert frame.exists() and side.exists() and sparse.exists()
    assert "4 blocks in" in small.output() and "are larger than the largest frame read here" in small.output()
    srv = Server(tmp_path, "--max-frame-bytes", "1MiB", cpu_bytes="0")
    with srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain]}).json()["matched"] == 3
        assert [client.get(f"/v1/blocks/{h.hex()}").content for h, _ in chain] == [b for _, b in chain]
        disk = next(t for t in client.get("/v1/stats").json()["tiers"] if t["name"] == "disk")
        assert (disk["corrupt"], disk["blocks"], disk["over_frame_limit_at_start"]) == (0, 3, 1)  # (the sparse one)


_DAMAGE = st.tuples(
    st.sampled_from(["truncate", "extend", "flip", "zero", "swap", "empty", "delete", "stray temp"]),
    st.integers(0, 1 << 30),  # which file
    st.integers(0, 1 << 30),  # where in it
    st.integers(0, 7),  # which bit
)


@pytest.fixture(scope="module")
def stored_chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    toks, kv, _ = _stored(root, 25, blocks=4)
    return root / "d", toks, kv


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damages=st.lists(_DAMAGE, min_size=1, max_size=3))
def test_a_restart_over_any_damage_serves_a_true_prefix_or_less(stored_chain, tmp_path, damages):
    """Frames and sidecars truncated, extended, bit-flipped, zeroed, swapped for another
    block's, emptied, deleted; stray temp files: the cache opens, and what it serves is a
    prefix of the chain, bit for bit, no longer than its lookup said; after that read, its
    lookup agrees with what it served, and so does the next cache over the directory."""
    source, toks, kv = stored_chain
    root = tmp_path / f"d{secrets.token_hex(4)}"
    shutil.copytree(source, root)
    (root / ".lock").unlink(missing_ok=True)
    names = sorted(p.relative_to(root) for p in root.glob("*/*") if p.suffix in (".frame", ".meta"))
    for how, which, where, bit in damages:
        path = root / names[which % len(names)]
        if how == "stray temp":
            (path.parent / f".tmp-{path.stem}{path.suffix}-0123abcd").write_bytes(b"interrupted")
            continue
        if not path.exists():
            continue
        data = bytearray(path.read_bytes())
        if how == "delete":
            path.unlink()
            continue
        if how == "truncate":
            data = data[: where % (len(data) + 1)]
        elif how == "extend":
            data += bytes(1 + where % 100)
        elif how == "flip" and data:
            data[where % len(data)] ^= 1 << bit
        elif how == "zero" and data:
            at = where % len(data)
            data[at : at + 64] = bytes(len(data[at : at + 64]))
        elif how == "swap":
            other = [n for n in names if n.suffix == path.suffix and (root / n).exists()]
            data = bytearray((root / other[where % len(other)]).read_bytes())
        elif how == "empty":
            data = bytearray()
        path.write_bytes(data)
    cache = make_cache(cpu="1MiB", disk=root)
    try:
        promised = cache.lookup(toks)
        got = cache.materialize(toks)
        assert got.num_tokens <= promised
        assert_prefix_equal(got, kv, got.num_tokens)
        assert cache.lookup(toks) == got.num_tokens
        assert cache.materialize(toks).num_tokens == got.num_tokens
    finally:
        cache.close()
    again = make_cache(cpu=0, disk=root)
    try:
        assert again.lookup(toks) == got.num_tokens
        assert_prefix_equal(again.materialize(toks), kv, got.num_tokens)
    finally:
        again.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    from redis_servers import RedisServer

    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@needs_redis
@pytest.mark.parametrize("damage", ["empty", "another configuration's"])
def test_a_redis_value_emptied_or_of_another_configuration_is_a_counted_miss_and_goes(redis_server, damage):
    from cacheseek.store.redis_keys import RedisKeys

    redis_server.cli("FLUSHALL")
    toks, kv = tokens_for(26, 3 * BLOCK), make_kv(3 * BLOCK, 26)
    opts = dict(redis_url=redis_server.url, redis_bytes="64MiB")
    writer = make_cache(cpu=0, **opts)
    writer.ingest(toks, kv)
    keys = writer.block_hashes(toks)
    client = writer.store.tier("redis")._connection()
    name = RedisKeys().frame(keys[1])
    value = client.get(name)
    client.set(name, b"" if damage == "empty" else _reseal(value, OTHER_CONFIG["layout"]))
    writer.close()
    cache = make_cache(cpu="4MiB", **opts)
    assert cache.lookup(toks) == 3 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    redis = next(t for t in cache.stats()["tiers"] if t["name"] == "redis")
    assert redis["corrupt"] == 1 and client.exists(name) == 0
    assert cache.lookup(toks) == BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)
    cache.close()


def test_a_remote_cache_ends_the_prefix_before_a_served_frame_whose_buffers_are_not_the_codecs(tmp_path):
    """The same over the wire: a server's disk holds such a frame (checksums good: the server
    took it, or it was forged there), the server serves it, and ``RemoteCache``'s decoder
    raised ``FrameError`` out of ``materialize``; the prefix now ends before it."""
    from server_helpers import Server

    toks, kv = tokens_for(28, 3 * BLOCK), make_kv(3 * BLOCK, 28)
    srv = Server(tmp_path, cpu_bytes="0")
    opts = dict(model_id="m", layout=cs.KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float16"),
                codec=cs.Raw(), block_tokens=BLOCK)
    with srv, cs.RemoteCache(srv.url, **opts) as remote:
        remote.ingest(toks, kv)
        keys = remote.block_hashes(toks)
    name = keys[1].hex()
    frame = srv.disk_path / name[:2] / f"{name}.frame"
    frame.write_bytes(_reseal(frame.read_bytes(), _swap_last_axes))
    with srv, cs.RemoteCache(srv.url, **opts) as remote:
        assert remote.lookup(toks) == 3 * BLOCK
        assert_prefix_equal(remote.materialize(toks), kv, BLOCK)


def test_a_fifo_in_place_of_a_data_file_is_damage_not_a_read_that_never_ends(tmp_path):
    """A named pipe where a block's data file was (put there after the start, so the start's
    scan did not drop it): the read's open waited for a writer that never came, and
    ``materialize`` with it, for good. It is now a counted miss, removed."""
    import os
    import threading

    toks, kv, keys = _stored(tmp_path, 29)
    cache = make_cache(cpu=0, disk=tmp_path / "d")
    frame, side = _files(tmp_path, keys[1])
    frame.unlink()
    os.mkfifo(frame)
    report = {}
    checking = threading.Thread(target=lambda: report.update(cache.store.tier("disk").check()), daemon=True)
    checking.start()
    checking.join(20)
    if checking.is_alive():
        os.close(os.open(frame, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("check() waited on the pipe")
    assert report == {"ok": 2, "corrupt": 1, "unreadable": 0, "other_version": 0}
    done, got = threading.Event(), []
    reader = threading.Thread(target=lambda: (got.append(cache.materialize(toks)), done.set()), daemon=True)
    reader.start()
    if not done.wait(20):
        fd = os.open(frame, os.O_WRONLY | os.O_NONBLOCK)  # the waiting open returns, and reads nothing
        os.close(fd)
        reader.join(20)
        pytest.fail("materialize waited on the pipe's open")
    assert_prefix_equal(got[0], kv, BLOCK)
    assert _disk(cache)["corrupt"] == 1
    assert not frame.exists() and not side.exists()
    cache.close()


def test_a_data_file_swapped_with_a_siblings_is_not_served(tmp_path):
    """Two blocks of one parent and position (two continuations of a prefix) have sidecars
    that agree with either's frame: only the frame's header, naming its block, tells them
    apart. Swapped (a backup restored into the wrong place, a bad copy), each is a counted
    miss, its files removed, never the other prompt's KV."""
    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame

    (a, fa), (b, fb) = raw_frame(1), raw_frame(2)
    disk = DiskTier(tmp_path / "d", 1 << 20, fsync=False)
    disk.put(a, fa)
    disk.put(b, fb)
    disk.close()
    path_a = tmp_path / "d" / a.hex()[:2] / f"{a.hex()}.frame"
    path_b = tmp_path / "d" / b.hex()[:2] / f"{b.hex()}.frame"
    data_a, data_b = path_a.read_bytes(), path_b.read_bytes()
    path_a.write_bytes(data_b)
    path_b.write_bytes(data_a)
    disk = DiskTier(tmp_path / "d", 1 << 20, fsync=False)
    assert disk.stats().blocks == 2  # (the sidecars agree with either frame: both indexed)
    assert disk.get(a) is None and disk.get(b) is None
    assert disk.stats().corrupt == 2 and not path_a.exists() and not path_b.exists()
    disk.close()
