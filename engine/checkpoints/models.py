"""Any model the engine reads, by what the path holds: a .gguf file (gguf.py), a quantized checkpoint folder
(engine.formats.quantized_checkpoints) or a dense Hugging Face folder (engine.loaders); whole (load_model), by its
header alone (model_config), or one tensor at a time (Source, what the streaming converter reads)."""
from pathlib import Path

import torch

from ..layers import linear_names, quantized_linears
from ..formats.quantized_checkpoints import LayerAssembler, load_quantized, method_for
from ..loaders import expert_parts, load_dense, read_config, skeleton, split_part, unfused, unfused_specs
from ..qwen3 import Qwen3Config
from ..safe_writes import TOKENIZER_FILES
from ..safetensors_io import DTYPE_BYTES, TensorReader
from ..formats.llama_cpp import gguf, gguf_experts, gguf_file
from ..formats.llama_cpp.gguf_tokenizer import gguf_tokenizer
from .tokenizer import check_vocabulary, export_tokenizer, load_tokenizer


def load_model(path, dtype=None, device="cpu", dense=False, progress=None, to_run=False):
    """Any model the engine reads: a .gguf file (gguf.py), a quantized checkpoint folder (config.json with a
    quantization_config) or a dense one. dense=True turns every quantized layer into an nn.Linear holding its
    dequantized weight (float32): the reference a GGUF model's own quantization defines. progress(iterable, total),
    e.g. tqdm, wraps a GGUF file's tensors as they load. to_run=True loads it to run (generate, eval:
    engine.runtime.prepare comes next): a GGUF file's quantized embedding and lm_head stay in their stored type
    instead of being dequantized, and its layers keep their codes without the blocks."""
    path = Path(path)
    if dense and to_run:
        raise ValueError("dense=True dequantizes every layer; to_run=True keeps them quantized")
    if path.suffix == ".gguf":
        model = gguf.load_gguf(path, dtype or torch.float32, device, progress, to_run)
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


def file_tensor_bytes(path):
    """The bytes a model's files hold in tensors (a GGUF file's tensor data; a folder's safetensors tensors): what
    its weights cost on disk, headers, metadata and the tokenizer left out."""
    path = Path(path)
    if path.suffix == ".gguf":
        with gguf_file.GGUFFile(path) as f:
            return sum(info.nbytes for info in f.tensors.values())
    return sum(DTYPE_BYTES[dtype] * torch.Size(shape).numel() for dtype, shape in TensorReader(path).specs.values())


def model_config(path):
    """The Qwen3Config of the model at `path` (a .gguf file or a folder), from its header or config.json alone."""
    path = Path(path)
    if path.suffix == ".gguf":
        with gguf_file.GGUFFile(path) as f:
            return Qwen3Config.from_hf(gguf.hf_config(f))
    return Qwen3Config.from_hf(read_config(path))


