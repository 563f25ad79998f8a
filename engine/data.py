"""Text -> token ids: the byte corpus and real tokenizers, split into training and held-out parts.

The tiny model reads bytes (vocabulary 256, id = byte value). Its tokenizer.json spells byte b as GPT-2's byte-level
character BYTE_CHARS[b] (printable bytes stand for themselves, the 68 others take chr(256 + k) in byte order), with
no merges and the ByteLevel pre-tokenizer and decoder: every client that reads byte-level BPE (transformers, vLLM,
llama.cpp through its `gpt2` vocabulary) maps UTF-8 text to exactly the bytes' values. Real models bring their own
tokenizer.json (or a GGUF file's vocabulary); HF's Rust `tokenizers` library runs both.

The built-in default text needs no download: the English reference text that ships with Python itself
(`pydoc_data.topics`, the language reference's topic pages, ~460 KB). `--text PATH` reads any file instead (the book
uses Edith Wharton's "The Verdict", ~20 KB). The last `held_out` fraction of the ids is never trained or calibrated
on; it is where the damage of quantization is measured:

    ids = tokenize(text)        train = ids[:cut]        held_out = ids[cut:]        cut = int(len(ids) * 0.9)
"""
import hashlib
import itertools
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .formats.gguf import GGUFFile
from .formats.gguf_tokenizer import gguf_tokenizer
from .safetensors_io import MAX_JSON_BYTES, checked_file, read_json, write_json


def default_corpus() -> bytes:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_corpus(path=None) -> bytes:
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--text {path}: no such file")
    data = path.read_bytes()
    if len(data) < 2048:
        raise ValueError(f"--text {path}: {len(data)} bytes is too short to train on (need at least 2048)")
    return data


# ---- tokenizers -------------------------------------------------------------------------------------------------

def _byte_chars():
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    moved = itertools.count(256)
    return tuple(chr(b) if b in printable else chr(next(moved)) for b in range(256))


