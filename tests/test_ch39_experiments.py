"""experiments/ch39.py, the book's stretch exercises 1 and 4: gpt-oss's MXFP4 expert tensors decode as transformers'
converter decodes them; the per-layer sensitivity ranks layers on a real checkpoint folder."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loaders import save_dense
from engine.safetensors_io import save_file
from engine.checkpoints.tokenizer import byte_tokenizer, write_tokenizer_files

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "ch39.py"), *args], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.mark.interop
def test_gpt_oss_expert_tensors_decode_as_transformers_converter_does(tmp_path):
    pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    tensors = {"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.randint(0, 256, (2, 64, 3, 16), generator=g,
                                                                               dtype=torch.uint8),
               "model.layers.0.mlp.experts.gate_up_proj_scales": torch.randint(110, 135, (2, 64, 3), generator=g,
                                                                               dtype=torch.uint8)}
    (tmp_path / "gpt-oss").mkdir()
    save_file(tensors, tmp_path / "gpt-oss" / "model.safetensors")
    for flag, path in (("--model", tmp_path / "gpt-oss"), ("--shard", tmp_path / "gpt-oss" / "model.safetensors")):
        out = run("gpt-oss", flag, str(path))                      # README's `gpt-oss --model PATH`, and a shard
        assert out.returncode == 0, out.stderr
        [row] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert row["equal_in_bf16"] and row["shape"] == [2, 64, 96]


@pytest.mark.slow
def test_sensitivity_ranks_every_layer(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "m", side_files=lambda f: write_tokenizer_files(byte_tokenizer(), f))
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    out = run("sensitivity", "--model", str(tmp_path / "m"), "--text", str(text), "--bits", "2", "--group-size",
              "32", "--calib-samples", "4", "--calib-len", "64", "--ctx", "64", "--chunks", "2")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["layer"] for r in rows) == [0, 1]
    assert rows[0]["kl_nats"] >= rows[1]["kl_nats"] > 0                  # sorted: the most sensitive first
