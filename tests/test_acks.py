"""What an acknowledgement means, on a real server: concurrent writers of one block, reads
right after the answers, and write-back under load with a small CPU tier."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from server_helpers import Server, batch_body, raw_frame

CONFIGS = {
    "disk": ("--cpu-bytes", "0"),
    "cpu+disk": ("--cpu-bytes", "8MiB"),
    "write-back": ("--cpu-bytes", "8MiB", "--no-write-through"),
}


@pytest.mark.parametrize("tiers", list(CONFIGS))
def test_concurrent_puts_of_one_block_then_gets_find_it(tmp_path, tiers):
    """Writers of one new block at once: one stores it, the others wait for that write and
    answer present; every writer's GET right after its answer finds the exact bytes."""
    writers, rounds = 4, 25
    failures: list[str] = []
    with Server(tmp_path, *CONFIGS[tiers]) as srv:
        clients = [httpx.Client(base_url=srv.url, timeout=30) for _ in range(writers)]
        try:
            for round_ in range(rounds):
                h, frame = raw_frame(round_, block=64)
                start = threading.Barrier(writers)
                statuses: list[str] = []

                def write(c: httpx.Client, batch: bool) -> None:
                    start.wait()
                    if batch:
                        r = c.post("/v1/blocks", content=batch_body([frame]))
                        status = r.json()[0]["status"] if r.status_code == 200 else f"HTTP {r.status_code}"
                    else:
                        r = c.put(f"/v1/blocks/{h.hex()}", content=frame)
                        status = r.json()["status"] if r.status_code in (200, 201) else f"HTTP {r.status_code}"
                    got = c.get(f"/v1/blocks/{h.hex()}")
                    statuses.append(status)
                    if got.status_code != 200 or got.content != frame:
                        failures.append(f"round {round_}: answered {status}, then GET gave {got.status_code}")

                threads = [threading.Thread(target=write, args=(c, i % 2 == 1)) for i, c in enumerate(clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert sorted(statuses) == ["present"] * (writers - 1) + ["stored"], (round_, statuses)
            assert not failures, failures[:5]
        finally:
            for c in clients:
                c.close()


def _cpu(stats: dict) -> dict:
    return next(t for t in stats["tiers"] if t["name"] == "cpu")


@pytest.mark.slow
def test_write_back_under_16_clients_never_answers_507_and_gives_its_slots_back(tmp_path):
    """A CPU tier of 8 MiB over a 64 MiB disk, write-back, 16 clients putting ~40 MiB: the
    disk has room all along, so no write is refused; evicting makes room (the move down holds
    a copy, not the slot); afterwards no slot is still held; nothing acknowledged is lost."""
    clients, per_client = 16, 40
    acked: dict[bytes, bytes] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def client(w: int, url: str) -> None:
        rng = random.Random(w)
        with httpx.Client(base_url=url, timeout=60) as c:
            i = 0
            while i < per_client:
                n = min(rng.choice((1, 4)), per_client - i)
                frames = [raw_frame(w * 1000 + i + j, block=64) for j in range(n)]
                i += n
                if n == 1:
                    r = c.put(f"/v1/blocks/{frames[0][0].hex()}", content=frames[0][1])
                    results = [r.json()] if r.status_code in (200, 201) else None
                else:
                    r = c.post("/v1/blocks", content=batch_body([f for _, f in frames]))
                    results = r.json() if r.status_code == 200 else None
                if results is None or any(x["status"] == "failed" for x in results):
                    errors.append(f"HTTP {r.status_code}: {r.text[:300]}")
                    return
                with lock:
                    acked.update(frames)

    with Server(tmp_path, "--cpu-bytes", "8MiB", "--disk-bytes", "64MiB", "--no-write-through") as srv:
        threads = [threading.Thread(target=client, args=(w, srv.url)) for w in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            stats = c.get("/v1/stats").json()
            cpu, disk = _cpu(stats), next(t for t in stats["tiers"] if t["name"] == "disk")
            assert stats["durability"] == "memory"
            assert cpu["held_slots"] == 0 and cpu["leases_active"] == 0 and cpu["reservation_bytes"] == 0, cpu
            assert cpu["used_bytes"] <= cpu["capacity_bytes"] and cpu["evictions"] > 0, cpu
            assert disk["demotions"] > 0 and disk["write_errors"] == 0, disk
            assert cpu["blocks"] + disk["blocks"] == len(acked) == clients * per_client
            for h, f in acked.items():  # every acknowledged block, from memory or from disk
                got = c.get(f"/v1/blocks/{h.hex()}")
                assert got.status_code == 200 and got.content == f
