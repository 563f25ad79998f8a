"""`pytest tests/test_ch39_<section>.py --yours FILE`: the chapter's tests grade a reader's own implementation.

tests/book/ holds the chapter's listings typed as a reader would, with the helpers the listings use but do not define
(find_params, to_e2m1, E2M1) written out too: each section's tests pass on them (green). A copy with one classic
mistake fails (red), with a message that names what differs. A FILE that cannot be imported, or that defines none
of what a section grades, is a usage error (exit 4) in one line."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sections import GRADED, SECTIONS, readme_list, signature_problem

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "tests" / "book"

# (section, the listing file, [(a line of it, the same line with a mistake)], what the failure says)
MISTAKES = {
    "gptq: no feedback past a block": (
        "gptq", "gptq.py", [("        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]", "        pass")], "below round-to-nearest"),
    "gptq: a group's range from the original weights": (
        "gptq", "gptq.py", [("    W, H = W[:, perm], H[perm][:, perm]", "    W, H = W[:, perm], H[perm][:, perm]\n"
                             "    W0 = W.clone()"),
                            ("                ahead = torch.cat((W1[:, i:], W[:, i2:]), 1)[:, :group_size]",
                             "                ahead = W0[:, col:col + group_size]")], "original weights"),
    "gptq: g_idx not put back in the original order": (
        "gptq", "gptq.py", [("    g_idx = (torch.arange(cols) // group_size)[inverse]",
                             "    g_idx = (torch.arange(cols) // group_size)[perm]")], "g_idx"),
    "gptq: unpack forgets the stored minus one": (
        "gptq", "gptq.py", [("    zeros = (z.reshape(qzeros.shape[0], -1) + 1).T.float()",
                             "    zeros = z.reshape(qzeros.shape[0], -1).T.float()")], "unpack_gptq's zeros["),
    "awq: columns packed in natural order": (
        "awq", "awq.py", [("AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)", "AWQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)")],
        "AutoAWQ's order"),
    "awq: the zero point's sign": (
        "awq", "awq.py", [("pack_nibbles(codes), s, -zeros * s,", "pack_nibbles(codes), s, zeros * s,")],
        "from_checkpoint(to_checkpoint(layer))'s weight"),
    "fp8: E4M3FNUZ's maximum": ("fp8", "fp8.py", [("E4M3_MAX = 448.0", "E4M3_MAX = 240.0")], "448"),
    "fp8: an all-zero block's scale not clamped": (
        "fp8", "fp8.py", [("    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)",
                           "    amax = tiles.abs().amax(dim=(1, 3))")], "all-zero block"),
    "fp8: tiles reshaped [rows, cols, block, block]": (
        "fp8", "fp8.py", [("    tiles = padded.reshape(rows, block, cols, block)",
                           "    tiles = padded.reshape(rows, cols, block, block)"),
                          ("    amax = tiles.abs().amax(dim=(1, 3))", "    amax = tiles.abs().amax(dim=(2, 3))"),
                          ("tiles / scale[:, None, :, None]", "tiles / scale[:, :, None, None]")],
        "tile reshape"),
    "fp4: split layout's halves swapped": (
        "fp4", "fp4.py", [("        codes = torch.cat((low, high), -1)", "        codes = torch.cat((high, low), -1)")],
        "dequantize"),
    "fp4: E2M1 ties rounded away from zero": (
        "fp4", "fp4.py", [("    up = torch.where(torch.arange(1, 8) % 2 == 0, above >= MIDPOINTS, above > MIDPOINTS)",
                           "    up = above >= MIDPOINTS")], "even code"),
    "fp4: NVFP4's nibbles swapped in pack and unpack": (
        "fp4", "fp4.py", [("    return codes[..., 0::2] | (codes[..., 1::2] << 4), block_scale, tensor_scale",
                           "    return codes[..., 1::2] | (codes[..., 0::2] << 4), block_scale, tensor_scale"),
                          ("    codes = torch.stack(((packed & 0xF).long(), (packed >> 4).long()), -1).flatten(-2)",
                           "    codes = torch.stack(((packed >> 4).long(), (packed & 0xF).long()), -1).flatten(-2)")],
        "low nibble"),
    "trellis: the path ends in the worst state": (
        "trellis", "trellis.py", [("    path[-1] = cost.argmin()", "    path[-1] = cost.argmax()")], "the best of all"),
    "trellis: a fixed start state": (
        "trellis", "trellis.py", [("    cost = (x[0] - table) ** 2",
                                   "    cost = torch.where(states == 0, (x[0] - table) ** 2, float('inf'))")],
        "any start state allowed"),
    "quantized_checkpoints: weights never loaded": (
        "quantized_checkpoints", "quantized_checkpoints.py", [("        assign(params[name], value, name)",
                                                               "        pass")], "the checkpoint's tensor of that name"),
}


def run_section(section, listing, *options):
    done = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / f"test_ch39_{section}.py"), "-q",
                           "-p", "no:cacheprovider", "--yours", str(listing), *options], capture_output=True,
                          text=True, cwd=ROOT)
    return done.returncode, done.stdout + done.stderr


def planted(name, tmp_path):
    section, listing, changes, _ = MISTAKES[name]
    text = (BOOK / listing).read_text()
    for line, wrong in changes:
        assert text.count(line) == 1, line
        text = text.replace(line, wrong)
    (tmp_path / listing).write_text(text)
    return section, tmp_path / listing


@pytest.mark.slow
@pytest.mark.parametrize("section", SECTIONS)
def test_the_chapters_listings_pass(section):
    """Each section's listings, the helpers they use defined in the same file as a reader writes them."""
    rc, out = run_section(section, BOOK / f"{section}.py")
    assert rc == 0 and " passed" in out and "failed" not in out, out[-3000:]
    assert f"--yours {BOOK / section}.py: graded " in out                   # the summary line, also under -q


