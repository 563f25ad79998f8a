"""compressed-tensors checkpoints against the real tools (test-only: pip install compressed-tensors transformers).

  - compressed_tensors' own packers (pack_to_int32 / unpack_from_int32, pack_fp4_to_uint8) agree with ours bit for bit;
  - its compressors, given our dequantized weights and our scales, produce exactly the tensors we write;
  - checkpoints its ModelCompressor writes (a transformers Qwen3) load in the engine with the weights transformers
    dequantizes; checkpoints the engine writes load in transformers (CompressedTensorsConfig(dequantize=True)) with
    our weights.
"""
import pytest
import torch
from torch import nn

from engine.formats import compressed_tensors as ct
from engine.formats.fp8 import FP8BlockLinear
from engine.formats.mx import E2M1, MXFP4Linear, NVFP4Linear
from engine.formats.numerics.affine import AffineQuantLinear, pack_int32
from engine.layers import quantized_linears
from helpers import method_io

pytestmark = [pytest.mark.interop,
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]
compressed_tensors = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

parts, read, write = method_io(ct.CHECKPOINT)

FORMATS = ct.CT_FORMATS


def _weight(out_f, in_f, seed=0):
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))


def _plus_zero(packed):
    """FP4 bytes with -0 (code 8) written as +0: the two encode the same weight, and a weight that was already
    dequantized to -0.0 gives their quantizer no reason to keep the sign."""
    low, high = packed & 0xF, packed >> 4
    return torch.where(low == 8, 0, low) | (torch.where(high == 8, 0, high) << 4)


def _scheme(config):
    return QuantizationScheme.model_validate(config["config_groups"]["group_0"])


# ---- packers ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_to_int32_bit_for_bit(bits, packed_dim):
    half, per = 2 ** (bits - 1), 32 // bits
    q = torch.randint(-half, half, (19, 37), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    theirs = pack_to_int32(q, bits, packed_dim=packed_dim)
    v = (q.int() + half) if packed_dim == 1 else (q.int() + half).T
    ours = pack_int32(torch.nn.functional.pad(v, (0, -v.shape[1] % per)), bits)
    assert torch.equal(ours if packed_dim == 1 else ours.T, theirs)
    assert torch.equal(unpack_from_int32(theirs, bits, q.shape, packed_dim), q)


def test_unpack_from_int32_reads_our_weight_packed():
    layer = AffineQuantLinear.from_weight(_weight(20, 72), 4, 32, sym=True)
    t = write(layer, ct.quantization_config("pack-quantized", group_size=32))
    assert torch.equal(unpack_from_int32(t["weight_packed"], 4, (20, 72)).int(), layer.weight_codes.int() - 8)


@pytest.mark.parametrize("cls", [NVFP4Linear, MXFP4Linear])
def test_pack_fp4_to_uint8_bit_for_bit(cls):
    layer = cls.from_linear(nn.Linear(64, 24, bias=False))
    packed = layer.packed if cls is NVFP4Linear else layer.blocks.reshape(24, -1)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(24, 64).long()
    assert torch.equal(pack_fp4_to_uint8(E2M1[codes]), packed)
    assert torch.equal(unpack_fp4_from_uint8(packed, 24, 64, torch.float32), E2M1[codes])


# ---- the compressors --------------------------------------------------------------------------------------------

def _layer(fmt, sym=True):
    w = _weight(48, 256)
    if fmt == "pack-quantized":
        return AffineQuantLinear.from_weight(w, 4, 64, sym=sym)
    linear = nn.Linear(256, 48, bias=False)
    linear.weight.data.copy_(w)
    return {"float-quantized": FP8BlockLinear, "nvfp4-pack-quantized": NVFP4Linear,
            "mxfp4-pack-quantized": MXFP4Linear}[fmt].from_linear(linear)


def _their_state(layer, fmt, ours):
    """What llm-compressor hands its compressor: the (fake-quantized) weight and the float qparams."""
    state = {"weight": layer.dequantize()}
    if fmt == "pack-quantized":
        state["weight_scale"] = layer.scales
        state["weight_zero_point"] = (layer.zeros.float() - 8).to(torch.int8)
    elif fmt == "float-quantized":
        state["weight_scale"] = ours["weight_scale"]
    elif fmt == "nvfp4-pack-quantized":
        state["weight_scale"] = ours["weight_scale"].float()
        state["weight_global_scale"] = ours["weight_global_scale"]
    else:
        state["weight_scale"] = torch.exp2(ours["weight_scale"].float() - 127)
    return state


@pytest.mark.parametrize("fmt,sym", [(f, True) for f in FORMATS] + [("pack-quantized", False)])
def test_their_compressor_writes_what_we_write(fmt, sym):
    config = ct.quantization_config(fmt, group_size=64, symmetric=sym)
    QuantizationConfig.model_validate(config)                            # our config passes their schema
    scheme = _scheme(config)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    layer = _layer(fmt, sym)
    ours = write(layer, config)
    theirs = compressor.compress(_their_state(layer, fmt, ours), scheme)
    assert set(theirs) == set(parts(config))
    for name in parts(config):
        a, b = ours[name], theirs[name]
        if name == "weight_scale" and fmt == "pack-quantized":
            a, b = a.float(), b.float()                                  # theirs in the dtype we passed
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype == torch.uint8:
            a, b = _plus_zero(a), _plus_zero(b)
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name
    # and their decompressor gives back our weights
    back = compressor.decompress(theirs, scheme)
    rtol = 1e-2 if fmt.startswith(("nv", "mx")) else 1e-6               # they decode FP4 in bfloat16
    torch.testing.assert_close(back["weight"].float(), layer.dequantize(), rtol=rtol, atol=1e-6)


# ---- whole checkpoints, both directions -------------------------------------------------------------------------

def _tiny_hf_config():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                    tie_word_embeddings=True)


