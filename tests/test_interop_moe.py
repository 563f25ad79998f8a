"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM: checkpoints transformers writes (some layers dense,
either routing normalization, sharded, half precision) load with logits within 1e-5 of its own, and the engine's
dense checkpoint loads in transformers with the same logits."""
import pytest
import torch

from engine.loaders import load_dense, save_dense

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

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
