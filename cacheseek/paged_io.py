"""KV in an engine's pages <-> block frames: the paged data path shared by ``PrefixCache``
and ``RemoteCache`` (``ingest`` of a ``PagedKV``, ``ingest_batch``, ``materialize_into``,
``materialize_into_batch``).

A call is planned whole before anything runs: every request's keys hashed, its page table
checked (ids inside the pages, none twice; for a write, no page shared by two requests),
and the blocks of every request numbered into one list, the call's rows (request r's
block b). One ``PagedSource`` maps each row to its pages, so the kernels take any rows of
any requests in one launch: encoding reads the pages in place (no contiguous copy of the
KV first), and decoding writes them in place (no contiguous KV in between). Launches are
cut by the data path's own batching (runs of new blocks, chunks of landed frames), never
by request; a launch holds blocks of one codec, as a codec mixed by block position needs.

Bad input raises ``InputError`` naming the request and the parameter, before anything is
encoded, stored or written; NaN or Inf found by the encode is traced to its request, and
what the call had stored is deleted again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import batching
from .block_format import BlockFormat
from .decode import BatchDecoder
from .errors import InputError
from .hashing import BlockHash
from .layout import KVLayout
from .pages import KVPages, PagedKV, PagedRequest, PagedSource, host_page_tables, page_table
from .prefix_keys import PrefixKeys, as_index
from .quant.codec import KVLayerCodec
from .quant.policy import single_codec
from .results import IngestResult, stored_prefix
from .staging import payload_views, staging_stride
from .encode import give_back
from .store.device_staging import StagingLease, staging_pool
from .store.streams import current_stream
from .store.tier import BlockFrame


@dataclass(slots=True)
class PagedCall:
    """One paged call, planned: per request its name (for errors), keys, page table and
    hashes; the rows (request, block) of the call and their ``PagedSource``."""

    pages: KVPages
    names: list[str]
    tables: list[torch.Tensor]
    hashes: list[list[BlockHash]]
    parents: list[list[bytes]]
    rows: list[tuple[int, int]] = field(default_factory=list)
    source: PagedSource | None = None
    sizes: list[int] = field(default_factory=list)  # full blocks each request's keys name
    tokens: list[int] = field(default_factory=list)  # tokens each request's keys name
    block_tokens: int = 0
    single: bool = False  # one request (``ingest`` / ``materialize_into``): parameters named bare
    # An ingest's: per request its first block to store (``PagedRequest.start``); those
    # before it an earlier call of the caller's stored: hashed (the chain's keys need
    # them), never looked up, encoded nor sent. Empty: every request from block 0.
    starts: list[int] = field(default_factory=list)

    def param(self, r: int, name: str) -> str:
        """How errors name parameter ``name`` of request ``r``: ``requests[1].max_tokens``
        in a batch, ``max_tokens`` in a call of one request."""
        return name if self.single else f"{self.names[r]}.{name}"

    def flat(self) -> tuple[list[BlockHash], list[bytes], list[int]]:
        """Every request's hashes, parents and block positions, end to end (row order)."""
        hashes: list[BlockHash] = []
        parents: list[bytes] = []
        positions: list[int] = []
        for h, p in zip(self.hashes, self.parents):
            hashes += h
            parents += p
            positions += range(len(h))
        return hashes, parents, positions

    def stored_before(self) -> list[bool]:
        """Per block (``flat()`` order) whether it lies before its request's ``starts``."""
        if not self.starts:
            return [False] * sum(len(h) for h in self.hashes)
        return [b < s for h, s in zip(self.hashes, self.starts) for b in range(len(h))]

    def request_of(self, row: int) -> int:
        return self.rows[row][0]

    def every_row(self) -> list[tuple[int, int]]:
        """(request, block) of every full block the call's keys name, in request order."""
        return [(r, b) for r, n in enumerate(self.sizes) for b in range(n)]

    def use_rows(self, rows: list[tuple[int, int]]) -> None:
        """Make ``rows`` ((request, block) each) the call's rows, with their source."""
        self.rows = rows
        self.source = PagedSource(self.pages, self.tables, rows, self.block_tokens)

    def rows_source(self) -> PagedSource:
        """The source of the call's rows (made by ``use_rows``)."""
        if self.source is None:
            raise RuntimeError("PagedCall: its rows are not chosen yet (use_rows)")
        return self.source


def _name(index: int | None) -> str:
    return "kv" if index is None else f"requests[{index}]"


