"""Chapter 39, the kernels: the GPU launch settings' code paths (run here under the interpreter), the format
tables on the device, and benchmarks/gpu_check.py --quick end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.formats.numerics import affine, minifloats
from engine.formats import fp8, mx, trellis
from engine.formats.nf4 import NF4Linear
from engine.kernels import triton_formats

ROOT = Path(__file__).resolve().parents[1]


def _layers(n, k):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False)
    codes = torch.randint(0, 256, (n // 16, k // 16, 3 * 256 // 8), dtype=torch.uint8)   # any bytes: tail-biting
    return {
        "int4": affine.AffineQuantLinear.from_linear(linear, 4, 64),
        "int2": affine.AffineQuantLinear.from_linear(linear, 2, 32),
        "fp8": fp8.FP8BlockLinear.from_linear(linear, 128),
        "mxfp4": mx.MXFP4Linear.from_linear(linear),
        "nvfp4": mx.NVFP4Linear.from_linear(linear),
        "nf4": NF4Linear.from_weight(linear.weight, 64),
        "trellis 1mad": trellis.TrellisLinear(*trellis.trellis_codes(linear.weight.detach(), 8, 2)[:2], 8, 2),
        "trellis 3inst": trellis.TrellisLinear(codes, (torch.rand(codes.shape[:2]) + 0.5).half(), 16, 3, "3inst",
                                               True, (16, 16), 256, 0),
    }


def _close(y, y_ref):
    """Equal up to float32 sums taken in another order: relative to the largest output (single outputs near 0
    have no relative precision)."""
    return y.shape == y_ref.shape and float((y - y_ref).abs().max()) <= 1e-5 * float(y_ref.abs().max())


@pytest.mark.parametrize("m", [1, 5, 40])
def test_compiled_launch_settings_compute_the_same_product(m, monkeypatch):
    """The GPU's tiles (the BLOCK_M = 1 GEMV branch, 16-row and 64-row tl.dot tiles) never run under the
    interpreter's own settings: force them here, every format, against the torch path."""
    monkeypatch.setattr(triton_formats, "INTERPRETED", False)
    assert (triton_formats.launch_settings(m).block_m == 1) == (m == 1)
    n, k = 48, 512                                             # ragged: 48 outputs fill neither 32 nor 64
    x = torch.randn(m, k)
    for name, layer in _layers(n, k).items():
        y_ref = x @ layer.dequantize().T
        y = layer.kernel_matmul(x)
        assert _close(y, y_ref), name
    codes = (torch.randn(n, k) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(n) + 0.5
    y = triton_formats.entquant_matmul(x, codes.view(torch.uint8), scale)
    assert _close(y, x @ (codes.float() * scale[:, None]).T)


def test_compiled_settings_are_legal_for_tl_dot():
    """Powers of two, and >= 16 on every tl.dot dimension: only the GEMV branch (no tl.dot) may use one row."""
    for m in range(1, 300):
        s = triton_formats.launch_settings(m)
        sizes = (s.block_m, s.block_n, s.block_k)
        assert all(b & (b - 1) == 0 for b in sizes) and min(sizes[1:]) >= 16 and (s.block_m >= 16 or m == 1)


def test_device_table_is_keyed_by_the_tables_bytes():
    """A value table is copied to a device once; a different table (here only code 8's -0 made +0, which a key
    by values would miss) gets its own copy."""
    e2m1 = minifloats.E2M1
    plus_zero = e2m1.clone()
    plus_zero[8] = 0.0
    on_meta = triton_formats.device_table(e2m1, "meta")
    assert triton_formats.device_table(e2m1.clone(), "meta") is on_meta
    assert triton_formats.device_table(plus_zero, "meta") is not on_meta
    assert triton_formats.device_table(e2m1, "cpu").data_ptr() == e2m1.data_ptr()     # already there: no copy


def test_bad_tables_and_group_sizes_are_value_errors():
    layer = _layers(48, 512)["nf4"]
    with pytest.raises(ValueError, match="16 entries"):
        triton_formats.nf4_matmul(torch.randn(2, 512), layer.packed, layer.absmax.float(), torch.zeros(8))
    with pytest.raises(ValueError, match="group_size"):
        triton_formats.nf4_matmul(torch.randn(2, 512), layer.packed, layer.absmax.float(), torch.zeros(16), 0)


@pytest.mark.slow
def test_gpu_check_quick_passes_every_check(tmp_path):
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out", str(out),
                          "--table-steps", "2"], capture_output=True, text=True, cwd=ROOT)
    report = json.loads(out.with_suffix(".json").read_text())
    assert run.returncode == 0, report["summary"]["failed"]
    kernels = {r["kernel"] for r in report["matmul"]}
    assert len(kernels) == 9 and all(r["ok"] and r["max_rel_err"] <= 1e-4 for r in report["matmul"])
    assert {r["batch"] for r in report["matmul"]} == {1, 16, 256}
    decoders = [r for r in report["decode"] if "source" in r]
    assert {r["decoder"] for r in decoders} == {"rANS", "Rice lattice E8", "Rice lattice D4", "Rice lattice A2",
                                                "Rice lattice Z"} and all(r["bit_exact"] for r in decoders)
    assert report["table"] and all(r["ok"] for r in report["table"])
    assert report["summary"]["ok"] and "checks passed" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_every_kernel_compiles_for_a_gpu_offline(tmp_path):
    """The interpreter runs code the GPU compiler refuses (a loop-carried variable that changes type, say): every
    kernel must also compile for sm_90, which Triton does without a GPU."""
    out = tmp_path / "compile"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--compile-only", "--out",
                          str(out)], capture_output=True, text=True, cwd=ROOT)
    report = json.loads(out.with_suffix(".json").read_text())
    assert run.returncode == 0, report["summary"]["failed"]
    assert report["summary"]["passed"] == report["summary"]["checks"] >= 30 and not report["summary"]["failed"]
