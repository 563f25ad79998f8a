"""rANS: a lossless coder of byte symbols against a static frequency table, in lanes that decode in lockstep.

Table: f [256] with sum 2^p (p = prob_bits, 14 by default), f[s] >= 1 for every symbol present; c[s] = f[0] + ...
+ f[s - 1]. A state x in [2^16, 2^32) holds the coded symbols:

    encode  x' = (x // f[s]) 2^p + x mod f[s] + c[s]                          (x' ~ x 2^p / f[s]: -log2 p(s) bits)
    decode  slot = x mod 2^p,  s = the symbol with c[s] <= slot < c[s] + f[s],  x = f[s] (x >> p) + slot - c[s]

Before a push would carry x past 2^32 (x >= f[s] 2^(32-p)) the encoder hands the low 16 bits of x to the stream;
the decoder takes a 16-bit word back whenever x falls below 2^16. rANS is a stack: the encoder runs from the last
symbol to the first, the decoder reads forward.

Why p = 14 and not 15: a push costs -log2 p(s) bits only up to the rounding in x // f[s], whose cost grows with
2^p / x (x may be as low as 2^16), and one bit less precision halves it; for the codes EntQuant makes this saves more
than the coarser table loses to rounding f (benchmarks/coders.py measures both).

Lanes: symbol i goes to lane i mod lanes, so the lanes decode one symbol each per step, in lockstep. They are
grouped lanes_per_stream at a time into sub-streams, each with its own words, so that a GPU program decodes one
sub-stream and its lanes find their next word with a prefix sum over who reads. Rate: n H bits, plus 32 bits of
final state per lane and of word count per sub-stream, the table and 24 bytes of header and checksum; the default
lane count keeps n / lanes >= 3072 steps, so that this overhead stays under 1% for blocks of >= 1M symbols at >= 2
bits.

Stream, version 2 (little-endian):
    header   magic "rANS", version u8, prob_bits u8, lanes_per_stream u16, n u64, sub-streams u32
    table    a 256-bit presence map, then f u16 of each present symbol
    states   u32 [sub-streams, lanes_per_stream]: the encoder's final states, where decoding starts
    counts   u32 [sub-streams]: words per sub-stream
    words    u16, sub-stream after sub-stream, each in the order its decoder reads them
    crc32    u32: zlib.crc32 of every byte above, then of len(context) (u64) and context, the caller's side data
             bound to the stream (a stream is refused unless the same context is given back when it is read)

Below: the textbook coder, one symbol at a time; then the table and the stream format. The fast coder, which
computes the same bytes with NumPy over all lanes at once, and over the lanes of many blocks at once (a model's
blocks in one pass: rans_encode_many), is rans_fast.py; tests pin them equal.
"""
import math
import struct
import zlib

import numpy as np
import torch

PROB_BITS = 14                      # default table precision: sum of f = 2^14 (why: see above)
STATE_LOW = 1 << 16                 # x lives in [2^16, 2^32): one 16-bit word per renormalization
LANES_PER_STREAM = 32               # one GPU warp per sub-stream
MIN_STEPS = 3072                    # default lanes: symbols per lane at least, so that states cost < 1%
MAX_LANES = 4096                    # default lanes: at most
LANES_LIMIT = 1 << 20               # lanes a caller may ask for (4 bytes of state each)
ONE_SYMBOL_LIMIT = 1 << 32          # a one-symbol stream's count is trusted up to here (its words bound nothing)
DECODE_CHUNK = 1 << 15              # fast decoder: symbols per batch of deferred symbol lookups
ENCODE_CHUNK = 1 << 16              # fast encoder: symbols per batch of table lookups made at once
ENCODE_BATCH = 1 << 24              # rans_encode_many: symbols coded side by side at most (~7 bytes each)
VERSION = 2                         # 1: no checksum
_MAGIC = b"rANS"
_HEADER = struct.Struct("<4sBBHQI")  # magic, version, prob_bits, lanes per stream, n, sub-streams
_CRC = struct.Struct("<I")


# ---- the textbook coder ------------------------------------------------------------------------------------------

