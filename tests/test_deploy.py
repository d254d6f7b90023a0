"""deploy/: the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, from
PyPI), docker-compose and the Prometheus and Grafana files checked for structure, and every
series the Grafana dashboard queries checked against a real server's /metrics. No Docker
engine or cluster runs here: these are the checks that can be made without one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cacheseek.descriptors import MIN_DESCRIPTORS
from cacheseek.server.config import ServerSettings
from cacheseek.store.redis_memory import maxmemory_needed
from cacheseek.units import parse_size
from redis_servers import needs_redis
from server_helpers import metrics_after_traffic

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S_VERSION = "1.30.0"
SETTINGS = {f"CACHESEEK_{name.upper()}" for name in ServerSettings.model_fields}
# The disk tier's index in memory: ~1.1 KiB a block, over frames of at least 64 KiB (the
# sizes docs/operations.md's "Memory for the disk index" sizes the Kubernetes example for).
DISK_INDEX_BYTES_PER_BLOCK = 1126
DISK_INDEX_FRAME_BYTES = 64 << 10
# What a CPU-tier block costs beside its frame, which cpu_bytes does not count: ~1.6 KiB
# (docs/operations.md's "Memory for the CPU tier's blocks"), over frames of 64 KiB or more.
CPU_BLOCK_BYTES = 1638

# The fields of a ServiceMonitor (monitoring.coreos.com/v1) these manifests use, as its CRD
# defines them: no Kubernetes schema covers a custom resource.
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"],
                "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                               "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                               "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
        }},
    },
}


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def test_kubernetes_manifests_validate_against_the_schemas():
    docs = manifests()
    kinds = {doc["kind"] for _, doc in docs}
    assert {"StatefulSet", "Service", "Deployment", "ServiceMonitor"} <= kinds
    for path, doc in docs:
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises, naming the field
    for kustomization in (DEPLOY / "k8s").rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            assert (kustomization.parent / resource).exists(), resource


def test_a_broken_manifest_is_caught():
    (path, doc), = [(p, d) for p, d in manifests() if d["kind"] == "StatefulSet" and "single" in str(p)]
    bad = json.loads(json.dumps(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = {"no": "such"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = json.loads(json.dumps(doc))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_workloads_are_wired_and_sized_from_their_tier_settings():
    docs = manifests()
    services = [d for _, d in docs if d["kind"] == "Service"]
    monitors = [d for _, d in docs if d["kind"] == "ServiceMonitor"]
    workloads = [d for _, d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert any(s["spec"]["selector"].items() <= labels.items() for s in services), w["metadata"]["name"]
        if w["kind"] == "StatefulSet":
            assert any(s["metadata"]["name"] == w["spec"]["serviceName"] for s in services)
    for w in [w for w in workloads if w["metadata"]["name"] == "cacheseek"]:
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env = _env(c)
        assert set(env) <= SETTINGS, set(env) - SETTINGS  # every variable is a real setting
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert "startupProbe" in c
        cpu = parse_size(env["CACHESEEK_CPU_BYTES"])
        reserve = min(cpu // 8, 1 << 30)
        request = parse_size(c["resources"]["requests"]["memory"].replace("Mi", "MiB").replace("Gi", "GiB"))
        disk = parse_size(env.get("CACHESEEK_DISK_BYTES") or "0")
        # the tier, its reserve, its blocks' own memory, the process, and the disk tier's index
        # (docs/operations.md, "Memory for the CPU tier's blocks" and "Memory for the disk
        # index": ~1.6 and ~1.1 KiB a block, frames of 64 KiB or more assumed)
        index = disk // DISK_INDEX_FRAME_BYTES * DISK_INDEX_BYTES_PER_BLOCK
        blocks = cpu // DISK_INDEX_FRAME_BYTES * CPU_BLOCK_BYTES
        assert request >= cpu + reserve + blocks + (1 << 30) + index, (request, cpu, blocks, index)
        if disk:
            (claim,) = w["spec"]["volumeClaimTemplates"]
            volume = parse_size(claim["spec"]["resources"]["requests"]["storage"].replace("Gi", "GiB"))
            assert volume >= disk * 1.1, (volume, disk)
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert Path(env["CACHESEEK_DISK_PATH"]).is_relative_to(mounts[claim["metadata"]["name"]])
        else:
            # Replicas without a disk share Redis: they must mask namespaces with one secret.
            assert env["CACHESEEK_REDIS_URL"].startswith("redis://") and "CACHESEEK_NAMESPACE_SECRET" in env
        ports = {p["name"] for p in c["ports"]}
        for m in monitors:
            assert {e["port"] for e in m["spec"]["endpoints"]} <= ports
            assert all(e["path"] == "/metrics" for e in m["spec"]["endpoints"])


def test_compose_prometheus_and_grafana_are_wired_together():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"cacheseek", "redis", "prometheus", "grafana"} <= set(services)
    assert set(services["cacheseek"]["environment"]) <= SETTINGS
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, (name, dep)
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
            else:
                assert source in compose["volumes"], (name, source)
    assert "allkeys" not in " ".join(services["redis"]["command"])  # docs/redis.md: never an allkeys-* policy
    # each connection holds a descriptor: a hard limit left to the daemon may be 1024, which a fleet fills
    assert services["cacheseek"]["ulimits"]["nofile"]["hard"] >= 16 * MIN_DESCRIPTORS
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["cacheseek:8080"]
    source = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = source["datasources"]
    assert ds["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "cacheseek.json").read_text())
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "cacheseek.yml").read_text())
    assert any(v.endswith(":" + provider["providers"][0]["options"]["path"] + ":ro") for v in services["grafana"]["volumes"])
    panels = dashboard["panels"]
    assert dashboard["uid"] and len({p["id"] for p in panels}) == len(panels) >= 12
    for p in panels:
        assert p["type"] in ("stat", "timeseries", "state-timeline") and {"x", "y", "w", "h"} <= set(p["gridPos"])
        assert p["targets"] and p["datasource"]["uid"] == ds["uid"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert 'job=~"$job"' in expr, expr
    titles = " ".join(p["title"].lower() for p in panels)
    for wanted in ("hit rate", "lookup latency", "throughput", "tier fill", "unique", "namespace", "breaker",
                   "evictions", "corrupt", "compression"):
        assert wanted in titles, wanted


@needs_redis
def test_every_series_the_dashboard_queries_exists(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "cacheseek.json").read_text())
    wanted = {name for p in dashboard["panels"] for t in p["targets"]
              for name in re.findall(r"\b(cacheseek_[a-z_]+)\{", t["expr"])}
    text = metrics_after_traffic(tmp_path)
    exposed = set(re.findall(r"^(cacheseek_[a-z_]+)[{ ]", text, re.M))
    assert wanted <= exposed, wanted - exposed
    # The fill panel divides Redis's used bytes by the budget in effect on its namespace (a
    # process of a smaller budget sharing it keeps it there): one-to-one, so their labels
    # must be the same.
    [fill] = [p["targets"][0]["expr"] for p in dashboard["panels"] if p["title"] == "Tier fill"]
    assert 'cacheseek_tier_used_bytes{job=~"$job",tier="redis"} / cacheseek_redis_budget_in_effect_bytes' in fill
    used = re.findall(r'^cacheseek_tier_used_bytes(\{[^}]*tier="redis"[^}]*\})', text, re.M)
    budget = re.findall(r"^cacheseek_redis_budget_in_effect_bytes(\{[^}]*\})", text, re.M)
    assert used and used == budget, (used, budget)


def _healthcheck() -> list[str]:
    """The Dockerfile's HEALTHCHECK command (exec form), with this interpreter for "python"."""
    import sys

    text = (DEPLOY.parent / "Dockerfile").read_text().replace("\\\n", " ")
    cmd = json.loads(re.search(r"^HEALTHCHECK .*?CMD (\[.*\])\s*$", text, re.M).group(1))
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


