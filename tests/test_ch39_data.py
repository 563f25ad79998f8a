"""The byte corpus: the held-out split is never trained or calibrated on; bad --text is a clear error."""
import pytest
import torch

from engine.data import Corpus, load_corpus


def _two_alphabet_corpus():
    """Training bytes all below 128, held-out bytes all 128 and above: any window that mixes them is visible."""
    train = bytes(i % 128 for i in range(9000))
    held_out = bytes(128 + i % 128 for i in range(1000))
    return Corpus.from_bytes(train + held_out)


def test_held_out_split_is_the_last_tenth():
    corpus = _two_alphabet_corpus()
    assert len(corpus.train) == 9000 and bool((corpus.train < 128).all())
    assert len(corpus.held_out) == 1000 and bool((corpus.held_out >= 128).all())


def test_training_and_calibration_never_read_held_out_text():
    corpus = _two_alphabet_corpus()
    x, y = corpus.batch(64, 127, torch.Generator().manual_seed(0))      # windows reach the split's very end
    assert int(x.max()) < 128 and int(y.max()) < 128
    assert int(corpus.calibration(seq_len=127, n=64).max()) < 128


def test_evaluation_reads_only_held_out_text():
    windows = _two_alphabet_corpus().eval_windows(seq_len=64)
    assert windows.shape == (15, 65) and bool((windows >= 128).all())


def test_text_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too short"):
        load_corpus(tmp_path / "short.txt")
