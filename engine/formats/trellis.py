"""Trellis-coded quantization (QTIP, ExLlamaV3's EXL3): a bitshift trellis, no stored codebook.

A state is an L-bit integer and each weight shifts in K new bits:  s_t = ((s_{t-1} << K) | b_t) mod 2^L.
Every state stands for a value computed by a tiny hash of its bits (QTIP's "1MAD" or "3INST"), normalized over all
2^L states to zero mean and unit variance (`codebook`). A tile of T weights (T = 256: one row's 256 inputs, or
QTIP's 16 x 16 block) is coded as

    w_t ~ scale * codebook[s_t],    scale an f16 per tile,

and the best symbols b_t are a shortest path through 2^L states per step (Viterbi, in trellis_viterbi.py). Weights are
first rotated group by group with a random Hadamard transform R = H D / sqrt(n) so they look i.i.d. Gaussian
(QuIP#); the layer keeps the rotated weight and rotates the activations instead, y = (x R^T) (W R^T)^T, with a fast
Walsh-Hadamard transform.

The stream of one tile is one integer N read as little-endian bytes; state t is the L-bit field at bit K(T-1-t):
  - free start:   N = s_0 followed by b_1 .. b_{T-1}, L + K(T-1) bits, padded to whole bytes;
  - tail-biting:  N = b_0 .. b_{T-1}, K T bits, read circularly (s_0's high bits are s_{T-1}'s low bits), so the
                  start state costs nothing. QTIP's two-pass trick picks the wrap state: code the sequence rotated
                  by T/2, then code it again with start and end pinned to the state that pass chose mid-way.
Bits per weight = (stored bytes * 8 + 16) / T: 2.09 at L=8, K=2 with a free start (2 pad bits), 2.0625 tail-biting
(plus the layer's 64-bit CRC, below).

Integrity. Every bit pattern is a valid trellis path, so a flipped bit decodes to another weight: each layer stores a
CRC32 of its codes, its scales and everything that fixes their meaning (L, K, code, tail_biting, tile, group, seed,
shape), and a layer whose CRC does not match is refused (ValueError), never decoded into another model.

BlockLDLQ (QTIP): GPTQ's error feedback (obq.py's loop) where each block of tile-width columns is trellis-coded as a
whole: with U = chol(H^-1) upper, W[:, rest] -= (W_B - Q_B) U_BB^-1 U_B,rest (the best linear correction of the later
columns).
"""
import functools

import torch

from .numerics import hadamard
from . import trellis_viterbi as viterbi
from .trellis_layout import (check_tile, from_tiles, pack_stream, rotate, stream_bits, stream_checksum,
                             stream_states, to_tiles, unrotate)
from ..layers import SEQUENTIAL_STEPS, QuantLinear
from .method import CheckpointMethod, Option, bool_option, choice_option, config_field, int_option, options_for
from .numerics.hadamard import random_hadamard  # noqa: F401  (the book imports it from here)

CODES = ("1mad", "3inst")
# Each code's hash constants (QTIP's): code_1mad / code_3inst below and the Triton kernel both take them from here.
HASH = {"1mad": (34038481, 76625530, 510, 147.800537109375),     # multiplier, increment, byte-sum centre, scale
        "3inst": (89226354, 64248484, 0x8FFF8FFF, 0x3B603B60)}   # multiplier, increment, kept bits, exponent bits


# ---- the codes ----------------------------------------------------------------------------------------------------

def code_1mad(states):
    """states (int) -> float32: one multiply-add mod 2^32, then the sum of the result's four bytes (a sum of four
    roughly uniform bytes is roughly Gaussian), centred and scaled as QTIP does."""
    a, b, centre, scale = HASH["1mad"]
    x = (states.to(torch.int64) * a + b) & 0xFFFFFFFF
    total = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    return (total - centre).float() / scale


def _fp16_bits(h):
    """16-bit patterns (int64 0..65535) -> their float16 values, as float32."""
    return (h - ((h >> 15) << 16)).to(torch.int16).view(torch.float16).float()


def code_3inst(states):
    """states (int) -> float32: multiply-add mod 2^32, keep each half's sign and low 12 bits and set a fixed exponent
    pattern ((x & kept) ^ exponent), read the halves as two float16 numbers and add them (exactly, in f32)."""
    a, b, kept, exponent = HASH["3inst"]
    x = (states.to(torch.int64) * a + b) & 0xFFFFFFFF
    x = (x & kept) ^ exponent
    return _fp16_bits(x >> 16) + _fp16_bits(x & 0xFFFF)


