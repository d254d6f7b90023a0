import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cacheseek import KIVI, KVLayout, Raw
from cacheseek.errors import ConfigError, InputError
from cacheseek.hashing import (
    BYTES,
    KEY_VERSION,
    TOKENS,
    ExtraKeys,
    MMInput,
    Shard,
    block_extra_keys,
    chain_hashes,
    from_hex,
    hash_block_tokens,
    hash_token_blocks,
    root_hash,
    to_hex,
    token_block_bytes,
)
from cacheseek.prefix_keys import PrefixKeys, Prompt

GOLDEN = Path(__file__).parent / "golden" / "keys.json"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_golden_keys import compute  # noqa: E402


def _root(**over):
    args = dict(
        namespace="ns", model_id="m", layout_fingerprint=KVLayout(2, 2, 64).fingerprint(),
        block_tokens=64, codec_fingerprint=KIVI(bits=4, group_size=32).fingerprint(), algo="xxh3_128",
    )
    args.update(over)
    return root_hash(**args)


def test_golden_vectors_unchanged():
    for case in json.loads(GOLDEN.read_text()):
        assert compute(case) == case, f"key bytes changed for {case['model_id']}/{case['algo']}"


def _f(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def test_root_follows_the_documented_recipe():
    # Rebuilt here from docs/design.md's recipe (Keys) with xxhash directly, not through the library.
    layout, codec = KVLayout(30, 3, 64, "float16"), KIVI(bits=4, group_size=32)
    data = (b"cacheseek/v3" + _f(b"ns") + _f(b"smollm2") + _f(b"L=30;H=3;D=64;dtype=float16")
            + struct.pack("<I", 64) + _f(codec.fingerprint()) + struct.pack("<4I", 1, 2, 0, 1))
    expect = xxhash.xxh3_128_digest(data)
    got = root_hash(namespace="ns", model_id="smollm2", layout_fingerprint=layout.fingerprint(),
                    block_tokens=64, codec_fingerprint=codec.fingerprint(), shard=Shard(tp_rank=1, tp_size=2))
    assert got == expect
    tokens = list(range(64))
    expect_h0 = xxhash.xxh3_128_digest(expect + b"T" + struct.pack("<64i", *tokens) + struct.pack("<I", 0))
    assert hash_token_blocks(got, tokens, 64) == [expect_h0]
    # caller-given bytes: kind B, then the bytes as given
    expect_b0 = xxhash.xxh3_128_digest(expect + b"B" + b"frame-0" + struct.pack("<I", 0))
    assert chain_hashes(got, [b"frame-0"]) == [expect_b0]


def test_extra_keys_follow_the_documented_recipe():
    root = _root()
    tokens = list(range(128))
    extra = ExtraKeys(lora_id="ad", cache_salt=b"s1", mm_inputs=(MMInput("img", 60, 10),))
    # block 0: the adapter, the image (tokens 60..69 overlap 0..63), the salt
    e0 = (b"L" + _f(b"ad") + b"M" + struct.pack("<I", 1) + _f(b"img") + struct.pack("<QQ", 60, 10)
          + b"S" + _f(b"s1"))
    # block 1: the adapter and the image (it overlaps 64..127 too); no salt
    e1 = b"L" + _f(b"ad") + b"M" + struct.pack("<I", 1) + _f(b"img") + struct.pack("<QQ", 60, 10)
    h0 = xxhash.xxh3_128_digest(root + b"T" + struct.pack("<64i", *tokens[:64]) + e0 + struct.pack("<I", len(e0)))
    h1 = xxhash.xxh3_128_digest(h0 + b"T" + struct.pack("<64i", *tokens[64:]) + e1 + struct.pack("<I", len(e1)))
    assert hash_token_blocks(root, tokens, 64, extra=extra) == [h0, h1]
    assert extra.for_blocks(2, 64) == [e0, e1]
    assert hash_block_tokens(root, struct.pack("<64i", *tokens[:64]), e0) == h0


def test_old_key_versions_never_match():
    # The v1 recipe (no shard, no closing length) and the v2 one (no content kind) on the
    # same configuration: nothing equal.
    layout, codec = KVLayout(30, 3, 64, "float16"), KIVI(bits=4, group_size=32)
    v1_root = xxhash.xxh3_128_digest(b"cacheseek/v1" + _f(b"ns") + _f(b"m") + _f(layout.fingerprint())
                                     + struct.pack("<I", 64) + _f(codec.fingerprint()))
    v1_h0 = xxhash.xxh3_128_digest(v1_root + struct.pack("<64i", *range(64)))
    v2_root = xxhash.xxh3_128_digest(b"cacheseek/v2" + _f(b"ns") + _f(b"m") + _f(layout.fingerprint())
                                     + struct.pack("<I", 64) + _f(codec.fingerprint()) + Shard().fingerprint())
    v2_h0 = xxhash.xxh3_128_digest(v2_root + struct.pack("<64i", *range(64)) + struct.pack("<I", 0))
    root = root_hash(namespace="ns", model_id="m", layout_fingerprint=layout.fingerprint(), block_tokens=64,
                     codec_fingerprint=codec.fingerprint())
    assert KEY_VERSION == b"cacheseek/v3"
    h0 = hash_token_blocks(root, list(range(64)), 64)[0]
    assert root not in (v1_root, v2_root) and h0 not in (v1_h0, v2_h0)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=16, max_size=16))
