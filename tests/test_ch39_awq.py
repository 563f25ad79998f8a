"""AWQ (chapter 39, "AWQ"): the scale search (never worse than RTN, >= 2x better with outlier channels), apply_awq,
the AutoAWQ GEMM layout (output 1's code in bits 16-19); these are marked @book, and `pytest tests/test_ch39_awq.py
--yours FILE` runs them on FILE's functions. Then the engine's own: the exact Gram-matrix error, the scaling pairs
with the GQA skip, clipping, save -> load."""
import copy

import pytest
import torch

from engine.formats import quantized_checkpoints as registry
from engine.formats.numerics import affine, calibration, input_stats
from engine.formats import awq
from helpers import rtn_baseline, same


pytestmark = pytest.mark.usefixtures("one_thread")
book = pytest.mark.book


def outlier_inputs(tokens, n, seed, outliers=4, factor=30.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g)
    x[:, torch.randperm(n, generator=g)[:outliers]] *= factor
    return x


def output_error(x, w_hat, w):
    return (x @ (w_hat - w).T).pow(2).mean().item()


@book("pack_awq", "unpack_awq")
def test_pin_output_one_in_bits_16_to_19():
    codes = torch.zeros(2, 8, dtype=torch.uint8)
    codes[0, 1] = 0xF
    codes[1] = torch.arange(8)
    packed = awq.pack_awq(codes, None)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    for row, want in ((0, 0xF << 16), (1, 0x75316420)):       # nibbles hold columns 0 2 4 6 1 3 5 7
        got = packed[row, 0].item() & 0xFFFFFFFF
        assert got == want, (f"pack_awq packs columns {codes[row].tolist()} as 0x{got:08X}; AutoAWQ's order 0 2 4 6 1 "
                             f"3 5 7 (nibble j holds column AWQ_ORDER[j]) gives 0x{want:08X}")
    same(awq.unpack_awq(packed), codes, "unpack_awq(pack_awq(codes))", "the codes packed")


def test_gram_error_equals_direct_error():
    """The search's error, from G = X^T X / n, is the book's mean squared output error over all tokens."""
    x = outlier_inputs(300, 64, 0)
    w = torch.randn(24, 64) * 0.1
    s = x.abs().mean(0) ** 0.5
    s = s / (s.max() * s.min()).sqrt()
    direct = ((x / s) @ affine.fake_quantize(w * s, 4, 32).T - x @ w.T).pow(2).mean().item()
    stats = input_stats.InputStats(64)
    for batch in x.split(77):                                  # streamed, never all held
        stats.add(batch)
    assert awq.scaled_error(w, s, stats.gram, 4, 32) == pytest.approx(direct, rel=1e-4)


@book("search_scale")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_beats_rtn_2x_with_outlier_channels(seed):
    torch.manual_seed(seed)
    x = outlier_inputs(1024, 128, seed)
    w = torch.randn(64, 128) * 0.05
    s, alpha = awq.search_scale([w], x, 4, 32)
    awq_err = output_error(x, affine.fake_quantize(w * s, 4, 32) / s, w)
    rtn_err = output_error(x, affine.fake_quantize(w, 4, 32), w)
    assert alpha > 0, (
        "search_scale chose alpha 0 (s = 1, no scaling) though 4 inputs are 30x larger: is s the mean |x| of each "
        "input channel (x.abs().mean(0)) to the power alpha, and each candidate's error that of (x / s) @ Q(w * s)^T "
        "against x @ w^T?")
    assert awq_err * 2 <= rtn_err, (
        f"the chosen s (alpha {alpha}) lowers the output error only {rtn_err / awq_err:.2f}x below round-to-nearest's "
        "(a correct search: 2x or more here)")


