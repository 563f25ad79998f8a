"""Triton kernels (compiled on a GPU, interpreted on CPU): triton_formats.py holds the dequantize-and-matmul kernels,
stream_decoders.py the rANS and Rice decoders; and compiled(), the one way the engine calls torch.compile. Kernels are
leaves: they import nothing from the formats, which pass their constants in."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# torch's CPU kernel set (ATEN_CPU_CAPABILITY, else the CPU's best) -> the vector width inductor's C++ is written for
VECTOR_BITS = {"AVX512": 512, "AVX2": 256, "DEFAULT": 0}


def compiled(fn, options=None, **kwargs):
    """torch.compile(fn, options=options, **kwargs) with inductor's C++ vector width pinned to the CPU kernel set torch
    runs here. inductor picks that width from ATEN_CPU_CAPABILITY but leaves it out of its cache key (torch 2.13): a
    graph cached at one width and loaded at another computes garbage or crashes; pinned, the width is in the key."""
    bits = VECTOR_BITS.get(torch.backends.cpu.get_cpu_capability())
    pinned = {} if bits is None else {"cpp.simdlen": bits}
    return torch.compile(fn, options={**pinned, **(options or {})}, **kwargs)


def check_device(x, *tensors):
    """Every launcher's first check: x is [M, K] and all tensors share one device."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    devices = {t.device for t in (x, *tensors)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
