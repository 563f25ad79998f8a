"""HyperQuant: lattice quantization (E8, D4, A2, Z) + bit-stripping + Rice sub-streams, for weights and the KV cache.

A lattice quantizer Q maps x in R^n to the nearest point of a lattice; its cell is rounder than the scalar interval,
so at equal rate its mean squared error is lower. The normalized second moment G = E|x - Q(x)|^2 / (n V^(2/n))
(V = cell volume) is Z 1/12, A2 0.080188, D4 0.076603, E8 0.0716821. Closest points follow Conway & Sloane
(ch. 20): round every coordinate, repair the parity constraint by moving the worst-rounded coordinate, and for E8
(and A2) also try the other coset and keep the nearer point. O(1) per scalar.

Integer realizations (what is stored), real point = code * axis (A2's y axis carries sqrt(3)):
    E8int = 2 E8 in Z^8      all c_i of one parity c, sum((c_i - c) / 2) even
    D4int = D4 in Z^4        sum(c_i) even
    A2int = (n_y, n_x)       n_y + n_x even, real point (sqrt(3) n_y, n_x)
    Z                        no constraint
Each mod-2 constraint pins one bit; Strip removes them (1.0 / 0.25 / 0.5 / 0 bits per scalar), zig-zag makes the
symbols non-negative (zz(n) = 2n, n >= 0; -2n - 1, n < 0), and E8's coset bit rides in the low bit of the halved
symbol: comb = 2 zz(t) + c. Symbol order per vector is chosen so a one-pass decoder rebuilds the dropped
coordinate at the vector's last symbol:
    E8 [comb, zz s_0..s_6]   D4 [zz c_0, zz c_1, zz c_2, zz t]   A2 [zz n_x, zz t_y]   Z [zz n]

Rice code with parameter k: m -> floor(m / 2^k) zeros, a one, then m mod 2^k in k bits, MSB first. A quotient
>= 15 escapes: 15 zeros, a one, m in 16 raw bits, so no codeword exceeds 32 bits and a decoder always finds a
whole codeword in a 32-bit window. Symbols are cut into sub-streams of 512 symbols, each with a 32-bit start bit
offset and its k (D4, A2: two k per sub-stream, one per symbol level); every sub-stream decodes independently.

Rate control: a table (data/lattice_snr_bps.json, `python -m engine.formats.lattice calibrate`) maps SNR =
10 log10(sigma^2 / sigma_q^2) (lattice scaled so that G V^(2/n) = sigma_q^2) to Rice bits per scalar on Gaussian
vectors; a target rate picks the SNR by interpolation. "bps" is the Rice payload alone, each sub-stream at its best
k: that accounting reproduces the paper's 3.74 / 3.77 / 3.81 / 3.84 at 21 dB. Offsets and k add 40 / 512 = 0.078
bps and per-row scales 16 / in; storage_bits counts them all.

Weights: random signs + Hadamard per tile of inputs, per-row alpha (rms), lattice + strip + Rice. KV cache: per
head vector, rotation none / signs / Haar ("qjl"), per-vector alpha, optional subtractive dither Q(x + U) - U with
U ~ Uniform(Voronoi cell) drawn fresh on every call, which makes <q, x_hat> unbiased for every single x.
"""
import itertools
import json
import math
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..kernels import stream_decoders
from .hadamard import rotate, unrotate
from .affine import pack_bits, unpack_bits
from .base import CheckpointMethod, QuantLinear, replace_linears

SUBSTREAM = 512          # symbols per Rice sub-stream
STREAM_META_BITS = 32 + 8  # per sub-stream: start bit offset, byte of k
K_MAX = 7                # Rice parameters 0..7
ESCAPE = 15              # a unary run this long means "16 raw bits follow"
RAW_BITS = 16
TABLE_PATH = Path(__file__).resolve().parents[2] / "data" / "lattice_snr_bps.json"


# ---- lattices ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lattice:
    """name, dimension n, G (normalized second moment), axis [n] (real point = code * axis), volume of a cell in
    real coordinates, levels [n] (which of the sub-stream's Rice parameters codes each symbol of a vector)."""
    name: str
    n: int
    G: float
    axis: tuple
    volume: float
    levels: tuple

    @property
    def noise_unit(self):
        """Per-scalar noise variance of the unscaled lattice: G V^(2/n)."""
        return self.G * self.volume ** (2 / self.n)


LATTICES = {
    "Z": Lattice("Z", 1, 1 / 12, (1.0,), 1.0, (0,)),
    "A2": Lattice("A2", 2, 0.080188, (math.sqrt(3), 1.0), 2 * math.sqrt(3), (0, 1)),
    "D4": Lattice("D4", 4, 0.076603, (1.0,) * 4, 2.0, (0, 0, 0, 1)),
    "E8": Lattice("E8", 8, 0.0716821, (1.0,) * 8, 2.0 ** 8, (0,) * 8),
}


