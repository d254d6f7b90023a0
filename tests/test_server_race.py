"""Writes checked at the same moment on one server: the positions each request checks must
still hold when it stores. A real uvicorn on loopback runs the app in this process, so that
a test can hold a request between its check and its store (``BlockService._put``) while
another request is checked and answered."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn

from cacheseek.errors import StorageError
from cacheseek.server.app import create_app
from cacheseek.server.claims import Conflict, PositionClaims
from cacheseek.server.config import ServerSettings
from cacheseek.server.protocol import protocol_class
from cacheseek.server.service import BlockService
from cacheseek.store.frame import parse_frame
from server_helpers import batch_body, free_port, raw_chain, raw_frame

WAIT = 20.0  # seconds before a step that never comes fails the test (rather than hanging it)


@dataclass
class Served:
    url: str
    service: BlockService


@pytest.fixture
def served(tmp_path) -> Iterator[Served]:
    """The app under uvicorn in a thread (its fast receive path, as ``cacheseek serve`` runs it)."""
    port = free_port()
    settings = ServerSettings(port=port, cpu_bytes=64 << 20, disk_bytes=0, disk_path=tmp_path / "disk",
                              log_level="warning")
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol_class() or "auto",
                            log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", app.state.service)
    finally:
        srv.should_exit = True
        thread.join(WAIT)


@dataclass
class Hold:
    """Holds the write of block ``key`` after its check, before its store, until ``go``.
    With ``fail``, the store then raises (a tier that failed)."""

    key: bytes
    fail: bool = False
    checked: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)

    def install(self, service: BlockService, monkeypatch: pytest.MonkeyPatch) -> Hold:
        store = service._put

        def held(namespace: str, frames: list, keys: list[bytes], **kw: object) -> list:
            if self.key in keys:
                self.checked.set()
                if not self.go.wait(WAIT):
                    raise RuntimeError("the test never let the held write go on")
                if self.fail:
                    raise StorageError("every tier failed (injected by the test)")
            return store(namespace, frames, keys, **kw)

        monkeypatch.setattr(service, "_put", held)
        return self


def send(url: str, route: str, h: bytes, frame: bytes) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=WAIT) as c:
        if route == "PUT":
            return c.put(f"/v1/blocks/{h.hex()}", content=frame)
        return c.post("/v1/blocks", content=batch_body([frame]))


def contradicting_links(service: BlockService, keys: list[bytes]) -> list[str]:
    """Stored blocks of ``keys`` whose stored parent is not one position above them."""
    out = []
    for key in keys:
        info = service.store.info(key)
        if info is None or info.position == 0:
            continue
        parent = service.store.info(info.parent)
        if parent is not None and parent.position != info.position - 1:
            out.append(f"{key.hex()} at {info.position} -> parent {info.parent.hex()} at {parent.position}")
    return out


@pytest.mark.parametrize("route", ["PUT", "POST"])
@pytest.mark.parametrize("held_first", ["parent", "child"])
def test_a_link_checked_beside_a_write_in_flight_that_contradicts_it_is_refused(served, monkeypatch, held_first,
                                                                                route):
    """P at position 3 and C (parent P) at position 1, in two requests: whichever is checked
    while the other is between its check and its store is refused, and no contradicting
    link is stored. Before, both passed (each checked a store without the other) and the
    link C -> P went up two positions."""
    p, parent = raw_frame(1, position=3, parent=os.urandom(16))  # P's own parent is not stored
    c, child = raw_frame(2, position=1, parent=p)
    (held_hash, held_frame), (other_hash, other_frame) = ((p, parent), (c, child)) if held_first == "parent" \
        else ((c, child), (p, parent))
    hold = Hold(held_hash).install(served.service, monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        # A batch is stored in a worker thread (a PUT into memory may be stored in the event loop).
        first = pool.submit(send, served.url, "POST", held_hash, held_frame)
        try:
            assert hold.checked.wait(WAIT), "the first write never reached its store"
            second = send(served.url, route, other_hash, other_frame)
        finally:
            hold.go.set()
        answer = first.result(WAIT)
    assert contradicting_links(served.service, [p, c]) == []
    assert answer.status_code == 200 and answer.json()[0]["status"] == "stored", answer.text
    assert second.status_code == 400, second.text
    assert "position" in second.json()["error"]
    with httpx.Client(base_url=served.url, timeout=WAIT) as client:
        assert client.get(f"/v1/blocks/{other_hash.hex()}").status_code == 404
        assert parse_frame(bytearray(client.get(f"/v1/blocks/{held_hash.hex()}").content)).position == \
            (3 if held_first == "parent" else 1)


def test_a_failed_write_leaves_no_position_behind(served, monkeypatch):
    """A write whose store fails holds nothing once answered: a block it named at one
    position is then taken at another."""
    p, parent = raw_frame(3, position=3, parent=os.urandom(16))
    c, child = raw_frame(4, position=1, parent=p)
    hold = Hold(p, fail=True).install(served.service, monkeypatch)
    hold.go.set()
    assert send(served.url, "POST", p, parent).status_code == 507
    r = send(served.url, "PUT", c, child)
    assert r.status_code == 201, r.text


def test_writers_of_one_chain_at_once_all_pass(served, monkeypatch):
    """Concurrent writers of the same blocks at the same positions (clients sharing a prompt)
    contradict nothing: the second is stored while the first is held, the first finds it
    present."""
    chain = raw_chain(5, 3)
    body = batch_body([f for _, f in chain])
    hold = Hold(chain[1][0]).install(served.service, monkeypatch)
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=served.url, timeout=WAIT) as client:
        first = pool.submit(client.post, "/v1/blocks", content=body)
        try:
            assert hold.checked.wait(WAIT), "the first write never reached its store"
            hold.key = b""  # the second write goes straight through
            second = client.post("/v1/blocks", content=body)
        finally:
            hold.go.set()
        answer = first.result(WAIT)
    assert [r["status"] for r in second.json()] == ["stored"] * 3, second.text
    assert [r["status"] for r in answer.json()] == ["present"] * 3, answer.text


def test_a_position_is_held_until_every_writer_claiming_it_is_done():
    claims = PositionClaims()
    p, c = (b"P" * 16, b"root" * 4, 3), (b"C" * 16, b"P" * 16, 1)
    assert claims.claim([p]) is None and claims.claim([p]) is None  # two writers of P at 3
    assert claims.claim([c]) == Conflict(0, "parent", b"P" * 16, 3)
    claims.release([p])
    assert claims.claim([c]) == Conflict(0, "parent", b"P" * 16, 3)  # the other writer still holds it
    claims.release([p])
    assert claims.claim([c]) is None
    assert claims.claim([(b"P" * 16, b"root" * 4, 3)]) == Conflict(0, "child", b"C" * 16, 1)
    assert claims.claim([(b"C" * 16, b"X" * 16, 2)]) == Conflict(0, "self", b"C" * 16, 1)
    claims.release([c])
    assert len(claims) == 0
