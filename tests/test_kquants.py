"""llama.cpp's K-quants (and Q4_0 ... Q8_0) written by the engine: round-to-nearest bit for bit against gguf-py's
quantize (where it has one) and llama.cpp's own libggml-base (through ctypes, where llama-cpp-python is installed),
every layout read back by gguf-py's dequantize, GPTQ's codes on the same grids (the same scales, a lower layer
error), the GGUF file and checkpoint folder round trips, and llama.cpp's fallback for rows not a multiple of 256.
(llama.cpp running the files: tests/test_interop_kquants.py.)"""
import copy
import ctypes
import dataclasses
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoints import gguf, gguf_file, gguf_writer, serving
from engine.formats.quantized_checkpoints import METHODS, load_quantized, save_quantized
from engine.formats.llama_cpp import bit_plan, ggml, ggml_quants
from engine.formats import gptq
from engine.formats.llama_cpp import gptq_ggml, refit
from engine.layers import quantized_linears
from engine.qwen3 import Qwen3, Qwen3Config

pytestmark = pytest.mark.usefixtures("one_thread")
gg = pytest.importorskip("gguf")

K = ggml.K_QUANTS
# rows of 256: K-quants fit every linear; rows of 96 (as SmolLM2's 576): all but down_proj fall back
K_CFG = Qwen3Config(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, num_hidden_layers=1)
FALLBACK_CFG = dataclasses.replace(K_CFG, hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                                   head_dim=32)


def weights(rows=16, cols=512, seed=0):
    """Weights that reach every branch of llama.cpp's quantizers: Gaussian, heavy-tailed, one-signed, sparse (with
    signed zeros), constant, tiny and huge rows; ties at exact halves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows * 8, cols, generator=g) * 0.02
    w[1::8] *= torch.rand(rows, cols, generator=g) ** 4 * 50
    w[2::8] = w[2::8].abs() + 0.01
    w[3::8] = -w[3::8].abs()
    w[4::8] *= torch.rand(rows, cols, generator=g) < 0.1
    w[4::8] = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -w[4::8], w[4::8])   # -0.0 and +0.0
    w[5::8] = 0.3
    w[6::8] = torch.randint(-8, 8, (rows, cols), generator=g) * 0.5
    w[7::8] *= torch.where(torch.arange(rows)[:, None] % 2 == 0, 1e-6, 1e3)
    return w


def libggml():
    """llama.cpp's libggml-base from the llama-cpp-python client (benchmarks/clients.py), or None."""
    root = Path(os.environ.get("ENGINE_CLIENTS", Path.home() / ".cache/engine/clients")) / "llamacpp" / "venv"
    found = sorted(root.glob("lib/python3*/site-packages/llama_cpp/lib/libggml-base.so"))
    if not found:
        return None
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


# ---- round-to-nearest: llama.cpp's bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_round_to_nearest_is_gguf_quantize_byte_for_byte(kind):
    """gguf-py's numpy port differs from llama.cpp on a block whose largest |w| is a signed zero (its d is +0, C's
    -0); the engine follows C there (the next test), so -0.0 is made +0.0 here."""
    w = weights() + 0.0
    theirs = gg.quants.quantize(w.numpy(), gg.GGMLQuantizationType[kind])
    assert np.array_equal(ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w)).numpy(), theirs)


@pytest.mark.interop
@pytest.mark.skipif(libggml() is None, reason="llama.cpp's libggml-base (install the llama.cpp client: "
                    "benchmarks/clients.py)")
@pytest.mark.parametrize("kind", ggml.INTEGER)
def test_round_to_nearest_is_llama_cpps_quantizer_byte_for_byte(kind):
    """ggml_quantize_chunk without an importance matrix: quantize_row_*_ref, what llama-quantize writes."""
    lib, w = libggml(), weights()
    type_id, block, size = ggml.GGML_TYPES[kind]
    x = np.ascontiguousarray(w.numpy())
    theirs = np.zeros(w.numel() // block * size, np.uint8)
    lib.ggml_quantize_chunk(type_id, x.ctypes.data, theirs.ctypes.data, 0, w.shape[0], w.shape[1], None)
    ours = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w)).reshape(-1).numpy()
    assert np.array_equal(ours, theirs), f"{(ours != theirs).sum()} bytes differ"


# ---- with an importance matrix: llama-quantize --imatrix's grids --------------------------------------------------

def importance(cols, seed=3):
    """An importance matrix row as skewed as real ones (a few inputs 1000x the rest), one input never active."""
    imp = torch.rand(cols, generator=torch.Generator().manual_seed(seed)) ** 3 * 10
    imp[5] = 0
    return imp


@pytest.mark.interop
@pytest.mark.skipif(libggml() is None, reason="llama.cpp's libggml-base (install the llama.cpp client: "
                    "benchmarks/clients.py)")
