"""A randomized kill -9 soak of ``cacheseek serve``: its durability promises checked from the
outside, over raw HTTP as docs/http-api.md describes it.

    python -m benchmarks.crash_soak --rounds 24 --seed 1 --clients 3

Each round takes one *lane* (a disk directory of its own and one configuration, kept across
that lane's rounds), starts the server on it (now and then killing a start first, at times in
its recovery), checks what it serves against every answer it gave before, then puts load on
it from ``--clients`` threads and kills it with SIGKILL: at a random moment, or right after a
``DELETE`` was answered. The load: chains of Raw and KIVI int2/int4/int8 frames (16- and
32-byte hashes, 1 to 8 blocks, some extending chains other clients share and send at once),
sent block by block (``PUT``) or in batches (``POST /v1/blocks``); prefix and block reads
(every frame served compared with what was sent); deletes of single blocks, admin chain
deletes, and flushes of a namespace only one client writes; pins (admin).

Lanes (small budgets, so that the CPU tier evicts every round):

- ``wt``: CPU 1 MiB over a 1 GiB write-through disk (durable; the disk never evicts)
- ``wt-evict``: CPU 1 MiB over a 4 MiB write-through disk (durable; the disk evicts)
- ``disk``: a 1 GiB disk alone (durable)
- ``wb``: CPU 1 MiB over a 1 GiB disk, write-back (memory; the CPU tier demotes to disk)

What a restart must show (docs/http-api.md, Acknowledgements; docs/design.md, Deletes):

- a block acknowledged ``durable`` (``stored``/``present``) is served byte-identical, unless
  its lane's disk evicts (``wt-evict``) and it is not pinned: an evicted block is absent,
  counted ``evicted``, never ``lost``; nor is a ``memory`` acknowledgement (``wb``) that a
  kill took before its demotion (counted ``memory_gone``);
- a block answered ``204`` to a ``DELETE`` (or deleted by an answered chain delete or flush),
  and not written again, is never served again (before the kill nor after it); except a
  flushed block that a restart before the flush found without its head, in write-back
  (operations.md, Known limits: it is unattributed, and a flush finds blocks through their
  attribution), counted ``flush_missed``;
- a pin answered ``saved: true`` is listed after the restart, and its chain served whole;
- no block is ever served with other bytes than were sent; no request is answered 5xx;
- the start's log has no traceback and names no damaged block (a kill -9 never leaves a
  committed file torn: each is renamed into place whole), and the disk tier counts no
  corrupt frame.

A disk that fills is not soaked here: it needs a small filesystem, which takes root
(a loop mount or a tmpfs of a given size); ``tests/test_disk_faults.py`` covers a full one.
Prints a table per lane and writes ``crash_soak.json`` (``--out``; default
benchmarks/results). Exit status 1 if any violation was found.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cacheseek.layout import KVLayout
from cacheseek.quant import KIVI, Raw
from cacheseek.store.frame import build_frame, plan_frame

from .report import table, write_json

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
BLOCK = 32  # tokens: a Raw frame holds 32 KiB of payload (KIVI groups tokens by 32)
CODECS: list[Any] = [Raw(), KIVI(bits=4, group_size=32), KIVI(bits=2, group_size=32), KIVI(bits=8, group_size=32)]
ADMIN = "soak-admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@dataclass(frozen=True)
class Lane:
    name: str
    args: tuple[str, ...]
    durable: bool
    disk_evicts: bool


LANES = {
    "wt": Lane("wt", ("--cpu-bytes", "1MiB", "--disk-bytes", "1GiB"), True, False),
    "wt-evict": Lane("wt-evict", ("--cpu-bytes", "1MiB", "--disk-bytes", "4MiB"), True, True),
    "disk": Lane("disk", ("--cpu-bytes", "0", "--disk-bytes", "1GiB"), True, False),
    "wb": Lane("wb", ("--cpu-bytes", "1MiB", "--disk-bytes", "1GiB", "--no-write-through"), False, False),
}

# What a start may say at WARNING or above after a kill -9 and nothing else: the writes the kill
# interrupted (temp files, data files never committed by a sidecar). Any other warning is
# reported (not a violation unless it names damage: see DAMAGE).
EXPECTED_WARNINGS = re.compile(r"temp file|orphan|without a sidecar|never acknowledged|interrupted", re.I)
DAMAGE = re.compile(r"torn|damaged|not msgpack|corrupt|checksum|its sidecar says", re.I)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    script = Path(sys.executable).parent / "cacheseek"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cacheseek.server.cli"]


class Server:
    """One ``cacheseek serve`` on a lane's directory, its log in a file of its own."""

    def __init__(self, root: Path, lane: Lane, n: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{lane.name}-{n}.log"
        self.cmd = [*serve_command(), "serve", "--port", str(self.port), "--log-level", "info",
                    "--disk-path", str(root / lane.name), *lane.args]
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> Server:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "CACHESEEK_ADMIN_TOKEN": ADMIN})
        return self

    def ready(self, timeout: float = 120.0) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return False

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


