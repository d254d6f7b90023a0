"""Launches past Triton's per-call binding (``kernels.launch.CachedLaunch``).

On CPU: the argument classes and the constexpr tail, with a real ``JITFunction``. On a
GPU: the same plan launched many times with inputs of different alignments, on the
default and a side stream, bit for bit as the reference and as Triton's own path.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cacheseek import kernels
from cacheseek.kernels import launch
from cacheseek.quant import kivi_reference as ref


def test_this_triton_launches_with_the_bound_arguments():
    # The direct path replays JITFunction.run's own launcher call; if an upgrade changes
    # that call, the path must turn itself off (and this says so, rather than a slowdown).
    assert launch.SUPPORTED


def test_argument_classes_are_at_least_as_fine_as_tritons():
    base = torch.zeros(64, dtype=torch.float16)
    assert launch.arg_class(base) == launch.arg_class(base[8:])  # 16 bytes on: same class
    assert launch.arg_class(base) != launch.arg_class(base[1:])  # 2 bytes on: not 16-aligned
    assert launch.arg_class(base) != launch.arg_class(base.view(torch.int16))
    classes = {launch.arg_class(v) for v in (1, 2, 16, 32, -16, 1 << 31, -(1 << 31) - 1, 1 << 63)}
    assert len(classes) == 6  # 16 and 32 (and -16) share one: multiples of 16 in int32
    assert launch.arg_class(16) == launch.arg_class(32) == launch.arg_class(-16)
    assert launch.arg_class(True) != launch.arg_class(1)


def _probe(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 3):
    pass


def _bad_order(x_ptr, A: tl.constexpr, n):
    pass


def test_the_constexpr_tail_follows_parameter_order_with_defaults():
    fn = triton.runtime.jit.JITFunction(_probe)
    cached = launch.CachedLaunch(fn, (4,), (7,), {"A": 5, "num_warps": 4})
    assert cached.grid == (4, 1, 1)
    assert cached._constexpr_tail(2) == (5, 3)
    assert launch.CachedLaunch(fn, (1,), (), {"num_warps": 4})._constexpr_tail(2) is None  # A has no default
    bad = launch.CachedLaunch(triton.runtime.jit.JITFunction(_bad_order), (1,), (), {"A": 1})
    assert bad._constexpr_tail(2) is None  # a runtime argument after a constexpr: Triton's path only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need a GPU")
@pytest.mark.parametrize("axis", [-2, -1])
def test_direct_launches_match_tritons_path_and_the_reference(axis):
    torch.manual_seed(0)
    big = torch.randn(2 * 8 * 256 * 128 + 64, dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()
    results = []
    try:
        for enabled in (False, True):
            launch.ENABLED = enabled
            for offset in (0, 1, 8, 0, 3):  # 2- and 6-byte offsets change the alignment class
                x = big[offset: offset + 2 * 8 * 256 * 128].view(2, 8, 256, 128)
                want = ref.quantize(x, bits=4, group=32, axis=axis, stats_dtype=torch.float16)
                for stream in (torch.cuda.current_stream(), side):
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        got = kernels.quantize(x, bits=4, group=32, axis=axis, stats_dtype=torch.float16)
                    torch.cuda.current_stream().wait_stream(stream)
                    for g, w in zip(got, want):
                        assert torch.equal(g, w)
                    results.append(got)
    finally:
        launch.ENABLED = True
    torch.cuda.synchronize()
    plan = kernels.kivi._quantize_plan((2, 8, 256, 128), (262144, 32768, 128, 1), torch.float16, 4, 32, axis,
                                       torch.float16, None, False, 0)
    assert plan.launch.cached is not None and plan.launch.cached.direct_launches >= 6  # not Triton's path each time


def test_launch_hooks_send_launches_through_triton():
    assert not launch._hooked(None)
    assert not launch._hooked(type("Chain", (), {"calls": []})())
    assert launch._hooked(type("Chain", (), {"calls": [print]})())
    assert launch._hooked(print)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned uploads need a GPU")
def test_new_layer_tables_go_up_through_the_pinned_ring_in_order():
    from cacheseek.kernels import layers

    device = torch.device("cuda")
    rows = layers._UploadRing.ROWS
    want = [tuple(range(i * 7, i * 7 + 32)) for i in range(3 * rows)]  # wraps the ring three times
    got = [layers._RING.upload(device, values) for values in want]
    torch.cuda.synchronize()
    assert [tuple(t.tolist()) for t in got] == want
    assert layers.offsets_table(device, want[5]) is not layers.offsets_table(device, want[6])
    assert layers.offsets_table(device, want[5]) is layers.offsets_table(device, want[5])  # cached


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")
def test_a_table_cached_on_one_stream_is_not_read_on_another_before_its_upload():
    from cacheseek.kernels import layers

    device = torch.device("cuda")
    busy, other = torch.cuda.Stream(device), torch.cuda.Stream(device)
    values = tuple(range(10_000_019, 10_000_019 + 97 * 301, 301))  # (no table holds these yet)
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of cycles: the upload queued behind it waits
        layers.offsets_table(device, values)
    with torch.cuda.stream(other):
        table = layers.offsets_table(device, values)
        seen = table.clone()  # on `other`, which nothing orders after `busy`
    torch.cuda.synchronize()
    assert tuple(seen.tolist()) == values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned flags need a GPU")
def test_flags_given_back_are_handed_out_again_all_true():
    from cacheseek.quant import tensors

    flags = tensors.host_flags((4, 3), True)
    assert flags.dtype == torch.bool and flags.all() and flags.is_pinned()
    flags[1, 2] = False
    tensors.give_back_flags(flags)
    again = tensors.host_flags((4, 3), True)
    assert again.data_ptr() == flags.data_ptr() and again.all()  # reused, and reset
    tensors.give_back_flags(again[0])  # a view: never pooled
    assert tensors.host_flags((3,), True).data_ptr() != again.data_ptr()
    assert not tensors.host_flags((2,), False).is_pinned()
