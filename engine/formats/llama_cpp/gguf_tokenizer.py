"""The tokenizer of a GGUF file, rebuilt from its metadata as a `tokenizers.Tokenizer` with the tokenizer_config
Hugging Face writes beside it; and the byte model's tokenizer keys a written GGUF file carries (engine/checkpoints/
tokenizer.py converts a tokenizer.json's).

    tokenizer.ggml.model  "gpt2": byte-level BPE (tokens, merges), split first by llama.cpp's pre-tokenizer regexes
                                  for tokenizer.ggml.pre (PRE_TOKENIZERS, from src/llama-vocab.cpp)
                          "llama": SentencePiece-style BPE with byte fallback; without merges they are rebuilt from
                                  the scores (every split of a token into two tokens, the higher score first)
    token_type            3 = control (special tokens), 4 = user-defined (added tokens)
    add_bos/add_eos_token BOS / EOS added around every sequence (a TemplateProcessing post-processor)

Every field is checked (types, lengths, ids in range) and anything malformed is a ValueError naming the key.
"""
import itertools
import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> llama.cpp's successive splits (src/llama-vocab.cpp, llm_tokenizer_bpe)
PRE_TOKENIZERS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais"], [_GPT2]),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"], [r"\p{N}", _GPT2]),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen"], [_QWEN2]),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"], [_LLAMA3]),
}
LLAMA3_LIKE = ("llama-bpe", "llama3", "llama-v3")     # llama.cpp ignores merges for these and adds BOS by default
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5       # tokenizer.ggml.token_type


def _byte_chars():
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    moved = itertools.count(256)
    return tuple(chr(b) if b in printable else chr(next(moved)) for b in range(256))


BYTE_CHARS = _byte_chars()                        # BYTE_CHARS[b]: byte b as one character (GPT-2's bytes_to_unicode)
DUMMY_MERGE = f"{BYTE_CHARS[32]} {BYTE_CHARS[32]}"       # llama.cpp refuses an empty merges list


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


def _spm_merges(tokens, scores, types):
    """SentencePiece BPE merges the highest-scoring pair first: every split of a token into two tokens is a merge,
    ranked by the token's score (what llama.cpp's llm_tokenizer_spm does greedily)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        if types[i] in (1, USER_DEFINED):                 # normal or user-defined pieces, not control or bytes
            found += [(-scores[i], i, t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    return [(left, right) for *_, left, right in sorted(found)]


def _bpe(vocab, merges, **options):
    try:
        return Tokenizer(models.BPE(vocab, merges, **options))
    except Exception as e:                            # the Rust side refuses e.g. a merge of unknown tokens
        raise ValueError(f"GGUF tokenizer is malformed: {e}") from None


def _typed(meta, key, default, ok, what):
    value = meta.get(key, default)
    if not ok(value):
        raise ValueError(f"GGUF {key} must be {what}, got {str(value)[:60]}")
    return value


def _is_list(kind, n=None):
    return lambda v: isinstance(v, list) and (n is None or len(v) == n) and all(type(x) in kind for x in v)


def _flag(meta, name, default):
    return _typed(meta, f"tokenizer.ggml.{name}", default, lambda v: isinstance(v, bool), "a bool")


def gpt2_pre_tokenizer(pre):
    """llama.cpp's splits for tokenizer.ggml.pre `pre`, then GPT-2's byte-to-unicode spelling."""
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in PRE_TOKENIZERS[pre]]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def gguf_tokenizer(f):
    """(tokenizers.Tokenizer, tokenizer_config dict as Hugging Face writes it, chat template included)."""
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = _typed(meta, "tokenizer.ggml.tokens", None, lambda v: _is_list((str,))(v) and len(set(v)) == len(v),
                    "a list of distinct strings")
    types = _typed(meta, "tokenizer.ggml.token_type", [1] * len(tokens), _is_list((int,), len(tokens)),
                   "one int per token")
    merges = _typed(meta, "tokenizer.ggml.merges", None,
                    lambda v: v is None or (_is_list((str,))(v) and all(len(m.split(" ")) == 2 for m in v)),
                    "a list of 'left right' strings")
    merges = merges and [tuple(m.split(" ")) for m in merges]
    special = {}
    for role in ("bos", "eos", "unknown", "padding"):
        i = _typed(meta, f"tokenizer.ggml.{role}_token_id", None,
                   lambda v: v is None or (type(v) is int and 0 <= v < len(tokens)), "a token id")
        special[role] = None if i is None else tokens[i]
    vocab = {t: i for i, t in enumerate(tokens)}
    # A merge whose result is not a token is never applied by llama.cpp (it looks the merged piece up in the
    # vocabulary), and tokenizers' BPE panics on it: drop it. Merges naming unknown pieces are kept, so that _bpe
    # refuses them with a clear error.
    if merges:
        merges = [m for m in merges if m[0] + m[1] in vocab or not (m[0] in vocab and m[1] in vocab)]
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported ({sorted(PRE_TOKENIZERS)})")
        tok = _bpe(vocab, merges or [], ignore_merges=pre in LLAMA3_LIKE)
        tok.pre_tokenizer = gpt2_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        add_bos = _flag(meta, "add_bos_token", pre in LLAMA3_LIKE)
    elif kind == "llama":
        if merges is None:
            scores = _typed(meta, "tokenizer.ggml.scores", None, _is_list((int, float), len(tokens)),
                            "one number per token (or merges given)")
            merges = _spm_merges(tokens, scores, types)
        tok = _bpe(vocab, merges, byte_fallback=True, unk_token=special["unknown"], fuse_unk=True)
        space, prefix = normalizers.Replace(" ", "\u2581"), _flag(meta, "add_space_prefix", True)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if prefix else space
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
        add_bos = _flag(meta, "add_bos_token", True)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported ('gpt2' and 'llama' are)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    add_eos = _flag(meta, "add_eos_token", False)
    if (add_bos and special["bos"] is None) or (add_eos and special["eos"] is None):
        raise ValueError("GGUF asks to add a BOS / EOS token but names none")
    if add_bos or add_eos:
        tok = _with_ends(tok, special["bos"] if add_bos else None, special["eos"] if add_eos else None, vocab)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special["bos"],
              "eos_token": special["eos"], "unk_token": special["unknown"], "pad_token": special["padding"],
              "add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = _typed(meta, "tokenizer.chat_template", None, lambda v: isinstance(v, str),
                                         "a string")
    return tok, config


def _with_ends(tok, bos, eos, vocab):
    """tok adding BOS before / EOS after each sequence (None: not added). Written as tokenizer.json's
    TemplateProcessing: its string form cannot name tokens that contain ':' or start with '$'."""
    ends = [t for t in (bos, eos) if t is not None]

    def piece(seq, type_id):
        return ([{"SpecialToken": {"id": bos, "type_id": type_id}}] * (bos is not None)
                + [{"Sequence": {"id": seq, "type_id": type_id}}]
                + [{"SpecialToken": {"id": eos, "type_id": type_id}}] * (eos is not None))
    spec = json.loads(tok.to_str())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": piece("A", 0),
                              "pair": piece("A", 0) + piece("B", 1),
                              "special_tokens": {t: {"id": t, "ids": [vocab[t]], "tokens": [t]} for t in ends}}
    return Tokenizer.from_str(json.dumps(spec))
