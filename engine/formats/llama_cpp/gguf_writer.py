"""GGUF writer: the engine's model, with its quantized layers kept as they are where GGML has their type, in the
single file llama.cpp runs (the container is described in gguf_file.py, the blocks in engine/formats/llama_cpp/ggml.py).

Which layer becomes which GGML type, and how exactly:

  engine layer                                        GGML   stored                       exact?
  GGMLLinear (read from GGUF, or GPTQ on a GGML grid) its    its own blocks, as they are  yes, byte for byte
                                                      type   (Q4_0 ... Q8_0, K-quants, IQ4, ...)
  AffineQuantLinear 4-bit, g32, zero 8 (symmetric)    Q4_0   d = scale                    yes: the same codes, bit for bit
  AffineQuantLinear 4-bit, g32, other zeros           Q4_1   d = scale, m = f16(offset)   codes and scales yes; the offset
                                                                                          -zero * scale is rounded to f16
  AffineQuantLinear 8-bit, g32, zero 128              Q8_0   d = scale, int8 q - 128      yes
  MXFP4Linear                                         MXFP4  E8M0 byte, split nibbles     yes
  NVFP4Linear (in % 64 == 0)                          NVFP4  4 E4M3 per 64 + `.scale`     yes (the tensor scale in F32)
  dense weights                                       F32 / F16 / BF16 (norms and biases always F32)
  token embedding (+ an untied lm_head)               dense, or embedding_type: llama.cpp's round-to-nearest in a GGML
                                                      type ("llama.cpp": Q6_K / Q8_0, what llama-quantize gives it)

The Q4_1 offset: offset = -zero * scale is a float32 (an f16 times an integer up to 15) and Q4_1 keeps it as an f16,
so it moves by at most half an f16 ulp of |offset| <= 15 * scale: below 2^-11 * 15 = 0.73% of one quantization step
(`offset_shift` reports the largest shift of a file, in steps). Everything else GGML cannot hold (group sizes other
than 32, GPTQ act-order's column permutation, asymmetric 8-bit, FP8, trellis, EntQuant, lattice, NF4 ...) is a
ValueError naming the layer and the reason, or, if the caller asks for it with fallback="F32" / "F16" / "BF16", that
layer's dequantized weight in that type, logged.

Names are gguf.py's tables read backwards (`model.layers.N.self_attn.q_proj` -> `blk.N.attn_q`); the architecture is
the model's model_type (llama / qwen2 / qwen3; qwen3_moe and qwen2_moe as `qwen3moe` and `qwen2moe`, their
experts stacked by gguf_experts.py, each stack in one GGML type); a tied lm_head writes no `output.weight`. For
`llama` the q_proj and k_proj rows (of the raw blocks and of the bias) are permuted into GGML's adjacent RoPE pairs
(`permute_rows`, the inverse of gguf.unpermute_rows). The `tokenizer.*` keys are the caller's
(checkpoints/tokenizer.py's `tokenizer_metadata`).
"""
import hashlib
import logging
import struct
from collections import Counter
from pathlib import Path

import torch

from ..numerics.affine import AffineQuantLinear, unpack_nibbles
from ...layers import QuantLinear, linear_names
from .ggml import DENSE, GGML_TYPES, INTEGER, IQ4, QK_K, GGMLLinear, encode
from .ggml_quants import FALLBACK, blocks, check_type, quantize
from ..mx import MXFP4Linear, NVFP4Linear
from . import gguf_experts
from .gguf import ARCHITECTURES, GLOBAL_NAMES, TENSOR_NAMES
from .gguf_file import DIGESTS, DIGESTS_FILE_TYPE, METADATA_DIGEST
from .gguf_tokenizer import byte_tokenizer_metadata
from ...output_lock import output_lock
from ...safe_writes import check_output_file, output_file
from ...safetensors_io import check_records

log = logging.getLogger(__name__)
ALIGNMENT, VERSION = 32, 3
U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 11,
              "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32, "MXFP4": 38,
              "NVFP4": 39}                                   # K: llama.cpp's _S
# llama.cpp's pre-tokenizer fingerprint text (conve------------------------------------------------------------------

