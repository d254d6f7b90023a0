"""Paged KV through the cache: ``ingest`` from an engine's pages, ``materialize_into`` pages,
their batched forms, and bad input. Each stores exactly the bytes the contiguous path
stores and writes exactly what it decodes, in every engine layout, on the Triton kernels
(interpreted on a CPU) and on the torch fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cacheseek as cs
from cacheseek import kernels
from cacheseek.pages import PagedSource
from cacheseek.quant import backend as kivi_codec
from paged_helpers import (
    DEVICE,
    engine_pages,
    engine_tensors,
    ingest_pages,
    kv_pages,
    page_tables,
    read_tokens,
    snapshot,
    stored_bytes,
    unchanged,
    write_tokens,
)
import store_helpers
from store_helpers import BLOCK, tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LAYOUT = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")  # small: the interpreter is slow
L, H, D, DTYPE = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype


def make_cache(*args, **kw):
    return store_helpers.make_cache(*args, layout=LAYOUT, **kw)


def make_kv(tokens: int, seed: int):
    """Contiguous KV on the pages' device: the contiguous path runs where the paged one does."""
    return store_helpers.make_kv(tokens, seed, LAYOUT, device=DEVICE)


INT4 = cs.KIVI(bits=4, group_size=32)


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """The kernels (interpreted on a CPU) or the torch fallback: the same bytes."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, request.param)
    return request.param


def expected_after_load(kind: str, before: list[torch.Tensor], layers, ids: list[int]) -> list[torch.Tensor]:
    """The engine's tensors as they must be after loading ``layers`` ([H, T, D] each) into
    the pages ``ids``: ``before`` with exactly those tokens written."""
    want = [t.clone() for t in before]
    write_tokens(kv_pages(kind, want), layers, ids)
    return want


ROTATED = cs.KIVI(k_bits=4, v_bits=2, group_size=32, v_clip=1, v_rotate=True)  # V gathered, rotated, encoded
CASES = [("flash", 16, INT4), ("nhd", 8, cs.Raw()), ("hnd", 32, cs.KIVI(k_bits=2, v_bits=8, group_size=32)),
         ("pool", 1, INT4), ("flashinfer-hnd", 64, cs.Raw()), ("flash", 16, ROTATED)]


@pytest.mark.parametrize("kind, page, codec", CASES, ids=[f"{k}-p{p}-{c.name}{'-rot' if getattr(c, 'v_rotate', False) else ''}" for k, p, c in CASES])
def test_paged_ingest_and_load_equal_the_contiguous_path(kind, page, codec, backend):
    T = 2 * BLOCK + 5  # a partial tail: not stored
    toks, kv = tokens_for(1, T), make_kv(T, 1)
    num_pages = 2 * -(-T // page) + 2
    pages, tensors = engine_pages(kind, L, H, D, num_pages, page, DTYPE)
    ids = page_tables([T], page, num_pages, seed=3)[0]
    write_tokens(pages, kv, ids)
    with make_cache(codec=codec) as contiguous, make_cache(codec=codec) as paged:
        want = contiguous.ingest(toks, kv)
        got = paged.ingest(toks, pages.at(ids))
        assert (got.blocks, got.stored, got.present) == (want.blocks, want.stored, want.present) == (2, 2, 0)
        assert stored_bytes(paged, toks) == stored_bytes(contiguous, toks)
        assert paged.ingest(toks, pages.at(ids)).present == 2

        # Load into another engine's pages, at other page ids: exactly the decoded prefix.
        dest_tensors = engine_tensors(kind, L, H, D, num_pages, page, DTYPE, seed=7)
        dest = kv_pages(kind, dest_tensors)
        before = snapshot(dest_tensors)
        dest_ids = page_tables([T], page, num_pages, seed=11)[0]
        loaded = paged.materialize_into(toks, dest.at(dest_ids))
        assert (loaded.num_tokens, loaded.num_blocks, loaded.tiers) == (2 * BLOCK, 2, ["cpu"] * 2)
        decoded = [(k[0], v[0]) for k, v in contiguous.materialize(toks, device=DEVICE).layers]
        assert unchanged(expected_after_load(kind, before, decoded, dest_ids), dest_tensors)


def test_max_tokens_and_a_short_page_table_limit_what_is_loaded(backend):
    T, page = 3 * BLOCK, 16
    toks, kv = tokens_for(2, T), make_kv(T, 2)
    with make_cache(codec=INT4) as cache:
        cache.ingest(toks, kv)
        decoded = [(k[0], v[0]) for k, v in cache.materialize(toks, device=DEVICE).layers]
        for max_tokens, table_tokens, blocks in ((None, T, 3), (2 * BLOCK - 1, T, 1), (None, 2 * BLOCK + 8, 2),
                                                 (0, T, 0)):
            pages, tensors = engine_pages("flash", L, H, D, 12, page, DTYPE, seed=5)
            before = snapshot(tensors)
            ids = page_tables([table_tokens], page, 12, seed=1)[0]
            loaded = cache.materialize_into(toks, pages.at(ids), max_tokens=max_tokens)
            assert loaded.num_blocks == blocks and loaded.num_tokens == blocks * BLOCK
            part = [(k[:, : blocks * BLOCK], v[:, : blocks * BLOCK]) for k, v in decoded]
            assert unchanged(expected_after_load("flash", before, part, ids), tensors)
        # nothing stored: nothing written
        pages, tensors = engine_pages("flash", L, H, D, 12, page, DTYPE, seed=5)
        before = snapshot(tensors)
        assert cache.materialize_into(tokens_for(9, T), pages.at(list(range(8)))).num_tokens == 0
        assert unchanged(before, tensors)


class Launches:
    """Counts the paged kernel launches of a call."""

    def __init__(self, monkeypatch):
        self.counts = {"quantize_pages": 0, "dequantize_pages": 0, "gather_pages": 0, "scatter_pages": 0}
        for name in self.counts:
            real = getattr(kernels, name)

            def counted(*args, _real=real, _name=name, **kw):
                self.counts[_name] += 1
                return _real(*args, **kw)

            monkeypatch.setattr(kernels, name, counted)

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        for name in self.counts:
            self.counts[name] = 0
        return out


@pytest.mark.parametrize("codec", [INT4, cs.Raw()], ids=["int4", "raw"])
def test_a_batch_is_encoded_and_decoded_together(codec, monkeypatch):
    """Three requests (one a Prompt, one sharing another's first block), each with its own
    tokens and page table, in one call: the same blocks as three contiguous ingests, and the
    launches of one request of as many blocks."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    launches = Launches(monkeypatch)
    page, num_pages = 16, 40
    sizes = [2 * BLOCK + 7, BLOCK, 2 * BLOCK]
    toks = [tokens_for(20 + r, n) for r, n in enumerate(sizes)]
    toks[2][:BLOCK] = toks[0][:BLOCK]  # request 2 shares request 0's first block
    kvs = [make_kv(n, 20 + r) for r, n in enumerate(sizes)]
    for layer in range(L):  # ... and its KV
        for side in (0, 1):
            kvs[2][layer][side][:, :BLOCK] = kvs[0][layer][side][:, :BLOCK]
    keys = [toks[0], cs.Prompt(toks[1]), toks[2]]
    pages, _ = engine_pages("flash", L, H, D, num_pages, page, DTYPE)
    tables = page_tables(sizes, page, num_pages, seed=4)
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    with make_cache(codec=codec) as paged, make_cache(codec=codec) as contiguous:
        results = paged.ingest_batch([cs.PagedRequest(k, ids) for k, ids in zip(keys, tables)], pages)
        assert [(r.blocks, r.stored, r.present) for r in results] == [(2, 2, 0), (1, 1, 0), (2, 1, 1)]
        side_launches = launches.take()
        for k, kv in zip(keys, kvs):
            contiguous.ingest(k, kv)
            assert stored_bytes(paged, k) == stored_bytes(contiguous, k)
        one_request_blocks = 4  # as many blocks as the batch encoded
        single_toks = tokens_for(30, one_request_blocks * BLOCK)
        single_kv = make_kv(one_request_blocks * BLOCK, 30)
        single_pages, _ = engine_pages("flash", L, H, D, num_pages, page, DTYPE)
        single_ids = page_tables([one_request_blocks * BLOCK], page, num_pages, seed=6)[0]
        write_tokens(single_pages, single_kv, single_ids)
        paged.ingest(single_toks, single_pages.at(single_ids))
        assert launches.take() == side_launches  # the same: launches are not per request
        assert sum(side_launches.values()) == 2  # one per side (K and V)

        dest, dest_tensors = engine_pages("flash", L, H, D, num_pages, page, DTYPE, seed=8)
        before = snapshot(dest_tensors)
        dest_tables = page_tables(sizes, page, num_pages, seed=9)
        requests = [cs.PagedRequest(k, ids, max_tokens=m) for k, ids, m in zip(keys, dest_tables, [None, None, BLOCK])]
        loaded = paged.materialize_into_batch(requests, dest)
        assert [(x.num_tokens, x.tiers) for x in loaded] == [(2 * BLOCK, ["cpu"] * 2), (BLOCK, ["cpu"]),
                                                             (BLOCK, ["cpu"])]
        batch_launches = launches.take()
        want = before
        for k, ids, x in zip(keys, dest_tables, loaded):
            got = contiguous.materialize(k, device=DEVICE, max_tokens=x.num_tokens)
            decoded = [(kk[0], vv[0]) for kk, vv in got.layers]
            want = expected_after_load("flash", want, decoded, ids)
        assert unchanged(want, dest_tensors)
        launches.take()
        paged.materialize_into(single_toks, dest.at(dest_tables[0] + dest_tables[1] + dest_tables[2][:2]))
        assert launches.take() == batch_launches  # 4 blocks: the same chunks as one request's


@pytest.mark.parametrize("codec", [INT4, cs.Raw()], ids=["int4", "raw"])
def test_without_an_in_place_tier_frames_go_through_put(tmp_path, codec, backend):
    """A disk tier on top (no run of slots to encode into): frames encoded from the pages in
    a staging buffer, then put, with the same bytes."""
    T, page = 2 * BLOCK, 8
    toks, kv = tokens_for(3, T), make_kv(T, 3)
    pages, _ = engine_pages("hnd", L, H, D, 20, page, DTYPE)
    ids = page_tables([T], page, 20, seed=2)[0]
    write_tokens(pages, kv, ids)
    with make_cache(tmp_path / "a", codec=codec, cpu=0, disk=tmp_path / "a") as paged, \
            make_cache(tmp_path / "b", codec=codec, cpu=0, disk=tmp_path / "b") as contiguous:
        assert paged.ingest(toks, pages.at(ids)).stored == 2
        contiguous.ingest(toks, kv)
        assert paged.lookup(toks) == T
        assert [bytes(f.payload_view()) for f, _ in paged.store.get_many(paged.block_hashes(toks))] == \
               [bytes(f.payload_view()) for f, _ in contiguous.store.get_many(contiguous.block_hashes(toks))]


# -- bad input: a clear InputError naming the request and the parameter; nothing stored,
# nothing written into any page ----------------------------------------------------------


def _setup(seed: int = 0):
    page, num_pages = 16, 24
    sizes = [2 * BLOCK, 2 * BLOCK]
    toks = [tokens_for(40 + r + seed, n) for r, n in enumerate(sizes)]
    kvs = [make_kv(n, 40 + r) for r, n in enumerate(sizes)]
    pages, tensors = engine_pages("flash", L, H, D, num_pages, page, DTYPE)
    tables = page_tables(sizes, page, num_pages, seed=5)
    for kv, ids in zip(kvs, tables):
        write_tokens(pages, kv, ids)
    return toks, kvs, pages, tensors, tables


def test_bad_ingest_input_names_the_request_and_stores_nothing(monkeypatch):
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    toks, _, pages, tensors, tables = _setup()
    wrong_dtype = cs.KVPages.vllm([t.to(torch.bfloat16) for t in tensors])
    wrong_heads = cs.KVPages.vllm([t[:, :, :, :1] for t in tensors])
    cases = [
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest(toks[1], [0, 1, 99, 2])],
                                  pages), r"requests\[1\].page_ids\[2\]: page 99 is outside the 24 pages"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest(toks[1], [3, 4, 3, 5])],
                                  pages), r"requests\[1\].page_ids: page 3 appears twice"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0][:3]), cs.PagedRequest(toks[1], tables[1])],
                                  pages), r"requests\[0\].page_ids: 3 pages of 16 tokens hold 48 tokens, but its keys "
                                          r"name 2 full blocks"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest([], tables[1])], pages),
         r"requests\[1\]: token_ids: empty"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest(toks[1], [0.5, 1.5])], pages),
         r"requests\[1\].page_ids: expected a flat sequence of int page ids"),
        # (bools were read as pages 1 and 0, as a tensor of bools is not)
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest(toks[1], [2, 3, True, False])],
                                  pages), r"requests\[1\].page_ids\[2\]: a bool, not a page id"),
        (lambda c: c.ingest(toks[0], pages.at([False, 5, 6, 7])), r"^page_ids\[0\]: a bool, not a page id"),
        # (and so was a 0-d bool tensor, as ``list(mask)`` holds: read as page 0 here)
        (lambda c: c.ingest(toks[0], pages.at([torch.tensor(False), 5, 6, 7])), r"^page_ids\[0\]: a bool, not a page id"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]),
                                   cs.PagedRequest(toks[1], [*tables[1][:3], torch.tensor(True)])], pages),
         r"^requests\[1\].page_ids\[3\]: a bool, not a page id"),
        # and so were token ids, as 1 and 0
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0]),
                                   cs.PagedRequest([*toks[1][:3], True, *toks[1][4:]], tables[1])], pages),
         r"^requests\[1\]: token_ids\[3\]: a bool, not a token id"),
        (lambda c: c.ingest([False, *toks[0][1:]], pages.at(tables[0])), r"^token_ids\[0\]: a bool, not a token id"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0])], wrong_dtype), r"pages: dtype torch.bfloat16"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], tables[0])], wrong_heads), r"pages: 1 KV heads"),
        (lambda c: c.ingest_batch([(toks[0], tables[0])], pages), r"requests\[0\]: expected a cacheseek.PagedRequest"),
        (lambda c: c.ingest(toks[0], pages.at(torch.tensor([[1, 2]]))), r"page_ids: expected a 1-D integer tensor"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], torch.tensor(tables[0], dtype=torch.complex64))], pages),
         r"requests\[0\].page_ids: expected a 1-D integer tensor, got torch.complex64"),
        (lambda c: c.ingest_batch([cs.PagedRequest(toks[0], torch.tensor(tables[0], device="meta"))], pages),
         r"requests\[0\].page_ids: a meta tensor holds no page ids"),
        (lambda c: c.ingest_batch({}, pages), r"requests: expected a list of cacheseek.PagedRequest"),
        (lambda c: c.ingest([], pages.at(tables[0])), r"^token_ids: empty input"),
    ]
    with make_cache(codec=INT4) as cache:
        for call, match in cases:
            with pytest.raises(cs.InputError, match=match):
                call(cache)
            assert cache.lookup(toks[0]) == 0 and cache.lookup(toks[1]) == 0
        assert cache.stats()["tiers"][0]["blocks"] == 0


