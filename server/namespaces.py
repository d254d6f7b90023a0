"""Namespaces: tenants share one store, and one tenant's hashes never reach another's blocks.

A block is stored under ``q = h XOR mask(namespace)``, where ``mask`` is a keyed BLAKE2b of
the namespace under a server secret, cut to the hash's size. The default namespace ``""``
has the zero mask, so single-tenant frames are stored byte for byte as sent (and a disk
directory is shared with an embedded ``PrefixCache``). In any other namespace the frame's
header is rewritten on the way in (``hash`` and ``parent`` masked; the payload and its
checksum are untouched) and back on the way out, so clients only ever see their own hashes,
and the store's own chain walk (parent links) works on the stored keys.

Why a secret: without one, a tenant who learned another tenant's hash ``h`` (it can often be
computed from a guessed prompt) and knew both namespace names could send
``h ^ mask(a) ^ mask(b)`` in its own namespace and hit the other's block. The masks are
never revealed (no route returns a stored key), so that difference cannot be computed.
Why XOR and not a one-way hash: frames must go back out under the client's hashes,
including the parent hash of each frame in a chain, which must be recoverable.

The secret comes from ``namespace_secret``, else from ``<disk_path>/.namespace-key``
(created on first start, mode 0600, so restarts keep finding their blocks: by a hard link of
a whole temporary file, or, on a filesystem without hard links, exclusively created and
written in place), else (no disk
tier) it is random for the life of the process: with a Redis tier, whose blocks outlive the
process, the start says so at WARNING (named namespaces' blocks there are lost to the next start).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import struct
import time
from dataclasses import replace
from pathlib import Path

import msgpack

from cacheseek.errors import ConfigError
from cacheseek.store.frame import FrameMeta, header_prefix
from .owners import OWNERS_FILE
from .state_files import fsync_dir, write_text_durably

KEY_FILE = ".namespace-key"
# A fingerprint of the secret the blocks beside it were stored under (BLAKE2b of it, which
# gives nothing of it back): a start under another secret is said, its named namespaces'
# blocks unreachable. It was not (key file to namespace_secret, one secret for another).
SECRET_ID_FILE = ".namespace-secret-id"
MIN_SECRET_BYTES = 16  # of namespace_secret (UTF-8): a shorter key is guessable
KEY_BYTES = 32  # of a key file this server makes
# link(2) refused by a filesystem that has no hard links (exFAT and FAT: EPERM; FUSE mounts of
# object stores: ENOSYS, EOPNOTSUPP, or EROFS from a FUSE layer that does not implement it).
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EROFS})
# How long a start that lost the race to make the key file waits for the winner's key to be
# written whole (where it is written in place: no hard links).
KEY_WRITE_WAIT_SECONDS = 5.0


def load_secret(explicit: bytes | None, disk_path: Path | None, *, shared_tier: bool = False) -> bytes:
    """The namespace secret: ``explicit``, else the key file in ``disk_path``, else random.
    ``shared_tier``: the store has a tier that outlives the process (Redis), whose blocks a
    random secret leaves behind at the next start: said once, at WARNING. With a disk tier,
    a secret other than the one its blocks were stored under is said (``SECRET_ID_FILE``)."""
    secret, said = _load_secret(explicit, disk_path, shared_tier)
    if disk_path is not None:
        _check_secret_id(Path(disk_path), secret, explicit, said)
    return secret


def _check_secret_id(disk_path: Path, secret: bytes, explicit: bytes | None, said: bool) -> None:
    """``said``: the change was told already (the key file missing, a new key made)."""
    log = logging.getLogger("cacheseek.server")
    path = disk_path / SECRET_ID_FILE
    mine = _secret_id(secret)
    try:
        before: str | None = path.read_text("ascii").strip()
    except FileNotFoundError:
        before = None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cacheseek serve: %s cannot be read (%s): a namespace secret other than the last start's would "
                    "go unsaid", path, exc)
        return
    if before is None and explicit:
        # (a directory of a release before the file: its key file, if any, names its secret)
        try:
            if (kept := (disk_path / KEY_FILE).read_bytes()) != explicit and len(kept) >= MIN_SECRET_BYTES:
                before = _secret_id(kept)
        except OSError:
            pass
    if before == mine:
        return
    if before is not None and not said:
        log.warning("cacheseek serve: the namespace secret is not the one the blocks in %s were stored under (%s "
                    "holds the last one's fingerprint): the blocks of named namespaces (any but the default \"\") "
                    "stored under it cannot be found, and age out of the tier. Give the earlier namespace_secret "
                    "(or its key file) back to reach them", disk_path, SECRET_ID_FILE)
    try:
        write_text_durably(path, mine + "\n")
    except OSError as exc:
        log.warning("cacheseek serve: %s not written (%s): a later change of the namespace secret would go unsaid",
                    path, exc)


def _secret_id(secret: bytes) -> str:
    return hashlib.blake2b(secret, digest_size=16, person=b"cacheseek-ns-id").hexdigest()


def _load_secret(explicit: bytes | None, disk_path: Path | None, shared_tier: bool) -> tuple[bytes, bool]:
    """The secret, and whether a new key file was made where an earlier start stored blocks
    (said here)."""
    if explicit:
        return explicit, False
    if disk_path is None:
        if shared_tier:
            logging.getLogger("cacheseek.server").warning(
                "cacheseek serve: a Redis tier is set but no namespace_secret, and no disk tier keeps a namespace "
                "key: this process uses a random one, so the blocks it stores in Redis in named namespaces "
                "(any namespace but the default \"\") become unreachable at its next restart (they age out of "
                "Redis, held in its budget until then), and other servers sharing the Redis never find them. Set "
                "namespace_secret, the same on every server sharing the Redis")
        return secrets.token_bytes(32), False
    path = Path(disk_path) / KEY_FILE
    try:
        return _checked_key(path, path.read_bytes()), False
    except FileNotFoundError:
        pass
    said = (path.parent / OWNERS_FILE).exists() or (path.parent / SECRET_ID_FILE).exists()
    if said:
        # (an earlier start stored blocks here: those of named namespaces were masked with the
        # key now missing, and a new one silently made them unreachable)
        logging.getLogger("cacheseek.server").warning(
            "cacheseek serve: %s is missing from a disk directory an earlier start stored blocks in: a new "
            "namespace key is made, and the blocks stored in named namespaces under the old one cannot be "
            "found (they age out of the tier). Restore the file, or give namespace_secret to keep a key "
            "across starts", path)
    path.parent.mkdir(0o700, parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f"{KEY_FILE}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # first writer wins; a concurrent start reads the winner's key
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        _create_in_place(path, key)
    finally:
        os.unlink(tmp)
    # The key's entry durable before any block masked with it is acknowledged: without it,
    # every namespaced block on disk would be unreachable after a power cut.
    fsync_dir(path.parent)
    return _checked_key(path, path.read_bytes()), said


def _create_in_place(path: Path, key: bytes) -> None:
    """The key file made without a hard link: created exclusively, so one start's key wins as
    with the link (a rename would replace a key another start may have used already), then
    written and synced. A start that finds it made waits for the key to be written whole;
    a failed write removes the file, which every later start would refuse as too short."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + KEY_WRITE_WAIT_SECONDS
        while path.stat().st_size < KEY_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def check_key_file(disk_path: Path | None) -> None:
    """``ConfigError`` if ``disk_path`` holds a key file too short to be one (truncated, or
    written by hand): said before the store opens. A new key is never made in its place:
    every namespaced block on disk would be unreachable under it."""
    if disk_path is not None:
        path = Path(disk_path) / KEY_FILE
        try:
            _checked_key(path, path.read_bytes())
        except FileNotFoundError:
            pass


