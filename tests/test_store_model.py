"""A model-based test of the tiered store: a ``PrefixCache`` over a real CPU tier and a real
disk tier (small budgets, so every few steps evict and demote), driven by hypothesis
through ingests, reads, deletes, pins, flushes and restarts, and checked after every step
against a plain model of what was ingested and the contracts of docs/design.md:

- whatever is served is bit-identical to what was ingested under that key (Raw), or to the
  codec's own encode and decode of it (KIVI);
- ``lookup``, ``locate`` and ``materialize`` agree, and name a prefix: every block up to it
  held, the next one in no tier, each named tier the fastest holding it;
- each tier's ``used_bytes`` is what its blocks count, within its budget; the disk holds
  exactly the files of the blocks it indexes (no temp file or half of one left);
- store-wide figures count each block once; counters never go back while a store is open;
- a pinned block is never evicted from a tier holding it; a deleted one is in no tier;
- a restart serves every block the disk held at the close (write-through: every block
  acknowledged and not evicted since);
- bad input raises ``InputError`` and changes nothing stored;
- no lease is left held after a call returns.

KV is a function of the tokens up to each block's end (as a model's is), so a block's key
names its content and the model knows what every key must serve.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cacheseek as cs
from cacheseek.errors import InputError

LAYOUT = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
BLOCK = 32
CODECS = {"raw": cs.Raw, "int4": lambda: cs.KIVI(bits=4, group_size=32)}
# Counters of a tier that only grow while it is open.
COUNTERS = ("hits", "misses", "evictions", "admissions", "promotions", "demotions", "bytes_in", "bytes_out",
            "corrupt", "foreign_version", "read_errors", "write_errors")
# Blocks of a budget: the CPU tier holds this many frames, the disk this many (in whole
# file-system blocks with their sidecars), so chains of up to MAX_BLOCKS overflow both.
CPU_FRAMES, DISK_FRAMES, MAX_BLOCKS = 3, 6, 5
# A codec's frame of one block and the disk's charge for it, probed once per codec: they
# depend on nothing else an example draws, and a probe is a disk tier (its 256 shard
# directories made and removed): half the disk tiers an example opens at set-up.
FRAME_SIZES: dict[str, tuple[int, int]] = {}


def block_kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The KV of the last block of ``tokens`` (a prefix ending at a block boundary): a
    function of every token before, as a model's is. [H, BLOCK, D] per layer."""
    seed = zlib.crc32(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype),
             torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype)) for _ in range(LAYOUT.num_layers)]