def _check_code(L, K, code):
    if code not in CODES:
        raise ValueError(f"code must be one of {CODES}, got {code!r}")
    if not (isinstance(L, int) and isinstance(K, int) and 1 <= K <= 8 and K < L <= 24):
        raise ValueError(f"need integers 1 <= K <= 8, K < L <= 24, got L={L!r}, K={K!r}")


@functools.cache
def code_stats(L, code="1mad"):
    """(mean, 1 / std) of the raw code over all 2^L states, as float32-representable floats."""
    _check_code(L, 1, code)
    raw = (code_1mad if code == "1mad" else code_3inst)(torch.arange(2 ** L)).double()
    return float(raw.mean().float()), float((1 / raw.std()).float())


@functools.cache
def _codebook(L, code):
    mean, inv_std = code_stats(L, code)
    raw = (code_1mad if code == "1mad" else code_3inst)(torch.arange(2 ** L))
    return (raw - mean) * inv_std                          # float32 ops in this order: the kernel repeats them


def codebook(L, *, code="1mad"):
    """The value of every L-bit state [2^L] float32: zero mean, unit variance over the states."""
    return _codebook(L, code).clone()


# ---- encoding -----------------------------------------------------------------------------------------------------

@torch.no_grad()
def viterbi_encode(x, L=8, K=2, *, code="1mad", tail_biting=False, wrap_window=None, compiled=None):
    """The book's encoder: x [T] (unit variance) -> (start state int, K-bit symbols [T - 1], reconstruction [T]).
    x [B, T] codes B sequences at once: start states [B]. Keywords as viterbi_path's; with tail_biting the symbols
    are [T] (s_0's high bits are s_{T-1}'s low bits, so the stream is exactly K T bits)."""
    states, recon = viterbi_path(x, L, K, code=code, tail_biting=tail_biting, wrap_window=wrap_window,
                                 compiled=compiled)
    symbols = states & (2 ** K - 1)
    if not tail_biting:
        symbols = symbols[..., 1:]
    start = states[..., 0]
    return (int(start) if start.dim() == 0 else start), symbols, recon


@torch.no_grad()
def viterbi_path(x, L=8, K=2, *, code="1mad", tail_biting=False, wrap_window=None, compiled=None):
    """x [B, T] or [T] (unit variance) -> (the least-squared-error state path [B, T] int64, its values [B, T]).

    tail_biting: the path's last L - K bits equal its first state's high bits, so no start state is stored.
    wrap_window: tail-biting's first pass only picks the wrap state; with wrap_window it codes only the last and the
    first wrap_window steps, joined, instead of the whole sequence rotated by T/2 (None, QTIP's). Cheaper, but at
    L=16 the wrap state it picks still depends on steps far away, and the MSE rises (see benchmarks/trellis_mse.py
    --windows). compiled: viterbi's.
    """
    _check_code(L, K, code)
    single = x.dim() == 1
    x = x.float().reshape(1, -1) if single else x.float()
    if x.dim() != 2 or x.shape[1] * K < L:
        raise ValueError(f"x must be [T] or [B, T] with K*T >= L, got shape {tuple(x.shape)}")
    if wrap_window is not None and not (isinstance(wrap_window, int) and wrap_window * K >= L):
        raise ValueError(f"wrap_window must be None or an int >= L / K = {L / K}, got {wrap_window!r}")
    table = _codebook(L, code)
    T = x.shape[1]
    search = functools.partial(viterbi.viterbi, table=table, L=L, K=K, compiled=compiled)
    with viterbi.one_thread() as threads:
        if tail_biting:
            half = T // 2 if wrap_window is None else min(T // 2, wrap_window)
            around = x.roll(half, 1)                                    # position 0 is at index `half`
            if 2 * half < T - 1:
                around = around[:, :2 * half]                           # the last and the first `half` steps
            first = search(around, threads=threads)
            path = search(x, wrap=first[:, half] >> K, threads=threads)
        else:
            path = search(x, threads=threads)
        out = path, table[path]
    return tuple(t[0] for t in out) if single else out


# ---- a weight matrix ----------------------------------------------------------------------------------------------

