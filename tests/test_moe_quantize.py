"""Quantizing Qwen3-MoE: each expert calibrated on exactly the tokens routed to it (counted), starved experts rounded
to nearest as stated and recorded, the router left dense; every method that quantizes linears one by one works on
the experts, in memory and layer by layer from disk, and loads back to the same model; GPTQ walks the experts a
chunk at a time (read from disk a chunk at a time when streamed) and writes the bytes of the unchunked walk; what a
method cannot yet do with experts is refused before any work."""
import copy

import pytest
import torch

from engine.checkpoints.streaming import quantize_checkpoint
from engine.formats import gptq
from engine.formats.numerics import experts
from engine.formats.numerics.calibration import decoder_layers
from engine.formats.quantized_checkpoints import load_quantized, save_quantized
from engine.layers import QuantLinear, quantized_linears, sequential_steps
from engine.loaders import save_dense
from engine.qwen3 import MLP, Qwen3, Qwen3MoeConfig
from engine.safetensors_io import snapshot_tensors
from helpers import random_ids
from test_moe import fuse

pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             mlp_only_layers=(1,), initializer_range=0.2)
DATA_FREE = {"fp8": dict(block=32), "rtn": dict(group_size=32), "nvfp4": {}, "mxfp4": {},
             "nf4": dict(group_size=32),
             "lattice": dict(bps=3.0), "trellis": dict(L=6, K=2, group=32), "entquant": dict(lam=14.5, max_iter=5)}


def tiny_moe(**change):
    torch.manual_seed(0)
    return Qwen3(Qwen3MoeConfig(**{**SIZES, **change})).eval()


@pytest.fixture(scope="module")
def ids():
    return random_ids(4, 16)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / "dense"
    save_dense(tiny_moe(), folder)
    return folder


@torch.no_grad()
def test_each_experts_statistics_come_from_exactly_its_routed_tokens(ids):
    model = tiny_moe()
    layer = next(decoder_layers(model, ids))                     # layer 0, sparse
    stats = layer.capture()
    h = layer.layer.post_attention_layernorm(layer.runs.layer.attention_residual(*layer.batches[0][:3]))
    x = h.reshape(-1, SIZES["hidden_size"])
    chosen = layer.layer.mlp.gate(x)[1]
    counts = [int((chosen == e).any(-1).sum()) for e in range(4)]
    assert sum(counts) == x.shape[0] * 2                          # each token counted once per chosen expert
    for e in range(4):
        mine = x[(chosen == e).any(-1)].double()
        one = stats[f"model.layers.0.mlp.experts.{e}.gate_proj"]
        assert one.rows == counts[e] and one is stats[f"model.layers.0.mlp.experts.{e}.up_proj"]
        torch.testing.assert_close(one.gram, (mine.T @ mine / len(mine)).float(), rtol=1e-5, atol=1e-6)
    assert stats["model.layers.0.self_attn.q_proj"].rows == x.shape[0]


@torch.no_grad()
def test_starved_experts_are_rounded_to_nearest_and_recorded(ids):
    cfg = dict(num_experts=16, num_experts_per_tok=1)             # 64 tokens, 16 experts: some see few or none
    model, reference = tiny_moe(**cfg), tiny_moe(**cfg)
    qcfg = gptq.quantize(model, ids[:, :8], group_size=32, expert_min_tokens=4, order="natural")
    tokens, rounded = qcfg["expert_tokens"], qcfg["experts_rounded"]
    assert tokens[1] is None and len(tokens) == 3 and all(sum(t) == 32 for t in (tokens[0], tokens[2]))
    assert qcfg["expert_min_tokens"] == 4 and rounded[1] == []
    for i in (0, 2):
        assert 0 in tokens[i] and rounded[i] == [e for e, n in enumerate(tokens[i]) if n < 4]
        for e, n in enumerate(tokens[i]):
            for part in ("gate_proj", "up_proj", "down_proj"):
                layer = model.model.layers[i].mlp.experts[e].get_submodule(part)
                weight = reference.model.layers[i].mlp.experts[e].get_submodule(part).weight
                rtn = gptq.dequantize_gptq(*gptq.gptq_quantize(weight, torch.eye(weight.shape[1]), 4, 32,
                                                               min_zero=1))
                assert isinstance(layer, QuantLinear) and bool(torch.isfinite(layer.dequantize()).all())
                assert torch.equal(layer.dequantize(), rtn) == (n < 4)   # round to nearest exactly when starved
    assert isinstance(model.model.layers[0].mlp.gate.weight, torch.nn.Parameter)      # the router stays dense
    assert torch.equal(model.model.layers[0].mlp.gate.weight, reference.model.layers[0].mlp.gate.weight)


