"""llama.cpp's own quantizers for GGML's integer types (ggml-quants.c: `quantize_row_*_ref`, what `llama-quantize`
runs without an importance matrix, and `quantize_row_*_impl`, what it runs with one), vectorized over blocks and
bit-exact: the same bytes.

A K-quant chooses its grid in two levels. Each sub-block of 16 or 32 weights gets a float scale (and, for the
asymmetric types, a min) from a small search; then the super-block of 256 stores those as integers on a grid of
their own: d = max scale / 63 (6 bits; Q2_K: 15, 4 bits; Q3_K: signed, -32..31; Q6_K: int8, -128..127) in f16,
sc_j = round(scale_j / d). Only then are the weights rounded, on the grid the file stores:

    Q2_K / Q4_K / Q5_K   q = clamp(round((x + dmin * m_j) / (d * sc_j)), 0, 2^b - 1)      x ~ d sc_j q - dmin m_j
    Q3_K / Q6_K          q = clamp(round(x / (d * sc_j)), -2^(b-1), 2^(b-1) - 1)         x ~ d sc_j q

The sub-block searches (make_qkx2_quants: asymmetric, a weighted least-squares fit of scale and min over 16 or 21
trial grids; make_qx_quants: symmetric, 18 trial scales, weights x^2; make_q3_quants: symmetric, coordinate
descent on the codes) are followed line by line. With an importance matrix (llama-imatrix's mean x_j^2 per input
column j) every search weighs a weight's error by imp_j sqrt(sigma2 + x^2) instead, searches longer (37 trial
grids), and the super-block's integer scales and mins are fitted by weighted error (make_qp_quants) rather than
set from the largest. Being bit-exact needs float32 arithmetic in C's order: every sum
is accumulated element by element (`c_sum`), constants are float32, round() is nearest-even as nearest_int is.
(C's truncating casts and roundf differ from nearest-even: the 32-blocks use them, and so does this file.)

`quantize(type_name, weight, importance=None)` returns the codes and the stored fields that ggml.encode /
ggml.encode_k / ggml.encode_iq4 turn into blocks (IQ4_NL / IQ4_XS: iq4.py's quantizer); `FALLBACK` is llama.cpp's
type for a row that is not a multiple of its block (llama-quant.cpp).
"""
import torch

from .c_float import EPS, F32, c_sum, first_of, positive_max, rdiv, round_f16, signed_absmax, sqrtf, to_int8, to_uint8
from . import iq4
from .ggml import GGML_TYPES, INTEGER, IQ4, K_QUANTS, QK_K, encode, encode_iq4, encode_k

FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


# ---- the sub-block searches ---------------------------------------------------------------------------------

def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """x, w [n, k] -> (scale [n], the_min [n], L [n, k]): the asymmetric grid x ~ scale * L - the_min, L in
    0..nmax, whose weighted error (|.| if use_mad, else squared) is lowest over the first try and nstep + 1 trial
    ranges (rmin + rdelta * is + nmax steps across [min, max]), each refit by weighted least squares."""
    lo, hi = first_of(x, torch.argmin), first_of(x, torch.argmax)
    lo = torch.where(lo > 0, torch.zeros(()), lo)
    sum_w, sum_x = c_sum(torch.stack([w, w * x]))
    flat = hi == lo

    def codes(iscale, low):
        return (iscale * (x - low[:, None])).round().clamp(0, nmax)

    def error(scale, low, L):
        diff = scale[:, None] * L + low[:, None] - x
        return c_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = rdiv(nmax, hi - lo)
    scale = rdiv(1, iscale)
    L = codes(iscale[:, None], lo)
    best, low = error(scale, lo, L), lo
    for step in range(nstep + 1):
        # as in C, each trial spans [the best min so far, max]: min moves when a trial wins
        Laux = codes(rdiv(F32(rmin) + F32(rdelta) * F32(step) + F32(nmax), hi - low)[:, None], low)
        wl = w * Laux
        sum_l, sum_l2, sum_xl = c_sum(torch.stack([wl, wl * Laux, wl * x]))
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        this_min = torch.where(positive, torch.zeros(()), this_min)
        cur = error(this_scale, this_min, Laux)
        better = (D > 0) & (cur < best)
        L = torch.where(better[:, None], Laux, L)
        best = torch.where(better, cur, best)
        scale, low = torch.where(better, this_scale, scale), torch.where(better, this_min, low)
    return (torch.where(flat, torch.zeros(()), scale), -torch.where(flat, lo, low),
            torch.where(flat[:, None], torch.zeros(()), L))


