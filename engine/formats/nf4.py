"""NF4 (QLoRA's NormalFloat4): the data-free 4-bit baseline.

16 levels at quantiles of N(0, 1), scaled to [-1, 1] (NF4_TABLE, as bitsandbytes ships them), one absmax per group
of 64 weights stored in float16:

    q = argmin_k |W / absmax - NF4[k]|,    W_hat = NF4[q] * absmax,    4 + 16 / 64 = 4.25 bits per weight

Two codes per byte, element 2j in the low nibble (in memory).

Checkpoints are written in bitsandbytes' layout, what transformers reads with BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4") (config.json: quant_method "bitsandbytes"). bitsandbytes quantizes the weight [out, in]
flattened, in blocks of `blocksize` consecutive weights, so its blocks are this layer's groups when in % G == 0
(required here). Per linear:

    weight                                  uint8 [out * in / 2, 1]   element 2k in the HIGH nibble of byte k
    weight.absmax                           float32 [out * in / G]    one absmax per block (ours: f16 values, exact)
    weight.quant_map                        float32 [16]              NF4_TABLE
    weight.quant_state.bitsandbytes__nf4    uint8 [n]                 UTF-8 JSON {"quant_type": "nf4", "blocksize": G,
                                                                        "dtype": "float32", "shape": [out, in]}

so 4 + 32 / G bits per weight on disk (4.5 at G = 64). Double quantization (nested_absmax: bitsandbytes'
bnb_4bit_use_double_quant) is not read.
"""
import json

import torch

from .numerics.affine import decode_pairs, grouped, pack_bits, pair_table, unpack_bits
from ..layers import QuantLinear, linear_names
from .method import CheckpointMethod, choice_option, options_for

NF4_TABLE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                          -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                          0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                          0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
NF4_PAIRS = pair_table(NF4_TABLE)        # a byte of two codes -> their two levels (decode_rows)


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
        if absmax.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"absmax must be float16 or float32, got {absmax.dtype}")
        if not bool(torch.isfinite(absmax).all()) or bool((absmax < 0).any()):
            raise ValueError("absmax must hold finite values >= 0")
        self.register_buffer("absmax", absmax.contiguous())        # f16 when quantized here, f32 when read

    @classmethod
    def from_weight(cls, weight, group_size=64, bias=None):
        codes, absmax = quantize_to_nf4(weight, group_size)
        return cls(pack_bits(codes, 4), absmax, weight.shape[1], group_size, bias)

    def dequantize(self):
        codes = unpack_bits(self.packed, 4, self.in_features).long()
        a = self.absmax.float().repeat_interleave(self.group_size, 1)[:, :self.in_features]
        return NF4_TABLE[codes] * a

    def decode_rows(self, out, start, stop):
        g, in_f = self.group_size, self.in_features
        if in_f % 2 or in_f % g:
            return super().decode_rows(out, start, stop)
        decode_pairs(out, self.packed[start:stop], NF4_PAIRS)
        out.view(len(out), -1, g).mul_(self.absmax[start:stop].float()[..., None])

    def kernel_matmul(self, x2d):
        from ..kernels import triton_formats      # Triton: imported by the engine path only
        return triton_formats.nf4_matmul(x2d, self.packed, self.absmax.float(), NF4_TABLE,
                                         self.group_size)

    def storage_bits(self):
        return 8 * self.packed.numel() + 8 * self.absmax.element_size() * self.absmax.numel()



def quantize_layer(layer, group_size=64):
    """Replace the layer's linears (a calibration.LayerCalibration) by NF4Linears, in place. Returns the
    quantization_config describing them."""
    if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1):
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    layer.replace(lambda name, linear: NF4Linear.from_weight(linear.weight, group_size, linear.bias))
    return {"quant_method": "nf4", "bits": 4, "group_size": group_size, "scale_dtype": "float16"}


