"""EntQuant: the scale search, the block-by-block runtime from one shared buffer, rate control, the checkpoint and
its integrity (the block streams bound to the config and the scales), the Fisher-weighted loss and the error
feedback."""
import copy
import json

import numpy as np
import pytest
import torch

from helpers import rewrite_tensors
from engine.coding import rans
from engine.evaluation import kl_stats
from engine.layers import impl
from engine.formats import entropy as E
from engine.formats import entropy_feedback as F
from engine.formats import entropy_scales as S
from engine.formats.numerics.minifloats import round_e4m3
from engine.formats.numerics.sensitivity import fisher_importance, self_generated_ids
from engine.kernels import stream_decoders
from engine.qwen3 import Qwen3, Qwen3Config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_round_e4m3_equals_torch_cast():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[values.isfinite()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.randn(20000) * 10.0 ** torch.randint(-4, 3, (20000,)), grid, mids,
                   mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)), torch.tensor([470.0, -1e6])])
    assert torch.equal(round_e4m3(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_larger_lambda_gives_lower_entropy_and_no_negative_zero():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.02
    rates = []
    for lam in (1.0, 14.5, 58.0):
        s = S.entquant_scales(w, lam, max_iter=50)
        codes = E.encode_weight(w, s)
        assert not (codes == 0x80).any()
        assert torch.equal(s, s.half().float())                # what the checkpoint stores (float16) is what was used
        rates.append(rans.empirical_entropy_bits(codes) / codes.numel())
    assert rates[0] > rates[1] > rates[2]


def _one_block(layer):
    """A minimal model.model.layers[0] around one layer."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Sequential(layer)])
    return root


def test_int8_super_weights_are_kept_exact():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.02
    w[3, 5], w[10, 60] = 2.0, -3.0
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight.data = w
    layers, bits, count = E.compress_blocks({0: [("l", linear)]}, 14.5, "int8", super_weights=2)
    layer = layers["l"]
    assert sorted(layer.super_index.tolist()) == [3 * 64 + 5, 10 * 64 + 60]
    assert sorted(layer.super_value.tolist()) == [-3.0, 2.0] and count == w.numel()
    decoder = E.attach_decoder(_one_block(layer))
    assert layer.decoder is decoder and (layer.block_index, layer.buffer_offset) == (0, 0)
    assert layer.dequantize()[3, 5] == 2.0 and layer.dequantize()[10, 60] == -3.0
    assert layer.storage_bits() == bits
    layer.super_value[0] += 1.0                                   # the stream is bound to its super weights too
    with pytest.raises(ValueError, match="checksum mismatch"):
        E.attach_decoder(_one_block(layer))


def _reference_with(model, quantized):
    """The dense model with each quantized linear's dequantized weight: what the quantized model must compute."""
    for name, layer in quantized.items():
        model.get_submodule(name).weight.data = layer.dequantize()
    return model


def test_model_runs_block_by_block_from_one_shared_buffer(tiny_model, tiny_cfg, monkeypatch):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    dense = Qwen3(tiny_cfg).eval()
    dense.load_state_dict(tiny_model.state_dict())
    qcfg = E.quantize(tiny_model, lam=14.5, max_iter=30)
    quantized = {n: m for n, m in tiny_model.named_modules() if isinstance(m, E.EntQuantLinear)}
    assert len(quantized) == 14 and qcfg["quant_method"] == "entquant"
    decoder = tiny_model.entquant_decoder
    for i, layers in decoder.blocks.items():                    # each layer bound to its own slice of the buffer
        sizes = [m.in_features * m.out_features for m in layers]
        assert [m.buffer_offset for m in layers] == np.cumsum([0] + sizes[:-1]).tolist()
        assert all(m.decoder is decoder and m.block_index == i for m in layers)
    decoded = []
    original = decoder.decode
    decoder.decode = lambda i: (decoded.append(i), original(i))[1]
    with torch.no_grad():
        logits = tiny_model(ids)
    decoder.decode = original
    assert decoded[0] == 0 and decoded[-1] == 1 and set(decoded) == {0, 1}   # each block decoded as it runs
    assert decoder.buffer.numel() == max(decoder.sizes.values())
    with torch.no_grad():
        reference = _reference_with(dense, quantized)(ids)
        assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4)
        calls = []
        triton_decode = stream_decoders.rans_decode
        monkeypatch.setattr(stream_decoders, "rans_decode", lambda *a: (calls.append(1), triton_decode(*a))[1])
        with impl("engine"):                        # the Triton decoder, also without a GPU
            assert torch.allclose(tiny_model(ids), logits, atol=1e-4, rtol=1e-4)
        assert len(calls) == 2
    streams = sum(len(m.stream) for m in quantized.values())
    bits = 8 * streams + sum(16 * m.out_features for m in quantized.values())
    assert sum(m.storage_bits() for m in quantized.values()) == bits
    assert abs(bits / sum(m.in_features * m.out_features for m in quantized.values()) - qcfg["bits_per_weight"]) < 1e-9
    mem = E.resident_bytes(tiny_model)
    assert mem["resident"] == streams + sum(2 * m.out_features for m in quantized.values()) + decoder.buffer.numel()


def test_bpw_target_is_met_within_tolerance(tiny_model):
    qcfg = E.quantize(tiny_model, bpw=3.0, max_iter=30)
    layers = [m for m in tiny_model.modules() if isinstance(m, E.EntQuantLinear)]
    bpw = sum(m.storage_bits() for m in layers) / sum(m.in_features * m.out_features for m in layers)
    assert abs(bpw - 3.0) <= 0.05 and bpw == pytest.approx(qcfg["bits_per_weight"])


def test_lambda_search_brackets_and_bisects():
    measure = lambda lam: 6.0 - 0.9 * np.log(lam)                # log-linear, as the paper observes
    table = [(1.0, 4.0), (10.0, 2.0)]                             # a poor start: the search must still get there
    lam, bpw = E.lambda_for_bpw(2.1, measure, table, tol=0.01)
    assert abs(bpw - 2.1) <= 0.01 and abs(measure(lam) - bpw) < 1e-12
    with pytest.raises(ValueError, match="no lambda reached 2.1"):
        E.lambda_for_bpw(2.1, lambda lam: 5.0, table)


def test_bad_arguments_are_refused(tiny_model):
    with pytest.raises(ValueError, match="exactly one of lam"):
        E.quantize(tiny_model)
    with pytest.raises(ValueError, match="option fmt of method 'entquant' must be one of"):
        E.quantize(tiny_model, lam=10.0, fmt="float4")
    with pytest.raises(ValueError, match="sensitivity"):
        E.quantize(tiny_model, lam=10.0, sensitivity="hessian")
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="importance"):
        S.entquant_scales(w, 10.0, importance=torch.ones(3))
    with pytest.raises(ValueError, match="importance"):
        S.entquant_scales(w, 10.0, importance=torch.tensor([1.0, float("nan"), 1.0, 1.0]))


