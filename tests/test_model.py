"""The tiny Qwen3 (and its Llama / Qwen2 variants): names, shapes, initial loss, cache, KV hook, half precision,
training determinism."""
import math

import pytest
import torch

from engine import training
from engine.data import Corpus, default_corpus
from engine.qwen3 import KVCache, RMSNorm, Qwen3, Qwen3Config
from engine.training import TrainConfig, train, trained_model


def test_parameter_names_are_hugging_face_names(tiny_model):
    names = set(dict(tiny_model.named_parameters()))
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert f"model.layers.{i}.self_attn.{proj}.weight" in names
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{i}.mlp.{proj}.weight" in names
        for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
            assert f"model.layers.{i}.{norm}.weight" in names
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight


def test_book_size_shapes():
    m = Qwen3(Qwen3Config())
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (256, 256) and attn.k_proj.weight.shape == (128, 256)
    assert m.model.layers[0].mlp.down_proj.weight.shape == (256, 768)
    assert m(torch.zeros(1, 7, dtype=torch.long)).shape == (1, 7, 256)


def test_first_loss_is_about_ln_256(tiny_model):
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(tiny_model(ids[:, :-1]).reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert abs(loss.item() - math.log(256)) < 0.15


def test_cached_generation_equals_full_forward(tiny_model):
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    out = tiny_model.generate(ids, 8)
    with torch.no_grad():
        greedy = tiny_model(out)[:, ids.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(greedy, out[:, ids.shape[1]:])


def test_generate_computes_the_head_for_the_last_position_only(tiny_model):
    """last_only=True gives the full forward's last row of logits (the same rows through the same layers), and
    generate asks for nothing else: every product the head makes, prompt and steps, is one position's."""
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(tiny_model(ids, last_only=True), tiny_model(ids)[:, -1:], rtol=1e-5, atol=1e-6)
    seen = []
    hook = tiny_model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    try:
        tiny_model.generate(ids, 3)
    finally:
        hook.remove()
    assert seen == [(2, 1, tiny_model.cfg.hidden_size)] * 3


def test_kv_transform_sees_rotated_k_and_v_and_changes_output(tiny_model):
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    seen = []

    def halve_values(k, v, index):
        seen.append((index, tuple(k.shape), tuple(v.shape)))
        return k, v * 0.5

    with torch.no_grad():
        base = tiny_model(ids)
        tiny_model.set_kv_transform(halve_values)
        changed = tiny_model(ids)
        tiny_model.set_kv_transform(None)
        again = tiny_model(ids)
    assert seen == [(0, (1, 2, 9, 16), (1, 2, 9, 16)), (1, (1, 2, 9, 16), (1, 2, 9, 16))]
    assert not torch.allclose(base, changed) and torch.equal(base, again)


@pytest.mark.parametrize("window", [None, 8])
def test_attention_goes_through_in_blocks_of_bounded_scores(tiny_model, monkeypatch, window):
    """red before: each forward held one [batch, heads, T, T] score tensor (calibrating 4 x 4096 tokens on a 4-head
    model: 3.6 GB). Blocks of 10 query rows give the same logits up to float rounding, with a windowed KV transform
    too (its coded band lies across blocks; a block against all positions put coded keys where a query's window
    is: 1e-4 off)."""
    from engine import qwen3
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(3))
    if window is not None:
        tiny_model.set_kv_transform(lambda k, v, index, start: (k.half().float(), v.half().float()), window=window)
    with torch.no_grad():
        whole = tiny_model(ids)
        monkeypatch.setattr(qwen3, "SCORE_ELEMENTS", 2 * 4 * 100 * 10, raising=False)   # batch x heads x L x rows
        rows, attend = [], qwen3.Attention._attend
        monkeypatch.setattr(qwen3.Attention, "_attend", lambda self, q, *args: rows.append(q.shape[2]) or
                            attend(self, q, *args))
        blocks = tiny_model(ids)
    assert rows == [10] * 20 and torch.allclose(blocks, whole, rtol=0, atol=1e-5)     # 2 layers x 10 blocks


FAMILIES = {"llama": dict(attention_bias=True, mlp_bias=True, rope_theta=5e5,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            "qwen2": dict(tie_word_embeddings=False), "qwen3": dict(attention_bias=True)}


def family_model(tiny_cfg, model_type):
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(**{**vars(tiny_cfg), "model_type": model_type, **FAMILIES[model_type]})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
    return model


def test_each_family_has_its_norms_and_biases(tiny_cfg):
    names = {t: set(dict(family_model(tiny_cfg, t).named_parameters())) for t in FAMILIES}
    attn = "model.layers.0.self_attn"
    assert f"{attn}.q_norm.weight" in names["qwen3"] and f"{attn}.q_norm.weight" not in names["llama"] | names["qwen2"]
    assert {f"{attn}.{p}_proj.bias" for p in "qkv"} <= names["qwen2"] and f"{attn}.o_proj.bias" not in names["qwen2"]
    assert {f"{attn}.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= names["llama"]
    assert "lm_head.weight" in names["qwen2"] and "model.layers.0.mlp.down_proj.bias" not in names["qwen3"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cached_generation_equals_full_forward_in_every_family(tiny_cfg, model_type):
    model = family_model(tiny_cfg, model_type)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, 8)
    with torch.no_grad():
        greedy = model(out)[:, ids.shape[1] - 1:-1].argmax(-1)
    assert torch.equal(greedy, out[:, ids.shape[1]:])


@pytest.mark.parametrize("model_type, dtype", [("llama", torch.bfloat16), ("qwen2", torch.float16),
                                               ("qwen3", torch.bfloat16)])
def test_half_precision_model_runs_close_to_float32(tiny_cfg, model_type, dtype):
    model = family_model(tiny_cfg, model_type)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids)
        half = model.to(dtype)
        logits = half(ids)
    assert logits.dtype == dtype and (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()
    assert half.generate(ids, 4).shape == (2, 16)


def test_rms_norm_squares_in_float32_and_returns_the_input_dtype():
    norm = RMSNorm(8).to(torch.float16)
    x = torch.full((1, 8), 1000.0, dtype=torch.float16)          # 1000^2 overflows float16
    y = norm(x)
    assert y.dtype == torch.float16 and torch.equal(y, torch.ones_like(y))


def test_training_is_deterministic_and_learns(tiny_cfg):
    corpus = Corpus.from_bytes(default_corpus()[:60000])
    tc = TrainConfig(steps=12, batch_size=4, seq_len=32, log_every=100)
    a, b = train(tiny_cfg, corpus, tc, log=lambda m: None), train(tiny_cfg, corpus, tc, log=lambda m: None)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    x, y = corpus.batch(4, 32, torch.Generator().manual_seed(9))
    fresh = Qwen3(tiny_cfg)
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(fresh(x).reshape(-1, 256), y.reshape(-1))
        after = torch.nn.functional.cross_entropy(a(x).reshape(-1, 256), y.reshape(-1))
    assert after < before - 0.5


def test_trained_model_is_cached(tiny_cfg, tmp_path):
    corpus = Corpus.from_bytes(default_corpus()[:60000])
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16)
    lines = []
    first = trained_model(tiny_cfg, corpus, tc, tmp_path, log=lines.append)
    second = trained_model(tiny_cfg, corpus, tc, tmp_path, log=lines.append)
    assert "using cached model" in lines[-1]
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters()))


