"""Quantizing a checkpoint from disk to disk, one decoder layer at a time, in bounded memory.

The model is never materialized. Its skeleton is built on the meta device (every shape, no memory); the calibration
ids are embedded once; then for each decoder layer i:

    read layer i's tensors from the source (a Hugging Face folder or a GGUF file)  ->  run the method's
    quantize_layer on it (the same function `quantize` runs in memory; data-aware methods capture their statistics
    from the hidden states that reach layer i)  ->  write layer i's tensors as shard i  ->  compute the hidden states
    for layer i + 1 (through the quantized layer, or through the float one before quantizing: the method says which)
    ->  free the layer

so peak memory is about one decoder layer plus the calibration activations and statistics, whatever the depth (the
embedding table is only read to embed the ids and again, tensor by tensor, to be copied). A sparse layer's experts,
for a method that reaches them only through its captures (CheckpointMethod.lazy_experts: GPTQ, a chunk of experts at
a time), are read as a capture first needs them, so a layer's float experts are not all held at once either.
Unquantized tensors (embeddings, norms, biases) are written in their source dtype. The output is sharded safetensors
with an index, config.json with the quantization_config, and the source's tokenizer and generation files.

`Conversion` checks everything once, before any work: the method, the output (its lock held: one writer; not the
source; nothing of the user's replaced), the source (opened once: config, layer count, shapes, tokenizer) and the
calibration the method needs.

A killed conversion resumes, and the record never disagrees with the files. The output is built in DIR's sibling
.DIR.partial, every shard under its final name (model-k-of-n: n is known from the source before any work), each
written atomically; progress.json records the layers done (and with which source, method, options and calibration)
and is rewritten only after a layer's shard is complete, so every layer it counts is on disk. A re-run with the
same arguments keeps those shards, removes everything else in the folder (a shard written after the last record, a
killed write's temporary file) and goes on (replaying done layers to rebuild the hidden states it needs); a folder
it cannot trust (no record, other settings, a counted shard missing or damaged) is started over. Either way one
line on stderr says which. Finishing writes the index, config.json and the tokenizer files, removes the record
(from then on the folder is not resumable, so the swap below can never be mistaken for one) and swaps the folder
into DIR atomically (safe_writes.commit_directory). Free space is checked against an estimate first (the tensors
copied as stored, and each layer written so far times the layers to go), and a full disk keeps the finished layers.

Several processes (torchrun; engine/distributed.py): every rank opens the source; rank 0 alone holds the lock,
reads and writes the progress record and writes every file, in the order above, so the folder and its resume are the
same as one process's. A data-free method's layers are quantized by rank i % N and sent to rank 0; a data-aware
method runs every layer on every rank, each with its share of the calibration batches (LayerCalibration merges the
statistics and shares each quantized linear), and a resumed run's replayed layers reach the other ranks as their
shards' bytes.
"""
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ..distributed import check_world, on_first, share
from ..formats.numerics.calibration import (LayerCalibration, check_ids, first_layer_batches, layer_weights,
                                            merged_config)
from ..formats.numerics.experts import expert_of
from ..formats.numerics.sensitivity import output_fisher
from ..layers import release_memory
from ..qwen3 import DecoderLayer, Qwen3Config
from ..loaders import check_complete, check_experts, check_layer_count, check_shapes, digest_of, place, skeleton
from ..formats.quantized_checkpoints import METHODS, LayerAssembler, checkpoint_tensors, config_digest
from ..output_lock import output_lock
from ..safe_writes import (check_apart, check_free_space, check_output, commit_directory, folder_size, is_disk_full,
                          recover_interrupted_swap, resumable_directory, space_error)
from ..safetensors_io import (INDEX, TensorReader, check_records, float_digest, read_header, read_json, save_file,
                             tensor_digest, write_json)
from .models import Source
from .rank_layers import RankLayerCalibration

PROGRESS = "progress.json"

def _say(message):
    print(message, file=sys.stderr, flush=True)


