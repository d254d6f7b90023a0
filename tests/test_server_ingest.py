"""Ingest of large frames through a real ``cacheseek serve``: bodies are received straight into
the CPU tier's memory (a reservation) and checked there. What is stored is exact, bad or cut-off
bodies change nothing, and a full CPU tier falls back to buffers."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from cacheseek.transport import BulkTransport
from server_helpers import Server, batch_body, raw_chain, split_batch

BIG_BLOCK = 4096  # a Raw frame of the helpers' layout: 4 MiB of payload, far more than one read


def big_chain(seed: int, n: int) -> list[tuple[bytes, bytes]]:
    return raw_chain(seed, n, block=BIG_BLOCK)


def state(c: httpx.Client) -> list[dict]:
    return c.get("/v1/stats").json()["tiers"]


def settle(c: httpx.Client, timeout: float = 10.0) -> list[dict]:
    """The stats once no reservation is lent out (a request may still be ending)."""
    deadline = time.monotonic() + timeout
    while True:
        tiers = state(c)
        if tiers[0].get("reservation_bytes") == 0 or time.monotonic() > deadline:
            return tiers
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["auto", "h11"])
def srv(request, tmp_path_factory):
    """With uvicorn's h11 protocol, bodies reach the app as ASGI messages (no ``BODY_INTO``)."""
    with Server(tmp_path_factory.mktemp("ingest"), "--http", request.param, cpu_bytes="64MiB") as server:
        yield server


@pytest.mark.parametrize("transport", ["httpx", "bulk"])
def test_large_frames_put_and_batch_are_stored_exactly(srv, transport):
    chain = big_chain(1 if transport == "httpx" else 2, 5)
    kw = {"transport": BulkTransport()} if transport == "bulk" else {}
    with httpx.Client(base_url=srv.url, timeout=60, **kw) as c:
        for h, f in chain[:2]:
            assert c.put(f"/v1/blocks/{h.hex()}", content=f).status_code == 201
        reports = c.post("/v1/blocks", content=batch_body([f for _, f in chain[2:]])).json()
        assert [r["status"] for r in reports] == ["stored"] * 3
        for h, f in chain:
            assert c.get(f"/v1/blocks/{h.hex()}").content == f
        assert split_batch(c.get(f"/v1/prefixes/{chain[-1][0].hex()}").content) == [f for _, f in chain]
        # Sent again: already there (200), and nothing is lent out or left behind.
        assert c.put(f"/v1/blocks/{chain[0][0].hex()}", content=chain[0][1]).status_code == 200
        cpu = settle(c)[0]
        assert cpu["reservation_bytes"] == 0 and cpu["held_slots"] == 0 and cpu["leases_active"] == 0


def test_bad_large_frames_change_nothing(srv):
    (h, good), (h2, good2) = big_chain(3, 2)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    cases = [
        ("PUT", f"/v1/blocks/{h.hex()}", bytes(flipped), 400, "checksum"),
        ("PUT", f"/v1/blocks/{h2.hex()}", good, 409, "not the URL"),
        ("PUT", f"/v1/blocks/{h.hex()}", good[:-1], 400, "truncated"),
        ("POST", "/v1/blocks", batch_body([good, bytes(flipped)]), 400, "frame 1"),
        ("POST", "/v1/blocks", batch_body([good, good2])[:-5], 400, "ended"),
    ]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        (h0, f0), = big_chain(30, 1)
        c.put(f"/v1/blocks/{h0.hex()}", content=f0)  # the CPU tier has memory mapped to lend
        for namespace in ("", "tenant-x"):
            headers = {"X-CacheSeek-Namespace": namespace} if namespace else {}
            for method, path, body, status, reason in cases:
                before = settle(c)
                r = c.request(method, path, content=body, headers=headers)
                assert r.status_code == status and reason in r.json()["error"], (method, reason, r.text)
                assert settle(c) == before, (method, reason)
            assert c.get(f"/v1/blocks/{h.hex()}", headers=headers).status_code == 404


