"""Text -> token ids: the byte corpus and real tokenizers, split into training and held-out parts.

The tiny model reads bytes (vocabulary 256, id = byte value); real models bring their own tokenizer
(engine/checkpoints/tokenizer.py).

The built-in default text needs no download: the English reference text that ships with Python itself
(`pydoc_data.topics`, the language reference's topic pages, ~460 KB). `--text PATH` reads any file instead (the book
uses Edith Wharton's "The Verdict", ~20 KB). The last `held_out` fraction of the ids is never trained or calibrated
on; it is where the damage of quantization is measured:

    ids = tokenize(text)        train = ids[:cut]        held_out = ids[cut:]        cut = int(len(ids) * 0.9)

Calibration of a real model (calibration_ids) reads its sequences from one or more sources, each contributing an
equal share of them: a file (windows of its training part), "pydoc" (the built-in corpus' training part), or "self"
(text the model writes itself from a random first token: numerics/sensitivity.py). What was used is kept as a
name and the SHA-256 of the ids, which the checkpoint writers record beside the source model's digest.
"""
import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .safetensors_io import tensor_digest
from .checkpoints.tokenizer import bos_id, encode, is_byte_tokenizer, read_tokens
from .console import bar, log
from .formats.numerics.sensitivity import self_generated_ids


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
        data = data.encode("utf-8") if isinstance(data, str) else data
        return cls.from_ids(encode(tokenizer, data), data, tokenizer, held_out)

    @classmethod
    def from_ids(cls, ids, data, tokenizer=None, held_out=0.1):
        """ids long [n], the tokenization of the bytes `data` by `tokenizer` (from_text, read_corpus)."""
        if not 0 < held_out <= 1:
            raise ValueError(f"held_out must be in (0, 1], got {held_out!r}")
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


# ---- calibration sources of a real model --------------------------------------------------------------------------

SELF, PYDOC = "self", "pydoc"
# The default for a real model (the tiny byte model calibrates on its own training text). benchmarks/calibration.py
# measures the sources against each other on held-out texts of other domains; until it shows a source that
# generalizes better, the default stays pydoc (on SmolLM2, GPTQ calibrated on "self" scored worse on the GPL than
# GPTQ calibrated on pydoc).
DEFAULT_CALIBRATION = (PYDOC,)


def check_sources(sources, flag="--calib"):
    """The cheap checks, before any model or tokenizer loads: a non-empty list of "self", "pydoc" or paths of
    files that exist and are not empty. Returns the sources as a tuple of str."""
    if isinstance(sources, (str, Path)):
        sources = (sources,)
    sources = tuple(str(s) for s in sources)
    if not sources:
        raise ValueError(f"{flag}: give at least one source ({SELF!r}, {PYDOC!r} or a text file)")
    for source in sources:
        if source in (SELF, PYDOC):
            continue
        path = Path(source)
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a folder; give a text file")
        if not path.is_file():
            raise ValueError(f"{flag} {path}: no such file (the named sources are {SELF!r} and {PYDOC!r})")
        if path.stat().st_size == 0:
            raise ValueError(f"{flag} {path} is empty")
    return sources


@dataclass
class Calibration:
    ids: torch.Tensor            # long [n, seq_len]
    name: str                    # the sources, e.g. "self (seed 1234)" or "pydoc + notes.txt"
    digest: str                  # sha256 of the ids (exactly what was calibrated on)

    def records(self):
        """The checkpoint's provenance entries (engine.checkpoints: the safetensors / index metadata)."""
        return {"engine.calibration": self.name, "engine.calibration_sha256": self.digest}


