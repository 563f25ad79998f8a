"""Where a checkpoint is served: which client loads which format (one table, used by `run.py quantize --target` and
by README), the settings each target needs, and the tensor-parallel degrees a checkpoint can be sharded to.

The table records what was seen on a CPU (benchmarks/clients.py re-measures it: vLLM CPU 0.32, llama.cpp through
llama-cpp-python 0.3.36, ONNX Runtime GenAI 0.18, transformers 5.24). A verdict is one of

    loads        the client runs it (the matrix gives the KL against the engine's own model)
    converts     llama.cpp's converter (convert_hf_to_gguf.py) turns the HF layout into a GGUF that runs
    cpu-refuses  refused on this CPU for want of a kernel (GPU kernels exist; not checked here): a warning
    refuses      the client's code refuses the format everywhere: an error

Tensor parallelism (vLLM): column-parallel layers (q, k, v, gate, up) split their outputs over the ranks,
row-parallel ones (o, down) their inputs. Each rank's slice must hold whole quantization units: whole packed int32
words along the packed dimension, whole groups along the inputs of row-parallel layers, whole 128 x 128 FP8 blocks
in both directions. Attention heads split evenly; KV heads split evenly or, when fewer than the ranks, are
replicated (the degree a multiple of their number), so each rank's k / v slice is then one head. vLLM also merges
q / k / v and gate / up into one matrix each, so even unsplit every part but the last must hold whole units.
"""
import math
import warnings
from pathlib import Path

import torch

from ..formats import gptq
from ..formats.llama_cpp import gptq_ggml
from ..qwen3 import Qwen3Config
from ..formats.llama_cpp.gguf import load_gguf
from ..formats.llama_cpp.gguf_writer import write_gguf
from ..loaders import load_dense, read_config
from ..formats.quantized_checkpoints import load_quantized
from ..output_lock import output_lock
from ..safe_writes import check_apart
from ..safetensors_io import checkpoint_records
from .tokenizer import tokenizer_metadata

TARGETS = ("transformers", "vllm", "llama.cpp", "onnx")
VLLM_GROUPS = (-1, 32, 64, 128)
DEFAULT_GROUP = 128                     # GPTQ's and AWQ's group size where none is given
ENGINE_ONLY = "only this engine reads it (no serving client knows the format)"
VLLM_CPU = "vLLM's CPU build has no kernel for it (GPU kernels exist; not checked here)"
FP4_FLOAT32 = ("in float32 the forward pass fails ('expected m1 and m2 to have the same dtype'): load with "
               "dtype=torch.bfloat16 or CompressedTensorsConfig(dequantize=True)")