def test_bad_pages_are_refused_when_built():
    t = [torch.zeros(2, 4, 16, H, D, dtype=DTYPE) for _ in range(3)]
    with pytest.raises(cs.InputError, match=r"pages layer 1: expected vLLM's \[2, num_pages, page_size, H, D\]"):
        cs.KVPages.vllm([t[0], t[1][0], t[2]])
    with pytest.raises(cs.InputError, match=r"pages layer 2 V: dtype torch.bfloat16"):
        cs.KVPages([x[0] for x in t], [x[1] for x in t[:2]] + [t[2][1].bfloat16()])
    with pytest.raises(cs.InputError, match=r"pages layer 1 K: on meta"):
        cs.KVPages([t[0][0], torch.empty(4, 16, H, D, dtype=DTYPE, device="meta"), t[2][0]], [x[1] for x in t])
    with pytest.raises(cs.InputError, match=r"pages layer 2 V: shape \[3, 16, 2, 64\], layer 0 K has \[4, 16, 2, 64\]"):
        cs.KVPages([t[0][0], t[1][0], t[2][0]], [x[1] for x in t][:2] + [t[2][1][:3]])
    with pytest.raises(cs.InputError, match=r"layout"):
        cs.KVPages([x[0] for x in t], [x[1] for x in t], layout="NDH")
    # The kernels need a token's channels in one run: refused where they read the pages;
    # the torch path (host pages) indexes any strides (vLLM's CPU pages: K column-major).
    strided = ([x[0].transpose(2, 3) for x in t], [x[1].transpose(2, 3) for x in t])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHESEEK_KIVI_BACKEND", "triton")
        with pytest.raises(cs.InputError, match=r"head dim must be contiguous"):
            cs.KVPages(*strided, layout="NHD")
    assert cs.KVPages(*strided, layout="NHD").head_dim == H
    with pytest.raises(cs.InputError, match=r"token pool"):
        cs.KVPages.token_pool([x[0] for x in t], [x[1] for x in t])
    # Pages of no token (or no head, no channel): a load into them wrote nothing and said a
    # miss, an ingest named the page table; a cache of no pages at all is a cache, though.
    for shape, what in (((4, 0, H, D), r"0 tokens a page"), ((4, 16, 0, D), r"0 KV heads"), ((4, 16, H, 0), r"a head dim of 0")):
        with pytest.raises(cs.InputError, match=rf"^pages: {what}"):
            cs.KVPages([torch.zeros(shape, dtype=DTYPE) for _ in range(3)],
                       [torch.zeros(shape, dtype=DTYPE) for _ in range(3)])
    assert cs.KVPages([torch.zeros(0, 16, H, D, dtype=DTYPE)], [torch.zeros(0, 16, H, D, dtype=DTYPE)]).num_pages == 0
    # (a TypeError from iterating them, naming nothing, before)
    for build in (lambda: cs.KVPages.vllm(None), lambda: cs.KVPages.flashinfer(7),
                  lambda: cs.KVPages.token_pool(None, [x[1] for x in t])):
        with pytest.raises(cs.InputError, match=r"^pages( K)?: expected a sequence of per-layer tensors, got (NoneType|int)"):
            build()


