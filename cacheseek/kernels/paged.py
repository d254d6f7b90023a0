"""An engine's paged KV cache, read and written in place by the kernels.

Engines keep KV in pages: vLLM per layer ``[2, num_pages, page_size, H, D]`` (K and V in
one tensor), FlashInfer ``[num_pages, page_size, H, D]`` (NHD) or ``[num_pages, H,
page_size, D]`` (HND), SGLang a token pool ``[slots, H, D]`` (pages of one token). Each
of these is, per layer and side, a 4-D view ``[num_pages, page_size, H, D]`` with the
head dim contiguous and any other strides: :class:`PagedLayers` holds one side's layers
that way, with a device table of each layer's offset from the first (as
``layers.LayerTable``), so one launch covers every layer.

A launch covers ``n`` store blocks of ``B`` tokens, each of them any block of any request:
:class:`BlockPages` maps launch row ``a`` to where its tokens are, as two numbers, the
index (in every request's page ids laid end to end) of the page holding the block's
first token and that token's slot in it. Token ``t`` of the block is then

    g = slot0 + t;   page = page_ids[first + g // page_size];   at (page, g % page_size)

so a store block may span many pages (page size 16 and blocks of 256), lie inside one
(pages larger than blocks), or be 256 single-token slots (a token pool). The KIVI kernels
(``kivi``) use the same two helpers, :func:`block_source` and :func:`page_offsets`.

Here: Raw's gather (pages into the staging rows a store block is encoded into, with a
NaN/Inf check per block) and scatter (decoded rows into pages), one launch per side.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .layers import FLAG_DTYPES, byte_view, nonfinite, offsets_table



class PagedLayers:
    """One side (K or V) of an engine's paged KV cache: per layer a ``[num_pages,
    page_size, H, D]`` view (any strides, the head dim contiguous), all layers of one shape,
    strides, dtype and device. ``base`` is the tensor the kernels address from, ``offsets``
    the device table of each layer's offset from it (in elements)."""

    __slots__ = ("align", "base", "device", "dtype", "head_dim", "heads", "layers", "num_pages", "offsets",
                 "page_size", "strides")

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("pages: no layers")
        first = layers[0]
        shape, stride, dtype, device = tuple(first.shape), first.stride(), first.dtype, first.device
        for i, t in enumerate(layers):
            if t.dim() != 4:
                raise ValueError(f"pages layer {i}: expected a [num_pages, page_size, H, D] view, got {list(t.shape)}")
            if tuple(t.shape) != shape or t.stride() != stride or t.dtype != dtype or t.device != device:
                raise ValueError(f"pages layer {i}: shape, strides, dtype and device must match layer 0's "
                                 f"({list(shape)} {stride} {dtype} {device}), got {list(t.shape)} {t.stride()} "
                                 f"{t.dtype} {t.device}")
        if stride[3] != 1 and shape[3] != 1:
            raise ValueError(f"pages: the head dim must be contiguous (stride 1), got strides {stride}")
        self.layers = list(layers)
        self.num_pages, self.page_size, self.heads, self.head_dim = shape
        self.strides = (stride[0], stride[1], stride[2])  # page, slot, head (elements)
        self.dtype, self.device = dtype, device
        size = first.element_size()
        ptrs = [t.data_ptr() for t in layers]
        self.base = first
        offsets = tuple((p - ptrs[0]) // size for p in ptrs)
        if any((p - ptrs[0]) % size for p in ptrs):
            raise ValueError("pages: layers must be element-aligned with each other")
        self.offsets = offsets_table(device, offsets)  # (an engine's cache is allocated once: one upload)
        aligned = ptrs[0] % 16 == 0 and all(o * size % 16 == 0 for o in offsets)
        self.align = 16 // size if aligned else 1  # a hint for vector loads (layers.layer_row)

    def __len__(self) -> int:
        return len(self.layers)

    def select(self, start: int, stop: int) -> "PagedLayers":
        """Layers ``[start, stop)`` (for work done one layer, or a few, at a time): the same
        base, a slice of the same device table; nothing is uploaded."""
        if not 0 <= start < stop <= len(self.layers):
            raise ValueError(f"layers [{start}, {stop}) are outside the {len(self.layers)} layers")
        sub = object.__new__(PagedLayers)
        for name in PagedLayers.__slots__:
            object.__setattr__(sub, name, getattr(self, name))
        sub.layers = self.layers[start:stop]
        sub.offsets = self.offsets[start:stop]
        return sub


class BlockPages:
    """Where each block of a launch lies in the pages: ``page_ids`` (int32, on the device)
    is every request's page table end to end, and ``blocks`` (int32 ``[N, 2]``, on the
    device) gives block ``i``'s (index in ``page_ids`` of the page holding its first token,
    that token's slot). A launch covers rows ``[first, first + n)``. ``slot_align``: the
    largest power of two (at most 32) dividing every block's first slot. ``num_pages`` and
    ``block_tokens``: the pages and the block size the map was checked for (a launch on
    other pages, or of other blocks, is refused: :func:`check_where`)."""

    __slots__ = ("block_tokens", "blocks", "num_blocks", "num_pages", "page_ids", "page_size", "slot_align")

    def __init__(self, page_ids: torch.Tensor, blocks: torch.Tensor, page_size: int, slot_align: int = 1, *,
                 num_pages: int, block_tokens: int) -> None:
        self.page_ids, self.blocks, self.page_size, self.slot_align = page_ids, blocks, page_size, slot_align
        self.num_pages, self.block_tokens = num_pages, block_tokens
        self.num_blocks = blocks.shape[0]

    @classmethod
    def build(cls, page_ids: torch.Tensor, blocks: torch.Tensor, *, page_size: int, num_pages: int,
              block_tokens: int, device: torch.device, checked: bool = False) -> "BlockPages":
        """From host tensors (int32 ``page_ids``, int32 ``blocks`` ``[N, 2]``), checked so that
        no launch can read or write outside the pages: every page id in ``[0, num_pages)``
        (unless the caller has ``checked`` them), every block's tokens within ``page_ids``,
        slots below ``page_size``. One upload, from pinned memory on a GPU: it waits for
        nothing queued before it."""
        if page_ids.dtype != torch.int32 or blocks.dtype != torch.int32 or blocks.dim() != 2 or blocks.shape[1] != 2:
            raise ValueError("page_ids and blocks: expected int32 [M] and int32 [N, 2] host tensors")
        if not checked and page_ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(page_ids))
            if lo < 0 or hi >= num_pages:
                raise ValueError(f"page_ids: every page id must be in [0, {num_pages})")
        align = 32
        if blocks.numel():
            first, slot = blocks[:, 0].long(), blocks[:, 1].long()
            last = first + (slot + block_tokens - 1) // page_size
            if int(first.min()) < 0 or int(slot.min()) < 0 or int(slot.max()) >= page_size \
                    or int(last.max()) >= page_ids.numel():
                raise ValueError("blocks: every block's tokens must lie within page_ids")
            if int(slot.max()):  # (usually every block starts a page: slot 0)
                while align > 1 and bool((slot % align).any()):
                    align //= 2
        n = blocks.shape[0]
        if device.type == "cpu":
            on_device = torch.cat([blocks.reshape(-1), page_ids])
        else:
            # Pinned, so the copy is queued (a pageable one would wait for the caller's stream).
            packed = torch.empty(2 * n + page_ids.numel(), dtype=torch.int32, pin_memory=True)
            torch.cat([blocks.reshape(-1), page_ids], out=packed)
            on_device = packed.to(device, non_blocking=True)
        return cls(on_device[2 * n :], on_device[: 2 * n].view(n, 2), page_size, align, num_pages=num_pages,
                   block_tokens=block_tokens)

    def rows(self, first: int, n: int) -> torch.Tensor:
        if first < 0 or n < 0 or first + n > self.num_blocks:
            raise ValueError(f"blocks [{first}, {first + n}) are outside the {self.num_blocks} mapped")
        return self.blocks[first : first + n]


