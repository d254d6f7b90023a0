"""``/metrics`` of a real server read by a strict parser of the text format (``prom_strict``):
after traffic of every kind (errors, 4xx, namespaces and models with the characters labels
escape or clean), across a restart, and with the (namespace, model) label pairs that the
server's own ``_other`` stands beside."""

from __future__ import annotations

import httpx

import prom_strict
from redis_servers import needs_redis
from server_helpers import Server, batch_body, metrics_after_traffic, raw_chain, raw_frame

ADMIN = "adm1n-token"
ODD_NAMESPACES = ('q"uote', "back\\slash", "x{y}=,#", "_other", "UPPER", "upper", "%41")


def post(c: httpx.Client, chain, ns: str = "", model: bytes | None = None) -> httpx.Response:
    headers = [(b"X-CacheSeek-Block-Tokens", b"32")]
    if ns:
        headers.append((b"X-CacheSeek-Namespace", ns.encode()))
    if model is not None:
        headers.append((b"X-CacheSeek-Model", model))
    return c.post("/v1/blocks", content=batch_body([f for _, f in chain]), headers=headers)


def mixed_traffic(c: httpx.Client) -> None:
    """One of each: stores, present blocks, lookups that hit and miss, reads, 4xx and 404s."""
    for i, ns in enumerate(ODD_NAMESPACES):
        chain = raw_chain(300 + i, 2)
        # Models a label shows as given, escaped, or cleaned (non-ASCII, past 128 characters).
        for model in (b'm"\\', b"mod\xe8le", b"mod\xe9le", b"x" * 129 + b"a", b"x" * 129 + b"b", b""):
            assert post(c, chain, ns, model).status_code == 200
        head = {"X-CacheSeek-Namespace": ns, "X-CacheSeek-Block-Tokens": "32"}
        c.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain] + ["ab" * 16]}, headers=head)
        c.post("/v1/lookup", json={"hashes": ["cd" * 16]}, headers=head)
        c.get(f"/v1/prefixes/{chain[-1][0].hex()}", headers=head)
    h, frame = raw_frame(399)
    assert c.put(f"/v1/blocks/{h.hex()}", content=frame[:-1]).status_code == 400  # a frame cut short
    assert c.put(f"/v1/blocks/{'ab' * 16}", content=frame).status_code == 409  # another hash's frame
    assert c.get("/v1/blocks/not-a-hash").status_code == 400
    assert c.get(f"/v1/blocks/{'ef' * 16}").status_code == 404
    assert c.get("/v1/stats", headers={"X-CacheSeek-Namespace": "a space"}).status_code == 400
    assert c.get("/v1/admin/namespaces").status_code == 401
    assert c.get("/no/such/route").status_code == 404
    assert c.post("/v1/lookup", content=b"{not json").status_code == 422


