"""compressed-tensors checkpoints: what llm-compressor writes and vLLM serves.

config.json's quantization_config says `"quant_method": "compressed-tensors"`, a `format` and `config_groups`, each
group a scheme `{targets: ["Linear"], weights: {num_bits, type, symmetric, strategy, group_size, block_structure,
...}, input_activations, format}`; `ignore` lists layers left dense (lm_head). One entry here reads and writes four
formats, each into the layer its own chapter section built (codes and scales are copied, never re-quantized; the one
arithmetic step is NVFP4's weight_global_scale = 1 / tensor_scale, whose round trip can move the tensor scale by one
float32 ulp):

  pack-quantized        int b-bit (W4A16), strategy "group" (or "channel": one group per row)  -> AffineQuantLinear
      weight_packed      int32 [out, ceil(in * b / 32)]   q + 2^(b-1) (the signed code made unsigned), low bits first
      weight_scale       [out, groups]                     float, the model's dtype (we write float32: readers
                                                            dequantize in the scale's dtype, f16 would round W)
      weight_zero_point  int32 [ceil(out * b / 32), groups] asymmetric only: zp + 2^(b-1), packed along the OUTPUTS
      weight_shape       int64 [2] = (out, in)
    compressed-tensors' codes are signed, q in [-2^(b-1), 2^(b-1) - 1]: W = (q - zp) * scale. Our codes are the
    stored fields c = q + 2^(b-1) and our zero z = zp + 2^(b-1), so W = c * scale + offset with offset = -z * scale.
    Symmetric means zp = 0: offset = -2^(b-1) * scale exactly, no zero points stored.
  float-quantized       FP8 E4M3, strategy "block" [b, b]                                     -> FP8BlockLinear
      weight             float8_e4m3fn [out, in]          weight_scale  f32 [ceil(out/b), ceil(in/b)]  (multiplies)
  nvfp4-pack-quantized  E2M1, blocks of 16, strategy "tensor_group"                             -> NVFP4Linear
      weight_packed      uint8 [out, in/2] (element 2j low nibble)   weight_scale  e4m3 [out, in/16]
      weight_global_scale f32 [1] = 448 * 6 / amax: the RECIPROCAL of our tensor scale (W = e2m1 * scale / global)
  mxfp4-pack-quantized  E2M1, blocks of 32, E8M0 scales, strategy "group"                       -> MXFP4Linear
      weight_packed      uint8 [out, in/2] (element 2j low nibble)   weight_scale  uint8 E8M0 [out, in/32]

The engine runs weights only: a scheme's dynamic input_activations (FP8_BLOCK's per-token FP8, NVFP4's FP4) are
computed at run time by vLLM and are not emulated here; static activation scales are refused.
"""
import torch

from .numerics import experts
from .numerics.affine import AffineQuantLinear, pack_int32, unpack_int32
from ..layers import quantized_linears
from .method import (CheckpointMethod, bool_option, choice_option, config_field, int_option, matrix_shape,
                     options_for, scale_tensor)
from .fp8 import FP8BlockLinear
from .mx import MX_BLOCK, NV_BLOCK, MXFP4Linear, NVFP4Linear

