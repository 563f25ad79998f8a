"""GPTQ on GGML's grids: the codes of llama.cpp's block types (the K-quants Q2_K ... Q6_K, and Q4_0 ... Q8_0)
chosen by GPTQ's error feedback instead of by rounding each weight alone, in blocks every llama.cpp build reads.

The grid comes first, from the weights and the calibration: llama.cpp's own quantizer with an importance matrix
(ggml_quants.quantize, bit-exact with `llama-quantize --imatrix`), the importance of input column j being the mean
x_j^2 that llama-imatrix would record, here H_jj / 2 of GPTQ's own Hessian. It fixes every block's scales, for a
K-quant the super-block's f16 d and dmin and the sub-blocks' 6-bit (Q2_K: 4-bit; Q6_K: 8-bit) scales and mins.
Decoded, that is an affine grid per sub-block of 16 or 32 weights (ggml.grid):

    w = q * scale + offset,   q in 0 .. levels - 1      (Q4_K: scale = d sc_j, offset = -dmin m_j, 16 levels)

Then obq.error_feedback visits the columns in GPTQ's order and rounds each one on its sub-blocks' grids, nearest:

    q = clamp(round((w - offset) / scale), 0, levels - 1)

pushing each column's error onto the columns not yet visited. The codes go back into the same blocks
(ggml_quants.blocks), so the file differs from llama.cpp's own with the same importance matrix only in its codes.
Round-to-nearest is the same loop without the feedback: on the same grid, GPTQ's layer error tr(E H E^T) is the
lower one. (Why the importance-weighted grid and not llama.cpp's plain one: GPTQ fixes the codes, not the scales; a
grid whose scales were fitted to the inputs that matter leaves it less error to push around. On SmolLM2 it halves
the Q5_K row's KL; on the tiny model, calibrated on its own training text, the plain grid is better below 4 bits:
imatrix=False keeps it. appendix/frontier.md.)

A row that is not a multiple of 256 cannot hold super-blocks; llama.cpp then writes its FALLBACK type (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0), and so does `ggml_type_for`.

This file extends gptq.py (which knows nothing of llama.cpp): its CHECKPOINT is GPTQ's with the GGML options
(ggml_type, bpw, imatrix, refit, plan) and checkpoint_format "ggml" (an engine folder of GGML blocks on its way
into a GGUF file); the registry (quantized_checkpoints.METHODS) holds it under "gptq". Without a GGML option or
config it is plain GPTQ, gptq.py's own path.
"""
import dataclasses

import torch

from ...config import Qwen3MoeConfig
from ...layers import sequential_steps
from .. import gptq
from ..gptq_order import DEFAULT as DEFAULT_ORDER
from ..gptq_order import ORDERS, SEARCH, visit_order
from ..method import Option, bool_option, choice_option, number_option, options_for
from ..numerics import calibration
from ..numerics.affine import AffineQuantLinear
from ..numerics.obq import error_feedback, inverse_cholesky, layer_error
from . import bit_plan, ggml, ggml_quants, iq4
from .refit import REFIT, refit_scales

# codes per integer type: 2^bits, the digit in the type's name (Q8_0 stores int8, codes 0..255 meaning -128..127);
# the IQ4 types' codes are the 16 levels K + 128 (ggml.IQ4_LEVELS)
LEVELS = {name: 2 ** int(name[1]) for name in ggml.INTEGER}
TYPES = (*LEVELS, *ggml.IQ4)


def nearest_code(type_name, t):
    """t [...]: weights in code units, (w - offset) / scale -> the nearest code of the type's grid."""
    if type_name in ggml.IQ4:
        return iq4.K[iq4.best_index(t - ggml.IQ4_ZERO)] + ggml.IQ4_ZERO
    return t.round().clamp(0, LEVELS[type_name] - 1)