def calibration_ids(sources, tokenizer, seq_len=512, n=32, seed=1234, model=None, on_token=None):
    """Calibration sequences [n, seq_len] from `sources` (check_sources), each contributing n // len(sources) of
    them (the first n % len(sources) one more), in the order given: a file or "pydoc" gives windows at seeded random
    positions of its training part (Corpus.calibration: the last tenth stays held out, BOS first where the
    tokenizer adds one); "self" gives sequences the model samples itself (self_generated_ids, after BOS where the
    tokenizer adds one). model: a function returning the model, called only for "self". on_token: called with
    each generated token (a progress bar)."""
    sources = check_sources(sources)
    _positive_int("seq_len", seq_len)
    _positive_int("n", n)
    if n < len(sources):
        raise ValueError(f"{n} calibration sequences cannot give each of {len(sources)} sources a share")
    if seq_len < 2:
        raise ValueError(f"calibration sequences need at least 2 tokens, got seq_len={seq_len}")
    shares = [n // len(sources) + (k < n % len(sources)) for k in range(len(sources))]
    texts = {s: _calibration_text(s, tokenizer, share * seq_len)                  # tokenized before the model loads
             for s, share in zip(sources, shares) if s != SELF}
    for source, corpus in texts.items():
        if len(corpus.train) <= seq_len:
            raise ValueError(f"--calib {source}: its training part ({len(corpus.train)} tokens: the last tenth is "
                             f"held out) is shorter than one {seq_len}-token window; give a longer text or a "
                             "smaller --calib-len")
    if SELF in sources and model is None:
        raise ValueError(f"calibration source {SELF!r} needs the model (model=a function returning it)")
    bos, loaded = bos_id(tokenizer), []
    parts = []
    for k, (source, share) in enumerate(zip(sources, shares)):
        if source == SELF:
            loaded = loaded or [model()]
            start = None if bos is None else torch.full((share, 1), bos)
            parts.append(self_generated_ids(loaded[0], share, seq_len, seed + k, start=start,
                                            on_token=on_token).cpu())
        else:
            parts.append(texts[source].calibration(seq_len, share, seed + k))
    ids = torch.cat(parts).long()
    names = [f"{s} (seed {seed + k})" if s == SELF else s if s == PYDOC else Path(s).name
             for k, s in enumerate(sources)]
    return Calibration(ids, " + ".join(names), tensor_digest(ids))


def calibration_bytes(tokens):
    """How much of a file a calibration of `tokens` tokens reads: 16 bytes a token (about four times the text the
    windows take, at ~4 bytes a token of prose), at least 2 MiB and at most MAX_TEXT_BYTES, so that a huge file
    costs no more time and memory than that (tokenizing costs some hundred bytes a token)."""
    return min(max(16 * tokens, 2 << 20), MAX_TEXT_BYTES)


# The most of a text file that calibration or evaluation reads: its first MAX_TEXT_BYTES, and of those no more than
# about MAX_TEXT_TOKENS tokens (~16 MB of prose; ~0.7 GB to tokenize at once). Evaluation reads up to both limits
# whatever it needs, calibration up to calibration_bytes: evaluation's held-out tenth always lies past the training
# part a calibration on the same file draws its windows from.
MAX_TEXT_BYTES = 64 << 20
MAX_TEXT_TOKENS = 1 << 22


def read_corpus(path, tokenizer, max_bytes=MAX_TEXT_BYTES, flag="--text"):
    """The Corpus (last tenth held out) of a text file's beginning: its first max_bytes (whole characters), and no
    more of those than MAX_TEXT_TOKENS tokens need (read_tokens: read and counted in pieces, stopped once past).
    Text the tokenizer cannot take is a ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            ids, data, _ = read_tokens(tokenizer, f, MAX_TEXT_TOKENS, max_bytes)
    except ValueError as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    return Corpus.from_ids(ids, data, tokenizer)


def text_corpus(path, tokenizer):
    """The held-out text a real model is evaluated on: --text FILE (read_corpus), or the built-in corpus."""
    return Corpus.from_text(default_corpus(), tokenizer) if path is None else read_corpus(path, tokenizer)


def _calibration_text(source, tokenizer, tokens):
    """The Corpus of a calibration source: "pydoc", or a file's first calibration_bytes(tokens) (read_corpus)."""
    if source != PYDOC:
        return read_corpus(source, tokenizer, calibration_bytes(tokens), "--calib")
    try:
        return Corpus.from_text(default_corpus(), tokenizer)
    except ValueError as e:
        raise ValueError(f"--calib {PYDOC}: {e}") from None


def real_calibration(sources, tokenizer, seq_len, n, model, one_thread=False):
    """calibration_ids(sources or DEFAULT_CALIBRATION, ...) as a command runs it: what it does on stderr, a progress
    bar while the model writes its own text, on one thread when one_thread (a small model's decoding steps are too
    small to share between threads: run.py generate's rule)."""
    sources = tuple(sources or DEFAULT_CALIBRATION)
    log(f"calibration: {' + '.join(map(str, sources))}, {n} x {seq_len} tokens ...")
    threads = torch.get_num_threads()
    steps = seq_len - 1 - (bos_id(tokenizer) is not None)
    progress = bar(total=steps, desc="sampling the model's own text", unit="token") if SELF in sources else None
    try:
        if one_thread:
            torch.set_num_threads(1)
        calibration = calibration_ids(sources, tokenizer, seq_len, n, model=model,
                                      on_token=progress and (lambda token: progress.update()))
    finally:
        torch.set_num_threads(threads)
        if progress is not None:
            progress.close()
    log(f"calibration: {calibration.name}, {tuple(calibration.ids.shape)} ids, sha256 {calibration.digest[:16]}")
    return calibration