@pytest.mark.parametrize("kind,cols", [*((k, 512) for k in ggml.INTEGER),
                                       *((k, 576) for k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"))])
def test_importance_quantizer_is_llama_cpps_with_an_imatrix_byte_for_byte(kind, cols):
    """ggml_quantize_chunk with an importance matrix: quantize_row_*_impl (576: a 32-block type's sigma2 is the
    whole row's, not a block's)."""
    lib, w, imp = libggml(), weights(cols=cols), importance(cols)
    type_id, block, size = ggml.GGML_TYPES[kind]
    x, qw = np.ascontiguousarray(w.numpy()), np.ascontiguousarray(imp.numpy())
    theirs = np.zeros(w.numel() // block * size, np.uint8)
    lib.ggml_quantize_chunk(type_id, x.ctypes.data, theirs.ctypes.data, 0, w.shape[0], w.shape[1], qw.ctypes.data)
    ours = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w, imp)).reshape(-1).numpy()
    assert np.array_equal(ours, theirs), f"{(ours != theirs).sum()} bytes differ"


@pytest.mark.parametrize("kind", [k for k in ggml.INTEGER if k != "Q8_0"])
def test_an_importance_matrix_lowers_the_importance_weighted_error(kind):
    w, imp = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) * 0.02, importance(512)
    err = {}
    for name, given in (("plain", None), ("imatrix", imp)):
        raw = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w, given))
        err[name] = (imp * (ggml.dequantize(raw.reshape(-1), kind, tuple(w.shape)) - w) ** 2).sum()
    assert err["imatrix"] < 0.9 * err["plain"], err


def test_q8_0_has_no_importance_search_as_in_llama_cpp():
    w = weights(cols=256)
    assert torch.equal(gptq_ggml.rtn_ggml(w, "Q8_0", importance(256)), gptq_ggml.rtn_ggml(w, "Q8_0"))


def test_a_bad_importance_matrix_is_refused():
    w = weights(cols=256)
    with pytest.raises(ValueError, match=r"must have shape \(256,\), got \(255,\)"):
        ggml_quants.quantize("Q4_K", w, torch.ones(255))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and non-negative"):
            ggml_quants.quantize("Q4_K", w, torch.full((256,), bad))


# ---- the layouts, read by gguf-py -------------------------------------------------------------------------------

def random_fields(kind, blocks, g):
    """Codes and super-block fields over their whole ranges, and the weights GGML's formula gives them."""
    f16 = lambda: (torch.rand(blocks, generator=g) * 0.1).half().float()          # noqa: E731
    ints = lambda lo, hi, n: torch.randint(lo, hi + 1, (blocks, n), generator=g)  # noqa: E731
    codes = ints(0, gptq_ggml.LEVELS[kind] - 1, 256)
    d, dmin = f16(), f16()
    if kind == "Q2_K":
        sc, m = ints(0, 15, 16), ints(0, 15, 16)
        w = d[:, None, None] * sc[..., None] * codes.view(blocks, 16, 16) - (dmin[:, None] * m)[..., None]
        return codes, dict(d=d, dmin=dmin, sc=sc, m=m), w
    if kind == "Q3_K":
        sc = ints(0, 63, 16)
        return codes, dict(d=d, sc=sc), (d[:, None] * (sc - 32))[..., None] * (codes.view(blocks, 16, 16) - 4)
    if kind == "Q6_K":
        sc = ints(-128, 127, 16)
        return codes, dict(d=d, sc=sc), (d[:, None] * sc)[..., None] * (codes.view(blocks, 16, 16) - 32)
    sc, m = ints(0, 63, 8), ints(0, 63, 8)
    w = (d[:, None] * sc)[..., None] * codes.view(blocks, 8, 32) - (dmin[:, None] * m)[..., None]
    return codes, dict(d=d, dmin=dmin, sc=sc, m=m), w


@pytest.mark.parametrize("kind", K)
def test_k_quant_blocks_decode_in_gguf_to_ggmls_formula(kind):
    codes, fields, expected = random_fields(kind, 64, torch.Generator().manual_seed(1))
    raw = ggml_quants.blocks(kind, codes.reshape(8, -1), fields)
    theirs = torch.from_numpy(np.array(gg.quants.dequantize(raw.numpy(), gg.GGMLQuantizationType[kind])))
    assert torch.equal(theirs.reshape(-1), expected.reshape(-1).float())
    assert torch.equal(ggml.dequantize(raw.reshape(-1), kind, (8, 8 * 256)), theirs.reshape(8, -1))


@pytest.mark.parametrize("kind", ggml.INTEGER)
def test_the_layer_computes_what_gguf_decodes(kind):
    w = weights(cols=256)
    raw = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w))
    layer = gptq_ggml.ggml_layer(raw, kind, 256)
    theirs = np.array(gg.quants.dequantize(raw.numpy(), gg.GGMLQuantizationType[kind]))
    assert torch.equal(layer.dequantize(), torch.from_numpy(theirs).reshape(w.shape))
    _, block, size = ggml.GGML_TYPES[kind]
    assert layer.bits_per_weight == size * 8 / block                        # the file's bits, nothing else


