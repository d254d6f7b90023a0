"""``PrefixCache``: the embedded cache a worker holds. Tiers live in this process."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from concurrent.futures import Future
from contextlib import closing
from typing import Any

from . import ingest_in_place, layerwise, paged_io
from .config import TierConfig
from .decode import BatchDecoder
from .encode import iter_encoded
from .errors import FrameError, InputError
from .hashing import DEFAULT_ALGO, SINGLE, Shard, digest_size
from .kv_input import check_layers, kv_layers
from .layerwise import LayerwiseLoad
from .layerwise_save import LayerwiseSave, PagedLayerwiseSave
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .quant.policy import PrecisionPolicy, single_codec
from .pages import KVPages, PagedKV
from .prefix_cache_base import PrefixCacheBase
from .results import IngestResult, Loaded, Located, Materialized, count_outcome, stored_prefix
from .store.device_staging import staging_stats
from .store.gpu import GpuTier
from .store.prefetch import Prefetch
from .store.tier import BlockFrame

__all__ = ["IngestResult", "Loaded", "Located", "Materialized", "Prefetch", "PrefixCache"]



class PrefixCache(PrefixCacheBase):
    """Stores and returns KV for prefix blocks, keyed by a chained hash of their content."""

    def __init__(
        self,
        *,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec | PrecisionPolicy | None = None,
        block_tokens: int = 256,
        tiers: TierConfig | None = None,
        namespace: str = "",
        hash_algo: str = DEFAULT_ALGO,
        max_batch_bytes: int | str = "1GiB",
        shard: Shard = SINGLE,
    ) -> None:
        super().__init__(model_id=model_id, layout=layout, codec=codec, block_tokens=block_tokens,
                         namespace=namespace, hash_algo=hash_algo, max_batch_bytes=max_batch_bytes, shard=shard)
        self.store = (tiers or TierConfig()).build(max_frame_bytes=self.block_format.max_frame_nbytes())

    # -- the three calls -----------------------------------------------------------------

    def ingest(self, keys: Any, kv: Any, *, wait: bool = True) -> IngestResult | Future:
        """Store the full blocks of ``kv`` that are not stored yet. Nothing is stored if the
        input is bad (wrong layout, lengths that disagree, NaN/Inf). ``kv`` may also be one
        request's KV in an engine's pages (``pages.at(page_ids)``), read there in place.
        ``wait=False`` is taken for code written against ``RemoteCache`` too: the call does
        the same work and returns a ``Future`` already done (nothing is left to send).

        With a persistent tier written through (a ``disk_path``, the default write-through),
        a block counted stored or present is on disk (fsynced) when this returns; without
        one, in memory (the last device-to-host copy may still be in flight: every read
        waits for it). ``IngestResult.durability`` says which."""
        if not wait:
            return _done(self.ingest(keys, kv))
        self._check_open()
        if isinstance(kv, PagedKV):
            return self._ingest_paged([(keys, kv.page_ids, None)], kv.pages, single=True)[0]
        layers = kv_layers(kv)
        tokens = check_layers(layers, self.layout)
        self.keys.check_ingest(keys, tokens)
        in_place = None
        if ingest_in_place.applies(self.store, layers[0][0].device):
            # KV on a GPU, host memory on top: blocks go straight into reserved CPU-tier
            # slots, and the chain's tail is on its way before the prompt is even hashed.
            in_place = ingest_in_place.InPlaceIngest(self.store, self.block_format, layers)
            in_place.guess_tail(tokens // self.block_tokens, digest_size(self.hash_algo))
        try:
            hashes = self.block_hashes(keys)
            present = found = self.store.present_many(hashes)
        except BaseException:
            if in_place is not None:
                in_place.abandon()
            raise
        result = IngestResult(blocks=len(hashes), stored=0, present=sum(present), tokens=len(hashes) * self.block_tokens,
                              durability=self.store.durability)
        if not hashes:
            if in_place is not None:
                in_place.abandon()  # (nothing was launched: fewer tokens than a block)
            return result
        parents = self.keys.parents(hashes)
        # A use of the blocks stored already, before this call's puts make room: else the
        # chain's own prefix, if least recently used, is what they evict (the new tail then
        # stored below a gap). Recency only: a hit's read counted the use. And its stored
        # prefix spared: a chain longer than the tier evicts as it goes, and that prefix is
        # older than its puts.
        spare = frozenset(hashes[: stored_prefix(found)])
        self.store.touch_chain([key for key, was in zip(hashes, found) if was], count_use=False)
        stored: list[bytes] = []
        if in_place is not None:
            outcomes = in_place.run(hashes, parents, present, self._batch_blocks, spare=spare)
            for key, outcome in zip(hashes, outcomes):
                if outcome is not None:
                    count_outcome(result, key, outcome, stored)
            present = [p or o is not None for p, o in zip(present, outcomes)]
        # The rest (any other tiers or devices, or blocks the top tier had no room to
        # reserve for) go through put_many. Batches go tail first, so when a chain overflows
        # a tier its head stays and its tail is evicted; on a GPU each batch's encoding
        # overlaps the previous one's copies. A bad batch (NaN, Inf) undoes the batches this
        # call stored before it, but not what their puts evicted. So the KV of every batch is
        # checked before the first (one pass over it), unless the top tier is a GPU tier: its
        # victims go down to memory, not out, and its puts run at device speed.
        left = present.count(False)  # blocks of the batches not put yet
        try:
            for batch in iter_encoded(self.block_format, layers, hashes, parents, present, self._batch_blocks,
                                      tail_first=True, pooled=True,
                                      check_first=not isinstance(self.store.tiers[0], GpuTier)):
                items = [(frame.meta.block_hash, frame) for frame in reversed(batch)]
                left -= len(batch)
                for (block_key, _), outcome in zip(items, self.store.put_many(
                        items, room_for=self._room_for(left, batch), spare=spare)):
                    count_outcome(result, block_key, outcome, stored)
        except InputError:
            self.store.delete_quietly(stored, "the undo of a write with bad input")
            raise
        return result

    def _room_for(self, blocks: int, batch: Sequence[BlockFrame]) -> int:
        """Bytes of ``blocks`` more frames of this call, put after ``batch``: made room for
        with it (``put_many``'s ``room_for``), in the top tier and the tiers written through,
        so that the later batches do not evict it. Each as large as the format's largest
        payload, under the longest header of ``batch`` (batches go tail first: theirs are no
        longer), as ``ingest_in_place`` counts its blocks not launched."""
        if not blocks or not batch:
            return 0
        header = max(f.meta.nbytes - f.meta.payload_nbytes for f in batch)
        return blocks * (max(p.planned_payload().payload_nbytes for p in self.block_format.parts()) + header)

    def ingest_layerwise(self, keys: Any) -> LayerwiseSave:
        """A writer that takes the KV of ``keys`` one layer at a time (``put_layer(i, k, v)``,
        as a forward produces them) and publishes the full blocks on ``finish()``, once every
        layer is there; ``abort()`` stores nothing. With a CPU tier on top, each layer is
        encoded into reserved slots as it is put, so the copies overlap the forward
        (``layerwise_save``); ``finish`` then checks and commits."""
        self._check_open()
        self._num_keys(keys)
        return LayerwiseSave(self, keys)

    def ingest_batch(self, requests: list[Any], pages: KVPages, *, layerwise: bool = False,
                     wait: bool = True, look_up_first: bool = False, look_up_wait: float | None = None) -> Any:
        """``ingest`` of many requests whose KV lives in ``pages`` (``cs.PagedRequest(keys,
        page_ids)`` each), their new blocks encoded together: launches are cut by the data
        path's batching, never per request. Bad input in any request raises ``InputError``
        naming it, and nothing of the call is stored. ``wait=False``: as ``ingest``'s (not
        with ``layerwise``, as for ``RemoteCache``). ``look_up_first`` and
        ``look_up_wait``: taken for code written for both caches, and change nothing: here
        the blocks stored are always found (in memory) before any is encoded. A request's ``start``: the blocks
        before it, an earlier call's, are hashed only (``PagedRequest``).

        ``layerwise=True``: a writer (``layerwise_save.PagedLayerwiseSave``) instead, made
        before the forward writes the pages: ``put_layer(i)`` once layer ``i``'s pages are
        written (encoded and stored into reserved CPU-tier slots while the forward goes
        on), then ``finish()`` -> the list of ``IngestResult``."""
        self._check_open()
        if layerwise and not wait:
            raise InputError("wait=False: not with layerwise=True (a layer-wise writer's finish() is the call "
                             "that stores; call ingest_batch(requests, pages, wait=False) after the forward instead)")
        if layerwise:
            self._check_paged()
            return PagedLayerwiseSave(self, requests, pages)
        results = self._ingest_paged(paged_io.requests_of(requests), pages, single=False,
                                     starts=paged_io.starts_of(requests))
        return results if wait else _done(results)

    def flush(self, timeout: float | None = None) -> bool:
        """True: an embedded ingest has stored what it stores when it returns, ``wait=False``
        or not (``RemoteCache.flush`` waits for its queued writes; code written for both
        may call it)."""
        return True

    def _ingest_paged(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *, single: bool,
                      planned: paged_io.PagedCall | None = None, starts: list[Any] | None = None
                      ) -> list[IngestResult]:
        """``planned``: the call checked and hashed already (a layer-wise writer's, made
        before the forward), whose requests are then not read again. ``starts``: each
        request's ``PagedRequest.start`` (``paged_io.ingest_starts``)."""
        self._check_paged()
        call = planned if planned is not None else paged_io.plan_ingest(self.keys, self.layout, pages, requests,
                                                                        single=single, starts=starts)
        every = call.every_row()
        in_place = None
        if planned is None and single and every and ingest_in_place.applies(self.store, pages.device):
            # One request: the chain's tail is on its way before the prompt is hashed (as
            # ``ingest``), so the rows are all its blocks.
            call.use_rows(every)
            in_place = ingest_in_place.InPlaceIngest(self.store, self.block_format, None, source=call.source)
            in_place.guess_tail(len(every), digest_size(self.hash_algo))
        try:
            if planned is None:
                paged_io.hash_requests(call, self.keys, requests)
            hashes, parents, positions = call.flat()
            found = paged_io.look_up_from_starts(call, hashes, self.store.present_many)
        except BaseException:
            if in_place is not None:
                in_place.abandon()
            raise
        results, present, copies = paged_io.ingest_results(call, found, self.store.durability)
        spare = paged_io.touch_found(self.store, call, found)
        if in_place is None:
            # The rows are the blocks to store, whoever's they are: runs of them (one launch
            # per side each) are not cut where one request ends and the next begins.
            keep = [i for i, p in enumerate(present) if not p]
            call.use_rows([every[i] for i in keep])
            hashes = [hashes[i] for i in keep]
            parents = [parents[i] for i in keep]
            positions = [positions[i] for i in keep]
            present = [False] * len(keep)
        if not hashes:
            if in_place is not None:
                in_place.abandon()
            return results
        stored: list[bytes] = []
        handled = list(present)
        try:
            if ingest_in_place.applies(self.store, pages.device):
                if in_place is None:
                    in_place = ingest_in_place.InPlaceIngest(self.store, self.block_format, None, source=call.source)
                outcomes = in_place.run(hashes, parents, present, self._batch_blocks, positions, spare=spare)
                for i, outcome in enumerate(outcomes):
                    if outcome is not None:
                        count_outcome(results[call.request_of(i)], hashes[i], outcome, stored,
                                      copies.get(hashes[i], ()))
                        handled[i] = True
            # The rest (a GPU tier on top, no room to reserve): frames through put_many,
            # batches tail first and checked first as in ``ingest``.
            left = handled.count(False)
            for start, batch in paged_io.encoded_batches(self.block_format, call, hashes, parents, positions,
                                                         [not h for h in handled], self._batch_blocks,
                                                         tail_first=True, pooled=True,
                                                         check_first=not isinstance(self.store.tiers[0], GpuTier)):
                order = list(range(start + len(batch) - 1, start - 1, -1))
                items: list[tuple[bytes, BlockFrame]] = [(hashes[i], batch[i - start]) for i in order]
                left -= len(batch)
                for i, outcome in zip(order, self.store.put_many(items, room_for=self._room_for(left, batch),
                                                                 spare=spare)):
                    count_outcome(results[call.request_of(i)], hashes[i], outcome, stored, copies.get(hashes[i], ()))
        except InputError as exc:
            self.store.delete_quietly(stored, "the undo of a write with bad input")
            paged_io.raise_bad_input(call, exc)
        return results

    def materialize_into(self, keys: Any, dest: PagedKV, *, max_tokens: int | None = None, start: int = 0,
                         layerwise: bool = False, located: bool = False) -> Any:
        """Write the longest stored prefix of ``keys`` (at most ``max_tokens``, and at most
        what ``dest``'s page table holds) straight into the pages ``dest = pages.at(page_ids)``
        names, decoded there; pages of later tokens are untouched. The writes are queued on
        the pages' device's current stream. ``start`` (a multiple of the block size): the
        tokens before it are in the pages already (the engine's own prefix hit), counted in
        the ``Loaded`` as far as they are stored, neither fetched nor written, as
        ``PagedRequest.start``. Returns ``Loaded``; with ``layerwise``, a
        ``LayerwiseLoad`` whose layers are written into the pages in order (``wait(layer)``
        before the engine reads a layer's pages; ``requests[0]`` is the ``Loaded``).
        ``located``: as ``materialize``'s."""
        self._check_open()
        if not isinstance(dest, PagedKV):
            raise InputError(f"dest: expected an engine's pages, pages.at(page_ids), got {type(dest).__name__}")
        requests = [(keys, dest.page_ids, max_tokens)]
        if layerwise:
            return self._load_paged_layerwise(requests, dest.pages, single=True, starts=[start])
        return self._load_paged(requests, dest.pages, single=True, starts=[start])[0]

    def materialize_into_batch(self, requests: list[Any], pages: KVPages, *, layerwise: bool = False,
                               located: bool = False) -> Any:
        """``materialize_into`` for many requests (``cs.PagedRequest(keys, page_ids,
        max_tokens, start)`` each), decoded together into their pages; no page may be written
        by two requests. Returns ``[Loaded, ...]``; with ``layerwise``, one ``LayerwiseLoad``
        for all of them (``requests``: the ``Loaded`` of each). Either way a request's blocks
        before its ``start`` (in its pages already) are counted in its ``Loaded``, neither
        fetched nor written."""
        self._check_open()
        if layerwise:
            return self._load_paged_layerwise(paged_io.requests_of(requests), pages, single=False,
                                              starts=paged_io.starts_of(requests))
        return self._load_paged(paged_io.requests_of(requests), pages, single=False, starts=paged_io.starts_of(requests))

    def _plan_load(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *, single: bool, starts: list[Any]):
        self._check_paged()
        call = paged_io.plan(self.keys, self.layout, pages, requests, single=single)
        paged_io.hash_requests(call, self.keys, requests)
        B = self.block_tokens
        starts = paged_io.load_starts(call, starts, B)
        limits = paged_io.load_limits(call, requests, B)
        located = self.store.locate_many([h[:n] for h, n in zip(call.hashes, limits)])
        counts = [len(where) for where in located]
        paged_io.plan_load(call, counts, B, starts)
        return call, located, counts, starts

    def _load_paged_layerwise(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *,
                              single: bool, starts: list[Any]) -> LayerwiseLoad:
        call, located, counts, starts = self._plan_load(requests, pages, single=single, starts=starts)
        B, L = self.block_tokens, self.layout.num_layers
        # Blocks before a request's start are in its pages already (the engine's own prefix
        # hit): counted, not fetched or written, as in ``_load_paged``. The call's rows are
        # blocks [start, count) of each request, in order, so a request's first fetched block
        # is the row after the previous requests' written ones.
        skip = [min(s, n) for s, n in zip(starts, counts)]
        sink = paged_io.PageSink(single_codec(self.block_format.codec), call.source) if call.rows else None
        firsts, row = [], 0
        for s, n in zip(skip, counts):
            firsts.append(row)
            row += n - s
        chains = [(h[s:n], where[s:n]) for h, where, s, n in zip(call.hashes, located, skip, counts)]
        decoder, got = layerwise.load(self.block_format, self.store, chains, pages.device, sink=sink, rows=firsts,
                                      starts=skip)
        results = []
        for s, where, tiers in zip(skip, located, got):
            res = Loaded(num_blocks=s + len(tiers), tiers=list(where[:s]) + tiers)
            res.num_tokens = res.num_blocks * B
            results.append(res)
        for h, res in zip(call.hashes, results):
            if res.num_blocks:
                self.store.touch_chain(h[: res.num_blocks])
        if decoder is not None and not any(got):
            decoder.release_all()
            decoder = None
        n = sum(r.num_blocks for r in results)
        return LayerwiseLoad(num_layers=L, device=pages.device, num_tokens=n * B, num_blocks=n,
                             tiers=[t for r in results for t in r.tiers], decoder=decoder, requests=results)

    def _load_paged(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *, single: bool,
                    starts: list[Any]) -> list[Loaded]:
        call, located, counts, starts = self._plan_load(requests, pages, single=single, starts=starts)
        B = self.block_tokens
        # Blocks before a request's start are in its pages already: counted, not written.
        results = [Loaded(num_blocks=min(s, n), tiers=list(where[: min(s, n)]))
                   for s, n, where in zip(starts, counts, located)]
        for res in results:
            res.num_tokens = res.num_blocks * B
        if not call.rows:
            return results
        decoder, sink = paged_io.decoder(self.block_format, call)
        feed = _Feed(decoder)
        first_row = 0
        try:
            # As ``materialize``: frames flow from the tiers into the decoder as they land, and
            # each landed chunk is decoded straight into its pages.
            for r, (n, s) in enumerate(zip(counts, starts)):
                if n <= s:
                    continue
                with closing(self._fetch(call.hashes[r][s:n], located[r][s:n], first=s)) as frames:
                    for frame, tier in frames:
                        sink.rows.append(first_row + results[r].num_blocks - s)
                        feed.add(frame)
                        results[r].num_blocks += 1
                        results[r].tiers.append(tier)
                first_row += n - s
            if len(decoder):
                decoder.finish(wait=False)
            for h, res in zip(call.hashes, results):
                res.num_tokens = res.num_blocks * B
                if res.num_blocks:
                    self.store.touch_chain(h[: res.num_blocks])
        finally:
            feed.close()
        return results

    def locate(self, keys: Any) -> Located:
        self._check_open()
        self._num_keys(keys)
        tiers = self.store.locate(self.block_hashes(keys))
        return Located(num_blocks=len(tiers), num_tokens=len(tiers) * self.block_tokens, tiers=tiers)

    def locate_batch(self, keys: Any) -> list[Located]:
        """``locate`` of each of ``keys`` (a list: token ids, a ``Prompt`` or bytes per block,
        one per request), as many calls of it would answer: what an engine admitting a batch
        asks of every request at once. Bad keys raise ``InputError`` naming their index
        (``keys[2]: ...``) before any is looked up."""
        self._check_open()
        chains, _ = self._hash_batch(keys)
        B = self.block_tokens
        # One question to each tier for every chain (a networked tier's round trip, once).
        return [Located(num_blocks=len(tiers), num_tokens=len(tiers) * B, tiers=tiers)
                for tiers in self.store.locate_many(chains)]

    def materialize(self, keys: Any, device: Any = None, *, max_tokens: int | None = None,
                    layerwise: bool = False, located: bool = False) -> Any:
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``:
        a ``Materialized``; with ``layerwise``, a ``LayerwiseLoad`` whose layers become ready
        in order (``wait(layer)``, then ``layer(i)``), decoding while the caller computes.
        ``located``: ``RemoteCache``'s (a load its server does not count again as a lookup,
        after ``locate``); taken here for code written against both, and nothing to this
        cache, which counts no lookups.

        Frames flow from the tiers into the decoder as each lands (``TieredStore.stream``):
        disk reads are many in flight, and each frame's copy to ``device`` starts as soon as
        it has been read and verified, while the next ones are still being read. A block a
        prefetch is promoting is waited for, not read twice. Frames lent in pooled buffers
        are released once their copies have landed."""
        self._check_open()
        self._num_keys(keys)
        device = self._device(device)
        hashes = self.block_hashes(keys)
        where = self.store.locate(self._limit(hashes, max_tokens))
        if layerwise:
            return self._materialize_layerwise(hashes, where, device)
        if not where:
            return self._nothing(device)
        decoder = BatchDecoder(self.block_format, len(where), device)
        tiers: list[str] = []
        feed = _Feed(decoder)
        try:
            with closing(self._fetch(hashes[: len(where)], where)) as frames:
                for frame, tier in frames:
                    feed.add(frame)
                    tiers.append(tier)
            if not tiers:
                return self._nothing(device)
            k, v = decoder.finish(wait=False)
            assert k is not None and v is not None  # (no sink: decoded into K and V)
            self.store.touch_chain(hashes[: len(tiers)])
            return self._materialized(k, v, tiers, device)  # while the last copies land
        finally:
            feed.close()

    def _fetch(self, hashes: Sequence[bytes], where: Sequence[str], first: int = 0) -> Generator[tuple[Any, str], None, None]:
        """(frame, tier) of each block of a located chain in order (``hashes``: its blocks from
        position ``first`` on), leased and checked; ends
        at the first block evicted or found corrupt since ``locate`` (the prefix ends there).
        Closing it cancels or gives back the reads not handed out."""
        frames = self.store.stream(hashes, where=where, leased=True)
        foreign = None
        try:
            for position, (key, got) in enumerate(zip(hashes, frames), first):
                if got is None:
                    return
                frame, tier = got
                try:
                    self.block_format.check_fetched(frame.meta, key, position)
                except FrameError as exc:
                    frame.release()
                    foreign = (key, tier, str(exc))
                    return
                yield frame, tier
        finally:
            frames.close()
            if foreign is not None:  # (once the reads are given back)
                self.store.drop_foreign(*foreign)

    def _materialize_layerwise(self, hashes: Sequence[bytes], located: list[str], device: Any) -> LayerwiseLoad:
        self._check_layerwise()
        L = self.layout.num_layers
        decoder, got = layerwise.load(self.block_format, self.store, [(hashes, located)], device)
        tiers = got[0]
        if decoder is not None and not tiers:
            decoder.release_all()
            decoder = None
        if tiers:
            self.store.touch_chain(hashes[: len(tiers)])
        return LayerwiseLoad(num_layers=L, device=device, num_tokens=len(tiers) * self.block_tokens,
                             num_blocks=len(tiers), tiers=tiers, decoder=decoder)

    def prefetch(self, keys: Any) -> Prefetch | None:
        """Start promoting the stored prefix of ``keys`` from disk or Redis into memory (the
        CPU tier, and the GPU tier where there is one) in the background, and return at
        once: a ``Prefetch`` handle (``wait(timeout)``, ``done()``, ``blocks`` being
        promoted), or None when there is nothing to promote (nothing stored, or the chain is
        in memory already: that costs one lookup) or ``max_prefetches`` are in flight. A
        ``materialize`` that comes meanwhile waits only for the blocks still on their way."""
        self._check_open()
        self._num_keys(keys)
        return self.store.prefetch(self.block_hashes(keys))

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The configuration, the store's figures, and ``device_staging``: each device's
        staging pool (its buffers and its ledger of leases, process-wide)."""
        return {**self._config_stats(), **self.store.stats(), "device_staging": staging_stats()}

    def close(self) -> None:
        """Close the store's tiers (idempotent). Every call but ``stats`` then raises
        ``RuntimeError``."""
        self._closed = True
        self.store.close()


def _done(result: Any) -> Future:
    """A ``Future`` that holds ``result`` already (an embedded ``wait=False`` call)."""
    future: Future = Future()
    future.set_result(result)
    return future


class _Feed:
    """Frames handed to a decoder in order, each given back as soon as its copy to the device
    has landed, so a long chain reuses a few pooled buffers instead of holding one per block."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.added: list = []
        self.released = 0  # the first ``released`` of ``added`` are given back

    def add(self, frame: Any) -> None:
        self.added.append(frame)  # released in ``close`` even if the add fails
        self.decoder.add(frame)  # its copy to the device starts now
        copied = self.decoder.copied()
        for done in self.added[self.released:copied]:
            done.release()
        self.released = max(self.released, copied)

    def close(self) -> None:
        try:
            self.decoder.close()  # no copy reads the frames' memory any more; the staging given back
        finally:
            for frame in self.added[self.released:]:
                frame.release()
