"""The layer-by-layer converter killed at any instant: the conversion dies just before its n-th file-system step (a
rename, an unlink, the folder swap, a removal), for every n; the next run of the same conversion then completes the
same checkpoint byte for byte, or starts over, and says which on stderr; DIR holds nothing else, and no `.DIR.*`
entry is left beside it.

A death is simulated in the process (fast: no import per kill): from step n on, every file-system step raises
_Killed, a BaseException, without doing anything, so the clean-up a real kill never runs (removing a temporary
file or folder) cannot run either. One case is also run as a real kill of a child process (os._exit)."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import safe_writes
from engine.loaders import save_dense
from engine.formats.quantized_checkpoints import load_quantized
from engine.checkpoints.streaming import quantize_checkpoint
from engine.qwen3 import Qwen3, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = {"fp8": dict(block=32), "gptq": dict(group_size=32)}
STEPS = (("os", "replace"), ("os", "rename"), ("os", "unlink"), ("os", "rmdir"), ("shutil", "rmtree"),
         ("safe_writes", "_exchange"))


class _Killed(BaseException):
    pass


def _dying(monkeypatch, n):
    """Patch every file-system step so that the process 'dies' before the n-th (n = 0: never); returns the list of
    steps taken."""
    modules = {"os": os, "shutil": shutil, "safe_writes": safe_writes}
    steps = []
    for module, name in STEPS:
        real = getattr(modules[module], name)

        def step(*args, _real=real, _name=name, **kwargs):
            steps.append(_name)
            if n and len(steps) >= n:
                raise _Killed(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(modules[module], name, step)
    return steps


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=3)
    folder = tmp_path_factory.mktemp("src") / "dense"
    save_dense(Qwen3(cfg).eval(), folder)
    return folder


def _ids(method):
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)) if method == "gptq" else None


def _convert(method, source, out):
    return quantize_checkpoint(source, out, method, _ids(method), progress=False, **OPTIONS[method])


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_a_conversion_killed_at_any_step_resumes_or_starts_over_and_says_which(method, source, tmp_path, capfd):
    with pytest.MonkeyPatch.context() as patch:
        steps = _dying(patch, 0)
        _convert(method, source, tmp_path / "whole" / "ck")
    reference = _files(tmp_path / "whole" / "ck")
    assert {"replace", "unlink"} <= set(steps)                           # the kills below reach the real steps
    for n in range(1, len(steps) + 1):
        out = tmp_path / f"kill-{n}" / "ck"
        with pytest.MonkeyPatch.context() as patch, pytest.raises(_Killed):
            _dying(patch, n)
            _convert(method, source, out)
        left = (out.parent / ".ck.partial").exists()
        capfd.readouterr()
        _convert(method, source, out)
        said = capfd.readouterr().err
        where = f"killed before step {n} ({steps[n - 1]})"
        assert _files(out) == reference, where                           # the same checkpoint, byte for byte
        assert sorted(p.name for p in out.parent.iterdir()) == ["ck"], where
        if left:
            assert ("resuming" in said) != ("started over" in said), (where, said)


# A real kill: a child process converts and exits (os._exit, no clean-up at all) just before its n-th rename.
CHILD = textwrap.dedent("""
    import os, sys, torch
    from engine.checkpoints.streaming import quantize_checkpoint
    n, source, out, calls = int(sys.argv[1]), sys.argv[2], sys.argv[3], []
    def dying(real):
        def rename(*args):
            calls.append(args)
            if len(calls) == n:
                os._exit(9)
            return real(*args)
        return rename
    os.replace, os.rename = dying(os.replace), dying(os.rename)
    quantize_checkpoint(source, out, "fp8", progress=False, block=32)
""")


@pytest.mark.slow
def test_a_real_kill_as_the_checkpoint_is_finished_resumes_to_the_same_bytes(source, tmp_path, capfd):
    """The issue's reproducer: killed as the finished layers become the checkpoint (the 9th rename: after the three
    layers, their progress records and the two tensors copied as stored)."""
    _convert("fp8", source, tmp_path / "whole" / "ck")
    out = tmp_path / "out" / "ck"
    child = subprocess.run([sys.executable, "-c", CHILD, "9", str(source), str(out)], cwd=ROOT, capture_output=True,
                           text=True)
    assert child.returncode == 9, child.stderr
    capfd.readouterr()
    _convert("fp8", source, out)
    assert "resuming" in capfd.readouterr().err
    assert _files(out) == _files(tmp_path / "whole" / "ck") and load_quantized(out) is not None
