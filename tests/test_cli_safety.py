"""run.py never loses or mixes data and never prints a traceback for bad input: the model is never its own output,
nothing is written below a file, tokenizer side files are read only as regular files inside their folder, a GGUF
output has one writer, a full disk changes nothing (one `error:` line otherwise); and `quantize --model` checks
everything once and opens its source once."""
import collections
import dataclasses
import json
import os
import subprocess
import sys

import pytest
from safetensors import SafetensorError

from engine import safe_writes, safetensors_io
from engine.checkpoints import gguf_file, gguf_writer, models, streaming, tokenizer
from engine.formats import quantized_checkpoints as registry
from engine.loaders import save_dense
from engine.checkpoints.tokenizer import export_tokenizer
from test_cli import ROOT, run
from test_safe_writes import HOLDER


@pytest.fixture
def dense(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "dense", side_files=lambda folder: export_tokenizer(None, folder))
    return tmp_path / "dense"


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _one_error_line(out, match):
    """Exit 1, no traceback, and one `error:` line (the last; progress lines may come before it) saying `match`."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:] and match in lines[-1], out.stderr


@pytest.mark.parametrize("where", ["model", "inside"])
def test_quantize_never_writes_the_model_it_reads(dense, where):
    before = _files(dense)
    out = dense if where == "model" else dense / "q"
    result = run("quantize", "--model", str(dense), "--method", "fp8", "--out", str(out), "--force")
    _one_error_line(result, "the model it is made from")
    assert _files(dense) == before


def test_an_output_below_a_file_is_one_error_line(dense, tmp_path):
    (tmp_path / "file").write_text("x")
    result = run("quantize", "--model", str(dense), "--method", "fp8", "--out", str(tmp_path / "file" / "sub"))
    _one_error_line(result, "file is a file, not a folder")


@pytest.mark.parametrize("case, match", [
    ("malformed", "tokenizer.json is not a valid tokenizer.json"),
    ("linked away", "tokenizer.json is a link to"),
    ("config a list", "tokenizer_config.json must hold a JSON object"),
    ("template linked away", "chat_template.jinja is a link to"),
])
def test_export_reads_tokenizer_files_only_inside_the_folder(dense, tmp_path, case, match):
    outside = tmp_path / "outside.txt"
    outside.write_text("a file outside the folder")
    if case == "malformed":
        (dense / "tokenizer.json").write_text('{"model": ')
    elif case == "linked away":
        os.replace(dense / "tokenizer.json", tmp_path / "tokenizer.json")
        (dense / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    elif case == "config a list":
        (dense / "tokenizer_config.json").write_text("[1, 2]")
    else:
        (dense / "chat_template.jinja").symlink_to(outside)
    result = run("export", str(dense), "--gguf", str(tmp_path / "m.gguf"))
    _one_error_line(result, match)
    assert not (tmp_path / "m.gguf").exists()


def test_quantize_from_a_gguf_file_checks_once_and_opens_it_once(tiny_model, tmp_path, monkeypatch):
    """Issue 24: the source GGUF file was opened three times and its tokenizer rebuilt twice; the output, "needs
    data" and each layer's config were checked twice."""
    import run as cli
    gguf_writer.write_gguf(tiny_model, tmp_path / "m.gguf")
    counts = collections.Counter()

    def counted(label, real):
        def call(*args, **kwargs):
            counts[label] += 1
            return real(*args, **kwargs)
        return call

    real_init = gguf_file.GGUFFile.__init__
    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", counted("file opened", real_init))
    for module in (streaming, models, registry, safe_writes, tokenizer):      # Source (models.py) reads the file
        for name, label in (("check_output", "output checked"), ("gguf_tokenizer", "tokenizer rebuilt")):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(label, getattr(module, name)))
    gptq = registry.METHODS["gptq"]
    monkeypatch.setitem(registry.METHODS, "gptq", dataclasses.replace(
        gptq, calibration=counted("needs data asked", gptq.calibration),
        validate=counted("layer config validated for writing", gptq.validate)))
    cli.main(["quantize", "--model", str(tmp_path / "m.gguf"), "--method", "gptq", "--group-size", "32",
              "--calib-samples", "2", "--calib-len", "16", "--out", str(tmp_path / "out")])
    assert counts == {"file opened": 1, "tokenizer rebuilt": 1, "output checked": 1, "needs data asked": 1,
                      "layer config validated for writing": 1}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_a_second_run_into_a_gguf_file_is_refused_at_once(dense, tmp_path, command):
    """GGUF outputs took no lock: two exports into one new file both said `wrote`, the later rename winning."""
    out = tmp_path / "m.gguf"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"                  # as a first run holds it
        argv = ["export", str(dense), "--gguf"] if command == "export" else \
            ["quantize", "--model", str(dense), "--method", "mxfp4", "--format", "gguf", "--out"]
        result = run(*argv, str(out))
    finally:
        holder.kill()
        holder.wait()
    _one_error_line(result, f"is being written by another run (pid {holder.pid}")
    assert "layers" not in result.stderr and not out.exists()        # refused before the conversion


def test_a_full_disk_while_a_conversion_replaces_a_checkpoint_is_one_error(dense, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, which escaped as a traceback."""
    import run as cli
    out = tmp_path / "out"
    cli.main(["quantize", "--model", str(dense), "--method", "fp8", "--out", str(out)])
    before = _files(out)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors_io, "library_save_file", full)
    with pytest.raises(SystemExit, match=rf"error: no space left on the device while writing {out}: about .* MB "
                                         "more is needed, .* the unfinished copy was removed and nothing was replaced"):
        cli.main(["quantize", "--model", str(dense), "--method", "fp8", "--option", "block=64", "--out", str(out)])
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["dense", "out"]