@book("search_scale")
def test_search_never_worse_than_rtn_without_outliers():
    torch.manual_seed(4)
    x = torch.randn(512, 64)
    ws = [torch.randn(32, 64) * 0.05, torch.randn(16, 64) * 0.05]
    s, _ = awq.search_scale(ws, x, 4, 32)
    for_s = sum(output_error(x, affine.fake_quantize(w * s, 4, 32) / s, w) for w in ws)
    for_rtn = sum(output_error(x, affine.fake_quantize(w, 4, 32), w) for w in ws)
    assert for_s <= for_rtn * (1 + 1e-5), (
        f"search_scale's s gives an output error {for_s / for_rtn:.3f}x that of s = 1: alpha = 0 (s = 1) is a "
        "candidate, so the lowest error found can never be worse than it (is every candidate's error summed over "
        "the linears that share the input, and the lowest kept?)")


@book("apply_awq")
def test_apply_awq_quantizes_every_linear_and_protects_outlier_channels(tiny_model):
    """A model whose norms feed a few channels 20x larger (the outliers real LLMs grow): apply_awq replaces every
    linear by the AffineQuantLinear it returns, and its output is closer to the float model's than round-to-nearest's
    at the same bits."""
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(norm.weight.numel())[:3]] *= 20
    ids = torch.randint(0, 256, (4, 48))
    with torch.no_grad():
        reference = model(ids)
        rtn = copy.deepcopy(model)
        for name, linear in list(rtn.named_modules()):
            if isinstance(linear, torch.nn.Linear) and name != "lm_head":
                parent, _, child = name.rpartition(".")
                setattr(rtn.get_submodule(parent), child, affine.AffineQuantLinear.from_weight(linear.weight, 4, 32))
        rtn_error = (rtn(ids) - reference).pow(2).mean().item()
        replaced = awq.apply_awq(model, ids, 4, 32)
        assert len(replaced) == 7 * len(model.model.layers)
        assert all(model.get_submodule(name) is layer for name, layer in replaced.items())
        assert all(isinstance(layer, affine.AffineQuantLinear) for layer in replaced.values())
        error = (model(ids) - reference).pow(2).mean().item()
        hint = ("worse than round-to-nearest: does every scaling leave the float model's function unchanged, the "
                "norm's weight (or the previous linear's rows) divided by s, the linears' input columns multiplied "
                "by s?" if error > rtn_error else
                "no better than round-to-nearest: are the scales searched on each linear's own captured inputs, "
                "with s from their mean |x| per channel?")
        assert error < 0.8 * rtn_error, (f"apply_awq's model output error is {error / rtn_error:.2f}x that of "
                                         f"round-to-nearest at the same bits (a correct AWQ: below 0.8x): {hint}")


@book("to_checkpoint", "from_checkpoint")
def test_to_checkpoint_writes_autoawq_gemm_tensors_that_read_back_exactly():
    """qweight int32 [in, out / 8], qzeros int32 [groups, out / 8], scales f16 [groups, out]."""
    torch.manual_seed(6)
    layer = affine.AffineQuantLinear.from_weight(torch.randn(32, 128) * 0.05, 4, 64)
    t = awq.to_checkpoint(layer)
    assert t["qweight"].dtype == t["qzeros"].dtype == torch.int32 and t["scales"].dtype == torch.float16
    assert t["qweight"].shape == (128, 4) and t["qzeros"].shape == (2, 4) and t["scales"].shape == (2, 32)
    back = awq.from_checkpoint(t["qweight"], t["qzeros"], t["scales"], 64, None, torch.float32)
    same(back.dequantize(), layer.dequantize(), "from_checkpoint(to_checkpoint(layer))'s weight",
         "the layer's own (q - zero) * scale, offset = -zero * scale,")


