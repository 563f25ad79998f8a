"""Quantized checkpoints, the chapter's loader and writer: one registry of methods, one streaming loader, one atomic
writer (the book's load_quantized, build, PARTS and save_quantized, for every method the engine has).

All the Hugging Face formats share a structure: config.json's `quantization_config` names the method
(`quant_method`), and each quantized linear's tensors sit under the linear's name (`...q_proj.qweight`,
`...q_proj.scales`, ...). Everything else (embeddings, norms, layers a method left dense) is stored as usual.

A method is a `CheckpointMethod` (engine/formats/method.py) defined in its own file; adding a format is that file plus
one line in `METHODS` below. The loader loop itself is engine/loaders.py's (the book's `assign` / `read_config`), the
files engine/safetensors_io.py's (`snapshot_tensors`, `save_file`). GGUF files and the layer-by-layer converter are
engine/checkpoints/'s: they build on this module.
"""
import dataclasses
import hashlib
import importlib
import json
import math
from collections.abc import Mapping, MutableMapping

import torch

from ..loaders import (check_complete, default_dtype, install_layer, load_tensors, model_digest, place, prepare,
                       read_config, skeleton, split_part)
from ..qwen3 import Qwen3Config
from ..safe_writes import atomic_directory, check_output
from ..safetensors_io import DTYPE_BYTES, checkpoint_records, nbytes, save_file, tensor_specs, write_json
from ..layers import QuantLinear, linear_names, quantized_linears


class Registry(MutableMapping):
    """{quant_method: CheckpointMethod}, each method's module imported when it is first asked for, so that reading a
    GPTQ file imports GPTQ's code and no other method's. {name: module}: the module's CHECKPOINT is the method (a
    method set by assignment, e.g. a test's wrapper, is kept as given).

    plain {name: (module, checkpoint_format)}: a method whose entry is extended from a room a reader can skip (GPTQ
    with llama.cpp's grids) names its plain module too; `file_method` reads and writes files with it alone unless
    their checkpoint_format is the one only the extension writes."""

    def __init__(self, modules, plain=None):
        self.modules, self.loaded, self.plain, self.assigned = dict(modules), {}, dict(plain or {}), set()

    def file_method(self, name, quantization_config):
        """The method that reads and writes a `name` file with this quantization_config."""
        if name in self.plain and name not in self.assigned:
            module, extended = self.plain[name]
            if quantization_config.get("checkpoint_format") != extended:
                return importlib.import_module(module).CHECKPOINT
        return self[name]

    def __getitem__(self, name):
        if name not in self.loaded:
            self.loaded[name] = importlib.import_module(self.modules[name]).CHECKPOINT
        return self.loaded[name]

    def __setitem__(self, name, method):
        self.modules.setdefault(name, None)
        self.loaded[name] = method
        self.assigned.add(name)

    def __delitem__(self, name):
        del self.modules[name]
        self.loaded.pop(name, None)
        self.assigned.discard(name)

    def __contains__(self, name):              # without importing the method's module
        return name in self.modules

    def __iter__(self):
        return iter(self.modules)

    def __len__(self):
        return len(self.modules)


# GPTQ's entry is GPTQ with llama.cpp's grids as well (llama_cpp/gptq_ggml.py extends gptq.py's CHECKPOINT), what
# the quantizers and the CLI use; a GPTQ file that is not checkpoint_format "ggml" is read and written by gptq.py
# alone. Adding a method is its file and one line here.
METHODS = Registry({"gptq": "engine.formats.llama_cpp.gptq_ggml", "awq": "engine.formats.awq",
                    "fp8": "engine.formats.fp8", "compressed-tensors": "engine.formats.compressed_tensors",
                    "trellis": "engine.formats.trellis", "entquant": "engine.formats.entropy",
                    "lattice": "engine.formats.lattice", "bitsandbytes": "engine.formats.nf4"},
                   plain={"gptq": ("engine.formats.gptq", "ggml")})

