"""Quantized checkpoints: one registry of methods, one streaming loader, one atomic writer.

All the Hugging Face formats share a structure: config.json's `quantization_config` names the method
(`quant_method`), and each quantized linear's tensors sit under the linear's name (`...q_proj.qweight`,
`...q_proj.scales`, ...). Everything else (embeddings, norms, layers a method left dense) is stored as usual.

A method is a `CheckpointMethod` (engine.formats.base) defined in its own file; adding a format is that file plus one
line in `METHODS` below.
"""
import hashlib
import inspect
import json
import math
from pathlib import Path

import torch

from ..formats import awq, entropy, fp8, gptq, lattice, nf4, trellis
from ..formats.base import QuantLinear, linear_names, quantized_linears
from . import compressed_tensors, gguf
from ..qwen3 import Qwen3Config
from .loaders import (check_complete, default_dtype, install_layer, load_dense, load_tensors, model_digest, place,
                       prepare, read_config, skeleton, split_part)
from .safe_writes import atomic_directory, check_output
from .safetensors_io import DTYPE_BYTES, checkpoint_records, nbytes, save_file, tensor_specs, write_json

METHODS = {m.name: m for m in (gptq.CHECKPOINT, awq.CHECKPOINT, fp8.CHECKPOINT, compressed_tensors.CHECKPOINT,
                               trellis.CHECKPOINT, entropy.CHECKPOINT, lattice.CHECKPOINT, nf4.CHECKPOINT)}

# Formats whose files are another method's layout: name -> (method, options fixed, {option: default} a user sets).
# `--method rtn` writes compressed-tensors pack-quantized (what llm-compressor writes and vLLM serves), mxfp4 / nvfp4
# its FP4 layouts, nf4 bitsandbytes' (what transformers reads).
ALIASES = {"rtn": ("compressed-tensors", {"format": "pack-quantized"},
                   {"bits": 4, "group_size": 64, "symmetric": False}),
           "mxfp4": ("compressed-tensors", {"format": "mxfp4-pack-quantized"}, {}),
           "nvfp4": ("compressed-tensors", {"format": "nvfp4-pack-quantized"}, {}),
           "nf4": ("bitsandbytes", {}, {"group_size": 64})}


def method_options(method):
    """{keyword: default} a method (or alias) takes: those of its quantize_layer (or quantize) but the calibration."""
    if method in ALIASES:
        return dict(ALIASES[method][2])
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted({*METHODS, *ALIASES})}")
    entry = METHODS[method]
    params = list(inspect.signature(entry.quantize_layer or entry.quantize).parameters.values())[1:]
    return {p.name: p.default for p in params if p.name != "calibration_ids" and p.kind is p.POSITIONAL_OR_KEYWORD}


def resolve(method, options):
    """(registry method, its options) for a method name or alias and the options a user gave."""
    if method not in ALIASES:
        method_options(method)                          # an unknown name is a ValueError
        return method, dict(options)
    target, fixed, defaults = ALIASES[method]
    return target, {**defaults, **options, **fixed}


def config_digest(quantization_config):
    """SHA-256 of a quantization_config (canonical JSON): recorded by the writer, checked by the loader, so that an
    edited field that changes what the bits mean (checkpoint_format, seed, code, L, lattice, fmt ...) is refused."""
    return hashlib.sha256(json.dumps(quantization_config, sort_keys=True).encode()).hexdigest()


def method_for(quantization_config):
    if not isinstance(quantization_config, dict):
        raise ValueError("config.json has no quantization_config object: not a quantized checkpoint "
                         "(use engine.checkpoints.loaders.load_dense for dense checkpoints)")
    name = quantization_config.get("quant_method")
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unsupported quant_method {name!r}; this engine reads {sorted(METHODS)}")
    return METHODS[name]


