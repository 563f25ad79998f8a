"""A tiny Qwen3, identical in math to transformers' Qwen3ForCausalLM, with Hugging Face parameter names.

    h = embed(ids)
    for each layer:   h = h + o_proj(attention(q_norm(q_proj(n1(h))), k_norm(k_proj(n1(h))), v_proj(n1(h))))
                      h = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))
    logits = lm_head(norm(h))                        (lm_head tied to embed by default)

RMSNorm runs in float32 (x / sqrt(mean(x^2) + eps), then the weight); RoPE rotates the two halves of each head
(rotate_half) by position * inv_freq, inv_freq_i = theta^(-2i / head_dim); attention is grouped-query (each K/V head
serves num_attention_heads / num_key_value_heads query heads), causal, scaled by 1/sqrt(head_dim), its softmax in
float32. q_norm / k_norm are RMSNorms over head_dim, applied before RoPE.

The same module serves Qwen2 and Llama, chosen by `model_type` as transformers' own classes are:

    model_type   transformers class   q/k norm   biases
    qwen3        Qwen3ForCausalLM     yes        q, k, v, o if attention_bias
    qwen2        Qwen2ForCausalLM     no         q, k, v always, o never
    llama        LlamaForCausalLM     no         q, k, v, o if attention_bias; gate, up, down if mlp_bias
    qwen3_moe    Qwen3MoeForCausalLM  yes        q, k, v, o if attention_bias
    qwen2_moe    Qwen2MoeForCausalLM  no         q, k, v always, o never

Qwen3-MoE and Qwen2-MoE (a Qwen3MoeConfig) replace the MLP of their sparse layers (cfg.sparse(i)) by a
SparseMoeBlock, a router and experts that are this file's MLPs (Qwen2-MoE's with a shared expert beside them):
engine/qwen3_moe.py.

RoPE may be rescaled (`rope_scaling`, any family): "linear" divides every inv_freq by factor; "llama3" keeps the
frequencies whose wavelength 2 pi / inv_freq is under original_max_position_embeddings / high_freq_factor, divides
those above original_max_position_embeddings / low_freq_factor by factor, and interpolates in between.

Every linear is an nn.Linear until a quantization method swaps it for a QuantLinear; this file knows no format.
The one hook for formats is `set_kv_transform(fn)`: fn(k, v, layer_index) -> (k, v) sees each new K (after RoPE)
and V, [batch, kv_heads, T, head_dim], before they are cached and attended to (KV-cache quantization).
`set_kv_transform(fn, window=R)` keeps the R most recent positions exact, as caches with a full-precision residual
do: the model keeps the exact K/V (cached too), calls fn(k, v, layer_index, start) on the positions from `start` on
that fn has not coded yet and takes back the coded K/V of the first m of them (fewer than given when fn codes whole
blocks of tokens); query position t then attends to position s through the exact K and V if t - s < R, through
the coded ones otherwise (R = 0: always coded, as the plain hook). Positions left uncoded must lie in the window.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import Qwen3Config, Qwen3MoeConfig  # noqa: F401  (the MoE config, imported with the model)


class RMSNorm(nn.Module):
    fast = False                     # torch's fused rms_norm on float32 (set_fast; the same values, one op)

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if self.fast and x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inv_frequencies(cfg):
    """[head_dim / 2] float32 RoPE frequencies theta^(-2i/d), rescaled as cfg.rope_scaling says."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_tables(cfg, positions):
    """positions [T] -> (cos, sin) [T, head_dim] in float32, each frequency repeated for the two halves."""
    freqs = positions.float()[:, None] * inv_frequencies(cfg).to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]: rotate each (i, i + D/2) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


_rotations = [None, None]      # (cos, the matrices rope_matrices made from it): the layers of a forward share them