# -- what was sent and answered ---------------------------------------------------------------


@dataclass
class Block:
    frame: bytes
    chain: int  # the chain that made it
    namespace: str
    durable_acks: int = 0
    memory_acks: int = 0
    deleted: bool = False  # a DELETE (or a chain delete) answered, and not written again since
    deleting: bool = False  # a delete was sent: unanswered (the kill), its fate is unknown
    deleted_by: str = ""  # which answer deleted it, in which round
    orphaned: bool = False  # served after a restart while an ancestor was not: unattributed since
    acked_round: int = -1


@dataclass
class Chain:
    index: int
    codec: Any
    keys: list[bytes]
    shared: bool  # sent by several clients; never deleted
    pure: bool  # no block of another chain in it: a chain delete takes all of it
    owner: int  # the client that may delete it (-1: none)
    namespace: str = ""  # "" or a client's own ("solo-N"), which it flushes now and then
    pinned: bool = False
    dead: bool = False  # deleted: not sent again


@dataclass
class Ledger:
    """Every frame sent to one lane, what the server answered for it, and every breach."""

    blocks: dict[bytes, Block] = field(default_factory=dict)
    chains: list[Chain] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def breach(self, what: str) -> None:
        with self.lock:
            self.violations.append(what)
            self.counts["violations"] += 1
        print(f"VIOLATION {what}", flush=True)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n


def make_chain(ledger: Ledger, rng: random.Random, *, shared: bool, owner: int,
               prefix: Chain | None = None, namespace: str = "") -> Chain:
    codec = rng.choice(CODECS)
    hash_size = rng.choice((16, 32))
    keys: list[bytes] = []
    parent, position = bytes(hash_size), 0
    if prefix is not None:
        keys = list(prefix.keys)
        parent, position = keys[-1], len(keys)
        hash_size = len(parent)
        codec = prefix.codec
    template = codec.template((LAYOUT.num_layers, LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim), LAYOUT.dtype)
    buffers = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    new: list[tuple[bytes, bytes]] = []
    for _ in range(rng.randint(1, 8)):
        key = rng.randbytes(hash_size)
        meta = plan_frame(block_hash=key, parent_hash=parent, position=position, layout=LAYOUT, block_tokens=BLOCK,
                          codec=codec.spec(), buffers=buffers)
        new.append((key, bytes(build_frame(meta, [rng.randbytes(t.nbytes) for t in meta.tensors]))))
        keys.append(key)
        parent, position = key, position + 1
    chain = Chain(-1, codec, keys, shared=shared, pure=prefix is None, owner=owner,
                  namespace=prefix.namespace if prefix is not None else namespace)
    with ledger.lock:
        chain.index = len(ledger.chains)
        for key, frame in new:
            ledger.blocks[key] = Block(frame, chain.index, chain.namespace)
        ledger.chains.append(chain)
    return chain


