"""Dense Qwen3 checkpoints in the Hugging Face layout: config.json + model.safetensors (or shards).

`load_dense` builds the model on the meta device (no memory, no random init), then streams the tensors in, checking
every name, shape and dtype; anything missing, unexpected or mis-shaped is a ValueError naming the tensor.
`save_dense` writes what transformers' Qwen3ForCausalLM.from_pretrained reads.
"""
import json
from pathlib import Path

import torch

from .qwen3 import Qwen3, Qwen3Config
from .safetensors_io import atomic_directory, save_file, snapshot_tensors


def read_config(directory):
    """config.json as a dict; ValueError if it is missing or not a JSON object."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise ValueError(f"no config.json in {directory}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def assign(param, value, name):
    """Copy a checkpoint tensor into a parameter: same shape, and a floating-point tensor for a float parameter."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
    if param.dtype.is_floating_point != value.dtype.is_floating_point:
        raise ValueError(f"{name}: checkpoint dtype {value.dtype} cannot fill a {param.dtype} parameter")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def empty_model(cfg, dtype=torch.float32, device="cpu"):
    """A Qwen3 whose tensors are allocated but not initialised (they are about to be loaded)."""
    with torch.device("meta"):
        model = Qwen3(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_tensors(model, directory, claim=None):
    """The one loader loop: stream every tensor of the checkpoint in `directory` into `model`.

    claim(name, tensor) -> True lets a quantized format take the tensors it owns (its layers are built from them);
    every other tensor must be one of the model's parameters, with its shape and a compatible dtype. A tied
    lm_head stored anyway is skipped. Returns the names of the parameters filled."""
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded = set()
    for name, value in snapshot_tensors(directory):
        if claim is not None and claim(name, value):
            continue
        if name == "lm_head.weight" and tied:
            continue                                     # tied: some writers store it anyway
        if name not in params:
            raise ValueError(f"unexpected tensor {name} in {directory}")
        assign(params[name], value, name)
        loaded.add(name)
    return loaded


def check_complete(model, loaded, directory, built=()):
    """Every parameter of the model must have been loaded, except those of the modules in `built` (layers a format
    constructed from its own tensors) and a tied lm_head."""
    skip = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing = sorted(n for n in dict(model.named_parameters())
                     if n not in loaded and n not in skip and n.rpartition(".")[0] not in built)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_dense(directory, dtype=torch.float32, device="cpu"):
    """A Qwen3 from a dense Hugging Face checkpoint folder."""
    cfg = Qwen3Config.from_hf(read_config(directory))
    model = empty_model(cfg, dtype, device)
    check_complete(model, load_tensors(model, directory), directory)
    return model.eval()


def dense_tensors(model, dtype=None):
    """{HF name: tensor} of a dense model (the tied lm_head is not stored, as transformers does)."""
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        out[name] = p.detach().to(dtype or p.dtype).contiguous()
    return out


def save_dense(model, directory, dtype=None):
    """Write config.json + model.safetensors (atomically: a failed save leaves nothing behind)."""
    raw = model.cfg.to_hf()
    if dtype is not None:
        raw["torch_dtype"] = raw["dtype"] = str(dtype).removeprefix("torch.")
    with atomic_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        save_file(dense_tensors(model, dtype), tmp / "model.safetensors", metadata={"format": "pt"})
