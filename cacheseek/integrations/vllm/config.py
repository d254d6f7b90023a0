"""The connector's settings: ``kv_connector_extra_config`` parsed into plain data.

Torch-free and vLLM-free, so a bad setting is reported (a ``ConfigError`` naming the key)
before anything is built, and the parsing is tested without an engine.

    {"codec": "int4", "group_size": 32, "block_tokens": 256, "model_id": "smollm2-135m",
     "tiers": {"cpu_bytes": "4GiB", "disk_path": "/var/cache/cs"}}       # embedded
    {"codec": "int4", "url": "http://127.0.0.1:8080", "model_id": "smollm2-135m"}  # remote
    {"codec": "int4", "layerwise_load": "auto"}   # layer-wise loads where vLLM's pages are on a GPU (default: off)
    {"codec": "int4", "layerwise_save": "auto"}   # layer-wise saves where vLLM's pages are on a GPU (default: off)
    {"codec": "int4", "url": "...", "background_saves": false}   # a remote save's upload inside wait_for_save
    {"codec": "int4", "url": "https://...", "ca_bundle": "/etc/cacheseek/ca.pem"}   # a TLS server's own CA
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...config import TierConfig
from ...errors import ConfigError
from ...hashing import DEFAULT_ALGO
from ...quant import KIVI, Raw
from ...quant.codec import KVLayerCodec
from ...quant.registry import codec_from_spec
from ...tls import ca_bundle_context
from ...units import parse_size

# codec name -> how it is built from the group size
CODECS: dict[str, Callable[[int], KVLayerCodec]] = {
    "raw": lambda g: Raw(),
    "int8": lambda g: KIVI(bits=8, group_size=g),
    "int4": lambda g: KIVI(bits=4, group_size=g),
    "int2": lambda g: KIVI(bits=2, group_size=g),
    "k2v4": lambda g: KIVI(k_bits=2, v_bits=4, group_size=g),
}

DEFAULT_TIERS: dict[str, Any] = {"cpu_bytes": "4GiB"}
DEFAULT_GROUP_SIZE = 32

_KEYS = frozenset({
    "codec", "group_size", "block_tokens", "model_id", "namespace", "hash_algo",
    "url", "token", "timeout_seconds", "tiers", "retry_after_seconds", "retry_cap_seconds", "layerwise_load",
    "layerwise_save", "background_saves", "max_pending_bytes", "lookup_wait_seconds", "background_loads",
    "resave_hold_seconds", "ca_bundle", "exchange_timeout_seconds", "lookup_deadline_seconds",
})
_REMOTE_ONLY = ("token", "ca_bundle", "background_saves", "max_pending_bytes", "lookup_wait_seconds",
                "background_loads", "resave_hold_seconds", "exchange_timeout_seconds", "lookup_deadline_seconds")
DEFAULT_MAX_PENDING_BYTES = 2 << 30
# exchange_timeout_seconds' default, in timeout_seconds (30 s with the default 10): a chain's
# whole prefix comes in one exchange, and a healthy server's answer for a long prompt must fit
# (32K tokens of an 8B model, raw bf16: 4 GiB, ~3.5 s at 10 Gbit/s), while a trickling server
# holds an in-step load, and every running request with it, 30 s at most rather than 600.
EXCHANGE_TIMEOUTS = 3
# ... and 30 s at least: a timeout_seconds lowered to fail fast on a dead server must not cap
# a healthy server's long answer (4 GiB at 2 Gbit/s: ~17 s) at 3 s.
MIN_EXCHANGE_SECONDS = 30.0
# lookup_deadline_seconds' default: a lookup is one small POST per rank, milliseconds from a
# healthy server even under load; waiting longer than this for one costs a new request more
# than the prefill of the prefix it might save on a GPU host would.
DEFAULT_LOOKUP_DEADLINE = 0.5
TIER_KEYS = frozenset(f.name for f in dataclasses.fields(TierConfig))


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector was configured with. ``url`` set: remote (a shared ``cacheseek
    serve``); otherwise embedded, with ``tiers`` in the worker process.

    ``model_id`` is part of every key: give the same value to every engine that should
    share blocks (the default, ``default_model_id``, is vLLM's model path with the weights'
    revision and quantization, and the path differs between hosts that keep the weights in
    different folders)."""

    codec: KVLayerCodec
    block_tokens: int = 256
    model_id: str | None = None
    namespace: str = ""
    hash_algo: str = DEFAULT_ALGO
    url: str | None = None
    token: str | None = field(default=None, repr=False)
    # The CA bundle (PEM) that signed an https server's certificate (RemoteCache's verify=):
    # a server with a self-signed or private-CA certificate was trusted only through the
    # undocumented SSL_CERT_FILE. None: the system's CAs.
    ca_bundle: str | None = None
    timeout_seconds: float = 10.0  # each connect, read and write of a remote call
    # One whole HTTP exchange (a request and its whole answer; RemoteCache's exchange_timeout).
    # timeout_seconds alone let a server or proxy that sends a byte now and then hold an
    # in-step load, and every running request with it, for RemoteCache's default 600 s.
    # None: EXCHANGE_TIMEOUTS x timeout_seconds, MIN_EXCHANGE_SECONDS at least (``exchange_timeout``).
    exchange_timeout_seconds: float | None = None
    tiers: TierConfig = field(default_factory=lambda: TierConfig(**DEFAULT_TIERS))
    retry_after_seconds: float = 1.0  # a server that failed is not asked again this long (doubling)
    retry_cap_seconds: float = 30.0
    # A step's load layer by layer (waited for in each attention layer, overlapping the
    # forward) rather than whole before the forward: True, False (the default), or None
    # ("auto": where vLLM's pages are on a GPU, the only place it overlaps). Off by default:
    # on the H200 the layer-wise load itself ran 1.4-1.5x longer than the whole load, which
    # only a forward longer than the difference repays, and it costs vLLM its full CUDA
    # graphs (docs/vllm.md). Only an embedded cache loads layer by layer (a server's frames
    # hold every layer of a block: nothing would overlap).
    layerwise_load: bool | None = False
    # A step's saves layer by layer: each attention layer's save_kv_layer encodes its new
    # blocks into reserved CPU-tier slots while the forward computes the next layer, and
    # wait_for_save only checks and commits (PrefixCache.ingest_batch(..., layerwise=True)).
    # True, False (the default), or None ("auto": where vLLM's pages are on a GPU). Like
    # layer-wise loads it needs vLLM's piecewise CUDA graphs and an embedded cache. Off by
    # default: measured with a stand-in forward, not yet in a vLLM GPU build (docs/vllm.md).
    layerwise_save: bool | None = False
    # A remote cache's saves: wait_for_save encodes the step's new blocks and moves their
    # frames to host memory, and the lookup and the upload follow on the client's sender
    # thread (RemoteCache.ingest_batch(wait=False)), so the step never waits for the
    # network. At most max_pending_bytes of frames wait; a save past it is dropped.
    background_saves: bool = True
    # A remote cache's loads between steps (vLLM's asynchronous loads: the request waits,
    # the others run), not inside the step that first computes the request. Off by default:
    # in vLLM's CPU build on two cores the loader thread competed with the forward for the
    # cores and the GIL, so the running requests gained nothing and the loading one waited
    # 2.5x longer (docs/performance.md, "vLLM connector"); not measured on a GPU host.
    background_loads: bool = False
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    # A remote lookup runs on a thread of its own; vLLM's scheduler waits this long for it at
    # most, then is told "not yet" and asks again at its next step (docs/vllm.md).
    lookup_wait_seconds: float = 0.01
    # A lookup unanswered this long after the scheduler first asked for it is late: the
    # request goes on as a miss and the guard rests the server as after a failure, so a
    # hung or trickling server adds this much to a new request's first token, not the
    # client's timeout. None: DEFAULT_LOOKUP_DEADLINE, or lookup_wait_seconds if longer
    # (``lookup_deadline``).
    lookup_deadline_seconds: float | None = None
    # A remote save that failed is sent again by the request's next save; its last save has
    # none: vLLM keeps a finished request's pages until the workers report it, which they do
    # at once where its saves were stored, else once the lost one was sent again (once, when
    # the guard lets it), this long at most. Longer than retry_after_seconds, which a
    # failure rests the guard for. 0: the pages are freed at once, and a last save's loss stands.
    resave_hold_seconds: float = 2.0

    @property
    def remote(self) -> bool:
        return self.url is not None

    def loads_layerwise(self, device_type: str) -> bool:
        """Whether the worker loads each step layer by layer, its pages on ``device_type``."""
        return self._layerwise(self.layerwise_load, device_type)

    def saves_layerwise(self, device_type: str) -> bool:
        """Whether the worker saves each step layer by layer, its pages on ``device_type``."""
        return self._layerwise(self.layerwise_save, device_type)

    def _layerwise(self, setting: bool | None, device_type: str) -> bool:
        if self.remote:
            return False
        return device_type == "cuda" if setting is None else setting

    @property
    def exchange_timeout(self) -> float:
        """Seconds one HTTP exchange with the server may take in all."""
        if self.exchange_timeout_seconds is not None:
            return self.exchange_timeout_seconds
        return max(EXCHANGE_TIMEOUTS * self.timeout_seconds, MIN_EXCHANGE_SECONDS)

    @property
    def lookup_deadline(self) -> float:
        """Seconds a remote lookup may take before its request goes on as a miss."""
        if self.lookup_deadline_seconds is not None:
            return self.lookup_deadline_seconds
        return max(DEFAULT_LOOKUP_DEADLINE, self.lookup_wait_seconds)

    @property
    def resave_hold(self) -> float:
        """Seconds vLLM keeps a finished request's pages for a lost save (0: it does not)."""
        return self.resave_hold_seconds if self.remote else 0.0

    @property
    def saves_in_background(self) -> bool:
        return self.remote and self.background_saves

    @property
    def loads_in_background(self) -> bool:
        return self.remote and self.background_loads

    @property
    def may_load_layerwise(self) -> bool:
        """Whether some device would load layer by layer (what vLLM must know at start)."""
        return not self.remote and self.layerwise_load is not False

    @property
    def may_work_layerwise(self) -> bool:
        """Whether some device would load or save layer by layer: vLLM must then run the
        attention layers outside its CUDA graphs (their hooks are Python)."""
        return not self.remote and (self.layerwise_load is not False or self.layerwise_save is not False)

    @classmethod
    def from_extra(cls, extra: Any) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; raises ``ConfigError`` naming the bad key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config: expected a JSON object, got {type(extra).__name__}")
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(_KEYS)}")
        kw: dict[str, Any] = {"codec": _codec(extra.get("codec", "int4"), extra.get("group_size"))}
        if "block_tokens" in extra:
            kw["block_tokens"] = _positive_int("block_tokens", extra["block_tokens"])
        for key in ("model_id", "namespace", "hash_algo", "url", "token"):
            if key in extra:
                kw[key] = _string(key, extra[key])
        # Refused as PrefixCache(model_id="") is: an empty one (a template left unfilled) was
        # replaced by vLLM's model path, and engines whose weights lie in other folders
        # silently stopped sharing blocks.
        if kw.get("model_id") == "":
            raise ConfigError("kv_connector_extra_config.model_id: must be a non-empty string (the same on every "
                              "engine that should share blocks; leave the key out for vLLM's model path), got ''")
        for key in ("timeout_seconds", "retry_after_seconds", "retry_cap_seconds", "lookup_wait_seconds",
                    "exchange_timeout_seconds", "lookup_deadline_seconds"):
            if key in extra:
                kw[key] = _positive_float(key, extra[key])
        if kw.get("lookup_deadline_seconds", math.inf) < kw.get("lookup_wait_seconds", 0.0):
            # (the scheduler would wait past the deadline it then calls late)
            raise ConfigError(f"kv_connector_extra_config.lookup_deadline_seconds: must be >= lookup_wait_seconds "
                              f"({kw['lookup_wait_seconds']!r}), got {kw['lookup_deadline_seconds']!r}")
        if "resave_hold_seconds" in extra:
            value = extra["resave_hold_seconds"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
                raise ConfigError(f"kv_connector_extra_config.resave_hold_seconds: must be a number of seconds "
                                  f">= 0 (0: off), got {value!r}")
            kw["resave_hold_seconds"] = float(value)
        for key in ("layerwise_load", "layerwise_save"):
            if key in extra:
                kw[key] = _auto_bool(key, extra[key])
        for key in ("background_saves", "background_loads"):
            if key in extra:
                if not isinstance(extra[key], bool):
                    raise ConfigError(f"kv_connector_extra_config.{key}: must be true or false, got {extra[key]!r}")
                kw[key] = extra[key]
        if "max_pending_bytes" in extra:
            try:
                kw["max_pending_bytes"] = parse_size(extra["max_pending_bytes"], name="max_pending_bytes")
            except ConfigError as exc:
                raise ConfigError(f"kv_connector_extra_config.{exc}") from None
            if kw["max_pending_bytes"] <= 0:
                raise ConfigError(f"kv_connector_extra_config.max_pending_bytes: must be > 0 bytes, "
                                  f"got {extra['max_pending_bytes']!r}")
        if "ca_bundle" in extra:
            kw["ca_bundle"] = _ca_bundle(extra["ca_bundle"])
        if "url" in kw and "tiers" in extra:
            raise ConfigError("kv_connector_extra_config: give either url (remote) or tiers (embedded), not both")
        for key in _REMOTE_ONLY:
            # (an embedded cache stores into its own tiers within the call: nothing to send behind)
            if key in extra and "url" not in kw:
                raise ConfigError(f"kv_connector_extra_config.{key}: only a remote cache (url) takes it")
        if "url" in kw and not kw["url"].startswith(("http://", "https://")):
            raise ConfigError(f"kv_connector_extra_config.url: expected http://host:port, got {kw['url']!r}")
        if "tiers" in extra:
            kw["tiers"] = _tiers(extra["tiers"])
        if kw.get("retry_cap_seconds", 30.0) < kw.get("retry_after_seconds", 1.0):
            raise ConfigError("kv_connector_extra_config.retry_cap_seconds: must be >= retry_after_seconds")
        return cls(**kw)


def default_model_id(model_config: Any) -> str:
    """The ``model_id`` an engine gets when none is configured: vLLM's model, with the
    weights' revision and quantization where they are set. KV computed from other weights is
    other KV: two engines serving one repository at two revisions, or one of them with its
    weights quantized (fp8, AWQ, ...), must not find each other's blocks."""
    model = str(model_config.model)
    revision = str(getattr(model_config, "revision", None) or "")
    quantization = str(getattr(model_config, "quantization", None) or "")
    if any(sep in part for part in (model, revision, quantization) for sep in "@+"):
        # Joined plainly, "m+fp8" would be model "m" quantized to fp8 and "m@v1+fp8" revision
        # "v1+fp8" too. "@@" begins no plain id (a revision never begins with "@"), and JSON
        # reads back as one triple only.
        return "@@" + json.dumps([model, revision, quantization])
    return model + (f"@{revision}" if revision else "") + (f"+{quantization}" if quantization else "")


def _codec(name: Any, group_size: Any) -> KVLayerCodec:
    # A group_size the codec would not use is refused, not dropped: a spec names its own
    # groups, and raw has none.
    if isinstance(name, dict):
        if group_size is not None:
            raise ConfigError("kv_connector_extra_config.group_size: a codec spec names its own group sizes "
                              f"(k_group, v_group); give them there, not group_size={group_size!r}")
        return codec_from_spec(name)
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"kv_connector_extra_config.codec: must be one of {sorted(CODECS)} or a codec spec, got {name!r}")
    if name == "raw" and group_size is not None:
        raise ConfigError(f"kv_connector_extra_config.group_size: only the KIVI codecs take one, not raw "
                          f"(got {group_size!r})")
    group = _positive_int("group_size", DEFAULT_GROUP_SIZE if group_size is None else group_size)
    return CODECS[name](group)