def ns_headers(namespace: str) -> dict[str, str]:
    return {"X-CacheSeek-Namespace": namespace} if namespace else {}


def batch_body(frames: list[bytes]) -> bytes:
    return b"".join(len(f).to_bytes(8, "little") + f for f in frames)


def split_batch(body: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 8 <= len(body):
        n = int.from_bytes(body[i : i + 8], "little")
        if i + 8 + n > len(body):
            break
        out.append(body[i + 8 : i + 8 + n])
        i += 8 + n
    return out


# -- the load ---------------------------------------------------------------------------------


class Killed(Exception):
    """The server went away mid-request: nothing that request sent was acknowledged."""


class Load:
    """``clients`` threads of mixed traffic against one server until it is killed."""

    def __init__(self, url: str, ledger: Ledger, lane: Lane, round_: int, rng: random.Random, clients: int,
                 kill_after_delete: bool) -> None:
        self.url, self.ledger, self.lane, self.round = url, ledger, lane, round_
        self.seeds = [rng.randrange(1 << 62) for _ in range(clients)]
        self.stop = threading.Event()
        self.acking = threading.Event()
        self.deleted = threading.Event()
        self.kill_after_delete = kill_after_delete
        self.acks = 0
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(clients)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self, w: int) -> None:
        rng = random.Random(self.seeds[w])
        try:
            with httpx.Client(base_url=self.url, timeout=30) as c:
                while not self.stop.is_set():
                    op = rng.random()
                    if op < 0.55:
                        self._ingest(c, rng, w)
                    elif op < 0.72:
                        self._read_prefix(c, rng)
                    elif op < 0.82:
                        self._read_block(c, rng)
                    elif op < 0.9:
                        self._delete(c, rng, w)
                    elif op < 0.94:
                        self._delete_chain(c, rng, w)
                    elif op < 0.96:
                        self._flush(c, w)
                    else:
                        self._pin(c, rng)
        except Killed:
            return
        except Exception as e:  # a harness bug must not pass for a quiet round
            self.ledger.breach(f"round {self.round}: client {w} crashed: {type(e).__name__}: {e}")

    def _call(self, c: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = c.request(method, path, **kw)
        except (httpx.TransportError, httpx.DecodingError) as e:
            raise Killed from e
        if r.status_code >= 500 and not (r.status_code == 503 and self.stop.is_set()):
            self.ledger.breach(f"round {self.round}: {method} {path[:40]}: {r.status_code} {r.text[:200]}")
        return r

    def _pick(self, rng: random.Random, pred: Any) -> Chain | None:
        with self.ledger.lock:
            some = [ch for ch in self.ledger.chains[-200:] if pred(ch)]
        return rng.choice(some) if some else None

    def _ingest(self, c: httpx.Client, rng: random.Random, w: int) -> None:
        ledger = self.ledger
        roll = rng.random()
        if roll < 0.25 and (ch := self._pick(rng, lambda ch: ch.shared and not ch.dead)) is not None:
            chain = ch  # another client may be sending it right now: "present" answers
        elif roll < 0.5 and (base := self._pick(rng, lambda ch: ch.shared and not ch.dead)) is not None:
            chain = make_chain(ledger, rng, shared=False, owner=w, prefix=base)
        elif roll < 0.6:  # into this client's own namespace, which it alone writes and flushes
            chain = make_chain(ledger, rng, shared=False, owner=w, namespace=f"solo-{w}")
        else:
            chain = make_chain(ledger, rng, shared=rng.random() < 0.2, owner=w)
        head = ns_headers(chain.namespace)
        step = 1 if rng.random() < 0.3 else rng.choice((2, 3, 4, 8))
        for i in range(0, len(chain.keys), step):
            keys = chain.keys[i : i + step]
            with ledger.lock:
                frames = [ledger.blocks[k].frame for k in keys]
            if len(keys) == 1:
                r = self._call(c, "PUT", f"/v1/blocks/{keys[0].hex()}", content=frames[0], headers=head)
                answers = [r.json()] if r.status_code in (200, 201) else None
            else:
                r = self._call(c, "POST", "/v1/blocks", content=batch_body(frames),
                               headers={"Content-Type": "application/vnd.cacheseek.frames", **head})
                answers = r.json() if r.status_code == 200 else None
            if answers is None:
                ledger.count(f"ingest_{r.status_code}")
                if r.status_code != 507:  # (every frame sent is valid: a refusal is the server's fault)
                    ledger.breach(f"round {self.round}: ingest answered {r.status_code}: {r.text[:200]}")
                return
            for key, answer in zip(keys, answers, strict=True):
                self._acked(key, answer)
            if not self.lane.disk_evicts and rng.random() < 0.3:
                # Either level: a GET right after the answer finds the block, until the last tier
                # holding it evicts it (here a 1 GiB disk: never); none deletes a chain being sent.
                acked = [k for k, a in zip(keys, answers) if a["status"] in ("stored", "present")]
                if acked:
                    key = rng.choice(acked)
                    got = self._call(c, "GET", f"/v1/blocks/{key.hex()}", headers=head)
                    if got.status_code != 200:
                        ledger.breach(f"round {self.round}: {key.hex()} acknowledged, then GET {got.status_code}")
                    else:
                        self._check_frames([got.content], chain, chain.keys.index(key), "read after its ack")

    def _acked(self, key: bytes, answer: dict) -> None:
        ledger = self.ledger
        if answer["status"] not in ("stored", "present"):
            ledger.count("ingest_failed")
            return
        durable = answer["durability"] == "durable"
        if durable != self.lane.durable:
            ledger.breach(f"round {self.round}: {key.hex()} acknowledged {answer['durability']} by lane {self.lane.name}")
        with ledger.lock:
            block = ledger.blocks[key]
            block.durable_acks += durable
            block.memory_acks += not durable
            block.deleted = False
            block.acked_round = self.round
            ledger.counts["acks"] += 1
            self.acks += 1
        self.acking.set()

    def _check_frames(self, frames: list[bytes], chain: Chain, start: int, what: str) -> None:
        for i, frame in enumerate(frames):
            key = chain.keys[start + i]
            with self.ledger.lock:
                sent = self.ledger.blocks[key].frame
            if frame != sent:
                self.ledger.breach(f"round {self.round}: {what}: block {key.hex()} served {len(frame)} bytes "
                                   f"other than the {len(sent)} sent")

    def _read_prefix(self, c: httpx.Client, rng: random.Random) -> None:
        chain = self._pick(rng, lambda ch: True)
        if chain is None:
            return
        end = rng.randrange(len(chain.keys))
        r = self._call(c, "GET", f"/v1/prefixes/{chain.keys[end].hex()}", headers=ns_headers(chain.namespace))
        self.ledger.count(f"prefix_{r.status_code}")
        if r.status_code == 200:
            frames = split_batch(r.content)
            self._check_frames(frames, chain, 0, "prefix read")
            if len(frames) < end + 1:
                self.ledger.count("prefix_cut_short")

    def _read_block(self, c: httpx.Client, rng: random.Random) -> None:
        chain = self._pick(rng, lambda ch: True)
        if chain is None:
            return
        i = rng.randrange(len(chain.keys))
        r = self._call(c, "GET", f"/v1/blocks/{chain.keys[i].hex()}", headers=ns_headers(chain.namespace))
        self.ledger.count(f"block_{r.status_code}")
        if r.status_code == 200:
            self._check_frames([r.content], chain, i, "block read")

    def _deletable(self, w: int) -> Any:
        return lambda ch: ch.owner == w and not ch.shared and not ch.pinned and not ch.dead

    def _delete(self, c: httpx.Client, rng: random.Random, w: int) -> None:
        chain = self._pick(rng, self._deletable(w))
        if chain is None:
            return
        # Only blocks of this client's own (unshared) tail: a shared prefix is never deleted.
        with self.ledger.lock:
            first = next(i for i, k in enumerate(chain.keys) if self.ledger.blocks[k].chain == chain.index)
            key = chain.keys[rng.randrange(first, len(chain.keys))]
            chain.dead = True  # never sent again: a delete must hold
            self.ledger.blocks[key].deleting = True
        r = self._call(c, "DELETE", f"/v1/blocks/{key.hex()}", headers=ns_headers(chain.namespace))
        self.ledger.count(f"delete_{r.status_code}")
        if r.status_code in (204, 404):
            with self.ledger.lock:
                self.ledger.blocks[key].deleted = True
                self.ledger.blocks[key].deleted_by = f"DELETE {r.status_code} in round {self.round}"
            if self.kill_after_delete and r.status_code == 204:
                self.deleted.set()
            again = self._call(c, "GET", f"/v1/blocks/{key.hex()}", headers=ns_headers(chain.namespace))
            if again.status_code != 404:
                self.ledger.breach(f"round {self.round}: block {key.hex()} deleted ({r.status_code}), then GET "
                                   f"{again.status_code}")

    def _delete_chain(self, c: httpx.Client, rng: random.Random, w: int) -> None:
        deletable = self._deletable(w)
        chain = self._pick(rng, lambda ch: deletable(ch) and ch.pure)
        if chain is None:
            return
        with self.ledger.lock:
            chain.dead = True
            for key in chain.keys:
                self.ledger.blocks[key].deleting = True
        r = self._call(c, "DELETE", f"/v1/admin/chains/{chain.keys[-1].hex()}",
                       headers={**ADMIN_HEADERS, **ns_headers(chain.namespace)})
        self.ledger.count(f"delete_chain_{r.status_code}")
        if r.status_code == 200:
            # The tail and every ancestor no other stored chain goes through: the whole of a pure
            # chain that nothing extends (its blocks are this chain's alone).
            with self.ledger.lock:
                for key in chain.keys:
                    self.ledger.blocks[key].deleted = True
                    self.ledger.blocks[key].deleted_by = f"chain delete in round {self.round}"
            if self.kill_after_delete:
                self.deleted.set()

    def _flush(self, c: httpx.Client, w: int) -> None:
        """A flush of this client's own namespace: every block of it goes (no other client
        writes there, and this one is not writing now; others may be reading it)."""
        namespace = f"solo-{w}"
        with self.ledger.lock:
            # Every chain of it, those partly deleted already too: the flush takes what is left.
            doomed = [ch for ch in self.ledger.chains if ch.namespace == namespace]
            for ch in doomed:
                ch.dead = True
                for key in ch.keys:
                    self.ledger.blocks[key].deleting = True
        if not doomed:
            return
        r = self._call(c, "POST", f"/v1/admin/flush?namespace={namespace}", headers=ADMIN_HEADERS)
        self.ledger.count(f"flush_{r.status_code}")
        if r.status_code in (200, 404):  # (404: nothing of it ever stored)
            with self.ledger.lock:
                for ch in doomed:
                    for key in ch.keys:
                        self.ledger.blocks[key].deleted = True
                        self.ledger.blocks[key].deleted_by = f"flush {r.status_code} in round {self.round}"
            if self.kill_after_delete:
                self.deleted.set()

    def _pin(self, c: httpx.Client, rng: random.Random) -> None:
        with self.ledger.lock:
            pinned = sum(len(ch.keys) for ch in self.ledger.chains if ch.pinned)
        if pinned >= 24:  # at most ~0.75 MiB of Raw frames pinned: the evicting disk keeps room
            return
        chain = self._pick(rng, lambda ch: ch.shared and not ch.dead and not ch.pinned)
        if chain is None:
            return
        r = self._call(c, "PUT", f"/v1/admin/pins/{chain.keys[-1].hex()}", headers=ADMIN_HEADERS)
        self.ledger.count(f"pin_{r.status_code}")
        if r.status_code == 200 and r.json().get("saved"):
            with self.ledger.lock:
                chain.pinned = True


# -- a round ----------------------------------------------------------------------------------


def verify(url: str, ledger: Ledger, lane: Lane, round_: int, rng: random.Random) -> dict[str, int]:
    """Everything a restart must show, against every answer the lane's servers gave."""
    got: Counter[str] = Counter()
    with ledger.lock:
        blocks = dict(ledger.blocks)
        pinned = {k for ch in ledger.chains if ch.pinned for k in ch.keys}
        # A pin is made again at start only if its chain is stored (server/admin.py restore_pins):
        # in write-back a kill may take a pinned chain that only memory held, and its pin with it.
        pinned_tails = {ch.keys[-1] for ch in ledger.chains
                        if ch.pinned and all(ledger.blocks[k].durable_acks for k in ch.keys)}
    with httpx.Client(base_url=url, timeout=60) as c:
        stats = c.get("/v1/stats").json()
        if stats["durability"] != ("durable" if lane.durable else "memory"):
            ledger.breach(f"round {round_}: durability {stats['durability']} on lane {lane.name}")
        listed = {p["hash"] for p in c.get("/v1/admin/pins", headers=ADMIN_HEADERS).json()}
        for key in pinned_tails:
            if key.hex() not in listed:
                ledger.breach(f"round {round_}: pin on {key.hex()} (saved) not listed after the restart")
        # Every block the lane was ever sent whose fate matters, and a sample of the rest.
        # (Every block of a client's own namespace too: which are orphans after this restart.)
        must = [k for k, b in blocks.items() if b.durable_acks or b.deleted or k in pinned or b.namespace]
        rest = [k for k, b in blocks.items() if not (b.durable_acks or b.deleted or k in pinned or b.namespace)]
        keys = must + rng.sample(rest, min(len(rest), 300))
        seen: dict[bytes, bool] = {}
        for key in keys:
            b = blocks[key]
            if b.deleting and not b.deleted:
                got["delete_unanswered"] += 1
                continue  # a delete cut by the kill: either way is right
            r = c.get(f"/v1/blocks/{key.hex()}", headers=ns_headers(b.namespace))
            if r.status_code >= 500:
                ledger.breach(f"round {round_}: GET {key.hex()} after the restart: {r.status_code} {r.text[:200]}")
                continue
            present = seen[key] = r.status_code == 200
            if present and r.content != b.frame:
                ledger.breach(f"round {round_}: block {key.hex()} served other bytes than sent after the restart")
            if b.deleted:
                got["deleted_checked"] += 1
                if present and b.orphaned and b.deleted_by.startswith("flush") and not lane.durable:
                    # operations.md, Known limits: a flush finds a namespace's blocks through their
                    # attribution, and a block whose head was gone at a restart has none: here, a
                    # block demoted to disk whose head only memory held when the kill came. (With
                    # write-through a head goes only by a delete, which keeps its key as a root.)
                    got["flush_missed_orphans"] += 1
                elif present:
                    ledger.breach(f"round {round_}: deleted block {key.hex()} (namespace {b.namespace!r}, "
                                  f"{b.deleted_by}; acknowledged in round {b.acked_round}) served after the restart")
            elif b.durable_acks:
                got["durable_checked"] += 1
                if present:
                    got["verified"] += 1
                elif key in pinned:
                    ledger.breach(f"round {round_}: pinned durable block {key.hex()} lost")
                    got["lost"] += 1
                elif lane.disk_evicts:
                    got["evicted"] += 1
                else:
                    ch = ledger.chains[b.chain]
                    ledger.breach(f"round {round_}: durable block {key.hex()} (acknowledged in round "
                                  f"{b.acked_round}; namespace {b.namespace!r}, position "
                                  f"{ch.keys.index(key)} of chain {b.chain}, shared {ch.shared}) lost")
                    got["lost"] += 1
            elif b.memory_acks:
                got["memory_checked"] += 1
                got["verified" if present else "memory_gone"] += 1
        with ledger.lock:
            for ch in ledger.chains:
                if ch.namespace:
                    for i, key in enumerate(ch.keys):
                        if seen.get(key) and not all(seen.get(k, False) for k in ch.keys[:i]):
                            ledger.blocks[key].orphaned = True
        stats = c.get("/v1/stats").json()
        disk = next((t for t in stats["tiers"] if t["name"] == "disk"), None)
        if disk is not None and disk["corrupt"]:
            ledger.breach(f"round {round_}: the disk tier found {disk['corrupt']} corrupt frames after a kill -9")
        got["disk_blocks"] = disk["blocks"] if disk else 0
    return dict(got)


def check_log(text: str, ledger: Ledger, round_: int, what: str) -> Counter:
    seen: Counter[str] = Counter()
    if "Traceback" in text:
        ledger.breach(f"round {round_}: {what}: a traceback in the log: "
                      f"{text[text.index('Traceback'):][:400]}")
    for line in text.splitlines():
        if not re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line):
            continue
        if DAMAGE.search(line) and not EXPECTED_WARNINGS.search(line):
            ledger.breach(f"round {round_}: {what}: names damage after a kill -9: {line[:300]}")
        elif EXPECTED_WARNINGS.search(line):
            seen["expected_warnings"] += 1
        else:
            seen["other_warnings"] += 1
            ledger.count("other_warning_lines")
            print(f"  [{what}] {line[:240]}", flush=True)
    return seen


