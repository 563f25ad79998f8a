"""The house the book's code lives in: the chapter's methods stand alone (their imports stay small, none reaches
into the rooms a reader can skip), and no file grows past a page a reader can hold."""
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK_METHODS = ("gptq", "awq", "fp8", "mx", "trellis")
SKIPPABLE_ROOMS = ("engine.formats.llama_cpp", "engine.formats.kv", "engine.checkpoints", "engine.distributed")


def _module_file(name):
    path = ROOT / Path(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _top_level_imports(path):
    """The engine modules `path` imports at its top level (not inside a function): what importing it costs."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("engine") and _module_file(n).exists()}
    for name in list(found):                    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        parts = name.split(".")
        found |= {".".join(parts[:k]) for k in range(1, len(parts))}
    return found


def closure(name):
    """Every engine module that importing `name` imports at top level, followed."""
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_top_level_imports(_module_file(module)) - seen)
    return seen


@pytest.mark.parametrize("method", BOOK_METHODS)
def test_a_book_method_imports_at_most_ten_engine_files(method):
    imported = closure(f"engine.formats.{method}")
    assert len(imported) <= 10, sorted(imported)
    assert not [m for m in imported if m.startswith(SKIPPABLE_ROOMS)]


def test_the_books_loader_and_writer_import_at_most_fifteen_engine_files():
    imported = closure("engine.formats.quantized_checkpoints")
    assert len(imported) <= 15, sorted(imported)
    assert not [m for m in imported if m.startswith(SKIPPABLE_ROOMS)]


def test_no_engine_file_is_longer_than_a_page_a_reader_can_hold():
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "engine").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > 450}
    assert not long, long


def test_a_plain_gptq_checkpoint_is_written_and_read_without_the_llama_cpp_room(tmp_path):
    """The registry's GPTQ entry is GPTQ on llama.cpp's grids as well; a plain GPTQ file must not need that room."""
    script = f"""
import sys, torch
from engine.qwen3 import Qwen3, Qwen3Config
from engine.formats import gptq
from engine.formats.quantized_checkpoints import load_quantized, save_quantized
torch.manual_seed(0)
model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=1)).eval()
config = gptq.quantize(model, torch.randint(0, 256, (2, 16)), group_size=32)
save_quantized(model, {str(tmp_path / 'ck')!r}, "gptq", quantization_config=config)
load_quantized({str(tmp_path / 'ck')!r})
print(sorted(m for m in sys.modules if m.startswith({SKIPPABLE_ROOMS!r})))
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_a_dense_models_gptq_runs_no_code_of_the_experts_or_of_the_ranks(tmp_path):
    """The book's path (benchmarks/book_path.py counts it): GPTQ of a dense model and its save enter no function of
    the sparse layers' room (numerics/experts.py) nor of several processes' (rank_layers.py, distributed.py)."""
    import torch
    from engine.formats import gptq
    from engine.formats.quantized_checkpoints import save_quantized
    from engine.qwen3 import Qwen3, Qwen3Config
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_hidden_layers=2)).eval()
    entered, engine = set(), str(ROOT / "engine")

    def profile(frame, event, arg):
        code = frame.f_code                             # functions only: a module imported on the way runs its body
        if event == "call" and code.co_flags & inspect.CO_OPTIMIZED and code.co_filename.startswith(engine):
            entered.add(Path(code.co_filename).relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    try:
        config = gptq.quantize(model, torch.randint(0, 256, (4, 16)), group_size=32)
        save_quantized(model, tmp_path / "ck", "gptq", quantization_config=config)
    finally:
        sys.setprofile(None)
    assert "engine/formats/numerics/calibration.py" in entered           # the walk was traced
    assert not entered & {"engine/formats/numerics/experts.py", "engine/checkpoints/rank_layers.py",
                          "engine/distributed.py"}, sorted(entered)


def test_each_option_default_is_the_one_its_quantizer_uses():
    """One default per option: what the CLI's checks and help say (CheckpointMethod.options) is what the method's
    quantize_layer (or its options object) uses when the keyword is not given."""
    import dataclasses
    import inspect

    from engine.formats import entropy, gptq
    from engine.formats.llama_cpp import gptq_ggml
    from engine.formats.quantized_checkpoints import METHODS
    quantizers = {name: [METHODS[name].quantize_layer] for name in METHODS}
    quantizers["gptq"] = [gptq.quantize_layer, gptq_ggml.quantize_layer]     # GPTQ's entry picks one of them
    differ, compared = [], 0
    for name, functions in quantizers.items():
        for function in functions:
            taken = {k: p.default for k, p in inspect.signature(function).parameters.items()
                     if p.default is not inspect.Parameter.empty}
            if name == "entquant":
                taken = {f.name: f.default for f in dataclasses.fields(entropy.EntQuantOptions)}
            for key, option in METHODS[name].options.items():
                if key in taken:
                    compared += 1
                    if option.default != taken[key]:
                        differ.append((name, function.__name__, key, option.default, taken[key]))
    assert not differ, differ
    assert compared >= 50, compared         # every method's options, not a vacuous pass
