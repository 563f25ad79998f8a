"""Training the tiny Qwen3 on bytes: AdamW, linear warm-up then cosine decay, gradient clipping.

Deterministic under a seed (initialisation and batches both come from it). The weights start at N(0, 0.02), so the
first loss is about ln 256 = 5.55 nats: a uniform guess over bytes. A trained model is cached in the HF layout under
a key made of the corpus hash, the config, the steps, the seed, the hyper-parameters and TRAINING_VERSION, so a re-run
skips training.
"""
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .loaders import load_dense, save_dense
from .checkpoints.tokenizer import export_tokenizer
from .qwen3 import Qwen3


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25


def lr_at(step, tc: TrainConfig):
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(progress * math.pi)))


def train(cfg, corpus, tc: TrainConfig, log=print):
    """A freshly initialised Qwen3(cfg) trained for tc.steps steps on corpus.train. Returns the model (eval mode)."""
    torch.manual_seed(tc.seed)
    model = Qwen3(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(tc.seed)
    start = time.time()
    model.train()
    for step in range(tc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = corpus.batch(tc.batch_size, tc.seq_len, gen)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        if step == 0 or (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
            elapsed = time.time() - start
            log(f"step {step + 1:4d}/{tc.steps}  loss {loss.item():.4f}  lr {lr_at(step, tc):.2e}  "
                f"{elapsed:6.1f} s  (eta {elapsed / (step + 1) * (tc.steps - step - 1):5.0f} s)")
    return model.eval()


# Bump when the training code changes what it produces for the same settings (version 2: the batch-start fix), so
# that a model cached by older code is trained again instead of silently reused.
TRAINING_VERSION = 2


def cache_key(cfg, corpus, tc: TrainConfig):
    blob = json.dumps({"corpus": corpus.digest, "model": asdict(cfg), "train": asdict(tc),
                       "version": TRAINING_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir():
    return Path(os.environ.get("ENGINE_CACHE", Path.home() / ".cache" / "engine"))


def trained_model(cfg, corpus, tc: TrainConfig, cache_dir=None, log=None):
    """The model trained with these settings, from the cache when it is there (then training is skipped)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = Path(cache_dir or default_cache_dir()) / f"qwen3-{cache_key(cfg, corpus, tc)}"
    if (path / "model.safetensors").exists():
        log(f"using cached model {path}")
        return load_dense(path)
    log(f"training {sum(p.numel() for p in Qwen3(cfg).parameters()) / 1e6:.2f} M parameters for {tc.steps} steps "
        f"on {len(corpus.train)} bytes")
    model = train(cfg, corpus, tc, log)
    save_dense(model, path, side_files=lambda folder: export_tokenizer(None, folder))
    return model


def tiny_setup(text=None, steps=TrainConfig.steps, seed=TrainConfig.seed):
    """The byte corpus (the built-in one, or the file `text`) and the book's tiny Qwen3 trained on it (cached)."""
    from .data import Corpus, load_corpus
    from .qwen3 import Qwen3Config
    corpus = Corpus.from_bytes(load_corpus(text))
    return corpus, trained_model(Qwen3Config(), corpus, TrainConfig(steps=steps, seed=seed))
