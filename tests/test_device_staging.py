"""Device staging buffers lent with leases (``store.device_staging``).

A buffer is never lent twice at once, nor reused before the work its last holder queued on
it (on a GPU: its release's events); a lease is released exactly once; the data path gives
its staging back on every error path (a decode, an encode, a layer-wise load that fails
midway) and reuses it on the next call; the pool keeps to its cap; many threads at once
never share a buffer. On a CPU the same pool runs without streams, so all of this but the
event ordering is tested anywhere; the GPU tests run on a CUDA machine (scripts/h200.sh
tests-new)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import cacheseek as cs
from cacheseek import decode, layerwise
from cacheseek.block_format import BlockFormat
from cacheseek.encode import iter_encoded
from cacheseek.errors import InputError
from cacheseek.store.device_staging import (MIN_CLASS_BYTES, DeviceStagingPool, is_staging, size_class,
                                            staging_pool)
from cacheseek.store.lease import LeaseError
from store_helpers import BLOCK, LAYOUT, make_cache, make_kv, tokens_for

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INT4 = cs.KIVI(bits=4, group_size=32)


def _active(device: torch.device = CPU) -> int:
    return staging_pool(device).stats()["leases_active"]


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel()


# -- the pool --------------------------------------------------------------------------------


def test_size_classes_round_up_by_at_most_a_quarter():
    assert size_class(0) == size_class(1) == size_class(MIN_CLASS_BYTES) == MIN_CLASS_BYTES
    for n in (MIN_CLASS_BYTES + 1, 100_000, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 7, 1 << 30):
        c = size_class(n)
        assert n <= c <= n * 1.25 + 1 and size_class(c) == c


def test_a_buffer_is_never_lent_twice_at_once_and_is_reused_after_its_release():
    pool = DeviceStagingPool(CPU, cap_bytes=8 << 20)
    leases = [pool.take(100_000) for _ in range(4)]
    spans = sorted(_span(lease.tensor) for lease in leases)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    for i, lease in enumerate(leases):
        lease.tensor.fill_(i)
    second = leases[1]
    ptr = second.tensor.data_ptr()
    second.release()
    again = pool.take(110_000)  # same class: the buffer released is the one reused
    assert again.tensor.data_ptr() == ptr and again.tensor.numel() == 110_000
    again.tensor.fill_(99)
    for i, lease in enumerate(leases):  # the others' bytes are untouched
        if lease is not second:
            assert bool((lease.tensor == i).all())
    stats = pool.stats()
    assert stats["buffers_made"] == 4 and stats["reused"] == 1 and stats["leases_active"] == 4
    for lease in [*leases, again]:
        if not lease.released:
            lease.release()
    assert pool.stats()["leases_active"] == 0 and pool.stats()["leased_bytes"] == 0


def test_a_staging_lease_is_released_exactly_once():
    pool = DeviceStagingPool(CPU)
    with pool.take(10) as lease:
        assert lease.tensor.numel() == 10 and pool.stats()["leases_active"] == 1
    assert lease.released and lease.tensor is None  # a use after the release fails
    with pytest.raises(LeaseError, match="twice"):
        lease.release()
    with pytest.raises(LeaseError):
        lease.used_on(None)
    stats = pool.stats()
    assert stats["leases_active"] == 0 and stats["lease_double_releases"] == 1 and stats["free_buffers"] == 1


def test_the_pool_keeps_to_its_cap_and_lends_one_off_buffers_beyond_it():
    cap = 4 * MIN_CLASS_BYTES
    pool = DeviceStagingPool(CPU, cap_bytes=cap)
    held = [pool.take(MIN_CLASS_BYTES) for _ in range(6)]  # 4 fit, 2 are one-offs
    stats = pool.stats()
    assert stats["pooled_bytes"] == cap and stats["buffers_made"] == 4 and stats["one_off"] == 2
    assert stats["leases_active"] == 6  # one-offs are leases too
    for lease in held:
        lease.release()
    stats = pool.stats()
    assert stats["free_buffers"] == 4 and stats["free_bytes"] == cap and stats["pooled_bytes"] == cap
    big = pool.take(2 * cap)  # larger than the cap: a buffer of its own, freed at its release
    assert big.tensor.numel() == 2 * cap and pool.stats()["one_off"] == 3
    big.release()
    assert pool.stats()["pooled_bytes"] == cap and pool.stats()["free_buffers"] == 4
    # A new class when the cap is all free buffers of another: those are freed for it.
    other = pool.take(3 * MIN_CLASS_BYTES)
    stats = pool.stats()
    assert stats["dropped"] == 3 and stats["pooled_bytes"] <= cap and stats["one_off"] == 3
    other.release()
    assert pool.stats()["pooled_bytes"] <= cap


def test_trim_frees_the_free_buffers_and_an_allocation_that_fails_is_not_counted(monkeypatch):
    pool = DeviceStagingPool(CPU, cap_bytes=8 * MIN_CLASS_BYTES)
    for lease in [pool.take(MIN_CLASS_BYTES) for _ in range(3)]:
        lease.release()
    held = pool.take(MIN_CLASS_BYTES)
    assert pool.trim() == 2 * MIN_CLASS_BYTES
    stats = pool.stats()
    assert stats["pooled_bytes"] == MIN_CLASS_BYTES and stats["free_buffers"] == 0 and stats["dropped"] == 2

    def no_memory(nbytes, stream):
        raise torch.OutOfMemoryError("no memory")

    monkeypatch.setattr(pool, "_empty", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        pool.take(3 * MIN_CLASS_BYTES)
    stats = pool.stats()
    assert stats["pooled_bytes"] == MIN_CLASS_BYTES and stats["buffers_made"] == 3 and stats["leases_active"] == 1
    held.release()


def test_a_lease_dropped_unreleased_keeps_its_buffer_lent():
    pool = DeviceStagingPool(CPU, cap_bytes=MIN_CLASS_BYTES)
    lease = pool.take(1000)
    ptr = lease.tensor.data_ptr()
    del lease  # a bug in the holder: shown, never reused under it
    stats = pool.stats()
    assert stats["leases_active"] == 1 and stats["free_buffers"] == 0
    other = pool.take(1000)
    assert other.tensor.data_ptr() != ptr and pool.stats()["one_off"] == 1
    other.release()


def test_many_threads_never_hold_one_buffer_at_once():
    pool = DeviceStagingPool(CPU, cap_bytes=24 * MIN_CLASS_BYTES)  # small: reuse, one-offs and drops all along
    held: dict[int, tuple[int, int]] = {}  # thread -> span it holds
    lock = threading.Lock()
    errors: list[str] = []
    threads, rounds = 8, 300

    def work(t: int) -> None:
        rnd = random.Random(t)
        for r in range(rounds):
            with pool.take(rnd.choice([1000, MIN_CLASS_BYTES, 100_000, 200_000])) as lease:
                span = _span(lease.tensor)
                with lock:
                    for other, (a, b) in held.items():
                        if a < span[1] and span[0] < b:
                            errors.append(f"thread {t} got bytes thread {other} holds")
                    held[t] = span
                lease.tensor.fill_(t)
                if not bool((lease.tensor == t).all()):
                    errors.append(f"thread {t}: its buffer was written by another")
                with lock:
                    del held[t]

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors[:3]
    stats = pool.stats()
    assert stats["leases_active"] == 0 and stats["leases_granted"] == threads * rounds
    assert stats["pooled_bytes"] <= pool.cap_bytes and stats["reused"] > 0


class _Stream:
    """A stand-in CUDA stream: work queued (``work``) and done (``finish``), and the events
    it was made to wait for."""

    def __init__(self) -> None:
        self.queued = self.done = 0
        self.waits: list = []

    def work(self) -> None:
        self.queued += 1

    def finish(self) -> None:
        self.done = self.queued

    def wait_event(self, event) -> None:
        self.waits.append(event)


class _Event:
    def record(self, stream: _Stream) -> None:
        self.stream, self.mark = stream, stream.queued

    def query(self) -> bool:
        return self.stream.done >= self.mark


def test_the_stream_order_of_reuse_with_stand_in_streams_and_events(monkeypatch):
    """The CUDA logic of the pool on a CPU: a release marks every stream of the holder; a
    buffer is reused once those marks have passed; under the cap a buffer still in use is
    not handed out; at the cap the taker's stream waits for its marks (the host never)."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    n = MIN_CLASS_BYTES
    pool = DeviceStagingPool(CPU, cap_bytes=2 * n)
    pool.cuda = True
    monkeypatch.setattr(pool, "_empty", lambda nbytes, stream: torch.empty(nbytes, dtype=torch.uint8))
    s1, s2, s3 = _Stream(), _Stream(), _Stream()
    a = pool.take(n, stream=s1).used_on(s2, s2, None)  # (named twice: marked once)
    a_ptr = a.tensor.data_ptr()
    s2.work()  # a copy out of it, still running at the release
    a.release()
    b = pool.take(n, stream=s1)  # a's buffer is still in use on s2: a new one (under the cap)
    b_ptr = b.tensor.data_ptr()
    assert b_ptr != a_ptr and pool.stats()["buffers_made"] == 2 and not s1.waits
    b.release()  # s1 has nothing queued: its mark has passed
    c = pool.take(n, stream=s1)
    assert c.tensor.data_ptr() == b_ptr and not s1.waits  # the free one whose users are done
    d = pool.take(n, stream=s3)  # at the cap, only a's buffer free: s3 waits for a's marks
    assert d.tensor.data_ptr() == a_ptr and pool.stats()["waited"] == 1
    assert [e.stream for e in s3.waits] == [s1, s2]
    s2.finish()
    c.release()
    d.release()
    e = pool.take(n, stream=s2)
    assert not s2.waits and pool.stats()["reused"] == 3 and pool.stats()["buffers_made"] == 2
    e.release()
    assert pool.stats()["leases_active"] == 0


