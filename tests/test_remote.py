"""``RemoteCache`` against a real `cacheseek serve`: the same scenarios as ``PrefixCache``, the
same results."""

from __future__ import annotations

import logging
import socket
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

import cacheseek as cs
from cacheseek.store.breaker import CircuitBreaker, ConstantBackoff
from server_helpers import Server, split_batch
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("remote"), "--write-token", "w", "--read-token", "r") as server:
        yield server


def _remote(srv, codec, **kw):
    kw.setdefault("token", "w")
    return cs.RemoteCache(srv.url, model_id="parity", layout=LAYOUT, codec=codec, block_tokens=BLOCK, **kw)


def _embedded(tmp_path, codec, **kw):
    tiers = cs.TierConfig(cpu_bytes="64MiB", disk_path=tmp_path / "embedded", pin_memory=False)
    return cs.PrefixCache(model_id="parity", layout=LAYOUT, codec=codec, block_tokens=BLOCK, tiers=tiers, **kw)


def _scenario(cache) -> list:
    """Every call of the shared API, with its result in comparable form."""
    out = []
    toks, kv = tokens_for(1, 6 * BLOCK + 5), make_kv(6 * BLOCK + 5, 1)
    head = [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv]
    out.append(("ingest head", cache.ingest(toks[: 2 * BLOCK], head)))
    out.append(("ingest all", cache.ingest(toks, kv)))
    out.append(("ingest again", cache.ingest(toks, kv)))
    out.append(("locate", cache.locate(toks)))
    changed = list(toks)
    changed[3 * BLOCK + 1] += 1
    out.append(("lookup changed", cache.lookup(changed)))
    out.append(("lookup partial tail", cache.lookup(toks[: 4 * BLOCK + 3])))
    out.append(("lookup unknown", cache.lookup(tokens_for(2, 3 * BLOCK))))
    for name, got in (("materialize", cache.materialize(toks)),
                      ("materialize changed", cache.materialize(changed)),
                      ("materialize max_tokens", cache.materialize(toks, max_tokens=4 * BLOCK - 1)),
                      ("materialize numpy max_tokens", cache.materialize(toks, max_tokens=np.int64(4 * BLOCK - 1))),
                      ("materialize unknown", cache.materialize(tokens_for(3, 2 * BLOCK)))):
        out.append((name, (got.num_tokens, got.num_blocks, got.tiers, str(got.device),
                           [(k.clone(), v.clone()) for k, v in got.layers])))
    # Blocks keyed by bytes (frames, actions) through the same calls.
    keys = [b"frame-0", b"frame-1+action", b"frame-2"]
    kvb = make_kv(3 * BLOCK, 4)
    out.append(("ingest block keys", cache.ingest(keys, [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kvb])))
    out.append(("lookup block keys", cache.lookup([b"frame-0", b"frame-1+action", b"other"])))
    got = cache.materialize(keys[:2])
    out.append(("materialize block keys", (got.num_tokens, [(k.clone(), v.clone()) for k, v in got.layers])))
    # Bad input raises the same error, and stores (sends) nothing.
    nan_kv = make_kv(2 * BLOCK, 5)
    nan_kv[1][0][0, BLOCK + 3, 5] = float("nan")
    bad_toks = tokens_for(5, 2 * BLOCK)
    masked = [*bad_toks[:BLOCK + 2], True, *bad_toks[BLOCK + 3 :]]  # (a bool was read as id 1)
    for name, call in (("nan", lambda: cache.ingest(bad_toks, nan_kv)),
                       ("short keys", lambda: cache.ingest(bad_toks[:-1], make_kv(2 * BLOCK, 5))),
                       ("empty", lambda: cache.lookup([])),
                       ("bool id ingest", lambda: cache.ingest(masked, make_kv(2 * BLOCK, 5))),
                       ("bool id lookup", lambda: cache.lookup([False, *toks[1:]])),
                       ("bool id materialize", lambda: cache.materialize([False, *toks[1:]]))):
        with pytest.raises(cs.InputError) as info:
            call()
        out.append((name, type(info.value).__name__, str(info.value)))
    out.append(("after bad input", cache.lookup(bad_toks), cache.lookup([1 if t is True else t for t in masked])))
    stats = cache.stats()
    # The server adds its own figures (traffic, requests, usage per namespace: docs/operations.md).
    server_only = {"commit", "descriptors", "frame_bytes_received", "frame_bytes_sent", "frames_rejected", "lookup_latency",
                   "metrics_detail", "namespaces", "recovery", "requests", "started_at", "traffic", "uptime_seconds",
                   "version"}
    out.append(("stats keys", sorted(set(stats) - server_only), [t["name"] for t in stats["tiers"]],
                stats["model_id"], stats["codec"], stats["block_tokens"]))
    return out


def _same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "kivi4"])
def test_remote_and_embedded_give_the_same_results(srv, tmp_path, codec):
    """Raw: bit-exact KV both ways. KIVI: the same encoder and decoder run on both sides, so
    the results are equal too (and within the codec's bound, which test_store checks)."""
    with _remote(srv, codec, namespace=f"parity-{codec.name}") as remote, _embedded(tmp_path, codec,
                                                                                    namespace=f"parity-{codec.name}") as embedded:
        got_remote = _scenario(remote)
        got_embedded = _scenario(embedded)
    for r, e in zip(got_remote, got_embedded, strict=True):
        _same(r, e, r[0])
    if codec.name == "raw":  # and against the source KV
        toks, kv = tokens_for(1, 6 * BLOCK + 5), make_kv(6 * BLOCK + 5, 1)
        with _remote(srv, codec, namespace="parity-raw") as remote:
            got = remote.materialize(toks)
        for (k, v), (k0, v0) in zip(got.layers, kv):
            assert torch.equal(k[0], k0[:, : 6 * BLOCK]) and torch.equal(v[0], v0[:, : 6 * BLOCK])


def test_chains_longer_than_the_servers_lookup_limit_are_looked_up_in_pieces(tmp_path):
    """A server taking at most 4 hashes a lookup (65,536 by default: a million tokens in
    blocks of 16): every call on longer chains gives the embedded cache's results."""
    with Server(tmp_path / "srv", "--max-lookup-hashes", "4") as small:
        with cs.RemoteCache(small.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                            max_lookup_hashes=4) as remote, _embedded(tmp_path, cs.Raw()) as embedded:
            for r, e in zip(_scenario(remote), _scenario(embedded), strict=True):
                _same(r, e, r[0])
            toks, kv = tokens_for(7, 11 * BLOCK), make_kv(11 * BLOCK, 7)
            head = [(k[:, : 9 * BLOCK], v[:, : 9 * BLOCK]) for k, v in kv]
            assert remote.ingest(toks[: 9 * BLOCK], head).stored == 9  # pieces of 4, 4, 1
            assert remote.ingest(toks, kv).stored == 2 and remote.lookup(toks) == 11 * BLOCK
            changed = list(toks)
            changed[9 * BLOCK] += 1  # the third piece matches its first block only
            before = _parity_traffic(small)
            assert remote.lookup(changed + [1, 2, 3]) == 9 * BLOCK  # 11 blocks and 3 tokens, in 3 pieces
            # One query, counted once: its tokens by its first piece, the others' blocks added
            # to it (each piece counted the query's tokens again, and as a lookup of its own).
            after = _parity_traffic(small)
            assert {k: after[k] - before[k] for k in after} == {
                "lookups": 1, "lookup_hits": 1, "lookup_blocks_requested": 11, "lookup_blocks_matched": 9,
                "lookup_tokens_requested": 11 * BLOCK + 3, "lookup_tokens_matched": 9 * BLOCK}
            assert remote.locate(changed).tiers == ["cpu"] * 9
            assert_prefix_equal(remote.materialize(toks), kv, 11 * BLOCK)
            assert remote.prefetch(toks) is None  # (all in memory: a hint for the first 4 blocks)
            # A client not told of the server's limit is refused once, on its first lookup, and
            # takes the limit the refusal names: every kind of lookup then goes in pieces.
            def unaware() -> cs.RemoteCache:
                return cs.RemoteCache(small.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK)

            with unaware() as client:
                before = _parity_traffic(small)
                assert client.lookup(toks) == 11 * BLOCK and client.max_lookup_hashes == 4
                after = _parity_traffic(small)
                assert after["lookups"] - before["lookups"] == 1  # (the refused one was not counted)
            with unaware() as client, ThreadPoolExecutor(8) as pool:
                # (threads refused at once: each goes again, though another lowered the limit first)
                assert list(pool.map(lambda _: client.lookup(toks), range(32))) == [11 * BLOCK] * 32
            with unaware() as client:
                assert [f.num_blocks for f in client.locate_batch([toks, changed, toks[:BLOCK]])] == [11, 9, 1]
                assert client.max_lookup_hashes == 4
            with unaware() as client:
                assert client.materialize(changed).num_tokens == 9 * BLOCK
            with unaware() as client:
                assert client.prefetch(toks) is None and client.max_lookup_hashes == 4
            more, more_kv = tokens_for(8, 6 * BLOCK), make_kv(6 * BLOCK, 8)
            with unaware() as client:
                assert client.ingest(more, more_kv).stored == 6 and client.max_lookup_hashes == 4
                assert client.lookup(more) == 6 * BLOCK
    with pytest.raises(cs.ConfigError, match="max_lookup_hashes"):
        cs.RemoteCache("http://127.0.0.1:1", model_id="m", layout=LAYOUT, max_lookup_hashes=0)


def _parity_traffic(server) -> dict[str, int]:
    """The lookup counters of the ``parity`` model's traffic on ``server``."""
    stats = httpx.get(server.url + "/v1/stats").json()
    mine = next(o for o in stats["traffic"]["by_owner"] if o["model"] == "parity")
    return {k: mine[k] for k in ("lookups", "lookup_hits", "lookup_blocks_requested", "lookup_blocks_matched",
                                 "lookup_tokens_requested", "lookup_tokens_matched")}


def test_a_layerwise_writer_refuses_a_first_layer_of_another_length_as_the_embedded_one_does(srv, tmp_path):
    """RemoteCache's writer took a first layer shorter than its keys, then refused every
    right layer after it (\"put twice\", \"earlier layers have ...\"), and its finish named
    layers \"never put\": usable only through abort(). It is refused at once, as the embedded
    writer refuses it, and the writer stays usable."""
    toks, kv, short = tokens_for(43, 2 * BLOCK), make_kv(2 * BLOCK, 43), make_kv(BLOCK, 43)
    with _embedded(tmp_path, cs.Raw()) as embedded, _remote(srv, cs.Raw(), namespace="lw-check") as remote:
        for cache in (embedded, remote):
            writer = cache.ingest_layerwise(toks)
            with pytest.raises(cs.InputError, match=rf"^layer 1: token_ids: {2 * BLOCK} tokens, but KV holds {BLOCK}$"):
                writer.put_layer(1, *short[1])
            for i in range(LAYOUT.num_layers):
                writer.put_layer(i, *kv[i])
            assert writer.finish().stored == 2, cache


def test_remote_errors_are_clear(srv):
    toks = tokens_for(6, 2 * BLOCK)
    kv = make_kv(2 * BLOCK, 6)
    with _remote(srv, cs.Raw(), token="r") as reader:
        assert reader.lookup(toks) == 0
        with pytest.raises(cs.RemoteError) as info:
            reader.ingest(toks, kv)
        assert info.value.status == 403 and "only read" in info.value.reason
    with _remote(srv, cs.Raw(), token="nope") as wrong, pytest.raises(cs.RemoteError) as info:
        wrong.lookup(toks)
    assert info.value.status == 403
    with _remote(srv, cs.Raw(), token=None) as anonymous, pytest.raises(cs.RemoteError) as info:
        anonymous.stats()
    assert info.value.status == 401
    with pytest.raises(cs.ConfigError, match="holds credentials; give them as token=") as refused:
        cs.RemoteCache(f"http://me:s3cret@127.0.0.1:{_closed_port()}", model_id="m", layout=LAYOUT, block_tokens=BLOCK)
    assert "s3cret" not in str(refused.value)
    with pytest.raises(cs.ConfigError, match=r"^url: 'ftp://host' is not an http:// or https:// URL$"):
        cs.RemoteCache("ftp://me:pw@host", model_id="m", layout=LAYOUT, block_tokens=BLOCK)
    # Every route's path is appended to the URL: after a query or a fragment, 404s (or a
    # stats() that worked, through httpx's merge, beside lookups that did not).
    for url in (f"{srv.url}#frag", f"{srv.url}/#frag", f"{srv.url}?x=1"):
        with pytest.raises(cs.ConfigError, match=r"^url: .* has a query or a fragment; give the server's address"):
            cs.RemoteCache(url, model_id="m", layout=LAYOUT, block_tokens=BLOCK)
    down = cs.RemoteCache(f"http://127.0.0.1:{_closed_port()}", model_id="m", layout=LAYOUT, codec=cs.Raw(),
                          block_tokens=BLOCK, timeout=5)
    with pytest.raises(cs.RemoteUnavailable, match="cannot reach") as info:
        down.lookup(toks)
    assert isinstance(info.value, ConnectionError) and info.value.status is None


def test_namespaces_keep_remote_tenants_apart(srv):
    toks, kv = tokens_for(7, 3 * BLOCK), make_kv(3 * BLOCK, 7)
    with _remote(srv, cs.Raw(), namespace="tenant-a") as a, _remote(srv, cs.Raw(), namespace="tenant-b") as b:
        assert a.ingest(toks, kv).stored == 3
        assert a.lookup(toks) == 3 * BLOCK and b.lookup(toks) == 0
        # Even with tenant-a's hashes in hand, tenant-b's namespace has no such blocks.
        hashes = [h.hex() for h in a.block_hashes(toks)]
        with httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer w", "X-CacheSeek-Namespace": "tenant-b"}) as c:
            assert c.post("/v1/lookup", json={"hashes": hashes}).json()["matched"] == 0
            assert c.get(f"/v1/prefixes/{hashes[-1]}").status_code == 404


def _closed_port() -> int:
    from server_helpers import free_port

    return free_port()


# -- outages: fail-open clients and the breaker ----------------------------------------------


def test_fail_open_against_a_dead_server_is_a_miss_logged_once(caplog):
    toks, kv = tokens_for(8, 2 * BLOCK), make_kv(2 * BLOCK, 8)
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(cs.ConfigError, match="on_unavailable"):
        cs.RemoteCache(url, model_id="m", layout=LAYOUT, block_tokens=BLOCK, on_unavailable="ignore")
    breaker = CircuitBreaker(failure_threshold=3, backoff=ConstantBackoff(60))  # no probe during the test
    with caplog.at_level("WARNING", logger="cacheseek.remote"), cs.RemoteCache(
            url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
            on_unavailable="miss", breaker=breaker) as cache:
        for i in range(10):
            assert cache.lookup(toks) == 0
            got = cache.materialize(toks)
            assert got.num_tokens == 0 and got.layers == []
            res = cache.ingest(toks, kv)
            assert res.stored == res.present == 0 and res.failed == 2
            assert ("cannot reach" if i == 0 else "circuit breaker open") in res.errors["server"]
        with pytest.raises(cs.InputError):  # bad input still raises: it is not an outage
            cache.ingest(toks[:-1], kv)
        stats = cache.client_stats()
    assert stats["outages"] == 1 and stats["in_outage"]
    assert stats["missed_lookups"] == 10 and stats["missed_materializes"] == 10 and stats["dropped_blocks"] == 20
    # The breaker opened after 3 failures: the other calls were not sent, so paid no timeout.
    assert stats["unavailable_calls"] == 3 and stats["refused_by_breaker"] == 27, stats
    assert stats["breaker"]["state"] == "open"
    warnings = [r for r in caplog.records if r.name == "cacheseek.remote"]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_a_server_killed_mid_run_then_restarted_resumes_calls(tmp_path, caplog):
    toks, kv = tokens_for(9, 3 * BLOCK), make_kv(3 * BLOCK, 9)
    srv = Server(tmp_path).start()
    port = srv.port
    try:
        with caplog.at_level("WARNING", logger="cacheseek.remote"), _remote(
                srv, cs.Raw(), token=None, on_unavailable="miss", timeout=5) as cache:
            assert cache.ingest(toks, kv).stored == 3
            srv.kill()
            assert cache.lookup(toks) == 0 and cache.materialize(toks).num_tokens == 0
            assert cache.ingest(tokens_for(10, 2 * BLOCK), make_kv(2 * BLOCK, 10)).failed == 2
            again = Server(tmp_path)
            again.port, again.url = port, srv.url  # the same address: the client follows it
            again.args[again.args.index("--port") + 1] = str(port)
            again.start()
            try:
                resumed = None
                for attempt in range(100):  # bounded: the breaker probes again within its cap (10 s)
                    if cache.lookup(toks) == 3 * BLOCK:
                        resumed = attempt
                        break
                    time.sleep(0.1)
                assert resumed is not None, cache.client_stats()
                assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)  # on disk: it survived
                stats = cache.client_stats()
                assert stats["outages"] == 1 and not stats["in_outage"] and stats["breaker"]["state"] == "closed"
            finally:
                again.stop()
    finally:
        srv.kill()
    messages = [r.getMessage() for r in caplog.records if r.name == "cacheseek.remote"]
    assert len(messages) == 2 and "unavailable" in messages[0] and "answers again" in messages[1]


