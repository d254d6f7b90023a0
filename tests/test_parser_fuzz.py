"""Property tests of every reader of bytes from outside the process, past the checksums.

``test_fuzz`` flips and truncates whole frames, which the header checksum refuses before a
field is read. Here the damage is forged: a field of a valid header set to any msgpack
value (a str where an int goes, bools, NaN, nested maps, 2**64 - 1) under a header
checksum and a payload checksum that hold; batch length prefixes set to 0, to huge and to
negative-as-unsigned values, and bodies spliced; a server's answers of the right JSON
shape with fields of the wrong types, and prefix streams so damaged. The contract: the
reader's own error (``FrameError``, a 4xx JSON answer, ``RemoteUnavailable``), nothing
stored by a refused request, and nothing but a true prefix served.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re

import httpx
import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import FrameError
from cacheseek.store.breaker import CircuitBreaker
from cacheseek.store.frame import ALIGN, MAGIC, PREAMBLE, check_codec_layout, parse_frame, payload_checksum
from cacheseek.transport import ssl_context
from redis_servers import needs_redis
from server_helpers import Server, batch_body, raw_frame
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_cache, make_kv, tokens_for

TINY = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")  # a Raw frame of ~1.3 KB
KIVI_LAYOUT = cs.KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype="float16")

# Every server and front here speaks plain http, so no client uses TLS: one context for them
# all, built once. A client or cache given verify=True loads the system's CA bundle (~25 ms
# of CPU), once per example.
_UNUSED_TLS = ssl_context(True)


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# Any msgpack value: what a field of a forged header may be set to.
VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=6) | st.binary(max_size=40)
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.sampled_from([0, 1, -1, 2, 4, 8, 16, 32, 64, 1 << 32, 1 << 62, 1 << 63, (1 << 64) - 1]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


def split_frame(frame: bytes) -> tuple[dict, bytes]:
    """(header, payload) of a valid frame."""
    _, n, _ = PREAMBLE.unpack_from(frame)
    payload_offset = -(-(PREAMBLE.size + n) // ALIGN) * ALIGN
    return msgpack.unpackb(frame[PREAMBLE.size : PREAMBLE.size + n], raw=False), frame[payload_offset:]


def forge(header, payload: bytes, *, seal: bool = True) -> bytes:
    """A frame of ``header`` over ``payload`` whose header checksum holds, and (``seal``) its
    payload checksum too: only the fields say what is wrong."""
    if seal and isinstance(header, dict):
        header = {**header, "checksum": payload_checksum(payload)}
    packed = msgpack.packb(header, use_bin_type=True)
    head = PREAMBLE.pack(MAGIC, len(packed), xxhash.xxh3_64_intdigest(packed)) + packed
    return head + bytes(-len(head) % ALIGN) + payload


def _paths(value, here=()) -> list[tuple]:
    out = [here]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*here, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*here, i))
    return out


def set_field(header: dict, which: int, value):
    """``header`` with its ``which``-th field (any depth, the whole header included) set to ``value``."""
    header = copy.deepcopy(header)
    paths = _paths(header)
    path = paths[which % len(paths)]
    if not path:
        return value
    node = header
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return header


def accepted(frame: bytes) -> bool:
    """Whether the server's own check (``service._check``) takes ``frame``; raises on any
    error but ``FrameError``."""
    try:
        check_codec_layout(parse_frame(frame))
    except FrameError:
        return False
    return True


FRAMES = {"raw": raw_frame(1, layout=TINY)[1],
          "kivi": raw_frame(2, layout=KIVI_LAYOUT, codec=cs.KIVI(k_bits=4, v_bits=2))[1]}


@fuzz(400)
@given(kind=st.sampled_from(sorted(FRAMES)), which=st.integers(0, 200), value=VALUES, seal=st.booleans())
def test_a_forged_header_field_of_any_type_is_a_frame_error(kind, which, value, seal):
    header, payload = split_frame(FRAMES[kind])
    forged = forge(set_field(header, which, value), payload, seal=seal)
    if not accepted(forged):  # (FrameError: the contract; any other exception fails here)
        return
    # Taken: then it is a frame of its own header, laid out as its codec lays it out.
    meta = parse_frame(forged)
    assert meta.nbytes == len(forged) and meta.payload_nbytes == len(payload)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("parsers"), "--max-frame-bytes", "1MiB", "--max-body-bytes", "4MiB") as srv:
        yield srv


def stored(client: httpx.Client) -> list[tuple]:
    return [(t["name"], t["blocks"], t["used_bytes"], t["bytes_in"]) for t in client.get("/v1/stats").json()["tiers"]]


def refused_and_nothing_stored(client: httpx.Client, before: list[tuple], response: httpx.Response, where) -> None:
    assert 400 <= response.status_code < 500, (where, response.status_code, response.text[:300])
    assert isinstance(response.json().get("error"), str), (where, response.text[:300])
    assert stored(client) == before, where


@fuzz(60)
@given(kind=st.sampled_from(sorted(FRAMES)), which=st.integers(0, 200), value=VALUES, seal=st.booleans(),
       how=st.sampled_from(["put", "post", "post behind a good frame"]))
def test_the_server_refuses_a_forged_header_and_stores_nothing(server, kind, which, value, seal, how):
    layout, codec = (TINY, None) if kind == "raw" else (KIVI_LAYOUT, cs.KIVI(k_bits=4, v_bits=2))
    h, good = raw_frame(which, layout=layout, codec=codec)
    header, payload = split_frame(good)
    forged = forge(set_field(header, which, value), payload, seal=seal)
    if accepted(forged):
        return  # (the field was set to what it held, or to what the checks allow)
    with httpx.Client(base_url=server.url, timeout=30, verify=_UNUSED_TLS) as client:
        before = stored(client)
        if how == "put":
            response = client.put(f"/v1/blocks/{h.hex()}", content=forged)
        else:
            frames = [forged] if how == "post" else [raw_frame(which + 1, layout=TINY)[1], forged]
            response = client.post("/v1/blocks", content=batch_body(frames))
        refused_and_nothing_stored(client, before, response, (how, kind, which, repr(value)[:80]))


LENGTHS = [0, 1, 15, 16, 2**32, 2**62, 2**63, 2**64 - 1]


@fuzz(60)
@given(index=st.integers(0, 2), length=st.sampled_from(LENGTHS) | st.integers(-64, 64),
       cut=st.integers(0, 1 << 20), splice=st.integers(0, 1 << 20), how=st.sampled_from(["length", "splice"]))
def test_the_server_refuses_a_batch_whose_lengths_lie_and_stores_nothing(server, index, length, cut, splice, how):
    frames = [raw_frame(cut + i, layout=TINY)[1] for i in range(3)]
    body = bytearray(batch_body(frames))
    start = sum(8 + len(f) for f in frames[:index])
    if how == "length":  # a length prefix set to 0, huge, negative as unsigned, or a few bytes off
        value = length if length not in range(-64, 65) else len(frames[index]) + length
        if value == len(frames[index]):
            return
        body[start : start + 8] = (value % 2**64).to_bytes(8, "little")
    else:  # two cuts of the body joined: a frame's tail where another's length is read
        a, b = sorted((cut % len(body), splice % len(body)))
        if a == b or (b - a) % len(body) == 0:
            return
        body = body[:a] + body[b:]
    with httpx.Client(base_url=server.url, timeout=30, verify=_UNUSED_TLS) as client:
        before = stored(client)
        response = client.post("/v1/blocks", content=bytes(body))
        refused_and_nothing_stored(client, before, response, (how, index, length, cut, splice))


# -- RemoteCache reading a server's answers ------------------------------------------------


def _front(answers: dict):
    """A fake server: each request answered ``answers[route]``: JSON, or for ``/v1/prefixes``
    a batch of frames."""
    def script(n: int, head: bytes):
        line = head.split(b"\r\n", 1)[0]
        route = next(r for r in ("/v1/lookup", "/v1/prefetch", "/v1/prefixes", "/v1/blocks", "/v1/stats")
                     if b" " + r.encode() in line)
        body = answers[route]
        kind = b"application/vnd.cacheseek.frames" if route == "/v1/prefixes" else b"application/json"
        return (b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body), False
    return script


def _remote(url: str) -> cs.RemoteCache:
    # (a breaker that never opens: every example reaches the reader under test)
    return cs.RemoteCache(url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                          trust_env=False, verify=_UNUSED_TLS, breaker=CircuitBreaker(failure_threshold=1 << 30))


SCALARS = st.none() | st.booleans() | st.integers(-3, 5) | st.floats() | st.text(max_size=6) \
    | st.sampled_from(["stored", "present", "failed", "cpu", "disk", "durable", "memory"])
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["status", "errors", "durability", "disk"]), inner, max_size=3),
                           max_leaves=6)
WRITE_LOOKUPS = st.sampled_from([{"matched": 0, "tiers": [], "present": [False, False], "durability": "durable"}]) \
    | st.fixed_dictionaries({"matched": st.integers(0, 2) | JSON_VALUES, "tiers": st.lists(JSON_VALUES, max_size=2)},
                            optional={"present": st.lists(st.booleans() | JSON_VALUES, min_size=2, max_size=2),
                                      "durability": JSON_VALUES, "max_body_bytes": JSON_VALUES, "started": JSON_VALUES,
                                      "blocks": JSON_VALUES, "joined": JSON_VALUES})
REPORTS = st.lists(st.fixed_dictionaries({"status": JSON_VALUES},
                                         optional={"errors": JSON_VALUES, "durability": JSON_VALUES}),
                   min_size=2, max_size=2) | JSON_VALUES


def test_remote_cache_takes_any_answer_of_the_wrong_types_for_no_servers(caplog):
    """Lookups, write reports and prefetch answers whose fields have any JSON type: a call
    raises ``RemoteUnavailable`` or ``RemoteError``, or returns; nothing else escapes
    (errors as a list raised AttributeError out of ``ingest``)."""
    from fake_http import FakeServer

    caplog.set_level(logging.CRITICAL, logger="cacheseek.remote")  # (each outage is logged)
    toks, kv = tokens_for(47, 2 * BLOCK), make_kv(2 * BLOCK, 47)
    answers: dict = {"/v1/prefixes": b"", "/v1/stats": b"{}"}
    with FakeServer(_front(answers)) as front, _remote(front.url) as cache:

        @fuzz(150)
        @given(lookup=WRITE_LOOKUPS, reports=REPORTS)
        def answered(lookup, reports):
            answers["/v1/lookup"] = answers["/v1/prefetch"] = json.dumps(lookup).encode()
            answers["/v1/blocks"] = json.dumps(reports).encode()
            for call in (lambda: cache.lookup(toks), lambda: cache.ingest(toks, kv), lambda: cache.prefetch(toks),
                         lambda: cache.materialize(toks)):
                try:
                    result = call()
                except (cs.RemoteUnavailable, cs.RemoteError):
                    continue
                if isinstance(result, cs.IngestResult):
                    assert isinstance(result.durability, str) and result.stored + result.present + result.failed <= 2

        answered()


@pytest.fixture(scope="module")
def true_chain():
    """The frames of a 3-block chain as a server holds them, and its tokens and KV."""
    toks, kv = tokens_for(48, 3 * BLOCK), make_kv(3 * BLOCK, 48)
    cache = make_cache(cpu="64MiB")
    cache.ingest(toks, kv)
    tier = cache.store.tiers[0]
    frames = [b"".join(bytes(s) for s in tier.get(h).wire_segments()) for h in cache.block_hashes(toks)]
    return toks, kv, frames


@fuzz(150)
@given(index=st.integers(0, 2), how=st.sampled_from(["field", "flip", "length", "truncate", "splice", "swap"]),
       which=st.integers(0, 200), value=VALUES, seal=st.booleans(), cut=st.integers(0, 1 << 20),
       length=st.sampled_from(LENGTHS))
def test_remote_cache_serves_only_a_true_prefix_of_a_damaged_prefix_stream(true_chain, index, how, which, value, seal,
                                                                          cut, length):
    from fake_http import FakeServer

    toks, kv, frames = true_chain
    frames = list(frames)
    if how == "field":
        header, payload = split_frame(frames[index])
        frames[index] = forge(set_field(header, which, value), payload, seal=seal)
    elif how == "flip":
        flipped = bytearray(frames[index])
        flipped[cut % len(flipped)] ^= 1 << (which % 8)
        frames[index] = bytes(flipped)
    elif how == "swap":
        frames[index], frames[(index + 1) % 3] = frames[(index + 1) % 3], frames[index]
    body = batch_body(frames)
    start = sum(8 + len(f) for f in frames[:index])
    if how == "length":
        body = body[:start] + length.to_bytes(8, "little") + body[start + 8 :]
    elif how == "truncate":
        body = body[: cut % len(body)]
    elif how == "splice":
        body = body[: cut % len(body)] + body[(cut * 7) % len(body) :]
    lookup = json.dumps({"matched": 3, "tiers": ["cpu"] * 3}).encode()
    answers = {"/v1/lookup": lookup, "/v1/prefixes": body}
    with FakeServer(_front(answers)) as front, _remote(front.url) as cache:
        got = cache.materialize(toks)
    # Whatever the damage, what is served is the chain's own KV, as far as it goes.
    assert_prefix_equal(got, kv, got.num_tokens)


# -- stored records: the disk tier's sidecars, the Redis index ------------------------------


@fuzz(60)
@given(which=st.integers(0, 100), value=VALUES, blob=st.binary(max_size=80), how=st.sampled_from(["field", "bytes", "flip"]))
def test_a_damaged_sidecar_costs_its_block_at_most(tmp_path_factory, which, value, blob, how):
    """A sidecar set to anything (a field of any type, other bytes, a bit flipped): the tier
    starts, and serves the block's own frame or nothing."""
    from cacheseek.store.disk import DiskTier
    from store_helpers import raw_frame as stored_frame

    root = tmp_path_factory.mktemp("sidecar")
    key, frame = stored_frame(3)
    with contextlib.closing(DiskTier(root, 1 << 26, fsync=False)) as tier:
        tier.put(key, frame)
    side = next(root.rglob("*.meta"))
    if how == "field":
        side.write_bytes(msgpack.packb(set_field(msgpack.unpackb(side.read_bytes()), which, value), use_bin_type=True))
    elif how == "bytes":
        side.write_bytes(blob)
    else:
        flipped = bytearray(side.read_bytes())
        flipped[which % len(flipped)] ^= 1 << (which % 8)
        side.write_bytes(bytes(flipped))
    with contextlib.closing(DiskTier(root, 1 << 26, fsync=False)) as tier:
        got = tier.get(key)
        assert got is None or bytes(got.host) == bytes(frame.host)
        tier.check()
        assert tier.stats().blocks in (0, 1)