def rans_decode_reference(data, n=None, context=b""):
    """The textbook decoder, one symbol at a time: bytes from rans_encode -> torch.uint8 [n]. Symbol i is the next
    symbol of lane i mod lanes; a lane whose state falls below 2^16 takes the next word of its sub-stream."""
    stream = data if isinstance(data, RansStream) else RansStream(data, n, context)
    p, width, f = stream.prob_bits, stream.states.shape[1], stream.f.tolist()
    c = (np.cumsum(f) - f).tolist()                             # c[s] = f[0] + ... + f[s - 1]
    symbol_of_slot = np.repeat(np.arange(256), f).tolist()     # slot in [c[s], c[s] + f[s]) -> s
    x, next_word = stream.states.reshape(-1).tolist(), stream.starts[:-1].tolist()
    ends, words = stream.starts[1:].tolist(), stream.words.tolist()
    out = np.empty(stream.n, np.uint8)
    for i in range(stream.n):
        lane = i % len(x)
        slot = x[lane] & ((1 << p) - 1)
        s = symbol_of_slot[slot]
        out[i] = s
        x[lane] = f[s] * (x[lane] >> p) + slot - c[s]
        if x[lane] < STATE_LOW:
            sub = lane // width
            if next_word[sub] == ends[sub]:
                raise ValueError(f"rANS stream corrupted: sub-stream {sub} read past its end")
            x[lane] = x[lane] << 16 | words[next_word[sub]]
            next_word[sub] += 1
    check_final(stream, x, np.array(next_word) - stream.starts[:-1])
    return torch.from_numpy(out)