def test_the_default_raises_and_the_breaker_refuses_at_once():
    toks = tokens_for(11, 2 * BLOCK)
    with cs.RemoteCache(f"http://127.0.0.1:{_closed_port()}", model_id="m", layout=LAYOUT, codec=cs.Raw(),
                        block_tokens=BLOCK, timeout=5) as cache:
        for _ in range(3):
            with pytest.raises(cs.RemoteUnavailable, match="cannot reach"):
                cache.lookup(toks)
        with pytest.raises(cs.RemoteUnavailable, match="circuit breaker open"):
            cache.lookup(toks)


# -- TLS: RemoteCache through a TLS front end to a real server ---------------------------------


class _Relay:
    """A TCP relay on loopback in front of a plain ``cacheseek serve`` that counts the
    connections it accepts; with ``context``, a TLS terminator (a certificate the test
    makes, so RemoteCache's ``verify`` is exercised end to end)."""

    def __init__(self, upstream_port: int, context=None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstream_port, self.context = upstream_port, context
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self.context is not None:
                try:
                    conn = self.context.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # (a shutdown wakes the other direction's recv, and the client)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def test_remote_cache_over_https_verifies_the_server(srv, tmp_path):
    import ssl

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    front = _Relay(srv.port, context)
    url = f"https://localhost:{front.port}"
    toks, kv = tokens_for(12, 3 * BLOCK), make_kv(3 * BLOCK, 12)
    try:
        with cs.RemoteCache(url, model_id="tls", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, token="w",
                            verify=str(bundle), trust_env=False) as cache:
            assert cache.ingest(toks, kv).stored == 3
            assert cache.lookup(toks) == 3 * BLOCK
            assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
        with cs.RemoteCache(url, model_id="tls", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, token="w",
                            trust_env=False) as unverified, \
                pytest.raises(cs.RemoteUnavailable, match="CERTIFICATE") as refused:
            unverified.lookup(toks)  # the system's CAs do not know the test's CA: refused, never sent in clear
        # said with what to do (it was only "cannot reach the CacheSeek server", an outage's words)
        assert "TLS certificate is not trusted: give verify= the CA bundle" in str(refused.value), refused.value
        with pytest.raises(cs.ConfigError, match="verify"):
            cs.RemoteCache(url, model_id="tls", layout=LAYOUT, block_tokens=BLOCK, verify=str(tmp_path / "none.pem"))
    finally:
        front.close()


def test_an_https_url_to_a_plain_http_server_says_to_use_http(srv):
    # OpenSSL's "wrong version number" ("record layer failure" from 3.2: the server answered the
    # handshake in plain HTTP) read as "cannot reach the CacheSeek server", an outage's words.
    url = srv.url.replace("http://", "https://")
    with cs.RemoteCache(url, model_id="tls", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, token="w",
                        trust_env=False) as wrong, pytest.raises(cs.RemoteUnavailable) as refused:
        wrong.lookup(tokens_for(12, BLOCK))
    said = str(refused.value)
    assert "does not speak TLS (plain http, most likely): use an http:// URL" in said and "TLS handshake" in said, said


def test_tensor_parallel_ranks_and_extra_keys_share_nothing_on_one_server(srv):
    """Two TP ranks with the same per-rank layout and model write to one server: neither
    finds the other's blocks; nor does a prompt with another adapter, salt or image."""
    toks = tokens_for(8, 3 * BLOCK)
    kv0, kv1 = make_kv(3 * BLOCK, 80), make_kv(3 * BLOCK, 81)
    rank = [_remote(srv, cs.Raw(), namespace="tp", shard=cs.Shard(tp_rank=r, tp_size=2)) for r in range(2)]
    try:
        assert rank[0].ingest(toks, kv0).stored == 3
        assert rank[1].lookup(toks) == 0
        assert rank[1].ingest(toks, kv1).stored == 3  # its own blocks, not "present"
        for r, kv in ((0, kv0), (1, kv1)):
            got = rank[r].materialize(toks)
            assert all(torch.equal(k[0], k0) for (k, _), (k0, _) in zip(got.layers, kv))
        image = cs.MMInput("sha-of-image", offset=BLOCK + 3, length=5)
        prompt = cs.Prompt(toks, mm_inputs=[image])
        assert rank[0].lookup(prompt) == BLOCK  # the block before the image is shared
        assert rank[0].ingest(prompt, kv0).stored == 2
        assert rank[0].lookup(cs.Prompt(toks, mm_inputs=[cs.MMInput("other", BLOCK + 3, 5)])) == BLOCK
        assert rank[0].lookup(cs.Prompt(toks, lora_id="adapter")) == 0
        assert rank[0].lookup(cs.Prompt(toks, cache_salt="tenant-7")) == 0
        assert rank[0].lookup(prompt) == 3 * BLOCK
    finally:
        for cache in rank:
            cache.close()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_paged_calls_give_the_embedded_results_through_a_server(srv, tmp_path, monkeypatch):
    """ingest from pages, ingest_batch, materialize_into and materialize_into_batch over HTTP:
    the results and the bytes written into the pages are the embedded cache's."""
    from paged_helpers import engine_pages, page_tables, snapshot, unchanged, write_tokens

    from cacheseek.quant import backend as kivi_codec

    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    sizes = [2 * BLOCK + 3, 3 * BLOCK]
    toks = [tokens_for(60 + r, n) for r, n in enumerate(sizes)]
    pages, _ = engine_pages("flash", L, H, D, 24, 16, dtype)
    tables = page_tables(sizes, 16, 24, seed=1)
    for r, (n, ids) in enumerate(zip(sizes, tables)):
        write_tokens(pages, make_kv(n, 60 + r), ids)
    codec = cs.KIVI(bits=4, group_size=32)
    got = {}
    for name, cache in (("remote", _remote(srv, codec, namespace="paged")), ("embedded", _embedded(tmp_path, codec))):
        with cache:
            first = cache.ingest(toks[0], pages.at(tables[0]))
            batch = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
            dest, dest_tensors = engine_pages("nhd", L, H, D, 24, 16, dtype, seed=4)
            dest_tables = page_tables(sizes, 16, 24, seed=2)
            one = cache.materialize_into(toks[1], dest.at(dest_tables[1]), max_tokens=np.int64(2 * BLOCK))
            loaded = cache.materialize_into_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, dest_tables)], dest)
            bad = make_kv(BLOCK, 5)
            bad[1][0][0, 3, 7] = float("inf")
            write_tokens(dest, bad, [20, 21])
            with pytest.raises(cs.InputError, match=r"requests\[1\]: k: holds NaN or Inf"):
                cache.ingest_batch([cs.PagedRequest(tokens_for(70, BLOCK), [22, 23]),
                                    cs.PagedRequest(tokens_for(71, BLOCK), [20, 21])], dest)
            nothing_sent = cache.lookup(tokens_for(70, BLOCK))
            before = snapshot(dest_tensors)
            with pytest.raises(cs.InputError, match=r"requests\[1\].page_ids: page 3 is also written by requests\[0\]"):
                cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3]),
                                              cs.PagedRequest(toks[1], [3, 4, 5, 6, 7, 8])], dest)
            assert unchanged(before, dest_tensors)
            got[name] = (first, batch, one, loaded, nothing_sent, [t.clone() for t in dest_tensors])
    remote, embedded = got["remote"], got["embedded"]
    assert remote[0] == embedded[0] and remote[1] == embedded[1] and remote[4] == embedded[4] == 0
    assert [(x.num_tokens, x.num_blocks) for x in (remote[2], *remote[3])] == \
           [(x.num_tokens, x.num_blocks) for x in (embedded[2], *embedded[3])] == [(64, 2), (64, 2), (96, 3)]
    assert unchanged(remote[5], embedded[5])


@pytest.mark.parametrize("codec", [cs.Raw(), cs.KIVI(bits=4, group_size=32)], ids=["raw", "int4"])
def test_paged_load_from_start_through_a_server(srv, codec):
    from test_paged import check_start_skips_the_engines_own_blocks

    with _remote(srv, codec, namespace=f"start-{codec.name}") as cache:
        check_start_skips_the_engines_own_blocks(cache, isinstance(codec, cs.Raw))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("wait", [True, False], ids=["wait", "behind"])
def test_paged_ingest_from_start_through_a_server(srv, wait, monkeypatch):
    """As embedded: the blocks before a start are neither looked up, encoded nor sent (with
    ``wait=False`` too, which encodes before its lookup), and the server takes a tail whose
    head it does not hold."""
    from test_paged import check_ingest_from_start

    with _remote(srv, cs.Raw(), namespace=f"ingest-start-{wait}") as cache:
        check_ingest_from_start(cache, monkeypatch, wait=wait)


def test_paged_calls_fail_open_like_the_others():
    """With ``on_unavailable="miss"`` a dead server makes the paged calls a miss and a dropped
    write (counted), and writes no page."""
    from paged_helpers import engine_pages, page_tables, snapshot, unchanged, write_tokens

    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    pages, tensors = engine_pages("nhd", L, H, D, 8, 16, dtype)
    tables = page_tables([2 * BLOCK, BLOCK], 16, 8, seed=3)
    toks = [tokens_for(90 + r, n) for r, n in enumerate((2 * BLOCK, BLOCK))]
    write_tokens(pages, make_kv(2 * BLOCK, 90), tables[0])
    before = snapshot(tensors)
    breaker = CircuitBreaker(failure_threshold=1, backoff=ConstantBackoff(60))
    with cs.RemoteCache(f"http://127.0.0.1:{_closed_port()}", model_id="m", layout=LAYOUT, codec=cs.Raw(),
                        block_tokens=BLOCK, timeout=5, on_unavailable="miss", breaker=breaker) as cache:
        res = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
        assert [(r.stored, r.failed) for r in res] == [(0, 2), (0, 1)] and "server" in res[0].errors
        loaded = cache.materialize_into_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
        assert [x.num_tokens for x in loaded] == [0, 0]
        assert cache.materialize_into(toks[0], pages.at(tables[0])).num_tokens == 0
        assert cache.locate_batch(toks) == [cs.Located(0, 0, [])] * 2
        stats = cache.client_stats()
    assert stats["dropped_blocks"] == 3 and stats["missed_materializes"] == 2 and stats["missed_lookups"] == 2
    assert unchanged(before, tensors)


# -- bodies past the server's max_body_bytes -------------------------------------------------------


def _shared_prefix_batch():
    """Two requests with one prefix in an engine's pages: (their PagedRequests, the pages,
    the shared block's keys)."""
    from paged_helpers import engine_pages, write_tokens

    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    shared = tokens_for(85, BLOCK)
    toks = [shared + tokens_for(86, BLOCK), shared + tokens_for(87, BLOCK)]
    kvs = [make_kv(2 * BLOCK, 85), make_kv(2 * BLOCK, 86)]
    for (k0, v0), (k1, v1) in zip(*kvs):  # one prefix: the same tokens, the same KV
        k1[:, :BLOCK], v1[:, :BLOCK] = k0[:, :BLOCK], v0[:, :BLOCK]
    pages, _ = engine_pages("nhd", L, H, D, 8, 16, dtype)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    return [cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages, shared


def test_a_block_two_requests_share_counts_the_servers_answer_for_both(tmp_path):
    """Two requests of a batch with one prefix: its frame is sent once, and the second
    request counted it present before the server answered. A write the server failed (its
    disk refused the frame) left the second's result saying the block was stored."""
    requests, pages, shared = _shared_prefix_batch()
    with Server(tmp_path) as server, _remote(server, cs.Raw(), token=None) as cache:
        head, tails = cache.block_hashes(shared)[0], [cache.block_hashes(r.keys)[1] for r in requests]
        assert head[:1] not in {t[:1] for t in tails}
        # A directory where its data file goes: the write's rename onto it fails (EISDIR).
        # (Not its shard replaced by a file: that is the directory emptied by hand, given up.)
        (server.disk_path / head[:1].hex() / f"{head.hex()}.frame" / "in-the-way").mkdir(parents=True)
        got = cache.ingest_batch(requests, pages)
        assert [(r.stored, r.present, r.failed) for r in got] == [(1, 0, 1), (1, 0, 1)]
        assert all("disk" in r.errors for r in got)


def test_a_block_two_requests_share_is_dropped_for_both_in_an_outage(tmp_path, monkeypatch):
    """The server dies between a batch's lookup and its POST: the blocks not acknowledged are
    dropped, and the shared block, counted present at the lookup, was not among them."""
    requests, pages, _ = _shared_prefix_batch()
    server = Server(tmp_path).start()
    try:
        with _remote(server, cs.Raw(), token=None, on_unavailable="miss", timeout=5) as cache:
            real = cache._write_lookup

            def lookup_then_die(*args, **kwargs):
                found = real(*args, **kwargs)
                server.kill()
                return found

            monkeypatch.setattr(cache, "_write_lookup", lookup_then_die)
            got = cache.ingest_batch(requests, pages)
            assert [(r.stored, r.present, r.failed) for r in got] == [(0, 0, 2), (0, 0, 2)]
            assert all("server" in r.errors for r in got) and cache.client_stats()["dropped_blocks"] == 4
    finally:
        server.kill()


def _block_posts(cache) -> dict[str, int]:
    """The server's answers to ``POST /v1/blocks`` so far, by status."""
    for route in cache.stats()["requests"]:
        if route["route"] == "/v1/blocks" and route["method"] == "POST":
            return route["statuses"]
    return {}


def _unpublished(remote, monkeypatch) -> None:
    """``remote`` as a client of a server that does not publish ``max_body_bytes`` in its
    lookups (one older than that, or behind a proxy whose own limit is lower)."""
    real = remote._lookup

    def lookup(*args, **kwargs):
        found = real(*args, **kwargs)
        found.pop("max_body_bytes", None)
        return found

    monkeypatch.setattr(remote, "_lookup", lookup)


@pytest.mark.parametrize("published", [True, False], ids=["published", "learnt-from-413"])
def test_an_ingest_past_the_servers_body_limit_is_split_as_the_embedded_cache_stores_it(tmp_path, monkeypatch,
                                                                                          published):
    """The server publishes max_body_bytes in the lookup each write begins with: the client
    splits its frames under it from its first body on. Where it is not published, the first
    body over it is refused (413), the client takes the limit that answer names, sends the
    frames again in bodies under it, and later calls split at once. The results are the
    embedded cache's, merged per call, either way."""
    from paged_helpers import engine_pages, page_tables, write_tokens

    n = 10 * BLOCK  # Raw frames of ~48 KiB: ~490 KiB in all, each well under max_frame_bytes
    toks, kv = tokens_for(20, n), make_kv(n, 20)
    head = [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv]
    sizes = [4 * BLOCK, 5 * BLOCK + 3]
    paged_toks = [tokens_for(21 + r, s) for r, s in enumerate(sizes)]
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    pages, _ = engine_pages("nhd", L, H, D, 24, 16, LAYOUT.torch_dtype)
    tables = page_tables(sizes, 16, 24, seed=5)
    for r, (size, ids) in enumerate(zip(sizes, tables)):
        write_tokens(pages, make_kv(size, 21 + r), ids)
    requests = [cs.PagedRequest(t, ids) for t, ids in zip(paged_toks, tables)]
    got = {}
    with Server(tmp_path / "srv", "--max-frame-bytes", "128KiB", "--max-body-bytes", "256KiB",
                "--max-inflight-body-bytes", "256KiB", disk=False) as server:
        embedded = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                                  tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False))
        remote = cs.RemoteCache(server.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK)
        if not published:
            _unpublished(remote, monkeypatch)
        for name, cache in (("embedded", embedded), ("remote", remote)):
            with cache:
                got[name] = [cache.ingest(toks[: 2 * BLOCK], head), cache.ingest(toks, kv),
                             cache.ingest_batch(requests, pages), cache.lookup(toks),
                             [cache.lookup(t) for t in paged_toks]]
                if name == "remote":
                    assert_prefix_equal(cache.materialize(toks), kv, n)
                    posts = _block_posts(cache)
                    learned = cache.max_body_bytes
    assert got["remote"] == got["embedded"]
    assert got["remote"][1].stored == 8 and got["remote"][1].present == 2
    assert [r.stored for r in got["remote"][2]] == [4, 5]
    assert learned == 256 << 10
    if published:  # no refusal: 1 + 2 + 2 POSTs
        assert posts == {"200": 1 + 2 + 2}, posts
    else:  # one refusal (the first body over the limit), then the same POSTs
        assert posts == {"200": 1 + 2 + 2, "413": 1}, posts


def test_the_body_limit_a_real_servers_413_names_is_read_from_its_fields_not_its_sentence(tmp_path, monkeypatch):
    """The client took the server's max_body_bytes from the 413's English sentence (a regex),
    tested only against a mock that wrote the sentence by hand: a rewording in server/ would
    have made it halve its bodies, blind. The server names the limit in fields (``limit``,
    ``limit_value``), which the client reads first; here the sentence says nothing the
    regex finds, and the client still learns the exact limit from a real server's 413."""
    import re

    from cacheseek import remote as remote_module

    monkeypatch.setattr(remote_module, "_BODY_LIMIT", re.compile(r"(?!)"))  # (a server's other wording)
    n = 10 * BLOCK
    toks, kv = tokens_for(26, n), make_kv(n, 26)
    with Server(tmp_path, "--max-frame-bytes", "128KiB", "--max-body-bytes", "256KiB",
                "--max-inflight-body-bytes", "256KiB", disk=False) as server:
        with cs.RemoteCache(server.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK) as remote:
            _unpublished(remote, monkeypatch)
            assert remote.ingest(toks, kv).stored == 10
            assert remote.max_body_bytes == 256 << 10
            assert _block_posts(remote) == {"200": 2, "413": 1}, _block_posts(remote)
            assert_prefix_equal(remote.materialize(toks), kv, n)


