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


def test_quantformats_on_a_model_reports_a_refused_row_and_goes_on(tmp_path, tiny_model):
    """A format that cannot hold this model's shapes (trellis' 256-wide rotation, hidden 64) is a row saying why;
    the rows after it are still measured."""
    from engine.checkpoints.loaders import save_dense
    save_dense(tiny_model, tmp_path / "dense")
    out = run("quantformats", "--model", str(tmp_path / "dense"), "--ctx", "32", "--chunks", "2",
              "--calib-samples", "2", "--calib-len", "32", "--rows", "L=8, K=3", "RTN int2",
              "--plot", str(tmp_path / "kl.png"))
    assert out.returncode == 0, out.stderr
    rows = rows_of(out.stdout)
    assert [r["format"] for r in rows] == ["trellis (QTIP-style), L=8, K=3", "RTN int2, g64"]
    assert "rotation tile" in rows[0]["error"] and rows[1]["kl_nats"] > 0
    assert "refused: " in out.stdout and (tmp_path / "kl.png").stat().st_size > 0    # the plot skips refused rows
