"""The small state files the server keeps beside the disk tier (owners, pins): each saved as
temp file, fsync, rename, then an fsync of the directory, so that an answer that says it is
saved (a pin's ``saved``) holds across a power cut, not only across a crash of the process."""

from __future__ import annotations

import os
from pathlib import Path


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the synced ``tmp`` over ``path`` and make the rename durable: without the
    directory's fsync, a power cut could leave the directory naming the old file."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the entries made or renamed in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
