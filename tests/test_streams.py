"""Streams are switched in a scope and given back: no call returns with the caller's current
CUDA stream (or device) changed, even when the work inside raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cacheseek as cs
from cacheseek import batching, decode, ingest_in_place
from cacheseek.store import device as store_device
from cacheseek.store import streams
from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KIVI4 = cs.KIVI(bits=4, group_size=32)


class FakeCuda:
    """The thread's current device and per-device current streams, as torch.cuda keeps them."""

    def __init__(self) -> None:
        self.device = 0
        self.current = {0: SimpleNamespace(device_index=0, name="caller0"),
                        1: SimpleNamespace(device_index=1, name="caller1")}

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(streams, "BINDINGS", None)  # torch.cuda's Python calls, as in a CPU build
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current[
            self.device if device is None else device])
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "set_stream", self.set_stream)

    def set_device(self, index: int) -> None:
        self.device = index

    def set_stream(self, stream) -> None:  # as torch does: the stream's device becomes current too
        self.device = stream.device_index
        self.current[stream.device_index] = stream


def test_on_stream_gives_back_the_callers_stream_and_device_even_on_error(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    work = SimpleNamespace(device_index=0, device=0, name="work0")
    with streams.on_stream(work):
        assert fake.current[0] is work
    assert fake.current[0].name == "caller0" and fake.device == 0
    other = SimpleNamespace(device_index=1, device=1, name="work1")  # a stream of another device
    with pytest.raises(ValueError), streams.on_stream(other):
        assert fake.current[1] is other and fake.device == 1
        raise ValueError("the work failed")
    assert fake.current[1].name == "caller1" and fake.current[0].name == "caller0" and fake.device == 0


class FakeBindings(FakeCuda):
    """The same state behind torch's C bindings: streams as (id, device index, device type)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = {0: (100, 0, 1), 1: (101, 1, 1)}

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(streams, "BINDINGS", streams._Bindings(
            get_stream=lambda index: self.current[index], set_stream=self.set_stream_by_id,
            get_device=lambda: self.device))

    def set_stream_by_id(self, *, stream_id: int, device_index: int, device_type: int) -> None:
        self.device = device_index  # as torch._C._cuda_setStream does
        self.current[device_index] = (stream_id, device_index, device_type)


def test_on_stream_through_torchs_bindings_gives_back_the_callers_stream_and_device(monkeypatch):
    fake = FakeBindings()
    fake.install(monkeypatch)
    work = SimpleNamespace(stream_id=7, device_index=0, device_type=1)
    with streams.on_stream(work):
        assert fake.current[0] == (7, 0, 1) and fake.device == 0
    assert fake.current[0] == (100, 0, 1) and fake.device == 0
    other = SimpleNamespace(stream_id=8, device_index=1, device_type=1)
    with pytest.raises(ValueError), streams.on_stream(other):
        assert fake.current[1] == (8, 1, 1) and fake.device == 1
        raise ValueError("the work failed")
    assert fake.current == {0: (100, 0, 1), 1: (101, 1, 1)} and fake.device == 0


def test_current_stream_through_the_bindings_refuses_a_device_that_is_not_cuda(monkeypatch):
    FakeBindings().install(monkeypatch)
    with pytest.raises(ValueError, match="expected a CUDA device"):
        streams.current_stream(torch.device("cpu"))


@pytest.mark.skipif(streams.BINDINGS is None or not torch.cuda.is_available(), reason="needs CUDA's bindings")
def test_current_stream_is_torchs_current_stream():
    mine = torch.cuda.Stream()
    dev = torch.device("cuda", torch.cuda.current_device())
    for device in (None, dev, torch.device("cuda"), dev.index):
        assert streams.current_stream(device) == torch.cuda.current_stream(device)
        with torch.cuda.stream(mine):
            got = streams.current_stream(device)
            assert got == mine == torch.cuda.current_stream(device) and got.device_index == dev.index


# -- on a GPU: ingest and materialize leave the caller on its stream ----------------------------

def _current_is(stream: torch.cuda.Stream) -> bool:
    return torch.cuda.current_stream() == stream and torch.cuda.current_device() == stream.device_index


@cuda
@pytest.mark.parametrize("codec", [cs.Raw(), KIVI4])
def test_ingest_and_materialize_return_on_the_callers_stream(codec, monkeypatch):
    monkeypatch.setattr(batching, "MIN_BATCH_BYTES", 0)  # several batches, several launches
    toks, kv = tokens_for(60, 8 * BLOCK), make_kv(8 * BLOCK, 60, device="cuda")
    mine = torch.cuda.Stream()
    frame_bytes = codec.encoded_nbytes(LAYOUT, BLOCK) + 1024
    in_place = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                              tiers=cs.TierConfig(cpu_bytes="16MiB"))
    # Full and without a reserve: the blocks go through put_many (HostCopies).
    through_put = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                                 tiers=cs.TierConfig(cpu_bytes=8 * frame_bytes, cpu_reserve_bytes=0))
    on_gpu = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=codec, block_tokens=BLOCK,
                            tiers=cs.TierConfig(gpu_bytes="16MiB", cpu_bytes=0))
    with torch.cuda.stream(mine):
        kv = [(k.clone(), v.clone()) for k, v in kv]  # made on the caller's stream
        for cache in (in_place, through_put, on_gpu):
            filler = tokens_for(61, 8 * BLOCK)
            cache.ingest(filler, kv)
            assert _current_is(mine)
            assert cache.ingest(toks, kv).stored == 8
            assert _current_is(mine)
            assert cache.materialize(toks, device="cuda").num_tokens == 8 * BLOCK
            assert _current_is(mine)


@cuda
def test_a_failure_inside_a_switched_scope_leaves_the_caller_on_its_stream(monkeypatch):
    toks, kv = tokens_for(62, 4 * BLOCK), make_kv(4 * BLOCK, 62, device="cuda")
    mine = torch.cuda.Stream()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    with torch.cuda.stream(mine):
        cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=KIVI4, block_tokens=BLOCK,
                               tiers=cs.TierConfig(cpu_bytes="16MiB"))
        with monkeypatch.context() as m:  # the in-place launch, on the encode stream
            m.setattr(ingest_in_place, "flags_to_host", broken)
            with pytest.raises(RuntimeError, match="device lost"):
                cache.ingest(toks, kv)
        assert _current_is(mine)
        bad = [(k.clone(), v.clone()) for k, v in kv]
        bad[1][0][0, 3, 3] = float("nan")
        with pytest.raises(cs.InputError):
            cache.ingest(toks, bad)
        assert _current_is(mine)
        with monkeypatch.context() as m:  # put_many's copies to the host, on the to-host stream
            m.setattr(store_device, "copy_entry", broken)
            full = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=KIVI4, block_tokens=BLOCK,
                                  tiers=cs.TierConfig(cpu_bytes="16MiB", cpu_reserve_bytes=0))
            full.store.tiers[0].lends_runs = False
            assert full.ingest(toks, kv).failed == 4
        assert _current_is(mine)
        cache.ingest(toks, kv)
        with monkeypatch.context() as m:  # the decoder's copies to the device, on the to-device stream
            m.setattr(decode, "as_host_tensor", broken)
            with pytest.raises(RuntimeError, match="device lost"):
                cache.materialize(toks, device="cuda")
        assert _current_is(mine)
