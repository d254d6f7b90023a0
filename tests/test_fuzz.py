"""A fuzz pass over the real server on loopback: every route of ``/openapi.json`` through
schemathesis (bounded examples), and a small valid frame damaged at every byte (flipped,
truncated; alone and inside a batch). No answer is a 5xx, every rejection is a 4xx with a
JSON reason, and nothing stored changes on a rejected request."""

from __future__ import annotations

import httpx
import pytest

from cacheseek.layout import KVLayout
from server_helpers import Server, batch_body, raw_frame

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = 30  # per operation: the whole pass stays under a minute on 2 cores
TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")  # a frame of ~1.3 KB


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("fuzz"), "--max-frame-bytes", "1MiB", "--max-body-bytes", "4MiB",
                "--max-lookup-hashes", "64") as srv:
        h, frame = raw_frame(1, layout=TINY)
        assert httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=frame).status_code == 201
        yield srv


def store_state(client: httpx.Client) -> list[tuple]:
    return [(t["name"], t["blocks"], t["used_bytes"], t["bytes_in"], t.get("write_errors"))
            for t in client.get("/v1/stats").json()["tiers"]]


def test_every_route_answers_fuzzed_requests_without_a_5xx(server):
    # schemathesis's own strategies, driven by hypothesis here (its pytest plugin does not
    # load under every pytest): each operation of the document gets its bounded examples.
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    checks = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
              schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for operation in operations:

            @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy())
            def fuzz(case) -> None:
                before = store_state(client)
                response = case.call(base_url=server.url, timeout=30)
                where = (case.method, case.formatted_path, response.status_code, response.text[:200])
                assert response.status_code < 500, where
                if response.status_code >= 400:
                    assert "error" in response.json(), where
                    assert store_state(client) == before, where
                case.validate_response(response, checks=checks)

            fuzz()


def test_a_frame_damaged_at_every_byte_is_refused_and_stores_nothing(server):
    h, good = raw_frame(7, layout=TINY)
    damaged = []
    for i in range(len(good)):
        flipped = bytearray(good)
        flipped[i] ^= 0xFF
        damaged.append(("flip", i, bytes(flipped)))
        damaged.append(("truncate", i, good[:i]))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = store_state(client)
        for how, i, body in damaged:
            r = client.put(f"/v1/blocks/{h.hex()}", content=body)
            assert r.status_code in (400, 409), (how, i, r.status_code, r.text)
            assert r.json()["error"], (how, i)
        for how, i, body in damaged[::29]:  # inside a batch, behind a good frame: the whole batch is refused
            _, other = raw_frame(8, layout=TINY)
            r = client.post("/v1/blocks", content=batch_body([other, body]))
            assert r.status_code in (400, 409, 413), (how, i, r.status_code, r.text)
        whole = batch_body([good])
        for i in [*range(8), *range(8, len(whole), 11)]:  # the length prefix's every byte, and the frame's
            flipped = bytearray(whole)
            flipped[i] ^= 0xFF
            r = client.post("/v1/blocks", content=bytes(flipped))
            assert r.status_code in (400, 409, 413), ("batch flip", i, r.status_code, r.text)
        assert store_state(client) == before
        assert client.get(f"/v1/blocks/{h.hex()}").status_code == 404
        assert client.put(f"/v1/blocks/{h.hex()}", content=good).status_code == 201
