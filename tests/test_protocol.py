"""``server.protocol``: request bodies read straight into the app's buffers, under a real
uvicorn on loopback (in a thread, with a small ASGI app), over raw sockets so that requests
can be pipelined and cut off at will."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import threading
import time

import pytest
import uvicorn

from cacheseek.server import protocol
from cacheseek.server.protocol import BODY_INTO, protocol_class
from server_helpers import free_port

BIG = 5 << 20  # far more than one read: the protocol takes the body over
SEEN: list[list[int]] = []  # what each read of the app's last requests got
HOLD = threading.Event()  # POST /hold reads nothing until it is set
RUNNING: list[uvicorn.Server] = []  # the fixture's server, for tests that look at its connections


async def app(scope, receive, send):
    """POST /?8,1000,...: read the body into buffers of those sizes (the rest into one more,
    unless ``only`` is in the list), answer what each read got and the SHA-256 of what was
    read. POST /early: answer without reading. POST /hold: wait for ``HOLD``, then read all.
    """
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/early":
        out = b'{"early": true}'
    elif scope["path"] == "/hold":
        await asyncio.to_thread(HOLD.wait, 60)
        digest, total, buf = hashlib.sha256(), 0, bytearray(1 << 16)
        while k := await scope["extensions"][BODY_INTO](buf):
            digest.update(memoryview(buf)[:k])
            total += k
        out = json.dumps({"length": total, "sha256": digest.hexdigest()}).encode()
    else:
        into = scope["extensions"][BODY_INTO]
        length = int(dict(scope["headers"]).get(b"content-length", b"0"))
        query = scope["query_string"].decode().split(",")
        sizes = [int(x) for x in query if x.isdigit()]
        if "only" not in query:
            sizes.append(max(length - sum(sizes), 0) + 10)  # room for more than is left
        digest, pieces, got = hashlib.sha256(), hashlib.sha256(), []
        for n in sizes:
            buf = bytearray(n)
            k = await into(buf, pieces.update)  # each piece as it lands, in order
            got.append(k)
            digest.update(memoryview(buf)[:k])
        SEEN.append(got)
        out = json.dumps({"got": got, "sha256": digest.hexdigest(), "pieces": pieces.hexdigest()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(params=["uvloop", "asyncio"])
def server(request, monkeypatch):
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    # Off the fast path (no httptools, a uvicorn out of range) uvicorn would serve these
    # bodies its own way, and the tests would wait for reads that never come: fail at once.
    problem = protocol.fast_path_problem()
    if problem is not None:
        pytest.fail(f"the fast receive path is off: {problem}")
    taken = []  # bytes received by the buffered protocol, read by the tests
    updated = protocol.BodyTakeover.buffer_updated

    def counting(self, nbytes):
        taken.append(nbytes)
        return updated(self, nbytes)

    monkeypatch.setattr(protocol.BodyTakeover, "buffer_updated", counting)
    port = free_port()
    marker = request.node.get_closest_marker("keep_alive_s")
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol_class(), loop=request.param,
                            log_level="warning", lifespan="on",
                            timeout_keep_alive=marker.args[0] if marker else 5)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    RUNNING.append(srv)
    yield port, taken
    RUNNING.remove(srv)
    HOLD.clear()
    srv.should_exit = True
    thread.join(10)


def request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def read_response(sock: socket.socket, rest: bytearray) -> tuple[int, dict]:
    while b"\r\n\r\n" not in rest:
        data = sock.recv(65536)
        assert data, "connection closed"
        rest += data
    head, _, tail = bytes(rest).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines[1:])
    n = int(headers[b"content-length"])
    body = bytearray(tail)
    while len(body) < n:
        data = sock.recv(65536)
        assert data, "connection closed"
        body += data
    rest[:] = body[n:]
    return int(lines[0].split()[1]), json.loads(bytes(body[:n]))


def test_a_body_is_read_in_place_in_any_pieces_and_the_connection_lives_on(server):
    port, taken = server
    body = os.urandom(BIG)
    with socket.create_connection(("127.0.0.1", port)) as s:
        rest = bytearray()
        for sizes in ([], [8, 1_000_000, 8], [BIG - 3, 1, 1]):
            s.sendall(request("/?" + ",".join(map(str, sizes)), body))
            status, got = read_response(s, rest)
            assert status == 200 and got["sha256"] == got["pieces"] == hashlib.sha256(body).hexdigest()
            assert got["got"][: len(sizes)] == sizes and sum(got["got"]) == BIG
    assert sum(taken) > BIG  # most of every body came through recv_into, not the parser


@pytest.mark.parametrize("chunk", [1, 2])
def test_a_chunked_body_of_tiny_chunks_held_for_a_route_costs_its_bytes_not_an_object_each(server, chunk):
    """A chunked body of 2-byte chunks sent to a route that does not read it yet: each chunk
    was kept as a ``bytes`` of its own (48 bytes with the allocator's rounding, and 8 in the
    deque) until ``high_water`` (1 MiB) bytes waited: measured, the server's RSS grew 28.6 MiB
    for one such connection (1-byte chunks: 8.9 MiB, CPython shares 1-byte ``bytes``, not the
    deque's slots). Small pieces are gathered into larger ones: what the pieces hold is about
    their bytes, and the body read later is the one sent, in order."""
    import sys

    port, _ = server
    data = bytes(i % 251 for i in range(3 << 20))  # past high_water, and past what the socket buffers hold
    wire = b"".join(b"%x\r\n" % chunk + data[i : i + chunk] + b"\r\n" for i in range(0, len(data), chunk))
    wire += b"0\r\n\r\n"
    head = b"POST /hold HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        sender = threading.Thread(target=s.sendall, args=(head + wire,), daemon=True)
        sender.start()
        deadline = time.monotonic() + 30
        while True:  # until the server stops reading: its pieces at high_water
            conns = list(RUNNING[0].server_state.connections)
            if conns and conns[0].flow.read_paused:
                break
            assert time.monotonic() < deadline, "the server never paused reading"
            time.sleep(0.01)
        cycle = conns[0].cycle
        pieces = list(cycle.pieces)
        held = sum(len(p) for p in pieces)
        # (a 1-byte bytes is CPython's shared one: its slot alone is this connection's)
        in_objects = sum(sys.getsizeof(p) if len(p) > 1 else 0 for p in pieces) + 8 * len(pieces)
        assert held > protocol.HIGH_WATER, held
        assert in_objects < 1.25 * held + (64 << 10), (in_objects, held, len(pieces))
        HOLD.set()
        rest = bytearray()
        status, got = read_response(s, rest)
        sender.join(30)
    assert status == 200 and got == {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_pipelined_requests_after_a_body_read_in_place(server):
    port, _ = server
    first, second = os.urandom(BIG), os.urandom(3000)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request("/?100", first) + request("/early", b"xyz") + request("/", second))
        rest = bytearray()
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(first).hexdigest()
        assert read_response(s, rest)[1] == {"early": True}
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(second).hexdigest()


def test_an_answer_before_the_body_skips_it_and_the_connection_lives_on(server):
    port, _ = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        rest = bytearray()
        s.sendall(request("/early", os.urandom(BIG)))
        assert read_response(s, rest)[1] == {"early": True}
        body = os.urandom(1000)
        s.sendall(request("/", body))
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(body).hexdigest()


def test_an_answer_in_the_middle_of_a_body_read_in_place_skips_the_rest(server):
    port, taken = server
    first, second = os.urandom(BIG), os.urandom(3000)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request("/?only,8,1000000", first) + request("/", second))
        rest = bytearray()
        digest = hashlib.sha256(first[:1_000_008]).hexdigest()
        assert read_response(s, rest)[1] == {"got": [8, 1_000_000], "sha256": digest, "pieces": digest}
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(second).hexdigest()
    assert sum(taken) >= BIG - 1_000_008  # the rest of the first body went through the takeover


@pytest.mark.keep_alive_s(1)
def test_a_body_still_arriving_after_an_early_answer_is_not_cut_off_as_idle(server):
    """Answered mid-body (a bad frame, a 503), the connection skips the rest of the body as
    it comes: the body's bytes are activity, as the parser's are, and the idle keep-alive timer
    armed by the answer once closed the connection under a client still sending its body."""
    port, taken = server
    first, second = os.urandom(BIG), os.urandom(3000)
    with socket.create_connection(("127.0.0.1", port)) as s:
        whole = request("/?only,8,1000000", first)
        s.sendall(whole[: 2 << 20])
        rest = bytearray()
        assert read_response(s, rest)[1]["got"] == [8, 1_000_000]
        for i in range(2 << 20, len(whole), 512 << 10):  # the rest over ~2.5 s, well past the keep-alive
            time.sleep(0.4)
            s.sendall(whole[i : i + (512 << 10)])
        s.sendall(request("/", second))
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(second).hexdigest()
    assert sum(taken) >= BIG - (2 << 20)  # the rest of the first body went through the takeover


def test_an_answer_to_a_body_never_asked_for_under_expect_100_continue_closes_the_connection(server):
    """A client that sent ``Expect: 100-continue`` and got a final answer without a 100 may
    send its body or not (RFC 9110, 10.1.1), so what follows the answer on the connection is
    a body or the next request, which nothing tells apart: the server once read the client's
    next request as the body it skips, and never answered it. It closes the connection now.
    A body asked for (the 100 sent) is read, and the connection lives on."""
    port, _ = server
    expect = "expect: 100-continue\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST /early HTTP/1.1\r\nhost: x\r\n{expect}content-length: {BIG}\r\n\r\n".encode())
        rest = bytearray()
        assert read_response(s, rest)[1] == {"early": True}
        s.settimeout(3)
        try:
            s.sendall(request("/", b"next"))
            assert s.recv(65536) == b""
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed, too
        except TimeoutError:
            raise AssertionError("the connection stayed open, reading the next request as the body") from None
    body = os.urandom(3000)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST / HTTP/1.1\r\nhost: x\r\n{expect}content-length: {len(body)}\r\n\r\n".encode())
        rest = bytearray()
        while b"\r\n\r\n" not in rest:
            rest += s.recv(65536)
        assert bytes(rest).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del rest[: len(b"HTTP/1.1 100 Continue\r\n\r\n")]
        s.sendall(body)
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(body).hexdigest()
        s.sendall(request("/", body))
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_client_gone_mid_body_ends_the_read_short(server):
    port, _ = server
    body = os.urandom(BIG)
    SEEN.clear()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request("/?8", body)[: BIG // 2])
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while not SEEN:
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.02)
    assert SEEN[-1][0] == 8 and 0 < SEEN[-1][1] < BIG - 8
    # The server is unharmed: a new connection is served.
    with socket.create_connection(("127.0.0.1", port)) as s:
        rest = bytearray()
        s.sendall(request("/", body))
        assert read_response(s, rest)[1]["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.keep_alive_s(60)
def test_a_connection_the_client_resets_is_let_go_at_once(server):
    """uvicorn cancels a connection's idle keep-alive timer when it ends cleanly, not when the
    client resets it (``connection_lost`` with an error): the timer held the protocol, its
    last request's scope and cycle, until it fired, keepalive_timeout_seconds later. A client
    answered and then resetting its connections, over and over, kept that many alive."""
    import gc
    import struct

    port, _ = server
    srv = RUNNING[-1]
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(request("/", b"x" * 100))
            read_response(s, bytearray())  # answered: the idle keep-alive timer is armed
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
    deadline = time.monotonic() + 10  # (the keep-alive timer: 60 s)
    while True:
        gc.collect()
        # (type(), not isinstance(): the latter asks every object's __class__, and some of
        # torch's module objects warn when asked)
        left = [o for o in gc.get_objects() if type(o) is srv.config.http_protocol_class]
        if not left:
            break
        assert time.monotonic() < deadline, f"{len(left)} of the connections the client reset are still held"
        del left
        time.sleep(0.05)


def test_the_fast_path_is_on_with_the_pinned_uvicorn_and_off_loudly_otherwise(monkeypatch):
    import uvicorn
    from uvicorn.protocols.http import httptools_impl

    from cacheseek.server.protocol import fast_path_problem

    # The installed uvicorn and httptools are in the pinned range, and read as expected: when
    # a release changes what server.protocol relies on, this fails (and the server warns).
    assert fast_path_problem() is None and protocol_class() is not None
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    assert "uvicorn 0.99.0 is outside the tested range" in fast_path_problem() and protocol_class() is None
    monkeypatch.undo()
    monkeypatch.setattr(httptools_impl.HttpToolsProtocol, "on_message_complete", lambda self: None)
    assert "on_message_complete" in fast_path_problem() and protocol_class() is None


def test_a_server_without_httptools_serves_on_uvicorns_own_parser_and_says_so(tmp_path):
    """The fast path needs httptools; without it the server warns and serves on uvicorn's
    h11 parser (it once asked uvicorn for httptools anyway, and died at start). h11 is
    strict: RemoteCache's streamed POSTs once went without a Host header, which it refuses."""
    import httpx
    import torch

    import cacheseek as cs
    from server_helpers import LAYOUT, Server, raw_frame

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "httptools.py").write_text('raise ImportError("httptools hidden by this test")\n')
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    h, frame = raw_frame(7)
    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 2, 64, 64, generator=gen).half(), torch.randn(1, 2, 64, 64, generator=gen).half())
          for _ in range(LAYOUT.num_layers)]
    with Server(tmp_path, disk=False, env={"PYTHONPATH": path}) as srv:
        assert httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=frame, timeout=10).status_code == 201
        got = httpx.get(f"{srv.url}/v1/blocks/{h.hex()}", timeout=10)
        assert got.status_code == 200 and got.content == frame
        with cs.RemoteCache(srv.url, model_id="h11", layout=LAYOUT, codec=cs.Raw(), block_tokens=32) as remote:
            assert remote.ingest(list(range(64)), kv).stored == 2
            back = remote.materialize(list(range(64)))
            assert back.num_tokens == 64 and all(torch.equal(a, b) for a, b in zip(back.layers[1], kv[1]))
        out = srv.output()
    assert "fast path is OFF (cannot import uvicorn's httptools protocol: httptools hidden by this test)" in out


