"""Prefix keys: the root hash and the chained block hashes (docs/design.md, "Keys").

Pure functions only; stores never compute a hash, and nothing here knows about codecs or
tiers beyond the fingerprint bytes they hand in.

    root  = H("cacheseek/v3" | namespace | model_id | layout fp | block_tokens | codec fp | shard)
    h[i]  = H(h[i-1] or root | kind | content[i] | extra[i] | u32 len(extra[i]))

The shard is the tensor- and pipeline-parallel rank and size that produced the KV (each
u32 little-endian; then, where given, b"F" and the stage's first layer as u32), so two
ranks never share a block. ``extra[i]`` names what else
decides block i's KV besides its tokens, as vLLM's ``hash_block_tokens(hash_fn, parent,
token_ids, extra_keys)`` does: a LoRA adapter (every block), the multimodal inputs whose
placeholder tokens overlap the block (content hash, offset and length), and a cache salt
(the first block only); empty when there is none. Its length closes the input, so the
parts are unambiguous for any content length. ``kind`` is one byte naming what the content
is: ``T``, token ids as little-endian int32, or ``B``, one caller-given bytes object per
block (a world model's frames, say); it sits at a fixed offset (parents have a fixed width),
so a block keyed by bytes never shares a key with a token block, whatever the bytes.

Each field of the root input is length-prefixed (u32 little-endian), so no two different
field tuples can produce the same byte string. Parents have a fixed width per algorithm.

Python's built-in ``hash`` is never used: keys must agree across processes, hosts and
``PYTHONHASHSEED`` values. ``KEY_VERSION`` changes whenever the recipe does, so keys of an
older recipe can never match.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import re
import sys
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType, cast

import xxhash

from .errors import ConfigError, InputError

BlockHash = NewType("BlockHash", bytes)

KEY_VERSION = b"cacheseek/v3"
DEFAULT_ALGO = "xxh3_128"


def _xxh3_128(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


# algorithm name -> (digest function, digest size in bytes)
HASH_ALGOS: dict[str, tuple[Callable[[bytes | memoryview], bytes], int]] = {
    "xxh3_128": (_xxh3_128, 16),
    "sha256": (_sha256, 32),
}

_HEX = re.compile(r"\A[0-9a-f]+\Z")
# A block hash in a URL: xxh3-128 (32 digits) or sha256 (64), lowercase (the OpenAPI document states it).
HASH_HEX_PATTERN = "^([0-9a-f]{32}|[0-9a-f]{64})$"
# The namespaces the server takes (its X-CacheSeek-Namespace header): printable ASCII, no
# spaces, at most 128. A client checks a namespace against it when it is made.
NAMESPACE_PATTERN = re.compile(r"\A[\x21-\x7e]{0,128}\Z")


def _digest_fn(algo: str) -> Callable[[bytes | memoryview], bytes]:
    try:
        return HASH_ALGOS[algo][0]
    except KeyError:
        raise ConfigError(f"hash_algo: expected one of {sorted(HASH_ALGOS)}, got {algo!r}") from None


def digest_size(algo: str) -> int:
    _digest_fn(algo)
    return HASH_ALGOS[algo][1]


def _field(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def as_index(value: Any) -> int | None:
    """``value`` as an int if it is an integer of any kind a caller may hold (an int, a
    numpy integer, a 0-d integer tensor: what ``operator.index`` takes, as page ids are
    taken), else None: a bool (True is no count of tokens), a bool tensor, a float, a str."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("torch.bool", "bool") \
            or getattr(value, "ndim", 0) != 0:  # (a 1-element tensor's __index__ works too)
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _utf8(value: str, name: str, error: type[Exception] = InputError) -> bytes:
    # A lone surrogate ("\ud800", which JSON's escapes can carry into a str) has no UTF-8.
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise error(f"{name}: not encodable as UTF-8 (a lone surrogate?): {value!r:.80}") from None


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a model's KV a worker holds: its tensor-parallel rank among
    ``tp_size`` ranks (each holding some of the KV heads) and its pipeline-parallel rank
    among ``pp_size`` stages (each holding some of the layers). Part of the root hash, so
    two ranks never share a block even when their per-rank layouts are the same.

    ``first_layer``: the model layer a pipeline stage's layer 0 is. A stage's rank does not
    say which layers it holds once the layers are split unevenly (vLLM's
    ``VLLM_PP_LAYER_PARTITION``): stage 1 of 32 layers split 8/8/8/8 holds layers 8-15, split
    9/8/8/7 layers 9-16, both 8 layers. Give it wherever engines sharing a store may split
    a model otherwise; None (the default) keeps the root it always had."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int | None = None

    def __post_init__(self) -> None:
        if self.first_layer is not None:
            first = as_index(self.first_layer)
            if first is None or not 0 <= first < 1 << 32:  # (the root holds it as u32)
                raise ConfigError(f"Shard.first_layer: must be None or an int in [0, 2**32), got {self.first_layer!r}")
            object.__setattr__(self, "first_layer", first)
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            n_, r_ = as_index(n), as_index(r)  # (numpy ints, as engines hold ranks, kept as ints)
            if n_ is None or not 1 <= n_ < 1 << 32:  # (the root holds each as u32)
                raise ConfigError(f"Shard.{size}: must be an int in [1, 2**32), got {n!r}")
            if r_ is None or not 0 <= r_ < n_:
                raise ConfigError(f"Shard.{rank}: must be an int in [0, {size}={n}), got {r!r}")
            object.__setattr__(self, size, n_)
            object.__setattr__(self, rank, r_)

    def fingerprint(self) -> bytes:
        ranks = struct.pack("<4I", self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
        # Last in the root and of fixed width, so what follows is told apart by its length:
        # nothing for a shard without first_layer (every earlier root), or b"F" and a u32.
        return ranks if self.first_layer is None else ranks + b"F" + struct.pack("<I", self.first_layer)


SINGLE = Shard()


def _name_bytes(value: Any, name: str) -> bytes:
    """A non-empty str (as UTF-8) or bytes naming an adapter, an input or a salt."""
    if isinstance(value, str):
        value = _utf8(value, name)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value)
    else:
        raise InputError(f"{name}: expected str or bytes, got {type(value).__name__}")
    if not value:
        raise InputError(f"{name}: must not be empty")
    return value