# Formats whose files are another method's layout: name -> (method, options fixed, {option: default} a user sets).
# `--method rtn` writes compressed-tensors pack-quantized (what llm-compressor writes and vLLM serves), mxfp4 / nvfp4
# its FP4 layouts, nf4 bitsandbytes' (what transformers reads).
ALIASES = {"rtn": ("compressed-tensors", {"format": "pack-quantized"},
                   {"bits": 4, "group_size": 64, "symmetric": False}),
           "mxfp4": ("compressed-tensors", {"format": "mxfp4-pack-quantized"}, {}),
           "nvfp4": ("compressed-tensors", {"format": "nvfp4-pack-quantized"}, {}),
           "nf4": ("bitsandbytes", {}, {"group_size": 64})}


def method_options(method):
    """{keyword: Option} a method (or alias) takes: its CheckpointMethod's declared options (an alias: the ones it
    leaves to the user, with its defaults)."""
    if method in ALIASES:
        target, _, defaults = ALIASES[method]
        return {k: dataclasses.replace(METHODS[target].options[k], default=v) for k, v in defaults.items()}
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted({*METHODS, *ALIASES})}")
    return dict(METHODS[method].options)


def resolve(method, options):
    """(registry method, options) for a method name or alias and the options a user gave: an alias's defaults and
    fixed options filled in (an alias's fixed options cannot be set). Not yet checked: METHODS[method].checked is the
    one check, made once every option is known."""
    accepted = method_options(method)                   # an unknown name is a ValueError
    if method not in ALIASES:
        return method, dict(options)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"method {method!r} takes no option {unknown[0]!r}; it takes {sorted(accepted)}")
    target, fixed, defaults = ALIASES[method]
    return target, {**defaults, **options, **fixed}


def config_digest(quantization_config):
    """SHA-256 of a quantization_config (canonical JSON): recorded by the writer, checked by the loader, so that an
    edited field that changes what the bits mean (checkpoint_format, seed, code, L, lattice, fmt ...) is refused."""
    return hashlib.sha256(json.dumps(quantization_config, sort_keys=True).encode()).hexdigest()


def method_for(quantization_config):
    if not isinstance(quantization_config, dict):
        raise ValueError("config.json has no quantization_config object: not a quantized checkpoint "
                         "(use engine.loaders.load_dense for dense checkpoints)")
    name = quantization_config.get("quant_method")
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unsupported quant_method {name!r}; this engine reads {sorted(METHODS)}")
    return METHODS.file_method(name, quantization_config)


def _validated(method, quantization_config):
    return method.validate(quantization_config) if method.validate else quantization_config


def _default_parts(method):
    """The tensors `method` stores per quantized linear in its default layout, or None where they depend on the
    configuration (compressed-tensors' format)."""
    config = {"quant_method": method.name}
    try:
        return tuple(method.parts(_validated(method, config)))
    except (ValueError, KeyError):
        try:
            return tuple(method.parts(config))
        except (ValueError, KeyError):
            return None


class _Parts(Mapping):
    """The book's PARTS, {method: the tensors it stores per quantized linear} in its default layout (for methods
    whose tensors depend on the configuration, compressed-tensors' formats, METHODS[name].parts(config) gives
    them), computed as METHODS imports each method."""

    def __getitem__(self, name):
        parts = _default_parts(METHODS[name])
        if parts is None:
            raise KeyError(name)
        return parts

    def __iter__(self):
        return (name for name in METHODS if _default_parts(METHODS[name]) is not None)

    def __len__(self):
        return sum(1 for _ in self)


PARTS = _Parts()


def build(method, parts, q, dtype=None):
    """The book's: one quantized linear from its checkpoint tensors. method: a quant_method name; parts {part: tensor}
    (+ "bias"); q: the quantization_config; dtype: the dtype the layer returns (None: the activations')."""
    entry = method_for({**q, "quant_method": method})
    layer = entry.read(parts, _validated(entry, q))
    if dtype is not None:
        layer.dtype = dtype
    return layer


