"""Qwen2-MoE: routed experts and a shared expert behind a sigmoid gate. Its config and checks, the block against a
direct per-token sum, transformers' own Qwen2MoeForCausalLM both ways, every method quantizing the shared expert (its
gate left dense, as the router), GGUF's `qwen2moe` written and read, and llama.cpp's own runtime running the engine's
MoE files (qwen2moe and qwen3moe) with the engine's log-probabilities."""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.formats.llama_cpp.gguf import load_gguf
from engine.formats.llama_cpp.gguf_file import GGUFFile
from engine.formats.llama_cpp.gguf_writer import write_gguf
from engine.formats.numerics import experts
from engine.formats.numerics.affine import AffineQuantLinear
from engine.formats.numerics.calibration import decoder_layers
from engine.formats.quantized_checkpoints import load_quantized, save_quantized
from engine.layers import quantized_linears, replace_linears, sequential_steps
from engine.loaders import load_dense, save_dense
from engine.qwen3 import Qwen3, Qwen3Config, Qwen3MoeConfig
from engine.safetensors_io import snapshot_tensors
from helpers import random_ids

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]
SIZES = dict(model_type="qwen2_moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=(1,),
             norm_topk_prob=False, initializer_range=0.2)


def tiny(**change):
    torch.manual_seed(0)
    model = Qwen3(Qwen3MoeConfig(**{**SIZES, **change})).eval()
    with torch.no_grad():                              # biases random too: a lost one shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def ids(seed=1, length=16):
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


# ---- the model ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_the_block_adds_the_shared_expert_weighted_by_its_sigmoid_gate_to_the_routed_sum():
    # in float64 (the router's softmax in float32, as the block takes it), so that the loop and the block's batched
    # matmuls agree to rounding on any CPU (float32 sums in another order differed by 1.3e-6 on a Xeon with AMX)
    block = tiny().model.layers[0].mlp.double()
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = torch.zeros_like(x)
    for t in range(7):
        top = (block.gate.weight @ x[t]).softmax(-1, dtype=torch.float32).topk(2)    # norm_topk_prob false: as is
        for w, e in zip(top.values, top.indices):
            expected[t] += w * block.experts[int(e)](x[t])
        expected[t] += torch.sigmoid(block.shared_expert_gate.weight[0] @ x[t]) * block.shared_expert(x[t])
    torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-9)


def test_the_config_round_trips_as_transformers_writes_it():
    cfg = Qwen3MoeConfig(**SIZES)
    raw = cfg.to_hf()
    assert raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["qkv_bias"] is True
    assert raw["shared_expert_intermediate_size"] == 64 and "attention_bias" not in raw
    assert Qwen3Config.from_hf(raw) == cfg and cfg.qkv_bias and not cfg.qk_norm
    assert "shared_expert_intermediate_size" not in Qwen3MoeConfig().to_hf()                  # Qwen3-MoE's
    defaults = Qwen3Config.from_hf({k: raw[k] for k in ("model_type", "vocab_size", "hidden_size",
                                                          "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads")})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.shared_expert_intermediate_size,
            defaults.norm_topk_prob) == (60, 4, 5632, False)                 # transformers' Qwen2MoeConfig


