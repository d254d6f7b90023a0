"""``BlockService``: what the routes do, in plain synchronous Python over a ``TieredStore``.

Frames are stored opaquely; on the way in every frame is parsed strictly (checksum
verified, tensor entries checked against its codec and layout), its hash checked against
the URL's, and its position checked against its parent's wherever the parent is known.
Every check happens before anything is stored, so a rejected request changes nothing.

A frame arrives in a buffer of its own, or (where the top tier has room) in place, in a
reservation of the top tier's memory (``TieredStore.reserve``): it is checked there and
committed, and a rejected one is given back. Its payload checksum is computed as it arrives
(``PayloadChecksum``), so checking it costs ~0.1 ms and routes do that in the event loop;
storing runs in a worker thread wherever it may do I/O (a disk or Redis tier) or copy a
whole frame (a buffer into the tier).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from cacheseek.batch_body import LENGTH
from cacheseek.errors import ChecksumError, FrameError
from cacheseek.hashing import to_hex
from cacheseek.log_throttle import LogThrottle
from cacheseek.store.cpu import CpuTier
from cacheseek.store.eviction import SoftSpare
from cacheseek.store.lease import Lease
from cacheseek.store.prefetch import Prefetch
from cacheseek.store.frame import FrameMeta, check_codec_layout, check_stat_values, header_prefix, parse_frame
from cacheseek.store.tier import BlockFrame, BlockInfo, Reservation
from cacheseek.store.tiered import DURABLE, DrainReport, StorePutResult, TieredStore
from cacheseek.units import format_size

from .claims import Claimed, PositionClaims
from .errors import BadFrame, HashMismatch, NotFound, TierUnreachable, without_keys
from .metrics import Metrics
from .namespaces import Namespaces, rewrite_prefix
from .owners import Owners

PUT_GROUP = 4  # frames per store call
# The most blocks a body's put spares below it (``_earlier_bodies``): the run a tail-first
# write's earlier bodies stored. A walk step is a children lookup in each local tier, and
# each eviction the body makes walks past the spared blocks the policy would give up first
# (``EvictionIndex.victim``: ~0.16 us a block, 0.65 ms past 4,096), so the cap bounds a
# body's extra work at its evictions times this: 32 evictions for a 1 GiB body of raw
# Llama-3-8B frames (32 MiB), ~20 ms; 512 for one of 2 MiB frames, ~0.3 s. 4,096 blocks are
# 4 bodies of 1 GiB (the client's max_body_bytes) at 1 MiB frames, 128 GiB at 32 MiB: a
# longer run is spared for its 4,096 blocks next to this body, and its far tail, written
# first, is given up first, as it was unspared.
SPARE_RUN_BLOCKS = 4096
# Bodies whose write may go on (``_earlier_bodies``): what each stored and spared, kept until
# the next body of its write comes, at most this many, holding this many keys in all (~6 MB;
# the oldest forgotten first; each at most SPARE_RUN_BLOCKS keys). Most are a write's one
# body that extends a stored prefix, never asked for, and small.
SPARE_BODIES = 256
SPARE_BODIES_KEYS = 1 << 16
DRAIN_PROGRESS_SECONDS = 5.0  # between a shutdown drain's progress lines

log = logging.getLogger("cacheseek.server")

WRITE_ERROR_LOG_SECONDS = 10.0  # a failing tier fails every write: its reason logged this often at most


@dataclass(slots=True)
class Incoming:
    """A client's frame, parsed and checked, not stored yet: in a buffer of its own, or
    written in place into a reservation of the top tier (then ``buf`` is None)."""

    buf: bytearray | None
    meta: FrameMeta
    reservation: Reservation | None = None


@dataclass(slots=True)
class ServicePutReport:
    """One frame's answer. ``status`` is at the level ``durability`` names (the store's,
    ``TieredStore.durability``): "stored" (committed there by this request), "present"
    (committed there already, or by a concurrent write of it that this request waited
    for), or "failed" (not committed there; ``errors`` say why per tier)."""

    hash: str
    status: str  # "stored" | "present" | "failed"
    errors: dict[str, str]
    nbytes: int = 0
    durability: str = "durable"  # "durable" | "memory"

    def to_dict(self) -> dict[str, Any]:
        return {"hash": self.hash, "status": self.status, "durability": self.durability, "errors": self.errors}


class BlockService:
    def __init__(self, store: TieredStore, namespaces: Namespaces, metrics: Metrics, *, max_chain_blocks: int,
                 owners: Owners | None = None) -> None:
        self.store = store
        self.namespaces = namespaces
        self.metrics = metrics
        self.max_chain_blocks = max_chain_blocks
        self.owners = owners if owners is not None else Owners()
        self.claims = PositionClaims()
        # A multi-body write's bodies (``_earlier_bodies``): under each body's first new block
        # of a chain that goes on below, the blocks it stored and spared.
        self._bodies: OrderedDict[bytes, frozenset[bytes]] = OrderedDict()
        self._bodies_keys = 0  # (their sizes added up, each record once)
        self._body_refs: dict[int, int] = {}  # id of a record -> the entries naming it (a body's chains share one)
        self._bodies_lock = threading.Lock()
        # Tier write failures, whole in the log (a client's answer hides the keys in them:
        # ``without_keys``), one line a period at most (a full disk fails every write).
        self._write_errors = LogThrottle(WRITE_ERROR_LOG_SECONDS)
        self.owners.adopt(store.residency.listen(self.owners))
        # A shared tier (Redis) keeps each block's owner beside it: an admin flush on any
        # replica finds there what no local index names (written by another, or evicted here).
        self.owners.tagger = namespaces.owner_tag
        # And a read from it tells each block's owner with its frame: a block another replica
        # wrote (or this one, before a restart) is attributed by it when promoted here.
        for tier in store.tiers:
            if hasattr(tier, "owner_tag") and hasattr(tier, "tags_read"):  # (a shared tier: Redis's)
                tier.owner_tag = self.owners.tag_of
                tier.tags_read = self.owners.came_with

    # -- writes --------------------------------------------------------------------------

    def check_client_frame(self, buf: bytearray, *, url_hash: bytes | None = None, where: str = "frame",
                           payload_digest: bytes | None = None, values: bool = True) -> Incoming:
        """Parse and check one client frame (its payload checksum already computed as it
        arrived, if ``payload_digest``). Raises ``BadFrame`` (400) or ``HashMismatch`` (409).
        ``values``: its quantizer stats too (else ``put(check_values=True)`` checks them)."""
        return Incoming(buf, self._check(buf, url_hash, where, payload_digest, values))

    def check_client_reserved(self, reservation: Reservation, *, url_hash: bytes | None = None,
                              where: str = "frame", payload_digest: bytes | None = None,
                              values: bool = True) -> Incoming:
        """``check_client_frame`` for a frame received into a reservation (its payload checksum
        already computed as it arrived, if ``payload_digest``); a bad one gives it back."""
        try:
            return Incoming(None, self._check(reservation.view(), url_hash, where, payload_digest, values),
                            reservation)
        except BaseException:
            self.store.abort(reservation)
            raise

    def _check(self, buf: Any, url_hash: bytes | None, where: str, payload_digest: bytes | None = None,
               values: bool = True) -> FrameMeta:
        try:
            meta = parse_frame(buf, verify=True, payload_digest=payload_digest)
            check_codec_layout(meta)
            if values:
                check_stat_values(meta, buf)
        except ChecksumError as exc:
            self.metrics.rejected("checksum")
            raise BadFrame(f"{where}: {exc}") from None
        except FrameError as exc:
            self.metrics.rejected("malformed")
            raise BadFrame(f"{where}: {exc}") from None
        if meta.position >= self.max_chain_blocks:
            self.metrics.rejected("malformed")
            raise BadFrame(f"{where}: position {meta.position} exceeds max_chain_blocks ({self.max_chain_blocks})",
                           limit="max_chain_blocks", limit_value=self.max_chain_blocks)
        if url_hash is not None and meta.block_hash != url_hash:
            self.metrics.rejected("hash_mismatch")
            raise HashMismatch(f"{where}: header hash {to_hex(meta.block_hash)} is not the URL's {to_hex(url_hash)}")
        return meta

    def check_and_put(self, namespace: str, buf: bytearray, url_hash: bytes,
                      payload_digest: bytes | None = None, *, model: str = "") -> ServicePutReport:
        """``PUT /v1/blocks/{hash}``: check one frame, then store it."""
        incoming = self.check_client_frame(buf, url_hash=url_hash, payload_digest=payload_digest)
        return self.put(namespace, [incoming], model=model, body=False)[0]

    def check_and_commit(self, namespace: str, reservation: Reservation, url_hash: bytes,
                         payload_digest: bytes | None = None, *, model: str = "") -> ServicePutReport:
        """``PUT /v1/blocks/{hash}`` for a frame received into a reservation: check it, then publish it."""
        incoming = self.check_client_reserved(reservation, url_hash=url_hash, payload_digest=payload_digest)
        return self.put(namespace, [incoming], model=model, body=False)[0]

    def put(self, namespace: str, frames: list[Incoming], *, model: str = "", body: bool = True,
            check_values: bool = False) -> list[ServicePutReport]:
        """Store checked frames, attributed to (namespace, model) (see ``_put``). A batch
        refused for its positions announces nothing: a position 0 would make its model the
        owner of the namespace's root. ``body``: a POST's body, whose room spares the same
        write's earlier bodies (``_earlier_bodies``); a PUT's frame spares none.
        ``check_values``: the frames' quantizer stats are checked here first (a POST's: a
        pass over up to a third of each frame, ~0.1 s a GiB, kept off the event loop, where
        the rest of each frame's check runs as it arrives); one that fails refuses them all."""
        if check_values:
            for i, inc in enumerate(frames):
                data = inc.buf if inc.reservation is None else inc.reservation.view()
                try:
                    check_stat_values(inc.meta, data)
                except FrameError as exc:
                    self.metrics.rejected("malformed")
                    raise BadFrame(f"frame {i}: {exc}", frame=i) from None
        self._check_batch_positions(frames)
        keys = [self.namespaces.stored_key(namespace, inc.meta.block_hash) for inc in frames]
        parents = [self.namespaces.stored_key(namespace, inc.meta.parent_hash) for inc in frames]
        claimed = [(k, p, inc.meta.position) for k, p, inc in zip(keys, parents, frames)]
        # Claimed before the store is looked at, given back once stored (server.claims): a
        # write checked meanwhile sees these positions, in the store or here.
        self._claim(namespace, frames, claimed)
        try:
            self._check_stored_positions(namespace, frames, keys)
            owners = self.owners
            owner = owners.expect_as(namespace, model, [(k, p if pos == 0 else b"", pos) for k, p, pos in claimed])
            try:
                return self._put(namespace, frames, keys, body=body)
            finally:
                owners.settle(owner, keys)
        finally:
            self.claims.release(claimed)

    def _put(self, namespace: str, frames: list[Incoming], keys: list[bytes], *, body: bool = True
             ) -> list[ServicePutReport]:
        """Store checked frames (in order), whose positions ``put`` checked against their
        parents' (in this batch or stored). Blocks already stored anywhere are not written
        again (their reservations are given back). On an error, reservations not yet
        committed stay lent: the caller aborts them."""
        ns = self.namespaces
        level = self.store.durability
        reports = [ServicePutReport(to_hex(inc.meta.block_hash), "present", {}, inc.meta.nbytes, level)
                   for inc in frames]
        outcomes: dict[int, StorePutResult] = {}
        group: list[tuple[int, bytes, BlockFrame]] = []
        # One question per tier for the whole batch (one round trip to Redis, not one per frame):
        # which blocks are committed where an acknowledgement needs them (a block only in
        # memory, its disk write in flight, is not: it is put again, and that put waits).
        stored = self.store.present_many(keys)
        # The bytes of the batch's new frames after each one. The batch is stored in pieces
        # (groups, frames received in place), and each piece evicts for the rest of the batch
        # too: evicting for itself alone, it evicted the pieces before it (a fresh chain is
        # the only once-used data in a tier whose blocks were all read again: ARC's first
        # victims), and the batch answered "stored" for blocks already gone.
        after = [0] * len(frames)
        for i in range(len(frames) - 2, -1, -1):
            after[i] = after[i + 1] + (0 if stored[i + 1] else frames[i + 1].meta.nbytes)
        # (not for a PUT: one frame, no write of our client's, and received in place into a
        # memory store it is committed in the event loop, where a walk of 4,096 steps, ~4 ms,
        # is 40 times what that path allows)
        spare = self._earlier_bodies(namespace, frames, keys, stored) if body else ()

        def flush() -> None:
            # Groups keep each tier's lock short: lookups (in the event loop) never wait long.
            for start in range(0, len(group), PUT_GROUP):
                part = group[start : start + PUT_GROUP]
                put = self.store.put_many([(k, f) for _, k, f in part], room_for=after[part[-1][0]], spare=spare)
                for (i, _, _), outcome in zip(part, put):
                    outcomes[i] = outcome
            group.clear()

        for i, (inc, key, here) in enumerate(zip(frames, keys, stored)):
            reservation = inc.reservation
            if here:
                if reservation is not None:
                    self.store.abort(reservation)
                continue
            meta = ns.rekey(namespace, inc.meta) if namespace else inc.meta
            if reservation is not None:
                if self._rekey_in_place(reservation, inc.meta, meta):
                    flush()  # in order: a chain that overflows the budget keeps its head
                    outcomes[i] = self.store.commit_many([(key, reservation, meta)], room_for=after[i], spare=spare)[0]
                    continue
                # A client's header packed longer or shorter than ours: move the frame to a buffer.
                buf = bytearray(reservation.view())
                self.store.abort(reservation)
            else:
                assert inc.buf is not None  # (no reservation: the frame is in a buffer of its own)
                buf = inc.buf
            if namespace:
                buf = rewrite_prefix(meta, buf, inc.meta.payload_offset)
            group.append((i, key, BlockFrame(meta, host=memoryview(buf), sealed=True)))
        flush()
        for i, outcome in outcomes.items():
            report = reports[i]
            report.status = "stored" if outcome.stored else "present" if outcome.present else "failed"
            # (each a tier's reason, read by the client: no stored key in it, see without_keys;
            # the log, the operator's, keeps them whole)
            report.errors = {tier: without_keys(reason) for tier, reason in outcome.errors.items()}
            if outcome.errors:
                if count := self._write_errors.due():
                    more = f" ({count} writes failed since the last such line)" if count > 1 else ""
                    log.warning("a block could not be stored: %s%s",
                                "; ".join(f"{t}: {r}" for t, r in outcome.errors.items()), more)
        return reports

    def _earlier_bodies(self, namespace: str, frames: list[Incoming], keys: list[bytes], stored: list[bool]
                        ) -> Container[bytes]:
        """What this batch's room spares: the blocks the same write's earlier bodies stored.
        A write past the client's max_body_bytes comes in several bodies, tail first (blocks
        33..63 of a 64-block chain, then 2..32, then 0..1), and each body makes room for
        itself: under ARC, in a tier whose older chains had all been read again (T2), the
        earlier bodies were its only once-used blocks (T1), ARC's first victims, so each
        later body evicted them, leaf first (the write kept 31 of the 64 blocks it was
        answered "stored" for, and the older chains stayed). Those blocks are the stored
        descendants of each chain's last new block in this body, a linear run: walked child
        by child while exactly one is stored (a fork, or none, ends it). A body may hold
        several chains (``ingest_batch`` of several requests is one stream, cut into bodies:
        a body holds one request's head and the one before's tail), so every chain's run is
        walked: a run ends at each new frame that is no other frame's parent in the body.
        A request sent wholly in an earlier body is below none of this body's chains, so each
        body leaves a record under its chains' first new blocks (those whose parent it does
        not hold: the write's next body does): what it stored and spared. A walk that steps
        on such a block takes that record in, and the write's later bodies spare all its
        earlier ones. ``SPARE_RUN_BLOCKS`` bounds the children lookups of all the walks
        together, and the spare (records too). Found by
        the chain, no client's word: a writer spares only blocks below its own, which no
        lookup reaches but through the blocks it writes now. A ``SoftSpare``: given up last,
        not never, so a body with no other room still stores, evicting them, leaf first (a
        chain longer than the tier keeps its head). An embedded ingest needs none: one call
        makes room for all its batches at once."""
        in_body = {inc.meta.block_hash for inc in frames}
        named = {inc.meta.parent_hash for inc in frames if inc.meta.position > 0}
        # (stored already: the blocks below it are not this write's to spare)
        new = [i for i in range(len(frames)) if not stored[i]]
        ends = dict.fromkeys(keys[i] for i in new if frames[i].meta.block_hash not in named)
        limit = min(SPARE_RUN_BLOCKS, self.max_chain_blocks)
        run: set[bytes] = set()
        steps = limit
        for key in ends:
            while steps > 0 and len(run) < limit:
                steps -= 1
                children = self.store.children(key)
                if len(children) != 1 or children[0] in run:
                    break
                key = children[0]
                run.add(key)
                with self._bodies_lock:
                    earlier = self._bodies.pop(key, None)
                    if earlier is not None:
                        self._forget_record(earlier)
                if earlier is not None:  # an earlier body's first block: what that body stored and spared
                    run.update(list(earlier - run)[: limit - len(run)])
        # This body's record, for the write's next body (which holds the parent of a chain's
        # first block here: the write goes on there), under each such block.
        # A chain whose parent is held already extends a stored prefix: no body of this write
        # holds that parent as a new frame (a walk starts only there), so a record of it would
        # never be taken, and such records, one a body in the common case, turned the others
        # over under load, exactly when a multi-body write needs its own.
        firsts = [keys[i] for i in new if frames[i].meta.position > 0 and frames[i].meta.parent_hash not in in_body
                  and self.store.residency.info(self.namespaces.stored_key(namespace, frames[i].meta.parent_hash)) is None]
        if firsts:
            mine = frozenset([keys[i] for i in new][:limit])
            mine |= frozenset(list(run - mine)[: limit - len(mine)])
            with self._bodies_lock:
                self._bodies_keys += len(mine)
                for key in firsts:
                    old = self._bodies.pop(key, None)
                    if old is not None:
                        self._forget_record(old)
                    self._bodies[key] = mine
                    self._body_refs[id(mine)] = self._body_refs.get(id(mine), 0) + 1
                while len(self._bodies) > SPARE_BODIES or self._bodies_keys > SPARE_BODIES_KEYS:
                    self._forget_record(self._bodies.popitem(last=False)[1])
        return SoftSpare(run) if run else ()

    def _forget_record(self, record: frozenset[bytes]) -> None:
        """Under ``_bodies_lock``: one entry naming ``record`` gone; its keys uncounted with
        the last."""
        left = self._body_refs.pop(id(record)) - 1
        if left:
            self._body_refs[id(record)] = left
        else:
            self._bodies_keys -= len(record)

    @staticmethod
    def _rekey_in_place(reservation: Reservation, sent: FrameMeta, meta: FrameMeta) -> bool:
        """Write ``meta``'s header over the received one if it fits the same aligned room
        (always, for headers this library packs); False if it does not."""
        if meta is sent:
            return True
        prefix = header_prefix(meta)
        if len(prefix) != sent.payload_offset:
            return False
        reservation.view()[: len(prefix)] = prefix
        return True

    def _check_batch_positions(self, frames: list[Incoming]) -> None:
        """One position per hash in a batch: only the first copy is stored, but children are
        checked against the batch's, so two positions for one hash would let a link pass that
        the store contradicts."""
        batch: dict[bytes, tuple[int, FrameMeta]] = {}
        for i, inc in enumerate(frames):
            first = batch.setdefault(inc.meta.block_hash, (i, inc.meta))
            if first[1].position != inc.meta.position:
                self.metrics.rejected("inconsistent")
                raise BadFrame(f"frame {i}: block {to_hex(inc.meta.block_hash)} at position {inc.meta.position} "
                               f"is also frame {first[0]}, at position {first[1].position}", frame=i)

    def _claim(self, namespace: str, frames: list[Incoming], claimed: list[Claimed]) -> None:
        """Claim the frames' positions (``PositionClaims``); one that contradicts a write in
        flight is refused as a stored block that contradicts it would be."""
        conflict = self.claims.claim(claimed)
        if conflict is None:
            return
        self.metrics.rejected("inconsistent")
        meta = frames[conflict.index].meta
        where = f"frame {conflict.index}" if len(frames) > 1 else "frame"
        other = to_hex(self.namespaces.client_hash(namespace, conflict.other))
        if conflict.what == "self":
            raise BadFrame(f"{where}: block {other} at position {meta.position} is being written at position "
                           f"{conflict.position} by another request", frame=conflict.index)
        if conflict.what == "parent":
            raise BadFrame(f"{where}: position {meta.position}, but its parent {other} is being written at "
                           f"position {conflict.position} by another request", frame=conflict.index)
        raise BadFrame(f"{where}: position {meta.position}, but block {other}, being written with it as its "
                       f"parent by another request, is at position {conflict.position}", frame=conflict.index)

    def _check_stored_positions(self, namespace: str, frames: list[Incoming], keys: list[bytes]) -> None:
        """Each frame's position against its parent's and its stored children's, whichever
        arrived first: every stored link then goes one position down, so no chain of links
        can close into a cycle (which eviction's walk to a leaf would never leave). A parent
        in the batch stands for the stored one, so it must be at its stored position, if
        stored."""
        batch = {inc.meta.block_hash: inc.meta for inc in frames}
        named = {inc.meta.parent_hash for inc in frames if inc.meta.position > 0}
        linked = [i for i, inc in enumerate(frames) if inc.meta.block_hash in named]
        # One question per tier for them all (one round trip to Redis), then a header per hit.
        for i, here in zip(linked, self.store.contains_many([keys[i] for i in linked])):
            info = self.store.info(keys[i]) if here else None
            meta = frames[i].meta
            if info is not None and info.position != meta.position:
                self.metrics.rejected("inconsistent")
                where = f"frame {i}" if len(frames) > 1 else "frame"
                raise BadFrame(f"{where}: block {to_hex(meta.block_hash)} at position {meta.position} is "
                               f"stored at position {info.position}", frame=i)
        for i, (inc, key) in enumerate(zip(frames, keys)):
            meta = inc.meta
            where = f"frame {i}" if len(frames) > 1 else "frame"
            # (a local tier's index, no tier asked: a shared tier's copy, another replica's, was
            # checked against no local child, and a Redis round trip a frame cost a batch 64)
            held = self.store.residency.info(key)
            if held is not None and held.position != meta.position:
                self.metrics.rejected("inconsistent")
                raise BadFrame(f"{where}: block {to_hex(meta.block_hash)} at position {meta.position} is "
                               f"stored at position {held.position}", frame=i)
            # Stored at this position already (a local index's), its stored children were checked
            # against it, or it against them, as each arrived: a walk of them again on every put of
            # it cost ~0.9 us a child, in the event loop (a tenant's block of 100k children made
            # each of its puts take 89 ms, and every other client waited).
            for child in (() if held is not None else self.store.children(key)):
                info = self.store.info(child)
                if info is not None and info.position != meta.position + 1:
                    self.metrics.rejected("inconsistent")
                    raise BadFrame(f"{where}: position {meta.position}, but block "
                                   f"{to_hex(self.namespaces.client_hash(namespace, child))}, stored with it "
                                   f"as its parent, is at position {info.position}", frame=i)
            if meta.position == 0:
                continue  # its parent is the client's root, which the server never sees
            parent = batch.get(meta.parent_hash)
            parent_pos = parent.position if parent is not None else None
            if parent is None:
                info = self.store.info(self.namespaces.stored_key(namespace, meta.parent_hash))
                parent_pos = info.position if info is not None else None
            if parent_pos is not None and parent_pos != meta.position - 1:
                self.metrics.rejected("inconsistent")
                raise BadFrame(f"{where}: position {meta.position}, but its parent "
                               f"{to_hex(meta.parent_hash)} is at position {parent_pos}", frame=i)

    def delete(self, namespace: str, h: bytes) -> None:
        # All or nothing: deleted from the local tiers alone, its Redis copy would be named by
        # no local index (no owner: a flush of its namespace or model could not find it) and
        # served again once Redis answered, unless the client retried.
        key = self.namespaces.stored_key(namespace, h)
        if self.store.children(key):
            self.owners.keep_for_children(key)
        with self.owners.deleting() as gone:
            deleted = self.store.delete(key, all_or_nothing=True)
            if deleted is not None:
                gone.append(key)
        if deleted is None:  # a 404 or a 204 would tell the client it is gone
            raise TierUnreachable(f"block {to_hex(h)}: a tier that may hold it could not be reached, so it is kept "
                                  "(in every tier); retry")
        if not deleted:
            raise NotFound(f"block {to_hex(h)} is not stored")

    # -- reads ---------------------------------------------------------------------------

    def get(self, namespace: str, h: bytes, leases: list[Lease | None]) -> tuple[list[Any], str]:
        """The frame of block ``h`` as wire segments (no payload copy), and the tier that
        served it. The lease on its bytes is appended to ``leases`` before this returns (so a
        caller whose worker thread outlives it still releases it)."""
        got = self.get_stored(self.namespaces.stored_key(namespace, h), leases)
        if got is None:
            raise NotFound(f"block {to_hex(h)} is not stored")
        frame, tier = got
        return self.wire_segments(namespace, frame), tier

    def head(self, namespace: str, h: bytes) -> tuple[int, str]:
        """What ``get`` would answer without its bytes: the frame's length and the fastest
        tier holding it (from the indexes: no frame is read, leased or touched)."""
        key = self.namespaces.stored_key(namespace, h)

        def find() -> tuple[int, str] | None:
            info = self.store.info(key)
            tiers = self.store.locate([key]) if info is not None else []
            return (info.nbytes, tiers[0]) if info is not None and tiers else None

        found = self.store.walk_past_moves(find)  # (a block on its way down a tier is waited for, as get does)
        if found is None:
            raise NotFound(f"block {to_hex(h)} is not stored")
        return found

    def get_nowait(self, namespace: str, h: bytes, leases: list[Lease | None]) -> tuple[list[Any], str] | None:
        """``get`` when the block is in host memory (no I/O), else None."""
        frame = self.get_in_memory(self.namespaces.stored_key(namespace, h), leases)
        if frame is None:
            return None
        return self.wire_segments(namespace, frame), self.store.tiers[0].name

    def get_stored(self, key: bytes, leases: list[Lease | None], *,
                   spare: Container[bytes] = ()) -> tuple[BlockFrame, str] | None:
        """The frame from the fastest tier and that tier's name, or None; the frame's lease
        appended to ``leases``, which the caller releases once the bytes are sent. ``spare``:
        the chain the caller is reading, which the block's promotion must not evict
        (``TieredStore.get``)."""
        got = self.store.get(key, spare=spare)
        if got is not None:
            leases.append(got[0].lease)
        return got

    def get_in_memory(self, key: bytes, leases: list[Lease | None]) -> BlockFrame | None:
        """The frame if the top tier holds it in host memory (no I/O: safe in the event loop),
        else None: the caller then reads it through ``get_stored`` in a worker thread. Its
        lease is appended to ``leases``."""
        top = self.store.tiers[0]
        if not isinstance(top, CpuTier) or top.info(key) is None:
            return None
        frame = top.get(key)
        if frame is not None:
            leases.append(frame.lease)
        return frame

    def wire_segments(self, namespace: str, frame: BlockFrame) -> list[Any]:
        """A stored frame as the client sent it: [header prefix, payload], payload not copied."""
        segments = frame.wire_segments()
        if not namespace:
            return segments
        meta = self.namespaces.rekey(namespace, frame.meta)  # XOR: back to the client's hashes
        payload = memoryview(frame.host).cast("B")[frame.meta.payload_offset :]
        prefix = header_prefix(meta)
        if len(prefix) != frame.meta.payload_offset:  # pragma: no cover - stored headers are packed here
            raise RuntimeError("a rekeyed header changed its aligned length")
        return [prefix, payload]

    def chain(self, namespace: str, h: bytes) -> list[tuple[bytes, BlockInfo]]:
        """Stored keys (and infos) of the chain ending at ``h``, head first. Positions must
        step down by one to 0 through the stored parent hashes; else the chain is incomplete.
        A block on its way down a tier (in none for a moment) is waited for, as a read does."""
        found = self.store.walk_past_moves(lambda: self._chain(namespace, h),
                                           missed=lambda out: isinstance(out, NotFound))
        if isinstance(found, NotFound):
            raise found
        return found

    def _chain(self, namespace: str, h: bytes) -> list[tuple[bytes, BlockInfo]] | NotFound:
        key = self.namespaces.stored_key(namespace, h)
        info = self.store.info(key)
        if info is None:
            return NotFound(f"block {to_hex(h)} is not stored")
        out = [(key, info)]
        while info.position > 0:
            parent = info.parent
            pinfo = self.store.info(parent)
            if pinfo is None or pinfo.position != info.position - 1:
                return NotFound(f"the chain ending at {to_hex(h)} is not complete: block at position "
                                f"{info.position - 1} is missing")
            out.append((parent, pinfo))
            info = pinfo
        out.reverse()
        return out

    def position(self, namespace: str, h: bytes) -> int | None:
        """The position block ``h`` is stored at, or None if it is not."""
        info = self.store.info(self.namespaces.stored_key(namespace, h))
        return None if info is None else info.position

    def stream_nbytes(self, chain: list[tuple[bytes, BlockInfo]]) -> int:
        return sum(LENGTH.size + info.nbytes for _, info in chain)

    def touch_chain(self, keys: list[bytes]) -> None:
        self.store.touch_chain(keys)

    def touch_block(self, namespace: str, h: bytes) -> None:
        """Mark block ``h`` used in every tier, as a hit (a read of one block)."""
        self.store.touch_chain([self.namespaces.stored_key(namespace, h)])

    def lookup(self, namespace: str, hashes: list[bytes], each: bool) -> dict[str, Any]:
        """The longest stored prefix of ``hashes`` (all of one size) and its tiers; with
        ``each``, also whether each hash is stored at all."""
        keys = self.namespaces.stored_keys(namespace, hashes)
        tiers = self.store.locate(keys)
        out: dict[str, Any] = {"matched": len(tiers), "tiers": tiers}
        if each:  # present as a put would answer it: committed at the acknowledgement level
            out["present"] = self.store.present_many(keys)
            out["durability"] = self.store.durability
            if tiers:
                # A writer's question before it extends a chain, as the embedded ingest's: its
                # stored prefix is marked used (recency, not a use), or the new blocks it then
                # sends, under a full tier, evicted that chain's own head, a leaf until they land,
                # and nothing of the longer chain was reachable.
                self.store.touch_chain(keys[: len(tiers)], count_use=False)
        return out

    def lookup_chains(self, namespace: str, chains: list[list[bytes]]) -> list[dict[str, Any]]:
        """``lookup`` of each of ``chains`` (without ``each``), as that many lookups would
        answer, with each tier asked once for all of them (``TieredStore.locate_many``)."""
        located = self.store.locate_many([self.namespaces.stored_keys(namespace, chain) for chain in chains])
        return [{"matched": len(tiers), "tiers": tiers} for tiers in located]

    def prefetch(self, namespace: str, hashes: list[bytes]) -> dict[str, Any]:
        """Start promoting the stored prefix of ``hashes`` into memory (``TieredStore.prefetch``)."""
        keys = self.namespaces.stored_keys(namespace, hashes)
        started = self.store.prefetcher.attempt(keys)
        if isinstance(started, Prefetch):
            return {"started": True, **started.to_dict(), "reason": None}
        reason = {
            "no_memory_tier": "this server has no memory tier to promote into (cpu_bytes is 0)",
            "nothing_stored": "nothing stored for this chain",
            "in_memory": "the chain's stored prefix is in memory already",
            "refused_busy": f"{self.store.prefetcher.max_in_flight} prefetches in flight already (max_prefetches)",
            "closed": "the server is shutting down",
        }[started.reason]
        return {"started": False, "matched": started.matched, "blocks": 0, "joined": 0, "reason": reason}

    def drain_at_shutdown(self, seconds: float, cut: threading.Event) -> DrainReport | None:
        """At a clean shutdown, once requests are done and before the store closes: write what
        only the memory tiers hold to the first persistent tier (``TieredStore.drain``) for at
        most ``seconds`` (0: not at all), logging how far it got; ``cut`` (a second SIGINT)
        stops it. None where it did not run: off, or a durable store (written through: its
        persistent tier has every block already, and asking a shared Redis which it holds would
        only cost the stop a round trip, or a timeout)."""
        if seconds <= 0 or self.store.durability == DURABLE:
            return None

        planned = False

        def progress(report: DrainReport) -> None:
            nonlocal planned
            if not planned:  # (its first call: the blocks to write are known, none written yet)
                planned = True
                if report.blocks:
                    log.info("shutdown: writing %s blocks (%s) that only memory holds to the %s tier, for at most "
                             "%g s (shutdown_drain_seconds; a second SIGINT stops it)", f"{report.blocks:,}",
                             format_size(report.bytes), report.tier, seconds)
                return
            log.info("shutdown: wrote %s of %s blocks (%s of %s) to the %s tier", f"{report.written:,}",
                     f"{report.blocks:,}", format_size(report.written_bytes), format_size(report.bytes), report.tier)

        report = self.store.drain(seconds=seconds, stop=cut.is_set, progress=progress,
                                  every_seconds=DRAIN_PROGRESS_SECONDS)
        if report.tier is None or not report.blocks:
            return report
        why = {"time limit": f"the time limit ran out (shutdown_drain_seconds {seconds:g} s)",
               "cut": "a second SIGINT stopped it",
               "no room": f"the {report.tier} tier had no room left but that of blocks this drain wrote, or pinned"}
        if report.stopped == "no room" and report.handed_on_to:
            why["no room"] = f"the {report.handed_on_to} tier had no room left for what the {report.tier} tier refused"
        left = f"; {why[report.stopped]}" if report.stopped else ""
        on = (f" ({report.handed_on:,} of them, which it refused, to the {report.handed_on_to} tier below it)"
              if report.handed_on_to else "")
        if report.not_admitted:  # (skipped, or handed on: its filter's not_admitted counts them too)
            on += f" ({report.not_admitted:,} not admitted by its filter, disk_admit_after_uses)"
        evicted = (f"; to make room it evicted {report.evicted:,} blocks the {report.tier} tier held before"
                   if report.evicted else "")
        log.log(logging.WARNING if report.left or report.failed else logging.INFO,
                "shutdown: wrote %s of %s blocks (%s of %s) that only memory held to the %s tier%s in %.1f s; skipped %s "
                "(not admitted, a tail without its head, or gone), failed %s%s, left behind %s (%s)%s%s",
                f"{report.written:,}", f"{report.blocks:,}", format_size(report.written_bytes),
                format_size(report.bytes), report.tier, on, report.seconds, f"{report.skipped:,}", f"{report.failed:,}",
                f" (the first: {report.first_error})" if report.first_error else "", f"{report.left:,}",
                format_size(report.left_bytes), evicted, left)
        return report

    def stats(self) -> dict[str, Any]:
        """The store's figures, with usage per owner (``namespaces``)."""
        return {**self.store.stats(), "namespaces": self.owners.usage()}

    def release_free_memory(self) -> None:
        """Hand the pages of the CPU tier's free memory back to the OS (after aborted uploads)."""
        top = self.store.tiers[0] if self.store.tiers else None
        if isinstance(top, CpuTier):
            top.release_free()

