import struct

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

import cacheseek as cs
from cacheseek.errors import ChecksumError, FrameError, FrameVersionError
from cacheseek.store.frame import (
    ALIGN,
    MAGIC,
    MAX_HEADER_NESTING,
    PREAMBLE,
    FORMAT_VERSION,
    VERSION_PROBE_NBYTES,
    build_frame,
    check_codec_layout,
    head_version,
    parse_frame,
    parse_header,
    plan_frame,
    replan_frame,
)
from cacheseek.store.tier import BlockFrame

LAYOUT = cs.KVLayout(2, 2, 64, "float16")


def _frame(codec=None, position=3, seed=0):
    codec = codec or cs.KIVI(bits=4, group_size=32)
    template = codec.template((2, 2, 32, 64), "float16")
    specs = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    meta = plan_frame(block_hash=bytes([seed]) * 16, parent_hash=b"\x02" * 16, position=position, layout=LAYOUT,
                      block_tokens=32, codec=codec.spec(), buffers=specs)
    buffers = [bytes((seed + i + j) % 251 for j in range(e.nbytes)) for i, e in enumerate(meta.tensors)]
    return meta, buffers, build_frame(meta, buffers)


def test_roundtrip_and_alignment():
    meta, buffers, data = _frame()
    got = parse_frame(data)
    assert got.block_hash == b"\x00" * 16 and got.parent_hash == b"\x02" * 16 and got.position == 3
    assert got.layout == LAYOUT and got.codec == cs.KIVI(bits=4, group_size=32).spec()
    assert got.payload_offset % ALIGN == 0
    assert all(e.offset % ALIGN == 0 for e in got.tensors)
    view, base = memoryview(data), got.payload_offset
    assert [bytes(view[base + e.offset : base + e.offset + e.nbytes]) for e in got.tensors] == buffers
    assert len(data) == got.nbytes
    check_codec_layout(got)


def test_unsealed_frame_seals_on_the_way_out():
    meta, buffers, data = _frame()
    unsealed = bytearray(data)
    unsealed[: meta.payload_offset] = bytes(meta.payload_offset)  # header not written yet
    from cacheseek.store.frame import header_prefix

    unsealed[: meta.payload_offset] = header_prefix(meta)  # checksum field still zero
    with pytest.raises(ChecksumError):
        parse_frame(unsealed)
    frame = BlockFrame(meta, host=memoryview(unsealed), sealed=False)
    wire = frame.to_bytes()
    assert wire == bytes(data)
    assert frame.to_bytes() == bytes(data)  # stays sealed on a second call


@given(cut=st.integers(min_value=0, max_value=10_000))
def test_any_truncation_is_rejected(cut):
    _, _, data = _frame()
    cut = cut % len(data)
    with pytest.raises(FrameError):
        parse_frame(data[:cut])


@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_bit_flip_is_rejected(pos, bit):
    meta, _, data = _frame()
    corrupt = bytearray(data)
    pos %= len(corrupt)
    corrupt[pos] ^= 1 << bit
    with pytest.raises(FrameError):  # (in the padding after the header too: it must be zeros)
        parse_frame(corrupt)


def test_any_byte_of_the_padding_after_the_header_is_refused_unless_zero():
    # No checksum covers it, so parse_frame requires zeros. The bit-flip property above let
    # a flip there pass (a third of a percent of its positions), so nothing checked this.
    meta, _, data = _frame()
    assert meta.payload_offset > PREAMBLE.size + meta.header_nbytes
    for pos in range(PREAMBLE.size + meta.header_nbytes, meta.payload_offset):
        corrupt = bytearray(data)
        corrupt[pos] = 0x80
        with pytest.raises(FrameError, match="padding"):
            parse_frame(corrupt)


@given(st.binary(max_size=4096))
def test_random_bytes_are_rejected(blob):
    with pytest.raises(FrameError):
        parse_frame(blob)
    with pytest.raises(FrameError):
        parse_frame(MAGIC + blob)


def _forge(header: dict, payload: bytes = b"") -> bytes:
    """A frame with a self-consistent preamble around an arbitrary (hostile) header."""
    raw = msgpack.packb(header, use_bin_type=True)
    pre = PREAMBLE.pack(MAGIC, len(raw), xxhash.xxh3_64_intdigest(raw))
    body = pre + raw
    body += bytes(-len(body) % ALIGN)
    return body + payload


