"""Layer-wise loading and storing: ``materialize(..., layerwise=True)``,
``materialize_into(..., layerwise=True)``, ``ingest_layerwise``, and ``prefill_with_reuse``
on a cache that waits per layer inside the forward.

On a CPU the handle decodes a layer group when one of its layers is first waited for, so
the order in which layers become ready is visible here; on a GPU (the CUDA-only cases) it
queues every group on side streams with an event per layer and never waits on the host.
Every load is compared byte for byte with the normal path.
"""

from __future__ import annotations

import gc
import threading
import types

import numpy as np
import pytest
import torch

import cacheseek as cs
from cacheseek import layerwise, layerwise_save, paged_io
from cacheseek.layerwise import LayerwiseDecoder, layer_groups
from cacheseek.quant import backend as kivi_codec
from cacheseek.store.arena import slot_stride
from cacheseek.store.device_staging import staging_pool
from model_helpers import tiny_llama
from paged_helpers import DEVICE, engine_pages, page_tables, snapshot, unchanged, write_tokens
from store_helpers import fail_disk_writes, fail_layer_group, make_kv, tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LAYOUT = cs.KVLayout(num_layers=6, num_kv_heads=2, head_dim=64, dtype="float16")  # groups (0,1) (1,3) (3,6)
L, H, D, DTYPE = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
BLOCK = 32
INT4 = cs.KIVI(bits=4, group_size=32)
CODECS = [cs.Raw(), INT4]
ROTATED = cs.KIVI(k_bits=4, v_bits=2, group_size=32, v_rotate=True)  # V rotated back after each group's decode
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_cache(codec, device_tier=False, **kw):
    tiers = cs.TierConfig(**({"cpu_bytes": "16MiB", "pin_memory": torch.cuda.is_available()} | kw))
    return cs.PrefixCache(model_id="lw", layout=LAYOUT, codec=codec, block_tokens=BLOCK, tiers=tiers)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """The torch reference on a CPU (the interpreted kernels are tested on the same ranges in
    test_paged.py); on a GPU the kernels."""
    if not torch.cuda.is_available():
        monkeypatch.setenv(kivi_codec.BACKEND_ENV, "torch")


def stored(cache, codec, T=3 * BLOCK + 7, seed=1, device="cpu"):
    toks, kv = tokens_for(seed, T), make_kv(T, seed, LAYOUT, device=device)
    assert cache.ingest(toks, kv).stored == T // BLOCK
    return toks, kv


# -- the handle ----------------------------------------------------------------------------


def test_layer_groups_grow_and_cover_every_layer():
    assert layer_groups(6) == [(0, 1), (1, 3), (3, 6)]
    # A rest smaller than half the group before it joins that group (no launch for one layer).
    assert layer_groups(32) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 32)]
    assert layer_groups(16) == [(0, 1), (1, 3), (3, 7), (7, 16)]
    assert layer_groups(40) == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 31), (31, 40)]
    assert layer_groups(1) == [(0, 1)]
    assert layer_groups(5, first=2) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError):
        layer_groups(0)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("codec", [*CODECS, ROTATED], ids=lambda c: c.name + ("-rot" if getattr(c, "v_rotate", False) else ""))
def test_layerwise_load_is_bit_identical_to_materialize(codec, kernels, monkeypatch):
    # The Triton decode of layer ranges (strided staging views) runs where test_paged.py runs
    # the kernels: on CUDA tensors on a GPU, interpreted on a CPU (CPU tensors outside the
    # interpreter are refused by the kernels).
    device = DEVICE if kernels else "cpu"
    if kernels:
        monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec, device=device)
        want = cache.materialize(toks, device=device)
        with cache.materialize(toks, device=device, layerwise=True) as load:
            assert (load.num_tokens, load.num_blocks, load.tiers) == (want.num_tokens, want.num_blocks, want.tiers)
            for i in range(L):
                k, v = load.layer(i)
                assert k.shape == (1, H, want.num_tokens, D)
                assert torch.equal(k, want.layers[i][0]) and torch.equal(v, want.layers[i][1])
            assert load.done()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the groups are queued at once")
def test_layers_become_ready_in_order_group_by_group():
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4)
        load = cache.materialize(toks, layerwise=True)
        assert [load.ready(i) for i in range(L)] == [False] * L  # nothing decoded before a wait
        load.wait(0)
        assert [load.ready(i) for i in range(L)] == [True] + [False] * 5
        load.wait(2)  # the group (1, 3) as a whole
        assert [load.ready(i) for i in range(L)] == [True] * 3 + [False] * 3
        load.wait(1)  # ready already: nothing more is decoded
        assert not load.ready(3)
        assert not load.done() or all(load.ready(i) for i in range(L))  # done() finishes the load
        assert all(load.ready(i) for i in range(L))
        times = load.timeline()
        assert [t.layer for t in times] == list(range(L))
        ready = [t.ready_ms for t in times]
        assert ready == sorted(ready)  # in order
        assert times[0].needed_ms is not None and times[5].needed_ms is None  # layer 5 was never waited for
        load.close()


def test_wait_checks_the_layer_and_an_empty_load_is_ready():
    with make_cache(cs.Raw()) as cache:
        toks, _ = stored(cache, cs.Raw())
        with cache.materialize(toks, layerwise=True) as load:
            with pytest.raises(cs.InputError, match="outside the 6 layers"):
                load.wait(6)
            with pytest.raises(cs.InputError):
                load.wait(-1)
            k, v = load.layer(3, wait=False)  # the tensors before the layer is there: shapes final
            assert k.shape == v.shape == (1, H, 3 * BLOCK, D)
        load.close()  # idempotent
        empty = cache.materialize(tokens_for(99, 2 * BLOCK), layerwise=True)
        assert (empty.num_tokens, empty.num_blocks, empty.tiers) == (0, 0, [])
        assert empty.done() and empty.ready(0)
        empty.wait(5)
        with pytest.raises(RuntimeError, match="nothing was loaded"):
            empty.layer(0)
        short = cache.materialize(toks, layerwise=True, max_tokens=BLOCK + 3)
        assert short.num_tokens == BLOCK and short.layer(0)[0].shape == (1, H, BLOCK, D)
        short.close()


def test_a_bad_layer_index_is_an_input_error_naming_it():
    """Every layer is loaded, so a negative index is not "not ready yet" but a wrong answer
    (layer 5's), and a float or a bool would be taken as some layer or fail deep inside."""
    with make_cache(cs.Raw()) as cache:
        toks, _ = stored(cache, cs.Raw())
        empty = cache.materialize(tokens_for(99, 2 * BLOCK), layerwise=True)  # every layer "ready" at once
        with cache.materialize(toks, layerwise=True) as load:
            load.wait(L - 1)
            for handle in (load, empty):
                for call in ("ready", "wait", "layer"):
                    for bad in (6, -1, 100):
                        with pytest.raises(cs.InputError, match=rf"^layer: {bad} is outside the 6 layers \(0 to 5\)"):
                            getattr(handle, call)(bad)
                    for bad, shown in ((1.5, "float 1.5"), (True, "bool True"), ("2", "str '2'"), (None, "None")):
                        with pytest.raises(cs.InputError, match=rf"^layer: expected an int index .*got {shown}"):
                            getattr(handle, call)(bad)
                with pytest.raises(cs.InputError, match="got float"):
                    handle.layer(2.0, wait=False)
            assert load.ready(5) and load.layer(5, wait=False)[0].shape == (1, H, 3 * BLOCK, D)
            # integers of the kinds page ids are taken as name their layer (a numpy int was refused)
            for index in (np.int64(2), torch.tensor(2), np.uint8(2)):
                load.wait(index)
                assert load.ready(index) and load.layer(index)[0] is load.layer(2)[0]


@pytest.mark.parametrize("into", ["tensors", "pages"])
def test_a_load_dropped_unclosed_gives_its_frames_back_and_decodes_no_more(into, monkeypatch):
    """A forward that raised after layer 0 drops its handle without ``close()``: the CPU-tier
    frames it leased and its staging are given back, and the groups left are not decoded."""
    decoded = []
    real = LayerwiseDecoder._decode_layers
    monkeypatch.setattr(LayerwiseDecoder, "_decode_layers",
                        lambda self, views, l0, l1, n: decoded.append(l0) or real(self, views, l0, l1, n))
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4, device=DEVICE)
        T = 3 * BLOCK
        pages, _ = engine_pages("flash", L, H, D, 12, 16, DTYPE)

        def leases():
            return cache.store.tier("cpu").lease_stats()["leases_active"]

        if into == "pages":
            load = cache.materialize_into(toks, pages.at(list(range(7))), layerwise=True)
        else:
            load = cache.materialize(toks, DEVICE, layerwise=True)
        assert load.num_tokens == T
        load.wait(0)
        if not torch.cuda.is_available():  # (on a GPU the last copy may have landed and its frames gone back)
            assert leases() > 0
        del load
        gc.collect()
        assert leases() == 0
        assert staging_pool(torch.device(DEVICE)).stats()["leases_active"] == 0
        if not torch.cuda.is_available():  # decoded lazily: the group waited for, nothing after it
            assert decoded == [0]
        # what the frames held is intact: the next load is whole
        want = cache.materialize(toks, DEVICE)
        with cache.materialize(toks, DEVICE, layerwise=True) as again:
            assert torch.equal(again.layer(L - 1)[1], want.layers[L - 1][1])
        assert leases() == 0


