"""The process's file descriptors: its limit (RLIMIT_NOFILE, ``ulimit -n``), which a server
raises to the hard one at start, and a record of each time they ran out (EMFILE, ENFILE).

Every client connection holds a descriptor, and so does every disk read and write in
flight. Once they run out, new connections are closed unanswered (uvloop's libuv accepts
and closes them to drain the backlog, and reports nothing) and disk writes fail. The
descriptors are the process's, not a tier's: one record (``EXHAUSTION``) for all who meet
the shortage (a disk tier's opens, the server's accept and its check), counted by place and
said in the log once a minute at most per place, with the limit and the remedy: the failed
write's own line ("Too many open files") names neither."""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass

from .log_throttle import LogThrottle

try:
    import resource
except ImportError:  # (not on Windows: no limit to read or raise)
    resource = None  # type: ignore[assignment]

log = logging.getLogger("cacheseek.descriptors")

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})
# The least a server should have: systemd's default soft limit, which 64 clients of 16
# connections each already fill. Below it the start warns.
MIN_DESCRIPTORS = 1024
# The server's own descriptors besides its connections and disk I/O: the listening socket,
# the disk tier's lock and directories, the event loop's, log files, Redis connections.
OWN_DESCRIPTORS = 64
# Where the hard limit is unlimited: the soft one is raised to this (Linux refuses more than
# fs.nr_open, 1048576 by default; macOS more than OPEN_MAX).
UNLIMITED_CAP = 1 << 20
EXHAUSTED_LOG_SECONDS = 60.0
# Where the shortage was met: ``accept``: a failed accept the event loop reported (the
# asyncio loop; uvloop's libuv reports none); ``check``: the server's check, once a second,
# found none free (new connections are then being closed unanswered, whichever loop);
# ``disk_read``, ``disk_write``: a disk tier's open of a block's file.
PLACES = ("accept", "check", "disk_read", "disk_write")


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


def open_count() -> int | None:
    """How many descriptors the process holds (Linux's /proc), or None where that cannot be
    read: elsewhere, or with none left to open the directory."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError:
        return None


class Exhaustion:
    """Each time the descriptors ran out, by place (``PLACES``), and its log line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(PLACES, 0)
        self._said = {place: LogThrottle(EXHAUSTED_LOG_SECONDS) for place in PLACES}

    def note(self, place: str, exc: BaseException | None = None) -> None:
        """Count one shortage met at ``place`` (one of ``PLACES``), and say it where due."""
        with self._lock:
            self._counts[place] += 1
        count = self._said[place].due()
        if not count:
            return
        limit = current_limit()
        held = f"all {limit.soft:,} it may hold" if limit is not None else "all it may hold"
        hard = "" if limit is None else f", hard limit {limit.hard:,}" if limit.hard is not None else ", no hard limit"
        cause = "the system's table is full (ENFILE, fs.file-max)" if getattr(exc, "errno", None) == errno.ENFILE else (
            f"the process holds {held} (RLIMIT_NOFILE, ulimit -n{hard})")
        more = f" ({count} times since the last such line, one a minute at most)" if count > 1 else ""
        log.warning("out of file descriptors at %s: %s. Each client connection holds one, as does each disk read "
                    "and write in flight: until some close, new connections are closed unanswered and disk reads "
                    "and writes fail. Raise the limit (docs/operations.md, File descriptors)%s",
                    _WHAT[place], cause, more)

    def check(self) -> bool:
        """Whether a descriptor can be had now; where none can, counted at ``check``. The
        server calls it once a second: under uvloop, connections closed at accept for want
        of one are reported nowhere else."""
        try:
            fd = os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno not in EXHAUSTED:
                return True  # (another failure than a shortage of descriptors: not this check's)
            self.note("check", exc)
            return False
        os.close(fd)
        return True

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


_WHAT = {"accept": "accept (a new connection could not be taken)",
         "check": "the server's check (no descriptor free: new connections are being dropped)",
         "disk_read": "a disk read (a block's file could not be opened)",
         "disk_write": "a disk write (a block's file could not be created)"}

# The process's one record: the descriptors are the process's, whoever meets their end.
EXHAUSTION = Exhaustion()


def note_if_exhausted(place: str, exc: BaseException) -> None:
    """Record ``exc`` at ``place`` where it is a shortage of descriptors (EMFILE, ENFILE)."""
    if isinstance(exc, OSError) and exc.errno in EXHAUSTED:
        EXHAUSTION.note(place, exc)


def figures() -> dict[str, object]:
    """``/v1/stats``' ``descriptors``: the limit, how many are held, and each time they ran out."""
    limit = current_limit()
    return {"limit": limit.soft if limit is not None else None, "hard_limit": limit.hard if limit is not None else None,
            "open": open_count(), "exhausted": EXHAUSTION.counts()}
