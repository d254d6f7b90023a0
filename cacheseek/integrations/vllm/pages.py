"""vLLM's paged KV cache seen as per-layer (K, V) page views, and token slots in it.

vLLM (v1, from 0.2x on) gives a connector one tensor per attention layer, of logical shape
``[P, H, N, C]``: P pages (kernel blocks) of N tokens, H KV heads, and C = 2 * head_dim
elements holding one head's K and V. How K and V share those C elements is the attention
backend's choice, and the connector has to know it:

- ``"channel"`` (FLASH_ATTN, TRITON_ATTN): per token and head, K in ``[..., :D]`` and V in
  ``[..., D:]``. With vLLM's default LBNHC layout a page is ``[N, H, 2D]`` in memory
  (the old flash layout's ``[2, P, N, H, D]`` with K and V interleaved per token).
  An MLA backend's pages are ``[P, 1, N, C]``, one latent per token: the same split reads its
  halves as K and V (H = 1, D = C / 2; ``cs.KVLayout.mla``).
- ``"token"`` (CPU_ATTN): each (page, head) row of ``N * 2D`` elements holds the page's K
  in its first ``N * D`` and its V in the rest (the backend views it as ``[P, H, 2N, D]``
  and splits at N). vLLM's CPU kernels (its "vec" ISAs) keep V row-major, ``[N, D]``, and
  K column-major, ``[D, N]``: channel ``d`` of token ``t`` at ``d * N + t``. So a token's
  K is strided by N, not contiguous (read as rows, a row held other tokens' channels). The
  AMX ISA packs K and V in tiles that no view describes: the connector refuses it at start
  (connector.py checks the layout against vLLM's own kernel).

Either way the views below are ``[P, H, N, D]`` with strides into the one tensor: nothing
is copied, and they are handed to the engine surface as ``cs.KVPages(k, v, layout="HND")``
(``VllmPages.engine``), whose paged ingest and ``materialize_into`` read and write them in
place. A vLLM block (the unit of the scheduler's block ids) may span several pages when
the kernel's block is smaller than the manager's; ``page_table`` maps a request's block
ids to the pages holding its tokens.

Torch only, no vLLM import: the GPU benchmark drives the same code without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError, InputError
from ...pages import KVPages

KV_SPLITS = ("channel", "token")


@dataclass(frozen=True, slots=True)
class PageFormat:
    """How one engine lays KV out in its pages."""

    kv_split: str  # "channel" or "token" (see the module docstring)
    head_dim: int
    block_size: int  # tokens per vLLM block: the unit of the scheduler's block ids
    page_tokens: int  # tokens per page of the layer tensors (divides block_size)

    def __post_init__(self) -> None:
        if self.kv_split not in KV_SPLITS:
            raise ConfigError(f"kv_split: must be one of {list(KV_SPLITS)}, got {self.kv_split!r}")
        if self.page_tokens <= 0 or self.block_size % self.page_tokens:
            raise ConfigError(
                f"page_tokens: {self.page_tokens} does not divide the vLLM block size {self.block_size}"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_tokens


def kv_views(layer: torch.Tensor, fmt: PageFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer's page tensor ``[P, H, N, 2D]``, each ``[P, H, N, D]``."""
    if layer.dim() != 4 or layer.shape[-1] != 2 * fmt.head_dim or layer.shape[2] != fmt.page_tokens:
        raise InputError(
            f"kv cache layer: shape {list(layer.shape)}, expected [pages, heads, {fmt.page_tokens}, "
            f"{2 * fmt.head_dim}]"
        )
    d, n = fmt.head_dim, fmt.page_tokens
    if fmt.kv_split == "channel":
        return layer[..., :d], layer[..., d:]
    if layer.stride(3) != 1 or layer.stride(2) != 2 * d:
        raise InputError(f"kv cache layer: a token-split page needs contiguous [N, 2D] rows, strides {layer.stride()}")
    page, head = layer.stride(0), layer.stride(1)
    k = layer.as_strided((*layer.shape[:2], n, d), (page, head, 1, n))
    v = layer.as_strided((*layer.shape[:2], n, d), (page, head, d, 1), layer.storage_offset() + n * d)
    return k, v


class VllmPages:
    """An engine's KV cache: per-layer (K, V) page views, in the model's layer order."""

    def __init__(self, layers: list[torch.Tensor], fmt: PageFormat) -> None:
        if not layers:
            raise InputError("kv caches: no attention layer was registered")
        self.fmt = fmt
        self.views = [kv_views(t, fmt) for t in layers]
        self.num_pages = layers[0].shape[0]
        self.num_heads = layers[0].shape[1]
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self.engine = engine_pages(self.views)

    def page_table(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """The pages holding tokens ``[0, num_tokens)`` of a request, in order."""
        per = self.fmt.pages_per_block
        n = -(-num_tokens // self.fmt.page_tokens)
        if n > len(block_ids) * per:
            raise InputError(f"page table: {num_tokens} tokens do not fit {len(block_ids)} blocks of {self.fmt.block_size}")
        return [block_ids[j // per] * per + j % per for j in range(n)]

    @property
    def num_layers(self) -> int:
        return len(self.views)


def engine_pages(views: list[tuple[torch.Tensor, torch.Tensor]]) -> KVPages:
    """The same pages as the engine surface's ``cs.KVPages``: K and V as ``[P, H, N, D]``
    views, its HND layout. The kernels address vLLM's own memory through them."""
    return KVPages([k for k, _ in views], [v for _, v in views], layout="HND")


__all__ = ["KV_SPLITS", "PageFormat", "VllmPages", "engine_pages", "kv_views"]
