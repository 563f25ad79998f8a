"""A real model's calibration sources (engine.data.calibration_ids, `run.py --calib`): files mixed by share, the
built-in text, the model's own text (seeded, within the vocabulary), bad sources refused before anything loads, the
default, and the record of what was used in the checkpoint."""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from engine.loaders import save_dense
from engine.safetensors_io import tensor_digest
from engine.checkpoints.tokenizer import byte_tokenizer
from engine.data import DEFAULT_CALIBRATION, PYDOC, SELF, Corpus, calibration_ids, check_sources, default_corpus

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def _word_tokenizer(bos=True):
    """Words 'w0'..'w999' are ids 1..1000; <s> (id 0) first in every sequence when bos."""
    vocab = {"<s>": 0, **{f"w{i}": i + 1 for i in range(1000)}, "[UNK]": 1001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.add_special_tokens(["<s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _file(folder, name, words, tail):
    """A text whose first 90% are `words` repeated and whose last tenth (held out) is `tail` words."""
    path = Path(folder) / name
    path.write_text(" ".join(words[i % len(words)] for i in range(900)) + " " +
                    " ".join(tail[i % len(tail)] for i in range(100)))
    return path


def _not_loaded():
    raise AssertionError("the model was loaded")


def test_files_are_mixed_by_share_from_their_training_parts(tmp_path):
    """Two files of disjoint vocabularies: the first gives ceil(5/2) = 3 sequences, the second 2, in the order
    given, and neither held-out tail appears."""
    a = _file(tmp_path, "a.txt", [f"w{i}" for i in range(100)], [f"w{i}" for i in range(800, 900)])
    b = _file(tmp_path, "b.txt", [f"w{i}" for i in range(300, 400)], [f"w{i}" for i in range(900, 1000)])
    cal = calibration_ids([a, b], _word_tokenizer(), seq_len=40, n=5, model=_not_loaded)
    body = cal.ids[:, 1:] - 1                                           # word numbers (id 0 is <s>)
    assert cal.ids.shape == (5, 40) and bool((cal.ids[:, 0] == 0).all())
    assert bool((body[:3] < 100).all()) and bool(((body[3:] >= 300) & (body[3:] < 400)).all())
    assert cal.name == "a.txt + b.txt" and cal.digest == tensor_digest(cal.ids)
    again = calibration_ids([b, a], _word_tokenizer(), seq_len=40, n=5)
    assert bool((again.ids[:3, 1:] > 300).all()) and again.digest != cal.digest


def test_pydoc_is_the_built_in_corpus_training_part():
    cal = calibration_ids([PYDOC], byte_tokenizer(), seq_len=64, n=3)
    assert cal.ids.shape == (3, 64) and cal.name == "pydoc"
    # the windows Corpus.calibration draws from the training split (the held-out tenth never), seeded alike
    assert torch.equal(cal.ids, Corpus.from_bytes(default_corpus()).calibration(64, 3, seed=1234))


def test_self_generated_ids_repeat_by_seed_and_stay_in_the_vocabulary(tiny_model):
    calls = []

    def model():
        calls.append(1)
        return tiny_model

    one = calibration_ids([SELF], _word_tokenizer(bos=False), seq_len=12, n=4, seed=7, model=model)
    two = calibration_ids([SELF], _word_tokenizer(bos=False), seq_len=12, n=4, seed=7, model=model)
    other = calibration_ids([SELF], _word_tokenizer(bos=False), seq_len=12, n=4, seed=8, model=model)
    assert one.ids.shape == (4, 12) and one.ids.dtype == torch.long
    assert torch.equal(one.ids, two.ids) and one.digest == two.digest and not torch.equal(one.ids, other.ids)
    assert 0 <= int(one.ids.min()) and int(one.ids.max()) < tiny_model.cfg.vocab_size
    assert one.name == "self (seed 7)" and len(calls) == 3


def test_self_text_starts_with_bos_where_the_tokenizer_adds_one(tiny_model):
    ids = calibration_ids([SELF], _word_tokenizer(bos=True), seq_len=10, n=3, model=lambda: tiny_model).ids
    assert bool((ids[:, 0] == 0).all()) and ids.shape == (3, 10)


def test_self_and_a_file_share_one_set(tiny_model, tmp_path):
    a = _file(tmp_path, "a.txt", [f"w{i}" for i in range(100, 200)], ["w999"])
    cal = calibration_ids([SELF, a], _word_tokenizer(bos=False), seq_len=16, n=3, model=lambda: tiny_model)
    assert cal.ids.shape == (3, 16) and cal.name == "self (seed 1234) + a.txt"
    assert bool(((cal.ids[2] > 100) & (cal.ids[2] <= 200)).all())       # the file's one window, after self's two


@pytest.mark.parametrize("make,match", [
    (lambda d: d / "missing.txt", "no such file"),
    (lambda d: (d / "empty.txt").write_text("") or d / "empty.txt", "is empty"),
    (lambda d: d, "is a folder"),
    (lambda d: "slef", "slef: no such file .the named sources are 'self' and 'pydoc'"),
])
def test_a_bad_source_is_one_error_before_the_model_loads(tmp_path, tiny_model, make, match):
    source = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        check_sources([SELF, source])
    with pytest.raises(ValueError, match=match):
        calibration_ids([SELF, source], byte_tokenizer(), seq_len=8, n=2, model=_not_loaded)
    save_dense(tiny_model, tmp_path / "dense")
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(tmp_path / "dense"),
                          "--method", "gptq", "--calib", "self", str(source), "--out", str(tmp_path / "q")],
                         capture_output=True, text=True, cwd=ROOT)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: --calib ")
    assert re.search(match, lines[0]) and not (tmp_path / "q").exists()


@pytest.mark.parametrize("command", ["quantize", "quantformats"])
def test_calib_without_a_model_is_refused_not_ignored(tmp_path, command):
    """The tiny model calibrates on its own training text: a --calib given without --model would change nothing."""
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), command, "--calib", "pydoc",
                          *(["--method", "gptq", "--out", str(tmp_path / "q")] if command == "quantize" else [])],
                         capture_output=True, text=True, cwd=ROOT)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and lines == [lines[0]] and re.match(r"error: --calib calibrates a real model", lines[0])
    assert not (tmp_path / "q").exists()


