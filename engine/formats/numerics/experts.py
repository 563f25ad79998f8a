"""Calibrating a sparse layer's experts (Qwen3-MoE): what a data-aware method does with experts that saw few tokens,
and what it records.

Each expert's input statistics come from exactly the calibration tokens the router sent it: qwen3_moe.SparseMoeBlock
runs an expert once per batch on its own tokens, so the capture hooks on its linears
(calibration.LayerCalibration.capture) see those and no others, and InputStats.rows counts them. Routing is uneven,
and an expert may see few tokens or none. GPTQ's Hessian from n tokens has rank at most n: with fewer tokens than
input columns it describes a subspace, and the error feedback would fit the handful of tokens seen at the cost of
every direction not seen. So an expert whose tokens number fewer than `min_tokens` (None: its input width, the least
a full-rank Hessian needs) is rounded to nearest instead, on the same grid in the same file: GPTQ with H = I, whose
inverse is diagonal, so that the error feedback moves no other column (obq.error_feedback); AWQ gives such an expert
no scale or clipping of its own (awq.quantize_layer). Never a NaN (no division by a zero count), never a skipped or a
zeroed expert. The router (mlp.gate) is not an nn.Linear and stays dense (compressed-tensors files say so in their
`ignore` list, ROUTER_IGNORE, as llm-compressor's MoE recipes do, for readers that would match it as a linear).

A MoE model's quantization_config records, per layer (merged_config keeps PER_LAYER fields as per-layer lists, one
entry per decoder layer, null for a dense one):

    expert_tokens       the calibration tokens routed to each expert (a token counts once for each of its k experts)
    experts_rounded     the experts rounded to nearest for want of tokens
    expert_min_tokens   the threshold (null: each expert's input width)
"""
import re

import torch

PER_LAYER = ("expert_tokens", "experts_rounded")
ROUTER_IGNORE = "re:.*mlp.gate$"
EXPERT = re.compile(r"(?:.*\.)?mlp\.experts\.(\d+)\.\w+")


def expert_of(name):
    """'model.layers.3.mlp.experts.7.up_proj' -> 7; None for a linear outside the experts."""
    match = EXPERT.fullmatch(name)
    return None if match is None else int(match[1])


def starved(stats, min_tokens=None):
    """{name: InputStats} -> the names of the expert linears that saw fewer than min_tokens tokens (None: fewer
    than their input width)."""
    return {name for name, s in stats.items()
            if expert_of(name) is not None and s.rows < (s.in_features if min_tokens is None else min_tokens)}


def hessians(stats, min_tokens=None):
    """({name: H [in, in]}, starved names): GPTQ's Hessian 2 X^T X / n of each linear's inputs, the identity for a
    starved expert's (with it GPTQ rounds to nearest)."""
    few = starved(stats, min_tokens)
    return {name: torch.eye(s.in_features) if name in few else s.hessian for name, s in stats.items()}, few


class StepHessians:
    """GPTQ's Hessians step by step: steps(layer, step) -> {name: H} of layer.capture(step), a starved expert's the
    identity; the token counts and starved names are kept for the layer's record (record(layer))."""

    def __init__(self, min_tokens=None):
        self.min_tokens, self.rows, self.few = min_tokens, {}, set()

    def __call__(self, layer, step):
        stats = layer.capture(step)                    # (its float64 sums go when this returns)
        made, few = hessians(stats, self.min_tokens)
        self.rows.update({name: s.rows for name, s in stats.items()})
        self.few |= few
        return made

    def record(self, layer):
        return layer_record(layer, self.rows, self.few, self.min_tokens)


def moe_config(cfg):
    """Whether a model's config is a Qwen3-MoE one (config.Qwen3MoeConfig; asked by its model_type, so that a
    method's module need not import the model's config)."""
    return getattr(cfg, "model_type", None) == "qwen3_moe"


def is_moe(module):
    """Whether a model, or a decoder layer of one (a dense layer included), is Qwen3-MoE's."""
    return moe_config(getattr(module, "cfg", None) or getattr(getattr(module, "self_attn", None), "cfg", None))


def refuse(cfg, what, why):
    """ValueError, before any work, where a method cannot yet treat a Qwen3-MoE model's experts."""
    if moe_config(cfg):
        raise ValueError(f"{what} is not implemented for Qwen3-MoE models: {why}")


def layer_record(layer, rows, few, min_tokens=None):
    """The fields a MoE model's layer adds to its quantization_config (module docstring), from {name: tokens seen}
    of (at least) each expert's first linear and the starved names; {} for a dense model's layer."""
    if not is_moe(layer.layer):
        return {}
    experts = getattr(layer.layer.mlp, "experts", None)
    tokens = None if experts is None else [0] * len(experts)
    for name, n in rows.items():
        if tokens is not None and expert_of(name) is not None:
            tokens[expert_of(name)] = n
    return {"expert_tokens": tokens, "experts_rounded": sorted({expert_of(name) for name in few}),
            "expert_min_tokens": min_tokens}
