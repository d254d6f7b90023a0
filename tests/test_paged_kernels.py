"""The paged kernels (``cacheseek/kernels/paged.py``, ``kivi.quantize_pages`` / ``dequantize_pages``)
against the contiguous path they must equal bit for bit: ``quantize_layers`` and
``gather_layers`` reading per-layer ``[H, T, D]`` KV, ``dequantize`` into a contiguous tensor.

Engine layouts: vLLM's flash layout (per layer ``[2, pages, page_size, H, D]``), NHD and
HND pages with K and V apart, and a token pool (SGLang: ``[slots, H, D]``, pages of one
token); page sizes below, equal to and above the store block. On a machine without CUDA
these run in the Triton interpreter (tiny shapes); on a GPU natively.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cacheseek import kernels  # noqa: E402
from cacheseek.kernels import BlockPages, PagedLayers  # noqa: E402
from cacheseek.quant.payload import AXIS_CHANNELS, AXIS_TOKENS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16 = torch.float16, torch.bfloat16
LAYOUTS = ["flash", "nhd", "hnd", "pool"]


def engine_pages(kind: str, L: int, H: int, D: int, num_pages: int, page: int, dtype, seed: int = 0):
    """An engine's KV cache filled with garbage: (K views, V views, the tensors themselves),
    the views ``[num_pages, page, H, D]`` per layer as ``cs.KVPages`` makes them."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEVICE)

    if kind == "flash":
        owned = [make(2, num_pages, page, H, D) for _ in range(L)]
        return [t[0] for t in owned], [t[1] for t in owned], owned
    if kind == "nhd":
        k, v = [make(num_pages, page, H, D) for _ in range(L)], [make(num_pages, page, H, D) for _ in range(L)]
        return k, v, k + v
    if kind == "hnd":
        k, v = [make(num_pages, H, page, D) for _ in range(L)], [make(num_pages, H, page, D) for _ in range(L)]
        return [t.transpose(1, 2) for t in k], [t.transpose(1, 2) for t in v], k + v
    assert kind == "pool" and page == 1
    k, v = [make(num_pages, H, D) for _ in range(L)], [make(num_pages, H, D) for _ in range(L)]
    return [t.unsqueeze(1) for t in k], [t.unsqueeze(1) for t in v], k + v


