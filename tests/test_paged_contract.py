"""The engine surface's contract for bad input, in ``PrefixCache`` and in ``RemoteCache`` over
a server on loopback alike: each refused call raises ``InputError`` naming the request and
the parameter, and leaves every page bit for bit as it was and the store as it was (no
block stored, none evicted). Layer-wise writers and loads used out of turn raise what
docs/engine.md says they raise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import cacheseek as cs
from cacheseek import layerwise_save
from cacheseek.quant import backend as kivi_codec
from paged_helpers import (DEVICE, engine_pages, engine_tensors, kv_pages, page_tables, snapshot, unchanged,
                           write_tokens)
from server_helpers import Server
from store_helpers import BLOCK, LAYOUT, make_kv, tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

L, H, D, DTYPE = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
PAGE, NUM_PAGES = 16, 24
CODEC = cs.KIVI(bits=4, group_size=32)


@dataclass
class World:
    """A cache holding prompts 0 and 1 (prompts 2 to 4 are not stored; their KV is in the
    pages too: 2 for every refused call, 3 and 4 for the writers that store),
    the engine's pages they were read from, and pages to load into."""

    kind: str
    cache: object
    pages: cs.KVPages
    tensors: list[torch.Tensor]
    tables: list[list[int]]
    toks: list[list[int]]
    dest: cs.KVPages
    dest_tensors: list[torch.Tensor]
    strided: cs.KVPages  # host pages whose head dim is not contiguous (built for the torch path)
    strided_tensors: list[torch.Tensor]

    def state(self):
        tier = self.cache.stats()["tiers"][0] if self.kind == "embedded" else {}
        blocks = [tier.get(k) for k in ("blocks", "used_bytes", "reservation_bytes", "held_slots", "evictions")]
        return ([self.cache.lookup(t) for t in self.toks], blocks,
                [snapshot(t) for t in (self.tensors, self.dest_tensors, self.strided_tensors)])

    def same_as(self, before) -> bool:
        lookups, blocks, tensors = before
        now = self.state()
        return now[:2] == (lookups, blocks) and all(
            unchanged(a, b) for a, b in zip(tensors, (self.tensors, self.dest_tensors, self.strided_tensors)))


@pytest.fixture(scope="module")
def backend_torch():
    # The torch path by default (quick); the cases that need the kernels ask for them.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kivi_codec.BACKEND_ENV, "torch")
        yield


