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
from cacheseek import block_io
from cacheseek.errors import InputError
from cacheseek.store import cpu as cpu_tier
from cacheseek.store.cpu import CpuTier
from cacheseek.store.frame import build_frame, plan_frame
from cacheseek.store.tier import BlockFrame
from store_helpers import BLOCK, LAYOUT, assert_prefix_equal, make_kv, tokens_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BUFFERS = [("k", "float16", (3, 2, BLOCK, 64)), ("v", "float16", (3, 2, BLOCK, 64))]


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


def frame(i: int) -> tuple[bytes, BlockFrame]:
    key = bytes([i]) * 16
    meta = plan_frame(block_hash=key, parent_hash=b"\x00" * 16, position=0, layout=LAYOUT, block_tokens=BLOCK,
                      codec=cs.Raw().spec(), buffers=BUFFERS)
    half = meta.tensors[0].nbytes
    return key, BlockFrame(meta, host=memoryview(build_frame(meta, [bytes([i]) * half] * 2)))


FRAME_BYTES = frame(1)[1].nbytes


def test_reads_wait_for_the_copies_and_a_failed_copy_is_a_counted_miss(landings):
    log, fail, _ = landings
    fail.add(bytes([2]) * 16)
    tier = CpuTier(4 * FRAME_BYTES)
    for i in (1, 2):
        assert tier.put(*frame(i)).stored is not None
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
    tier.put(*frame(1))
    tier.put(*frame(2))
    result = tier.put(*frame(3))  # evicts 1: its copies must be done before its slot is reused
    assert [k for k, _ in result.evicted] == [bytes([1]) * 16] and log == ["01"]
    assert tier.delete(bytes([2]) * 16) and log == ["01", "02"]
    made[bytes([3]) * 16].finished = True  # landed on its own: the next put forgets it, no wait
    tier.put(*frame(4))
    assert tier.get(bytes([3]) * 16) is not None and log == ["01", "02"]


def test_an_evicted_frame_whose_copy_failed_is_not_demoted(landings, tmp_path):
    _, fail, _ = landings
    fail.add(bytes([1]) * 16)
    store = cs.TierConfig(cpu_bytes=2 * FRAME_BYTES, disk_path=tmp_path / "d", write_through=()).build()
    for i in (1, 2, 3):
        store.put(*frame(i))
    disk = store.tier("disk")
    assert not disk.contains(bytes([1]) * 16)
    assert store.tier("cpu").stats().write_errors == 1


def test_write_through_and_close_settle_the_copies_first(landings, tmp_path):
    log, _, _ = landings
    store = cs.TierConfig(cpu_bytes=4 * FRAME_BYTES, disk_path=tmp_path / "d").build()
    store.put_many([frame(1), frame(2)])
    assert sorted(log) == ["01", "02"]  # the disk tier read the CPU tier's copies: waited first
    assert store.tier("disk").get(bytes([2]) * 16).to_bytes() == frame(2)[1].to_bytes()
    tier = CpuTier(4 * FRAME_BYTES)
    tier.put(*frame(5))
    tier.close()
    assert log[-1] == "05"


def test_pipeline_batches():
    mb = 1 << 20
    assert block_io.pipeline_blocks(16, 32, 32 * mb) == 6  # 16 Llama-3-8B blocks: 3 batches
    assert block_io.pipeline_blocks(16, 3, 32 * mb) == 3  # never above the configured batch
    assert block_io.pipeline_blocks(3, 32, 32 * mb) == 4  # not below 128 MiB of raw KV a batch
    assert block_io.pipeline_blocks(40, 32, mb) == 32  # small blocks: the batch size decides
    assert block_io.pipeline_blocks(1, 32, 1 << 30) == 1


# -- the real thing, on a GPU ------------------------------------------------------------

KIVI4 = cs.KIVI(bits=4, group_size=32)


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
    monkeypatch.setattr(block_io, "PIPELINE_MIN_BYTES", 0)  # several batches even for small blocks
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
    monkeypatch.setattr(block_io, "PIPELINE_MIN_BYTES", 0)
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
    monkeypatch.setattr(block_io, "PIPELINE_MIN_BYTES", 0)
    toks, kv = tokens_for(32, 10 * BLOCK), make_kv(10 * BLOCK, 32, device="cuda")
    frame_bytes = cs.Raw().encoded_nbytes(LAYOUT, BLOCK) + 1024
    cache = _gpu_cache(cs.Raw(), cpu=3 * frame_bytes, disk_path=tmp_path / "d", write_through=())
    assert cache.ingest(toks, kv).stored == 10
    assert cache.locate(toks).tiers.count("disk") == 7
    assert_prefix_equal(cache.materialize(toks, device="cuda"), kv, 10 * BLOCK)
    written = _gpu_cache(cs.Raw(), cpu=3 * frame_bytes, disk_path=tmp_path / "wt")  # write-through
    assert written.ingest(toks, kv).stored == 10
    assert_prefix_equal(_gpu_cache(cs.Raw(), cpu=0, disk_path=tmp_path / "wt").materialize(toks), kv, 10 * BLOCK)


@cuda
def test_nan_in_a_later_gpu_batch_undoes_the_batches_in_flight(monkeypatch):
    monkeypatch.setattr(block_io, "PIPELINE_MIN_BYTES", 0)
    toks, kv = tokens_for(33, 8 * BLOCK), make_kv(8 * BLOCK, 33, device="cuda")
    kv[1][1][0, 2, 3] = float("nan")  # block 0: batches go tail first, so it fails last
    cache = _gpu_cache(KIVI4)
    with pytest.raises(InputError, match="NaN or Inf"):
        cache.ingest(toks, kv)
    assert cache.lookup(toks) == 0 and cache.stats()["used_bytes"] == 0
