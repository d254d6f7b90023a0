"""Tier construction for the server: the one function that turns settings into a store.

A new tier (Redis) adds its group of settings to ``ServerSettings`` and its lines here.
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
        disk_fsync=settings.disk_fsync,
    )


def build_store(settings: ServerSettings) -> TieredStore:
    return tier_config(settings).build()
