import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cacheseek import KIVI, KVLayout, Raw
from cacheseek.errors import ConfigError, InputError
from cacheseek.hashing import (
    block_hash,
    chain_hashes,
    from_hex,
    hash_token_blocks,
    root_hash,
    to_hex,
    token_block_bytes,
)

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


def test_root_follows_the_documented_recipe():
    # Rebuilt here from DESIGN's recipe with xxhash directly, not through the library.
    def field(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    layout, codec = KVLayout(30, 3, 64, "float16"), KIVI(bits=4, group_size=32)
    data = (b"cacheseek/v1" + field(b"ns") + field(b"smollm2") + field(b"L=30;H=3;D=64;dtype=float16")
            + struct.pack("<I", 64) + field(codec.fingerprint()))
    expect = xxhash.xxh3_128_digest(data)
    got = root_hash(namespace="ns", model_id="smollm2", layout_fingerprint=layout.fingerprint(),
                    block_tokens=64, codec_fingerprint=codec.fingerprint())
    assert got == expect
    tokens = list(range(64))
    expect_h0 = xxhash.xxh3_128_digest(expect + struct.pack("<64i", *tokens))
    assert hash_token_blocks(got, tokens, 64) == [expect_h0]


def test_keys_equal_across_processes_and_hash_seeds():
    script = (
        "import sys; sys.path.insert(0, 'scripts');"
        "from make_golden_keys import compute, CASES;"
        "import json; print(json.dumps([compute(c)['token_chain'] for c in CASES]))"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], check=True)
        outs.add(res.stdout)
    assert len(outs) == 1


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
        {"codec_fingerprint": Raw().fingerprint()},
        {"algo": "sha256"},
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


def test_token_bytes_are_little_endian_int32():
    assert token_block_bytes([1, -1, 256]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00"


def test_bytes_blocks_chain():
    root = _root()
    hs = chain_hashes(root, [b"a", b"b"])
    assert hs[0] == block_hash(root, b"a") and hs[1] == block_hash(hs[0], b"b")


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
        (lambda: block_hash(b"short", b"x"), "parent"),
        (lambda: from_hex("ABC"), "hash"),
        (lambda: from_hex("00" * 16, "sha256"), "hash"),
    ],
)
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises((ConfigError, InputError), match=match):
        call()