def test_a_bytes_block_never_shares_a_key_with_the_token_block_it_spells(tokens):
    # Caller-given bytes equal to a token block's int32 encoding, under the same root: the
    # content kind keeps them apart (they collided under cacheseek/v2).
    root = _root(block_tokens=8)
    spelled = token_block_bytes(tokens)
    as_tokens = hash_token_blocks(root, tokens, 8)
    as_bytes = chain_hashes(root, [spelled[:32], spelled[32:]])
    assert len(as_tokens) == 2 and not set(as_tokens) & set(as_bytes)
    assert chain_hashes(root, [spelled[:32], spelled[32:]], kind=TOKENS) == as_tokens
    assert hash_block_tokens(root, spelled[:32]) == as_tokens[0]
    assert hash_block_tokens(root, spelled[:32], kind=BYTES) == as_bytes[0]


def test_keys_equal_across_processes_and_hash_seeds():
    # Every golden case (shards and extra keys too), through the pure functions and
    # through PrefixKeys with a Prompt, in fresh processes under different hash seeds.
    script = (
        "import sys, json; sys.path.insert(0, 'scripts');"
        "from make_golden_keys import compute, CASES;"
        "import cacheseek as cs;"
        "from cacheseek.prefix_keys import PrefixKeys;"
        "keys = PrefixKeys.create(namespace='t', model_id='m', layout=cs.KVLayout(2, 2, 64), codec=cs.KIVI(),"
        " block_tokens=32, shard=cs.Shard(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, first_layer=2));"
        "p = cs.Prompt(list(range(100)), lora_id='a', cache_salt='s',"
        " mm_inputs=[cs.MMInput('x', 40, 8), cs.MMInput(b'y', 2, 3)]);"
        "print(json.dumps([[c['root'], c['token_chain']] for c in map(compute, CASES)]"
        " + [[h.hex() for h in keys.block_hashes(p)]]))"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], check=True)
        outs.add(res.stdout)
    assert len(outs) == 1
    golden = [[c["root"], c["token_chain"]] for c in json.loads(GOLDEN.read_text())]
    assert json.loads(outs.pop())[:-1] == golden


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "other"},
        {"model_id": "m2"},
        {"layout_fingerprint": KVLayout(3, 2, 64).fingerprint()},
        {"layout_fingerprint": KVLayout(2, 4, 64).fingerprint()},
        {"layout_fingerprint": KVLayout(2, 2, 128).fingerprint()},
        {"layout_fingerprint": KVLayout(2, 2, 64, "bfloat16").fingerprint()},
        {"block_tokens": 128},
        {"codec_fingerprint": KIVI(bits=2, group_size=32).fingerprint()},
        {"codec_fingerprint": KIVI(bits=4, group_size=64).fingerprint()},
        {"codec_fingerprint": KIVI(bits=4, group_size=32, v_bits=8).fingerprint()},
        {"codec_fingerprint": KIVI(bits=4, group_size=32, k_group_size=128).fingerprint()},
        {"codec_fingerprint": KIVI(bits=4, group_size=32, stats_dtype="float32").fingerprint()},
        {"codec_fingerprint": KIVI(bits=4, group_size=32, v_clip=2).fingerprint()},
        {"codec_fingerprint": Raw().fingerprint()},
        {"algo": "sha256"},
        {"shard": Shard(tp_rank=0, tp_size=2)},
        {"shard": Shard(pp_rank=0, pp_size=2)},
    ],
)
def test_any_change_changes_the_root(change):
    assert _root(**change) != _root()


def test_fields_cannot_bleed_into_each_other():
    assert _root(namespace="ab", model_id="c") != _root(namespace="a", model_id="bc")


def test_sha256_digests_are_32_bytes_and_hex_roundtrips():
    root = _root(algo="sha256")
    assert len(root) == 32
    h = hash_token_blocks(root, list(range(128)), 64, "sha256")
    assert [len(x) for x in h] == [32, 32]
    assert from_hex(to_hex(h[1]), "sha256") == h[1]
    assert to_hex(h[1]) == to_hex(h[1]).lower()


