"""FP8 E4M3 weights with one float32 scale per 128 x 128 block (the Qwen3-FP8 / DeepSeek-V3 checkpoint layout).

E4M3 (float8_e4m3fn) has 4 exponent bits and 3 mantissa bits: 448 is its largest value and its grid is relative
(every binade holds 8 steps), so each value is kept to about 2^-4 of itself. One scale per block maps the block's
largest magnitude onto 448:

    s[i, j] = amax(W[block i, block j]) / 448          q = e4m3(W / s)          W_hat = q * s

The checkpoint stores q as `weight` (float8_e4m3fn [out, in]) and s as `weight_scale_inv` (float32
[ceil(out/128), ceil(in/128)]); despite its name it multiplies. Storage: 8 bits per weight + 32 / 128^2 = 8.002.
Shapes that are not multiples of the block get a ragged last block row / column (its scale covers fewer weights).

The layer is W8A16: its kernel widens FP8 tiles to float32 in registers. `w8a8_reference` computes what an FP8 x FP8
tensor-core GEMM does instead (activations rounded to E4M3 per token per 128 inputs), to measure that on a CPU.
"""
import torch
import torch.nn.functional as F

from ..kernels import triton_formats
from ..kernels.triton_formats import fp8_block_kernel, fp8_block_matmul  # noqa: F401  (the book's names)
from ..layers import QuantLinear
from .method import CheckpointMethod, config_field, int_option, options_for, scale_tensor
from .numerics.minifloats import E4M3_HALF_SHIFT, E4M3_MAX, e4m3_halves


def _blocks(out_f, in_f, block):
    return -(-out_f // block), -(-in_f // block)


def _check_block(block):
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")


def quantize_blocks(weight, block=128):
    """weight [out, in] -> (weight float8_e4m3fn [out, in], scale_inv float32 [ceil(out/b), ceil(in/b)])."""
    _check_block(block)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight has NaN or infinite values")
    out_f, in_f = weight.shape
    rows, cols = _blocks(out_f, in_f, block)
    # zero padding never raises a block's amax, so a ragged edge block is scaled by its real weights only
    padded = F.pad(weight.float(), (0, cols * block - in_f, 0, rows * block - out_f))
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)                   # an all-zero block still gets a scale
    scale = amax / E4M3_MAX
    # the clamp guards against x / s rounding a hair above 448; torch's cast rounds to nearest even
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale


def _expand(scale_inv, out_f, in_f, block):
    """Per-block scales [rows, cols] -> per-weight scales [out, in] (indexing, so that a huge block costs nothing)."""
    rows = torch.arange(out_f, device=scale_inv.device) // block
    cols = torch.arange(in_f, device=scale_inv.device) // block
    return scale_inv.float()[rows][:, cols]


def _check_shapes(weight, scale_inv, block):
    _check_block(block)
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"weight and scale_inv must be 2-D, got {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    expected = _blocks(*weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for weight "
                         f"{tuple(weight.shape)} with {block}x{block} blocks")


def dequantize_blocks(weight, scale_inv, block=128):
    """weight fp8 [out, in], scale_inv [ceil(out/b), ceil(in/b)] -> float32 [out, in]."""
    _check_shapes(weight, scale_inv, block)
    return weight.float() * _expand(scale_inv, *weight.shape, block)


def quantize_activations(x, group=128):
    """x [n, k] -> (float8_e4m3fn [n, k], scale float32 [n, ceil(k/group)]): per token, per `group` inputs, the
    FP8 activations a W8A8 GEMM consumes (computed on the fly at run time, hence "dynamic")."""
    _check_block(group)
    n, k = x.shape
    groups = -(-k // group)
    g = F.pad(x.float(), (0, groups * group - k)).reshape(n, groups, group)
    scale = g.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, groups * group)[:, :k].contiguous(), scale


def w8a8_reference(x, weight, scale_inv, block=128):
    """x [n, in], weight fp8 [out, in], scale_inv [ceil(out/b), ceil(in/b)] -> [n, out] float32.

    What an FP8 x FP8 tensor-core GEMM computes: both operands in E4M3, the raw FP8 products of each b-wide slice of
    the inputs accumulated in float32, then each slice's partial sum rescaled by its activation scale (per token)
    and its weight scale (per block of outputs) and the slices added up."""
    _check_shapes(weight, scale_inv, block)
    out_f, in_f = weight.shape
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [n, {in_f}], got {tuple(x.shape)}")
    xq, xs = quantize_activations(x, block)
    slices = scale_inv.shape[1]
    pad = slices * block - in_f
    a = F.pad(xq.float(), (0, pad)).reshape(x.shape[0], slices, block)
    w = F.pad(weight.float(), (0, pad)).reshape(out_f, slices, block)
    partial = torch.einsum("nsb,osb->nos", a, w)                            # [n, out, slices], one per slice
    w_scale = scale_inv.float().repeat_interleave(block, 0)[:out_f]         # [out, slices]
    return (partial * xs[:, None, :] * w_scale[None]).sum(-1)