def _code_tiles(seqs, L, K, code, tail_biting):
    """[seq [R, C, T], ...] -> [(codes uint8 [R, C, nbytes], scales f16 [R, C], reconstruction [R, C, T]), ...].

    All tiles of all the tensors go through one batched Viterbi (a big batch amortizes each step's overhead). Each
    tile is coded at its RMS, then its scale is refit by least squares on the chosen path (never worse) and rounded
    to f16 before the reconstruction is formed, so it is exactly what a decoder computes."""
    T = seqs[0].shape[-1]
    if tail_biting and K * T % 8:
        raise ValueError(f"a tail-biting stream of {T} x {K} bits must fill whole bytes")
    flat = torch.cat([s.reshape(-1, T) for s in seqs]).float()
    if not torch.isfinite(flat).all():
        raise ValueError("weights are not finite (NaN or inf)")
    rms = flat.pow(2).mean(1, keepdim=True).sqrt()
    states, values = viterbi_path(flat / torch.where(rms > 0, rms, 1.0), L, K, code=code, tail_biting=tail_biting)
    fit = (flat * values).sum(1) / values.pow(2).sum(1).clamp_min(1e-30)
    scales = fit.clamp_min(0).half()
    if not torch.isfinite(scales).all():
        raise ValueError("a tile's scale overflows float16")
    recon = values * scales.float()[:, None]
    codes = pack_stream(states, L, K, tail_biting)
    sizes = [s.shape[0] * s.shape[1] for s in seqs]
    return [(c.reshape(*s.shape[:2], -1), sc.reshape(s.shape[:2]), r.reshape(s.shape))
            for s, c, sc, r in zip(seqs, codes.split(sizes), scales.split(sizes), recon.split(sizes))]


@torch.no_grad()
def quantize_trellis(weight, L=8, K=2, group=256, seed=0, *, code="1mad", tail_biting=False, tile=None):
    """The book's: weight [out, in] -> (the dequantized weight [out, in], what a decoder produces; bits per weight,
    stream and f16 scales counted). Keywords and what is stored: trellis_codes."""
    codes, scales, w_rot = trellis_codes(weight, L, K, group, seed, code=code, tail_biting=tail_biting, tile=tile)
    T = w_rot.numel() // scales.numel()
    return unrotate(w_rot, group, seed), (stream_bits(L, K, T, tail_biting) + 16) / T


@torch.no_grad()
def trellis_codes(weight, L=8, K=2, group=256, seed=0, *, code="1mad", tail_biting=False, tile=None):
    """weight [out, in] -> (codes uint8 [out / th, in / tw, nbytes], scales f16 [out / th, in / tw], w_rot [out, in]).

    Rows are rotated in groups of `group` inputs (`rotate`), then cut into tiles (th, tw) (default (1, group): one
    row's group, the book's layout; (16, 16) is QTIP's), each a sequence of T = th * tw weights coded by the trellis.
    w_rot is the reconstruction in the rotated basis, exactly decode_trellis(codes, scales, ...); the weight it
    stands for is unrotate(w_rot, group, seed)."""
    _check_code(L, K, code)
    tile = tuple(tile) if tile is not None else (1, group)
    seq = to_tiles(rotate(weight, group, seed), tile)
    [(codes, scales, recon)] = _code_tiles([seq], L, K, code, tail_biting)
    return codes, scales, from_tiles(recon, tile)


def decode_trellis(codes, scales, L=8, K=2, code="1mad", tail_biting=False, tile=(1, 256)):
    """Rebuild the rotated weight [out, in] float32 from the streams alone: codes uint8 [R, C, nbytes], scales f16
    [R, C]. Replays the shift register (`stream_states`), looks up the code, multiplies by the tile's scale."""
    _check_code(L, K, code)
    th, tw = tile
    if codes.dim() != 3 or scales.shape != codes.shape[:2] or scales.dtype != torch.float16:
        raise ValueError(f"codes must be [R, C, bytes] with f16 scales [R, C], got codes {tuple(codes.shape)}, "
                         f"scales {scales.dtype} {tuple(scales.shape)}")
    if not torch.isfinite(scales).all():
        raise ValueError("corrupted stream: a scale is not finite")
    R, C, nbytes = codes.shape
    states = stream_states(codes.reshape(R * C, nbytes), L, K, th * tw, tail_biting)
    w = torch.index_select(_codebook(L, code), 0, states.reshape(-1)).view(states.shape)
    w *= scales.reshape(-1, 1).float()
    return from_tiles(w.reshape(R, C, -1), (th, tw))


