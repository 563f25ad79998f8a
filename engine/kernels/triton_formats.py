"""Every Triton kernel of the engine, each beside its Python launcher.

Each kernel computes y = x @ W^T while decoding W from its stored form inside the kernel, so the dense weight never
exists in memory. On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
below before triton is imported): the same kernel source, executed with NumPy on the CPU. That is slow but exact,
which is what the tests need.

One switch chooses the implementation of every quantized layer's forward pass: `set_impl("torch")` (dequantize in
PyTorch, then matmul) or `set_impl("engine")` (these kernels). `run.py --impl` turns it.

Interpreter trap (checked): converting f32 -> fp8 inside a kernel is wrong under the interpreter (no saturation,
ties away from zero, subnormals flushed). Kernels here only ever widen fp8 to f32, which is exact.
"""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_IMPLS = ("torch", "engine")
_impl = "torch"


def set_impl(name: str) -> None:
    """Choose how quantized layers compute: "torch" (dequantize + matmul) or "engine" (Triton kernels)."""
    global _impl
    if name not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {name!r}")
    _impl = name


def get_impl() -> str:
    return _impl


@contextlib.contextmanager
def impl(name: str):
    """`with impl("engine"): model(ids)` runs every quantized layer through its kernel, then restores the switch."""
    previous = get_impl()
    set_impl(name)
    try:
        yield
    finally:
        set_impl(previous)


def tile_sizes(m):
    """(BLOCK_M, BLOCK_N, BLOCK_K). Under the interpreter each program is a Python-level step, so big tiles (few
    programs, wide NumPy ops) are fastest; compiled, small-M decode shapes want a small BLOCK_M."""
    if INTERPRETED:
        return 64, 64, 64
    return (16 if m <= 16 else 64), 64, 64


def check_inputs(x, *tensors):
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    devices = {t.device for t in (x, *tensors)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------------------------------------------
# Affine integer codes (RTN, GPTQ, AWQ): W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]
# q is packed along k, 8 // BITS codes per byte, low bits first (engine.formats.affine.pack_bits).


@triton.jit
def affine_matmul_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, q_cols, groups, group_size,
                         BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    per_byte: tl.constexpr = 8 // BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(q_ptr + rn[:, None] * q_cols + rk[None, :] // per_byte, mask=w_ok, other=0).to(tl.int32)
        q = (byte >> ((rk[None, :] % per_byte) * BITS)) & ((1 << BITS) - 1)
        g = rn[:, None] * groups + rk[None, :] // group_size
        s = tl.load(s_ptr + g, mask=w_ok, other=0.0)
        o = tl.load(o_ptr + g, mask=w_ok, other=0.0)
        w = q.to(tl.float32) * s + o
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def affine_matmul(x, packed, scales, offsets, group_size, bits):
    """x [M, K] float32, packed uint8 [N, ceil(K * bits / 8)], scales / offsets float32 [N, groups] -> y [M, N]."""
    check_inputs(x, packed, scales, offsets)
    if bits not in (2, 4, 8):
        raise ValueError(f"affine kernel supports 2, 4 or 8 bits, got {bits}")
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    bm, bn, bk = tile_sizes(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    affine_matmul_kernel[grid](x.float().contiguous(), packed.contiguous(), scales.float().contiguous(),
                               offsets.float().contiguous(), y, m, n, k, packed.shape[1], scales.shape[1],
                               group_size, BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y
