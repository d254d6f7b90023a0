"""KV layers -> block frames, in batches: the put path shared by PrefixCache and RemoteCache.

The token range of every layer is stacked once on the KV's own device into [L, H, n*B, D]
and viewed as [n, L, H, B, D], so one codec call (one kernel launch per K and V) encodes
n blocks of all layers; with the Triton kernels the layers are read in place, with no
stacked copy. Each block's frame points at its row of one staging buffer; the bytes are
copied only when a tier takes them. Raw KV on the host is not staged at all: its frames
point at the caller's own slices.

``iter_encoded(..., pooled=True)`` (the store's put path) leases each batch's staging from
the device's pool (``store.device_staging``) and gives it back when the next batch is asked
for: the frames of a batch are valid until then. Frames that are returned (``encode_blocks``,
``encode_missing``) own plain tensors instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from . import batching
from .block_format import BlockFormat
from .quant.backend import kernels_available
from .quant.codec import KVLayerCodec
from .quant.policy import single_codec
from .errors import InputError
from .layout import KVLayout
from .quant.tensors import all_finite, within
from .staging import payload_views, staging_stride
from .store.device_staging import StagingLease, staging_pool
from .store.lease import release_all
from .store.streams import current_stream, on_stream, work_stream
from .store.tier import BlockFrame

_UNPREPARED: Any = object()  # _encode_deferred asks the codec to prepare the layers itself


def _stack(layers: list[tuple[torch.Tensor, torch.Tensor]], t0: int, n: int, block_tokens: int):
    t1 = t0 + n * block_tokens
    k = torch.stack([k[:, t0:t1] for k, _ in layers])
    v = torch.stack([v[:, t0:t1] for _, v in layers])
    L, H, _, D = k.shape
    as_blocks = (L, H, n, block_tokens, D)
    return k.view(as_blocks).permute(2, 0, 1, 3, 4), v.view(as_blocks).permute(2, 0, 1, 3, 4)


def encode_blocks(
    fmt: BlockFormat,
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
    frames: list[BlockFrame] = []
    device = layers[0][0].device
    for a, b in fmt.segments(first_block, first_block + len(hashes)):  # one launch per codec
        part = fmt.at(a)
        got, finite = _encode_deferred(part, layers, a, hashes[a - first_block : b - first_block],
                                       parents[a - first_block : b - first_block], staging)
        if device.type == "cuda" and finite.device.type == "cpu":
            current_stream(device).synchronize()  # the kernels write the flags in host memory
        _check_flags(fmt, single_codec(part.codec), finite, layers, a, b)
        frames += got
    return frames


def _encode_deferred(
    fmt: BlockFormat,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    first_block: int,
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    staging: bool | None = None,
    prepared: Any = _UNPREPARED,
    leases: list[StagingLease] | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[list[BlockFrame], torch.Tensor]:
    """:func:`encode_blocks` without waiting for the device: the frames plus the codec's
    validity flags, which must be checked before the frames are used. ``prepared``: the
    codec's ``prepare_layers`` of ``layers``, when the caller encodes them in batches.
    ``fmt`` is uniform (one codec: a policy's ``fmt.at(position)``). ``leases``: the staging
    is leased from the device's pool (for the current stream) and its lease appended there,
    for the caller to release once the frames' bytes are copied (else: a plain tensor).
    ``rows``: ``[n, stride]`` staging rows to encode into instead, the caller's (its share
    of a lease taken for several pieces)."""
    if not fmt.uniform:
        raise RuntimeError("_encode_deferred: a launch holds blocks of one codec; cut at fmt.segments")
    codec, block_tokens = single_codec(fmt.codec), fmt.block_tokens
    n = len(hashes)
    t0 = first_block * block_tokens
    device = layers[0][0].device
    raw = codec.name == "raw"
    direct = raw and not (device.type != "cpu" if staging is None else staging)
    metas = fmt.plan_run(first_block, hashes[:1], parents[:1])
    if direct:
        finite = _raw_finite(layers, t0, t0 + n * block_tokens)
    else:
        payload = metas[0].payload_nbytes
        stride = staging_stride(payload)
        if rows is not None:
            buf, stride = rows, rows.shape[1]
        elif leases is None:
            buf = torch.empty((n, stride), dtype=torch.uint8, device=device)
        else:
            lease = staging_pool(device).take(n * stride)
            leases.append(lease)
            buf = lease.rows(n, stride)
        views = payload_views(buf, metas[0].tensors, n, stride)
        if prepared is _UNPREPARED:
            prepared = codec.prepare_layers([k for k, _ in layers], [v for _, v in layers])
        finite = encode_into(codec, layers, prepared, t0, n, block_tokens, views)
    # The host plans the frames while the device encodes.
    metas += fmt.plan_run(first_block + 1, hashes[1:], parents[1:])
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
            views[0][:, layer].copy_(_as_blocks(k, t0, n, block_tokens))
            views[1][:, layer].copy_(_as_blocks(v, t0, n, block_tokens))
        return _raw_finite(layers, t0, t1)
    if layers[0][0].device.type == "cpu":
        # On the host, each layer encoded where it lies straight into its place in the
        # views: stacking the layers first, or copying the codes out of fresh buffers after,
        # would be one more pass over the KV or its codes (the encoder reads and writes any
        # strides).
        flags = []
        for layer, (k, v) in enumerate(layers):
            _, finite = codec.encode_deferred(_as_blocks(k, t0, n, block_tokens), _as_blocks(v, t0, n, block_tokens),
                                              out=[view[:, layer] for view in views])
            flags.append(finite)
        return torch.stack(flags).all(0)
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


def _as_blocks(t: torch.Tensor, t0: int, n: int, block_tokens: int) -> torch.Tensor:
    """Tokens ``[t0, t0 + n * block_tokens)`` of one layer's [H, T, D] as [n, H, B, D] (a view)."""
    return t[:, t0 : t0 + n * block_tokens].unflatten(1, (n, block_tokens)).transpose(0, 1)


