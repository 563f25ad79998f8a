"""The engine's model against transformers' own Llama / Qwen2 / Qwen3 classes, checkpoints both ways.

Checkpoints are random-initialized and written by transformers itself (tied and untied heads, one file and sharded,
bf16 / f16 / f32); norm weights and biases get random values, so a missing norm or bias shows in the logits.
"""
import copy
import json

import pytest
import torch

from engine.loaders import load_dense, save_dense
from engine.qwen3 import Qwen3, Qwen3Config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, initializer_range=0.15)   # 24: 1/sqrt(24) is inexact
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}        # with theta 5e5, head_dim 24: frequencies in each regime
HF_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
CASES = {
    "llama-llama3-biases-untied-bf16-sharded": ("llama", dict(attention_bias=True, mlp_bias=True, rope_theta=5e5,
                                                              rope_scaling=LLAMA3), torch.bfloat16, "30KB"),
    "llama-tied-f16": ("llama", dict(tie_word_embeddings=True), torch.float16, None),
    "llama-linear-rope-f32-sharded": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
                                      torch.float32, "60KB"),
    "qwen2-untied-bf16-sharded": ("qwen2", {}, torch.bfloat16, "30KB"),
    "qwen2-tied-f32": ("qwen2", dict(tie_word_embeddings=True, rope_theta=5000.0), torch.float32, None),
    "qwen3-tied-f16-sharded": ("qwen3", dict(tie_word_embeddings=True), torch.float16, "30KB"),
    "qwen3-bias-untied-bf16": ("qwen3", dict(attention_bias=True), torch.bfloat16, None),
}


def hf_class(model_type, suffix="ForCausalLM"):
    return getattr(transformers, HF_CLASSES[model_type] + suffix)


@torch.no_grad()
def randomize_norms_and_biases(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def write_hf_checkpoint(directory, model_type, extra, dtype, shard_size):
    torch.manual_seed(0)
    hf = hf_class(model_type)(hf_class(model_type, "Config")(**SIZES, **copy.deepcopy(extra)))  # it edits dicts
    randomize_norms_and_biases(hf)
    hf.to(dtype).save_pretrained(directory, max_shard_size=shard_size or "10GB")
    return directory


def ids(seed=1):
    return torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory):
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids()).logits


@pytest.mark.parametrize("case", CASES)
def test_transformers_checkpoint_loads_with_equal_logits(case, tmp_path):
    model_type, extra, dtype, shard_size = CASES[case]
    directory = write_hf_checkpoint(tmp_path / "hf", model_type, extra, dtype, shard_size)
    assert (directory / "model.safetensors.index.json").exists() == bool(shard_size)
    ours = load_dense(directory, dtype=torch.float32)
    assert ours.cfg.model_type == model_type and ours.cfg.torch_dtype == str(dtype).removeprefix("torch.")
    with torch.no_grad():
        assert (ours(ids()) - hf_logits(directory)).abs().max() < 1e-4


def test_the_comparison_sees_a_missing_bias_norm_or_rope_scaling(tmp_path):
    directory = write_hf_checkpoint(tmp_path / "hf", *CASES["llama-llama3-biases-untied-bf16-sharded"])
    reference, ours = hf_logits(directory), load_dense(directory, dtype=torch.float32)
    layer = ours.model.layers[1]
    changes = {"rope scaling": lambda: setattr(ours.cfg, "rope_scaling", None),
               "o_proj bias": lambda: layer.self_attn.o_proj.bias.zero_(),
               "mlp bias": lambda: layer.mlp.up_proj.bias.zero_(),
               "norm weight": lambda: layer.input_layernorm.weight.fill_(1.0)}
    with torch.no_grad():
        for name, change in changes.items():
            change()
            assert (ours(ids()) - reference).abs().max() > 1e-2, name


@pytest.mark.parametrize("case", ["llama-llama3-biases-untied-bf16-sharded", "qwen2-untied-bf16-sharded",
                                  "qwen3-tied-f16-sharded"])
def test_half_precision_logits_are_transformers_eager_logits_bit_for_bit(case, tmp_path):
    """Run in the stored dtype: RMSNorm, RoPE tables and softmax in float32, the rest in bf16 / f16, as there."""
    model_type, extra, dtype, shard_size = CASES[case]
    directory = write_hf_checkpoint(tmp_path / "hf", model_type, extra, dtype, shard_size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    ours = load_dense(directory, dtype=dtype)
    with torch.no_grad():
        expected, got = hf.eval()(ids()).logits, ours(ids())
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("case", ["llama-llama3-biases-untied-bf16-sharded", "qwen2-tied-f32",
                                  "qwen3-bias-untied-bf16"])
def test_cached_generation_equals_transformers_generate(case, tmp_path):
    directory = write_hf_checkpoint(tmp_path / "hf", *CASES[case])
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = ids()[:, :5]
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, min_new_tokens=10,
                           do_sample=False)
    assert torch.equal(load_dense(directory, dtype=torch.float32).generate(prompt, 10), expected)


