"""Who owns each stored block: a (namespace, model) pair, for usage figures and admin flushes.

The store keys blocks by masked hashes and knows nothing of tenants, so the server tells it
nothing either; it keeps its own attribution, fed by the store's residency events
(``store.residency``: a block entering its first tier, leaving its last):

- a block the server is writing was announced first (``expect``): it belongs to the writer's
  namespace and model (``X-CacheSeek-Model``; "" when the client does not say);
- a block that left the store a moment ago enters it again as its owner's (a demotion:
  out of one tier, then into the next), as does a child whose parent is so on its way;
- a block promoted from a shared Redis tier is its owner tag's (``came_with``: the tag each
  block is written to Redis with, read in the same round trip as its frame), where this
  process knows the names behind the tag: an owner's it attributes, or those of a request
  it served (``heard``: a read in a namespace and model brings that namespace's blocks up,
  whichever replica wrote them); the root of a chain so attributed is kept as a writer's
  is, so its copies on disk are attributed again after a restart;
- any other block (recovered from disk, promoted with a tag not known here, a write that
  lost the announcement) inherits from its chain: a block at position 0 from its *root* (its parent
  hash as stored, which is the client's root masked by the namespace: one per namespace,
  model and codec configuration), a later one from its parent. Roots are few, so they are
  kept in a small JSON file beside the disk tier (``OWNERS_FILE``), and blocks recovered at
  start are attributed again through them. The root is whatever parent hash a client's
  position-0 frame names, so at most ``max_roots`` are kept: past it, a new root is not
  remembered (its chains are attributed while written, and unattributed after a restart).

A block whose chain cannot be traced (its head gone, or written before the root was
known) is *unattributed* (namespace None); one that came up from Redis keeps its tag here
(``stray_keys``), so a flush of its namespace or model still finds it once Redis has let go
of it. Blocks only a shared Redis tier holds are not seen here (Redis has no local index):
usage counts the local tiers. A flush finds those through the owner tag each block is
written to Redis with (``tag_of``, kept beside its entry in the shared index), whichever
process wrote it.

Events arrive under a tier's lock: every method they call is a few dict operations.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheseek.store.tier import BlockInfo

from .state_files import read_state, replace_durably

log = logging.getLogger("cacheseek.server")

OWNERS_FILE = ".cacheseek-owners.json"
FILE_VERSION = 1
UNATTRIBUTED = 0  # owner id of blocks whose chain cannot be traced
OTHER_MODEL = "_other"  # a namespace's models past ``max_models``, counted as one


@dataclass(slots=True)
class Usage:
    blocks: int = 0
    used_bytes: int = 0
    raw_bytes: int = 0


class Owners:
    def __init__(self, state_dir: Path | None = None, *, max_owners: int = 4096, max_models: int = 64,
                 max_roots: int = 4096, max_namespace_roots: int = 256, max_left: int = 1 << 16,
                 directory_held: Callable[[], bool] = lambda: True) -> None:
        """``directory_held``: whether ``state_dir`` is still the one the server opened (its
        disk tier gave up a directory deleted or replaced under it: ``DiskTier.lost``); the
        file is not written into another's."""
        self._lock = threading.Lock()
        self.max_owners = max_owners
        self.max_models = max_models
        self._models: dict[str | None, int] = {}  # namespace -> models told apart in it
        self._of_namespace: dict[str | None, list[int]] = {}  # namespace -> its owners' ids
        self.max_roots = max_roots
        self.max_namespace_roots = max_namespace_roots
        self._namespace_roots: dict[str | None, int] = {}  # namespace -> roots kept for its owners
        self._names: list[tuple[str | None, str]] = [(None, "")]  # id -> (namespace, model)
        self._ids: dict[tuple[str | None, str], int] = {}
        self._usage: list[Usage] = [Usage()]
        self._roots: dict[bytes, int] = {}  # stored root -> owner id
        self._of: dict[bytes, int] = {}  # stored key -> owner id, for blocks held
        # Stored key -> owner id of the blocks that left the store last, oldest first. A block
        # demoted leaves one tier before it enters the next (a chain goes down tail first,
        # each victim in no tier meanwhile): it, and a child entering before it, are
        # attributed through this. A key is one namespace's for good (keys are masked by it).
        self._left: dict[bytes, int] = {}
        self.max_left = max_left
        # Per ``_left`` entry, the ``gone`` event that made it (``_gone_seq`` counts them): a
        # delete drops only the entries made before it began (``deleting``).
        self._gone_seq = 0
        self._left_seq: dict[bytes, int] = {}
        # .deleting: the blocks leaving the store on this thread are deleted, not moved down
        self._thread = threading.local()
        # keys being written -> the owner ids of the writes in flight, first announced first:
        # two writers of one block (clients sharing a prompt) each settle their own.
        self._expected: dict[bytes, list[int]] = {}
        # (namespace, model) -> the tag a shared Redis keeps for the owner (set by the server)
        self.tagger: Any = None
        self._tags: list[str] = [""]  # id -> tag ("" for unattributed)
        self._owner_of_tag: dict[str, int] = {}  # the tags in ``_tags`` -> their ids
        # Tags of the (namespace, model) pairs requests were served in (``heard``), newest
        # last, at most ``max_owners``: the names behind the tags of blocks they bring up.
        self._heard: dict[tuple[str, str], str] = {}
        self._heard_tags: dict[str, tuple[str, str]] = {}
        # Stored key -> the owner tag its frame came up from Redis with (``came_with``), until
        # it enters a local tier (``appeared``), at most ``max_left`` (a read not promoted
        # leaves its entry, dropped oldest first).
        self._came: dict[bytes, str] = {}
        # Unattributed blocks held that came up with a tag (one not known here): a flush
        # matches it (``stray_keys``). Blocks of a (namespace, model) never named here.
        self._stray: dict[bytes, str] = {}
        self._path = Path(state_dir) / OWNERS_FILE if state_dir is not None else None
        self._directory_held = directory_held
        self._save_lock = threading.Lock()  # one writer of the file at a time, newest last
        self._load()

    # -- the writer's side -----------------------------------------------------------------

    def owner_id(self, namespace: str, model: str) -> int:
        """The id of (namespace, model), made on first use; ``UNATTRIBUTED`` once
        ``max_owners`` exist (a bound on what a client can make the server remember). A
        namespace's models past ``max_models`` are one owner, ``OTHER_MODEL``: a client names
        its model freely, and one naming thousands used up every id, after which the blocks
        of every namespace and model first seen were nobody's (a flush of that namespace
        found none of them). A new model of a namespace at ``max_models`` takes the place of
        one that holds nothing now (flushed, or evicted): models replaced over a server's
        life (a new ``model_id`` per weight update) stay told apart, and flushed by name.
        A writer asks ``expect_as``, which announces its blocks in the same step."""
        with self._lock:
            got, new_root = self._owner_id(namespace, model)
        if new_root:
            self._save()  # (the roots of the model it replaced are gone from the file)
        return got

    def _owner_id(self, namespace: str, model: str, *, take_place: bool = True) -> tuple[int, bool]:
        """(Under the lock.) ``owner_id``, and whether roots were forgotten (a place taken).
        ``take_place=False``: a model past ``max_models`` is ``OTHER_MODEL``, no idle model's
        place taken (whose forgotten roots would want the file saved: not under a tier's lock)."""
        key = (namespace, model)
        got = self._ids.get(key)
        if got is not None:
            return got, False
        new_root = False
        if model != OTHER_MODEL and self._models.get(namespace, 0) >= self.max_models:
            got, new_root = self._take_place(key) if take_place else (None, False)
            if got is None:
                key = (namespace, OTHER_MODEL)
                got = self._ids.get(key)
        if got is None:
            if len(self._names) > self.max_owners:
                return UNATTRIBUTED, False
            got = len(self._names)
            self._names.append(key)
            self._usage.append(Usage())
            self._ids[key] = got
            self._of_namespace.setdefault(namespace, []).append(got)
            if key[1] != OTHER_MODEL:
                self._models[namespace] = self._models.get(namespace, 0) + 1
        return got, new_root

    def expect_as(self, namespace: str, model: str, blocks: Iterable[tuple[bytes, bytes, int]]) -> int:
        """``owner_id`` of (namespace, model) and ``expect`` of its ``blocks``, in one step:
        apart, an id just given was idle (no block, no write announced) until the announce,
        and a new model of a full namespace could take its place meanwhile (two models'
        writes counted, tagged and flushed as one)."""
        with self._lock:
            owner, replaced = self._owner_id(namespace, model)
            new_root = self._expect(owner, blocks)
        if replaced or new_root:
            self._save()
        return owner

    def _take_place(self, key: tuple[str | None, str]) -> tuple[int | None, bool]:
        """(Under the lock.) The id of a model of ``key``'s namespace that holds no block and
        has none being written, given to ``key``: its roots forgotten (blocks under them
        would be the new model's), its tag made again; and whether it had roots (the file
        is saved again). None if every model holds some."""
        # (Blocks of it between tiers, gone from one and not yet in the next, are in ``_left``.)
        idle = [o for o in self._of_namespace.get(key[0], ())
                if self._names[o][1] != OTHER_MODEL and not self._usage[o].blocks]
        if not idle:
            return None, False
        busy = {o for writers in self._expected.values() for o in writers} | set(self._left.values())
        got = next((o for o in idle if o not in busy), None)
        if got is None:
            return None, False
        roots = [r for r, o in self._roots.items() if o == got]
        for root in roots:
            del self._roots[root]
            self._namespace_roots[key[0]] -= 1
        for left in [k for k, o in self._left.items() if o == got]:
            del self._left[left]
        del self._ids[self._names[got]]
        self._names[got] = key
        self._usage[got] = Usage()
        self._ids[key] = got
        if got < len(self._tags):
            self._owner_of_tag.pop(self._tags[got], None)
            self._tags[got] = tag = self.tagger(*key) if self.tagger is not None and key[0] is not None else ""
            if tag:
                self._owner_of_tag[tag] = got
        return got, bool(roots)

    def past_models(self, namespace: str | None, model: str) -> list[str]:
        """The namespaces (``namespace``, or any) where ``model`` would be counted as
        ``OTHER_MODEL`` now: their ``max_models`` told apart, each holding blocks."""
        with self._lock:
            return [ns for ns, n in self._models.items() if ns is not None and n >= self.max_models
                    and (namespace is None or ns == namespace) and (ns, model) not in self._ids
                    and model != OTHER_MODEL]

    def expect(self, owner: int, blocks: Iterable[tuple[bytes, bytes, int]]) -> None:
        """Announce blocks about to be written by ``owner``: (stored key, stored parent,
        position). A block at position 0 makes its parent (the masked root) this owner's."""
        with self._lock:
            new_root = self._expect(owner, blocks)
        if new_root:
            self._save()

    def _expect(self, owner: int, blocks: Iterable[tuple[bytes, bytes, int]]) -> bool:
        """(Under the lock.) ``expect``; whether a root was kept (the file is saved again)."""
        new_root = False
        for key, parent, position in blocks:
            self._expected.setdefault(key, []).append(owner)
            if position == 0 and owner != UNATTRIBUTED and self._roots.get(parent) != owner:
                # Each new root rewrites the whole file: without a bound, a writer naming a
                # fresh parent in every frame grew it (and each write's cost) for good. And
                # a bound per namespace: one writer naming thousands used up the file's, and
                # every other namespace's new roots went unkept (after a restart, their
                # blocks were nobody's).
                if parent not in self._roots and not self._room_for_root(owner):
                    continue
                self._keep_root(parent, owner)
                new_root = True
        return new_root

    def _room_for_root(self, owner: int) -> bool:
        return len(self._roots) < self.max_roots \
            and self._namespace_roots.get(self._names[owner][0], 0) < self.max_namespace_roots

    def _keep_root(self, root: bytes, owner: int) -> None:
        """(Under the lock.) ``root`` is ``owner``'s, counted in its namespace's roots."""
        before = self._roots.get(root)
        if before is not None:
            self._namespace_roots[self._names[before][0]] -= 1
        self._roots[root] = owner
        namespace = self._names[owner][0]
        self._namespace_roots[namespace] = self._namespace_roots.get(namespace, 0) + 1

    def keep_for_children(self, key: bytes) -> None:
        """``key`` is about to be deleted while blocks that extend it stay: keep it as a root
        of its owner (saved before the delete), so that after a restart they are still
        attributed through it, as a chain's head is through its parent. Without it they were
        nobody's, and a flush of their namespace passed them by while it still served them.
        Kept within the same bounds as the roots (a namespace that deletes many parents uses
        up its own roots only)."""
        with self._lock:
            owner = self._of.get(key, UNATTRIBUTED)
            if owner == UNATTRIBUTED or self._roots.get(key) == owner:
                return
            if key not in self._roots and not self._room_for_root(owner):
                return
            self._keep_root(key, owner)
        self._save()

    def settle(self, owner: int, keys: Iterable[bytes]) -> None:
        """``owner``'s writes announced for ``keys`` are done (stored, found present, or
        failed); another writer's announcement of the same key stands."""
        with self._lock:
            for key in keys:
                writers = self._expected.get(key)
                if writers is None:
                    continue
                try:
                    writers.remove(owner)
                except ValueError:
                    pass
                if not writers:
                    del self._expected[key]

    # -- the reader's side ---------------------------------------------------------------

    def heard(self, namespace: str, model: str) -> None:
        """A request in (``namespace``, ``model``) is about to read blocks, which may come up
        from a shared tier written by another process (``came_with``): their tag is told by
        these names. Keys are masked per namespace, so what the request finds is its
        namespace's; a replica that never wrote it counted it unattributed (its chain's root
        unknown here), and a flush of the namespace passed it by. One dict look-up once heard."""
        if (namespace, model) in self._heard or self.tagger is None:
            return
        tag = self.tagger(namespace, model)  # (two keyed hashes, once per pair heard)
        with self._lock:
            if len(self._heard) >= self.max_owners:  # (names a client makes up: bounded, oldest out)
                oldest = next(iter(self._heard))
                self._heard_tags.pop(self._heard.pop(oldest), None)
            self._heard[(namespace, model)] = tag
            self._heard_tags[tag] = (namespace, model)

    def came_with(self, tagged: Iterable[tuple[bytes, str]], heads: Iterable[tuple[bytes, str]] = ()) -> None:
        """Blocks a shared tier's read found, each with the owner tag it was written with,
        about to be promoted: ``appeared`` attributes them by it (the one round trip that read
        the frames read the tags). ``heads``: (stored root, tag) of those at position 0. A
        tag kept only here was gone at a restart: the copies on disk came back nobody's, and
        a flush of their namespace passed them by once another replica's flush had taken
        Redis's. So a root a tag names an owner of is kept as a writer's is (the file saved
        here, with no tier's lock held), and ``adopt`` attributes the chain under it again."""
        new_root = False
        with self._lock:
            for key, tag in tagged:
                self._keep_came(key, tag)
            for root, tag in heads:
                owner = self._owner_of(tag)
                if owner is None or owner == UNATTRIBUTED or self._roots.get(root) == owner:
                    continue
                if root not in self._roots and not self._room_for_root(owner):
                    continue
                self._keep_root(root, owner)
                new_root = True
        if new_root:
            self._save()

    def _keep_came(self, key: bytes, tag: str) -> None:
        """(Under the lock.) ``key``'s tag until it enters a local tier; the oldest out past
        ``max_left``."""
        self._came[key] = tag
        while len(self._came) > self.max_left:
            del self._came[next(iter(self._came))]

    def _owner_of(self, tag: str) -> int | None:
        """(Under the lock.) The owner a tag names, made if its names were heard; None if this
        process knows no names behind it."""
        self._tag_owners()
        got = self._owner_of_tag.get(tag)
        if got is not None:
            return got
        names = self._heard_tags.get(tag)
        if names is None:
            return None
        return self._owner_id(*names, take_place=False)[0]

    def _tag_owners(self) -> None:
        """(Under the lock.) The tag of every owner made so far (tags are made once per owner:
        two keyed hashes). None before the server sets ``tagger``."""
        if self.tagger is None:
            return
        while len(self._tags) < len(self._names):
            namespace, model = self._names[len(self._tags)]
            tag = self.tagger(namespace, model) if namespace is not None else ""
            if tag:
                self._owner_of_tag[tag] = len(self._tags)
            self._tags.append(tag)

    # -- residency events (under a tier's lock) ------------------------------------------------

    def appeared(self, key: bytes, info: BlockInfo) -> None:
        with self._lock:
            writers = self._expected.get(key)
            left = self._left.pop(key, None)
            self._left_seq.pop(key, None)
            tag = self._came.pop(key, None) if self._came else None
            owner = writers[0] if writers else left
            if owner is None and tag is not None:
                owner = self._owner_of(tag)
            if owner is None:
                owner = self._roots.get(info.parent, UNATTRIBUTED) if info.position == 0 \
                    else self._of.get(info.parent, self._left.get(info.parent,
                                                                  self._roots.get(info.parent, UNATTRIBUTED)))
            if owner == UNATTRIBUTED and tag is not None:
                self._stray[key] = tag
            self._of[key] = owner
            u = self._usage[owner]
            u.blocks += 1
            u.used_bytes += info.nbytes
            u.raw_bytes += info.raw_nbytes

    def gone(self, key: bytes, info: BlockInfo) -> None:
        with self._lock:
            owner = self._of.pop(key, UNATTRIBUTED)
            if owner == UNATTRIBUTED and self._stray:
                tag = self._stray.pop(key, None)
                if tag is not None and not getattr(self._thread, "deleting", False):
                    # (on its way down a tier, as ``_left`` is for an owner's: the copy it
                    # lands as keeps its tag, and its flush)
                    self._keep_came(key, tag)
            self._gone_seq += 1
            if owner != UNATTRIBUTED and not getattr(self._thread, "deleting", False):
                self._left[key] = owner
                self._left_seq[key] = self._gone_seq
                if len(self._left) > self.max_left:
                    oldest = next(iter(self._left))
                    del self._left[oldest]
                    self._left_seq.pop(oldest, None)
            u = self._usage[owner]
            u.blocks -= 1
            u.used_bytes -= info.nbytes
            u.raw_bytes -= info.raw_nbytes

    @contextmanager
    def deleting(self) -> Iterator[list[bytes]]:
        """Around deletes made on this thread; the caller adds the keys deleted to the list
        given. Those blocks leave for good, not on their way down (``_left``, which holds
        their model's place: ``_take_place``), and an entry kept for one of them before the
        delete began (a demotion under way) is dropped. A client may write one again
        meanwhile, and a write-back move it down on another thread: that copy's entry is
        kept, or it lands in the next tier as nobody's (a flush of its model then passed it
        by). The delete's own events are this thread's, so they are told apart by thread."""
        with self._lock:
            since = self._gone_seq
        self._thread.deleting = True
        deleted: list[bytes] = []
        try:
            yield deleted
        finally:
            self._thread.deleting = False
            with self._lock:
                for key in deleted:
                    if self._left_seq.get(key, since + 1) <= since:
                        del self._left[key], self._left_seq[key]

    def adopt(self, held: list[tuple[bytes, BlockInfo]]) -> None:
        """Attribute blocks held before this listened (sorted by position: parents first)."""
        for key, info in held:
            self.appeared(key, info)

    # -- reading -----------------------------------------------------------------------------

    def usage(self) -> list[dict[str, Any]]:
        """Per owner holding blocks (or known): namespace (None: unattributed), model, figures."""
        with self._lock:
            out: list[dict[str, Any]] = []
            for (namespace, model), u in zip(self._names, self._usage):
                if u.blocks or (namespace is not None and (namespace, model) in self._ids):
                    out.append({"namespace": namespace, "model": model, "blocks": u.blocks,
                                "used_bytes": u.used_bytes, "raw_bytes": u.raw_bytes})
        out.sort(key=lambda u: (-u["used_bytes"], u["namespace"] or "", u["model"]))
        return out

    def known(self, *, namespace: str | None = None, model: str | None = None) -> bool:
        """Whether any owner matches (namespace and/or model)."""
        return any(_matches(name, namespace, model) for name in self._names[1:])

    def keys_of(self, *, namespace: str | None = None, model: str | None = None) -> list[bytes]:
        """Keys held (locally) by the owners that match."""
        with self._lock:
            ids = {i for i, name in enumerate(self._names) if i != UNATTRIBUTED and _matches(name, namespace, model)}
            return [key for key, owner in self._of.items() if owner in ids]

    def stray_keys(self, match: Callable[[str], bool]) -> list[bytes]:
        """Unattributed keys held whose owner tag (as they came up from a shared tier)
        ``match`` accepts: a flush's, of names this process never knew when they came."""
        with self._lock:
            return [key for key, tag in self._stray.items() if match(tag)]

    def tag_of(self, key: bytes) -> str:
        """The owner tag of a block about to be written to a shared tier ("" if nobody's):
        the writer's announced, else its holder's (a demotion's copy, or its last one), else
        the tag it came up from a shared tier with."""
        with self._lock:
            writers = self._expected.get(key)
            owner = writers[0] if writers else self._of.get(key, self._left.get(key, UNATTRIBUTED))
            if owner == UNATTRIBUTED:  # (a block that came up with a tag not known here keeps it)
                return self._stray.get(key) or self._came.get(key, "")
            if self.tagger is None:
                return ""
            self._tag_owners()
            return self._tags[owner]

    def owner_of(self, key: bytes) -> tuple[str | None, str]:
        return self._names[self._of.get(key, UNATTRIBUTED)]

    # -- the roots file ------------------------------------------------------------------

    def _load(self) -> None:
        if self._path is None:
            return
        data = read_state(self._path, FILE_VERSION, "owners")
        if data is None:
            return  # attribution starts afresh (usage of old blocks shows unattributed)
        roots = data.get("roots")
        for entry in roots if isinstance(roots, list) else []:  # (anything else raised: no start)
            try:
                namespace, model, root = str(entry["namespace"]), str(entry["model"]), bytes.fromhex(entry["root"])
            except (KeyError, TypeError, ValueError):
                continue
            owner = self.owner_id(namespace, model)
            if owner != UNATTRIBUTED and (root in self._roots or self._room_for_root(owner)):
                self._keep_root(root, owner)

    def _save(self) -> None:
        """Write the roots table: temp file, fsync, rename, directory fsync (a crash or a power cut
        leaves the old or the new)."""
        if self._path is None or not self._directory_held():
            return
        with self._save_lock:
            self._write()

    def _write(self) -> None:
        assert self._path is not None
        with self._lock:
            roots = [{"root": root.hex(), "namespace": self._names[o][0], "model": self._names[o][1]}
                     for root, o in self._roots.items()]
        text = json.dumps({"version": FILE_VERSION, "roots": roots}, indent=1)
        tmp = self._path.with_name(f"{OWNERS_FILE}.{secrets.token_hex(4)}.tmp")
        try:
            self._path.parent.mkdir(0o700, parents=True, exist_ok=True)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            replace_durably(tmp, self._path)
        except OSError as exc:
            # Said, not raised: the write that named a new root is stored all the same. After a
            # restart, that root's blocks are counted as nobody's until it is written again.
            log.warning("owners not saved to %s: %s", self._path, exc)
            try:
                tmp.unlink()
            except OSError:
                pass


def _matches(name: tuple[str | None, str], namespace: str | None, model: str | None) -> bool:
    return (namespace is None or name[0] == namespace) and (model is None or name[1] == model)


__all__ = ["OTHER_MODEL", "OWNERS_FILE", "Owners", "UNATTRIBUTED"]
