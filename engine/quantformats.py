"""`run.py quantformats`: quantize a copy of the model for every row of engine/tables.py, measure it, print it.

The tiny model's table (tiny_table): KL(P_ref || P_quant) per held-out byte; a real model's (real_table):
llama.cpp's --kl-divergence statistics on held-out chunks, with each row's time and peak memory. Each row is
announced as "row k of N" with an ETA (RowProgress), printed as a JSON line when it finishes, and the markdown table
comes at the end, or at Ctrl-C with the rows finished so far.
"""
import copy
import json
import time
from pathlib import Path

import torch

from .checkpoints.models import load_model
from .checkpoints.tokenizer import load_tokenizer
from .console import bar, clock, log
from .data import real_calibration, text_corpus
from .evaluation import ReferenceLogits, compare_models, held_out_logits, kl_stats, markdown_table, perplexity
from . import tables
from .layers import decoded_weights, impl, model_bits
from .tables import expected_seconds
from .training import tiny_setup


def quantize_row(row, model, calibration):
    """Quantize a copy-to-be of the model for one table row; returns the K/V quantizer of a KV-cache row."""
    if row.kv_cache:
        return row.quantize(model, **row.options)
    row.quantize(model, calibration, **row.options)
    return None


def evaluate(model, windows, impl_name):
    """Logits of the held-out windows, every quantized layer decoded once (torch) or through its kernel (engine)."""
    with impl(impl_name), decoded_weights(model):
        return held_out_logits(model, windows)


class RowProgress:
    """'row k of N' before each row, with the elapsed time and an ETA: the rows still to run, weighted by how long
    each took on two idle cores (expected_seconds), at the pace this run has shown so far."""

    def __init__(self, rows):
        self.rows, self.cost = rows, [expected_seconds(r) for r in rows]
        self.start = time.time()

    def begin(self, k):
        elapsed = time.time() - self.start
        pace = elapsed / sum(self.cost[:k]) if k else 1.0
        eta = f", ETA ~{clock(pace * sum(self.cost[k:]))}" + ("" if k else " (on idle cores)")
        log(f"row {k + 1} of {len(self.rows)}: {self.rows[k].label} (elapsed {clock(elapsed)}{eta})")


def tiny_table(args, selected, book, n_all):
    """The table on the tiny byte model: KL per held-out byte against the trained model, one JSON line per row as it
    finishes, then the markdown table (also when interrupted: the rows finished so far)."""
    if book:
        log(f"the book's table: {len(selected)} rows (--rows all: all {n_all})")
    t0 = time.time()
    corpus, reference = tiny_setup(args.text, args.steps, args.seed)
    reference = reference.to(getattr(torch, args.reference_dtype))
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
            model = copy.deepcopy(reference)
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


def kv_scored(model, args):
    """The model, or with --kv-cache SPEC the model read through a fresh stored KV cache per chunk (a prefill)."""
    if args.kv_cache is None:
        return model
    from .formats.kv.kv_store import parse_kv_spec, stored_logits
    return lambda ids: stored_logits(model, ids, parse_kv_spec(args.kv_cache), args.prefill_chunk)[0]


def real_table(args, selected):
    """The table on a real model: llama.cpp's statistics against the model itself (a GGUF model's dequantized
    weights), on held-out text the calibration never saw; each row's time and peak resident memory."""
    path = Path(args.model)
    tokenizer = load_tokenizer(path)
    chunks = text_corpus(args.text, tokenizer).eval_chunks(args.ctx, args.chunks)
    loaded = []

    def reference_model():                          # loaded once, after the calibration files are tokenized
        if not loaded:
            log(f"loading {path.name} ...")
            loaded.append(load_model(path, torch.float32, dense=True))
        return loaded[0]

    # one thread while the model samples its own text: every row quantizes the whole model in memory, so this
    # table runs small models (run.py generate's rule for them)
    calibration = real_calibration(args.calib, tokenizer, args.calib_len, args.calib_samples, reference_model,
                                   one_thread=True).ids if tables.calibrated(selected) else None
    reference = reference_model()
    log(f"{path.name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f} M parameters; "
        f"{len(chunks)} chunks of {args.ctx} held-out tokens"
        + ("" if calibration is None else f", {tuple(calibration.shape)} calibration tokens"))
    ref_logits = ReferenceLogits(reference, chunks)
    results, progress = [], RowProgress(selected)
    try:
        for k, row in enumerate(selected):
            progress.begin(k)
            with tables.MemoryWatch() as memory:
                start = time.time()
                model = copy.deepcopy(reference)
                try:
                    kv = quantize_row(row, model, calibration)
                except ValueError as e:             # this model's shapes do not fit the format: say so, go on
                    results.append({"format": row.label, "error": str(e)})
                    print(json.dumps(results[-1]), flush=True)
                    log(f"{row.label}: {e}")
                    continue
                seconds = time.time() - start
                stats = compare_models(ref_logits, kv_scored(model, args), chunks, impl=args.impl,
                                       progress=lambda it: bar(it, desc="evaluating", unit="chunk", leave=False))
            bits = kv.report()["total_bps"] if row.kv_cache else model_bits(model)
            result = {"format": row.label + (f" + KV {args.kv_cache}" if args.kv_cache else ""),
                      "bits": round(bits, 3), **stats, "seconds": round(seconds, 1),
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
        tables.plot_rate_distortion(results, args.plot, title=Path(args.model).name if args.model else "tiny Qwen3")
        log(f"wrote {args.plot}")
