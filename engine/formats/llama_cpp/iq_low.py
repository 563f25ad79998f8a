"""llama.cpp's low-bit "IQ" types (ggml-quants.c: dequantize_row_iq*), decoded into the engine's integer layer.

A super-block of 256 weights has one f16 d and small integer sub-block scales ls; the weights come 8 (IQ3: 4) at
a time from a fixed codebook, a "grid" of lattice points: an index picks the point (its 8 or 4 levels), sign bits
flip its levels (IQ1: a shift delta = +-1/8 instead). The levels: G2 in {8, 25, 43}; G3 in {4, 12, ..., 52, 62}
(IQ3_XXS) or {1, 3, ..., 15} (IQ3_S); G1 in {-1, 0, 1}. s = -1 where the weight's sign bit is set, else 1.

  type     bytes  layout (in order)                                             weight                      group zero
  IQ2_XXS  66     f16 d, 8 x (4 B grid index, u32 = 4 x 7-bit sign index | ls << 28)
                                                                                d (0.5 + ls) / 4 * s G2     32    43
  IQ2_XS   74     f16 d, 32 u16 (9-bit index | sign index << 9), 8 B ls (two nibbles)
                                                                                d (0.5 + ls) / 4 * s G2     16    43
  IQ2_S    82     f16 d, 32 B index, 32 B sign bits, 8 B index bits 8-9, 8 B ls d (0.5 + ls) / 4 * s G2     16    43
  IQ3_XXS  98     f16 d, 64 B index (4 weights each), 8 u32 (4 x 7-bit sign index | ls << 28)
                                                                                d (0.5 + ls) / 2 * s G3     32    62
  IQ3_S    110    f16 d, 64 B index, 8 B index bit 8, 32 B sign bits, 4 B ls    d (1 + 2 ls) * s G3         32    15
  IQ1_S    50     f16 d, 32 B index, 8 u16 (4 x 3 index bits 8-10 | ls << 12 | delta sign << 15)
                                                                                d (1 + 2 ls) * (G1 + delta) 32    9
  IQ1_M    56     32 B index, 16 B (per 8 weights: 3 index bits | delta sign << 3), 4 u16 (4 x 3-bit ls, top
                  nibbles: d's 16 bits, lowest first)                           d (1 + 2 ls) * (G1 + delta) 16    9

A sign index picks ksigns_iq2xs[i]: its 7 bits and, as bit 7, their parity (an even count of minus signs); sign bit
j (kmask_iq2xs[j] = 1 << j) belongs to weight j of the 8. Index bits 8 and up come from a second field; in IQ1_M
each 4-bit field of the 16 bytes (low nibble first) serves one run of 8 weights, as do the sign bytes of IQ2_S /
IQ3_S. A group is where the scale changes: IQ2_XS / IQ2_S put two 4-bit ls in each byte, one per 16 weights; IQ1_M
has a 3-bit ls per 16 and a delta per 8 (inside the group: in the code).

Every type is an affine grid with an integer zero point, the engine's AffineQuantLinear: code = zero + s * level
(IQ1: zero + 8 (G1 + delta) = 9 + 8 G1 +- 1, scale d (1 + 2 ls) / 8), one uint8 per weight in [0, 2 zero], and
w = (code - zero) * scale. That is llama.cpp's float32 exactly. d has 11 significant bits, 1 + 2 ls < 32 has 5 (IQ1:
< 16, 4), and (0.5 + ls) / 4 = (1 + 2 ls) / 8 only adds powers of two (an f16's smallest, 2^-24, / 8 is far from
float32's subnormals), so each scale is exact, in at most 16 bits. C rounds scale * level (level <= 62: 6 bits; IQ1:
dl * (G1 + delta), the sum exact, 4 bits / 8), we round (code - zero) * scale: the same real number, of at most 22
bits, so both are exact and equal. No level (nor 8 G1 +- 1) is 0: a weight is 0 only where d is, and then with C's
sign. code * scale + offset (offset = -zero * scale), the engine layer's form, is exact too (code <= 124: 23 bits),
as a number (+0 where C has -0). The tables are llama.cpp's (MIT), in ggml_iq_grids.json next to this file, made
from ggml-common.h by scripts/extract_ggml_iq_grids.py.
"""
import base64
import functools
import json
from pathlib import Path

import torch

QK_K = 256
GRIDS = Path(__file__).resolve().with_name("ggml_iq_grids.json")


@functools.cache
def tables():
    """name -> llama.cpp's table [entries, bytes per entry]: uint8 (iq1s_grid: int8), byte j of a grid entry is the
    level of its weight j (the entry's bytes in little-endian memory order, what ggml's uint8_t pointer reads)."""
    out = {}
    for name, t in json.loads(GRIDS.read_text())["tables"].items():
        raw = bytearray(base64.b64decode(t["base64"]))
        out[name] = torch.frombuffer(raw, dtype=getattr(torch, t["dtype"])).reshape(t["entries"], -1)
    return out