@given(
    tokens=st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), min_size=0, max_size=200),
    block=st.sampled_from([4, 16, 32]),
    cut=st.integers(min_value=0, max_value=200),
)
def test_chain_is_prefix_stable_and_partial_tails_are_not_keyed(tokens, block, cut):
    root = _root()
    full = hash_token_blocks(root, tokens, block)
    assert len(full) == len(tokens) // block
    assert hash_token_blocks(root, tokens[:cut], block) == full[: min(cut, len(tokens)) // block]


@given(
    tokens=st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), min_size=0, max_size=200),
    block=st.sampled_from([4, 16, 32]),
)
def test_ids_packed_by_the_caller_give_the_same_keys(tokens, block):
    # (prefill_with_reuse packs a prompt to check its ids, and hashes with those bytes)
    root = _root()
    packed = token_block_bytes(tokens)
    assert hash_token_blocks(root, tokens, block, packed=packed) == hash_token_blocks(root, tokens, block)
    keys = PrefixKeys(root, block)
    if tokens:
        assert keys.hashed(tokens, packed=packed).hashes == keys.hashed(tokens).hashes
    with pytest.raises(ValueError, match="packed"):  # bytes of other ids are refused, not hashed
        hash_token_blocks(root, tokens, block, packed=packed + b"\0\0\0\0")


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=50000), min_size=64, max_size=64),
    pos=st.integers(min_value=0, max_value=63),
)
def test_a_changed_token_changes_its_block_and_every_later_one(tokens, pos):
    root = _root()
    before = hash_token_blocks(root, tokens, 16)
    changed = list(tokens)
    changed[pos] += 1
    after = hash_token_blocks(root, changed, 16)
    first = pos // 16
    assert before[:first] == after[:first]
    assert all(a != b for a, b in zip(before[first:], after[first:]))


def test_tensor_and_list_token_ids_give_the_same_keys():
    torch = pytest.importorskip("torch")
    tokens = list(range(1000, 1256))
    root = _root()
    by_list = hash_token_blocks(root, tokens, 64)
    assert hash_token_blocks(root, torch.tensor(tokens), 64) == by_list
    assert hash_token_blocks(root, torch.tensor([tokens]), 64) == by_list