def _raw_finite(layers, t0: int, t1: int) -> torch.Tensor:
    """[K ok, V ok] for tokens [t0, t1) of every layer (Raw frames are the caller's bytes,
    checked where they lie). Only those tokens: a NaN in a block already stored or in the
    partial tail is no block's of this encode, as for KIVI, which checks what it encodes."""
    def ok(t: torch.Tensor) -> torch.Tensor:
        return all_finite(t[:, t0:t1])

    return torch.stack([torch.stack([ok(k) for k, _ in layers]).all(), torch.stack([ok(v) for _, v in layers]).all()])


def check_tokens(codec: KVLayerCodec, layers: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout,
                 t0: int, t1: int) -> None:
    """``InputError`` if tokens ``[t0, t1)`` of ``layers`` hold KV ``codec`` refuses: NaN,
    Inf, or (beyond its ``safe_magnitudes``) a range its stats cannot hold. One pass over
    each layer (min and max, or finiteness where every finite value encodes); the codec's
    own encode only for a layer beyond its safe magnitudes, which the encode alone judges.
    For a caller that must know before its first write that its last one will not fail."""
    # (On the host, a contiguous copy takes all_finite's bit test, not isfinite's slow
    # path for half types.)
    sides = [t[:, t0:t1] if t.is_cuda else t[:, t0:t1].contiguous() for kv in layers for t in kv]
    bounds = codec.safe_magnitudes(layout.dtype, layout.head_dim)
    ok = torch.stack([all_finite(t) if bounds is None else within(t, bounds[i % 2]) for i, t in enumerate(sides)])
    if bool(ok.all()):
        return
    finite = ok if bounds is None else torch.stack([all_finite(t) for t in sides])
    if not bool(finite.all()):
        raise InputError(f"{'k' if not bool(finite[0::2].all()) else 'v'}: holds NaN or Inf; input rejected")
    for i in range(0, len(sides), 2):
        if not bool(ok[i] & ok[i + 1]):
            codec.encode(sides[i], sides[i + 1])  # the codec's InputError, if it refuses them


