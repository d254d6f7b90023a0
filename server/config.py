"""``ServerSettings``: every setting of ``cacheseek serve``, in one pydantic-settings model.

Sources, highest priority first: command-line flags, environment variables
(``CACHESEEK_<NAME>``, e.g. ``CACHESEEK_CPU_BYTES=8GiB``), an optional TOML or YAML file
(``--config`` or ``CACHESEEK_CONFIG``), then the defaults below. Byte sizes take ints or
strings like ``"4GiB"``; durations are in seconds, and their names say so (``_seconds``; the
older ``_s`` spelling still works, with a ``DeprecationWarning``, from every source). Tier
construction from these settings lives in one place,
``server.store.build_store``, so a new tier (Redis) adds a group of settings here and a few
lines there.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib is tomli, taken into the standard library in 3.11
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from cacheseek.config import default_cpu_reserve
from cacheseek.errors import ConfigError
from cacheseek.hashing import NAMESPACE_PATTERN
from cacheseek.store.frame import PREAMBLE
from cacheseek.store.redis_client import MAX_TIMEOUT_SECONDS, parse_redis_url
from cacheseek.store.redis_keys import RedisKeys
from cacheseek.units import parse_size

from .namespaces import MIN_SECRET_BYTES

ENV_PREFIX = "CACHESEEK_"
# Old spelling -> setting: durations were once named ``_s``. Each still works (flags, keyword
# arguments, CACHESEEK_* variables, config files) and warns.
DEPRECATED_NAMES = {
    "graceful_timeout_s": "graceful_timeout_seconds",
    "keepalive_timeout_s": "keepalive_timeout_seconds",
    "redis_ttl_s": "redis_ttl_seconds",
    "redis_connect_timeout_s": "redis_connect_timeout_seconds",
    "redis_socket_timeout_s": "redis_socket_timeout_seconds",
    "redis_breaker_base_s": "redis_breaker_base_seconds",
    "redis_breaker_cap_s": "redis_breaker_cap_seconds",
}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``CACHESEEK_*`` variable that names no setting but is close to one's:
    pydantic-settings reads only the known ones, so a misspelt one (``CACHESEEK_DISK_BYTE``)
    left its default in force without a word. Names close to none are other tools' (the
    library's ``CACHESEEK_KIVI_BACKEND``, ``cacheseek top``'s ``CACHESEEK_TOKEN``)."""
    settings = {name.upper() for name in ServerSettings.model_fields}
    known = settings | {name.upper() for name in DEPRECATED_NAMES} | {"CONFIG"}
    out = []
    for variable in sorted(environ):
        name = variable.upper().removeprefix(ENV_PREFIX)
        if not variable.upper().startswith(ENV_PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(settings), n=1, cutoff=0.75)
        if close:
            out.append(f"{variable} is not a setting (ignored); did you mean {ENV_PREFIX}{close[0]}?")
    return out


SECRETS = ("read_token", "write_token", "admin_token", "metrics_token", "namespace_secret", "tenants")


def exposed_secrets(flags: Any, config_file: str | Path | None) -> list[str]:
    """A warning for each secret other users of the host can read: one given as a flag (in
    ``/proc/PID/cmdline``, which ``ps`` shows everyone), and a settings file holding one that
    its group or others may read."""
    out = [f"--{name.replace('_', '-')} on the command line can be read by other users of this host (ps, "
           f"/proc/PID/cmdline); give it as {ENV_PREFIX}{name.upper()} or in a settings file only its owner reads"
           for name in SECRETS if name in flags]
    if config_file is None and os.environ.get(ENV_PREFIX + "CONFIG"):
        config_file = os.environ[ENV_PREFIX + "CONFIG"]
    if config_file is not None:
        path = Path(config_file).expanduser()
        try:
            held = [name for name in SECRETS if load_config_file(path).get(name)]
            mode = path.stat().st_mode & 0o777
        except (ConfigError, OSError):
            return out  # (said when the settings are read)
        if held and mode & 0o077:
            out.append(f"config {path} holds {', '.join(held)} and other users can read it (mode {mode:04o}): "
                       f"chmod 600 {path}")
    return out


