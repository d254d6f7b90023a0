"""An engine's paged KV cache, as the cache reads it (ingest) and writes it (materialize_into)
in place, and the requests whose KV lives in it.

Engines keep KV in pages of ``page_size`` tokens, and each request has a page table: the
ids of the pages holding its tokens, in order (token ``t`` is in page ``ids[t // page_size]``,
slot ``t % page_size``). ``KVPages`` takes the layouts engines use:

    vLLM (flash attention)   per layer [2, num_pages, page_size, H, D]   KVPages.vllm(kv_caches)
    FlashInfer               per layer [num_pages, 2, page_size, H, D]   KVPages.flashinfer(kv, "NHD")
                             per layer [num_pages, 2, H, page_size, D]   KVPages.flashinfer(kv, "HND")
    K and V apart            per layer [num_pages, page_size, H, D]      KVPages(k, v, layout="NHD")
                             per layer [num_pages, H, page_size, D]      KVPages(k, v, layout="HND")
    SGLang token pool        per layer [slots, H, D] (pages of 1 token)  KVPages.token_pool(k, v)
    MLA latents              per layer [num_pages, page_size, C]         KVPages.mla(latent_caches)

and holds every layer's K and V as ``[num_pages, page_size, H, D]`` views (any strides):
no copy is made, the kernels address the engine's own memory. A store block of ``B``
tokens may span many pages (page size 16 and blocks of 256), lie inside one, or be ``B``
single-token slots.

``PagedSource`` is one call's blocks in those pages (which request, which block, where its
tokens are), checked, with what the codecs need to encode and decode them in place: the
kernels' tables (``cacheseek.kernels.paged``) or, without Triton, a torch gather and
scatter that give the same bytes.
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import InputError
from .layout import KVLayout
from .quant.backend import backend_for, forced_triton
from .quant.tensors import FP8_TORCH_DTYPES, dtype_str, finite_per_block, within

if TYPE_CHECKING:  # (the kernels import triton: loaded only where they run)
    from .kernels import BlockPages


PAGE_LAYOUTS = ("NHD", "HND")
PAGE_DEVICES = ("cpu", "cuda")


def _as_pages(t: Any, layout: str, where: str) -> torch.Tensor:
    """One layer's K or V as a [num_pages, page_size, H, D] view."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise InputError(f"{where}: expected [num_pages, page_size, H, D] ({layout}) pages, got shape {list(t.shape)}")
    # Pages a forward wrote under grad mode require grad: the torch path's gathers would carry
    # it into the encode's in-place copies, which refuse it (as ``kv_input`` detaches KV).
    t = t.detach()
    return t if layout == "NHD" else t.transpose(1, 2)


def _per_layer(tensors: Any, where: str) -> Any:
    """``tensors`` (one per layer: a list, a tuple, or a tensor whose first dim is the
    layers), or ``InputError`` (iterating anything else failed naming nothing)."""
    if not isinstance(tensors, (list, tuple, torch.Tensor)):
        raise InputError(f"{where}: expected a sequence of per-layer tensors, got {type(tensors).__name__}")
    return tensors


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """(stride, size) of the dims of ``t`` that take more than one index, largest stride first."""
    return sorted(((st, n) for st, n in zip(t.stride(), t.shape) if n > 1), reverse=True)


def _self_overlaps(t: torch.Tensor) -> bool:
    # Each stride past what the smaller ones span: then no two indices meet. Engines'
    # layouts (pages, slots, heads, dims nested, any gaps) all pass.
    span = 0
    for st, n in reversed(_dims(t)):
        if st <= span:
            return True
        span += (n - 1) * st
    return False


