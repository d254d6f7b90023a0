"""Triton kernels for KIVI (shipped as ``cacheseek.kernels``).

``quantize`` and ``dequantize`` compute what ``cacheseek.quant.kivi_reference`` does, in
one launch per call. On a machine without CUDA they run only under ``TRITON_INTERPRET=1``
(set before triton is first imported).
"""

from .kivi import dequantize, quantize

__all__ = ["dequantize", "quantize"]