def make_qx_quants(x, nmax, w=None):
    """x [n, k] -> (scale [n], L [n, k] in 0..2 nmax - 1): the symmetric grid x ~ scale * (L - nmax), the best of
    19 trial scales by weighted least squares (rmse_type 1: weights w [n, k], or x^2 without an importance matrix)."""
    amax, vmax = signed_absmax(x)
    w = x * x if w is None else w

    def trial(iscale):
        l = (iscale[:, None] * x).round().clamp(-nmax, nmax - 1)
        return l, *c_sum(torch.stack([w * x * l, w * l * l]))

    l, sumlx, suml2 = trial(rdiv(-nmax, vmax))
    L = l + nmax
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros(()))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        l, sumlx, suml2 = trial(rdiv(-(F32(nmax) + F32(0.1) * F32(step)), vmax))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better[:, None], l + nmax, L)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    zero = amax < EPS
    return torch.where(zero, torch.zeros(()), scale), torch.where(zero[:, None], torch.zeros(()), L)


def make_q3_quants(x, nmax):
    """x [n, k] -> (scale [n], L [n, k] in 0..2 nmax - 1): the symmetric grid x ~ scale * (L - nmax) from
    round-to-nearest at scale max / -nmax, then up to 5 passes of coordinate descent on each code (x^2 weights)."""
    amax, vmax = signed_absmax(x)
    L = (rdiv(-nmax, vmax)[:, None] * x).round().clamp(-nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = c_sum(torch.stack([w * x * L, w * L * L]))
    for _ in range(5):                                 # a pass that changes nothing leaves the next one nothing to do
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = (xi * sl2 / slx).round().clamp(-nmax, nmax - 1)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = (slx > 0) & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx2, sumlx), torch.where(take, sl22, suml2)
    zero = amax < EPS
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros(()))
    return torch.where(zero, torch.zeros(()), scale), torch.where(zero[:, None], torch.zeros(()), L + nmax)


def make_qp_quants(x, nmax, w):
    """x, w [n, k], x >= 0 -> (scale [n], L [n, k] in 0..nmax): the grid x ~ scale * L through 0 (a super-block's
    sub-block scales or mins under an importance matrix), the best of 9 trial scales by w-weighted error, then up to
    5 passes of coordinate descent on each code."""
    top = positive_max(x)
    iscale = rdiv(nmax, top)
    L = to_uint8((iscale[:, None] * x).round())
    scale = rdiv(1, iscale)
    diff = x - scale[:, None] * L
    best = c_sum(w * diff * diff)
    for step in (*range(-4, 0), *range(1, 5)):
        trial = (F32(0.1) * F32(step) + F32(nmax)) / top
        diff = x - rdiv(1, trial)[:, None] * (trial[:, None] * x).round().clamp(max=nmax)
        mse = c_sum(w * diff * diff)
        better = mse < best
        best, iscale = torch.where(better, mse, best), torch.where(better, trial, iscale)
    L = to_uint8((iscale[:, None] * x).round().clamp(max=nmax))
    sumlx, suml2 = c_sum(torch.stack([w * x * L, w * L * L]))
    for _ in range(5):
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = (xi * sl2 / slx).round().clamp(max=nmax)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = (slx > 0) & (sl2 > 0) & (new != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx2, sumlx), torch.where(take, sl22, suml2)
    zero = top < EPS
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros(()))
    return torch.where(zero, torch.zeros(()), scale), torch.where(zero[:, None], torch.zeros(()), L)


# ---- the super-blocks: x [blocks, 256] -> (codes [blocks, 256], fields) ------------------------------------------

def _round_codes(x, d, L, lo, hi, dm=None):
    """The codes on the stored grid, sub-block step d [blocks, subs] (0: keep L, as C skips those sub-blocks):
    asymmetric (dm given) round((x + dm) / d), symmetric round(x / d) - lo; clamped to 0..hi - lo."""
    xs = x.reshape(*d.shape, -1)
    v = (xs + dm[..., None]) / d[..., None] if dm is not None else xs / d[..., None]
    q = v.round().clamp(lo, hi) - lo
    return torch.where((d == 0)[..., None], L.reshape(xs.shape), q).reshape(x.shape)