def test_the_exposition_is_valid_text_format_after_every_kind_of_traffic_and_a_restart(tmp_path):
    srv = Server(tmp_path, "--admin-token", ADMIN)
    with srv, httpx.Client(base_url=srv.url) as c:
        before = prom_strict.parse(c.get("/metrics").text)
        mixed_traffic(c)
        after = prom_strict.parse(c.get("/metrics").text)
        # Counters never go down between two scrapes of one process.
        for name, fam in before.items():
            if fam.type == "counter":
                for sample, labels, v in fam.samples:
                    assert prom_strict.value(after, sample, **labels) >= v, (sample, labels)
        assert prom_strict.value(after, "cacheseek_namespace_blocks", namespace='q"uote', model='m"\\') == 2
        assert prom_strict.value(after, "cacheseek_lookups_total", namespace="back\\slash", model="") == 2
        assert prom_strict.value(after, "cacheseek_http_requests_total", route="unmatched", method="GET",
                                 status="404") == 1
        # A block of the default namespace whose parent was never stored: after the restart its
        # chain cannot be traced (unattributed), as a real namespace "_other" (a valid name)
        # holds blocks too. (A DELETE of a parent leaves no such block: its key stays a root.)
        chain = raw_chain(400, 2)
        assert post(c, chain[1:]).status_code == 200
    with srv, httpx.Client(base_url=srv.url) as c:
        usage = c.get("/v1/admin/namespaces", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert any(u["namespace"] is None for u in usage) and any(u["namespace"] == "_other" for u in usage)
        mixed_traffic(c)
        families = prom_strict.parse(c.get("/metrics").text)
        stats = c.get("/v1/stats").json()
        # Usage series add up to the store's distinct blocks whatever they were merged under.
        blocks = sum(v for _, _, v in families["cacheseek_namespace_blocks"].samples)
        assert blocks == stats["blocks"] == sum(u["blocks"] for u in stats["namespaces"])


@needs_redis
def test_the_exposition_with_a_redis_tier_and_disk_admission_is_valid(tmp_path):
    """The families only a Redis tier (its breaker, its faults) and an admission threshold make."""
    families = prom_strict.parse(metrics_after_traffic(tmp_path, "--disk-admit-after-uses", "2"))
    assert prom_strict.value(families, "cacheseek_redis_breaker_state", state="closed") == 1
    # (no other process on the namespace: the server's own budget is the one in effect)
    assert prom_strict.value(families, "cacheseek_redis_budget_in_effect_bytes", tier="redis") == \
        prom_strict.value(families, "cacheseek_tier_capacity_bytes", tier="redis")
    assert families["cacheseek_tier_admission_refusals_total"].samples
    assert prom_strict.value(families, "cacheseek_frames_rejected_total", reason="malformed") == 1


def test_the_usage_past_metrics_max_owners_is_one_series_beside_a_namespace_and_model_named_other(tmp_path):
    """The overflow's ("_other", "_other") and a real namespace "_other" writing as model
    "_other" were two series with one label set: a duplicate Prometheus refuses."""
    with Server(tmp_path, env={"CACHESEEK_METRICS_MAX_OWNERS": "2"}) as s, httpx.Client(base_url=s.url) as c:
        assert post(c, raw_chain(500, 3), "team-a", b"llama").status_code == 200
        assert post(c, raw_chain(501, 2), "_other", b"_other").status_code == 200
        assert post(c, raw_chain(502, 1), "team-b", b"llama").status_code == 200
        families = prom_strict.parse(c.get("/metrics").text)
        assert prom_strict.value(families, "cacheseek_namespace_blocks", namespace="_other", model="_other") == 3
        assert prom_strict.value(families, "cacheseek_namespace_blocks", namespace="team-a", model="llama") == 3


def test_tier_and_owner_figures_are_what_a_known_sequence_makes_across_a_restart(tmp_path):
    """Ingests over a CPU tier of 9 frames on a write-through disk, lookups, a prefix read
    from disk, deletes, a restart and a flush: every tier's blocks and bytes, the distinct
    figures and each owner's usage are what the sequence makes, /metrics says the same as
    /v1/stats, and no counter goes down between two scrapes of one process."""
    from cacheseek.store.disk import allocation_unit, block_charge

    frame = len(raw_chain(0, 1)[0][1])
    disk_frame = block_charge(frame, allocation_unit(tmp_path))
    srv = Server(tmp_path, "--admin-token", ADMIN, cpu_bytes=str(9 * frame + frame // 2))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    chains = [raw_chain(600 + i, 4) for i in range(4)]

    def figures(c: httpx.Client) -> tuple[dict, dict, dict]:
        stats = c.get("/v1/stats").json()
        families = prom_strict.parse(c.get("/metrics").text)
        tiers = {t["name"]: t for t in stats["tiers"]}
        for name, t in tiers.items():
            for field in ("blocks", "used_bytes", "unique_blocks", "unique_bytes"):
                assert prom_strict.value(families, f"cacheseek_tier_{field}", tier=name) == t[field], (name, field)
            for field in ("hits", "misses", "evictions", "admissions", "promotions"):
                assert prom_strict.value(families, f"cacheseek_tier_{field}_total", tier=name) == t[field]
        usage = {u["namespace"]: u for u in stats["namespaces"] if u["blocks"]}
        assert stats["blocks"] == sum(t["unique_blocks"] for t in tiers.values()) == sum(
            u["blocks"] for u in usage.values())
        assert stats["used_bytes"] == stats["blocks"] * frame
        return tiers, {ns: u["blocks"] for ns, u in usage.items()}, families

    def no_counter_went_down(before: dict, after: dict) -> None:
        for fam in before.values():
            if fam.type == "counter":
                for sample, labels, v in fam.samples:
                    assert prom_strict.value(after, sample, **labels) >= v, (sample, labels)

    with srv, httpx.Client(base_url=srv.url) as c:
        for i, chain in enumerate(chains):
            assert post(c, chain, f"ns{i % 2}", b"m").status_code == 200
        tiers, usage, first = figures(c)
        assert (tiers["cpu"]["blocks"], tiers["cpu"]["evictions"], tiers["cpu"]["admissions"]) == (9, 7, 16)
        assert (tiers["disk"]["blocks"], tiers["disk"]["used_bytes"]) == (16, 16 * disk_frame)
        assert tiers["cpu"]["used_bytes"] == 9 * frame and tiers["disk"]["unique_blocks"] == 7
        assert usage == {"ns0": 8, "ns1": 8}
        for i, chain in enumerate(chains):  # lookups read no tier
            head = {"X-CacheSeek-Namespace": f"ns{i % 2}"}
            assert c.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain]}, headers=head).json()["matched"] == 4
        tiers2, _, second = figures(c)
        assert all(tiers2[n][k] == tiers[n][k] for n in tiers for k in ("hits", "misses", "blocks"))
        assert c.get(f"/v1/prefixes/{chains[0][-1][0].hex()}", headers={"X-CacheSeek-Namespace": "ns0"}).status_code == 200
        tiers3, _, third = figures(c)
        cpu, disk = tiers3["cpu"], tiers3["disk"]
        read_below = cpu["misses"]
        assert cpu["hits"] + read_below == 4 and disk["hits"] == read_below == cpu["promotions"] > 0
        assert (cpu["blocks"], cpu["evictions"], cpu["admissions"]) == (9, 7 + read_below, 16 + read_below)
        assert c.delete(f"/v1/blocks/{chains[1][-1][0].hex()}", headers={"X-CacheSeek-Namespace": "ns1"}).status_code == 204
        deleted = c.delete(f"/v1/admin/chains/{chains[3][-1][0].hex()}", headers={**admin, "X-CacheSeek-Namespace": "ns1"})
        assert deleted.json()["deleted_blocks"] == 4
        tiers4, usage4, fourth = figures(c)
        assert tiers4["disk"]["blocks"] == 11 and tiers4["disk"]["used_bytes"] == 11 * disk_frame
        assert usage4 == {"ns0": 8, "ns1": 3}
        for a, b in ((first, second), (second, third), (third, fourth)):
            no_counter_went_down(a, b)
    with srv, httpx.Client(base_url=srv.url) as c:
        tiers, usage, _ = figures(c)
        assert (tiers["cpu"]["blocks"], tiers["cpu"]["used_bytes"]) == (0, 0)
        assert (tiers["disk"]["blocks"], tiers["disk"]["used_bytes"], tiers["disk"]["unique_blocks"]) == (
            11, 11 * disk_frame, 11)
        assert usage == {"ns0": 8, "ns1": 3}  # recovered blocks attributed again through their roots
        recovered = c.get("/v1/stats").json()["recovery"]["tiers"]["disk"]
        assert recovered["blocks"] == 11 and recovered["bytes"] == 11 * frame
        flushed = c.post("/v1/admin/flush", params={"namespace": "ns0"}, headers=admin).json()
        assert (flushed["deleted_blocks"], flushed["deleted_bytes"]) == (8, 8 * frame)
        tiers, usage, _ = figures(c)
        assert tiers["disk"]["blocks"] == 3 and usage == {"ns1": 3}


