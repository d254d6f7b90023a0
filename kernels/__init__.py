"""Triton kernels for KIVI (shipped as ``cacheseek.kernels``).

``quantize`` and ``dequantize`` compute what ``cacheseek.quant.kivi_reference`` does, in
one launch per call. On a machine without CUDA they run only under ``TRITON_INTERPRET=1``
(set before triton is first imported).
"""

from .kivi import LayerTable, dequantize, quantize, quantize_layers, store_to_host

__all__ = ["LayerTable", "dequantize", "quantize", "quantize_layers", "store_to_host"]
