"""Command line for the engine. Without --model every command works on the book's tiny Qwen3, trained on bytes (and
cached); with --model PATH (a Hugging Face folder, a quantized checkpoint or a .gguf file) on that model.

  python run.py quantformats   the book's KL table (--rows all: every row; --model PATH: a real model's table)
  python run.py train          train (or load the cached) tiny Qwen3; --out DIR saves it
  python run.py quantize       write a quantized checkpoint: --method NAME --out DIR (or FILE.gguf)
  python run.py eval           KL of a quantized checkpoint against its reference
  python run.py export         a checkpoint folder or .gguf file as one GGUF file
  python run.py generate       continue a prompt

`python run.py COMMAND --help` lists a command's flags. Arguments are checked before anything is loaded; a bad one
is one `error:` line (exit 1); Ctrl-C says what was kept (exit 130).
"""
import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path

# The names argparse shows are literals here, so that --help never imports torch; tests/test_cli.py checks each one
# against the registry (engine.checkpoints.registry.METHODS, ALIASES) and GPTQ's ORDERS (engine.formats.gptq).
METHODS = {
    "rtn": "round to nearest, int4 (or --bits 2), asymmetric, groups of --group-size 64; written as compressed-tensors "
           "pack-quantized (llm-compressor's layout: vLLM, transformers)",
    "gptq": "GPTQ (calibrated, error feedback), AutoGPTQ's v1 layout (transformers, vLLM, llama.cpp's converter)",
    "awq": "AWQ (calibrated scales and clipping), AutoAWQ's GEMM layout",
    "fp8": "FP8 E4M3 with a scale per 128x128 block (Qwen3-FP8 / DeepSeek-V3 layout)",
    "mxfp4": "MXFP4: E2M1 with an E8M0 scale per 32; compressed-tensors mxfp4-pack-quantized",
    "nvfp4": "NVFP4: E2M1 with an E4M3 scale per 16 and one per tensor; compressed-tensors nvfp4-pack-quantized",
    "nf4": "NF4 (QLoRA's NormalFloat4), absmax per 64; bitsandbytes' layout (transformers' load_in_4bit)",
    "bitsandbytes": "the same as nf4 (its registry name)",
    "compressed-tensors": "any compressed-tensors format: --option format=pack-quantized|float-quantized|"
                          "nvfp4-pack-quantized|mxfp4-pack-quantized",
    "trellis": "QTIP-style trellis codes (--option L=8|16, K=2|3, ldlq=true); the engine's own layout",
    "entquant": "EntQuant: Float8 codes + rANS per block at --bpw bits per weight; the engine's own layout",
    "lattice": "HyperQuant: E8/D4/A2/Z lattice codes in Rice streams (--option bps=3, lattice=E8); the engine's own",
}
GPTQ_ORDERS = {
    "natural": "columns 0, 1, 2, ... (the paper's)",
    "act_order": "by decreasing Hessian diagonal, groups follow the visit: AutoGPTQ's desc_act=True file (g_idx "
                 "permuted; vLLM refuses it)",
    "act_order_static": "the same visit, each group a range of original columns fixed before the loop: a plain "
                        "file (the default)",
    "group_aware": "groups by decreasing Hessian diagonal, columns in order inside (GPTQModel's GAR)",
    "group_aware_sum": "the same, groups ranked by their total Hessian diagonal",
    "group_aware_reference": "GPTQModel's default reproduced exactly",
}
TARGETS = ("vllm", "transformers", "llama.cpp", "onnx")
GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)    # what GPTQModel's QuantizeConfig accepts
BPW_RANGE = (1.5, 6.0)                                  # EntQuant's lambda search, from the shipped table
SMALL_MODEL = 2 << 30                                   # bytes on disk: generate runs a smaller model on one thread


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def bar(iterable=None, **kwargs):
    """A tqdm progress bar on stderr (on a terminal; silent when stderr is a file)."""
    from tqdm import tqdm
    return tqdm(iterable, disable=None, dynamic_ncols=True, **kwargs)


def clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def model_bits(model):
    from engine.formats.base import quantized_linears
    layers = quantized_linears(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return sum(layer.storage_bits() for layer in layers) / weights if weights else None


def tiny_setup(args):
    """The byte corpus and the tiny Qwen3 trained on it (cached)."""
    from engine.data import Corpus, load_corpus
    from engine.qwen3 import Qwen3Config
    from engine.training import TrainConfig, trained_model
    corpus = Corpus.from_bytes(load_corpus(args.text))
    return corpus, trained_model(Qwen3Config(), corpus, TrainConfig(steps=args.steps, seed=args.seed))


# ---- cheap checks, before anything is loaded ----------------------------------------------------------------------

def check_model_path(path, flag="--model"):
    """A model the engine can read: a folder holding config.json, or a .gguf file; says which part is missing."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{flag} {path}: no such file or folder")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{flag} {path}: a file must be a .gguf model; a Hugging Face model is a folder "
                             "(config.json + safetensors)")
        return path
    if not path.is_dir():
        raise ValueError(f"{flag} {path}: not a regular file or folder")
    if not (path / "config.json").exists():
        raise ValueError(f"{flag} {path}: the folder has no config.json (not a Hugging Face model folder)")
    from engine.checkpoints.loaders import read_config
    read_config(path)
    return path


def check_text(path, flag="--text"):
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"{flag} {p} is a folder; give a text file")
        if not p.is_file():
            raise ValueError(f"{flag} {p}: no such file")


def check_output(out, force):
    from engine.checkpoints.safe_writes import check_output as check
    check(out, force, override="--force")


def check_file_output(path, force, flag="--out"):
    """One output file (GGUF): not a folder, not an existing file unless --force, in a folder that exists."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; a GGUF output is one file ({flag} FILE.gguf)")
    if path.exists() and not force:
        raise ValueError(f"{flag} {path} exists; choose another path or pass --force")
    if not path.resolve().parent.is_dir():
        raise ValueError(f"{flag} {path}: no folder {path.resolve().parent} to write it into")


# ---- quantformats -----------------------------------------------------------------------------------------------

def quantize_row(row, model, calibration):
    """Quantize a copy-to-be of the model for one table row; returns the K/V quantizer of a KV-cache row."""
    if row.kv_cache:
        return row.quantize(model, **row.options)
    row.quantize(model, calibration, **row.options)
    return None


def evaluate(model, windows, impl_name):
    from engine.evaluation import held_out_logits
    from engine.formats.base import decoded_weights, impl
    with impl(impl_name), decoded_weights(model):
        return held_out_logits(model, windows)


class RowProgress:
    """'row k of N' before each row, with the elapsed time and an ETA: the rows still to run, weighted by how long
    each took on two idle cores (tables.expected_seconds), at the pace this run has shown so far."""

    def __init__(self, rows):
        from engine import tables
        self.rows, self.cost = rows, [tables.expected_seconds(r) for r in rows]
        self.start, self.done = time.time(), 0

    def begin(self, k):
        elapsed = time.time() - self.start
        pace = elapsed / sum(self.cost[:k]) if k else 1.0
        eta = f", ETA ~{clock(pace * sum(self.cost[k:]))}" + ("" if k else " (on idle cores)")
        log(f"row {k + 1} of {len(self.rows)}: {self.rows[k].label} (elapsed {clock(elapsed)}{eta})")


def cmd_quantformats(args):
    from engine import tables
    rows = tables.rows() if args.model is None else tables.real_model_rows()
    book = args.rows is None and args.model is None
    selected = tables.book_rows() if book else rows if args.rows in (None, ["all"]) else tables.select(rows, args.rows)
    if args.plot:
        tables.check_plot(args.plot)
    check_text(args.text)
    if args.model is not None:
        check_model_path(args.model)
        check_text(args.calib, "--calib")
        return quantformats_real(args, selected)
    import torch
    from engine.evaluation import held_out_logits, kl_stats, perplexity
    if book:
        log(f"the book's table: {len(selected)} rows (--rows all: all {len(rows)})")
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
    progress = RowProgress(selected)
    try:
        for k, row in enumerate(selected):
            progress.begin(k)
            start = time.time()
            model = reference_copy(reference)
            kv = quantize_row(row, model, calibration)
            stats = kl_stats(ref_logits, evaluate(model, windows, args.impl))
            bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
            result = {"format": row.label, "bits": round(bits, 2),
                      **{k: round(v, 6 if k.startswith("kl") else 2) for k, v in stats.items()},
                      **({"weights": "dense"} if row.kv_cache else {}), "seconds": round(time.time() - start, 1)}
            results.append(result)
            print(json.dumps(result), flush=True)
    except KeyboardInterrupt:
        print(f"\n{tables.markdown(results)}\n\n(interrupted: {len(results) - 1} of {len(selected)} rows)", flush=True)
        raise
    print()
    print(tables.markdown(results))
    plot(args, results[1:])
    log(f"impl={args.impl}: training/cache {t_trained - t0:.1f} s, {len(selected)} rows {time.time() - t_trained:.1f} s")


