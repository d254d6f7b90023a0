"""The small state files the server keeps beside the disk tier (owners, pins): each saved as
temp file, fsync, rename, then an fsync of the directory, so that an answer that says it is
saved (a pin's ``saved``) holds across a power cut, not only across a crash of the process."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from cacheseek.store.disk import fsync_dir

__all__ = ["fsync_dir", "read_state", "replace_durably", "write_text_durably"]

log = logging.getLogger("cacheseek.server")


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the synced ``tmp`` over ``path`` and make the rename durable: without the
    directory's fsync, a power cut could leave the directory naming the old file."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    """``text`` as ``path`` (mode 0600): temp file, fsync, ``replace_durably``."""
    tmp = path.with_name(f"{path.name}.{os.urandom(4).hex()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise



def read_state(path: Path, version: int, what: str) -> dict[str, Any] | None:
    """The state file's JSON object, or None where there is none or it cannot be used. One
    unreadable (torn, hand-edited, unreadable by this user) or of another version (a newer
    release's) is said, and moved aside to ``NAME.unreadable``: left in place, the next save
    replaced it, and what it held was gone for good without a word."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # (JSON nested ~1000 deep: RecursionError)
        problem = f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    else:
        if isinstance(data, dict) and data.get("version") == version:
            return data
        found = data.get("version") if isinstance(data, dict) else None
        problem = f"of version {found!r}, where this release reads version {version}"
    aside = path.with_name(path.name + ".unreadable")
    for n in range(1, 100):  # (one set aside before is kept: a second must not replace it)
        if not aside.exists():
            break
        aside = path.with_name(f"{path.name}.unreadable.{n}")
    try:
        os.replace(path, aside)
        kept = f"moved to {aside} (the next save writes a new one)"
    except OSError as exc:
        kept = f"left in place: it could not be moved aside ({exc}), and the next save replaces it"
    log.warning("cacheseek serve: the %s file %s is %s: the server starts without what it names; %s",
                what, path, problem, kept)
    return None
