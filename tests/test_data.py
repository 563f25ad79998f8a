"""The corpus: the held-out split is never trained or calibrated on, for bytes and for a real tokenizer; evaluation
chunks are llama.cpp's; bad --text and window arguments are clear errors."""
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from engine.checkpoints.tokenizer import byte_tokenizer
from engine.data import Corpus, default_corpus, load_corpus


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


# ---- text through a real tokenizer ------------------------------------------------------------------------------

def _word_tokenizer():
    """Words 'w0'..'w999' are ids 1..1000, each sequence starts with <s> (id 0), as Llama 3's tokenizer does."""
    vocab = {"<s>": 0, **{f"w{i}": i + 1 for i in range(1000)}, "[UNK]": 1001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _word_corpus(n_train=900, n_held=100):
    """Training words are ids 1..500, held-out words 501..1000: a window that mixes them is visible."""
    words = [f"w{i % 500}" for i in range(n_train)] + [f"w{500 + i % 500}" for i in range(n_held)]
    return Corpus.from_text(" ".join(words), _word_tokenizer())


def test_the_byte_corpus_is_the_byte_tokenizer_corpus():
    data = default_corpus()[:5000]
    by_bytes, by_tokenizer = Corpus.from_bytes(data), Corpus.from_text(data, byte_tokenizer())
    assert torch.equal(by_bytes.train, by_tokenizer.train) and torch.equal(by_bytes.held_out, by_tokenizer.held_out)
    assert by_bytes.digest == by_tokenizer.digest and by_bytes.bos is by_tokenizer.bos is None


def test_token_corpus_holds_out_the_last_tenth_of_the_ids():
    corpus = _word_corpus()
    assert corpus.bos == 0 and len(corpus.train) == 900 and len(corpus.held_out) == 100
    assert int(corpus.train.max()) <= 500 < int(corpus.held_out.min())
    assert Corpus.from_text("w1 w2", _word_tokenizer()).digest != Corpus.from_text("w1 w2").digest


def test_eval_chunks_are_consecutive_held_out_windows_starting_with_bos():
    corpus = _word_corpus(n_held=100)
    chunks = corpus.eval_chunks(ctx=16)
    assert chunks.shape == (6, 16) and bool((chunks[:, 0] == 0).all())
    assert torch.equal(chunks[:, 1:], corpus.held_out[:96].reshape(6, 16)[:, 1:])
    assert corpus.eval_chunks(ctx=16, chunks=2).shape == (2, 16)


def test_calibration_reads_the_training_split_with_bos_first():
    windows = _word_corpus().calibration(seq_len=64, n=8)
    assert windows.shape == (8, 64) and bool((windows[:, 0] == 0).all()) and int(windows.max()) <= 500


def test_calibration_on_short_text_warns_and_still_draws_from_training_text():
    corpus = _word_corpus(n_train=360, n_held=40)
    with pytest.warns(UserWarning, match="8 windows of 64 tokens overlap in a 360-token training split"):
        assert corpus.calibration(seq_len=64, n=8).shape == (8, 64)
    with pytest.warns(UserWarning, match="fewer than one 2048-token window; using it once as a 359-token window"):
        windows = corpus.calibration(seq_len=2048, n=128)
    assert windows.shape == (1, 359) and int(windows.max()) <= 500


@pytest.mark.parametrize("call,match", [
    (lambda c: c.eval_chunks(ctx=2), "ctx must be at least 3"),
    (lambda c: c.eval_chunks(ctx=512), "shorter than one 512-token chunk"),
    (lambda c: c.eval_chunks(ctx=16, chunks=0), "chunks must be a positive integer"),
    (lambda c: c.calibration(seq_len=0), "seq_len must be a positive integer"),
    (lambda c: Corpus.from_text("w1", held_out=0), "held_out must be in"),
])
def test_window_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(_word_corpus())
