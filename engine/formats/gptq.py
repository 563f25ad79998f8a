"""GPTQ (Frantar et al., 2022): quantize a layer's columns one at a time, pushing each column's rounding error onto
the columns not yet quantized, so that the layer's OUTPUT on calibration inputs X moves as little as possible.

    minimize ||X W_hat^T - X W^T||^2,   Hessian H = 2 X^T X / n   (the same for every output row)
    column i:  e = (w_i - quant(w_i)) / [H^-1]_ii,   w_j <- w_j - e [H^-1]_ij   for every later column j

The loop itself is numerics/obq.py's (H^-1's Cholesky factor damped by 1% of mean(diag H), updates applied
lazily a block of 128 columns at a time); this file is GPTQ's quantizer for it: each group's grid
(affine.find_params: f16 scale, integer zero) is chosen from the group's weights as corrected when the loop enters
the group, then every column is rounded on its group's grid. The scale is rounded to f16 when it is chosen, so GPTQ
compensates exactly the grid its file stores.

The column orders GPTQ can visit (natural, act-order, static groups, group-aware, search): gptq_order.py.

Checkpoint (AutoGPTQ, `checkpoint_format` "gptq" = v1, the default everywhere; "gptq_v2" = raw zeros):

    qweight int32 [in * b / 32, out]     32 / b codes along the INPUT dimension per word, low bits first
    qzeros  int32 [groups, out * b / 32] zero points along the OUTPUT dimension; v1 stores zero - 1
    scales  f16   [groups, out]          g_idx int32 [in]
    W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])

v1 cannot store a zero point of 0: (0 - 1) & 0xF = 15 decodes as 16, a model that outputs garbage (real tools have
shipped such files; GPTQModel's v2 -> v1 word subtraction even borrows into the next output's zero). So for v1 the
quantizer picks grids with zero >= 1 (`min_zero=1`: a group whose range starts at 0 gets a one-step-wider grid), and
the writer re-fits any other layer's zero-0 groups on such a grid rather than write a wrapped value.

At load, `to_runtime` sorts the input columns by g_idx once so that groups are contiguous; the resulting
AffineQuantLinear permutes the activations (x[:, perm]) instead.
"""
import functools
import warnings

import torch

from .gptq_order import DEFAULT as DEFAULT_ORDER
from .gptq_order import ORDERS, SEARCH, SEARCHED, check_order, visit_order
from .method import (CheckpointMethod, bool_option, choice_option, config_field, int_option, number_option,
                     options_for, scale_tensor)
from .numerics.affine import (AffineQuantLinear, affine_parts, as_int32, find_params, group_width,  # noqa: F401
                              grouped, pack_int32, unpack_int32)
from .numerics.obq import error_feedback, inverse_cholesky, layer_error

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
PACKABLE_BITS = (2, 4, 8)          # bit widths that tile an int32 word exactly (3-bit GPTQ uses a split layout)


DEFAULTS = {"bits": 4, "group_size": 128, "order": DEFAULT_ORDER, "damp": 0.01, "sym": False,
            "checkpoint_format": "gptq"}


# ---- the algorithm ----------------------------------------------------------------------------------------------

def hessian_from(inputs):
    """The book's gptq.hessian_from: inputs [..., in] (or an iterable of such batches) -> H = 2 X^T X / n [in, in],
    accumulated as the model walk accumulates it (input_stats.InputStats, float64)."""
    from .numerics.input_stats import InputStats        # the walk's statistics, imported where they are used
    return InputStats.of(inputs).hessian


def group_grid(w, bits, sym=False, min_zero=0, f16=True):
    """w [rows, n] -> (scale, zero) [rows], as affine.find_params (f16 as there), but with zero >= min_zero.

    A group whose grid would start at zero (its weights all >= 0, or nearly) gets zero = min_zero and a grid
    stretched so its top code still reaches the group's maximum: scale = max / (top - min_zero)."""
    scale, zero = find_params(w, bits, sym=sym, f16=f16)
    if min_zero:
        top = 2 ** bits - 1
        low = zero < min_zero
        stretched = w.float().max(1).values.clamp(min=0) / (top - min_zero)
        stretched = stretched.half().float() if f16 else stretched
        scale = torch.where(low & (stretched > 0), stretched, scale)
        zero = zero.clamp(min=min_zero)
    return scale, zero


