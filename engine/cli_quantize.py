"""`run.py quantize`: the method's options from the command line (--option KEY=VALUE and the named flags, each
parsed by the type of its keyword's default), every check that needs no model, then the tiny model quantized in
memory or a --model quantized layer by layer from disk (engine.checkpoints.streaming; with torchrun, by several
processes), written as a checkpoint folder or one GGUF file, and the summary line. Like engine/cli.py, it imports
nothing heavy at module level.
"""
import contextlib
import json
import math
import time
from pathlib import Path

from engine.cli_checks import (SMALL_MODEL, check_calibration, check_calibration_size, check_file_output,
                               check_model_path, check_output, check_text, model_bytes)
from engine.console import clock, log

GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)    # what GPTQModel's QuantizeConfig accepts
# --bpw: EntQuant's lambda search (from the shipped table); GPTQ's GGML mix, Q2_K (2.625) to Q8_0 (8.5)
BPW_RANGE = {"entquant": (1.5, 6.0), "gptq": (2.625, 8.5)}


def quantize_options(args):
    """--option KEY=VALUE and the named flags -> {keyword: value} for the method, each value parsed by the type of
    that keyword's default; unknown keywords and values of the wrong type are errors."""
    from engine.formats.quantized_checkpoints import method_options
    accepted = method_options(args.method)
    options = {}
    for text in args.option or []:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ValueError(f"--option wants KEY=VALUE, got {text!r}")
        if key not in accepted:
            close = key.replace("-", "_") if key.replace("-", "_") in accepted else None
            raise ValueError(f"--method {args.method} takes no option {key!r}"
                             f"{f' (did you mean {close!r}?)' if close else ''}; it takes {list(accepted)}")
        options[key] = parse_value(key, value, accepted[key].default)
    flags = (("bits", getattr(args, "bits", None)), ("group_size", args.group_size), ("order", args.order),
             ("bpw", args.bpw))
    for key, value in flags:
        if value is not None:
            if key not in accepted:
                flag = f"--{key.replace('_', '-')}"
                raise ValueError(f"{flag} does not apply to --method {args.method}; it takes "
                                 f"{list(accepted) or 'no options'}")
            if key in options:
                raise ValueError(f"--{key.replace('_', '-')} and --option {key}= both set {key}; give one")
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
    check_text(args.text)
    named_gguf = Path(args.out).suffix == ".gguf"      # a folder named so would be read back as no GGUF file
    if named_gguf and (args.format == "safetensors" or args.target not in (None, "llama.cpp")):
        writer = "--format safetensors" if args.format == "safetensors" else f"--target {args.target}"
        raise ValueError(f"--out {args.out}: a name ending in .gguf is a GGUF file, and {writer} writes a folder; "
                         "name the folder otherwise")
    args.format = args.format or ("gguf" if named_gguf else "safetensors")
    if args.model is not None:
        check_model_path(args.model)
    check_calibration(args)
    from engine.formats.quantized_checkpoints import resolve
    options = quantize_options(args)
    group = options.get("group_size")
    if args.method in ("gptq", "awq", "compressed-tensors", "rtn") and group is not None and group not in GROUP_SIZES:
        raise ValueError(f"--group-size {group}: GPTQModel, AutoAWQ and vLLM accept {list(GROUP_SIZES)}")
    if args.method == "rtn" and group == -1:
        raise ValueError("--group-size -1: rtn takes a positive group size (compressed-tensors' per-row "
                         "strategy is --method compressed-tensors)")
    bpw = options.get("bpw")
    if isinstance(bpw, (int, float)) and not BPW_RANGE[args.method][0] <= bpw <= BPW_RANGE[args.method][1]:
        low, high = BPW_RANGE[args.method]
        raise ValueError(f"--bpw {bpw}: {args.method} reaches {low} to {high} bits per weight")
    if args.method == "gptq" and {"ggml_type", "bpw"} & options.keys() and not (
            args.target == "llama.cpp" or args.format == "gguf"):
        raise ValueError("ggml_type and --bpw make GPTQ write llama.cpp's GGML blocks: add --target "
                         "llama.cpp (or --format gguf)")
    if args.method == "rtn" and (args.target == "llama.cpp" or args.format == "gguf"):
        options.setdefault("group_size", 32)           # GGML's blocks; the alias's 64 is its safetensors default
    method, options = resolve(args.method, options)
    if args.target or args.format == "gguf":
        from engine.checkpoints.serving import check_target
        from engine.checkpoints.models import model_config
        from engine.config import Qwen3MoeConfig
        moe = args.model is not None and isinstance(model_config(args.model), Qwen3MoeConfig)
        options, args.format = check_target(args.target or "llama.cpp", method, options, args.format, moe)
        if args.target == "vllm" and args.model is not None:    # hours of work for a file vLLM refuses: not begun
            from engine.checkpoints.serving import check_vllm_groups
            check_vllm_groups(model_config(args.model).to_hf(), method, options)
    from engine.formats.quantized_checkpoints import METHODS
    options = METHODS[method].checked(options)            # every option's range, and the method's rules, once
    if args.embedding_type is not None and args.format != "gguf":
        raise ValueError("--embedding-type sets a GGUF file's embedding type: add --target llama.cpp (or --format "
                         "gguf)")
    if args.format == "gguf":
        args.embedding_type = args.embedding_type or ("llama.cpp" if args.target == "llama.cpp" else "F32")
        check_file_output(args.out, args.force)
        if args.model is not None:
            from engine.safe_writes import check_apart
            check_apart(args.model, args.out)
    elif args.model is None:                             # a --model's output is checked by its Conversion, once
        check_output(args.out, args.force)
    return method, options


