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

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .errors import FrameError, InputError
from .layout import KVLayout
from .quant.codec import KVLayerCodec
from .quant.tensors import TORCH_DTYPES, all_finite
from .store.device import as_host_tensor, copy_entry, work_stream
from .store.frame import FrameMeta, TensorEntry, plan_frame, replan_frame
from .store.tier import BlockFrame

STAGING_ALIGN = 256
_UNPREPARED: Any = object()  # _encode_deferred asks the codec to prepare the layers itself


def check_layers(layers: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout) -> int:
    """Check per-layer [H, T, D] K/V against ``layout``; return T."""
    if len(layers) != layout.num_layers:
        raise InputError(f"kv: {len(layers)} layers, the cache's layout has {layout.num_layers}")
    want_dtype = layout.torch_dtype
    k0 = layers[0][0]
    tokens = k0.shape[-2] if k0.dim() == 3 else -1
    shape, device = (layout.num_kv_heads, tokens, layout.head_dim), k0.device
    if all(k.shape == shape and v.shape == shape and k.dtype == want_dtype and v.dtype == want_dtype
           and k.device == device and v.device == device for k, v in layers):
        return tokens  # the usual case, checked in one pass; the loop below says what is wrong
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
    raise AssertionError("unreachable: the fast check failed, so one of the checks above must")


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

    With ``staging`` (the default on a GPU), the payloads of all n blocks are assembled in
    one device buffer at a fixed stride, so moving a block to host memory later is one
    contiguous copy. Raises ``InputError`` on NaN or Inf.
    """
    frames, finite = _encode_deferred(codec, layout, block_tokens, layers, first_block, hashes, parents, staging)
    device = layers[0][0].device
    if device.type == "cuda" and finite.device.type == "cpu":
        torch.cuda.current_stream(device).synchronize()  # the kernels write the flags in host memory
    codec.check_finite(finite)
    return frames


def _encode_deferred(
    codec: KVLayerCodec,
    layout: KVLayout,
    block_tokens: int,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    first_block: int,
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    staging: bool | None = None,
    prepared: Any = _UNPREPARED,
) -> tuple[list[BlockFrame], torch.Tensor]:
    """:func:`encode_blocks` without waiting for the device: the frames plus the codec's
    validity flags, which must be checked before the frames are used. ``prepared``: the
    codec's ``prepare_layers`` of ``layers``, when the caller encodes them in batches."""
    n = len(hashes)
    t0 = first_block * block_tokens
    device = layers[0][0].device
    raw = codec.name == "raw"
    direct = raw and not (device.type != "cpu" if staging is None else staging)
    metas = [plan_block(codec, layout, block_tokens, block_hash=hashes[0], parent_hash=parents[0],
                        position=first_block)]
    if direct:
        finite = _raw_finite(layers, t0, t0 + n * block_tokens)
    else:
        payload = metas[0].payload_nbytes
        stride = (payload + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
        buf = torch.empty((n, stride), dtype=torch.uint8, device=device)
        views = payload_views(buf, metas[0].tensors, n, stride)
        if prepared is _UNPREPARED:
            prepared = codec.prepare_layers([k for k, _ in layers], [v for _, v in layers])
        finite = encode_into(codec, layers, prepared, t0, n, block_tokens, views)
    # The host plans the frames while the device encodes.
    metas += [replan_frame(metas[0], block_hash=hashes[i], parent_hash=parents[i], position=first_block + i)
              for i in range(1, n)]
    if direct:
        # On the host, Raw frames point at the caller's own per-layer slices: the only
        # copy is the one into the tier.
        def pieces(i: int) -> list:
            a, b = t0 + i * block_tokens, t0 + (i + 1) * block_tokens
            return [[k[:, a:b] for k, _ in layers], [v[:, a:b] for _, v in layers]]

        return [BlockFrame(meta, device_entries=pieces(i), sealed=False) for i, meta in enumerate(metas)], finite
    return [BlockFrame(meta, device_payload=buf[i, :payload], sealed=False) for i, meta in enumerate(metas)], finite


def encode_into(codec: KVLayerCodec, layers: list[tuple[torch.Tensor, torch.Tensor]], prepared: Any, t0: int,
                n: int, block_tokens: int, views: list[torch.Tensor]) -> Any:
    """Encode ``n`` blocks from token ``t0`` into ``views`` (the codec template's buffers as
    ``[n, L, H, ...]``, e.g. rows of a staging buffer); returns the codec's validity flags,
    not yet waited for. ``prepared``: ``codec.prepare_layers`` of ``layers``, or None."""
    if prepared is not None:
        return codec.encode_layers_into(prepared, t0, n, block_tokens, views)
    t1 = t0 + n * block_tokens
    if codec.name == "raw" and layers[0][0].device.type == "cpu":
        # On the host, a copy per layer into place is one pass (stacking would be two).
        for layer, (k, v) in enumerate(layers):
            views[0][:, layer].copy_(k[:, t0:t1].unflatten(1, (n, block_tokens)).transpose(0, 1))
            views[1][:, layer].copy_(v[:, t0:t1].unflatten(1, (n, block_tokens)).transpose(0, 1))
        return _raw_finite(layers, t0, t1)
    # Stacking first keeps this to a handful of launches (not two per layer).
    k5, v5 = _stack(layers, t0, n, block_tokens)
    if codec.name == "raw":
        finite = torch.stack([all_finite(k5), all_finite(v5)])
        sources = [k5, v5]
    else:
        encoded, finite = codec.encode_deferred(k5, v5)
        sources = [src for _, _, src in encoded.named_buffers()]
    for view, src in zip(views, sources, strict=True):
        view.copy_(src)
    return finite


def plan_block(codec: KVLayerCodec, layout: KVLayout, block_tokens: int, *, block_hash: bytes, parent_hash: bytes,
               position: int) -> FrameMeta:
    """The frame of one block as ``codec`` encodes it (unsealed: no checksum yet); derive
    the frames of the blocks after it with ``replan_frame``."""
    # Laying out the buffers costs ~0.1 ms: it is done once per configuration, and each
    # block's frame is derived from that template.
    key = (codec.name, tuple(codec.spec().items()), layout, block_tokens, len(block_hash), len(parent_hash))
    try:
        template = _TEMPLATES.get(key)
    except TypeError:  # a spec with unhashable values: its fingerprint names it as well
        key = (codec.fingerprint(), layout, block_tokens, len(block_hash), len(parent_hash))
        template = _TEMPLATES.get(key)
    if template is None:
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        encoded = codec.template((L, H, block_tokens, D), layout.dtype)
        specs = [(name, spec.dtype, spec.shape) for name, spec, _ in encoded.named_buffers()]
        template = plan_frame(block_hash=bytes(len(block_hash)), parent_hash=bytes(len(parent_hash)), position=0,
                              layout=layout, block_tokens=block_tokens, codec=codec.spec(), buffers=specs)
        if len(_TEMPLATES) >= 64:
            _TEMPLATES.pop(next(iter(_TEMPLATES)))
        _TEMPLATES[key] = template
    return replan_frame(template, block_hash=block_hash, parent_hash=parent_hash, position=position)


_TEMPLATES: dict[tuple, FrameMeta] = {}


def _raw_finite(layers, t0: int, t1: int) -> torch.Tensor:
    """[K ok, V ok] for tokens [t0, t1) of every layer (Raw frames are the caller's bytes,
    checked where they lie). On the host, whole contiguous layers are checked instead: the
    fast bit test needs contiguous memory, and a copy would cost more than the extra bytes."""
    whole = layers[0][0].device.type == "cpu"

    def ok(t: torch.Tensor) -> torch.Tensor:
        return all_finite(t if whole else t[:, t0:t1])

    return torch.stack([torch.stack([ok(k) for k, _ in layers]).all(), torch.stack([ok(v) for _, v in layers]).all()])


def check_frame(meta: FrameMeta, *, key: bytes, codec_spec: dict, layout: KVLayout, block_tokens: int) -> None:
    if meta.block_hash != key:
        raise FrameError("frame names another block")
    if meta.codec != codec_spec or meta.layout != layout or meta.block_tokens != block_tokens:
        raise FrameError("frame was written with another codec, layout or block size")


class BatchDecoder:
    """Decodes up to ``max_blocks`` consecutive blocks into [L, H, n*B, D] K and V on ``device``.

    ``add`` starts a frame's copy into a staging buffer at once. On a GPU the copies run on
    a side stream and every ``chunk_blocks`` blocks are decoded as soon as they have landed,
    so decoding overlaps the transfer of the next blocks; ``finish`` decodes the rest.
    The host's work per block is a copy launch: the staging views are made once, and each
    chunk costs one codec call.
    """

    def __init__(self, codec: KVLayerCodec, layout: KVLayout, block_tokens: int, max_blocks: int,
                 device: torch.device, *, chunk_blocks: int = 8) -> None:
        self.codec, self.layout, self.block_tokens = codec, layout, block_tokens
        self.max_blocks, self.device = max_blocks, device
        self._copy_stream = work_stream("to_device", device) if device.type == "cuda" else None
        self._chunk = chunk_blocks
        self._meta0: FrameMeta | None = None
        self._staging: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []  # the codec's buffers of every staging row
        self._frames: list[BlockFrame] = []  # host views stay alive until the copies are done
        self._decoded = 0
        self._k: torch.Tensor | None = None  # made at the first decode: the first copy starts sooner
        self._v: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._frames)

    def _start(self, meta: FrameMeta) -> None:
        """Lay out the staging rows for frames like ``meta``, and check the codec agrees."""
        L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
        template = self.codec.template((self.max_blocks, L, H, B, D), self.layout.dtype)
        for (name, spec, _), entry in zip(template.named_buffers(), meta.tensors, strict=True):
            if entry.name != name or entry.dtype != spec.dtype or (self.max_blocks, *entry.shape) != spec.shape:
                raise FrameError(f"frame buffer {entry.name} does not match the codec's {name}")
        stride = (meta.payload_nbytes + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
        self._staging = torch.empty((self.max_blocks, stride), dtype=torch.uint8, device=self.device)
        self._views = payload_views(self._staging, meta.tensors, self.max_blocks, stride)
        self._meta0 = meta
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def add(self, frame: BlockFrame) -> None:
        if len(self._frames) >= self.max_blocks:
            raise RuntimeError(f"BatchDecoder holds {self.max_blocks} blocks already")
        if self._meta0 is None:
            self._start(frame.meta)
        elif frame.meta.tensors != self._meta0.tensors:
            raise FrameError("frames of one chain disagree on their payload layout")
        dst = self._staging[len(self._frames)]
        caller = None
        if self._copy_stream is not None:
            # set_stream, not a stream context: the context costs more than the copy's launch.
            caller = torch.cuda.current_stream(self.device)
            torch.cuda.set_stream(self._copy_stream)
        try:
            if frame.device_payload is not None:
                dst[: self._meta0.payload_nbytes].copy_(frame.device_payload, non_blocking=True)
            elif frame.device_entries is not None:
                for entry, src in zip(frame.meta.tensors, frame.device_entries, strict=True):
                    copy_entry(dst[entry.offset : entry.offset + entry.nbytes], src)
            else:
                dst[: self._meta0.payload_nbytes].copy_(as_host_tensor(frame.payload_view()), non_blocking=True)
        finally:
            if caller is not None:
                torch.cuda.set_stream(caller)
        self._frames.append(frame)
        pending, left = len(self._frames) - self._decoded, self.max_blocks - len(self._frames)
        # Near the end, smaller chunks: the decode of the last one is not hidden behind copies.
        if pending >= self._chunk or pending >= self._chunk // 2 and left < self._chunk:
            self._decode_pending()

    def _decode_pending(self) -> None:
        j0, j1 = self._decoded, len(self._frames)
        if j1 == j0:
            return
        if self._copy_stream is not None:
            landed = torch.cuda.Event()
            landed.record(self._copy_stream)
            torch.cuda.current_stream(self.device).wait_event(landed)
        L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
        if self._k is None:
            self._k = torch.empty((L, H, self.max_blocks * B, D), dtype=self.layout.torch_dtype, device=self.device)
            self._v = torch.empty_like(self._k)
            as_blocks = (L, H, self.max_blocks, B, D)
            self._k_blocks = self._k.view(as_blocks).permute(2, 0, 1, 3, 4)
            self._v_blocks = self._v.view(as_blocks).permute(2, 0, 1, 3, 4)
        template = self.codec.template((j1 - j0, L, H, B, D), self.layout.dtype)
        out = (self._k_blocks[j0:j1], self._v_blocks[j0:j1])
        self.codec.decode(template.with_buffers([v[j0:j1] for v in self._views]), self.device, out=out)
        self._decoded = j1

    def finish(self, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks added, [L, H, n*B, D] (views: the last blocks may be unused),
        decoded on the current stream. ``wait=False``: the caller calls :meth:`wait` before
        the frames added may be released (their copies may still be in flight)."""
        n = len(self._frames)
        if n == 0:
            raise RuntimeError("BatchDecoder.finish: no frames were added")
        self._decode_pending()
        if wait:
            self.wait()
        tokens = n * self.block_tokens
        if n == self.max_blocks:
            return self._k, self._v
        return self._k[:, :, :tokens], self._v[:, :, :tokens]

    def wait(self) -> None:
        """Return once every copy out of the frames added is done; the frames are released."""
        if self._copy_stream is not None and self._frames:
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)  # this decoder's copies, queued before now
            copied.synchronize()
        self._frames.clear()


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


def payload_views(buf: torch.Tensor, tensors: Sequence[TensorEntry], count: int, stride: int,
                  offset: int = 0) -> list[torch.Tensor]:
    """The buffers ``tensors`` of ``count`` payloads laid out at ``stride`` bytes in ``buf``,
    the first at byte ``offset``, as ``[count, ...]`` views (e.g. a codec's buffers in the
    rows of a staging buffer)."""
    typed: dict[torch.dtype, torch.Tensor] = {}  # one view of ``buf`` per dtype, not one per buffer
    out = []
    base = buf.storage_offset() * buf.element_size()
    for dtype, size, strides, start in _view_plan(tuple(tensors), offset, count, stride):
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buf.view(dtype)
        out.append(whole.as_strided(size, strides, base // dtype.itemsize + start))
    return out


@functools.lru_cache(maxsize=256)
def _view_plan(tensors: tuple[TensorEntry, ...], offset: int, count: int, stride: int) -> list[tuple]:
    """(dtype, size, strides, storage offset in elements) of each buffer's ``[count, ...]``
    view: worked out once per layout and count (it is most of a view's cost)."""
    plan = []
    for e in tensors:
        dtype = TORCH_DTYPES[e.dtype]
        item = dtype.itemsize
        inner = [1] * len(e.shape)
        for i in range(len(e.shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * e.shape[i + 1]
        plan.append((dtype, (count, *e.shape), (stride // item, *inner), (offset + e.offset) // item))
    return plan


def block_parents(root: bytes, hashes: Sequence[bytes]) -> list[bytes]:
    return [root, *hashes[:-1]]


def iter_encoded(
    codec: KVLayerCodec,
    layout: KVLayout,
    block_tokens: int,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    present: Sequence[bool],
    batch_blocks: int,
    *,
    tail_first: bool = False,
) -> Iterator[list[BlockFrame]]:
    """Frames of every block not ``present``, a batch (at most ``batch_blocks`` consecutive
    blocks) at a time. Raises ``InputError`` on NaN or Inf before yielding the bad batch.

    On a GPU the blocks are cut into up to ``PIPELINE_DEPTH`` batches (see
    :func:`pipeline_blocks`), encoded on a side stream: each batch's encoding overlaps the
    copies of the batch before.
    ``tail_first`` yields the batches of the chain's end first.
    """
    device = layers[0][0].device
    missing = [not p for p in present]
    if device.type == "cuda":
        batch_blocks = pipeline_blocks(sum(missing), batch_blocks, layout.raw_nbytes(block_tokens))
    batches = list(true_runs(missing, batch_blocks))
    if tail_first:
        batches.reverse()
    if not batches:
        return
    prepared = codec.prepare_layers([k for k, _ in layers], [v for _, v in layers])
    side = work_stream("encode", device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # the KV was made on the current stream

    def launch(start: int, stop: int):
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            frames, finite = _encode_deferred(codec, layout, block_tokens, layers, start,
                                              hashes[start:stop], parents[start:stop], prepared=prepared)
            done = None
            if side is not None:
                finite = flags_to_host(finite)
                done = torch.cuda.Event()
                done.record(side)
        return frames, finite, done

    upcoming = launch(*batches[0])
    try:
        for i in range(len(batches)):
            frames, finite, done = upcoming
            if done is not None:
                done.synchronize()
                torch.cuda.current_stream(device).wait_event(done)
            codec.check_finite(finite)
            yield frames
            if i + 1 < len(batches):
                # Launched once this batch's copies are out (not before: the host is the
                # bottleneck, and the copies should start as early as they can); its
                # encoding overlaps them.
                upcoming = launch(*batches[i + 1])
    finally:
        # Stopped early (bad input, or the caller gave up): the batch launched ahead still
        # writes its flags into host memory; let it finish before that memory is reused.
        if upcoming[2] is not None:
            upcoming[2].synchronize()


PIPELINE_DEPTH = 3  # batches an ingest is cut into on a GPU, so copies overlap encoding
PIPELINE_MIN_BYTES = 128 << 20  # raw KV per batch below which the host's fixed costs dominate


def pipeline_blocks(missing: int, batch_blocks: int, block_raw_nbytes: int) -> int:
    """Blocks per batch on a GPU: at most ``batch_blocks``, and small enough that
    ``missing`` blocks make ``PIPELINE_DEPTH`` batches, so only the first batch's encode is
    not hidden behind copies; but not below ``PIPELINE_MIN_BYTES`` of raw KV (each batch
    costs the host a fixed ~0.5 ms of launches and bookkeeping, which must stay under the
    time its copies take)."""
    floor = max(1, -(-PIPELINE_MIN_BYTES // block_raw_nbytes))
    return max(1, min(batch_blocks, max(floor, -(-missing // PIPELINE_DEPTH))))


def flags_to_host(flags: torch.Tensor) -> torch.Tensor:
    """Validity flags into pinned host memory, written by a kernel: reading them back with
    a copy would wait behind every device-to-host copy already queued on the copy engine
    (the previous batches' payloads), stalling the pipeline. Without Triton: unchanged."""
    from .quant.kivi import kernels_available

    if flags.device.type == "cpu" or not kernels_available():
        return flags  # already in host memory (written there by the kernels), or no Triton
    from . import kernels

    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    kernels.store_to_host(flags.contiguous(), host)
    return host


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
    """Frames for every block not ``present``, in chain order. Raises ``InputError`` (and
    returns nothing) on NaN or Inf."""
    frames: list[BlockFrame] = []
    for batch in iter_encoded(codec, layout, block_tokens, layers, hashes, parents, present, batch_blocks):
        frames += batch
    return frames


def true_runs(flags: Sequence[bool], max_len: int):
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
           "encode_missing", "iter_encoded", "payload_views"]
