"""Calibration: what the data-aware methods (GPTQ, AWQ, BlockLDLQ) learn about each linear's inputs, one decoder
layer at a time: two statistics of them, G = X^T X / n and mean |x| (InputStats, input_stats.py), never the inputs.

The model is walked the way GPTQModel's and llm-compressor's sequential pipelines walk it: the calibration ids are
embedded once, and each decoder layer receives the hidden states [B, T, hidden] that the previous layer produced.
While a layer runs, forward pre-hooks on the watched linears accumulate InputStats, and the forward is stopped as soon
as every watched linear has seen its input (the rest of the layer would be wasted work). The method then quantizes
(part of) the layer, may capture again (GPTQ's "true sequential": q/k/v, then o, then gate/up, then down, each step
seeing the already-quantized earlier ones), and finally the layer's outputs become the next layer's inputs: through
its quantized linears (GPTQ: later layers correct the error of earlier ones) or, captured before quantizing, through
the float layer (AWQ and BlockLDLQ, as AutoAWQ does). The work is one pass of one layer per step, so it grows
linearly with depth, not as layers^2 as re-running the model from the embedding for every step would.

Within a layer, a step's run may resume where the step before stopped instead of starting from the layer's input
(the attention computed once, not once per GPTQ step): engine/formats/numerics/layer_runs.py, a speed-up with the same
results, kept apart so that this file reads as the walk itself.

With several processes each rank walks the layers with its share of the batches, through a LayerCalibration whose
capture merges the ranks' statistics and whose replace shares the work (engine/checkpoints/rank_layers.py), so every
method runs unchanged.
"""
import contextlib

import torch
from tqdm import tqdm

from ...layers import (QuantLinear, experts_of, input_owner, is_moe, linear_names, quantized_linears, release_memory,
                       replace_linears, sequential_steps)
from . import experts
from .layer_runs import ResumingRuns
from .input_stats import InputStats, slot_of

BATCH_SIZE = 8                  # calibration sequences in one forward pass (by_layer's default)


class _Seen(Exception):
    """Raised by a pre-hook to end a forward once every watched linear has seen its input."""


def capture(modules, batches, run, slot=lambda b: 0, keep_slots=False):
    """{name: module} -> {name: InputStats} of each module's inputs while run(b, batch) executes for every batch
    (b its index, slot(b) its calibration slot); each run is stopped as soon as all of `modules` have seen their
    input."""
    stats = {name: InputStats(m.in_features, keep_slots) for name, m in modules.items()}
    seen, at = set(), [0]

    def hook(name):
        def record(module, args):
            stats[name].add(args[0].float(), slot(at[0]))
            seen.add(name)
            if len(seen) == len(modules):
                raise _Seen
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    try:
        for b, batch in enumerate(batches):
            seen.clear()
            at[0] = b
            try:
                run(b, batch)
            except _Seen:
                pass
    finally:
        for h in handles:
            h.remove()
    return stats