def _good_header():
    meta, _, data = _frame()
    return meta.header_dict(), bytes(data[meta.payload_offset :])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h: h["tensors"][1].update(offset=0), "overlapping"),
        (lambda h: h["tensors"][1].update(offset=65), "unaligned"),
        (lambda h: h["tensors"][5].update(nbytes=10**12, shape=[10**12 // 2]), "past the payload"),
        (lambda h: h["tensors"][0].update(shape=[2, 2, 4, 64, 1 << 40]), "nbytes disagrees|bad value"),
        (lambda h: h["tensors"][0].update(dtype="object"), "unknown"),
        (lambda h: h["tensors"].extend([h["tensors"][0]] * 20), "1..16"),
        (lambda h: h.update(v=2), "version"),
        (lambda h: h.update(hash=b"short"), "hash"),
        (lambda h: h.update(layout={"num_layers": -1, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}), "layout"),
        (lambda h: h.update(extra=1), "header keys"),
        (lambda h: h.update(payload_nbytes=1 << 61), "not where the last tensor ends"),
        (lambda h: h.update(payload_nbytes=h["payload_nbytes"] + 64), "not where the last tensor ends"),
        (lambda h: h["tensors"][1].update(offset=h["tensors"][1]["offset"] + 64), "leaving a gap"),
        (lambda h: h.update(pos=-1), "pos"),
        (lambda h: h.update(parent=bytes(32)), "hash and parent differ in size"),
        (lambda h: h.update(block_tokens=0), "block_tokens: bad value 0"),
    ],
)
def test_hostile_headers_are_rejected_before_any_payload_access(mutate, match):
    header, payload = _good_header()
    mutate(header)
    with pytest.raises(FrameError, match=match):
        parse_frame(_forge(header, payload))


def test_a_frame_with_bytes_after_its_payload_is_refused():
    """Unchecked, a frame parsed without its checksum (``verify=False``: a header read, a
    server's first look) took bytes past its payload as its own."""
    _, _, data = _frame()
    for verify in (False, True):
        with pytest.raises(FrameError, match="frame has 1 trailing bytes"):
            parse_frame(bytes(data) + b"\x00", verify=verify)


@pytest.mark.parametrize("version, extra", [(2, {}), (0, {}), (2, {"added_later": [1, 2]}), (7, {"checksum": None})])
def test_a_whole_frame_of_another_format_version_is_told_from_damage(version, extra):
    """Another release's frame (whole under its header checksum, its header with fields this
    release does not know) raises FrameVersionError: the tiers keep it, where damage goes."""
    header, payload = _good_header()
    header.update(v=version, **extra)
    with pytest.raises(FrameVersionError, match=f"version {version} is not 1"):
        parse_frame(_forge(header, payload))
    with pytest.raises(FrameVersionError):
        parse_header(_forge(header, payload))


@pytest.mark.parametrize("v", [1.0, True, "2", None])
def test_a_version_that_is_no_integer_is_damage(v):
    header, payload = _good_header()
    header.update(v=v)
    with pytest.raises(FrameError, match="version") as got:
        parse_frame(_forge(header, payload))
    assert not isinstance(got.value, FrameVersionError)


def test_huge_declared_header_length_is_rejected_without_allocating():
    data = PREAMBLE.pack(MAGIC, 2**32 - 1, 0) + b"\x00" * 100
    with pytest.raises(FrameError, match="header length"):
        parse_header(data)


def test_header_checksum_guards_the_header():
    header, payload = _good_header()
    good = bytearray(_forge(header, payload))
    struct.pack_into("<Q", good, 8, 12345)
    with pytest.raises(FrameError, match="header checksum"):
        parse_frame(good)


def test_entries_must_match_the_codec_for_the_layout():
    header, payload = _good_header()
    header["codec"] = cs.KIVI(bits=2, group_size=32).spec()
    meta = parse_frame(_forge(header, payload), verify=False)
    with pytest.raises(FrameError, match="do not match codec"):
        check_codec_layout(meta)
    header["codec"] = {"name": "zstd"}
    with pytest.raises(FrameError, match="codec"):
        check_codec_layout(parse_frame(_forge(header, payload), verify=False))
    # K grouped along tokens: a block that is not whole groups (the template would size it)
    header["codec"] = cs.KIVI(bits=4, group_size=128).spec()
    with pytest.raises(FrameError, match="cannot encode this layout and block size"):
        check_codec_layout(parse_frame(_forge(header, payload), verify=False))
    # msgpack map keys may be bytes as well as str: a FrameError too, not a TypeError
    header["codec"] = {**cs.KIVI(bits=4, group_size=32).spec(), b"junk": 1}
    with pytest.raises(FrameError, match="codec"):
        check_codec_layout(parse_frame(_forge(header, payload), verify=False))
    # nil where a spec holds bits or a group size: the constructor took None for "as bits or
    # group_size", so the frame passed as a KIVI(bits=4, group_size=32)'s under a spec no codec writes
    for key in ("k_bits", "v_bits", "k_group", "v_group"):
        header["codec"] = {**cs.KIVI(bits=4, group_size=32).spec(), key: None}
        with pytest.raises(FrameError, match=key):
            check_codec_layout(parse_frame(_forge(header, payload), verify=False))


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16), st.integers(0, 1 << 40))
def test_replanning_another_block_gives_what_planning_it_gives(block_hash, parent, position):
    codec = cs.KIVI(k_bits=2, v_bits=8, group_size=32)
    template = codec.template((2, 2, 32, 64), "float16")
    specs = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    common = dict(layout=LAYOUT, block_tokens=32, codec=codec.spec(), buffers=specs)
    first = plan_frame(block_hash=b"\x01" * 16, parent_hash=b"\x00" * 16, position=0, **common)
    want = plan_frame(block_hash=block_hash, parent_hash=parent, position=position, **common)
    got = replan_frame(first, block_hash=block_hash, parent_hash=parent, position=position)
    assert got == want and got.payload_offset == want.payload_offset
    assert got.cached_header() == want.cached_header()


