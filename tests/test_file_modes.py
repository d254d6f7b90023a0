"""What CacheSeek writes is its owner's alone: a block's KV can be turned back into its prompt's
text, so no other local user may read a stored block, its sidecar, or the server's state
beside them. Real files, under the usual umask of 022 (the modes are passed at creation, so
the umask cannot widen them)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import httpx
import pytest

from cacheseek.store.disk import DiskTier
from server_helpers import Server, batch_body, raw_chain
from store_helpers import BLOCK, make_cache, make_kv, raw_frame, tokens_for

ADMIN = "adm1n-token"
WRITE = "wr1te-token"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def made_under(root: Path) -> dict[str, int]:
    """Every entry under ``root``, ``root`` too: relative path -> permission bits."""
    modes = {".": stat.S_IMODE(root.lstat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            modes[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def assert_owner_only(modes: dict[str, int]) -> None:
    loose = {path: oct(mode) for path, mode in modes.items() if mode & 0o077}
    assert not loose, f"group or others may access: {loose}"


def test_a_store_run_creates_nothing_other_local_users_can_read(tmp_path, umask_022):
    root = tmp_path / "made" / "disk"  # made by the tier, as its parent is
    tokens, kv = tokens_for(1, 4 * BLOCK), make_kv(4 * BLOCK, 1)
    with make_cache(disk=root) as cache:  # written through the CPU tier: a group commit of 4
        assert cache.ingest(tokens, kv).stored == 4
    one = DiskTier(tmp_path / "one", 1 << 20, group_commit=False)  # a frame committed on its own
    try:
        assert one.put(*raw_frame(7)).stored is not None
    finally:
        one.close()
    for disk in (root, tmp_path / "one"):
        modes = made_under(disk)
        assert len([p for p in modes if p.endswith(".frame")]) == len([p for p in modes if p.endswith(".meta")]) > 0
        assert ".lock" in modes and len([p for p in modes if len(p) == 2]) == 256
        assert_owner_only(modes)


def test_a_server_run_creates_nothing_other_local_users_can_read(tmp_path, umask_022):
    chain = raw_chain(3, 3)
    writer = {"Authorization": f"Bearer {WRITE}", "X-CacheSeek-Namespace": "a", "X-CacheSeek-Model": "m"}
    with Server(tmp_path, "--admin-token", ADMIN, "--write-token", WRITE) as srv, \
            httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/blocks", content=batch_body([f for _, f in chain]), headers=writer)
        assert r.status_code == 200 and all(x["status"] == "stored" for x in r.json()), r.text
        admin = {"Authorization": f"Bearer {ADMIN}", "X-CacheSeek-Namespace": "a"}
        r = c.put(f"/v1/admin/pins/{chain[-1][0].hex()}", headers=admin)
        assert r.status_code == 200 and r.json()["saved"] is True, r.text
    modes = made_under(srv.disk_path)
    for name in (".cacheseek-owners.json", ".cacheseek-pins.json", ".namespace-key", ".lock"):
        assert name in modes, sorted(modes)
    assert len([p for p in modes if p.endswith(".frame")]) == 3
    assert_owner_only(modes)


def test_an_existing_root_keeps_its_mode_and_loose_modes_in_it_are_named_once(tmp_path, umask_022, caplog):
    """A directory the operator made is theirs: its mode is left alone. Shard directories an
    earlier release made (0755, their files 0644) are said, not changed: a chmod of every file
    would hold the start for minutes on a large directory. A group's access is the operator's
    choice (Kubernetes' fsGroup gives one to every file of a volume), not said."""
    root = tmp_path / "d"
    root.mkdir()
    os.chmod(root, 0o757)  # writable by every user, beyond what the umask gave
    (root / "00").mkdir(0o755)
    (root / "01").mkdir(0o755)
    (root / "02").mkdir()
    os.chmod(root / "02", 0o2770)  # a group's, as fsGroup leaves it
    with caplog.at_level(logging.WARNING, logger="cacheseek.store"):
        DiskTier(root, 1 << 20).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o757
    assert stat.S_IMODE((root / "00").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "03").stat().st_mode) == 0o700  # made by the tier
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "may write in this directory (mode 757)" in m]) == 1, said
    assert len([m for m in said if "2 shard directories" in m and f"chmod -R go= {root}" in m]) == 1, said
    caplog.clear()
    os.chmod(root, 0o2770)
    for shard in ("00", "01"):
        os.chmod(root / shard, 0o700)
    with caplog.at_level(logging.WARNING, logger="cacheseek.store"):
        DiskTier(root, 1 << 20).close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