@pytest.fixture(scope="module", params=["embedded", "remote"])
def world(request, tmp_path_factory, backend_torch):
    sizes = [2 * BLOCK] * 5
    toks = [tokens_for(300 + r, n) for r, n in enumerate(sizes)]
    pages, tensors = engine_pages("flash", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=1)
    tables = page_tables(sizes, PAGE, NUM_PAGES, seed=7)
    for r, (n, ids) in enumerate(zip(sizes, tables)):
        write_tokens(pages, make_kv(n, 300 + r), ids)
    dest, dest_tensors = engine_pages("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=2)
    # vLLM's CPU pages keep K column-major: taken by the torch path, not by the kernels
    strided_tensors = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in
                       engine_tensors("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=3, device="cpu")]
    strided = kv_pages("nhd", strided_tensors)
    if request.param == "embedded":
        # (pinned where CUDA is: the layer-wise writers' kernels store into the slots from the device)
        tiers = cs.TierConfig(cpu_bytes="16MiB")
        cache = cs.PrefixCache(model_id="contract", layout=LAYOUT, codec=CODEC, block_tokens=BLOCK, tiers=tiers)
        server = None
    else:
        server = Server(tmp_path_factory.mktemp("contract")).__enter__()
        cache = cs.RemoteCache(server.url, model_id="contract", layout=LAYOUT, codec=CODEC, block_tokens=BLOCK)
    try:
        assert [r.stored for r in cache.ingest_batch([cs.PagedRequest(t, ids) for t, ids in
                                                      zip(toks[:2], tables[:2])], pages)] == [2, 2]
        yield World(request.param, cache, pages, tensors, tables, toks, dest, dest_tensors, strided,
                    strided_tensors)
    finally:
        cache.close()
        if server is not None:
            server.__exit__(None, None, None)


def R(keys, ids, **kw):
    return cs.PagedRequest(keys, ids, **kw)


def _other(pages: cs.KVPages, **change) -> cs.KVPages:
    """Pages like ``pages`` (flash) but of another dtype, head count or layer count."""
    layers = change.get("layers", L)
    tensors = engine_tensors("flash", layers, change.get("heads", H), D, NUM_PAGES, PAGE, change.get("dtype", DTYPE))
    return kv_pages("flash", tensors)


# (name, the call, the error): prompt 2 is the one an ingest would store; prompts 0 and 1
# are stored, so a load would write their pages.
INGEST = [
    ("page outside", lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]), R(w.toks[2], [*w.tables[2][:3], 24])],
                                                    w.pages),
     r"^requests\[1\]\.page_ids\[3\]: page 24 is outside the 24 pages$"),
    ("negative page", lambda w: w.cache.ingest(w.toks[2], w.pages.at([-1, *w.tables[2][1:]])),
     r"^page_ids\[0\]: page -1 is outside the 24 pages$"),
    ("page twice", lambda w: w.cache.ingest_batch([R(w.toks[2], [*w.tables[2][:3], w.tables[2][1]])], w.pages),
     r"^requests\[0\]\.page_ids: page \d+ appears twice$"),
    ("float table", lambda w: w.cache.ingest(w.toks[2], w.pages.at(torch.tensor(w.tables[2], dtype=torch.float32))),
     r"^page_ids: expected a 1-D integer tensor, got torch.float32 \[4\]$"),
    ("bool table", lambda w: w.cache.ingest_batch([R(w.toks[2], torch.ones(4, dtype=torch.bool))], w.pages),
     r"^requests\[0\]\.page_ids: expected a 1-D integer tensor, got torch.bool"),
    ("2-D table", lambda w: w.cache.ingest(w.toks[2], w.pages.at(torch.tensor([w.tables[2]]))),
     r"^page_ids: expected a 1-D integer tensor, got torch.int64 \[1, 4\]$"),
    ("table on meta", lambda w: w.cache.ingest(w.toks[2], w.pages.at(torch.tensor(w.tables[2], device="meta"))),
     r"^page_ids: a meta tensor holds no page ids$"),
    ("numpy table", lambda w: w.cache.ingest(w.toks[2], w.pages.at(np.array(w.tables[2]))),
     r"^page_ids: expected a list of page ids or a 1-D tensor, got ndarray$"),
    ("table shorter than the keys", lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]),
                                                                   R(w.toks[2], w.tables[2][:3])], w.pages),
     r"^requests\[1\]\.page_ids: 3 pages of 16 tokens hold 48 tokens, but its keys name 2 full blocks \(64 tokens\)$"),
    # (one request names its parameters bare, as its other errors do: "kv.page_ids" before)
    ("table shorter than the keys, one request", lambda w: w.cache.ingest(w.toks[2], w.pages.at(w.tables[2][:3])),
     r"^page_ids: 3 pages of 16 tokens hold 48 tokens, but its keys name 2 full blocks \(64 tokens\)$"),
    # (counted as 128 tokens, they failed the page table's check: the page table was named)
    ("token ids of two rows", lambda w: w.cache.ingest(torch.tensor([w.toks[2]] * 2), w.pages.at(w.tables[2])),
     r"^token_ids: expected shape \[T\] or \[1, T\], got \[2, 64\]$"),
    ("token ids of two rows, in a batch",
     lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]), R(torch.tensor([w.toks[2]] * 2), w.tables[2])],
                                    w.pages),
     r"^requests\[1\]: token_ids: expected shape \[T\] or \[1, T\], got \[2, 64\]$"),
    ("token ids of two rows, contiguous KV", lambda w: w.cache.ingest(torch.tensor([w.toks[2]] * 2),
                                                                      make_kv(2 * BLOCK, 1)),
     r"^token_ids: expected shape \[T\] or \[1, T\], got \[2, 64\]$"),
    # (a start of 0.0 or False was taken by an ingest, refused by a load)
    ("a start of 0.0", lambda w: w.cache.ingest_batch([R(w.toks[2], w.tables[2], start=0.0)], w.pages),
     r"^requests\[0\]\.start: expected a multiple of the block size 32 >= 0, got 0\.0$"),
    ("a start of False", lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]), R(w.toks[2], w.tables[2],
                                                                                       start=False)], w.pages),
     r"^requests\[1\]\.start: expected a multiple of the block size 32 >= 0, got False$"),
    ("KV shorter than the keys", lambda w: w.cache.ingest(w.toks[2], make_kv(BLOCK, 1)),
     r"^token_ids: 64 tokens, but KV holds 32$"),
    ("KV of fewer layers", lambda w: w.cache.ingest(w.toks[2], make_kv(2 * BLOCK, 1)[:2]),
     r"^kv: 2 layers, the cache's layout has 3$"),
    ("pages of another dtype",
     lambda w: w.cache.ingest_batch([R(w.toks[2], w.tables[2])], _other(w.pages, dtype=torch.float32)),
     r"^pages: dtype torch.float32, the cache's layout says float16$"),
    ("pages of other heads", lambda w: w.cache.ingest(w.toks[2], _other(w.pages, heads=1).at(w.tables[2])),
     r"^pages: 1 KV heads of dim 64, the cache's layout has 2 of dim 64$"),
    ("pages of fewer layers", lambda w: w.cache.ingest_batch([R(w.toks[2], w.tables[2])], _other(w.pages, layers=2)),
     r"^pages: 2 layers, the cache's layout has 3$"),
    ("pages the kernels cannot read", lambda w: w.cache.ingest(w.toks[2], w.strided.at(w.tables[2])),
     r"^pages layer 0 K: the head dim must be contiguous for the Triton kernels"),
    # (the engine's pages, where one request's are taken: "got KVPages", and no word of .at())
    ("the pages, not a request's", lambda w: w.cache.ingest(w.toks[2], w.pages),
     r"^kv: expected an HF DynamicCache, a sequence of per-layer \(K, V\) or one request's pages "
     r"\(pages\.at\(page_ids\)\), got KVPages$"),
    ("not a request", lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]), (w.toks[2], w.tables[2])], w.pages),
     r"^requests\[1\]: expected a cacheseek.PagedRequest, got tuple$"),
    ("layer-wise writer, page twice",
     lambda w: w.cache.ingest_batch([R(w.toks[0], w.tables[0]), R(w.toks[2], [*w.tables[2][:3], w.tables[2][0]])],
                                    w.pages, layerwise=True),
     r"^requests\[1\]\.page_ids: page \d+ appears twice$"),
    ("layer-wise writer, pages of fewer layers",
     lambda w: w.cache.ingest_batch([R(w.toks[2], w.tables[2])], _other(w.pages, layers=2), layerwise=True),
     r"^pages: 2 layers, the cache's layout has 3$"),
]

