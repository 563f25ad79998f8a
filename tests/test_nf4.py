"""NF4, the data-free 4-bit baseline: nearest levels, the bits it costs, the Triton kernel, the whole-model entry."""
import pytest
import torch

from engine.layers import impl, quantized_linears
from engine.formats import nf4

pytestmark = pytest.mark.usefixtures("one_thread")


def test_nf4_levels_bits_and_kernel():
    torch.manual_seed(0)
    w = torch.randn(48, 130)
    layer = nf4.NF4Linear.from_weight(w)
    deq = layer.dequantize()
    groups = -(-130 // 64)
    assert layer.storage_bits() == 48 * 130 * 4 + 48 * groups * 16
    absmax = torch.nn.functional.pad(w, (0, groups * 64 - 130)).reshape(48, groups, 64).abs().amax(-1).half().float()
    a = absmax.repeat_interleave(64, 1)[:, :130]
    levels = nf4.NF4_TABLE[None, None, :] * a[..., None]
    nearest = levels.gather(-1, (levels - w[..., None]).abs().argmin(-1, keepdim=True))[..., 0]
    assert torch.allclose(deq, nearest)
    x = torch.randn(5, 130)
    with impl("engine"):
        assert torch.allclose(layer(x), x @ deq.T, atol=1e-4, rtol=1e-4)


def test_quantize_replaces_every_block_linear_and_describes_them(tiny_model):
    for bad in (0, 64.0, True):
        with pytest.raises(ValueError, match="group_size must be a positive integer"):
            nf4.quantize(tiny_model, group_size=bad)
    assert not quantized_linears(tiny_model)
    qcfg = nf4.quantize(tiny_model, group_size=32)
    layers = quantized_linears(tiny_model)
    assert len(layers) == 14 and all(isinstance(m, nf4.NF4Linear) and m.group_size == 32 for m in layers.values())
    assert isinstance(tiny_model.lm_head, torch.nn.Linear)                  # lm_head (tied) stays dense
    assert qcfg == {"quant_method": "nf4", "bits": 4, "group_size": 32, "scale_dtype": "float16"}


def test_mismatched_shapes_are_refused():
    layer = nf4.NF4Linear.from_weight(torch.randn(8, 64))
    with pytest.raises(ValueError, match="NF4 shapes do not fit"):
        nf4.NF4Linear(layer.packed, layer.absmax, in_features=130)


def test_bitsandbytes_layout_round_trips_the_codes_and_absmax(tiny_model, tmp_path):
    """save_quantized(..., "bitsandbytes") writes bitsandbytes' tensors (first element in the HIGH nibble, float32
    absmax per flattened block, the JSON quant state) and loads back to the same model."""
    import json
    from engine.checkpoints.models import load_model
    from engine.formats.quantized_checkpoints import save_quantized
    from engine.safetensors_io import TensorReader
    save_quantized(tiny_model, tmp_path / "nf4", "nf4", group_size=32)
    layer = quantized_linears(tiny_model)["model.layers.0.self_attn.q_proj"]
    reader = TensorReader(tmp_path / "nf4")
    name = "model.layers.0.self_attn.q_proj.weight"
    packed, absmax = reader.read(name), reader.read(name + ".absmax")
    state = json.loads(bytes(reader.read(name + ".quant_state.bitsandbytes__nf4").tolist()))
    codes = nf4.unpack_bits(layer.packed, 4, layer.in_features).reshape(-1)
    assert torch.equal(packed.reshape(-1), (codes[0::2] << 4) | codes[1::2])
    assert torch.equal(absmax, layer.absmax.float().reshape(-1)) and absmax.dtype == torch.float32
    assert state == {"quant_type": "nf4", "blocksize": 32, "dtype": "float32", "shape": [64, 64]}
    assert json.loads((tmp_path / "nf4" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "bitsandbytes"
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "nf4")(ids), tiny_model(ids))


def test_bitsandbytes_blocks_must_not_straddle_rows(tiny_model):
    with pytest.raises(ValueError, match="option group_size of method 'bitsandbytes' must be one of 32, 64"):
        nf4.bnb_quantize(tiny_model, group_size=48)
