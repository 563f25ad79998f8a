"""How much did quantization hurt? Statistics of the next-token distributions, as llama.cpp reports them.

For each held-out position t, with P the reference model's distribution and Q the quantized one's:

    KL_t = sum_v P_t(v) (log P_t(v) - log Q_t(v))        (nats; >= 0, = 0 iff P_t = Q_t)

We report the mean with its standard error, the 99th percentile (the bad tail that a mean hides), and how often
both models put the same token on top. KL, unlike perplexity, cannot be improved by noise: an overfit model's
held-out perplexity sometimes drops when quantization perturbs it, which says nothing about quality.
"""
import math

import torch


def kl_per_position(ref_logits, logits):
    """[..., vocab] x2 -> KL(P_ref || P) per position [...], in nats, computed in float64."""
    logp = torch.log_softmax(ref_logits.double(), -1)
    logq = torch.log_softmax(logits.double(), -1)
    p = logp.exp()
    return (torch.xlogy(p, p) - p * logq).sum(-1).clamp_min(0)       # xlogy: 0 log 0 = 0 where P(v) = 0


def kl_stats(ref_logits, logits):
    """{'kl_nats', 'kl_stderr', 'kl_p99', 'same_top_pct'} over all positions."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    kl = kl_per_position(ref_logits, logits).flatten()
    same = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return {"kl_nats": kl.mean().item(),
            "kl_stderr": (kl.std().item() / math.sqrt(kl.numel())) if kl.numel() > 1 else 0.0,
            "kl_p99": torch.quantile(kl, 0.99).item(),
            "same_top_pct": 100.0 * same}


def perplexity(logits, targets):
    """exp(mean cross-entropy) of next-byte targets [...] under logits [..., vocab]."""
    nll = torch.nn.functional.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return math.exp(nll.item())


@torch.no_grad()
def held_out_logits(model, windows, batch_size=16):
    """Logits [n, seq_len, vocab] (float32) for held-out windows [n, seq_len + 1] (the last byte is only a target)."""
    return torch.cat([model(windows[i:i + batch_size, :-1]).float() for i in range(0, len(windows), batch_size)])