@pytest.mark.parametrize("n", [16, 1000], ids=["short", "long"])  # (the two ways 0s and 1s are found)
def test_a_bool_among_token_ids_is_refused_naming_its_index(n):
    # struct packs True and False as 1 and 0: a mask handed in as the ids got keys.
    import numpy as np

    root, ids = _root(), [j % 3 + 256 * (j % 7) for j in range(n)]  # 0s and 1s among them
    keys = hash_token_blocks(root, ids, 8)
    assert hash_token_blocks(root, torch.tensor(ids), 8) == keys  # 0 and 1 as ints are ids
    for j, bad in ((0, True), (n - 3, False), (n // 2, torch.tensor(True))):
        mixed = list(ids)
        mixed[j] = bad
        for keys_in in (mixed, tuple(mixed), Prompt(mixed), np.array(mixed, dtype=object)):
            with pytest.raises(InputError, match=rf"^token_ids\[{j}\]: a bool, not a token id$"):
                PrefixKeys(root, 8).block_hashes(keys_in)
        with pytest.raises(InputError, match=rf"^token_ids\[{j}\]: a bool"):
            token_block_bytes(mixed)
    # numpy and 0-d tensor integers are ids (as page ids are), bool dtypes are not
    assert hash_token_blocks(root, [np.int64(t) for t in ids], 8) == keys
    assert hash_token_blocks(root, [torch.tensor(t) for t in ids], 8) == keys
    for bools in (torch.ones(n, dtype=torch.bool), np.ones(n, dtype=bool)):
        with pytest.raises(InputError, match="^token_ids: a tensor of bools"):
            hash_token_blocks(root, bools, 8)
    # A batched tokenizer's ids: one row is a [1, T] (as a tensor of that shape is); two rows, or
    # a float tensor, are named as what they are (both were "not an int in the int32 range")
    assert hash_token_blocks(root, [list(ids)], 8) == keys
    assert PrefixKeys(root, 8).block_hashes([list(ids)]) == keys
    with pytest.raises(InputError, match=r"^token_ids: expected shape \[T\] or \[1, T\], got a list of 2 rows"):
        PrefixKeys(root, 8).block_hashes([list(ids), list(ids)])
    for floats in (torch.tensor(ids, dtype=torch.float32), np.array(ids, dtype=np.float64)):
        with pytest.raises(InputError, match=rf"^token_ids: expected an integer tensor, got (torch\.)?float\w+ \[{n}\]$"):
            PrefixKeys(root, 8).block_hashes(floats)
    # (numpy 2.4 refuses their __index__, and struct says so; 2.2 lets struct pack them, with
    # a warning, and they are then found as bools)
    for bad in (np.True_, np.array(False)):
        with pytest.raises(InputError, match=rf"^token_ids(: every id must be an int|\[{n - 1}\]: a bool)"):
            hash_token_blocks(root, [*ids[:-1], bad], 8)


def test_token_bytes_are_little_endian_int32():
    assert token_block_bytes([1, -1, 256]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00"


def test_bytes_blocks_chain():
    root = _root()
    hs = chain_hashes(root, [b"a", b"b"])
    assert hs[0] == hash_block_tokens(root, b"a", kind=BYTES) and hs[1] == hash_block_tokens(hs[0], b"b", kind=BYTES)
    # the closing length keeps content and extra keys apart: no content bytes imitate extras
    extra = block_extra_keys(lora_id="x")
    assert hash_block_tokens(root, b"a" + extra, b"") != hash_block_tokens(root, b"a", extra)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: token_block_bytes([2**31]), "token_ids"),
        (lambda: token_block_bytes(["x"]), "token_ids"),
        (lambda: hash_token_blocks(_root(), [[1, 2], [3, 4]], 2), "token_ids"),
        (lambda: chain_hashes(_root(), ["text"]), r"block_keys\[0\]"),
        (lambda: _root(algo="md5"), "hash_algo"),
        (lambda: _root(block_tokens=0), "block_tokens"),
        (lambda: _root(model_id=""), "model_id"),
        (lambda: hash_block_tokens(b"short", b"x"), "parent"),
        (lambda: hash_block_tokens(_root(), b"x", kind=b"X"), "kind"),
        # vLLM's function of this name takes the ids: bytes([1, 2]) was another key, unsaid
        (lambda: hash_block_tokens(_root(), [1, 2, 3]), r"^content: expected bytes .*got list"),
        (lambda: chain_hashes(_root(), [b"x"], kind="B"), "kind"),
        (lambda: Shard(tp_rank=2, tp_size=2), "tp_rank"),
        (lambda: Shard(tp_size=0), "tp_size"),
        (lambda: Shard(pp_rank=-1, pp_size=2), "pp_rank"),
        (lambda: Shard(tp_rank=True, tp_size=2), "tp_rank"),
        # The root holds these as u32 and the names as UTF-8 (a struct.error and a
        # UnicodeEncodeError before: a lone surrogate reaches a str through JSON's escapes).
        (lambda: Shard(tp_rank=0, tp_size=1 << 32), "tp_size"),
        (lambda: _root(block_tokens=1 << 32), "block_tokens"),
        (lambda: _root(namespace="\ud800"), "namespace"),
        (lambda: _root(model_id="m\udfff"), "model_id"),
        (lambda: ExtraKeys(lora_id="\ud800"), "lora_id"),
        (lambda: block_extra_keys(lora_id="\ud800"), "lora_id"),
        (lambda: ExtraKeys(cache_salt="\udc80"), "cache_salt"),
        (lambda: Prompt([1, 2], cache_salt="\udc80"), "cache_salt"),
        (lambda: MMInput("\ud800", 0, 4), "MMInput.hash"),
        (lambda: _root(shard=(0, 1)), "shard"),
        (lambda: MMInput("h", -1, 4), "MMInput.offset"),
        (lambda: MMInput("h", 0, 0), "MMInput.length"),
        (lambda: MMInput("h", 1 << 63, 4), "MMInput.offset"),  # keys hold it as u64 (a struct.error before)
        (lambda: MMInput("h", 0, 2**64), "MMInput.length"),
        (lambda: MMInput("", 0, 4), "MMInput.hash"),
        (lambda: MMInput(7, 0, 4), "MMInput.hash"),
        (lambda: ExtraKeys(lora_id=""), "lora_id"),
        (lambda: ExtraKeys(lora_id=3), "lora_id"),
        (lambda: ExtraKeys(cache_salt=""), "cache_salt"),
        (lambda: ExtraKeys(mm_inputs=(("h", 0, 4),)), r"mm_inputs\[0\]"),
        (lambda: ExtraKeys(mm_inputs=None), "^mm_inputs: expected a sequence of cacheseek.MMInput, got NoneType"),
        (lambda: Prompt([1, 2], mm_inputs=MMInput("h", 0, 4)), "^mm_inputs: expected a sequence .* got MMInput"),
        (lambda: Prompt([b"block"]), "Prompt.token_ids"),
        (lambda: from_hex("ABC"), "hash"),
        (lambda: from_hex("00" * 16, "sha256"), "hash"),
        (lambda: hash_token_blocks(_root(), [1, 2, None], 2), "token_ids"),  # in the unkeyed tail too
        (lambda: hash_token_blocks(_root(), [1, 2, 2**40], 2), "token_ids"),
        (lambda: hash_token_blocks(_root(), torch.ones(4, dtype=torch.bool), 2), "bools"),
        (lambda: PrefixKeys(_root(), 2).num_tokens(5), "keys"),
        (lambda: PrefixKeys(_root(), 2).num_tokens(None), "keys"),
    ],
)
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises((ConfigError, InputError), match=match):
        call()


# -- shards and extra keys ---------------------------------------------------------------

shards = st.builds(lambda tp, tpr, pp, ppr, first: Shard(tpr % tp, tp, ppr % pp, pp, first),
                   st.integers(1, 8), st.integers(0, 7), st.integers(1, 4), st.integers(0, 3),
                   st.one_of(st.none(), st.integers(0, 3)))


@given(a=shards, b=shards, tokens=st.lists(st.integers(0, 50000), min_size=16, max_size=64))
def test_two_ranks_never_share_a_block(a, b, tokens):
    ha, hb = (hash_token_blocks(_root(shard=s), tokens, 16) for s in (a, b))
    if a == b:
        assert ha == hb
    else:
        assert not set(ha) & set(hb)


def test_every_rank_of_a_deployment_has_its_own_root():
    roots = {_root(shard=Shard(t, 8, p, 4)) for t in range(8) for p in range(4)}
    assert len(roots) == 32 and _root(shard=Shard()) == _root()


tokens64 = st.lists(st.integers(0, 50000), min_size=64, max_size=64)
names = st.text(min_size=1, max_size=8)