def _k_asym(x, sub, nmax, scale_bits, rmin, rdelta, nstep, weights):
    """Q2_K / Q4_K / Q5_K: sub-blocks of `sub` from make_qkx2_quants, their scales and mins on a grid of
    scale_bits-bit integers times the super-block's f16 d and dmin."""
    n = len(x)
    xs = x.reshape(-1, sub)
    scales, mins, L = make_qkx2_quants(xs, weights(xs), nmax, rmin, rdelta, nstep, use_mad=scale_bits == 4)
    scales, mins = scales.reshape(n, -1), mins.reshape(n, -1)
    top = F32(2 ** scale_bits - 1)
    max_scale, max_min = positive_max(scales), positive_max(mins)
    inv_scale = torch.where(max_scale > 0, rdiv(top, max_scale), torch.zeros(()))
    inv_min = torch.where(max_min > 0, rdiv(top, max_min), torch.zeros(()))
    sc = to_uint8((inv_scale[:, None] * scales).round())
    m = (inv_min[:, None] * mins).round()
    m = to_uint8(m) if scale_bits == 6 else m
    if scale_bits == 6:
        sc, m = sc.clamp(max=63), m.clamp(max=63)
    else:                                              # Q2_K: one byte, sc | m << 4, as C stores it
        byte = (sc.long() | (m.long() << 4)) & 255
        sc, m = (byte & 15).float(), (byte >> 4).float()
    d, dmin = round_f16(max_scale / top), round_f16(max_min / top)
    codes = _round_codes(x, d[:, None] * sc, L, 0, nmax, dmin[:, None] * m)
    return codes, dict(d=d, dmin=dmin, sc=sc, m=m)


def _av_plus_abs(xs):
    """Q4_K / Q5_K's weights: sqrt(mean x^2) + |x|."""
    return sqrtf(c_sum(xs * xs) / F32(xs.shape[1]))[:, None] + xs.abs()


def _quantize_q2_k(x):
    return _k_asym(x, 16, 3, 4, -0.5, 0.1, 15, torch.abs)


def _quantize_q4_k(x):
    return _k_asym(x, 32, 15, 6, -1.0, 0.1, 20, _av_plus_abs)


def _quantize_q5_k(x):
    return _k_asym(x, 32, 31, 6, -0.5, 0.1, 15, _av_plus_abs)


def _k_sym(x, search, nmax, top, *weights):
    """Q3_K / Q6_K: sub-blocks of 16 with symmetric scales from `search`, and the super-block's inverse step
    iscale = -top / (the sub-block scale of largest magnitude) -> (scales [n, 16], L, amax, iscale)."""
    scales, L = search(x.reshape(-1, 16), nmax, *weights)
    scales = scales.reshape(len(x), 16)
    amax, max_scale = signed_absmax(scales)
    return scales, L, amax, rdiv(-top, max_scale)


def _quantize_q3_k(x):
    scales, L, amax, iscale = _k_sym(x, make_q3_quants, 4, 32)
    sc = to_int8((iscale[:, None] * scales).round()).clamp(-32, 31) + 32
    nonzero = amax != 0
    sc = torch.where(nonzero[:, None], sc, torch.zeros(()))      # C leaves the scale bytes 0: sc - 32 = -32, d = 0
    d = torch.where(nonzero, round_f16(rdiv(1, iscale)), torch.zeros(()))
    return _round_codes(x, d[:, None] * (sc - 32), L, -4, 3), dict(d=d, sc=sc)


def _quantize_q6_k(x, qw=None):
    """(With an importance matrix qw the sub-block scales weigh the error by qw itself, as llama.cpp does.)"""
    scales, L, amax, iscale = _k_sym(x, make_qx_quants, 32, 128, *([] if qw is None else [qw.reshape(-1, 16)]))
    sc = to_int8((iscale[:, None] * scales).round().clamp(max=127))
    d = round_f16(rdiv(1, iscale))
    codes = _round_codes(x, d[:, None] * sc, L, -32, 31)
    zero = amax < EPS                                        # C zeroes the whole block
    return (torch.where(zero[:, None], torch.zeros(()), codes),
            dict(d=torch.where(zero, torch.zeros(()), d), sc=torch.where(zero[:, None], torch.zeros(()), sc)))


# ---- the 32-blocks: x [blocks, 32] -> (codes, fields) ----------------------------------------------------------

def _inverse(d):
    return torch.where(d != 0, rdiv(1, d), torch.zeros(()))


