"""Device-to-host copies left in flight by the CPU tier, and the pipelined GPU ingest.

The CPU tier returns from a put once a device frame's copies are issued. The first tests
drive the tier's bookkeeping with landings we control (on any machine): every read,
eviction, demotion, delete and write-through waits for a frame's copies first, and a
frame whose copies fail is dropped and counted. The CUDA tests run the real thing.
"""

from __future__ import annotations

import pytest
import torch

import cacheseek as cs
from cacheseek import batching, ingest_in_place
from cacheseek.block_format import BlockFormat
from cacheseek.errors import InputError
from cacheseek.store import cpu as cpu_tier
from cacheseek.store.cpu import CpuTier
from cacheseek.store.arena import HostArena, slot_stride
from cacheseek.store.frame import parse_frame
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_cache, make_kv, raw_frame, tokens_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KIVI4 = cs.KIVI(bits=4, group_size=32)


class Landing:
    """Stands in for device.Landing: copies that finish when the test says so."""

    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail, self.finished = log, name, fail, False

    def issue(self) -> None:
        pass

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError("device copy failed")
        self.finished = True


@pytest.fixture
def landings(monkeypatch):
    """Every frame put into a CpuTier gets a Landing; ``fail`` names the keys whose copies fail."""
    log: list[str] = []
    fail: set[bytes] = set()
    made: dict[bytes, Landing] = {}
    real = cpu_tier._start_fill

    def start_fill(frame, slot, view, copies):
        real(frame, slot, view, copies)
        key = frame.meta.block_hash
        made[key] = Landing(log, key.hex()[:2], fail=key in fail)
        return made[key]

    monkeypatch.setattr(cpu_tier, "_start_fill", start_fill)
    return log, fail, made


FRAME_BYTES = raw_frame(1)[1].nbytes


def test_reads_wait_for_the_copies_and_a_failed_copy_is_a_counted_miss(landings):
    log, fail, _ = landings
    fail.add(bytes([2]) * 16)
    tier = CpuTier(4 * FRAME_BYTES)
    for i in (1, 2):
        assert tier.put(*raw_frame(i)).stored is not None
    assert log == []  # nothing waited at put time
    assert tier.contains(bytes([2]) * 16)
    assert tier.get(bytes([1]) * 16) is not None and log == ["01"]
    assert tier.get(bytes([2]) * 16) is None and log == ["01", "02"]
    stats = tier.stats()
    assert (stats.blocks, stats.used_bytes, stats.write_errors, stats.misses) == (1, FRAME_BYTES, 1, 1)
    assert not tier.contains(bytes([2]) * 16)
    tier.get(bytes([1]) * 16)
    assert log == ["01", "02"]  # landed once, never waited again


def test_eviction_and_delete_wait_before_the_slot_is_reused(landings):
    log, _, made = landings
    tier = CpuTier(2 * FRAME_BYTES)
    tier.put(*raw_frame(1))
    tier.put(*raw_frame(2))
    result = tier.put(*raw_frame(3))  # evicts 1: its copies must be done before its slot is reused
    assert [k for k, _ in result.evicted] == [bytes([1]) * 16] and log == ["01"]
    assert tier.delete(bytes([2]) * 16) and log == ["01", "02"]
    made[bytes([3]) * 16].finished = True  # landed on its own: the next put forgets it, no wait
    tier.put(*raw_frame(4))
    assert tier.get(bytes([3]) * 16) is not None and log == ["01", "02"]


def test_an_evicted_frame_whose_copy_failed_is_not_demoted(landings, tmp_path):
    _, fail, _ = landings
    fail.add(bytes([1]) * 16)
    store = cs.TierConfig(cpu_bytes=2 * FRAME_BYTES, disk_path=tmp_path / "d", write_through=()).build()
    for i in (1, 2, 3):
        store.put(*raw_frame(i))
    disk = store.tier("disk")
    assert not disk.contains(bytes([1]) * 16)
    assert store.tier("cpu").stats().write_errors == 1


def test_write_through_and_close_settle_the_copies_first(landings, tmp_path):
    log, _, _ = landings
    store = cs.TierConfig(cpu_bytes=4 * FRAME_BYTES, disk_path=tmp_path / "d").build()
    store.put_many([raw_frame(1), raw_frame(2)])
    assert sorted(log) == ["01", "02"]  # the disk tier read the CPU tier's copies: waited first
    assert store.tier("disk").get(bytes([2]) * 16).to_bytes() == raw_frame(2)[1].to_bytes()
    tier = CpuTier(4 * FRAME_BYTES)
    tier.put(*raw_frame(5))
    tier.close()
    assert log[-1] == "05"


def _commit_in_flight(store_or_tier, i: int, landing: Landing):
    """Reserve a slot, fill it with raw_frame(i)'s bytes and commit it with ``landing``."""
    key, frame = raw_frame(i)
    reservation = store_or_tier.reserve_run(frame.nbytes, 1, grow=True)[0]
    reservation.view()[:] = memoryview(frame.to_bytes())
    return key, store_or_tier.commit_many([(key, reservation, frame.meta)], sealed=False, landing=landing)[0]


def test_a_frame_committed_in_flight_is_read_only_once_it_has_landed():
    log: list[str] = []
    tier = CpuTier(4 * FRAME_BYTES)
    key, result = _commit_in_flight(tier, 1, Landing(log, "01"))
    assert result.stored is not None and log == []  # published without waiting
    assert tier.get(key).to_bytes() == raw_frame(1)[1].to_bytes() and log == ["01"]
    bad, _ = _commit_in_flight(tier, 2, Landing(log, "02", fail=True))
    assert tier.get(bad) is None and log == ["01", "02"]  # its copy failed: dropped, counted
    assert tier.stats().write_errors == 1 and tier.stats().blocks == 1
    for i in (3, 5):
        _commit_in_flight(tier, i, Landing(log, f"0{i}"))
    tier._landing[bytes([3]) * 16].landing.finished = True
    _commit_in_flight(tier, 6, Landing(log, "06"))
    assert sorted(tier._landing) == [bytes([5]) * 16, bytes([6]) * 16]  # landed ones forgotten, unwaited
    tier.close()  # settles what is still in flight
    assert log[-2:] == ["05", "06"] and "03" not in log


