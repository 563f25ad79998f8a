"""Qwen3Config: the configuration of the model family engine/qwen3.py runs (Qwen3, Qwen2, Llama; Qwen3-MoE and
Qwen2-MoE as its subclass Qwen3MoeConfig), read from and written to Hugging Face's config.json.

`from_hf` checks every field it reads for its exact type and range before anything is built (a size that is a bool
or a float, a layer count of a billion, a NaN epsilon, an unknown RoPE scaling, sliding-window attention: each a
ValueError naming the key), fills what config.json leaves out with the defaults transformers' own config classes
assume (HF_DEFAULTS), and `to_hf` writes the config back as transformers writes it.
"""
import math
from dataclasses import asdict, dataclass

REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_TYPES = ("qwen3_moe", "qwen2_moe")
# What transformers' config classes assume for a key that config.json leaves out (None: derived, as there).
HF_DEFAULTS = {
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "bos_token_id": None, "eos_token_id": None},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768,
              "bos_token_id": None, "eos_token_id": None},
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768,
                  "bos_token_id": None, "eos_token_id": None},
    "qwen2_moe": {"num_key_value_heads": 16, "head_dim": None, "max_position_embeddings": 32768,
                  "bos_token_id": None, "eos_token_id": None},
}
# Qwen3MoeConfig's own keys and transformers' defaults for them (num_experts: 5.x writes it as num_local_experts)
MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": (), "shared_expert_intermediate_size": 0},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": (), "shared_expert_intermediate_size": 5632},
}
ROPE_PARAMETERS = {"default": (), "linear": ("factor",),
                   "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
DTYPES = ("float32", "float16", "bfloat16")
MAX_SIZE = 2**31 - 1          # no tensor dimension of a real model comes near; beyond it is a corrupt config
MAX_LAYERS = 1000             # real models have at most a few hundred; the loader also counts the layers present
FLOAT32_TINY, FLOAT32_MAX = 2.0 ** -126, 3.4028234663852886e38     # RMSNorm and RoPE run in float32


def _model_type(value):
    if not isinstance(value, str) or value not in ARCHITECTURES:
        raise ValueError(f"config model_type={value!r}: this engine runs {sorted(ARCHITECTURES)}")
    return value


def _size(name, value, limit=MAX_SIZE):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"config {name}={value!r}: must be an integer in [1, {limit}]")
    return value


