"""Chapter 39's loader and writer, typed as a reader would (`pytest tests/test_ch39_quantized_checkpoints.py --yours
tests/book/quantized_checkpoints.py`). The listings' relative imports (`from ..loaders import ...`) work as printed:
--yours imports a FILE as if it sat in engine/formats/ beside the chapter's module (a file run on its own writes
`from engine.loaders import ...`)."""
import json
from pathlib import Path

import torch

from engine.formats import awq, fp8, gptq

PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
         "fp8": ("weight", "weight_scale_inv")}


@torch.no_grad()
def load_quantized(directory, device="cpu", dtype=torch.bfloat16):
    from ..loaders import assign, read_config
    from ..qwen3 import Qwen3, Qwen3Config
    from ..safetensors_io import snapshot_tensors
    raw = read_config(directory)
    q = raw.get("quantization_config") or {}
    method = q.get("quant_method")
    if method not in PARTS:
        raise ValueError(f"Unsupported quant_method {method!r} (gptq, awq or fp8)")
    cfg = Qwen3Config.from_hf(raw)
    with torch.device("meta"):
        model = Qwen3(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    pending = {}
    for name, value in snapshot_tensors(directory):
        module, _, part = name.rpartition(".")
        if module in linears and (part in PARTS[method] or part == "bias"):
            pending.setdefault(module, {})[part] = value
            if all(p in pending[module] for p in PARTS[method]):
                parts = pending.pop(module)
                layer = build(method, parts, q, dtype)
                parent, _, child = module.rpartition(".")
                setattr(model.get_submodule(parent), child, layer.to(device))
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in params:
            raise ValueError(f"Unexpected tensor {name}")
        assign(params[name], value, name)
    if pending:
        raise ValueError(f"Incomplete quantized layers: {sorted(pending)[:3]}")
    return model.eval()


def build(method, parts, q, dtype):
    bias = parts.get("bias")
    if method == "gptq":
        if q.get("bits", 4) != 4:
            raise ValueError("Only 4-bit GPTQ is implemented")
        codes, scales, zeros, g_idx = gptq.unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"])
        return gptq.to_runtime(codes, scales, zeros, g_idx, q["group_size"], bias, dtype)
    if method == "awq":
        return awq.from_checkpoint(parts["qweight"], parts["qzeros"], parts["scales"], q["group_size"], bias, dtype)
    if q.get("weight_block_size", [128, 128]) != [128, 128]:
        raise ValueError("Only 128 x 128 FP8 blocks are implemented")
    return fp8.FP8BlockLinear(parts["weight"], parts["weight_scale_inv"], bias, dtype)


@torch.no_grad()
def save_quantized(model, directory, method, calibration_ids=None, group_size=128, act_order=False):
    from ..safetensors_io import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = {k: v for k, v in vars(model.cfg).items()}
    raw["model_type"] = "qwen3"
    tensors = {}
    inputs = {}
    if method == "gptq":
        handles = [m.register_forward_hook(lambda mod, a, o, n=n: inputs.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
                   for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        model(calibration_ids)
        for h in handles:
            h.remove()
    if method == "awq":
        replaced = awq.apply_awq(model, calibration_ids, 4, group_size)
    for name, module in model.named_modules():
        if name == "lm_head" or not isinstance(module, (torch.nn.Linear, awq.AffineQuantLinear)):
            continue
        if method == "gptq":
            H = gptq.hessian_from(torch.cat(inputs[name]))
            codes, scales, zeros, g_idx = gptq.gptq_quantize(module.weight, H, 4, group_size, act_order)
            tensors.update({f"{name}.{k}": v for k, v in gptq.pack_gptq(codes, scales, zeros, g_idx).items()})
        elif method == "awq":
            tensors.update({f"{name}.{k}": v for k, v in awq.to_checkpoint(replaced[name]).items()})
        else:
            weight, scale_inv = fp8.quantize_blocks(module.weight)
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = weight, scale_inv
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if module == "lm_head" and model.cfg.tie_word_embeddings:
            continue
        if not any(key.startswith(module + ".") for key in tensors) or module in ("lm_head", ""):
            tensors.setdefault(name, p.detach().contiguous())
    raw["quantization_config"] = ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
                                  if method == "fp8" else
                                  {"quant_method": method, "bits": 4, "group_size": group_size, "desc_act": act_order,
                                   "sym": False, **({"version": "gemm", "zero_point": True} if method == "awq" else {})})
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(tensors, directory / "model.safetensors")
