"""KV layers <-> block frames, in batches: the data path shared by PrefixCache and RemoteCache.

Encoding: the token range of every layer is stacked once on the KV's own device into
[L, H, n*B, D] and viewed as [n, L, H, B, D], so one codec call (one kernel launch per
K and V) encodes n blocks of all layers. Each block's frame points at its slices of the
encoder's output; the bytes are copied only when a tier takes them.

Decoding: the payloads of n blocks land in one device staging buffer at a fixed stride
(one copy per block, host-to-device when they come from host memory), are viewed as
[n, L, H, ...] with ``as_strided``, and one codec call decodes them straight into the
[L, H, n*B, D] outputs. Full-precision KV is only ever built on the target device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import FrameError, InputError
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .quant.tensors import TORCH_DTYPES, all_finite
from .store.device import as_host_tensor, copy_entry
from .store.frame import FrameMeta, plan_frame
from .store.tier import BlockFrame

STAGING_ALIGN = 256


def check_layers(layers: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout) -> int:
    """Check per-layer [H, T, D] K/V against ``layout``; return T."""
    if len(layers) != layout.num_layers:
        raise InputError(f"kv: {len(layers)} layers, the cache's layout has {layout.num_layers}")
    want_dtype = layout.torch_dtype
    k0 = layers[0][0]
    tokens = k0.shape[-2] if k0.dim() == 3 else -1
    for i, (k, v) in enumerate(layers):
        for name, t in (("K", k), ("V", v)):
            if t.dim() != 3 or t.shape[0] != layout.num_kv_heads or t.shape[2] != layout.head_dim:
                raise InputError(
                    f"kv layer {i} {name}: shape {list(t.shape)}, the layout needs "
                    f"[{layout.num_kv_heads}, T, {layout.head_dim}]"
                )
            if t.shape[1] != tokens:
                raise InputError(f"kv layer {i} {name}: {t.shape[1]} tokens, layer 0 has {tokens}")
            if t.dtype != want_dtype:
                raise InputError(f"kv layer {i} {name}: dtype {t.dtype}, the layout says {layout.dtype}")
            if t.device != k0.device:
                raise InputError(f"kv layer {i} {name}: on {t.device}, layer 0 K is on {k0.device}")
    return tokens


def _stack(layers: list[tuple[torch.Tensor, torch.Tensor]], t0: int, n: int, block_tokens: int):
    t1 = t0 + n * block_tokens
    k = torch.stack([k[:, t0:t1] for k, _ in layers])
    v = torch.stack([v[:, t0:t1] for _, v in layers])
    L, H, _, D = k.shape
    as_blocks = (L, H, n, block_tokens, D)
    return k.view(as_blocks).permute(2, 0, 1, 3, 4), v.view(as_blocks).permute(2, 0, 1, 3, 4)


def encode_blocks(
    codec: KVLayerCodec,
    layout: KVLayout,
    block_tokens: int,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    first_block: int,
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    staging: bool | None = None,
) -> list[BlockFrame]:
    """Frames for ``len(hashes)`` consecutive blocks starting at block ``first_block``.

    With ``staging`` (the default on a GPU), the payloads of all n blocks are assembled in one device buffer at a fixed
    stride, so moving a block to host memory later is one contiguous copy. Raises
    ``InputError`` (and encodes nothing) on NaN or Inf.
    """
    n = len(hashes)
    t0 = first_block * block_tokens
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    template = codec.template((L, H, block_tokens, D), layout.dtype)
    specs = [(name, spec.dtype, spec.shape) for name, spec, _ in template.named_buffers()]
    codec_spec = codec.spec()
    metas = [
        plan_frame(block_hash=hashes[i], parent_hash=parents[i], position=first_block + i, layout=layout,
                   block_tokens=block_tokens, codec=codec_spec, buffers=specs)
        for i in range(n)
    ]
    device = layers[0][0].device
    raw = codec.name == "raw"
    if raw:
        finite = torch.stack([all_finite(t) for pair in layers for t in pair])
        if not bool(finite.all()):
            raise InputError("kv: holds NaN or Inf; nothing was stored")
        if not (device.type != "cpu" if staging is None else staging):
            # On the host, Raw frames point at the caller's own per-layer slices: the only
            # copy is the one into the tier.
            def pieces(i: int) -> list:
                a, b = t0 + i * block_tokens, t0 + (i + 1) * block_tokens
                return [[k[:, a:b] for k, _ in layers], [v[:, a:b] for _, v in layers]]

            return [BlockFrame(meta, device_entries=pieces(i), sealed=False) for i, meta in enumerate(metas)]
    payload = metas[0].payload_nbytes
    stride = (payload + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
    staging = torch.empty((n, stride), dtype=torch.uint8, device=device)
    views = [_strided(staging, e.offset, TORCH_DTYPES[e.dtype], (n, *e.shape), stride) for e in metas[0].tensors]
    if raw:
        for which, view in enumerate(views):  # k, then v: one device pass per layer
            for layer, pair in enumerate(layers):
                src = pair[which][:, t0 : t0 + n * block_tokens].unflatten(1, (n, block_tokens)).transpose(0, 1)
                view[:, layer].copy_(src)
    else:
        k5, v5 = _stack(layers, t0, n, block_tokens)
        for view, (_, _, buf) in zip(views, codec.encode(k5, v5).named_buffers(), strict=True):
            view.copy_(buf)
    return [BlockFrame(meta, device_payload=staging[i, :payload], sealed=False) for i, meta in enumerate(metas)]


def check_frame(meta: FrameMeta, *, key: bytes, codec_spec: dict, layout: KVLayout, block_tokens: int) -> None:
    if meta.block_hash != key:
        raise FrameError("frame names another block")
    if meta.codec != codec_spec or meta.layout != layout or meta.block_tokens != block_tokens:
        raise FrameError("frame was written with another codec, layout or block size")


class BatchDecoder:
    """Decodes up to ``max_blocks`` consecutive blocks into [L, H, n*B, D] K and V on ``device``.

    ``add`` starts a frame's copy into the staging buffer at once (non-blocking), so the
    caller's work on the next frame overlaps the transfer; ``finish`` decodes them all in
    one codec call.
    """

    def __init__(self, codec: KVLayerCodec, layout: KVLayout, block_tokens: int, max_blocks: int,
                 device: torch.device) -> None:
        self.codec, self.layout, self.block_tokens = codec, layout, block_tokens
        self.max_blocks, self.device = max_blocks, device
        self._meta0: FrameMeta | None = None
        self._staging: torch.Tensor | None = None
        self._stride = 0
        self._frames: list[BlockFrame] = []  # host views stay alive until the copies are done

    def __len__(self) -> int:
        return len(self._frames)

    def add(self, frame: BlockFrame) -> None:
        if len(self._frames) >= self.max_blocks:
            raise RuntimeError(f"BatchDecoder holds {self.max_blocks} blocks already")
        if self._meta0 is None:
            self._meta0 = frame.meta
            self._stride = (frame.meta.payload_nbytes + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
            self._staging = torch.empty((self.max_blocks, self._stride), dtype=torch.uint8, device=self.device)
        elif frame.meta.tensors != self._meta0.tensors:
            raise FrameError("frames of one chain disagree on their payload layout")
        dst = self._staging[len(self._frames), : self._meta0.payload_nbytes]
        if frame.device_payload is not None:
            dst.copy_(frame.device_payload, non_blocking=True)
        elif frame.device_entries is not None:
            for entry, src in zip(frame.meta.tensors, frame.device_entries, strict=True):
                copy_entry(dst[entry.offset : entry.offset + entry.nbytes], src)
        else:
            dst.copy_(as_host_tensor(frame.payload_view()), non_blocking=True)
        self._frames.append(frame)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self._frames)
        if n == 0 or self._meta0 is None or self._staging is None:
            raise RuntimeError("BatchDecoder.finish: no frames were added")
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        B = self.block_tokens
        template = self.codec.template((n, L, H, B, D), self.layout.dtype)
        buffers = []
        for (name, spec, _), entry in zip(template.named_buffers(), self._meta0.tensors, strict=True):
            if entry.name != name or entry.dtype != spec.dtype or (n, *entry.shape) != spec.shape:
                raise FrameError(f"frame buffer {entry.name} does not match the codec's {name}")
            buffers.append(_strided(self._staging, entry.offset, TORCH_DTYPES[spec.dtype], spec.shape, self._stride))
        encoded = template.with_buffers(buffers)
        k = torch.empty((L, H, n * B, D), dtype=self.layout.torch_dtype, device=self.device)
        v = torch.empty_like(k)
        as_blocks = (L, H, n, B, D)
        self.codec.decode(encoded, self.device,
                          out=(k.view(as_blocks).permute(2, 0, 1, 3, 4), v.view(as_blocks).permute(2, 0, 1, 3, 4)))
        if self.device.type == "cuda":
            # The frames' host views may be recycled once we return: the copies must be done.
            torch.cuda.current_stream(self.device).synchronize()
        self._frames.clear()
        return k, v


def decode_frames(
    codec: KVLayerCodec,
    layout: KVLayout,
    block_tokens: int,
    frames: Sequence[BlockFrame],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode n consecutive blocks into K and V of shape [L, H, n*B, D] on ``device``."""
    decoder = BatchDecoder(codec, layout, block_tokens, len(frames), device)
    for frame in frames:
        decoder.add(frame)
    return decoder.finish()


