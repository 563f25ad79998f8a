"""KV-cache quantization (engine/formats/kv/kv_cache.py, kv_baselines.py): HyperQuant's dither makes every inner
product unbiased; the baselines' grids are llama.cpp's, vLLM's and KIVI's; the residual window is exactly the
per-query rule (exact if t - s < R) in prefill and in generate; and every stored bit is counted."""
import contextlib
import math

import numpy as np
import pytest
import torch
from helpers import random_ids as ids
from torch._dynamo.utils import counters

from engine.coding import rice
from engine.formats.llama_cpp import ggml, ggml_quants
from engine.formats.kv import kv_baselines, kv_cache
from engine.formats.numerics.lattices import LATTICES
from engine.qwen3 import KVCache, Qwen3, Qwen3Config, apply_rope, rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model, quantizer, x):
    if quantizer is not None:
        kv_cache.install(model, quantizer)
    with torch.no_grad():
        return model(x)


# ---- HyperQuant's lattice KV ------------------------------------------------------------------------------------

def inner_product_errors(quantizer, x, q, draws):
    x_hat = quantizer.quantize(x.expand(draws, -1).contiguous())
    return (x_hat - x) @ q


@pytest.mark.parametrize("rotation", ["none", "qjl"])
def test_dither_makes_inner_products_unbiased(rotation):
    g = torch.Generator().manual_seed(4)
    x, q = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    draws = 4000
    dithered = inner_product_errors(kv_cache.KVQuantizer("E8", 2.0, rotation, dither=True, seed=1), x, q, draws)
    bound = 4 * dithered.std() / math.sqrt(draws)
    assert abs(float(dithered.mean())) < bound
    # Without dither the error is the same on every call: a fixed bias. Measured along its own direction.
    plain = kv_cache.KVQuantizer("E8", 2.0, rotation, dither=False, seed=1)
    err = plain.quantize(x[None])[0] - x
    fixed = inner_product_errors(plain, x, err, 50)
    assert float(fixed.max() - fixed.min()) < 1e-9 and float(fixed.mean()) > bound * err.norm() / q.norm()


