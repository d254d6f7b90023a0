"""The keys of one cache configuration: its root hash, and the chained block hashes of
what a caller hands in (token ids, or one bytes object per block).

Shared by the embedded ``PrefixCache`` and the HTTP ``RemoteCache``, so the two compute
the same keys by the same code. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .hashing import DEFAULT_ALGO, BlockHash, chain_hashes, hash_token_blocks, root_hash
from .layout import KVLayout
from .quant.codec import KVLayerCodec


def is_block_keys(keys: Any) -> bool:
    return isinstance(keys, (list, tuple)) and len(keys) > 0 and isinstance(keys[0], (bytes, bytearray, memoryview))


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    root: BlockHash
    block_tokens: int
    hash_algo: str = DEFAULT_ALGO

    @classmethod
    def create(
        cls,
        *,
        namespace: str,
        model_id: str,
        layout: KVLayout,
        codec: KVLayerCodec,
        block_tokens: int,
        hash_algo: str = DEFAULT_ALGO,
    ) -> PrefixKeys:
        """Check that ``codec`` fits ``layout`` and ``block_tokens``, and compute the root."""
        codec.check_layout(layout, block_tokens)
        root = root_hash(
            namespace=namespace, model_id=model_id, layout_fingerprint=layout.fingerprint(),
            block_tokens=block_tokens, codec_fingerprint=codec.fingerprint(), algo=hash_algo,
        )
        return cls(root=root, block_tokens=block_tokens, hash_algo=hash_algo)

    def block_hashes(self, keys: Any) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``keys`` (token ids, or one bytes per block)."""
        if is_block_keys(keys):
            return chain_hashes(self.root, keys, self.hash_algo)
        return hash_token_blocks(self.root, keys, self.block_tokens, self.hash_algo)

    def parents(self, hashes: list[BlockHash]) -> list[bytes]:
        return [self.root, *hashes[:-1]]

    def num_tokens(self, keys: Any) -> int:
        """Tokens named by ``keys``; raises ``InputError`` on an empty input."""
        if is_block_keys(keys):
            return len(keys) * self.block_tokens
        n = len(keys) if isinstance(keys, (list, tuple)) else int(getattr(keys, "numel", lambda: len(keys))())
        if n == 0:
            raise InputError("token_ids: empty input")
        return n

    def check_ingest(self, keys: Any, kv_tokens: int) -> None:
        """``keys`` name exactly the ``kv_tokens`` tokens of the KV handed in with them."""
        if isinstance(keys, (list, tuple)) and len(keys) == 0:
            raise InputError("keys: empty input")
        if is_block_keys(keys):
            if kv_tokens // self.block_tokens != len(keys):
                raise InputError(
                    f"block_keys: {len(keys)} blocks of {self.block_tokens} tokens, but KV holds {kv_tokens} tokens"
                )
        elif self.num_tokens(keys) != kv_tokens:
            raise InputError(f"token_ids: {self.num_tokens(keys)} tokens, but KV holds {kv_tokens}")


__all__ = ["PrefixKeys", "is_block_keys"]
