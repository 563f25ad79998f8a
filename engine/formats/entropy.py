"""EntQuant: Float8 weights pushed towards low entropy, stored with an rANS coder, decoded block by block.

Quantization (per linear, data-free). One scale per output channel, kept as its log2 s [out]:

    Q     = E4M3(clamp(W * 2^-s, -448, 448))           (Int8: round, clamp to +-127)
    W_hat = Q * 2^s
    loss  = ||W_hat - W||_1 / ||W||_1 + lambda * R(Q),  R = 4 * mean|Q| (Float8)  or  mean|Q| / 128 (Int8)

The l1 norm of Q is a differentiable stand-in for its entropy: shrinking it pushes weights into E4M3's subnormal
range, where the grid is uniform and coarse, so fewer distinct byte values occur. Gradients reach s through a
straight-through estimator (the cast and the clamp count as identity); torch.optim.LBFGS with a strong-Wolfe line
search minimizes over s, one layer at a time. s is rounded to float16 (what we store) before the final cast.
Int8 keeps a handful of "super weights" (the largest magnitudes) exact beside the codes.

Coding. The E4M3 bytes (-0 mapped to +0) of all quantized linears of one transformer block form one symbol
stream, coded with rANS against a static frequency table f (sum 2^15, every present symbol >= 1):

    encode  x' = (x // f[s]) * 2^15 + x % f[s] + c[s]        (c = cumulative f; x kept in [2^16, 2^32))
    decode  slot = x mod 2^15, s = sym(slot), x = f[s] * (x >> 15) + slot - c[s]

When x leaves its interval a 16-bit word moves between state and stream, at most one per symbol. Symbol i goes to
lane i mod K, so K lanes decode K consecutive symbols per step in lockstep; lanes are grouped W at a time into
sub-streams, each with its own word stream (a start offset), so a GPU program decodes one sub-stream and its W lanes
find their read positions with a prefix sum. Rate: n * H plus about 3 bytes per lane plus the table; the default K
grows with n (n / K >= 3072) so that the overhead stays under 1% for blocks of >= 1M symbols at >= 2 bits.

Runtime. The model keeps only each block's stream; one decode buffer (uint8, the largest block) is shared by all
blocks, and a forward pre-hook on every transformer layer decodes that block into it just before the layer runs.
The matmul reads the buffer's E4M3 (or int8) bytes and applies 2^s per output channel.

Sensitivity (our addition, optional: sensitivity="fisher"). The paper's loss treats every weight alike, so every
layer ends up near the same rate. What the model's output loses is, to second order and keeping only the diagonal F
of the Fisher information, a weighted squared error: KL(p || p_hat) ~ 1/2 sum_ij F_ij (W_hat - W)_ij^2. We estimate
F on sequences the model samples itself (labels drawn from its own predictions: still no calibration text), average
it over each output row (phi_j, one number per scale) and replace the reconstruction term by

    sum_j phi_j ||W_hat_j - W_j||^2 / (K * n_layer),     K = sum_rows phi_j ||W_j||^2 / n_model

(K makes it a relative error across the whole model, so one lambda trades rate against the estimated KL in every
layer alike: sensitive layers and rows get finer steps, robust ones coarser). Measured on the tiny model at ~2.1 bits
per weight: KL 0.0043 against 0.0078 with the paper's loss (RTN int2 g64: 0.0235).

Rate control. lambda -> bits per weight is close to log-linear (the paper: nearly model-independent); the table
measured on the tiny model ships in data/entquant_lambda_bpw.json and seeds a bracketing search on lambda that
meets a bpw target (measured: coded bytes of everything, scales included) within +-0.05.

NF4 (QLoRA's NormalFloat4, absmax per 64 in float16) sits at the end as the data-free baseline.
"""
import functools
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..kernels import stream_decoders, triton_formats
from .affine import grouped, pack_bits, unpack_bits
from .base import CheckpointMethod, QuantLinear, get_impl, replace_linears
from .minifloats import E4M3_MAX, round_e4m3

PROB_BITS = 15                      # frequency table precision: sum of f = 2^15
STATE_LOW = 1 << 16                 # x lives in [2^16, 2^32): one 16-bit word per renormalization
LANES_PER_STREAM = 32
MIN_STEPS = 3072                    # symbols per lane at least, so that states cost < 1% (see module docstring)
MAX_LANES = 4096
ONE_SYMBOL_LIMIT = 1 << 32          # a one-symbol stream's count is trusted up to here (its words bound nothing)
DECODE_CHUNK = 1 << 15              # CPU decode: symbols per batch of deferred symbol lookups
_MAGIC = b"rANS"
_HEADER = struct.Struct("<4sBBHQI")  # magic, version, prob_bits, lanes per stream, n, sub-streams


# ---- frequency table --------------------------------------------------------------------------------------------