def reference_copy(model):
    import copy
    return copy.deepcopy(model)


def quantformats_real(args, selected):
    """The table on a real model: llama.cpp's statistics against the model itself (a GGUF model's dequantized
    weights), on held-out text the calibration never saw; each row's time and peak resident memory."""
    import torch
    from engine import tables
    from engine.checkpoints.registry import load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.data import Corpus, load_corpus
    from engine.evaluation import ReferenceLogits, compare_models, markdown_table
    path = Path(args.model)
    tokenizer = load_tokenizer(path)
    corpus = Corpus.from_text(load_corpus(args.text), tokenizer)
    chunks = corpus.eval_chunks(args.ctx, args.chunks)
    calibration = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
    log(f"loading {path.name} ...")
    reference = load_model(path, torch.float32, dense=True)
    log(f"{path.name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f} M parameters; "
        f"{len(chunks)} chunks of {args.ctx} held-out tokens, {tuple(calibration.shape)} calibration tokens")
    ref_logits = ReferenceLogits(reference, chunks)
    results, progress = [], RowProgress(selected)
    try:
        for k, row in enumerate(selected):
            progress.begin(k)
            with tables.MemoryWatch() as memory:
                start = time.time()
                model = reference_copy(reference)
                try:
                    kv = quantize_row(row, model, calibration)
                except ValueError as e:             # this model's shapes do not fit the format: say so, go on
                    results.append({"format": row.label, "error": str(e)})
                    print(json.dumps(results[-1]), flush=True)
                    log(f"{row.label}: {e}")
                    continue
                seconds = time.time() - start
                stats = compare_models(ref_logits, model, chunks, impl=args.impl,
                                       progress=lambda it: bar(it, desc="evaluating", unit="chunk", leave=False))
            bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
            result = {"format": row.label, "bits": round(bits, 3), **stats, "seconds": round(seconds, 1),
                      "peak_rss_gb": round(memory.peak / 1e9, 2)}
            results.append(result)
            print(json.dumps(result), flush=True)
            del model
    except KeyboardInterrupt:
        print(f"\n{markdown_table(results, label='format')}\n\n(interrupted: {len(results)} of {len(selected)} rows)",
              flush=True)
        raise
    print()
    print(markdown_table(results, label="format"))
    plot(args, [r for r in results if "error" not in r])


def plot(args, results):
    if args.plot:
        from engine import tables
        tables.plot_rate_distortion(results, args.plot, title=Path(args.model).name if args.model else "tiny Qwen3")
        log(f"wrote {args.plot}")


# ---- train ------------------------------------------------------------------------------------------------------

def cmd_train(args):
    check_text(args.text)
    if args.out:
        check_output(args.out, args.force)
    _, model = tiny_setup(args)
    if args.out:
        from engine.checkpoints.loaders import save_dense
        from engine.checkpoints.tokenizer import export_tokenizer
        save_dense(model, args.out, force=args.force, side_files=lambda folder: export_tokenizer(None, folder))
        log(f"saved {args.out}")


# ---- quantize ---------------------------------------------------------------------------------------------------

