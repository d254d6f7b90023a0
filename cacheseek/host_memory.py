"""The memory this process may use, and whether a CPU tier's budget fits in it: the
machine's or its cgroup's memory, and the address space its RLIMIT_AS (``ulimit -v``) leaves.

Shared by ``TierConfig.build`` (the embedded cache) and ``cacheseek serve`` (which says it
before it binds its port), so both refuse one budget in the same words."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from .units import format_size

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_limit(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """The memory this process may use, and what sets it: the machine's, or a cgroup's limit
    (a container's, a Slurm job's, a systemd slice's) where lower; 0 where neither can be read.

    A limit holds for every group below the one it is set on: a Slurm job's is set on the
    job's group, its tasks run in groups below (their own ``memory.max`` says "max"), so every
    group from the process's up to the hierarchy's root is read, not the process's alone."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # (no sysconf, or no such name here)
        limit = 0
    where = "the machine's memory"
    for file, value in _cgroup_limits(proc_cgroup, cgroup_root):
        if 0 < value < (limit or value + 1):
            limit, where = value, f"the limit of its cgroup, {file}"
    return limit, where


def _cgroup_limits(proc_cgroup: Path, cgroup_root: Path) -> list[tuple[Path, int]]:
    """Each memory limit readable for the groups this process is in, and the file saying it
    (v2 ``memory.max``; v1 ``memory.limit_in_bytes`` and ``memory.stat``'s
    ``hierarchical_memory_limit``, which counts the groups above one a container cannot see)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, ValueError):
        return []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # (not a cgroup line: the others still are)
            continue
        _, controllers, path = fields
        if controllers == "":
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        # The path is the one the hierarchy's root sees: within a container (a cgroup namespace,
        # or v1's mount of its own group) it may be "/" or absent below base.
        parts = [p for p in path.split("/") if p]
        groups = [] if ".." in parts else [base.joinpath(*parts[:n]) for n in range(len(parts), 0, -1)]
        for group in [*groups, base]:
            value = _number(group / name)
            if value is not None:
                found.append((group / name, value))
            if controllers != "":
                stat = _stat_value(group / "memory.stat", "hierarchical_memory_limit")
                if stat is not None:
                    found.append((group / "memory.stat", stat))
    return found


def _number(file: Path) -> int | None:
    try:
        return int(file.read_text().strip())  # ("max" where none: not a number)
    except (OSError, ValueError):
        return None


def _stat_value(file: Path, key: str) -> int | None:
    try:
        for line in file.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def address_space_left(status: Path = Path("/proc/self/status")) -> tuple[int, int] | None:
    """(bytes this process may still map under its RLIMIT_AS, the limit), or None where it
    has none. What it maps now (``VmSize``) counts; 0 where that cannot be read."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = 0
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - mapped), soft


def cpu_budget_problem(cpu_bytes: int, reserve_bytes: int) -> str | None:
    """Why a CPU tier of ``cpu_bytes`` (and its reserve) cannot work here, or None. Its memory
    is mapped lazily, so an impossible budget (100TiB, a typo for GiB) started, and the
    process was killed for memory only once traffic had filled what there is (or, under
    RLIMIT_AS, ran with a tier capped at the chunks it could map: ``HostArena.capped``)."""
    asked = (f"cpu_bytes: {format_size(cpu_bytes)} and its reserve (cpu_reserve_bytes {format_size(reserve_bytes)}) "
             "are more than")
    limit, where = memory_limit()
    if limit and cpu_bytes + reserve_bytes > limit:
        return (f"{asked} the memory this process may use, {format_size(limit)} ({where}): it would be killed "
                "for memory before the CPU tier filled; give less")
    space = address_space_left()
    if space is not None and cpu_bytes + reserve_bytes > space[0]:
        return (f"{asked} the address space this process may still map, {format_size(space[0])} (its RLIMIT_AS, "
                f"ulimit -v, is {format_size(space[1])}, less what it maps now): the CPU tier could not map its "
                "memory; give less, or raise the limit")
    return None
