"""Trellis codes (chapter 39, "Trellis codes: QTIP and EXL3"). First the chapter's checks, marked @book (`pytest
tests/test_ch39_trellis.py --yours FILE` runs them on FILE's functions): Viterbi's optimality by brute force, its
Gaussian MSE, the codebook, the random Hadamard rotation, quantize_trellis' rate and error. Then the engine's: the
3INST code, the fast Viterbi, tail-biting, the bitstream, the kernel, BlockLDLQ."""
import copy
import itertools

import numpy as np
import pytest
import torch

from engine.formats import quantized_checkpoints as registry
from engine.formats.numerics import affine, hadamard
from engine.formats import trellis, trellis_viterbi as viterbi
from engine.layers import impl, quantized_linears
from engine.kernels import triton_formats
from engine.qwen3 import Qwen3, Qwen3Config
from helpers import same

pytestmark = pytest.mark.usefixtures("one_thread")
book = pytest.mark.book


def _1mad_by_hand(s):
    x = (s * 34038481 + 76625530) % 2 ** 32
    return (sum((x >> (8 * i)) & 255 for i in range(4)) - 510) / 147.800537109375


def _3inst_by_hand(s):
    x = ((s * 89226354 + 64248484) % 2 ** 32 & 0x8FFF8FFF) ^ 0x3B603B60
    halves = np.array([x >> 16, x & 0xFFFF], dtype=np.uint16).view(np.float16).astype(np.float64)
    return float(halves.sum())


def test_codes_match_their_definitions_and_codebook_is_normalized():
    states = [0, 1, 2, 255, 4096, 65535, 123457]
    got_1mad = trellis.code_1mad(torch.tensor(states))
    got_3inst = trellis.code_3inst(torch.tensor(states))
    for s, a, b in zip(states, got_1mad.tolist(), got_3inst.tolist()):
        assert a == pytest.approx(_1mad_by_hand(s), abs=1e-6)
        assert b == pytest.approx(_3inst_by_hand(s), abs=1e-6)
    for code in trellis.CODES:
        table = trellis.codebook(10, code=code).double()
        assert abs(table.mean()) < 1e-5 and table.std() == pytest.approx(1.0, abs=1e-5)


def _brute_force(x, table, L, K, wrap=None):
    """Least squared error over every start state and every symbol sequence (optionally tail-biting-pinned)."""
    T = len(x)
    best = float("inf")
    for s0 in range(2 ** L):
        if wrap is not None and s0 >> K != wrap:
            continue
        for syms in itertools.product(range(2 ** K), repeat=T - 1):
            path = [s0]
            for b in syms:
                path.append(((path[-1] << K) | b) % 2 ** L)
            if wrap is not None and path[-1] % 2 ** (L - K) != wrap:
                continue
            best = min(best, float(((x - table[path]) ** 2).sum()))
    return best


def _is_trellis_path(states, L, K):
    return bool((states[..., 1:] >> K == states[..., :-1] % 2 ** (L - K)).all())


# ---- the chapter's checks ---------------------------------------------------------------------------------------

def _path(start, symbols, L, K):
    """The states a start state and its K-bit symbols walk through: s_t = ((s_{t-1} << K) | b_t) mod 2^L."""
    states = [int(start)]
    for b in symbols.tolist():
        states.append(((states[-1] << K) | int(b)) % 2 ** L)
    return torch.tensor(states)


@book("codebook")
@pytest.mark.parametrize("L", [8, 10])
def test_the_codebook_has_zero_mean_and_unit_variance(L):
    table = trellis.codebook(L)
    assert table.shape == (2 ** L,) and table.dtype == torch.float32, (
        f"codebook({L}) is {table.dtype} {tuple(table.shape)}: one float32 value per state, {2 ** L}")
    mean, std = float(table.double().mean()), float(table.double().std())
    assert abs(mean) < 1e-5 and std == pytest.approx(1.0, abs=1e-5), (
        f"codebook({L}) has mean {mean:.3g} and standard deviation {std:.4g}: normalize the code's values over all "
        f"{2 ** L} states, (v - mean) / std")
    distinct = len(set(table.tolist()))
    assert distinct > 2 ** L // 8, (                                        # a spread of values, not a few levels
        f"codebook({L}) holds only {distinct} distinct values: each state's value is the hash of its own bits")


