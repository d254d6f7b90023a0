"""Block frames: the one byte format of a stored block (HTTP body, disk file, Redis value).

    offset 0        4           8                     16
           | "CSKF" | header_len | header xxh3-64 (LE) | msgpack header ... | zero pad | payload ...
                      u32 LE       u64                   header_len bytes     to 64      buffers, each
                                                                                         64-aligned
    header = {"v": 1, "hash": bin, "parent": bin, "pos": int, "layout": {...}, "block_tokens": int,
              "codec": {...}, "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],
              "payload_nbytes": int, "checksum": bin(8) = xxh3-64 of the payload, big-endian}

The payload checksum is a fixed 8-byte field so the header's length is known before the
payload exists: a frame is planned, its payload written in place (straight from a device
copy, if need be), then sealed. Parsing trusts nothing of the structure: every length,
offset, dtype and shape is checked before a byte of payload is touched, and parsing never
allocates. The payload's values are not read; ``check_stat_values`` (the server's, on an
upload) checks a quantizer's stats.
See docs/frame-format.md.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import xxhash

from ..errors import ChecksumError, ConfigError, FrameError, FrameVersionError
from ..layout import KVLayout
from ..quant.payload import BUFFER_DTYPES
from ..quant.registry import codec_from_spec

MAGIC = b"CSKF"
FORMAT_VERSION = 1
ALIGN = 64
PREAMBLE = struct.Struct("<4sIQ")
MAX_HEADER_NBYTES = 64 * 1024
MAX_TENSORS = 16
MAX_RANK = 8
# A header nests four deep (header, tensors, an entry, its shape); the rest is room for a
# codec spec of another release. Checked, not left to RecursionError: whether a repr or an
# == of a value ~1000 deep raises depends on the Python version (3.11 does, 3.12 does not).
MAX_HEADER_NESTING = 16
HASH_SIZES = (16, 32)
_HEADER_KEYS = {"v", "hash", "parent", "pos", "layout", "block_tokens", "codec", "tensors", "payload_nbytes", "checksum"}
_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_checksum(payload: Any) -> bytes:
    return xxhash.xxh3_64_digest(payload)


class PayloadChecksum:
    """``payload_checksum`` of a frame fed whole, in order, in pieces as it arrives: each
    piece is hashed while it is still in cache, where a check after the last byte would
    make a second pass over memory. Where the payload starts is read from the preamble;
    ``digest()`` is None if the preamble is not a frame's (parsing will say why)."""

    __slots__ = ("_hash", "_head", "_offset", "_pos")

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()
        self._head = bytearray()
        self._offset: int | None = None
        self._pos = 0

    def feed(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        start = self._pos
        self._pos += view.nbytes
        if self._offset is None:
            self._head += view[: PREAMBLE.size - len(self._head)]
            if len(self._head) < PREAMBLE.size:
                return
            magic, header_len, _ = PREAMBLE.unpack(self._head)
            ok = magic == MAGIC and header_len <= MAX_HEADER_NBYTES
            self._offset = _align(PREAMBLE.size + header_len) if ok else -1
        if self._offset >= 0 and self._pos > self._offset:
            self._hash.update(view[max(self._offset - start, 0) :])

    def digest(self) -> bytes | None:
        return self._hash.digest() if self._offset is not None and self._offset >= 0 else None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # within the payload
    nbytes: int


@dataclass(frozen=True, slots=True)
class FrameMeta:
    """A parsed (or planned) frame header plus where its payload sits. ``layout``,
    ``codec`` and ``tensors`` are shared by the metas of one configuration (the blocks of a
    model): never change ``codec`` in place."""

    block_hash: bytes
    parent_hash: bytes
    position: int
    layout: KVLayout
    block_tokens: int
    codec: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    payload_nbytes: int
    checksum: bytes
    header_nbytes: int
    version: int = FORMAT_VERSION
    payload_offset: int = field(init=False, compare=False)
    # The packed header of a planned frame, saved to avoid packing it twice per block, and
    # the per-frame fields it was packed from: a copy made with other values
    # (dataclasses.replace) ignores it. None in a parsed one, whose header is in its frame.
    packed_header: bytes | None = field(default=None, compare=False, repr=False)
    packed_for: tuple | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload_offset", _align(PREAMBLE.size + self.header_nbytes))
        if self.packed_header is not None and self.packed_for is None:
            object.__setattr__(self, "packed_for", self._varying())

    def _varying(self) -> tuple:
        return (self.block_hash, self.parent_hash, self.position, self.checksum, self.header_nbytes, self.version)

    def cached_header(self) -> bytes | None:
        """The packed header if it still describes this frame."""
        return self.packed_header if self.packed_for == self._varying() else None

    def without_packed_header(self) -> FrameMeta:
        """This meta without its packed header: what a tier keeps for as long as it holds
        the block, once the header is written into the frame (~340 bytes a block less)."""
        if self.packed_header is None:
            return self
        # (the constructor, not ``dataclasses.replace``: half the cost, on every put of a block)
        return FrameMeta(self.block_hash, self.parent_hash, self.position, self.layout, self.block_tokens,
                         self.codec, self.tensors, self.payload_nbytes, self.checksum, self.header_nbytes,
                         self.version)

    @property
    def nbytes(self) -> int:
        """Total frame size: what a tier stores and a budget counts."""
        return self.payload_offset + self.payload_nbytes

    @property
    def raw_nbytes(self) -> int:
        """Bytes of unencoded KV this frame stands for (for compression ratios)."""
        return self.layout.raw_nbytes(self.block_tokens)

    def entry(self, name: str) -> TensorEntry:
        for e in self.tensors:
            if e.name == name:
                return e
        raise KeyError(name)

    def header_dict(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "hash": self.block_hash,
            "parent": self.parent_hash,
            "pos": self.position,
            "layout": self.layout.to_dict(),
            "block_tokens": self.block_tokens,
            # a copy: one codec map is shared by every meta of a configuration, planned or parsed
            "codec": dict(self.codec),
            "tensors": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
                for e in self.tensors
            ],
            "payload_nbytes": self.payload_nbytes,
            "checksum": self.checksum,
        }


