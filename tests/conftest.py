import gc
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

import engine.kernels  # noqa: F401  (on a CPU: Triton's interpreter, set before a --yours FILE imports triton)

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))       # the fuzzers, test tools: by their names
from engine.qwen3 import Qwen3, Qwen3Config
from sections import GRADED, SECTIONS, signature_problem

YOURS = "engine.formats.yours"     # FILE is imported as if it sat beside the chapter's modules: `from ..loaders`


class _Exited(BaseException):
    """os._exit called by a --yours FILE: reported, where the real one would end pytest silently with its status."""


def _raise_exited(status=0):
    raise _Exited(status)


def pytest_addoption(parser):
    parser.addoption("--yours", metavar="FILE", default=None,
                     help="run the chapter's tests on your own implementation: the functions FILE defines of those a "
                          "section asks you to build (tests/sections.py) take the place of the engine's; tests of "
                          "what FILE does not define, and tests of the engine's own internals, are skipped")


def _where(path, error):
    """'FILE, line N: Error: message' for an error raised while importing FILE (the last line of FILE it passed)."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename).resolve() == Path(path).resolve():
            line = frame.lineno
    if isinstance(error, _Exited):
        what = f"os._exit({error.args[0]}) while being imported"
    elif isinstance(error, SystemExit):
        what = f"sys.exit({error.code!r}) while being imported"
    else:
        what = f"{type(error).__name__}: {getattr(error, 'msg', None) or error}"
    return f"--yours {path}{f', line {line}' if line else ''}: {what}"


def _load_yours(path):
    """FILE's definitions {name: object} of the names the sections grade, its other definitions (its own helpers),
    and the graded names it defines with a signature other than the chapter's {name: why}."""
    if not Path(path).is_file() or Path(path).suffix != ".py":
        raise pytest.UsageError(f"--yours {path}: no such Python file")
    spec = importlib.util.spec_from_file_location(YOURS, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[YOURS] = module
    real_exit, os._exit = os._exit, _raise_exited
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit, _Exited) as error:
        raise pytest.UsageError(_where(path, error)) from None
    finally:
        os._exit = real_exit
    defined = {}
    for name, obj in vars(module).items():
        target = getattr(obj, "fn", obj)                 # a @triton.jit kernel wraps its function
        if (inspect.isfunction(target) or inspect.isclass(target)) and target.__module__ == YOURS:
            defined[name] = obj
    graded = {name: obj for name, obj in defined.items() if name in GRADED}
    wrong = {name: why for name, obj in graded.items() if (why := signature_problem(name, obj))}
    return graded, sorted(set(defined) - set(graded)), wrong


def pytest_configure(config):
    path = config.getoption("--yours")
    config.yours = None if path is None else (path, *_load_yours(path))


def _section_of(item):
    name = Path(str(item.fspath)).stem.removeprefix("test_ch39_")
    return name if name in SECTIONS else None


def pytest_collection_modifyitems(config, items):
    """Under --yours: a FILE that defines none of the names the collected sections grade is a usage error."""
    if config.yours is None:
        return
    path, graded, _, _ = config.yours
    sections = sorted({s for item in items if (s := _section_of(item))})
    looked_for = [name for s in sections for name in SECTIONS[s].graded]
    if looked_for and not set(looked_for) & set(graded):
        raise pytest.UsageError(f"--yours {path} defines none of the names {', '.join(sections)} grades: "
                                f"{', '.join(looked_for)}")


_FROZEN_AT = [None]


def pytest_runtest_setup(item):
    """At each test module's first test, what lives on (torch's, transformers' and the engine's modules, then what
    earlier modules leave: compiled graphs, loaded tools) leaves the garbage collector's view, the garbage among it
    collected first (gc.collect, gc.freeze): the engine's release_memory collects after each step of a conversion,
    and a full collection over all of that was most of a tiny model's conversion time. What the tests make is
    collected as before."""
    if item.module is not _FROZEN_AT[0]:
        _FROZEN_AT[0] = item.module
        gc.collect()
        gc.freeze()


def pytest_terminal_summary(terminalreporter, config):
    """Under --yours, also with -q: what was graded, what of FILE only served FILE, and what could not be tested."""
    if config.yours is None:
        return
    path, graded, helpers, wrong = config.yours
    write = terminalreporter.write_line
    write(f"--yours {path}: graded {', '.join(sorted(graded)) or 'nothing'}"
          + (f"; your {', '.join(helpers)} served your own functions only" if helpers else ""))
    for why in wrong.values():
        write(f"--yours {path}: {why}")
    skipped = terminalreporter.stats.get("skipped", [])
    missing = sorted({name for report in skipped for name in getattr(report, "yours_missing", ())})
    if missing:
        write(f"--yours {path}: tests that need {', '.join(missing)} too were skipped (define them to run those)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().yours_missing = getattr(item, "yours_missing", ())


@pytest.fixture(autouse=True)
def _your_implementation(request, monkeypatch):
    """Under --yours: a test marked @pytest.mark.book(names...) runs with FILE's definitions of those names in place
    of the engine's (skipped if FILE lacks one, failed if FILE's signature is not the chapter's); any other test pins
    the engine's own code and is skipped. os._exit from FILE fails the test instead of ending pytest silently."""
    if request.config.yours is None:
        return
    path, graded, _, wrong = request.config.yours
    marker = request.node.get_closest_marker("book")
    if marker is None:
        pytest.skip("tests the engine's own code, not what the chapter asks you to build")
    missing = [name for name in marker.args if name not in graded]
    if missing:
        request.node.yours_missing = missing
        pytest.skip(f"{path} defines no {', '.join(missing)}")
    bad = [wrong[name] for name in marker.args if name in wrong]
    if bad:
        pytest.fail(f"--yours {path}: {bad[0]}", pytrace=False)
    for name, obj in graded.items():
        home = importlib.import_module(GRADED[name][1])
        engines = getattr(home, name, None)
        # and wherever the engine's object is imported under the same name (trellis.random_hadamard is hadamard's):
        # a test reaching it there graded the engine's, not FILE's
        for module in [m for n, m in sys.modules.items() if n == "engine" or n.startswith("engine.")]:
            if engines is not None and getattr(module, name, None) is engines:
                monkeypatch.setattr(module, name, obj)
        monkeypatch.setattr(home, name, obj)

    def exited(status=0):
        pytest.fail(f"--yours {path}: your code called os._exit({status}), which would end the tests silently",
                    pytrace=False)
    monkeypatch.setattr(os, "_exit", exited)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Never read or write the user's training cache from tests."""
    monkeypatch.setenv("ENGINE_CACHE", str(tmp_path_factory.getbasetemp() / "engine-cache"))


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors (pytestmark = pytest.mark.usefixtures("one_thread")): extra threads only add
    synchronization there, and stall badly on a loaded machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_cfg():
    """Smaller than the book's model so tests stay fast, with the same structure (GQA, 2 layers)."""
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2)


@pytest.fixture
def tiny_model(tiny_cfg):
    torch.manual_seed(0)
    return Qwen3(tiny_cfg).eval()


@pytest.fixture
def model32():
    """The tiny test model with head_dim 32 (llama.cpp's KV blocks are 32 values along head_dim)."""
    from engine.qwen3 import Qwen3, Qwen3Config
    torch.manual_seed(0)
    return Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, num_hidden_layers=2)).eval()