@dataclass(frozen=True, slots=True)
class MMInput:
    """A multimodal input of a prompt: the content hash of the image (audio, video, ...)
    and the placeholder tokens it fills, ``[offset, offset + length)`` in the prompt. Two
    prompts with the same placeholder tokens but other content get other keys."""

    hash: str | bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        _name_bytes(self.hash, "MMInput.hash")
        # Both go into the keys as u64, and their sum must not pass that either.
        offset, length = as_index(self.offset), as_index(self.length)
        if offset is None or not 0 <= offset < 1 << 63:
            raise InputError(f"MMInput.offset: must be an int in [0, 2**63), got {self.offset!r}")
        if length is None or not 1 <= length < 1 << 63:
            raise InputError(f"MMInput.length: must be an int in [1, 2**63), got {self.length!r}")
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "length", length)


_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_NO_EXTRA = _U32.pack(0)  # the closing length of a block with no extra keys
TOKENS = b"T"  # a block's content kind: its token ids, as little-endian int32
BYTES = b"B"  # a block's content kind: one bytes object the caller gives per block


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What decides a prompt's KV besides its tokens, hashed into the blocks it concerns
    (as vLLM's extra keys): ``lora_id`` every block, each of ``mm_inputs`` the blocks its
    placeholder tokens overlap, ``cache_salt`` the first block (and so, by the chain, every
    block: prompts with different salts share nothing)."""

    lora_id: str | None = None
    mm_inputs: Sequence[MMInput] = ()  # (any sequence; stored as a tuple, sorted, by __post_init__)
    cache_salt: str | bytes | None = None

    def __post_init__(self) -> None:
        if self.lora_id is not None and not (isinstance(self.lora_id, str) and self.lora_id):
            raise InputError(f"lora_id: expected a non-empty str, got {self.lora_id!r}")
        if self.lora_id is not None:
            _utf8(self.lora_id, "lora_id")
        if self.cache_salt is not None:
            _name_bytes(self.cache_salt, "cache_salt")
        if isinstance(self.mm_inputs, (str, bytes)) or not hasattr(self.mm_inputs, "__iter__"):
            raise InputError(f"mm_inputs: expected a sequence of cacheseek.MMInput, got {type(self.mm_inputs).__name__}")
        inputs = tuple(self.mm_inputs)
        for i, item in enumerate(inputs):
            if not isinstance(item, MMInput):
                raise InputError(f"mm_inputs[{i}]: expected a cacheseek.MMInput, got {type(item).__name__}")
        # Canonical order, so the caller's order does not matter.
        object.__setattr__(self, "mm_inputs", tuple(sorted(
            inputs, key=lambda m: (m.offset, m.length, _name_bytes(m.hash, "MMInput.hash")))))

    def __bool__(self) -> bool:
        return self.lora_id is not None or bool(self.mm_inputs) or self.cache_salt is not None

    def for_blocks(self, num_blocks: int, block_tokens: int) -> list[bytes]:
        """The extra-key bytes of blocks ``0 .. num_blocks - 1`` (see :func:`block_extra_keys`)."""
        out = []
        mm, first = self.mm_inputs, 0  # inputs before ``first`` end before the current block
        for i in range(num_blocks):
            lo, hi = i * block_tokens, (i + 1) * block_tokens
            while first < len(mm) and mm[first].offset + mm[first].length <= lo:
                first += 1
            overlapping = []
            for m in mm[first:]:
                if m.offset >= hi:
                    break  # sorted by offset: none later overlaps either
                if m.offset + m.length > lo:
                    overlapping.append(m)
            out.append(block_extra_keys(lora_id=self.lora_id, mm_inputs=overlapping,
                                        cache_salt=self.cache_salt if i == 0 else None))
        return out


def block_extra_keys(*, lora_id: str | None = None, mm_inputs: Sequence[MMInput] = (),
                     cache_salt: str | bytes | None = None) -> bytes:
    """Canonical bytes of one block's extra keys (empty when there are none): tagged,
    length-prefixed fields in a fixed order,

        b"L" | lora_id                                   (u32 length + UTF-8)
        b"M" | u32 count | (hash | u64 offset | u64 length) * count   (in the given order)
        b"S" | cache_salt                                (u32 length + bytes)

    ``mm_inputs`` are the inputs overlapping the block, in (offset, length, hash) order."""
    parts = []
    if lora_id is not None:
        parts += [b"L", _field(_utf8(lora_id, "lora_id"))]
    if mm_inputs:
        parts += [b"M", _U32.pack(len(mm_inputs))]
        for m in mm_inputs:
            parts += [_field(_name_bytes(m.hash, "MMInput.hash")), _U64.pack(m.offset), _U64.pack(m.length)]
    if cache_salt is not None:
        parts += [b"S", _field(_name_bytes(cache_salt, "cache_salt"))]
    return b"".join(parts)


def root_hash(
    *,
    namespace: str,
    model_id: str,
    layout_fingerprint: bytes,
    block_tokens: int,
    codec_fingerprint: bytes,
    shard: Shard = SINGLE,
    algo: str = DEFAULT_ALGO,
) -> BlockHash:
    """The hash every chain starts from. Any change to any argument changes it."""
    if not isinstance(namespace, str):
        raise ConfigError(f"namespace: expected str, got {type(namespace).__name__}")
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"model_id: expected a non-empty str, got {model_id!r}")
    if not _is_count(block_tokens) or not 0 < block_tokens < 1 << 32:  # (held as u32)
        raise ConfigError(f"block_tokens: must be an int in [1, 2**32), got {block_tokens!r}")
    if not isinstance(shard, Shard):
        raise ConfigError(f"shard: expected a cacheseek.Shard, got {type(shard).__name__}")
    data = b"".join(
        (
            KEY_VERSION,
            _field(_utf8(namespace, "namespace", ConfigError)),
            _field(_utf8(model_id, "model_id", ConfigError)),
            _field(bytes(layout_fingerprint)),
            struct.pack("<I", block_tokens),
            _field(bytes(codec_fingerprint)),
            shard.fingerprint(),
        )
    )
    return BlockHash(_digest_fn(algo)(data))


def hash_block_tokens(parent: bytes, content: bytes | memoryview, extra_keys: bytes = b"",
                      algo: str = DEFAULT_ALGO, kind: bytes = TOKENS) -> BlockHash:
    """Hash of one block given its parent's hash (or the root), its content bytes (token ids
    as little-endian int32, ``kind=TOKENS``; or the caller's bytes, ``kind=BYTES``) and its
    extra-key bytes (:func:`block_extra_keys`; empty for none)."""
    if len(parent) != digest_size(algo):
        raise InputError(f"parent: a {algo} hash is {digest_size(algo)} bytes, got {len(parent)}")
    if kind not in (TOKENS, BYTES):
        raise InputError(f"kind: expected {TOKENS!r} or {BYTES!r}, got {kind!r}")
    if not isinstance(content, (bytes, bytearray, memoryview)):
        # (vLLM's function of this name takes the ids: bytes() of small ints made one byte
        # each, another key without a word)
        raise InputError(f"content: expected bytes (token ids packed by token_block_bytes), got "
                         f"{type(content).__name__}")
    return BlockHash(_digest_fn(algo)(b"".join((bytes(parent), kind, bytes(content), extra_keys,
                                                _U32.pack(len(extra_keys))))))


def chain_hashes(root: bytes, blocks: Iterable[bytes | memoryview], algo: str = DEFAULT_ALGO,
                 extra_keys: Sequence[bytes] | None = None, kind: bytes = BYTES) -> list[BlockHash]:
    """Chained hashes of block contents: by default caller-given bytes (frames, actions,
    anything; ``kind=BYTES``); ``extra_keys``: each block's extra-key bytes, or None for none."""
    fn = _digest_fn(algo)
    if len(root) != digest_size(algo):
        raise InputError(f"root: a {algo} hash is {digest_size(algo)} bytes, got {len(root)}")
    if kind not in (TOKENS, BYTES):
        raise InputError(f"kind: expected {TOKENS!r} or {BYTES!r}, got {kind!r}")
    out: list[BlockHash] = []
    parent = bytes(root)
    for i, content in enumerate(blocks):
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise InputError(f"block_keys[{i}]: expected bytes, got {type(content).__name__}")
        if extra_keys is None or not extra_keys[i]:
            parent = fn(b"".join((parent, kind, bytes(content), _NO_EXTRA)))
        else:
            extra = extra_keys[i]
            parent = fn(b"".join((parent, kind, bytes(content), extra, _U32.pack(len(extra)))))
        out.append(BlockHash(parent))
    return out


def as_token_list(token_ids: Any) -> Sequence[int]:
    """Token ids as a flat sequence of ints: a list, a tuple, or a tensor/array of shape [T] or [1, T]."""
    if hasattr(token_ids, "tolist") and hasattr(token_ids, "shape"):
        dtype = str(getattr(token_ids, "dtype", ""))
        if dtype in ("torch.bool", "bool"):
            raise InputError("token_ids: a tensor of bools, not token ids")  # (read as 0 and 1)
        shape = tuple(token_ids.shape)
        if "float" in dtype or "complex" in dtype:  # (its tolist() gave floats, refused as "not in the int32 range")
            raise InputError(f"token_ids: expected an integer tensor, got {dtype} {list(shape)}")
        try:
            if len(shape) == 2 and shape[0] == 1:
                token_ids = token_ids.reshape(-1)
            elif len(shape) != 1:
                raise InputError(f"token_ids: expected shape [T] or [1, T], got {list(shape)}")
            token_ids = token_ids.tolist()
        except (RuntimeError, NotImplementedError) as exc:  # (a meta tensor holds no values; a sparse one)
            raise InputError(f"token_ids: a tensor whose values cannot be read ({exc})") from None
    if not isinstance(token_ids, (list, tuple)):
        raise InputError(f"token_ids: expected a sequence of ints, got {type(token_ids).__name__}")
    if token_ids and isinstance(token_ids[0], (list, tuple)):
        # A batched tokenizer's ``input_ids`` ([[...]]): one row is taken, as a [1, T] tensor is.
        if len(token_ids) == 1:
            return as_token_list(token_ids[0])
        raise InputError(f"token_ids: expected shape [T] or [1, T], got a list of {len(token_ids)} rows (one "
                         "request's ids at a time; a batch: locate_batch, or one call a request)")
    return token_ids


_INT_DTYPES = frozenset(f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64))