def quantize_options(args):
    """--option KEY=VALUE and the named flags -> {keyword: value} for the method, each value parsed by the type of
    that keyword's default; unknown keywords and values of the wrong type are errors."""
    from engine.checkpoints.registry import method_options
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
    flags = (("bits", getattr(args, "bits", None)), ("group_size", args.group_size), ("order", args.order),
             ("bpw", args.bpw))
    for key, value in flags:
        if value is not None:
            if key not in accepted:
                flag = f"--{key.replace('_', '-')}"
                raise ValueError(f"{flag} does not apply to --method {args.method}; it takes "
                                 f"{list(accepted) or 'no options'}")
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
    """Everything about `quantize` that can be checked without loading a model: (registry method, options)."""
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {sorted(METHODS)}, got {args.method!r}")
    check_text(args.text)
    if args.model is not None:
        check_model_path(args.model)
        check_text(args.calib, "--calib")
    from engine.checkpoints.registry import resolve
    options = quantize_options(args)
    group = options.get("group_size")
    if args.method in ("gptq", "awq", "compressed-tensors", "rtn") and group is not None and group not in GROUP_SIZES:
        raise ValueError(f"--group-size {group}: GPTQModel, AutoAWQ and vLLM accept {list(GROUP_SIZES)}")
    if args.method == "rtn" and group == -1:
        raise ValueError("--group-size -1: rtn takes a positive group size (compressed-tensors' per-row "
                         "strategy is --method compressed-tensors)")
    bpw = options.get("bpw")
    if bpw is not None and not BPW_RANGE[0] <= bpw <= BPW_RANGE[1]:
        raise ValueError(f"--bpw {bpw}: {args.method} reaches {BPW_RANGE[0]} to {BPW_RANGE[1]} bits per weight")
    method, options = resolve(args.method, options)
    if args.target or args.format == "gguf":
        from engine.checkpoints.serving import check_target
        options, args.format = check_target(args.target or "llama.cpp", method, options, args.format)
    if args.format == "gguf":
        check_file_output(args.out, args.force)
    else:
        check_output(args.out, args.force)
    return method, options


def cmd_quantize(args):
    method, options = check_quantize_args(args)
    from engine.checkpoints.registry import METHODS as REGISTRY
    from engine.checkpoints.registry import save_quantized
    from engine.checkpoints.tokenizer import export_tokenizer
    started = time.time()
    if args.model is None:
        corpus, model = tiny_setup(args)
        log(f"quantizing the tiny model with {args.method} ...")
        if args.format == "gguf":
            from engine.checkpoints.gguf_writer import write_gguf
            REGISTRY[method].quantize(model, corpus.calibration(), **options)
            report = write_gguf(model, args.out, force=args.force)
            log(f"wrote {args.out}: {json.dumps(report)}")
            return summarize_output(args.out, model_bits(model), started)
        qcfg = save_quantized(model, args.out, method, corpus.calibration(), force=args.force,
                              side_files=lambda folder: export_tokenizer(None, folder), **options)
    else:
        from engine.checkpoints.serving import export_gguf
        from engine.checkpoints.streaming import quantize_checkpoint
        ids = None
        if REGISTRY[method].calibration(options):
            from engine.checkpoints.tokenizer import load_tokenizer
            from engine.data import Corpus, load_corpus
            log("tokenizing the calibration text ...")
            corpus = Corpus.from_text(load_corpus(args.calib), load_tokenizer(args.model))
            ids = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
        if args.format == "gguf":   # layer by layer into a folder of ours beside FILE, then one GGUF from it
            import tempfile
            with tempfile.TemporaryDirectory(dir=Path(args.out).resolve().parent, prefix=".gguf-") as tmp:
                quantize_checkpoint(args.model, Path(tmp) / "ck", method, ids, **options)
                report = export_gguf(Path(tmp) / "ck", args.out, force=args.force)
            log(f"wrote {args.out}: {json.dumps(report)}")
            return summarize_output(args.out, None, started)
        qcfg = quantize_checkpoint(args.model, args.out, method, ids, force=args.force, **options)
    log(f"wrote {args.out}: {json.dumps(qcfg)}")
    summarize_output(args.out, None, started)
    if args.target == "vllm":
        from engine.checkpoints.serving import tp_degrees, vllm_serve_command
        log(f"tensor-parallel degrees: {json.dumps(tp_degrees(args.out))}\nserve: {vllm_serve_command(args.out)}")


