"""Chapter 39's FP4 listings, typed as a reader would (`pytest tests/test_ch39_fp4.py --yours tests/book/fp4.py`),
with the helpers the listings use and chapter 38 defined, E2M1 (the 16 values) and to_e2m1, written out here (the
engine's are engine.formats.numerics.minifloats')."""
import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def to_e2m1(x):
    """The nearest E2M1 code (sign << 3 | magnitude index), saturating at 6; a tie goes to the even index."""
    above = x.float().abs()[..., None]
    up = torch.where(torch.arange(1, 8) % 2 == 0, above >= MIDPOINTS, above > MIDPOINTS)
    return (up.sum(-1) | (torch.signbit(x).long() << 3)).to(torch.uint8)


def quantize_mxfp4(w, layout="interleaved"):
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    codes = to_e2m1(x / torch.exp2(exponent)[..., None])
    if layout == "interleaved":
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    else:
        packed = codes[..., :16] | (codes[..., 16:] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(blocks, scales, layout="interleaved"):
    low, high = (blocks & 0xF).long(), (blocks >> 4).long()
    if layout == "interleaved":
        codes = torch.stack((low, high), -1).flatten(-2)
    else:
        codes = torch.cat((low, high), -1)
    values = E2M1[codes] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


def quantize_nvfp4(w):
    x = w.float().reshape(*w.shape[:-1], -1, 16)
    tensor_scale = x.abs().amax().clamp_min(1e-12) / (448.0 * 6.0)        # E4M3's max x E2M1's max
    block_scale = (x.abs().amax(-1) / 6.0 / tensor_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    scale = block_scale.float() * tensor_scale
    codes = to_e2m1(torch.where(scale[..., None] > 0, x / scale[..., None].clamp_min(1e-30), torch.zeros_like(x)))
    return codes[..., 0::2] | (codes[..., 1::2] << 4), block_scale, tensor_scale


def dequantize_nvfp4(packed, block_scale, tensor_scale):
    codes = torch.stack(((packed & 0xF).long(), (packed >> 4).long()), -1).flatten(-2)
    return (E2M1[codes] * (block_scale.float() * tensor_scale)[..., None]).flatten(-2)
