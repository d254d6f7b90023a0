"""The cache behind a connector: embedded (one ``PrefixCache`` per process, shared by the
scheduler side and the worker side that vLLM builds in it) or remote (a ``RemoteCache``
per side, all talking to one ``cacheseek serve``).

Embedded needs the scheduler and the worker in one process: vLLM's uniprocess executor,
which it uses when there is one worker (``--tensor-parallel-size 1``, no pipeline
parallelism). vLLM builds the two sides separately, in either order; whichever comes first
builds the cache and the other finds it here, by its whole configuration.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ...config import TierConfig
from ...errors import ConfigError
from ...hashing import Shard
from ...layout import KVLayout
from .config import DEFAULT_TIERS, TIER_KEYS, ConnectorConfig


class _Shared:
    """Process-wide embedded caches, counted by their users (at most one per side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, tuple[Any, int]] = {}

    def acquire(self, key: str, build) -> Any:
        with self._lock:
            cache, users = self._caches.get(key, (None, 0))
            if cache is None:
                cache = build()
            self._caches[key] = (cache, users + 1)
            return cache

    def release(self, cache: Any) -> None:
        with self._lock:
            for key, (held, users) in list(self._caches.items()):
                if held is cache:
                    if users > 1:
                        self._caches[key] = (held, users - 1)
                    else:
                        del self._caches[key]
                        held.close()
                    return


_SHARED = _Shared()


def open_cache(config: ConnectorConfig, layout: KVLayout, model_id: str, shard: Shard) -> Any:
    """A ``RemoteCache`` (``config.url`` set) or the process's shared ``PrefixCache``, for
    ``shard``'s blocks (``cs.Shard`` is part of the root hash: two ranks never share a
    block; a single worker's ``Shard()`` keys as any other front of the model does)."""
    common: dict[str, Any] = {"layout": layout, "codec": config.codec, "block_tokens": config.block_tokens,
              "namespace": config.namespace, "hash_algo": config.hash_algo, "model_id": model_id, "shard": shard}
    if config.url is not None:  # (config.remote)
        from ...remote import RemoteCache

        return RemoteCache(config.url, token=config.token, timeout=config.timeout_seconds,
                           exchange_timeout=config.exchange_timeout,
                           max_pending_bytes=config.max_pending_bytes,
                           verify=config.ca_bundle if config.ca_bundle is not None else True, **common)
    from ...prefix_cache import PrefixCache

    name = json.dumps({**common, "layout": layout.to_dict(), "codec": config.codec.spec(),
                       "shard": shard.fingerprint().hex(), "tiers": repr(config.tiers)}, sort_keys=True, default=repr)
    try:
        return _SHARED.acquire(name, lambda: PrefixCache(tiers=config.tiers, **common))
    except ConfigError as exc:
        raise _as_connectors(exc, config) from None


def _as_connectors(exc: ConfigError, config: ConnectorConfig) -> ConfigError:
    """A tier's setting refused as the cache is built (inside vLLM's engine start: a CPU tier
    over the host's memory), named as the connector's key, and as its default where none was
    given: "cpu_bytes: ... give less" told a user who never wrote cpu_bytes neither."""
    key = str(exc).split(":", 1)[0]
    if type(exc) is not ConfigError or key not in TIER_KEYS:
        return exc
    default = config.tiers == TierConfig(**DEFAULT_TIERS)
    why = f" (the default tiers, {json.dumps(DEFAULT_TIERS)}: give tiers a smaller {key})" if default else ""
    return ConfigError(f"kv_connector_extra_config.tiers.{exc}{why}")


def close_cache(config: ConnectorConfig, cache: Any) -> None:
    if config.remote:
        cache.close()
    else:
        _SHARED.release(cache)


def check_at_start(cache: Any, *, write: bool) -> None:
    """A token the server refuses, or a server certificate not trusted, failed every call
    after, each logged as an outage, and vLLM computed everything: said at start instead,
    naming the key to fix (a server not up yet is no error here: the guard handles outages)."""
    try:
        cache.check_token(write=write)
    except ConfigError as exc:
        key, _, why = str(exc).partition(": ")
        # (RemoteCache's verify= is this config's ca_bundle)
        raise ConfigError(f"kv_connector_extra_config.{'ca_bundle' if key == 'verify' else key}: {why}") from None


__all__ = ["check_at_start", "close_cache", "open_cache"]
