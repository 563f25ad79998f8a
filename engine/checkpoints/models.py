"""Any model the engine reads, by what the path holds: a .gguf file (gguf.py), a quantized checkpoint folder
(engine.formats.quantized_checkpoints) or a dense Hugging Face folder (engine.loaders)."""
from pathlib import Path

import torch

from ..formats.numerics.base import quantized_linears
from ..formats.quantized_checkpoints import load_quantized
from ..loaders import load_dense, read_config
from ..qwen3 import Qwen3Config
from . import gguf


def load_model(path, dtype=None, device="cpu", dense=False, progress=None):
    """Any model the engine reads: a .gguf file (gguf.py), a quantized checkpoint folder (config.json with a
    quantization_config) or a dense one. dense=True turns every quantized layer into an nn.Linear holding its
    dequantized weight (float32): the reference a GGUF model's own quantization defines. progress(iterable, total),
    e.g. tqdm, wraps a GGUF file's tensors as they load."""
    path = Path(path)
    if path.suffix == ".gguf":
        model = gguf.load_gguf(path, dtype or torch.float32, device, progress)
    elif isinstance(read_config(path).get("quantization_config"), dict):
        model = load_quantized(path, device, dtype)
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


def model_config(path):
    """The Qwen3Config of the model at `path` (a .gguf file or a folder), from its header or config.json alone."""
    path = Path(path)
    if path.suffix == ".gguf":
        with gguf.GGUFFile(path) as f:
            return Qwen3Config.from_hf(gguf.hf_config(f))
    return Qwen3Config.from_hf(read_config(path))
