"""The book's dequantize-and-matmul kernels, each beside its Python launcher.

Each kernel computes y = x @ W^T while decoding W from its stored form inside the kernel, so the dense weight never
exists in memory. On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
engine/kernels/__init__.py before triton is imported): the same kernel source, executed with NumPy on the CPU. That
is slow but exact, which is what the tests need. The lossless stream decoders (rANS, Rice) are in stream_decoders.py.

Interpreter trap (checked): converting f32 -> fp8 inside a kernel is wrong under the interpreter (no saturation,
ties away from zero, subnormals flushed). Kernels here only ever widen fp8 to f32, which is exact.
"""
import torch
import triton
import triton.language as tl

from . import INTERPRETED, check_inputs


def tile_sizes(m):
    """(BLOCK_M, BLOCK_N, BLOCK_K), powers of two >= 16. Under the interpreter every program and every tl op costs
    Python overhead, so the fastest tiles are the biggest (a 1024 x 768 x 256 int4 matmul: 30 s with 64^3 tiles,
    1.2 s with 1024 x 256 x 128, measured on 2 cores); compiled, small-M decode shapes want a small BLOCK_M."""
    if INTERPRETED:
        return min(1024, max(16, triton.next_power_of_2(m))), 256, 128
    return (16 if m <= 16 else 64), 64, 64