def prompt_kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of a whole prompt: its full blocks' ``block_kv``, then zeros for the tokens past
    the last full block (never stored)."""
    n = len(tokens) // BLOCK
    blocks = [block_kv(tokens[: (i + 1) * BLOCK]) for i in range(n)]
    rest = len(tokens) - n * BLOCK
    tail = torch.zeros((LAYOUT.num_kv_heads, rest, LAYOUT.head_dim), dtype=LAYOUT.torch_dtype)
    return [(torch.cat([b[layer][0] for b in blocks] + [tail], dim=1),
             torch.cat([b[layer][1] for b in blocks] + [tail], dim=1)) for layer in range(LAYOUT.num_layers)]


class StoreMachine(RuleBasedStateMachine):
    """One cache per example, its configuration drawn first (codec, write-through or
    write-back, eviction policy, fsync, disk admission); what it must serve is known from
    ``prompts``."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: cs.PrefixCache | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="cs-model-"))
        self.prompts: list[list[int]] = []  # every prompt ingested (full blocks, plus a partial one at times)
        self.next_token = 1
        self.deleted: set[bytes] = set()  # deleted, not ingested again since: in no tier
        self.pins: dict[bytes, list[bytes]] = {}  # pin key -> the chain it covers
        self.expected: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (KIVI) memo of encode+decode
        self.counters: dict[str, dict[str, int]] = {}
        self.pinned_in: dict[bytes, set[str]] = {}

    # -- set-up ----------------------------------------------------------------------------

    @initialize(codec=st.sampled_from(sorted(CODECS)), write_back=st.booleans(), eviction=st.sampled_from(["arc", "lru"]),
                fsync=st.booleans(), admit=st.sampled_from([1, 2]))
    def open_store(self, codec, write_back, eviction, fsync, admit):
        # (fsync changes no answer here, only what a power cut would leave, and costs half the time)
        self.codec_name, self.write_back, self.eviction, self.fsync = codec, write_back, eviction, fsync
        self.admit = 1
        self.codec = CODECS[codec]()
        if codec not in FRAME_SIZES:
            probe = self._open(cpu="1MiB", disk_bytes="1GiB", path=self.tmp / "probe")
            probe.ingest(list(range(BLOCK)), prompt_kv(list(range(BLOCK))))
            frame = probe.stats()["tiers"][0]["used_bytes"]
            FRAME_SIZES[codec] = frame, probe.store.tier("disk").charge(frame)
            probe.close()
        self.frame, charge = FRAME_SIZES[codec]
        self.cpu_bytes = CPU_FRAMES * self.frame
        self.disk_bytes = DISK_FRAMES * charge
        self.admit = admit  # (the probe above admits every block: its sizes are wanted)
        self.cache = self._open()

    def _open(self, *, cpu=None, disk_bytes=None, path=None) -> cs.PrefixCache:
        tiers = cs.TierConfig(cpu_bytes=cpu or self.cpu_bytes, disk_path=path or self.tmp / "disk",
                              disk_bytes=disk_bytes or self.disk_bytes, pin_memory=False, disk_fsync=self.fsync,
                              eviction=self.eviction, disk_admit_after_uses=self.admit,
                              write_through=() if self.write_back else None)
        return cs.PrefixCache(model_id="m", layout=LAYOUT, codec=self.codec, block_tokens=BLOCK, tiers=tiers)

    def teardown(self):
        if self.cache is not None:
            self.cache.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def store(self):
        return self.cache.store

    def _new_tokens(self, n: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return out

    def _draw_prompt(self, data) -> list[int]:
        return self.prompts[data.draw(st.integers(0, len(self.prompts) - 1), label="prompt")]

    def _keys(self, tokens: list[int]) -> list[bytes]:
        return self.cache.block_hashes(tokens[: len(tokens) // BLOCK * BLOCK])

    def _tiers_holding(self, key: bytes) -> set[str]:
        return {t.name for t in self.store.tiers if t.contains(key)}

    # -- rules -----------------------------------------------------------------------------

    @rule(blocks=st.integers(1, MAX_BLOCKS), partial=st.integers(0, BLOCK - 1))
    def ingest_new(self, blocks, partial):
        self._ingest(self._new_tokens(blocks * BLOCK + partial))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), more=st.integers(0, 3))
    def ingest_extending(self, data, more):
        """A stored prompt's first blocks (all, some, or none of them), then new ones."""
        base = self._draw_prompt(data)
        keep = data.draw(st.integers(0, len(base) // BLOCK))
        self._ingest(base[: keep * BLOCK] + self._new_tokens(more * BLOCK))

    def _ingest(self, tokens: list[int]) -> None:
        keys = self._keys(tokens)
        if not keys:
            return
        present = self.store.present_many(keys)
        res = self.cache.ingest(tokens, prompt_kv(tokens))
        assert (res.blocks, res.tokens) == (len(keys), len(keys) * BLOCK)
        assert res.present == sum(present) and res.stored + res.present + res.failed == res.blocks, res
        # (A disk that admits a block only once used again acknowledges none of them.)
        assert res.durability == ("memory" if self.write_back or self.admit > 1 else "durable")
        if not self.pins:
            # Nothing pinned: every tier has room for any one frame, so no block fails.
            assert res.failed == 0 and not res.errors, res
        self.deleted -= set(keys)
        self.prompts.append(tokens)
        if not self.pins and not any(present):
            # A new chain overflowing a tier loses its tail before its head: what each tier
            # it was put in keeps of it is a prefix (victims are leaves, blocks put tail
            # first), and so is what the store keeps. (A write-back disk gets the victims
            # of the tier above, the tail: design.md's "two cases".)
            put_in = self.store.tiers[:1] if self.write_back or self.admit > 1 else self.store.tiers
            for held in [t.contains_many(keys) for t in put_in] + [self.store.contains_many(keys)]:
                assert held == sorted(held, reverse=True), held
        if not self.pins and len(keys) <= CPU_FRAMES:
            # A chain the top tier can hold whole is served whole: the blocks the call found
            # stored were touched before its new ones made room, so they are not the victims.
            assert self.cache.lookup(tokens) == len(keys) * BLOCK, "the chain's own prefix was evicted"
        if not self.pins and res.durability == "durable" and len(keys) <= DISK_FRAMES:
            # Acknowledged durable: on disk when the call returns.
            disk = self.store.tier("disk")
            assert all(disk.contains_many(keys)), "a block acknowledged durable is not on disk"

    @precondition(lambda self: self.prompts)
    @rule()
    def materialize_latest(self):
        self._materialize(self.prompts[-1], None)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), limit=st.none() | st.integers(0, MAX_BLOCKS * BLOCK + 8))
    def materialize(self, data, limit):
        self._materialize(self._draw_prompt(data), limit)

    def _materialize(self, tokens: list[int], limit: int | None) -> None:
        keys = self._keys(tokens)
        n = self._check_located(tokens, keys)
        if limit is not None:
            n = min(n, limit // BLOCK)
        located = self.cache.locate(tokens).tiers[:n]
        got = self.cache.materialize(tokens, max_tokens=limit)
        assert got.num_tokens == len(got.tiers) * BLOCK
        # All of it: a read's promotions (and their victims on the way down) evict no block of
        # the chain it reads, so every block its lookup found is still there when it is reached.
        assert len(got.tiers) == n, (got.tiers, located)
        n = len(got.tiers)
        for i in range(n):
            want = self._served(keys[i], tokens[: (i + 1) * BLOCK])
            for layer, (k, v) in enumerate(got.layers):
                sl = slice(i * BLOCK, (i + 1) * BLOCK)
                assert torch.equal(k[0][:, sl], want[layer][0]), f"block {i} layer {layer}: K differs"
                assert torch.equal(v[0][:, sl], want[layer][1]), f"block {i} layer {layer}: V differs"

    def _check_located(self, tokens: list[int], keys: list[bytes]) -> int:
        """``lookup``/``locate`` of ``tokens``: a prefix of held blocks, each in the tier named
        (the fastest holding it), the next block in none."""
        loc = self.cache.locate(tokens)
        assert self.cache.lookup(tokens) == loc.num_tokens == loc.num_blocks * BLOCK
        names = self.store.tier_names
        for key, tier in zip(keys, loc.tiers):
            held = [t for t in names if t in self._tiers_holding(key)]
            assert held and held[0] == tier, (tier, held)
        if loc.num_blocks < len(keys):
            assert not self._tiers_holding(keys[loc.num_blocks])
        return loc.num_blocks

    def _served(self, key: bytes, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What a block must decode to: its KV (Raw), or the codec's encode and decode of it."""
        kv = block_kv(tokens)
        if self.codec_name == "raw":
            return kv
        if key not in self.expected:
            self.expected[key] = [self.codec.decode(self.codec.encode(k, v)) for k, v in kv]
        return self.expected[key]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def prefetch(self, data):
        """Promote a prompt's stored prefix into memory in the background, and wait for it."""
        fetch = self.cache.prefetch(self._draw_prompt(data))
        if fetch is not None:
            assert fetch.wait(30), "a prefetch of a few blocks did not end"

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), with_descendants=st.booleans())
    def delete(self, data, with_descendants):
        """One block (a chain then has a gap), or it and every block below it (an admin's chain
        delete), tail first."""
        tokens = self._draw_prompt(data)
        keys = self._keys(tokens)
        key = keys[data.draw(st.integers(0, len(keys) - 1))]
        doomed = [key]
        if with_descendants:
            self.store.settle_moves()
            doomed += self.store.descendants(key)
        held = {k: bool(self._tiers_holding(k)) for k in doomed}
        got = self.store.delete_many(doomed[::-1], all_or_nothing=True)
        assert got == [held[k] for k in doomed[::-1]]
        self.deleted |= set(doomed)
        for k in doomed:
            self.pinned_in.pop(k, None)
        self._forget_pins_of(set(doomed))

    @precondition(lambda self: len(self.prompts) >= 4)
    @rule()
    def flush(self):
        """Every block, as a namespace flush deletes them (settled, highest position first)."""
        store = self.store
        store.settle_moves()
        keys = list(dict.fromkeys(k for t in store.tiers for k in t.keys()))
        keys.sort(key=lambda k: -store.info(k).position)
        assert all(store.delete_many(keys, all_or_nothing=True))
        self.deleted |= set(keys)
        self.pinned_in.clear()
        self._forget_pins_of(set(keys))
        assert all(t.stats().blocks == t.stats().used_bytes == 0 for t in store.tiers)

    def _forget_pins_of(self, gone: set[bytes]) -> None:
        for pin_key in [p for p in self.pins if p in gone]:
            assert self.store.unpin(pin_key) is not None
            del self.pins[pin_key]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def pin(self, data):
        tokens = self._draw_prompt(data)
        keys = self._keys(tokens)
        n = data.draw(st.integers(1, len(keys)))
        chain = keys[:n]
        complete = all(self._tiers_holding(k) for k in chain)
        try:
            pin = self.store.pin(chain[-1])
        except cs.StorageError:
            # A tier that could not keep it beside its pins (it would stay over budget): nothing pinned.
            assert complete
            return
        if not complete:
            assert pin is None
            return
        assert pin is not None
        self.pins[chain[-1]] = chain

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pins)))
        assert self.store.unpin(key) is not None
        del self.pins[key]

    def _not_admitted(self) -> int:
        """Blocks the disk's filter has refused so far (0 without one)."""
        return sum(t.get("admission", {}).get("not_admitted", 0) for t in self.store.stats()["tiers"])

    @precondition(lambda self: self.prompts)
    @rule(drain=st.booleans())
    def restart(self, drain):
        """Close and open again over the same directory: the disk tier serves what it held
        (a write-back store's memory is lost, unless drained to disk first)."""
        if drain:
            refused = self._not_admitted()
            report = self.store.drain()
            assert report.failed == 0 and report.left == 0 or report.stopped == "no room", report
            assert self._not_admitted() - refused == report.not_admitted, report  # each refusal counted, once
            if report.stopped is None and self.admit == 1:  # (else: blocks not admitted are skipped)
                disk = self.store.tier("disk")
                for key in self.store.tier("cpu").keys():
                    info = self.store.info(key)
                    # Written, or a tail whose head the disk does not hold (no lookup reaches it there).
                    assert disk.contains(key) or info.position and not disk.contains(info.parent), key.hex()
        disk = set(self.store.tier("disk").keys())
        self.cache.close()
        self.cache = self._open()
        assert set(self.store.tier("disk").keys()) == disk
        assert not self.store.tier("cpu").keys()
        self.pins.clear()  # (the store keeps none across a restart; a server makes them again)
        self.counters.clear()
        self.pinned_in.clear()

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), kind=st.sampled_from(["nan", "layers", "dtype", "tokens"]))
    def bad_ingest(self, data, kind):
        base = self._draw_prompt(data)
        tokens = base[: len(base) // BLOCK * BLOCK] + self._new_tokens(BLOCK)
        kv = prompt_kv(tokens)
        if kind == "nan":
            kv[-1][1][0, -1, 0] = float("nan")  # in the new block only
        elif kind == "layers":
            kv = kv[:-1]
        elif kind == "dtype":
            kv = [(k.float(), v.float()) for k, v in kv]
        else:
            tokens = tokens[:-1]
        before = self._stored_state()
        with pytest.raises(InputError):
            self.cache.ingest(tokens, kv)
        assert self._stored_state() == before

    def _stored_state(self):
        return [(sorted(t.keys()), t.stats().used_bytes) for t in self.store.tiers]

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def tiers_hold_what_they_count(self):
        if self.cache is None:
            return
        for tier in self.store.tiers:
            st_ = tier.stats()
            keys = tier.keys()
            infos = [tier.info(k) for k in keys]
            assert st_.blocks == len(keys)
            assert st_.used_bytes == sum(i.charge for i in infos), tier.name
            assert st_.raw_bytes == sum(i.raw_nbytes for i in infos)
            assert st_.used_bytes <= tier.capacity_bytes, (tier.name, st_.used_bytes, tier.capacity_bytes)
            covered = {k for chain in self.pins.values() for k in chain}
            assert st_.pinned_blocks == len(covered & set(keys))
            assert st_.corrupt == st_.read_errors == st_.foreign_version == 0
            if tier.name == "cpu":
                leases = tier.lease_stats()
                assert leases["leases_active"] == leases["held_slots"] == 0, leases

    @invariant()
    def disk_holds_exactly_its_blocks_files(self):
        if self.cache is None:
            return
        disk = self.store.tier("disk")
        files = sorted(p.name for shard in disk.root.iterdir() if shard.is_dir() for p in shard.iterdir())
        want = sorted(f"{k.hex()}.{ext}" for k in disk.keys() for ext in ("frame", "meta"))
        assert files == want

    @invariant()
    def store_figures_count_each_block_once(self):
        if self.cache is None:
            return
        stats = self.cache.stats()
        tiers = self.store.tiers
        held = [set(t.keys()) for t in tiers]
        every = set().union(*held)
        assert stats["blocks"] == len(every)
        assert stats["used_bytes"] == sum(self.store.info(k).nbytes for k in every)
        for i, entry in enumerate(stats["tiers"]):
            assert entry["unique_blocks"] == len(held[i] - set().union(set(), *held[:i]))
        assert stats["pins"] == len(self.pins)
        for pool in stats["device_staging"]:
            assert pool["leases_active"] == 0, pool
        assert stats["tiers"][-1]["stream_buffers"]["leases_active"] == 0

    @invariant()
    def counters_never_go_back(self):
        if self.cache is None:
            return
        for entry in self.cache.stats()["tiers"]:
            now = {c: entry[c] for c in COUNTERS}
            before = self.counters.get(entry["name"], {})
            assert all(now[c] >= before.get(c, 0) for c in COUNTERS), (entry["name"], before, now)
            self.counters[entry["name"]] = now

    @invariant()
    def deleted_blocks_are_gone(self):
        if self.cache is None:
            return
        for key in self.deleted:
            assert not self._tiers_holding(key), key.hex()

    @invariant()
    def pinned_blocks_stay_where_they_are(self):
        if self.cache is None:
            return
        covered = {k for chain in self.pins.values() for k in chain}
        now = {k: self._tiers_holding(k) for k in covered}
        for key, tiers in now.items():
            assert self.pinned_in.get(key, set()) <= tiers, (key.hex(), self.pinned_in.get(key), tiers)
        self.pinned_in = now


StoreMachine.TestCase.settings = settings(max_examples=int(os.environ.get("CACHESEEK_MODEL_EXAMPLES", "30")),
                                          stateful_step_count=int(os.environ.get("CACHESEEK_MODEL_STEPS", "40")),
                                          deadline=None, database=None, derandomize=True)
TestStoreModel = StoreMachine.TestCase



def _sizes(tmp_path: Path) -> tuple[int, int]:
    """A Raw frame of LAYOUT's blocks, and what a disk tier under ``tmp_path`` charges for one."""
    probe = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="1MiB", disk_path=tmp_path / "probe", disk_bytes="1GiB",
                                               pin_memory=False))
    probe.ingest(list(range(BLOCK)), prompt_kv(list(range(BLOCK))))
    frame = probe.stats()["used_bytes"]
    charge = probe.store.tier("disk").charge(frame)
    probe.close()
    return frame, charge


