"""benchmarks/frontier.py's pieces: the bit count and dequantization of a GGUF file (gguf-py against the engine's
layers), the reference moved off its grid with its function kept, llama.cpp's imatrix file, the frontier's choice,
a tiny run end to end (JSON lines, table, plot, resume, a peer that is absent says why), texts added later scored
from the kept rows, the ratios per text and a remedy row's own calibration."""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import client_runners  # noqa: E402
import frontier  # noqa: E402
import frontier_peers  # noqa: E402
import frontier_report  # noqa: E402
import frontier_reference  # noqa: E402
from engine.formats.llama_cpp.gguf_writer import write_gguf  # noqa: E402
from engine.evaluation import kl_per_position  # noqa: E402
from engine.formats.numerics import affine  # noqa: E402
from engine.layers import quantized_linears  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def llama_model(seed=0):
    """A small llama (q/k rows permuted in GGUF, no q/k norms) with rows of 256 and groups of 32."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, num_hidden_layers=1, vocab_size=256)
    return Qwen3(cfg).eval()


def test_gguf_linears_counts_bits_from_the_types_and_dequantizes_like_the_engine(tmp_path):
    model = llama_model()
    affine.quantize(model, bits=4, group_size=32, sym=True)           # written as Q4_0: 18 bytes per 32 weights
    write_gguf(model, tmp_path / "m.gguf")
    weights, bits, types = frontier_peers.gguf_linears(tmp_path / "m.gguf")
    layers = quantized_linears(model)
    assert set(weights) == set(layers) and types == {"Q4_0": sum(w.numel() for w in weights.values())}
    for name, layer in layers.items():                                # q/k rows back in HF's order
        assert torch.equal(weights[name], layer.dequantize().float()), name
        assert bits[name] == layer.in_features * layer.out_features * 4.5


def test_perturbation_leaves_the_grid_and_keeps_the_function_without_noise():
    model = llama_model(1)
    with torch.no_grad():                                             # put every linear on a Q4_1 grid (g32)
        for _, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and m is not model.lm_head:
                m.weight.copy_(affine.fake_quantize(m.weight, bits=4, group_size=32))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def on_grid(m):                                                   # share of groups a Q4_1 RTN reproduces
        w = m.model.layers[0].mlp.down_proj.weight.detach()
        return (affine.fake_quantize(w, bits=4, group_size=32) - w).abs().reshape(-1, 32).amax(1).lt(1e-6) \
            .float().mean().item()

    moved = frontier_reference.perturb(copy.deepcopy(model), seed=0, noise=0.0, spread=0.25)
    noisy = frontier_reference.perturb(copy.deepcopy(model), seed=0, noise=0.03, spread=0.25)
    with torch.no_grad():
        ref, same, other = model(ids), moved(ids), noisy(ids)
    assert on_grid(model) > 0.99 and on_grid(moved) < 0.05
    assert kl_per_position(ref, same).max() < 1e-9 < kl_per_position(ref, other).mean()


def test_imatrix_file_holds_mean_squares_under_llama_cpp_names(tmp_path):
    model = llama_model()
    calibration = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    sums = frontier.importance(model, calibration)
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(calibration)).reshape(-1, 256).double()
    assert torch.allclose(sums["model.layers.0.self_attn.q_proj"][0], x.square().sum(0))
    assert sums["model.layers.0.mlp.down_proj"][1] == 24
    frontier.write_imatrix(sums, tmp_path / "imatrix.gguf", 3, 8)
    entries = dict(client_runners.imatrix_entries(str(tmp_path / "imatrix.gguf")))
    assert set(entries) == {f"blk.0.{t}.weight".encode() for t in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                    "ffn_gate", "ffn_up", "ffn_down")}
    assert torch.allclose(torch.from_numpy(entries[b"blk.0.attn_q.weight"]).double(), x.square().mean(0), rtol=1e-5)
    from gguf import GGUFReader
    fields = GGUFReader(str(tmp_path / "imatrix.gguf")).fields
    assert bytes(fields["general.type"].parts[-1]).decode() == "imatrix"
    assert int(fields["imatrix.chunk_count"].parts[-1][0]) == 3


def test_frontier_compares_the_best_peer_with_the_engine_at_or_below_its_bits():
    def row(tool, bits, kl):
        return {"tool": tool, "row": f"{tool}{bits}", "bits": bits, "texts": {"t": {"kl_nats": kl}}}
    results = [row("engine", 3.9, 0.2), row("engine", 4.3, 0.05), row("llama.cpp", 4.1, 0.1),
               row("HQQ", 4.0, 0.3), row("engine", 8.0, 0.01), {"tool": "HQQ", "row": "x", "error": "absent"}]
    [(rate, peer, ours)] = frontier_report.frontier(results, "t")
    assert (rate, peer["row"], ours["row"]) == (4.0, "llama.cpp4.1", "engine3.9")   # 4.3 bits is above 4.1


@pytest.fixture
def tiny_reference(tmp_path, monkeypatch, tiny_model):
    """frontier.py's tiny reference made small (2 chunks of 32 bytes, 2 calibration rows) and no peer venv."""
    monkeypatch.setitem(frontier_reference.SETTINGS, "tiny", dict(ctx=32, chunks=2, calib_len=32, calib_samples=2,
                                                                  autoround_iters=0))
    monkeypatch.setattr(frontier_reference, "trained_model", lambda *a, **k: tiny_model)
    monkeypatch.setattr(frontier_peers.clients, "CACHE", tmp_path / "no-venvs")
    monkeypatch.setattr(frontier, "KEPT", tmp_path / "none-kept")          # not the repository's rows
    return tiny_model