def test_k_and_v_each_one_tensor_of_every_layer_are_taken_as_the_factories_take_them():
    """An engine that keeps each side's layers in one tensor (``[L, num_pages, ...]``): the
    factories (``vllm``, ``flashinfer``, ``token_pool``) take a tensor whose first dim is the
    layers, and ``KVPages(k, v)`` refused it, saying it wanted sequences of per-layer tensors."""
    gen = torch.Generator().manual_seed(3)
    k, v = ((torch.randn(L, 8, H, 16, D, generator=gen) * 3).to(DTYPE) for _ in range(2))
    pages, listed = cs.KVPages(k, v, layout="HND"), cs.KVPages(list(k), list(v), layout="HND")
    assert [(a.data_ptr(), a.stride()) for a in pages.k + pages.v] == \
        [(a.data_ptr(), a.stride()) for a in listed.k + listed.v]  # (the same views: no copy)
    with make_cache(codec=cs.Raw()) as cache:
        toks = tokens_for(1, 2 * BLOCK)
        assert cache.ingest(toks, pages.at([0, 1, 2, 3])).stored == 2
        assert cache.materialize_into(toks, pages.at([7, 6, 5, 4])).num_tokens == 2 * BLOCK
    assert torch.equal(k[:, [7, 6, 5, 4]], k[:, :4]) and torch.equal(v[:, [7, 6, 5, 4]], v[:, :4])
    with pytest.raises(cs.InputError, match=r"^pages: expected K and V as two equally long"):
        cs.KVPages(k, v[:1], layout="HND")


def test_pages_sharing_memory_are_refused_when_built():
    """K tensors given as V too, or one layer's tensor twice: a load wrote V over K (or a
    layer over another) and an ingest stored K as V, each reported done."""
    t = [torch.zeros(2, 4, 16, H, D, dtype=DTYPE) for _ in range(2)]
    k, v = [x[0] for x in t], [x[1] for x in t]
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: the same memory as layer 0 K"):
        cs.KVPages(k, k)
    with pytest.raises(cs.InputError, match=r"^pages layer 1 K: the same memory as layer 0 K"):
        cs.KVPages([k[0], k[0]], v)
    with pytest.raises(cs.InputError, match=r"^pages layer 1 V: the same memory as layer 0 V"):
        cs.KVPages(k, [v[0], v[0]])
    with pytest.raises(cs.InputError, match=r"^pages layer 1 K: the same memory as layer 0 K"):
        cs.KVPages.vllm([t[0], t[0]])
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: the same memory as layer 1 K"):
        cs.KVPages(k, [k[1], v[1]], layout="HND")
    # views that interleave without sharing an element are pages of their own
    assert cs.KVPages.flashinfer([x.transpose(0, 1) for x in t]).num_layers == 2
    assert cs.KVPages.vllm(t).num_layers == 2


def test_pages_overlapping_in_part_are_refused_when_built():
    """Views that share memory without starting at one address (V one page past K, a
    layer's pages shifted into the next's, pages expanded from one page, heads on top of
    each other) were taken: a load wrote one request's V over another's K, or every page
    into the same memory, and reported each token written."""
    buf = torch.zeros(26, 16, H, D, dtype=DTYPE)
    own = [torch.zeros(24, 16, H, D, dtype=DTYPE) for _ in range(2)]
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: shares memory with layer 0 K"):
        cs.KVPages([buf[0:24]], [buf[1:25]])
    with pytest.raises(cs.InputError, match=r"^pages layer 1 K: shares memory with layer 0 K"):
        cs.KVPages([buf[0:24], buf[2:26]], own)
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: shares memory with layer 0 K"):
        cs.KVPages([buf[:24]], [buf.view(-1)[1 : 1 + 24 * 16 * H * D].view(24, 16, H, D)])
    with pytest.raises(cs.InputError, match=r"^pages layer 0 K: its pages, slots or heads overlap one another"):
        cs.KVPages([buf[:1].expand(24, 16, H, D)], own[:1])
    with pytest.raises(cs.InputError, match=r"^pages layer 0 K: its pages, slots or heads overlap one another"):
        cs.KVPages([buf[:, :1].expand(26, 16, H, D)[:24]], own[:1])
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: its pages, slots or heads overlap one another"):
        cs.KVPages(own[:1], [buf.as_strided((24, 16, H, D), (16 * H * D, H * D, 0, 1))])
    # named in the views' order, not the addresses' (layer 1 below layer 0 here)
    two = torch.zeros(2, 24, 16, H, D, dtype=DTYPE)
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: the same memory as layer 0 K"):
        cs.KVPages([two[1], two[0]], [two[1], two[0]])
    with pytest.raises(cs.InputError, match=r"^pages layer 0 V: shares memory with layer 0 K"):
        cs.KVPages([buf[1:25]], [buf[0:24]])
    # interleaved K and V (FlashInfer), pages of every other page, a pool: no element shared
    t = torch.zeros(24, 2, H, 16, D, dtype=DTYPE)
    assert cs.KVPages.flashinfer([t, t.clone()], "HND").num_pages == 24
    assert cs.KVPages.flashinfer([t.transpose(2, 3).contiguous()], "NHD").num_pages == 24
    assert cs.KVPages([buf[0:24:2]], [buf[1:25:2]]).num_pages == 12
    assert cs.KVPages.vllm([torch.zeros(2, 24, 16, 2 * H, D, dtype=DTYPE)[:, :, :, ::2]]).num_pages == 24
    assert cs.KVPages.token_pool([buf.view(-1, H, D)[:100]], [buf.view(-1, H, D)[100:200]]).num_pages == 100


