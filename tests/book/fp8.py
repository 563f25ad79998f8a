"""Chapter 39's FP8 listings, typed as a reader would (`pytest tests/test_ch39_fp8.py --yours tests/book/fp8.py`).
check_device is the engine's kernels' check."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import check_device

E4M3_MAX = 448.0


def quantize_blocks(weight, block=128):
    """[out, in] -> (fp8 weight, scale_inv [ceil(out/b), ceil(in/b)]) with one scale per block."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    padded = F.pad(weight.float(), (0, cols * block - in_f, 0, rows * block - out_f))
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows * block, cols * block)[:out_f, :in_f].contiguous(), scale


def dequantize_blocks(weight, scale_inv, block=128):
    s = scale_inv.repeat_interleave(block, 0)[:weight.shape[0]].repeat_interleave(block, 1)[:, :weight.shape[1]]
    return weight.float() * s


def quantize_activations(x, group=128):
    """Per token, per 128 input channels: the FP8 activations a W8A8 GEMM consumes."""
    n, k = x.shape
    g = x.float().reshape(n, k // group, group)
    scale = g.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    return (g / scale[..., None]).to(torch.float8_e4m3fn).reshape(n, k), scale


def w8a8_reference(x, weight, scale_inv, block=128):
    xq, xs = quantize_activations(x, block)
    out = torch.zeros(x.shape[0], weight.shape[0])
    for kb in range(x.shape[1] // block):
        a = xq[:, kb * block:(kb + 1) * block].float() * xs[:, kb:kb + 1]
        w = weight[:, kb * block:(kb + 1) * block].float() * scale_inv[:, kb].repeat_interleave(block)[:weight.shape[0], None]
        out += a @ w.T
    return out


@triton.jit
def fp8_block_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, s_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=w_ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (rn[:, None] // 128) * s_cols + rk[None, :] // 128, mask=w_ok, other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w * s), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_block_matmul(x, weight, scale_inv, block_m=16, block_n=32, block_k=32):
    check_device(x, weight, scale_inv)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    fp8_block_kernel[grid](x.contiguous(), weight.contiguous(), scale_inv.float().contiguous(), y, m, n, k,
                           scale_inv.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
