"""Write tests/golden/keys.json from the current key code.

Run only when the key bytes change on purpose (which also means a new KEY_VERSION):
the golden file exists so that an accidental change can never go unnoticed.
"""

import json
import sys
from pathlib import Path

from cacheseek import KIVI, KVLayout, Raw
from cacheseek.hashing import chain_hashes, hash_token_blocks, root_hash

CASES = [
    {"namespace": "", "model_id": "smollm2-135m", "layout": [30, 3, 64, "float16"], "block_tokens": 64,
     "codec": {"bits": 4, "group_size": 32}, "algo": "xxh3_128"},
    {"namespace": "tenant-a", "model_id": "llama-3-8b", "layout": [32, 8, 128, "bfloat16"], "block_tokens": 256,
     "codec": {"k_bits": 2, "v_bits": 4, "group_size": 128}, "algo": "xxh3_128"},
    {"namespace": "tenant-a", "model_id": "llama-3-8b", "layout": [32, 8, 128, "bfloat16"], "block_tokens": 256,
     "codec": None, "algo": "sha256"},
]


def compute(case: dict) -> dict:
    layout = KVLayout(*case["layout"])
    codec = Raw() if case["codec"] is None else KIVI(**case["codec"])
    root = root_hash(
        namespace=case["namespace"], model_id=case["model_id"], layout_fingerprint=layout.fingerprint(),
        block_tokens=case["block_tokens"], codec_fingerprint=codec.fingerprint(), algo=case["algo"],
    )
    bt = case["block_tokens"]
    tokens = [(i * 7919 + 13) % 50257 for i in range(bt * 3 + 5)]
    token_chain = hash_token_blocks(root, tokens, bt, case["algo"])
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