class LayerAssembler:
    """The quantized format's part of the loader loop: it claims each tensor `{linear}.{part}` its method owns,
    and as soon as all of a linear's parts have arrived builds the layer (method.read) and puts it in place of the
    model's nn.Linear (or hands it to install(name, layer)), so the whole checkpoint is never held twice. A linear
    stored as a plain `weight` (one the method left unquantized) is not claimed and loads dense."""

    def __init__(self, model, method, quantization_config, device, install=None):
        self.model, self.method, self.quantization_config, self.device = model, method, quantization_config, device
        self.install = install or (lambda name, layer: install_layer(self.model, name, layer, self.device))
        self.linears = {name: model.get_submodule(name) for name in linear_names(model)}
        self.needed = set(method.parts(quantization_config))
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
            self._install(module, self.method.read(self.pending.pop(module), self.quantization_config))
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
        self.install(name, layer)
        self.built.add(name)


@torch.no_grad()
def load_quantized(directory, device="cpu", dtype=None, *, verify=True):
    """The book's loader: a Qwen3 (or Llama / Qwen2) from a quantized checkpoint folder, any method of METHODS. The
    dense loader's checks and loop (engine.loaders.prepare, load_tensors), with the method's LayerAssembler claiming
    the quantized linears' tensors; a quantized layer is built as soon as all of its parts have arrived. The
    quantization_config is validated once, before anything is allocated.

    dtype: the unquantized tensors' dtype (the book's default is bfloat16; here None keeps the dtype they are stored
    in, so a float32 checkpoint is not rounded); quantized layers keep their own codes and compute in float32.
    verify=False skips the per-tensor SHA-256 check of files the engine wrote."""
    raw = read_config(directory)
    method = method_for(raw.get("quantization_config"))
    recorded = checkpoint_records(directory).get("engine.quantization_config_sha256")
    if recorded is not None and recorded != config_digest(raw["quantization_config"]):
        raise ValueError(f"the quantization_config in {directory}/config.json is not the one its tensors were written "
                         "with (its digest differs): its fields change what the stored bits mean, so it is refused")
    quantization_config = method.validate(raw["quantization_config"]) if method.validate else raw["quantization_config"]
    raw, _, model, specs = prepare(directory, {*method.parts(quantization_config), "bias"})
    dtype = dtype or default_dtype(specs)
    assembler = LayerAssembler(model, method, quantization_config, device)
    loaded = load_tensors(model, directory, dtype, device, assembler.claim, verify)
    for name, value in assembler.dense_leftovers().items():
        place(model, name, value, dtype, device)
        loaded.add(name)
    check_complete(model, loaded, directory, assembler.built)
    model.quantization_config = raw["quantization_config"]
    if method.finish is not None:
        method.finish(model, quantization_config)
    return model.eval()


def checkpoint_tensors(module, method, quantization_config, prefix="", stored=None):
    """{checkpoint name: tensor} of a quantized model or decoder layer `module` (its names prefixed by `prefix`):
    each QuantLinear's parts (method.write with the validated quantization_config) and bias, every other
    parameter (norms, embeddings, linears left dense) as it is, or in the dtype `stored` {name: dtype} says it was
    read in. A tied lm_head is the embedding's parameter and is not written twice. The one builder of a checkpoint's
    tensors: save_quantized runs it on the model, the streaming converter on each decoder layer."""
    stored, tensors, quantized = stored or {}, {}, set()
    for name, layer in module.named_modules():
        if isinstance(layer, QuantLinear):
            quantized.add(name)
            for part, value in method.write(layer, quantization_config).items():
                tensors[f"{prefix}{name}.{part}"] = value
            if layer.bias is not None:
                tensors[f"{prefix}{name}.bias"] = layer.bias.detach().to(stored.get(f"{prefix}{name}.bias",
                                                                                    layer.bias.dtype))
    for name, p in module.named_parameters():              # each shared (tied) parameter once, by its first name
        if name.rpartition(".")[0] not in quantized:
            tensors[prefix + name] = p.detach().to(stored.get(prefix + name, p.dtype))
    return tensors