LOAD = [
    ("page outside", lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3]), R(w.toks[1], [4, 5, 6, 24])],
                                                              w.dest),
     r"^requests\[1\]\.page_ids\[3\]: page 24 is outside the 24 pages$"),
    ("negative page", lambda w: w.cache.materialize_into(w.toks[0], w.dest.at([0, 1, -3, 2])),
     r"^page_ids\[2\]: page -3 is outside the 24 pages$"),
    ("page twice", lambda w: w.cache.materialize_into(w.toks[0], w.dest.at([5, 6, 5, 7])),
     r"^page_ids: page 5 appears twice$"),
    ("a page two requests write", lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3]),
                                                                           R(w.toks[1], [4, 5, 3, 6])], w.dest),
     r"^requests\[1\]\.page_ids: page 3 is also written by requests\[0\] in this call$"),
    ("a page two requests write, layer-wise",
     lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3]), R(w.toks[1], [4, 5, 6, 0])], w.dest,
                                              layerwise=True),
     r"^requests\[1\]\.page_ids: page 0 is also written by requests\[0\] in this call$"),
    ("a page two requests write, one after its start",
     lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3]), R(w.toks[1], [8, 9, 2, 10], start=BLOCK)],
                                              w.dest),
     r"^requests\[1\]\.page_ids: page 2 is also written by requests\[0\] in this call$"),
    # (a contiguous load given a request's pages for its device: torch's dump of its overloads)
    ("a request's pages as the device", lambda w: w.cache.materialize(w.toks[0], w.dest.at([0, 1, 2, 3])),
     r"^device: expected a torch.device, a str or an int, got PagedKV; to write into an engine's pages: "
     r"materialize_into\(keys, pages\.at\(page_ids\)\)$"),
    ("int table of floats", lambda w: w.cache.materialize_into(w.toks[0], w.dest.at(torch.tensor([0.0, 1.0]))),
     r"^page_ids: expected a 1-D integer tensor, got torch.float32"),
    ("pages of another dtype", lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3])],
                                                                        _other(w.pages, dtype=torch.bfloat16)),
     r"^pages: dtype torch.bfloat16, the cache's layout says float16$"),
    ("pages of fewer layers", lambda w: w.cache.materialize_into(w.toks[0], _other(w.pages, layers=1).at([0, 1, 2, 3])),
     r"^pages: 1 layers, the cache's layout has 3$"),
    ("pages of more layers, layer-wise",
     lambda w: w.cache.materialize_into(w.toks[0], _other(w.pages, layers=4).at([0, 1, 2, 3]), layerwise=True),
     r"^pages: 4 layers, the cache's layout has 3$"),
    ("pages the kernels cannot write", lambda w: w.cache.materialize_into(w.toks[0], w.strided.at([0, 1, 2, 3])),
     r"^pages layer 0 K: the head dim must be contiguous for the Triton kernels"),
    ("a start past the page table",
     lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3]), R(w.toks[1], [4, 5], start=2 * BLOCK)],
                                              w.dest),
     r"^requests\[1\]\.start: 64 tokens are in its pages, but its page table holds 2 pages of 16 tokens "
     r"\(32 tokens\)$"),
    ("a start past the page table, layer-wise",
     lambda w: w.cache.materialize_into_batch([R(w.toks[1], [4], start=BLOCK)], w.dest, layerwise=True),
     r"^requests\[0\]\.start: 32 tokens are in its pages, but its page table holds 1 pages of 16 tokens"),
    ("a start past the keys",
     lambda w: w.cache.materialize_into_batch([R(w.toks[0][:BLOCK], [0, 1, 2, 3, 4, 5], start=2 * BLOCK)], w.dest),
     r"^requests\[0\]\.start: 64 tokens are in its pages, but its keys name 32$"),
    ("a start of no whole block",
     lambda w: w.cache.materialize_into_batch([R(w.toks[0], [0, 1, 2, 3], start=5)], w.dest),
     r"^requests\[0\]\.start: expected a multiple of the block size 32 >= 0, got 5$"),
]

