"""Calibrating a sparse layer's experts (Qwen3-MoE, Qwen2-MoE): what a data-aware method does with experts that saw
few tokens, what it records, and how GPTQ takes them a chunk at a time. (A shared expert sees every token: its
linears are calibrated as a dense MLP's are, in their own steps before the chunks.)

Each expert's input statistics come from exactly the calibration tokens the router sent it: qwen3_moe.SparseMoeBlock
runs an expert once per batch on its own tokens, so the capture hooks on its linears
(calibration.LayerCalibration.capture) see those and no others, and InputStats.rows counts them. Routing is uneven,
and an expert may see few tokens or none. GPTQ's Hessian from n tokens has rank at most n: with fewer tokens than
input columns it describes a subspace, and the error feedback would fit the handful of tokens seen at the cost of
every direction not seen. So an expert whose tokens number fewer than `min_tokens` (None: its input width, the least
a full-rank Hessian needs) is rounded to nearest instead, on the same grid in the same file: GPTQ with H = I, whose
inverse is diagonal, so that the error feedback moves no other column (obq.error_feedback); AWQ gives such an expert
no scale or clipping of its own (awq.quantize_layer). Never a NaN (no division by a zero count), never a skipped or a
zeroed expert. The router (mlp.gate) is not an nn.Linear and stays dense, as does a shared expert's gate
(mlp.shared_expert_gate, Qwen2-MoE's); compressed-tensors files say so in their `ignore` list (dense_weights), as
llm-compressor's MoE recipes do, for readers that would match them as linears.

A MoE model's quantization_config records, per layer (merged_config keeps PER_LAYER fields as per-layer lists, one
entry per decoder layer, null for a dense one):

    expert_tokens       the calibration tokens routed to each expert (a token counts once for each of its k experts)
    experts_rounded     the experts rounded to nearest for want of tokens
    expert_min_tokens   the threshold (null: each expert's input width)

A chunk of experts at a time (chunked_steps). The statistics of every expert of a layer at once would be E times
an expert's (a Qwen3-30B-A3B layer: 128 x 67 MB, 8.6 GB, for gate/up), so GPTQ walks a sparse layer's experts in
chunks: a chunk's gate/up captured, quantized and their statistics freed, then its down_proj's, then the next chunk's,
each capture re-running the layer from its kept residual (layer_runs.py) with the sparse block running the chunk's
experts alone (SparseMoeBlock.running, set by `running`). An expert's inputs are its own tokens' (router and norm
are unchanged) and its down_proj reads silu(gate(x)) * up(x) of its own gate and up alone, so every statistic, every
code and every byte written is the one the unchunked walk gives. The chunk holds as many experts as fit CHUNK_BYTES,
each priced at its gate/up step's peak (expert_bytes; n = hidden, I = the expert's width):

    chunk = max(1, CHUNK_BYTES // (8 n (n + 1)  +  2 * 4 n^2  +  3 * 4 n I))
              two float64 triangles of X^T X, a float32 Hessian for gate and for up, its float32 weights

Experts the streaming converter left on disk are read as a chunk's capture needs them (`running`'s load), so a
layer's float experts are not held all at once either.
"""
import contextlib
import re

import torch

from ...layers import experts_of, is_moe, model_cfg, moe_config, release_memory, sequential_steps