def test_split_posts_keep_the_chains_head_when_the_servers_tier_overflows(tmp_path):
    """Tail first across the POSTs, as in one: a chain longer than the server's CPU tier
    keeps its head (as the embedded cache does), not its tail, which no lookup reaches."""
    n = 10 * BLOCK
    toks, kv = tokens_for(22, n), make_kv(n, 22)
    embedded = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                              tiers=cs.TierConfig(cpu_bytes="256KiB", pin_memory=False))
    with embedded:
        assert embedded.ingest(toks, kv).stored == 10
        kept = embedded.lookup(toks)
    assert 0 < kept < n
    with Server(tmp_path, "--max-frame-bytes", "64KiB", "--max-body-bytes", "128KiB",
                "--max-inflight-body-bytes", "256KiB", cpu_bytes="256KiB", disk=False) as server:
        with cs.RemoteCache(server.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK) as remote:
            assert remote.ingest(toks, kv).stored == 10
            assert remote.lookup(toks) == kept
            assert_prefix_equal(remote.materialize(toks), kv, kept)
            assert _block_posts(remote) == {"200": 5}  # split under the published limit at once


def test_extending_a_stored_chain_under_a_full_tier_keeps_its_head_as_the_embedded_cache_does(tmp_path):
    """A writer asks which blocks are stored (a lookup with ``each``) and sends only the new
    ones. Nothing marked the stored prefix used, so under a full tier the new blocks evicted
    their own chain's head (the least recent: the chain below another one), and the longer
    chain matched nothing while its new blocks held half the tier."""
    a, kv_a = tokens_for(31, 6 * BLOCK), make_kv(6 * BLOCK, 31)
    b, kv_b = tokens_for(32, 3 * BLOCK), make_kv(3 * BLOCK, 32)

    def steps(cache) -> tuple[int, int]:
        cache.ingest(a[: 3 * BLOCK], [(k[:, : 3 * BLOCK], v[:, : 3 * BLOCK]) for k, v in kv_a])
        cache.ingest(b, kv_b)
        assert cache.ingest(a, kv_a).stored == 3
        return cache.lookup(a) // BLOCK, cache.lookup(b) // BLOCK

    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(cpu_bytes="1MiB", pin_memory=False)) as probe:
        probe.ingest(b[:BLOCK], [(k[:, :BLOCK], v[:, :BLOCK]) for k, v in kv_b])
        frame = probe.stats()["tiers"][0]["used_bytes"]  # what one block takes of the tier
    budget = str(6 * frame + frame // 2)  # room for 6 blocks: the longer chain, or its head and the other
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        tiers=cs.TierConfig(cpu_bytes=budget, pin_memory=False)) as embedded:
        assert steps(embedded) == (6, 0)
    with Server(tmp_path, "--cpu-reserve-bytes", "0", cpu_bytes=budget, disk=False) as server:
        with cs.RemoteCache(server.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK) as remote:
            assert steps(remote) == (6, 0)
            assert_prefix_equal(remote.materialize(a), kv_a, 6 * BLOCK)


def test_a_client_body_limit_splits_posts_and_a_frame_it_cannot_hold_is_refused(srv, tmp_path):
    toks, kv = tokens_for(23, 6 * BLOCK), make_kv(6 * BLOCK, 23)
    with pytest.raises(cs.ConfigError, match="max_body_bytes"):
        _remote(srv, cs.Raw(), max_body_bytes=0)
    with pytest.raises(cs.ConfigError, match="max_body_bytes"):
        _remote(srv, cs.Raw(), max_body_bytes="lots")
    with _remote(srv, cs.Raw(), namespace="body", max_body_bytes="16KiB") as tiny:
        with pytest.raises(cs.ConfigError, match=r"max_body_bytes \(16384\) cannot hold one frame"):
            tiny.ingest(toks, kv)  # a Raw frame is ~48 KiB
        assert tiny.lookup(toks) == 0  # nothing sent
    with _remote(srv, cs.Raw(), namespace="body", max_body_bytes="100KiB") as small:
        before = _block_posts(small)
        assert small.ingest(toks, kv).stored == 6
        after = _block_posts(small)
        assert after.get("200", 0) - before.get("200", 0) == 3  # two frames a body
        assert after.get("413", 0) == before.get("413", 0)
        assert small.max_body_bytes == 100 << 10
        assert_prefix_equal(small.materialize(toks), kv, 6 * BLOCK)


def test_a_frame_over_the_servers_body_limit_is_a_clear_error_and_stores_nothing(tmp_path):
    big = 8 * BLOCK  # a Raw frame of ~384 KiB: no body of the server's can hold it
    toks, kv = tokens_for(24, 2 * big), make_kv(2 * big, 24)
    with Server(tmp_path, "--max-frame-bytes", "128KiB", "--max-body-bytes", "256KiB",
                "--max-inflight-body-bytes", "256KiB", disk=False) as server:
        with cs.RemoteCache(server.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=big,
                            on_unavailable="miss") as remote:
            with pytest.raises(cs.ConfigError, match=r"the server's max_body_bytes \(262144\) cannot hold one frame"):
                remote.ingest(toks, kv)
            assert remote.lookup(toks) == 0
            assert remote.max_body_bytes == 256 << 10
            with pytest.raises(cs.ConfigError, match="cannot hold one frame"):
                remote.ingest(toks, kv)
            assert _block_posts(remote) == {}  # the published limit said so before any body went


# -- prefetch in an outage -------------------------------------------------------------------------


def test_prefetch_in_an_outage_is_a_miss_like_the_other_calls():
    toks = tokens_for(25, 2 * BLOCK)
    breaker = CircuitBreaker(failure_threshold=2, backoff=ConstantBackoff(60))
    url = f"http://127.0.0.1:{_closed_port()}"
    with cs.RemoteCache(url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                        on_unavailable="miss", breaker=breaker) as cache:
        for _ in range(3):
            assert cache.prefetch(toks) is None
        with pytest.raises(cs.InputError):  # bad input still raises: it is not an outage
            cache.prefetch([])
        stats = cache.client_stats()
    assert stats["missed_prefetches"] == 3 and stats["outages"] == 1 and stats["in_outage"]
    assert stats["unavailable_calls"] == 2 and stats["refused_by_breaker"] == 1
    with cs.RemoteCache(url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        timeout=5) as cache, pytest.raises(cs.RemoteUnavailable, match="cannot reach"):
        cache.prefetch(toks)  # the default still raises


# -- the paged layer-wise writer checks its requests when it is made --------------------------------


def test_the_paged_layerwise_writer_refuses_bad_requests_when_it_is_made_as_embedded(srv, tmp_path):
    from paged_helpers import engine_pages, write_tokens

    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    pages, _ = engine_pages("nhd", L, H, D, 8, 16, LAYOUT.torch_dtype)
    good = cs.PagedRequest(tokens_for(26, 2 * BLOCK), [0, 1, 2, 3])
    write_tokens(pages, make_kv(2 * BLOCK, 26), [0, 1, 2, 3])
    bad_calls = {
        "page out of range": [good, cs.PagedRequest(tokens_for(27, 2 * BLOCK), [4, 5, 6, 99])],
        "table too short": [good, cs.PagedRequest(tokens_for(27, 2 * BLOCK), [4, 5])],
        "page shared": [good, cs.PagedRequest(tokens_for(27, 2 * BLOCK), [3, 4, 5, 6])],
        "empty keys": [good, cs.PagedRequest([], [4])],
        "not a request": [good, (tokens_for(27, 2 * BLOCK), [4, 5, 6, 7])],
        # (an empty list is a step with nothing to save: taken, test_paged_contract.py)
        "a request not in a list": good,
    }
    want = {}
    with _embedded(tmp_path, cs.Raw()) as embedded:
        for name, requests in bad_calls.items():
            try:
                embedded.ingest_batch(requests, pages, layerwise=True).abort()
            except cs.InputError as exc:
                want[name] = str(exc)
    assert set(want) == set(bad_calls) - {"page shared"}  # a write may read one page twice
    with _remote(srv, cs.Raw(), namespace="lw-checks") as remote:
        for name, message in want.items():
            with pytest.raises(cs.InputError) as info:
                remote.ingest_batch(bad_calls[name], pages, layerwise=True).abort()
            assert str(info.value) == message, name
        assert remote.lookup(good.keys) == 0  # nothing sent
        writer = remote.ingest_batch([good], pages, layerwise=True)
        for i in range(L):
            writer.put_layer(i)
        assert [r.stored for r in writer.finish()] == [2]
        assert remote.lookup(good.keys) == 2 * BLOCK


# -- answers that are not the server's, and blocks gone mid-call ---------------------------------


def _evict_the_last_block_before_the_first_get(cache, srv, toks, monkeypatch, namespace=""):
    """Make the chain of ``toks`` lose its last block (a DELETE) after the lookup, before
    the first GET of its prefix: the eviction race. Returns the chain length each GET asked."""
    hashes = cache.block_hashes(toks)
    stream = cache._stream_chain
    gets: list[int] = []
    headers = {"authorization": "Bearer w", **({"x-cacheseek-namespace": namespace} if namespace else {})}

    def evicted_first(chain, start=0):
        if not gets:
            r = httpx.delete(f"{srv.url}/v1/blocks/{hashes[-1].hex()}", headers=headers)
            assert r.status_code == 204
        gets.append(len(chain))
        return stream(chain, start)

    monkeypatch.setattr(cache, "_stream_chain", evicted_first)
    return gets


def test_a_block_gone_between_the_lookup_and_the_get_ends_the_prefix_before_it(srv, monkeypatch):
    """The server answers 404 for a chain missing any block: the client looks the chain up
    again and fetches what is left, as the embedded cache would return it."""
    toks, kv = tokens_for(31, 6 * BLOCK), make_kv(6 * BLOCK, 31)
    with _remote(srv, cs.Raw()) as cache:
        assert cache.ingest(toks, kv).stored == 6
        gets = _evict_the_last_block_before_the_first_get(cache, srv, toks, monkeypatch)
        got = cache.materialize(toks)
        assert gets == [6, 5]
        assert_prefix_equal(got, kv, 5 * BLOCK)


def _read_buffers(cache) -> dict:
    return cache.client_stats()["read_buffers"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200: scripts/h200.sh tests-store)"))])
def test_a_materialize_reads_into_the_buffers_of_the_last_and_gives_every_one_back(srv, monkeypatch, device):
    """The frames a materialize reads land in host buffers the next one reuses (into fresh
    memory, half a loopback read's time went to page faults; page-locked beside a GPU, so
    their copies run at the link's speed), and every buffer comes back: after a whole read,
    a read cut short by a bad frame, and the eviction race. On a GPU a buffer is reused only
    after its copy has landed: the KV read back is the stored KV, bit for bit."""
    from cacheseek import remote as remote_module

    toks, kv = tokens_for(91, 4 * BLOCK), make_kv(4 * BLOCK, 91)
    with _remote(srv, cs.Raw(), namespace=f"reuse-{device}") as cache:
        assert cache.ingest(toks, kv).stored == 4
        kept = cache.materialize(toks, device)
        assert_prefix_equal(kept, kv, 4 * BLOCK)
        first = _read_buffers(cache)
        assert first["buffers_made"] == 4 and first["leases_active"] == 0 and first["buffers_free"] == 4
        assert first["pinned"] is torch.cuda.is_available()  # (said True on a CPU-only host, pinning nothing)
        for _ in range(2):
            assert_prefix_equal(cache.materialize(toks, device), kv, 4 * BLOCK)
        again = _read_buffers(cache)
        assert again["buffers_made"] == 4 and again["leases_active"] == 0 and again["leases_granted"] == 12
        assert_prefix_equal(kept, kv, 4 * BLOCK)  # the KV returned is its own, not a view of a buffer read into again

        parse = remote_module.parse_frame
        parsed: list[int] = []

        def third_is_bad(buf, **kw):
            parsed.append(1)
            if len(parsed) == 3:
                raise cs.FrameError("injected: a frame that fails its checksum")
            return parse(buf, **kw)

        monkeypatch.setattr(remote_module, "parse_frame", third_is_bad)
        assert_prefix_equal(cache.materialize(toks, device), kv, 2 * BLOCK)
        monkeypatch.setattr(remote_module, "parse_frame", parse)
        assert _read_buffers(cache)["leases_active"] == 0

        gets = _evict_the_last_block_before_the_first_get(cache, srv, toks, monkeypatch, namespace=f"reuse-{device}")
        assert_prefix_equal(cache.materialize(toks, device), kv, 3 * BLOCK)
        assert gets == [4, 3]
        last = _read_buffers(cache)
        assert last["leases_active"] == 0 and last["buffers_made"] == 4 and last["lease_double_releases"] == 0


def test_waited_ingests_send_every_frame_from_one_reused_buffer(srv):
    """A waited ingest moves one frame at a time to the host just before it is sent, into a
    buffer that the next frame, and the next ingest, reuses: the stored bytes are each
    frame's own (the transport sent or copied a frame before it asked for the next)."""
    chains = [(tokens_for(96 + i, 4 * BLOCK), make_kv(4 * BLOCK, 96 + i)) for i in range(2)]
    with _remote(srv, cs.Raw(), namespace="reuse-writes") as cache:
        for toks, kv in chains:
            assert cache.ingest(toks, kv).stored == 4
        writes = cache.client_stats()["write_buffers"]
        assert writes["buffers_made"] == 1 and writes["leases_granted"] == 8 and writes["leases_active"] == 0
        assert writes["pinned"] is torch.cuda.is_available()
        for toks, kv in chains:
            assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)


@pytest.mark.parametrize("failing", [3, 2], ids=["later-chain", "first-chain"])
def test_a_paged_batch_gives_back_the_buffers_of_the_chains_it_fetched_before_an_outage(srv, monkeypatch, failing):
    """A batch load fetches every chain before it writes a page; an outage in one chain
    (fetched at once with the other) leaves the pages as they were and gives back the
    buffers of every chain read, once every fetch has ended."""
    from paged_helpers import engine_pages, page_tables, snapshot, unchanged, write_tokens

    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    sizes = [2 * BLOCK, 3 * BLOCK]
    toks = [tokens_for(95 + r, n) for r, n in enumerate(sizes)]
    pages, _ = engine_pages("flash", L, H, D, 24, 16, dtype)
    tables = page_tables(sizes, 16, 24, seed=3)
    for r, (n, ids) in enumerate(zip(sizes, tables)):
        write_tokens(pages, make_kv(n, 95 + r), ids)
    with _remote(srv, cs.Raw(), namespace=f"reuse-paged-{failing}", on_unavailable="miss") as cache:
        assert [r.stored for r in cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)],
                                                     pages)] == [2, 3]
        dest, dest_tensors = engine_pages("flash", L, H, D, 24, 16, dtype, seed=5)
        dest_tables = page_tables(sizes, 16, 24, seed=4)
        requests = [cs.PagedRequest(t, ids) for t, ids in zip(toks, dest_tables)]
        read = cache._read_chain

        def one_is_an_outage(hashes, *args, **kw):
            if len(hashes) == failing:  # (by chain, not by call: the two are fetched at once)
                raise cs.RemoteUnavailable("injected: the server went away")
            return read(hashes, *args, **kw)

        monkeypatch.setattr(cache, "_read_chain", one_is_an_outage)
        before = snapshot(dest_tensors)
        assert [r.num_tokens for r in cache.materialize_into_batch(requests, dest)] == [0, 0]
        assert unchanged(before, dest_tensors)
        took = _read_buffers(cache)
        # The first chain's fetch is waited for before the error is raised; the second's, when
        # the first failed, is either called off before it began or waited for too.
        assert took["leases_granted"] in ((2,) if failing == 3 else (0, 3)) and took["leases_active"] == 0
        monkeypatch.setattr(cache, "_read_chain", read)
        assert [r.num_tokens for r in cache.materialize_into_batch(requests, dest)] == [2 * BLOCK, 3 * BLOCK]
        assert _read_buffers(cache)["leases_active"] == 0


def _count_requests(cache, monkeypatch) -> list[str]:
    """The paths of the requests ``cache`` sends from now on (every one goes through its transport)."""
    sent: list[str] = []
    handle = cache._transport.handle_request

    def counted(request):
        sent.append(request.url.path)
        return handle(request)

    monkeypatch.setattr(cache._transport, "handle_request", counted)
    return sent


def _owner_traffic(srv, namespace: str) -> dict[str, int]:
    stats = httpx.get(srv.url + "/v1/stats", headers={"authorization": "Bearer r"}).json()
    mine = next(o for o in stats["traffic"]["by_owner"] if o["namespace"] == namespace and o["model"] == "parity")
    return {k: mine[k] for k in ("lookups", "lookup_hits", "lookup_blocks_requested", "lookup_blocks_matched",
                                 "lookup_tokens_requested", "lookup_tokens_matched")}