def _positive(name, value, allow_zero=False):
    """A finite real number > 0 (>= 0 with allow_zero), as a float; JSON integers are accepted, bools are not."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        ok = ok and math.isfinite(float(value)) and (value >= 0 if allow_zero else value > 0)
    except OverflowError:
        ok = False
    if not ok:
        raise ValueError(f"config {name}={value!r}: must be a finite {'non-negative' if allow_zero else 'positive'} "
                         f"number")
    return float(value)


def _flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"config {name}={value!r}: must be true or false")
    return value


def _token_id(name, value, many=False):
    if value is None:
        return None
    if many and isinstance(value, list) and value:
        return [_token_id(name, v) for v in value]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
        raise ValueError(f"config {name}={value!r}: must be a token id in [0, {MAX_SIZE}]"
                         f"{', a non-empty list of them' if many else ''} or null")
    return value


@dataclass
class Qwen3Config:
    model_type: str = "qwen3"
    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None            # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None       # None (default RoPE) or {"rope_type": ..., *ROPE_PARAMETERS[rope_type]}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        """Check every field's exact type and range (a bool is not a size), before any tensor exists."""
        _model_type(self.model_type)
        if (self.model_type in MOE_TYPES) != isinstance(self, Qwen3MoeConfig):
            raise ValueError(f"config model_type={self.model_type!r} goes with "
                             f"{'Qwen3MoeConfig' if self.model_type in MOE_TYPES else 'Qwen3Config'}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "max_position_embeddings"):
            _size(name, getattr(self, name))
        _size("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"config hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                                 f"{self.num_attention_heads} (and no head_dim is given)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _size("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config head_dim={self.head_dim}: must be even for RoPE")
        self.rms_norm_eps = _positive("rms_norm_eps", self.rms_norm_eps)
        if not FLOAT32_TINY <= self.rms_norm_eps <= 1:
            raise ValueError(f"config rms_norm_eps={self.rms_norm_eps!r}: must lie in [2^-126, 1] (a normal float32; "
                             f"real models use 1e-6 to 1e-5)")
        self.rope_theta = _positive("rope_theta", self.rope_theta)
        if self.rope_theta > FLOAT32_MAX:
            raise ValueError(f"config rope_theta={self.rope_theta!r}: must be a finite float32")
        self.initializer_range = _positive("initializer_range", self.initializer_range, allow_zero=True)
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            _flag(name, getattr(self, name))
        if self.model_type in ("qwen2", "qwen2_moe") and self.attention_bias:
            raise ValueError(f"config attention_bias=True: {self.model_type} has q/k/v biases always and no o_proj "
                             "bias")
        if self.model_type != "llama" and self.mlp_bias:
            raise ValueError(f"config mlp_bias=True: only llama has MLP biases, not {self.model_type}")
        self.rope_scaling = self._checked_rope_scaling()
        dtype = self.torch_dtype.removeprefix("torch.") if isinstance(self.torch_dtype, str) else self.torch_dtype
        if dtype not in DTYPES:
            raise ValueError(f"config dtype={self.torch_dtype!r}: must be one of {', '.join(DTYPES)}")
        self.torch_dtype = dtype
        self.bos_token_id = _token_id("bos_token_id", self.bos_token_id)
        self.eos_token_id = _token_id("eos_token_id", self.eos_token_id, many=True)

    def _checked_rope_scaling(self):
        scaling = self.rope_scaling
        if scaling is None:
            return None
        if not isinstance(scaling, dict):
            raise ValueError(f"config rope_scaling={scaling!r}: must be an object or null")
        kind = scaling.get("rope_type", "default")
        if not isinstance(kind, str) or kind not in ROPE_PARAMETERS:
            raise ValueError(f"config rope_type={kind!r}: this engine implements {', '.join(ROPE_PARAMETERS)}")
        keys = set(scaling) - {"rope_type"}
        if keys != set(ROPE_PARAMETERS[kind]):
            raise ValueError(f"config rope_scaling of type {kind} takes exactly {list(ROPE_PARAMETERS[kind])}, "
                             f"got {sorted(keys, key=str)}")
        if kind == "default":
            return None
        out = {"rope_type": kind}
        for key in ROPE_PARAMETERS[kind]:
            check = _size if key == "original_max_position_embeddings" else _positive
            out[key] = check(f"rope_scaling.{key}", scaling[key])
        if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"config rope_scaling.high_freq_factor={out['high_freq_factor']} must exceed "
                             f"low_freq_factor={out['low_freq_factor']}")
        return out

    def sparse(self, index):
        """Whether decoder layer `index` holds experts (a Qwen3MoeConfig says; a dense model's never do)."""
        return False

    @property
    def architecture(self):
        return ARCHITECTURES[self.model_type]

    @property
    def qk_norm(self):
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self):
        return self.attention_bias or self.model_type in ("qwen2", "qwen2_moe")

    @classmethod
    def from_hf(cls, raw: dict) -> "Qwen3Config":
        """A config.json dict (transformers 4.x: rope_theta, rope_scaling, torch_dtype; 5.x: rope_parameters,
        dtype). A key it leaves out takes transformers' default for that model_type."""
        if not isinstance(raw, dict):
            raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required key(s) {missing}")
        model_type = _model_type(raw.get("model_type", "qwen3"))
        architectures = raw.get("architectures")
        if architectures is not None and (not isinstance(architectures, list)
                                          or ARCHITECTURES[model_type] not in architectures):
            raise ValueError(f"config architectures={architectures!r}: model_type {model_type} is "
                             f"{ARCHITECTURES[model_type]}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config hidden_act={raw['hidden_act']!r}: only SiLU MLPs are implemented")
        defaults = HF_DEFAULTS[model_type]
        theta, scaling = _rope_from_hf(raw, defaults)
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads", defaults["num_key_value_heads"])
        moe = model_type in MOE_TYPES
        if model_type == "qwen2_moe" and raw.get("qkv_bias", True) is not True:
            raise ValueError(f"config qkv_bias={raw['qkv_bias']!r}: Qwen2-MoE's q/k/v biases are implemented, "
                             "not their absence")
        if model_type == "qwen3_moe" and raw.get("use_sliding_window", False) is not False:
            raise ValueError(f"config use_sliding_window={raw['use_sliding_window']!r}: qwen3_moe would slide every "
                             "layer's window; only full attention is implemented")
        new = Qwen3MoeConfig if moe else cls
        cfg = new(model_type=model_type, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                  intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
                  num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads,
                  head_dim=raw.get("head_dim", defaults["head_dim"]),
                  rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                  max_position_embeddings=raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
                  tie_word_embeddings=raw.get("tie_word_embeddings", False),
                  attention_bias=raw.get("attention_bias", False) if model_type in ("qwen3", "llama",
                                                                                   "qwen3_moe") else False,
                  mlp_bias=raw.get("mlp_bias", False) if model_type == "llama" else False,
                  initializer_range=raw.get("initializer_range", 0.02),
                  torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
                  bos_token_id=raw.get("bos_token_id", defaults["bos_token_id"]),
                  eos_token_id=raw.get("eos_token_id", defaults["eos_token_id"]),
                  **(_moe_from_hf(raw) if moe else {}))
        if model_type != "llama":
            _check_full_attention(raw, cfg.num_hidden_layers)
        return cfg

    def to_hf(self) -> dict:
        """config.json for transformers: both the 4.x and the 5.x key styles, so either version reads it."""
        raw = asdict(self)
        raw.update(architectures=[self.architecture], dtype=self.torch_dtype, hidden_act="silu", use_cache=True,
                   attention_dropout=0.0, rope_parameters={"rope_theta": self.rope_theta,
                                                           **(self.rope_scaling or {"rope_type": "default"})})
        if self.model_type in ("qwen2", "qwen2_moe"):
            del raw["attention_bias"]
        if isinstance(self, Qwen3MoeConfig):                 # transformers 4 reads num_experts, 5 num_local_experts
            raw.update(mlp_only_layers=list(self.mlp_only_layers), num_local_experts=self.num_experts)
            if self.model_type == "qwen2_moe":
                raw["qkv_bias"] = True
            else:
                del raw["shared_expert_intermediate_size"]
        if self.model_type == "llama":
            raw["pretraining_tp"] = 1
        else:
            del raw["mlp_bias"]
            raw.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        return raw


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (transformers' Qwen3MoeForCausalLM, the shape of Qwen3-30B-A3B): Qwen3's attention, and in each
    sparse layer a router over num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok of them per
    token (their softmax weights renormalized to sum 1 if norm_topk_prob). Layer i is sparse unless it is in
    mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step; a dense layer has an MLP of
    intermediate_size, as Qwen3's. Qwen2-MoE (model_type "qwen2_moe", Qwen1.5-MoE-A2.7B's family): Qwen2's attention
    (q/k/v biases, no q/k norms), and beside the routed experts every token also runs a shared expert of
    shared_expert_intermediate_size, weighted by a sigmoid gate (0 for Qwen3-MoE, which has none)."""
    model_type: str = "qwen3_moe"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        shared = self.shared_expert_intermediate_size
        if self.model_type == "qwen2_moe":
            _size("shared_expert_intermediate_size", shared)
        elif shared != 0:
            raise ValueError(f"config shared_expert_intermediate_size={shared!r}: {self.model_type} has no shared "
                             "expert")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            _size(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts="
                             f"{self.num_experts}: a token cannot be routed to more experts than there are")
        _flag("norm_topk_prob", self.norm_topk_prob)
        layers = self.mlp_only_layers
        if not isinstance(layers, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int)
                                                        or not 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(f"config mlp_only_layers={str(layers)[:80]}: must be a list of layer indices in "
                             f"[0, {self.num_hidden_layers})")
        self.mlp_only_layers = tuple(sorted(set(layers)))

    def sparse(self, index):
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


def _moe_from_hf(raw):
    """Qwen3MoeConfig's own fields from a config.json (num_experts under either of its names, which must agree)."""
    names = [k for k in ("num_experts", "num_local_experts") if k in raw]
    if len(names) == 2 and raw["num_experts"] != raw["num_local_experts"]:
        raise ValueError(f"config num_experts={raw['num_experts']!r} and num_local_experts="
                         f"{raw['num_local_experts']!r} disagree")
    defaults = MOE_DEFAULTS[raw.get("model_type")]
    fields = {k: raw.get(k, v) for k, v in defaults.items()}
    if raw.get("model_type") == "qwen3_moe":                 # not Qwen3-MoE's key: a stray one is not read
        fields["shared_expert_intermediate_size"] = 0
    fields["num_experts"] = raw[names[0]] if names else defaults["num_experts"]
    fields["mlp_only_layers"] = fields["mlp_only_layers"] if fields["mlp_only_layers"] is not None else ()
    return fields


