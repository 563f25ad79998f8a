"""Serving: the table of what loads where, the settings each --target picks or refuses (naming the reason), and the
tensor-parallel degrees a checkpoint's shapes allow (vLLM's sharding rules), on checkpoints the engine writes."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoints import serving
from engine.formats.quantized_checkpoints import save_quantized
from engine.qwen3 import Qwen3, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def config(quantization_config=None, **shape):
    raw = dataclasses.replace(Qwen3Config(), **shape).to_hf()
    if quantization_config:
        raw["quantization_config"] = quantization_config
    return raw


def supported(raw):
    return [tp for tp, reasons in serving.tp_degrees(raw).items() if not reasons]


def test_book_model_shards_by_its_heads_and_its_groups():
    """hidden 256 = 4 heads x 64, 2 KV heads, intermediate 768."""
    assert supported(config()) == [1, 2, 4]
    assert serving.tp_degrees(config())[8] == ["4 attention heads do not split over 8 ranks"]
    assert supported(config({"quant_method": "gptq", "bits": 4, "group_size": 64})) == [1, 2, 4]
    reasons = serving.tp_degrees(config({"quant_method": "gptq", "bits": 4, "group_size": 128}))[4]
    assert reasons == ["o_proj: 64 inputs per rank, not a multiple of 128",
                       "down_proj: 192 inputs per rank, not a multiple of 128"]


def test_fp8_blocks_are_never_split_below_128():
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert supported(config(fp8)) == [1]                       # at 2 ranks k_proj / v_proj keep 64 rows each
    assert "k_proj: 64 outputs per rank, not a multiple of 128" in serving.tp_degrees(config(fp8))[2]
    assert supported(config(fp8, num_key_value_heads=4)) == [1, 2]
    # unsplit, vLLM still merges q/k/v: every part but the last (v) must be whole blocks
    assert supported(config(fp8, hidden_size=512, num_attention_heads=8, num_key_value_heads=1)) == []


def test_kv_heads_replicate_onto_more_ranks_only_when_they_divide_them():
    assert supported(config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2)) == [1, 2, 4, 8]
    assert "3 KV heads neither split" in serving.tp_degrees(
        config(hidden_size=384, num_attention_heads=6, num_key_value_heads=3))[2][0]


def test_packed_words_must_not_be_split():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32}
    assert serving.shard_units(awq) == (8, 32)                  # outputs packed 8 per int32, groups along inputs
    assert serving.shard_units({"quant_method": "gptq", "bits": 4, "group_size": -1}) == (8, 8)
    assert "q_proj: 4 outputs per rank" in serving.tp_degrees(config(awq, hidden_size=32, num_attention_heads=8,
                                                                      num_key_value_heads=8, head_dim=4,
                                                                      intermediate_size=64))[8][0]
    with pytest.raises(ValueError, match="trellis.*no tensor-parallel layout"):
        serving.shard_units({"quant_method": "trellis"})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints the engine writes -> their config.json, to check shard_units and config_kind read them."""
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1)
    out = {}
    for name, method, options in [("ct-asym", "compressed-tensors", {"symmetric": False, "group_size": 32}),
                                  ("ct-nvfp4", "compressed-tensors", {"format": "nvfp4-pack-quantized"}),
                                  ("ct-fp8", "compressed-tensors", {"format": "float-quantized", "block": 32}),
                                  ("fp8", "fp8", {"block": 32})]:
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        save_quantized(Qwen3(cfg).eval(), folder, method, force=True, **options)
        out[name] = (serving.read_config(folder), method, options)
    return out


def test_written_checkpoints_are_read_by_kind_and_units(written):
    units = {"ct-asym": (8, 32), "ct-nvfp4": (1, 16), "ct-fp8": (32, 32), "fp8": (32, 32)}
    for name, (raw, method, options) in written.items():
        assert serving.config_kind(raw) == serving.checkpoint_kind(method, options), name
        assert serving.shard_units(raw["quantization_config"]) == units[name], name


@pytest.mark.parametrize("target,method,options,fmt,match", [
    ("vllm", "gptq", {"order": "act_order"}, "safetensors", "desc_act=True"),
    ("vllm", "gptq", {"sym": False}, "safetensors", "symmetric only"),
    ("vllm", "awq", {"group_size": 256}, "safetensors", "group_size = 256"),
    ("onnx", "fp8", {}, "safetensors", "fp8 quantized model is not currently supported"),
    ("onnx", "compressed-tensors", {}, "safetensors", "CUDA EP"),
    ("transformers", "trellis", {}, "safetensors", "only this engine reads it"),
    ("llama.cpp", "gptq", {"group_size": 64}, "gguf", "hold 32 weights, not group size 64"),
    ("llama.cpp", "gptq", {"order": "act_order"}, "gguf", "no permutation"),
    ("llama.cpp", "fp8", {}, "gguf", "no FP8 type"),
    ("llama.cpp", "entquant", {}, "gguf", "only this engine"),
    ("llama.cpp", "bitsandbytes", {}, "gguf", "no NF4 type"),                 # red before: refused after quantizing
    ("llama.cpp", "gptq", {"bits": 2}, "gguf", "not 2-bit asymmetric"),
    ("llama.cpp", "compressed-tensors", {"bits": 2}, "gguf", "not 2-bit symmetric"),
    ("llama.cpp", "compressed-tensors", {"bits": 8, "symmetric": False}, "gguf", r"not 8-bit asymmetric.*sym=true"),
    ("llama.cpp", "gptq", {"bits": 8}, "gguf", "not 8-bit asymmetric ones .sym=true"),
    ("vllm", "gptq", {"sym": True}, "gguf", "--format gguf is for llama.cpp"),
])
def test_target_refuses_what_it_cannot_load_naming_why(target, method, options, fmt, match):
    with pytest.raises(ValueError, match=match):
        serving.check_target(target, method, options, fmt)


