"""Command line for the engine. Without --model every command works on the book's tiny Qwen3, trained on bytes (and
cached); with --model PATH (a Hugging Face folder, a quantized checkpoint or a .gguf file) on that model.

  python run.py quantformats [--model PATH] [--text FILE] [--rows SUBSTR ...] [--impl torch|engine] [--plot F.png]
      quantize the model every way and print one JSON line per row as it finishes, then a markdown table
  python run.py train      [--steps 300] [--text FILE] [--seed 0] [--out DIR]       train (cached), save it dense
  python run.py quantize   [--model PATH] --method NAME --out DIR [--group-size G] [--order O] [--bpw B]
                           [--option KEY=VALUE ...] [--calib FILE --calib-samples N --calib-len T] [--force]
                           [--target vllm|transformers|llama.cpp|onnx] [--format safetensors|gguf]
      write a quantized checkpoint (gptq, awq, fp8, compressed-tensors, trellis, entquant, lattice); a --model is
      quantized layer by layer from disk, in bounded memory, resumable; --target picks settings that client loads
      and refuses what it cannot; --format gguf writes one llama.cpp file (--out FILE)
  python run.py export     SOURCE --gguf FILE [--force]        a checkpoint folder or .gguf file as a GGUF file
  python run.py eval       DIR                                      KL of a tiny-model checkpoint vs its reference
  python run.py eval       --model REF --quantized DIR [--text FILE] [--ctx 512] [--chunks N]
      llama.cpp's perplexity --kl-divergence statistics of any quantized model against its reference
  python run.py generate   [--model PATH] --prompt TEXT [--max-new-tokens 64] [--temperature 0]
"""
import argparse
import copy
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import tables
from engine.checkpoints.gguf_writer import write_gguf
from engine.checkpoints.loaders import checkpoint_source, model_digest, read_config, save_dense
from engine.checkpoints.registry import METHODS, load_model, load_quantized, save_quantized
from engine.checkpoints.safe_writes import check_output
from engine.checkpoints.serving import check_target, export_gguf, tp_degrees, vllm_serve_command
from engine.checkpoints.streaming import quantize_checkpoint
from engine.checkpoints.tokenizer import encode, export_tokenizer, load_tokenizer, token_bytes
from engine.data import Corpus, load_corpus
from engine.evaluation import ReferenceLogits, compare_models, held_out_logits, kl_stats, markdown_table, perplexity
from engine.formats.base import impl, quantized_linears
from engine.qwen3 import Qwen3Config
from engine.training import TrainConfig, trained_model

GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)    # what GPTQModel's QuantizeConfig accepts
BPW_RANGE = (1.5, 6.0)                                  # EntQuant's lambda search, from the shipped table


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def model_bits(model):
    layers = quantized_linears(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return sum(layer.storage_bits() for layer in layers) / weights if weights else None


def tiny_setup(args):
    """The byte corpus and the tiny Qwen3 trained on it (cached)."""
    corpus = Corpus.from_bytes(load_corpus(args.text))
    return corpus, trained_model(Qwen3Config(), corpus, TrainConfig(steps=args.steps, seed=args.seed))


def check_model_path(path):
    """A --model that exists and that the engine can read, checked before anything is loaded."""
    path = Path(path)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(f"--model {path}: not a model folder (config.json + safetensors) or a .gguf file")
    if path.is_dir():
        read_config(path)
    return path


def evaluate(model, windows, impl_name):
    with impl(impl_name):
        return held_out_logits(model, windows)


# ---- quantformats -----------------------------------------------------------------------------------------------

def quantize_row(row, model, calibration):
    """Quantize a copy-to-be of the model for one table row; returns the K/V quantizer of a KV-cache row."""
    if row.kv_cache:
        return row.quantize(model, **row.options)
    row.quantize(model, calibration, **row.options)
    return None


def cmd_quantformats(args):
    rows = tables.rows() if args.model is None else tables.real_model_rows()
    selected = tables.select(rows, args.rows)
    if args.plot:
        tables.check_plot(args.plot)
    if args.model is not None:
        return quantformats_real(args, selected)
    t0 = time.time()
    corpus, reference = tiny_setup(args)
    t_trained = time.time()
    windows, calibration = corpus.eval_windows(), corpus.calibration()
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
        kv = quantize_row(row, model, calibration)
        stats = kl_stats(ref_logits, evaluate(model, windows, args.impl))
        bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
        result = {"format": row.label, "bits": round(bits, 2),
                  **{k: round(v, 6 if k.startswith("kl") else 2) for k, v in stats.items()},
                  **({"weights": "dense"} if row.kv_cache else {}), "seconds": round(time.time() - start, 1)}
        results.append(result)
        print(json.dumps(result), flush=True)
    print()
    print(tables.markdown(results))
    plot(args, results[1:])
    log(f"impl={args.impl}: training/cache {t_trained - t0:.1f} s, rows {time.time() - t_trained:.1f} s")


def quantformats_real(args, selected):
    """The table on a real model: llama.cpp's statistics against the model itself (a GGUF model's dequantized
    weights), on held-out text the calibration never saw; each row's time and peak resident memory."""
    path = check_model_path(args.model)
    tokenizer = load_tokenizer(path)
    corpus = Corpus.from_text(load_corpus(args.text), tokenizer)
    chunks = corpus.eval_chunks(args.ctx, args.chunks)
    calibration = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
    reference = load_model(path, torch.float32, dense=True)
    log(f"{path.name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f} M parameters; "
        f"{len(chunks)} chunks of {args.ctx} held-out tokens, {tuple(calibration.shape)} calibration tokens")
    ref_logits = ReferenceLogits(reference, chunks)
    results = []
    for row in selected:
        log(f"quantizing: {row.label}")
        with tables.MemoryWatch() as memory:
            start = time.time()
            model = copy.deepcopy(reference)
            try:
                kv = quantize_row(row, model, calibration)
            except ValueError as e:                 # this model's shapes do not fit the format: say so, go on
                results.append({"format": row.label, "error": str(e)})
                print(json.dumps(results[-1]), flush=True)
                log(f"{row.label}: {e}")
                continue
            seconds = time.time() - start
            stats = compare_models(ref_logits, model, chunks, impl=args.impl)
        bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
        result = {"format": row.label, "bits": round(bits, 3), **stats, "seconds": round(seconds, 1),
                  "peak_rss_gb": round(memory.peak / 1e9, 2)}
        results.append(result)
        print(json.dumps(result), flush=True)
        del model
    print()
    print(markdown_table(results, label="format"))
    plot(args, [r for r in results if "error" not in r])


def plot(args, results):
    if args.plot:
        tables.plot_rate_distortion(results, args.plot, title=Path(args.model).name if args.model else "tiny Qwen3")
        log(f"wrote {args.plot}")


# ---- train, quantize, eval, generate ----------------------------------------------------------------------------

def cmd_train(args):
    if args.out:
        check_output(args.out, args.force)
    _, model = tiny_setup(args)
    if args.out:
        save_dense(model, args.out, force=args.force, side_files=lambda folder: export_tokenizer(None, folder))
        log(f"saved {args.out}")


def method_options(method):
    """{keyword: default} a method takes on the command line: those of its quantize_layer (or quantize)."""
    entry = METHODS[method]
    params = list(inspect.signature(entry.quantize_layer or entry.quantize).parameters.values())[1:]
    return {p.name: p.default for p in params if p.name != "calibration_ids" and p.kind is p.POSITIONAL_OR_KEYWORD}


def quantize_options(args):
    """--option KEY=VALUE and the named flags -> {keyword: value} for the method, each value parsed by the type of
    that keyword's default; unknown keywords and values of the wrong type are errors."""
    accepted = method_options(args.method)
    options = {}
    for text in args.option or []:
        key, sep, value = text.partition("=")
        key = key.replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--option wants KEY=VALUE, got {text!r}")
        if key not in accepted:
            raise ValueError(f"--method {args.method} takes no option {key!r}; it takes {list(accepted)}")
        options[key] = parse_value(key, value, accepted[key])
    flags = (("group_size", args.group_size), ("order", args.order), ("bpw", args.bpw))
    for key, value in flags:
        if value is not None:
            if key not in accepted:
                flag = f"--{key.replace('_', '-')}"
                raise ValueError(f"{flag} does not apply to --method {args.method}; it takes "
                                 f"{list(accepted)}")
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
    if args.model is not None:
        check_model_path(args.model)
        if args.calib is not None and not Path(args.calib).is_file():
            raise ValueError(f"--calib {args.calib}: no such file")
    if args.target or args.format == "gguf":
        options, args.format = check_target(args.target or "llama.cpp", args.method, options, args.format)
    if args.format != "gguf":
        check_output(args.out, args.force)
    elif Path(args.out).is_dir():
        raise ValueError(f"output {args.out} is a directory; --format gguf writes one file (--out FILE.gguf)")
    elif Path(args.out).exists() and not args.force:
        raise ValueError(f"output {args.out} exists; choose another path or pass --force")
    return options


def cmd_quantize(args):
    options = check_quantize_args(args)
    if args.model is None:
        corpus, model = tiny_setup(args)
        if args.format == "gguf":
            METHODS[args.method].quantize(model, corpus.calibration(), **options)
            log(f"wrote {args.out}: {json.dumps(write_gguf(model, args.out, force=args.force))}")
            return
        qcfg = save_quantized(model, args.out, args.method, corpus.calibration(), force=args.force,
                              side_files=lambda folder: export_tokenizer(None, folder), **options)
    else:
        ids = None
        if METHODS[args.method].calibration(options):
            corpus = Corpus.from_text(load_corpus(args.calib), load_tokenizer(args.model))
            ids = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
        if args.format == "gguf":   # layer by layer into a folder of ours beside FILE, then one GGUF from it
            with tempfile.TemporaryDirectory(dir=Path(args.out).resolve().parent, prefix=".gguf-") as tmp:
                quantize_checkpoint(args.model, Path(tmp) / "ck", args.method, ids, **options)
                report = export_gguf(Path(tmp) / "ck", args.out, force=args.force)
            log(f"wrote {args.out}: {json.dumps(report)}")
            return
        qcfg = quantize_checkpoint(args.model, args.out, args.method, ids, force=args.force, **options)
    log(f"wrote {args.out}: {json.dumps(qcfg)}")
    if args.target == "vllm":
        log(f"tensor-parallel degrees: {json.dumps(tp_degrees(args.out))}\nserve: {vllm_serve_command(args.out)}")


def cmd_export(args):
    log(f"wrote {args.gguf}: {json.dumps(export_gguf(args.source, args.gguf, force=args.force))}")


def cmd_eval(args):
    if args.model is not None or args.quantized is not None:
        return eval_real(args)
    if args.directory is None:
        raise ValueError("give a checkpoint DIR of the tiny model, or --model REF --quantized DIR")
    read_config(args.directory)                          # a missing or broken checkpoint fails before training
    source = checkpoint_source(args.directory)
    corpus, reference = tiny_setup(args)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{args.directory} was quantized from another model (digest {source[:12]}) than this "
                         f"reference ({model_digest(reference)[:12]}, from --steps {args.steps} --seed {args.seed}"
                         f"{' --text ' + args.text if args.text else ''}); give the settings it was made with")
    windows = corpus.eval_windows()
    model = load_quantized(args.directory)
    stats = kl_stats(held_out_logits(reference, windows), evaluate(model, windows, args.impl))
    bits = model_bits(model)
    print(json.dumps({"checkpoint": args.directory, "bits": None if bits is None else round(bits, 3), **stats}))


