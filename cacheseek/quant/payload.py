"""Torch-free payload schemas: what an encoded KV layer is, independent of where it lives.

A buffer field holds either a ``torch.Tensor`` (on any device, straight out of an encoder)
or a bytes-like object on the host (out of a frame, a socket or a file). The schema itself
never imports torch, so the store and the server can move payloads without it.

An ``EncodedLayer`` holds K and V of one layer, or of a stack of layers and blocks: every
leading dimension in front of ``[H, T, D]`` is carried through unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from ..errors import FrameError

# Element dtypes a payload buffer may have, with their sizes.
BUFFER_DTYPES: dict[str, int] = {"int32": 4, "float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1,
                                  "float8_e4m3fn": 1, "float8_e5m2": 1}

# What an encoded tensor may stand for (a layout's KV dtype).
KV_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")

MAX_ELEMENTS = 1 << 62  # the most elements (a zero dimension counted as one) of a tensor's shape

# The grouped axis, as a negative index into [..., H, T, D].
AXIS_TOKENS = -2  # K: per channel, groups of consecutive tokens
AXIS_CHANNELS = -1  # V: per token, groups of consecutive channels


def packed_shape(shape: tuple[int, ...], axis: int, bits: int) -> tuple[int, ...]:
    """Shape of the int32 code words: ``32 // bits`` codes per word along ``axis``."""
    per_word = 32 // bits
    n = shape[axis]
    if n % per_word:
        raise ValueError(f"axis of length {n} cannot be packed {per_word} codes per int32 word")
    out = list(shape)
    out[axis] = n // per_word
    return tuple(out)