CT_FORMATS = ("pack-quantized", "float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


# ---- the config -------------------------------------------------------------------------------------------------

def quantization_config(format="pack-quantized", bits=4, group_size=64, symmetric=True, block=128):
    """The quantization_config dict llm-compressor's presets write (W4A16 / W4A16_ASYM with our group size,
    FP8_BLOCK, NVFP4A16, MXFP4A16), quantizing every Linear but lm_head."""
    activations = None
    if format == "pack-quantized":
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"pack-quantized bits must be 1, 2, 4 or 8 here, got {bits}")
        weights = {"num_bits": bits, "type": "int", "symmetric": bool(symmetric), "strategy": "group",
                   "group_size": group_size, "dynamic": False}
    elif format == "float-quantized":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                   "block_structure": [block, block], "group_size": None, "dynamic": False}
        # FP8_BLOCK's activations: quantized per token per 128 inputs at run time (nothing stored)
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
                       "dynamic": True}
    elif format == "nvfp4-pack-quantized":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                   "group_size": NV_BLOCK, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    elif format == "mxfp4-pack-quantized":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                   "group_size": MX_BLOCK, "dynamic": False, "scale_dtype": "torch.uint8"}
    else:
        raise ValueError(f"unknown compressed-tensors format {format!r}; choose from {CT_FORMATS}")
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": activations,
              "output_activations": None, "format": format}
    return {"quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def scheme_of(config):
    """quantization_config -> (format, weights args dict, input_activations dict or None) of its one scheme.

    Several config_groups are fine when they agree (same format and weights); a mixed-precision checkpoint, whose
    layers differ, is a ValueError: a reader here sees a layer's tensors, not which group targeted it."""
    if not isinstance(config, dict) or config.get("quant_method") != "compressed-tensors":
        raise ValueError("not a compressed-tensors quantization_config (quant_method must be 'compressed-tensors')")
    status = config.get("quantization_status", "compressed")
    for key, what in (("kv_cache_scheme", "KV-cache quantization"), ("sparsity_config", "sparse weights"),
                      ("transform_config", "rotation transforms")):
        value = config.get(key)
        if value is not None and value != {} and not (isinstance(value, dict) and value.get("format") == "dense"):
            raise ValueError(f"quantization_config {key}={str(value)[:80]}: {what} are not supported (the engine "
                             "would ignore them and compute another model)")
    if status != "compressed":
        raise ValueError(f"quantization_status is {status!r}: only 'compressed' checkpoints store packed weights")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    found = set()
    for name, scheme in groups.items():
        if not isinstance(scheme, dict) or not isinstance(scheme.get("weights"), dict):
            raise ValueError(f"config group {name!r} has no weights scheme (preset names are not supported)")
        fmt = scheme.get("format") or config.get("format")
        if not isinstance(fmt, str) or not isinstance(scheme.get("input_activations"), (dict, type(None))):
            raise ValueError(f"config group {name!r}: format must be a string and input_activations an object or "
                             f"null, got {fmt!r} and {scheme.get('input_activations')!r}"[:300])
        found.add((fmt, repr(sorted(scheme["weights"].items())), repr(scheme.get("input_activations"))))
    if len(found) > 1:
        raise ValueError(f"config_groups use {len(found)} different schemes (mixed precision is not supported)")
    fmt = next(iter(found))[0]
    scheme = next(iter(groups.values()))
    if fmt not in CT_FORMATS:
        raise ValueError(f"unsupported compressed-tensors format {fmt!r}; this engine reads {CT_FORMATS}")
    weights, acts = scheme["weights"], scheme.get("input_activations")
    if weights.get("dynamic", False):
        raise ValueError("dynamic weight quantization stores no weights to read")
    if weights.get("actorder") in ("group", "dynamic"):
        raise ValueError("actorder='group' checkpoints (weight_g_idx) are not supported")
    if acts is not None and acts.get("dynamic") not in (True, "local"):
        raise ValueError("static activation quantization (input_scale) is not supported: the engine runs weights "
                         "only")
    _check_weights(fmt, weights)
    return fmt, weights, acts


def _check_weights(fmt, w):
    want = {"pack-quantized": ("int", None, ("group", "channel")),
            "float-quantized": ("float", 8, ("block",)),
            "nvfp4-pack-quantized": ("float", 4, ("tensor_group",)),
            "mxfp4-pack-quantized": ("float", 4, ("group",))}[fmt]
    kind, bits, strategies = want
    config_field(w, "symmetric", True, bool)
    if w.get("type") != kind or (bits is not None and config_field(w, "num_bits", None, int) != bits):
        raise ValueError(f"{fmt} holds {kind} {bits or ''} weights, config says {w.get('type')} {w.get('num_bits')}")
    if w.get("strategy") not in strategies:
        raise ValueError(f"{fmt}: strategy {w.get('strategy')!r} is not supported (only {strategies})")
    if fmt == "pack-quantized":
        config_field(w, "num_bits", None, int, lambda b: b in (1, 2, 4, 8), "1, 2, 4 or 8")
        if w["strategy"] == "group":
            config_field(w, "group_size", None, int, lambda g: g > 0, "a positive int (group strategy)")
    elif fmt == "float-quantized":
        config_field(w, "block_structure", None, list, lambda b: len(b) == 2 and b[0] == b[1] and type(b[0]) is int
                     and b[0] > 0, "square blocks [b, b]")
    elif not w.get("symmetric", True) or w.get("group_size") != {"nvfp4-pack-quantized": NV_BLOCK,
                                                                  "mxfp4-pack-quantized": MX_BLOCK}[fmt]:
        raise ValueError(f"{fmt} must be symmetric with group_size {NV_BLOCK if 'nv' in fmt else MX_BLOCK}")


def validate(quantization_config):
    """quantization_config -> {"format", "weights", "input_activations"} of its one scheme, checked once."""
    fmt, weights, acts = scheme_of(quantization_config)
    return {"format": fmt, "weights": weights, "input_activations": acts}


def _parts(quantization_config):
    fmt, weights = quantization_config["format"], quantization_config["weights"]
    acts = quantization_config["input_activations"]
    extra = ("input_global_scale",) if acts is not None and acts.get("strategy") == "tensor_group" else ()
    if fmt == "pack-quantized":
        zero = () if weights.get("symmetric", True) else ("weight_zero_point",)
        return ("weight_packed", "weight_scale", "weight_shape") + zero + extra
    if fmt == "float-quantized":
        return ("weight", "weight_scale") + extra
    if fmt == "nvfp4-pack-quantized":
        return ("weight_packed", "weight_scale", "weight_global_scale") + extra
    return ("weight_packed", "weight_scale") + extra


# ---- reading ----------------------------------------------------------------------------------------------------

def _expect(name, t, dtype, shape):
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")


def _float_scale(name, t, shape):
    if tuple(scale_tensor(t, name).shape) != tuple(shape):
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, expected {tuple(shape)}")
    if not torch.isfinite(t.float()).all():
        raise ValueError(f"{name} has NaN or infinite values")
    return t.float()


def _read_packed_int(p, weights):
    bits, per = weights["num_bits"], 32 // weights["num_bits"]
    out_f, in_f = matrix_shape(p["weight_shape"])
    group_size = in_f if weights["strategy"] == "channel" else weights["group_size"]
    groups = -(-in_f // group_size)
    _expect("weight_packed", p["weight_packed"], torch.int32, (out_f, -(-in_f // per)))
    codes = unpack_int32(p["weight_packed"], bits)[:, :in_f]
    scales = _float_scale("weight_scale", p["weight_scale"], (out_f, groups))
    middle = 2 ** (bits - 1)
    if weights.get("symmetric", True):
        zeros = torch.full_like(scales, middle)
    else:
        _expect("weight_zero_point", p["weight_zero_point"], torch.int32, (-(-out_f // per), groups))
        zeros = unpack_int32(p["weight_zero_point"].T, bits)[:, :out_f].T.float()
    return AffineQuantLinear.from_codes(codes, scales, group_size, bits, zeros=zeros, bias=p.get("bias"))


def _read(p, quantization_config):
    fmt, weights = quantization_config["format"], quantization_config["weights"]
    if fmt == "pack-quantized":
        return _read_packed_int(p, weights)
    if fmt == "float-quantized":
        block = weights["block_structure"][0]
        w = p["weight"]
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise ValueError(f"weight must be float8_e4m3fn [out, in], got {w.dtype} {tuple(w.shape)}")
        shape = (-(-w.shape[0] // block), -(-w.shape[1] // block))
        return FP8BlockLinear(w, _float_scale("weight_scale", p["weight_scale"], shape), p.get("bias"), block=block)
    packed = p["weight_packed"]
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be uint8 [out, in/2], got {packed.dtype} {tuple(packed.shape)}")
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    if fmt == "nvfp4-pack-quantized":
        if in_f % NV_BLOCK:
            raise ValueError(f"NVFP4 in_features {in_f} is not a multiple of {NV_BLOCK}")
        _expect("weight_scale", p["weight_scale"], torch.float8_e4m3fn, (out_f, in_f // NV_BLOCK))
        global_scale = _float_scale("weight_global_scale", p["weight_global_scale"].reshape(-1), (1,))
        if global_scale.item() <= 0:
            raise ValueError(f"weight_global_scale must be positive, got {global_scale.item()}")
        return NVFP4Linear(packed, p["weight_scale"], 1.0 / global_scale[0], p.get("bias"))
    if in_f % MX_BLOCK:
        raise ValueError(f"MXFP4 in_features {in_f} is not a multiple of {MX_BLOCK}")
    _expect("weight_scale", p["weight_scale"], torch.uint8, (out_f, in_f // MX_BLOCK))
    return MXFP4Linear(packed.reshape(out_f, -1, 16), p["weight_scale"], p.get("bias"))


# ---- writing ----------------------------------------------------------------------------------------------------

def _write_packed_int(layer, weights):
    if not isinstance(layer, AffineQuantLinear):
        raise ValueError(f"pack-quantized holds AffineQuantLinear layers, got {type(layer).__name__}")
    bits, per = layer.bits, 32 // layer.bits
    group_size = layer.in_features if weights["strategy"] == "channel" else weights["group_size"]
    if bits != weights["num_bits"] or layer.group_size != group_size:
        raise ValueError(f"layer has {layer.bits} bits, group {layer.group_size}; config says "
                         f"{weights['num_bits']} bits, group {group_size}")
    if layer.perm is not None:
        raise ValueError("act-order layer (perm): compressed-tensors has no g_idx, store it without act-order")
    if (layer.scales <= 0).any():
        raise ValueError("pack-quantized needs positive scales")
    if layer.zeros is None:
        raise ValueError("this layer's grid has free offsets (a GGUF Q4_1 / K-quant min), not the integer zero "
                         "points pack-quantized stores")
    zeros = layer.zeros.float()
    middle = 2 ** (bits - 1)
    codes = torch.nn.functional.pad(layer.weight_codes, (0, -layer.in_features % per))
    tensors = {"weight_packed": pack_int32(codes, bits), "weight_scale": layer.scales.float(),
               "weight_shape": torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64)}
    if weights.get("symmetric", True):
        if not (zeros == middle).all():
            raise ValueError("asymmetric layer (zero points other than 2^(bits-1)) cannot be written as symmetric; "
                             "use symmetric=False")
    else:
        z = torch.nn.functional.pad(zeros.T.to(torch.uint8), (0, -layer.out_features % per))
        tensors["weight_zero_point"] = pack_int32(z, bits).T.contiguous()     # packed along the outputs
    return tensors


def _write(layer, quantization_config):
    fmt, weights = quantization_config["format"], quantization_config["weights"]
    if fmt == "pack-quantized":
        return _write_packed_int(layer, weights)
    expected = {"float-quantized": FP8BlockLinear, "nvfp4-pack-quantized": NVFP4Linear,
                "mxfp4-pack-quantized": MXFP4Linear}[fmt]
    if not isinstance(layer, expected):
        raise ValueError(f"{fmt} holds {expected.__name__} layers, got {type(layer).__name__}")
    if fmt == "float-quantized":
        if [layer.block, layer.block] != weights["block_structure"]:
            raise ValueError(f"layer has {layer.block}x{layer.block} blocks, config says {weights['block_structure']}")
        return {"weight": layer.weight, "weight_scale": layer.weight_scale_inv.float()}
    if fmt == "nvfp4-pack-quantized":
        return {"weight_packed": layer.packed, "weight_scale": layer.block_scale,
                "weight_global_scale": (1.0 / layer.tensor_scale.float()).reshape(1)}
    return {"weight_packed": layer.blocks.reshape(layer.out_features, -1), "weight_scale": layer.scales}


# ---- quantizing -------------------------------------------------------------------------------------------------

def quantize_layer(layer, format="pack-quantized", group_size=64, symmetric=True, bits=4, block=128):
    """Quantize the layer's linears (a calibration.LayerCalibration) IN PLACE into `format` (data-free: round to
    nearest for int, the FP8 / FP4 quantizers of fp8.py and mx.py) and return the quantization_config. For GPTQ /
    AWQ layers, quantize with those methods and write with `config_for_model`."""
    config = quantization_config(format, bits, group_size, symmetric, block)

    def make(name, linear):
        if format == "pack-quantized":
            return AffineQuantLinear.from_linear(linear, bits, group_size, sym=symmetric)
        if format == "float-quantized":
            return FP8BlockLinear.from_linear(linear, block)
        return (NVFP4Linear if format == "nvfp4-pack-quantized" else MXFP4Linear).from_linear(linear)

    layer.replace(make)
    return moe_ignore(config, layer.layer)


def moe_ignore(config, module):
    """config, with a MoE model's dense routers and shared experts' gates in its ignore list
    (numerics/experts.py: dense_weights)."""
    config["ignore"] = [*config["ignore"], *experts.dense_weights(module)]
    return config


def quantize(model, calibration_ids=None, **options):
    """Quantize every linear but lm_head in place (data-free: calibration_ids is not used)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **CHECKPOINT.checked(options))


def config_for_model(model):
    """The quantization_config describing a model that is already quantized (RTN, GPTQ, AWQ, FP8, FP4 layers), for
    writing it as compressed-tensors. Int layers are symmetric only if every zero point is the middle code."""
    layers = list(quantized_linears(model).values())
    if not layers:
        raise ValueError("model has no quantized layers")
    first = layers[0]
    if isinstance(first, AffineQuantLinear):
        kinds = {(type(layer), getattr(layer, "bits", None), getattr(layer, "group_size", None)) for layer in layers}
        if len(kinds) > 1:
            raise ValueError(f"layers differ ({len(kinds)} kinds): mixed precision is not supported")
        symmetric = all(layer.zeros is not None and bool((layer.zeros == 2 ** (layer.bits - 1)).all())
                        for layer in layers)
        return moe_ignore(quantization_config("pack-quantized", first.bits, first.group_size, symmetric), model)
    fmt = {FP8BlockLinear: "float-quantized", NVFP4Linear: "nvfp4-pack-quantized",
           MXFP4Linear: "mxfp4-pack-quantized"}.get(type(first))
    if fmt is None or any(type(layer) is not type(first) for layer in layers):
        raise ValueError(f"cannot describe {sorted({type(l).__name__ for l in layers})} layers as compressed-tensors")
    return moe_ignore(quantization_config(fmt, block=getattr(first, "block", 128)), model)


OPTIONS = options_for(quantize_layer, format=choice_option(CT_FORMATS), group_size=int_option(1, also=(-1,)),
                      symmetric=bool_option(), bits=choice_option((1, 2, 4, 8)), block=int_option(1, 1 << 16))


CHECKPOINT = CheckpointMethod(name="compressed-tensors", parts=_parts, read=_read, write=_write, quantize=quantize,
                              validate=validate, quantize_layer=quantize_layer, options=OPTIONS)