def test_a_commit_in_flight_waits_before_the_tiers_written_through(tmp_path):
    log: list[str] = []
    store = cs.TierConfig(cpu_bytes=4 * FRAME_BYTES, disk_path=tmp_path / "d").build()
    key, outcome = _commit_in_flight(store, 4, Landing(log, "04"))
    assert outcome.stored and log == ["04"]  # the disk tier read the bytes: waited first
    assert store.tier("disk").get(key).to_bytes() == raw_frame(4)[1].to_bytes()
    assert store.tier("cpu").get(key) is not None and log == ["04"]  # landed once, not waited again


class Dma(Landing):
    """A Landing whose copy writes ``fill`` over ``view`` when it lands (as a device copy
    into a slot would, whoever holds the slot by then)."""

    def __init__(self, log: list[str], name: str, view: memoryview, fill: int, fail: bool = False) -> None:
        super().__init__(log, name, fail)
        self.view, self.fill = view, fill

    def land(self) -> None:
        if not self.finished and not self.fail:
            self.view[:] = bytes([self.fill]) * len(self.view)
            self.finished = True

    def wait(self) -> None:
        super().wait()
        self.finished = False
        self.land()


def _reserve_in_flight(tier, i: int, log: list[str], fill: int = 0xEE, fail: bool = False):
    """raw_frame(i)'s header in a reserved slot, its payload still to be copied in by a Dma."""
    key, frame = raw_frame(i)
    reservation = tier.reserve_run(frame.nbytes, 1, grow=True)[0]
    view = reservation.view()
    off = frame.meta.payload_offset
    view[:off] = memoryview(frame.to_bytes())[:off]
    return key, frame, reservation, Dma(log, f"0{i}", view[off:], fill, fail)


def test_a_commit_in_flight_of_a_key_stored_meanwhile_frees_its_slot_once_landed():
    """Two ingests of one block: the second's commit finds it stored and gives its slot back,
    but only after its copy has landed, or the copy would overwrite the next frame put there."""
    log: list[str] = []
    tier = CpuTier(8 * FRAME_BYTES)
    tier.put(*raw_frame(1))
    key, frame, reservation, dma = _reserve_in_flight(tier, 1, log)
    result = tier.commit_many([(key, reservation, frame.meta)], sealed=False, landing=dma)[0]
    assert result.stored is None and log == ["01"]  # stored already: waited, then freed
    tier.put(*raw_frame(2))  # into the slot given back
    dma.land()
    assert tier.get(bytes([2]) * 16).to_bytes() == raw_frame(2)[1].to_bytes()
    assert tier.get(key).to_bytes() == raw_frame(1)[1].to_bytes()


def test_a_commit_in_flight_refused_for_pinned_blocks_frees_its_slot_once_landed():
    log: list[str] = []
    tier = CpuTier(2 * FRAME_BYTES, reserve_bytes=2 * FRAME_BYTES)
    key, frame, reservation, dma = _reserve_in_flight(tier, 3, log)
    for i in (1, 2):
        tier.put(*raw_frame(i))
    tier.pin([bytes([1]) * 16, bytes([2]) * 16])
    result = tier.commit_many([(key, reservation, frame.meta)], sealed=False, landing=dma)[0]
    assert result.error is not None and log == ["03"]  # refused: every block pinned
    tier.unpin([bytes([1]) * 16, bytes([2]) * 16])
    tier.put(*raw_frame(4))
    dma.land()
    assert tier.get(bytes([4]) * 16).to_bytes() == raw_frame(4)[1].to_bytes()
    assert tier.stats().extra["reservation_bytes"] == 0


def test_a_device_frame_whose_copy_failed_is_not_written_through(landings, tmp_path):
    """The write-through settles the CPU tier's copies first; a frame whose copy failed is
    neither written to disk from the slot it never filled nor acknowledged."""
    _, fail, _ = landings
    fail.add(bytes([7]) * 16)
    store = cs.TierConfig(cpu_bytes=4 * FRAME_BYTES, disk_path=tmp_path / "d").build()
    out = store.put_many([raw_frame(6), raw_frame(7)])
    assert out[0].stored and not out[1].stored and not out[1].present
    assert "cpu" in out[1].errors and "copy" in out[1].errors["cpu"]
    disk = store.tier("disk")
    assert disk.contains(bytes([6]) * 16) and not disk.contains(bytes([7]) * 16)
    assert store.get(bytes([7]) * 16) is None and store.tier("cpu").stats().write_errors == 1
    store.close()


def test_a_failed_copy_before_the_write_through_gives_the_reservations_back(tmp_path):
    log: list[str] = []
    store = cs.TierConfig(cpu_bytes=4 * FRAME_BYTES, disk_path=tmp_path / "d").build()
    cpu = store.tier("cpu")
    key, frame, reservation, dma = _reserve_in_flight(cpu, 3, log, fail=True)
    outcome = store.commit_many([(key, reservation, frame.meta)], sealed=False, landing=dma)[0]
    assert not outcome.stored and "copy" in outcome.errors["cpu"] and log == ["03"]
    assert cpu.stats().extra["reservation_bytes"] == 0 and cpu.stats().write_errors == 1
    assert store.get(key) is None and not store.tier("disk").contains(key)
    store.close()


def test_the_put_path_pipelines_three_batches_of_at_least_128_mib():
    mb = 1 << 20
    assert batching.pipelined_batch_blocks(16, 32, 32 * mb) == 6  # 16 Llama-3-8B blocks: 3 batches
    assert batching.pipelined_batch_blocks(16, 3, 32 * mb) == 3  # never above the configured batch
    assert batching.pipelined_batch_blocks(3, 32, 32 * mb) == 4  # not below 128 MiB of raw KV a batch
    assert batching.pipelined_batch_blocks(40, 32, mb) == 32  # small blocks: the batch size decides
    assert batching.pipelined_batch_blocks(1, 32, 1 << 30) == 1


def test_the_in_place_ingest_starts_at_128_mib_and_doubles():
    mb = 1 << 20
    assert batching.first_batch_blocks(32 * mb) == 4
    assert batching.first_batch_blocks(1 << 30) == 1
    # 16 new blocks, tail first: 4, then the 12 left (doubling to 8 would leave a runt of 4).
    assert batching.growing([(0, 16)], 4) == [(12, 16), (0, 12)]
    assert batching.growing([(0, 64)], 4) == [(60, 64), (52, 60), (36, 52), (0, 36)]
    assert batching.growing([(10, 12), (0, 4)], 4) == [(10, 12), (0, 4)]  # only the tail's batch is cut
    assert batching.copy_pieces(12) == [(4, 12), (0, 4)] and batching.copy_pieces(7) == [(0, 7)]
    assert list(batching.runs([True, True, False, True, True, True], 2)) == [(0, 2), (3, 5), (5, 6)]


