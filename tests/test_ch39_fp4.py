"""FP4 (chapter 39, "FP4: MXFP4 and NVFP4"): MXFP4 in both layouts (the split one checked against GGUF's decoder) and
NVFP4, marked @book (`pytest tests/test_ch39_fp4.py --yours FILE` runs them on FILE's functions); then the engine's
E2M1 rounding, exponents, layers and kernels."""
import math

import pytest
import torch
from torch import nn

from engine.layers import impl
from engine.formats.llama_cpp import ggml
from engine.formats import mx
from engine.kernels import triton_formats
from helpers import same

book = pytest.mark.book

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_table():
    assert mx.E2M1[:8].tolist() == MAGNITUDES
    assert mx.E2M1[8:].tolist() == [-v for v in MAGNITUDES]
    assert torch.signbit(mx.E2M1[8])                          # code 8 is -0


@pytest.mark.parametrize("table", [mx.E2M1, torch.arange(16.0) - 7.5])
def test_fp4_kernels_decode_with_the_table_they_are_given(table):
    """The kernels hold no E2M1 copy of their own: a code decodes to whatever the format's table says."""
    codes = torch.arange(64) % 16                                # every code, in both nibbles of a byte
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None, :].repeat(3, 1)       # [3, 32]
    eye = torch.eye(64)
    mx_w = triton_formats.mxfp4_matmul(eye, packed.reshape(3, 2, 16), torch.full((3, 2), 127, dtype=torch.uint8),
                                       table).T                  # E8M0 127 = 2^0
    nv_w = triton_formats.nvfp4_matmul(eye, packed, torch.ones(3, 4).to(torch.float8_e4m3fn), 1.0, table).T
    assert torch.equal(mx_w, table[codes].expand(3, 64)) and torch.equal(nv_w, mx_w)


def test_to_e2m1_ties_to_even_and_saturation():
    cases = {0.25: 0.0, 0.26: 0.5, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 5.01: 6.0,
             7.0: 6.0, 1e30: 6.0, float("inf"): 6.0, -0.3: -0.5, -2.5: -2.0, -1e9: -6.0}
    x = torch.tensor(list(cases))
    assert mx.E2M1[mx.to_e2m1(x).long()].tolist() == list(cases.values())
    assert mx.to_e2m1(torch.tensor([-0.0, -0.1])).tolist() == [8, 8]


def test_to_e2m1_is_nearest_by_brute_force():
    x = torch.linspace(-7, 7, 5601)                               # steps of 1/400: every midpoint is hit exactly
    codes = mx.to_e2m1(x).long()
    dist = (x[:, None] - mx.E2M1[None, :]).abs()
    assert torch.equal(dist.gather(1, codes[:, None])[:, 0], dist.min(1).values)
    # at a tie the chosen code has mantissa bit 0
    tie = (dist == dist.min(1, keepdim=True).values).sum(1) > 1
    tie &= x.abs() < 6
    assert tie.sum() >= 14 and ((codes[tie] & 1) == 0).all()


@book("quantize_mxfp4", "dequantize_mxfp4")
@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_mxfp4_round_trip(layout):
    torch.manual_seed(0)
    w = torch.randn(6, 5, 64) * torch.rand(6, 5, 1) * 10
    blocks, scales = mx.quantize_mxfp4(w, layout)
    assert blocks.shape == (6, 5, 2, 16) and blocks.dtype == torch.uint8 and scales.shape == (6, 5, 2), (
        f"blocks {blocks.dtype} {tuple(blocks.shape)}, scales {tuple(scales.shape)}; a [6, 5, 64] weight gives uint8 "
        "blocks [6, 5, 2, 16] (two codes a byte) and scales [6, 5, 2] (one a 32)")
    # the shared exponent is floor(log2(amax)) - 2, checked block by block with Python's frexp
    amax = w.reshape(-1, 32).abs().amax(1)
    expected = [math.frexp(a)[1] - 1 - 2 + 127 for a in amax.tolist()]
    got = scales.flatten().tolist()
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert first is None, (
        f"block {first}'s scale byte is {got[first]}, its amax {amax[first].item():.6g}: the E8M0 byte is "
        f"floor(log2(amax)) - 2 + 127 = {expected[first]} (the -2 puts the largest magnitude in E2M1's top binade, "
        "[4, 8); 127 the bias)")
    w_hat = mx.dequantize_mxfp4(blocks, scales, layout)
    assert w_hat.shape == w.shape, f"dequantize_mxfp4 gives {tuple(w_hat.shape)} for a {tuple(w.shape)} weight"
    # requantizing what we decoded changes nothing; every error is at most one step of the top binade (2 * 2^e)
    for name, a, b in zip(("blocks", "scales"), mx.quantize_mxfp4(w_hat, layout), (blocks, scales)):
        same(a, b, f"quantize_mxfp4(dequantize_mxfp4(...), {layout!r})'s {name}", f"the {name} it decoded")
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((w - w_hat).abs() <= 2 * step).all(), (
        f"a weight decodes {((w - w_hat).abs() / step).max().item():.3g} x 2^(scale - 127) away from itself (at most "
        "2: half of E2M1's widest step, 4 to 6): is each code's value E2M1[code] * 2^(scale - 127)?")


