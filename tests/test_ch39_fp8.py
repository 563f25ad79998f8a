"""FP8 block scales (chapter 39, "FP8 checkpoints"): quantize_blocks on ragged shapes, w8a8_reference and the W8A16
kernel, marked @book (`pytest tests/test_ch39_fp8.py --yours FILE` runs them on FILE's functions); then the
engine's FP8BlockLinear and its checkpoint parts."""
import pytest
import torch
from torch import nn

from engine.layers import impl
from engine.formats import fp8
from helpers import same

book = pytest.mark.book


def _per_weight_scale(scale_inv, shape, block):
    return scale_inv.repeat_interleave(block, 0)[:shape[0]].repeat_interleave(block, 1)[:, :shape[1]]


@book("quantize_blocks", "dequantize_blocks")
@pytest.mark.parametrize("shape,block", [((130, 200), 128), ((256, 128), 128), ((5, 7), 4), ((33, 65), 32)])
def test_quantize_blocks_ragged(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, s = fp8.quantize_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    blocks = (-(-shape[0] // block), -(-shape[1] // block))
    assert s.dtype == torch.float32 and s.shape == blocks, (
        f"scale_inv is {s.dtype} {tuple(s.shape)}; one float32 per {block} x {block} block of a {shape} weight is {blocks}")
    # every block's largest magnitude lands exactly on E4M3's top value 448
    per = _per_weight_scale(s, shape, block)
    top = (w.abs() / per - fp8.E4M3_MAX).abs() < 1e-3
    assert torch.isclose(q.float().abs()[top], torch.tensor(fp8.E4M3_MAX)).all(), (
        f"a block's largest weight is stored as {q.float().abs()[top].min().item():g}; scale_inv = amax / 448 puts it "
        "on E4M3's top value 448")
    assert top.sum() >= s.numel(), (
        f"only {int(top.sum())} weights land on 448 for {s.numel()} blocks: scale_inv[r, c] must be the amax of rows "
        f"r*{block}.. and columns c*{block}.. divided by 448 (is the tile reshape [rows, {block}, cols, {block}]?)")
    # relative error of a 3-bit mantissa (half an ulp = 2^-4) or, in the subnormal range, half of 2^-9 * scale
    try:
        back = fp8.dequantize_blocks(q, s, block)
    except RuntimeError as e:
        pytest.fail(f"dequantize_blocks on a {shape} weight in {block}-blocks: {e}: a ragged last block's scales, "
                    "repeated block times, must be cut to the weight's rows and columns", pytrace=False)
    bound = torch.maximum(w.abs() * 2 ** -4, per * 2 ** -10) * (1 + 1e-6)
    worst = ((back - w).abs() / bound).argmax().item()
    r, c = divmod(worst, shape[1])
    assert (back - w).abs()[r, c] <= bound[r, c], (
        f"dequantize_blocks gives {back[r, c].item():.6g} for weight [{r}, {c}] = {w[r, c].item():.6g} (E4M3's 3 "
        f"mantissa bits: within 2^-4 of it): is w = q * scale_inv, block [{r // block}, {c // block}]'s scale over "
        f"its {block} x {block} weights?")


@book("quantize_blocks", "dequantize_blocks")
def test_an_all_zero_block_decodes_to_zeros_not_nan():
    """A block of zeros (a pruned tile, padding) has amax 0: without the clamp its scale is 0, its weights 0 / 0."""
    w = torch.randn(256, 256)
    w[:128, 128:] = 0
    q, s = fp8.quantize_blocks(w)
    back = fp8.dequantize_blocks(q, s)
    assert s[0, 1] > 0, f"the all-zero block's scale_inv is {s[0, 1].item():g}: clamp its amax (clamp_min(1e-12))"
    same(back[:128, 128:], w[:128, 128:], "the all-zero block decoded", "a block of zeros")


def test_zero_block_and_bad_input():
    w = torch.zeros(4, 6)
    w[0, 0] = 1.0
    q, s = fp8.quantize_blocks(w, 4)
    assert torch.equal(fp8.dequantize_blocks(q, s, 4), w)
    with pytest.raises(ValueError, match='scale_inv has shape'):
        fp8.dequantize_blocks(q, s[:, :1], 4)
    with pytest.raises(ValueError, match='NaN or infinite'):
        fp8.quantize_blocks(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match='must be float8_e4m3fn'):
        fp8.FP8BlockLinear(q.float(), s, block=4)
    with pytest.raises(ValueError, match=r'and so must the weights it decodes \(scale x 448\)'):
        fp8.FP8BlockLinear(q, torch.full_like(s, 1e37), block=4)            # 1e37 * 448 overflows float32
    for dtype in (torch.int64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match='weight_scale_inv must be a 16- or 32-bit float tensor'):
            fp8.FP8BlockLinear(q, s.to(dtype), block=4)


def _w8a8_loop(x, weight, scale_inv, block):
    """The seed's literal loop over 128-wide slices of K (the vectorized version must equal it)."""
    xq, xs = fp8.quantize_activations(x, block)
    out = torch.zeros(x.shape[0], weight.shape[0])
    for kb in range(x.shape[1] // block):
        a = xq[:, kb * block:(kb + 1) * block].float() * xs[:, kb:kb + 1]
        w = weight[:, kb * block:(kb + 1) * block].float() * scale_inv[:, kb].repeat_interleave(block)[
            :weight.shape[0], None]
        out += a @ w.T
    return out


@book("quantize_activations", "w8a8_reference")
def test_w8a8_reference():
    torch.manual_seed(1)
    x, w = torch.randn(6, 256), torch.randn(200, 256) * 0.05
    q, s = fp8.quantize_blocks(w)
    y = fp8.w8a8_reference(x, q, s)
    loop = _w8a8_loop(x, q, s, 128)
    assert torch.allclose(y, loop, rtol=1e-5, atol=1e-5), (
        f"w8a8_reference is off by up to {(y - loop).abs().max().item():.3g} from summing, over each 128 inputs k, "
        "(xq_k * x_scale_k) @ (q_k * scale_inv_k)^T, with quantize_activations' per-token scales")
    dense = x @ w.T
    rel = ((y - dense).norm() / dense.norm()).item()
    assert rel < 0.05, f"w8a8_reference is {rel:.1%} from x @ w^T (both operands in E4M3: a few percent at most)"
    assert (y - x @ fp8.dequantize_blocks(q, s).T).abs().max() > 0, (
        "w8a8_reference equals the float activations' product: the activations must be rounded to E4M3 too")


@book("fp8_block_matmul")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_w8a16_kernel_computes_x_times_the_dequantized_weight(dtype):
    """fp8_block_matmul(x, weight, scale_inv) = x @ dequantize_blocks(weight, scale_inv)^T, returned in x's dtype
    (a ragged last block of outputs included)."""
    torch.manual_seed(4)
    q, s = fp8.quantize_blocks(torch.randn(200, 256) * 0.05)
    x = torch.randn(5, 256).to(dtype)
    expected = x.float() @ fp8.dequantize_blocks(q, s).T
    for y in (fp8.fp8_block_matmul(x, q, s), fp8.fp8_block_matmul(x, q, s, block_m=16, block_n=32, block_k=32)):
        assert y.dtype == dtype and y.shape == (5, 200), f"y is {y.dtype} {tuple(y.shape)}; x's dtype, (5, 200)"
        bad = ~torch.isclose(y.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
        assert not bad.any(), (
            f"fp8_block_matmul differs from x @ dequantize_blocks(weight, scale_inv)^T at {int(bad.sum())} of 1000 "
            f"outputs, first output column {bad.nonzero()[0, 1].item()}: is weight [n, k]'s scale read at "
            "scale_inv[n // 128, k // 128], the row of blocks times scale_inv's columns?")


@book("quantize_activations")
def test_quantize_activations_scales_each_token_and_group_of_inputs():
    """Activations [tokens, in] -> E4M3 codes [tokens, in], scales [tokens, in / group]: each token's each group of
    inputs has its own scale, its largest magnitude on 448 (one outlier token does not flatten the others)."""
    x = torch.randn(3, 128) * torch.tensor([[1.0], [100.0], [0.01]])
    xq, xs = fp8.quantize_activations(x, 32)
    assert xq.shape == (3, 128) and xs.shape == (3, 4), f"codes {tuple(xq.shape)}, scales {tuple(xs.shape)}"
    top = xq.float().abs().view(3, 4, 32).amax(-1)
    assert (top == fp8.E4M3_MAX).all(), (
        f"the largest code of each (token, group) is {top.tolist()}, not 448 each: is each scale the amax of one "
        "token's 32 inputs over 448 (amax over the last axis of x viewed [tokens, groups, group])?")


@pytest.mark.parametrize("shape,block,m", [((70, 130), 128, 3), ((65, 33), 16, 5)])
def test_kernel_equals_torch(shape, block, m):
    torch.manual_seed(2)
    layer = fp8.FP8BlockLinear(*fp8.quantize_blocks(torch.randn(shape), block), bias=torch.randn(shape[0]),
                               block=block)
    # with x = I the kernel returns the dequantized weight it decoded, exactly
    eye = torch.eye(shape[1])
    assert torch.equal(layer.kernel_matmul(eye).T, layer.dequantize())
    x = torch.randn(m, shape[1])
    with impl("engine"):
        y_engine = layer(x)
    y_torch = layer(x)
    assert torch.allclose(y_engine, y_torch, rtol=1e-5, atol=1e-5)


def test_quantize_model_and_checkpoint_parts():
    torch.manual_seed(3)
    model = nn.Sequential()
    model.add_module("up", nn.Linear(256, 300, bias=True))
    model.add_module("lm_head", nn.Linear(300, 64, bias=False))
    ref = model.up.weight.detach().clone()
    config = fp8.quantize(model)
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}
    assert isinstance(model.up, fp8.FP8BlockLinear) and isinstance(model.lm_head, nn.Linear)
    assert 8.0 < model.up.bits_per_weight < 8.01
    assert (model.up.dequantize() - ref).abs().max() <= ref.abs().max() * 2 ** -4
    spec = fp8.validate(config)
    assert fp8.CHECKPOINT.parts(spec) == ("weight", "weight_scale_inv")
    parts = fp8.CHECKPOINT.write(model.up, spec)
    back = fp8.CHECKPOINT.read({**parts, "bias": model.up.bias}, spec)
    assert torch.equal(back.dequantize(), model.up.dequantize()) and torch.equal(back.bias, model.up.bias)
    for bad, field in (({**config, "weight_block_size": [128, 64]}, "weight_block_size"),
                       ({**config, "weight_block_size": None}, "no weight_block_size"),
                       ({**config, "weight_block_size": [True, True]}, "weight_block_size"),
                       ({**config, "fmt": "e5m2"}, "fmt"), ({**config, "activation_scheme": "static"}, "activation")):
        with pytest.raises(ValueError, match=field):
            fp8.validate(bad)
    with pytest.raises(ValueError, match="scale_inv has shape"):            # scales that belong to 64x64 blocks
        fp8.CHECKPOINT.read(parts, fp8.validate({**config, "weight_block_size": [64, 64]}))