def _dropped_in_a_cycle(make) -> None:
    """What a consumer whose forward raised leaves: its handle held only by a cycle (the
    exception it kept in a local, whose traceback holds the frame that holds both)."""

    def forward():
        handle = make()  # noqa: F841 - held by the frame alone
        try:
            raise RuntimeError("forward failed")
        except RuntimeError as exc:
            error = exc  # noqa: F841 - the cycle: frame -> error -> traceback -> frame
        return None

    forward()


@pytest.mark.parametrize("handle", ["load", "save"])
def test_a_handle_the_garbage_collector_finalizes_inside_a_tier_call_does_not_deadlock(handle, monkeypatch):
    """A load or save dropped in a reference cycle is finalized by the cyclic collector, in
    whichever thread allocates when it runs: one inside a CPU-tier call, holding the tier's
    lock, which the handle's ``__del__`` took again to give its frames or slots back. That
    thread hung, and every call on the tier after it. The release is handed to a thread of
    its own there; the memory still comes back."""
    from cacheseek.store.lease import finalizer

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    with make_cache(INT4) as cache:
        toks, kv = stored(cache, INT4)
        cpu = cache.store.tier("cpu")

        def load():
            got = cache.materialize(toks, "cpu", layerwise=True)
            got.wait(0)
            assert cpu.lease_stats()["leases_active"] > 0
            return got

        def save():
            writer = cache.ingest_layerwise(tokens_for(9, 4 * BLOCK))
            writer.put_layer(0, *make_kv(4 * BLOCK, 9, LAYOUT)[0])
            assert writer.mode == "slots" and reservation_bytes(cache) > 0
            return writer

        enabled = gc.isenabled()
        gc.disable()
        try:
            _dropped_in_a_cycle(load if handle == "load" else save)

            def collect_inside_a_tier_call():  # as a collection an allocation there triggers
                with cpu._lock:
                    gc.collect()

            collector = threading.Thread(target=collect_inside_a_tier_call, daemon=True)
            collector.start()
            collector.join(10)
            assert not collector.is_alive(), "the collector's thread deadlocked on the tier's lock"
        finally:
            if enabled:
                gc.enable()
        assert finalizer.settle(30)
        assert cpu.lease_stats()["leases_active"] == 0 and reservation_bytes(cache) == 0
        assert cache.materialize(toks).num_tokens == 3 * BLOCK  # (the tier answers)


@pytest.mark.parametrize("into", ["tensors", "pages"])
def test_a_load_whose_first_frame_cannot_be_taken_gives_it_back(into, monkeypatch):
    """The decoder's staging, laid out at the first frame, cannot be had (out of memory): the
    load raises, and that frame, leased from the CPU tier and taken by no list yet, goes back
    with the rest (its slot was leased for good: never evicted, never reused)."""
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4, device=DEVICE)
        want = cache.materialize(toks, DEVICE)
        pages, _ = engine_pages("flash", L, H, D, 12, 16, DTYPE)

        def out_of_memory(self, meta):
            raise RuntimeError("injected: out of memory for the staging")

        monkeypatch.setattr(LayerwiseDecoder, "_start", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            if into == "pages":
                cache.materialize_into(toks, pages.at(list(range(7))), layerwise=True)
            else:
                cache.materialize(toks, DEVICE, layerwise=True)
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0
        monkeypatch.undo()
        with cache.materialize(toks, DEVICE, layerwise=True) as again:
            assert torch.equal(again.layer(L - 1)[1], want.layers[L - 1][1])
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0


def decode_failing_from(layer: int):
    """``LayerwiseDecoder._decode_layers`` that raises for every group from ``layer`` on."""
    real = LayerwiseDecoder._decode_layers

    def decode(self, views, l0, l1, n):
        if l0 >= layer:
            raise RuntimeError("device lost")
        return real(self, views, l0, l1, n)
    return decode


def test_a_load_that_fails_part_way_raises_on_wait_for_what_is_missing(monkeypatch):
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4)
        want = cache.materialize(toks)
        monkeypatch.setattr(LayerwiseDecoder, "_decode_layers", decode_failing_from(1))
        load = cache.materialize(toks, layerwise=True)
        k, _ = load.layer(0)  # loaded before the failure: good
        assert torch.equal(k, want.layers[0][0])
        with pytest.raises(cs.LoadError, match="layer 1 .*device lost.*recompute"):
            load.wait(1)
        with pytest.raises(cs.LoadError):
            load.layer(5)
        assert isinstance(load.error, RuntimeError) and not load.done() and not load.ready(4)
        load.close()
        monkeypatch.undo()
        # the store is untouched: the next load is whole
        with cache.materialize(toks, layerwise=True) as again:
            assert torch.equal(again.layer(5)[1], want.layers[5][1])


def _decodes_held(monkeypatch, hold_group: int, *, until: threading.Event):
    """``_decode_layers`` that records (l0, staging still lent) per decode, and holds the
    first decode of ``hold_group`` (after setting ``holding``) until ``until`` is set or
    0.5 s passed: bounded, not a synchronization (a close in another thread either ran
    meanwhile, the race, or waits for this decode to end)."""
    real = LayerwiseDecoder._decode_layers
    decoded: list[tuple[int, bool]] = []
    holding = threading.Event()

    def decode(self, views, l0, l1, n):
        if l0 == LAYOUT_GROUPS[hold_group][0] and not holding.is_set():
            holding.set()
            until.wait(0.5)
        decoded.append((l0, self._lease is not None))
        return real(self, views, l0, l1, n)

    monkeypatch.setattr(LayerwiseDecoder, "_decode_layers", decode)
    return decoded, holding


LAYOUT_GROUPS = layer_groups(L)  # (0, 1) (1, 3) (3, 6)


def test_a_close_from_another_thread_while_the_consumer_waits_lets_the_decode_finish(monkeypatch):
    """On a CPU a consumer's ``wait`` decodes the group in its own thread. A ``close()`` from
    another thread meanwhile (a server shutting a request down) ran the same groups again
    beside it and gave the staging buffer and the frames back while the consumer's decode
    still read them: the buffer went back to the pool (the next load's, reused under the
    decode). Now the close waits for the decode in flight; every group is decoded once,
    with its staging still lent, and the consumer's layers are whole."""
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4)
        want = cache.materialize(toks)
        closed = threading.Event()
        decoded, holding = _decodes_held(monkeypatch, 1, until=closed)
        load = cache.materialize(toks, layerwise=True)
        load.wait(0)
        consumer = threading.Thread(target=load.wait, args=(2,))
        consumer.start()
        assert holding.wait(30)
        closer = threading.Thread(target=lambda: (load.close(), closed.set()))
        closer.start()
        consumer.join(30)
        closer.join(30)
        assert not consumer.is_alive() and not closer.is_alive()
        assert decoded == [(0, True), (1, True), (3, True)], decoded  # once each, staging lent
        k, v = load.layer(2)
        assert torch.equal(k, want.layers[2][0]) and torch.equal(v, want.layers[2][1])
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0
        assert cache.store.tier("cpu").lease_stats()["lease_double_releases"] == 0
        assert staging_pool(torch.device("cpu")).stats()["leases_active"] == 0


def test_two_closes_at_once_finish_the_load_once_and_neither_raises(monkeypatch):
    """``close()`` checked ``_closed`` and set it only at its end: two threads closing one
    load (a consumer's ``with`` and a shutdown) both ran the groups left, and both gave the
    frames and the staging back, the second raising ``LeaseError`` (or releasing a lease
    the first had given back). Now one close finishes the load; the other waits for it."""
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4)
        want = cache.materialize(toks)
        first_done = threading.Event()
        decoded, holding = _decodes_held(monkeypatch, 1, until=first_done)
        load = cache.materialize(toks, layerwise=True)
        errors: list[BaseException] = []

        def close() -> None:
            try:
                load.close()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)
            first_done.set()

        first = threading.Thread(target=close)
        first.start()
        assert holding.wait(30)
        second = threading.Thread(target=close)
        second.start()
        first.join(30)
        second.join(30)
        assert not first.is_alive() and not second.is_alive()
        assert errors == [], errors
        assert [l0 for l0, _ in decoded] == [0, 1, 3] and all(lent for _, lent in decoded), decoded
        assert torch.equal(load.layer(5)[1], want.layers[5][1])
        stats = cache.store.tier("cpu").lease_stats()
        assert stats["leases_active"] == 0 and stats["lease_double_releases"] == 0, stats
        assert staging_pool(torch.device("cpu")).stats()["leases_active"] == 0


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_an_eager_load_has_every_layer_issued_before_the_handle_returns(codec, monkeypatch):
    """The GPU default: every group queued at once (here: decoded at once, on the CPU)."""
    monkeypatch.setitem(layerwise.ISSUE, "cpu", "eager")
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec)
        want = cache.materialize(toks)
        with cache.materialize(toks, layerwise=True) as load:
            assert all(load.ready(i) for i in range(load.num_layers))  # nobody waited for any
            for i in range(load.num_layers):
                k, v = load.layer(i)
                assert torch.equal(k, want.layers[i][0]) and torch.equal(v, want.layers[i][1])