@torch.no_grad()
def gptq_quantize(weight, hessian, bits=4, group_size=128, act_order=False, damp=0.01, block=128, *, order=None,
                  sym=False, min_zero=0):
    """weight [out, in], hessian [in, in] = 2 X^T X / n -> (codes uint8 [out, in], scales [out, groups],
    zeros [out, groups], g_idx int32 [in]); W_hat[o, i] = scales[o, g_idx[i]] * (codes[o, i] - zeros[o, g_idx[i]]).

    The book's arguments: act_order=False visits the columns in their natural order, True by decreasing H_ii with
    groups that are ranges of the visit (a permuted g_idx). block: the lazy batch of obq.error_feedback.
    The engine's, as keywords: order (a name of ORDERS, or an Order) instead of act_order, e.g.
    order="act_order_static"; group_size -1 = one group per row (affine.group_width); min_zero=1 keeps every zero
    point storable in a v1 checkpoint; sym puts the zero point in the middle of the grid."""
    if not isinstance(act_order, bool):
        raise ValueError(f"act_order (the 5th argument) is True or False, got {act_order!r}; the engine's other "
                         f"visits are the keyword order=, one of {tuple(ORDERS)}")
    if order is None:
        order = "act_order" if act_order else "natural"
    elif act_order and check_order(order) != ORDERS["act_order"]:
        raise ValueError(f"act_order=True and order={order!r} ask for two visits; give one")
    spec = check_order(order)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size >= 1 or group_size == -1):
        raise ValueError(f"group_size must be a positive int or -1 (one group per row), got {group_size!r}")
    out_f, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({cols}, {cols})")
    group_size = group_width(group_size, cols)
    W, H = weight.float().clone(), hessian.float()
    diag = torch.diag(H).clone()
    dead = diag == 0                                       # inputs never active: their weights cannot matter
    W[:, dead] = 0
    diag[dead] = 1                                         # as obq.inverse_cholesky (and the reference code) see it
    dev = W.device
    groups = -(-cols // group_size)
    perm = visit_order(diag, group_size, order)
    # The group of each visited column: under plain act-order the ranges of the visit (g_idx then names each
    # column's), otherwise the ranges of the original columns (g_idx stays sorted).
    label = torch.arange(cols, device=dev) // group_size if spec.permuted else perm // group_size
    f16 = not spec.reference_grid
    if spec.static:
        scales, zeros = (t.reshape(out_f, groups) for t in
                         group_grid(grouped(W, group_size).reshape(-1, group_size), bits, sym, min_zero, f16))
    else:
        scales, zeros = torch.zeros(out_f, groups, device=dev), torch.zeros(out_f, groups, device=dev)
    labels, sizes = label.tolist(), torch.bincount(label, minlength=groups).tolist()
    codes = torch.zeros(out_f, cols, device=dev)
    top = 2 ** bits - 1

    def quantize(j, current):
        g = labels[j]
        if not spec.static and (j == 0 or labels[j - 1] != g):     # a new group: its grid from its n columns now
            ahead = current(j, j + sizes[g], as_of_block=spec.reference_grid)
            scales[:, g], zeros[:, g] = group_grid(ahead, bits, sym, min_zero, f16)
        q = (current(j, j + 1)[:, 0] / scales[:, g] + zeros[:, g]).round().clamp(0, top)
        codes[:, j] = q
        return (scales[:, g] * (q - zeros[:, g]))[:, None]

    error_feedback(W[:, perm], inverse_cholesky(H[perm][:, perm], damp), quantize, block=block)
    inverse = torch.argsort(perm)
    scales = scales.half().float() if spec.reference_grid else scales
    return codes[:, inverse].to(torch.uint8), scales, zeros, label[inverse].to(torch.int32)


def dequantize_gptq(codes, scales, zeros, g_idx):
    """(codes [out, in], scales / zeros [out, groups], g_idx [in]) -> W_hat [out, in] float32."""
    g = g_idx.long()
    return scales.float()[:, g] * (codes.float() - zeros.float()[:, g])


@torch.no_grad()
def search_order(weight, hessian, bits=4, group_size=128, candidates=SEARCHED, **options):
    """weight [out, in], hessian [in, in] -> (gptq_quantize's four tensors, the order's name): GPTQ in each candidate
    order, keeping the one with the lowest layer_error (ties: the first). Costs one GPTQ per candidate.

    No order wins everywhere: act-order with static groups usually does, but on a layer whose heavy inputs cluster
    in a few groups (attention's o_proj) a group-aware order can be lower, and max and sum as the group score each
    win on some layers. The default candidates all keep g_idx sorted (desc_act=false); one of them,
    group_aware_reference, is GPTQModel's default, so the search is never above GPTQModel's default on the same
    weight, Hessian and damping."""
    unknown = [name for name in candidates if name not in ORDERS]
    if unknown or not candidates:
        raise ValueError(f"candidates must be a non-empty list of {tuple(ORDERS)}, got {list(candidates)}")
    best = None
    for name in candidates:
        parts = gptq_quantize(weight, hessian, bits, group_size, order=name, **options)
        error = layer_error(dequantize_gptq(*parts), weight.float(), hessian)
        if best is None or error < best[0]:
            best = error, parts, name
    return best[1], best[2]


# ---- the checkpoint layout --------------------------------------------------------------------------------------

def _check_bits(bits):
    if bits not in PACKABLE_BITS:
        raise ValueError(f"GPTQ packing supports bits in {PACKABLE_BITS}, got {bits}")


def _check_format(checkpoint_format):
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")


def pack_gptq(codes, scales, zeros, g_idx, *, bits=4, checkpoint_format="gptq"):
    """codes [out, in], scales / zeros [out, groups], g_idx [in] -> {"qweight", "qzeros", "scales", "g_idx"}.

    v1 ("gptq") stores zero - 1 and so refuses a zero point of 0 (it would wrap); v2 stores raw zeros."""
    _check_bits(bits)
    _check_format(checkpoint_format)
    zeros = zeros.round().to(torch.int64)
    if checkpoint_format == "gptq":
        if (zeros < 1).any():
            raise ValueError("a zero point of 0 cannot be stored in a GPTQ v1 checkpoint: 0 - 1 wraps to "
                             f"{2 ** bits - 1}, which every v1 reader decodes as {2 ** bits} (the book's pack_gptq "
                             "writes it so); quantize with min_zero=1, use make_v1_safe, or write gptq_v2")
        zeros = zeros - 1
    return {"qweight": pack_int32(codes, bits).T.contiguous(),
            "qzeros": pack_int32(zeros.T, bits).contiguous(),
            "scales": scales.T.to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous()}


def unpack_gptq(qweight, qzeros, scales, g_idx, *, bits=4, checkpoint_format="gptq"):
    """Checkpoint tensors -> (codes uint8 [out, in], scales [out, groups], zeros [out, groups], g_idx [in]).

    v1 zeros are read as stored + 1, as every v1 reader does (so a wrapped 0 reads as 2^bits: faithfully garbage)."""
    _check_bits(bits)
    _check_format(checkpoint_format)
    codes = unpack_int32(qweight.T.contiguous(), bits)                        # [out, in]
    zeros = unpack_int32(qzeros, bits).T.float()                              # [out, groups]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return codes, scales.T.float(), zeros, g_idx.to(torch.int32)


def make_v1_safe(codes, scales, zeros, g_idx, bits=4):
    """Re-fit every (row, group) whose zero point is 0 on a grid with zero 1, so that it can go into a v1 file.

    Exact when the group never uses the top code (codes shift up by one); otherwise the group is re-rounded on a
    grid one step wider (scale * top / (top - 1)), an error of at most half that step. Returns new
    (codes, scales, zeros) and the number of groups changed."""
    top = 2 ** bits - 1
    g = g_idx.long()
    bad = zeros == 0
    if not bad.any():
        return codes, scales, zeros, 0
    group_max = torch.zeros_like(scales).scatter_reduce(1, g.expand_as(codes), codes.float(), "amax")
    wider = torch.where(group_max > top - 1, (scales * group_max / (top - 1)).half().float(), scales)
    new_scales = torch.where(bad, wider, scales)
    w = scales[:, g] * codes.float()                                          # zero 0: w = scale * q
    refit = (w / new_scales[:, g]).round().add(1).clamp(0, top)
    new_codes = torch.where(bad[:, g], refit, codes.float()).to(torch.uint8)
    return new_codes, new_scales, torch.where(bad, 1.0, zeros), int(bad.sum())


# ---- the runtime layer ------------------------------------------------------------------------------------------

def to_runtime(codes, scales, zeros, g_idx, group_size, bias=None, dtype=None, *, bits=4):
    """GPTQ tensors (original column order + g_idx) -> AffineQuantLinear (returning `dtype`, as the book's).

    Columns are sorted by g_idx once so that each group is contiguous; the layer then applies x[:, perm]. Without
    act-order g_idx is already sorted and no permutation is stored."""
    out_f, in_f = codes.shape
    groups = scales.shape[1]
    g = g_idx.long()
    if g.shape != (in_f,) or zeros.shape != scales.shape or scales.shape[0] != out_f:
        raise ValueError(f"inconsistent GPTQ shapes: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, "
                         f"zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}")
    if in_f and (g.min() < 0 or g.max() >= groups):
        raise ValueError(f"g_idx values must lie in [0, {groups})")
    expected = (in_f - torch.arange(groups) * group_size).clamp(0, group_size)
    if not torch.equal(torch.bincount(g, minlength=groups), expected):
        raise ValueError(f"g_idx does not give each group {group_size} columns (group_size mismatch?)")
    perm = torch.argsort(g, stable=True)
    if torch.equal(perm, torch.arange(in_f)):
        perm = None
    stored = codes if perm is None else codes[:, perm]
    scales = scales.float()
    return AffineQuantLinear(stored, scales, None, group_size, False, bias, dtype, bits=bits, zeros=zeros, perm=perm)


# ---- whole model ------------------------------------------------------------------------------------------------

def permuted(options):
    """Whether quantize_layer(**options) writes the permuted layout (g_idx permuted, desc_act=true)."""
    order = options.get("order", DEFAULTS["order"])
    return order in ORDERS and ORDERS[order].permuted


@torch.no_grad()
def quantize_layer(layer, bits=DEFAULTS["bits"], group_size=DEFAULTS["group_size"], order=DEFAULTS["order"],
                   damp=DEFAULTS["damp"], sym=DEFAULTS["sym"], checkpoint_format=DEFAULTS["checkpoint_format"],
                   expert_min_tokens=None):
    """GPTQ one decoder layer (a calibration.LayerCalibration) in place, step by step in forward order (q/k/v, o,
    gate/up, down): each step's Hessians come from the layer's inputs passed through its already-quantized earlier
    steps (GPTQModel's "true sequential"). order: a name of ORDERS, or "search" (each linear's order chosen by
    search_order, three GPTQs per linear; the file stays plain). For a v1 checkpoint (the default) every zero point
    is kept >= 1 (min_zero). Returns the quantization_config: desc_act says whether g_idx is permuted (the only
    case that needs it), order records the visit. GPTQ on llama.cpp's grids is llama_cpp/gptq_ggml.py's.
    A sparse (Qwen3-MoE) layer's experts each get the Hessian of the tokens routed to them; one that saw fewer than
    expert_min_tokens (None: its input width) is rounded to nearest (numerics/experts.py, recorded in the config);
    the experts are calibrated a chunk at a time (LayerCalibration.step_hessians: the same bytes, bounded memory)."""
    quantization_config = validate({"quant_method": "gptq", "bits": bits, "group_size": group_size, "order": order,
                                    "desc_act": permuted({"order": order}), "sym": sym,
                                    "checkpoint_format": checkpoint_format})
    min_zero = 1 if checkpoint_format == "gptq" and not sym else 0
    for hessians in layer.step_hessians(expert_min_tokens):

        def make(name, linear, hessians=hessians):
            group = group_width(group_size, linear.in_features)
            weight, options = linear.weight.detach(), dict(damp=damp, sym=sym, min_zero=min_zero)
            if order == SEARCH:
                parts, _ = search_order(weight, hessians[name], bits, group, **options)
            else:
                parts = gptq_quantize(weight, hessians[name], bits, group, order=order, **options)
            return to_runtime(*parts, group, linear.bias, bits=bits)

        layer.replace(make, names=hessians, rows=order != SEARCH)      # search prices an order over all rows
    kept = ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "order")
    return {**{k: quantization_config[k] for k in kept}, **layer.expert_record}


