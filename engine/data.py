"""The byte corpus: text as bytes (vocabulary 256, no tokenizer), split into training and held-out parts.

The built-in default needs no download: the English reference text that ships with Python itself
(`pydoc_data.topics`, the language reference's topic pages, ~460 KB). `--text PATH` trains on any file instead
(the book uses Edith Wharton's "The Verdict", ~20 KB). The last `held_out` fraction is never trained on; it is
where the damage of quantization is measured.
"""
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch


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


@dataclass
class Corpus:
    train: torch.Tensor          # uint8 -> long ids [n_train]
    held_out: torch.Tensor       # [n_held]
    digest: str                  # sha256 of the raw bytes (part of the training cache key)

    @classmethod
    def from_bytes(cls, data: bytes, held_out=0.1):
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(ids) * (1 - held_out))
        return cls(ids[:cut], ids[cut:], hashlib.sha256(data).hexdigest())

    def batch(self, batch_size, seq_len, generator):
        """Random training windows: (inputs, targets) [batch, seq_len], targets shifted by one byte."""
        if len(self.train) < seq_len + 1:
            raise ValueError(f"training text ({len(self.train)} bytes) is shorter than one {seq_len + 1}-byte window")
        starts = torch.randint(0, len(self.train) - seq_len, (batch_size,), generator=generator)
        windows = self.train[starts[:, None] + torch.arange(seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]

    def eval_windows(self, seq_len=128, max_windows=16):
        """Consecutive non-overlapping held-out windows [n, seq_len + 1] (inputs and next-byte targets)."""
        n = min(max_windows, (len(self.held_out) - 1) // seq_len)
        if n < 1:
            raise ValueError(f"held-out text ({len(self.held_out)} bytes) is shorter than one {seq_len}-byte window")
        return self.held_out[:n * seq_len + 1].unfold(0, seq_len + 1, seq_len)

    def calibration(self, seq_len=128, n=16, seed=1234):
        """Calibration windows [n, seq_len] from the TRAINING split only (never the held-out text)."""
        return self.batch(n, seq_len, torch.Generator().manual_seed(seed))[0]
