"""The batch framing (shared by the server and RemoteCache) and BulkTransport."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheseek.transport import BulkTransport
from cacheseek.batch_body import BatchFormatError, BatchReader, BatchTooLarge
from server_helpers import Server, batch_body, raw_frame

FRAMES = [raw_frame(i, block=8)[1] for i in range(3)]
BODY = batch_body(FRAMES)


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(BODY)), max_size=12))
def test_any_split_of_a_body_gives_the_same_frames(cuts):
    reader = BatchReader(max_frame_bytes=1 << 20, max_body_bytes=1 << 22)
    got = []
    points = [0, *sorted(cuts), len(BODY)]
    for a, b in zip(points, points[1:]):
        got += reader.feed(BODY[a:b])
    reader.finish()
    assert [bytes(f) for f in got] == FRAMES


def test_limits_and_truncation():
    with pytest.raises(BatchTooLarge, match="max_frame_bytes"):
        BatchReader(max_frame_bytes=100, max_body_bytes=1 << 20).feed(BODY)
    with pytest.raises(BatchTooLarge, match="max_body_bytes"):
        BatchReader(max_frame_bytes=1 << 20, max_body_bytes=len(BODY) - 1).feed(BODY)
    reader = BatchReader(max_frame_bytes=1 << 20, max_body_bytes=1 << 22)
    reader.feed(BODY[:-1])
    with pytest.raises(BatchFormatError, match="ended after"):
        reader.finish()


def test_bulk_transport_reuses_connections_and_reports_a_dead_server(tmp_path):
    transport = BulkTransport(max_connections=2)
    with Server(tmp_path, disk=False) as srv, httpx.Client(base_url=srv.url, transport=transport) as c:
        h, frame = raw_frame(1)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame).status_code == 201
        for _ in range(5):
            assert c.get(f"/v1/blocks/{h.hex()}").content == frame
            assert c.get("/healthz").json() == {"status": "ok"}
        assert sum(len(v) for v in transport._idle.values()) == 1  # one connection, kept alive
        with c.stream("GET", f"/v1/blocks/{h.hex()}") as r:
            assert b"".join(bytes(x) for x in r.iter_raw()) == frame
        r = c.post("/v1/blocks", content=iter([b"\x00" * 8]))  # chunked request body
        assert r.status_code == 400 and "preamble" in r.json()["error"]
        srv.stop()
        with pytest.raises(httpx.TransportError):
            c.get("/healthz")


def test_iter_frames_reads_a_prefix_stream_with_either_transport(tmp_path):
    from cacheseek.batch_body import iter_frames
    from server_helpers import raw_chain

    chain = raw_chain(9, 4)
    with Server(tmp_path, disk=False) as srv:
        for transport in (BulkTransport(), None):
            with httpx.Client(base_url=srv.url, transport=transport) as c:
                c.post("/v1/blocks", content=batch_body([f for _, f in chain])).raise_for_status()
                with c.stream("GET", f"/v1/prefixes/{chain[-1][0].hex()}") as r:
                    assert [bytes(f) for f in iter_frames(r, max_frame_bytes=1 << 20)] == [f for _, f in chain]
                assert c.get("/healthz").status_code == 200  # the connection is usable after
