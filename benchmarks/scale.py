"""Scale by simulation: a Qwen3-8B-shaped checkpoint (16 GB in bf16) written to disk shard by shard, then converted
layer by layer with fp8 and with an entropy-coded method (HyperQuant's lattice codes, Rice-coded), measuring wall
time and peak resident memory of each conversion as a whole process.

    python benchmarks/scale.py [--dir /tmp/qwen3-8b-shape] [--layers 36] [--methods fp8 lattice] [--keep]

The checkpoint is random (N(0, 0.02) weights, unit norms), written one tensor at a time so that writing it needs no
more memory than its largest tensor; a Qwen3-8B has 36 layers, hidden 4096, intermediate 12288, 32 query heads and 8
KV heads of 128, a 151,936-token vocabulary and an untied lm_head. The conversions run `run.py quantize --model DIR`
in a child process under /usr/bin/time -v (its "Maximum resident set size" is the figure quoted).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.safetensors_io import INDEX, save_file, write_json  # noqa: E402
from engine.qwen3 import Qwen3Config  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_theta=1000000.0, max_position_embeddings=40960, torch_dtype="bfloat16")


def layer_shapes(cfg, i):
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    p = f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)}


def write_checkpoint(folder, cfg):
    """One shard per decoder layer plus one for the embeddings, norm and lm_head, each tensor made and written
    alone."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def make(shape):
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = [layer_shapes(cfg, i) for i in range(cfg.num_hidden_layers)]
    shards.append({"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                   "model.norm.weight": (cfg.hidden_size,), "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)})
    weight_map = {}
    for k, shapes in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({t: make(shape) for t, shape in shapes.items()}, folder / name)
        weight_map.update(dict.fromkeys(shapes, name))
        print(f"wrote {name}", file=sys.stderr, flush=True)
    write_json(folder / INDEX, {"metadata": {}, "weight_map": weight_map})
    write_json(folder / "config.json", cfg.to_hf())


def convert(folder, method, out):
    """(wall seconds, peak RSS bytes) of `run.py quantize --model folder --method method` as a whole process."""
    options = {"fp8": [], "lattice": ["--option", "bps=3.0"], "entquant": ["--option", "lam=14.5"]}[method]
    return timed_quantize(folder, out, ["--method", method, *options])


def timed_quantize(folder, out, arguments, env=None):
    """(wall seconds, peak RSS bytes) of `run.py quantize --model folder ARGUMENTS --out out --force` as a whole
    process under /usr/bin/time -v (its "Maximum resident set size")."""
    start = time.time()
    run = subprocess.run(["/usr/bin/time", "-v", sys.executable, str(ROOT / "run.py"), "quantize", "--model",
                          str(folder), *arguments, "--out", str(out), "--force"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.time() - start
    if run.returncode:
        raise SystemExit(f"the conversion failed:\n{run.stderr[-3000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return seconds, peak_kb * 1024


def folder_bytes(folder):
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/qwen3-8b-shape")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--methods", nargs="*", default=["fp8", "lattice"])
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards (32+ GB of disk)")
    args = parser.parse_args()
    folder = Path(args.dir)
    cfg = Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": args.layers})
    if not (folder / INDEX).exists():
        start = time.time()
        write_checkpoint(folder, cfg)
        print(f"checkpoint: {folder_bytes(folder) / 1e9:.1f} GB in {time.time() - start:.0f} s", file=sys.stderr)
    results = []
    for method in args.methods:
        out = folder.parent / f"{folder.name}-{method}"
        seconds, peak = convert(folder, method, out)
        results.append({"method": method, "layers": cfg.num_hidden_layers, "source_gb": folder_bytes(folder) / 1e9,
                        "output_gb": folder_bytes(out) / 1e9, "seconds": round(seconds, 1),
                        "peak_rss_gb": round(peak / 1e9, 2), "load": os.getloadavg()[0]})
        print(json.dumps(results[-1]), flush=True)
        if not args.keep:
            shutil.rmtree(out)
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
