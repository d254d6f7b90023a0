"""Triton kernels for KIVI, and for reading a model's per-layer KV and an engine's paged KV
in place (shipped as ``cacheseek.kernels``).

``quantize`` and ``dequantize`` compute what ``cacheseek.quant.kivi_reference`` does, in
one launch per call. On a machine without CUDA they run only under ``TRITON_INTERPRET=1``
(set before triton is first imported).
"""

from .kivi import dequantize, dequantize_pages, quantize, quantize_layers, quantize_pages, store_to_host
from .layers import LayerTable, gather_layers
from .paged import BlockPages, PagedLayers, gather_pages, scatter_pages
from .ranges import copy_ranges, store_ranges
from .rotation import rotate_rows

__all__ = ["BlockPages", "LayerTable", "PagedLayers", "copy_ranges", "dequantize", "dequantize_pages", "gather_layers",
           "gather_pages", "quantize", "quantize_layers", "quantize_pages", "rotate_rows", "scatter_pages", "store_ranges",
           "store_to_host"]
