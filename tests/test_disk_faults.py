"""The disk tier under storage faults other than a crash: files lost or cut behind its back."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from server_helpers import Server, raw_chain
from store_helpers import raw_frame, run_on_a_tmpfs
from cacheseek.errors import StorageError
from cacheseek.store import direct_io, disk
from cacheseek.store.disk import DiskTier


def _files(root) -> list[str]:
    return sorted(p.name for p in root.glob("[0-9a-f][0-9a-f]/*"))


def test_a_put_of_a_block_whose_files_went_is_written_again_not_answered_present(tmp_path):
    """The index said the block was held, so a put of it answered "present" (its
    acknowledgement) with no file on disk: a restart found nothing, and every read missed.
    A put of a held block now looks at its files first: gone, or cut short, the entry is
    dropped (counted corrupt, named in the log) and the block written again."""
    tier = DiskTier(tmp_path / "d", 1 << 30)
    (k1, f1), (k2, f2) = raw_frame(1), raw_frame(2)
    tier.put(k1, f1)
    tier.put_many([(k2, f2), raw_frame(3)])
    data1, side1 = tier._paths(k1)
    data1.unlink()
    side1.unlink()
    with open(tier._paths(k2)[0], "r+b") as f:
        f.truncate(100)
    assert tier.put(k1, f1).stored is not None
    results = tier.put_many([(k2, f2), raw_frame(3)])
    assert results[0].stored is not None and results[0].error is None
    assert results[1].stored is None and results[1].error is None  # whole: present
    assert data1.stat().st_size == f1.meta.nbytes and side1.exists()
    assert tier.get(k1) is not None and tier.get(k2) is not None
    stats = tier.stats()
    assert stats.corrupt == 2 and stats.blocks == 3 and len(_files(tier.root)) == 6
    tier.close()
    again = DiskTier(tmp_path / "d", 1 << 30)
    assert sorted(again.keys()) == sorted([k1, k2, raw_frame(3)[0]])
    again.close()


def test_a_put_of_a_block_whose_sidecar_became_a_directory_is_not_answered_present(tmp_path):
    """A directory in a held block's sidecar's place: a restart keeps nothing of the block
    (its frame an orphan), so a put must not answer "present". The entry is dropped
    (counted corrupt) and the put, unable to write its sidecar there, fails naming it."""
    tier = DiskTier(tmp_path / "d", 1 << 30)
    (k1, f1), (k2, f2) = raw_frame(1), raw_frame(2)
    tier.put_many([(k1, f1), (k2, f2)])
    side = tier._paths(k2)[1]
    side.unlink()
    side.mkdir()
    results = tier.put_many([(k1, f1), (k2, f2)])
    assert results[0].stored is None and results[0].error is None  # whole: present
    assert results[1].stored is None and results[1].error is not None and str(side) in str(results[1].error)
    assert tier.stats().corrupt == 1 and not tier.contains(k2) and tier.get(k2) is None
    side.rmdir()  # the operator clears the way: written again
    assert tier.put(k2, f2).stored is not None and tier.get(k2) is not None
    tier.close()
    again = DiskTier(tmp_path / "d", 1 << 30)
    assert sorted(again.keys()) == sorted([k1, k2])
    again.close()


def test_a_server_rewrites_a_block_whose_files_were_removed_behind_its_back(tmp_path):
    """The server asks which blocks of a write are committed before it writes (and a
    lookup's ``each`` asks the same): the disk tier answered from its index, so a block
    whose files were removed was answered "present" and never written again."""
    (h, body), = raw_chain(41, 1)
    with Server(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.put(f"/v1/blocks/{h.hex()}", content=body).status_code == 201
        for p in srv.disk_path.glob(f"{h.hex()[:2]}/{h.hex()}.*"):
            p.unlink()
        look = c.post("/v1/lookup", json={"hashes": [h.hex()], "each": True})
        assert look.status_code == 200 and look.json()["present"] == [False], look.text
        r = c.put(f"/v1/blocks/{h.hex()}", content=body)
        assert r.status_code == 201 and r.json()["status"] == "stored", r.text
        assert sorted(p.suffix for p in srv.disk_path.glob(f"{h.hex()[:2]}/{h.hex()}.*")) == [".frame", ".meta"]
        assert "its files were gone behind the tier's back" in srv.output()


# The scripts' start: a disk tier on the tmpfs, and ``fill()``, another writer filling the
# filesystem (its file descriptor returned).
_ON_A_TMPFS = r"""
import json, os, sys
sys.path[:0] = sys.argv[2:]
from cacheseek.store.disk import DiskTier
from store_helpers import raw_frame

tier = DiskTier(sys.argv[1] + "/d", 1 << 30)

def fill():
    fd = os.open(sys.argv[1] + "/other", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        return fd
"""

_FULL_AND_EMPTY = _ON_A_TMPFS + r"""
fd = fill()
errors = [str(tier.put_many([raw_frame(1)])[0].error), str(tier.put_many([raw_frame(2), raw_frame(3)])[0].error)]
left = sorted(os.listdir(sys.argv[1] + "/d/01")) + sorted(os.listdir(sys.argv[1] + "/d/02"))
os.close(fd)
os.unlink(sys.argv[1] + "/other")
tier._fitted_at = 0.0  # (the budget is fitted again at most once a second: not a wait in a test)
after = tier.put(*raw_frame(4)).stored is not None
print(json.dumps({"errors": errors, "left": left, "after": after, "write_errors": tier.stats().write_errors}))
tier.close()
"""


_FULL_THEN_FREED = _ON_A_TMPFS + r"""
tier.put_many([raw_frame(i) for i in range(1, 7)])
fd = fill()
full = tier.put_many([raw_frame(10), raw_frame(11)])  # the budget lowered to what is held: evicts
os.close(fd)
os.unlink(sys.argv[1] + "/other")  # the other writer's space comes free
tier._fitted_at = 0.0  # (the budget is fitted again at most once a second: not a wait in a test)
before = tier.stats()
held = [i for i in list(range(1, 7)) + [10, 11] if tier.contains(raw_frame(i)[0])]
after = tier.put_many([raw_frame(i) for i in (20, 21, 22)])
print(json.dumps({"full_stored": [r.stored is not None for r in full], "held": held,
                  "still": [i for i in held if tier.contains(raw_frame(i)[0])],
                  "stored": [r.stored is not None for r in after], "evicted": tier.stats().evictions - before.evictions,
                  "budget_before": before.capacity_bytes, "budget_after": tier.stats().capacity_bytes}))
tier.close()
"""


def test_the_first_batch_after_a_full_filesystem_frees_fits_the_budget_before_it_evicts(tmp_path):
    """A full filesystem lowers the budget to what the tier holds; once the other writer's
    space comes free, the next batch's room was made against the lowered budget before the
    budget was fitted again (in the group's write): it evicted blocks the filesystem had room
    for. A batch now fits the budget first, as a single put does."""
    import json

    run = run_on_a_tmpfs(tmp_path, _FULL_THEN_FREED, "1m", timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["full_stored"] == [True, True] and len(out["held"]) >= 4, out  # (the case: stored by evicting)
    assert out["stored"] == [True, True, True] and out["evicted"] == 0 and out["still"] == out["held"], out
    assert out["budget_after"] > out["budget_before"], out


def test_a_write_to_a_full_filesystem_holding_nothing_says_the_filesystem_is_full(tmp_path):
    """A full filesystem lowers the budget to what the tier holds; holding nothing, the
    write's second try found its frame larger than a budget of 0 and said so ("exceeds
    the budget (0)"), as did every write until the budget was fitted again: a 507 that
    blamed disk_bytes, or the frame. It now says the budget was lowered for a full
    filesystem. Nothing is left on disk, and once space comes back writes go on, no restart.
    On a real 512 KiB tmpfs in a mount namespace of its own (as test_capacity's)."""
    import json

    run = run_on_a_tmpfs(tmp_path, _FULL_AND_EMPTY, "512k", timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert all("to what the filesystem has room for" in e for e in out["errors"]), out
    assert out["left"] == [] and out["after"] and out["write_errors"] == 3, out
    assert "the filesystem is full" in run.stderr


@contextlib.contextmanager
def _undeletable(shard: Path):
    """Nothing in ``shard`` can be removed (EPERM), as on a filesystem that went read-only:
    ``chattr +i`` on the directory (root, ext4/XFS/tmpfs)."""
    # (a failure, not a skip: CI runs as root on such a filesystem, and a skip hid the tests)
    assert shutil.which("chattr") is not None, "these tests need chattr (Debian's e2fsprogs)"
    made = subprocess.run(["chattr", "+i", str(shard)], capture_output=True, text=True)
    assert made.returncode == 0, f"chattr +i {shard}: {made.stderr} (needs root on a filesystem with immutable files)"
    try:
        probe = shard / "probe"
        with pytest.raises(PermissionError):  # (the flag takes effect: nothing is made there)
            probe.touch()
        yield
    finally:
        subprocess.run(["chattr", "-i", str(shard)], check=True)


def test_a_delete_whose_files_cannot_be_removed_fails_and_keeps_the_block(tmp_path):
    """A delete whose unlinks failed (EPERM here; EROFS, EIO on a failing disk) was answered
    True after a warning, the block forgotten: a restart found its files and served it
    again, a tenant's delete undone. Now it raises, and the block stays held as it is."""
    tier = DiskTier(tmp_path / "d", 1 << 30)
    (k, f), (k2, f2) = raw_frame(7), raw_frame(8)
    tier.put_many([(k, f), (k2, f2)])
    shard = tier._paths(k)[0].parent
    with _undeletable(shard):
        with pytest.raises(StorageError, match="cannot delete block .*the block is kept"):
            tier.delete(k)
        assert tier.contains(k) and tier.get(k) is not None and tier.stats().blocks == 2
    assert tier.delete(k) is True and not tier.contains(k)  # writable again: it goes
    tier.close()
    again = DiskTier(tmp_path / "d", 1 << 30)
    assert again.keys() == [k2]
    again.close()


def test_a_delete_whose_directory_cannot_be_synced_fails(tmp_path, monkeypatch):
    """The shard's fsync after the unlinks makes a delete durable; one that failed was only
    logged, and the delete answered done while a power cut could bring the block back. Now
    it raises, the shard stays owed, and the next delete (a retry) syncs it."""
    tier = DiskTier(tmp_path / "d", 1 << 30)
    k, f = raw_frame(7)
    tier.put(k, f)
    real = disk.fsync_dir

    def failing(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "fsync_dir", failing)
    with pytest.raises(StorageError, match="not durable"):
        tier.delete(k)
    with pytest.raises(StorageError, match="not durable"):
        tier.delete(k)  # (a retry, the block no longer held: still strict)
    monkeypatch.setattr(disk, "fsync_dir", real)
    assert not tier.contains(k)
    assert tier._synced[k[0]] < tier._unlinks[k[0]]
    assert tier.delete(k) is False and tier._synced[k[0]] == tier._unlinks[k[0]]
    tier.close()


def test_a_delete_of_a_block_the_disk_does_not_hold_does_not_fail_for_others_unsynced_evictions(tmp_path, monkeypatch):
    """A strict delete synced its shard strictly even for a key the disk did not hold, so
    an eviction's unsynced unlink there (best effort) and a failing fsync made the delete
    of a block only the CPU tier held raise ``StorageError``: the library's undo loops and
    ``drop_foreign`` (a read) raised mid-way. Now such a delete still tries the sync, but
    logs a failure; the block goes from the tiers that hold it."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import TieredStore
    tier = DiskTier(tmp_path / "d", 1 << 30)
    store = TieredStore([CpuTier(1 << 24), tier])  # write-back
    by_shard: dict[int, list] = {}
    for i in range(1, 2000):  # (two blocks of one shard)
        k, f = raw_frame(i)
        by_shard.setdefault(k[0], []).append((k, f))
        if len(by_shard[k[0]]) == 2:
            (a, fa), (b, fb) = by_shard[k[0]]
            break
    tier.put(a, fa)
    with tier._lock:  # (an eviction: its unlinks not synced)
        tier._remove_files(a)
        tier._index.remove(a)
    store.put(b, fb)
    assert not tier.contains(b) and store.tier("cpu").contains(b)

    def failing(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "fsync_dir", failing)
    assert tier.delete(b) is False
    assert store.delete(b) is True and not store.tier("cpu").contains(b)
    store.drop_foreign(a, "disk", "a test")  # (a read's drop: no raise either)
    assert tier._synced[a[0]] < tier._unlinks[a[0]]  # (still owed: the next delete there tries again)
    store.close()


def test_an_undo_the_disk_fails_still_raises_the_bad_input_and_deletes_the_rest(tmp_path, monkeypatch):
    """The library's undo of a call with bad input (prefix_cache, layerwise_save,
    ingest_in_place) deleted the blocks it had stored with ``store.delete``, which a failing
    disk makes raise: the caller got a ``StorageError`` for its NaN, and the blocks after the
    failing one stayed stored. Now the undo is best effort (``delete_quietly``): logged, the
    rest deleted, the ``InputError`` raised."""
    from cacheseek.errors import InputError
    from cacheseek.layerwise_save import _undone_on_bad_input
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import TieredStore
    tier = DiskTier(tmp_path / "d", 1 << 30)
    store = TieredStore([CpuTier(1 << 24), tier], write_through=["disk"])
    keys = []
    for i in range(1, 4):
        k, f = raw_frame(i)
        store.put(k, f)
        keys.append(k)
    real, calls = tier.delete, []

    def failing_once(key):
        calls.append(key)
        if len(calls) == 1:
            raise StorageError("disk tier: cannot delete block: removing its sidecar failed: Input/output error")
        return real(key)

    monkeypatch.setattr(tier, "delete", failing_once)
    with pytest.raises(InputError, match="bad"):
        with _undone_on_bad_input(store, keys):
            raise InputError("bad")
    assert calls == keys
    assert [tier.contains(k) for k in keys] == [True, False, False]  # (the failing one logged, still there)
    store.close()


def test_a_batch_of_deletes_stops_at_the_block_the_disk_could_not_delete(tmp_path):
    """``delete_many`` (a flush, a chain's delete) went on past a block whose files stayed,
    and counted it deleted."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.tiered import DeleteFailed, TieredStore
    tier = DiskTier(tmp_path / "d", 1 << 30)
    store = TieredStore([CpuTier(1 << 20), tier], write_through=["disk"])
    keys: list[bytes] = []
    for i in range(1, 100):  # (three blocks in three shards: only the second's is made undeletable)
        k, f = raw_frame(i)
        if len(keys) < 3 and all(k[0] != x[0] for x in keys):
            store.put(k, f)
            keys.append(k)
    shard = tier._paths(keys[1])[0].parent
    with _undeletable(shard):
        with pytest.raises(DeleteFailed) as failed:
            store.delete_many(keys)
        assert failed.value.results == [True]
        assert [tier.contains(k) for k in keys] == [False, True, True]
        assert store.get(keys[1]) is not None
    assert store.delete_many(keys) == [False, True, True]
    store.close()


ADMIN = {"Authorization": "Bearer adm"}


def _server_holding(tmp_path: Path, seed: int) -> tuple[Server, list[tuple[bytes, bytes]]]:
    """A server with an admin token (``ADMIN``) that has stored a chain of 3 (put here),
    stopped; the chain."""
    blocks = raw_chain(seed, 3)
    srv = Server(tmp_path, "--admin-token", "adm")
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for h, body in blocks:
            assert c.put(f"/v1/blocks/{h.hex()}", content=body).status_code == 201
    return srv, blocks


def test_a_server_answers_507_to_a_delete_or_flush_the_disk_could_not_carry_out(tmp_path):
    """A DELETE or an admin flush whose files could not be removed was answered 204 / 200
    "deleted_blocks": the blocks came back at the next restart."""
    srv, blocks = _server_holding(tmp_path, 43)
    admin = ADMIN
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        h = blocks[-1][0]
        shards = sorted({srv.disk_path / x.hex()[:2] for x, _ in blocks})
        with contextlib.ExitStack() as stack:
            for shard in shards:
                stack.enter_context(_undeletable(shard))
            r = c.delete(f"/v1/blocks/{h.hex()}")
            assert r.status_code == 507 and "cannot delete block" in r.json()["error"], r.text
            assert h.hex() not in r.text  # (a stored key is never told)
            assert c.get(f"/v1/blocks/{h.hex()}").status_code == 200
            r = c.post("/v1/admin/flush", params={"namespace": ""}, headers=admin)
            assert r.status_code == 507 and "flush of namespace ''" in r.json()["error"], r.text
            assert c.post("/v1/lookup", json={"hashes": [x.hex() for x, _ in blocks]}).json()["matched"] == 3
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/lookup", json={"hashes": [x.hex() for x, _ in blocks]}).json()["matched"] == 3
        r = c.post("/v1/admin/flush", params={"namespace": ""}, headers=admin)
        assert r.status_code == 200 and r.json()["deleted_blocks"] == 3, r.text
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/lookup", json={"hashes": [x.hex() for x, _ in blocks]}).json()["matched"] == 0


def test_a_flush_that_fails_part_way_forgets_the_pins_of_the_blocks_it_deleted(tmp_path):
    """A flush deletes a chain tail first; its head's files cannot be removed. The tail, and
    the pin named by it, are gone: the pin was kept all the same (in the pins list and the
    store's pin table), a retry never found it again, and a client writing the prompt again
    had it pinned on arrival, never evicted, though the operator had flushed it."""
    srv, blocks = _server_holding(tmp_path, 44)
    admin = ADMIN
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.put(f"/v1/admin/pins/{blocks[-1][0].hex()}", json={}, headers=admin).status_code == 200
        head = srv.disk_path / blocks[0][0].hex()[:2]
        # (the seed's chain has its head alone in its shard directory: only its delete fails)
        assert not any(h.hex()[:2] == head.name for h, _ in blocks[1:])
        with _undeletable(head):
            r = c.post("/v1/admin/flush", params={"namespace": ""}, headers=admin)
            assert r.status_code == 507 and "2 of its 3 blocks deleted" in r.json()["error"], r.text
        assert c.get("/v1/admin/pins", headers=admin).json() == []
        r = c.post("/v1/admin/flush", params={"namespace": ""}, headers=admin)
        assert r.status_code == 200 and r.json()["deleted_blocks"] == 1, r.text
        for h, body in blocks:  # the prompt written again
            assert c.put(f"/v1/blocks/{h.hex()}", content=body).status_code == 201
        assert all(t.get("pinned_blocks", 0) == 0 for t in c.get("/v1/stats").json()["tiers"])


def test_a_block_the_device_fails_to_read_is_dropped_and_written_again(tmp_path, monkeypatch):
    """A block whose file gave EIO on every read (a bad sector) was kept: every lookup
    advertised it, every prefix read was cut there, and a put of it answered "present"
    without writing it. The I/O error is the block's damage: dropped (counted in
    ``corrupt``, the read in ``read_errors``), and the next put writes it again. A read
    not made for want of descriptors keeps the block, as before."""
    tier = DiskTier(tmp_path / "d", 1 << 30)
    (k1, f1), (k2, f2) = raw_frame(1), raw_frame(2)
    tier.put_many([(k1, f1), (k2, f2)])
    bad = {str(tier._paths(k1)[0]): errno.EIO, str(tier._paths(k2)[0]): errno.EMFILE}
    real = direct_io._read_whole

    def failing(fd, path, *args):
        if str(path) in bad:
            raise OSError(bad[str(path)], os.strerror(bad[str(path)]))
        return real(fd, path, *args)

    monkeypatch.setattr(direct_io, "_read_whole", failing)
    assert tier.get_many([k1, k2]) == [None, None]
    stats = tier.stats()
    assert not tier.contains(k1) and tier.contains(k2)  # the shortage's block kept
    assert (stats.corrupt, stats.read_errors, stats.blocks) == (1, 2, 1)
    bad.pop(str(tier._paths(k1)[0]))
    assert tier.put(k1, f1).stored is not None  # written again, not answered "present"
    assert tier.get(k1) is not None
    tier.close()


def _no_new_threads(monkeypatch) -> None:
    """Every thread started from now on fails as at a container's pids limit."""
    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)


def test_the_disk_tier_starts_its_threads_at_open_not_under_load(tmp_path, monkeypatch):
    """Its writer and reader pools started threads as work came: at a pids limit the one
    that could not start raised ``RuntimeError: can't start new thread`` out of a put or a
    read (a server's 500). They start at open now, and work goes on with no thread to
    start; a limit that leaves no room for them fails the open, naming it."""
    tier = DiskTier(tmp_path / "d", 1 << 30, read_depth=4)
    _no_new_threads(monkeypatch)
    blocks = [raw_frame(i) for i in range(1, 9)]
    assert all(r.stored is not None for r in tier.put_many(blocks))
    assert [f is not None for f in tier.get_many([k for k, _ in blocks])] == [True] * 8
    frames = tier.stream([k for k, _ in blocks])
    for frame in frames:
        assert frame is not None and frame.lease is not None
        frame.lease.release()
    frames.close()
    tier.close()
    with pytest.raises(StorageError, match="cannot start the 8 threads of the disk tier's writes: can't start new "
                                           "thread .*pids limit"):
        DiskTier(tmp_path / "d", 1 << 30)
    monkeypatch.undo()
    again = DiskTier(tmp_path / "d", 1 << 30)  # (the failed open gave the directory back)
    assert len(again.keys()) == 8
    again.close()


# A shard directory made read-only under the tier, as a filesystem the kernel remounted so
# after an error (ext4's errors=remount-ro): a read-only bind mount of it over itself, in
# the script's own mount namespace (a tmpfs remounted read-only refuses while the tier
# holds its lock file open for writing).
_READ_ONLY = _ON_A_TMPFS + r"""
import subprocess, time
from pathlib import Path
from cacheseek.errors import StorageError
from cacheseek.store import disk

(k1, f1), (k2, f2) = raw_frame(1), raw_frame(2)
tier.put(k1, f1)
shard = str(tier._paths(k2)[0].parent)
for cmd in (["mount", "--bind", shard, shard], ["mount", "-o", "remount,bind,ro", shard]):
    subprocess.run(cmd, check=True)
before = tier.read_only()
failed = [str(tier.put_many([(k2, f2)])[0].error)]
try:
    tier.put(k2, f2)
except StorageError as exc:
    failed.append(str(exc))
ro = tier.stats().to_dict()
still = tier.read_only()  # (looked at again: the shard still refuses)
time.sleep(disk.ROOT_CHECK_SECONDS + 0.1)
still_after_a_second = tier.read_only()
subprocess.run(["umount", shard], check=True)
time.sleep(disk.ROOT_CHECK_SECONDS + 0.1)
cleared = tier.read_only()  # (no write in between: the probe found the filesystem writable)
left = sorted(p.name for p in Path(shard).iterdir() if p.name.startswith("."))
stored = tier.put(k2, f2).stored is not None
print(json.dumps({"before": before, "failed": failed, "read_only": ro["read_only"], "write_errors": ro["write_errors"],
                  "still": [still, still_after_a_second], "cleared": cleared, "left": left,
                  "served": tier.get(k1) is not None, "stored": stored, "after": tier.stats().to_dict()["read_only"]}))
tier.close()
"""


def test_a_filesystem_gone_read_only_marks_the_tier_read_only_until_it_is_writable(tmp_path):
    """Every write refused with EROFS was one more write error and a warning, nothing in
    the stats said the tier could not write any more (and ``/readyz`` stayed 200). Now
    ``read_only`` says it (an error logged once) until the folder takes a probe file again
    (asked at most once a second: no write needed) or a write commits."""
    out = run_on_a_tmpfs(tmp_path, _READ_ONLY, "16m", 60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["before"] is None and all("Read-only file system" in e for e in got["failed"]), got
    assert got["read_only"] == disk.READ_ONLY and got["write_errors"] == 2
    assert got["still"] == [disk.READ_ONLY, disk.READ_ONLY] and got["cleared"] is None, got
    assert got["left"] == [], got  # (the probe's file removed)
    assert got["served"] and got["stored"] and got["after"] is None
    assert out.stderr.count("its filesystem is read-only") == 1, out.stderr


_SERVER_READ_ONLY = r"""
import json, subprocess, sys, time
from pathlib import Path
sys.path[:0] = sys.argv[2:]
import httpx
from server_helpers import Server, raw_chain

disk = Path(sys.argv[1]) / "disk"
(h1, b1), (h2, b2) = raw_chain(51, 2)
out = {}
srv = Server(Path(sys.argv[1]).parent / "srv", "--disk-path", str(disk), "--disk-bytes", "8MiB")
with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
    out["put"] = c.put(f"/v1/blocks/{h1.hex()}", content=b1).status_code
    shard = str(disk / h2.hex()[:2])
    for cmd in (["mount", "--bind", shard, shard], ["mount", "-o", "remount,bind,ro", shard]):
        subprocess.run(cmd, check=True)
    out["put_ro"] = c.put(f"/v1/blocks/{h2.hex()}", content=b2).status_code
    ready = c.get("/readyz")
    out["readyz"] = [ready.status_code, ready.json()]
    out["get"] = c.get(f"/v1/blocks/{h1.hex()}").status_code
    out["metric"] = [line for line in c.get("/metrics").text.splitlines() if line.startswith("cacheseek_tier_read_only")]
    out["stats"] = [t["read_only"] for t in c.get("/v1/stats").json()["tiers"] if t["name"] == "disk"]
    subprocess.run(["umount", shard], check=True)
    # No write in between (a load balancer sends an unready server none): ready again
    # once the tier's probe finds the filesystem writable (at most once a second).
    deadline = time.monotonic() + 10
    while (status := c.get("/readyz").status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    out["readyz_after"] = status
    out["put_rw"] = c.put(f"/v1/blocks/{h2.hex()}", content=b2).status_code
print(json.dumps(out))
print(srv.output(), file=sys.stderr)
"""


def test_the_read_only_probe_writes_no_bytes_and_leaves_no_file(tmp_path, monkeypatch):
    """The probe that clears ``read_only`` wrote bytes into its file: a filesystem writable
    again but full refused them (ENOSPC), the tier stayed "read-only" for good, and each
    probe left its file behind. It now makes an empty file and removes it; only a refusal
    as read-only (or of permission) says the filesystem still is."""
    tier = DiskTier(tmp_path / "d", 1 << 20)
    folder = tmp_path / "d"
    assert tier._accepts_writes(folder) and not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    assert tier._accepts_writes(folder)  # (a full filesystem: writable)
    monkeypatch.setattr(os, "write", real_write)
    real_open = os.open
    for code, writable in ((errno.EROFS, False), (errno.EACCES, False), (errno.ENOSPC, True)):
        monkeypatch.setattr(os, "open", lambda *a, c=code: (_ for _ in ()).throw(OSError(c, os.strerror(c))))
        assert tier._accepts_writes(folder) is writable, code
    monkeypatch.setattr(os, "open", real_open)
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
    tier.close()


def test_a_write_through_server_whose_disk_went_read_only_is_not_ready(tmp_path):
    """Its disk refusing every write (EROFS), a write-through server answered every PUT 507
    while ``/readyz`` said 200, so a load balancer kept sending it writes. Not ready now
    (``cacheseek_tier_read_only`` 1, ``read_only`` in the stats), reads of what it holds
    served, and ready again once the filesystem is writable, with no write in between
    (none comes: a load balancer sends an unready server no writes)."""
    out = run_on_a_tmpfs(tmp_path, _SERVER_READ_ONLY, "16m", 120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["put"] == 201 and got["put_ro"] == 507 and got["get"] == 200, got
    assert got["readyz"] == [503, {"error": f"disk tier (written through): {disk.READ_ONLY}"}], got
    assert got["metric"] == ['cacheseek_tier_read_only{tier="disk"} 1.0'] and got["stats"] == [disk.READ_ONLY]
    assert got["put_rw"] == 201 and got["readyz_after"] == 200, got


class _SlowUnlink:
    """``disk._unlink`` held at the first unlink of a sidecar (an eviction's, on a disk where
    each takes tens of milliseconds) until ``go`` is set; ``released``: whether it was, within
    a bounded wait (a tier that waits for its own unlink then goes on, and fails the test)."""

    def __init__(self, monkeypatch, only: threading.Thread | None = None) -> None:
        """``only``: held in that thread alone."""
        self.reached, self.go = threading.Event(), threading.Event()
        self.released: bool | None = None
        self.key: bytes | None = None
        real = disk._unlink

        def unlink(path: Path) -> None:
            if path.suffix == ".meta" and not self.reached.is_set() and only in (None, threading.current_thread()):
                self.key = bytes.fromhex(path.stem)
                self.reached.set()
                self.released = self.go.wait(10)
            real(path)

        monkeypatch.setattr(disk, "_unlink", unlink)


def _charged_on_disk(tier: DiskTier) -> int:
    """What the files in the tier's shards take, counted as the budget counts them."""
    return sum(direct_io.round_up(max(p.stat().st_size, 1), tier.alloc_unit)
               for p in tier.root.glob("[0-9a-f][0-9a-f]/*"))


def test_an_evictions_slow_unlinks_hold_up_no_lookup_or_other_write_and_keep_the_budget(tmp_path, monkeypatch):
    """An eviction unlinked its victims' files under the tier's lock, which a lookup takes
    (``contains_many``, in the server's event loop): on a disk whose unlinks took 10-50 ms, a
    batch evicting 64 blocks froze every request, ``/healthz`` included, for seconds. The
    victims leave the index under the lock and their files go after; until they are gone
    their bytes count as held, so a write meanwhile evicts for them rather than take their
    room twice over."""
    frames = [raw_frame(i) for i in range(1, 8)]
    charge = disk.block_charge(frames[0][1].meta.nbytes, disk.allocation_unit(tmp_path))
    tier = DiskTier(tmp_path / "d", 4 * charge, fsync=False)
    slow = _SlowUnlink(monkeypatch)
    try:
        for key, frame in frames[:4]:
            tier.put(key, frame)
        batch: list = []
        # (two frames: room is made for both at once, then unlinked, before either is claimed)
        writer = threading.Thread(target=lambda: batch.extend(tier.put_many(frames[4:6])))
        writer.start()
        assert slow.reached.wait(10)
        answers = tier.contains_many([key for key, _ in frames])  # the lookup answers while the unlink waits
        tier.put(*frames[6])  # and so does another write
        on_disk = _charged_on_disk(tier)
        slow.go.set()
        writer.join(30)
        assert slow.released, "the lookup and the write waited for the eviction's unlinks"
        assert answers[:4].count(True) == 2 and answers[4:] == [False, False, False], answers
        assert on_disk <= tier.capacity_bytes, (on_disk, tier.capacity_bytes)  # (the victims' files still there)
        assert [r.error for r in batch] == [None, None]
        assert tier.contains_many([key for key, _ in frames[4:]]) == [True, True, True]
        assert tier.stats().blocks == 4 and _charged_on_disk(tier) == tier.stats().used_bytes <= tier.capacity_bytes
        assert not tier._removing and tier._removing_bytes == 0
    finally:
        slow.go.set()
        tier.close()


@pytest.mark.parametrize("batch", [False, True])
def test_a_block_put_again_while_its_eviction_unlinks_its_files_keeps_its_new_files(tmp_path, monkeypatch, batch):
    """A block's files are named by its hash alone: written again while its eviction still
    had its old files to unlink (outside the lock), the late unlink removed the new ones, and
    the block was answered stored and held with nothing on disk. Its put waits for that
    unlink, and writes after it."""
    frames = dict(raw_frame(i) for i in range(1, 7))
    keys = list(frames)
    charge = disk.block_charge(frames[keys[0]].meta.nbytes, disk.allocation_unit(tmp_path))
    tier = DiskTier(tmp_path / "d", 4 * charge, fsync=False)
    slow = _SlowUnlink(monkeypatch)
    waits_for_it = slow.go

    class Seen(threading.Event):
        def wait(self, timeout=None):
            waits_for_it.set()  # (the put again waits for the unlink: let it go on)
            return super().wait(timeout)

    removal = disk._Removal
    monkeypatch.setattr(disk, "_Removal", lambda nbytes: removal(nbytes, Seen()))
    try:
        for key in keys[:4]:
            tier.put(key, frames[key])
        evicting = threading.Thread(target=tier.put, args=(keys[4], frames[keys[4]]))
        evicting.start()
        assert slow.reached.wait(10)
        victim = slow.key
        assert victim in keys[:4] and not tier.contains(victim)
        again = [(victim, raw_frame(keys.index(victim) + 1)[1])] + ([(keys[5], frames[keys[5]])] if batch else [])
        answers: list = []

        def put_again():
            try:
                answers.extend(tier.put_many(again) if batch else [tier.put(*again[0])])
            finally:
                waits_for_it.set()  # (done without waiting: the unlink goes on, and takes its files)

        reput = threading.Thread(target=put_again)
        reput.start()
        reput.join(30)
        evicting.join(30)
        assert slow.released, "the put again waited on the tier's lock, not on the unlink"
        assert answers and answers[0].error is None and answers[0].stored is not None, answers
        assert tier.present_many([victim]) == [True]
        got = tier.get(victim)
        assert got is not None and bytes(got.to_bytes()) == bytes(frames[victim].to_bytes())
    finally:
        slow.go.set()
        tier.close()


def _full_tier(tmp_path, blocks: int = 4, **kwargs) -> tuple[DiskTier, list, int]:
    """A tier whose budget is ``blocks`` one-charge blocks, holding them (frames 1 to
    ``blocks``, the first the least recently used); the frames 1 to 9, and the charge."""
    frames = [raw_frame(i) for i in range(1, 10)]
    charge = disk.block_charge(frames[0][1].meta.nbytes, disk.allocation_unit(tmp_path))
    tier = DiskTier(tmp_path / "d", blocks * charge, fsync=kwargs.pop("fsync", False), **kwargs)
    for key, frame in frames[:blocks]:
        tier.put(key, frame)
    return tier, frames, charge


def test_a_batch_leaves_no_victim_marked_while_it_waits_on_another_write(tmp_path, monkeypatch):
    """A batch whose claim evicted a block and then failed (the next victim not read for want
    of a descriptor) went on to wait for another thread's write of one of its frames with its
    victim out of the index but its files not yet unlinked: a put of that victim waited on it
    meanwhile, and where that put was itself the write waited on (a batch holding both
    blocks), neither ever returned. A call now unlinks its victims before it waits on anyone."""
    tier, frames, charge = _full_tier(tmp_path)
    victim = frames[0][0]
    tier.demote_evicted = True
    real_read = tier._read_frame
    reads: list = []

    def read(key, expected=None):
        reads.append(key)
        if len(reads) == 2:  # (the second victim, once)
            raise direct_io.ReadFailed("EMFILE", damaged=False, shortage=True)
        return real_read(key, expected)

    monkeypatch.setattr(tier, "_read_frame", read)
    in_flight = disk._InFlight(nbytes=charge)  # another thread's write of frames[4], its room held
    with tier._lock:
        tier._writing[frames[4][0]] = in_flight
        tier._reserved += charge
    waiting, marked = threading.Event(), []
    real_await = tier._await

    def await_(key, pending):
        marked.extend(getattr(tier._doomed, "keys", None) or [])
        waiting.set()
        return real_await(key, pending)

    monkeypatch.setattr(tier, "_await", await_)
    batch: list = []
    writer = threading.Thread(target=lambda: batch.extend(tier.put_many([frames[4], frames[5]])), daemon=True)
    again: list = []
    reput = threading.Thread(target=lambda: again.append(tier.put(*frames[0])), daemon=True)
    try:
        writer.start()
        assert waiting.wait(10)
        assert reads[0] == victim and not tier.contains(victim)
        reput.start()
        reput.join(10)  # (the batch's wait goes on meanwhile: only its victim's unlink was waited for)
        assert marked == [], [k.hex() for k in marked]
        assert not reput.is_alive(), "a put of the victim waited on a batch waiting on another write"
        assert again[0].stored is not None and tier.contains(victim)
    finally:
        with tier._lock:
            del tier._writing[frames[4][0]]
            tier._reserved -= charge
        in_flight.done.set()
        writer.join(10)
        reput.join(10)
        tier.close()
    assert batch[1].error is not None  # (its victim could not be read: refused)


def test_a_delete_racing_an_eviction_of_its_block_syncs_that_evictions_unlinks(tmp_path, monkeypatch):
    """A delete looked for an eviction of its block, outside the lock, before it took the
    lock: one beginning between the two (the block out of the index, its files not yet
    unlinked) left the delete finding the block not held, and nothing owed in its shard; it
    returned before the eviction's unlinks, which nothing synced, so a power cut brought the
    block a tenant had deleted back. Here another thread's put evicts the block as soon as the
    delete first lets the tier's lock go, whatever it did under it."""
    tier, frames, charge = _full_tier(tmp_path, fsync=True)
    victim = frames[0][0]
    assert tier._index.victim(()) == victim
    deleting = threading.get_ident()
    # (two frames: room made for both at once, so it evicts even once the delete freed a block)
    evicting = threading.Thread(target=tier.put_many, args=(frames[4:6],), daemon=True)
    slow = _SlowUnlink(monkeypatch, only=evicting)
    real = tier._lock

    class Lock:
        def acquire(self, *args, **kwargs):
            return real.acquire(*args, **kwargs)

        def release(self):
            real.release()
            if threading.get_ident() == deleting and not evicting.is_alive() and not slow.reached.is_set():
                evicting.start()  # (its victim: the delete's block, if still held; else the next)
                assert slow.reached.wait(10)

        __enter__ = acquire

        def __exit__(self, *exc):
            self.release()

        def locked(self):
            return real.locked()

    monkeypatch.setattr(tier, "_lock", Lock())
    try:
        answer = tier.delete(victim)
        slow.go.set()
        evicting.join(10)
        assert not evicting.is_alive()
        assert slow.key is not None
        shard = victim[0]
        assert tier._synced[shard] == tier._unlinks[shard] > 0, (answer, tier._unlinks[shard], tier._synced[shard])
        assert not any(p.exists() for p in tier._paths(victim))
    finally:
        slow.go.set()
        evicting.join(10)
        monkeypatch.setattr(tier, "_lock", real)
        tier.close()


def test_a_write_beside_another_puts_unlinking_victims_evicts_only_for_itself(tmp_path, monkeypatch):
    """A put took its room in the same locked section as it evicted for it, and unlinked its
    victims after: a write meanwhile counted both its room and its victims' bytes (the same
    room twice), and evicted a block it did not need to, for good. The room is taken once the
    victims are gone."""
    tier, frames, charge = _full_tier(tmp_path)
    slow = _SlowUnlink(monkeypatch)
    first = threading.Thread(target=tier.put, args=frames[4], daemon=True)
    try:
        first.start()
        assert slow.reached.wait(10)
        tier.put(*frames[5])
        slow.go.set()
        first.join(10)
        assert not first.is_alive()
        stats = tier.stats()
        assert (stats.blocks, stats.evictions) == (4, 2), stats
        assert tier.contains_many([frames[4][0], frames[5][0]]) == [True, True]
        assert _charged_on_disk(tier) == stats.used_bytes == tier.capacity_bytes
    finally:
        slow.go.set()
        first.join(10)
        tier.close()


def test_a_write_beside_a_trims_unlinking_victims_evicts_only_for_itself(tmp_path, monkeypatch):
    """A trim's victims (blocks over a budget lowered, or overshot by concurrent writes)
    counted as held for other writers until their files were unlinked: a write meanwhile
    evicted a block more for them, and the tier ended a block under its budget."""
    tier, frames, charge = _full_tier(tmp_path)
    tier.close()
    tier = DiskTier(tmp_path / "d", 3 * charge, fsync=False, trim_at_open=False)  # (4 blocks over a budget of 3)
    slow = _SlowUnlink(monkeypatch)
    trim = threading.Thread(target=tier.trim, daemon=True)
    try:
        trim.start()
        assert slow.reached.wait(10)
        tier.put(*frames[5])
        slow.go.set()
        trim.join(10)
        assert not trim.is_alive()
        stats = tier.stats()
        assert (stats.blocks, stats.evictions) == (3, 2), stats
        assert _charged_on_disk(tier) == stats.used_bytes == tier.capacity_bytes
    finally:
        slow.go.set()
        trim.join(10)
        tier.close()


def test_an_evictions_unlinks_after_the_tier_gave_its_directory_up_leave_the_new_one_alone(tmp_path, monkeypatch):
    """An eviction's unlinks, outside the lock, went on after the tier gave its directory up
    (replaced behind its back): they removed the files of the same blocks in the directory
    there now, another owner's. Each unlink looks first."""
    tier, frames, charge = _full_tier(tmp_path)
    root = tmp_path / "d"
    slow = _SlowUnlink(monkeypatch)
    batch = threading.Thread(target=tier.put_many, args=(frames[4:6],), daemon=True)  # (evicts two, room made at once)
    try:
        batch.start()
        assert slow.reached.wait(10)
        victims = [key for key, _ in frames[:2]]
        assert slow.key in victims and not any(tier.contains_many(victims))
        os.rename(root, tmp_path / "old")
        shutil.copytree(tmp_path / "old", root)
        assert tier.lost() == "replaced by another directory"
        slow.go.set()  # (the sidecar's unlink under way goes on: it began before)
        batch.join(10)
        assert not batch.is_alive()
        left = [p.name for key in victims for p in tier._paths(key) if p.exists()]
        assert sorted(left) == sorted(f"{k.hex()}.{s}" for k in victims for s in ("frame", "meta")
                                      if (k, s) != (slow.key, "meta")), left
        assert not tier._removing and tier._removing_bytes == 0
    finally:
        slow.go.set()
        batch.join(10)
        tier.close()


class _Interrupt(BaseException):
    """An interrupt (KeyboardInterrupt, or an exception a signal handler raises)."""


def test_an_interrupted_unlink_of_a_victim_leaves_no_put_of_it_waiting(tmp_path, monkeypatch):
    """An eviction's unlinks cut short by an interrupt (and the try at the end of the call
    too) left the victim marked as being removed by a thread that might never call the tier
    again: every other thread's put of it waited for good, and the budget counted its bytes
    twice. Its files are charged as a block of another version's are, and go when room is
    needed; a put of it writes over them."""
    tier, frames, charge = _full_tier(tmp_path)
    victim = frames[0][0]
    real = disk._unlink
    armed = [True]

    def unlink(path: Path) -> None:  # (in the first put alone: in its eviction, then in the call's last try)
        if path.suffix == ".meta" and armed[0]:
            raise _Interrupt
        real(path)

    monkeypatch.setattr(disk, "_unlink", unlink)
    answers: list = []
    reput = threading.Thread(target=lambda: answers.append(tier.put(*frames[0])), daemon=True)
    try:
        with pytest.raises(_Interrupt):
            tier.put(*frames[4])
        armed[0] = False
        assert not tier.contains(victim)
        reput.start()
        reput.join(10)
        assert not reput.is_alive(), "a put of the victim waits on the interrupted thread"
        assert answers[0].stored is not None and tier.contains(victim)
        assert not tier._removing and tier._removing_bytes == 0
        assert tier.stats().used_bytes + tier._others_bytes <= tier.capacity_bytes
        tier.put(*frames[5])
        assert _charged_on_disk(tier) == tier.stats().used_bytes + tier._others_bytes <= tier.capacity_bytes
    finally:
        for removal in list(tier._removing.values()):
            removal.done.set()  # (the old code: the put stuck on it goes on, and the tier closes)
        reput.join(10)
        tier.close()


def test_a_refit_while_writes_are_in_flight_keeps_the_headroom(tmp_path, monkeypatch):
    """A refit counted the writes in flight as held, though what they had yet to write was
    still in the filesystem's free space: counted twice, the budget rose by nearly the bytes
    in flight, past the headroom (and here past the filesystem's size), and the writes then
    took that much of it."""
    from types import SimpleNamespace

    unit, size = 4096, 4 << 20
    root = tmp_path / "d"

    def free() -> int:  # a filesystem of ``size`` bytes holding the directory's files and nothing else
        return size - sum(direct_io.round_up(max(p.stat().st_size, 1), unit) for p in root.rglob("*") if p.is_file())

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free() // unit, f_frsize=unit,
                                                                    f_bsize=unit, f_blocks=size // unit))
    tier = DiskTier(root, 1 << 40, fsync=False)
    try:
        budget = tier.capacity_bytes
        frames = [raw_frame(i) for i in range(1, 9)]
        n = tier.charge(frames[0][1].meta.nbytes)
        claimed = [tier._claim(key, frame, []) for key, frame in frames]  # (claimed, not yet written)
        tier._refit()
        assert tier.capacity_bytes <= budget, (tier.capacity_bytes, budget, len(frames) * n)
        tier._finish([p for p in claimed if isinstance(p, disk._Pending)])
    finally:
        tier.close()


def test_a_refit_while_a_write_has_written_but_not_committed_evicts_nothing_for_it(tmp_path, monkeypatch):
    """What a write in flight has written is neither in the filesystem's free space nor held
    until it commits: a refit that left it out lowered the budget by that much, and the next
    put evicted cached blocks down to it for good (19 where 1 was needed, here)."""
    from types import SimpleNamespace

    unit, size, flying = 4096, 4 << 20, 1 << 20
    root = tmp_path / "d"

    def free() -> int:  # a filesystem of ``size`` bytes holding the directory's files and nothing else
        return size - sum(direct_io.round_up(max(p.stat().st_size, 1), unit) for p in root.rglob("*") if p.is_file())

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free() // unit, f_frsize=unit,
                                                                    f_bsize=unit, f_blocks=size // unit))
    monkeypatch.setattr(disk, "REFIT_SECONDS", 0.0)
    tier = DiskTier(root, 1 << 40, fsync=False)
    try:
        i = 1
        while tier.stats().used_bytes + flying + tier.charge(raw_frame(i)[1].meta.nbytes) <= tier.capacity_bytes:
            tier.put(*raw_frame(i))
            i += 1
        budget, blocks = tier.capacity_bytes, len(tier._index)
        # A write of 1 MiB in flight: its room held, its bytes written, not committed yet.
        with tier._lock:
            tier._reserved += flying
        (root / "ab" / ".tmp-in-flight").write_bytes(bytes(flying))
        tier._refit()
        assert tier.capacity_bytes == budget
        evictions = tier.stats().evictions
        tier.put(*raw_frame(i))  # the one block the budget has no room for beside the write in flight
        assert tier.stats().evictions - evictions == 1 and len(tier._index) == blocks
        (root / "ab" / ".tmp-in-flight").unlink()
        with tier._lock:
            tier._reserved -= flying
    finally:
        tier.close()


def test_a_second_interrupt_as_an_evictions_unlinks_are_settled_leaves_no_block_marked(tmp_path, monkeypatch):
    """A put interrupted in its victim's unlink, and again as the settle took the lock to let
    the victim go: the thread's marks were cleared first, so no settle ever came for it, and
    every put and delete of that block waited for ever."""
    root = tmp_path / "d"
    probe = DiskTier(root, 1 << 30, fsync=False)
    probe.put(*raw_frame(1))
    charge = probe.stats().used_bytes
    probe.close()
    shutil.rmtree(root)
    tier = DiskTier(root, 4 * charge, fsync=False)
    for i in range(1, 5):
        tier.put(*raw_frame(i))
    real_lock, real_unlink, armed = tier._lock, disk._unlink, [False]

    class SecondInterrupt:  # the tier's lock, but for one interrupt as it is taken
        def __enter__(self):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt("second")
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    def unlink(path):
        monkeypatch.setattr(disk, "_unlink", real_unlink)
        armed[0] = True
        raise KeyboardInterrupt("first")

    tier._lock = SecondInterrupt()
    monkeypatch.setattr(disk, "_unlink", unlink)
    try:
        with pytest.raises(KeyboardInterrupt):
            tier.put(*raw_frame(5))
        tier._lock = real_lock
        assert not tier._removing and tier._removing_bytes == 0
        victims = [raw_frame(i) for i in range(1, 5) if not tier.contains(raw_frame(i)[0])]
        assert victims
        put = threading.Thread(target=tier.put, args=victims[0])
        put.start()
        put.join(10)
        assert not put.is_alive() and tier.contains(victims[0][0])
    finally:
        tier._lock = real_lock
        tier.close()
