"""Quantizing a checkpoint from disk to disk, one decoder layer at a time, in bounded memory.

The model is never materialized. Its skeleton is built on the meta device (every shape, no memory); the calibration
ids are embedded once; then for each decoder layer i:

    read layer i's tensors from the source (a Hugging Face folder or a GGUF file)  ->  run the method's
    quantize_layer on it (the same function `quantize` runs in memory; data-aware methods capture their statistics
    from the hidden states that reach layer i)  ->  write layer i's tensors as shard i  ->  compute the hidden states
    for layer i + 1 (through the quantized layer, or through the float one before quantizing: the method says which)
    ->  free the layer

so peak memory is about one decoder layer plus the calibration activations and statistics, whatever the depth (the
embedding table is only read to embed the ids and again, tensor by tensor, to be copied). Unquantized tensors
(embeddings, norms, biases) are written in their source dtype. The output is sharded safetensors with an index,
config.json with the quantization_config, and the source's tokenizer and generation files.

A killed conversion resumes: the output is built in DIR's sibling .DIR.partial, with progress.json recording what
was done and with which source, method, options and calibration; a re-run with the same arguments skips the layers
already written (replaying them to rebuild the hidden states it needs) and goes on. The finished folder is swapped
into DIR atomically (engine.checkpoints.safe_writes.commit_directory).
"""
import ctypes
import gc
import json
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..formats.base import QuantLinear
from ..formats.calibration import LayerCalibration, check_ids, first_layer_batches, layer_weights, merged_config
from ..qwen3 import DecoderLayer, Qwen3Config
from . import gguf
from .loaders import check_layer_count, check_shapes, digest_of, place, read_config, skeleton
from .registry import METHODS, config_digest
from .safe_writes import check_output, commit_directory, recover_interrupted_swap, resumable_directory
from .safetensors_io import (INDEX, TensorReader, save_file, float_digest, tensor_digest, tensor_specs,
                              write_json)
from .tokenizer import export_tokenizer

PROGRESS = "progress.json"
try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:                                  # not glibc: the system keeps its own allocator's habits
    _LIBC = None


class Source:
    """A model on disk, read one decoder layer at a time: a Hugging Face folder or a GGUF file (whose quantized
    linears are dequantized: their weights are the reference the new method starts from). `config` is the HF-style
    config dict, `names` the HF tensor names; tensors(keep) yields (name, tensor) for the names keep() selects."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_file() and self.path.suffix == ".gguf":
            self.gguf = gguf.GGUFFile(self.path)
            self.config = gguf.hf_config(self.gguf)
            self.names = {gguf.hf_name(n)[0]: None for n in self.gguf.tensors}
        else:
            self.gguf = None
            self.config = read_config(self.path)
            self.reader = TensorReader(self.path)
            self.names = dict(tensor_specs(self.path))

    def tensors(self, keep):
        if self.gguf is not None:
            yield from gguf.hf_tensors(self.gguf, keep, dense=True)
        else:
            for name in self.reader.names():
                if keep(name):
                    yield name, self.reader.read(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.gguf is not None:
            self.gguf.close()

    def identity(self):
        """What a resumed conversion must find unchanged: the source's files (names, sizes, modification times)."""
        files = [self.path] if self.gguf is not None else sorted(self.path.iterdir())
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


