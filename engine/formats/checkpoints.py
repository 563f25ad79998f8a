"""Quantized checkpoints: one registry of methods, one streaming loader, one atomic writer.

All the Hugging Face formats share a structure: config.json's `quantization_config` names the method
(`quant_method`), and each quantized linear's tensors sit under the linear's name (`...q_proj.qweight`,
`...q_proj.scales`, ...). Everything else (embeddings, norms, layers a method left dense) is stored as usual.

A method is a `CheckpointMethod` (engine.formats.base) defined in its own file; adding a format is that file plus one
line in `METHODS` below.
"""
import json

import torch

from ..loaders import assign, empty_model, read_config
from ..qwen3 import Qwen3Config
from ..safetensors_io import atomic_directory, save_file, snapshot_tensors
from . import awq, compressed_tensors, entropy, fp8, gptq, lattice, trellis
from .base import QuantLinear, linear_names, quantized_linears

METHODS = {m.name: m for m in (gptq.CHECKPOINT, awq.CHECKPOINT, fp8.CHECKPOINT, compressed_tensors.CHECKPOINT,
                               trellis.CHECKPOINT, entropy.CHECKPOINT, lattice.CHECKPOINT)}


def method_for(quantization_config):
    if not isinstance(quantization_config, dict):
        raise ValueError("config.json has no quantization_config object: not a quantized checkpoint "
                         "(use engine.loaders.load_dense for dense checkpoints)")
    name = quantization_config.get("quant_method")
    if name not in METHODS:
        raise ValueError(f"unsupported quant_method {name!r}; this engine reads {sorted(METHODS)}")
    return METHODS[name]


@torch.no_grad()
def load_quantized(directory, dtype=torch.float32, device="cpu"):
    """A Qwen3 from a quantized checkpoint folder.

    Tensors are streamed; a quantized layer is built as soon as all of its parts have arrived and put in place of
    the model's nn.Linear, so the whole checkpoint is never held twice. A linear whose tensors are a plain `weight`
    (a layer the method left unquantized) is loaded dense.
    """
    raw = read_config(directory)
    qcfg = raw.get("quantization_config")
    method = method_for(qcfg)
    cfg = Qwen3Config.from_hf(raw)
    model = empty_model(cfg, dtype, device)
    params = dict(model.named_parameters())
    linears = {name: model.get_submodule(name) for name in linear_names(model)}
    needed = set(method.parts(qcfg))
    pending, built, loaded = {}, set(), set()
    for name, value in snapshot_tensors(directory):
        module, _, part = name.rpartition(".")
        if module in linears and (part in needed or (part == "bias" and linears[module].bias is not None)):
            parts = pending.setdefault(module, {})
            parts[part] = value
            want = needed | ({"bias"} if linears[module].bias is not None else set())
            if want <= parts.keys():
                _install(model, module, linears[module], method.read(pending.pop(module), qcfg), device)
                built.add(module)
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name} in {directory} (method {method.name})")
        assign(params[name], value, name)
        loaded.add(name)
    for module, parts in list(pending.items()):
        weight = parts.get("weight")
        dense = weight is None or (weight.dtype.is_floating_point and weight.element_size() > 1)
        if dense and not set(parts) & (needed - {"weight"}):     # a linear the method left unquantized
            for part, value in parts.items():
                assign(params[f"{module}.{part}"], value, f"{module}.{part}")
                loaded.add(f"{module}.{part}")
            del pending[module]
    if pending:
        module, parts = next(iter(pending.items()))
        raise ValueError(f"incomplete quantized layer(s) {sorted(pending)[:3]}: {module} has {sorted(parts)}, "
                         f"method {method.name} needs {sorted(needed)}")
    dense_needed = {n for n in params if n.rpartition(".")[0] not in built}
    dense_needed -= {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(dense_needed - loaded)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensor(s) {missing[:5]}")
    model.quantization_config = qcfg
    if method.finish is not None:
        method.finish(model, qcfg)
    return model.eval()


def _install(model, name, linear, layer, device):
    if not isinstance(layer, QuantLinear):
        raise TypeError(f"reader returned {type(layer).__name__} for {name}, expected a QuantLinear")
    if (layer.in_features, layer.out_features) != (linear.in_features, linear.out_features):
        raise ValueError(f"{name}: checkpoint layer is {layer.out_features} x {layer.in_features}, the config says "
                         f"{linear.out_features} x {linear.in_features}")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer.to(device))


@torch.no_grad()
def save_quantized(model, directory, method, calibration_ids=None, quantization_config=None, **options):
    """Write `model` as a `method` checkpoint (config.json + model.safetensors), atomically.

    A dense model is first quantized IN PLACE with the method's own quantizer (options such as group_size,
    act_order go to it; calibration_ids [batch, tokens] for methods that need data). A model that is already
    quantized (e.g. RTN or GPTQ layers written as compressed-tensors) is written as it is, with
    `quantization_config` or the one recorded when it was quantized.
    Returns the quantization_config written.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    entry = METHODS[method]
    layers = quantized_linears(model)
    if not layers:
        quantization_config = entry.quantize(model, calibration_ids, **options)
        layers = quantized_linears(model)
    elif options:
        raise ValueError(f"model is already quantized; options {sorted(options)} would be ignored")
    quantization_config = quantization_config or getattr(model, "quantization_config", None)
    if not quantization_config or quantization_config.get("quant_method") != method:
        raise ValueError(f"model is quantized but no {method} quantization_config was given")
    tensors = {}
    for name, layer in layers.items():
        for part, value in entry.write(layer, quantization_config).items():
            tensors[f"{name}.{part}"] = value
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach()
    for name, p in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in layers or (name == "lm_head.weight" and model.cfg.tie_word_embeddings):
            continue
        tensors[name] = p.detach()
    raw = model.cfg.to_hf()
    raw["quantization_config"] = quantization_config
    model.quantization_config = quantization_config
    with atomic_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    return quantization_config