@pytest.mark.parametrize("case", ["llama-llama3-biases-untied-bf16-sharded", "qwen2-tied-f32",
                                  "qwen3-bias-untied-bf16"])
def test_engine_checkpoint_loads_in_transformers_with_equal_logits(case, tmp_path):
    model_type, extra, _, _ = CASES[case]
    cfg = Qwen3Config(model_type=model_type, **SIZES, **extra)
    torch.manual_seed(0)
    ours = Qwen3(cfg).eval()
    randomize_norms_and_biases(ours)
    save_dense(ours, tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["architectures"] == [cfg.architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32).eval()
    assert type(hf).__name__ == cfg.architecture
    with torch.no_grad():
        assert (hf(ids()).logits - ours(ids())).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", HF_CLASSES)
def test_keys_a_config_leaves_out_take_transformers_defaults(model_type):
    raw = {"model_type": model_type, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    if model_type != "llama":
        raw["num_key_value_heads"] = 2                   # Qwen's default (32) would not divide 2 heads
    hf = hf_class(model_type, "Config")(**raw)
    ours = Qwen3Config.from_hf(raw)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.head_dim, ours.num_key_value_heads, ours.tie_word_embeddings) == \
           (head_dim, hf.num_key_value_heads, hf.tie_word_embeddings)
    assert (ours.bos_token_id, ours.eos_token_id, ours.max_position_embeddings, ours.rope_theta) == \
           (hf.bos_token_id, hf.eos_token_id, hf.max_position_embeddings, hf.rope_parameters["rope_theta"])


@pytest.fixture
def nf4_pair(tiny_model, tmp_path):
    """An engine NF4 checkpoint loaded twice: by the engine, and by transformers' own loader into bitsandbytes'
    Linear4bit layers."""
    bnb = pytest.importorskip("bitsandbytes")
    from engine.checkpoints.models import load_model
    from engine.formats.quantized_checkpoints import save_quantized
    save_quantized(copy.deepcopy(tiny_model), tmp_path / "nf4", "nf4", group_size=32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "nf4", dtype=torch.float32).eval()
    layers = {name: m for name, m in theirs.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 7 * tiny_model.cfg.num_hidden_layers
    return bnb, load_model(tmp_path / "nf4"), theirs, layers


def test_bitsandbytes_decodes_the_nf4_checkpoint_to_the_engines_weights_exactly(nf4_pair):
    """What can be compared exactly is: bitsandbytes' own dequantization of every layer equals the engine's."""
    bnb, ours, _, layers = nf4_pair
    mine = dict(ours.named_modules())
    for name, layer in layers.items():
        theirs = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        assert torch.equal(theirs, mine[name].dequantize()), name


def _bnb_logits(theirs, layers, fast_path, ids):
    """bitsandbytes' forward with its CPU fast path (a fused kernel on bf16 activations and scales, used where the CPU
    has AVX512-BF16) forced on or off; off, each Linear4bit dequantizes and multiplies in float32."""
    for layer in layers.values():
        layer.support_avx512bf16_for_cpu = fast_path
    with torch.no_grad():
        return theirs(ids).logits


@pytest.mark.parametrize("fast_path", [False, True], ids=["float32-path", "avx512bf16-path"])
def test_transformers_runs_the_nf4_checkpoint_as_the_engine_does(nf4_pair, fast_path):
    """transformers + bitsandbytes compute the engine's logits, within bitsandbytes' own arithmetic on this CPU.

    Its float32 path is a float32 matmul of the same weights: the engine's logits to float32 rounding. Its fast path
    rounds activations and scales to bf16, so it is held to its own distance from its float32 path (measured here,
    on this CPU) plus float32 rounding: a fixed tolerance held on one CPU and failed on another."""
    bnb, ours, theirs, layers = nf4_pair
    if fast_path and not bnb.functional.has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes has no fast path to force here")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours(ids)
    scale = mine.abs().max()
    exact = _bnb_logits(theirs, layers, False, ids)
    assert (mine - exact).abs().max() < 1e-4 * scale
    if fast_path:
        fast = _bnb_logits(theirs, layers, True, ids)
        own = (fast - exact).abs().max()                  # bitsandbytes' fast path against its float32 path
        assert 0 < own < 0.05 * scale                     # it did run (bf16 moves something), and stayed near
        assert (mine - fast).abs().max() <= own + 1e-4 * scale
