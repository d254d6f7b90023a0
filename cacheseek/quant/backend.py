"""Which implementation encodes and decodes a tensor: the Triton kernels or the torch reference.

CUDA tensors use the Triton kernels (``cacheseek.kernels``) when they import, CPU tensors
``kivi_host`` (the reference's bits, arranged for a CPU), anything else the torch reference. The reference is 24-82x slower on a GPU, so losing the kernels
there is never silent: the first CUDA tensor sent to the reference warns, once, with the
ImportError and the fix, and ``kernel_backend()`` says which one runs and why (in
``PrefixCache.stats()``). ``CACHESEEK_KIVI_BACKEND=torch`` forces the reference (for
comparisons); ``=triton`` forces the kernels (on a CPU only under ``TRITON_INTERPRET=1``)
and fails with a ``ConfigError`` naming the reason when they cannot load.

Torch is imported only by the functions that run kernels.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Any

from ..errors import ConfigError

BACKEND_ENV = "CACHESEEK_KIVI_BACKEND"
MODES = ("auto", "torch", "triton")
TRITON = "triton"
REFERENCE = "torch-reference"
FIX = ("install Triton and import cacheseek from an installed package (pip install -e '.[kernels]' in "
       "the checkout), so that cacheseek.kernels imports")


class KernelFallbackWarning(RuntimeWarning):
    """CUDA tensors are being encoded or decoded by the torch reference: the kernels did not load."""


@functools.cache
def kernels_import_error() -> str | None:
    """Why Triton or ``cacheseek.kernels`` does not import (checked once per process); None if they do."""
    try:
        import triton  # noqa: F401

        from cacheseek import kernels  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def kernels_available() -> bool:
    """True when Triton and ``cacheseek.kernels`` import."""
    return kernels_import_error() is None


def _mode() -> str:
    mode = os.environ.get(BACKEND_ENV, "auto")
    if mode not in MODES:
        raise ConfigError(f"{BACKEND_ENV}: must be auto, torch or triton, got {mode!r}")
    return mode


def forced_triton() -> bool:
    """Whether ``CACHESEEK_KIVI_BACKEND=triton`` asks for the kernels whatever the device."""
    return _mode() == "triton"


def kernel_backend() -> tuple[str, str | None]:
    """What KV on a CUDA device is encoded and decoded with: ``("triton", None)``, or
    ``("torch-reference", why)``. Raises ``ConfigError`` if ``CACHESEEK_KIVI_BACKEND=triton``
    and the kernels cannot load."""
    mode = _mode()
    if mode == "torch":
        return REFERENCE, f"{BACKEND_ENV}=torch"
    error = kernels_import_error()
    if error is None:
        return TRITON, None
    if mode == "triton":
        raise ConfigError(f"{BACKEND_ENV}=triton, but the Triton kernels cannot load ({error}); {FIX}")
    return REFERENCE, f"the Triton kernels cannot load ({error}); {FIX}"


def backend_for(t: Any) -> str:
    """Which implementation encodes/decodes ``t``: "triton" or "torch"."""
    mode = _mode()
    if mode == "torch":
        return "torch"
    if mode == "triton":
        kernel_backend()  # raises, naming the reason, if the kernels cannot load
        return "triton"
    if not t.is_cuda:
        return "torch"
    if kernels_available():
        return "triton"
    _warn_fallback_once()
    return "torch"


_warned = threading.Event()


def _warn_fallback_once() -> None:
    if _warned.is_set():
        return
    _warned.set()
    _, why = kernel_backend()
    warnings.warn(f"CUDA KV is encoded and decoded by the torch reference, 24-82x slower: {why}",
                  KernelFallbackWarning, stacklevel=4)


def ops_for(t: Any) -> Any:
    """The module whose ``quantize``/``dequantize`` run on ``t``: on the host, ``kivi_host``
    (the reference's bits in fewer passes over memory)."""
    if backend_for(t) == "triton":
        from cacheseek import kernels

        return kernels
    if t.device.type == "cpu":
        from . import kivi_host

        return kivi_host
    from . import kivi_reference

    return kivi_reference


def layer_tables(k_layers: list[Any], v_layers: list[Any]) -> Any | None:
    """K's and V's ``kernels.LayerTable``, for codecs whose kernels read a model's layers in
    place; None on the torch backend, or when the layers differ in strides (the caller then
    stacks them). The caller has checked that the layers agree in shape, dtype and device."""
    if backend_for(k_layers[0]) != "triton":
        return None
    from cacheseek import kernels

    try:
        return kernels.LayerTable(k_layers, checked=True), kernels.LayerTable(v_layers, checked=True)
    except ValueError:
        return None


__all__ = ["BACKEND_ENV", "KernelFallbackWarning", "backend_for", "forced_triton", "kernel_backend",
           "kernels_available", "kernels_import_error", "layer_tables", "ops_for"]