KERNELS = {"pages the kernels cannot read", "pages the kernels cannot write"}


def _refused(world, monkeypatch, name, call, match):
    if name in KERNELS:
        monkeypatch.setenv(kivi_codec.BACKEND_ENV, "triton")
    before = world.state()
    with pytest.raises(cs.InputError, match=match):
        result = call(world)
        if hasattr(result, "abort"):  # (a writer made by mistake would hold slots)
            result.abort()
    assert world.same_as(before), f"{name}: a page or the store changed"


@pytest.mark.parametrize("name, call, match", INGEST, ids=[c[0] for c in INGEST])
def test_a_refused_ingest_names_the_request_and_stores_nothing(world, monkeypatch, name, call, match):
    _refused(world, monkeypatch, name, call, match)


@pytest.mark.parametrize("name, call, match", LOAD, ids=[c[0] for c in LOAD])
def test_a_refused_load_names_the_request_and_writes_no_page(world, monkeypatch, name, call, match):
    _refused(world, monkeypatch, name, call, match)


def test_a_refused_write_behind_ingest_queues_nothing(world):
    before = world.state()
    with pytest.raises(cs.InputError, match=r"^requests\[0\]\.page_ids: page \d+ appears twice$"):
        world.cache.ingest_batch([R(world.toks[2], [*world.tables[2][:3], world.tables[2][2]])], world.pages,
                                 wait=False)
    with pytest.raises(cs.InputError, match=r"^wait=False: not with layerwise=True"):
        world.cache.ingest_batch([R(world.toks[2], world.tables[2])], world.pages, layerwise=True, wait=False)
    assert world.cache.flush(30)
    assert world.same_as(before)