def summarize_output(out, bits, started):
    """The human line after a checkpoint is written: bits per quantized weight, the files' size, the time."""
    from engine.checkpoints.registry import checkpoint_bits
    out = Path(out)
    files = [out] if out.is_file() else [p for p in out.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    if out.is_dir():                                     # what the files hold (f32 scales, packed zero points ...)
        bits = checkpoint_bits(out)
    per = f"{bits:.3f} bits per quantized weight (every stored bit of the quantized linears), " if bits else ""
    log(f"summary: {per}{size / 1e6:.1f} MB in {len(files)} file(s), {clock(time.time() - started)}")


# ---- export, eval, generate -------------------------------------------------------------------------------------

def cmd_export(args):
    source = Path(args.source)
    if source.is_file() and source.suffix == ".gguf":
        pass
    elif not source.exists():
        raise ValueError(f"SOURCE {source}: no such file or folder")
    else:
        check_model_path(source, "SOURCE")
    check_file_output(args.gguf, args.force, "--gguf")
    from engine.checkpoints.serving import export_gguf
    log(f"loading {source} ...")
    log(f"wrote {args.gguf}: {json.dumps(export_gguf(args.source, args.gguf, force=args.force))}")


def cmd_eval(args):
    if args.model is not None or args.quantized is not None:
        return eval_real(args)
    if args.checkpoint is None:
        raise ValueError("give a checkpoint of the tiny model (a folder or .gguf file), or --model REF --quantized Q")
    check_model_path(args.checkpoint, "CHECKPOINT")
    check_text(args.text)
    from engine.checkpoints.loaders import checkpoint_source, model_digest
    from engine.checkpoints.registry import load_model
    from engine.evaluation import held_out_logits, kl_stats
    path = Path(args.checkpoint)
    source = checkpoint_source(path) if path.is_dir() else None   # a missing or broken checkpoint fails here
    corpus, reference = tiny_setup(args)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{path} was quantized from another model (digest {source[:12]}) than this reference "
                         f"({model_digest(reference)[:12]}, from --steps {args.steps} --seed {args.seed}"
                         f"{' --text ' + args.text if args.text else ''}); give the settings it was made with")
    windows = corpus.eval_windows()
    model = load_model(path)
    stats = kl_stats(held_out_logits(reference, windows), evaluate(model, windows, args.impl))
    bits = model_bits(model)
    print(json.dumps({"checkpoint": str(path), "bits": None if bits is None else round(bits, 3), **stats}))
    log(f"summary: KL {stats['kl_nats']:.5f} ± {stats['kl_stderr']:.5f} nats per byte (p99 {stats['kl_p99']:.4f}), "
        f"same top byte {stats['same_top_pct']:.1f}%" + (f", {bits:.3f} bits per weight" if bits else ""))


def eval_real(args):
    if args.model is None or args.quantized is None:
        raise ValueError("eval needs both --model REF and --quantized Q")
    ref_path, q_path = check_model_path(args.model), check_model_path(args.quantized, "--quantized")
    check_text(args.text)
    import torch
    from engine.checkpoints.loaders import checkpoint_source, model_digest
    from engine.checkpoints.registry import load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.data import Corpus, load_corpus
    from engine.evaluation import compare_models, markdown_table
    corpus = Corpus.from_text(load_corpus(args.text), load_tokenizer(ref_path))
    chunks = corpus.eval_chunks(args.ctx, args.chunks)                  # short text fails before any model loads
    source = checkpoint_source(q_path) if q_path.is_dir() else None
    log(f"loading {ref_path} ...")
    reference = load_model(ref_path, torch.float32, dense=True)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{q_path} was quantized from another model (digest {source[:12]}) than {ref_path} "
                         f"({model_digest(reference)[:12]})")
    log(f"loading {q_path} ...")
    quantized = load_model(q_path)
    bits = model_bits(quantized)
    from engine.formats.base import decoded_weights
    with decoded_weights(quantized):
        stats = compare_models(reference, quantized, chunks, impl=args.impl,
                               progress=lambda it: bar(it, desc="evaluating", unit="chunk"))
    result = {"reference": str(ref_path), "quantized": str(q_path), "bits": bits and round(bits, 3), **stats}
    print(json.dumps(result))
    print(markdown_table([{**result, "model": q_path.name}]))
    log(f"summary: KL {stats['kl_nats']:.4f} ± {stats['kl_stderr']:.4f} nats per token (p99 "
        f"{stats['kl_p99']:.3f}), perplexity {stats['ppl']:.2f} vs {stats['ppl_ref']:.2f} for the reference, same top "
        f"token {stats['same_top_pct']:.1f}%, on {stats['positions']} positions"
        + (f"; {bits:.3f} bits per quantized weight" if bits else ""))


