"""``BulkTransport`` against a fake server that answers what each test scripts, over real
sockets: bad heads, interim answers, connections closed after an answer or while idle (the
stale-connection race), TLS. Each case ends in a clear error or a transparent resend, and
the pool is usable afterwards (one connection in it: a leaked slot would time out)."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import httpx
import pytest

from cacheseek.transport import BulkTransport
from fake_http import FakeServer, Script

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _client(srv: FakeServer, **kw) -> httpx.Client:
    transport = BulkTransport(max_connections=1, **{"trust_env": False, **kw})
    return httpx.Client(base_url=srv.url, transport=transport, timeout=httpx.Timeout(5, pool=1))


def _usable(c: httpx.Client) -> None:
    """One connection in the pool: a slot leaked by an earlier error would time out here."""
    for _ in range(3):
        r = c.get("/fine")
        assert r.status_code == 200 and r.content == b"ok"


def _bad_first(bad: bytes) -> Script:
    return lambda n, head: (bad, True) if b"/bad" in head else (OK, False)


@pytest.mark.parametrize("bad, match", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\nok", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nok", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "differ"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok", "both"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok", "Transfer-Encoding"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\n no-name\r\nContent-Length: 2\r\n\r\nok", "header line"),
    (b"HTTP/2 200 OK\r\nContent-Length: 2\r\n\r\nok", "status line"),
    (b"ICY 200 OK\r\n\r\nok", "status line"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "101"),
    (b"HTTP/1.1 099 Odd\r\n\r\n" + OK, "status 099"),  # no status below 100: not an interim answer
    (b"HTTP/1.1 000 Zero\r\n\r\n" + OK, "status 000"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nok", "missing"),
])
def test_a_malformed_answer_is_a_clear_error_and_leaks_nothing(bad, match):
    with FakeServer(_bad_first(bad)) as srv, _client(srv) as c:
        with pytest.raises(httpx.RemoteProtocolError, match=match):
            c.get("/bad").read()
        _usable(c)


@pytest.mark.parametrize("where", ["lease", "lock"])
def test_an_interrupt_as_a_connection_slot_is_taken_gives_the_slot_back(monkeypatch, where):
    """A slot was taken, then its lease made and listed before the ``try`` that gives it
    back: an interrupt there (Ctrl-C) kept the slot for good, and after max_connections of
    them every call waited out the pool timeout and failed as "more calls at once"."""
    from cacheseek import transport
    from store_helpers import InterruptedAtRelease

    with FakeServer(lambda n, head: (OK, False)) as srv, _client(srv) as c:
        bulk = c._transport
        for _ in range(2):  # (one slot: a slot kept by the first would time the second out)
            if where == "lease":
                real = transport._Lease.__init__

                def interrupted(self, *args):
                    raise KeyboardInterrupt

                monkeypatch.setattr(transport._Lease, "__init__", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    c.get("/fine")
                monkeypatch.setattr(transport._Lease, "__init__", real)
            else:
                real_lock = bulk._lock
                bulk._lock = InterruptedAtRelease(real_lock, when=lambda: bool(bulk._leases))
                with pytest.raises(KeyboardInterrupt):
                    c.get("/fine")
                bulk._lock = real_lock
        assert not bulk._leases
        _usable(c)


def test_interim_answers_are_skipped_and_the_connection_stays_in_step():
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    with FakeServer(lambda n, head: (interim + OK, False)) as srv, _client(srv) as c:
        for _ in range(4):
            r = c.post("/x", content=b"body")
            assert r.status_code == 200 and r.content == b"ok"
        assert srv.connections == 1  # one kept-alive connection, never out of step


def test_a_connection_closed_right_after_the_answer_is_not_reused():
    with FakeServer(lambda n, head: (OK, True)) as srv, _client(srv) as c:
        for _ in range(5):
            assert c.get("/x").content == b"ok"
        assert srv.connections == 5


def test_connection_close_and_http_1_0_are_honoured():
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    old = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"
    for reply in (close, old):
        # The server keeps the socket open: a client that ignored the header would hang on reuse.
        with FakeServer(lambda n, head, reply=reply: (reply, False)) as srv, _client(srv) as c:
            for _ in range(3):
                assert c.get("/x").content == b"ok"
            assert srv.connections == 3


def test_a_kept_alive_connection_closed_by_the_server_is_resent_once_when_idempotent():
    # The race: the server gives up on the connection just as the next request arrives, so
    # the request meets a closed connection (here: every second request on a connection).
    stale = lambda n, head: (None, True) if n == 1 else (OK, False)  # noqa: E731
    with FakeServer(stale) as srv, _client(srv) as c:
        for i in range(6):
            assert c.get(f"/x{i}").content == b"ok"
            assert c.put(f"/p{i}", content=b"frame").content == b"ok"
            assert c.post("/lookup", content=b"h" * 16, extensions={"cacheseek_idempotent": True}).content == b"ok"
        assert srv.connections > 6
        # A POST (not idempotent) or a body that cannot be sent again is not resent: a clear error.
        c.get("/warm")
        with pytest.raises(httpx.RemoteProtocolError, match="closed before a response"):
            c.post("/once", content=b"x")
        c.get("/warm")
        with pytest.raises(httpx.TransportError):
            c.put("/stream", content=iter([b"a", b"b"]))
        _usable(c)


@pytest.mark.parametrize("record", [b"\x15\x03\x01\x00\x02\x02\x46", b"\x16\x03\x03\x00\x00"])
def test_an_answer_that_is_a_tls_record_says_to_use_https(record):
    # A TLS server that answers plain HTTP with an alert (0x15) or a handshake record (0x16)
    # rather than closing: the head read on to the close ("closed inside a response head").
    with FakeServer(lambda n, head: (record, False)) as srv, _client(srv) as c:
        with pytest.raises(httpx.RemoteProtocolError, match=r"a TLS record .* use an https:// URL"):
            c.get("/x")


def test_a_fresh_connection_closed_before_an_answer_names_https_only_if_the_server_speaks_tls(tls):
    # A TLS server closes a plain request's connection without a byte: the error says so only
    # once a TLS handshake with it succeeded (a plain server that closed says nothing of TLS).
    _, server = tls
    closed = lambda n, head: (None, True)  # noqa: E731
    with FakeServer(closed) as plain, _client(plain) as c:
        started = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError, match="closed before a response") as said:
            c.get("/x")  # (the fake waits on the hello for a head: the handshake gives up at its 1 s)
        assert "https" not in str(said.value) and time.monotonic() - started < 2.5
        assert plain.connections == 2  # the request's, and the handshake's
    with FakeServer(closed, tls=server) as tls_only:  # (the fake's TLS handshake fails on plain bytes)
        with _client(tls_only) as c, pytest.raises(httpx.RemoteProtocolError) as said:
            c.get(f"http://127.0.0.1:{tls_only.port}/x")
        assert "speaks https, not http: use an https:// URL" in str(said.value), said.value


def test_an_ipv6_server_is_named_in_brackets_where_the_scheme_is_wrong(tls):
    # "::1:8080 speaks https" read as an address of more groups (or port 1:8080): the
    # address is said as its URL writes it, [::1]:8080.
    _, server = tls
    record = b"\x15\x03\x01\x00\x02\x02\x46"
    for script, tls_server in (((lambda n, head: (record, False)), None), ((lambda n, head: (None, True)), server)):
        with FakeServer(script, tls=tls_server, host="::1") as srv, _client(srv) as c:
            with pytest.raises(httpx.RemoteProtocolError, match=rf": \[::1\]:{srv.port} speaks https"):
                c.get(f"http://[::1]:{srv.port}/x")
    # A plain server answers a TLS hello with its 400 at once (as uvicorn's parsers do).
    plain = socket.create_server(("::1", 0), family=socket.AF_INET6)
    port = plain.getsockname()[1]

    def answer() -> None:
        conn, _ = plain.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    with plain, httpx.Client(transport=BulkTransport(trust_env=False), timeout=5) as c:
        with pytest.raises(httpx.ConnectError, match=rf"TLS handshake with \[::1\]:{port} failed: .*: "
                                                     rf"\[::1\]:{port} does not speak TLS"):
            c.get(f"https://[::1]:{port}/x")


def test_a_connection_the_server_closed_while_idle_is_replaced_before_use():
    with FakeServer(lambda n, head: (OK, False)) as srv, _client(srv) as c:
        assert c.get("/x").content == b"ok"
        pooled = next(iter(c._transport._idle.values()))[0]
        pooled.shutdown(socket.SHUT_RD)  # as if the server's FIN arrived
        assert c.get("/y").content == b"ok"
        assert srv.connections == 2


@pytest.fixture
def high_fds():
    """Descriptors above 1024 (FD_SETSIZE) for what is opened next, as in a process with
    many files and sockets open (vLLM raises its limit for them)."""
    import os
    import resource

    import gc

    gc.collect()  # (a socket an earlier test left in a cycle, closed later, would free a descriptor below)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Raising a hard limit below 1200 needs privilege: without it, this fails and says so.
    raised = hard if hard == resource.RLIM_INFINITY else max(hard, 1200)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), raised))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_past_descriptor_1024_are_kept_alive_and_checked(high_fds):
    """The check of a pooled connection (is it still open?) used select(), which refuses
    descriptors past 1024: every such connection was taken for closed, and every request
    opened a new one (a TCP and TLS handshake each, and no error to say so)."""
    with FakeServer(lambda n, head: (OK, False)) as srv, _client(srv) as c:
        for _ in range(4):
            assert c.get("/x").content == b"ok"
        assert srv.connections == 1
        pooled = next(iter(c._transport._idle.values()))[0]
        assert pooled.fileno() > 1024
        pooled.shutdown(socket.SHUT_RD)  # as if the server's FIN arrived: still replaced before use
        assert c.get("/y").content == b"ok"
        assert srv.connections == 2


def test_chunked_and_close_delimited_bodies():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\nok\r\n3\r\n!!!\r\n0\r\nX-T: 1\r\n\r\n"
    eof = b"HTTP/1.1 200 OK\r\n\r\nuntil the end"
    with FakeServer(lambda n, head: (eof, True) if b"/eof" in head else (chunked, False)) as srv, _client(srv) as c:
        assert c.get("/c").content == b"ok!!!"
        assert c.get("/c").content == b"ok!!!"
        assert c.get("/eof").content == b"until the end"
        assert c.get("/c").content == b"ok!!!"


def test_a_chunk_is_handed_on_as_it_arrives_not_held_whole():
    """A chunk's size is the peer's word (up to 2**64 bytes): its data was read into memory
    whole before any of it was handed on, so a reader that stops after a limit of its own
    (RemoteCache's ``ANSWER_BYTES``) held everything a peer sent in one endless chunk, and
    here waited for bytes that never come."""
    read = threading.Event()

    def script(n: int, head: bytes):
        def body():
            yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % (1 << 40) + b"x" * (1 << 20)
            read.wait(10)  # the rest of the chunk: not until the client has what came
        return body(), True

    with FakeServer(script) as srv, _client(srv, chunk_bytes=1 << 20) as c:
        with c.stream("GET", "/big", timeout=httpx.Timeout(1, pool=1)) as r:
            got = 0
            for piece in r.iter_raw():
                assert 0 < len(piece) <= 1 << 20
                got += len(piece)
                if got == 1 << 20:
                    break
        read.set()


def test_other_schemes_are_refused_and_proxies_are_honoured(monkeypatch):
    with pytest.raises(httpx.UnsupportedProtocol, match="ftp"):
        BulkTransport().handle_request(httpx.Request("GET", "ftp://example.invalid/x"))
    # A proxy from the environment: the request goes to it, in absolute form.
    with FakeServer(lambda n, head: (OK, False)) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("NO_PROXY", "")
        with httpx.Client(transport=BulkTransport()) as c:
            assert c.get("http://cacheseek.invalid:8080/v1/stats").content == b"ok"
        assert proxy.requests[-1].startswith(b"GET http://cacheseek.invalid:8080/v1/stats HTTP/1.1")
        # NO_PROXY covers the host: straight to it (which does not exist here).
        monkeypatch.setenv("NO_PROXY", "cacheseek.invalid")
        with httpx.Client(transport=BulkTransport()) as c, pytest.raises(httpx.ConnectError):
            c.get("http://cacheseek.invalid:8080/v1/stats")


def test_a_proxy_without_a_scheme_is_http_and_one_that_cannot_carry_is_refused_up_front(monkeypatch):
    """HTTP_PROXY=host:port (a common form, which httpx and curl read as http://) failed
    every call with httpx's ValueError, and a bad ``proxy=`` was taken at construction; a
    NO_PROXY entry with a port was never matched."""
    import cacheseek as cs
    from store_helpers import BLOCK, LAYOUT

    with FakeServer(lambda n, head: (OK, False)) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"127.0.0.1:{proxy.port}")
        monkeypatch.setenv("NO_PROXY", "")
        with httpx.Client(transport=BulkTransport()) as c:
            assert c.get("http://cacheseek.invalid:8080/v1/stats").content == b"ok"
        assert proxy.requests[-1].startswith(b"GET http://cacheseek.invalid:8080/v1/stats HTTP/1.1")
        monkeypatch.setenv("NO_PROXY", "cacheseek.invalid:8080")
        with httpx.Client(transport=BulkTransport()) as c, pytest.raises(httpx.ConnectError):
            c.get("http://cacheseek.invalid:8080/v1/stats")
        with httpx.Client(transport=BulkTransport()) as c:  # another port: through the proxy
            assert c.get("http://cacheseek.invalid:8081/v1/stats").content == b"ok"
    monkeypatch.delenv("NO_PROXY")
    made = dict(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, on_unavailable="miss")
    for given, said in ((dict(proxy="ftp://u:pw@127.0.0.1:1"), r"^proxy: 'ftp://u:\*\*\*@127.0.0.1:1' cannot carry"),
                        (dict(proxy="127.0.0.1:3128"), r"^proxy: '127.0.0.1:3128' cannot carry")):
        with pytest.raises(cs.ConfigError, match=said):
            cs.RemoteCache("http://127.0.0.1:9", **made, **given)
    monkeypatch.setenv("HTTP_PROXY", "gopher://127.0.0.1:70")
    with pytest.raises(cs.ConfigError, match=r"^the environment's HTTP_PROXY or ALL_PROXY: 'gopher://"):
        cs.RemoteCache("http://127.0.0.1:9", **made)
    cs.RemoteCache("http://127.0.0.1:9", **made, trust_env=False).close()  # (the environment not read)


@pytest.fixture(scope="module")
def tls():
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(server)
    return ca, server


def test_https_verifies_against_a_ca_bundle_and_moves_bodies(tls, tmp_path):
    ca, server = tls
    big = bytes(range(256)) * 4096  # 1 MiB: more than one TLS record, read with recv_into
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
    with FakeServer(lambda n, head: (reply, False), tls=server) as srv:
        bundle = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(bundle))
        with _client(srv, verify=str(bundle)) as c:
            for _ in range(3):
                r = c.put("/x", content=big)
                assert r.content == big
            assert srv.connections == 1  # kept alive over TLS
        with _client(srv) as c, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            c.get("/x")  # the system's CAs do not know the test's CA
        with _client(srv, verify=False) as c:
            assert c.get("/x").content == big


def _dribbled(part: str) -> Script:
    """An answer whose head, body or chunks come a byte every 20 ms: each read is well within
    the read timeout, the whole far beyond the exchange's limit."""
    def script(n: int, head: bytes):
        def pieces():
            answer = {"head": OK, "body": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n" + b"x" * 500,
                      "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * 100
                      + b"0\r\n\r\n"}[part]
            start = 0 if part == "head" else answer.index(b"\r\n\r\n") + 4
            yield answer[:start]
            for i in range(start, len(answer)):
                time.sleep(0.02)
                yield answer[i : i + 1]
        return pieces(), True
    return script


@pytest.mark.parametrize("part", ["head", "body", "chunked"])
def test_an_answer_dribbled_within_the_read_timeout_is_cut_off_at_the_exchange_timeout(part):
    with FakeServer(_dribbled(part)) as srv, _client(srv, exchange_timeout=0.5) as c:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match="exchange_timeout"):
            c.get("/slow").read()
        assert time.monotonic() - start < 2.5  # the read timeout is 5 s; the dribble takes 10 s
    with FakeServer(lambda n, head: (OK, False)) as srv, _client(srv, exchange_timeout=0.5) as c:
        _usable(c)  # within the limit: answered as ever, and the connection reused


@pytest.mark.parametrize("part", ["body", "chunked"])
def test_an_answer_dribbled_through_a_proxy_is_cut_off_at_the_exchange_timeout_and_by_a_cutoff(part, monkeypatch):
    """Through a proxy (here one from the environment, as ``trust_env`` takes it) httpx's
    transport carried the exchange, and neither ``exchange_timeout`` nor ``cut_off_at``
    applied: an answer dribbled a byte at a time ran its whole length (``RemoteCache`` exit
    waited 105 s with exit_timeout=3). Its body is now ended at the deadline, and an exchange
    begun after a cutoff is refused unsent. (The fake server answers the absolute-form
    request as a proxy would forward it.)"""
    with FakeServer(_dribbled(part)) as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("NO_PROXY", "")
        transport = BulkTransport(max_connections=1, exchange_timeout=0.5)
        with httpx.Client(base_url="http://cacheseek.invalid:8080", transport=transport,
                          timeout=httpx.Timeout(5, pool=1)) as c:
            start = time.monotonic()
            with pytest.raises(httpx.ReadTimeout, match="exchange_timeout"):
                c.get("/slow").read()
            assert time.monotonic() - start < 2.5  # the read timeout is 5 s; the dribble takes 10 s
            assert proxy.requests[-1].startswith(b"GET http://cacheseek.invalid:8080/slow")
            transport.exchange_timeout = None
            assert transport.cut_off_at(time.monotonic()) == 0  # (nothing under way)
            sent = len(proxy.requests)
            with pytest.raises(httpx.ReadTimeout, match="cut off"):
                c.get("/after")
            assert len(proxy.requests) == sent
            assert transport._proxied_threads == []


def _unanswered(address: str, port: int = 0) -> tuple[socket.socket, list[socket.socket]]:
    """A listener whose accept queue is full: connects to it hang (their SYNs dropped)."""
    listener = socket.socket()
    listener.bind((address, port))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect((address, port))
        except BlockingIOError:
            pass
        queued.append(c)
    time.sleep(0.2)
    return listener, queued


@pytest.mark.parametrize("bound", ["timeout", "exchange_timeout"])
def test_a_name_of_two_unanswering_addresses_is_given_up_within_the_bound_not_twice_it(monkeypatch, bound):
    """socket.create_connection gives each address the whole connect timeout: a name with two
    addresses that drop packets (a dual-stack host whose IPv6 route is dead) took twice the
    bound, past ``exchange_timeout`` too. The addresses share the bound now."""
    first, held1 = _unanswered("127.0.0.1")
    port = first.getsockname()[1]
    second, held2 = _unanswered("127.0.0.2", port)
    real = socket.getaddrinfo

    def two_addresses(host, *args, **kw):
        if host == "two.invalid":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port))]
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    kw, timeout = ({"exchange_timeout": 1.0}, 30) if bound == "exchange_timeout" else ({}, 1.0)
    transport = BulkTransport(max_connections=1, trust_env=False, **kw)
    try:
        with httpx.Client(base_url=f"http://two.invalid:{port}", transport=transport,
                          timeout=httpx.Timeout(timeout, pool=1)) as c:
            start = time.monotonic()
            with pytest.raises(httpx.TimeoutException) as info:
                c.get("/stats")
            assert 0.9 < time.monotonic() - start < 1.8  # (2 s: each address given the whole bound)
            assert f"127.0.0.1:{port}" in str(info.value) and f"127.0.0.2:{port}" in str(info.value)  # both tried
    finally:
        for sock in [first, second, *held1, *held2]:
            sock.close()