class LayerAssembler:
    """The quantized format's part of the loader loop: it claims each tensor `{linear}.{part}` its method owns,
    and as soon as all of a linear's parts have arrived builds the layer (method.read) and puts it in place of the
    model's nn.Linear, so the whole checkpoint is never held twice. A linear stored as a plain `weight` (one the
    method left unquantized) is not claimed and loads dense."""

    def __init__(self, model, method, qcfg, device):
        self.model, self.method, self.qcfg, self.device = model, method, qcfg, device
        self.linears = {name: model.get_submodule(name) for name in linear_names(model)}
        self.needed = set(method.parts(qcfg))
        self.pending, self.built = {}, set()

    def claim(self, name, value):
        module, part = split_part(name, self.linears)
        linear = self.linears.get(module)
        if linear is None or module in self.built:
            return False
        want = self.needed | ({"bias"} if linear.bias is not None else set())
        if part not in want:
            return False
        parts = self.pending.setdefault(module, {})
        parts[part] = value
        if want <= parts.keys():
            self._install(module, self.method.read(self.pending.pop(module), self.qcfg))
        return True

    @staticmethod
    def _quantized(value):
        return not (value.dtype.is_floating_point and value.element_size() > 1)

    def dense_leftovers(self):
        """{name: tensor} of linears that arrived as a plain float weight (and bias): layers left unquantized."""
        dense = {}
        for module, parts in list(self.pending.items()):
            weight = parts.get("weight")
            if (weight is None or not self._quantized(weight)) and not set(parts) & (self.needed - {"weight"}):
                dense.update({f"{module}.{part}": value for part, value in parts.items()})
                del self.pending[module]
        if self.pending:
            module, parts = next(iter(self.pending.items()))
            raise ValueError(f"incomplete quantized layer(s) {sorted(self.pending)[:3]}: {module} has "
                             f"{sorted(parts)}, method {self.method.name} needs {sorted(self.needed)}")
        return dense

    def _install(self, name, layer):
        install_layer(self.model, name, layer, self.device)
        self.built.add(name)


@torch.no_grad()
def load_quantized(directory, dtype=None, device="cpu", verify=True):
    """A Qwen3 from a quantized checkpoint folder: the dense loader's checks and loop (engine.checkpoints.loaders.prepare,
    load_tensors), with the method's LayerAssembler claiming the quantized linears' tensors. The
    quantization_config is validated once, before anything is allocated. Unquantized tensors keep their stored
    dtype (or `dtype`); quantized layers keep their own."""
    raw = read_config(directory)
    method = method_for(raw.get("quantization_config"))
    recorded = checkpoint_records(directory).get("engine.quantization_config_sha256")
    if recorded is not None and recorded != config_digest(raw["quantization_config"]):
        raise ValueError(f"the quantization_config in {directory}/config.json is not the one its tensors were written "
                         "with (its digest differs): its fields change what the stored bits mean, so it is refused")
    qcfg = method.validate(raw["quantization_config"]) if method.validate else raw["quantization_config"]
    raw, _, model, specs = prepare(directory, {*method.parts(qcfg), "bias"})
    dtype = dtype or default_dtype(specs)
    assembler = LayerAssembler(model, method, qcfg, device)
    loaded = load_tensors(model, directory, dtype, device, assembler.claim, verify)
    for name, value in assembler.dense_leftovers().items():
        place(model, name, value, dtype, device)
        loaded.add(name)
    check_complete(model, loaded, directory, assembler.built)
    model.quantization_config = raw["quantization_config"]
    if method.finish is not None:
        method.finish(model, qcfg)
    return model.eval()


def checkpoint_tensors(module, method, spec, prefix="", stored=None):
    """{checkpoint name: tensor} of a quantized model or decoder layer `module` (its names prefixed by `prefix`):
    each QuantLinear's parts (method.write with the validated quantization_config `spec`) and bias, every other
    parameter (norms, embeddings, linears left dense) as it is, or in the dtype `stored` {name: dtype} says it was
    read in. A tied lm_head is the embedding's parameter and is not written twice. The one builder of a checkpoint's
    tensors: save_quantized runs it on the model, the streaming converter on each decoder layer."""
    stored, tensors, quantized = stored or {}, {}, set()
    for name, layer in module.named_modules():
        if isinstance(layer, QuantLinear):
            quantized.add(name)
            for part, value in method.write(layer, spec).items():
                tensors[f"{prefix}{name}.{part}"] = value
            if layer.bias is not None:
                tensors[f"{prefix}{name}.bias"] = layer.bias.detach().to(stored.get(f"{prefix}{name}.bias",
                                                                                    layer.bias.dtype))
    for name, p in module.named_parameters():              # each shared (tied) parameter once, by its first name
        if name.rpartition(".")[0] not in quantized:
            tensors[prefix + name] = p.detach().to(stored.get(prefix + name, p.dtype))
    return tensors