# -- the data path ---------------------------------------------------------------------------


def _stored(cache, codec, blocks: int = 4, seed: int = 1):
    toks = tokens_for(seed, blocks * BLOCK)
    kv = make_kv(blocks * BLOCK, seed)
    assert cache.ingest(toks, kv).stored == blocks
    return toks, kv


@pytest.mark.parametrize("codec", [cs.Raw(), INT4], ids=lambda c: c.name)
def test_materialize_gives_its_staging_back_and_reuses_it_on_the_next_call(codec):
    # On the host a tier's frames (aligned) are decoded from their own bytes: no staging
    # taken at all. Frames copied into staging (misaligned copies here) take one lease a
    # decode, given back, and the next decode reuses its buffer.
    cache = make_cache(cpu="4MiB", codec=codec)
    toks, _ = _stored(cache, codec)
    before, granted = _active(), staging_pool(CPU).stats()["leases_granted"]
    first = cache.materialize(toks)
    assert _active() == before and staging_pool(CPU).stats()["leases_granted"] == granted
    stored = [cache.store.get(h)[0] for h in cache.block_hashes(toks)]
    odd = []
    for frame in stored:
        buf = bytearray(1 + len(frame.host))
        buf[1:] = frame.host
        odd.append(decode.BlockFrame(frame.meta, host=memoryview(buf)[1:]))
        frame.release()
    fmt = BlockFormat(codec, LAYOUT, BLOCK)
    k, v = decode.decode_frames(fmt, odd, CPU)
    made = staging_pool(CPU).stats()["buffers_made"]
    again = decode.decode_frames(fmt, odd, CPU)
    assert _active() == before and staging_pool(CPU).stats()["buffers_made"] == made  # nothing new made
    for layer, (k1, v1) in enumerate(first.layers):
        assert torch.equal(k1[0], k[layer]) and torch.equal(v1[0], v[layer])
        assert torch.equal(k1[0], again[0][layer]) and torch.equal(v1[0], again[1][layer])
    entry = next(p for p in cache.stats()["device_staging"] if p["device"] == "cpu")
    assert entry["leases_granted"] == granted + 2 and entry["leases_active"] == before
    cache.close()


