"""Layer-wise loading and storing: KV whose layers become ready in order, so a forward can
start on layer 0 while later layers are still on their way, and an ingest that takes the
layers as a forward produces them.

``LayerwiseLoad`` is the handle a layer-wise ``materialize`` / ``materialize_into`` returns.
It knows nothing of any engine: a consumer calls ``wait(layer)`` before it reads a layer
(a transformers cache in its ``update``, a vLLM connector in ``wait_for_layer_load``).

How a load runs (``LayerwiseDecoder``):

- The frames are fetched from the tiers as for ``materialize``. On a GPU, a frame from the
  CPU tier has only its first layer group copied to the device when it arrives; frames from
  other tiers (a disk read lent in a pooled buffer, the GPU tier) are copied whole and given
  back at once, as before.
- Then the layers are decoded group by group (groups of 1, 2, 4, 8 ... layers), over all
  blocks at once: for each group the copies of its slices of every CPU-tier frame (six
  copies per frame for KIVI, one per buffer), then one decode launch per side, on a decode
  stream of its own, then a CUDA event. ``wait(layer)`` makes the consumer's stream wait for
  that event: the host never waits on the device. On a GPU every group is issued before
  the handle is returned (``ISSUE``): the host's part of the load is then over before the
  forward's launches begin, and the device runs the groups' copies and decodes on its side
  streams while the forward computes the layers already there. (A thread issuing them
  during the forward, or the forward's own waits, contend with its launches for the host
  and the GIL, and delivered layers late.)
- Without CUDA, each group is decoded when a layer of it is first waited for (synchronous,
  in the caller's thread): the same API and the same bytes, testable anywhere.

A load that fails part way (a decode that raises) marks the handle: ``wait`` on a layer not
loaded raises ``LoadError``, and the caller recomputes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .block_format import BlockFormat
from .decode import BatchDecoder
from .errors import ConfigError, FrameError, InputError, LoadError
from .hashing import as_index
from .quant.backend import kernels_available
from .quant.policy import single_codec
from .store.device import as_host_tensor
from .store.lease import finalizer
from .store.streams import current_stream, on_stream, work_stream
from .store.tier import BlockFrame

_FOREACH_COPY = True  # torch._foreach_copy_ takes host-to-device pairs (else: one copy_ per piece)
LOOKAHEAD_GROUPS = 2  # groups issued beyond the one a consumer waits for (lazy issue on a GPU)
# How groups 1.. are issued, by device type: "eager" (all of them before the handle is
# returned: the copies and decodes are queued on the side streams in order, and the device
# overlaps them with the consumer's work; the host is done with the load before the
# forward starts), "background" (a thread of the load's own: on a GPU it contends for the
# GIL with the forward's launches, and its groups arrive late: benchmarks/ttft.py
# --layerwise-issue measures all three), or "lazy" (from the consumer's ``wait``,
# LOOKAHEAD_GROUPS ahead). On a CPU, lazy: a layer is decoded when it is first waited for.
ISSUE = {"cuda": "eager", "cpu": "lazy"}
ISSUE_MODES = ("eager", "background", "lazy")
# A group's slices of every CPU-tier frame read in place by one kernel (pinned tiers, with
# Triton), rather than copied one by one: off only to measure the difference (ttft.py).
GATHER = True
GATHER_ON_CPU = False  # tests: the one-kernel group copy on CPU tensors too (Triton's interpreter)
# GPU loads record when each layer was first waited for (a timing event per layer, for
# ``LayerwiseLoad.timeline``) only when this is set as the load is made: those events cost
# a forward's 32 waits 0.1-0.3 ms of host time on the H200's host (0.29-0.76 ms against
# 0.16-0.47, paired in six device runs), on the path to the first token. Without a GPU the
# timeline is always kept.
TIMELINE = False


def layer_groups(num_layers: int, first: int = 1) -> list[tuple[int, int]]:
    """``[l0, l1)`` ranges covering ``num_layers`` layers: ``first`` layers, then twice as
    many each time, so the forward starts after a small first copy while the number of
    launches stays logarithmic in the layer count. A rest smaller than half the group
    before it joins that group: a group costs the host its launches (~0.13 ms on the H200's
    host), and a 32-layer model's last layer alone would be ready no sooner."""
    if num_layers < 1:
        raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
    out, l0, size = [], 0, max(1, first)
    while l0 < num_layers:
        l1 = min(num_layers, l0 + size)
        if num_layers - l1 < size // 2:
            l1 = num_layers
        out.append((l0, l1))
        l0, size = l1, size * 2
    return out


# -- the decoder ---------------------------------------------------------------------------