def plan_frame(
    *,
    block_hash: bytes,
    parent_hash: bytes,
    position: int,
    layout: KVLayout,
    block_tokens: int,
    codec: dict[str, Any],
    buffers: list[tuple[str, str, tuple[int, ...]]],
) -> FrameMeta:
    """Lay out a frame for buffers ``(name, dtype, shape)``; the checksum is filled by :func:`seal_frame`."""
    entries = []
    offset = 0
    for name, dtype, shape in buffers:
        nbytes = BUFFER_DTYPES[dtype] * math.prod(shape)
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset = _align(offset + nbytes)
    payload_nbytes = entries[-1].offset + entries[-1].nbytes if entries else 0
    fields: dict[str, Any] = dict(
        block_hash=bytes(block_hash), parent_hash=bytes(parent_hash), position=position, layout=layout,
        block_tokens=block_tokens, codec=codec, tensors=tuple(entries), payload_nbytes=payload_nbytes,
        checksum=bytes(8),
    )
    header = msgpack.packb(FrameMeta(**fields, header_nbytes=0).header_dict(), use_bin_type=True)
    return FrameMeta(**fields, header_nbytes=len(header), packed_header=header)


def replan_frame(meta: FrameMeta, *, block_hash: bytes, parent_hash: bytes, position: int) -> FrameMeta:
    """:func:`plan_frame` for another block with ``meta``'s layout, codec and buffers: the
    same result, without laying out the buffers or packing the header's fixed fields
    again (a batch of blocks plans one frame and derives the rest)."""
    block_hash, parent_hash = bytes(block_hash), bytes(parent_hash)
    header = meta.cached_header()
    if header is None:
        header = msgpack.packb(meta.header_dict(), use_bin_type=True)
    # The header is a msgpack map whose fields go: v, hash, parent, pos, [fixed fields],
    # checksum. The per-block ones are packed around the fixed middle, byte for byte as
    # packb writes the whole map (tests check it against plan_frame).
    middle = _MIDDLES.get(header)
    if middle is None:
        head = len(_varying_head(meta.version, meta.block_hash, meta.parent_hash, meta.position))
        middle = header[head : len(header) - len(_CHECKSUM_FIELD) - len(_pack_small(meta.checksum))]
        with _SHARED_LOCK:  # (see ``_shared_fixed``)
            if len(_MIDDLES) >= 256:
                _MIDDLES.pop(next(iter(_MIDDLES)))
            _MIDDLES[header] = middle
    header = b"".join((_varying_head(meta.version, block_hash, parent_hash, position), middle, _UNSEALED_TAIL))
    return FrameMeta(block_hash=block_hash, parent_hash=parent_hash, position=position,
                     layout=meta.layout, block_tokens=meta.block_tokens, codec=meta.codec, tensors=meta.tensors,
                     payload_nbytes=meta.payload_nbytes, checksum=bytes(8), header_nbytes=len(header),
                     packed_header=header)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


