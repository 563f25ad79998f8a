"""Qwen3-MoE's sparse MLP (engine/qwen3.py puts one in each sparse layer, cfg.sparse(i)): the router `mlp.gate`
[experts, hidden] scores each token, softmax in float32, its top k experts (norm_topk_prob: their weights
renormalized to sum 1) each run their own SwiGLU MLP `mlp.experts.E` on it, and the outputs are summed with those
weights. The router is a plain weight, not an nn.Linear, so quantization (which replaces nn.Linears) leaves it dense;
each expert's linears are ordinary nn.Linears, named as transformers saves them (mlp.experts.E.gate_proj ...).

Qwen2-MoE adds a shared expert that every token runs, `mlp.shared_expert` (a SwiGLU MLP of
cfg.shared_expert_intermediate_size), its output weighted per token by sigmoid(`mlp.shared_expert_gate` . x), a
[1, hidden] weight that is, like the router, a plain weight and stays dense:

    out = sum_k w_k expert_k(x) + sigmoid(g . x) shared_expert(x)
"""
import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Qwen3-MoE's `mlp.gate`: weight [experts, hidden]. x [N, hidden] -> (weights [N, k] in x's dtype, experts
    [N, k] long): each token's k most probable experts and their softmax probabilities (float32), renormalized to
    sum 1 if cfg.norm_topk_prob."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.in_features = cfg.hidden_size        # as a linear's: a calibration hook reads every token it routes

    def forward(self, x):
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, -1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's `mlp.shared_expert_gate`: weight [1, hidden]. x [N, hidden] -> sigmoid(x . weight) [N, 1]."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, cfg.hidden_size))

    def forward(self, x):
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    """x [B, T, hidden] -> sum over each token's k experts of weight * expert(x) [B, T, hidden]. Each expert runs
    once, on exactly the tokens routed to it (so a calibration hook on its linears sees those and no others).
    mlp(cfg, width): the model's own MLP class (qwen3.MLP), one of cfg.moe_intermediate_size per expert.
    `running`: the experts that run (None: all); a calibration capture of some experts' inputs runs those alone.
    The shared expert (where cfg has one) runs first, so that a capture of its inputs alone stops before the others."""

    def __init__(self, cfg, mlp):
        super().__init__()
        self.gate, self.running = Router(cfg), None
        self.experts = nn.ModuleList(mlp(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = mlp(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = SharedExpertGate(cfg)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        shared = self.shared_expert_gate(flat) * self.shared_expert(flat) if hasattr(self, "shared_expert") else None
        weights, chosen = self.gate(flat)                              # [N, k] each
        # the N * k (token, slot) pairs grouped by expert: slot s is token s // k's choice s % k
        slots = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(flat)
        for e, (expert, mine) in enumerate(zip(self.experts, slots.split(counts))):
            if len(mine) and (self.running is None or e in self.running):     # (an expert no token chose: not run)
                tokens = mine // self.gate.top_k
                out.index_add_(0, tokens, expert(flat[tokens]) * weights.flatten()[mine, None])
        return (out if shared is None else out + shared).view_as(x)
