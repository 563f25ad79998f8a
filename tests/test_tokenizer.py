"""Tokenizers: the byte model's tokenizer.json maps text to exactly its bytes (as the byte corpus does); folders, GGUF
files and checkpoints carry their tokenizer; transformers reads what the engine writes."""
import json
import os

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from engine.safetensors_io import write_json
from engine.checkpoints.tokenizer import (BYTE_CHARS, bos_id, byte_tokenizer, copy_tokenizer_files, encode,
                                           export_tokenizer, is_byte_tokenizer, load_tokenizer, token_bytes,
                                           write_tokenizer_files)
from engine.data import Corpus
from engine.qwen3 import Qwen3Config
from test_gguf import ARR, BOOL, I32, STR, gguf_bytes, write

TEXT = "".join(map(chr, range(256))) + "Plain ASCII, Ünïcödé, \u6771\u4eac, \t tabs\r\n and \U0001F600 \x00\x7f\u0080\u00ad\u00ff\u0100 " * 3


def test_byte_tokenizer_gives_the_byte_corpus_ids():
    tok = byte_tokenizer()
    assert tok.get_vocab_size() == 256 and set(BYTE_CHARS) == set(pre_tokenizers.ByteLevel.alphabet())
    assert tok.encode(TEXT).ids == list(TEXT.encode("utf-8")) == Corpus.from_text(TEXT).train.tolist() + \
        Corpus.from_text(TEXT).held_out.tolist()
    assert tok.decode(tok.encode(TEXT).ids) == TEXT


def test_every_byte_round_trips_even_invalid_utf8():
    data = bytes(range(256)) + b"\xff\xfe\xc3"                    # lone continuation and truncated sequences
    ids = encode(byte_tokenizer(), data)
    assert ids.tolist() == list(data)
    assert token_bytes(byte_tokenizer(), ids) == data


def test_byte_tokenizer_is_recognized_after_a_save_and_load(tmp_path):
    write_tokenizer_files(byte_tokenizer(), tmp_path)
    assert is_byte_tokenizer(load_tokenizer(tmp_path)) and not is_byte_tokenizer(_bos_tokenizer())
    spaced = byte_tokenizer()
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)
    assert not is_byte_tokenizer(spaced) and encode(spaced, "a").tolist() == [BYTE_CHARS.index("\u0120"), 97]