def default_disk_path() -> Path:
    """``$XDG_CACHE_HOME/cacheseek/store``, or ``~/.cache/cacheseek/store``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cacheseek" / "store"


class TenantTokens(BaseModel):
    """Tokens bound to one namespace: a caller holding them can use only that namespace."""

    model_config = ConfigDict(extra="forbid")
    read_token: SecretStr | None = None
    write_token: SecretStr


_config_file: ContextVar[Path | None] = ContextVar("cacheseek_config_file", default=None)


def renamed(values: dict[str, Any], where: str, *, spell: Any = str) -> dict[str, Any]:
    """``values`` with each deprecated setting name replaced by its new one, warning once per
    name (``spell(name)`` is how ``where`` writes a name: a flag, a variable). Giving both
    spellings of one setting is an error."""
    if not any(old in values for old in DEPRECATED_NAMES):
        return values
    out = dict(values)
    for old, new in DEPRECATED_NAMES.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"{where}: {spell(old)} and {spell(new)} name one setting; give {spell(new)} only")
        warnings.warn(f"{where}: {spell(old)} is deprecated; use {spell(new)}", DeprecationWarning, stacklevel=3)
        out[new] = out.pop(old)
    return out


class _DeprecatedEnvSource(PydanticBaseSettingsSource):
    """``CACHESEEK_<OLD NAME>`` variables (see ``DEPRECATED_NAMES``), under their new names."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        env = {k.upper(): v for k, v in os.environ.items()}
        found = {old: env[ENV_PREFIX + old.upper()] for old in DEPRECATED_NAMES if ENV_PREFIX + old.upper() in env}
        both = {DEPRECATED_NAMES[old]: env[ENV_PREFIX + DEPRECATED_NAMES[old].upper()] for old in found
                if ENV_PREFIX + DEPRECATED_NAMES[old].upper() in env}  # (renamed() refuses them)
        return renamed({**found, **both}, "environment", spell=lambda name: ENV_PREFIX + name.upper())


class _FileSource(PydanticBaseSettingsSource):
    """Settings from the TOML or YAML file named by ``--config`` (or ``CACHESEEK_CONFIG``)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        path = _config_file.get() or (Path(os.environ[ENV_PREFIX + "CONFIG"]) if os.environ.get(ENV_PREFIX + "CONFIG") else None)
        self.data = renamed(load_config_file(path), f"config {path}") if path is not None else {}
        for key in self.data:
            if key not in settings_cls.model_fields:
                # pydantic's "Extra inputs are not permitted" said neither whose key it was nor
                # what it may have meant
                # (the variables' spelling, CPU_BYTES or CACHESEEK_CPU_BYTES, read in any case
                # there, is close to no setting as written)
                plain = key.lower().removeprefix(ENV_PREFIX.lower())
                close = difflib.get_close_matches(plain, sorted(settings_cls.model_fields), n=1, cutoff=0.75)
                meant = f"; did you mean {close[0]}?" if close else " (cacheseek serve --help lists them)"
                raise ConfigError(f"config {path}: {key} is not a setting{meant}")

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A settings file as a dict: ``.toml``, or ``.yaml``/``.yml``. Keys are setting names;
    a ``[cacheseek]`` table (or top-level ``cacheseek:`` map), if present, is used instead."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")  # (TOML is UTF-8; so is the YAML this reads)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}") from None
    except UnicodeDecodeError as exc:  # (a traceback and exit 1 before)
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {exc.start + 1}: {exc.reason})") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            # (yaml.safe_load keeps the last of a key given twice: a merged file's second
            # write_token or disk_path was taken without a word)
            data = yaml.load(text, Loader=_unique_key_loader()) or {}
        else:
            raise ConfigError(f"config: {path} must end in .toml, .yaml or .yml")
    except _RepeatedKey as exc:
        raise ConfigError(f"config {path}: {exc.key} is given twice{exc.where}") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config: {path} is not valid: {exc}") from None
    except Exception as exc:  # yaml.YAMLError and friends
        raise ConfigError(f"config: {path} is not valid: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a table of settings")
    if isinstance(data.get("cacheseek"), dict):
        # (a file shared with other tools: their keys beside the table are theirs) A setting
        # beside it was dropped without a word: the server started on its default.
        names = {*ServerSettings.model_fields, *DEPRECATED_NAMES}
        beside = sorted(str(k) for k in data if str(k).replace("-", "_") in names)
        if beside:
            raise ConfigError(f"config {path}: {', '.join(beside)} {'is' if len(beside) == 1 else 'are'} beside the "
                              "[cacheseek] table, whose settings alone are read: put "
                              f"{'it' if len(beside) == 1 else 'them'} in the table")
        data = data["cacheseek"]
    # cpu-bytes and cpu_bytes name one setting: the last of them was taken without a word
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in out:
            raise ConfigError(f"config {path}: {spelt[name]} and {key} name one setting: give it once")
        out[name], spelt[name] = value, str(key)
    return out


class _RepeatedKey(Exception):
    """A YAML mapping that gives one key twice (``key``: its value as loaded; ``where``:
    the repeat's line and column, never the line's text: it may hold a token)."""

    def __init__(self, key: Any, mark: Any) -> None:
        super().__init__(key)
        self.key = key
        self.where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


_LOADER: Any = None


def _unique_key_loader() -> Any:
    """A ``yaml.SafeLoader`` whose mappings, at every level, refuse a key given twice
    (``<<`` merges still give way to the keys beside them, as YAML has them)."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                if isinstance(node, yaml.MappingNode):
                    seen: set[Any] = set()
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":
                            continue
                        key = self.construct_object(key_node, deep=True)
                        try:
                            repeated = key in seen
                        except TypeError:  # (unhashable: the constructor below refuses it)
                            continue
                        if repeated:
                            raise _RepeatedKey(key, key_node.start_mark)
                        seen.add(key)
                return super().construct_mapping(node, deep=deep)

        _LOADER = UniqueKeyLoader
    return _LOADER


