"""The calibration walk's speed-up (numerics/layer_runs.py): a layer's runs resume where the last stopped, with
the same results as running the layer whole, and never from a kept tensor whose modules changed."""
import copy

import torch

from engine.formats.numerics import calibration
from engine.formats import gptq


def _attention_runs(monkeypatch):
    """A counter of the attention's runs (each call of _attend, one per batch and forward through a layer)."""
    from engine import qwen3
    runs, attend = [], qwen3.Attention._attend
    monkeypatch.setattr(qwen3.Attention, "_attend", lambda self, *a, **k: runs.append(1) or attend(self, *a, **k))
    return runs


def test_true_sequential_walk_computes_the_attention_once_and_the_same_bits(tiny_model, monkeypatch):
    """GPTQ's four steps and the layer's outputs resume where the step before stopped (the kept context of o_proj,
    then the residual after attention): the attention runs once per batch and layer, not four times, and every
    code, scale and output is the one that re-running the whole layer for each step gives."""
    ids = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(3))
    runs = _attention_runs(monkeypatch)
    resumed = copy.deepcopy(tiny_model)
    gptq.quantize(resumed, ids, batch_size=2, group_size=32)
    layers, batches = tiny_model.cfg.num_hidden_layers, 3
    assert len(runs) == layers * batches
    runs.clear()
    monkeypatch.setattr(calibration.LayerCalibration, "_run", lambda self, b, args, watched=(): self.layer(*args))
    whole = copy.deepcopy(tiny_model)
    gptq.quantize(whole, ids, batch_size=2, group_size=32)
    assert len(runs) == 4 * layers * batches
    a, b = resumed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_kept_part_is_not_used_once_a_module_it_came_from_changes(tiny_model):
    """A kept context or residual is dropped when a linear before it is replaced, and not used (nor trusted) when a
    weight before it is edited in place: each capture equals a fresh walk's."""
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(4))
    batches = calibration.first_layer_batches(tiny_model, ids, 2)
    layer = calibration.LayerCalibration(tiny_model.model.layers[0], 0, batches)

    def fresh_gram(names):
        return calibration.LayerCalibration(layer.layer, 0, batches).capture(names)[layer.prefix + names[0]].gram

    layer.capture(["mlp.down_proj"])                                 # runs the whole layer: keeps the residual
    assert all(kept.keys() == {"residual"} for kept in layer.runs.kept)
    assert torch.equal(layer.capture(["self_attn.q_proj"])["model.layers.0.self_attn.q_proj"].gram,
                       fresh_gram(["self_attn.q_proj"]))              # watched before the residual: not skipped
    with torch.no_grad():
        layer.layer.self_attn.o_proj.weight.mul_(1.5)                # in place: the residual is stale
    assert torch.equal(layer.capture(["mlp.gate_proj"])["model.layers.0.mlp.gate_proj"].gram,
                       fresh_gram(["mlp.gate_proj"]))
    layer.capture(["self_attn.o_proj"])                             # keeps o_proj's input, the context
    layer.replace(lambda name, linear: torch.nn.Linear(linear.in_features, linear.out_features),
                  names=["model.layers.0.self_attn.v_proj"])
    assert all("context" not in kept for kept in layer.runs.kept)
    assert torch.equal(layer.capture(["self_attn.o_proj"])["model.layers.0.self_attn.o_proj"].gram,
                       fresh_gram(["self_attn.o_proj"]))
    outputs = layer.outputs()
    assert all(kept == {} for kept in layer.runs.kept)
    with torch.no_grad():
        assert all(torch.equal(out[0], layer.layer(*args)) for out, args in zip(outputs, batches))
