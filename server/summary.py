"""What ``cacheseek serve`` prints for a person: its settings with units, and, once the store is
open, its tiers (budgets in GiB, paths), what each recovered and how long opening took."""

from __future__ import annotations

from typing import Any

from cacheseek import __version__
from cacheseek.build import describe
from cacheseek.descriptors import MIN_DESCRIPTORS, OWN_DESCRIPTORS, Limit, needed

from .config import ServerSettings

GIB = 1 << 30
_SECRETS = {"read_token", "write_token", "admin_token", "metrics_token", "namespace_secret"}
# settings whose names end in these are shown with a unit
_UNITS = (("_bytes", "bytes"), ("_seconds", "s"))


def gib(nbytes: int | float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:,.2f} GiB" if nbytes >= GIB or nbytes == 0 else f"{nbytes / GIB:.3f} GiB"


def _value(name: str, value: Any) -> str:
    if name in _SECRETS:
        return "set" if value is not None else "unset"
    if name == "tenants":
        return f"{len(value)} namespaces: {', '.join(sorted(value)) or '-'}" if value else "none"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if name.endswith("_bytes") and isinstance(value, int):
        return f"{gib(value)} ({value:,} bytes)" if value >= 1 << 20 else f"{value:,} bytes"
    for suffix, unit in _UNITS[1:]:
        if name.endswith(suffix) and isinstance(value, (int, float)):
            return f"{value:g} {unit}"
    if isinstance(value, int) and name != "port":
        return f"{value:,}"
    return str(value)


def settings_lines(settings: ServerSettings) -> list[str]:
    """Every setting, one a line, with its unit; secrets say only whether they are set."""
    out = [f"cacheseek serve {describe(__version__)}: settings"]
    width = max(len(n) for n in ServerSettings.model_fields)
    described = settings.describe()
    for name in ServerSettings.model_fields:
        value = getattr(settings, name) if name in _SECRETS or name == "tenants" else described.get(name)
        out.append(f"  {name:<{width}}  {_value(name, value)}")
    return out


def store_lines(settings: ServerSettings, stats: dict[str, Any], recovery: dict[str, Any]) -> list[str]:
    """The store as opened: each tier's budget, place and what it held at start."""
    scheme = "https" if settings.tls_cert is not None else "http"
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # an IPv6 address
    out = [f"cacheseek serve: store open in {recovery['seconds']:.2f} s, on {scheme}://{host}:{settings.port}"]
    tiers = {t["name"]: t for t in stats["tiers"]}
    for name, tier in tiers.items():
        found = recovery["tiers"].get(name, {"blocks": 0, "bytes": 0})
        eviction = (tier.get("eviction") or {}).get("policy")
        line = f"  {name:<5} budget {gib(tier['capacity_bytes'])}"
        if name == "cpu":
            line += f" (+ {gib(settings.cpu_reserve_bytes)} reserve for frames arriving)"
        elif name == "disk":
            line += f" at {tier.get('path', settings.disk_path)}" + (", fsync" if settings.disk_fsync else ", no fsync")
            if settings.disk_admit_after_uses > 1:
                line += f", admitted after {settings.disk_admit_after_uses} uses"
        elif name == "redis":
            line += f" (shared) at {tier.get('url')}, key namespace {tier.get('namespace')!r}"
            line += f", ttl {settings.redis_ttl_seconds:g} s" if settings.redis_ttl_seconds else ", no ttl"
        if eviction:
            line += f", {eviction} eviction"
        out.append(line)
        if tier.get("persistent", name in ("disk", "redis")):
            held = "recovered" if name == "disk" else "holds"
            extra = ""
            removed = tier.get("removed_at_start")
            if isinstance(removed, dict) and any(removed.values()):
                extra = " (removed at start: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in removed.items()) + ")"
            if found.get("trimmed_blocks"):
                extra += f" ({found['trimmed_blocks']:,} evicted to fit the budget)"
            if tier.get("other_version_at_start"):
                extra += f" ({tier['other_version_at_start']:,} blocks of another format version left alone)"
            if tier.get("over_frame_limit_at_start"):
                extra += f" ({tier['over_frame_limit_at_start']:,} blocks over max_frame_bytes left alone)"
            on_disk = found.get("charged_bytes", found["bytes"])
            if on_disk != found["bytes"]:  # whole file-system blocks, and each block's sidecar
                extra = f" ({gib(on_disk)} on disk)" + extra
            if name == "redis" and tier.get("index_stale"):
                # (its index could not be read: "holds 0 blocks" said as fact was a guess)
                out.append(f"        holds ? blocks: Redis could not be asked at start "
                           f"({tier.get('last_error') or 'no answer'}); it is asked again on each call")
                continue
            out.append(f"        {held} {found['blocks']:,} blocks, {gib(found['bytes'])}{extra}")
    out.append(f"  write-through: {', '.join(stats['write_through']) or 'none'}; "
               f"promote on hit: {'on' if stats['promote_on_hit'] else 'off'}")
    out.append(f"  distinct blocks held: {stats['blocks']:,}, {gib(stats['used_bytes'])} "
               f"(compression {stats['compression_ratio']:.2f}x)" if stats.get("compression_ratio") else
               f"  distinct blocks held: {stats['blocks']:,}, {gib(stats['used_bytes'])}")
    auth = "tokens" if settings.auth_enabled else "none (anyone who can connect may read and write)"
    out.append(f"  auth: {auth}; tenants: {len(settings.tenants)}; admin routes: "
               f"{'on' if settings.admin_token is not None else 'off (no admin_token)'}")
    scrape = "token" if settings.metrics_need_token else "no token"
    out.append(f"  metrics: {'detailed' if settings.metrics_detail else 'store figures only'}; "
               f"dashboard at /dashboard, API docs at /docs, Prometheus at /metrics ({scrape})")
    return out