def cmd_generate(args):
    if not args.prompt:
        raise ValueError("--prompt is empty")
    check_text(args.text)
    if args.model is not None:
        check_model_path(args.model)
    import torch
    from engine.checkpoints.tokenizer import encode, load_tokenizer
    from engine.formats.base import decoded_weights, impl
    started = time.time()
    # A small model's ops (and at batch 1 any model's steps are small) are too small to share between threads:
    # they only wait on each other, 4-10x slower on a loaded 2-core machine (measured); a big model's weights need
    # every core's memory bandwidth. Small: under SMALL_MODEL bytes on disk.
    threads = torch.get_num_threads()
    if args.model is not None and model_bytes(args.model) < SMALL_MODEL:
        torch.set_num_threads(1)
    if args.model is None:
        _, model = tiny_setup(args)                       # (training, when not cached, on every thread)
        tokenizer = load_tokenizer(None)                  # bytes
        torch.set_num_threads(1)
    else:
        from engine.checkpoints.registry import load_model
        tokenizer = load_tokenizer(args.model)
        log(f"loading {args.model} ...")
        model = load_model(args.model, progress=lambda it, total: bar(it, total=total, desc="loading",
                                                                      unit="tensor", leave=False))
    ids = encode(tokenizer, args.prompt.encode("utf-8"))[None]
    if ids.numel() == 0:
        raise ValueError("--prompt is empty")
    loaded = time.time()
    generator = torch.Generator().manual_seed(args.seed)
    state = {"first": None, "new": []}

    def show(token):                                   # each token as it comes (whole UTF-8 characters)
        state["first"] = state["first"] or time.time()
        state["new"].append(int(token[0, 0]))
        text = spell(tokenizer, state["new"])
        sys.stdout.buffer.write(text[state.get("shown", 0):])
        sys.stdout.buffer.flush()
        state["shown"] = len(text)

    try:
        with impl(args.impl), decoded_weights(model, progress=lambda it: bar(it, desc="decoding weights",
                                                                                unit="layer", leave=False)) as kept:
            decoded = time.time()
            model.generate(ids, args.max_new_tokens, args.temperature, generator, on_token=show)
    finally:
        torch.set_num_threads(threads)
    sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    done = time.time()
    n = len(state["new"])
    log(f"load {loaded - started:.1f} s, " + (f"decode weights {decoded - loaded:.1f} s, " if kept else "")
        + f"first token {state['first'] - decoded:.2f} s after that, {n} tokens in {done - decoded:.1f} s "
        f"({n / max(done - decoded, 1e-9):.1f} tokens/s)")


def model_bytes(path):
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))


def spell(tokenizer, ids):
    """The bytes ids spell: exact for a byte-level vocabulary, the tokenizer's own decoder otherwise; an incomplete
    UTF-8 character at the end is held back until its last byte arrives."""
    from engine.checkpoints.tokenizer import token_bytes
    try:
        text = token_bytes(tokenizer, ids)
    except ValueError:                                   # a SentencePiece-style vocabulary: its own decoder
        return tokenizer.decode(ids).rstrip("\ufffd").encode("utf-8")
    for cut in range(min(3, len(text)), 0, -1):          # hold back a partial character (at most 3 bytes)
        try:
            text[len(text) - cut:].decode("utf-8")
            break
        except UnicodeDecodeError:
            if text[len(text) - cut] >> 6 == 0b11:       # the lead byte of the unfinished character
                return text[:len(text) - cut]
    return text


# ---- the parser -------------------------------------------------------------------------------------------------