@pytest.fixture(scope="module")
def quantized_once():
    """One quantized model for the checkpoint tests (the conftest's tiny configuration): (model, qcfg, {name:
    checkpoint parts}). Tests copy what they change."""
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=2)).eval()
    qcfg = E.quantize(model, lam=58.0, max_iter=20)
    parts = {n: E.CHECKPOINT.write(m, qcfg) for n, m in model.named_modules() if isinstance(m, E.EntQuantLinear)}
    return model, qcfg, parts


@pytest.fixture
def written(quantized_once):
    """(qcfg, {name: parts}, a fresh model holding the quantized model's dense tensors, ids, the quantized logits)."""
    model, qcfg, parts = quantized_once
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    fresh = Qwen3(model.cfg).eval()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if k in fresh.state_dict()}, strict=False)
    return dict(qcfg), {n: dict(p) for n, p in parts.items()}, fresh, ids, logits


def _read_into(model, parts, qcfg):
    for name, p in parts.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, E.CHECKPOINT.read(p, qcfg))


def test_checkpoint_parts_round_trip(written):
    qcfg, parts, fresh, ids, logits = written
    assert all(set(p) == set(E.CHECKPOINT.parts(qcfg)) for p in parts.values())
    assert parts["model.layers.0.self_attn.q_proj"]["weight_stream"].numel() > 0
    assert parts["model.layers.0.mlp.down_proj"]["weight_stream"].numel() == 0
    _read_into(fresh, parts, qcfg)
    with pytest.raises(ValueError, match="not attached to a block decoder"):
        fresh(ids)
    E.CHECKPOINT.finish(fresh, qcfg)
    with torch.no_grad():
        assert torch.equal(fresh(ids), logits)


