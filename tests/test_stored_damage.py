"""Bytes at rest are untrusted: frames and sidecars damaged or forged on disk, read through
the real embedded ``PrefixCache`` over real files. A damaged block is a miss (the prefix
ends before it), counted in ``corrupt``, and removed; never decoded, never an exception."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import xxhash

import cacheseek as cs
from cacheseek.store.frame import ALIGN, MAGIC, PREAMBLE, parse_frame, payload_checksum
from store_helpers import BLOCK, assert_prefix_equal, make_cache, make_kv, tokens_for

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
    assert cache.store.tier("disk").check() == {"ok": 2, "corrupt": 1, "unreadable": 0}
    assert_prefix_equal(cache.materialize(toks), kv, BLOCK)  # the prefix ends before it
    disk = _disk(cache)
    assert disk["corrupt"] == 1 and disk["blocks"] == 2
    assert not frame.exists() and not side.exists()
    assert disk["raw_bytes"] == 2 * cache.layout.raw_nbytes(BLOCK)
    cache.close()
