"""``TierConfig``: which tiers an embedded cache (or a server) runs, as plain data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .store.tiered import TieredStore
from .units import parse_size

TIER_ORDER = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets take ints or strings like ``"4GiB"``; a budget of 0 turns a tier off.

    ``write_through`` names the persistent tiers that receive every ingest (default: all
    of them, so acknowledged blocks survive a crash); other tiers fill by demotion.
    """

    gpu_bytes: int | str = 0
    cpu_bytes: int | str = "4GiB"
    disk_path: str | Path | None = None
    disk_bytes: int | str = "64GiB"
    write_through: tuple[str, ...] | None = None
    promote_on_hit: bool = True
    pin_memory: bool = True
    gpu_device: str = "cuda"
    disk_fsync: bool = True

    def build(self) -> TieredStore:
        from .store.cpu import CpuTier
        from .store.disk import DiskTier

        tiers = []
        gpu = parse_size(self.gpu_bytes, name="gpu_bytes")
        if gpu:
            from .store.gpu import GpuTier

            tiers.append(GpuTier(gpu, device=self.gpu_device))
        cpu = parse_size(self.cpu_bytes, name="cpu_bytes")
        if cpu:
            tiers.append(CpuTier(cpu, pin=self.pin_memory))
        if self.disk_path is not None:
            tiers.append(DiskTier(self.disk_path, parse_size(self.disk_bytes, name="disk_bytes"), fsync=self.disk_fsync))
        if not tiers:
            raise ConfigError("TierConfig: no tier is on; give gpu_bytes, cpu_bytes or disk_path")
        persistent = [t.name for t in tiers[1:] if t.persistent]
        write_through = persistent if self.write_through is None else list(self.write_through)
        return TieredStore(tiers, write_through=write_through, promote_on_hit=self.promote_on_hit)