@book("viterbi_encode")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_viterbi_encode_is_optimal_by_brute_force(seed):
    """Every one of the 2^4 x 2^5 codes of a 16-state, 1-bit trellis over 6 steps: none is closer to x."""
    L, K = 4, 1
    x = torch.randn(6, generator=torch.Generator().manual_seed(seed))
    start, symbols, recon = trellis.viterbi_encode(x, L, K)
    table = trellis.codebook(L)
    assert isinstance(start, int) and symbols.shape == (5,) and recon.shape == (6,)
    walked = table[_path(start, symbols, L, K)]                            # the symbols walk the trellis
    same(recon, walked, "viterbi_encode's reconstruction", f"the walk from start state {start} with its symbols")
    got, best = float(((x - recon) ** 2).sum()), _brute_force(x, table, L, K)
    assert got == pytest.approx(best, rel=1e-5), (
        f"viterbi_encode's path has squared error {got:.6g}; the best of all {2 ** L * 2 ** (K * 5)} codes has "
        f"{best:.6g} (a path must end in the state of least cost, any start state allowed)")


@book("viterbi_encode")
def test_viterbi_on_gaussian_data_beats_the_best_scalar_code():
    """About 0.08 per unit variance at L = 8, K = 2 (2 bits per weight plus the start state), where Lloyd-Max, the
    best 2-bit scalar code, has 0.118."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    mse = torch.stack([(trellis.viterbi_encode(row, 8, 2)[2] - row).pow(2).mean() for row in x]).mean().item()
    assert mse < 0.09, (                                                   # (0.087 on this sample)
        f"viterbi_encode's mean squared error on unit Gaussians is {mse:.4f} (a shortest path: 0.087 here; Lloyd-Max's "
        "best 2-bit scalar code 0.118)")


@book("random_hadamard")
def test_random_hadamard_is_orthogonal_and_spreads_an_outlier():
    h = trellis.random_hadamard(256, seed=3)
    gram = h @ h.T
    assert torch.allclose(gram, torch.eye(256), atol=1e-5), (
        f"random_hadamard(256) @ its transpose has {gram.diagonal().mean().item():.4g} on the diagonal: an orthogonal "
        "rotation is H D / sqrt(n), H's entries +-1 and D's signs +-1")
    spike = torch.zeros(256)
    spike[7] = 16.0
    spread = (h @ spike).abs()
    assert torch.allclose(spread, torch.ones(256)), (                      # one outlier, spread over all 256
        f"an outlier of 16 rotates to magnitudes {spread.min().item():.3g}..{spread.max().item():.3g}, not 1 each "
        "(16 / sqrt(256)): every entry of a Hadamard matrix has the same magnitude")
    with pytest.raises(ValueError):
        trellis.random_hadamard(96)


@book("quantize_trellis")
def test_quantize_trellis_counts_its_bits_and_beats_two_bit_rtn():
    """Rows with outliers, rotated to look Gaussian and coded at K = 2: (L + K (group - 1) + 16) / group bits, and a
    much smaller error than round-to-nearest at 2.5 bits."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 512, generator=g) * 0.02
    w[:, torch.randperm(512, generator=g)[:6]] *= 12
    w_hat, bits = trellis.quantize_trellis(w, 8, 2, 256, 0)
    assert w_hat.shape == w.shape, f"quantize_trellis gives {tuple(w_hat.shape)} for a {tuple(w.shape)} weight"
    assert bits == pytest.approx((8 + 2 * 255 + 16) / 256), (
        f"{bits} bits per weight; a group of 256 costs its start state (L = 8 bits), K = 2 bits for each of the 255 "
        "steps after it and an f16 scale: (8 + 2 * 255 + 16) / 256")
    trellis_mse = (w_hat - w).pow(2).mean().item()
    rtn_mse = (affine.fake_quantize(w, 2, 64) - w).pow(2).mean().item()
    assert trellis_mse < 0.5 * rtn_mse and trellis_mse < 0.12 * w.pow(2).mean().item(), (
        f"quantize_trellis' error is {trellis_mse / rtn_mse:.2f}x 2-bit round-to-nearest's and "
        f"{trellis_mse / w.pow(2).mean().item():.3f} of the weights' power (a correct one: ~0.1x and ~0.09): are the "
        "groups rotated (w R^T) before coding, each scaled to unit RMS, and rotated back (w_hat R) after?")