@pytest.mark.parametrize("split", ["in place, then put_many", "put_many in batches", "paged, put_many in batches"])
def test_an_ingest_the_disk_can_hold_whole_keeps_every_block_it_acknowledges(tmp_path, split):
    """Found by ``StoreMachine``: an ingest written to the disk in pieces had its later pieces
    evict its earlier ones there (ARC's once-used blocks, the chain's tail, before blocks used
    twice), though the disk had room for the whole chain: every block was acknowledged
    durable, and the tail was on disk no more. The pieces: the tail committed into the CPU
    tier's slots in place (room to reserve for it only) and the rest put (the first shrunk
    example), or the put path's batches (a GPU tier on top; here the disk, with one-block
    batches), of KV as layers or in an engine's pages. Each piece now makes room for the
    rest of the call, in every tier it goes to."""
    frame, charge = _sizes(tmp_path)
    if split.startswith("in place"):
        tiers = cs.TierConfig(cpu_bytes=3 * frame, disk_path=tmp_path / "d", disk_bytes=6 * charge, pin_memory=False)
        batch = "1GiB"
    else:
        tiers = cs.TierConfig(cpu_bytes=0, disk_path=tmp_path / "d", disk_bytes=6 * charge, pin_memory=False)
        batch = LAYOUT.raw_nbytes(BLOCK)
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers,
                           max_batch_bytes=batch)
    used = list(range(1000, 1000 + 2 * BLOCK))
    cache.ingest(used, prompt_kv(used))
    assert cache.materialize(used).num_tokens == 2 * BLOCK  # used twice: ARC keeps these over new blocks
    chain = list(range(2000, 2000 + 5 * BLOCK))
    kv = prompt_kv(chain)
    if split.startswith("paged"):
        from paged_helpers import engine_pages, write_tokens

        pages, _ = engine_pages("nhd", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 16, 16,
                                LAYOUT.torch_dtype)
        ids = list(range(15, 5, -1))  # (10 pages of 16 tokens, out of order)
        write_tokens(pages, kv, ids)
        kv = pages.at(ids)
    res = cache.ingest(chain, kv)
    assert (res.stored, res.failed, res.durability) == (5, 0, "durable")
    assert cache.store.tier("disk").contains_many(cache.block_hashes(chain)) == [True] * 5
    cache.close()
    again = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers)
    assert again.lookup(chain) == 5 * BLOCK
    got = again.materialize(chain)
    for (k, v), (k0, v0) in zip(got.layers, prompt_kv(chain)):
        assert torch.equal(k[0], k0) and torch.equal(v[0], v0)
    again.close()


