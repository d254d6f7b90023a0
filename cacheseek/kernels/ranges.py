"""Byte ranges between many host buffers and the rows of a device buffer, in one launch each way.

A layer-wise load copies, for each layer group, one slice per codec buffer out of every
CPU-tier frame: at 16K tokens that is 64 frames x 4 slices, hundreds of copies per group,
and each copy's launch costs the host more than its bytes cost the link (the host, not
the link, set how soon each group arrived). Pinned host memory is mapped into the device's
address space (the CPU tier's chunks are pinned torch allocations), so one kernel reads
every slice through a table of the frames' addresses: its loads cross the link at ~0.9x
the copy engine's rate (``benchmarks/host_access.py``), for one launch per group.

A layer-wise save goes the other way (``store_ranges``): as a forward produces layer ``i``,
its encoded slices of every block go from a device staging buffer straight into their
CPU-tier slots, one launch per layer, while the forward computes the layers after it.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, on_device
from .layers import offsets_table

WORD = 4  # bytes moved per element: every offset and size must be a multiple of it
CHUNK_WORDS = 2048  # words per chunk (8 KiB)
# Programs per launch: enough reads in flight to keep the link busy (benchmarks/host_access.py
# --ranges measures it against the copy engine), few enough to leave most SMs to the kernels
# a layer-wise load overlaps with.
PROGRAMS = 16


@triton.jit
def _copy_ranges_kernel(table, dst, row_words, chunk_offsets, chunk_sizes, Q, total, CHUNK: tl.constexpr):
    # A fixed number of programs, each looping over (source, chunk) pairs: the reads wait
    # on the link, and a program per chunk would hold every SM meanwhile, slowing the
    # kernels the load overlaps with (a forward's). The ranges are cut into chunks on the
    # host, so no iteration is spent past a short range's end (a codec's small scale
    # buffers beside its large code buffers).
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        i = t // Q
        q = t % Q
        size = tl.load(chunk_sizes + q)
        off = tl.load(chunk_offsets + q)
        idx = tl.arange(0, CHUNK)
        mask = idx < size
        src = tl.load(table + 2 * i).to(tl.pointer_type(tl.int32))
        row = tl.load(table + 2 * i + 1)
        values = tl.load(src + off + idx, mask=mask)
        tl.store(dst + row * row_words + off + idx, values, mask=mask)


def _check_launch(fn: str, table: torch.Tensor, rows: torch.Tensor, name: str, programs: int) -> int:
    """The checks both directions share; the device buffer's row length in bytes."""
    if table.dim() != 2 or table.shape[1] != 2 or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError(f"{fn}: table must be a contiguous [n, 2] int64 tensor of (address, row)")
    if programs < 1:
        raise ValueError(f"programs: must be >= 1, got {programs}")
    if rows.dim() != 2 or rows.shape[1] % WORD or not rows.is_contiguous() or rows.data_ptr() % WORD:
        raise ValueError(f"{fn}: {name} must be contiguous [rows, row_bytes] with 4-byte aligned rows")
    if table.device != rows.device:  # (the kernel reads the table through a pointer on the rows' device)
        raise ValueError(f"{fn}: table on {table.device}, {name} on {rows.device}: must be one device")
    return rows.shape[1]


@functools.lru_cache(maxsize=64)
def _launcher(kernel, programs: int) -> CachedLaunch:
    """The kernel's launches on ``programs`` programs, past Triton's per-call binding after
    the first (``launch.py``): a layer-wise load launches one per layer group."""
    return CachedLaunch(kernel, (programs,), (), {"CHUNK": CHUNK_WORDS})


def _launch(kernel, programs: int, device: torch.device, *args) -> None:
    on_device(device, _launcher(kernel, programs), *args)


