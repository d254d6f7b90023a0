"""Launching a compiled kernel again without Triton's per-call binding.

``kernel[grid](*args, **constexprs)`` binds every argument, derives the specialization key
(each pointer's 16-byte alignment, each integer's class) as a string, and looks the
compiled kernel up by it: tens of microseconds of host time a launch. The store launches
a handful of kernels per call on a few shapes, and a fresh-prompt ingest of a 4K prompt
moves its payload in about 3 ms, so that host time is a visible share of the call.

``CachedLaunch`` keeps, per launch plan, the compiled kernel of each argument class it
has met, under a key at least as fine as Triton's own (per tensor: dtype and whether the
address is a multiple of 16; per integer: whether it is 1, a multiple of 16, and which of
int32 / int64 / uint64 it needs). A key it has not met goes through Triton once, which
compiles or finds the kernel; later calls with that key call the compiled kernel's
launcher directly, on the current stream, as ``JITFunction.run`` does.

It steps aside, and every call goes through Triton, where it cannot be sure to match it:
an installed Triton whose ``JITFunction.run`` does not launch with the bound argument
values (``launch_with_bound_args``), launch hooks set (profilers), the interpreter, or a
kernel whose constexprs are not all after its runtime arguments. ``ENABLED = False``
turns it off (benchmarks measure both).
"""

import inspect
from typing import Any

import torch
import triton

ENABLED = True
_INT32 = 1 << 31
_UINT64_FROM = 1 << 63


def _launch_with_bound_args() -> bool:
    """Whether this Triton's ``JITFunction.run`` launches with every bound argument in
    parameter order, constexprs included (3.3 and later); older ones passed other lists."""
    try:
        src = inspect.getsource(triton.runtime.jit.JITFunction.run)
    except (OSError, TypeError, AttributeError):
        return False
    return "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata" in src \
        and "*bound_args.values())" in src


SUPPORTED = hasattr(triton, "knobs") and _launch_with_bound_args()


def on_device(device: torch.device, launch: Any, *args: Any) -> None:
    """``launch(*args)`` with ``device`` current: Triton launches on the current CUDA device,
    which need not be the one the tensors are on."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch(*args)
    else:
        launch(*args)


def arg_class(arg: Any) -> Any:
    """The part of an argument that Triton specializes a kernel on (or finer)."""
    if isinstance(arg, int) and not isinstance(arg, bool):
        return (arg == 1, arg % 16 == 0, -_INT32 <= arg < _INT32, arg >= _UINT64_FROM)
    ptr = getattr(arg, "data_ptr", None)
    if ptr is not None:
        return (arg.dtype, ptr() % 16 == 0)
    return (type(arg), arg)


class CachedLaunch:
    """Launches of one JIT kernel with fixed trailing scalars and constexprs (a launch
    plan), the compiled kernel remembered per argument class."""

    __slots__ = ("fn", "grid", "scalars", "options", "direct_launches", "_compiled", "_tail", "_direct")

    def __init__(self, fn: Any, grid: tuple[int, ...], scalars: tuple[Any, ...], options: dict[str, Any]) -> None:
        self.fn, self.scalars, self.options = fn, scalars, options
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self._compiled: dict[tuple, tuple] = {}
        self._tail: tuple | None = None  # constexpr values in parameter order, after the runtime ones
        self._direct = SUPPORTED and isinstance(fn, triton.runtime.JITFunction)
        self.direct_launches = 0

    def _constexpr_tail(self, n_runtime: int) -> tuple | None:
        params = self.fn.params
        rest = params[n_runtime:]
        if any(not p.is_constexpr for p in rest) or any(p.is_constexpr for p in params[:n_runtime]):
            return None
        try:
            return tuple(self.options[p.name] if p.name in self.options else _default(p) for p in rest)
        except KeyError:
            return None

    def __call__(self, *args: Any) -> None:
        """Launch on the current device and stream (the caller has made the tensors' device current)."""
        if not (ENABLED and self._direct) or _hooked(triton.knobs.runtime.launch_enter_hook) \
                or _hooked(triton.knobs.runtime.launch_exit_hook):  # (no knobs: not _direct)
            # (a hook wants Triton's launch metadata: Triton's own path builds it)
            self.fn[self.grid](*args, *self.scalars, **self.options)
            return
        key = tuple(map(arg_class, args))
        hit = self._compiled.get(key)
        driver = triton.runtime.driver.active
        if hit is None:
            kernel = self.fn[self.grid](*args, *self.scalars, **self.options)
            if self._tail is None:
                self._tail = self._constexpr_tail(len(args) + len(self.scalars))
                if self._tail is None:
                    self._direct = False
                    return
            if kernel is not None:
                self._compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            return
        run, function, metadata = hit
        tail = self._tail
        assert tail is not None  # (set before the first kernel is remembered)
        stream = driver.get_current_stream(driver.get_current_device())
        g0, g1, g2 = self.grid
        run(g0, g1, g2, stream, function, metadata, None, None, None, *args, *self.scalars, *tail)
        self.direct_launches += 1


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: None, or an empty ``HookChain`` (newer Triton's default), is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _default(param: Any) -> Any:
    default = param.default
    if default is inspect.Parameter.empty:
        raise KeyError(param.name)
    return default


__all__ = ["ENABLED", "SUPPORTED", "CachedLaunch", "arg_class"]
