"""Dense checkpoints in the Hugging Face layout: config.json + model.safetensors (or shards).

Loading checks before it allocates: config.json is read (bounded, a regular file), the safetensors headers give every
tensor's name, dtype and shape, the config's layer count must equal the layers the tensors hold, and the model is
built on the meta device (no memory, no random init) so that every stored shape can be compared with the model's
before a byte of weights is read. Then `load_tensors`, the one loader loop (the quantized loader runs it too), streams
the tensors in one at a time, each placed where the meta tensor was: anything missing, unexpected or mis-shaped is a
ValueError naming the tensor. Weights keep their stored dtype unless a dtype is asked for.

`save_dense` writes what transformers' {Llama,Qwen2,Qwen3,Qwen3Moe}ForCausalLM.from_pretrained reads.

Qwen3-MoE's experts are read in either layout found in the wild: one tensor per expert linear
(`mlp.experts.E.gate_proj.weight` [I, hidden], what transformers 5's save_pretrained writes and the engine's model
holds), or transformers 5's fused in-memory layout, `mlp.experts.gate_up_proj` [E, 2I, hidden] (gate's rows, then
up's) and `mlp.experts.down_proj` [E, hidden, I], split into the first as it is read (`unfused`).
"""
import hashlib
import re

import torch
from torch import nn

from .layers import linear_names
from .qwen3 import Qwen3, Qwen3Config
from .safe_writes import atomic_directory, recover_interrupted_swap
from .safetensors_io import (checkpoint_records, float_digest, nbytes, read_json, save_file, snapshot_tensors,
                             tensor_specs, write_json)

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_config(directory):
    """config.json as a dict; ValueError if it is missing, not a regular file, too large or not a JSON object."""
    recover_interrupted_swap(directory)
    return read_json(directory, "config.json")


INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_")


def skeleton(cfg):
    """The model on the meta device: every parameter's shape, no memory, no initialisation (the init functions are
    skipped while it is built: on meta tensors they compute nothing, but the first call imports torch's compiler,
    seconds of a model load)."""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    try:
        for name in INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return Qwen3(cfg)
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def check_layer_count(cfg, specs, directory):
    """The config must describe exactly the decoder layers whose tensors the checkpoint holds (checked before a
    model of num_hidden_layers layers is built)."""
    held = {int(m.group(1)) for name in specs if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if held != set(range(cfg.num_hidden_layers)):
        extra = sorted(held - set(range(cfg.num_hidden_layers)))[:3]
        missing = sorted(set(range(cfg.num_hidden_layers)) - held)[:3]
        raise ValueError(f"{directory}: config.json says num_hidden_layers={cfg.num_hidden_layers} but the tensors "
                         f"hold layers {sorted(held)[:3]}{'...' if len(held) > 3 else ''} ({len(held)} in all"
                         f"{f'; missing {missing}' if missing else ''}{f'; unexpected {extra}' if extra else ''})")


FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def expert_parts(name, shape):
    """[(per-expert weight name, expert, row slice)] that the fused expert tensor `name` of `shape` holds; None for
    any other tensor."""
    fused = FUSED_EXPERTS.fullmatch(name)
    if fused is None:
        return None
    if len(shape) != 3 or (fused[2] == "gate_up_proj" and shape[1] % 2):
        raise ValueError(f"{name}: a fused expert tensor must be [experts, {'2 x ' * (fused[2] == 'gate_up_proj')}"
                         f"rows, columns], got shape {tuple(shape)}")
    half = shape[1] // 2
    rows = ({"gate_proj": slice(0, half), "up_proj": slice(half, None)} if fused[2] == "gate_up_proj"
            else {"down_proj": slice(None)})
    return [(f"{fused[1]}.{e}.{linear}.weight", e, r) for e in range(shape[0]) for linear, r in rows.items()]


def unfused_specs(specs):
    """{name: (dtype, shape)} with each fused expert tensor replaced by the per-expert weights it holds."""
    out = {}
    for name, (dtype, shape) in specs.items():
        parts = expert_parts(name, shape)
        for part, _, rows in parts or ():
            if part in specs:
                raise ValueError(f"{part} is stored twice: on its own and inside the fused {name}")
            out[part] = (dtype, (len(range(shape[1])[rows]), shape[2]))
        if parts is None:
            out[name] = (dtype, shape)
    return out


def unfused(tensors):
    """(name, tensor) pairs with each fused expert tensor split into its per-expert weights (copies: no two
    parameters share a storage)."""
    for name, value in tensors:
        parts = expert_parts(name, value.shape)
        if parts is None:
            yield name, value
        for part, e, rows in parts or ():
            yield part, value[e, rows].clone()


def check_experts(model, specs, directory):
    """Every sparse layer's router and each expert's linears (a shared expert's and its gate too) must be stored
    (any tensor of a linear counts: a quantized format stores its parts), checked from the headers before a byte is
    read."""
    linears = set(linear_names(model))
    needed = {n for n in linears if ".mlp.experts." in n or ".mlp.shared_expert." in n} | {
        n.removesuffix(".weight") for n, _ in model.named_parameters()
        if n.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))}
    if not needed:
        return
    missing = sorted(needed - {split_part(name, linears)[0] for name in specs})
    if missing:
        raise ValueError(f"{directory}: the experts' tensors of {len(missing)} linear(s) or router(s) are missing, "
                         f"e.g. {missing[:3]} (config.json says num_experts={model.cfg.num_experts})")


