"""AWQ (Lin et al., 2023): protect the weights that large activations multiply by scaling them up before rounding.

For input channel j with scale s_j > 0,  X W^T = (X diag(s)^-1) (W diag(s))^T  exactly; rounding W diag(s) then
gives the big-activation channels a finer relative grid. The 1/s folds into whatever produced X: an RMSNorm weight
(-> q, k, v and -> gate, up) or the previous linear's output rows (v -> o, up -> down; skipped when v's rows do not
match o's columns, as under GQA); in a sparse (MoE) layer, every expert's gate and up share the norm's scale
(the router's weight and a shared expert's gate take it too), each expert's down its own up's (scaling_pairs).
s = mean|x|^alpha (normalized by sqrt(max * min)), alpha from a 20-point grid minimizing the linears' output error;
alpha = 0 is plain round-to-nearest, so the search never does worse than RTN on the error it measures. Then, as
AutoAWQ does, each group's range is clipped (affine.choose_clip: the shrink that minimizes that group's output
error), which matters more than the scales on a model without outlier channels.

Improvements over the book's code (tested in tests/test_ch39_awq.py):
  * The book keeps every calibration input and recomputes x @ W^T for all tokens at each of the 20 alphas. The
    output error only depends on X through G = X^T X / n:  mean_t ||x_t dW^T||^2 = tr(dW G dW^T), dW = Q(W s)/s - W.
    So we stream G and mean|x| (InputStats) and never hold the inputs; each alpha costs out * in^2, not
    tokens * in * out (the same number, up to float rounding). The clipping search too reads G only, its
    diagonal blocks: each shrink costs out * in * group_size, and no inputs are sampled.
  * The book's to_checkpoint recomputes zero points as round(-offsets / scales).clamp(0, 15), silently changing any
    layer whose offsets are not integer zero points; we recover them exactly or refuse (affine.affine_parts).

Checkpoint (AutoAWQ GEMM, 4-bit):
    qweight int32 [in, out / 8]      8 codes along the OUTPUT dimension; nibble j holds column [0,2,4,6,1,3,5,7][j]
    qzeros  int32 [groups, out / 8]  raw zero points, same order          scales f16 [groups, out]
    W[o, i] = (q[i, o] - z[i // G, o]) * s[i // G, o]
"""
import torch

from .numerics import experts
from .numerics.affine import (AffineQuantLinear, affine_parts, check_bits, choose_clip, fake_quantize,  # noqa: F401
                              group_width, pack_int32, pack_nibbles, quantize_to_affine, unpack_int32)
from .method import CheckpointMethod, bool_option, choice_option, config_field, int_option, options_for, scale_tensor
from ..layers import input_owner
from .numerics.input_stats import InputStats

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- the scale search -------------------------------------------------------------------------------------------

@torch.no_grad()
def search_scale(weights, inputs, bits=4, group_size=128, grid=20):
    """Best per-input-channel scale s [in] for the linears `weights` ([out_k, in] each), all reading `inputs`
    (a tensor [..., in] or an input_stats.InputStats). Returns (s, alpha).

    error(alpha) = sum_k tr(dW_k G dW_k^T) / out_k  with dW_k = Q(W_k s) / s - W_k: the mean squared output error
    on the calibration inputs, as the book measures it, computed from G = X^T X / n."""
    stats = inputs if isinstance(inputs, InputStats) else InputStats.of(inputs)
    x_mean, gram = stats.mean_abs, stats.gram
    weights = [w.float() for w in weights]
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(grid):
        alpha = step / grid
        s = x_mean.clamp_min(1e-4) ** alpha
        s = s / (s.max() * s.min()).sqrt()
        error = sum(scaled_error(w, s, gram, bits, group_size) for w in weights)
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


def scaled_error(weight, s, gram, bits=4, group_size=128):
    """Mean squared output error of quantizing weight [out, in] with input scales s [in]:
    mean over tokens and outputs of ((x / s) Q(W s)^T - x W^T)^2 = tr(dW G dW^T) / out, dW = Q(W s) / s - W."""
    w = weight.float()
    dw = fake_quantize(w * s, bits, group_size) / s - w
    return ((dw @ gram) * dw).sum().item() / w.shape[0]