def recovery_figures(stats: dict[str, Any], seconds: float, trimmed: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """What each persistent tier held when the store opened (``stats``: before the start's
    trim), how long opening took, and (given the figures after the trim, ``trimmed``) how
    many blocks the trim took from each: a restart with a smaller budget."""
    after = {t["name"]: t for t in (trimmed or {}).get("tiers", [])}
    tiers = {}
    for tier in stats["tiers"]:
        if tier["name"] == "cpu" or tier["name"] == "gpu":
            continue
        # Frame bytes, as ``stored_bytes`` counts them; a disk tier's budget counts more
        # (``charged_bytes``: its files' whole file-system blocks and sidecars).
        tiers[tier["name"]] = {"blocks": tier["blocks"], "bytes": tier.get("frame_bytes", tier["used_bytes"]),
                               "charged_bytes": tier["used_bytes"]}
        if tier["name"] in after:
            tiers[tier["name"]]["trimmed_blocks"] = max(0, tier["blocks"] - after[tier["name"]]["blocks"])
    return {"seconds": seconds, "tiers": tiers}


def over_budget_lines(stats: dict[str, Any], recovery: dict[str, Any]) -> list[str]:
    """Warnings for tiers opened over more than their budget (``stats``: as opened): what the
    start's trim evicted from each local one (a smaller ``disk_bytes`` than the last run's,
    typed by mistake, cost most of the cache unsaid), and a shared Redis over this server's
    ``redis_bytes``, which its first call trimmed for every server sharing it."""
    out = []
    for tier in stats["tiers"]:
        name, used, budget = tier["name"], tier["used_bytes"], tier["capacity_bytes"]
        trimmed = recovery["tiers"].get(name, {}).get("trimmed_blocks", 0)
        if trimmed:
            out.append(f"{name} tier: held {tier['blocks']:,} blocks ({gib(used)}) at start, more than its budget "
                       f"({gib(budget)}): the {trimmed:,} least recently used were evicted to fit (handed to the "
                       "tier below, where there is one)")
        elif name == "redis" and tier.get("evictions"):
            # (the shared index evicts down to the budget of whichever server calls it: the
            # start's first read of it did, before anything was written)
            out.append(f"redis tier: the shared index held more than this server's redis_bytes ({gib(budget)}): "
                       f"its {tier['evictions']:,} least recently used blocks were evicted at start, for every "
                       "server sharing it (the smallest redis_bytes in use wins)")
    return out


def descriptor_lines(settings: ServerSettings, limit: Limit | None) -> tuple[str, str | None]:
    """The file descriptors the server may hold, as the start left them (``limit``: after
    ``descriptors.raise_soft_limit``), and a warning where that is fewer than it should have
    (``descriptors.needed``): each connection holds one, and once they run out new ones are
    closed unanswered."""
    if limit is None:
        return "cacheseek serve: file descriptors: no limit to read on this system", None
    hard = f"hard limit {limit.hard:,}" if limit.hard is not None else "no hard limit"
    raised = f"soft limit raised from {limit.was:,}, {hard}" if limit.raised else hard
    line = f"cacheseek serve: file descriptors: up to {limit.soft:,} (RLIMIT_NOFILE; {raised})"
    need = needed(settings.disk_read_depth if settings.disk_bytes > 0 else 0)
    if limit.soft >= need:
        return line, None
    return line, (f"file descriptors: the process may hold only {limit.soft:,} (RLIMIT_NOFILE, {hard}), fewer than "
                  f"the {need:,} a server should have (at least {MIN_DESCRIPTORS:,}; about {OWN_DESCRIPTORS} of its "
                  "own and one per disk read in flight, the rest for connections): each client connection holds one, "
                  "and once they run out new connections are closed unanswered and disk writes fail. Raise the hard "
                  "limit: systemd LimitNOFILE=, docker run --ulimit nofile=N:N, ulimit -Hn (docs/operations.md, "
                  "File descriptors)")
