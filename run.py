"""Command line for the engine.

  python run.py quantformats [--steps 300] [--text PATH] [--seed 0] [--impl torch|engine] [--rows SUBSTR ...]
      Train (or load from cache) a tiny Qwen3 on bytes, quantize it every way, and print the KL table:
      one JSON line per row as it finishes, then a markdown table.
  python run.py train     [--steps] [--text] [--seed] [--out DIR]       train (cached) and optionally save dense
  python run.py quantize  --method NAME --out DIR [--group-size 64] [--act-order] [--bpw 2.1] [--option K=V ...]
                          [--target vllm|transformers|llama.cpp|onnx] [--format safetensors|gguf]
      write the trained model as a quantized checkpoint (gptq, awq, fp8, compressed-tensors, trellis, entquant,
      lattice); --option passes any other keyword of that method's quantize(); --target picks settings that client
      loads and refuses what it cannot; --format gguf writes one llama.cpp file (--out FILE)
  python run.py export    SOURCE --gguf FILE [--force]       a checkpoint folder or .gguf file as a GGUF file
  python run.py eval      DIR [--impl] [--steps/--text/--seed]          KL of a quantized checkpoint vs the reference
"""
import argparse
import copy
import inspect
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.data import Corpus, load_corpus
from engine.evaluation import held_out_logits, kl_stats, perplexity
from engine.formats import affine, awq, entropy, fp8, gptq, kv_cache, lattice, mx, nf4, trellis
from engine.formats.base import impl, quantized_linears
from engine.formats.checkpoints import METHODS, load_quantized, save_quantized
from engine.formats.gguf_writer import write_gguf
from engine.formats.serving import check_target, export_gguf, tp_degrees, vllm_serve_command
from engine.loaders import checkpoint_source, model_digest, read_config, save_dense
from engine.safetensors_io import check_output
from engine.qwen3 import Qwen3Config
from engine.training import TrainConfig, trained_model


GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)    # what GPTQModel's QuantizeConfig accepts
BPW_RANGE = (1.5, 6.0)                                  # EntQuant's lambda search, from the shipped table


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Row:
    """One line of the table: `quantize(model, calibration_ids, **options)` is a method's entry point."""
    label: str
    quantize: Callable
    options: dict = field(default_factory=dict)
    kv_cache: bool = False      # weights stay dense; K and V are quantized as they enter the cache


def rows():
    """The table: the book's rows in the book's order, then EntQuant, HyperQuant and the KV cache."""
    return [
        Row("RTN int4, g64", affine.quantize, dict(bits=4, group_size=64)),
        Row("GPTQ int4, g64", gptq.quantize, dict(group_size=64)),
        Row("GPTQ int4, g64, act-order", gptq.quantize, dict(group_size=64, act_order=True)),
        Row("AWQ int4, g64", awq.quantize, dict(group_size=64)),
        Row("FP8 E4M3, 128x128 blocks", fp8.quantize, dict(block=128)),
        Row("MXFP4", mx.quantize, dict(format="mxfp4")),
        Row("NVFP4", mx.quantize, dict(format="nvfp4")),
        Row("trellis (QTIP-style), L=8", trellis.quantize, dict(L=8, K=2)),
        Row("trellis (QTIP-style), L=8, K=3", trellis.quantize, dict(L=8, K=3)),
        Row("RTN int2, g64 (for comparison)", affine.quantize, dict(bits=2, group_size=64)),
        Row("trellis BlockLDLQ (QTIP-style), L=8, 16x16 tiles", trellis.quantize, dict(L=8, K=2, ldlq=True)),
        *[Row(f"EntQuant Float8+ANS, ~{b} bpw", entropy.quantize, dict(bpw=b, tol=0.01))
          for b in (4.0, 3.0, 2.1)],
        *[Row(f"EntQuant Float8+ANS + self-Fisher, ~{b} bpw", entropy.quantize,
              dict(bpw=b, tol=0.01, sensitivity="fisher")) for b in (3.0, 2.1)],
        Row("NF4, g64", nf4.quantize, dict(group_size=64)),
        *[Row(f"lattice E8, {b} bps", lattice.quantize, dict(lattice="E8", bps=b)) for b in (2.0, 3.0, 4.0)],
        *[Row(f"lattice {name}, 3.0 bps", lattice.quantize, dict(lattice=name, bps=3.0)) for name in ("D4", "A2", "Z")],
        *[Row(f"KV cache E8, {b} bps, rotation {rot}{', dither' if dither else ''}", kv_cache.kv_quantize,
              dict(lattice="E8", bps=b, rotation=rot, dither=dither), kv_cache=True)
          for b in (2.0, 3.0) for rot in ("none", "signs", "qjl") for dither in (False, True)],
    ]