@given(tokens=tokens64, lora=names, other=names)
def test_a_lora_adapter_changes_every_block(tokens, lora, other):
    base = hash_token_blocks(_root(), tokens, 16)
    with_a = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(lora_id=lora))
    assert not set(base) & set(with_a)
    with_b = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(lora_id=other))
    assert (with_a == with_b) == (lora == other)


@given(tokens=tokens64, salt=st.one_of(names, st.binary(min_size=1, max_size=8)))
def test_a_cache_salt_is_hashed_into_the_first_block_and_so_changes_the_chain(tokens, salt):
    extra = ExtraKeys(cache_salt=salt)
    salted = hash_token_blocks(_root(), tokens, 16, extra=extra)
    assert not set(salted) & set(hash_token_blocks(_root(), tokens, 16))
    assert extra.for_blocks(4, 16)[0] != b"" and extra.for_blocks(4, 16)[1:] == [b""] * 3


mm = st.builds(MMInput, st.sampled_from(["img-a", "img-b", b"\x00raw"]), st.integers(0, 80), st.integers(1, 40))


@given(tokens=tokens64, inputs=st.lists(mm, max_size=4), data=st.data())
def test_an_mm_input_changes_the_blocks_from_the_first_it_overlaps(tokens, inputs, data):
    """Blocks before an input's first placeholder block are unchanged by it; that block and
    every later one change (the chain); the caller's order of the inputs does not matter."""
    base = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=tuple(inputs)))
    shuffled = data.draw(st.permutations(inputs))
    assert hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=tuple(shuffled))) == base
    new = data.draw(mm)
    more = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=(*inputs, new)))
    first = new.offset // 16
    assert more[:first] == base[:first]
    if new not in inputs:
        assert all(a != b for a, b in zip(more[first:], base[first:]))


