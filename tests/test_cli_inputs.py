"""What a user gives run.py: a tokenizer that panics in Rust is one `error:` line naming its file."""
import sys
from pathlib import Path

import pytest

from engine.checkpoints import tokenizer as tokenizers
from engine.loaders import save_dense
from test_cli import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fuzz_inputs import AAA, text_tokenizer  # noqa: E402  (the fuzzer's hostile tokenizers)


@pytest.fixture
def dense(tiny_model, tmp_path):
    """The tiny model (a context of 4096 tokens) as a dense folder with the byte tokenizer."""
    save_dense(tiny_model, tmp_path / "dense", side_files=lambda folder: tokenizers.export_tokenizer(None, folder))
    return tmp_path / "dense"


def test_a_tokenizer_that_panics_is_one_error_line_naming_it(dense, tmp_path):
    """red before: pyo3's PanicException (a BaseException) escaped as a traceback, after Rust's own panic message
    and, under RUST_BACKTRACE, a backtrace (a pre-tokenizer regex past Oniguruma's retry limit)."""
    text_tokenizer(dense, ("split", "(a+)+$"))
    (tmp_path / "prompt.txt").write_text(AAA)
    out = run("generate", "--model", str(dense), "--prompt-file", str(tmp_path / "prompt.txt"))
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"error: {dense / 'tokenizer.json'}: the tokenizers library failed on it (Onig: Regex search error: "
        "retry-limit-in-match over)"], out.stderr