@pytest.mark.parametrize("change, match", [
    (dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size=0: must be an integer in \[1"),
    (dict(qkv_bias=False), r"qkv_bias=False: Qwen2-MoE's q/k/v biases are implemented"),
])
def test_a_malformed_qwen2_moe_config_is_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf({**Qwen3MoeConfig(**SIZES).to_hf(), **change})
    with pytest.raises(ValueError, match=r"attention_bias=True: qwen2_moe has q/k/v biases always and no o_proj"):
        Qwen3MoeConfig(**SIZES, attention_bias=True)               # (config.json's key is not read, as for qwen2)


def test_qwen3_moe_has_no_shared_expert():
    raw = {**Qwen3MoeConfig().to_hf(), "shared_expert_intermediate_size": 8}      # not Qwen3-MoE's key: not read
    assert Qwen3Config.from_hf(raw).shared_expert_intermediate_size == 0
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=8: qwen3_moe has no shared expert"):
        Qwen3MoeConfig(shared_expert_intermediate_size=8)


@pytest.mark.parametrize("missing", ["model.layers.2.mlp.shared_expert.down_proj.weight",
                                     "model.layers.0.mlp.shared_expert_gate.weight"])
def test_a_checkpoint_without_its_shared_expert_is_refused_before_a_weight_is_read(missing, tmp_path, monkeypatch):
    save_dense(tiny(), tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors[missing]
    save_file(tensors, tmp_path / "m" / "model.safetensors", {"format": "pt"})
    import engine.loaders as loaders
    monkeypatch.setattr(loaders, "snapshot_tensors", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=rf"are missing, e\.g\. \['{missing.removesuffix('.weight')}'\]"):
        load_dense(tmp_path / "m")


# ---- against transformers' Qwen2MoeForCausalLM ----------------------------------------------------------------------

def write_hf(directory, dtype=torch.float32, **change):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = {**{k: v for k, v in SIZES.items() if k != "model_type"}, "mlp_only_layers": [1], **change}
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**config))
    with torch.no_grad():                              # norms and biases random too
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    hf.to(dtype).save_pretrained(directory)
    return directory


@torch.no_grad()
def hf_logits(directory, **options):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             **options).eval()(ids()).logits


@pytest.mark.interop
@torch.no_grad()
@pytest.mark.parametrize("change, dtype", [({}, torch.float32),
                                           (dict(decoder_sparse_step=2, norm_topk_prob=True, mlp_only_layers=[],
                                                 tie_word_embeddings=True), torch.bfloat16)])
def test_a_transformers_qwen2_moe_checkpoint_loads_with_logits_within_1e_5(change, dtype, tmp_path):
    directory = write_hf(tmp_path / "hf", dtype, **change)
    ours = load_dense(directory, dtype=torch.float32)
    assert ours.cfg.model_type == "qwen2_moe" and any(ours.cfg.sparse(i) for i in range(3))
    assert (ours(ids()) - hf_logits(directory)).abs().max() < 1e-5
    save_dense(ours, tmp_path / "ours")                  # and the engine's own folder in transformers
    assert (hf_logits(tmp_path / "ours") - ours(ids())).abs().max() < 1e-5