_MAP_HEAD = b"\x8a"  # a msgpack map of the header's 10 fields
_CHECKSUM_FIELD = _pack("checksum")
_V_KEY, _HASH_KEY, _PARENT_KEY, _POS_KEY = (_pack(k) for k in ("v", "hash", "parent", "pos"))
_UNSEALED_TAIL = _CHECKSUM_FIELD + _pack(bytes(8))
_MIDDLES: dict[bytes, bytes] = {}  # a header's fixed fields, by the header (templates are reused)


def _pack_small(value: Any) -> bytes:
    """packb of a hash (bin) or a position (uint) without packb's ~1 µs per call."""
    if isinstance(value, bytes) and len(value) < 256:
        return b"\xc4" + bytes((len(value),)) + value
    if type(value) is int and 0 <= value < 1 << 32:
        if value < 128:
            return bytes((value,))
        for marker, width in ((b"\xcc", 1), (b"\xcd", 2), (b"\xce", 4)):
            if value < 1 << (8 * width):
                return marker + value.to_bytes(width, "big")
    return _pack(value)


def _varying_head(version: int, block_hash: bytes, parent_hash: bytes, position: int) -> bytes:
    return b"".join((_MAP_HEAD, _V_KEY, _pack_small(version), _HASH_KEY, _pack_small(block_hash), _PARENT_KEY,
                     _pack_small(parent_hash), _POS_KEY, _pack_small(position)))


def header_prefix(meta: FrameMeta) -> bytes:
    """Preamble + msgpack header + zero padding: the ``payload_offset`` bytes before the payload."""
    header = meta.cached_header() or msgpack.packb(meta.header_dict(), use_bin_type=True)
    if len(header) != meta.header_nbytes:
        raise RuntimeError("frame header changed length after planning")
    preamble = PREAMBLE.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header))
    return preamble + header + bytes(meta.payload_offset - PREAMBLE.size - len(header))


# How many first bytes of a stored value ``head_version`` reads: the preamble, the header
# map's own head (up to a map32's 5 bytes), its first key and a small int.
VERSION_PROBE_NBYTES = PREAMBLE.size + 8


def head_version(head: Any) -> int | None:
    """The format version named by a stored value's first ``VERSION_PROBE_NBYTES`` bytes, as
    every release so far lays a header out (the magic, then a map whose first key is ``v``,
    a small int); None where they name none that way (not a frame, or a header laid out
    otherwise: only ``parse_header`` tells). Nothing is checked but those bytes: a tier
    asks this to know another release's frame from its own without reading the header."""
    view = bytes(head[:VERSION_PROBE_NBYTES])
    if len(view) < PREAMBLE.size + 4 or view[:4] != MAGIC:
        return None
    at = PREAMBLE.size
    kind = view[at]
    at += 1 if 0x80 <= kind <= 0x8F else 3 if kind == 0xDE else 5 if kind == 0xDF else len(view)
    if view[at : at + 2] != _V_KEY or at + 2 >= len(view) or view[at + 2] >= 0x80:
        return None
    return view[at + 2]


def seal_frame(meta: FrameMeta, frame: Any) -> FrameMeta:
    """Checksum the payload already written into ``frame``, then write its preamble and header."""
    view = memoryview(frame).cast("B")
    if view.nbytes != meta.nbytes:
        raise ValueError(f"frame buffer is {view.nbytes} bytes, the plan needs {meta.nbytes}")
    sealed = replace(meta, checksum=payload_checksum(view[meta.payload_offset :]))
    view[: meta.payload_offset] = header_prefix(sealed)
    return sealed