def quantize(model, calibration_ids, batch_size=8, **options):
    """GPTQ every decoder layer of `model` in place, each layer's inputs coming from the quantized layers before it
    (engine.formats.numerics.calibration); calibration_ids [B, T] go through in batches of batch_size. Options: those
    of quantize_layer. Returns the quantization_config."""
    from .numerics.calibration import by_layer          # the model walk: only a whole model needs it
    return by_layer(model, CHECKPOINT, calibration_ids, batch_size, **CHECKPOINT.checked(options))


# ---- the registry entry -----------------------------------------------------------------------------------------

def validate(quantization_config):
    """A GPTQ quantization_config, checked once: bits, group_size (-1: one group per row), checkpoint_format and the
    engine's order (absent in other tools' files), with DEFAULTS filled in; desc_act=true must go with a permuted
    order. Checkpoints written before `order` existed recorded their visit as boolean flags, still accepted."""
    field = functools.partial(config_field, quantization_config)
    bits = field("bits", DEFAULTS["bits"], int, lambda b: b in PACKABLE_BITS, f"one of {PACKABLE_BITS}")
    group_size = field("group_size", DEFAULTS["group_size"], int, lambda g: g == -1 or g >= 1, "-1 or a positive int")
    fmt = field("checkpoint_format", DEFAULTS["checkpoint_format"], str, lambda f: f in CHECKPOINT_FORMATS,
                f"one of {CHECKPOINT_FORMATS}")
    names = (*ORDERS, SEARCH)
    order = field("order", None, (str, type(None)), lambda o: o is None or o in names, f"one of {names}")
    for key in ("desc_act", "sym", "static_groups", "act_group_aware", "order_search"):
        field(key, False, bool)
    desc_act = quantization_config.get("desc_act", False)
    if order is not None and desc_act != (order in ORDERS and ORDERS[order].permuted):
        raise ValueError(f"quantization_config: desc_act={desc_act} does not fit order {order!r} (only 'act_order' "
                         "permutes g_idx)")
    return {**quantization_config, "bits": bits, "group_size": group_size, "checkpoint_format": fmt}