def test_pages_on_a_device_without_data_are_refused_when_built():
    """Meta tensors have shapes and no data: an ingest from them failed inside torch, and a
    load into them reported tokens loaded that were written nowhere."""
    meta = [torch.empty(2, 4, 16, H, D, dtype=DTYPE, device="meta") for _ in range(L)]
    refused = r"^pages: on meta, which holds no data; expected pages on cpu or cuda"
    with pytest.raises(cs.InputError, match=refused):
        cs.KVPages.vllm(meta)
    with pytest.raises(cs.InputError, match=refused):
        cs.KVPages([t[0] for t in meta], [t[1] for t in meta], layout="HND")
    with pytest.raises(cs.InputError, match=refused):
        cs.KVPages.token_pool([t[0, 0] for t in meta], [t[1, 0] for t in meta])
    with pytest.raises(cs.InputError, match=refused):
        cs.KVPages.flashinfer([t.transpose(0, 1) for t in meta])
    assert cs.KVPages.vllm([torch.zeros_like(t, device="cpu") for t in meta]).device.type == "cpu"


def test_pages_a_forward_wrote_under_grad_mode_are_read_and_written_as_any(backend):
    """A forward run without ``no_grad`` leaves the engine's pages requiring grad: the torch
    path's gather then fed the encode's in-place copies a tensor with a grad, and the ingest
    failed with torch's "a leaf Variable that requires grad" (contiguous KV is detached)."""
    toks, kvs, _, _, tables = _setup()
    tensors = [torch.zeros(24, 16, H, D, dtype=DTYPE, device=DEVICE) for _ in range(2 * L)]
    weight = torch.ones((), dtype=DTYPE, device=DEVICE, requires_grad=True)
    g = torch.arange(2 * BLOCK)
    page, slot = torch.tensor(tables[0])[g // 16].to(DEVICE), (g % 16).to(DEVICE)
    for layer, (k, v) in enumerate(kvs[0]):  # as the forward's own writes
        tensors[layer][page, slot] = (k * weight).transpose(0, 1)
        tensors[L + layer][page, slot] = (v * weight).transpose(0, 1)
    pages = cs.KVPages(tensors[:L], tensors[L:])
    assert tensors[0].requires_grad  # (as a forward under grad mode leaves them)
    with make_cache(codec=INT4) as cache, make_cache(codec=INT4) as contiguous:
        assert cache.ingest(toks[0], pages.at(tables[0])).stored == 2
        contiguous.ingest(toks[0], kvs[0])
        assert stored_bytes(cache, toks[0]) == stored_bytes(contiguous, toks[0])
        assert cache.materialize_into(toks[0], pages.at(tables[1])).num_tokens == 2 * BLOCK
        decoded = contiguous.materialize(toks[0], device=DEVICE).layers
        for (k, v), (k0, v0) in zip(read_tokens(pages, tables[1], 2 * BLOCK), decoded):
            assert torch.equal(k.cpu(), k0[0].cpu()) and torch.equal(v.cpu(), v0[0].cpu())


def test_pages_made_under_inference_mode_are_written_outside_it(backend):
    """An engine's cache allocated under ``torch.inference_mode`` holds inference tensors:
    the torch path's ``index_copy_`` into them, outside that mode, raised torch's "Inplace
    update to inference tensor outside InferenceMode" (a layer-wise load failed each layer);
    the kernels, writing by address, were fine."""
    toks, kvs, _, _, tables = _setup()
    with torch.inference_mode():
        tensors = engine_tensors("flash", L, H, D, 24, 16, DTYPE)
    pages = kv_pages("flash", tensors)
    with make_cache(codec=INT4) as cache:
        cache.ingest(toks[0], kvs[0])
        decoded = cache.materialize(toks[0], device=DEVICE).layers
        assert cache.materialize_into(toks[0], pages.at(tables[0])).num_tokens == 2 * BLOCK
        with cache.materialize_into(toks[0], pages.at(tables[1]), layerwise=True) as load:
            for layer in range(L):
                load.wait(layer)
        for ids in tables:
            for (k, v), (k0, v0) in zip(read_tokens(pages, ids, 2 * BLOCK), decoded):
                assert torch.equal(k.cpu(), k0[0].cpu()) and torch.equal(v.cpu(), v0[0].cpu())


def test_nan_in_one_request_names_it_and_stores_nothing_of_the_batch(backend):
    toks, kvs, pages, tensors, tables = _setup()
    page = pages.page_size
    token = BLOCK + 3  # request 1, block 1
    pages.v[1][tables[1][token // page], token % page, 1, 5] = float("nan")
    with make_cache(codec=INT4) as cache:
        with pytest.raises(cs.InputError, match=r"requests\[1\]: v: holds NaN or Inf.*\(block 1; nothing of this call"):
            cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
        assert cache.lookup(toks[0]) == 0 and cache.lookup(toks[1]) == 0
        assert cache.stats()["tiers"][0]["blocks"] == 0
        with pytest.raises(cs.InputError, match=r"^kv: v: holds NaN"):
            cache.ingest(toks[1], pages.at(tables[1]))
        assert cache.ingest(toks[0], pages.at(tables[0])).stored == 2  # the good request alone is fine


def test_bad_load_input_names_the_request_and_writes_no_page(monkeypatch):
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    toks, kvs, pages, _, tables = _setup()
    with make_cache(codec=INT4) as cache:
        cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)], pages)
        dest, dest_tensors = engine_pages("flash", L, H, D, 24, 16, DTYPE, seed=3)
        before = snapshot(dest_tensors)
        cases = [
            (lambda: cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3]),
                                                   cs.PagedRequest(toks[1], [4, 5, 1, 6])], dest),
             r"requests\[1\].page_ids: page 1 is also written by requests\[0\] in this call"),
            (lambda: cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3]),
                                                   cs.PagedRequest(toks[1], [4, 5, 6, 24])], dest),
             r"requests\[1\].page_ids\[3\]: page 24 is outside the 24 pages"),
            (lambda: cache.materialize_into(toks[0], dest.at([7, 8, 7, 9])), r"^page_ids: page 7 appears twice"),
            (lambda: cache.materialize_into(toks[0], dest.at([torch.tensor(True), 8, 9, 10])),
             r"^page_ids\[0\]: a bool, not a page id"),
            (lambda: cache.materialize_into(toks[0], dest.at(torch.tensor([7, 8], device="meta"))),
             r"^page_ids: a meta tensor holds no page ids"),
            (lambda: cache.materialize_into(toks[0], dest), r"dest: expected an engine's pages"),
            # the keys are at fault, not a ``kv`` (materialize_into has none): named as materialize names them
            (lambda: cache.materialize_into([], dest.at([7, 8])), r"^token_ids: empty input"),
            (lambda: cache.materialize_into([2**40] * BLOCK, dest.at([7, 8])), r"^token_ids: every id must be an int"),
            (lambda: cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3]),
                                                   cs.PagedRequest([True, *toks[1][1:]], [4, 5, 6, 7])], dest),
             r"^requests\[1\]: token_ids\[0\]: a bool, not a token id"),
            (lambda: cache.materialize_into(torch.ones(2, BLOCK, dtype=torch.long), dest.at([7, 8])),
             r"^token_ids: expected shape \[T\] or \[1, T\]"),
            (lambda: cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3])],
                                                  cs.KVPages.vllm([t.float() for t in dest_tensors])),
             r"pages: dtype torch.float32"),
        ]
        for call, match in cases:
            with pytest.raises(cs.InputError, match=match):
                call()
            assert unchanged(before, dest_tensors)
        # the same page in two requests is fine where only one of them writes it
        loaded = cache.materialize_into_batch([cs.PagedRequest(toks[0], [0, 1, 2, 3]),
                                               cs.PagedRequest(tokens_for(99, 2 * BLOCK), [0, 1, 2, 3])], dest)
        assert [x.num_tokens for x in loaded] == [2 * BLOCK, 0]
        decoded = cache.materialize(toks[0], device=DEVICE).layers
        for (k, v), (k0, v0) in zip(read_tokens(dest, [0, 1, 2, 3], 2 * BLOCK), decoded):
            assert torch.equal(k.cpu(), k0[0].cpu()) and torch.equal(v.cpu(), v0[0].cpu())


