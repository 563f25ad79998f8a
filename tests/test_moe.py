"""Qwen3-MoE in the engine's own terms: the config and its checks, the sparse block's routing against a direct
per-token sum, both expert layouts of a Hugging Face folder, and malformed MoE checkpoints refused from the headers.
(Against transformers' own Qwen3MoeForCausalLM: tests/test_interop_moe.py.)"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loaders import load_dense, save_dense
from engine.qwen3 import Qwen3, Qwen3Config, Qwen3MoeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             mlp_only_layers=(1,), initializer_range=0.2)
RAW = {**Qwen3MoeConfig(**SIZES).to_hf()}


def tiny_moe(**change):
    torch.manual_seed(0)
    return Qwen3(Qwen3MoeConfig(**{**SIZES, **change})).eval()


def ids(seed=1):
    return torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "dense"
    save_dense(tiny_moe(), path)
    return path


def test_sparse_layers_are_those_transformers_makes_sparse():
    cfg = Qwen3MoeConfig(**{**SIZES, "num_hidden_layers": 6, "mlp_only_layers": (4,), "decoder_sparse_step": 2})
    assert [cfg.sparse(i) for i in range(6)] == [False, True, False, True, False, True]
    model = Qwen3(cfg)
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [cfg.sparse(i) for i in range(6)]
    assert not any(Qwen3Config().sparse(i) for i in range(2))


@torch.no_grad()
@pytest.mark.parametrize("normalize", [True, False])
def test_the_sparse_block_is_each_tokens_weighted_sum_of_its_top_k_experts(normalize):
    block = tiny_moe(norm_topk_prob=normalize).model.layers[0].mlp
    x = torch.randn(2, 5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            probs = (block.gate.weight @ x[b, t]).softmax(-1)
            top = probs.topk(2)
            weights = top.values / top.values.sum() if normalize else top.values
            for w, e in zip(weights, top.indices):
                expected[b, t] += w * block.experts[int(e)](x[b, t])
    assert torch.allclose(block(x), expected, atol=1e-6)


@torch.no_grad()
def test_an_expert_runs_on_exactly_the_tokens_routed_to_it():
    block = tiny_moe().model.layers[0].mlp
    x = torch.randn(3, 7, SIZES["hidden_size"], generator=torch.Generator().manual_seed(2))
    seen = {e: [] for e in range(4)}
    for e, expert in enumerate(block.experts):
        expert.gate_proj.register_forward_pre_hook(lambda m, args, e=e: seen[e].append(args[0]))
    block(x)
    chosen = block.gate(x.reshape(-1, SIZES["hidden_size"]))[1]
    for e in range(4):
        routed = x.reshape(-1, SIZES["hidden_size"])[(chosen == e).any(-1)]
        got = torch.cat(seen[e]) if seen[e] else routed[:0]
        assert torch.equal(got, routed)


@torch.no_grad()
def test_cached_generation_equals_the_full_forward():
    model = tiny_moe()
    out = model.generate(ids()[:, :6], 6)
    assert torch.equal(out[:, 6:], torch.stack([model(out[:, :6 + i])[:, -1].argmax(-1) for i in range(6)], 1))


def test_config_round_trips_and_reads_either_name_of_num_experts():
    cfg = Qwen3Config.from_hf(json.loads(json.dumps(RAW)))
    assert isinstance(cfg, Qwen3MoeConfig) and cfg == Qwen3MoeConfig(**SIZES)
    v4 = {k: v for k, v in RAW.items() if k != "num_local_experts"}
    v5 = {k: v for k, v in RAW.items() if k != "num_experts"}
    assert Qwen3Config.from_hf(v4) == Qwen3Config.from_hf(v5) == cfg


@pytest.mark.parametrize("change, match", [
    ({"num_experts": 0, "num_local_experts": 0}, r"num_experts=0: must be an integer in \[1"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 exceeds num_experts=4"),
    ({"num_local_experts": 8}, r"num_experts=4 and num_local_experts=8 disagree"),
    ({"moe_intermediate_size": 0}, r"moe_intermediate_size=0"),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers=\[3\]: must be a list of layer indices in \[0, 3\)"),
    ({"norm_topk_prob": "yes"}, r"norm_topk_prob='yes': must be true or false"),
    ({"use_sliding_window": True}, r"use_sliding_window=True: qwen3_moe"),
])
def test_a_malformed_moe_config_is_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf({**RAW, **change})


def test_the_dense_config_stays_as_it_was():
    assert "num_experts" not in Qwen3Config().to_hf() and "mlp_only_layers" not in Qwen3Config().to_hf()
    with pytest.raises(ValueError, match="model_type='qwen3_moe' goes with Qwen3MoeConfig"):
        Qwen3Config(model_type="qwen3_moe")


def fuse(folder, out):
    """The folder rewritten in transformers 5's fused expert layout."""
    tensors = load_file(folder / "model.safetensors")
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"),
                                                               tensors.pop(f"{p}.{e}.up_proj.weight")])
                                                    for e in range(4)])
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out


@torch.no_grad()
def test_the_fused_expert_layout_loads_to_the_same_model(folder, tmp_path):
    model = load_dense(fuse(folder, tmp_path / "fused"))
    assert torch.equal(model(ids()), load_dense(folder)(ids()))
    assert model.model.layers[2].mlp.experts[3].up_proj.weight.untyped_storage().nbytes() == 16 * 32 * 4


def rewrite(folder, out, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.2.mlp.experts.3.down_proj.weight"),
     r"experts' tensors of 1 linear\(s\) or router\(s\) are missing, e\.g\. \['model\.layers\.2\.mlp\.experts\.3\."
     r"down_proj'\] \(config\.json says num_experts=4\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(17, 32)}),
     r"experts\.1\.up_proj\.weight: checkpoint shape \(17, 32\) != model shape \(16, 32\)"),
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(4, 31)}),
     r"mlp\.gate\.weight: checkpoint shape \(4, 31\) != model shape \(4, 32\)"),
    (lambda t: t.pop("model.layers.0.mlp.gate.weight"), r"\['model\.layers\.0\.mlp\.gate'\]"),
    (lambda t: t.update({"model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(16, 32)}),
     r"unexpected tensor model\.layers\.0\.mlp\.experts\.4\.up_proj\.weight"),
])
def test_a_malformed_moe_checkpoint_is_refused_before_a_weight_is_read(folder, tmp_path, edit, match, monkeypatch):
    bad = rewrite(folder, tmp_path / "bad", edit)
    import engine.loaders as loaders
    monkeypatch.setattr(loaders, "snapshot_tensors", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=match):
        load_dense(bad)


@pytest.mark.parametrize("experts, match", [(3, r"experts\.3\.gate_proj"), (5, r"unexpected tensor .*experts\.4\.")])
def test_a_fused_tensor_with_another_expert_count_is_refused(folder, tmp_path, experts, match):
    fused = fuse(folder, tmp_path / "fused")
    tensors = load_file(fused / "model.safetensors")
    stacked = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = stacked[[0, 1, 2, 3, 0][:experts]]
    save_file(tensors, fused / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_dense(fused)
