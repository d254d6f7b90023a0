"""Triton kernels for KIVI, and for reading a model's per-layer KV in place (shipped as
``cacheseek.kernels``).

``quantize`` and ``dequantize`` compute what ``cacheseek.quant.kivi_reference`` does, in
one launch per call. On a machine without CUDA they run only under ``TRITON_INTERPRET=1``
(set before triton is first imported).
"""

from .kivi import dequantize, quantize, quantize_layers, store_to_host
from .layers import LayerTable, gather_layers

__all__ = ["LayerTable", "dequantize", "gather_layers", "quantize", "quantize_layers", "store_to_host"]