def launch_matmul(kernel, x, n, weights, extras=(), **constexprs):
    """Run a dequantize-and-matmul kernel: kernel(x, *weights, y, M, N, K, *extras, **constexprs, BLOCK_M, BLOCK_N,
    BLOCK_K) over a grid of output tiles. Every matmul kernel below has that signature. Returns y [M, n] float32."""
    m, k = x.shape
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    bm, bn, bk = tile_sizes(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    kernel[grid](x.float().contiguous(), *weights, y, m, n, k, *extras, **constexprs,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


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
    k, n = x.shape[1], packed.shape[0]
    groups = -(-k // group_size) if group_size > 0 else 0
    if packed.shape[1] != -(-k * bits // 8) or scales.shape != (n, groups) or offsets.shape != (n, groups):
        raise ValueError(f"affine shapes do not fit K={k}, {bits} bits, group_size={group_size}: packed "
                         f"{tuple(packed.shape)}, scales {tuple(scales.shape)}, offsets {tuple(offsets.shape)}")
    return launch_matmul(affine_matmul_kernel, x, packed.shape[0],
                         (packed.contiguous(), scales.float().contiguous(), offsets.float().contiguous()),
                         (packed.shape[1], scales.shape[1], group_size), BITS=bits)


# ----------------------------------------------------------------------------------------------------------------
# FP8 and FP4 (engine/formats/fp8.py, engine/formats/mx.py). Every kernel only widens low-precision codes to f32,
# which is exact (f32 -> fp8 inside a kernel is the interpreter trap above).
#   FP8 block  W[n, k] = e4m3[n, k] * s[n // B, k // B]                        (W8A16; B = 128 in checkpoints)
#   MXFP4      W[n, k] = e2m1[n, k] * 2^(e[n, k // 32] - 127)                  (E8M0 scale per 32)
#   NVFP4      W[n, k] = e2m1[n, k] * (e4m3[n, k // 16] * t)                   (E4M3 scale per 16, f32 per tensor)
# FP4 codes are two per byte, element 2j in the low nibble (the interleaved layout).


@triton.jit
def fp8_block_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, s_cols, block,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W8A16: FP8 weight tiles are widened in registers and scaled by their block's factor."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=w_ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (rn[:, None] // block) * s_cols + rk[None, :] // block, mask=w_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w * s), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_block_matmul(x, weight, scale_inv, block=128):
    """x [M, K] float32, weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N/block), ceil(K/block)] -> y [M, N]."""
    check_inputs(x, weight, scale_inv)
    k = x.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    if block < 1 or tuple(scale_inv.shape) != (-(-n // block), -(-k // block)):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit a [{n}, {k}] weight in {block}-blocks")
    return launch_matmul(fp8_block_kernel, x, n, (weight.contiguous(), scale_inv.float().contiguous()),
                         (scale_inv.shape[1], block))


# E2M1 code -> value (engine.formats.mx.E2M1; code = sign << 3 | magnitude index). One gather from this 16-entry
# table decodes a nibble; under the interpreter it is also ~30% faster than decoding sign / exponent / mantissa bits.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_e2m1_tables = {}


def e2m1_table(device):
    if device not in _e2m1_tables:
        _e2m1_tables[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return _e2m1_tables[device]


@triton.jit
def mxfp4_matmul_kernel(x_ptr, b_ptr, e_ptr, lut_ptr, y_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(b_ptr + rn[:, None] * (K // 2) + rk[None, :] // 2, mask=w_ok, other=0).to(tl.int32)
        code = (byte >> ((rk[None, :] % 2) * 4)) & 0xF                       # element 2j low nibble, 2j+1 high
        e = tl.load(e_ptr + rn[:, None] * (K // 32) + rk[None, :] // 32, mask=w_ok, other=0).to(tl.int32)
        # 2^(e - 127) built from its float32 bits: exponent field e; e = 0 is the subnormal 2^-127 = bit 22
        scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
        w = tl.load(lut_ptr + code) * scale
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def mxfp4_matmul(x, blocks, scales):
    """x [M, K] float32, blocks uint8 [N, K/32, 16] (interleaved), scales uint8 E8M0 [N, K/32] -> y [M, N]."""
    check_inputs(x, blocks, scales)
    k = x.shape[1]
    n = blocks.shape[0]
    if tuple(blocks.shape) != (n, k // 32, 16) or tuple(scales.shape) != (n, k // 32) or k % 32:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not fit K={k}")
    return launch_matmul(mxfp4_matmul_kernel, x, n, (blocks.contiguous(), scales.contiguous(), e2m1_table(x.device)))


@triton.jit
def nvfp4_matmul_kernel(x_ptr, p_ptr, s_ptr, t_ptr, lut_ptr, y_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.load(t_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(p_ptr + rn[:, None] * (K // 2) + rk[None, :] // 2, mask=w_ok, other=0).to(tl.int32)
        code = (byte >> ((rk[None, :] % 2) * 4)) & 0xF
        s = tl.load(s_ptr + rn[:, None] * (K // 16) + rk[None, :] // 16, mask=w_ok, other=0.0).to(tl.float32)
        w = tl.load(lut_ptr + code) * (s * t)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def nvfp4_matmul(x, packed, block_scale, tensor_scale):
    """x [M, K] float32, packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], tensor_scale f32 -> y [M, N]."""
    check_inputs(x, packed, block_scale)
    k = x.shape[1]
    n = packed.shape[0]
    if tuple(packed.shape) != (n, k // 2) or tuple(block_scale.shape) != (n, k // 16) or k % 16:
        raise ValueError(f"NVFP4 packed {tuple(packed.shape)} / block_scale {tuple(block_scale.shape)} "
                         f"do not fit K={k}")
    t = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device).reshape(1)
    return launch_matmul(nvfp4_matmul_kernel, x, n,
                         (packed.contiguous(), block_scale.contiguous(), t, e2m1_table(x.device)))


# ----------------------------------------------------------------------------------------------------------------
# EntQuant (engine/formats/entropy.py): the per-channel-scaled FP8 / Int8 matmul that reads a decoded block, and
# the NF4 baseline.
#   EntQuant matmul  W[n, k] = code[n, k] * 2^s[n]  (code E4M3 or int8; the scale is applied after the dot)
#   NF4   W[n, k] = NF4[q[n, k]] * absmax[n, k // G]  (two codes per byte, element 2j in the low nibble)


@triton.jit
def entquant_matmul_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc * scale[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N))


def entquant_matmul(x, codes, scale, fmt="float8"):
    """x [M, K] float32, codes uint8 [N, K] (E4M3 or int8 bytes), scale float32 [N] (= 2^log_scale) -> y [M, N]."""
    check_inputs(x, codes, scale)
    k = x.shape[1]
    n = codes.shape[0]
    if codes.shape != (n, k) or scale.shape != (n,) or fmt not in ("float8", "int8"):
        raise ValueError(f"codes must be [N, {k}] with scale [N] and fmt float8 / int8, got {tuple(codes.shape)}, "
                         f"{tuple(scale.shape)}, {fmt!r}")
    q = codes.contiguous().view(torch.float8_e4m3fn if fmt == "float8" else torch.int8)
    return launch_matmul(entquant_matmul_kernel, x, n, (q, scale.float().contiguous()))


@triton.jit
def nf4_matmul_kernel(x_ptr, p_ptr, a_ptr, t_ptr, y_ptr, M, N, K, p_cols, groups, group_size,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        byte = tl.load(p_ptr + rn[:, None] * p_cols + rk[None, :] // 2, mask=w_ok, other=0).to(tl.int32)
        q = (byte >> ((rk[None, :] % 2) * 4)) & 15
        a = tl.load(a_ptr + rn[:, None] * groups + rk[None, :] // group_size, mask=w_ok, other=0.0)
        w = tl.load(t_ptr + q, mask=w_ok, other=0.0) * a
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def nf4_matmul(x, packed, absmax, table, group_size=64):
    """x [M, K] float32, packed uint8 [N, ceil(K / 2)], absmax float32 [N, groups], table float32 [16] -> y [M, N]."""
    check_inputs(x, packed, absmax, table)
    k = x.shape[1]
    n = packed.shape[0]
    if packed.shape[1] != -(-k // 2) or absmax.shape != (n, -(-k // group_size)) or table.numel() != 16:
        raise ValueError(f"NF4 shapes do not fit K={k}: packed {tuple(packed.shape)}, absmax {tuple(absmax.shape)}")
    return launch_matmul(nf4_matmul_kernel, x, n,
                         (packed.contiguous(), absmax.float().contiguous(), table.float().contiguous()),
                         (packed.shape[1], absmax.shape[1], group_size))


# ----------------------------------------------------------------------------------------------------------------
# Trellis codes (QTIP / EXL3 style, engine.formats.trellis): W_rot[n, k] = scale[tile] * code(s_t), where the
# state s_t is the L-bit field at bit KBITS*(T-1-t) of its tile's stream (uint8, little-endian, read circularly),
# t = (n % TH) * TW + k % TW. The activations arrive already rotated (x R^T), so no Hadamard happens here.


@triton.jit
def trellis_matmul_kernel(x_ptr, c_ptr, s_ptr, y_ptr, M, N, K, tile_cols, nbytes, mean, inv_std,
                          L: tl.constexpr, KBITS: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
                          CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_ok = (rn[:, None] < N) & (rk[None, :] < K)
        tile = (rn[:, None] // TH) * tile_cols + rk[None, :] // TW
        t = (rn[:, None] % TH) * TW + rk[None, :] % TW
        o = KBITS * (TH * TW - 1 - t)                         # bit offset of this weight's state
        word = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.uint32)
        for j in tl.static_range(4):                          # the 4 bytes holding the L-bit field (L <= 24)
            byte = tl.load(c_ptr + tile * nbytes + (o // 8 + j) % nbytes, mask=w_ok, other=0)
            word = word | (byte.to(tl.uint32) << (8 * j))
        state = (word >> (o % 8).to(tl.uint32)) & ((1 << L) - 1)
        if CODE == 0:                                         # 1MAD: multiply-add mod 2^32, sum of the 4 bytes
            h = state * 34038481 + 76625530
            total = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255)
            raw = (total.to(tl.int32) - 510).to(tl.float32) / 147.800537109375
        else:                                                 # 3INST: two float16 halves with a fixed exponent
            h = (state * 89226354 + 64248484) & 0x8FFF8FFF
            h = h ^ 0x3B603B60
            hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            raw = hi + lo
        s = tl.load(s_ptr + tile, mask=w_ok, other=0.0)
        w = ((raw - mean) * inv_std) * s
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def trellis_matmul(x, codes, scales, L, K, tile, mean, inv_std, code=0):
    """x [M, in] float32 (already rotated), codes uint8 [out / th, in / tw, nbytes], scales float32 [out / th,
    in / tw] -> y [M, out]. mean / inv_std normalize the raw code (engine.formats.trellis.code_stats); code 0 = 1MAD,
    1 = 3INST."""
    check_inputs(x, codes, scales)
    th, tw = tile
    if codes.dim() != 3 or codes.dtype != torch.uint8 or tuple(scales.shape) != tuple(codes.shape[:2]):
        raise ValueError(f"codes must be uint8 [R, C, bytes] with scales [R, C], got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    if x.shape[1] != codes.shape[1] * tw or not 1 <= K < L <= 24 or code not in (0, 1):
        raise ValueError(f"x {tuple(x.shape)} / L={L}, K={K}, code={code} do not fit codes {tuple(codes.shape)}")
    return launch_matmul(trellis_matmul_kernel, x, codes.shape[0] * th,
                         (codes.contiguous(), scales.float().contiguous()),
                         (codes.shape[1], codes.shape[2], mean, inv_std), L=L, KBITS=K, TH=th, TW=tw, CODE=code)
