"""Tokenizers: text -> token ids for the tiny byte model and for real models, and the tokenizer files a checkpoint
carries.

The tiny model reads bytes (vocabulary 256, id = byte value). Its tokenizer.json spells byte b as GPT-2's byte-level
character BYTE_CHARS[b] (printable bytes stand for themselves, the 68 others take chr(256 + k) in byte order), with
no merges and the ByteLevel pre-tokenizer and decoder: every client that reads byte-level BPE (transformers, vLLM,
llama.cpp through its `gpt2` vocabulary) maps UTF-8 text to exactly the bytes' values. Real models bring their own
tokenizer.json (or a GGUF file's vocabulary, gguf_tokenizer.py); HF's Rust `tokenizers` library runs both.

The tokenizer a written GGUF file carries (`tokenizer_metadata`, its `tokenizer.*` keys): the byte model gets the
recipe llama.cpp accepts (`gpt2`, pre `qwen2`, BYTE_CHARS with id = byte, one dummy merge because llama.cpp needs a
non-empty merges list, no BOS); a GGUF source passes its keys on unchanged; a byte-level BPE tokenizer.json is
converted (tokens, merges, types, specials, chat template), its pre-tokenizer named by which of llama.cpp's splits
reproduce its ids on llama.cpp's fingerprint text (CHKTXT).
"""
import codecs
import contextlib
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .gguf_file import GGUFFile
from .gguf_tokenizer import PRE_TOKENIZERS, gguf_tokenizer, gpt2_pre_tokenizer
from ..safe_writes import TOKENIZER_FILES
from ..safetensors_io import MAX_JSON_BYTES, checked_file, read_json, write_json


def _byte_chars():
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    moved = itertools.count(256)
    return tuple(chr(b) if b in printable else chr(next(moved)) for b in range(256))


BYTE_CHARS = _byte_chars()                        # BYTE_CHARS[b]: byte b as one character (GPT-2's bytes_to_unicode)
BYTE_VOCAB = {c: b for b, c in enumerate(BYTE_CHARS)}
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
    UTF-8 or not; every other tokenizer reads UTF-8 text (read_tokens: a tokenizer that expands text is refused)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return read_tokens(tok, io.BytesIO(data))[0]


# ---- text read only as far as it is needed --------------------------------------------------------------------------

FIRST_PIECE, LAST_PIECE = 1 << 4, 1 << 16        # bytes tokenized at once to count, doubling from the first
TOKENS_PER_BYTE = 16                             # at most; byte-level BPE makes at most one, a byte fallback one


def read_tokens(tok, stream, limit=None, max_bytes=None):
    """Tokenize a binary stream (a file opened "rb", io.BytesIO) without reading or tokenizing more than needed:
    (ids long [n], data: the bytes read, complete: whether that is all of the stream).

    Reading stops at the stream's end, after max_bytes (a character cut there is left out), or once more than
    `limit` tokens are counted. Counting tokenizes piece by piece, FIRST_PIECE bytes first, doubling: a normalizer
    that expands each character 10,000-fold costs one small piece, not the whole text at once; more than
    TOKENS_PER_BYTE tokens a byte is a ValueError. A piece boundary may split a word (a token or two more than
    the whole text has: give `limit` room); ids are always one tokenization of all of `data`, exactly what the whole
    text gives. The byte tokenizer (or None) reads any bytes, its ids their values; other tokenizers read UTF-8."""
    if tok is None or is_byte_tokenizer(tok):
        caps = [n for n in (max_bytes, None if limit is None else limit + 1) if n is not None]
        data = stream.read(min(caps)) if caps else stream.read()
        complete = not caps or len(data) < min(caps) or not stream.read(1)
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)
        return ids, data, complete
    decoder, data, pieces, count, size = codecs.getincrementaldecoder("utf-8")(), bytearray(), [], 0, FIRST_PIECE
    while True:
        raw = stream.read(size if max_bytes is None else min(size, max_bytes - len(data)))
        at_end = not raw and (max_bytes is None or len(data) < max_bytes or not stream.read(1))
        held = len(decoder.getstate()[0])                         # a character's first bytes, from the last read
        try:
            piece = decoder.decode(raw, final=at_end)
        except UnicodeDecodeError as e:
            raise ValueError(f"the text is not UTF-8 (at byte {len(data) - held + e.start}); only the byte tokenizer "
                             "reads any bytes") from None
        data += raw
        if piece:
            with rust_calls(tok):
                count += len(tok.encode(piece, add_special_tokens=False))
            pieces.append(piece)
        if limit is not None and count > limit:
            break
        if count > TOKENS_PER_BYTE * (len(data) + 1):
            raise ValueError(f"{tokenizer_file(tok)}: the tokenizer makes {count} tokens of {len(data)} bytes of "
                             f"text, more than {TOKENS_PER_BYTE} a byte (a normalizer that multiplies characters?)")
        if at_end or not raw:
            break
        size = min(2 * size, LAST_PIECE)
    data = bytes(data[:len(data) - len(decoder.getstate()[0])])   # without a character max_bytes cut
    with rust_calls(tok):
        ids = tok.encode("".join(pieces), add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.long), data, at_end