def test_the_guessed_tail_grows_with_the_chain():
    mb = 1 << 20
    # Llama-3-8B blocks of 256 tokens (32 MiB raw): the first batch's 4 blocks, until an
    # eighth of the chain is more (the host hashes and plans the chain while they are copied).
    assert [batching.guessed_tail_blocks(n, 32 * mb) for n in (8, 16, 32, 40, 64, 256)] == [4, 4, 4, 5, 8, 32]
    assert batching.guessed_tail_blocks(64, 1 << 30) == 8


# -- ingest in place: runs of reserved slots, one copy each, committed after the check ----
# (On the CPU the KV is encoded straight into the slots; on a GPU into staging laid out
# like them, then one device-to-host copy. The bookkeeping is the same: tested here.)

RAW_FRAME = cs.Raw().encoded_nbytes(LAYOUT, BLOCK) + 1024  # a Raw frame with its header, rounded up


class _Spy:
    """Records the calls to ``owner.name`` (and still makes them)."""

    def __init__(self, monkeypatch, owner, name: str) -> None:
        self.calls: list[tuple] = []  # (args, what the call returned)
        real = getattr(owner, name)

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            self.calls.append((args, out))
            return out

        monkeypatch.setattr(owner, name, spy)


def _tier_state(cache: cs.PrefixCache) -> dict:
    tier = cache.stats()["tiers"][0]
    return {k: tier[k] for k in ("blocks", "used_bytes", "evictions", "bytes_in", "reservation_bytes")}


def test_a_run_of_slots_is_laid_end_to_end_and_each_slot_is_freed_alone():
    arena = HostArena(1 << 20)
    run = arena.allocate_run(1000, 5)
    stride = slot_stride(1000)
    assert [s.offset - run[0].offset for s in run] == [i * stride for i in range(5)]
    assert arena.allocate_run(1000, (1 << 20) // stride) is None  # no contiguous room for that many
    for slot in run[1::2]:
        arena.free(slot)  # holes between the slots still lent
    assert arena.allocate_run(1000, 2) is not None  # from the end of the chunk, not the holes
    for slot in run[0::2]:
        arena.free(slot)
    again = arena.allocate_run(1000, 5)
    assert again[0].offset == run[0].offset  # the freed slots merged back into one extent


def test_an_ingest_goes_in_place_one_run_per_batch_and_never_through_put(monkeypatch):
    cache = make_cache(cpu="4MiB")
    runs = _Spy(monkeypatch, cache.store, "reserve_run")
    puts = _Spy(monkeypatch, cache.store.tiers[0], "put_many")
    toks, kv = tokens_for(40, 8 * BLOCK), make_kv(8 * BLOCK, 40)
    assert cache.ingest(toks, kv).stored == 8
    assert [args[1] for args, _ in runs.calls] == [8] and not puts.calls
    assert _tier_state(cache)["reservation_bytes"] == 0
    assert_prefix_equal(cache.materialize(toks), kv, 8 * BLOCK)
    for key in cache.block_hashes(toks):  # every slot holds a whole frame that parses and checks
        frame = cache.store.tiers[0].get(key)
        assert parse_frame(frame.to_bytes()).block_hash == key


def test_nan_stores_nothing_and_evicts_nothing_even_in_a_full_tier(monkeypatch):
    # A full tier with a reserve takes the new blocks into the reserve and evicts only once
    # they have passed the NaN/Inf check, so a bad input changes nothing stored.
    cache = make_cache(cpu=6 * RAW_FRAME, cpu_reserve_bytes=3 * RAW_FRAME)
    filler = tokens_for(41, 6 * BLOCK)
    assert cache.ingest(filler, make_kv(6 * BLOCK, 41)).stored == 6
    before = _tier_state(cache)
    toks, kv = tokens_for(42, 3 * BLOCK), make_kv(3 * BLOCK, 42)
    kv[2][0][1, BLOCK + 3, 7] = float("nan")
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert _tier_state(cache) == before and cache.lookup(filler) == 6 * BLOCK
    kv[2][0][1, BLOCK + 3, 7] = 0.5
    assert cache.ingest(toks, kv).stored == 3
    assert _tier_state(cache)["evictions"] == 3  # at commit, once the blocks were known good
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)


def _full_kivi_cache(reserve_frames: int, layout: cs.KVLayout = LAYOUT) -> tuple[cs.PrefixCache, list[list[int]]]:
    """A KIVI cache whose tier three other 6-block prompts fill (every new block evicts), two
    blocks per in-place run, lending new blocks ``reserve_frames`` frames of reserve."""
    # (KIVI: Raw on the host checks whole layers at once, so every run would fail.)
    frame = cs.PrefixCache(model_id="m", layout=layout, codec=KIVI4, block_tokens=BLOCK).block_format \
        .planned_payload().nbytes
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=KIVI4, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=18 * frame, cpu_reserve_bytes=reserve_frames * frame),
                           max_batch_bytes=2 * layout.raw_nbytes(BLOCK))
    others = [tokens_for(seed, 6 * BLOCK) for seed in (60, 61, 62)]
    for seed, toks in zip((60, 61, 62), others):
        cache.ingest(toks, make_kv(6 * BLOCK, seed, layout))
    return cache, others


def test_nan_in_a_later_run_commits_nothing_and_evicts_nothing(monkeypatch):
    """Every run launched is checked before the first commit, so the runs before the bad one
    evict nothing for blocks that would only be deleted again."""
    cache, others = _full_kivi_cache(reserve_frames=6)  # the whole call fits the reserve
    before = ([cache.lookup(t) for t in others], _tier_state(cache))
    commits = _Spy(monkeypatch, cache.store, "commit_many")
    toks, kv = tokens_for(43, 6 * BLOCK), make_kv(6 * BLOCK, 43)
    kv[0][1][0, 3, 3] = float("inf")  # block 0: the chain's head, the last run launched
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert commits.calls == [] and cache.lookup(toks) == 0
    assert ([cache.lookup(t) for t in others], _tier_state(cache)) == before


def _count_rest_checks(monkeypatch) -> list:
    """One entry per ``InPlaceIngest._check_rest`` call (made before it runs: it may raise)."""
    calls, real = [], ingest_in_place.InPlaceIngest._check_rest
    monkeypatch.setattr(ingest_in_place.InPlaceIngest, "_check_rest", lambda self: calls.append(1) or real(self))
    return calls