def empirical_entropy_bits(symbols):
    """n * H(empirical distribution) in bits: the floor any coder of these symbols (table not counted) meets."""
    counts = np.bincount(_as_numpy(symbols), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum() if counts.sum() else counts[:0]
    return float(-(counts[counts > 0] * np.log2(p)).sum())


def quantize_frequencies(counts, prob_bits=PROB_BITS):
    """counts [256] -> f [256] int64 with sum 2^prob_bits and f >= 1 wherever count > 0.

    Start from the floor of the scaled counts, then hand the leftover units to the largest fractional parts; if the
    minimum of 1 overshot, take units back where that costs the fewest bits (count * log2(f / (f - 1)))."""
    counts = np.asarray(counts, dtype=np.int64)
    total, m = int(counts.sum()), 1 << prob_bits
    if total == 0:
        return np.zeros(256, dtype=np.int64)
    exact = counts * m / total
    f = np.where(counts > 0, np.maximum(np.floor(exact), 1), 0).astype(np.int64)
    short = m - int(f.sum())
    if short > 0:
        f[np.argsort(-(exact - f))[:short]] += 1
    while short < 0:                                  # at most 255 rounds: each returns one unit
        cost = np.where(f > 1, counts * np.log2(np.maximum(f, 2) / np.maximum(f - 1, 1)), np.inf)
        f[np.argmin(cost)] -= 1
        short += 1
    return f


def _slot_tables(f, prob_bits):
    """Per slot of [0, 2^prob_bits): its symbol, that symbol's frequency and slot - c[symbol] (decode lookups)."""
    c = np.concatenate([[0], np.cumsum(f)[:-1]])
    sym = np.repeat(np.arange(256), f).astype(np.int64)
    return sym, f[sym], np.arange(1 << prob_bits) - c[sym]


# ---- the stream -------------------------------------------------------------------------------------------------

def _as_numpy(symbols):
    if isinstance(symbols, torch.Tensor):
        symbols = symbols.detach().cpu().numpy()
    symbols = np.asarray(symbols)
    if symbols.dtype != np.uint8:
        raise ValueError(f"symbols must be uint8, got {symbols.dtype}")
    return symbols.reshape(-1)


def default_lanes(n, lanes_per_stream=LANES_PER_STREAM):
    """K lanes for n symbols: a power of two, a multiple of lanes_per_stream, with n / K >= MIN_STEPS where n allows
    (never fewer than lanes_per_stream lanes)."""
    k = 1 << max(n // MIN_STEPS, 1).bit_length() - 1
    return int(min(max(k, lanes_per_stream), MAX_LANES))


def rans_encode(symbols, lanes=None, lanes_per_stream=LANES_PER_STREAM, prob_bits=PROB_BITS):
    """uint8 symbols [n] -> bytes: header, table (256-bit presence map + u16 f of present symbols), final states
    u32 [S, W], word counts u32 [S], words u16 (sub-stream by sub-stream, in the order the decoder reads them).

    Encoding runs backwards over the steps, all K = S * W lanes at once."""
    s_all = _as_numpy(symbols)
    n = s_all.size
    lanes = default_lanes(n, lanes_per_stream) if lanes is None else lanes
    if not 1 <= lanes_per_stream < 1 << 16 or lanes < 1 or lanes % lanes_per_stream or not 1 <= prob_bits <= 15:
        raise ValueError(f"lanes ({lanes}) must be a positive multiple of lanes_per_stream ({lanes_per_stream}, "
                         f"1..65535); prob_bits ({prob_bits}) in 1..15")
    f = quantize_frequencies(np.bincount(s_all, minlength=256), prob_bits)
    c = np.concatenate([[0], np.cumsum(f)[:-1]])
    x_max = f << (32 - prob_bits)                     # emit a word first when x >= x_max(s): then x' < 2^32
    steps = -(-n // lanes)
    x = np.full(lanes, STATE_LOW, dtype=np.int64)
    emitted, owners = [], []                          # per step (last first): words in lane order, their sub-stream
    for t in range(steps - 1, -1, -1):
        sym = s_all[t * lanes:(t + 1) * lanes].astype(np.int64)
        k = sym.size                                  # the last step may be partial: lanes [0, k) take part
        xs, fs = x[:k], f[sym]
        out = xs >= x_max[sym]
        emitted.append(xs[out] & 0xFFFF)
        owners.append(np.flatnonzero(out) // lanes_per_stream)
        xs = np.where(out, xs >> 16, xs)
        x[:k] = (xs // fs << prob_bits) + xs % fs + c[sym]
    words = np.concatenate(emitted[::-1]) if emitted else np.zeros(0, np.int64)
    owner = np.concatenate(owners[::-1]) if owners else np.zeros(0, np.int64)
    order = np.argsort(owner, kind="stable")          # group by sub-stream, keep the decoder's reading order
    n_streams = lanes // lanes_per_stream
    counts = np.bincount(owner, minlength=n_streams)
    present = f > 0
    return b"".join([
        _HEADER.pack(_MAGIC, 1, prob_bits, lanes_per_stream, n, n_streams),
        np.packbits(present, bitorder="little").tobytes(),
        f[present].astype("<u2").tobytes(),
        x.astype("<u4").tobytes(),
        counts.astype("<u4").tobytes(),
        words[order].astype("<u2").tobytes(),
    ])


class RansStream:
    """A parsed, size-checked stream: n, prob_bits, f [256], states [S, W] int64, starts [S + 1] (word offsets of the
    sub-streams), words [total] int64. Raises ValueError on anything malformed. A symbol can cost almost nothing, so
    the data's length does not bound n: pass the n you expect (a block knows its weight count) to bound the work."""

    def __init__(self, data, n=None):
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu().numpy().tobytes()
        data = bytes(data)
        if len(data) < _HEADER.size + 32:
            raise ValueError(f"rANS stream truncated: {len(data)} bytes is shorter than its header")
        magic, version, self.prob_bits, w, self.n, s = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != 1:
            raise ValueError("not an rANS stream (bad magic or version)")
        if not 1 <= self.prob_bits <= 15 or w == 0 or s == 0:
            raise ValueError(f"bad rANS header: prob_bits {self.prob_bits}, {w} lanes per stream, {s} streams")
        if n is not None and self.n != n:
            raise ValueError(f"rANS stream holds {self.n} symbols, expected {n}")
        pos = _HEADER.size
        present = np.unpackbits(np.frombuffer(data, np.uint8, 32, pos), bitorder="little").astype(bool)
        pos += 32
        n_sym = int(present.sum())
        need = pos + 2 * n_sym + 4 * s * w + 4 * s
        if len(data) < need:
            raise ValueError(f"rANS stream truncated: {len(data)} bytes, the tables alone need {need}")
        self.f = np.zeros(256, np.int64)
        self.f[present] = np.frombuffer(data, "<u2", n_sym, pos)
        pos += 2 * n_sym
        self.states = np.frombuffer(data, "<u4", s * w, pos).astype(np.int64).reshape(s, w)
        pos += 4 * s * w
        counts = np.frombuffer(data, "<u4", s, pos).astype(np.int64)
        pos += 4 * s
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        if len(data) != pos + 2 * int(self.starts[-1]):
            raise ValueError(f"rANS stream has {len(data)} bytes, its header promises {pos + 2 * self.starts[-1]}")
        self.words = np.frombuffer(data, "<u2", int(self.starts[-1]), pos).astype(np.int64)
        if self.n and (int(self.f.sum()) != 1 << self.prob_bits or (self.f[present] == 0).any()):
            raise ValueError("rANS frequency table does not sum to 2^prob_bits")
        if ((self.states < STATE_LOW) | (self.states >= 1 << 32)).any():
            raise ValueError("rANS start state out of range")
        # Every symbol costs at least log2(2^prob_bits / max f) bits and a lane's state holds at most 16 bits more
        # than its final value, so the words bound n (unless one symbol takes the whole table and costs nothing):
        # a corrupted count is refused here instead of starting a decode that would never end.
        top = int(self.f.max())
        if self.n and top < 1 << self.prob_bits:
            most = (16 * (len(self.words) + self.states.size)) / (self.prob_bits - math.log2(top)) + self.states.size
            if self.n > most:
                raise ValueError(f"rANS header claims {self.n} symbols, its {len(self.words)} words hold at most "
                                 f"{int(most)}")
        elif self.n > ONE_SYMBOL_LIMIT and n is None:
            raise ValueError(f"one-symbol rANS stream claims {self.n} symbols: its size cannot confirm that, pass the "
                             "n you expect")

    def tensors(self, device):
        """What the Triton decoder takes, as torch tensors on device: (states [S, W], starts [S + 1], words,
        slot symbol / frequency / bias tables [2^prob_bits])."""
        sym, f, bias = _slot_tables(self.f, self.prob_bits) if self.n else (np.zeros((3, 1 << self.prob_bits),
                                                                                      np.int64))
        arrays = (self.states, self.starts, self.words, sym.astype(np.uint8), f, bias)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)


def check_final(stream, x, read):
    """After decoding, every lane must be back at the encoder's start state and every sub-stream read exactly to its
    end; anything else means the stream was corrupted."""
    if (np.asarray(read) != np.diff(stream.starts)).any() or (np.asarray(x) != STATE_LOW).any():
        raise ValueError("rANS stream corrupted: final states or read positions do not match")


def rans_decode(data, n=None):
    """bytes (or a uint8 tensor, or a RansStream) from rans_encode -> torch.uint8 [n] (n: the count expected, checked
    against the header before any work). All lanes step in lockstep: a Python loop over the n / K steps, NumPy over
    the K = S * W lanes. At the default K of small blocks (256) each NumPy call costs more than its arithmetic, so a
    step is 12 calls on preallocated int64 buffers, every one with out=:

        z = F[slot] * x + D[slot] = (f * (x >> p) + slot - c) << 16   (F = f << 16-p, D folds the rest: no x >> p)
        need = z < STATE_LOW << 16;  x = need ? z | word : z >> 16     (z | word is y << 16 | word)

    The word indices come from one in-place accumulate over [ptr | need] per sub-stream, in a buffer whose columns
    run on from step to step, so last step's final index is this step's ptr without a copy. Slots are kept for a
    chunk of steps and turned into symbols with one lookup per chunk."""
    st = data if isinstance(data, RansStream) else RansStream(data, n)
    if n is not None and st.n != n:
        raise ValueError(f"rANS stream holds {st.n} symbols, expected {n}")
    n, (s_count, w_count) = st.n, st.states.shape
    lanes, shape = s_count * w_count, st.states.shape
    out = np.empty(n, dtype=np.uint8)
    if n == 0:
        check_final(st, st.states, np.zeros(s_count, np.int64))
        return torch.from_numpy(out)
    p = st.prob_bits
    sym_of, f_of, bias_of = _slot_tables(st.f, p)
    sym_of = sym_of.astype(np.uint8)
    F = f_of << (16 - p)
    D = ((bias_of << p) - f_of * np.arange(1 << p)) << (16 - p)     # may be negative; F[slot] * x + D[slot] is not
    words = st.words if len(st.words) else np.zeros(1, np.int64)
    x = st.states.copy()
    # 0-d arrays, not Python or NumPy scalars: a ufunc converts those on every call.
    mask, top, s16 = np.array((1 << p) - 1), np.array(STATE_LOW << 16), np.array(16)
    full = n // lanes
    rows = out[:full * lanes].reshape((full,) + shape)
    c = max(1, min(full, DECODE_CHUNK // lanes))
    slots = np.empty((c,) + shape, np.int64)
    a, z, w = (np.empty(shape, np.int64) for _ in range(3))
    need = np.empty(shape, bool)
    # rk[s]: the word index last read by sub-stream s, then per step W counts that the accumulate turns into indices.
    rk = np.empty((s_count, c * w_count + 1), np.int64)
    rk[:, 0] = st.starts[:-1] - 1
    plan = [(slots[j], rk[:, j * w_count:(j + 1) * w_count + 1], rk[:, j * w_count + 1:(j + 1) * w_count + 1])
            for j in range(c)]
    # Local names and positional arguments: at ~1 us per call, lookups and keyword parsing are a real share.
    band, mul, add, rsh, less, bor = np.bitwise_and, np.multiply, np.add, np.right_shift, np.less, np.bitwise_or
    acc, copyto, putmask = np.add.accumulate, np.copyto, np.putmask
    take_f, take_d, take_w = F.take, D.take, words.take       # positional args and mode 'clip': the cheapest take
    for t0 in range(0, full, c):
        t1 = min(t0 + c, full)
        for sl, block, idx in plan[:t1 - t0]:
            band(x, mask, sl)
            take_f(sl, None, a, 'clip')
            mul(a, x, z)
            take_d(sl, None, a, 'clip')
            add(z, a, z)
            rsh(z, s16, x)
            less(z, top, need)
            copyto(idx, need)
            acc(block, 1, None, block)
            take_w(idx, None, w, 'clip')            # 'clip': a corrupted stream reads a wrong word, check_final says so
            bor(z, w, z)
            putmask(x, need, z)
        sym_of.take(slots[:t1 - t0], None, rows[t0:t1], 'clip')
        rk[:, 0] = rk[:, (t1 - t0) * w_count]
    ptr = rk[:, :1].copy()
    k = n - full * lanes
    if k:                                           # last, partial step: lanes [0, k) take part
        active = (np.arange(lanes) < k).reshape(shape)
        sl = x & mask
        out[full * lanes:] = sym_of[sl].reshape(-1)[:k]
        z = F[sl] * x + D[sl]
        need = (z < top) & active
        rank = need.cumsum(1)
        x = np.where(active, np.where(need, z | words.take(ptr + rank, mode="clip"), z >> 16), x)
        ptr += rank[:, -1:]
    check_final(st, x, ptr[:, 0] + 1 - st.starts[:-1])
    return torch.from_numpy(out)


# ---- EntQuant: choosing the per-channel scales ------------------------------------------------------------------

FORMATS = {"float8": E4M3_MAX, "int8": 127.0}          # largest code magnitude


def _ste_codes(x, fmt):
    """Straight-through quantizer: forward = the stored code values, backward = identity (cast and clamp alike)."""
    if fmt == "float8":
        q = round_e4m3(x.detach())
    else:
        q = x.round().clamp(-127.0, 127.0)
    return x + (q - x).detach()


def entquant_scales(weight, lam, fmt="float8", max_iter=500, history=100, lr=1.0, keep=None, importance=None):
    """weight [out, in] -> log2 scales s [out] (float32 holding float16 values) minimizing
    ||Q 2^s - W||_1 / ||W||_1 + lam * R(Q) with L-BFGS (strong Wolfe). keep (bool [out, in], optional) marks
    weights stored exactly (Int8 super weights): they take no part in the loss. importance [out] (optional, from
    fisher_importance: phi_j / K) replaces the reconstruction term by sum_j importance_j ||W_hat_j - W_j||^2 / numel."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    w = weight.detach().float()
    if keep is not None:
        w = w.masked_fill(keep, 0.0)
    top = FORMATS[fmt]
    absmax = w.abs().amax(1).clamp(min=torch.finfo(torch.float16).tiny)
    s = torch.log2(absmax / top).requires_grad_()              # start: absmax scaling, every weight representable
    norm = w.abs().sum().clamp(min=1e-30)
    rate_weight = 4.0 if fmt == "float8" else 1.0 / 128
    if importance is not None:
        importance = torch.as_tensor(importance).detach().to(w.device, torch.float32)
        if importance.shape != (w.shape[0],) or not bool(torch.isfinite(importance).all() & (importance >= 0).all()):
            raise ValueError(f"importance must be {w.shape[0]} finite, non-negative numbers (one per output row)")
        importance = importance[:, None]

    def loss_fn():
        q = _ste_codes(w * torch.exp2(-s)[:, None], fmt)
        err = q * torch.exp2(s)[:, None] - w
        recon = (err.abs().sum() / norm if importance is None else (importance * err.square()).sum() / w.numel())
        return recon + lam * rate_weight * q.abs().mean()

    opt = torch.optim.LBFGS([s], lr=lr, max_iter=max_iter, history_size=history, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return s.detach().to(torch.float16).float()


def encode_weight(weight, log_scale, fmt="float8", keep=None):
    """weight [out, in] + log2 scales [out] -> codes uint8 [out, in] (E4M3 or int8 bytes; -0 stored as +0, so one
    symbol stands for zero). Weights marked in keep are coded as 0 (they are stored exactly beside)."""
    x = weight.detach().float() * torch.exp2(-log_scale.float())[:, None]
    if keep is not None:
        x = x.masked_fill(keep, 0.0)
    if fmt == "float8":
        codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    return x.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)


def decode_weight(codes, log_scale, fmt="float8"):
    """codes uint8 [out, in] + log2 scales [out] -> weight [out, in] float32 (super weights not included)."""
    values = codes.view(torch.float8_e4m3fn if fmt == "float8" else torch.int8).float()
    return values * torch.exp2(log_scale.float())[:, None]


def super_weight_mask(weight, count):
    """bool [out, in]: the `count` weights of largest magnitude (Int8's super weights, kept exact)."""
    keep = torch.zeros(weight.numel(), dtype=torch.bool)
    if count > 0:
        keep[weight.detach().abs().reshape(-1).topk(min(count, weight.numel())).indices] = True
    return keep.reshape(weight.shape)


# ---- data-free sensitivities: the diagonal Fisher information on the model's own samples -----------------------

def _vocab_and_device(model):
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError("the model needs cfg.vocab_size (an engine Qwen3) to sample its own text")
    return vocab, next(model.parameters()).device


@torch.no_grad()
def self_generated_ids(model, samples=64, seq_len=128, seed=0):
    """ids [samples, seq_len]: what the model writes itself (temperature 1, eval mode) after a uniformly random first
    token. No calibration text is read: this is the only input the Fisher estimate sees. Seeded on the model's
    device, so a run repeats on the same device."""
    if not (isinstance(samples, int) and isinstance(seq_len, int) and samples >= 1 and seq_len >= 2):
        raise ValueError(f"need integers samples >= 1 and seq_len >= 2, got {samples!r} and {seq_len!r}")
    vocab, device = _vocab_and_device(model)
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    try:
        model.eval()
        first = torch.randint(vocab, (samples, 1), generator=g, device=device)
        return model.generate(first, seq_len - 1, temperature=1.0, generator=g)
    finally:
        model.train(was_training)


def fisher_importance(model, names, ids, draws=4, batch_size=8, seed=0):
    """Per-output-row importance {name: [out]} of the listed linears: the diagonal Fisher information of their
    weights, F = E_x E_{y ~ p(.|x)} (d log p(y|x) / dW)^2, averaged over each row (phi_j), divided by
    K = sum_rows phi_j ||W_j||^2 / (weights of all listed linears). ids [batch, T]: the inputs x (self_generated_ids).

    Labels y are sampled from the model's own predictions (draws per batch, one forward pass and `draws` backward
    passes), so no text is needed. Summing the log-likelihood over the positions of a batch before squaring keeps
    the estimate of sum_positions F unbiased: given the inputs the labels are drawn independently and each position's
    score has mean zero, so the cross terms vanish in expectation. What is accumulated is that sum over positions
    and draws, not the mean F; the scale cancels in the division by K (a ratio: consistent, not unbiased)."""
    if not names or len(set(names)) != len(names):
        raise ValueError("fisher_importance needs a non-empty list of distinct linear names")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.numel() and not ids.is_floating_point()):
        raise ValueError(f"ids must be a non-empty [batch, T] integer tensor, got {getattr(ids, 'shape', ids)}")
    if draws < 1 or batch_size < 1:
        raise ValueError(f"draws ({draws}) and batch_size ({batch_size}) must be >= 1")
    if torch.is_inference_mode_enabled():
        raise ValueError("fisher_importance needs gradients: call it outside torch.inference_mode()")
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), torch.nn.Linear)]
    if missing:
        raise ValueError(f"fisher_importance: not linears of this model: {missing[:3]}")
    _, device = _vocab_and_device(model)
    weights = {n: modules[n].weight for n in names}
    acc = {n: torch.zeros(w.shape[0], device=w.device) for n, w in weights.items()}    # row sums of grad^2
    flags, was_training = {p: p.requires_grad for p in model.parameters()}, model.training
    g = torch.Generator(device=device).manual_seed(seed)
    try:
        model.eval()
        for p in flags:
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
        with torch.enable_grad():
            for batch in ids.to(device).split(batch_size):
                logits = model(batch).float().flatten(0, 1)
                probs = logits.detach().softmax(-1)
                for d in range(draws):
                    y = torch.multinomial(probs, 1, generator=g)[:, 0]
                    loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                    grads = torch.autograd.grad(loss, list(weights.values()), retain_graph=d + 1 < draws,
                                                allow_unused=True)          # an unused linear has Fisher 0
                    for n, grad in zip(weights, grads):
                        if grad is not None:
                            acc[n] += grad.float().square().sum(1)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)
    phi = {n: acc[n] / weights[n].shape[1] for n in weights}
    k = sum((phi[n] * weights[n].detach().float().square().sum(1)).sum() for n in weights)
    k = k / sum(w.numel() for w in weights.values())
    if not k > 0:
        raise ValueError("the Fisher estimate is zero: the model's predictions do not depend on these weights")
    return {n: (v / k).cpu() for n, v in phi.items()}


# ---- the layer and the per-model block decoder ------------------------------------------------------------------

class EntQuantLinear(QuantLinear):
    """One linear of an EntQuant block: log2 scales float16 [out], Int8 super weights (flat indices int32 [k],
    exact values float32 [k]; k = 0 for Float8) and, for the FIRST linear of its block only, the whole block's rANS
    stream (uint8 [bytes]; an empty tensor for the others). Its codes [out, in] are a view of the model's shared
    decode buffer, valid while its block is the one decoded there (`attach_decoder` links layer and buffer).

    storage_bits: 16 per scale + 64 per super weight + this layer's share of the block stream, split in proportion
    to the weight counts (the shares add up to the stream's exact size)."""

    def __init__(self, in_features, out_features, log_scale, fmt="float8", stream=None, super_index=None,
                 super_value=None, bias=None):
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
        if tuple(log_scale.shape) != (out_features,):
            raise ValueError(f"log_scale has shape {tuple(log_scale.shape)}, expected ({out_features},)")
        super().__init__(in_features, out_features, bias)
        self.fmt = fmt
        idx = torch.zeros(0, dtype=torch.int32) if super_index is None else super_index.to(torch.int32)
        val = torch.zeros(0) if super_value is None else super_value.float()
        if idx.shape != val.shape or (idx.numel() and (idx.min() < 0 or idx.max() >= in_features * out_features)):
            raise ValueError("super weights: indices and values must match and lie inside the weight")
        self.register_buffer("log_scale", log_scale.to(torch.float16).contiguous())
        self.register_buffer("stream", (torch.zeros(0, dtype=torch.uint8) if stream is None
                                        else stream.to(torch.uint8).reshape(-1).contiguous()))
        self.register_buffer("super_index", idx.contiguous())
        self.register_buffer("super_value", val.contiguous())
        self._decoder, self._block, self._offset, self._stream_bits = None, None, 0, None

    def codes(self):
        """The layer's codes uint8 [out, in], decoding its block first if the buffer holds another one."""
        if self._decoder is None:
            raise ValueError("EntQuantLinear is not attached to a block decoder: call "
                             "engine.formats.entropy.attach_decoder(model) after building or loading the model")
        buffer = self._decoder.decode(self._block)
        return buffer[self._offset:self._offset + self.out_features * self.in_features].view(
            self.out_features, self.in_features)

    def dequantize(self):
        w = decode_weight(self.codes(), self.log_scale, self.fmt)
        if self.super_index.numel():
            w.view(-1)[self.super_index.long()] = self.super_value
        return w

    def kernel_matmul(self, x2d):
        y = triton_formats.entquant_matmul(x2d, self.codes(), torch.exp2(self.log_scale.float()), self.fmt)
        if self.super_index.numel():                            # y[:, o] += x[:, i] * (w_super - 0): codes hold 0
            rows, cols = self.super_index.long() // self.in_features, self.super_index.long() % self.in_features
            y.index_add_(1, rows, x2d[:, cols] * self.super_value)
        return y

    def storage_bits(self):
        if self._stream_bits is None:
            raise ValueError("EntQuantLinear is not attached to a block decoder (its stream share is unknown)")
        return self._stream_bits + 16 * self.out_features + 64 * self.super_index.numel()

    def extra_repr(self):
        bits = "?" if self._stream_bits is None else f"{self.bits_per_weight:.3f}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, bits={bits}"


class BlockDecoder:
    """A model's decode machinery: the blocks' EntQuant layers (each block's stream sits in its first layer), ONE
    uint8 buffer sized to the largest block, and the index of the block it holds. decode(i) is what the forward
    pre-hook of transformer layer i calls. The Triton decoder runs under impl "engine", on a GPU or under the
    interpreter (a block's ~3072 lockstep steps take ~6 s there on 2 cores: all lanes in one program); the NumPy
    decoder under impl "torch" (tests pin the two decoders equal)."""

    def __init__(self, blocks):
        self.blocks = blocks                                    # {block index: [EntQuantLinear, ...]}
        self.sizes = {i: sum(m.in_features * m.out_features for m in layers) for i, layers in blocks.items()}
        self.parsed, self.on_device = {}, {}                  # parsed streams; their tensors per device
        self.buffer, self.current = None, None

    def decode(self, index):
        """Make the buffer hold block `index`; returns the buffer (uint8 [largest block])."""
        head = self.blocks[index][0]
        if self.buffer is None or self.buffer.device != head.stream.device:
            self.buffer = torch.empty(max(self.sizes.values()), dtype=torch.uint8, device=head.stream.device)
            self.current = None
        if self.current != index:
            self.current = None                                 # a failed decode leaves no block marked valid
            if index not in self.parsed:
                self.parsed[index] = RansStream(head.stream, self.sizes[index])
            stream, out = self.parsed[index], self.buffer[:self.sizes[index]]
            if get_impl() == "engine":
                if (index, out.device) not in self.on_device:
                    self.on_device[index, out.device] = stream.tensors(out.device)
                stream_decoders.rans_decode(*self.on_device[index, out.device], out, stream.prob_bits)
            else:
                out.copy_(rans_decode(stream))
            self.current = index
        return self.buffer

    def pre_hook(self, index, module, args):
        self.decode(index)

    def resident_bytes(self):
        """(compressed bytes: streams + scales + super weights, decode buffer bytes)."""
        layers = [m for ms in self.blocks.values() for m in ms]
        packed = sum(m.stream.numel() + 2 * m.log_scale.numel() + 8 * m.super_index.numel() for m in layers)
        return packed, max(self.sizes.values())


def _blocks_of(model):
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("EntQuant decodes per transformer block: the model needs model.model.layers")
    return model.model.layers


def attach_decoder(model):
    """Link every EntQuantLinear to one shared BlockDecoder and put a forward pre-hook on each transformer layer
    that has them. Called after quantizing and after loading a checkpoint; calling it again replaces the old
    decoder. Returns the decoder."""
    blocks, seen = {}, set()
    for i, block in enumerate(_blocks_of(model)):
        layers = [m for m in block.modules() if isinstance(m, EntQuantLinear)]
        seen.update(map(id, layers))
        if not layers:
            continue
        if layers[0].stream.numel() == 0 or any(m.stream.numel() for m in layers[1:]):
            raise ValueError(f"block {i}: the block stream must sit in its first EntQuant layer, and only there")
        RansStream(layers[0].stream, n=sum(m.in_features * m.out_features for m in layers))   # ValueError if not
        blocks[i] = layers
    strays = [n for n, m in model.named_modules() if isinstance(m, EntQuantLinear) and id(m) not in seen]
    if strays:
        raise ValueError(f"EntQuant layers outside model.model.layers: {strays[:3]}")
    decoder = BlockDecoder(blocks)
    for i, block in enumerate(_blocks_of(model)):
        old = getattr(block, "_entquant_hook", None)
        if old is not None:
            old.remove()
        block._entquant_hook = block.register_forward_pre_hook(functools.partial(decoder.pre_hook, i)) \
            if i in blocks else None
    for i, layers in blocks.items():
        stream_bits, sizes = 8 * layers[0].stream.numel(), [m.in_features * m.out_features for m in layers]
        shares = [stream_bits * s // sum(sizes) for s in sizes]
        shares[0] += stream_bits - sum(shares)
        offset = 0
        for m, size, share in zip(layers, sizes, shares):
            m._decoder, m._block, m._offset, m._stream_bits = decoder, i, offset, share
            offset += size
    model.entquant_decoder = decoder
    return decoder


# ---- whole models: quantize, rate control -----------------------------------------------------------------------

def _block_linears(model):
    """{block index: [(name, nn.Linear), ...]} in module order: the linears EntQuant replaces."""
    out = {}
    for i, block in enumerate(_blocks_of(model)):
        prefix = f"model.layers.{i}."
        found = [(prefix + n, m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        if found:
            out[i] = found
    return out


def compress_blocks(linears, lam, fmt="float8", super_weights=8, max_iter=500, lanes=None, importance=None):
    """{block: [(name, linear)]} -> ({name: (log_scale [out], super_index [k], super_value [k])},
    {block: stream bytes}, total bits, weight count). super_weights applies to Int8 only; importance: {name: [out]}
    from fisher_importance, or None for the paper's loss."""
    per_layer, streams, bits, count = {}, {}, 0, 0
    for i, named in linears.items():
        codes = []
        for name, linear in named:
            w = linear.weight.detach().float()
            keep = super_weight_mask(w, super_weights) if fmt == "int8" else None
            s = entquant_scales(w, lam, fmt, max_iter=max_iter, keep=keep,
                                importance=None if importance is None else importance[name])
            codes.append(encode_weight(w, s, fmt, keep).reshape(-1))
            idx = torch.zeros(0, dtype=torch.int32) if keep is None else keep.reshape(-1).nonzero()[:, 0].int()
            per_layer[name] = (s, idx, w.reshape(-1)[idx.long()])
            bits += 16 * s.numel() + 64 * idx.numel()
            count += w.numel()
        streams[i] = rans_encode(torch.cat(codes), lanes=lanes)
        bits += 8 * len(streams[i])
    return per_layer, streams, bits, count


def lambda_for_bpw(target, measure, table, tol=0.05, max_evals=10):
    """Find lambda with |measure(lambda) - target| <= tol (measure: lambda -> coded bits per weight, decreasing).

    First guess: the shipped lambda -> bpw table, read as log-linear. Then bracket and bisect in log lambda, each new
    point placed where the line through the bracket's ends meets the target (regula falsi), clamped to the middle
    80% of the bracket so that it always shrinks. Returns (lambda, bpw)."""
    table = sorted(table)
    if not table:
        raise ValueError("no lambda -> bpw table to start from")
    logs = np.log([lam for lam, _ in table])
    rates = np.array([b for _, b in table])
    order = np.argsort(rates)
    log_lam = float(np.interp(target, rates[order], logs[order]))
    lo = hi = None                                              # (log lambda, bpw) with bpw above / below target
    for _ in range(max_evals):
        bpw = measure(math.exp(log_lam))
        if abs(bpw - target) <= tol:
            return math.exp(log_lam), bpw
        if bpw > target:
            lo = (log_lam, bpw)
        else:
            hi = (log_lam, bpw)
        if lo is None or hi is None:
            log_lam += math.log(2.0) if hi is None else -math.log(2.0)
            continue
        frac = (lo[1] - target) / (lo[1] - hi[1])
        log_lam = lo[0] + min(max(frac, 0.1), 0.9) * (hi[0] - lo[0])
    raise ValueError(f"no lambda reached {target} +- {tol} bits per weight in {max_evals} tries")


LAMBDA_TABLE = Path(__file__).resolve().parents[2] / "data" / "entquant_lambda_bpw.json"


# Where no table is shipped: the paper's Float8 presets, and what the Fisher-weighted loss measured on the tiny model.
PRESETS = {None: [(3.9, 4.0), (14.5, 3.0), (58.0, 2.0)], "fisher": [(0.25, 4.04), (2.0, 3.06), (16.0, 2.16)]}


def parse_sensitivity(sensitivity):
    """None or "none" -> None (the paper's loss); "fisher" -> "fisher" (the Fisher-weighted loss)."""
    if sensitivity in (None, "none"):
        return None
    if sensitivity != "fisher":
        raise ValueError(f"sensitivity must be 'none' (the paper's loss) or 'fisher', got {sensitivity!r}")
    return sensitivity


def table_key(fmt, sensitivity=None):
    """The lambda table's key: the format, plus "+fisher" when the Fisher-weighted loss sets the scales (its lambda
    has another scale than the paper's)."""
    return fmt if sensitivity is None else f"{fmt}+{sensitivity}"


def load_lambda_table(fmt="float8", sensitivity=None, path=LAMBDA_TABLE):
    """[(lambda, bpw), ...] measured on the tiny trained model (benchmarks/entquant_rate.py rebuilds the file);
    without it, PRESETS (the search then brackets from there)."""
    path = Path(path)
    table = json.loads(path.read_text()).get(table_key(fmt, sensitivity), []) if path.exists() else []
    if not table:
        return PRESETS[sensitivity]
    return [(row["lambda"], row["bpw"]) for row in table]


@torch.no_grad()
def quantize_entquant(model, calibration_ids=None, lam=None, bpw=None, fmt="float8", super_weights=8,
                      max_iter=500, lanes=None, tol=0.05, sensitivity=None, fisher_samples=64):
    """EntQuant, data-free (calibration_ids is ignored): replace every linear of every transformer block by an
    EntQuantLinear, IN PLACE. Give lam (lambda) or bpw (a target in coded bits per weight, metadata included, reached
    within tol by searching lambda). sensitivity="fisher" weights the reconstruction by the Fisher information
    estimated on fisher_samples sequences the model writes itself (see the module docstring). Returns the
    quantization_config."""
    if (lam is None) == (bpw is None):
        raise ValueError("give exactly one of lam (lambda) or bpw (target bits per weight)")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    sensitivity = parse_sensitivity(sensitivity)
    linears = _block_linears(model)
    importance = None
    if sensitivity == "fisher":
        start = time.time()
        ids = self_generated_ids(model, fisher_samples)
        importance = fisher_importance(model, [n for named in linears.values() for n, _ in named], ids)
        print(f"entquant: Fisher sensitivities from {fisher_samples} self-generated sequences "
              f"({time.time() - start:.1f} s)", file=sys.stderr, flush=True)
    found = {}

    def measure(lam_):
        start = time.time()
        found[lam_] = compress_blocks(linears, lam_, fmt, super_weights, max_iter, lanes, importance)
        _, _, bits, count = found[lam_]
        print(f"entquant: lambda {lam_:.4g} -> {bits / count:.3f} bits per weight ({time.time() - start:.1f} s)",
              file=sys.stderr, flush=True)
        return bits / count

    if bpw is not None:
        lam, _ = lambda_for_bpw(bpw, measure, load_lambda_table(fmt, sensitivity), tol=tol)
    else:
        measure(lam)
    per_layer, streams, bits, count = found[lam]
    heads = {named[0][0]: i for i, named in linears.items()}

    def make(name, linear):
        s, idx, val = per_layer[name]
        stream = torch.frombuffer(bytearray(streams[heads[name]]), dtype=torch.uint8) if name in heads else None
        return EntQuantLinear(linear.in_features, linear.out_features, s, fmt, stream, idx, val, linear.bias)

    replace_linears(model, make, names=set(per_layer))
    attach_decoder(model)
    return {"quant_method": "entquant", "fmt": fmt, "lambda": lam, "bits_per_weight": bits / count,
            "sensitivity": sensitivity, "coding_unit": "transformer block", "coder": "rANS", "prob_bits": PROB_BITS}


def resident_bytes(model):
    """What an EntQuant model keeps for its quantized linears at run time vs dense float32 and bfloat16:
    {"compressed", "buffer", "resident", "dense_f32", "dense_bf16"} in bytes."""
    decoder = getattr(model, "entquant_decoder", None)
    if decoder is None:
        raise ValueError("model has no EntQuant decoder (quantize_entquant or attach_decoder first)")
    packed, buffer = decoder.resident_bytes()
    weights = sum(m.in_features * m.out_features for ms in decoder.blocks.values() for m in ms)
    return {"compressed": packed, "buffer": buffer, "resident": packed + buffer,
            "dense_f32": 4 * weights, "dense_bf16": 2 * weights}


# ---- checkpoint -------------------------------------------------------------------------------------------------
# The coding unit is a block but the registry stores tensors per linear: each block's stream is stored under its
# FIRST linear (`model.layers.{i}.self_attn.q_proj.weight_stream`, uint8: header, table, states, offsets, words),
# the other linears of the block store an empty `weight_stream`. After all layers are read, attach_decoder(model)
# (CHECKPOINT's `finish`) links them to the shared buffer again; it checks that each stream holds exactly its
# block's weights.

_PARTS = ("weight_stream", "weight_log_scale", "weight_shape", "super_index", "super_value")


def _write(layer, quantization_config):
    return {"weight_stream": layer.stream, "weight_log_scale": layer.log_scale,
            "weight_shape": torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64),
            "super_index": layer.super_index, "super_value": layer.super_value}


def _read(parts, quantization_config):
    shape = parts["weight_shape"]
    if shape.numel() != 2:
        raise ValueError(f"weight_shape must hold (out, in), got {shape.tolist()}")
    out_f, in_f = (int(v) for v in shape.tolist())
    return EntQuantLinear(in_f, out_f, parts["weight_log_scale"], quantization_config.get("fmt", "float8"),
                          parts["weight_stream"], parts["super_index"], parts["super_value"], parts.get("bias"))


def finish_loading(model, quantization_config):
    """After every layer of a checkpoint is in place: rebuild the shared decoder and the pre-hooks."""
    attach_decoder(model)


CHECKPOINT = CheckpointMethod(name="entquant", parts=lambda quantization_config: _PARTS, read=_read, write=_write,
                              quantize=quantize_entquant, finish=finish_loading)


# ---- NF4, the data-free baseline beside it ----------------------------------------------------------------------
# NormalFloat4 (QLoRA): 16 levels at quantiles of N(0, 1) scaled to [-1, 1], one absmax per group of 64 stored in
# float16: W = NF4[q] * absmax, 4 + 16 / 64 = 4.25 bits per weight.

NF4_TABLE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                          -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                          0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                          0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def quantize_to_nf4(weight, group_size=64):
    """weight [out, in] -> (codes uint8 [out, in] in 0..15, absmax float16 [out, groups]): the nearest level."""
    out_f, in_f = weight.shape
    g = grouped(weight.detach(), group_size)
    absmax = g.abs().amax(-1).half()
    a = absmax.float().clamp(min=torch.finfo(torch.float16).tiny)
    mids = (NF4_TABLE[1:] + NF4_TABLE[:-1]) / 2                 # nearest level = number of midpoints below
    codes = torch.bucketize((g / a[..., None]).clamp(-1, 1), mids)
    return codes.reshape(out_f, -1)[:, :in_f].to(torch.uint8), absmax


class NF4Linear(QuantLinear):
    """packed uint8 [out, ceil(in / 2)] (two NF4 codes per byte, low nibble first), absmax float16 [out, groups]."""

    def __init__(self, packed, absmax, in_features, group_size=64, bias=None):
        out_f, groups = absmax.shape
        if packed.shape != (out_f, -(-in_features // 2)) or groups != -(-in_features // group_size):
            raise ValueError(f"NF4 shapes do not fit in={in_features}, group {group_size}: packed "
                             f"{tuple(packed.shape)}, absmax {tuple(absmax.shape)}")
        super().__init__(in_features, out_f, bias)
        self.group_size = group_size
        self.register_buffer("packed", packed.to(torch.uint8).contiguous())
        self.register_buffer("absmax", absmax.half().contiguous())

    @classmethod
    def from_weight(cls, weight, group_size=64, bias=None):
        codes, absmax = quantize_to_nf4(weight, group_size)
        return cls(pack_bits(codes, 4), absmax, weight.shape[1], group_size, bias)

    def dequantize(self):
        codes = unpack_bits(self.packed, 4, self.in_features).long()
        a = self.absmax.float().repeat_interleave(self.group_size, 1)[:, :self.in_features]
        return NF4_TABLE[codes] * a

    def kernel_matmul(self, x2d):
        return triton_formats.nf4_matmul(x2d, self.packed, self.absmax.float(), NF4_TABLE, self.group_size)

    def storage_bits(self):
        return 8 * self.packed.numel() + 16 * self.absmax.numel()


def quantize_nf4(model, calibration_ids=None, group_size=64):
    """Replace every linear but lm_head by an NF4Linear (data-free), IN PLACE. Returns {name: layer}."""
    return replace_linears(model, lambda name, linear: NF4Linear.from_weight(linear.weight, group_size,
                                                                               linear.bias))