class LayerwiseDecoder(BatchDecoder):
    """A ``BatchDecoder`` that decodes layer group by layer group over all its blocks,
    instead of block chunk by block chunk. It owns the frames added: it gives each back once
    nothing more will be copied out of it (``release``)."""

    def __init__(self, fmt: BlockFormat, max_blocks: int, device: torch.device,
                 groups: Sequence[tuple[int, int]], *, sink: Any = None, host_mapped: bool = False) -> None:
        """``host_mapped``: the split frames (CPU-tier frames, ``add(split=True)``) live in
        pinned host memory, mapped into the device: each group's slices of all of them are
        then read by one kernel (``kernels.copy_ranges``) instead of one copy per slice."""
        super().__init__(fmt, max_blocks, device, sink=sink)
        self.groups = list(groups)
        self._gather = GATHER and host_mapped and (device.type == "cuda" or GATHER_ON_CPU) and kernels_available()
        self._gather_tables: Any = None  # (device table of (address, staging row) per split frame)
        self._decode_stream = work_stream("layerwise_decode", device) if device.type == "cuda" else None
        # (staging row, payload) of the frames copied group by group: the payload as a host
        # tensor, or (read in place by one kernel a group) its address
        self._rows: list[tuple[int, Any]] = []
        self._pending: deque[tuple[torch.cuda.Event, BlockFrame]] = deque()  # copied whole, copy maybe in flight
        self._split_frames: list[BlockFrame] = []  # given back after the last group's copies
        self._last_copy: Any = None  # event after the last copy out of the frames
        self._sealed = False
        # When the load began (the zero of its timeline): before the first frame's copy.
        self.started = time.perf_counter()
        self.start_event = None
        if device.type == "cuda":
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record(current_stream(device))

    def add(self, frame: BlockFrame, *, split: bool = False) -> None:
        """Start the copy of ``frame`` to the device: whole, or (``split``, host frames on a
        GPU) its first layer group only, the rest when its group is run. The frame is the
        decoder's from this call on, also when it raises: given back here if neither
        ``release_all``'s lists took it (a CPU-tier slot leased for good otherwise)."""
        taken = len(self._split_frames) + len(self._pending)
        try:
            self._add(frame, split)
        except BaseException:
            if len(self._split_frames) + len(self._pending) == taken:
                if self._copy_stream is not None:
                    self._copy_stream.synchronize()  # (a part of its copy may be in flight)
                frame.release()
            raise

    def _add(self, frame: BlockFrame, split: bool) -> None:
        if self._sealed:
            raise RuntimeError("LayerwiseDecoder.add after seal")
        if len(self._frames) >= self.max_blocks:
            raise RuntimeError(f"LayerwiseDecoder holds {self.max_blocks} blocks already")
        if self._meta0 is None:
            self._start(frame.meta)
            self._plan_pieces(frame.meta)
        elif frame.meta.tensors != self._meta0.tensors:
            raise FrameError("frames of one chain disagree on their payload layout")
        assert self._meta0 is not None and self._staging is not None  # (made by _start, at the first frame)
        j = len(self._frames)
        host = frame.device_payload is None and frame.device_entries is None
        self._frames.append(frame)
        if split and host and len(self.groups) > 1:
            # Only layer group 0 now (on a CPU too, so the host's work per frame is what it is
            # on a GPU): one C++ call per side cuts its pieces (one per buffer) out; the rest
            # of the frame is cut and copied when group 1 runs, off the path to layer 0.
            self._split_frames.append(frame)
            if self._gather:  # every group, the first too, is read by one kernel when it runs
                address = frame.host_address
                if address is None:
                    address = as_host_tensor(frame.host).data_ptr()
                self._rows.append((j, address + frame.meta.payload_offset))
                return
            src = as_host_tensor(frame.payload_view())[: self._meta0.payload_nbytes]
            self._rows.append((j, src))
            if self._copy_stream is None:
                self._copy_group(0, self._rows[-1:])
            else:
                with on_stream(self._copy_stream):
                    self._copy_group(0, self._rows[-1:])
            return
        dst = self._staging[j]  # (a view made per frame: only where a frame is copied whole)
        if self._copy_stream is None:
            self._copy(frame, dst)  # done when it returns
            frame.release()
            return
        with on_stream(self._copy_stream):
            self._copy(frame, dst)
            landed = torch.cuda.Event()
            landed.record(self._copy_stream)
            self._pending.append((landed, frame))

    def _plan_pieces(self, meta: Any) -> None:
        """Where a payload is cut for each layer group: per group, the cut offsets of its
        pieces (one per buffer: that buffer's layers of the group) and their indices among
        the parts. (The staging's side of a group is cut at its first copy: never where one
        kernel reads every group, which needs only the byte ranges.)"""
        L = self.layout.num_layers
        if any(not e.shape or e.shape[0] != L or e.nbytes % L for e in meta.tensors):
            raise FrameError("frame buffers are not laid out layer-major: cannot load them layer by layer")
        self._plans = []
        for l0, l1 in self.groups:
            bounds = {b for e in meta.tensors for b in (e.offset + l0 * (e.nbytes // L), e.offset + l1 * (e.nbytes // L))}
            cuts = sorted(bounds - {0})
            index = {c: i + 1 for i, c in enumerate(cuts)} | {0: 0}
            self._plans.append((cuts, [index[e.offset + l0 * (e.nbytes // L)] for e in meta.tensors]))
        self._group_dst: list[Any] = [None] * len(self.groups)
        # The same slices as byte ranges of a payload (and of its staging row), for the kernel.
        self._ranges = [tuple((e.offset + l0 * (e.nbytes // L), (l1 - l0) * (e.nbytes // L)) for e in meta.tensors)
                        for l0, l1 in self.groups]
        if self._gather and any(o % 4 or n % 4 for group in self._ranges for o, n in group):
            self._gather = False  # (frames lay buffers out 64-byte aligned: not seen in practice)

    def _staging_pieces(self, g: int) -> list[tuple[torch.Tensor, ...]]:
        """Group ``g``'s pieces of every staging row, one tuple per buffer (made at the
        group's first use: one ``unbind`` per buffer, not a cut per frame)."""
        pieces = self._group_dst[g]
        if pieces is None:
            cuts, idx = self._plans[g]
            assert self._staging is not None  # (made by _start; given back only after the last group)
            cols = self._staging.tensor_split(cuts, dim=1)
            pieces = self._group_dst[g] = [cols[i].unbind(0) for i in idx]
        return pieces

    def _copy_group(self, g: int, rows: list[tuple[int, Any]] | None = None) -> None:
        """Copy layer group ``g`` of ``rows`` (default: every frame copied group by group),
        queued on the current stream: one ``_foreach_copy_`` (its launches made in C++).
        Each payload is cut into the group's pieces by one C++ call (slicing them one by
        one in Python cost more than the copies' launches); only this group's, so the
        first groups' copies start after a small share of the cutting."""
        if self._gather:
            self._gather_group(g)
            return
        cuts, idx = self._plans[g]
        cols = self._staging_pieces(g)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for j, payload in self._rows if rows is None else rows:
            parts = payload.tensor_split(cuts)
            dst.extend(col[j] for col in cols)
            src.extend(parts[i] for i in idx)
        self._copy_list(dst, src)

    def _gather_group(self, g: int) -> None:
        """Group ``g``'s slices of every split frame into their staging rows: one kernel
        reading the frames where they are (pinned host memory, mapped into the device)."""
        from . import kernels

        if self._gather_tables is None:
            rows = [(address, j) for j, address in self._rows]
            table = torch.tensor(rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._gather_tables = (table.to(self.device, non_blocking=True), table)  # (keep the source alive)
        addrs, _ = self._gather_tables
        assert self._staging is not None  # (made by _start; given back only after the last group)
        kernels.copy_ranges(addrs, self._staging, self._ranges[g])

    @staticmethod
    def _copy_list(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        global _FOREACH_COPY
        if _FOREACH_COPY:
            try:
                torch._foreach_copy_(dst, src, non_blocking=True)
                return
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # a torch without it across devices
                _FOREACH_COPY = False
                warnings.warn(f"torch._foreach_copy_ failed ({exc}); layer-wise copies fall back to one "
                              "Python call per piece (slower to launch)", RuntimeWarning, stacklevel=2)
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)

    def release_copied(self) -> None:
        """Give back the frames whose copies have all landed (asks the device, no wait)."""
        pending = self._pending
        while pending and pending[0][0].query():
            pending.popleft()[1].release()
        if self._split_frames and self._last_copy is not None and self._last_copy.query():
            self._release_split()

    def seal(self) -> int:
        """No more frames: allocate the outputs (contiguous loads). Returns the block count."""
        self._sealed = True
        n = self._n = len(self._frames)
        # Each group's views of the staging and the outputs, cut by one split per tensor
        # (not two slices per tensor per group, a few microseconds of host time each).
        sizes = [l1 - l0 for l0, l1 in self.groups]
        if n:
            self._group_views = list(zip(*(v[:n].split(sizes, dim=1) for v in self._views)))
        if n and self._sink is None:
            L, H, D, B = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim, self.block_tokens
            self._k = torch.empty((L, H, n * B, D), dtype=self.layout.torch_dtype, device=self.device)
            self._v = torch.empty_like(self._k)
            self._k_blocks = self._k.view(L, H, n, B, D).permute(2, 0, 1, 3, 4)
            self._v_blocks = self._v.view(L, H, n, B, D).permute(2, 0, 1, 3, 4)
            self._group_outputs = {l0: kv for (l0, _), kv in zip(self.groups, zip(self._k_blocks.split(sizes, dim=1),
                                                                                   self._v_blocks.split(sizes, dim=1)))}
        if self._decode_stream is not None and n:
            prepare = getattr(self._sink, "prepare", None)
            if prepare is not None:
                prepare()  # tables the kernels keep: uploaded in the caller's stream order, not the decode stream's
            # The outputs and the staging were made on the caller's stream; the side streams
            # use them. The staging is leased (given back after the last group's decode, its
            # release marks the decode stream too); the outputs go to the caller, who frees
            # them whenever: the allocator must not hand their memory out again before the
            # decode stream is done with them, so they stay on record_stream.
            self._decode_stream.wait_stream(current_stream(self.device))
            for t in (self._k, self._v):
                if t is not None:
                    t.record_stream(self._decode_stream)
            if self._lease is not None:
                self._lease.used_on(self._decode_stream)
        return n

    @property
    def outputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._k, self._v

    def run_group(self, g: int, timing: bool = False) -> Any:
        """Copy (the rest of the frames' slices) and decode layer group ``g``; on a GPU,
        queued on the side streams and returns the event that marks it decoded."""
        l0, l1 = self.groups[g]
        n = self._n
        views = self._group_views[g]
        first = 0 if self._gather else 1  # (without the kernel, group 0 went with each frame)
        last = g == len(self.groups) - 1
        if self._decode_stream is None:
            if g >= first and self._rows:
                self._copy_group(g)  # done when it returns
                if last:
                    self._release_split()
            self._decode_layers(views, l0, l1, n)
            if last:
                self._release_staging()
            return None
        assert self._copy_stream is not None  # (a decode stream only on a GPU, where both are made)
        if g >= first and self._rows:
            with on_stream(self._copy_stream):
                self._copy_group(g)
        landed = torch.cuda.Event()
        landed.record(self._copy_stream)
        if last:
            self._last_copy = landed
        self._decode_stream.wait_event(landed)
        with on_stream(self._decode_stream):
            self._decode_layers(views, l0, l1, n)
        ready = torch.cuda.Event(enable_timing=timing)
        ready.record(self._decode_stream)
        if last:
            self._release_staging()  # every copy into it and decode out of it is queued
        return ready

    def _release_split(self) -> None:
        frames, self._split_frames, self._rows = self._split_frames, [], []
        for frame in frames:
            frame.release()

    def _decode_layers(self, views: Sequence[torch.Tensor], l0: int, l1: int, n: int) -> None:
        if self._sink is not None:
            self._sink(0, n, list(views), layers=(l0, l1))
            return
        single_codec(self.codec).decode_buffers(list(views), self._group_outputs[l0])

    def release_all(self) -> None:
        """Wait for every copy out of the frames (host-side), then give them all back, and the
        staging buffer if the last group did not (a load that failed or was closed early)."""
        try:
            if self._copy_stream is not None and (self._pending or self._split_frames):
                done = torch.cuda.Event()
                done.record(self._copy_stream)
                done.synchronize()
            while self._pending:
                self._pending.popleft()[1].release()
            self._release_split()
            self._frames.clear()
        finally:
            self._release_staging()

    def _release_staging(self) -> None:
        self._group_dst, self._group_views = [], []  # views of the staging
        super()._release_staging()


# -- the handle ----------------------------------------------------------------------------


@dataclass(slots=True)
class LayerTiming:
    """One layer of a load's timeline, in ms since the load started: ``ready_ms`` when its
    decode finished, ``needed_ms`` when the consumer first waited for it (on a GPU, both on
    the device's clock); ``stall_ms`` how long the consumer waited."""

    layer: int
    ready_ms: float
    needed_ms: float | None

    @property
    def stall_ms(self) -> float:
        return 0.0 if self.needed_ms is None else max(0.0, self.ready_ms - self.needed_ms)


class LayerwiseLoad:
    """A load whose layers become ready in order: ``wait(layer)`` before reading a layer.

    ``num_tokens`` / ``num_blocks`` / ``tiers``: what is being loaded (known when the handle
    is returned: the frames are fetched by then, only the decodes run on). ``layer(i)``:
    the (K, V) of a contiguous load, ``[1, H, num_tokens, D]`` each, after waiting for it.
    ``done()``: every layer ready (no wait). ``close()``: wait for the device, give the
    store's memory back (also on ``with``'s exit); ``abandon()``: the same without loading
    the layers not issued yet (nobody will read them). A load that failed part way raises
    ``LoadError`` from ``wait`` for the layers it did not load; ``error`` holds the cause.
    ``requests``: for a load into pages, the ``Loaded`` of each request (what is written).
    A handle dropped without ``close()`` (its consumer's forward raised) gives the store's
    memory back once the work in flight is done, and decodes no more groups.
    """

    def __init__(self, *, num_layers: int, device: torch.device, num_tokens: int = 0, num_blocks: int = 0,
                 tiers: Sequence[str] = (), decoder: LayerwiseDecoder | None = None,
                 layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, timing: bool | None = None,
                 requests: Sequence[Any] | None = None, issue: str | None = None) -> None:
        self.num_layers, self.device = num_layers, device
        self.requests = list(requests) if requests is not None else []
        self.num_tokens, self.num_blocks, self.tiers = num_tokens, num_blocks, list(tiers)
        self.error: BaseException | None = None
        self._decoder = decoder
        self._cuda = device.type == "cuda"
        self._timing = (TIMELINE if timing is None else timing) and self._cuda
        self._groups = decoder.groups if decoder is not None else [(0, num_layers)]
        self._group_of = [g for g, (l0, l1) in enumerate(self._groups) for _ in range(l0, l1)]
        self._issued = 0 if decoder is not None else len(self._groups)
        issue = issue or ISSUE.get(device.type, "lazy")
        if issue not in ISSUE_MODES:
            if decoder is not None:
                decoder.release_all()  # the frames it holds go back: nothing will load them
            raise ConfigError(f"issue: {issue!r} is not one of {', '.join(ISSUE_MODES)}")
        self._background = decoder is not None and issue == "background"
        self._eager = decoder is not None and issue == "eager"
        # Guards _issued/_events with a background issuer; taken through the (C) lock itself:
        # ``Condition.__exit__`` is Python, and an interrupt at its start left it held.
        self._issue_mutex = threading.RLock()
        self._issue_lock = threading.Condition(self._issue_mutex)
        # Held while a thread runs groups (no background issuer: a consumer's wait on a CPU, a
        # close) and while the decoder's memory is given back: a close from another thread
        # waits for a decode in flight instead of running the groups beside it and giving
        # the staging and frames back under it.
        self._run_lock = threading.RLock()
        self._closing = threading.Lock()  # one close or abandon at a time: the second finds it done
        self._worker: threading.Thread | None = None
        self._events: list[Any] = [None] * num_layers  # per layer: its group's ready event (GPU)
        self._ready_t: list[float | None] = [None] * num_layers  # per layer, host clock (CPU)
        self._needed: list[Any] = [None] * num_layers  # per layer: when first waited for
        self._layers = list(layers) if layers is not None else None
        self._closed = False
        if decoder is not None:
            finalizer.ready()  # (a finalizer cannot start the thread its release may need)
        self._t0 = decoder.started if decoder is not None else time.perf_counter()
        self._start = decoder.start_event if decoder is not None else None
        if self._cuda and self._start is None:
            self._start = torch.cuda.Event(enable_timing=self._timing)
            self._start.record(current_stream(device))
        if decoder is None:  # everything is there already (nothing stored, or a whole load)
            ready = torch.cuda.Event(enable_timing=self._timing) if self._cuda else None
            if ready is not None:
                ready.record(current_stream(device))
            self._events = [ready] * num_layers
            self._ready_t = [0.0] * num_layers
        elif self._background:
            # Group 0 (its copies went with the frames) is issued here, in the caller's thread,
            # and nothing more: the handle is returned at once, and a thread of the load's own
            # issues groups 1.. in order (copies, decodes, events), so neither this call nor the
            # consumer's waits spend host time on them. It runs under the caller's grad and
            # inference modes (the outputs may be inference tensors written in place).
            self._advance(0)
            if self._issued < len(self._groups) and self.error is None:
                modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
                self._worker = threading.Thread(target=self._issue_rest, args=modes,
                                                name="cacheseek-layerwise", daemon=True)
                self._worker.start()
        elif self._eager:
            self._advance(len(self._groups) - 1)
        elif self._cuda:
            self._advance(min(len(self._groups), LOOKAHEAD_GROUPS) - 1)

    # -- building ----------------------------------------------------------------------

    @classmethod
    def loaded(cls, materialized: Any, num_layers: int) -> LayerwiseLoad:
        """A handle over KV already decoded (``Materialized``): every layer ready at once.
        What a cache that cannot load layer by layer returns (``RemoteCache``), so callers
        need no branch."""
        return cls(num_layers=num_layers, device=materialized.device, num_tokens=materialized.num_tokens,
                   num_blocks=materialized.num_blocks, tiers=materialized.tiers,
                   layers=[(k, v) for k, v in materialized.layers] or None)

    # -- the consumer's side -----------------------------------------------------------

    def wait(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (on a GPU: default the device's current stream) wait until
        ``layer`` is loaded: work queued on it afterwards sees the layer. On a GPU the host
        does not wait; without one, the layer is decoded now if it is not yet. Raises
        ``LoadError`` if the load failed before this layer."""
        layer = self._layer_index(layer)
        g = self._group_of[layer]
        if self._closed and self._decoder is not None and g >= self._issued:
            # Abandoned (or closed after a failure) before this layer's group was issued: it
            # will never be loaded, which is what LoadError tells a caller (recompute it);
            # the layers loaded before stay valid and are waited for as usual.
            self._not_loaded(layer)
        if self._cuda:
            stream = stream if stream is not None else current_stream(self.device)
            if self._needed[layer] is None and self._timing:
                needed = torch.cuda.Event(enable_timing=True)
                needed.record(stream)
                self._needed[layer] = needed
            # With a background issuer: only until this layer's group is issued (normally long
            # since); lazily: issue it and the next LOOKAHEAD_GROUPS from this thread.
            self._advance(g if self._background else g + LOOKAHEAD_GROUPS)
            self._check(layer)
            stream.wait_event(self._events[layer])
        else:
            if self._needed[layer] is None:
                self._needed[layer] = time.perf_counter()
            self._advance(g)
            self._check(layer)

    def layer(self, i: int, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer ``i``, ``[1, H, num_tokens, D]`` each, after ``wait(i)``.
        ``wait=False``: the tensors now, not yet holding the layer (for a consumer that
        waits later, before it reads them: shapes and devices are final)."""
        i = self._layer_index(i)
        decoder = self._decoder
        if self._layers is None and (decoder is None or decoder.outputs[0] is None):
            if self.num_tokens == 0:
                raise RuntimeError("LayerwiseLoad.layer: nothing was loaded (num_tokens is 0)")
            raise RuntimeError("LayerwiseLoad.layer: this load wrote into an engine's pages; read them there")
        if wait:
            self.wait(i)
        if self._layers is None:
            # Every layer's views in one call each side (two views per layer, per call, cost
            # a consumer that takes all 32 layers ~0.25 ms of host time on the H200's host).
            assert decoder is not None  # (else raised above)
            k, v = decoder.outputs
            assert k is not None and v is not None  # (else raised above: both are made together)
            self._layers = list(zip(k.unsqueeze(1).unbind(0), v.unsqueeze(1).unbind(0), strict=True))
        return self._layers[i]

    def ready(self, layer: int) -> bool:
        """Whether ``layer`` is loaded (asks the device; never waits, never issues work)."""
        layer = self._layer_index(layer)
        if self.error is not None and self._events[layer] is None and self._ready_t[layer] is None:
            return False
        if self._cuda:
            event = self._events[layer]
            return event is not None and event.query()
        return self._ready_t[layer] is not None

    def done(self) -> bool:
        """Whether every layer is loaded (issues what is left; never waits)."""
        if self._background and self._issued < len(self._groups):
            return False  # the issuer is still at work
        self._advance(len(self._groups) - 1)
        if self.error is not None:
            return False
        ok = self.ready(self.num_layers - 1) if self.num_layers else True
        if ok and self._decoder is not None:
            with self._run_lock:
                if not self._closed:  # (closed: given back already)
                    self._decoder.release_copied()
        return ok

    def synchronize(self) -> None:
        """Load every layer and wait for it on the host; raises ``LoadError`` on a failure."""
        self._advance(len(self._groups) - 1)
        self._check(self.num_layers - 1)
        if self._cuda and self._events[-1] is not None:
            self._events[-1].synchronize()

    def close(self) -> None:
        """Finish: every layer loaded (so nothing is left writing into memory the caller may
        reuse), and the store's memory given back. Idempotent, and safe from any thread: a
        close while another runs waits for it, and a group a consumer is decoding (on a CPU)
        is finished before the memory goes back."""
        with self._closing:
            if self._closed:
                return
            try:
                if self.error is None:
                    self._advance(len(self._groups) - 1)
                self._join()
                if self._cuda:
                    done = [e for e in self._events if e is not None]
                    if done:
                        done[-1].synchronize()
            finally:
                with self._run_lock:
                    self._closed = True
                    if self._decoder is not None:
                        self._decoder.release_all()

    def abandon(self) -> None:
        """``close`` for a consumer that will read no more of the load (its forward raised):
        the store's memory is given back once the copies and decodes already issued are
        done, and the layer groups not issued yet are never decoded. Idempotent; ``close``
        after it does nothing, and ``wait`` on a layer never loaded raises ``LoadError`` (on
        one loaded before, it answers as before)."""
        with self._closing:
            if self._closed:
                return
            if self._decoder is None:
                self._closed = True
                return
            self._abandon()

    def __del__(self) -> None:
        # A consumer whose forward raised drops the handle unclosed: the frames it holds are
        # CPU-tier slots leased for good otherwise (LayerwiseSave gives its slots back alike).
        if getattr(self, "_closed", True) or getattr(self, "_decoder", None) is None:
            return
        if finalizer.in_collection():  # (maybe in a thread holding the tier's lock: see ``Finalizer``)
            finalizer.submit(self.abandon)
            return
        finalizer.run(self.abandon)

    def _abandon(self) -> None:
        """Give the store's memory back once nothing in flight reads or writes it, without
        decoding the groups not issued yet (nobody will read them)."""
        self._closed = True  # (_advance issues nothing more, a background issuer stops)
        try:
            self._join()
            issued = [e for e in self._events if e is not None]
            if self._cuda and issued:
                # The last group issued: its decode may still read the staging and write the
                # outputs or the engine's pages, and it ran after every copy before it.
                with contextlib.suppress(Exception):  # (a device error: that work failed, writes no more)
                    issued[-1].synchronize()
        finally:
            if self._decoder is not None:  # (none: nothing held; its callers skip it then)
                with self._run_lock:  # (a consumer's decode in flight ends first)
                    self._decoder.release_all()

    def __enter__(self) -> LayerwiseLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def timeline(self) -> list[LayerTiming]:
        """Per layer: when it was ready and when the consumer first waited for it (ms since
        the load began). On a GPU this waits for the device, and needs a load made while
        ``cacheseek.layerwise.TIMELINE`` was set (its waits then record events)."""
        self.synchronize()
        out = []
        for i in range(self.num_layers):
            if self._cuda:
                if not self._timing:
                    raise RuntimeError("LayerwiseLoad.timeline: this GPU load kept no timeline; set "
                                       "cacheseek.layerwise.TIMELINE = True before making the load")
                start, event = self._start, self._events[i]
                assert start is not None and event is not None  # (on a GPU: made at __init__; synchronized above)
                ready = start.elapsed_time(event)
                needed = self._needed[i]
                if needed is not None:
                    needed.synchronize()
                needed_ms = start.elapsed_time(needed) if needed is not None else None
            else:
                ready_t = self._ready_t[i]
                ready = (ready_t - self._t0) * 1e3 if ready_t else 0.0
                needed_ms = (self._needed[i] - self._t0) * 1e3 if self._needed[i] is not None else None
            out.append(LayerTiming(i, ready, needed_ms))
        return out

    def elapsed_ms(self, mark: Any) -> float:
        """ms from the load's start to ``mark``: a CUDA event recorded later (waited for
        here), or a ``time.perf_counter()`` value without CUDA. For timelines: when the
        consumer's work ended, on the same clock as ``timeline()``."""
        if self._cuda:
            mark.synchronize()
            assert self._start is not None  # (made at __init__ on a GPU)
            return self._start.elapsed_time(mark)
        return (mark - self._t0) * 1e3

    # -- internals ---------------------------------------------------------------------

    def _advance(self, upto: int) -> None:
        """Issue (GPU) or run (CPU) the layer groups up to ``upto``, in order. With a
        background issuer, the caller's thread only waits until they have been issued."""
        if self._worker is not None:
            if threading.current_thread() is not self._worker:
                self._await_issued(upto)
                return
            self._issue(upto)  # (the only thread that issues: it needs no lock, and close joins it)
            return
        with self._run_lock:
            self._issue(upto)

    def _issue(self, upto: int) -> None:
        """``_advance``'s work, in the one thread that may run groups now."""
        decoder = self._decoder
        upto = min(upto, len(self._groups) - 1)
        while self._issued <= upto and self.error is None and not self._closed:
            g = self._issued
            assert decoder is not None  # (without one, every group counts as issued at __init__)
            try:
                event = decoder.run_group(g, timing=self._timing)
            except BaseException as exc:  # marks the load; ``wait`` raises for what is missing
                with self._issue_mutex:
                    self.error = exc
                    self._issue_lock.notify_all()
                if self._worker is None:
                    decoder.release_all()  # (the issuer's frames are given back by close())
                return
            l0, l1 = self._groups[g]
            now = time.perf_counter()
            with self._issue_mutex:
                for i in range(l0, l1):
                    self._events[i] = event
                    self._ready_t[i] = now
                self._issued += 1
                self._issue_lock.notify_all()
        if self._issued == len(self._groups) and decoder is not None and self._cuda and self._worker is None:
            decoder.release_copied()

    def _issue_rest(self, grad: bool, inference: bool) -> None:
        """The background issuer: every group after the first, in order."""
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                if self._cuda:
                    torch.cuda.set_device(self.device)
                self._advance(len(self._groups) - 1)
        except BaseException as exc:  # e.g. set_device failing: the load is marked, never hangs
            with self._issue_mutex:
                self.error = self.error or exc
                self._issue_lock.notify_all()

    def _await_issued(self, upto: int) -> None:
        """Block until the issuer has issued group ``upto`` (or failed, or ended)."""
        upto = min(upto, len(self._groups) - 1)
        worker = self._worker
        assert worker is not None  # (called only with a background issuer)
        with self._issue_mutex:
            while self._issued <= upto and self.error is None and worker.is_alive():
                self._issue_lock.wait(0.05)

    def _join(self) -> None:
        """Wait for the issuer to end (every group issued, or the load failed)."""
        if self._worker is not None and threading.current_thread() is not self._worker:
            self._worker.join()

    def _layer_index(self, layer: Any) -> int:
        """``layer`` as the int index of a layer of this load, else ``InputError``: an integer
        of any kind page ids are taken as (an int, a numpy integer, a 0-d tensor); a bool or a
        float is a caller's mistake, and a negative index would silently name another layer."""
        return _layer_of(layer, self.num_layers, "the")

    def _check(self, layer: int) -> None:
        if self._events[layer] is None and self._ready_t[layer] is None:
            self._not_loaded(layer)

    def _not_loaded(self, layer: int) -> None:
        cause = self.error
        # No cause: the load was abandoned before the layer's group was issued.
        why = f"{type(cause).__name__}: {cause}" if cause is not None else "the load was abandoned"
        raise LoadError(f"layer {layer} of the prefix was not loaded ({why}); recompute it") from cause


def load(fmt: BlockFormat, store: Any, chains: Sequence[tuple[Sequence[bytes], Sequence[str]]],
         device: torch.device, *, sink: Any = None, rows: list[int] | None = None,
         groups: Sequence[tuple[int, int]] | None = None,
         starts: Sequence[int] | None = None) -> tuple[LayerwiseDecoder | None, list[list[str]]]:
    """Fetch the frames of ``chains`` ((hashes, located tiers) per request, in row order)
    into a ``LayerwiseDecoder``: per chain, the tiers of the blocks it got (a chain ends at
    the first block gone or bad since the lookup). ``rows``: with a page ``sink``, the
    call's row of each chain's first block, appended to ``sink.rows`` per block added.
    ``starts``: the position in its chain of each chain's first block (0 when not given)."""
    if sink is not None and rows is None:
        raise TypeError("layerwise.load: a page sink needs the rows of its chains")
    total = sum(len(where) for _, where in chains)
    got: list[list[str]] = [[] for _ in chains]
    if not total:
        return None, got
    groups = list(groups) if groups is not None else layer_groups(fmt.layout.num_layers)
    cpu = store.tier("cpu") if "cpu" in store.tier_names else None
    decoder = LayerwiseDecoder(fmt, total, device, groups, sink=sink,
                               host_mapped=cpu is not None and (cpu.host_mapped or device.type == "cpu"))
    try:
        for r, (hashes, where) in enumerate(chains):
            if not where:
                continue
            frames = store.stream(list(hashes[: len(where)]), where=list(where), leased=True)
            foreign = None
            try:
                for position, (key, item) in enumerate(zip(hashes, frames), starts[r] if starts else 0):
                    if item is None:
                        break  # evicted or found corrupt since the lookup: this prefix ends here
                    frame, tier = item
                    try:
                        fmt.check_fetched(frame.meta, key, position)
                    except FrameError as exc:
                        frame.release()
                        foreign = (key, tier, str(exc))
                        break
                    if sink is not None:
                        assert rows is not None  # (checked above)
                        sink.rows.append(rows[r] + len(got[r]))
                    decoder.add(frame, split=tier == "cpu")
                    got[r].append(tier)
                    decoder.release_copied()
            finally:
                frames.close()
                if foreign is not None:  # (once the reads are given back)
                    store.drop_foreign(*foreign)
        decoder.seal()
    except BaseException:
        decoder.release_all()
        raise
    return decoder, got


# -- ingest, layer by layer ----------------------------------------------------------------


class LayerwiseWriter(Protocol):
    """What ``ingest_layerwise`` answers (``LayerwiseIngest``, or a ``PrefixCache``'s
    ``LayerwiseSave``): KV put layer by layer, stored on ``finish``."""

    @property
    def mode(self) -> str | None: ...

    @property
    def missing(self) -> list[int]: ...

    def put_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def finish(self) -> Any: ...

    def abort(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, *exc: object) -> None: ...


class LayerWriter:
    """What every layer-wise writer shares: open until ``finish`` or ``abort`` (idempotent),
    and a ``with`` block left open (by an exception, or without ``finish``) aborts it."""

    _state = "open"

    def abort(self) -> None:  # pragma: no cover - each writer implements it
        raise NotImplementedError

    def _open(self, what: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"{type(self).__name__}.{what}: the writer is {self._state}")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._state == "open":
            self.abort()  # an exception, or left without finish(): nothing is stored


def _layer_of(layer: Any, n: int, whose: str) -> int:
    """``layer`` as an int in ``[0, n)``, else ``InputError`` naming it and the range."""
    i = as_index(layer)
    if i is None:
        raise InputError(f"layer: expected an int index of one of the {n} layers (0 to {n - 1}), "
                         f"got {type(layer).__name__} {layer!r:.40}")
    if not 0 <= i < n:
        raise InputError(f"layer: {i} is outside {whose} {n} layers (0 to {n - 1})")
    return i


def check_layer_index(layer: Any, put: Sequence[Any]) -> int:
    """``layer`` as the int index of a layer, one per entry of ``put``, whose entry is not
    set yet (None or False: not put), else ``InputError``; integers taken as a load's are."""
    i = _layer_of(layer, len(put), "the layout's")
    if put[i] is not None and put[i] is not False:
        raise InputError(f"layer {i}: put twice")
    return i


def check_layer(i: Any, k: Any, v: Any, layout: Any, layers: list, tokens: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer-wise writer's check of layer ``i`` (``layers``: what was put so far, ``tokens``:
    the earlier layers' length): ``InputError`` naming what is wrong, else K and V as
    ``[1, H, T, D]``."""
    i = check_layer_index(i, layers)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4) or (t.dim() == 4 and t.shape[0] != 1):
            raise InputError(f"layer {i} {name}: expected a [1, H, T, D] or [H, T, D] tensor")
    k = k if k.dim() == 4 else k.unsqueeze(0)
    v = v if v.dim() == 4 else v.unsqueeze(0)
    if k.shape != v.shape:
        raise InputError(f"layer {i}: k {list(k.shape)} and v {list(v.shape)} differ")
    if k.dtype != v.dtype or k.device != v.device:
        raise InputError(f"layer {i}: k and v differ in dtype or device")
    H, T, D = k.shape[-3:]
    if (H, D) != (layout.num_kv_heads, layout.head_dim):
        raise InputError(f"layer {i}: {H} heads of dim {D}, the layout says {layout.num_kv_heads} of dim {layout.head_dim}")
    if k.dtype != layout.torch_dtype:
        raise InputError(f"layer {i}: dtype {k.dtype}, the layout says {layout.dtype}")
    if tokens is not None and T != tokens:
        raise InputError(f"layer {i}: {T} tokens, earlier layers have {tokens}")
    if k.requires_grad or v.requires_grad:
        # KV from a forward run without ``no_grad``: storing it needs none, and the encode's
        # in-place steps into the slots refuse it (``ingest`` detaches it alike).
        k, v = k.detach(), v.detach()
    return k, v


def missing_layers_error(missing: list[int], num_layers: int) -> InputError:
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    return InputError(f"layers {shown} were never put ({len(missing)} of {num_layers}); nothing stored")


class LayerwiseIngest(LayerWriter):
    """Takes a prompt's KV one layer at a time (``put_layer(i, k, v)``, any order, as a
    forward produces them) and stores its blocks when ``finish()`` is called with every
    layer there: a block is stored whole or not at all, never some of its layers. ``abort()``
    (or leaving a ``with`` block by an exception) drops what was put: nothing is stored.

    The layers are kept by reference until ``finish`` (a forward's cache makes new tensors
    as it grows, so the ones put stay as they were); ``finish`` is one ``ingest`` of them,
    with its checks (NaN/Inf: nothing stored) and its result."""

    # (``LayerwiseSave.mode``'s value for the whole save on ``finish``: code written against
    # either cache reads it, as docs/engine.md shows)
    mode = "reference"

    def __init__(self, ingest: Callable[[Any, list], Any], keys: Any, layout: Any,
                 check_tokens: Callable[[int], None] | None = None) -> None:
        """``check_tokens(T)``: raises ``InputError`` when the keys do not fit T tokens of KV
        (``PrefixKeys.check_ingest``), asked on the first layer put, as ``LayerwiseSave`` asks."""
        self._ingest, self.keys, self.layout = ingest, keys, layout
        self._check_tokens = check_tokens
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layout.num_layers
        self._tokens: int | None = None

    def put_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``i``'s K and V, ``[1, H, T, D]`` or ``[H, T, D]`` (T: the prompt's tokens
        so far, the same for every layer). Bad input raises ``InputError``; the writer stays
        usable (nothing of it was taken)."""
        self._open("put_layer")
        k, v = check_layer(i, k, v, self.layout, self._layers, self._tokens)
        if self._tokens is None and self._check_tokens is not None:
            try:
                self._check_tokens(k.shape[-2])
            except InputError as exc:
                raise InputError(f"layer {i}: {exc}") from None
        self._tokens = k.shape[-2]
        self._layers[i] = (k, v)

    @property
    def missing(self) -> list[int]:
        return [i for i, kv in enumerate(self._layers) if kv is None]

    def finish(self) -> Any:
        """Store the blocks (one ``ingest`` of all layers) and return its ``IngestResult``.
        With a layer missing: ``InputError``, and nothing is stored."""
        self._open("finish")
        missing = self.missing
        if missing:
            self.abort()
            raise missing_layers_error(missing, len(self._layers))
        layers, self._layers = self._layers, [None] * len(self._layers)
        self._state = "finished"
        return self._ingest(self.keys, layers)

    def abort(self) -> None:
        """Drop every layer put: nothing is stored. Idempotent."""
        if self._state == "open":
            self._state = "aborted"
        self._layers = [None] * len(self._layers)


class PagedLayerwiseIngest(LayerWriter):
    """The reference writer for KV in an engine's pages (``RemoteCache.ingest_batch(...,
    layerwise=True)``): ``put_layer(i)`` only records that layer ``i`` is written, and
    ``finish()`` is one ``ingest_batch`` of the requests, once every layer is there. Over
    HTTP a frame holds every layer of its block, so nothing can be sent before the last
    layer; the same interface as ``layerwise_save.PagedLayerwiseSave``."""

    def __init__(self, ingest_batch: Callable[[list, Any], Any], requests: list, pages: Any, num_layers: int) -> None:
        self._ingest_batch, self.requests, self.pages = ingest_batch, requests, pages
        self._put = [False] * num_layers
        self.mode = "reference"

    def put_layer(self, i: int) -> None:
        self._open("put_layer")
        i = check_layer_index(i, self._put)
        self._put[i] = True

    @property
    def missing(self) -> list[int]:
        return [i for i, put in enumerate(self._put) if not put]

    def finish(self) -> list:
        self._open("finish")
        missing = self.missing
        if missing:
            self.abort()
            raise missing_layers_error(missing, len(self._put))
        self._state = "finished"
        return self._ingest_batch(self.requests, self.pages)

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"


__all__ = ["LOOKAHEAD_GROUPS", "LayerTiming", "LayerwiseDecoder", "LayerwiseIngest", "LayerwiseLoad",
           "LayerWriter", "PagedLayerwiseIngest", "check_layer", "check_layer_index", "layer_groups", "load",
           "missing_layers_error"]