@pytest.mark.parametrize("piece", ["put_many", "commit_many"])
def test_a_call_stored_in_pieces_makes_room_for_the_rest_in_the_tiers_written_through(tmp_path, piece):
    """The store's side of the fix above, as a server stores a batch (groups put, frames
    received in place committed one by one, each with ``room_for`` the rest of the batch):
    the write-through disk made room for each piece alone, and the last piece evicted the
    first (its once-used tail, ARC's first victim), though the disk had room for all."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.disk import DiskTier, allocation_unit, block_charge
    from cacheseek.store.frame import parse_frame
    from cacheseek.store.tier import BlockFrame
    from cacheseek.store.tiered import TieredStore
    from server_helpers import raw_chain

    def frames(seed: int, n: int) -> list[tuple[bytes, BlockFrame]]:
        return [(h, BlockFrame(parse_frame(buf := bytearray(f)), host=memoryview(buf))) for h, f in raw_chain(seed, n)]

    used, chain = frames(1, 2), frames(2, 5)
    size = chain[0][1].nbytes
    cpu = CpuTier(3 * size, reserve_bytes=size)
    disk = DiskTier(tmp_path / "d", 6 * block_charge(size, allocation_unit(tmp_path)), fsync=False)
    store = TieredStore([cpu, disk], write_through=["disk"])
    store.put_many(used)
    store.touch_chain([k for k, _ in used])  # used again: ARC keeps these over new blocks
    tail, rest = chain[-1], chain[:-1]
    if piece == "put_many":
        first = store.put_many([tail], room_for=4 * size)[0]
    else:
        reservation = store.reserve(size)
        reservation.view()[:] = tail[1].to_bytes()
        first = store.commit_many([(tail[0], reservation, tail[1].meta)], room_for=4 * size)[0]
    assert first.stored
    assert all(r.stored for r in store.put_many(rest[::-1]))
    assert disk.contains_many([k for k, _ in chain]) == [True] * 5
    store.close()
