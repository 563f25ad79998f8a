"""benchmarks/layerwise.py's plan: the tools of a method interleaved round by round, and an --estimate dry run that
reads only the source's config.json (no venv, no runs)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import layerwise  # noqa: E402


def test_plan_interleaves_tools_round_by_round():
    runs = layerwise.plan(["gptq", "fp8"], 2)
    assert [(m, r, t) for m, r, t in runs[:6]] == [("gptq", r, t) for r in (0, 1)
                                                   for t in ("engine", "gptqmodel", "llm-compressor")]
    assert [t for m, _, t in runs if m == "fp8"] == ["read", "engine", "read", "engine"]


def test_estimate_dry_run_lists_every_run_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 64}))
    layerwise.main(["--model", str(tmp_path), "--methods", "gptq", "lattice", "--tools", "engine", "--rounds", "2",
                    "--work", str(tmp_path / "work"), "--estimate"])
    err = capsys.readouterr().err
    assert err.startswith("6 runs on ") and err.count("round 2") == 3
    assert not (tmp_path / "work").exists()
