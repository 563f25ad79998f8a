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
    "gptq: H not damped": (
        "gptq", "gptq.py", [("    H += damp * torch.diag(H).mean() * torch.eye(cols)", "    pass")], "is H damped"),
    "gptq: act-order's g_idx in visit order": (
        "gptq", "gptq.py", [("    g_idx = (torch.arange(cols) // group_size)[inverse]",
                             "    g_idx = torch.arange(cols) // group_size")], "their own group's scales"),
    "awq: scaled the wrong way round": (
        "awq", "awq.py", [("                norm.weight.div_(s.to(norm.weight.dtype))",
                           "                norm.weight.mul_(s.to(norm.weight.dtype))"),
                          ("                previous.weight.div_(s[:, None].to(previous.weight.dtype))",
                           "                previous.weight.mul_(s[:, None].to(previous.weight.dtype))"),
                          ("                linear.weight.mul_(s[None, :].to(linear.weight.dtype))",
                           "                linear.weight.div_(s[None, :].to(linear.weight.dtype))")],
        "leave the float model's function unchanged"),
    "awq: s from the signed mean of x": (
        "awq", "awq.py", [("    x_mean = x.abs().mean(0)", "    x_mean = x.mean(0)")], "chose alpha 0"),
    "fp8: codes divided by their scale": (
        "fp8", "fp8.py", [("    return weight.float() * s\n", "    return weight.float() / s\n")],
        "is w = q * scale_inv"),
    "fp8: a ragged block's scales not cut": (
        "fp8", "fp8.py", [("[:weight.shape[0]].repeat_interleave(block, 1)[:, :weight.shape[1]]",
                           ".repeat_interleave(block, 1)")], "ragged last block"),
    "fp8: the kernel reads scale_inv transposed": (
        "fp8", "fp8.py", [("s_ptr + (rn[:, None] // 128) * s_cols + rk[None, :] // 128",
                           "s_ptr + (rk[None, :] // 128) * s_cols + rn[:, None] // 128")],
        "scale_inv[n // 128, k // 128]"),
    "fp8: one scale for all activations": (
        "fp8", "fp8.py", [("    scale = g.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX",
                           "    scale = g.abs().amax().clamp_min(1e-12) / E4M3_MAX * torch.ones(n, k // group)")],
        "each (token, group)"),
    "fp4: MXFP4's exponent without the -2": (
        "fp4", "fp4.py", [("(torch.floor(torch.log2(amax)) - 2)", "(torch.floor(torch.log2(amax)))")], "top binade"),
    "fp4: NVFP4's tensor scale without E2M1's 6": (
        "fp4", "fp4.py", [("/ (448.0 * 6.0)", "/ 448.0")], "amax / (448 * 6)"),
    "trellis: the codebook not normalized": (
        "trellis", "trellis.py", [("    return ((values - values.mean()) / values.std()).float()",
                                   "    return values.float()")], "(v - mean) / std"),
    "trellis: the Hadamard matrix not divided by sqrt(n)": (
        "trellis", "trellis.py", [("    return h * signs[None, :] / math.sqrt(n)", "    return h * signs[None, :]")],
        "an orthogonal rotation is H D / sqrt(n)"),
    "trellis: the weights not rotated back": (
        "trellis", "trellis.py", [("    return (out @ rotation).reshape(rows, cols), bits",
                                   "    return out.reshape(rows, cols), bits")], "rotated back"),
    "trellis: the scale's bits not counted": (
        "trellis", "trellis.py", [("    bits = (L + K * (group - 1) + 16) / group",
                                   "    bits = (L + K * (group - 1)) / group")],
        "an f16 scale"),
    "quantized_checkpoints: the config without desc_act": (
        "quantized_checkpoints", "quantized_checkpoints.py", [('"desc_act": act_order,\n', '\n')],
        "the real tools read"),
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