# kind -> {target: (verdict, reason)}; reasons are the clients' own refusal lines where they give one
LOADS = {
    "dense": {"transformers": ("loads", ""), "vllm": ("loads", ""), "llama.cpp": ("converts", ""),
              "onnx": ("loads", "")},
    "gptq sym": {"transformers": ("loads", ""), "vllm": ("loads", ""), "llama.cpp": ("converts", "dequantized"),
                 "onnx": ("loads", "")},
    "gptq asym": {"transformers": ("loads", ""), "llama.cpp": ("converts", "dequantized"), "onnx": ("loads", ""),
                  "vllm": ("refuses", "vLLM's GPTQ path is symmetric only: 'Unsupported quantization config: "
                                      "bits=4, sym=False'")},
    "gptq act-order": {"transformers": ("loads", ""), "llama.cpp": ("converts", "dequantized"),
                       "onnx": ("loads", ""),
                       "vllm": ("refuses", "vLLM refuses desc_act=True: 'GPTQ group activation ordering "
                                           "(desc_act=True) is no longer supported'")},
    "awq": {"transformers": ("loads", ""), "vllm": ("loads", ""), "onnx": ("loads", ""),
            "llama.cpp": ("refuses", "converter: 'Quant method is not yet supported: awq'")},
    "compressed-tensors int4 sym": {"transformers": ("loads", ""), "vllm": ("loads", ""),
                                    "llama.cpp": ("converts", "dequantized")},
    "compressed-tensors int4 asym": {"transformers": ("loads", "with CompressedTensorsConfig(dequantize=True): its "
                                                              "run-compressed path expects unpacked zero points "
                                                              "[out, groups], the format (and vLLM) packs them"),
                                     "vllm": ("loads", ""),
                                     "llama.cpp": ("converts", "dequantized")},
    "compressed-tensors fp8": {"transformers": ("loads", "it runs the config's dynamic FP8 activations too (W8A8)"), "llama.cpp": ("converts", "dequantized"),
                               "vllm": ("cpu-refuses", "vLLM's CPU FP8 block kernel needs AMX (Sapphire Rapids)")},
    "compressed-tensors nvfp4": {"transformers": ("loads", FP4_FLOAT32 + "; the decompressor rounds the weights "
                                                                          "to bfloat16"),
                                 "llama.cpp": ("converts", "kept as GGML NVFP4"), "vllm": ("cpu-refuses", VLLM_CPU)},
    "compressed-tensors mxfp4": {"transformers": ("loads", FP4_FLOAT32), "vllm": ("cpu-refuses", VLLM_CPU),
                                 "llama.cpp": ("refuses", "converter: 'Quant format mxfp4-pack-quantized ... is "
                                                          "not yet supported'")},
    "fp8": {"transformers": ("loads", "dequantized on CPU"), "llama.cpp": ("converts", "dequantized"),
            "vllm": ("cpu-refuses", "vLLM's CPU FP8 block kernel needs AMX (Sapphire Rapids)"),
            "onnx": ("refuses", "model builder: 'The fp8 quantized model is not currently supported'")},
    "gguf": {"llama.cpp": ("loads", ""), "transformers": ("loads", "gguf_file=..., dequantized; qwen3 only with head_dim 128 (its GGUF "
                                                 "loader ignores attention.key_length)"),
             "vllm": ("refuses", "serve the HF layout: vLLM's GGUF loader is experimental and not checked here"),
             "onnx": ("refuses", "the model builder reads HF folders here, not GGUF")},
    **{method: dict.fromkeys(TARGETS, ("refuses", ENGINE_ONLY)) for method in ("trellis", "entquant", "lattice")},
}
for _kind in ("compressed-tensors int4 sym", "compressed-tensors int4 asym", "compressed-tensors fp8",
              "compressed-tensors nvfp4", "compressed-tensors mxfp4"):
    LOADS[_kind]["onnx"] = ("refuses", "model builder: 'ModelOpt FP8/NVFP4 checkpoints are only supported on the "
                                       "CUDA EP' (it takes every compressed-tensors checkpoint for ModelOpt)")

# transformers 5.25 on Qwen3-MoE (engine files, tests/test_interop_moe.py): it holds the experts fused, as 3-D
# parameters, and reads them from these kinds only; the rest of LOADS holds for the attention and dense layers.
NOT_FUSED = "its {} loader replaces nn.Linears only, so the fused experts stay uninitialized"
MOE_TRANSFORMERS = {
    "dense": ("loads", ""), "compressed-tensors int4 sym": ("loads", ""),
    "compressed-tensors fp8": ("refuses", "its fused experts' dequantizer multiplies by the block scales without "
                                          "expanding them ('The size of tensor a (256) must match the size of tensor "
                                          "b (2)'), so only experts of one block load: --method fp8"),
    "fp8": ("loads", "dequantized on CPU; the expert widths must be multiples of the block (real models' are)"),
    "compressed-tensors mxfp4": ("loads", FP4_FLOAT32),
    "gptq sym": ("refuses", NOT_FUSED.format("GPTQ")), "gptq asym": ("refuses", NOT_FUSED.format("GPTQ")),
    "gptq act-order": ("refuses", NOT_FUSED.format("GPTQ")), "awq": ("refuses", NOT_FUSED.format("AWQ")),
    "bitsandbytes": ("refuses", "it refuses the per-expert NF4 tensors ('ignore_mismatched_sizes')"),
    "compressed-tensors int4 asym": ("refuses", "its experts' decompressor gets no zero points ('Asymmetric quant "
                                                "requires zero-point values'): --option symmetric=true"),
    "compressed-tensors nvfp4": ("refuses", "its fused experts decode to other weights (logits off by ~6 on a tiny "
                                            "model)")}
# vLLM CPU 0.32 on Qwen3-MoE and Qwen2-MoE (engine files, `benchmarks/clients.py --moe ARCH --clients vllm`): the
# dense folder loads; its CPU build has no kernel for 4-bit experts; the rest of LOADS holds (FP8, FP4: no CPU kernel).
MOE_VLLM = dict.fromkeys(("gptq sym", "awq", "compressed-tensors int4 sym", "compressed-tensors int4 asym"), (
    "cpu-refuses", "vLLM's CPU build has no MoE kernel for 4-bit experts ('No WNA16 MoE backend supports the "
                   "deployment configuration')"))