# ---- BlockLDLQ ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def block_ldlq(weight, hessian, L=8, K=2, group=256, seed=0, code="1mad", tail_biting=False, tile=(16, 16),
               damp=0.01, block=128):
    """GPTQ's error feedback with trellis coding (QTIP's BlockLDLQ): weight [out, in], hessian [in, in] (its inputs'
    2 X^T X / n, unrotated) -> (codes, scales, w_rot) as trellis_codes.

    obq.error_feedback in the rotated basis (H_rot = R H R^T, group by group; float64), one step being a block of tw
    columns whose tiles the trellis codes all at once: W[:, later] -= (W_B - Q_B) U_BB^-1 U_B,later. Linears that
    read the same input (q/k/v, gate/up) share H and can go as one weight, their rows stacked."""
    from .numerics.obq import error_feedback, inverse_cholesky   # BlockLDLQ alone feeds errors forward (ldlq=True)
    _check_code(L, K, code)
    tile = tuple(tile)
    check_tile(weight.shape, tile)
    in_f = weight.shape[1]
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"hessian must be [{in_f}, {in_f}], got {tuple(hessian.shape)}")
    h = rotate(rotate(hessian.double(), group, seed).T, group, seed).double()   # R H R^T, group by group
    coded = []

    def quantize(j, current):
        [(codes, scales, recon)] = _code_tiles([to_tiles(current(j, j + tile[1]), tile)], L, K, code, tail_biting)
        coded.append((codes, scales))
        return from_tiles(recon, tile).double()

    w_rot = error_feedback(rotate(weight, group, seed).double(), inverse_cholesky(h, damp), quantize, step=tile[1],
                           block=block)
    return torch.cat([c for c, _ in coded], 1), torch.cat([s for _, s in coded], 1), w_rot.float()


# ---- the layer ----------------------------------------------------------------------------------------------------