def build_frame(meta: FrameMeta, buffers: list[Any]) -> bytearray:
    """A sealed frame from host buffers, in one allocation and one copy of each buffer."""
    if len(buffers) != len(meta.tensors):
        raise ValueError(f"expected {len(meta.tensors)} buffers, got {len(buffers)}")
    out = bytearray(meta.nbytes)  # zero-filled: alignment gaps are deterministic
    view = memoryview(out)
    base = meta.payload_offset
    for entry, buf in zip(meta.tensors, buffers):
        src = memoryview(buf).cast("B")
        if src.nbytes != entry.nbytes:
            raise ValueError(f"{entry.name}: buffer holds {src.nbytes} bytes, entry needs {entry.nbytes}")
        view[base + entry.offset : base + entry.offset + entry.nbytes] = src
    seal_frame(meta, out)
    return out


def _expect(cond: bool, reason: str, *args: Any) -> None:
    # The reason is formatted only on failure: a header passes ~90 checks, and formatting
    # each one's message up front was most of the time it took to parse one.
    if not cond:
        raise FrameError(reason.format(*args) if args else reason)


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise FrameError(f"{what}: bad value {value!r:.40}")
    return value


_HEADER_KEYS_TEXT = str(sorted(_HEADER_KEYS))
_ENTRY_KEYS_TEXT = str(sorted(_ENTRY_KEYS))


def parse_header(data: Any) -> FrameMeta:
    """Parse and check the preamble and header of ``data``; the payload is not read."""
    return _parse_header(data)