def test_an_unknown_issue_mode_is_a_config_error(monkeypatch):
    monkeypatch.setitem(layerwise.ISSUE, "cpu", "sideways")
    codec = CODECS[0]
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec)
        with pytest.raises(cs.ConfigError, match="sideways"):
            cache.materialize(toks, layerwise=True)
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0  # nothing left lent


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: compiled kernels take no CPU tensors "
                    "(on a GPU, test_cuda_layer_groups_of_cpu_frames_are_copied_apart runs this path)")
@pytest.mark.parametrize("issue", ["eager", "lazy"])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_layer_groups_read_by_one_kernel_load_the_same_bytes(codec, issue, monkeypatch):
    """The GPU path for CPU-tier frames (each group's slices of every frame read in place
    by ``kernels.copy_ranges``), run here by Triton's interpreter on CPU tensors."""
    monkeypatch.setattr(layerwise, "GATHER_ON_CPU", True)
    monkeypatch.setitem(layerwise.ISSUE, "cpu", issue)
    calls = []
    real = layerwise.LayerwiseDecoder._gather_group
    monkeypatch.setattr(layerwise.LayerwiseDecoder, "_gather_group", lambda self, g: calls.append(g) or real(self, g))
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec)
        want = cache.materialize(toks)
        with cache.materialize(toks, layerwise=True) as load:
            for i in reversed(range(L)):  # any order of waits
                k, v = load.layer(i)
                assert torch.equal(k, want.layers[i][0]) and torch.equal(v, want.layers[i][1])
        assert sorted(calls) == list(range(len(layer_groups(L))))  # every group, the first too, by the kernel
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0


@pytest.fixture
def background(monkeypatch):
    """Groups 1.. issued by the load's own thread, as on a GPU (here it decodes them)."""
    monkeypatch.setitem(layerwise.ISSUE, "cpu", "background")


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_a_background_issuer_loads_the_same_bytes_under_the_callers_modes(codec, background):
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec)
        want = cache.materialize(toks)
        with torch.inference_mode():  # the outputs are inference tensors: the issuer writes them in that mode
            load = cache.materialize(toks, layerwise=True)
            assert load.ready(0)  # group 0 is issued (here: decoded) before the handle is returned
            for i in reversed(range(L)):  # any order: a wait blocks until the issuer got there
                k, v = load.layer(i)
                assert torch.equal(k, want.layers[i][0]) and torch.equal(v, want.layers[i][1])
            load.close()
        assert load.done() and not load._worker.is_alive()
        assert [t.layer for t in load.timeline()] == list(range(L))


def test_a_background_issuer_that_fails_marks_the_load_and_never_hangs(background, monkeypatch):
    with make_cache(INT4) as cache:
        toks, _ = stored(cache, INT4)
        want = cache.materialize(toks)
        monkeypatch.setattr(LayerwiseDecoder, "_decode_layers", decode_failing_from(3))
        load = cache.materialize(toks, layerwise=True)
        assert torch.equal(load.layer(2)[0], want.layers[2][0])  # groups 0 and 1 loaded
        with pytest.raises(cs.LoadError, match="layer 5 .*device lost"):
            load.wait(5)
        assert not load.done()
        load.close()
        monkeypatch.undo()
        with cache.materialize(toks, layerwise=True) as again:  # the frames were given back
            assert torch.equal(again.layer(5)[1], want.layers[5][1])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_a_frame_is_cut_into_one_piece_per_buffer_and_layer_group(codec):
    """What a GPU copies of a CPU-tier frame per layer group: exactly that group's layers of
    every buffer, and all groups together the whole payload."""
    from cacheseek.store.device import as_host_tensor

    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec)
        frame, _ = cache.store.get_many(cache.block_hashes(toks)[:1])[0]
        groups = layer_groups(L)
        dec = LayerwiseDecoder(cache.block_format, 1, torch.device("cpu"), groups)
        n = frame.meta.payload_nbytes
        payload = as_host_tensor(frame.payload_view())[:n].clone()
        dec.add(frame, split=True)  # group 0 copied now, the rest when its group runs
        dec.seal()
        row = dec._staging[0][:n]
        copied = torch.zeros(n, dtype=torch.bool)
        for g, (l0, l1) in enumerate(groups):
            if g:
                dec._copy_group(g)
            for e in frame.meta.tensors:
                per = e.nbytes // L
                copied[e.offset + l0 * per : e.offset + l1 * per] = True
            assert len(dec._plans[g][1]) == len(frame.meta.tensors)  # one piece per buffer
            assert torch.equal(row[copied], payload[copied])
        dec.release_all()
        assert copied.all() or not payload[~copied].any()  # (gaps between buffers, if any, are zeros)


# -- into an engine's pages ------------------------------------------------------------------


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("codec", [*CODECS, ROTATED], ids=lambda c: c.name + ("-rot" if getattr(c, "v_rotate", False) else ""))
def test_layerwise_into_pages_writes_what_materialize_into_writes_layer_by_layer(codec, kernels, monkeypatch):
    # The Triton kernels (interpreted on a CPU), a layer range per launch; or the torch
    # fallback, named so that a GPU's default (the kernels) does not take over.
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton" if kernels else "torch")
    page, num_pages = 16, 24
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec, device=DEVICE)  # the KV where the pages are: the kernels encode it
        T = 3 * BLOCK + 7
        ids = page_tables([T], page, num_pages, seed=2)[0]
        normal, normal_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=4)
        lw, lw_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=4)
        before = snapshot(lw_t)
        got = cache.materialize_into(toks, normal.at(ids))
        load = cache.materialize_into(toks, lw.at(ids), layerwise=True)
        assert (load.num_tokens, load.num_blocks, load.tiers) == (got.num_tokens, got.num_blocks, got.tiers)
        assert load.requests == [got]
        if not torch.cuda.is_available():  # decoded on wait: layer 0's pages only so far
            load.wait(0)
            assert torch.equal(lw_t[0], normal_t[0]) and unchanged(before[1:], lw_t[1:])
        for i in range(L):
            load.wait(i)
        load.close()
        assert unchanged(normal_t, lw_t)
        with pytest.raises(RuntimeError, match="engine's pages"):
            load.layer(0)
        # The tables the kernels keep are made on the caller's stream (``seal``), before any
        # decode on the load's own stream; the torch fallback has none to make.
        fresh, _ = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=4)
        sink = paged_io.PageSink(codec, types.SimpleNamespace(pages=fresh, kernel_pages=fresh.kernel_pages))
        sink.prepare()
        assert bool(fresh._kernel_pages) == kernels


def test_layerwise_batch_into_pages_equals_the_batch():
    page, num_pages = 8, 64
    with make_cache(INT4) as cache:
        a, _ = stored(cache, INT4, T=2 * BLOCK, seed=1)
        b, _ = stored(cache, INT4, T=3 * BLOCK + 1, seed=2)
        miss = tokens_for(77, BLOCK)
        tables = page_tables([2 * BLOCK, 3 * BLOCK + 1, BLOCK], page, num_pages, seed=6)
        reqs = [cs.PagedRequest(k, t) for k, t in zip((a, b, miss), tables)]
        normal, normal_t = engine_pages("nhd", L, H, D, num_pages, page, DTYPE, seed=1)
        lw, lw_t = engine_pages("nhd", L, H, D, num_pages, page, DTYPE, seed=1)
        want = cache.materialize_into_batch(reqs, normal)
        with cache.materialize_into_batch(reqs, lw, layerwise=True) as load:
            assert load.requests == want and load.num_blocks == 5
            load.synchronize()
        assert unchanged(normal_t, lw_t)


@pytest.mark.parametrize("page", [1, 8, 16, 32])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_layerwise_batch_from_start_equals_the_whole_load_from_start(codec, page):
    """Requests whose first blocks are in their pages already (``start``, an engine's own
    prefix hit): the layer-wise load writes blocks ``[start, end)`` only, the same bytes as
    the whole load, and leaves the pages before ``start`` (and every other page) alone."""
    num_pages = 16 * BLOCK // page
    with make_cache(codec) as cache:
        a, _ = stored(cache, codec, T=4 * BLOCK, seed=1)
        b, _ = stored(cache, codec, T=3 * BLOCK + 1, seed=2)
        c, _ = stored(cache, codec, T=2 * BLOCK, seed=3)
        sizes = [4 * BLOCK, 3 * BLOCK + 1, 2 * BLOCK, 2 * BLOCK]
        tables = page_tables(sizes, page, num_pages, seed=page)
        # a from block 2, b from block 1 (ending at block 3: max_tokens), c all of it from
        # block 0, and one whose start is past what is stored (nothing to write): c's first
        # block and one never stored (keys shorter than the start are refused).
        reqs = [cs.PagedRequest(a, tables[0], start=2 * BLOCK),
                cs.PagedRequest(b, tables[1], max_tokens=3 * BLOCK, start=BLOCK),
                cs.PagedRequest(c, tables[2]),
                cs.PagedRequest(c[:BLOCK] + tokens_for(99, BLOCK), tables[3], start=2 * BLOCK)]
        normal, normal_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=5)
        lw, lw_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=5)
        before = snapshot(lw_t)
        want = cache.materialize_into_batch(reqs, normal)
        assert [(x.num_blocks, len(x.tiers)) for x in want] == [(4, 4), (3, 3), (2, 2), (1, 1)]
        with cache.materialize_into_batch(reqs, lw, layerwise=True) as load:
            assert load.requests == want and load.num_blocks == 10
            for i in range(L):
                load.wait(i)
        assert unchanged(normal_t, lw_t)
        # what was written: exactly the pages of blocks [start, end) (the pages were random)
        P = BLOCK // page if page < BLOCK else 1
        written = set(tables[0][2 * P : 4 * P] + tables[1][P : 3 * P] + tables[2][: 2 * P])
        for layer, (t, b0) in enumerate(zip(lw_t, before)):
            for p in range(num_pages):
                same = torch.equal(t[:, p].view(torch.uint8), b0[:, p].view(torch.uint8))
                assert same == (p not in written), (layer, p)


