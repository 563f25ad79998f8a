"""run.py's serving commands: `quantize --target` refuses what the target cannot load before any work, `--format
gguf` / `--target llama.cpp` write one GGUF file, `export` turns a checkpoint folder into one with identical logits."""
import argparse
import json

import pytest
import torch

from engine.checkpoints import gguf, gguf_file
from test_cli import run


def test_target_refusal_names_the_reason_before_training(tmp_path):
    out = run("quantize", "--method", "gptq", "--order", "act_order", "--target", "vllm",
              "--out", str(tmp_path / "ck"))
    assert out.returncode != 0 and "vLLM refuses desc_act=True" in out.stderr
    assert "training" not in out.stderr and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_quantize_writes_gguf_and_export_rewrites_it(tmp_path):
    out = run("quantize", "--method", "compressed-tensors", "--target", "llama.cpp", "--steps", "2",
              "--out", str(tmp_path / "q4_0.gguf"))
    assert out.returncode == 0, out.stderr
    wrote = [line for line in out.stderr.splitlines() if line.startswith("wrote ")][-1]
    assert json.loads(wrote.split(": ", 1)[1])["types"] == {"Q4_0": 14}
    out = run("export", str(tmp_path / "q4_0.gguf"), "--gguf", str(tmp_path / "again.gguf"))
    assert out.returncode == 0, out.stderr
    with gguf_file.GGUFFile(tmp_path / "q4_0.gguf") as a, gguf_file.GGUFFile(tmp_path / "again.gguf") as b:
        assert a.tensors["token_embd.weight"].type_name == "Q6_K"      # --target llama.cpp: llama-quantize's choice
        assert b.tensors["token_embd.weight"].type_name == "F32"       # export's default: the embedding as loaded
        assert torch.equal(gguf.load_gguf(tmp_path / "q4_0.gguf").model.embed_tokens.weight.reshape(-1),
                           b.raw("token_embd.weight").view(torch.float32))
        assert all(torch.equal(a.raw(name), b.raw(name)) for name in a.tensors if name != "token_embd.weight")
        assert {k: v for k, v in a.metadata.items() if k.startswith("tokenizer.")} == \
            {k: v for k, v in b.metadata.items() if k.startswith("tokenizer.")}


def test_embedding_type_is_refused_where_no_gguf_file_is_written(tmp_path):
    out = run("quantize", "--method", "rtn", "--embedding-type", "Q8_0", "--out", str(tmp_path / "ck"))
    assert out.returncode == 1 and "--embedding-type sets a GGUF file's embedding type" in out.stderr
    assert not any(tmp_path.iterdir())


def test_boolean_options_parse_as_json_booleans():
    """`--option sym=True` must reach the quantizer (and config.json) as true, not the string "True"."""
    from engine import cli_quantize
    for text in ("True", "true", "1", "yes"):
        args = argparse.Namespace(method="gptq", option=[f"sym={text}"], group_size=None, order=None, bpw=None)
        assert cli_quantize.quantize_options(args) == {"sym": True}
    with pytest.raises(ValueError, match="sym wants true or false"):
        cli_quantize.quantize_options(argparse.Namespace(method="gptq", option=["sym=maybe"], group_size=None,
                                                order=None, bpw=None))