def test_locate_batch_answers_as_locate_calls_in_one_round_trip(srv, tmp_path, monkeypatch):
    """An engine admitting N requests asks how much of each is stored in one ``POST
    /v1/lookup``: the answers are N ``locate`` calls' (and the embedded cache's), and the
    server counts N lookups with their tokens, as it counted the N calls. Chains past
    ``max_lookup_hashes`` in all go in several lookups, a longer one alone in pieces."""
    sizes = [3 * BLOCK + 5, 2 * BLOCK, 6 * BLOCK, BLOCK - 1, 4 * BLOCK]
    toks = [tokens_for(120 + r, n) for r, n in enumerate(sizes)]
    changed = list(toks[2])
    changed[4 * BLOCK] += 1  # its first 4 blocks stored
    unknown = tokens_for(130, 2 * BLOCK)
    got = {}
    for name, cache in (("remote", _remote(srv, cs.Raw(), namespace="batch-locate")),
                        ("embedded", _embedded(tmp_path, cs.Raw()))):
        with cache:
            for t in toks[:3]:
                cache.ingest(t, make_kv(len(t), 7))
            keys = [toks[0], unknown, changed, toks[3], cache.keys.hashed(toks[1]), toks[4][: 2 * BLOCK + 1]]
            if name == "remote":
                sent = _count_requests(cache, monkeypatch)
                before = _owner_traffic(srv, "batch-locate")
            one_by_one = [cache.locate(k) for k in keys]
            if name == "remote":
                mid = _owner_traffic(srv, "batch-locate")
                del sent[:]
            together = cache.locate_batch(keys)
            if name == "remote":
                assert sent == ["/v1/lookup"]
                after = _owner_traffic(srv, "batch-locate")
                assert {k: after[k] - mid[k] for k in after} == {k: mid[k] - before[k] for k in mid}
                assert after["lookups"] - mid["lookups"] == len(keys)
            assert together == one_by_one
            assert cache.locate_batch([]) == []
            for bad, why in (([toks[0], [], toks[1]], r"^keys\[1\]: token_ids: empty input"),
                             ([toks[0], None], r"^keys\[1\]: keys: expected token ids"),
                             ([[0.5] * BLOCK], r"^keys\[0\]: token_ids"),
                             (toks[0][0], r"^keys: expected a list of keys")):
                with pytest.raises(cs.InputError, match=why):
                    cache.locate_batch(bad)
            if name == "remote":
                assert sent == ["/v1/lookup"]  # bad input: nothing more sent
            got[name] = together
    assert got["remote"] == got["embedded"]
    assert [x.num_blocks for x in got["remote"]] == [3, 0, 4, 0, 2, 0]
    # A client of at most 4 hashes a lookup, chains of 3, 2, 6, 0, 2, 0, 3 blocks: [3] alone,
    # [6] alone in pieces of 4 and 2, [2, 0, 2, 0] together, [3] alone: 5 lookups.
    with _remote(srv, cs.Raw(), namespace="batch-locate", max_lookup_hashes=4) as small:
        sent = _count_requests(small, monkeypatch)
        keys = [toks[0], unknown, changed, toks[3], toks[1], toks[4][:5], toks[0]]
        together = small.locate_batch(keys)
        assert len(sent) == 5
        assert together == [small.locate(k) for k in keys]


def test_a_server_that_knows_no_lookup_of_several_chains_is_asked_chain_by_chain(srv):
    """An older server ignores ``?chains=`` and answers one chain of all the hashes: seen in
    its answer (no ``chains``), which is dropped; each chain is then asked alone, this call
    and the next."""
    from fake_http import FakeServer

    toks = [tokens_for(150, 2 * BLOCK), tokens_for(151, 3 * BLOCK)]
    with FakeServer(_forwarding_front(srv, b'{"matched": 0, "tiers": []}')) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
            trust_env=False) as older:
        assert older.locate_batch(toks) == [cs.Located(0, 0, [])] * 2
        assert older.locate_batch(toks) == [cs.Located(0, 0, [])] * 2
        lines = [r.split(b"\r\n", 1)[0].decode() for r in front.requests]
    assert len(lines) == 5 and "chains=2,3" in lines[0] and not any("chains" in line for line in lines[1:])


def test_a_paged_batch_load_looks_up_once_and_fetches_its_chains_at_once(srv, monkeypatch):
    """materialize_into_batch over HTTP: one lookup for all requests, and their chains
    fetched at once (each fetch waits here until all four have begun: fetched one after
    another, the first would wait alone), decoded into the pages once all have come."""
    import threading

    from paged_helpers import engine_pages, page_tables, read_tokens, write_tokens

    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    sizes = [2 * BLOCK, 3 * BLOCK, BLOCK + 7, 2 * BLOCK]
    toks = [tokens_for(140 + r, n) for r, n in enumerate(sizes)]
    kvs = [make_kv(n, 140 + r) for r, n in enumerate(sizes)]
    src, _ = engine_pages("nhd", L, H, D, 40, 16, dtype)
    tables = page_tables(sizes, 16, 40, seed=7)
    for kv, ids in zip(kvs, tables):
        write_tokens(src, kv, ids)
    with _remote(srv, cs.Raw(), namespace="batch-load") as cache:
        assert [r.stored for r in cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)],
                                                     src)] == [2, 3, 1, 2]
        dest, _ = engine_pages("nhd", L, H, D, 40, 16, dtype, seed=9)
        dest_tables = page_tables(sizes, 16, 40, seed=8)
        all_begun = threading.Barrier(4, timeout=5)
        read = cache._read_chain

        def fetch(*args, **kw):
            all_begun.wait()
            return read(*args, **kw)

        monkeypatch.setattr(cache, "_read_chain", fetch)
        sent = _count_requests(cache, monkeypatch)
        loaded = cache.materialize_into_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, dest_tables)], dest)
        assert [x.num_blocks for x in loaded] == [2, 3, 1, 2]
        assert sent.count("/v1/lookup") == 1 and len(sent) == 5
        for kv, ids, x in zip(kvs, dest_tables, loaded):
            for (k, v), (k0, v0) in zip(read_tokens(dest, ids, x.num_tokens), kv):
                assert torch.equal(k.cpu(), k0[:, : x.num_tokens]) and torch.equal(v.cpu(), v0[:, : x.num_tokens])
        assert _read_buffers(cache)["leases_active"] == 0


def test_a_paged_batch_met_by_close_raises_and_writes_nothing(srv, monkeypatch):
    """close() from another thread while a batch fetches: the fetch it calls off (queued
    behind two under way) makes the batch raise close()'s error once the two have ended,
    with no page written and every buffer given back, not answer a load short of that chain."""
    import threading

    from paged_helpers import engine_pages, page_tables, snapshot, unchanged, write_tokens

    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    sizes = [BLOCK, BLOCK, BLOCK]
    toks = [tokens_for(160 + r, n) for r, n in enumerate(sizes)]
    src, _ = engine_pages("nhd", L, H, D, 12, 16, dtype)
    tables = page_tables(sizes, 16, 12, seed=5)
    for r, ids in enumerate(tables):
        write_tokens(src, make_kv(BLOCK, 160 + r), ids)
    cache = _remote(srv, cs.Raw(), namespace="batch-close", max_concurrent_fetches=2)
    assert [r.stored for r in cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)],
                                                 src)] == [1, 1, 1]
    dest, dest_tensors = engine_pages("nhd", L, H, D, 12, 16, dtype, seed=6)
    before = snapshot(dest_tensors)
    read, reached, go = cache._read_chain, threading.Semaphore(0), threading.Event()

    def read_then_hold(*args, **kw):
        frames = read(*args, **kw)
        reached.release()
        go.wait(10)
        return frames

    monkeypatch.setattr(cache, "_read_chain", read_then_hold)
    raised: list[BaseException] = []

    def load():
        try:
            cache.materialize_into_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], dest)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    assert reached.acquire(timeout=10) and reached.acquire(timeout=10)  # two read, the third queued
    cache.close()
    go.set()
    loader.join(10)
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and "closed" in str(raised[0]), raised
    assert unchanged(before, dest_tensors)
    assert _read_buffers(cache)["leases_active"] == 0


def test_a_batch_s_fetch_threads_exit_once_idle_stay_through_a_loop_and_end_at_close(srv, monkeypatch):
    """The fetch pool kept its threads until close(): a client that loaded one batch and then
    idled for hours held max_concurrent_fetches threads. They now exit once idle
    (FETCH_IDLE_SECONDS, short here), a loop of batches keeps the same ones, and close()
    ends them."""
    import cacheseek.remote as remote_module
    from paged_helpers import engine_pages, page_tables, write_tokens

    # Idle long enough that a loaded machine's next batch comes first; short for a test.
    monkeypatch.setattr(remote_module, "FETCH_IDLE_SECONDS", 2.0, raising=False)
    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    sizes = [BLOCK] * 4
    toks = [tokens_for(180 + r, n) for r, n in enumerate(sizes)]
    src, _ = engine_pages("nhd", L, H, D, 8, 16, dtype)
    tables = page_tables(sizes, 16, 8, seed=3)
    for r, ids in enumerate(tables):
        write_tokens(src, make_kv(BLOCK, 180 + r), ids)
    before = set(threading.enumerate())

    def fetchers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("cacheseek-fetch") and t not in before}

    def gone(threads: set[threading.Thread], within: float) -> bool:
        for t in threads:
            t.join(within)
        return not any(t.is_alive() for t in threads)

    cache = _remote(srv, cs.Raw(), namespace="fetch-threads", max_concurrent_fetches=4)
    requests = [cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)]
    assert [r.stored for r in cache.ingest_batch(requests, src)] == [1, 1, 1, 1]
    dest, _ = engine_pages("nhd", L, H, D, 8, 16, dtype, seed=4)
    assert [x.num_blocks for x in cache.materialize_into_batch(requests, dest)] == [1] * 4
    first = fetchers()
    # The batch's chains were fetched on the pool's threads (none inline), at most 4 of them.
    assert first, "no fetch thread after a batch of 4 chains"
    assert len(first) == cache._fetcher.threads <= cache.max_concurrent_fetches == 4, first
    for _ in range(3):  # a hot loop: the threads kept (more started only while all are busy)
        assert [x.num_blocks for x in cache.materialize_into_batch(requests, dest)] == [1] * 4
        now = fetchers()
        assert first <= now and len(now) <= 4, (first, now)
    first = fetchers()
    assert gone(first, within=15.0), "idle fetch threads still alive"
    assert [x.num_blocks for x in cache.materialize_into_batch(requests, dest)] == [1] * 4  # started again
    again = fetchers()
    assert again and not again & first
    cache.close()
    assert gone(again, within=2.0), "fetch threads alive after close()"
    assert _read_buffers(cache)["leases_active"] == 0


def test_read_buffer_bytes_zero_reads_into_fresh_memory_every_time(srv):
    toks, kv = tokens_for(93, 2 * BLOCK), make_kv(2 * BLOCK, 93)
    with _remote(srv, cs.Raw(), namespace="reuse", read_buffer_bytes=0) as cache:
        cache.ingest(toks, kv)
        for _ in range(2):
            assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)
        got = _read_buffers(cache)
        assert got["buffers_made"] == 4 and got["buffers_free"] == 0 and got["leases_active"] == 0
    with pytest.raises(cs.ConfigError, match="read_buffer_bytes"):
        _remote(srv, cs.Raw(), read_buffer_bytes=-1)


def test_a_look_again_after_the_eviction_race_is_not_counted_as_a_query_of_its_own(srv, monkeypatch):
    """The lookup a materialize sends again after its GET met the eviction race (a 404) was
    counted by the server as a query of its own: two lookups and two hits for one
    materialize, the chain's tokens requested and matched twice. The query counts once, as
    its lookup answered."""
    toks, kv = tokens_for(44, 6 * BLOCK), make_kv(6 * BLOCK, 44)

    def traffic() -> dict[str, int]:
        stats = httpx.get(srv.url + "/v1/stats", headers={"authorization": "Bearer r"}).json()
        mine = next(o for o in stats["traffic"]["by_owner"] if o["namespace"] == "again")
        return {k: mine[k] for k in ("lookups", "lookup_hits", "lookup_blocks_requested", "lookup_blocks_matched",
                                     "lookup_tokens_requested", "lookup_tokens_matched")}

    with _remote(srv, cs.Raw(), namespace="again") as cache:
        assert cache.ingest(toks, kv).stored == 6
        gets = _evict_the_last_block_before_the_first_get(cache, srv, toks, monkeypatch, namespace="again")
        before = traffic()
        assert_prefix_equal(cache.materialize(toks), kv, 5 * BLOCK)
        assert gets == [6, 5]
        after = traffic()
    assert {k: after[k] - before[k] for k in after} == {
        "lookups": 1, "lookup_hits": 1, "lookup_blocks_requested": 6, "lookup_blocks_matched": 6,
        "lookup_tokens_requested": 6 * BLOCK, "lookup_tokens_matched": 6 * BLOCK}


def test_a_request_located_then_loaded_counts_once_and_a_paged_load_its_whole_query(srv):
    """The hit rate an operator reads: a paged load said its query was the whole blocks it
    could load (a prompt of 4 blocks and 19 tokens, its 4 blocks stored: a hit rate of 1
    where ``materialize`` of it read 0.87), and an engine that locates every request and
    loads the hits (the vLLM connector, ``prefill_with_reuse``) counted each hit twice and
    each miss once. A load after ``locate`` says ``located=True``: not counted again."""
    from paged_helpers import engine_pages

    def traffic() -> dict[str, int]:
        stats = httpx.get(srv.url + "/v1/stats", headers={"authorization": "Bearer r"}).json()
        mine = next(o for o in stats["traffic"]["by_owner"] if o["namespace"] == "counted")
        return {k: mine[k] for k in ("lookups", "lookup_hits", "lookup_tokens_requested", "lookup_tokens_matched")}

    def counted(call) -> dict[str, int]:
        before = traffic()
        call()
        after = traffic()
        return {k: after[k] - before[k] for k in after}

    n = 4 * BLOCK + 19
    toks, kv = tokens_for(45, n), make_kv(n, 45)
    miss = tokens_for(46, n)
    pages, _ = engine_pages("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 24, 16,
                            LAYOUT.torch_dtype)
    ids = list(range(10))
    whole = {"lookups": 1, "lookup_hits": 1, "lookup_tokens_requested": n, "lookup_tokens_matched": 4 * BLOCK}
    with _remote(srv, cs.Raw(), namespace="counted") as cache:
        assert cache.ingest(toks, kv).stored == 4
        assert counted(lambda: cache.materialize(toks)) == whole
        assert counted(lambda: cache.materialize_into(toks, pages.at(ids))) == whole
        assert counted(lambda: cache.materialize_into_batch([cs.PagedRequest(toks, ids)], pages)) == whole
        assert counted(lambda: cache.materialize_into(toks, pages.at(ids), max_tokens=3 * BLOCK + 5)) == {
            "lookups": 1, "lookup_hits": 1, "lookup_tokens_requested": 3 * BLOCK + 5,
            "lookup_tokens_matched": 3 * BLOCK}

        def engine() -> None:  # locate both, load the hit
            hit, missed = cache.locate_batch([toks, miss])
            assert (hit.num_tokens, missed.num_tokens) == (4 * BLOCK, 0)
            got = cache.materialize_into_batch([cs.PagedRequest(toks, ids)], pages, located=True)
            assert got[0].num_tokens == 4 * BLOCK
            assert cache.materialize(toks, located=True).num_tokens == 4 * BLOCK
            assert cache.materialize_into(toks, pages.at(ids), located=True).num_tokens == 4 * BLOCK

        assert counted(engine) == {"lookups": 2, "lookup_hits": 1, "lookup_tokens_requested": 2 * n,
                                   "lookup_tokens_matched": 4 * BLOCK}