def _strided(staging: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: int) -> torch.Tensor:
    """View ``[n, *shape[1:]]`` elements of ``dtype`` at ``offset`` in every staging row."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    typed = staging.view(dtype)
    inner = shape[1:]
    strides = [1] * len(inner)
    for i in range(len(inner) - 2, -1, -1):
        strides[i] = strides[i + 1] * inner[i + 1]
    return typed.as_strided((shape[0], *inner), (stride // itemsize, *strides), offset // itemsize)


def block_parents(root: bytes, hashes: Sequence[bytes]) -> list[bytes]:
    return [root, *hashes[:-1]]


def encode_missing(
    codec: KVLayerCodec,
    layout: KVLayout,
    block_tokens: int,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    present: Sequence[bool],
    batch_blocks: int,
) -> list[BlockFrame]:
    """Frames for every block not ``present``, encoded in runs of at most ``batch_blocks``
    consecutive blocks. Raises ``InputError`` (and returns nothing) on NaN or Inf."""
    frames: list[BlockFrame] = []
    for start, stop in _runs([not p for p in present], batch_blocks):
        frames += encode_blocks(codec, layout, block_tokens, layers, first_block=start,
                                hashes=hashes[start:stop], parents=parents[start:stop])
    return frames


def _runs(flags: Sequence[bool], max_len: int):
    """[start, stop) ranges of consecutive True flags, each at most ``max_len`` long."""
    i = 0
    while i < len(flags):
        if not flags[i]:
            i += 1
            continue
        j = i
        while j < len(flags) and flags[j] and j - i < max_len:
            j += 1
        yield i, j
        i = j


__all__ = ["BatchDecoder", "block_parents", "check_frame", "check_layers", "decode_frames", "encode_blocks",
           "encode_missing"]
