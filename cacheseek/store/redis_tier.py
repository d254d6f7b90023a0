"""The ``redis`` tier: frames in Redis or Redis Cluster, shared by every process pointed at it.

Storage (key names in ``redis_keys``):
- Each frame is one string value, written by one ``SET`` (with ``PX`` when a TTL is set),
  so a reader never sees half a block. The frame's own header is the block's metadata
  (parent, position, sizes): :meth:`info` reads it with ``GETRANGE``, without the payload.
- Byte accounting and LRU order live in a shared index in Redis (``redis_index``), changed
  only by one atomic script, so every process sharing a namespace keeps one budget.

Round trips: a lookup of a whole chain is one pipelined ``EXISTS`` (grouped per master by
redis-py in a cluster), and so is a lookup of many (``TieredStore.locate_many``); a batch
put is three (STRLEN and each value's first bytes + index script; the SETs and the victims'
DELs; a check that the index still counts what was written); a save's question of which
blocks are stored (``present_many``) is one pipelined ``GETRANGE`` of each value's first bytes; a touch is one (index script, plus ``PEXPIRE`` and a look
at the pinned set when a TTL is set: a pin another process made meanwhile must not be left
to expire), two with a TTL in a cluster (the look waits for the expiries there); a read is
one pipelined ``GET`` (``GETRANGE`` under ``max_frame_bytes``), plus an index call when a
key is missing (to forget a ghost).

Faults: every redis-py error is caught here. A read that fails is a miss, a write that
fails raises ``StorageError`` (one result per frame in ``put_many``) and is counted as a
dropped write. A circuit breaker stops calls after repeated connection failures or
timeouts and lets a probe through after a backoff, so a Redis that is down costs each
request nothing, and service resumes on its own once a probe succeeds. A frame that
fails its checksum (or names another block, or is larger than ``max_frame_bytes``: a read
takes no more than one byte past it) is a miss, and it is deleted and counted. One of
another format version is a counted miss that is not deleted (another release sharing this
Redis reads it), and not stored for this release: its next save of the block writes over it.

TTL: a block expires ``ttl_seconds`` after its last use (write or hit), not after its
write: a touch refreshes it, so a chain in use keeps its head.
"""

from __future__ import annotations

import builtins
import importlib.util
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import ConfigError, FrameError, FrameVersionError, StorageError, TierUnavailable
from ..log_throttle import LogThrottle
from . import redis_memory
from .breaker import CLOSED, CircuitBreaker, Ticket
from .frame import (FORMAT_VERSION, MAX_HEADER_NBYTES, PREAMBLE, VERSION_PROBE_NBYTES, head_version, parse_frame,
                    parse_header)
from .redis_client import RedisTarget, RedisTimeouts, connect, parse_redis_url
from .redis_index import (CALL_REPLY_SECONDS, GEN_FENCE_SECONDS, PIN_LEASE_SECONDS, ForeignKey, IndexTotals, IndexUpdate,
                          SharedIndex, foreign_key, index_types, member_text, member_texts)
from .redis_keys import RedisKeys
from .tier import BlockFrame, BlockInfo, TierPutResult, Tier

T = TypeVar("T")

HEADER_PROBE_NBYTES = 4096  # first GETRANGE of info(): holds the whole header of any usual frame
# A read that finds no value forgets the index entry only once it has been idle this long:
# a put counts its block one round trip before its SET lands, and a batch of large frames
# can take seconds to send. Far longer than that, so that no write in flight loses its entry.
GHOST_GRACE_SECONDS = 60.0
# Redis refuses an expiry (PEXPIRE, SET PX) whose milliseconds, added to its clock, pass
# 2^63 - 1: past that every write failed ("value is not an integer or out of range"), and
# inf could not be made milliseconds at all. 2^62 ms is 146 million years.
MAX_TTL_SECONDS = (1 << 62) / 1000
# How often at most ``stats()`` reads the whole pinned set (this process's view of other
# processes' pins, which spares touches a PEXPIRE they would take back): 100k pins are 7 MB
# a read, and a metrics scrape calls stats() every few seconds. A stale view costs nothing
# but that PEXPIRE: a touch checks every expiry it sets against the pinned set.
PIN_REFRESH_SECONDS = 10.0
# How often at most a key of the index found holding another type is logged again: every
# call that needs the index meets it (each put, touch and read's ghost check) until it goes.
FOREIGN_LOG_SECONDS = 60.0
# How many blocks whose frame was found of another format version a process remembers (the
# oldest forgotten first): ~100 bytes each. One forgotten is found by a lookup again, until
# its next read or put finds it again.
OTHER_VERSION_REMEMBERED = 16384

log = logging.getLogger("cacheseek.store.redis")
CORRUPT_LOG_SECONDS = 60.0


class RedisUnavailable(TierUnavailable):
    """Redis did not answer (down, timed out, restarting), or the circuit breaker is open."""


class ForeignIndexKey(StorageError):
    """A key of the shared index holds a value of another type than the index keeps there
    (another app's, sharing the keyspace, or a SET by hand): every call that needs the index
    is refused, changing nothing, until it is gone. The key is never deleted here."""

    def __init__(self, message: str, found: ForeignKey) -> None:
        super().__init__(message)
        self.found = found


