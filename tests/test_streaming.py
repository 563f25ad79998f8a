"""Quantizing from disk, one decoder layer at a time: the same checkpoint as the in-memory path for every method,
source dtypes kept, resumable after a kill, GGUF sources, bad input refused before any work; the source never
replaced, the user's files kept, one writer per output, a full disk refused first or kept for a resume."""
import copy
import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.formats import quantized_checkpoints as registry
from engine.loaders import model_digest, save_dense
from engine.formats.quantized_checkpoints import load_quantized, save_quantized
from engine.safetensors_io import INDEX, checkpoint_records, snapshot_tensors
from engine.checkpoints.streaming import quantize_checkpoint
from engine.formats.llama_cpp import gptq_ggml
from engine.qwen3 import Qwen3, Qwen3Config

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]

OPTIONS = {"gptq": dict(group_size=32, order="act_order_static"), "awq": dict(group_size=32), "fp8": dict(block=32),
           "compressed-tensors": dict(group_size=32), "trellis": dict(L=6, K=2, group=64),
           "lattice": dict(bps=3.0), "entquant": dict(lam=14.5, max_iter=5)}


@pytest.fixture(scope="module")
def three_layers():
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=3)
    return Qwen3(cfg).eval()


@pytest.fixture(scope="module")
def source(three_layers, tmp_path_factory):
    folder = tmp_path_factory.mktemp("src") / "dense"
    save_dense(three_layers, folder)
    return folder


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def _tensors(folder):
    return dict(snapshot_tensors(folder))


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_streaming_writes_what_the_in_memory_path_writes(method, three_layers, source, ids, tmp_path):
    in_memory = save_quantized(copy.deepcopy(three_layers), tmp_path / "mem", method, ids, **OPTIONS[method])
    streamed = quantize_checkpoint(source, tmp_path / "disk", method, ids, progress=False, **OPTIONS[method])
    assert streamed == in_memory
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "disk" / INDEX).exists()                           # sharded, one shard per layer + rest
    records = checkpoint_records(tmp_path / "disk")
    assert records["engine.source_sha256"] == model_digest(three_layers)  # provenance without the model in memory
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "disk")(ids), load_quantized(tmp_path / "mem")(ids))


def test_a_bpw_mix_streams_with_the_same_fisher_and_plan(three_layers, source, ids, tmp_path, monkeypatch):
    """GPTQ's --bpw mix can price its candidates with the model's output Fisher (plan=fisher): from disk it is
    measured one layer at a time, the tied head held, and the Fisher each layer's plan sees, the plan and every
    byte equal the in-memory path's."""
    seen, layer_errors = [], gptq_ggml.layer_errors

    def spy(layer, names, *args, **kwargs):
        seen.append({n: layer.fisher[layer.prefix + n] for n in names})
        return layer_errors(layer, names, *args, **kwargs)

    monkeypatch.setattr(gptq_ggml, "layer_errors", spy)
    options = dict(bpw=5.0, order="act_order_static", plan="fisher")
    in_memory = save_quantized(copy.deepcopy(three_layers), tmp_path / "mem", "gptq", ids, **options)
    streamed = quantize_checkpoint(source, tmp_path / "disk", "gptq", ids, progress=False, **options)
    assert len(seen) == 6 and all(torch.equal(seen[i][n], seen[i + 3][n]) for i in range(3) for n in seen[i])
    assert streamed == in_memory and len(set(streamed["ggml_types"].values())) > 1
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a bf16 source: the tied head computes in the converter's float32 (red before: a dtype error in lm_head)
    save_dense(three_layers, tmp_path / "bf16", dtype=torch.bfloat16)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "from-bf16", "gptq", ids, progress=False, **options)
    assert len(seen) == 9 and all(torch.allclose(seen[i][n], seen[i + 6][n], rtol=0.1) for i in range(3)
                                  for n in seen[i])