def test_an_ingest_not_waited_for_gives_a_future_of_what_a_waited_one_gives(world):
    """Code written against either cache runs on both: ``wait=False`` and ``flush()`` on the
    embedded one too (its future done when the call returns)."""
    a, b = tokens_for(603, 2 * BLOCK), tokens_for(604, 2 * BLOCK)  # keys never stored (the KV of prompts 3, 4)
    one = world.cache.ingest(a, world.pages.at(world.tables[3]), wait=False)
    many = world.cache.ingest_batch([R(a, world.tables[3]), R(b, world.tables[4])], world.pages, wait=False)
    assert world.cache.flush(30)
    assert (one.result(30).stored, one.result(30).present) == (2, 0)
    assert [(r.stored, r.present) for r in many.result(30)] == [(0, 2), (2, 0)]
    assert [world.cache.lookup(k) for k in (a, b)] == [2 * BLOCK, 2 * BLOCK]


def test_a_start_inside_the_page_table_and_the_keys_still_loads(world):
    """What the start checks leave: a start at the end of the page table or of the keys is
    every block in the pages already (nothing fetched or written)."""
    before = snapshot(world.dest_tensors)
    got = world.cache.materialize_into_batch([R(world.toks[0], [10, 11, 12, 13], start=2 * BLOCK),
                                              R(world.toks[1], [14, 15, 16, 17, 18], start=2 * BLOCK)], world.dest)
    assert [(x.num_tokens, x.num_blocks) for x in got] == [(2 * BLOCK, 2), (2 * BLOCK, 2)]
    assert unchanged(before, world.dest_tensors)


# (RemoteCache's paged writer is the reference one: no slots mode there)
@pytest.mark.parametrize("world, mode", [("embedded", "reference"), ("embedded", "slots"), ("remote", "reference")],
                         indirect=["world"])
def test_an_empty_batch_is_a_step_with_nothing_to_do(world, monkeypatch, mode):
    """A step with no loads or saves: every batch call answers nothing, as ``locate_batch([])``
    does (each raised "expected a non-empty list" before), and its layer-wise handle and
    writer are used as any other's. Pages of another layout are still refused."""
    if mode == "slots":
        monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    before = world.state()
    assert world.cache.locate_batch([]) == []
    assert world.cache.materialize_into_batch([], world.dest) == []
    assert world.cache.ingest_batch([], world.pages) == []
    assert world.cache.ingest_batch((), world.pages, wait=False).result(30) == []
    load = world.cache.materialize_into_batch([], world.dest, layerwise=True)
    assert (load.requests, load.num_blocks, load.num_tokens, load.tiers) == ([], 0, 0, [])
    for layer in (2, 0, 1):
        load.wait(layer)
        assert load.ready(layer)
    load.synchronize()
    load.close()
    writer = world.cache.ingest_batch([], world.pages, layerwise=True)
    for layer in (1, 0, 2):
        writer.put_layer(layer)
    assert writer.finish() == []
    with world.cache.ingest_batch([], world.pages, layerwise=True) as writer:
        writer.put_layer(0)  # left without finish: aborted, as any writer
    with pytest.raises(RuntimeError, match=r"put_layer: the writer is aborted"):
        writer.put_layer(1)
    for call in (lambda: world.cache.ingest_batch([], _other(world.pages, layers=2)),
                 lambda: world.cache.materialize_into_batch([], _other(world.pages, layers=2), layerwise=True),
                 lambda: world.cache.ingest_batch([], _other(world.pages, layers=2), layerwise=True)):
        with pytest.raises(cs.InputError, match=r"^pages: 2 layers, the cache's layout has 3$"):
            call()
    with pytest.raises(cs.InputError, match=r"^requests: expected a list of cacheseek.PagedRequest"):
        world.cache.materialize_into_batch(None, world.dest)
    assert world.cache.flush(30)
    assert world.same_as(before)


