"""KL statistics: zero for identical models, positive otherwise, and the same numbers a direct formula gives."""
import math

import torch

from engine.evaluation import kl_per_position, kl_stats, perplexity


def test_kl_of_a_distribution_with_itself_is_zero():
    logits = torch.randn(3, 10, 256, generator=torch.Generator().manual_seed(0))
    stats = kl_stats(logits, logits.clone())
    assert stats["kl_nats"] == 0 and stats["kl_p99"] == 0 and stats["same_top_pct"] == 100


def test_kl_is_nonnegative_and_matches_the_definition():
    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    kl = kl_per_position(p, q)
    assert (kl >= 0).all()
    P, Q = p.double().softmax(-1), q.double().softmax(-1)
    assert torch.allclose(kl, (P * (P / Q).log()).sum(-1))
    stats = kl_stats(p, q)
    assert math.isclose(stats["kl_stderr"], kl.std().item() / math.sqrt(50), rel_tol=1e-9)
    assert stats["kl_p99"] >= stats["kl_nats"] > 0


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    assert math.isclose(perplexity(torch.zeros(4, 5, 256), torch.zeros(4, 5, dtype=torch.long)), 256, rel_tol=1e-9)