def complete_utf8(data):
    """bytes without the first bytes of a UTF-8 character that they end inside (at most 3)."""
    for cut in range(min(3, len(data)), 0, -1):
        try:
            data[len(data) - cut:].decode("utf-8")
            return data
        except UnicodeDecodeError:
            if data[len(data) - cut] >> 6 == 0b11:               # the lead byte of the unfinished character
                return data[:len(data) - cut]
    return data


# ---- calls into the Rust library ----------------------------------------------------------------------------------

def tokenizer_file(tok):
    """The file a tokenizer was read from (load_tokenizer records it as tok.file), to name in errors."""
    return getattr(tok, "file", None) or "the tokenizer"


@contextlib.contextmanager
def rust_calls(tok_or_name):
    """Around calls into the tokenizers library (Rust): a panic there (a pre-tokenizer regex past Oniguruma's retry
    limit, a charsmap it cannot parse, a template naming a token it lacks) reaches Python as pyo3's PanicException,
    a BaseException that no `except Exception` catches, after Rust's panic hook has written it, and under
    RUST_BACKTRACE a backtrace, to stderr. It becomes one ValueError naming the tokenizer's file; stderr (file
    descriptor 2) is held in a temporary file during the call and passed on only when nothing panicked."""
    name = tok_or_name if isinstance(tok_or_name, (str, Path)) else tokenizer_file(tok_or_name)
    sys.stderr.flush()
    saved, panic = os.dup(2), None
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as e:                               # pyo3_runtime is made at run time: no import
            if type(e).__name__ != "PanicException":
                raise
            panic = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if panic is None and held.tell():
                held.seek(0)
                sys.stderr.buffer.write(held.read())
                sys.stderr.flush()
    if panic is not None:
        raise ValueError(f"{name}: the tokenizers library failed on it ({str(panic)[:200]})") from None


def bos_id(tok):
    """The id tok's post-processor puts before every sequence (Llama 3's <|begin_of_text|>), or None (Qwen, bytes)."""
    if tok is None:
        return None
    with rust_calls(tok):
        enc = tok.encode("a")
    return enc.ids[0] if enc.special_tokens_mask[0] else None


def _from_json_file(path, what):
    with rust_calls(what):
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:                           # the Rust side names what is wrong
            raise ValueError(f"{what} is not a valid tokenizer.json: {e}") from None
    tok.file = str(what)
    return tok


def _is_byte_model(folder):
    return (Path(folder) / "config.json").exists() and read_json(folder, "config.json").get("vocab_size") == 256


def check_vocabulary(tok, vocab_size, where, declared=None):
    """Every id tok can produce (its vocabulary and added tokens) must be a row of the model's embedding: an id past
    vocab_size would be an IndexError in the first forward pass, so it is refused when the tokenizer loads.
    declared: {token: id} as tokenizer.json states its added tokens (the library renumbers an id it finds out of
    place; the file's own number is the one to name)."""
    if type(vocab_size) is not int:
        return tok
    declared = declared or {}
    ids = [*declared.items(), *tok.get_vocab(with_added_tokens=True).items()]   # both: either can be the larger
    name, top = max(ids, key=lambda item: item[1], default=(None, -1))
    if top >= vocab_size:
        moved = f" (tokenizer.json gives it id {declared[name]}, which another token holds: the tokenizers library " \
                "renumbered it)" if declared.get(name, top) != top else ""
        raise ValueError(f"{where}: token {name!r} has id {top}{moved}, beyond the model's vocabulary of {vocab_size} "
                         "(vocab_size): the tokenizer does not belong to this model")
    return tok


def present(folder, name):
    """Whether `folder` has an entry `name` (a dangling link counts: reading it must then fail, not be skipped)."""
    return (Path(folder) / name).exists() or (Path(folder) / name).is_symlink()


