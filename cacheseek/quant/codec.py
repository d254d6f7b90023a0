"""The codec protocol every KV encoder implements, and the canonical bytes of a codec's spec.

Codecs are cheap value objects: constructing one never imports torch, so hashing, frames
and the server can name a codec (its spec and fingerprint) without it. ``encode`` and
``decode`` import torch when first called.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from ..layout import KVLayout
from .payload import EncodedLayer


@runtime_checkable
class KVLayerCodec(Protocol):
    """Encodes K and V of a layer (or a stack of layers/blocks) into compact buffers.

    ``encode(k, v)`` runs on the tensors' own device and returns buffers on that device.
    ``decode(encoded, device)`` first moves only the compact buffers to ``device``, then
    rebuilds K and V there; full-precision KV is never rebuilt elsewhere and copied over.
    Shapes are ``[..., H, T, D]``; leading dimensions pass through.
    """

    name: str

    def spec(self) -> dict[str, Any]: ...

    def fingerprint(self) -> bytes: ...

    def check_layout(self, layout: KVLayout, block_tokens: int) -> None: ...

    def template(self, shape: tuple[int, ...], dtype: str) -> EncodedLayer: ...

    def encoded_nbytes(self, layout: KVLayout, num_tokens: int) -> int: ...

    def encode(self, k: Any, v: Any) -> EncodedLayer: ...

    def encode_deferred(self, k: Any, v: Any, *, out: list[Any] | None = None) -> tuple[EncodedLayer, Any]:
        """``encode`` without the host wait: also returns device-side validity flags.
        ``out``: the template's buffers (any strides, on the KV's device) to encode into;
        the result holds them."""
        ...

    def prepare_key(self) -> Any:
        """Equal for codecs whose ``prepare_layers`` of the same layers are interchangeable
        (a precision policy's parts then prepare the layers once)."""
        ...

    def prepare_layers(self, k_layers: list[Any], v_layers: list[Any]) -> Any | None:
        """Get ready to encode blocks read in place from per-layer ``[H, T, D]`` K and V
        (which the caller has checked agree in shape, dtype and device); None if this codec
        or backend cannot (the caller then stacks the layers and calls ``encode_deferred``)."""
        ...

    def encode_layers_into(self, prepared: Any, t0: int, n: int, block_tokens: int, out: list[Any]) -> Any:
        """Encode ``n`` blocks of tokens from ``t0`` on from ``prepare_layers``' layers into
        ``out`` (the template's buffers as ``[n, L, H, ...]`` views); returns the flags of
        ``encode_deferred`` (possibly a host tensor the device writes: read it once the
        device has run the work queued so far)."""
        ...

    def encode_pages_into(self, source: Any, first: int, n: int, block_tokens: int, out: list[Any],
                          layers: tuple[int, int] | None = None) -> Any:
        """Encode blocks ``[first, first + n)`` of ``source`` (``cacheseek.pages.PagedSource``:
        blocks held in an engine's pages) into ``out`` as ``encode_layers_into`` does, reading
        the pages in place; ``layers = (l0, l1)``: only those layers (``out`` then holds
        ``l1 - l0``). Returns flags for ``check_finite``, one column per block when 2-D."""
        ...

    def decode_into_pages(self, buffers: list[Any], source: Any, first: int, n: int,
                          layers: tuple[int, int] | None = None) -> None:
        """Decode ``n`` blocks (the template's buffers as ``[n, L, H, ...]`` views on the
        pages' device) straight into the pages of blocks ``[first, first + n)`` of ``source``."""
        ...

    def check_finite(self, finite: Any, kv_dtype: str | None = None) -> None:
        """Raise ``InputError`` unless the flags from ``encode_deferred`` all hold; its
        message names the causes ``kv_dtype`` (the KV's, when given) leaves possible."""
        ...

    def safe_magnitudes(self, dtype: str, head_dim: int) -> tuple[float, float] | None:
        """``(k, v)``: magnitudes within which finite ``dtype`` KV always encodes; None when
        every finite input does. Lets a caller check KV before its encode with one cheap
        pass (min and max), and run the encode itself only on KV beyond them."""
        ...

    def decode(self, encoded: EncodedLayer, device: Any = None, *, out: Any = None) -> tuple[Any, Any]: ...

    def decode_buffers(self, buffers: list[Any], out: tuple[Any, Any]) -> None:
        """Decode the template's buffers (``[n, ...]`` views, already on ``out``'s device and
        checked against the template by the caller: a decoder's staging rows) into ``out``,
        K and V as ``[n, L, H, B, D]``: ``decode`` without building, checking or moving an
        ``EncodedLayer``, which costs the host more than the launches (~0.1 ms a call)."""
        ...


def canonical_fingerprint(spec: dict[str, Any]) -> bytes:
    """Canonical bytes of a codec spec: sorted keys, no whitespace. Part of every root hash."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()


def same_spec(a: Any, b: Any) -> bool:
    """Whether codec specs ``a`` and ``b`` name the same codec: equal, with every value of
    the same type. ``==`` holds for 1.0, True and 1, but a spec saying ``"k_bits": 4.0``
    is no codec's (the constructors refuse it) and has other canonical bytes, so another
    key: a frame whose header says so was not written by ``k_bits=4``."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        if a.keys() != b.keys():
            return False
        for key, value in a.items():
            if not same_spec(value, b[key]):
                return False
        return True
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(map(same_spec, a, b))
    return a == b