ON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", ON_DEVICES)
def test_nan_in_a_block_not_launched_before_a_commit_for_room_evicts_nothing(device, monkeypatch):
    """A call larger than the reserve commits its first run to make room before its last is
    encoded (that commit evicts for the whole call): the blocks not launched yet are checked
    for NaN and Inf before it, so a bad value there commits nothing and evicts nothing."""
    cache, others = _full_kivi_cache(reserve_frames=2)
    before = ([cache.lookup(t) for t in others], _tier_state(cache))
    commits = _Spy(monkeypatch, cache.store, "commit_many")
    checks = _count_rest_checks(monkeypatch)
    toks, kv = tokens_for(43, 6 * BLOCK), make_kv(6 * BLOCK, 43, device=device)
    kv[0][1][0, 3, 3] = float("inf")  # block 0: the chain's head, the last run launched
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert checks == [1] and commits.calls == [] and cache.lookup(toks) == 0
    assert ([cache.lookup(t) for t in others], _tier_state(cache)) == before
    kv[0][1][0, 3, 3] = 0.5
    assert cache.ingest(toks, kv).stored == 6 and len(commits.calls) > 1  # good: committed in pieces


BF16 = cs.KVLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim,
                   dtype="bfloat16")


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_range_beyond_fp16_stats_in_a_block_not_launched_evicts_nothing(device, monkeypatch):
    """bf16 KV past 65504 is finite, yet KIVI's fp16 stats cannot hold a group's min below
    -65504: the check before a commit for room refuses it as the encode would (nothing
    committed, nothing evicted), and accepts a value past 65504 the encode accepts."""
    cache, others = _full_kivi_cache(reserve_frames=2, layout=BF16)
    before = ([cache.lookup(t) for t in others], _tier_state(cache))
    commits = _Spy(monkeypatch, cache.store, "commit_many")
    checks = _count_rest_checks(monkeypatch)
    toks, kv = tokens_for(46, 6 * BLOCK), make_kv(6 * BLOCK, 46, BF16, device=device)
    kv[1][0][1, 5, 7] = -1e6  # K of block 0 (the last run launched): the group's min, beyond fp16
    with pytest.raises(InputError, match=r"^k: a group whose min or range/levels is beyond float16 stats \(finite "
                                         r"values past 65504: use stats_dtype='float32'\)"):
        cache.ingest(toks, kv)
    assert checks == [1] and commits.calls == [] and cache.lookup(toks) == 0
    assert ([cache.lookup(t) for t in others], _tier_state(cache)) == before
    # Past 65504 and yet encodable: the group's min stays small and its range / 15 fits.
    kv[1][0][1, 5, 7] = 1e5
    assert cache.ingest(toks, kv).stored == 6 and len(commits.calls) > 1 and checks == [1, 1]


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_range_beyond_fp16_stats_in_pages_not_launched_names_the_request(device, monkeypatch):
    from paged_helpers import engine_tensors, kv_pages, write_tokens

    cache, others = _full_kivi_cache(reserve_frames=2, layout=BF16)
    T, page = 6 * BLOCK, 16
    toks, kv = tokens_for(47, T), make_kv(T, 47, BF16)
    pages = kv_pages("flash", engine_tensors("flash", BF16.num_layers, BF16.num_kv_heads, BF16.head_dim, 20, page,
                                             BF16.torch_dtype, device=device))
    ids = list(range(19, 19 - T // page, -1))
    write_tokens(pages, kv, ids)
    before = ([cache.lookup(t) for t in others], _tier_state(cache))
    commits = _Spy(monkeypatch, cache.store, "commit_many")
    pages.v[2][ids[1], 3, 1, 9] = -1e6  # block 0's token 19, head 1: a V group's min
    with pytest.raises(InputError, match=r"requests\[0\]: v: a group whose min or range/levels is beyond float16 "
                                         r"stats \(finite values past 65504"):
        cache.ingest_batch([cs.PagedRequest(toks, ids)], pages)
    assert commits.calls == [] and cache.lookup(toks) == 0
    assert ([cache.lookup(t) for t in others], _tier_state(cache)) == before
    pages.v[2][ids[1], 3, 1, 9] = 1e5  # the group's range / 15 fits, its min is the others'
    assert cache.ingest_batch([cs.PagedRequest(toks, ids)], pages)[0].stored == 6


def test_the_check_before_a_commit_for_room_looks_only_at_blocks_to_store(monkeypatch):
    """Exactly the blocks the call stores: a NaN in a stored block's KV, or in the partial
    tail (never stored), rejects nothing, as without the check."""
    cache, _ = _full_kivi_cache(reserve_frames=2)
    checks = _Spy(monkeypatch, ingest_in_place.InPlaceIngest, "_check_rest")
    toks, kv = tokens_for(44, 6 * BLOCK + 5), make_kv(6 * BLOCK + 5, 44)
    assert cache.ingest(toks[:BLOCK], [(k[:, :BLOCK], v[:, :BLOCK]) for k, v in kv]).stored == 1
    kv[1][0][1, 2, 3] = float("nan")  # block 0, stored already
    kv[2][1][0, 6 * BLOCK + 2, 0] = float("inf")  # the partial tail
    got = cache.ingest(toks, kv)
    assert (got.stored, got.present) == (5, 1) and len(checks.calls) == 1  # (the check ran)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_nan_in_pages_not_launched_before_a_commit_for_room_names_the_request_and_evicts_nothing(device, monkeypatch):
    """The same for KV in an engine's pages (``ingest_batch``): the blocks are gathered out
    of the pages to be checked, exactly their tokens (garbage in the unused slots of the
    last page is not the request's), and the error names the request."""
    from paged_helpers import engine_tensors, kv_pages, write_tokens

    cache, others = _full_kivi_cache(reserve_frames=2)
    T, page = 6 * BLOCK + 5, 16
    toks, kv = tokens_for(45, T), make_kv(T, 45)
    pages = kv_pages("flash", engine_tensors("flash", LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, 20, page,
                                             LAYOUT.torch_dtype, device=device))
    ids = list(range(19, 19 - -(-T // page), -1))  # scattered the other way round
    write_tokens(pages, kv, ids)
    pages.k[0][ids[-1], T % page + 1] = float("nan")  # past the request's last token: not its KV
    before = ([cache.lookup(t) for t in others], _tier_state(cache))
    commits = _Spy(monkeypatch, cache.store, "commit_many")
    checks = _count_rest_checks(monkeypatch)
    pages.v[2][ids[1], 3] = float("inf")  # block 0's token 19 (pages of 16): launched last
    with pytest.raises(InputError, match=r"requests\[0\].*NaN or Inf"):
        cache.ingest_batch([cs.PagedRequest(toks, ids)], pages)
    assert checks == [1] and commits.calls == [] and cache.lookup(toks) == 0
    assert ([cache.lookup(t) for t in others], _tier_state(cache)) == before
    pages.v[2][ids[1], 3] = 0.5
    assert cache.ingest_batch([cs.PagedRequest(toks, ids)], pages)[0].stored == 6


def test_without_room_to_reserve_the_blocks_go_through_put(monkeypatch):
    cache = make_cache(cpu=4 * RAW_FRAME, cpu_reserve_bytes=0)
    assert cache.ingest(tokens_for(44, 4 * BLOCK), make_kv(4 * BLOCK, 44)).stored == 4  # full now
    puts = _Spy(monkeypatch, cache.store.tiers[0], "put_many")
    toks, kv = tokens_for(45, 3 * BLOCK), make_kv(3 * BLOCK, 45)
    assert cache.ingest(toks, kv).stored == 3
    assert puts.calls and _tier_state(cache)["evictions"] == 3
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)


def test_a_fragmented_tier_gets_shorter_runs(monkeypatch):
    cache = make_cache(cpu=12 * RAW_FRAME)
    cache.store.tiers[0]._arena.chunk_bytes = 4 * slot_stride(RAW_FRAME)  # no run of more than 4 slots
    runs = _Spy(monkeypatch, cache.store, "reserve_run")
    toks, kv = tokens_for(46, 10 * BLOCK), make_kv(10 * BLOCK, 46)
    assert cache.ingest(toks, kv).stored == 10
    lent = [len(got) for _, got in runs.calls if got is not None]
    assert runs.calls[0][0][1] == 10 and sum(lent) == 10 and max(lent) <= 4
    assert_prefix_equal(cache.materialize(toks), kv, 10 * BLOCK)


@pytest.mark.parametrize("how", ["in-place", "put", "paged", "layerwise"])
def test_a_chain_longer_than_the_tier_keeps_its_stored_head(how, monkeypatch):
    """A tier of 3 blocks holds a chain's head; the chain comes again 4 blocks long. Its new
    blocks evict as they go, tail first, and the stored head (touched before them, yet older
    than each) went first: the tier was left holding blocks 1-3, a tail no lookup reaches,
    and a prompt sharing blocks 0 and 1 found nothing. The found blocks are spared now, so
    the chain's own tail goes: blocks 0-2 stay. In place, through put_many, from pages and
    from a layer-wise save alike."""
    from cacheseek import layerwise_save
    from paged_helpers import engine_pages, write_tokens

    if how == "put":
        monkeypatch.setattr(ingest_in_place, "applies", lambda *args: False)
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)  # (slots, not one ingest at finish)
    cache = make_cache(cpu=3 * RAW_FRAME, cpu_reserve_bytes=3 * RAW_FRAME, eviction="lru")  # (room to reserve)
    toks, kv = tokens_for(70, 4 * BLOCK), make_kv(4 * BLOCK, 70)
    assert cache.ingest(toks[:BLOCK], [(k[:, :BLOCK], v[:, :BLOCK]) for k, v in kv]).stored == 1
    for seed in (71, 72):  # others, older than the head's touch
        cache.ingest(tokens_for(seed, BLOCK), make_kv(BLOCK, seed))
    if how == "paged":
        L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
        pages, _ = engine_pages("flash", L, H, D, 4 * BLOCK // 16, 16, LAYOUT.torch_dtype)
        write_tokens(pages, kv, list(range(4 * BLOCK // 16)))
        [got] = cache.ingest_batch([cs.PagedRequest(toks, list(range(4 * BLOCK // 16)))], pages)
    elif how == "layerwise":
        with cache.ingest_layerwise(toks) as writer:
            for i, (k, v) in enumerate(kv):
                writer.put_layer(i, k, v)
            got = writer.finish()
        assert writer.mode == "slots"
    else:
        got = cache.ingest(toks, kv)
    assert (got.present, got.stored) == (1, 3)
    assert cache.lookup(toks) == 3 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, 3 * BLOCK)
    assert cache.lookup(toks[: 2 * BLOCK] + tokens_for(73, BLOCK)) == 2 * BLOCK


@pytest.mark.parametrize("disk", [True, False], ids=["disk-below", "cpu-only"])
def test_a_tier_full_of_a_chains_own_prefix_spares_it_only_where_nothing_below_keeps_it(tmp_path, disk):
    """A chain's stored prefix fills the CPU tier and the chain comes again one block longer.
    Alone, the tier spares the prefix: the new block fails, and the error says why. With a
    disk below (written through), the head the tier evicts is on disk already: the block is
    stored, and the whole chain is served across the two tiers."""
    cache = make_cache(cpu=3 * RAW_FRAME, cpu_reserve_bytes=3 * RAW_FRAME, disk=tmp_path / "d" if disk else None)
    toks, kv = tokens_for(74, 4 * BLOCK), make_kv(4 * BLOCK, 74)
    assert cache.ingest(toks[: 3 * BLOCK], [(k[:, : 3 * BLOCK], v[:, : 3 * BLOCK]) for k, v in kv]).stored == 3
    got = cache.ingest(toks, kv)
    if disk:
        assert (got.present, got.stored, got.failed, got.errors) == (3, 1, 0, {})
        assert cache.lookup(toks) == 4 * BLOCK and "disk" in cache.locate(toks).tiers  # (what the CPU tier gave up)
    else:
        assert (got.present, got.stored, got.failed) == (3, 0, 1)
        assert "without evicting blocks this write spares" in got.errors["cpu"]
        assert cache.lookup(toks) == 3 * BLOCK
    assert_prefix_equal(cache.materialize(toks), kv, cache.lookup(toks))


def test_a_partial_run_is_the_largest_free_extent():
    arena = HostArena(1 << 20)
    stride = slot_stride(1000)
    run = arena.allocate_run(1000, (1 << 20) // stride)  # the whole chunk
    for slot in run[3:5] + run[10:17]:
        arena.free(slot)  # holes of 2 and 7 slots
    assert arena.allocate_run(1000, 9, grow=False) is None
    got = arena.allocate_run(1000, 9, grow=False, partial=True)
    assert [s.offset for s in got] == [run[10].offset + i * stride for i in range(7)]
    assert len(arena.allocate_run(1000, 9, partial=True)) == 2  # then the other hole
    assert arena.allocate_run(1000, 9, partial=True) is None  # nothing left at all


def test_a_partial_reservation_stops_at_the_budget_and_the_reserve():
    tier = CpuTier(8 * RAW_FRAME, reserve_bytes=2 * RAW_FRAME)
    assert tier.reserve_run(RAW_FRAME, 12) is None  # the whole run: past the budget and the reserve
    got = tier.reserve_run(RAW_FRAME, 12, grow=True, partial=True)
    assert len(got) == 10
    assert tier.reserve_run(RAW_FRAME, 1, grow=True, partial=True) is None
    for reservation in got:
        tier.abort(reservation)
    # Without ``grow`` a reservation may take only the arena's room past the budget.
    assert len(tier.reserve_run(RAW_FRAME, 12, partial=True)) <= 2 + (tier._arena.limit_bytes - 10 * RAW_FRAME) // RAW_FRAME


def test_a_full_tier_lends_what_its_fragmented_reserve_holds_and_no_call_waits(monkeypatch):
    # The steady state of a tier that holds two calls, with a reserve of one call (fresh prompts,
    # every call evicts the oldest): the reserve's room lies in pieces where evicted calls were.
    # Each call takes its slots in those pieces rather than waiting for a commit to free a
    # whole run (on a GPU, a commit waits for a copy to land: the pipeline stalls).
    layout, blocks = cs.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16"), 16
    frame = cs.Raw().encoded_nbytes(layout, BLOCK) + 4096  # a header's worth over: 3 frames of slack in the chunk
    cache = make_cache(cpu=2 * blocks * frame, cpu_reserve_bytes=blocks * frame, eviction="lru", layout=layout)
    runs = _Spy(monkeypatch, cache.store, "reserve_run")
    fragmented = 0
    for call in range(8):
        toks, kv = tokens_for(60 + call, blocks * BLOCK), make_kv(blocks * BLOCK, 60 + call, layout)
        runs.calls.clear()
        assert cache.ingest(toks, kv).stored == blocks
        assert all(got is not None for _, got in runs.calls), call
        assert sum(len(got) for _, got in runs.calls) == blocks
        fragmented += len(runs.calls) > 1
    assert fragmented >= 4  # (the case this test is about: runs in pieces)
    tier = cache.stats()["tiers"][0]
    assert tier["evictions"] >= 5 * blocks and tier["blocks"] + tier["evictions"] == 8 * blocks
    assert tier["reservation_bytes"] == 0
    assert_prefix_equal(cache.materialize(toks), kv, blocks * BLOCK)


@pytest.fixture
def guessing(monkeypatch):
    """Ingests launch the chain's tail before hashing on the CPU too (on a GPU they do
    anyway), with a first batch of two blocks."""
    monkeypatch.setattr(ingest_in_place, "GUESS_ON", ("cuda", "cpu"))
    monkeypatch.setattr(batching, "MIN_BATCH_BYTES", 2 * LAYOUT.raw_nbytes(BLOCK))


def test_a_guessed_tail_found_stored_is_given_back(guessing):
    cache = make_cache(cpu="4MiB", codec=KIVI4)
    toks, kv = tokens_for(48, 6 * BLOCK), make_kv(6 * BLOCK, 48)
    assert cache.ingest(toks, kv).stored == 6
    before = _tier_state(cache)
    again = cache.ingest(toks, kv)  # all stored: the two blocks launched early are dropped
    assert (again.stored, again.present) == (0, 6) and _tier_state(cache) == before
    longer, kv2 = toks + tokens_for(49, 4 * BLOCK), make_kv(10 * BLOCK, 48)
    got = cache.ingest(longer, kv2)  # the usual case: a stored prefix, a new tail
    assert (got.stored, got.present) == (4, 6) and _tier_state(cache)["reservation_bytes"] == 0
    plain = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=KIVI4, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="4MiB"))  # the same blocks, not guessed
    plain.ingest(longer, kv2)
    tail = slice(6 * BLOCK, 10 * BLOCK)  # (the prefix came from kv, not kv2)
    for (k, v), (k0, v0) in zip(cache.materialize(longer).layers, plain.materialize(longer).layers):
        assert torch.equal(k[:, :, tail], k0[:, :, tail]) and torch.equal(v[:, :, tail], v0[:, :, tail])


def test_a_guessed_tail_with_nan_stores_nothing(guessing):
    cache = make_cache(cpu="4MiB", codec=KIVI4)
    toks, kv = tokens_for(50, 6 * BLOCK), make_kv(6 * BLOCK, 50)
    kv[1][0][0, 5 * BLOCK + 2, 1] = float("nan")
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    state = _tier_state(cache)
    assert cache.lookup(toks) == 0 and state["used_bytes"] == 0 and state["reservation_bytes"] == 0


def test_a_long_chain_guesses_an_eighth_of_it_and_stores_it_once(guessing):
    cache = make_cache(cpu="8MiB", codec=KIVI4)
    toks, kv = tokens_for(52, 24 * BLOCK), make_kv(24 * BLOCK, 52)
    assert batching.guessed_tail_blocks(24, LAYOUT.raw_nbytes(BLOCK)) == 3  # 2-block first batches here
    assert cache.ingest(toks, kv).stored == 24
    plain = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=KIVI4, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="8MiB"))
    plain.ingest(toks, kv)
    for (k, v), (k0, v0) in zip(cache.materialize(toks).layers, plain.materialize(toks).layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert _tier_state(cache)["reservation_bytes"] == 0
    again = cache.ingest(toks, kv)  # all stored: the 3 guessed blocks are given back
    assert (again.stored, again.present) == (0, 24) and _tier_state(cache)["reservation_bytes"] == 0


def test_a_fragmented_tier_lends_the_guess_a_shorter_tail(guessing, monkeypatch):
    cache = make_cache(cpu=30 * RAW_FRAME)
    cache.store.tiers[0]._arena.chunk_bytes = 2 * slot_stride(RAW_FRAME)  # no run of more than 2 slots
    runs = _Spy(monkeypatch, cache.store, "reserve_run")
    toks, kv = tokens_for(53, 24 * BLOCK), make_kv(24 * BLOCK, 53)
    assert cache.ingest(toks, kv).stored == 24
    (args, guessed), *rest = runs.calls
    assert args[1] == batching.guessed_tail_blocks(24, LAYOUT.raw_nbytes(BLOCK)) == 3
    assert len(guessed) == 2  # blocks 22 and 23, launched before the keys were known
    assert sum(len(got) for _, got in rest) == 22
    assert_prefix_equal(cache.materialize(toks), kv, 24 * BLOCK)
    assert _tier_state(cache)["reservation_bytes"] == 0


def test_bad_tokens_after_a_guessed_launch_leave_nothing_reserved(guessing):
    cache = make_cache(cpu="4MiB")
    toks, kv = tokens_for(51, 6 * BLOCK), make_kv(6 * BLOCK, 51)
    toks[3] = 2**40  # outside int32: found while hashing, after the tail was launched
    with pytest.raises(InputError, match="int32"):
        cache.ingest(toks, kv)
    assert _tier_state(cache) == {"blocks": 0, "used_bytes": 0, "evictions": 0, "bytes_in": 0, "reservation_bytes": 0}


def test_frames_written_in_place_are_sealed_on_their_way_to_disk(tmp_path):
    cache = make_cache(cpu="4MiB", disk=tmp_path / "d", codec=KIVI4)
    toks, kv = tokens_for(47, 5 * BLOCK), make_kv(5 * BLOCK, 47)
    assert cache.ingest(toks, kv).stored == 5
    want = cache.materialize(toks)
    cache.close()
    reopened = make_cache(cpu=0, disk=tmp_path / "d", codec=KIVI4)
    assert reopened.store.tier("disk").check() == {"ok": 5, "corrupt": 0, "unreadable": 0, "other_version": 0}
    got = reopened.materialize(toks)
    for (k, v), (k0, v0) in zip(got.layers, want.layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)


# -- the real thing, on a GPU ------------------------------------------------------------

def _small_batches(monkeypatch) -> None:
    monkeypatch.setattr(batching, "MIN_BATCH_BYTES", 0)  # a first batch of one block


def _gpu_cache(codec, cpu="16MiB", **kw) -> cs.PrefixCache:
    return cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes=cpu, **kw))


def _expected(codec, kv, tokens):
    """What the codec gives back for the first ``tokens`` of ``kv``, encoded and decoded on the GPU."""
    out = []
    for k, v in kv:
        enc = codec.encode(k[:, :tokens].clone(), v[:, :tokens].clone())
        out.append(tuple(t.clone() for t in codec.decode(enc, torch.device("cuda"))))
    return out


def _assert_layers_equal(got: cs.Materialized, want) -> None:
    for (k, v), (k0, v0) in zip(got.layers, want):
        assert torch.equal(k[0], k0) and torch.equal(v[0], v0)


@cuda
@pytest.mark.parametrize("codec", [cs.Raw(), KIVI4])
def test_kv_overwritten_right_after_ingest_is_stored_as_it_was(codec, monkeypatch):
    _small_batches(monkeypatch)  # several batches even for small blocks
    toks, kv = tokens_for(30, 12 * BLOCK), make_kv(12 * BLOCK, 30, device="cuda")
    want = _expected(codec, kv, 12 * BLOCK)
    cache = _gpu_cache(codec)
    assert cache.ingest(toks, kv).stored == 12
    for k, v in kv:  # the worker reuses its KV memory at once, on its own stream
        k.fill_(7.0)
        v.mul_(-3.0)
    _assert_layers_equal(cache.materialize(toks, device="cuda"), want)


@cuda
def test_freed_encoder_buffers_are_not_reused_while_copies_read_them(monkeypatch):
    _small_batches(monkeypatch)
    toks, kv = tokens_for(31, 16 * BLOCK), make_kv(16 * BLOCK, 31, device="cuda")
    want = _expected(KIVI4, kv, 16 * BLOCK)
    cache = _gpu_cache(KIVI4)
    side = torch.cuda.Stream()
    for _ in range(3):
        cache.ingest(toks, kv)
        with torch.cuda.stream(side):  # churn the allocator on the encoder's kind of stream
            junk = [torch.full((1 << 20,), 255, dtype=torch.uint8, device="cuda") for _ in range(64)]
        del junk
        _assert_layers_equal(cache.materialize(toks, device="cuda"), want)
        for key in cache.block_hashes(toks):
            cache.store.delete(key)


@cuda
def test_frames_evicted_in_flight_reach_the_disk_tier_intact(tmp_path, monkeypatch):
    _small_batches(monkeypatch)
    toks, kv = tokens_for(32, 10 * BLOCK), make_kv(10 * BLOCK, 32, device="cuda")
    frame_bytes = cs.Raw().encoded_nbytes(LAYOUT, BLOCK) + 1024
    cache = _gpu_cache(cs.Raw(), cpu=3 * frame_bytes, disk_path=tmp_path / "d", write_through=())
    assert cache.ingest(toks, kv).stored == 10
    assert cache.locate(toks).tiers.count("disk") == 7
    assert_prefix_equal(cache.materialize(toks, device="cuda"), kv, 10 * BLOCK)
    cache.close()
    with _gpu_cache(cs.Raw(), cpu=3 * frame_bytes, disk_path=tmp_path / "wt") as written:  # write-through
        assert written.ingest(toks, kv).stored == 10
    # The directory is free once its writer is closed (a second open cache would be DiskInUse).
    with _gpu_cache(cs.Raw(), cpu=0, disk_path=tmp_path / "wt") as reopened:
        assert_prefix_equal(reopened.materialize(toks), kv, 10 * BLOCK)


@cuda
def test_nan_in_a_later_gpu_batch_undoes_the_batches_in_flight(monkeypatch):
    _small_batches(monkeypatch)
    toks, kv = tokens_for(33, 8 * BLOCK), make_kv(8 * BLOCK, 33, device="cuda")
    kv[1][1][0, 2, 3] = float("nan")  # block 0: batches go tail first, so it fails last
    cache = _gpu_cache(KIVI4)
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert cache.lookup(toks) == 0 and cache.stats()["used_bytes"] == 0


@cuda
@pytest.mark.parametrize("codec", [cs.Raw(), KIVI4])
def test_a_full_tier_without_a_reserve_takes_gpu_frames_through_put(codec, monkeypatch):
    # No reserve to encode into: the blocks go through put_many (copies in flight per
    # frame, evictions before the copies), and still come back exact.
    _small_batches(monkeypatch)
    frame_bytes = codec.encoded_nbytes(LAYOUT, BLOCK) + 1024
    toks, kv = tokens_for(34, 6 * BLOCK), make_kv(6 * BLOCK, 34, device="cuda")
    cache = _gpu_cache(codec, cpu=6 * frame_bytes, cpu_reserve_bytes=0)
    filler = tokens_for(35, 6 * BLOCK)
    assert cache.ingest(filler, make_kv(6 * BLOCK, 35, device="cuda")).stored == 6
    reserve_runs = []
    real = cache.store.reserve_run
    cache.store.reserve_run = lambda *a, **kw: reserve_runs.append(a) or real(*a, **kw)
    assert cache.ingest(toks, kv).stored == 6
    assert reserve_runs and cache.stats()["tiers"][0]["evictions"] == 6
    _assert_layers_equal(cache.materialize(toks, device="cuda"), _expected(codec, kv, 6 * BLOCK))


@cuda
def test_a_gpu_reingest_gives_the_guessed_tail_back_and_keeps_the_frames(monkeypatch):
    _small_batches(monkeypatch)
    toks, kv = tokens_for(36, 8 * BLOCK), make_kv(8 * BLOCK, 36, device="cuda")
    cache = _gpu_cache(KIVI4)
    assert cache.ingest(toks, kv).stored == 8
    before = cache.stats()["tiers"][0]
    again = cache.ingest(toks, kv)
    after = cache.stats()["tiers"][0]
    assert (again.stored, again.present) == (0, 8)
    assert {k: after[k] for k in ("blocks", "used_bytes", "bytes_in", "reservation_bytes")} == \
        {k: before[k] for k in ("blocks", "used_bytes", "bytes_in", "reservation_bytes")}
    _assert_layers_equal(cache.materialize(toks, device="cuda"), _expected(KIVI4, kv, 8 * BLOCK))


@cuda
def test_the_last_gpu_piece_is_published_in_flight_and_read_once_landed(monkeypatch):
    """The call's last copy goes frame by frame (payloads only): its frames are committed
    with the copy still in flight, and every read waits for it."""
    _small_batches(monkeypatch)
    monkeypatch.setattr(batching, "LAST_PIECE", 2)
    toks, kv = tokens_for(37, 8 * BLOCK), make_kv(8 * BLOCK, 37, device="cuda")
    cache = _gpu_cache(KIVI4)
    landings = []
    real = cache.store.commit_many

    def commit_many(items, **kw):
        landings.append(kw.get("landing"))
        return real(items, **kw)

    monkeypatch.setattr(cache.store, "commit_many", commit_many)
    torch.cuda._sleep(50_000_000)  # hold the device, so the copies are surely in flight at commit
    assert cache.ingest(toks, kv).stored == 8
    assert isinstance(landings[-1], ingest_in_place.CopyLanding) and all(x is None for x in landings[:-1])
    _assert_layers_equal(cache.materialize(toks, device="cuda"), _expected(KIVI4, kv, 8 * BLOCK))
    for key in cache.block_hashes(toks):  # every header whole, every payload where it belongs
        frame = cache.store.tiers[0].get(key)
        assert parse_frame(frame.to_bytes()).block_hash == key
        frame.release()


@cuda
def test_a_device_frame_with_a_bad_buffer_frees_its_slot_once_the_good_ones_landed():
    """A frame whose first buffer is good and second is not: the put fails for it, and the
    tier frees its slot only once the copy already started into it has run."""
    from cacheseek.store.streams import work_stream
    from cacheseek.store.tier import BlockFrame

    key, frame = raw_frame(9)
    first, second = frame.meta.tensors[:2]
    good = torch.full((first.nbytes,), 9, dtype=torch.uint8, device="cuda")
    short = torch.full((second.nbytes - 1,), 9, dtype=torch.uint8, device="cuda")
    tier = CpuTier(4 * FRAME_BYTES, pin=True)
    torch.cuda._sleep(50_000_000)  # the good buffer's copy queues behind this
    result = tier.put_many([(key, BlockFrame(frame.meta, device_entries=[good, short], sealed=False))])[0]
    assert result.error is not None and "copy" in str(result.error)
    assert work_stream("to_host", torch.device("cuda", torch.cuda.current_device())).query()  # ran before the free
    assert tier.put(*raw_frame(2)).stored is not None
    torch.cuda.synchronize()
    assert tier.get(bytes([2]) * 16).to_bytes() == raw_frame(2)[1].to_bytes()


def test_a_failed_launch_gives_its_reservations_back(monkeypatch):
    cache = make_cache(cpu="4MiB", codec=KIVI4)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(ingest_in_place, "encode_into", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        cache.ingest(tokens_for(52, 4 * BLOCK), make_kv(4 * BLOCK, 52))
    assert calls and _tier_state(cache) == {"blocks": 0, "used_bytes": 0, "evictions": 0, "bytes_in": 0,
                                            "reservation_bytes": 0}


@pytest.mark.parametrize("codec", [KIVI4, cs.PrecisionPolicy(first_blocks=2, first=cs.Raw(), rest=KIVI4)],
                         ids=["uniform", "policy"])
def test_placeholder_runs_are_the_plans_of_all_zero_keys_kept_per_position(codec):
    """Kept per (first, count), a server's prompts of many lengths missed the cache, and each
    miss planned its whole tail again (~10 us a frame); kept per position, any run of
    positions planned before is a slice."""
    fmt = BlockFormat(codec, LAYOUT, BLOCK)
    for first, count in ((5, 3), (0, 1), (3, 9), (130, 4), (250, 10), (7, 2), (60, 70), (8000, 64)):
        # (headers grow past 127, 255; runs across chunks; a long prompt's tail, its chunks only)
        unknown = [bytes(16)] * count
        assert fmt.placeholder_run(first, count, 16) == fmt.plan_run(first, unknown, unknown), (first, count)
    first = fmt.placeholder_run(5, 3, 16)
    again = fmt.placeholder_run(4, 4, 16)[1:]
    assert again == first and all(a is b for a, b in zip(again, first))  # kept, sliced
    assert [m.position for m in fmt.placeholder_run(200, 2, 32)] == [200, 201]
    # (8000, 64) planned the chunks of positions 7,936-8,063 only, not every position before them
    assert len([k for k in fmt._placeholders if k[0] == 16]) <= 8