def quantize(model, calibration_ids=None, **options):
    """NF4 every linear but lm_head, in place (data-free: calibration_ids is ignored)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **options)


# ---- bitsandbytes' checkpoint layout (module docstring) ---------------------------------------------------------

BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BNB_STATE = "weight.quant_state.bitsandbytes__nf4"
BNB_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
              "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "float32",
              "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["lm_head"], "llm_int8_threshold": 6.0,
              "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}


def bnb_validate(quantization_config):
    """A bitsandbytes quantization_config this reader holds: 4-bit NF4, no double quantization."""
    if (quantization_config.get("load_in_4bit") is not True
            or quantization_config.get("bnb_4bit_quant_type", "fp4") != "nf4"):
        raise ValueError("bitsandbytes checkpoint: only 4-bit NF4 is read (load_in_4bit true, bnb_4bit_quant_type "
                         f"'nf4'), got load_in_4bit={quantization_config.get('load_in_4bit')!r}, "
                         f"bnb_4bit_quant_type={quantization_config.get('bnb_4bit_quant_type')!r}")
    if quantization_config.get("bnb_4bit_use_double_quant", False) is not False:
        raise ValueError("bitsandbytes checkpoint: double quantization (bnb_4bit_use_double_quant) is not read")
    return quantization_config


def bnb_parts(quantization_config):
    return ("weight", "weight.absmax", "weight.quant_map", BNB_STATE)


def _check_blocksize(group_size, in_features):
    if group_size not in BNB_BLOCKSIZES or in_features % group_size:
        raise ValueError(f"bitsandbytes NF4: blocksize {group_size!r} must be one of {BNB_BLOCKSIZES} and divide "
                         f"in_features {in_features} (its blocks run over the flattened weight)")


def bnb_read(p, quantization_config):
    """{part: tensor} of one linear -> NF4Linear (codes and absmax exactly as stored)."""
    state = p[BNB_STATE]
    if state.dtype != torch.uint8 or state.dim() != 1 or state.numel() > 4096:
        raise ValueError(f"{BNB_STATE} must be a short uint8 [n] JSON string, got {state.dtype} {tuple(state.shape)}")
    try:
        info = json.loads(bytes(state.tolist()).decode("utf-8"))
        shape, blocksize = [int(v) for v in info["shape"]], info["blocksize"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(f"{BNB_STATE} is not bitsandbytes' quant-state JSON") from None
    if info.get("quant_type") != "nf4" or len(shape) != 2 or min(shape) < 1 or type(blocksize) is not int:
        raise ValueError(f"{BNB_STATE}: want quant_type nf4, a 2-D shape and an int blocksize, got {info}"[:300])
    out_f, in_f = shape
    _check_blocksize(blocksize, in_f)
    weight, absmax, quant_map = p["weight"], p["weight.absmax"], p["weight.quant_map"]
    if weight.dtype != torch.uint8 or weight.numel() != out_f * in_f // 2:
        raise ValueError(f"weight must be uint8 with {out_f * in_f // 2} bytes, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if absmax.dtype != torch.float32 or tuple(absmax.shape) != (out_f * in_f // blocksize,):
        raise ValueError(f"weight.absmax must be float32 [{out_f * in_f // blocksize}], got {absmax.dtype} "
                         f"{tuple(absmax.shape)}")
    if quant_map.dtype != torch.float32 or not torch.equal(quant_map.reshape(-1), NF4_TABLE):
        raise ValueError("weight.quant_map is not the NF4 table")
    b = weight.reshape(out_f, in_f // 2)
    packed = ((b & 15) << 4) | (b >> 4)                       # high-nibble-first -> low-nibble-first
    return NF4Linear(packed, absmax.reshape(out_f, -1), in_f, blocksize, p.get("bias"))


def bnb_write(layer, quantization_config):
    """NF4Linear -> {part: tensor} in bitsandbytes' layout."""
    if not isinstance(layer, NF4Linear):
        raise ValueError(f"bitsandbytes NF4 holds NF4Linear layers, got {type(layer).__name__}")
    _check_blocksize(layer.group_size, layer.in_features)
    state = {"quant_type": "nf4", "blocksize": layer.group_size, "dtype": "float32",
             "shape": [layer.out_features, layer.in_features]}
    b = layer.packed
    return {"weight": (((b & 15) << 4) | (b >> 4)).reshape(-1, 1),
            "weight.absmax": layer.absmax.float().reshape(-1), "weight.quant_map": NF4_TABLE.clone(),
            BNB_STATE: torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)}


def bnb_quantize_layer(layer, group_size=64):
    """NF4 on the layer's linears (a calibration.LayerCalibration), blocks bitsandbytes can store; returns its
    quantization_config."""
    for name in linear_names(layer.layer):
        _check_blocksize(group_size, layer.layer.get_submodule(name).in_features)
    quantize_layer(layer, group_size)
    return dict(BNB_CONFIG)


def bnb_quantize(model, calibration_ids=None, **options):
    """NF4 every linear but lm_head in bitsandbytes' blocks, in place (data-free)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return bnb_quantize_layer(whole_model(model), **CHECKPOINT.checked(options))


CHECKPOINT = CheckpointMethod(name="bitsandbytes", parts=bnb_parts, read=bnb_read, write=bnb_write,
                              quantize=bnb_quantize, validate=bnb_validate, quantize_layer=bnb_quantize_layer,
                              options=options_for(bnb_quantize_layer, group_size=choice_option(BNB_BLOCKSIZES)))