def test_a_decode_that_fails_midway_gives_its_staging_back(monkeypatch):
    cache = make_cache(cpu="4MiB", codec=INT4)
    toks, _ = _stored(cache, INT4, blocks=12)
    want = cache.materialize(toks)
    before = _active()
    calls = []

    def failing(real):
        def decode_(self, *args):
            calls.append(1)
            if len(calls) == 2:  # the second decode: after a first one (out of staging, or on
                raise RuntimeError("decode failed")  # the host out of the first frame's bytes)
            return real(self, *args)
        return decode_

    for name in ("_decode_pending", "_host_decode"):
        monkeypatch.setattr(decode.BatchDecoder, name, failing(getattr(decode.BatchDecoder, name)))
    with pytest.raises(RuntimeError, match="decode failed"):
        cache.materialize(toks)
    assert len(calls) == 2 and _active() == before
    assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0
    monkeypatch.undo()
    got = cache.materialize(toks)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, want.layers))
    assert _active() == before
    cache.close()


def test_decode_frames_gives_its_staging_back_when_a_frame_is_bad():
    cache = make_cache(cpu="4MiB", codec=INT4)
    toks, _ = _stored(cache, INT4, blocks=3)
    frames = [f for f, _ in cache.store.get_many(cache.block_hashes(toks))]
    other = make_cache(cpu="4MiB", codec=cs.KIVI(bits=2, group_size=32))
    t2, _ = _stored(other, None, blocks=1, seed=5)
    odd = other.store.get_many(other.block_hashes(t2))[0][0]
    before = _active()
    with pytest.raises(Exception, match="payload layout|does not match"):
        decode.decode_frames(cache.block_format, [*frames[:2], odd], CPU)
    assert _active() == before
    for f in [*frames, odd]:
        f.release()
    cache.close()
    other.close()