@pytest.mark.parametrize("tls", [False, True])
def test_the_image_healthcheck_asks_the_port_and_scheme_the_server_was_given(tmp_path, tls):
    """It asked http://127.0.0.1:8080 whatever the settings: a container given another port
    (CACHESEEK_PORT) or TLS (CACHESEEK_TLS_CERT) was unhealthy for good."""
    import os
    import subprocess

    from server_helpers import Server

    args, env = [], {}
    if tls:
        trustme = pytest.importorskip("trustme")
        cert = trustme.CA().issue_cert("127.0.0.1")
        cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
        env = {"CACHESEEK_TLS_CERT": str(tmp_path / "cert.pem"), "CACHESEEK_TLS_KEY": str(tmp_path / "key.pem")}
        args = ["--tls-cert", env["CACHESEEK_TLS_CERT"], "--tls-key", env["CACHESEEK_TLS_KEY"]]
    srv = Server(tmp_path, *args, disk=False, verify=False).start()
    check = {**os.environ, **env, "CACHESEEK_PORT": str(srv.port)}  # (the container's environment)
    try:
        done = subprocess.run(_healthcheck(), env=check, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    finally:
        srv.stop()
    done = subprocess.run(_healthcheck(), env=check, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0  # (and a server that is gone is unhealthy)


REDIS_UNITS = {"": 1, "k": 1000, "kb": 1 << 10, "m": 10**6, "mb": 1 << 20, "g": 10**9, "gb": 1 << 30}


def redis_size(value: str) -> int:
    """A redis-server size argument in bytes: its ``mb`` is 1024 * 1024, its ``m`` 10**6."""
    m = re.fullmatch(r"(\d+)([a-z]*)", value.lower())
    assert m and m.group(2) in REDIS_UNITS, value
    return int(m.group(1)) * REDIS_UNITS[m.group(2)]


def test_redis_maxmemory_holds_the_redis_tier_budget_as_redis_md_asks():
    """docs/redis.md: ``maxmemory`` at least ``redis_bytes x 1.3 + 64 MiB`` (``maxmemory_needed``:
    a frame takes up to a quarter more in Redis's allocator; else Redis answers OOM and writes
    are dropped, for good). The Kubernetes Redis had 17700mb (17.3 GiB: Redis's
    ``mb`` is a MiB) for replicas' 16 GiB, which need 17.7 GiB; compose's 8gb sat beside a
    commented-out Redis URL that would run the default 16 GiB budget."""
    default = ServerSettings.model_fields["redis_bytes"].default
    pairs = []
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    env = compose["services"]["cacheseek"]["environment"]
    budget = re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", env.get("CACHESEEK_REDIS_BYTES", str(default)))
    pairs.append(("docker-compose.yml", budget, compose["services"]["redis"]["command"]))
    docs = manifests()
    for path, doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c.get("args") and c["args"][0] == "redis-server":
                (replicas,) = [c for _, d in docs if d["kind"] in ("Deployment", "StatefulSet")
                               for c in d["spec"]["template"]["spec"]["containers"]
                               if any(e["name"] == "CACHESEEK_REDIS_URL" for e in c.get("env", []))]
                env = {e["name"]: e.get("value") for e in replicas["env"]}
                pairs.append((path.name, env.get("CACHESEEK_REDIS_BYTES", str(default)), c["args"]))
    assert len(pairs) == 2
    short = []
    for where, budget, command in pairs:
        maxmemory = redis_size(command[command.index("--maxmemory") + 1])
        need = maxmemory_needed(parse_size(budget))
        if maxmemory < need:
            short.append(f"{where}: maxmemory {maxmemory / 2**30:.2f} GiB < {need / 2**30:.2f} GiB "
                         f"for redis_bytes {budget}")
    assert not short, "\n".join(short)
