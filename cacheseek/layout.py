"""The shape of a model's KV cache, and the dtypes CacheSeek accepts.

Torch-free on purpose: hashing, frames and the server describe layouts without importing
torch. ``KVLayout`` accepts a ``torch.dtype`` too and keeps only its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

# dtype name -> bytes per element, for every dtype a KV tensor may have.
KV_DTYPES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

# The 8-bit floats: an engine's fp8 KV cache (vLLM ``--kv-cache-dtype fp8*``), stored byte
# for byte (only the Raw codec takes them: KIVI's kernels and reference compute in the KV's
# own dtype, which has no arithmetic on these).
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})

_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    # No bare "fp8": vLLM's means e4m3 on CUDA and e4m3fnuz on ROCm, two encodings.
    "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a KV dtype given as a ``torch.dtype`` or a string."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in KV_DTYPES:
        raise ConfigError(f"dtype: KV must be one of {sorted(KV_DTYPES)}, got {dtype!r}")
    return name


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per-model KV geometry: part of every key, so two layouts never share blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout.{field}: must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, dtype: Any = "float16") -> KVLayout:
        """An MLA model's cache (DeepSeek-V2/V3: per token and layer one latent of
        ``latent_dim`` = kv_lora_rank + rope dim elements, shared by every head): one "head"
        whose K is the latent's first half and V the rest (``KVPages.mla`` makes those views),
        so every codec, kernel and tier stores it as it stores K and V."""
        if isinstance(latent_dim, bool) or not isinstance(latent_dim, int) or latent_dim <= 0 or latent_dim % 2:
            raise ConfigError(f"KVLayout.mla latent_dim: must be a positive even int (kv_lora_rank + rope dim), "
                              f"got {latent_dim!r}")
        return cls(num_layers=num_layers, num_kv_heads=1, head_dim=latent_dim // 2, dtype=dtype)

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def itemsize(self) -> int:
        return KV_DTYPES[self.dtype]

    def raw_nbytes(self, num_tokens: int) -> int:
        """Bytes of K plus V, unencoded, for ``num_tokens`` tokens of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * num_tokens * self.head_dim * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: Any) -> KVLayout:
        if not isinstance(data, dict) or set(data) != {"num_layers", "num_kv_heads", "head_dim", "dtype"}:
            raise ConfigError(f"KVLayout: expected num_layers, num_kv_heads, head_dim and dtype, got {data!r}")
        return cls(**data)

    def fingerprint(self) -> bytes:
        """Canonical bytes that name this layout inside the root hash."""
        return f"L={self.num_layers};H={self.num_kv_heads};D={self.head_dim};dtype={self.dtype}".encode()

    @property
    def torch_dtype(self):  # -> torch.dtype, imported lazily to keep this module torch-free
        import torch

        return getattr(torch, self.dtype)