@pytest.mark.slow
@pytest.mark.parametrize("name", MISTAKES)
def test_a_classic_mistake_fails_and_says_what_differs(name, tmp_path):
    section, listing = planted(name, tmp_path)
    rc, out = run_section(section, listing)
    assert rc == 1 and " failed" in out, out[-3000:]
    assert MISTAKES[name][3] in out, out[-3000:]


@pytest.mark.parametrize("source, says", [
    ("def gptq_quantize(weight, hessian\n", r"line 1: SyntaxError: '\(' was never closed"),
    ("import torch\nfrom engine.nowhere import find_params\n", r"line 2: ModuleNotFoundError: No module named "
                                                              r"'engine.nowhere'"),
    ("import sys\n\nsys.exit(0)\n", r"line 3: sys.exit\(0\) while being imported"),
    ("import os\nos._exit(0)\n", r"line 2: os._exit\(0\) while being imported"),
    ("def find_params(x, bits=4):\n    return x, x\n", "defines none of the names gptq grades: gptq_quantize, "
                                                       "pack_gptq, unpack_gptq"),
])
def test_a_file_that_cannot_be_graded_is_one_usage_error_line(tmp_path, source, says):
    (tmp_path / "mine.py").write_text(source)
    rc, out = run_section("gptq", tmp_path / "mine.py")
    assert rc == 4 and re.search(says, out) and "INTERNALERROR" not in out and "Traceback" not in out, out


def test_a_file_that_does_not_exist_is_a_usage_error(tmp_path):
    rc, out = run_section("gptq", tmp_path / "nope.py")
    assert rc == 4 and "no such Python file" in out


def test_os_exit_inside_a_test_fails_it_instead_of_ending_pytest_silently(tmp_path):
    (tmp_path / "mine.py").write_text("import os\n\n\ndef pack_gptq(codes, scales, zeros, g_idx):\n    os._exit(0)\n\n\n"
                                      "def unpack_gptq(qweight, qzeros, scales, g_idx):\n    os._exit(0)\n")
    rc, out = run_section("gptq", tmp_path / "mine.py", "-k", "layout")
    assert rc == 1 and "your code called os._exit(0)" in out, out


def test_a_pair_tested_together_says_which_half_is_missing(tmp_path):
    text = (BOOK / "gptq.py").read_text()
    (tmp_path / "mine.py").write_text(text[:text.index("def unpack_gptq")])
    rc, out = run_section("gptq", tmp_path / "mine.py", "-k", "layout or shapes")
    assert rc == 0 and "tests that need unpack_gptq too were skipped" in out, out


def test_a_graded_name_with_another_signature_is_reported_by_name(tmp_path):
    text = (BOOK / "gptq.py").read_text().replace("def gptq_quantize(weight, hessian, bits=4, group_size=128, "
                                                  "act_order=False, damp=0.01, block=128):",
                                                  "def gptq_quantize(weight, hessian, bits, group_size):")
    (tmp_path / "mine.py").write_text(text)
    rc, out = run_section("gptq", tmp_path / "mine.py", "-k", "shapes")
    assert rc == 1 and "gptq_quantize(weight, hessian, bits, group_size) differs from the chapter's" in out, out


def test_only_the_graded_names_replace_the_engines():
    """A reader's helper of an engine name (find_params without `sym=`) must not reach the engine's fake_quantize,
    which the tests' round-to-nearest baseline calls: with it swapped in, the GPTQ tests failed with a TypeError."""
    rc, out = run_section("gptq", BOOK / "gptq.py", "-k", "round_to_nearest")
    assert rc == 0 and "your as_int32, find_params served your own functions only" in out, out


def test_the_chapters_signatures_are_the_engines():
    """Every graded name exists in the engine module named for it, with the chapter's parameters first."""
    import importlib
    for name, (_, module, _) in GRADED.items():
        engine_own = getattr(importlib.import_module(module), name)
        assert signature_problem(name, engine_own) is None, signature_problem(name, engine_own)


def test_readmes_list_of_graded_names_is_this_registry():
    readme = (ROOT / "README.md").read_text()
    assert readme_list() in readme, "README's --yours list differs from tests/sections.py: paste readme_list()"