# Per decoder layer: (norm, previous linear, the linears that read its output); the scale folds into the norm's
# weight, or into the previous linear's output rows when there is no norm in between. Names relative to the layer.
SCALING_PAIRS = (("input_layernorm", None, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("post_attention_layernorm", None, ("mlp.gate_proj", "mlp.up_proj")),
                 (None, "self_attn.v_proj", ("self_attn.o_proj",)),
                 (None, "mlp.up_proj", ("mlp.down_proj",)))


def scaling_pairs(layer):
    """SCALING_PAIRS of a decoder layer; a sparse (MoE) layer's: every expert's gate/up, and a shared expert's, after
    post_attention_layernorm (the router and a shared expert's gate read its output too: their weights take the
    scale, exactly, and stay dense), each expert's down after its own up."""
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        return SCALING_PAIRS
    owners = ["mlp.shared_expert"] * hasattr(layer.mlp, "shared_expert") + [f"mlp.experts.{e}"
                                                                             for e in range(len(experts))]
    return (SCALING_PAIRS[0], ("post_attention_layernorm", None, tuple(f"{owner}.{linear}" for owner in owners
                                                                        for linear in ("gate_proj", "up_proj"))),
            SCALING_PAIRS[2], *((None, f"{owner}.up_proj", (f"{owner}.down_proj",)) for owner in owners))


@torch.no_grad()
def quantize_layer(layer, group_size=128, bits=4, clip=True, expert_min_tokens=None):
    """Scale, clip and quantize one decoder layer's linears (a calibration.LayerCalibration) in place, AutoAWQ's
    way. Returns the quantization_config AutoAWQ writes.

    The inputs of q, o, gate and down are summarized (InputStats) while the FLOAT layer runs on its calibration
    inputs (the layer's inputs are the float layers' outputs, as in AutoAWQ); then each pair's scale is searched and
    folded in, each group's clipping range is searched on the scaled weights (affine.choose_clip; clip=False: the
    book's AWQ, scales only), and every linear is rounded to nearest within its clipped ranges.
    A sparse layer (scaling_pairs): the experts' shared scale is searched on every token that reaches the block
    (the router's inputs), as AutoAWQ's MoE models do; each expert's clipping and its down_proj's scale on its own
    tokens. An expert that saw fewer than expert_min_tokens (None: its input width; numerics/experts.py) keeps the
    shared scale its norm imposes and is otherwise rounded to nearest: no scale of its own, no clipping."""
    check_bits(bits)
    if not isinstance(clip, bool):
        raise ValueError(f"clip must be true or false, got {clip!r}")
    pairs, router = scaling_pairs(layer.layer), getattr(layer.layer.mlp, "gate", None)
    dense = [m for m in (router, getattr(layer.layer.mlp, "shared_expert_gate", None)) if m is not None]
    watched = [input_owner(n) for _, _, names in pairs for n in names] + ["mlp.gate"] * (router is not None)
    stats = layer.capture(dict.fromkeys(watched))
    few = experts.starved(stats, expert_min_tokens)
    clips = {}

    def group(linear):
        return group_width(group_size, linear.in_features)

    for norm, previous, names in pairs:
        linears = [layer.layer.get_submodule(n) for n in names]
        shared = norm == "post_attention_layernorm" and router is not None       # the experts' gate/up
        inputs = stats[layer.prefix + ("mlp.gate" if shared else names[0])]
        s = torch.ones(linears[0].in_features)
        previous = previous and layer.layer.get_submodule(previous)
        starved = not shared and layer.prefix + names[0] in few           # an expert's down_proj, too few tokens
        folds = previous is None or previous.out_features == linears[0].in_features   # GQA: v's rows feed several
        if folds and not starved:                                                     # heads: no fold
            s, _ = search_scale([lin.weight for lin in linears], inputs, bits, group(linears[0]))
            _fold_scale(norm and layer.layer.get_submodule(norm), previous, linears + dense * shared, s)
        # AutoAWQ's clipping search, on the scaled weights: their inputs x / s have the Gram matrix G / (s s^T)
        for name, linear in zip(names, linears):
            own = layer.prefix + input_owner(name)
            clips[layer.prefix + name] = (choose_clip(linear.weight.detach(), stats[own].gram / (s[:, None] * s),
                                                      bits, group(linear)) if clip and own not in few else None)
    layer.replace(lambda name, linear: AffineQuantLinear.from_linear(linear, bits, group(linear), clip=clips[name]))
    return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm",
            **experts.layer_record(layer, {n: one.rows for n, one in stats.items()}, few, expert_min_tokens)}


def quantize(model, calibration_ids, batch_size=8, **options):
    """AWQ every decoder layer of `model` in place (engine.formats.calibration: the inputs of each layer come from
    the float layers before it); options: those of quantize_layer. Returns the quantization_config."""
    from .numerics.calibration import by_layer          # the model walk: only a whole model needs it
    return by_layer(model, CHECKPOINT, calibration_ids, batch_size, **CHECKPOINT.checked(options))


@torch.no_grad()
def apply_awq(model, calibration_ids, bits=4, group_size=128, *, clip=False, batch_size=8):
    """The book's entry point: scale and quantize every decoder layer of `model` in place, AutoAWQ's way, and return
    {linear name: AffineQuantLinear} of the layers put in place. clip=False is the book's AWQ (scales only);
    clip=True adds AutoAWQ's clipping search (what `quantize` and `--method awq` do by default)."""
    quantize(model, calibration_ids, batch_size, bits=bits, group_size=group_size, clip=clip)
    return {name: m for name, m in model.named_modules() if isinstance(m, AffineQuantLinear)}


def _fold_scale(norm, previous, linears, s):
    """Multiply the linears' input columns by s and divide what produces their input (the norm's weight, or the
    previous linear's output rows) by s: the product is unchanged before rounding."""
    if norm is not None:
        norm.weight.div_(s.to(norm.weight.dtype))
    else:
        previous.weight.div_(s[:, None].to(previous.weight.dtype))
        if previous.bias is not None:
            previous.bias.div_(s.to(previous.bias.dtype))
    for linear in linears:
        linear.weight.mul_(s[None, :].to(linear.weight.dtype))


