"""Mixture-of-experts models in GGUF: llama.cpp's `qwen3moe` (Qwen3-MoE) and `qwen2moe` (Qwen2-MoE, with a shared
expert) architectures, read (gguf.py) and written (gguf_writer.py).

llama.cpp stores a sparse layer's experts stacked, one tensor per linear for all of them, and its router as a
dense matrix:

    blk.N.ffn_gate_inp.weight    [experts, hidden]          model.layers.N.mlp.gate.weight (always F32 here)
    blk.N.ffn_gate_exps.weight   [experts, I, hidden]       model.layers.N.mlp.experts.E.gate_proj, E = 0 .. experts-1
    blk.N.ffn_up_exps.weight     [experts, I, hidden]       ... up_proj
    blk.N.ffn_down_exps.weight   [experts, hidden, I]       ... down_proj

and qwen2moe's shared expert as a dense layer's linears beside them, with its sigmoid gate as a vector:

    blk.N.ffn_{gate,up,down}_shexp.weight                   model.layers.N.mlp.shared_expert.{gate,up,down}_proj
    blk.N.ffn_gate_inp_shexp.weight  [hidden]               model.layers.N.mlp.shared_expert_gate.weight [1, hidden]

(torch order; GGUF's ne is reversed). A stack is one GGML type, expert e's rows the e-th run of its bytes, so each
expert splits off as its own raw blocks and loads as the same layer a dense model's linear would. The metadata says
`<arch>.expert_count`, `expert_used_count` (top k), `expert_feed_forward_length` (I) and, for qwen2moe,
`expert_shared_feed_forward_length`; every stack, router and shared expert must agree with them. llama.cpp's graphs
have experts in every layer; qwen3moe's renormalizes the top-k weights (norm_topk_prob), qwen2moe's never does. So
the reader reads norm_topk_prob as the architecture fixes it, and the writer refuses a model that differs.
llama.cpp's qwen2moe also requires `output.weight` (its qwen3moe falls back to the embedding): a tied head is written
as a copy of `token_embd`, so the file reads back untied, with the same logits.
"""
import re

import torch

from .ggml import DENSE, dequantize, quantized_linear

ARCHES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}          # GGUF architecture -> model_type
RENORMALIZES = {"qwen3moe": True, "qwen2moe": False}                 # norm_topk_prob, fixed by llama.cpp's graph
OWN_OUTPUT = ("qwen2moe",)           # llama.cpp's qwen2moe requires output.weight: a tied head is written twice
ROUTER, SHARED_GATE = "ffn_gate_inp", "ffn_gate_inp_shexp"
STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SHARED = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj"}
EXPERT_LINEAR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")


def stack_name(kind):
    """The HF-style name gguf.hf_name gives a stack (its experts' common name without the expert index)."""
    return f"mlp.experts.{STACKS[kind]}"


def expert_names(stacked, experts):
    """'model.layers.3.mlp.experts.up_proj.weight', 4 -> the four experts' names, 'model.layers.3.mlp.experts.E.up_proj
    .weight' for E = 0 .. 3."""
    head, _, linear = stacked.rpartition(".experts.")
    return [f"{head}.experts.{e}.{linear}" for e in range(experts)]


def architecture(model_type):
    """The GGUF architecture of a MoE model_type, None for another."""
    return {m: a for a, m in ARCHES.items()}.get(model_type)


def moe_config(f, arch, get):
    """The Qwen3MoeConfig keys of config.json for the MoE GGUFFile f of architecture `arch` (get: gguf.hf_config's
    checked reader of `<arch>.*` keys), after checking every router, stack and shared expert against the metadata: a
    layer is sparse when it has a router, and then must have all three stacks of [expert_count, ...] with
    expert_feed_forward_length rows (and qwen2moe's shared expert, of expert_shared_feed_forward_length)."""
    experts, used, width = get("expert_count"), get("expert_used_count"), get("expert_feed_forward_length")
    hidden, layers = get("embedding_length"), get("block_count")
    shapes = {ROUTER: (experts, hidden), "ffn_gate_exps": (experts, width, hidden),
              "ffn_up_exps": (experts, width, hidden), "ffn_down_exps": (experts, hidden, width)}
    shared = {}
    if arch == "qwen2moe":
        # (llama.cpp reads a missing width as feed_forward_length's, as files converted before the key existed need)
        shared["shared_expert_intermediate_size"] = wide = get("expert_shared_feed_forward_length",
                                                               get("feed_forward_length"))
        shapes.update({SHARED_GATE: (hidden,), "ffn_gate_shexp": (wide, hidden), "ffn_up_shexp": (wide, hidden),
                       "ffn_down_shexp": (hidden, wide)})
    dense = []
    for i in range(layers):
        held = {kind: f.tensors.get(f"blk.{i}.{kind}.weight") for kind in shapes}
        if not any(held.values()):
            dense.append(i)
            continue
        for kind, info in held.items():
            if info is None or info.shape != shapes[kind]:
                found = "missing" if info is None else list(info.shape)
                raise ValueError(f"GGUF tensor blk.{i}.{kind}.weight is {found}; the metadata ({arch}.expert_count="
                                 f"{experts}, expert_feed_forward_length={width}, embedding_length={hidden}"
                                 f"{''.join(f', expert_shared_feed_forward_length={v}' for v in shared.values())}) "
                                 f"says {list(shapes[kind])}")
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": RENORMALIZES[arch], "mlp_only_layers": dense, **shared}