def _flip_byte(t, pos):
    t = t.clone()
    t.view(torch.uint8).view(-1)[pos] ^= 0x10
    return t


@pytest.mark.parametrize("change", ["stream byte", "truncated stream", "scale byte", "fmt", "prob_bits",
                                    "blocks swapped"])
def test_a_changed_stream_scale_or_config_is_refused_never_decoded(written, change):
    qcfg, parts, fresh, ids, logits = written
    head, down = "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    if change == "stream byte":
        parts[head]["weight_stream"] = _flip_byte(parts[head]["weight_stream"], 100)
    elif change == "truncated stream":
        parts[head]["weight_stream"] = parts[head]["weight_stream"][:-3]
    elif change == "scale byte":
        parts[down]["weight_log_scale"] = _flip_byte(parts[down]["weight_log_scale"], 0)
    elif change == "fmt":
        qcfg["fmt"] = "int8"                        # the same bytes read as Int8 codes: another model
    elif change == "prob_bits":
        qcfg["prob_bits"] -= 1                      # another table precision than the streams were coded at
    else:
        for name in [n for n in parts if n.startswith("model.layers.0.")]:
            other = name.replace("layers.0.", "layers.1.")
            parts[name], parts[other] = parts[other], parts[name]
    _read_into(fresh, parts, qcfg)
    with pytest.raises(ValueError, match="checksum mismatch|truncated|promises"):
        E.CHECKPOINT.finish(fresh, qcfg)


def test_weight_shape_must_be_two_positive_integers(written):
    qcfg, parts, _, _, _ = written
    p = parts["model.layers.0.mlp.down_proj"]
    for bad in (p["weight_shape"][:, None], p["weight_shape"].float(), -p["weight_shape"]):
        with pytest.raises(ValueError, match="weight_shape must be two positive integers"):
            E.CHECKPOINT.read({**p, "weight_shape": bad}, qcfg)


def test_save_load_through_registry_gives_identical_logits(tiny_model, tmp_path):
    from engine.formats import quantized_checkpoints as registry
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    registry.save_quantized(tiny_model, tmp_path / "ckpt", "entquant", lam=14.5, max_iter=20)
    with torch.no_grad():
        logits = tiny_model(ids)
        loaded = registry.load_quantized(tmp_path / "ckpt")            # its finish hook re-attaches the decoder
        assert torch.equal(loaded(ids), logits)
    assert {m.stream.numel() > 0 for m in loaded.modules() if isinstance(m, E.EntQuantLinear)} == {True, False}
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    edited = copy.deepcopy(config)
    edited["quantization_config"]["fmt"] = "int8"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="not the one its tensors were written with"):
        registry.load_quantized(tmp_path / "ckpt")                   # the writer's record of the config
    rewrite_tensors(tmp_path / "ckpt", lambda tensors: None)           # drop that record: the streams still know
    for field, value, match in [("fmt", "int8", "EntQuant block 0 .* checksum mismatch"),   # valid, but not these bits
                                ("fmt", "float4", "field 'fmt' must be one of"),
                                ("prob_bits", True, "field 'prob_bits' must be in 1..15")]:
        edited = copy.deepcopy(config)
        edited["quantization_config"][field] = value
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=match):
            registry.load_quantized(tmp_path / "ckpt")