@functools.lru_cache(maxsize=64)
def _int32s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}i")


def token_block_bytes(tokens: Sequence[int], *, from_tensor: bool = False) -> bytes:
    """Content bytes of one token block (or of several, end to end): the ids as
    little-endian int32. A bool among them is refused (``InputError`` naming its index),
    as a tensor of bools is by ``as_token_list``; ``from_tensor``: ``tokens`` is a tensor's
    ``tolist()``, which holds none, so none is looked for."""
    # A cached Struct packs a 4096-id prompt ~2.5x faster than array("i", ...) (40 vs 105
    # µs here), which matters on the ingest path: this is most of hashing a prompt.
    try:
        data = _int32s(len(tokens)).pack(*tokens)
    except (struct.error, TypeError) as exc:  # (TypeError: an __index__ that refuses, a numpy bool's)
        raise InputError(f"token_ids: every id must be an int in the int32 range ({exc})") from None
    if not from_tensor:
        # struct packs True and False as 1 and 0: a mask handed in as the ids got keys.
        for j in _zero_or_one(data):
            t = tokens[j]
            if type(t) is not int and (isinstance(t, bool) or str(getattr(t, "dtype", "")) in ("torch.bool", "bool")):
                raise InputError(f"token_ids[{j}]: a bool, not a token id")
    return data


