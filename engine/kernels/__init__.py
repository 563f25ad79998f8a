"""Triton kernels (compiled on a GPU, interpreted on CPU): triton_formats.py holds the dequantize-and-matmul kernels,
stream_decoders.py the rANS and Rice decoders. Kernels are leaves: they import nothing from the formats, which pass
their constants in."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_device(x, *tensors):
    """Every launcher's first check: x is [M, K] and all tensors share one device."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    devices = {t.device for t in (x, *tensors)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