def eval_real(args):
    if args.model is None or args.quantized is None:
        raise ValueError("eval needs both --model REF and --quantized DIR")
    ref_path, q_path = check_model_path(args.model), check_model_path(args.quantized)
    corpus = Corpus.from_text(load_corpus(args.text), load_tokenizer(ref_path))
    chunks = corpus.eval_chunks(args.ctx, args.chunks)                  # short text fails before any model loads
    source = checkpoint_source(q_path) if q_path.is_dir() else None
    reference = load_model(ref_path, torch.float32, dense=True)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{q_path} was quantized from another model (digest {source[:12]}) than {ref_path} "
                         f"({model_digest(reference)[:12]})")
    quantized = load_model(q_path)
    bits = model_bits(quantized)
    stats = compare_models(reference, quantized, chunks, impl=args.impl)
    result = {"reference": str(ref_path), "quantized": str(q_path), "bits": bits and round(bits, 3), **stats}
    print(json.dumps(result))
    print(markdown_table([{**result, "model": q_path.name}]))


def cmd_generate(args):
    if args.model is None:
        _, model = tiny_setup(args)
        tokenizer = load_tokenizer(None)                  # bytes
    else:
        path = check_model_path(args.model)
        model, tokenizer = load_model(path), load_tokenizer(path)
    ids = encode(tokenizer, args.prompt.encode("utf-8"))[None]
    if ids.numel() == 0:
        raise ValueError("--prompt is empty")
    generator = torch.Generator().manual_seed(args.seed)
    with impl(args.impl):
        out = model.generate(ids, args.max_new_tokens, args.temperature, generator)
    new = out[0, ids.shape[1]:].tolist()
    try:
        text = token_bytes(tokenizer, new)                # exact bytes of a byte-level vocabulary
    except ValueError:                                    # a SentencePiece-style one: its own decoder
        text = tokenizer.decode(new).encode("utf-8")
    sys.stdout.buffer.write(text + b"\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, impl_option=True):
        p.add_argument("--model", help="a model folder, quantized checkpoint or .gguf file (default: the tiny Qwen3)")
        p.add_argument("--steps", type=int, default=300, help="tiny model: training steps (default 300)")
        p.add_argument("--text", default=None, help="tiny model: train on this file's bytes; real model: held-out "
                                                    "text for evaluation (default: the built-in corpus)")
        p.add_argument("--seed", type=int, default=0)
        if impl_option:
            p.add_argument("--impl", choices=["torch", "engine"], default="torch",
                           help="torch: dequantize + matmul; engine: Triton kernels (interpreted on CPU)")
        return p

    def chunks(p):
        p.add_argument("--ctx", type=int, default=512, help="real model: tokens per evaluation chunk (512)")
        p.add_argument("--chunks", type=int, default=8, help="real model: held-out chunks to score (8)")
        return p

    def calib(p):
        p.add_argument("--calib", help="real model: calibration text (default: the built-in corpus' training part)")
        p.add_argument("--calib-samples", type=int, default=32, help="calibration sequences (32)")
        p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence (512)")
        return p

    q = calib(chunks(common(sub.add_parser("quantformats", help="the KL table of every format"))))
    q.add_argument("--rows", nargs="*", help="only rows whose label contains one of these substrings")
    q.add_argument("--plot", help="also draw KL against bits per weight into this .png (needs matplotlib)")
    t = common(sub.add_parser("train", help="train (or load the cached) tiny Qwen3"), impl_option=False)
    t.add_argument("--out", help="also save it as a dense HF checkpoint here")
    t.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    z = calib(common(sub.add_parser("quantize", help="write a quantized checkpoint"), impl_option=False))
    z.add_argument("--method", required=True)
    z.add_argument("--out", required=True)
    z.add_argument("--group-size", type=int)
    z.add_argument("--order", help="gptq: the column order, one of natural, act_order (AutoGPTQ's desc_act=True "
                   "file: g_idx permuted, vLLM refuses it), act_order_static (the default: the same visit, a plain "
                   "file), group_aware, group_aware_sum, group_aware_reference (GPTQModel's default) or search (the "
                   "best of three per linear)")
    z.add_argument("--bpw", type=float, help="entquant: target bits per weight (lambda found by bisection)")
    z.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="any other option of the method, e.g. format=nvfp4-pack-quantized, L=8, bps=3, sym=true")
    z.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    z.add_argument("--target", help="vllm, transformers, llama.cpp or onnx: settings that client loads")
    z.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors")
    x = sub.add_parser("export", help="write a checkpoint folder or .gguf file as a GGUF file")
    x.add_argument("source")
    x.add_argument("--gguf", required=True, metavar="FILE")
    x.add_argument("--force", action="store_true", help="replace FILE if it exists")
    e = chunks(common(sub.add_parser("eval", help="KL of a quantized checkpoint against its reference model")))
    e.add_argument("directory", nargs="?", help="a checkpoint of the tiny model")
    e.add_argument("--quantized", help="with --model REF: the quantized model (folder or .gguf)")
    g = common(sub.add_parser("generate", help="continue a prompt (greedy, or sampled with --temperature)"))
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    if not 1 <= getattr(args, "steps", 1) <= 10 ** 6:
        parser.error("--steps must be >= 1 (and at most 10^6)")
    for name in ("ctx", "chunks", "calib_samples", "calib_len", "max_new_tokens"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "temperature", 0.0) < 0 or not math.isfinite(getattr(args, "temperature", 0.0)):
        parser.error("--temperature must be a finite number >= 0")
    commands = {"quantformats": cmd_quantformats, "train": cmd_train, "quantize": cmd_quantize, "eval": cmd_eval,
                "generate": cmd_generate, "export": cmd_export}
    try:
        commands[args.command](args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