CT_FORMATS = {"pack-quantized": "int4", "float-quantized": "fp8", "nvfp4-pack-quantized": "nvfp4",
              "mxfp4-pack-quantized": "mxfp4"}


def checkpoint_kind(method, options=None, fmt="safetensors"):
    """The table's row for `run.py quantize --method METHOD --option ...` (method None: the dense model)."""
    options = options or {}
    if fmt == "gguf":
        return "gguf"
    if method is None:
        return "dense"
    if method == "gptq":
        return ("gptq act-order" if gptq.permuted(options) else "gptq sym" if options.get("sym")
                else "gptq asym")
    if method == "compressed-tensors":
        kind = CT_FORMATS.get(options.get("format", "pack-quantized"))
        if kind is None:
            raise ValueError(f"compressed-tensors format {options['format']!r} is not one of {sorted(CT_FORMATS)}")
        if kind == "int4":
            kind += " sym" if options.get("symmetric", True) else " asym"
        return f"compressed-tensors {kind}"
    if method not in LOADS:
        raise ValueError(f"no serving entry for method {method!r}")
    return method


def config_kind(config):
    """The table's row for a checkpoint's config.json dict."""
    q = config.get("quantization_config")
    if q is None:
        return "dense"
    method = q.get("quant_method")
    if method == "gptq":
        return checkpoint_kind("gptq", {"order": "act_order" if q.get("desc_act") else "natural", "sym": q.get("sym")})
    if method == "compressed-tensors":
        fmt = q.get("format")
        weights = next(iter(q.get("config_groups", {}).values()), {}).get("weights", {})
        return checkpoint_kind(method, {"format": fmt, "symmetric": weights.get("symmetric", True)})
    return checkpoint_kind(method)


def gguf_options(method, options):
    """The options that make `method` write layers GGML holds exactly (group size 32, no act-order), or ValueError."""
    options = dict(options)
    if method in ("trellis", "entquant", "lattice"):
        raise ValueError(f"llama.cpp cannot load {method}: {ENGINE_ONLY}")
    if method == "fp8" or (method == "compressed-tensors" and options.get("format") == "float-quantized"):
        raise ValueError("llama.cpp: GGML has no FP8 type (write the HF layout for llama.cpp's converter, which "
                         "dequantizes it)")
    if method == "gptq" and gptq.permuted(options):
        raise ValueError("llama.cpp: GPTQ act-order permutes the input columns; GGML blocks store no permutation")
    if method == "gptq" and options.get("bpw") is not None:              # a K-quant mix that meets the budget
        options.setdefault("ggml_type", gptq_ggml.MIX)
    if method == "gptq" and gptq_ggml.on_grids(options):              # llama.cpp's own grids: gptq_ggml.rules
        return options
    if method == "bitsandbytes":
        raise ValueError("llama.cpp: GGML has no NF4 type (nf4 is bitsandbytes' layout, for transformers)")
    integer = method in ("gptq", "awq") or (method == "compressed-tensors" and
                                           options.get("format", "pack-quantized") == "pack-quantized")
    sym = options.get("sym", False) if method == "gptq" else options.get("symmetric", True)
    if integer and (options.get("bits", 4) not in (4, 8) or (options.get("bits", 4) == 8 and not sym)):
        raise ValueError(f"llama.cpp: GGML's blocks of 32 hold 4-bit codes (Q4_0, Q4_1) or symmetric 8-bit ones "
                         f"(Q8_0), not {options['bits']}-bit {'symmetric' if sym else 'asymmetric'} ones"
                         + (" (sym=true makes them symmetric)" if options["bits"] == 8 else ""))
    if integer:
        if options.setdefault("group_size", 32) != 32:
            raise ValueError(f"llama.cpp: GGML's Q4_0 / Q4_1 / Q8_0 blocks hold 32 weights, not group size "
                             f"{options['group_size']} (--group-size 32)")
    return options


