"""Write tests/golden/keys.json from the current key code.

Run only when the key bytes change on purpose (which also means a new KEY_VERSION):
the golden file exists so that an accidental change can never go unnoticed.
"""

import json
import sys
from pathlib import Path

from cacheseek import KIVI, KVLayout, PrecisionPolicy, Raw
from cacheseek.hashing import ExtraKeys, MMInput, Shard, chain_hashes, hash_token_blocks, root_hash

LLAMA = {"namespace": "tenant-a", "model_id": "llama-3-8b", "layout": [32, 8, 128, "bfloat16"], "block_tokens": 256}
CASES = [
    {"namespace": "", "model_id": "smollm2-135m", "layout": [30, 3, 64, "float16"], "block_tokens": 64,
     "codec": {"bits": 4, "group_size": 32}, "algo": "xxh3_128"},
    {**LLAMA, "codec": {"k_bits": 2, "v_bits": 4, "group_size": 128}, "algo": "xxh3_128"},
    {**LLAMA, "codec": None, "algo": "sha256"},
    # A tensor- and pipeline-parallel rank: per-rank layout (2 of 8 KV heads, 16 of 32 layers).
    {**LLAMA, "layout": [16, 2, 128, "bfloat16"], "codec": {"bits": 4, "group_size": 32}, "algo": "xxh3_128",
     "shard": [1, 4, 1, 2]},
    # Extra keys: a LoRA adapter, two images (one spanning blocks 0 and 1, one inside block 2), a salt.
    {"namespace": "", "model_id": "smollm2-135m", "layout": [30, 3, 64, "float16"], "block_tokens": 64,
     "codec": {"bits": 4, "group_size": 32}, "algo": "xxh3_128", "shard": [0, 2, 0, 1],
     "extra": {"lora_id": "sql-adapter", "cache_salt": "tenant-7",
               "mm_inputs": [["img-9f86d081884c7d65", 40, 50], ["img-60303ae22b998861", 130, 10]]}},
    {**LLAMA, "codec": {"bits": 8, "group_size": 64}, "algo": "sha256",
     "extra": {"lora_id": None, "cache_salt": None, "mm_inputs": [["audio-0", 255, 2]]}},
    # A precision policy (first block int8, the rest K int4 / V int2): its own root.
    {"namespace": "", "model_id": "smollm2-135m", "layout": [30, 3, 64, "float16"], "block_tokens": 64,
     "codec": {"policy": {"first": {"bits": 8, "group_size": 32}, "first_blocks": 1,
                          "rest": {"k_bits": 4, "v_bits": 2, "group_size": 32}}}, "algo": "xxh3_128"},
    # The near miss with V's range search (KIVI v_clip): blocks of 128, int4 first block.
    {"namespace": "", "model_id": "smollm2-135m", "layout": [30, 3, 64, "float32"], "block_tokens": 128,
     "codec": {"policy": {"first": {"bits": 4, "group_size": 32}, "first_blocks": 1,
                          "rest": {"k_bits": 4, "v_bits": 2, "k_group_size": 128, "v_group_size": 64,
                                   "v_clip": 2}}}, "algo": "xxh3_128"},
]


def make_codec(spec: dict | None):
    if spec is None:
        return Raw()
    if "policy" in spec:
        p = spec["policy"]
        return PrecisionPolicy(first=make_codec(p["first"]), first_blocks=p["first_blocks"], rest=make_codec(p["rest"]))
    return KIVI(**spec)


def compute(case: dict) -> dict:
    layout = KVLayout(*case["layout"])
    codec = make_codec(case["codec"])
    shard = Shard(*case["shard"]) if "shard" in case else Shard()
    root = root_hash(
        namespace=case["namespace"], model_id=case["model_id"], layout_fingerprint=layout.fingerprint(),
        block_tokens=case["block_tokens"], codec_fingerprint=codec.fingerprint(), shard=shard, algo=case["algo"],
    )
    extra = None
    if "extra" in case:
        e = case["extra"]
        extra = ExtraKeys(lora_id=e["lora_id"], cache_salt=e["cache_salt"],
                          mm_inputs=tuple(MMInput(h, o, n) for h, o, n in e["mm_inputs"]))
    bt = case["block_tokens"]
    tokens = [(i * 7919 + 13) % 50257 for i in range(bt * 3 + 5)]
    token_chain = hash_token_blocks(root, tokens, bt, case["algo"], extra)
    byte_chain = chain_hashes(root, [b"frame-0", b"frame-1\x00action", b""], case["algo"])
    return {
        **case,
        "root": root.hex(),
        "token_chain": [h.hex() for h in token_chain],
        "byte_chain": [h.hex() for h in byte_chain],
    }


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/keys.json")
    out.write_text(json.dumps([compute(c) for c in CASES], indent=1) + "\n")
    print(f"wrote {out}")
