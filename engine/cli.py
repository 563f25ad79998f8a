"""What `run.py`'s commands do (run.py itself only parses and dispatches): train, eval, export, generate, and the
quantformats table's selection (engine/quantformats.py measures it); quantize is engine/cli_quantize.py. Each command
first makes the cheap checks of engine/cli_checks.py. Nothing heavy is imported at module level: each command
imports what it runs, so that `run.py --help` and an argument error never wait for torch.
"""
import json
import sys
import time
from pathlib import Path

from engine.cli_checks import (SMALL_MODEL, check_calibration, check_calibration_size, check_context, check_file_output,
                               check_kv_cache, check_model_path, check_output, check_text, model_bytes)
from engine.console import bar, log


def kv_summary(spec, cache):
    """One line: what a stored cache holds against bf16 for the same positions, and the decoded values it keeps."""
    from engine.formats.kv.kv_store import DECODED_BYTES
    nbytes, bf16 = cache.nbytes(), cache.bf16_bytes()
    held, decoded = nbytes["total"], nbytes["decoded"]
    return (f"KV cache {spec}: {held / 2 ** 20:.2f} MiB held for {cache.length} positions, {held / bf16:.1%} of a bf16 "
            f"cache's {bf16 / 2 ** 20:.2f} MiB" + (f"; besides, {decoded / 2 ** 20:.2f} MiB of its first pages kept "
                                                  f"decoded (at most {DECODED_BYTES >> 20} MiB)" if decoded else ""))


# ---- quantformats -----------------------------------------------------------------------------------------------

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
    check_calibration(args)
    if args.model is not None and args.reference_dtype != "float32":
        raise ValueError("--reference-dtype is the tiny model's; a real model's reference is its own weights")
    if args.kv_cache is not None:
        if args.model is None:
            raise ValueError("--kv-cache puts a stored KV cache under a real model's rows (--model M); the tiny "
                             "table's KV rows are its own")
        kv_rows = [row.label for row in selected if row.kv_cache]
        if kv_rows:
            raise ValueError(f"--kv-cache {args.kv_cache} goes under the weight rows; these rows are KV caches "
                             f"themselves: {'; '.join(kv_rows)}")
    from engine import quantformats
    if args.model is not None:
        from engine.checkpoints.models import model_config
        cfg = model_config(args.model)
        check_context(args.ctx, "--ctx", cfg)
        check_calibration_size(args, cfg)
        check_kv_cache(args, args.ctx, cfg.head_dim, "--ctx")
        return quantformats.real_table(args, selected)
    quantformats.tiny_table(args, selected, book, len(rows))


# ---- train ------------------------------------------------------------------------------------------------------

def cmd_train(args):
    check_text(args.text)
    if args.out:
        check_output(args.out, args.force)
    from engine.training import tiny_setup
    _, model = tiny_setup(args.text, args.steps, args.seed)
    if args.out:
        from engine.loaders import save_dense
        from engine.checkpoints.tokenizer import export_tokenizer
        save_dense(model, args.out, force=args.force, side_files=lambda folder: export_tokenizer(None, folder))
        log(f"saved {args.out}")


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
    report = export_gguf(args.source, args.gguf, fallback=args.fallback, force=args.force,
                         embedding_type=args.embedding_type)
    log(f"wrote {args.gguf}: {json.dumps(report)}")


def stored_bits(path, model):
    """Bits per quantized weight of the checkpoint at `path` as its files store them (a folder: every byte of its
    quantized linears' tensors, from its headers, as `quantize` reports it; a GGUF file: its loaded layers count
    their GGML types' bits), not the in-memory convention of the book's table (a scale and a zero point of 16 bits
    a group)."""
    from engine.formats.quantized_checkpoints import checkpoint_bits
    from engine.layers import model_bits
    return checkpoint_bits(path) if Path(path).is_dir() else model_bits(model)


def cmd_eval(args):
    if args.kv_cache is not None and args.model is None:
        raise ValueError("--kv-cache evaluates a real model's cache: eval --model M --kv-cache SPEC")
    if args.model is not None or args.quantized is not None:
        return eval_real(args)
    if getattr(args, "weights", None) is not None:
        raise ValueError("--weights applies to a real model's eval (--model REF --quantized Q) and to generate; a "
                         "tiny checkpoint's KL is measured on its float32 weights")
    if args.checkpoint is None:
        raise ValueError("give a checkpoint of the tiny model (a folder or .gguf file), or --model REF --quantized Q")
    check_model_path(args.checkpoint, "CHECKPOINT")
    check_text(args.text)
    from engine.loaders import checkpoint_source, model_digest
    from engine.checkpoints.models import load_model
    from engine.evaluation import held_out_logits, kl_stats
    from engine.quantformats import evaluate
    from engine.training import tiny_setup
    path = Path(args.checkpoint)
    source = checkpoint_source(path) if path.is_dir() else None   # a missing or broken checkpoint fails here
    corpus, reference = tiny_setup(args.text, args.steps, args.seed)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{path} was quantized from another model (digest {source[:12]}) than this reference "
                         f"({model_digest(reference)[:12]}, from --steps {args.steps} --seed {args.seed}"
                         f"{' --text ' + args.text if args.text else ''}); give the settings it was made with")
    windows = corpus.eval_windows()
    model = load_model(path)
    stats = kl_stats(held_out_logits(reference, windows), evaluate(model, windows, args.impl))
    bits = stored_bits(path, model)
    print(json.dumps({"checkpoint": str(path), "bits": None if bits is None else round(bits, 3), **stats}))
    log(f"summary: KL {stats['kl_nats']:.5f} ± {stats['kl_stderr']:.5f} nats per byte (p99 {stats['kl_p99']:.4f}), "
        f"same top byte {stats['same_top_pct']:.1f}%" + (f", {bits:.3f} bits per weight" if bits else ""))


