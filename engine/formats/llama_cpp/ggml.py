"""GGML's block formats (what GGUF files store), decoded into the engine's layers without dequantizing.

A row of n weights is n / B blocks of `size` bytes; f16 is an IEEE half, "q" the codes, a K-quant super-block
holds 256 weights in sub-blocks of 16 or 32 with their own scales. Every integer type is an affine grid per group
(w = q * scale + offset) with these exact groups, so each loads as an AffineQuantLinear:

  type   B    bytes  layout                                      weight                     group  codes
  Q4_0   32   18     f16 d, 16 B nibbles                         d * (q - 8)                32     4-bit
  Q4_1   32   20     f16 d, f16 m, 16 B nibbles                  d * q + m                  32     4-bit
  Q5_0   32   22     f16 d, u32 high bits, 16 B nibbles          d * (q - 16)               32     8-bit
  Q5_1   32   24     f16 d, f16 m, u32 high bits, 16 B nibbles   d * q + m                  32     8-bit
  Q8_0   32   34     f16 d, 32 int8                              d * q   (codes q + 128)    32     8-bit
  Q2_K   256  84     16 B (4-bit sc | 4-bit m << 4), 64 B 2-bit q, f16 d, f16 dmin
                                                                 d * sc * q - dmin * m      16     2-bit
  Q3_K   256  110    32 B high bits, 64 B 2-bit q, 12 B 6-bit sc, f16 d
                                                                 d * (sc - 32) * (q - 4)    16     4-bit
  Q4_K   256  144    f16 d, f16 dmin, 12 B 6-bit (sc, m) x 8, 128 B nibbles
                                                                 d * sc * q - dmin * m      32     4-bit
  Q5_K   256  176    as Q4_K + 32 B high bits                    d * sc * q - dmin * m      32     8-bit
  Q6_K   256  210    128 B low nibbles, 64 B 2-bit high, 16 int8 sc, f16 d
                                                                 d * sc * (q - 32)          16     8-bit
  IQ4_NL 32   18     f16 d, 16 B nibbles                         d * K[q]                   32     8-bit
  IQ4_XS 256  136    f16 d, u16 scales_h, 4 B scales_l, 128 B nibbles
                                                                 d * (l - 32) * K[q]        32     8-bit
  IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (256, 1.56 to 3.44 bits): codebook types, read only; each is
         an integer grid too, levels +- a codebook point's (iq_low.py)            16 / 32 8-bit
  MXFP4  32   17     E8M0 byte e, 16 B nibbles                   E2M1(q) * 2^(e - 127)      -> MXFP4Linear
  NVFP4  64   36     4 E4M3 scales (one per 16), 32 B nibbles    E2M1(q) * s_16 * t         -> NVFP4Linear

(Q3_K's stored bit is "not 4": q = low 2 bits + 4 * high bit, minus 4. NVFP4's per-tensor factor t is not in the
blocks: llama.cpp keeps it in a separate F32 [1] tensor `<name>.scale` and multiplies the matmul's output by it.)
The IQ4 types are not integer grids: K = kvalues_iq4nl, 16 fixed levels (-127 ... 113) denser near zero; the engine
holds K[q] + 128 as an 8-bit code with the zero point 128, so they too are affine layers (IQ4_XS's six-bit l of each
32 weights: low 4 bits in scales_l, sub-block 2i low and 2i + 1 high, top 2 bits at bit 2j of scales_h). Products of
an f16 and a small integer are exact in float32, so q * scale + offset gives exactly ggml's float32 values (as
numbers: ggml's d * (q - 8) is -0 where this is +0). Codes of 5 and 6 bits are held one per byte in memory (the
engine packs 1, 2, 4 or 8 bits), scales and offsets as float32; what a layer costs (storage_bits) is its blocks'
size, super-block scales packed as stored.

Bit order: ggml never interleaves neighbours. In a run of S bytes, bits [f*b, f*b + b) of byte j hold element
f * S + j (`_fields`): Q4_0 nibbles are element j low, j + 16 high (S = 16, the "split" layout of mx.py); Q4_K / Q5_K
runs of 32 bytes cover 64 weights; Q2_K / Q3_K 2-bit runs of 32 bytes cover 128; the high-bit planes of Q3_K / Q5_K
are 8 planes of 32; NVFP4 runs of 8 bytes cover each sub-block of 16. Q5_0's u32 is plain little-endian, bit i =
element i.

A layer read from GGML blocks is a `GGMLLinear`: an AffineQuantLinear (codes, per-group scale and offset: the
engine's one integer layer and kernel) that also keeps the blocks it came from, so a file is written back byte for
byte and its size is the blocks' (Q4_K: 4.5 bits per weight); loaded to run, it is a `GGMLCodes`, the same without
the blocks, its size still theirs. GPTQ's GGML grids (engine/formats/llama_cpp/gptq_ggml.py) build their layers the
same way, from blocks.

The writer's side is the inverse of the decoders: `encode` for the 32-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4,
NVFP4: codes, per-block scale and offset), `encode_k` for the K-quants (codes, the super-block's f16 d / dmin and
its integer sub-block scales / mins), `encode_iq4` for IQ4_NL / IQ4_XS; ggml_quants.py and iq4.py hold llama.cpp's
own quantizers that choose them, gguf_writer.py decides which layer goes where.
"""
import torch

