"""GPTQ and AWQ against the real tools: GPTQModel's packer (and its v2 -> v1 conversion), AutoAWQ's GEMM packer and
dequantizer, and transformers loading the checkpoints we write.

Test-only installs (torch must stay at the pinned version; both tools declare newer torch or heavy extras):
    pip install --no-deps -c /tmp/torch-constraint.txt gptqmodel==7.7.0 autoawq==0.2.9 torchao==0.18.0
    pip install -c /tmp/torch-constraint.txt pypcre logbar threadpoolctl device-smi tokenicer defuser pillow \\
        accelerate datasets optimum
(gptqmodel's import needs the second line's packages and torchao; transformers' GPTQ loader needs optimum; AutoAWQ's
import needs accelerate and datasets. /tmp/torch-constraint.txt holds the single line torch==2.13.0.)
"""
import sys
import types
from pathlib import Path

import pytest
import torch

from engine.formats import quantized_checkpoints as registry
from engine.formats.numerics import affine
from engine.formats import awq, gptq
from engine.layers import quantized_linears

pytestmark = pytest.mark.interop


@pytest.fixture(autouse=True, scope="module")
def _eager_one_thread():
    """GPTQModel's torch kernels call torch.compile (a minute of inductor C++ builds on CPU) and these tensors are
    tiny: run them eagerly, on one thread."""
    import torch._dynamo
    previous = torch.get_num_threads(), torch._dynamo.config.disable
    torch.set_num_threads(1)
    torch._dynamo.config.disable = True
    yield
    torch.set_num_threads(previous[0])
    torch._dynamo.config.disable = previous[1]


@pytest.fixture(scope="module")
def gptqmodel_packer():
    pytest.importorskip("gptqmodel")
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    def pack(codes, scales, zeros, g_idx, bits, act_order):
        """GPTQModel's own path: pack_original re-derives codes from a dense weight (internally v2), then the
        v2 -> v1 conversion subtracts one from every zero (as a word subtraction, 0x11111111 for 4 bits)."""
        out_f, in_f = codes.shape
        linear = torch.nn.Linear(in_f, out_f, bias=False)
        linear.weight.data = gptq.dequantize_gptq(codes, scales, zeros, g_idx)
        ref = TorchLinear(bits=bits, group_size=in_f // scales.shape[1], sym=False, desc_act=act_order,
                          in_features=in_f, out_features=out_f, bias=False)
        ref.pack_original(linear, scales, zeros, g_idx)
        convert_gptq_v2_to_v1_format_module(ref, types.SimpleNamespace(bits=bits, pack_dtype=torch.int32))
        return {k: getattr(ref, k) for k in ("qweight", "qzeros", "scales", "g_idx")}, linear.weight.data

    return pack


