"""Our dense checkpoints against transformers' own Qwen3ForCausalLM, in both directions."""
import pytest
import torch

from engine.loaders import load_dense, save_dense

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "ck")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - tiny_model(ids)).abs().max() < 1e-4


def test_transformers_checkpoint_loads_in_engine_with_equal_logits(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():                                      # random norm weights, so q/k-norm are really tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_dense(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-4
