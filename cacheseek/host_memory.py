"""The memory this process may use, and whether a CPU tier's budget fits in it.

Shared by ``TierConfig.build`` (the embedded cache) and ``cacheseek serve`` (which says it
before it binds its port), so both refuse one budget in the same words."""

from __future__ import annotations

import os
from pathlib import Path

from .units import format_size


def memory_limit() -> tuple[int, str]:
    """The memory this process may use, and what sets it: the machine's, or its cgroup's
    limit (a container's) where lower; 0 where neither can be read."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # (no sysconf, or no such name here)
        limit = 0
    where = "the machine's memory"
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # cgroup v2
                candidates += [Path("/sys/fs/cgroup", path.lstrip("/"), "memory.max"), Path("/sys/fs/cgroup/memory.max")]
            elif "memory" in controllers.split(","):  # cgroup v1
                candidates += [Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes"),
                               Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")]
    except (OSError, ValueError):
        pass
    for file in candidates:
        try:
            value = int(file.read_text().strip())  # ("max" where none: not a number)
        except (OSError, ValueError):
            continue
        if 0 < value < (limit or value + 1):
            limit, where = value, f"the limit of its cgroup, {file}"
    return limit, where


def cpu_budget_problem(cpu_bytes: int, reserve_bytes: int) -> str | None:
    """Why a CPU tier of ``cpu_bytes`` (and its reserve) cannot work here, or None. Its memory
    is mapped lazily, so an impossible budget (100TiB, a typo for GiB) started, and the
    process was killed for memory only once traffic had filled what there is."""
    limit, where = memory_limit()
    if not limit or cpu_bytes + reserve_bytes <= limit:
        return None
    return (f"cpu_bytes: {format_size(cpu_bytes)} and its reserve (cpu_reserve_bytes {format_size(reserve_bytes)}) "
            f"are more than the memory this process may use, {format_size(limit)} ({where}): it would be killed "
            "for memory before the CPU tier filled; give less")
