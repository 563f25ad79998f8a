"""llama.cpp's IQ4_NL and IQ4_XS (engine/formats/llama_cpp/iq4.py, ggml.py): its quantizer ported byte for byte
(checked against libggml through ctypes, with and without an importance matrix), blocks decoded as gguf-py decodes
them, GPTQ's codes on their grids, and files llama.cpp reads."""
import numpy as np
import pytest
import torch

from engine.formats import gptq
from engine.formats.llama_cpp import gptq_ggml
from engine.formats.llama_cpp import ggml, ggml_quants, iq4
from test_gguf import random_blocks
from test_kquants import hessian, importance, libggml, weights

gg = pytest.importorskip("gguf")
IQ4 = ggml.IQ4


@pytest.mark.interop
@pytest.mark.skipif(libggml() is None, reason="llama.cpp's libggml-base (install the llama.cpp client: "
                    "benchmarks/clients.py)")
@pytest.mark.parametrize("imatrix", [False, True])
@pytest.mark.parametrize("cols", [512, 768])
@pytest.mark.parametrize("kind", IQ4)
def test_the_quantizer_is_llama_cpps_byte_for_byte(kind, cols, imatrix):
    """ggml_quantize_chunk (what llama-quantize runs, --imatrix or not) on weights that reach every branch: zero
    blocks, one-signed blocks, ties, huge and tiny rows; 768 = 3 super-blocks, so per-block state cannot leak."""
    lib, w = libggml(), weights(cols=cols)
    imp = importance(cols) if imatrix else None
    type_id, block, size = ggml.GGML_TYPES[kind]
    x = np.ascontiguousarray(w.numpy())
    qw = None if imp is None else np.ascontiguousarray(imp.numpy())
    theirs = np.zeros(w.numel() // block * size, np.uint8)
    lib.ggml_quantize_chunk(type_id, x.ctypes.data, theirs.ctypes.data, 0, w.shape[0], w.shape[1],
                            None if qw is None else qw.ctypes.data)
    ours = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w, imp)).reshape(-1).numpy()
    assert np.array_equal(ours, theirs), f"{(ours != theirs).sum()} bytes differ"


def test_best_index_is_the_nearest_level_ties_going_up():
    levels = iq4.K
    mids = (levels[:-1] + levels[1:]) / 2
    x = torch.cat([levels, mids, mids - 0.25, mids + 0.25, torch.tensor([-1e5, -127.5, 113.5, 1e5])])
    brute = (x[:, None] - levels[None]).abs()
    nearest = torch.where(brute == brute.min(1, keepdim=True).values, torch.arange(16), -1).amax(1)   # ties: up
    assert torch.equal(iq4.best_index(x), nearest)


@pytest.mark.parametrize("kind", IQ4)
def test_random_blocks_decode_as_gguf_py_decodes_them(kind):
    """Every nibble and every 6-bit sub-block scale (IQ4_XS), read by the reference decoder and by the layer."""
    raw = random_blocks(kind, 16, 512, seed=1, scale=1.0)
    theirs = torch.from_numpy(np.array(gg.quants.dequantize(raw.numpy(), gg.GGMLQuantizationType[kind])))
    assert torch.equal(ggml.dequantize(raw, kind, (16, 512)), theirs.reshape(16, 512))
    layer = ggml.quantized_linear(raw, kind, (16, 512))
    assert torch.equal(layer.dequantize(), theirs.reshape(16, 512))
    assert layer.bits_per_weight == {"IQ4_NL": 4.5, "IQ4_XS": 4.25}[kind]


@pytest.mark.parametrize("kind", IQ4)
def test_blocks_read_back_to_the_same_bytes(kind):
    raw = random_blocks(kind, 8, 512, seed=2)
    codes, scale, _ = ggml.grid(raw, kind, (8, 512))
    if kind == "IQ4_NL":
        again = ggml.encode_iq4(kind, codes, scale.reshape(-1))
    else:
        d = raw.reshape(-1, 136)[:, :2].contiguous().view(torch.float16).float().reshape(-1)
        l_j = (scale.reshape(-1, 8) / d[:, None] + 32).round()
        again = ggml.encode_iq4(kind, codes, d, l_j)
    assert torch.equal(again, raw)


def test_codes_that_are_no_level_are_refused():
    with pytest.raises(ValueError, match="not one of the levels kvalues_iq4nl"):
        ggml.encode_iq4("IQ4_NL", torch.full((1, 32), 130, dtype=torch.uint8), torch.ones(1))


def test_an_importance_matrix_lowers_the_importance_weighted_error():
    w, imp = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) * 0.02, importance(512)
    for kind in IQ4:
        err = {}
        for name, given in (("plain", None), ("imatrix", imp)):
            raw = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, w, given))
            err[name] = (imp * (ggml.dequantize(raw.reshape(-1), kind, tuple(w.shape)) - w) ** 2).sum()
        assert err["imatrix"] < 0.9 * err["plain"], (kind, err)


def test_non_uniform_levels_fit_gaussian_weights_closer_than_q4_0():
    """The reason the type exists: at the same 4.5 bits, 16 levels placed for bell-shaped weights beat 16 evenly
    spaced ones."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(5))
    err = {kind: (ggml.dequantize(gptq_ggml.rtn_ggml(w, kind).reshape(-1), kind, tuple(w.shape)) - w).pow(2).mean()
           for kind in ("IQ4_NL", "Q4_0")}
    assert err["IQ4_NL"] < 0.85 * err["Q4_0"], err


def test_iq4_xs_rows_not_a_multiple_of_256_fall_back_to_iq4_nl():
    assert gptq_ggml.ggml_type_for("IQ4_XS", 576) == "IQ4_NL"
    assert gptq_ggml.ggml_type_for("IQ4_XS", 1536) == "IQ4_XS"


@pytest.mark.parametrize("kind", IQ4)
def test_gptq_keeps_llama_cpps_scales_and_only_picks_levels(kind):
    """GPTQ on an IQ4 grid (before the scales are refit, test_kquants): the scales are llama-quantize
    --imatrix's (importance diag(H) / 2), every code is one of the 16 levels, and feeding the error forward lowers
    the layer error below llama.cpp's own rounding."""
    w, H = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 0.05, hessian(256)
    rtn = gptq_ggml.rtn_ggml(w, kind, torch.diag(H) / 2)
    ours = gptq_ggml.gptq_ggml(w, H, kind, gptq.visit_order(torch.diag(H), 32, "act_order"), refit=False)
    codes, scale, _ = ggml.grid(ours.reshape(-1), kind, tuple(w.shape))
    assert torch.equal(scale, ggml.grid(rtn.reshape(-1), kind, tuple(w.shape))[1])
    assert torch.isin(codes, (iq4.K + 128).to(torch.uint8)).all()
    err = {name: gptq.layer_error(ggml.dequantize(raw.reshape(-1), kind, tuple(w.shape)), w, H)
           for name, raw in (("gptq", ours), ("rtn", rtn))}
    assert err["gptq"] < 0.7 * err["rtn"], err