def test_checkpoint_round_trip_and_refusals():
    torch.manual_seed(5)
    w = torch.randn(16, 64)
    layer = affine.AffineQuantLinear.from_weight(w, 4, 32)
    t = awq.to_checkpoint(layer)
    assert t["qweight"].shape == (64, 2) and t["qzeros"].shape == (2, 2) and t["scales"].shape == (2, 16)
    assert t["scales"].dtype == torch.float16
    back = awq.from_checkpoint(t["qweight"], t["qzeros"], t["scales"], 32)
    assert torch.equal(back.dequantize(), layer.dequantize())
    # The book rounds -offset / scale to a zero point and would silently write a different layer; a layer of free
    # offsets (a GGUF Q4_1 one) has no integer zero points, and is refused.
    free = affine.AffineQuantLinear(layer.packed, layer.scales, layer.offsets + 0.3 * layer.scales, 32,
                                    True, in_features=64)
    with pytest.raises(ValueError, match=r"free offsets \(a GGUF Q4_1 / K-quant min\), not integer zero points"):
        awq.to_checkpoint(free)
    with pytest.raises(ValueError, match="qzeros"):
        awq.from_checkpoint(t["qweight"], t["qzeros"][:1], t["scales"], 32)
    with pytest.raises(ValueError, match="AWQ scales must be a 16- or 32-bit float tensor, got torch.int64"):
        awq.from_checkpoint(t["qweight"], t["qzeros"], t["scales"].long(), 32)
    with pytest.raises(ValueError, match="4-bit"):
        awq.validate({"quant_method": "awq", "bits": 8, "group_size": 32})
    with pytest.raises(ValueError, match="version"):
        awq.validate({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv_fast"})


def test_scales_fold_exactly_and_gqa_skip(tiny_model, monkeypatch):
    """Force real scaling (alpha = 0.5 everywhere) and round to 8 bits: if the 1/s were folded wrongly into the
    norms or the previous layers, the output would move far more than 8-bit rounding moves it. Under GQA (v has 32
    rows, o reads 64 inputs) the v -> o pair is never searched: 3 searches per layer, not 4."""
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        reference = tiny_model(ids)
    searched = []

    def fixed(weights, inputs, bits=4, group_size=128, grid=20):
        searched.append(tuple(w.shape for w in weights))
        s = inputs.mean_abs.clamp_min(1e-4) ** 0.5
        return s / (s.max() * s.min()).sqrt(), 0.5

    monkeypatch.setattr(awq, "search_scale", fixed)
    norm_before = tiny_model.model.layers[0].input_layernorm.weight.clone()
    calibration.by_layer(tiny_model, awq.CHECKPOINT, ids, bits=8, group_size=32)     # 8 bits: past awq.quantize's check
    assert not torch.equal(tiny_model.model.layers[0].input_layernorm.weight, norm_before)
    assert len(searched) == 3 * len(tiny_model.model.layers)
    assert (torch.Size([64, 64]),) not in searched                        # o_proj alone: the skipped pair
    with torch.no_grad():
        scaled = tiny_model(ids)
    assert (scaled - reference).abs().max() < 0.02 * reference.abs().max()


def test_model_save_load_and_quality(tiny_model, tmp_path):
    torch.manual_seed(1)
    calibration = torch.randint(0, 256, (4, 64))
    held_out = torch.randint(0, 256, (2, 48))
    reference, rtn_error = rtn_baseline(tiny_model, held_out)
    qcfg = registry.save_quantized(tiny_model, tmp_path, "awq", calibration, group_size=32)
    assert qcfg == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    with torch.no_grad():
        ours = tiny_model(held_out)
        assert torch.equal(registry.load_quantized(tmp_path)(held_out), ours)
    assert (ours - reference).pow(2).mean() < rtn_error


def test_group_size_minus_one_is_one_group_per_row_as_autoawq_writes_it(tiny_model, tmp_path):
    """red before: the option table took -1 (AutoAWQ's per-row groups, which the reader reads) and the quantizer
    refused it after the model was loaded"""
    calibration = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    qcfg = registry.save_quantized(tiny_model, tmp_path, "awq", calibration, group_size=-1)
    assert qcfg["group_size"] == -1
    loaded = registry.load_quantized(tmp_path)
    for name, layer in registry.quantized_linears(loaded).items():
        assert layer.scales.shape == (layer.out_features, 1), name
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids), tiny_model(ids))