@book("quantize_mxfp4", "dequantize_mxfp4")
def test_the_split_layout_is_ggufs_mxfp4_block():
    """A GGUF MXFP4 block is the E8M0 byte, then the 16 bytes of the split layout (element j low, j + 16 high):
    chapter 38's GGUF decoder reads them as dequantize_mxfp4 does."""
    torch.manual_seed(5)
    w = torch.randn(4, 128) * 3
    blocks, scales = mx.quantize_mxfp4(w, "split")
    raw = torch.cat((scales[..., None], blocks), -1).reshape(-1)                  # [4, 4 blocks, 17 bytes]
    same(mx.dequantize_mxfp4(blocks, scales, "split"), ggml.dequantize(raw, "MXFP4", (4, 128)),
         "dequantize_mxfp4(..., 'split')", "GGUF's MXFP4 block (element j low nibble, j + 16 high)")


@book("quantize_mxfp4", "dequantize_mxfp4")
def test_mxfp4_layouts_hold_the_same_values():
    torch.manual_seed(1)
    w = torch.randn(3, 96)
    inter, s1 = mx.quantize_mxfp4(w, "interleaved")
    split, s2 = mx.quantize_mxfp4(w, "split")
    same(s2, s1, "the split layout's scales", "the interleaved layout's")
    same(mx.dequantize_mxfp4(split, s2, "split"), mx.dequantize_mxfp4(inter, s1, "interleaved"),
         "dequantize_mxfp4(..., 'split')", "dequantize_mxfp4(..., 'interleaved') of the same weights")
    codes = mx.to_e2m1(w.reshape(3, 3, 32) / torch.exp2(s1.float() - 127)[..., None])
    for name, got, want in (("interleaved & 0xF", inter & 0xF, codes[..., 0::2]),
                            ("interleaved >> 4", inter >> 4, codes[..., 1::2]),
                            ("split & 0xF", split & 0xF, codes[..., :16]), ("split >> 4", split >> 4, codes[..., 16:])):
        same(got, want, name, "the format (interleaved: element 2j low, 2j + 1 high; split: j low, j + 16 high)")


TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}   # E2M1's midpoints -> the even code


def _check_ties(decoded, fmt):
    for x, want in TIES.items():
        for sign in (1, -1):
            got = decoded[sign * x]
            assert got == sign * want, (f"{fmt} stores {sign * x:g} as {got:g}: a value halfway between two E2M1 "
                                        f"values rounds to the one with an even code (mantissa bit 0): {sign * want:g}")


@book("quantize_mxfp4", "dequantize_mxfp4")
def test_mxfp4_rounds_a_tie_to_the_even_code():
    """A block whose largest magnitude is 6 has scale 2^0: each midpoint between E2M1 values is stored as itself."""
    values = [6.0] + list(TIES) + [-x for x in TIES]
    w = torch.tensor(values + [0.0] * (32 - len(values)))[None, :]
    decoded = mx.dequantize_mxfp4(*mx.quantize_mxfp4(w))[0].tolist()
    _check_ties(dict(zip(values, decoded)), "quantize_mxfp4")