def rope_matrices(cos, sin):
    """(cos, sin) [T, d] -> R [T, d, d] with x @ R[t] = apply_rope(x, cos, sin) at position t (up to rounding): RoPE
    as one product (the fast path's), made once per forward pass, whose layers all get the same tables."""
    if _rotations[0] is not cos:
        half = cos.shape[-1] // 2
        r = torch.diag_embed(cos)
        i = torch.arange(half, device=cos.device)
        r[:, i + half, i] = -sin[:, :half]
        r[:, i, i + half] = sin[:, half:]
        _rotations[:] = cos, r
    return _rotations[1]


class KVCache:
    """Keys and values of the tokens seen so far, per layer: [B, kv_heads, T, head_dim]. Under a windowed KV
    transform they are exact, and the transform's coded K/V of the first positions are kept beside them."""

    def __init__(self, num_layers):
        self.keys, self.values = [None] * num_layers, [None] * num_layers
        self.coded_keys, self.coded_values = [None] * num_layers, [None] * num_layers
        self._room = {}                  # (coded, layer) -> the K and V buffers keys / values are views of

    @property
    def length(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def coded_length(self, index):
        return 0 if self.coded_keys[index] is None else self.coded_keys[index].shape[2]

    def update(self, index, k, v, coded=False):
        """Append k, v [B, kv_heads, t, d] to layer `index`'s: views of buffers grown by an eighth when full, so a
        step writes its token's K/V where concatenating copied the whole cache (8192 positions: 380 MB a step)."""
        keys, values = (self.coded_keys, self.coded_values) if coded else (self.keys, self.values)
        n, t, room = 0 if keys[index] is None else keys[index].shape[2], k.shape[2], self._room.get((coded, index))
        if room is None or room[0].shape[2] < n + t or room[0].dtype != k.dtype:
            room = tuple(a.new_empty(*a.shape[:2], n + t + max(256, (n + t) // 8), a.shape[3]) for a in (k, v))
            if n:
                room[0][:, :, :n], room[1][:, :, :n] = keys[index], values[index]
            self._room[coded, index] = room
        room[0][:, :, n:n + t], room[1][:, :, n:n + t] = k, v
        keys[index], values[index] = room[0][:, :, :n + t], room[1][:, :, :n + t]
        return keys[index], values[index]

    def windowed(self, index, k, v, fn, window):
        """The new k, v [B, kv_heads, t, d] under a windowed transform fn -> (exact K, V, coded K, V (exact where fn
        has not coded yet), [B, kv_heads, L, d] each, basis None). A stored cache (formats/kv/kv_store.py) gives the
        same, its exact K/V filled with codes where no query reads them any more, and may give basis (m_k, m_v) [d, d]
        orthogonal: its K are k @ m_k, its V v @ m_v (attention rotates each query and output, not each position)."""
        k, v = self.update(index, k, v)
        done = self.coded_length(index)
        k_hat, v_hat = self.update(index, *fn(k[:, :, done:], v[:, :, done:], index, done), coded=True)
        n = k_hat.shape[2]
        if k.shape[2] - n > window:
            raise ValueError(f"the KV transform left {k.shape[2] - n} positions uncoded, more than its window "
                             f"of {window}")
        return k, v, torch.cat((k_hat, k[:, :, n:]), 2), torch.cat((v_hat, v[:, :, n:]), 2), None


# Attention's scores [B, heads, T, L] are float32, held about three times over (scores, masked copy, softmax): T = L
# = 16384 at 4 heads would be 13 GB. Queries go in blocks of rows whose scores hold at most SCORE_ELEMENTS floats (64
# MB), each against the positions its queries see (a causal block's later columns are masked): equal up to rounding.
SCORE_ELEMENTS = 1 << 24


def score_rows(batch, heads, length):
    """Query rows per block of attention over `length` positions."""
    return max(1, SCORE_ELEMENTS // (batch * heads * length))


def attention_bytes(cfg, batch, tokens):
    """Peak bytes of attention's scores in a forward pass of ids [batch, tokens]: three float32 copies of a block."""
    rows = min(tokens, score_rows(batch, cfg.num_attention_heads, tokens))
    return 3 * 4 * batch * cfg.num_attention_heads * rows * tokens


class Attention(nn.Module):
    fast = False                     # set_fast: torch's scaled_dot_product_attention where no KV transform is set

    def __init__(self, cfg: Qwen3Config, index: int):
        super().__init__()
        self.index, self.cfg = index, cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.kv_transform, self.kv_window = None, None
        self.qkv = None                  # a projection of q, k and v at once (engine.runtime fuses them), or None

    def forward(self, x, cos, sin, cache=None):
        if self.fast and self.kv_transform is None:
            return self._fast(x, cos, sin, cache)
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v = self._project(x)
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_transform is not None and self.kv_window is None:
            k, v = self.kv_transform(k, v, self.index)
        coded = basis = None
        if self.kv_window is not None:                   # without a cache: one forward's own, thrown away after
            k, v, *coded, basis = (cache or KVCache(self.index + 1)).windowed(self.index, k, v, self.kv_transform,
                                                                              self.kv_window)
        elif cache is not None:
            k, v = cache.update(self.index, k, v)
        past = k.shape[2] - t
        causal = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        if coded is not None:
            coded.append(torch.ones_like(causal).tril(past - self.kv_window))  # t - s >= window: the coded K/V
        rows, blocks = score_rows(b, cfg.num_attention_heads, k.shape[2]), []
        for i in range(0, t, rows):                    # a long sequence's queries, in blocks of rows: each block
            n = past + min(i + rows, t)                # against the positions its last query sees
            blocks.append(self._attend(q[:, :, i:i + rows], k[:, :, :n], v[:, :, :n], causal[i:i + rows, :n],
                                       coded and [c[:, :, :n] for c in coded[:2]] + [coded[2][i:i + rows, :n]],
                                       basis))
        out = torch.cat(blocks, 2)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _project(self, x):
        """x [B, T, hidden] -> q, k, v [B, T, heads, head_dim], from the fused projection where there is one."""
        b, t, _ = x.shape
        h, kv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        if self.qkv is not None:
            return self.qkv(x).view(b, t, -1, d).split((h, kv, kv), 2)
        return (proj(x).view(b, t, -1, d) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def _fast(self, x, cos, sin, cache):
        """forward in fewer ops, for a model that runs (set_fast): q, k and v from one projection where they are
        fused, RoPE as one product by each position's rotation (rope_matrices; on q and k at once where no norm sits
        between), torch's scaled_dot_product_attention (its softmax in the activations' dtype, as this file's in
        float32 models), or for one query two products (its softmax in float32). The same math: equal up to
        rounding."""
        b, t, _ = x.shape
        h, kv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        plain = isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        rotation = rope_matrices(cos.to(x.dtype), sin.to(x.dtype))             # [t, d, d]

        def rope(z):                 # z [b, t, n, d] -> [b, n, t, d]: per position t one [b n, d] @ [d, d] (a bmm)
            return (z.transpose(0, 1).reshape(t, -1, d) @ rotation).view(t, b, -1, d).permute(1, 2, 0, 3)

        if self.qkv is not None and plain:
            qkv = self.qkv(x).view(b, t, -1, d)                             # [b, t, h + 2 kv, d]
            qk = rope(qkv[:, :, :h + kv])
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, :, h + kv:].transpose(1, 2)
        else:
            q, k, v = self._project(x)
            q, k, v = rope(self.q_norm(q)), rope(self.k_norm(k)), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        past = k.shape[2] - t
        if t == 1:                     # one query (a generated token): two products beat the fused kernel's one row
            scores = q.reshape(b, kv, h // kv, d) @ k.transpose(-1, -2) * d ** -0.5      # [b, kv, groups, L]
            out = (scores.float().softmax(-1).to(v.dtype) @ v).view(b, h, 1, d)
        else:
            mask = None if past == 0 else torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0, scale=d ** -0.5,
                                                 enable_gqa=h != kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _attend(self, q, k, v, causal, coded=None, basis=None):
        """Causal grouped-query attention [B, heads, T, d]. coded = (k_hat, v_hat, far): where far [T, L], the score
        comes from k_hat and the weight multiplies v_hat. Where a query can look, far holds whole columns [0, a) (older
        than every query's window) and none of [b, L): only the band [a, b), at most T wide, needs both K/V (a decode
        step's band is one column). basis (m_k, m_v): k, v, k_hat, v_hat hold K/V in it (KVCache.windowed): q (k m_k)^T
        is read as (q m_k^T) k^T, p (v m_v) as (p v) m_v. A fast model (set_fast) reads several queries through torch's
        fused attention, which never holds the [T, L] scores (a long prompt's prefill over a coded cache), the band's
        coded K/V as extra columns that only the queries far from them see; one query's step stays a product, faster
        than that kernel for one row."""
        cfg = self.cfg
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if coded is not None:
            k_hat, v_hat, far = coded
            a, b = int((far | ~causal).all(0).sum()), int((far & causal).any(0).sum())    # (the future is masked)
            if a == k.shape[2]:                        # every column coded (no window): no copy to make
                k, v = k_hat, v_hat
            elif a:
                k = torch.cat((k_hat[:, :, :a], k[:, :, a:]), 2)
                v = torch.cat((v_hat[:, :, :a], v[:, :, a:]), 2)
        if basis is not None:
            q = q @ basis[0].T
        b_, h, t, d = q.shape
        if self.fast and t > 1:                # torch's fused kernel; a band's columns enter twice, each copy masked
            mask = causal
            if coded is not None and b > a:
                band = far[:, a:b] & causal[:, a:b]
                mask = torch.cat((causal[:, :a], causal[:, a:b] & ~band, causal[:, b:], band), 1)
                k, v = torch.cat((k, k_hat[:, :, a:b]), 2), torch.cat((v, v_hat[:, :, a:b]), 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.head_dim ** -0.5,
                                                 enable_gqa=groups > 1)
            return out if basis is None else out @ basis[1]
        # The heads that share a KV head are rows of one product (head h reads KV head h // groups): K and V are
        # not copied once per head, which at a long context costs more than the products.
        scores = (q.reshape(b_, -1, groups * t, d) @ k.transpose(-1, -2)).view(b_, h, t, -1)
        scores = (scores * cfg.head_dim ** -0.5).float()                   # as transformers' eager path
        if coded is not None and b > a:
            band = far[:, a:b]
            k_band = k_hat[:, :, a:b].repeat_interleave(groups, 1)
            scores[..., a:b] = torch.where(band, (q @ k_band.transpose(-1, -2) * cfg.head_dim ** -0.5).float(),
                                           scores[..., a:b])
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (p.to(v.dtype).reshape(b_, -1, groups * t, p.shape[-1]) @ v).view(b_, h, t, -1)
        if coded is not None and b > a:
            v_band = (v_hat[:, :, a:b] - v[:, :, a:b]).repeat_interleave(groups, 1)
            out = out + p[..., a:b].masked_fill(~band, 0).to(v.dtype) @ v_band
        return out if basis is None else out @ basis[1]


class MLP(nn.Module):
    """SwiGLU of width `intermediate` (default cfg.intermediate_size; an expert's is cfg.moe_intermediate_size)."""

    def __init__(self, cfg: Qwen3Config, intermediate=None):
        super().__init__()
        intermediate = intermediate or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up = None              # a projection of gate and up at once (engine.runtime fuses them), or None

    def forward(self, x):
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, -1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sparse(index):
            from .qwen3_moe import SparseMoeBlock      # a sparse layer's alone: a dense model is read without it
            self.mlp = SparseMoeBlock(cfg, MLP)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        return self.mlp_residual(self.attention_residual(x, cos, sin, cache))

    # The two residual halves, apart so that a calibration walk can resume between them (calibration.py).
    def attention_residual(self, x, cos, sin, cache=None, context=None):
        """x + attention(norm(x)) [B, T, hidden]; context: o_proj's input [B, T, heads * d], when already known."""
        if context is not None:
            return x + self.self_attn.o_proj(context)
        return x + self.self_attn(self.input_layernorm(x), cos, sin, cache)

    def mlp_residual(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3(nn.Module):
    """ids [B, T] -> logits [B, T, vocab], in the parameters' dtype. Qwen2 and Llama too (cfg.model_type)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    def _init(self, module):
        """Every weight but a norm's (a linear's, the embedding's, a MoE router's) drawn from N(0, initializer_range),
        every bias 0, as transformers initializes them."""
        if isinstance(getattr(module, "weight", None), nn.Parameter) and not isinstance(module, RMSNorm):
            nn.init.normal_(module.weight, std=self.cfg.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids, cache: KVCache | None = None, last_only=False):
        """ids [B, T] -> logits [B, T, vocab] (last_only: [B, 1, vocab], the last position's, which is all generate
        reads: the head's product for one position instead of T)."""
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, tokens], got shape {tuple(ids.shape)}")
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        cos, sin = rope_tables(self.cfg, positions)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache)
        return self.lm_head(self.model.norm(h[:, -1:] if last_only else h))

    def set_fast(self, fast=True):
        """Run with torch's fused kernels (F.rms_norm on float32, scaled_dot_product_attention for several queries,
        under a KV transform too; one query's step as two products), as engine.runtime.prepare does for generate and
        eval: the same math in fewer ops, equal up to rounding; off, this file computes as transformers' eager path."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.fast = fast

    def set_kv_transform(self, fn, window=None):
        """fn(k, v, layer_index) -> (k, v), or None to remove; with window R (an int >= 0) the windowed hook,
        fn(k, v, layer_index, start). See the module docstring."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"KV window={window!r}: must be an integer >= 0 or None")
        for layer in self.model.layers:
            layer.self_attn.kv_transform, layer.self_attn.kv_window = fn, None if fn is None else window

    @torch.inference_mode()            # no_grad's speed and less: no version counters (7% a decode step)
    def generate(self, ids, max_new_tokens, temperature=0.0, generator=None, on_token=None, cache=None,
                 prefill_chunk=None):
        """Greedy (temperature 0) or sampled continuation with a KV cache: ids [B, T] -> [B, T + max_new_tokens];
        on_token(ids [B, 1]) gets each new token as it is chosen. Logits that are not finite are a ValueError, not a
        token picked from NaNs; more tokens than the model's context one before any work. Any temperature > 0 samples
        (the logits shifted by their maximum first: a tiny temperature is greedy, not NaN). cache: an empty one to fill
        (a KVCache by default; a stored one, formats/kv/kv_store.py); prefill_chunk: the prompt read this many tokens
        at a time, attention's scores [chunk, T], not [T, T] (a long prompt's peak memory)."""
        context = self.cfg.max_position_embeddings
        if ids.shape[1] + max_new_tokens > context:
            raise ValueError(f"the prompt's {ids.shape[1]} tokens and {max_new_tokens} new ones exceed the model's "
                             f"context of {context} tokens")
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
        cache = KVCache(self.cfg.num_hidden_layers) if cache is None else cache
        if cache.length:
            raise ValueError(f"generate needs an empty cache; this one holds {cache.length} positions")
        chunk = prefill_chunk or ids.shape[1]
        for first in range(0, ids.shape[1], chunk):
            logits = self(ids[:, first:first + chunk], cache, last_only=True)[:, -1]
        out = [ids]
        for step in range(max_new_tokens):
            if not bool(torch.isfinite(logits).all()):
                raise ValueError(f"the model's logits are not finite at new token {step}: its forward pass "
                                 "overflowed float32 or computed with a NaN; nothing is generated from them")
            if temperature > 0:
                shifted = logits.double() - logits.double().amax(-1, keepdim=True)     # float64: 5e-324 is
                probs = (shifted / temperature).softmax(-1)                              # a temperature there
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if step + 1 < max_new_tokens:                 # the last token needs no logits after it
                logits = self(nxt, cache, last_only=True)[:, -1]
        return torch.cat(out, 1)