def test_layerwise_from_start_that_fails_part_way_raises_for_the_layers_it_did_not_load(monkeypatch):
    """A decode that fails at layer group 1, for a batch loading from start > 0: layer 0 is
    written (and the same as the whole load's), layers of groups 1.. raise ``LoadError``, and
    ``close`` gives the store's memory back."""
    page, num_pages = 16, 32
    with make_cache(INT4) as cache:
        a, _ = stored(cache, INT4, T=3 * BLOCK, seed=1)
        table = page_tables([3 * BLOCK], page, num_pages, seed=3)[0]
        reqs = [cs.PagedRequest(a, table, start=BLOCK)]
        normal, normal_t = engine_pages("nhd", L, H, D, num_pages, page, DTYPE, seed=5)
        lw, lw_t = engine_pages("nhd", L, H, D, num_pages, page, DTYPE, seed=5)
        cache.materialize_into_batch(reqs, normal)
        before = snapshot(lw_t)
        fail_layer_group(monkeypatch, 1)
        load = cache.materialize_into_batch(reqs, lw, layerwise=True)
        load.wait(0)
        with pytest.raises(cs.LoadError, match="injected decode failure"):
            load.wait(1)
        load.close()
        for layer in range(L):  # (nhd: K of each layer, then V of each)
            if layer == 0:
                assert torch.equal(lw_t[0], normal_t[0]) and torch.equal(lw_t[L], normal_t[L])
            else:
                assert unchanged(before[layer :: L], lw_t[layer :: L])
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0  # the frames given back
        assert staging_pool(torch.device(DEVICE)).stats()["leases_active"] == 0  # and the staging


# -- ingest, layer by layer ------------------------------------------------------------------


def stored_payloads(cache, keys):
    out = []
    for got in cache.store.get_many(cache.block_hashes(keys)):
        assert got is not None
        out.append(bytes(got[0].payload_view()))
    return out


SAVE_MODES = ["slots", "reference"]


@pytest.fixture(params=SAVE_MODES)
def save_mode(request, monkeypatch):
    """Layer-wise saves both ways: into reserved slots as each layer is put (any new KV at
    all pays here), and the reference writer's (layers kept, one ingest on finish)."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0 if request.param == "slots" else 1 << 62)
    return request.param


def reservation_bytes(cache):
    return cache.stats()["tiers"][0]["reservation_bytes"]


@pytest.mark.parametrize("codec", [*CODECS, ROTATED], ids=lambda c: c.name + ("-rot" if getattr(c, "v_rotate", False) else ""))
def test_ingest_layerwise_stores_what_ingest_stores_once_every_layer_is_there(codec, save_mode):
    T = 2 * BLOCK + 5
    toks, kv = tokens_for(3, T), make_kv(T, 3, LAYOUT)
    with make_cache(codec) as normal, make_cache(codec) as lw:
        want = normal.ingest(toks, kv)
        writer = lw.ingest_layerwise(toks)
        for i in reversed(range(L)):  # any order
            writer.put_layer(i, kv[i][0][None], kv[i][1])
            assert lw.locate(toks).num_blocks == 0  # nothing visible before finish()
        assert writer.mode == save_mode
        got = writer.finish()
        assert reservation_bytes(lw) == 0
        assert (got.blocks, got.stored, got.present) == (want.blocks, want.stored, want.present)
        assert stored_payloads(lw, toks) == stored_payloads(normal, toks)
        with pytest.raises(RuntimeError, match="finished"):
            writer.put_layer(0, *kv[0])


def test_ingest_layerwise_stores_nothing_on_abort_a_missing_layer_or_bad_kv(save_mode):
    T = 2 * BLOCK
    toks, kv = tokens_for(4, T), make_kv(T, 4, LAYOUT)
    with make_cache(INT4) as cache:
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == save_mode
        writer.abort()
        assert cache.locate(toks).num_blocks == 0 and reservation_bytes(cache) == 0
        with pytest.raises(RuntimeError, match="aborted"):
            writer.finish()

        writer = cache.ingest_layerwise(toks)
        for i in range(L - 1):
            writer.put_layer(i, *kv[i])
        assert writer.missing == [L - 1]
        with pytest.raises(cs.InputError, match="layers 5 were never put"):
            writer.finish()
        assert cache.locate(toks).num_blocks == 0

        # an error inside a with block: nothing stored
        with pytest.raises(KeyError):
            with cache.ingest_layerwise(toks) as writer:
                for i in range(L):
                    writer.put_layer(i, *kv[i])
                raise KeyError("the forward failed")
        assert cache.locate(toks).num_blocks == 0

        bad = [(k.clone(), v.clone()) for k, v in kv]
        bad[3][1][0, BLOCK + 1, 0] = float("nan")
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *bad[i])
        with pytest.raises(cs.InputError, match="NaN"):
            writer.finish()
        assert cache.locate(toks).num_blocks == 0 and reservation_bytes(cache) == 0

        # keys for more tokens than the KV has: refused on the first layer, nothing taken
        writer = cache.ingest_layerwise(tokens_for(4, T + BLOCK))
        with pytest.raises(cs.InputError, match=rf"^layer 2: token_ids: {T + BLOCK} tokens, but KV holds {T}$"):
            writer.put_layer(2, *kv[2])
        assert writer.mode is None and writer.missing == list(range(L))
        writer.abort()

        # bad layers are refused one by one, and the writer stays usable
        writer = cache.ingest_layerwise(toks)
        for bad in (6, -1):
            with pytest.raises(cs.InputError, match=rf"^layer: {bad} is outside the layout's 6 layers \(0 to 5\)"):
                writer.put_layer(bad, *kv[0])
        # named as a load's layers are (a numpy int was called "outside" the layers)
        for bad, shown in ((True, "bool True"), (1.0, "float 1.0"), (torch.tensor(1.0), "Tensor"),
                           (torch.tensor(True), "Tensor"), (np.float32(1), "float32"), ("1", "str '1'")):
            with pytest.raises(cs.InputError, match=rf"^layer: expected an int index of one of the 6 layers .*got {shown}"):
                writer.put_layer(bad, *kv[0])
        with pytest.raises(cs.InputError, match="heads"):
            writer.put_layer(0, kv[0][0][:1], kv[0][1][:1])
        with pytest.raises(cs.InputError, match="dtype"):
            writer.put_layer(0, kv[0][0].float(), kv[0][1].float())
        writer.put_layer(0, *kv[0])
        with pytest.raises(cs.InputError, match="put twice"):
            writer.put_layer(0, *kv[0])
        with pytest.raises(cs.InputError, match="tokens"):
            writer.put_layer(1, kv[1][0][:, :BLOCK], kv[1][1][:, :BLOCK])
        for i in range(1, L):  # (any integer kind a page id may be: a numpy int, a 0-d tensor)
            writer.put_layer((int, np.int64, torch.tensor)[i % 3](i), *kv[i])
        assert writer.finish().stored == 2
        with pytest.raises(cs.InputError, match="empty"):
            cache.ingest_layerwise([])


def test_an_abort_from_another_thread_waits_for_the_layer_being_written_into_the_slots(monkeypatch):
    """``abort()`` from another thread (a shutdown) while ``put_layer`` encoded a layer into
    the reserved slots gave the slots back under it: the encode went on writing into memory
    the tier could lend the next writer (a block stored by it then holds this layer's
    bytes). Now the abort waits for the layer in flight, then gives the slots back, and the
    writer takes no more layers."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 2 * BLOCK
    toks, kv = tokens_for(6, T), make_kv(T, 6, LAYOUT)
    real = layerwise_save.encode_into
    aborted, holding = threading.Event(), threading.Event()
    held_while_written: list[int] = []

    with make_cache(INT4) as cache:
        def encode(*args, **kw):
            if not holding.is_set():
                holding.set()
                aborted.wait(0.5)  # bounded, not a synchronization: the abort ran (the race) or waits
            held_while_written.append(reservation_bytes(cache))
            return real(*args, **kw)

        writer = cache.ingest_layerwise(toks)
        writer.put_layer(0, *kv[0])
        assert writer.mode == "slots" and reservation_bytes(cache) > 0
        monkeypatch.setattr(layerwise_save, "encode_into", encode)
        putter = threading.Thread(target=writer.put_layer, args=(1, *kv[1]))
        putter.start()
        assert holding.wait(30)
        aborter = threading.Thread(target=lambda: (writer.abort(), aborted.set()))
        aborter.start()
        putter.join(30)
        aborter.join(30)
        assert not putter.is_alive() and not aborter.is_alive()
        assert held_while_written and all(n > 0 for n in held_while_written), held_while_written
        assert reservation_bytes(cache) == 0 and cache.locate(toks).num_blocks == 0
        with pytest.raises(RuntimeError, match="aborted"):
            writer.put_layer(2, *kv[2])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_a_layerwise_save_takes_kv_that_requires_grad_as_ingest_does(codec, save_mode):
    """KV from a forward run without ``no_grad`` requires grad: ``ingest`` stores it, and a
    save into slots raised from the encode's in-place steps (a leaf that requires grad),
    out of the forward that put the layer."""
    T = 2 * BLOCK
    toks, kv = tokens_for(5, T), make_kv(T, 5, LAYOUT)
    grad = [(k.float().requires_grad_().to(DTYPE), v.float().requires_grad_().to(DTYPE)) for k, v in kv]
    with make_cache(codec) as cache, make_cache(codec) as normal:
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *grad[i])
        assert writer.mode == save_mode
        assert writer.finish().stored == 2 and reservation_bytes(cache) == 0
        assert normal.ingest(toks, grad).stored == 2
        assert stored_payloads(cache, toks) == stored_payloads(normal, toks)


