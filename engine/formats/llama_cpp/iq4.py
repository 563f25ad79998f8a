"""llama.cpp's quantizer for its 4-bit non-uniform types IQ4_NL and IQ4_XS (ggml-quants.c:
quantize_row_iq4_nl_impl with ntry = 7, what `llama-quantize` runs, with or without an importance matrix), vectorized
over blocks and bit-exact. The levels K = kvalues_iq4nl and the blocks: ggml.py.

Per block of 32 weights x, with error weights e_j = x_j^2, or imp_j sqrt(sigma2 + x_j^2) with an importance matrix
(sigma2 = 2 mean x^2 over the block, IQ4_XS: over the super-block of 256):

    m = the x_j of largest magnitude;  d = m / 127;  q_j = the level nearest x_j / d;  d = sum e K[q] x / sum e K[q]^2
    for t in -7 .. 7:  the same fit at 1 / d = (t - 127) / m (a negative d mirrors the asymmetric levels),
                       kept where (sum e K x)^2 / sum e K^2 is larger

IQ4_NL stores f16(d) and picks the codes again at 1 / d. IQ4_XS puts a super-block's eight d_j on a signed 6-bit grid:
D = -d_max / 32 (d_max the d_j of largest magnitude), l_j = clamp(round(d_j / D), -32, 31), stores f16(D) and
l_j + 32, and picks the codes again at 1 / (D l_j), the float D, not its f16. (quantize_row_iq4_nl_ref, ntry = -1,
is ggml's from-float for activations: not what a file holds, not ported.)
"""
import torch

from .c_float import EPS, F32, c_sum, rdiv, signed_absmax, sqrtf
from .ggml import GGML_TYPES, IQ4, IQ4_LEVELS, IQ4_ZERO

K = IQ4_LEVELS.float()
NTRY = 7


def best_index(x):
    """best_index_int8 over K: x float32 [...] -> the index of the nearest level [...] (a tie goes up), as C."""
    mu = torch.searchsorted(K, x.contiguous(), right=True).clamp(1, 15)
    lo, hi = K[mu - 1], K[mu]
    q = torch.where(x - lo < hi - x, mu - 1, mu)
    return torch.where(x <= K[0], 0, torch.where(x >= K[15], 15, q))


def reciprocal(t):
    """C's `d ? 1/d : 0.f`."""
    nonzero = t != 0
    return torch.where(nonzero, rdiv(1, torch.where(nonzero, t, 1)), 0)


def _fit(x, e, inv):
    """x, e [n, 32], inv [n, 1] -> (sum e K x, sum e K^2) [n] of the levels nearest inv * x."""
    level = K[best_index(inv * x)]
    eq = e * level
    sums = c_sum(torch.stack([eq * x, eq * level]))
    return sums[0], sums[1]


def block_scales(x, e):
    """The search of one block of 32: x, e [n, 32] -> d [n] (0 for a block whose largest |x| is below EPS)."""
    amax, m = signed_absmax(x)
    empty = amax < EPS
    sqx, sq2 = _fit(x, e, reciprocal(m / torch.full_like(m, 127.0))[:, None])          # d = -m / K[0]
    d = torch.where(sq2 > 0, sqx / sq2, 0)
    best = d * sqx
    for t in range(-NTRY, NTRY + 1):
        sqx, sq2 = _fit(x, e, rdiv(t - 127, torch.where(empty, 1, m))[:, None])            # 1/d = (t + K[0]) / m
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = torch.where(better, sqx / sq2, d)
        best = torch.where(better, d * sqx, best)
    return torch.where(empty, 0, d)


@torch.no_grad()
def quantize(type_name, weight, importance=None):
    """weight [out, in] -> (codes uint8 [out, in], fields): llama-quantize's IQ4_NL / IQ4_XS blocks as the engine's
    codes K[q] + 128 and the fields ggml.encode_iq4 stores: d [blocks] (f16 values), for IQ4_XS also l [blocks, 8]
    (0..63). importance [in]: the --imatrix entry of this weight (checked by the caller), or None."""
    if type_name not in IQ4:
        raise ValueError(f"GGML type {type_name!r} is not one of {', '.join(IQ4)}")
    sb = GGML_TYPES[type_name][1]
    x = weight.detach().float().reshape(-1, sb)
    if importance is None:
        e = x * x
    else:
        qw = importance.float().expand(weight.shape).reshape(-1, sb)
        e = qw * sqrtf(c_sum(x * x)[:, None] * F32(2 / sb) + x * x)
    xb = x.reshape(-1, 32)
    d = block_scales(xb, e.reshape(-1, 32))
    if type_name == "IQ4_NL":
        q, fields = best_index(reciprocal(d)[:, None] * xb), {"d": d.half().float()}
    else:
        d = d.reshape(-1, sb // 32)
        D = -signed_absmax(d)[1] / F32(32)
        l_j = (reciprocal(D)[:, None] * d).round().clamp(-32, 31)
        q = best_index(reciprocal(D[:, None] * l_j).reshape(-1, 1) * xb)
        fields = {"d": D.half().float(), "l": (l_j + 32).to(torch.uint8)}
    return (K[q] + IQ4_ZERO).to(torch.uint8).reshape(weight.shape), fields
