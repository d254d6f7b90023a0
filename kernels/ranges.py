"""The same byte ranges of many host buffers, copied into the rows of a device buffer in one launch.

A layer-wise load copies, for each layer group, one slice per codec buffer out of every
CPU-tier frame: at 16K tokens that is 64 frames x 4 slices, hundreds of copies per group,
and each copy's launch costs the host more than its bytes cost the link (the host, not
the link, set how soon each group arrived). Pinned host memory is mapped into the device's
address space (the CPU tier's chunks are pinned torch allocations), so one kernel reads
every slice through a table of the frames' addresses: its loads cross the link at ~0.9x
the copy engine's rate (``benchmarks/host_access.py``), for one launch per group.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import contextlib

import torch
import triton
import triton.language as tl

WORD = 4  # bytes moved per element: every offset and size must be a multiple of it
CHUNK_WORDS = 2048  # words per chunk (8 KiB)
# Programs per launch: enough reads in flight to keep the link busy (benchmarks/host_access.py
# --ranges measures it against the copy engine), few enough to leave most SMs to the kernels
# a layer-wise load overlaps with.
PROGRAMS = 16


@triton.jit
def _copy_ranges_kernel(table, dst, row_words, offsets, sizes, P, C, total, CHUNK: tl.constexpr):
    # A fixed number of programs, each looping over chunks (source, range, chunk): the reads
    # wait on the link, and a program per chunk would hold every SM meanwhile, slowing the
    # kernels the load overlaps with (a forward's).
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        i = t // (P * C)
        r = (t // C) % P
        c = t % C
        size = tl.load(sizes + r)
        off = tl.load(offsets + r)
        idx = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        mask = idx < size
        src = tl.load(table + 2 * i).to(tl.pointer_type(tl.int32))
        row = tl.load(table + 2 * i + 1)
        values = tl.load(src + off + idx, mask=mask)
        tl.store(dst + row * row_words + off + idx, values, mask=mask)


def copy_ranges(table: torch.Tensor, dst: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                max_size: int, *, programs: int = PROGRAMS) -> None:
    """For every source ``(address, row)`` of ``table`` and every range ``r``: bytes
    ``[offsets[r], offsets[r] + sizes[r])`` (given in 4-byte words) of the host buffer at
    ``address`` into the same bytes of ``dst[row]``, on the current stream, in one launch of
    at most ``programs`` programs. ``table``: ``[n, 2]`` int64 device tensor; the addresses
    point into pinned (device-mapped) host memory, 4-byte aligned; ``dst``: a contiguous
    ``[rows, row_bytes]`` uint8 device tensor; ``max_size``: the largest of ``sizes``
    (words). Nothing checks that the addresses are mapped or the rows in range: a pageable
    address faults the kernel (the caller knows where its frames live)."""
    if table.dim() != 2 or table.shape[1] != 2 or table.dtype != torch.int64 or not table.is_contiguous():
        raise ValueError("copy_ranges: table must be a contiguous [n, 2] int64 tensor of (address, row)")
    if programs < 1:
        raise ValueError(f"programs: must be >= 1, got {programs}")
    sources = table.shape[0]
    rows, row_bytes = dst.shape
    if row_bytes % WORD or not dst.is_contiguous() or dst.data_ptr() % WORD:
        raise ValueError("copy_ranges: dst must be contiguous [rows, row_bytes] with 4-byte aligned rows")
    ranges = sizes.numel()
    if not sources or not ranges or max_size <= 0:
        return
    chunks = triton.cdiv(max_size, CHUNK_WORDS)
    total = sources * ranges * chunks
    with torch.cuda.device(dst.device) if dst.device.type == "cuda" else contextlib.nullcontext():
        _copy_ranges_kernel[(min(total, programs),)](table, dst.view(torch.int32), row_bytes // WORD, offsets, sizes,
                                                     ranges, chunks, total, CHUNK=CHUNK_WORDS)