@pytest.mark.interop
@torch.no_grad()
def test_a_quantized_qwen2_moe_checkpoint_loads_in_transformers_with_the_engines_logits(tmp_path):
    """compressed-tensors int4: the shared expert quantized, its gate (an nn.Linear in transformers) left dense by
    the `ignore` list."""
    import transformers
    ours = load_dense(write_hf(tmp_path / "hf"))
    config = save_quantized(ours, tmp_path / "q", "rtn", group_size=8, symmetric=True)
    assert config["ignore"] == ["lm_head", experts.ROUTER_IGNORE, experts.SHARED_GATE_IGNORE]
    theirs = hf_logits(tmp_path / "q", quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    assert (theirs - ours(ids())).abs().max() < 1e-5


# ---- quantization ------------------------------------------------------------------------------------------------

DATA_FREE = {"rtn": dict(group_size=32), "fp8": dict(block=32), "mxfp4": {}, "nf4": dict(group_size=32),
             "entquant": dict(lam=14.5, max_iter=5)}


@pytest.mark.parametrize("method", sorted(DATA_FREE) + ["gptq", "awq"])
def test_every_method_quantizes_the_shared_expert_and_leaves_its_gate_dense(method, tmp_path):
    # (NVFP4 is left out: its file's global scale is 1 / tensor_scale, whose round trip may move the tensor scale
    # by one float32 ulp, compressed_tensors.py's docstring; tests/test_moe_quantize.py covers it on experts)
    model = tiny()
    save_quantized(model, tmp_path / "q", method, random_ids(4, 16), **DATA_FREE.get(method, dict(group_size=32)))
    layers = quantized_linears(model)
    assert len(layers) == 3 * 4 + 2 * (4 * 3 + 3) + 3
    assert {f"model.layers.{i}.mlp.shared_expert.{p}" for i in (0, 2) for p in ("gate_proj", "up_proj",
                                                                                   "down_proj")} <= set(layers)
    stored = dict(snapshot_tensors(tmp_path / "q"))
    assert stored["model.layers.2.mlp.shared_expert_gate.weight"].dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")(ids()), model(ids()))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_streaming_from_disk_writes_what_the_in_memory_path_writes(method, tmp_path, monkeypatch):
    from engine.checkpoints.streaming import quantize_checkpoint
    save_dense(tiny(), tmp_path / "dense")
    options = dict(group_size=32, expert_min_tokens=1)
    if method == "gptq":
        options["order"] = "act_order_static"          # the converter's default order (save_quantized's: natural)
    in_memory = save_quantized(tiny(), tmp_path / "mem", method, random_ids(4, 16), **options)
    monkeypatch.setattr(experts, "CHUNK_BYTES", 1)                 # GPTQ: one expert a chunk, read as needed
    streamed = quantize_checkpoint(tmp_path / "dense", tmp_path / "disk", method, random_ids(4, 16),
                                   progress=False, **options)
    assert streamed == in_memory
    a, b = dict(snapshot_tensors(tmp_path / "mem")), dict(snapshot_tensors(tmp_path / "disk"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_moe_conversion_resumes_to_the_same_bytes_and_expert_records(tmp_path, monkeypatch):
    from engine.checkpoints.streaming import quantize_checkpoint
    from test_streaming import _Killed, _watched_gptq
    save_dense(tiny(), tmp_path / "dense")
    options = dict(group_size=32, expert_min_tokens=32)                 # some experts rounded, some not
    whole = quantize_checkpoint(tmp_path / "dense", tmp_path / "whole", "gptq", random_ids(4, 16), progress=False,
                                **options)
    seen = []
    _watched_gptq(monkeypatch, seen, dies_at=2)                          # layer 2: sparse, after the dense one
    with pytest.raises(_Killed):
        quantize_checkpoint(tmp_path / "dense", tmp_path / "out", "gptq", random_ids(4, 16), progress=False,
                            **options)
    seen.clear()
    _watched_gptq(monkeypatch, seen)
    resumed = quantize_checkpoint(tmp_path / "dense", tmp_path / "out", "gptq", random_ids(4, 16), progress=False,
                                  **options)
    assert seen == [2] and resumed == whole and whole["expert_tokens"][1] is None
    rounded = whole["experts_rounded"][0] + whole["experts_rounded"][2]
    assert 0 < len(rounded) < 8, whole["expert_tokens"]
    a, b = dict(snapshot_tensors(tmp_path / "whole")), dict(snapshot_tensors(tmp_path / "out"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_shared_expert_is_calibrated_in_its_own_steps_before_the_chunks_of_experts(monkeypatch):
    layer = tiny().model.layers[0]
    shared = (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), ("mlp.shared_expert.down_proj",))
    assert sequential_steps(layer)[2][:2] == shared[0] and sequential_steps(layer)[3][0] == shared[1][0]
    monkeypatch.setattr(experts, "CHUNK_BYTES", 3 * experts.expert_bytes(layer.mlp.experts[0]))
    steps = experts.chunked_steps(layer)
    assert steps[2:4] == shared
    assert steps[4:] == (tuple(f"mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj")),
                         tuple(f"mlp.experts.{e}.down_proj" for e in range(3)),
                         ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj"), ("mlp.experts.3.down_proj",))


@torch.no_grad()
def test_a_capture_of_the_shared_experts_inputs_runs_no_routed_expert():
    layer = next(decoder_layers(tiny(), random_ids(4, 16)))
    ran = []
    for e, expert in enumerate(layer.layer.mlp.experts):
        expert.register_forward_pre_hook(lambda module, args, e=e: ran.append(e))
    stats = layer.capture(["mlp.shared_expert.down_proj"])["model.layers.0.mlp.shared_expert.down_proj"]
    assert ran == [] and stats.rows == 4 * 16                                  # every token, no routed expert


@torch.no_grad()
def test_awq_folds_the_norms_scale_into_the_shared_experts_gate_too():
    from engine.formats import awq
    model, reference = tiny(), tiny()
    for m in (model, reference):              # an outlier input channel: AWQ's search scales it on any CPU
        m.model.layers[0].post_attention_layernorm.weight.data[5] = 30.0
    awq.quantize(model, random_ids(4, 16), group_size=32)
    ours, theirs = model.model.layers[0], reference.model.layers[0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    s = theirs.post_attention_layernorm.weight / ours.post_attention_layernorm.weight        # the folded scale
    assert s[5] > 1.5                                                                         # it protects channel 5
    torch.testing.assert_close(ours.mlp.shared_expert_gate.weight, theirs.mlp.shared_expert_gate.weight * s)
    torch.testing.assert_close(ours.mlp.shared_expert_gate(ours.post_attention_layernorm(x)),
                               theirs.mlp.shared_expert_gate(theirs.post_attention_layernorm(x)), rtol=1e-5, atol=1e-6)


# ---- GGUF: llama.cpp's qwen2moe ---------------------------------------------------------------------------------

GGUF_SIZES = dict(mlp_only_layers=(), num_hidden_layers=2, tie_word_embeddings=False)


@torch.no_grad()
def test_a_qwen2moe_file_holds_llama_cpps_tensors_and_reads_back_to_the_same_model(tmp_path):
    model = tiny(**GGUF_SIZES)
    write_gguf(model, tmp_path / "m.gguf")
    with GGUFFile(tmp_path / "m.gguf") as f:
        assert f.metadata["general.architecture"] == "qwen2moe"
        assert f.metadata["qwen2moe.expert_shared_feed_forward_length"] == 64
        assert f.tensors["blk.1.ffn_gate_inp_shexp.weight"].shape == (64,)          # llama.cpp's {n_embd}
        assert f.tensors["blk.1.ffn_down_shexp.weight"].shape == (64, 64)
        assert f.tensors["blk.0.attn_q.bias"].shape == (64,)
    back = load_gguf(tmp_path / "m.gguf")
    assert back.cfg.model_type == "qwen2_moe" and back.cfg.norm_topk_prob is False
    assert torch.equal(back(ids()), model(ids()))


@torch.no_grad()
def test_a_tied_head_is_written_as_the_output_llama_cpps_qwen2moe_requires(tmp_path):
    model = tiny(**{**GGUF_SIZES, "tie_word_embeddings": True})
    write_gguf(model, tmp_path / "m.gguf")
    with GGUFFile(tmp_path / "m.gguf") as f:
        assert torch.equal(f.raw("output.weight"), f.raw("token_embd.weight"))
    back = load_gguf(tmp_path / "m.gguf")
    assert not back.cfg.tie_word_embeddings and torch.equal(back(ids()), model(ids()))


def test_what_llama_cpps_qwen2moe_would_run_differently_is_not_written(tmp_path):
    with pytest.raises(ValueError, match=r"norm_topk_prob=true: llama.cpp's qwen2moe never renormalizes"):
        write_gguf(tiny(**GGUF_SIZES, norm_topk_prob=True), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def rewritten(path, **metadata):
    """The tiny model's qwen2moe file with metadata keys changed (None: left out)."""
    from engine.formats.llama_cpp import gguf_tokenizer
    from engine.formats.llama_cpp.gguf_writer import model_metadata, model_tensors, write_container
    model = tiny(**GGUF_SIZES)
    meta = {**model_metadata(model.cfg), **gguf_tokenizer.byte_tokenizer_metadata(model.cfg),
            **{f"qwen2moe.{k}": v for k, v in metadata.items()}}
    write_container(path, {k: v for k, v in meta.items() if v is not None}, model_tensors(model)[0])
    return path


def test_a_qwen2moe_file_whose_shared_expert_disagrees_with_its_metadata_is_refused(tmp_path):
    bad = rewritten(tmp_path / "bad.gguf", expert_shared_feed_forward_length=48)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_shexp\.weight is \[64, 64\]; the metadata .*"
                                         r"expert_shared_feed_forward_length=48\) says \[48, 64\]"):
        load_gguf(bad)


@torch.no_grad()
def test_a_file_without_the_shared_width_reads_it_as_llama_cpp_does_from_the_feed_forward_length(tmp_path):
    old = rewritten(tmp_path / "old.gguf", expert_shared_feed_forward_length=None, feed_forward_length=64)
    back = load_gguf(old)
    assert back.cfg.shared_expert_intermediate_size == 64 and torch.equal(back(ids()), tiny(**GGUF_SIZES)(ids()))
    with pytest.raises(ValueError, match=r"ffn_gate_shexp\.weight is \[64, 64\]; .* says \[96, 64\]"):
        load_gguf(rewritten(tmp_path / "wide.gguf", expert_shared_feed_forward_length=None))


# ---- llama.cpp's own runtime ------------------------------------------------------------------------------------

LLAMA_PYTHON = Path.home() / ".cache" / "engine" / "clients" / "llamacpp" / "venv" / "bin" / "python"
RUNNERS = Path(__file__).resolve().parents[1] / "benchmarks" / "client_runners.py"
ARCHES = {"qwen2moe": dict(GGUF_SIZES), "qwen2moe-tied": dict(GGUF_SIZES, tie_word_embeddings=True),
          "qwen3moe": dict(GGUF_SIZES, model_type="qwen3_moe", norm_topk_prob=True, shared_expert_intermediate_size=0)}


def llama_cpp_logprobs(path, tokens, tmp_path):
    np.save(tmp_path / "ids.npy", tokens.numpy().astype(np.int32))
    done = subprocess.run([str(LLAMA_PYTHON), str(RUNNERS), "llamacpp", str(tmp_path / "ids.npy"),
                           str(tmp_path / "out.npy"), str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "refused" not in done.stdout, (done.stdout + done.stderr)[-800:]
    assert json.loads(done.stdout.splitlines()[-1])["version"]
    return torch.from_numpy(np.load(tmp_path / "out.npy")).double()


@pytest.mark.interop
@pytest.mark.skipif(not LLAMA_PYTHON.exists(), reason="llama.cpp's venv (benchmarks/clients.py builds it) is absent")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("bits", [None, 4])
def test_llama_cpp_runs_the_engines_moe_file_with_the_engines_log_probabilities(arch, bits, tmp_path):
    """F32: within float rounding. Q4_0 (every linear, experts stacked): llama.cpp rounds the activations to 8 bits
    for its integer dot products, and a token near a tie of its router then picks another expert, so the bound is a
    KL one, far below what a misplaced expert or scale would give (the float model against the Q4_0 one: KL ~0.3)."""
    model = tiny(**ARCHES[arch])
    if bits:
        replace_linears(model, lambda name, linear: AffineQuantLinear.from_linear(linear, bits, 32, sym=True))
    write_gguf(model, tmp_path / "m.gguf")
    tokens = ids(length=32)
    with torch.no_grad():
        ours = torch.log_softmax(model(tokens).double(), -1)
    theirs = llama_cpp_logprobs(tmp_path / "m.gguf", tokens, tmp_path)
    if bits is None:
        assert (theirs - ours).abs().max() < 1e-4
    else:
        kl = (ours.exp() * (ours - theirs)).sum(-1)
        assert kl.mean() < 0.01                      # measured 0.0027 (a dense model's Q4_0 file: 0.0007)
