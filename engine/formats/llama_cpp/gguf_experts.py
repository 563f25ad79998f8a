"""Qwen3-MoE in GGUF: llama.cpp's `qwen3moe` architecture, read (gguf.py) and written (gguf_writer.py).

llama.cpp stores a sparse layer's experts stacked, one tensor per linear for all of them, and its router as a
dense matrix:

    blk.N.ffn_gate_inp.weight    [experts, hidden]          model.layers.N.mlp.gate.weight (always F32 here)
    blk.N.ffn_gate_exps.weight   [experts, I, hidden]       model.layers.N.mlp.experts.E.gate_proj, E = 0 .. experts-1
    blk.N.ffn_up_exps.weight     [experts, I, hidden]       ... up_proj
    blk.N.ffn_down_exps.weight   [experts, hidden, I]       ... down_proj

(torch order; GGUF's ne is reversed). A stack is one GGML type, expert e's rows the e-th run of its bytes, so each
expert splits off as its own raw blocks and loads as the same layer a dense model's linear would. The metadata says
`qwen3moe.expert_count`, `expert_used_count` (top k) and `expert_feed_forward_length` (I); every stack and router
must agree with them. llama.cpp's qwen3moe graph renormalizes the top-k weights (norm_topk_prob) and has experts in
every layer, so the reader reads norm_topk_prob = true, and the writer refuses a model that differs in either.
"""
import re

import torch

from .ggml import DENSE, dequantize, quantized_linear

ARCH, MODEL_TYPE = "qwen3moe", "qwen3_moe"
ROUTER = "ffn_gate_inp"
STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERT_LINEAR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")


def stack_name(kind):
    """The HF-style name gguf.hf_name gives a stack (its experts' common name without the expert index)."""
    return f"mlp.experts.{STACKS[kind]}"


def expert_names(stacked, experts):
    """'model.layers.3.mlp.experts.up_proj.weight', 4 -> the four experts' names, 'model.layers.3.mlp.experts.E.up_proj
    .weight' for E = 0 .. 3."""
    head, _, linear = stacked.rpartition(".experts.")
    return [f"{head}.experts.{e}.{linear}" for e in range(experts)]


def moe_config(f, get):
    """The Qwen3MoeConfig keys of config.json for the qwen3moe GGUFFile f (get: gguf.hf_config's checked reader of
    `qwen3moe.*` keys), after checking every router and stack against the metadata: a layer is sparse when it has a
    router, and then must have all three stacks of [expert_count, ...] with expert_feed_forward_length rows."""
    experts, used, width = get("expert_count"), get("expert_used_count"), get("expert_feed_forward_length")
    hidden, layers = get("embedding_length"), get("block_count")
    shapes = {ROUTER: (experts, hidden), "ffn_gate_exps": (experts, width, hidden),
              "ffn_up_exps": (experts, width, hidden), "ffn_down_exps": (experts, hidden, width)}
    dense = []
    for i in range(layers):
        held = {kind: f.tensors.get(f"blk.{i}.{kind}.weight") for kind in shapes}
        if not any(held.values()):
            dense.append(i)
            continue
        for kind, info in held.items():
            if info is None or info.shape != shapes[kind]:
                found = "missing" if info is None else list(info.shape)
                raise ValueError(f"GGUF tensor blk.{i}.{kind}.weight is {found}; the metadata ({ARCH}.expert_count="
                                 f"{experts}, expert_feed_forward_length={width}, embedding_length={hidden}) says "
                                 f"{list(shapes[kind])}")
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": True, "mlp_only_layers": dense}


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
    """ValueError where llama.cpp's qwen3moe would run another model than cfg describes."""
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.sparse(i)]
    if dense:
        raise ValueError(f"layers {dense[:5]} of this qwen3_moe model are dense (mlp_only_layers / "
                         "decoder_sparse_step): llama.cpp's qwen3moe has experts in every layer")
    if not cfg.norm_topk_prob:
        raise ValueError("norm_topk_prob=false: llama.cpp's qwen3moe always renormalizes the top-k weights")


def moe_metadata(cfg):
    return {f"{ARCH}.expert_count": cfg.num_experts, f"{ARCH}.expert_used_count": cfg.num_experts_per_tok,
            f"{ARCH}.expert_feed_forward_length": cfg.moe_intermediate_size}


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