def _checked_key(path: Path, key: bytes) -> bytes:
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(f"namespace key: {path} holds {len(key)} bytes, not a key (at least {MIN_SECRET_BYTES}): "
                          "restore it from a backup, or remove it to start with a new key (the blocks stored in "
                          "namespaces other than the default one are then unreachable)")
    return key


class Namespaces:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"namespace_secret: at least {MIN_SECRET_BYTES} bytes")
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"cacheseek-ns").digest()
        self._masks: dict[tuple[str, int], bytes] = {}

    def mask(self, namespace: str, size: int) -> bytes:
        if not namespace:
            return bytes(size)
        got = self._masks.get((namespace, size))
        if got is None:
            got = hashlib.blake2b(namespace.encode(), key=self._key, digest_size=64).digest()[:size]
            if len(self._masks) < 100_000:
                self._masks[(namespace, size)] = got
        return got

    def stored_key(self, namespace: str, h: bytes) -> bytes:
        """The store's key for the client's hash ``h`` (its own inverse: XOR)."""
        if not namespace:
            return bytes(h)
        return _xor(h, self.mask(namespace, len(h)))

    client_hash = stored_key  # XOR is an involution

    def owner_tag(self, namespace: str, model: str) -> str:
        """How a shared Redis names the owner of a block (``RedisKeys.owners``):
        ``<namespace tag>.<model tag>``, keyed like the masks, so every replica sharing the
        secret (as they must, to share blocks) names an owner alike, and Redis holds no
        tenant's or model's name. Each part alone picks a flush's blocks: a namespace's (all
        its models), a model's (in every namespace), or both."""
        return f"{self.namespace_tag(namespace)}.{self.model_tag(model)}"

    def namespace_tag(self, namespace: str) -> str:
        return self._tag(b"ns", namespace)

    def model_tag(self, model: str) -> str:
        return self._tag(b"model", model)

    def _tag(self, kind: bytes, name: str) -> str:
        return hashlib.blake2b(kind + b":" + name.encode(), key=self._key, digest_size=8,
                               person=b"cacheseek-owner").hexdigest()

    def stored_keys(self, namespace: str, hashes: list[bytes]) -> list[bytes]:
        """``stored_key`` of each hash (all of one size), in one XOR over them all."""
        if not namespace or not hashes:
            return list(hashes)
        size = len(hashes[0])
        joined = _xor(b"".join(hashes), self.mask(namespace, size) * len(hashes))
        return list(struct.unpack(f"{size}s" * len(hashes), joined))

    def rekey(self, namespace: str, meta: FrameMeta) -> FrameMeta:
        """``meta`` with ``hash`` and ``parent`` moved into (or out of) ``namespace``."""
        if not namespace:
            return meta
        moved = replace(meta, block_hash=self.stored_key(namespace, meta.block_hash),
                        parent_hash=self.stored_key(namespace, meta.parent_hash))
        header = msgpack.packb(moved.header_dict(), use_bin_type=True)
        return replace(moved, header_nbytes=len(header))


def rewrite_prefix(meta: FrameMeta, frame: bytearray, old_payload_offset: int) -> bytearray:
    """Write the preamble and header of ``meta`` over ``frame``'s (payload kept). In place when
    the new header fits the old one's aligned room (always, for headers this library packs)."""
    prefix = header_prefix(meta)
    if len(prefix) == old_payload_offset:
        frame[: len(prefix)] = prefix
        return frame
    return bytearray(prefix) + memoryview(frame)[old_payload_offset:]


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")