def test_tiny_run_writes_rows_table_and_plot_resumes_and_names_absent_peers(tmp_path, monkeypatch, capsys,
                                                                            tiny_reference):
    q4k = "=engine GPTQ on llama.cpp's Q4_K imatrix grid"
    args = ["--references", "tiny", "--tools", "engine", "HQQ", "--rows", "RTN int4, g128", "FP8", "HQQ int4 g64",
            q4k, "--out", str(tmp_path), "--no-install", "--texts", "gpl3", "pydoc"]
    frontier.main(args)
    out = capsys.readouterr().out
    lines = [json.loads(s) for s in out.splitlines() if s.startswith("{")]
    assert [r["row"] for r in lines] == ["FP8 E4M3, 128x128 blocks", "RTN int4, g128", q4k[8:], "int4 g64"]
    assert "not installed" in lines[3]["error"] and "| HQQ | int4 g64 | - | cannot run: " in out
    table = [s for s in out.splitlines() if s.startswith("| engine |")]
    assert [s.split(" | ")[1] for s in table] == ["RTN int4, g128", q4k[8:], "FP8 E4M3, 128x128 blocks"]  # by bits
    # the GGUF row's whole file was written (64-wide rows: Q5_0 linears, the embedding at Q8_0), measured and
    # removed; rows of the engine's own formats have no GGUF to measure
    linears = lines[2]["bits"] * sum(m.weight.numel() for n, m in tiny_reference.named_modules()
                                     if n.startswith("model.layers.") and hasattr(m, "weight")
                                     and m.weight.dim() == 2) / 8
    embedding = tiny_reference.model.embed_tokens.weight.numel() * 8.5 / 8
    # the rest (norms, byte vocabulary, alignment) is ~10 KB; an F32 embedding would add 48 KB
    assert linears + embedding < lines[2]["file_bytes"] < linears + embedding + 16384
    assert "file_bytes" not in lines[0] and not list((tmp_path / "tiny" / "files").glob("*.gguf"))
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    monkeypatch.setattr(frontier, "engine_row", lambda *a: pytest.fail("a cached row was recomputed"))
    frontier.main(args)                                               # the absent peer is asked again
    out = capsys.readouterr().out
    assert [json.loads(s)["row"] for s in out.splitlines() if s.startswith("{")] == ["int4 g64"]
    assert f"| engine | {q4k[8:]} | {lines[2]['bits']:.3f} | {lines[2]['file_bytes'] / 2 ** 20:.1f} |" in out


def test_a_row_kept_with_the_repository_is_used_where_the_cache_has_none(tmp_path, monkeypatch, capsys,
                                                                         tiny_reference):
    args = ["--references", "tiny", "--tools", "engine", "--rows", "RTN int4, g128", "--no-install",
            "--texts", "gpl3"]
    frontier.main(args + ["--out", str(tmp_path / "first")])
    measured = next((tmp_path / "first" / "tiny" / "rows").glob("*.json"))
    row = json.loads(measured.read_text())
    row["texts"]["gpl3"]["kl_nats"] = 123.0                         # planted: only the kept copy says it
    (tmp_path / "kept" / "tiny").mkdir(parents=True)
    (tmp_path / "kept" / "tiny" / measured.name).write_text(json.dumps(row))
    capsys.readouterr()
    monkeypatch.setattr(frontier, "engine_row", lambda *a: pytest.fail("a kept row was quantized again"))
    frontier.main(args + ["--out", str(tmp_path / "new-machine"), "--kept", str(tmp_path / "kept")])
    out = capsys.readouterr().out
    assert not [s for s in out.splitlines() if s.startswith("{")]          # nothing measured
    assert "123" in next(s for s in out.splitlines() if s.startswith("| engine | RTN int4, g128 |"))
    frontier.main(args + ["--out", str(tmp_path / "first"), "--kept", str(tmp_path / "kept")])
    out = capsys.readouterr().out                                      # the cache's own row comes first
    assert "123" not in next(s for s in out.splitlines() if s.startswith("| engine | RTN int4, g128 |"))