def test_request_parameters_of_a_wrong_type_name_the_request_and_touch_nothing(monkeypatch):
    """A float or str ``max_tokens``, or keys that are no keys (None, a number), failed deep
    inside (a chain sliced by a float, ``len(None)``) with a TypeError naming nothing."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "torch")
    toks, _, pages, tensors, tables = _setup()
    with make_cache(codec=INT4) as cache:
        cache.ingest(toks[0], pages.at(tables[0]))  # a load of request 0 would write its pages
        blocks = cache.stats()["tiers"][0]["blocks"]
        before = snapshot(tensors)

        def batch(call, bad, **kw):
            return lambda: getattr(cache, call)([cs.PagedRequest(toks[0], tables[0]), bad], pages, **kw)

        expected = r"expected an int number of tokens >= 0, or None for no limit, got "
        not_keys = r": keys: expected token ids \(a list or a tensor\), block keys or a Prompt, got "
        cases = [
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens=40.0)),
             rf"^requests\[1\]\.max_tokens: {expected}float 40.0"),
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens="64")),
             rf"^requests\[1\]\.max_tokens: {expected}str '64'"),
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens=True)),
             rf"^requests\[1\]\.max_tokens: {expected}bool True"),
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens=torch.tensor(True))),
             rf"^requests\[1\]\.max_tokens: {expected}Tensor"),
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens=64.0), layerwise=True),
             rf"^requests\[1\]\.max_tokens: {expected}float"),
            (lambda: cache.materialize_into(toks[0], pages.at(tables[0]), max_tokens=64.0), rf"^max_tokens: {expected}float"),
            # (-1, often meant as "no limit", loaded nothing without a word)
            (batch("materialize_into_batch", cs.PagedRequest(toks[0], tables[1], max_tokens=-1)),
             rf"^requests\[1\]\.max_tokens: {expected}int -1"),
            (lambda: cache.materialize_into(toks[0], pages.at(tables[0]), max_tokens=-1), rf"^max_tokens: {expected}int -1"),
            (lambda: cache.materialize(toks[0], max_tokens=-1), rf"^max_tokens: {expected}int -1"),
            (batch("ingest_batch", cs.PagedRequest(None, tables[1])), rf"^requests\[1\]{not_keys}NoneType"),
            (batch("ingest_batch", cs.PagedRequest(7, tables[1]), layerwise=True), rf"^requests\[1\]{not_keys}int"),
            (batch("materialize_into_batch", cs.PagedRequest(None, tables[1])), rf"^requests\[1\]{not_keys}NoneType"),
            (batch("materialize_into_batch", cs.PagedRequest(cs.Prompt(None), tables[1])),
             rf"^requests\[1\]{not_keys}NoneType"),  # (its token ids)
        ]
        for call, match in cases:
            with pytest.raises(cs.InputError, match=match):
                call()
            assert unchanged(before, tensors)
            assert cache.stats()["tiers"][0]["blocks"] == blocks and cache.lookup(toks[1]) == 0
        # a whole number of tokens is fine, of any integer type (a numpy one was refused), and
        # None loads what the page table holds
        got = cache.materialize_into_batch([cs.PagedRequest(toks[0], tables[0], max_tokens=BLOCK + 5),
                                            cs.PagedRequest(toks[0], tables[1], max_tokens=None)], pages)
        assert [x.num_tokens for x in got] == [BLOCK, 2 * BLOCK]
        got = cache.materialize_into_batch([cs.PagedRequest(toks[0], tables[0], max_tokens=np.int64(BLOCK + 5)),
                                            cs.PagedRequest(toks[0], tables[1], max_tokens=torch.tensor(BLOCK))],
                                           pages)
        assert [x.num_tokens for x in got] == [BLOCK, BLOCK]
        assert cache.materialize_into(toks[0], pages.at(tables[0]), max_tokens=np.int32(BLOCK)).num_tokens == BLOCK


@pytest.mark.parametrize("shape", ["[T]", "[1, T]"])
def test_token_ids_in_a_numpy_array_are_keys_as_in_a_tensor(shape, monkeypatch):
    """A numpy [1, T] array of ids (as a tokenizer returns them) was counted as one token,
    though hashed as T: ``ingest`` refused it ("1 tokens, but KV holds ..."), and a paged
    ingest of it failed with an IndexError naming nothing."""
    monkeypatch.setenv(kivi_codec.BACKEND_ENV, "torch")
    toks, kvs, pages, _, tables = _setup()
    ids = np.array(toks[0]) if shape == "[T]" else np.array([toks[0]])
    with make_cache(codec=INT4) as want, make_cache(codec=INT4) as contiguous, \
            make_cache(codec=INT4) as paged, make_cache(codec=INT4) as batch:
        expected = want.ingest(toks[0], kvs[0])
        assert expected.stored == 2
        assert contiguous.ingest(ids, kvs[0]) == expected
        assert paged.ingest(ids, pages.at(tables[0])) == expected
        assert batch.ingest_batch([cs.PagedRequest(ids, tables[0])], pages) == [expected]
        for cache in (contiguous, paged, batch):
            assert cache.locate(ids).num_tokens == cache.lookup(toks[0]) == 2 * BLOCK
            assert stored_bytes(cache, toks[0]) == stored_bytes(want, toks[0])


@pytest.mark.parametrize("codec", [INT4, cs.Raw(), ROTATED], ids=["int4", "raw", "int4-v2-rotated"])
def test_codecs_encode_and_decode_a_range_of_layers_in_pages(codec, backend):
    """What layer-wise loading builds on: ``layers=(l0, l1)`` encodes and decodes exactly
    those layers' part of each block."""
    from cacheseek.block_format import BlockFormat
    from cacheseek.pages import PagedSource, page_table
    from cacheseek.staging import payload_views

    T, page = 2 * BLOCK, 16
    pages, tensors = engine_pages("nhd", L, H, D, 8, page, DTYPE)
    ids = page_tables([T], page, 8, seed=1)[0]
    write_tokens(pages, make_kv(T, 6), ids)
    source = PagedSource(pages, [page_table(ids, pages, "page_ids")], [(0, 0), (0, 1)], BLOCK)
    def staging(layers: int):
        fmt = BlockFormat(codec, cs.KVLayout(layers, H, D, "float16"), BLOCK)
        m = fmt.plan(block_hash=bytes(16), parent_hash=bytes(16), position=0)
        buf = torch.zeros((2, m.payload_nbytes), dtype=torch.uint8, device=DEVICE)
        return payload_views(buf, m.tensors, 2, m.payload_nbytes)

    whole = staging(L)
    flags = codec.encode_pages_into(source, 0, 2, BLOCK, whole)
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # the kernels write the flags into host memory
    assert bool(flags.all())
    for layer in range(L):
        part = staging(1)
        codec.encode_pages_into(source, 0, 2, BLOCK, part, layers=(layer, layer + 1))
        assert all(torch.equal(p[:, 0], w[:, layer]) for p, w in zip(part, whole))
    dest_all, all_tensors = engine_pages("nhd", L, H, D, 8, page, DTYPE, seed=2)
    dest_one, one_tensors = engine_pages("nhd", L, H, D, 8, page, DTYPE, seed=2)
    codec.decode_into_pages(whole, PagedSource(dest_all, [page_table(ids, dest_all, "p")], [(0, 0), (0, 1)], BLOCK),
                            0, 2)
    one = PagedSource(dest_one, [page_table(ids, dest_one, "p")], [(0, 0), (0, 1)], BLOCK)
    for layer in range(L):
        codec.decode_into_pages([w[:, layer : layer + 1] for w in whole], one, 0, 2, layers=(layer, layer + 1))
    assert unchanged(all_tensors, one_tensors)