# (RemoteCache's paged writer is the reference one: no slots mode there)
@pytest.mark.parametrize("world, mode", [("embedded", "reference"), ("embedded", "slots"), ("remote", "reference")],
                         indirect=["world"])
def test_a_layerwise_writer_used_out_of_turn_stores_nothing(world, monkeypatch, mode):
    """Layers in any order are taken; a layer twice, outside the layout or not an int is an
    ``InputError`` and the writer stays usable; ``finish`` with a layer missing stores nothing
    (and gives the reserved slots back); a finished or aborted writer refuses more with a
    ``RuntimeError``."""
    if mode == "slots":
        monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
    before = world.state()
    writer = world.cache.ingest_batch([R(world.toks[2], world.tables[2])], world.pages, layerwise=True)
    assert writer.mode == mode
    if mode == "slots":
        assert world.state()[1] != before[1]  # (slots held while the writer is open)
    writer.put_layer(2)
    writer.put_layer(0)
    for bad, match in ((2, r"^layer 2: put twice$"), (3, r"^layer: 3 is outside the layout's 3 layers \(0 to 2\)$"),
                       (-1, r"^layer: -1 is outside"), (True, r"^layer: expected an int index"),
                       (1.0, r"^layer: expected an int index")):
        with pytest.raises(cs.InputError, match=match):
            writer.put_layer(bad)
    assert writer.missing == [1]
    with pytest.raises(cs.InputError, match=r"^layers 1 were never put \(1 of 3\); nothing stored$"):
        writer.finish()
    with pytest.raises(RuntimeError, match=r"put_layer: the writer is aborted"):
        writer.put_layer(1)
    assert world.same_as(before)
    with world.cache.ingest_batch([R(world.toks[2], world.tables[2])], world.pages, layerwise=True) as writer:
        writer.put_layer(0)
    assert world.same_as(before)  # left without finish: aborted
    r = 3 if mode == "reference" else 4
    writer = world.cache.ingest_batch([R(world.toks[r], world.tables[r])], world.pages, layerwise=True)
    for i in (1, 2, 0):
        writer.put_layer(i)
    assert [x.stored for x in writer.finish()] == [2]
    with pytest.raises(RuntimeError, match=r"finish: the writer is finished"):
        writer.finish()
    assert world.cache.lookup(world.toks[r]) == 2 * BLOCK


