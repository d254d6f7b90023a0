"""The fixed orthonormal rotation of the head dimension behind ``KIVI(v_rotate=True)``.

V is quantized per token in groups of channels, and V's outlier channels are the same
channels token after token, so a few channels set most groups' ranges. Rotating each V row
by an orthonormal matrix R spreads them over all channels (as QuaRot and SpinQuant do);
the codec stores quant(V R) and decodes dequant(...) R^T. With no quantization in between
it is the identity (up to fp32 rounding), and the stored bytes per block are unchanged.

    R       = diag(s) H_n / sqrt(n)        n = head_dim, a power of two
    H_1     = [1];  H_2m = [[H_m, H_m], [H_m, -H_m]]       (Sylvester's Hadamard matrix)
    s_i     = +1 if bit i of signs_bytes(n) is 0, else -1 (bit i: byte i // 8, bit i % 8,
              least significant first)
    signs_bytes(n) = SHA-256("cacheseek/kivi/v_rotate/n=<n>/<j>") for j = 0, 1, ...,
              concatenated (ASCII, <n> and <j> in decimal)

    c           = s * float32(1 / sqrt(n))                 (an fp32 vector: signed scales)
    rotate(x)   = fwht(x * c)                              (x row vectors, fp32)
    unrotate(y) = fwht(y) * c, capped at +-the output dtype's largest finite value

``fwht`` is the fast Walsh-Hadamard transform, x H_n, computed in log2(n) stages of fp32
additions and subtractions (stage h = 1, 2, 4, ...: (a, b) -> (a + b, a - b) for elements
h apart in blocks of 2h). Each output element is the same sequence of IEEE fp32
operations on every device (the scaling too: a product of two fp32 tensors, not of a
tensor and a Python scalar), so a GPU encode stores the same codes as the CPU reference (a
matmul would sum in a device-dependent order). For n = 64, 1/sqrt(n) = 1/8 is exact. The
signs are fixed by the hash, not by a random generator whose sequence could change between
torch versions.

On a GPU with the kernels, ``rotate`` and ``unrotate`` run as one pass over the rows
(``kernels.rotation.rotate_rows``: the same stages in registers, the same bits); the torch
stages here are the reference and the CPU path. Torch is imported only by the functions
that compute.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

SIGNS_LABEL = "cacheseek/kivi/v_rotate"


def supported(head_dim: int) -> bool:
    """Whether the rotation is defined for ``head_dim`` (a power of two, at least 2)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def sign_bits(n: int) -> list[int]:
    """The n sign bits (0: +1, 1: -1) of the rotation of size ``n``, from SHA-256 (above)."""
    out: list[int] = []
    j = 0
    while len(out) < n:
        digest = hashlib.sha256(f"{SIGNS_LABEL}/n={n}/{j}".encode("ascii")).digest()
        out += [(byte >> b) & 1 for byte in digest for b in range(8)]
        j += 1
    return out[:n]


@functools.cache
def _vectors(n: int, device: Any) -> tuple[Any, Any]:
    import torch

    s = 1.0 - 2.0 * torch.tensor(sign_bits(n), dtype=torch.float32)
    c = s * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)  # fp32 * fp32, on the CPU: the same everywhere
    return s.to(device), c.to(device)


def signs(n: int, device: Any) -> Any:
    """The sign vector s ([n] fp32, +1/-1) on ``device``, cached per device."""
    import torch

    return _vectors(n, torch.device(device))[0]


def scaled_signs(n: int, device: Any) -> Any:
    """c = s * float32(1 / sqrt(n)) ([n] fp32) on ``device``, cached per device."""
    import torch

    return _vectors(n, torch.device(device))[1]


def _check(x: Any) -> int:
    n = x.shape[-1]
    if not supported(n):
        raise ValueError(f"rotation: head_dim must be a power of two, got {n}")
    return n


def fwht(x: Any) -> Any:
    """x H_n along the last dimension (unnormalized), in fp32 stages; returns a new tensor."""
    import torch

    n = _check(x)
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return y.view(*lead, n)


def rotate(x: Any, dtype: Any = None) -> Any:
    """x R as a new tensor (any leading shape; the last dimension is head_dim): fp32, or
    rounded once to ``dtype``. With the kernels on a GPU, one pass
    (``kernels.rotation.rotate_rows``, the same bits, rows of up to 1024); else the stages
    above in torch."""
    n = _check(x)
    if _on_kernels(x):
        from cacheseek import kernels

        return kernels.rotate_rows(x, scaled_signs(n, x.device), inverse=False, dtype=dtype or _fp32())
    y = fwht(x.float() * scaled_signs(n, x.device))
    return y if dtype is None else y.to(dtype)


def unrotate(y: Any, dtype: Any = None) -> Any:
    """y R^T as a new tensor, fp32 or rounded once to ``dtype`` (capped at its largest
    finite value, either sign): the inverse of :func:`rotate`."""
    import torch

    n = _check(y)
    if _on_kernels(y):
        from cacheseek import kernels

        return kernels.rotate_rows(y, scaled_signs(n, y.device), inverse=True, dtype=dtype or _fp32())
    x = fwht(y).mul_(scaled_signs(n, y.device))
    # Capped at the output dtype's largest finite value, as a plain decode is: a row at
    # fp16's max comes back with the quantization errors of every channel added to it,
    # which can pass 65520 and round to Inf (and a decode has no lower bound either).
    top = torch.finfo(dtype or torch.float32).max
    x = x.clamp_(-top, top)
    return x if dtype is None else x.to(dtype)


def _on_kernels(t: Any) -> bool:
    from .backend import backend_for

    if not (t.is_cuda and backend_for(t) == "triton"):
        return False
    from cacheseek.kernels import rotation as rotation_kernel

    return t.shape[-1] <= rotation_kernel.MAX_N


def _fp32() -> Any:
    import torch

    return torch.float32


__all__ = ["SIGNS_LABEL", "fwht", "rotate", "scaled_signs", "sign_bits", "signs", "supported", "unrotate"]