def test_kept_rows_that_name_a_file_are_one_error_line(tmp_path, capsys):
    (tmp_path / "rows.json").write_text("{}")
    with pytest.raises(SystemExit):
        frontier.main(["--kept", str(tmp_path / "rows.json"), "--render", "--out", str(tmp_path)])
    assert f"error: --kept {tmp_path / 'rows.json'} is not a folder" in capsys.readouterr().err


def test_a_text_added_later_is_scored_from_the_kept_rows_without_quantizing_again(tmp_path, monkeypatch, capsys,
                                                                                  tiny_reference):
    args = ["--references", "tiny", "--tools", "engine", "--rows", "RTN int4, g128", "AWQ int4, g128",
            "--out", str(tmp_path), "--no-install"]
    frontier.main(args + ["--texts", "gpl3"])
    first = {r["row"]: r for r in map(json.loads, (s for s in capsys.readouterr().out.splitlines()
                                                   if s.startswith("{")))}
    assert set(first) == {"RTN int4, g128", "AWQ int4, g128"} and all(set(r["texts"]) == {"gpl3"}
                                                                       for r in first.values())
    # AWQ folds scales into the norms: its kept layers must bring them back, or the gpl3 score moves
    original_engine_row = frontier.engine_row
    awq_json = next((tmp_path / "tiny" / "rows").glob("engine-AWQ*.json"))
    forgotten = json.loads(awq_json.read_text())
    planted = {**forgotten["texts"].pop("gpl3"), "kl_nats": 123.0}
    forgotten["texts"]["pydoc"] = planted                              # kept as it is: never scored again
    awq_json.write_text(json.dumps(forgotten))
    monkeypatch.setattr(frontier, "engine_row", lambda *a: pytest.fail("a kept row was quantized again"))
    frontier.main(args)                                               # every text: the default
    again = {r["row"]: r for r in map(json.loads, (s for s in capsys.readouterr().out.splitlines()
                                                   if s.startswith("{")))}
    assert all(set(r["texts"]) == set(frontier_reference.TEXTS) for r in again.values())
    for label in first:
        assert again[label]["texts"]["gpl3"] == first[label]["texts"]["gpl3"]
        assert again[label]["bits"] == first[label]["bits"] and again[label]["seconds"] == first[label]["seconds"]
    assert again["AWQ int4, g128"]["texts"]["pydoc"] == planted
    # kept layers that no longer load: the row is quantized again and scored on every text, its old scores dropped
    rtn_json = next((tmp_path / "tiny" / "rows").glob("engine-RTN*.json"))
    stale = json.loads(rtn_json.read_text())
    del stale["texts"]["idle"]
    stale["texts"]["code"] = planted
    rtn_json.write_text(json.dumps(stale))
    kept = tmp_path / "tiny" / "files" / "engine" / f"{frontier.slug('engine', 'RTN int4, g128')}.pt"
    kept.write_bytes(b"not a pickle")
    awq_json.write_text(awq_json.read_text()[:100])        # a row file cut short (a run killed while writing it)
    quantized = []
    monkeypatch.setattr(frontier, "engine_row", lambda *a: quantized.append(a[3]) or original_engine_row(*a))
    frontier.main(args)
    fresh = {r["row"]: r for r in map(json.loads, (s for s in capsys.readouterr().out.splitlines()
                                                   if s.startswith("{")))}
    assert quantized == [{"bits": 4, "group_size": 128}, {"group_size": 128}]     # both measured again, whole
    assert fresh["RTN int4, g128"]["texts"]["code"] != planted
    for label in first:                                                             # the same quantization again
        assert fresh[label]["texts"]["gpl3"] == first[label]["texts"]["gpl3"]
    texts = torch.load(tmp_path / "tiny" / "texts.pt")
    assert set(texts) == set(frontier_reference.TEXTS) and all(len(t) == 2 for t in texts.values())
    info = json.loads((tmp_path / "tiny" / "info.json").read_text())
    assert set(info["texts_sha256"]) == set(frontier_reference.TEXTS)