@functools.lru_cache(maxsize=64)
def _chunks(ranges: tuple[tuple[int, int], ...], chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``ranges`` ((offset, size) in words) cut into pieces of at most ``chunk`` words: their
    offsets and sizes."""
    offsets, sizes = [], []
    for off, size in ranges:
        for start in range(0, size, chunk):
            offsets.append(off + start)
            sizes.append(min(chunk, size - start))
    return tuple(offsets), tuple(sizes)


def copy_ranges(table: torch.Tensor, dst: torch.Tensor, ranges: Sequence[tuple[int, int]], *,
                programs: int = PROGRAMS) -> None:
    """For every source ``(address, row)`` of ``table`` and every range ``(offset, size)``
    of ``ranges`` (bytes, multiples of 4): bytes ``[offset, offset + size)`` of the host
    buffer at ``address`` into the same bytes of ``dst[row]``, on the current stream, in
    one launch of at most ``programs`` programs. ``table``: ``[n, 2]`` int64 device tensor;
    the addresses point into pinned (device-mapped) host memory, 4-byte aligned; ``dst``: a
    contiguous ``[rows, row_bytes]`` uint8 device tensor. The ranges' chunk table is made
    once per distinct ``ranges`` (cached on the device). Nothing checks that the addresses
    are mapped or the rows in range: a pageable address faults the kernel (the caller
    knows where its frames live)."""
    row_bytes = _check_launch("copy_ranges", table, dst, "dst", programs)
    if any(off % WORD or size % WORD or off < 0 or size < 0 or off + size > row_bytes for off, size in ranges):
        raise ValueError(f"copy_ranges: ranges must be 4-byte multiples within a row of {row_bytes} bytes")
    words = tuple((off // WORD, size // WORD) for off, size in ranges if size)
    sources = table.shape[0]
    if not sources or not words:
        return
    offsets, sizes = _chunks(words, CHUNK_WORDS)
    total = sources * len(offsets)
    _launch(_copy_ranges_kernel, min(total, programs), dst.device, table, dst.view(torch.int32), row_bytes // WORD,
            offsets_table(dst.device, offsets), offsets_table(dst.device, sizes), len(offsets), total)


@triton.jit
def _store_ranges_kernel(src, row_words, table, chunk_src, chunk_dst, chunk_sizes, chunk_steps, step, Q, total,
                         CHUNK: tl.constexpr):
    # _copy_ranges_kernel's loop the other way: device rows out to host addresses (their
    # stores cross the link), each range at its own offset on either side.
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        i = t // Q
        q = t % Q
        size = tl.load(chunk_sizes + q)
        s_off = tl.load(chunk_src + q)
        d_off = tl.load(chunk_dst + q) + step * tl.load(chunk_steps + q)
        idx = tl.arange(0, CHUNK)
        mask = idx < size
        dst = tl.load(table + 2 * i).to(tl.pointer_type(tl.int32))
        row = tl.load(table + 2 * i + 1)
        values = tl.load(src + row * row_words + s_off + idx, mask=mask)
        tl.store(dst + d_off + idx, values, mask=mask)


@functools.lru_cache(maxsize=64)
def _moves(ranges: tuple[tuple[int, int, int, int], ...], chunk: int) -> tuple[tuple[int, ...], ...]:
    """``ranges`` ((source offset, destination offset, size, destination step) in words)
    cut into pieces of at most ``chunk`` words: each piece's four values, as four tuples."""
    pieces = [(s + start, d + start, min(chunk, size - start), step)
              for s, d, size, step in ranges for start in range(0, size, chunk)]
    return tuple(zip(*pieces))


def store_ranges(src: torch.Tensor, table: torch.Tensor, ranges: Sequence[tuple[int, int, int, int]], *,
                 step: int = 0, programs: int = PROGRAMS) -> None:
    """For every destination ``(address, row)`` of ``table`` and every ``(src_offset,
    dst_offset, size, dst_step)`` of ``ranges`` (bytes, multiples of 4): bytes
    ``[src_offset, src_offset + size)`` of ``src[row]`` to ``address + dst_offset + step *
    dst_step``, on the current stream, in one launch of at most ``programs`` programs.
    (``step``: e.g. a layer's index, where each range is one layer's slice of a buffer
    ``dst_step`` bytes long per layer: the ranges, and the device tables made of them, stay
    the same for every layer.) ``src``: a contiguous ``[rows, row_bytes]`` uint8 device
    tensor; ``table``: ``[n, 2]`` int64 on its device, the addresses in pinned
    (device-mapped) host memory, 4-byte aligned. As with :func:`copy_ranges`, nothing checks
    that the addresses are mapped or that the bytes written are the caller's: the caller
    owns the slots it writes (reserved, unpublished)."""
    row_bytes = _check_launch("store_ranges", table, src, "src", programs)
    if step < 0 or any(x % WORD or x < 0 for r in ranges for x in r) or any(s + size > row_bytes for s, _, size, _ in ranges):
        raise ValueError(f"store_ranges: ranges must be non-negative 4-byte multiples, each within a row of "
                         f"{row_bytes} bytes, and step >= 0")
    words = tuple(tuple(x // WORD for x in r) for r in ranges if r[2])
    sources = table.shape[0]
    if not sources or not words:
        return
    src_offsets, dst_offsets, sizes, steps = _moves(words, CHUNK_WORDS)
    total = sources * len(sizes)
    _launch(_store_ranges_kernel, min(total, programs), src.device, src.view(torch.int32), row_bytes // WORD, table,
            offsets_table(src.device, src_offsets), offsets_table(src.device, dst_offsets),
            offsets_table(src.device, sizes), offsets_table(src.device, steps), step, len(sizes), total)
