"""The HTTP service as a client on the network (or a web page in a browser) would probe it:
who may change what, and what a refused request leaves behind. Real ``cacheseek serve``
processes on loopback."""

from __future__ import annotations

import socket

import httpx
import pytest

from server_helpers import Server, batch_body, raw_frame


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No tokens: the default, on loopback."""
    with Server(tmp_path_factory.mktemp("open")) as srv:
        yield srv


def _stored(url: str, h: bytes) -> bool:
    got = httpx.post(url + "/v1/lookup", json={"hashes": [h.hex()]})
    assert got.status_code == 200, got.text
    return got.json()["matched"] == 1


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_page_of_another_origin_cannot_store_blocks_with_a_simple_request(open_server, content_type):
    """A browser sends a POST whose body is typed as text or a form (or not typed) to any
    origin without a CORS preflight: fetch(url, {method: "POST", mode: "no-cors", body}).
    Every web page a user of the server's host opened could store KV in a server without
    tokens (served to inference as a cached prefix's). The browser names the page in Origin."""
    h, frame = raw_frame(1)
    headers = {"Origin": "http://attacker.example"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]), headers=headers)
    assert got.status_code == 403, got.text
    assert "another origin" in got.json()["error"]
    assert not _stored(open_server.url, h)
    # An opaque origin (a sandboxed frame, a file:// page) is another origin too.
    got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]), headers={"Origin": "null"})
    assert got.status_code == 403, got.text
    assert not _stored(open_server.url, h)


def test_a_page_of_another_origin_cannot_delete_prefetch_or_use_another_port(open_server):
    h, frame = raw_frame(2)
    assert httpx.put(f"{open_server.url}/v1/blocks/{h.hex()}", content=frame).status_code == 201
    host = open_server.url.removeprefix("http://")
    # Another port of the same host is another origin (a page of another local service).
    for origin in ("http://attacker.example", f"http://127.0.0.1:{open_server.port + 1}", f"https://{host}"):
        got = httpx.delete(f"{open_server.url}/v1/blocks/{h.hex()}", headers={"Origin": origin})
        assert got.status_code == 403, (origin, got.text)
        got = httpx.post(open_server.url + "/v1/prefetch", content=f'{{"hashes": ["{h.hex()}"]}}',
                         headers={"Origin": origin, "Content-Type": "text/plain"})
        assert got.status_code == 403, (origin, got.text)
    assert _stored(open_server.url, h)


def test_the_servers_own_pages_and_clients_without_origin_still_write(open_server):
    """The dashboard's and /docs' requests carry the server's own origin; RemoteCache, curl
    and every client that is not a browser send no Origin: both are let through. A GET from
    another origin too: the browser hides its answer from the page, and it changes nothing."""
    host = open_server.url.removeprefix("http://")
    for i, origin in enumerate((None, f"http://{host}", f"HTTP://{host.upper()}")):
        h, frame = raw_frame(10 + i)
        headers = {"Origin": origin} if origin is not None else {}
        got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]), headers=headers)
        assert got.status_code == 200 and got.json()[0]["status"] == "stored", (origin, got.text)
        assert _stored(open_server.url, h)
    got = httpx.get(f"{open_server.url}/v1/blocks/{h.hex()}", headers={"Origin": "http://attacker.example"})
    assert got.status_code == 200



def test_a_rebound_name_cannot_write_to_a_server_on_loopback(open_server):
    """DNS rebinding: a page at http://rebound.example:PORT whose name is made to resolve to
    127.0.0.1 after it loaded is, for the browser, of the server's origin: its requests carry
    Host and Origin both naming rebound.example, and passed the same-origin check. On a
    loopback address, the page must be of a loopback name (localhost, 127.0.0.0/8, [::1])."""
    h, frame = raw_frame(30)
    port = open_server.port
    for name in ("rebound.example", "10.1.2.3", "[2001:db8::1]"):
        got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]),
                         headers={"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}", "Content-Type": "text/plain"})
        assert got.status_code == 403, (name, got.text)
        assert not _stored(open_server.url, h)
    for i, name in enumerate(("localhost", "127.0.0.2", "app.localhost")):
        h, frame = raw_frame(31 + i)
        got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]),
                         headers={"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}"})
        assert got.status_code == 200 and got.json()[0]["status"] == "stored", (name, got.text)