def test_haar_rotation_is_orthogonal_and_not_a_sign_flip():
    s = kv_cache.haar_orthogonal(16, torch.Generator().manual_seed(0))
    assert torch.allclose(s @ s.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    assert float((s.abs() > 1e-6).sum()) > 16 * 8


@pytest.mark.parametrize("name", list(LATTICES))
def test_dither_is_uniform_on_the_voronoi_cell(name):
    lat = LATTICES[name]
    u = kv_cache.voronoi_dither((100_000 // lat.n,), name, torch.Generator().manual_seed(6))
    assert torch.equal(lat.closest_point(u), torch.zeros_like(u, dtype=torch.long))
    second = u.pow(2).sum(1).mean() / lat.n
    assert abs(float(second) / lat.noise_unit - 1) < 0.02


def test_kv_quantizer_through_the_attention_hook_counts_its_bits(tiny_model):
    x = ids(2, 32)
    ref = logits(tiny_model, None, x)
    kv = kv_cache.KVQuantizer("E8", 3.0, rotation="signs", dither=True, seed=2, window=0)
    out = logits(tiny_model, kv, x)
    assert 0 < float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 0.05
    report = kv.report()
    # 2 layers x (K, V), each [2, 2 kv heads, 32, 16]: 2048 scalars in 4 sub-streams, 128 vectors with an alpha
    assert kv.stats["scalars"] == 4 * 2048
    assert kv.stats["metadata_bits"] == 4 * (4 * rice.STREAM_META_BITS + 128 * 16)
    assert 2.9 < report["payload_bps"] < 3.3 and report["exact_fraction"] == 0
    assert report["coded_bps"] == report["payload_bps"] + kv.stats["metadata_bits"] / kv.stats["scalars"]
    assert report["total_bps"] == pytest.approx(report["coded_bps"], rel=1e-12)


# ---- the engines' formats ---------------------------------------------------------------------------------------

def reference_q8_0(block):
    """llama.cpp's quantize_row_q8_0_ref for one block, one float32 operation at a time."""
    block = [np.float32(v) for v in block]
    d = max(abs(v) for v in block) / np.float32(127)
    inv = np.float32(1) / d if d else np.float32(0)
    codes = [int(math.copysign(math.floor(abs(v * inv) + 0.5), v * inv)) for v in block]   # roundf on exact halves
    return np.concatenate([np.float16(d).reshape(1).view(np.uint8), np.array(codes, np.int8).view(np.uint8)])


def reference_q4_0(block):
    block = [np.float32(v) for v in block]
    m = max(block, key=abs)                                 # the first of largest magnitude, as llama.cpp's loop
    d = m / np.float32(-8)
    inv = np.float32(1) / d if d else np.float32(0)
    q = [min(15, int(v * inv + np.float32(8.5))) for v in block]
    return np.concatenate([np.float16(d).reshape(1).view(np.uint8),
                           np.array([q[j] | q[j + 16] << 4 for j in range(16)], np.uint8)])


def awkward_blocks():
    """Blocks of 32: random, all zero, exact halves of the q8_0 grid (0.5 -> 1, -2.5 -> -3), a tie for the largest
    magnitude (q4_0 takes the first), and values on q4_0's rounding edges."""
    g = torch.Generator().manual_seed(3)
    halves = torch.arange(32) - 15.5
    halves[0] = 127.0
    ties = torch.randn(32, generator=g)
    ties[3], ties[9] = 4.0, -4.0
    edges = torch.linspace(-8, 7.5, 32)
    return torch.stack([*torch.randn(6, 32, generator=g) * 2, torch.zeros(32), halves, ties, edges])


@pytest.mark.parametrize("name, reference", [("Q8_0", reference_q8_0), ("Q4_0", reference_q4_0)])
def test_ggml_blocks_are_llama_cpps(name, reference):
    x = awkward_blocks()
    blocks = ggml_quants.blocks(name, *ggml_quants.quantize(name, x))
    assert np.array_equal(blocks.numpy(), np.stack([reference(row.tolist()) for row in x]))
    kv = kv_baselines.GGMLKV(name.lower())
    assert torch.equal(kv.quantize(x), ggml.dequantize(blocks.reshape(-1), name, x.shape))
    gg = pytest.importorskip("gguf")
    theirs = gg.quants.quantize(x.numpy(), gg.GGMLQuantizationType[name])
    assert np.array_equal(blocks.numpy().reshape(-1), theirs.reshape(-1))


def _ggml_pages(name, size, tokens=40):
    """Random q4_0 / q8_0 blocks [2, 3, tokens, 2 blocks] with f16 scales of every magnitude (subnormal, huge, zero,
    negative), and ggml.dequantize's values of them."""
    g = torch.Generator().manual_seed(size + tokens)
    raw = torch.randint(0, 256, (2, 3, tokens, 2 * size), dtype=torch.uint8, generator=g)
    extremes = torch.tensor([0.0, -0.0, 6e-8, 65504.0, -1e-5] * 2)
    scales = torch.cat([torch.randn(12 * tokens - len(extremes), generator=g), extremes])
    raw.view(torch.float16)[..., ::size // 2] = scales.reshape(2, 3, tokens, 2).half()
    return raw, ggml.dequantize(raw.reshape(-1), name.upper(), (2, 3, tokens, 64))


@pytest.mark.parametrize("compiled", [False, True], ids=["tensor ops", "compiled"])
@pytest.mark.parametrize("name, size", [("q4_0", 18), ("q8_0", 34)])
def test_ggml_blocks_read_back_as_the_textbook_decoder_reads_them(name, size, compiled):
    """dequantize_blocks (every block of a layer's pages at once; by its tensor ops, or q4_0's by q4_0_into
    compiled) gives ggml.dequantize's values bit for bit, on random bytes with scales of every magnitude, token-major
    views included (a stored page's layout), also written into a slice of a buffer; the rotation back as one matmul
    is fwht's up to float rounding."""
    raw, expected = _ggml_pages(name, size)
    assert torch.equal(kv_baselines.dequantize_blocks(raw, name, compiled=compiled), expected)
    token_major = raw.movedim(2, 0).contiguous().movedim(0, 2)
    assert torch.equal(kv_baselines.dequantize_blocks(token_major, name, compiled=compiled), expected)
    buffer = torch.full((2, 3, 50, 64), float("nan"))                      # a cache's buffer: written in place
    kv_baselines.dequantize_blocks(token_major, name, out=buffer[:, :, 5:45], compiled=compiled)
    assert torch.equal(buffer[:, :, 5:45], expected)
    assert buffer[:, :, :5].isnan().all() and buffer[:, :, 45:].isnan().all()
    kv = kv_baselines.GGMLKV(name, key_order="halves")
    for which in (0, 1):
        torch.testing.assert_close(kv._rotate_back(expected, which), kv._rotate(expected, which), atol=1e-5,
                                   rtol=1e-6)


def test_a_long_caches_q4_0_decode_is_compiled_once_for_every_length(monkeypatch):
    """dequantize_blocks compiles q4_0's decode from COMPILE_FROM values at once (a long cache's step: seconds to
    build, once), its shapes symbolic: a cache that grows compiles nothing more; a short one, and q8_0, run the
    tensor ops."""
    monkeypatch.setattr(kv_baselines, "COMPILE_FROM", 2 * 3 * 41 * 64)
    compiled_calls, built_once = [], kv_baselines.compiled_q4_0_into
    monkeypatch.setattr(kv_baselines, "compiled_q4_0_into", lambda: compiled_calls.append(1) or built_once())
    for name, size in (("q4_0", 18), ("q8_0", 34)):
        raw, expected = _ggml_pages(name, size)
        assert torch.equal(kv_baselines.dequantize_blocks(raw, name), expected)     # 40 tokens: below
    assert not compiled_calls
    raw, expected = _ggml_pages("q8_0", 34, 57)
    assert torch.equal(kv_baselines.dequantize_blocks(raw, "q8_0"), expected) and not compiled_calls   # long q8_0
    with torch.inference_mode():
        buffer = torch.empty(2, 3, 70, 64)
        kv_baselines.dequantize_blocks(_ggml_pages("q4_0", 18, 41)[0], "q4_0", out=buffer[:, :, 1:42])
        built = dict(counters["stats"])
        for tokens in (42, 57, 69):
            raw, expected = _ggml_pages("q4_0", 18, tokens)
            kv_baselines.dequantize_blocks(raw, "q4_0", out=buffer[:, :, 1:1 + tokens])
            assert torch.equal(buffer[:, :, 1:1 + tokens], expected)
    assert len(compiled_calls) == 4 and dict(counters["stats"]) == built


def test_past_dynamos_limit_of_builds_the_q4_0_decode_still_gives_its_values():
    """A new layout or grad mode is a new build, and dynamo stops building at 8 (then q4_0_into runs eager): every
    layout still reads back ggml.dequantize's values."""
    raw, expected = _ggml_pages("q4_0", 18)
    for mode in (torch.inference_mode, torch.no_grad, contextlib.nullcontext):
        with mode():
            for r in (raw, raw.movedim(2, 0).contiguous().movedim(0, 2), raw[:1, :1], raw[:, :1],
                      raw.transpose(0, 1).contiguous().transpose(0, 1)):
                want = expected[:r.shape[0], :r.shape[1]]
                assert torch.equal(kv_baselines.dequantize_blocks(r, "q4_0", compiled=True), want)
                buffer = torch.full((*r.shape[:2], 49, 64), float("nan"))
                kv_baselines.dequantize_blocks(r, "q4_0", out=buffer[:, :, 4:44], compiled=True)
                assert torch.equal(buffer[:, :, 4:44], want)


def test_without_a_compiler_the_block_decode_runs_its_tensor_ops_with_a_warning(monkeypatch):
    """Where torch.compile cannot build the decode (no C++ compiler), one warning says so and the tensor ops give
    the same values."""
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(torch, "compile", no_compiler)
    kv_baselines.compiled_q4_0_into.cache_clear()
    raw, expected = _ggml_pages("q4_0", 18)
    try:
        with pytest.warns(UserWarning, match="cannot build the KV cache's block decode here.*same values"):
            assert torch.equal(kv_baselines.dequantize_blocks(raw, "q4_0", compiled=True), expected)
        assert kv_baselines.compiled_q4_0_into() is None
    finally:
        kv_baselines.compiled_q4_0_into.cache_clear()


@pytest.mark.parametrize("spec", ["q4_0", "q8_0,rotation=none", "q8_0,key_order=interleaved"])
def test_ggml_pages_decoded_into_a_buffer_are_what_decode_gives(spec):
    """decode_into writes the blocks straight into a cache's buffer only where decode adds nothing (in the basis,
    or no rotation back nor reordered keys); elsewhere, and into a bf16 buffer, it is decode's values: a rotated
    K or V read unrotated, or the interleaved keys in their stored order, is red."""
    from engine.formats.kv.kv_store import parse_kv_spec
    kv = parse_kv_spec(spec)
    kv.adopt(Qwen3Config(head_dim=64))
    x = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(1))
    for which in (0, 1):
        codes = kv.encode(x, 0, which)
        for dtype in (torch.float32, torch.bfloat16):
            for in_basis, expected in ((False, kv.decode(codes, 0, which)), (True, kv.decode_in_basis(codes))):
                buffer = torch.zeros(1, 2, 50, 64, dtype=dtype)
                kv.decode_into(codes, buffer[:, :, 10:], 0, which, in_basis)
                assert torch.equal(buffer[:, :, 10:], expected.to(dtype)) and not buffer[:, :, :10].any()


def ggml_gen_hadamard(n):
    """llama.cpp's ggml_gen_hadamard (llama-kv-cache.cpp), transcribed: the orthonormal Sylvester matrix."""
    h = torch.zeros(n, n, dtype=torch.float64)
    h[0, 0] = 1 / n ** 0.5
    s = 1
    while s < n:
        h[s:2 * s, :s], h[:s, s:2 * s], h[s:2 * s, s:2 * s] = h[:s, :s], h[:s, :s], -h[:s, :s]
        s *= 2
    return h


@pytest.mark.parametrize("d", [64, 128])
def test_ggml_cache_rotates_each_head_as_llama_cpp_does(d):
    """K in chunks of the largest power of two dividing head_dim, V in chunks of 64, by H / sqrt(n); decoding
    rotates back (H is its own inverse). Without it (rotation none) the blocks are x's own."""
    x = torch.randn(2, 3, 5, d, generator=torch.Generator().manual_seed(d))
    kv = kv_baselines.GGMLKV("q4_0", key_order="halves")
    for which, n in ((0, d), (1, 64)):
        h = ggml_gen_hadamard(n).float()
        rotated = (x.unflatten(-1, (-1, n)) @ h.T).flatten(-2)
        blocks = ggml_quants.blocks("Q4_0", *ggml_quants.quantize("Q4_0", rotated.reshape(-1, d)))
        expected = (ggml.dequantize(blocks.reshape(-1), "Q4_0", x.shape).unflatten(-1, (-1, n)) @ h).flatten(-2)
        assert torch.allclose(kv.quantize(x, which=which), expected, atol=1e-5, rtol=0)
    plain = kv_baselines.GGMLKV("q4_0", rotation="none")
    blocks = ggml_quants.blocks("Q4_0", *ggml_quants.quantize("Q4_0", x.reshape(-1, d)))
    assert torch.equal(plain.quantize(x), ggml.dequantize(blocks.reshape(-1), "Q4_0", x.shape))


def test_llama_keys_are_blocked_in_llama_cpps_interleaved_order():
    """llama.cpp's converter makes each rotated pair (i, i + d/2) of a Llama head adjacent; its K blocks (and the
    Hadamard chunks) are cut in that order. install() settles key_order "auto" by the model's type."""
    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(5))
    pairs = x.unflatten(-1, (2, 32)).transpose(-1, -2).flatten(-2)             # [x_0, x_32, x_1, x_33, ...]
    halves = kv_baselines.GGMLKV("q4_0", key_order="halves")
    interleaved = kv_baselines.GGMLKV("q4_0", key_order="interleaved")
    back = halves.quantize(pairs).unflatten(-1, (32, 2)).transpose(-1, -2).flatten(-2)
    assert torch.equal(interleaved.quantize(x, which=0), back)
    assert torch.equal(interleaved.quantize(x, which=1), halves.quantize(x, which=1))      # V is not permuted
    for model_type, order in (("llama", "interleaved"), ("qwen3", "halves")):
        kv = kv_baselines.GGMLKV("q4_0")
        kv_cache.install(Qwen3(Qwen3Config(model_type=model_type, num_hidden_layers=1)), kv)
        assert kv.key_order == order


def test_q8_0_rounds_halves_away_from_zero():
    x = torch.zeros(32)
    x[:4] = torch.tensor([127.0, 0.5, -2.5, 1.5])
    assert kv_baselines.GGMLKV("q8_0").quantize(x)[:4].tolist() == [127.0, 1.0, -3.0, 2.0]


def test_kivi_groups_keys_per_channel_and_values_per_token():
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(5)) * 3
    kv = kv_baselines.KIVI(bits=2, group=4, window=4)
    k_hat, v_hat = kv.quantize(x, which=0), kv.quantize(x, which=1)
    k_ref, v_ref = torch.empty_like(x), torch.empty_like(x)
    for b in range(2):
        for h in range(2):
            for i in range(0, 8, 4):
                for c in range(8):
                    k_ref[b, h, i:i + 4, c] = brute_min_max(x[b, h, i:i + 4, c], 2)     # a channel, 4 tokens
                    v_ref[b, h, c, i:i + 4] = brute_min_max(x[b, h, c, i:i + 4], 2)     # a token, 4 channels
    assert torch.equal(k_hat, k_ref) and torch.equal(v_hat, v_ref)
    assert len(set(k_hat[0, 0, :4, 0].tolist())) <= 4 and len(set(k_hat[0, 0, 0, :].tolist())) > 4
    assert kv.report()["coded_bps"] == 2 + 32 / 4


def brute_min_max(values, bits):
    z = float(torch.tensor(min(values.tolist())).half())
    s = float(torch.tensor((max(values.tolist()) - z) / (2 ** bits - 1)).half())
    return torch.tensor([min(max(round((v - z) / s), 0), 2 ** bits - 1) * s + z for v in values.tolist()])


@pytest.mark.parametrize("scale", kv_baselines.FP8_SCALES)
def test_fp8_scale_is_the_calls_amax_per_tensor_or_per_head(scale):
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(7)) * torch.tensor([1.0, 10, 100])[:, None,
                                                                                                           None]
    kv = kv_baselines.FP8KV(scale)
    out = kv.quantize(x)
    for h in range(3):
        amax = (x if scale == "tensor" else x[:, h]).abs().max()
        s = amax / 448
        assert torch.equal(out[:, h], (x[:, h] / s).to(torch.float8_e4m3fn).float() * s)
    assert kv.report()["coded_bps"] == 8 + 32 * (1 if scale == "tensor" else 3) / x.numel()