def hf_shape(name, shape):
    """The torch shape of a MoE model's dense tensor `name` whose GGUF shape is `shape`: a shared expert's gate,
    a vector in GGUF, is a [1, hidden] weight (gguf_shape's inverse)."""
    return (1, *shape) if name.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1 else shape


def gguf_shape(name, shape):
    """The GGUF shape of tensor `name` of torch shape `shape`: a shared expert's [1, hidden] gate is a vector."""
    return tuple(shape[1:]) if name.endswith(".mlp.shared_expert_gate.weight") else tuple(shape)


def expert_tensors(info, stacked, raw, keep=None, dense=False):
    """Yield each expert of a stack: (HF weight name, dense tensor) for a dense type or with dense=True, else
    (HF module name, its quantized layer); raw: the stack's uint8 [nbytes]; keep(HF weight name) selects."""
    out_f, in_f = info.shape[1:]
    for name, blocks in zip(expert_names(stacked, info.shape[0]), raw.reshape(info.shape[0], -1)):
        if keep is not None and not keep(name):
            continue
        if dense or info.type_name in DENSE:
            yield name, dequantize(blocks.contiguous(), info.type_name, (out_f, in_f))
        else:
            yield name.removesuffix(".weight"), quantized_linear(blocks.contiguous(), info.type_name, (out_f, in_f))


def check_writable(cfg):
    """ValueError where llama.cpp's qwen3moe or qwen2moe would run another model than cfg describes."""
    arch = architecture(cfg.model_type)
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.sparse(i)]
    if dense:
        raise ValueError(f"layers {dense[:5]} of this {cfg.model_type} model are dense (mlp_only_layers / "
                         f"decoder_sparse_step): llama.cpp's {arch} has experts in every layer")
    if cfg.norm_topk_prob != RENORMALIZES[arch]:
        raise ValueError(f"norm_topk_prob={str(cfg.norm_topk_prob).lower()}: llama.cpp's {arch} "
                         f"{'always' if RENORMALIZES[arch] else 'never'} renormalizes the top-k weights")


def moe_metadata(cfg):
    arch = architecture(cfg.model_type)
    shared = {f"{arch}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size} if (
        cfg.shared_expert_intermediate_size) else {}
    return {f"{arch}.expert_count": cfg.num_experts, f"{arch}.expert_used_count": cfg.num_experts_per_tok,
            f"{arch}.expert_feed_forward_length": cfg.moe_intermediate_size, **shared}


def stack_experts(entries, gguf_name):
    """[(HF expert tensor name, GGML type, torch shape, raw)] of every expert linear -> the stacked GGUF tensors
    [(name, type, (experts, out, in), raw)]; a stack's experts must share one type (llama.cpp's stack has one)."""
    stacks = {}
    for name, kind, shape, raw in entries:
        layer, expert, linear, part = EXPERT_LINEAR.fullmatch(name).groups()
        if part != "weight":
            raise ValueError(f"{name}: GGUF's stacked experts hold weights only (no per-expert bias or scale)")
        stacks.setdefault(f"model.layers.{layer}.mlp.experts.{linear}.weight", {})[int(expert)] = (kind, shape, raw)
    out = []
    for stacked, experts in stacks.items():
        kinds = {kind for kind, _, _ in experts.values()}
        if len(kinds) != 1 or sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{stacked}: llama.cpp stacks a layer's experts in one tensor of one GGML type; these "
                             f"are {sorted(kinds)}")
        shape = experts[0][1]
        raws = [experts[e][2].reshape(-1) for e in range(len(experts))]
        out.append((gguf_name(stacked), kinds.pop(), (len(experts), *shape), torch.cat(raws)))
    return out