# ---- GPTQ on the grids ------------------------------------------------------------------------------------------

def hessian(cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, cols, generator=g) @ (torch.eye(cols) + 0.2 * torch.randn(cols, cols, generator=g))
    x[:, :4] *= 8                                                           # a few outlier inputs
    return 2 * x.T @ x / len(x)


@pytest.mark.parametrize("kind", gptq_ggml.TYPES)
def test_gptq_on_a_ggml_grid_keeps_llama_cpps_imatrix_scales_and_lowers_the_layer_error(kind):
    """The grid is llama-quantize --imatrix's with the Hessian's diagonal as the importance (diag(H) / 2 = the mean
    x^2 llama-imatrix records); only the codes differ."""
    w, H = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 0.05, hessian(256)
    rtn = gptq_ggml.rtn_ggml(w, kind, torch.diag(H) / 2)
    ours = gptq_ggml.gptq_ggml(w, H, kind, gptq.visit_order(torch.diag(H), 32, "act_order"), refit=False)
    shape = tuple(w.shape)
    _, rtn_scale, rtn_offset = ggml.grid(rtn.reshape(-1), kind, shape)
    codes, scale, offset = ggml.grid(ours.reshape(-1), kind, shape)
    assert torch.equal(scale, rtn_scale) and torch.equal(offset, rtn_offset)       # only the codes differ
    err = {name: gptq.layer_error(ggml.dequantize(raw.reshape(-1), kind, shape), w, H)
           for name, raw in (("gptq", ours), ("rtn", rtn), ("plain rtn", gptq_ggml.rtn_ggml(w, kind)))}
    # llama.cpp's imatrix rounding already weighs the outlier inputs: GPTQ's gain over it is the smaller one
    assert err["gptq"] < 0.7 * err["rtn"] and err["gptq"] < 0.4 * err["plain rtn"], err


@pytest.mark.parametrize("kind", ["Q2_K", "Q4_K", "Q5_K"])
def test_gptq_without_correlated_inputs_is_llama_cpps_imatrix_round_to_nearest(kind):
    """With H = I no error is fed forward: each weight is rounded on the stored grid, as llama.cpp rounds it with
    an importance matrix of equal entries."""
    w = weights(cols=256)
    ours = gptq_ggml.gptq_ggml(w, torch.eye(256), kind, refit=False)
    assert torch.equal(ours, gptq_ggml.rtn_ggml(w, kind, torch.full((256,), 0.5)))


@pytest.mark.parametrize("kind", refit.REFIT)
def test_refit_scales_keep_the_codes_and_lower_every_rows_layer_error(kind):
    """The scales refit to GPTQ's codes by least squares in H's norm, rounded to f16 and kept per row only where
    they help: the codes and the integer sub-block scales stay, no row's error rises, the layer's falls."""
    w, H = torch.randn(48, 512, generator=torch.Generator().manual_seed(2)) * 0.05, hessian(512)
    perm = gptq.visit_order(torch.diag(H), 32, "act_order")
    before, after = (gptq_ggml.gptq_ggml(w, H, kind, perm, refit=r) for r in (False, True))
    shape = tuple(w.shape)
    assert torch.equal(ggml.grid(before.reshape(-1), kind, shape)[0], ggml.grid(after.reshape(-1), kind, shape)[0])
    rows = {}
    for name, raw in (("before", before), ("after", after)):
        w_hat = ggml.dequantize(raw.reshape(-1), kind, shape)
        rows[name] = torch.tensor([gptq.layer_error(w_hat[i:i + 1], w[i:i + 1], H) for i in range(len(w))])
    assert (rows["after"] <= rows["before"]).all()
    assert (rows["after"] < rows["before"]).sum() >= len(w) // 4, rows      # Q6_K's 16 sub-scales leave least


def test_refit_scales_in_row_chunks_equal_the_whole_layer_at_once(monkeypatch):
    """The refit's working set is bounded (a 14336-wide layer would otherwise need rows x blocks x in floats at
    once): solved a few rows at a time, the same scales come out. (Not asserted bit for bit: a BLAS may sum a
    matrix product of 3 rows in another order than one of 20, and an f16 rounding can then flip.)"""
    w, H = torch.randn(20, 512, generator=torch.Generator().manual_seed(3)) * 0.05, hessian(512)
    codes, fields = ggml_quants.quantize("IQ4_NL", w, torch.diag(H) / 2)
    whole = refit.refit_scales(w, H, "IQ4_NL", codes, fields)["d"]
    monkeypatch.setattr(refit, "REFIT_SCALARS", 3 * 16 * 512)          # 3 rows at a time, a ragged last chunk
    chunked = refit.refit_scales(w, H, "IQ4_NL", codes, fields)["d"]
    assert (chunked == whole).float().mean() > 0.97
    assert ((chunked - whole).abs() <= whole.abs() * 2 ** -10).all()        # at most one f16 step apart
    assert (whole != fields["d"]).float().mean() > 0.5                     # the refit changed most scales


