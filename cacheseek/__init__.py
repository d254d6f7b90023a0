"""CacheSeek: a tiered KV-cache store for exact-prefix reuse.

    import cacheseek as cs
    layout = cs.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
    codec = cs.KIVI(bits=4, group_size=32)
"""

from .errors import CacheSeekError, ChecksumError, ConfigError, FrameError, InputError, StorageError
from .hashing import BlockHash
from .config import TierConfig
from .layout import KVLayout
from .prefix_cache import IngestResult, Located, Materialized, PrefixCache
from .quant import KIVI, KVLayerCodec, Raw

__version__ = "0.1.0"

__all__ = [
    "KIVI",
    "BlockHash",
    "CacheSeekError",
    "ChecksumError",
    "ConfigError",
    "FrameError",
    "IngestResult",
    "InputError",
    "KVLayerCodec",
    "KVLayout",
    "Located",
    "Materialized",
    "PrefixCache",
    "Raw",
    "StorageError",
    "TierConfig",
    "__version__",
]