def check_start_skips_the_engines_own_blocks(cache, raw: bool) -> None:
    """Two requests whose first block is already in the engine's pages (its own prefix hit:
    the same pages in both tables), loaded from block 1 on in one call: those shared pages
    are neither written nor refused as written twice; a start that is not whole blocks is
    refused naming the request, writing nothing."""
    T, page = 3 * BLOCK, 16
    lay = cache.layout
    L, H, D, DTYPE = lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.torch_dtype
    toks = tokens_for(40, T)
    src, _ = engine_pages("nhd", L, H, D, 24, page, DTYPE, seed=6)
    write_tokens(src, store_helpers.make_kv(T, 40, lay, device=DEVICE), list(range(6)))
    cache.ingest(toks, src.at(list(range(6))))
    decoded = read_tokens(src, list(range(6)), T) if raw else None
    pages, tensors = engine_pages("flash", L, H, D, 24, page, DTYPE, seed=8)
    before = snapshot(tensors)
    shared = [10, 11]  # the engine's own pages of block 0, in both tables
    tables = [shared + [2, 3, 4, 5], shared + [6, 7, 8, 9]]
    # (a numpy start, as a page table's ids may be, was refused)
    loaded = cache.materialize_into_batch([cs.PagedRequest(toks, tables[0], start=np.int64(BLOCK)),
                                           cs.PagedRequest(toks[: 2 * BLOCK], tables[1], start=torch.tensor(BLOCK))],
                                          pages)
    assert [(x.num_tokens, x.num_blocks) for x in loaded] == [(T, 3), (2 * BLOCK, 2)]
    shared_before = read_tokens(kv_pages("flash", before), shared, BLOCK)
    for (k, v), (bk, bv) in zip(read_tokens(pages, shared, BLOCK), shared_before):
        assert torch.equal(k, bk) and torch.equal(v, bv)  # the engine's own pages: untouched
    if decoded is not None:
        for (k, v), (wk, wv) in zip(read_tokens(pages, tables[0], T), decoded):
            assert torch.equal(k[:, BLOCK:], wk[:, BLOCK:]) and torch.equal(v[:, BLOCK:], wv[:, BLOCK:])
    before = snapshot(tensors)
    with pytest.raises(cs.InputError, match=r"requests\[1\]\.start: expected a multiple of the block size"):
        cache.materialize_into_batch([cs.PagedRequest(toks, tables[0], start=BLOCK),
                                      cs.PagedRequest(toks, [12, 13, 14, 15, 16, 17], start=BLOCK + 1)], pages)
    assert unchanged(before, tensors)
    with pytest.raises(cs.InputError, match=r"requests\[1\]\.start: expected a multiple of the block size"):
        cache.materialize_into_batch([cs.PagedRequest(toks, tables[0], start=BLOCK),
                                      cs.PagedRequest(toks, [12, 13, 14, 15, 16, 17], start=BLOCK + 1)], pages,
                                     layerwise=True)
    assert unchanged(before, tensors)
    for bad in (False, np.bool_(False), torch.tensor(False), float(BLOCK), [BLOCK]):
        with pytest.raises(cs.InputError, match=r"requests\[1\]\.start: expected a multiple of the block size"):
            cache.materialize_into_batch([cs.PagedRequest(toks, tables[0]),
                                          cs.PagedRequest(toks, [12, 13, 14, 15, 16, 17], start=bad)], pages)
        assert unchanged(before, tensors)
    # One request: the same start, the same pages written, its own pages (and no others) untouched.
    for layerwise in (False, True):
        one, one_tensors = engine_pages("flash", L, H, D, 24, page, DTYPE, seed=8)
        got = cache.materialize_into(toks, one.at(tables[0]), start=np.int64(BLOCK), layerwise=layerwise)
        if layerwise:
            got.close()  # (every layer written into the pages)
            got = got.requests[0]
        assert (got.num_tokens, got.num_blocks, len(got.tiers)) == (T, 3, 3)
        assert unchanged([t[:, shared] if t.dim() == 5 else t[shared] for t in before],
                         [t[:, shared] if t.dim() == 5 else t[shared] for t in one_tensors])
        for (k, v), (wk, wv) in zip(read_tokens(one, tables[0], T), read_tokens(pages, tables[0], T)):
            assert torch.equal(k[:, BLOCK:], wk[:, BLOCK:]) and torch.equal(v[:, BLOCK:], wv[:, BLOCK:])
    one_before = snapshot(one_tensors)
    for bad, why in ((BLOCK + 1, r"^start: expected a multiple of the block size"),
                     (4 * BLOCK, r"^start: 128 tokens are in its pages, but its page table holds 6 pages"),
                     (True, r"^start: expected a multiple")):
        with pytest.raises(cs.InputError, match=why):
            cache.materialize_into(toks, one.at(tables[0]), start=bad)
        assert unchanged(one_before, one_tensors)


@pytest.mark.parametrize("codec", [cs.Raw(), INT4], ids=["raw", "int4"])
def test_a_load_from_start_leaves_the_engines_own_pages_alone(codec):
    with make_cache(codec=codec) as cache:
        check_start_skips_the_engines_own_blocks(cache, isinstance(codec, cs.Raw))


def test_nan_through_the_put_path_names_its_request_once():
    """A tier with no room to reserve stores paged blocks through put_many; its NaN check
    named the request twice ("requests[1]: requests[1]: ...")."""
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
    kv = [torch.randn(2, 16, 8, 2, 32).half() for _ in range(2)]  # vLLM's flash layout: 16 pages of 8 tokens
    pages = cs.KVPages.vllm(kv)
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=cs.Raw(), block_tokens=32,
                           tiers=cs.TierConfig(cpu_bytes="20KiB", cpu_reserve_bytes=0, pin_memory=False))
    cache.ingest(list(range(1000, 1064)), pages.at(list(range(8))))  # the tier is full
    held = cache.lookup(list(range(1000, 1064)))
    kv[0][0, 9, 0, 0, 0] = float("inf")  # K of the second request's first block
    requests = [cs.PagedRequest(list(range(64)), list(range(8))), cs.PagedRequest(list(range(100, 164)), list(range(8, 16)))]
    once = r"^{}: k: holds NaN or Inf; input rejected \(block 0; nothing of this call is stored\)$"
    with pytest.raises(cs.InputError, match=once.format(r"requests\[1\]")):
        cache.ingest_batch(requests, pages)
    with pytest.raises(cs.InputError, match=once.format("kv")):
        cache.ingest(list(range(100, 164)), pages.at(list(range(8, 16))))
    assert cache.lookup(list(range(64))) == 0 and cache.lookup(list(range(1000, 1064))) == held > 0


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_nan_in_a_later_put_batch_evicts_nothing_from_a_full_cpu_tier(paged):
    """A full CPU tier with no room to reserve takes a call through put_many in several
    batches, tail first. A bad block in the head's batch undoes the tail's puts but could not
    undo what they evicted (other prompts, gone from memory): the KV of every batch is
    checked before the first put, on any top tier but a GPU tier's."""
    layout = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
    cache = cs.PrefixCache(model_id="m", layout=layout, codec=cs.Raw(), block_tokens=32, max_batch_bytes="32KiB",
                           tiers=cs.TierConfig(cpu_bytes="200KiB", cpu_reserve_bytes=0, pin_memory=False))
    kv = [torch.randn(2, 32, 8, 2, 32).half() for _ in range(2)]  # vLLM's flash layout: 32 pages of 8 tokens
    pages = cs.KVPages.vllm(kv)
    others = [list(range(1000 * i, 1000 * i + 64)) for i in range(1, 7)]
    for i, toks in enumerate(others):
        cache.ingest(toks, pages.at(list(range(8 * (i % 4), 8 * (i % 4) + 8))))
    before = ([cache.lookup(t) for t in others], cache.stats()["tiers"][0])
    assert before[0] == [64] * 6 and before[1]["evictions"] == 0
    kv[1][1, 4, 0, 1, 5] = float("nan")  # V of layer 1 in block 1 of the request (pages 0-31): a head block
    toks = list(range(8 * 32))
    with pytest.raises(cs.InputError, match="NaN or Inf"):
        if paged:
            cache.ingest_batch([cs.PagedRequest(toks, list(range(32)))], pages)
        else:
            cache.ingest(toks, pages.at(list(range(32))))
    assert ([cache.lookup(t) for t in others], cache.stats()["tiers"][0]) == before
    kv[1][1, 4, 0, 1, 5] = 0.5
    assert cache.ingest(toks, pages.at(list(range(32)))).stored == 8  # good KV: stored, evicting others
    assert cache.stats()["tiers"][0]["evictions"] > 0