def test_the_spread_table_says_where_the_engine_is_not_below_on_every_text():
    def row(tool, bits, kls):
        return {"tool": tool, "row": f"{tool}{bits}", "bits": bits, "texts": {t: {"kl_nats": v} for t, v in kls.items()}}
    results = [row("engine", 4.0, {"a": 0.1, "b": 0.3}), row("llama.cpp", 4.1, {"a": 0.2, "b": 0.2}),
               row("engine", 8.0, {"a": 0.01, "b": 0.01}), row("llama.cpp", 8.5, {"a": 0.02, "b": 0.04})]
    assert frontier_report.ratios(results, ["a", "b"]) == {4.0: {"a": 0.5, "b": pytest.approx(1.5)},
                                                    8.0: {"a": 0.5, "b": 0.25}}
    table = frontier_report.spread_table(results, ["a", "b"]).splitlines()
    assert table[2] == "| ~4.0 | 0.50x | 1.50x | 0.50-1.50x | 0.87x | no |"
    assert table[3] == "| ~8.0 | 0.50x | 0.25x | 0.25-0.50x | 0.35x | yes |"


LLAMA_PYTHON = frontier_peers.clients.CACHE / "llamacpp" / "venv" / "bin" / "python"


@pytest.mark.skipif(not LLAMA_PYTHON.exists(), reason="llama.cpp's venv (benchmarks/clients.py builds it) is absent")
def test_llama_cpp_quantizes_iq2_only_with_our_imatrix_file(tmp_path):
    import subprocess
    from engine.formats.llama_cpp.gguf_file import GGUFFile
    model = llama_model()
    write_gguf(model, tmp_path / "f32.gguf")
    calibration = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    frontier.write_imatrix(frontier.importance(model, calibration), tmp_path / "imatrix.gguf", 4, 32)

    def quantize(out, *extra):
        return subprocess.run([str(LLAMA_PYTHON), str(frontier_peers.clients.RUNNERS), "quantize",
                               str(tmp_path / "f32.gguf"), str(out), "IQ2_XXS", *extra], capture_output=True, text=True)
    assert quantize(tmp_path / "plain.gguf").returncode != 0              # llama.cpp refuses IQ2 without one
    done = quantize(tmp_path / "iq2.gguf", "--imatrix", str(tmp_path / "imatrix.gguf"))
    assert done.returncode == 0, done.stderr[-500:]
    assert json.loads(done.stdout.splitlines()[-1])["imatrix_entries"] == 7
    with GGUFFile(tmp_path / "iq2.gguf") as f:
        assert {i.type_name for n, i in f.tensors.items() if n.startswith("blk.0.ffn_up")} == {"IQ2_XXS"}


@pytest.mark.parametrize("features,usable", [("AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 |", True),
                                             ("AVX2 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 |", False)])
def test_a_llama_cpp_build_with_amx_counts_as_not_installed(tmp_path, features, usable):
    """llama-cpp-python 0.3.36 built natively on an AMX CPU segfaults on a quantized GGUF: the client check rejects
    such a build (its system info lists AMX), so the portable build replaces it."""
    import subprocess
    (tmp_path / "llama_cpp.py").write_text(f"def llama_print_system_info():\n    return b'CPU : {features}'\n")
    done = subprocess.run([sys.executable, "-c", frontier_peers.clients.LLAMA_IMPORT], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path)}, capture_output=True)
    assert (done.returncode == 0) == usable
    flags = frontier_peers.clients.LLAMA_CMAKE_ARGS
    assert "GGML_NATIVE=OFF" in flags and "AMX" not in flags


def test_a_llama_cpp_venv_without_gguf_counts_as_not_installed(tmp_path):
    """A venv with llama_cpp but not the recipe's gguf (a half-finished install) is no client: its imatrix
    quantization would crash mid-run; the check says not installed instead."""
    import subprocess
    (tmp_path / "llama_cpp.py").write_text("def llama_print_system_info():\n    return b'CPU : AVX2 = 1 |'\n")
    (tmp_path / "gguf.py").write_text("raise ImportError('no gguf here')\n")
    done = subprocess.run([sys.executable, "-c", frontier_peers.clients.LLAMA_IMPORT], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path)}, capture_output=True)
    assert done.returncode != 0 and b"no gguf here" in done.stderr


def test_a_remedy_row_quantizes_on_its_own_calibration_mix(tmp_path, monkeypatch, tiny_reference):
    seen = []

    def engine_row(model, calibration, quantize, options):
        seen.append((calibration, options))
        return copy.deepcopy(model), 4.0, "counted"

    monkeypatch.setattr(frontier, "engine_row", engine_row)
    frontier.main(["--references", "tiny", "--tools", "engine", "--rows", "=engine GPTQ int4, g128",
                   "=engine GPTQ int4, g128, calibration pydoc + self", "--out", str(tmp_path), "--texts", "gpl3"])
    (plain, plain_options), (mixed, mixed_options) = seen
    assert plain_options == mixed_options == {"group_size": 128}          # calib is the row's, not the quantizer's
    assert plain.shape == mixed.shape == (2, 32) and not torch.equal(plain, mixed)
    assert torch.equal(torch.load(tmp_path / "tiny" / "calibration-pydoc+self.pt"), mixed)
