"""4-bit floats: MXFP4 (OCP microscaling) and NVFP4.

Both store each weight as E2M1 (1 sign, 2 exponent, 1 mantissa bit): the 16 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
their negatives, code = sign << 3 | magnitude index. Rounding is to nearest, ties to the even code, saturating at 6.
They differ in the scales, which do most of the work with so few values:

  MXFP4  a block of 32 shares an E8M0 scale, a bare power of two 2^(e - 127) stored as the byte e. The exponent
         puts the block's largest magnitude in E2M1's top binade: e - 127 = floor(log2 amax) - 2 (6 = 1.5 * 2^2).
         Storage 4 + 8/32 = 4.25 bits per weight.
  NVFP4  a block of 16 shares an E4M3 scale, times one float32 per tensor, t = amax / (448 * 6), so that E4M3's
         range is spent on the ratios between blocks:  s_block = e4m3(amax_block / 6 / t),  w = code * s_block * t.
         Storage 4 + 8/16 = 4.5 bits per weight (+ 32 bits per tensor). A power-of-two scale can miss the ideal by
         almost 2x; E4M3 is within ~6%, and the blocks are half as long, so NVFP4 loses less. (compressed-tensors
         stores the reciprocal, weight_global_scale = 448 * 6 / amax.)

Two codes share a byte, in two orders found in the wild: "interleaved" (gpt-oss, transformers, torchao,
compressed-tensors: element 2j in the low nibble, 2j+1 in the high one) and "split" (GGUF: element j low, j + 16
high). K must be a multiple of the block (32 / 16): every checkpoint format stores exactly K / block scales and no
in_features, so a ragged tail is a ValueError rather than silent padding.
"""
import torch

from .numerics.affine import decode_pairs, pack_nibbles, pair_table, unpack_nibbles
from ..layers import QuantLinear
from .numerics.minifloats import E2M1, E2M1_MAX, E4M3_MAX, byte_values, e8m0_to_float, to_e2m1

MX_BLOCK, NV_BLOCK = 32, 16
LAYOUTS = ("interleaved", "split")


def _blocked(w, block, what):
    if w.shape[-1] % block:
        raise ValueError(f"{what}: the last dimension ({w.shape[-1]}) must be a multiple of {block}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{what}: weight has NaN or infinite values")
    return w.float().reshape(*w.shape[:-1], -1, block)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ---- MXFP4 ------------------------------------------------------------------------------------------------------

def quantize_mxfp4(w, layout="interleaved"):
    """w [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 E8M0 [..., K/32])."""
    _check_layout(layout)
    x = _blocked(w, MX_BLOCK, "quantize_mxfp4")
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    # frexp is exact where floor(log2(.)) in float32 is not (just below a power of two log2 rounds up)
    exponent = (torch.frexp(amax).exponent - 1 - 2).clamp(-127, 127)
    codes = to_e2m1(x * torch.exp2(-exponent.float())[..., None])          # a power of two: exact
    if layout == "split":
        codes = codes.reshape(*codes.shape[:-1], 2, 16).transpose(-1, -2).flatten(-2)  # j beside j + 16
    return pack_nibbles(codes), (exponent + 127).to(torch.uint8)


def dequantize_mxfp4(blocks, scales, layout="interleaved"):
    """blocks uint8 [..., K/32, 16], scales uint8 [..., K/32] -> float32 [..., K]."""
    _check_layout(layout)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "(expected [..., K/32, 16] and [..., K/32])")
    codes = unpack_nibbles(blocks).long()
    if layout == "split":
        codes = codes.reshape(*codes.shape[:-1], 16, 2).transpose(-1, -2).flatten(-2)
    return (E2M1.to(codes.device)[codes] * e8m0_to_float(scales)[..., None]).flatten(-2)


# ---- NVFP4 ------------------------------------------------------------------------------------------------------