def test_block_ldlq_streams_too(three_layers, source, ids, tmp_path):
    options = dict(L=6, K=2, group=64, ldlq=True)
    save_quantized(copy.deepcopy(three_layers), tmp_path / "mem", "trellis", ids, **options)
    quantize_checkpoint(source, tmp_path / "disk", "trellis", ids, progress=False, **options)
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_entquant_with_calibration_feedback_streams_too(three_layers, source, ids, tmp_path):
    options = dict(lam=14.5, max_iter=5, feedback="calibration")             # Hessians from ids, block by block
    in_memory = save_quantized(copy.deepcopy(three_layers), tmp_path / "mem", "entquant", ids, **options)
    streamed = quantize_checkpoint(source, tmp_path / "disk", "entquant", ids, progress=False, **options)
    assert streamed == in_memory and streamed["feedback"] == "calibration"
    save_quantized(copy.deepcopy(three_layers), tmp_path / "plain", "entquant", ids, lam=14.5, max_iter=5)
    assert not torch.equal(_tensors(tmp_path / "plain")["model.layers.2.self_attn.q_proj.weight_stream"],
                           _tensors(tmp_path / "disk")["model.layers.2.self_attn.q_proj.weight_stream"])
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("options, match", [(dict(feedback="self"), "whole model in memory"),
                                            (dict(feedback="calibration", feedback_damp=-1.0), "feedback_damp")])
def test_entquant_options_a_layer_cannot_run_are_refused_before_any_work(options, match, source, ids, tmp_path):
    with pytest.raises(ValueError, match=match):
        quantize_checkpoint(source, tmp_path / "out", "entquant", ids, progress=False, lam=14.5, **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("first, options", [("gptq", dict(group_size=32, order="act_order")), ("nf4", {}),
                                            ("fp8", dict(block=32))])
def test_a_quantized_checkpoint_as_the_source_is_read_dequantized(first, options, three_layers, ids, tmp_path):
    """A GPTQ file (act-order: a permuted g_idx), a bitsandbytes one (dotted parts) or an FP8 one converted again:
    each linear read as the weight load_model(dense=True) holds, so the output is what quantizing that model in memory
    writes, byte for byte, and records its digest (eval's check). Red before: one error refusing any quantized
    source (and, before that, `unexpected tensor ...g_idx`)."""
    from engine.checkpoints.models import load_model
    save_quantized(copy.deepcopy(three_layers), tmp_path / "first", first, ids, **options)
    dense = load_model(tmp_path / "first", dense=True)
    in_memory = save_quantized(dense, tmp_path / "mem", "compressed-tensors", group_size=32)
    streamed = quantize_checkpoint(tmp_path / "first", tmp_path / "disk", "compressed-tensors", progress=False,
                                   group_size=32)
    assert streamed == in_memory
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    source = model_digest(load_model(tmp_path / "first", dense=True))
    assert checkpoint_records(tmp_path / "disk")["engine.source_sha256"] == source


def test_a_quantized_source_that_cannot_be_read_by_layer_is_one_error(three_layers, tmp_path):
    save_quantized(copy.deepcopy(three_layers), tmp_path / "ent", "entquant", lam=14.5, max_iter=5)
    with pytest.raises(ValueError, match="a checkpoint of method entquant is read whole"):
        quantize_checkpoint(tmp_path / "ent", tmp_path / "out", "fp8", progress=False, block=32)
    save_quantized(copy.deepcopy(three_layers), tmp_path / "gptq", "gptq", torch.randint(0, 256, (2, 16)),
                   group_size=32)

    def drop(tensors):                                                    # one linear loses a part
        del tensors["model.layers.1.mlp.up_proj.qzeros"]
    from helpers import rewrite_tensors
    rewrite_tensors(tmp_path / "gptq", drop)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj: a gptq linear needs \['g_idx', 'qweight', "
                                         r"'qzeros', 'scales'\]; the checkpoint has \['g_idx', 'qweight', 'scales'\]"):
        quantize_checkpoint(tmp_path / "gptq", tmp_path / "out", "fp8", progress=False, block=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ent", "gptq"]


def test_unquantized_tensors_keep_the_source_dtype(three_layers, ids, tmp_path):
    save_dense(three_layers, tmp_path / "bf16", dtype=torch.bfloat16)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", "gptq", ids, progress=False, group_size=32)
    tensors = _tensors(tmp_path / "out")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.2.input_layernorm.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.2.self_attn.q_proj.scales"].dtype == torch.float16     # GPTQ's own layout


class _Killed(Exception):
    pass


def _watched_gptq(monkeypatch, seen, dies_at=None):
    """Put a GPTQ in the registry that records which layers it quantizes and raises at layer `dies_at`."""
    real = gptq_ggml.CHECKPOINT                                          # the registry's GPTQ, unwrapped

    def quantize_layer(layer, **options):
        seen.append(layer.index)
        if layer.index == dies_at:
            raise _Killed
        return real.quantize_layer(layer, **options)
    monkeypatch.setitem(registry.METHODS, "gptq", dataclasses.replace(real, quantize_layer=quantize_layer))


def test_a_killed_conversion_resumes_and_gives_the_same_checkpoint(source, ids, tmp_path, monkeypatch):
    quantize_checkpoint(source, tmp_path / "whole", "gptq", ids, progress=False, group_size=32)
    seen = []
    _watched_gptq(monkeypatch, seen, dies_at=2)
    with pytest.raises(_Killed):
        quantize_checkpoint(source, tmp_path / "out", "gptq", ids, progress=False, group_size=32)
    partial = tmp_path / ".out.partial"
    assert json.loads((partial / "progress.json").read_text())["done"] == 2 and not (tmp_path / "out").exists()
    seen.clear()
    _watched_gptq(monkeypatch, seen)
    quantize_checkpoint(source, tmp_path / "out", "gptq", ids, progress=False, group_size=32)
    assert seen == [2]                                                    # layers 0 and 1 were not redone
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "out")
    assert all(torch.equal(a[k], b[k]) for k in a) and not partial.exists()


def test_a_partial_from_other_settings_is_started_over(source, ids, tmp_path):
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "progress.json").write_text(json.dumps({"identity": "another run", "done": 3}))
    quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False, block=32)
    assert load_quantized(tmp_path / "out") is not None and not partial.exists()