def check_target(target, method, options, fmt="safetensors", moe=False):
    """The settings `target` loads, for `run.py quantize --method ... --target ...`: returns (options, fmt) with
    the target's defaults filled in (vLLM: symmetric GPTQ; llama.cpp: GGUF with group size 32). A combination the
    target refuses is a ValueError naming the reason; one refused only on a CPU, or loaded with a caveat, warns.
    moe: the model is a MoE one (transformers: MOE_TRANSFORMERS; vLLM: MOE_VLLM; llama.cpp:
    gguf_writer.check_writable)."""
    if target not in TARGETS:
        raise ValueError(f"--target must be one of {TARGETS}, got {target!r}")
    if target == "llama.cpp":
        return gguf_options(method, options), "gguf"
    if fmt == "gguf":
        raise ValueError(f"--format gguf is for llama.cpp; {target}: {LOADS['gguf'][target][1]}")
    if options.get("ggml_type") is not None:
        raise ValueError(f"ggml_type writes GGML blocks, which only llama.cpp loads (--target llama.cpp), not {target}")
    options = dict(options)
    if target == "vllm" and method in ("gptq", "awq") and options.get("group_size", DEFAULT_GROUP) not in VLLM_GROUPS:
        raise ValueError(f"vllm cannot load this checkpoint: its GPTQ / AWQ kernels take group sizes {VLLM_GROUPS} "
                         f"('Marlin does not support group_size = {options['group_size']}')")
    picked = target == "vllm" and method == "gptq" and "sym" not in options
    if picked:
        options["sym"] = True
    kind = checkpoint_kind(method, options)
    verdict, reason = LOADS[kind].get(target, ("loads", ""))
    if moe and target in ("transformers", "vllm"):
        verdict, reason = (MOE_TRANSFORMERS if target == "transformers" else MOE_VLLM).get(kind, (verdict, reason))
        reason = reason and f"(MoE) {reason}"
    if verdict == "refuses":
        raise ValueError(f"{target} cannot load this checkpoint: {reason}")
    if picked:
        warnings.warn("--target vllm: picked sym=true (vLLM's GPTQ path is symmetric only)")
    if reason and verdict != "converts":
        warnings.warn(f"{target}: {reason}")
    return options, fmt