@pytest.mark.parametrize("name, args, env", [
    ("write_token", ["--write-token", "s3cret-w "], {}),  # a secret file's line, its newline cut, a space left
    ("admin_token", ["--write-token", "s3cret-w"], {"CACHESEEK_ADMIN_TOKEN": "s3cret-caf\u00e9"}),
    ("read_token", ["--write-token", "s3cret-w", "--read-token", "\u00a0s3cret-r"], {}),
    ("tenants['team-a'].write_token", ["--write-token", "s3cret-w"],
     {"CACHESEEK_TENANTS": '{"team-a": {"write_token": "s3cret-t\\n"}}'}),
])
def test_a_token_no_header_can_carry_stops_the_start_without_printing_it(tmp_path, name, args, env):
    """A token with a space at either end, or a character outside printable ASCII, was taken:
    the server started, and every request holding it was a 403 (a header's value is ASCII and
    its edge spaces are not part of it). The start stops, naming the setting, not the token."""
    srv = Server(tmp_path, *args, env=env)
    with pytest.raises(RuntimeError, match="exited with 2") as refused:
        srv.start()
    out = str(refused.value)
    assert name in out and "printable ASCII" in out, out
    assert "s3cret" not in out, out


def test_tokens_with_spaces_inside_are_accepted_and_work(tmp_path):
    with Server(tmp_path, "--write-token", "s3cret with spaces") as srv:
        h, frame = raw_frame(20)
        got = httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=frame,
                        headers={"Authorization": "Bearer s3cret with spaces"})
        assert got.status_code == 201, got.text
        assert httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=frame).status_code == 401


@pytest.mark.parametrize("host", ["127.0.0.1:\u00b2", "127.0.0.1:" + "1" * 5000, "[::1", "127.0.0.1:", "127.0.0.1:-1"])
def test_a_host_header_of_no_port_is_another_origin_never_a_500(open_server, host):
    """The same-origin check reads the Host header's port: one that is not a number (a
    latin-1 superscript digit, thousands of digits int() refuses) is refused, not a crash."""
    h, frame = raw_frame(40)
    got = httpx.post(open_server.url + "/v1/blocks", content=batch_body([frame]),
                     headers={"Host": host.encode("latin-1"), "Origin": f"http://{host}".encode("latin-1")})
    assert got.status_code in (400, 403), got.text
    assert not _stored(open_server.url, h)


def test_request_methods_of_no_standard_make_no_label_sets(tmp_path):
    """h11 answers any token as a method (a 404 or 405), and each one was a label of
    /metrics' request series, with a histogram kept for the life of the process: a client
    without a token grew /metrics and the server's memory without bound."""
    with Server(tmp_path, "--http", "h11", disk=False) as srv:
        for i in range(40):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(f"XMETHOD{i} /v1/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 4"), answer[:100]
        text = httpx.get(srv.url + "/metrics").text
        assert "XMETHOD" not in text
        others = [line for line in text.splitlines() if line.startswith("cacheseek_http_requests_total{")
                  and 'method="_other"' in line]
        assert sum(float(line.rpartition(" ")[2]) for line in others) == 40, others