def test_target_picks_the_settings_it_loads():
    with pytest.warns(UserWarning, match="picked sym=true"):
        assert serving.check_target("vllm", "gptq", {}) == ({"sym": True}, "safetensors")
    assert serving.check_target("llama.cpp", "gptq", {}) == ({"group_size": 32}, "gguf")
    # act-order with static groups (GPTQ's default) writes a sorted g_idx: a plain file every target loads
    assert serving.check_target("llama.cpp", "gptq", {"order": "act_order_static"}) == (
        {"order": "act_order_static", "group_size": 32}, "gguf")
    assert serving.check_target("llama.cpp", "compressed-tensors", {"format": "mxfp4-pack-quantized"}) == (
        {"format": "mxfp4-pack-quantized"}, "gguf")
    assert serving.check_target("onnx", "awq", {"group_size": 64}) == ({"group_size": 64}, "safetensors")
    with pytest.warns(UserWarning, match="AMX"):
        serving.check_target("vllm", "fp8", {})
    with pytest.warns(UserWarning, match="bfloat16"):
        serving.check_target("transformers", "compressed-tensors", {"format": "nvfp4-pack-quantized"})
    with pytest.raises(ValueError, match="--target must be one of"):
        serving.check_target("tgi", "gptq", {})


SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, num_hidden_layers=1, vocab_size=256)


def test_a_group_size_vllm_cannot_tile_is_refused_before_any_work(tmp_path):
    """red before: `quantize --model smollm2 --method gptq --target vllm` quantized for its minutes (a 70B: hours),
    then said `serve: none: vLLM would refuse` (576 inputs per rank in groups of 128)"""
    config = Qwen3Config(**SMOLLM2_SHAPE).to_hf()
    for method in ("gptq", "awq"):
        with pytest.raises(ValueError, match=r"vllm would refuse this checkpoint at every tensor-parallel degree "
                                             r"\(o_proj: 576 inputs per rank, not a multiple of 128\); --group-size "
                                             "-1 or 32 or 64 would load"):
            serving.check_vllm_groups(config, method, {})
        serving.check_vllm_groups(config, method, {"group_size": 64})
    serving.check_vllm_groups(config, "fp8", {})                         # not a group size's matter
    from engine.loaders import save_dense
    save_dense(Qwen3(Qwen3Config(**SMOLLM2_SHAPE)), tmp_path / "dense")
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(tmp_path / "dense"),
                          "--method", "gptq", "--target", "vllm", "--out", str(tmp_path / "q")], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("error: vllm would refuse")
    assert "layers" not in out.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_table_and_serve_line():
    table = serving.markdown_table()
    assert all(f"| {kind} |" in table for kind in serving.LOADS)
    assert "| gptq asym | loads | refuses (" in table
    raw = config({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True})
    assert serving.vllm_serve_command("ck", raw) == "vllm serve ck --quantization gptq --tensor-parallel-size 4"
    blocks = config({"quant_method": "fp8", "weight_block_size": [1000, 1000]})   # red before: max() of nothing
    assert serving.vllm_serve_command("ck", blocks).startswith("none: vLLM would refuse ck (q_proj: ")


def test_the_serving_page_carries_the_table():
    page = (Path(__file__).resolve().parents[1] / "appendix" / "serving.md").read_text()
    assert serving.markdown_table() in page, "appendix/serving.md's table is stale: paste markdown_table() again"


def test_quantize_model_to_gguf_equals_its_folder(tmp_path, tiny_model):
    """`run.py quantize --model DIR --format gguf`: the layer-by-layer converter into a folder of ours, then one GGUF
    file; the file computes what the folder does, and the folder is gone."""
    import run
    from engine.checkpoints.models import load_model
    from engine.formats.llama_cpp.gguf import load_gguf
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    common = ["quantize", "--model", str(tmp_path / "dense"), "--method", "compressed-tensors",
              "--option", "format=mxfp4-pack-quantized"]
    run.main(common + ["--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    run.main(common + ["--out", str(tmp_path / "folder")])
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        a, b = load_gguf(tmp_path / "m.gguf")(ids), load_model(tmp_path / "folder")(ids)
    assert torch.allclose(a, b, atol=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "folder", "m.gguf"]