def stats_shape(shape: tuple[int, ...], axis: int, group: int) -> tuple[int, ...]:
    """Shape of scale and min: one per group along ``axis`` (the last group may be ragged)."""
    out = list(shape)
    out[axis] = math.ceil(shape[axis] / group)
    return tuple(out)


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return BUFFER_DTYPES[dtype] * math.prod(shape)


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """Where one buffer of an encoded tensor sits: its role, element dtype and shape."""

    role: str  # "q" (codes or raw values), "scale", "min"
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One tensor after encoding.

    Quantized (``bits`` 2/4/8): ``qdata`` is int32 words, codes packed little-endian along
    ``axis`` (element j of a word in bits [j*bits, (j+1)*bits)); ``scale`` and ``offset``
    (the group minimum) hold one value per ``group`` elements along ``axis``, in
    ``stats_dtype``. ``pad`` counts the elements the last group lacks (a ragged group).

    Unquantized (``group == 0``): ``qdata`` holds the values in ``dtype``, and ``scale``,
    ``offset`` and ``stats_dtype`` are ``None``.
    """

    qdata: Any
    scale: Any | None
    offset: Any | None
    shape: tuple[int, ...]
    dtype: str
    bits: int
    group: int
    axis: int
    pad: int
    stats_dtype: str | None

    @property
    def quantized(self) -> bool:
        return self.group > 0

    def buffer_specs(self) -> list[BufferSpec]:
        if not self.quantized:
            return [BufferSpec("q", self.dtype, self.shape)]
        assert self.stats_dtype is not None
        st = stats_shape(self.shape, self.axis, self.group)
        return [
            BufferSpec("q", "int32", packed_shape(self.shape, self.axis, self.bits)),
            BufferSpec("scale", self.stats_dtype, st),
            BufferSpec("min", self.stats_dtype, st),
        ]

    def buffers(self) -> list[Any]:
        return [self.qdata] if not self.quantized else [self.qdata, self.scale, self.offset]

    def with_buffers(self, buffers: list[Any]) -> EncodedTensor:
        """The same tensor description over other buffers (moved, viewed, parsed)."""
        if len(buffers) != len(self.buffer_specs()):
            raise ValueError(f"expected {len(self.buffer_specs())} buffers, got {len(buffers)}")
        if not self.quantized:
            return replace(self, qdata=buffers[0])
        return replace(self, qdata=buffers[0], scale=buffers[1], offset=buffers[2])

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.buffer_specs())

    def meta(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bits": self.bits,
            "group": self.group,
            "axis": self.axis,
            "pad": self.pad,
            "stats_dtype": self.stats_dtype,
        }

    @classmethod
    def from_meta(cls, meta: Any, buffers: list[Any] | None = None) -> EncodedTensor:
        """Rebuild from :meth:`meta` and host buffers, checking every size before use."""
        try:
            shape = tuple(int(x) for x in meta["shape"])
            t = cls(
                qdata=None, scale=None, offset=None, shape=shape, dtype=str(meta["dtype"]),
                bits=int(meta["bits"]), group=int(meta["group"]), axis=int(meta["axis"]),
                pad=int(meta["pad"]),
                stats_dtype=None if meta["stats_dtype"] is None else str(meta["stats_dtype"]),
            )
            if any(x < 0 for x in shape) or len(shape) < 3 or t.axis not in (AXIS_TOKENS, AXIS_CHANNELS):
                raise ValueError(f"bad shape {shape} or axis {t.axis}")
            # A tensor's strides are products of the dimensions after each, a zero counted as
            # one: past MAX_ELEMENTS they overflow in torch, though the tensor holds nothing
            # (a zero among huge dimensions agrees with buffers of no byte).
            if math.prod(max(x, 1) for x in shape) > MAX_ELEMENTS:
                raise ValueError(f"shape {shape}: too large to lay out")
            # Every field as an encode writes it: a decoder sizes its work from them.
            if t.dtype not in KV_DTYPES:
                raise ValueError(f"dtype {t.dtype!r} is not a KV dtype ({', '.join(KV_DTYPES)})")
            if t.quantized:
                if t.bits not in (2, 4, 8) or t.stats_dtype not in ("float16", "float32"):
                    raise ValueError(f"bits {t.bits} or stats_dtype {t.stats_dtype!r}")
                if not 0 <= t.pad < t.group or (shape[t.axis] + t.pad) % t.group:
                    raise ValueError(f"pad {t.pad} does not complete the last group of {t.group}")
            elif t.group != 0 or t.pad or t.stats_dtype is not None:
                raise ValueError("an unquantized tensor has no group, pad nor stats_dtype")
            specs = t.buffer_specs()
            for spec in specs:
                if spec.dtype not in BUFFER_DTYPES:
                    raise ValueError(f"unknown dtype {spec.dtype!r}")
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # (int(inf): OverflowError)
            raise FrameError(f"encoded tensor metadata is malformed: {exc}") from None
        if buffers is None:
            return t
        if len(buffers) != len(specs):
            raise FrameError(f"encoded tensor has {len(buffers)} buffers, its metadata names {len(specs)}")
        for spec, buf in zip(specs, buffers, strict=True):
            if memoryview(buf).nbytes != spec.nbytes:
                raise FrameError(f"{spec.role} buffer holds {memoryview(buf).nbytes} bytes, its shape needs {spec.nbytes}")
        return t.with_buffers(buffers)


@dataclass(frozen=True, slots=True)
class EncodedLayer:
    """K and V of one layer (or a stack of layers/blocks) after encoding, plus the codec spec."""

    k: EncodedTensor
    v: EncodedTensor
    codec: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def named_buffers(self) -> list[tuple[str, BufferSpec, Any]]:
        """``("k.q", spec, buffer)``, ... in a fixed order: the order frames store them in."""
        out = []
        for prefix, t in (("k", self.k), ("v", self.v)):
            for spec, buf in zip(t.buffer_specs(), t.buffers(), strict=True):
                out.append((f"{prefix}.{spec.role}", spec, buf))
        return out

    def check_made_as(self, want: EncodedLayer) -> None:
        """Raise ``FrameError`` unless K and V are described as ``want`` (the codec's template
        for K's shape and dtype) describes them: a decoder sizes its work from these fields."""
        fields = ("shape", "dtype", "bits", "group", "axis", "pad", "stats_dtype")
        for side, got, made in (("k", self.k, want.k), ("v", self.v, want.v)):
            if any(getattr(got, f) != getattr(made, f) for f in fields):
                raise FrameError(f"encoded {side}: {[getattr(got, f) for f in fields]} is not what this codec "
                                 f"writes for that shape ({[getattr(made, f) for f in fields]})")

    def with_buffers(self, buffers: list[Any]) -> EncodedLayer:
        nk = len(self.k.buffer_specs())
        return replace(self, k=self.k.with_buffers(buffers[:nk]), v=self.v.with_buffers(buffers[nk:]))

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-ready dict. Buffers must be host bytes-like objects."""
        out: dict[str, Any] = {"codec": self.codec}
        for prefix, t in (("k", self.k), ("v", self.v)):
            try:
                out[prefix] = {**t.meta(), "buffers": [memoryview(b).cast("B") for b in t.buffers()]}
            except TypeError:
                raise TypeError(
                    "EncodedLayer.to_wire needs host bytes-like buffers: move device tensors to the host "
                    "(cacheseek.quant.tensors.to_host), then view them as bytes (tensors.host_view)"
                ) from None
        return out

    @classmethod
    def from_wire(cls, data: Any) -> EncodedLayer:
        try:
            k = EncodedTensor.from_meta(data["k"], list(data["k"]["buffers"]))
            v = EncodedTensor.from_meta(data["v"], list(data["v"]["buffers"]))
            codec = data["codec"]
        except (KeyError, TypeError) as exc:
            raise FrameError(f"encoded layer is malformed: missing {exc}") from None
        if not isinstance(codec, dict):
            raise FrameError(f"encoded layer is malformed: codec is a {type(codec).__name__}, not a map")
        return cls(k=k, v=v, codec=codec)

    def packb(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def unpackb(cls, data: bytes) -> EncodedLayer:
        try:
            wire = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise FrameError(f"encoded layer is not valid msgpack: {exc}") from None
        return cls.from_wire(wire)