def test_gptq_without_an_imatrix_keeps_llama_cpps_plain_grid():
    w, H = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 0.05, hessian(256)
    ours = gptq_ggml.gptq_ggml(w, H, "Q4_K", imatrix=False, refit=False)       # (a refit would move d and dmin)
    _, scale, offset = ggml.grid(ours.reshape(-1), "Q4_K", tuple(w.shape))
    _, plain_scale, plain_offset = ggml.grid(gptq_ggml.rtn_ggml(w, "Q4_K").reshape(-1), "Q4_K", tuple(w.shape))
    assert torch.equal(scale, plain_scale) and torch.equal(offset, plain_offset)
    _, imatrix_scale, _ = ggml.grid(gptq_ggml.gptq_ggml(w, H, "Q4_K", refit=False).reshape(-1), "Q4_K",
                                    tuple(w.shape))
    assert not torch.equal(imatrix_scale, plain_scale)


def test_rows_not_a_multiple_of_256_fall_back_as_llama_cpp_does():
    assert {t: gptq_ggml.ggml_type_for(t, 576) for t in K} == \
        {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
    assert gptq_ggml.ggml_type_for("Q4_K", 1536) == "Q4_K"
    with pytest.raises(ValueError, match="Q4_0 needs rows of a multiple of 32 weights, got 100"):
        gptq_ggml.ggml_type_for("Q3_K", 100)
    with pytest.raises(ValueError, match="ggml_type must be one of"):
        gptq_ggml.ggml_type_for("Q7_K", 256)


# ---- whole models: GGUF files and checkpoint folders ------------------------------------------------------------

def calibration_ids(vocab=256):
    return torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))


def quantized_model(cfg, ggml_type, seed=0):
    torch.manual_seed(seed)
    model = Qwen3(cfg).eval()
    qcfg = gptq_ggml.quantize(model, calibration_ids(), ggml_type=ggml_type)
    return model, qcfg


def logits(model):
    with torch.no_grad():
        return model(calibration_ids()[:2, :9])


def test_gptq_k_quant_model_goes_into_gguf_block_for_block_and_reads_back(tmp_path):
    model, qcfg = quantized_model(FALLBACK_CFG, "Q4_K")
    plan = qcfg["ggml_types"]
    assert plan == {**dict.fromkeys(plan, "Q5_0"), "mlp.down_proj": "Q4_K"}               # 96-wide rows fall back
    report = gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    assert report["types"] == {"Q5_0": 6, "Q4_K": 1}
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        for name, layer in quantized_linears(model).items():
            key = gguf_writer.gguf_name(name + ".weight")
            assert f.tensors[key].type_name == layer.ggml_type and torch.equal(f.raw(key), layer.raw.reshape(-1))
    assert torch.equal(logits(gguf.load_gguf(tmp_path / "m.gguf")), logits(model))


def test_checkpoint_folder_keeps_the_blocks_and_exports_the_same_gguf(tmp_path):
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    save_quantized(model, tmp_path / "ck", "gptq", calibration_ids(), ggml_type="Q3_K")
    loaded = load_quantized(tmp_path / "ck")
    assert {n: layer.ggml_type for n, layer in quantized_linears(loaded).items()} == \
        dict.fromkeys(quantized_linears(model), "Q3_K")
    assert torch.equal(logits(loaded), logits(model))
    serving.export_gguf(tmp_path / "ck", tmp_path / "a.gguf")
    gguf_writer.write_gguf(model, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_bad_ggml_requests_are_refused_before_any_work():
    with pytest.raises(ValueError, match="ggml_type '.*' is not one of"):
        quantized_model(K_CFG, "Q7_K")
    with pytest.raises(ValueError, match="GGML blocks store no column permutation"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), ggml_type="Q4_K", order="act_order")
    with pytest.raises(ValueError, match="only llama.cpp loads"):
        serving.check_target("vllm", "gptq", {"ggml_type": "Q4_K"})
    with pytest.raises(ValueError, match="ggml_type 'Q9_K' is not one of"):          # the one check of options
        METHODS["gptq"].checked({"ggml_type": "Q9_K"})
    with pytest.raises(ValueError, match=r"option ggml_type of method 'gptq' must be one of .*, got \['Q4_K'\]"):
        METHODS["gptq"].checked({"ggml_type": ["Q4_K"]})
    with pytest.raises(ValueError, match="ggml_type 'Q4_X' is not one of"):
        gptq_ggml.validate({"quant_method": "gptq", "checkpoint_format": "ggml", "ggml_type": "Q4_X"})
    with pytest.raises(ValueError, match="imatrix=False chooses the grid of a GGML type"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), imatrix=False)


def test_the_config_records_which_grid_gptq_used():
    assert quantized_model(FALLBACK_CFG, "Q4_K")[1]["imatrix"] is True
    assert gptq_ggml.quantize(Qwen3(FALLBACK_CFG).eval(), calibration_ids(), ggml_type="Q4_K", imatrix=False)["imatrix"] \
        is False


# ---- a bits budget: the mix of types ----------------------------------------------------------------------------

def test_choose_spends_the_budget_where_the_error_falls_most():
    # "a" loses much error per extra bit, "b" little: the budget buys a's upgrade first
    table = {"a": {"lo": (100, 50.0), "mid": (200, 10.0), "hi": (300, 9.0)},
             "b": {"lo": (100, 5.0), "mid": (200, 3.0), "hi": (300, 2.5)},
             "c": {"lo": (100, 1.0), "worse": (200, 2.0)}}                  # more bits, more error: never taken
    assert bit_plan.choose(table, 300) == {"a": "lo", "b": "lo", "c": "lo"}
    assert bit_plan.choose(table, 400) == {"a": "mid", "b": "lo", "c": "lo"}
    assert bit_plan.choose(table, 500) == {"a": "mid", "b": "mid", "c": "lo"}
    with pytest.raises(ValueError, match="below the cheapest choice"):
        bit_plan.choose(table, 299)


def test_choose_spends_what_the_greedy_walk_leaves_on_the_best_change_that_fits():
    # a's hull step lo -> hi does not fit; mid, off a's hull, does, and saves more than anything else left
    table = {"a": {"lo": (100, 10.0), "mid": (220, 6.0), "hi": (300, 1.0)},
             "b": {"lo": (100, 5.0), "mid": (110, 4.9)}}
    assert bit_plan.choose(table, 330) == {"a": "mid", "b": "mid"}
    assert bit_plan.choose(table, 400) == {"a": "hi", "b": "lo"}


def test_choose_is_never_worse_than_any_choice_it_could_afford_on_small_tables():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        table = {n: {o: (int(b), float(c)) for o, b, c in zip("xyz", torch.randint(1, 9, (3,), generator=g) * 50,
                                                               torch.rand(3, generator=g))} for n in "abc"}
        budget = float(torch.randint(150, 1200, (), generator=g))
        combos = [dict(zip("abc", c)) for c in itertools.product("xyz", repeat=3)]
        fits = [c for c in combos if sum(table[n][o][0] for n, o in c.items()) <= budget]
        if not fits:
            continue
        chosen = bit_plan.choose(table, budget)
        cost = lambda c: sum(table[n][o][1] for n, o in c.items())                  # noqa: E731
        assert sum(table[n][o][0] for n, o in chosen.items()) <= budget
        # uniform choices (one option everywhere) that fit are never better
        assert all(cost(chosen) <= cost(c) + 1e-12 for c in fits if len(set(c.values())) == 1)


def _fisher_by_whole_backward(model, ids):
    """The textbook output Fisher: the whole model's backward, a sequence at a time, y drawn as output_fisher draws
    them (one generator, sequences in order)."""
    sums, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers."):
            def hook(module, args, out, name=name):
                out.register_hook(lambda g: sums.__setitem__(name, sums.get(name, 0) + g.double().pow(2).sum((0, 1))))
            hooks.append(m.register_forward_hook(hook))
    generator = torch.Generator().manual_seed(0)
    for row in ids:
        logp = torch.log_softmax(model(row[None])[0].float(), -1)
        y = torch.multinomial(logp.detach().exp(), 1, generator=generator)
        logp.gather(1, y).sum().backward()
    for h in hooks:
        h.remove()
    return {name: (s / ids.numel()).float() for name, s in sums.items()}


def test_output_fisher_layer_by_layer_equals_the_whole_models_backward():
    """One layer at a time (what the converter can hold) gives the textbook's G, from the first `sequences` only,
    and leaves the weights' .grad alone."""
    from engine.formats.numerics.calibration import first_layer_batches
    from engine.formats.numerics.sensitivity import output_fisher
    torch.manual_seed(0)
    model = Qwen3(dataclasses.replace(FALLBACK_CFG, num_hidden_layers=2)).eval()
    ids = torch.randint(0, 256, (7, 24), generator=torch.Generator().manual_seed(1))
    G = output_fisher(model, first_layer_batches(model, ids, 2), sequences=5)
    assert all(p.grad is None for p in model.parameters())
    reference = _fisher_by_whole_backward(model, ids[:5])
    assert set(G) == set(reference) and len(G) == 14
    for name in G:
        assert torch.allclose(G[name], reference[name], rtol=1e-4, atol=1e-12), name
    with pytest.raises(ValueError, match="sequences >= 1"):
        output_fisher(model, first_layer_batches(model, ids, 2), sequences=0)