@torch.no_grad()
def save_quantized(model, directory, method, calibration_ids=None, quantization_config=None, force=False,
                   side_files=None, **options):
    """Write `model` as a `method` checkpoint (config.json + model.safetensors), atomically.

    A dense model is first quantized IN PLACE with the method's own quantizer (options such as group_size,
    act_order go to it; calibration_ids [batch, tokens] for methods that need data); the digest of the dense model
    is recorded in the checkpoint (engine.checkpoints.loaders.model_digest), so an evaluation can tell which model it came from. A model that is already
    quantized (e.g. RTN or GPTQ layers written as compressed-tensors) is written as it is, with
    `quantization_config` or the one recorded when it was quantized.
    The save is atomic and refuses a folder that holds anything but an engine checkpoint unless force=True
    (engine.checkpoints.safe_writes.atomic_directory); side_files(folder), if given, adds the tokenizer files to it. Returns
    the quantization_config written.
    """
    method, options = resolve(method, options) if not quantized_linears(model) else (method, options)
    entry = METHODS[method]
    check_output(directory, force)                       # before minutes of quantization are spent
    layers = quantized_linears(model)
    if not layers:
        model.source_digest = model_digest(model)
        quantization_config = entry.quantize(model, calibration_ids, **options)
        layers = quantized_linears(model)
    elif options:
        raise ValueError(f"model is already quantized; options {sorted(options)} would be ignored")
    quantization_config = quantization_config or getattr(model, "quantization_config", None)
    if not quantization_config or quantization_config.get("quant_method") != method:
        raise ValueError(f"model is quantized but no {method} quantization_config was given")
    spec = entry.validate(quantization_config) if entry.validate else quantization_config
    tensors = checkpoint_tensors(model, entry, spec)
    raw = model.cfg.to_hf()
    raw["quantization_config"] = quantization_config
    model.quantization_config = quantization_config
    with atomic_directory(directory, force, needed=nbytes(tensors)) as tmp:
        write_json(tmp / "config.json", raw)
        meta = {"engine.quantization_config_sha256": config_digest(quantization_config)}
        source = getattr(model, "source_digest", None)
        save_file(tensors, tmp / "model.safetensors", {**meta, "engine.source_sha256": source} if source else meta)
        if side_files is not None:
            side_files(tmp)
    return quantization_config


def checkpoint_bits(directory):
    """Bits per weight of a quantized checkpoint's quantized linears, from its headers alone: every stored byte of
    their parts (codes, scales, zero points, streams; biases and linears left dense excluded) over their weights.
    None for a dense checkpoint."""
    raw = read_config(directory)
    if not isinstance(raw.get("quantization_config"), dict):
        return None
    model = skeleton(Qwen3Config.from_hf(raw))
    linears = {name: model.get_submodule(name) for name in linear_names(model)}
    stored, owners = 0, set()
    for name, (dtype, shape) in tensor_specs(directory).items():
        module, part = split_part(name, linears)
        if module in linears and part != "bias" and not (part == "weight" and dtype in ("F32", "F16", "BF16")):
            stored += DTYPE_BYTES[dtype] * math.prod(shape)
            owners.add(module)
    weights = sum(linears[m].in_features * linears[m].out_features for m in owners)
    return 8 * stored / weights if weights else None


def load_model(path, dtype=None, device="cpu", dense=False, progress=None):
    """Any model the engine reads: a .gguf file (gguf.py), a quantized checkpoint folder (config.json with a
    quantization_config) or a dense one. dense=True turns every quantized layer into an nn.Linear holding its
    dequantized weight (float32): the reference a GGUF model's own quantization defines. progress(iterable, total),
    e.g. tqdm, wraps a GGUF file's tensors as they load."""
    path = Path(path)
    if path.suffix == ".gguf":
        model = gguf.load_gguf(path, dtype or torch.float32, device, progress)
    elif isinstance(read_config(path).get("quantization_config"), dict):
        model = load_quantized(path, dtype, device)
    else:
        model = load_dense(path, dtype, device)
    if dense:
        for name, layer in quantized_linears(model).items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _dense_linear(layer))
    return model


def _dense_linear(layer):
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(layer.dequantize())
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear
