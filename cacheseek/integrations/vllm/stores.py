"""The cache behind a connector: embedded (one ``PrefixCache`` per process, shared by the
scheduler side and the worker side that vLLM builds in it) or remote (a ``RemoteCache``
per side, all talking to one ``cacheseek serve``).

Embedded needs the scheduler and the worker in one process: vLLM's uniprocess executor,
which it uses when there is one worker (``--tensor-parallel-size 1``, no pipeline
parallelism). vLLM builds the two sides separately, in either order; whichever comes first
builds the cache and the other finds it here, by its whole configuration.
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...layout import KVLayout
from .config import ConnectorConfig


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of the KV a worker holds. Two ranks must never share a block."""

    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"shard: tensor-parallel rank {self.tp_rank} is not in [0, {self.tp_size})")


def shard_model_id(model_id: str, shard: Shard) -> str:
    """The model id that keys this shard's blocks where the root hash cannot take the shard
    itself (a CacheSeek without the engine surface's ``cs.Shard``): the rank goes into the
    model id, which is part of the root, so two ranks' roots differ. A single worker keeps
    the plain model id, so its blocks are the ones any other front (``prefill_with_reuse``,
    another engine) stores for that model."""
    if shard.tp_size == 1:
        return model_id
    return f"{model_id}#tp{shard.tp_rank}of{shard.tp_size}"


def shard_keys(front: type, model_id: str, shard: Shard) -> dict[str, Any]:
    """The constructor arguments that key ``shard``'s blocks apart: ``shard=cs.Shard(...)``
    where the front takes it, else a model id with the rank in it."""
    if "shard" in inspect.signature(front.__init__).parameters:
        import cacheseek as cs

        return {"model_id": model_id, "shard": cs.Shard(tp_rank=shard.tp_rank, tp_size=shard.tp_size)}
    return {"model_id": shard_model_id(model_id, shard)}


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
    ``shard``'s blocks."""
    common = {"layout": layout, "codec": config.codec, "block_tokens": config.block_tokens,
              "namespace": config.namespace, "hash_algo": config.hash_algo}
    if config.remote:
        from ...remote import RemoteCache

        return RemoteCache(config.url, token=config.token, timeout=config.timeout_seconds,
                           **shard_keys(RemoteCache, model_id, shard), **common)
    from ...prefix_cache import PrefixCache

    keys = shard_keys(PrefixCache, model_id, shard)
    name = json.dumps({**common, **keys, "layout": layout.to_dict(), "codec": config.codec.spec(),
                       "tiers": repr(config.tiers)}, sort_keys=True, default=repr)
    return _SHARED.acquire(name, lambda: PrefixCache(tiers=config.tiers, **keys, **common))


def close_cache(config: ConnectorConfig, cache: Any) -> None:
    if config.remote:
        cache.close()
    else:
        _SHARED.release(cache)


__all__ = ["Shard", "close_cache", "open_cache", "shard_keys", "shard_model_id"]
