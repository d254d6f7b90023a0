"""Triton kernels for KIVI (shipped as ``cacheseek.kernels``)."""
