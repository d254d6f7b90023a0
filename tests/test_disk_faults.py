"""The disk tier under storage faults other than a crash: files lost or cut behind its back."""

from __future__ import annotations

import httpx

from server_helpers import Server, raw_chain
from store_helpers import raw_frame, run_on_a_tmpfs
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