def _quantize_q4_0(x):
    _, vmax = signed_absmax(x)
    d = vmax / F32(-8)
    return (x * _inverse(d)[:, None] + F32(8.5)).trunc().clamp(max=15), dict(d=round_f16(d))


def _quantize_q5_0(x):
    _, vmax = signed_absmax(x)
    d = vmax / F32(-16)
    return (x * _inverse(d)[:, None] + F32(16.5)).trunc().clamp(max=31), dict(d=round_f16(d))


def _quantize_q4_1(x, top=15):
    lo, hi = first_of(x, torch.argmin), first_of(x, torch.argmax)
    d = (hi - lo) / F32(top)
    q = ((x - lo[:, None]) * _inverse(d)[:, None] + F32(0.5)).trunc()
    return (q.clamp(max=top) if top == 15 else q % 32), dict(d=round_f16(d), m=round_f16(lo))   # Q5_1 keeps 5 bits


def _quantize_q5_1(x):
    return _quantize_q4_1(x, 31)


def _quantize_q8_0(x):
    d = x.abs().amax(1) / F32(127)
    v = x * _inverse(d)[:, None]
    q = v.round()
    tie = (v - v.trunc()).abs() == 0.5                       # roundf: ties away from zero
    q = torch.where(tie, v.trunc() + v.sign(), q)
    return q + 128, dict(d=round_f16(d))


