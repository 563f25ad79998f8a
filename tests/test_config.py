"""Qwen3Config: config.json of Llama / Qwen2 / Qwen3 in transformers 4.x and 5.x styles, and a ValueError naming the
field for every malformed value, before anything is built."""
import json

import pytest

from engine.qwen3 import Qwen3Config

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_transformers_4_and_5_styles_read_the_same(model_type):
    base = {**BASE, "model_type": model_type}
    v4 = Qwen3Config.from_hf({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                              "rope_scaling": {"type": "llama3", **LLAMA3}})
    v5 = Qwen3Config.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3},
                              "dtype": "bfloat16"})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.torch_dtype == "bfloat16"
    assert v4.rope_scaling == {"rope_type": "llama3", **LLAMA3} and v4.architecture.lower().startswith(model_type)


@pytest.mark.parametrize("extra", [{"model_type": "qwen3", "attention_bias": True},
                                   {"model_type": "qwen2", "tie_word_embeddings": True, "eos_token_id": [1, 2]},
                                   {"model_type": "llama", "mlp_bias": True, "bos_token_id": 1,
                                    "rope_scaling": {"rope_type": "linear", "factor": 2}}])
def test_to_hf_round_trips(extra):
    cfg = Qwen3Config.from_hf({**BASE, **extra})
    assert Qwen3Config.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_family_decides_norms_and_biases():
    qwen2 = Qwen3Config.from_hf({**BASE, "model_type": "qwen2", "attention_bias": False})
    llama = Qwen3Config.from_hf({**BASE, "model_type": "llama", "attention_bias": True})
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.attention_bias) == (False, True, False)
    assert (llama.qk_norm, llama.qkv_bias, llama.attention_bias) == (False, True, True)
    assert Qwen3Config().qk_norm and not Qwen3Config().qkv_bias


def test_head_dim_is_derived_when_absent_and_dtype_spellings_are_normalized():
    raw = {k: v for k, v in BASE.items() if k != "head_dim"}
    cfg = Qwen3Config.from_hf({**raw, "model_type": "llama", "torch_dtype": "torch.float16"})
    assert cfg.head_dim == 16 and cfg.torch_dtype == "float16"


def test_sliding_window_configs_that_use_no_window_are_accepted():
    cfg = Qwen3Config.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
                               "max_window_layers": 2, "layer_types": None})
    assert cfg.num_hidden_layers == 2


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": 0}, r"num_attention_heads=0: must be an integer"),
    ({"hidden_size": True}, r"hidden_size=True"),
    ({"intermediate_size": 128.0}, r"intermediate_size=128.0"),
    ({"vocab_size": 10**12}, r"vocab_size=1000000000000"),
    ({"num_hidden_layers": 10**9}, r"num_hidden_layers=1000000000"),
    ({"num_key_value_heads": "2"}, r"num_key_value_heads='2'"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 15}, r"head_dim=15: must be even"),
    ({"head_dim": -16}, r"head_dim=-16"),
    ({"head_dim": None, "hidden_size": 66}, r"hidden_size=66 is not a multiple of num_attention_heads=4"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0"),
    ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps='1e-6': must be a finite positive number"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps=0"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan"),
    ({"rms_norm_eps": 1e300}, r"rms_norm_eps=1e\+300: must lie in \[2\^-126, 1\]"),
    ({"rms_norm_eps": 2**63}, r"rms_norm_eps=9.2\d+e\+18: must lie in"),
    ({"rms_norm_eps": 1e-300}, r"rms_norm_eps=1e-300: must lie in"),
    ({"rope_theta": 1e300}, r"rope_theta=1e\+300: must be a finite float32"),
    ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     r"rope_theta=500000.0 and rope_parameters.rope_theta=nan disagree"),
    ({"rope_theta": True}, r"rope_theta=True"),
    ({"rope_theta": float("inf")}, r"rope_theta=inf"),
    ({"rope_theta": -1.0}, r"rope_theta=-1.0"),
    ({"rope_theta": 10**400}, r"rope_theta=1000"),
    ({"initializer_range": -0.1}, r"initializer_range=-0.1"),
    ({"rope_parameters": "default"}, r"rope_parameters='default': must be an object"),
    ({"rope_scaling": [8.0]}, r"rope_scaling=\[8.0\]: must be an object"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn'"),
    ({"rope_scaling": {"rope_type": ["llama3"]}}, r"rope_type=\['llama3'\]"),
    ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, r"type default takes exactly \[\], got \['factor'\]"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"type llama3 takes exactly"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope_scaling.factor=0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, r"rope_scaling.factor='2'"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": True}}, r"rope_scaling.factor=True"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 1.0}},
     r"high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": 64.5}},
     r"original_max_position_embeddings=64.5"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"dtype": "float64"}, r"dtype='float64': must be one of float32, float16, bfloat16"),
    ({"torch_dtype": 16}, r"dtype=16"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes': must be true or false"),
    ({"attention_bias": 1}, r"attention_bias=1"),
    ({"model_type": "mistral"}, r"model_type='mistral': this engine runs"),
    ({"model_type": ["qwen3"]}, r"model_type=\['qwen3'\]"),
    ({"architectures": ["LlamaForCausalLM"]}, r"architectures=\['LlamaForCausalLM'\]: model_type qwen3 is Qwen3"),
    ({"architectures": "Qwen3ForCausalLM"}, r"architectures='Qwen3ForCausalLM'"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}, r"use_sliding_window=True"),
    ({"use_sliding_window": "no"}, r"use_sliding_window='no'"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types=.*only full_attention"),
    ({"eos_token_id": -1}, r"eos_token_id=-1: must be a token id"),
    ({"eos_token_id": []}, r"eos_token_id=\[\]"),
    ({"eos_token_id": [1, "2"]}, r"eos_token_id='2'"),
    ({"bos_token_id": True}, r"bos_token_id=True"),
    ({"bos_token_id": [1]}, r"bos_token_id=\[1\]"),
])
def test_malformed_field_is_a_value_error_naming_it(change, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf({**BASE, **change})


@pytest.mark.parametrize("raw, match", [
    ({k: v for k, v in BASE.items() if k != "hidden_size"}, r"lacks required key\(s\) \['hidden_size'\]"),
    ([BASE], r"must be a JSON object, got list"),
])
def test_config_that_is_not_a_config(raw, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf(raw)


def test_qwen2_ignores_attention_and_mlp_bias_keys_as_transformers_does():
    cfg = Qwen3Config.from_hf({**BASE, "model_type": "qwen2", "attention_bias": True, "mlp_bias": True})
    assert not cfg.attention_bias and not cfg.mlp_bias and cfg.qkv_bias


@pytest.mark.parametrize("kwargs, match", [
    ({"model_type": "qwen2", "attention_bias": True}, r"qwen2 has q/k/v biases always"),
    ({"mlp_bias": True}, r"only llama has MLP biases, not qwen3"),
    ({"rope_scaling": "linear"}, r"rope_scaling='linear'"),
])
def test_direct_construction_is_checked_too(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config(**kwargs)
