"""Rice sub-streams: the lossless stage of HyperQuant (engine.formats.lattice), for non-negative integer symbols.

Rice code with parameter rice_k (a Golomb code of modulus 2^rice_k): m -> q = floor(m / 2^rice_k) zeros, a one,
then m mod 2^rice_k in rice_k bits, MSB first: q + 1 + rice_k bits, near-optimal for a geometric source when 2^rice_k
is about its mean. A quotient q >= ESCAPE = 15 escapes instead: 15 zeros, a one, m in RAW_BITS = 16 raw bits, so no
codeword exceeds 32 bits and a decoder always finds a whole codeword in a 32-bit window. Signed values go through
zig-zag first: zz(n) = 2n for n >= 0, -2n - 1 for n < 0.

Layout. Symbols are cut into sub-streams of SUBSTREAM = 512; each has a 32-bit start bit offset and one byte of Rice
parameters (level 0 in bits 0-2, level 1 in bits 3-5, each 0..RICE_K_MAX = 7), so every sub-stream decodes on its
own (one GPU thread each) and the metadata costs 40 / 512 = 0.078 bits per symbol. A vector layout `levels` (one
entry per symbol of a vector of len(levels), e.g. D4's (0, 0, 0, 1)) says which level codes each symbol. Each
sub-stream's rice_k per level is the one of 0..7 with the fewest bits: sum over symbols of min(q, 15) + 1 + rice_k,
plus 16 - rice_k per escape.

Integrity. A CRC32 covers the payload, offsets, Rice parameters, count, total_bits, substream and caller-given
`context` bytes (for a lattice layer: its lattice, shape, rotation tile, scales and signs); `validate` checks it and
every structural fact a decoder relies on, and raises ValueError before anything is decoded.
"""
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

SUBSTREAM = 512            # symbols per sub-stream
STREAM_META_BITS = 32 + 8  # per sub-stream: start bit offset, byte of Rice parameters
RICE_K_MAX = 7             # Rice parameters 0..7 (3 bits)
ESCAPE = 15                # a unary run this long means "RAW_BITS raw bits follow"
RAW_BITS = 16
ENCODE_CHUNK = 1 << 20     # rice_encode: symbols coded at once (its int64 temporaries: ~100 bytes each)


def rice_decode_reference(streams, levels=(0,)):
    """The textbook decoder: a bit reader, one codeword at a time. RiceStreams -> symbols [count] int64; symbol i is
    coded with its sub-stream's Rice parameter of level levels[i % len(levels)]."""
    streams.validate()
    bits = np.unpackbits(streams.payload.numpy()).tolist()
    symbols = []
    for s, (pos, end) in enumerate(zip(streams.offsets.tolist(), streams.stream_ends().tolist())):

        def read(n):                                     # the next n bits, MSB first, never past the sub-stream
            nonlocal pos
            if pos + n > end:
                raise ValueError(f"sub-stream {s} runs past its end at bit {end}: stream is corrupt")
            value = 0
            for bit in bits[pos:pos + n]:
                value = 2 * value + bit
            pos += n
            return value

        for i in range(s * streams.substream, min((s + 1) * streams.substream, streams.count)):
            rice_k = int(streams.rice_ks[s]) >> 3 * levels[i % len(levels)] & 7
            q = 0
            while read(1) == 0:                          # the unary quotient: zeros up to the first one
                q += 1
                if q > ESCAPE:
                    raise ValueError(f"sub-stream {s}: a unary run longer than the escape: stream is corrupt")
            symbols.append(read(RAW_BITS) if q == ESCAPE else q << rice_k | read(rice_k))
        if pos != end:
            raise ValueError(f"sub-stream {s} does not decode to its boundary (ends at bit {pos}, expected {end}): "
                             f"stream is corrupt")
    return torch.tensor(symbols, dtype=torch.int64)


_CLZ16 = np.array([16] + [16 - int(v).bit_length() for v in range(1, 1 << 16)], dtype=np.uint32)


def rice_decode(streams, levels=(0,)):
    """The fast decoder, equal to rice_decode_reference: RiceStreams -> symbols [count] int64 (NumPy). All sub-streams
    decode in lockstep: step j reads symbol j of every sub-stream through a 32-bit window at its bit position; the
    unary run is the window's count of leading zeros (a 16-bit lookup table: a valid codeword has its '1' there).
    Needs whole vectors: count and substream multiples of len(levels)."""
    streams.validate()
    return decode_lockstep(streams.payload.numpy(), streams.offsets.numpy(), streams.stream_ends().numpy(),
                           streams.rice_ks.numpy(), streams.count, streams.substream, levels)