# ---- the residual window and the exact first block --------------------------------------------------------------

def plain_hook(quantizer):
    return lambda k, v, layer: (quantizer.quantize(k, layer, 0), quantizer.quantize(v, layer, 1))


@pytest.mark.parametrize("make", [lambda **o: kv_cache.KVQuantizer("E8", 2.0, "signs", seed=3, **o),
                                  lambda **o: kv_baselines.GGMLKV("q4_0", **o)])
def test_window_zero_equals_the_plain_hook_exactly(model32, make):
    x = ids(2, 24)
    windowed = logits(model32, make(window=0), x)
    model32.set_kv_transform(plain_hook(make()))
    assert torch.equal(windowed, logits(model32, None, x))


@pytest.mark.parametrize("make", [lambda: kv_cache.KVQuantizer("E8", 2.0, "qjl", dither=True, window=24, exact_keys=8),
                                  lambda: kv_baselines.KIVI(2, group=8, window=30)])
def test_a_window_covering_the_sequence_is_the_dense_model(model32, make):
    x = ids(2, 24)
    dense = logits(model32, None, x)
    assert torch.equal(logits(model32, make(), x), dense)
    kv_cache.install(model32, make())
    model32.set_kv_transform(None)
    assert torch.equal(logits(model32, None, x), dense)