def test_a_gguf_source_streams_from_its_dequantized_weights(tiny_model, ids, tmp_path):
    from test_gguf import U32, gguf_bytes, qwen3_metadata, qwen3_tensors, write      # the GGUF tests' writer
    tensors, _ = qwen3_tensors(tiny_model)
    path = write(tmp_path, gguf_bytes(qwen3_metadata(tiny_model.cfg) + [("qwen3.vocab_size", U32, 256)], tensors))
    quantize_checkpoint(path, tmp_path / "out", "gptq", ids, progress=False, group_size=32)
    save_quantized(copy.deepcopy(tiny_model), tmp_path / "mem", "gptq", ids, group_size=32, order="act_order_static")
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "out")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_is_refused_before_any_work(source, tmp_path):
    with pytest.raises(ValueError, match="GPTQ needs calibration_ids|gptq needs calibration_ids"):
        quantize_checkpoint(source, tmp_path / "out", "gptq", None, progress=False)
    with pytest.raises(ValueError, match="unknown method 'bitnet'"):
        quantize_checkpoint(source, tmp_path / "out", "bitnet")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not an engine checkpoint"):
        quantize_checkpoint(source, mine, "fp8", progress=False)
    assert (mine / "notes.txt").read_text() == "keep" and not (tmp_path / ".mine.partial").exists()


def test_a_resumed_conversion_says_where_it_resumes_and_its_bar_starts_there(source, ids, tmp_path, monkeypatch,
                                                                             capsys):
    _watched_gptq(monkeypatch, [], dies_at=2)
    with pytest.raises(_Killed):
        quantize_checkpoint(source, tmp_path / "out", "gptq", ids, progress=False, group_size=32)
    _watched_gptq(monkeypatch, [])
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    quantize_checkpoint(source, tmp_path / "out", "gptq", ids, progress=True, group_size=32)
    err = capsys.readouterr().err
    assert f"resuming {tmp_path / 'out'}: layers 0-1 of 3 were written by an earlier run" in err
    assert "2/3" in err and "0/3" not in err                  # the bar starts at the layers already done


# ---- the source, the user's files, one writer, a full disk --------------------------------------------------------

@pytest.mark.parametrize("where", ["the source", "inside it", "containing it"])
def test_the_output_is_never_the_source_inside_it_or_around_it(three_layers, where, tmp_path):
    source = tmp_path / "model" / "dense"
    save_dense(three_layers, source)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    out = {"the source": source, "inside it": source / "q", "containing it": tmp_path / "model"}[where]
    with pytest.raises(ValueError, match=r"(is|lies inside|contains) the model it is made from"):
        quantize_checkpoint(source, out, "fp8", progress=False, force=True)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "dense", "model", "model.safetensors"]