def test_the_output_fisher_prices_a_weight_error_in_nats_of_kl():
    """The planner's currency: for a small error E on one linear, 1/4 sum_o G_o e_o H e_o^T is the KL the model's
    output moves by (measured on the same tokens) within a factor 1.6 on every linear of the layer (o_proj is the
    farthest, 1.5x here: its input and its output gradient are not independent, K-FAC's assumption; the others are
    within 10%); the layer's own error tr(E H E^T) per nat of KL differs between the linears by 300x."""
    from engine.formats.numerics.calibration import capture, first_layer_batches
    from engine.formats.numerics.sensitivity import output_fisher
    torch.manual_seed(0)
    model, ids = Qwen3(K_CFG).eval(), calibration_ids()
    G = output_fisher(model, first_layer_batches(model, ids, 8), sequences=len(ids))
    with torch.no_grad():
        reference = torch.log_softmax(model(ids), -1)
    ratios, per_layer_error = {}, {}
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                         and n.startswith("model.layers.")]:
        H = capture({name: linear}, [ids], lambda b, x: model(x))[name].hessian.double()
        E = torch.randn(linear.weight.shape, generator=torch.Generator().manual_seed(3)) * linear.weight.std() * 0.03
        moved = copy.deepcopy(model)
        with torch.no_grad():
            moved.get_submodule(name).weight += E
            kl = float((reference.exp() * (reference - torch.log_softmax(moved(ids), -1))).sum(-1).mean())
        rows = ((E.double() @ H) * E.double()).sum(1)
        ratios[name] = float(G[name].double() @ rows.detach()) / 4 / kl
        per_layer_error[name] = float(rows.detach().sum()) / kl
    assert all(0.67 < r < 1.6 for r in ratios.values()), ratios
    assert max(per_layer_error.values()) / min(per_layer_error.values()) > 100, per_layer_error


def test_the_plan_scores_each_type_by_the_layer_error_gptq_leaves_with_it():
    """layer_errors' cost of a type is s_l x GPTQ's own layer error tr(E H E^T) on that grid (one sensitivity per
    linear, whatever the type); on every row it is exactly that, on every k-th row an estimate of it; and GPTQ's
    error, not round-to-nearest's: below the RTN error on the same grid."""
    from engine.formats.numerics.calibration import decoder_layers
    torch.manual_seed(0)
    layer = next(decoder_layers(Qwen3(K_CFG).eval(), calibration_ids(), 8, "gptq", "quantized"))
    name = layer.prefix + "mlp.down_proj"
    full = gptq_ggml.layer_errors(layer, ["mlp.down_proj"], rows=10 ** 6)[name]
    sampled = gptq_ggml.layer_errors(layer, ["mlp.down_proj"], rows=64)[name]
    W, H = layer.module(name).weight.detach().float(), layer.capture(["mlp.down_proj"])[name].hessian

    def error(raw, kind):
        return gptq.layer_error(ggml.dequantize(raw.reshape(-1), kind, W.shape), W, H)

    exact = {kind: error(gptq_ggml.gptq_ggml(W, H, kind, gptq_ggml.visit_order(
        torch.diag(H), gptq_ggml.group_size(kind), gptq_ggml.DEFAULT_ORDER)), kind) for kind in full}
    ratios = [full[kind][1] / exact[kind] for kind in full]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)              # one s_l for every type
    assert all(0.5 < sampled[k][1] / full[k][1] < 2 for k in full)          # 64 of 256 rows: an estimate
    rtn = error(gptq_ggml.rtn_ggml(W, "Q4_K", torch.diag(H) / 2), "Q4_K")
    assert exact["Q4_K"] < rtn
    costs = [full[k][1] for k in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")]
    assert costs == sorted(costs, reverse=True)


def test_the_plan_prices_each_type_by_gptqs_error_under_the_output_fisher():
    """plan="fisher": layer_errors' cost of a type is sum_o G_o e_o H e_o^T of the error e GPTQ leaves on that grid:
    exactly that on every row, an estimate on every k-th row; GPTQ's error, not round-to-nearest's (below RTN's on
    the same grid); and no cost without the model's Fisher."""
    from engine.formats.numerics.calibration import decoder_layers
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    layer = next(decoder_layers(model, calibration_ids(), 8, "gptq", "quantized", fisher=True))
    name = layer.prefix + "mlp.down_proj"
    full = gptq_ggml.layer_errors(layer, ["mlp.down_proj"], rows=10 ** 6, plan="fisher")[name]
    sampled = gptq_ggml.layer_errors(layer, ["mlp.down_proj"], rows=64, plan="fisher")[name]
    W, H = layer.module(name).weight.detach().float(), layer.capture(["mlp.down_proj"])[name].hessian

    def cost(raw, kind):
        E = (ggml.dequantize(raw.reshape(-1), kind, W.shape) - W).double()
        return float(layer.fisher[name].double() @ ((E @ H.double()) * E).sum(1))

    exact = {kind: cost(gptq_ggml.gptq_ggml(W, H, kind, gptq_ggml.visit_order(
        torch.diag(H), gptq_ggml.group_size(kind), gptq_ggml.DEFAULT_ORDER)), kind) for kind in full}
    assert all(full[kind][1] == pytest.approx(exact[kind], rel=1e-9) for kind in full)
    assert all(0.5 < sampled[k][1] / full[k][1] < 2 for k in full)          # 64 of 256 rows: an estimate
    assert exact["Q4_K"] < cost(gptq_ggml.rtn_ggml(W, "Q4_K", torch.diag(H) / 2), "Q4_K")
    costs = [full[k][1] for k in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")]
    assert costs == sorted(costs, reverse=True)
    layer.fisher = None
    with pytest.raises(ValueError, match="output Fisher"):
        gptq_ggml.layer_errors(layer, ["mlp.down_proj"], plan="fisher")


def test_a_bpw_budget_mixes_k_quants_and_the_file_meets_it(tmp_path):
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    qcfg = gptq_ggml.quantize(model, calibration_ids(), bpw=4.0)                           # a budget alone: a mix
    assert qcfg["ggml_type"] == "mix" and qcfg["bpw"] == 4.0 and len(set(qcfg["ggml_types"].values())) > 1
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        linears = [info for key, info in f.tensors.items() if key.split(".")[-2] in gguf.LINEARS]
        bits = sum(f.raw(key).numel() * 8 for key in f.tensors if key.split(".")[-2] in gguf.LINEARS)
    assert bits <= 4.0 * sum(int(np.prod(info.shape)) for info in linears)
    with pytest.raises(ValueError, match=r"option bpw of method 'gptq' must be a number in \[2.625, 8.5\], got 2.5"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), ggml_type="mix", bpw=2.5)
    with pytest.raises(ValueError, match="needs a bits budget"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), ggml_type="mix")
    with pytest.raises(ValueError, match=r"plan='fisher' prices the candidates of a bits budget's mix; it needs bpw"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), ggml_type="Q4_K", plan="fisher")
    with pytest.raises(ValueError, match=r"option plan of method 'gptq' must be one of 'layer_output', 'fisher'"):
        gptq_ggml.quantize(Qwen3(K_CFG).eval(), calibration_ids(), bpw=4.5, plan="kl")