_LAYER_NAMES = {hf: g for g, hf in TENSOR_NAMES.items()}
_GLOBALS = {hf: g for g, hf in GLOBAL_NAMES.items()}


def gguf_name(name):
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (the inverse of gguf.hf_name)."""
    module, _, suffix = name.rpartition(".")
    if module in _GLOBALS:
        return f"{_GLOBALS[module]}.{suffix}"
    parts = module.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_NAMES:
        raise ValueError(f"tensor {name!r} has no GGUF name in llama / qwen2 / qwen3")
    return f"blk.{int(parts[2])}.{_LAYER_NAMES[parts[3]]}.{suffix}"


def permute_rows(rows, heads):
    """HF's rotate-half row order -> GGML's adjacent pairs, per head: rows [heads * D, ...] (the converter's
    LlamaModel.permute; gguf.unpermute_rows undoes it)."""
    if rows.shape[0] % (2 * heads):
        raise ValueError(f"{rows.shape[0]} rows do not split into {heads} heads of even size")
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).transpose(1, 2).reshape(rows.shape)


# ---- layers -> GGML blocks --------------------------------------------------------------------------------------

def _f16_values(x):
    return bool(torch.equal(x.half().float(), x))


def ggml_blocks(layer):
    """A quantized linear -> (GGML type, raw uint8 [out, row bytes], tensor scale or None) holding its codes and
    grid (Q4_1's offsets rounded to f16); ValueError naming why GGML cannot hold it otherwise."""
    out_f, in_f = layer.out_features, layer.in_features
    if isinstance(layer, GGMLLinear):
        return layer.ggml_type, layer.raw, None
    if isinstance(layer, AffineQuantLinear):
        if layer.perm is not None:
            raise ValueError("GPTQ act-order (desc_act) permutes the input columns; GGML blocks store no permutation")
        if layer.group_size != 32 or in_f % 32:
            raise ValueError(f"group size {layer.group_size} (in_features {in_f}): GGML's Q4_0 / Q4_1 / Q8_0 blocks "
                             "hold exactly 32 weights; quantize with group size 32")
        scales, offsets = layer.scales, layer.offsets
        if not _f16_values(scales) or bool((scales < 0).any()):
            raise ValueError("scales are not non-negative float16 values, which GGML's blocks store")
        symmetric = layer.zeros is not None and bool((layer.zeros == 2 ** (layer.bits - 1)).all())
        if layer.bits == 4:
            kind = "Q4_0" if symmetric else "Q4_1"
            if kind == "Q4_1" and not bool(torch.isfinite(offsets.half()).all()):
                raise ValueError("offsets exceed float16's range (Q4_1 stores them as f16)")
        elif layer.bits == 8 and symmetric:
            kind = "Q8_0"
        else:
            raise ValueError(f"{layer.bits}-bit {'symmetric' if symmetric else 'asymmetric'} codes: GGML has Q4_0, "
                             "Q4_1 (4-bit) and Q8_0 (8-bit symmetric) only")
        raw = encode(kind, layer.weight_codes, scales, offsets.half().float() if kind == "Q4_1" else None)
        return kind, raw.reshape(out_f, -1), None
    if isinstance(layer, MXFP4Linear):
        raw = encode("MXFP4", unpack_nibbles(layer.blocks.reshape(out_f, -1)), layer.scales)
        return "MXFP4", raw.reshape(out_f, -1), None
    if isinstance(layer, NVFP4Linear):
        if in_f % 64:
            raise ValueError(f"in_features {in_f}: GGML's NVFP4 blocks hold 64 weights")
        raw = encode("NVFP4", unpack_nibbles(layer.packed), layer.block_scale)
        return "NVFP4", raw.reshape(out_f, -1), layer.tensor_scale.reshape(1).float()
    raise ValueError(f"{type(layer).__name__}: GGML has no type for this format")


def offset_shift(layer):
    """How far Q4_1 moves an AffineQuantLinear's offsets: max |f16(offset) - offset| / scale, in quantization steps."""
    shift = (layer.offsets.half().float() - layer.offsets).abs() / layer.scales.clamp_min(2.0 ** -24)
    return float(shift.max())


def _dense(value, kind, name):
    out = value.detach().float() if value.dim() == 1 else value.detach().to(DENSE[kind])
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name} does not fit in {kind} (values overflow)")
    return kind if value.dim() > 1 else "F32", out.contiguous().view(torch.uint8).reshape(-1)