# ---- the engine's ---------------------------------------------------------------------------------------------------

def test_viterbi_is_optimal_by_brute_force():
    """Every one of the 2^4 x 2^5 codes of a 16-state, 1-bit trellis over 6 steps; three sequences in one batch."""
    L, K = 4, 1
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    start, symbols, recon = trellis.viterbi_encode(x, L, K)
    states, values = trellis.viterbi_path(x, L, K)
    table = trellis.codebook(L)
    assert _is_trellis_path(states, L, K) and torch.equal(symbols, states[:, 1:] % 2)
    assert torch.equal(start, states[:, 0]) and torch.equal(values, recon)
    assert torch.equal(recon, table[states])
    for i in range(3):
        assert float(((x[i] - recon[i]) ** 2).sum()) == pytest.approx(_brute_force(x[i], table, L, K), rel=1e-5)
    # the tail-biting pass is optimal among the paths whose ends it pins, and so is the textbook one
    wrap = torch.tensor([0, 5, 7])
    for search in (viterbi.viterbi, viterbi.viterbi_reference):
        pinned = search(x, table, L, K, wrap=wrap)
        assert torch.equal(pinned[:, 0] >> K, wrap) and torch.equal(pinned[:, -1] % 2 ** (L - K), wrap)
        for i in range(3):
            err = float(((x[i] - table[pinned[i]]) ** 2).sum())
            assert err == pytest.approx(_brute_force(x[i], table, L, K, int(wrap[i])), rel=1e-5)


@pytest.mark.parametrize("L,K,T", [(6, 2, 40), (8, 3, 40), (9, 3, 40), (10, 4, 24), (16, 2, 12), (16, 3, 12)])
def test_fast_viterbi_finds_the_textbook_paths(L, K, T):
    """Same paths as the book's listing, with and without pinned ends; K that does not divide L (the layout's
    rotated symbols) and L=16 included; many small chunks on two threads give the same answer as one."""
    torch.manual_seed(L * 10 + K)
    x = torch.randn(3, T)
    table = trellis.codebook(L, code="3inst" if L == 16 else "1mad")
    for wrap in (None, torch.randint(0, 2 ** (L - K), (3,))):
        reference = viterbi.viterbi_reference(x, table, L, K, wrap)
        assert torch.equal(viterbi.viterbi(x, table, L, K, wrap), reference)
        chunked = viterbi.viterbi(x, table, L, K, wrap, threads=2, budget=4 * T * 2 ** (L - K) * 4)
        assert torch.equal(chunked, reference)


