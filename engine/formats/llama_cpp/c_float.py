"""C's float32 arithmetic, as llama.cpp's quantizers (ggml-quants.c) do it, for ports that must write the same
bytes: sums accumulated element by element in order, divisions as C divides, sqrtf correctly rounded, C's integer
conversions, and C's first-wins searches for a maximum. (torch's reductions sum in blocks and its `number / tensor`
multiplies by a reciprocal: both round differently.)"""
import numpy as np
import torch

F32 = np.float32
EPS = 1e-15                 # ggml-quants.c's GROUP_MAX_EPS: a block whose largest |x| is below it is all zero


def c_sum(t):
    """t [..., n] -> [...]: sum over the last dim in C's order, (((0 + t0) + t1) + ...), in float32. (Stack several
    sums into one t: the loop is the cost.)"""
    acc = torch.zeros(t.shape[:-1])
    for column in t.movedim(-1, 0).contiguous():
        acc += column
    return acc


def first_of(x, arg):
    """x [..., n] -> [...]: the first element that argmax / argmin picks (C's `if (x[i] < min) min = x[i]` keeps
    the first of equal values, which matters for the sign of a zero)."""
    return x.gather(-1, arg(x, -1, keepdim=True))[..., 0]


def positive_max(x):
    """C's `float m = 0; if (x[i] > m) m = x[i];` over the last dim: the max, or +0 when none is positive."""
    m = x.amax(-1)
    return torch.where(m > 0, m, torch.zeros(()))


def signed_absmax(x):
    """x [..., n] -> (amax, the signed value of the first element reaching it) [...]: C's `if (ax > amax)` loop,
    starting from max = +0."""
    v = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]
    return v.abs(), torch.where(v.abs() > 0, v, torch.zeros(()))


def rdiv(c, t):
    """c / t for a float32 constant c, divided as C divides (torch's `number / tensor` multiplies by a reciprocal,
    which rounds twice)."""
    return torch.full_like(t, float(c)) / t


def sqrtf(x):
    """sqrtf, correctly rounded (torch's float32 sqrt on CPU is not always)."""
    return torch.sqrt(x.double()).float()


def round_f16(x):
    """GGML_FP32_TO_FP16 then back: round to nearest f16 (ties to even)."""
    return x.half().float()


def to_uint8(v):
    """C's conversion of an int to uint8 (modulo 256)."""
    return torch.remainder(v, 256)


def to_int8(v):
    """C's conversion of an int to int8 (modulo 256, signed)."""
    return torch.remainder(v + 128, 256) - 128
