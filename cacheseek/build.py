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
import re
from pathlib import Path

UNKNOWN = "unknown"
SHORT = 12  # hex digits shown: unique in any repository of this size
_HASH = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1, or SHA-256


@functools.cache
def commit() -> str:
    """The short commit of the checkout this package runs from, or ``"unknown"``."""
    try:
        found = _commit_of(Path(__file__).resolve().parent.parent)
    except (OSError, UnicodeDecodeError, ValueError):
        found = None
    return found[:SHORT] if found else UNKNOWN


def _commit_of(root: Path) -> str | None:
    dot = root / ".git"
    if dot.is_file():  # a worktree or a submodule: "gitdir: <path>"
        text = dot.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git_dir = (root / text[len("gitdir:"):].strip()).resolve()
    elif dot.is_dir():
        git_dir = dot
    else:
        return None
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head if _HASH.fullmatch(head) else None  # a detached HEAD
    ref = head[len("ref:"):].strip()
    # A worktree keeps its HEAD; the refs live in the repository's own directory.
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    for base in (git_dir, common):
        loose = base / ref
        if loose.is_file():
            value = loose.read_text().strip()
            return value if _HASH.fullmatch(value) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            value, _, name = line.partition(" ")
            if name == ref and _HASH.fullmatch(value):
                return value
    return None


def describe(version: str) -> str:
    """``version`` with the build's commit beside it, as the CLI and the server say it."""
    return f"{version} (commit {commit()})"


__all__ = ["UNKNOWN", "commit", "describe"]