def test_an_encode_that_finds_nan_or_is_abandoned_gives_its_staging_back():
    fmt = BlockFormat(INT4, LAYOUT, BLOCK)
    kv = make_kv(6 * BLOCK, 3)
    hashes = [bytes([i]) * 16 for i in range(1, 7)]
    parents = [b"\x00" * 16, *hashes[:-1]]
    before = _active()
    batches = iter_encoded(fmt, kv, hashes, parents, [False] * 6, 2, pooled=True)
    first = next(batches)
    assert len(first) == 2 and _active() == before + 1 and is_staging(first[0].device_payload)
    batches.close()  # the consumer gives up
    assert _active() == before
    bad = [(k.clone(), v.clone()) for k, v in kv]
    bad[1][0][0, 4 * BLOCK + 1, 0] = float("nan")  # block 4: the third batch
    seen = 0
    with pytest.raises(InputError):
        for batch in iter_encoded(fmt, bad, hashes, parents, [False] * 6, 2, pooled=True):
            seen += len(batch)
            assert _active() == before + 1
    assert seen == 4 and _active() == before
    # Unpooled (frames the caller keeps): plain tensors, no lease.
    kept = [f for b in iter_encoded(fmt, kv, hashes, parents, [False] * 6, 2) for f in b]
    assert _active() == before and not any(is_staging(f.device_payload) for f in kept)


def test_an_ingest_with_nan_gives_its_staging_back():
    cache = make_cache(cpu="4MiB", codec=INT4, gpu=0)
    kv = make_kv(4 * BLOCK, 4)
    kv[2][1][1, 3 * BLOCK, 5] = float("inf")
    before = _active()
    with pytest.raises(InputError):
        cache.ingest(tokens_for(4, 4 * BLOCK), kv)
    assert _active() == before
    cache.close()


@pytest.mark.parametrize("fail_from", [1, 3])
def test_a_layerwise_load_that_fails_midway_gives_its_staging_back(monkeypatch, fail_from):
    layout = cs.KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float16")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=INT4, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="4MiB"))
    toks = tokens_for(7, 3 * BLOCK)
    cache.ingest(toks, make_kv(3 * BLOCK, 7, layout))
    before = _active()
    real = layerwise.LayerwiseDecoder._decode_layers

    def failing(self, views, l0, l1, n):
        if l0 >= fail_from:
            raise RuntimeError("device lost")
        return real(self, views, l0, l1, n)

    monkeypatch.setattr(layerwise.LayerwiseDecoder, "_decode_layers", failing)
    load = cache.materialize(toks, layerwise=True)
    assert _active() == before + 1  # held while groups are left to run
    with pytest.raises(cs.LoadError):
        load.wait(5)
    load.close()
    assert _active() == before
    monkeypatch.undo()
    with cache.materialize(toks, layerwise=True) as whole:
        whole.wait(5)  # the last group issued: the staging is given back before close
        assert _active() == before
    cache.close()