def markdown_table():
    """The table of what loads where (appendix/serving.md), the reasons as numbered notes below it."""
    lines, notes = ["| checkpoint | " + " | ".join(TARGETS) + " |", "|---|" + "---|" * len(TARGETS)], []
    for kind, row in LOADS.items():
        cells = []
        for target in TARGETS:
            verdict, reason = row.get(target, ("not checked", ""))
            if reason and reason not in notes:
                notes.append(reason)
            cells.append(verdict + (f" ({notes.index(reason) + 1})" if reason else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + [f"{i}. {note}" for i, note in enumerate(notes, 1)])


# ---- loading and exporting --------------------------------------------------------------------------------------

def load_checkpoint(source, dtype=None):
    """An engine model from a checkpoint folder (dense or quantized) or a .gguf file."""
    source = Path(source)
    if source.is_file():
        return load_gguf(source, dtype or torch.float32)
    if "quantization_config" in read_config(source):
        return load_quantized(source, dtype=dtype)
    return load_dense(source, dtype)


def export_gguf(source, path, dense_type="F32", fallback=None, force=False, embedding_type=None):
    """`run.py export SOURCE --gguf PATH`: the checkpoint at `source` as a GGUF file, its quantized layers in their
    GGML types (gguf_writer), the tokenizer taken from the source (the byte model's when it has none), and the
    folder's calibration records (engine.calibration, engine.calibration_sha256) as metadata of the same names."""
    check_apart(source, path)
    records = {k: v for k, v in checkpoint_records(source).items() if k.startswith("engine.calibration")} \
        if Path(source).is_dir() else {}
    with output_lock(path):                     # from before the load: a second writer is refused at once
        model = load_checkpoint(source)
        return write_gguf(model, path, tokenizer=tokenizer_metadata(model.cfg, source), dense_type=dense_type,
                          fallback=fallback,
                          force=force, records=records, embedding_type=embedding_type)


# ---- tensor parallelism -----------------------------------------------------------------------------------------

def shard_units(quantization_config):
    """(column unit, row unit): each rank's output slice of a column-parallel layer, and input slice of a
    row-parallel one, must be a multiple of these (whole packed words, groups, blocks)."""
    q = quantization_config or {}
    method = q.get("quant_method")
    if method is None:
        return 1, 1
    if method == "gptq":                   # qweight packs inputs, qzeros outputs, 32 / bits per int32
        pack, group = 32 // q.get("bits", 4), q.get("group_size", 128)
        return pack, math.lcm(pack, group if group > 0 else 1)
    if method == "awq":                    # qweight and qzeros pack outputs; groups along inputs
        return 32 // q.get("bits", 4), q.get("group_size", 128)
    if method == "fp8":
        block_n, block_k = q.get("weight_block_size", [128, 128])
        return block_n, block_k
    if method == "compressed-tensors":
        weights = next(iter(q.get("config_groups", {}).values()), {}).get("weights", {})
        if weights.get("type") == "float" and weights.get("num_bits") == 8:
            block_n, block_k = weights.get("block_structure") or [1, 1]
            return block_n, block_k
        group = weights.get("group_size") or 1
        if weights.get("type") == "float":                       # nvfp4 / mxfp4: two codes per byte
            return 1, math.lcm(group, 2)
        pack = 32 // weights.get("num_bits", 4)
        return (1 if weights.get("symmetric", True) else pack), math.lcm(group, pack)
    raise ValueError(f"quant_method {method!r}: vLLM does not load it, so it has no tensor-parallel layout")


def tp_degrees(config, degrees=(1, 2, 4, 8)):
    """config.json dict (or a checkpoint folder) -> {degree: [reasons it cannot be sharded that way]}; an empty
    list means vLLM can run the checkpoint with --tensor-parallel-size degree."""
    if not isinstance(config, dict):
        config = read_config(config)
    cfg = Qwen3Config.from_hf(config)
    column_unit, row_unit = shard_units(config.get("quantization_config"))
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    result = {}
    for tp in degrees:
        reasons = []
        if heads % tp:
            reasons.append(f"{heads} attention heads do not split over {tp} ranks")
        if kv % tp and tp % kv:
            reasons.append(f"{kv} KV heads neither split over {tp} ranks nor replicate onto them")
        if cfg.intermediate_size % tp:
            reasons.append(f"intermediate size {cfg.intermediate_size} does not split over {tp} ranks")
        if not reasons:
            kv_rows = kv * hd // tp if kv >= tp else hd
            columns = {"q_proj": heads * hd // tp, "k_proj": kv_rows, "v_proj": kv_rows,
                       "gate_proj": cfg.intermediate_size // tp, "up_proj": cfg.intermediate_size // tp}
            if tp == 1:                    # unsplit, q/k/v and gate/up are still merged: the last part may be ragged
                del columns["v_proj"], columns["up_proj"]
            rows = {"o_proj": heads * hd // tp, "down_proj": cfg.intermediate_size // tp}
            reasons += [f"{name}: {n} outputs per rank, not a multiple of {column_unit}"
                        for name, n in columns.items() if n % column_unit]
            reasons += [f"{name}: {n} inputs per rank, not a multiple of {row_unit}"
                        for name, n in rows.items() if n % row_unit]
        result[tp] = reasons
    return result


def check_vllm_groups(config, method, options):
    """ValueError, before any work, where vLLM would refuse at every tensor-parallel degree the GPTQ or AWQ
    checkpoint `options` make of the model whose config.json is `config`: a group size that does not tile its layers
    (SmolLM2's 576 inputs in groups of 128), naming the group sizes vLLM takes that would load."""
    if method not in ("gptq", "awq"):
        return

    def refusals(group):
        q = {"quant_method": method, "bits": options.get("bits", 4), "group_size": group}
        return tp_degrees({**config, "quantization_config": q})[1]
    refused = refusals(options.get("group_size", DEFAULT_GROUP))
    if refused:
        fits = [str(g) for g in VLLM_GROUPS if not refusals(g)]
        raise ValueError(f"vllm would refuse this checkpoint at every tensor-parallel degree ({'; '.join(refused)}); "
                         + (f"--group-size {' or '.join(fits)} would load" if fits else
                            "no group size vLLM takes fits this model"))


def vllm_serve_command(directory, config=None):
    """The `vllm serve` line for a checkpoint, at the largest tensor-parallel degree it supports (or why it has
    none: its blocks or groups do not tile this model's merged layers)."""
    config = config or read_config(directory)
    degrees = tp_degrees(config)
    if all(degrees.values()):
        return f"none: vLLM would refuse {directory} ({'; '.join(degrees[1])})"
    degrees = [tp for tp, reasons in degrees.items() if not reasons]
    method = (config.get("quantization_config") or {}).get("quant_method")
    return (f"vllm serve {directory}" + (f" --quantization {method}" if method else "")
            + f" --tensor-parallel-size {max(degrees)}")