def eval_real(args):
    if args.model is None or args.quantized is None and args.kv_cache is None:
        raise ValueError("eval needs both --model REF and --quantized Q (or --model M --kv-cache SPEC: M's coded cache "
                         "against its exact one)")
    ref_path = check_model_path(args.model)
    q_path = None if args.quantized is None else check_model_path(args.quantized, "--quantized")
    check_text(args.text)
    from engine.checkpoints.models import model_config
    for path in filter(None, (ref_path, q_path)):
        check_context(args.ctx, "--ctx", model_config(path))
    check_kv_cache(args, args.ctx, model_config(ref_path).head_dim, "--ctx")
    from engine import runtime
    weights = runtime.choose(getattr(args, "weights", None), args.impl, q_path or ref_path)
    import torch
    from engine.loaders import checkpoint_source, model_digest
    from engine.checkpoints.models import load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.data import text_corpus
    from engine.evaluation import compare_models, markdown_table
    from engine.layers import impl, model_bits
    corpus = text_corpus(args.text, load_tokenizer(ref_path))
    chunks = corpus.eval_chunks(args.ctx, args.chunks)                  # short text fails before any model loads
    source = checkpoint_source(q_path) if q_path is not None and q_path.is_dir() else None
    log(f"loading {ref_path} ...")
    reference = load_model(ref_path, torch.float32, dense=True)
    if source is not None and source != model_digest(reference):
        raise ValueError(f"{q_path} was quantized from another model (digest {source[:12]}) than {ref_path} "
                         f"({model_digest(reference)[:12]})")
    if q_path is not None:
        log(f"loading {q_path} ...")
    quantized = reference if q_path is None else load_model(q_path, to_run=weights not in (None, "float32"))
    bits = stored_bits(q_path, quantized) if q_path is not None else model_bits(quantized)
    scored, kv = quantized, {}
    if args.kv_cache is not None:                     # each chunk read through a fresh stored cache, as a prefill
        from engine.formats.kv.kv_store import parse_kv_spec, stored_logits

        def scored(ids):
            kv["quantizer"] = parse_kv_spec(args.kv_cache)
            logits, kv["cache"] = stored_logits(quantized, ids, kv["quantizer"], args.prefill_chunk)
            return logits
    with impl(args.impl), runtime.running(quantized, weights):
        stats = compare_models(reference, scored, chunks, impl=args.impl,
                               progress=lambda it: bar(it, desc="evaluating", unit="chunk"))
        weight_bytes = runtime.held_bytes(quantized)
    label = q_path.name if q_path is not None else ref_path.name
    result = {"reference": str(ref_path), "quantized": str(q_path or ref_path), "bits": bits and round(bits, 3)}
    if kv:
        label += f" + KV {args.kv_cache}"
        held = kv["cache"].nbytes()["total"]
        result.update(kv_cache=args.kv_cache, kv_bits=round(kv["quantizer"].report()["total_bps"], 3),
                      kv_bytes=held, kv_bf16_bytes=kv["cache"].bf16_bytes())
    result.update(stats)
    print(json.dumps(result))
    print(markdown_table([{**result, "model": label}]))
    log(f"summary: KL {stats['kl_nats']:.4f} ± {stats['kl_stderr']:.4f} nats per token (p99 "
        f"{stats['kl_p99']:.3f}), perplexity {stats['ppl']:.2f} vs {stats['ppl_ref']:.2f} for the reference, same top "
        f"token {stats['same_top_pct']:.1f}%, on {stats['positions']} positions"
        + (f"; {bits:.3f} bits per quantized weight" if bits else ""))
    if kv:
        log(kv_summary(args.kv_cache, kv["cache"]) + f"; {result['kv_bits']} bits per K/V scalar counted")
    form = (weights or args.impl) if q_path is not None else ("its float32 weights, read with the exact cache and "
                                                               "with the coded one")
    log(f"{label}{f' ({form})' if form else ''}: " + runtime.memory_line(quantized, q_path or ref_path, weight_bytes))