def _yaml_problem(exc: Exception) -> str:
    """A YAML error's reason and place, without the quote of the line it stopped at (that
    line may hold a token)."""
    problem = getattr(exc, "problem", None)
    if problem is None:
        return type(exc).__name__
    def at(mark: Any) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

    context = getattr(exc, "context", None)
    context = f"{context}{at(getattr(exc, 'context_mark', None))}: " if context else ""
    return f"{context}{problem}{at(getattr(exc, 'problem_mark', None))}"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    def __init__(self, **values: Any) -> None:
        super().__init__(**renamed(values, "ServerSettings"))

    # -- listening -------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, ge=1, le=65535, description="TCP port")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    access_log: bool = Field(False, description="log every request (costly at high request rates)")
    http: Literal["auto", "h11", "httptools"] = Field(
        "auto", description="uvicorn HTTP implementation; auto: httptools with a leaner body path (server.protocol)")
    loop: Literal["auto", "asyncio", "uvloop"] = Field("auto", description="uvicorn event loop")
    graceful_timeout_seconds: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="on SIGTERM, how long in-flight requests may finish")
    keepalive_timeout_seconds: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="idle keep-alive connections close after this")
    header_timeout_seconds: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="a request's headers must all arrive within this of its first byte (or of the connection's "
                    "opening); else the connection is closed")
    body_idle_timeout_seconds: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="a request body that gets no byte for this long (while the server reads), or a response whose "
                    "client takes no byte of it for this long, is cut off")
    body_min_bytes_per_second: int = Field(
        64 << 10, description="bytes per second a request body must average once it has run body_idle_timeout_seconds "
                              "(time the server is not reading excluded), and a response its client must take once "
                              "it has waited for the client that long; 0 turns the check off")
    tls_cert: Path | None = Field(None, description="PEM certificate chain: serve HTTPS (with tls_key)")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")

    # -- tiers (built by server.store.build_store) -----------------------------------------
    cpu_bytes: int = Field(4 << 30, description="CPU tier budget; 0 turns the tier off")
    cpu_reserve_bytes: int | None = Field(
        None, description="host memory beyond the CPU budget for frames still arriving (received in place, "
                          "evicted for at commit); default: an eighth of cpu_bytes, at most 1 GiB")
    disk_path: Path = Field(default_factory=default_disk_path, description="disk tier directory")
    disk_bytes: int = Field(64 << 30, description="disk tier budget; 0 turns the tier off")
    write_through: bool = Field(
        True, description="every ingest is written to the persistent tiers (disk, Redis) before it is acknowledged")
    shutdown_drain_seconds: float = Field(
        30.0, ge=0, allow_inf_nan=False,
        description="on SIGTERM/SIGINT, once in-flight requests are done: how long to spend writing the blocks "
                    "only the memory tiers hold (write-back: not demoted yet) to disk, or Redis, so a restart finds "
                    "them; a second SIGINT stops it; 0: off (they are lost)")
    disk_fsync: bool = Field(True, description="fsync frames, sidecars and directories on disk")
    disk_group_commit: bool = Field(
        True, description="commit the frames of one request together (data files, sidecars, one fsync per "
                          "shard directory); off: one frame at a time. Durable when answered either way")
    disk_read_depth: int = Field(16, ge=1, le=256, description="whole-file disk reads kept in flight")
    max_prefetches: int = Field(4, ge=1, le=256, description="prefetches (POST /v1/prefetch) running at once")
    promote_on_hit: bool = Field(True, description="copy a hit from a lower tier into the faster ones")
    eviction: Literal["arc", "lru"] = Field(
        "arc", description="eviction policy of the CPU and disk tiers (docs/hit-rate.md); Redis keeps LRU")
    disk_admit_after_uses: int = Field(
        1, ge=1, description="write a block to disk only once it has been used this many times (1: every block)")

    # -- redis tier (shared by servers on many hosts; see docs/redis.md) --------------------
    redis_url: str | None = Field(
        None, description="redis://host:port, or redis+cluster://host:port[,host:port...]; unset: no Redis tier")
    redis_bytes: int = Field(16 << 30, description="Redis tier budget, shared by every server using the namespace")
    redis_ttl_seconds: float | None = Field(
        None, gt=0, description="a block unused this long expires from Redis; unset: never")
    redis_prefix: str = Field("cacheseek", description="first part of every Redis key")
    redis_namespace: str = Field("default", description="second part of every Redis key: separate budgets on one Redis")
    # (at most MAX_TIMEOUT_SECONDS: a socket holds its timeout in int64 nanoseconds, and a longer
    # one was refused only as the store opened, blamed on redis_url)
    redis_connect_timeout_seconds: float = Field(
        1.0, gt=0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False, description="Redis connect timeout")
    redis_socket_timeout_seconds: float = Field(
        2.0, gt=0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False, description="Redis read/write timeout")
    redis_breaker_failures: int = Field(3, ge=1, description="consecutive Redis failures that open the circuit breaker")
    # (finite: an infinite one was refused only as the store opened, blamed on "tiers")
    redis_breaker_base_seconds: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="first open period of the breaker; doubles per failed probe")
    redis_breaker_cap_seconds: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="longest open period of the breaker")

    # -- limits ----------------------------------------------------------------------------
    max_body_bytes: int = Field(2 << 30, description="largest request body (a batch of frames)")
    max_inflight_body_bytes: int = Field(
        2 << 30, description="request-body bytes received and not yet stored, over all requests; a request that "
                             "would pass it is answered 503")
    # (no frame is smaller than its preamble: a smaller limit made a server that refused every
    # frame, said only where a Redis tier was set, and blamed on redis_url)
    max_frame_bytes: int = Field(256 << 20, ge=PREAMBLE.size, description="largest single frame")
    max_lookup_hashes: int = Field(1 << 16, ge=1, description="most hashes in one lookup")
    max_chain_blocks: int = Field(1 << 20, ge=1, description="longest chain a frame's position may claim")

    # -- auth and tenants ------------------------------------------------------------------
    read_token: SecretStr | None = Field(None, description="bearer token for reads, any namespace")
    write_token: SecretStr | None = Field(None, description="bearer token for reads and writes, any namespace")
    tenants: dict[str, TenantTokens] = Field(
        default_factory=dict, description="namespace -> {read_token, write_token}: tokens bound to one namespace")
    namespace_secret: SecretStr | None = Field(
        None, description="key that separates namespaces in storage (at least 16 bytes); default: a file in disk_path, or random")
    admin_token: SecretStr | None = Field(
        None, description="bearer token for /v1/admin (usage, flush, delete, pin); unset: admin routes are off")
    metrics_token: SecretStr | None = Field(
        None, description="bearer token that reads /metrics and nothing else (a scraper's); with tokens set, "
                          "/metrics takes it or the read, write or admin token")
    metrics_open: bool = Field(
        False, description="/metrics takes no token even where the server has tokens (it names every namespace "
                           "and model, with their traffic and usage); without tokens it takes none anyway")

    # -- observability ---------------------------------------------------------------------
    metrics_detail: bool = Field(
        True, description="count every request: per-route latency histograms, per-namespace/model lookups, "
                          "ingest and materialize (off: only the store's figures, read at scrape time)")
    metrics_max_owners: int = Field(
        64, ge=1, le=10_000, description="most (namespace, model) label pairs in metrics; more count as _other")

    @field_validator("cpu_bytes", "disk_bytes", "redis_bytes", "max_body_bytes", "max_frame_bytes",
                     "max_inflight_body_bytes", "body_min_bytes_per_second", mode="before")
    @classmethod
    def _size(cls, value: Any, info: Any) -> int:
        return parse_size(value, name=info.field_name)

    @field_validator("max_body_bytes", "max_inflight_body_bytes")  # (max_frame_bytes: its ge= above)
    @classmethod
    def _limit(cls, value: int, info: Any) -> int:
        if value == 0:  # (0 turns a tier off; a limit of 0 made a server that refused every frame)
            raise ValueError(f"{info.field_name}: must be more than 0 bytes")
        return value

    @field_validator("cpu_reserve_bytes", mode="before")
    @classmethod
    def _optional_size(cls, value: Any, info: Any) -> int | None:
        if value is None or value == "":
            return None  # CACHESEEK_CPU_RESERVE_BYTES= (empty) means the default reserve
        return parse_size(value, name=info.field_name)


    @field_validator("read_token", "write_token", "namespace_secret", "admin_token", "metrics_token", mode="before")
    @classmethod
    def _unset_if_empty(cls, value: Any) -> Any:
        return None if value == "" else value  # CACHESEEK_WRITE_TOKEN= (empty) means no token

    @field_validator("namespace_secret")
    @classmethod
    def _namespace_secret(cls, value: SecretStr | None) -> SecretStr | None:
        # Checked here, with the other settings: the app refused it only once started (exit
        # 3, a traceback), after the store was opened.
        if value is not None and len(value.get_secret_value().encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"must be at least {MIN_SECRET_BYTES} bytes")
        return value

    @field_validator("redis_url", "redis_ttl_seconds", mode="before")
    @classmethod
    def _unset_redis(cls, value: Any) -> Any:
        return None if value == "" else value  # CACHESEEK_REDIS_URL= (empty) means no Redis tier

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_redis_url(value)  # a ConfigError (a ValueError) names what is wrong
        return value

    @field_validator("redis_namespace", mode="before")
    @classmethod
    def _default_namespace(cls, value: Any) -> Any:
        # CACHESEEK_REDIS_NAMESPACE= (empty, as a manifest rendering an unset variable writes
        # it) means the default, as every other empty setting: taken as the namespace "", it
        # gave that server data and a budget of its own, shared with none of its peers.
        return "default" if value == "" else value

    @field_validator("redis_prefix", "redis_namespace")
    @classmethod
    def _redis_key_part(cls, value: str, info: Any) -> str:
        RedisKeys(**{info.field_name.removeprefix("redis_"): value})
        return value

    @field_validator("disk_path", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        if value == "":
            # CACHESEEK_DISK_PATH= (empty) means the default, as for every optional setting: Path("")
            # is the current directory, whose files the disk tier's recovery would delete.
            return default_disk_path()
        return Path(value).expanduser() if isinstance(value, (str, Path)) else value

    @field_validator("tls_cert", "tls_key", mode="before")
    @classmethod
    def _optional_path(cls, value: Any) -> Any:
        if value is None or value == "":
            return None  # CACHESEEK_TLS_CERT= (empty) means plain HTTP
        return Path(value).expanduser() if isinstance(value, (str, Path)) else value

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, value: dict[str, TenantTokens]) -> dict[str, TenantTokens]:
        for name in value:
            if not NAMESPACE_PATTERN.match(name):
                raise ValueError(f"tenants: namespace {name!r} must be 0-128 printable ASCII characters, no spaces")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.cpu_bytes == 0 and self.disk_bytes == 0 and (self.redis_url is None or self.redis_bytes == 0):
            raise ValueError("cpu_bytes and disk_bytes are both 0 and no Redis tier is set: no tier would hold anything")
        if self.redis_breaker_cap_seconds < self.redis_breaker_base_seconds:
            raise ValueError(f"redis_breaker_cap_seconds ({self.redis_breaker_cap_seconds}) is below "
                             f"redis_breaker_base_seconds ({self.redis_breaker_base_seconds})")
        if self.max_frame_bytes > self.max_body_bytes:
            raise ValueError(f"max_frame_bytes ({self.max_frame_bytes}) exceeds max_body_bytes ({self.max_body_bytes})")
        if self.max_body_bytes > self.max_inflight_body_bytes:
            raise ValueError(f"max_body_bytes ({self.max_body_bytes}) exceeds max_inflight_body_bytes "
                             f"({self.max_inflight_body_bytes}): such a body could never be received")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: set both (HTTPS) or neither (plain HTTP)")
        if self.read_token is not None and self.write_token is None:
            raise ValueError("read_token is set but write_token is not: writes would be open to anyone")
        if self.metrics_token is not None and self.write_token is None:
            raise ValueError("metrics_token is set but write_token is not: /metrics and /v1/stats, the same "
                             "figures, are open to anyone without tokens")
        if self.metrics_token is not None and self.metrics_open:
            raise ValueError("metrics_token and metrics_open: /metrics takes a token or none; set one of them")
        named = [(name, t.get_secret_value()) for name, t in
                 (("read_token", self.read_token), ("write_token", self.write_token), ("admin_token", self.admin_token),
                  ("metrics_token", self.metrics_token))
                 if t is not None]
        for namespace, tenant in self.tenants.items():
            named += [(f"tenants[{namespace!r}].{name}", t.get_secret_value())
                      for name, t in (("read_token", tenant.read_token), ("write_token", tenant.write_token))
                      if t is not None]
        tokens = [t for _, t in named]
        if any(not t for t in tokens):
            raise ValueError("read_token/write_token/admin_token/metrics_token/tenants: a token may not be empty")
        for name, t in named:
            # A header carries printable ASCII, and its value's spaces at either end are not
            # part of it: such a token (a pasted non-breaking space, a trailing newline of a
            # secrets file) was taken, and no client could ever send it (every request 403).
            if not (t.isascii() and t.isprintable()) or t != t.strip():
                raise ValueError(f"{name}: a token is printable ASCII without spaces at either end (no HTTP "
                                 "header carries anything else, so no client could send this one)")
        if len(set(tokens)) != len(tokens):
            raise ValueError("read_token/write_token/admin_token/metrics_token/tenants: every token must be different")
        if self.tenants and self.write_token is None:
            raise ValueError("tenants: set write_token too (the operator's token), or callers without tenant "
                             "tokens could write anywhere")
        if self.cpu_reserve_bytes is None:  # resolved here, so the settings printed at start show it
            self.cpu_reserve_bytes = default_cpu_reserve(self.cpu_bytes)
        return self

    @property
    def auth_enabled(self) -> bool:
        return self.write_token is not None

    @property
    def metrics_need_token(self) -> bool:
        """``/metrics`` wants a token: the server has tokens and ``metrics_open`` is off. Its
        labels name every namespace and model with their traffic and usage, what ``/v1/stats``
        hides from a tenant's token and from callers without one."""
        return self.auth_enabled and not self.metrics_open

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _DeprecatedEnvSource(settings_cls), _FileSource(settings_cls)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> ServerSettings:
        """Settings from ``overrides`` (flags), the environment, and ``config_file``."""
        token = _config_file.set(Path(config_file) if config_file is not None else None)
        try:
            return cls(**overrides)
        except SettingsError as exc:
            # pydantic-settings' own error (an environment variable of a table that is not JSON)
            # names neither the variable nor the problem: both are said, as for any bad setting.
            m = re.search(r'field "(\w+)"', str(exc))
            where = f"{ENV_PREFIX}{m.group(1).upper()}" if m else "settings"
            raise ConfigError(f"{where}: cannot read it: {exc.__cause__ or exc}; give a JSON object") from None
        finally:
            _config_file.reset(token)

    def describe(self) -> dict[str, Any]:
        """The settings as printed at start: secrets masked."""
        out = self.model_dump(mode="json")
        if self.redis_url is not None:
            out["redis_url"] = parse_redis_url(self.redis_url).redacted()
        return out