def test_the_default_threshold_is_each_experts_input_width(ids):
    qcfg = gptq.quantize(tiny_moe(), ids, group_size=32)          # 64 tokens over 4 experts x 2: about 32 each
    assert qcfg["expert_min_tokens"] is None
    for tokens, rounded in zip(qcfg["expert_tokens"], qcfg["experts_rounded"]):
        # gate/up read 64 columns, down 32: an expert below 64 tokens has its gate/up rounded (the expert listed)
        assert rounded == ([e for e, n in enumerate(tokens) if n < 64] if tokens else [])


@pytest.mark.parametrize("method", sorted(DATA_FREE) + ["gptq", "awq"])
def test_every_linear_method_quantizes_the_experts_and_loads_back(method, ids, tmp_path):
    model = tiny_moe()
    qcfg = save_quantized(model, tmp_path / "q", method, ids, **DATA_FREE.get(method, dict(group_size=32)))
    layers = quantized_linears(model)
    assert len(layers) == 3 * 4 + 2 * 4 * 3 + 3 and "model.layers.2.mlp.experts.3.down_proj" in layers
    stored = dict(snapshot_tensors(tmp_path / "q"))
    assert stored["model.layers.0.mlp.gate.weight"].dtype == torch.float32                # the router as it was
    back = load_quantized(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    if qcfg["quant_method"] == "compressed-tensors":              # routers are not linears there either
        assert qcfg["ignore"] == ["lm_head", experts.ROUTER_IGNORE]


@pytest.mark.parametrize("method, options", [("gptq", dict(group_size=32, order="act_order_static")),
                                             ("awq", dict(group_size=32)), ("fp8", dict(block=32)),
                                             ("compressed-tensors", dict(group_size=32))])
def test_streaming_writes_what_the_in_memory_path_writes(method, options, source, ids, tmp_path):
    in_memory = save_quantized(tiny_moe(), tmp_path / "mem", method, ids, **options)
    streamed = quantize_checkpoint(source, tmp_path / "disk", method, ids, progress=False, **options)
    assert streamed == in_memory
    a, b = dict(snapshot_tensors(tmp_path / "mem")), dict(snapshot_tensors(tmp_path / "disk"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fused_expert_folder_streams_to_the_same_checkpoint(source, ids, tmp_path):
    fuse(source, tmp_path / "fused")                       # transformers 5's fused expert layout
    for folder in ("fused", "dense"):
        quantize_checkpoint(tmp_path / "fused" if folder == "fused" else source, tmp_path / f"q-{folder}", "gptq",
                            ids, progress=False, group_size=32)
    a, b = dict(snapshot_tensors(tmp_path / "q-fused")), dict(snapshot_tensors(tmp_path / "q-dense"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def float_experts_held(monkeypatch):
    """[float expert linears held after each read], filled as the streaming converter reads its source."""
    from engine.checkpoints import streaming
    held, fill = [], streaming._fill

    def counting(model, tensors, dtype, digests):
        stored = fill(model, tensors, dtype, digests)
        held.append(sum(1 for n, p in model.named_parameters() if ".experts." in n and p.device.type != "meta"))
        return stored

    monkeypatch.setattr(streaming, "_fill", counting)
    return held


def test_streaming_holds_one_layers_experts_at_a_time(source, ids, tmp_path, monkeypatch):
    held = float_experts_held(monkeypatch)
    quantize_checkpoint(source, tmp_path / "q", "gptq", ids, progress=False, group_size=32)
    assert max(held) == 4 * 3                                     # one sparse layer's 4 experts x 3 linears


def chunks_of(n, monkeypatch):
    """GPTQ's chunks of experts made n experts long: CHUNK_BYTES set to n experts' cost (experts.chunk_size)."""
    with torch.device("meta"):
        expert = MLP(Qwen3MoeConfig(**SIZES), SIZES["moe_intermediate_size"])
    monkeypatch.setattr(experts, "CHUNK_BYTES", n * experts.expert_bytes(expert))


def test_a_sparse_layer_is_walked_a_chunk_of_experts_at_a_time(monkeypatch):
    with torch.device("meta"):                    # Qwen3-30B-A3B's expert: 86 MB a chunk holds, 3 in 256 MiB
        thirty = MLP(Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768), 768)
    assert experts.expert_bytes(thirty) == 85_999_616 and experts.chunk_size([thirty]) == 3
    model = tiny_moe()
    chunks_of(3, monkeypatch)
    steps = experts.chunked_steps(model.model.layers[0])
    assert steps[:2] == sequential_steps(model.model.layers[0])[:2]                   # q/k/v, then o
    assert steps[2:] == (tuple(f"mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj")),
                         tuple(f"mlp.experts.{e}.down_proj" for e in range(3)),
                         ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj"), ("mlp.experts.3.down_proj",))
    assert experts.chunked_steps(model.model.layers[1]) == sequential_steps(model.model.layers[1])     # dense


@torch.no_grad()
def test_a_capture_of_one_experts_inputs_runs_that_expert_alone(ids):
    layer = next(decoder_layers(tiny_moe(), ids))
    whole = layer.capture()["model.layers.0.mlp.experts.2.gate_proj"]
    ran = []
    for e, expert in enumerate(layer.layer.mlp.experts):
        expert.register_forward_pre_hook(lambda module, args, e=e: ran.append(e))
    alone = layer.capture(["mlp.experts.2.gate_proj", "mlp.experts.2.up_proj"])["model.layers.0.mlp.experts.2.up_proj"]
    assert set(ran) == {2} and layer.layer.mlp.running is None
    assert alone.rows == whole.rows and torch.equal(alone.gram, whole.gram)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("options", [dict(group_size=32, order="act_order_static"), dict(ggml_type="Q4_0")])
def test_chunks_of_experts_write_the_bytes_of_the_unchunked_walk(chunk, options, ids, tmp_path, monkeypatch):
    options = {**options, "expert_min_tokens": 1}                 # every expert's own Hessian, none rounded
    whole = save_quantized(tiny_moe(), tmp_path / "whole", "gptq", ids, **options)
    chunks_of(chunk, monkeypatch)
    assert save_quantized(tiny_moe(), tmp_path / "chunked", "gptq", ids, **options) == whole
    a, b = dict(snapshot_tensors(tmp_path / "whole")), dict(snapshot_tensors(tmp_path / "chunked"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_streaming_reads_one_chunk_of_experts_at_a_time_into_the_same_bytes(source, ids, tmp_path, monkeypatch):
    options = dict(group_size=32, order="act_order_static", expert_min_tokens=1)    # (save_quantized's default
    # order is the book's, natural; the converter's another)
    save_quantized(tiny_moe(), tmp_path / "mem", "gptq", ids, **options)          # in memory, unchunked
    chunks_of(1, monkeypatch)
    held = float_experts_held(monkeypatch)
    quantize_checkpoint(source, tmp_path / "disk", "gptq", ids, progress=False, **options)
    assert max(held) == 3                                         # one expert's 3 linears in float at a time
    a, b = dict(snapshot_tensors(tmp_path / "mem")), dict(snapshot_tensors(tmp_path / "disk"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method, options, match", [
    ("trellis", dict(ldlq=True, L=6, K=2, group=32), r"trellis with ldlq=True is not implemented for MoE models"),
    ("entquant", dict(lam=14.5, feedback="calibration"), r"EntQuant's feedback and sensitivity is not implemented"),
    ("gptq", dict(ggml_type="mix", bpw=4.5), r"give one ggml_type for a Qwen3-MoE model"),
])
def test_what_a_method_cannot_do_with_experts_is_refused_before_any_work(method, options, match, source, ids,
                                                                         tmp_path, monkeypatch):
    from engine.formats.numerics import calibration
    monkeypatch.setattr(calibration, "first_layer_batches", lambda *a: pytest.fail("work began"))
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(source, tmp_path / "q", method, ids, progress=False, **options)
    with pytest.raises(ValueError, match=match):
        save_quantized(tiny_moe(), tmp_path / "m", method, ids, **options)


@torch.no_grad()
def test_awq_scales_the_router_with_the_experts_and_rounds_starved_experts_to_nearest(ids):
    from engine.formats import awq
    from engine.formats.numerics.affine import AffineQuantLinear
    model, reference = tiny_moe(), tiny_moe()
    qcfg = awq.quantize(model, ids, group_size=32, expert_min_tokens=30)
    tokens, rounded = qcfg["expert_tokens"][0], qcfg["experts_rounded"][0]
    assert sum(tokens) == 128 and rounded == [e for e, n in enumerate(tokens) if n < 30] and rounded
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    ours, theirs = model.model.layers[0], reference.model.layers[0]
    assert not torch.equal(ours.mlp.gate.weight, theirs.mlp.gate.weight)              # the scale folded in ...
    torch.testing.assert_close(ours.mlp.gate(ours.post_attention_layernorm(x))[0],    # ... routes as before
                               theirs.mlp.gate(theirs.post_attention_layernorm(x))[0], rtol=1e-5, atol=1e-6)
    for e in range(4):
        down = theirs.mlp.experts[e].down_proj
        rtn = AffineQuantLinear.from_linear(down, 4, 32).dequantize()      # no scale of its own, no clipping
        assert torch.equal(ours.mlp.experts[e].down_proj.dequantize(), rtn) == (e in rounded)


def test_the_dense_models_gptq_config_is_as_it_was(ids):
    from engine.qwen3 import Qwen3Config
    torch.manual_seed(0)
    dense = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16)).eval()
    assert not {"expert_tokens", "experts_rounded", "expert_min_tokens"} & gptq.quantize(copy.deepcopy(dense), ids,
                                                                                          group_size=32).keys()


@torch.no_grad()
def test_the_engines_kernels_run_the_quantized_experts_as_torch_does(ids):
    from engine.layers import impl
    model = tiny_moe()
    gptq.quantize(model, ids, group_size=32, expert_min_tokens=1)
    with impl("engine"):
        kernels = model(ids[:1, :6])
    torch.testing.assert_close(kernels, model(ids[:1, :6]), rtol=1e-4, atol=1e-5)