def write_tokens(views, kv_layers, ids: list[int], page: int) -> None:
    """Put per-layer [H, T, D] KV into the pages named by ``ids`` (token g at page
    ids[g // page], slot g % page), as an engine's forward would have."""
    T = kv_layers[0].shape[1]
    g = torch.arange(T)
    pages = torch.tensor(ids, dtype=torch.long)[g // page].to(DEVICE)
    slots = (g % page).to(DEVICE)
    for view, x in zip(views, kv_layers):
        view[pages, slots] = x.transpose(0, 1)


def where_for(tables: list[list[int]], blocks: list[tuple[int, int]], page: int, block: int, num_pages: int):
    """BlockPages for ``blocks`` = [(request, block index)], the requests' page ids end to end."""
    starts, flat = [], []
    for ids in tables:
        starts.append(len(flat))
        flat += ids
    rows = [(starts[r] + b * block // page, b * block % page) for r, b in blocks]
    return BlockPages.build(torch.tensor(flat, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32).reshape(-1, 2),
                            page_size=page, num_pages=num_pages, block_tokens=block, device=torch.device(DEVICE))


def request(seed: int, L: int, H: int, T: int, D: int, dtype):
    gen = torch.Generator().manual_seed(100 + seed)
    out = []
    for _ in range(L):
        k = torch.randn(H, T, D, generator=gen)
        k[:, :, 3] *= 15  # an outlier channel
        out.append((k.to(dtype).to(DEVICE), torch.randn(H, T, D, generator=gen).to(dtype).to(DEVICE)))
    return out


def page_tables(num_requests: int, tokens: int, page: int, num_pages: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled page ids for each request."""
    per = -(-tokens // page)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    assert per * num_requests <= num_pages
    return [perm[r * per : (r + 1) * per] for r in range(num_requests)]


def staging(n: int, L: int, H: int, block: int, D: int, bits: int, group: int, axis: int, stats, pad: int = 24):
    """(q, scale, min) of n blocks as [n, L, H, ...] views of rows at a padded stride (as
    the store's staging buffers), poisoned."""
    from cacheseek.kernels.kivi import _shapes

    q_shape, st_shape = _shapes((n, L, H, block, D), bits, group, axis)
    out = []
    for shape, dtype in ((q_shape, torch.int32), (st_shape, stats), (st_shape, stats)):
        per = 1
        for x in shape[1:]:
            per *= x
        buf = torch.full((n * (per + pad),), -7, dtype=torch.int32 if dtype == torch.int32 else torch.float32)
        buf = buf.to(dtype).to(DEVICE)
        inner = torch.empty(shape[1:]).stride()
        out.append(buf.as_strided(shape, (per + pad, *inner)))
    return tuple(out)


def flags(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool, pin_memory=DEVICE == "cuda")


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# (layout, page size, block tokens, bits, group, dtype, stats): every KIVI setting in a few
# shapes small enough for the interpreter; Raw separately.
CASES = [
    ("flash", 16, 32, 4, 32, F16, F16),
    ("nhd", 8, 32, 2, 32, BF16, F16),
    ("hnd", 32, 32, 8, 32, F16, torch.float32),
    ("pool", 1, 32, 4, 32, BF16, torch.float32),
    ("flash", 64, 32, 4, 32, F16, F16),  # pages larger than a store block
    ("hnd", 24, 32, 4, 32, F16, F16),  # a page size that is no power of two: blocks start mid-page
    ("hnd", 16, 128, 4, 128, F16, F16),
    ("nhd", 32, 128, 2, 128, BF16, torch.float32),
    ("flash", 16, 128, 8, 128, BF16, F16),
]


@pytest.mark.parametrize("kind, page, block, bits, group, dtype, stats", CASES,
                         ids=[f"{c[0]}-p{c[1]}-b{c[2]}-int{c[3]}-g{c[4]}-{str(c[5])[6:]}-{str(c[6])[6:]}"
                              for c in CASES])
def test_kivi_pages_equal_the_contiguous_path(kind, page, block, bits, group, dtype, stats):
    L, H, D = 2, 2, 64
    n_req, blocks_per = 2, 2 if block == 32 else 1
    T = blocks_per * block
    num_pages = n_req * -(-T // page) + 3
    k_views, v_views, _ = engine_pages(kind, L, H, D, num_pages, page, dtype)
    tables = page_tables(n_req, T, page, num_pages, seed=bits)
    reqs = [request(r, L, H, T, D, dtype) for r in range(n_req)]
    for ids, kv in zip(tables, reqs):
        write_tokens(k_views, [k for k, _ in kv], ids, page)
        write_tokens(v_views, [v for _, v in kv], ids, page)
    # One launch covering every block of both requests, the second request's first.
    order = [(1, b) for b in range(blocks_per)] + [(0, b) for b in range(blocks_per)]
    where = where_for(tables, order, page, block, num_pages)
    n = len(order)
    for side, axis, views in (("k", AXIS_TOKENS, k_views), ("v", AXIS_CHANNELS, v_views)):
        got, ok = staging(n, L, H, block, D, bits, group, axis, stats), flags(n)
        kernels.quantize_pages(PagedLayers(views), where, 0, n, block, bits=bits, group=group, axis=axis, out=got,
                               ok_flags=ok)
        _sync()
        assert ok.all()
        for row, (r, b) in enumerate(order):
            want, want_ok = staging(1, L, H, block, D, bits, group, axis, stats), flags(1)
            layers = [k if side == "k" else v for k, v in reqs[r]]
            kernels.quantize_layers(layers, b * block, 1, block, bits=bits, group=group, axis=axis, out=want,
                                    ok_flag=want_ok)
            _sync()
            for g, w in zip(got, want):
                assert torch.equal(g[row], w[0]), f"{side} block {row} differs"

        # Decode straight into fresh pages: exactly the contiguous decode, nothing else touched.
        fresh_k, fresh_v, owned = engine_pages(kind, L, H, D, num_pages, page, dtype, seed=9)
        before = [t.clone() for t in owned]
        dest = fresh_k if side == "k" else fresh_v
        kernels.dequantize_pages(*got, bits=bits, group=group, axis=axis, pages=PagedLayers(dest), where=where,
                                 first=0, n=n, block=block)
        contiguous = [kernels.dequantize(g, s, m, bits=bits, group=group, axis=axis,
                                         shape=(L, H, block, D), dtype=dtype)
                      for row, (g, s, m) in enumerate(zip(*got))]
        _sync()
        written = torch.zeros(num_pages, page, dtype=torch.bool)
        for row, (r, b) in enumerate(order):
            for t in range(block):
                gtok = b * block + t
                pg, sl = tables[r][gtok // page], gtok % page
                written[pg, sl] = True
                for layer in range(L):
                    assert torch.equal(dest[layer][pg, sl].cpu(), contiguous[row][layer, :, t].cpu())
        for view_now, view_before in zip(dest, (before_view(kind, before, side, L))):
            assert torch.equal(view_now[~written.to(DEVICE)].cpu(), view_before[~written.to(DEVICE)].cpu())


def before_view(kind, before, side, L):
    """The [N, P, H, D] views of the untouched copies ``before`` for ``side``."""
    if kind == "flash":
        return [t[0 if side == "k" else 1] for t in before]
    half = before[:L] if side == "k" else before[L:]
    if kind == "hnd":
        return [t.transpose(1, 2) for t in half]
    if kind == "pool":
        return [t.unsqueeze(1) for t in half]
    return half


@pytest.mark.parametrize("kind, page", [("flash", 16), ("hnd", 8), ("pool", 1), ("nhd", 64)])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_raw_gather_and_scatter_are_byte_copies(kind, page, dtype):
    L, H, D, block = 3, 2, 64, 32
    T = 2 * block
    num_pages = 2 * -(-T // page) + 2
    k_views, v_views, _ = engine_pages(kind, L, H, D, num_pages, page, dtype)
    tables = page_tables(2, T, page, num_pages, seed=5)
    reqs = [request(r, L, H, T, D, dtype) for r in range(2)]
    for ids, kv in zip(tables, reqs):
        write_tokens(k_views, [k for k, _ in kv], ids, page)
        write_tokens(v_views, [v for _, v in kv], ids, page)
    order = [(0, 1), (1, 0), (1, 1), (0, 0)]
    where = where_for(tables, order, page, block, num_pages)
    n = len(order)
    for side, views in (("k", k_views), ("v", v_views)):
        rows = torch.full((n, L, H, block + 1, D), 7.0, dtype=dtype, device=DEVICE)[:, :, :, :block]  # padded rows
        ok = flags(n)
        kernels.gather_pages(PagedLayers(views), where, 0, n, block, out=rows, ok_flags=ok)
        _sync()
        assert ok.all()
        for row, (r, b) in enumerate(order):
            want = torch.stack([(k if side == "k" else v)[:, b * block : (b + 1) * block] for k, v in reqs[r]])
            assert torch.equal(rows[row], want)
        fresh_k, fresh_v, owned = engine_pages(kind, L, H, D, num_pages, page, dtype, seed=3)
        dest = fresh_k if side == "k" else fresh_v
        kernels.scatter_pages(rows, PagedLayers(dest), where, 0, n, block)
        _sync()
        for r, ids in enumerate(tables):
            g = torch.arange(T)
            pg = torch.tensor(ids)[g // page].to(DEVICE)
            got = torch.stack([view[pg, (g % page).to(DEVICE)].transpose(0, 1) for view in dest])
            want = torch.stack([(k if side == "k" else v) for k, v in reqs[r]])
            assert torch.equal(got, want)


def test_one_layer_at_a_time_and_a_subset_of_blocks():
    """``select`` (layers) and ``first``/``n`` (blocks) cut a launch down without any upload:
    what layer-wise loading builds on."""
    L, H, D, block, page = 3, 2, 64, 32, 16
    T = 3 * block
    num_pages = T // page + 1
    k_views, _, _ = engine_pages("flash", L, H, D, num_pages, page, F16)
    ids = page_tables(1, T, page, num_pages, seed=2)[0]
    (kv,) = [request(4, L, H, T, D, F16)]
    write_tokens(k_views, [k for k, _ in kv], ids, page)
    where = where_for([ids], [(0, b) for b in range(3)], page, block, num_pages)
    pages = PagedLayers(k_views)
    full = staging(3, L, H, block, D, 4, 32, AXIS_TOKENS, F16)
    kernels.quantize_pages(pages, where, 0, 3, block, bits=4, group=32, axis=AXIS_TOKENS, out=full, ok_flags=flags(3))
    for layer in range(L):
        part = staging(2, 1, H, block, D, 4, 32, AXIS_TOKENS, F16)
        kernels.quantize_pages(pages.select(layer, layer + 1), where, 1, 2, block, bits=4, group=32,
                               axis=AXIS_TOKENS, out=part, ok_flags=flags(2))
        _sync()
        for p, f in zip(part, full):
            assert torch.equal(p[:, 0], f[1:3, layer])
    # decode layer by layer into fresh pages: the same bytes as all layers at once
    dest_all, _, _ = engine_pages("flash", L, H, D, num_pages, page, F16, seed=1)
    dest_one, _, _ = engine_pages("flash", L, H, D, num_pages, page, F16, seed=1)
    kernels.dequantize_pages(*full, bits=4, group=32, axis=AXIS_TOKENS, pages=PagedLayers(dest_all), where=where,
                             first=0, n=3, block=block)
    for layer in range(L):
        kernels.dequantize_pages(*(t[:, layer : layer + 1] for t in full), bits=4, group=32, axis=AXIS_TOKENS,
                                 pages=PagedLayers(dest_one).select(layer, layer + 1), where=where, first=0, n=3,
                                 block=block)
    _sync()
    assert all(torch.equal(a, b) for a, b in zip(dest_all, dest_one))


def test_nan_and_inf_are_flagged_per_block():
    L, H, D, block, page = 2, 2, 64, 32, 8
    T = 2 * block
    num_pages = 2 * T // page
    k_views, v_views, _ = engine_pages("nhd", L, H, D, num_pages, page, F16)
    tables = page_tables(2, T, page, num_pages, seed=1)
    for ids, kv in zip(tables, [request(r, L, H, T, D, F16) for r in range(2)]):
        write_tokens(k_views, [k for k, _ in kv], ids, page)
        write_tokens(v_views, [v for _, v in kv], ids, page)
    bad_page = tables[1][(block + 5) // page]  # request 1, block 1, token 5
    k_views[1][bad_page, 5 % page, 1, 7] = float("inf")
    v_views[0][bad_page, 5 % page, 0, 2] = float("nan")
    order = [(0, 0), (0, 1), (1, 0), (1, 1)]
    where = where_for(tables, order, page, block, num_pages)
    for views, axis in ((k_views, AXIS_TOKENS), (v_views, AXIS_CHANNELS)):
        ok = flags(4)
        kernels.quantize_pages(PagedLayers(views), where, 0, 4, block, bits=4, group=32, axis=axis,
                               out=staging(4, L, H, block, D, 4, 32, axis, F16), ok_flags=ok)
        _sync()
        assert ok.tolist() == [True, True, True, False]
        ok = flags(4)
        kernels.gather_pages(PagedLayers(views), where, 0, 4, block, out=torch.empty(4, L, H, block, D, dtype=F16,
                                                                                   device=DEVICE), ok_flags=ok)
        _sync()
        assert ok.tolist() == [True, True, True, False]


def test_bad_geometry_is_refused_before_any_launch():
    views = [torch.zeros(4, 8, 2, 64, dtype=F16, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match="layer 1"):
        PagedLayers([views[0], torch.zeros(4, 8, 2, 64, dtype=BF16, device=DEVICE)])
    with pytest.raises(ValueError, match="layer 0"):
        PagedLayers([torch.zeros(4, 8, 64, device=DEVICE)])
    with pytest.raises(ValueError, match="contiguous"):
        PagedLayers([torch.zeros(4, 8, 64, 2, dtype=F16, device=DEVICE).transpose(2, 3)])
    with pytest.raises(ValueError, match="page id"):
        where_for([[0, 1, 4, 2]], [(0, 0)], 8, 32, 4)
    with pytest.raises(ValueError, match="within page_ids"):
        where_for([[0, 1, 2]], [(0, 0)], 8, 32, 4)
    where = where_for([[0, 1, 2, 3]], [(0, 0)], 8, 32, 4)
    with pytest.raises(ValueError, match="outside"):
        where.rows(0, 2)
    with pytest.raises(ValueError, match="out q"):
        kernels.quantize_pages(PagedLayers(views), where, 0, 1, 32, bits=4, group=32, axis=AXIS_TOKENS,
                               out=staging(1, 1, 2, 32, 64, 4, 32, AXIS_TOKENS, F16), ok_flags=flags(1))
    with pytest.raises(ValueError, match="ok_flags"):
        kernels.quantize_pages(PagedLayers(views), where, 0, 1, 32, bits=4, group=32, axis=AXIS_TOKENS,
                               out=staging(1, 2, 2, 32, 64, 4, 32, AXIS_TOKENS, F16), ok_flags=flags(0))


def test_a_page_map_made_for_other_pages_is_refused_before_any_launch():
    """``BlockPages`` built for another page size, more pages or another block size than the
    launch's: the kernels would read and write other slots (pages of 16 addressed as pages
    of 32 put a block's second half in the next page), or past the pages' end, with no
    error. Refused, naming what differs, and nothing is written."""
    L, H, D, block, page = 1, 2, 64, 32, 16
    views = [torch.zeros(4, page, H, D, dtype=F16, device=DEVICE) for _ in range(L)]
    pages = PagedLayers(views)
    rows = staging(1, L, H, block, D, 4, 32, AXIS_TOKENS, F16)
    raw = torch.zeros(1, L, H, block, D, dtype=F16, device=DEVICE)
    for where, what in ((where_for([[0, 1]], [(0, 0)], 32, block, 4), "page size"),
                        (where_for([[0, 1, 2, 5]], [(0, 0)], page, block, 8), "pages"),
                        (where_for([[0, 1, 2, 3]], [(0, 0)], page, 2 * block, 4), "block")):
        calls = [
            lambda: kernels.quantize_pages(pages, where, 0, 1, block, bits=4, group=32, axis=AXIS_TOKENS,
                                           out=staging(1, L, H, block, D, 4, 32, AXIS_TOKENS, F16), ok_flags=flags(1)),
            lambda: kernels.dequantize_pages(*rows, bits=4, group=32, axis=AXIS_TOKENS, pages=pages, where=where,
                                             first=0, n=1, block=block),
            lambda: kernels.gather_pages(pages, where, 0, 1, block, out=raw, ok_flags=flags(1)),
            lambda: kernels.scatter_pages(raw, pages, where, 0, 1, block),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=what):
                call()
    _sync()
    assert all(not v.any() for v in views)


# Real models' geometries the cases above (D=64, H=2) do not reach: head dims 80 (Phi-2), 112,
# 256 (Gemma) with their ragged or wide V groups, 1, 3 and 5 KV heads, fp32 KV, store blocks
# of 96 and 192 tokens, blocks starting mid-page (pages of 24) and a token pool.
GEOMETRIES = [
    # (layout, page, H, D, block, bits, group, dtype, stats)
    ("nhd", 24, 3, 80, 96, 2, 32, F16, torch.float32),
    ("flash", 16, 5, 112, 128, 8, 128, BF16, F16),
    ("pool", 1, 1, 256, 64, 4, 64, torch.float32, F16),
]


@pytest.mark.parametrize("kind, page, H, D, block, bits, group, dtype, stats", GEOMETRIES,
                         ids=[f"{g[0]}-p{g[1]}-h{g[2]}-d{g[3]}-b{g[4]}-int{g[5]}-g{g[6]}-{str(g[7])[6:]}"
                              for g in GEOMETRIES])
def test_model_geometries_in_pages_equal_the_torch_reference(kind, page, H, D, block, bits, group, dtype, stats):
    """Every kernel on pages against ``kivi_reference`` (the torch fallback) of the same
    blocks, and Raw's gather and scatter against the tokens themselves, bit for bit."""
    from cacheseek.quant import kivi_reference

    L, n = 1, 2
    T = n * block
    num_pages = -(-T // page) + 2
    k_views, v_views, _ = engine_pages(kind, L, H, D, num_pages, page, dtype)
    (ids,) = page_tables(1, T, page, num_pages, seed=bits)
    (kv,) = [request(7, L, H, T, D, dtype)]
    write_tokens(k_views, [k for k, _ in kv], ids, page)
    write_tokens(v_views, [v for _, v in kv], ids, page)
    where = where_for([ids], [(0, 1), (0, 0)], page, block, num_pages)
    g = torch.arange(T)
    pg, sl = torch.tensor(ids)[g // page].to(DEVICE), (g % page).to(DEVICE)
    for side, axis, views in (("k", AXIS_TOKENS, k_views), ("v", AXIS_CHANNELS, v_views)):
        x = torch.stack([k if side == "k" else v for k, v in kv])  # [L, H, T, D]
        blocks = torch.stack([x[:, :, block:], x[:, :, :block]])  # in launch order
        got = staging(n, L, H, block, D, bits, group, axis, stats)
        kernels.quantize_pages(PagedLayers(views), where, 0, n, block, bits=bits, group=group, axis=axis, out=got,
                               ok_flags=flags(n))
        want = kivi_reference.quantize(blocks, bits=bits, group=group, axis=axis, stats_dtype=stats)
        _sync()
        for name, a, b in zip(("q", "scale", "mn"), got, want):
            assert torch.equal(a, b), f"{side} {name}"
        dest, _, _ = engine_pages(kind, L, H, D, num_pages, page, dtype, seed=9)
        kernels.dequantize_pages(*got, bits=bits, group=group, axis=axis, pages=PagedLayers(dest), where=where,
                                 first=0, n=n, block=block)
        decoded = kivi_reference.dequantize(*want, bits=bits, group=group, axis=axis, shape=blocks.shape, dtype=dtype)
        _sync()
        assert torch.equal(dest[0][pg, sl].transpose(0, 1), torch.cat([decoded[1][0], decoded[0][0]], dim=1))

        rows = torch.full((n, L, H, block, D), 7.0, dtype=dtype, device=DEVICE)
        kernels.gather_pages(PagedLayers(views), where, 0, n, block, out=rows, ok_flags=flags(n))
        _sync()
        assert torch.equal(rows, blocks)
        kernels.scatter_pages(rows, PagedLayers(dest), where, 0, n, block)
        _sync()
        assert torch.equal(dest[0][pg, sl].transpose(0, 1), x[0])


def test_offsets_past_2_to_the_31_elements():
    """Pages and rows more than 2^31 elements from the tensor's start: every offset the
    kernels compute is 64-bit (an int32 product of page id and page stride wraps there, and
    reads or writes far outside the pages). The 4 GiB tensor is never touched but for the
    pages used, so it costs no memory on a CPU (Linux maps untouched pages lazily)."""
    from cacheseek.quant import kivi_reference

    H, D, P, B = 8, 128, 16, 32
    N = (1 << 31) // (P * H * D) + 8
    big = torch.empty((N, P, H, D), dtype=F16, device=DEVICE)
    ids = [N - 3, 5, N - 1]  # the block runs from the top pages to a low one and back
    x = torch.randn(H, 3 * P, D, generator=torch.Generator().manual_seed(0)).to(F16).to(DEVICE)

    def fill(src):
        for i, pid in enumerate(ids):
            big[pid] = src[:, i * P : (i + 1) * P].transpose(0, 1)

    def read():
        return torch.cat([big[i] for i in ids]).transpose(0, 1)[:, 8 : 8 + B]

    fill(x)
    block = x[:, 8 : 8 + B]  # slot 8 of the first page on
    where = BlockPages.build(torch.tensor(ids, dtype=torch.int32), torch.tensor([[0, 8]], dtype=torch.int32),
                             page_size=P, num_pages=N, block_tokens=B, device=torch.device(DEVICE))
    pages = PagedLayers([big])
    for axis in (AXIS_TOKENS, AXIS_CHANNELS):
        want = kivi_reference.quantize(block[None, None], bits=4, group=32, axis=axis, stats_dtype=F16)
        got = staging(1, 1, H, B, D, 4, 32, axis, F16)
        kernels.quantize_pages(pages, where, 0, 1, B, bits=4, group=32, axis=axis, out=got, ok_flags=flags(1))
        _sync()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
        fill(torch.zeros_like(x))
        kernels.dequantize_pages(*want, bits=4, group=32, axis=axis, pages=pages, where=where, first=0, n=1, block=B)
        decoded = kivi_reference.dequantize(*want, bits=4, group=32, axis=axis, shape=(1, 1, H, B, D), dtype=F16)
        _sync()
        assert torch.equal(read(), decoded[0, 0])
        fill(x)
    rows = torch.empty(1, 1, H, B, D, dtype=F16, device=DEVICE)
    kernels.gather_pages(pages, where, 0, 1, B, out=rows, ok_flags=flags(1))
    fill(torch.zeros_like(x))
    kernels.scatter_pages(rows, pages, where, 0, 1, B)
    _sync()
    assert torch.equal(rows[0, 0], block) and torch.equal(read(), block)

    # Not in pages: rows of a strided view 2^30 + 2048 elements apart (a stride that fits in
    # int32, the third row's offset does not), read and written in place.
    view = big.view(-1).as_strided((3, 1, 2 * P, D), ((1 << 30) + 2048, 0, D, 1))
    vals = torch.randn(3, 1, 2 * P, D, generator=torch.Generator().manual_seed(1)).to(F16).to(DEVICE)
    view.copy_(vals)
    for axis in (AXIS_TOKENS, AXIS_CHANNELS):
        want = kivi_reference.quantize(vals, bits=4, group=32, axis=axis, stats_dtype=F16)
        got = kernels.quantize(view, bits=4, group=32, axis=axis, stats_dtype=F16)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        view.zero_()
        kernels.dequantize(*want, bits=4, group=32, axis=axis, shape=vals.shape, dtype=F16, out=view)
        assert torch.equal(view, kivi_reference.dequantize(*want, bits=4, group=32, axis=axis, shape=vals.shape,
                                                           dtype=F16))
        view.copy_(vals)
