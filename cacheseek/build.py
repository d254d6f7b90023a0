"""Which build is running: the git commit of the checkout the package runs from.

The package's version (``cacheseek.__version__``) has been 0.1.0 in every build, so it cannot
tell the processes of a rolling upgrade apart. The commit can, where the package runs from a
git checkout (``pip install -e .``, or ``PYTHONPATH``). It is read from the checkout's files
(``.git/HEAD`` and the ref it names, loose or packed; a worktree's ``.git`` file), once, on
first use: no ``git`` process, nothing on a request's path after the first. Elsewhere (an
installed wheel, a container image built without ``.git``) it is ``"unknown"``.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from pathlib import Path

UNKNOWN = "unknown"
SHORT = 12  # hex digits shown: unique in any repository of this size
_HASH = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1, or SHA-256
_REF = re.compile(r"refs/[A-Za-z0-9._/-]+")  # a branch's ref, inside the repository's directory
SMALL_FILE = 4096  # HEAD, a loose ref, a .git or commondir file
PACKED_REFS_BYTES = 16 << 20


@functools.cache
def commit() -> str:
    """The short commit of the checkout this package runs from, or ``"unknown"``."""
    try:
        found = _commit_of(Path(__file__).resolve().parent.parent)
    except (OSError, UnicodeDecodeError, ValueError, MemoryError):
        found = None
    return found[:SHORT] if found else UNKNOWN


def _commit_of(root: Path) -> str | None:
    dot = root / ".git"
    if dot.is_file():  # a worktree or a submodule: "gitdir: <path>"
        text = _read(dot)
        if not text.startswith("gitdir:"):
            return None
        git_dir = (root / text[len("gitdir:"):].strip()).resolve()
    elif dot.is_dir():
        git_dir = dot
    else:
        return None
    head = _read(git_dir / "HEAD")
    if not head.startswith("ref:"):
        return head if _HASH.fullmatch(head) else None  # a detached HEAD
    ref = head[len("ref:"):].strip()
    if not _REF.fullmatch(ref) or ".." in ref.split("/"):
        return None  # (read nothing outside the repository's directory for it)
    # A worktree keeps its HEAD; the refs live in the repository's own directory.
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = (git_dir / _read(git_dir / "commondir")).resolve()
    for base in (git_dir, common):
        loose = base / ref
        if loose.is_file():
            value = _read(loose)
            return value if _HASH.fullmatch(value) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in _read(packed, PACKED_REFS_BYTES).splitlines():
            value, _, name = line.partition(" ")
            if name == ref and _HASH.fullmatch(value):
                return value
    return None


def _read(path: Path, limit: int = SMALL_FILE) -> str:
    """A regular file's text, stripped, of at most ``limit`` bytes (``ValueError`` past it):
    read at every start, a FIFO in its place hung it, and ``/dev/zero`` filled its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path}: over {limit} bytes")
    return data.decode().strip()


def describe(version: str) -> str:
    """``version`` with the build's commit beside it, as the CLI and the server say it."""
    return f"{version} (commit {commit()})"


__all__ = ["UNKNOWN", "commit", "describe"]
