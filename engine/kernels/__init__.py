"""Triton kernels (compiled on a GPU, interpreted on CPU)."""