class _SlowReader:
    """A transport whose client takes ``per_tick`` bytes of the buffered response a second."""

    def __init__(self, buffered: int, per_tick: int) -> None:
        self.buffered, self.per_tick, self.aborted_at = buffered, per_tick, None

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.aborted_at is not None

    def abort(self) -> None:
        self.aborted_at = time.monotonic()


def test_a_response_read_slower_than_the_minimum_rate_is_cut_off():
    """A client that takes a little of a response now and then never goes a whole
    body_idle_timeout_seconds without a byte, and held the response's leases for good: once
    writing has been paused that long, it must have averaged body_min_bytes_per_second."""
    import asyncio

    limits = protocol.ConnectionLimits(body_idle_timeout_seconds=2.0, body_min_bytes_per_second=64 << 10)

    async def watch(per_second: int) -> float | None:
        loop = asyncio.get_running_loop()
        transport = _SlowReader(8 << 20, per_second)
        proto = type("P", (), {"loop": loop, "transport": transport, "client": ("127.0.0.1", 1)})()
        dog = protocol.Watchdog(proto, limits)
        start = time.monotonic()
        dog.send_paused()
        while time.monotonic() - start < 4.5 and transport.aborted_at is None:
            await asyncio.sleep(0.25)
            transport.buffered -= per_second // 4  # the client reads on
        dog.stop()
        return None if transport.aborted_at is None else transport.aborted_at - start

    trickle = asyncio.run(watch(16 << 10))  # 16 KiB/s: progress on every tick, a quarter of the rate
    assert trickle is not None and 1.5 < trickle < 3.5, trickle
    assert asyncio.run(watch(1 << 20)) is None  # a reader at 1 MiB/s is served on