class RepairWouldEvict(StorageError):
    """``check(fix=True, evict=False)`` found the namespace holding more than this tier's
    budget: its repair (a call of the index script) would evict down to that budget."""

    def __init__(self, message: str, held_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.held_bytes = held_bytes
        self.budget_bytes = budget_bytes


def _fault_kind(exc: BaseException) -> str:
    """How a redis-py error counts. ``timeout`` and ``unavailable`` trip the breaker;
    ``rejected`` (Redis answered with an error: OOM under maxmemory, a wrong type) does not."""
    from redis.exceptions import (
        BusyLoadingError, ClusterDownError, ClusterError, ConnectionError, MasterDownError,
        RedisClusterException, ReadOnlyError, TimeoutError, TryAgainError,
    )

    if isinstance(exc, (TimeoutError, builtins.TimeoutError)):
        return "timeout"
    if isinstance(exc, OSError):
        return "unavailable"
    unavailable = (ConnectionError, BusyLoadingError, ClusterDownError, ClusterError, MasterDownError,
                   TryAgainError, ReadOnlyError, RedisClusterException)
    return "unavailable" if isinstance(exc, unavailable) else "rejected"


def _answered_unavailable(exc: BaseException) -> bool:
    """Whether Redis answered that it cannot serve this connection's calls now (a replica
    refusing writes, a server loading its data or without its master, a slot migrating)."""
    from redis.exceptions import BusyLoadingError, MasterDownError, ReadOnlyError, TryAgainError

    return isinstance(exc, (ReadOnlyError, BusyLoadingError, MasterDownError, TryAgainError))


def _redis_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


def _may_have_run(exc: BaseException) -> bool:
    """Whether a call cut short by ``exc`` may have run in Redis, or part of it: anything but
    an error Redis answered. An interrupt (KeyboardInterrupt) lands anywhere, as a lost
    connection does, so what such a fault would leave owed, it leaves owed too."""
    return not isinstance(exc, _redis_errors()) or _fault_kind(exc) != "rejected"


@dataclass(slots=True)
class _Faults:
    dropped_writes: int = 0
    read_errors: int = 0
    timeouts: int = 0
    unavailable: int = 0
    rejected: int = 0
    refused_by_breaker: int = 0
    foreign_index: int = 0  # calls refused for a key of the index holding another type
    foreign_index_key: str = ""  # the last such key found ("": none)
    foreign_logged: dict[str, float] = field(default_factory=dict)  # key -> when last logged
    last_error: str = ""


@dataclass(slots=True)
class _Batch:
    """One ``put_many`` in flight: the frames, their results, and which still go to Redis."""

    items: list[tuple[bytes, BlockFrame]]
    results: list[TierPutResult] = field(default_factory=list)
    todo: list[int] = field(default_factory=list)  # indexes still to send to Redis


class RedisTier(Tier):
    persistent = True
    index_in_memory = False  # lookups and touches are round trips: keep them off event loops

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        prefix: str = "cacheseek",
        namespace: str = "default",
        ttl_seconds: float | None = None,
        timeouts: RedisTimeouts | None = None,
        breaker: CircuitBreaker | None = None,
        client_retries: int = 1,
        pin_lease_seconds: float = PIN_LEASE_SECONDS,
        max_frame_bytes: int | None = None,
        name: str = "redis",
    ) -> None:
        """``max_frame_bytes``: the largest frame the tier's owner writes or reads (a cache's
        configuration makes frames of one size; a server takes none larger than its limit).
        A read takes at most one byte more of a value (``GETRANGE``): a larger one is damage,
        counted and deleted, found without taking it whole (up to Redis's 512 MB, each read).
        None: values are read whole (``GET``)."""
        super().__init__(name, capacity_bytes)
        if max_frame_bytes is not None and (isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int)
                                            or max_frame_bytes < PREAMBLE.size):
            raise ConfigError(f"redis max_frame_bytes: must be an int >= {PREAMBLE.size}, or None, "
                              f"got {max_frame_bytes!r}")
        self.max_frame_bytes = max_frame_bytes
        if not (isinstance(capacity_bytes, int) and capacity_bytes > 0):
            raise ConfigError(f"redis_bytes: must be > 0 bytes, got {capacity_bytes!r}")
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not 0 < ttl_seconds <= MAX_TTL_SECONDS):
            raise ConfigError(f"redis_ttl_seconds: must be > 0 and at most {MAX_TTL_SECONDS:.3g} seconds, or None, "
                              f"got {ttl_seconds!r}")
        if isinstance(pin_lease_seconds, bool) or not 0 < pin_lease_seconds <= MAX_TTL_SECONDS:
            raise ConfigError(f"redis pin_lease_seconds: must be > 0 seconds, got {pin_lease_seconds!r}")
        if not (isinstance(client_retries, int) and client_retries >= 0):
            raise ConfigError(f"redis client_retries: must be an int >= 0, got {client_retries!r}")
        self.target: RedisTarget = parse_redis_url(url)
        if importlib.util.find_spec("redis") is None:  # (else every call would raise ImportError)
            raise ConfigError("redis_url: the redis tier needs redis-py: pip install -e '.[redis]' in the checkout")
        self.keys_of = RedisKeys(prefix, namespace)
        self.ttl_seconds = ttl_seconds
        self._ttl_ms = None if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self.timeouts = timeouts if timeouts is not None else RedisTimeouts()
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._client_retries = client_retries
        self._index = SharedIndex(self.keys_of, capacity_bytes, 0 if self._ttl_ms is None else self._ttl_ms * 1000,
                                  generations=self.target.cluster,
                                  pin_lease_us=max(1, round(pin_lease_seconds * 1_000_000)))
        # This process's pins in Redis are its own (``owner``), under a lease renewed every
        # fifth of it while it holds any: another process's unpin leaves them, and they
        # outlive this process by one lease at most (see ``redis_index``).
        self.owner = os.urandom(12).hex()
        self.pin_lease_seconds = pin_lease_seconds
        self._own: set[bytes] = set()  # the blocks this process pins in Redis
        self._lease_stop = threading.Event()
        self._lease_keeper: threading.Thread | None = None
        self._client: Any = None
        self._connect_lock = threading.Lock()
        self._faults = _Faults()
        self._totals = IndexTotals()
        # Said in the log: an outage once as it starts and once as it ends (it was in the
        # counters alone), and values a read found bad (deleted) once a minute at most.
        self._outage_since: float | None = None
        self._corrupt_said = LogThrottle(CORRUPT_LOG_SECONDS)
        self._pinned: set[bytes] = set()  # pins known to this process (from Redis, with a TTL)
        self._pins_read_at = -PIN_REFRESH_SECONDS  # when _refresh_pins last read them
        # Unpins that could not reach Redis, sent again with the next call that can: left
        # there, such pins would hold the shared budget for good (no process remembers them).
        self._owed_unpins: set[bytes] = set()
        self._pinning = threading.RLock()  # one pin, unpin or owed unpin of this process at a time
        # Fenced deletes of frames the index has let go that a fault kept from Redis (the
        # connection lost between a script and its deletes): member -> (generation, when owed).
        # Left undone, such a frame stays stored and uncounted (an orphan, outside the budget).
        self._owed_drops: dict[str, tuple[int, float]] = {}
        # Blocks a call released (a lapsed lease's, an unpin's) whose frames' expiry could not
        # be given back then (the connection lost after the script ran): given back later, or
        # they would keep none, unpinned, until the TTL prune.
        self._owed_expiries: set[bytes] = set()
        # Puts' script calls whose reply a fault kept from us (Redis may have run them, and
        # evicted): call id -> when owed. Their replies are kept in Redis for a while; the
        # next call that reaches it asks for them, and deletes their victims.
        self._owed_replies: dict[str, float] = {}
        # Who owns a block this process counts anew (an opaque tag; "" for none), kept beside
        # its index entry (``RedisKeys.owners``) so that a flush by any process sharing this
        # Redis finds it (see ``owned``). Set by whoever knows owners (the server); it is
        # called with no lock of this tier held, and must be quick.
        self.owner_tag: Callable[[bytes], str] | None = None
        # Told the owner tags of the frames a read found, (key, tag) for each with one, before
        # they are handed on (promoted into a faster tier): where set, a read asks for them in
        # its round trip (one HMGET beside the frames'). A process that did not write a block
        # (another replica did, or this one before a restart) learns its owner so. Called with
        # no lock of this tier held; must be quick.
        # Called with (key, tag) of each, and (stored parent, tag) of those at position 0.
        self.tags_read: Callable[[list[tuple[bytes, str]], list[tuple[bytes, str]]], None] | None = None
        self.repair_evictions = 0  # blocks the last check(fix=True) evicted
        self._smaller_budget_said = 0  # the last smaller budget of another process logged
        # Blocks whose frame a read (or a put's look at its first bytes) found of another format
        # version (another release's, in a rolling upgrade or after a rollback), oldest first. Not stored, for this release: a
        # lookup does not find them, a touch leaves them, and a put writes its own frame over
        # them. Taken as stored, every save of a prefix in use touched them in the shared LRU
        # and wrote none of its own, so they never aged out, and the prefix missed for good.
        self._other_version: OrderedDict[bytes, None] = OrderedDict()

    # -- the one way to talk to Redis ----------------------------------------------------

    def _connection(self) -> Any:
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    self._client = connect(self.target, self.timeouts, retries=self._client_retries)
                client = self._client
        return client

    def _run(self, op: Callable[[Any], T]) -> T:
        """Run ``op(client)`` behind the breaker. Raises ``RedisUnavailable`` (breaker open,
        connection failure, timeout) or ``StorageError`` (Redis answered with an error)."""
        ticket = self.breaker.allow_call()
        if ticket is None:
            with self._lock:
                self._faults.refused_by_breaker += 1
            raise RedisUnavailable(f"{self.name} tier: circuit open after repeated failures "
                                   f"(last: {self._faults.last_error or 'none'})")
        try:
            result = op(self._connection())
        except _redis_errors() as exc:
            raise self._failed(exc, ticket) from None
        except BaseException:
            # Not Redis's error (an interrupt, or a bug here): no news of its health. Counted
            # as a failure, three KeyboardInterrupts opened the breaker on a healthy Redis,
            # with no fault counted or logged. (A probe's turn goes to the next call.)
            self.breaker.record_unsent(ticket)
            raise
        self.breaker.record_success(ticket)
        if self._outage_since is not None:
            self._outage_ended()
        return result

    def _outage_began(self, text: str) -> None:
        with self._lock:
            if self._outage_since is not None or self.breaker.state == CLOSED:
                return
            self._outage_since = time.monotonic()
        log.warning("%s tier: Redis at %s cannot be reached (%s): its calls are refused at once while the circuit "
                    "breaker is open, and tried again after a backoff; reads there miss, writes that need it fail",
                    self.name, self.target.redacted(), text)

    def _outage_ended(self) -> None:
        with self._lock:
            since, self._outage_since = self._outage_since, None
        if since is not None:
            log.warning("%s tier: Redis at %s answers again, after %.1f s", self.name, self.target.redacted(),
                        time.monotonic() - since)

    def _failed(self, exc: BaseException, ticket: Ticket | None = None) -> StorageError:
        found = foreign_key(exc)
        if found is None and "WRONGTYPE" in str(exc):
            found = self._find_foreign_key()  # (a command of ours, not a script: which key, unsaid)
        if found is not None:
            return self._foreign(found, ticket)
        kind = _fault_kind(exc)
        text = f"{type(exc).__name__}: {exc}"[:300]
        with self._lock:
            self._faults.last_error = text
            if kind == "timeout":
                self._faults.timeouts += 1
            elif kind == "unavailable":
                self._faults.unavailable += 1
            else:
                self._faults.rejected += 1
        if kind == "rejected":
            self.breaker.record_success(ticket)  # Redis is there; it refused this one command
            return StorageError(f"{self.name} tier: Redis refused: {text}")
        if _answered_unavailable(exc):
            self._drop_idle_connections()
        self.breaker.record_failure(ticket)
        self._outage_began(text)
        return RedisUnavailable(f"{self.name} tier: {text}")

    def _drop_idle_connections(self) -> None:
        """Close the pooled connections no call is using, so that the next call (a breaker
        probe) opens a new one, and resolves the URL's host again. A Redis that answers
        READONLY, LOADING, MASTERDOWN or TRYAGAIN keeps the connection open: after a failover
        behind one name (DNS, a Kubernetes Service) every pooled connection still led to the
        demoted master, each probe reused one, and the tier never wrote again. Connections in
        use are left to their calls (a read there still works); one that fails so drops the rest."""
        pool = getattr(self._client, "connection_pool", None)  # (a cluster client keeps none: it reroutes itself)
        if pool is not None:
            try:
                pool.disconnect(inuse_connections=False)
            except Exception:  # (closing a socket whose peer is gone must not hide the fault)
                pass

    def _find_foreign_key(self) -> ForeignKey | None:
        """The first key of the index (of those with fixed names) holding another type than
        it keeps there, asked after a plain command of ours met WRONGTYPE (a frame's name
        under another type, which reads handle per key, can meet it too: then None)."""
        wanted = index_types(self.keys_of)
        try:
            pipe = self._connection().pipeline(transaction=False)  # (one slot: the index's)
            for key in wanted:
                pipe.type(key)
            kinds = pipe.execute()
        except _redis_errors():
            return None
        for (key, want), kind in zip(wanted.items(), kinds):
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in ("none", want):
                return ForeignKey(key, kind, want)
        return None

    def _foreign(self, found: ForeignKey, ticket: Ticket | None = None) -> ForeignIndexKey:
        """The error for a call refused for a key of the index holding another type: counted,
        and logged once a ``FOREIGN_LOG_SECONDS`` per key (every call meets it)."""
        message = (f"{self.name} tier: the Redis key {found.key} holds a {found.kind}, where this store keeps its "
                   f"shared index (a {found.want}): another app or tool wrote it there. It is left alone, and "
                   f"nothing is stored, evicted or marked used through the index until it is gone (stored blocks "
                   f"are still served). If it is not another app's data, delete it (redis-cli DEL '{found.key}') "
                   f"and run `cacheseek redis-check --fix`; if it is, give this store a redis_prefix or "
                   f"redis_namespace of its own")
        now = time.monotonic()
        with self._lock:
            faults = self._faults
            faults.foreign_index += 1
            faults.foreign_index_key = found.key
            faults.rejected += 1
            faults.last_error = message[:300]
            last = faults.foreign_logged.get(found.key)
            due = last is None or now - last >= FOREIGN_LOG_SECONDS
            if due:
                faults.foreign_logged[found.key] = now
        self.breaker.record_success(ticket)  # Redis is there; it holds data of another kind
        if due:
            log.error("%s", message)
        return ForeignIndexKey(message, found)

    def _raise_unavailable(self, replies: Sequence[Any]) -> None:
        """Cluster pipelines hand back connection errors in place: raise the first."""
        for reply in replies:
            if isinstance(reply, BaseException) and _fault_kind(reply) != "rejected":
                raise reply

    # -- writes --------------------------------------------------------------------------

    def put(self, key: bytes, frame: BlockFrame) -> TierPutResult:
        result = self.put_many([(key, frame)])[0]
        if result.error is not None:
            raise result.error
        return result

    def put_many(self, items: list[tuple[bytes, BlockFrame]], *, lease_stored: bool = False,
                 room_for: int = 0, spare: Container[bytes] = ()) -> list[TierPutResult]:
        """Store several frames: three round trips for the batch. A frame that cannot be
        stored gets ``error`` set; with Redis unreachable, every frame does, at once.
        (``spare``: ignored; Redis chooses its own victims.)"""
        batch = _Batch(items=list(items), results=[TierPutResult(stored=None) for _ in items])
        for i, (key, frame) in enumerate(batch.items):
            if frame.nbytes > self.capacity_bytes:
                batch.results[i].error = StorageError(
                    f"{self.name} tier: a {frame.nbytes}-byte frame exceeds the budget ({self.capacity_bytes})")
            else:
                batch.todo.append(i)
        if batch.todo:
            try:
                self._run(lambda c: self._write(c, batch))
            except StorageError as exc:
                dropped = [r for i in batch.todo if (r := batch.results[i]).error is None and r.stored is None]
                for result in dropped:
                    result.error = exc
                with self._lock:
                    self._faults.dropped_writes += len(dropped)
            else:
                self._pay_owed_unpins()  # (Redis answers again: what an outage left owed)
                self._pay_owed_replies()
                self._pay_owed_drops()
                self._pay_owed_expiries()
        with self._lock:
            self._stats.write_errors += sum(1 for r in batch.results if r.error is not None)
        return batch.results

    def _write(self, client: Any, batch: _Batch) -> None:
        keys, members = self.keys_of, [RedisKeys.member(batch.items[i][0]) for i in batch.todo]
        # Round trip 1: which frames exist, and count the new ones in the shared index
        # (index first: an interrupted write leaves a ghost, never an uncounted frame).
        # A value is "there" only at its frame's length and of this format version: a
        # truncated value, a key of another type under the frame's name (an error reply), or
        # another release's frame (whose length is often this one's: headers are padded) is
        # written over. The version is read from the value's first bytes (``head_version``),
        # for a frame this process never read too: one more small command a frame.
        pipe = client.pipeline(transaction=False)
        for i in batch.todo:
            pipe.strlen(keys.frame(batch.items[i][0]))
            self._queue_probe(pipe, keys.frame(batch.items[i][0]))
        call = SharedIndex.new_call()
        tag = self.owner_tag
        self._index.queue(pipe, add=[(m, batch.items[i][1].nbytes, batch.items[i][1].meta.raw_nbytes,
                                      tag(batch.items[i][0]) if tag is not None else "")
                                     for m, i in zip(members, batch.todo)], call=call)
        try:
            replies = pipe.execute(raise_on_error=False)
            self._raise_unavailable(replies)
            if isinstance(replies[-1], BaseException):
                raise replies[-1]
            # (Within the try: an interrupt once the script has answered, before its victims
            # are settled below, owes its reply, which Redis keeps, as a lost one does; it
            # left them stored and counted nowhere.)
            exists = [type(n) is int and n == batch.items[i][1].nbytes and self._this_version(batch.items[i][0], head)
                      for i, n, head in zip(batch.todo, replies[:-1:2], replies[1:-1:2])]
            update = SharedIndex.parse(replies[-1])
            self._note_totals(update.totals)
            self.count(evictions=len(update.evicted))  # (done in the index now, whatever fails next)
        except BaseException as exc:
            if _may_have_run(exc):  # (it may have run, and evicted)
                with self._lock:
                    self._owed_replies[call] = time.monotonic()
            raise
        # Blocks a lapsed lease let go get their frames' expiry back before the SETs: the call
        # listed them once, and a fault in the round trips below would leave those frames
        # without one for good. (Victims are dealt with below; a put renews no lease.)
        try:
            self._settle(client, update, victims=False)
        except BaseException as exc:
            self._owe_drops(list(update.evicted) + list(update.expired), update.gens, exc)
            raise
        evicted_now, expired_now = set(update.evicted), set(update.expired)
        # Round trip 2: the victims' frames read (if demotion wants them) and deleted, then the
        # SETs. Deletes first, so they land as soon after the script as they can: another
        # process that counts one of them again meanwhile writes it after our DEL, not before.
        pipe = client.pipeline(transaction=False)
        own = set(members)
        victims = [m for m in update.evicted if m not in own]  # other blocks this batch pushed out
        n_get = len(victims) if self.demote_evicted else 0
        for m in victims[:n_get]:
            self._queue_read(pipe, keys.frame_of_member(m))
        sets: list[int] = []
        sent: set[str] = set()
        refresh: list[str] = []  # present, unpinned: a write restarts their expiry
        with_px: list[str] = []  # written with an expiry (unpinned when the index was asked)
        for i, member, present, status in zip(batch.todo, members, exists, update.added):
            key, frame = batch.items[i]
            result = batch.results[i]
            if status == -2:
                t = update.totals
                result.error = StorageError(
                    f"{self.name} tier: no room for a {frame.nbytes}-byte frame: {t.pinned_bytes} of "
                    f"{self.capacity_bytes} bytes are pinned ({t.pinned_blocks} blocks), and pinned blocks are never evicted")
            elif status < 0:  # raced with a smaller budget in another process
                result.error = StorageError(f"{self.name} tier: a {frame.nbytes}-byte frame exceeds the shared budget")
            elif present and member not in expired_now and status in (0, 3):
                # stored=None: already there (now touched). One counted anew is written all
                # the same: it was stored uncounted, so very likely another process's victim
                # whose DEL is on its way (or pruned as expired here: about to go).
                if self._ttl_ms is not None and status in (0, 1) and member not in evicted_now:
                    refresh.append(member)
            elif member in evicted_now:
                # The batch alone overflows the budget: this frame would be evicted by the
                # later ones at once, so it is not sent (stored, then evicted, in effect).
                result.stored = frame
                result.evicted.append((key, frame if self.demote_evicted else None))
            else:
                sets.append(i)
                sent.add(member)
                if self._ttl_ms is not None and status not in (2, 3):
                    with_px.append(member)
        # Every evicted or expired block's frame goes, ours included (one may have been there
        # already), except those about to be written: they are counted again.
        dels = [m for m in list(update.evicted) + list(update.expired) if m not in sent]
        n_del = self._queue_drop(pipe, dels, update.gens)
        status_of = dict(zip(batch.todo, update.added))
        n_gen = self._queue_gens(pipe, [RedisKeys.member(batch.items[i][0]) for i in sets], update.gens)
        for i in sets:
            self._queue_set(pipe, batch, i, status_of[i])
        for m in refresh:  # last: the replies above are read by position
            pipe.pexpire(keys.frame_of_member(m), self._ttl_ms)
        try:
            replies = pipe.execute(raise_on_error=False) if len(pipe) else []
            self._raise_unavailable(replies)
        except BaseException as exc:
            self._owe_drops(dels, update.gens, exc)
            raise
        datas = [self._value(r) for r in replies[:n_get]] if n_get else [None] * len(victims)
        replies = replies[n_get + n_del + n_gen :]
        refused = []
        for i, reply in zip(sets, replies):
            key, frame = batch.items[i]
            if isinstance(reply, BaseException):
                batch.results[i].error = self._failed(reply)
                refused.append(RedisKeys.member(key))
            else:
                batch.results[i].stored = frame
                with self._lock:
                    self._stats.bytes_in += frame.nbytes
                    self._stats.admissions += 1
        written = [i for i in sets if batch.results[i].stored is not None]
        self._forget_other_version([batch.items[i][0] for i in written])
        names = [RedisKeys.member(batch.items[i][0]) for i in written]
        landed = set(names)
        expiring = [m for m in with_px if m in landed] + refresh
        if written or expiring:
            # Round trip 3: another process may have evicted one of these blocks between our
            # index add and our SET, and sent its DEL before our SET landed. Delete what the
            # index no longer counts: at worst this leaves a ghost, never an uncounted frame.
            # And one whose value is gone though the index counts it: another process's DEL of
            # it as a victim, sent before we counted it again, landed after our SET. It is
            # written once more. (Such DELs are fenced and cannot do this, unless they land
            # more than GEN_FENCE_SECONDS after their eviction in a cluster.)
            # The sizes hash counts every block; the LRU zset leaves out pinned ones, and a
            # block may have been pinned since our add: its frame's expiry is taken off again.
            pipe = client.pipeline(transaction=False)
            if written:
                pipe.hmget(keys.sizes, names)
            for m in expiring:  # (SISMEMBER each, not SMISMEMBER: Redis before 6.2 has none)
                pipe.sismember(keys.pinned, m)
            for m in names:
                pipe.exists(keys.frame_of_member(m))
            checks = pipe.execute()
            sizes = checks[0] if written else []
            found = checks[len(checks) - len(names):] if names else []
            pins = checks[1 if written else 0 : len(checks) - len(names)]
            gone = [m for m, size in zip(names, sizes) if size is None]
            if gone:
                self._drop(client, gone, update.gens)
            lost = [i for i, m, size, n in zip(written, names, sizes, found) if size is not None and not n]
            if lost:
                for i in lost:  # not stored until written again (a fault here fails them)
                    batch.results[i].stored = None
                pipe = client.pipeline(transaction=False)
                n_gen = self._queue_gens(pipe, [RedisKeys.member(batch.items[i][0]) for i in lost], update.gens)
                for i in lost:
                    self._queue_set(pipe, batch, i, status_of[i])
                again = pipe.execute(raise_on_error=False)
                self._raise_unavailable(again)
                for i, reply in zip(lost, again[n_gen:]):
                    if isinstance(reply, BaseException):  # (refused: OOM) a ghost now, not stored
                        batch.results[i].error = self._failed(reply)
                    else:
                        batch.results[i].stored = batch.items[i][1]
            if expiring:
                self._persist_pinned(client, expiring, pins)
        # Victims go with the first frame's result; their frames only if demotion wants them.
        batch.results[batch.todo[0]].evicted += [
            (victim, self._decode(victim, data, drop_corrupt=False))
            for m, data in zip(victims, datas) if (victim := RedisKeys.key(m)) is not None
        ]
        with self._lock:
            self._faults.dropped_writes += len(refused)
        if refused:  # Redis refused those SETs (OOM): uncount them now rather than leave ghosts
            self._settle(client, SharedIndex.parse(self._index.queue(client, forget=refused)))
            # and drop what such a SET would have replaced (a block the index had let expire
            # keeps its old value until its own PX): no value is left uncounted. (DEL runs
            # under maxmemory.)
            self._drop(client, refused, update.gens)

    def _queue_drop(self, pipe: Any, members: Sequence[str], gens: Mapping[str, int]) -> int:
        """Queue the deletes of the frames of blocks the index has let go (evicted, expired,
        forgotten); returns how many replies they add. Fenced, so that another process that
        counted a block again since keeps what it wrote, however late this lands. On one
        Redis a frame goes only while the index does not count its block (one script holds
        both). In a cluster (frames and index on different masters) a frame goes only while
        the generation stored beside it is no newer than the one the index let go
        (``gens``: an ``IndexUpdate``'s)."""
        if not members:
            return 0
        if self.target.cluster:
            for m in members:
                self._index.queue_drop_stale(pipe, m, gens[m])
            return len(members)
        self._index.queue_drop_uncounted(pipe, members)
        return 1

    def _drop(self, client: Any, members: Sequence[str], gens: Mapping[str, int]) -> None:
        if members:
            pipe = client.pipeline(transaction=False)
            self._queue_drop(pipe, members, gens)
            try:
                pipe.execute()
            except BaseException as exc:
                self._owe_drops(members, gens, exc)
                raise

    def _owe_drops(self, members: Sequence[str], gens: Mapping[str, int], exc: BaseException) -> None:
        """Remember the deletes of ``members`` that a connection failure, a timeout or an
        interrupt may have kept from Redis (landed or not: a fenced delete sent twice takes nothing)."""
        if members and _may_have_run(exc):
            now = time.monotonic()
            with self._lock:
                for m in members:
                    self._owed_drops.setdefault(m, (gens.get(m, 0), now))

    def _pay_owed_replies(self) -> None:
        """Ask for the replies of puts' script calls a fault kept from us, and delete their
        victims (fenced: a block counted again since keeps its frame). A reply Redis kept
        no longer (``CALL_REPLY_SECONDS``) is not asked for; the call's victims stay orphans."""
        if not self._owed_replies:
            return
        with self._lock:
            owed, self._owed_replies = self._owed_replies, {}
        now = time.monotonic()
        todo = [call for call, since in owed.items() if now - since < CALL_REPLY_SECONDS]

        def send(c: Any) -> None:
            while todo:
                update = self._index.replay(c, todo[0])
                todo.pop(0)  # (asked: its deletes, if they fail now, are owed)
                if update is not None:
                    self._settle(c, update)

        try:
            self._run(send)
        except RedisUnavailable:
            self._owe_replies_again(todo, owed)
        except StorageError:
            pass  # (Redis refused: counted; asking again would not help)
        except BaseException:
            # Interrupted (KeyboardInterrupt): taken out of what is owed above, the calls not
            # yet asked for were forgotten, and their victims left stored, counted nowhere.
            self._owe_replies_again(todo, owed)
            raise

    def _owe_replies_again(self, calls: Sequence[str], owed: Mapping[str, float]) -> None:
        with self._lock:
            for call in calls:
                self._owed_replies.setdefault(call, owed[call])

    def _pay_owed_drops(self) -> None:
        if not self._owed_drops:
            return
        with self._lock:
            owed, self._owed_drops = self._owed_drops, {}
        if self.target.cluster:
            # A generation key expires GEN_FENCE_SECONDS after its write: a delete sent later
            # than that after its eviction could take a block counted and written again since.
            now = time.monotonic()
            owed = {m: v for m, v in owed.items() if now - v[1] < GEN_FENCE_SECONDS / 2}
        if not owed:
            return

        def send(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            self._queue_drop(pipe, list(owed), {m: gen for m, (gen, _) in owed.items()})
            pipe.execute()

        try:
            self._run(send)
        except RedisUnavailable:
            self._owe_drops_again(owed)
        except StorageError:
            pass  # (Redis refused them: counted; sending them again would not help)
        except BaseException:
            self._owe_drops_again(owed)  # (interrupted: sent or not, a fenced delete sent twice takes nothing)
            raise

    def _owe_drops_again(self, owed: Mapping[str, tuple[int, float]]) -> None:
        with self._lock:
            for m, entry in owed.items():
                self._owed_drops.setdefault(m, entry)

    def _mark_adopted(self, client: Any, members: Sequence[str], update: IndexUpdate) -> None:
        """In a cluster, give orphans the index just counted again their new generation, so
        that the late delete of the eviction that orphaned them (if it is only late) is
        fenced off from here on."""
        adopted = [m for m, status in zip(members, update.added) if status in (1, 2) and m not in update.evicted]
        if self.target.cluster and adopted:
            pipe = client.pipeline(transaction=False)
            self._queue_gens(pipe, adopted, update.gens)
            pipe.execute()

    def _queue_gens(self, pipe: Any, members: Sequence[str], gens: Mapping[str, int]) -> int:
        """In a cluster, queue the generation keys of frames about to be written (before
        their SETs: a fenced delete landing between the two then keeps the old value, which
        the SET replaces); returns how many replies they add. On one Redis, none."""
        if not self.target.cluster:
            return 0
        for m in members:
            pipe.set(self.keys_of.gen_of_member(m), gens[m], px=GEN_FENCE_SECONDS * 1000)
        return len(members)

    def _queue_set(self, pipe: Any, batch: _Batch, i: int, status: int) -> None:
        key, frame = batch.items[i]
        segments = frame.wire_segments()  # seals the frame if it is not yet
        value = segments[0] if len(segments) == 1 else b"".join(segments)  # one SET, one value
        pipe.set(self.keys_of.frame(key), value, px=None if status in (2, 3) else self._ttl_ms)

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: bytes) -> BlockFrame | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[BlockFrame | None]:
        """Frames for ``keys`` in one pipelined round trip; a miss (or a fault) is None."""
        if not keys:
            return []
        start = time.perf_counter()
        told = self.tags_read
        members = [RedisKeys.member(k) for k in keys] if told is not None else []
        try:
            datas, tags = self._run(lambda c: self._read_values(c, [self.keys_of.frame(k) for k in keys], members))
        except StorageError:
            with self._lock:
                self._faults.read_errors += 1
                self._stats.misses += len(keys)
            return [None] * len(keys)
        elapsed = time.perf_counter() - start
        # An error reply for one key is that block's miss alone; a value of another type under
        # a frame's name (WRONGTYPE) goes, as a corrupt frame does.
        out = [None if data is None else self._decode(key, data, drop_corrupt=True) for key, data in zip(keys, datas)]
        hits = [f for f in out if f is not None]
        with self._lock:
            self._stats.hits += len(hits)
            self._stats.misses += len(out) - len(hits)
            self._stats.bytes_out += sum(f.nbytes for f in hits)
            self._stats.read_seconds += elapsed
        absent = [key for key, data in zip(keys, datas) if data is None]
        if absent:
            self._repair_ghosts(absent)
        if told is not None and tags:
            found: list[tuple[bytes, str]] = []
            heads: list[tuple[bytes, str]] = []
            for key, frame, tag in zip(keys, out, tags):
                if frame is not None and tag and (text := member_text(tag)):
                    found.append((key, text))
                    if frame.meta.position == 0:
                        heads.append((frame.meta.parent_hash, text))
            if found:
                told(found, heads)
        return out

    def _queue_read(self, pipe: Any, name: str) -> None:
        """Queue the read of a frame's value: whole (``GET``), or, under ``max_frame_bytes``,
        its first ``max_frame_bytes + 1`` bytes (``GETRANGE``: as cheap as a ``GET`` on
        loopback, one command a key still), so that a larger value is known for what it is
        without being taken whole. ``_value`` reads the reply."""
        if self.max_frame_bytes is None:
            pipe.get(name)
        else:
            pipe.getrange(name, 0, self.max_frame_bytes)

    def _value(self, reply: Any) -> Any:
        """A ``_queue_read`` reply as a ``GET``'s: ``GETRANGE`` answers an empty string for a
        key that is not there (no frame is empty)."""
        return None if self.max_frame_bytes is not None and reply == b"" else reply

    def _read_values(self, client: Any, names: Sequence[str], members: Sequence[str] = ()
                     ) -> tuple[list[Any], list[Any]]:
        """The values of frames ``names`` (``_queue_read``), one round trip; an error Redis
        answers for one key comes back in its place (a connection error still raises). With
        ``members`` (the same blocks'), their owner tags too, in the same round trip ([]
        where Redis answered an error for them, whatever the error: the blocks are read all
        the same; the one hash of tags is on one node, whose slot moving or going down failed
        every read, frames and all)."""
        pipe = client.pipeline(transaction=False)
        if members:
            # Before the frames: a delete takes the frame first and its tag after, so a read
            # that finds the frame found its tag too (read after, it could find the frame and
            # not the tag, and the block was promoted nobody's, which a flush passed by).
            pipe.hmget(self.keys_of.owners, list(members))
        for name in names:
            self._queue_read(pipe, name)
        replies = pipe.execute(raise_on_error=False)
        tags: list[Any] = []
        if members:
            got = replies.pop(0)
            tags = got if isinstance(got, list) else []
        self._raise_unavailable(replies)
        empty = [i for i, r in enumerate(replies) if r == b""] if self.max_frame_bytes is not None else []
        if empty:
            # GETRANGE answers the same for a missing key and an empty value: ask which, on
            # this miss path only. An empty value is damage (corrupt, removed, as a GET found
            # it), not a ghost to leave in place.
            pipe = client.pipeline(transaction=False)
            for i in empty:
                pipe.exists(names[i])
            found = pipe.execute(raise_on_error=False)
            self._raise_unavailable(found)
            there = {i for i, n in zip(empty, found) if n == 1}
            return [r if i in there else self._value(r) for i, r in enumerate(replies)], tags
        return [self._value(r) for r in replies], tags

    def _repair_ghosts(self, keys: Sequence[bytes]) -> None:
        """Forget the index entries of blocks a read found without a value (expired, or
        dropped by Redis under ``maxmemory``), so that they stop holding budget. Only entries
        idle for ``GHOST_GRACE_SECONDS`` and unpinned go (see the index script). One round
        trip, more only when one is forgotten; a failure is ignored (a ghost is safe, only
        wasteful)."""
        def send(c: Any) -> None:
            update = SharedIndex.parse(self._index.queue(
                c, repair=[RedisKeys.member(k) for k in keys], repair_idle_us=round(GHOST_GRACE_SECONDS * 1e6)))
            self._settle(c, update)
            if not update.repaired:
                return
            # A write stalled past the grace may have landed its SET (and found its block
            # counted) since our GET: count such a frame again rather than leave it an orphan.
            found = self._pipelined(c, "exists", [self.keys_of.frame_of_member(m) for m, _, _ in update.repaired])
            back = [entry for entry, n in zip(update.repaired, found) if n]
            if back:
                self._settle(c, SharedIndex.parse(self._index.queue(c, add=back)))

        try:
            self._run(send)
        except StorageError:
            pass

    def _decode(self, key: bytes, data: Any, *, drop_corrupt: bool = True) -> BlockFrame | None:
        """Parse and verify a frame read from Redis; a bad one (or an error reply in its
        place) is counted (and deleted). One of another format version is counted
        (``foreign_version``) and kept: another release sharing this Redis reads it."""
        if data is None:
            return None
        if isinstance(data, BaseException) and not str(data).startswith("WRONGTYPE"):
            # (BUSY with another client's script, OOM...: says nothing of the value, kept)
            with self._lock:
                self._faults.read_errors += 1
                self._faults.last_error = f"{type(data).__name__}: {data}"[:300]
            return None
        try:
            if isinstance(data, BaseException):  # a key of another type under the frame's name
                raise FrameError(f"Redis answered {type(data).__name__}: {str(data)[:80]}")
            if self.max_frame_bytes is not None and len(data) > self.max_frame_bytes:
                raise FrameError(f"the value is larger than any frame read here ({self.max_frame_bytes} bytes)")
            meta = parse_frame(data, verify=True)
            if meta.block_hash != key:
                raise FrameError("frame header names another block")
        except FrameVersionError:
            # Not this release's to judge: neither served, nor deleted as damage (its writer
            # counted it in the shared index, whose LRU evicts it as any block, unless used).
            # Remembered: not stored, for this release (``_other_version``).
            self.count(foreign_version=1)
            self._remember_other_version(key)
            return None
        except FrameError:
            if not drop_corrupt:
                self.count(corrupt=1)
            elif isinstance(data, BaseException):
                self._drop_corrupt(key, -1, b"")
            elif self.max_frame_bytes is not None and len(data) > self.max_frame_bytes:
                # (read in part: fenced by its least length and its first bytes, not sent back whole)
                self._drop_corrupt(key, len(data), bytes(data[:HEADER_PROBE_NBYTES]), at_least=True)
            else:
                self._drop_corrupt(key, len(data), data)
            return None
        # (this release's frame now, another process's write over the one remembered: its
        # touches go on, else its hits here left its place in the shared LRU as it was)
        self._forget_other_version([key])
        return BlockFrame(meta, host=memoryview(data), sealed=True)

    def _drop_corrupt(self, key: bytes, length: int, head: bytes, *, at_least: bool = False) -> None:
        """Count a value a read found bad, delete it and forget its block. Fenced: another
        process may have put the block since the read (written over, acknowledged), so only
        the value found bad goes (``length``, -1 for a key of another type, or with
        ``at_least`` the least length of one read in part, and its first bytes ``head`` as
        read), and the index forgets the block only if that value went."""
        with self._lock:
            self._stats.corrupt += 1
        if count := self._corrupt_said.due():
            why = (f"larger than the largest frame read here, {self.max_frame_bytes} bytes: a server sharing this "
                   "Redis with a larger max_frame_bytes may have written it; give every one the same"
                   ) if at_least else "a checksum, length or header that does not check, or a key of another type"
            log.warning("%s tier: %d value%s found bad and deleted (the last: block %s, %s); `corrupt` counts "
                        "them, this line comes once a minute at most", self.name, count, "" if count == 1 else "s",
                        key.hex(), why)
        member = RedisKeys.member(key)

        def drop(c: Any) -> None:
            if self._index.drop_found(c, member, length, head, at_least=at_least):
                self._settle(c, SharedIndex.parse(self._index.queue(c, forget=[member])))

        try:
            self._run(drop)
        except StorageError:
            pass  # counted; the bad value is found (and dropped) again on the next read

    def _pipelined(self, client: Any, command: str, keys: Sequence[str], *, per_key_errors: bool = False
                   ) -> list[Any]:
        """``command`` on each key, one round trip. ``per_key_errors``: an error Redis answers
        for one key comes back in its place (a connection error still raises)."""
        pipe = client.pipeline(transaction=False)
        for k in keys:
            getattr(pipe, command)(k)
        if not per_key_errors:
            return pipe.execute()
        replies = pipe.execute(raise_on_error=False)
        self._raise_unavailable(replies)
        return replies

    def _persist_pinned(self, client: Any, members: Sequence[str], flags: Sequence[Any] | None = None) -> list[str]:
        """Take the expiry off the frames of ``members`` that are pinned now, and return those
        (``flags``: their membership of the pinned set, asked after their expiry was set; else
        asked here).
        A pin is a ``SADD`` to the index's pinned set, then a ``PERSIST`` of the frame, two
        slots no script can hold together in a cluster: a ``PX`` or ``PEXPIRE`` sent on an
        older look at the index can land after another process's ``PERSIST``. Asked after
        the expiry has landed, this sees every pin whose ``PERSIST`` it could have undone;
        a later pin's own ``PERSIST`` comes after its ``SADD``, so after the expiry too."""
        if not members:
            return []
        if flags is None:
            pipe = client.pipeline(transaction=False)  # (one slot: the index's)
            for m in members:
                pipe.sismember(self.keys_of.pinned, m)
            flags = pipe.execute()
        pinned = [m for m, flag in zip(members, flags) if int(flag)]
        if pinned:
            self._pipelined(client, "persist", [self.keys_of.frame_of_member(m) for m in pinned])
        return pinned

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined ``EXISTS`` per key, in one round trip (per master, in a cluster). A
        block a read found of another format version (``_other_version``) is asked its value's
        first bytes instead (``GETRANGE``): held only once this release's frame is there."""
        if not keys:
            return []
        with self._lock:
            foreign = [k in self._other_version for k in keys] if self._other_version else [False] * len(keys)

        def ask(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k, theirs in zip(keys, foreign):
                if theirs:
                    self._queue_probe(pipe, self.keys_of.frame(k))
                else:
                    pipe.exists(self.keys_of.frame(k))
            replies = pipe.execute(raise_on_error=False)
            self._raise_unavailable(replies)
            for reply, theirs in zip(replies, foreign):
                if isinstance(reply, BaseException) and not theirs:
                    raise reply
            return replies

        try:
            found = self._run(ask)
        except StorageError:
            with self._lock:
                self._faults.read_errors += 1
            return [False] * len(keys)
        return [self._this_version(k, reply) if theirs else bool(reply) for k, theirs, reply in zip(keys, foreign, found)]

    def present_many(self, keys: list[bytes]) -> list[bool]:
        """Whether this release's frame of each block is stored (a put's "present": an
        ingest asks it before it encodes, a server before it writes what it received): one
        pipelined ``GETRANGE`` of each value's first bytes, in one round trip. Another
        release's frame, though no read here has met it yet, is not: answered present (as an
        ``EXISTS`` answered), it was touched and never written over. (A lookup asks
        ``contains_many``: an ``EXISTS`` is ~2 µs cheaper a key, and a lookup is the hot path.)"""
        if not keys:
            return []

        def ask(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                self._queue_probe(pipe, self.keys_of.frame(k))
            replies = pipe.execute(raise_on_error=False)
            self._raise_unavailable(replies)
            return replies

        try:
            heads = self._run(ask)
        except StorageError:
            with self._lock:
                self._faults.read_errors += 1
            return [False] * len(keys)
        return [self._this_version(k, head) for k, head in zip(keys, heads)]

    @staticmethod
    def _queue_probe(pipe: Any, name: str) -> None:
        """Queue the read of a value's first bytes, enough to tell its format version
        (``head_version``; a missing key answers an empty string)."""
        pipe.getrange(name, 0, VERSION_PROBE_NBYTES - 1)

    def _this_version(self, key: bytes, head: Any) -> bool:
        """Whether a value whose first bytes are ``head`` (a ``GETRANGE`` reply) counts as
        this block stored: not another release's frame. One whose bytes name no version
        (not a frame as releases lay them out) is stored unless a read found the block of
        another version: a read judges it. Keeps ``_other_version`` to what the value says."""
        if isinstance(head, BaseException):  # (a key of another type: a read drops it as damage)
            return True
        if not head:
            self._forget_other_version([key])  # (gone)
            return False
        version = head_version(head)
        if version is None:
            with self._lock:
                return key not in self._other_version
        if version != FORMAT_VERSION:
            self._remember_other_version(key)
            return False
        self._forget_other_version([key])  # (written again since, by this release)
        return True

    def _remember_other_version(self, key: bytes) -> None:
        with self._lock:
            self._other_version[key] = None
            self._other_version.move_to_end(key)
            while len(self._other_version) > OTHER_VERSION_REMEMBERED:
                self._other_version.popitem(last=False)

    def _forget_other_version(self, keys: Iterable[bytes]) -> None:
        if self._other_version:
            with self._lock:
                for k in keys:
                    self._other_version.pop(k, None)

    def info(self, key: bytes) -> BlockInfo | None:
        """The block's sizes, parent and position, from its frame header (no payload read)."""
        try:
            return self.info_or_raise(key)
        except RedisUnavailable:
            return None

    def info_or_raise(self, key: bytes) -> BlockInfo | None:
        name = self.keys_of.frame(key)

        def read(c: Any) -> tuple[int, bytes]:
            pipe = c.pipeline(transaction=False)
            pipe.strlen(name)
            pipe.getrange(name, 0, HEADER_PROBE_NBYTES - 1)
            size, head = pipe.execute()
            if len(head) < min(size, HEADER_PROBE_NBYTES):
                # Its length and its head are two commands, and the value may expire (or be
                # evicted) between them: gone, not damaged.
                return 0, b""
            if size >= PREAMBLE.size:
                need = PREAMBLE.size + min(PREAMBLE.unpack_from(head)[1], MAX_HEADER_NBYTES)
                if len(head) < need <= size:
                    head = c.getrange(name, 0, need - 1)
            return size, head

        try:
            size, head = self._run(read)
        except StorageError as exc:
            with self._lock:
                self._faults.read_errors += 1
            if isinstance(exc, RedisUnavailable):
                raise
            return None  # (Redis answered, with an error: no frame of this block there)
        if size == 0:
            return None
        try:
            if self.max_frame_bytes is not None and size > self.max_frame_bytes:
                raise FrameError(f"the value is larger than any frame read here ({self.max_frame_bytes} bytes)")
            meta = parse_header(head)
            if meta.block_hash != key or meta.nbytes != size:
                raise FrameError("frame header disagrees with its key or its length")
        except FrameVersionError:
            self.count(foreign_version=1)  # (another release's: kept, see ``_decode``)
            self._remember_other_version(key)
            return None
        except FrameError:
            self._drop_corrupt(key, size, head)
            return None
        return BlockInfo(nbytes=meta.nbytes, raw_nbytes=meta.raw_nbytes, parent=meta.parent_hash,
                         position=meta.position)

    def keys(self) -> list[bytes]:
        """Blocks the shared index counts: pinned ones first, then least recently used first."""
        try:
            members = self._run(lambda c: list(_pinned_stored(c, self.keys_of)) + c.zrange(self.keys_of.lru, 0, -1))
        except StorageError:
            return []
        return [key for m in members if (key := RedisKeys.key(m)) is not None]

    def owned(self, match: Callable[[str], bool]) -> list[bytes]:
        """Blocks the shared index counts whose owner tag ``match`` accepts, whichever
        process wrote them (one ``HSCAN`` of the owners hash, in pages). Raises
        ``StorageError`` when Redis cannot be read: a caller about to delete an owner's
        blocks must not take a partial list for the whole."""
        def scan(c: Any) -> list[bytes]:
            found = []
            for member, tag in c.hscan_iter(self.keys_of.owners, count=1000):
                text = member_text(tag)  # (None: not UTF-8, no tag a writer of this tier makes)
                if text is not None and match(text) and (key := RedisKeys.key(member)) is not None:
                    found.append(key)
            return found

        return self._run(scan)

    # -- other changes -------------------------------------------------------------------

    def delete(self, key: bytes) -> bool | None:
        self._forget_other_version([key])
        try:
            return self._run(lambda c: self._delete(c, key))
        except StorageError:
            return None  # (not "not held": the frame may be there still)

    def _delete(self, client: Any, key: bytes) -> bool:
        pipe = client.pipeline(transaction=False)
        pipe.delete(self.keys_of.frame(key))
        self._index.queue(pipe, forget=[RedisKeys.member(key)])
        if self.target.cluster:
            pipe.delete(self.keys_of.frame_gen(key))
        deleted, reply, *_ = pipe.execute()
        self._settle(client, SharedIndex.parse(reply))
        return bool(deleted)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark blocks used, in order (the last becomes the most recent); with a TTL, this
        also restarts their expiry. One round trip; a failure is ignored (and counted)."""
        keys = list(keys)
        if self._other_version:  # (another release's frames: left to age out, or to be written over)
            with self._lock:
                keys = [k for k in keys if k not in self._other_version]
        if not keys:
            return

        def send(c: Any) -> list[str]:
            pipe = c.pipeline(transaction=False)
            self._index.queue(pipe, touch=[RedisKeys.member(k) for k in keys])
            expiring, skipped = [], []
            if self._ttl_ms is not None:
                pinned = self._pinned
                for k in keys:
                    if k in pinned:  # a pinned frame keeps no expiry
                        skipped.append(k)
                    else:
                        pipe.pexpire(self.keys_of.frame(k), self._ttl_ms)
                        expiring.append(RedisKeys.member(k))
            # (this process's view of the pins is refreshed now and then: another's may be
            # newer.) One connection runs a pipeline in order, so on a single Redis the pin
            # check can follow the expiries in the same round trip; a cluster's pipeline goes
            # to several masters at once, so there it waits for their replies.
            ordered = bool(expiring) and not self.target.cluster
            for m in expiring if ordered else ():
                pipe.sismember(self.keys_of.pinned, m)
            replies = pipe.execute()
            update = SharedIndex.parse(replies[0])
            self._settle(c, update)
            self._persist_pinned(c, expiring, replies[len(replies) - len(expiring):] if ordered else None)
            # A pin this process knew of may be gone (another process unpinned the block, or
            # Redis was flushed or restarted): left without its PEXPIRE, a block in use expired.
            held = set(update.pinned)
            unpinned = [k for k in skipped if RedisKeys.member(k) not in held]
            if unpinned:
                with self._lock:
                    self._pinned.difference_update(unpinned)
                self._restart_expiry(c, unpinned)
            # A PEXPIRE answers whether the value was there: an uncounted one is an orphan.
            there = {m for m, n in zip(expiring, replies[1 : 1 + len(expiring)]) if n}
            return [m for m in update.uncounted if m in there]

        try:
            orphans = self._run(send)
        except StorageError:
            return
        if orphans:
            self._adopt([key for m in orphans if (key := RedisKeys.key(m)) is not None])

    def _adopt(self, keys: list[bytes]) -> None:
        """Count blocks stored but not counted (orphans: a victim whose DEL never arrived)
        that a touch found in use, from their headers, as ``check(fix=True)`` does. With a
        TTL each touch restarts their expiry, so a chain in use would keep them uncounted for
        good. (Without one, nothing marks them in a touch's round trip: ``check(fix=True)``
        or a put of the block adopts them.)"""
        found = [(RedisKeys.member(k), info.nbytes, info.raw_nbytes) for k in keys
                 if (info := self.info(k)) is not None]
        if not found:
            return

        def send(c: Any) -> None:
            update = SharedIndex.parse(self._index.queue(c, add=found))
            self._settle(c, update)  # (an adopted block over the budget goes too: counted, then evicted)
            self._mark_adopted(c, [m for m, _, _ in found], update)

        try:
            self._run(send)
        except StorageError:
            pass

    def pin(self, keys: Iterable[bytes]) -> None:
        """Pin blocks in the shared index, as this process's (every process sharing it sees
        the pin; another's unpin leaves it), and take the expiry off their frames. Raises
        ``StorageError`` if Redis cannot be reached."""
        keys = list(keys)
        if not keys:
            return
        def send(c: Any) -> None:
            self._settle(c, self._send_pins(c, keys))

        with self._pinning:  # (an owed unpin sent meanwhile would undo this pin)
            with self._lock:
                self._owed_unpins.difference_update(keys)  # pinned again: that unpin is no longer owed
            self._run(send)
            with self._lock:
                self._own.update(keys)
                self._pinned.update(keys)
        self._keep_lease()

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Drop this process's pins of blocks. Those no other process pins go back to the
        shared LRU (their frames expire again, with a TTL)."""
        keys = list(keys)
        if not keys:
            return

        members = [RedisKeys.member(k) for k in keys]

        def send(c: Any) -> None:
            self._settle(c, SharedIndex.parse(self._index.queue(c, unpin=members, owner=self.owner)))
            # Not listed in the reply (see ``IndexUpdate.released``): each frame gets its
            # expiry back, then those another owner still pins lose it again. So an unpin sent
            # again (its first reply lost, or owed), which releases nothing, still does this.
            self._unpinned(c, members)

        with self._pinning:
            with self._lock:
                self._own.difference_update(keys)
            try:
                self._run(send)
            except StorageError:
                with self._lock:  # counted; sent again by the next call that reaches Redis
                    self._owed_unpins.update(keys)
                return
            except BaseException:
                # Interrupted, sent or not: forgotten here, the pin stayed in Redis under this
                # process's lease, which the keeper renews, so the block held the shared budget
                # for as long as the process lived. Sent again, an unpin is harmless.
                with self._lock:
                    self._owed_unpins.update(keys)
                raise
            with self._lock:
                self._owed_unpins.difference_update(keys)

    def _restart_expiry(self, client: Any, keys: Sequence[bytes]) -> list[str]:
        """Give unpinned blocks' frames their expiry again (then take it off those pinned
        meanwhile, or still); returns those."""
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.pexpire(self.keys_of.frame(k), self._ttl_ms)
        pipe.execute()
        return self._persist_pinned(client, [RedisKeys.member(k) for k in keys])

    def _unpinned(self, client: Any, members: Sequence[str]) -> None:
        """Blocks this process no longer pins, or none does (a call's ``released``): their
        frames expire again, unless pinned still."""
        if members:
            released = [key for m in members if (key := RedisKeys.key(m)) is not None]
            with self._lock:
                self._pinned.difference_update(released)
            if self._ttl_ms is not None:
                try:
                    restarted = self._restart_expiry(client, released)
                except BaseException:
                    with self._lock:
                        self._owed_expiries.update(released)
                    raise
                held = [key for m in restarted if (key := RedisKeys.key(m)) is not None]
                with self._lock:
                    self._pinned.update(held)

    def _pay_owed_expiries(self) -> None:
        """Give back the expiry owed to released blocks' frames (see ``_owed_expiries``)."""
        if not self._owed_expiries:
            return
        with self._lock:
            owed, self._owed_expiries = list(self._owed_expiries), set()
        try:
            self._run(lambda c: self._unpinned(c, [RedisKeys.member(k) for k in owed]))
        except RedisUnavailable:
            pass  # (still owed: _unpinned put them back)
        except StorageError:
            pass  # (Redis refused them: counted; sending them again would not help)

    def _pin_again(self, client: Any) -> None:
        """Send this process's pins again: its lease ran out (it was cut off from Redis for
        longer than the lease) or Redis lost it (flushed, restarted), and its pins with it."""
        with self._pinning:  # (an unpin meanwhile must not be undone by this)
            with self._lock:
                own = [k for k in self._own if k not in self._owed_unpins]
            if own:
                # (its reply says the lease was lost, as every pin's does that takes a lease
                # anew: this is the pin that answers that)
                self._settle(client, self._send_pins(client, own), pin_again=False)

    def _send_pins(self, client: Any, keys: list[bytes]) -> IndexUpdate:
        """Pin ``keys`` in the index as this process's, and take the expiry off their frames."""
        update = SharedIndex.parse(self._index.queue(client, pin=[RedisKeys.member(k) for k in keys],
                                                     owner=self.owner))
        if self._ttl_ms is not None:
            self._pipelined(client, "persist", [self.keys_of.frame(k) for k in keys])
        return update

    def _keep_lease(self) -> None:
        """Start renewing this process's pin lease (once; the thread ends with ``close`` or
        when the tier is dropped)."""
        with self._lock:
            if self._lease_keeper is not None:
                return
            self._lease_keeper = threading.Thread(
                target=_renew_leases, args=(weakref.ref(self), self._lease_stop, self.pin_lease_seconds / 5),
                name=f"cacheseek-{self.name}-pin-lease", daemon=True)
        self._lease_keeper.start()

    def _renew_lease(self) -> None:
        if self._own:
            try:
                self._run(lambda c: self._settle(c, SharedIndex.parse(self._index.queue(
                    c, owner=self.owner, own_count=self._own_count()))))
            except StorageError:
                return  # counted; the next renewal tries again (and pins again what a lapse took)
        # Unpins an outage left owed go now, not only with the next put or stats(): a process
        # that only reads renewed its lease, and so kept those blocks pinned, for good.
        self._pay_owed_unpins()

    def _own_count(self) -> int:
        """How many blocks this process pins in Redis, at most: a pin joins ``_own`` once
        answered, an unpin leaves it before it is sent, so Redis's set of this owner holds
        at least these, unless Redis lost some."""
        with self._lock:
            return len(self._own)

    def _pay_owed_unpins(self) -> None:
        if self._owed_unpins:
            with self._pinning:  # (a pin made since took its keys out of what is owed)
                with self._lock:
                    owed = list(self._owed_unpins)
                if owed:
                    self.unpin(owed)

    def _refresh_pins(self, client: Any) -> None:
        """Learn the pins other processes made, so that touches leave their frames' expiry
        alone (every ``PIN_REFRESH_SECONDS`` at most)."""
        if self._ttl_ms is None or time.monotonic() - self._pins_read_at < PIN_REFRESH_SECONDS:
            return
        members = client.smembers(self.keys_of.pinned)
        with self._lock:
            self._pinned = {key for m in members if (key := RedisKeys.key(m)) is not None}
        self._pins_read_at = time.monotonic()

    def _settle(self, client: Any, update: IndexUpdate, *, victims: bool = True, pin_again: bool = True) -> None:
        """What any script call leaves to do beside the index, whatever the call was for
        (every call drops the pins of owners whose lease ran out, prunes expired entries,
        and evicts down to this process's budget, which may be the smallest in use): delete
        the frames of blocks it evicted or let expire (``victims``; a put deletes its own in
        its next round trip), give back their expiry to frames no pin holds any more, and
        pin again what a lapse of this process's lease took (``pin_again``)."""
        self._note_totals(update.totals)
        if victims and (update.evicted or update.expired):
            self.count(evictions=len(update.evicted))
            self._drop(client, list(update.evicted) + list(update.expired), update.gens)
        self._unpinned(client, update.released)
        if update.lease_lost and pin_again:
            self._pin_again(client)

    def _note_totals(self, totals: IndexTotals) -> None:
        with self._lock:
            self._totals = totals
            smaller = 0 < totals.budget_bytes < self.capacity_bytes and totals.budget_bytes != self._smaller_budget_said
            if smaller:
                self._smaller_budget_said = totals.budget_bytes
        if smaller:
            # Said once per budget: this process's own figures (fill against its budget, its
            # evictions) showed a tier far from full while another's calls emptied it.
            # (The record lasts BUDGET_SEEN_SECONDS: a restart with a larger budget hears of its own
            # last run's until then, which the message allows for.)
            log.warning("%s tier: a process sharing the Redis namespace %s:%s used a budget of %s bytes within the "
                        "last 10 minutes, below this one's %s (another process, or this server's own run before a "
                        "restart with a larger redis_bytes): every call evicts down to its caller's budget, so the "
                        "namespace holds at most that much while it runs, and its evictions are not counted here. "
                        "Give every process sharing a namespace the same redis_bytes, or each its own "
                        "redis_namespace",
                        self.name, self.keys_of.prefix, self.keys_of.namespace, f"{totals.budget_bytes:,}",
                        f"{self.capacity_bytes:,}")

    # -- operations ----------------------------------------------------------------------

    def sizing_problems(self) -> list[str] | None:
        """What is wrong with each master's memory settings for this tier's budget
        (``redis_memory.sizing_problems``); None where Redis could not be asked (or refuses
        ``INFO``)."""
        # Past the breaker and the fault counts: a user whose ACL denies INFO (a managed
        # Redis may) is a healthy setup, and counted a rejected call and a last_error at
        # every start; an unreachable Redis is for the tier's own calls to report.
        try:
            info = self._connection().info("memory")
        except Exception as exc:  # noqa: BLE001 - any failure: not asked
            log.info("%s tier: Redis's memory settings not checked (INFO memory: %s)", self.name,
                     type(exc).__name__ if isinstance(exc, OSError) else exc)
            return None
        if not isinstance(info, dict):
            return None
        # A cluster answers for each node, by name (replicas too: their maxmemory matters
        # once they are promoted).
        nodes = info if info and all(isinstance(v, dict) for v in info.values()) else {"Redis": info}
        return [line for where, memory in nodes.items()
                for line in redis_memory.sizing_problems(memory, self.capacity_bytes, where if len(nodes) > 1 else "Redis")]

    def stats(self):
        """Counters of this process; used bytes and blocks of the shared index (the last
        values seen, with ``index_stale`` true, when Redis cannot be asked)."""
        def refresh(c: Any) -> None:
            self._settle(c, SharedIndex.parse(self._index.queue(c, owner=self.owner if self._own else "",
                                                                own_count=self._own_count())))
            self._refresh_pins(c)

        try:
            self._pay_owed_unpins()  # (first, so the figures below count what it gives back)
            self._pay_owed_replies()
            self._pay_owed_drops()
            self._pay_owed_expiries()
            self._run(refresh)
            stale = False
        except StorageError:
            stale = True
        with self._lock:
            self._stats.used_bytes = self._totals.used_bytes
            self._stats.raw_bytes = self._totals.raw_bytes
            self._stats.blocks = self._totals.blocks
            self._stats.pinned_bytes = self._totals.pinned_bytes
            self._stats.pinned_blocks = self._totals.pinned_blocks
            faults = self._faults
            self._stats.extra = {
                "url": self.target.redacted(), "cluster": self.target.cluster,
                "prefix": self.keys_of.prefix, "namespace": self.keys_of.namespace,
                "ttl_seconds": self.ttl_seconds, "index_stale": stale,
                "dropped_writes": faults.dropped_writes, "read_errors": faults.read_errors,
                "timeouts": faults.timeouts, "unavailable_errors": faults.unavailable,
                "rejected_errors": faults.rejected, "refused_by_breaker": faults.refused_by_breaker,
                "foreign_index_errors": faults.foreign_index, "foreign_index_key": faults.foreign_index_key,
                "last_error": faults.last_error, "breaker": self.breaker.stats().to_dict(),
                "owed_unpins": len(self._owed_unpins), "owed_drops": len(self._owed_drops),
                "owed_replies": len(self._owed_replies),
                # The smallest budget in use on the namespace (this one's, or another process's
                # below it): the one evictions keep it to.
                "budget_in_effect_bytes": min(self.capacity_bytes, self._totals.budget_bytes or self.capacity_bytes),
            }
            return self._snapshot()

    def check(self, *, fix: bool = False, ghost_grace_seconds: float = GHOST_GRACE_SECONDS,
              evict: bool = True) -> dict[str, int]:
        """Post-mortem: compare the shared index with the frames actually stored.

        ``ghosts``: indexed, not stored (an interrupted write, or a frame Redis evicted or
        expired); ``orphans``: stored, not indexed (a victim whose DEL never arrived);
        ``wrong_size``: indexed and stored, but counted at another size than the stored
        value's length (a snapshot restored between a put's count and its SET, or two writers
        of frames of different sizes under one hash whose SETs landed in the other order than
        their counts); ``ok``: the others, indexed and stored at their size;
        ``stale_owner_tags``: owner tags (``RedisKeys.owners``) of blocks the index does not
        count, left by a release before owner tags, whose evictions left them (Redis memory
        outside the budget, growing with every such eviction of a tagged block).
        ``fix`` forgets the ghosts, adopts the orphans and counts the wrong sizes at the stored
        frames' (both read from their headers), and removes the stale owner tags (each only if
        its block is still uncounted: a put since the scan keeps its tag). An unpinned ghost
        used within ``ghost_grace_seconds`` is left, as a read leaves it: it may be a put in flight
        (counted, its SET not landed yet), and forgotten, that put would delete the frame it
        then wrote. So is a wrong size used within it (a put in flight counts its own size
        before its SET replaces the value), one a put has counted again since the scan, and
        a pinned one (no LRU entry to age: mended once unpinned and idle). Scans
        every master: for maintenance, not for a request path.

        The repair evicts down to this tier's budget what the namespace holds beyond it (the
        blocks stored, orphans adopted included). ``evict=False`` refuses such a repair
        (``RepairWouldEvict``, nothing changed): a budget smaller than the one the processes
        sharing the namespace use would empty most of it. ``repair_evictions``: how many
        blocks the last repair evicted."""
        if fix:
            self.repair_evictions = 0

        def scan(c: Any) -> tuple[set[str], set[str], set[str]]:
            # Tags first: a block counted after this (its tag with it) is not taken for a stale
            # tag, and one let go in between is (its tag went with its count: removing it does nothing).
            tagged.update(t for m, _ in c.hscan_iter(self.keys_of.owners, count=1000)
                          if (t := member_text(m)) is not None)
            pinned = set(member_texts(c.smembers(self.keys_of.pinned)))
            entries = c.hgetall(self.keys_of.sizes)
            indexed = set(member_texts(entries))
            for name, value in entries.items():
                text = member_text(name)
                size = re.match(rb"(\d+) \d+$", value) if isinstance(value, bytes) else None
                if text is not None and size is not None:
                    sizes[text] = int(size.group(1))
                    seen[text] = value
            stored = set()
            for name in c.scan_iter(match=self.keys_of.frame_pattern, count=1000):
                text = name.decode("utf-8", "replace")
                member = text[text.index("{") + 1 : -1]
                if RedisKeys.key(member) is not None:  # (another tool's key under the pattern: not ours)
                    stored.add(member)
            # The stored values' lengths, of the blocks counted (a value gone since the SCAN: 0;
            # a key of another type under a frame's name: an error, in its place).
            both = sorted(indexed & stored)
            lengths.update(zip(both, self._pipelined(c, "strlen", [self.keys_of.frame_of_member(m) for m in both],
                                                     per_key_errors=True)))
            return indexed, stored, pinned

        sizes: dict[str, int] = {}
        seen: dict[str, bytes] = {}  # each entry of the sizes hash as read
        tagged: set[str] = set()
        lengths: dict[str, Any] = {}
        indexed, stored, pinned = self._run(scan)
        ghosts, orphans = sorted(indexed - stored), sorted(stored - indexed)
        wrong = sorted(m for m in indexed & stored
                       if m in sizes and type(n := lengths[m]) is int and n not in (0, sizes[m]))
        stale_tags = sorted(tagged - indexed)
        report = {"ok": len(indexed & stored) - len(wrong), "ghosts": len(ghosts), "orphans": len(orphans),
                  "wrong_size": len(wrong), "stale_owner_tags": len(stale_tags)}
        if fix and (ghosts or orphans or wrong):
            adopt = []
            for m in orphans:
                orphan = RedisKeys.key(m)
                assert orphan is not None  # (scan stores only members that name a key)
                info = self.info(orphan)
                if info is not None:
                    adopt.append((m, info.nbytes, info.raw_nbytes))
            resize = []
            for m in wrong:
                key = RedisKeys.key(m)
                assert key is not None
                # (its header, checked against its length: a value that is not a whole frame
                # is deleted here, with its entry, as a read would)
                info = self.info(key)
                if info is not None:
                    resize.append((m, seen[m], info.nbytes, info.raw_nbytes))
            now_size = {m: n for m, _, n, _ in resize}
            held = (sum(now_size.get(m, sizes.get(m, 0)) for m in indexed & stored)
                    + sum(n for _, n, _ in adopt))
            if not evict and held > self.capacity_bytes:
                raise RepairWouldEvict(
                    f"{self.name} tier: the namespace holds {held:,} bytes ({len(indexed & stored) + len(adopt)} blocks, "
                    f"orphans included), more than this budget of {self.capacity_bytes:,}: a repair would evict the "
                    f"least recently used down to it. Nothing was changed", held, self.capacity_bytes)

            def repair(c: Any) -> None:
                # A pinned ghost is forgotten at once: it has no LRU entry to age, and a pin is
                # of a block stored already. Only the script can judge the others' idle time.
                update = SharedIndex.parse(self._index.queue(
                    c, forget=[m for m in ghosts if m in pinned], add=adopt,
                    repair=[m for m in ghosts if m not in pinned], resize=resize,
                    repair_idle_us=max(0, round(ghost_grace_seconds * 1e6))))
                self.repair_evictions += len(update.evicted)
                self._settle(c, update)
                self._mark_adopted(c, [m for m, _, _ in adopt], update)
                if update.repaired:  # (a write stalled past the grace may have landed since the scan)
                    found = self._pipelined(c, "exists", [self.keys_of.frame_of_member(m) for m, _, _ in update.repaired])
                    back = [entry for entry, n in zip(update.repaired, found) if n]
                    if back:
                        again = SharedIndex.parse(self._index.queue(c, add=back))
                        self.repair_evictions += len(again.evicted)
                        self._settle(c, again)

            self._run(repair)
        if fix and stale_tags:
            self._run(lambda c: self._index.drop_stale_owner_tags(c, stale_tags))
        return report

    def close(self) -> None:
        """Stop renewing this process's pin lease, then close the connection: its pins in Redis
        go one lease later, unless pinned again (the server's pins file does at its start)."""
        with self._lock:
            self._lease_stop.set()
            keeper = self._lease_keeper
            self._lease_stop, self._lease_keeper = threading.Event(), None
        # A renewal in flight is waited for (its commands' socket timeouts at most): with its
        # connection closed under it, redis-py would send it again on a new one, after this
        # returned, and that connection would stay open.
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join()
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a client whose server is gone must not raise
                pass


def _renew_leases(tier_ref: Callable[[], RedisTier | None], stop: threading.Event, every_seconds: float) -> None:
    """A tier's pin lease keeper (a weak reference: a tier dropped without ``close`` ends it)."""
    while not stop.wait(every_seconds):
        tier = tier_ref()
        if tier is None:
            return
        tier._renew_lease()
        del tier


def _pinned_stored(client: Any, keys: RedisKeys) -> list[str]:
    """Pinned members that the index counts (stored, or ghosts)."""
    pinned = list(member_texts(client.smembers(keys.pinned)))
    if not pinned:
        return []
    held = client.hmget(keys.sizes, pinned)
    return [m for m, size in zip(pinned, held) if size is not None]


__all__ = ["ForeignIndexKey", "RedisTier", "RedisUnavailable", "RepairWouldEvict"]
