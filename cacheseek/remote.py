"""``RemoteCache``: the methods and results of ``PrefixCache``, over HTTP to ``cacheseek serve``.

Keys are computed here, by the same code as ``PrefixCache`` (``PrefixKeys``). Ingest asks
the server which blocks are new (one ``/v1/lookup`` round trip), encodes only those, on the
KV's own device, moves each compact frame to the host just before it is sent, and streams
them in one ``POST /v1/blocks`` (several, tail first, where they pass ``max_body_bytes``).
Materialize asks for the longest stored prefix, streams its frames from ``GET
/v1/prefixes/{last hash}``, checks each (checksum, hash, codec, layout), and decodes them on
the target device. One ``httpx.Client`` (keep-alive, a connection pool)
serves every call, over ``BulkTransport`` (keep-alive, a connection pool, bodies moved with
one copy, https with the client's ``verify``, proxies honoured); the object is safe to share
between threads.

An outage (the server down, unreachable, timing out, answering 503, or a front answering
a page of its own, not the server's JSON) raises
``RemoteUnavailable`` by default (``on_unavailable="raise"``). With ``on_unavailable="miss"``
it is a miss instead: ``lookup`` 0, ``materialize`` nothing, ``prefetch`` None, and
``ingest`` reports its blocks failed (``errors["server"]``), so a worker's hot path needs no
``try``. Either way a circuit breaker (``store.breaker``) stops calls after a few failures in a row and lets one
probe through after a backoff, so an outage does not cost every call a timeout; the outage
is logged once when it starts and once when it ends, and counted in ``client_stats()``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import httpx

from . import paged_io
from .batch_body import BATCH_CONTENT_TYPE, FRAME_CONTENT_TYPE, LENGTH, BatchFormatError, BatchTooLarge, iter_frames
from .decode import decode_frames
from .encode import encode_missing
from .errors import ConfigError, FrameError, InputError, PoolExhausted, RemoteBusy, RemoteError, RemoteUnavailable
from .hashing import DEFAULT_ALGO, NAMESPACE_PATTERN, SINGLE, BlockHash, Shard, digest_size, to_hex
from .idle_pool import IdlePool
from .kv_input import check_layers, kv_layers
from .layerwise import LayerwiseLoad, PagedLayerwiseIngest
from .layout import KVLayout
from .log_throttle import LogThrottle
from .pages import KVPages, PagedKV
from .prefix_cache_base import PrefixCacheBase
from .quant.codec import KVLayerCodec
from .quant.policy import PrecisionPolicy
from .results import IngestResult, Loaded, Located
from .store.breaker import CircuitBreaker, ExponentialBackoff
from .store.device import frames_to_host
from .store.device_staging import staging_stats
from .store.direct_io import BufferPool
from .store.frame import parse_frame
from .store.prefetch import Prefetch
from .store.tier import BlockFrame
from .tls import untrusted_certificate
from .transport import IDEMPOTENT_EXTENSION, BulkTransport
from .units import parse_size
from .store.lease import Handover
from .write_behind import WriteBehind

NAMESPACE_HEADER = "X-CacheSeek-Namespace"
# For the server's figures only (hit rate per model, in tokens): it sees hashes, not models.
MODEL_HEADER = "X-CacheSeek-Model"
BLOCK_TOKENS_HEADER = "X-CacheSeek-Block-Tokens"
TOKENS_HEADER = "X-CacheSeek-Tokens"
CONTINUES_HEADER = "X-CacheSeek-Continues"  # a lookup piece's first position, after the chain's first piece
# A lookup sent again for a query the server counted already (after a prefix GET's 404): not counted again.
AGAIN_HEADER = "X-CacheSeek-Again"
BAD_FRAME_LOG_SECONDS = 60.0  # a fetched frame that fails its check: said at most this often
CUT_ANSWER_LOG_SECONDS = 60.0  # a prefix's answer whose connection ended mid-body: said at most this often
# A batch's fetch threads exit after this long without a fetch: far above the gap between
# the batches of an engine's step loop (milliseconds), so those never start threads again.
FETCH_IDLE_SECONDS = 5.0
START_HEADER = "X-CacheSeek-Start"  # the position a prefix's answer streams from (?start=), where honoured
BUSY_HEADER = "X-CacheSeek-Busy"  # on a 503 from a server that is up (back-pressure): not an outage
OUTAGE_STATUSES = (502, 503, 504)  # 502 and 504: a proxy's, its upstream (the server) unreachable
# Error statuses that, in a front's page rather than the server's JSON, say the service is not
# there for now: the ingress's default backend (404) while the service has no endpoints, a
# proxy that timed out (408) or failed (5xx). The others say the client is set up wrong (a
# redirect: http to https; a 400; a proxy's 407 for credentials) or are the refusals every
# sender means (401, 403, 413: split and sent again, 429: busy): errors, whoever sent them,
# that a miss would hide.
FRONT_OUTAGE_STATUSES = (404, 408)
ON_UNAVAILABLE = ("raise", "miss")
FETCH_TRIES = 3  # GETs of a prefix whose blocks keep vanishing between the lookup and the GET
# Chains in one lookup of several: their lengths (the query) and tokens (a header) ride in the
# request's head, which the server takes up to 64 KiB of; 1,024 chains take about 14 KiB.
LOOKUP_CHAINS = 1024
HEADER_SLACK = 64 << 10  # over a frame's planned size: its header's hashes and fields, with room to spare
ERROR_BODY_BYTES = 64 << 10  # an error answer's body read whole, for its connection to stay open, up to this
# The longest JSON answer read: a lookup of 65,536 hashes with every block's presence is ~1 MB.
ANSWER_BYTES = 64 << 20
REASON_CHARS = 500  # of an error answer that is not the server's JSON, kept as the error's reason
# How a server before the error fields (docs/http-api.md) named its body limit in a 413: in the sentence.
# The most frames in one POST /v1/blocks: a server with a disk tier spends its time per block
# (a file and a sidecar each, fsynced in group commits), ~2 ms a small block on a loaded
# 2-core host (4,096 in 7.5 s, 16,384 in 32 s), so 150,000 small blocks in one body were
# answered after ~190 s, past the 60 s read timeout: reported as an outage (breaker open)
# while the server stored them all. 2,048 is ~4 s there; the bytes cap binds first for
# frames over 512 KiB.
MAX_BODY_FRAMES = 2048
# Frames up to this size are read into (and sent from) pieces of shared slabs, not a mapping
# each: a chain of 70,000 small blocks passed vm.max_map_count (``BufferPool``).
PIECES_UP_TO = 256 << 10
_BODY_LIMIT = re.compile(r"max_body_bytes \((\d+)\)")

log = logging.getLogger("cacheseek.remote")
T = TypeVar("T")


class _Outages:
    """Whether the server is in an outage, as this client sees it, and what it cost: logged
    once when an outage starts and once when it ends, never per call."""

    def __init__(self, url: str, mode: str) -> None:
        self.url, self.mode = url, mode
        self._lock = threading.Lock()
        self._since: float | None = None
        self.counts = {"outages": 0, "unavailable_calls": 0, "refused_by_breaker": 0, "missed_lookups": 0,
                       "missed_materializes": 0, "missed_prefetches": 0, "dropped_blocks": 0, "busy_refusals": 0,
                       "pool_timeouts": 0, "bad_frames": 0, "cut_answers": 0}
        self.last_error = ""
        self._bad_said = LogThrottle(BAD_FRAME_LOG_SECONDS)
        self._cut_said = LogThrottle(CUT_ANSWER_LOG_SECONDS)

    def failed(self, exc: BaseException, *, refused: bool = False) -> None:
        with self._lock:
            self.counts["refused_by_breaker" if refused else "unavailable_calls"] += 1
            if not refused:
                self.last_error = str(exc)
            if self._since is not None:
                return
            self._since = time.monotonic()
            self.counts["outages"] += 1
        then = "calls are misses and writes are dropped" if self.mode == "miss" else "calls raise RemoteUnavailable"
        log.warning("CacheSeek server %s is unavailable (%s); %s until it answers again", self.url, exc, then)

    def answered(self) -> None:
        if self._since is None:  # the usual case, without the lock
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("CacheSeek server %s answers again, after an outage of %.1f s", self.url, time.monotonic() - since)

    def bad_frame(self, key: bytes, exc: BaseException) -> None:
        """A frame the server sent that failed its check (another configuration's under this
        cache's key, or damaged): counted, and said once a minute at most."""
        with self._lock:
            self.counts["bad_frames"] += 1
        if self._bad_said.due():
            log.warning("cacheseek server %s sent a frame for block %s that fails its check (%s): the prefix ends "
                        "before it (client_stats()['bad_frames'] counts them; this line once a minute at most)",
                        self.url, key.hex(), exc)

    def cut_answer(self, path: str, frames: int, exc: BaseException) -> None:
        """A prefix's answer whose connection ended mid-body (a server killed, a front's body
        or buffer limit, a reset): its ``frames`` whole frames stand. Counted, and said once a
        minute at most (with the cuts held back since), so a front that cuts every large
        answer shows why the hit rate fell."""
        with self._lock:
            self.counts["cut_answers"] += 1
        if said := self._cut_said.due():
            log.warning("CacheSeek server %s: the answer to GET %s ended after %d whole frames (%s): a shorter "
                        "prefix is loaded (%d such answers since this was last said; client_stats()['cut_answers'] "
                        "counts them; this line once a minute at most)", self.url, path, frames, exc, said)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "in_outage": self._since is not None, "last_error": self.last_error}


class _FrameStream(httpx.SyncByteStream):
    """A batch body of frames, each moved to the host just before it is sent, into a buffer
    of ``buffers`` given back once the transport asks for the next frame (every transport
    has sent, or copied, a chunk by then: ``cacheseek.transport``). Replayable, so the
    transport may send it again on a new connection when a kept-alive one turns out closed
    before any answer (the blocks are content-addressed: a resend stores nothing twice)."""

    replayable = True

    def __init__(self, frames: list[BlockFrame], buffers: BufferPool) -> None:
        self._frames = frames
        self._buffers = buffers

    # httpx's stubs say bytes; each chunk goes to the socket as it is, so a memoryview of the
    # frame's memory sends without a copy.
    def __iter__(self) -> Iterator[bytes | memoryview]:  # type: ignore[override]
        for frame in self._frames:
            if frame.host is not None:
                yield LENGTH.pack(frame.meta.nbytes)
                yield from frame.wire_segments()
                continue
            with self._buffers.take(frame.meta.nbytes) as lease:
                host = frames_to_host([frame], take=lambda n: lease.buffer.view(n))[0]
                yield LENGTH.pack(host.meta.nbytes)
                yield from host.wire_segments()
                del host  # (its view of the buffer)