def _nested_within(value: Any, limit: int) -> bool:
    """Whether no list or map in ``value`` lies more than ``limit`` levels down (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _parse_header(data: Any) -> FrameMeta:
    view = memoryview(data).cast("B")
    _expect(view.nbytes >= PREAMBLE.size, "frame truncated: {} bytes, not even a preamble", view.nbytes)
    magic, header_len, header_sum = PREAMBLE.unpack_from(view)
    _expect(magic == MAGIC, "not a CacheSeek frame (bad magic)")
    _expect(header_len <= MAX_HEADER_NBYTES, "header length {} exceeds {}", header_len, MAX_HEADER_NBYTES)
    _expect(view.nbytes >= PREAMBLE.size + header_len, "frame truncated inside its header")
    header_bytes = view[PREAMBLE.size : PREAMBLE.size + header_len]
    _expect(xxhash.xxh3_64_intdigest(header_bytes) == header_sum, "header checksum mismatch")
    try:
        h = msgpack.unpackb(header_bytes, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"header is not valid msgpack: {exc}") from None
    # The version before the keys: another release's header may hold other fields, and a
    # frame of it, whole under its checksum, is not damage (a tier keeps it, uncounted as
    # corrupt). ``type(...) is int``: msgpack's 1.0 and true compare equal to 1, and are not
    # versions.
    if isinstance(h, dict) and type(h.get("v")) is int and h["v"] != FORMAT_VERSION:
        raise FrameVersionError(f"frame format version {h['v']} is not {FORMAT_VERSION}: written by another "
                                "release")
    _expect(isinstance(h, dict) and h.keys() == _HEADER_KEYS, "header keys must be {}", _HEADER_KEYS_TEXT)
    _expect(_nested_within(h, MAX_HEADER_NESTING), "header: a value is nested too deep (over {} levels)",
            MAX_HEADER_NESTING)
    _expect(type(h["v"]) is int, "frame format version {!r:.20} is not {}", h["v"], FORMAT_VERSION)
    for key in ("hash", "parent"):
        _expect(isinstance(h[key], bytes) and len(h[key]) in HASH_SIZES, "{}: not a 16- or 32-byte hash", key)
    _expect(len(h["hash"]) == len(h["parent"]), "hash and parent differ in size")
    _expect(isinstance(h["checksum"], bytes) and len(h["checksum"]) == 8, "checksum: not 8 bytes")
    _expect(isinstance(h["codec"], dict), "codec: not a map")
    try:
        layout = KVLayout.from_dict(h["layout"])
    except (ConfigError, TypeError) as exc:
        raise FrameError(f"layout: {exc}") from None
    payload_nbytes = _int(h["payload_nbytes"], "payload_nbytes")
    tensors = h["tensors"]
    _expect(isinstance(tensors, list) and 0 < len(tensors) <= MAX_TENSORS, "tensors: expected 1..16 entries")
    entries = []
    end = 0
    for i, e in enumerate(tensors):
        _expect(isinstance(e, dict) and e.keys() == _ENTRY_KEYS, "tensors[{}]: keys must be {}", i, _ENTRY_KEYS_TEXT)
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        _expect(isinstance(name, str) and 0 < len(name) <= 64, "tensors[{}].name: bad", i)
        _expect(isinstance(dtype, str) and dtype in BUFFER_DTYPES, "tensors[{}].dtype: {!r:.20} unknown", i, dtype)
        _expect(isinstance(shape, list) and len(shape) <= MAX_RANK, "tensors[{}].shape: bad", i)
        what = f"tensors[{i}]"
        shape = tuple([_int(x, what + ".shape", 0, 1 << 40) for x in shape])
        offset = _int(e["offset"], what + ".offset")
        nbytes = _int(e["nbytes"], what + ".nbytes")
        _expect(nbytes == BUFFER_DTYPES[dtype] * math.prod(shape), "{}: nbytes disagrees with shape", what)
        # Exactly where plan_frame lays it (the next aligned offset): a gap would be payload
        # bytes no tensor names, which a decoder sizing rows from another frame overruns.
        _expect(offset == (_align(end) if i else 0), "{}: offset {} unaligned, overlapping or leaving a gap "
                "(expected {})", what, offset, _align(end) if i else 0)
        end = offset + nbytes
        _expect(end <= payload_nbytes, "{}: runs past the payload", what)
        entries.append(TensorEntry(name, dtype, shape, offset, nbytes))
    _expect(payload_nbytes == end, "payload_nbytes {} is not where the last tensor ends ({})", payload_nbytes, end)
    position = _int(h["pos"], "pos")
    layout, block_tokens, codec, tensors, payload_nbytes = _shared_fixed(header_bytes, h, position, (
        layout, _int(h["block_tokens"], "block_tokens", 1, 1 << 24), h["codec"], tuple(entries), payload_nbytes))
    # No packed header kept: a parsed frame's header lies in the frame already, and a tier
    # keeps the meta as long as the block (a copy of the header in each was ~340 bytes a block).
    return FrameMeta(
        block_hash=h["hash"], parent_hash=h["parent"], position=position, layout=layout, block_tokens=block_tokens,
        codec=codec, tensors=tensors, payload_nbytes=payload_nbytes, checksum=h["checksum"], header_nbytes=header_len,
    )


# The fixed fields of the headers parsed lately, by their packed bytes: every block of a
# model parses to one shared layout, codec and tensor table, which a tier keeps per block
# for as long as it holds the block (fresh copies cost ~1.1 KiB a block). Bounded: a few
# configurations each in practice; headers from elsewhere may hold anything.
_SHARED: dict[bytes, tuple] = {}
_SHARED_MAX = 64
_SHARED_MAX_NBYTES = 4096
_SHARED_LOCK = threading.Lock()


def _shared_fixed(header_bytes: memoryview, h: dict[str, Any], position: int, fixed: tuple) -> tuple:
    """``fixed`` (the header's layout, block_tokens, codec, tensors and payload_nbytes, parsed
    and checked), or the equal values of an earlier header whose fixed fields were packed
    byte for byte alike."""
    # Only a header laid out as this library packs one (replan_frame's order: the per-block
    # fields around the fixed ones, the checksum last) is keyed by its middle bytes: those
    # are then exactly the fixed fields, which the same bytes always parse to.
    head = _varying_head(h["v"], h["hash"], h["parent"], position)
    tail = _CHECKSUM_FIELD + _pack_small(h["checksum"])
    n = header_bytes.nbytes
    if (n - len(head) - len(tail) <= _SHARED_MAX_NBYTES and next(reversed(h)) == "checksum"
            and header_bytes[: len(head)] == head and header_bytes[n - len(tail) :] == tail):
        middle = bytes(header_bytes[len(head) : n - len(tail)])
        # Least recently parsed out first, a hit moved to the end: frames of configurations
        # seen once (rejected ones, another writer's) pass through without pushing out the
        # models in use. Locked: ``next(iter())`` over a dict another thread is inserting
        # into raises RuntimeError.
        with _SHARED_LOCK:
            shared = _SHARED.pop(middle, None)
            if shared is not None:
                fixed = shared
            elif len(_SHARED) >= _SHARED_MAX:
                _SHARED.pop(next(iter(_SHARED)))
            _SHARED[middle] = fixed
    return fixed


def parse_frame(data: Any, *, verify: bool = True, payload_digest: bytes | None = None) -> FrameMeta:
    """Parse a whole frame: header checks, exact total length, and (``verify``) the payload
    checksum, computed here or given as ``payload_digest`` (by a ``PayloadChecksum``)."""
    view = memoryview(data).cast("B")
    meta = parse_header(view)
    _expect(view.nbytes >= meta.nbytes, "frame truncated: {} of {} bytes", view.nbytes, meta.nbytes)
    _expect(view.nbytes == meta.nbytes, "frame has {} trailing bytes", view.nbytes - meta.nbytes)
    if verify:
        # No checksum covers the padding after the header: it must be zeros, so that no byte
        # of a frame is free to carry anything.
        pad = view[PREAMBLE.size + meta.header_nbytes : meta.payload_offset]
        _expect(bytes(pad) == bytes(pad.nbytes), "the padding after the header is not zeros")
        digest = payload_digest if payload_digest is not None else payload_checksum(view[meta.payload_offset :])
        if digest != meta.checksum:
            raise ChecksumError("payload checksum mismatch")
    return meta


def check_codec_layout(meta: FrameMeta) -> None:
    """The tensor entries are exactly what the header's codec makes for its layout and block size."""
    try:
        codec = codec_from_spec(meta.codec)
    except (ConfigError, TypeError, ValueError) as exc:  # (a spec from outside: any of its values may be odd)
        raise FrameError(f"codec: {exc}") from None
    lay = meta.layout
    try:
        # (the geometry first: a template sizes a ragged K group too, which no frame holds)
        codec.check_layout(lay, meta.block_tokens)
    except ConfigError as exc:
        raise FrameError(f"codec {meta.codec.get('name')!r:.20} cannot encode this layout and block size: {exc}") from None
    try:
        template = codec.template((lay.num_layers, lay.num_kv_heads, meta.block_tokens, lay.head_dim), lay.dtype)
        want = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    except ValueError as exc:  # a geometry the codec cannot pack (head_dim 12 at int4, 4 tokens in a group of 32)
        raise FrameError(f"codec {meta.codec.get('name')!r:.20} cannot encode this layout and block size: {exc}") from None
    got = [(e.name, e.dtype, e.shape) for e in meta.tensors]
    _expect(got == want, "tensor entries do not match codec {!r} for this layout", meta.codec.get("name"))