@pytest.mark.parametrize("chunk_bytes", [1, 64 << 20], ids=["a-block-a-piece", "one-piece"])
@pytest.mark.parametrize("codec", [cs.Raw(), INT4], ids=["raw", "int4"])
def test_a_check_of_blocks_in_pages_finds_the_bad_block_in_any_piece(codec, chunk_bytes):
    """``PagedSource.check_values`` reads its verdicts once, after every piece of every
    layer: a NaN in the last block of a later layer is found and named, and the blocks
    before it pass."""
    kv = [torch.randn(2, 16, 8, 2, 32).half() for _ in range(2)]  # vLLM's flash layout: 16 pages of 8 tokens
    source = PagedSource(cs.KVPages.vllm(kv), [torch.arange(16, dtype=torch.int32)], [(0, b) for b in range(4)], 32)
    source.check_values(codec, 0, 4, chunk_bytes=chunk_bytes)
    kv[1][1, 13, 7, 1, 31] = float("nan")  # V of layer 1, page 13's last token: block 3's
    with pytest.raises(cs.InputError, match="^k or v: holds NaN or Inf"):
        source.check_values(codec, 0, 4, chunk_bytes=chunk_bytes)
    assert source.bad_blocks() == [3]
    source.check_values(codec, 0, 3, chunk_bytes=chunk_bytes)  # the blocks before it


def test_a_refused_paged_ingest_of_several_batches_evicts_nothing(tmp_path):
    """A full disk tier, and a batch whose second request's first block holds Inf, stored in
    runs of one block tail first: the puts of the runs after it evicted stored blocks before
    its check refused the call."""
    raw = LAYOUT.raw_nbytes(BLOCK)
    cache = cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes=0, disk_path=tmp_path / "d",
                                               disk_bytes=3 * store_helpers.disk_charge(raw + 1024) + raw // 2),
                           max_batch_bytes=raw)
    toks, kvs, pages, tensors, tables = _setup()
    held = tokens_for(70, 3 * BLOCK)
    assert cache.ingest(held, make_kv(3 * BLOCK, 70)).stored == 3  # the tier is full
    tensors[0][0, tables[1][0], 0, 0, 0] = float("inf")  # K of layer 0, request 1's first page
    with pytest.raises(cs.InputError, match=r"^requests\[1\]: .*NaN or Inf"):
        cache.ingest_batch([cs.PagedRequest(toks[0], tables[0]), cs.PagedRequest(toks[1], tables[1])], pages)
    assert cache.lookup(held) == 3 * BLOCK and cache.lookup(toks[0]) == cache.lookup(toks[1]) == 0
    assert cache.store.tier("disk").stats().evictions == 0


@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "disk"])
def test_an_ingest_that_finds_every_block_stored_marks_them_used(tmp_path, disk):
    """An ingest of blocks all stored already is a use of them, as a contiguous ingest's is:
    ``ingest_batch`` (and a paged ``ingest`` not in place) returned before marking them, so
    the chain just reused was the next evicted."""
    T = 2 * BLOCK
    room = 6 * store_helpers.disk_charge(LAYOUT.raw_nbytes(BLOCK) + 1024) + (16 << 10)  # 6 Raw blocks of LAYOUT
    tiers = cs.TierConfig(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=room) if disk else \
        cs.TierConfig(cpu_bytes="200KiB", pin_memory=False)  # room for 6 Raw blocks of LAYOUT
    pages, _ = engine_pages("nhd", L, H, D, 16, 16, DTYPE)
    chains = [tokens_for(60 + i, T) for i in range(4)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(4)]
    for i, ids in enumerate(tables):
        write_tokens(pages, make_kv(T, 60 + i), ids)
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers) as cache:
        for i in range(3):
            cache.ingest_batch([cs.PagedRequest(chains[i], tables[i])], pages)
        again = [lambda: cache.ingest_batch([cs.PagedRequest(chains[0], tables[0])], pages)[0]]
        if disk:
            again.append(lambda: cache.ingest(chains[0], pages.at(tables[0])))
        for use in again:
            assert (use().present, cache.lookup(chains[0])) == (2, T)
        cache.ingest_batch([cs.PagedRequest(chains[3], tables[3])], pages)  # evicts the least recently used chain
        assert [cache.lookup(t) for t in chains] == [T, 0, T, T]