def test_a_layerwise_save_stores_only_new_blocks_and_gives_its_slots_back_when_dropped(monkeypatch):
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 4 * BLOCK
    toks, kv = tokens_for(6, T), make_kv(T, 6, LAYOUT)
    with make_cache(INT4) as cache, make_cache(INT4) as normal:
        assert cache.ingest(toks[: 2 * BLOCK], [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv]).stored == 2
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == "slots" and reservation_bytes(cache) > 0
        got = writer.finish()
        assert (got.blocks, got.stored, got.present, got.failed) == (4, 2, 2, 0)
        normal.ingest(toks, kv)
        assert stored_payloads(cache, toks) == stored_payloads(normal, toks)

        # a forward that raises leaves its writer unfinished: dropping it gives the slots back
        other = tokens_for(7, T)
        writer = cache.ingest_layerwise(other)
        writer.put_layer(0, *kv[0])
        assert reservation_bytes(cache) > 0
        del writer
        assert reservation_bytes(cache) == 0 and cache.locate(other).num_blocks == 0
        # nothing new at all: nothing reserved, the result says present
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == "reference" and writer.finish().present == 4


@pytest.mark.parametrize("paged", [False, True])
def test_a_save_stores_again_a_block_found_stored_and_deleted_while_it_ran(monkeypatch, paged):
    """A block stored when the save started gets no slot; deleted (or evicted) while the
    forward ran, it was counted present and left missing: the chain's blocks published after
    it were behind a gap, and no lookup found any of them. It is stored again on finish."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 4 * BLOCK
    toks, kv = tokens_for(6, T), make_kv(T, 6, LAYOUT)
    with make_cache(INT4) as cache, make_cache(INT4) as normal:
        head = [(k[:, : 2 * BLOCK], v[:, : 2 * BLOCK]) for k, v in kv]
        assert cache.ingest(toks[: 2 * BLOCK], head).stored == 2
        if paged:
            pages, _ = engine_pages("flash", L, H, D, 8, 16, DTYPE)
            ids = page_tables([T], 16, 8, seed=1)[0]
            write_tokens(pages, kv, ids)
            writer = cache.ingest_batch([cs.PagedRequest(toks, ids)], pages, layerwise=True)
            put = writer.put_layer
        else:
            writer = cache.ingest_layerwise(toks)
            put = lambda i: writer.put_layer(i, *kv[i])  # noqa: E731
        put(0)
        assert writer.mode == "slots"
        assert cache.store.delete(cache.block_hashes(toks)[0])
        for i in range(1, L):
            put(i)
        got = writer.finish()
        got = got[0] if paged else got
        assert (got.blocks, got.stored, got.present, got.failed) == (4, 3, 1, 0)
        assert cache.locate(toks).num_blocks == 4 and reservation_bytes(cache) == 0
        normal.ingest(toks, kv)
        assert stored_payloads(cache, toks) == stored_payloads(normal, toks)


def test_a_layerwise_save_into_a_full_tier_stores_what_did_not_fit_on_finish(monkeypatch):
    """A full tier lends a save only its reserve: the blocks that got no slot are ingested
    on finish, and the chain is stored whole, the same bytes as a plain ingest."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 8 * BLOCK
    frame = make_cache(INT4).block_format.planned_payload().nbytes
    tiers = {"cpu_bytes": 24 * frame, "cpu_reserve_bytes": 3 * frame}
    with make_cache(INT4, **tiers) as cache, make_cache(INT4) as normal:
        for seed in (20, 21, 22):  # fill the tier: every new block now evicts
            cache.ingest(tokens_for(seed, T), make_kv(T, seed, LAYOUT))
        toks, kv = tokens_for(8, T), make_kv(T, 8, LAYOUT)
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == "slots" and 0 < sum(len(r.metas) for r in writer._runs) < 8
        got = writer.finish()
        assert (got.stored, got.present, got.failed) == (8, 0, 0)
        assert cache.locate(toks).num_blocks == 8 and reservation_bytes(cache) == 0
        normal.ingest(toks, kv)
        assert stored_payloads(cache, toks) == stored_payloads(normal, toks)


def test_a_layerwise_save_into_a_fragmented_tier_takes_its_longest_runs(monkeypatch):
    """Memory in pieces (no run of more than four slots here): the save takes the longest run
    each time, so its ten blocks go in three runs, not in runs halved until one fits."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 10 * BLOCK
    toks, kv = tokens_for(9, T), make_kv(T, 9, LAYOUT)
    with make_cache(INT4) as cache, make_cache(INT4) as normal:
        frame = cache.block_format.plan_run(0, cache.block_hashes(toks), [b""] * 10)[-1].nbytes
        cache.store.tiers[0]._arena.chunk_bytes = 4 * slot_stride(frame)
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == "slots" and [len(r.metas) for r in writer._runs] == [4, 4, 2]
        assert writer.finish().stored == 10 and reservation_bytes(cache) == 0
        normal.ingest(toks, kv)
        assert stored_payloads(cache, toks) == stored_payloads(normal, toks)


@pytest.mark.parametrize("paged", [False, True])
def test_a_save_into_a_tier_smaller_than_its_chain_counts_each_block_once(monkeypatch, paged):
    """The slots' commits evict one another's blocks (three frames of room, eight new
    blocks), and the ingest of the blocks without a slot stores those again: they were
    counted stored by both, 9 stored and -1 present of 8 blocks."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 8 * BLOCK + 5
    frame = make_cache(INT4).block_format.planned_payload().nbytes
    with make_cache(INT4, cpu_bytes=3 * frame) as cache, make_cache(INT4, cpu_bytes=3 * frame) as normal:
        toks, kv = tokens_for(9, T), make_kv(T, 9, LAYOUT, device=DEVICE)
        writer = _layerwise_save(cache, toks, kv, paged)
        assert writer.mode == "slots"
        got = writer.finish()[0] if paged else writer.finish()
        want = normal.ingest(toks, kv)
        assert (want.blocks, want.stored, want.present, want.failed) == (8, 8, 0, 0)
        assert (got.blocks, got.stored, got.present, got.failed) == (8, 8, 0, 0)
        assert reservation_bytes(cache) == 0


def _layerwise_save(cache, toks, kv, paged):
    """A layer-wise save of ``kv`` with every layer put, not finished: from vLLM-layout pages
    (one request, 16-token pages) when ``paged``, else from the layers."""
    if paged:
        pages, _ = engine_pages("flash", L, H, D, 24, 16, DTYPE)
        ids = page_tables([len(toks)], 16, 24, seed=1)[0]
        write_tokens(pages, kv, ids)
        writer = cache.ingest_batch([cs.PagedRequest(toks, ids)], pages, layerwise=True)
        for i in range(L):
            writer.put_layer(i)
    else:
        writer = cache.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
    return writer


def _save_with_its_tail_in_slots(cache, toks, kv, paged):
    """A layer-wise save of ``kv`` (8 blocks) into a tier filled first, so that it gets slots
    for its tail only (its head is ingested on finish); every layer put, not finished."""
    T = len(toks)
    for seed in (20, 21, 22):
        cache.ingest(tokens_for(seed, T), make_kv(T, seed, LAYOUT))
    writer = _layerwise_save(cache, toks, kv, paged)
    assert writer.mode == "slots" and 0 < sum(len(r.metas) for r in writer._runs) < 8
    return writer


@pytest.mark.parametrize("paged", [False, True])
def test_a_save_whose_commit_fails_for_a_block_counts_it_once(tmp_path, monkeypatch, paged):
    """A full tier: the tail gets slots, the head is ingested on finish. A slot's commit
    whose write through to the disk failed counted the block failed, and that ingest, which
    writes such a block again, counted it failed once more: failed 2 of 1, present -1."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 8 * BLOCK
    frame = make_cache(cs.Raw()).block_format.planned_payload().nbytes
    with make_cache(cs.Raw(), cpu_bytes=24 * frame, cpu_reserve_bytes=3 * frame, disk_path=tmp_path / "d") as cache:
        toks, kv = tokens_for(8, T), make_kv(T, 8, LAYOUT)
        writer = _save_with_its_tail_in_slots(cache, toks, kv, paged)
        tail = cache.block_hashes(toks)[-1]  # in a slot
        fail_disk_writes(monkeypatch, [tail])
        got = writer.finish()
        got = got[0] if paged else got
        assert (got.stored, got.present, got.failed) == (7, 0, 1) and "Input/output error" in got.errors["disk"]
        monkeypatch.undo()
        assert cache.store.present_many(cache.block_hashes(toks)) == [True] * 7 + [False]


@pytest.mark.parametrize("paged", [False, True])
def test_a_nan_in_a_block_that_got_no_slot_stores_nothing(monkeypatch, paged):
    """The blocks without a slot are checked by the ingest on finish, after the slots' blocks
    were published: a NaN there deletes them again, so the save stores nothing."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "torch")
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 8 * BLOCK
    frame = make_cache(INT4).block_format.planned_payload().nbytes
    with make_cache(INT4, cpu_bytes=24 * frame, cpu_reserve_bytes=3 * frame) as cache:
        toks, kv = tokens_for(8, T), make_kv(T, 8, LAYOUT)
        kv[2][1][0, 3, 0] = float("nan")  # block 0: the head, which gets no slot
        writer = _save_with_its_tail_in_slots(cache, toks, kv, paged)
        with pytest.raises(cs.InputError, match="NaN or Inf"):
            writer.finish()
        assert not any(cache.store.present_many(cache.block_hashes(toks)))
        assert reservation_bytes(cache) == 0


