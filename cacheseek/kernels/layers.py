"""A model's per-layer KV read in place: a device table of each layer's offset from layer 0.

Workers keep K and V as one ``[H, T, D]`` tensor per layer. Encoding blocks of all layers
at once would otherwise need a stacked copy of the KV first (as large as the KV itself);
the kernels here and in ``kivi`` instead index layer ``l`` through a small table.
"""

# (No `from __future__ import annotations` here: @triton.jit reads parameter annotations.)
import contextlib
import threading

import torch
import triton
import triton.language as tl

_OFFSET_TABLES: dict[tuple, torch.Tensor] = {}  # device tables by their offsets: a worker's KV lives on
_OFFSET_TABLES_LOCK = threading.Lock()  # held to drop and add (reads go without)
RING_UPLOADS = True  # new tables go up from the pinned ring below (False: a pinned tensor each)


class _UploadRing:
    """Pinned host rows that new device tables are copied from, reused in turn once the
    copy out of a row has run. A table is new on most calls of a server (the forward that
    has just made the KV put it at new addresses), and a pinned tensor made for each one
    cost ~0.1 ms of host time on the H200 host, a visible share of a 4K-token ingest."""

    ROWS, WIDTH = 64, 512  # int64 entries a row: tables longer than this take the slow path

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # made on first use (pinning needs CUDA)
        self._events: list[torch.cuda.Event | None] = [None] * self.ROWS
        self._next = 0
        self._lock = threading.Lock()

    def upload(self, device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
        n = len(values)
        table = torch.empty(n, dtype=torch.int64, device=device)
        with self._lock:
            if self._host is None:
                self._host = torch.empty((self.ROWS, self.WIDTH), dtype=torch.int64, pin_memory=True)
            i = self._next
            self._next = (i + 1) % self.ROWS
            done = self._events[i]
            if done is not None:
                done.synchronize()  # the row's last copy has run (ROWS uploads ago: in practice long since)
            row = self._host[i, :n]
            row.copy_(torch.tensor(values, dtype=torch.int64))
            table.copy_(row, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events[i] = event
        return table


_RING = _UploadRing()


def _stream_id(device: torch.device) -> int:
    """The id of ``device``'s current stream, through torch's C binding (the Python call
    costs 3-30 µs on a busy host; this path runs several times a call). 0 off CUDA."""
    if device.type != "cuda":
        return 0
    try:
        c = torch._C
        return c._cuda_getCurrentStream(device.index if device.index is not None else c._cuda_getDevice())[0]
    except AttributeError:  # a torch that renamed the bindings
        return torch.cuda.current_stream(device).stream_id


def offsets_table(device: torch.device, offsets: tuple[int, ...]) -> torch.Tensor:
    """The device table of ``offsets`` (int64), cached by its values and by the stream
    current on ``device``: uploaded on that stream, so a kernel queued there after this
    call reads it whole. (One table shared across streams could be read by a kernel on
    another stream before its copy ran, and, once dropped from the cache, handed by the
    allocator to new work on its own stream while the other stream still read it.)
    Uploaded from pinned memory when it is new: a pageable copy would wait for everything
    queued on the caller's stream (in a server, the forward that has just made fresh KV at
    new addresses). A caller that keeps a table reads it on streams that wait for this one.
    """
    key = (device, _stream_id(device), offsets)
    table = _OFFSET_TABLES.get(key)
    if table is None:
        if device.type == "cuda" and RING_UPLOADS and len(offsets) <= _UploadRing.WIDTH:
            table = _RING.upload(device, offsets)
        else:
            host = torch.tensor(offsets, dtype=torch.int64, pin_memory=device.type == "cuda")
            table = host.to(device, non_blocking=True)
        # One step: threads adding at once (a server's ingests) each found room, or both
        # took the same oldest key and the second pop raised KeyError out of its ingest.
        with _OFFSET_TABLES_LOCK:
            while len(_OFFSET_TABLES) >= 64:
                _OFFSET_TABLES.pop(next(iter(_OFFSET_TABLES)))
            _OFFSET_TABLES[key] = table
    return table


class LayerTable:
    """A model's layers (L separate ``[H, T, D]`` tensors of one shape, strides, dtype and
    device) as a device table of each layer's offset from layer 0, for the kernels that
    read them in place (:func:`gather_layers`, ``kivi.quantize_layers``). ``checked``: the
    caller has already checked the layers' shapes, dtypes and devices agree (only strides
    and alignment are checked here)."""

    __slots__ = ("device", "dtype", "layers", "offsets", "shape", "stride")

    def __init__(self, layers: list[torch.Tensor], *, checked: bool = False) -> None:
        first = layers[0]
        shape, stride, dtype, device = first.shape, first.stride(), first.dtype, first.device
        if len({t.stride() for t in layers}) != 1 or not checked and any(
                t.shape != shape or t.dtype != dtype or t.device != device for t in layers):
            i = next(i for i, t in enumerate(layers) if t.stride() != stride or t.shape != shape
                     or t.dtype != dtype or t.device != device)
            raise ValueError(f"layers[{i}]: shape, strides, dtype and device must match layer 0's")
        if len(shape) != 3 or stride[-1] != 1:
            raise ValueError(f"layers: expected [H, T, D] tensors with unit last stride, got {tuple(shape)} {stride}")
        ptrs = [t.data_ptr() for t in layers]
        size = first.element_size()
        if any(p % 16 for p in ptrs) or (stride[1] * size) % 16:
            raise ValueError("layers: every layer and token row must start 16-byte aligned")
        self.layers = list(layers)
        self.shape, self.stride, self.dtype, self.device = tuple(shape), stride, dtype, device
        # Offsets, not addresses: a table stays right for any tensors at the same distances,
        # so the (small) upload happens once per set of KV buffers, not once per call.
        self.offsets = offsets_table(device, tuple((p - ptrs[0]) // size for p in ptrs))

    def __len__(self) -> int:
        return len(self.layers)

    def check_blocks(self, t0: int, n: int, block: int) -> None:
        if t0 < 0 or n < 0 or t0 + n * block > self.shape[1]:
            raise ValueError(f"tokens [{t0}, {t0 + n * block}) are outside the layers' {self.shape[1]}")


@triton.jit
def layer_row(x_ptr, xt_ptr, a, c, XH, sx_a, sx_c, X_TABLE: tl.constexpr, X_ALIGN: tl.constexpr):
    """Where row (a, c) of the input starts. With ``X_TABLE``, the input is a model's layers,
    each its own [H, T, D] tensor: ``x_ptr`` is layer 0 and ``xt_ptr`` a table of each
    layer's offset from it (in elements), one entry per XH inner rows; row (a, c) is inner
    row c % XH of layer c // XH, so no stacked copy is needed."""
    if X_TABLE:
        # Offsets from a pointer the compiler knows is aligned (not raw addresses), declared
        # multiples of 16 bytes (LayerTable checks): the loads stay vectorized.
        off = tl.multiple_of(tl.load(xt_ptr + c // XH), X_ALIGN)
        row = x_ptr + off + a * sx_a + (c % XH) * sx_c
    else:
        row = x_ptr + a * sx_a + c * sx_c
    return row


@triton.jit
def _gather_kernel(
    x_ptr, xt_ptr, o_ptr, bad_addr,
    C, T, D, XH,
    sx_a, sx_c, sx_t,
    so_a, so_c, so_t,
    BLOCK_T: tl.constexpr, D_PAD: tl.constexpr, X_ALIGN: tl.constexpr, MASKED: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    # A program copies BLOCK_T tokens of one (block, layer x head) row, and clears the host
    # byte at bad_addr if any of them is NaN or Inf (x - x is NaN exactly for those; fp8,
    # moved as bytes, is NaN or Inf where its bits under NAN_BITS are all set).
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    t_tile = pid % n_t
    row = pid // n_t
    a = (row // C).to(tl.int64)
    c = (row % C).to(tl.int64)
    t = (t_tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.arange(0, D_PAD)
    x_ptrs = layer_row(x_ptr, xt_ptr, a, c, XH, sx_a, sx_c, True, X_ALIGN) + t[:, None] * sx_t + d[None, :]
    o_ptrs = o_ptr + a * so_a + c * so_c + t[:, None] * so_t + d[None, :]
    ok = (t < T)[:, None] & (d < D)[None, :]
    if MASKED:
        x = tl.load(x_ptrs, mask=ok, other=0.0)
        tl.store(o_ptrs, x, mask=ok)
    else:
        x = tl.load(x_ptrs)
        tl.store(o_ptrs, x)
    bad = nonfinite(x, NAN_BITS)
    if tl.max(tl.max(bad, axis=1), axis=0) > 0:
        tl.store(bad_addr.to(tl.pointer_type(tl.int8)), 0)


@triton.jit
def nonfinite(x, NAN_BITS: tl.constexpr):
    """1 (int32) where ``x`` is NaN or Inf. ``NAN_BITS`` 0: ``x`` is a float; else ``x`` is
    fp8 moved as uint8 (see :func:`byte_view`), non-finite where those bits are all set."""
    if NAN_BITS:
        bad = ((x & NAN_BITS) == NAN_BITS).to(tl.int32)
    else:
        xf = x.to(tl.float32)
        bad = ((xf - xf) != 0.0).to(tl.int32)
    return bad


# fp8 dtype -> the bits that are all set exactly in its NaN and Inf (quant/tensors.py's
# exponent masks: e4m3fn has no Inf, and NaN is S.1111.111).
_FP8_NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def byte_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as the copy kernels take it, and their ``NAN_BITS``: fp8 as a uint8 view (same
    strides; the kernels only move it, and the interpreter and pre-Ada GPUs have no fp8
    conversions), everything else as it is."""
    bits = _FP8_NAN_BITS.get(t.dtype, 0)
    return (t.view(torch.uint8), bits) if bits else (t, 0)


FLAG_DTYPES = (torch.bool, torch.uint8, torch.int8)  # host flags: a kernel clears one byte per flag


def check_flag(ok_flag: torch.Tensor) -> None:
    """``ValueError`` unless ``ok_flag`` is a one-byte flag in host memory. (Pinning is not
    checked: is_pinned() can stall for milliseconds.) A wider flag kept its other bytes when
    the kernel cleared its first: a float 1.0 still read set, a NaN found and not reported."""
    if ok_flag.device.type != "cpu" or ok_flag.dtype not in FLAG_DTYPES or ok_flag.numel() < 1:
        raise ValueError(f"ok_flag: one byte of host memory ({', '.join(map(str, FLAG_DTYPES))}), pinned when the "
                         f"layers are on a GPU; got {ok_flag.dtype} on {ok_flag.device}")


def gather_layers(layers: "LayerTable | list[torch.Tensor]", t0: int, n: int, block: int, *,
                  out: torch.Tensor, ok_flag: torch.Tensor) -> None:
    """Copy tokens ``[t0, t0 + n * block)`` of every layer, as ``n`` blocks, into ``out`` of
    shape ``[n, L, H, block, D]`` (e.g. a view of a staging buffer, each block a row at
    its own stride), in one launch. ``ok_flag``: one byte of host memory (pinned when the
    layers are on a GPU) that the kernel sets to 0 if any value copied is NaN or Inf; the
    caller sets it to 1 before, and reads it once the launch is done."""
    table = layers if isinstance(layers, LayerTable) else LayerTable(layers)
    table.check_blocks(t0, n, block)
    H, _, D = table.shape
    L = len(table)
    if tuple(out.shape) != (n, L, H, block, D) or out.dtype != table.dtype or out.device != table.device:
        raise ValueError(f"out: expected {(n, L, H, block, D)} {table.dtype} on {table.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    so = out.stride()
    if so[4] != 1 or (L > 1 and H > 1 and so[1] != so[2] * H) or (L > 1 and H == 1 and so[1] != so[2]):
        raise ValueError(f"out: strides {so} cannot be indexed as [block, layer x head] rows")
    check_flag(ok_flag)
    if n * L * H * block * D == 0:
        return
    sx_h, sx_t, _ = table.stride
    d_pad = triton.next_power_of_2(D)
    block_t = min(triton.next_power_of_2(block), max(1, 8192 // d_pad))
    grid = (n * L * H * triton.cdiv(block, block_t),)
    on_gpu = table.device.type == "cuda"
    if not on_gpu and isinstance(_gather_kernel, triton.runtime.JITFunction):
        raise RuntimeError("cacheseek.kernels: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    # Triton launches on the current CUDA device, which need not be the tensors' one.
    with torch.cuda.device(table.device) if on_gpu else contextlib.nullcontext():
        x, nan_bits = byte_view(table.layers[0][:, t0:])
        _gather_kernel[grid](
            x, table.offsets, byte_view(out)[0], ok_flag.data_ptr(),
            L * H, block, D, H,
            block * sx_t, sx_h, sx_t,
            so[0], so[2], so[3],
            BLOCK_T=block_t, D_PAD=d_pad, X_ALIGN=16 // table.layers[0].element_size(),
            MASKED=d_pad != D or block % block_t != 0, NAN_BITS=nan_bits, num_warps=4,
        )