@pytest.mark.parametrize("eviction", ["lru", "arc"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_an_ingest_never_evicts_its_own_stored_prefix(eviction, paged):
    """A chain's stored blocks are used by the ingest that extends it before its new blocks
    make room: they were marked only after the puts, so when the chain's prefix was the
    least recently used, the new tail evicted it and was stored below a gap (the result
    counted 3 blocks, a lookup found 1)."""
    tiers = cs.TierConfig(cpu_bytes="112KiB", pin_memory=False, eviction=eviction)  # room for 3 Raw blocks
    pages, _ = engine_pages("nhd", L, H, D, 16, 16, DTYPE)
    x, y = tokens_for(70, 3 * BLOCK), tokens_for(71, BLOCK)
    kv_x, kv_y = make_kv(3 * BLOCK, 70), make_kv(BLOCK, 71)
    write_tokens(pages, kv_x, list(range(6)))
    write_tokens(pages, kv_y, [6, 7])

    def ingest(cache, tokens, kv, ids):
        if paged:
            return cache.ingest_batch([cs.PagedRequest(tokens, ids)], pages)[0]
        return cache.ingest(tokens, [(k[:, : len(tokens)], v[:, : len(tokens)]) for k, v in kv])

    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers) as cache:
        ingest(cache, x[: 2 * BLOCK], kv_x, list(range(4)))  # the prefix, least recently used from here on
        ingest(cache, y, kv_y, [6, 7])  # the tier is full
        got = ingest(cache, x, kv_x, list(range(6)))
        assert (got.present, got.stored) == (2, 1)
        assert (cache.lookup(x), cache.lookup(y)) == (3 * BLOCK, 0)  # the other chain made the room
        store_helpers.assert_prefix_equal(cache.materialize(x), kv_x, 3 * BLOCK)


@pytest.mark.parametrize("eviction", ["lru", "arc"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["batch", "layerwise"])
def test_a_batch_never_evicts_a_requests_own_stored_prefix(eviction, layerwise):
    """A batch's stored blocks were marked used as one chain of all its requests: the last
    request's stored prefix became the least recently used of them, so its own new blocks
    evicted it and were stored below a gap (counted stored, found by no lookup), where
    ingests of the requests one after another evict the other chain."""
    tiers = cs.TierConfig(cpu_bytes="112KiB", pin_memory=False, eviction=eviction)  # room for 3 Raw blocks
    pages, _ = engine_pages("nhd", L, H, D, 16, 16, DTYPE)
    x, y = tokens_for(72, 2 * BLOCK), tokens_for(73, 3 * BLOCK)
    kv_y = make_kv(3 * BLOCK, 73)
    write_tokens(pages, make_kv(2 * BLOCK, 72), list(range(4)))
    write_tokens(pages, kv_y, list(range(4, 10)))
    requests = [cs.PagedRequest(x, list(range(4))), cs.PagedRequest(y, list(range(4, 10)))]
    with cs.PrefixCache(model_id="m", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK, tiers=tiers) as cache:
        cache.ingest_batch([cs.PagedRequest(y[:BLOCK], [4, 5])], pages)
        cache.ingest_batch(requests[:1], pages)  # the tier is full: x, and y's first block
        got = ingest_pages(cache, requests, pages, layerwise)
        assert [(r.present, r.stored) for r in got] == [(2, 0), (1, 2)]
        assert (cache.lookup(x), cache.lookup(y)) == (0, 3 * BLOCK)  # the other chain made the room
        store_helpers.assert_prefix_equal(cache.materialize(y), kv_y, 3 * BLOCK)


@pytest.mark.parametrize("top", ["disk", "cpu"])
def test_a_block_two_requests_share_counts_its_one_writes_outcome_for_both(tmp_path, monkeypatch, top):
    """Two requests of a batch with one prefix: its block is encoded and written once, for
    the first, and the second counted it present before that write ran. A write that failed
    (a disk error) left the second's result saying the block was stored. Through put (the
    disk on top) and in place (a CPU tier on top, written through to the disk)."""
    T, page = 2 * BLOCK, 16
    shared = tokens_for(80, BLOCK)
    toks = [shared + tokens_for(81, BLOCK), shared + tokens_for(82, BLOCK)]
    kv0, kv1 = make_kv(T, 80), make_kv(T, 81)
    for (k0, v0), (k1, v1) in zip(kv0, kv1):  # one prefix: the same tokens, the same KV
        k1[:, :BLOCK], v1[:, :BLOCK] = k0[:, :BLOCK], v0[:, :BLOCK]
    pages, _ = engine_pages("nhd", L, H, D, 8, page, DTYPE)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    write_tokens(pages, kv0, tables[0])
    write_tokens(pages, kv1, tables[1])
    requests = [cs.PagedRequest(t, ids) for t, ids in zip(toks, tables)]
    with make_cache(cpu="1MiB" if top == "cpu" else 0, disk=tmp_path / "d", pin_memory=False) as cache:
        head = cache.block_hashes(shared)[0]
        store_helpers.fail_disk_writes(monkeypatch, [head])
        got = cache.ingest_batch(requests, pages)
        monkeypatch.undo()
        assert [(r.stored, r.present, r.failed) for r in got] == [(1, 0, 1), (1, 0, 1)]
        assert all("Input/output error" in r.errors["disk"] for r in got)
        assert not cache.store.present_many([head])[0]
        # Written again, it is stored once, and counted present by the request that shares it.
        again = cache.ingest_batch(requests, pages)
        assert [(r.stored, r.present, r.failed) for r in again] == [(1, 1, 0), (0, 2, 0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_page_tables_on_a_gpu_reach_the_host_in_one_copy_per_call():
    """Each copy of a table to the host waits for the work queued on the device (the
    engine's forward): a batch of 8 requests' tables waited 8 times."""
    from cacheseek import paged_io

    pages, _ = engine_pages("flash", L, H, D, 64, 16, DTYPE)
    tables = page_tables([2 * BLOCK] * 8, 16, 64, seed=3)
    with make_cache(cpu="16MiB") as cache:
        requests = [(tokens_for(700 + r, 2 * BLOCK), torch.tensor(ids, device="cuda"), None)
                    for r, ids in enumerate(tables)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning, match="synchroniz") as caught:
                call = paged_io.plan(cache.keys, LAYOUT, pages, requests, single=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert sum("synchroniz" in str(w.message) for w in caught) == 1
    assert [t.tolist() for t in call.tables] == tables


def check_ingest_from_start(cache, monkeypatch, *, wait: bool = True, layerwise: bool = False) -> None:
    """``PagedRequest.start`` in an ingest: the blocks before it (an earlier call's) are
    hashed, never looked up, encoded nor sent; the result counts the blocks from it on;
    the chain is found whole; a head not stored leaves the tail stored past a gap; a bad
    start names the request and stores nothing. (tests/test_remote.py runs it over HTTP.)"""
    from cacheseek.pages import PagedSource

    layout = cache.layout
    L_, H_, D_ = layout.num_layers, layout.num_kv_heads, layout.head_dim
    page, num_pages = 16, 40
    sizes = [4 * BLOCK, 2 * BLOCK, 4 * BLOCK]
    toks = [tokens_for(300 + r, n) for r, n in enumerate(sizes)]
    pages, _ = engine_pages("flash", L_, H_, D_, num_pages, page, layout.torch_dtype)
    tables = page_tables(sizes, page, num_pages, seed=11)
    for r, (n, ids) in enumerate(zip(sizes, tables)):
        write_tokens(pages, store_helpers.make_kv(n, 300 + r, layout, device=DEVICE), ids)
    encoded = []
    encode = PagedSource.encode
    monkeypatch.setattr(PagedSource, "encode", lambda self, codec, first, n, views, *a, **kw:
                        encoded.append(n) or encode(self, codec, first, n, views, *a, **kw))

    def ingest(requests):
        if layerwise:
            writer = cache.ingest_batch(requests, pages, layerwise=True)
            for i in range(L_):
                writer.put_layer(i)
            return writer.finish()
        got = cache.ingest_batch(requests, pages, wait=wait)
        return got if wait else got.result(timeout=60)

    def counts(results):
        return [(r.blocks, r.stored, r.present, r.failed, r.tokens) for r in results]

    ingest([cs.PagedRequest(toks[0][: 2 * BLOCK], tables[0])])  # the earlier call: the head
    assert cache.lookup(toks[0]) == 2 * BLOCK
    encoded.clear()
    results = ingest([cs.PagedRequest(toks[0], tables[0], start=2 * BLOCK), cs.PagedRequest(toks[1], tables[1])])
    assert counts(results) == [(2, 2, 0, 0, 2 * BLOCK), (2, 2, 0, 0, 2 * BLOCK)]
    if not layerwise:  # (a layer-wise writer encodes through its own slots)
        assert sum(encoded) == 4  # the 2 new blocks of each: the head is not encoded again
    assert cache.lookup(toks[0]) == 4 * BLOCK  # the chain, whole
    # A start past every full block: nothing to store.
    assert counts(ingest([cs.PagedRequest(toks[0], tables[0], start=4 * BLOCK)])) == [(0, 0, 0, 0, 0)]
    # A head not stored (evicted since): the tail is stored past the gap, found once the head is.
    results = ingest([cs.PagedRequest(toks[2], tables[2], start=2 * BLOCK)])
    assert counts(results) == [(2, 2, 0, 0, 2 * BLOCK)] and cache.lookup(toks[2]) == 0
    assert counts(ingest([cs.PagedRequest(toks[2], tables[2])])) == [(4, 2, 2, 0, 4 * BLOCK)]
    assert cache.lookup(toks[2]) == 4 * BLOCK
    other = tokens_for(400, 2 * BLOCK)
    for bad, why in ((BLOCK + 1, r"^requests\[1\]\.start: expected a multiple of the block size 32 >= 0, got 33"),
                     (True, r"^requests\[1\]\.start: expected a multiple of the block size"),
                     (3 * BLOCK, r"^requests\[1\]\.start: 96 tokens stored by an earlier call, but its keys name "
                                 r"2 full blocks \(64 tokens\)")):
        with pytest.raises(cs.InputError, match=why):
            ingest([cs.PagedRequest(other, tables[1]), cs.PagedRequest(toks[1], tables[1], start=bad)])
        assert cache.lookup(other) == 0


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_an_ingest_from_start_stores_only_the_blocks_after_it(monkeypatch, layerwise):
    monkeypatch.setattr("cacheseek.layerwise_save.MIN_SAVE_BYTES", 0)  # (the writer's slots, however small)
    with make_cache(codec=cs.Raw(), cpu="8MiB") as cache:
        check_ingest_from_start(cache, monkeypatch, layerwise=layerwise)