LLAMA_CPP = "llama.cpp"                  # embedding_type: the type llama-quantize gives the embedding and output
EMBEDDING_TYPES = (*DENSE, *INTEGER, *IQ4, LLAMA_CPP)


def embedding_types(linear_types, row, tied):
    """llama-quantize's types for (token_embd, output) in a file whose linears are mostly of one type
    (llama-quant.cpp, llama_tensor_get_type_impl): the output, and a tied embedding, Q6_K, or Q8_0 where the file is
    Q8_0 or a row is not a multiple of 256 (Q6_K's block: it falls back to Q8_0); an untied embedding the file's
    type, falling back as linears do. A file without quantized linears keeps them dense (None)."""
    if not linear_types:
        return None, None
    base = linear_types.most_common(1)[0][0]
    output = "Q8_0" if row % QK_K or base == "Q8_0" else "Q6_K"
    if tied:
        return output, None
    if base not in INTEGER + IQ4:
        return output, output
    return (FALLBACK.get(base, base) if row % GGML_TYPES[base][1] else base), output


def _quantized_embedding(value, kind, name):
    """An embedding or output matrix [rows, hidden] -> (kind, raw): llama.cpp's round-to-nearest, no importance
    matrix (llama-imatrix records none for them); a hidden size that is not a multiple of the type's block takes
    its fallback type, as llama-quantize does (logged)."""
    if value.shape[1] % GGML_TYPES[kind][1] and kind in FALLBACK:
        log.warning("%s: %s needs rows of a multiple of %d, got %d; written as %s", name, kind,
                    GGML_TYPES[kind][1], value.shape[1], FALLBACK[kind])
        kind = FALLBACK[kind]
    check_type(kind, value.shape[1])
    return kind, blocks(kind, *quantize(kind, value.detach().float())).reshape(-1)


def model_tensors(model, dense_type="F32", fallback=None, embedding_type=None):
    """(GGUF tensors [(name, GGML type, torch shape, raw uint8)], report) for `model`: quantized linears in their
    GGML type (or `fallback`, logged, for a layer GGML cannot hold), everything else dense, but for the token
    embedding and an untied lm_head where embedding_type names a GGML type (LLAMA_CPP: llama-quantize's choice,
    `embedding_types`; None: dense_type)."""
    if dense_type not in DENSE or (fallback is not None and fallback not in DENSE):
        raise ValueError(f"dense_type and fallback must be one of {sorted(DENSE)} (fallback also None), got "
                         f"{dense_type!r} and {fallback!r}")
    if embedding_type is not None and embedding_type not in EMBEDDING_TYPES:
        raise ValueError(f"embedding_type must be one of {EMBEDDING_TYPES} or None, got {embedding_type!r}")
    cfg = model.cfg
    check_writable(cfg)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    permuted = cfg.model_type == "llama"
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    tensors, report = [], {"types": Counter(), "fallbacks": {}, "offset_shift": 0.0}
    experts = []                                             # stacked at the end, a stack per layer and linear

    def add(name, kind, shape, raw):
        if gguf_experts.EXPERT_LINEAR.fullmatch(name):
            return experts.append((name, kind, shape, raw))
        target = gguf_name(name)
        part = target.split(".")[-2]
        if permuted and part in heads and not name.endswith(".scale"):
            raw = permute_rows(raw.reshape(shape[0], -1), heads[part])
        tensors.append((target, kind, tuple(shape), raw.reshape(-1)))

    for name, layer in quantized.items():
        shape = (layer.out_features, layer.in_features)
        try:
            kind, raw, scale = ggml_blocks(layer)
        except ValueError as e:
            if fallback is None:
                raise ValueError(f"{name}: {e} (or write it dequantized: fallback F32, F16 or BF16)") from None
            log.warning("%s: %s; written dequantized as %s", name, e, fallback)
            report["fallbacks"][name] = str(e)
            kind, raw = _dense(layer.dequantize(), fallback, name)
            scale = None
        add(f"{name}.weight", kind, shape, raw)
        report["types"][kind] += 1
        if kind == "Q4_1":
            report["offset_shift"] = max(report["offset_shift"], offset_shift(layer))
        if scale is not None:
            add(f"{name}.scale", "F32", (1,), scale.contiguous().view(torch.uint8))
        if layer.bias is not None:
            add(f"{name}.bias", "F32", (layer.out_features,), _dense(layer.bias, "F32", name)[1])
    if embedding_type == LLAMA_CPP:
        linears = Counter({k: n for k, n in report["types"].items() if k not in DENSE})
        chosen = embedding_types(linears, cfg.hidden_size, cfg.tie_word_embeddings)
    else:
        chosen = (embedding_type, embedding_type)
    embeddings = dict(zip(("model.embed_tokens.weight", "lm_head.weight"), chosen))
    dense_linears = set(linear_names(model))
    for name, value in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in quantized or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        gates = name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))     # router, shared gate
        kind = embeddings.get(name) or ("F32" if gates else dense_type)
        kind, raw = _dense(value, kind, name) if kind in DENSE else _quantized_embedding(value, kind, name)
        add(name, kind, gguf_experts.gguf_shape(name, value.shape), raw)
        if value.dim() == 2 and name.rpartition(".")[0] in dense_linears:
            report["types"][kind] += 1
    if cfg.tie_word_embeddings and architecture(cfg) in gguf_experts.OWN_OUTPUT:     # the head written as its own
        tensors += [("output.weight", *entry[1:]) for entry in tensors if entry[0] == "token_embd.weight"]
    return tensors + gguf_experts.stack_experts(experts, gguf_name), report