def _check_flags(fmt: BlockFormat, codec: KVLayerCodec, finite: Any,
                 layers: list[tuple[torch.Tensor, torch.Tensor]], first: int, stop: int) -> None:
    """``codec.check_finite`` of blocks ``[first, stop)``; on a refusal, the refusal their
    values name (a NaN told from a range the stats cannot hold), as the codec's encode does."""
    try:
        codec.check_finite(finite, fmt.layout.dtype)
    except InputError:
        check_tokens(codec, layers, fmt.layout, first * fmt.block_tokens, stop * fmt.block_tokens)
        raise


def check_encodable(fmt: BlockFormat, layers: list[tuple[torch.Tensor, torch.Tensor]], todo: Sequence[bool]) -> None:
    """``check_tokens`` for the blocks flagged in ``todo``, each with its position's codec."""
    for a, b in batching.runs(todo, len(todo)):
        for c, d in fmt.segments(a, b):
            check_tokens(single_codec(fmt.at(c).codec), layers, fmt.layout, c * fmt.block_tokens, d * fmt.block_tokens)


def iter_encoded(
    fmt: BlockFormat,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    present: Sequence[bool],
    batch_blocks: int,
    *,
    tail_first: bool = False,
    pooled: bool = False,
    check_first: bool = False,
) -> Iterator[list[BlockFrame]]:
    """Frames of every block not ``present``, a batch (at most ``batch_blocks`` consecutive
    blocks) at a time. Raises ``InputError`` on NaN or Inf before yielding the bad batch;
    with ``check_first``, before the first when there are several (``check_encodable``: a
    pass over the KV), for a caller whose writes of one batch would cost others (evictions).

    On a GPU the blocks are cut into up to ``batching.PIPELINE_DEPTH`` batches, encoded on a
    side stream: each batch's encoding overlaps the copies of the batch before.
    ``tail_first`` yields the batches of the chain's end first. ``pooled``: each batch's
    staging is leased and given back when the next batch is asked for (or the generator
    closed): the frames are valid until then, and a reader on the device must have queued
    its reads by then, on the caller's stream or the to-host stream (the store's copies).
    """
    device = layers[0][0].device
    missing = [not p for p in present]
    if device.type == "cuda":
        batch_blocks = batching.pipelined_batch_blocks(sum(missing), batch_blocks,
                                                       fmt.layout.raw_nbytes(fmt.block_tokens))
    # A launch holds blocks of one codec, so under a precision policy a batch is cut where
    # the codec changes; its pieces are launched together and waited for once, so a policy
    # costs a launch per piece, not a pipeline stage (a round trip of the host) per piece.
    batches = [fmt.segments(*run) for run in batching.runs(missing, batch_blocks)]
    if tail_first:
        batches.reverse()
    if not batches:
        return
    if check_first and len(batches) > 1:
        check_encodable(fmt, layers, missing)
    k_layers, v_layers = [k for k, _ in layers], [v for _, v in layers]
    prepared: dict[Any, Any] = {}  # codec.prepare_key() -> its prepare_layers (a policy's parts may share it)
    side = work_stream("encode", device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(current_stream(device))  # the KV was made on the current stream

    held: list[StagingLease] = []  # the staging of the batch yielded last (and of one launched ahead)

    def launch(pieces: list[tuple[int, int]]):
        frames, checks = [], []  # checks: (codec, its validity flags, its blocks) per piece
        shares = None
        if pooled and side is not None and len(pieces) > 1:
            with on_stream(side):
                shares = _round_staging(fmt, pieces, device, held)
        for p, (start, stop) in enumerate(pieces):
            part = fmt.at(start)
            codec = single_codec(part.codec)
            key = codec.prepare_key()
            if key not in prepared:
                prepared[key] = codec.prepare_layers(k_layers, v_layers)
            with on_stream(side) if side is not None else contextlib.nullcontext():
                got, finite = _encode_deferred(part, layers, start, hashes[start:stop], parents[start:stop],
                                               prepared=prepared[key], leases=held if pooled else None,
                                               rows=None if shares is None else shares[p])
                if side is not None:
                    finite = flags_to_host(finite)
            frames += got
            checks.append((codec, finite, start, stop))
        done = None
        if side is not None:
            done = torch.cuda.Event()
            done.record(side)
        return frames, checks, done

    upcoming = None
    try:
        upcoming = launch(batches[0])
        for i in range(len(batches)):
            frames, checks, done = upcoming
            if done is not None:
                done.synchronize()
                current_stream(device).wait_event(done)
            for codec, finite, start, stop in checks:
                _check_flags(fmt, codec, finite, layers, start, stop)
            yield frames
            give_back(held, device)  # before the next launch, which may take the same buffer
            if i + 1 < len(batches):
                # Launched once this batch's copies are out (not before: the host is the
                # bottleneck, and the copies should start as early as they can); its
                # encoding overlaps them.
                upcoming = launch(batches[i + 1])
    finally:
        # Stopped early (bad input, or the caller gave up): the batch launched ahead still
        # writes its flags into host memory; let it finish before that memory is reused.
        try:
            if upcoming is not None and upcoming[2] is not None:
                upcoming[2].synchronize()
        finally:
            give_back(held, device)


def _round_staging(fmt: BlockFormat, pieces: list[tuple[int, int]], device: torch.device,
                   held: list[StagingLease]) -> list[torch.Tensor]:
    """One staging lease (taken for the current stream, appended to ``held``) for the
    pieces of a round, cut into each piece's rows at its codec's stride: a precision
    policy's round costs one take, as a uniform one does."""
    shapes = [(b - a, staging_stride(fmt.at(a).planned_payload().payload_nbytes)) for a, b in pieces]
    lease = staging_pool(device).take(sum(n * stride for n, stride in shapes))
    held.append(lease)
    return lease.row_blocks(shapes)


def give_back(leases: list[StagingLease], device: torch.device) -> None:
    """Release the staging ``leases`` of frames handed to a store (emptying the list): the
    readers of their bytes queued on the caller's stream (a GPU tier's copy) or the to-host
    stream (``store.device.HostCopies``), both marked as users."""
    if not leases:
        return
    if device.type == "cuda":
        users = (current_stream(device), work_stream("to_host", device))
        for lease in leases:
            if not lease.released:
                lease.used_on(*users)
    release_all(leases)


def flags_to_host(flags: torch.Tensor) -> torch.Tensor:
    """Validity flags into pinned host memory, written by a kernel: reading them back with
    a copy would wait behind every device-to-host copy already queued on the copy engine
    (the previous batches' payloads), stalling the pipeline. Without Triton: unchanged."""
    if flags.device.type == "cpu" or not kernels_available():
        return flags  # already in host memory (written there by the kernels), or no Triton
    from . import kernels

    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    kernels.store_to_host(flags.contiguous(), host)
    return host


def encode_missing(
    fmt: BlockFormat,
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    present: Sequence[bool],
    batch_blocks: int,
) -> list[BlockFrame]:
    """Frames for every block not ``present``, in chain order. Raises ``InputError`` (and
    returns nothing) on NaN or Inf."""
    frames: list[BlockFrame] = []
    for batch in iter_encoded(fmt, layers, hashes, parents, present, batch_blocks):
        frames += batch
    return frames


__all__ = ["encode_blocks", "encode_into", "encode_missing", "flags_to_host", "give_back", "iter_encoded"]
