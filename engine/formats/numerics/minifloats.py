"""The small float grids that FP8, MXFP4 / NVFP4 and EntQuant share: E4M3, E2M1 and the E8M0 scale byte.

  E4M3 (float8_e4m3fn)  1 sign, 4 exponent (bias 7), 3 mantissa bits; largest 448, no infinities; below 2^-6 the
                        subnormals, a uniform grid of step 2^-9.
  E2M1 (FP4)            1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives,
                        code = sign << 3 | magnitude index.
  E8M0                  a bare power of two 2^(e - 127) stored as its exponent byte e (255 is NaN).

Rounding is to nearest, ties to even, saturating at the largest value, as hardware and ml_dtypes do.
"""
import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# Midpoints between neighbouring magnitudes 0, 0.5, 1, ... 6. At a tie the even code (mantissa bit 0) wins: below
# the midpoint after an even index (0.25 -> 0, 2.5 -> 2), above it after an odd one (0.75 -> 1, 1.75 -> 2).
_MIDPOINTS = (E2M1[1:8] + E2M1[0:7]) / 2
_TIE_GOES_UP = torch.arange(7) % 2 == 1


def to_e2m1(x):
    """x [...] float -> E2M1 codes uint8 [...]: nearest, ties to even, saturating at +-6 (the sign of -0 and of
    negatives that round to 0 is kept, as hardware and ml_dtypes do)."""
    a = x.float().abs()[..., None]
    mid = _MIDPOINTS.to(a.device)
    index = torch.where(_TIE_GOES_UP.to(a.device), a >= mid, a > mid).sum(-1)
    return (index | (torch.signbit(x).long() << 3)).to(torch.uint8)


def e8m0_to_float(scales):
    """E8M0 bytes -> 2^(e - 127) float32 (255 is NaN in the OCP spec)."""
    e = scales.long()
    return torch.where(e == 255, float("nan"), torch.exp2((e - 127).float()))


def round_e4m3(x):
    """float32 -> the nearest E4M3 value (ties to even, saturating at +-448), as float32. Equals
    x.clamp(-448, 448).to(torch.float8_e4m3fn).float() but runs as a few vectorized integer ops, faster than torch's
    CPU cast on the weight matrices EntQuant's scale search rounds (the cast wins on short vectors, where an op's
    fixed cost dominates, and on tens of millions of elements): normals keep 3 mantissa bits by adding a
    round-to-even bias to the f32 bit pattern; below 2^-6 the grid is uniform with step 2^-9 (the subnormals)."""
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    bits = x.view(torch.int32)
    bits = (bits + ((1 << 19) - 1) + ((bits >> 20) & 1)) & ~((1 << 20) - 1)
    normal = bits.view(torch.float32)
    return torch.where(x.abs() < 2.0 ** -6, torch.round(x * 512.0) / 512.0, normal)


# ---- decoding at run time (engine/runtime.py): whole rows of codes into float32, a few vectorized passes ----------

E4M3_HALF_SHIFT = 2.0 ** 8       # e4m3_halves' values are the E4M3 values times 2^-8


def e4m3_halves(codes):
    """E4M3 bytes (uint8 or float8_e4m3fn) [...] -> float16 [...] holding each value times 2^-8, exactly: the sign
    to bit 15, the other 7 bits to bits 13..7, so E4M3's exponent (bias 7) is read as float16's (bias 15) and its
    subnormals as float16's. Two int16 passes where torch's float8 cast runs one element at a time. (0x7F / 0xFF,
    E4M3's NaN, become 480 * 2^-8: layers refuse NaN codes when they load.)"""
    w = codes.view(torch.int8).to(torch.int16)       # sign-extended: w * 128 sets bits 15 and 14 of a negative one
    return w.mul_(128).bitwise_and_(-16385).view(torch.float16)            # -16385 = 0xBFFF: clear bit 14


def byte_values(table, codes):
    """table float32 [256] indexed by the bytes codes (uint8 or a 1-byte float type) [...] -> float32 [...]: a
    scale byte's value in one gather (E8M0_VALUES, E4M3_VALUES), where its arithmetic takes a handful of passes."""
    return torch.index_select(table, 0, codes.reshape(-1).view(torch.uint8).to(torch.int32)).view(codes.shape)
