"""The ``Raw`` codec: K and V stored as they are, byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InputError
from ..layout import KVLayout
from .backend import layer_tables
from .codec import canonical_fingerprint, same_spec
from .payload import AXIS_TOKENS, EncodedLayer, EncodedTensor

VERSION = 1


@dataclass(frozen=True)
class Raw:
    """No quantization: the round trip is byte-identical. Rejects NaN and Inf all the same."""

    name = "raw"

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "version": VERSION}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Raw:
        if spec != {"name": "raw", "version": VERSION} or type(spec["version"]) is not int:
            raise ConfigError(f"raw spec: expected {{'name': 'raw', 'version': {VERSION}}}, got {spec!r:.200}")
        return cls()

    def fingerprint(self) -> bytes:
        return canonical_fingerprint(self.spec())

    def check_layout(self, layout: KVLayout, block_tokens: int) -> None:
        return None

    def template(self, shape: tuple[int, ...], dtype: str) -> EncodedLayer:
        from ..layout import KV_DTYPES

        def side() -> EncodedTensor:
            return EncodedTensor(None, None, None, tuple(shape), dtype, 8 * KV_DTYPES[dtype], 0, AXIS_TOKENS, 0, None)

        return EncodedLayer(k=side(), v=side(), codec=self.spec())

    def encoded_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        return layout.raw_nbytes(num_tokens)

    def safe_magnitudes(self, dtype: str, head_dim: int) -> None:
        return None  # only NaN and Inf are refused

    def encode(self, k: Any, v: Any) -> EncodedLayer:
        layer, finite = self.encode_deferred(k, v)
        self.check_finite(finite)
        return layer

    def encode_deferred(self, k: Any, v: Any, *, out: list[Any] | None = None) -> tuple[EncodedLayer, Any]:
        """Like :meth:`encode`, returning the validity flags for :meth:`check_finite`
        instead of waiting for them. ``out``: K's and V's buffers to copy them into."""
        import torch

        from .tensors import all_finite, check_kv, copy_into, dtype_str

        check_kv(k, v)
        layer = self.template(tuple(k.shape), dtype_str(k.dtype))
        buffers = [k.contiguous(), v.contiguous()] if out is None else list(copy_into((k, v), out))
        return layer.with_buffers(buffers), torch.stack([all_finite(k), all_finite(v)])

    def prepare_key(self) -> Any:
        return "layer-tables"  # KIVI's too, unless it rotates V

    def prepare_layers(self, k_layers: list[Any], v_layers: list[Any]) -> Any | None:
        """Tables of the layers' offsets for the Triton gather (see ``backend.layer_tables``;
        None: the caller stacks the layers, and that copy is the encoding)."""
        return layer_tables(k_layers, v_layers)

    def encode_layers_into(self, prepared: Any, t0: int, n: int, block_tokens: int, out: list[Any]) -> Any:
        """Copy ``n`` blocks of every layer straight into ``out`` ([n, L, H, B, D] views of K
        and V), one launch each, checking for NaN and Inf on the way. The flags are a host
        tensor the kernels write: read them only after the device has run the launches."""
        import torch

        from cacheseek import kernels

        k_table, v_table = prepared
        ok = torch.ones(2, dtype=torch.bool, pin_memory=k_table.device.type == "cuda")
        kernels.gather_layers(k_table, t0, n, block_tokens, out=out[0], ok_flag=ok[0:1])
        kernels.gather_layers(v_table, t0, n, block_tokens, out=out[1], ok_flag=ok[1:2])
        return ok

    def encode_pages_into(self, source: Any, first: int, n: int, block_tokens: int, out: list[Any],
                          layers: tuple[int, int] | None = None) -> Any:
        """Copy blocks ``[first, first + n)`` of ``source`` (blocks in an engine's pages) into
        ``out`` ([n, L, H, B, D] views of K and V), one gather launch each, checking for NaN
        and Inf: flags ``[2, n]`` in host memory, written by the launches (see
        ``KIVI.encode_pages_into``). Without Triton, a torch gather."""
        import torch

        from .backend import backend_for

        if backend_for(source.pages.k[0]) == "triton":
            from cacheseek import kernels

            k_pages, v_pages, where = source.kernel_pages(layers)
            ok = torch.ones((2, n), dtype=torch.bool, pin_memory=source.device.type == "cuda")
            kernels.gather_pages(k_pages, where, first, n, block_tokens, out=out[0], ok_flags=ok[0])
            kernels.gather_pages(v_pages, where, first, n, block_tokens, out=out[1], ok_flags=ok[1])
            return ok
        from .tensors import finite_per_block

        finite = []
        for view, side in zip(out, "kv"):
            rows = source.gather(side, first, n, layers)
            finite.append(finite_per_block(rows))  # per block, as the kernels flag them
            view.copy_(rows)
        return torch.stack(finite)

    def decode_into_pages(self, buffers: list[Any], source: Any, first: int, n: int,
                          layers: tuple[int, int] | None = None) -> None:
        """Copy ``n`` blocks (``buffers``: K and V as [n, L, H, B, D] views on the pages'
        device) into the pages of blocks ``[first, first + n)`` of ``source``."""
        from .backend import backend_for

        if backend_for(source.pages.k[0]) == "triton":
            from cacheseek import kernels

            k_pages, v_pages, where = source.kernel_pages(layers)
            kernels.scatter_pages(buffers[0], k_pages, where, first, n, source.block_tokens)
            kernels.scatter_pages(buffers[1], v_pages, where, first, n, source.block_tokens)
            return
        source.scatter("k", buffers[0], first, n, layers)
        source.scatter("v", buffers[1], first, n, layers)

    def check_finite(self, finite: Any, kv_dtype: str | None = None) -> None:
        flags = finite.tolist()
        if finite.dim() > 1:
            flags = [all(row) for row in flags]
        if not all(flags):
            raise InputError(f"{'k' if not flags[0] else 'v'}: holds NaN or Inf; input rejected")

    def decode(self, encoded: EncodedLayer, device: Any = None, *, out: Any = None) -> tuple[Any, Any]:
        import torch

        from .tensors import check_out, to_device

        if not same_spec(encoded.codec, self.spec()):
            raise InputError(f"encoded: made by codec {encoded.codec}, not {self.spec()}")
        encoded.check_made_as(self.template(encoded.k.shape, encoded.k.dtype))  # (a payload from elsewhere)
        if device is not None:
            encoded = to_device(encoded, device)
        else:
            first = encoded.k.qdata
            encoded = to_device(encoded, first.device if isinstance(first, torch.Tensor) else "cpu")
        k, v = (b for _, _, b in encoded.named_buffers())
        if out is None:
            return k, v
        out = check_out(out, encoded, k.device)
        self.decode_buffers([k, v], out)
        return out[0], out[1]

    def decode_buffers(self, buffers: list[Any], out: tuple[Any, Any]) -> None:
        out[0].copy_(buffers[0])
        out[1].copy_(buffers[1])
