"""``kernels.copy_ranges``: byte ranges of many host buffers into device rows, one launch;
``kernels.store_ranges``: the other way, device rows out to host addresses.

On a GPU the sources are pinned host tensors read in place by the kernel (their mapped
addresses); without one, Triton's interpreter runs it on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cacheseek import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PIN = DEVICE == "cuda"


def _run(sources, rows, row_bytes, ranges, order, programs=kernels.ranges.PROGRAMS):
    gen = torch.Generator().manual_seed(sources * 1000 + rows)
    src = [torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen) for _ in range(sources)]
    if PIN:
        src = [t.pin_memory() for t in src]
    dst = torch.full((rows, row_bytes), 7, dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([(t.data_ptr(), r) for t, r in zip(src, order)], dtype=torch.int64, device=DEVICE)
    kernels.copy_ranges(table, dst, ranges, programs=programs)
    want = torch.full((rows, row_bytes), 7, dtype=torch.uint8)
    for t, r in zip(src, order):
        for o, n in ranges:
            want[r, o:o + n] = t[o:o + n]
    assert torch.equal(dst.cpu(), want)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_ranges_land_in_their_rows_and_nothing_else_changes(data):
    row_words = data.draw(st.integers(1, 3000))
    row_bytes = row_words * 4
    rows = data.draw(st.integers(1, 6))
    sources = data.draw(st.integers(1, rows))
    order = data.draw(st.permutations(range(rows)))[:sources]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, row_words), min_size=2, max_size=8))))
    pairs = list(zip(cuts[::2], cuts[1::2]))
    ranges = [(a * 4, (b - a) * 4) for a, b in pairs if b > a] or [(0, row_bytes)]
    _run(sources, rows, row_bytes, ranges, order, programs=data.draw(st.sampled_from([1, 2, 3, 32])))


def test_a_range_larger_than_one_program_is_copied_whole():
    # chunks of 2048 words: a range of 5000 words is three, beside one of 16 words
    _run(2, 3, 4 * 6000, [(4 * 100, 4 * 5000), (0, 64)], [2, 0])
    _run(2, 3, 4 * 6000, [(4 * 100, 4 * 5000), (0, 64)], [2, 0], programs=1)  # one program loops over all


def test_bad_tables_and_rows_are_refused():
    dst = torch.zeros((2, 64), dtype=torch.uint8, device=DEVICE)
    one = [(0, 4)]
    with pytest.raises(ValueError, match="table"):
        kernels.copy_ranges(torch.zeros(3, dtype=torch.int64, device=DEVICE), dst, one)
    with pytest.raises(ValueError, match="programs"):
        kernels.copy_ranges(torch.zeros((1, 2), dtype=torch.int64, device=DEVICE), dst, one, programs=0)
    with pytest.raises(ValueError, match="dst"):
        kernels.copy_ranges(torch.zeros((1, 2), dtype=torch.int64, device=DEVICE), dst[:, :62], one)
    with pytest.raises(ValueError, match="ranges"):
        kernels.copy_ranges(torch.zeros((1, 2), dtype=torch.int64, device=DEVICE), dst, [(0, 6)])
    with pytest.raises(ValueError, match="ranges"):
        kernels.copy_ranges(torch.zeros((1, 2), dtype=torch.int64, device=DEVICE), dst, [(60, 8)])


def _store(rows, row_bytes, dst_bytes, ranges, order, programs=kernels.ranges.PROGRAMS, step=0):
    gen = torch.Generator().manual_seed(rows * 1000 + row_bytes)
    src = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    dst = [torch.full((dst_bytes,), 7, dtype=torch.uint8) for _ in order]
    if PIN:
        dst = [t.pin_memory() for t in dst]
    table = torch.tensor([(t.data_ptr(), r) for t, r in zip(dst, order)], dtype=torch.int64, device=DEVICE)
    kernels.store_ranges(src.to(DEVICE), table, ranges, programs=programs, step=step)
    if PIN:
        torch.cuda.synchronize()
    for t, r in zip(dst, order):
        want = torch.full((dst_bytes,), 7, dtype=torch.uint8)
        for s, d, n, per in ranges:
            want[d + step * per:d + step * per + n] = src[r, s:s + n]
        assert torch.equal(t, want)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_stored_ranges_land_at_their_addresses_and_nothing_else_changes(data):
    row_words = data.draw(st.integers(1, 3000))
    rows = data.draw(st.integers(1, 5))
    order = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=4))
    # disjoint destination ranges, each from anywhere in the row; with a step, each range is
    # one of several same-sized slices of its own stretch (a layer of a buffer) and the
    # step picks which
    sizes = data.draw(st.lists(st.integers(0, row_words), min_size=1, max_size=5))
    layers = data.draw(st.integers(1, 3))
    step = data.draw(st.integers(0, layers - 1))
    ranges, d = [], 0
    for n in sizes:
        s = data.draw(st.integers(0, row_words - n))
        d += data.draw(st.integers(0, 3))
        ranges.append((4 * s, 4 * d, 4 * n, 4 * n if layers > 1 else 0))
        d += n * layers
    _store(rows, row_words * 4, 4 * d + 16, ranges, order, programs=data.draw(st.sampled_from([1, 2, 3, 32])),
           step=step)


def test_a_stored_range_larger_than_one_program_lands_whole():
    _store(3, 4 * 6000, 4 * 9000, [(4 * 100, 4 * 3000, 4 * 5000, 0), (0, 0, 64, 0)], [2, 0])
    _store(3, 4 * 6000, 4 * 9000, [(4 * 100, 4 * 3000, 4 * 5000, 0), (0, 0, 64, 0)], [2, 0], programs=1)


def test_bad_store_tables_and_ranges_are_refused():
    src = torch.zeros((2, 64), dtype=torch.uint8, device=DEVICE)
    table = torch.zeros((1, 2), dtype=torch.int64, device=DEVICE)
    one = [(0, 0, 4, 0)]
    with pytest.raises(ValueError, match="table"):
        kernels.store_ranges(src, torch.zeros(3, dtype=torch.int64, device=DEVICE), one)
    with pytest.raises(ValueError, match="programs"):
        kernels.store_ranges(src, table, one, programs=0)
    with pytest.raises(ValueError, match="src"):
        kernels.store_ranges(src[:, :62], table, one)
    for bad in ([(0, 0, 6, 0)], [(60, 0, 8, 0)], [(0, 2, 4, 0)], [(-4, 0, 4, 0)], [(0, 0, 4, 2)]):
        with pytest.raises(ValueError, match="ranges"):
            kernels.store_ranges(src, table, bad)
    with pytest.raises(ValueError, match="step"):
        kernels.store_ranges(src, table, one, step=-1)


OTHER = "cpu" if DEVICE == "cuda" else "meta"  # a device the rows are not on


def test_a_table_on_another_device_than_the_rows_is_refused_before_the_launch():
    """The table was not checked against the rows' device: the kernel read a host table
    through a device pointer (on a GPU an illegal address, which ends the process's CUDA
    context), or, interpreted, failed deep in Triton ("Cannot copy out of meta tensor").
    Now a ``ValueError`` names both devices, and nothing is written."""
    src = torch.arange(64, dtype=torch.uint8)
    rows = torch.full((2, 64), 7, dtype=torch.uint8, device=DEVICE)
    table = torch.tensor([[src.data_ptr(), 0]], dtype=torch.int64, device=OTHER)
    with pytest.raises(ValueError, match=f"copy_ranges: table on {OTHER}.*dst on {DEVICE}"):
        kernels.copy_ranges(table, rows, [(0, 8)])
    with pytest.raises(ValueError, match=f"store_ranges: table on {OTHER}.*src on {DEVICE}"):
        kernels.store_ranges(rows, table, [(0, 0, 8, 0)])
    assert bool((rows == 7).all()) and torch.equal(src, torch.arange(64, dtype=torch.uint8))