def test_a_file_shorter_than_one_window_is_refused_before_the_model_loads(tmp_path):
    short = _file(tmp_path, "short.txt", ["w1", "w2"], ["w3"])         # 900 training words
    with pytest.raises(ValueError, match="short.txt: its training part .900 tokens.* shorter than one 1024-token"):
        calibration_ids([SELF, short], _word_tokenizer(bos=False), seq_len=1024, n=2, model=_not_loaded)
    with pytest.raises(ValueError, match="3 calibration sequences cannot give each of 4 sources a share"):
        calibration_ids([short] * 4, _word_tokenizer(), seq_len=8, n=3)


def test_the_default_is_named_in_help_and_recorded_in_the_checkpoint(tmp_path, tiny_model):
    """run.py's help names the default; `quantize --model` without --calib calibrates on it, and the checkpoint's
    index records its name and the digest of exactly these ids (computed here through the Python path)."""
    help_text = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--help"], capture_output=True,
                               text=True, cwd=ROOT).stdout
    assert f"Default: {' '.join(DEFAULT_CALIBRATION)}" in " ".join(help_text.split())
    save_dense(tiny_model, tmp_path / "dense")
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(tmp_path / "dense"),
                          "--method", "gptq", "--group-size", "32", "--calib-samples", "2", "--calib-len", "16",
                          "--out", str(tmp_path / "q")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    meta = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["metadata"]
    from engine.checkpoints.models import load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    expected = calibration_ids(DEFAULT_CALIBRATION, load_tokenizer(tmp_path / "dense"), seq_len=16, n=2,
                               model=lambda: load_model(tmp_path / "dense", torch.float32, dense=True))
    assert meta["engine.calibration"] == expected.name == " + ".join(DEFAULT_CALIBRATION)
    assert meta["engine.calibration_sha256"] == expected.digest
    from engine.checkpoints.gguf_file import GGUFFile
    from engine.checkpoints.serving import export_gguf
    export_gguf(tmp_path / "q", tmp_path / "q.gguf")                 # what --format gguf writes from that folder
    with GGUFFile(tmp_path / "q.gguf") as f:
        assert (f.metadata["engine.calibration"], f.metadata["engine.calibration_sha256"]) == \
            (expected.name, expected.digest)


def test_quantformats_on_a_model_calibrates_on_calib(tmp_path, tiny_model):
    """--calib reaches the real-model table (it used to calibrate on --text whatever --calib said)."""
    save_dense(tiny_model, tmp_path / "dense")
    text = tmp_path / "notes.txt"
    text.write_bytes(bytes(range(32, 127)) * 40)
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantformats", "--model", str(tmp_path / "dense"),
                          "--rows", "AWQ int4", "--ctx", "32", "--chunks", "2", "--calib", str(text),
                          "--calib-samples", "2", "--calib-len", "32"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "calibration: notes.txt, (2, 32) ids" in out.stderr