@given(tokens=tokens64, offset=st.integers(0, 48), length=st.integers(1, 16))
def test_the_same_image_elsewhere_or_another_image_gives_other_keys(tokens, offset, length):
    at = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=(MMInput("img", offset, length),)))
    moved = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=(MMInput("img", offset + 1, length),)))
    other = hash_token_blocks(_root(), tokens, 16, extra=ExtraKeys(mm_inputs=(MMInput("img2", offset, length),)))
    assert at[offset // 16] != moved[offset // 16] and at[offset // 16] != other[offset // 16]


@given(tokens=st.lists(st.integers(0, 50000), max_size=120), cut=st.integers(0, 120), inputs=st.lists(mm, max_size=3),
       lora=st.one_of(st.none(), names), salt=st.one_of(st.none(), names))
def test_chains_with_extra_keys_are_prefix_stable(tokens, cut, inputs, lora, salt):
    extra = ExtraKeys(lora_id=lora, mm_inputs=tuple(inputs), cache_salt=salt)
    full = hash_token_blocks(_root(), tokens, 16, extra=extra)
    assert hash_token_blocks(_root(), tokens[:cut], 16, extra=extra) == full[: min(cut, len(tokens)) // 16]


def test_empty_extra_keys_are_no_extra_keys_and_prompts_hash_like_their_tokens():
    keys = PrefixKeys.create(namespace="", model_id="m", layout=KVLayout(2, 2, 64), codec=KIVI(), block_tokens=32)
    tokens = list(range(96))
    assert keys.block_hashes(Prompt(tokens)) == keys.block_hashes(tokens)
    assert hash_token_blocks(keys.root, tokens, 32, extra=ExtraKeys()) == keys.block_hashes(tokens)
    assert keys.block_hashes(Prompt(tokens, lora_id="a")) != keys.block_hashes(tokens)
    assert keys.num_tokens(Prompt(tokens)) == 96


@given(tokens=st.lists(st.integers(0, 50000), min_size=1, max_size=120), cut=st.integers(1, 120))
def test_hashed_keys_give_the_keys_hashes_and_their_prefixes_the_prefixes(tokens, cut):
    keys = PrefixKeys.create(namespace="", model_id="m", layout=KVLayout(2, 2, 64), codec=Raw(), block_tokens=16)
    hashed = keys.hashed(tokens)
    assert keys.block_hashes(hashed) == keys.block_hashes(tokens) and keys.num_tokens(hashed) == len(tokens)
    cut = min(cut, len(tokens))
    assert keys.block_hashes(hashed.prefix(cut)) == keys.block_hashes(tokens[:cut])
    assert keys.num_tokens(hashed.prefix(cut)) == cut


def test_hashed_keys_are_hashed_again_under_another_configuration(monkeypatch):
    layout, tokens = KVLayout(2, 2, 64), list(range(96))
    keys = PrefixKeys.create(namespace="", model_id="m", layout=layout, codec=Raw(), block_tokens=32)
    other_model = PrefixKeys.create(namespace="", model_id="n", layout=layout, codec=Raw(), block_tokens=32)
    other_block = PrefixKeys.create(namespace="", model_id="m", layout=layout, codec=Raw(), block_tokens=16)
    hashed = keys.hashed(tokens)
    assert other_model.block_hashes(hashed) == other_model.block_hashes(tokens) != keys.block_hashes(tokens)
    assert other_block.block_hashes(hashed) == other_block.block_hashes(tokens)
    assert keys.hashed(hashed).hashes == hashed.hashes  # hashed again from its keys, not wrapped twice
    # under its own configuration the hashes are not computed again
    import cacheseek.prefix_keys as prefix_keys

    monkeypatch.setattr(prefix_keys, "hash_token_blocks", lambda *a, **k: pytest.fail("hashed again"))
    assert keys.block_hashes(hashed) == list(hashed.hashes)
    keys.check_ingest(hashed, 96)
    with pytest.raises(InputError, match="KV holds 64"):
        keys.check_ingest(hashed, 64)


@pytest.mark.parametrize("shape", [(96,), (1, 96)])
def test_hashed_keys_prefix_of_a_tensor_holds_the_prefix_only(shape):
    """A [1, T] tensor's prefix kept all T ids (``[:n]`` sliced its batch dimension), so a
    cache of another configuration hashed all T and an ingest of n tokens was refused."""
    keys = PrefixKeys.create(namespace="", model_id="m", layout=KVLayout(2, 2, 64), codec=Raw(), block_tokens=16)
    other = PrefixKeys.create(namespace="", model_id="n", layout=KVLayout(2, 2, 64), codec=Raw(), block_tokens=16)
    prefix = keys.hashed(torch.arange(96).reshape(shape)).prefix(40)
    assert keys.num_tokens(prefix.keys) == 40
    assert other.block_hashes(prefix) == other.block_hashes(list(range(40)))
    keys.check_ingest(prefix, 40)


def test_hashed_keys_prefix_takes_token_ids_and_lengths_within_them_only():
    keys = PrefixKeys.create(namespace="", model_id="m", layout=KVLayout(2, 2, 64), codec=Raw(), block_tokens=32)
    for bad in (0, 97, -1):
        with pytest.raises(InputError, match=r"HashedKeys.prefix"):
            keys.hashed(list(range(96))).prefix(bad)
    with pytest.raises(InputError, match=r"HashedKeys.prefix"):
        keys.hashed([b"a", b"b"]).prefix(32)
    with pytest.raises(InputError, match="empty"):
        keys.hashed([])


def test_ranks_and_placeholder_offsets_take_any_integer_and_give_the_same_keys():
    # Engines hold ranks and placeholder ranges as numpy or tensor ints: such a value is the
    # int it stands for (the same keys, equal objects), while a bool, a float or a 1-element
    # list is refused as before.
    import numpy as np

    assert Shard(tp_rank=np.int64(1), tp_size=np.int32(2), pp_size=torch.tensor(1)) == Shard(tp_rank=1, tp_size=2)
    assert type(Shard(tp_rank=np.int64(1), tp_size=np.int64(2)).tp_rank) is int
    assert Shard(tp_rank=np.int64(1), tp_size=2).fingerprint() == Shard(tp_rank=1, tp_size=2).fingerprint()
    odd = ExtraKeys(mm_inputs=(MMInput("img", np.int64(60), torch.tensor(10)),))
    even = ExtraKeys(mm_inputs=(MMInput("img", 60, 10),))
    root = b"r" * 16
    tokens = list(range(128))
    assert hash_token_blocks(root, tokens, 64, extra=odd) == hash_token_blocks(root, tokens, 64, extra=even)
    for bad in (True, 1.0, [1], np.bool_(True), torch.tensor([1, 2])):
        with pytest.raises(ConfigError, match="Shard.tp_size"):
            Shard(tp_size=bad)
        with pytest.raises(InputError, match="MMInput.length"):
            MMInput("img", 0, bad)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(64, device="meta"),
    lambda: torch.arange(64).to_sparse(),
    lambda: torch.arange(64).reshape(1, 64).to_sparse(),
], ids=["meta", "sparse", "sparse-1xT"])
def test_token_ids_in_a_tensor_without_readable_values_are_an_input_error(make):
    # A meta tensor's tolist() raised NotImplementedError and a sparse one's RuntimeError,
    # out of every call that takes keys: no ValueError naming the parameter.
    keys = PrefixKeys.create(namespace="", model_id="m", layout=KVLayout(2, 2, 64), codec=Raw(), block_tokens=32)
    for call in (keys.block_hashes, keys.hashed, lambda ids: keys.block_hashes(Prompt(ids, lora_id="a"))):
        with pytest.raises(InputError, match="^token_ids: "):
            call(make())