def test_a_paged_save_counts_a_block_two_requests_share_as_its_one_write_ended(tmp_path, monkeypatch, save_mode):
    """Two requests with one prefix: its block gets one slot (or one put), for the first,
    and the second counted it present before the commit. A commit whose write through to
    the disk failed left the second's result saying the block was stored."""
    T, page = 2 * BLOCK, 16
    shared = tokens_for(90, BLOCK)
    toks = [shared + tokens_for(91, BLOCK), shared + tokens_for(92, BLOCK)]
    kvs = [make_kv(T, 90, LAYOUT), make_kv(T, 91, LAYOUT)]
    for (k0, v0), (k1, v1) in zip(*kvs):  # one prefix: the same tokens, the same KV
        k1[:, :BLOCK], v1[:, :BLOCK] = k0[:, :BLOCK], v0[:, :BLOCK]
    pages, _ = engine_pages("flash", L, H, D, 8, page, DTYPE)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    with make_cache(cs.Raw(), disk_path=tmp_path / "d") as cache:
        head = cache.block_hashes(shared)[0]
        writer = cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages,
                                    layerwise=True)
        for i in range(L):
            writer.put_layer(i)
        assert writer.mode == save_mode
        fail_disk_writes(monkeypatch, [head])
        got = writer.finish()
        assert [(r.stored, r.present, r.failed) for r in got] == [(1, 0, 1), (1, 0, 1)]
        assert all("Input/output error" in r.errors["disk"] for r in got)
        assert reservation_bytes(cache) == 0


def test_a_layerwise_save_takes_every_kind_of_keys(monkeypatch):
    """Keys as bytes per block (world models) and as a ``cs.Prompt`` with extra keys: the
    same blocks as ``ingest`` of those keys."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 2 * BLOCK
    kv = make_kv(T, 13, LAYOUT)
    for keys in ([b"frame-0", b"frame-1+action"], cs.Prompt(tokens_for(13, T), lora_id="sql", cache_salt="t")):
        with make_cache(INT4) as lw, make_cache(INT4) as normal:
            writer = lw.ingest_layerwise(keys)
            for i in range(L):
                writer.put_layer(i, *kv[i])
            assert writer.mode == "slots" and writer.finish().stored == 2
            assert normal.ingest(keys, kv).stored == 2
            assert stored_payloads(lw, keys) == stored_payloads(normal, keys)


def test_a_layerwise_save_under_a_precision_policy_stores_each_position_in_its_codec(monkeypatch):
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    policy = cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32), rest=INT4, first_blocks=1)
    T = 3 * BLOCK
    toks, kv = tokens_for(9, T), make_kv(T, 9, LAYOUT)
    with make_cache(policy) as lw, make_cache(policy) as normal:
        writer = lw.ingest_layerwise(toks)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.mode == "slots" and len(writer._runs) == 2
        assert writer.finish().stored == 3
        normal.ingest(toks, kv)
        assert stored_payloads(lw, toks) == stored_payloads(normal, toks)


@pytest.mark.parametrize("kind", ["flash", "hnd"])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_a_paged_layerwise_save_stores_what_ingest_batch_stores(codec, kind, save_mode):
    """Three requests in an engine's pages (one sharing another's first block, one whose
    first block is stored already): ``ingest_batch(..., layerwise=True)``, a layer put as
    each is written, stores what ``ingest_batch`` does; a NaN in one request's pages names
    it, and nothing of the call is stored."""
    paged_save_case(codec, kind, save_mode, bad_input=True)


def test_a_paged_layerwise_save_through_the_triton_encode(monkeypatch):
    """The same into slots with the paged encode kernel writing each layer (on a CPU, in the
    interpreter, straight into the slots). The reference writer is ``ingest_batch``, whose
    kernels test_paged.py runs; the bad input is the same code either way, and the
    interpreter is slow."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    paged_save_case(INT4, "flash", "slots", bad_input=False)


def paged_save_case(codec, kind, save_mode, *, bad_input):
    page, num_pages = 16, 48
    sizes = [2 * BLOCK + 7, 3 * BLOCK, 2 * BLOCK]
    toks = [tokens_for(40 + r, n) for r, n in enumerate(sizes)]
    toks[2][:BLOCK] = toks[0][:BLOCK]
    kvs = [make_kv(n, 40 + r, LAYOUT, device=DEVICE) for r, n in enumerate(sizes)]
    for layer in range(L):
        for side in (0, 1):
            kvs[2][layer][side][:, :BLOCK] = kvs[0][layer][side][:, :BLOCK]
    tables = page_tables(sizes, page, num_pages, seed=5)
    pages, _ = engine_pages(kind, L, H, D, num_pages, page, DTYPE)
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    requests = [cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)]
    with make_cache(codec) as lw, make_cache(codec) as normal:
        for cache in (lw, normal):
            cache.ingest(toks[1][:BLOCK], [(k[:, :BLOCK], v[:, :BLOCK]) for k, v in kvs[1]])
        writer = lw.ingest_batch(requests, pages, layerwise=True)
        assert writer.mode == save_mode
        for i in range(L):
            writer.put_layer(i)
            assert lw.locate(toks[0]).num_blocks == 0
        got = writer.finish()
        want = normal.ingest_batch(requests, pages)
        assert [(r.blocks, r.stored, r.present, r.failed) for r in got] == \
            [(r.blocks, r.stored, r.present, r.failed) for r in want] == [(2, 2, 0, 0), (3, 2, 1, 0), (2, 1, 1, 0)]
        for t in toks:
            assert stored_payloads(lw, t) == stored_payloads(normal, t)
        assert reservation_bytes(lw) == 0
        with pytest.raises(RuntimeError, match="finished"):
            writer.put_layer(0)
        if not bad_input:
            return

        bad_toks = [tokens_for(50 + r, n) for r, n in enumerate(sizes)]
        bad = [[(k.clone(), v.clone()) for k, v in kv] for kv in kvs]
        bad[1][L - 1][1][0, 2 * BLOCK + 1, 0] = float("nan")
        write_tokens(pages, bad[1], tables[1])
        writer = lw.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(bad_toks, tables)], pages, layerwise=True)
        with pytest.raises(cs.InputError, match="outside"):
            writer.put_layer(L)
        for i in range(L):
            writer.put_layer(i)
        with pytest.raises(cs.InputError, match=r"requests\[1\]" if save_mode == "slots" else "NaN"):
            writer.finish()
        assert all(lw.locate(t).num_blocks == 0 for t in bad_toks) and reservation_bytes(lw) == 0


# -- RemoteCache: the same API, every layer ready at once ---------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_helpers import Server

    with Server(tmp_path_factory.mktemp("layerwise-server"), cpu_bytes="64MiB", disk=False) as srv:
        yield srv


def test_remote_cache_returns_a_handle_with_every_layer_ready(server):
    T = 2 * BLOCK + 3
    toks, kv = tokens_for(5, T), make_kv(T, 5, LAYOUT)
    with cs.RemoteCache(server.url, model_id="lw", layout=LAYOUT, codec=INT4, block_tokens=BLOCK) as remote:
        writer = remote.ingest_layerwise(toks)
        assert writer.mode == "reference"  # (docs/engine.md's ``writer.mode``: an AttributeError here)
        for i in range(L):
            writer.put_layer(i, *kv[i])
        assert writer.finish().stored == 2 and writer.mode == "reference"
        want = remote.materialize(toks)
        with remote.materialize(toks, layerwise=True) as load:
            assert load.num_tokens == 2 * BLOCK and load.done() and all(load.ready(i) for i in range(L))
            for i in range(L):
                assert torch.equal(load.layer(i)[0], want.layers[i][0])
        page, num_pages = 16, 12
        ids = page_tables([T], page, num_pages, seed=1)[0]
        normal, normal_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=2)
        lw, lw_t = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=2)
        got = remote.materialize_into(toks, normal.at(ids))
        load = remote.materialize_into(toks, lw.at(ids), layerwise=True)
        assert load.requests == [got] and load.done()
        load.wait(L - 1)
        assert unchanged(normal_t, lw_t)

        # a paged save: the reference writer, one ingest_batch on finish
        other = tokens_for(6, T)
        pages, _ = engine_pages("flash", L, H, D, num_pages, page, DTYPE)
        write_tokens(pages, make_kv(T, 6, LAYOUT, device=DEVICE), ids)
        writer = remote.ingest_batch([cs.PagedRequest(other, ids)], pages, layerwise=True)
        for i in range(L - 1):
            writer.put_layer(i)
        with pytest.raises(cs.InputError, match="never put"):
            writer.finish()
        assert remote.lookup(other) == 0
        writer = remote.ingest_batch([cs.PagedRequest(other, ids)], pages, layerwise=True)
        for i in range(L):
            writer.put_layer(i)
        assert writer.mode == "reference" and [r.stored for r in writer.finish()] == [2]
        assert remote.lookup(other) == 2 * BLOCK