def windowed_reference(model, x, quantizer):
    """The model's forward with attention query by query: query t reads position s's exact K and V if
    t - s < window, the quantizer's otherwise (its K/V from one call on the whole sequence)."""
    cfg, t_len, window = model.cfg, x.shape[1], quantizer.window
    cos, sin = rope_tables(cfg, torch.arange(t_len))
    h = model.model.embed_tokens(x)
    for layer in model.model.layers:
        a, n = layer.self_attn, layer.input_layernorm(h)
        split = (x.shape[0], t_len, -1, cfg.head_dim)
        q = apply_rope(a.q_norm(a.q_proj(n).view(split)).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_norm(a.k_proj(n).view(split)).transpose(1, 2), cos, sin)
        v = a.v_proj(n).view(split).transpose(1, 2)
        k_hat, v_hat = quantizer(k, v, a.index, 0)
        assert k_hat.shape == k.shape
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        rows = []
        for t in range(t_len):
            exact = (t - torch.arange(t + 1) < window)[:, None]
            kt = torch.where(exact, k[:, :, :t + 1], k_hat[:, :, :t + 1]).repeat_interleave(groups, 1)
            vt = torch.where(exact, v[:, :, :t + 1], v_hat[:, :, :t + 1]).repeat_interleave(groups, 1)
            p = (q[:, :, t:t + 1] @ kt.transpose(-1, -2) * cfg.head_dim ** -0.5).float().softmax(-1)
            rows.append(p @ vt)
        h = h + a.o_proj(torch.cat(rows, 2).transpose(1, 2).reshape(x.shape[0], t_len, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


WINDOWED = [lambda: kv_cache.KVQuantizer("E8", 2.0, "signs", seed=4, window=5, exact_keys=3),
            lambda: kv_baselines.KIVI(2, group=4, window=6)]


@pytest.mark.parametrize("make", WINDOWED)
def test_window_is_the_per_query_rule(model32, make):
    x = ids(2, 16)
    dense = logits(model32, None, x)
    fast = logits(model32, make(), x)
    with torch.no_grad():
        slow = windowed_reference(model32, x, make())
    assert torch.allclose(fast, slow, atol=1e-5, rtol=0)
    assert (fast - dense).abs().max() > 1e-3


@pytest.mark.parametrize("make", WINDOWED)
def test_generate_codes_each_block_once_and_equals_the_prefill(model32, make):
    x = ids(2, 16)
    prefill = make()
    full = logits(model32, prefill, x)
    stepwise = make()
    kv_cache.install(model32, stepwise)
    cache = KVCache(model32.cfg.num_hidden_layers)
    with torch.no_grad():
        steps = [model32(x[:, :3], cache)] + [model32(x[:, i:i + 1], cache) for i in range(3, 16)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    assert [n for n, _ in stepwise.coded] == [n for n, _ in prefill.coded]


def test_exact_first_block_keeps_those_keys_and_only_those():
    k, v = torch.randn(2, 1, 2, 10, 16, generator=torch.Generator().manual_seed(8)).unbind(0)
    kv = kv_cache.KVQuantizer("E8", 2.0, exact_keys=4)
    k_hat, v_hat = kv(k, v, 0, 0)
    assert torch.equal(k_hat[:, :, :4], k[:, :, :4]) and not torch.equal(v_hat[:, :, :4], v[:, :, :4])
    assert (k_hat[:, :, 4:] != k[:, :, 4:]).any(-1).all()
    assert [n for n, _ in kv.coded] == [2 * 6 * 16, 2 * 10 * 16]
    k_hat, _ = kv(k, v, 0, 10)                             # positions 10..19: no key kept
    assert (k_hat != k).any(-1).all()


def test_total_rate_counts_the_window_and_first_keys_at_16_bits(model32):
    # q4_0 codes cost exactly 4.5 bits; 40 positions, the last 8 exact, and the first 8 keys: K 16 + V 8 exact.
    kv = kv_baselines.GGMLKV("q4_0", window=8, exact_keys=8)
    logits(model32, kv, ids(2, 40))
    report = kv.report()
    assert report["coded_bps"] == 4.5
    assert report["total_bps"] == pytest.approx(((24 + 32) * 4.5 + (16 + 8) * 16) / 80, rel=1e-12)
    assert report["exact_fraction"] == 24 / 80 and report["vs_bf16"] == report["total_bps"] / 16
    # KIVI 2-bit g8: keys 2 + 32 / 8 = 6 bits, values over 8 channels 6 bits; 24 of 32 positions exact
    kivi = kv_baselines.KIVI(2, group=8, window=24)
    logits(model32, kivi, ids(1, 32))
    assert kivi.report()["coded_bps"] == 6 and kivi.report()["total_bps"] == pytest.approx((8 * 6 + 24 * 16) / 32)
    # the lattice's default window is the paper's 32 recent tokens
    lattice = kv_cache.kv_quantize(model32, "E8", 3.0)
    logits(model32, None, ids(1, 40))
    assert lattice.window == 32 and lattice.report()["exact_fraction"] == 32 / 40


def test_kv_quantizers_reject_bad_arguments(model32):
    with pytest.raises(ValueError, match="rotation must be one of"):
        kv_cache.KVQuantizer("E8", 3.0, rotation="haar")
    with pytest.raises(ValueError, match="lattice must be one of"):
        kv_cache.KVQuantizer("E7", 3.0)
    with pytest.raises(ValueError, match="not a multiple of E8's dimension 8"):
        kv_cache.KVQuantizer("E8", 3.0).quantize(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="window=-1: must be an integer >= 0"):
        kv_cache.KVQuantizer("E8", 3.0, window=-1)
    with pytest.raises(ValueError, match="exact_keys=True: must be an integer"):
        kv_baselines.FP8KV(exact_keys=True)
    with pytest.raises(ValueError, match="fp8 scale must be one of"):
        kv_baselines.FP8KV("channel")
    with pytest.raises(ValueError, match="cache_type must be one of"):
        kv_baselines.GGMLKV("q5_0")
    with pytest.raises(ValueError, match="q8_0 needs head_dim to be a multiple of 32"):
        kv_baselines.GGMLKV("q8_0").quantize(torch.zeros(1, 1, 2, 16))
    with pytest.raises(ValueError, match="KIVI bits must be 2 or 4"):
        kv_baselines.KIVI(3)
    with pytest.raises(ValueError, match="need window >= 31"):
        kv_baselines.KIVI(2, group=32, window=8)
    with pytest.raises(ValueError, match="multiple of the 8-token block"):
        kv_baselines.KIVI(2, group=8, window=8, exact_keys=4)
    with pytest.raises(ValueError, match="KV format must be one of"):
        kv_baselines.kv_quantize(model32, "int3")
    with pytest.raises(ValueError, match="KV window=1.5"):
        model32.set_kv_transform(plain_hook(kv_baselines.FP8KV()), window=1.5)
    model32.set_kv_transform(lambda k, v, layer, start: (k[:, :, :0], v[:, :, :0]), window=3)
    with pytest.raises(ValueError, match="left 5 positions uncoded, more than its window of 3"):
        logits(model32, None, ids(1, 5))