def read_tokenizer_folder(folder):
    """(Tokenizer, tokenizer_config dict, chat template text or None) of a folder's tokenizer.json,
    tokenizer_config.json ({} if absent) and chat_template.jinja (None if absent): each a regular file inside the
    folder (safetensors_io.checked_file), bounded and well formed, or a ValueError naming it."""
    folder = Path(folder)
    tok = _from_json_file(checked_file(folder, "tokenizer.json", MAX_JSON_BYTES), folder / "tokenizer.json")
    config = read_json(folder, "tokenizer_config.json") if present(folder, "tokenizer_config.json") else {}
    template = None
    if present(folder, "chat_template.jinja"):
        try:
            template = checked_file(folder, "chat_template.jinja", MAX_JSON_BYTES).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{folder / 'chat_template.jinja'} is not UTF-8 text") from None
    return tok, config, template


def load_tokenizer(path=None):
    """A tokenizers.Tokenizer: None -> the byte tokenizer; a folder -> its tokenizer.json (a folder of the byte model
    written before tokenizer files were: the byte tokenizer); a file -> a GGUF file's vocabulary. A tokenizer with
    ids beyond the model's vocabulary (config.json's vocab_size, the GGUF embedding's rows) is refused. tok.file
    records the file read, for errors to name (tokenizer_file)."""
    if path is None:
        return byte_tokenizer()
    path = Path(path)
    if path.is_dir():
        if present(path, "tokenizer.json"):
            tok = _from_json_file(checked_file(path, "tokenizer.json", MAX_JSON_BYTES), path / "tokenizer.json")
            vocab = read_json(path, "config.json").get("vocab_size") if (path / "config.json").exists() else None
            added = read_json(path, "tokenizer.json").get("added_tokens")
            declared = {t["content"]: t["id"] for t in added if isinstance(t, dict) and type(t.get("id")) is int
                        and isinstance(t.get("content"), str)} if isinstance(added, list) else {}
            return check_vocabulary(tok, vocab, path / "tokenizer.json", declared)
        if _is_byte_model(path):
            return byte_tokenizer()
        raise ValueError(f"no tokenizer.json in {path} (a SentencePiece-only tokenizer.model is not read)")
    if path.is_file():
        with GGUFFile(path) as f, rust_calls(path):
            embedding = f.tensors.get("token_embd.weight")
            tok = check_vocabulary(gguf_tokenizer(f)[0], embedding and embedding.shape[0], path)
        tok.file = str(path)
        return tok
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
        if present(source_folder, name):
            shutil.copyfile(checked_file(source_folder, name, MAX_JSON_BYTES), Path(out_folder) / name)
            copied.append(name)
    return copied


def export_tokenizer(source, out_folder, rebuilt=None):
    """Give a checkpoint written into out_folder its source's tokenizer: None (the tiny byte model) -> the byte
    tokenizer's files; a model folder -> its tokenizer files copied (or the byte tokenizer's for a byte model
    folder without any); a GGUF file -> tokenizer.json and tokenizer_config.json (with its chat template) rebuilt
    from its metadata (nothing if it has none; rebuilt: gguf_tokenizer's result, or () for none, when the caller
    has already built it). Returns the names written."""
    if source is None:
        return write_tokenizer_files(byte_tokenizer(), out_folder)
    source = Path(source)
    if source.is_dir():
        copied = copy_tokenizer_files(source, out_folder)
        if "tokenizer.json" not in copied and _is_byte_model(source):
            copied += write_tokenizer_files(byte_tokenizer(), out_folder)
        return copied
    if rebuilt is None:
        with GGUFFile(source) as f:                           # a GGUF file may hold weights only
            rebuilt = gguf_tokenizer(f) if "tokenizer.ggml.tokens" in f.metadata else ()
    return write_tokenizer_files(rebuilt[0], out_folder, rebuilt[1]) if rebuilt else []


# ---- the tokenizer a GGUF file carries: its tokenizer.* keys --------------------------------------------------------

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5       # tokenizer.ggml.token_type
DUMMY_MERGE = f"{BYTE_CHARS[32]} {BYTE_CHARS[32]}"       # llama.cpp refuses an empty merges list
# llama.cpp's pre-tokenizer fingerprint text (convert_hf_to_gguf.py, get_vocab_base_pre)
CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
          "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 "
          "3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 "
          "?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e \u043d\u0430 "
          "\u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 ''''''```````\"\"\"\"......!!!!!!?????? I've been "
          "'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")