class TrellisLinear(QuantLinear):
    """Trellis streams per tile + f16 scales; the rotation is rebuilt from its seed.

    codes uint8 [out / th, in / tw, nbytes], scales f16 [out / th, in / tw], crc int64 [1] (stream_checksum; None:
    computed here, for a layer just quantized). forward: y = rotate(x) @ W_rot^T, W_rot decoded on the fly (the kernel
    replays each tile's shift register). dequantize() = unrotate(W_rot)."""

    def __init__(self, codes, scales, L=8, K=2, code="1mad", tail_biting=False, tile=(1, 256), group=256, seed=0,
                 bias=None, crc=None):
        _check_code(L, K, code)
        hadamard.check_power_of_two(group)
        th, tw = tile = tuple(int(t) for t in tile)
        if codes.dim() != 3 or codes.dtype != torch.uint8 or scales.shape != codes.shape[:2] \
                or scales.dtype != torch.float16:
            raise ValueError(f"need codes uint8 [R, C, bytes] and scales f16 [R, C], got codes {codes.dtype} "
                             f"{tuple(codes.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
        nbytes = -(-stream_bits(L, K, th * tw, tail_biting) // 8)
        if codes.shape[2] != nbytes:
            raise ValueError(f"truncated or oversized stream: {codes.shape[2]} bytes per tile, expected {nbytes}")
        out_f, in_f = codes.shape[0] * th, codes.shape[1] * tw
        if in_f % group:
            raise ValueError(f"in_features {in_f} is not a multiple of the rotation group {group}")
        expected = stream_checksum(codes, scales, L, K, code, tail_biting, tile, group, seed)
        if crc is not None:
            if not isinstance(crc, torch.Tensor) or crc.dtype != torch.int64 or crc.numel() != 1:
                raise ValueError(f"trellis crc must be an int64 tensor [1], got {crc!r}"[:200])
            if int(crc) != expected:
                raise ValueError("trellis stream checksum mismatch: the codes, the scales or the fields that fix "
                                 "their meaning (L, K, code, tail_biting, tile, group, seed) changed since it was "
                                 "written")
        super().__init__(in_f, out_f, bias)
        self.L, self.K, self.code, self.tail_biting, self.tile, self.group, self.seed = \
            L, K, code, bool(tail_biting), tile, group, seed
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("crc", torch.tensor([expected], dtype=torch.int64))
        self.row_align = th                                     # decode_rows decodes whole tile rows
        self.decode_rotated()                                   # a malformed stream fails here, not mid-forward

    def decode_rotated(self):
        """The rotated weight W R^T [out, in] float32, straight from the streams."""
        return decode_trellis(self.codes, self.scales, self.L, self.K, self.code, self.tail_biting, self.tile)

    def dequantize(self):
        return unrotate(self.decode_rotated(), self.group, self.seed)

    def runtime_input(self, x2d):
        return hadamard.rotate_by_product(x2d, hadamard.random_signs(self.group, self.seed), self.group)

    def decode_rows(self, out, start, stop):
        """Rows start:stop (whole tile rows: row_align) of the rotated weight, which runtime_input's x multiplies."""
        th = self.tile[0]
        tiles = slice(start // th, stop // th)
        out.copy_(decode_trellis(self.codes[tiles], self.scales[tiles], self.L, self.K, self.code, self.tail_biting,
                                 self.tile))

    def table_rows(self):
        """(codebook float32 [2^L], states uint8 [out, in], scales float32 [R, C] one per tile, the tile, (signs [in],
        group), K): the shift registers replayed once, for engine.runtime_forms' TableRows (row r, column c of the
        rotated weight is codebook[states[r, c]] * scales[r // th, c // tw], decode_trellis' product; K the bits each
        step shifts in); None for L > 8."""
        if self.L > 8:
            return None
        R, C, nbytes = self.codes.shape
        states = stream_states(self.codes.reshape(R * C, nbytes), self.L, self.K, self.tile[0] * self.tile[1],
                               self.tail_biting)
        return (_codebook(self.L, self.code), from_tiles(states.to(torch.uint8).reshape(R, C, -1), self.tile),
                self.scales.float(), self.tile, (hadamard.random_signs(self.group, self.seed), self.group), self.K)

    def kernel_matmul(self, x2d):
        mean, inv_std = code_stats(self.L, self.code)
        from ..kernels import triton_formats      # Triton: imported by the engine path only
        return triton_formats.trellis_matmul(rotate(x2d, self.group, self.seed), self.codes, self.scales.float(),
                                             self.L, self.K, self.tile, mean, inv_std, self.code, HASH[self.code])

    def storage_bits(self):
        return self.codes.numel() * 8 + self.scales.numel() * 16 + 64

    def extra_repr(self):
        return super().extra_repr() + f", L={self.L}, K={self.K}, code={self.code}, tile={self.tile}"


# ---- whole model and checkpoint -----------------------------------------------------------------------------------

@torch.no_grad()
def quantize_layer(layer, L=8, K=2, code="1mad", tail_biting=False, tile=None, group=None, seed=0, ldlq=False):
    """Replace the layer's linears (a calibration.LayerCalibration) by TrellisLinears, in place; all their tiles go
    through one batched Viterbi. ldlq=True runs BlockLDLQ with the Hessians of the layer's calibration inputs
    (default tile (16, 16): 16-column blocks; the inputs come from the float layers before it, so unlike GPTQ they do
    not see earlier layers' error). group: the Hadamard rotation's width (None: the largest power of two <= 256
    dividing every linear's input width, hadamard.fitting_tile; every decoder layer has the same widths, so one group
    for the model). Returns the quantization_config."""
    _check_code(L, K, code)
    if group is None:
        group = hadamard.fitting_tile([layer.module(n).in_features for n in layer.linear_names()], 256)
    tile = tuple(tile) if tile is not None else ((16, 16) if ldlq else (1, group))
    if ldlq:                              # the linears of one sequential step read one input: one stacked weight
        stats, coded = layer.capture(), {}
        for step in SEQUENTIAL_STEPS:
            names = [layer.prefix + n for n in step]
            weights = [layer.module(n).weight.detach().float() for n in names]
            H = stats[names[0]].hessian
            codes, scales = layer.by_rows(lambda w, H=H: block_ldlq(w, H, L, K, group, seed, code, tail_biting,
                                                                    tile)[:2], torch.cat(weights))
            rows = [w.shape[0] // tile[0] for w in weights]
            coded.update({n: parts for n, parts in zip(names, zip(codes.split(rows), scales.split(rows)))})
    else:
        names = layer.linear_names()
        tiles = [to_tiles(rotate(layer.module(n).weight.detach().float(), group, seed), tile) for n in names]
        coded = {n: parts[:2] for n, parts in zip(names, _code_tiles(tiles, L, K, code, tail_biting))}

    def make(name, linear):
        codes, scales = coded[name]
        return TrellisLinear(codes, scales, L, K, code, tail_biting, tile, group, seed, bias=linear.bias)
    layer.replace(make)
    return {"quant_method": "trellis", "L": L, "K": K, "code": code, "tail_biting": bool(tail_biting),
            "tile": list(tile), "group": group, "seed": seed, "ldlq": bool(ldlq)}


def quantize(model, calibration_ids=None, batch_size=8, **options):
    """Trellis-code every linear but lm_head in place: the whole model at once (data-free), or with ldlq=True one
    decoder layer at a time on calibration_ids [B, T]. Options: those of quantize_layer."""
    from .numerics.calibration import by_layer, whole_model     # the model walk: only a whole model needs it
    if options.get("ldlq"):
        return by_layer(model, CHECKPOINT, calibration_ids, batch_size, **CHECKPOINT.checked(options))
    return quantize_layer(whole_model(model), **CHECKPOINT.checked(options))


def _is_tile(tile):
    return len(tile) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 16 for v in tile)


def validate(quantization_config):
    """A trellis quantization_config, checked once: every field that changes what the bits mean, exactly typed."""
    field = functools.partial(config_field, quantization_config)
    opts = {"L": field("L", None, int), "K": field("K", None, int),
            "code": field("code", None, str, lambda c: c in CODES, f"one of {CODES}"),
            "tail_biting": field("tail_biting", None, bool),
            "tile": tuple(field("tile", None, list, _is_tile, "[rows, cols], two positive ints")),
            "group": field("group", None, int, lambda g: 2 <= g <= 1 << 16, "a power of two >= 2"),
            "seed": field("seed", None, int, lambda v: 0 <= v < 1 << 63, "an int in [0, 2^63)")}
    _check_code(opts["L"], opts["K"], opts["code"])
    hadamard.check_power_of_two(opts["group"])
    return {**quantization_config, **opts}


def _read(parts, quantization_config):
    options = {k: quantization_config[k] for k in ("L", "K", "code", "tail_biting", "tile", "group", "seed")}
    return TrellisLinear(parts["trellis_codes"], parts["trellis_scales"], **options, bias=parts.get("bias"),
                         crc=parts["trellis_crc"])


def _write(layer, quantization_config):
    mismatch = [k for k in ("L", "K", "code", "tail_biting", "tile", "group", "seed")
                if getattr(layer, k) != quantization_config[k]]
    if mismatch:
        raise ValueError(f"layer and quantization_config disagree on {mismatch}")
    return {"trellis_codes": layer.codes, "trellis_scales": layer.scales, "trellis_crc": layer.crc}


def _rules(options):
    options = {**{key: option.default for key, option in OPTIONS.items()}, **options}
    _check_code(options["L"], options["K"], options["code"])
    if options["group"] is not None:
        hadamard.check_power_of_two(options["group"])


OPTIONS = options_for(quantize_layer, L=int_option(2, 24), K=int_option(1, 8), code=choice_option(CODES),
                      tail_biting=bool_option(),
                      tile=Option(lambda t: isinstance(t, (list, tuple)) and _is_tile(tuple(t)), "[rows, cols]"),
                      group=int_option(2, 1 << 16), seed=int_option(0, (1 << 63) - 1), ldlq=bool_option())
def _fits(cfg, options):
    """Refuse BlockLDLQ on a Qwen3-MoE model (a model's matter: numerics/experts.py, imported only here)."""
    from .numerics import experts
    if options.get("ldlq"):
        experts.refuse(cfg, "trellis with ldlq=True", "BlockLDLQ stacks a step's linears on one Hessian, but each "
                       "expert reads its own tokens; use ldlq=False")


CHECKPOINT = CheckpointMethod(name="trellis",
                              parts=lambda quantization_config: ("trellis_codes", "trellis_scales", "trellis_crc"),
                              read=_read, write=_write, quantize=quantize, validate=validate,
                              quantize_layer=quantize_layer,
                              calibration=lambda options: "float" if options.get("ldlq") else None,
                              options=OPTIONS, rules=_rules,
                              fits=_fits)