def ggml_type_for(type_name, in_features):
    """The type llama.cpp writes for a row of in_features when `type_name` is asked for: the type itself, or its
    fallback when the row is not a multiple of its block (ValueError if neither fits)."""
    if type_name not in TYPES:
        raise ValueError(f"ggml_type must be one of {TYPES}, got {type_name!r}")
    if in_features % ggml.GGML_TYPES[type_name][1] and type_name in ggml_quants.FALLBACK:
        type_name = ggml_quants.FALLBACK[type_name]
    ggml_quants.check_type(type_name, in_features)
    return type_name


def group_size(type_name):
    """Weights per grid (sub-block): 16 or 32."""
    return ggml.AFFINE[type_name][1]


@torch.no_grad()
def gptq_ggml(weight, hessian, type_name, perm=None, damp=0.01, block=128, imatrix=True, refit=True):
    """weight [out, in], hessian [in, in] = 2 X^T X / n -> raw uint8 [out, row bytes]: GGML blocks of `type_name`
    on llama.cpp's grid with GPTQ's codes. perm [in]: the visit order (None: natural; any permutation writes a
    plain file, since the grids do not depend on it). imatrix=False: llama.cpp's plain grid, no importance.
    refit: then each block's f16 scale refit to the codes (refit.py: refit_scales, the types of REFIT)."""
    out_f, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({cols}, {cols})")
    ggml_quants.check_type(type_name, cols)
    W, H = weight.float().clone(), hessian.float()
    W[:, torch.diag(H) == 0] = 0                         # inputs never active: their weights cannot matter
    importance = torch.diag(H) / 2 if imatrix else None
    rtn, fields = ggml_quants.quantize(type_name, W, importance)     # the grid first: llama.cpp's own
    _, scale, offset = ggml.grid(ggml_quants.blocks(type_name, rtn, fields).reshape(-1), type_name, W.shape)
    perm = torch.arange(cols) if perm is None else perm
    group = perm // group_size(type_name)                # each visited column's grid
    s, o, fixed = scale[:, group], offset[:, group], rtn[:, perm].float()
    codes = torch.empty(out_f, cols)

    def quantize(j, current):
        q = nearest_code(type_name, (current(j, j + 1)[:, 0] - o[:, j]) / s[:, j])
        q = torch.where(s[:, j] == 0, fixed[:, j], q)    # a zero step: every code is the offset
        codes[:, j] = q
        return (q * s[:, j] + o[:, j])[:, None]

    error_feedback(W[:, perm], inverse_cholesky(H[perm][:, perm], damp), quantize, block=block)
    codes = codes[:, torch.argsort(perm)].to(torch.uint8)
    if refit and type_name in REFIT:
        fields = refit_scales(W, H, type_name, codes, fields)
    return ggml_quants.blocks(type_name, codes, fields)


def rtn_ggml(weight, type_name, importance=None):
    """weight [out, in] -> raw uint8 [out, row bytes]: llama.cpp's round-to-nearest, the baseline (importance [in]:
    with llama.cpp's importance matrix, as `llama-quantize --imatrix`)."""
    return ggml_quants.blocks(type_name, *ggml_quants.quantize(type_name, weight, importance))


def ggml_layer(raw, type_name, in_features, bias=None):
    """raw [out, row bytes] -> the GGMLLinear the GGUF reader would build from the same blocks."""
    return ggml.quantized_linear(raw.reshape(-1), type_name, (raw.shape[0], in_features), bias)


MIX = "mix"                # ggml_type="mix": a type per linear (Q2_K ... Q6_K, IQ4) chosen to meet a bpw budget
MIX_TYPES = (*ggml.K_QUANTS, *ggml.IQ4)          # a mix's candidates, each falling back as llama.cpp does


def check_request(ggml_type):
    """ValueError unless ggml_type is a type of TYPES, MIX, or {linear name: type of TYPES}."""
    if isinstance(ggml_type, dict):
        named = list(ggml_type.values())
    elif isinstance(ggml_type, str):
        named = [] if ggml_type == MIX else [ggml_type]
    else:
        named = [ggml_type]
    bad = [t for t in named if not isinstance(t, str) or t not in TYPES]
    if bad:
        raise ValueError(f"ggml_type {bad[0]!r} is not one of {TYPES} (or {MIX!r} with a bpw budget, or a dict of "
                         "linear name -> type)")
    return ggml_type