def _names(monkeypatch, answers) -> None:
    """``socket.getaddrinfo`` of each name in ``answers`` is ``answers[name](port)``; other
    names, and address literals, as ever."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host in answers and not flags & socket.AI_NUMERICHOST:
            return answers[host](port)
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _at(*addresses: str):
    return lambda port: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]


def test_a_name_whose_first_address_drops_packets_connects_through_the_next(monkeypatch):
    """The first address was given the whole connect budget: a name whose first address
    drops SYNs (a dead IPv6 route listed first) was an outage for good, though its second
    answered, and the error said "every address". The next address starts a quarter second
    on (Happy Eyeballs, RFC 8305), the one that connected is tried first from then on, and a
    name none of whose addresses answers says which were tried."""
    from cacheseek.connect import RESOLVER

    with FakeServer(lambda n, head: (OK, False)) as srv:
        hole, held = _unanswered("127.0.0.2", srv.port)
        try:
            _names(monkeypatch, {"first-dead.invalid": _at("127.0.0.2", "127.0.0.1"),
                                 "none-listening.invalid": _at("127.0.0.3", "127.0.0.4")})
            transport = BulkTransport(max_connections=1, trust_env=False)
            with httpx.Client(base_url=f"http://first-dead.invalid:{srv.port}", transport=transport,
                              timeout=httpx.Timeout(3, pool=1)) as c:
                start = time.monotonic()
                assert c.get("/fine").content == b"ok"  # (the old code: ConnectTimeout at 3 s)
                assert time.monotonic() - start < 2.5
            first = RESOLVER.addresses("first-dead.invalid", srv.port, None)[0]
            assert first[4] == ("127.0.0.1", srv.port)  # the address that connected, first next time
            with httpx.Client(base_url=f"http://none-listening.invalid:{srv.port}",
                              transport=BulkTransport(max_connections=1, trust_env=False),
                              timeout=httpx.Timeout(3, pool=1)) as c, pytest.raises(httpx.ConnectError) as info:
                c.get("/fine")
            assert f"127.0.0.3:{srv.port}" in str(info.value) and f"127.0.0.4:{srv.port}" in str(info.value)
        finally:
            for sock in [hole, *held]:
                sock.close()


def test_an_address_of_a_family_the_host_cannot_open_hands_its_turn_to_the_next(monkeypatch):
    """A name's address whose socket cannot even be made (an IPv6 address on a host built or
    booted without IPv6: EAFNOSUPPORT) is a failed try, as a refused connect is: the next
    address is tried at once, not the error raised out of the connect."""
    with FakeServer(lambda n, head: (OK, False)) as srv:
        unopenable = (255, socket.SOCK_STREAM, 6, "", ("::9", srv.port, 0, 0))  # (no such address family)
        _names(monkeypatch, {"no-v6.invalid": lambda port: [unopenable, *_at("127.0.0.1")(port)]})
        with httpx.Client(base_url=f"http://no-v6.invalid:{srv.port}",
                          transport=BulkTransport(max_connections=1, trust_env=False),
                          timeout=httpx.Timeout(3, pool=1)) as c:
            start = time.monotonic()
            assert c.get("/fine").content == b"ok"
            assert time.monotonic() - start < 2.0  # (no stagger waited: the failed try handed on at once)


def test_a_name_lookup_never_answered_is_a_connect_timeout_naming_dns_one_lookup_at_a_time(monkeypatch):
    """``getaddrinfo`` knows no timeout: with a dead resolver every connect (every breaker
    probe) waited its ~10 s whatever the client's timeout. The lookup is held to the connect
    budget now, a late one a ConnectTimeout that names DNS, and the calls that come while it
    is out wait for that one lookup rather than each start a thread of its own."""
    release, lookups = threading.Event(), []

    def hung(port):
        lookups.append(port)
        release.wait(20)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    _names(monkeypatch, {"hung-dns.invalid": hung})
    try:
        transport = BulkTransport(max_connections=2, trust_env=False)
        with httpx.Client(base_url="http://hung-dns.invalid:8080", transport=transport,
                          timeout=httpx.Timeout(5, connect=0.5, pool=1)) as c:
            for _ in range(3):
                start = time.monotonic()
                with pytest.raises(httpx.ConnectTimeout, match=r"DNS.*hung-dns\.invalid"):
                    c.get("/v1/stats")
                assert time.monotonic() - start < 4  # (the resolver's own 20 s before)
        assert lookups == [8080]
    finally:
        release.set()


@pytest.mark.parametrize("outage", ["fails", "hangs"])
def test_a_resolver_that_fails_for_now_leaves_the_names_last_addresses_in_use(monkeypatch, outage):
    """A resolver that stops answering (``EAI_AGAIN``, or no answer at all: a DNS outage)
    made every new connection fail, the server itself up. The name's last good addresses are
    used meanwhile, within the connect budget; once a lookup has failed or been late, at
    once (each new connection waited half its budget for the same dead resolver). A name
    never resolved is an error that names the lookup."""
    dead, release = threading.Event(), threading.Event()
    name = f"flaky-dns-{outage}.invalid"

    def flaky(port):
        if dead.is_set():
            if outage == "hangs":
                release.wait(20)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return _at("127.0.0.1")(port)

    def never(port):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    _names(monkeypatch, {name: flaky, "never-resolved.invalid": never})
    with FakeServer(lambda n, head: (OK, True)) as srv:  # (closes each connection: each request a new one)
        transport = BulkTransport(max_connections=1, trust_env=False)
        try:
            with httpx.Client(base_url=f"http://{name}:{srv.port}", transport=transport,
                              timeout=httpx.Timeout(5, connect=1, pool=1)) as c:
                assert c.get("/a").content == b"ok"
                dead.set()
                assert c.get("/b").content == b"ok"  # (hangs: half the 1 s connect budget waited)
                start = time.monotonic()
                for _ in range(4):
                    assert c.get("/c").content == b"ok"
                assert time.monotonic() - start < 1.0  # (2 s before: 0.5 s a connect)
        finally:
            release.set()
        assert srv.connections == 6
        with httpx.Client(base_url=f"http://never-resolved.invalid:{srv.port}",
                          transport=BulkTransport(max_connections=1, trust_env=False),
                          timeout=httpx.Timeout(5, pool=1)) as c, \
                pytest.raises(httpx.ConnectError, match=r"name lookup \(DNS\) of never-resolved\.invalid"):
            c.get("/a")


def test_a_request_body_a_server_never_reads_is_cut_off_at_the_exchange_timeout():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never reads
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        transport = BulkTransport(max_connections=1, trust_env=False, exchange_timeout=0.5)
        with httpx.Client(base_url=url, transport=transport, timeout=httpx.Timeout(5, pool=1)) as c:
            start = time.monotonic()
            with pytest.raises(httpx.TimeoutException, match="exchange_timeout"):
                c.post("/upload", content=bytes(64 << 20))
            assert time.monotonic() - start < 2.5


def test_cut_off_at_holds_an_exchange_under_way_and_refuses_one_begun_after_it_unsent():
    """``cut_off_at`` (``RemoteCache.close()``'s bound on its queued writes): a dribbled answer
    under way ends at the cutoff, sooner than its own ``exchange_timeout``; an exchange begun
    after it fails at once, and no connection is made for it. The pool slot comes back."""
    with FakeServer(_dribbled("body")) as srv, _client(srv, exchange_timeout=30) as c:
        transport = c._transport
        start = time.monotonic()
        transport.cut_off_at(start + 0.5)
        with pytest.raises(httpx.ReadTimeout, match="cut off"):
            c.get("/slow").read()
        assert time.monotonic() - start < 2.5  # the dribble takes 10 s, the exchange_timeout 30
        connections = srv.connections
        with pytest.raises(httpx.ReadTimeout, match="cut off"):
            c.get("/after")
        assert srv.connections == connections and time.monotonic() - start < 2.5
        assert transport._slots.acquire(timeout=0)  # (no slot leaked)


def _one_body(listener: socket.socket, got: list[bytes]) -> None:
    """Read one request of known length on ``listener``, keep its body, answer OK."""
    conn, _ = listener.accept()
    with conn:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        got.append(body)
        conn.sendall(OK)


def test_a_body_streamed_from_one_reused_buffer_arrives_as_each_chunk_was_when_yielded():
    """A request's stream may reuse a chunk's memory once it is asked for the next
    (RemoteCache sends each frame from a reused buffer): the small chunks held back to go
    out with later ones are held as copies, and the large ones are sent at once."""
    import threading

    sizes = [8, 100, 3000, 70_000, 5, 64 * 1024, 1, 64 * 1024 - 1, 2]
    buf = bytearray(max(sizes))
    sent: list[bytes] = []

    def stream():
        for i, n in enumerate(sizes):
            buf[:n] = bytes([i + 1]) * n
            sent.append(bytes(buf[:n]))
            yield memoryview(buf)[:n]
            buf[:] = b"\xee" * len(buf)  # the memory reused: what the transport holds must not change

    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=_one_body, args=(listener, got), daemon=True)
        server.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with httpx.Client(base_url=url, transport=BulkTransport(trust_env=False), timeout=5) as c:
            r = c.post("/x", content=stream(), headers={"content-length": str(sum(sizes))})
        server.join(5)
    assert r.status_code == 200 and got == [b"".join(sent)]


def test_a_body_the_server_stops_reading_is_a_write_timeout_not_a_read_one():
    """A request body the server stopped reading (a stalled server or front) ran past the
    write timeout, and was reported as ``ReadTimeout``: ``RemoteCache`` then said a read had
    timed out for an upload that never finished. It is a ``WriteTimeout``, as httpx's own."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # its backlog takes the connection; nothing reads
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with httpx.Client(base_url=url, transport=BulkTransport(max_connections=1, trust_env=False),
                          timeout=httpx.Timeout(0.3, pool=1)) as c:
            start = time.monotonic()
            with pytest.raises(httpx.WriteTimeout):
                c.post("/upload", content=bytes(64 << 20))
            assert time.monotonic() - start < 2.5