def test_metrics_take_an_operator_or_metrics_token_where_the_server_has_tokens(tmp_path):
    """/metrics names every namespace and model with its traffic and usage: open on a server
    with tokens, it told anyone who reached the port the tenants' names and their load, what
    /v1/stats hides from a tenant's token. With tokens it takes the metrics token or the
    operator's; a refusal is the usual 401/403 and never holds the token."""
    tenants = '{"team-secret": {"write_token": "tenant-w"}}'
    wrong = "wrong-scrape-token-7f3a"
    env = {"CACHESEEK_TENANTS": tenants, "CACHESEEK_METRICS_TOKEN": "scrape-me", "CACHESEEK_ADMIN_TOKEN": "adm"}
    with Server(tmp_path / "tokens", "--read-token", "rd", "--write-token", "wr", "--access-log", "--log-level", "info",
                disk=False, env=env) as srv, httpx.Client(base_url=srv.url) as c:
        h, frame = raw_frame(7)
        put = c.put(f"/v1/blocks/{h.hex()}", content=frame, headers={"Authorization": "Bearer tenant-w"})
        assert put.status_code == 201, put.text
        refused = c.get("/metrics")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", refused.text
        assert set(refused.json()) == {"error"} and "team-secret" not in refused.text
        assert c.head("/metrics").status_code == 401
        for token in (wrong, "tenant-w"):  # a tenant's token reads its own figures only (/v1/stats)
            got = c.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert got.status_code == 403 and set(got.json()) == {"error"}, got.text
            assert token not in got.text and "team-secret" not in got.text
        for token in ("scrape-me", "rd", "wr", "adm"):
            got = c.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert got.status_code == 200 and 'namespace="team-secret"' in got.text, token
        # The metrics token reads nothing else.
        assert c.get("/v1/stats", headers={"Authorization": "Bearer scrape-me"}).status_code == 403
        assert c.get(f"/v1/blocks/{h.hex()}", headers={"Authorization": "Bearer scrape-me",
                                                        "X-CacheSeek-Namespace": "team-secret"}).status_code == 403
    log = srv.output()
    assert "GET /metrics" in log and wrong not in log and "scrape-me" not in log
    # metrics_open: today's scrapers, without a token, on a server with tokens.
    with Server(tmp_path / "open", "--write-token", "wr", "--metrics-open", disk=False) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200


def test_a_tier_error_a_tenant_reads_names_no_stored_key(tmp_path):
    """A stored key is a namespace's mask XOR the client's hash. A disk write that failed
    answered "disk tier: writing <stored key>.frame failed": the tenant XORed it with its hash
    to get its mask, and with it read, deleted and overwrote the default namespace's blocks
    (whose mask is zero). Tier reasons reach clients with every key hidden (the log keeps them)."""
    import json
    import re

    tenants = json.dumps({"a": {"write_token": "tenant-a-secret-token"}})
    tenant = {"Authorization": "Bearer tenant-a-secret-token"}
    # Frames of the test layout (32 KiB) cannot be written past 20,000 bytes a file: a disk that fails.
    with Server(tmp_path, "--write-token", "operator-token", env={"CACHESEEK_TENANTS": tenants},
                max_file_bytes=20_000) as srv, httpx.Client(base_url=srv.url) as c:
        h, frame = raw_frame(2)
        r = c.put(f"/v1/blocks/{h.hex()}", content=frame, headers=tenant)
        assert r.status_code == 507 and "writing <key>.frame failed" in r.json()["error"], r.text
        h2, frame2 = raw_frame(3)
        r = c.post("/v1/blocks", content=batch_body([frame2]), headers=tenant)
        errors = r.json()[0]["errors"] if r.status_code == 200 else r.json()
        said = json.dumps(errors)
        assert "<key>" in said, r.text
        for text in (said, c.put(f"/v1/blocks/{h.hex()}", content=frame, headers=tenant).text):
            assert not [k for k in re.findall(r"[0-9a-f]{32,}", text) if k not in (h.hex(), h2.hex())], text
        assert re.search(r"WARNING.*a block could not be stored: disk: disk tier: writing [0-9a-f]{32}\.frame failed",
                         srv.output()), srv.output()  # (the operator's log keeps the key)