def rans_encode_reference(symbols, lanes=None, lanes_per_stream=LANES_PER_STREAM, prob_bits=PROB_BITS,
                          context=b""):
    """The textbook encoder, from the last symbol to the first: uint8 symbols [n] -> the bytes rans_encode gives."""
    symbols, lanes = check_encode_arguments(symbols, lanes, lanes_per_stream, prob_bits, context)
    f = quantize_frequencies(np.bincount(symbols, minlength=256), prob_bits)
    f, c = f.tolist(), (np.cumsum(f) - f).tolist()
    x = [STATE_LOW] * lanes
    words = [[] for _ in range(lanes // lanes_per_stream)]     # per sub-stream, in the order they are written
    for i in reversed(range(symbols.size)):
        lane, s = i % lanes, int(symbols[i])
        if x[lane] >= f[s] << (32 - prob_bits):                  # x' would not fit 32 bits: hand 16 of them over
            words[lane // lanes_per_stream].append(x[lane] & 0xFFFF)
            x[lane] >>= 16
        x[lane] = (x[lane] // f[s] << prob_bits) + x[lane] % f[s] + c[s]
    reading_order = [w[::-1] for w in words]                    # a stack: read back in reverse
    return pack_stream(prob_bits, lanes_per_stream, symbols.size, np.array(f), x,
                       [len(w) for w in reading_order], [w for sub in reading_order for w in sub], context)


# ---- the frequency table -----------------------------------------------------------------------------------------

def empirical_entropy_bits(symbols):
    """n * H(empirical distribution) in bits: the floor any coder of these symbols (table not counted) meets."""
    counts = np.bincount(as_symbols(symbols), minlength=256).astype(np.float64)
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
    if int((counts > 0).sum()) > m:
        raise ValueError(f"{int((counts > 0).sum())} distinct symbols do not fit the 2^{prob_bits} = {m} slots of "
                         "the frequency table: raise prob_bits")
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


def slot_tables(f, prob_bits):
    """Per slot of [0, 2^prob_bits): its symbol, that symbol's frequency and slot - c[symbol] (the decoders'
    lookups), int64 [2^prob_bits] each."""
    c = np.cumsum(f) - f
    sym = np.repeat(np.arange(256), f).astype(np.int64)
    return sym, f[sym], np.arange(1 << prob_bits) - c[sym]


# ---- the stream format -------------------------------------------------------------------------------------------

def as_symbols(symbols):
    """A uint8 array or tensor (any shape) -> the flat uint8 NumPy array of its symbols."""
    if isinstance(symbols, torch.Tensor):
        symbols = symbols.detach().cpu().numpy()
    symbols = np.asarray(symbols)
    if symbols.dtype != np.uint8:
        raise ValueError(f"symbols must be uint8, got {symbols.dtype}")
    return symbols.reshape(-1)


def default_lanes(n, lanes_per_stream=LANES_PER_STREAM):
    """Lanes for n symbols: a power of two, a multiple of lanes_per_stream, with n / lanes >= MIN_STEPS where n allows
    (never fewer than lanes_per_stream lanes, at most MAX_LANES unless one sub-stream is wider)."""
    lanes = 1 << max(n // MIN_STEPS, 1).bit_length() - 1
    return int(min(max(lanes, lanes_per_stream), max(MAX_LANES, lanes_per_stream)))


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_context(context):
    if not isinstance(context, (bytes, bytearray, memoryview)):
        raise ValueError(f"context must be bytes (the side data bound to the stream), got {type(context).__name__}")


def check_encode_arguments(symbols, lanes, lanes_per_stream, prob_bits, context):
    """Everything an encoder needs that its decoders would refuse, refused first: -> (symbols [n] uint8, lanes)."""
    symbols = as_symbols(symbols)
    if not (_is_int(lanes_per_stream) and 1 <= lanes_per_stream <= 1 << 15
            and lanes_per_stream & (lanes_per_stream - 1) == 0):
        raise ValueError(f"lanes_per_stream must be a power of two in 1..32768 (a GPU program's width), got "
                         f"{lanes_per_stream!r}")
    lanes = default_lanes(symbols.size, lanes_per_stream) if lanes is None else lanes
    if not (_is_int(lanes) and 1 <= lanes <= LANES_LIMIT and lanes % lanes_per_stream == 0):
        raise ValueError(f"lanes ({lanes!r}) must be a positive multiple of lanes_per_stream ({lanes_per_stream}), "
                         f"at most {LANES_LIMIT}")
    if not (_is_int(prob_bits) and 1 <= prob_bits <= 15):
        raise ValueError(f"prob_bits must be an integer in 1..15, got {prob_bits!r}")
    _check_context(context)
    return symbols, int(lanes)


def _checksum(body, context):
    crc = zlib.crc32(body)
    return zlib.crc32(context, zlib.crc32(struct.pack("<Q", len(context)), crc))


def pack_stream(prob_bits, lanes_per_stream, n, f, states, counts, words, context=b""):
    """The stream's bytes (layout in the module docstring): f [256], final states [lanes], word counts
    [sub-streams], words (sub-stream by sub-stream, in reading order). Refuses, before writing, a stream that the
    decoder's size check would refuse."""
    bound = symbols_bound(f, prob_bits, len(words), len(states))
    if bound is not None and n > bound:
        raise ValueError(f"{n} symbols coded into {len(words)} words: more than the decoder's size check accepts "
                         f"({int(bound)}); code them with more lanes")
    present = f > 0
    body = b"".join([
        _HEADER.pack(_MAGIC, VERSION, prob_bits, lanes_per_stream, n, len(counts)),
        np.packbits(present, bitorder="little").tobytes(),
        f[present].astype("<u2").tobytes(),
        np.asarray(states, np.int64).astype("<u4").tobytes(),
        np.asarray(counts, np.int64).astype("<u4").tobytes(),
        np.asarray(words, np.int64).astype("<u2").tobytes(),
    ])
    return body + _CRC.pack(_checksum(body, context))


def symbols_bound(f, prob_bits, n_words, lanes):
    """The most symbols n_words words and `lanes` final states can hold, or None when nothing bounds them (one
    symbol takes the whole table and costs nothing). Every symbol costs at least log2(2^prob_bits / max f) bits and
    a lane's state holds at most 16 bits more than its start."""
    top = int(np.max(f)) if len(f) else 0
    if not 0 < top < 1 << prob_bits:
        return None
    return 16 * (n_words + lanes) / (prob_bits - math.log2(top)) + lanes


class RansStream:
    """A parsed, checked stream: n, prob_bits, f [256], states [S, W] int64 (S sub-streams of W lanes), starts
    [S + 1] (word offsets of the sub-streams), words [total] int64. The checksum is verified against `context`
    before anything else is read; anything malformed raises ValueError. A symbol can cost almost nothing, so the
    data's length does not bound n: pass the n you expect (a block knows its weight count) to bound the work."""

    def __init__(self, data, n=None, context=b""):
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8:
                raise ValueError(f"an rANS stream tensor must be uint8, got {data.dtype}")
            data = data.detach().cpu().numpy().tobytes()
        _check_context(context)
        data = bytes(data)
        if len(data) < _HEADER.size + 32 + _CRC.size:
            raise ValueError(f"rANS stream truncated: {len(data)} bytes is shorter than its header")
        magic, version, self.prob_bits, w, self.n, s = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise ValueError("not an rANS stream (bad magic)")
        if version != VERSION:
            raise ValueError(f"rANS stream format version {version} was written by an older engine (this one reads "
                             f"version {VERSION}, with a checksum): quantize the model again" if version < VERSION
                             else f"rANS stream format version {version} is newer than this engine ({VERSION})")
        if _checksum(memoryview(data)[:-_CRC.size], context) != _CRC.unpack_from(data, len(data) - _CRC.size)[0]:
            raise ValueError("rANS stream checksum mismatch: the stream's bytes, or the side data bound to it "
                             "(context), changed since it was written")
        if not 1 <= self.prob_bits <= 15 or w == 0 or w & (w - 1) or s == 0:
            raise ValueError(f"bad rANS header: prob_bits {self.prob_bits}, {w} lanes per stream, {s} streams")
        if n is not None and self.n != n:
            raise ValueError(f"rANS stream holds {self.n} symbols, expected {n}")
        pos = _HEADER.size
        present = np.unpackbits(np.frombuffer(data, np.uint8, 32, pos), bitorder="little").astype(bool)
        pos += 32
        n_sym = int(present.sum())
        need = pos + 2 * n_sym + 4 * s * w + 4 * s + _CRC.size
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
        if len(data) != pos + 2 * int(self.starts[-1]) + _CRC.size:
            raise ValueError(f"rANS stream has {len(data)} bytes, its header promises "
                             f"{pos + 2 * int(self.starts[-1]) + _CRC.size}")
        self.words = np.frombuffer(data, "<u2", int(self.starts[-1]), pos).astype(np.int64)
        if self.n and (int(self.f.sum()) != 1 << self.prob_bits or (self.f[present] == 0).any()):
            raise ValueError("rANS frequency table does not sum to 2^prob_bits")
        if ((self.states < STATE_LOW) | (self.states >= 1 << 32)).any():
            raise ValueError("rANS start state out of range")
        # A corrupted count is refused here instead of starting a decode that would never end.
        most = symbols_bound(self.f, self.prob_bits, len(self.words), self.states.size) if self.n else None
        if most is not None and self.n > most:
            raise ValueError(f"rANS header claims {self.n} symbols, its {len(self.words)} words hold at most "
                             f"{int(most)}")
        if most is None and self.n > ONE_SYMBOL_LIMIT and n is None:
            raise ValueError(f"one-symbol rANS stream claims {self.n} symbols: its size cannot confirm that, pass the "
                             "n you expect")

    def tensors(self, device):
        """What the Triton decoder takes, as torch tensors on device: (states [S, W], starts [S + 1], words,
        slot symbol / frequency / bias tables [2^prob_bits])."""
        sym, f, bias = slot_tables(self.f, self.prob_bits) if self.n else np.zeros((3, 1 << self.prob_bits),
                                                                                   np.int64)
        arrays = (self.states, self.starts, self.words, sym.astype(np.uint8), f, bias)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)


def check_final(stream, x, read):
    """After decoding, every lane must be back at the encoder's start state and every sub-stream read exactly to its
    end (read [S]: words each read); anything else means the stream was corrupted."""
    if (np.asarray(read) != np.diff(stream.starts)).any() or (np.asarray(x) != STATE_LOW).any():
        raise ValueError("rANS stream corrupted: final states or read positions do not match")
