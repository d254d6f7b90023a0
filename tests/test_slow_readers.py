"""Responses that stream stored frames to a client reading slowly (but above
``body_min_bytes_per_second``, so it is never cut off), on a real ``cacheseek serve`` over
loopback: the CPU-tier slots such a response keeps leased, and the bytes it sends while
the tier evicts and reuses slots under it."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx

from cacheseek.layout import KVLayout
from server_helpers import LAYOUT, Server, batch_body, raw_chain

MiB = 1 << 20
BIG_LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, dtype="float16")  # 1 MiB Raw frames


class SlowReader:
    """A raw-socket GET of a prefix, read at ``rate`` bytes a second in a thread of its own."""

    def __init__(self, port: int, path: str, rate: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        self.rate = rate
        self.got = bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        start = time.monotonic()
        self.sock.settimeout(20)
        while not self.stop.is_set():
            ahead = len(self.got) - self.rate * (time.monotonic() - start)
            if ahead > 0:
                time.sleep(min(ahead / self.rate, 0.05))
                continue
            try:
                data = self.sock.recv(16 << 10)
            except OSError:
                return
            if not data:
                return
            self.got += data
            if self._whole():
                return

    def _whole(self) -> bool:
        top, sep, body = bytes(self.got[:4096]).partition(b"\r\n\r\n")
        if not sep:
            return False
        length = next(int(line.split(b":")[1]) for line in top.split(b"\r\n") if line.lower().startswith(b"content-length"))
        return len(self.got) >= len(top) + 4 + length

    def finish(self, timeout: float = 30) -> bytes:
        """Read the rest (at full speed) until the server closes or the body is whole."""
        self.rate = 1 << 40
        self.thread.join(timeout)
        self.sock.close()
        return bytes(self.got)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _cpu(url: str) -> dict:
    return httpx.get(url + "/v1/stats").json()["tiers"][0]


def _frames(body: bytes) -> list[bytes]:
    """The whole frames of a (possibly cut short) batch body."""
    frames, i = [], 0
    while i + 8 <= len(body) and i + 8 + (n := int.from_bytes(body[i : i + 8], "little")) <= len(body):
        frames.append(body[i + 8 : i + 8 + n])
        i += 8 + n
    return frames


def test_a_slow_reader_holds_a_few_leases_not_its_whole_prefix(tmp_path):
    """A response read slowly held the lease of every frame it had fetched until it was over:
    a 16 MiB prefix read at 1 MiB/s held 9 leases after 3 MiB read (and more as it went on),
    and a 24 MiB ingest into the 24 MiB tier meanwhile kept 16 blocks, its evicted slots held."""
    chain = raw_chain(1, 16, layout=BIG_LAYOUT)  # 16 MiB, 1 MiB frames
    args = ["--cpu-reserve-bytes", "6MiB", "--body-min-bytes-per-second", "64KiB"]
    with Server(tmp_path, *args, cpu_bytes="24MiB", disk=False) as srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]), timeout=30).status_code == 200
        reader = SlowReader(srv.port, f"/v1/prefixes/{chain[-1][0].hex()}", 1 * MiB)
        try:
            time.sleep(2.5)
            held = _cpu(srv.url)
            # The frame the transport is sending, the tail of the one before, the next one fetched.
            assert held["leases_active"] <= 3, held
            fresh = raw_chain(2, 24, layout=BIG_LAYOUT)  # the tier's whole budget: evicts the chain being read
            codes = [httpx.put(f"{srv.url}/v1/blocks/{h.hex()}", content=f, timeout=30).status_code for h, f in fresh]
            assert codes == [201] * 24, codes
            tier = _cpu(srv.url)
            assert tier["held_slots"] <= 3 and tier["blocks"] >= 20, tier
        finally:
            reader.close()
        tier = _cpu(srv.url)
        assert tier["leases_active"] == 0 and tier["held_slots"] == 0, tier
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_slow_reader_gets_the_stored_bytes_while_the_tier_reuses_slots_under_it(tmp_path):
    """Leases released as the transport sends past their frames, never sooner: slots evicted
    and refilled while slow readers are mid-response never change the bytes they receive."""
    # 12 MiB of 128 KiB frames: more than the kernel's socket buffers take, so the transport
    # holds views of several frames when the tier is refilled.
    chain = raw_chain(3, 96, layout=LAYOUT, block=128)
    args = ["--body-min-bytes-per-second", "64KiB", "--eviction", "lru"]
    with Server(tmp_path, *args, cpu_bytes="16MiB", disk=False) as srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain])).status_code == 200
        readers = []
        for _ in range(4):
            readers.append(SlowReader(srv.port, f"/v1/prefixes/{chain[-1][0].hex()}", 1 * MiB))
            time.sleep(0.3)
        time.sleep(0.5)
        for seed in (10, 11, 12):  # 24 MiB: every slot of the chain evicted, and refilled
            fresh = raw_chain(seed, 64, layout=LAYOUT, block=128)
            assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in fresh])).status_code == 200
        for reader in readers:
            got = reader.finish()
            top, _, body = got.partition(b"\r\n\r\n")
            assert top.startswith(b"HTTP/1.1 200")
            frames = _frames(body)
            assert len(frames) >= 8  # (cut short where the chain was evicted ahead of the stream)
            assert all(f == chain[i][1] for i, f in enumerate(frames)), [f == chain[i][1] for i, f in enumerate(frames)]
        tier = _cpu(srv.url)
        assert tier["leases_active"] == 0 and tier["held_slots"] == 0 and tier["evictions"] > 0, tier
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_reader_above_the_minimum_rate_is_not_cut_off_while_the_kernel_holds_its_bytes(tmp_path):
    """The send watchdog saw progress only when the transport's own buffer shrank, which it
    does only when the socket's kernel buffer (megabytes on loopback) has room again: a
    reader taking 1 MiB/s was cut off as "no response byte taken" within a second or two
    under a 1 s idle limit. What the kernel has not sent counts as unsent too."""
    chain = raw_chain(4, 4, layout=BIG_LAYOUT)  # 4 MiB
    args = ["--body-idle-timeout-seconds", "1", "--body-min-bytes-per-second", "16KiB"]
    with Server(tmp_path, *args, cpu_bytes="24MiB", disk=False) as srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]), timeout=30).status_code == 200
        reader = SlowReader(srv.port, f"/v1/prefixes/{chain[-1][0].hex()}", 1 * MiB)
        reader.thread.join(30)
        got = reader.finish()
        top, _, body = got.partition(b"\r\n\r\n")
        assert top.startswith(b"HTTP/1.1 200") and _frames(body) == [f for _, f in chain], (len(body), top[:200])
        # One under the minimum is still cut off, once its response outgrows the kernel's buffers.
        long = raw_chain(5, 12, layout=BIG_LAYOUT)
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in long]), timeout=30).status_code == 200
        reader = SlowReader(srv.port, f"/v1/prefixes/{long[-1][0].hex()}", 4 << 10)
        time.sleep(4)
        got = reader.finish()  # the rest at full speed: what the kernels held when it was cut (~4 MiB)
        assert len(got) < 8 * MiB, len(got)




def test_a_stalled_reader_of_a_chain_broken_mid_stream_is_cut_off(tmp_path):
    """A response cut short (a block found corrupt ahead of the stream) waits for its leased
    bytes to leave the transport before it closes. That wait had no end: where the frame
    before the break left the transport under its high-water mark (writing not paused, so
    the protocol's send limits never armed), a client that read no more held the response,
    and the leases of the frames in the transport, for good. Now the wait ends once
    body_idle_timeout_seconds pass without a byte taken, and the connection is dropped."""
    # 48 KiB frames: the one the socket's buffers take only part of leaves the rest (under
    # the transport's 64 KiB high-water mark) in the transport, and writing goes on.
    layout = dict(layout=LAYOUT, block=48)
    probe_chain = raw_chain(40, 150, **layout)
    chains = [raw_chain(41 + i, 150, **layout) for i in range(3)]
    args = ["--body-idle-timeout-seconds", "2", "--body-min-bytes-per-second", "1KiB"]
    with Server(tmp_path, *args, cpu_bytes="16MiB") as srv:

        def stalled(chain) -> socket.socket:  # a GET of the chain that reads nothing
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(f"GET /v1/prefixes/{chain[-1][0].hex()} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            return sock

        def put(frames) -> None:
            assert httpx.post(srv.url + "/v1/blocks", content=batch_body(frames), timeout=30).status_code == 200

        put([f for _, f in probe_chain])
        probe = stalled(probe_chain)
        time.sleep(1.0)  # the socket's buffers fill, then the transport's; writing pauses
        # Fetched: the frame the kernel took part of, the one that paused writing, the one
        # waiting to be sent, the next one.
        partly = _cpu(srv.url)["hits"] - 4
        probe.close()
        assert 10 <= partly <= 140, partly
        # Each chain breaks at a block near the one after that one: a block read from disk
        # and found corrupt; those before it are in memory, leased as they are sent.
        breaks = [partly + 1 + i for i in (-1, 0, 1)]
        put([f for chain, at in zip(chains, breaks) for _, f in chain[at:]])
        put([f for _, f in raw_chain(50, 400, **layout)])  # 19 MiB: the tails go to disk only
        put([f for chain, at in zip(chains, breaks) for _, f in chain[:at]])
        for chain, at in zip(chains, breaks):
            hexkey = chain[at][0].hex()
            with open(srv.disk_path / hexkey[:2] / f"{hexkey}.frame", "r+b") as f:
                f.seek(-100, 2)
                f.write(b"\xff" * 100)
        socks = []
        try:
            socks = [stalled(chain) for chain in chains]
            deadline = time.monotonic() + 10
            while (tier := _cpu(srv.url))["leases_active"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert tier["leases_active"] == 0 and tier["held_slots"] == 0, tier
            disk = httpx.get(srv.url + "/v1/stats").json()["tiers"][1]
            assert disk["corrupt"] == 3, disk  # each chain's break was met
        finally:
            for sock in socks:
                sock.close()
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_prefix_stream_stops_fetching_once_its_client_is_gone(tmp_path):
    """A client that went away mid-prefix had the rest of its chain fetched all the same (and
    counted as hits and as bytes sent): woken by the disconnection, the body ran through every
    frame in memory before the cancellation reached it (a send to a gone client returns at
    once). It now stops at the next frame."""
    chain = raw_chain(60, 200, layout=LAYOUT, block=48)  # 9.4 MiB: more than the socket's buffers take
    with Server(tmp_path, cpu_bytes="64MiB", disk=False) as srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]), timeout=30).status_code == 200
        sent_before = _frame_bytes_sent(srv.url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        sock.connect(("127.0.0.1", srv.port))
        sock.sendall(f"GET /v1/prefixes/{chain[-1][0].hex()} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        time.sleep(1.0)  # the buffers fill; writing pauses
        fetched = _cpu(srv.url)["hits"]
        assert fetched < len(chain) - 10, fetched
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset: the client is gone
        time.sleep(1.0)
        tier = _cpu(srv.url)
        assert tier["hits"] <= fetched + 1 and tier["leases_active"] == 0, (fetched, tier)
        assert _frame_bytes_sent(srv.url) - sent_before <= (fetched + 1) * len(chain[0][1])
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def _frame_bytes_sent(url: str) -> float:
    line = next(line for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("cacheseek_frame_bytes_sent_total "))
    return float(line.split()[1])



def test_a_stalled_reader_of_small_frames_gets_the_stored_bytes_after_the_response_is_over(tmp_path):
    """The last ``TAIL_COPY`` bytes of a response go from a copy, so that no view of a leased
    slot is left with the transport once it is over and every lease is released. Only the
    last frame's were copied: with frames smaller than the transport's high-water mark, what
    it still held at the end began with views of the frames before (their leases released),
    and a tier reusing those slots changed the bytes the client got. Now the copy is the
    response's last bytes, whichever frames they are of."""
    chain = raw_chain(70, 1500, layout=LAYOUT, block=4)  # 6.8 MiB of 4.6 KiB frames
    args = ["--body-idle-timeout-seconds", "30", "--body-min-bytes-per-second", "1KiB", "--eviction", "lru"]
    with Server(tmp_path, *args, cpu_bytes="8MiB", disk=False) as srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]), timeout=30).status_code == 200
        probe = SlowReader(srv.port, f"/v1/prefixes/{chain[-1][0].hex()}", 1)  # reads (almost) nothing
        time.sleep(1.0)  # the socket's buffers fill, then the transport's: writing pauses
        fetched = _cpu(srv.url)["hits"]
        probe.close()
        assert fetched < len(chain) - 10, fetched
        # A prefix of the chain that ends a few frames before writing paused: the response is
        # over with the transport under its high-water mark, holding the end of the frames
        # before the last, as the socket's buffers fill again.
        # The probe's hits count a frame or more read ahead of what went out (how many depends on
        # where the pause fell): a prefix that does not fit after all stalls with its frames
        # leased; it is given up and a shorter one asked, still within the transport's buffer.
        for short in (7, 10, 13):
            time.sleep(0.5)
            hits = _cpu(srv.url)["hits"]
            reader = SlowReader(srv.port, f"/v1/prefixes/{chain[fetched - short - 1][0].hex()}", 1)
            deadline = time.monotonic() + 10
            while ((tier := _cpu(srv.url))["hits"] < hits + fetched - short or tier["leases_active"]) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            if tier["leases_active"] == 0:
                break
            reader.close()
        assert tier["leases_active"] == 0, tier  # the response is over; the client has read nothing
        for seed in (71, 72, 73):  # every slot of the chain evicted, and refilled
            fresh = raw_chain(seed, 1000, layout=LAYOUT, block=4)
            assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in fresh])).status_code == 200
        got = reader.finish()
        top, _, body = got.partition(b"\r\n\r\n")
        assert top.startswith(b"HTTP/1.1 200")
        frames = _frames(body)
        assert len(frames) == fetched - short
        bad = [i for i, f in enumerate(frames) if f != chain[i][1]]
        assert not bad, bad
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_client_gone_while_a_frame_is_read_in_a_thread_leaves_no_lease(tmp_path):
    """A frame a worker thread reads (here: one a prefetch is promoting, waited for, then
    taken from memory, leased) was cancelled with the response when its client went away,
    but the thread read on, and added the frame's lease to the response's leases after they
    were released: the lease was held for good (the slot never reused). The read is now
    waited for, and its lease released with the others."""
    chain = raw_chain(80, 100, layout=BIG_LAYOUT)  # 100 MiB, 1 MiB frames
    srv = Server(tmp_path, cpu_bytes="256MiB")
    with srv:
        assert httpx.post(srv.url + "/v1/blocks", content=batch_body([f for _, f in chain]), timeout=60).status_code == 200
    with srv:  # restarted: the chain on disk only
        answer = httpx.post(srv.url + "/v1/prefetch", json={"hashes": [h.hex() for h, _ in chain]})
        assert answer.status_code == 202, answer.text
        # The last block: the prefetch promotes it last, and the read waits for it.
        sock = socket.socket()
        sock.connect(("127.0.0.1", srv.port))
        sock.sendall(f"GET /v1/prefixes/{chain[-1][0].hex()}?start={len(chain) - 1} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        time.sleep(0.05)  # the response begun, its read waiting
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset: the client is gone
        deadline = time.monotonic() + 20
        while (tier := _cpu(srv.url))["blocks"] < len(chain) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        tier = _cpu(srv.url)
        assert tier["blocks"] == len(chain) and tier["leases_active"] == 0 and tier["held_slots"] == 0, tier
        log = srv.output()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