QUANTIZERS = {"Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1, "Q5_0": _quantize_q5_0, "Q5_1": _quantize_q5_1,
              "Q8_0": _quantize_q8_0, "Q2_K": _quantize_q2_k, "Q3_K": _quantize_q3_k, "Q4_K": _quantize_q4_k,
              "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


# ---- with an importance matrix (quantize_row_*_impl: what `llama-quantize --imatrix` runs) ---------------------
# qw [blocks, block]: each weight's input column's importance (llama-imatrix: the mean x^2 of that column over
# calibration text; GPTQ's Hessian diagonal is the same up to a factor, which no search below sees). Every search
# weighs a weight's error by qw sqrt(sigma2 + x^2); the super-block's integer scales and mins are then fitted by the
# sub-blocks' summed weights (make_qp_quants) instead of set from the largest one.

def _importance(x, qw, sigma2):
    return qw * sqrtf(sigma2 + x * x)


def _super_sigma2(x, factor, sub):
    """x [super-blocks, 256] -> sigma2 per sub-block [super-blocks * 256 / sub, 1]: factor * mean x^2."""
    return (F32(factor) * c_sum(x * x) / F32(QK_K)).repeat_interleave(QK_K // sub)[:, None]


def _k_asym_imatrix(x, qw, sub, nmax, top, factor):
    """Q2_K / Q4_K / Q5_K: make_qkx3_quants per sub-block (make_qkx2_quants' search, 37 trial ranges, squared
    error), then the scales and the mins each on their own make_qp_quants grid."""
    n, xs = len(x), x.reshape(-1, sub)
    w = _importance(xs, qw.reshape(-1, sub), _super_sigma2(x, factor, sub))
    scales, mins, L = make_qkx2_quants(xs, w, nmax, -0.9, 0.05, 36, use_mad=False)
    sw = c_sum(w).reshape(n, -1)
    d, sc = make_qp_quants(scales.reshape(n, -1), top, sw)
    dmin, m = make_qp_quants(mins.reshape(n, -1), top, sw)
    d, dmin = round_f16(d), round_f16(dmin)
    return _round_codes(x, d[:, None] * sc, L, 0, nmax, dmin[:, None] * m), dict(d=d, dmin=dmin, sc=sc, m=m)


def _q3_k_imatrix(x, qw):
    """make_qx_quants per sub-block, then the 16 scales on a signed 6-bit grid by make_qx_quants again."""
    xs = x.reshape(-1, 16)
    w = _importance(xs, qw.reshape(-1, 16), _super_sigma2(x, 2, 16))
    scales, L = make_qx_quants(xs, 4, w)
    d, sc = make_qx_quants(scales.reshape(len(x), 16), 32, c_sum(w).reshape(len(x), 16))
    d = round_f16(d)
    return _round_codes(x, d[:, None] * (sc - 32), L, -4, 3), dict(d=d, sc=sc)


def _sym_imatrix(nmax):
    """Q4_0 / Q5_0: make_qx_quants' weighted search; the codes are those of the float scale, stored in f16."""
    def quantizer(x, qw, sigma2):
        scale, L = make_qx_quants(x, nmax, _importance(x, qw, sigma2))
        return L, dict(d=round_f16(scale))
    return quantizer


def _asym_imatrix(nmax):
    """Q4_1 / Q5_1: make_qkx3_quants' weighted scale and min."""
    def quantizer(x, qw, sigma2):
        scale, the_min, L = make_qkx2_quants(x, _importance(x, qw, sigma2), nmax, -0.9, 0.05, 36, use_mad=False)
        return L, dict(d=round_f16(scale), m=round_f16(-the_min))
    return quantizer


IMATRIX = {"Q4_0": _sym_imatrix(8), "Q5_0": _sym_imatrix(16), "Q4_1": _asym_imatrix(15), "Q5_1": _asym_imatrix(31),
           "Q2_K": lambda x, qw: _k_asym_imatrix(x, qw, 16, 3, 15, 1),
           "Q3_K": _q3_k_imatrix,
           "Q4_K": lambda x, qw: _k_asym_imatrix(x, qw, 32, 15, 63, 2),
           "Q5_K": lambda x, qw: _k_asym_imatrix(x, qw, 32, 31, 63, 2),
           "Q6_K": _quantize_q6_k}


def check_type(type_name, in_features):
    """ValueError unless llama.cpp's quantizer for `type_name` takes rows of in_features."""
    if type_name not in QUANTIZERS and type_name not in IQ4:
        raise ValueError(f"GGML type {type_name!r}: the engine quantizes to {', '.join(INTEGER + IQ4)}")
    block = GGML_TYPES[type_name][1]
    if in_features % block:
        hint = f" (llama.cpp falls back to {FALLBACK[type_name]})" if type_name in FALLBACK else ""
        raise ValueError(f"{type_name} needs rows of a multiple of {block} weights, got {in_features}{hint}")


def check_importance(importance, in_features):
    """ValueError unless importance is [in_features] finite, non-negative numbers."""
    if not isinstance(importance, torch.Tensor) or importance.shape != (in_features,):
        shape = tuple(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"an importance matrix row must have shape ({in_features},), got {shape}")
    if not torch.isfinite(importance).all() or (importance < 0).any():
        raise ValueError("an importance matrix must be finite and non-negative")
    return importance.float()


@torch.no_grad()
def quantize(type_name, weight, importance=None):
    """weight [out, in] -> (codes uint8 [out, in], fields): llama.cpp's quantizer, the fields being what
    `blocks(type_name, codes, fields)` stores: d (and m / dmin, sc) per block. importance [in] (None: none) is the
    importance matrix's entry for this weight: without one, llama-quantize's round-to-nearest (quantize_row_*_ref);
    with one, the grid `llama-quantize --imatrix` writes (Q8_0 has no such search and ignores it, as llama.cpp does)."""
    check_type(type_name, weight.shape[1])
    block = GGML_TYPES[type_name][1]
    w = weight.detach().float()
    x = w.reshape(-1, block).contiguous()
    if type_name in IQ4:
        imp = None if importance is None else check_importance(importance, w.shape[1])
        return iq4.quantize(type_name, w, imp)
    if importance is None or type_name == "Q8_0":
        codes, fields = QUANTIZERS[type_name](x)
    else:
        qw = check_importance(importance, w.shape[1]).expand(w.shape).reshape(-1, block)
        if block == QK_K:
            codes, fields = IMATRIX[type_name](x, qw)
        else:                                                # sigma2: the mean x^2 of the whole row
            sigma2 = (c_sum(w * w) / F32(w.shape[1])).repeat_interleave(w.shape[1] // block)[:, None]
            codes, fields = IMATRIX[type_name](x, qw, sigma2)
    return codes.reshape(weight.shape).to(torch.uint8), fields


def blocks(type_name, codes, fields):
    """codes [out, in] + fields (from quantize) -> raw uint8 [out, row bytes] of GGML blocks."""
    if type_name in IQ4:
        raw = encode_iq4(type_name, codes, fields["d"], fields.get("l"))
    elif type_name in K_QUANTS:
        raw = encode_k(type_name, codes, fields["d"], fields["sc"], fields.get("dmin"), fields.get("m"))
    else:
        raw = encode(type_name, codes, fields["d"], fields.get("m"))
    return raw.reshape(codes.shape[0], -1)