def _f16(b, at):
    """The f16 at byte `at` (even) of each block: uint8 [n, bytes] -> float32 [n, 1]."""
    return b.view(torch.float16)[:, at // 2, None].float()


def _u16(b):
    """uint8 [n, 2k] -> int32 [n, k], little-endian."""
    b = b.int()
    return b[:, 0::2] | (b[:, 1::2] << 8)


def _u32(b):
    """uint8 [n, 4k] -> int64 [n, k], little-endian."""
    b = b.long()
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


def _split(x, width, count):
    """int [n, k] -> [n, k * count]: the `count` fields of `width` bits of each, lowest first."""
    shifts = torch.arange(0, width * count, width, dtype=x.dtype)
    return ((x[..., None] >> shifts) & (2 ** width - 1)).reshape(len(x), -1)


def _sign_bits(signs):
    """sign bytes uint8 [n, k] -> bool [n, 8k], weight j of each 8 negative where `signs & kmask_iq2xs[j]`."""
    return ((signs[..., None] & tables()["kmask_iq2xs"][:, 0]) != 0).reshape(len(signs), -1)


def _sign_index(index):
    """7-bit sign indices [n, k] -> bool [n, 8k] through ksigns_iq2xs (7 bits and their parity)."""
    return _sign_bits(tables()["ksigns_iq2xs"][index.long(), 0])


def _signed(grid, index, negative, zero):
    """grid indices [n, k] and sign bits bool [n, 256] -> codes uint8 [n, 256]: zero + s * level."""
    levels = tables()[grid][index.long()].reshape(len(index), -1).short()
    return (zero + torch.where(negative, -levels, levels)).to(torch.uint8)


def _shifted(index, minus, zero=9):
    """IQ1: grid indices [n, 32] and delta signs bool [n, 32] (one per 8 weights) -> codes uint8 [n, 256]:
    zero + 8 G1 + 1, or - 1 where the delta is negative (delta * 8 = +-1)."""
    g1 = tables()["iq1s_grid"][index.long()].short()                                   # [n, 32, 8]
    step = torch.where(minus, -1, 1).short()[..., None]
    return (zero + 8 * g1 + step).reshape(len(index), -1).to(torch.uint8)


# Each decoder: blocks uint8 [n, bytes] -> (codes uint8 [n, 256], scale float32 [n, 256 / group], offset = -zero *
# scale), w = (codes - zero) * scale; the float arithmetic of the scales is C's, in C's order.

def _decode_iq2_xxs(b):
    q = b[:, 2:].reshape(len(b), 8, 8)                       # per 32 weights: 4 grid indices, then the u32
    aux = _u32(q[:, :, 4:].reshape(len(b), -1))              # [n, 8]
    codes = _signed("iq2xxs_grid", q[:, :, :4].reshape(len(b), -1), _sign_index(_split(aux, 7, 4)), 43)
    scale = _f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.25
    return codes, scale, -43 * scale


def _decode_iq2_xs(b):
    q = _u16(b[:, 2:66])                                     # [n, 32]: 9-bit index | 7-bit sign index << 9
    codes = _signed("iq2xs_grid", q & 511, _sign_index(q >> 9), 43)
    scale = _f16(b, 0) * (0.5 + _split(b[:, 66:74], 4, 2).float()) * 0.25
    return codes, scale, -43 * scale


def _decode_iq2_s(b):
    index = b[:, 2:34].int() | (_split(b[:, 66:74].int(), 2, 4) << 8)
    codes = _signed("iq2s_grid", index, _sign_bits(b[:, 34:66]), 43)
    scale = _f16(b, 0) * (0.5 + _split(b[:, 74:82], 4, 2).float()) * 0.25
    return codes, scale, -43 * scale


def _decode_iq3_xxs(b):
    aux = _u32(b[:, 66:98])                                  # [n, 8]: 4 x 7-bit sign index | ls << 28
    codes = _signed("iq3xxs_grid", b[:, 2:66], _sign_index(_split(aux, 7, 4)), 62)
    scale = _f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.5
    return codes, scale, -62 * scale


def _decode_iq3_s(b):
    index = b[:, 2:66].int() | (_split(b[:, 66:74].int(), 1, 8) << 8)
    codes = _signed("iq3s_grid", index, _sign_bits(b[:, 74:106]), 15)
    scale = _f16(b, 0) * (1 + 2 * _split(b[:, 106:110].int(), 4, 2)).float()
    return codes, scale, -15 * scale


def _decode_iq1_s(b):
    qh = _u16(b[:, 34:50])                                   # [n, 8]
    index = b[:, 2:34].int() | (_split(qh, 3, 4) << 8)
    codes = _shifted(index.reshape(len(b), 8, 4), ((qh & 0x8000) != 0)[..., None].expand(-1, -1, 4))
    scale = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float() * 0.125
    return codes.reshape(len(b), -1), scale, -9 * scale


def _decode_iq1_m(b):
    sc = _u16(b[:, 48:56])                                   # [n, 4]
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = torch.stack([bits & 255, bits >> 8], 1).to(torch.uint8).view(torch.float16).float()      # [n, 1]
    field = _split(b[:, 32:48].int(), 4, 2)                  # [n, 32]: one per 8 weights
    codes = _shifted(b[:, :32].int() | ((field & 7) << 8), (field & 8) != 0)
    scale = d * (2 * _split(sc, 3, 4) + 1).float() * 0.125                                     # [n, 16]
    return codes, scale, -9 * scale


# name -> (decoder, group size, the integer zero point); codes are held 8 bits a weight
DECODERS = {"IQ2_XXS": (_decode_iq2_xxs, 32, 43), "IQ2_XS": (_decode_iq2_xs, 16, 43), "IQ2_S": (_decode_iq2_s, 16, 43),
            "IQ3_XXS": (_decode_iq3_xxs, 32, 62), "IQ3_S": (_decode_iq3_s, 32, 15), "IQ1_S": (_decode_iq1_s, 32, 9),
            "IQ1_M": (_decode_iq1_m, 16, 9)}
BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}
