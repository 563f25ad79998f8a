"""Every call chapter 39's listings make, with the book's arguments, against the engine: each runs, and returns what
the book's docstrings say (names, positions, shapes, dtypes). The chapter's imports resolve where it makes them."""
import json

import pytest
import torch
import torch.nn.functional as F

from engine.formats import awq, fp8, gptq, mx, trellis
from engine.formats import quantized_checkpoints as qc
from engine.formats.numerics.affine import (AffineQuantLinear, fake_quantize, find_params, pack_nibbles,
                                            quantize_to_affine)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_chapters_imports_resolve():
    from engine.formats.mx import dequantize_mxfp4  # noqa: F401  (stretch exercise 4)
    from engine.formats.quantized_checkpoints import PARTS, build, load_quantized, save_quantized  # noqa: F401
    from engine.loaders import assign, read_config  # noqa: F401
    from engine.qwen3 import Qwen3, Qwen3Config  # noqa: F401
    from engine.safetensors_io import save_file, snapshot_tensors  # noqa: F401
    for module, names in {awq: ("AWQ_ORDER", "AffineQuantLinear", "fake_quantize", "pack_nibbles",
                                "quantize_to_affine"),
                          gptq: ("find_params", "hessian_from", "as_int32"), fp8: ("E4M3_MAX", "fp8_block_kernel"),
                          mx: ("E2M1", "to_e2m1"), trellis: ("random_hadamard", "codebook", "code_1mad")}.items():
        assert all(hasattr(module, name) for name in names), module.__name__