def decode_lockstep(payload, offsets, ends, rice_ks, count, substream=SUBSTREAM, levels=(0,), dtype=np.int64):
    """rice_decode's body on NumPy arrays, with each sub-stream's end given (so that sub-streams cut from several
    streams, each padded to whole bytes, decode in one lockstep: the KV cache's pages): payload uint8 [bytes],
    offsets / ends [streams] (start and end bits), rice_ks uint8 [streams] -> symbols [count] of dtype (int32 holds
    every symbol: they are < 2^16). Every sub-stream but the last holds `substream` symbols; each start must lie
    inside the payload.

    The arithmetic is 32-bit (twice the lanes of 64-bit in each vector instruction): win[i] holds bytes i .. i+3,
    so bit p's window, win[p >> 3] << (p & 7), has at least 25 valid bits, which hold every codeword but an
    escape's (at most 15 + 7 = 22 bits); an escape's raw value is read from the window at bit p + 16."""
    n = len(levels)
    if count % n or substream % n:
        raise ValueError(f"{count} symbols in sub-streams of {substream} are not whole vectors of {n}")
    S = substream
    nb = payload.size
    ns = offsets.size
    start = offsets.astype(np.int64)
    inside = ns == 0 or 0 <= start.min() <= start.max() < 8 * nb
    if ns != -(-count // S) or rice_ks.size != ns or ends.size != ns or not inside:
        raise ValueError(f"{ns} sub-streams with {rice_ks.size} Rice parameters and {ends.size} ends do not hold "
                         f"{count} symbols of a {nb}-byte payload")
    # Zero padding past the end: every start lies inside the payload and a step moves at most 32 bits, so even a
    # corrupt sub-stream never reads past 4 S more bytes.
    padded = np.zeros(nb + 4 * S + 16, dtype=np.uint8)
    padded[:nb] = payload
    windows = padded.size - 3
    win = np.empty(windows, dtype=np.uint32)
    for a in range(4):                                                          # the windows at bytes a, a + 4, ...
        win[a::4] = np.frombuffer(padded, dtype=">u4", count=(windows - a + 3) // 4, offset=a)
    pos = start.astype(np.uint32 if 8 * padded.size < 2 ** 32 else np.uint64)
    packed = rice_ks.astype(np.uint32)
    rice_k = np.stack([packed & 7, (packed >> 3) & 7])                          # [2 levels, streams]
    shift, mask, length_k = 31 - rice_k, (np.uint32(1) << rice_k) - 1, rice_k + 1
    last_count = count - (ns - 1) * S
    out = np.zeros((S, ns), dtype=dtype)
    bad = np.zeros(ns, dtype=bool)
    # Every step runs in the same buffers (no allocation) and gathers with np.take (its indices lie in range by
    # construction, so mode="clip" never clips): at a few thousand lanes, half the time of fresh arrays and indexing.
    at, w, q, rem, esc = (np.empty(ns, t) for t in (pos.dtype, np.uint32, np.uint32, np.uint32, bool))
    lanes = None
    for j in range(S):
        if lanes != (ns if j < last_count else ns - 1):                         # the last sub-stream is shorter
            lanes = ns if j < last_count else ns - 1
            p, a, wj, qj, r, e = (x[:lanes] for x in (pos, at, w, q, rem, esc))
            per_level = [(shift[v, :lanes], mask[v, :lanes], length_k[v, :lanes], rice_k[v, :lanes]) for v in (0, 1)]
        sh, mk, lk, rk = per_level[levels[j % n]]
        np.right_shift(p, 3, out=a)
        np.take(win, a, out=wj, mode="clip")
        np.bitwise_and(p, 7, out=a)
        np.left_shift(wj, a, out=wj, casting="unsafe")                          # bits p .. p+24 (at least), MSB first
        np.right_shift(wj, 16, out=r)
        np.take(_CLZ16, r, out=qj, mode="clip")                                 # the unary run
        np.subtract(sh, qj, out=r)
        np.right_shift(wj, r, out=r)
        np.bitwise_and(r, mk, out=r)                                            # the remainder
        np.add(p, qj, out=p)
        np.add(p, lk, out=p)
        np.greater_equal(qj, ESCAPE, out=e)
        escapes = e.any()
        if escapes:                                                             # rare: a raw 16-bit value
            i = np.flatnonzero(e)
            bad[i] |= qj[i] > ESCAPE
            raw_at = p[i] - qj[i] - lk[i] + (ESCAPE + 1)                        # the codeword's start + 16
        np.left_shift(qj, rk, out=qj)
        np.bitwise_or(qj, r, out=out[j, :lanes], casting="unsafe")
        if escapes:
            out[j, i] = (win[raw_at >> 3] << (raw_at & 7).astype(np.uint32)) >> (32 - RAW_BITS)
            p[i] = raw_at + RAW_BITS                                            # 32 bits on, corrupt or not
    wrong = bad | (pos != ends)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise ValueError(f"sub-stream {i} does not decode to its boundary (ends at bit {pos[i]}, expected {ends[i]}): "
                         f"stream is corrupt")
    return torch.from_numpy(out).t().reshape(-1)[:count]        # torch's transposing copy is blocked: 2-3x NumPy's


def zigzag(n):
    """signed int64 -> non-negative: 0, -1, 1, -2, 2 ... -> 0, 1, 2, 3, 4 ..."""
    return (n << 1) ^ (n >> 63)


def unzigzag(m):
    return (m >> 1) ^ -(m & 1)


def rice_lengths(m, rice_k):
    """Bits of each codeword: symbols m, parameters rice_k (NumPy int64 arrays, same shape) -> int64 array."""
    q = m >> rice_k
    return np.where(q < ESCAPE, q + 1 + rice_k, ESCAPE + 1 + RAW_BITS)


def choose_rice_ks(symbols, levels=(0,), substream=SUBSTREAM):
    """symbols [N] (int64, whole vectors) -> rice_ks [streams, 2] int64: per sub-stream and level, the rice_k in
    0..RICE_K_MAX with the fewest bits. Each candidate needs only per-stream sums of the clamped quotients and escape
    counts (NumPy: its integer reductions are several times faster than torch's here)."""
    n = len(levels)
    count = symbols.numel()
    streams = -(-count // substream)
    m = np.zeros(streams * substream, dtype=np.int32)
    m[:count] = symbols.numpy()
    m = m.reshape(streams, substream // n, n).transpose(0, 2, 1).copy()           # [streams, n, S / n]
    live = np.zeros(streams * substream, dtype=np.int64)
    live[:count] = 1
    level = np.eye(2, dtype=np.int64)[list(levels)]                                # [n, 2]
    symbols_per_level = live.reshape(streams, -1, n).sum(1) @ level               # [streams, 2]
    cost = []
    for rice_k in range(RICE_K_MAX + 1):
        q = np.minimum(m >> rice_k, ESCAPE)
        quotients = q.sum(-1, dtype=np.int64) @ level
        escapes = (q == ESCAPE).sum(-1, dtype=np.int64) @ level
        cost.append(quotients + symbols_per_level * (1 + rice_k) + escapes * (RAW_BITS - rice_k))
    return torch.from_numpy(np.stack(cost, -1).argmin(-1))


def symbol_rice_ks(rice_ks, count, levels=(0,), substream=SUBSTREAM):
    """rice_ks [streams, 2] -> the rice_k of each of `count` symbols (NumPy int64 [count])."""
    index = np.arange(count)
    return rice_ks.numpy()[index // substream, np.array(levels)[index % len(levels)]]


def rice_bits(symbols, levels=(0,), substream=SUBSTREAM):
    """Exact payload bits rice_encode emits for these symbols (the best rice_k per sub-stream), without building the
    stream: what the KV cache and the rate table count."""
    flat = symbols.reshape(-1)
    rice_k = symbol_rice_ks(choose_rice_ks(flat, levels, substream), flat.numel(), levels, substream)
    return int(rice_lengths(flat.numpy(), rice_k).sum())


def stream_ends(offsets, total_bits):
    """offsets [streams] -> int64 [streams] on their device: where each sub-stream must end (the next one's start;
    the last ends at total_bits)."""
    return torch.cat([offsets[1:].long(), offsets.new_tensor([total_bits], dtype=torch.long)])


@dataclass
class RiceStreams:
    """A serialized symbol stream: payload uint8 [bytes] (MSB-first bits), offsets int32 [streams] (start bit of each
    sub-stream), rice_ks uint8 [streams] (level 0 in bits 0-2, level 1 in bits 3-5), count (symbols), total_bits,
    crc (see `checksum`), substream (symbols per sub-stream; 512 in every format here, smaller only to keep
    interpreted kernel tests short), context (side data the crc covers too). `seal` computes the crc; `validate`
    checks everything a decoder relies on and raises ValueError naming the first problem."""
    payload: torch.Tensor
    offsets: torch.Tensor
    rice_ks: torch.Tensor
    count: int
    total_bits: int
    crc: int
    substream: int = SUBSTREAM
    context: bytes = b""

    def checksum(self):
        """CRC32 of everything the bits mean: the sizes, payload, offsets, Rice parameters and context."""
        crc = zlib.crc32(struct.pack("<3q", self.count, self.total_bits, self.substream))
        for part in (self.payload, self.offsets, self.rice_ks):
            crc = zlib.crc32(part.numpy().tobytes(), crc)
        return zlib.crc32(self.context, crc)

    @classmethod
    def seal(cls, payload, offsets, rice_ks, count, total_bits, substream=SUBSTREAM, context=b""):
        streams = cls(payload.to(torch.uint8), offsets.to(torch.int32), rice_ks.to(torch.uint8), int(count),
                      int(total_bits), 0, substream, context)
        streams.crc = streams.checksum()
        return streams

    @property
    def streams(self):
        return self.offsets.numel()

    def stream_ends(self):
        return stream_ends(self.offsets, self.total_bits)

    def stream_counts(self):
        counts = torch.full((self.streams,), self.substream, dtype=torch.long)
        counts[-1] = self.count - (self.streams - 1) * self.substream
        return counts

    def validate(self):
        for name, t, dtype in (("payload", self.payload, torch.uint8), ("offsets", self.offsets, torch.int32),
                               ("rice_ks", self.rice_ks, torch.uint8)):
            if t.dtype != dtype or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
        if not isinstance(self.substream, int) or self.substream <= 0:
            raise ValueError(f"substream must be a positive int, got {self.substream!r}")
        if self.count <= 0 or self.streams != -(-self.count // self.substream):
            raise ValueError(f"{self.streams} sub-streams cannot hold {self.count} symbols of {self.substream}")
        if self.rice_ks.numel() != self.streams:
            raise ValueError(f"{self.rice_ks.numel()} Rice parameter bytes for {self.streams} sub-streams")
        if int((self.rice_ks >> 6).max()) != 0:
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
        if self.checksum() != self.crc:
            raise ValueError("stream checksum mismatch: payload, offsets, Rice parameters, sizes or side data "
                             "(context) are corrupt")


def rice_encode(symbols, levels=(0,), substream=SUBSTREAM, context=b""):
    """symbols [N] (integers in [0, 2^16), whole vectors of len(levels)) -> RiceStreams sealed with `context`.
    Vectorized, ENCODE_CHUNK symbols (whole sub-streams) at a time, so that the extra memory is O(chunk) and not a
    few int64 copies of the tensor: each codeword's length, a prefix sum for its position, then its bits after its
    leading zeros (at most 17) added into the (at most 3) bytes they touch. A chunk's bytes start at the byte
    holding its first bit, which it shares with the chunk before when that one ends inside it."""
    flat = symbols.reshape(-1)
    n = len(levels)
    if flat.numel() == 0:
        raise ValueError("nothing to encode")
    if flat.numel() % n or substream <= 0 or substream % n:
        raise ValueError(f"{flat.numel()} symbols in sub-streams of {substream} are not whole vectors of {n}")
    if int(flat.min()) < 0 or int(flat.max()) >= 1 << RAW_BITS:
        raise ValueError(f"Rice symbols must lie in [0, 2^{RAW_BITS}), got [{int(flat.min())}, {int(flat.max())}]"
                         " (lattice scale too fine?)")
    count = flat.numel()
    step = substream * max(8, ENCODE_CHUNK // substream)          # >= 8 bits: a chunk always has a byte its own
    pieces, offsets, ks, bit = [], [], [], 0                          # bit: where the next chunk starts
    for first in range(0, count, step):
        chunk = flat[first:first + step].long()
        rice_ks = choose_rice_ks(chunk, levels, substream)            # [chunk's streams, 2]
        m = chunk.numpy()
        rice_k = symbol_rice_ks(rice_ks, m.size, levels, substream)
        esc = (m >> rice_k) >= ESCAPE
        length = rice_lengths(m, rice_k)
        end = bit + np.cumsum(length)                                 # each codeword's end, in the whole payload
        if int(end[-1]) >= 2 ** 31:
            raise ValueError("tensor too large for 32-bit sub-stream offsets")
        value = np.where(esc, m | (1 << RAW_BITS), (m & ((1 << rice_k) - 1)) | (1 << rice_k))  # '1' and what follows
        last = end - 1 - 8 * (bit >> 3)                               # the codeword's final bit, from the chunk's
        aligned = value << (7 - (last & 7))                           # <= 24 bits ending at that byte's LSB
        byte = last >> 3
        # Codewords occupy disjoint bits, so summing their bytes is OR-ing them.
        chunk_bytes = sum(np.bincount(np.maximum(byte - i, 0), weights=(aligned >> (8 * i)) & 255,
                                      minlength=int(byte[-1]) + 1) for i in range(3)).astype(np.uint8)
        if bit & 7:                                                   # the byte shared with the chunk before
            pieces[-1][-1] |= chunk_bytes[0]
            chunk_bytes = chunk_bytes[1:]
        pieces.append(chunk_bytes)
        offsets.append((end - length)[::substream].copy())              # a copy: the view would keep the chunk
        ks.append(rice_ks)
        bit = int(end[-1])
    rice_ks = torch.cat(ks)
    return RiceStreams.seal(torch.from_numpy(np.concatenate(pieces)), torch.from_numpy(np.concatenate(offsets)),
                            rice_ks[:, 0] | (rice_ks[:, 1] << 3), count, bit, substream, context)
