"""The keys of one cache configuration: its root hash, and the chained block hashes of
what a caller hands in (token ids, a ``Prompt`` with extra keys, or one bytes object per
block).

Shared by the embedded ``PrefixCache`` and the HTTP ``RemoteCache``, so the two compute
the same keys by the same code. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .hashing import (
    as_index,
    DEFAULT_ALGO,
    SINGLE,
    BlockHash,
    ExtraKeys,
    MMInput,
    Shard,
    chain_hashes,
    hash_token_blocks,
    root_hash,
)
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .quant.policy import PrecisionPolicy


def is_block_keys(keys: Any) -> bool:
    return isinstance(keys, (list, tuple)) and len(keys) > 0 and isinstance(keys[0], (bytes, bytearray, memoryview))


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Prompt:
    """Token ids with what else decides their KV: a LoRA adapter, multimodal inputs (each
    a content hash and the placeholder tokens it fills), a cache salt. Accepted wherever
    token ids are; blocks of prompts that differ in any of these never match.

        cs.Prompt(token_ids, lora_id="sql-adapter", cache_salt="tenant-7",
                  mm_inputs=[cs.MMInput(hash=image_sha, offset=5, length=576)])
    """

    token_ids: Any
    extra: ExtraKeys

    def __init__(self, token_ids: Any, *, lora_id: str | None = None, mm_inputs: Sequence[MMInput] = (),
                 cache_salt: str | bytes | None = None) -> None:
        if isinstance(token_ids, Prompt) or is_block_keys(token_ids):
            raise InputError("Prompt.token_ids: expected token ids (a list, tuple or tensor of ints)")
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "extra", ExtraKeys(lora_id=lora_id, mm_inputs=mm_inputs, cache_salt=cache_salt))

    def __len__(self) -> int:
        return _token_count(self.token_ids)


@dataclass(frozen=True, slots=True, eq=False)
class HashedKeys:
    """Keys hashed once (``PrefixKeys.hashed``), for one caller that hands the same keys to
    several calls of a cache: ``prefill_with_reuse`` locates, loads and saves a prompt,
    and hashing 16K tokens costs the host ~0.4 ms each time, on the path to the first
    token. Accepted wherever its keys are; a cache of another configuration hashes
    ``keys`` again. The keys must not change after this is made: where the hashes are
    reused they are not read again."""

    keys: Any
    num_tokens: int
    hashes: tuple[BlockHash, ...]
    config: tuple[BlockHash, int, str]  # (root, block_tokens, hash_algo) the hashes are under

    def prefix(self, num_tokens: int) -> HashedKeys:
        """The first ``num_tokens`` token ids (token keys only), with their hashes: a chain's
        hashes of a prefix are the first ones of the whole."""
        if isinstance(self.keys, Prompt) or is_block_keys(self.keys) or not 0 < num_tokens <= self.num_tokens:
            raise InputError(f"HashedKeys.prefix({num_tokens}): token ids only, 1..{self.num_tokens} tokens")
        # A [1, T] tensor's ids run along its second dimension ([:n] would keep all T).
        keys = self.keys[:, :num_tokens] if len(getattr(self.keys, "shape", ())) == 2 else self.keys[:num_tokens]
        return HashedKeys(keys, num_tokens, self.hashes[: num_tokens // self.config[1]], self.config)


def _token_count(tokens: Any) -> int:
    if isinstance(tokens, (list, tuple)):
        return len(tokens)
    shape = getattr(tokens, "shape", None)
    if isinstance(shape, tuple) and not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
        # (as hashing refuses it: counted as rows x T tokens first, a [2, T] batch of ids failed
        # the checks of the KV or page table given with it, which named those instead)
        raise InputError(f"token_ids: expected shape [T] or [1, T], got {list(shape)}")
    numel = getattr(tokens, "numel", None)
    if numel is not None:
        return int(numel())
    size = getattr(tokens, "size", None)
    if isinstance(size, int) and hasattr(tokens, "shape"):  # a numpy array: its len() of [1, T] is 1
        return size
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise InputError(f"keys: expected token ids (a list or a tensor), block keys or a Prompt, "
                         f"got {type(tokens).__name__}")
    return len(tokens)


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
        codec: KVLayerCodec | PrecisionPolicy,
        block_tokens: int,
        hash_algo: str = DEFAULT_ALGO,
        shard: Shard = SINGLE,
    ) -> PrefixKeys:
        """Check that ``codec`` fits ``layout`` and ``block_tokens``, and compute the root."""
        codec.check_layout(layout, block_tokens)
        root = root_hash(
            namespace=namespace, model_id=model_id, layout_fingerprint=layout.fingerprint(),
            block_tokens=block_tokens, codec_fingerprint=codec.fingerprint(), shard=shard, algo=hash_algo,
        )
        return cls(root=root, block_tokens=block_tokens, hash_algo=hash_algo)

    def hashed(self, keys: Any, *, packed: bytes | None = None) -> HashedKeys:
        """``keys`` with their block hashes, computed once (see ``HashedKeys``). ``packed``:
        ``hashing.token_block_bytes(keys)`` of token ids the caller has packed already
        (to check them), not packed again."""
        if isinstance(keys, HashedKeys):
            keys = keys.keys
        if packed is not None and isinstance(keys, list):
            hashes = hash_token_blocks(self.root, keys, self.block_tokens, self.hash_algo, packed=packed)
        else:
            hashes = self.block_hashes(keys)
        return HashedKeys(keys, self.num_tokens(keys), tuple(hashes), (self.root, self.block_tokens, self.hash_algo))

    def block_hashes(self, keys: Any) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``keys`` (token ids, a ``Prompt``, or one
        bytes per block, or ``HashedKeys``)."""
        if isinstance(keys, HashedKeys):
            if keys.config == (self.root, self.block_tokens, self.hash_algo):
                return list(keys.hashes)
            keys = keys.keys
        if isinstance(keys, Prompt):
            return hash_token_blocks(self.root, keys.token_ids, self.block_tokens, self.hash_algo, keys.extra)
        if is_block_keys(keys):
            return chain_hashes(self.root, keys, self.hash_algo)
        return hash_token_blocks(self.root, keys, self.block_tokens, self.hash_algo)

    def parents(self, hashes: list[BlockHash]) -> list[bytes]:
        return [self.root, *hashes[:-1]]

    def num_tokens(self, keys: Any) -> int:
        """Tokens named by ``keys``; raises ``InputError`` on an empty input."""
        if isinstance(keys, HashedKeys):
            return keys.num_tokens
        if is_block_keys(keys):
            return len(keys) * self.block_tokens
        n = _token_count(keys.token_ids if isinstance(keys, Prompt) else keys)
        if n == 0:
            raise InputError("token_ids: empty input")
        return n

    def check_ingest(self, keys: Any, kv_tokens: int) -> None:
        """``keys`` name exactly the ``kv_tokens`` tokens of the KV handed in with them."""
        if isinstance(keys, HashedKeys):
            keys = keys.keys
        if isinstance(keys, (list, tuple)) and len(keys) == 0:
            raise InputError("keys: empty input")
        if is_block_keys(keys):
            if kv_tokens // self.block_tokens != len(keys):
                raise InputError(
                    f"block_keys: {len(keys)} blocks of {self.block_tokens} tokens, but KV holds {kv_tokens} tokens"
                )
        elif self.num_tokens(keys) != kv_tokens:
            raise InputError(f"token_ids: {self.num_tokens(keys)} tokens, but KV holds {kv_tokens}")


__all__ = ["ExtraKeys", "HashedKeys", "MMInput", "PrefixKeys", "Prompt", "Shard", "as_index", "is_block_keys"]