def test_pipeline_stages_holding_other_layers_never_share_a_root():
    """A stage's rank and the stage count do not say which layers it holds once the layers
    are split unevenly (vLLM's VLLM_PP_LAYER_PARTITION): stage 1 of 32 layers split
    [8, 8, 8, 8] holds layers 8-15, split [9, 8, 8, 7] layers 9-16, both 8 layers under one
    KVLayout, so both had one root and each loaded the other's KV. ``first_layer`` names
    the stage's first layer in the root; left out, the root is the one it always was."""
    layout = KVLayout(8, 2, 64).fingerprint()
    even, uneven = Shard(pp_rank=1, pp_size=4, first_layer=8), Shard(pp_rank=1, pp_size=4, first_layer=9)
    assert _root(layout_fingerprint=layout, shard=even) != _root(layout_fingerprint=layout, shard=uneven)
    assert _root(shard=Shard(first_layer=0)) != _root()  # (said or not: other roots, never the same by chance)
    # The recipe: the shard's four u32, then b"F" and the first layer as u32 when given.
    assert even.fingerprint() == struct.pack("<4I", 0, 1, 1, 4) + b"F" + struct.pack("<I", 8)
    assert Shard(pp_rank=1, pp_size=4).fingerprint() == struct.pack("<4I", 0, 1, 1, 4)
    assert Shard(1, 2, 0, 1, 5) == Shard(tp_rank=1, tp_size=2, first_layer=5)
    for bad in (-1, 1 << 32, True, 1.0, "8"):
        with pytest.raises(ConfigError, match=r"^Shard.first_layer: "):
            Shard(first_layer=bad)
    import numpy as np

    assert Shard(first_layer=np.int64(8)).fingerprint() == Shard(first_layer=8).fingerprint()


def _codec_bytes_kv(dtype):
    # Integer arithmetic, not a random generator whose sequence may change between torch versions.
    n = torch.arange(2 * 2 * 128 * 64, dtype=torch.int64)
    k = ((((n * 7919) % 2003) - 1001).to(torch.float32) / 97).reshape(2, 2, 128, 64)
    v = ((((n * 104729) % 1999) - 999).to(torch.float32) / 131).reshape(2, 2, 128, 64)
    v[..., 5] *= 9  # an outlier channel: what v_clip and v_rotate are for
    return k.to(dtype), v.to(dtype)


# What each codec stores for _codec_bytes_kv: the xxh3-64 of its buffers end to end, per KV dtype.
CODEC_BYTES = {
    "raw": (Raw(), ("3548931d649e8a35", "e88bb60dff473ad0", "8131799b5ac5ae5e")),
    "int4": (KIVI(bits=4, group_size=32), ("13421f90410b60e4", "37087c431d152d09", "d92799d2fccf5406")),
    "int2": (KIVI(bits=2, group_size=32), ("0d0bbb960d153575", "4042bdce5969511d", "4e75f576f7d3e391")),
    "int8-g64": (KIVI(bits=8, group_size=64), ("0618e63059491160", "b820a6009af6af07", "a23f2da92cd5f3d0")),
    "k2v4-g128-fp32": (KIVI(k_bits=2, v_bits=4, group_size=128, stats_dtype="float32"),
                       ("689fc4c59ae942a9", "04f8ffd6fa67b6ee", "5476ab3cab6d99a3")),
    "k4v2-kg64": (KIVI(k_bits=4, v_bits=2, k_group_size=64, v_group_size=32),
                  ("f69248302a2b0f3e", "6f0d9180edaa2932", "94ec7f2752c6e920")),
    "v_clip": (KIVI(bits=4, group_size=32, v_clip=3), ("9aaa9243ae51f59b", "d9adb362b1105081", "25e552ed8c0e7420")),
    "v_rotate": (KIVI(bits=4, group_size=32, v_rotate=True),
                 ("d713e33e7b293916", "4eebd1b093a15076", "6d9f897f62d3e6a4")),
    "k4v2-clip-rotate": (KIVI(k_bits=4, v_bits=2, group_size=32, v_clip=2, v_rotate=True),
                         ("84d7f63e2a309b15", "6c1f8f81abd8ac1e", "b4f095988fef69f4")),
}