class LayerCalibration:
    """Decoder layer `index` of a model and the calibration batches that reach it: each batch is the tuple of
    arguments the model passes the layer (hidden states [b, T, hidden] first, then the RoPE tables); batches is
    None for a data-free method. fisher: {full linear name: G [out]}, the model's output Fisher (sensitivity.py), for a
    method that asks for it (CheckpointMethod.output_fisher), else None. load(indices): reads those of a sparse
    layer's experts that are still on the meta device, as a run first needs them (experts.running; the streaming
    converter's, for a method with CheckpointMethod.lazy_experts), None where the layer holds them all."""

    def __init__(self, layer, index, batches=None, method="this method", prefix=None, fisher=None, load=None):
        self.layer, self.index, self.batches, self.method, self.fisher = layer, index, batches, method, fisher
        self.load, self.experts = load, experts_of(layer)        # a sparse layer's experts, None for a dense one
        self.expert_record = {}                                 # what step_hessians saw of them (experts.py)
        self.prefix = f"model.layers.{index}." if prefix is None else prefix
        self.runs = ResumingRuns(layer, len(batches or ()))
        self.first, self.total = 0, len(batches or ())          # the calibration slots of the batches (input_stats)

    def replace(self, make, names=None, rows=False):
        """Replace the layer's linears (all, or the full names in `names`) by make(full name, linear), in place.
        rows=True says that make quantizes each output row on its own given the statistics (error feedback), so that
        several processes may each make a share of the rows (checkpoints/rank_layers.py)."""
        names = None if names is None else {n.removeprefix(self.prefix) for n in names}
        replaced = replace_linears(self.layer, lambda name, linear: make(self.prefix + name, linear), names)
        self.runs.drop_stale()                          # what the replaced linears made is freed now
        return replaced

    def by_rows(self, fn, *rows):
        """fn(*rows) for tensors whose first dimension is a weight's output rows (None passes as it is) and an fn
        whose results are tensors per output row in turn: error feedback given the statistics, which several
        processes split by rows (checkpoints/rank_layers.py)."""
        return fn(*rows)

    def step_hessians(self, min_tokens=None):
        """Yield {full name: H = 2 X^T X / n [in, in]} for each step of the layer in forward order (q/k/v, o,
        gate/up, down), each captured when the caller has replaced the steps before: GPTQ's true-sequential walk. A
        sparse layer's experts are taken a chunk at a time and one that saw fewer than min_tokens gets H = I
        (experts.StepHessians); what they saw is left in self.expert_record ({} for a dense layer)."""
        if self.experts is None:
            for step in sequential_steps(self.layer):
                release_memory()                        # what the step before freed, back to the system
                yield {name: stats.hessian for name, stats in self.capture(step).items()}
            if is_moe(self.layer):                      # a MoE model's dense layer: its record says it has none
                self.expert_record = experts.layer_record(self, {}, set(), min_tokens)
            return
        hessians = experts.StepHessians(min_tokens)
        for step in experts.chunked_steps(self.layer):
            yield hessians(self, step)
        self.expert_record = hessians.record(self)

    def _running(self, watched=None):
        """A sparse layer's runs limited to the experts `watched` needs (experts.running); a dense one's as is."""
        return contextlib.nullcontext() if self.experts is None else experts.running(self.layer, watched, self.load)

    def _run(self, b, args, watched=()):
        """What self.layer(*args) returns for batch b (resumed where an earlier run of the batch stopped, when that
        gives the same result: ResumingRuns); `watched`: the modules whose inputs the caller captures."""
        return self.runs.run(b, args, watched)

    def linears(self, names=None):
        """{full name: module} of the layer's linears (`names`: relative names such as "self_attn.q_proj"; all of
        them, in forward order, by default)."""
        names = [n for step in sequential_steps(self.layer) for n in step] if names is None else names
        return {self.prefix + n: self.layer.get_submodule(n) for n in names}

    def module(self, name):
        """The layer's submodule of full name `name`."""
        return self.layer.get_submodule(name.removeprefix(self.prefix))

    def linear_names(self):
        """Full names of the linears a data-free method replaces, in module order (all but lm_head)."""
        return [self.prefix + n for n in linear_names(self.layer)]

    @torch.no_grad()
    def capture(self, names=None):
        """{full name: InputStats} of the named linears' inputs (all of them by default) over every batch. Linears
        that read the same input (layers.input_owner) accumulate their statistics once and share them. An expert's
        linears see exactly the tokens routed to it (InputStats.rows counts them; none: 0)."""
        if self.batches is None:
            raise ValueError(f"{self.method} needs calibration_ids")
        names = [n for step in sequential_steps(self.layer) for n in step] if names is None else list(names)
        first = {n: input_owner(n) for n in names}
        watched = self.linears(dict.fromkeys(first.values()))
        stats = self._statistics(watched)
        return {self.prefix + n: stats[self.prefix + first[n]] for n in names}

    def _statistics(self, watched, keep_slots=False):
        """{full name: InputStats} of the watched modules' inputs over this process's batches, each batch summed in
        its calibration slot (input_stats.slot_of); keep_slots: each slot's sums kept apart, to be merged."""
        with self._running(watched.values()):
            return capture(watched, self.batches, lambda b, args: self._run(b, args, watched.values()),
                           lambda b: slot_of(self.first + b, self.total), keep_slots)

    @torch.no_grad()
    def outputs(self):
        """The layer's arguments for the next layer: its outputs, with the same RoPE tables. What was kept for the
        batches is freed: the layer's last use."""
        outputs = []
        with self._running():
            for b, args in enumerate(self.batches):
                outputs.append((self._run(b, args), *args[1:]))
                self.runs.forget(b)
        return outputs


def check_ids(calibration_ids, vocab_size, method):
    """calibration_ids [B, T] (or [T]) of token ids below vocab_size -> a 2-D long tensor; ValueError otherwise."""
    if calibration_ids is None or not torch.is_tensor(calibration_ids) or calibration_ids.numel() == 0:
        raise ValueError(f"{method} needs calibration_ids (a non-empty [batch, tokens] tensor of token ids)")
    ids = calibration_ids if calibration_ids.dim() == 2 else calibration_ids.reshape(1, -1)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"calibration_ids must be integer token ids, got {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"calibration_ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    return ids.long()


class _FirstLayer(Exception):
    pass


