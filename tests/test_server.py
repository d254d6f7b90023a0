"""The HTTP service, end to end: every test talks to a real `cacheseek serve` subprocess."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.store.frame import ALIGN, MAGIC, PREAMBLE, parse_frame
from server_helpers import Server, batch_body, bodies, cacheseek_command, raw_chain, raw_frame, split_batch

LIMITS = ("--max-frame-bytes", "256KiB", "--max-body-bytes", "1MiB", "--max-lookup-hashes", "1000")
BINARY = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("srv"), *LIMITS) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def stored_state(client: httpx.Client) -> list[tuple]:
    """What is stored, per tier: blocks, bytes and write counters (not read counters)."""
    return [(t["name"], t["blocks"], t["used_bytes"], t["bytes_in"], t["evictions"], t["write_errors"])
            for t in client.get("/v1/stats").json()["tiers"]]


# /v1/stats keys that count requests (they change with every call) rather than what is stored
_TRAFFIC_KEYS = {"uptime_seconds", "requests", "traffic", "frames_rejected", "frame_bytes_received",
                 "frame_bytes_sent", "lookup_latency"}


def stored_figures(client: httpx.Client, **kw) -> dict:
    """``/v1/stats`` less its request counters (and each tier's read counters)."""
    stats = client.get("/v1/stats", **kw).json()
    out = {k: v for k, v in stats.items() if k not in _TRAFFIC_KEYS}
    out["tiers"] = [{k: v for k, v in t.items() if k not in ("hits", "misses", "bytes_out", "read_seconds", "read_gbps")}
                    for t in stats["tiers"]]
    return out


def put(client, h: bytes, frame: bytes, **kw) -> httpx.Response:
    return client.put(f"/v1/blocks/{h.hex()}", content=frame, **kw)


# -- the happy paths --------------------------------------------------------------------------


def test_put_get_delete_roundtrip(client):
    h, frame = raw_frame(1)
    r = put(client, h, frame)
    assert r.status_code == 201 and r.json() == {"hash": h.hex(), "status": "stored", "durability": "durable",
                                              "errors": {}}
    assert put(client, h, frame).status_code == 200
    got = client.get(f"/v1/blocks/{h.hex()}")
    assert got.status_code == 200 and got.content == frame
    assert got.headers["content-type"] == "application/octet-stream" and got.headers["x-cacheseek-tier"] == "cpu"
    assert client.delete(f"/v1/blocks/{h.hex()}").status_code == 204
    assert client.delete(f"/v1/blocks/{h.hex()}").status_code == 404
    miss = client.get(f"/v1/blocks/{h.hex()}")
    assert miss.status_code == 404 and "not stored" in miss.json()["error"]


def test_batch_ingest_lookup_and_prefix_stream(client):
    chain = raw_chain(2, 4)
    r = client.post("/v1/blocks", content=batch_body([f for _, f in reversed(chain)]),
                    headers={"content-type": "application/vnd.cacheseek.frames"})
    assert r.status_code == 200
    assert [x["hash"] for x in r.json()] == [h.hex() for h, _ in reversed(chain)]
    assert {x["status"] for x in r.json()} == {"stored"}
    again = client.post("/v1/blocks", content=batch_body([chain[0][1]]))
    assert again.json()[0]["status"] == "present"

    hexes = [h.hex() for h, _ in chain]
    other = raw_frame(99)[0].hex()
    look = client.post("/v1/lookup", json={"hashes": hexes + [other] + hexes[:1]})
    assert look.json() == {"matched": 4, "tiers": ["cpu"] * 4}
    each = client.post("/v1/lookup", json={"hashes": [other, *hexes], "each": True}).json()
    assert each["matched"] == 0 and each["present"] == [False, True, True, True, True]

    for end in (3, 1):
        got = client.get(f"/v1/prefixes/{hexes[end]}")
        assert got.status_code == 200 and got.headers["x-cacheseek-blocks"] == str(end + 1)
        assert got.headers["content-type"] == "application/vnd.cacheseek.frames"
        assert split_batch(got.content) == [f for _, f in chain[: end + 1]]
    assert client.delete(f"/v1/blocks/{hexes[1]}").status_code == 204
    broken = client.get(f"/v1/prefixes/{hexes[3]}")
    assert broken.status_code == 404 and "not complete" in broken.json()["error"]
    assert client.post("/v1/lookup", json={"hashes": hexes}).json()["matched"] == 1


@pytest.mark.parametrize("eviction", ["arc", "lru"])
def test_a_block_read_one_by_one_is_used_and_not_the_first_victim(tmp_path, eviction):
    """``GET /v1/blocks/{hash}`` marked nothing used (no tier's read does: a prefix's reads are
    marked together, by the route): a block read ten times was the first one evicted."""
    blocks = [raw_frame(40 + i) for i in range(5)]
    frame_bytes = len(blocks[0][1])
    with Server(tmp_path, "--eviction", eviction, cpu_bytes=str(4 * frame_bytes + frame_bytes // 2),
                disk=False) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for h, frame in blocks[:4]:
            assert put(client, h, frame).status_code == 201
        for _ in range(3):
            assert client.get(f"/v1/blocks/{blocks[0][0].hex()}").content == blocks[0][1]
        assert put(client, *blocks[4]).status_code == 201
        held = [client.head(f"/v1/blocks/{h.hex()}").status_code for h, _ in blocks]
        assert held == [200, 404, 200, 200, 200], held  # the least recently used went: the second


def test_a_prefix_read_s_promotion_of_its_head_does_not_evict_its_own_tail(tmp_path):
    """A chain's head on disk, its tail only in a full CPU tier (the disk admits a block only
    once used twice): the read promoted the head from disk into the CPU tier, whose victim
    was the chain's own tail, before the read reached it: the answer was cut ("vanished
    while streaming"). The promotion now gives up a block of no chain being read instead."""
    a, c = raw_chain(31, 3), raw_chain(32, 3)
    frame_bytes = len(a[0][1])
    hexes = [h.hex() for h, _ in a]
    with Server(tmp_path, "--disk-admit-after-uses", "2", cpu_bytes=str(3 * frame_bytes + frame_bytes // 2)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        assert put(client, *a[0]).status_code == 201
        assert client.get(f"/v1/prefixes/{hexes[0]}").status_code == 200  # its second use: the disk admits it
        assert client.post("/v1/blocks", content=batch_body([f for _, f in c])).status_code == 200  # head: down
        assert client.post("/v1/blocks", content=batch_body([f for _, f in a[1:]])).status_code == 200
        assert client.get(f"/v1/prefixes/{c[0][0].hex()}").status_code == 200  # the tail the oldest in memory
        assert client.post("/v1/lookup", json={"hashes": hexes}).json()["tiers"] == ["disk", "cpu", "cpu"]
        try:
            got = client.get(f"/v1/prefixes/{hexes[-1]}")
        except httpx.RemoteProtocolError as exc:
            pytest.fail(f"the answer was cut: {exc}")
        assert got.status_code == 200 and split_batch(got.content) == [f for _, f in a]
        assert client.post("/v1/lookup", json={"hashes": hexes}).json()["tiers"] == ["cpu"] * 3
        cpu, disk = client.get("/v1/stats").json()["tiers"]
        assert (cpu["promotions"], cpu["write_errors"], disk["hits"]) == (1, 0, 1)


def test_a_binary_lookup_answers_as_the_json_one(client):
    for size in (16, 32):
        chain = raw_chain(7 + size, 3, hash_size=size)
        assert client.post("/v1/blocks", content=batch_body([f for _, f in chain])).status_code == 200
        hashes = [h for h, _ in chain]
        other = os.urandom(size)
        query = "?hash_bytes=32" if size == 32 else ""
        for asked in (hashes, hashes[:2], [*hashes[:1], other, hashes[2]], [other, *hashes], []):
            for each in (False, True):
                answer = client.post("/v1/lookup", json={"hashes": [h.hex() for h in asked], "each": each}).json()
                binary = client.post(f"/v1/lookup{query}{'&' if query else '?'}each={str(each).lower()}",
                                     content=b"".join(asked), headers=BINARY)
                assert binary.status_code == 200 and binary.json() == answer, (size, len(asked), each)
        each = client.post(f"/v1/lookup?each=true{query.replace('?', '&')}", content=b"".join([other, *hashes]),
                           headers=BINARY).json()
        assert each == {"matched": 0, "tiers": [], "present": [False, True, True, True], "durability": "durable",
                        "max_body_bytes": 1 << 20}  # (LIMITS): what a writer splits its frames under
    # Hashes of one size read as the other are other hashes: no match, never an error.
    assert client.post("/v1/lookup", content=b"".join(hashes), headers=BINARY).json()["matched"] == 0


def test_a_lookup_of_several_chains_answers_each_as_a_lookup_of_it_alone(client):
    """``?chains=`` (binary) or ``{"chains": [...]}``: one answer per chain, in order, each
    what a lookup of that chain alone answers; chains of no hash too."""
    for size in (16, 32):
        chain = raw_chain(90 + size, 3, hash_size=size)
        assert client.post("/v1/blocks", content=batch_body([f for _, f in chain])).status_code == 200
        hashes = [h for h, _ in chain]
        other = os.urandom(size)
        asked = [hashes, [other, *hashes], [], hashes[:2], [hashes[0], other, hashes[2]]]
        alone = [client.post("/v1/lookup", json={"hashes": [h.hex() for h in c]}).json() for c in asked]
        assert [a["matched"] for a in alone] == [3, 0, 0, 2, 1]
        query = f"?chains={','.join(str(len(c)) for c in asked)}" + ("&hash_bytes=32" if size == 32 else "")
        binary = client.post(f"/v1/lookup{query}", content=b"".join(h for c in asked for h in c), headers=BINARY)
        assert binary.status_code == 200 and binary.json() == {"chains": alone}
        as_json = client.post("/v1/lookup", json={"chains": [[h.hex() for h in c] for c in asked]})
        assert as_json.status_code == 200 and as_json.json() == {"chains": alone}


def test_a_lookup_of_more_chains_than_a_client_sends_is_refused_before_it_is_looked_up(tmp_path):
    """Each chain is a lookup of its own in the event loop: 65,536 empty chains (a 262 KB body)
    held every other client ~0.5 s, and 700,000 were parsed whole to be refused. RemoteCache
    sends at most LOOKUP_CHAINS in a body: a body of more is a 422 (and of more than
    max_lookup_hashes, as before, where that is lower)."""
    from cacheseek.remote import LOOKUP_CHAINS
    from server.routes.lookup import MAX_CHAINS

    assert MAX_CHAINS == LOOKUP_CHAINS == 1024
    with Server(tmp_path, disk=False) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        for n, status in ((1024, 200), (1025, 422), (20_000, 422)):
            r = client.post("/v1/lookup", json={"chains": [[]] * n})
            assert r.status_code == status, (n, r.text[:200])
            if status == 422:
                assert "at most 1,024 in a body" in r.json()["error"], r.text
            r = client.post(f"/v1/lookup?chains={','.join(['0'] * n)}", content=b"", headers=BINARY)
            assert r.status_code == status, (n, r.text[:200])
        assert len(client.post("/v1/lookup", json={"chains": [[]] * 1024}).json()["chains"]) == 1024


def test_sha256_hashes_and_kivi_frames_are_accepted(client):
    import cacheseek as cs

    h, frame = raw_frame(3, hash_size=32, codec=cs.KIVI(bits=4, group_size=32))
    assert put(client, h, frame).status_code == 201
    assert client.get(f"/v1/blocks/{h.hex()}").content == frame


def _with_stat(frame: bytes, name: str, index: int, value: float) -> bytes:
    """``frame`` with element ``index`` of stat buffer ``name`` set to ``value``, sealed again
    (a writer that skipped the encoder's check: the checksum holds)."""
    import struct

    from cacheseek.store.frame import seal_frame

    meta = parse_frame(frame)
    entry = meta.entry(name)
    fmt, size = {"float16": ("<e", 2), "float32": ("<f", 4)}[entry.dtype]
    out = bytearray(frame)
    struct.pack_into(fmt, out, meta.payload_offset + entry.offset + index * size, value)
    seal_frame(meta, out)
    return bytes(out)


@pytest.mark.parametrize("stats", ["float16", "float32"])
def test_a_kivi_frame_whose_stats_are_not_finite_or_whose_scale_is_negative_is_refused(client, stats):
    """A client that bypasses the encoder's NaN check could store stats every reader decodes
    into NaN KV; the server refuses them (400, counted as malformed), and a batch holding one
    stores nothing."""
    codec = cs.KIVI(bits=4, group_size=32, stats_dtype=stats)
    nan, inf = float("nan"), float("inf")
    for name, index, value, said in (("k.scale", 0, nan, "k.scale: holds NaN or Inf"),
                                     ("v.min", 7, -inf, "v.min: holds NaN or Inf"),
                                     ("k.min", 3, inf, "k.min: holds NaN or Inf"),
                                     ("v.scale", 5, -0.5, "v.scale: 1 negative scale")):
        h, good = raw_frame(60, codec=codec)
        bad = _with_stat(good, name, index, value)
        before = stored_figures(client)
        rejected = client.get("/v1/stats").json().get("frames_rejected", {})
        r = put(client, h, bad)
        assert r.status_code == 400 and r.json()["error"].startswith(f"frame: {said}"), r.text
        chain = raw_chain(61, 3, codec=codec)
        frames = [f for _, f in chain]
        frames[1] = _with_stat(frames[1], name, index, value)
        r = client.post("/v1/blocks", content=batch_body(frames))
        assert r.status_code == 400 and r.json()["error"].startswith(f"frame 1: {said}"), r.text
        assert r.json()["frame"] == 1
        assert stored_figures(client) == before
        assert client.post("/v1/lookup", json={"hashes": [x.hex() for x, _ in chain]}).json()["matched"] == 0
        assert client.get(f"/v1/blocks/{h.hex()}").status_code == 404
        assert client.get("/v1/stats").json()["frames_rejected"]["malformed"] == rejected.get("malformed", 0) + 2
    # A -0.0 scale (a group of zeros) and the valid frame itself are stored.
    h, good = raw_frame(62, codec=codec)
    assert put(client, h, _with_stat(good, "k.scale", 0, -0.0)).status_code == 201
    h, good = raw_frame(63, codec=codec)
    assert put(client, h, good).status_code == 201
    assert client.get(f"/v1/blocks/{h.hex()}").content == good


# -- bad input: the answer, and nothing stored changes ----------------------------------------


def _relaid(frame: bytes, **changes) -> bytes:
    """``frame`` with header fields changed and laid out again (checksums right)."""
    meta = parse_frame(frame)
    header = msgpack.unpackb(frame[PREAMBLE.size : PREAMBLE.size + meta.header_nbytes], raw=False)
    packed = msgpack.packb({**header, **changes}, use_bin_type=True)
    offset = -(-(PREAMBLE.size + len(packed)) // ALIGN) * ALIGN
    preamble = PREAMBLE.pack(MAGIC, len(packed), xxhash.xxh3_64_intdigest(packed))
    return preamble + packed + bytes(offset - PREAMBLE.size - len(packed)) + frame[meta.payload_offset :]


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def _bad_cases():
    h, frame = raw_frame(10)
    meta = parse_frame(frame)
    flipped = bytearray(frame)
    flipped[-7] ^= 1
    h2, frame2 = raw_frame(11)
    big_h, big = raw_frame(12, block=320)  # 320 KiB of payload: over max_frame_bytes
    child_h, child = raw_frame(13, position=5, parent=h)  # its parent (stored below) is at position 0
    n = len(frame).to_bytes(8, "little")
    layout = msgpack.unpackb(frame[PREAMBLE.size : PREAMBLE.size + meta.header_nbytes], raw=False)["layout"]
    deep_codec = _relaid(frame, codec={"name": "raw", "version": _nested(1000)})
    deep_layout = _relaid(frame, layout={**layout, "num_layers": _nested(1000)})
    return [
        # (name, method, path, kwargs, status, reason fragment)
        ("random bytes", "PUT", f"/v1/blocks/{h.hex()}", dict(content=os.urandom(500)), 400, "magic"),
        ("empty body", "PUT", f"/v1/blocks/{h.hex()}", dict(content=b""), 400, "truncated"),
        ("truncated frame", "PUT", f"/v1/blocks/{h.hex()}", dict(content=frame[:-100]), 400, "truncated"),
        ("trailing bytes", "PUT", f"/v1/blocks/{h.hex()}", dict(content=frame + b"x"), 400, "trailing"),
        ("bad checksum", "PUT", f"/v1/blocks/{h.hex()}", dict(content=bytes(flipped)), 400, "checksum"),
        ("header only", "PUT", f"/v1/blocks/{h.hex()}", dict(content=frame[: meta.payload_offset]), 400, "truncated"),
        ("hash not the URL's", "PUT", f"/v1/blocks/{h2.hex()}", dict(content=frame), 409, "not the URL"),
        ("bad hash in URL", "PUT", "/v1/blocks/xyz", dict(content=frame), 400, "hex"),
        ("uppercase hash", "GET", f"/v1/blocks/{h.hex().upper()}", {}, 400, "hex"),
        ("frame over the limit", "PUT", f"/v1/blocks/{big_h.hex()}", dict(content=big), 413, "max_frame_bytes"),
        ("codec nested 1000 deep", "PUT", f"/v1/blocks/{h.hex()}", dict(content=deep_codec), 400, "nested too deep"),
        ("layout nested 1000 deep", "POST", "/v1/blocks", dict(content=batch_body([deep_layout])), 400, "nested"),
        ("position contradicts parent", "PUT", f"/v1/blocks/{child_h.hex()}", dict(content=child), 400, "position"),
        ("batch cut mid-frame", "POST", "/v1/blocks", dict(content=batch_body([frame2])[:-10]), 400, "ended"),
        ("batch cut in a length", "POST", "/v1/blocks", dict(content=batch_body([frame2]) + b"\x01\x02"), 400, "length"),
        ("batch huge length", "POST", "/v1/blocks", dict(content=(2**63).to_bytes(8, "little") + frame2), 413,
         "max_frame_bytes"),
        ("batch length past the body limit", "POST", "/v1/blocks",
         dict(content=batch_body([frame2] * 25) + (250_000).to_bytes(8, "little")), 413, "max_body_bytes"),
        ("batch tiny length", "POST", "/v1/blocks", dict(content=(5).to_bytes(8, "little") + b"12345"), 400, "preamble"),
        ("batch with one bad frame", "POST", "/v1/blocks", dict(content=batch_body([frame2, bytes(flipped), frame2])),
         400, "frame 1"),
        ("batch with a random frame", "POST", "/v1/blocks", dict(content=n + os.urandom(len(frame))), 400, "frame 0"),
        ("body over the limit", "POST", "/v1/blocks", dict(content=batch_body([frame2]) * 40), 413, "max_body_bytes"),
        # (its bound exactly: a declared length one byte past max_body_bytes is refused unread; at it, read)
        ("body one byte over the limit", "POST", "/v1/blocks", dict(content=bytes((1 << 20) + 1)), 413, "max_body_bytes"),
        ("body at the limit", "POST", "/v1/blocks", dict(content=bytes(1 << 20)), 400, "preamble"),
        ("lookup not JSON", "POST", "/v1/lookup", dict(content=b"{not json"), 422, ""),
        ("lookup wrong type", "POST", "/v1/lookup", dict(json={"hashes": "abc"}), 422, "hashes"),
        ("lookup bad hex", "POST", "/v1/lookup", dict(json={"hashes": ["zz" * 16]}), 422, "hashes"),
        ("lookup extra field", "POST", "/v1/lookup", dict(json={"hashes": [], "x": 1}), 422, "x"),
        ("lookup mixed sizes", "POST", "/v1/lookup", dict(json={"hashes": ["00" * 16, "00" * 32]}), 422, "size"),
        ("lookup too many", "POST", "/v1/lookup", dict(json={"hashes": ["00" * 16] * 1001}), 422, "at most"),
        ("lookup uppercase hex", "POST", "/v1/lookup", dict(json={"hashes": ["00" * 16, "AB" * 16]}), 422, "hashes.1"),
        ("lookup hex with spaces", "POST", "/v1/lookup", dict(json={"hashes": ["00 " * 10 + "00"]}), 422, "hex"),
        ("binary lookup cut hash", "POST", "/v1/lookup", dict(content=bytes(40), headers=BINARY), 422, "whole number"),
        ("binary lookup bad size", "POST", "/v1/lookup?hash_bytes=20", dict(content=bytes(40), headers=BINARY), 422,
         "hash_bytes"),
        ("binary lookup bad flag", "POST", "/v1/lookup?each=maybe", dict(content=bytes(32), headers=BINARY), 422,
         "each"),
        ("binary lookup too many", "POST", "/v1/lookup", dict(content=bytes(16 * 1001), headers=BINARY), 422,
         "at most"),
        ("binary lookup as JSON", "POST", "/v1/lookup", dict(content=bytes(32)), 422, "JSON"),
        ("chains not a number", "POST", "/v1/lookup?chains=1,x", dict(content=bytes(32), headers=BINARY), 422,
         "chains[1]"),
        ("chains not the body's", "POST", "/v1/lookup?chains=1,1", dict(content=bytes(48), headers=BINARY), 422,
         "add up"),
        ("chains too many hashes", "POST", "/v1/lookup?chains=600,401", dict(content=bytes(16 * 1001), headers=BINARY),
         422, "at most"),
        ("chains too many", "POST", "/v1/lookup?chains=" + ",".join(["0"] * 1001), dict(content=b"", headers=BINARY),
         422, "at most"),
        ("chains with each", "POST", "/v1/lookup?chains=2&each=true", dict(content=bytes(32), headers=BINARY), 422,
         "each"),
        ("JSON chains bad hex", "POST", "/v1/lookup", dict(json={"chains": [["00" * 16], ["00" * 16, "AB" * 16]]}),
         422, "chains.1.1"),
        ("JSON chains and hashes", "POST", "/v1/lookup", dict(json={"hashes": [], "chains": []}), 422, "not both"),
        ("JSON neither", "POST", "/v1/lookup", dict(json={}), 422, "not both or neither"),
        ("JSON chains too many hashes", "POST", "/v1/lookup",
         dict(json={"chains": [["00" * 16] * 600, ["00" * 16] * 401]}), 422, "at most"),
        ("JSON chains not lists", "POST", "/v1/lookup", dict(json={"chains": ["00" * 16]}), 422, "chains"),
        ("prefetch of chains", "POST", "/v1/prefetch?chains=1", dict(content=bytes(16), headers=BINARY), 422,
         "chains"),
        ("bad namespace", "GET", f"/v1/blocks/{h.hex()}", dict(headers={"X-CacheSeek-Namespace": "a b"}), 400,
         "Namespace"),
        ("missing block", "GET", f"/v1/blocks/{h2.hex()}", {}, 404, "not stored"),
        ("missing chain", "GET", f"/v1/prefixes/{h2.hex()}", {}, 404, "not stored"),
        ("delete missing", "DELETE", f"/v1/blocks/{h2.hex()}", {}, 404, "not stored"),
        ("unknown route", "GET", "/v1/nothing", {}, 404, ""),
        ("wrong method", "PATCH", f"/v1/blocks/{h.hex()}", {}, 405, ""),
    ], (h, frame)


def test_each_kind_of_bad_input_gets_its_status_and_changes_nothing(client):
    cases, (h, frame) = _bad_cases()
    assert put(client, h, frame).status_code == 201  # the parent of "position contradicts parent"
    for name, method, path, kw, status, reason in cases:
        before = stored_figures(client)
        r = client.request(method, path, **kw)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert "error" in r.json() and reason in r.json()["error"], (name, r.text)
        assert stored_figures(client) == before, name
        assert bodies(client)["in_flight_bytes"] == 0, name
    assert client.get(f"/v1/blocks/{h.hex()}").content == frame


def test_a_method_a_path_does_not_take_names_every_method_it_does(client):
    """RFC 9110: a 405's Allow lists the resource's methods. Starlette named those of the
    first route on the path only: PUT for a block, which GET and DELETE serve too."""
    h = bytes([0xE1]) * 16
    for method, path, allowed in (("PATCH", f"/v1/blocks/{h.hex()}", "GET, HEAD, PUT, DELETE"),
                                  ("POST", "/healthz", "GET, HEAD"), ("HEAD", "/v1/lookup", "POST"),
                                  ("GET", "/v1/blocks", "POST"), ("PUT", "/v1/lookup", "POST")):
        r = client.request(method, path)
        assert (r.status_code, r.headers["allow"]) == (405, allowed), (method, path, r.headers)


def test_a_path_with_a_slash_after_it_is_an_unknown_route_not_a_redirect_to_the_host_header(client):
    """Starlette answered a route's path with a "/" added by an empty 307 to the same path
    on whatever host the request's Host header named: bodiless, not the JSON every other
    refusal is, and a redirect that names a host the client made up."""
    h, frame = raw_frame(31)
    before = stored_state(client)
    for method, path in (("GET", "/v1/stats/"), ("PUT", f"/v1/blocks/{h.hex()}/"), ("POST", "/v1/lookup/"),
                         ("GET", "/dashboard/")):
        r = client.request(method, path, content=frame if method == "PUT" else None,
                           headers={"host": "elsewhere.example"})
        assert r.status_code == 404 and "location" not in r.headers and r.json()["error"], (method, path, r.headers)
    assert stored_state(client) == before


def test_a_block_stored_before_its_parent_is_checked_when_the_parent_arrives(client):
    """A link is checked whichever end arrives first, so two writes cannot store a cycle of
    parents (which eviction's walk to a leaf would never leave)."""
    a, b = bytes([0xA1]) * 16, bytes([0xB1]) * 16
    _, frame_a = raw_frame(41, block_hash=a, parent=b, position=5)
    _, frame_b = raw_frame(42, block_hash=b, parent=a, position=6)
    assert put(client, a, frame_a).status_code == 201  # its parent is not stored: nothing to check yet
    before = stored_figures(client)
    for r in (put(client, b, frame_b), client.post("/v1/blocks", content=batch_body([frame_b]))):
        assert r.status_code == 400 and "is at position 5" in r.json()["error"], r.text
        assert stored_figures(client) == before
    _, good_b = raw_frame(43, block_hash=b, parent=bytes(16), position=4)
    assert put(client, b, good_b).status_code == 201  # at 4, as A's link to it says
    for h in (a, b):
        assert client.delete(f"/v1/blocks/{h.hex()}").status_code == 204


def test_a_batch_naming_one_hash_at_two_positions_is_refused(client):
    """The batch's copy of a parent is what its children are checked against: a hash sent
    twice at two positions let one link pass against the copy not stored, and a batch
    stored a cycle of parents (an admin chain delete then walked it for good)."""
    h, k = bytes([0xC1]) * 16, bytes([0xD1]) * 16
    _, at_2 = raw_frame(44, block_hash=h, parent=k, position=2)
    _, at_0 = raw_frame(45, block_hash=h, position=0)
    _, child = raw_frame(46, block_hash=k, parent=h, position=1)
    before = stored_figures(client)
    r = client.post("/v1/blocks", content=batch_body([at_2, at_0, child]))
    assert r.status_code == 400 and "also frame" in r.json()["error"], r.text
    assert stored_figures(client) == before
    assert client.get(f"/v1/blocks/{h.hex()}").status_code == 404
    # The same frame twice is no contradiction.
    r = client.post("/v1/blocks", content=batch_body([at_0, at_0, child]))
    assert r.status_code == 200 and [x["status"] for x in r.json()] == ["stored", "present", "stored"], r.text
    assert client.get(f"/v1/prefixes/{k.hex()}").status_code == 200
    for x in (k, h):
        assert client.delete(f"/v1/blocks/{x.hex()}").status_code == 204


def test_a_batch_naming_a_stored_hash_at_another_position_is_refused(client):
    """A parent in the batch is what its children are checked against, and a stored copy is
    not written again: the batch's copy at another position than the stored one let a link
    pass that the store contradicts (here, closing a cycle of parents: A at 5 -> B, B at 4 -> A)."""
    a, b = bytes([0xE1]) * 16, bytes([0xF1]) * 16
    _, a_at_5 = raw_frame(47, block_hash=a, parent=b, position=5)
    _, a_at_3 = raw_frame(48, block_hash=a, parent=bytes(16), position=3)
    _, b_at_4 = raw_frame(49, block_hash=b, parent=a, position=4)
    assert put(client, a, a_at_5).status_code == 201  # its parent is not stored: nothing to check yet
    before = stored_figures(client)
    r = client.post("/v1/blocks", content=batch_body([a_at_3, b_at_4]))
    assert r.status_code == 400 and "stored at position 5" in r.json()["error"], r.text
    assert stored_figures(client) == before
    assert client.get(f"/v1/blocks/{b.hex()}").status_code == 404
    # At its stored position, the batch's copy stands for the stored one: found present.
    _, a_again = raw_frame(50, block_hash=a, parent=b, position=5)
    _, child = raw_frame(51, parent=a, position=6)
    r = client.post("/v1/blocks", content=batch_body([a_again, child]))
    assert r.status_code == 200 and [x["status"] for x in r.json()] == ["present", "stored"], r.text
    for x in (parse_frame(child).block_hash, a):
        assert client.delete(f"/v1/blocks/{x.hex()}").status_code == 204

_, _GOOD = raw_frame(20)
_GOOD_HASH = parse_frame(_GOOD).block_hash
_META = parse_frame(_GOOD)
# Bytes a flip must change the meaning of: the preamble, the header and the payload (not the zero padding).
_SIGNIFICANT = list(range(16 + _META.header_nbytes)) + list(range(_META.payload_offset, len(_GOOD)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_is_always_a_400_and_stores_nothing(client, data):
    kind = data.draw(st.sampled_from(["random", "truncate", "flip", "batch-random", "batch-length"]))
    path, body = f"/v1/blocks/{_GOOD_HASH.hex()}", None
    if kind == "random":
        body = data.draw(st.binary(max_size=4096))
    elif kind == "truncate":
        body = _GOOD[: data.draw(st.integers(0, len(_GOOD) - 1))]
    elif kind == "flip":
        pos = data.draw(st.sampled_from(_SIGNIFICANT))
        body = bytearray(_GOOD)
        body[pos] ^= 1 << data.draw(st.integers(0, 7))
        body = bytes(body)
    elif kind == "batch-random":
        path, body = "/v1/blocks", data.draw(st.binary(min_size=1, max_size=4096))
    else:
        length = data.draw(st.integers(0, 2**64 - 1))
        path, body = "/v1/blocks", length.to_bytes(8, "little") + _GOOD[: data.draw(st.integers(0, 2048))]
    before = stored_figures(client)
    method = "POST" if path == "/v1/blocks" else "PUT"
    r = client.request(method, path, content=body)
    assert r.status_code in (400, 409, 413), (kind, r.status_code, r.text)
    assert r.json()["error"]
    assert stored_figures(client) == before


# -- operations -------------------------------------------------------------------------------


def test_metrics_are_prometheus_text_with_the_series(client):
    from prometheus_client.parser import text_string_to_metric_families

    h, frame = raw_frame(30)
    put(client, h, frame)
    client.get(f"/v1/blocks/{h.hex()}")
    put(client, h, frame[:-1])
    client.get("/v1/stats")  # the route below is checked by name: this test calls it, not an earlier one
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("cacheseek_tier_hits", "cacheseek_tier_misses", "cacheseek_tier_evictions",
                 "cacheseek_tier_corrupt_frames", "cacheseek_tier_used_bytes", "cacheseek_tier_bytes_in",
                 "cacheseek_tier_bytes_out", "cacheseek_http_request_duration_seconds", "cacheseek_http_requests",
                 "cacheseek_frames_rejected"):
        assert name in families, name
    routes = {s.labels.get("route") for s in families["cacheseek_http_request_duration_seconds"].samples}
    assert {"/v1/blocks/{hash}", "/v1/stats"} <= routes
    tiers = {s.labels["tier"] for s in families["cacheseek_tier_used_bytes"].samples}
    assert tiers == {"cpu", "disk"}
    rejected = {s.labels["reason"]: s.value for s in families["cacheseek_frames_rejected"].samples
                if s.name.endswith("_total")}
    assert rejected.get("malformed", 0) >= 1


def test_openapi_states_the_write_answers_and_the_traffic_headers(client):
    """The PUT answers' example said "stored" for the 200 (a real one says "present") and had
    no durability; the write answers' schemas were empty, so a generated client got untyped
    results; and the headers that count a client's traffic per model and in tokens were
    missing, so a client generated from the document showed under the model ""."""
    paths = client.get("/openapi.json").json()["paths"]
    put = paths["/v1/blocks/{hash}"]["put"]["responses"]
    for status, word in (("200", "present"), ("201", "stored")):
        answer = put[status]["content"]["application/json"]
        assert answer["example"]["status"] == word and answer["example"]["durability"] == "durable", answer
        schema = answer["schema"]
        assert set(schema["required"]) == {"hash", "status", "durability", "errors"}, schema
        assert schema["properties"]["status"]["enum"] == ["stored", "present", "failed"]
        assert schema["properties"]["durability"]["enum"] == ["durable", "memory"]
    failed = put["507"]["content"]["application/json"]["schema"]
    assert {"error", "errors", "status"} <= set(failed["properties"]), failed
    batch = paths["/v1/blocks"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert batch["type"] == "array" and "durability" in batch["items"]["required"], batch
    counted = {"X-CacheSeek-Model", "X-CacheSeek-Block-Tokens"}
    lookup = {"X-CacheSeek-Tokens", "X-CacheSeek-Continues", "X-CacheSeek-Again"}
    for path, method in (("/v1/blocks/{hash}", "put"), ("/v1/blocks", "post"), ("/v1/blocks/{hash}", "get"),
                         ("/v1/prefixes/{hash}", "get"), ("/v1/lookup", "post")):
        headers = {p["name"] for p in paths[path][method]["parameters"] if p["in"] == "header"}
        assert counted <= headers and (lookup <= headers) == (path == "/v1/lookup"), (path, method, headers)
    # Real answers are what the schemas say (tests/test_fuzz.py checks every route's).
    h, frame = raw_frame(90)
    first, again = client.put(f"/v1/blocks/{h.hex()}", content=frame), client.put(f"/v1/blocks/{h.hex()}", content=frame)
    assert (first.status_code, first.json()["status"]) == (201, "stored"), first.text
    assert (again.status_code, again.json()["status"]) == (200, "present"), again.text
    assert set(again.json()) == {"hash", "status", "durability", "errors"}


def test_openapi_docs_health_and_stats(client):
    doc = client.get("/openapi.json").json()
    try:
        from openapi_spec_validator import validate
    except ImportError:  # pragma: no cover
        validate = None
    if validate is not None:
        validate(doc)
    paths = doc["paths"]
    assert {"put", "get", "delete"} <= set(paths["/v1/blocks/{hash}"]) and "post" in paths["/v1/blocks"]
    assert {"/v1/prefixes/{hash}", "/v1/lookup", "/v1/stats", "/metrics", "/healthz", "/readyz"} <= set(paths)
    put_body = paths["/v1/blocks/{hash}"]["put"]["requestBody"]["content"]
    assert "application/octet-stream" in put_body
    lookup = paths["/v1/lookup"]["post"]
    assert {"application/json", "application/octet-stream"} <= set(lookup["requestBody"]["content"])
    assert "hashes" in lookup["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"hash_bytes", "each", "X-CacheSeek-Namespace"} <= {p["name"] for p in lookup["parameters"]}
    assert lookup["security"] == [{"HTTPBearer": []}] and "HTTPBearer" in doc["components"]["securitySchemes"]
    assert "LookupResponse" in str(lookup["responses"]["200"])
    assert client.get("/docs").status_code == 200
    assert client.get("/healthz").json() == {"status": "ok"}
    # The fast receive path is on (a uvicorn outside the pinned range, or one whose internals
    # changed, turns it off: this fails then, as the server's start warns).
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["kernels"] == "not used" and "clients" in ready["kernels_reason"]
    assert ready["receive_path"] == "in-place"
    # The document states what the routes answer: 400 for bad input, 422 only for lookup bodies,
    # and the pattern of a block hash.
    for path, ops in paths.items():
        for method, op in ops.items():
            assert ("422" in op["responses"]) == ((path, method) in {("/v1/lookup", "post"), ("/v1/prefetch", "post")}), (path, method)
            if path.startswith("/v1/"):
                assert "400" in op["responses"], (path, method)
            for param in op.get("parameters", []):
                if param["name"] == "hash":
                    assert param["schema"]["pattern"] == "^([0-9a-f]{32}|[0-9a-f]{64})$"
    stats = client.get("/v1/stats").json()
    assert [t["name"] for t in stats["tiers"]] == ["cpu", "disk"]
    for key in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions", "bytes_in", "bytes_out",
                "compression_ratio", "corrupt"):
        assert key in stats["tiers"][0], key
    assert "compression_ratio" in stats


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see a process's libraries")
def test_the_serving_process_never_loads_torch(srv, client):
    maps = Path(f"/proc/{srv.proc.pid}/maps")
    h, frame = raw_frame(40)
    put(client, h, frame)
    client.get(f"/v1/prefixes/{h.hex()}")
    assert "libtorch" not in maps.read_text()


# -- auth and namespaces ----------------------------------------------------------------------


def test_tokens_401_403_and_read_only(tmp_path):
    tenants = json.dumps({"team-a": {"read_token": "a-read", "write_token": "a-write"}})
    env = {"CACHESEEK_READ_TOKEN": "r-token", "CACHESEEK_WRITE_TOKEN": "w-token", "CACHESEEK_TENANTS": tenants}
    h, frame = raw_frame(50)
    path = f"/v1/blocks/{h.hex()}"
    with Server(tmp_path, disk=False, env=env) as srv, httpx.Client(base_url=srv.url) as c:
        def auth(token: str, ns: str | None = None) -> dict:
            return {"Authorization": f"Bearer {token}", **({"X-CacheSeek-Namespace": ns} if ns is not None else {})}

        before = stored_figures(c, headers=auth("r-token"))
        r = c.put(path, content=frame)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and r.json()["error"]
        assert c.put(path, content=frame, headers={"Authorization": "Basic eDp5"}).status_code == 401
        assert c.put(path, content=frame, headers=auth("w-tokeN")).status_code == 403
        assert c.put(path, content=frame, headers=auth("r-token")).status_code == 403
        assert c.put(path, content=frame, headers=auth("a-read")).status_code == 403
        assert c.put(path, content=frame, headers=auth("a-write", "team-b")).status_code == 403
        assert c.get("/v1/stats").status_code == 401
        assert stored_figures(c, headers=auth("r-token")) == before
        assert c.put(path, content=frame, headers=auth("w-token")).status_code == 201
        assert c.get(path, headers=auth("r-token")).content == frame
        # A tenant's token works in its own namespace only, and sees only its own blocks.
        assert c.get(path, headers=auth("a-read")).status_code == 404
        assert c.put(path, content=frame, headers=auth("a-write")).status_code == 201
        assert c.get(path, headers=auth("a-read", "team-a")).content == frame
        assert c.get(path, headers=auth("w-token", "team-a")).content == frame
        assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=auth("a-read")).status_code == 403  # (it shows every namespace)
        assert c.get("/metrics", headers=auth("r-token")).status_code == 200
        # The lean lookup route checks callers as the other routes do, for either body.
        for kw in (dict(json={"hashes": [h.hex()]}), dict(content=h, headers=BINARY)):
            headers = kw.pop("headers", {})
            look = lambda more=None: c.post("/v1/lookup", **kw, headers={**headers, **(more or {})})  # noqa: E731
            r = look()
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert look({"Authorization": "Basic eDp5"}).status_code == 401
            assert look(auth("r-tokeN")).status_code == 403
            assert look(auth("a-read", "team-b")).status_code == 403
            assert look(auth("r-token", "a b")).status_code == 400
            assert look(auth("r-token")).json()["matched"] == 1
            assert look(auth("a-read")).json()["matched"] == 1  # team-a's own block
            assert look(auth("r-token", "team-c")).json()["matched"] == 0
        # A lookup of several chains: the same callers, the same namespaces.
        def chains(more=None):
            return c.post("/v1/lookup?chains=1,1", content=h + h, headers={**BINARY, **(more or {})})

        assert chains().status_code == 401 and chains(auth("a-read", "team-b")).status_code == 403
        assert [x["matched"] for x in chains(auth("a-read")).json()["chains"]] == [1, 1]
        assert [x["matched"] for x in chains(auth("r-token", "team-c")).json()["chains"]] == [0, 0]
        # A RemoteCache of a tenant's token names the tenant's namespace: one that named none
        # (its keys made without it) was taken as the tenant's, and never shared a block with
        # one that named it. Refused, saying which to name.
        refused = c.put(path, content=frame, headers=auth("a-write", ""))
        assert refused.status_code == 403 and "bound to namespace 'team-a', not ''" in refused.text
        layout = cs.KVLayout(2, 2, 64, "float16")
        unnamed = cs.RemoteCache(srv.url, model_id="m", layout=layout, codec=cs.Raw(), block_tokens=32, token="a-write")
        with unnamed, pytest.raises(cs.ConfigError, match="bound to namespace 'team-a'"):
            unnamed.check_token(write=True)
        named = cs.RemoteCache(srv.url, model_id="m", layout=layout, codec=cs.Raw(), block_tokens=32, token="a-write",
                               namespace="team-a")
        with named:
            named.check_token(write=True)


def test_namespaces_never_share_blocks_and_survive_a_restart(tmp_path):
    chain = raw_chain(60, 3)
    hexes = [h.hex() for h, _ in chain]
    a, b = {"X-CacheSeek-Namespace": "tenant-a"}, {"X-CacheSeek-Namespace": "tenant-b"}
    for round_ in range(2):
        with Server(tmp_path) as srv, httpx.Client(base_url=srv.url) as c:
            if round_ == 0:
                assert c.post("/v1/blocks", content=batch_body([f for _, f in chain]), headers=a).status_code == 200
            # Everything comes back in tenant-a exactly as sent (hashes in the headers included).
            assert c.get(f"/v1/blocks/{hexes[1]}", headers=a).content == chain[1][1]
            assert split_batch(c.get(f"/v1/prefixes/{hexes[2]}", headers=a).content) == [f for _, f in chain]
            assert c.post("/v1/lookup", json={"hashes": hexes}, headers=a).json()["matched"] == 3
            # Other namespaces, the default one included, see nothing (after the restart, tenant-b
            # holds its own block under hexes[0], stored below).
            for other in ((b, {}) if round_ == 0 else ({},)):
                assert c.post("/v1/lookup", json={"hashes": hexes, "each": True}, headers=other).json() == {
                    "matched": 0, "tiers": [], "present": [False] * 3, "durability": "durable",
                    "max_body_bytes": 2 << 30}
                assert c.get(f"/v1/blocks/{hexes[0]}", headers=other).status_code == 404
                assert c.get(f"/v1/prefixes/{hexes[2]}", headers=other).status_code == 404
                assert c.delete(f"/v1/blocks/{hexes[0]}", headers=other).status_code == 404
            if round_ == 0:
                # tenant-b storing the same hash gets its own block; tenant-a's is untouched.
                _, imposter = raw_frame(61, block_hash=chain[0][0])
                assert c.put(f"/v1/blocks/{hexes[0]}", content=imposter, headers=b).status_code == 201
                assert c.get(f"/v1/blocks/{hexes[0]}", headers=b).content == imposter
                assert c.get(f"/v1/blocks/{hexes[0]}", headers=a).content == chain[0][1]
            else:
                assert c.get(f"/v1/blocks/{hexes[0]}", headers=b).content == raw_frame(61, block_hash=chain[0][0])[1]
                assert c.post("/v1/lookup", json={"hashes": hexes}, headers=b).json()["matched"] == 1
    assert (tmp_path / "disk" / ".namespace-key").stat().st_mode & 0o777 == 0o600


# -- settings and the command -----------------------------------------------------------------


def test_settings_come_from_flags_env_and_a_file(tmp_path):
    from cacheseek.server.config import ServerSettings, default_disk_path

    toml = tmp_path / "cs.toml"
    toml.write_text('cpu_bytes = "1GiB"\nport = 9000\nmax_frame_bytes = "64MiB"\n')
    yaml = tmp_path / "cs.yaml"
    yaml.write_text("cacheseek:\n  cpu_bytes: 2GiB\n  write_through: false\n")
    s = ServerSettings.load(toml)
    assert (s.cpu_bytes, s.port, s.max_frame_bytes) == (1 << 30, 9000, 64 << 20)
    assert ServerSettings.load(yaml).write_through is False
    os.environ["CACHESEEK_PORT"] = "9100"
    try:
        assert ServerSettings.load(toml).port == 9100  # env beats the file
        assert ServerSettings.load(toml, port=9200).port == 9200  # flags beat env
    finally:
        del os.environ["CACHESEEK_PORT"]
    assert ServerSettings.load().disk_path == default_disk_path()
    assert str(default_disk_path()).endswith("cacheseek/store")
    # The CPU tier's reserve for frames being received: an eighth of its budget, at most 1 GiB.
    assert s.cpu_reserve_bytes == 128 << 20
    assert ServerSettings.load(cpu_bytes="64GiB").cpu_reserve_bytes == 1 << 30
    assert ServerSettings.load(toml, cpu_reserve_bytes="0").cpu_reserve_bytes == 0


def test_a_first_start_on_a_filesystem_without_hard_links_makes_its_namespace_key(tmp_path, monkeypatch):
    """exFAT, FAT and FUSE mounts of object stores have no link(2): the namespace key, made by
    a hard link, stopped the first start with a traceback (exit 3), the disk tier open. Here
    ``os.link`` refuses as there (EPERM) in the server's process: the key is made in place,
    and a restart keeps it (a namespace's block found again)."""
    import server_helpers

    script = tmp_path / "no_hard_links.py"
    script.write_text("import errno, os\n"
                      "def link(*args, **kwargs):\n"
                      "    raise OSError(errno.EPERM, 'Operation not permitted')\n"
                      "os.link = link\n"
                      "from cacheseek.server.cli import run\n"
                      "run()\n")
    monkeypatch.setattr(server_helpers, "cacheseek_command", lambda: [sys.executable, str(script)])
    [(h, frame)] = raw_chain(62, 1)
    a = {"X-CacheSeek-Namespace": "tenant-a"}
    with Server(tmp_path) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame, headers=a).status_code == 201
    key_file = srv.disk_path / ".namespace-key"
    key = key_file.read_bytes()
    assert len(key) == 32 and key_file.stat().st_mode & 0o777 == 0o600
    assert not list(srv.disk_path.glob(".namespace-key.*"))  # (its temporary file removed)
    with Server(tmp_path) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get(f"/v1/blocks/{h.hex()}", headers=a).content == frame
    assert key_file.read_bytes() == key
    assert "Traceback" not in srv.output()


def test_without_hard_links_the_first_start_to_make_the_namespace_key_wins(tmp_path, monkeypatch):
    # Another start made the key file between this one's link refused and its own create: this
    # one takes that key (as a lost link race did), never writes its own over it.
    from cacheseek.server import namespaces

    theirs = b"k" * 32

    def link(src, dst):
        Path(dst).write_bytes(theirs)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(namespaces.os, "link", link)
    assert namespaces.load_secret(None, tmp_path / "d") == theirs
    assert (tmp_path / "d" / ".namespace-key").read_bytes() == theirs
    # A link refused for another reason is no missing feature: still an error.
    monkeypatch.setattr(namespaces.os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        namespaces.load_secret(None, tmp_path / "e")


def test_a_key_of_the_settings_file_that_names_no_setting_is_named_with_the_one_meant(tmp_path):
    """A misspelt key in the settings file (``cpu_bytez``) was pydantic's "cpu_bytez: Extra
    inputs are not permitted", which says neither that it is the file's key nor what it
    may have meant; a misspelt variable is said with the setting it is close to."""
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import ServerSettings

    toml = tmp_path / "cs.toml"
    toml.write_text('cpu_bytez = "1GiB"\nport = 9000\n')
    with pytest.raises(ConfigError, match=rf"config {re.escape(str(toml))}: cpu_bytez is not a setting; did you "
                                          r"mean cpu_bytes\?"):
        ServerSettings.load(toml)
    yaml = tmp_path / "cs.yaml"
    yaml.write_text("cacheseek:\n  colour: blue\n")  # close to none: the file's key, and where to look
    with pytest.raises(ConfigError, match=r"colour is not a setting \(cacheseek serve --help lists them\)"):
        ServerSettings.load(yaml)
    toml.write_text("redis_ttl_s = 5\n")  # an old spelling still works
    assert ServerSettings.load(toml).redis_ttl_seconds == 5


def test_a_settings_file_key_spelt_as_its_variable_is_named_with_the_setting(tmp_path):
    """A key copied from the environment's spelling (``CPU_BYTES``, ``CACHESEEK_DISK_BYTES``:
    the variables' names are read in any case) is close to no setting as written: it was
    said with no setting meant, only "--help lists them"."""
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import ServerSettings

    toml = tmp_path / "cacheseek.toml"
    for key, meant in (("CPU_BYTES", "cpu_bytes"), ("CACHESEEK_DISK_BYTES", "disk_bytes"),
                       ("Redis_URL", "redis_url")):
        toml.write_text(f'{key} = "1GiB"\n')
        with pytest.raises(ConfigError, match=rf"config {re.escape(str(toml))}: {key} is not a setting; did you "
                                              rf"mean {meant}\?"):
            ServerSettings.load(toml)


def test_settings_beside_a_cacheseek_table_are_refused_not_dropped(tmp_path):
    """A file with a ``[cacheseek]`` table (its settings in a file shared with other tools)
    is read from that table alone: a setting left beside it (``port = 9000`` above it) was
    dropped without a word, and the server started on the default port."""
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import ServerSettings

    toml = tmp_path / "cacheseek.toml"
    toml.write_text('port = 9000\n\n[cacheseek]\ncpu_bytes = "1GiB"\n')
    with pytest.raises(ConfigError, match=rf"config {re.escape(str(toml))}: port is beside the \[cacheseek\] "
                                          r"table, whose settings alone are read: put it in the table"):
        ServerSettings.load(toml)
    toml.write_text('[cacheseek]\ncpu_bytes = "1GiB"\nport = 9000\n')
    assert ServerSettings.load(toml).port == 9000


def test_a_setting_given_twice_in_a_settings_file_is_refused_not_last_wins(tmp_path):
    """A key given twice in a YAML file (yaml.safe_load keeps the last), and one setting spelt
    with "-" and with "_" (TOML, YAML, a [cacheseek] table: collapsed into one name), were
    taken silently, the last one winning: a merged file's second write_token or disk_path was
    used without a word. TOML itself refuses a repeated key; so does every file now."""
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import ServerSettings

    toml, yaml = tmp_path / "cs.toml", tmp_path / "cs.yaml"
    for path, text, said in (
            (yaml, "cpu_bytes: 1GiB\nport: 9000\ncpu_bytes: 2GiB\n", "cpu_bytes is given twice (line 3, column 1)"),
            (yaml, "cacheseek:\n  port: 9000\n  port: 9001\n", "port is given twice (line 3, column 3)"),
            (yaml, "tenants:\n  team:\n    write_token: a-token-here\n    write_token: b-token-here\n",
             "write_token is given twice (line 4, column 5)"),  # at every level
            (yaml, "cpu_bytes: 1GiB\ncpu-bytes: 2GiB\n", "cpu_bytes and cpu-bytes name one setting: give it once"),
            (toml, 'cpu_bytes = "1GiB"\ncpu-bytes = "2GiB"\n', "cpu_bytes and cpu-bytes name one setting: give it once"),
            (toml, '[cacheseek]\ncpu-bytes = "1GiB"\ncpu_bytes = "2GiB"\n',
             "cpu-bytes and cpu_bytes name one setting: give it once")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"^config {re.escape(str(path))}: {re.escape(said)}$"):
            ServerSettings.load(path)
    # A YAML merge (<<) still gives way to the keys beside it, as YAML has it.
    yaml.write_text("base: &b {cpu_bytes: 1GiB, port: 9000}\ncacheseek:\n  <<: *b\n  cpu_bytes: 2GiB\n")
    s = ServerSettings.load(yaml)
    assert (s.cpu_bytes, s.port) == (2 << 30, 9000)
    # cacheseek serve: exit 2 naming the file and the setting, never the values (a token here)
    yaml.write_text('write_token: "s3cret-one"\nport: 1\nwrite_token: "s3cret-two"\n')
    out = subprocess.run([*cacheseek_command(), "serve", "--config", str(yaml)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and f"config {yaml}: write_token is given twice (line 3, column 1)" in out.stderr, \
        out.stderr
    assert "s3cret" not in out.stderr + out.stdout and "Traceback" not in out.stderr, out.stderr


def test_an_empty_disk_path_or_reserve_means_the_default(tmp_path, monkeypatch):
    from cacheseek.server.config import ServerSettings, default_disk_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CACHESEEK_DISK_PATH", "")
    monkeypatch.setenv("CACHESEEK_CPU_RESERVE_BYTES", "")
    s = ServerSettings.load(cpu_bytes="1GiB")
    assert s.disk_path == default_disk_path() and s.disk_path.resolve() != tmp_path.resolve()
    assert s.cpu_reserve_bytes == 128 << 20
    toml = tmp_path / "cs.toml"
    toml.write_text('disk_path = ""\n')
    monkeypatch.delenv("CACHESEEK_DISK_PATH")
    assert ServerSettings.load(toml).disk_path == default_disk_path()
    assert ServerSettings.load(disk_path="").disk_path == default_disk_path()


def test_a_namespace_with_a_newline_at_its_end_is_refused_where_it_is_named():
    """The namespace pattern ended in ``$``, which matches before a final newline: a tenant
    named "team-c\\n" started, and its clients could never reach it (403 naming "team-c", 400
    naming "team-c\\n"); a Redis prefix took one too."""
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import ServerSettings
    from cacheseek.store.redis_keys import RedisKeys

    with pytest.raises(ValueError, match="tenants: namespace 'team-c\\\\n' must be"):
        ServerSettings.load(tenants={"team-c\n": {"write_token": "w"}}, write_token="op")
    assert list(ServerSettings.load(tenants={"team-c": {"write_token": "w"}}, write_token="op").tenants) == ["team-c"]
    for bad in ({"prefix": "cacheseek\n"}, {"namespace": "default\n"}):
        with pytest.raises(ConfigError):
            RedisKeys(**bad)


def test_a_tenants_variable_that_is_not_json_exits_2_naming_it():
    env = {**os.environ, "CACHESEEK_TENANTS": "not json"}
    out = subprocess.run([*cacheseek_command(), "serve", "--port", "1"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "CACHESEEK_TENANTS: cannot read it: Expecting value: line 1 column 1" in out.stderr


def test_the_old_seconds_spelling_still_works_and_warns(tmp_path, monkeypatch):
    from cacheseek.errors import ConfigError
    from cacheseek.server.config import DEPRECATED_NAMES, ServerSettings

    assert all(new == old.removesuffix("_s") + "_seconds" for old, new in DEPRECATED_NAMES.items())
    with pytest.warns(DeprecationWarning, match="redis_ttl_s is deprecated; use redis_ttl_seconds"):
        assert ServerSettings.load(redis_ttl_s=5).redis_ttl_seconds == 5
    toml = tmp_path / "old.toml"
    toml.write_text("graceful_timeout_s = 7\nredis_breaker_cap_s = 9\n")
    with pytest.warns(DeprecationWarning) as said:
        s = ServerSettings.load(toml)
    assert (s.graceful_timeout_seconds, s.redis_breaker_cap_seconds) == (7, 9)
    assert sorted(str(w.message).split(": ")[1] for w in said) == [
        "graceful_timeout_s is deprecated; use graceful_timeout_seconds",
        "redis_breaker_cap_s is deprecated; use redis_breaker_cap_seconds"]
    toml.write_text("graceful_timeout_seconds = 7\n")
    monkeypatch.setenv("CACHESEEK_KEEPALIVE_TIMEOUT_S", "11")
    with pytest.warns(DeprecationWarning, match="CACHESEEK_KEEPALIVE_TIMEOUT_S is deprecated; use "
                                                "CACHESEEK_KEEPALIVE_TIMEOUT_SECONDS"):
        s = ServerSettings.load(toml)
    assert s.keepalive_timeout_seconds == 11 and s.graceful_timeout_seconds == 7
    with pytest.warns(DeprecationWarning):  # the new spelling from a stronger source wins, as for any setting
        assert ServerSettings.load(toml, keepalive_timeout_seconds=3).keepalive_timeout_seconds == 3
    monkeypatch.setenv("CACHESEEK_KEEPALIVE_TIMEOUT_SECONDS", "12")
    with pytest.raises(ConfigError, match="name one setting"):  # both spellings in one place
        ServerSettings.load()
    monkeypatch.delenv("CACHESEEK_KEEPALIVE_TIMEOUT_S")
    with pytest.raises(ConfigError, match="name one setting"):
        ServerSettings.load(redis_ttl_s=1, redis_ttl_seconds=2)
    assert "redis_ttl_s" not in ServerSettings.load().describe()
    # A flag: said on stderr, and validated as the setting it names.
    out = subprocess.run([*cacheseek_command(), "serve", "--port", "1", "--graceful-timeout-s", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--graceful-timeout-s is deprecated; use --graceful-timeout-seconds" in out.stderr
    assert "graceful_timeout_seconds" in out.stderr


def test_serve_help_gives_each_settings_variable_and_default():
    # --help named each variable but no default (the docs' table had them), and --config
    # did not say that CACHESEEK_CONFIG names the file too.
    out = subprocess.run([*cacheseek_command(), "serve", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "1000"})
    assert out.returncode == 0, out.stderr
    lines: dict[str, str] = {}  # each option's help, its lines joined
    flag = None
    for line in out.stdout.split("options:")[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            lines[flag] = line
        elif flag is not None:
            lines[flag] += " " + line.strip()
    assert "CACHESEEK_CONFIG" in lines["--config"]
    assert "[env CACHESEEK_CPU_BYTES; default 4.00 GiB]" in lines["--cpu-bytes"]
    assert "[env CACHESEEK_GRACEFUL_TIMEOUT_SECONDS; default 30 s]" in lines["--graceful-timeout-seconds"]
    assert "[env CACHESEEK_WRITE_THROUGH; default on]" in lines["--write-through"]
    assert "[env CACHESEEK_HOST; default 127.0.0.1]" in lines["--host"]
    assert "[env CACHESEEK_REDIS_URL]" in lines["--redis-url"]  # (unset by default: its text says so)


def test_a_misspelt_variable_is_said_not_silently_ignored(tmp_path):
    # pydantic-settings reads only the variables of known settings: CACHESEEK_DISK_BYTE=1GiB
    # left the 64 GiB default in force without a word.
    env = {**os.environ, "CACHESEEK_DISK_BYTE": "1GiB", "CACHESEEK_WRITE_TROUGH": "false",
           "CACHESEEK_TOKEN": "t", "CACHESEEK_KIVI_BACKEND": "torch",  # (other tools': close to no setting)
           "CACHESEEK_VLLM_PYTHON": "/usr/bin/python3"}
    out = subprocess.run([*cacheseek_command(), "serve", "--port", "70000"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2 and "port" in out.stderr, out.stderr  # (said before the settings are checked)
    said = [line for line in out.stderr.splitlines() if "is not a setting" in line]
    assert said == [
        "cacheseek serve: warning: CACHESEEK_DISK_BYTE is not a setting (ignored); did you mean CACHESEEK_DISK_BYTES?",
        "cacheseek serve: warning: CACHESEEK_WRITE_TROUGH is not a setting (ignored); did you mean "
        "CACHESEEK_WRITE_THROUGH?"], out.stderr


def test_a_secret_other_users_can_read_is_said_at_start(tmp_path):
    # A token given as a flag is in /proc/PID/cmdline (ps shows it to every user of the host),
    # and a settings file holding one was read whatever its mode: neither was said.
    toml = tmp_path / "cs.toml"
    toml.write_text('write_token = "s3cret-file"\nport = 70000\n')  # (a bad port: the start stops after)
    toml.chmod(0o644)
    out = subprocess.run([*cacheseek_command(), "serve", "--config", str(toml), "--admin-token", "s3cret-flag"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "s3cret" not in out.stderr + out.stdout, out.stderr
    said = [line for line in out.stderr.splitlines() if "other users" in line]
    assert said == [
        "cacheseek serve: warning: --admin-token on the command line can be read by other users of this host "
        "(ps, /proc/PID/cmdline); give it as CACHESEEK_ADMIN_TOKEN or in a settings file only its owner reads",
        f"cacheseek serve: warning: config {toml} holds write_token and other users can read it (mode 0644): "
        f"chmod 600 {toml}"], out.stderr
    toml.chmod(0o600)
    out = subprocess.run([*cacheseek_command(), "serve", "--config", str(toml)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "CACHESEEK_ADMIN_TOKEN": "s3cret-env"})
    assert out.returncode == 2 and "other users" not in out.stderr, out.stderr


def test_bad_settings_exit_2_naming_the_setting(tmp_path):
    base = [*cacheseek_command(), "serve", "--port", "1"]
    for args, name in ((["--cpu-bytes", "lots"], "cpu_bytes"), (["--read-token", "x"], "write_token"),
                       (["--config", str(tmp_path / "x.ini")], "config"), (["--port", "70000"], "port")):
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and name in out.stderr, (args, out.stderr)
    out = subprocess.run([*base, "--disk-bytes", "0", "--redis-url", "redis://127.0.0.1:1", "--redis-ttl-seconds", "inf"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "redis_ttl_seconds: must be > 0 and at most" in out.stderr, out.stderr
    # (named as itself: "cannot open the store (redis_url): redis_ttl_seconds: ..." blamed the URL)
    assert "cannot open the store (redis_ttl_seconds): redis_ttl_seconds" in out.stderr, out.stderr
    for args, name in ((["--redis-connect-timeout-seconds", "inf"], "redis_connect_timeout_seconds"),
                       (["--redis-breaker-base-seconds", "inf", "--redis-breaker-cap-seconds", "inf"], "cap_seconds")):
        out = subprocess.run([*base, "--disk-bytes", "0", "--redis-url", "redis://127.0.0.1:1", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and name in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    # An infinite time limit turned the slow-client protection off unsaid: refused, named.
    for flag in ("--header-timeout-seconds", "--body-idle-timeout-seconds", "--graceful-timeout-seconds",
                 "--shutdown-drain-seconds", "--keepalive-timeout-seconds"):
        out = subprocess.run([*base, flag, "inf"], capture_output=True, text=True, timeout=60)
        name = flag.removeprefix("--").replace("-", "_")
        assert out.returncode == 2 and name in out.stderr and "finite number" in out.stderr, (flag, out.stderr)
    # A namespace secret too short to key anything: said as a setting, before the store is
    # opened (it was refused only as the app started: exit 3, a traceback, the disk created).
    disk = tmp_path / "never"
    out = subprocess.run([*base, "--disk-path", str(disk), "--namespace-secret", "fifteen-bytes!!"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "namespace_secret" in out.stderr and "16 bytes" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not disk.exists()
    # A namespace key file too short to be one (truncated, written by hand): exit 2 naming
    # it, and no new key made in its place (exit 3 and a traceback, as the app started).
    disk = tmp_path / "short-key"
    disk.mkdir()
    (disk / ".namespace-key").write_bytes(b"short")
    out = subprocess.run([*base, "--disk-path", str(disk)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "namespace key:" in out.stderr and "holds 5 bytes" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and (disk / ".namespace-key").read_bytes() == b"short"


def test_a_frame_or_body_limit_of_0_is_refused_not_a_server_that_takes_nothing():
    # 0 turns a tier off, but a limit of 0 bytes made a server that answered every PUT 413; so
    # did a frame limit under a frame's 16-byte preamble (1..15), refused only where a Redis
    # tier was set (blamed on redis_url, as the store opened).
    base = [*cacheseek_command(), "serve", "--port", "70000"]  # (a bad port too: said in the same message)
    frame = "max_frame_bytes\n  Input should be greater than or equal to 16"
    for args, said in ((["--max-frame-bytes", "0"], [frame]), (["--max-frame-bytes", "1"], [frame]),
                       (["--max-frame-bytes", "15B"], [frame]),
                       (["--max-body-bytes", "0", "--max-frame-bytes", "0"],
                        [frame, "max_body_bytes: must be more than 0 bytes"]),
                       (["--max-inflight-body-bytes", "0B", "--max-body-bytes", "0", "--max-frame-bytes", "0"],
                        [frame, "max_body_bytes: must be more than 0 bytes",
                         "max_inflight_body_bytes: must be more than 0 bytes"])):
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and all(text in out.stderr for text in said), (args, out.stderr)
    out = subprocess.run([*base, "--max-frame-bytes", "16"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "max_frame_bytes" not in out.stderr and "port" in out.stderr, out.stderr


def test_redis_timeouts_and_breaker_periods_out_of_range_are_named_as_themselves():
    """Bounds checked only as the store opened were blamed on another setting, with the
    library's names: "cannot open the store (redis_url): redis timeout connect_seconds ...",
    "(tiers): backoff: need base_seconds > 0, a finite cap_seconds ...". Each is now refused
    as its own setting, before anything is opened."""
    from server_helpers import free_port

    base = [*cacheseek_command(), "serve", "--port", str(free_port()), "--disk-bytes", "0",
            "--redis-url", "redis://127.0.0.1:1"]
    for args, said in (
            (["--redis-connect-timeout-seconds", "1e300"],
             ["redis_connect_timeout_seconds\n  Input should be less than or equal to 9223372036"]),
            (["--redis-socket-timeout-seconds", "1e300"],
             ["redis_socket_timeout_seconds\n  Input should be less than or equal to 9223372036"]),
            (["--redis-breaker-base-seconds", "inf", "--redis-breaker-cap-seconds", "inf"],
             ["redis_breaker_base_seconds\n  Input should be a finite number",
              "redis_breaker_cap_seconds\n  Input should be a finite number"]),
            (["--redis-breaker-base-seconds", "nan"], ["redis_breaker_base_seconds\n  Input should be a finite number"]),
            (["--max-frame-bytes", "15"], ["max_frame_bytes\n  Input should be greater than or equal to 16"])):
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and all(text in out.stderr for text in said), (args, out.stderr)
        assert "cannot open the store" not in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


def test_bad_settings_never_print_a_token(tmp_path):
    """pydantic's message for a bad setting repeats the values given (input_value=...), and a
    model-wide check's repeats them all: the tokens went to stderr, and so to the logs."""
    base = [*cacheseek_command(), "serve", "--port", "1"]
    for args, env, name in (
            (["--write-token", "s3cret-w"], {"CACHESEEK_TENANTS": '{"a b": {"write_token": "s3cret-t"}}'}, "tenants"),
            (["--write-token", "s3cret-w", "--admin-token", "s3cret-w"], {}, "every token must be different"),
            (["--read-token", "s3cret-r"], {}, "write_token"),
            (["--write-token", "s3cret-w", "--port", "x"], {}, "port")):
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        assert out.returncode == 2 and name in out.stderr, (args, out.stderr)
        assert "s3cret" not in out.stderr + out.stdout, (args, out.stderr)
    config = tmp_path / "cs.yaml"  # YAML's own message quotes the line it stopped at
    config.write_text('write_token: "s3cret-y\nport: 1\n')
    out = subprocess.run([*base, "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not valid: while scanning a quoted scalar" in out.stderr, out.stderr
    assert "line 1, column 14" in out.stderr and "s3cret" not in out.stderr, out.stderr
    # A file that is not UTF-8 (saved as Latin-1): a UnicodeDecodeError traceback and exit 1
    latin = tmp_path / "cs.toml"
    latin.write_bytes('write_token = "s3cret-\xe9"\n'.encode("latin-1"))
    out = subprocess.run([*base, "--config", str(latin)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"config: {latin} is not UTF-8 text (byte 23: " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "s3cret" not in out.stderr, out.stderr


def test_serve_prints_settings_and_sigterm_finishes_inflight_requests(tmp_path):
    chain = raw_chain(70, 6)
    srv = Server(tmp_path, "--write-token", "s3cret").start()
    try:
        out = srv.output()
        assert "s3cret" not in out and re.search(r"^  write_token +set$", out, re.M), out
        assert re.search(r"^  cpu_bytes +0\.062 GiB \(67,108,864 bytes\)$", out, re.M), out
        assert re.search(r"^  disk +budget 1\.00 GiB at .*disk, fsync, arc eviction$", out, re.M), out
        assert re.search(r"^ +recovered 0 blocks, 0\.00 GiB$", out, re.M) and "store open in" in out, out
        body = batch_body([f for _, f in chain])
        sent = threading.Event()

        def slow_body():
            for i in range(0, len(body), 16384):
                yield body[i : i + 16384]
                if i == 16384 * 2:
                    sent.set()
                    time.sleep(0.5)  # SIGTERM lands here, mid-request

        result = {}

        def upload():
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                result["r"] = c.post("/v1/blocks", content=slow_body(), headers={
                    "Authorization": "Bearer s3cret", "Content-Length": str(len(body))})

        t = threading.Thread(target=upload)
        t.start()
        assert sent.wait(10)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert result["r"].status_code == 200 and [x["status"] for x in result["r"].json()] == ["stored"] * 6
        # Exit 0 (docs/http-api.md): uvicorn re-raises the signal once it has shut down, which
        # killed the process before the store was closed (-SIGTERM).
        assert srv.proc.wait(30) == 0, srv.output()
        assert "Traceback" not in srv.output()
    finally:
        srv.kill()
    with Server(tmp_path) as again, httpx.Client(base_url=again.url) as c:
        got = c.get(f"/v1/prefixes/{chain[-1][0].hex()}")
        assert split_batch(got.content) == [f for _, f in chain]



def _answer(s: socket.socket) -> bytes:
    """One whole HTTP answer from ``s`` (its head and Content-Length bytes), b"" if closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_durations_under_a_second_are_kept_whole_not_truncated(tmp_path):
    """graceful_timeout_seconds and keepalive_timeout_seconds take fractions (> 0): 0.9 was
    handed to uvicorn as int 0, so a SIGTERM cut off every request in flight at once and
    every kept-alive connection closed as its answer was sent."""
    h, frame = raw_frame(71)
    srv = Server(tmp_path, "--graceful-timeout-seconds", "0.9", "--keepalive-timeout-seconds", "0.9").start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(s).startswith(b"HTTP/1.1 200")
            time.sleep(0.2)  # well within the keep-alive timeout
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(s).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(f"PUT /v1/blocks/{h.hex()} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(frame)}\r\n"
                      "Content-Type: application/octet-stream\r\n\r\n".encode() + frame[: len(frame) // 2])
            time.sleep(0.3)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # SIGTERM taken; the rest of the body comes within the graceful timeout
            s.sendall(frame[len(frame) // 2 :])
            assert _answer(s).startswith(b"HTTP/1.1 201"), srv.output()
        assert srv.proc.wait(30) == 0
        assert "Traceback" not in srv.output()
    finally:
        srv.kill()
    with Server(tmp_path) as again:
        again.proc.send_signal(signal.SIGINT)  # Ctrl-C: the same graceful stop
        assert again.proc.wait(30) == 0, again.output()
    with Server(tmp_path) as again:
        assert httpx.get(f"{again.url}/v1/blocks/{h.hex()}").content == frame

# -- crashes and concurrency ------------------------------------------------------------------


@pytest.mark.slow
def test_kill9_during_batch_ingest_keeps_every_acknowledged_block_exact(tmp_path):
    rng = random.Random(5)
    acked: dict[bytes, bytes] = {}
    for round_ in range(3):
        srv = Server(tmp_path, "--cpu-bytes", "16MiB").start()
        stop = threading.Event()

        def ingest(round_=round_):
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                for batch in range(1000):
                    if stop.is_set():
                        return
                    frames = [raw_frame(round_ * 100_000 + batch * 100 + i, block=64) for i in range(8)]
                    try:
                        r = c.post("/v1/blocks", content=batch_body([f for _, f in frames]))
                    except httpx.HTTPError:
                        return  # killed mid-request: nothing of this batch was acknowledged
                    assert r.status_code == 200, r.text
                    for (h, f), res in zip(frames, r.json()):
                        assert res["status"] == "stored" and not res["errors"], res
                        acked[h] = f

        t = threading.Thread(target=ingest)
        t.start()
        time.sleep(rng.uniform(0.5, 1.5))
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        stop.set()
        t.join(30)
        with Server(tmp_path) as again, httpx.Client(base_url=again.url, timeout=30) as c:
            assert len(acked) > 0
            for h, f in acked.items():
                got = c.get(f"/v1/blocks/{h.hex()}")
                assert got.status_code == 200 and got.content == f
    assert len(acked) >= 24


@pytest.mark.slow
def test_the_owners_file_keeps_a_bounded_number_of_roots(tmp_path):
    """A chain's root is the parent hash its position-0 frame names, so a writer can name a
    fresh one in every frame. Each new root rewrote the whole roots file, which grew for good:
    5000 such frames left 5000 roots, and every later new root wrote them all again."""
    from cacheseek.layout import KVLayout
    from cacheseek.server.owners import OWNERS_FILE

    cap = 256  # Owners.max_namespace_roots: one writer's namespace (the file's own bound, 4096, is tested beside Owners)
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    frames = [raw_frame(i, parent=i.to_bytes(16, "little"), layout=tiny)[1] for i in range(1, cap + 905)]
    with Server(tmp_path) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        for start in range(0, len(frames), 2000):
            r = c.post("/v1/blocks", content=batch_body(frames[start : start + 2000]))
            assert r.status_code == 200 and {x["status"] for x in r.json()} == {"stored"}
        roots = json.loads((s.disk_path / OWNERS_FILE).read_text())["roots"]
        assert len(roots) == cap
        assert c.get("/v1/stats").json()["tiers"][1]["blocks"] == len(frames)  # every block stored all the same


def test_16_concurrent_clients_lose_nothing(tmp_path):
    shared = raw_chain(80, 2)
    errors: list[BaseException] = []
    expected: dict[bytes, bytes] = {h: f for h, f in shared}
    lock = threading.Lock()

    def client_loop(w: int, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                for i in range(4):
                    own = raw_chain(1000 + w * 10 + i, 2)
                    # Re-link the suffix onto the shared prefix.
                    h2, f2 = raw_frame(5000 + w * 10 + i, position=2, parent=shared[-1][0])
                    h3, f3 = raw_frame(6000 + w * 10 + i, position=3, parent=h2)
                    chain = [*shared, (h2, f2), (h3, f3)]
                    r = c.post("/v1/blocks", content=batch_body([f for _, f in reversed(chain)]))
                    assert r.status_code == 200 and all(x["status"] in ("stored", "present") for x in r.json())
                    got = c.get(f"/v1/prefixes/{h3.hex()}")
                    assert got.status_code == 200 and split_batch(got.content) == [f for _, f in chain]
                    with lock:
                        expected.update({h2: f2, h3: f3})
                    del own
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with Server(tmp_path) as srv:
        threads = [threading.Thread(target=client_loop, args=(w, srv.url)) for w in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        with httpx.Client(base_url=srv.url) as c:
            tiers = {t["name"]: t for t in c.get("/v1/stats").json()["tiers"]}
            assert tiers["cpu"]["blocks"] == tiers["disk"]["blocks"] == len(expected) == 2 + 16 * 4 * 2
    with Server(tmp_path, disk=True) as again, httpx.Client(base_url=again.url) as c:
        for h, f in expected.items():
            assert c.get(f"/v1/blocks/{h.hex()}").content == f


@pytest.mark.parametrize("argv, usage, said", [
    (["serve", "--cpu-bites", "1GiB"], "usage: cacheseek serve ", "--cpu-bites (did you mean --cpu-bytes?) 1GiB"),
    (["admin", "flush", "--namespce", "x"], "usage: cacheseek admin flush ", "--namespce (did you mean --namespace?) x"),
    (["plan", "--trace", "t", "--polcy=lru"], "usage: cacheseek plan ", "--polcy=lru (did you mean --policy?)"),
    # a prefix of a flag is not the flag: argparse's default took it (and would have taken
    # another flag, or refused it as ambiguous, once a second flag began so)
    (["serve", "--cpu-byte", "1GiB"], "usage: cacheseek serve ", "--cpu-byte (did you mean --cpu-bytes?) 1GiB"),
    (["admin", "flush", "--names", "x"], "usage: cacheseek admin flush ", "--names (did you mean --namespace?) x"),
])
def test_a_mistyped_option_is_said_by_its_command_with_the_one_meant(argv, usage, said):
    """A flag a command does not take printed the top level's usage (its list of commands),
    with no hint of the command's own flags."""
    r = subprocess.run([*cacheseek_command(), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(usage), r.stderr
    assert r.stderr.rstrip().endswith(f"error: unrecognized arguments: {said}"), r.stderr