BYTE_CHARS = _byte_chars()                        # BYTE_CHARS[b]: byte b as one character (GPT-2's bytes_to_unicode)
BYTE_VOCAB = {c: b for b, c in enumerate(BYTE_CHARS)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


def byte_tokenizer():
    """The tiny model's tokenizer: 256 tokens, id = byte value (UTF-8 text -> its bytes)."""
    tok = Tokenizer(models.BPE(dict(BYTE_VOCAB), []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def is_byte_tokenizer(tok):
    """True when tok maps any text to its UTF-8 bytes' values (the byte tokenizer, whatever wrote its file)."""
    if tok.get_vocab_size(with_added_tokens=True) != 256:
        return False
    spec = json.loads(tok.to_str())
    pre = spec["pre_tokenizer"] or {}
    return (spec["model"].get("type") == "BPE" and spec["model"]["vocab"] == BYTE_VOCAB
            and not spec["model"]["merges"] and not spec["added_tokens"] and spec["normalizer"] is None
            and pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space"))


def token_bytes(tok, ids):
    """The exact bytes that ids [n] spell in a byte-level vocabulary (the byte tokenizer, GPT-2, Qwen, SmolLM2), even
    where they are not valid UTF-8 (tok.decode would put U+FFFD there)."""
    out = bytearray()
    for i in ids:
        piece = tok.id_to_token(int(i))
        if piece is None or any(c not in BYTE_VOCAB for c in piece):
            raise ValueError(f"token {int(i)} ({piece!r}) is not spelled in the byte-level alphabet")
        out += bytes(BYTE_VOCAB[c] for c in piece)
    return bytes(out)


def encode(tok, data):
    """bytes (or str) -> ids, long [n], without special tokens. The byte tokenizer (or None) takes any bytes, valid
    UTF-8 or not; every other tokenizer reads UTF-8 text."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if tok is None or is_byte_tokenizer(tok):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the text is not UTF-8 (at byte {e.start}); only the byte tokenizer reads any bytes") from None
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def bos_id(tok):
    """The id tok's post-processor puts before every sequence (Llama 3's <|begin_of_text|>), or None (Qwen, bytes)."""
    if tok is None:
        return None
    enc = tok.encode("a")
    return enc.ids[0] if enc.special_tokens_mask[0] else None


def _from_json_file(path, what):
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                               # the Rust side names what is wrong
        raise ValueError(f"{what} is not a valid tokenizer.json: {e}") from None


def _is_byte_model(folder):
    return (Path(folder) / "config.json").exists() and read_json(folder, "config.json").get("vocab_size") == 256


def load_tokenizer(path=None):
    """A tokenizers.Tokenizer: None -> the byte tokenizer; a folder -> its tokenizer.json (a folder of the byte model
    written before tokenizer files were: the byte tokenizer); a file -> a GGUF file's vocabulary."""
    if path is None:
        return byte_tokenizer()
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").exists() or (path / "tokenizer.json").is_symlink():
            return _from_json_file(checked_file(path, "tokenizer.json", MAX_JSON_BYTES), path / "tokenizer.json")
        if _is_byte_model(path):
            return byte_tokenizer()
        raise ValueError(f"no tokenizer.json in {path} (a SentencePiece-only tokenizer.model is not read)")
    if path.is_file():
        with GGUFFile(path) as f:
            return gguf_tokenizer(f)[0]
    raise ValueError(f"{path}: no such tokenizer folder or GGUF file")


def write_tokenizer_files(tok, folder, config=None, chat_template=None):
    """Write tokenizer.json, tokenizer_config.json (config: e.g. gguf_tokenizer's, with bos/eos/unk/pad_token and
    add_bos_token; chat_template overrides its template) and, when any special token is named,
    special_tokens_map.json into folder (a checkpoint being written: atomic_directory's staging folder). Returns the
    names written."""
    folder = Path(folder)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **(config or {})}
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_json(folder / "tokenizer.json", json.loads(tok.to_str()))
    write_json(folder / "tokenizer_config.json", config)
    special = {role: config[role] for role in SPECIAL_ROLES if config.get(role) is not None}
    if special:
        write_json(folder / "special_tokens_map.json", special)
    return ["tokenizer.json", "tokenizer_config.json"] + ["special_tokens_map.json"] * bool(special)


def copy_tokenizer_files(source_folder, out_folder):
    """Copy the TOKENIZER_FILES that source_folder holds (regular files only; a link may not lead out of the folder,
    or out of a Hugging Face cache's blobs) into out_folder. Returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(source_folder) / name
        if path.exists() or path.is_symlink():
            shutil.copyfile(checked_file(source_folder, name, MAX_JSON_BYTES), Path(out_folder) / name)
            copied.append(name)
    return copied


def export_tokenizer(source, out_folder):
    """Give a checkpoint written into out_folder its source's tokenizer: None (the tiny byte model) -> the byte
    tokenizer's files; a model folder -> its tokenizer files copied (or the byte tokenizer's for a byte model
    folder without any); a GGUF file -> tokenizer.json and tokenizer_config.json (with its chat template) rebuilt
    from its metadata (nothing if it has none). Returns the names written."""
    if source is None:
        return write_tokenizer_files(byte_tokenizer(), out_folder)
    source = Path(source)
    if source.is_dir():
        copied = copy_tokenizer_files(source, out_folder)
        if "tokenizer.json" not in copied and _is_byte_model(source):
            copied += write_tokenizer_files(byte_tokenizer(), out_folder)
        return copied
    with GGUFFile(source) as f:
        if "tokenizer.ggml.tokens" not in f.metadata:         # a GGUF file may hold weights only
            return []
        tok, config = gguf_tokenizer(f)
    return write_tokenizer_files(tok, out_folder, config)


# ---- the corpus -------------------------------------------------------------------------------------------------

def _positive_int(name, value):
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class Corpus:
    train: torch.Tensor          # long ids [n_train]
    held_out: torch.Tensor       # [n_held]
    digest: str                  # sha256 of the raw bytes (and of a real tokenizer): part of the training cache key
    bos: int | None = None       # put in the first position of every window, where the tokenizer adds a BOS

    @classmethod
    def from_text(cls, data, tokenizer=None, held_out=0.1):
        """Text (bytes or str) tokenized by `tokenizer` (None: bytes); the last `held_out` fraction of the ids (in
        (0, 1]; 1 for a file kept only for evaluation) is held out."""
        if not 0 < held_out <= 1:
            raise ValueError(f"held_out must be in (0, 1], got {held_out!r}")
        data = data.encode("utf-8") if isinstance(data, str) else data
        ids = encode(tokenizer, data)
        digest = hashlib.sha256(data)
        if tokenizer is not None and not is_byte_tokenizer(tokenizer):
            digest.update(tokenizer.to_str().encode())
        cut = int(len(ids) * (1 - held_out))
        return cls(ids[:cut], ids[cut:], digest.hexdigest(), bos_id(tokenizer))

    @classmethod
    def from_bytes(cls, data: bytes, held_out=0.1):
        return cls.from_text(data, None, held_out)

    def batch(self, batch_size, seq_len, generator):
        """Random training windows: (inputs, targets) [batch, seq_len], targets shifted by one token."""
        if len(self.train) < seq_len + 1:
            raise ValueError(f"training text ({len(self.train)} tokens) is shorter than one {seq_len + 1}-token window")
        starts = torch.randint(0, len(self.train) - seq_len, (batch_size,), generator=generator)
        windows = self.train[starts[:, None] + torch.arange(seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]

    def eval_windows(self, seq_len=128, max_windows=16):
        """Consecutive non-overlapping held-out windows [n, seq_len + 1] (inputs and next-token targets)."""
        n = min(max_windows, (len(self.held_out) - 1) // seq_len)
        if n < 1:
            raise ValueError(f"held-out text ({len(self.held_out)} tokens) is shorter than one {seq_len}-token window")
        return self.held_out[:n * seq_len + 1].unfold(0, seq_len + 1, seq_len)

    def eval_chunks(self, ctx=512, chunks=None):
        """llama.cpp's perplexity chunks: consecutive non-overlapping windows [n, ctx] of the held-out ids, n = the
        whole chunks it holds (at most `chunks`), the first id of each replaced by BOS where the tokenizer adds one."""
        _positive_int("ctx", ctx)
        if ctx < 3:
            raise ValueError(f"ctx must be at least 3 (the second half of a chunk is scored), got {ctx}")
        if chunks is not None:
            _positive_int("chunks", chunks)
        n = len(self.held_out) // ctx
        if n < 1:
            raise ValueError(f"held-out text ({len(self.held_out)} tokens) is shorter than one {ctx}-token chunk")
        windows = self.held_out[:min(n, chunks or n) * ctx].reshape(-1, ctx).clone()
        if self.bos is not None:
            windows[:, 0] = self.bos
        return windows

    def calibration(self, seq_len=128, n=16, seed=1234):
        """Calibration windows [n, seq_len] at random positions of the TRAINING split only (never the held-out
        text), BOS first where the tokenizer adds one. Short text: when n * seq_len exceeds the split, windows
        overlap (a warning says so); a split of at most seq_len tokens gives one window, all of it but the last."""
        _positive_int("seq_len", seq_len)
        _positive_int("n", n)
        if len(self.train) < 2:
            raise ValueError(f"training text ({len(self.train)} tokens) is too short to calibrate on")
        if len(self.train) <= seq_len:
            warnings.warn(f"calibration: the training split holds {len(self.train)} tokens, fewer than one "
                          f"{seq_len}-token window; using it once as a {len(self.train) - 1}-token window",
                          stacklevel=2)
            seq_len, n = len(self.train) - 1, 1
        elif n * seq_len > len(self.train):
            warnings.warn(f"calibration: {n} windows of {seq_len} tokens overlap in a {len(self.train)}-token "
                          "training split", stacklevel=2)
        windows = self.batch(n, seq_len, torch.Generator().manual_seed(seed))[0]
        if self.bos is not None:
            windows[:, 0] = self.bos
        return windows