# ---- the checkpoint layout --------------------------------------------------------------------------------------

def _check_bits(bits):
    if bits != 4:
        raise ValueError(f"AutoAWQ GEMM checkpoints are 4-bit, got bits={bits}")


def pack_awq(codes, zeros=None):
    """[rows, cols] codes 0..15 (cols % 8 == 0) -> int32 [rows, cols / 8] in AWQ's interleaved order
    (nibble j of each word holds column AWQ_ORDER[j] of its run of 8: output 1 sits in bits 16-19).
    zeros: the book's second argument, always None there (zero points are packed by a call of their own)."""
    if zeros is not None:
        raise ValueError("pack_awq packs one tensor; pack the zero points by a second call, pack_awq(zeros)")
    return pack_int32(codes, 4, AWQ_ORDER)


def unpack_awq(packed):
    """int32 [rows, words] -> uint8 [rows, words * 8], undoing the interleave."""
    return unpack_int32(packed, 4, AWQ_ORDER)


def to_checkpoint(layer):
    """AffineQuantLinear -> {"qweight", "qzeros", "scales"} (AutoAWQ GEMM). Refuses layers AWQ cannot store
    exactly: a column permutation, non-integer zero points, non-f16 scales, out_features % 8 != 0."""
    codes, scales, zeros, _ = affine_parts(layer)
    if layer.perm is not None:
        raise ValueError("AWQ checkpoints have no column permutation (g_idx); write this layer as GPTQ")
    _check_bits(layer.bits)
    if layer.out_features % 8:
        raise ValueError(f"AWQ packs 8 outputs per word; out_features={layer.out_features}")
    return {"qweight": pack_awq(codes.T), "qzeros": pack_awq(zeros.T),
            "scales": scales.T.to(torch.float16).contiguous()}


def from_checkpoint(qweight, qzeros, scales, group_size, bias=None, dtype=None):
    """AutoAWQ GEMM tensors -> AffineQuantLinear (its integer zero points as stored, returning `dtype`)."""
    if any(t.dtype != torch.int32 or t.dim() != 2 for t in (qweight, qzeros)):
        raise ValueError("AWQ qweight / qzeros must be 2-D int32")
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    group_size = group_width(group_size, in_f)
    groups = -(-in_f // group_size)
    if tuple(qzeros.shape) != (groups, out_f // 8) or tuple(scales.shape) != (groups, out_f):
        raise ValueError(f"AWQ qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit qweight "
                         f"{tuple(qweight.shape)} with group_size {group_size}")
    if not bool(torch.isfinite(scale_tensor(scales, "AWQ scales").float()).all()):
        raise ValueError("AWQ scales must be finite")
    codes = unpack_awq(qweight).T                                               # [out, in]
    zeros = unpack_awq(qzeros).T.float()                                        # [out, groups]
    s = scales.T.float()
    return AffineQuantLinear(codes, s, None, group_size, False, bias, dtype, zeros=zeros)


# ---- the registry entry -----------------------------------------------------------------------------------------

def validate(quantization_config):
    """An AutoAWQ GEMM quantization_config, checked once (AutoAWQ's own keys w_bit / q_group_size are read too):
    4 bits, zero points, version "gemm", group_size -1 or positive (default 128)."""
    bits = quantization_config.get("w_bit", 4)
    config_field(quantization_config, "bits", bits, int, lambda b: b == 4, "4 (AutoAWQ GEMM checkpoints are 4-bit)")
    config_field(quantization_config, "zero_point", True, bool, lambda z: z,
                 "true (AWQ without zero points is not supported)")
    config_field(quantization_config, "version", "gemm", str, lambda v: v.lower() == "gemm",
                 "'gemm' (the only version supported)")
    group_size = config_field(quantization_config, "group_size", quantization_config.get("q_group_size", 128), int,
                              lambda g: g == -1 or g >= 1, "-1 or a positive int")
    return {**quantization_config, "group_size": group_size}


def _read(parts, quantization_config):
    return from_checkpoint(parts["qweight"], parts["qzeros"], parts["scales"], quantization_config["group_size"],
                           parts.get("bias"))


def _write(layer, quantization_config):
    group_size = quantization_config["group_size"]
    if layer.group_size != group_width(group_size, layer.in_features):
        raise ValueError(f"layer has group size {layer.group_size}; config says {group_size}")
    return to_checkpoint(layer)


OPTIONS = options_for(quantize_layer, group_size=int_option(1, also=(-1,)),
                      bits=choice_option((4,)),                  # AutoAWQ GEMM's files hold 4-bit codes only
                      clip=bool_option(), expert_min_tokens=int_option(1))
CHECKPOINT = CheckpointMethod(name="awq", parts=lambda quantization_config: ("qweight", "qzeros", "scales"),
                              read=_read, write=_write, quantize=quantize, validate=validate,
                              quantize_layer=quantize_layer, calibration=lambda options: "float", options=OPTIONS)
