"""What each of the chapter's sections asks a reader to build, in one place: `pytest tests/test_ch39_<section>.py
--yours FILE` grades FILE's definitions of these names (and only these), README's "--yours" table lists them.

For each section: the graded names, each with the engine module whose definition it takes the place of and the
chapter's signature (the tests call it as the chapter does), and the helpers its listings use without defining
them, with where a reader imports them from. A reader's own definitions of helpers (find_params, E4M3_MAX, ...)
serve the reader's own functions; they never replace what the engine's internals or the tests' baselines call.
"""
import inspect
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Section:
    graded: dict                    # name -> (engine module, the chapter's parameters)
    helpers: dict = field(default_factory=dict)     # name -> where the listings' helper comes from


SECTIONS = {
    "gptq": Section(
        {"gptq_quantize": ("engine.formats.gptq",
                           "weight, hessian, bits=4, group_size=128, act_order=False, damp=0.01, block=128"),
         "pack_gptq": ("engine.formats.gptq", "codes, scales, zeros, g_idx"),
         "unpack_gptq": ("engine.formats.gptq", "qweight, qzeros, scales, g_idx")},
        {"find_params": "engine.formats.numerics.affine; chapter 20's, one of yours takes (x, bits)",
         "as_int32": "in the listing"}),
    "awq": Section(
        {"search_scale": ("engine.formats.awq", "weights, inputs, bits=4, group_size=128, grid=20"),
         "apply_awq": ("engine.formats.awq", "model, calibration_ids, bits=4, group_size=128"),
         "pack_awq": ("engine.formats.awq", "codes, zeros"),
         "unpack_awq": ("engine.formats.awq", "packed"),
         "to_checkpoint": ("engine.formats.awq", "layer"),
         "from_checkpoint": ("engine.formats.awq",
                             "qweight, qzeros, scales, group_size, bias=None, dtype=torch.bfloat16")},
        {"fake_quantize, quantize_to_affine, pack_nibbles, AffineQuantLinear": "engine.formats.numerics.affine",
         "AWQ_ORDER": "in the listing: (0, 2, 4, 6, 1, 3, 5, 7)"}),
    "fp8": Section(
        {"quantize_blocks": ("engine.formats.fp8", "weight, block=128"),
         "dequantize_blocks": ("engine.formats.fp8", "weight, scale_inv, block=128"),
         "quantize_activations": ("engine.formats.fp8", "x, group=128"),
         "w8a8_reference": ("engine.formats.fp8", "x, weight, scale_inv, block=128"),
         "fp8_block_kernel": ("engine.kernels.triton_formats",
                              "x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, s_cols, BLOCK_M, BLOCK_N, BLOCK_K"),
         "fp8_block_matmul": ("engine.kernels.triton_formats",
                              "x, weight, scale_inv, block_m=16, block_n=32, block_k=32")},
        {"check_device": "engine.kernels", "E4M3_MAX": "448.0, engine.formats.numerics.minifloats",
         "F": "torch.nn.functional"}),
    "fp4": Section(
        {"quantize_mxfp4": ("engine.formats.mx", "w, layout='interleaved'"),
         "dequantize_mxfp4": ("engine.formats.mx", "blocks, scales, layout='interleaved'"),
         "quantize_nvfp4": ("engine.formats.mx", "w"),
         "dequantize_nvfp4": ("engine.formats.mx", "packed, block_scale, tensor_scale")},
        {"to_e2m1, E2M1": "engine.formats.numerics.minifloats; chapter 38's codes and their 16 values"}),
    "trellis": Section(
        {"code_1mad": ("engine.formats.trellis", "states"),
         "codebook": ("engine.formats.trellis", "L"),
         "viterbi_encode": ("engine.formats.trellis", "x, L=8, K=2"),
         "random_hadamard": ("engine.formats.numerics.hadamard", "n, seed=0"),
         "quantize_trellis": ("engine.formats.trellis", "weight, L=8, K=2, group=256, seed=0")}),
    "quantized_checkpoints": Section(
        {"load_quantized": ("engine.formats.quantized_checkpoints", "directory, device='cpu', dtype=torch.bfloat16"),
         "build": ("engine.formats.quantized_checkpoints", "method, parts, q, dtype"),
         "save_quantized": ("engine.formats.quantized_checkpoints",
                            "model, directory, method, calibration_ids=None, group_size=128, act_order=False")},
        {"assign, read_config": "engine.loaders; the listing's `from ..loaders`",
         "Qwen3, Qwen3Config": "engine.qwen3", "snapshot_tensors, save_file": "engine.safetensors_io",
         "gptq, awq, fp8": "engine.formats", "PARTS": "in the listing: {method: tensor names}"}),
}

GRADED = {name: (section, *where) for section, s in SECTIONS.items() for name, where in s.graded.items()}


def chapter_signature(name):
    """The chapter's parameters of graded `name`, as an inspect.Signature."""
    scope = {"torch": torch}
    exec(f"def {name}({GRADED[name][2]}): pass", scope)
    return inspect.signature(scope[name])


def signature_problem(name, obj):
    """Why obj cannot stand in for the chapter's `name` (None if it can): the chapter's parameters, in its order and
    with its names, each with a default where the chapter has one; any parameter after them needs a default too."""
    try:
        theirs = inspect.signature(getattr(obj, "fn", obj))      # a @triton.jit kernel wraps its function
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj):
        return None
    want = list(chapter_signature(name).parameters.values())
    have = [p for p in theirs.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra = have[len(want):]
    names_ok = [p.name for p in have[:len(want)]] == [p.name for p in want]
    defaults_ok = all(h.default is not h.empty for h, w in zip(have, want) if w.default is not w.empty)
    if names_ok and defaults_ok and all(p.default is not p.empty for p in extra):
        return None
    return (f"{name}{theirs} differs from the chapter's {name}{chapter_signature(name)}: the tests call it as the "
            "chapter does (same parameters in the same order, defaults where the chapter has them; any parameter "
            "you add needs a default)")


README_MARK = "<!-- the --yours list: tests/sections.py's readme_list(); test_ch39_yours.py checks it -->"


def readme_list():
    """README's list of what each section grades and where its helpers come from (wrapped at 116 characters)."""
    import textwrap
    lines = [README_MARK]
    for name, section in SECTIONS.items():
        helpers = "; ".join(f"`{h}` ({where})" for h, where in section.helpers.items())
        text = (f"- `tests/test_ch39_{name}.py` grades {', '.join(f'`{g}`' for g in section.graded)}"
                + (f"; helpers: {helpers}" if helpers else ""))
        lines += textwrap.wrap(text, 116, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines)