def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help, description):
        return sub.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def tiny(p, text_use, seed_use="training seed (default 0): same seed, same model"):
        g = p.add_argument_group("the tiny model (used when there is no --model)")
        g.add_argument("--steps", type=int, default=300,
                       help="training steps (default 300; the trained model is cached in ~/.cache/engine or "
                            "$ENGINE_CACHE, keyed by corpus, steps and seed)")
        g.add_argument("--seed", type=int, default=0, help=seed_use)
        p.add_argument("--text", metavar="FILE", help=text_use)

    def model(p, what="the model"):
        p.add_argument("--model", metavar="PATH", help=f"{what}: a Hugging Face folder (config.json + safetensors), "
                                                       "a quantized checkpoint folder or a .gguf file (default: the "
                                                       "book's tiny Qwen3)")

    def impl(p):
        p.add_argument("--impl", choices=["torch", "engine"], default="torch",
                       help="how quantized layers compute: torch (decode the weights, then one matmul: the "
                            "reference, default) or engine (each layer's Triton kernel; interpreted on a CPU, slow)")

    def real_eval(p):
        g = p.add_argument_group("a real model's evaluation (with --model)")
        g.add_argument("--ctx", type=int, default=512, help="tokens per held-out chunk (default 512)")
        g.add_argument("--chunks", type=int, default=8, help="held-out chunks to score (default 8)")

    def calib(p):
        g = p.add_argument_group("calibration of a real model (with --model; GPTQ, AWQ, BlockLDLQ, EntQuant feedback)")
        g.add_argument("--calib", metavar="FILE", help="calibration text (default: the training part of the built-in "
                                                       "corpus, Python's own reference text)")
        g.add_argument("--calib-samples", type=int, default=32, help="calibration sequences (default 32)")
        g.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence (default 512)")

    q = command("quantformats", "the KL table of every format",
                "Quantize the model every way and print one JSON line per row as it finishes, then a markdown table. "
                "The default is the book's table on the tiny model (its 10 rows in the book's order, then EntQuant, "
                "a lattice and a KV-cache row); --rows all gives every row.")
    model(q, "measure this model's table instead")
    tiny(q, "the text: the tiny model trains on its bytes; a real model's held-out evaluation text "
            "(default: the built-in corpus)")
    impl(q)
    q.add_argument("--rows", nargs="+", metavar="SUBSTR",
                   help="'all' for every row, or only the rows whose label contains one of these substrings "
                        "(case-insensitive), e.g. --rows GPTQ NVFP4 \"KV cache\"")
    q.add_argument("--plot", metavar="FILE.png", help="also draw KL against bits per weight (needs matplotlib)")
    real_eval(q)
    calib(q)

    t = command("train", "train (or load the cached) tiny Qwen3", "Train the book's tiny Qwen3 on bytes (cached).")
    tiny(t, "train on this file's bytes (default: the built-in corpus)")
    t.add_argument("--out", metavar="DIR", help="also save it as a dense Hugging Face checkpoint folder here")
    t.add_argument("--force", action="store_true", help="replace --out even if it holds files that are not an "
                                                        "engine checkpoint")

    methods = "\n".join(textwrap.fill(text, 116, initial_indent=f"  {name:19s} ", subsequent_indent=" " * 22)
                        for name, text in METHODS.items())
    z = command("quantize", "write a quantized checkpoint",
                "Write a quantized checkpoint. With --model the model is quantized layer by layer from disk, in "
                "bounded memory, and a killed run resumes when run again with the same arguments.\n\nmethods:\n"
                + methods)
    model(z, "quantize this model")
    z.add_argument("--method", required=True, metavar="NAME", help=f"one of: {', '.join(METHODS)} (see above)")
    z.add_argument("--out", required=True, metavar="DIR",
                   help="the checkpoint folder to write (a FILE.gguf with --format gguf or --target llama.cpp)")
    z.add_argument("--bits", type=int, help="rtn, gptq, compressed-tensors: bits per code (rtn: 4 or 2; gptq: 2, 3, "
                                            "4 or 8; default 4)")
    z.add_argument("--group-size", type=int, metavar="G",
                   help=f"weights per scale group: rtn / gptq / awq / compressed-tensors one of {list(GROUP_SIZES)} "
                        "(-1: one group per row; default 64, gptq / awq 128), nf4 a power of two 32..4096 "
                        "(default 64)")
    orders = "; ".join(f"{name}: {text}" for name, text in GPTQ_ORDERS.items())
    z.add_argument("--order", metavar="ORDER", help=f"gptq's column order, one of {', '.join(GPTQ_ORDERS)} or "
                                                    f"search (the best of three per linear). {orders}")
    z.add_argument("--bpw", type=float, metavar="B", help=f"entquant: target bits per weight, {BPW_RANGE[0]} to "
                                                          f"{BPW_RANGE[1]} (lambda found by bisection)")
    z.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="any other option of the method (repeatable), e.g. sym=true (gptq), format=nvfp4-pack-"
                        "quantized (compressed-tensors), L=16 (trellis), bps=3 (lattice); an unknown key is an "
                        "error that lists the method's options")
    z.add_argument("--target", choices=TARGETS, help="pick the settings this client loads, and refuse (before any "
                                                     "work) what it cannot; llama.cpp writes a GGUF file")
    z.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                   help="safetensors: a Hugging Face checkpoint folder (default); gguf: one llama.cpp file")
    z.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    tiny(z, "the tiny model trains on this file's bytes (with --model it is not used: see --calib)")
    calib(z)

    x = command("export", "write a checkpoint folder or .gguf file as one GGUF file",
                "Write a checkpoint folder or .gguf file as one GGUF file, its quantized layers in their GGML types.")
    x.add_argument("source", metavar="SOURCE", help="a checkpoint folder (dense or quantized) or a .gguf file")
    x.add_argument("--gguf", required=True, metavar="FILE", help="the GGUF file to write")
    x.add_argument("--force", action="store_true", help="replace FILE if it exists")

    e = command("eval", "KL of a quantized checkpoint against its reference",
                "KL of a quantized checkpoint against its reference. A tiny-model checkpoint: eval CHECKPOINT (the "
                "reference is the cached tiny model of --steps / --seed / --text). A real model: eval --model REF "
                "--quantized Q, llama.cpp's perplexity --kl-divergence statistics on held-out chunks.")
    e.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="a checkpoint of the tiny model: a folder or a .gguf file")
    model(e, "the reference model")
    e.add_argument("--quantized", metavar="Q", help="with --model REF: the quantized model (folder or .gguf file)")
    tiny(e, "the tiny model's training text (it must be the one the checkpoint was made from); a real model's "
            "held-out evaluation text (default: the built-in corpus)")
    impl(e)
    real_eval(e)

    g = command("generate", "continue a prompt", "Continue a prompt with the model's own tokenizer, printing each "
                                                 "token as it comes.")
    model(g)
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy (default); above 0: sample from softmax(logits / T)")
    tiny(g, "the tiny model's training text (default: the built-in corpus)",
         "the sampling seed, and the tiny model's training seed (default 0)")
    impl(g)
    return parser