def as_requests(requests: Any) -> list[PagedRequest]:
    # An empty list is a step with nothing to load or save (as ``locate_batch([])``): its
    # call answers nothing, so an engine calling once per step needs no guard of its own.
    if not isinstance(requests, (list, tuple)):
        raise InputError("requests: expected a list of cacheseek.PagedRequest")
    for i, r in enumerate(requests):
        if not isinstance(r, PagedRequest):
            raise InputError(f"requests[{i}]: expected a cacheseek.PagedRequest, got {type(r).__name__}")
    return list(requests)


def check_pages(pages: Any, layout: KVLayout) -> KVPages:
    if not isinstance(pages, KVPages):
        raise InputError(f"pages: expected a cacheseek.KVPages, got {type(pages).__name__}")
    pages.check(layout)
    return pages


def _bad_keys(call: PagedCall, r: int, request_keys: Any, exc: TypeError) -> InputError:
    # The keys' own checks raise InputError; keys of no type they know (None, a number, a
    # sequence of mixed types) fail in len() or the hashing instead, naming no request.
    return InputError(f"{call.param(r, 'keys')}: expected token ids, a Prompt or bytes per block, "
                      f"got {type(request_keys).__name__} ({exc})")


def _keys_error(call: PagedCall, r: int, exc: InputError) -> InputError:
    # A call of one request has no request to name, and its keys are what is wrong, not its
    # ``kv`` (``materialize_into`` has none): the error as ``ingest``/``materialize`` give it.
    return exc if call.single else InputError(f"{call.names[r]}: {exc}")


