"""What a user gives run.py is read only as far as the command needs it: a prompt file and a tokenizer that
multiplies text cost the model's context, not the file's size; eval's --text its first MAX_TEXT_TOKENS tokens; --ctx
stays within the model's context; a tokenizer that panics in Rust is one `error:` line naming its file."""
import json
from types import SimpleNamespace

import pytest

from engine import cli, data
from engine.checkpoints import tokenizer as tokenizers
from engine.loaders import save_dense
from test_cli import run

from fuzz_inputs import AAA, text_tokenizer  # (the fuzzer's hostile tokenizers: tests/fuzz/)


@pytest.fixture
def dense(tiny_model, tmp_path):
    """The tiny model (a context of 4096 tokens) as a dense folder with the byte tokenizer."""
    save_dense(tiny_model, tmp_path / "dense", side_files=lambda folder: tokenizers.export_tokenizer(None, folder))
    return tmp_path / "dense"


def _generate(model, prompt=None, prompt_file=None):
    args = SimpleNamespace(prompt=prompt, prompt_file=prompt_file and str(prompt_file), text=None, model=str(model),
                           max_new_tokens=1, steps=1, seed=0, kv_cache=None, impl="torch", temperature=0.0,
                           prefill_chunk=None)
    cli.cmd_generate(args)


def _counting_tokens(monkeypatch):
    """Every token the tokenizers load_tokenizer gives from now on make: a list of counts, one per encode call."""
    made, load = [], tokenizers.load_tokenizer

    def counted(path=None):
        tok = load(path)
        encode = tok.encode
        tok.encode = lambda *args, **kwargs: made.append(len(result := encode(*args, **kwargs))) or result
        return tok
    monkeypatch.setattr(tokenizers, "load_tokenizer", counted)
    return made


@pytest.mark.parametrize("how", ["bytes", "prefix-space"])
def test_a_prompt_file_is_read_only_as_far_as_the_context_needs(dense, tmp_path, how):
    """red before: the whole file was read, then tokenized, then found too long (200 MB: 2.6 GB); here its tail,
    past twice the context, is not UTF-8 and is never read (prefix-space: a tokenizer read as UTF-8 text)."""
    text_tokenizer(dense, how)
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"The quick brown fox. " * 2000 + b"\xff")
    with pytest.raises(ValueError, match=r"prompt\.txt is more than 8192 tokens, and the model's context is 4096: "
                                         "shorten it"):
        _generate(dense, prompt_file=prompt)


def test_a_prompt_within_the_context_is_the_whole_texts_tokenization(tmp_path):
    """Counting tokenizes pieces that cut words ([UNK] halves here), but the ids are the whole text's."""
    from test_data import _word_tokenizer
    tok = _word_tokenizer()
    text = " ".join(f"w{i % 1000}" for i in range(3000))
    (tmp_path / "prompt.txt").write_text(text)
    ids = cli.prompt_ids(SimpleNamespace(prompt=None, prompt_file=str(tmp_path / "prompt.txt")), tok, 4096)
    assert ids[0].tolist() == tok.encode(text, add_special_tokens=False).ids and ids.shape == (1, 3000)


def test_a_normalizer_that_multiplies_text_costs_one_small_piece(dense, monkeypatch):
    """red before: 3,000 "a"s, each made 1,000 by the tokenizer's normalizer, were tokenized whole (3 M tokens; at
    10,000 each: 30 M tokens, 5 GB) before the prompt's length was checked; now the first piece of 16 bytes is."""
    text_tokenizer(dense, ("expand", 1000))
    made = _counting_tokens(monkeypatch)
    with pytest.raises(ValueError, match="--prompt is more than 8192 tokens, and the model's context is 4096"):
        _generate(dense, prompt="a" * 3000)
    assert made == [16_000, 16_000]                       # the first piece counted, then tokenized (as a whole)


def test_a_tokenizer_that_panics_is_one_error_line_naming_it(dense, tmp_path):
    """red before: pyo3's PanicException (a BaseException) escaped as a traceback, after Rust's own panic message
    and, under RUST_BACKTRACE, a backtrace (a pre-tokenizer regex past Oniguruma's retry limit)."""
    text_tokenizer(dense, ("split", "(a+)+$"))
    (tmp_path / "prompt.txt").write_text(AAA)
    out = run("generate", "--model", str(dense), "--prompt-file", str(tmp_path / "prompt.txt"))
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: --prompt-file {tmp_path / 'prompt.txt'}: {dense / 'tokenizer.json'}: the tokenizers library failed "
        "on it (Onig: Regex search error: retry-limit-in-match over)"], out.stderr


def test_eval_reads_its_text_only_as_far_as_max_text_tokens(dense, tmp_path, monkeypatch, capsys):
    """red before: eval --text read the whole file (200 MB: 2.4 GB); here the tail past MAX_TEXT_TOKENS is not
    UTF-8 and is never read. Calibration on the same file reads no further (its windows stay out of the last
    tenth eval holds out)."""
    text_tokenizer(dense, "prefix-space")
    monkeypatch.setattr(data, "MAX_TEXT_TOKENS", 20_000, raising=False)
    text = tmp_path / "text.txt"
    text.write_bytes(b"The quick brown fox jumps over the lazy dog. " * 2000 + b"\xff")
    cli.eval_real(SimpleNamespace(model=str(dense), quantized=str(dense), kv_cache=None, text=str(text), ctx=64,
                                  chunks=2, impl="torch", prefill_chunk=None))
    assert json.loads(capsys.readouterr().out.splitlines()[0])["chunks"] == 2
    tok = tokenizers.load_tokenizer(dense)
    evaluated, calibrated = data.text_corpus(text, tok), data.read_corpus(text, tok, 10 ** 9)
    assert 20_000 < len(evaluated.train) + len(evaluated.held_out) < 20_000 + tokenizers.LAST_PIECE
    assert calibrated.digest == evaluated.digest


def test_eval_refuses_a_ctx_beyond_the_models_context_before_loading(dense):
    """red before: --ctx 4097 on a model of 4096 positions was evaluated silently, --ctx 16384 too (13.4 GB)."""
    for argv in (["eval", "--model", str(dense), "--quantized", str(dense), "--ctx", "4097", "--chunks", "1"],
                 ["eval", "--model", str(dense), "--quantized", str(dense), "--ctx", "16384"],
                 ["quantformats", "--model", str(dense), "--rows", "RTN int4", "--ctx", "4097"]):
        out = run(*argv)
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == \
            f"error: --ctx {argv[argv.index('--ctx') + 1]} is longer than the model's context (4096 tokens)", out.stderr
        assert "loading" not in out.stderr