# -- on a GPU --------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_cuda_wait_queues_an_event_wait_and_the_bytes_match(codec, monkeypatch):
    monkeypatch.setattr(layerwise, "TIMELINE", True)
    with make_cache(codec) as cache:
        toks, _ = stored(cache, codec, device="cuda")
        want = cache.materialize(toks, device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        load = cache.materialize(toks, device="cuda", layerwise=True)
        for i in range(L):
            load.wait(i, stream=side)  # the host returns at once
        with torch.cuda.stream(side):
            got = [(k.clone(), v.clone()) for k, v in (load.layer(i, wait=False) for i in range(L))]
        side.synchronize()
        for (k, v), (k0, v0) in zip(got, want.layers):
            assert torch.equal(k, k0) and torch.equal(v, v0)
        times = load.timeline()
        assert all(t.needed_ms is not None for t in times)
        assert [t.ready_ms for t in times] == sorted(t.ready_ms for t in times)
        load.close()
        monkeypatch.setattr(layerwise, "TIMELINE", False)  # the default: the waits record no events
        with cache.materialize(toks, device="cuda", layerwise=True) as load:
            for i in range(L):
                load.wait(i)
            assert load._needed == [None] * L
            with pytest.raises(RuntimeError, match="TIMELINE = True"):
                load.timeline()


@cuda
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("issue", layerwise.ISSUE_MODES)
def test_cuda_layer_groups_of_cpu_frames_are_copied_apart(issue, pinned, monkeypatch):
    """A pinned CPU tier: each group's slices of every frame read in place by one kernel;
    a pageable one: copied slice by slice. Every way of issuing the groups, the same bytes."""
    monkeypatch.setitem(layerwise.ISSUE, "cuda", issue)
    with make_cache(INT4, pin_memory=pinned) as cache:
        toks, _ = stored(cache, INT4, device="cuda")
        want = cache.materialize(toks, device="cuda")
        load = cache.materialize(toks, device="cuda", layerwise=True)
        assert load._decoder._gather == pinned
        for i in range(L):
            k, v = load.layer(i)
            assert torch.equal(k, want.layers[i][0]) and torch.equal(v, want.layers[i][1])
        load.close()
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0


@cuda
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_a_layerwise_save_into_pageable_host_memory_makes_no_kernel_store(paged, monkeypatch):
    """A CPU tier of pageable memory (``pin_memory=False``): ``store_ranges`` cannot store into
    it from the device (illegal addresses: the process's CUDA context was lost), so the writer
    takes the reference path, and the frames equal a plain ingest's."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    T = 4 * BLOCK
    toks, kv = tokens_for(13, T), make_kv(T, 13, LAYOUT, device="cuda")
    with make_cache(INT4, pin_memory=False) as lw, make_cache(INT4, pin_memory=False) as normal:
        if paged:
            pages, _ = engine_pages("flash", L, LAYOUT.num_kv_heads, LAYOUT.head_dim, 16, 16, LAYOUT.torch_dtype)
            ids = list(range(T // 16))
            write_tokens(pages, kv, ids)
            writer = lw.ingest_batch([cs.PagedRequest(toks, ids)], pages, layerwise=True)
            for i in range(L):
                writer.put_layer(i)
            assert writer.mode == "reference"
            assert [r.stored for r in writer.finish()] == [4]
        else:
            writer = lw.ingest_layerwise(toks)
            for i in range(L):
                writer.put_layer(i, *kv[i])
            assert writer.mode == "reference"
            assert writer.finish().stored == 4
        torch.cuda.synchronize()  # (an illegal address would be raised here at the latest)
        normal.ingest(toks, kv)
        assert stored_payloads(lw, toks) == stored_payloads(normal, toks)


@cuda
@pytest.mark.parametrize("codec", [*CODECS, ROTATED, "policy"], ids=lambda c: c if isinstance(c, str) else c.name)
def test_cuda_a_layerwise_save_stores_each_layer_through_the_store_kernel(codec, monkeypatch):
    """On a GPU each layer is encoded into staging and stored into the pinned slots by
    ``kernels.store_ranges`` as it is put: the frames equal a plain ingest's, byte for byte;
    a NaN in one layer publishes nothing and gives every slot back."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    if codec == "policy":
        codec = cs.PrecisionPolicy(first=cs.KIVI(bits=8, group_size=32), rest=INT4, first_blocks=1)
    T = 4 * BLOCK + 3
    toks, kv = tokens_for(11, T), make_kv(T, 11, LAYOUT, device="cuda")
    with make_cache(codec) as lw, make_cache(codec) as normal:
        writer = lw.ingest_layerwise(toks)
        for i in range(L):
            # made on the current stream just before the put (as a forward's layer): the
            # save's stream waits for it there, not the host
            k, v = kv[i][0] * 1, kv[i][1] * 1
            writer.put_layer(i, k, v)
        assert writer.mode == "slots"
        assert writer.finish().stored == 4 and reservation_bytes(lw) == 0
        normal.ingest(toks, kv)
        assert stored_payloads(lw, toks) == stored_payloads(normal, toks)

        bad = [(k.clone(), v.clone()) for k, v in kv]
        bad[L - 1][0][1, 2, 3] = float("inf")
        other = tokens_for(12, T)
        writer = lw.ingest_layerwise(other)
        for i in range(L):
            writer.put_layer(i, *bad[i])
        with pytest.raises(cs.InputError):
            writer.finish()
        assert lw.locate(other).num_blocks == 0 and reservation_bytes(lw) == 0


# -- transformers: prefill_with_reuse(layerwise=True) ----------------------------------------

transformers = pytest.importorskip("transformers")
from cacheseek.integrations.transformers import (  # noqa: E402
    cache_length,
    dynamic_cache_layers,
    forward,
    greedy_continue,
    kv_layout,
    layerwise_cache,
    prefill_with_reuse,
)

TF_BLOCK = 64


@pytest.fixture(scope="module")
def tiny_model():
    # One torch thread while these tests run: they compare two forwards bit for bit, and a
    # multi-threaded matmul's blocking may follow the threads it gets on a loaded machine (a CI
    # run once stored a raw block one rounding apart from the normal prefill's).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_llama(num_hidden_layers=4)
    finally:
        torch.set_num_threads(before)


def model_cache(model, codec):
    return cs.PrefixCache(model_id="lw-tf", layout=kv_layout(model), codec=codec, block_tokens=TF_BLOCK,
                          tiers=cs.TierConfig(cpu_bytes="64MiB", pin_memory=False))


def same_result(a, b) -> bool:
    return (torch.equal(a.logits, b.logits) and a.reused_tokens == b.reused_tokens
            and all(torch.equal(x, y) for p, q in zip(dynamic_cache_layers(a.cache), dynamic_cache_layers(b.cache))
                    for x, y in zip(p, q)))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_layerwise_prefill_equals_the_normal_one_and_stores_the_same_blocks(tiny_model, codec, save_mode):
    ids = list(range(3, 3 + 3 * TF_BLOCK + 10))
    with model_cache(tiny_model, codec) as lw, model_cache(tiny_model, codec) as normal:
        first = prefill_with_reuse(tiny_model, lw, ids, layerwise=True)  # nothing stored: layers go to the writer
        assert (first.reused_tokens, first.stored_blocks) == (0, 3)
        assert lw.stats()["tiers"][0]["reservation_bytes"] == 0
        prefill_with_reuse(tiny_model, normal, ids)
        assert stored_payloads(lw, ids) == stored_payloads(normal, ids)
        a = prefill_with_reuse(tiny_model, normal, ids, reuse="always", ingest=False)
        b = prefill_with_reuse(tiny_model, lw, ids, reuse="always", ingest=False, layerwise=True)
        assert b.reused_tokens == 3 * TF_BLOCK and b.tiers == ["cpu"] * 3 and b.skipped_reason is None
        assert same_result(a, b)
        assert type(b.cache).__name__ == "LayerwiseDynamicCache" and cache_length(b.cache) == len(ids)
        ga, gb = (greedy_continue(tiny_model, r.cache, r.logits, 6, keep_logits=True) for r in (a, b))
        assert ga.tokens == gb.tokens and all(torch.equal(x, y) for x, y in zip(ga.logits, gb.logits))


def test_layerwise_prefill_with_a_background_issuer_equals_the_normal_one(tiny_model, background):
    ids = list(range(5, 5 + 3 * TF_BLOCK + 4))
    with model_cache(tiny_model, INT4) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        with torch.inference_mode():
            a = prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False)
            b = prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False, layerwise=True)
        assert b.reused_tokens == 3 * TF_BLOCK and b.skipped_reason is None and same_result(a, b)