def byte_tokenizer_metadata(cfg):
    """The byte model's vocabulary as llama.cpp accepts it (DESIGN.md section 7)."""
    if cfg.vocab_size != 256:
        raise ValueError(f"no tokenizer given and vocab_size is {cfg.vocab_size}: only the byte model (256) has an "
                         "implied one; pass the model's tokenizer.json folder or GGUF file")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": list(BYTE_CHARS), "tokenizer.ggml.token_type": [NORMAL] * 256,
            "tokenizer.ggml.merges": [DUMMY_MERGE],
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    for role, value in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id)):
        if isinstance(value, int):
            meta[f"tokenizer.ggml.{role}_token_id"] = value
    return meta


def _special(value):
    return value.get("content") if isinstance(value, dict) else value


def hf_tokenizer_metadata(directory, vocab_size):
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) of a byte-level BPE tokenizer -> GGUF
    tokenizer keys. The rows past the tokenizer's last id (a padded embedding) become unused [PAD{i}] tokens."""
    tok, config, template = read_tokenizer_folder(directory)
    spec = json.loads(tok.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"{directory}/tokenizer.json is not a byte-level BPE (GPT-2 style) tokenizer; convert it "
                         "with llama.cpp's converter instead")
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) > vocab_size:
        raise ValueError(f"tokenizer ids are not 0..{len(by_id) - 1} within the model's vocab_size {vocab_size}")
    added = {t["id"]: CONTROL if t["special"] else USER_DEFINED for t in spec.get("added_tokens", [])}
    tokens = [by_id[i] for i in range(len(by_id))] + [f"[PAD{i}]" for i in range(len(by_id), vocab_size)]
    types = [added.get(i, NORMAL) for i in range(len(by_id))] + [UNUSED] * (vocab_size - len(by_id))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges or [DUMMY_MERGE],
            "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False)),
            "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False))}
    ids = {t: i for i, t in enumerate(tokens)}
    for role, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        token = _special(config.get(key))
        if isinstance(token, str) and token in ids:
            meta[f"tokenizer.ggml.{role}_token_id"] = ids[token]
    template = config.get("chat_template") if template is None else template
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    with rust_calls(tok):
        meta["tokenizer.ggml.pre"] = _pre_tokenizer_name(tok, meta)
    return meta


def _pieces(pre_tokenizer, normalizer, text):
    text = normalizer.normalize_str(text) if normalizer else text
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def _pre_tokenizer_name(tok, meta):
    """The llama.cpp pre-tokenizer that splits CHKTXT into `tok`'s own pieces, else the first that gives its ids
    (llama.cpp's converter names it by a hash of those ids; trying each split gguf.py knows needs no hash table)."""
    names = []                                           # one name per distinct set of splits, in gguf.py's order
    for name, splits in PRE_TOKENIZERS.items():
        if all(PRE_TOKENIZERS[other] != splits for other in names):
            names.append(name)
    if tok.pre_tokenizer is not None:
        pieces = _pieces(tok.pre_tokenizer, tok.normalizer, CHKTXT)
        for name in names:
            if _pieces(gpt2_pre_tokenizer(name), None, CHKTXT) == pieces:
                return name
    ids = tok.encode(CHKTXT, add_special_tokens=False).ids
    for name in names:
        probe = {**meta, "tokenizer.ggml.pre": name, "tokenizer.ggml.add_bos_token": False,
                 "tokenizer.ggml.add_eos_token": False}
        if gguf_tokenizer(SimpleNamespace(metadata=probe))[0].encode(CHKTXT).ids == ids:
            return name
    raise ValueError("no llama.cpp pre-tokenizer reproduces this tokenizer's splits (on llama.cpp's fingerprint "
                     f"text); the known ones are {sorted(PRE_TOKENIZERS)}")


def tokenizer_metadata(cfg, source=None):
    """GGUF tokenizer keys: from a .gguf file (copied), a folder with tokenizer.json (converted), or, with no
    source, the byte model's vocabulary."""
    if source is None or (Path(source).is_dir() and not present(source, "tokenizer.json")):
        return byte_tokenizer_metadata(cfg)
    if Path(source).is_dir():
        return hf_tokenizer_metadata(source, cfg.vocab_size)
    with GGUFFile(source) as f:
        meta = {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.model" not in meta:
        raise ValueError(f"{source} holds no tokenizer (tokenizer.ggml.model)")
    return meta