def test_the_strict_parser_refuses_what_the_format_does_not_allow():
    """The reader the tests above rely on fails on each fault it is there to catch."""
    import pytest

    good = ('# HELP a_total A.\n# TYPE a_total counter\na_total{x="q\\"\\\\\\n"} 1.0\n'
            '# HELP h H.\n# TYPE h histogram\nh_bucket{le="0.1"} 1.0\nh_bucket{le="+Inf"} 2.0\nh_sum 0.3\nh_count 2.0\n')
    assert prom_strict.value(prom_strict.parse(good), "a_total", x='q"\\\n') == 1
    for bad in (
        good + 'a_total{x="q\\"\\\\\\n"} 2.0\n',  # a duplicate series
        good + "# HELP a_total A.\n",  # a family's lines apart
        good.replace('{x="q', '{x="1",x="q'),  # a label twice
        good.replace('\\"', '\\t'),  # an escape the format has not
        good.replace("a_total{x", "a{x").replace("TYPE a_total", "TYPE a").replace("HELP a_total", "HELP a"),
        good.replace("1.0\n#", "NaN\n#", 1),  # a NaN counter
        good.replace('h_bucket{le="0.1"} 1.0', 'h_bucket{le="0.1"} 3.0'),  # buckets not cumulative
        good.replace('h_bucket{le="+Inf"} 2.0\n', ""),  # no +Inf bucket
        good.replace("h_count 2.0", "h_count 3.0"),  # +Inf is not _count
        "# HELP g G.\ng 1.0\n# TYPE g gauge\n",  # TYPE after a sample
        good.rstrip("\n"),  # no final newline
    ):
        with pytest.raises(prom_strict.ExpositionError):
            prom_strict.parse(bad)


