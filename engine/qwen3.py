"""A tiny Qwen3, identical in math to transformers' Qwen3ForCausalLM, with Hugging Face parameter names.

    h = embed(ids)
    for each layer:   h = h + o_proj(attention(q_norm(q_proj(n1(h))), k_norm(k_proj(n1(h))), v_proj(n1(h))))
                      h = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))
    logits = lm_head(norm(h))                        (lm_head tied to embed by default)

RMSNorm runs in float32 (x / sqrt(mean(x^2) + eps), then the weight); RoPE rotates the two halves of each head
(rotate_half); attention is grouped-query (each K/V head serves num_attention_heads / num_key_value_heads query
heads), causal, scaled by 1/sqrt(head_dim). q_norm / k_norm are RMSNorms over head_dim, applied before RoPE.

Every linear is an nn.Linear until a quantization method swaps it for a QuantLinear; this file knows no format.
The one hook for formats is `set_kv_transform(fn)`: fn(k, v, layer_index) -> (k, v) sees each new K (after RoPE)
and V, [batch, kv_heads, T, head_dim], before they are cached and attended to (KV-cache quantization).
"""
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class Qwen3Config:
    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    initializer_range: float = 0.02
    torch_dtype: str = "float32"

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim")
        bad = [name for name in sizes if not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        if bad:
            raise ValueError(f"config sizes must be positive integers: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, raw: dict) -> "Qwen3Config":
        """A config.json dict (transformers 4.x: rope_theta, torch_dtype; 5.x: rope_parameters, dtype)."""
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required key(s) {missing}")
        if raw.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"model_type is {raw.get('model_type')!r}, expected 'qwen3'")
        if raw.get("hidden_act", "silu") != "silu" or raw.get("use_sliding_window"):
            raise ValueError(f"only SiLU MLPs with full attention are implemented, got hidden_act="
                             f"{raw.get('hidden_act')!r}, use_sliding_window={raw.get('use_sliding_window')!r}")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
            raise ValueError(f"only default RoPE is implemented, got {rope or raw.get('rope_scaling')}")
        heads = raw["num_attention_heads"]
        return cls(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
                   head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                   rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
                   max_position_embeddings=raw.get("max_position_embeddings", 4096),
                   tie_word_embeddings=raw.get("tie_word_embeddings", True),
                   attention_bias=raw.get("attention_bias", False),
                   initializer_range=raw.get("initializer_range", 0.02),
                   torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))

    def to_hf(self) -> dict:
        """config.json for transformers: both the 4.x and the 5.x key styles, so either version reads it."""
        raw = asdict(self)
        raw.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", dtype=self.torch_dtype,
                   rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
                   hidden_act="silu", use_cache=True, use_sliding_window=False, sliding_window=None,
                   max_window_layers=self.num_hidden_layers, attention_dropout=0.0,
                   bos_token_id=None, eos_token_id=None)
        return raw


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim, positions, theta):
    """positions [T] -> (cos, sin) [T, head_dim], each frequency repeated for the two halves."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]: rotate each (i, i + D/2) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class KVCache:
    """Keys and values of the tokens seen so far, per layer: [B, kv_heads, T, head_dim]."""

    def __init__(self, num_layers):
        self.keys, self.values = [None] * num_layers, [None] * num_layers

    @property
    def length(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, index, k, v):
        if self.keys[index] is not None:
            k, v = torch.cat((self.keys[index], k), 2), torch.cat((self.values[index], v), 2)
        self.keys[index], self.values[index] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int):
        super().__init__()
        self.index, self.cfg = index, cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.kv_transform = None

    def forward(self, x, cos, sin, cache=None):
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_norm(self.q_proj(x).view(b, t, -1, cfg.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_transform is not None:
            k, v = self.kv_transform(k, v, self.index)
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        past = k.shape[2] - t
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(cfg.head_dim)
        causal = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1).to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3(nn.Module):
    """ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    def _init(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids, cache: KVCache | None = None):
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, tokens], got shape {tuple(ids.shape)}")
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        cos, sin = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_theta)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache)
        return self.lm_head(self.model.norm(h))

    def set_kv_transform(self, fn):
        """fn(k, v, layer_index) -> (k, v), or None to remove. See the module docstring."""
        for layer in self.model.layers:
            layer.self_attn.kv_transform = fn

    @torch.no_grad()
    def generate(self, ids, max_new_tokens, temperature=0.0, generator=None):
        """Greedy (temperature 0) or sampled continuation with a KV cache: ids [B, T] -> [B, T + max_new_tokens]."""
        cache = KVCache(self.cfg.num_hidden_layers)
        logits = self(ids, cache)[:, -1]
        out = [ids]
        for _ in range(max_new_tokens):
            if temperature > 0:
                probs = (logits.float() / temperature).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            logits = self(nxt, cache)[:, -1]
        return torch.cat(out, 1)
