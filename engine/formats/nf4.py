"""NF4 (QLoRA's NormalFloat4): the data-free 4-bit baseline.

16 levels at quantiles of N(0, 1), scaled to [-1, 1] (NF4_TABLE, as bitsandbytes ships them), one absmax per group
of 64 weights stored in float16:

    q = argmin_k |W / absmax - NF4[k]|,    W_hat = NF4[q] * absmax,    4 + 16 / 64 = 4.25 bits per weight

Two codes per byte, element 2j in the low nibble. No checkpoint format of its own here: it is a row of the table.
"""
import torch

from ..kernels import triton_formats
from .affine import grouped, pack_bits, unpack_bits
from .base import QuantLinear
from .calibration import whole_model

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
        return triton_formats.nf4_matmul(x2d, self.packed, self.absmax.float(), NF4_TABLE,
                                         self.group_size)

    def storage_bits(self):
        return 8 * self.packed.numel() + 16 * self.absmax.numel()



def quantize_layer(layer, group_size=64):
    """Replace the layer's linears (a calibration.LayerCalibration) by NF4Linears, in place. Returns the
    quantization_config describing them."""
    if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1):
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    layer.replace(lambda name, linear: NF4Linear.from_weight(linear.weight, group_size, linear.bias))
    return {"quant_method": "nf4", "bits": 4, "group_size": group_size, "scale_dtype": "float16"}


def quantize(model, calibration_ids=None, **options):
    """NF4 every linear but lm_head, in place (data-free: calibration_ids is ignored)."""
    return quantize_layer(whole_model(model), **options)