def _tiers(value: Any) -> TierConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"kv_connector_extra_config.tiers: expected an object of TierConfig fields, got {value!r}")
    unknown = sorted(set(value) - TIER_KEYS)
    if unknown:
        raise ConfigError(f"kv_connector_extra_config.tiers: unknown keys {unknown}; known: {sorted(TIER_KEYS)}")
    names = value.get("write_through")
    if names is not None:
        # (a bare string would be read as a list of its letters)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"kv_connector_extra_config.tiers.write_through: expected a list of tier names, "
                              f"got {names!r}")
        value = {**value, "write_through": tuple(names)}
    try:
        return TierConfig(**value)
    except TypeError as exc:
        raise ConfigError(f"kv_connector_extra_config.tiers: {exc}") from None


def _ca_bundle(value: Any) -> str:
    # Checked here, where the key can be named: at the engine's first request (RemoteCache
    # reads it as it is built, inside vLLM's start) the error would name only "verify".
    path = _string("ca_bundle", value)
    try:
        ca_bundle_context(path)
    except ValueError as exc:
        raise ConfigError(f"kv_connector_extra_config.ca_bundle: {exc} (the CA bundle, PEM, that signed the "
                          "server's certificate)") from None
    return path


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config.{name}: must be a positive int, got {value!r}")
    return value


MAX_SECONDS = 1e6  # (11.6 days) a wait past threading's TIMEOUT_MAX (9.2e9 s) raised at the first request


def _positive_float(name: str, value: Any) -> float:
    # Finite and bounded: JSON's Infinity passed, the engine started, and its first lookup
    # raised OverflowError out of vLLM's scheduler (or another key's check blamed the wrong key).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise ConfigError(f"kv_connector_extra_config.{name}: must be a positive number of seconds, at most "
                          f"{MAX_SECONDS:,.0f}, got {value!r}")
    return float(value)


def _auto_bool(name: str, value: Any) -> bool | None:
    if value == "auto":
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{name}: must be true, false or \"auto\", got {value!r}")
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config.{name}: must be a string, got {value!r}")
    return value


__all__ = ["CODECS", "ConnectorConfig"]