def split_part(name, linears):
    """'model.layers.0.mlp.up_proj.weight.absmax' -> ('model.layers.0.mlp.up_proj', 'weight.absmax'): the linear
    (a name in `linears`) a tensor belongs to and its part, which may itself hold dots (bitsandbytes' do); (name
    without its last part, that part) when no linear owns it."""
    module, part = name, ""
    while "." in module:
        module, _, tail = module.rpartition(".")
        part = f"{tail}.{part}" if part else tail
        if module in linears:
            return module, part
    return name.rpartition(".")[0], name.rpartition(".")[2]


def check_shapes(model, specs, directory, parts=()):
    """From the headers alone, before a byte of weights is read: every stored tensor is one of the model's
    parameters, with that parameter's shape, or one of `parts` (the tensors a quantized format stores under a
    linear's name, e.g. "qweight", "weight.absmax"; its reader checks their shapes). Anything else, say a tensor
    the model does not have declared a terabyte long, is refused here rather than read and then refused."""
    params = dict(model.named_parameters())
    linears = set(linear_names(model))
    for name, (dtype, shape) in specs.items():
        module, part = split_part(name, linears)
        owned = module in linears and part in parts
        packed = owned and not dtype.startswith(("F", "BF"))      # e.g. bitsandbytes' uint8 `weight`: its own shape
        if name in params and not packed:
            if tuple(params[name].shape) != shape:
                raise ValueError(f"{name}: checkpoint shape {shape} != model shape {tuple(params[name].shape)} "
                                 f"(config.json of {directory})")
        elif not owned and not (name == "lm_head.weight" and model.cfg.tie_word_embeddings):   # tied: stored anyway
            raise ValueError(f"unexpected tensor {name} ({dtype} {list(shape)}) in {directory}: this "
                             f"{model.cfg.model_type} model has no such parameter")


def default_dtype(specs):
    """The dtype a model loads in when none is asked for: that of its embedding table as stored."""
    dtype = specs.get("model.embed_tokens.weight", ("F32", ()))[0]
    return TORCH_DTYPES.get(dtype, torch.float32)


def prepare(directory, parts=()):
    """(config dict, Qwen3Config, meta skeleton, {name: (dtype, shape)}): everything checked that can be checked
    from config.json and the headers alone (parts: what a quantized format stores per linear, see check_shapes)."""
    raw = read_config(directory)
    cfg = Qwen3Config.from_hf(raw)
    specs = unfused_specs(tensor_specs(directory))
    check_layer_count(cfg, specs, directory)
    model = skeleton(cfg)
    check_shapes(model, specs, directory, parts)
    check_experts(model, specs, directory)
    return raw, cfg, model, specs


def _check_value(name, value, param):
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
    if not value.dtype.is_floating_point or value.element_size() < 2:
        raise ValueError(f"{name}: checkpoint dtype {value.dtype} cannot fill a floating-point parameter")
    if not all_finite(value):
        raise ValueError(f"{name}: checkpoint tensor holds NaN or infinite values")


def all_finite(value, chunk=1 << 22):
    """Whether every value is finite, checked a chunk at a time: torch.isfinite of a whole tensor makes a copy and
    masks of its size (a 30B's bf16 embedding, 0.6 GB, took 2.2 GB for an instant)."""
    flat = value.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[start:start + chunk]).all()) for start in range(0, flat.numel(), chunk))


@torch.no_grad()
def assign(param, value, name):
    """The book's: copy a checkpoint tensor into an allocated parameter, in place, in the parameter's dtype. The
    same checks as place: the model's shape, a floating-point tensor, finite values (ValueError naming `name`)."""
    _check_value(name, value, param)
    param.copy_(value.to(param.dtype))


