"""Loading and writing checkpoints (chapter 39): save_quantized and load_quantized for GPTQ, AWQ and FP8 in the
real tools' layouts, marked @book (`pytest tests/test_ch39_quantized_checkpoints.py --yours FILE` runs them on FILE's
functions); then the engine's registry of every method, the streaming build, and a clear error for every malformed
input."""
import copy
import json
import math

import pytest
import torch
from safetensors import safe_open

from engine.formats import quantized_checkpoints as qc
from engine.layers import QuantLinear
from engine.formats.quantized_checkpoints import METHODS, load_quantized, save_quantized
from engine.safetensors_io import snapshot_tensors
from helpers import rewrite_tensors, same

book = pytest.mark.book
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


# ---- the chapter's checks ---------------------------------------------------------------------------------------

def _saved(model, directory, method):
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    qc.save_quantized(model, directory, method, ids, *([32] if method != "fp8" else []))
    with safe_open(directory / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return json.loads((directory / "config.json").read_text()), tensors


@book("save_quantized", "load_quantized")
@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_written_checkpoint_loads_back_close_to_the_original_model(tiny_model, tmp_path, method):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        reference = torch.log_softmax(tiny_model(ids), -1)
    _, stored = _saved(copy.deepcopy(tiny_model), tmp_path, method)
    loaded = qc.load_quantized(tmp_path, "cpu", torch.float32)
    dense = [name for name in LINEARS if isinstance(loaded.get_submodule(f"model.layers.0.{name}"), torch.nn.Linear)]
    assert not dense, f"load_quantized left model.layers.0.{dense[0]} an nn.Linear: build its quantized layer"
    for name, p in loaded.named_parameters():                  # the embeddings and norms: as the checkpoint holds them
        if name in stored:
            same(p.detach(), stored[name].float(), f"the loaded {name}", "the checkpoint's tensor of that name")
    with torch.no_grad():
        logp = torch.log_softmax(loaded(ids), -1)
    kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
    assert kl > 0, "the loaded model computes the float model's outputs exactly: are its weights the quantized ones?"
    assert kl < (1e-3 if method == "fp8" else 3e-2), (                    # quantized: close, not equal
        f"the loaded model's KL from the float one is {kl:.3g} nats per token (a correct {method} round trip: below "
        f"{1e-3 if method == 'fp8' else 3e-2:g}): does each layer decode what the writer stored?")


@book("save_quantized")
@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_the_checkpoint_holds_the_real_tools_tensors(tiny_model, tmp_path, method):
    """The layouts of AutoGPTQ, AutoAWQ and the FP8 block checkpoints, as config.json and each linear's tensors."""
    raw, tensors = _saved(copy.deepcopy(tiny_model), tmp_path, method)
    q = raw["quantization_config"]
    out_f, in_f = tiny_model.model.layers[0].mlp.up_proj.weight.shape
    i32, groups = torch.int32, in_f // 32
    config, layout = {
        "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},    # the book's natural order
                 {"qweight": (i32, (in_f // 8, out_f)), "qzeros": (i32, (groups, out_f // 8)),
                  "scales": (torch.float16, (groups, out_f)), "g_idx": (i32, (in_f,))}),
        "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                {"qweight": (i32, (in_f, out_f // 8)), "qzeros": (i32, (groups, out_f // 8)),
                 "scales": (torch.float16, (groups, out_f))}),
        "fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]},
                {"weight": (torch.float8_e4m3fn, (out_f, in_f)),
                 "weight_scale_inv": (torch.float32, (-(-out_f // 128), -(-in_f // 128)))})}[method]
    wrong = {key: q.get(key) for key, value in config.items() if q.get(key) != value}
    assert not wrong, f"quantization_config has {wrong}; the real tools read {config}"
    parts = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith("model.layers.0.mlp.up_proj.")}
    for part, (dtype, shape) in layout.items():
        got = parts.get(part)
        assert got is not None and got.dtype == dtype and tuple(got.shape) == shape, (
            f"model.layers.0.mlp.up_proj.{part} is "
            f"{'missing' if got is None else f'{got.dtype} {tuple(got.shape)}'}; {method}'s layout for a [{out_f}, "
            f"{in_f}] linear: " + ", ".join(f"{name} {d} {s}" for name, (d, s) in layout.items()))
    if method == "gptq":
        same(parts["g_idx"].long(), torch.arange(in_f) // 32, "g_idx", "the natural order's groups, i // 32")
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(tensors)           # the rest as usual
    assert not missing, f"the checkpoint lacks {sorted(missing)}: every tensor that is not quantized is stored too"


def test_the_writer_refuses_an_option_the_method_does_not_take(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"method 'fp8' takes no option 'group_size' \(the book's group_size is "):
        save_quantized(copy.deepcopy(tiny_model), tmp_path / "x", "fp8", None, 32)
    with pytest.raises(ValueError, match="method 'awq' takes no option 'act_order_static'"):
        save_quantized(copy.deepcopy(tiny_model), tmp_path / "x", "awq", None, act_order_static=True)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,match", [((32, True), r"calibration_ids \(the 4th argument\) must be token ids"),
                                        ((None, True), r"group_size \(the 5th argument\) must be an int"),
                                        ((None, 32, "yes"), r"act_order \(the 6th argument\) is True or False")])
def test_book_positions_that_do_not_fit_are_refused(tiny_model, tmp_path, args, match):
    """save_quantized(model, dir, "gptq", 32, True) meant group 32 and act-order under another signature: here the
    book's positions are (calibration_ids, group_size, act_order), so it is refused, not written as something else."""
    with pytest.raises(ValueError, match=match):
        save_quantized(copy.deepcopy(tiny_model), tmp_path / "x", "gptq", *args)
    assert not (tmp_path / "x").exists()


@book("load_quantized")
def test_the_loader_refuses_what_it_cannot_read(fp8_checkpoint):
    _edit_config(fp8_checkpoint, lambda raw: raw["quantization_config"].update(quant_method="bitnet"))
    with pytest.raises(ValueError, match="(?i)unsupported quant_method 'bitnet'"):
        qc.load_quantized(fp8_checkpoint)


@book("load_quantized")
def test_the_loader_refuses_an_unexpected_tensor(tiny_model, tmp_path):
    _saved(copy.deepcopy(tiny_model), tmp_path, "fp8")
    rewrite_tensors(tmp_path, lambda t: t.update({"model.layers.0.mlp.surprise": torch.zeros(3)}))
    with pytest.raises(ValueError, match="(?i)unexpected tensor model.layers.0.mlp.surprise"):
        qc.load_quantized(tmp_path)


# ---- the engine's ---------------------------------------------------------------------------------------------------


@pytest.fixture
def fp8_model(tiny_model):
    return copy.deepcopy(tiny_model)           # save_quantized quantizes the model it is given in place


@pytest.fixture
def fp8_checkpoint(fp8_model, tmp_path):
    save_quantized(fp8_model, tmp_path / "fp8", "fp8")
    return tmp_path / "fp8"


def _edit_config(directory, change):
    raw = json.loads((directory / "config.json").read_text())
    change(raw)
    (directory / "config.json").write_text(json.dumps(raw))


# Cheap options for every registered method; a method added to the registry must be added here too.
CHEAP_OPTIONS = {"gptq": dict(group_size=32), "awq": dict(group_size=32), "fp8": dict(block=32),
                 "compressed-tensors": dict(group_size=32), "trellis": dict(L=6, K=2, group=64),
                 "entquant": dict(lam=14.5, max_iter=5), "lattice": dict(bps=3.0),
                 "bitsandbytes": dict(group_size=32)}


def test_the_registry_holds_every_method():
    assert set(METHODS) == set(CHEAP_OPTIONS)


@pytest.mark.parametrize("name", sorted(CHEAP_OPTIONS))
def test_every_method_writes_its_quant_method_and_reloads_identically(name, tiny_model, tmp_path):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    qcfg = save_quantized(tiny_model, tmp_path / name, name, calibration_ids=ids, **CHEAP_OPTIONS[name])
    assert qcfg["quant_method"] == name
    loaded = load_quantized(tmp_path / name)
    assert json.loads((tmp_path / name / "config.json").read_text())["quantization_config"] == qcfg
    with torch.no_grad():
        assert torch.equal(loaded(ids), tiny_model(ids))


@pytest.mark.parametrize("name", sorted(CHEAP_OPTIONS))
def test_every_method_refuses_a_model_already_quantized(name, tiny_model):
    """red before: a method replaces nn.Linear layers only, so on a model loaded from a GGUF file or a checkpoint
    it quantized nothing and returned a config as if it had"""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    METHODS["fp8"].quantize(tiny_model, None, **CHEAP_OPTIONS["fp8"])
    before = {n: type(m) for n, m in tiny_model.named_modules()}
    layers = 7 * tiny_model.cfg.num_hidden_layers
    with pytest.raises(ValueError, match=rf"the model is already quantized \({layers} layers: FP8BlockLinear\); a "
                                         "method quantizes a model's float linears"):
        METHODS[name].quantize(tiny_model, ids, **CHEAP_OPTIONS[name])
    assert {n: type(m) for n, m in tiny_model.named_modules()} == before


def _extremes(t):
    """What a corrupt or hostile file can hold in tensor t: NaN, infinities and the dtype's largest numbers in a
    floating part; all-ones bytes (a float8's NaN, the largest codes) in the others."""
    if t.dtype.is_floating_point and t.element_size() > 1:
        return [math.nan, math.inf, torch.finfo(t.dtype).max, -torch.finfo(t.dtype).max]
    return [0x7F, 0xFF]


def _with(t, value):
    t = t.clone()
    if t.dtype.is_floating_point and t.element_size() > 1:
        t.view(-1)[:4] = value
    else:
        t.view(torch.uint8).view(-1)[:4] = value
    return t


CT_FORMATS = ("float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


@pytest.mark.parametrize("name,options", [*sorted(CHEAP_OPTIONS.items()),
                                          *(("compressed-tensors", dict(format=f)) for f in CT_FORMATS)])
def test_no_load_returns_a_model_with_non_finite_weights(name, options, tiny_model, tmp_path):
    """Every part of a quantized linear set to NaN, infinity, the largest number or all-ones bytes (digests
    rewritten, as a tool that wrote such values would): the load is refused, or every weight the model computes
    with (each quantized layer's decoded weight included) is finite."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    save_quantized(copy.deepcopy(tiny_model), tmp_path, name, calibration_ids=ids, **options)
    pristine = dict(snapshot_tensors(tmp_path))
    parts = [n for n in pristine if n.startswith("model.layers.0.mlp.down_proj.")]
    refused = 0
    for part in parts:
        for value in _extremes(pristine[part]):
            rewrite_tensors(tmp_path, lambda tensors: tensors.update(pristine, **{part: _with(pristine[part], value)}))
            try:
                model = load_quantized(tmp_path)
            except ValueError:
                refused += 1
                continue
            decoded = [m.dequantize() for m in model.modules() if isinstance(m, QuantLinear)]
            assert all(torch.isfinite(t).all() for t in [*model.parameters(), *decoded]), (part, value)
    assert parts and refused > 0


def test_save_then_load_gives_identical_logits(tiny_model, fp8_model, fp8_checkpoint):
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loaded = load_quantized(fp8_checkpoint)(ids)
        assert torch.equal(loaded, fp8_model(ids))
        assert not torch.equal(loaded, tiny_model(ids))


def test_unknown_method_is_refused_when_saving(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="unknown method 'bitnet'"):
        save_quantized(tiny_model, tmp_path / "x", "bitnet")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["bitnet", ["fp8"]])
def test_unsupported_quant_method(fp8_checkpoint, name):
    _edit_config(fp8_checkpoint, lambda raw: raw["quantization_config"].update(quant_method=name))
    with pytest.raises(ValueError, match=f"unsupported quant_method {name!r}".replace("[", r"\[")):
        load_quantized(fp8_checkpoint)


def test_dense_checkpoint_is_not_a_quantized_one(fp8_checkpoint):
    _edit_config(fp8_checkpoint, lambda raw: raw.pop("quantization_config"))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quantized(fp8_checkpoint)


def test_incomplete_layer(fp8_checkpoint):
    rewrite_tensors(fp8_checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match="incomplete quantized layer.*mlp.up_proj"):
        load_quantized(fp8_checkpoint)


def test_unexpected_tensor(fp8_checkpoint):
    rewrite_tensors(fp8_checkpoint, lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.mlp.up_proj.qweight"):
        load_quantized(fp8_checkpoint)


def test_layer_shape_that_does_not_match_the_config(fp8_checkpoint, tiny_model, tmp_path):
    _edit_config(fp8_checkpoint, lambda raw: raw.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight: checkpoint shape \(\d+, 128\) != model shape"):
        load_quantized(fp8_checkpoint)                      # seen in the header, before anything is allocated
    save_quantized(tiny_model, tmp_path / "gptq", "gptq", torch.randint(0, 256, (2, 16)), group_size=32)
    _edit_config(tmp_path / "gptq", lambda raw: raw.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj: checkpoint layer is \d+ x \d+, the config says"):
        load_quantized(tmp_path / "gptq")                   # packed parts: seen when the layer is built


def _as_if_written_elsewhere(directory):
    """Rewrite the tensors without the engine's record of the quantization_config (as another tool's file)."""
    rewrite_tensors(directory, lambda tensors: None)


def test_an_edited_quantization_config_is_refused(fp8_checkpoint):
    _edit_config(fp8_checkpoint, lambda raw: raw["quantization_config"].update(activation_scheme="dynamic", x=1))
    with pytest.raises(ValueError, match="not the one its tensors were written with"):
        load_quantized(fp8_checkpoint)


def test_unsupported_bits_and_block_size(tiny_model, tmp_path, fp8_checkpoint):
    _edit_config(fp8_checkpoint, lambda raw: raw["quantization_config"].update(weight_block_size=[64, 32]))
    _as_if_written_elsewhere(fp8_checkpoint)
    with pytest.raises(ValueError, match="weight_block_size"):
        load_quantized(fp8_checkpoint)
    calibration = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    save_quantized(tiny_model, tmp_path / "gptq", "gptq", calibration, group_size=32)
    _edit_config(tmp_path / "gptq", lambda raw: raw["quantization_config"].update(bits=3))
    _as_if_written_elsewhere(tmp_path / "gptq")
    with pytest.raises(ValueError, match="bits"):
        load_quantized(tmp_path / "gptq")


def test_stray_bias_on_a_quantized_linear_is_refused(fp8_checkpoint):
    rewrite_tensors(fp8_checkpoint, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.self_attn.q_proj.bias"):
        load_quantized(fp8_checkpoint)


def test_casting_a_quantized_model_keeps_its_stored_codes(fp8_checkpoint):
    model = load_quantized(fp8_checkpoint)
    layer = model.model.layers[0].mlp.up_proj
    weight, scale = layer.weight.clone(), layer.weight_scale_inv.clone()
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight_scale_inv, scale)
    assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8))
    assert model(torch.zeros(1, 3, dtype=torch.long)).dtype == torch.bfloat16