def test_no_spelling_of_a_namespace_reaches_another_ones_blocks_or_figures(tmp_path):
    """A tenant bound to "acme" tries the other namespaces' spellings: case, percent-encoding,
    a non-ASCII look-alike, surrounding whitespace, an empty or over-long name, the header
    twice. None reads "ACME"'s block or "%61cme"'s, or counts in their figures; the admin
    flush of one spelling takes that namespace's blocks only."""
    import socket

    tenants = '{"acme": {"write_token": "acme-w"}}'
    with Server(tmp_path, "--admin-token", ADMIN, "--write-token", "wr1te", env={"CACHESEEK_TENANTS": tenants}) as s, \
            httpx.Client(base_url=s.url) as c:
        chains = {ns: raw_chain(700 + i, 2) for i, ns in enumerate(("acme", "ACME", "%61cme", "acme_"))}
        for ns, chain in chains.items():
            r = c.post("/v1/blocks", content=batch_body([f for _, f in chain]),
                       headers={"Authorization": "Bearer wr1te", "X-CacheSeek-Namespace": ns})
            assert r.status_code == 200
        others = [chain[0][0].hex() for ns, chain in chains.items() if ns != "acme"]
        mine = chains["acme"][0][0].hex()
        spellings = [b"ACME", b"Acme", b"%61cme", b"%61%63%6d%65", b"acme_", b"\xef\xbd\x81cme", b"a\xcc\x8acme", b"",
                     b"a" * 129]
        for spelling in spellings:
            for h in [mine, *others]:
                r = c.get(f"/v1/blocks/{h}", headers=[(b"Authorization", b"Bearer acme-w"),
                                                     (b"X-CacheSeek-Namespace", spelling)])
                assert r.status_code in (400, 403), (spelling, h, r.status_code)
        host, port = s.url.removeprefix("http://").split(":")
        for raw in (b"ACME ", b" ACME", b"\tACME", b"acme\t", b"ACME\x0b"):
            for h in others:
                with socket.create_connection((host, int(port))) as so:
                    so.sendall(f"GET /v1/blocks/{h} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer acme-w\r\n".encode()
                               + b"X-CacheSeek-Namespace: " + raw + b"\r\nConnection: close\r\n\r\n")
                    status = so.recv(64).split(b"\r\n")[0]
                assert status.split(b" ")[1] in (b"400", b"403", b"404"), (raw, status)
        # Spaces and tabs around a header's value are not part of it (RFC 9110 5.5): the
        # tenant's own namespace so written is its own on every HTTP implementation (h11 took
        # it, httptools answered 400).
        for raw in (b"acme ", b"acme\t", b" \tacme"):
            with socket.create_connection((host, int(port))) as so:
                so.sendall(f"GET /v1/blocks/{mine} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer acme-w\r\n".encode()
                           + b"X-CacheSeek-Namespace: " + raw + b"\r\nConnection: close\r\n\r\n")
                status = so.recv(64).split(b"\r\n")[0]
            assert status.split(b" ")[1] == b"200", (raw, status)
        # The header twice: refused (which one a front read is unknown), counted for no one.
        for h in others:
            r = c.get(f"/v1/blocks/{h}", headers=[(b"Authorization", b"Bearer acme-w"),
                                                 (b"X-CacheSeek-Namespace", b"acme"), (b"X-CacheSeek-Namespace", b"ACME")])
            assert r.status_code == 400 and "x-cacheseek-namespace header appears more than once" in r.text
        assert c.get(f"/v1/blocks/{mine}", headers={"Authorization": "Bearer acme-w"}).status_code == 200
        stats = c.get("/v1/stats", headers={"Authorization": "Bearer acme-w"}).json()
        assert {o["namespace"] for o in stats["traffic"]["by_owner"]} == {"acme"}
        assert {u["namespace"] for u in stats["namespaces"]} == {"acme"}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        flushed = c.post("/v1/admin/flush", params={"namespace": "%61cme"}, headers=admin).json()
        assert flushed["deleted_blocks"] == 2
        left = {u["namespace"]: u["blocks"] for u in c.get("/v1/admin/namespaces", headers=admin).json()}
        assert left == {"acme": 2, "ACME": 2, "%61cme": 0, "acme_": 2}, left


def test_a_tenant_does_not_see_the_lookups_of_every_namespace_in_its_stats(tmp_path):
    """``lookup_latency`` is the histogram of every namespace's lookups: a tenant's
    ``/v1/stats`` carried it, so the count (and timing) of the other tenants' lookups, though
    a tenant sees "no per-route request figures" (docs/operations.md)."""
    tenants = '{"team-a": {"write_token": "a-w"}, "team-b": {"write_token": "b-w"}}'
    with Server(tmp_path, "--write-token", "wr1te", env={"CACHESEEK_TENANTS": tenants}) as s, \
            httpx.Client(base_url=s.url) as c:
        for _ in range(5):
            c.post("/v1/lookup", json={"hashes": ["ab" * 16]}, headers={"Authorization": "Bearer b-w"})
        mine = c.get("/v1/stats", headers={"Authorization": "Bearer a-w"}).json()
        assert "lookup_latency" not in mine and "requests" not in mine, mine.get("lookup_latency")
        every = c.get("/v1/stats", headers={"Authorization": "Bearer wr1te"}).json()
        assert every["lookup_latency"]["count"] == 5