def _check_full_attention(raw, num_layers):
    """Qwen2/Qwen3: refuse a config whose layers use sliding-window attention (transformers' layer_types rule)."""
    sliding = raw.get("use_sliding_window", False)
    if not isinstance(sliding, bool):
        raise ValueError(f"config use_sliding_window={sliding!r}: must be true or false")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ValueError(f"config layer_types={str(layer_types)[:80]}: only full_attention layers are implemented")
    window_layers = raw.get("max_window_layers", 28)
    if layer_types is None and sliding and raw.get("sliding_window", 4096) is not None and not (
            isinstance(window_layers, int) and window_layers >= num_layers):
        raise ValueError("config use_sliding_window=True: only full attention is implemented")


def _rope_from_hf(raw, defaults):
    """(rope_theta, rope_scaling) from either key style; like transformers 5, rope_scaling wins over
    rope_parameters, and rope_theta inside the dict over the top-level key."""
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"config {key}={raw[key]!r}: must be an object or null")
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if "rope_theta" in rope and "rope_theta" in raw and not rope["rope_theta"] == raw["rope_theta"]:
        raise ValueError(f"config rope_theta={raw['rope_theta']!r} and rope_parameters.rope_theta="
                         f"{rope['rope_theta']!r} disagree (transformers 4 reads the first, 5 the second)"[:300])
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.get("type", "default"))
    rope.pop("type", None)
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0 or isinstance(partial, bool):
        raise ValueError(f"config partial_rotary_factor={partial!r}: only full-width RoPE (1.0) is implemented")
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings",
                        raw.get("max_position_embeddings", defaults["max_position_embeddings"]))
    return theta, {"rope_type": kind, **rope}
