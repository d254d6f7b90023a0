"""A fuzz of the engine surface against bad input, in ``PrefixCache`` and in ``RemoteCache``
over a server on loopback alike: hypothesis builds a valid paged call (ingest or load, of
one request or a batch, whole or layer-wise, into pages of 16, 48, 64 tokens or a token
pool, Raw or KIVI), breaks one thing in one request, and checks that the call raises
``InputError`` naming that request and parameter, that no page changed (byte for byte,
the engine's other requests' pages included), that the store is as it was (blocks, bytes,
reservations, leases, staging), and that the valid call then does what it says: an ingest
stores its blocks, a load writes exactly the tokens of the blocks it loads and nothing
else of any page. ``test_paged_contract.py`` names each refusal once; this crosses them
with the shapes, positions and call forms a hand-written case does not reach.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek import layerwise_save
from cacheseek.quant import backend as kivi_codec
from cacheseek.store.device_staging import staging_stats
from paged_helpers import engine_pages, engine_tensors, kv_pages, snapshot, unchanged
from server_helpers import Server
from store_helpers import BLOCK, make_kv, tokens_for

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

B = BLOCK
LAYOUT = cs.KVLayout(num_layers=3, num_kv_heads=1, head_dim=32, dtype="float16")  # small: every page is compared
L, H, D, DTYPE = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.torch_dtype
# (kind, page size, pages): a page of a third of a block, one that does not divide the
# block, a page of two blocks, a token pool; each about 12 blocks of room.
PAGES = [("flash", 16, 24), ("nhd", 48, 8), ("hnd", 64, 6), ("pool", 1, 384)]
CODECS = {"raw": cs.Raw(), "int4": cs.KIVI(bits=4, group_size=32)}
# Stored at the start (contiguous), in both caches: what the loads find.
STORED = [tokens_for(700 + i, n) for i, n in enumerate((2 * B + 5, 3 * B, B + 20))]
EXAMPLES = int(os.environ.get("CACHESEEK_FUZZ_EXAMPLES", "25"))  # per cache kind: a few seconds on 2 cores


@dataclass
class World:
    kind: str
    caches: dict[str, Any]
    pages: dict[str, tuple[cs.KVPages, list[torch.Tensor]]]  # (source, the engine's tensors) per page kind
    dests: dict[str, tuple[cs.KVPages, list[torch.Tensor]]]
    server: Server | None = None

    def state(self) -> tuple:
        """Everything a refused call must leave as it was (no counter of lookups or reads)."""
        out: list[Any] = []
        for cache in self.caches.values():
            out.append([cache.lookup(t) for t in STORED])
            if self.kind == "embedded":
                tier = cache.stats()["tiers"][0]
                out.append([tier[k] for k in ("blocks", "used_bytes", "bytes_in", "evictions", "reservation_bytes",
                                              "leases_active", "held_slots")])
            else:
                behind = cache.client_stats()["write_behind"]
                out.append((behind["writes_pending"], behind["pending_bytes"]))  # (not the high-water mark)
        if self.kind == "remote":
            tiers = self.caches["raw"].stats()["tiers"]
            out.append([(t["name"], t["blocks"], t["used_bytes"], t["bytes_in"]) for t in tiers])
        # (by device, the idle ones aside: a device's pool is made at its first use, which a
        # call refused after its encode, for a NaN, may be on a GPU)
        out.append(sorted((p["device"], p["leases_active"]) for p in staging_stats() if p.get("leases_active")))
        return tuple(map(repr, out))

    def tensors(self, kind: str) -> list[torch.Tensor]:
        """The engine's tensors of ``kind``'s pages (a call is given no other pages)."""
        return [*self.pages[kind][1], *self.dests[kind][1]]


@pytest.fixture(scope="module")
def backend_torch():
    # The refusals come before any encode or decode; the torch path runs the valid calls
    # quickly (the kernels' paged forms are tested against it in test_paged.py).
    # CACHESEEK_FUZZ_BACKEND=triton runs them on the kernels (interpreted on a CPU: slow; on a
    # GPU, =auto: the kernels for CUDA tensors, torch for the CPU's).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kivi_codec.BACKEND_ENV, os.environ.get("CACHESEEK_FUZZ_BACKEND", "torch"))
        yield


@pytest.fixture(scope="module", params=["embedded", "remote"])
def world(request, tmp_path_factory, backend_torch):
    server = None
    if request.param == "remote":
        server = Server(tmp_path_factory.mktemp("paged-fuzz")).__enter__()
    caches: dict[str, Any] = {}
    try:
        for name, codec in CODECS.items():
            if server is None:
                caches[name] = cs.PrefixCache(model_id="fuzz", layout=LAYOUT, codec=codec, block_tokens=B,
                                              tiers=cs.TierConfig(cpu_bytes="64MiB"))
            else:
                caches[name] = cs.RemoteCache(server.url, model_id="fuzz", layout=LAYOUT, codec=codec,
                                              block_tokens=B)
            for i, toks in enumerate(STORED):
                kv = make_kv(len(toks), 700 + i, LAYOUT)
                assert caches[name].ingest(toks, kv).stored == len(toks) // B
        pages = {kind: engine_pages(kind, L, H, D, n, page, DTYPE, seed=11) for kind, page, n in PAGES}
        dests = {kind: engine_pages(kind, L, H, D, n, page, DTYPE, seed=12) for kind, page, n in PAGES}
        yield World(request.param, caches, pages, dests, server)
    finally:
        for cache in caches.values():
            cache.close()
        if server is not None:
            server.__exit__(None, None, None)


# -- the valid calls ------------------------------------------------------------------------


@dataclass(repr=False)
class Req:
    keys: Any
    ids: Any
    start: Any = 0
    max_tokens: Any = None
    tokens: int = 0  # the keys' tokens (before any mutation)
    stored: int = 0  # the keys' blocks stored before the call

    def __repr__(self) -> str:
        keys = f"{len(self.keys)} tokens" if isinstance(self.keys, list) and len(self.keys) > 8 else \
            f"{self.keys!r:.60}"
        return (f"Req({keys}, ids={self.ids!r:.80}, start={self.start!r:.20}, max_tokens={self.max_tokens!r:.20}, "
                f"stored={self.stored})")

    def request(self) -> Any:
        return cs.PagedRequest(self.keys, self.ids, max_tokens=self.max_tokens, start=self.start)


@dataclass(repr=False)
class Call:
    op: str  # ingest, ingest_batch, ingest_layerwise, load, load_batch, load_layerwise
    codec: str
    page_kind: str
    reqs: list[Req]
    wait: bool = True  # an ingest's: False, a future of its results
    slots: bool = False  # an embedded layer-wise ingest's: into reserved CPU-tier slots
    pages_override: Any = None

    def __repr__(self) -> str:
        return (f"Call({self.op}, {self.codec}, {self.page_kind}, wait={self.wait}, slots={self.slots}, "
                f"pages_override={self.pages_override!r:.60}, reqs={self.reqs})")

    @property
    def single(self) -> bool:
        return self.op in ("ingest", "load")

    @property
    def loads(self) -> bool:
        return self.op.startswith("load")


def page_size(kind: str) -> int:
    return next(p for k, p, _ in PAGES if k == kind)


def num_pages(kind: str) -> int:
    return next(n for k, _, n in PAGES if k == kind)


_FRESH = iter(range(10_000, 1 << 62))


def fresh_tokens(n: int) -> list[int]:
    """Token ids never used before in this run: the data drawn must not depend on what
    earlier examples stored, so a prompt's stored blocks are known when it is drawn."""
    return tokens_for(next(_FRESH), n)