def test_a_client_gone_mid_body_leaves_nothing(srv):
    (h0, f0), (h, frame) = big_chain(4, 2)
    head = f"PUT /v1/blocks/{h.hex()} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(frame)}\r\n\r\n".encode()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.put(f"/v1/blocks/{h0.hex()}", content=f0)  # the CPU tier has memory mapped to lend
        before = settle(c)
        for cut in (100, len(frame) // 2, len(frame) - 1):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(head + frame[:cut])
                time.sleep(0.2)
                # The body is being received into the CPU tier's memory: lent, not stored.
                lent = state(c)[0]
                assert lent["reservation_bytes"] >= len(frame) and lent["blocks"] == before[0]["blocks"]
            assert settle(c) == before, cut
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        assert c.get(f"/v1/blocks/{h.hex()}").content == frame


def test_a_request_pipelined_behind_a_large_body_is_answered(srv):
    (h, frame), = big_chain(5, 1)
    put = f"PUT /v1/blocks/{h.hex()} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(frame)}\r\n\r\n".encode()
    get = f"GET /v1/blocks/{h.hex()} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(put + frame + get)
        data = bytearray()
        deadline = time.monotonic() + 30
        while data.count(b"HTTP/1.1 ") < 2 or len(data) < len(frame):
            assert time.monotonic() < deadline, bytes(data[:300])
            data += s.recv(1 << 20)
    first, _, rest = bytes(data).partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 201")
    assert rest[rest.index(b"HTTP/1.1 ") :].startswith(b"HTTP/1.1 200") and rest.endswith(frame)


def test_a_chunked_body_and_a_full_cpu_tier_take_the_buffered_path(tmp_path):
    chain = big_chain(6, 6)  # 24 MiB through a 10 MiB CPU tier: the tail goes through put, evicting to disk
    with Server(tmp_path, cpu_bytes="10MiB") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        h, f = chain[0]
        r = c.put(f"/v1/blocks/{h.hex()}", content=iter([f[:1000], f[1000:]]))  # no Content-Length: chunked
        assert r.status_code == 201
        reports = c.post("/v1/blocks", content=batch_body([f for _, f in chain[1:]])).json()
        assert [r["status"] for r in reports] == ["stored"] * 5
        tiers = {t["name"]: t for t in settle(c)}
        assert tiers["cpu"]["used_bytes"] <= 10 << 20 and tiers["cpu"]["evictions"] > 0
        assert tiers["disk"]["blocks"] == 6 and tiers["cpu"]["reservation_bytes"] == 0
        assert split_batch(c.get(f"/v1/prefixes/{chain[-1][0].hex()}").content) == [f for _, f in chain]


def _block_posts(cache) -> int:
    """``POST /v1/blocks`` the server has answered 200."""
    routes = cache.stats()["requests"]
    return next((r["statuses"].get("200", 0) for r in routes if r["route"] == "/v1/blocks" and r["method"] == "POST"), 0)


def test_a_namespace_rewrites_the_header_in_place(srv):
    chain = big_chain(7, 2)
    a = {"X-CacheSeek-Namespace": "tenant-a"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.put(f"/v1/blocks/{chain[0][0].hex()}", content=chain[0][1], headers=a).status_code == 201
        assert c.post("/v1/blocks", content=batch_body([chain[1][1]]), headers=a).json()[0]["status"] == "stored"
        assert split_batch(c.get(f"/v1/prefixes/{chain[1][0].hex()}", headers=a).content) == [f for _, f in chain]
        assert c.get(f"/v1/blocks/{chain[0][0].hex()}").status_code == 404


@pytest.mark.parametrize("requests", [1, 2], ids=["one-request", "ingest_batch-of-2"])
@pytest.mark.parametrize("bodies", [1, 3], ids=["one-body", "three-bodies"])
@pytest.mark.parametrize("tier", ["cpu", "cpu-no-reserve", "disk", "written-through"],
                         ids=["received-in-place", "buffered", "disk-only", "disk-written-through"])
def test_a_fresh_chain_posted_into_a_full_tier_keeps_every_block_it_answers_stored(tmp_path, tier, bodies, requests):
    """A write's blocks never evict each other: the tier makes room for the whole batch
    before its first block lands. Committed one (or a few) at a time, each evicting for
    itself, a fresh chain's blocks were ARC's only once-used blocks once every older one had
    been read again, and each commit evicted the ones before it: of 8 blocks answered
    "stored", 4 were left (Llama-3-8B frames on a full 400 MiB tier: 4 of 16). The disk tier,
    alone, gave up a group's blocks to the next group's the same way. So did a chain sent in
    several bodies (past the client's max_body_bytes, tail first), each body evicting the
    ones before it (of a raw Llama-3-8B prompt of 64 blocks in 3 bodies, 31 were left),
    until a body's room spared the stored run below its last block: the client is the one
    it was, and says nothing more. An ``ingest_batch`` of two requests of 4 blocks (the vLLM
    connector's call: one stream, last request first, cut into bodies of 3, 3 and 2 frames)
    kept 4 and 0 while a body spared only the run below its highest block (the first
    request's tail, with nothing below), and 4 and 2 while it spared each of its chains' runs
    alone: the last body holds none of the second request, which only the second body's
    record of what it stored and spared names."""
    import cacheseek as cs
    from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for

    args = {"cpu": (), "cpu-no-reserve": ("--cpu-reserve-bytes", "0"), "disk": ("--disk-bytes", "1MiB"),
            "written-through": ("--disk-bytes", "1MiB")}[tier]
    kw = {"model_id": "full", "layout": LAYOUT, "codec": cs.Raw(), "block_tokens": BLOCK, "trust_env": False}
    with Server(tmp_path, *args, disk=tier in ("disk", "written-through"), cpu_bytes="0" if tier == "disk" else "1MiB") \
            as srv, cs.RemoteCache(srv.url, **kw) as cache:
        older = [(tokens_for(200 + i, 4 * BLOCK), make_kv(4 * BLOCK, 200 + i)) for i in range(6)]
        for toks, kv in older:  # the tier fills, and every block in it is read again
            assert cache.ingest(toks, kv).stored == 4
            assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)
        for top in cache.stats()["tiers"]:  # (both, written through: the disk gave them up too)
            assert top["evictions"] > 0, f"the {top['name']} tier is not full: the test proves nothing"
        n = 8 // requests  # (8 blocks in all)
        prompts = [(tokens_for(300 + r, n * BLOCK), make_kv(n * BLOCK, 300 + r)) for r in range(requests)]
        frame = cache.block_format.max_frame_nbytes() + 8  # (and its length prefix)
        with cs.RemoteCache(srv.url, **kw, max_body_bytes=3 * frame if bodies > 1 else "1GiB") as writer:
            posts = _block_posts(writer)
            if requests == 1:
                assert writer.ingest(*prompts[0]).stored == 8
            else:
                from paged_helpers import engine_pages, page_tables, write_tokens
                pages, _ = engine_pages("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 64, 16,
                                        LAYOUT.torch_dtype)
                tables = page_tables([n * BLOCK] * requests, 16, 64, seed=3)
                for (_, kv), table in zip(prompts, tables):
                    write_tokens(pages, kv, table)
                got = writer.ingest_batch([cs.PagedRequest(t, table) for (t, _), table in zip(prompts, tables)], pages)
                assert [r.stored for r in got] == [n] * requests
            assert _block_posts(writer) - posts == bodies
        left = [cache.lookup(toks) // BLOCK for toks, _ in prompts]
        assert left == [n] * requests, f"{left} of the {n} blocks of each request answered stored are left"
        for toks, kv in prompts:
            assert_prefix_equal(cache.materialize(toks), kv, n * BLOCK)


@pytest.mark.parametrize("tier", ["cpu", "cpu-no-reserve", "disk"], ids=["received-in-place", "buffered", "disk-only"])
def test_a_write_longer_than_the_tier_evicts_its_own_earlier_bodies_rather_than_fail(tmp_path, tier):
    """A body's room spares the write's earlier bodies only while anything else may go: a
    chain of 8 blocks sent in 3 bodies into a tier of 4 has nothing else to give up, and each
    body is stored all the same, evicting the earlier ones leaf first, as it did before they
    were spared (a chain longer than the tier keeps its head). Spared outright, the second
    body was refused (``Spared``: "failed")."""
    import cacheseek as cs
    from cacheseek.store.disk import allocation_unit, block_charge
    from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for

    nbytes = 50_000  # (a frame of these: ~49.6 kB) a tier of 4 of them, not 5
    if tier == "disk":
        (tmp_path / "disk").mkdir(parents=True, exist_ok=True)
        args: tuple[str, ...] = ("--disk-bytes", str(4 * block_charge(nbytes, allocation_unit(tmp_path / "disk")) + 8192))
    else:
        args = ("--cpu-reserve-bytes", "0") if tier == "cpu-no-reserve" else ()
    kw = {"model_id": "long", "layout": LAYOUT, "codec": cs.Raw(), "block_tokens": BLOCK, "trust_env": False}
    with Server(tmp_path, *args, disk=tier == "disk", cpu_bytes="0" if tier == "disk" else str(4 * nbytes + 20_000)) as srv, \
            cs.RemoteCache(srv.url, **kw) as cache:
        frame = cache.block_format.max_frame_nbytes() + 8  # (and its length prefix)
        assert 49_000 < frame < nbytes
        toks, kv = tokens_for(400, 8 * BLOCK), make_kv(8 * BLOCK, 400)
        with cs.RemoteCache(srv.url, **kw, max_body_bytes=3 * frame) as writer:
            posts = _block_posts(writer)
            report = writer.ingest(toks, kv)
            assert (report.stored, report.failed) == (8, 0), report
            assert _block_posts(writer) - posts == 3
        top = next(t for t in cache.stats()["tiers"] if t["name"] == ("disk" if tier == "disk" else "cpu"))
        assert (top["blocks"], top["write_errors"]) == (4, 0), top
        assert cache.lookup(toks) == 4 * BLOCK  # the head
        assert_prefix_equal(cache.materialize(toks[: 4 * BLOCK]), kv, 4 * BLOCK)


def test_a_body_that_extends_a_stored_prefix_leaves_no_record_for_a_next_body():
    """A body leaves a record of what it stored under its chains' first blocks, for the
    write's next body, which holds their parents as new frames. A chain whose parent is held
    already (a body extending a stored prefix, the common single-body write) has no such next
    body: its record was never taken, and such records, one a body, turned the others over
    under load. A body of several chains counts its one record once."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import TieredStore
    from server.metrics import Metrics
    from server.namespaces import Namespaces
    from server.service import BlockService

    store = TieredStore([CpuTier(8 << 20)])
    service = BlockService(store, Namespaces(b"s" * 32), Metrics(), max_chain_blocks=1 << 10)
    ns = Namespaces(b"s" * 32)
    chain = raw_chain(90, 4)
    incoming = [service.check_client_frame(bytearray(f), where=f"frame {i}") for i, (_, f) in enumerate(chain)]
    service.put("", incoming[:2])  # a prefix, stored whole from its head
    assert not service._bodies
    service.put("", incoming[2:])  # extends it: its first block's parent is held
    assert not service._bodies and service._bodies_keys == 0
    # The tail of another chain first, its head to come in a next body: a record, counted once.
    other = raw_chain(91, 4)
    later = [service.check_client_frame(bytearray(f), where=f"frame {i}") for i, (_, f) in enumerate(other)]
    service.put("", later[2:])
    first = ns.stored_key("", other[2][0])
    assert list(service._bodies) == [first] and service._bodies_keys == 2
    service.put("", later[:2])  # the next body takes it in
    assert not service._bodies and service._bodies_keys == 0


def test_a_put_spares_nothing_and_walks_nothing_a_post_body_spares_the_run_below_it():
    """A body's room spares the stored run below its chains (the write's earlier bodies,
    ``_earlier_bodies``), a walk of up to 4,096 children lookups (~4 ms). A PUT's frame
    walked it too, and one received in place into a memory store is committed in the event
    loop, where ~0.1 ms is what that path allows (a client PUTting a long chain tail first
    walked everything below each block). A PUT now spares nothing and walks nothing; our
    client sends a write past max_body_bytes as POST bodies, never as PUTs."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import TieredStore
    from server.metrics import Metrics
    from server.namespaces import Namespaces
    from server.service import BlockService

    store = TieredStore([CpuTier(8 << 20)])
    service = BlockService(store, Namespaces(b"s" * 32), Metrics(), max_chain_blocks=1 << 10)
    walked: list[bytes] = []
    children = store.children
    store.children = lambda key: (walked.append(key), children(key))[1]  # type: ignore[method-assign]
    spared: list[object] = []
    put_many = store.put_many
    store.put_many = lambda items, **kw: (spared.append(kw.get("spare")), put_many(items, **kw))[1]  # type: ignore[method-assign]
    try:
        for seed, put in ((70, True), (71, False)):
            chain = raw_chain(seed, 4)
            reports = service.put("", [service.check_client_frame(bytearray(f)) for _, f in chain[1:]])
            assert [r.status for r in reports] == ["stored"] * 3
            walked.clear(), spared.clear()
            h, f = chain[0]
            if put:
                assert service.check_and_put("", bytearray(f), h).status == "stored"
                assert len(walked) <= 1 and spared == [()]  # (one lookup: its children's positions)
            else:
                assert service.put("", [service.check_client_frame(bytearray(f))])[0].status == "stored"
                assert len(walked) > 1 and [set(s) for s in spared] == [{k for k, _ in chain[1:]}]  # type: ignore[call-overload]
    finally:
        store.close()


def test_a_body_of_several_chains_spares_each_ones_run_within_one_bound():
    """Every chain of a body has its run walked (an ingest_batch's body holds several), and
    one bound (``SPARE_RUN_BLOCKS``, or max_chain_blocks if lower) caps all the walks'
    lookups and the spare together, not each walk."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import TieredStore
    from server.metrics import Metrics
    from server.namespaces import Namespaces
    from server.service import BlockService

    store = TieredStore([CpuTier(8 << 20)])
    spared: list[object] = []
    put_many = store.put_many
    store.put_many = lambda items, **kw: (spared.append(kw.get("spare")), put_many(items, **kw))[1]  # type: ignore[method-assign]
    try:
        for bound, want in ((64, 10), (8, 7)):  # (8 lookups: 5 blocks and the end of one run, 2 of the other)
            service = BlockService(store, Namespaces(b"s" * 32), Metrics(), max_chain_blocks=bound)
            chains = [raw_chain(80 + bound + c, 6) for c in range(2)]
            for chain in chains:  # (each its own body, then forgotten: the spare is found by the walk)
                service.put("", [service.check_client_frame(bytearray(f)) for _, f in chain[1:]])
            service._bodies.clear()
            spared.clear()
            service.put("", [service.check_client_frame(bytearray(chain[0][1])) for chain in chains])
            [spare] = spared
            below = {k for chain in chains for k, _ in chain[1:]}
            assert len(spare) == want and set(spare) <= below  # type: ignore[arg-type]
    finally:
        store.close()
