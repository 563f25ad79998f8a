"""run.py on Qwen3-MoE and Qwen2-MoE models: generate, quantize layer by layer from disk (into a folder and into a
qwen3moe / qwen2moe GGUF file), eval; what cannot be done refused in one line before any work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loaders import save_dense
from engine.qwen3 import Qwen3, Qwen3MoeConfig

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
             initializer_range=0.2, max_position_embeddings=512)


def run(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *map(str, args)], capture_output=True, text=True,
                          errors="replace", cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for name, change in (("mixed", dict(mlp_only_layers=(1,))), ("sparse", {}),
                         ("shared", dict(model_type="qwen2_moe", shared_expert_intermediate_size=64,
                                         norm_topk_prob=False))):
        torch.manual_seed(0)
        save_dense(Qwen3(Qwen3MoeConfig(**{**SIZES, **change})), root / name)
    return root


def test_generate_quantize_and_eval_run_on_a_moe_model(folders):
    out = run("generate", "--model", "mixed", "--prompt", "hello", "--max-new-tokens", "4", cwd=folders)
    assert out.returncode == 0 and "4 tokens in" in out.stderr, out.stderr
    out = run("quantize", "--model", "mixed", "--method", "gptq", "--calib-samples", "4", "--calib-len", "32",
              "--option", "group_size=32", "--out", "q", cwd=folders)
    assert out.returncode == 0, out.stderr
    qcfg = json.loads((folders / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["expert_tokens"][1] is None and sum(qcfg["expert_tokens"][0]) == 4 * 32 * 2
    out = run("eval", "--model", "mixed", "--quantized", "q", "--chunks", "2", "--ctx", "32", cwd=folders)
    assert out.returncode == 0, out.stderr
    assert 0 < json.loads(out.stdout.splitlines()[0])["kl_nats"] < 1


def test_a_moe_model_goes_into_a_qwen3moe_gguf_file_and_evaluates(folders):
    out = run("quantize", "--model", "sparse", "--method", "gptq", "--target", "llama.cpp", "--option",
              "ggml_type=Q4_0", "--calib-samples", "4", "--calib-len", "32", "--out", "m.gguf", cwd=folders)
    assert out.returncode == 0 and '"types": {"Q4_0": 32}' in out.stderr, out.stderr
    out = run("eval", "--model", "sparse", "--quantized", "m.gguf", "--chunks", "2", "--ctx", "32", cwd=folders)
    assert out.returncode == 0 and 0 < json.loads(out.stdout.splitlines()[0])["kl_nats"] < 1, out.stderr


def test_a_qwen2_moe_model_quantizes_to_a_gguf_file_that_runs(folders):
    out = run("quantize", "--model", "shared", "--method", "gptq", "--target", "llama.cpp", "--option",
              "ggml_type=Q4_0", "--calib-samples", "4", "--calib-len", "32", "--out", "shared.gguf", cwd=folders)
    assert out.returncode == 0 and '"types": {"Q4_0": 38}' in out.stderr, out.stderr      # 2 x (4 + 3 + 4 x 3)
    out = run("generate", "--model", "shared.gguf", "--prompt", "hello", "--max-new-tokens", "4", cwd=folders)
    assert out.returncode == 0 and "4 tokens in" in out.stderr, out.stderr


@pytest.mark.parametrize("args, message", [
    (["quantize", "--model", "mixed", "--method", "gptq", "--target", "llama.cpp", "--option", "ggml_type=Q4_0",
      "--out", "x.gguf"], "error: layers [1] of this qwen3_moe model are dense"),
    (["quantize", "--model", "mixed", "--method", "trellis", "--option", "ldlq=true", "--out", "x"],
     "error: trellis with ldlq=True is not implemented for MoE models"),
    (["quantize", "--model", "mixed", "--method", "rtn", "--target", "transformers", "--out", "x"],
     "error: transformers cannot load this checkpoint: (MoE) its experts' decompressor gets no zero points"),
    (["quantize", "--model", "mixed", "--method", "gptq", "--target", "transformers", "--out", "x"],
     "error: transformers cannot load this checkpoint: (MoE) its GPTQ loader replaces nn.Linears only"),
])
def test_what_a_moe_model_cannot_get_is_one_line_before_any_work(folders, args, message):
    out = run(*args, cwd=folders)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(message), out.stderr
    assert "layers:" not in out.stderr and not (folders / "x").exists() and not (folders / "x.gguf").exists()


@pytest.mark.parametrize("method, options, warns", [
    ("gptq", {}, True), ("awq", {}, True), ("compressed-tensors", {}, True), ("gptq", {"sym": False}, None)])
def test_vllm_on_a_moe_model_warns_of_its_cpu_build_where_dense_layers_would_load(method, options, warns):
    """serving.MOE_VLLM: vLLM CPU 0.32 refused the engine's 4-bit MoE files ('No WNA16 MoE backend'), the dense
    folder loaded (appendix/moe.md); what LOADS refuses everywhere stays an error."""
    import warnings
    from engine.checkpoints.serving import check_target
    if warns is None:
        with pytest.raises(ValueError, match="vllm cannot load this checkpoint"):
            check_target("vllm", method, options, moe=True)
        return
    with pytest.warns(UserWarning, match=r"vllm: \(MoE\) vLLM's CPU build has no MoE kernel for 4-bit experts"):
        check_target("vllm", method, options, moe=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_target("vllm", method, {**options, "sym": True} if method == "gptq" else options, moe=False)