def get_lattice(name):
    if isinstance(name, Lattice):
        return name
    if name not in LATTICES:
        raise ValueError(f"lattice must be one of {sorted(LATTICES)}, got {name!r}")
    return LATTICES[name]


def closest_dn(x):
    """x [..., n] -> nearest point of D_n (integers with an even sum), float. Round; if the sum is odd, round the
    coordinate that was rounded worst the other way (the cheapest parity repair)."""
    f = torch.round(x)
    err = x - f
    i = err.abs().argmax(-1, keepdim=True)
    step = torch.where(err.gather(-1, i) >= 0, 1.0, -1.0).to(x.dtype)
    g = f.scatter_add(-1, i, step)
    return torch.where((f.sum(-1, keepdim=True) % 2) != 0, g, f)


def _nearer(a, b, x):
    return torch.where(((a - x) ** 2).sum(-1, keepdim=True) <= ((b - x) ** 2).sum(-1, keepdim=True), a, b)


def closest_point(x, lattice):
    """x [..., n] real coordinates -> integer codes [..., n] (int64) of the nearest point of the integer
    realization; the point itself is codes * lattice.axis."""
    lat = get_lattice(lattice)
    if x.shape[-1] != lat.n:
        raise ValueError(f"{lat.name} quantizes vectors of {lat.n}, got last dimension {x.shape[-1]}")
    x = x.double()
    if lat.name == "Z":
        return torch.round(x).long()
    if lat.name == "D4":
        return closest_dn(x).long()
    if lat.name == "E8":                                   # E8 = D8 u (D8 + 1/2); E8int = 2 E8
        h = x / 2
        return (2 * _nearer(closest_dn(h), closest_dn(h - 0.5) + 0.5, h)).round().long()
    # A2int = rectangular lattice (2 sqrt3 Z x 2Z) plus its coset shifted by (sqrt3, 1), in units of the axis
    u = x / torch.tensor(lat.axis, dtype=x.dtype)                       # (n_y, n_x) as reals
    even = 2 * torch.round(u / 2)
    odd = 2 * torch.round((u - 1) / 2) + 1
    axis = torch.tensor(lat.axis, dtype=x.dtype)
    return (_nearer(even * axis, odd * axis, x) / axis).round().long()