# A stat buffer's element read as a signed integer of its size, and its exponent bits: all
# of them set is NaN or Inf.
_STAT_BITS = {"float16": ("<i2", 0x7C00), "bfloat16": ("<i2", 0x7F80), "float32": ("<i4", 0x7F800000)}
_STAT_ROLES = ("scale", "min")


def check_stat_values(meta: FrameMeta, data: Any) -> None:
    """``FrameError`` unless every quantizer stat of the frame (the buffers of role
    ``scale`` or ``min``: a KIVI group's) is finite and no scale is below zero (``-0.0``
    is zero), which no encode of this library writes and every decode would spread over a
    whole group. Call it on a frame ``check_codec_layout`` has passed (its entries are then
    the codec's). One pass over the stats only: 11% (int8) to 33% (int2, or fp32 stats) of a
    KIVI frame's bytes with groups of 32, measured at 18-62 ms per GiB of frames on a shared
    2-core host, about what the payload checksum's pass costs. A Raw frame has none, and its
    values are not read: a NaN scan of its payload measured 4-5 times the checksum, for no
    guarantee of its values (docs/http-api.md, "What a write is trusted with")."""
    import numpy as np  # (the server's dependency: the library never calls this)

    view = memoryview(data).cast("B")
    for e in meta.tensors:
        role = e.name.rpartition(".")[2]
        if role not in _STAT_ROLES or e.dtype not in _STAT_BITS:
            continue
        int_dtype, exponent = _STAT_BITS[e.dtype]
        bits = np.frombuffer(view, dtype=int_dtype, count=e.nbytes // BUFFER_DTYPES[e.dtype],
                             offset=meta.payload_offset + e.offset)
        if bits.size == 0:
            continue
        _expect(int((bits & exponent).max()) != exponent, "{}: holds NaN or Inf ({} stats must be finite)",
                e.name, e.dtype)
        if role == "scale":
            # The sign bit set (a negative integer), other than -0.0 (the integer's minimum).
            negative = np.count_nonzero(bits < 0) - np.count_nonzero(bits == np.iinfo(bits.dtype).min)
            _expect(negative == 0, "{}: {} negative scale(s) (a group's scale is its range over its "
                    "levels: never below zero)", e.name, negative)