@torch.no_grad()
def first_layer_batches(model, ids, batch_size):
    """What the model hands its first decoder layer for each batch of ids: [(hidden, *rope tables), ...]. Found by
    a pre-hook on layer 0 that stops the forward, so the model alone decides how it embeds and what it passes on."""
    batches = []

    def grab(module, args):
        batches.append(tuple(args))
        raise _FirstLayer

    handle = model.model.layers[0].register_forward_pre_hook(grab)
    try:
        for batch in ids.split(batch_size):
            try:
                model(batch)
            except _FirstLayer:
                pass
    finally:
        handle.remove()
    return batches


def decoder_layers(model, calibration_ids, batch_size=BATCH_SIZE, method="calibration", inputs_from="quantized",
                   fisher=False):
    """Yield a LayerCalibration for each decoder layer of `model`, in order. The caller captures and quantizes
    inside the loop body; the next layer then receives this layer's outputs, computed after the body
    (inputs_from="quantized": through the quantized layer) or before it (inputs_from="float"). inputs_from=None:
    a data-free method, whose layers come without calibration batches. fisher=True: the float model's output
    Fisher is measured first and handed to every layer (LayerCalibration.fisher)."""
    if inputs_from is None:
        for i, layer in enumerate(model.model.layers):
            yield LayerCalibration(layer, i, None, method)
        return
    if inputs_from not in ("quantized", "float"):
        raise ValueError(f"inputs_from must be 'quantized', 'float' or None, got {inputs_from!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ids = check_ids(calibration_ids, model.cfg.vocab_size, method)
    batches = first_layer_batches(model, ids, batch_size)
    grads = None
    if fisher:                                  # only GPTQ's Fisher-priced mix asks: sensitivity.py is its part
        from .sensitivity import output_fisher
        grads = output_fisher(model, batches)
    for i, layer in enumerate(model.model.layers):
        cal = LayerCalibration(layer, i, batches, method, fisher=grads)
        ahead = cal.outputs() if inputs_from == "float" else None
        yield cal
        batches = ahead if ahead is not None else cal.outputs()


def check_unquantized(model):
    """ValueError if `model` already holds quantized linears: a method replaces nn.Linear layers only, so it would
    pass over them and return a quantization_config for layers it never quantized."""
    done = quantized_linears(model)
    if done:
        kinds = ", ".join(sorted({type(m).__name__ for m in done.values()}))
        raise ValueError(f"the model is already quantized ({len(done)} layers: {kinds}); a method quantizes a "
                         "model's float linears: load it with its weights dequantized (engine.checkpoints.models."
                         "load_model(path, dense=True)) to start from them")


def whole_model(model):
    """The whole model (any module) as one data-free "layer": a data-free method's quantize_layer on it replaces every
    linear but lm_head, exactly as on each decoder layer in turn."""
    check_unquantized(model)
    return LayerCalibration(model, 0, None, prefix="")


def by_layer(model, method, calibration_ids=None, batch_size=BATCH_SIZE, **options):
    """Quantize `model` in place, one decoder layer at a time: method.quantize_layer(LayerCalibration, **options) on
    each (the same function the streaming converter, engine.checkpoints.streaming.quantize_checkpoint, calls on layers
    read from disk), the layers' inputs as method.calibration(options) says (a CheckpointMethod states it once).
    Returns the quantization_config quantize_layer describes its work with."""
    check_unquantized(model)
    method.fits(model.cfg, options)
    layers = decoder_layers(model, calibration_ids, batch_size, method.name, method.calibration(options),
                            method.output_fisher(options))
    bar = tqdm(layers, total=model.cfg.num_hidden_layers, desc=f"{method.name} layers", unit="layer", leave=False,
               disable=None)                        # shown on a terminal only
    configs, weights = [], []
    for layer in bar:
        configs.append(method.quantize_layer(layer, **options))
        weights.append(layer_weights(layer))
    return merged_config(configs, weights)


def layer_weights(layer):
    """How many weights a quantized LayerCalibration's quantized linears hold (what its config's bits_per_weight
    counts)."""
    return sum(m.in_features * m.out_features for m in layer.layer.modules() if isinstance(m, QuantLinear))


def merged_config(configs, weights):
    """One quantization_config from the layers' own: fields they agree on as they are; bits_per_weight (EntQuant's
    per-block rate search) as the weight-weighted mean; any other field that differs, and those that are always one
    value per layer (experts.PER_LAYER: the experts' token counts), as the list of per-layer values."""
    merged = dict(configs[0])
    for key in merged:
        values = [c[key] for c in configs]
        if any(v != values[0] for v in values) or key in experts.PER_LAYER:
            merged[key] = (sum(v * n for v, n in zip(values, weights)) / sum(weights)
                           if key == "bits_per_weight" else values)
    return merged