@book("quantize_nvfp4", "dequantize_nvfp4")
def test_nvfp4_rounds_a_tie_to_the_even_code():
    """amax 6 x 448 makes the tensor scale 1 and a block of amax 6 has block scale 1: midpoints are stored as such."""
    values = [6.0] + list(TIES) + [-x for x in TIES]
    w = torch.tensor(values + [0.0] * (16 - len(values)) + [6.0 * 448] + [0.0] * 15)[None, :]
    decoded = mx.dequantize_nvfp4(*mx.quantize_nvfp4(w))[0].tolist()
    _check_ties(dict(zip(values, decoded)), "quantize_nvfp4")


# element 2j in the low nibble, 2j + 1 in the high one: what gpt-oss, transformers, torchao and compressed-tensors
# store for MXFP4 ("interleaved") and NVFP4 (nvfp4-pack-quantized); pairs (1, 2) -> codes 2, 4; (0.5, 3) -> 1, 5;
# (6, -1) -> 7, 10
PAIRS = [1.0, 2.0, 0.5, 3.0, 6.0, -1.0]
PAIR_BYTES = [0x42, 0x51, 0xA7]


def _check_bytes(packed, fmt):
    got = [int(b) for b in packed[:3]]
    assert got == PAIR_BYTES, (
        f"{fmt}'s first bytes are {', '.join(f'0x{b:02X}' for b in got)} for elements {PAIRS}; the format stores "
        f"element 2j in the low nibble and 2j + 1 in the high one: {', '.join(f'0x{b:02X}' for b in PAIR_BYTES)}")


@book("quantize_mxfp4")
def test_mxfp4_interleaved_bytes_are_the_formats():
    w = torch.tensor(PAIRS + [0.0] * 26)[None, :]
    _check_bytes(mx.quantize_mxfp4(w, "interleaved")[0].flatten(), "quantize_mxfp4")


@book("quantize_nvfp4")
def test_nvfp4_bytes_are_the_formats():
    """With the tensor's amax 6 x 448 in another block, this block's scale is exactly 1."""
    w = torch.tensor(PAIRS + [0.0] * 10 + [6.0 * 448] + [0.0] * 15)[None, :]
    _check_bytes(mx.quantize_nvfp4(w)[0].flatten(), "quantize_nvfp4")


def test_exponent_just_below_a_power_of_two():
    w = torch.zeros(1, 32)
    w[0, 0] = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0))   # float32 log2 rounds this up to 3.0
    assert mx.quantize_mxfp4(w)[1].item() == 127                 # floor(log2(7.99..)) - 2 = 0


@book("quantize_nvfp4", "dequantize_nvfp4")
def test_nvfp4_round_trip():
    torch.manual_seed(2)
    w = torch.randn(40, 48) * torch.rand(40, 1) * 4
    packed, block_scale, tensor_scale = mx.quantize_nvfp4(w)
    assert packed.shape == (40, 3, 8) and block_scale.shape == (40, 3) and block_scale.dtype == torch.float8_e4m3fn, (
        f"packed {tuple(packed.shape)}, block_scale {block_scale.dtype} {tuple(block_scale.shape)}; a [40, 48] weight "
        "gives packed [40, 3, 8] (two codes a byte) and float8_e4m3fn block scales [40, 3] (one a 16)")
    want = w.abs().max() / (448 * 6)
    assert tensor_scale.numel() == 1 and torch.isclose(tensor_scale, want), (
        f"tensor_scale is {tensor_scale.flatten()[0].item():.6g}; amax / (448 * 6) = {want.item():.6g} (E4M3's top "
        "value times E2M1's) lets the largest block scale land on 448")
    assert block_scale.float().max() == 448, (
        f"the largest block scale is {block_scale.float().max().item():g}, not E4M3's top value 448: is each block "
        "scale its amax / 6 / tensor_scale?")
    scale = (block_scale.float() * tensor_scale).repeat_interleave(16, 1)
    w_hat = mx.dequantize_nvfp4(packed, block_scale, tensor_scale)
    assert ((w - w_hat).abs() <= scale * 1.0 + 1e-7).all(), (      # half of E2M1's widest step (2), or saturation
        f"a weight decodes {((w - w_hat).abs() / scale).max().item():.3g} x its scale away from itself (at most 1: "
        "half of E2M1's widest step): is each value E2M1[code] * block_scale * tensor_scale?")
    assert torch.equal(mx.to_e2m1(w_hat / scale) & 7, mx.to_e2m1(w / scale) & 7), (
        "a code is not the nearest E2M1 value of weight / (block_scale * tensor_scale), with the E4M3-rounded block "
        "scale (round the block scale first, then divide by what it stores)")


