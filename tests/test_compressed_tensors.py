"""compressed-tensors checkpoints: layouts pinned by hand, round trips into the engine's layers, bad input refused."""
import dataclasses

import pytest
import torch
from torch import nn

from engine.formats import compressed_tensors as ct
from engine.formats.fp8 import FP8BlockLinear
from engine.formats.mx import MXFP4Linear, NVFP4Linear
from engine.formats.numerics import affine
from engine.formats.numerics.affine import AffineQuantLinear
from engine.layers import impl, quantized_linears
from engine.qwen3 import Qwen3
from helpers import method_io

parts, read, write = method_io(ct.CHECKPOINT)


def _affine(out_f=36, in_f=200, group=64, sym=True, seed=0):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    return AffineQuantLinear.from_weight(w, 4, group, sym=sym)


def _linear(out_f, in_f, seed=0):
    lin = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)))
    return lin


def _round_trip(layer, config):
    return read(write(layer, config), config)


# ---- pack-quantized ---------------------------------------------------------------------------------------------

def test_pack_quantized_layout_by_hand():
    """Element j of a run of 8 sits in bits 4j..4j+3 as q + 8 (= our code), low bits first; scales [out, groups]."""
    codes = torch.tensor([[3, 15, 0, 7, 8, 1, 9, 12, 5, 5, 2, 14, 6, 0, 11, 4]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 0.25]])
    layer = AffineQuantLinear.from_codes(codes, scales, 8, 4, zeros=torch.full_like(scales, 8))
    t = write(layer, ct.quantization_config("pack-quantized", group_size=8))
    expected = [sum(int(c) << (4 * j) for j, c in enumerate(row)) for row in codes[0].reshape(2, 8).tolist()]
    expected = [e - 2 ** 32 if e >= 2 ** 31 else e for e in expected]
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].tolist() == [expected]
    assert t["weight_shape"].tolist() == [1, 16]
    assert t["weight_scale"].dtype == torch.float32 and t["weight_scale"].tolist() == [[0.5, 0.25]]
    assert "weight_zero_point" not in t