def _transformers_load(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32).eval()


def _ct_write(directory, config):
    """A real compressed-tensors checkpoint: transformers Qwen3 -> apply the scheme -> min-max qparams (what
    llm-compressor's default observer computes) -> ModelCompressor compresses -> save_pretrained."""
    transformers = pytest.importorskip("transformers")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(_tiny_hf_config()).float()
    apply_quantization_config(model, QuantizationConfig.model_validate(config))
    for module in model.modules():
        if not hasattr(module, "quantization_scheme"):
            continue
        args, w = module.quantization_scheme.weights, module.weight.data
        if args.strategy == "block":
            b = args.block_structure[0]                                     # k/v_proj: 64 rows, a ragged block
            w = torch.nn.functional.pad(w, (0, -w.shape[1] % b, 0, -w.shape[0] % b))
            blocks = w.reshape(w.shape[0] // b, b, w.shape[1] // b, b)
            lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
        else:
            groups = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = groups.amin(-1), groups.amax(-1)
        global_scale = None
        if args.strategy == "tensor_group":
            global_scale = generate_gparam(w.min(), w.max())
            module.weight_global_scale.data.copy_(global_scale)
        scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
        module.weight_scale.data = scale if args.scale_dtype is not None else scale.to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)


def _tolerance(fmt):
    return 1e-2 if fmt == "nvfp4-pack-quantized" else 1e-6            # transformers decodes NVFP4 in bfloat16


@pytest.mark.parametrize("fmt,sym", [(f, True) for f in FORMATS] + [("pack-quantized", False)])
def test_model_compressor_checkpoint_loads_in_engine(tmp_path, monkeypatch, fmt, sym):
    registry = pytest.importorskip("engine.formats.quantized_checkpoints")
    monkeypatch.setitem(registry.METHODS, "compressed-tensors", ct.CHECKPOINT)
    _ct_write(tmp_path, ct.quantization_config(fmt, group_size=64, symmetric=sym))
    ours = registry.load_quantized(tmp_path)
    reference = _transformers_load(tmp_path)
    layers = quantized_linears(ours)
    assert len(layers) == 7
    for name, layer in layers.items():
        torch.testing.assert_close(layer.dequantize(), reference.get_submodule(name).weight.float(),
                                   rtol=_tolerance(fmt), atol=1e-6)


@pytest.mark.parametrize("fmt,sym", [(f, True) for f in FORMATS] + [("pack-quantized", False)])
def test_engine_checkpoint_loads_in_transformers(tmp_path, monkeypatch, fmt, sym):
    registry = pytest.importorskip("engine.formats.quantized_checkpoints")
    from engine.qwen3 import Qwen3, Qwen3Config
    monkeypatch.setitem(registry.METHODS, "compressed-tensors", ct.CHECKPOINT)
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config.from_hf(_tiny_hf_config().to_dict())).eval()
    registry.save_quantized(model, tmp_path, "compressed-tensors", format=fmt, group_size=64, symmetric=sym)
    reference = _transformers_load(tmp_path)
    for name, layer in quantized_linears(model).items():
        torch.testing.assert_close(reference.get_submodule(name).weight.float(), layer.dequantize(),
                                   rtol=_tolerance(fmt), atol=1e-6)
    if fmt in ("pack-quantized", "mxfp4-pack-quantized"):               # weight-only schemes: same logits too
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(reference(ids).logits, model(ids), rtol=1e-4, atol=1e-4)