# ---- metadata ---------------------------------------------------------------------------------------------------

def check_writable(cfg):
    """ValueError, from the config alone, where llama.cpp has no architecture for the model or would run another."""
    if architecture(cfg) not in ARCHITECTURES:
        raise ValueError(f"model_type {cfg.model_type!r} has no GGUF architecture here ({sorted(ARCHITECTURES)})")
    if architecture(cfg) in gguf_experts.ARCHES:
        gguf_experts.check_writable(cfg)


def architecture(cfg):
    """The GGUF architecture of cfg's model_type (qwen3_moe, qwen2_moe: llama.cpp's qwen3moe, qwen2moe)."""
    return gguf_experts.architecture(cfg.model_type) or cfg.model_type


def model_metadata(cfg, name="engine"):
    """{key: value} of the architecture keys llama.cpp reads for cfg.model_type (llama / qwen2 / qwen3 /
    qwen3_moe / qwen2_moe)."""
    arch = architecture(cfg)
    meta = {"general.architecture": arch, "general.type": "model", "general.name": name,
            "general.quantization_version": 2, f"{arch}.vocab_size": cfg.vocab_size,
            f"{arch}.context_length": cfg.max_position_embeddings, f"{arch}.embedding_length": cfg.hidden_size,
            f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.feed_forward_length": cfg.intermediate_size,
            f"{arch}.attention.head_count": cfg.num_attention_heads,
            f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
            f"{arch}.attention.key_length": cfg.head_dim, f"{arch}.attention.value_length": cfg.head_dim,
            f"{arch}.rope.dimension_count": cfg.head_dim, f"{arch}.rope.freq_base": float(cfg.rope_theta),
            f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    if arch in gguf_experts.ARCHES:
        meta.update(gguf_experts.moe_metadata(cfg))
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    if scaling["rope_type"] == "linear":
        meta.update({f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": float(scaling["factor"])})
    elif scaling["rope_type"] != "default":
        raise ValueError(f"RoPE type {scaling['rope_type']!r}: llama.cpp needs a rope_freqs tensor for it, which this "
                         "writer does not compute")
    return meta


# ---- the container ----------------------------------------------------------------------------------------------

_SCALARS = {U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}


def _string(text):
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _kind(key, value):
    """The GGUF value type of a metadata value (ints are u32 as llama.cpp's keys want, token types i32)."""
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        if key == "tokenizer.ggml.token_type":
            return I32
        return U32 if 0 <= value < 2 ** 32 else U64 if 0 <= value < 2 ** 64 else None
    return F32 if isinstance(value, float) else STRING if isinstance(value, str) else None


def _value(key, value):
    if isinstance(value, (list, tuple)):
        kinds = {_kind(key, v) for v in value} or {I32}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(f"metadata {key}: an array must hold values of one GGUF type")
        kind = kinds.pop()
        items = b"".join(_string(v) for v in value) if kind == STRING else \
            struct.pack(f"<{len(value)}{_SCALARS[kind]}", *value)
        return struct.pack("<IIQ", ARRAY, kind, len(value)) + items
    kind = _kind(key, value)
    if kind is None:
        raise ValueError(f"metadata {key}: {type(value).__name__} {value!r} has no GGUF type")
    return struct.pack("<I", kind) + (_string(value) if kind == STRING else struct.pack("<" + _SCALARS[kind], value))


def write_container(path, metadata, tensors, force=False):
    """metadata {key: value}, tensors [(name, GGML type, torch shape, raw uint8)] -> a GGUF v3 file at `path`,
    written as engine.safe_writes.output_file writes (under its lock, never over a file unless force), with each
    tensor's name, type, shape and SHA-256 recorded in the metadata (gguf_file.DIGESTS: the reader verifies them)."""
    path = Path(path)
    entries = b"".join(_string(key) + _value(key, value) for key, value in metadata.items())
    metadata = {**metadata, DIGESTS: [f"{name} {kind} {'x'.join(map(str, shape))} "
                                      f"{hashlib.sha256(raw.contiguous().numpy()).hexdigest()}"
                                      for name, kind, shape, raw in tensors],
                METADATA_DIGEST: hashlib.sha256(entries).hexdigest()}
    if "general.file_type" in metadata:                      # which file the digests are for (gguf_file.py, Integrity)
        metadata[DIGESTS_FILE_TYPE] = metadata["general.file_type"]
    head = bytearray(b"GGUF" + struct.pack("<IQQ", VERSION, len(tensors), len(metadata)))
    for key, value in metadata.items():
        head += _string(key) + _value(key, value)
    offset = 0
    for name, kind, shape, raw in tensors:
        _, block, size = GGML_TYPES[kind]
        if shape[-1] % block or raw.numel() != torch.Size(shape).numel() // block * size:
            raise ValueError(f"tensor {name}: {raw.numel()} bytes of {kind} do not hold shape {tuple(shape)}")
        head += _string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape),
                                            GGML_TYPES[kind][0], offset)
        offset += -(-raw.numel() // ALIGNMENT) * ALIGNMENT
    head += bytes(-len(head) % ALIGNMENT)
    with output_file(path, len(head) + offset, force) as f:
        f.write(head)
        for _, _, _, raw in tensors:
            f.write(memoryview(raw.contiguous().numpy()))
            f.write(bytes(-raw.numel() % ALIGNMENT))


def write_gguf(model, path, tokenizer=None, dense_type="F32", fallback=None, force=False, name="engine",
               records=None, embedding_type=None):
    """Write `model` (dense or quantized, llama / qwen2 / qwen3) as a GGUF file that llama.cpp runs. tokenizer: its
    GGUF keys {"tokenizer.*": value} (engine.checkpoints.tokenizer.tokenizer_metadata makes them from a .gguf file or a
    tokenizer.json folder; None: the byte model's). records:
    provenance strings stored as they are ({"engine.calibration": ...}). embedding_type: the token embedding's (and
    an untied lm_head's) type: None (dense_type), a GGML type, or "llama.cpp" (the types llama-quantize gives them,
    Q6_K or Q8_0: a file the size of llama.cpp's). Returns a report: {"types": {GGML type:
    linears}, "fallbacks": {layer: reason}, "offset_shift": Q4_1's largest offset shift in quantization steps}."""
    records = check_records(records)
    with output_lock(path):                                        # a second writer is refused now, not after it
        check_output_file(path, force)                             # before any tensor is converted
        tensors, report = model_tensors(model, dense_type, fallback, embedding_type)
        metadata = model_metadata(model.cfg, name)
        metadata["general.file_type"] = FILE_TYPES[report["types"].most_common(1)[0][0]] if report["types"] else 0
        metadata.update(byte_tokenizer_metadata(model.cfg) if tokenizer is None else tokenizer)
        metadata.update(records)
        write_container(path, metadata, tensors, force)
    return {**report, "types": dict(report["types"])}