def test_a_load_of_a_prompt_under_one_block_counts_its_query_as_locate_does(srv):
    """A prompt shorter than one block (or cut below one by ``max_tokens``) has no hash to
    look up: ``materialize`` and the paged loads sent no lookup for it, so the server never
    counted the query, while ``locate`` of the same prompt counted a lookup with no hit and
    its tokens. A worker loading without ``locate`` read a hit rate over its long prompts
    only (1.0 where ``locate`` read 0.76). Every load not ``located`` is one query now."""
    from paged_helpers import engine_pages

    def traffic() -> dict[str, int]:
        stats = httpx.get(srv.url + "/v1/stats", headers={"authorization": "Bearer r"}).json()
        mine = next((o for o in stats["traffic"]["by_owner"] if o["namespace"] == "short"), {})
        return {k: mine.get(k, 0) for k in ("lookups", "lookup_hits", "lookup_tokens_requested",
                                            "lookup_tokens_matched")}

    def counted(call) -> dict[str, int]:
        before = traffic()
        call()
        after = traffic()
        return {k: after[k] - before[k] for k in after}

    short, long = tokens_for(48, BLOCK - 12), tokens_for(49, 2 * BLOCK)
    pages, _ = engine_pages("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 24, 16,
                            LAYOUT.torch_dtype)
    ids = list(range(10))
    miss = {"lookups": 1, "lookup_hits": 0, "lookup_tokens_requested": BLOCK - 12, "lookup_tokens_matched": 0}
    cut = {**miss, "lookup_tokens_requested": BLOCK - 1}
    with _remote(srv, cs.Raw(), namespace="short") as cache:
        assert cache.ingest(long, make_kv(2 * BLOCK, 49)).stored == 2
        assert counted(lambda: cache.locate(short)) == miss
        assert counted(lambda: cache.materialize(short)) == miss
        assert counted(lambda: cache.materialize(short, layerwise=True).close()) == miss
        assert counted(lambda: cache.materialize_into(short, pages.at(ids))) == miss
        assert counted(lambda: cache.materialize_into_batch([cs.PagedRequest(short, ids)], pages)) == miss
        assert counted(lambda: cache.materialize(long, max_tokens=BLOCK - 1)) == cut
        assert counted(lambda: cache.materialize_into(long, pages.at(ids), max_tokens=BLOCK - 1)) == cut
        # beside a request with blocks: each its own query, in the same lookup
        both = [cs.PagedRequest(long, ids[:4]), cs.PagedRequest(short, ids[4:])]
        assert [r.num_tokens for r in cache.materialize_into_batch(both, pages)] == [2 * BLOCK, 0]
        assert counted(lambda: cache.materialize_into_batch(both, pages)) == {
            "lookups": 2, "lookup_hits": 1, "lookup_tokens_requested": 3 * BLOCK - 12,
            "lookup_tokens_matched": 2 * BLOCK}
        # located: counted by its locate already, and nothing to ask
        assert counted(lambda: cache.materialize(short, located=True)) == dict.fromkeys(miss, 0)
        # cut to no token (an engine's prompt_len - 1 of a one-token prompt): no query, not a
        # lookup of 0 tokens that lowered lookup_hits / lookups
        assert counted(lambda: cache.materialize(long, max_tokens=0)) == dict.fromkeys(miss, 0)
        assert counted(lambda: cache.materialize(long, max_tokens=0, layerwise=True).close()) == dict.fromkeys(miss, 0)
        assert counted(lambda: cache.materialize_into(long, pages.at(ids), max_tokens=0)) == dict.fromkeys(miss, 0)
        assert counted(lambda: cache.materialize_into_batch([cs.PagedRequest(short, ids)], pages,
                                                            located=True)) == dict.fromkeys(miss, 0)


def test_a_frame_of_another_configuration_under_the_caches_key_is_counted_and_said(srv, caplog):
    """A frame the server sends for a block that fails its check (a writer of other settings
    under the same keys; here a Raw frame under a KIVI cache's first key) ended the prefix
    unsaid: never decoded (right), but not counted or logged, lookups still claiming it."""
    from server_helpers import raw_frame

    toks = tokens_for(47, 2 * BLOCK)
    with _remote(srv, cs.KIVI(bits=4, group_size=32), namespace="forged") as cache, caplog.at_level(logging.WARNING):
        first = cache.block_hashes(toks)[0]
        _, frame = raw_frame(1, block_hash=bytes(first), parent=cache.keys.parents([first])[0], layout=LAYOUT)
        put = httpx.put(f"{srv.url}/v1/blocks/{first.hex()}", content=frame,
                        headers={"authorization": "Bearer w", "x-cacheseek-namespace": "forged"})
        assert put.status_code == 201, put.text
        assert cache.lookup(toks) == BLOCK
        assert cache.materialize(toks).num_tokens == 0  # never decoded as this cache's
        assert cache.materialize(toks).num_tokens == 0
        assert cache.client_stats()["bad_frames"] == 2
    said = [r.getMessage() for r in caplog.records if "fails its check" in r.getMessage()]
    assert len(said) == 1 and first.hex() in said[0] and "another codec" in said[0], said


def _answers(status_line: bytes, body: bytes, *, lookups: bytes | None = None, headers: bytes = b""):
    """A fake front: lookups answered ``lookups`` (JSON) when given, every other request
    ``status_line`` with ``body``."""
    def script(n: int, head: bytes):
        if lookups is not None and b" /v1/lookup" in head.split(b"\r\n", 1)[0]:
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(lookups)).encode() + b"\r\n\r\n" + lookups), False
        return (status_line + b"\r\n" + headers + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
                + body), False
    return script


def test_a_streamed_frame_of_another_block_ends_the_prefix_before_it():
    """The frame a server streams at a chain's place is checked to be that block (its header
    names it): the only check between a server's (or a proxy cache's) wrong body and another
    prompt's KV in the engine. A chain whose second frame is a valid frame of a sibling block
    (same parent and position, same configuration) loads its first block alone."""
    import json as jsonlib

    from fake_http import FakeServer
    from server_helpers import batch_body, raw_frame

    toks = tokens_for(48, 2 * BLOCK)
    with cs.RemoteCache("http://127.0.0.1:1", model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        trust_env=False) as keys_of:
        h0, h1 = keys_of.block_hashes(toks)
        root = keys_of.keys.parents([h0])[0]
    first = raw_frame(1, block_hash=bytes(h0), parent=root, layout=LAYOUT)[1]
    sibling = raw_frame(2, block_hash=bytes(17 * [7])[:16], parent=bytes(h0), position=1, layout=LAYOUT)[1]
    body = batch_body([first, sibling])
    found = jsonlib.dumps({"matched": 2, "tiers": ["cpu", "cpu"]}).encode()

    def script(n: int, head: bytes):
        if b" /v1/lookup" in head.split(b"\r\n", 1)[0]:
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(found)).encode() + b"\r\n\r\n" + found), False
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.cacheseek.frames\r\ncontent-length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body), False

    with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                     block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
        got = cache.materialize(toks)
        assert got.num_tokens == BLOCK  # the first block's; never the sibling's KV as block 1
        assert cache.client_stats()["bad_frames"] == 1


def test_a_gateways_502_or_504_is_an_outage_and_a_busy_503_or_a_429_is_not(caplog):
    from fake_http import FakeServer

    toks, kv = tokens_for(32, 2 * BLOCK), make_kv(2 * BLOCK, 32)
    for status in (b"502 Bad Gateway", b"504 Gateway Timeout"):
        with FakeServer(_answers(b"HTTP/1.1 " + status, b"<html>upstream down</html>")) as front, \
                cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                               on_unavailable="miss", trust_env=False) as cache:
            assert cache.lookup(toks) == 0 and cache.materialize(toks).num_tokens == 0
            assert cache.ingest(toks, kv).failed == 2
            stats = cache.client_stats()
            assert stats["outages"] == 1 and stats["unavailable_calls"] == 3, (status, stats)
            assert stats["breaker"]["state"] == "open"
        with FakeServer(_answers(b"HTTP/1.1 " + status, b"")) as front, \
                cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                               timeout=5, trust_env=False) as cache, pytest.raises(cs.RemoteUnavailable):
            cache.lookup(toks)
    page = _answers(b"HTTP/1.1 200 OK", b"<html>maintenance</html>", headers=b"content-type: text/html\r\n")
    with FakeServer(page) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                   block_tokens=BLOCK, timeout=5, on_unavailable="miss",
                                                   trust_env=False) as cache:
        assert cache.lookup(toks) == 0 and cache.prefetch(toks) is None and cache.ingest(toks, kv).failed == 2
        assert cache.client_stats()["outages"] == 1  # a front's page is not the service
    # The server's own back-pressure, and a rate-limiting front's (a 429 was a RemoteError
    # even under "miss": a failed call where a miss was promised).
    lookup = b'{"matched": 0, "tiers": [], "present": [false, false], "durability": "durable"}'
    for busy in (_answers(b"HTTP/1.1 503 Service Unavailable", b'{"error": "retry later"}',
                          lookups=lookup, headers=b"retry-after: 1\r\nx-cacheseek-busy: max_inflight_body_bytes\r\n"),
                 _answers(b"HTTP/1.1 429 Too Many Requests", b"retry later: 100 requests per second", lookups=lookup,
                          headers=b"retry-after: 1\r\ncontent-type: text/plain\r\n")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="cacheseek.remote"), FakeServer(busy) as front, \
                cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                               on_unavailable="miss", trust_env=False) as cache:
            for _ in range(5):
                res = cache.ingest(toks, kv)
                assert res.failed == 2 and "retry later" in res.errors["server"]
            assert cache.lookup(toks) == 0  # reads still go: the breaker stayed closed
            stats = cache.client_stats()
        assert stats["busy_refusals"] == 5 and stats["dropped_blocks"] == 10
        assert stats["outages"] == 0 and stats["unavailable_calls"] == 0 and stats["breaker"]["state"] == "closed"
        assert not [r for r in caplog.records if r.name == "cacheseek.remote"]  # no outage logged
        with FakeServer(busy) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                       block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
            with pytest.raises(cs.RemoteBusy, match="retry later"):  # the default raises it (a RemoteUnavailable)
                cache.ingest(toks, kv)
    # Busy answers in a row, with no answered lookup between them to reset the breaker's count
    # (above, each ingest's lookup was answered: a busy refusal counted as a failure would
    # never have opened it there).
    every = _answers(b"HTTP/1.1 503 Service Unavailable", b'{"error": "retry later"}',
                     headers=b"retry-after: 1\r\nx-cacheseek-busy: max_inflight_body_bytes\r\n")
    with FakeServer(every) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                    block_tokens=BLOCK, timeout=5, on_unavailable="miss",
                                                    trust_env=False) as cache:
        for _ in range(6):
            assert cache.lookup(toks) == 0
        stats = cache.client_stats()
    assert stats["busy_refusals"] == 6 and stats["breaker"]["state"] == "closed" and stats["outages"] == 0
    assert stats["refused_by_breaker"] == 0


@pytest.mark.parametrize("status", [b"404 Not Found", b"408 Request Timeout", b"500 Internal Server Error"])
def test_a_fronts_error_page_is_an_outage_and_the_servers_own_json_error_is_not(status):
    """Every error the server sends is its JSON ``{"error": ...}``. A front's HTML page (an
    ingress's default 404, a proxy's 408 or 500) was raised as a ``RemoteError`` from every
    call under ``on_unavailable="miss"`` (a hot path promised it needs no ``try``) and never
    opened the breaker. It is an outage now, as a 2xx page is; the same status with the
    server's JSON error is still the error it says, and a page that says the client is set
    up wrong (a redirect, a 400, a proxy's 407, a refused token's 401) an error too: a miss
    would hide it."""
    from fake_http import FakeServer

    toks, kv = tokens_for(35, 2 * BLOCK), make_kv(2 * BLOCK, 35)
    page = _answers(b"HTTP/1.1 " + status, b"<html><body><h1>" + status + b"</h1></body></html>",
                    headers=b"content-type: text/html\r\n")
    with FakeServer(page) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                   block_tokens=BLOCK, timeout=5, on_unavailable="miss",
                                                   trust_env=False) as cache:
        assert cache.lookup(toks) == 0 and cache.materialize(toks).num_tokens == 0
        assert cache.ingest(toks, kv).failed == 2
        assert cache.ingest(toks, kv, wait=False).result(10).failed == 2
        stats = cache.client_stats()
        assert stats["outages"] == 1 and stats["unavailable_calls"] == 3, stats
        assert stats["breaker"]["state"] == "open" and status[:3].decode() in stats["last_error"]
    with FakeServer(page) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                   block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
        with pytest.raises(cs.RemoteUnavailable, match="<html>") as info:
            cache.lookup(toks)
        assert info.value.status == int(status[:3]) and info.value.reason.startswith("<html>")
    own = _answers(b"HTTP/1.1 " + status, b'{"error": "the server says no"}',
                   headers=b"content-type: application/json\r\n")
    pages = [(_answers(b"HTTP/1.1 " + wrong, b"<html>set up wrong</html>",
                       headers=b"location: https://elsewhere/\r\n" if wrong.startswith(b"301") else b""),
              "<html>set up wrong</html>")
             for wrong in (b"401 Unauthorized", b"407 Proxy Authentication Required", b"400 Bad Request",
                           b"301 Moved Permanently")]
    for script, reason in [(own, "the server says no"), *pages]:
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, on_unavailable="miss",
                                                         trust_env=False) as cache:
            with pytest.raises(cs.RemoteError) as info:
                cache.lookup(toks)
            assert not isinstance(info.value, cs.RemoteUnavailable) and info.value.reason == reason
            assert cache.client_stats()["outages"] == 0


def test_a_server_that_dribbles_its_answer_is_an_outage_at_the_exchange_timeout():
    from fake_http import FakeServer

    toks = tokens_for(34, 2 * BLOCK)
    lookup = b'{"matched": 2, "tiers": ["cpu", "cpu"]}'

    def script(n: int, head: bytes):
        if b" /v1/lookup" in head.split(b"\r\n", 1)[0]:
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(lookup)).encode() + b"\r\n\r\n" + lookup), False

        def dribble():  # a byte every 50 ms: each read well within the 5 s timeout
            yield (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.cacheseek.frames\r\ncontent-length: 4096\r\n\r\n"
                   + (4088).to_bytes(8, "little"))  # a frame's length, then its bytes
            for _ in range(4088):
                time.sleep(0.05)
                yield b"\0"
        return dribble(), True

    with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                     block_tokens=BLOCK, timeout=5, exchange_timeout=0.5,
                                                     on_unavailable="miss", trust_env=False) as cache:
        start = time.monotonic()
        assert cache.materialize(toks).num_tokens == 0
        assert time.monotonic() - start < 3
        stats = cache.client_stats()
        assert stats["outages"] == 1 and "exchange_timeout" in stats["last_error"]
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(cs.ConfigError, match="timeout"):
            cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=LAYOUT, block_tokens=BLOCK, exchange_timeout=bad)
        with pytest.raises(cs.ConfigError, match="timeout"):
            cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=LAYOUT, block_tokens=BLOCK, timeout=bad)


@pytest.mark.parametrize("answer", ["huge-length", "html", "chunked"])
def test_a_prefix_answer_that_is_not_frames_is_a_miss_and_allocates_nothing(answer):
    """A body whose first bytes declare an impossible frame length (an HTML page read as
    one) is never allocated, and a chunked answer is read as well as a sized one."""
    from fake_http import FakeServer

    toks = tokens_for(33, 2 * BLOCK)
    bodies = {"huge-length": (1 << 30).to_bytes(8, "little") + bytes(100), "html": b"<!DOCTYPE html><html>maintenance",
              "chunked": b""}
    if answer == "chunked":
        script = _answers(b"HTTP/1.1 200 OK", b"", lookups=b'{"matched": 2, "tiers": ["cpu", "cpu"]}')

        def chunked(n: int, head: bytes):
            if b" /v1/prefixes/" in head.split(b"\r\n", 1)[0]:
                chunk = (1 << 30).to_bytes(8, "little") + bytes(100)  # read by a BatchReader: no length known
                return (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.cacheseek.frames\r\n"
                        b"transfer-encoding: chunked\r\n\r\n" + f"{len(chunk):x}".encode() + b"\r\n" + chunk
                        + b"\r\n0\r\n\r\n"), False
            return script(n, head)
        script_used = chunked
    else:
        script_used = _answers(b"HTTP/1.1 200 OK", bodies[answer], lookups=b'{"matched": 2, "tiers": ["cpu", "cpu"]}',
                               headers=b"content-type: application/vnd.cacheseek.frames\r\n")
    for mode in ("miss", "raise"):
        with FakeServer(script_used) as front, cs.RemoteCache(
                front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                on_unavailable=mode, trust_env=False) as cache:
            tracemalloc.start()
            try:
                assert cache.materialize(toks).num_tokens == 0  # the prefix ends at the first bad frame: here
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 64 << 20, f"{peak} bytes allocated for an answer that holds no frame"



def _forwarding_front(srv, lookup: bytes, *, compress: bool = False, strip_query: bool = False,
                      chunked: bool = False):
    """A fake front: lookups answered ``lookup`` (JSON), other requests forwarded to ``srv``
    (their bodies are not; their query too unless ``strip_query``: a server that knows no
    parameter), the answer gzipped when ``compress`` and the request accepts it, sent in
    chunks of 1,000 bytes when ``chunked``."""
    import gzip

    def script(n: int, head: bytes):
        line, *fields = head.decode("latin-1").split("\r\n")
        _, path, _ = line.split(" ")
        if strip_query:
            path = path.partition("?")[0]
        headers = {k.lower(): v for k, v in (f.split(": ", 1) for f in fields)}
        if path.startswith("/v1/lookup"):
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(lookup)).encode() + b"\r\n\r\n" + lookup), False
        headers.pop("host")
        upstream = httpx.get(srv.url + path, headers=headers)
        body, extra = upstream.content, b""
        if compress and "gzip" in headers.get("accept-encoding", ""):
            body, extra = gzip.compress(body), b"content-encoding: gzip\r\n"
        head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n" % (upstream.status_code,
                                                             upstream.headers["content-type"].encode()) + extra
        if chunked:
            pieces = [body[i : i + 1000] for i in range(0, len(body), 1000)]
            return head + b"transfer-encoding: chunked\r\n\r\n" + b"".join(
                b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n", False
        return head + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body, False
    return script


def test_a_prefix_a_front_sends_in_chunks_is_read_whole_into_memory_of_its_own(srv):
    """A front that re-chunks the prefix stream (no length known): its frames come through
    a ``BatchReader``, not the reused read buffers, and the materialize is whole."""
    from fake_http import FakeServer

    toks, kv = tokens_for(37, 3 * BLOCK), make_kv(3 * BLOCK, 37)
    with _remote(srv, cs.Raw(), namespace="chunked") as cache:
        assert cache.ingest(toks, kv).stored == 3
    lookup = b'{"matched": 3, "tiers": ["cpu", "cpu", "cpu"]}'
    with FakeServer(_forwarding_front(srv, lookup, chunked=True)) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, token="w",
            namespace="chunked", trust_env=False) as cache:
        assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
        assert _read_buffers(cache)["leases_granted"] == 0


