"""`pytest tests/test_ch39_<section>.py --yours FILE`: the chapter's tests run on a reader's own implementation.

tests/book/ holds the chapter's listings typed as a reader would: each section's tests pass on them (green), and
on a copy with one deliberate mistake, the kind a reader makes, they fail (red)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "tests" / "book"

# section -> (the listing file, one line of it, the same line with a mistake)
MISTAKES = {
    "gptq": ("gptq.py", "        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]", "        pass"),     # no feedback past a block
    "awq": ("awq.py", "AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)", "AWQ_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)"),
    "fp8": ("fp8.py", "E4M3_MAX = 448.0", "E4M3_MAX = 240.0"),                                  # E4M3FNUZ's max
    "fp4": ("fp4.py", "        codes = torch.cat((low, high), -1)", "        codes = torch.cat((high, low), -1)"),
    "trellis": ("trellis.py", "    path[-1] = cost.argmin()", "    path[-1] = cost.argmax()"),
    "quantized_checkpoints": ("quantized_checkpoints.py", "        assign(params[name], value, name)",
                              "        pass"),                                                # weights never loaded
}


def run_section(section, listing):
    done = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / f"test_ch39_{section}.py"), "-q",
                           "-p", "no:cacheprovider", "--yours", str(listing)], capture_output=True, text=True,
                          cwd=ROOT)
    return done.returncode, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("section", MISTAKES)
def test_the_chapters_listings_pass_and_a_mistake_in_them_fails(section, tmp_path):
    name, line, wrong = MISTAKES[section]
    rc, summary = run_section(section, BOOK / name)
    assert rc == 0 and " passed" in summary, summary
    text = (BOOK / name).read_text()
    assert text.count(line) == 1
    (tmp_path / name).write_text(text.replace(line, wrong))
    rc, summary = run_section(section, tmp_path / name)
    assert rc == 1 and " failed" in summary, summary


def test_a_file_that_does_not_exist_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_ch39_gptq.py"), "-q",
                           "--yours", str(tmp_path / "nope.py")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 4 and "no such Python file" in done.stderr