@pytest.mark.slow                                   # compiles a C++ kernel: ~5-10 s, more with a cold inductor cache
def test_compiled_step_finds_the_textbook_paths_on_two_threads():
    """The compiled add-compare-select step (one shape: chunks of 2 sequences, one per thread) rounds as the eager
    one and the book's listing do, so all three find the same paths, with and without pinned ends."""
    L, K, T = 16, 2, 12
    torch.manual_seed(3)
    x = torch.randn(4, T)
    table = trellis.codebook(L)
    budget = 2 * 4 * T * 2 ** (L - K) * 2                      # two chunks of 2 sequences, one per thread
    for wrap in (None, torch.randint(0, 2 ** (L - K), (4,))):
        reference = viterbi.viterbi_reference(x, table, L, K, wrap)
        assert torch.equal(viterbi.viterbi(x, table, L, K, wrap, threads=2, budget=budget, compiled=True), reference)
        assert torch.equal(viterbi.viterbi(x, table, L, K, wrap, threads=2, budget=budget, compiled=False), reference)


def test_viterbi_runs_eager_where_the_step_does_not_compile(monkeypatch):
    x = torch.randn(3, 16)
    table = trellis.codebook(8)
    monkeypatch.setattr(viterbi, "_compiles", lambda *shape: OSError("no C++ compiler"))
    with pytest.raises(RuntimeError, match="cannot build the Viterbi step"):
        viterbi.viterbi(x, table, 8, 2, compiled=True)
    monkeypatch.setattr(viterbi, "COMPILE_FROM", 0)            # a search big enough to compile
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler.*runs eager"):
        paths = viterbi.viterbi(x, table, 8, 2)
    assert torch.equal(paths, viterbi.viterbi_reference(x, table, 8, 2))


def test_viterbi_rejects_bad_input():
    table = trellis.codebook(8)
    with pytest.raises(ValueError, match="not finite"):
        viterbi.viterbi(torch.tensor([[0.0, float("nan"), 1.0, 2.0]]), table, 8, 2)
    with pytest.raises(ValueError, match=r"K\*T >= L"):
        viterbi.viterbi(torch.zeros(2, 3), table, 8, 2)
    with pytest.raises(ValueError, match="wrap must be"):
        viterbi.viterbi(torch.zeros(2, 8), table, 8, 2, wrap=torch.tensor([0, 64]))


@pytest.mark.parametrize("wrap_window", [None, 4])
def test_tail_biting_path_closes_on_itself_and_its_stream_decodes_to_it(wrap_window):
    """With a first pass over the 4 + 4 steps around the wrap point too (4 = L / K, the least allowed): the
    second pass pins the ends, so the path closes and is the best one through its wrap state."""
    L, K = 8, 2
    x = torch.randn(4, 64)
    _, symbols, recon = trellis.viterbi_encode(x, L, K, tail_biting=True, wrap_window=wrap_window)
    states, _ = trellis.viterbi_path(x, L, K, tail_biting=True, wrap_window=wrap_window)
    assert symbols.shape == (4, 64) and torch.equal(symbols, states % 2 ** K)
    assert _is_trellis_path(torch.cat((states, states[:, :1]), 1), L, K)        # s_0 follows s_{T-1}
    assert torch.equal(trellis.stream_states(trellis.pack_stream(states, L, K, True), L, K, 64, True), states)
    assert torch.equal(recon, trellis.codebook(L)[states])
    pinned = viterbi.viterbi_reference(x, trellis.codebook(L), L, K, wrap=states[:, 0] >> K)
    assert torch.equal(states, pinned)
    with pytest.raises(ValueError, match="wrap_window must be"):
        trellis.viterbi_encode(x, L, K, tail_biting=True, wrap_window=3)


