"""run.py's serving commands: `quantize --target` refuses what the target cannot load before any work, `--format
gguf` / `--target llama.cpp` write one GGUF file, `export` turns a checkpoint folder into one with identical logits."""
import argparse
import json

import pytest
import torch

from engine.checkpoints import gguf
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
    with gguf.GGUFFile(tmp_path / "q4_0.gguf") as a, gguf.GGUFFile(tmp_path / "again.gguf") as b:
        assert all(torch.equal(a.raw(name), b.raw(name)) for name in a.tensors)      # the same blocks, byte for byte
        assert {k: v for k, v in a.metadata.items() if k.startswith("tokenizer.")} == \
            {k: v for k, v in b.metadata.items() if k.startswith("tokenizer.")}


def test_boolean_options_parse_as_json_booleans():
    """`--option sym=True` must reach the quantizer (and config.json) as true, not the string "True"."""
    from engine import cli
    for text in ("True", "true", "1", "yes"):
        args = argparse.Namespace(method="gptq", option=[f"sym={text}"], group_size=None, order=None, bpw=None)
        assert cli.quantize_options(args) == {"sym": True}
    with pytest.raises(ValueError, match="sym wants true or false"):
        cli.quantize_options(argparse.Namespace(method="gptq", option=["sym=maybe"], group_size=None,
                                                order=None, bpw=None))
