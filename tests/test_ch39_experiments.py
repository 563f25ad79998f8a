"""The chapter's stretch exercises. 1 (experiments/ch39.py methods, sensitivity): every method's row on a real
checkpoint folder, KL and next-token accuracy; the per-layer sensitivity ranks layers. 2 (a Triton kernel that
decodes trellis codes on the fly) and 3 (BlockLDLQ: GPTQ's feedback with trellis codes): `run.py quantformats`'
rows. 4: gpt-oss's MXFP4 expert tensors decode as transformers' converter decodes them."""
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


def _dense_folder(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "m", side_files=lambda f: write_tokenizer_files(byte_tokenizer(), f))
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)
    return tmp_path / "m", text


@pytest.mark.slow
def test_exercise_1_prints_each_methods_row_with_next_token_accuracy(tiny_model, tmp_path):
    model, text = _dense_folder(tiny_model, tmp_path)
    out = run("methods", "--model", str(model), "--text", str(text), "--calib-samples", "4", "--calib-len", "64",
              "--ctx", "64", "--chunks", "2")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in rows] == ["RTN int4, g128", "GPTQ int4, g128", "GPTQ int4, g128, act-order",
                                          "AWQ int4, g128"]
    assert all(0 <= r["next_token_pct"] <= 100 and r["kl_nats"] > 0 for r in rows)
    assert out.stdout.index("RTN int4, g128: KL") < out.stdout.index('{"method": "GPTQ int4, g128"')  # as it finishes


def test_exercise_1_takes_run_pys_model_names_and_refuses_what_is_not_a_model(tmp_path):
    out = run("methods", "--model", str(tmp_path / "nothing"))
    assert out.returncode == 1 and out.stderr.strip() == f"error: --model {tmp_path / 'nothing'}: no such file or folder"


def test_exercise_4_without_transformers_names_the_command_that_installs_it(tmp_path):
    """transformers hidden from the run (an import hook that refuses it): one line with `pip install transformers`."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text("import sys\nclass Hide:\n    def find_spec(self, name, *a):\n        if name.split('.')[0] == "
                    "'transformers':\n            raise ImportError(name)\nsys.meta_path.insert(0, Hide())\n")
    import os
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "ch39.py"), "gpt-oss"], capture_output=True,
                         text=True, cwd=ROOT, env=env)
    assert out.returncode == 1 and "`pip install transformers`" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_exercises_2_and_3_are_quantformats_rows():
    """Exercise 2's kernel decodes the trellis row through Triton (--impl engine); exercise 3's BlockLDLQ row has a
    far lower KL than plain trellis coding at the same bits."""
    rows = {}
    for impl, labels in (("torch", ["trellis (QTIP-style), L=8", "BlockLDLQ (QTIP-style), L=8"]),
                         ("engine", ["trellis (QTIP-style), L=8"])):
        done = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantformats", "--steps", "30", "--impl", impl,
                               "--rows", *labels], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        rows[impl] = {r["format"]: r for r in map(json.loads, filter(lambda line: line.startswith('{"format"'),
                                                                      done.stdout.splitlines()))}
    plain = rows["torch"]["trellis (QTIP-style), L=8"]
    ldlq = rows["torch"]["trellis BlockLDLQ (QTIP-style), L=8, 16x16 tiles"]
    assert ldlq["bits"] == plain["bits"] and ldlq["kl_nats"] < plain["kl_nats"] / 2
    assert rows["engine"]["trellis (QTIP-style), L=8"]["kl_nats"] == pytest.approx(plain["kl_nats"], rel=1e-3)