def test_a_front_that_compresses_what_the_client_accepts_leaves_materialize_whole(srv):
    """The frames of a materialize are read raw (``read_exactly``, not httpx's decoding), so
    the client must not invite a front (an ingress's compress middleware) to gzip them: it
    asked for gzip, got it, read the gzip stream as frames, and every load was a miss."""
    from fake_http import FakeServer

    toks, kv = tokens_for(35, 4 * BLOCK), make_kv(4 * BLOCK, 35)
    with _remote(srv, cs.Raw(), namespace="gzip") as cache:
        assert cache.ingest(toks, kv).stored == 4
    lookup = b'{"matched": 4, "tiers": ["cpu", "cpu", "cpu", "cpu"]}'
    with FakeServer(_forwarding_front(srv, lookup, compress=True)) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, token="w",
            namespace="gzip", timeout=5, trust_env=False) as cache:
        assert_prefix_equal(cache.materialize(toks), kv, 4 * BLOCK)


@pytest.mark.parametrize("lookup", [b'{"matched": 4, "tiers": ["cpu", "cpu", "cpu", "cpu"]}', b'{}',
                                    b'{"matched": "2", "tiers": ["cpu", "cpu"]}', b'[]'],
                         ids=["more-than-asked", "empty", "matched-a-string", "a-list"])
def test_a_lookup_answer_that_is_not_the_servers_is_an_outage_and_writes_no_page(srv, lookup):
    """A lookup answer is checked before it is used: a count past the hashes asked about
    made ``materialize_into`` fetch and write blocks past ``max_tokens`` (pages the engine
    did not offer), and an answer of another shape raised KeyError or TypeError."""
    from fake_http import FakeServer
    from paged_helpers import engine_pages, snapshot, unchanged

    toks, kv = tokens_for(36, 4 * BLOCK), make_kv(4 * BLOCK, 36)
    with _remote(srv, cs.Raw(), namespace="lie") as cache:
        cache.ingest(toks, kv)
        assert cache.lookup(toks) == 4 * BLOCK
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    pages, tensors = engine_pages("nhd", L, H, D, 8, 16, LAYOUT.torch_dtype)
    before = snapshot(tensors)
    with FakeServer(_forwarding_front(srv, lookup)) as front:
        for mode in ("miss", "raise"):
            with cs.RemoteCache(front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                                token="w", namespace="lie", timeout=5, trust_env=False, on_unavailable=mode) as cache:
                if mode == "raise":
                    with pytest.raises(cs.RemoteUnavailable, match="not the CacheSeek server's"):
                        cache.materialize_into(toks, pages.at(list(range(8))), max_tokens=2 * BLOCK)
                    continue
                got = cache.materialize_into(toks, pages.at(list(range(8))), max_tokens=2 * BLOCK)
                assert got.num_tokens == 0
                assert cache.lookup(toks[: 2 * BLOCK]) == 0
                assert cache.materialize(toks[: 2 * BLOCK]).num_tokens == 0
                assert cache.client_stats()["unavailable_calls"] == 3
    assert unchanged(before, tensors)


@pytest.mark.parametrize("present", [b'["no", "no"]', b"[null, null]", b"[1, 0]"])
def test_a_write_lookup_whose_presence_is_not_booleans_is_an_outage(present):
    """What a write's lookup says of each block decides what is sent; its list was checked
    for its length only: strings or nulls raised TypeError from ``ingest``, and made
    ``ingest_batch`` report blocks present that it never sent (``"no"`` is truthy)."""
    from fake_http import FakeServer
    from paged_helpers import engine_pages, write_tokens

    toks, kv = tokens_for(45, 2 * BLOCK), make_kv(2 * BLOCK, 45)
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    pages, _ = engine_pages("nhd", L, H, D, 4, 16, LAYOUT.torch_dtype)
    write_tokens(pages, kv, [0, 1, 2, 3])
    script = _answers(b"HTTP/1.1 200 OK", b'[{"status": "stored"}, {"status": "stored"}]',
                      lookups=b'{"matched": 0, "tiers": [], "durability": "durable", "present": ' + present + b"}",
                      headers=b"content-type: application/json\r\n")
    for mode in ("miss", "raise"):
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, on_unavailable=mode,
                                                         trust_env=False) as cache:
            calls = (lambda: cache.ingest(toks, kv),
                     lambda: cache.ingest_batch([cs.PagedRequest(toks, [0, 1, 2, 3])], pages)[0])
            for call in calls:
                if mode == "raise":
                    with pytest.raises(cs.RemoteUnavailable, match="not the CacheSeek server's"):
                        call()
                    continue
                got = call()
                assert (got.stored, got.present, got.failed) == (0, 0, 2), got
            assert not [r for r in front.requests if b" /v1/blocks" in r.split(b"\r\n", 1)[0]]


def _ingest_foreign_answer(script, toks, kv):
    """``ingest`` against a front answering ``script``: under ``on_unavailable="raise"`` a
    ``RemoteUnavailable`` naming an answer of no CacheSeek server; under ``"miss"`` its
    result and the client's stats."""
    from fake_http import FakeServer

    for mode in ("raise", "miss"):
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, trust_env=False,
                                                         on_unavailable=mode) as cache:
            if mode == "raise":
                with pytest.raises(cs.RemoteUnavailable, match="not the CacheSeek server's"):
                    cache.ingest(toks, kv)
            else:
                return cache.ingest(toks, kv), cache.client_stats()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("answer", [b'[{"status": "stored"}]', b'[{"status": "stored"}, {"status": "stored"}, '
                                    b'{"status": "stored"}]', b'[]', b'{}', b'["stored", "stored"]'],
                         ids=["one-for-two", "three-for-two", "none", "an-object", "not-reports"])
def test_a_write_answer_that_is_not_one_report_per_frame_is_an_outage(answer):
    """The reports of a POST are counted frame by frame (``ingest_batch`` gives each to its
    request by its place): a list of another length counted blocks never sent, or left
    sent ones uncounted and the next body's reports given to the wrong requests."""
    toks, kv = tokens_for(37, 2 * BLOCK), make_kv(2 * BLOCK, 37)
    lookups = b'{"matched": 0, "tiers": [], "present": [false, false], "durability": "durable"}'
    script = _answers(b"HTTP/1.1 200 OK", answer, lookups=lookups, headers=b"content-type: application/json\r\n")
    res, stats = _ingest_foreign_answer(script, toks, kv)
    assert (res.stored, res.present, res.failed) == (0, 0, 2) and "server" in res.errors
    assert stats["dropped_blocks"] == 2


@pytest.mark.parametrize("body", [b'"upstream down"', b'["upstream down"]', b"null", b"42"])
def test_an_error_answer_whose_json_is_not_an_object_is_still_the_error_it_says(body):
    """The reason of an error answer is its JSON's ``error``; a front's JSON of another kind
    (a string, a list) raised AttributeError, so a 503 was no outage and a 403 no RemoteError."""
    from fake_http import FakeServer

    toks = tokens_for(38, 2 * BLOCK)
    for status, error in ((b"503 Service Unavailable", cs.RemoteUnavailable), (b"403 Forbidden", cs.RemoteError)):
        for lookups in (None, b'{"matched": 2, "tiers": ["cpu", "cpu"]}'):  # the lookup's answer, the GET's
            script = _answers(b"HTTP/1.1 " + status, body, headers=b"content-type: application/json\r\n",
                              lookups=lookups)
            with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                             block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
                with pytest.raises(error) as info:
                    cache.materialize(toks)
                assert info.value.status == int(status[:3]) and info.value.reason == body.decode()


@pytest.mark.parametrize("status", [b"200 OK", b"403 Forbidden"])
def test_json_nested_too_deep_is_the_answer_of_no_server(status):
    """A body of a thousand ``[`` (1 KB) is JSON that ``json.loads`` gives up on with
    ``RecursionError``, not ``ValueError``: it escaped every call raw, past
    ``on_unavailable="miss"`` and the breaker. A 2xx one is no service, as any answer that
    is not the server's JSON; an error's reason is its text, as for any body not JSON."""
    from fake_http import FakeServer

    toks, kv = tokens_for(43, 2 * BLOCK), make_kv(2 * BLOCK, 43)
    deep = b"[" * 5000
    script = _answers(b"HTTP/1.1 " + status, deep, headers=b"content-type: application/json\r\n")
    for mode in ("miss", "raise"):
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, on_unavailable=mode,
                                                         trust_env=False) as cache:
            if status.startswith(b"403"):
                with pytest.raises(cs.RemoteError) as info:
                    cache.lookup(toks)
                assert info.value.status == 403 and info.value.reason.startswith("[[[")
            elif mode == "miss":
                assert cache.lookup(toks) == 0 and cache.prefetch(toks) is None
                assert cache.ingest(toks, kv).failed == 2
                assert cache.client_stats()["outages"] == 1
            else:
                for call in (lambda: cache.lookup(toks), cache.stats):
                    with pytest.raises(cs.RemoteUnavailable, match="not JSON"):
                        call()


@pytest.mark.parametrize("status", [b"200 OK", b"500 Internal Server Error", b"404 Not Found"])
def test_an_answer_that_does_not_decode_as_its_content_encoding_says_is_no_service(status):
    """The server never compresses; a front that answers ``Content-Encoding: gzip`` over a
    body that is not gzip made httpx's ``DecodingError`` escape every call, past
    ``on_unavailable="miss"`` (a worker's hot path with no ``try``) and the breaker. It is no
    service (``RemoteUnavailable``), as an answer that is not JSON is; a prefix GET's 404 is
    the eviction race whatever its body."""
    from fake_http import FakeServer

    toks, kv = tokens_for(39, 2 * BLOCK), make_kv(2 * BLOCK, 39)
    garbage = _answers(b"HTTP/1.1 " + status, b"\x1f\x8b not gzip at all",
                       headers=b"content-type: application/json\r\ncontent-encoding: gzip\r\n",
                       lookups=b'{"matched": 2, "tiers": ["cpu", "cpu"]}' if status.startswith(b"404") else None)

    def cache(front, mode):
        return cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                              on_unavailable=mode, trust_env=False)

    if status.startswith(b"404"):  # only the GET's answer is undecodable: the chain is gone, looked up again
        with FakeServer(garbage) as front, cache(front, "raise") as remote:
            assert remote.materialize(toks).num_tokens == 0
            assert remote.client_stats()["outages"] == 0
        return
    with FakeServer(garbage) as front, cache(front, "miss") as remote:
        assert remote.lookup(toks) == 0 and remote.materialize(toks).num_tokens == 0
        assert remote.prefetch(toks) is None and remote.ingest(toks, kv).failed == 2
        stats = remote.client_stats()
        assert stats["outages"] == 1 and "Content-Encoding" in stats["last_error"], stats
    with FakeServer(garbage) as front, cache(front, "raise") as remote:
        for call in (lambda: remote.lookup(toks), remote.stats):
            with pytest.raises(cs.RemoteUnavailable, match="Content-Encoding"):
                call()


@pytest.mark.parametrize("reply", [b"ICY 200 OK\r\n\r\n", None], ids=["not-http", "closed-unanswered"])
def test_a_prefix_get_answered_with_no_valid_http_is_an_outage_like_a_lookup(reply):
    """A GET whose reply is not HTTP, or that the connection ends before any answer, got no
    answer: an outage (raised by default, a miss under ``"miss"``, counted, the breaker
    told), as for a lookup. It was taken for a body cut short: an empty prefix, and an answer."""
    from fake_http import FakeServer

    toks = tokens_for(39, 2 * BLOCK)
    lookups = b'{"matched": 2, "tiers": ["cpu", "cpu"]}'

    def script(n: int, head: bytes):
        if b" /v1/lookup" in head.split(b"\r\n", 1)[0]:
            return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(lookups)).encode() + b"\r\n\r\n" + lookups), False
        return reply, True

    for mode in ("raise", "miss"):
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, trust_env=False,
                                                         on_unavailable=mode) as cache:
            if mode == "raise":
                with pytest.raises(cs.RemoteUnavailable, match="cannot reach"):
                    cache.materialize(toks)
            else:
                assert cache.materialize(toks).num_tokens == 0
            stats = cache.client_stats()
            assert stats["unavailable_calls"] == 1 and stats["breaker"]["consecutive_failures"] == 1


@pytest.mark.parametrize("namespace", ["é", "a b", "x" * 129, "a\r\nX-CacheSeek-Model: other", "tab\there", "team-a\n"])
def test_a_namespace_the_server_refuses_is_a_config_error_before_anything_is_sent(srv, namespace):
    """The namespace travels in a header that the server takes as 0-128 printable ASCII
    characters without spaces: any other raised UnicodeEncodeError, or went out as it was
    (every call a 400, or a CR LF writing a header line of its own into each request)."""
    with pytest.raises(cs.ConfigError, match="namespace"):
        _remote(srv, cs.Raw(), namespace=namespace)
    with _remote(srv, cs.Raw(), namespace="~ok.ns-1_!") as cache:
        assert cache.lookup(tokens_for(40, BLOCK)) == 0


@pytest.mark.parametrize("bad", [0, -1, "4", 2.5, True])
def test_a_pool_of_no_connections_is_a_config_error_not_an_outage(bad):
    """``max_connections=0`` made every call wait the pool timeout and fail as an outage
    (the breaker opened on a server that was up); the others raised ValueError or TypeError
    from the semaphore, or took 2.5 for a count of connections."""
    with pytest.raises(cs.ConfigError, match="max_connections"):
        cs.RemoteCache("http://127.0.0.1:9", model_id="m", layout=LAYOUT, block_tokens=BLOCK, max_connections=bad)


@pytest.mark.parametrize("token", ["s3cret\n", "s3cret\r\nX-CacheSeek-Namespace: other", "s3crét"])
def test_a_token_that_cannot_be_a_header_is_a_config_error_naming_it(srv, token):
    """A token read from a file keeps its newline: every request went out malformed, and the
    server's 400 ("malformed HTTP request") named no token; a non-ASCII one raised
    UnicodeEncodeError. The error names the token (not its value) when the client is made."""
    with pytest.raises(cs.ConfigError, match="^token: ") as info:
        _remote(srv, cs.Raw(), token=token)
    assert "s3cr" not in str(info.value)
    with _remote(srv, cs.Raw(), token="w") as cache:
        assert cache.lookup(tokens_for(41, BLOCK)) == 0


@pytest.mark.parametrize("answer", [b'{"started": true}', b"[]", b'{"started": true, "matched": "2", "blocks": 2, '
                                    b'"joined": 0}'], ids=["no-counts", "a-list", "a-string-count"])
def test_a_prefetch_answer_that_is_not_the_servers_is_an_outage(answer):
    """``prefetch`` is a scheduler's call (``prefetch_queued``): an answer of another shape
    raised KeyError or AttributeError there, where an outage is None under ``"miss"``."""
    from fake_http import FakeServer

    toks = tokens_for(42, 2 * BLOCK)
    script = _answers(b"HTTP/1.1 202 Accepted", answer, headers=b"content-type: application/json\r\n")
    for mode in ("miss", "raise"):
        with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                         block_tokens=BLOCK, timeout=5, trust_env=False,
                                                         on_unavailable=mode) as cache:
            if mode == "raise":
                with pytest.raises(cs.RemoteUnavailable, match="not the CacheSeek server's"):
                    cache.prefetch(toks)
            else:
                assert cache.prefetch(toks) is None
                assert cache.client_stats()["missed_prefetches"] == 1
    started = b'{"started": true, "matched": 2, "blocks": 1, "joined": 0, "reason": null}'
    with FakeServer(_answers(b"HTTP/1.1 202 Accepted", started)) as front, cs.RemoteCache(
            front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
            trust_env=False) as cache:
        got = cache.prefetch(toks)
        assert (got.matched, got.blocks, got.joined, got.on_server) == (2, 1, 0, True)


def test_a_prefetch_meeting_a_connection_closed_while_idle_is_sent_again_as_a_lookup_is():
    """The stale-connection race (the server gives up on a kept-alive connection just as the
    next request arrives) is answered by sending the request again on a new connection when
    it is idempotent. A prefetch is (a hint: a second one joins the first's promotions), but
    it was a POST not marked so: the race was an outage, counted and told to the breaker."""
    from fake_http import FakeServer

    toks = tokens_for(46, 2 * BLOCK)
    answer = b'{"started": true, "matched": 2, "blocks": 2, "joined": 0, "reason": null}'

    def script(n: int, head: bytes):
        if n % 2 == 1:  # every second request on a connection: closed unanswered
            return None, True
        return (b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(answer)).encode() + b"\r\n\r\n" + answer), False

    with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                     block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
        for _ in range(4):
            got = cache.prefetch(toks)
            assert got is not None and got.blocks == 2
        stats = cache.client_stats()
        assert stats["unavailable_calls"] == 0 and stats["outages"] == 0, stats
        assert front.connections > 1


