"""Round-to-nearest and the one affine integer layer (codes x scale + offset per group), with its Triton kernel."""
import pytest
import torch

from engine.formats.numerics import affine
from engine.formats.numerics.affine import (AffineQuantLinear, affine_codes, choose_clip, choose_clip_reference,
                                            fake_quantize, find_params, pack_bits, pack_int32, pack_nibbles,
                                            quantize_to_affine, unpack_bits, unpack_int32, unpack_nibbles)
from engine.layers import impl, quantized_linears, set_impl


def test_find_params_covers_the_range_and_rounds_scales_to_f16():
    w = torch.tensor([[-1.0, 0.5, 2.0], [0.0, 0.0, 0.0]])
    scale, zero = find_params(w, 4)
    assert torch.equal(scale, scale.half().float())
    assert torch.allclose(scale[0], torch.tensor(3.0 / 15), rtol=1e-3) and zero[0] == 5
    lo, hi = (0 - zero) * scale, (15 - zero) * scale
    assert (lo[0] <= -1.0 + scale[0] / 2) and (hi[0] >= 2.0 - scale[0] / 2)


def test_rtn_error_is_at_most_half_a_step():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    codes, scales, zeros = affine_codes(w, 4, 32)
    step = scales.repeat_interleave(32, 1)
    assert ((fake_quantize(w, 4, 32) - w).abs() <= step / 2 + 1e-6).all()
    assert codes.max() <= 15 and codes.dtype == torch.uint8


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_bits_round_trip(bits):
    codes = torch.randint(0, 2 ** bits, (3, 13), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, -(-13 * bits // 8))
    assert torch.equal(unpack_bits(packed, bits, 13), codes)


def test_pack_nibbles_puts_the_even_element_in_the_low_nibble():
    assert pack_nibbles(torch.tensor([[1, 2]])).item() == 0x21
    assert torch.equal(unpack_nibbles(torch.tensor([[0x21]], dtype=torch.uint8)), torch.tensor([[1, 2]]).byte())


def test_pack_int32_order_and_sign():
    values = torch.arange(8).repeat(2, 1) % 16
    values[1, 7] = 15                                            # top nibble set: the word is negative as int32
    natural = pack_int32(values)
    assert natural[0, 0].item() == 0x76543210
    assert natural[1, 0].item() < 0 and torch.equal(unpack_int32(natural), values.byte())
    awq = pack_int32(values, 4, [0, 2, 4, 6, 1, 3, 5, 7])
    assert (awq[0, 0].item() >> 16) & 0xF == 1                  # element 1 sits in bits 16-19
    assert torch.equal(unpack_int32(awq, 4, [0, 2, 4, 6, 1, 3, 5, 7]), values.byte())
    with pytest.raises(ValueError, match="cannot pack"):
        pack_int32(torch.zeros(1, 7))


@pytest.mark.parametrize("bits,group", [(4, 64), (2, 64), (4, 24)])
def test_layer_equals_fake_quantized_matmul(bits, group):
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(40, 120, generator=g), torch.randn(5, 120, generator=g), torch.randn(40, generator=g)
    layer = AffineQuantLinear.from_weight(w, bits, group, bias=b)
    expected = x @ fake_quantize(w, bits, group).T + b
    assert torch.allclose(layer(x), expected, atol=1e-5)


def test_bits_per_weight_counts_the_metadata():
    w = torch.randn(64, 256)
    layer = AffineQuantLinear.from_weight(w, 4, 64)
    assert layer.bits_per_weight == 4.5
    assert AffineQuantLinear.from_weight(w, 2, 64).bits_per_weight == 2.5


def test_input_permutation_is_undone():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(16, 64, generator=g), torch.randn(3, 64, generator=g)
    perm = torch.randperm(64, generator=g)
    stored = w[:, perm]                                          # columns kept in the order perm
    layer = AffineQuantLinear.from_weight(stored, 4, 16, perm=perm)
    assert torch.allclose(layer.dequantize()[:, perm], fake_quantize(stored, 4, 16))
    with impl("engine"):
        y = layer(x)
    assert torch.allclose(y, x @ layer.dequantize().T, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("m,n,k,group", [(1, 33, 96, 32), (67, 70, 130, 64)])
def test_triton_kernel_equals_torch_on_odd_shapes(bits, m, n, k, group):
    g = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    layer = AffineQuantLinear.from_weight(w, bits, group)
    reference = layer(x)
    with impl("engine"):
        out = layer(x)
    assert torch.allclose(out, reference, atol=1e-4, rtol=1e-4)


def test_choose_clip_never_increases_output_error():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(32, 128, generator=g), torch.randn(256, 128, generator=g)
    w[:, 5] *= 8                                                 # an outlier column the range must stretch over
    clip = choose_clip(w, x.T @ x / len(x), 3, 64)
    err = lambda wq: (x @ (wq - w).T).pow(2).mean()              # noqa: E731
    assert (clip <= 1).all() and (clip < 1).any()
    assert err(fake_quantize(w, 3, 64, clip=clip)) <= err(fake_quantize(w, 3, 64))


@pytest.mark.parametrize("in_features, group, clipped", [(128, 64, False), (100, 32, True)])
def test_fake_quantize_is_exactly_the_stored_layer(in_features, group, clipped):
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(24, in_features, generator=g) * 3
    clip = torch.rand(24, -(-in_features // group), generator=g) * 0.5 + 0.5 if clipped else None
    codes, scales, zeros = affine_codes(w, 4, group, clip)
    stored = affine.dequantize_affine(codes, scales, -zeros * scales, group)
    assert torch.equal(fake_quantize(w, 4, group, clip=clip), stored)


@pytest.mark.parametrize("in_features, group", [(128, 64), (100, 32)])
def test_choose_clip_from_the_gram_matrix_equals_the_per_token_search(in_features, group):
    g = torch.Generator().manual_seed(in_features)
    w, x = torch.randn(48, in_features, generator=g), torch.randn(300, in_features, generator=g)
    w[:, 3] *= 6
    x[:, 7] *= 5                                                 # a large input channel
    fast, reference = choose_clip(w, x.T @ x / len(x), 4, group), choose_clip_reference(w, x, 4, group)
    assert (fast < 1).any()
    assert torch.equal(fast, reference)                            # errors compared in float64 on both sides


def test_rtn_quantize_model_replaces_every_linear_but_lm_head(tiny_model):
    qcfg = affine.quantize(tiny_model, bits=4, group_size=16)
    assert qcfg == {"quant_method": "rtn", "bits": 4, "group_size": 16, "sym": False}
    replaced = quantized_linears(tiny_model)
    assert len(replaced) == 14 and isinstance(tiny_model.lm_head, torch.nn.Linear)
    assert tiny_model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 256)


def test_impl_switch_rejects_unknown_names():
    with pytest.raises(ValueError, match="impl"):
        set_impl("cuda")


def test_a_free_offset_is_never_rounded_onto_an_integer_zero_point():
    """The two grids hold what they were given: integer zero points come back as stored (no division by the scale),
    and offsets just off that grid (-2.0005 steps, a GGUF Q4_1 min) are refused by a writer of integer zero points
    rather than rounded to 2, while the layer computes with them exactly."""
    layer = AffineQuantLinear.from_weight(torch.randn(8, 64, generator=torch.Generator().manual_seed(3)), 4, 32)
    assert layer.zeros.dtype == torch.uint8 and torch.equal(affine.affine_parts(layer)[2], layer.zeros.float())
    offsets = -(layer.zeros.float() + 5e-4) * layer.scales
    free = AffineQuantLinear(layer.packed, layer.scales, offsets, 32, True, in_features=64)
    assert free.zeros is None and torch.equal(free.offsets, offsets)
    with pytest.raises(ValueError, match="free offsets"):
        affine.affine_parts(free)


def test_non_finite_bias_and_grids_that_overflow_are_refused():
    codes, scales, zeros = affine_codes(torch.randn(4, 64), 4, 32)
    with pytest.raises(ValueError, match="bias holds NaN or infinite values"):
        AffineQuantLinear.from_codes(codes, scales, 32, 4, zeros=zeros, bias=torch.full((4,), float("inf")))
    with pytest.raises(ValueError, match="and so must the weights they decode to"):        # 1e38 * 15: inf
        AffineQuantLinear.from_codes(codes, torch.full_like(scales, 1e38), 32, 4, zeros=zeros)
    with pytest.raises(ValueError, match="and so must the weights they decode to"):
        AffineQuantLinear.from_codes(codes, scales, 32, 4, offsets=torch.full_like(scales, float("nan")))


def test_bad_inputs_are_clear_errors():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="group_size"):
        affine_codes(w, 4, 0)
    with pytest.raises(ValueError, match="not finite"):
        affine_codes(torch.full((4, 64), float("nan")), 4, 32)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(2, 8, dtype=torch.uint8), 3)
    layer = AffineQuantLinear.from_weight(w, 4, 32)
    with pytest.raises(ValueError, match="input has 32 features, the layer expects 64"):
        layer(torch.zeros(2, 32))


def test_a_tiny_range_still_gets_a_usable_scale():
    w = torch.tensor([[1e-9, -2e-9, 0.0, 3e-9]])
    codes, scales, zeros = affine_codes(w, 4, 4)
    assert (scales > 0).all() and torch.isfinite(-zeros * scales).all()
    assert (fake_quantize(w, 4, 4) - w).abs().max() < 1e-7


def test_the_books_affine_layer_takes_codes_scales_offsets_and_returns_its_dtype():
    """Chapter 38's call, as chapter 39's apply_awq makes it: quantize_to_affine's offsets, pack_nibbles' codes,
    packed=True; the layer is the same grid as the integer-zero-point one, and returns `dtype`."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    codes, scales, offsets = quantize_to_affine(w, 4, 32)
    _, _, zeros = affine_codes(w, 4, 32)
    assert torch.equal(offsets, -zeros * scales)
    layer = AffineQuantLinear(pack_nibbles(codes), scales, offsets, 32, True, dtype=torch.bfloat16)
    assert torch.equal(layer.weight_codes, codes) and torch.equal(layer.offsets, offsets)
    assert torch.equal(layer.dequantize(), AffineQuantLinear.from_weight(w, 4, 32).dequantize())
    assert layer(torch.randn(2, 64)).dtype == torch.bfloat16
    assert torch.equal(AffineQuantLinear(codes, scales, offsets, 32).packed, layer.packed)      # packed=False
    with pytest.raises(ValueError, match=r"packed \(the 5th argument\)"):
        AffineQuantLinear(codes, scales, offsets, 32, "yes")
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        AffineQuantLinear(codes + 16, scales, offsets, 32)