class Source:
    """A model on disk, read one decoder layer at a time: a Hugging Face folder, a quantized checkpoint folder or a
    GGUF file (the last two's quantized linears dequantized: their weights are the reference the new method starts
    from, as load_model(path, dense=True) holds them). `config` is the HF-style config dict, `sizes` {HF tensor name:
    bytes as the converter reads it}; tensors(keep) yields (name, tensor) for the names keep() selects; tokenizer()
    and export_tokenizer(folder) rebuild a GGUF file's tokenizer once."""

    def __init__(self, path):
        self.path = Path(path)
        self._rebuilt = None
        if self.path.is_file() and self.path.suffix == ".gguf":
            self.gguf, self.quantized = gguf_file.GGUFFile(self.path), None
            self.config = gguf.hf_config(self.gguf)
            self.sizes = {}
            for n, info in self.gguf.tensors.items():
                name, kind = gguf.hf_name(n)
                names = gguf_experts.expert_names(name, info.shape[0]) if kind in gguf_experts.STACKS else [name]
                self.sizes.update(dict.fromkeys(names, _read_bytes(info) // len(names)))
        else:
            self.gguf = None
            self.config = read_config(self.path)
            self.reader = TensorReader(self.path)
            self.specs = unfused_specs(self.reader.specs)          # fused experts: as the per-expert weights
            self.skeleton = skeleton(Qwen3Config.from_hf(self.config)) if "quantization_config" in self.config else None
            self.quantized = _quantized_linears(self.config, self.specs, self.skeleton)
            if self.quantized is not None:                       # each quantized linear as its float32 weight
                modules, shapes = self.quantized[2], self.quantized[3]
                self.specs = {n: spec for n, spec in self.specs.items() if split_part(n, modules)[0] not in modules
                              or split_part(n, modules)[1] == "bias"}
                self.specs.update({f"{m}.weight": ("F32", shapes[m]) for m in modules})
            self.sizes = {n: DTYPE_BYTES[dtype] * torch.Size(shape).numel() for n, (dtype, shape) in self.specs.items()}

    def tensors(self, keep):
        if self.gguf is not None:
            yield from gguf.hf_tensors(self.gguf, keep, dense=True)
        elif self.quantized is not None:
            yield from self._dequantized(keep)
        else:
            for name in self.reader.names():
                parts = expert_parts(name, self.reader.specs[name][1])
                if parts is None and keep(name):
                    yield name, self.reader.read(name)
                elif parts is not None and any(keep(part) for part, _, _ in parts):
                    yield from ((p, t) for p, t in unfused([(name, self.reader.read(name))]) if keep(p))

    def _dequantized(self, keep):
        """tensors(keep) of a quantized checkpoint: a linear's parts gathered as they are read and the linear built
        (the loader's LayerAssembler), then yielded as `{linear}.weight`, dequantized (and its bias)."""
        method, config, modules, _ = self.quantized
        built, biases = [], {}
        assembler = LayerAssembler(self.skeleton, method, config, "cpu", install=lambda *item: built.append(item))
        for name in self.reader.names():
            module, part = split_part(name, modules)
            if module not in modules:
                if keep(name):
                    yield name, self.reader.read(name)
            elif keep(f"{module}.weight") or keep(f"{module}.bias"):
                value = self.reader.read(name)
                if part == "bias":
                    biases[module] = value                    # yielded as stored (the layer holds it in float32)
                assembler.claim(name, value)
                for module, layer in built:
                    yield f"{module}.weight", layer.dequantize().float()
                    if module in biases:
                        yield f"{module}.bias", biases.pop(module)
                built.clear()

    def has_tokenizer(self):
        if self.gguf is None:
            return (self.path / "tokenizer.json").exists()
        return "tokenizer.ggml.tokens" in self.gguf.metadata

    def tokenizer(self):
        """The model's tokenizers.Tokenizer (ids beyond the embedding's rows refused, as load_tokenizer does)."""
        if self.gguf is None:
            return load_tokenizer(self.path)
        embedding = self.gguf.tensors.get("token_embd.weight")
        return check_vocabulary(self._gguf_tokenizer()[0], embedding and embedding.shape[0], self.path)

    def export_tokenizer(self, folder):
        """Write the model's tokenizer files into `folder` (tokenizers.export_tokenizer); returns their names."""
        if self.gguf is None:
            return export_tokenizer(self.path, folder)
        return export_tokenizer(self.path, folder, self._gguf_tokenizer()
                                if "tokenizer.ggml.tokens" in self.gguf.metadata else ())

    def _gguf_tokenizer(self):
        if self._rebuilt is None:
            self._rebuilt = gguf_tokenizer(self.gguf)
        return self._rebuilt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.gguf is not None:
            self.gguf.close()

    def side_bytes(self):
        """About the bytes of the tokenizer files export_tokenizer writes (a GGUF file's: twice its header)."""
        if self.gguf is not None:
            return 2 * min((info.offset for info in self.gguf.tensors.values()), default=0)
        return sum((self.path / name).stat().st_size for name in TOKENIZER_FILES if (self.path / name).is_file())

    def identity(self):
        """What a resumed conversion must find unchanged: the source's files (names, sizes, modification times)."""
        files = [self.path] if self.gguf is not None else sorted(self.path.iterdir())
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


def _quantized_linears(config, specs, model):
    """None for a dense folder; for a quantized checkpoint (method, its validated quantization_config, {linear:
    the parts its file stores}, {linear: weight shape}) of the linears stored quantized (a linear left dense, stored
    as a plain weight, is read as one). A method whose layers share state past a linear (EntQuant's blocks) or a
    linear missing a part is refused here, before any work."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    method = method_for(raw)
    quantization_config = method.validate(raw) if method.validate else raw
    if method.finish is not None:
        raise ValueError(f"a checkpoint of method {method.name} is read whole (its layers share its decoder), not "
                         "one layer at a time: a conversion starts from a model's float weights, or from a checkpoint "
                         "of another method")
    needed = set(method.parts(quantization_config))
    linears = {name: model.get_submodule(name).weight.shape for name in linear_names(model)}
    stored = {}
    for name in specs:
        module, part = split_part(name, linears)
        if module in linears:
            stored.setdefault(module, set()).add(part)
    modules = {m: parts for m, parts in stored.items() if parts & (needed - {"weight"})}
    for module, parts in modules.items():
        if not needed <= parts:
            raise ValueError(f"{module}: a {method.name} linear needs {sorted(needed)}; the checkpoint has "
                             f"{sorted(parts)}")
    return method, quantization_config, modules, {m: tuple(linears[m]) for m in modules}


def _read_bytes(info):
    """Bytes of a GGUF tensor as the converter reads it: dense types as stored, block types decoded to float32."""
    n = torch.Size(info.shape).numel()
    return n * (2 if info.type_name in ("F16", "BF16") else 4)