def test_stats_from_a_front_that_is_not_the_server_is_an_outage_like_the_other_calls():
    """``stats()`` parsed its answer outside the breaker, with httpx: a front's page raised
    JSONDecodeError, where every other call's is ``RemoteUnavailable``."""
    from fake_http import FakeServer

    page = _answers(b"HTTP/1.1 200 OK", b"<html>maintenance</html>", headers=b"content-type: text/html\r\n")
    with FakeServer(page) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                   block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
        with pytest.raises(cs.RemoteUnavailable, match="not JSON"):
            cache.stats()
        assert cache.client_stats()["unavailable_calls"] == 1


@pytest.mark.parametrize("framing", ["sized", "chunked", "one-chunk"])
def test_an_endless_answer_is_not_read_whole(framing):
    """Every answer but a prefix's frames was read whole before its status was looked at: a
    peer that sends without end (a URL that names a file server, a broken front) took the
    worker's memory. A 2xx answer past ``ANSWER_BYTES`` is no server's (an outage); an
    error is read for its reason only, its connection dropped. ``one-chunk``: a chunked
    body of one chunk that declares more than is ever sent was read into memory whole
    before any of it was handed on, however far past the limit."""
    from fake_http import FakeServer

    from cacheseek.remote import ANSWER_BYTES, ERROR_BODY_BYTES, REASON_CHARS

    toks = tokens_for(40, 2 * BLOCK)
    size = 4 * ANSWER_BYTES
    unsent: list[int] = []

    def endless(status: bytes):
        def body():
            head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            head += b"content-length: %d\r\n\r\n" % size if framing == "sized" else b"transfer-encoding: chunked\r\n\r\n"
            yield head + (b"%x\r\n" % (1 << 40) if framing == "one-chunk" else b"")
            piece, left = b"x" * (1 << 20), size
            while left:
                yield piece if framing != "chunked" else b"%x\r\n%s\r\n" % (len(piece), piece)
                left -= len(piece)
                unsent[:] = [left]
            if framing == "chunked":
                yield b"0\r\n\r\n"
        return body()

    def script(status: bytes):
        def answer(n: int, head: bytes):
            return endless(status), True
        return answer

    for status, error in ((b"200 OK", cs.RemoteUnavailable), (b"500 Internal Server Error", cs.RemoteError)):
        for call in ("lookup", "stats"):
            unsent[:] = [size]
            with FakeServer(script(status)) as front, cs.RemoteCache(
                    front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, timeout=5,
                    trust_env=False) as cache:
                tracemalloc.start()
                try:
                    with pytest.raises(error) as info:
                        cache.lookup(toks) if call == "lookup" else cache.stats()
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
            assert peak < ANSWER_BYTES + (32 << 20), (status, call, peak)
            assert unsent[0] > 0, (status, call)  # the client stopped reading: the rest was never sent
            if error is cs.RemoteError:
                assert info.value.status == 500 and info.value.reason == "x" * REASON_CHARS
                assert peak < ERROR_BODY_BYTES + (32 << 20), (call, peak)
            else:
                assert "longer than" in str(info.value)


# -- a load from start fetches only the blocks past it ---------------------------------------------


def _sent(srv) -> int:
    return httpx.get(srv.url + "/v1/stats", headers={"authorization": "Bearer r"}).json()["frame_bytes_sent"]


def test_a_paged_load_from_start_streams_only_the_blocks_past_it(srv):
    """An engine holding the chain's first blocks in its own pages gets only the rest: the
    GET asks for them from ``start`` on (``?start=``), so the head's frames are no longer
    read and sent to be dropped. The pages written are the unranged load's, bit for bit;
    against a server that ignores the parameter (no answer header) the client drops the
    head itself."""
    from fake_http import FakeServer
    from paged_helpers import engine_pages, read_tokens, snapshot, unchanged

    codec = cs.KIVI(bits=4, group_size=32)
    T, start = 6 * BLOCK, 3 * BLOCK
    toks, kv = tokens_for(37, T), make_kv(T, 37)
    L, H, D, dtype = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
    table = list(range(11, -1, -1))  # 12 pages of 16 tokens, in reverse

    def load(cache, from_token):
        pages, tensors = engine_pages("nhd", L, H, D, 12, 16, dtype, seed=5)
        before = snapshot(tensors)
        sent = _sent(srv)
        got = cache.materialize_into_batch([cs.PagedRequest(toks, table, start=from_token)], pages)[0]
        return (got.num_tokens, got.num_blocks, got.tiers), pages, before, tensors, _sent(srv) - sent

    with _remote(srv, codec, namespace="ranged") as cache:
        assert cache.ingest(toks, kv).stored == 6
        whole, whole_pages, _, _, whole_bytes = load(cache, 0)
        ranged, pages, before, tensors, ranged_bytes = load(cache, start)
    assert whole == (T, 6, ["cpu"] * 6) and ranged == whole
    assert 0 < ranged_bytes < whole_bytes * 0.55  # 3 frames of 6
    own = table[: start // 16]
    assert unchanged([t[own] for t in before], [t[own] for t in tensors])  # the engine's own pages: untouched
    for (k, v), (wk, wv) in zip(read_tokens(pages, table, T), read_tokens(whole_pages, table, T)):
        assert torch.equal(k[:, start:], wk[:, start:]) and torch.equal(v[:, start:], wv[:, start:])
    lookup = b'{"matched": 6, "tiers": ["cpu", "cpu", "cpu", "cpu", "cpu", "cpu"]}'
    with FakeServer(_forwarding_front(srv, lookup, strip_query=True)) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=codec, block_tokens=BLOCK, token="w",
            namespace="ranged", timeout=5, trust_env=False) as older:
        fallback, _, _, fallback_tensors, fallback_bytes = load(older, start)
        assert "start=3" in front.requests[-1].split(b"\r\n", 1)[0].decode()
    assert fallback == whole and fallback_bytes == whole_bytes  # the whole chain came, its head dropped
    assert unchanged(tensors, fallback_tensors)


def test_a_prefix_get_from_start_answers_what_it_streams_and_refuses_bad_starts(srv):
    toks, kv = tokens_for(38, 5 * BLOCK), make_kv(5 * BLOCK, 38)
    with _remote(srv, cs.Raw(), namespace="start") as cache:
        assert cache.ingest(toks, kv).stored == 5
        hashes = cache.block_hashes(toks)
    auth = {"authorization": "Bearer r", "x-cacheseek-namespace": "start"}
    url = f"{srv.url}/v1/prefixes/{hashes[-1].hex()}"
    whole = httpx.get(url, headers=auth)
    assert whole.status_code == 200 and whole.headers["x-cacheseek-start"] == "0"
    got = httpx.get(url, params={"start": 3}, headers=auth)
    assert got.status_code == 200 and got.headers["x-cacheseek-blocks"] == "2" and got.headers["x-cacheseek-start"] == "3"
    frames = [httpx.get(f"{srv.url}/v1/blocks/{h.hex()}", headers=auth).content for h in hashes]
    assert int(got.headers["content-length"]) == len(got.content) == sum(8 + len(f) for f in frames[3:])
    assert got.content == b"".join(len(f).to_bytes(8, "little") + f for f in frames[3:])
    assert whole.content.endswith(got.content)
    last = httpx.get(url, params={"start": 4}, headers=auth)
    assert last.status_code == 200 and last.content == len(frames[4]).to_bytes(8, "little") + frames[4]
    sent = _sent(srv)
    for bad in ("-1", "x", "1.0", " 1", "+1", "1_0", "\u0663", "", "5", "99", "9" * 5000):
        r = httpx.get(url, params={"start": bad}, headers=auth)
        assert r.status_code == 400 and r.json()["error"].startswith("start: "), (bad, r.status_code, r.text[:200])
    assert _sent(srv) == sent  # nothing streamed
    # An incomplete chain is a 404 whatever the start.
    gone = httpx.delete(f"{srv.url}/v1/blocks/{hashes[1].hex()}", headers={**auth, "authorization": "Bearer w"})
    assert gone.status_code == 204
    assert httpx.get(url, params={"start": 3}, headers=auth).status_code == 404


def test_a_wait_for_a_pooled_connection_is_not_the_servers_outage(srv):
    """More calls at once than ``max_connections``: one that waits past its timeout for a
    connection of this client's pool raises ``PoolExhausted`` (a miss under ``"miss"``).
    The server is up: it was counted as an outage, three opened the breaker, and every
    call after them was refused though the server answered."""
    toks, kv = tokens_for(39, 2 * BLOCK), make_kv(2 * BLOCK, 39)
    for mode in ("raise", "miss"):
        with _remote(srv, cs.Raw(), namespace="pool", max_connections=1, timeout=0.2,
                     on_unavailable=mode) as cache:
            assert cache.ingest(toks, kv).failed == 0
            with cache._http.stream("GET", "/v1/stats"):  # the pool's one connection, held
                for _ in range(4):
                    if mode == "raise":
                        with pytest.raises(cs.PoolExhausted, match="max_connections"):
                            cache.lookup(toks)
                    else:
                        assert cache.lookup(toks) == 0
            stats = cache.client_stats()
            assert stats["pool_timeouts"] == 4 and stats["outages"] == stats["unavailable_calls"] == 0, stats
            assert stats["breaker"]["state"] == "closed" and stats["breaker"]["consecutive_failures"] == 0
            assert cache.lookup(toks) == 2 * BLOCK  # the connection given back: served at once


def test_a_chain_gone_before_its_get_keeps_the_connection_alive(srv, monkeypatch):
    """A 404 for a chain evicted between the lookup and the GET (the eviction race) leaves
    the connection in the pool: its small error body is read, where it was left unread and
    the connection closed, so every race cost a new connection."""
    toks, kv = tokens_for(41, 3 * BLOCK), make_kv(3 * BLOCK, 41)
    with _remote(srv, cs.Raw(), namespace="race404") as cache:
        assert cache.ingest(toks, kv).stored == 3
        hashes = cache.block_hashes(toks)
    assert httpx.delete(f"{srv.url}/v1/blocks/{hashes[-1].hex()}", headers={"authorization": "Bearer w",
                                                                            "x-cacheseek-namespace": "race404"}
                        ).status_code == 204
    relay = _Relay(srv.port)
    try:
        with cs.RemoteCache(relay.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                            token="w", namespace="race404", max_connections=1, trust_env=False) as cache:
            for _ in range(3):
                assert cache._stream_chain(hashes) is None  # the whole chain asked for: a 404
                assert_prefix_equal(cache.materialize(toks), kv, 2 * BLOCK)
            assert cache.lookup(toks) == 2 * BLOCK
    finally:
        relay.close()
    assert relay.accepted == 1


def test_every_call_after_close_raises_one_clear_error(srv):
    """After ``close()`` lookups and ingests still went out (straight to the transport),
    while materialize, prefetch and stats raised httpx's RuntimeError about its client;
    a call of no blocks answered as if open. Every call raises the same error now, under
    ``on_unavailable="miss"`` too, sends nothing, and counts no outage."""
    from paged_helpers import engine_pages

    toks, kv = tokens_for(42, 2 * BLOCK), make_kv(2 * BLOCK, 42)
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    pages, _ = engine_pages("nhd", L, H, D, 8, 16, LAYOUT.torch_dtype)
    for mode in ("raise", "miss"):
        cache = _remote(srv, cs.Raw(), namespace="closed", on_unavailable=mode)
        writer = cache.ingest_batch([cs.PagedRequest(toks, [0, 1, 2, 3])], pages, layerwise=True)
        cache.close()
        calls = {"lookup": lambda: cache.lookup(toks), "locate": lambda: cache.locate(toks),
                 "lookup of nothing": lambda: cache.lookup(toks[: BLOCK - 1]),
                 "ingest": lambda: cache.ingest(toks, kv), "materialize": lambda: cache.materialize(toks),
                 "prefetch": lambda: cache.prefetch(toks), "stats": cache.stats,
                 "ingest_batch": lambda: cache.ingest_batch([cs.PagedRequest(toks, [0, 1, 2, 3])], pages),
                 "materialize_into": lambda: cache.materialize_into(toks, pages.at([4, 5, 6, 7])),
                 "materialize_into_batch": lambda: cache.materialize_into_batch(
                     [cs.PagedRequest(toks, [4, 5, 6, 7])], pages),
                 # (a writer was handed out, and raised only on finish, after the forward had put every layer)
                 "ingest_layerwise": lambda: cache.ingest_layerwise(toks),
                 "materialize layer-wise": lambda: cache.materialize(toks, layerwise=True)}
        for name, call in calls.items():
            with pytest.raises(RuntimeError, match=r"^RemoteCache: closed") as info:
                call()
            assert not isinstance(info.value, cs.CacheSeekError), name
        for i in range(L):
            writer.put_layer(i)
        with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
            writer.finish()
        stats = cache.client_stats()  # this client's own figures: still there
        assert stats["outages"] == stats["unavailable_calls"] == 0 and stats["breaker"]["state"] == "closed"
        cache.close()  # again: nothing to do
    with _remote(srv, cs.Raw(), namespace="closed") as cache:
        assert cache.lookup(toks) == 0  # nothing was sent


# -- faults mid-call: a front that stops forwarding, then cuts the connection ---------------


class _StallingFront:
    """A relay on loopback in front of a real server that forwards every byte until a
    request holding ``marker`` has gone through it; from then on it stops forwarding one
    direction (``"down"``: the answer, ``"up"``: the request's body) after ``after`` bytes
    counted from that request on, sets ``stalled``, and, once ``cut()`` is called, closes both sides. One thread
    per connection (select), so a stall holds only that connection."""

    def __init__(self, upstream_port: int, marker: bytes, *, after: int, direction: str = "down",
                 hold: bool = True) -> None:
        """``hold=False``: cut at once, without a stall. ``head_bytes``: the length of the
        last answer's head after the marked request (``direction="down"``)."""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream_port, self.marker, self.after, self.direction = upstream_port, marker, after, direction
        self.hold, self.head_bytes = hold, 0
        self.stalled, self._cut = threading.Event(), threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        import selectors

        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, ("up", upstream))
        sel.register(upstream, selectors.EVENT_READ, ("down", client))
        armed, counted = False, 0
        try:
            while True:
                for key, _ in sel.select():
                    direction, dst = key.data
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    if direction == "up" and self.marker in data:
                        armed, counted = True, 0  # (counted from the last such request on the connection)
                    if armed and direction == self.direction:
                        if counted == 0 and direction == "down":
                            self.head_bytes = data.find(b"\r\n\r\n") + 4  # (uvicorn sends a head whole)
                        if counted + len(data) > self.after:
                            dst.sendall(data[: self.after - counted])
                            self.stalled.set()
                            if self.hold:
                                self._cut.wait(30)
                            return
                        counted += len(data)
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                s.close()

    def cut(self) -> None:
        self._cut.set()

    def __enter__(self) -> _StallingFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self.listener.close()


def _until(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.005)


def test_close_while_a_read_is_in_flight_keeps_counting_its_buffers(srv):
    """``close()`` swapped both buffer pools for new, empty ones: a read still in flight
    went on holding buffers of the old pool, which ``client_stats()`` no longer showed (0
    leases active while it held some, every count back at 0), so a lease a call failed to
    give back after a close could not be seen. The counts go on through the close; the
    buffers kept for reuse are let go, and those still lent are dropped when given back."""
    toks, kv = tokens_for(130, 8 * BLOCK), make_kv(8 * BLOCK, 130)
    with _remote(srv, cs.Raw(), namespace="close-in-flight") as writer:
        assert writer.ingest(toks, kv).stored == 8
    payload = max(part.planned_payload().nbytes for part in writer.block_format.parts())
    # Two frames whole (each a header longer than its payload), the third begun.
    with _StallingFront(srv.port, b"GET /v1/prefixes", after=3 * payload) as front:
        cache = cs.RemoteCache(front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                               namespace="close-in-flight", token="w", timeout=10, trust_env=False)
        assert_prefix_equal(cache.materialize(toks[: 2 * BLOCK]), kv, 2 * BLOCK)  # two buffers kept for reuse
        got: list = []

        def read() -> None:
            try:
                got.append(cache.materialize(toks))
            except RuntimeError as exc:
                got.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        front.stalled.wait(10)
        _until(lambda: cache.client_stats()["read_buffers"]["leases_active"] >= 3)
        before = cache.client_stats()["read_buffers"]
        cache.close()  # (which cuts the read under way: it gives its buffers back as it ends)
        during = cache.client_stats()["read_buffers"]
        assert during["leases_active"] <= before["leases_active"], during
        assert during["leases_granted"] == before["leases_granted"] and during["buffers_free"] == 0, during
        reader.join(10)
    assert got and isinstance(got[0], RuntimeError) and str(got[0]).startswith("RemoteCache: closed"), got
    after = cache.client_stats()["read_buffers"]
    assert after["leases_active"] == 0 and after["buffers_free"] == 0 and after["lease_double_releases"] == 0, after