def _zero_or_one(data: bytes) -> list[int]:
    """Indices of the int32 ids packed in ``data`` that are 0 or 1: where a bool can be.
    Found by value, then checked by type at those few: a type check of every id costs the
    host ~2.5x the pack of a 16K prompt, and this ~0.3x."""
    if len(data) <= 256:  # (below ~64 ids this loop takes less than torch's few launches)
        return [j for j in range(len(data) // 4) if data[4 * j + 1 : 4 * j + 4] == b"\0\0\0" and data[4 * j] <= 1]
    # torch only where the process has it loaded already (the caches do): keys alone (a
    # router's, PrefixKeys') must not import it, and the scan below is ~5x slower.
    torch = sys.modules.get("torch")
    if torch is not None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.int32)
        return ((ids & -2) == 0).nonzero().flatten().tolist()
    # Each byte lane sliced out at C speed (the low byte mapped to 0 where it is 0 or 1),
    # the lanes ORed as big ints: a zero byte of the result is an id of 0 or 1.
    n = len(data) // 4
    acc = int.from_bytes(data[0::4].translate(_LOW_BYTE_NOT_0_OR_1), "little")
    for lane in (data[1::4], data[2::4], data[3::4]):
        acc |= int.from_bytes(lane, "little")
    flags = acc.to_bytes(n, "little")
    out, i = [], flags.find(0)
    while i >= 0:
        out.append(i)
        i = flags.find(0, i + 1)
    return out


_LOW_BYTE_NOT_0_OR_1 = bytes([0, 0] + [1] * 254)


def hash_token_blocks(
    root: bytes, token_ids: Any, block_tokens: int, algo: str = DEFAULT_ALGO, extra: ExtraKeys | None = None,
    *, packed: bytes | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``; a partial tail is not keyed.
    ``extra``: the prompt's extra keys (LoRA adapter, multimodal inputs, cache salt).
    ``packed``: ``token_block_bytes(token_ids)``, where the caller has it already (it is
    most of the cost: packed again, 16K ids cost the host ~0.2 ms)."""
    tokens = as_token_list(token_ids)
    # (an integer tensor's or array's tolist() holds ints only; an object array's may hold bools)
    from_tensor = str(getattr(token_ids, "dtype", "")).removeprefix("torch.") in _INT_DTYPES
    n_full = len(tokens) // block_tokens
    if packed is not None:
        if len(packed) != 4 * len(tokens):
            raise ValueError(f"packed: {len(packed)} bytes for {len(tokens)} token ids")
        data = packed
    else:
        data = token_block_bytes(tokens, from_tensor=from_tensor)  # the partial tail too: checked as every id is
    step = 4 * block_tokens
    if extra:
        extras = extra.for_blocks(n_full, block_tokens)
        return chain_hashes(root, (data[i * step : (i + 1) * step] for i in range(n_full)), algo, extras, TOKENS)
    # The usual case, on every ingest and lookup: one join and one digest per block.
    fn = _digest_fn(algo)
    if len(root) != digest_size(algo):
        raise InputError(f"root: a {algo} hash is {digest_size(algo)} bytes, got {len(root)}")
    parent, out, join = bytes(root), [], b"".join
    for a in range(0, n_full * step, step):
        parent = fn(join((parent, TOKENS, data[a : a + step], _NO_EXTRA)))
        out.append(parent)
    return cast("list[BlockHash]", out)  # (BlockHash is bytes at run time: no wrapper call per block)


def to_hex(h: bytes) -> str:
    return bytes(h).hex()


def from_hex(text: str, algo: str | None = None) -> BlockHash:
    """Parse a lowercase-hex block hash, as used in URLs. Checks the length for ``algo``."""
    sizes = {size for _, size in HASH_ALGOS.values()} if algo is None else {digest_size(algo)}
    if not isinstance(text, str) or not _HEX.fullmatch(text) or len(text) // 2 not in sizes or len(text) % 2:
        want = " or ".join(str(2 * s) for s in sorted(sizes))
        raise InputError(f"hash: expected {want} lowercase hex digits, got {text!r:.80}")
    return BlockHash(bytes.fromhex(text))