# The kernels where they run interpreted (on a CPU: the same bytes as the reference). Compiled
# for a GPU they round exact ties as the device does, and test_kernels compares them with the
# reference there (codes equal but at ties); their bytes are not pinned.
@pytest.mark.parametrize("backend", ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"])
@pytest.mark.parametrize("name", sorted(CODEC_BYTES))
def test_the_bytes_a_codec_stores_are_those_its_fingerprint_names(name, backend, monkeypatch):
    """A key names its blocks' bytes through the codec's fingerprint (its spec, with the
    codec's VERSION): a change to what a codec stores for the same KV under the same spec
    would have the blocks stored before it decoded by the new code, silently, under the same
    keys. These digests change only with that codec's VERSION (so its fingerprint, so every
    key): a failure here is a format change that needs one. Every setting that changes the
    bytes changes the fingerprint (the digests and the fingerprints are distinct alike)."""
    codec, want = CODEC_BYTES[name]
    monkeypatch.setenv("CACHESEEK_KIVI_BACKEND", backend)
    for dtype, digest in zip((torch.float16, torch.bfloat16, torch.float32), want):
        encoded = codec.encode(*_codec_bytes_kv(dtype))
        h = xxhash.xxh3_64()
        for _, _, buffer in encoded.named_buffers():
            h.update(buffer.contiguous().view(torch.uint8).numpy().tobytes())
        assert h.hexdigest() == digest, f"{name} ({dtype}) stores other bytes under its fingerprint {codec.fingerprint()}"
    assert len({c.fingerprint() for c, _ in CODEC_BYTES.values()}) == len(CODEC_BYTES)
    assert len({d for _, ds in CODEC_BYTES.values() for d in ds}) == 3 * len(CODEC_BYTES)


def _read_extra(data: bytes) -> tuple:
    """``block_extra_keys``' bytes read back as design.md lays them out: each reads back as
    exactly one (lora_id, inputs, salt), so no two of those share bytes."""
    at, lora, inputs, salt = 0, None, [], None

    def field() -> bytes:
        nonlocal at
        (n,) = struct.unpack_from("<I", data, at)
        at += 4 + n
        assert at <= len(data), "a length past the end"
        return data[at - n : at]

    def tag(t: bytes) -> bool:
        nonlocal at
        if data[at : at + 1] == t:
            at += 1
            return True
        return False

    if tag(b"L"):
        lora = field().decode()
    if tag(b"M"):
        (count,) = struct.unpack_from("<I", data, at)
        at += 4
        for _ in range(count):
            h = field()
            inputs.append((h, *struct.unpack_from("<QQ", data, at)))
            at += 16
    if tag(b"S"):
        salt = field()
    assert at == len(data), "bytes left over"
    return lora, inputs, salt


mm_parts = st.tuples(st.binary(min_size=1, max_size=4), st.integers(0, 2**63 - 1), st.integers(1, 2**63 - 1))


@given(lora=st.one_of(st.none(), st.text("LMS\x00\x01é", min_size=1, max_size=6)),
       inputs=st.lists(mm_parts, max_size=3), salt=st.one_of(st.none(), st.binary(min_size=1, max_size=6)),
       salt_as_text=st.booleans())
def test_a_blocks_extra_keys_read_back_as_exactly_what_they_were_made_of(lora, inputs, salt, salt_as_text):
    """Tags, lengths and counts keep an adapter, inputs and a salt apart whatever bytes they
    hold (tag letters, NULs, lengths in their own bytes): the encoding reads back unambiguously."""
    mm = [MMInput(h, o, n) for h, o, n in inputs]
    given_salt = salt.decode("latin-1") if salt is not None and salt_as_text else salt
    data = block_extra_keys(lora_id=lora, mm_inputs=mm, cache_salt=given_salt)
    want_salt = given_salt.encode() if isinstance(given_salt, str) else given_salt
    assert _read_extra(data) == (lora, [tuple(x) for x in inputs], want_salt)
    assert (data == b"") == (lora is None and not inputs and salt is None)


@given(st.lists(st.sampled_from([0, 1, 2, 255, 256, 257, 1 << 16, 1 << 24, -1, -2, -256, 2**31 - 1, -(2**31)])
                | st.integers(-(2**31), 2**31 - 1), min_size=0, max_size=400))
def test_the_scan_for_ids_a_bool_could_be_agrees_with_and_without_torch(ids):
    from cacheseek import hashing

    data = struct.pack(f"<{len(ids)}i", *ids)
    want = [j for j, t in enumerate(ids) if t in (0, 1)]
    assert hashing._zero_or_one(data) == want  # torch is loaded here
    real = sys.modules.pop("torch")
    try:
        assert hashing._zero_or_one(data) == want  # the scan a process without torch takes
    finally:
        sys.modules["torch"] = real


def test_keys_of_a_long_prompt_import_no_torch():
    """Keys are pure functions, and a router's process has no torch: hashing a prompt of more
    than 64 ids imported it (and failed where it was not installed), with the same keys."""
    ids = [j % 5 for j in range(16 * 1024)]  # many 0s and 1s
    root = _root()
    code = (
        "import sys; sys.modules['torch'] = None\n"  # an import of torch fails, as where it is not installed
        "from cacheseek.prefix_keys import PrefixKeys\n"
        f"keys = PrefixKeys(bytes.fromhex({root.hex()!r}), 256).block_hashes({ids!r})\n"
        "print(','.join(k.hex() for k in keys))\n"
        f"try:\n    PrefixKeys(bytes.fromhex({root.hex()!r}), 256).block_hashes([5] * 100 + [True])\n"
        "except Exception as exc: print(type(exc).__name__, exc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    keys, refused = r.stdout.splitlines()
    assert keys.split(",") == [k.hex() for k in hash_token_blocks(root, ids, 256)]
    assert refused == "InputError token_ids[100]: a bool, not a token id"


def test_an_input_that_ends_at_a_blocks_start_is_not_in_that_blocks_keys():
    """Overlap is half-open, as vLLM's: an input over tokens [10, 16) is block 0's alone, also
    when it sorts after a longer one still open at block 1 (nothing else pins the boundary:
    ``>=`` for ``>`` changed such prompts' keys, unversioned)."""
    a, b = MMInput("a", 0, 100), MMInput("b", 10, 6)
    blocks = ExtraKeys(mm_inputs=[a, b]).for_blocks(2, 16)
    assert blocks[0] == block_extra_keys(mm_inputs=[a, b])
    assert blocks[1] == block_extra_keys(mm_inputs=[a])
    ends_inside = ExtraKeys(mm_inputs=[a, MMInput("b", 10, 7)]).for_blocks(2, 16)
    assert ends_inside[1] == block_extra_keys(mm_inputs=[a, MMInput("b", 10, 7)])