class RemoteCache(PrefixCacheBase):
    """A ``PrefixCache`` whose tiers live in a CacheSeek server at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec | PrecisionPolicy | None = None,
        block_tokens: int = 256,
        namespace: str = "",
        hash_algo: str = DEFAULT_ALGO,
        token: str | None = None,
        timeout: float = 60.0,
        exchange_timeout: float | None = 600.0,
        exit_timeout: float = 5.0,
        max_connections: int = 16,
        max_batch_bytes: int | str = "1GiB",
        max_body_bytes: int | str = "1GiB",
        on_unavailable: str = "raise",
        verify: bool | str | os.PathLike | ssl.SSLContext = True,
        proxy: str | None = None,
        trust_env: bool = True,
        breaker: CircuitBreaker | None = None,
        shard: Shard = SINGLE,
        max_lookup_hashes: int = 1 << 16,
        max_pending_bytes: int | str = "2GiB",
        read_buffer_bytes: int | str = "1GiB",
        max_concurrent_fetches: int = 8,
    ) -> None:
        """``timeout``: seconds for each connect, read and write. ``exchange_timeout``: seconds
        for one whole request and its answer (None: no bound), which cuts off a server or
        proxy that sends a byte now and then, each within ``timeout``; a timeout is an outage.
        ``exit_timeout``: at interpreter exit, a cache never closed gives its ``wait=False``
        writes this long in all, then cuts them (best-effort: a process exiting does not wait
        out a slow server; ``cacheseek.write_behind``).
        ``on_unavailable``: ``"raise"`` (``RemoteUnavailable``) or ``"miss"`` (an outage is
        a miss and a dropped write; see the module doc). ``verify``: TLS for an ``https``
        URL: True (the system's CAs), a CA bundle path, an ``ssl.SSLContext``, or False (no
        verification). ``proxy``: a proxy URL; by default (``trust_env``) the environment's
        ``HTTP(S)_PROXY``/``NO_PROXY`` apply. ``breaker``: default 3 failures in a row open
        it, probes after 0.5 s doubling up to 10 s. ``max_body_bytes``: the largest body of one
        ``POST /v1/blocks``; an ingest whose new frames pass it, or ``MAX_BODY_FRAMES``
        (2,048: a disk tier's time goes by blocks, each body answered well within
        ``timeout``), sends them in several, in order. The default, 1 GiB, is half the server's default ``max_body_bytes``, so that
        one body leaves room in its ``max_inflight_body_bytes`` for others. A lower limit of
        the server's lowers this client's to it: the server publishes it in the lookup every
        write begins with, and a ``413`` (an older server's, or a proxy's: half the refused
        body where it names none) does it too, the refused body then going again, split.
        ``max_lookup_hashes``: the most hashes in one ``POST /v1/lookup`` (the server's
        ``max_lookup_hashes``, 65,536 by default): a longer chain (a million tokens in
        blocks of 16) is looked up in pieces, in order, each only if the one before it
        matched whole (a write's lookup asks every piece); a server's lower limit takes its
        place at the first lookup refused for it. ``max_pending_bytes``: the most
        bytes of frames that ``wait=False`` ingests hold in host memory, queued or being
        sent (``cacheseek.write_behind``); a write that would pass it is dropped. Their
        buffers, and the one frame at a time a waited ingest moves to the host, are kept for
        reuse up to that size (page-locked where CUDA is present).
        ``read_buffer_bytes``: the host memory that materializes keep between calls for the
        frames they read (page-locked where CUDA is present), so that the next read lands in
        memory already mapped (0: fresh memory for every read).
        ``max_concurrent_fetches``: the most chains a ``materialize_into_batch`` fetches at
        once, each over a connection of the pool (at most ``max_connections``; 1: one after
        another), on as many threads, each gone after ``FETCH_IDLE_SECONDS`` (5 s) without a
        fetch."""
        super().__init__(model_id=model_id, layout=layout, codec=codec, block_tokens=block_tokens,
                         namespace=namespace, hash_algo=hash_algo, max_batch_bytes=max_batch_bytes,
                         shard=shard)
        if not NAMESPACE_PATTERN.match(namespace):  # (a header: CR LF would write a line of its own)
            raise ConfigError(f"namespace: {namespace!r:.40} is not 0-128 printable ASCII characters without "
                              "spaces, as the server takes it")
        if on_unavailable not in ON_UNAVAILABLE:
            raise ConfigError(f"on_unavailable: {on_unavailable!r} is not one of {ON_UNAVAILABLE}")
        for name, value in (("max_lookup_hashes", max_lookup_hashes), ("max_connections", max_connections),
                            ("max_concurrent_fetches", max_concurrent_fetches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be an int >= 1, got {value!r}")
        self.max_lookup_hashes = max_lookup_hashes
        pending = parse_size(max_pending_bytes, name="max_pending_bytes")
        if pending <= 0:
            raise ConfigError(f"max_pending_bytes: must be > 0 bytes, got {max_pending_bytes!r}")
        # The frames' host memory, reused from one write to the next, waited or not
        # (page-locked beside a GPU): fresh memory cost a 4K-token int4 save 87 ms of page
        # faults on the H200, the copy itself 15 ms.
        self._host_buffers = BufferPool(pin=True, keep_bytes=pending, pieces_up_to=PIECES_UP_TO)
        read_keep = parse_size(read_buffer_bytes, name="read_buffer_bytes")
        # The frames a materialize reads, reused by the next: into fresh memory, half the
        # client's time on a loopback read went to page faults; page-locked, a frame's copy
        # to the GPU runs at the link's speed and off the host's way.
        self._read_buffers = BufferPool(pin=True, keep_bytes=read_keep, pieces_up_to=PIECES_UP_TO)
        self.max_body_bytes = parse_size(max_body_bytes, name="max_body_bytes")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes: must be > 0 bytes, got {max_body_bytes!r}")
        self._limit_from_server = False  # whether max_body_bytes is a 413's, not the caller's
        self.url = url.rstrip("/")
        parsed = httpx.URL(self.url)
        if parsed.scheme not in ("http", "https"):
            raise ConfigError(f"url: '{parsed.copy_with(userinfo=b'')}' is not an http:// or https:// URL")
        if parsed.userinfo:
            # Not every request would send them (lookups go straight to the transport), and
            # the URL is in every outage's log line and error.
            raise ConfigError(f"url: {parsed.copy_with(userinfo=b'')} holds credentials; give them as token=")
        if "?" in self.url or "#" in self.url:
            # Every route's path is appended to the URL: after a query or a fragment it names none.
            raise ConfigError(f"url: {self.url} has a query or a fragment; give the server's address "
                              "(http://host:port, and a path prefix if a proxy serves it under one)")
        for name, seconds in (("timeout", timeout), ("exchange_timeout", exchange_timeout)):
            if seconds is None and name == "exchange_timeout":
                continue
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 1e9:
                raise ConfigError(f"{name}: must be a finite number of seconds > 0, got {seconds!r}")
        if isinstance(exit_timeout, bool) or not isinstance(exit_timeout, (int, float)) or not 0 <= exit_timeout < 1e9:
            raise ConfigError(f"exit_timeout: must be a finite number of seconds >= 0, got {exit_timeout!r}")
        self.on_unavailable = on_unavailable
        self.breaker = breaker if breaker is not None else CircuitBreaker(
            failure_threshold=3, backoff=ExponentialBackoff(base_seconds=0.5, cap_seconds=10.0))
        self._outages = _Outages(self.url, on_unavailable)
        # Sent empty too: its keys are made with the namespace named here, and a token bound to
        # a tenant's namespace with none named was taken as that namespace's, so two workers of
        # one tenant (one naming it, one not) never shared a block; now the server refuses it.
        headers = {NAMESPACE_HEADER: namespace}
        if model_id.isascii() and model_id.isprintable():
            headers[MODEL_HEADER] = model_id[:128]
        headers[BLOCK_TOKENS_HEADER] = str(block_tokens)
        # Frames are read raw (read_exactly, iter_raw), past httpx's decoding: httpx's default
        # "gzip, deflate" would invite a front (an ingress's compress middleware) to send
        # gzip, read as frames and so a miss.
        headers["Accept-Encoding"] = "identity"
        if token:
            # A token read from a file keeps its newline: the request would go out malformed.
            if not token.isascii() or not token.isprintable():
                raise ConfigError("token: holds a line break, another control character or non-ASCII text, which "
                                  "no header can carry (one read from a file keeps its newline: strip it)")
            headers["Authorization"] = f"Bearer {token}"
        timeouts = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.max_connections = max_connections
        self._transport = BulkTransport(max_connections=max_connections, verify=verify, proxy=proxy,
                                        trust_env=trust_env, exchange_timeout=exchange_timeout)
        try:
            self._transport.check_proxy(self.url)
        except ValueError as exc:
            self._transport.close()
            raise ConfigError(str(exc)) from None
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeouts, transport=self._transport)
        self._behind = WriteBehind(pending, owner=type(self).__name__, exit_timeout=exit_timeout,
                                   cut_off=self._transport.cut_off_at)
        self._headers = headers
        self._timeouts = timeouts.as_dict()
        self.max_concurrent_fetches = min(max_concurrent_fetches, max_connections)
        self._fetcher: IdlePool | None = None  # made by the first batch that fetches several chains
        self._fetcher_lock = threading.Lock()
        # ``look_up_first``'s lookups with a wait, on a thread of their own (not the fetches':
        # a late one held a load's fetch behind it), one at a time: the one in flight.
        self._first_lookups: IdlePool | None = None
        self._first_lookup: Future | None = None
        # Whether the server answers a lookup of several chains (?chains=); an older one reads
        # them as one chain, which is seen in its answer, and is then asked chain by chain.
        self._chain_lookups = True

    # -- the three calls -----------------------------------------------------------------

    def ingest(self, keys: Any, kv: Any, *, wait: bool = True) -> IngestResult | Future:
        """Store the full blocks of ``kv`` that the server does not hold yet. Nothing is sent
        if the input is bad (wrong layout, lengths that disagree, NaN/Inf). Stored and
        present mean what the server's answers say (``IngestResult.durability``: durable,
        on disk, with a write-through server). In an outage with ``on_unavailable="miss"``,
        the blocks not acknowledged count as failed, with ``errors["server"]``. ``kv`` may be
        one request's KV in an engine's pages (``pages.at(page_ids)``), encoded there in place.
        ``wait=False``: return once the KV is read (encoded, its frames in host memory: the
        tensors or pages may then change), with a ``Future`` of the result; the lookup and
        the upload follow on the cache's sender thread (``cacheseek.write_behind``). Bad
        input still raises here."""
        self._check_open()
        if isinstance(kv, PagedKV):
            call = self._plan_paged([(keys, kv.page_ids, None)], kv.pages, single=True)
            if not wait:
                return self._write_behind_paged(call, single=True)
            return self._ingest_planned(call)[0]
        layers = kv_layers(kv)
        self.keys.check_ingest(keys, check_layers(layers, self.layout))
        hashes = self.block_hashes(keys)
        result = IngestResult(blocks=len(hashes), stored=0, present=0, tokens=len(hashes) * self.block_tokens)
        if not wait:
            return self._write_behind(
                [result], hashes, [0] * len(hashes), {},
                lambda: encode_missing(self.block_format, layers, hashes, self.keys.parents(hashes),
                                       [False] * len(hashes), self._batch_blocks), single=True)
        if not hashes:
            return result
        try:
            self._ingest(layers, hashes, result)
        except RemoteUnavailable as exc:
            self._dropped([result], exc)
        return result

    def _ingest(self, layers: list, hashes: list[BlockHash], result: IngestResult) -> None:
        found = self._write_lookup(hashes)
        present = found["present"]
        result.present = sum(present)
        result.durability = found.get("durability", result.durability)
        # Encode everything first: a bad block (NaN, Inf) then sends nothing.
        frames = encode_missing(self.block_format, layers, hashes, self.keys.parents(hashes), present,
                                self._batch_blocks)
        if not frames:
            return
        frames.reverse()  # tail first, as PrefixCache stores them: a chain that overflows keeps its head
        for report in self._post_frames(frames):
            _count_report(result, report)

    def ingest_batch(self, requests: list[Any], pages: KVPages, *, layerwise: bool = False,
                     wait: bool = True, look_up_first: bool = False, look_up_wait: float | None = None) -> Any:
        """``ingest`` of many requests whose KV lives in ``pages`` (``cs.PagedRequest`` each):
        one lookup for all of them, their new blocks encoded together (launches are not per
        request), and one streamed POST (several past ``max_body_bytes``). Bad input in any
        request raises ``InputError`` naming it, and sends nothing.
        ``layerwise=True``: the reference writer (``layerwise.PagedLayerwiseIngest``, this
        same call on ``finish``), for callers written against ``PrefixCache``'s. As there,
        the requests are checked and hashed when the writer is made, so bad ones raise
        before the forward runs rather than after it.
        ``wait=False`` (not with ``layerwise``): as ``ingest``'s, a ``Future`` of the
        results, returned once the pages are read; every block is encoded, the server's
        lookup comes after. With ``look_up_first=True`` the lookup comes first, in the call
        (one round trip), and only the blocks the server does not hold are encoded: for
        blocks the caller expects stored (an engine's own prefix-cache hit, which an earlier
        request saved), whose encoding costs more than the round trip; an outage met by that
        lookup is met as ``wait=True``'s (raised, or the blocks counted failed).
        ``look_up_wait``: the most seconds the call waits for that lookup (None: as long as
        the client's ``timeout``); unanswered by then, every block is encoded, as without
        ``look_up_first`` (``client_stats()["write_behind"]["lookups_first_late"]``), so a
        slow server never holds the caller longer than that. A request's
        ``start``: the blocks before it, an earlier call's, are hashed only (neither looked
        up, encoded nor sent; ``PagedRequest``)."""
        self._check_open()
        if layerwise and not wait:
            raise InputError("wait=False: not with layerwise=True (a layer-wise writer's finish() is the call "
                             "that sends; call ingest_batch(requests, pages, wait=False) after the forward instead)")
        call = self._plan_paged(paged_io.requests_of(requests), pages, single=False,
                                starts=paged_io.starts_of(requests))
        if layerwise:
            return PagedLayerwiseIngest(lambda _requests, _pages: self._ingest_planned(call), requests, pages,
                                        self.layout.num_layers)
        if wait:
            return self._ingest_planned(call)
        return self._write_behind_paged(call, look_up_first=look_up_first, look_up_wait=look_up_wait)

    def _plan_paged(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *, single: bool,
                    starts: list[Any] | None = None) -> paged_io.PagedCall:
        """Every request checked and hashed (``InputError`` naming the request); nothing sent."""
        self._check_paged()
        call = paged_io.plan_ingest(self.keys, self.layout, pages, requests, single=single, starts=starts)
        paged_io.hash_requests(call, self.keys, requests)
        return call

    def _ingest_planned(self, call: paged_io.PagedCall) -> list[IngestResult]:
        results = self._results(call)
        try:
            self._send_paged(call, results)
        except RemoteUnavailable as exc:
            self._dropped(results, exc)
        return results

    def _results(self, call: paged_io.PagedCall) -> list[IngestResult]:
        return paged_io.new_results(call)

    def _dropped(self, results: list[IngestResult], exc: RemoteUnavailable) -> None:
        """An outage met by a write: raised, or (``on_unavailable="miss"``) every block not
        acknowledged counted failed."""
        if self.on_unavailable == "raise":
            raise exc
        for result in results:
            dropped = result.blocks - result.stored - result.present - result.failed
            result.failed += dropped
            if dropped:
                result.errors.setdefault("server", str(exc))
            self._outages.count("dropped_blocks", dropped)

    def _send_paged(self, call: paged_io.PagedCall, results: list[IngestResult]) -> None:
        hashes, parents, positions = call.flat()
        if all(call.stored_before()):  # (no block, or none past its request's start)
            return
        present, copies = self._look_up_paged(call, hashes, results)
        keep = [i for i, p in enumerate(present) if not p]
        if not keep:
            return
        hashes, frames = self._encode_rows(call, keep, hashes, parents, positions)
        frames.reverse()  # tail first, as ingest sends them
        rows = range(len(frames) - 1, -1, -1)
        for row, report in zip(rows, self._post_frames(frames)):
            _count_report(results[call.request_of(row)], report, copies.get(hashes[row], ()))

    def _look_up_paged(self, call: paged_io.PagedCall, hashes: list[BlockHash], results: list[IngestResult],
                       wait: float | None = None) -> tuple[list[bool], dict[bytes, list[IngestResult]]]:
        """The write's lookup of a paged call's blocks (those from each request's start on;
        ``hashes``: ``call.flat()``'s), counted in ``results``: ``count_found``'s answer (per
        block whether it needs no encoding; the later requests of each block met twice).
        ``wait``: seconds to wait for the answer at most (on a thread of its own), else
        ``TimeoutError`` and ``results`` untouched."""
        answer: dict[str, Any] = {}

        def look_up(asked: list[BlockHash]) -> list[bool]:
            answer.update(self._write_lookup(asked) if wait is None else self._first_lookup_within(asked, wait))
            return answer["present"]

        found = paged_io.look_up_from_starts(call, hashes, look_up)
        for result in results:
            result.durability = answer.get("durability", result.durability)
        return paged_io.count_found(call, found, results)  # twice in this call: sent once

    def _first_lookup_within(self, asked: list[BlockHash], wait: float) -> dict[str, Any]:
        """The write lookup of ``asked``, answered within ``wait`` seconds, else
        ``TimeoutError``. One at a time: while a late one is still out (a slow server), the
        next is not sent (``TimeoutError`` at once), so late lookups never pile up."""
        with self._fetcher_lock:
            self._check_open()
            if self._first_lookup is not None and not self._first_lookup.done():
                raise TimeoutError("the write lookup before this one is not answered yet")
            if self._first_lookups is None:
                self._first_lookups = IdlePool(1, idle_seconds=FETCH_IDLE_SECONDS, thread_name_prefix="cacheseek-lookup")
            job = self._first_lookup = self._first_lookups.submit(self._write_lookup, asked)
        return job.result(timeout=wait)

    def _encode_rows(self, call: paged_io.PagedCall, keep: list[int], hashes: list[BlockHash],
                     parents: list[bytes], positions: list[int]) -> tuple[list[BlockHash], list[BlockFrame]]:
        """The frames of the blocks ``keep`` names (indices in ``call.flat()`` order, whose
        ``hashes``, ``parents`` and ``positions`` are given), encoded from the call's pages,
        and their hashes; every block is encoded before any is returned, so a bad one (NaN,
        Inf) sends nothing. The call's rows become those blocks."""
        every = call.every_row()
        call.use_rows([every[i] for i in keep])
        hashes = [hashes[i] for i in keep]
        parents = [parents[i] for i in keep]
        positions = [positions[i] for i in keep]
        frames: list[BlockFrame] = []
        for _, batch in paged_io.encoded_batches(self.block_format, call, hashes, parents, positions,
                                                 [True] * len(keep), self._batch_blocks):
            frames += batch
        return hashes, frames

    # -- writes sent after the call returns ------------------------------------------------

    def _write_behind_paged(self, call: paged_io.PagedCall, *, single: bool = False,
                            look_up_first: bool = False, look_up_wait: float | None = None) -> Future:
        """``ingest_batch(wait=False)``: a block twice in the call is encoded once (its later
        requests count the one write's outcome), every other encoded; none looked up first,
        unless ``look_up_first``: then those the server holds (answered within
        ``look_up_wait``) are counted present, not encoded."""
        results = self._results(call)
        hashes, parents, positions = call.flat()
        found = None
        if look_up_first and not all(call.stored_before()):
            try:
                found = self._look_up_paged(call, hashes, results, look_up_wait)
            except RemoteUnavailable as exc:
                self._dropped(results, exc)
                return _done(results[0] if single else results)
            except TimeoutError:
                self._behind.count_late_lookup()
        again, copies = found or paged_io.count_found(call, [False] * len(hashes), results)
        keep = [i for i, seen in enumerate(again) if not seen]
        every = call.every_row()
        return self._write_behind(results, [hashes[i] for i in keep], [every[i][0] for i in keep], copies,
                                  lambda: self._encode_rows(call, keep, hashes, parents, positions)[1], single=single)

    def _write_behind(self, results: list[IngestResult], hashes: list[BlockHash], owners: list[int],
                      copies: dict[bytes, list[IngestResult]], encode: Callable[[], list[BlockFrame]], *,
                      single: bool) -> Future:
        """Encode (``encode()``: the frames of ``hashes``, in order; ``owners``: each one's
        result) and move the frames to host memory now; queue the lookup and the upload.
        Past ``max_pending_bytes`` nothing is encoded: the blocks are answered failed. The
        future's result: ``results``, or with ``single`` its one result."""
        answer = (lambda: results[0]) if single else (lambda: results)
        if not hashes:
            return _done(answer())
        handover = Handover()  # (made before the room is taken: see the ``try`` below)
        nbytes = len(hashes) * self._pending_frame_bytes
        # (per request, a block two requests share counted for both)
        if not self._behind.reserve(nbytes, sum(result.blocks - result.present for result in results)):
            why = (f"this write's {len(hashes)} frames ({nbytes} bytes at most) would pass max_pending_bytes "
                   f"({self._behind.max_bytes}) beside the {self._behind.pending_bytes} bytes waiting to be sent: dropped")
            for result in results:
                result.failed = result.blocks - result.present  # (``look_up_first``'s found counted)
                result.errors.setdefault("backlog", why)
            # (this client's own bound, the server not asked: write_behind's blocks_refused, not
            # an outage's dropped_blocks, which counted them in either on_unavailable mode)
            return _done(answer())
        leases: list[Any] = []

        def take(n: int) -> memoryview:
            lease = self._host_buffers.take(n)
            leases.append(lease)
            return lease.buffer.view(n)

        def give_back() -> None:
            for lease in leases:
                lease.release()

        try:
            # Checksummed on the sender thread, as each frame is sent (BlockFrame.wire_segments).
            frames = frames_to_host(encode(), take=take, seal=False)

            def send() -> Any:
                try:
                    self._send_behind(results, hashes, owners, copies, frames)
                finally:
                    give_back()
                self._behind.count_failed_blocks(sum(result.failed for result in results))
                return answer()

            return self._behind.submit(nbytes, send, handover)
        except BaseException:
            if handover.claim():  # (else the sender has the write, its buffers and its room)
                give_back()
                self._behind.release(nbytes)
            raise

    def _send_behind(self, results: list[IngestResult], hashes: list[BlockHash], owners: list[int],
                     copies: dict[bytes, list[IngestResult]], frames: list[BlockFrame]) -> None:
        """On the sender thread: the lookup, then the frames of the blocks not stored yet."""
        try:
            found = self._write_lookup(hashes)
            for result in results:
                result.durability = found.get("durability", result.durability)
            new = []
            for i, was in enumerate(found["present"]):
                if was:
                    for result in (results[owners[i]], *copies.get(hashes[i], ())):
                        result.present += 1
                else:
                    new.append(i)
            sent = [frames[i] for i in reversed(new)]  # tail first, as ingest sends them
            frames.clear()
            for i, report in zip(reversed(new), self._post_frames(sent)):
                _count_report(results[owners[i]], report, copies.get(hashes[i], ()))
        except RemoteUnavailable as exc:
            self._dropped(results, exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every ``wait=False`` ingest made before this call is answered;
        False if ``timeout`` seconds passed first."""
        return self._behind.flush(timeout)

    def materialize_into(self, keys: Any, dest: PagedKV, *, max_tokens: int | None = None, start: int = 0,
                         layerwise: bool = False, located: bool = False) -> Any:
        """Write the longest stored prefix (at most ``max_tokens``, and what ``dest``'s page
        table holds) straight into the pages ``dest = pages.at(page_ids)`` names, decoded there
        (``PrefixCache.materialize_into``); the blocks before ``start`` are in the pages
        already: counted, not fetched (the GET asks from ``start`` on) nor written.
        ``layerwise``: a ``LayerwiseLoad`` with every layer ready at once (see ``materialize``).
        ``located``: as ``materialize``'s."""
        self._check_open()
        if not isinstance(dest, PagedKV):
            raise InputError(f"dest: expected an engine's pages, pages.at(page_ids), got {type(dest).__name__}")
        loaded = self._load_paged([(keys, dest.page_ids, max_tokens)], dest.pages, single=True, starts=[start],
                                  located=located)
        return self._all_ready(loaded, dest.pages.device) if layerwise else loaded[0]

    def materialize_into_batch(self, requests: list[Any], pages: KVPages, *, layerwise: bool = False,
                               located: bool = False) -> Any:
        """``materialize_into`` for many requests (``cs.PagedRequest`` each): one lookup of
        every request's chain (``locate_batch``'s), their chains fetched at once (at most
        ``max_concurrent_fetches``, over the pool's connections), then decoded together into
        their pages. Every chain has arrived before any page is written. ``located``: as
        ``materialize``'s, for every request."""
        self._check_open()
        loaded = self._load_paged(paged_io.requests_of(requests), pages, single=False,
                                  starts=paged_io.starts_of(requests), located=located)
        return self._all_ready(loaded, pages.device) if layerwise else loaded

    def _all_ready(self, loaded: list[Loaded], device: Any) -> LayerwiseLoad:
        """A layer-wise handle over pages already written: every layer ready at once. Over
        HTTP a frame holds every layer of its block, so no layer is complete before the last
        frame has arrived (docs/engine.md, "Layer-wise over HTTP")."""
        n = sum(r.num_blocks for r in loaded)
        return LayerwiseLoad(num_layers=self.layout.num_layers, device=device, num_tokens=n * self.block_tokens,
                             num_blocks=n, tiers=[t for r in loaded for t in r.tiers], requests=loaded)

    def _load_paged(self, requests: list[tuple[Any, Any, Any]], pages: KVPages, *, single: bool,
                    starts: list[Any], located: bool) -> list[Loaded]:
        self._check_paged()
        call = paged_io.plan(self.keys, self.layout, pages, requests, single=single)
        paged_io.hash_requests(call, self.keys, requests)
        starts = paged_io.load_starts(call, starts, self.block_tokens)
        limits = paged_io.load_limits(call, requests, self.block_tokens)
        chains: list[list[BlockFrame]] = [[] for _ in requests]
        try:
            return self._load_fetched(call, requests, starts, limits, chains, located)
        finally:
            _release(chains)

    def _load_fetched(self, call: paged_io.PagedCall, requests: list[tuple[Any, Any, Any]], starts: list[int],
                      limits: list[int], chains: list[list[BlockFrame]], located: bool) -> list[Loaded]:
        """``_load_paged``'s fetch and decode; ``chains`` gets the frames fetched (the
        caller releases them)."""
        results = [Loaded() for _ in requests]
        B = self.block_tokens
        tokens = [t if (n := self._max_tokens(given)) is None else min(t, n)
                  for t, (_, _, given) in zip(call.tokens, requests)]
        # Everything is fetched before any page is written: an outage (or a bad chain) in any
        # request leaves the pages as they were.
        try:
            # A request with no block to load is a query still (an empty chain, as
            # ``locate_batch`` sends it), unless a ``locate`` counted it: left out, a worker's
            # hit rate counted only its prompts of a block or more.
            # (A request cut to no token at all is no query: nothing asked, nothing counted.)
            asked = [r for r, n in enumerate(limits) if n or (tokens[r] and not located)]
            answers: list[dict[str, Any] | None] = [None] * len(asked)
            # The query's length, its partial last block included (as ``materialize`` says it),
            # cut to ``max_tokens``: the hit rate's denominator. Whole blocks only, a paged
            # load read as a hit rate of 1 where ``materialize`` of the prompt read 0.77.
            self._lookup_chains([call.hashes[r][: limits[r]] for r in asked], [tokens[r] for r in asked], answers,
                                again=located)
            found: list[dict[str, Any]] = [{"matched": 0, "tiers": []} for _ in requests]
            for r, answer in zip(asked, answers):
                assert answer is not None  # (each answered, or _lookup_chains raised)
                found[r] = answer
            counts = [f["matched"] for f in found]
            paged_io.plan_load(call, counts, B, starts)
            # The blocks before a request's start are in its pages already: not fetched.
            self._fetch_chains([(h[:n], s) if n > s else None for h, n, s in zip(call.hashes, counts, starts)], chains)
        except RemoteUnavailable:
            if self.on_unavailable == "raise":
                raise
            self._outages.count("missed_materializes")
            return results
        for r, (n, s) in enumerate(zip(counts, starts)):
            done = min(n, s) + len(chains[r])
            results[r] = Loaded(done * self.block_tokens, done, list(found[r]["tiers"][:done]))
        if not call.rows:
            return results
        decoder, sink = paged_io.decoder(self.block_format, call)
        try:
            first_row = 0
            for frames, n, s in zip(chains, counts, starts):
                for j, frame in enumerate(frames):
                    sink.rows.append(first_row + j)
                    decoder.add(frame)
                first_row += max(0, n - s)
            if len(decoder):
                decoder.finish()
        finally:
            decoder.close()  # the staging given back on every path
        return results

    def _fetch_chains(self, jobs: list[tuple[list[BlockHash], int] | None], chains: list[list[BlockFrame]]) -> None:
        """``chains[i]`` = the frames of ``jobs[i]`` (a chain and the position to fetch it
        from; None: nothing to fetch), several at once (``max_concurrent_fetches``), each
        over a connection of the pool. Returns once every fetch has ended, so that the
        frames of every chain are in ``chains`` for the caller to release; the first error
        is raised then, the fetches not yet begun called off."""
        todo = [(i, job) for i, job in enumerate(jobs) if job is not None]
        if len(todo) == 1 or self.max_concurrent_fetches == 1:
            for i, (hashes, start) in todo:
                chains[i] = self._fetch_chain(hashes, start)
            return
        pool = self._fetch_pool()
        futures: list[tuple[int, Future]] = []
        error: BaseException | None = None
        try:
            for i, (hashes, start) in todo:
                futures.append((i, pool.submit(self._fetch_chain, hashes, start)))
        except RuntimeError:  # the pool shut down by close() from another thread meanwhile
            error = self._closed_error()
        for i, future in futures:
            while True:
                try:
                    chains[i] = future.result()
                except CancelledError:
                    # Called off by an error here, or by close(): a chain missing is no prefix.
                    error = error or self._closed_error()
                except BaseException as exc:  # noqa: BLE001 - raised below, once every fetch has ended
                    if error is None:
                        error = exc
                        for _, later in futures:
                            later.cancel()
                    if not future.done():  # (an interrupt of this thread's wait: the fetch runs on)
                        continue
                break
        if error is not None:
            raise error

    def _fetch_pool(self) -> IdlePool:
        with self._fetcher_lock:
            self._check_open()
            if self._fetcher is None:
                # Its threads exit once idle (FETCH_IDLE_SECONDS): a client that loads a batch
                # and then idles holds none, a hot loop of batches keeps them.
                self._fetcher = IdlePool(self.max_concurrent_fetches, idle_seconds=FETCH_IDLE_SECONDS,
                                         thread_name_prefix="cacheseek-fetch")
            return self._fetcher

    def locate_batch(self, keys: Any) -> list[Located]:
        """``locate`` of each of ``keys`` (a list, one per request), as many calls of it would
        answer and the server count (each a lookup, with its tokens), in one ``POST
        /v1/lookup`` (several past ``max_lookup_hashes`` hashes in all, or 1,024 chains; a chain
        longer than ``max_lookup_hashes`` goes alone, in pieces). Bad keys raise ``InputError``
        naming their index before anything is sent. In an outage with
        ``on_unavailable="miss"``, the requests not answered are misses (``missed_lookups``
        counts each)."""
        self._check_open()
        chains, tokens = self._hash_batch(keys)
        found: list[dict[str, Any] | None] = [None] * len(chains)
        try:
            self._lookup_chains(chains, tokens, found)
        except RemoteUnavailable:
            if self.on_unavailable == "raise":
                raise
            self._outages.count("missed_lookups", sum(f is None for f in found))
        B = self.block_tokens
        return [Located(num_blocks=f["matched"], num_tokens=f["matched"] * B, tiers=list(f["tiers"]))
                if f is not None else Located(num_blocks=0, num_tokens=0, tiers=[]) for f in found]

    def _lookup_chains(self, chains: list[list[BlockHash]], tokens: list[int],
                       found: list[dict[str, Any] | None], *, again: bool = False) -> None:
        """``found[i]`` = the lookup of ``chains[i]`` (a query of ``tokens[i]`` tokens), as
        few round trips as the limits allow: chains packed into lookups of several, each of
        at most ``max_lookup_hashes`` hashes and ``LOOKUP_CHAINS`` chains. Raises at the
        first that fails; those answered before stay in ``found``. ``again``: queries the
        server counted already (``_lookup``). A lookup refused for a server's lower
        ``max_lookup_hashes`` lowers this client's, and the chains not answered go again."""
        try:
            self._lookup_chains_under_limit(chains, tokens, found, again)
        except RemoteError as exc:
            if not self._lower_lookup_limit(exc):
                raise
            rest = [i for i, f in enumerate(found) if f is None]
            answers: list[dict[str, Any] | None] = [None] * len(rest)
            try:
                self._lookup_chains_under_limit([chains[i] for i in rest], [tokens[i] for i in rest], answers, again)
            finally:
                for i, answer in zip(rest, answers):
                    found[i] = answer

    def _lower_lookup_limit(self, exc: RemoteError) -> bool:
        """Whether a lookup refused for its number of hashes (a ``413`` or ``422`` naming the
        server's ``max_lookup_hashes``) may go again (once: its callers retry one time): that
        limit becomes this client's where lower. One at or above this client's limit goes
        again too: another thread's refusal lowered it while this lookup was out. A refusal
        that names no limit is raised."""
        value = exc.fields.get("limit_value")
        if exc.status not in (413, 422) or exc.fields.get("limit") != "max_lookup_hashes" \
                or type(value) is not int or not 0 < value < 1 << 63:
            return False
        self.max_lookup_hashes = min(self.max_lookup_hashes, value)
        return True

    def _lookup_chains_under_limit(self, chains: list[list[BlockHash]], tokens: list[int],
                                   found: list[dict[str, Any] | None], again: bool) -> None:
        limit = self.max_lookup_hashes
        group: list[int] = []
        size = 0
        for i, hashes in enumerate(chains):
            if len(hashes) > limit:
                found[i] = self._lookup(hashes, tokens=tokens[i], again=again)  # alone, in pieces
                continue
            if group and (size + len(hashes) > limit or len(group) == LOOKUP_CHAINS):
                self._lookup_group(group, chains, tokens, found, again)
                group, size = [], 0
            group.append(i)
            size += len(hashes)
        if group:
            self._lookup_group(group, chains, tokens, found, again)

    def _lookup_group(self, group: list[int], chains: list[list[BlockHash]], tokens: list[int],
                      found: list[dict[str, Any] | None], again: bool) -> None:
        answers = self._lookup_several([chains[i] for i in group], [tokens[i] for i in group], again) \
            if len(group) > 1 and self._chain_lookups else None
        if answers is None:  # one chain, or a server that answers one chain a lookup
            for i in group:
                found[i] = self._lookup_piece(chains[i], each=False, tokens=tokens[i], again=again)
            return
        for i, answer in zip(group, answers):
            found[i] = answer

    def _lookup_several(self, chains: list[list[BlockHash]], tokens: list[int], again: bool = False
                        ) -> list[dict[str, Any]] | None:
        """One ``POST /v1/lookup?chains=...`` of several chains; None from a server that read
        them as one chain (an older one, which knows no ``chains``): it is asked chain by
        chain from then on."""
        flat = [h for chain in chains for h in chain]
        path, content, headers = lookup_request(flat, chains=[len(chain) for chain in chains])
        headers[TOKENS_HEADER] = ",".join(map(str, tokens))
        if again:
            headers[AGAIN_HEADER] = "1"
        request = httpx.Request("POST", self.url + path, content=content, headers={**self._headers, **headers},
                                extensions={"timeout": self._timeouts, IDEMPOTENT_EXTENSION: True})

        def call() -> list[dict[str, Any]] | None:
            response = self._send(request, path)
            found = _json_answer(response, self.url + path)
            answers = found.get("chains") if isinstance(found, dict) else None
            if isinstance(answers, list) and len(answers) == len(chains) and all(
                    _is_lookup_answer(a, len(chain), False) for a, chain in zip(answers, chains)):
                return answers
            if answers is None and _is_lookup_answer(found, len(flat), False):
                return None
            raise _foreign(found, f"a lookup of {len(chains)} chains", response.status_code, self.url + path)

        answers = self._guarded(path, call)
        if answers is None:
            log.info("CacheSeek server %s answers no lookup of several chains (an older server): each request "
                     "is looked up alone", self.url)
            self._chain_lookups = False
        return answers

    def locate(self, keys: Any) -> Located:
        self._check_open()
        tokens = self._num_keys(keys)
        hashes = self.block_hashes(keys)
        try:
            found = self._lookup(hashes, tokens=tokens)
        except RemoteUnavailable:
            if self.on_unavailable == "raise":
                raise
            self._outages.count("missed_lookups")
            return Located(num_blocks=0, num_tokens=0, tiers=[])
        n = found["matched"]
        return Located(num_blocks=n, num_tokens=n * self.block_tokens, tiers=list(found["tiers"]))

    def materialize(self, keys: Any, device: Any = None, *, max_tokens: int | None = None,
                    layerwise: bool = False, located: bool = False) -> Any:
        """KV of the longest stored prefix (at most ``max_tokens``), decoded on ``device``.
        ``layerwise``: the same KV behind a ``LayerwiseLoad`` with every layer ready at once
        (the API of ``PrefixCache``'s layer-wise load, so callers need no branch; over HTTP
        no layer is whole before the last frame has come, docs/engine.md).
        ``located``: the caller asked ``locate`` (or ``locate_batch``) about these keys just
        before, and that lookup is the one the server's hit rate counts: this load's lookup
        is not counted again (an engine that locates every request and loads the hits
        counted each hit twice, each miss once).

        If a block vanishes between the lookup and the transfer (evicted, or found corrupt),
        the prefix ends before it, as in ``PrefixCache``. In an outage with
        ``on_unavailable="miss"``, nothing."""
        self._check_open()
        if layerwise:
            self._check_layerwise()
            return LayerwiseLoad.loaded(self.materialize(keys, device, max_tokens=max_tokens, located=located),
                                        self.layout.num_layers)
        tokens = self._num_keys(keys)
        device = self._device(device)
        max_tokens = self._max_tokens(max_tokens)
        hashes = self._limit(self.block_hashes(keys), max_tokens)
        if max_tokens is not None:
            tokens = min(tokens, max_tokens)
        try:
            # A prompt under one block (or cut below one) is asked too, as ``locate`` asks it:
            # the server's hit rate counts a query only from its lookup. Located, it was counted;
            # cut to no token (``max_tokens=0``), it is no query.
            found: dict[str, Any] = self._lookup(hashes, tokens=tokens, again=located) \
                if hashes or (tokens and not located) \
                else {"matched": 0, "tiers": []}
            frames = self._fetch_chain(hashes[: found["matched"]]) if found["matched"] else []
        except RemoteUnavailable:
            if self.on_unavailable == "raise":
                raise
            self._outages.count("missed_materializes")
            return self._nothing(device)
        if not frames:
            return self._nothing(device)
        try:
            k, v = decode_frames(self.block_format, frames, device)  # (its copies off the frames have landed)
        finally:
            _release([frames])
        return self._materialized(k, v, list(found["tiers"][: len(frames)]), device)

    def _prefetch(self, hashes: list[BlockHash]) -> dict[str, Any]:
        # (a hint: the first max_lookup_hashes blocks, those a read needs first, are enough)
        path, content, headers = lookup_request(hashes[: self.max_lookup_hashes])
        # (idempotent: a second one joins the first's promotions, so the transport may send
        # it again on a new connection when a kept-alive one turns out closed, as a lookup)
        found: dict[str, Any] = self._request(
            "POST", path.replace("/v1/lookup", "/v1/prefetch", 1), content=content, headers=headers,
            json_answer=True, check=_is_prefetch_answer, what="a prefetch's answer",
            extensions={IDEMPOTENT_EXTENSION: True})
        return found

    def prefetch(self, keys: Any) -> Prefetch | None:
        """``POST /v1/prefetch``: the server starts promoting the stored prefix of ``keys``
        from its disk or Redis tier into its CPU tier, and answers at once. A ``Prefetch``
        (``on_server``: it cannot be waited for here; a ``materialize`` meanwhile waits in the
        server for the blocks still on their way), or None when the server started nothing
        (nothing stored, already in memory, or its limit of prefetches in flight). In an
        outage with ``on_unavailable="miss"``, None too."""
        self._check_open()
        self._num_keys(keys)
        hashes = self.block_hashes(keys)
        if not hashes:
            return None
        try:
            try:
                found = self._prefetch(hashes)
            except RemoteError as exc:
                if not self._lower_lookup_limit(exc):
                    raise
                found = self._prefetch(hashes)
        except RemoteUnavailable:
            if self.on_unavailable == "raise":
                raise
            self._outages.count("missed_prefetches")
            return None
        if not found.get("started"):
            return None
        return Prefetch(matched=found["matched"], blocks=found["blocks"], joined=found["joined"], on_server=True)

    # -- operations ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's per-tier figures, in the shape of ``PrefixCache.stats()``;
        ``device_staging``: this process's staging pools (the decodes run here)."""
        self._check_open()
        server = self._request("GET", "/v1/stats", json_answer=True, check=lambda found: isinstance(found, dict),
                               what="the server's figures")
        return {**self._config_stats(), **server, "device_staging": staging_stats()}

    def check_token(self, *, write: bool = True) -> None:
        """Whether the server takes this client's token to write (``write``) or to read,
        asked by a delete (or a read) of a block no one stored, which changes nothing. A token
        it refuses (``401``, ``403``), or a server certificate this client does not trust
        (``verify``), is a ``ConfigError``, said now rather than by every call after; a server
        that cannot be reached, or any other answer, raises nothing here (an outage is said by
        the calls that meet it), and the breaker hears nothing of it."""
        import secrets

        self._check_open()
        path = f"/v1/blocks/{secrets.token_hex(digest_size(self.hash_algo))}"
        try:
            response = self._http.request("DELETE" if write else "GET", path)
        except (httpx.HTTPError, RemoteError) as exc:
            if untrusted_certificate(exc):
                # Not an outage that passes: every call after failed alike, each a miss.
                raise ConfigError(f"verify: the TLS certificate of {self.url} is not trusted by this client: give "
                                  f"it the CA bundle that signed it ({exc})") from None
            return
        if response.status_code in (401, 403):
            try:
                reason = response.json().get("error") or response.text[:REASON_CHARS]
            except (ValueError, AttributeError, RecursionError):
                reason = response.text[:REASON_CHARS]
            raise ConfigError(f"token: {self.url} refused it to {'write' if write else 'read'} "
                              f"(HTTP {response.status_code}: {reason})"
                              + ("" if self._headers.get("Authorization") else "; it needs one"))

    def client_stats(self) -> dict[str, Any]:
        """This client's view of the server's availability: ``outages`` (each logged once),
        ``unavailable_calls`` (requests that failed to get an answer), ``refused_by_breaker``
        (calls not sent: the breaker was open), ``missed_lookups``, ``missed_materializes``,
        ``missed_prefetches`` and ``dropped_blocks`` (outages turned into misses, with
        ``on_unavailable="miss"``), ``busy_refusals`` (``RemoteBusy``: the server up, its
        request bodies in flight at their cap), ``pool_timeouts`` (``PoolExhausted``: calls that
        waited past their timeout for a connection of this client's pool, not sent),
        ``bad_frames`` (fetched frames that failed their check), ``cut_answers`` (prefix
        answers whose connection ended mid-body: the whole frames before the cut loaded),
        ``in_outage``, ``last_error``, the breaker's state, and ``write_behind``: the
        ``wait=False`` ingests (queued, done, refused past ``max_pending_bytes`` and the
        blocks of those, ``blocks_refused``, failed:
        their futures hold an error, the last one's in its ``last_error``, pending now, and
        their bytes; ``blocks_failed``: blocks of those sent answered failed); ``write_buffers`` and ``read_buffers``: the host buffers that
        frames are sent from and read into, kept for reuse (made, free, lent now)."""
        return {**self._outages.snapshot(), "on_unavailable": self.on_unavailable,
                "breaker": self.breaker.stats().to_dict(), "write_behind": self._behind.stats(),
                "write_buffers": self._host_buffers.stats(), "read_buffers": self._read_buffers.stats()}

    def close(self) -> None:
        """Send the ``wait=False`` ingests still queued, then close the connections. Every
        call but ``client_stats`` then raises ``RuntimeError``. With ``exchange_timeout``
        set, the queued writes get that long in all: those not answered by then are dropped,
        as in an outage (``errors["server"]``), the exchange under way then cut, so ``close``
        returns within about ``exchange_timeout`` (through a proxy, an exchange waiting for
        its answer's head is not cut: ``BulkTransport._through_proxy``). Then the exchanges
        other threads have under way (a load on an engine's loader thread) are cut too: each
        such call raises the closed error at once, rather than holding the process's exit
        for up to ``exchange_timeout`` against a server that trickles its answer."""
        # Each write's exchanges were bounded alone: against a server (or a front) dribbling
        # its answers, close() took failure_threshold times exchange_timeout, until the
        # breaker opened, and a lenient breaker's more.
        self._behind.close(timeout=self._transport.exchange_timeout)
        # The buffers kept for the next writes (page-locked, up to max_pending_bytes): no
        # write comes after close, and the process may hold this object long after. The
        # pools stay, emptied: a call still in flight gives its buffers back to them, and
        # client_stats() goes on counting its leases.
        self._host_buffers.keep_at_most(0)
        self._read_buffers.keep_at_most(0)
        with self._fetcher_lock:
            self._closed = True
            fetcher, self._fetcher = self._fetcher, None
            first, self._first_lookups = self._first_lookups, None
        self._http.close()
        # (after the queued writes' own drain above: every exchange still running is another
        # thread's call, and Python's exit joins an executor's threads, so one left to run
        # held the process's exit for its whole exchange_timeout)
        self._transport.cut_off_at(time.monotonic())
        for pool in (fetcher, first):
            if pool is not None:
                pool.shutdown(cancel_futures=True)  # (no wait: an exchange under way ends on the closed client)

    # -- HTTP ----------------------------------------------------------------------------

    def _guarded(self, path: str, call: Callable[[], T]) -> T:
        """Run one exchange with the server under the breaker: refused at once while it is
        open; a failure to get an answer (or a 503) counts against it, any other answer for it."""
        self._check_open()  # (a layer-wise writer made before close() sends on finish())
        ticket = self.breaker.allow_call()
        if ticket is None:
            retry = self.breaker.stats().retry_in_seconds
            exc = RemoteUnavailable(f"the CacheSeek server failed {self.breaker.failure_threshold} or more calls in a "
                                    f"row; not asked again for {retry:.1f} s (circuit breaker open)", url=self.url + path)
            self._outages.failed(exc, refused=True)
            raise exc
        try:
            out = call()
        except PoolExhausted:
            self.breaker.record_unsent(ticket)  # this client's own limit: the server was not asked
            self._outages.count("pool_timeouts")
            raise
        except RemoteBusy:
            self.breaker.record_success(ticket)  # an answer: the server is up, its bodies in flight at their cap
            self._outages.answered()
            self._outages.count("busy_refusals")
            raise
        except RemoteUnavailable as exc:
            if self._closed:
                # Cut by close() from another thread (or met its closed transport): this
                # client's own end, not the server's failure, so no outage is counted or logged.
                self.breaker.record_unsent(ticket)
                raise self._closed_error() from None
            if self._behind.exiting_here():
                # A write cut at interpreter exit: this client's own limit, not the server's
                # failure. Counted, its queue's cut writes opened the breaker under the
                # threads the program left running.
                self.breaker.record_unsent(ticket)
                raise
            self.breaker.record_failure(ticket)
            self._outages.failed(exc)
            raise
        except RemoteError as exc:
            # 503: starting or shutting down; 502, 504: a proxy that cannot reach it. No
            # service, as far as a caller can tell.
            if exc.status in OUTAGE_STATUSES:
                self.breaker.record_failure(ticket)
                self._outages.failed(exc)
                raise RemoteUnavailable(exc.reason, status=exc.status, url=exc.url, fields=exc.fields) from None
            self.breaker.record_success(ticket)
            self._outages.answered()
            raise
        except Exception as exc:
            if isinstance(exc, RuntimeError) and self._closed:
                # Closed by another thread after this call's check: its httpx client or transport refused.
                raise self._closed_error() from None
            self.breaker.record_success(ticket)  # an answer came (a bad frame in it is not an outage)
            self._outages.answered()
            raise
        self.breaker.record_success(ticket)
        self._outages.answered()
        return out

    def _lookup(self, hashes: list[BlockHash], *, each: bool = False, tokens: int | None = None,
                again: bool = False) -> dict[str, Any]:
        """``POST /v1/lookup``; a chain longer than ``max_lookup_hashes`` in pieces, in order:
        the next only while the prefix matched so far is whole, unless ``each`` asks about
        every block. The server counts the pieces as one query; ``again``: a query it
        counted already, not counted again. A lookup refused for a server's lower
        ``max_lookup_hashes`` lowers this client's and goes again, in pieces under it."""
        try:
            return self._lookup_under_limit(hashes, each, tokens, again)
        except RemoteError as exc:
            if not self._lower_lookup_limit(exc):
                raise
            return self._lookup_under_limit(hashes, each, tokens, again)

    def _lookup_under_limit(self, hashes: list[BlockHash], each: bool, tokens: int | None,
                            again: bool) -> dict[str, Any]:
        limit = self.max_lookup_hashes
        if len(hashes) <= limit:
            return self._lookup_piece(hashes, each=each, tokens=tokens, again=again)
        found: dict[str, Any] = {"matched": 0, "tiers": []}
        for start in range(0, len(hashes), limit):
            piece = hashes[start : start + limit]
            part = self._lookup_piece(piece, each=each, tokens=tokens if start == 0 else None, continues=start,
                                      again=again)
            if found["matched"] == start:  # the prefix is whole so far: this piece extends it
                found["matched"] += part["matched"]
                found["tiers"] += part["tiers"]
            if each:
                found["present"] = found.get("present", []) + part["present"]
                found.update({k: v for k, v in part.items() if k not in found})
            elif part["matched"] < len(piece):
                break
        return found

    def _lookup_piece(self, hashes: list[BlockHash], *, each: bool, tokens: int | None,
                      continues: int = 0, again: bool = False) -> dict[str, Any]:
        """One ``POST /v1/lookup``, sent to the transport directly: a lookup comes before every
        request a worker serves, and httpx.Client's own request path (URL merging, auth
        and redirect flows, text decoding) cost ~0.3 ms of a ~1 ms lookup."""
        path, content, headers = lookup_request(hashes, each=each)
        if tokens is not None:  # the query's length, partial last block included: the hit rate's denominator
            headers[TOKENS_HEADER] = str(tokens)
        if continues:  # a piece after the chain's first: the server counts the query once
            headers[CONTINUES_HEADER] = str(continues)
        if again:
            headers[AGAIN_HEADER] = "1"
        request = httpx.Request("POST", self.url + path, content=content, headers={**self._headers, **headers},
                                extensions={"timeout": self._timeouts, IDEMPOTENT_EXTENSION: True})

        def call() -> dict[str, Any]:
            response = self._send(request, path)
            found = _json_answer(response, self.url + path)
            if not _is_lookup_answer(found, len(hashes), each):
                raise _foreign(found, f"a lookup of {len(hashes)} hashes", response.status_code, self.url + path)
            return found

        return self._guarded(path, call)

    def _write_lookup(self, hashes: list[BlockHash]) -> dict[str, Any]:
        """The lookup a write begins with (``each``: which blocks are present). The server
        answers its ``max_body_bytes`` too, which becomes this client's where lower: the
        frames are then split under it from the first body on, not after a ``413``."""
        found = self._lookup(hashes, each=True)
        limit = found.get("max_body_bytes")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            self._take_body_limit(limit)
        return found

    def _send(self, request: httpx.Request, path: str) -> httpx.Response:
        """One request through the transport, its body read whole."""
        try:
            response = _read_answer(self._transport.handle_request(request), self.url + path)
        except httpx.TransportError as exc:
            raise self._unreached(exc, path) from None
        self._raise_for_status(response, path)
        return response

    def _post_frames(self, frames: list[BlockFrame]) -> Iterator[dict[str, Any]]:
        """Send ``frames`` in streamed POSTs of at most ``max_body_bytes`` and
        ``MAX_BODY_FRAMES`` each, in their
        order, and yield each frame's report as its POST is answered (so what a POST stored
        is counted even if a later one meets an outage). Sends nothing until iterated.
        Takes the frames over: each POST's leave the list once it is answered, which frees
        their device buffers. A frame that no body can hold raises ``ConfigError`` before
        anything more is sent."""
        try:
            self._check_body_room(frames)
            while frames:
                limit, n, total = self.max_body_bytes, 0, 0
                while n < min(len(frames), MAX_BODY_FRAMES) and (n == 0 or total + _wire_bytes(frames[n]) <= limit):
                    total += _wire_bytes(frames[n])
                    n += 1
                try:
                    reports = self._post_body(frames[:n], total)
                except RemoteError as exc:
                    if not self._lower_body_limit(exc, total):
                        raise
                    self._check_body_room(frames)  # a frame the server can never take: say so, send no more
                    continue
                del frames[:n]
                yield from reports
        finally:
            frames.clear()  # on an error too: a traceback kept by the caller must not hold device buffers

    def _check_body_room(self, frames: list[BlockFrame]) -> None:
        biggest = max((_wire_bytes(f) for f in frames), default=0)
        if biggest > self.max_body_bytes:
            whose = "the server's max_body_bytes" if self._limit_from_server else "max_body_bytes"
            raise ConfigError(f"{whose} ({self.max_body_bytes}) cannot hold one frame of this cache "
                              f"({biggest} bytes with its length prefix): raise it, or use smaller blocks "
                              "(block_tokens) or a more compact codec; nothing more of this call is sent")

    def _lower_body_limit(self, exc: RemoteError, total: int) -> bool:
        """Whether a refused body of ``total`` bytes may go again, split: a 413 for the
        body's size, not for one frame's. The limit the 413 names (its ``limit_value``
        where its ``limit`` is ``max_body_bytes``) becomes this client's, so later calls are
        not refused first; where none is named (a proxy's 413), half the refused body. The
        limit then is below the refused body, so each retry sends fewer frames, and this ends."""
        if exc.status != 413:
            return False
        name, value = exc.fields.get("limit"), exc.fields.get("limit_value")
        if isinstance(name, str):
            if name != "max_body_bytes":
                return False
            # (a limit of no server's, 0, negative, past 2**63 or not a whole number, names none:
            # 0 would make every later call a ConfigError)
            limit = value if type(value) is int and 0 < value < 1 << 63 else 0
        else:
            # A server before the fields (or a proxy): the limit only in its sentence.
            if "max_frame_bytes" in exc.reason:
                return False
            named = _BODY_LIMIT.search(exc.reason)
            # (int() refuses 4,300 digits)
            limit = int(named[1]) if named and len(named[1]) <= 19 else 0
        self._take_body_limit(min(limit if limit > 0 else total // 2, total - 1))
        return True

    def _take_body_limit(self, limit: int) -> None:
        """The server's (or a proxy's) body limit becomes this client's where it is lower."""
        if limit < self.max_body_bytes:  # another thread may have lowered it further meanwhile
            self.max_body_bytes, self._limit_from_server = limit, True

    def _post_body(self, frames: list[BlockFrame], total: int) -> list[dict[str, Any]]:
        """One streamed POST of ``frames`` (content-addressed, so sent again on a new
        connection if a kept-alive one turns out closed)."""
        path, sent = "/v1/blocks", len(frames)
        request = httpx.Request(
            "POST", self.url + path, stream=_FrameStream(frames, self._host_buffers),
            headers={**self._headers, "Content-Type": BATCH_CONTENT_TYPE, "Content-Length": str(total)},
            extensions={"timeout": self._timeouts, IDEMPOTENT_EXTENSION: True})
        del frames  # the request's alone, let go below (a traceback would keep this frame's locals)

        def call() -> list[dict[str, Any]]:
            response = self._send(request, path)
            reports = _json_answer(response, self.url + path)
            # Counted frame by frame, each given to its request by its place: a list of
            # another length would count blocks never sent, or give reports to the wrong requests.
            if not (isinstance(reports, list) and len(reports) == sent and all(map(_is_put_report, reports))):
                raise _foreign(reports, f"{sent} reports", response.status_code, self.url + path)
            return reports

        try:
            return self._guarded(path, call)
        finally:
            request.stream = httpx.ByteStream(b"")  # the frames go now, answered or not

    def _fetch_chain(self, hashes: list[BlockHash], start: int = 0) -> list[BlockFrame]:
        """The frames of ``hashes`` (a chain from its head) from position ``start`` on, as far
        as they arrive whole and valid. A block gone since the lookup (evicted, deleted) ends
        the prefix before it: the server answers 404 for the whole chain, so the stored part
        is looked up again and fetched."""
        for _ in range(FETCH_TRIES):
            frames = self._guarded(f"/v1/prefixes/{to_hex(hashes[-1])}", lambda: self._stream_chain(hashes, start))
            if frames is not None:
                return frames
            matched = self._lookup(hashes, again=True)["matched"]
            if not start < matched < len(hashes):
                return []  # nothing stored past start, or the whole chain again: another writer races this read
            hashes = hashes[:matched]
        return []

    @functools.cached_property
    def _pending_frame_bytes(self) -> int:
        """What a frame waiting to be sent counts against ``max_pending_bytes``: the format's
        largest frame (its longest header), a few bytes over any real one."""
        return self.block_format.max_frame_nbytes()

    @functools.cached_property
    def _max_frame_bytes(self) -> int:
        """No frame of this cache's format is longer: a longer declared length is never
        allocated (memory follows bytes received, not bytes declared)."""
        return max(part.planned_payload().nbytes for part in self.block_format.parts()) + HEADER_SLACK

    def _stream_chain(self, hashes: list[BlockHash], start: int = 0) -> list[BlockFrame] | None:
        """The frames from position ``start`` on; None: the server has not every block of
        ``hashes`` (a 404). Each frame lies in a buffer leased from ``_read_buffers``: the
        caller releases it (``_release``) once done with its bytes."""
        leases: list[Any] = []  # every buffer taken; those of no frame handed out go back here

        def take(n: int) -> memoryview:
            try:
                lease = self._read_buffers.take(n)
            except (OSError, MemoryError) as exc:
                # Host memory short: the prefix read so far stands (``_read_chain``), said here.
                log.warning("a read of a chain of %d blocks from %s ends after %d frames: no host memory for the "
                            "next (%s: %s)", len(hashes), self.url, len(leases), type(exc).__name__, exc)
                raise MemoryError(f"no host memory for a {n}-byte frame") from exc
            leases.append(lease)
            return lease.buffer.view(n)

        try:
            frames = self._read_chain(hashes, start, take, leases)
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        kept = {id(f.lease) for f in frames or ()}
        for lease in leases:
            if id(lease) not in kept:  # a frame dropped: before start, past the chain, or bad
                lease.release()
        return frames

    def _read_chain(self, hashes: list[BlockHash], start: int, take: Callable[[int], memoryview],
                    leases: list[Any]) -> list[BlockFrame] | None:
        frames: list[BlockFrame] = []
        seen = 0  # leases taken so far: a frame read through ``take`` (not a chunked body's) added one
        path = f"/v1/prefixes/{to_hex(hashes[-1])}"
        try:
            with self._http.stream("GET", path, params={"start": start} if start else None) as response:
                if response.status_code == 404:
                    _read_small(response)  # the eviction race: its connection back to the pool, not closed
                    return None
                if not response.is_success:
                    self._raise_for_status(_read_answer(response, self.url + path), path)
                # A server that ignored ?start= (an older one: no answer header) streams from
                # the head; those frames are checked at their places, then dropped.
                i = _streamed_from(response, start)
                if i is None:
                    return []  # a start this client did not ask for: no frame's place is known
                try:
                    for buf in iter_frames(response, max_frame_bytes=self._max_frame_bytes, take=take):
                        if i >= len(hashes):
                            break
                        try:
                            meta = parse_frame(buf, verify=True)
                            self.block_format.check_fetched(meta, hashes[i], i)
                        except FrameError as exc:
                            # Not a cut connection: a frame that came whole and is not this
                            # block in this configuration (a writer of other settings under
                            # the same keys, damage). It ended the prefix unsaid, lookups
                            # still counting it.
                            self._outages.bad_frame(hashes[i], exc)
                            raise
                        lease = leases[-1] if len(leases) > seen else None
                        seen = len(leases)
                        if i >= start:
                            frames.append(BlockFrame(meta, host=memoryview(buf).cast("B"), sealed=True, lease=lease))
                        i += 1
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    # The connection ended mid-body: the whole frames before it stand, and the
                    # cut is counted. Not a failure for the breaker (the server answered, and the
                    # part that came is used): a front that cuts every large answer opened it,
                    # and then refused the lookups and small loads it passes whole. A server
                    # gone for good fails the next call's connect, which the breaker counts.
                    self._outages.cut_answer(path, len(frames), exc)
                except (FrameError, BatchFormatError, BatchTooLarge, MemoryError):
                    pass  # a bad or oversized frame (or one no memory is left for) ends the prefix; the whole ones before it stand
        except httpx.TransportError as exc:
            # Before a body (no answer, or one that is not HTTP), as for any other call.
            raise self._unreached(exc, path) from None
        return frames

    def _request(self, method: str, path: str, *, json_answer: bool = False,
                 check: Callable[[Any], bool] | None = None, what: str = "", **kw: Any) -> Any:
        """The response; its JSON with ``json_answer`` (parsed under the breaker, as the
        answer's part), which ``check`` (if given) must pass, else it is not the server's
        answer (``what`` it should be)."""
        def call() -> Any:
            try:
                response = self._http.send(self._http.build_request(method, path, **kw), stream=True)
                response = _read_answer(response, self.url + path)
            except httpx.TransportError as exc:
                raise self._unreached(exc, path) from None
            self._raise_for_status(response, path)
            if not json_answer:
                return response
            found = _json_answer(response, self.url + path)
            if check is not None and not check(found):
                raise _foreign(found, what, response.status_code, self.url + path)
            return found

        return self._guarded(path, call)

    def _unreached(self, exc: httpx.TransportError, path: str) -> RemoteUnavailable:
        """The error of a request that got no answer. A wait for a pooled connection is this
        client's saturation (more calls at once than its pool), not the server's failure."""
        if isinstance(exc, httpx.PoolTimeout):
            return PoolExhausted(f"no connection of this client's pool came free in time: more calls at once than "
                                 f"max_connections ({self.max_connections}); not sent", url=self.url + path)
        if untrusted_certificate(exc):
            # Not an outage that passes: said with what to do, beside the reason.
            return RemoteUnavailable(f"the CacheSeek server's TLS certificate is not trusted: give verify= the CA "
                                     f"bundle that signed it (or an ssl.SSLContext): {exc!r}", url=self.url + path)
        if "use an https:// URL" in str(exc) or "use an http:// URL" in str(exc):
            # (this client's transport says so: a TLS server asked in plain http, or the reverse)
            # Not an outage that passes either: the URL is wrong.
            return RemoteUnavailable(f"the CacheSeek server's URL has the wrong scheme: {exc!r}", url=self.url + path)
        return RemoteUnavailable(f"cannot reach the CacheSeek server: {exc!r}", url=self.url + path)

    def _raise_for_status(self, response: httpx.Response, path: str) -> None:
        if response.is_success:
            return
        try:
            answer = response.json()
        except (ValueError, RecursionError):  # (JSON nested ~1000 deep: json gives up with RecursionError)
            answer = None
        # The server's JSON is {"error": reason, ...fields}; a front's may be anything (a string, a list).
        reason = ((answer.get("error") if isinstance(answer, dict) else None) or response.text[:REASON_CHARS]
                  or response.reason_phrase)
        fields = {k: v for k, v in answer.items() if k != "error"} if isinstance(answer, dict) else None
        # A busy server's 503, or a front's 429 (a rate limit before the server): both say
        # "later", about this request, not that the service is gone.
        if response.status_code == 429 or response.status_code == 503 and BUSY_HEADER in response.headers:
            raise RemoteBusy(str(reason), status=response.status_code, url=self.url + path, fields=fields)
        own = isinstance(answer, dict) and isinstance(answer.get("error"), str)
        if not own and (response.status_code in FRONT_OUTAGE_STATUSES or 500 <= response.status_code < 600) \
                and response.status_code not in OUTAGE_STATUSES:
            # Every error the server sends is its JSON {"error": ...}: another body (an
            # ingress's default 404 page, a proxy's 500 or 407) is a front's, not the service,
            # as a 2xx answer that is not JSON is. Raised as the error it was, a front's page
            # failed every call of a hot path under on_unavailable="miss", and never rested
            # the breaker. (502, 503, 504: outages whatever their body, in _guarded.) Its
            # reason is the page's text, as any error's not the server's JSON.
            raise RemoteUnavailable(str(reason), status=response.status_code, url=self.url + path, fields=fields)
        raise RemoteError(str(reason), status=response.status_code, url=self.url + path, fields=fields)


def _release(chains: list[list[BlockFrame]]) -> None:
    """Give back the read buffers of fetched frames (``RemoteCache._stream_chain``)."""
    for frames in chains:
        for frame in frames:
            frame.release()


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _json_answer(response: httpx.Response, url: str) -> Any:
    """A 2xx answer's JSON. One that is not JSON came from something other than the server
    (a front's maintenance page, say): no service, as far as a caller can tell."""
    try:
        return json.loads(response.content)
    except (ValueError, RecursionError):  # (JSON nested ~1000 deep: json gives up with RecursionError)
        raise RemoteUnavailable(f"the answer is not the CacheSeek server's (not JSON: {response.content[:60]!r})",
                                status=response.status_code, url=url) from None


def _read_answer(response: httpx.Response, url: str) -> httpx.Response:
    """``response`` with its body read: up to ``ANSWER_BYTES`` of a 2xx answer (JSON; a longer
    one is not the server's: ``RemoteUnavailable``) and ``ERROR_BODY_BYTES`` of an error
    (its reason; the rest goes with the connection). Read whole, the body of a peer that
    sends without end (a misdirected URL, a broken front) took the worker's memory."""
    cap = ANSWER_BYTES if response.is_success else ERROR_BODY_BYTES
    length = response.headers.get("content-length", "")
    declared = int(length) if length.isascii() and length.isdigit() else None
    body, too_long = bytearray(), declared is not None and declared > cap
    try:
        if declared is not None and declared <= cap:
            response.read()
            return response
        if not (too_long and response.is_success):  # an error's reason is read, however long its body
            for chunk in response.iter_bytes():
                body += chunk[: cap + 1 - len(body)]
                if len(body) > cap:
                    too_long = True
                    break
    except httpx.DecodingError as exc:
        # The server never compresses: a front's doing, and what it sends cannot be read.
        raise RemoteUnavailable(f"the answer is not the CacheSeek server's (its body does not decode as its "
                                f"Content-Encoding says: {exc})", status=response.status_code, url=url) from None
    finally:
        response.close()  # a body left unread: its connection is closed, not pooled
    if too_long and response.is_success:
        raise RemoteUnavailable(f"the answer is not the CacheSeek server's (longer than {cap} bytes)",
                                status=response.status_code, url=url)
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body[:cap]))


def _read_small(response: httpx.Response) -> None:
    """Read a streamed answer's body whole if it declares at most ``ERROR_BODY_BYTES``: a
    body left unread closes its kept-alive connection."""
    length = response.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) <= ERROR_BODY_BYTES:
        try:
            response.read()
        except (httpx.TransportError, httpx.DecodingError):
            pass  # the answer stands; only its connection is lost


def _streamed_from(response: httpx.Response, start: int) -> int | None:
    """The chain position a prefix's answer streams from: ``start`` if the server honoured
    it, 0 if it ignored it (no answer header), None if it names another."""
    honoured = response.headers.get(START_HEADER)
    if honoured is None:
        return 0
    return start if honoured == str(start) else None


def _is_lookup_answer(found: Any, asked: int, each: bool) -> bool:
    """Whether ``found`` answers a lookup of ``asked`` hashes. Its count slices the chain that
    is fetched and names the pages that are written, so one past the hashes asked about (or
    an answer of another shape: a front's JSON, a server out of step) is no service, as an
    answer that is not JSON is. So is a presence that is not one boolean per block: it
    decides which blocks are sent (a truthy ``"no"`` or ``1`` was a block never sent,
    reported present)."""
    if not isinstance(found, dict):
        return False
    matched, tiers = found.get("matched"), found.get("tiers")
    if not (type(matched) is int and 0 <= matched <= asked and isinstance(tiers, list) and len(tiers) == matched
            and all(isinstance(t, str) for t in tiers)):
        return False
    if not isinstance(found.get("durability", ""), str):  # (handed to the caller in IngestResult.durability)
        return False
    present = found.get("present")
    return not each or (isinstance(present, list) and len(present) == asked and set(map(type, present)) <= {bool})


def _is_put_report(report: Any) -> bool:
    """Whether ``report`` is one frame's entry in ``POST /v1/blocks``'s answer, as
    ``_count_report`` reads it: a status, and where given a durability and errors (tier ->
    reason) that are text, as the server writes them. Errors as a list raised AttributeError
    out of an ingest, past ``on_unavailable="miss"``."""
    if not isinstance(report, dict) or not isinstance(report.get("status"), str):
        return False
    errors = report.get("errors")
    if errors is not None and not (isinstance(errors, dict) and all(isinstance(r, str) for r in errors.values())):
        return False
    return isinstance(report.get("durability", ""), str)


def _is_prefetch_answer(found: Any) -> bool:
    """Whether ``found`` is ``POST /v1/prefetch``'s answer: started (and its counts), or not."""
    if not isinstance(found, dict) or not isinstance(found.get("started"), bool):
        return False
    counts = [found.get(name) for name in ("matched", "blocks", "joined")]
    return not found["started"] or all(type(n) is int and n >= 0 for n in counts)


def _foreign(answer: Any, expected: str, status: int, url: str) -> RemoteUnavailable:
    return RemoteUnavailable(f"the answer is not the CacheSeek server's (not {expected}: {json.dumps(answer)[:60]})",
                             status=status, url=url)


def _wire_bytes(frame: BlockFrame) -> int:
    """A frame's bytes in a batch body, its length prefix included."""
    return LENGTH.size + frame.meta.nbytes


def _count_report(result: IngestResult, report: dict[str, Any], copies: Sequence[IngestResult] = ()) -> None:
    """Count one frame's report into ``result``; ``copies``: the results of the other
    requests of the call that hold the block too (sent once): present in each if the
    server holds it now, failed if not."""
    status = report.get("status")
    if status == "stored":
        result.stored += 1
    elif status == "present":
        result.present += 1
    else:
        result.failed += 1
    for copy in copies:
        if status in ("stored", "present"):
            copy.present += 1
        else:
            copy.failed += 1
    for res in (result, *copies):
        res.durability = report.get("durability", res.durability)
        for tier, reason in (report.get("errors") or {}).items():
            res.errors.setdefault(tier, reason)


def lookup_request(hashes: Sequence[bytes], *, each: bool = False,
                   chains: Sequence[int] | None = None) -> tuple[str, bytes, dict[str, str]]:
    """``POST /v1/lookup`` as ``RemoteCache`` sends it (path, body, headers): the hashes as raw
    bytes end to end, which the server splits without parsing JSON or hex; ``chains``: they
    are several chains of these lengths, end to end."""
    query = []
    if hashes and len(hashes[0]) != 16:
        query.append(f"hash_bytes={len(hashes[0])}")
    if each:
        query.append("each=true")
    if chains is not None:
        query.append("chains=" + ",".join(map(str, chains)))
    path = "/v1/lookup" + ("?" + "&".join(query) if query else "")
    return path, b"".join(hashes), {"Content-Type": FRAME_CONTENT_TYPE}


__all__ = ["RemoteCache", "lookup_request"]