@pytest.mark.parametrize("code", trellis.CODES)
@pytest.mark.parametrize("tail_biting", [False, True])
@pytest.mark.parametrize("L,K,tile", [(8, 2, (1, 128)), (12, 3, (8, 16))])
def test_decoder_rebuilds_the_encoder_reconstruction_bit_for_bit(code, tail_biting, L, K, tile):
    torch.manual_seed(1)
    w = torch.randn(16, 256) * 0.02
    codes, scales, w_rot = trellis.trellis_codes(w, L, K, group=128, seed=3, code=code, tail_biting=tail_biting,
                                                    tile=tile)
    T = tile[0] * tile[1]
    assert codes.dtype == torch.uint8 and codes.shape == (16 // tile[0], 256 // tile[1],
                                                          -(-trellis.stream_bits(L, K, T, tail_biting) // 8))
    assert torch.equal(trellis.decode_trellis(codes, scales, L, K, code, tail_biting, tile), w_rot)
    layer = trellis.TrellisLinear(codes, scales, L, K, code, tail_biting, tile, group=128, seed=3)
    assert torch.equal(layer.decode_rotated(), w_rot)
    rel = (layer.dequantize() - w).pow(2).mean() / w.pow(2).mean()
    assert rel < (0.12 if K == 2 else 0.05)


@pytest.mark.parametrize("code,tail_biting,L,K,tile", [("1mad", False, 8, 2, (1, 256)), ("3inst", True, 16, 3, (16, 16))])
def test_kernel_equals_torch_decoder(code, tail_biting, L, K, tile):
    """Any byte string is a valid tail-biting stream, so random bytes test the decoders at L=16 without encoding."""
    torch.manual_seed(2)
    if tail_biting:
        codes = torch.randint(0, 256, (32 // tile[0], 256 // tile[1], K * 256 // 8), dtype=torch.uint8)
        scales = (torch.rand(codes.shape[:2]) + 0.5).half()
    else:
        codes, scales, _ = trellis.trellis_codes(torch.randn(32, 256), L, K, 256, 0, code=code, tail_biting=tail_biting,
                                                 tile=tile)
    layer = trellis.TrellisLinear(codes, scales, L, K, code, tail_biting, tile, 256, 0)
    mean, inv_std = trellis.code_stats(L, code)
    eye = torch.eye(256)                              # y = W_rot^T exactly: one product per output
    w_kernel = triton_formats.trellis_matmul(eye, codes, scales.float(), L, K, tile, mean, inv_std, code,
                                             trellis.HASH[code]).T
    assert torch.equal(w_kernel, layer.decode_rotated())
    x = torch.randn(5, 256)
    y_torch = layer(x)
    with impl("engine"):
        y_engine = layer(x)
    assert torch.allclose(y_engine, y_torch, rtol=1e-4, atol=1e-4)


def test_each_tile_scale_is_the_least_squares_fit_on_its_path():
    """The Viterbi codes each tile at its RMS; its stored scale is then refit on the chosen path by least squares,
    <w, v> / <v, v> rounded to f16, which is never worse than the RMS it was searched at."""
    torch.manual_seed(0)
    w = torch.randn(8, 256) * torch.linspace(0.5, 2.0, 256)
    codes, scales, _ = trellis.trellis_codes(w, L=8, K=2)
    unit = trellis.decode_trellis(codes, torch.ones_like(scales), L=8, K=2)      # the path's values at scale 1
    target = trellis.rotate(w, 256, 0)
    fit = (target * unit).sum(1) / unit.pow(2).sum(1)
    assert torch.equal(scales[:, 0], fit.half())
    rms = target.pow(2).mean(1).sqrt()
    assert (unit * fit[:, None] - target).pow(2).sum() < (unit * rms[:, None] - target).pow(2).sum()


def test_gaussian_mse_at_two_bits_with_honest_rate():
    """Tail-biting: the stream is exactly K T bits, so MSE is measured at 2 bits per weight (+16/T for the scale).
    Lloyd-Max, the best scalar 2-bit code, reaches 0.118; the rate-distortion bound is 0.0625."""
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    states, recon = trellis.viterbi_path(x, 8, 2, tail_biting=True)
    stream = trellis.pack_stream(states, 8, 2, True)
    assert stream.shape[1] * 8 == 2 * 256
    assert (recon - x).pow(2).mean() <= 0.088
    codes, scales, _ = trellis.trellis_codes(x, 8, 2, tail_biting=True)
    layer = trellis.TrellisLinear(codes, scales, 8, 2, tail_biting=True)
    assert layer.bits_per_weight == (2 * 256 + 16) / 256 + 64 / 256 ** 2           # the CRC: 64 bits per layer
    assert (layer.dequantize() - x).pow(2).mean() <= 0.088


@pytest.mark.parametrize("L,tail_biting,rows,n", [(8, False, 32, 128), (16, True, 16, 64)])
def test_block_ldlq_beats_plain_trellis_on_output_error(L, tail_biting, rows, n):
    torch.manual_seed(0)
    x = (torch.randn(1024, n) @ (torch.eye(n) + 2 * torch.randn(n, n) / n ** 0.5)) * torch.linspace(0.2, 2, n)
    w = torch.randn(rows, n) * 0.05
    hessian = 2 * x.T @ x / x.shape[0]

    def output_error(w_rot):
        return (x @ (w - trellis.unrotate(w_rot, 64, 0)).T).pow(2).mean()
    options = dict(group=64, tail_biting=tail_biting, tile=(16, 16))
    _, _, plain = trellis.trellis_codes(w, L, 2, **options)
    codes, scales, fed_back = trellis.block_ldlq(w, hessian, L, 2, **options)
    assert torch.equal(trellis.decode_trellis(codes, scales, L, 2, tail_biting=tail_biting, tile=(16, 16)), fed_back)
    assert output_error(fed_back) < 0.8 * output_error(plain)


def test_l16_tail_biting_reaches_qtip_mse_and_decodes_to_the_encoder_reconstruction():
    """QTIP's parameters (L=16, K=2, 16 x 16 tiles, tail-biting: exactly 2 bits per weight + an f16 scale per tile)
    on 16 Gaussian tiles: MSE about QTIP's 0.069 (this sample's noise is about +-0.002; L=8 reaches 0.08)."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    codes, scales, w_rot = trellis.trellis_codes(x, 16, 2, tail_biting=True, tile=(16, 16))
    assert codes.shape == (1, 16, 2 * 256 // 8)
    assert torch.equal(trellis.decode_trellis(codes, scales, 16, 2, tail_biting=True, tile=(16, 16)), w_rot)
    layer = trellis.TrellisLinear(codes, scales, 16, 2, tail_biting=True, tile=(16, 16))
    assert layer.bits_per_weight == (2 * 256 + 16) / 256 + 64 / x.numel()            # the CRC: 64 bits per layer
    assert (layer.dequantize() - x).pow(2).mean() <= 0.072


def _layer(tail_biting=False):
    w = torch.randn(16, 256)
    codes, scales, _ = trellis.trellis_codes(w, 8, 2, tail_biting=tail_biting)
    return codes, scales


@pytest.mark.parametrize("change", ["code byte", "scale", "seed", "code", "tile"])
def test_a_changed_stream_scale_or_field_is_refused_by_the_checksum(change):
    """Every bit pattern is a valid path: without the CRC each of these would decode, silently, to another weight."""
    codes, scales, _ = trellis.trellis_codes(torch.randn(4, 64), 8, 2, group=64)
    args = dict(codes=codes, scales=scales, tile=(1, 64), group=64)
    crc = trellis.TrellisLinear(**args).crc
    if change == "code byte":
        args["codes"] = codes.clone()
        args["codes"][1, 0, 5] ^= 0x04
    elif change == "scale":
        args["scales"] = scales * 2
    elif change == "seed":
        args["seed"] = 1
    elif change == "code":
        args["code"] = "3inst"
    else:
        args.update(codes=codes.reshape(2, 2, -1), scales=scales.reshape(2, 2), tile=(2, 32))   # 64 weights a tile too
    with pytest.raises(ValueError, match="trellis stream checksum mismatch"):
        trellis.TrellisLinear(**args, crc=crc)


def test_malformed_streams_raise_value_error():
    codes, scales = _layer()                                  # free start: 8 + 2 * 255 = 518 bits in 65 bytes
    with pytest.raises(ValueError, match="truncated"):
        trellis.TrellisLinear(codes[..., :-1], scales)
    with pytest.raises(ValueError, match='uint8 bytes per tile'):
        trellis.decode_trellis(codes[..., :-1], scales)
    bad = codes.clone()
    bad[0, 0, -1] |= 0x80                                      # a padding bit
    with pytest.raises(ValueError, match="padding"):
        trellis.TrellisLinear(bad, scales)
    nan = scales.clone()
    nan[3, 0] = float("nan")
    with pytest.raises(ValueError, match="scale"):
        trellis.TrellisLinear(codes, nan)
    with pytest.raises(ValueError, match='need codes uint8'):
        trellis.TrellisLinear(codes.int(), scales)
    with pytest.raises(ValueError, match='truncated or oversized'):
        trellis.TrellisLinear(codes, scales, tail_biting=True)  # 65 bytes cannot be a 512-bit tail-biting stream
    with pytest.raises(ValueError, match='K < L'):
        trellis.TrellisLinear(codes, scales, L=8, K=8)
    with pytest.raises(ValueError, match='code must be one of'):
        trellis.TrellisLinear(codes, scales, code="2mad")
    with pytest.raises(ValueError, match='rotation tile'):
        trellis.trellis_codes(torch.randn(16, 200), 8, 2)
    with pytest.raises(ValueError, match="do not fit"):
        triton_formats.trellis_matmul(torch.randn(2, 128), codes, scales.float(), 8, 2, (1, 256), 0.0, 1.0, "1mad",
                                      trellis.HASH["1mad"])


def test_model_quantize_engine_and_checkpoint_round_trip(tiny_model, tmp_path):
    ids = torch.randint(0, 256, (2, 24))
    config = trellis.quantize(tiny_model, L=8, K=2, group=64, tail_biting=True)
    layers = quantized_linears(tiny_model)
    assert len(layers) == 14 and all(isinstance(m, trellis.TrellisLinear) for m in layers.values())
    assert all(m.bits_per_weight == (2 * 64 + 16) / 64 + 64 / (m.in_features * m.out_features) for m in layers.values())
    with torch.no_grad():
        ref = tiny_model(ids)
        with impl("engine"):
            engine = tiny_model(ids)
    assert torch.allclose(engine, ref, rtol=1e-3, atol=1e-3)
    registry.save_quantized(tiny_model, tmp_path / "ckpt", "trellis", quantization_config=config)
    loaded = registry.load_quantized(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)


def test_the_rotation_group_fits_any_input_width():
    """SmolLM2's 576- and 1536-wide inputs take groups of 64; the book's 256 / 768 keep 256."""
    assert hadamard.fitting_tile([256, 768], 256) == 256 and hadamard.fitting_tile([576, 1536], 256) == 64
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(hidden_size=96, intermediate_size=192, num_attention_heads=3, num_key_value_heads=1,
                              head_dim=32, num_hidden_layers=1)).eval()
    config = trellis.quantize(model, L=8, K=2)
    assert config["group"] == 32 and all(m.group == 32 for m in quantized_linears(model).values())


def test_model_block_ldlq_needs_calibration_and_beats_plain_trellis(tiny_model):
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="trellis needs calibration_ids"):
        trellis.quantize(copy.deepcopy(tiny_model), None, ldlq=True, group=64)
    plain, fed_back = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    trellis.quantize(plain, None, L=8, K=2, group=64, tile=(8, 8))
    config = trellis.quantize(fed_back, ids, L=8, K=2, group=64, ldlq=True, tile=(8, 8))
    assert config["ldlq"] and config["tile"] == [8, 8]
    with torch.no_grad():
        reference = tiny_model(ids)
        plain_error = (plain(ids) - reference).pow(2).mean()
        fed_back_error = (fed_back(ids) - reference).pow(2).mean()
    assert fed_back_error < 0.8 * plain_error          # the error feedback must pay off on the calibration data