OPS = ("ingest", "ingest_batch", "ingest_layerwise", "load", "load_batch", "load_layerwise")


@st.composite
def valid_calls(draw, ops: tuple[str, ...] = OPS) -> Call:
    op = draw(st.sampled_from(ops))
    kind = draw(st.sampled_from([k for k, _, _ in PAGES]))
    P, N = page_size(kind), num_pages(kind)
    n_req = 1 if op in ("ingest", "load") else draw(st.integers(1, 3))
    free = draw(st.permutations(range(N)))
    at = 0
    reqs: list[Req] = []
    for r in range(n_req):
        if op.startswith("load"):
            i = draw(st.integers(0, len(STORED)))  # (len(STORED): a prompt never stored)
            base = STORED[i] if i < len(STORED) else tokens_for(799, 2 * B)
            toks = base + fresh_tokens(draw(st.integers(0, B + 7)))
            stored = len(base) // B if i < len(STORED) else 0
            start = B * draw(st.integers(0, len(toks) // B))
            # a table may hold fewer tokens than the keys (the load stops there), not fewer than its start
            need = -(-len(toks) // P)
            pages = draw(st.integers(max(-(-start // P), min(need, 1)), need + 1))
            max_tokens = draw(st.one_of(st.none(), st.integers(0, len(toks) + B)))
        elif r and draw(st.booleans()):
            toks, stored = list(reqs[0].keys), reqs[0].stored  # one prompt twice: its blocks encoded once
            start, max_tokens = reqs[0].start, None
            pages = -(-len(toks) // P)
        else:
            # a stored prompt's first blocks, then new ones: some blocks present, some not
            i = draw(st.integers(0, len(STORED)))
            stored = draw(st.integers(0, len(STORED[i]) // B)) if i < len(STORED) else 0
            toks = STORED[i][: stored * B] if stored else []
            toks = toks + fresh_tokens(draw(st.integers(0 if stored else 1, 3 * B + 9)))
            start = 0 if op == "ingest" else B * draw(st.integers(0, len(toks) // B))  # (ingest takes none)
            pages = -(-len(toks) // P) + draw(st.integers(0, 1))
            max_tokens = None
        if at + pages > N:  # (no room left: the request takes what there is, if that covers it)
            pages = N - at
            if pages * P < (start if op.startswith("load") else len(toks) // B * B):
                break
        reqs.append(Req(toks, list(free[at : at + pages]), start, max_tokens, len(toks), stored))
        at += pages
    if not reqs:  # (the first request always fits: every page set holds it)
        raise AssertionError("no request fits")
    codec = draw(st.sampled_from(list(CODECS)))
    wait = op not in ("ingest", "ingest_batch") or draw(st.booleans())
    return Call(op, codec, kind, reqs, wait=wait, slots=op == "ingest_layerwise" and draw(st.booleans()))


def run_call(world: World, call: Call) -> Any:
    """The call as an engine makes it; a layer-wise handle is used to its end (layers waited
    for, or put, in a drawn order) and its results returned."""
    cache = world.caches[call.codec]
    pages = call.pages_override
    if pages is None:
        pages = (world.dests if call.loads else world.pages)[call.page_kind][0]
    reqs = [r.request() if isinstance(r, Req) else r for r in call.reqs]
    if call.op == "ingest":
        r = call.reqs[0]
        got = cache.ingest(r.keys, pages.at(r.ids), wait=call.wait)
        return [got if call.wait else got.result(30)]
    if call.op == "ingest_batch":
        got = cache.ingest_batch(reqs, pages, wait=call.wait)
        return got if call.wait else got.result(30)
    if call.op == "ingest_layerwise":
        with pytest.MonkeyPatch.context() as mp:
            if call.slots:
                mp.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
            with cache.ingest_batch(reqs, pages, layerwise=True) as writer:
                new = any(r.tokens // B > max(r.stored, r.start // B) for r in call.reqs if isinstance(r, Req))
                slots = call.slots and world.kind == "embedded" and new
                assert writer.mode == ("slots" if slots else "reference")
                for layer in reversed(range(L)):
                    writer.put_layer(layer)
                return writer.finish()
    if call.op == "load":
        r = call.reqs[0]
        return [cache.materialize_into(r.keys, pages.at(r.ids), max_tokens=r.max_tokens, start=r.start)]
    if call.op == "load_batch":
        return cache.materialize_into_batch(reqs, pages)
    assert call.op == "load_layerwise"
    with cache.materialize_into_batch(reqs, pages, layerwise=True) as load:
        for layer in (L - 1, 0, *range(1, L - 1)):
            load.wait(layer)
        return load.requests


# -- what the valid call must do -------------------------------------------------------------


def stored_blocks(cache, keys) -> int:
    return cache.lookup(keys) // B


def expected_load(world: World, call: Call) -> tuple[list[int], list[torch.Tensor]]:
    """Blocks each request loads, and the destination's tensors after the load: as before,
    with exactly the tokens of the blocks written (from ``start`` on) replaced by their
    decoded KV, which ``materialize`` gives."""
    cache = world.caches[call.codec]
    dest, tensors = world.dests[call.page_kind]
    want_tensors = snapshot(tensors)
    want = kv_pages(call.page_kind, want_tensors)
    P = dest.page_size
    counts = []
    for r in call.reqs:
        assert stored_blocks(cache, r.keys) == r.stored
        n = min(r.stored, len(r.ids) * P // B)
        if r.max_tokens is not None:
            n = min(n, r.max_tokens // B)
        counts.append(n)
        s = r.start // B
        if n <= s:
            continue
        got = cache.materialize(r.keys, want_tensors[0].device, max_tokens=n * B)
        t = torch.arange(s * B, n * B)
        page = torch.tensor(r.ids, dtype=torch.long)[t // P]
        slot = t % P
        for layer, (k, v) in enumerate(got.layers):
            want.k[layer][page, slot] = k[0, :, s * B : n * B].transpose(0, 1)
            want.v[layer][page, slot] = v[0, :, s * B : n * B].transpose(0, 1)
    return counts, want_tensors


def check_valid(world: World, call: Call) -> None:
    if call.loads:
        counts, want = expected_load(world, call)
        got = run_call(world, call)
        assert [x.num_blocks for x in got] == counts
        assert [x.num_tokens for x in got] == [n * B for n in counts]
        assert unchanged(want, world.dests[call.page_kind][1]), "a load wrote outside the blocks it loaded"
        return
    cache = world.caches[call.codec]
    got = run_call(world, call)
    for r, res in zip(call.reqs, got):
        full = r.tokens // B
        assert res.present >= max(0, r.stored - r.start // B), res
        assert res.blocks == full - r.start // B and res.failed == 0, res
        assert res.stored + res.present == res.blocks, res
        if r.start == 0:
            assert cache.lookup(r.keys) == full * B


# -- the mutations -------------------------------------------------------------------------


@dataclass
class Broken:
    call: Call
    target: int | None  # the request named; None: the call's pages
    what: str  # the mutation
    param: str = ""  # page_ids, start, max_tokens, keys, request, pages, nan, also_written
    detail: str = ""  # a regex the rest of the message must match
    nan_at: tuple | None = None  # (layer, side, page, slot, head, dim, value) written into the source pages


def _table_types(ids: list[int]) -> list[tuple[Any, str]]:
    return [
        (torch.tensor(ids, dtype=torch.float32), r": expected a 1-D integer tensor, got torch.float32"),
        (torch.tensor([i % 2 == 0 for i in ids]), r": expected a 1-D integer tensor, got torch.bool"),
        (torch.tensor([ids]), r": expected a 1-D integer tensor, got torch.int64 \[1, "),
        (np.array(ids), r": expected a list of page ids or a 1-D tensor, got ndarray"),
        (None, r": expected a list of page ids or a 1-D tensor, got NoneType"),
        (range(len(ids)), r": expected a list of page ids or a 1-D tensor, got range"),
        ([*ids[:-1], float(ids[-1])], r": expected a flat sequence of int page ids"),
        ([*ids[:-1], [ids[-1]]], r": expected a flat sequence of int page ids"),
        (torch.tensor(ids, device="meta"), r": a meta tensor holds no page ids"),
        ([*ids[:-1], True], rf"\[{len(ids) - 1}\]: a bool, not a page id"),
    ]


def _bad_keys(toks: list[int]) -> list[tuple[Any, str]]:
    j = len(toks) // 2
    return [
        ([], r"token_ids: empty input"),
        (None, r"keys: expected token ids"),
        (3.5, r"keys: expected token ids"),
        ("hello", r"keys: expected token ids"),
        ([*toks[:j], True, *toks[j + 1 :]], rf"token_ids\[{j}\]: a bool, not a token id"),
        ([*toks[:j], 2**31, *toks[j + 1 :]], r"token_ids: every id must be an int in the int32 range"),
        ([*toks[:j], float(toks[j]), *toks[j + 1 :]], r"token_ids: every id must be an int in the int32 range"),
        (torch.tensor(toks, dtype=torch.float32), r"token_ids: "),
        (torch.tensor([toks, toks]), r"token_ids: expected shape \[T\] or \[1, T\]"),
        (torch.tensor(toks, dtype=torch.bool), r"token_ids: a tensor of bools"),
        (cs.Prompt(None), r"keys: expected token ids"),
    ]


def _written(call: Call, world: World, r: int) -> list[int]:
    """Positions in request ``r``'s table of the pages its valid load writes."""
    req, P = call.reqs[r], page_size(call.page_kind)
    n = min(req.stored, len(req.ids) * P // B)
    if req.max_tokens is not None:
        n = min(n, req.max_tokens // B)
    s = req.start // B
    return list(range(s * B // P, -(-n * B // P))) if n > s else []


@st.composite
def broken_calls(draw, world: World) -> tuple[Call, Broken]:
    """(the valid call, the call with one thing broken)."""
    valid = draw(valid_calls())
    call = replace(valid, reqs=list(valid.reqs))
    n = len(call.reqs)
    # (a page two requests write needs a request after one that writes: drawn for it often)
    clash = [t for t in range(1, n) if _written(valid, world, t) and any(_written(valid, world, u) for u in range(t))]
    t = draw(st.sampled_from(clash)) if clash and draw(st.booleans()) else draw(st.integers(0, n - 1))
    req = call.reqs[t]
    P, N = page_size(call.page_kind), num_pages(call.page_kind)
    options = ["page_outside", "page_twice", "table_type", "keys", "pages"]
    if call.op != "ingest":  # (ingest(keys, pages.at(ids)) takes no start)
        options.append("start")
    if not call.single:
        options.append("not_request")
    if call.loads:
        options.append("max_tokens")
        if any(_written(valid, world, u) for u in range(t)) and _written(valid, world, t):
            options.append("also_written")
    else:
        if req.tokens >= B:
            options.append("table_short")
        first_new = max(req.start // B, req.stored)
        shared = any(call.reqs[u].keys == req.keys for u in range(t))
        if first_new < req.tokens // B and not shared:
            options.append("nan")
    # (the mutations only some calls take drawn as often as the rest together)
    rare = [o for o in options if o in ("also_written", "nan", "table_short")]
    what = draw(st.sampled_from(rare)) if rare and draw(st.booleans()) else draw(st.sampled_from(options))
    bad = Broken(call, t, what)

    def change(**kw) -> None:
        call.reqs[t] = replace(req, **kw)

    if what == "page_outside":
        if not req.ids:
            change(ids=[N])
            j, page = 0, N
        else:
            j = draw(st.integers(0, len(req.ids) - 1))
            page = draw(st.sampled_from([N, N + 7, -1, -N]))
            change(ids=[*req.ids[:j], page, *req.ids[j + 1 :]])
        bad.param, bad.detail = f"page_ids[{j}]", rf": page {page} is outside the {N} pages$"
    elif what == "page_twice":
        ids = req.ids if len(req.ids) >= 2 else [*req.ids, *(p for p in range(N) if p not in req.ids)][:2]
        a, b = sorted(draw(st.lists(st.integers(0, len(ids) - 1), min_size=2, max_size=2, unique=True)))
        ids = list(ids)
        ids[b] = ids[a]
        change(ids=ids)
        bad.param, bad.detail = "page_ids", rf": page {ids[a]} appears twice$"
    elif what == "table_type":
        ids = req.ids or [0]
        value, detail = draw(st.sampled_from(_table_types(ids)))
        change(ids=value)
        bad.param, bad.detail = "page_ids", detail
    elif what == "table_short":
        need = -(-(req.tokens // B * B) // P)
        change(ids=req.ids[: need - 1])
        bad.param, bad.detail = "page_ids", rf": {need - 1} pages of {P} tokens hold {(need - 1) * P} tokens, but"
    elif what == "keys":
        value, detail = draw(st.sampled_from(_bad_keys(req.keys)))
        change(keys=value)
        bad.param, bad.detail = "keys", detail
    elif what == "start":
        full = req.tokens // B
        choices = [(req.start + draw(st.integers(1, B - 1)), "expected a multiple"), (-B, "expected a multiple"),
                   (float(req.start), "expected a multiple"), (True, "expected a multiple"),
                   (None, "expected a multiple"), ("0", "expected a multiple")]
        if call.loads:
            choices.append((B * (req.tokens // B + 1), r"\d+ tokens are in its pages, but"))
        else:
            choices.append(((full + 1) * B, rf"\d+ tokens stored by an earlier call, but its keys name {full} full"))
        value, detail = draw(st.sampled_from(choices))
        change(start=value)
        bad.param, bad.detail = "start", rf": {detail}"
    elif what == "max_tokens":
        value = draw(st.sampled_from([float(B), "64", True, torch.tensor(True), torch.tensor([B]), -1]))
        change(max_tokens=value)
        bad.param, bad.detail = "max_tokens", r": expected an int number of tokens >= 0, or None for no limit, got "
    elif what == "not_request":
        call.reqs[t] = (req.keys, req.ids)
        bad.param, bad.detail = "request", r": expected a cacheseek.PagedRequest, got tuple$"
    elif what == "pages":
        change_what = draw(st.sampled_from(["dtype", "heads", "layers"]))
        tensors = engine_tensors(call.page_kind, L + (change_what == "layers"), H + (change_what == "heads"),
                                 D, N, P, torch.bfloat16 if change_what == "dtype" else DTYPE, seed=5)
        call.pages_override = kv_pages(call.page_kind, tensors)
        bad.target, bad.param = None, "pages"
        bad.detail = {"dtype": r"^pages: dtype torch.bfloat16, the cache's layout says float16$",
                      "heads": rf"^pages: {H + 1} KV heads of dim", "layers": rf"^pages: {L + 1} layers"}[change_what]
    elif what == "also_written":
        u = draw(st.sampled_from([u for u in range(t) if _written(valid, world, u)]))
        theirs = valid.reqs[u].ids[draw(st.sampled_from(_written(valid, world, u)))]
        j = draw(st.sampled_from(_written(valid, world, t)))
        change(ids=[*req.ids[:j], theirs, *req.ids[j + 1 :]])
        bad.param = "page_ids"
        bad.detail = rf": page {theirs} is also written by requests\[{u}\] in this call$"
    else:
        assert what == "nan"
        b = draw(st.integers(first_new, req.tokens // B - 1))
        tok = b * B + draw(st.integers(0, B - 1))
        layer, side = draw(st.integers(0, L - 1)), draw(st.sampled_from(["k", "v"]))
        bad.nan_at = (layer, side, req.ids[tok // P], tok % P, draw(st.integers(0, H - 1)),
                      draw(st.integers(0, D - 1)), draw(st.sampled_from([math.nan, math.inf, -math.inf])))
        bad.param, bad.detail = "nan", rf"holds NaN or Inf.*\(block {b}; nothing of this call is stored\)$"
    return valid, bad


def expected_message(bad: Broken) -> str:
    """What the error must start with: the request and the parameter (bare in a call of one
    request, where there is no request to name)."""
    if bad.param == "pages":
        return bad.detail
    single = bad.call.single
    who = "" if single else rf"requests\[{bad.target}\]"
    if bad.param == "keys":
        return rf"^{who}{': ' if who else ''}({bad.detail})"
    if bad.param == "nan":
        return rf"^{who or 'kv'}: .*{bad.detail}"
    if bad.param == "request":
        return rf"^{who}{bad.detail}"
    param = re.escape(bad.param)
    return rf"^{who}{'.' if who else ''}{param}{bad.detail}"


def no_leases(world: World) -> None:
    """Nothing held once a call has returned: no reservation, lease or staging buffer."""
    for cache in world.caches.values():
        if world.kind == "embedded":
            tier = cache.stats()["tiers"][0]
            assert (tier["reservation_bytes"], tier["leases_active"]) == (0, 0), tier
    assert all(p.get("leases_active", 0) == 0 for p in staging_stats()), staging_stats()


@given(data=st.data())
@settings(max_examples=EXAMPLES, deadline=None, database=None)
def test_a_broken_call_names_its_request_and_changes_nothing_then_the_valid_one_works(world, data):
    valid, bad = data.draw(broken_calls(world))
    event(f"{valid.op}: {bad.what}")
    restore = None
    if bad.nan_at is not None:
        layer, side, page, slot, h, d, value = bad.nan_at
        pages = world.pages[valid.page_kind][0]
        view = (pages.k if side == "k" else pages.v)[layer]
        restore = (view, page, slot, view[page, slot].clone())
        view[page, slot, h, d] = value
    before_pages = snapshot(world.tensors(valid.page_kind))
    before = world.state()
    try:
        with pytest.raises(cs.InputError) as refused:
            run_call(world, bad.call)
        assert re.search(expected_message(bad), str(refused.value)), (expected_message(bad), str(refused.value))
        assert unchanged(before_pages, world.tensors(valid.page_kind)), "a refused call changed a page"
        assert world.state() == before, ("a refused call changed the store", before, world.state())
    finally:
        if restore is not None:
            view, page, slot, value = restore
            view[page, slot] = value
    no_leases(world)
    check_valid(world, valid)
    no_leases(world)


# -- layer-wise handles used in any order, and left part way -----------------------------------


def _layer_state(world: World, kind: str, before: list[torch.Tensor], want: list[torch.Tensor]) -> list[str]:
    """Per layer of the destination: "loaded" (K and V as the load writes them), "before"
    (untouched), or "torn" (anything else: part of a layer, or tokens outside the load)."""
    dest = world.dests[kind][0]
    was, will = kv_pages(kind, before), kv_pages(kind, want)
    out = []
    for layer in range(L):
        now = [dest.k[layer], dest.v[layer]]
        if unchanged([will.k[layer], will.v[layer]], now):
            out.append("loaded")
        elif unchanged([was.k[layer], was.v[layer]], now):
            out.append("before")
        else:
            out.append("torn")
    return out


@st.composite
def handle_uses(draw) -> tuple[Call, list[tuple[str, int]], str]:
    """A valid layer-wise load, what its consumer does with the handle (waits, asks, in any
    order and more than once), and how it leaves it: closed, abandoned, or dropped."""
    call = draw(valid_calls(("load_layerwise",)))
    layer = st.integers(0, L - 1)
    step = st.one_of(st.tuples(st.just("wait"), layer), st.tuples(st.just("ready"), layer),
                     st.tuples(st.sampled_from(["done", "close", "abandon"]), st.just(0)))
    return call, draw(st.lists(step, max_size=6)), draw(st.sampled_from(["close", "abandon", "drop"]))


@given(data=st.data())
@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, database=None)
def test_a_layerwise_load_used_in_any_order_writes_whole_layers_and_gives_everything_back(world, data):
    """Each layer of the pages is the loaded one or the one before, never part of either;
    a layer waited for is loaded; after ``close`` every one is; after ``abandon`` (or a
    handle dropped unclosed) a layer not loaded raises ``LoadError``; nothing is held after."""
    call, steps, end = data.draw(handle_uses())
    cache, (dest, tensors) = world.caches[call.codec], world.dests[call.page_kind]
    counts, want = expected_load(world, call)
    before = snapshot(tensors)
    load = cache.materialize_into_batch([r.request() for r in call.reqs], dest, layerwise=True)
    assert [x.num_blocks for x in load.requests] == counts
    waited, closed, abandoned = set(), False, False
    for what, layer in steps:
        if what == "wait":
            if abandoned and not load.ready(layer):
                with pytest.raises(cs.LoadError, match=rf"^layer {layer} of the prefix was not loaded"):
                    load.wait(layer)
                continue
            load.wait(layer)
            waited.add(layer)
        elif what == "ready":
            ready = load.ready(layer)
            assert not (closed and not abandoned) or ready
            if ready:
                waited.add(layer)
        elif what == "done":
            load.done()
        elif what == "close":
            load.close()
            closed = True
        else:
            load.abandon()
            closed = abandoned = True
        state = _layer_state(world, call.page_kind, before, want)
        assert "torn" not in state, state
        assert all(state[i] == "loaded" for i in waited), (state, waited)
        if closed and not abandoned:
            assert state == ["loaded"] * L
    if end == "drop":
        del load  # (its last reference: finalized here)
    elif end == "close":
        load.close()
        if not abandoned:
            waited = set(range(L))
    else:
        load.abandon()
    state = _layer_state(world, call.page_kind, before, want)
    assert "torn" not in state and all(state[i] == "loaded" for i in waited), (state, waited)
    no_leases(world)


@st.composite
def save_uses(draw) -> tuple[Call, list[int], str]:
    """A valid layer-wise save, the layers put (any order, one maybe twice), and how it is
    left before its end: aborted, dropped, an exception in its ``with``, or finished with a
    layer missing."""
    call = draw(valid_calls(("ingest_layerwise",)))
    layers = draw(st.lists(st.integers(0, L - 1), max_size=L + 1))
    return call, layers, draw(st.sampled_from(["abort", "drop", "raise", "finish"]))


@given(data=st.data())
@settings(max_examples=max(10, EXAMPLES // 2), deadline=None, database=None)
def test_a_layerwise_save_left_part_way_stores_nothing_and_the_next_one_stores(world, data):
    call, layers, end = data.draw(save_uses())
    cache, pages = world.caches[call.codec], world.pages[call.page_kind][0]
    before = world.state()
    with pytest.MonkeyPatch.context() as mp:
        if call.slots:
            mp.setattr(layerwise_save, "MIN_SAVE_BYTES", 0)
        writer = cache.ingest_batch([r.request() for r in call.reqs], pages, layerwise=True)
        put: set[int] = set()
        for layer in layers:
            if layer in put:
                with pytest.raises(cs.InputError, match=rf"^layer {layer}: put twice$"):
                    writer.put_layer(layer)
            else:
                writer.put_layer(layer)
                put.add(layer)
        if end == "finish" and len(put) == L:
            end = "abort"  # (every layer put: finish would store; this test leaves it part way)
        if end == "abort":
            writer.abort()
        elif end == "drop":
            del writer  # (its last reference: finalized here)
        elif end == "raise":
            with pytest.raises(ZeroDivisionError):
                with writer:
                    raise ZeroDivisionError
        else:
            with pytest.raises(cs.InputError, match=r"^layers [\d, ]+ were never put"):
                writer.finish()
    if world.kind == "remote":
        assert cache.flush(30)
    assert world.state() == before, "a save left part way stored or held something"
    no_leases(world)
    check_valid(world, call)
    no_leases(world)