@torch.no_grad()
def save_quantized(model, directory, method, calibration_ids=None, group_size=None, act_order=None, *,
                   quantization_config=None, force=False, side_files=None, **options):
    """The book's writer: `model` as a `method` checkpoint (config.json + model.safetensors), atomically.

    The book's arguments: calibration_ids [batch, tokens] for the methods that need data; group_size (None: the
    book's 128 for gptq and awq, each other method's own default); act_order (GPTQ: True visits the columns by
    decreasing H_ii and stores a permuted g_idx; False or None the natural order, the book's default; the engine's
    other visits are the keyword order=). Other keywords go to the method's quantizer.
    A dense model is first quantized IN PLACE with the method's own quantizer; the digest of the dense model is
    recorded in the checkpoint (engine.loaders.model_digest), so an evaluation can tell which model it came from. A
    model that is already quantized (e.g. RTN or GPTQ layers written as compressed-tensors) is written as it is,
    with `quantization_config` or the one recorded when it was quantized.
    The save is atomic and refuses a folder that holds anything but an engine checkpoint unless force=True
    (engine.safe_writes.atomic_directory); side_files(folder), if given, adds the tokenizer files to it. Returns
    the quantization_config written.
    """
    if calibration_ids is not None and not (isinstance(calibration_ids, torch.Tensor) and calibration_ids.dim() == 2
                                            and not calibration_ids.dtype.is_floating_point):
        raise ValueError(f"calibration_ids (the 4th argument) must be token ids [batch, tokens] or None, got "
                         f"{type(calibration_ids).__name__}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise ValueError(f"group_size (the 5th argument) must be an int, got {group_size!r}")
        options["group_size"] = group_size
    if act_order is not None:
        if not isinstance(act_order, bool):
            raise ValueError(f"act_order (the 6th argument) is True or False, got {act_order!r}")
        if method != "gptq" and act_order:
            raise ValueError(f"act_order=True is GPTQ's; method {method!r} has no column order")
        if "order" in options and act_order:
            raise ValueError(f"act_order=True and order={options['order']!r} ask for two visits; give one")
        if method == "gptq":
            options.setdefault("order", "act_order" if act_order else "natural")
    layers = quantized_linears(model)
    if not layers:
        if method in METHODS:
            options = {**METHODS[method].book_defaults(options), **options}
        if "group_size" in options and "group_size" not in method_options(method):
            raise ValueError(f"method {method!r} takes no option 'group_size' (the book's group_size is GPTQ's and "
                             f"AWQ's); it takes {sorted(method_options(method))}")
        method, options = resolve(method, options)
        options = METHODS[method].checked(options)          # every option checked before any work
    elif method not in METHODS:
        raise ValueError(f"unknown method {method!r}; a quantized model is written as one of {sorted(METHODS)}")
    check_output(directory, force)                       # before minutes of quantization are spent
    if not layers:
        model.source_digest = model_digest(model)
        quantization_config = METHODS[method].quantize(model, calibration_ids, **options)
        layers = quantized_linears(model)
    elif options:
        raise ValueError(f"model is already quantized; options {sorted(options)} would be ignored")
    quantization_config = quantization_config or getattr(model, "quantization_config", None)
    if not quantization_config or quantization_config.get("quant_method") != method:
        raise ValueError(f"model is quantized but no {method} quantization_config was given")
    entry = METHODS.file_method(method, quantization_config)
    validated = entry.validate(quantization_config) if entry.validate else quantization_config
    tensors = checkpoint_tensors(model, entry, validated)
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
