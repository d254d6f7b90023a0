"""``RemoteCache`` against a real `cacheseek serve`: the same scenarios as ``PrefixCache``, the
same results."""

from __future__ import annotations

import httpx
import pytest
import torch

import cacheseek as cs
from server_helpers import Server
from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for


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
    for name, call in (("nan", lambda: cache.ingest(bad_toks, nan_kv)),
                       ("short keys", lambda: cache.ingest(bad_toks[:-1], make_kv(2 * BLOCK, 5))),
                       ("empty", lambda: cache.lookup([]))):
        with pytest.raises(cs.InputError) as info:
            call()
        out.append((name, type(info.value).__name__, str(info.value)))
    out.append(("after bad input", cache.lookup(bad_toks)))
    stats = cache.stats()
    # The server adds its own figures (traffic, requests, usage per namespace: docs/operations.md).
    server_only = {"frame_bytes_received", "frame_bytes_sent", "frames_rejected", "lookup_latency", "metrics_detail",
                   "namespaces", "recovery", "requests", "started_at", "traffic", "uptime_seconds", "version"}
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