def test_gptq_listing_calls():
    out_f, in_f, g = 32, 256, 128
    w, x = torch.randn(out_f, in_f) * 0.05, torch.randn(512, in_f)
    H = gptq.hessian_from(x)
    assert H.shape == (in_f, in_f)
    scale, zero = find_params(w[:, :g], 4)
    assert scale.shape == zero.shape == (out_f,)
    for act_order in (False, True):
        codes, scales, zeros, g_idx = gptq.gptq_quantize(w, H, 4, g, act_order)
        assert (codes.dtype, codes.shape, scales.shape, zeros.shape) == (torch.uint8, (out_f, in_f), (out_f, 2),
                                                                         (out_f, 2))
        assert g_idx.dtype == torch.int32 and g_idx.shape == (in_f,)
        t = gptq.pack_gptq(codes, scales, zeros, g_idx)
        assert [t[k].dtype for k in ("qweight", "qzeros", "scales", "g_idx")] == [torch.int32, torch.int32,
                                                                                 torch.float16, torch.int32]
        assert t["qweight"].shape == (in_f // 8, out_f) and t["qzeros"].shape == (2, out_f // 8)
        codes2, scales2, zeros2, g_idx2 = gptq.unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"])
        assert torch.equal(codes2, codes) and torch.equal(zeros2, zeros) and torch.equal(g_idx2, g_idx)
        layer = gptq.to_runtime(codes2, scales2, zeros2, g_idx2, g, None, torch.bfloat16)
        assert layer(torch.randn(3, in_f)).dtype == torch.bfloat16
    assert gptq.as_int32(torch.tensor([2 ** 32 - 1])).item() == -1


def test_awq_listing_calls(tiny_model):
    weights, inputs = [torch.randn(48, 64), torch.randn(16, 64)], torch.randn(100, 64)
    s, alpha = awq.search_scale(weights, inputs, 4, 32)
    assert s.shape == (64,) and 0 <= alpha < 1
    assert fake_quantize(weights[0].float() * s, 4, 32).shape == (48, 64)
    codes, scale, offset = quantize_to_affine(weights[0], 4, 32)
    layer = AffineQuantLinear(pack_nibbles(codes), scale, offset, 32, True, dtype=torch.float32)
    assert layer.weight_codes.shape == (48, 64)
    packed = awq.pack_awq(codes, None)
    assert packed.dtype == torch.int32 and torch.equal(awq.unpack_awq(packed), codes)
    replaced = awq.apply_awq(tiny_model, torch.randint(0, 256, (2, 32)), 4, 32)
    name = "model.layers.0.mlp.down_proj"
    t = awq.to_checkpoint(replaced[name])
    back = awq.from_checkpoint(t["qweight"], t["qzeros"], t["scales"], 32, None, torch.bfloat16)
    assert isinstance(back, awq.AffineQuantLinear) and torch.equal(back.dequantize(), replaced[name].dequantize())


def test_fp8_listing_calls():
    w, x = torch.randn(200, 256) * 0.05, torch.randn(4, 256)
    weight, scale_inv = fp8.quantize_blocks(w)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == w.shape and scale_inv.shape == (2, 2)
    assert fp8.dequantize_blocks(weight, scale_inv).shape == w.shape
    xq, xs = fp8.quantize_activations(x, 128)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (4, 2)
    assert fp8.w8a8_reference(x, weight, scale_inv).shape == (4, 200)
    y = fp8.fp8_block_matmul(x.bfloat16(), weight, scale_inv, block_m=16, block_n=32, block_k=32)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 200)
    layer = fp8.FP8BlockLinear(weight, scale_inv, None, torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    assert F.pad is not None and fp8.E4M3_MAX == 448.0


def test_fp4_listing_calls():
    w = torch.randn(3, 4, 64)
    for layout in ("interleaved", "split"):
        blocks, scales = mx.quantize_mxfp4(w, layout=layout)
        assert blocks.shape == (3, 4, 2, 16) and scales.shape == (3, 4, 2) and scales.dtype == torch.uint8
        assert mx.dequantize_mxfp4(blocks, scales, layout=layout).shape == w.shape
    codes, block_scale, tensor_scale = mx.quantize_nvfp4(w)
    assert codes.shape == (3, 4, 4, 8) and block_scale.shape == (3, 4, 4)
    assert block_scale.dtype == torch.float8_e4m3fn and tensor_scale.numel() == 1
    assert mx.dequantize_nvfp4(codes, block_scale, tensor_scale).shape == w.shape
    assert mx.E2M1[mx.to_e2m1(torch.tensor([1.4])).long()].item() == 1.5


def test_trellis_listing_calls():
    assert trellis.code_1mad(torch.arange(16)).shape == (16,)
    assert trellis.codebook(8).shape == (256,)
    start, symbols, recon = trellis.viterbi_encode(torch.randn(256), 8, 2)
    assert isinstance(start, int) and symbols.shape == (255,) and recon.shape == (256,)
    h = trellis.random_hadamard(256, 0)
    assert h.shape == (256, 256)
    w_hat, bits = trellis.quantize_trellis(torch.randn(4, 512) * 0.02, 8, 2, 256, 0)
    assert w_hat.shape == (4, 512) and bits == (8 + 2 * 255 + 16) / 256


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_loader_and_writer_listing_calls(tiny_model, tmp_path, method):
    from engine.loaders import assign, read_config
    from engine.safetensors_io import save_file, snapshot_tensors
    ids = torch.randint(0, 256, (2, 32))
    group = () if method == "fp8" else (32, False)
    qc.save_quantized(tiny_model, tmp_path, method, ids, *group)
    raw = read_config(tmp_path)
    q = raw["quantization_config"]
    model = qc.load_quantized(tmp_path, "cpu", torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16 and model(ids).dtype == torch.bfloat16
    tensors = dict(snapshot_tensors(tmp_path))
    prefix = "model.layers.0.mlp.up_proj."
    parts = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    assert set(qc.PARTS[method]) <= set(parts)
    layer = qc.build(method, parts, q, torch.bfloat16)
    assert layer(torch.randn(2, layer.in_features)).dtype == torch.bfloat16
    param = torch.nn.Parameter(torch.empty(tensors["model.norm.weight"].shape))
    assign(param, tensors["model.norm.weight"], "model.norm.weight")
    assert torch.equal(param.data, tensors["model.norm.weight"].float())
    save_file({"x": torch.zeros(2)}, tmp_path / "extra.safetensors")
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == method