def gptq_layer(seed, bits, act_order, out_f=64, in_f=256, group=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    x = torch.randn(512, in_f, generator=g) * torch.linspace(0.1, 3.0, in_f)
    # min_zero=1: GPTQModel's word-wide "- 0x11111111" borrows into the next output's zero when a zero is 0
    order = "act_order" if act_order else "natural"
    return gptq.gptq_quantize(w, gptq.hessian_from(x), bits, group, order=order, min_zero=1)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_gptq_bit_identical_to_gptqmodel(gptqmodel_packer, bits, act_order):
    codes, scales, zeros, g_idx = gptq_layer(bits, bits, act_order)
    theirs, _ = gptqmodel_packer(codes, scales, zeros, g_idx, bits, act_order)
    ours = gptq.pack_gptq(codes, scales, zeros, g_idx, bits=bits)
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key


@pytest.mark.parametrize("act_order", [False, True])
def test_gptqmodel_tensors_load_in_engine(gptqmodel_packer, act_order):
    codes, scales, zeros, g_idx = gptq_layer(7, 4, act_order)
    theirs, weight = gptqmodel_packer(codes, scales, zeros, g_idx, 4, act_order)
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": act_order, "sym": False}
    layer = gptq.CHECKPOINT.read(dict(theirs), gptq.validate(qcfg))
    assert torch.equal(layer.dequantize(), weight)          # the exact weights GPTQModel packed


@pytest.fixture(scope="module")
def order_bench():
    """benchmarks/gptq_order.py: it drives GPTQModel's GPTQ quantizer with a given weight and Hessian."""
    pytest.importorskip("gptqmodel")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gptq_order
    return gptq_order


def uneven_layer(seed, out_f=32, in_f=128):
    """A layer whose inputs have uneven, shuffled channel scales (what makes the order matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, in_f, generator=g) * torch.linspace(0.1, 3.0, in_f)[torch.randperm(in_f, generator=g)]
    return torch.randn(out_f, in_f, generator=g) * 0.02, gptq.hessian_from(x)


def test_group_aware_order_is_gptqmodels():
    pytest.importorskip("gptqmodel")
    from gptqmodel.quantization import gar
    _, h = uneven_layer(0)
    diag = torch.diag(h)
    local, values = gar.compute_local_perms(diag, 32, return_values=True)
    theirs = gar.compose_final_perm(local, gar.compute_global_perm(diag, 32, precomputed_values=values), 32)
    assert torch.equal(gptq.visit_order(diag, 32, "group_aware"), theirs)


@pytest.mark.parametrize("order", ["natural", "desc_act", "static+desc_act", "act_group_aware"])
def test_each_order_matches_gptqmodel_layer_error(order_bench, order):
    """Same weight, Hessian, damping and group size: the same layer error as GPTQModel in the same order (they differ
    only by our f16 scales), and our best order at or below GPTQModel's default (group-aware)."""
    w, h = uneven_layer(1)
    engine_order, their_options = order_bench.ORDERS[order]
    ours = order_bench.layer_error(order_bench.engine_quantize(w, h, 4, 32, order=engine_order), w, h)
    theirs = order_bench.layer_error(order_bench.gptqmodel_quantize(w, h, 4, 32, **their_options), w, h)
    assert abs(ours / theirs - 1) < 0.03
    if order in ("desc_act", "static+desc_act"):
        default = order_bench.gptqmodel_quantize(w, h, 4, 32, act_group_aware=True)
        assert ours < order_bench.layer_error(default, w, h)


def test_pack_awq_bit_identical_to_autoawq():
    pytest.importorskip("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.02                             # AutoAWQ's packer needs out % 32 == 0
    layer = affine.AffineQuantLinear.from_weight(w, 4, 64)
    ours = awq.to_checkpoint(layer)
    linear = torch.nn.Linear(256, 96, bias=False)
    linear.weight.data = layer.dequantize()
    zeros = layer.zeros.float()
    ref = WQLinear_GEMM.from_linear(linear, 4, 64, scales=layer.scales.T.contiguous(), zeros=zeros.T.contiguous())
    for key in ("qweight", "qzeros", "scales"):
        assert torch.equal(getattr(ref, key), ours[key]), key
    theirs = dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"], 4, 64)      # [in, out], f16
    assert torch.allclose(theirs.float().T, layer.dequantize(), atol=1e-3, rtol=1e-3)
    back = awq.from_checkpoint(ref.qweight, ref.qzeros, ref.scales, 64)
    assert torch.equal(back.dequantize(), layer.dequantize())


@pytest.mark.parametrize("method,options", [("gptq", {"group_size": 32, "order": "natural"}),
                                            ("gptq", {"group_size": 32, "order": "act_order"}),      # permuted
                                            ("gptq", {"group_size": 32}),       # the default: static groups
                                            ("gptq", {"group_size": 32, "order": "group_aware"}),
                                            ("gptq", {"group_size": 32, "order": "search"}),
                                            ("awq", {"group_size": 32})])
def test_transformers_loads_our_checkpoint(tiny_model, tmp_path, method, options):
    pytest.importorskip("gptqmodel")
    if method == "gptq":
        pytest.importorskip("optimum")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    registry.save_quantized(tiny_model, tmp_path, method, torch.randint(0, 256, (4, 64)), **options)
    config = (transformers.GPTQConfig(bits=4, backend="torch") if method == "gptq"
              else transformers.AwqConfig(bits=4, backend="torch_awq"))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, quantization_config=config,
                                                       dtype=torch.float32).eval()
    assert not isinstance(hf.model.layers[0].self_attn.q_proj, torch.nn.Linear)   # really quantized there
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        ours, theirs = tiny_model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 2e-3


@pytest.mark.parametrize("act_order", [False, True])
def test_checkpoint_packed_by_gptqmodel_loads_in_engine(gptqmodel_packer, tiny_model, tmp_path, act_order):
    """A whole checkpoint folder whose every quantized layer was packed by GPTQModel (v1, as it ships) loads in the
    engine and reproduces the model those codes came from, logit for logit."""
    import json

    from engine.safetensors_io import save_file
    qcfg = gptq.quantize(tiny_model, torch.randint(0, 256, (4, 64)), group_size=32,
                         order="act_order" if act_order else "natural")
    tensors = {}
    for name, layer in quantized_linears(tiny_model).items():
        codes, scales, zeros, g_idx = affine.affine_parts(layer)
        packed, _ = gptqmodel_packer(codes, scales, zeros, g_idx, 4, act_order)
        tensors.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
    for name, p in tiny_model.state_dict().items():
        if name.rpartition(".")[0] not in quantized_linears(tiny_model) and name != "lm_head.weight":
            tensors[name] = p.contiguous()
    (tmp_path / "config.json").write_text(json.dumps({**tiny_model.cfg.to_hf(), "quantization_config": qcfg}))
    save_file(tensors, tmp_path / "model.safetensors")
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(registry.load_quantized(tmp_path)(ids), tiny_model(ids))
