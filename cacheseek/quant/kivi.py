"""The KIVI codec: K per channel (groups of tokens), V per token (groups of channels).

This class is the codec's configuration, validation, spec and sizes; ``quant.backend``
picks the implementation that runs it (the Triton kernels or the torch reference).
Constructing a ``KIVI`` never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, FrameError, InputError
from ..layout import KVLayout
from .backend import backend_for, layer_tables, ops_for
from .codec import canonical_fingerprint, same_spec
from .payload import AXIS_CHANNELS, AXIS_TOKENS, EncodedLayer, EncodedTensor
from .rotation import supported as rotation_supported

VERSION = 1
BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
STATS_DTYPES = ("float16", "float32")
CLIP_STEPS = (0, 1, 2, 3, 4, 5, 6)
_SPEC_KEYS = {"name", "version", "k_bits", "v_bits", "k_group", "v_group", "stats_dtype"}
_CLIP_KEY = "v_clip"  # in the spec only when on: codecs without it keep their fingerprints
_ROTATE_KEY = "v_rotate"  # likewise: in the spec (as true) only when on


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be True or False, got {value!r:.40}")
    return value


def _check_choice(name: str, value: Any, choices: tuple) -> Any:
    # Of the choices' own type: 4.0 == 4 (and True == 1), but a float would reach the spec,
    # so the same settings would get another fingerprint (another key) and float shapes.
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(f"{name}: must be one of {list(choices)}, got {value!r:.40}")
    return value


@dataclass(frozen=True, init=False)
class KIVI:
    """KIVI asymmetric quantization. ``KIVI(bits=4, group_size=32)`` sets K and V alike;
    ``k_bits``, ``v_bits``, ``k_group_size`` and ``v_group_size`` override one side.

    ``v_clip`` (0 to 6; 0, the default, is plain min/max): V's encoder also tries each
    group's range shrunk about its centre by 5%, 10%, ... (``v_clip`` steps) and keeps the
    one whose decode has the least squared error (``kivi_reference``). The stored format
    and the decoder are the same; the spec, so the keys, differ.

    ``v_rotate`` (default False): V's rows are rotated by a fixed orthonormal matrix of the
    head dimension (signed Hadamard, ``quant.rotation``) before they are quantized, and
    rotated back after they are decoded, which spreads V's outlier channels over every
    group. The rotated rows are computed in fp32 and rounded to V's dtype before the
    quantizer (with its range search, if any) sees them; decoding dequantizes to fp32,
    rotates back and rounds once. Same bytes per block; the spec, so the keys, differ.
    Needs a head_dim that is a power of two.

    ``stats_dtype`` (default ``"float16"``): each group's min and scale. ``"float32"`` for
    fp32 KV at a large offset with a small range, for int8 groups of ranges under ~1e-3
    (fp16 stores such a scale as a subnormal), and for bf16/fp32 values beyond 65504
    (docs/precision.md, "The stats dtype")."""

    k_bits: int
    v_bits: int
    k_group: int
    v_group: int
    stats_dtype: str
    v_clip: int
    v_rotate: bool

    name = "kivi"

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 32,
        *,
        k_bits: int | None = None,
        v_bits: int | None = None,
        k_group_size: int | None = None,
        v_group_size: int | None = None,
        stats_dtype: str = "float16",
        v_clip: int = 0,
        v_rotate: bool = False,
    ) -> None:
        _check_choice("bits", bits, BITS)
        _check_choice("group_size", group_size, GROUP_SIZES)
        values = {
            "k_bits": _check_choice("k_bits", bits if k_bits is None else k_bits, BITS),
            "v_bits": _check_choice("v_bits", bits if v_bits is None else v_bits, BITS),
            "k_group": _check_choice("k_group_size", group_size if k_group_size is None else k_group_size, GROUP_SIZES),
            "v_group": _check_choice("v_group_size", group_size if v_group_size is None else v_group_size, GROUP_SIZES),
            "stats_dtype": _check_choice("stats_dtype", str(stats_dtype).removeprefix("torch."), STATS_DTYPES),
            "v_clip": int(_check_choice("v_clip", v_clip, CLIP_STEPS)),
            "v_rotate": _check_flag("v_rotate", v_rotate),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return (
            f"KIVI(k_bits={self.k_bits}, v_bits={self.v_bits}, k_group_size={self.k_group}, "
            f"v_group_size={self.v_group}, stats_dtype={self.stats_dtype!r}"
            + (f", v_clip={self.v_clip}" if self.v_clip else "")
            + (", v_rotate=True)" if self.v_rotate else ")")
        )

    # -- identity ---------------------------------------------------------------------

    def spec(self) -> dict[str, Any]:
        spec = {
            "name": self.name,
            "version": VERSION,
            "k_bits": self.k_bits,
            "v_bits": self.v_bits,
            "k_group": self.k_group,
            "v_group": self.v_group,
            "stats_dtype": self.stats_dtype,
        }
        if self.v_clip:
            spec[_CLIP_KEY] = self.v_clip
        if self.v_rotate:
            spec[_ROTATE_KEY] = True
        return spec

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> KIVI:
        if not _SPEC_KEYS <= set(spec) <= _SPEC_KEYS | {_CLIP_KEY, _ROTATE_KEY}:
            raise ConfigError(f"kivi spec: expected keys {sorted(_SPEC_KEYS)} (and {_CLIP_KEY!r}, "
                              f"{_ROTATE_KEY!r} when on), got {sorted(map(repr, spec))!s:.200}")
        if type(spec["version"]) is not int or spec["version"] != VERSION:
            raise ConfigError(f"kivi spec: version {spec['version']!r:.40} is not {VERSION}")
        for key in ("k_bits", "v_bits", "k_group", "v_group"):
            # (the constructor takes None for "as bits or group_size": a spec holds the value itself)
            if spec[key] is None:
                raise ConfigError(f"kivi spec: {key} must be an int, got None")
        if type(spec["stats_dtype"]) is not str or spec["stats_dtype"] not in STATS_DTYPES:
            # (the constructor also takes a torch dtype, "torch.float16"; a spec holds the name only)
            raise ConfigError(f"kivi spec: stats_dtype must be one of {list(STATS_DTYPES)}, "
                              f"got {spec['stats_dtype']!r:.40}")
        if _CLIP_KEY in spec and (type(spec[_CLIP_KEY]) is not int or spec[_CLIP_KEY] not in CLIP_STEPS[1:]):
            raise ConfigError(f"kivi spec: {_CLIP_KEY} must be one of {list(CLIP_STEPS[1:])} "
                              f"(left out when off), got {spec[_CLIP_KEY]!r:.40}")
        if _ROTATE_KEY in spec and spec[_ROTATE_KEY] is not True:
            raise ConfigError(f"kivi spec: {_ROTATE_KEY} must be true (left out when off), "
                              f"got {spec[_ROTATE_KEY]!r:.40}")
        return cls(
            k_bits=spec["k_bits"], v_bits=spec["v_bits"], k_group_size=spec["k_group"],
            v_group_size=spec["v_group"], stats_dtype=spec["stats_dtype"], v_clip=spec.get(_CLIP_KEY, 0),
            v_rotate=spec.get(_ROTATE_KEY, False),
        )

    def fingerprint(self) -> bytes:
        return canonical_fingerprint(self.spec())

    # -- sizes --------------------------------------------------------------------------

    def check_layout(self, layout: KVLayout, block_tokens: int) -> None:
        if layout.fp8:
            # The kernels and the reference take each group's min and max in the KV's own
            # dtype, which for fp8 has no arithmetic (on the CPU, nor in the interpreter);
            # and int4 would only halve fp8's bytes, where it quarters 16-bit KV's. Not done.
            raise ConfigError(f"codec: KIVI ({self.spec()}) does not encode {layout.dtype} KV; "
                              "store an fp8 KV cache with the raw codec")
        if block_tokens % self.k_group:
            raise ConfigError(
                f"block_tokens: {block_tokens} is not a multiple of k_group_size={self.k_group} "
                "(K is grouped along tokens, and only whole blocks are stored)"
            )
        if self.v_rotate and not rotation_supported(layout.head_dim):
            raise ConfigError(f"head_dim: {layout.head_dim} is not a power of two, which v_rotate needs "
                              "(a Hadamard rotation of the head dimension)")
        per_word = 32 // self.v_bits
        if layout.head_dim % per_word:
            raise ConfigError(
                f"head_dim: {layout.head_dim} cannot be packed at v_bits={self.v_bits} "
                f"(needs a multiple of {per_word} channels per int32 word)"
            )

    def template(self, shape: tuple[int, ...], dtype: str) -> EncodedLayer:
        """The encoded layout of K and V of ``shape`` ([..., H, T, D]), without buffers."""
        shape = tuple(shape)

        def side(bits: int, group: int, axis: int) -> EncodedTensor:
            pad = math.ceil(shape[axis] / group) * group - shape[axis]
            return EncodedTensor(None, None, None, shape, dtype, bits, group, axis, pad, self.stats_dtype)

        return EncodedLayer(
            k=side(self.k_bits, self.k_group, AXIS_TOKENS),
            v=side(self.v_bits, self.v_group, AXIS_CHANNELS),
            codec=self.spec(),
        )

    def encoded_nbytes(self, layout: KVLayout, num_tokens: int) -> int:
        """Bytes stored for ``num_tokens`` tokens of every layer: codes plus stats."""
        shape = (layout.num_layers, layout.num_kv_heads, num_tokens, layout.head_dim)
        return self.template(shape, layout.dtype).nbytes

    # -- compute ------------------------------------------------------------------------

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if shape[-2] % self.k_group:
            raise InputError(f"k_group_size: {self.k_group} does not divide the number of tokens T={shape[-2]}")
        if shape[-1] % (32 // self.v_bits):
            raise InputError(
                f"head_dim: {shape[-1]} cannot be packed at v_bits={self.v_bits} "
                f"(needs a multiple of {32 // self.v_bits})"
            )
        if self.v_rotate and not rotation_supported(shape[-1]):
            raise InputError(f"head_dim: {shape[-1]} is not a power of two, which v_rotate needs")

    def _rotated(self, v: Any) -> Any:
        """V as the quantizer sees it: rotated in fp32, rounded to V's dtype (``v_rotate``)."""
        from .rotation import rotate

        return rotate(v, v.dtype) if self.v_rotate else v

    def _dequantize_v(self, ops: Any, vq: Any, vs: Any, vm: Any, shape: tuple[int, ...], dtype: Any,
                      out: Any = None) -> Any:
        """V decoded (into ``out`` when given): with ``v_rotate``, dequantized to fp32,
        rotated back, rounded once to ``dtype``."""
        if not self.v_rotate:
            return ops.dequantize(vq, vs, vm, bits=self.v_bits, group=self.v_group, axis=AXIS_CHANNELS,
                                  shape=shape, dtype=dtype, out=out)
        import torch

        from .rotation import unrotate

        y = ops.dequantize(vq, vs, vm, bits=self.v_bits, group=self.v_group, axis=AXIS_CHANNELS,
                           shape=shape, dtype=torch.float32)
        v = unrotate(y, dtype)
        if out is None:
            return v
        out.copy_(v)
        return out

    def encode(self, k: Any, v: Any) -> EncodedLayer:
        """Quantize on the tensors' device. Rejects NaN, Inf and ranges the stats cannot hold."""
        from .tensors import dtype_str

        layer, finite = self.encode_deferred(k, v)
        if not bool(finite.all()):
            side = "k" if not bool(finite[:2].all()) else "v"
            raise InputError(self._refusal(side, dtype_str(k.dtype), k if side == "k" else v))
        return layer

    def encode_deferred(self, k: Any, v: Any, *, out: list[Any] | None = None) -> tuple[EncodedLayer, Any]:
        """Like :meth:`encode`, without waiting for the device: also returns the validity
        flags (a small device tensor) for :meth:`check_finite`. The caller must check them
        before the encoding is used. ``out``: the template's six buffers (any strides, on
        the KV's device) to encode into, which the result then holds: the host codec writes
        them in place, the others' results are copied there."""
        import torch

        from .tensors import FP8_TORCH_DTYPES, all_finite, check_kv, dtype_str

        check_kv(k, v)
        if k.dtype in FP8_TORCH_DTYPES:
            raise InputError(f"k, v: KIVI does not encode {dtype_str(k.dtype)} KV; use the raw codec")
        self._check_shape(tuple(k.shape))
        if out is not None and len(out) != 6:
            raise ValueError(f"out: expected KIVI's 6 buffers (K's and V's codes, scale, min), got {len(out)}")
        ops = ops_for(k)
        stats = getattr(torch, self.stats_dtype)
        kq, ks, km = _quantize(ops, k, None if out is None else out[:3], bits=self.k_bits, group=self.k_group,
                               axis=AXIS_TOKENS, stats_dtype=stats)
        vq, vs, vm = _quantize(ops, self._rotated(v), None if out is None else out[3:], bits=self.v_bits,
                               group=self.v_group, axis=AXIS_CHANNELS, stats_dtype=stats, clip=self.v_clip)
        # A NaN or Inf anywhere in a group, or a group range beyond the stats dtype, leaves a
        # non-finite scale or min: one check over the small stats catches all of them.
        finite = torch.stack([all_finite(t) for t in (ks, km, vs, vm)])
        layer = self.template(tuple(k.shape), dtype_str(k.dtype))
        return layer.with_buffers([kq, ks, km, vq, vs, vm]), finite

    def prepare_key(self) -> Any:
        return "layer-tables, V rotated" if self.v_rotate else "layer-tables"  # Raw's is the plain one too

    def prepare_layers(self, k_layers: list[Any], v_layers: list[Any]) -> Any | None:
        """Tables of the layers' offsets for the Triton kernels (see :func:`layer_tables`).
        With ``v_rotate``, V's table is over rotated copies of V's layers (the kernels read
        them as they would the layers; the table keeps them alive)."""
        if self.v_rotate and backend_for(k_layers[0]) == "triton":
            if not rotation_supported(v_layers[0].shape[-1]):
                raise InputError(f"head_dim: {v_layers[0].shape[-1]} is not a power of two, which v_rotate needs")
            v_layers = [self._rotated(v) for v in v_layers]
        return layer_tables(k_layers, v_layers)

    def encode_layers_into(self, prepared: Any, t0: int, n: int, block_tokens: int, out: list[Any]) -> Any:
        """Quantize ``n`` blocks from token ``t0`` of the prepared layers straight into
        ``out``: one launch for K, one for V, no stacked copy of the KV. The flags are a
        host tensor the kernels write: read them only after the device has run the launches."""
        from cacheseek import kernels

        from .tensors import host_flags

        k_table, v_table = prepared
        # The flags live in host memory and the kernels clear them (K: [0], V: [2]) if a
        # stored stat is not finite: ready when the launches are, read with no copy.
        ok = host_flags((4,), k_table.device.type == "cuda")
        kernels.quantize_layers(k_table, t0, n, block_tokens, bits=self.k_bits, group=self.k_group,
                                axis=AXIS_TOKENS, out=tuple(out[:3]), ok_flag=ok[0:1])
        kernels.quantize_layers(v_table, t0, n, block_tokens, bits=self.v_bits, group=self.v_group,
                                axis=AXIS_CHANNELS, out=tuple(out[3:]), ok_flag=ok[2:3], clip=self.v_clip)
        return ok

    def encode_pages_into(self, source: Any, first: int, n: int, block_tokens: int, out: list[Any],
                          layers: tuple[int, int] | None = None) -> Any:
        """Quantize blocks ``[first, first + n)`` of ``source`` (a ``cacheseek.pages.PagedSource``:
        blocks in an engine's pages) straight into ``out`` (the template's buffers as ``[n, L,
        H, ...]`` views; with ``layers = (l0, l1)`` only those layers, as ``[n, l1 - l0, H,
        ...]``), one launch for K and one for V, reading the pages in place. Returns the
        validity flags: on the kernels, ``[4, n]`` in host memory (K in row 0, V in row 2,
        one column per block), written by the launches; read them once the device has run
        them. Without Triton (or with ``v_rotate``), the pages are gathered and encoded as
        tensors (by the kernels where they run)."""
        import torch

        # v_rotate: V's rows are rotated before the quantizer reads them, so not in place:
        # the pages are gathered (K too, for one simple path) and encoded as a tensor.
        if backend_for(source.pages.k[0]) == "triton" and not self.v_rotate:
            from cacheseek import kernels

            k_pages, v_pages, where = source.kernel_pages(layers)
            ok = torch.ones((4, n), dtype=torch.bool, pin_memory=source.device.type == "cuda")
            kernels.quantize_pages(k_pages, where, first, n, block_tokens, bits=self.k_bits, group=self.k_group,
                                   axis=AXIS_TOKENS, out=tuple(out[:3]), ok_flags=ok[0])
            kernels.quantize_pages(v_pages, where, first, n, block_tokens, bits=self.v_bits, group=self.v_group,
                                   axis=AXIS_CHANNELS, out=tuple(out[3:]), ok_flags=ok[2], clip=self.v_clip)
            return ok
        from .tensors import finite_per_block

        self.encode_deferred(source.gather("k", first, n, layers), source.gather("v", first, n, layers), out=out)
        # The stats, per block, as the kernels flag them.
        return torch.stack([finite_per_block(view) for view in out if view.is_floating_point()])

    def decode_into_pages(self, buffers: list[Any], source: Any, first: int, n: int,
                          layers: tuple[int, int] | None = None) -> None:
        """Decode ``n`` blocks (``buffers``: the template's buffers as ``[n, L, H, ...]`` views
        on the pages' device, e.g. staging rows; with ``layers`` only those layers) straight
        into the pages of blocks ``[first, first + n)`` of ``source``, one launch per side.
        Without Triton (or with ``v_rotate``, whose V is rotated back before it lands):
        decoded as tensors (by the kernels where they run), then scattered (the same bytes)."""
        kq, ks, km, vq, vs, vm = buffers
        if backend_for(source.pages.k[0]) == "triton" and not self.v_rotate:
            from cacheseek import kernels

            k_pages, v_pages, where = source.kernel_pages(layers)
            kernels.dequantize_pages(kq, ks, km, bits=self.k_bits, group=self.k_group, axis=AXIS_TOKENS,
                                     pages=k_pages, where=where, first=first, n=n, block=source.block_tokens)
            kernels.dequantize_pages(vq, vs, vm, bits=self.v_bits, group=self.v_group, axis=AXIS_CHANNELS,
                                     pages=v_pages, where=where, first=first, n=n, block=source.block_tokens)
            return
        pages = source.pages
        shape = (n, kq.shape[1], pages.num_kv_heads, source.block_tokens, pages.head_dim)
        k, v = self._dequantize(list(buffers), shape, pages.dtype, None, None)
        source.scatter("k", k, first, n, layers)
        source.scatter("v", v, first, n, layers)

    def check_finite(self, finite: Any, kv_dtype: str | None = None) -> None:
        """Raise ``InputError`` unless every flag from :meth:`encode_deferred` (or a paged
        encode's ``[4, n]``) holds. ``kv_dtype`` (the KV's, when known) narrows the message
        to the causes that dtype leaves possible."""
        flags = finite.tolist()
        if finite.dim() > 1:
            flags = [all(row) for row in flags]
        if not all(flags):
            raise InputError(self._refusal("k" if not all(flags[:2]) else "v", kv_dtype))

    def _refusal(self, side: str, kv_dtype: str | None, values: Any = None) -> str:
        """Why ``side``'s stats came out non-finite, for the error: from ``values`` (the side's
        KV) when given, else every cause ``kv_dtype`` leaves possible. fp32 stats are
        suggested only where they can help: finite values past fp16's range."""
        rotated = side == "v" and self.v_rotate
        rotation = (f"rows that overflow {kv_dtype or 'the KV dtype'} once rotated (v_rotate grows a row by up "
                    "to sqrt(head_dim))")
        if self.stats_dtype == "float16":
            stats = ("a group whose min or range/levels is beyond float16 stats (finite values past 65504: "
                     "use stats_dtype='float32')")
        else:
            stats = "a group whose range is beyond float32 stats"
        if values is not None:
            from .tensors import all_finite

            if not bool(all_finite(values)):
                return f"{side}: holds NaN or Inf; input rejected"
            if rotated and not bool(all_finite(self._rotated(values))):
                return f"{side}: {rotation}; input rejected"
            return f"{side}: {stats}; input rejected"
        # Without the values: fp16 KV's min fits fp16 stats and its range over 3 or more
        # levels does too, so only NaN, Inf or (v_rotate) a rotated row can fail it.
        causes = ["holds NaN or Inf"]
        if rotated:
            causes.append(rotation)
        if kv_dtype != "float16":
            causes.append(stats)
        return f"{side}: {', or '.join(causes)}; input rejected"

    def safe_magnitudes(self, dtype: str, head_dim: int) -> tuple[float, float] | None:
        """Within ``m``, a group's min fits the stats and its range (at most ``2m``, taken in
        fp32) over the levels (at least 3) fits too, so ``m`` is the smaller of the stats'
        largest value and half fp32's. Rotated V rows grow by up to ``sqrt(head_dim)`` and
        are rounded to V's own dtype first."""
        import torch

        top = torch.finfo(getattr(torch, dtype)).max
        k = min(torch.finfo(getattr(torch, self.stats_dtype)).max, torch.finfo(torch.float32).max / 2)
        v = min(k, top) / math.sqrt(head_dim) if self.v_rotate else k
        return None if top <= min(k, v) else (k, v)

    def decode(self, encoded: EncodedLayer, device: Any = None, *, out: Any = None) -> tuple[Any, Any]:
        """Move the compact buffers to ``device``, then dequantize there."""
        from .tensors import TORCH_DTYPES, check_out, to_device

        if not same_spec(encoded.codec, self.spec()):
            raise InputError(f"encoded: made by codec {encoded.codec}, not {self.spec()}")
        encoded.check_made_as(self.template(encoded.k.shape, encoded.k.dtype))  # (a payload from elsewhere)
        try:
            # The template sizes shapes no encode makes (a ragged K group, a head_dim v_rotate
            # cannot rotate), which the kernels and the rotation refuse with a ValueError.
            self._check_shape(encoded.k.shape)
        except InputError as exc:
            raise FrameError(f"encoded: no encode of this codec makes this shape: {exc}") from None
        if device is not None:
            encoded = to_device(encoded, device)
        else:
            encoded = to_device(encoded, _device_of(encoded))
        k_out, v_out = check_out(out, encoded, encoded.k.qdata.device) if out is not None else (None, None)
        return self._dequantize([b for _, _, b in encoded.named_buffers()], encoded.k.shape,
                                TORCH_DTYPES[encoded.k.dtype], k_out, v_out)

    def decode_buffers(self, buffers: list[Any], out: tuple[Any, Any]) -> None:
        self._dequantize(buffers, tuple(out[0].shape), out[0].dtype, out[0], out[1])

    def _dequantize(self, buffers: list[Any], shape: tuple[int, ...], dtype: Any, k_out: Any,
                    v_out: Any) -> tuple[Any, Any]:
        kq, ks, km, vq, vs, vm = buffers
        ops = ops_for(kq)
        k = ops.dequantize(kq, ks, km, bits=self.k_bits, group=self.k_group, axis=AXIS_TOKENS,
                           shape=shape, dtype=dtype, out=k_out)
        v = self._dequantize_v(ops, vq, vs, vm, shape, dtype, v_out)
        return k, v


def _quantize(ops: Any, x: Any, out: Any, **args: Any) -> Any:
    """``ops.quantize(x, **args)``, into ``out`` (q, scale, min) when given: the host codec
    encodes into it; the kernels' and the reference's fresh results are copied there."""
    if out is None:
        return ops.quantize(x, **args)
    from . import kivi_host
    from .tensors import copy_into

    if ops is kivi_host:
        return ops.quantize(x, **args, out=tuple(out))
    return copy_into(ops.quantize(x, **args), out)


def _device_of(encoded: EncodedLayer) -> Any:
    import torch

    first = encoded.k.qdata
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
