"""Scale by simulation, mixture of experts: a Qwen3-30B-A3B-shaped checkpoint cut to a few layers, written by
transformers itself (random weights), then GPTQ int4 (group 128) layer by layer from disk, measuring wall time and
peak resident memory of the conversion as a whole process.

    python benchmarks/moe_30b_shape.py [--dir /tmp/qwen3-30b-a3b-shape] [--layers 4] [--calib-samples 16]
                                       [--calib-len 256] [--threads N] [--keep]

The model is transformers' Qwen3MoeForCausalLM with Qwen3-30B-A3B's shape: hidden 2048, 128 experts of 768 in every
layer, top 8 (renormalized), 32 query heads and 4 KV heads of 128, the 151,936-token vocabulary, an untied lm_head;
made in bfloat16 with transformers' own random initialization (normal, std 0.02; unit norms) and written with
save_pretrained (one tensor per expert linear, as transformers 5 writes them): 4 layers are 6.2 GB, of which the
embedding and lm_head 1.2 GB; the tokenizer beside it is the engine's byte-level one (Qwen's is not here, and random
weights read any ids below the vocabulary alike). Making it holds the whole model once (a peak of 9.7 GB, 47 s).
The conversion is

    /usr/bin/time -v python run.py quantize --model DIR --method gptq --calib-samples 16 --calib-len 256 --out OUT

in a child process (GPTQ's defaults: 4 bits, group 128, its default column order; the calibration is the engine's
default text, pydoc, 16 sequences of 256 tokens); its "Maximum resident set size" is the peak quoted, with the load
average beside the time (the machine may be shared). --threads N runs it with OMP_NUM_THREADS=N: on a machine shared
with other jobs, threads of one matmul that wait for a descheduled sibling spin, and a run's time then swings by
several times; one thread is slower but steady.
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checkpoints.tokenizer import export_tokenizer  # noqa: E402
from scale import folder_bytes, timed_quantize  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)


def write_checkpoint(folder, layers):
    """The model made by transformers in bfloat16 (random init) and saved with save_pretrained, with the engine's
    byte-level tokenizer."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": layers})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="2GB")
    export_tokenizer(None, folder)


def convert(folder, out, samples, length, threads=None):
    """(wall seconds, peak RSS bytes) of run.py quantize --method gptq on `folder` as a whole process (threads:
    its OMP_NUM_THREADS, None: torch's default)."""
    arguments = ["--method", "gptq", "--calib-samples", str(samples), "--calib-len", str(length)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    print(" ".join(["run.py quantize --model", str(folder), *arguments]), file=sys.stderr, flush=True)
    return timed_quantize(folder, out, arguments, env)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/qwen3-30b-a3b-shape")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--threads", type=int, help="the conversion's OMP_NUM_THREADS (default: torch's)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards (6+ GB of disk)")
    args = parser.parse_args()
    folder = Path(args.dir)
    if not (folder / "config.json").exists():
        start = time.time()
        write_checkpoint(folder, args.layers)
        print(f"checkpoint: {folder_bytes(folder) / 1e9:.1f} GB in {time.time() - start:.0f} s", file=sys.stderr)
    out = folder.parent / f"{folder.name}-gptq"
    seconds, peak = convert(folder, out, args.calib_samples, args.calib_len, args.threads)
    print(json.dumps({"method": "gptq", "layers": args.layers, "calibration": f"{args.calib_samples} x "
                      f"{args.calib_len}", "threads": args.threads or torch.get_num_threads(),
                      "source_gb": round(folder_bytes(folder) / 1e9, 2),
                      "output_gb": round(folder_bytes(out) / 1e9, 2), "seconds": round(seconds, 1),
                      "peak_rss_gb": round(peak / 1e9, 2), "load": [round(x, 2) for x in os.getloadavg()]}),
          flush=True)
    if not args.keep:
        shutil.rmtree(out)
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