MEMBERS = st.binary(min_size=1, max_size=34) | st.sampled_from([b"\xff\xfe", b"not-a-hash", b"ab" * 16])
RECORDS = st.binary(max_size=24) | st.sampled_from([b"nan", b"inf", b"-inf", b"-5", b"0x10", b"1e30", b"1 1", b"7 x"])


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from redis_servers import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@needs_redis
@fuzz(40)
@given(lru=st.lists(st.tuples(MEMBERS, st.floats(0, 1e6)), max_size=3), pinned=st.lists(MEMBERS, max_size=2),
       sizes=st.lists(st.tuples(MEMBERS, RECORDS), max_size=3), owners=st.lists(st.tuples(MEMBERS, MEMBERS), max_size=2),
       totals=st.lists(st.tuples(st.sampled_from(["used", "raw", "blocks", "clock", "pinned_bytes", "pinned_blocks"]),
                                 RECORDS), max_size=3))
def test_a_redis_index_another_tool_wrote_into_keeps_the_budget_and_raises_nothing(redis_url, lru, pinned, sizes,
                                                                                   owners, totals):
    """Members, sizes, owner tags and totals of any bytes in the shared index: puts, reads,
    stats, ``keys``, ``owned`` and ``check`` raise nothing, and the budget holds."""
    from cacheseek.store.redis_tier import RedisTier
    from store_helpers import raw_frame as stored_frame

    frames = [stored_frame(i + 1) for i in range(5)]
    n = frames[0][1].nbytes
    tier = RedisTier(redis_url, 3 * n)
    c = tier._connection()
    try:
        c.flushall()
        tier.put(*frames[0])
        keys = tier.keys_of
        for member, score in lru:
            c.zadd(keys.lru, {member: score})
        for member in pinned:
            c.sadd(keys.pinned, member)
        for member, record in sizes:
            c.hset(keys.sizes, member, record)
        for member, tag in owners:
            c.hset(keys.owners, member, tag)
        for name, record in totals:
            c.hset(keys.totals, name, record)
        for key, frame in frames[1:]:
            tier.put(key, frame)
        assert all(tier.get(key) is None or bytes(tier.get(key).host) == bytes(frame.host) for key, frame in frames)
        tier.keys(), tier.owned(lambda tag: True), tier.check()
        # (a sizes entry written as the index writes one counts as a block's bytes)
        counted = sum(int(m[1]) for _, r in sizes if (m := re.fullmatch(rb"(\d+) \d+", r)))
        assert 0 <= tier.stats().used_bytes <= 3 * n + counted
    finally:
        tier.close()