# ---- the Fisher-weighted loss (our addition; the estimate lives in numerics/sensitivity.py) -----------------

def test_self_generated_ids_are_reproducible_and_in_vocabulary(tiny_model):
    a = self_generated_ids(tiny_model, samples=3, seq_len=10, seed=4)
    assert a.shape == (3, 10) and a.dtype == torch.long and int(a.min()) >= 0 and int(a.max()) < 256
    assert torch.equal(a, self_generated_ids(tiny_model, samples=3, seq_len=10, seed=4))
    assert not torch.equal(a, self_generated_ids(tiny_model, samples=3, seq_len=10, seed=5))


def _exact_row_fisher(model, names, ids, label_probs=None):
    """{name: [out]}: row means of sum over positions of E_y (d log p(y) / dW)^2 with every label y enumerated,
    y ~ the model's own p (the quantity the sampled, summed-then-squared estimate is unbiased for) or ~ label_probs."""
    weights = [model.get_submodule(n).weight for n in names]
    exact = [torch.zeros_like(w) for w in weights]
    logp = model(ids).log_softmax(-1)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            for y in range(logp.shape[-1]):
                grads = torch.autograd.grad(logp[b, t, y], weights, retain_graph=True)
                prob = logp[b, t, y].exp().detach() if label_probs is None else label_probs[y]
                for e, g in zip(exact, grads):
                    e += prob * g.square()
    return {n: e.mean(1) for n, e in zip(names, exact)}


def _normalized(model, row_fisher):
    k = sum((f * model.get_submodule(n).weight.detach().square().sum(1)).sum() for n, f in row_fisher.items())
    k = k / sum(model.get_submodule(n).weight.numel() for n in row_fisher)
    return {n: f / k for n, f in row_fisher.items()}


def _relative_error(got, want):
    return max(float((got[n] - want[n]).abs().sum() / want[n].sum()) for n in want)


def test_fisher_estimate_matches_the_exact_expectation():
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, num_hidden_layers=1))
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)                  # peaked predictions: the labels' law matters
    model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter must stay frozen
    names = ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"]
    ids = torch.tensor([[1, 5, 2], [7, 0, 3]])
    want = _normalized(model, _exact_row_fisher(model, names, ids))
    uniform = _normalized(model, _exact_row_fisher(model, names, ids, torch.full((8,), 1 / 8)))
    assert _relative_error(uniform, want) > 0.3             # labels not drawn from the model would be caught
    got = fisher_importance(model, names, ids, draws=300, seed=1)
    # 300 draws over 6 positions: seeds 1-8 give 0.05-0.12 (the estimate's spread); sampling the labels uniformly
    # instead gives 0.33-0.35, taking the model's top label 0.65.
    assert _relative_error(got, want) < 0.2
    assert not model.model.embed_tokens.weight.requires_grad and model.model.layers[0].mlp.up_proj.weight.requires_grad
    assert model.training                                   # eval mode while estimating, then restored