def test_a_model_cached_by_older_training_code_is_not_reused(tiny_cfg, tmp_path, monkeypatch):
    corpus = Corpus.from_bytes(default_corpus()[:60000])
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16)
    trained_model(tiny_cfg, corpus, tc, tmp_path, log=lambda msg: None)
    monkeypatch.setattr(training, "TRAINING_VERSION", training.TRAINING_VERSION + 1)
    lines = []
    trained_model(tiny_cfg, corpus, tc, tmp_path, log=lines.append)
    assert lines[0].startswith("training") and len(list(tmp_path.iterdir())) == 2




def test_generate_refuses_logits_that_are_not_finite(tiny_model):
    """A norm weight of 3e38 is a finite weight, but the forward pass overflows: red when generate picked tokens
    from NaN logits."""
    with torch.no_grad():
        tiny_model.model.norm.weight.fill_(3e38)
    with pytest.raises(ValueError, match="logits are not finite at new token 0"):
        tiny_model.generate(torch.tensor([[1, 2, 3]]), 4)


def test_generate_streams_each_token_as_it_is_chosen(tiny_model):
    seen = []
    out = tiny_model.generate(torch.tensor([[5, 6, 7]]), 5, on_token=lambda t: seen.append(int(t)))
    assert seen == out[0, 3:].tolist()


def test_decoded_weights_are_reused_and_redone_when_the_layer_changes(tiny_model):
    """Inside decoded_weights each quantized layer decodes once; a layer whose buffers change in place decodes
    again; outside, nothing is kept. Outputs equal the undecoded path's."""
    from engine.formats.numerics import affine
    from engine.layers import decoded_weights, quantized_linears
    affine.quantize(tiny_model, bits=4, group_size=32)
    layer = quantized_linears(tiny_model)["model.layers.0.mlp.up_proj"]
    calls = []
    original = type(layer).dequantize
    layer.dequantize = lambda: calls.append(1) or original(layer)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        plain = tiny_model(ids)
        calls.clear()
        with decoded_weights(tiny_model) as kept:
            assert kept and calls == [1]
            assert torch.equal(tiny_model(ids), plain) and torch.equal(tiny_model(ids), plain) and calls == [1]
            layer.scales.mul_(2)                                    # in place: its version counter moves
            changed = tiny_model(ids)
            assert calls == [1, 1] and not torch.equal(changed, plain)
        assert layer._decoded is None
        tiny_model(ids)
        assert calls == [1, 1, 1]
        with decoded_weights(tiny_model, max_bytes=0) as kept:     # too big for the budget: nothing kept
            assert not kept and torch.equal(tiny_model(ids), changed)


def test_decoded_weights_keep_nothing_under_the_engine_implementation(tiny_model):
    from engine.formats.numerics import affine
    from engine.layers import decoded_weights, impl
    affine.quantize(tiny_model, bits=4, group_size=32)
    with impl("engine"), decoded_weights(tiny_model) as kept:
        assert not kept


def test_the_exact_cache_appends_a_step_in_place_and_holds_every_position():
    """A step writes its token's K/V into room the cache keeps; concatenating copied the whole cache every step
    (red with torch.cat: a new storage each step). What it gives back is every position given, in order."""
    cache, given = KVCache(1), []
    for t in (5, 1, 1, 300, 1):
        given.append((torch.randn(2, 3, t, 8), torch.randn(2, 3, t, 8)))
        k, v = cache.update(0, *given[-1])
        assert torch.equal(k, torch.cat([g[0] for g in given], 2))
        assert torch.equal(v, torch.cat([g[1] for g in given], 2))
    assert cache.length == 308
    before = k.untyped_storage().data_ptr()
    k, _ = cache.update(0, torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    assert k.untyped_storage().data_ptr() == before and k.shape[2] == 309
