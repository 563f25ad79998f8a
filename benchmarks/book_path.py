"""How much code a reader follows from the book's GPTQ to a saved checkpoint: README's "Using it from Python" path
(`gptq.quantize(model, ids)`, then `save_quantized(model, dir, "gptq", quantization_config=...)`) run on a tiny
model under a profiler, every engine function it enters counted whole (its def, docstring and body, as a reader
reads it), per file. The model's own forward (qwen3.py, config.py) is not counted: the chapter's path is the
quantizer's.

    python benchmarks/book_path.py            # lines per file, the functions that make them, and the total

Issue 48's measure: about 1,160 lines in 11 files at 7419e74; its target <= 500 lines in <= 6 files.
"""
import collections
import inspect
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.formats import gptq  # noqa: E402
from engine.formats.quantized_checkpoints import save_quantized  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config  # noqa: E402

ROOT = os.path.dirname(engine.__file__)
MODEL_FILES = ("qwen3.py", "config.py")


def traced(run):
    """run() under a profiler -> {code object: (file relative to engine/, first line, last line)} of every engine
    function it entered (module and class bodies, which run at import, excluded)."""
    seen = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code not in seen and code.co_filename.startswith(ROOT) and (
                code.co_flags & inspect.CO_OPTIMIZED):
            source, first = inspect.getsourcelines(code)
            seen[code] = (os.path.relpath(code.co_filename, ROOT), first, first + len(source) - 1)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def main():
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=2)).eval()
    ids = torch.randint(0, 256, (4, 32))
    with tempfile.TemporaryDirectory() as out:
        seen = traced(lambda: save_quantized(model, Path(out) / "ck", "gptq",
                                             quantization_config=gptq.quantize(model, ids, group_size=32)))
    lines, functions = collections.defaultdict(set), collections.defaultdict(list)
    for code, (path, first, last) in seen.items():
        if path not in MODEL_FILES:
            lines[path].update(range(first, last + 1))      # a nested function's lines are its parent's
            functions[path].append((last - first + 1, code.co_qualname))
    for path in sorted(lines, key=lambda p: -len(lines[p])):
        biggest = ", ".join(f"{name} {n}" for n, name in sorted(functions[path], reverse=True)[:5]
                            if "<" not in name)
        print(f"{len(lines[path]):5d}  engine/{path:40s} {biggest}")
    print(f"{sum(map(len, lines.values())):5d}  lines in {len(lines)} files")


if __name__ == "__main__":
    main()