@pytest.mark.parametrize("plan", gptq_ggml.PLANS)
@pytest.mark.parametrize("budget,single", [(4.5, "Q4_K"), (5.5, "Q5_K")])
def test_a_budget_is_spent_within_one_percent_and_beats_the_single_type_of_its_size(budget, single, plan):
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = torch.log_softmax(model(ids), -1)

    def quantized(**options):
        m = copy.deepcopy(model)
        qcfg = gptq_ggml.quantize(m, calibration_ids(), **options)
        layers = quantized_linears(m).values()
        bits = sum(q.storage_bits() for q in layers) / sum(q.in_features * q.out_features for q in layers)
        with torch.no_grad():
            kl = float((reference.exp() * (reference - torch.log_softmax(m(ids), -1))).sum(-1).mean())
        return bits, kl, qcfg

    (mix_bits, mix_kl, qcfg), (bits, kl, _) = quantized(bpw=budget, plan=plan), quantized(ggml_type=single)
    assert qcfg["plan"] == plan and qcfg["bpw"] == budget          # the config records the currency, not the types
    assert 0.99 * budget <= mix_bits <= budget and bits == budget
    assert mix_kl < kl, (mix_kl, kl)


@pytest.mark.parametrize("method, bpw, reach", [("gptq", "9", "2.625 to 8.5"), ("gptq", "2.5", "2.625 to 8.5"),
                                                ("entquant", "6.5", "1.5 to 6.0")])
def test_cli_refuses_a_bpw_its_method_cannot_reach_before_any_work(tmp_path, method, bpw, reach):
    from test_cli import run
    out = run("quantize", "--method", method, "--bpw", bpw, "--out", str(tmp_path / "m"))
    assert out.returncode == 1 and out.stderr.startswith(f"error: --bpw {float(bpw)}: {method} reaches {reach}")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("target", [[], ["--target", "llama.cpp"]])      # its defaults (group size 32) are not blamed
@pytest.mark.parametrize("option,error", [("imatrix=false", "imatrix=False chooses the grid of a GGML type"),
                                          ("plan=fisher", "plan='fisher' prices the candidates of a bits budget's "
                                                          "mix; it needs bpw")])
def test_cli_refuses_a_grid_option_without_a_ggml_type_before_any_work(tmp_path, target, option, error):
    from test_cli import run
    out_path = tmp_path / ("m.gguf" if target else "m")
    out = run("quantize", "--method", "gptq", "--option", option, *target, "--out", str(out_path))
    assert out.returncode == 1 and out.stderr.startswith(f"error: {error}")
    assert not out_path.exists()