def _bos_tokenizer():
    """Byte vocabulary + '<s>' (256), added before every sequence like Llama 3's <|begin_of_text|>."""
    tok = Tokenizer(models.BPE({c: b for b, c in enumerate(BYTE_CHARS)} | {"<s>": 256}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return tok


def test_bos_is_found_from_the_post_processor():
    assert bos_id(_bos_tokenizer()) == 256
    assert bos_id(byte_tokenizer()) is None and bos_id(None) is None


def test_a_tokenizer_other_than_bytes_reads_only_utf8():
    assert encode(_bos_tokenizer(), "ab").tolist() == [97, 98]                 # no special tokens added
    with pytest.raises(ValueError, match="not UTF-8 \\(at byte 1\\)"):
        encode(_bos_tokenizer(), b"a\xffb")


def test_load_tokenizer_from_a_folder_a_byte_model_folder_and_a_gguf_file(tmp_path):
    (tmp_path / "real").mkdir()
    _bos_tokenizer().save(str(tmp_path / "real" / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "real").encode("a").ids == [256, 97]
    (tmp_path / "tiny").mkdir()
    write_json(tmp_path / "tiny" / "config.json", Qwen3Config().to_hf())        # written before tokenizer files
    assert is_byte_tokenizer(load_tokenizer(tmp_path / "tiny"))
    assert is_byte_tokenizer(load_tokenizer(None))
    tok = load_tokenizer(write(tmp_path, gguf_bytes(_byte_gguf_metadata()), "bytes.gguf"))
    assert tok.encode(TEXT).ids == list(TEXT.encode("utf-8"))


def _byte_gguf_metadata():
    """The byte vocabulary as llama.cpp's `gpt2` type spells it (DESIGN 7), without merges."""
    return [("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "qwen2"),
            ("tokenizer.ggml.tokens", ARR, (STR, list(BYTE_CHARS))), ("tokenizer.ggml.token_type", ARR,
                                                                       (I32, [1] * 256)),
            ("tokenizer.ggml.merges", ARR, (STR, [])), ("tokenizer.ggml.add_bos_token", BOOL, False)]


@pytest.mark.parametrize("bad,match", [("missing", "no such tokenizer folder"), ("empty", "no tokenizer.json"),
                                       ("broken", "not a valid tokenizer.json")])
def test_load_tokenizer_errors_are_named(tmp_path, bad, match):
    folder = tmp_path / bad
    if bad != "missing":
        folder.mkdir()
    if bad == "broken":
        (folder / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match=match):
        load_tokenizer(folder)


def test_copy_takes_the_tokenizer_files_present_and_nothing_else(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt", "generation_config.json",
                 "chat_template.jinja", "model.safetensors", "README.md"):
        (src / name).write_text(name)
    assert sorted(copy_tokenizer_files(src, out)) == sorted(os.listdir(out)) == [
        "chat_template.jinja", "generation_config.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "merges.txt").read_text() == "merges.txt"


def test_copy_refuses_a_link_out_of_the_folder(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (tmp_path / "secret").write_text("not a tokenizer")
    (src / "vocab.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        copy_tokenizer_files(src, out)
    assert not (out / "vocab.json").exists()


def test_export_writes_the_byte_tokenizer_and_a_gguf_vocabulary(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert export_tokenizer(None, tmp_path / "a") == ["tokenizer.json", "tokenizer_config.json"]
    assert is_byte_tokenizer(load_tokenizer(tmp_path / "a"))
    meta = _byte_gguf_metadata() + [("tokenizer.chat_template", STR, "{{ messages }}")]
    export_tokenizer(write(tmp_path, gguf_bytes(meta), "bytes.gguf"), tmp_path / "b")
    config = json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{{ messages }}" and config["add_bos_token"] is False
    assert load_tokenizer(tmp_path / "b").encode(TEXT).ids == list(TEXT.encode("utf-8"))


@pytest.mark.interop
def test_transformers_reads_the_written_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(_bos_tokenizer(), tmp_path, {"bos_token": "<s>", "add_bos_token": True},
                          chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(TEXT)["input_ids"] == [256] + list(TEXT.encode("utf-8"))
    assert hf.bos_token_id == 256
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    write_tokenizer_files(byte_tokenizer(), tmp_path)
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    assert bytes_to_unicode() == dict(enumerate(BYTE_CHARS))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(TEXT)["input_ids"] == list(TEXT.encode("utf-8")) and hf.decode(list(b"caf\xc3\xa9")) == "café"


@pytest.mark.parametrize("token_id", [256, 1_000_000])
def test_an_added_token_beyond_the_vocabulary_is_refused_when_the_tokenizer_loads(tmp_path, tiny_model, token_id):
    """red before: the tokenizer loaded, and generate's first forward pass died with an IndexError"""
    from engine.loaders import save_dense
    from fuzz_checkpoints import tokenizer_with_added_token
    save_dense(tiny_model, tmp_path / "ck")
    tokenizer_with_added_token(tmp_path / "ck", token_id)
    with pytest.raises(ValueError, match=f"'<\\|fuzz\\|>' has id {token_id}, beyond the model's vocabulary of 256"):
        load_tokenizer(tmp_path / "ck")


def test_an_added_token_on_an_id_another_token_holds_is_refused_where_the_library_moves_it(tmp_path, tiny_model):
    """red before: id 255 is byte 255's, the tokenizers library silently gives "<|fuzz|>" id 256 instead, and the
    check read the file's 255 and let the tokenizer through"""
    from engine.loaders import save_dense
    from fuzz_checkpoints import tokenizer_with_added_token
    save_dense(tiny_model, tmp_path / "ck")
    tokenizer_with_added_token(tmp_path / "ck", 255)
    with pytest.raises(ValueError, match="'<\\|fuzz\\|>' has id 256 \\(tokenizer.json gives it id 255, which another "
                                         "token holds"):
        load_tokenizer(tmp_path / "ck")


def _fuzzed(folder, how):
    """A folder with only a tokenizer.json, the byte tokenizer changed as tests/fuzz/fuzz_inputs.py changes it."""
    from fuzz_inputs import break_tokenizer, text_tokenizer
    folder.mkdir()
    (break_tokenizer if isinstance(how, str) else text_tokenizer)(folder, how)
    return folder


@pytest.mark.parametrize("how,where", [("charsmap", "load"), ("template", "bos_id"), (("split", "(a+)+$"), "encode")])
def test_a_panic_of_the_tokenizers_library_is_a_value_error_naming_the_file(tmp_path, capfd, how, where):
    """red before: pyo3's PanicException, a BaseException, went past every `except Exception`, after Rust had
    printed the panic (a backtrace under RUST_BACKTRACE) on stderr. A charsmap it cannot parse panics on loading,
    a template naming a token it lacks on encoding with special tokens, a regex past Oniguruma's retry limit on
    splitting."""
    folder = _fuzzed(tmp_path / "tok", how)
    with pytest.raises(ValueError, match=f"^{folder / 'tokenizer.json'}: the tokenizers library failed on it"):
        tok = load_tokenizer(folder)                          # "load": fails here
        bos_id(tok) if where == "bos_id" else encode(tok, "a" * 3000 + "!")
    assert "panicked" not in capfd.readouterr().err


def test_a_tokenizer_that_multiplies_text_is_refused_after_one_small_piece(tmp_path):
    """red before: each "a" of a corpus became 1,000 tokens, all of them made (a 10,000-fold normalizer on the
    built-in corpus: hundreds of millions); now the first piece's 16 bytes make 16,000, more than 16 a byte."""
    tok = load_tokenizer(_fuzzed(tmp_path / "tok", ("expand", 1000)))
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizer makes 16000 tokens of 16 bytes of text, more "
                                         "than 16 a byte"):
        Corpus.from_text("a" * 3000, tok)
