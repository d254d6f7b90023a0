"""``kernels.copy_ranges``: byte ranges of many host buffers into device rows, one launch.

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