def check_where(pages: PagedLayers, where: BlockPages, block: int) -> None:
    """``where`` maps blocks of ``block`` tokens into these pages: the same page size, no
    page past the pages' end, on their device. The kernels trust the map (its page ids
    and slots were checked against the pages and block size it was built for): pages of
    16 addressed as pages of 32 read and write other requests' slots, and a page id past
    the end, or a longer block, memory outside the pages."""
    if where.page_size != pages.page_size:
        raise ValueError(f"where: made for a page size of {where.page_size}, the pages have {pages.page_size}")
    if where.num_pages > pages.num_pages:
        raise ValueError(f"where: made for {where.num_pages} pages, there are {pages.num_pages}")
    if block != where.block_tokens:
        raise ValueError(f"where: made for blocks of {where.block_tokens} tokens, the launch has block={block}")
    if where.blocks.device != pages.device:
        raise ValueError(f"where: on {where.blocks.device}, the pages on {pages.device}")


@triton.jit
def block_source(blk_ptr, a, bad_addr, PAGE: tl.constexpr):
    """For launch row (block) ``a`` in pages (``PAGE`` > 0, the page size): the index in the
    page ids of the page holding its first token, that token's slot, and the address of
    its own validity flag (one byte per block). Not in pages: zeros and ``bad_addr``."""
    first = 0
    slot = 0
    flag = bad_addr
    if PAGE > 0:
        first = tl.load(blk_ptr + 2 * a).to(tl.int64)
        slot = tl.load(blk_ptr + 2 * a + 1)
        flag = bad_addr + a
    return first, slot, flag