def test_frames_of_one_model_parse_to_one_shared_layout_codec_and_tensor_table():
    # A tier keeps each block's meta for as long as it holds the block: fresh copies of what
    # every block of a model has alike cost ~1.1 KiB a block, uncounted by its budget.
    metas = [parse_frame(_frame(position=p, seed=s)[2]) for s, p in ((1, 0), (2, 5), (3, 1 << 20))]
    first = metas[0]
    for meta in metas[1:]:
        assert meta.layout is first.layout and meta.codec is first.codec and meta.tensors is first.tensors
        assert meta.block_tokens == first.block_tokens and meta.payload_nbytes == first.payload_nbytes
    assert [(m.block_hash, m.position) for m in metas] == [(bytes([1]) * 16, 0), (bytes([2]) * 16, 5),
                                                          (bytes([3]) * 16, 1 << 20)]
    assert len({m.checksum for m in metas}) == 3
    assert all(m.packed_header is None for m in metas)  # (the header is in the frame)
    first.header_dict()["codec"]["version"] = 2  # a header built from one changes no other
    assert metas[1].codec == cs.KIVI(bits=4, group_size=32).spec()

    # another configuration gets its own, equal to what it packed
    meta, _, data = _frame(codec=cs.KIVI(k_bits=2, v_bits=8, group_size=32), seed=4)
    other = parse_frame(data)
    assert (other.layout, other.codec, other.tensors, other.payload_nbytes) == (meta.layout, meta.codec, meta.tensors,
                                                                              meta.payload_nbytes)
    assert other.tensors != first.tensors and other.codec is not first.codec

    # a header laid out otherwise (the same fields in another order) parses to the same values
    header, payload = _good_header()
    reordered = parse_frame(_forge(dict(reversed(list(header.items()))), payload), verify=False)
    plain = parse_frame(_forge(header, payload), verify=False)
    assert reordered == plain and reordered.tensors == plain.tensors and reordered.codec == plain.codec