def _reaches(d: int, dims: list[tuple[int, int]]) -> bool:
    """Whether ``d`` elements is a difference of two offsets of a view of ``dims`` (as
    ``_dims``, not self-overlapping): whether two such views ``d`` apart share an element."""
    if not dims:
        return d == 0
    (st, n), rest = dims[0], dims[1:]
    below = sum((m - 1) * s for s, m in rest)
    lo, hi = max(-(n - 1), -((below - d) // st)), min(n - 1, (d + below) // st)
    return any(_reaches(d - c * st, rest) for c in range(lo, hi + 1))  # (at most two c: st > below)


def _beside(a: list[tuple[int, int]], b: list[tuple[int, int]], d: int) -> bool:
    """Whether views of ``a`` and ``b`` (as ``_dims``), ``b`` starting ``d > 0`` elements
    after ``a``, interleave without sharing an element, in the one way engines interleave
    K and V of other strides (vLLM's CPU pages: K column-major, V row-major, per page and
    head): the same outer dims, nested without gaps (offsets every ``S`` elements), and
    within each step of ``S`` all of ``a``'s inner elements before all of ``b``'s."""
    outer = []
    while a and b and a[0] == b[0]:
        outer.append(a[0])
        a, b = a[1:], b[1:]
    if not outer:
        return False
    step = outer[-1][0]
    for (st, _), (inner_st, inner_n) in zip(outer, outer[1:]):
        if st != inner_st * inner_n:
            return False
    span_a, span_b = (sum((n - 1) * st for st, n in dims) for dims in (a, b))
    return span_a < d and d + span_b < step


def _check_disjoint(views: list[tuple[str, torch.Tensor]]) -> None:
    """``InputError`` naming the first view that shares an element with itself or another."""
    spans = []
    for j, (here, t) in enumerate(views):
        if not t.numel():
            continue
        if _self_overlaps(t):
            raise InputError(f"pages {here}: its pages, slots or heads overlap one another (shape {list(t.shape)}, "
                             f"strides {list(t.stride())})")
        size = t.element_size()
        end = t.data_ptr() + (sum((n - 1) * st for st, n in zip(t.stride(), t.shape)) + 1) * size
        spans.append((t.data_ptr(), end, j, t))
    clashes = []  # (the later view, the earlier one, whether they start at one address)
    active: list[tuple[int, int, int, torch.Tensor]] = []
    for start, end, j, t in sorted(spans, key=lambda s: (s[0], s[2])):
        active = [a for a in active if a[1] > start]
        for a_start, _, i, a in active:
            d, size = start - a_start, t.element_size()
            # Address ranges that meet hold disjoint elements only where the views interleave
            # (FlashInfer's K and V): the same strides, and no offset of one on the other's.
            if not d or a.element_size() != size or d % size:
                clashes.append((max(i, j), min(i, j), not d))
            elif a.stride() == t.stride() and not _reaches(d // size, _dims(t)):
                continue
            elif a.stride() != t.stride() and _beside(_dims(a), _dims(t), d // size):
                continue
            else:
                clashes.append((max(i, j), min(i, j), not d))
        active.append((start, end, j, t))
    if clashes:  # named in the views' order, whatever order the allocator put them in
        later, earlier, same = min(clashes)
        what = "the same memory as" if same else "shares memory with"
        raise InputError(f"pages {views[later][0]}: {what} {views[earlier][0]}; every layer's K and V must be "
                         "pages of their own")


class KVPages:
    """Every layer's K and V pages of an engine's KV cache, held as ``[num_pages, page_size,
    H, D]`` views of the engine's own tensors. Build it once (the engine's cache lives on)
    and hand out ``at(page_ids)`` per request."""

    __slots__ = ("_kernel_pages", "_strided", "device", "dtype", "head_dim", "k", "num_kv_heads", "num_layers",
                 "num_pages", "page_size", "v")

    def __init__(self, k: Sequence[torch.Tensor] | torch.Tensor, v: Sequence[torch.Tensor] | torch.Tensor, *,
                 layout: str = "NHD") -> None:
        """``k``, ``v``: per layer a ``[num_pages, page_size, H, D]`` (NHD) or ``[num_pages, H,
        page_size, D]`` (HND) tensor: a list or tuple of them, or one tensor whose first dim is
        the layers."""
        if layout not in PAGE_LAYOUTS:
            raise InputError(f"layout: expected one of {list(PAGE_LAYOUTS)}, got {layout!r}")
        # A side's layers in one tensor (an engine's [L, num_pages, ...]), as the factories take them.
        k, v = (list(t.unbind(0)) if isinstance(t, torch.Tensor) and t.dim() else t for t in (k, v))
        if not isinstance(k, (list, tuple)) or not isinstance(v, (list, tuple)) or len(k) != len(v) or not k:
            raise InputError("pages: expected K and V as two equally long, non-empty sequences of per-layer tensors")
        self.k = [_as_pages(t, layout, f"pages layer {i} K") for i, t in enumerate(k)]
        self.v = [_as_pages(t, layout, f"pages layer {i} V") for i, t in enumerate(v)]
        first = self.k[0]
        shape, dtype, device = tuple(first.shape), first.dtype, first.device
        self._strided: str | None = None  # the first view whose head dim is not contiguous
        for name, views in (("K", self.k), ("V", self.v)):
            for i, t in enumerate(views):
                if tuple(t.shape) != shape:
                    raise InputError(f"pages layer {i} {name}: shape {list(t.shape)}, layer 0 K has {list(shape)}")
                if t.dtype != dtype:
                    raise InputError(f"pages layer {i} {name}: dtype {t.dtype}, layer 0 K has {dtype}")
                if t.device != device:
                    raise InputError(f"pages layer {i} {name}: on {t.device}, layer 0 K is on {device}")
                # The kernels read a token's channels as one run; the torch path (pages in host
                # memory, unless the kernels are forced) indexes any strides: vLLM's CPU pages
                # keep K column-major.
                if t.stride(3) != 1 and t.shape[3] != 1:
                    if device.type != "cpu" or forced_triton():
                        raise InputError(f"pages layer {i} {name}: the head dim must be contiguous, "
                                         f"strides {t.stride()}")
                    if self._strided is None:
                        self._strided = (f"pages layer {i} {name}: the head dim must be contiguous for the Triton "
                                         f"kernels, strides {t.stride()}")
            if len({t.stride() for t in views}) != 1:
                raise InputError(f"pages {name}: every layer must have the same strides")
        if 0 in shape[1:]:
            # (a load into pages of no token wrote nothing and answered a miss; an ingest named
            # the page table; no page at all is a cache all the same, whose page ids are refused)
            what = "0 tokens a page" if not shape[1] else "0 KV heads" if not shape[2] else "a head dim of 0"
            raise InputError(f"pages: {what} (layer 0 K: [num_pages, page_size, H, D] = {list(shape)}); "
                             "they hold no KV")
        if device.type not in PAGE_DEVICES:
            # Refused here, not at the first call: a meta tensor takes any write without
            # effect (a load would report tokens written nowhere) and fails any read deep in
            # torch; the data paths (streams, staging, kernels) are built for cpu and cuda.
            held = "which holds no data" if device.type == "meta" else "which the cache cannot read or write"
            raise InputError(f"pages: on {device}, {held}; expected pages on {' or '.join(PAGE_DEVICES)}")
        # Views that share memory: given the K tensors as V too (or one layer's tensor
        # twice, or V a page past K), an ingest stored K as V and a load wrote V over K, both
        # reported done; pages expanded from one page took every page's load into one.
        _check_disjoint([(f"layer {i} {name}", t) for name, views in (("K", self.k), ("V", self.v))
                         for i, t in enumerate(views)])
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = shape
        self.num_layers, self.dtype, self.device = len(self.k), dtype, device
        self._kernel_pages: dict[tuple[int, int], Any] = {}

    @classmethod
    def vllm(cls, kv_caches: Sequence[torch.Tensor]) -> KVPages:
        """vLLM's flash-attention layout: per layer one ``[2, num_pages, page_size, H, D]``
        tensor, K at index 0 and V at 1."""
        for i, t in enumerate(_per_layer(kv_caches, "pages")):
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[0] != 2:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"pages layer {i}: expected vLLM's [2, num_pages, page_size, H, D], got {got}")
        return cls([t[0] for t in kv_caches], [t[1] for t in kv_caches])

    @classmethod
    def flashinfer(cls, kv_caches: Sequence[torch.Tensor], layout: str = "NHD") -> KVPages:
        """FlashInfer's paged layout, K and V in one tensor per layer: ``[num_pages, 2,
        page_size, H, D]`` (NHD) or ``[num_pages, 2, H, page_size, D]`` (HND)."""
        for i, t in enumerate(_per_layer(kv_caches, "pages")):
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[1] != 2:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"pages layer {i}: expected FlashInfer's [num_pages, 2, ...] ({layout}), got {got}")
        return cls([t[:, 0] for t in kv_caches], [t[:, 1] for t in kv_caches], layout=layout)

    @classmethod
    def token_pool(cls, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> KVPages:
        """A token pool (SGLang's ``MHATokenToKVPool``): per layer ``[slots, H, D]``, a page
        table of slot indices (pages of one token)."""
        for name, side in (("K", k), ("V", v)):
            for i, t in enumerate(_per_layer(side, f"pages {name}")):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise InputError(f"pages layer {i} {name}: expected a [slots, H, D] token pool, got {got}")
        return cls([t.unsqueeze(1) for t in k], [t.unsqueeze(1) for t in v])

    @classmethod
    def mla(cls, latent_caches: Sequence[torch.Tensor] | torch.Tensor) -> KVPages:
        """An MLA model's paged latent cache (vLLM's MLA backends, SGLang's
        ``MLATokenToKVPool`` with pages of 1): per layer ``[num_pages, page_size, C]``, one
        latent of C elements per token (``KVLayout.mla``). Its halves are the K and V views:
        the store keeps the latent byte for byte under Raw, and loads write it back whole."""
        ks, vs = [], []
        for i, t in enumerate(_per_layer(latent_caches, "pages")):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[2] % 2:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"pages layer {i}: expected an MLA latent cache [num_pages, page_size, C] "
                                 f"with C even, got {got}")
            half = t.shape[2] // 2
            ks.append(t[:, :, None, :half])
            vs.append(t[:, :, None, half:])
        return cls(ks, vs)

    def at(self, page_ids: Any) -> PagedKV:
        """The KV of one request: the tokens held by ``page_ids`` (its page table, in order)."""
        return PagedKV(self, page_ids)

    def check(self, layout: KVLayout) -> None:
        """The pages fit a cache of ``layout``; raises ``InputError`` naming what does not."""
        if self.num_layers != layout.num_layers:
            raise InputError(f"pages: {self.num_layers} layers, the cache's layout has {layout.num_layers}")
        if (self.num_kv_heads, self.head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise InputError(f"pages: {self.num_kv_heads} KV heads of dim {self.head_dim}, the cache's layout has "
                             f"{layout.num_kv_heads} of dim {layout.head_dim}")
        if self.dtype != layout.torch_dtype:
            # (vLLM allocates an fp8 cache's pages as uint8: the same bytes, seen as fp8)
            view = f" (fp8 pages held as uint8: make them of t.view(torch.{layout.dtype}))" \
                if layout.fp8 and self.dtype == torch.uint8 else ""
            raise InputError(f"pages: dtype {self.dtype}, the cache's layout says {layout.dtype}{view}")
        if self._strided is not None and backend_for(self.k[0]) == "triton":
            # Host pages built while the torch path was in use, the kernels asked for since
            # (CACHESEEK_KIVI_BACKEND=triton): they failed in the launch with a ValueError.
            raise InputError(self._strided)

    def kernel_pages(self, layers: tuple[int, int] | None = None):
        """(K, V) as ``cacheseek.kernels.PagedLayers`` (made once: their layer tables are
        uploaded once), or layers ``[l0, l1)`` of them."""
        key = (0, self.num_layers)
        pair = self._kernel_pages.get(key)
        if pair is None:
            from . import kernels

            pair = self._kernel_pages[key] = (kernels.PagedLayers(self.k), kernels.PagedLayers(self.v))
        if layers is None or tuple(layers) == key:
            return pair
        return pair[0].select(*layers), pair[1].select(*layers)

    def __repr__(self) -> str:
        return (f"KVPages({self.num_layers} layers, {self.num_pages} pages of {self.page_size} tokens, "
                f"H={self.num_kv_heads}, D={self.head_dim}, {self.dtype}, {self.device})")


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One request's KV in an engine's pages: ``pages.at(page_ids)``. Accepted as ``kv`` by
    ``ingest``, and as the destination of ``materialize_into``."""

    pages: KVPages
    page_ids: Any


@dataclass(frozen=True, slots=True)
class PagedRequest:
    """One request of a batch: its keys (token ids, a ``Prompt``, or bytes per block), its
    page table, and (``materialize_into_batch``) at most how many tokens to load, and from
    which token on to write them: the blocks before ``start`` (a multiple of the block
    size) are in the pages already (an engine's own prefix hit, pages it may share with
    other requests), so they are neither fetched nor written, but must be stored for the
    blocks after them to load. To ``ingest_batch``, ``start`` says the blocks before it
    were stored by an earlier call of the caller's (a prompt saved chunk by chunk): they
    are hashed, as the chain's keys need them, but neither looked up, encoded nor sent,
    and the ``IngestResult`` counts the blocks from ``start`` on."""

    keys: Any
    page_ids: Any
    max_tokens: int | None = None
    start: int = 0


# Integer dtypes a page table may come in (not bool, nor complex: a complex table lost its
# imaginary part on the way to int64).
_ID_DTYPES = frozenset(d for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                                   getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                   getattr(torch, "uint64", None)) if d is not None)


def host_page_tables(tables: Sequence[Any]) -> list[Any]:
    """``tables`` with those that are page-id tensors on a GPU copied to the host together, one
    copy per device: each copy waits for the work queued before it (the engine's forward
    too), so a call of N requests' tables on a GPU waited N times. Anything else as given
    (``page_table`` checks and names it)."""
    out = list(tables)
    on_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tables):
        if isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype in _ID_DTYPES and t.device.type == "cuda":
            on_device.setdefault(t.device, []).append(i)
    for idx in on_device.values():
        if len(idx) < 2:
            continue
        flat = torch.cat([tables[i].to(torch.int64) for i in idx]).cpu()
        for i, part in zip(idx, flat.split([tables[i].numel() for i in idx])):
            out[i] = part
    return out


def page_table(page_ids: Any, pages: KVPages, where: str) -> torch.Tensor:
    """``page_ids`` (a sequence of ints, or a 1-D integer tensor on any device) as an int32
    host tensor, checked: every id a page of ``pages``, none twice."""
    if isinstance(page_ids, torch.Tensor):
        if page_ids.dim() != 1 or page_ids.dtype not in _ID_DTYPES:
            raise InputError(f"{where}: expected a 1-D integer tensor, got {page_ids.dtype} {list(page_ids.shape)}")
        if page_ids.device.type == "meta":
            raise InputError(f"{where}: a meta tensor holds no page ids")
        ids = page_ids.to("cpu", torch.int64)
    elif isinstance(page_ids, (list, tuple)):
        # array() takes ints only (a float or a nested list is a TypeError), ~8x faster
        # than torch.tensor() on a list (the page tables of a 16K prompt: 1K-16K ids).
        try:
            ids = torch.frombuffer(array.array("q", page_ids), dtype=torch.int64) if page_ids else \
                torch.zeros(0, dtype=torch.int64)
        except (TypeError, OverflowError) as exc:
            raise InputError(f"{where}: expected a flat sequence of int page ids ({exc})") from None
        # array() takes a bool as 0 or 1 (a mask given as the table read pages 1 and 0), and
        # a 0-d bool tensor too (what ``list(mask)`` holds), as torch refuses a tensor of
        # bools; only ids 0 and 1 can have been one.
        for j in ((ids == 0) | (ids == 1)).nonzero().flatten().tolist():
            if isinstance(page_ids[j], bool) or getattr(page_ids[j], "dtype", None) == torch.bool:
                raise InputError(f"{where}[{j}]: a bool, not a page id")
    else:
        raise InputError(f"{where}: expected a list of page ids or a 1-D tensor, got {type(page_ids).__name__}")
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= pages.num_pages:
            j = int(((ids < 0) | (ids >= pages.num_pages)).nonzero()[0])
            raise InputError(f"{where}[{j}]: page {int(ids[j])} is outside the {pages.num_pages} pages")
        if torch.unique(ids).numel() != ids.numel():
            sorted_ids, _ = ids.sort()
            dup = int(sorted_ids[1:][sorted_ids[1:] == sorted_ids[:-1]][0])
            raise InputError(f"{where}: page {dup} appears twice")
    return ids.to(torch.int32)


class PagedSource:
    """The blocks of one call, in pages: block ``i`` of the call (a launch row) is block
    ``blocks[i]`` of request ``requests[i]``. Checked and planned on the host once; what
    the kernels need goes to the device in one upload, the first time they need it."""

    __slots__ = ("_where", "block_tokens", "checked", "device", "launched", "owner", "page_ids", "pages", "rows")

    def __init__(self, pages: KVPages, tables: Sequence[torch.Tensor], rows: Sequence[tuple[int, int]],
                 block_tokens: int) -> None:
        """``tables``: each request's checked page table (``page_table``); ``rows``: the
        call's blocks as (request, block index), each covered by its request's table."""
        self.pages, self.block_tokens, self.device = pages, block_tokens, pages.device
        P = pages.page_size
        starts, total = [], 0
        for table in tables:
            starts.append(total)
            total += table.numel()
        if len(tables) == 1:
            self.page_ids = tables[0]
        else:
            # (no tables: an empty batch, whose call has no rows)
            self.page_ids = torch.cat(list(tables)) if tables else torch.zeros(0, dtype=torch.int32)
        self.owner = [r for r, _ in rows]
        flat = array.array("i")
        for r, b in rows:  # (a plain loop: torch ops on a few dozen numbers cost more)
            tok = b * block_tokens
            flat.append(starts[r] + tok // P)
            flat.append(tok % P)
        self.rows = torch.frombuffer(flat, dtype=torch.int32).view(-1, 2) if rows else \
            torch.zeros((0, 2), dtype=torch.int32)
        self._where: BlockPages | None = None
        self.launched: list[tuple[int, int, torch.Tensor]] = []  # (first, n, flags) of each encode
        self.checked: list[tuple[int, int, torch.Tensor]] = []  # (first, n, flags) of check_finite

    def __len__(self) -> int:
        return self.rows.shape[0]

    def kernel_pages(self, layers: tuple[int, int] | None = None):
        """(K ``PagedLayers``, V ``PagedLayers``, ``BlockPages``) for the Triton kernels."""
        if self._where is None:
            from . import kernels

            self._where = kernels.BlockPages.build(self.page_ids, self.rows, page_size=self.pages.page_size,
                                                   num_pages=self.pages.num_pages, block_tokens=self.block_tokens,
                                                   device=self.device, checked=True)
        k, v = self.pages.kernel_pages(layers)
        return k, v, self._where

    def encode(self, codec: Any, first: int, n: int, out: list[torch.Tensor]) -> torch.Tensor:
        """``codec.encode_pages_into`` of blocks ``[first, first + n)`` into ``out``; the flags
        are kept, so that a bad input can be traced to its request (:meth:`bad_blocks`)."""
        flags = codec.encode_pages_into(self, first, n, self.block_tokens, out)
        self.launched.append((first, n, flags))
        return flags

    def check_values(self, codec: Any, first: int, n: int, *, chunk_bytes: int = 64 << 20) -> None:
        """``InputError`` if the KV of blocks ``[first, first + n)`` is KV ``codec`` refuses:
        NaN or Inf in K or V of any layer, or (beyond the codec's ``safe_magnitudes``, where
        its encode of the block decides) a range its stats cannot hold. One layer and side
        at a time, at most ``chunk_bytes`` of blocks gathered out of the pages at once:
        exactly the blocks' tokens, never the rest of a page. The verdicts stay on the device
        and are read once, at the end: a read per piece made the host wait for the device
        at every piece, while an in-place ingest's copies waited for the host (raw 16K-token
        paged ingests took 1.5x the contiguous ones on the H200). Before an encode reaches
        them: see ``InPlaceIngest``. The result is kept for :meth:`bad_blocks`."""
        if n <= 0:
            return
        bounds = codec.safe_magnitudes(dtype_str(self.pages.dtype), self.pages.head_dim)
        B, H, D = self.block_tokens, self.pages.num_kv_heads, self.pages.head_dim
        page, slot = self._token_index(first, n)
        step = max(1, chunk_bytes // (B * H * D * self.pages.dtype.itemsize))
        finite = torch.ones(n, dtype=torch.bool, device=self.device)
        inside = finite.clone() if bounds is not None else None
        for side, views in (("k", self.pages.k), ("v", self.pages.v)):
            for view in views:
                for a in range(0, n, step):
                    b = min(n, a + step)
                    x = _tokens(view, page[a * B : b * B], slot[a * B : b * B]).view(b - a, B * H * D)
                    finite[a:b] &= finite_per_block(x)
                    if inside is not None:
                        inside[a:b] &= within(x, bounds[0 if side == "k" else 1], dim=0)
        verdict = torch.stack([finite.all(), (finite if inside is None else inside).all()]).tolist()
        refused = None if verdict[0] else InputError("k or v: holds NaN or Inf; input rejected")
        if refused is None and not verdict[1]:
            assert inside is not None
            for j in (~inside).nonzero().flatten().tolist():
                k, v = self.gather("k", first + j, 1)[0], self.gather("v", first + j, 1)[0]  # [L, H, B, D]
                try:
                    for layer in range(k.shape[0]):
                        codec.encode(k[layer], v[layer])
                except InputError as e:
                    finite[j], refused = False, e
        self.checked.append((first, n, finite.view(1, n)))
        if refused is not None:
            raise refused

    def bad_blocks(self) -> list[int]:
        """Rows whose flags say NaN or Inf, among the encodes whose work is done (call it
        after a codec's ``check_finite`` has failed: the device has run them) and the
        blocks ``check_finite`` checked."""
        bad = []
        for first, n, flags in self.launched + self.checked:
            ok = flags.reshape(flags.shape[0], -1).all(0).tolist() if flags.dim() > 1 else [bool(flags.all())] * n
            bad += [first + j for j, good in enumerate(ok) if not good]
        return bad

    # -- the torch path (no Triton): the same bytes, through index copies ---------------------

    def _token_index(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        P, B = self.pages.page_size, self.block_tokens
        rows = self.rows[first : first + n].long()
        g = rows[:, 1:2] + torch.arange(B)  # [n, B]
        page = self.page_ids.long()[rows[:, 0:1] + g // P]
        return page.reshape(-1).to(self.device), (g % P).reshape(-1).to(self.device)

    def _views(self, side: str, layers: tuple[int, int] | None) -> list[torch.Tensor]:
        views = self.pages.k if side == "k" else self.pages.v
        return views if layers is None else views[layers[0] : layers[1]]

    def gather(self, side: str, first: int, n: int, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Blocks ``[first, first + n)`` of ``side`` ("k"/"v") as a new ``[n, L, H, B, D]`` tensor."""
        page, slot = self._token_index(first, n)
        B = self.block_tokens
        per_layer = [_tokens(view, page, slot) for view in self._views(side, layers)]  # each [n*B, H, D]
        x = torch.stack(per_layer)  # [L, n*B, H, D]
        L, _, H, D = x.shape
        return x.view(L, n, B, H, D).permute(1, 0, 3, 2, 4)

    def scatter(self, side: str, rows: torch.Tensor, first: int, n: int,
                layers: tuple[int, int] | None = None) -> None:
        """Write ``rows`` (``[n, L, H, B, D]``) into the pages of blocks ``[first, first + n)``."""
        page, slot = self._token_index(first, n)
        for layer, view in enumerate(self._views(side, layers)):
            x = rows[:, layer]  # [n, H, B, D]
            x = x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])
            if view.dtype in FP8_TORCH_DTYPES:  # (torch's CPU index_copy_ has no fp8: move the bytes)
                view, x = view.view(torch.uint8), x.view(torch.uint8)
            # An engine's cache allocated under inference mode takes in-place writes only
            # inside it (the kernels write by address, whatever the mode).
            with torch.inference_mode() if view.is_inference() else contextlib.nullcontext():
                if _mergeable(view):
                    view.flatten(0, 1).index_copy_(0, page * view.shape[1] + slot, x)
                else:
                    view[page, slot] = x


def _mergeable(view: torch.Tensor) -> bool:
    return view.stride(0) == view.shape[1] * view.stride(1)


def _tokens(view: torch.Tensor, page: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Tokens (page, slot) of a ``[pages, page_size, H, D]`` view as ``[tokens, H, D]``:
    ``index_select`` over pages and slots merged where it can (advanced indexing is far
    slower on a CPU)."""
    if _mergeable(view):
        return view.flatten(0, 1).index_select(0, page * view.shape[1] + slot)
    return view[page, slot]


__all__ = ["KVPages", "PagedKV", "PagedRequest", "PagedSource", "host_page_tables", "page_table"]
