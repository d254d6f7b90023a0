"""Admin operations over the store: usage per namespace and model, flushes, chain deletes, pins.

Each operation changes what it names and nothing else:

- ``flush(namespace, model)`` deletes the blocks the server attributes to them
  (``owners.Owners``), and those a shared Redis tier holds under their owner tag
  (``RedisKeys.owners``: whichever replica wrote them), tail first (highest position first), so that what a concurrent
  reader still finds is always a prefix. Blocks written while a flush runs are either
  deleted or stored whole: every tier stores and deletes a block in one step under its lock.
  Blocks a demotion has in flight (between two tiers, in neither) are waited for, and
  deleted where they land.
- ``delete_chain(namespace, hash)`` deletes the block, every block that extends it (they
  are unreachable without it), and its ancestors that no other stored chain goes through:
  chains sharing its head keep every block they use.
- ``pin``/``unpin`` keep a whole chain out of eviction in every tier (``TieredStore.pin``),
  until unpinned or for ``ttl_seconds``. Pins are kept in a small JSON file beside the disk
  tier (``PINS_FILE``) and applied again when the server starts.

With several replicas over one Redis, each replica's own tiers are its own: a flush through
one deletes from Redis every block of what it names, but another replica's CPU tier keeps
its copies; run a flush, delete or pin against every replica (``cacheseek admin --url A
--url B ...``). Each finds its copies whichever went first: a block a replica promoted from
Redis came with its owner tag, and is attributed by it, or kept with it (``stray_keys``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheseek.errors import StorageError, TierUnavailable
from cacheseek.hashing import to_hex
from cacheseek.store.tiered import DeleteFailed

from .errors import NotFound, TierUnreachable
from .owners import OTHER_MODEL
from .service import BlockService
from .state_files import read_state, replace_durably

log = logging.getLogger("cacheseek.server")

PINS_FILE = ".cacheseek-pins.json"
FILE_VERSION = 1
# Walks of a chain to delete, each after the demotions then in flight: two that agree end it
# (a chain's blocks move down a few times at most, each move changing the walk once).
WALKS = 8
# How often the pins a start could not make again (Redis unreachable then) are tried again.
# Each try costs nothing while Redis's breaker is open, and one timeout when it probes.
RESTORE_RETRY_SECONDS = 1.0


class AdminOps:
    def __init__(self, service: BlockService, state_dir: Path | None = None) -> None:
        self.service = service
        self.store = service.store
        self._lock = threading.Lock()  # one admin change at a time
        self._pins: dict[bytes, dict[str, Any]] = {}  # stored key of the chain's last block -> how it was pinned
        self._path = Path(state_dir) / PINS_FILE if state_dir is not None else None
        # Pins of the file that a start could not make again because a tier could not be asked
        # (Redis down): stored key -> its entry. Kept in the file and tried again until made
        # (or their chain is gone, or they expire): dropped, the next save lost them for good
        # and the chain stayed unpinned once Redis was back.
        self._unrestored: dict[bytes, dict[str, Any]] = {}
        self._chains_gone = 0  # pins of the file whose chains were no longer stored
        # stored key -> ((pinned_at, expires_at), its pins file entry as encoded for them)
        self._encoded: dict[bytes, tuple[tuple[float, float | None], str]] = {}
        self._stop = threading.Event()
        self._retrying: threading.Thread | None = None

    # -- usage ---------------------------------------------------------------------------

    def namespaces(self) -> list[dict[str, Any]]:
        """Per namespace: blocks, bytes, and the same per model within it."""
        return _group(self.service.owners.usage(), "namespace", "model", "models")

    def models(self) -> list[dict[str, Any]]:
        return _group(self.service.owners.usage(), "model", "namespace", "namespaces")

    # -- deletes -------------------------------------------------------------------------

    def flush(self, *, namespace: str | None = None, model: str | None = None) -> dict[str, Any]:
        owners = self.service.owners
        what = " and ".join(f"{k} {v!r}" for k, v in (("namespace", namespace), ("model", model)) if v is not None)
        known = owners.known(namespace=namespace, model=model)
        with self._lock:
            keys = owners.keys_of(namespace=namespace, model=model)
            # A block a demotion has on its way down now is in no tier, so owned by nobody
            # and not among ``keys``: it would reach the next tier after the flush and stay.
            # Once those moves are over it is held, and owned, again. (A block they evict
            # meanwhile is one of ``keys``: its delete takes the copy it lands as.)
            self.store.settle_moves()
            # Blocks a shared tier holds that no local index names (another replica's, or
            # evicted from here), found by the owner tag they were written with. Listed before
            # anything is deleted: a list cut short by an outage would delete part of a
            # tenant's blocks and answer as if done.
            match = self._tag_match(namespace, model)
            shared = self._shared_keys(match, what)
            # Blocks promoted here with a tag whose names this server did not know then: held
            # here unattributed, found by the tag (their Redis copies may be gone: flushed
            # through another replica first, expired, or evicted).
            stray = owners.stray_keys(match)
            if not known and not shared and not stray:
                hint = ""
                if model is not None and (full := owners.past_models(namespace, model)):
                    hint += (f"; namespace {full[0]!r} has {owners.max_models} models told apart, each holding "
                             f"blocks: a model past them is counted, and flushed, as {OTHER_MODEL!r} (flush --model "
                             f"{OTHER_MODEL} deletes every such model's blocks)")
                if any(hasattr(tier, "owned") for tier in self.store.tiers):
                    # (owner tags are keyed with the secret: another replica's are found only with its)
                    hint += ("; blocks other replicas wrote to Redis are found only where every replica has "
                             "the same namespace_secret")
                raise NotFound(f"no blocks were ever stored for {what} through this server{hint}")
            keys = list(dict.fromkeys([*keys, *owners.keys_of(namespace=namespace, model=model), *stray,
                                       *owners.stray_keys(match), *shared]))
            # A block whose Redis copy could not be deleted is kept in every tier: the flush
            # finds what to delete here, so a retry finds it again and deletes it there too
            # (deleted here alone, its Redis copy was named by nothing and served again).
            blocks, nbytes, unknown, gone = self._delete(keys, f"flush of {what}")
            self._forget_pins_of(gone)
        # (an operator's change to what is stored: said, as a start's removals are)
        log.info("admin: flush of %s deleted %d blocks (%s bytes)%s", what, blocks, f"{nbytes:,}",
                    f"; {unknown} kept, a tier that may hold them not reached" if unknown else "")
        if unknown:
            raise TierUnreachable(f"flush of {what}: a tier that may hold {unknown} of its {len(keys)} blocks could "
                                  f"not be reached, so those are kept (in every tier; {blocks} others deleted); retry")
        return {"namespace": namespace, "model": model, "deleted_blocks": blocks, "deleted_bytes": nbytes}

    def _tag_match(self, namespace: str | None, model: str | None) -> Callable[[str], bool]:
        """Whether an owner tag (``Namespaces.owner_tag``) is of ``namespace`` and ``model``
        (None: any)."""
        names = self.service.namespaces
        ns_tag = names.namespace_tag(namespace) if namespace is not None else None
        model_tag = names.model_tag(model) if model is not None else None

        def match(tag: str) -> bool:
            ns, _, mo = tag.partition(".")
            return (ns_tag is None or ns == ns_tag) and (model_tag is None or mo == model_tag)

        return match

    def _shared_keys(self, match: Callable[[str], bool], what: str) -> list[bytes]:
        found: list[bytes] = []
        for tier in self.store.tiers:
            if hasattr(tier, "owned"):
                try:
                    found += tier.owned(match)
                except StorageError as exc:
                    raise TierUnreachable(f"flush of {what}: the {tier.name} tier could not be reached to find "
                                          f"its blocks there ({exc}), so none was deleted; retry") from None
        return found

    def delete_chain(self, namespace: str, h: bytes) -> dict[str, Any]:
        store = self.store
        key = self.service.namespaces.stored_key(namespace, h)
        with self._lock:
            # A block a demotion has on its way down is in no tier for a moment, and a walk
            # misses it: a head another chain still goes through looked like this chain's
            # alone, a parent on its way ended the walk (and came back as a usable prefix),
            # the block itself was not found. Walked again once the moves in flight are over,
            # until two walks agree: what one missed in transit has landed for the next.
            doomed = self._doomed(key)
            for _ in range(WALKS):
                store.settle_moves()
                again = self._doomed(key)
                same = _blocks(again) == _blocks(doomed)
                doomed = again
                if same:
                    break
            if doomed is None:
                # Not found where asked: a tier that could not be asked (Redis) may hold it,
                # and a 404 would tell the admin it is gone. Its delete says which it is.
                if store.delete(key) is None:
                    raise TierUnreachable(f"block {to_hex(h)}: not in the tiers that answered, but a tier that may "
                                          "hold its chain could not be reached; retry")
                raise NotFound(f"block {to_hex(h)} is not stored in namespace {namespace!r} (X-CacheSeek-Namespace; "
                               "cacheseek admin --namespace)")
            blocks, nbytes, unknown, gone = self._delete(doomed, f"delete of the chain ending at {to_hex(h)}")
            self._forget_pins_of(gone)
        log.info("admin: delete of the chain ending at %s (namespace %r) deleted %d blocks (%s bytes)%s", to_hex(h),
                    namespace, blocks, f"{nbytes:,}",
                    f"; {unknown} kept, a tier that may hold them not reached" if unknown else "")
        if unknown:
            # Those are kept in every tier: a retry walks the chain again and finds them, its
            # descendants too (Redis keeps no index of children: deleted here alone, a
            # descendant's Redis copy was named by nothing and served again).
            raise TierUnreachable(f"chain ending at {to_hex(h)}: a tier that may hold {unknown} of its {len(doomed)} "
                                  "blocks could not be reached, so those are kept (in every tier); retry")
        return {"hash": to_hex(h), "deleted_blocks": blocks, "deleted_bytes": nbytes}

    def _doomed(self, key: bytes) -> list[bytes] | None:
        """The blocks a delete of the chain at ``key`` takes: it, every block that extends
        it, and its ancestors no other stored chain goes through; None if it is not stored."""
        store = self.store
        info = store.info(key)
        if info is None:
            return None
        doomed = [key, *store.descendants(key)]
        # Up the chain while no other stored chain goes through the parent.
        child, pinfo = key, info
        while pinfo.position > 0:
            parent = pinfo.parent
            if any(c != child for c in store.children(parent)):
                break
            up = store.info(parent)
            # Only a parent one position down is this chain's (as ``BlockService.chain``
            # reads it): a link that skips positions can close a cycle where a tier keeps no
            # index of children to refuse it (Redis), and this walk would never end.
            if up is None or up.position != pinfo.position - 1:
                break
            pinfo = up
            doomed.append(parent)
            child = parent
        return doomed

    def _delete(self, keys: list[bytes], what: str) -> tuple[int, int, int, set[bytes]]:
        """Delete ``keys``, highest position first; returns blocks and bytes deleted, how many
        of them a tier that may hold them (Redis) could not be asked to delete (those are kept
        in every tier: ``TieredStore.delete``'s ``all_or_nothing``), and the keys gone.

        A tier that fails a delete (the disk could not remove a block's files, or sync them
        away) raises ``StorageError`` (507) naming ``what``: the blocks from that one on are
        kept, for a retry to find and delete. The blocks deleted before it are forgotten by
        the owners' and pins' records as a whole delete's are: a retry finds its keys through
        those records and the indexes, which no longer hold them, so a pin of one was kept
        for good and pinned the chain again when a client wrote it again."""
        store = self.store
        infos = [(k, store.residency.info(k) or store.info(k)) for k in keys]
        infos.sort(key=lambda item: -(item[1].position if item[1] is not None else 0))
        blocks = nbytes = unknown = 0
        gone: set[bytes] = set()
        with self.service.owners.deleting() as forgotten:
            try:
                answers = store.delete_many([key for key, _ in infos], all_or_nothing=True)
            except DeleteFailed as exc:
                done = sum(1 for deleted in exc.results if deleted)
                before = {key for (key, _), deleted in zip(infos, exc.results) if deleted is not None}
                forgotten += before
                self._forget_pins_of(before)
                log.error("admin: %s failed after %d of its %d blocks: %s", what, done, len(keys), exc)
                raise StorageError(f"{what}: {exc} ({done} of its {len(keys)} blocks deleted before the failure, maybe "
                                   "not durably; the rest kept); retry once the disk is writable") from None
            for (key, info), deleted in zip(infos, answers):
                if deleted:
                    blocks += 1
                    nbytes += info.nbytes if info is not None else 0
                if deleted is None:
                    unknown += 1
                else:
                    gone.add(key)
            forgotten += gone
        return blocks, nbytes, unknown, gone

    # -- pins ----------------------------------------------------------------------------

    def pin(self, namespace: str, h: bytes, ttl_seconds: float | None = None, *,
            expires_at: float | None = None) -> dict[str, Any]:
        key = self.service.namespaces.stored_key(namespace, h)
        with self._lock:
            return self._pin(namespace, h, key, ttl_seconds, expires_at)

    def _pin(self, namespace: str, h: bytes, key: bytes, ttl_seconds: float | None,
             expires_at: float | None, pinned_at: float | None = None) -> dict[str, Any]:
        try:
            pin = self.store.pin(key, ttl_seconds=ttl_seconds, expires_at=expires_at, pinned_at=pinned_at)
        except TierUnavailable as exc:
            # Not a 404 ("not stored") nor a 507 (a full store): an outage, nothing pinned.
            raise TierUnreachable(f"the chain ending at {to_hex(h)}: a tier that may hold it or must keep its pin "
                                  f"could not be reached ({exc}), so nothing is pinned; retry") from None
        if pin is None:
            raise NotFound(f"the chain ending at {to_hex(h)} is not stored whole in namespace {namespace!r} "
                           "(X-CacheSeek-Namespace; cacheseek admin --namespace)")
        self._pins[key] = {"namespace": namespace, "hash": to_hex(h)}
        self._unrestored.pop(key, None)
        saved = self._save()
        return {**self._describe(key, pin), "saved": saved}

    def unpin(self, namespace: str, h: bytes) -> dict[str, Any]:
        key = self.service.namespaces.stored_key(namespace, h)
        with self._lock:
            pin = self.store.unpin(key)
            if pin is None:
                self._pins.pop(key, None)
                waiting = self._unrestored.pop(key, None)
                if waiting is not None:  # (not made again yet: it no longer will be)
                    saved = self._save()
                    return {"namespace": namespace, "hash": to_hex(h), "blocks": 0,
                            "pinned_at": waiting["pinned_at"], "expires_at": waiting["expires_at"],
                            "stored_blocks": 0, "bytes": 0, "saved": saved}
                raise NotFound(f"no pin on {to_hex(h)}")
            # Described before its name is forgotten: the answer names the chain it unpinned.
            described = self._describe(key, pin)
            self._pins.pop(key, None)
            saved = self._save()
        return {**described, "saved": saved}

    def pins(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every pin; ``waiting``: one of the pins file that a start could not make again
        (Redis unreachable), not in effect yet (no block pinned)."""
        out = []
        for pin in self.store.pins():
            desc = {**self._describe(pin.key, pin), "waiting": False}
            if namespace is None or desc["namespace"] == namespace:
                out.append(desc)
        with self._lock:
            waiting = [entry for key, entry in self._unrestored.items() if key not in self._pins]
        out += [{**entry, "blocks": 0, "stored_blocks": 0, "bytes": 0, "waiting": True}
                for entry in waiting
                if namespace is None or entry["namespace"] == namespace]
        return out

    def _describe(self, key: bytes, pin: Any) -> dict[str, Any]:
        named = self._pins.get(key, {"namespace": None, "hash": None})
        held = [info for info in (self.store.residency.info(k) for k in pin.keys) if info is not None]
        # ``stored_blocks`` < ``blocks``: a block of the chain was deleted (a block DELETE); the
        # pin still covers it, and it is pinned again once stored again.
        return {**named, **pin.to_dict(), "stored_blocks": len(held), "bytes": sum(info.nbytes for info in held)}

    def _forget_pins_of(self, deleted: set[bytes]) -> None:
        gone = [key for key in self._pins if key in deleted]
        for key in gone:
            self.store.unpin(key)
            self._pins.pop(key)
        waiting = [key for key in self._unrestored if key in deleted]
        for key in waiting:
            self._unrestored.pop(key)
        if gone or waiting:
            self._save()

    def restore_pins(self) -> int:
        """Pin again what the pins file names (those not expired, whose chains are stored)."""
        if self._path is None:
            return 0
        data = read_state(self._path, FILE_VERSION, "pins")
        if data is None:
            return 0
        now = time.time()
        entries = data.get("pins")
        expired = 0
        for entry in entries if isinstance(entries, list) else []:
            try:
                namespace, h, expires = str(entry["namespace"]), bytes.fromhex(entry["hash"]), entry.get("expires_at")
                key = self.service.namespaces.stored_key(namespace, h)
            except (KeyError, TypeError, ValueError):
                continue
            # An expiry that is not a finite number is skipped as any unreadable entry (compared
            # with the clock, a string stopped the server's start).
            if expires is not None and (isinstance(expires, bool) or not isinstance(expires, (int, float))
                                        or not math.isfinite(expires) or expires <= now):
                expired += isinstance(expires, (int, float)) and not isinstance(expires, bool)
                continue
            # When it was first pinned, kept across restarts ("since" of ``admin pins``); a file
            # of an older release has none, and one that is no time (or later than now: the
            # clock was set back) is unknown: the pin counts from now, as it always did.
            since = entry.get("pinned_at")
            if isinstance(since, bool) or not isinstance(since, (int, float)) or not math.isfinite(since) \
                    or since > now:
                since = None
            # Every entry waits until made: a save while the first are made keeps the rest.
            self._unrestored[key] = {"namespace": namespace, "hash": to_hex(h), "pinned_at": since,
                                     "expires_at": expires}
        self._chains_gone = 0
        made, _ = self._pin_unrestored(at_start=True)
        # Said once, counted: the pins a start drops (expired while the server was down, or
        # their chains no longer stored) went without a word, and an operator found fewer
        # pins than before the restart.
        if self._chains_gone:
            log.warning("pins file: %d pins made again; %d dropped whose chains are no longer stored whole, "
                        "%d expired while the server was down", made, self._chains_gone, expired)
        elif made or expired:
            log.info("pins file: %d pins made again; %d expired while the server was down", made, expired)
        if self._unrestored:
            self._retrying = threading.Thread(target=self._retry_unrestored, name="cacheseek-pins-restore", daemon=True)
            self._retrying.start()
        return made

    def _pin_unrestored(self, *, at_start: bool = False) -> tuple[int, bool]:
        """Make again the pins of the file not made yet: how many were made, and whether
        none is left. One that a tier could not be asked for (Redis unreachable) is kept,
        for the next try."""
        with self._lock:
            todo = list(self._unrestored.items())
        made = 0
        for key, entry in todo:
            namespace, h, expires = entry["namespace"], bytes.fromhex(entry["hash"]), entry["expires_at"]
            since = entry["pinned_at"]
            with self._lock:
                if self._unrestored.get(key) is not entry:
                    continue  # pinned or unpinned by an admin meanwhile: theirs stands
                why: BaseException | None = None
                try:
                    if expires is None or expires > time.time():
                        self._pin(namespace, h, key, None, expires, since)
                        made += 1
                        continue
                except NotFound:
                    self._chains_gone += 1  # (its chain is gone: not made again, as at any start)
                except TierUnreachable as exc:
                    if at_start:
                        log.warning("pin of %s in namespace %r not restored yet: %s (kept in the pins file, and "
                                    "made again once it can be)", entry["hash"], namespace, exc)
                        continue
                    return made, False  # (still unreachable: the rest would be too)
                except StorageError as exc:  # (a tier full of pins): not made again, as before
                    why = exc
                if why is not None:
                    log.warning("pin of %s in namespace %r not restored: %s", entry["hash"], namespace, why)
                del self._unrestored[key]
                self._save()
        with self._lock:
            return made, not self._unrestored

    def _retry_unrestored(self) -> None:
        while not self._stop.wait(RESTORE_RETRY_SECONDS):
            if self._pin_unrestored()[1]:
                return

    def close(self) -> None:
        """Stop trying again the pins a start could not make (they stay in the pins file)."""
        self._stop.set()
        if self._retrying is not None:
            self._retrying.join()

    def _save(self) -> bool | None:
        """Write the pins file: whether it was written (None: no disk tier, no file). A pin
        or unpin answers it, so that one a restart will not keep is not acknowledged as if
        it would be."""
        # The names of pins that expired go too: nothing else forgets them, and a pin made
        # with a TTL each time a prefix ran hot grew this table (and each save) for good.
        table = self.store.pin_table
        live = {key: pin for key in self._pins if (pin := table.get(key)) is not None}
        for key in [key for key in self._pins if key not in live]:
            del self._pins[key]
        if self._path is None:
            return None
        # Each entry is encoded once, and again only when its pin changes: a save encoded
        # every live pin, with json's pure-Python encoder (``indent``), ~5 us per live pin on
        # each pin and unpin (82% of a pin at 3,000 pins). Compact, the same version and
        # fields: the file is what json.dumps writes for it, and any release reads it.
        encoded = self._encoded
        parts = []
        for key, pin in live.items():
            known = encoded.get(key)
            if known is None or known[0] != (pin.pinned_at, pin.expires_at):
                text = json.dumps({**self._pins[key], "pinned_at": pin.pinned_at, "expires_at": pin.expires_at},
                                  separators=(",", ":"))
                known = encoded[key] = ((pin.pinned_at, pin.expires_at), text)
            parts.append(known[1])
        if len(encoded) > 2 * len(live) + 16:  # (those of pins gone since)
            self._encoded = {key: encoded[key] for key in live}
        parts += [json.dumps(entry, separators=(",", ":")) for key, entry in self._unrestored.items()
                  if key not in self._pins]
        if lost := self.store.lost_tiers():  # (the directory there now is not this server's to write in)
            log.warning("pins not saved to %s: %s (a restart keeps only those of the last save)", self._path,
                        "; ".join(f"the {name} tier's directory was {why} under the running server"
                                  for name, why in lost.items()))
            return False
        text = f'{{"version":{FILE_VERSION},"pins":[{",".join(parts)}]}}'
        tmp = self._path.with_name(f"{PINS_FILE}.{secrets.token_hex(4)}.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            replace_durably(tmp, self._path)
        except OSError as exc:
            # Said, not raised: the pin holds in this process; a restart would not make it again.
            log.warning("pins not saved to %s: %s (a restart keeps only those of the last save)", self._path, exc)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False
        return True


def _blocks(doomed: list[bytes] | None) -> frozenset[bytes] | None:
    return None if doomed is None else frozenset(doomed)


def _group(usage: list[dict[str, Any]], by: str, within: str, label: str) -> list[dict[str, Any]]:
    groups: dict[Any, dict[str, Any]] = {}
    for u in usage:
        g = groups.setdefault(u[by], {by: u[by], "blocks": 0, "used_bytes": 0, "raw_bytes": 0, label: []})
        for f in ("blocks", "used_bytes", "raw_bytes"):
            g[f] += u[f]
        g[label].append({within: u[within], "blocks": u["blocks"], "used_bytes": u["used_bytes"],
                         "raw_bytes": u["raw_bytes"]})
    return sorted(groups.values(), key=lambda g: (-g["used_bytes"], str(g[by])))
