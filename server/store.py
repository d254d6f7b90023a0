"""Tier construction for the server: the one function that turns settings into a store.

Each tier has its group of settings in ``ServerSettings`` and its lines here. The Redis tier
connects lazily: a server starts (and serves from its other tiers) while Redis is down.
"""

from __future__ import annotations

from cacheseek.config import TierConfig
from cacheseek.store.tiered import TieredStore

from .config import ServerSettings


def tier_config(settings: ServerSettings) -> TierConfig:
    disk_on = settings.disk_bytes > 0
    return TierConfig(
        gpu_bytes=0,
        cpu_bytes=settings.cpu_bytes,
        disk_path=settings.disk_path if disk_on else None,
        disk_bytes=settings.disk_bytes,
        # None: every persistent tier below the top receives every ingest (TierConfig's default).
        write_through=None if settings.write_through else (),
        promote_on_hit=settings.promote_on_hit,
        pin_memory=False,  # no GPU reads the server's host memory; pinning would import torch
        cpu_reserve_bytes=settings.cpu_reserve_bytes or 0,
        disk_fsync=settings.disk_fsync,
        disk_group_commit=settings.disk_group_commit,
        disk_read_depth=settings.disk_read_depth,
        max_prefetches=settings.max_prefetches,
        eviction=settings.eviction,
        disk_admit_after_uses=settings.disk_admit_after_uses,
        redis_url=settings.redis_url,
        redis_bytes=settings.redis_bytes,
        redis_ttl_seconds=settings.redis_ttl_seconds,
        redis_prefix=settings.redis_prefix,
        redis_namespace=settings.redis_namespace,
        redis_connect_timeout_seconds=settings.redis_connect_timeout_seconds,
        redis_socket_timeout_seconds=settings.redis_socket_timeout_seconds,
        redis_breaker_failures=settings.redis_breaker_failures,
        redis_breaker_base_seconds=settings.redis_breaker_base_seconds,
        redis_breaker_cap_seconds=settings.redis_breaker_cap_seconds,
    )


def build_store(settings: ServerSettings) -> TieredStore:
    """The store, its disk tier not yet trimmed to ``disk_bytes``: ``store.trim()`` once the
    pins file's pins are made again, so that a smaller budget does not evict a pinned chain."""
    return tier_config(settings).build(trim_disk_at_open=False, max_frame_bytes=settings.max_frame_bytes)