def quantize_nvfp4(w):
    """w [..., K] (K % 16 == 0) -> (codes uint8 [..., K/16, 8] (the book's shape: each block's 16 codes two per
    byte, interleaved), block_scale float8_e4m3fn [..., K/16], tensor_scale float32 scalar tensor = amax / (448 * 6)).
    The checkpoint layouts store the codes flat, [..., K/2]: the same bytes, .flatten(-2).

    The arithmetic follows torchao's nvfp4_quantize, so the codes agree bit for bit: block scales are clamped to
    [smallest normal E4M3, 448] (an all-zero block gets 2^-6, never 0) and values are multiplied by the reciprocal
    (1 / t) / s_block rather than divided."""
    x = _blocked(w, NV_BLOCK, "quantize_nvfp4")
    tensor_scale = x.abs().amax().clamp_min(1e-12) / (E4M3_MAX * E2M1_MAX)
    wanted = x.abs().amax(-1) / E2M1_MAX / tensor_scale
    block_scale = wanted.clamp(torch.finfo(torch.float8_e4m3fn).tiny, E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / tensor_scale) / block_scale.float()
    codes = to_e2m1(x * reciprocal[..., None])
    return pack_nibbles(codes), block_scale, tensor_scale


def _flat_codes(packed, block_scale):
    """NVFP4 codes as the book shapes them, [..., K/16, 8], or as checkpoints store them, [..., K/2] -> [..., K/2]."""
    if packed.shape == (*block_scale.shape, NV_BLOCK // 2):
        return packed.flatten(-2)
    if packed.shape[:-1] != block_scale.shape[:-1] or packed.shape[-1] != block_scale.shape[-1] * NV_BLOCK // 2:
        raise ValueError(f"NVFP4 packed {tuple(packed.shape)} and block_scale {tuple(block_scale.shape)} do not match "
                         "(expected [..., K/16, 8] or [..., K/2], and [..., K/16])")
    return packed


def dequantize_nvfp4(packed, block_scale, tensor_scale):
    """packed uint8 [..., K/16, 8] or [..., K/2], block_scale e4m3 [..., K/16], tensor_scale scalar ->
    float32 [..., K]."""
    packed = _flat_codes(packed, block_scale)
    if torch.as_tensor(tensor_scale).numel() != 1:
        raise ValueError("tensor_scale must be a single number")
    codes = unpack_nibbles(packed).long().reshape(*block_scale.shape, NV_BLOCK)
    scale = block_scale.float() * torch.as_tensor(tensor_scale, dtype=torch.float32)
    return (E2M1.to(codes.device)[codes] * scale[..., None]).flatten(-2)


# ---- layers -----------------------------------------------------------------------------------------------------

E2M1_PAIRS = pair_table(E2M1)            # a byte of two E2M1 codes -> their two values (decode_rows)
E8M0_VALUES = e8m0_to_float(torch.arange(256))                                 # a scale byte -> 2^(e - 127)
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


class MXFP4Linear(QuantLinear):
    """blocks uint8 [out, in/32, 16] (interleaved), scales uint8 E8M0 [out, in/32] -> y = x @ W_hat^T."""

    def __init__(self, blocks, scales, bias=None):
        if blocks.dim() != 3 or blocks.shape[-1] != 16 or blocks.shape[:2] != scales.shape:
            raise ValueError(f"MXFP4Linear needs blocks [out, in/32, 16] and scales [out, in/32], got "
                             f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
        if (scales == 255).any():
            raise ValueError("E8M0 scale 0xFF is NaN")
        super().__init__(scales.shape[1] * MX_BLOCK, scales.shape[0], bias)
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("scales", scales.contiguous())
        # OCP allows scales up to 2^127, but 4 x 2^126 is already past float32's largest number: such a block
        # decodes to infinities. Only a file with a scale byte >= 253 pays for the full decode that finds them.
        if (scales >= 253).any() and not bool(torch.isfinite(self.dequantize()).all()):
            raise ValueError("MXFP4 weight: an E8M0 scale of 2^126 or more times its E2M1 codes overflows float32")

    @classmethod
    def from_linear(cls, linear):
        return cls(*quantize_mxfp4(linear.weight.detach(), "interleaved"), linear.bias)

    def dequantize(self):
        return dequantize_mxfp4(self.blocks, self.scales, "interleaved")

    def decode_rows(self, out, start, stop):
        decode_pairs(out, self.blocks[start:stop], E2M1_PAIRS)
        out.view(len(out), -1, MX_BLOCK).mul_(byte_values(E8M0_VALUES, self.scales[start:stop])[..., None])

    def kernel_matmul(self, x2d):
        from ..kernels import triton_formats      # Triton: imported by the engine path only
        return triton_formats.mxfp4_matmul(x2d, self.blocks, self.scales, E2M1)

    def storage_bits(self):
        return self.blocks.numel() * 8 + self.scales.numel() * 8


class NVFP4Linear(QuantLinear):
    """packed uint8 [out, in/2] (interleaved; or quantize_nvfp4's [out, in/16, 8]), block_scale e4m3 [out, in/16],
    tensor_scale f32 -> y = x @ W_hat^T."""

    def __init__(self, packed, block_scale, tensor_scale, bias=None):
        if packed.dim() == 3 and packed.shape == (*block_scale.shape, NV_BLOCK // 2):
            packed = packed.flatten(-2)
        if packed.dim() != 2 or block_scale.shape != (packed.shape[0], packed.shape[1] * 2 // NV_BLOCK) \
                or packed.shape[1] % (NV_BLOCK // 2):
            raise ValueError(f"NVFP4Linear needs packed [out, in/2] and block_scale [out, in/16], got "
                             f"{tuple(packed.shape)} and {tuple(block_scale.shape)}")
        if packed.dtype != torch.uint8 or block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"packed must be uint8 and block_scale float8_e4m3fn, got {packed.dtype} and "
                             f"{block_scale.dtype}")
        tensor_scale = torch.as_tensor(tensor_scale, dtype=torch.float32)
        if tensor_scale.numel() != 1 or not bool(torch.isfinite(tensor_scale).all() & (tensor_scale > 0).all()):
            raise ValueError(f"tensor_scale must be one finite positive number, got {tensor_scale}")
        if bool(torch.isnan(block_scale.float()).any() | (block_scale.float() < 0).any()):
            raise ValueError("NVFP4 block scales must be non-negative E4M3 numbers (0x7F / 0xFF is NaN)")
        super().__init__(packed.shape[1] * 2, packed.shape[0], bias)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("block_scale", block_scale.contiguous())
        self.register_buffer("tensor_scale", tensor_scale.reshape(()).clone())

    @classmethod
    def from_linear(cls, linear):
        return cls(*quantize_nvfp4(linear.weight.detach()), linear.bias)

    def dequantize(self):
        return dequantize_nvfp4(self.packed, self.block_scale, self.tensor_scale)

    def decode_rows(self, out, start, stop):
        decode_pairs(out, self.packed[start:stop], E2M1_PAIRS)
        scale = byte_values(E4M3_VALUES, self.block_scale[start:stop]) * self.tensor_scale
        out.view(len(out), -1, NV_BLOCK).mul_(scale[..., None])

    def kernel_matmul(self, x2d):
        from ..kernels import triton_formats      # Triton: imported by the engine path only
        return triton_formats.nvfp4_matmul(x2d, self.packed, self.block_scale, self.tensor_scale, E2M1)

    def storage_bits(self):
        return self.packed.numel() * 8 + self.block_scale.numel() * 8 + 32


FP4_LAYERS = {"mxfp4": (MXFP4Linear, MX_BLOCK, "e8m0"), "nvfp4": (NVFP4Linear, NV_BLOCK, "e4m3")}


def quantize_layer(layer, format="mxfp4"):
    """Replace the layer's linears (a calibration.LayerCalibration) by MXFP4Linear or NVFP4Linear layers, in place.
    Returns a quantization_config describing them (compressed-tensors checkpoints store them)."""
    if format not in FP4_LAYERS:
        raise ValueError(f"format must be one of {sorted(FP4_LAYERS)}, got {format!r}")
    layer_cls, block, scale = FP4_LAYERS[format]

    def make(name, linear):
        if linear.in_features % block:
            raise ValueError(f"{name}: in_features={linear.in_features} is not a multiple of the {block}-block")
        return layer_cls.from_linear(linear)

    layer.replace(make)
    return {"quant_method": format, "block_size": block, "scale": scale, "layout": "interleaved"}


def quantize(model, calibration_ids=None, **options):
    """MXFP4 / NVFP4 every linear but lm_head, in place (data-free: calibration_ids is not used)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **options)