class FP8BlockLinear(QuantLinear):
    """weight float8_e4m3fn [out, in] + weight_scale_inv float32 [ceil(out/b), ceil(in/b)] -> y = x @ W_hat^T,
    returned in `dtype` (the book's compute dtype; None: the activations'). block: the engine's keyword for blocks
    other than the checkpoints' 128 x 128."""

    def __init__(self, weight_fp8, scale_inv, bias=None, dtype=None, *, block=128):
        if weight_fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight must be float8_e4m3fn, got {weight_fp8.dtype}")
        _check_shapes(weight_fp8, scale_inv, block)
        scale_tensor(scale_inv, "weight_scale_inv")
        if not bool((scale_inv.float() >= 0).all() & torch.isfinite(scale_inv.float() * E4M3_MAX).all()):
            raise ValueError("weight_scale_inv must be non-negative and finite, and so must the weights it decodes "
                             "(scale x 448)")
        if bool(torch.isnan(weight_fp8.float()).any()):
            raise ValueError("FP8 weight holds NaN codes (0x7F / 0xFF)")
        super().__init__(weight_fp8.shape[1], weight_fp8.shape[0], bias, dtype)
        self.block = block
        self.register_buffer("weight", weight_fp8.contiguous())
        self.register_buffer("weight_scale_inv", scale_inv.float().contiguous())

    @classmethod
    def from_linear(cls, linear, block=128):
        q, s = quantize_blocks(linear.weight.detach(), block)
        return cls(q, s, linear.bias, block=block)

    def dequantize(self):
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block)

    def decode_rows(self, out, start, stop):
        """Rows start:stop: the codes (e4m3_halves, values * 2^-8) times their blocks' scales * 2^8, the same
        products as dequantize's."""
        out.copy_(e4m3_halves(self.weight[start:stop]))
        b, in_f = self.block, self.in_features
        scale = self.weight_scale_inv[torch.arange(start, stop) // b] * E4M3_HALF_SHIFT        # [rows, column blocks]
        full = in_f // b
        if full:
            out[:, :full * b].unflatten(1, (full, b)).mul_(scale[:, :full, None])
        if in_f % b:
            out[:, full * b:].mul_(scale[:, full:])

    def kernel_matmul(self, x2d):
        return triton_formats.fp8_block_matmul(x2d, self.weight, self.weight_scale_inv, block=self.block)

    def storage_bits(self):
        return self.weight.numel() * 8 + self.weight_scale_inv.numel() * 32


def quantize_layer(layer, block=128):
    """Replace the layer's linears (a calibration.LayerCalibration) by FP8BlockLinears, in place. Returns the
    quantization_config that transformers' fine-grained FP8 loader reads."""
    _check_block(block)
    layer.replace(lambda name, linear: FP8BlockLinear.from_linear(linear, block))
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def quantize(model, calibration_ids=None, **options):
    """FP8 every linear but lm_head, in place (data-free: calibration_ids is not used)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **CHECKPOINT.checked(options))


def validate(quantization_config):
    """A fine-grained FP8 quantization_config, checked once: E4M3, dynamic activations, square weight blocks."""
    config_field(quantization_config, "fmt", "e4m3", str, lambda f: f == "e4m3",
                 "'e4m3' (the only FP8 format supported)")
    config_field(quantization_config, "activation_scheme", "dynamic", str, lambda a: a == "dynamic", "'dynamic'")
    if quantization_config.get("weight_block_size") is None:
        raise ValueError("FP8 quantization_config has no weight_block_size (per-tensor FP8 is not supported)")
    size = config_field(quantization_config, "weight_block_size", None, list,
                        lambda b: len(b) == 2 and b[0] == b[1] and isinstance(
        b[0], int) and not isinstance(b[0], bool) and 0 < b[0] <= 1 << 16, "square blocks [b, b], 0 < b <= 65536")
    return {**quantization_config, "block": size[0]}


def _read(parts, quantization_config):
    return FP8BlockLinear(parts["weight"], parts["weight_scale_inv"], parts.get("bias"),
                          block=quantization_config["block"])


def _write(layer, quantization_config):
    if not isinstance(layer, FP8BlockLinear):
        raise TypeError(f"fp8 checkpoints hold FP8BlockLinear layers, got {type(layer).__name__}")
    if layer.block != quantization_config["block"]:
        raise ValueError(f"layer has {layer.block}x{layer.block} blocks, config says "
                         f"{quantization_config['weight_block_size']}")
    return {"weight": layer.weight, "weight_scale_inv": layer.weight_scale_inv}


CHECKPOINT = CheckpointMethod(name="fp8", parts=lambda quantization_config: ("weight", "weight_scale_inv"),
                              read=_read, write=_write, quantize=quantize, validate=validate,
                              quantize_layer=quantize_layer,
                              options=options_for(quantize_layer, block=int_option(1, 1 << 16)))