from ..numerics.affine import AffineQuantLinear, pack_bits, pack_nibbles, unpack_bits
from ..numerics.minifloats import E2M1, e8m0_to_float
from ..mx import MXFP4Linear, NVFP4Linear
from . import iq_low

QK_K = 256

# GGML's type table (ggml.h): name -> (id, weights per block, bytes per block). All of it is listed so that any
# file can be parsed and sized; only the types below are decoded.
GGML_TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50),
    "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136),
    "I8": (24, 1, 1), "I16": (25, 1, 2), "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8),
    "IQ1_M": (29, 256, 56), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17), "NVFP4": (40, 64, 36), "Q1_0": (41, 128, 18),
}
TYPE_NAMES = {type_id: name for name, (type_id, _, _) in GGML_TYPES.items()}
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _fields(data, bits, span):
    """uint8 [n, runs * span] -> codes uint8 [n, runs * span * 8 / bits]: in each run of `span` bytes, bits
    [f * bits, f * bits + bits) of byte j hold element f * span + j."""
    runs = data.reshape(len(data), -1, 1, span)
    return torch.cat([(runs >> shift) & (2 ** bits - 1) for shift in range(0, 8, bits)], 2).reshape(len(data), -1)


def _read_f16(blocks, at):
    """The f16 at byte `at` of each block: uint8 [n, bytes] -> float32 [n, 1]. (Viewing whole rows: a copy of a
    narrow uint8 slice is far slower.)"""
    return blocks.view(torch.float16)[:, at // 2, None].float()


def _k_scales(s):
    """Q4_K / Q5_K: 12 bytes -> (sc [n, 8], m [n, 8]), 6 bits each. Sub-blocks 0-3 keep their scale and min in the
    low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7 take 4 bits from bytes 8-11 and 2 from the top of bytes 0-7."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], 1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], 1)
    return sc.float(), m.float()


def _pack(codes, bits):
    """codes uint8 [n, k] (each < 2^bits) -> the AffineQuantLinear's packed bytes uint8 [n, k * bits / 8] (code j at
    bit (j % (8 / bits)) * bits of byte j // (8 / bits), affine.pack_bits' layout) with uint8 shifts: no int32 copy
    of a whole tensor, which is most of what loading a GGUF file's linears would otherwise cost."""
    if bits == 8:
        return codes
    fields = codes.reshape(len(codes), -1, 8 // bits)
    packed = fields[..., 0].clone()
    for j in range(1, 8 // bits):
        packed |= fields[..., j] << (j * bits)
    return packed


# Each decoder: blocks uint8 [n, bytes] -> (codes uint8 [n, B], scale [n, B / group], offset [n, B / group]).

def _nvfp4_scales(b):
    """NVFP4 blocks -> E4M3 scales float8_e4m3fn [n, 4]. ggml reads them unsigned (the sign bit is ignored) and 0x7F
    (E4M3's NaN) as 0."""
    s = b[:, :4] & 0x7F
    return torch.where(s == 0x7F, 0, s).view(torch.float8_e4m3fn)


def _decode_q4_0(b):
    d = _read_f16(b, 0)
    return _fields(b[:, 2:], 4, 16), d, -8 * d


def _decode_q4_1(b):
    return _fields(b[:, 4:], 4, 16), _read_f16(b, 0), _read_f16(b, 2)


def _decode_q5_0(b):
    d = _read_f16(b, 0)
    return _fields(b[:, 6:], 4, 16) | (unpack_bits(b[:, 2:6], 1, 32) << 4), d, -16 * d


def _decode_q5_1(b):
    return _fields(b[:, 8:], 4, 16) | (unpack_bits(b[:, 4:8], 1, 32) << 4), _read_f16(b, 0), _read_f16(b, 2)


def _decode_q8_0(b):
    d = _read_f16(b, 0)
    return b[:, 2:] ^ 0x80, d, -128 * d                   # int8 q + 128 as a byte: its top bit flipped


def _decode_q2_k(b):
    scale = _read_f16(b, 80) * (b[:, :16] & 15).float()
    offset = -_read_f16(b, 82) * (b[:, :16] >> 4).float()
    return _fields(b[:, 16:80], 2, 32), scale, offset


def _decode_q3_k(b):
    sc = _fields(b[:, 96:104], 4, 8) | (_fields(b[:, 104:108], 2, 4) << 4)          # 16 six-bit scales
    scale = _read_f16(b, 108) * (sc.float() - 32)
    return _fields(b[:, 32:96], 2, 32) | (_fields(b[:, 0:32], 1, 32) << 2), scale, -4 * scale


def _decode_q4_k(b):
    sc, m = _k_scales(b[:, 4:16])
    return _fields(b[:, 16:], 4, 32), _read_f16(b, 0) * sc, -_read_f16(b, 2) * m


def _decode_q5_k(b):
    sc, m = _k_scales(b[:, 4:16])
    codes = _fields(b[:, 48:], 4, 32) | (_fields(b[:, 16:48], 1, 32) << 4)
    return codes, _read_f16(b, 0) * sc, -_read_f16(b, 2) * m


def _decode_q6_k(b):
    codes = _fields(b[:, :128], 4, 64) | (_fields(b[:, 128:192], 2, 32) << 4)
    scale = _read_f16(b, 208) * b.view(torch.int8)[:, 192:208].float()
    return codes, scale, -32 * scale


IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])   # K
IQ4_ZERO = 128


def _iq4_codes(nibbles):
    """uint8 [n, runs * 16] of level indices -> the engine's codes K[q] + 128, uint8 [n, runs * 32]."""
    return (IQ4_LEVELS[_fields(nibbles, 4, 16).long()] + IQ4_ZERO).to(torch.uint8)


def _decode_iq4_nl(b):
    d = _read_f16(b, 0)
    return _iq4_codes(b[:, 2:]), d, -IQ4_ZERO * d


def _decode_iq4_xs(b):
    l_j = unpack_bits(b[:, 4:8], 4, 8) | (unpack_bits(b[:, 2:4], 2, 8) << 4)
    scale = _read_f16(b, 0) * (l_j.float() - 32)
    return _iq4_codes(b[:, 8:]), scale, -IQ4_ZERO * scale


# name -> (decoder, group size, bits the codes are held with, the integer zero point; None: a free offset)
AFFINE = {"Q4_0": (_decode_q4_0, 32, 4, 8), "Q4_1": (_decode_q4_1, 32, 4, None), "Q5_0": (_decode_q5_0, 32, 8, 16),
          "Q5_1": (_decode_q5_1, 32, 8, None), "Q8_0": (_decode_q8_0, 32, 8, 128), "Q2_K": (_decode_q2_k, 16, 2, None),
          "Q3_K": (_decode_q3_k, 16, 4, 4), "Q4_K": (_decode_q4_k, 32, 4, None), "Q5_K": (_decode_q5_k, 32, 8, None),
          "Q6_K": (_decode_q6_k, 16, 8, 32), "IQ4_NL": (_decode_iq4_nl, 32, 8, IQ4_ZERO),
          "IQ4_XS": (_decode_iq4_xs, 32, 8, IQ4_ZERO),
          **{name: (decode, group, 8, zero) for name, (decode, group, zero) in iq_low.DECODERS.items()}}
IQ4 = ("IQ4_NL", "IQ4_XS")
IQ_LOW = tuple(iq_low.DECODERS)                       # read only: llama.cpp's 1- to 3-bit codebook types
INTEGER = tuple(n for n in AFFINE if n not in IQ4 + IQ_LOW)   # integer types: read, and written from codes and scales
K_QUANTS = tuple(name for name in INTEGER if GGML_TYPES[name][1] == QK_K)
DECODED = (*DENSE, *AFFINE, "MXFP4", "NVFP4")


def _blocks(raw, type_name, shape):
    """raw uint8 [nbytes] of a tensor of `shape` (torch order, last = row) -> blocks uint8 [rows * per_row, size]."""
    if type_name not in DECODED:
        raise ValueError(f"GGML type {type_name} is not supported (this engine reads {', '.join(DECODED)})")
    _, block, size = GGML_TYPES[type_name]
    if shape[-1] % block or raw.numel() % size or raw.numel() // size * block != torch.Size(shape).numel():
        raise ValueError(f"{raw.numel()} bytes of {type_name} do not hold a tensor of shape {tuple(shape)}")
    return raw.reshape(-1, size)


def dequantize(raw, type_name, shape):
    """The reference decoder: raw uint8 [nbytes] -> tensor of `shape` (dense types in their own dtype, every
    quantized type in float32)."""
    blocks = _blocks(raw, type_name, shape)
    if type_name in DENSE:
        return blocks.view(DENSE[type_name]).reshape(shape)
    if type_name == "MXFP4":
        codes = _fields(blocks[:, 1:], 4, 16).long()
        return (E2M1[codes] * e8m0_to_float(blocks[:, :1])).reshape(shape)
    if type_name == "NVFP4":
        codes = _fields(blocks[:, 4:], 4, 8).long().reshape(-1, 4, 16)
        return (E2M1[codes] * _nvfp4_scales(blocks).float()[..., None]).reshape(shape)
    decode, group, _, _ = AFFINE[type_name]
    codes, scale, offset = decode(blocks)
    w = codes.float().reshape(len(blocks), -1, group) * scale[..., None] + offset[..., None]
    return w.reshape(shape)


class GGMLLinear(AffineQuantLinear):
    """An AffineQuantLinear read from GGML blocks, keeping them: raw uint8 [out, row bytes] of `ggml_type`. It
    computes as the affine layer (the same codes and grid, decoded once); the file writer stores `raw` as it is, and
    its size is the blocks' size."""

    ROW_BUFFERS = (*AffineQuantLinear.ROW_BUFFERS, "raw")

    def __init__(self, raw, ggml_type, codes, scales, group_size, bits, bias=None, *, zeros=None, offsets=None):
        super().__init__(_pack(codes, bits), scales, offsets, group_size, True, bias, bits=bits, zeros=zeros,
                         in_features=codes.shape[1])
        self.ggml_type = ggml_type
        self.register_buffer("raw", raw.to(torch.uint8).contiguous())

    def storage_bits(self):
        return self.raw.numel() * 8


class GGMLCodes(AffineQuantLinear):
    """A GGML layer loaded to run (quantized_linear's keep_blocks=False): its codes and grid without the blocks, an
    AffineQuantLinear whose storage_bits are still the blocks' (what the file stores: a Q5_0 layer's 5.5 bits a
    weight, where its 8-bit codes and float scales would count 9)."""

    def __init__(self, *args, block_bits, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_bits = block_bits

    def storage_bits(self):
        return self.block_bits


def quantized_linear(raw, type_name, shape, bias=None, tensor_scale=None, keep_blocks=True):
    """raw uint8 [nbytes] of a quantized weight [out, in] -> the engine layer holding exactly its codes and grid:
    GGMLLinear (an AffineQuantLinear with its blocks; keep_blocks=False: GGMLCodes, without them) for the
    integer types, MXFP4Linear for MXFP4, NVFP4Linear for NVFP4 (tensor_scale: the `<name>.scale` tensor's value, 1
    when absent)."""
    if len(shape) != 2 or type_name in DENSE:
        raise ValueError(f"a quantized linear needs a 2-D quantized weight, got {type_name} {tuple(shape)}")
    if tensor_scale is not None and type_name != "NVFP4":
        raise ValueError(f"a per-tensor scale on a {type_name} weight is not supported (only NVFP4 has one)")
    out_f, in_f = shape
    blocks = _blocks(raw, type_name, shape)
    if type_name == "NVFP4":
        codes = _fields(blocks[:, 4:], 4, 8).reshape(out_f, in_f)
        return NVFP4Linear(pack_nibbles(codes), _nvfp4_scales(blocks).reshape(out_f, -1),
                           1.0 if tensor_scale is None else tensor_scale, bias)
    if type_name == "MXFP4":
        codes = _fields(blocks[:, 1:], 4, 16)                # split layout -> element order -> interleaved
        return MXFP4Linear(pack_nibbles(codes).reshape(out_f, -1, 16), blocks[:, 0].reshape(out_f, -1), bias)
    decode, group, bits, zero = AFFINE[type_name]
    codes, scale, offset = decode(blocks)
    scale = scale.reshape(out_f, -1)
    grid = {"zeros": torch.full_like(scale, zero)} if zero is not None else {"offsets": offset.reshape(out_f, -1)}
    if not keep_blocks:
        return GGMLCodes(_pack(codes.reshape(out_f, in_f), bits), scale, grid.get("offsets"), group, True, bias,
                         bits=bits, zeros=grid.get("zeros"), in_features=in_f, block_bits=raw.numel() * 8)
    return GGMLLinear(raw.reshape(out_f, -1), type_name, codes.reshape(out_f, in_f), scale, group, bits, bias, **grid)


def grid(raw, type_name, shape):
    """raw uint8 [nbytes] of an integer type -> (codes uint8 [out, in], scale [out, groups], offset [out, groups]),
    w = codes * scale + offset: what its blocks say, the decoders' own reading."""
    decode = AFFINE[type_name][0]
    codes, scale, offset = decode(_blocks(raw, type_name, shape))
    return codes.reshape(shape), scale.reshape(shape[0], -1), offset.reshape(shape[0], -1)


# ---- the writer's side: engine codes -> GGML blocks --------------------------------------------------------------

def _unfields(codes, bits, span):
    """codes uint8 [n, runs * span * 8 / bits] (each < 2^bits) -> uint8 [n, runs * span], the inverse of _fields."""
    c = codes.to(torch.uint8).reshape(len(codes), -1, 8 // bits, span)
    out = torch.zeros_like(c[:, :, 0])
    for f in range(8 // bits):
        out |= c[:, :, f] << (f * bits)
    return out.reshape(len(codes), -1)


def _f16_bytes(x):
    """float32 [n] holding f16 values -> uint8 [n, 2]."""
    return x.reshape(-1, 1).half().view(torch.uint8)


ENCODED = (*(name for name in INTEGER if name not in K_QUANTS), "MXFP4", "NVFP4")   # encode's (encode_k, encode_iq4)


def _check_codes(type_name, codes):
    _, block, _ = GGML_TYPES[type_name]
    if codes.dim() != 2 or codes.shape[1] % block:
        raise ValueError(f"{type_name}: codes {tuple(codes.shape)} are not rows of whole blocks of {block}")
    return codes.to(torch.uint8).reshape(-1, block)


def encode(type_name, codes, scales, offsets=None):
    """The engine's codes and grid -> raw uint8 [nbytes] of a GGML tensor, the inverse of the decoders:

      Q4_0   codes [out, in] 0..15, scales [out, in/32] (f16 values)          w = scale * (q - 8)
      Q4_1   codes 0..15, scales and offsets [out, in/32] (f16 values)        w = scale * q + offset
      Q5_0   codes 0..31, scales (f16 values)                                 w = scale * (q - 16)
      Q5_1   codes 0..31, scales and offsets (f16 values)                     w = scale * q + offset
      Q8_0   codes 0..255, scales [out, in/32] (f16 values)                   w = scale * (q - 128)  (int8 q - 128)
      MXFP4  E2M1 codes, scales = E8M0 bytes uint8 [out, in/32]
      NVFP4  E2M1 codes, scales = float8_e4m3fn [out, in/16] (>= 0); the tensor scale goes in `<name>.scale`

    Scales and offsets must already be what the file stores (gguf_writer checks that before calling)."""
    if type_name not in ENCODED:
        raise ValueError(f"GGML type {type_name} cannot be written by encode (it writes {', '.join(ENCODED)}; "
                         f"encode_k writes {', '.join(K_QUANTS)})")
    q = _check_codes(type_name, codes)
    if type_name == "NVFP4":
        s = scales.contiguous().view(torch.uint8).reshape(len(q), 4)
        return torch.cat([s, _unfields(q, 4, 8)], 1).reshape(-1)
    s = scales.reshape(-1)
    if type_name == "MXFP4":
        parts = [s.to(torch.uint8).reshape(-1, 1), _unfields(q, 4, 16)]
    elif type_name == "Q8_0":
        parts = [_f16_bytes(s), (q.short() - 128).to(torch.int8).view(torch.uint8)]
    else:
        head = [_f16_bytes(s)] + ([_f16_bytes(offsets.reshape(-1))] if type_name in ("Q4_1", "Q5_1") else [])
        high = [pack_bits(q >> 4, 1)] if type_name in ("Q5_0", "Q5_1") else []   # u32 bit i = element i
        parts = head + high + [_unfields(q & 15, 4, 16)]
    return torch.cat(parts, 1).reshape(-1)


def _k_scale_bytes(sc, m):
    """(sc, m) [n, 8] six-bit -> the 12 scale bytes of Q4_K / Q5_K, the inverse of _k_scales."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    return torch.cat([lo, mid, (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)


def encode_k(type_name, codes, d, sc, dmin=None, m=None):
    """A K-quant's codes and super-block grid -> raw uint8 [nbytes], the inverse of the decoders:

      Q2_K   codes 0..3, d / dmin [blocks] (f16 values), sc / m [blocks, 16] 0..15   w = d * sc * q - dmin * m
      Q3_K   codes 0..7, d, sc [blocks, 16] 0..63 (the scale + 32)                   w = d * (sc - 32) * (q - 4)
      Q4_K   codes 0..15, d / dmin, sc / m [blocks, 8] 0..63                         w = d * sc * q - dmin * m
      Q5_K   codes 0..31, as Q4_K
      Q6_K   codes 0..63, d, sc [blocks, 16] -128..127 (int8)                        w = d * sc * (q - 32)

    (blocks = out * in / 256, in row order; codes [out, in].)"""
    if type_name not in K_QUANTS:
        raise ValueError(f"GGML type {type_name} is not a K-quant ({', '.join(K_QUANTS)})")
    q = _check_codes(type_name, codes)
    d = _f16_bytes(d)
    sc = sc.reshape(len(q), -1).to(torch.int16)
    if type_name in ("Q2_K", "Q4_K", "Q5_K"):
        dmin, m = _f16_bytes(dmin), m.reshape(len(q), -1).to(torch.int16)
    if type_name == "Q2_K":
        parts = [(sc | (m << 4)).to(torch.uint8), _unfields(q, 2, 32), d, dmin]
    elif type_name == "Q3_K":
        sc = sc.to(torch.uint8)
        parts = [_unfields(q >> 2, 1, 32), _unfields(q & 3, 2, 32), _unfields(sc & 15, 4, 8),
                 _unfields(sc >> 4, 2, 4), d]
    elif type_name == "Q4_K":
        parts = [d, dmin, _k_scale_bytes(sc, m).to(torch.uint8), _unfields(q, 4, 32)]
    elif type_name == "Q5_K":
        parts = [d, dmin, _k_scale_bytes(sc, m).to(torch.uint8), _unfields(q >> 4, 1, 32), _unfields(q & 15, 4, 32)]
    else:
        parts = [_unfields(q & 15, 4, 64), _unfields(q >> 4, 2, 32), sc.to(torch.int8).view(torch.uint8), d]
    return torch.cat(parts, 1).reshape(-1)


def encode_iq4(type_name, codes, d, l_j=None):
    """IQ4 codes and grid -> raw uint8 [nbytes], the inverse of the decoders:

      IQ4_NL   codes [out, in] in K + 128, d [blocks] (f16 values)                       w = d * (code - 128)
      IQ4_XS   codes in K + 128, d [blocks] (f16 values), l_j [blocks, 8] 0..63          w = d (l_j - 32) (code - 128)
    """
    if type_name not in IQ4:
        raise ValueError(f"GGML type {type_name} is not one of {', '.join(IQ4)}")
    q = _check_codes(type_name, codes).long()
    lut = torch.full((256,), -1, dtype=torch.int16)
    lut[IQ4_LEVELS + IQ4_ZERO] = torch.arange(16, dtype=torch.int16)
    index = lut[q]
    if (index < 0).any():
        raise ValueError(f"{type_name}: a code is not one of the levels kvalues_iq4nl + 128")
    parts = [_f16_bytes(d)]
    if type_name == "IQ4_XS":
        l_j = l_j.reshape(len(q), 8).to(torch.uint8)
        parts += [pack_bits(l_j >> 4, 2), pack_bits(l_j & 15, 4)]
    return torch.cat([*parts, _unfields(index.to(torch.uint8), 4, 16)], 1).reshape(-1)
