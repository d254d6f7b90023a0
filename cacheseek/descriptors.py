"""The process's file descriptors: its limit (RLIMIT_NOFILE, ``ulimit -n``), which a server
raises to the hard one at start, and the least it should have.

Every client connection holds a descriptor, and so does every disk read and write in
flight. Once they run out, new connections are closed unanswered (uvloop's libuv accepts
and closes them to drain the backlog) and disk writes fail."""

from __future__ import annotations

import logging
from dataclasses import dataclass

try:
    import resource
except ImportError:  # (not on Windows: no limit to read or raise)
    resource = None  # type: ignore[assignment]

log = logging.getLogger("cacheseek.descriptors")

# The least a server should have: systemd's default soft limit, which 64 clients of 16
# connections each already fill. Below it the start warns.
MIN_DESCRIPTORS = 1024
# The server's own descriptors besides its connections and disk I/O: the listening socket,
# the disk tier's lock and directories, the event loop's, log files, Redis connections.
OWN_DESCRIPTORS = 64
# Where the hard limit is unlimited: the soft one is raised to this (Linux refuses more than
# fs.nr_open, 1048576 by default; macOS more than OPEN_MAX).
UNLIMITED_CAP = 1 << 20


@dataclass(frozen=True, slots=True)
class Limit:
    """RLIMIT_NOFILE: ``soft`` (what the process may hold), ``hard`` (the most the soft one
    may be raised to without privilege; None: unlimited), ``was``: the soft limit before
    the start raised it (equal to ``soft`` where it did not)."""

    soft: int
    hard: int | None
    was: int

    @property
    def raised(self) -> bool:
        return self.soft > self.was


def current_limit() -> Limit | None:
    """The process's RLIMIT_NOFILE, or None where there is none to read."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    soft = UNLIMITED_CAP if soft == infinite else soft
    return Limit(soft=soft, hard=None if hard == infinite else hard, was=soft)


def raise_soft_limit(cap: int = UNLIMITED_CAP) -> Limit | None:
    """Raise the soft RLIMIT_NOFILE to the hard one (to ``cap`` where that is unlimited), as
    nginx, redis and Go's runtime do: the soft default (1024 under systemd, a login shell's
    ulimit) is a compatibility figure for select(), which nothing here uses. A soft limit
    above already is kept. Returns the limit now, or None where there is none."""
    limit = current_limit()
    if limit is None:
        return None
    target = limit.hard if limit.hard is not None else max(limit.soft, cap)
    hard = resource.RLIM_INFINITY if limit.hard is None else limit.hard
    while target > limit.soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # (above fs.nr_open, or macOS's OPEN_MAX: less, then)
            log.debug("RLIMIT_NOFILE: a soft limit of %d refused: %s", target, exc)
            target //= 2
            continue
        return Limit(soft=target, hard=limit.hard, was=limit.soft)
    return limit


def needed(disk_read_depth: int = 0, connections: int = 0) -> int:
    """The descriptors a server should have at least: its own, its disk reads in flight, the
    ``connections`` it should take, and never under ``MIN_DESCRIPTORS``."""
    return max(MIN_DESCRIPTORS, OWN_DESCRIPTORS + disk_read_depth + connections)
