import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

import engine.kernels  # noqa: F401  (on a CPU: Triton's interpreter, set before a --yours FILE imports triton)
from engine.qwen3 import Qwen3, Qwen3Config

# Where the chapter's functions live in the engine: `--yours FILE` puts FILE's functions in place of these modules'
# functions of the same names.
BOOK_MODULES = ("engine.formats.gptq", "engine.formats.awq", "engine.formats.numerics.affine", "engine.formats.fp8",
                "engine.formats.mx", "engine.formats.numerics.minifloats", "engine.formats.trellis",
                "engine.formats.numerics.hadamard", "engine.formats.quantized_checkpoints",
                "engine.kernels.triton_formats", "engine.loaders", "engine.safetensors_io")


def pytest_addoption(parser):
    parser.addoption("--yours", metavar="FILE", default=None,
                     help="run the chapter's tests on your own implementation: the functions and classes FILE defines "
                          "take the place of the engine's of the same names; tests of what FILE does not define, "
                          "and tests of the engine's own internals, are skipped (saying why)")


def _load_yours(path):
    spec = importlib.util.spec_from_file_location("yours", path)
    if spec is None or not Path(path).is_file():
        raise pytest.UsageError(f"--yours {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    own = {}
    for name, obj in vars(module).items():
        target = getattr(obj, "fn", obj)                 # a @triton.jit kernel wraps its function
        if (inspect.isfunction(target) or inspect.isclass(target)) and target.__module__ == "yours":
            own[name] = obj
    return own


def pytest_configure(config):
    path = config.getoption("--yours")
    config.yours = None if path is None else (path, _load_yours(path))


def pytest_report_header(config):
    if config.yours is not None:
        path, own = config.yours
        return f"--yours {path}: in place of the engine's {', '.join(sorted(own)) or 'nothing (no function in it)'}"


@pytest.fixture(autouse=True)
def _your_implementation(request, monkeypatch):
    """Under --yours: a test marked @pytest.mark.book(names...) runs with the file's functions in place of the
    engine's (and is skipped if the file lacks one of `names`); any other test pins the engine's own code and is
    skipped."""
    if request.config.yours is None:
        return
    path, own = request.config.yours
    marker = request.node.get_closest_marker("book")
    if marker is None:
        pytest.skip("tests the engine's own code, not what the chapter asks you to build")
    missing = [name for name in marker.args if name not in own]
    if missing:
        pytest.skip(f"{path} defines no {', '.join(missing)}")
    for module_name in BOOK_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in own.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, obj)


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
