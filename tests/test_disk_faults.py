"""The disk tier under storage faults other than a crash: files lost or cut behind its back."""

from __future__ import annotations

import httpx

from server_helpers import Server, raw_chain
from store_helpers import raw_frame
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