def release_memory():
    """Give freed memory back to the system: collect the cycles an nn.Module leaves, then ask glibc to return its
    free heap (freed tensors of a few MB stay in the heap otherwise, and resident memory creeps up layer by layer)."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _layer_prefix(i):
    return f"model.layers.{i}."


def _fill(model, tensors, dtype, digests):
    """Place source tensors into the skeleton in `dtype` (None: as stored), remembering each one's digest
    (provenance) and its stored dtype (what it is written back in)."""
    stored = {}
    for name, value in tensors:
        digests[name] = float_digest(value)
        stored[name] = value.dtype
        place(model, name, value, dtype or value.dtype, "cpu")
    return stored


def _layer_tensors(layer, prefix, entry, spec, stored):
    """{checkpoint name: tensor} of a quantized decoder layer: each QuantLinear's parts (entry.write) and bias, every
    other parameter (norms, unquantized linears) in the dtype it was stored in."""
    tensors, quantized = {}, set()
    for name, module in layer.named_modules():
        if isinstance(module, QuantLinear):
            quantized.add(name)
            for part, value in entry.write(module, spec).items():
                tensors[f"{prefix}{name}.{part}"] = value
            if module.bias is not None:
                tensors[f"{prefix}{name}.bias"] = module.bias.detach().to(stored[f"{prefix}{name}.bias"])
    for name, p in layer.named_parameters():
        if name.rpartition(".")[0] not in quantized:
            tensors[prefix + name] = p.detach().to(stored.get(prefix + name, p.dtype))
    return tensors


def _read_back(model, i, folder, entry, spec, dtype):
    """Rebuild quantized layer i from its written shard (a resumed run replays it to get the next inputs)."""
    from .registry import LayerAssembler
    assembler = LayerAssembler(model, entry, spec, "cpu")
    reader = TensorReader(folder / f"layer-{i:05d}.safetensors")
    for name in reader.names():
        value = reader.read(name)
        if not assembler.claim(name, value):
            place(model, name, value, dtype, "cpu")
    for name, value in assembler.dense_leftovers().items():
        place(model, name, value, dtype, "cpu")


def quantize_checkpoint(source, out, method, calibration_ids=None, force=False, dtype=torch.float32, batch_size=8,
                        progress=True, records=None, **options):
    """Quantize the model at `source` (an HF folder or a .gguf file) with `method` (a key of checkpoints.METHODS)
    into the checkpoint folder `out`, one decoder layer at a time (see the module docstring). calibration_ids
    [B, T] for the data-aware methods; options go to the method's quantize_layer; dtype is the precision the layers
    compute in while they are calibrated (data-free methods read each layer in its stored dtype; stored dtypes are
    kept on disk); records: more "engine.*" provenance entries for the index's metadata (which calibration:
    engine.data.Calibration.records). Returns the quantization_config."""
    records = records or {}
    if not all(isinstance(k, str) and k.startswith("engine.") and isinstance(v, str) for k, v in records.items()):
        raise ValueError(f"records must map 'engine.*' names to strings, got {records!r}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    entry = METHODS[method]
    if entry.quantize_layer is None:
        raise ValueError(f"method {method} cannot quantize layer by layer")
    recover_interrupted_swap(out)
    check_output(out, force)
    with Source(source) as src:
        cfg = Qwen3Config.from_hf(src.config)
        check_layer_count(cfg, src.names, source)
        model = skeleton(cfg)
        if src.gguf is None:
            check_shapes(model, tensor_specs(source), source)
        mode = entry.calibration(options)
        ids = check_ids(calibration_ids, cfg.vocab_size, method) if mode else None
        identity = {"source": src.identity(), "method": method, "options": options, "dtype": str(dtype),
                    "calibration": None if ids is None else tensor_digest(ids)}
        folder, state = _resume(out, identity)
        batches = None
        if mode:                                    # the embedding, in its stored dtype, only to embed the ids
            _fill(model, src.tensors(lambda n: n == "model.embed_tokens.weight"), None, {})
            batches = [(h.to(dtype), *rope) for h, *rope in first_layer_batches(model, ids, batch_size)]
            model.model.embed_tokens.to_empty(device="meta")
        layer_dtype = dtype if mode else None      # data-free methods read each weight as stored (half the memory)
        done, n = state["done"], cfg.num_hidden_layers
        if done and progress:                       # the bar starts where the killed run stopped
            tqdm.write(f"resuming {out}: layers 0-{done - 1} of {n} were written by an earlier run (kept in "
                       f"{folder}){'; replaying them for the calibration inputs' if mode else ''}", file=sys.stderr)
        bar = tqdm(total=n, initial=done, desc=f"{method} layers", disable=not progress, unit="layer")
        for i in range(n):
            batches = _convert_layer(model, i, src, entry, mode, batches, folder, state, layer_dtype, options)
            bar.update(i >= done)
        bar.close()
        rest = (lambda n: not n.startswith("model.layers.") and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
        # one at a time (an 8B's embedding is 1.2 GB), and no enumerate(): its cached result tuple would keep the
        # previous tensor alive while the next one is read
        k = 0
        for name, tensor in src.tensors(rest):
            state["digests"][name] = float_digest(tensor)
            save_file({name: tensor}, folder / f"rest-{k:05d}.safetensors")     # as stored, byte for byte
            del tensor
            k += 1
        qcfg = merged_config(state["layer_configs"], state["weights"])
        _finish(folder, out, src, cfg, qcfg, {**records, "engine.source_sha256": digest_of(state["digests"])})
    return qcfg


def _convert_layer(model, i, src, entry, mode, batches, folder, state, dtype, options):
    """Read decoder layer i, quantize it and write it (or, done by a killed run, replay it), free it; returns the
    calibration batches for layer i + 1."""
    validate = entry.validate or (lambda config: config)
    prefix = _layer_prefix(i)
    stored = _fill(model, src.tensors(lambda n: n.startswith(prefix)), dtype, state["digests"])
    layer = LayerCalibration(model.model.layers[i], i, batches, entry.name)
    if i < state["done"]:
        if mode == "quantized":
            _read_back(model, i, folder, entry, validate(state["layer_configs"][i]), dtype)
        batches = layer.outputs() if mode else None
    else:
        ahead = layer.outputs() if mode == "float" else None
        layer_cfg = entry.quantize_layer(layer, **options)
        save_file(_layer_tensors(layer.layer, prefix, entry, validate(layer_cfg), stored),
                  folder / f"layer-{i:05d}.safetensors")
        batches = ahead if ahead is not None else (layer.outputs() if mode else None)
        state["layer_configs"].append(layer_cfg)
        state["weights"].append(layer_weights(layer))
        state["done"] = i + 1
        write_json(folder / PROGRESS, state)
    model.model.layers[i] = DecoderLayer(model.cfg, i).to("meta")
    del layer
    release_memory()
    return batches


def _resume(out, identity):
    """(the partial folder, its progress state): a fresh one, or the one a killed run with the same identity left."""
    folder = resumable_directory(out)
    state_file = folder / PROGRESS
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    if state is None or state.get("identity") != identity:
        shutil.rmtree(folder)
        folder = resumable_directory(out)
        state = {"identity": identity, "done": 0, "digests": {}, "layer_configs": [], "weights": []}
    return folder, state


def _finish(folder, out, src, cfg, qcfg, records):
    """Index (its metadata: the provenance records), config.json and the source's side files, then the finished
    folder swapped into `out`."""
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    weight_map, total = {}, 0
    for k, name in enumerate(files, 1):
        shard = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        for t in TensorReader(folder / name).names():
            weight_map[t] = shard
        total += (folder / name).stat().st_size
        (folder / name).rename(folder / shard)
    write_json(folder / INDEX, {"metadata": {"total_size": total, **records,
                                             "engine.quantization_config_sha256": config_digest(qcfg)},
                                "weight_map": weight_map})
    raw = cfg.to_hf()
    raw["quantization_config"] = qcfg
    write_json(folder / "config.json", raw)
    (folder / PROGRESS).unlink()
    export_tokenizer(src.path, folder)                  # with generation_config.json and the chat template
    commit_directory(folder, out)