def test_each_layer_waits_inside_the_forward_in_order(tiny_model):
    ids = list(range(7, 7 + 2 * TF_BLOCK + 3))
    with model_cache(tiny_model, INT4) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        load = cache.materialize(ids, max_tokens=len(ids) - 1, layerwise=True)
        waited = []
        real_wait = load.wait

        def wait(layer, stream=None):
            # when layer i is first needed, later groups are not decoded yet (on a CPU)
            waited.append((layer, [load.ready(i) for i in range(4)]))
            real_wait(layer, stream)

        load.wait = wait
        past = layerwise_cache(load, tiny_model.config)
        assert cache_length(past) == 2 * TF_BLOCK  # the prefix length, before any layer is loaded
        forward(tiny_model, torch.tensor([ids[2 * TF_BLOCK:]]), past)  # `cache=` or `past_key_values=`
        assert [layer for layer, _ in waited] == [0, 1, 2, 3]
        if not torch.cuda.is_available():
            assert waited[0][1] == [False] * 4 and waited[1][1] == [True, False, False, False]
        load.close()


def test_a_failed_layerwise_load_is_recomputed(tiny_model, monkeypatch):
    ids = list(range(11, 11 + 2 * TF_BLOCK + 5))
    with model_cache(tiny_model, cs.Raw()) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        full = prefill_with_reuse(tiny_model, cache, ids, reuse="never", ingest=False)
        real = LayerwiseDecoder._decode_layers

        def failing(self, views, l0, l1, n):
            if l0 >= 1:
                raise RuntimeError("decode failed")
            return real(self, views, l0, l1, n)

        monkeypatch.setattr(LayerwiseDecoder, "_decode_layers", failing)
        res = prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=True)
        assert res.reused_tokens == 0 and res.computed_tokens == len(ids)
        assert "layer-wise load failed" in res.skipped_reason and "decode failed" in res.skipped_reason
        assert torch.equal(res.logits, full.logits) and cache_length(res.cache) == len(ids)


def test_a_layerwise_prefill_that_raises_gives_back_the_loads_frames_and_the_writers_slots(tiny_model,
                                                                                           monkeypatch):
    """Held while the error is (``pytest.raises`` keeps its traceback, and so the call's
    frame): the load's CPU-tier frames when a model's cache is refused before the forward
    (sliding-window layers), and the writer's reserved slots when the recompute after a
    failed load raises."""
    sliding = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=1024)).eval()
    ids = list(range(17, 17 + 2 * TF_BLOCK + 5))
    with model_cache(sliding, cs.Raw()) as cache:
        layout = cache.layout
        kv = [tuple(torch.randn(layout.num_kv_heads, len(ids), layout.head_dim) for _ in "kv")
              for _ in range(layout.num_layers)]
        assert cache.ingest(ids, kv).stored == 2
        with pytest.raises(cs.ConfigError, match="has sliding-window layers") as refused:
            prefill_with_reuse(sliding, cache, ids, reuse="always", layerwise=True)
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0 and refused.value is not None
        # A miss too, before anything runs: it ran and stored, and the hit after it was refused.
        with pytest.raises(cs.ConfigError, match=r"^layerwise=True: MistralForCausalLM has sliding-window layers"):
            prefill_with_reuse(sliding, cache, list(range(500, 500 + 2 * TF_BLOCK)), layerwise=True)
        assert cache.locate(list(range(500, 500 + 2 * TF_BLOCK))).num_tokens == 0

    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)  # the writer reserves slots
    with model_cache(tiny_model, cs.Raw()) as cache:
        prefill_with_reuse(tiny_model, cache, ids[: TF_BLOCK + 1])  # block 0 stored: the load fails in layer 1
        monkeypatch.setattr(LayerwiseDecoder, "_decode_layers", decode_failing_from(1))
        real_put = layerwise_save.LayerwiseSave.put_layer

        def put_layer(self, i, k, v):
            real_put(self, i, k, v)
            if i == 2:  # reached in the recompute only
                raise RuntimeError("out of memory")

        monkeypatch.setattr(layerwise_save.LayerwiseSave, "put_layer", put_layer)
        with pytest.raises(RuntimeError, match="out of memory") as raised:
            prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=True)
        assert reservation_bytes(cache) == 0 and raised.value is not None
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0


@pytest.mark.parametrize("change", ["evicted", "stored"])
def test_a_layerwise_load_that_differs_from_its_lookup_runs_the_right_suffix(tiny_model, monkeypatch, change):
    """Between the lookup and the load a block may go (the load ends short: the suffix
    starts earlier than the ids put on the device before the load) or come (it ends
    later): either way the forward runs exactly the ids after what was loaded."""
    ids = list(range(13, 13 + 3 * TF_BLOCK + 6))
    with model_cache(tiny_model, cs.Raw()) as cache:
        prefill_with_reuse(tiny_model, cache, ids[: 2 * TF_BLOCK] if change == "stored" else ids)
        hashes = cache.block_hashes(ids)
        real_locate = cache.locate

        def locate(keys):
            located = real_locate(keys)
            if change == "evicted":
                cache.store.delete(hashes[2])  # the lookup saw 3 blocks; the load finds 2
            else:
                prefill_with_reuse(tiny_model, cache, ids, reuse="never")  # the lookup saw 2; the load finds 3
            return located

        monkeypatch.setattr(cache, "locate", locate)
        res = prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False, layerwise=True)
        monkeypatch.undo()
        want = prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False)
    assert res.reused_tokens == want.reused_tokens == (2 if change == "evicted" else 3) * TF_BLOCK
    assert res.computed_tokens == len(ids) - res.reused_tokens and cache_length(res.cache) == len(ids)
    assert same_result(res, want)


def test_a_layerwise_prefill_whose_forward_raises_decodes_no_more_layers(tiny_model, monkeypatch):
    """The forward raises in layer 1 (out of memory, say): the caller gets that error, the
    load's frames and staging go back, and the layer groups after the one layer 0 waited
    for are not decoded (nobody reads them; closing the load decoded all of them first)."""
    ids = list(range(23, 23 + 2 * TF_BLOCK + 5))
    decoded = []
    real = LayerwiseDecoder._decode_layers
    monkeypatch.setattr(LayerwiseDecoder, "_decode_layers",
                        lambda self, views, l0, l1, n: decoded.append(l0) or real(self, views, l0, l1, n))

    def out_of_memory(module, args, kwargs):
        raise RuntimeError("CUDA out of memory")

    with model_cache(tiny_model, INT4) as cache:
        prefill_with_reuse(tiny_model, cache, ids)
        assert layer_groups(4) == [(0, 1), (1, 3), (3, 4)]
        decoded.clear()
        hook = tiny_model.model.layers[1].register_forward_pre_hook(out_of_memory, with_kwargs=True)
        try:
            with pytest.raises(RuntimeError, match="^CUDA out of memory$") as raised:
                prefill_with_reuse(tiny_model, cache, ids, reuse="always", layerwise=True)
        finally:
            hook.remove()
        assert raised.value is not None  # (its traceback holds the call's frame, and so the load)
        if not torch.cuda.is_available():  # (on a GPU every group is issued before the forward)
            assert decoded == [0]
        assert cache.store.tier("cpu").lease_stats()["leases_active"] == 0
        assert staging_pool(torch.device("cpu")).stats()["leases_active"] == 0
        assert reservation_bytes(cache) == 0
        again = prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False, layerwise=True)
        assert same_result(again, prefill_with_reuse(tiny_model, cache, ids, reuse="always", ingest=False))


# -- SmolLM2 (slow): the real model, Raw and int4 -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_smollm2_layerwise_reuse_equals_the_normal_path(codec, monkeypatch):
    from cacheseek.integrations import smollm2, texts
    from cacheseek.integrations.demo import chat_prompt

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's cores are shared; OpenMP threads spin when descheduled
    try:
        model, tokenizer = smollm2.load()  # fetched on first use (scripts/test.sh's machines have the network)
        doc = texts.stdlib_document("json")[:900]
        ids = chat_prompt(tokenizer, doc, "Which function parses a JSON string?")
        with model_cache(model, codec) as normal, model_cache(model, codec) as lw:
            prefill_with_reuse(model, normal, ids)
            prefill_with_reuse(model, lw, ids, layerwise=True)
            assert stored_payloads(lw, ids) == stored_payloads(normal, ids)
            a = prefill_with_reuse(model, normal, ids, reuse="always", ingest=False)
            b = prefill_with_reuse(model, lw, ids, reuse="always", ingest=False, layerwise=True)
            assert b.reused_tokens == (len(ids) - 1) // TF_BLOCK * TF_BLOCK > 0
            assert same_result(a, b)
            ga, gb = (greedy_continue(model, r.cache, r.logits, 8, keep_logits=True) for r in (a, b))
            assert ga.tokens == gb.tokens and all(torch.equal(x, y) for x, y in zip(ga.logits, gb.logits))
    finally:
        torch.set_num_threads(before)


def test_layerwise_prefill_through_a_server_equals_the_normal_one(tiny_model, server):
    ids = list(range(13, 13 + 2 * TF_BLOCK + 9))
    with cs.RemoteCache(server.url, model_id="lw-tf-remote", layout=kv_layout(tiny_model), codec=INT4,
                        block_tokens=TF_BLOCK) as remote:
        first = prefill_with_reuse(tiny_model, remote, ids, layerwise=True)  # stored through the writer
        assert (first.reused_tokens, first.stored_blocks) == (0, 2)
        a = prefill_with_reuse(tiny_model, remote, ids, reuse="always", ingest=False)
        b = prefill_with_reuse(tiny_model, remote, ids, reuse="always", ingest=False, layerwise=True)
        assert b.reused_tokens == 2 * TF_BLOCK and same_result(a, b)