def plan(keys: PrefixKeys, layout: KVLayout, pages: KVPages, requests: Sequence[tuple[Any, Any, int | None]],
         *, single: bool) -> PagedCall:
    """Check every request (``(keys, page_ids, max_tokens)``): its keys name tokens, its
    page table is one of ``pages``' (ids inside, none twice). Hashing is ``hash_requests``."""
    check_pages(pages, layout)
    call = PagedCall(pages, [], [], [], [], block_tokens=keys.block_tokens, single=single)
    tables = host_page_tables([page_ids for _, page_ids, _ in requests])
    for i, ((request_keys, _, _), page_ids) in enumerate(zip(requests, tables)):
        name = _name(None if single else i)
        call.names.append(name)
        try:
            tokens = keys.num_tokens(request_keys)
        except InputError as exc:
            raise _keys_error(call, i, exc) from None
        except TypeError as exc:
            raise _bad_keys(call, i, request_keys, exc) from None
        call.tables.append(page_table(page_ids, pages, call.param(i, "page_ids")))
        call.sizes.append(tokens // keys.block_tokens)
        call.tokens.append(tokens)
    return call


def hash_requests(call: PagedCall, keys: PrefixKeys, requests: Sequence[tuple[Any, Any, int | None]]) -> None:
    for r, (request_keys, _, _) in enumerate(requests):
        try:
            hashes = keys.block_hashes(request_keys)
        except InputError as exc:
            raise _keys_error(call, r, exc) from None
        except TypeError as exc:
            raise _bad_keys(call, r, request_keys, exc) from None
        call.hashes.append(hashes)
        call.parents.append(keys.parents(hashes) if hashes else [])


def plan_ingest(keys: PrefixKeys, layout: KVLayout, pages: KVPages, requests: Sequence[tuple[Any, Any, int | None]],
                *, single: bool, starts: Sequence[Any] | None = None) -> PagedCall:
    """Plan an ingest: every full block of every request is read from its pages, so each
    page table must cover them. ``hash_requests`` hashes; ``use_rows`` picks the blocks to
    encode (possibly before the hashing, so that a chain's tail can be launched first).
    ``starts``: each request's ``PagedRequest.start`` as given (``call.starts``)."""
    call = plan(keys, layout, pages, requests, single=single)
    B, P = keys.block_tokens, pages.page_size
    for r, (table, n) in enumerate(zip(call.tables, call.sizes)):
        if table.numel() * P < n * B:
            raise InputError(f"{call.param(r, 'page_ids')}: {table.numel()} pages of {P} tokens hold "
                             f"{table.numel() * P} tokens, but its keys name {n} full blocks ({n * B} tokens)")
    if starts is not None:
        # (each checked, 0 too: a start of 0.0 or False, refused by a load, was taken here)
        checked = ingest_starts(call, starts)
        if any(checked):
            call.starts = checked
    return call


def ingest_starts(call: PagedCall, starts: Sequence[Any]) -> list[int]:
    """Each request's first block to store (``starts``: each one's ``start`` in tokens, as
    given), in blocks; ``InputError`` naming the request for a start that is not a whole
    number of blocks, or past the full blocks its keys name."""
    B, out = call.block_tokens, []
    for r, (given, n) in enumerate(zip(starts, call.sizes, strict=True)):
        name = call.param(r, "start")
        start = as_index(given)
        if start is None or start < 0 or start % B:
            raise InputError(f"{name}: expected a multiple of the block size {B} >= 0, got {given!r:.40}")
        if start > n * B:
            raise InputError(f"{name}: {start} tokens stored by an earlier call, but its keys name "
                             f"{n} full blocks ({n * B} tokens)")
        out.append(start // B)
    return out


def look_up_from_starts(call: PagedCall, hashes: Sequence[BlockHash], look_up: Any) -> list[bool]:
    """``look_up`` (hashes -> a bool each) of the blocks from each request's start on;
    per block (``flat()`` order) whether it was found, False for those before a start
    (not asked)."""
    before = call.stored_before()
    asked = [key for key, b in zip(hashes, before) if not b]
    got = iter(look_up(asked) if asked else [])
    return [False if b else bool(next(got)) for b in before]


def ingest_results(call: PagedCall, found: Sequence[bool], durability: str
                   ) -> tuple[list[IngestResult], list[bool], dict[bytes, list[IngestResult]]]:
    """Before a hashed call's ingest: one ``IngestResult`` per request, and what
    ``count_found`` gives for them."""
    results = new_results(call, durability)
    return (results, *count_found(call, found, results))


def new_results(call: PagedCall, durability: str = "durable") -> list[IngestResult]:
    """One empty ``IngestResult`` per request of a hashed call: its blocks (and tokens)
    from its start on, those before it being an earlier call's."""
    B, starts = call.block_tokens, call.starts or [0] * len(call.hashes)
    return [IngestResult(blocks=len(h) - s, stored=0, present=0, tokens=(len(h) - s) * B, durability=durability)
            for h, s in zip(call.hashes, starts)]


def count_found(call: PagedCall, found: Sequence[bool], results: Sequence[IngestResult]
                ) -> tuple[list[bool], dict[bytes, list[IngestResult]]]:
    """Per block (in ``flat()`` order) whether it needs no encoding: stored already
    (``found``, counted present in its request's result), or met earlier in the call (two
    requests with one prefix encode and write it once); and for each block met again, the
    results of the later requests holding it. They count the outcome of its one write
    (``count_outcome``'s ``copies``), not present before it runs: a write that fails must
    not leave them saying the block is stored. A block before its request's start needs
    none either, and counts nowhere (an earlier call stored it)."""
    present, i = list(found), 0
    copies: dict[bytes, list[IngestResult]] = {}
    seen: set[bytes] = set()
    starts = call.starts or [0] * len(call.hashes)
    for result, hashes, start in zip(results, call.hashes, starts):
        for b, key in enumerate(hashes):
            if b < start:
                # (not in ``seen``: another request holding it past its own start stores it)
                present[i] = True
                i += 1
                continue
            if present[i]:
                result.present += 1
            elif key in seen:
                present[i] = True
                copies.setdefault(key, []).append(result)
            seen.add(key)
            i += 1
    return present, copies


def touch_found(store: Any, call: PagedCall, found: Sequence[bool]) -> frozenset[bytes]:
    """Mark each request's blocks stored already (``found``, in ``flat()`` order) used, as
    ``ingest`` does before its puts make room: request by request, each its own chain, as
    ingests of them one after another would. (As one chain of them all, the last
    request's stored prefix was the least recently used, and its own new blocks, put
    first, evicted it: they were stored below a gap.) One call all the same, one round trip
    to a shared index: ``touch_chain`` uses a chain tail first, so the last request goes first.
    Returns what the call's puts spare (``TieredStore.put_many``): one request's stored
    prefix; none for several, whose other chains are what may make the room."""
    ends = list(itertools.accumulate(len(hashes) for hashes in call.hashes))
    store.touch_chain([key for hashes, end in zip(reversed(call.hashes), reversed(ends))
                       for key, was in zip(hashes, found[end - len(hashes) : end]) if was], count_use=False)
    if len(call.hashes) != 1:
        return frozenset()
    return frozenset(call.hashes[0][: stored_prefix(found)])


def load_starts(call: PagedCall, starts: Sequence[Any], block_tokens: int) -> list[int]:
    """Each request's first block to write (``starts``: each one's ``start`` in tokens,
    ``PagedRequest.start`` or ``materialize_into``'s, as given), in blocks; ``InputError``
    naming the request for a start that is not a whole number of blocks, or that says more
    tokens are in its pages than its page table or its keys hold."""
    P = call.pages.page_size
    out = []
    for r, (given, table, tokens) in enumerate(zip(starts, call.tables, call.tokens, strict=True)):
        name = call.param(r, "start")
        start = as_index(given)
        if start is None or start < 0 or start % block_tokens:
            raise InputError(f"{name}: expected a multiple of the block size {block_tokens} >= 0, "
                             f"got {given!r:.40}")
        # A start past them was taken: its blocks were counted loaded (as far as they were
        # stored), tokens the engine then read from pages the request does not have.
        if start > table.numel() * P:
            raise InputError(f"{name}: {start} tokens are in its pages, but its page table holds "
                             f"{table.numel()} pages of {P} tokens ({table.numel() * P} tokens)")
        if start > tokens:
            raise InputError(f"{name}: {start} tokens are in its pages, but its keys name {tokens}")
        out.append(start // block_tokens)
    return out


def starts_of(requests: Any) -> list[Any]:
    """Each ``PagedRequest``'s ``start``, as given (``load_starts`` checks a load's,
    ``ingest_starts`` an ingest's)."""
    return [r.start for r in as_requests(requests)]


def plan_load(call: PagedCall, counts: Sequence[int], block_tokens: int, starts: Sequence[int] | None = None) -> None:
    """Rows for loading blocks ``[starts[r], counts[r])`` of each request into its pages:
    refuses a page that two requests would write (``InputError`` naming both), then maps
    the rows. The pages of blocks before ``starts[r]`` are not written."""
    P = call.pages.page_size
    starts = starts or [0] * len(counts)
    written = [table[s * block_tokens // P : -(-n * block_tokens // P)] if n > s else table[:0]
               for table, n, s in zip(call.tables, counts, starts)]
    every = torch.cat(written) if written else torch.zeros(0, dtype=torch.int32)
    if every.numel() and torch.unique(every).numel() != every.numel():
        owner: dict[int, int] = {}
        for r, ids in enumerate(written):
            for page in ids.tolist():
                if page in owner:
                    raise InputError(f"{call.names[r]}.page_ids: page {page} is also written by "
                                     f"{call.names[owner[page]]} in this call")
                owner[page] = r
    call.use_rows([(r, b) for r, (n, s) in enumerate(zip(counts, starts)) for b in range(s, n)])


def load_limits(call: PagedCall, requests: Sequence[tuple[Any, Any, int | None]], block_tokens: int) -> list[int]:
    """Blocks each request may load: its full blocks, as far as its page table holds them
    and its ``max_tokens`` allows."""
    P = call.pages.page_size
    out = []
    for r, ((_, _, given), table, hashes) in enumerate(zip(requests, call.tables, call.hashes)):
        # A float would slice the chain with a float, a str fail in max(): neither names the request.
        max_tokens = None if given is None else as_index(given)
        if given is not None and (max_tokens is None or max_tokens < 0):
            raise InputError(f"{call.param(r, 'max_tokens')}: expected an int number of tokens >= 0, or None for no "
                             f"limit, got {type(given).__name__} {given!r:.40}")
        n = min(len(hashes), table.numel() * P // block_tokens)
        if max_tokens is not None:
            n = min(n, max_tokens // block_tokens)
        out.append(n)
    return out


def raise_bad_input(call: PagedCall, exc: InputError) -> None:
    """Re-raise ``exc`` (NaN or Inf found by a paged encode) naming its request and block."""
    bad = call.source.bad_blocks() if call.source is not None else []
    if not bad or exc.names_request:  # named already (an encode, then its caller)
        raise exc
    r, b = call.rows[bad[0]]
    named = InputError(f"{call.names[r]}: {exc} (block {b}; nothing of this call is stored)")
    named.names_request = True
    raise named from None


def encode_frames(fmt: BlockFormat, source: PagedSource, start: int, stop: int, hashes: Sequence[bytes],
                  parents: Sequence[bytes], positions: Sequence[int],
                  leases: list[StagingLease] | None = None) -> tuple[list[BlockFrame], Any]:
    """Frames of rows ``[start, stop)`` of ``source``, their payloads in one device staging
    buffer at a fixed stride, encoded straight from the pages in one launch per side; and
    the codec's flags (not yet waited for), to check before the frames are used.
    ``leases``: the staging is leased from the device's pool and its lease appended there
    (the caller releases it once the frames' bytes are copied); else a plain tensor."""
    n = stop - start
    metas = fmt.plan_run(start, hashes[start : start + 1], parents[start : start + 1], positions[start : start + 1])
    payload = metas[0].payload_nbytes
    stride = staging_stride(payload)
    if leases is None:
        buf = torch.empty((n, stride), dtype=torch.uint8, device=source.device)
    else:
        lease = staging_pool(source.device).take(n * stride)
        leases.append(lease)
        buf = lease.rows(n, stride)
    flags = source.encode(fmt.codec, start, n, payload_views(buf, metas[0].tensors, n, stride))
    # The host plans the frames while the device encodes.
    metas += fmt.plan_run(start + 1, hashes[start + 1 : stop], parents[start + 1 : stop], positions[start + 1 : stop])
    return [BlockFrame(meta, device_payload=buf[i, :payload], sealed=False) for i, meta in enumerate(metas)], flags


def encoded_batches(fmt: BlockFormat, call: PagedCall, hashes: Sequence[bytes], parents: Sequence[bytes],
                    positions: Sequence[int], missing: Sequence[bool], batch_blocks: int, *, tail_first: bool = False,
                    pooled: bool = False, check_first: bool = False):
    """(first row, frames) of the rows ``missing`` marks, a run of at most ``batch_blocks``
    at a time, each checked for NaN and Inf (``InputError`` naming the request) before it is
    yielded; with ``check_first`` and several runs, every run before the first (as
    ``encode.iter_encoded``'s). ``hashes``, ``parents``, ``positions``: those of the call's
    rows. ``pooled``: as ``iter_encoded``'s (the frames of a run are valid until the next
    is asked for)."""
    runs = list(batching.runs(missing, batch_blocks))
    if tail_first:
        runs.reverse()
    source, codec = call.rows_source(), single_codec(fmt.codec)
    if check_first and len(runs) > 1:
        try:
            for start, stop in runs:
                source.check_values(codec, start, stop - start)
        except InputError as exc:
            raise_bad_input(call, exc)
    held: list[StagingLease] = []
    device = source.device
    try:
        for start, stop in runs:
            frames, flags = encode_frames(fmt, source, start, stop, hashes, parents, positions,
                                          held if pooled else None)
            if device.type == "cuda":
                current_stream(device).synchronize()  # flags are written in host memory
            try:
                codec.check_finite(flags, fmt.layout.dtype)
            except InputError as exc:
                raise_bad_input(call, exc)
            yield start, frames
            give_back(held, device)
    finally:
        give_back(held, device)


class PageSink:
    """Where a ``BatchDecoder`` decodes into pages: decoder row ``j`` is the call's row
    ``rows[j]``; a chunk of consecutive rows is one ``decode_into_pages`` (a chunk splits
    only where a request's prefix ended early, a block found gone since the lookup)."""

    def __init__(self, codec: KVLayerCodec, source: PagedSource) -> None:
        self.codec, self.source = codec, source
        self.rows: list[int] = []  # the call's row of each block added to the decoder

    def prepare(self) -> None:
        """Make the kernels' device tables now, on the current stream (a layer-wise load
        decodes on a stream of its own; the tables are kept for later calls on any stream)."""
        from .quant.backend import backend_for

        if backend_for(self.source.pages.k[0]) == "triton":
            self.source.kernel_pages()

    def __call__(self, j0: int, j1: int, buffers: list[torch.Tensor], layers: tuple[int, int] | None = None) -> None:
        """Decode rows ``[j0, j1)`` (``buffers``: their staging views; with ``layers = (l0,
        l1)``, views of those layers only, written into those layers' pages)."""
        j = j0
        while j < j1:
            k = j + 1
            while k < j1 and self.rows[k] == self.rows[k - 1] + 1:
                k += 1
            self.codec.decode_into_pages([b[j - j0 : k - j0] for b in buffers], self.source, self.rows[j], k - j,
                                         layers=layers)
            j = k


def decoder(fmt: BlockFormat, call: PagedCall) -> tuple[BatchDecoder, PageSink]:
    sink = PageSink(single_codec(fmt.codec), call.rows_source())
    return BatchDecoder(fmt, max(1, len(call.rows)), call.pages.device, sink=sink), sink


def requests_of(kv_or_requests: Any, single_keys: Any = None, max_tokens: int | None = None):
    """``(keys, page_ids, max_tokens)`` per request, from a ``PagedKV`` (one request) or a
    list of ``PagedRequest``."""
    if isinstance(kv_or_requests, PagedKV):
        return [(single_keys, kv_or_requests.page_ids, max_tokens)]
    return [(r.keys, r.page_ids, r.max_tokens) for r in as_requests(kv_or_requests)]


__all__ = ["PageSink", "PagedCall", "count_found", "decoder", "encode_frames", "encoded_batches", "hash_requests",
           "ingest_results", "ingest_starts", "look_up_from_starts", "new_results", "plan", "load_starts",
           "plan_ingest", "plan_load", "raise_bad_input", "requests_of", "starts_of", "touch_found"]