def convert(args, out, method, options, force=False, group=None):
    """--model quantized layer by layer into the folder `out`: every check once, the source opened once (group: the
    processes torchrun started, engine.distributed)."""
    from engine.checkpoints.streaming import Conversion
    with Conversion(args.model, out, method, force=force, override="--force", ranks=group, **options) as conversion:
        if not conversion.needs_data:
            return conversion.run()
        check_calibration_size(args, conversion.cfg)
        from engine.data import real_calibration
        calibration = real_calibration(args.calib, conversion.source.tokenizer(), args.calib_len, args.calib_samples,
                                       conversion.float_model, one_thread=model_bytes(args.model) < SMALL_MODEL)
        return conversion.run(calibration.ids, calibration.records())


def cmd_quantize(args):
    method, options = check_quantize_args(args)
    from engine import distributed
    started = time.time()
    if distributed.launched():
        if args.model is None:
            raise ValueError("torchrun: several processes quantize a model from disk (--model PATH); the tiny model "
                             "is quantized by one process")
        if method == "gptq" and options.get("bpw") is not None:     # its plan measures on the first sequences
            raise ValueError(f"--bpw {options['bpw']}: GPTQ's mix is planned by one process; run it without torchrun")
        group = distributed.Group.from_env()
        try:
            if group.first:
                return quantize_from_disk(args, method, options, started, group)
            import io
            with contextlib.redirect_stderr(io.StringIO()):     # one report, rank 0's; the others' errors still show
                return quantize_from_disk(args, method, options, started, group)
        finally:
            group.close()
    if args.model is not None:
        return quantize_from_disk(args, method, options, started)
    from engine.formats.quantized_checkpoints import METHODS as REGISTRY
    from engine.formats.quantized_checkpoints import save_quantized
    from engine.checkpoints.tokenizer import export_tokenizer
    from engine.training import tiny_setup
    corpus, model = tiny_setup(args.text, args.steps, args.seed)
    log(f"quantizing the tiny model with {args.method} ...")
    if args.format == "gguf":
        from engine.formats.llama_cpp.gguf_writer import write_gguf
        REGISTRY[method].quantize(model, corpus.calibration(), **options)
        report = write_gguf(model, args.out, force=args.force, embedding_type=args.embedding_type)
        log(f"wrote {args.out}: {json.dumps(report)}")
        return summarize_output(args.out, started)
    from engine.loaders import model_digest
    model.source_digest = model_digest(model)      # quantized with the method's own defaults, then written
    quantization_config = REGISTRY[method].quantize(model, corpus.calibration(), **options)
    save_quantized(model, args.out, method, quantization_config=quantization_config, force=args.force,
                   side_files=lambda folder: export_tokenizer(None, folder))
    report_checkpoint(args, quantization_config, started)


