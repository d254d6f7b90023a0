"""The small state files the server keeps beside the disk tier (owners, pins): each saved as
temp file, fsync, rename, then an fsync of the directory, so that an answer that says it is
saved (a pin's ``saved``) holds across a power cut, not only across a crash of the process."""

from __future__ import annotations

import os
from pathlib import Path

from cacheseek.store.disk import fsync_dir

__all__ = ["fsync_dir", "replace_durably"]


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the synced ``tmp`` over ``path`` and make the rename durable: without the
    directory's fsync, a power cut could leave the directory naming the old file."""
    os.replace(tmp, path)
    fsync_dir(path.parent)