@triton.jit
def page_offsets(tok, T, s_t, s_p, pt_ptr, first, slot, PAGE: tl.constexpr):
    """Offsets (elements, from the row's layer and head) of tokens ``tok`` of a block held in
    pages of ``PAGE`` tokens: token g = slot + tok of the block's page run sits in slot
    g % PAGE of page page_ids[first + g // PAGE]. Lanes at or past T (masked by the
    caller) are clamped, so the page-id load never leaves the block's run."""
    g = slot + tl.minimum(tok, T - 1).to(tl.int32)  # (32-bit index math: a block's run is short)
    page = tl.load(pt_ptr + first + g // PAGE).to(tl.int64)
    return page * s_p + (g % PAGE).to(tl.int64) * s_t


@triton.jit
def _pages_copy_kernel(
    pg_ptr, pgt_ptr, r_ptr, bad_addr, pt_ptr, blk_ptr,
    C, T, D, XH,
    s_h, s_t, s_p,
    sr_a, sr_c, sr_t,
    BLOCK_T: tl.constexpr, D_PAD: tl.constexpr, ALIGN: tl.constexpr, PAGE: tl.constexpr,
    TO_PAGES: tl.constexpr, MASKED: tl.constexpr, NAN_BITS: tl.constexpr,
):
    # A program copies BLOCK_T tokens of one (block, layer x head) row between the pages and
    # the staging rows. Gathering (TO_PAGES false), it clears the block's host flag byte if
    # any value is NaN or Inf (layers.nonfinite).
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    t_tile = pid % n_t
    row = pid // n_t
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)
    t = (t_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.arange(0, D_PAD)
    first, slot, flag = block_source(blk_ptr, a, bad_addr, PAGE)
    off = tl.multiple_of(tl.load(pgt_ptr + c // XH), ALIGN)
    pg_ptrs = pg_ptr + off + (c % XH) * s_h + page_offsets(t, T, s_t, s_p, pt_ptr, first, slot, PAGE)[:, None] \
        + d[None, :]
    r_ptrs = r_ptr + a * sr_a + c * sr_c + t[:, None] * sr_t + d[None, :]
    ok = (t < T)[:, None] & (d < D)[None, :]
    if TO_PAGES:
        if MASKED:
            tl.store(pg_ptrs, tl.load(r_ptrs, mask=ok, other=0.0), mask=ok)
        else:
            tl.store(pg_ptrs, tl.load(r_ptrs))
    else:
        if MASKED:
            x = tl.load(pg_ptrs, mask=ok, other=0.0)
            tl.store(r_ptrs, x, mask=ok)
        else:
            x = tl.load(pg_ptrs)
            tl.store(r_ptrs, x)
        bad = nonfinite(x, NAN_BITS)
        if tl.max(tl.max(bad, axis=1), axis=0) > 0:
            tl.store(flag.to(tl.pointer_type(tl.int8)), 0)


def check_rows(rows: torch.Tensor, pages: PagedLayers, n: int, block: int, name: str) -> None:
    """``rows``: ``[n, L, H, block, D]`` (staging views, each block a row at its own stride)
    of the pages' dtype and device, indexable as [block, layer x head] rows."""
    L, H, D = len(pages), pages.heads, pages.head_dim
    if tuple(rows.shape) != (n, L, H, block, D) or rows.dtype != pages.dtype or rows.device != pages.device:
        raise ValueError(f"{name}: expected {(n, L, H, block, D)} {pages.dtype} on {pages.device}, "
                         f"got {tuple(rows.shape)} {rows.dtype} on {rows.device}")
    so = rows.stride()
    if so[4] != 1 or (L > 1 and H > 1 and so[1] != so[2] * H) or (L > 1 and H == 1 and so[1] != so[2]):
        raise ValueError(f"{name}: strides {so} cannot be indexed as [block, layer x head] rows")


def _copy(pages: PagedLayers, where: BlockPages, first: int, n: int, block: int, rows: torch.Tensor,
          flags: torch.Tensor | None, to_pages: bool) -> None:
    check_rows(rows, pages, n, block, "rows")
    check_where(pages, where, block)
    blk = where.rows(first, n)
    if n * len(pages) * pages.heads * block * pages.head_dim == 0:
        return
    D, H, L = pages.head_dim, pages.heads, len(pages)
    d_pad = triton.next_power_of_2(D)
    block_t = min(triton.next_power_of_2(block), max(1, 8192 // d_pad))
    grid = (n * L * H * triton.cdiv(block, block_t),)
    on_gpu = pages.device.type == "cuda"
    if not on_gpu and isinstance(_pages_copy_kernel, triton.runtime.JITFunction):
        raise RuntimeError("cacheseek.kernels: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    so = rows.stride()
    s_p, s_t, s_h = pages.strides
    with torch.cuda.device(pages.device) if on_gpu else contextlib.nullcontext():
        base, nan_bits = byte_view(pages.base)
        _pages_copy_kernel[(grid)](
            base, pages.offsets, byte_view(rows)[0], flags.data_ptr() if flags is not None else 0, where.page_ids, blk,
            L * H, block, D, H,
            s_h, s_t, s_p,
            so[0], so[2], so[3],
            BLOCK_T=block_t, D_PAD=d_pad, ALIGN=pages.align, PAGE=where.page_size, TO_PAGES=to_pages,
            MASKED=d_pad != D or block % block_t != 0, NAN_BITS=nan_bits, num_warps=4,
        )


def check_flags(flags: torch.Tensor, n: int) -> None:
    if flags.device.type != "cpu" or flags.dtype not in FLAG_DTYPES or flags.numel() < n \
            or not flags.is_contiguous():
        raise ValueError(f"ok_flags: {n} contiguous bytes of host memory (pinned when the pages are on a GPU)")


def gather_pages(pages: PagedLayers, where: BlockPages, first: int, n: int, block: int, *, out: torch.Tensor,
                 ok_flags: torch.Tensor) -> None:
    """Copy blocks ``[first, first + n)`` of ``where`` (``block`` tokens each, every layer of
    ``pages``) into ``out`` (``[n, L, H, block, D]``), in one launch. ``ok_flags``: ``n``
    bytes of host memory (pinned when the pages are on a GPU), one per block, that the
    kernel sets to 0 where a value copied is NaN or Inf; the caller sets them to 1 before,
    and reads them once the launch is done."""
    check_flags(ok_flags, n)
    _copy(pages, where, first, n, block, out, ok_flags, to_pages=False)


def scatter_pages(rows: torch.Tensor, pages: PagedLayers, where: BlockPages, first: int, n: int, block: int) -> None:
    """Copy ``rows`` (``[n, L, H, block, D]``) into the pages of blocks ``[first, first + n)``
    of ``where``, in one launch."""
    _copy(pages, where, first, n, block, rows, None, to_pages=True)
