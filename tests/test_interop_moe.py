"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM: checkpoints transformers writes (some layers dense,
either routing normalization, sharded, half precision) load with logits within 1e-5 of its own, and the engine's
dense checkpoint loads in transformers with the same logits."""
import pytest
import torch

from engine.loaders import load_dense, save_dense

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]

SIZES = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
             initializer_range=0.15)
CASES = {"dense-layer-1-normalized-f32": (dict(mlp_only_layers=[1], norm_topk_prob=True), torch.float32, None),
         "every-second-layer-sparse-bf16-sharded": (dict(decoder_sparse_step=2, norm_topk_prob=False,
                                                         num_experts_per_tok=3), torch.bfloat16, "40KB"),
         "all-sparse-tied-f16": (dict(tie_word_embeddings=True, norm_topk_prob=True), torch.float16, None)}


def ids(seed=1):
    return torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))


def write_hf(directory, extra, dtype, shard_size):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SIZES, **extra}))
    with torch.no_grad():                              # norms random too: a missing one shows in the logits
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    hf.to(dtype).save_pretrained(directory, max_shard_size=shard_size or "10GB")
    return directory


@torch.no_grad()
def hf_logits(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(ids()).logits


@torch.no_grad()
@pytest.mark.parametrize("case", CASES)
def test_a_transformers_moe_checkpoint_loads_with_logits_within_1e_5(case, tmp_path):
    extra, dtype, shard_size = CASES[case]
    directory = write_hf(tmp_path / "hf", extra, dtype, shard_size)
    ours = load_dense(directory, dtype=torch.float32)
    sparse = [ours.cfg.sparse(i) for i in range(SIZES["num_hidden_layers"])]
    assert any(sparse) and (all(sparse) or case != "all-sparse-tied-f16")
    assert (ours(ids()) - hf_logits(directory)).abs().max() < 1e-5


@torch.no_grad()
def test_the_engines_moe_checkpoint_loads_in_transformers_with_equal_logits(tmp_path):
    source = write_hf(tmp_path / "hf", *CASES["dense-layer-1-normalized-f32"])
    ours = load_dense(source)
    save_dense(ours, tmp_path / "ours")
    assert (hf_logits(tmp_path / "ours") - ours(ids())).abs().max() < 1e-5


def test_gguf_py_reads_the_engines_qwen3moe_file_with_llama_cpps_stacked_shapes(tmp_path):
    gguf = pytest.importorskip("gguf")
    from engine.formats.llama_cpp.gguf_writer import write_gguf
    from engine.qwen3 import Qwen3, Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**{**SIZES, "vocab_size": 256, "num_experts": 4, "moe_intermediate_size": 32})
    model = Qwen3(cfg)
    write_gguf(model, tmp_path / "moe.gguf")
    reader = gguf.GGUFReader(tmp_path / "moe.gguf")
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]
    names = {gguf.TENSOR_NAMES[t].format(bid=0) for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]}
    tensors = {t.name: t for t in reader.tensors}
    assert {n.removesuffix(".weight") for n in tensors if n.startswith(("blk.0.", "token", "output"))} <= names
    assert "blk.0.ffn_gate_exps" in names and "blk.3.ffn_down_exps.weight" in tensors
    field = reader.get_field(gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch))
    assert field.contents() == 4 and reader.get_field(gguf.Keys.General.ARCHITECTURE).contents() == arch
    assert reader.get_field(gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)).contents() == 2
    assert reader.get_field(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)).contents() == 32
    # GGUF's ne is [in, out, experts]; gguf-py's data is the torch order [experts, out, in]
    assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist() == [48, 32, 4]
    assert tensors["blk.0.ffn_down_exps.weight"].data.shape == (4, 48, 32)
    assert tensors["blk.0.ffn_gate_inp.weight"].data.shape == (4, 48)
    up = torch.from_numpy(tensors["blk.2.ffn_up_exps.weight"].data.copy())
    assert torch.equal(up[3], model.model.layers[2].mlp.experts[3].up_proj.weight.detach())


# transformers 5.25 holds Qwen3-MoE's experts fused ([experts, rows, in] parameters, not nn.Linears). Its GPTQ path
# (gptqmodel) replaces nn.Linears only, so a GPTQ-format file's per-expert qweight / qzeros are left out and the
# experts stay randomly initialized (tried: logits off by ~8). Its compressed-tensors path with dequantize=True
# decompresses each expert's packed weight and fuses it as its own checkpoints are: the format it loads MoE in, GPTQ's
# codes included (an engine GPTQ model written as compressed-tensors pack-quantized). Two limits of that path: it
# hands the experts' decompressor no zero points (an asymmetric scheme fails there; its layout is checked against
# compressed-tensors' own decompressor below), and its fused FP8 experts read only blocks that divide the experts'
# widths (as real MoE models' do: 768 = 6 x 128).
@torch.no_grad()
@pytest.mark.parametrize("method", ["rtn", "gptq-as-compressed-tensors", "fp8"])
def test_a_quantized_moe_checkpoint_loads_in_transformers_with_the_engines_logits(method, tmp_path):
    from engine.formats import compressed_tensors, gptq
    from engine.formats.quantized_checkpoints import save_quantized
    source = write_hf(tmp_path / "hf", *CASES["dense-layer-1-normalized-f32"])
    ours = load_dense(source)
    if method == "gptq-as-compressed-tensors":
        qcfg = gptq.quantize(ours, ids(2), group_size=8, order="act_order_static", sym=True, expert_min_tokens=1)
        assert qcfg["experts_rounded"][0] == [e for e, n in enumerate(qcfg["expert_tokens"][0]) if n == 0]
        save_quantized(ours, tmp_path / "q", "compressed-tensors",
                       quantization_config=compressed_tensors.config_for_model(ours))
    else:
        save_quantized(ours, tmp_path / "q", method,
                       **(dict(group_size=8, symmetric=True) if method == "rtn" else dict(block=8)))
    config = (transformers.FineGrainedFP8Config(dequantize=True) if method == "fp8" else
              transformers.CompressedTensorsConfig(dequantize=True))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=config,
                                                              dtype=torch.float32).eval()
    experts = theirs.model.layers[0].mlp.experts
    assert torch.equal(experts.down_proj[3], ours.model.layers[0].mlp.experts[3].down_proj.dequantize())
    assert (theirs(ids()).logits - ours(ids())).abs().max() < 1e-5


def test_an_asymmetric_experts_layout_decompresses_with_compressed_tensors_own_code(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from engine.formats.quantized_checkpoints import load_quantized, save_quantized
    from engine.safetensors_io import snapshot_tensors
    ours = load_dense(write_hf(tmp_path / "hf", *CASES["dense-layer-1-normalized-f32"]))
    config = save_quantized(ours, tmp_path / "q", "rtn", group_size=8)                # symmetric=False
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    stored, back = dict(snapshot_tensors(tmp_path / "q")), load_quantized(tmp_path / "q")
    for name in ("model.layers.0.mlp.experts.5.gate_proj", "model.layers.3.mlp.experts.0.down_proj"):
        state = {part: stored[f"{name}.{part}"] for part in ("weight_packed", "weight_scale", "weight_zero_point",
                                                             "weight_shape")}
        weight = compressor.decompress(state, scheme)["weight"].float()
        assert torch.equal(weight, back.get_submodule(name).dequantize())
        assert torch.equal(weight, ours.get_submodule(name).dequantize())


@torch.no_grad()
@pytest.mark.parametrize("method, options, kind", [
    ("rtn", dict(group_size=8), "compressed-tensors int4 asym"), ("nvfp4", {}, "compressed-tensors nvfp4"),
    ("awq", dict(group_size=8), "awq"), ("nf4", dict(group_size=32), "bitsandbytes"),
    ("compressed-tensors", dict(format="float-quantized", block=16), "compressed-tensors fp8")])
def test_what_serving_says_transformers_refuses_for_moe_it_does(method, options, kind, tmp_path):
    """serving.MOE_TRANSFORMERS' refusals, seen: transformers 5.25 raises, or computes other logits."""
    from engine.checkpoints.serving import MOE_TRANSFORMERS
    from engine.formats.quantized_checkpoints import save_quantized
    assert MOE_TRANSFORMERS[kind][0] == "refuses"
    widths = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, head_dim=16)   # NF4, NVFP4 blocks
    ours = load_dense(write_hf(tmp_path / "hf", dict(mlp_only_layers=[1], **widths), torch.float32, None))
    save_quantized(ours, tmp_path / "q", method, ids(2), **options)
    config = {"awq": transformers.AwqConfig(bits=4, backend="torch_awq"), "nf4": None}.get(
        method, transformers.CompressedTensorsConfig(dequantize=True))
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=config,
                                                                  dtype=torch.float32).eval()
    except (RuntimeError, AssertionError, ValueError):
        return
    assert (theirs(ids()).logits - ours(ids())).abs().max() > 0.1