@pytest.mark.slow
def test_cli_writes_a_k_quant_mix_for_llama_cpp_within_the_budget(tmp_path):
    from test_cli import run
    out = run("quantize", "--method", "gptq", "--target", "llama.cpp", "--bpw", "4.25", "--steps", "2",
              "--out", str(tmp_path / "mix.gguf"))
    assert out.returncode == 0, out.stderr
    with gguf_file.GGUFFile(tmp_path / "mix.gguf") as f:
        keys = [k for k in f.tensors if k.split(".")[-2] in gguf.LINEARS]
        types = {f.tensors[k].type_name for k in keys}
        bits = sum(f.raw(k).numel() * 8 for k in keys) / sum(int(np.prod(f.tensors[k].shape)) for k in keys)
        params = sum(int(np.prod(info.shape)) for info in f.tensors.values())
    assert bits <= 4.25 and len(types) > 1 and types <= {*K, *ggml.IQ4}
    # the summary line: the linears' bits and, beside them, the whole file's bits per parameter (embedding included)
    whole = 8 * (tmp_path / "mix.gguf").stat().st_size / params
    assert f"{bits:.3f} bits per quantized weight" in out.stderr and whole > bits
    assert f"{whole:.3f} bits per parameter in the whole file(s)" in out.stderr.splitlines()[-1], out.stderr
    out = run("quantize", "--method", "gptq", "--target", "llama.cpp", "--option", "ggml_type=Q4_Z",
              "--out", str(tmp_path / "bad.gguf"))
    assert out.returncode == 1 and out.stderr.startswith("error: ggml_type 'Q4_Z' is not one of")


@pytest.mark.parametrize("kind", ggml.INTEGER)
def test_a_gguf_file_of_any_integer_type_is_written_back_byte_for_byte(tmp_path, kind):
    """Blocks the engine did not make (random bytes, as any tool may write them) go back out exactly as read."""
    from test_gguf import K_CFG as READ_CFG, U32, gguf_bytes, qwen3_metadata, qwen3_tensors, write
    torch.manual_seed(0)
    tensors, _ = qwen3_tensors(Qwen3(READ_CFG).eval(), kind)
    source = write(tmp_path, gguf_bytes(qwen3_metadata(READ_CFG) + [("qwen3.vocab_size", U32, 64)], tensors))
    written, report = gguf_writer.model_tensors(gguf.load_gguf(source))
    assert report["types"] == {kind: 14}
    with gguf_file.GGUFFile(source) as f:
        assert all(torch.equal(f.raw(name), raw) for name, type_name, _, raw in written if type_name == kind)


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_export_refuses_a_source_whose_digests_do_not_match(tmp_path, source):
    """`export` reads through the verified loaders: one flipped byte in a quantized tensor of an engine GGUF or an
    engine checkpoint folder is refused naming the tensor, and no output is written (a copy without the check would
    carry the damage into a new GGUF with fresh digests)."""
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    if source == "gguf":
        gguf_writer.write_gguf(quantized_model(K_CFG, "Q4_K")[0], tmp_path / "src")
        with gguf_file.GGUFFile(tmp_path / "src") as f:
            info = f.tensors[gguf_writer.gguf_name("model.layers.0.mlp.down_proj.weight")]
            at = info.offset + info.nbytes // 2
        target = tmp_path / "src"
    else:
        save_quantized(model, tmp_path / "src", "gptq", calibration_ids(), ggml_type="Q4_K")
        target = next((tmp_path / "src").glob("*.safetensors"))
        at = target.stat().st_size - 7                                   # inside the last tensor's bytes
    data = bytearray(target.read_bytes())
    data[at] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256|digest|SHA-256"):
        serving.export_gguf(tmp_path / "src", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_a_budget_the_row_widths_cannot_meet_is_refused_before_quantizing(tmp_path):
    """Rows of 96 (not a multiple of 256) have no GGML type below 4.5 bits: a --bpw under what the cheapest types
    reach is one error line from the config alone, and nothing is written."""
    from engine.formats.llama_cpp.gptq_ggml import check_budget
    from engine.loaders import save_dense
    from test_cli import run
    with pytest.raises(ValueError, match=r"allow no GGML mix below 4\.\d+ bits per weight"):
        check_budget(FALLBACK_CFG, 4.0)
    check_budget(K_CFG, 2.7)                                     # rows of 256: Q2_K's 2.625 bits are reachable
    torch.manual_seed(0)
    model = Qwen3(FALLBACK_CFG).eval()
    for calibration in (None, calibration_ids()):               # the library too, before its calibration pass
        with pytest.raises(ValueError, match=r"allow no GGML mix below 4\.\d+ bits per weight"):
            gptq_ggml.quantize(model, calibration, bpw=3.0)
    save_dense(model, tmp_path / "m")
    out = run("quantize", "--model", str(tmp_path / "m"), "--method", "gptq", "--target", "llama.cpp", "--bpw",
              "3.0", "--calib", "self", "--out", str(tmp_path / "q.gguf"))
    assert out.returncode == 1 and "allow no GGML mix below" in out.stderr.splitlines()[-1], out.stderr
    assert not (tmp_path / "q.gguf").exists()