def is_member(codes, lattice):
    """codes [..., n] int -> bool [...]: does the integer vector lie in the integer realization?"""
    lat = get_lattice(lattice)
    c = codes.long()
    if lat.name == "Z":
        return torch.ones(c.shape[:-1], dtype=torch.bool)
    if lat.name in ("D4", "A2"):
        return c.sum(-1) % 2 == 0
    par = c[..., :1] & 1
    return ((c & 1) == par).all(-1) & (((c - par) // 2).sum(-1) % 2 == 0)


# ---- zig-zag and strip ------------------------------------------------------------------------------------------

def zigzag(n):
    """signed int64 -> non-negative: 0, -1, 1, -2, 2 ... -> 0, 1, 2, 3, 4 ..."""
    return (n << 1) ^ (n >> 63)


def unzigzag(m):
    return (m >> 1) ^ -(m & 1)


def strip(codes, lattice):
    """Lattice codes [V, n] (int64, members) -> Rice symbols [V, n] (int64 >= 0), the seed's Strip + zig-zag."""
    lat = get_lattice(lattice)
    c = codes.long()
    if lat.name == "Z":
        return zigzag(c)
    if lat.name == "D4":
        p = c[:, :3].sum(1) & 1
        t = (c[:, 3] - p) >> 1
        return zigzag(torch.cat([c[:, :3], t[:, None]], 1))
    if lat.name == "A2":
        n_y, n_x = c[:, 0], c[:, 1]
        t_y = (n_y - (n_x & 1)) >> 1
        return zigzag(torch.stack([n_x, t_y], 1))
    cbit = c[:, 0] & 1
    s = (c - cbit[:, None]) >> 1
    p = s[:, :7].sum(1) & 1
    t = (s[:, 7] - p) >> 1
    return torch.cat([(2 * zigzag(t) + cbit)[:, None], zigzag(s[:, :7])], 1)


def unstrip(symbols, lattice):
    """Inverse of strip: symbols [V, n] -> codes [V, n]. Every non-negative symbol vector gives a lattice point,
    so the stripped alphabet has no redundancy left."""
    lat = get_lattice(lattice)
    m = symbols.long()
    if lat.name == "Z":
        return unzigzag(m)
    if lat.name == "D4":
        c = unzigzag(m)
        c3 = 2 * c[:, 3] + (c[:, :3].sum(1) & 1)
        return torch.cat([c[:, :3], c3[:, None]], 1)
    if lat.name == "A2":
        n_x = unzigzag(m[:, 0])
        n_y = 2 * unzigzag(m[:, 1]) + (n_x & 1)
        return torch.stack([n_y, n_x], 1)
    cbit, t = m[:, 0] & 1, unzigzag(m[:, 0] >> 1)
    s = unzigzag(m[:, 1:])
    s7 = 2 * t + (s.sum(1) & 1)
    return 2 * torch.cat([s, s7[:, None]], 1) + cbit[:, None]


# ---- Rice sub-streams -------------------------------------------------------------------------------------------

def rice_lengths(m, k):
    """Bits of each codeword: symbols m, parameters k (NumPy int64 arrays, same shape) -> int64 array."""
    q = m >> k
    return np.where(q < ESCAPE, q + 1 + k, ESCAPE + 1 + RAW_BITS)


def choose_ks(symbols, lattice, substream=SUBSTREAM):
    """symbols [N] (int64, whole vectors) -> ks [streams, 2] int64: per sub-stream and symbol level, the k in
    0..K_MAX that minimizes its bits. A codeword costs min(q, 15) + 1 + k bits plus 16 - k more if it escapes,
    so each k needs only per-stream sums of the clamped quotients and escape counts (NumPy: its integer
    reductions are several times faster than torch's here)."""
    lat = get_lattice(lattice)
    n = symbols.numel()
    streams = -(-n // substream)
    m = np.zeros(streams * substream, dtype=np.int32)
    m[:n] = symbols.numpy()
    m = m.reshape(streams, substream // lat.n, lat.n).transpose(0, 2, 1).copy()      # [streams, n, S / n]
    live = np.zeros(streams * substream, dtype=np.int64)
    live[:n] = 1
    level = np.eye(2, dtype=np.int64)[list(lat.levels)]                              # [n, 2]
    count = live.reshape(streams, -1, lat.n).sum(1) @ level                          # [streams, 2]
    cost = []
    for k in range(K_MAX + 1):
        q = np.minimum(m >> k, ESCAPE)
        quotients = q.sum(-1, dtype=np.int64) @ level
        escapes = (q == ESCAPE).sum(-1, dtype=np.int64) @ level
        cost.append(quotients + count * (1 + k) + escapes * (RAW_BITS - k))
    return torch.from_numpy(np.stack(cost, -1).argmin(-1))


def symbol_levels(n_symbols, lattice):
    lat = get_lattice(lattice)
    return torch.tensor(lat.levels).repeat(n_symbols // lat.n)


def rice_bits(symbols, lattice):
    """Exact payload bits the encoder emits for these symbols [V, n] (optimal k per sub-stream), without
    building the stream: what the KV cache and rate table count."""
    flat = symbols.reshape(-1)
    return int(rice_lengths(flat.numpy(), _symbol_ks(choose_ks(flat, lattice), flat.numel(), lattice)).sum())


def _symbol_ks(ks, n, lattice, substream=SUBSTREAM):
    """ks [streams, 2] -> the k of each of n symbols (NumPy)."""
    return ks.numpy()[np.arange(n) // substream, symbol_levels(n, lattice).numpy()]


@dataclass
class RiceStreams:
    """A serialized symbol stream: payload uint8 [bytes] (MSB-first bits), offsets int32 [streams] (start bit of
    each sub-stream), ks uint8 [streams] (k of level 0 in bits 0-2, level 1 in bits 3-5), count (symbols),
    total_bits, crc (crc32 of payload, offsets and ks), substream (symbols per sub-stream; 512 in every format
    here, smaller only to keep interpreted kernel tests short). `seal` computes the crc; `validate` checks everything a
    decoder relies on and raises ValueError naming the first problem."""
    payload: torch.Tensor
    offsets: torch.Tensor
    ks: torch.Tensor
    count: int
    total_bits: int
    crc: int
    substream: int = SUBSTREAM

    @staticmethod
    def checksum(payload, offsets, ks):
        crc = zlib.crc32(payload.numpy().tobytes())
        crc = zlib.crc32(offsets.to(torch.int32).numpy().tobytes(), crc)
        return zlib.crc32(ks.numpy().tobytes(), crc)

    @classmethod
    def seal(cls, payload, offsets, ks, count, total_bits, substream=SUBSTREAM):
        payload, offsets, ks = payload.to(torch.uint8), offsets.to(torch.int32), ks.to(torch.uint8)
        return cls(payload, offsets, ks, int(count), int(total_bits), cls.checksum(payload, offsets, ks), substream)

    @property
    def streams(self):
        return self.offsets.numel()

    def stream_ends(self):
        """int64 [streams]: where each sub-stream must end (the next one's start; the last ends at total_bits)."""
        return torch.cat([self.offsets[1:].long(), torch.tensor([self.total_bits])])

    def stream_counts(self):
        counts = torch.full((self.streams,), self.substream, dtype=torch.long)
        counts[-1] = self.count - (self.streams - 1) * self.substream
        return counts

    def validate(self):
        for name, t, dtype in (("payload", self.payload, torch.uint8), ("offsets", self.offsets, torch.int32),
                               ("ks", self.ks, torch.uint8)):
            if t.dtype != dtype or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
        if self.count <= 0 or self.streams != -(-self.count // self.substream):
            raise ValueError(f"{self.streams} sub-streams cannot hold {self.count} symbols of {self.substream}")
        if self.ks.numel() != self.streams:
            raise ValueError(f"{self.ks.numel()} Rice parameters for {self.streams} sub-streams")
        if int((self.ks >> 6).max()) != 0:
            raise ValueError("Rice parameter byte has bits above the two 3-bit fields")
        nbytes = self.payload.numel()
        if not 8 * nbytes - 8 < self.total_bits <= 8 * nbytes:
            raise ValueError(f"total_bits {self.total_bits} does not match a payload of {nbytes} bytes")
        starts, ends = self.offsets.long(), self.stream_ends()
        lengths, counts = ends - starts, self.stream_counts()
        if int(starts[0]) != 0:
            raise ValueError(f"the first sub-stream must start at bit 0, not {int(starts[0])}")
        bad = (lengths < counts) | (lengths > (ESCAPE + 1 + RAW_BITS) * counts)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"sub-stream {i} spans {int(lengths[i])} bits for {int(counts[i])} symbols: "
                             f"offsets are corrupt")
        if self.checksum(self.payload, self.offsets, self.ks) != self.crc:
            raise ValueError("stream checksum mismatch: payload, offsets or Rice parameters are corrupt")


def rice_encode(symbols, lattice, substream=SUBSTREAM):
    """symbols [V, n] (int64 >= 0, < 2^16) -> RiceStreams. Vectorized: every codeword's length, an exclusive
    prefix sum for its position, then each codeword's bits after its leading zeros (at most 17) are added into the
    (at most 3) bytes they touch."""
    flat = symbols.reshape(-1).long()
    if flat.numel() == 0:
        raise ValueError("nothing to encode")
    if int(flat.min()) < 0 or int(flat.max()) >= 1 << RAW_BITS:
        raise ValueError(f"Rice symbols must lie in [0, 2^{RAW_BITS}), got [{int(flat.min())}, {int(flat.max())}]"
                         " (lattice scale too fine?)")
    n = flat.numel()
    ks = choose_ks(flat, lattice, substream)                           # [streams, 2]
    m = flat.numpy()
    k = _symbol_ks(ks, n, lattice, substream)
    esc = (m >> k) >= ESCAPE
    length = rice_lengths(m, k)
    end = np.cumsum(length)
    total = int(end[-1])
    if total >= 2 ** 31:
        raise ValueError("tensor too large for 32-bit sub-stream offsets")
    value = np.where(esc, m | (1 << RAW_BITS), (m & ((1 << k) - 1)) | (1 << k))   # the '1' and what follows it
    last = end - 1                                                     # the codeword's final bit
    aligned = value << (7 - (last & 7))                                # <= 24 bits ending at that byte's LSB
    byte = last >> 3
    # Codewords occupy disjoint bits, so summing their bytes is OR-ing them.
    payload = sum(np.bincount(np.maximum(byte - i, 0), weights=(aligned >> (8 * i)) & 255,
                              minlength=-(-total // 8)) for i in range(3))
    offsets = torch.from_numpy((end - length)[::substream])
    return RiceStreams.seal(torch.from_numpy(payload.astype(np.uint8)), offsets, ks[:, 0] | (ks[:, 1] << 3),
                            n, total, substream)


_CLZ16 = np.array([16] + [15 - int(v).bit_length() + 1 for v in range(1, 1 << 16)], dtype=np.int64)


def rice_decode(streams, lattice):
    """RiceStreams -> symbols [count // n, n] int64 on the CPU. All sub-streams decode in lockstep: step j reads
    symbol j of every sub-stream through a 32-bit window starting at its bit position (from 5 bytes); the unary
    run is the window's count of leading zeros (a 16-bit lookup table: a valid codeword has its '1' there)."""
    streams.validate()
    lat = get_lattice(lattice)
    if streams.count % lat.n or streams.substream % lat.n:
        raise ValueError(f"{streams.count} symbols in sub-streams of {streams.substream} do not form whole "
                         f"{lat.name} vectors")
    S = streams.substream
    nb = streams.payload.numel()
    # win40[i] = bytes i..i+4 big-endian. Zero padding past the end: validate() keeps every start inside the
    # payload and a step moves at most 32 bits, so even a corrupt sub-stream never indexes past 4 S more bytes.
    b = np.zeros(nb + 4 * S + 16, dtype=np.int64)
    b[:nb] = streams.payload.numpy()
    n40 = nb + 4 * S + 8
    win40 = b[:n40] << 32 | b[1:n40 + 1] << 24 | b[2:n40 + 2] << 16 | b[3:n40 + 3] << 8 | b[4:n40 + 4]
    ns = streams.streams
    pos = streams.offsets.numpy().astype(np.int64)
    ks = streams.ks.numpy().astype(np.int64)
    k_level = np.stack([ks & 7, (ks >> 3) & 7])                                 # [2, streams]
    shift_level, mask_level, k1_level = 31 - k_level, (1 << k_level) - 1, k_level + 1
    last_count = streams.count - (ns - 1) * S
    out = np.zeros((S, ns), dtype=np.int64)
    bad = np.zeros(ns, dtype=bool)
    for j in range(S):
        lanes = ns if j < last_count else ns - 1
        p = pos[:lanes]
        level = lat.levels[j % lat.n]
        w = win40[p >> 3]
        w >>= 8 - (p & 7)
        w &= 0xFFFFFFFF                                                         # bits p .. p+31, MSB first
        q = _CLZ16[w >> 16]
        rem = w >> (shift_level[level, :lanes] - q)
        rem &= mask_level[level, :lanes]
        np.bitwise_or(q << k_level[level, :lanes], rem, out=out[j, :lanes])
        length = q + k1_level[level, :lanes]
        esc = q >= ESCAPE
        if esc.any():                                                           # rare: raw 16-bit value
            bad[:lanes] |= q > ESCAPE
            out[j, :lanes] = np.where(esc, w & ((1 << RAW_BITS) - 1), out[j, :lanes])
            length = np.where(esc, ESCAPE + 1 + RAW_BITS, length)
        p += length
    ends = streams.stream_ends().numpy()
    wrong = bad | (pos != ends)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise ValueError(f"sub-stream {i} does not decode to its {S}-symbol boundary "
                         f"(ends at bit {pos[i]}, expected {ends[i]}): stream is corrupt")
    return torch.from_numpy(out.T.reshape(-1)[:streams.count].copy()).reshape(-1, lat.n)


def encode_codes(codes, lattice, substream=SUBSTREAM):
    """Lattice codes [V, n] -> RiceStreams (strip, zig-zag, Rice)."""
    return rice_encode(strip(codes, lattice), lattice, substream)


def decode_codes(streams, lattice):
    """RiceStreams -> lattice codes [V, n] (Rice decode, inverse strip)."""
    return unstrip(rice_decode(streams, lattice), lattice)


# ---- rate control -----------------------------------------------------------------------------------------------

def lattice_scale(snr_db, lattice):
    """Lattice scale beta for unit-variance data: noise per scalar beta^2 G V^(2/n) = 10^(-SNR/10)."""
    lat = get_lattice(lattice)
    return math.sqrt(10 ** (-snr_db / 10) / lat.noise_unit)


def gaussian_rate(lattice, snr_db, vectors=100_000, seed=0):
    """(Rice payload bits per scalar, measured SNR in dB) for iid N(0, 1) vectors at the given SNR."""
    lat = get_lattice(lattice)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vectors, lat.n, generator=g, dtype=torch.float64)
    beta = lattice_scale(snr_db, lat)
    codes = closest_point(x / beta, lat)
    err = (codes * torch.tensor(lat.axis, dtype=torch.float64) * beta - x).pow(2).mean()
    return rice_bits(strip(codes, lat), lat) / x.numel(), float(-10 * torch.log10(err))


def calibrate(path=TABLE_PATH, snrs=None, vectors=100_000, seed=0):
    """Measure the SNR -> bits-per-scalar table for every lattice and write it as JSON."""
    snrs = [i / 2 for i in range(73)] if snrs is None else snrs
    table = {"snr_db": snrs, "vectors": vectors, "seed": seed, "substream": SUBSTREAM,
             "rate": "Rice payload bits per scalar, optimal k per 512-symbol sub-stream (offsets and k excluded)",
             "bps": {name: [round(gaussian_rate(name, s, vectors, seed)[0], 5) for s in snrs] for name in LATTICES}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


_TABLE = None


def load_table():
    global _TABLE
    if _TABLE is None:
        if not TABLE_PATH.exists():
            raise ValueError(f"{TABLE_PATH} is missing: run `python -m engine.formats.lattice calibrate`")
        _TABLE = json.loads(TABLE_PATH.read_text())
    return _TABLE


def snr_for_rate(bps, lattice):
    """Target Rice bits per scalar -> SNR in dB, by linear interpolation in the calibration table."""
    get_lattice(lattice)
    table = load_table()
    snrs, rates = table["snr_db"], table["bps"][lattice]
    if not rates[0] <= bps <= rates[-1]:
        raise ValueError(f"{lattice} rate {bps} outside the calibrated range [{rates[0]}, {rates[-1]}]")
    return float(np.interp(bps, rates, snrs))


# ---- rotation tile (the rotation itself: engine.formats.hadamard) -------------------------------------------------

def rotation_tile(in_features, tile=128):
    """The largest power of two <= tile that divides in_features."""
    t = tile
    while in_features % t:
        t //= 2
    return t


# ---- weights ----------------------------------------------------------------------------------------------------

def _unpack_signs(packed, n):
    """uint8 [n / 8] (bit set = -1, affine.pack_bits layout) -> signs float32 [n]."""
    return 1.0 - 2.0 * unpack_bits(packed, 1, n).float()


def _pack_signs(signs):
    return pack_bits((signs < 0).to(torch.uint8), 1)


class LatticeLinear(QuantLinear):
    """A weight stored as Rice sub-streams of stripped lattice codes.

    W' = W R^T (R = H D / sqrt(tile) per tile of inputs, engine.formats.hadamard); row o of W' is cut into vectors
    of n and quantized as scales[o] * code * axis. Stored: the RiceStreams (payload, offsets, ks), scales f16
    [out], signs (1 bit per input), header int64 [in, out, tile, total_bits, crc]. Forward: y = (x R^T) W'^T, W' decoded
    on the fly (CPU lockstep decoder for impl torch, the Triton decoder for impl engine).
    """

    def __init__(self, streams, scales, signs, lattice, in_features, tile, bias=None):
        lat = get_lattice(lattice)
        out_f = scales.numel()
        if tile < 2 or in_features % lat.n or in_features % 8 or in_features % tile or tile & (tile - 1):
            raise ValueError(f"in_features {in_features} must be a multiple of 8, of {lat.name}'s n={lat.n} and of "
                             f"the power-of-two tile {tile}")
        if streams.count != out_f * in_features or signs.numel() * 8 != in_features:
            raise ValueError(f"stream of {streams.count} symbols / {signs.numel() * 8} signs do not fit a "
                             f"[{out_f}, {in_features}] weight")
        if streams.substream != SUBSTREAM:
            raise ValueError(f"a LatticeLinear stores {SUBSTREAM}-symbol sub-streams, got {streams.substream}")
        streams.validate()
        super().__init__(in_features, out_features=out_f, bias=bias)
        self.lattice, self.tile = lat.name, tile
        self.register_buffer("payload", streams.payload)
        self.register_buffer("offsets", streams.offsets)
        self.register_buffer("ks", streams.ks)
        self.register_buffer("scales", scales.to(torch.float16))
        self.register_buffer("signs", signs.to(torch.uint8))
        self.register_buffer("header", torch.tensor([in_features, out_f, tile, streams.total_bits, streams.crc]))

    def streams(self):
        return RiceStreams(self.payload, self.offsets, self.ks, self.in_features * self.out_features,
                           int(self.header[3]), int(self.header[4]))

    def _signs(self):
        return _unpack_signs(self.signs, self.in_features)

    def rotated_weight(self):
        """W' [out, in] float32 decoded on the CPU."""
        lat = get_lattice(self.lattice)
        codes = decode_codes(self.streams(), lat).float() * torch.tensor(lat.axis, dtype=torch.float32)
        return codes.reshape(self.out_features, self.in_features) * self.scales.float()[:, None]

    def dequantize(self):
        return unrotate(self.rotated_weight(), self._signs(), self.tile)

    def kernel_matmul(self, x2d):
        lat = get_lattice(self.lattice)
        w = stream_decoders.lattice_decode(self.payload, self.offsets, self.ks, self.in_features * self.out_features,
                                          self.stream_ends(), lat.name, self.scales.float(), self.in_features,
                                          lat.axis[0])
        return rotate(x2d, self._signs().to(x2d.device), self.tile) @ w.reshape(self.out_features, -1).T

    def stream_ends(self):
        return self.streams().stream_ends()

    def storage_bits(self):
        return 8 * (self.payload.numel() + self.ks.numel() + self.signs.numel()) + 32 * self.offsets.numel() \
            + 16 * self.scales.numel() + 64 * self.header.numel()


def quantize_weight(weight, lattice="E8", snr_db=21.0, tile=128, seed=0, bias=None):
    """weight [out, in] -> LatticeLinear at the given SNR (per row: noise = rms(W' row)^2 10^(-SNR/10))."""
    lat = get_lattice(lattice)
    in_f = weight.shape[1]
    tile = rotation_tile(in_f, tile)
    g = torch.Generator().manual_seed(seed)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (in_f,), generator=g).float()
    w = rotate(weight.detach().float(), signs, tile).double()
    alpha = w.pow(2).mean(1).sqrt()
    scales = (alpha * lattice_scale(snr_db, lat)).half()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))          # an all-zero row codes to zeros
    codes = closest_point((w / scales.double()[:, None]).reshape(-1, lat.n), lat)
    return LatticeLinear(encode_codes(codes, lat), scales, _pack_signs(signs), lat.name, in_f, tile, bias)


def quantize(model, calibration_ids=None, lattice="E8", bps=3.0, tile=128, seed=0):
    """Quantize every linear but lm_head in place (data-free: calibration_ids is unused). The target `bps` is the
    Rice payload rate of the Gaussian calibration table; layers report their full storage in bits_per_weight.
    Returns the quantization_config."""
    snr = snr_for_rate(bps, lattice)
    seeds = itertools.count(seed)                       # one rotation per layer, in module order
    replace_linears(model, lambda name, linear: quantize_weight(linear.weight, lattice, snr, tile, next(seeds),
                                                                linear.bias))
    return {"quant_method": "lattice", "lattice": lattice, "bps": bps, "snr_db": snr, "substream": SUBSTREAM,
            "rice_k_max": K_MAX, "rotation": "hadamard", "tile": tile, "seed": seed}


_PARTS = ("payload", "offsets", "ks", "scales", "signs", "header")


def _write(layer, config):
    return {name: getattr(layer, name) for name in _PARTS}


def _read(parts, config):
    in_f, out_f, tile, total_bits, crc = (int(v) for v in parts["header"])
    if parts["scales"].numel() != out_f:
        raise ValueError(f"header says {out_f} rows, scales has {parts['scales'].numel()}")
    streams = RiceStreams(parts["payload"], parts["offsets"], parts["ks"], in_f * out_f, total_bits, crc)
    return LatticeLinear(streams, parts["scales"], parts["signs"], config["lattice"], in_f, tile, parts.get("bias"))


CHECKPOINT = CheckpointMethod(name="lattice", parts=lambda config: _PARTS, read=_read, write=_write,
                              quantize=quantize)


# ---- KV cache ---------------------------------------------------------------------------------------------------

def haar_orthogonal(n, generator):
    """A Haar-uniform orthogonal matrix [n, n]: QR of a Gaussian matrix with R's diagonal signs moved into Q."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def voronoi_dither(shape, lattice, generator):
    """U [..., n] ~ Uniform(Voronoi cell of the unscaled lattice, real coordinates): uniform in a box that tiles
    space by a sublattice (4Z^8 in E8int, 2Z^4 in D4, (2 sqrt3 Z x 2Z) in A2, Z), then reduced mod the lattice."""
    lat = get_lattice(lattice)
    box = {"Z": 1.0, "A2": 2.0, "D4": 2.0, "E8": 4.0}[lat.name]
    axis = torch.tensor(lat.axis, dtype=torch.float64)
    u = torch.rand(*shape, lat.n, generator=generator, dtype=torch.float64) * box * axis
    return u - closest_point(u, lat) * axis


class KVQuantizer:
    """fn(k, v, layer_index) -> (k_hat, v_hat) for `model.set_kv_transform`: every head vector (last dim) is
    rotated (none / signs / Haar "qjl", drawn once per layer from `seed`), scaled by its rms alpha (kept in f16),
    quantized to the lattice at the SNR of the target rate (optionally with subtractive dither, fresh each call)
    and rotated back. `stats` counts scalars and coded bits (Rice payload, sub-stream metadata, alphas)."""

    def __init__(self, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0):
        if rotation not in ("none", "signs", "qjl"):
            raise ValueError(f"rotation must be none, signs or qjl, got {rotation!r}")
        self.lat = get_lattice(lattice)
        self.bps, self.rotation, self.dither, self.seed = bps, rotation, dither, seed
        self.beta = lattice_scale(snr_for_rate(bps, lattice), lattice)
        self.rotations = {}
        self.noise = torch.Generator().manual_seed(seed + 1_000_003)
        self.stats = {"scalars": 0, "payload_bits": 0, "metadata_bits": 0}

    def _rotation(self, layer, which, d):
        key = (layer, which)
        if key not in self.rotations:
            g = torch.Generator().manual_seed(self.seed * 1009 + 2 * layer + which)
            if self.rotation == "qjl":
                self.rotations[key] = haar_orthogonal(d, g)
            elif self.rotation == "signs":
                self.rotations[key] = torch.diag(1.0 - 2.0 * torch.randint(0, 2, (d,), generator=g).double())
            else:
                self.rotations[key] = None
        return self.rotations[key]

    def quantize(self, x, layer=0, which=0):
        """x [..., d] -> x_hat [..., d] (same dtype); d must be a multiple of the lattice dimension."""
        d = x.shape[-1]
        if d % self.lat.n:
            raise ValueError(f"head_dim {d} is not a multiple of {self.lat.name}'s dimension {self.lat.n}")
        s = self._rotation(layer, which, d)
        y = x.double() if s is None else x.double() @ s.T
        alpha = y.pow(2).mean(-1, keepdim=True).sqrt().half().double()
        scale = torch.where(alpha > 0, alpha * self.beta, torch.ones_like(alpha))
        axis = torch.tensor(self.lat.axis, dtype=torch.float64)
        z = (y / scale).reshape(*y.shape[:-1], d // self.lat.n, self.lat.n)
        u = voronoi_dither(z.shape[:-1], self.lat, self.noise) if self.dither else torch.zeros_like(z)
        codes = closest_point(z + u, self.lat)
        y_hat = (codes * axis - u).reshape(y.shape) * scale
        self._count(codes, y.shape)
        x_hat = y_hat if s is None else y_hat @ s
        return x_hat.to(x.dtype)

    def _count(self, codes, shape):
        n = codes.numel()
        payload = rice_bits(strip(codes.reshape(-1, self.lat.n), self.lat), self.lat)
        self.stats["scalars"] += n
        self.stats["payload_bits"] += payload
        self.stats["metadata_bits"] += STREAM_META_BITS * -(-n // SUBSTREAM) + 16 * (n // shape[-1])   # + alphas

    def __call__(self, k, v, layer_index):
        return self.quantize(k, layer_index, 0), self.quantize(v, layer_index, 1)

    def report(self):
        """Coded KV rate: payload and total bits per scalar, and the total as a fraction of bf16."""
        n = max(self.stats["scalars"], 1)
        total = (self.stats["payload_bits"] + self.stats["metadata_bits"]) / n
        return {"payload_bps": self.stats["payload_bits"] / n, "total_bps": total, "vs_bf16": total / 16}


def kv_quantize(model, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0):
    """Install a KVQuantizer on the model's attention hook (weights untouched); returns it (see .report())."""
    fn = KVQuantizer(lattice, bps, rotation, dither, seed)
    model.set_kv_transform(fn)
    return fn


def bench(symbols=1 << 22, bps=3.0):
    """Rice encode / CPU decode throughput (M symbols/s) on Gaussian data at `bps`, per lattice."""
    import time
    for name, lat in LATTICES.items():
        x = torch.randn(symbols // lat.n, lat.n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        stripped = strip(closest_point(x / lattice_scale(snr_for_rate(bps, name), name), name), name)
        start = time.perf_counter()
        streams = rice_encode(stripped, name)
        encode = time.perf_counter() - start
        start = time.perf_counter()
        decoded = rice_decode(streams, name)
        decode = time.perf_counter() - start
        if not torch.equal(decoded, stripped):
            raise AssertionError(f"{name}: Rice round trip failed")
        print(f"{name}: {stripped.numel()} symbols in {streams.streams} sub-streams, "
              f"{streams.total_bits / stripped.numel():.3f} bps; encode {stripped.numel() / encode / 1e6:.1f}, "
              f"decode {stripped.numel() / decode / 1e6:.1f} M symbols/s")


if __name__ == "__main__":
    if sys.argv[1:] == ["calibrate"]:
        t = calibrate()
        print(f"wrote {TABLE_PATH}: " + ", ".join(f"{n} {np.interp(21.0, t['snr_db'], t['bps'][n]):.3f}"
                                                  for n in LATTICES) + " bps at 21 dB")
    elif sys.argv[1:] == ["bench"]:
        bench()
    else:
        raise SystemExit("usage: python -m engine.formats.lattice calibrate | bench")