def model_bits(model):
    layers = quantized_linears(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return sum(layer.storage_bits() for layer in layers) / weights if weights else None


def setup(args):
    corpus = Corpus.from_bytes(load_corpus(args.text))
    tc = TrainConfig(steps=args.steps, seed=args.seed)
    model = trained_model(Qwen3Config(), corpus, tc)
    return corpus, model


def evaluate(model, windows, impl_name):
    with impl(impl_name):
        return held_out_logits(model, windows)


def markdown(results):
    lines = ["| format | bits | KL (nats) | ± | p99 | same top % |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "kl_nats" in r:
            lines.append(f"| {r['format']} | {r['bits']} | {r['kl_nats']:.5f} | {r['kl_stderr']:.5f} | "
                         f"{r['kl_p99']:.4f} | {r['same_top_pct']:.1f} |")
        else:
            lines.append(f"| {r['format']} | {r['bits']} | (perplexity {r['held_out_perplexity']}) | | | |")
    return "\n".join(lines)


def cmd_quantformats(args):
    selected = [r for r in rows() if not args.rows or any(s.lower() in r.label.lower() for s in args.rows)]
    if not selected:
        raise SystemExit(f"--rows {args.rows} matches no row; rows are: {[r.label for r in rows()]}")
    t0 = time.time()
    corpus, reference = setup(args)
    t_trained = time.time()
    windows = corpus.eval_windows()
    calibration = corpus.calibration()
    ref_logits = held_out_logits(reference, windows)
    dtype = str(next(reference.parameters()).dtype).removeprefix("torch.")
    bits = torch.finfo(next(reference.parameters()).dtype).bits
    results = [{"format": f"{dtype} reference", "bits": bits,
                "held_out_perplexity": round(perplexity(ref_logits, windows[:, 1:]), 2)}]
    print(json.dumps(results[0]), flush=True)
    for row in selected:
        start = time.time()
        log(f"quantizing: {row.label}")
        model = copy.deepcopy(reference)
        if row.kv_cache:                # the bits column is then the coded K/V rate, known after the forward pass
            kv = row.quantize(model, **row.options)
        else:
            row.quantize(model, calibration, **row.options)
        stats = kl_stats(ref_logits, evaluate(model, windows, args.impl))
        bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
        result = {"format": row.label, "bits": round(bits, 2),
                  **{k: round(v, 6 if k.startswith("kl") else 2) for k, v in stats.items()},
                  **({"weights": "dense"} if row.kv_cache else {}), "seconds": round(time.time() - start, 1)}
        results.append(result)
        print(json.dumps(result), flush=True)
    print()
    print(markdown(results))
    log(f"impl={args.impl}: training/cache {t_trained - t0:.1f} s, rows {time.time() - t_trained:.1f} s")


def cmd_train(args):
    if args.out:
        check_output(args.out, args.force)
    _, model = setup(args)
    if args.out:
        save_dense(model, args.out, force=args.force)
        log(f"saved {args.out}")


def quantize_options(args):
    """--option KEY=VALUE and the named flags -> {keyword: value} for the method's quantize(), each value parsed by
    the type of that keyword's default; unknown keywords and values of the wrong type are errors."""
    entry = METHODS[args.method]
    accepted = inspect.signature(entry.quantize_layer or entry.quantize).parameters
    takes = [p for p in accepted if p not in ("model", "calibration_ids", "layer")]
    options = {}
    for text in args.option or []:
        key, sep, value = text.partition("=")
        key = key.replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--option wants KEY=VALUE, got {text!r}")
        if key not in takes:
            raise ValueError(f"--method {args.method} takes no option {key!r}; it takes {takes}")
        options[key] = parse_value(key, value, accepted[key].default)
    for key, value in (("group_size", args.group_size), ("act_order", args.act_order or None), ("bpw", args.bpw)):
        if value is not None:
            if key not in takes:
                raise ValueError(f"--{key.replace('_', '-')} does not apply to --method {args.method}; it takes {takes}")
            options[key] = value
    return options


def parse_value(key, text, default):
    """A command-line value read as the type of the keyword's default: true/false/1/0/yes/no for a bool, a number
    for an int or a float, text for a str; JSON (numbers, lists, true/false) where the default is None."""
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"option {key} wants true or false, got {text!r}")
        return text.lower() in ("true", "1", "yes")
    try:
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        raise ValueError(f"option {key} wants {type(default).__name__}, got {text!r}") from None
    if isinstance(default, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check_quantize_args(args):
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {sorted(METHODS)}, got {args.method!r}")
    options = quantize_options(args)
    group = options.get("group_size")
    if args.method in ("gptq", "awq", "compressed-tensors") and group is not None and group not in GROUP_SIZES:
        raise ValueError(f"--group-size {group}: GPTQModel, AutoAWQ and vLLM accept {list(GROUP_SIZES)}")
    bpw = options.get("bpw")
    if bpw is not None and not BPW_RANGE[0] <= bpw <= BPW_RANGE[1]:
        raise ValueError(f"--bpw {bpw}: {args.method} reaches {BPW_RANGE[0]} to {BPW_RANGE[1]} bits per weight")
    if args.target or args.format == "gguf":
        options, args.format = check_target(args.target or "llama.cpp", args.method, options, args.format)
    if args.format != "gguf":
        check_output(args.out, args.force)
    elif Path(args.out).exists() and not args.force:
        raise ValueError(f"output {args.out} exists; choose another path or pass --force")
    return options


def cmd_quantize(args):
    options = check_quantize_args(args)
    corpus, model = setup(args)
    if args.format == "gguf":
        METHODS[args.method].quantize(model, corpus.calibration(), **options)
        log(f"wrote {args.out}: {json.dumps(write_gguf(model, args.out, force=args.force))}")
        return
    qcfg = save_quantized(model, args.out, args.method, corpus.calibration(), force=args.force, **options)
    log(f"wrote {args.out}: {json.dumps(qcfg)}")
    if args.target == "vllm":
        log(f"tensor-parallel degrees: {json.dumps(tp_degrees(args.out))}\nserve: {vllm_serve_command(args.out)}")


def cmd_export(args):
    log(f"wrote {args.gguf}: {json.dumps(export_gguf(args.source, args.gguf, force=args.force))}")


def cmd_eval(args):
    read_config(args.directory)                          # a missing or broken checkpoint fails before training
    source = checkpoint_source(args.directory)
    corpus, reference = setup(args)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{args.directory} was quantized from another model (digest {source[:12]}) than this "
                         f"reference ({model_digest(reference)[:12]}, from --steps {args.steps} --seed {args.seed}"
                         f"{' --text ' + args.text if args.text else ''}); give the settings it was made with")
    windows = corpus.eval_windows()
    model = load_quantized(args.directory)
    stats = kl_stats(held_out_logits(reference, windows), evaluate(model, windows, args.impl))
    bits = model_bits(model)
    print(json.dumps({"checkpoint": args.directory, "bits": None if bits is None else round(bits, 3), **stats}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
        p.add_argument("--text", default=None, help="train on this file's bytes (default: built-in corpus)")
        p.add_argument("--seed", type=int, default=0)
        return p

    q = common(sub.add_parser("quantformats", help="the KL table of every format"))
    q.add_argument("--impl", choices=["torch", "engine"], default="torch",
                   help="torch: dequantize + matmul; engine: Triton kernels (interpreted on CPU)")
    q.add_argument("--rows", nargs="*", help="only rows whose label contains one of these substrings")
    t = common(sub.add_parser("train", help="train (or load the cached) tiny Qwen3"))
    t.add_argument("--out", help="also save it as a dense HF checkpoint here")
    t.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    z = common(sub.add_parser("quantize", help="write the trained model as a quantized checkpoint"))
    z.add_argument("--method", required=True)
    z.add_argument("--out", required=True)
    z.add_argument("--group-size", type=int)
    z.add_argument("--act-order", action="store_true", help="gptq: visit columns by decreasing Hessian diagonal")
    z.add_argument("--bpw", type=float, help="entquant: target bits per weight (lambda found by bisection)")
    z.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="any other option of the method's quantize(), e.g. format=nvfp4-pack-quantized, L=8, bps=3")
    z.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    z.add_argument("--target", help="vllm, transformers, llama.cpp or onnx: settings that client loads")
    z.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors")
    x = sub.add_parser("export", help="write a checkpoint folder or .gguf file as a GGUF file")
    x.add_argument("source")
    x.add_argument("--gguf", required=True, metavar="FILE")
    x.add_argument("--force", action="store_true", help="replace FILE if it exists")
    e = common(sub.add_parser("eval", help="KL of a quantized checkpoint against the reference model"))
    e.add_argument("directory")
    e.add_argument("--impl", choices=["torch", "engine"], default="torch")
    args = parser.parse_args(argv)
    if not 1 <= getattr(args, "steps", 1) <= 10 ** 6:
        parser.error("--steps must be >= 1 (and at most 10^6)")
    try:
        {"quantformats": cmd_quantformats, "train": cmd_train, "quantize": cmd_quantize, "eval": cmd_eval,
         "export": cmd_export}[args.command](args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
