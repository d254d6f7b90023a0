"""The shell tools and the vLLM connector against the README's TLS server (``cacheseek serve
--tls-cert --tls-key``) whose certificate a private CA signed: each takes that CA's bundle
(``--cacert FILE``; the connector's ``ca_bundle`` key), and without it says what to do.
They had no way to trust it but the undocumented SSL_CERT_FILE."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess

import pytest

from server_helpers import Server, cacheseek_command, write_tls_files

ADMIN = "adm1n-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    import ssl

    root = write_tls_files(tmp_path_factory.mktemp("tls"))
    (root / "junk.pem").write_text("not a certificate\n")
    verify = ssl.create_default_context(cafile=str(root / "ca.pem"))
    with Server(root / "srv", "--tls-cert", str(root / "cert.pem"), "--tls-key", str(root / "key.pem"),
                "--admin-token", ADMIN, "--write-token", "w", verify=verify) as srv:
        yield root, srv


def _cli(*args: str) -> subprocess.CompletedProcess:
    # (no SSL_CERT_FILE from the caller: the test is of --cacert)
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    return subprocess.run([*cacheseek_command(), *args], capture_output=True, text=True, timeout=60, env=env)


def test_top_and_admin_trust_the_servers_ca_given_by_cacert(tls):
    root, srv = tls
    ca = str(root / "ca.pem")
    top = _cli("top", "--url", srv.url, "--token", "w", "--once", "--cacert", ca)
    assert top.returncode == 0 and "hit rate" in top.stdout, top.stderr
    admin = _cli("admin", "--url", srv.url, "--token", ADMIN, "--cacert", ca, "namespaces")
    assert admin.returncode == 0, admin.stderr
    after = _cli("admin", "pins", "--url", srv.url, "--token", ADMIN, "--cacert", ca)  # (after the command too)
    assert after.returncode == 0, after.stderr
    # Without it: refused, and told what to do (it said only "certificate verify failed").
    top = _cli("top", "--url", srv.url, "--token", "w", "--once")
    assert top.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in top.stderr, top.stderr
    assert "give --cacert FILE" in top.stderr and "SSL_CERT_FILE" in top.stderr, top.stderr
    admin = _cli("admin", "--url", srv.url, "--token", ADMIN, "namespaces")
    assert admin.returncode == 3 and "give --cacert FILE" in admin.stderr and "SSL_CERT_FILE" in admin.stderr, admin
    # A bundle that is not one: exit 2, named, nothing asked.
    for bad, said in ((root / "missing.pem", "no file at"), (root / "junk.pem", "not a readable PEM bundle")):
        for cmd in (["top", "--url", srv.url, "--token", "w", "--once"],
                    ["admin", "--url", srv.url, "--token", ADMIN, "namespaces"]):
            done = _cli(*cmd, "--cacert", str(bad))
            assert done.returncode == 2 and "--cacert" in done.stderr and said in done.stderr, (cmd, done.stderr)


def test_demo_checks_an_https_url_with_its_cacert(tls, monkeypatch):
    pytest.importorskip("torch")
    from cacheseek.integrations import demo

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    root, srv = tls
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)

    def problem(*args: str) -> str | None:
        return demo._device_error(parser.parse_args(["--url", srv.url, "--token", "w", *args]))

    assert problem("--cacert", str(root / "ca.pem")) is None
    said = problem()
    assert said and "CERTIFICATE_VERIFY_FAILED" in said and "give --cacert FILE" in said and "SSL_CERT_FILE" in said
    assert "no file at" in (problem("--cacert", str(root / "missing.pem")) or "")
    assert "not a readable PEM bundle" in (problem("--cacert", str(root / "junk.pem")) or "")
    plain = demo._device_error(parser.parse_args(["--url", "http://127.0.0.1:1", "--cacert", str(root / "ca.pem")]))
    assert plain and "--cacert: only an https:// --url" in plain
    # and the cache the demo opens verifies with it
    import cacheseek as cs
    from store_helpers import LAYOUT, make_kv, tokens_for

    args = parser.parse_args(["--url", srv.url, "--token", "w", "--cacert", str(root / "ca.pem")])
    cache = demo.open_cache(args, LAYOUT, cs.Raw(), "demo-tls")
    try:
        assert cache.ingest(tokens_for(3, args.block_tokens), make_kv(args.block_tokens, 3)).stored == 1
    finally:
        cache.close()


def test_the_vllm_connector_trusts_the_ca_bundle_its_config_names(tls, caplog):
    pytest.importorskip("torch")
    import cacheseek as cs
    from cacheseek.errors import ConfigError
    from cacheseek.integrations.vllm.config import ConnectorConfig
    from cacheseek.integrations.vllm.guard import StoreGuard
    from cacheseek.integrations.vllm.stores import check_at_start, close_cache, open_cache
    from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

    root, srv = tls
    toks, kv = tokens_for(5, 2 * BLOCK), make_kv(2 * BLOCK, 5)
    extra = {"codec": "raw", "url": srv.url, "token": "w", "block_tokens": BLOCK}
    config = ConnectorConfig.from_extra({**extra, "ca_bundle": str(root / "ca.pem")})
    cache = open_cache(config, LAYOUT, "vllm-tls", cs.Shard())
    try:
        check_at_start(cache, write=True)
        assert cache.ingest(toks, kv).stored == 2 and cache.lookup(toks) == 2 * BLOCK
    finally:
        close_cache(config, cache)
    for bad, said in ((root / "missing.pem", "no file at"), (root / "junk.pem", "not a readable PEM bundle")):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.ca_bundle: .*{said}"):
            ConnectorConfig.from_extra({**extra, "ca_bundle": str(bad)})
    with pytest.raises(ConfigError, match="ca_bundle: only a remote cache"):
        ConnectorConfig.from_extra({"ca_bundle": str(root / "ca.pem")})
    with pytest.raises(ConfigError, match="ca_bundle: must be a string"):
        ConnectorConfig.from_extra({**extra, "ca_bundle": 1})
    # Without it the engine's start says so, naming the key (it started, and every call after
    # failed, each a miss); and a failure the connector logs says which key to give.
    config = ConnectorConfig.from_extra(extra)
    cache = open_cache(config, LAYOUT, "vllm-tls", cs.Shard())
    try:
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.ca_bundle: the TLS certificate of "
                                              r"https://127\.0\.0\.1:\d+ is not trusted by this client"):
            check_at_start(cache, write=True)
        with pytest.raises(cs.RemoteUnavailable) as refused:
            cache.lookup(toks)
    finally:
        close_cache(config, cache)
    with caplog.at_level(logging.WARNING, logger="cacheseek.integrations.vllm"):
        StoreGuard(config, "scheduler").failure("lookup", refused.value)
    assert "give kv_connector_extra_config.ca_bundle" in caplog.text, caplog.text
