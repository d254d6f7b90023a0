"""One owner per disk directory, and a disk budget the filesystem can hold."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

import cacheseek as cs
from cacheseek.store.disk import DiskInUse, DiskTier
from server_helpers import Server

HERE = Path(__file__).resolve().parent
HOLD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    import cacheseek as cs
    from store_helpers import make_cache
    cache = make_cache(cpu=0, disk={disk!r})
    print("open", flush=True)
    sys.stdin.readline()
    cache.close()
    print("closed", flush=True)
    sys.stdin.readline()
""")


def test_two_prefix_caches_in_two_processes_on_one_directory(tmp_path):
    disk = tmp_path / "d"
    child = subprocess.Popen([sys.executable, "-c", HOLD.format(here=str(HERE), disk=str(disk))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "open\n", child.stderr.read()
        with pytest.raises(DiskInUse, match=rf"disk_path: {disk} is in use by another process \(pid {child.pid}"):
            cs.PrefixCache(model_id="m", layout=cs.KVLayout(2, 2, 64, "float16"), block_tokens=32,
                           tiers=cs.TierConfig(cpu_bytes=0, disk_path=disk))
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "closed\n"
        # Closed: the directory is free for the next owner (the child is still alive).
        cs.PrefixCache(model_id="m", layout=cs.KVLayout(2, 2, 64, "float16"), block_tokens=32,
                       tiers=cs.TierConfig(cpu_bytes=0, disk_path=disk)).close()
    finally:
        child.kill()
        child.wait(10)


FORK_THEN_HOLD = textwrap.dedent("""
    import os, sys, time
    # A child the scheduler leaves waiting right after the fork (a loaded machine), before
    # its at-fork hooks have run: first registered, this runs before the tier's, which
    # closes the child's copy of the lock descriptor.
    os.register_at_fork(after_in_child=lambda: time.sleep(0.3))
    sys.path.insert(0, {here!r})
    from store_helpers import make_cache
    cache = make_cache(cpu=0, disk={disk!r})
    ready_r, ready_w = os.pipe()
    child = os.fork()  # a worker forked after the cache opened (multiprocessing's default)
    if child == 0:
        os.write(ready_w, b"x")  # (Python runs in the child only once its at-fork hooks have)
        time.sleep(60)
        os._exit(0)
    os.read(ready_r, 1)
    print(child, flush=True)
    time.sleep(60)
""")


def test_the_owners_kill_9_frees_the_directory_though_a_forked_child_lives(tmp_path):
    """The child closes its copy of the lock descriptor in an at-fork hook, in the child,
    some time after ``fork()`` returned in the owner. The test killed the owner as soon as
    it had forked and failed with DiskInUse when the child had not run yet (CI once, on a
    loaded machine): the owner now waits for the child to be running Python before it says
    it has forked; the hook above makes that wait needed every time."""
    import signal

    disk = tmp_path / "d"
    owner = subprocess.Popen([sys.executable, "-c", FORK_THEN_HOLD.format(here=str(HERE), disk=str(disk))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(owner.stdout.readline() or 0)
        assert child, owner.stderr.read()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        os.kill(child, 0)  # still alive
        DiskTier(disk, 1 << 20).close()  # the lock went with its owner
    finally:
        owner.kill()
        if child:
            os.kill(child, signal.SIGKILL)


def test_a_second_tier_in_one_process_fails_and_close_releases(tmp_path):
    first = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(DiskInUse, match="in use by another cache \\(or tier\\) in this process, open on it now"):
        DiskTier(tmp_path, 1 << 20)
    first.close()
    first.close()  # idempotent
    DiskTier(tmp_path, 1 << 20).close()


def test_two_servers_on_one_directory_the_second_fails_clearly(tmp_path):
    with Server(tmp_path) as first:
        second = Server(tmp_path)
        with pytest.raises(RuntimeError, match="exited") as info:
            second.start()
        assert f"{tmp_path / 'disk'} is in use by another process (pid {first.proc.pid}" in str(info.value)
        assert "exited with 2" in str(info.value) and "Traceback" not in str(info.value)  # a setting's exit code
        assert httpx.get(first.url + "/readyz").status_code == 200  # the owner is unharmed


def test_a_disk_budget_beyond_the_filesystem_is_clamped_with_a_warning(tmp_path, caplog):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with caplog.at_level(logging.WARNING, logger="cacheseek.store"):
        tier = DiskTier(tmp_path, 100 << 40)
    try:
        assert tier.capacity_bytes < free and tier.stats().to_dict()["requested_bytes"] == 100 << 40
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert "disk_bytes: 100.00 TiB" in warning and "free" in warning and "clamped" in warning
    finally:
        tier.close()
    small = DiskTier(tmp_path, 1 << 20)  # a budget that fits is left alone
    assert small.capacity_bytes == 1 << 20
    small.close()


def test_a_server_with_a_budget_beyond_the_filesystem_says_so(tmp_path):
    with Server(tmp_path, "--disk-bytes", "100TiB", "--log-level", "warning") as srv:
        disk = next(t for t in httpx.get(srv.url + "/v1/stats").json()["tiers"] if t["name"] == "disk")
        assert disk["capacity_bytes"] < disk["requested_bytes"] == 100 << 40
    assert "disk_bytes: 100.00 TiB" in srv.output() and "clamped" in srv.output()


def test_a_clamped_disk_budget_is_the_eviction_policys_budget_too(tmp_path, monkeypatch):
    """ARC sizes its target and its ghost lists from the budget: left at ``disk_bytes`` when
    the tier was clamped to the filesystem, it kept ghosts for ten times the blocks the
    tier could hold (its bound is |T1| + |B1| <= the budget)."""
    from types import SimpleNamespace

    from store_helpers import raw_frame

    nbytes = raw_frame(0)[1].nbytes
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=10 * nbytes, f_frsize=1))
    tier = DiskTier(tmp_path, 100 * 10 * nbytes, fsync=False, policy="arc")
    try:
        assert tier.capacity_bytes < 10 * nbytes
        for i in range(100):
            tier.put(*raw_frame(i))
        arc = tier.stats().to_dict()["eviction"]
        assert arc["t1_bytes"] + arc["ghost_bytes"] <= tier.capacity_bytes, arc
    finally:
        tier.close()


def test_a_directory_that_cannot_be_grown_at_open_is_a_storage_error_and_frees_it(tmp_path, monkeypatch):
    """A full or read-only filesystem under an existing directory: making its shard folders
    raised a bare OSError (the server's command line caught it, an embedded cache did not).
    It is a StorageError naming the directory, and the directory is free again."""
    import errno

    real_mkdir = Path.mkdir

    def full(self, *args, **kwargs):
        if self.parent == tmp_path / "d":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(cs.StorageError, match=rf"disk tier: cannot open {tmp_path / 'd'}: .*No space left"):
        DiskTier(tmp_path / "d", 1 << 20)
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    DiskTier(tmp_path / "d", 1 << 20).close()  # (the lock was given back)


def _on_disk(root: Path) -> int:
    """What the tier's files take on the filesystem (``st_blocks``), the lock file and the
    directories aside."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*")
               if p.is_file() and not p.is_symlink() and p.name != ".lock")


@pytest.mark.parametrize("group_commit", [True, False])
def test_the_disk_budget_bounds_what_the_files_take_on_the_filesystem(tmp_path, group_commit):
    # Small frames (32 KiB): counted by frame bytes, the files (each frame and sidecar
    # rounded up to whole file-system blocks) took a quarter more than the budget.
    from store_helpers import raw_frame

    budget = 1 << 20
    root = tmp_path / "d"
    tier = DiskTier(root, budget, fsync=False, group_commit=group_commit)
    try:
        frames = [raw_frame(i) for i in range(1, 81)]
        for start in range(0, len(frames), 4):
            for r in tier.put_many(frames[start : start + 4]):
                assert r.error is None
            assert _on_disk(root) <= budget
        stats = tier.stats()
        assert stats.evictions > 0 and _on_disk(root) <= stats.used_bytes <= budget
        extra = stats.to_dict()
        assert extra["frame_bytes"] == sum(tier.info(k).nbytes for k in tier.keys()) < stats.used_bytes
        used, keys = stats.used_bytes, sorted(tier.keys())
    finally:
        tier.close()
    again = DiskTier(root, budget, fsync=False)
    try:
        assert again.stats().used_bytes == used and sorted(again.keys()) == keys
        assert again.stats().evictions == 0  # (the rebuild counts what the writes counted: nothing to trim)
    finally:
        again.close()


def test_close_waits_for_a_check_with_fix_before_giving_the_directory_up(tmp_path, monkeypatch):
    """``check(fix=True)`` ran outside the calls ``close()`` waits for: closed mid-check, the
    tier gave its directory up while the check still held a bad read of a block, and went
    on reading (and, with ``fix``, deleting) files that were the next owner's: a block that
    owner wrote again, whole and acknowledged, lost its files to the old check. Now close
    waits for the block being checked, and the check stops there, closed."""
    from cacheseek.errors import StorageError
    from cacheseek.store import disk as disk_mod
    from store_helpers import raw_frame

    root = tmp_path / "d"
    first = DiskTier(root, 1 << 20)
    frames = [raw_frame(i) for i in (1, 2)]
    for key, frame in frames:
        first.put(key, frame)
        data = root / key.hex()[:2] / f"{key.hex()}.frame"
        body = bytearray(data.read_bytes())
        body[-1] ^= 0xFF  # a payload byte flipped on disk: the check finds it corrupt
        data.write_bytes(body)
    reading, go = threading.Event(), threading.Event()
    real = disk_mod.parse_frame

    def held(view, **kw):  # the check's first read waits for the test
        reading.set()
        assert go.wait(30)
        return real(view, **kw)

    monkeypatch.setattr(disk_mod, "parse_frame", held)
    outcome: list = []

    def check() -> None:
        try:
            outcome.append(first.check(fix=True))
        except StorageError as exc:
            outcome.append(exc)

    checker = threading.Thread(target=check, daemon=True)
    checker.start()
    assert reading.wait(30)
    closer = threading.Thread(target=first.close, daemon=True)
    closer.start()
    closer.join(1.0)
    try:
        assert closer.is_alive(), "close() returned while check(fix=True) was in flight"
        with pytest.raises(DiskInUse):  # (the directory is still the checking tier's)
            DiskTier(root, 1 << 20)
    finally:
        go.set()
        closer.join(30)
        checker.join(30)
    assert not closer.is_alive() and not checker.is_alive()
    # The block being checked when close came was judged (and dropped); the next is refused.
    assert isinstance(outcome[0], StorageError) and "closed" in str(outcome[0]), outcome
    monkeypatch.undo()
    second = DiskTier(root, 1 << 20)
    try:
        # the one left unchecked
        assert second.check(fix=True) == {"ok": 0, "corrupt": 1, "unreadable": 0, "other_version": 0}
        for key, frame in frames:
            assert second.put(key, frame).stored is not None  # (both dropped: written again)
        assert second.check() == {"ok": 2, "corrupt": 0, "unreadable": 0, "other_version": 0}
    finally:
        second.close()


def test_a_fork_in_another_thread_while_the_lock_is_taken_leaves_the_child_without_it(tmp_path, monkeypatch):
    """A child forked (by another thread) after the lock file was opened but before its
    descriptor was registered for the at-fork hook kept a copy of it, and so the flock,
    for its whole life: the owner's close (or kill -9) no longer freed the directory. A
    fork now waits for a lock being taken or given back to be registered."""
    import fcntl as real_fcntl
    from types import SimpleNamespace

    from cacheseek.store import disk as disk_mod

    root = tmp_path / "d"
    root.mkdir()
    in_flock, go = threading.Event(), threading.Event()

    def flock(fd, op):
        in_flock.set()
        assert go.wait(30)
        return real_fcntl.flock(fd, op)

    monkeypatch.setattr(disk_mod, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=real_fcntl.LOCK_EX,
                                                           LOCK_NB=real_fcntl.LOCK_NB))
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    forked: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:  # the child: says it runs (its at-fork hooks done), lives until told
            os.close(hold_w)
            os.write(ready_w, b"x")
            os.read(hold_r, 1)
            os._exit(0)
        forked.append(pid)

    tiers: list[DiskTier] = []
    opener = threading.Thread(target=lambda: tiers.append(DiskTier(root, 1 << 20)), daemon=True)
    opener.start()
    forker = None
    try:
        assert in_flock.wait(30)
        forker = threading.Thread(target=fork, daemon=True)
        forker.start()
        forker.join(1.0)  # the fork, where nothing holds it back (the old code: at once)
        go.set()
        opener.join(30)
        forker.join(30)
        assert forked and tiers, (forked, tiers)
        assert os.read(ready_r, 1) == b"x"  # the child runs: its at-fork hooks are done
        tiers[0].close()
        monkeypatch.undo()
        DiskTier(root, 1 << 20).close()  # free, though the child lives
    finally:
        go.set()
        os.close(hold_w)
        for pid in forked:
            os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, hold_r):
            os.close(fd)


def test_opening_a_large_directory_says_how_far_it_has_read(tmp_path, monkeypatch, caplog):
    """The index is rebuilt from every sidecar before the port opens: 40,000 blocks took 4 s
    here with the page cache warm, so millions take minutes, and nothing was said between the
    settings and "store open in". Every few seconds (here: every shard, the interval at 0)
    the tier says how many of its 256 shard directories it has read and the blocks found."""
    from cacheseek.store import disk as disk_module
    from store_helpers import raw_frame

    root = tmp_path / "d"
    tier = DiskTier(root, 1 << 30, fsync=False)
    tier.put_many([raw_frame(i) for i in range(1, 7)])
    tier.close()
    monkeypatch.setattr(disk_module, "RECOVERY_PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="cacheseek.store"):
        DiskTier(root, 1 << 30).close()
    said = [r.getMessage() for r in caplog.records if "shard directories read" in r.getMessage()]
    assert len(said) == 256, said[:3]
    assert said[0].startswith(f"disk tier: opening {root}: 1 of 256 shard directories read, ")
    assert said[-1].startswith(f"disk tier: opening {root}: 256 of 256 shard directories read, 6 blocks found")


def _disk_store(root: Path):
    from cacheseek.store.tiered import TieredStore
    from store_helpers import raw_frame

    frames = [raw_frame(i) for i in range(1, 5)]
    disk = DiskTier(root, 1 << 20, fsync=False)
    store = TieredStore([disk])
    for key, frame in frames:
        store.put(key, frame)
    return store, disk, frames


@pytest.mark.parametrize("how", ["deleted", "replaced", "emptied", "globbed"])
def test_a_directory_deleted_or_replaced_under_the_tier_is_given_up(tmp_path, how, caplog):
    """``globbed``: ``rm -rf DIR/*``, which leaves the dot-files (the lock among them): the
    tier went on offering every block, each found missing only when read (counted as
    damage). Its shard directories gone, it is emptied as when the lock goes."""
    import shutil

    from cacheseek.errors import StorageError
    from store_helpers import raw_frame

    root = tmp_path / "d"
    store, disk, frames = _disk_store(root)
    assert disk.lost() is None and store.lost_tiers() == {}
    if how == "deleted":
        shutil.rmtree(root)
    elif how == "replaced":
        root.rename(tmp_path / "moved")
        root.mkdir()  # (a second server's, say: it finds no lock here)
    else:
        for entry in root.iterdir():
            if how == "emptied" or not entry.name.startswith("."):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    key, frame = raw_frame(9)
    # A write within the second (no check due yet) finds its shard gone and looks at once.
    with caplog.at_level(logging.ERROR, "cacheseek.store.disk"), \
            pytest.raises(StorageError, match=f"disk tier: its directory {root} was .* while open: nothing is written"):
        disk.put(key, frame)
    want = {"deleted": "deleted", "replaced": "replaced by another directory",
            "emptied": "emptied (its lock file .lock was deleted)",
            "globbed": "emptied (its shard directory 00 was deleted)"}[how]
    assert store.lost_tiers() == {"disk": want}
    assert "its 4 blocks" in caplog.text
    if how != "deleted":
        assert not any(root.rglob("*.frame")), "wrote into a directory it does not hold the lock of"
    stats = disk.stats()
    assert (stats.blocks, stats.used_bytes, stats.corrupt, stats.extra["lost"]) == (0, 0, 0, want)
    # Its blocks are misses, no tier claims them, deletes find nothing, nothing more is written.
    assert [store.get(k) for k, _ in frames] == [None] * 4
    assert all(store.residency.info(k) is None for k, _ in frames)
    assert disk.stats().corrupt == 0
    assert disk.delete(frames[0][0]) is False
    with pytest.raises(StorageError, match="nothing is written there"):
        disk.put(*raw_frame(10))
    if how != "deleted":
        assert not any(root.rglob("*.frame"))
    store.close()
    # The directory there now is free for the next owner.
    DiskTier(root, 1 << 20).close()


def test_a_directory_deleted_under_an_idle_tier_is_found_by_the_next_check(tmp_path, monkeypatch):
    import shutil

    from cacheseek.store import disk as disk_module

    store, disk, frames = _disk_store(tmp_path / "d")
    shutil.rmtree(tmp_path / "d")
    # A read inside the second: the file it does not find is looked at as the directory's.
    assert store.get(frames[0][0]) is None
    assert disk.stats().corrupt == 0 and store.lost_tiers() == {"disk": "deleted"}
    store.close()
    # A lookup alone (no read, no write) finds it once the check is due.
    store, disk, frames = _disk_store(tmp_path / "e")
    monkeypatch.setattr(disk_module, "ROOT_CHECK_SECONDS", 0.0)
    shutil.rmtree(tmp_path / "e")
    assert disk.present_many([frames[0][0]]) == [False]
    assert disk.stats().corrupt == 0 and disk.stats().blocks == 0
    store.close()
    # A shard directory replaced (its blocks gone with the old one) is found the same way.
    store, disk, frames = _disk_store(tmp_path / "f")
    shard = tmp_path / "f" / frames[0][0].hex()[:2]
    shard.rename(tmp_path / "aside")
    shard.mkdir()
    assert disk.present_many([frames[0][0]]) == [False]
    assert disk.stats().corrupt == 0 and disk.lost() == f"emptied (its shard directory {shard.name} was replaced)"
    store.close()


def test_a_server_whose_disk_directory_is_deleted_is_not_ready(tmp_path):
    import shutil

    from server_helpers import raw_frame

    with Server(tmp_path) as srv, httpx.Client(base_url=srv.url) as c:
        h, frame = raw_frame(1)
        head = {"X-CacheSeek-Model": "m", "X-CacheSeek-Block-Tokens": "32"}
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame, headers=head).status_code in (200, 201)
        assert c.get("/readyz").status_code == 200
        shutil.rmtree(srv.disk_path)
        ready = c.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert "disk tier: its storage was deleted under the running server: restart it" in ready.text
        assert str(srv.disk_path) not in ready.text  # (an open route: no host details)
        assert 'cacheseek_tier_lost{tier="disk"} 1.0' in c.get("/metrics").text
        disk = next(t for t in c.get("/v1/stats").json()["tiers"] if t["name"] == "disk")
        assert (disk["lost"], disk["blocks"], disk["corrupt"]) == ("deleted", 0, 0)
    assert "its directory" in srv.output() and "was deleted while the tier had it open" in srv.output()


def test_a_server_whose_disk_directory_is_emptied_with_a_glob_is_not_ready(tmp_path):
    """``rm -rf DIR/*`` (the dot-files, the lock among them, left): lookups went on matching
    every block, a prefix GET was answered 200 and cut with no byte sent."""
    import shutil

    from server_helpers import raw_chain

    chain = raw_chain(61, 4)
    with Server(tmp_path) as srv, httpx.Client(base_url=srv.url) as c:
        for h, body in chain:
            assert c.put(f"/v1/blocks/{h.hex()}", content=body).status_code == 201
        for entry in srv.disk_path.iterdir():
            if not entry.name.startswith("."):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "emptied (its shard directory 00 was deleted)" in ready.text, ready.text
        look = c.post("/v1/lookup", json={"hashes": [h.hex() for h, _ in chain]}).json()
        assert "disk" not in look["tiers"], look  # (its CPU-tier copies still serve)
        disk = next(t for t in c.get("/v1/stats").json()["tiers"] if t["name"] == "disk")
        assert (disk["blocks"], disk["corrupt"]) == (0, 0), disk


def test_a_server_writes_no_state_file_into_a_directory_put_in_its_own_place(tmp_path):
    from server_helpers import raw_frame

    admin = "a" * 32
    with Server(tmp_path, "--admin-token", admin) as srv, \
            httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {admin}"}) as c:
        head = {"X-CacheSeek-Model": "m", "X-CacheSeek-Block-Tokens": "32"}
        h, frame = raw_frame(1)
        assert c.put(f"/v1/blocks/{h.hex()}", content=frame, headers=head).status_code in (200, 201)
        srv.disk_path.rename(tmp_path / "moved")
        srv.disk_path.mkdir()  # another server's, say
        assert c.get("/readyz").status_code == 503
        # A new root (the owners file) and a pin (the pins file): neither written in there.
        h2, frame2 = raw_frame(2)
        c.put(f"/v1/blocks/{h2.hex()}", content=frame2, headers={**head, "X-CacheSeek-Model": "other"})
        pinned = c.put(f"/v1/admin/pins/{h.hex()}")  # (still held: in the CPU tier)
        assert pinned.status_code == 200 and pinned.json()["saved"] is False, pinned.text
        assert list(srv.disk_path.iterdir()) == []
    assert "pins not saved to" in srv.output() and "directory was replaced by another directory" in srv.output()


def test_a_budget_other_writers_lower_is_said(tmp_path, monkeypatch, caplog):
    """A budget clamped to the filesystem is fitted again every second: another program's
    files lowered it (and evicted the blocks over it), unsaid; the log says it once a minute
    at most."""
    from types import SimpleNamespace

    from cacheseek.store import disk as disk_module

    free = [50 << 20]
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free[0], f_frsize=1))
    monkeypatch.setattr(disk_module, "REFIT_SECONDS", 0.0)
    tier = DiskTier(tmp_path, 1 << 40, fsync=False)
    try:
        before = tier.capacity_bytes
        free[0] = 10 << 20  # another writer took 40 MiB
        with caplog.at_level(logging.WARNING, "cacheseek.store.disk"):
            tier._refit_if_due()
            free[0] = 5 << 20
            tier._refit_if_due()
        assert tier.capacity_bytes < before
        said = [r.getMessage() for r in caplog.records if "other writers are filling the filesystem" in r.getMessage()]
        assert len(said) == 1 and "the budget is lowered from" in said[0], said
    finally:
        tier.close()


def test_an_interrupt_as_a_call_is_counted_does_not_leave_close_waiting(tmp_path):
    """A call on the tier is counted, so that ``close`` waits for it. An interrupt raised as
    the count's lock was let go (Ctrl-C, or a signal handler's exit, lands there in about one
    stop in five under load) escaped before the count's ``try``: the call stayed counted for
    good, and ``close`` waited for it for ever."""
    from store_helpers import InterruptedAtRelease, raw_frame

    tier = DiskTier(tmp_path / "d", 1 << 20)
    tier._calls_lock = InterruptedAtRelease(tier._calls_lock)
    key, frame = raw_frame(1)
    with pytest.raises(KeyboardInterrupt):
        tier.put(key, frame)
    assert tier._calls_lock.raised
    tier.put(key, frame)  # the tier goes on, its next call counted and let go
    closer = threading.Thread(target=tier.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "close waits for a call that ended by an interrupt"


@pytest.mark.parametrize("frames", [1, 2])  # one put; a group commit's claims
def test_an_interrupt_as_a_write_is_marked_in_flight_leaves_nothing_in_flight(tmp_path, frames):
    """A write is marked in flight (its room held; a second put of the block waits for it)
    under the tier's lock, and undone by a ``try`` that began after the lock was let go: an
    interrupt there left the mark for good. The room stayed held, the next put of the block
    waited for ever with no timeout, and ``close`` behind it."""
    from store_helpers import InterruptedAtRelease, raw_frame

    tier = DiskTier(tmp_path / "d", 1 << 24)
    tier._lock = InterruptedAtRelease(tier._lock, when=lambda: bool(tier._writing))
    items = [raw_frame(i) for i in range(1, frames + 1)]
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(items)
    assert tier._lock.raised
    _nothing_in_flight_and_the_tier_goes_on(tier, items)


def test_close_while_another_thread_reads_a_chain_from_disk_ends_the_read_in_misses(tmp_path, monkeypatch):
    """The disk tier's ``close`` shut its read pool under a stream in flight: the reader got
    ``RuntimeError("cannot schedule new futures after shutdown")``, and a pooled read
    buffer stayed lent for good. The reads not made are misses now, and nothing is lent."""
    import time

    from store_helpers import BLOCK, make_cache, make_kv

    cache = make_cache(cpu=str(2 * 50_000), disk=str(tmp_path / "d"), write_through=("disk",), promote_on_hit=False)
    tokens = 64 * BLOCK
    keys = list(range(tokens))
    cache.ingest(keys, make_kv(tokens, seed=1))
    real = DiskTier._landed

    def slow(self, *args):  # (a consumer a little slower than the reads: the close overtakes it)
        time.sleep(0.02)
        return real(self, *args)

    monkeypatch.setattr(DiskTier, "_landed", slow)
    out: dict = {}

    def reader() -> None:
        try:
            out["tokens"] = cache.materialize(keys).num_tokens
        except BaseException as exc:  # noqa: BLE001 - what it raised is the finding
            out["error"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.3)
    cache.close()
    thread.join(30)
    assert not thread.is_alive()
    if "error" in out:  # a read begun after the close: the tier's closed error
        from cacheseek.errors import StorageError

        assert isinstance(out["error"], StorageError) and "disk tier: closed" in str(out["error"]), repr(out["error"])
    else:
        assert 0 < out["tokens"] < tokens  # what landed before the close, then misses
    assert cache.store.tier("disk")._stream_buffers.ledger.stats()["leases_active"] == 0


def test_an_interrupt_half_way_through_a_group_commit_leaves_nothing_in_flight(tmp_path):
    """A group commit indexes its writes one by one under the lock and wakes their waiters
    after: an interrupt half way (at the first block's indexing) left the rest in flight for
    good, the next put of one waiting for ever, and close behind it."""
    from store_helpers import raw_frame

    tier = DiskTier(tmp_path / "d", 1 << 24)
    items = [raw_frame(i) for i in (1, 2, 3)]
    real_add = tier._index.add
    armed = [True]

    def interrupted_add(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real_add(*args, **kwargs)

    tier._index.add = interrupted_add
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(items)
    tier._index.add = real_add
    _nothing_in_flight_and_the_tier_goes_on(tier, items)


def _nothing_in_flight_and_the_tier_goes_on(tier: DiskTier, items: list) -> None:
    """After an interrupted write: nothing left in flight, a put of the same blocks stores
    them (it waited for ever on a write left in flight), and ``close`` returns."""
    assert tier._writing == {} and tier._reserved == 0
    putter = threading.Thread(target=tier.put_many, args=(items,), daemon=True)
    putter.start()
    putter.join(10)
    assert not putter.is_alive(), "a put waits for a write an interrupt ended"
    assert all(tier.contains(key) for key, _ in items)
    closer = threading.Thread(target=tier.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()


def test_an_interrupt_as_a_group_commit_gives_a_writes_room_back_keeps_no_room_held(tmp_path):
    """A group commit takes a write out of flight, then gives its room back: an interrupt as
    the room was given back (``_release``'s entry) left the room held for good, the tier a
    block smaller until a restart."""
    from store_helpers import raw_frame

    tier = DiskTier(tmp_path / "d", 1 << 24)
    items = [raw_frame(i) for i in (1, 2)]
    real_release = tier._release
    armed = [True]

    def interrupted_release(*args):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real_release(*args)

    tier._release = interrupted_release
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(items)
    tier._release = real_release
    _nothing_in_flight_and_the_tier_goes_on(tier, items)


def test_an_interrupt_as_a_split_batch_commits_its_first_part_leaves_nothing_in_flight(tmp_path):
    """A batch that does not fit at once commits what it has claimed before it claims the
    rest. Those writes were handed to the commit before it began: an interrupt as it began
    left them in neither, in flight for good (the next put of one, and close, waited for ever)."""
    from store_helpers import raw_frame

    probe = DiskTier(tmp_path / "p", 1 << 24)
    probe.put(*raw_frame(99))
    room = probe._index.used_bytes
    probe.close()
    tier = DiskTier(tmp_path / "d", 2 * room, fsync=False)  # (room for two: the third splits the batch)
    real = tier._commit_part
    armed = [True]

    def interrupted(group, results):
        if armed[0] and group:
            armed[0] = False
            raise KeyboardInterrupt
        return real(group, results)

    tier._commit_part = interrupted
    items = [raw_frame(i) for i in (1, 2, 3)]
    with pytest.raises(KeyboardInterrupt):
        tier.put_many(items)
    tier._commit_part = real
    _nothing_in_flight_and_the_tier_goes_on(tier, items[:2])


def test_a_budget_fitted_to_the_filesystem_again_and_again_keeps_its_headroom_free(tmp_path, monkeypatch):
    """A budget below ``disk_bytes`` is fitted to the filesystem again every second, as what
    the tier holds plus 95% of the free space: the free space then was the headroom the last
    fit left, so each fit handed 95% of it to the tier, and within seconds of writes the
    filesystem was full (other writers, and the server's owners and pins files beside the
    tier, failed with ENOSPC). The headroom is 5% of what the tier holds plus the free space,
    which the tier's own writes and evictions leave alone: every fit finds the same budget."""
    from types import SimpleNamespace

    from cacheseek.store import disk as disk_module
    from cacheseek.store.direct_io import round_up
    from store_helpers import raw_frame

    unit, size = 4096, 4 << 20
    root = tmp_path / "d"

    def free() -> int:  # a filesystem of ``size`` bytes holding the directory's files and nothing else
        return size - sum(round_up(max(p.stat().st_size, 1), unit) for p in root.rglob("*") if p.is_file())

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free() // unit, f_frsize=unit,
                                                                    f_bsize=unit, f_blocks=size // unit))
    monkeypatch.setattr(disk_module, "REFIT_SECONDS", 0.0)
    tier = DiskTier(root, 1 << 40, fsync=False)
    try:
        budget = tier.capacity_bytes
        headroom = free() - budget  # (the lock file aside, nothing is held yet)
        assert headroom >= 0.05 * (size - unit) - 1, (budget, headroom)
        budgets, lowest = set(), size
        for i in range(3 * size // tier.charge(raw_frame(0)[1].meta.nbytes)):  # the filesystem filled thrice over
            tier.put(*raw_frame(i))
            budgets.add(tier.capacity_bytes)
            lowest = min(lowest, free())
        assert budgets == {budget}, sorted(budgets)
        assert lowest >= headroom and tier.stats().evictions > 0, (lowest, headroom)
    finally:
        tier.close()