def test_a_layerwise_load_waited_out_of_order_or_after_close(world):
    """Layers waited for in any order are the plain load's; after ``close`` every layer
    answers as loaded; after ``abandon`` a layer loaded before does, and one never loaded
    raises ``LoadError`` (a ``RuntimeError`` before, for loaded layers too); a layer outside
    the load is an ``InputError``."""
    want, _ = engine_pages("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=2)
    world.cache.materialize_into(world.toks[0], want.at([0, 1, 2, 3]))
    got, got_tensors = engine_pages("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=2)
    load = world.cache.materialize_into(world.toks[0], got.at([0, 1, 2, 3]), layerwise=True)
    for layer in (2, 0, 1):
        load.wait(layer)
    for bad, match in ((3, r"^layer: 3 is outside the 3 layers"), (-1, r"^layer: -1 is outside"),
                       (True, r"^layer: expected an int index")):
        with pytest.raises(cs.InputError, match=match):
            load.wait(bad)
    load.close()
    assert unchanged(want.k + want.v, got.k + got.v)
    for layer in range(L):
        load.wait(layer)
        assert load.ready(layer)
    load = world.cache.materialize_into(world.toks[0], got.at([0, 1, 2, 3]), layerwise=True)
    load.wait(0)
    load.abandon()
    load.wait(0)
    # Without CUDA a group is decoded when first waited for: layer 2's never was. (On a GPU
    # every group is issued before the handle is returned, and over HTTP every layer is
    # ready then: layer 2 is loaded.)
    assert load.ready(2) == (world.kind == "remote" or DEVICE != "cpu")
    if not load.ready(2):
        with pytest.raises(cs.LoadError, match=r"^layer 2 of the prefix was not loaded \(the load was abandoned\)"):
            load.wait(2)
        with pytest.raises(cs.LoadError, match=r"^layer 2 of the prefix was not loaded \(the load was abandoned\)"):
            load.synchronize()  # ("(NoneType: None)" before)
    else:
        load.wait(2)


def test_a_layerwise_writer_stores_the_requests_it_was_made_with(world):
    """The requests are checked and hashed when the writer is made; an engine may reuse the
    list it gave (or a page table in it) during the forward. The embedded writer (in
    reference mode, and for the blocks that got no slot) read them again on ``finish``: it
    stored a request it was never made with, from page ids it never checked, where
    ``RemoteCache`` (and the slots) kept to the plan."""
    fresh = tokens_for(403, 2 * BLOCK)  # keys never stored, the KV of prompt 3
    table = list(world.tables[3])
    requests = [R(fresh, table)]
    writer = world.cache.ingest_batch(requests, world.pages, layerwise=True)
    assert writer.mode == "reference"
    other = tokens_for(503, 2 * BLOCK)
    requests.append(R(other, world.tables[2]))  # the engine's list, reused
    table[0] = NUM_PAGES - 1  # (page 23: holds no prompt's KV)
    for i in range(L):
        writer.put_layer(i)
    assert [x.stored for x in writer.finish()] == [2]
    assert world.cache.lookup(other) == 0
    # what was stored is the KV of the pages the writer was made with
    got, _ = engine_pages("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=9)
    want, _ = engine_pages("nhd", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=9)
    assert world.cache.materialize_into(fresh, got.at([0, 1, 2, 3])).num_tokens == 2 * BLOCK
    reference = cs.PrefixCache(model_id="ref", layout=LAYOUT, codec=CODEC, block_tokens=BLOCK,
                               tiers=cs.TierConfig(cpu_bytes="16MiB", pin_memory=False))
    with reference:
        reference.ingest(fresh, world.pages.at(world.tables[3]))
        reference.materialize_into(fresh, want.at([0, 1, 2, 3]))
    assert unchanged(want.k + want.v, got.k + got.v)


@pytest.mark.parametrize("mode", ["reference", "slots"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_a_layerwise_writer_of_a_closed_cache_refuses_and_gives_its_slots_back(backend_torch, monkeypatch, mode, paged):
    """A cache closed while its writer was open (the engine shutting down mid-forward): every
    call of a closed cache raises, but the writer's slots went on being written, and
    ``finish`` committed them and reported the blocks stored."""
    monkeypatch.setattr(layerwise_save, "MIN_SAVE_BYTES", 0 if mode == "slots" else 1 << 62)
    pages, _ = engine_pages("flash", L, H, D, NUM_PAGES, PAGE, DTYPE, seed=1)
    kv = make_kv(2 * BLOCK, 300)
    write_tokens(pages, kv, [0, 1, 2, 3])
    toks = tokens_for(300, 2 * BLOCK)
    cache = cs.PrefixCache(model_id="closed", layout=LAYOUT, codec=CODEC, block_tokens=BLOCK,
                           tiers=cs.TierConfig(cpu_bytes="16MiB"))
    if paged:
        writer = cache.ingest_batch([R(toks, [0, 1, 2, 3])], pages, layerwise=True)
        put = writer.put_layer
    else:
        writer = cache.ingest_layerwise(toks)
        put = lambda i: writer.put_layer(i, *kv[i])  # noqa: E731
    put(0)
    assert writer.mode == mode
    cache.close()
    with pytest.raises(RuntimeError, match=r"^PrefixCache: closed"):
        put(1)
    with pytest.raises(RuntimeError, match=r"the writer is aborted"):
        writer.finish()
    tier = cache.stats()["tiers"][0]
    assert (tier["blocks"], tier["reservation_bytes"], tier["used_bytes"]) == (0, 0, 0)