PER_LAYER = ("expert_tokens", "experts_rounded")
CHUNK_BYTES = 256 * 2 ** 20     # what one chunk of experts may cost while it is calibrated (chunk_size)
ROUTER_IGNORE = "re:.*mlp.gate$"
SHARED_GATE_IGNORE = "re:.*mlp.shared_expert_gate$"
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
    identity; the token counts and starved names are kept for the layer's record (record(layer)). Each step first
    hands the memory the step before freed back to the system (layers.release_memory; without it a 30B-shaped
    layer's resident memory grew by 30 MB a chunk of three experts, its live tensors by the 8 MB of their codes)."""

    def __init__(self, min_tokens=None):
        self.min_tokens, self.rows, self.few = min_tokens, {}, set()

    def __call__(self, layer, step):
        release_memory()                               # what the step before freed, back to the system
        stats = layer.capture(step)                    # (its float64 sums go when this returns)
        made, few = hessians(stats, self.min_tokens)
        self.rows.update({name: s.rows for name, s in stats.items()})
        self.few |= few
        return made

    def record(self, layer):
        return layer_record(layer, self.rows, self.few, self.min_tokens)


def dense_weights(module):
    """The patterns (compressed-tensors' `ignore`) of the weights a MoE model keeps dense that a reader would
    match as linears: the routers, and the shared experts' gates where the model has them; [] for a dense model."""
    if not is_moe(module):
        return []
    shared = getattr(model_cfg(module), "shared_expert_intermediate_size", 0)
    return [ROUTER_IGNORE] + [SHARED_GATE_IGNORE] * bool(shared)


def refuse(cfg, what, why):
    """ValueError, before any work, where a method cannot yet treat a Qwen3-MoE model's experts."""
    if moe_config(cfg):
        raise ValueError(f"{what} is not implemented for MoE models: {why}")


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


def expert_bytes(expert):
    """Bytes one expert (a SwiGLU MLP) costs while its chunk is calibrated, at the peak of its gate/up step (its
    largest, hidden >= intermediate): its input's statistics (InputStats: two float64 upper triangles of
    [hidden, hidden], the total and the open slot's), the float32 Hessian [hidden, hidden] GPTQ makes of them for
    gate_proj and again for up_proj, and its three linears' float32 weights."""
    n, inter = expert.gate_proj.in_features, expert.gate_proj.out_features
    return 2 * 8 * n * (n + 1) // 2 + 2 * 4 * n * n + 3 * 4 * n * inter


def chunk_size(experts, budget=None):
    """Experts per chunk: as many as fit `budget` bytes (None: CHUNK_BYTES) at expert_bytes each, at least one.
    Qwen3-30B-A3B (hidden 2048, intermediate 768): 86 MB an expert, 3 a chunk. Several processes
    (engine.distributed) keep a float64 sum per slot of theirs instead of two, more where ranks are few."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // expert_bytes(experts[0]))


def chunked_steps(layer, budget=None):
    """layers.sequential_steps(layer) with a sparse layer's expert steps taken a chunk of experts at a time
    (module docstring): q/k/v, o, then for each chunk (chunk_size) its experts' gate/up, then their down_proj."""
    steps, experts = sequential_steps(layer), experts_of(layer)
    if experts is None:
        return steps
    size = chunk_size(experts, budget)
    chunks = [range(first, min(first + size, len(experts))) for first in range(0, len(experts), size)]
    shared = tuple(tuple(n for n in step if expert_of(n) is None) for step in steps[2:])    # a shared expert's
    return steps[:2] + tuple(step for step in shared if step) + tuple(
        tuple(n for n in step if expert_of(n) in chunk) for chunk in chunks for step in steps[2:])


def reached(layer, watched):
    """The experts (indices) that runs of a decoder layer must run when each stops as soon as every `watched`
    module has seen its input (calibration.capture; None: runs to the end): the experts that own a watched module,
    none ([]) when no watched module is an expert's (the router and a shared expert read their inputs before any
    expert runs)."""
    experts = experts_of(layer)
    if experts is None or watched is None:
        return None
    owner = {id(m): e for e, expert in enumerate(experts) for m in expert.modules()}
    return sorted({owner[id(m)] for m in watched if id(m) in owner})


def not_held(experts, chosen):
    """The experts among `chosen` (indices; None: all) with a weight still on the meta device (not read yet)."""
    return [e for e in (range(len(experts)) if chosen is None else chosen)
            if any(p.is_meta for p in experts[e].parameters())]


@contextlib.contextmanager
def running(layer, watched=None, load=None):
    """`with running(layer, watched, load):` runs of the decoder layer for a capture of the `watched` modules (None:
    whole runs) run the experts `reached` names alone (SparseMoeBlock.running); those of them not read yet are read
    first, load(indices) (the streaming converter's experts, left on disk until a capture needs them)."""
    experts = experts_of(layer)
    if experts is None:
        yield
        return
    chosen = reached(layer, watched)
    missing = not_held(experts, chosen)
    if missing and load is None:
        raise ValueError(f"experts {missing[:3]} of this layer were never read (no loader was given)")
    if missing:
        load(missing)
    layer.mlp.running = None if chosen is None else set(chosen)
    try:
        yield
    finally:
        layer.mlp.running = None