def test_a_call_that_meets_a_close_from_another_thread_raises_the_closed_error(srv):
    """A call past its check that the cache is open when another thread closed it (here,
    while the breaker let it through) went on into the closed httpx client and raised its
    RuntimeError ("Cannot send a request, as the client has been closed"), or, for a
    lookup, was sent anyway on a connection made after the close. It raises the error every
    call after ``close()`` raises, and sends nothing."""
    toks, kv = tokens_for(131, 2 * BLOCK), make_kv(2 * BLOCK, 131)
    with _remote(srv, cs.Raw(), namespace="close-race") as writer:
        assert writer.ingest(toks, kv).stored == 2

    class ClosingBreaker(CircuitBreaker):
        """Closes the cache from another thread the first time a call is let through."""

        cache = None

        def allow_call(self):
            cache, type(self).cache = type(self).cache, None
            if cache is not None:
                closer = threading.Thread(target=cache.close)
                closer.start()
                closer.join(10)
            return super().allow_call()

    calls = {"stats": lambda c: c.stats(), "prefetch": lambda c: c.prefetch(toks),
             "lookup": lambda c: c.lookup(toks), "materialize": lambda c: c.materialize(toks)}
    for name, call in calls.items():
        cache = _remote(srv, cs.Raw(), namespace="close-race", breaker=ClosingBreaker())
        ClosingBreaker.cache = cache
        with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
            call(cache)
        assert cache.client_stats()["unavailable_calls"] == 0, name


def test_close_ends_a_load_another_thread_has_under_way_at_once(srv):
    """``close()`` cut only its own queued writes' exchanges: a load on another thread (an
    engine's loader) held by a front that stopped forwarding went on until its read timeout
    or ``exchange_timeout`` (600 s by default), and Python's exit, which joins an executor's
    threads, waited for it. The load now ends as close() does, with the closed error (no
    outage counted: the server did not fail), as does every call after; close() again is a
    no-op."""
    from concurrent.futures import ThreadPoolExecutor

    toks, kv = tokens_for(133, 8 * BLOCK), make_kv(8 * BLOCK, 133)
    with _remote(srv, cs.Raw(), namespace="close-cuts") as writer:
        assert writer.ingest(toks, kv).stored == 8
    payload = max(part.planned_payload().nbytes for part in writer.block_format.parts())
    with _StallingFront(srv.port, b"GET /v1/prefixes", after=3 * payload) as front:
        cache = cs.RemoteCache(front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                               namespace="close-cuts", token="w", timeout=60, exchange_timeout=120,
                               on_unavailable="miss", trust_env=False)
        loader = ThreadPoolExecutor(1, thread_name_prefix="loader")
        try:
            load = loader.submit(cache.materialize, toks)
            assert front.stalled.wait(10)
            start = time.monotonic()
            cache.close()
            with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
                load.result(timeout=10)  # (the old code: still reading 60 s on)
            assert time.monotonic() - start < 10
        finally:
            front.cut()
            loader.shutdown(wait=True)
        stats = cache.client_stats()
        assert stats["outages"] == stats["unavailable_calls"] == 0 and stats["breaker"]["state"] == "closed", stats
        assert stats["read_buffers"]["leases_active"] == 0
        with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
            cache.lookup(toks)
        cache.close()


def test_close_ends_a_call_another_thread_has_still_connecting(monkeypatch):
    """A call still connecting (its name's lookup hung: a dead resolver) was not cut by
    ``close()``: it went on for its whole connect timeout, and held the process's exit so.
    It ends within a tenth of a second of close() now, with the closed error."""
    real, asked = socket.getaddrinfo, threading.Event()

    def hung(host, port, family=0, type=0, proto=0, flags=0):
        if host == "hung-dns.invalid" and not flags & socket.AI_NUMERICHOST:
            asked.set()
            time.sleep(30)
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    cache = cs.RemoteCache("http://hung-dns.invalid:8080", model_id="m", layout=LAYOUT, codec=cs.Raw(),
                           block_tokens=BLOCK, timeout=20, trust_env=False)
    with ThreadPoolExecutor(1) as loader:
        call = loader.submit(cache.lookup, tokens_for(1, 2 * BLOCK))
        assert asked.wait(10)
        start = time.monotonic()
        cache.close()
        with pytest.raises(RuntimeError, match=r"^RemoteCache: closed"):
            call.result(timeout=15)  # (the old code: on for the whole 20 s connect timeout)
        assert time.monotonic() - start < 5
    assert cache.client_stats()["outages"] == 0


def test_a_prefix_answer_cut_at_any_byte_gives_the_frames_whole_before_it_and_every_buffer_back(srv):
    """A prefix answer whose connection ends (a server killed, a front gone) in its head,
    at each frame boundary, inside each length prefix and inside each frame: a head cut
    short is an outage (a miss here); otherwise the prefix is the frames whole before the
    cut, their KV exact, and every read buffer comes back."""
    toks, kv = tokens_for(132, 3 * BLOCK), make_kv(3 * BLOCK, 132)
    with _remote(srv, cs.Raw(), namespace="cuts") as writer:
        assert writer.ingest(toks, kv).stored == 3
    breaker = CircuitBreaker(failure_threshold=1000, backoff=ConstantBackoff(0.01))
    with _StallingFront(srv.port, b"GET /v1/prefixes", after=1 << 30, hold=False) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, namespace="cuts",
            token="w", timeout=5, trust_env=False, on_unavailable="miss", breaker=breaker) as cache:
        assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
        head = front.head_bytes
        answer = httpx.get(f"{srv.url}/v1/prefixes/{cs.hashing.to_hex(cache.block_hashes(toks)[-1])}",
                           headers={"Authorization": "Bearer r", "X-CacheSeek-Namespace": "cuts"})
        frames = split_batch(answer.content)
        assert answer.status_code == 200 and len(frames) == 3
        cuts = {0: 0, head // 2: 0, head - 1: 0, head: 0, head + 3: 0}
        end = head
        for k, frame in enumerate(frames):  # (inside the length prefix, inside the frame, at its end)
            cuts.update({end + 4: k, end + 8 + len(frame) // 2: k, end + 8 + len(frame) - 1: k})
            end += 8 + len(frame)
            cuts[end] = k + 1
        for after, blocks in sorted(cuts.items()):
            front.after = after
            got = cache.materialize(toks)
            assert got.num_blocks == blocks, (after, got.num_blocks)
            assert_prefix_equal(got, kv, blocks * BLOCK)
            assert cache.client_stats()["read_buffers"]["leases_active"] == 0, after
        assert cache.client_stats()["read_buffers"]["lease_double_releases"] == 0


def test_a_prefix_answer_cut_mid_body_is_counted_and_said_once_not_an_outage(srv, caplog):
    """A materialize whose answer's connection ended mid-body returned the shorter prefix
    with nothing in ``client_stats()`` to say so: a front cutting every large answer (a
    proxy's body limit) took the hit rate to near zero unseen. Each cut is counted in
    ``cut_answers`` and logged, once a minute at most; it is no outage, and the breaker
    stays closed (the server answered, and what came is used)."""
    toks, kv = tokens_for(134, 3 * BLOCK), make_kv(3 * BLOCK, 134)
    with _remote(srv, cs.Raw(), namespace="cut-count") as writer:
        assert writer.ingest(toks, kv).stored == 3
    payload = max(part.planned_payload().nbytes for part in writer.block_format.parts())
    with _StallingFront(srv.port, b"GET /v1/prefixes", after=1 << 30, hold=False) as front, cs.RemoteCache(
            front.url, model_id="parity", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, namespace="cut-count",
            token="w", timeout=5, trust_env=False, on_unavailable="miss") as cache:
        assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
        assert cache.client_stats()["cut_answers"] == 0  # a whole answer
        front.after = front.head_bytes + 2 * payload  # the first frame whole, the second begun
        with caplog.at_level("WARNING", logger="cacheseek.remote"):
            for _ in range(3):
                got = cache.materialize(toks)
                assert got.num_blocks == 1
                assert_prefix_equal(got, kv, BLOCK)
        stats = cache.client_stats()
        assert stats["cut_answers"] == 3 and stats["outages"] == stats["unavailable_calls"] == 0, stats
        assert stats["breaker"]["state"] == "closed"
        said = [r.getMessage() for r in caplog.records if "cut_answers" in r.getMessage()]
        assert len(said) == 1 and "ended after 1 whole frames" in said[0], said


_GOOD_LOOKUP = {"matched": 0, "tiers": [], "present": [False, False], "durability": "durable"}


@pytest.mark.parametrize("lookup, reports", [
    (_GOOD_LOOKUP, [{"status": "stored", "errors": ["disk"]}] * 2),
    (_GOOD_LOOKUP, [{"status": "stored", "errors": -1}] * 2),
    (_GOOD_LOOKUP, [{"status": "failed", "errors": {"disk": {"why": 1}}}] * 2),
    (_GOOD_LOOKUP, [{"status": ["stored"]}] * 2),
    (_GOOD_LOOKUP, [{"status": "stored", "durability": {"level": "durable"}}] * 2),
    ({**_GOOD_LOOKUP, "durability": ["durable"]}, [{"status": "stored"}] * 2),
    ({"matched": 2, "tiers": [{"name": "cpu"}, None], "present": [True, True]}, [{"status": "stored"}] * 2),
], ids=["errors-a-list", "errors-a-number", "errors-reason-a-map", "status-a-list", "durability-a-map",
        "lookup-durability-a-list", "tiers-not-names"])
def test_a_write_answer_of_the_right_length_but_another_shape_is_an_outage(lookup, reports):
    """A POST's reports were checked to be one map per frame, not what the maps hold: errors
    as a list (or a number) raised AttributeError out of ``ingest``, past
    ``on_unavailable="miss"``; a durability or a tier that is no name was handed to the
    caller as the server's word. Each is an answer of no CacheSeek server."""
    import json

    toks, kv = tokens_for(46, 2 * BLOCK), make_kv(2 * BLOCK, 46)
    script = _answers(b"HTTP/1.1 200 OK", json.dumps(reports).encode(), lookups=json.dumps(lookup).encode(),
                      headers=b"content-type: application/json\r\n")
    res, _ = _ingest_foreign_answer(script, toks, kv)
    assert (res.stored, res.present, res.failed) == (0, 0, 2) and "server" in res.errors, res
    assert res.durability == "durable"


@pytest.mark.parametrize("named", ["9" * 5000, "0"], ids=["5000-digits", "zero"])
def test_a_413_naming_a_limit_no_server_has_is_taken_as_naming_none(named):
    """A 413 for a body's size names the server's max_body_bytes, which the client takes as
    its own. The number was read whole: 5000 digits raised ValueError out of ``ingest``
    (int() refuses 4,300), and 0 made every later ingest a ConfigError. Such a 413 names no
    limit: the body goes again halved, as after a proxy's 413."""
    import json

    from fake_http import FakeServer

    toks, kv = tokens_for(49, 2 * BLOCK), make_kv(2 * BLOCK, 49)
    lookups = b'{"matched": 0, "tiers": [], "present": [false, false], "durability": "durable"}'
    posts: list[int] = []

    def script(n: int, head: bytes):
        if b" /v1/lookup" in head.split(b"\r\n", 1)[0]:
            body = lookups
        else:
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            posts.append(length)
            if len(posts) == 1:
                error = json.dumps({"error": f"body of {length} bytes exceeds max_body_bytes ({named})"}).encode()
                return (b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\ncontent-length: "
                        + str(len(error)).encode() + b"\r\n\r\n" + error), True
            body = json.dumps([{"status": "stored"}] * (1 if length < posts[0] else 2)).encode()
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body), False

    with FakeServer(script) as front, cs.RemoteCache(front.url, model_id="m", layout=LAYOUT, codec=cs.Raw(),
                                                     block_tokens=BLOCK, timeout=5, trust_env=False) as cache:
        res = cache.ingest(toks, kv)
        assert (res.stored, res.failed) == (2, 0), res
        assert len(posts) == 3 and posts[1] + posts[2] == posts[0]  # the refused body, then one frame a body
        assert 0 < cache.max_body_bytes < posts[0]
        assert cache.ingest(toks, kv).stored == 2  # (the limit halved, not 0: later calls still send)


def test_check_token_says_a_token_the_server_refuses_and_changes_nothing(tmp_path):
    """A token the server refused failed every call after it, each an outage to the caller
    (the vLLM connector logged each, and computed everything): ``check_token`` asks once, by
    a delete (or a read) of a block no one stored."""
    with Server(tmp_path, "--write-token", "w", "--read-token", "r", disk=False) as srv:
        def remote(token):
            return cs.RemoteCache(srv.url, model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                                  token=token)

        with remote("w") as c:
            c.check_token(write=True)
            c.check_token(write=False)
            assert c.client_stats()["breaker"]["consecutive_failures"] == 0
        with remote("r") as c:
            c.check_token(write=False)
            with pytest.raises(cs.ConfigError, match=rf"^token: {srv.url} refused it to write \(HTTP 403: "):
                c.check_token(write=True)
        with remote(None) as c, pytest.raises(cs.ConfigError, match=r"refused it to read \(HTTP 401: .*; it needs one$"):
            c.check_token(write=False)
        with remote("wrong") as c, pytest.raises(cs.ConfigError, match=r"refused it to write \(HTTP 40[13]"):
            c.check_token()
        assert httpx.get(srv.url + "/v1/stats", headers={"Authorization": "Bearer r"}).json()["blocks"] == 0
    with socket.socket() as s:  # nothing listening: no error here (the calls say an outage)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with cs.RemoteCache(f"http://127.0.0.1:{port}", model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                        token="w", timeout=2) as c:
        c.check_token()
        assert c.client_stats()["breaker"]["consecutive_failures"] == 0


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


TINY = cs.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")


def test_a_long_chain_of_small_frames_is_read_into_slabs_not_a_mapping_a_frame(srv):
    """A world model's long chain of small blocks: each frame read took a mapping of its
    own, and a chain past ~65k frames passed vm.max_map_count (65,530): mmap failed with
    ENOMEM out of materialize, a raw OSError. Now small frames are pieces of shared slabs."""
    n = 3000
    ids, kv = torch.arange(n), [(torch.randn(1, n, 8).half(), torch.randn(1, n, 8).half())]
    with cs.RemoteCache(srv.url, model_id="long-chain", layout=TINY, codec=cs.Raw(), block_tokens=1,
                        token="w", trust_env=False) as cache:
        assert cache.ingest(ids, kv).stored == n
        before = _mappings()
        got = cache.materialize(ids)
        grew = _mappings() - before
        assert got.num_tokens == n
        assert_prefix_equal(got, kv, n)
        assert grew < 100, f"{grew} mappings more after reading {n} frames"
        stats = _read_buffers(cache)
        assert stats["buffers_made"] == n and stats["leases_active"] == 0


def test_read_buffers_of_small_frames_are_found_again_without_a_scan(srv):
    """The pool found its best fit by a scan of every free buffer: a long chain read after
    another (its ~65k buffers kept) took minutes, and the server cut the stalled stream."""
    with _remote(srv, cs.Raw()) as cache:
        pool = cache._read_buffers
        before = _mappings()
        leases = [pool.take(64 + i % 4000) for i in range(30_000)]
        assert _mappings() - before < 100
        for lease in leases:
            lease.release()
        started = time.monotonic()
        leases = [pool.take(64 + i % 4000) for i in range(30_000)]
        assert time.monotonic() - started < 30  # (a scan: ~30,000 x 30,000 steps, minutes)
        assert pool.stats()["buffers_made"] == 30_000
        for lease in leases:
            lease.release()


def test_a_read_that_finds_no_host_memory_ends_the_prefix_with_a_warning(srv, caplog):
    toks, kv = tokens_for(94, 4 * BLOCK), make_kv(4 * BLOCK, 94)
    with _remote(srv, cs.Raw(), namespace="no-memory") as cache:
        assert cache.ingest(toks, kv).stored == 4
        real, taken = cache._read_buffers.take, []

        def take(nbytes):
            if len(taken) == 2:
                raise OSError(12, "Cannot allocate memory")
            taken.append(nbytes)
            return real(nbytes)

        cache._read_buffers.take = take
        with caplog.at_level("WARNING", logger="cacheseek.remote"):
            got = cache.materialize(toks)
        assert got.num_tokens == 2 * BLOCK
        assert_prefix_equal(got, kv, 2 * BLOCK)
        assert any("no host memory" in r.getMessage() for r in caplog.records)
        assert _read_buffers(cache)["leases_active"] == 0


def test_a_write_of_many_small_blocks_goes_in_bodies_of_a_bounded_frame_count(srv, monkeypatch):
    """Bodies were cut by bytes only: 150,000 small blocks were one body a server with a disk
    tier answered after ~190 s, past the client's read timeout (an outage, the breaker open)
    while it stored every block. Cut at MAX_BODY_FRAMES too (made small here)."""
    from cacheseek import remote as remote_module

    monkeypatch.setattr(remote_module, "MAX_BODY_FRAMES", 64, raising=False)
    n = 200
    ids, kv = torch.arange(n), [(torch.randn(1, n, 8).half(), torch.randn(1, n, 8).half())]
    with cs.RemoteCache(srv.url, model_id="many-bodies", layout=TINY, codec=cs.Raw(), block_tokens=1,
                        token="w", trust_env=False) as cache:
        bodies, post = [], cache._post_body
        cache._post_body = lambda frames, total: bodies.append(len(frames)) or post(frames, total)
        result = cache.ingest(ids, kv)
        assert result.stored == n and result.failed == 0
        assert bodies == [64, 64, 64, 8]
        assert cache.lookup(ids) == n
        assert_prefix_equal(cache.materialize(ids), kv, n)