def place(model, name, value, dtype, device):
    """Put a checkpoint tensor where the model's (meta) parameter `name` is, as a new parameter cast to dtype (the
    engine's loop builds the model on the meta device, so nothing is allocated twice); checked as assign."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr)
    _check_value(name, value, param)
    setattr(module, attr, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=param.requires_grad))


def install_layer(model, name, layer, device="cpu"):
    """Put a quantized layer (a QuantLinear built from a format's tensors) in place of the model's nn.Linear `name`,
    which must exist and have the layer's shape."""
    from .layers import QuantLinear
    try:
        linear = model.get_submodule(name)           # (not a dict of every module: that per layer is quadratic)
    except AttributeError:
        linear = None
    if not isinstance(layer, QuantLinear) or not isinstance(linear, nn.Linear):
        raise ValueError(f"{name}: a {type(layer).__name__} cannot replace {type(linear).__name__} (not a linear of "
                         "this model)")
    if (layer.in_features, layer.out_features) != (linear.in_features, linear.out_features):
        raise ValueError(f"{name}: checkpoint layer is {layer.out_features} x {layer.in_features}, the config says "
                         f"{linear.out_features} x {linear.in_features}")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer.to(device))


def load_tensors(model, directory, dtype, device="cpu", claim=None, verify=True):
    """The one loader loop: stream every tensor of the checkpoint in `directory` into `model`.

    claim(name, tensor) -> True lets a quantized format take the tensors it owns (its layers are built from them);
    every other tensor must be one of the model's parameters. A tied lm_head stored anyway is skipped. Returns the
    names of the parameters filled."""
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded = set()
    for name, value in unfused(snapshot_tensors(directory, verify)):
        if claim is not None and claim(name, value):
            continue
        if name == "lm_head.weight" and tied:
            continue                                     # tied: some writers store it anyway
        if name not in params:
            raise ValueError(f"unexpected tensor {name} in {directory}")
        place(model, name, value, dtype, device)
        loaded.add(name)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return loaded


def check_complete(model, loaded, directory, built=()):
    """Every parameter of the model must have been loaded, except those of the modules in `built` (layers a format
    constructed from its own tensors) and a tied lm_head."""
    skip = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing = sorted(n for n in dict(model.named_parameters())
                     if n not in loaded and n not in skip and n.rpartition(".")[0] not in built)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_dense(directory, dtype=None, device="cpu", verify=True):
    """A Qwen3 from a dense Hugging Face checkpoint folder, in its stored dtype (or `dtype`). verify=False skips the
    per-tensor SHA-256 check of files the engine wrote."""
    _, _, model, specs = prepare(directory)
    dtype = dtype or default_dtype(specs)
    check_complete(model, load_tensors(model, directory, dtype, device, verify=verify), directory)
    return model.eval()


def model_digest(model):
    """SHA-256 of the weights a model computes with, as float32 (so that a lossless bf16 / f16 -> f32 load gives the
    same digest, and a quantized layer counts as its dequantized weight): the provenance a quantized checkpoint
    records, and `run.py eval` checks."""
    from .layers import QuantLinear
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            tensors[f"{name}.weight"] = module.dequantize()
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias
        else:
            for p_name, p in module.named_parameters(recurse=False):
                tensors[f"{name}.{p_name}" if name else p_name] = p
    if model.cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return digest_of({name: float_digest(t) for name, t in tensors.items()})


def digest_of(tensor_digests):
    """One digest for a model from {name: tensor digest} (the streaming converter builds it tensor by tensor)."""
    return hashlib.sha256("\n".join(f"{k}:{v}" for k, v in sorted(tensor_digests.items())).encode()).hexdigest()


def checkpoint_source(directory):
    """The model_digest of the model a checkpoint was quantized from, as its writer recorded it (None if unknown)."""
    return checkpoint_records(directory).get("engine.source_sha256")


def dense_tensors(model, dtype=None):
    """{HF name: tensor} of a dense model (the tied lm_head is not stored, as transformers does)."""
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        out[name] = p.detach().to(dtype or p.dtype).contiguous()
    return out


def save_dense(model, directory, dtype=None, force=False, side_files=None):
    """Write config.json + model.safetensors atomically (engine.safe_writes.atomic_directory: a failed or killed
    save leaves the old checkpoint or nothing; a folder holding other files is refused unless force=True).
    side_files(folder), if given, writes the rest of the checkpoint (tokenizer files) into the same atomic folder."""
    raw = model.cfg.to_hf()
    if dtype is not None:
        raw["torch_dtype"] = raw["dtype"] = str(dtype).removeprefix("torch.")
    tensors = dense_tensors(model, dtype)
    with atomic_directory(directory, force, needed=nbytes(tensors)) as tmp:
        write_json(tmp / "config.json", raw)
        save_file(tensors, tmp / "model.safetensors")
        if side_files is not None:
            side_files(tmp)