def one_round(root: Path, lane: Lane, ledger: Ledger, round_: int, rng: random.Random, args: argparse.Namespace,
              serial: list[int], *, last: bool) -> dict[str, Any]:
    """Start the lane's server (a start killed first, now and then), verify, load, kill -9;
    ``last``: verify, then stop it with SIGTERM."""
    before = len(ledger.violations)
    row: dict[str, Any] = {"round": round_, "lane": lane.name, "killed_start": "-"}
    if not last and serial[0] >= len(LANES) and rng.random() < args.startup_kills:
        # A start killed at a random moment, at times in its recovery: the next one finishes it.
        serial[0] += 1
        early = Server(root, lane, serial[0]).spawn()
        if rng.random() < 0.5:  # once the store begins to open (the disk index is read then)
            deadline = time.monotonic() + 30
            while "Waiting for application startup" not in early.output() and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
        else:
            time.sleep(rng.uniform(0.0, 1.5))
        row["killed_start"] = "ready" if early.ready(timeout=0.01) else "starting"
        early.kill9()
        check_log(early.output(), ledger, round_, "killed start")
    serial[0] += 1
    srv = Server(root, lane, serial[0]).spawn()
    t0 = time.monotonic()
    if not srv.ready():
        ledger.breach(f"round {round_}: {lane.name}: no start: {srv.output()[-1500:]}")
        srv.kill9()
        return {**row, "kill": "-", "start_s": -1, "violations": len(ledger.violations) - before}
    row["start_s"] = round(time.monotonic() - t0, 2)
    check_log(srv.output(), ledger, round_, "start")
    row.update(verify(srv.url, ledger, lane, round_, rng))
    if last:
        code = srv.stop()
        if code != 0:
            ledger.breach(f"{lane.name}: SIGTERM exit status {code}")
        check_log(srv.output(), ledger, round_, "stop")
        row.update({"acks": 0, "kill": "SIGTERM"})
    else:
        after_delete = rng.random() < args.delete_kills
        load = Load(srv.url, ledger, lane, round_, rng, args.clients, after_delete)
        with load:
            if not load.acking.wait(60):
                ledger.breach(f"round {round_}: nothing acknowledged in 60 s")
            time.sleep(rng.uniform(0.2, args.max_load_seconds))
            if after_delete:  # the next delete answered: killed right after its 204
                load.deleted.clear()
                load.deleted.wait(5.0)
            srv.kill9()
        check_log(srv.output(), ledger, round_, "run")
        row.update({"acks": load.acks, "kill": "after delete" if load.deleted.is_set() else "random"})
    row["violations"] = len(ledger.violations) - before
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lanes = [LANES[name] for name in args.lanes.split(",")]
    ledgers = {lane.name: Ledger() for lane in lanes}
    rows: list[dict[str, Any]] = []
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="crash-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    serial = [0]
    plan = [(r, lanes[r % len(lanes)], False) for r in range(args.rounds)]
    plan += [(args.rounds + i, lane, True) for i, lane in enumerate(lanes)]  # each lane's closing check
    for round_, lane, last in plan:
        if not last and args.minutes and time.monotonic() - started > args.minutes * 60:
            continue  # out of time: on to each lane's closing check
        row = one_round(root, lane, ledgers[lane.name], round_, rng, args, serial, last=last)
        rows.append(row)
        print(f"round {round_:3d} {lane.name:8s} acks {row.get('acks', 0):5d} verified {row.get('verified', 0):5d} "
              f"evicted {row.get('evicted', 0):4d} lost {row.get('lost', 0):3d} deletes held "
              f"{row.get('deleted_checked', 0):4d} kill {row['kill']:12s} killed start {row['killed_start']:8s} "
              f"start {row['start_s']:5.2f}s violations {row['violations']}", flush=True)
    totals = {name: dict(led.counts) for name, led in ledgers.items()}
    violations = {name: led.violations for name, led in ledgers.items()}
    return {"seed": args.seed, "clients": args.clients, "rounds": rows, "totals": totals, "violations": violations,
            "dir": str(root), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24, help="kill -9 rounds, over the lanes in turn")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=3, help="client threads per round")
    ap.add_argument("--lanes", default="wt,wt-evict,disk,wb", help=f"of {','.join(LANES)}")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop starting rounds after this long (0: no limit)")
    ap.add_argument("--max-load-seconds", type=float, default=4.0, help="a random kill comes 0.2 s to this after load")
    ap.add_argument("--startup-kills", type=float, default=0.3, help="share of starts killed first, at a random moment")
    ap.add_argument("--delete-kills", type=float, default=0.3, help="share of rounds killed right after a DELETE's 204")
    ap.add_argument("--dir", default=None, help="where the lanes' disk directories and logs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="folder for crash_soak.json (default benchmarks/results)")
    args = ap.parse_args()
    for name in args.lanes.split(","):
        if name not in LANES:
            ap.error(f"--lanes: no lane {name!r} (lanes: {', '.join(LANES)})")
    got = run(args)
    rows = got["rounds"]
    summary = []
    for name in args.lanes.split(","):
        mine = [r for r in rows if r["lane"] == name]
        summary.append({"lane": name, "rounds": len(mine), "acks": sum(r.get("acks", 0) for r in mine),
                        "verified": sum(r.get("verified", 0) for r in mine),
                        "evicted": sum(r.get("evicted", 0) for r in mine),
                        "memory_gone": sum(r.get("memory_gone", 0) for r in mine),
                        "lost": sum(r.get("lost", 0) for r in mine),
                        "deletes_held": sum(r.get("deleted_checked", 0) for r in mine),
                        "flush_missed": sum(r.get("flush_missed_orphans", 0) for r in mine),
                        "violations": len(got["violations"][name])})
    print(table(summary, ["lane", "rounds", "acks", "verified", "evicted", "memory_gone", "lost", "deletes_held",
                          "flush_missed", "violations"], title=f"kill -9 soak, seed {args.seed}, {args.clients} clients, "
                                                f"{got['seconds']} s"))
    for name, found in got["violations"].items():
        for line in found[:20]:
            print(f"VIOLATION [{name}] {line}")
    path = write_json("crash_soak", {**got, "summary": summary}, args.out)
    print(f"wrote {path}")
    sys.exit(1 if any(got["violations"].values()) else 0)


if __name__ == "__main__":
    main()
