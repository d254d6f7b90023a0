"""CacheSeek: a tiered KV-cache store for exact-prefix reuse.

    import cacheseek as cs
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
    codec = cs.KIVI(bits=4, group_size=32)

The names that need torch (``PrefixCache``, ``RemoteCache`` and their results) are
imported on first use, so ``import cacheseek`` (and so the store and the server, which
move bytes only) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import TierConfig
from .errors import (
    CacheSeekError,
    ChecksumError,
    ConfigError,
    FrameError,
    FrameVersionError,
    InputError,
    LoadError,
    PoolExhausted,
    RemoteBusy,
    RemoteError,
    RemoteUnavailable,
    StorageError,
    TierUnavailable,
)
from .hashing import BlockHash, ExtraKeys, MMInput, Shard
from .layout import KVLayout
from .prefix_keys import HashedKeys, Prompt
from .quant import KIVI, KVLayerCodec, PrecisionPolicy, Raw

if TYPE_CHECKING:
    from .layerwise import LayerwiseIngest, LayerwiseLoad
    from .layerwise_save import LayerwiseSave
    from .pages import KVPages, PagedKV, PagedRequest
    from .prefix_cache import PrefixCache
    from .remote import RemoteCache
    from .results import IngestResult, Loaded, Located, Materialized

__version__ = "0.1.0"

# name -> module that defines it, imported on first access (PEP 562)
_LAZY = {
    "IngestResult": ".results",
    "KVPages": ".pages",
    "LayerwiseIngest": ".layerwise",
    "LayerwiseLoad": ".layerwise",
    "LayerwiseSave": ".layerwise_save",
    "Loaded": ".results",
    "PagedKV": ".pages",
    "PagedRequest": ".pages",
    "Located": ".results",
    "Materialized": ".results",
    "PrefixCache": ".prefix_cache",
    "RemoteCache": ".remote",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cacheseek' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "KIVI",
    "BlockHash",
    "CacheSeekError",
    "ChecksumError",
    "ConfigError",
    "ExtraKeys",
    "FrameError",
    "FrameVersionError",
    "HashedKeys",
    "IngestResult",
    "InputError",
    "KVLayerCodec",
    "KVLayout",
    "KVPages",
    "LayerwiseIngest",
    "LayerwiseLoad",
    "LayerwiseSave",
    "LoadError",
    "Loaded",
    "Located",
    "MMInput",
    "Materialized",
    "PagedKV",
    "PagedRequest",
    "PrecisionPolicy",
    "PrefixCache",
    "Prompt",
    "Raw",
    "PoolExhausted",
    "RemoteBusy",
    "RemoteCache",
    "RemoteError",
    "RemoteUnavailable",
    "Shard",
    "StorageError",
    "TierConfig",
    "TierUnavailable",
    "__version__",
]