def test_an_engine_checkpoint_with_the_users_files_is_not_replaced(source, tmp_path):
    quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False, block=32)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "out" / "mydata").mkdir()
    with pytest.raises(ValueError, match=r"also holds other files \(mydata/, notes.txt\); replacing it would delete"):
        quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (tmp_path / "out" / "mydata").is_dir()


SLOW_WRITER = """
import dataclasses, pathlib, sys, time
from engine.formats import quantized_checkpoints as registry
from engine.checkpoints.streaming import quantize_checkpoint
source, out, go = sys.argv[1:4]
real = registry.METHODS["fp8"]
def quantize_layer(layer, **options):
    while not pathlib.Path(go).exists():
        time.sleep(0.05)
    return real.quantize_layer(layer, **options)
registry.METHODS["fp8"] = dataclasses.replace(real, quantize_layer=quantize_layer)
quantize_checkpoint(source, out, "fp8", progress=False, block=32)
"""


def test_a_second_conversion_into_the_same_folder_is_refused_at_once(three_layers, source, tmp_path):
    other = copy.deepcopy(three_layers)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight[0, 0] += 1          # model B: one weight of layer 1 differs
    save_dense(other, tmp_path / "b")
    quantize_checkpoint(source, tmp_path / "a-alone", "fp8", progress=False, block=32)
    out, go = tmp_path / "out", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(source), str(out), str(go)], cwd=ROOT,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / ".out.partial").exists():                 # the first run is under way
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        with pytest.raises(ValueError, match=rf"output {out} is being written by another run \(pid {first.pid}"):
            quantize_checkpoint(tmp_path / "b", out, "fp8", progress=False, block=32)
    finally:
        go.touch()
        assert first.wait(300) == 0, first.stderr.read()
    assert _tensors(out).keys() == _tensors(tmp_path / "a-alone").keys()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(out).values(), _tensors(tmp_path / "a-alone").values()))


def test_a_conversion_that_cannot_fit_is_refused_before_any_work(source, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(ValueError, match=rf"not enough space for {tmp_path / 'out'}: about [0-9.]+ MB more is needed, "
                                         r"0.0 MB is free; nothing was written"):
        quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_up_keeps_the_finished_layers_and_the_next_run_resumes(source, tmp_path, monkeypatch,
                                                                                  capfd):
    quantize_checkpoint(source, tmp_path / "whole", "fp8", progress=False, block=32)
    real, calls = os.fsync, []

    def fills_up(fd):                                   # the third fsync: layer 1's shard, after layer 0 and its record
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fills_up)
    with pytest.raises(ValueError, match=r"no space left on the device while writing .*out: about [0-9.]+ MB more is "
                                         r"needed, [0-9.]+ MB is free; the finished part \([0-9.]+ MB in "
                                         r"\.out\.partial\) is kept: free space and run the same command again"):
        quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False, block=32)
    monkeypatch.undo()
    assert json.loads((tmp_path / ".out.partial" / "progress.json").read_text())["done"] == 1
    capfd.readouterr()
    quantize_checkpoint(source, tmp_path / "out", "fp8", progress=False, block=32)
    assert f"resuming {tmp_path / 'out'}: layer 0 of 3 was written by an earlier run" in capfd.readouterr().err
    assert [p.read_bytes() for p in sorted((tmp_path / "out").iterdir())] == \
        [p.read_bytes() for p in sorted((tmp_path / "whole").iterdir())]


@pytest.mark.parametrize("bad_id", [256, 10 ** 6, 2 ** 31 - 1])
def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_before_any_work(three_layers, tmp_path, bad_id):
    """Even for a data-free method, which never tokenizes: the tokenizer would be copied into the output, and
    `generate` on it would fail on its first use of that id."""
    from engine.checkpoints.tokenizer import export_tokenizer
    save_dense(three_layers, tmp_path / "src", side_files=lambda folder: export_tokenizer(None, folder))
    spec = json.loads((tmp_path / "src" / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": bad_id, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "src" / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"token '<extra>' has id {bad_id}, beyond the model's vocabulary of 256"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "out", "fp8", progress=False)
    assert not (tmp_path / "out").exists()