def test_asymmetric_zero_points_packed_along_outputs():
    """weight_zero_point [ceil(out/8), groups]: output o's zero (zp + 8 = our zero) in word o // 8, bits 4 (o % 8)."""
    layer = _affine(out_f=12, in_f=64, group=32, sym=False)
    t = write(layer, ct.quantization_config("pack-quantized", group_size=32, symmetric=False))
    zp = t["weight_zero_point"]
    assert zp.dtype == torch.int32 and tuple(zp.shape) == (2, 2)
    zeros = layer.zeros.long()
    for o in range(12):
        for g in range(2):
            assert (int(zp[o // 8, g]) >> (4 * (o % 8))) & 0xF == zeros[o, g]


@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized_round_trip_ragged(sym):
    layer = _affine(out_f=36, in_f=200, group=64, sym=sym)             # 200 % 8 != 0, 36 % 8 != 0, ragged group
    config = ct.quantization_config("pack-quantized", group_size=64, symmetric=sym)
    t = write(layer, config)
    assert tuple(t["weight_packed"].shape) == (36, 25) and tuple(t["weight_scale"].shape) == (36, 4)
    assert set(t) == set(parts(config))
    back = read(t, config)
    assert torch.equal(back.weight_codes, layer.weight_codes)
    assert torch.equal(back.dequantize(), layer.dequantize())


def test_symmetric_read_has_zero_point_eight():
    layer = _round_trip(_affine(), ct.quantization_config("pack-quantized", group_size=64))
    assert bool((layer.zeros == 8).all()) and torch.equal(layer.offsets, -8 * layer.scales)


def test_asymmetric_layer_refused_as_symmetric_and_symmetric_fits_asymmetric():
    with pytest.raises(ValueError, match="symmetric"):
        write(_affine(sym=False), ct.quantization_config("pack-quantized", group_size=64, symmetric=True))
    sym = _affine(sym=True)
    config = ct.quantization_config("pack-quantized", group_size=64, symmetric=False)
    t = write(sym, config)
    assert torch.equal(read(t, config).dequantize(), sym.dequantize())


def test_write_refuses_what_the_format_cannot_hold():
    config = ct.quantization_config("pack-quantized", group_size=64)
    layer = _affine()
    with pytest.raises(ValueError, match="group"):
        write(layer, ct.quantization_config("pack-quantized", group_size=32))
    permuted = AffineQuantLinear(layer.packed, layer.scales, None, 64, True, zeros=layer.zeros, in_features=200,
                                 perm=torch.randperm(200))
    with pytest.raises(ValueError, match="act-order"):
        write(permuted, config)
    fractional = AffineQuantLinear(layer.packed, layer.scales, layer.offsets + 0.3 * layer.scales, 64, True,
                                   in_features=200)
    with pytest.raises(ValueError, match="free offsets"):
        write(fractional, ct.quantization_config("pack-quantized", group_size=64, symmetric=False))
    with pytest.raises(ValueError, match="AffineQuantLinear"):
        write(FP8BlockLinear.from_linear(_linear(8, 64)), config)


def test_channel_strategy_and_float32_scales_read():
    """llm-compressor's channel strategy (one scale per row) and bf16 / f32 scales from real checkpoints."""
    layer = _affine(out_f=8, in_f=64, group=64)
    config = ct.quantization_config("pack-quantized", group_size=64)
    t = write(layer, config)
    config["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None)
    t["weight_scale"] = t["weight_scale"].to(torch.bfloat16)
    back = read(t, config)
    assert back.group_size == 64
    assert torch.equal(back.scales, t["weight_scale"].float())


# ---- FP8 block, NVFP4, MXFP4 ------------------------------------------------------------------------------------

def test_fp8_block_round_trip_ragged():
    layer = FP8BlockLinear.from_linear(_linear(130, 200))
    config = ct.quantization_config("float-quantized")
    t = write(layer, config)
    assert t["weight"].dtype == torch.float8_e4m3fn and tuple(t["weight_scale"].shape) == (2, 2)
    assert t["weight_scale"].dtype == torch.float32
    assert torch.equal(read(t, config).dequantize(), layer.dequantize())


def test_nvfp4_global_scale_is_the_reciprocal():
    layer = NVFP4Linear.from_linear(_linear(24, 64))
    config = ct.quantization_config("nvfp4-pack-quantized")
    t = write(layer, config)
    assert tuple(t["weight_packed"].shape) == (24, 32) and t["weight_scale"].dtype == torch.float8_e4m3fn
    amax = _linear(24, 64).weight.abs().max()
    assert t["weight_global_scale"].item() == pytest.approx(448 * 6 / amax.item(), rel=1e-6)
    back = read(t, config)
    assert torch.equal(back.packed, layer.packed) and torch.equal(back.block_scale.view(torch.uint8), layer.block_scale.view(torch.uint8))
    # t -> 1/t -> 1/(1/t) may move t by one float32 ulp
    torch.testing.assert_close(back.dequantize(), layer.dequantize(), rtol=2e-7, atol=0)


def test_nvfp4_w4a4_checkpoint_reads_weights_only():
    """llm-compressor's NVFP4 (W4A4) preset also stores input_global_scale: a part we take and leave unused."""
    layer = NVFP4Linear.from_linear(_linear(16, 32))
    config = ct.quantization_config("nvfp4-pack-quantized")
    config["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
        "symmetric": True}
    assert parts(config)[-1] == "input_global_scale"
    t = dict(write(layer, config), input_global_scale=torch.tensor([7.0]))
    assert torch.equal(read(t, config).packed, layer.packed)


def test_mxfp4_round_trip_and_layout():
    layer = MXFP4Linear.from_linear(_linear(24, 64))
    config = ct.quantization_config("mxfp4-pack-quantized")
    t = write(layer, config)
    assert tuple(t["weight_packed"].shape) == (24, 32) and tuple(t["weight_scale"].shape) == (24, 2)
    # element 2j in the low nibble of byte j (the interleaved order), as E2M1 codes
    codes = torch.stack([t["weight_packed"] & 0xF, t["weight_packed"] >> 4], -1).reshape(24, 64)
    assert torch.equal(codes, torch.stack([layer.blocks & 0xF, layer.blocks >> 4], -1).reshape(24, 64))
    assert torch.equal(read(t, config).dequantize(), layer.dequantize())


# ---- configs and bad input --------------------------------------------------------------------------------------

def test_config_matches_llm_compressor_presets():
    c = ct.quantization_config("pack-quantized", group_size=128)
    g = c["config_groups"]["group_0"]
    assert c["quant_method"] == "compressed-tensors" and c["quantization_status"] == "compressed"
    assert g["targets"] == ["Linear"] and c["ignore"] == ["lm_head"]
    assert g["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                            "group_size": 128, "dynamic": False}
    assert parts(ct.quantization_config("nvfp4-pack-quantized")) == (
        "weight_packed", "weight_scale", "weight_global_scale")


def test_bad_configs_and_tensors_raise_value_error():
    good = ct.quantization_config("pack-quantized", group_size=64)
    t = write(_affine(), good)
    bad = []
    bad.append(dict(good, quant_method="gptq"))
    bad.append(dict(good, quantization_status="frozen"))
    bad.append(dict(good, config_groups={}))
    mixed = ct.quantization_config("pack-quantized", group_size=64)
    mixed["config_groups"]["group_1"] = ct.quantization_config("float-quantized")["config_groups"]["group_0"]
    bad.append(mixed)
    static = ct.quantization_config("pack-quantized", group_size=64)
    static["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": False}
    bad.append(static)
    three = ct.quantization_config("pack-quantized", group_size=64)
    three["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    bad.append(three)
    unknown = ct.quantization_config("pack-quantized", group_size=64)
    unknown["config_groups"]["group_0"]["format"] = "marlin-24"
    bad.append(unknown)
    reasons = ["quant_method must be 'compressed-tensors'", "quantization_status is 'frozen'", "no config_groups",
               "mixed precision", "static activation", "num_bits. must be 1, 2, 4 or 8, got 3", "format 'marlin-24'"]
    for config, reason in zip(bad, reasons, strict=True):
        with pytest.raises(ValueError, match=reason):
            read(t, config)
    for name, value, reason in [("weight_packed", t["weight_packed"][:, :-1], "weight_packed is torch.int32 \\(36, 24\\)"),
                                ("weight_scale", t["weight_scale"][:, :2], "weight_scale is"),
                                ("weight_shape", torch.tensor([36, 999]), "expected torch.int32 \\(36, 125\\)"),
                                ("weight_packed", t["weight_packed"].float(), "weight_packed is torch.float32")]:
        with pytest.raises(ValueError, match=reason):
            read(dict(t, **{name: value}), good)
    with pytest.raises(ValueError, match="format"):
        ct.quantization_config("int-quantized")


def _changed(change):
    config = ct.quantization_config("pack-quantized", group_size=64)
    change(config, config["config_groups"]["group_0"])
    return config


@pytest.mark.parametrize("change, reason", [
    (lambda c, g: g.update(input_activations=True), "input_activations an object or null, got 'pack-quantized' and True"),
    (lambda c, g: g.update(format=["pack-quantized"]), r"format must be a string .* got \['pack-quantized'\]"),
    (lambda c, g: g["weights"].update(num_bits=True), "field 'num_bits' must be .*, got True"),
    (lambda c, g: g["weights"].update(group_size=True), "field 'group_size' must be a positive int .*, got True"),
    (lambda c, g: g["weights"].update(symmetric="yes"), "field 'symmetric' must be bool"),
    (lambda c, g: c.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme=.*KV-cache quantization are not"),
    (lambda c, g: c.update(transform_config={"config_groups": {}}), "transform_config=.*rotation transforms"),
    (lambda c, g: c.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config=.*sparse weights"),
])
def test_fields_of_the_wrong_type_or_that_change_the_model_are_refused(change, reason):
    with pytest.raises(ValueError, match=reason):
        ct.validate(_changed(change))


def test_scales_and_weight_shape_of_the_wrong_kind_are_refused():
    good = ct.quantization_config("pack-quantized", group_size=64)
    t = write(_affine(), good)
    for name, value, reason in [("weight_scale", t["weight_scale"].to(torch.float8_e4m3fn), "16- or 32-bit float"),
                                ("weight_scale", t["weight_scale"].long(), "16- or 32-bit float"),
                                ("weight_shape", t["weight_shape"][:, None], "two positive integers"),
                                ("weight_shape", t["weight_shape"].float(), "two positive integers")]:
        with pytest.raises(ValueError, match=reason):
            read(dict(t, **{name: value}), good)


# ---- whole models -----------------------------------------------------------------------------------------------

class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = _linear(64, 32, 1), _linear(32, 64, 2)
        self.lm_head = _linear(16, 32, 3)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("fmt,cls", [("pack-quantized", AffineQuantLinear), ("float-quantized", FP8BlockLinear),
                                     ("nvfp4-pack-quantized", NVFP4Linear), ("mxfp4-pack-quantized", MXFP4Linear)])
def test_quantize_replaces_linears_and_describes_itself(fmt, cls):
    model = _Tiny()
    config = ct.quantize(model, None, format=fmt, group_size=32)
    assert isinstance(model.up, cls) and isinstance(model.down, cls) and type(model.lm_head) is nn.Linear
    assert config == ct.config_for_model(model)
    for layer in (model.up, model.down):                               # NVFP4: see the reciprocal test
        torch.testing.assert_close(_round_trip(layer, config).dequantize(), layer.dequantize(), rtol=2e-7, atol=0)


def test_config_for_model_sees_asymmetry():
    model = _Tiny()
    ct.quantize(model, None, format="pack-quantized", group_size=32, symmetric=False)
    assert ct.config_for_model(model)["config_groups"]["group_0"]["weights"]["symmetric"] is False


@pytest.fixture
def registered(monkeypatch):
    registry = pytest.importorskip("engine.formats.quantized_checkpoints")
    monkeypatch.setitem(registry.METHODS, "compressed-tensors", ct.CHECKPOINT)
    return registry


@pytest.mark.parametrize("fmt", ct.CT_FORMATS)
def test_qwen3_checkpoint_round_trip_and_kernels(tmp_path, registered, tiny_cfg, fmt):
    torch.manual_seed(0)
    tiny_model = Qwen3(dataclasses.replace(tiny_cfg, num_hidden_layers=1)).eval()    # one layer: kernels are slow
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    registered.save_quantized(tiny_model, tmp_path, "compressed-tensors", format=fmt, group_size=32)
    loaded = registered.load_quantized(tmp_path)
    for name, layer in quantized_linears(tiny_model).items():
        torch.testing.assert_close(loaded.get_submodule(name).dequantize(), layer.dequantize(), rtol=2e-7, atol=0)
    with torch.no_grad():
        reference = tiny_model(ids)
        torch.testing.assert_close(loaded(ids), reference, rtol=1e-5, atol=1e-5)
        with impl("engine"):                              # the loaded layers run their kernels
            torch.testing.assert_close(loaded(ids), reference, rtol=1e-4, atol=1e-4)


def test_already_quantized_rtn_model_saved_as_asymmetric(tmp_path, registered, tiny_model):
    affine.quantize(tiny_model, bits=4, group_size=32)                                      # asymmetric: zero points per group
    config = ct.config_for_model(tiny_model)
    assert config["config_groups"]["group_0"]["weights"]["symmetric"] is False
    registered.save_quantized(tiny_model, tmp_path, "compressed-tensors", quantization_config=config)
    loaded = registered.load_quantized(tmp_path)
    for name, layer in quantized_linears(tiny_model).items():
        assert torch.equal(loaded.get_submodule(name).dequantize(), layer.dequantize())