@pytest.mark.parametrize("records", [{"calibration": "pydoc"}, {"engine.calibration": 3}])
def test_a_gguf_refuses_records_that_are_not_engine_strings_before_writing(tmp_path, tiny_model, records):
    from engine.checkpoints.gguf_writer import write_gguf
    with pytest.raises(ValueError, match="records must map 'engine.\\*' names to strings"):
        write_gguf(tiny_model, tmp_path / "m.gguf", records=records)
    assert not (tmp_path / "m.gguf").exists()


def test_a_huge_file_is_read_only_as_far_as_the_calibration_needs(tmp_path):
    """2 sequences of 8 tokens read calibration_bytes(16) = 2 MiB: a file whose text changes after that contributes
    nothing from beyond it (red when the whole file is read: words from the tail would be sampled too)."""
    from engine.data import calibration_bytes
    limit = calibration_bytes(16)
    head = ("w1 " * (limit // 3 + 1)).encode()
    path = tmp_path / "huge.txt"
    path.write_bytes(head + b"w2 " * (limit // 3))
    ids = calibration_ids([str(path)], _word_tokenizer(bos=False), seq_len=8, n=2).ids
    assert set(ids.flatten().tolist()) == {2}                    # w1 only
    assert calibration_bytes(10 ** 9) == 64 << 20


def test_a_file_the_tokenizer_panics_on_is_one_error_naming_both(tmp_path):
    """The Rust tokenizer panics (a pre-tokenizer regex past Oniguruma's retry limit): one ValueError."""
    from fuzz_inputs import AAA, text_tokenizer
    from engine.checkpoints.tokenizer import load_tokenizer
    (tmp_path / "tok").mkdir()
    text_tokenizer(tmp_path / "tok", ("split", "(a+)+$"))
    (tmp_path / "a.txt").write_text(AAA)
    with pytest.raises(ValueError, match=r"^--calib .*a\.txt: .*tokenizer\.json: the tokenizers library failed on it "
                                         r"\(Onig: Regex search error"):
        calibration_ids([str(tmp_path / "a.txt")], load_tokenizer(tmp_path / "tok"), seq_len=8, n=2)


def test_the_memory_check_counts_attentions_scores(tiny_cfg, monkeypatch):
    """red before: only the hidden states were counted: 4 x 4096 tokens of the tiny model, 16 MiB counted while
    attention's scores took 3.6 GB (now 192 MiB: blocks of 256 query rows)."""
    from engine import cli
    from engine import layers as ground
    monkeypatch.setattr(ground, "available_memory", lambda: 100 << 20)
    with pytest.raises(ValueError, match="needs about 0.2 GiB for the hidden states .* and attention's scores"):
        cli.check_calibration_size(SimpleNamespace(calib_samples=4, calib_len=4096), tiny_cfg)


@pytest.mark.parametrize("args,match", [(("--calib-samples", "1000000000"), "needs about .* GiB for the hidden"),
                                        (("--calib-len", "100000"), "is longer than the model's context")])
def test_calibration_sizes_beyond_memory_or_context_are_refused_first(tmp_path, tiny_model, args, match):
    save_dense(tiny_model, tmp_path / "dense")
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(tmp_path / "dense"),
                          "--method", "gptq", *args, "--out", str(tmp_path / "q")], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 1 and re.search(match, out.stderr.strip().splitlines()[-1]), out.stderr
    assert not (tmp_path / "q").exists() and "calibration:" not in out.stderr


def test_a_file_cut_inside_a_character_calibrates_on_the_characters_before(tmp_path):
    """red before: the first calibration_bytes of a UTF-8 file ended inside an "é" (2 bytes) and the whole text was
    refused as not UTF-8."""
    from fuzz_inputs import text_tokenizer
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.data import calibration_bytes
    (tmp_path / "tok").mkdir()
    text_tokenizer(tmp_path / "tok", "prefix-space")                 # byte-level, read as UTF-8 text
    (tmp_path / "e.txt").write_text("a" + "é" * (calibration_bytes(16) // 2 + 8))   # byte 2 MiB starts an "é"
    ids = calibration_ids([str(tmp_path / "e.txt")], load_tokenizer(tmp_path / "tok"), seq_len=8, n=2).ids
    assert ids.shape == (2, 8) and set(ids.flatten().tolist()) <= set("é".encode())