class Conversion:
    """Quantizing the model at `source` (an HF folder or a .gguf file) with `method` (a key of registry.METHODS)
    into the checkpoint folder `out`, one decoder layer at a time (see the module docstring). Entering it checks
    everything once, holds the output's lock and opens the source; `needs_data` says whether run() needs
    calibration ids, `source.tokenizer()` turns text into them. Options go to the method's quantize_layer; dtype is
    the precision layers compute in while they are calibrated (data-free methods read each layer in its stored
    dtype; stored dtypes are kept on disk). ranks: this process's engine.distributed.Group when torchrun started
    several (each calls run() with the same ids; rank 0 alone touches the output)."""

    def __init__(self, source, out, method, force=False, dtype=torch.float32, batch_size=8, progress=True,
                 override="force=True", ranks=None, **options):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
        self.entry = METHODS[method]
        if self.entry.quantize_layer is None:
            raise ValueError(f"method {method} cannot quantize layer by layer")
        self.source_path, self.out, self.method = Path(source), Path(out), method
        self.force, self.override = force, override              # override: how a refusal names force (--force)
        self.dtype, self.batch_size, self.progress = dtype, batch_size, progress and (ranks is None or ranks.first)
        self.options = self.entry.checked(options)               # every option, before anything is opened
        self.group = ranks                                       # several processes: engine.distributed.Group
        if ranks is not None:
            check_world(ranks.world, self.entry.calibration(self.options) is not None)
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        try:
            on_first(self.group, self._output_checks, "checking the output")      # the one writer: rank 0
            self.source = self._stack.enter_context(Source(self.source_path))
            self.cfg = Qwen3Config.from_hf(self.source.config)
            self.entry.fits(self.cfg, self.options)
            check_layer_count(self.cfg, self.source.sizes, self.source_path)
            self.model = skeleton(self.cfg)
            if self.source.gguf is None:
                check_shapes(self.model, self.source.specs, self.source_path)
                check_experts(self.model, self.source.specs, self.source_path)
            if self.source.has_tokenizer():
                self.source.tokenizer()          # an id beyond the vocabulary: refused now, not copied into the output
            self.mode = self.entry.calibration(self.options)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _output_checks(self):
        check_apart(self.source_path, self.out)
        self._stack.enter_context(output_lock(self.out))          # a second writer is refused here, at once
        recover_interrupted_swap(self.out)
        check_output(self.out, self.force, self.override)

    def __exit__(self, *exc):
        self._stack.close()

    @property
    def writer(self):
        """Whether this process writes the output (the one process, or rank 0)."""
        return self.group is None or self.group.first

    @property
    def needs_data(self):
        return self.mode is not None

    def float_model(self, dtype=torch.float32):
        """The whole source model in `dtype`, read through the open source (the "self" calibration samples the
        model's own text from it; the converter itself never holds more than a layer)."""
        model, loaded = skeleton(self.cfg), set()
        for name, value in self.source.tensors(lambda n: not (n == "lm_head.weight" and self.cfg.tie_word_embeddings)):
            place(model, name, value, dtype, "cpu")
            loaded.add(name)
        if self.cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        check_complete(model, loaded, self.source_path)
        return model.eval()

    def _rest(self, name):
        """Tensors outside the decoder layers (embedding, final norm, an untied lm_head): copied as stored."""
        return not name.startswith("model.layers.") and not (name == "lm_head.weight" and
                                                             self.cfg.tie_word_embeddings)

    def run(self, calibration_ids=None, records=None):
        """Convert (calibration_ids [B, T] for the data-aware methods); records: more "engine.*" provenance entries
        for the index's metadata (which calibration: engine.data.Calibration.records). Returns the
        quantization_config."""
        ids = check_ids(calibration_ids, self.cfg.vocab_size, self.method) if self.mode else None
        self.records = check_records(records)
        layers, rest = self.cfg.num_hidden_layers, [n for n in self.source.sizes if self._rest(n)]
        n = layers + len(rest)
        self.shards = [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        identity = {"source": self.source.identity(), "method": self.method, "options": self.options,
                    "dtype": str(self.dtype), "calibration": None if ids is None else tensor_digest(ids)}
        folder, state = on_first(self.group, lambda: self._resume(identity), "reading the progress record")
        self.known = sum(self.source.sizes[name] for name in rest) + self.source.side_bytes()
        try:
            self._check_space(folder, state)
            return self._convert(folder, state, ids)
        except BaseException as e:
            if not self.writer:
                raise
            if not state["done"]:                   # nothing worth keeping
                shutil.rmtree(folder, ignore_errors=True)
            if is_disk_full(e):
                raise space_error(self.out, self._still_needed(folder, state), self._kept(folder, state),
                                  ran_out=True) from None
            raise

    def _still_needed(self, folder, state):
        """Bytes the conversion still has to write: the layers to go at the mean size of those written (none written
        yet: only what is known before any work), the tensors copied as stored and the tokenizer files."""
        written = [(folder / s).stat().st_size for s in self.shards[:state["done"]] if (folder / s).exists()]
        per_layer = sum(written) / len(written) if written else 0
        return per_layer * (self.cfg.num_hidden_layers - len(written)) + self.known

    def _kept(self, folder, state):
        return (folder.name, folder_size(folder)) if state["done"] else None

    def _check_space(self, folder, state):
        if self.writer:
            check_free_space(self.out, self._still_needed(folder, state), self._kept(folder, state))

    def _convert(self, folder, state, ids):
        layers, batches = self.cfg.num_hidden_layers, None
        self.share = (0, None)                      # (this rank's first calibration batch, all batches)
        self.fisher = None                          # the output Fisher, for a method that asks for it
        if self.mode and state["done"] < layers:    # the embedding, in its stored dtype, only to embed the ids
            _fill(self.model, self.source.tensors(lambda n: n == "model.embed_tokens.weight"), None, {})
            if self.group is not None:              # this rank's contiguous share of the batches
                total = -(-len(ids) // self.batch_size)
                mine = share(total, self.group.rank, self.group.world)
                ids, self.share = ids[mine.start * self.batch_size:mine.stop * self.batch_size], (mine.start, total)
            # a rank whose share is empty (fewer batches than ranks) has no batches, not one empty batch (what
            # splitting 0 ids gives): it adds nothing to the statistics and still takes part in every exchange
            batches = [(h.to(self.dtype), *rope) for h, *rope in first_layer_batches(self.model, ids, self.batch_size)
                       ] if len(ids) else []
            if self.entry.output_fisher(self.options):
                self.fisher = self._output_fisher(batches)
            self.model.model.embed_tokens.to_empty(device="meta")
        self._validated, done = {}, state["done"]
        bar = tqdm(total=layers, initial=done, desc=f"{self.method} layers", disable=not self.progress, unit="layer")
        for i in range(layers):                     # the bar starts where a killed run stopped
            if i < done and (not self.mode or done == layers):
                continue                            # done: its record holds its digests, no later layer needs it
            if self.group is not None and not self.mode:
                self._spread_layer(i, folder, state)
            else:
                batches = self._layer(i, batches, folder, state)
            bar.update(i >= done)
            if i + 1 < layers:                      # with the layers written so far measured
                self._check_space(folder, state)
        bar.close()
        if not self.writer:
            return None
        # one at a time (an 8B's embedding is 1.2 GB), and no enumerate(): its cached result tuple would keep the
        # previous tensor alive while the next one is read
        k = self.cfg.num_hidden_layers
        for name, tensor in self.source.tensors(self._rest):
            state["digests"][name] = float_digest(tensor)
            save_file({name: tensor}, folder / self.shards[k])          # as stored, byte for byte
            del tensor
            k += 1
        quantization_config = merged_config(state["layer_configs"], state["weights"])
        self._finish(folder, quantization_config, digest_of(state["digests"]))
        return quantization_config

    def _spec(self, layer_cfg):
        """A layer's quantization_config validated by the method, once per distinct config."""
        key = json.dumps(layer_cfg, sort_keys=True)
        if key not in self._validated:
            self._validated[key] = self.entry.validate(layer_cfg) if self.entry.validate else layer_cfg
        return self._validated[key]

    def _layer(self, i, batches, folder, state):
        """Read decoder layer i, quantize it and write it (or, done by a killed run, replay it), free it; returns the
        calibration batches for layer i + 1."""
        model, mode = self.model, self.mode
        prefix = f"model.layers.{i}."
        layer_dtype = self.dtype if mode else None      # data-free methods read each weight as stored (half the memory)
        lazy = mode and self.entry.lazy_experts         # the experts read as the method's captures need them

        def read(experts=None):                         # the layer (its experts too, unless lazy), or those experts
            def keep(name):
                e = expert_of(name.rpartition(".")[0])
                return name.startswith(prefix) and (e in experts if experts is not None else not lazy or e is None)
            stored.update(_fill(model, self.source.tensors(keep), layer_dtype, state["digests"]))
        stored = {}
        read()
        options = dict(fisher=self.fisher, load=lambda experts: read(set(experts)))
        layer = (LayerCalibration(model.model.layers[i], i, batches, self.entry.name, **options) if self.group is None
                 else RankLayerCalibration(model.model.layers[i], i, batches, self.entry.name, self.group, *self.share,
                                           **options))
        if i < state["done"]:
            if mode == "quantized":
                self._read_back(folder, self.shards[i], self._spec(state["layer_configs"][i]), layer_dtype)
            batches = layer.outputs() if mode else None
        else:
            ahead = layer.outputs() if mode == "float" else None
            layer_cfg = self.entry.quantize_layer(layer, **self.options)
            if self.writer:
                self._write_layer(i, checkpoint_tensors(layer.layer, self.entry, self._spec(layer_cfg), prefix,
                                                        stored), layer_cfg, layer_weights(layer), {}, folder, state)
            batches = ahead if ahead is not None else (layer.outputs() if mode else None)
        model.model.layers[i] = _meta_layer(model.cfg, i)
        del layer
        release_memory()
        return batches

    def _output_fisher(self, batches):
        """The float model's output Fisher (numerics/sensitivity.py: output_fisher) with one decoder layer read from
        disk at a time (each read twice: forward, then backward), the final norm and lm_head held meanwhile; a
        resumed run measures it again, the same draws."""
        model, head = self.model, lambda n: n in ("model.norm.weight", "lm_head.weight")
        _fill(model, self.source.tensors(head), self.dtype, {})
        if self.cfg.tie_word_embeddings:             # the embedding is held as stored (bf16, say): a copy in dtype
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().to(self.dtype),
                                                      requires_grad=False)

        def load(i):
            _fill(model, self.source.tensors(lambda n: n.startswith(f"model.layers.{i}.")), self.dtype, {})
            return model.model.layers[i]

        def free(i):
            model.model.layers[i] = _meta_layer(model.cfg, i)
            release_memory()

        try:
            return output_fisher(model, batches, load=load, free=free, progress=self.progress)
        finally:                                     # (a tied lm_head gets a meta weight of its own, as before)
            model.model.norm.to_empty(device="meta")
            model.lm_head.to_empty(device="meta")

    def _write_layer(self, i, tensors, layer_cfg, weights, digests, folder, state):
        """Layer i's shard, then its progress record (every layer the record counts is on disk)."""
        save_file(tensors, folder / self.shards[i])
        state["digests"].update(digests)
        state["layer_configs"].append(layer_cfg)
        state["weights"].append(weights)
        state["done"] = i + 1
        write_json(folder / PROGRESS, state)

    def _spread_layer(self, i, folder, state):
        """A data-free method over several ranks: layer i quantized by rank i % world, written by rank 0."""
        owner, prefix = i % self.group.world, f"model.layers.{i}."
        if self.group.rank == owner:
            digests = {}
            stored = _fill(self.model, self.source.tensors(lambda n: n.startswith(prefix)), None, digests)
            layer = LayerCalibration(self.model.model.layers[i], i, None, self.entry.name)
            layer_cfg = self.entry.quantize_layer(layer, **self.options)
            result = (checkpoint_tensors(layer.layer, self.entry, self._spec(layer_cfg), prefix, stored), layer_cfg,
                      layer_weights(layer), digests)
            self.model.model.layers[i] = _meta_layer(self.model.cfg, i)
            del layer
            release_memory()
            if owner != 0:
                self.group.send(result, 0, f"sending layer {i}")
        if self.group.first:
            if owner != 0:
                result = self.group.receive(owner, f"receiving layer {i}")
            self._write_layer(i, *result, folder, state)

    def _read_back(self, folder, shard, spec, dtype):
        """Rebuild a quantized layer from its written shard (a resumed run replays it to get the next inputs); in a
        group rank 0 sends the shard's bytes to the others."""
        if self.group is not None:
            data = self.group.broadcast((folder / shard).read_bytes() if self.writer else None, 0,
                                        f"sending {shard}")
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / shard).write_bytes(data)
                return self._read_back_file(Path(tmp) / shard, spec, dtype)
        return self._read_back_file(folder / shard, spec, dtype)

    def _read_back_file(self, shard, spec, dtype):
        assembler = LayerAssembler(self.model, self.entry, spec, "cpu")
        reader = TensorReader(shard)
        for name in reader.names():
            value = reader.read(name)
            if not assembler.claim(name, value):
                place(self.model, name, value, dtype, "cpu")
        for name, value in assembler.dense_leftovers().items():
            place(self.model, name, value, dtype, "cpu")

    def _resume(self, identity):
        """(the partial folder, its progress state): the one a killed run with the same identity left, holding
        only the shards its record counts, or a fresh one; says which on stderr when a partial folder was found."""
        folder = self.out.parent / f".{self.out.name}.partial"
        if folder.exists() or folder.is_symlink():
            state, why = self._trusted(folder, identity)
            if state is not None:
                keep = {PROGRESS, *self.shards[:state["done"]]}
                for entry in folder.iterdir():
                    if entry.name not in keep:
                        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                done, n = state["done"], self.cfg.num_hidden_layers
                layers = "no layer" if not done else "layer 0" if done == 1 else f"layers 0-{done - 1}"
                replay = "; replaying them for the calibration inputs" if done and self.mode and done < n else ""
                _say(f"resuming {self.out}: {layers} of {n} {'were' if done > 1 else 'was'} written by an earlier run "
                     f"(kept in {folder}){replay}")
                return folder, state
            _say(f"{self.out}: started over: {folder.name} {why}")
            shutil.rmtree(folder) if folder.is_dir() and not folder.is_symlink() else folder.unlink()
        return resumable_directory(self.out), {"identity": identity, "done": 0, "digests": {}, "layer_configs": [],
                                               "weights": []}

    def _trusted(self, folder, identity):
        """(the progress state, None) of a partial folder this conversion can go on from, or (None, why not)."""
        if folder.is_symlink() or not folder.is_dir():
            return None, "is not a folder"
        try:
            state = read_json(folder, PROGRESS)
        except ValueError:
            return None, "has no readable progress record (a run that was finishing, or another kind of run)"
        if state.get("identity") != identity:
            return None, "was left by a run from another source, method, options or calibration"
        done = state.get("done")
        if (type(done) is not int or not 0 <= done <= self.cfg.num_hidden_layers
                or any(len(state.get(k, ())) != done for k in ("layer_configs", "weights"))):
            return None, "has a progress record that does not add up"
        for shard in self.shards[:done]:
            try:
                read_header(folder / shard)
            except (OSError, ValueError):
                return None, f"lacks a complete {shard}, which its progress record counts"
        return state, None

    def _finish(self, folder, quantization_config, source_digest):
        """Index (with the provenance records), config.json and the source's side files; the record removed, then the
        folder swapped into `out`."""
        weight_map, total = {}, 0
        for name in self.shards:
            for t in read_header(folder / name)[0]:
                weight_map[t] = name
            total += (folder / name).stat().st_size
        digest = config_digest(quantization_config)
        write_json(folder / INDEX, {"metadata": {"total_size": total, **self.records,
                                                 "engine.source_sha256": source_digest,
                                                 "engine.quantization_config_sha256": digest},
                                    "weight_map": weight_map})
        raw = self.cfg.to_hf()
        raw["quantization_config"] = quantization_config
        write_json(folder / "config.json", raw)
        self.source.export_tokenizer(folder)            # with generation_config.json and the chat template
        (folder / PROGRESS).unlink()
        commit_directory(folder, self.out)


def _meta_layer(cfg, i):
    """Decoder layer i on the meta device, built there (built on the CPU first, a 30B-shaped sparse layer would take
    its 2.4 GB of float32 experts, and their initialization, for an instant)."""
    with torch.device("meta"):
        return DecoderLayer(cfg, i)


def _fill(model, tensors, dtype, digests):
    """Place source tensors into the skeleton in `dtype` (None: as stored), remembering each one's digest
    (provenance) and its stored dtype (what it is written back in)."""
    stored = {}
    for name, value in tensors:
        digests[name] = float_digest(value)
        stored[name] = value.dtype
        place(model, name, value, dtype or value.dtype, "cpu")
    return stored


def quantize_checkpoint(source, out, method, calibration_ids=None, force=False, dtype=torch.float32, batch_size=8,
                        progress=True, records=None, ranks=None, **options):
    """Quantize the model at `source` into the checkpoint folder `out` layer by layer (a Conversion checked, then
    run with calibration_ids [B, T] for the data-aware methods and the provenance `records`). Returns the
    quantization_config."""
    with Conversion(source, out, method, force, dtype, batch_size, progress, ranks=ranks, **options) as conversion:
        return conversion.run(calibration_ids, records)