@given(cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_a_checksum_fed_in_pieces_is_the_payload_checksum(cuts):
    from cacheseek.store.frame import PayloadChecksum, payload_checksum

    _, _, data = _frame()
    meta = parse_frame(data)
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    checksum = PayloadChecksum()
    for a, b in zip(bounds, bounds[1:]):
        checksum.feed(memoryview(data)[a:b])
    assert checksum.digest() == payload_checksum(memoryview(data)[meta.payload_offset :]) == meta.checksum
    assert parse_frame(data, payload_digest=checksum.digest()) == meta
    with pytest.raises(ChecksumError):
        parse_frame(data, payload_digest=bytes(8))


def test_a_checksum_fed_no_frame_has_no_digest():
    from cacheseek.store.frame import PayloadChecksum

    for blob in (b"", b"CSKF", b"XXXX" + bytes(60), MAGIC + struct.pack("<IQ", 1 << 20, 0) + bytes(100)):
        checksum = PayloadChecksum()
        checksum.feed(blob)
        assert checksum.digest() is None, blob[:8]


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["codec", "layout", "shape"])
def test_a_value_nested_past_the_limit_is_refused_whatever_the_python_recursion_limit(where):
    """Depth is checked, not left to a RecursionError, which a repr or == of a value ~1000
    deep raises on Python 3.11 and not on 3.12: there the frame reached the codec check and
    its error echoed the whole value."""
    header, payload = _good_header()
    deep = _nested(MAX_HEADER_NESTING - 1)  # under the header and its codec or layout: one level over
    if where == "codec":
        header["codec"] = {**header["codec"], "version": deep}
    elif where == "layout":
        header["layout"] = {**header["layout"], "num_layers": deep}
    else:
        header["tensors"][0]["shape"] = _nested(MAX_HEADER_NESTING - 2)  # header, tensors, entry
    with pytest.raises(FrameError, match=f"nested too deep \\(over {MAX_HEADER_NESTING} levels\\)"):
        parse_header(_forge(header, payload))
    header, payload = _good_header()
    header["codec"] = {**header["codec"], "version": _nested(MAX_HEADER_NESTING - 2)}  # at the limit
    with pytest.raises(FrameError, match="codec") as got:
        check_codec_layout(parse_frame(_forge(header, payload), verify=False))
    assert len(str(got.value)) < 300  # the spec's repr is cut, not echoed whole


def test_a_codec_spec_in_an_error_is_cut_short():
    header, payload = _good_header()
    header["codec"] = {**header["codec"], "version": "x" * 60_000}
    with pytest.raises(FrameError, match="codec") as got:
        check_codec_layout(parse_frame(_forge(header, payload), verify=False))
    assert len(str(got.value)) < 300


def test_head_version_reads_the_version_from_a_values_first_bytes_alone():
    """What the Redis tier reads to tell another release's frame from its own without its
    header (``GETRANGE`` of the first bytes): the version where the header's map opens with
    ``v`` and a small int (fixmap, map16 or map32), None for anything else."""
    from store_helpers import as_other_version

    _, _, data = _frame()
    assert head_version(bytes(data[:VERSION_PROBE_NBYTES])) == FORMAT_VERSION
    assert head_version(as_other_version(bytes(data))[:VERSION_PROBE_NBYTES]) == 2
    head = bytes(data[: PREAMBLE.size])
    for map_head in (b"\x81", b"\xde\x00\x01", b"\xdf\x00\x00\x00\x01"):
        assert head_version(head + map_head + b"\xa1v\x07" + bytes(8)) == 7
    assert head_version(head + b"\x81\xa4hash") is None  # (another field first: only a parse tells)
    assert head_version(head + b"\x81\xa1v\xcd\x01\x00") is None  # (a version past a fixint)
    assert head_version(b"XXXX" + bytes(20)) is None and head_version(b"") is None
    assert head_version(bytes(data[: PREAMBLE.size + 2])) is None  # (cut short)


def test_a_model_in_use_keeps_its_shared_header_through_many_configurations_seen_once():
    # Frames of configurations seen once (rejected ones, another writer's) pass through the
    # shared headers without pushing out the model whose frames keep coming: a hit is the
    # most recent, and 64 others since its last frame (not since its first) are what it takes.
    def frame(block_tokens, seed):
        meta = plan_frame(block_hash=bytes([seed % 251]) * 16, parent_hash=b"\x02" * 16, position=1, layout=LAYOUT,
                          block_tokens=block_tokens, codec={"name": "raw"}, buffers=[("kv", "uint8", (64,))])
        return build_frame(meta, [bytes(64)])

    first = parse_frame(frame(32, 0))
    for n in range(1, 200):
        parse_frame(frame(1000 + n, n))  # another configuration, seen once
        if n % 16 == 0:
            assert parse_frame(frame(32, n)).codec is first.codec