def check_numbers(parser, args):
    if not 1 <= getattr(args, "steps", 1) <= 10 ** 6:
        parser.error("--steps must be >= 1 (and at most 10^6)")
    for name in ("ctx", "chunks", "calib_samples", "calib_len", "max_new_tokens"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "temperature", 0.0) < 0 or not math.isfinite(getattr(args, "temperature", 0.0)):
        parser.error("--temperature must be a finite number >= 0")


def interrupted(args):
    """The one line Ctrl-C prints: what was kept, and how to go on."""
    if args.command == "quantize" and args.model is not None and args.format != "gguf":
        out = Path(args.out)
        return (f"interrupted: the layers written so far are kept in {out.parent / f'.{out.name}.partial'}; run the "
                "same command again to resume there")
    if args.command == "quantformats":
        return "interrupted: the rows measured so far are above; --rows SUBSTR ... measures chosen rows"
    if args.command in ("quantize", "export", "train") and (getattr(args, "out", None) or
                                                            getattr(args, "gguf", None)):
        return "interrupted: nothing was written (outputs are swapped in whole when complete); run it again"
    return "interrupted"


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_numbers(parser, args)
    commands = {"quantformats": cmd_quantformats, "train": cmd_train, "quantize": cmd_quantize, "eval": cmd_eval,
                "generate": cmd_generate, "export": cmd_export}
    try:
        commands[args.command](args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    except ModuleNotFoundError as e:                     # argparse ran without them: say what to install
        raise SystemExit(f"error: the Python package {e.name!r} is not installed here; `pip install torch==2.13.0 "
                         "-e .` in this folder installs what the engine needs")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        log(interrupted(args))
        raise SystemExit(130)


if __name__ == "__main__":
    main()