def test_fisher_importance_is_relative_to_the_whole_model(tiny_model):
    names = [n for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
    imp = fisher_importance(tiny_model, names, self_generated_ids(tiny_model, samples=4, seq_len=16))
    total = sum((imp[n] * tiny_model.get_submodule(n).weight.detach().square().sum(1)).sum() for n in names)
    assert total == pytest.approx(sum(tiny_model.get_submodule(n).weight.numel() for n in names), rel=1e-4)
    assert all(imp[n].shape == (tiny_model.get_submodule(n).out_features,) and (imp[n] > 0).all() for n in names)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for bad_names, bad_ids, kwargs, match in [
            (["model.layers.0.mlp"], ids, {}, "not linears"), ([], ids, {}, "non-empty"),
            ([names[0], names[0]], ids, {}, "distinct"), (names, ids.float(), {}, "integer"),
            (names, ids[:, :0], {}, "non-empty"), (names, ids, {"draws": 0}, "draws")]:
        with pytest.raises(ValueError, match=match):
            fisher_importance(tiny_model, bad_names, bad_ids, **kwargs)
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        fisher_importance(tiny_model, names, ids)


@pytest.mark.parametrize("option, bound", [(dict(sensitivity="fisher", fisher_samples=4), 0.8),      # seen 0.56x
                                           (dict(feedback="self", feedback_samples=8), 0.9),       # seen 0.81x
                                           (dict(feedback="calibration"), 0.9)])               # seen 0.82x
def test_self_generated_text_lowers_kl_at_the_same_rate(tiny_model, option, bound):
    """The Fisher-weighted loss and the error feedback, each against the paper's EntQuant (an untrained model);
    feedback="calibration" takes other self-generated text as its calibration."""
    ids = self_generated_ids(tiny_model, samples=4, seq_len=64, seed=5)       # not the options' own samples (seed 0)
    calibration = self_generated_ids(tiny_model, samples=8, seq_len=64, seed=7)
    with torch.no_grad():
        reference = tiny_model(ids)
    kl, bits = [], []
    for options in ({}, option):
        model = copy.deepcopy(tiny_model)
        qcfg = E.quantize(model, calibration, bpw=2.5, tol=0.05, max_iter=20, **options)
        with torch.no_grad():
            kl.append(kl_stats(reference, model(ids))["kl_nats"])
        bits.append(qcfg["bits_per_weight"])
    assert qcfg.get("sensitivity") == option.get("sensitivity") and qcfg["feedback"] == option.get("feedback")
    assert abs(bits[0] - 2.5) <= 0.05 and abs(bits[1] - 2.5) <= 0.05
    assert kl[1] < bound * kl[0], (kl, bits)


def _correlated_inputs(n=2048, d=48, seed=0):
    """Inputs [n, d] whose features are strongly correlated (what makes error feedback pay)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) * 0.3 + torch.eye(d)
    return torch.randn(n, d, generator=g) @ mix


@pytest.mark.parametrize("fmt", ["float8", "int8"])
def test_feedback_codes_lie_on_the_grid_and_lower_the_output_error(fmt):
    torch.manual_seed(0)
    x = _correlated_inputs()
    H = 2 * x.T @ x / len(x)
    w = torch.randn(32, 48) * 0.02
    s = S.entquant_scales(w, 58.0 if fmt == "float8" else 14.5, fmt, max_iter=30)
    w_hat = F.feedback_weight(w, s, H, fmt)
    codes = E.encode_weight(w_hat, s, fmt)
    assert torch.equal(E.decode_weight(codes, s, fmt), w_hat)           # stored exactly: nothing else is needed
    nearest = E.decode_weight(E.encode_weight(w, s, fmt), s, fmt)
    out_err = lambda v: ((v - w) @ x.T).square().mean().item()
    assert out_err(w_hat) < 0.8 * out_err(nearest)


def test_feedback_with_uncorrelated_inputs_is_nearest_rounding():
    torch.manual_seed(1)
    w = torch.randn(16, 40) * 0.02
    s = S.entquant_scales(w, 14.5, max_iter=30)
    H = torch.diag(torch.rand(40) + 0.5)                                 # no cross terms: nothing to feed back
    assert torch.equal(F.feedback_weight(w, s, H), E.decode_weight(E.encode_weight(w, s), s))


def test_feedback_keeps_super_weights_exact_and_counts_their_error_as_zero():
    torch.manual_seed(2)
    x = _correlated_inputs(d=32, seed=2)
    H = 2 * x.T @ x / len(x)
    w = torch.randn(16, 32) * 0.02
    w[3, 5] = 2.0
    keep = S.super_weight_mask(w, 1)
    s = S.entquant_scales(w, 14.5, "int8", keep=keep, max_iter=30)
    w_hat = F.feedback_weight(w, s, H, "int8", keep=keep)
    assert w_hat[3, 5] == 0                                              # the code beside the exact value
    # with the super weight restored, the error must be small: spreading 2.0 - 0 over row 3 would not be
    restored = w_hat.clone()
    restored[3, 5] = 2.0
    nearest = E.decode_weight(E.encode_weight(w, s, "int8", keep), s, "int8")
    nearest[3, 5] = 2.0
    out_err = lambda v: ((v - w) @ x.T).square().mean().item()
    assert out_err(restored) < 0.8 * out_err(nearest)


def test_feedback_damping_reaches_the_codes():
    torch.manual_seed(0)
    x = _correlated_inputs()
    H, w = 2 * x.T @ x / len(x), torch.randn(32, 48) * 0.02
    s = S.entquant_scales(w, 58.0, "float8", max_iter=30)
    nearest = E.decode_weight(E.encode_weight(w, s), s)
    moved = [(F.feedback_weight(w, s, H, damp=d) != nearest).float().mean() for d in (0.01, 1e4)]
    assert moved[0] > 0.05 and moved[1] < 0.2 * moved[0]           # a huge diagonal leaves nothing to feed back


def test_quantize_hands_feedback_damp_to_every_linear(tiny_model, monkeypatch):
    seen = []
    monkeypatch.setattr(E, "feedback_weight", lambda w, s, h, fmt, keep, damp: seen.append(damp) or w)
    qcfg = E.quantize(copy.deepcopy(tiny_model), lam=10.0, max_iter=2, feedback="self", feedback_samples=1,
                      feedback_damp=0.5)
    assert seen == [0.5] * 14 and qcfg["feedback_damp"] == 0.5                  # 7 linears in each of 2 blocks


def test_calibration_feedback_takes_each_blocks_inputs_through_the_quantized_blocks_before(tiny_model,
                                                                                          monkeypatch):
    ids = self_generated_ids(tiny_model, samples=4, seq_len=32, seed=7)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    float_h = F.self_hessians(tiny_model, names, ids)                      # both from the float model
    used, compress = {}, E.compress_blocks
    monkeypatch.setattr(E, "compress_blocks", lambda *a: used.update(a[7]) or compress(*a))
    E.quantize(copy.deepcopy(tiny_model), ids, lam=10.0, max_iter=2, feedback="calibration")
    assert torch.allclose(used[names[0]], float_h[names[0]], rtol=1e-4, atol=1e-6)    # block 0: float inputs
    assert not torch.allclose(used[names[1]], float_h[names[1]], rtol=1e-2)            # block 1: block 0 quantized


def test_feedback_arguments_are_refused(tiny_model):
    with pytest.raises(ValueError, match="option feedback of method 'entquant' must be one of"):
        E.quantize(tiny_model, lam=10.0, feedback="hessian")
    with pytest.raises(ValueError, match="needs calibration_ids"):
        E.quantize(tiny_model, lam=10.0, feedback="calibration")
    with pytest.raises(ValueError, match="does not combine"):
        E.quantize(tiny_model, torch.zeros(1, 4, dtype=torch.long), lam=10.0, feedback="calibration",
                   sensitivity="fisher")
    for damp in (-0.1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="feedback_damp"):
            E.quantize(tiny_model, lam=10.0, feedback="self", feedback_damp=damp)
    with pytest.raises(ValueError, match="do not fit"):
        F.feedback_weight(torch.randn(4, 8), torch.zeros(4), torch.eye(7))
    with pytest.raises(ValueError, match="not linears"):
        F.self_hessians(tiny_model, ["model.layers.0.mlp"], torch.zeros(1, 4, dtype=torch.long))


def test_self_hessians_are_the_inputs_second_moment(tiny_model):
    ids = self_generated_ids(tiny_model, samples=3, seq_len=16)
    name = "model.layers.1.mlp.down_proj"
    seen = []
    module = dict(tiny_model.named_modules())[name]
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, m.in_features)))
    with torch.no_grad():
        tiny_model(ids)
    handle.remove()
    x = torch.cat(seen)
    H = F.self_hessians(tiny_model, [name, "model.layers.0.self_attn.q_proj"], ids, batch_size=2)[name]
    torch.testing.assert_close(H, 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-6)