def cmd_generate(args):
    if args.prompt_file is not None:
        check_text(args.prompt_file, "--prompt-file")
        if Path(args.prompt_file).stat().st_size == 0:
            raise ValueError(f"--prompt-file {args.prompt_file} is empty")
    elif not args.prompt:
        raise ValueError("--prompt is empty")
    check_text(args.text)
    if args.model is not None:
        check_model_path(args.model)
    from engine import runtime
    weights = runtime.choose(getattr(args, "weights", None), args.impl, args.model)
    import torch
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.layers import impl
    from engine.training import tiny_setup
    from engine.checkpoints.models import model_config
    from engine.qwen3 import Qwen3Config
    started = time.time()
    # The model's context bounds the prompt and the new tokens, as llama.cpp's context does: checked before the
    # model loads (the prompt's tokens from the tokenizer, the context from the config alone).
    tokenizer = load_tokenizer(args.model)
    cfg = Qwen3Config() if args.model is None else model_config(args.model)
    context = cfg.max_position_embeddings
    ids = prompt_ids(args, tokenizer, context)
    if ids.shape[1] + args.max_new_tokens > context:
        log(f"generating at most {context - ids.shape[1]} tokens: the model's context is {context} and the prompt "
            f"is {ids.shape[1]}")
        args.max_new_tokens = context - ids.shape[1]
    quantizer = check_kv_cache(args, context, cfg.head_dim)
    # A small model's ops (and at batch 1 any model's steps are small) are too small to share between threads:
    # they only wait on each other, 4-10x slower on a loaded 2-core machine (measured); a big model's weights need
    # every core's memory bandwidth. Small: under SMALL_MODEL bytes on disk.
    threads = torch.get_num_threads()
    if args.model is not None and model_bytes(args.model) < SMALL_MODEL:
        torch.set_num_threads(1)
    if args.model is None:
        _, model = tiny_setup(args.text, args.steps, args.seed)  # (training, when not cached, on every thread)
        torch.set_num_threads(1)
    else:
        from engine.checkpoints.models import load_model
        log(f"loading {args.model} ...")
        model = load_model(args.model, progress=lambda it, total: bar(it, total=total, desc="loading",
                                                                      unit="tensor", leave=False),
                           to_run=weights not in (None, "float32"))
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
        with impl(args.impl), runtime.running(model, weights, lambda it: bar(it, desc="decoding weights",
                                                                             unit="layer", leave=False)) as kept:
            decoded = time.time()
            cache = None
            if quantizer is not None:
                from engine.formats.kv.kv_store import install
                cache = install(model, quantizer)
            model.generate(ids, args.max_new_tokens, args.temperature, generator, on_token=show, cache=cache,
                           prefill_chunk=args.prefill_chunk)
            weight_bytes = runtime.held_bytes(model)
    finally:
        torch.set_num_threads(threads)
    sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    done = time.time()
    n = len(state["new"])
    prepared = f"{'decode' if kept else 'prepare'} weights {decoded - loaded:.1f} s, " if weights else ""
    log(f"load {loaded - started:.1f} s, {prepared}first token {state['first'] - decoded:.2f} s after that, {n} tokens "
        f"in {done - decoded:.1f} s ({n / max(done - decoded, 1e-9):.1f} tokens/s)")
    if cache is not None:
        log(kv_summary(args.kv_cache, cache))
    log(f"{weights or args.impl}: " + runtime.memory_line(model, args.model, weight_bytes))


def prompt_ids(args, tokenizer, context):
    """--prompt or --prompt-file's ids [1, n], n < context: the file read and the text tokenized only as far as the
    context needs (read_tokens, counting up to twice the context: room for its piece boundaries), so that a huge
    file, or a tokenizer that multiplies text, is the same one "too long" line."""
    import io
    from engine.checkpoints.tokenizer import read_tokens
    flag = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
    try:
        with open(args.prompt_file, "rb") if args.prompt_file else io.BytesIO(args.prompt.encode()) as stream:
            ids, data, complete = read_tokens(tokenizer, stream, limit=2 * context)
        if complete:
            data.decode("utf-8")                                  # the byte tokenizer reads any bytes: a prompt is text
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not complete:
        raise ValueError(f"{flag} is more than {2 * context} tokens, and the model's context is {context}: shorten it")
    if len(ids) >= context:
        raise ValueError(f"{flag} is {len(ids)} tokens, and the model's context is {context}: shorten it")
    if len(ids) == 0:
        raise ValueError(f"{flag} is empty")
    return ids[None]


def spell(tokenizer, ids):
    """The bytes ids spell: exact for a byte-level vocabulary, the tokenizer's own decoder otherwise; an incomplete
    UTF-8 character at the end is held back until its last byte arrives."""
    from engine.checkpoints.tokenizer import complete_utf8, rust_calls, token_bytes
    try:
        return complete_utf8(token_bytes(tokenizer, ids))
    except ValueError:                                   # a SentencePiece-style vocabulary: its own decoder
        with rust_calls(tokenizer):
            return tokenizer.decode(ids).rstrip("\ufffd").encode("utf-8")