# -- on a GPU --------------------------------------------------------------------------------


@cuda
def test_a_buffer_is_reused_only_after_the_work_its_holder_queued():
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 8 << 20
    pool = DeviceStagingPool(dev, cap_bytes=size_class(n))  # room for one buffer
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    # The kernels used below, loaded first: CUDA loads a kernel's module at its first launch
    # and may wait for the device to do so, which ran the sleep out before the release.
    torch.cuda._sleep(1)
    torch.empty(1, dtype=torch.uint8, device=dev).fill_(1)
    torch.cuda.synchronize(dev)
    first = pool.take(n, stream=s1)
    ptr = first.tensor.data_ptr()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(1_000_000_000)  # the first holder's work is still queued at its release
        first.tensor.fill_(1)
    first.release()
    second = pool.take(n, stream=s2)  # at the cap: the same buffer, s2 made to wait (no host wait)
    assert second.tensor.data_ptr() == ptr and pool.stats()["waited"] == 1
    buf = second.tensor
    with torch.cuda.stream(s2):
        buf.fill_(2)
    second.release()
    torch.cuda.synchronize(dev)
    assert bool((buf == 2).all())  # the first holder's fill ran before, never after


@cuda
def test_under_the_cap_a_buffer_still_in_use_on_the_device_is_not_handed_out():
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = DeviceStagingPool(dev, cap_bytes=64 << 20)
    side = torch.cuda.Stream(dev)
    first = pool.take(1 << 20)
    first.used_on(side)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        first.tensor.fill_(7)
    first_ptr = first.tensor.data_ptr()
    first.release()
    second = pool.take(1 << 20)
    assert second.tensor.data_ptr() != first_ptr and pool.stats()["waited"] == 0
    second.release()
    torch.cuda.synchronize(dev)
    third = pool.take(1 << 20)  # both done now: a free one is reused, nothing new made
    assert pool.stats()["buffers_made"] == 2 and pool.stats()["reused"] == 1
    third.release()


@cuda
@pytest.mark.parametrize("codec", [cs.Raw(), INT4], ids=lambda c: c.name)
def test_gpu_ingest_and_materialize_give_their_staging_back_and_reuse_it(codec):
    dev = torch.device("cuda", torch.cuda.current_device())
    cache = make_cache(cpu="64MiB", gpu="16MiB", codec=codec)
    kv = make_kv(8 * BLOCK, 9, device="cuda")
    toks = tokens_for(9, 8 * BLOCK)
    before = _active(dev)
    cache.ingest(toks, kv)
    first = cache.materialize(toks, dev)
    torch.cuda.synchronize(dev)  # its decode done: its staging's events have passed
    made = staging_pool(dev).stats()["buffers_made"]
    for _ in range(3):
        again = cache.materialize(toks, dev)
        for (k, v), (k2, v2) in zip(first.layers, again.layers):
            assert torch.equal(k, k2) and torch.equal(v, v2)  # (waits for the decode)
    torch.cuda.synchronize(dev)
    stats = staging_pool(dev).stats()
    assert stats["leases_active"] == before and stats["buffers_made"] == made
    cache.close()


def test_memo_keeps_views_with_the_buffer_for_its_next_holder():
    pool = DeviceStagingPool(torch.device("cpu"))
    with pool.take(1 << 20) as lease:
        views = lease.memo(("rows", 4), lambda: [lease.tensor[:4], lease.tensor[4:8]])
        assert lease.memo(("rows", 4), lambda: pytest.fail("made twice")) is views
        first = lease.tensor.data_ptr()
    with pool.take(1 << 20) as again:  # the same buffer, taken again: its views found, not cut again
        assert again.tensor.data_ptr() == first
        assert again.memo(("rows", 4), lambda: pytest.fail("made twice")) is views
    with pytest.raises(LeaseError, match="after its release"):
        again.memo(("rows", 4), list)
