"""FP8, MXFP4 and NVFP4 against the real tools: ml_dtypes (rounding), gguf (split MXFP4), torchao and transformers
(interleaved MXFP4, NVFP4), compressed-tensors (FP4 packing), transformers (loading our FP8 checkpoint)."""
import numpy as np
import pytest
import torch

from engine.formats import fp8, mx
from engine.formats.numerics.affine import unpack_nibbles

pytestmark = pytest.mark.interop


def _boundaries(values):
    """Every representable value, every midpoint between neighbours, and the float32 neighbours of both."""
    v = np.unique(values.astype(np.float32))
    mids = ((v[1:].astype(np.float64) + v[:-1]) / 2).astype(np.float32)
    points = np.concatenate([v, mids])
    return np.unique(np.concatenate([points, np.nextafter(points, np.float32(np.inf)),
                                     np.nextafter(points, np.float32(-np.inf))]))


def test_e2m1_rounding_equals_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    grid = mx.E2M1.numpy()
    x = np.concatenate([_boundaries(grid), np.float32([-0.0, 6.5, -7.0, 7.5, 1e30, -np.inf, np.inf])])
    expected = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(mx.to_e2m1(torch.from_numpy(x)).numpy(), expected)
    # and through quantize_mxfp4: a 6 in every block of 32 makes the shared scale 2^0
    pad = -len(x) % 31
    rows = np.concatenate([x.clip(-7.9, 7.9), np.zeros(pad, np.float32)]).reshape(-1, 31)
    w = torch.from_numpy(np.concatenate([rows, np.full((len(rows), 1), 6, np.float32)], 1))
    blocks, scales = mx.quantize_mxfp4(w.reshape(1, -1))
    assert (scales == 127).all()
    want = w.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(unpack_nibbles(blocks).reshape(w.shape).numpy(), want)


def test_e4m3_rounding_equals_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    x = _boundaries(grid[np.isfinite(grid)])
    x = x[np.abs(x) <= fp8.E4M3_MAX]                 # past 448 ml_dtypes gives NaN, torch saturates: we clamp first
    expected = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    # quantize_blocks with one block holding 448 has scale exactly 1: its codes are the raw E4M3 roundings
    w = torch.from_numpy(np.concatenate([x, np.float32([fp8.E4M3_MAX])]))[None, :]
    q, s = fp8.quantize_blocks(w, block=w.shape[1])
    assert s.item() == 1.0
    assert np.array_equal(q[0, :-1].view(torch.uint8).numpy(), expected)


def test_mxfp4_split_layout_equals_gguf():
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(8, 256) * torch.rand(8, 1) * 5
    w[0, :32] = 0                                                       # an all-zero block
    blocks, scales = mx.quantize_mxfp4(w, "split")
    raw = torch.cat([scales[..., None], blocks], -1).reshape(8, -1).numpy()   # GGUF block: scale byte + 16 bytes
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs, mx.dequantize_mxfp4(blocks, scales, "split").numpy())
    # gguf's own quantizer writes the same bytes, except that it stores a negative value rounded to 0 as +0
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    strip_negative_zero = torch.from_numpy(raw.copy())
    body = strip_negative_zero.reshape(8, -1, 17)[..., 1:]
    body &= torch.where((body & 0xF) == 8, 0xF7, 0xFF).to(torch.uint8)
    body &= torch.where((body >> 4) == 8, 0x7F, 0xFF).to(torch.uint8)
    assert np.array_equal(ref, strip_negative_zero.numpy())


def test_mxfp4_interleaved_equals_torchao():
    torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    torch.manual_seed(1)
    w = torch.randn(2, 48, 128) * torch.rand(2, 48, 1) * 3
    blocks, scales = mx.quantize_mxfp4(w, "interleaved")
    scale_ref, data_ref = torchao_mx.to_mx(w, torch.float4_e2m1fn_x2, 32, torchao_mx.ScaleCalculationMode.FLOOR)
    assert torch.equal(scale_ref.view(torch.uint8).reshape(scales.shape), scales)
    assert torch.equal(data_ref.view(torch.uint8).reshape(blocks.shape), blocks)


def test_mxfp4_interleaved_decodes_like_transformers():
    mxfp4_hf = pytest.importorskip("transformers.integrations.mxfp4")
    torch.manual_seed(1)
    blocks, scales = mx.quantize_mxfp4(torch.randn(2, 48, 128) * torch.rand(2, 48, 1) * 3, "interleaved")
    theirs = mxfp4_hf.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)    # gpt-oss experts: [E, K, N]
    assert torch.equal(theirs, mx.dequantize_mxfp4(blocks, scales).transpose(1, 2))


def test_nvfp4_equals_torchao_and_compressed_tensors():
    torchao_nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch.manual_seed(2)
    w = torch.randn(64, 256) * torch.rand(64, 1) * 2
    w[3, :16] = 0
    packed, block_scale, tensor_scale = mx.quantize_nvfp4(w)
    assert torch.equal(tensor_scale, torchao_nv.per_tensor_amax_to_scale(w.abs().max()))
    scale_ref, data_ref = torchao_nv.nvfp4_quantize(w, 16, tensor_scale)
    assert torch.equal(scale_ref.view(torch.uint8), block_scale.view(torch.uint8))
    packed = packed.flatten(-2)                                   # the book's [out, K/16, 8] as stored, [out, K/2]
    assert torch.equal(data_ref.view(torch.uint8), packed)
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    values = mx.E2M1[torch.stack(((packed & 0xF).long(), (packed >> 4).long()), -1).flatten(-2)]
    assert torch.equal(helpers.pack_fp4_to_uint8(values), packed)


def test_fp8_checkpoint_loads_in_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    registry = pytest.importorskip("engine.formats.quantized_checkpoints")
    from engine.qwen3 import Qwen3, Qwen3Config
    monkeypatch.setitem(registry.METHODS, "fp8", fp8.CHECKPOINT)     # whether or not the lead registered it
    torch.manual_seed(3)
    model = Qwen3(Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1)).eval()
    registry.save_quantized(model, tmp_path, "fp8")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()   # CPU: dequantizes
    ours = {f"model.{name}.weight": layer.dequantize() for name, layer in model.model.named_modules()
            if isinstance(layer, fp8.FP8BlockLinear)}
    assert len(ours) == 7
    theirs = hf.state_dict()
    for name, weight in ours.items():
        assert torch.equal(theirs[name].float(), weight), name
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4)
    back = registry.load_quantized(tmp_path)
    assert all(torch.equal(back.get_submodule(n.rpartition(".")[0]).dequantize(), w)
               for n, w in ours.items())