def bits_per_weight(type_name):
    _, block, size = ggml.GGML_TYPES[type_name]
    return size * 8 / block


PLAN_ROWS = 64           # rows of each linear GPTQ quantizes per candidate while planning (every k-th row)
PROBE_BITS, PROBE_GROUP = 4, 32   # the round-to-nearest whose error at the layer's output measures a sensitivity
PLANS = ("layer_output", "fisher")   # what a candidate's error is priced in (layer_errors)


@torch.no_grad()
def layer_errors(layer, names, damp=0.01, order=DEFAULT_ORDER, imatrix=True, refit=True, rows=PLAN_ROWS,
                 max_sequences=4, plan="layer_output"):
    """{full name: {type: (bits, cost)}}: each candidate type of each linear (MIX_TYPES, each falling back as
    llama.cpp does for the row width) scored by the error GPTQ will leave with it (not round-to-nearest's), in one
    currency for the layer's linears, so that the costs of q_proj and down_proj add up. With e = GPTQ(W_l[rows], H,
    t) - W_l[rows] on every k-th row (rows are quantized independently given H: the error scales with their count):

        plan="layer_output":  cost_l(t) = s_l * sum_o e_o H e_o^T * out / rows
        plan="fisher":        cost_l(t) = sum_o G_o e_o H e_o^T * out / rows      (4 x the KL it adds, to 2nd order)

    s_l, what a unit of the linear's layer error adds at the decoder layer's output, is measured once per linear with
    a 4-bit round-to-nearest in groups of 32 (bit_plan.output_costs); G is the model's output Fisher of the linear's
    rows (layer.fisher; numerics/sensitivity.py: output_fisher)."""
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    if plan == "fisher" and layer.fisher is None:
        raise ValueError("plan='fisher' prices each candidate by the model's output Fisher; quantize through "
                         "gptq.quantize or the layer-by-layer converter, which measure it first")
    stats, errors, probes, table = layer.capture(names), {}, {}, {}
    for name in names:
        full = layer.prefix + name
        linear, H = layer.module(full), stats[full].hessian.double()
        W = linear.weight.float()
        kinds = dict.fromkeys(ggml_type_for(t, linear.in_features) for t in MIX_TYPES)
        step = max(1, W.shape[0] // rows)
        picked = W[::step]
        per_row = layer.fisher[full][::step].double() if plan == "fisher" else torch.ones(len(picked), dtype=H.dtype)
        errors[full] = {}
        for kind in kinds:
            perm = visit_order(torch.diag(H), group_size(kind), order)
            raw = gptq_ggml(picked, H, kind, perm, damp, imatrix=imatrix, refit=refit)
            E = (ggml.dequantize(raw.reshape(-1), kind, picked.shape) - picked).double()
            errors[full][kind] = (W.numel() * bits_per_weight(kind),
                                  float(per_row @ ((E @ H) * E).sum(1)) * len(W) / len(picked))
        if plan == "layer_output":
            probe = AffineQuantLinear.from_linear(linear, PROBE_BITS, PROBE_GROUP)
            probes[full] = (layer_error(probe.dequantize().float(), W, H), {"probe": (0, lambda lin, p=probe: p)})
    if plan == "fisher":
        return errors
    at_output = bit_plan.output_costs(layer, {full: make for full, (_, make) in probes.items()}, max_sequences)
    for full, (probe_error, _) in probes.items():
        (_, cost), = at_output[full].values()
        s = cost / probe_error if probe_error > 0 else 1.0
        table[full] = {kind: (bits, s * err) for kind, (bits, err) in errors[full].items()}
    return table


def plan_mix(layer, names, bpw, damp=0.01, order=DEFAULT_ORDER, imatrix=True, refit=True, plan="layer_output"):
    """{relative name: type}: the type of each linear that meets `bpw` over the layer's linears with the lowest
    added error in `plan`'s currency (bit_plan.choose on layer_errors' costs). Each layer spends the budget on its
    own linears: a budget shared by the whole model did worse, in either currency (appendix/serving.md)."""
    table = layer_errors(layer, names, damp, order, imatrix, refit, plan=plan)
    weights = sum(layer.module(layer.prefix + n).weight.numel() for n in names)
    try:
        chosen = bit_plan.choose(table, bpw * weights)
    except ValueError as e:
        raise ValueError(f"--bpw {bpw} for layer {layer.index}: {e}") from None
    return {name.removeprefix(layer.prefix): kind for name, kind in chosen.items()}


def check_budget(cfg, bpw):
    """ValueError unless a GGML mix of cfg's decoder linears can meet bpw: each linear at the cheapest type its row
    width allows (a row that is not a multiple of 256 has nothing below 4.5 bits). From the config alone, so a
    conversion refuses before it reads a weight."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    total = 0.0
    for out_f, in_f in shapes:
        fits = []
        for t in MIX_TYPES:
            try:
                fits.append(bits_per_weight(ggml_type_for(t, in_f)))
            except ValueError:
                pass
        if not fits:
            raise ValueError(f"--bpw {bpw}: rows of {in_f} weights hold no GGML block (a multiple of 32 is needed)")
        total += out_f * in_f * min(fits)
    low = total / sum(o * i for o, i in shapes)
    if bpw < low:
        raise ValueError(f"--bpw {bpw}: this model's rows ({hidden}, {q}, {inter} wide) allow no GGML mix below "
                         f"{low:.3f} bits per weight (a row that is not a multiple of 256 has no type under 4.5 bits; "
                         "llama.cpp's own low-bit files fall back the same way)")


BPW_RANGE = (2.625, 8.5)           # Q2_K's bits per weight to Q8_0's: what a mix of these types can reach

def rules(options):
    """What GPTQ on GGML grids needs of its options (the type, the budget, the grid, the order) together."""
    ggml_type, bpw = options.get("ggml_type"), options.get("bpw")
    if options.get("plan", PLANS[0]) != PLANS[0] and bpw is None:
        raise ValueError(f"plan={options['plan']!r} prices the candidates of a bits budget's mix; it needs bpw")
    if ggml_type is None and bpw is None:
        key = next(k for k in ("imatrix", "refit", "plan") if k in options)
        does = {"imatrix": "chooses the grid", "refit": "refits the scales",
                "plan": "prices the candidates of a bits budget's mix"}[key]
        raise ValueError(f"{key}={options.get(key)!r} {does} of a GGML type; it needs ggml_type or bpw (--target "
                         "llama.cpp)")
    if ggml_type is not None:
        check_request(ggml_type)
    if (ggml_type in (None, MIX)) != (bpw is not None):
        raise ValueError(f"ggml_type={MIX!r} needs a bits budget (bpw), and a GPTQ bits budget picks GGML types: "
                         f"ggml_type={MIX!r} (what --target llama.cpp --bpw B asks for); got ggml_type={ggml_type!r}, "
                         f"bpw={bpw!r}")
    order = options.get("order", DEFAULT_ORDER)
    if order == SEARCH or (order in ORDERS and ORDERS[order].permuted):
        raise ValueError(f"order {order!r}: GGML blocks store no column permutation and one grid per block; use a "
                         "plain-file order (act_order_static, natural, group_aware...)")


@torch.no_grad()
def quantize_layer(layer, ggml_type=None, order=DEFAULT_ORDER, damp=0.01, bpw=None, imatrix=True, refit=True,
                   plan=PLANS[0], expert_min_tokens=None):
    """GPTQ one decoder layer (a calibration.LayerCalibration) onto GGML blocks, in place, step by step in forward
    order as gptq.quantize_layer does. ggml_type: one type for every linear (each falling back as llama.cpp does),
    {relative linear name: type}, or MIX (or None with bpw): the types plan_mix picks for `bpw` bits per weight over
    the layer (so every layer, and the model, meets it). order: a plain-file visit of gptq_order.ORDERS. imatrix:
    the grid llama-quantize --imatrix picks with the Hessian's diagonal as the importance (True), or its plain
    round-to-nearest grid (False). refit: each block's f16 fields refit to GPTQ's codes where that helps
    (refit.refit_scales). plan: the currency a mix's candidates are priced in (layer_errors). Returns the
    quantization_config, with the type each linear got (ggml_types). A sparse layer's experts: as gptq.py's."""
    ggml_type = MIX if ggml_type is None else ggml_type
    rules(dict(ggml_type=ggml_type, order=order, bpw=bpw, imatrix=imatrix, plan=plan))
    names = [n for step in sequential_steps(layer.layer) for n in step]
    if ggml_type == MIX:
        wanted = plan_mix(layer, names, bpw, damp, order, imatrix, refit, plan)
    else:
        wanted = ggml_type if isinstance(ggml_type, dict) else dict.fromkeys(names, ggml_type)
    types = {name: ggml_type_for(wanted[name], layer.module(layer.prefix + name).in_features) for name in names}
    for hessians in layer.step_hessians(expert_min_tokens):    # a sparse layer's experts a chunk at a time

        def make(name, linear, hessians=hessians):
            kind, H = types[name.removeprefix(layer.prefix)], hessians[name]
            perm = visit_order(torch.diag(H), group_size(kind), order)
            raw = gptq_ggml(linear.weight, H, kind, perm, damp, imatrix=imatrix, refit=refit)
            return ggml_layer(raw, kind, linear.in_features, linear.bias)

        layer.replace(make, names=hessians, rows=True)
    return {"quant_method": "gptq", "checkpoint_format": "ggml", "ggml_type": ggml_type, "order": order,
            "desc_act": False, "imatrix": imatrix, "refit": refit, "ggml_types": types,
            **({"bpw": bpw, "plan": plan} if bpw is not None else {}),
            **layer.expert_record}


# ---- the engine folder on the way to a GGUF file (checkpoint_format "ggml") ----------------------------------------

PARTS = ("ggml_blocks", "ggml_type")


def write_parts(layer):
    """A GGMLLinear -> {"ggml_blocks": uint8 [out, row bytes], "ggml_type": int32 [1] (GGML's type id)}."""
    if not isinstance(layer, ggml.GGMLLinear):
        raise ValueError(f"checkpoint_format 'ggml' holds GGML blocks, got a {type(layer).__name__}")
    return {"ggml_blocks": layer.raw, "ggml_type": torch.tensor([ggml.GGML_TYPES[layer.ggml_type][0]],
                                                                dtype=torch.int32)}


def read_parts(parts):
    """write_parts' tensors (+ "bias") -> the GGMLLinear."""
    raw, kind = parts["ggml_blocks"], parts["ggml_type"]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or kind.dtype != torch.int32 or kind.numel() != 1:
        raise ValueError("GPTQ ggml_blocks must be 2-D uint8 and ggml_type one int32")
    name = ggml.TYPE_NAMES.get(int(kind), "?")
    if name not in TYPES:
        raise ValueError(f"GPTQ ggml_type {int(kind)} ({name}) is not one of {TYPES}")
    _, block, size = ggml.GGML_TYPES[name]
    if raw.shape[1] % size:
        raise ValueError(f"GPTQ ggml_blocks rows of {raw.shape[1]} bytes are not whole {name} blocks of {size}")
    return ggml_layer(raw, name, raw.shape[1] // size * block, parts.get("bias"))


# ---- GPTQ's registry entry, with llama.cpp's grids ------------------------------------------------------------------

GGML = "ggml"                      # checkpoint_format of an engine folder of GGML blocks
OPTIONS = options_for(quantize_layer, ggml_type=Option(lambda t: isinstance(t, (str, dict)),
                                                        f"one of {TYPES}, {MIX!r} or a dict"),
                      bpw=number_option(*BPW_RANGE), imatrix=bool_option(), refit=bool_option(),
                      plan=choice_option(PLANS), **{k: gptq.OPTIONS[k] for k in ("order", "damp", "expert_min_tokens")})
GGML_OPTIONS = set(OPTIONS) - set(gptq.OPTIONS)
PLAIN_OPTIONS = {"bits", "group_size", "sym", "checkpoint_format"}


def is_ggml(quantization_config):
    """Whether a (validated) quantization_config is an engine folder of GGML blocks."""
    return quantization_config["checkpoint_format"] == GGML


def on_grids(options):
    """Whether options (or a quantization_config) ask for GPTQ on llama.cpp's grids."""
    return bool(GGML_OPTIONS & options.keys()) or options.get("checkpoint_format") == GGML


def validate(quantization_config):
    """gptq.validate, or for checkpoint_format "ggml" the GGML request (bits, group_size and sym do not apply)."""
    if quantization_config.get("checkpoint_format") != GGML:
        return gptq.validate(quantization_config)
    check_request(quantization_config.get("ggml_type"))
    return dict(quantization_config)


def all_rules(options):
    """GPTQ's plain options and those of llama.cpp's grids do not mix; each side's own rules otherwise."""
    if not GGML_OPTIONS & options.keys():
        return gptq.CHECKPOINT.rules and gptq.CHECKPOINT.rules(options)
    mixed = sorted(PLAIN_OPTIONS & options.keys())
    if mixed:
        raise ValueError(f"GPTQ on llama.cpp's grids (ggml_type, bpw) takes no {', '.join(mixed)}: the GGML type fixes "
                         "its bits and blocks")
    rules(options)


def fits(cfg, options):
    """A bits budget is one a GGML mix of cfg's row widths can meet (check_budget), from the config alone; a mix is
    not for experts (llama.cpp stacks a layer's experts in one tensor of one type)."""
    if on_grids(options) and options.get("ggml_type") in (None, MIX) and isinstance(cfg, Qwen3MoeConfig):
        raise ValueError("a GGML bits budget (bpw) picks a type per linear, but llama.cpp stacks a sparse layer's "
                         "experts in one tensor of one type: give one ggml_type for a Qwen3-MoE model")
    if options.get("bpw") is not None:
        check_budget(cfg, options["bpw"])


def quantize_any_layer(layer, **options):
    """GPTQ on llama.cpp's grids (quantize_layer) when the options name a GGML type or a bits budget, plain GPTQ
    (gptq.quantize_layer) otherwise."""
    return (quantize_layer if on_grids(options) else gptq.quantize_layer)(layer, **options)


def quantize(model, calibration_ids, batch_size=8, **options):
    """gptq.quantize with llama.cpp's grids among the options (ggml_type, bpw, ...): every decoder layer in place."""
    return calibration.by_layer(model, CHECKPOINT, calibration_ids, batch_size, **CHECKPOINT.checked(options))


CHECKPOINT = dataclasses.replace(
    gptq.CHECKPOINT, quantize=quantize, quantize_layer=quantize_any_layer, validate=validate, rules=all_rules,
    fits=fits, options={**gptq.CHECKPOINT.options, **OPTIONS},
    parts=lambda quantization_config: PARTS if is_ggml(quantization_config) else gptq.PARTS,
    read=lambda parts, quantization_config: read_parts(parts) if is_ggml(quantization_config) else
    gptq.CHECKPOINT.read(parts, quantization_config),
    write=lambda layer, quantization_config: write_parts(layer) if is_ggml(quantization_config) else
    gptq.CHECKPOINT.write(layer, quantization_config),
    output_fisher=lambda options: options.get("plan") == "fisher",
    book_defaults=lambda options: {"order": "natural"} if on_grids(options) else gptq.CHECKPOINT.book_defaults(options))