def _read(parts, quantization_config):
    bits, group_size, fmt = (quantization_config[k] for k in ("bits", "group_size", "checkpoint_format"))
    qweight, qzeros, scales, g_idx = (parts[k] for k in PARTS)
    if any(t.dtype != torch.int32 for t in (qweight, qzeros)) or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError("GPTQ qweight / qzeros must be 2-D int32")
    per = 32 // bits
    in_f, out_f = qweight.shape[0] * per, qweight.shape[1]
    group_size = group_width(group_size, in_f)
    groups = -(-in_f // group_size)
    want = {"qzeros": (groups, out_f // per), "scales": (groups, out_f), "g_idx": (in_f,)}
    for k, shape in want.items():
        if tuple(parts[k].shape) != shape:
            raise ValueError(f"GPTQ {k} has shape {tuple(parts[k].shape)}, expected {shape} for qweight "
                             f"{tuple(qweight.shape)}, group_size {group_size}")
    # A negative scale is a real tool's grid (AutoRound's symmetric one puts the largest-magnitude weight, negative,
    # on code 0), so only NaN / infinity is refused.
    if not bool(torch.isfinite(scale_tensor(scales, "GPTQ scales").float()).all()):
        raise ValueError("GPTQ scales must be finite")
    codes, scales, zeros, g_idx = unpack_gptq(qweight, qzeros, scales, g_idx, bits=bits, checkpoint_format=fmt)
    return to_runtime(codes, scales, zeros, g_idx, group_size, parts.get("bias"), bits=bits)


def _write(layer, quantization_config):
    bits, group_size, fmt = (quantization_config[k] for k in ("bits", "group_size", "checkpoint_format"))
    codes, scales, zeros, g_idx = affine_parts(layer)
    if layer.bits != bits or layer.group_size != group_width(group_size, layer.in_features):
        raise ValueError(f"layer has {layer.bits} bits, group {layer.group_size}; config says {bits}, {group_size}")
    if layer.perm is not None and not quantization_config.get("desc_act", False):
        raise ValueError("an act-order layer (permuted g_idx) needs desc_act=true in its config: loaders that trust "
                         "desc_act=false (vLLM) ignore g_idx")
    if fmt == "gptq":
        codes, scales, zeros, changed = make_v1_safe(codes, scales, zeros, g_idx, bits)
        if changed:
            warnings.warn(f"{changed} groups had zero point 0, which GPTQ v1 cannot store; re-fitted them on a "
                          "grid with zero 1 (write checkpoint_format='gptq_v2' to keep them exact)")
    return pack_gptq(codes, scales, zeros, g_idx, bits=bits, checkpoint_format=fmt)


PARTS = ("qweight", "qzeros", "scales", "g_idx")
OPTIONS = options_for(quantize_layer, bits=choice_option(PACKABLE_BITS), group_size=int_option(1, also=(-1,)),
                      order=choice_option((*ORDERS, SEARCH)), damp=number_option(0, 1, open_low=True),
                      sym=bool_option(), checkpoint_format=choice_option(CHECKPOINT_FORMATS),
                      expert_min_tokens=int_option(1))

CHECKPOINT = CheckpointMethod(name="gptq", read=_read, write=_write, quantize=quantize,
                              parts=lambda quantization_config: PARTS, validate=validate, quantize_layer=quantize_layer,
                              calibration=lambda options: "quantized", options=OPTIONS, lazy_experts=True,
                              book_defaults=lambda options: {"group_size": 128, "order": "natural"})