def quantize_from_disk(args, method, options, started, group=None):
    """quantize --model: layer by layer from disk; group: torchrun's processes (engine.distributed), every rank
    quantizing its share, rank 0 writing and reporting."""
    first = group is None or group.first
    if args.format == "gguf":   # layer by layer into a folder of ours beside FILE, then one GGUF from it
        from engine.formats.llama_cpp.gguf_writer import check_writable
        from engine.checkpoints.models import model_config
        from engine.checkpoints.serving import export_gguf
        check_writable(model_config(args.model))              # before any work (a MoE model llama.cpp cannot run)
        with gguf_workspace(args.out, group) as tmp:
            convert(args, tmp / "ck", method, options, group=group)
            if first:
                report = export_gguf(tmp / "ck", args.out, force=args.force, embedding_type=args.embedding_type)
        if first:
            log(f"wrote {args.out}: {json.dumps(report)}")
            summarize_output(args.out, started)
        return
    quantization_config = convert(args, args.out, method, options, args.force, group)
    if first:
        ranks = "" if group is None else (f" with {group.world} ranks (rank 0 sent and received "
                                          f"{group.bytes / 1e6:.1f} MB)")
        report_checkpoint(args, quantization_config, started, ranks)


@contextlib.contextmanager
def gguf_workspace(out, group=None):
    """A temporary folder beside the GGUF file `out` (removed afterwards), made holding `out`'s one-writer lock, so
    that a second run into `out` is refused at once, not after its conversion; with several processes rank 0 holds
    the lock and makes the folder, and the others learn its name (or rank 0's refusal)."""
    import shutil
    import tempfile
    from engine.distributed import on_first
    from engine.output_lock import output_lock
    first = group is None or group.first
    with contextlib.ExitStack() as held:
        def make():
            held.enter_context(output_lock(out))
            return tempfile.mkdtemp(dir=Path(out).resolve().parent, prefix=".gguf-")
        tmp = on_first(group, make, "naming the GGUF's folder")
        try:
            yield Path(tmp)
        finally:
            if first:
                shutil.rmtree(tmp, ignore_errors=True)


def report_checkpoint(args, quantization_config, started, ranks=""):
    """The lines after a checkpoint folder is written (and, for vLLM, how to serve it)."""
    log(f"wrote {args.out}{ranks}: {json.dumps(quantization_config)}")
    summarize_output(args.out, started)
    if args.target == "vllm":
        from engine.checkpoints.serving import tp_degrees, vllm_serve_command
        log(f"tensor-parallel degrees: {json.dumps(tp_degrees(args.out))}\nserve: {vllm_serve_command(args.out)}")


def summarize_output(out, started):
    """The human line after a checkpoint is written: bits per quantized weight, bits per parameter of the whole
    files (embedding, norms, tokenizer and metadata included: what a download costs), their size, the time."""
    from engine.formats.llama_cpp.gguf import gguf_bits
    from engine.formats.quantized_checkpoints import checkpoint_bits
    from engine.loaders import read_config, skeleton
    from engine.qwen3 import Qwen3Config
    out = Path(out)
    files = [out] if out.is_file() else [p for p in out.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    if out.is_dir():                                     # what the files hold (f32 scales, packed zero points ...)
        bits = checkpoint_bits(out)
        params = sum(p.numel() for p in skeleton(Qwen3Config.from_hf(read_config(out))).parameters())
    else:
        bits, params = gguf_bits(out)
    per = f"{bits:.3f} bits per quantized weight (every stored bit of the quantized linears), " if bits else ""
    whole = f"{8 * size / params:.3f} bits per parameter in the whole file(s), " if params else ""
    log(f"summary: {per}{whole}{size / 1e6:.1f} MB in {len(files)} file(s), {clock(time.time() - started)}")
