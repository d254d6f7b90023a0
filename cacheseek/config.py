"""``TierConfig``: which tiers an embedded cache (or a server) runs, as plain data."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .host_memory import cpu_budget_problem
from .store.arena import cpu_chunk_bytes
from .store.eviction import DEFAULT_POLICY, check_policy
from .store.tier import Tier
from .store.tiered import TieredStore
from .units import format_size, parse_size

TIER_ORDER = ("gpu", "cpu", "disk", "redis")


def default_cpu_reserve(cpu_bytes: int) -> int:
    """The CPU tier's reserve unless one is given: an eighth of its budget, at most 1 GiB."""
    return min(cpu_bytes // 8, 1 << 30)


def _check_gpu_device(gpu_bytes: int, device: str) -> None:
    """A GPU tier's device is one torch sees (else torch's own error came from deep inside
    it: ``AssertionError: Torch not compiled with CUDA enabled`` on a CPU build)."""
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"gpu_device: {device!r} is not a torch device ({exc})") from None
    if where.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"gpu_bytes: {format_size(gpu_bytes)} asks for a GPU tier, but torch sees no CUDA device "
                          f"(torch {torch.__version__}); give gpu_bytes=0 on a machine without a GPU")
    count = torch.cuda.device_count()
    if where.index is not None and where.index >= count:
        raise ConfigError(f"gpu_device: {device!r} is not one of the {count} CUDA device{'s' if count != 1 else ''} "
                          "torch sees")


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets take ints or strings like ``"4GiB"``; a budget of 0 turns a tier off.

    ``write_through`` names the persistent tiers that receive every ingest (default: all
    of them, so acknowledged blocks survive a crash); other tiers fill by demotion.

    The ``redis`` tier is on when ``redis_url`` is set (``redis://host:port`` for one Redis,
    ``redis+cluster://host:port[,host:port...]`` for Redis Cluster; see docs/redis.md). It
    is persistent, so it is written through by default; ``write_through=()`` makes it
    fill by demotion only (write-back). ``redis_bytes`` is the budget of the namespace,
    shared by every process using it; ``redis_ttl_seconds`` expires blocks unused that
    long. The breaker opens after ``redis_breaker_failures`` consecutive failures and
    probes again after ``redis_breaker_base_seconds``, doubling up to the cap.

    ``eviction`` names the policy of the gpu, cpu and disk tiers (``store.eviction``:
    ``"arc"``, the default, or ``"lru"``); the Redis tier's shared index is LRU.
    ``disk_admit_after_uses`` > 1 writes a block to disk only once it has been used that
    many times (the ingest counts as the first): fewer SSD writes, at the cost of the
    blocks used once and of crash safety for blocks not yet admitted.
    """

    gpu_bytes: int | str = 0
    cpu_bytes: int | str = "4GiB"
    disk_path: str | Path | None = None
    disk_bytes: int | str = "64GiB"
    write_through: tuple[str, ...] | None = None
    promote_on_hit: bool = True
    pin_memory: bool = True
    # Map (pinned: page-lock) the CPU tier's whole budget when the cache is built, ~0.5 s a
    # GiB pinned, rather than a 1 GiB chunk at a time inside the ingests of its first fill
    # (which then stall on it: benchmarks/first_fill.py).
    cpu_map_at_start: bool = False
    # Host memory the CPU tier may lend beyond its budget to frames still being written
    # (a GPU ingest encodes into it, the server receives request bodies into it); eviction
    # makes room at commit. None: an eighth of cpu_bytes, at most 1 GiB.
    cpu_reserve_bytes: int | str | None = None
    gpu_device: str = "cuda"
    eviction: str = DEFAULT_POLICY
    disk_admit_after_uses: int = 1
    disk_fsync: bool = True
    # Commit a batch of frames together (data files, then sidecars, then one fsync per shard
    # directory); False: one frame at a time (store/disk.py). Durable on return either way.
    disk_group_commit: bool = True
    # Whole-file reads the disk tier keeps in flight.
    disk_read_depth: int = 16
    # Background promotions (prefetches) in flight at once; more are refused.
    max_prefetches: int = 4
    redis_url: str | None = None
    redis_bytes: int | str = "16GiB"
    redis_ttl_seconds: float | None = None
    redis_prefix: str = "cacheseek"
    redis_namespace: str = "default"
    redis_connect_timeout_seconds: float = 1.0
    redis_socket_timeout_seconds: float = 2.0
    redis_breaker_failures: int = 3
    redis_breaker_base_seconds: float = 1.0
    redis_breaker_cap_seconds: float = 30.0

    def build(self, *, trim_disk_at_open: bool = True, max_frame_bytes: int | None = None) -> TieredStore:
        """The store. ``trim_disk_at_open=False``: a disk tier holding more than ``disk_bytes``
        at open is trimmed to it only by the store's ``trim()``, which its owner calls once the
        pins it keeps are made again (the server: ``.cacheseek-pins.json``); else it is
        trimmed here, once the tiers below that take what it evicts are built.
        ``max_frame_bytes``: the largest frame the owner writes or reads; the CPU tier's chunks
        hold one at least (``arena.cpu_chunk_bytes``); the disk tier reads
        no larger file (``DiskTier``), the Redis tier no more of a value than one byte past it
        (``RedisTier``): either is a corrupt frame, deleted."""
        check_policy(self.eviction, what="eviction")
        if isinstance(self.disk_admit_after_uses, bool) or not isinstance(self.disk_admit_after_uses, int) \
                or self.disk_admit_after_uses < 1:
            raise ConfigError(f"disk_admit_after_uses: must be an int >= 1, got {self.disk_admit_after_uses!r}")
        if self.disk_path is not None and (not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path)):
            # (checked before any tier is built: a CPU tier's pinned memory is not made for nothing)
            raise ConfigError(f"disk_path: must be a directory path (str or Path), got {self.disk_path!r}")
        cpu = parse_size(self.cpu_bytes, name="cpu_bytes")
        if cpu:
            # (before any tier is made) The tier's memory is mapped lazily: a budget past what
            # there is would build, and the process be killed for memory once traffic filled it.
            problem = cpu_budget_problem(cpu, self.resolved_cpu_reserve_bytes())
            if problem:
                raise ConfigError(problem)
        tiers: list[Tier] = []
        try:
            store = self._build_tiers(tiers, cpu, max_frame_bytes)
        except BaseException:
            # (a bad redis_url, write_through, or a signal, found once the tiers above are
            # made) Given back: held by the error's traceback, the disk directory stayed
            # locked to this process, and a build with the setting fixed was refused it.
            for tier in tiers:
                tier.close()
            raise
        if trim_disk_at_open:
            try:
                store.trim()  # (once the tiers below are there: what the disk trims is handed down)
            except BaseException:
                store.close()  # (the disk's lock given back)
                raise
        return store

    def _build_tiers(self, tiers: list[Tier], cpu: int, max_frame_bytes: int | None) -> TieredStore:
        """The store over the tiers asked for, each appended to ``tiers`` once made (for
        ``build`` to close, should a later one fail)."""
        from .store.cpu import CpuTier
        from .store.disk import DiskTier

        gpu = parse_size(self.gpu_bytes, name="gpu_bytes")
        if gpu:
            from .store.gpu import GpuTier

            _check_gpu_device(gpu, self.gpu_device)
            tiers.append(GpuTier(gpu, device=self.gpu_device, policy=self.eviction))
        if cpu:
            tiers.append(CpuTier(cpu, pin=self.pin_memory, reserve_bytes=self.resolved_cpu_reserve_bytes(),
                                 policy=self.eviction, map_at_start=self.cpu_map_at_start,
                                 chunk_bytes=cpu_chunk_bytes(max_frame_bytes)))
        if self.disk_path is not None:
            if isinstance(self.disk_read_depth, bool) or not isinstance(self.disk_read_depth, int) \
                    or not 1 <= self.disk_read_depth <= 256:
                raise ConfigError(f"disk_read_depth: must be an int in [1, 256], got {self.disk_read_depth!r}")
            tiers.append(DiskTier(self.disk_path, parse_size(self.disk_bytes, name="disk_bytes"),
                                  fsync=self.disk_fsync, policy=self.eviction, group_commit=self.disk_group_commit,
                                  read_depth=self.disk_read_depth, pin=self.pin_memory,
                                  trim_at_open=False, max_frame_bytes=max_frame_bytes))
        redis_bytes = parse_size(self.redis_bytes, name="redis_bytes")
        if self.redis_url is not None and redis_bytes:
            tiers.append(self.build_redis_tier(redis_bytes, max_frame_bytes=max_frame_bytes))
        if not tiers:
            raise ConfigError("TierConfig: no tier is on; give gpu_bytes, cpu_bytes, disk_path or redis_url")
        persistent = [t.name for t in tiers[1:] if t.persistent]
        write_through = persistent if self.write_through is None else list(self.write_through)
        admit = {"disk": self.disk_admit_after_uses} if self.disk_path is not None and len(tiers) > 1 else {}
        admit = {k: v for k, v in admit.items() if k in [t.name for t in tiers[1:]]}
        return TieredStore(tiers, write_through=write_through, promote_on_hit=self.promote_on_hit,
                           admit_after=admit, max_prefetches=self.max_prefetches)

    def resolved_cpu_reserve_bytes(self) -> int:
        if self.cpu_reserve_bytes is None:
            return default_cpu_reserve(parse_size(self.cpu_bytes, name="cpu_bytes"))
        return parse_size(self.cpu_reserve_bytes, name="cpu_reserve_bytes")

    def build_redis_tier(self, capacity_bytes: int, *, max_frame_bytes: int | None = None):
        """The redis tier alone (it connects lazily: building never fails for a Redis that is
        down). ``max_frame_bytes``: as ``build``'s."""
        from .store.breaker import CircuitBreaker, ExponentialBackoff
        from .store.redis_client import RedisTimeouts
        from .store.redis_tier import RedisTier

        breaker = CircuitBreaker(
            failure_threshold=self.redis_breaker_failures,
            backoff=ExponentialBackoff(base_seconds=self.redis_breaker_base_seconds,
                                       cap_seconds=self.redis_breaker_cap_seconds),
        )
        if self.redis_url is None:
            raise ConfigError("build_redis_tier: redis_url is not set")
        timeouts = RedisTimeouts(connect_seconds=self.redis_connect_timeout_seconds,
                                 socket_seconds=self.redis_socket_timeout_seconds)
        return RedisTier(self.redis_url, capacity_bytes, prefix=self.redis_prefix, namespace=self.redis_namespace,
                         ttl_seconds=self.redis_ttl_seconds, timeouts=timeouts, breaker=breaker,
                         max_frame_bytes=max_frame_bytes)
