import pytest
import torch

from engine.qwen3 import Qwen3, Qwen3Config


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