def test_nvfp4_codes_read_as_checkpoints_store_them_flat():
    packed, block_scale, tensor_scale = mx.quantize_nvfp4(torch.randn(8, 64))
    assert torch.equal(mx.dequantize_nvfp4(packed.flatten(-2), block_scale, tensor_scale),
                       mx.dequantize_nvfp4(packed, block_scale, tensor_scale))
    assert torch.equal(mx.NVFP4Linear(packed, block_scale, tensor_scale).packed, packed.flatten(-2))


@book("quantize_mxfp4", "dequantize_mxfp4", "quantize_nvfp4", "dequantize_nvfp4")
def test_nvfp4_beats_mxfp4_on_gaussian_weights():
    torch.manual_seed(3)
    w = torch.randn(256, 256)
    mse_mx = (mx.dequantize_mxfp4(*mx.quantize_mxfp4(w)) - w).pow(2).mean()
    mse_nv = (mx.dequantize_nvfp4(*mx.quantize_nvfp4(w)) - w).pow(2).mean()
    assert mse_nv < 0.8 * mse_mx


def test_bad_input():
    with pytest.raises(ValueError, match='multiple of 32'):
        mx.quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match='multiple of 16'):
        mx.quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match='layout must be one of'):
        mx.quantize_mxfp4(torch.randn(4, 32), layout="gguf")
    with pytest.raises(ValueError, match='NaN or infinite'):
        mx.quantize_nvfp4(torch.full((1, 16), float("nan")))
    blocks, scales = mx.quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match='0xFF is NaN'):
        mx.MXFP4Linear(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match='do not match'):
        mx.dequantize_mxfp4(blocks, scales[:, :1])
    packed, bs, ts = mx.quantize_nvfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match='NVFP4Linear needs'):
        mx.NVFP4Linear(packed, bs[:, :2], ts)
    with pytest.raises(ValueError, match="one finite positive number"):
        mx.NVFP4Linear(packed, bs, torch.ones(2))


def _layers(n, k):
    torch.manual_seed(4)
    w = torch.randn(n, k) * torch.rand(n, 1)
    w[1, :32] *= 2.0 ** -126                                     # an E8M0 scale byte of 0 (2^-127, subnormal)
    bias = torch.randn(n)
    return [mx.MXFP4Linear(*mx.quantize_mxfp4(w), bias=bias), mx.NVFP4Linear(*mx.quantize_nvfp4(w), bias=bias)]


@pytest.mark.parametrize("n,k,m", [(70, 96, 3), (33, 160, 1)])
def test_kernels_equal_torch(n, k, m):
    for layer in _layers(n, k):
        # with x = I the kernel hands back exactly the weight it decoded
        assert torch.equal(layer.kernel_matmul(torch.eye(k)).T, layer.dequantize())
        x = torch.randn(m, k)
        with impl("engine"):
            y_engine = layer(x)
        assert torch.allclose(y_engine, layer(x), rtol=1e-5, atol=1e-5)
    assert _layers(n, k)[0].scales[1, 0] == 0


def test_quantize_models():
    for fmt, kind, bits in (("mxfp4", mx.MXFP4Linear, 4.25), ("nvfp4", mx.NVFP4Linear, 4.5)):
        torch.manual_seed(5)
        model = nn.Sequential()
        model.add_module("up", nn.Linear(64, 96))
        model.add_module("lm_head", nn.Linear(96, 32))
        ref = model.up.weight.detach().clone()
        config = mx.quantize(model, format=fmt)
        assert config["quant_method"] == fmt
        assert isinstance(model.up, kind) and isinstance(model.lm_head, nn.Linear)
        assert bits <= model.up.bits_per_weight <= bits + 32 / ref.numel()
        rel = (model.up.dequantize() - ref).norm() / ref.norm()
        assert 0.01 < rel < 0.2
    ragged = nn.Sequential()
    ragged.add_module("down", nn.Linear(40, 8))
    with pytest.raises(ValueError, match="down: in_features=40"):
        mx.quantize(ragged, format="nvfp4")
    with pytest.raises(ValueError, match="format must be one of"):
        mx.quantize(ragged, format="fp4")
