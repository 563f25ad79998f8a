"""The book's dequantize-and-matmul kernels: one tile loop, and per format the function that decodes a weight tile.

Every format computes y = x @ W^T while decoding W from its stored form inside the kernel, so the dense weight never
exists in memory. The loop is the same for all of them (`dequant_matmul_kernel`): a program owns a BLOCK_M x BLOCK_N
tile of y and walks along K, loading an x tile and asking the format's decode function for the matching
[BLOCK_N, BLOCK_K] tile of W. A format is therefore one small @triton.jit function,

    decode(weight, CONSTS, n [BLOCK_N, 1], k [1, BLOCK_K], ok [BLOCK_N, BLOCK_K]) -> W[n, k] float32 (0 if not ok),

where `weight` is the tuple of the format's pointers and run-time sizes, CONSTS the tuple of its compile-time
constants (bits, group size, hash constants: a constexpr, so the compiler folds them), and its launcher checks
shapes and builds both. The formats pass their constants in (the E2M1 and NF4 value
tables, the trellis hash): a kernel knows no format's numbers.

On a machine without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
engine/kernels/__init__.py before triton is imported): the same kernel source, executed with NumPy on the CPU. That
is slow but exact, which is what the tests need. The lossless stream decoders (rANS, Rice) are in stream_decoders.py.

Interpreter trap (checked): converting f32 -> fp8 inside a kernel is wrong under the interpreter (no saturation,
ties away from zero, subnormals flushed). Kernels here only ever widen fp8 to f32, which is exact.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import INTERPRETED, check_device


class Launch(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "ieee"          # tl.dot's input precision


def launch_settings(m):
    """Tile sizes and launch settings for an x of m rows, fixed per batch-size regime (no autotuning at import).

    Interpreter: every program and every tl op costs Python overhead whatever its width, so the biggest tiles are the
    fastest (num_warps / num_stages mean nothing there).
    Compiled (NVIDIA; sized for the 132 SMs of an H100 / H200, checked to compile for sm_90 without register spills):
      m == 1     a GEMV, bound by reading the weights once. BLOCK_M = 1 takes the kernel's tl.sum branch: one FMA per
                 weight, where tl.dot (>= 16 rows) would spend 16 on 15 rows of padding. A narrow BLOCK_N = 16 makes
                 N / 16 programs (256 at N = 4096, two per SM) so that every SM streams weights, and a wide
                 BLOCK_K = 256 over 8 warps keeps many loads in flight per program.
      m <= 16    small batches (decoding a few sequences) are still memory-bound: tl.dot's minimum of 16 rows, and
                 BLOCK_N = 32 for N / 32 programs (128 at N = 4096). Two stages pipeline the next tile's loads;
                 BLOCK_K = 64 because every loaded [BLOCK_N, BLOCK_K] operand (codes, scales) is staged in shared
                 memory per stage, and 128 spills registers for the FP4 and NF4 decoders.
      m > 16     batches like 256 reuse each decoded weight m times and become compute-bound: square 64 x 64 tiles
                 on the tensor cores, three stages. x arrives in float32, and "tf32x3" (each operand split into two TF32
                 parts, three TF32 products) stays within ~2^-21 of float32 products, where plain TF32 rounds both
                 operands to 10 mantissa bits (2^-11).
    """
    if INTERPRETED:
        return Launch(min(1024, max(16, triton.next_power_of_2(m))), 256, 128)
    if m == 1:
        return Launch(1, 16, 256, num_warps=8, num_stages=2)
    if m <= 16:
        return Launch(16, 32, 64, num_warps=4, num_stages=2, precision="tf32x3")
    return Launch(64, 64, 32, num_warps=4, num_stages=3, precision="tf32x3")


@triton.jit
def dequant_matmul_kernel(x_ptr, y_ptr, M, N, K, weight, out_scale_ptr, DECODE: tl.constexpr, CONSTS: tl.constexpr,
                          PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """y [M, N] = (x [M, K] @ W^T) * out_scale [N] (when given: a per-output factor that commutes with the sum, so it
    is applied once per output instead of once per weight), W's tiles from DECODE(weight, CONSTS, n, k, ok)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0).to(tl.float32)
        w = DECODE(weight, CONSTS, rn[:, None], rk[None, :], (rn[:, None] < N) & (rk[None, :] < K))
        if BLOCK_M == 1:                                      # GEMV: [1, BLOCK_K] * [BLOCK_N, BLOCK_K], summed on k
            acc += tl.sum(x * w, axis=1)[None, :]
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if out_scale_ptr is not None:
        acc = acc * tl.load(out_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def launch_matmul(decode, x, n, weight, consts=(), out_scale=None):
    """y [M, n] float32 = x [M, K] @ W^T (* out_scale [n]), W [n, K] decoded tile by tile by `decode` from the
    tuples `weight` (run time) and `consts` (compile time), over a grid of output tiles."""
    m, k = x.shape
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    s = launch_settings(m)
    grid = (triton.cdiv(m, s.block_m), triton.cdiv(n, s.block_n))
    dequant_matmul_kernel[grid](x.float().contiguous(), y, m, n, k, weight, out_scale, DECODE=decode,
                                CONSTS=tuple(consts), PRECISION=s.precision, BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                                BLOCK_K=s.block_k, num_warps=s.num_warps, num_stages=s.num_stages)
    return y


_device_tables = {}


def device_table(table, device):
    """A format's small value table (float32 [16]) on `device`, copied there once: a host-to-device copy in every
    call would cost more than a batch-1 matmul. Keyed by the table's bytes, so a different table is never mixed up."""
    table = table.detach().float().reshape(-1)
    if table.device == torch.device(device):
        return table.contiguous()
    key = (str(device), table.cpu().numpy().tobytes())
    if key not in _device_tables:
        _device_tables[key] = table.to(device).contiguous()
    return _device_tables[key]


def _check_table(table, what):
    if table.numel() != 16:
        raise ValueError(f"{what} value table must have 16 entries, got {table.numel()}")


def _check_group(group_size):
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


# ----------------------------------------------------------------------------------------------------------------
# Affine integer codes (RTN, GPTQ, AWQ): W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]
# q is packed along k, 8 // BITS codes per byte, low bits first (affine.pack_bits). G and BITS are
# compile-time constants: an integer division by a run-time value costs a GPU some twenty instructions per weight.


@triton.jit
def affine_tile(weight, CONSTS, n, k, ok):
    q_ptr, s_ptr, o_ptr, q_cols, groups = weight
    GROUP: tl.constexpr = CONSTS[0]
    BITS: tl.constexpr = CONSTS[1]
    per_byte: tl.constexpr = 8 // BITS
    byte = tl.load(q_ptr + n * q_cols + k // per_byte, mask=ok, other=0).to(tl.int32)
    q = (byte >> ((k % per_byte) * BITS)) & ((1 << BITS) - 1)
    g = n * groups + k // GROUP
    return q.to(tl.float32) * tl.load(s_ptr + g, mask=ok, other=0.0) + tl.load(o_ptr + g, mask=ok, other=0.0)


def affine_matmul(x, packed, scales, offsets, group_size, bits):
    """x [M, K] float32, packed uint8 [N, ceil(K * bits / 8)], scales / offsets float32 [N, groups] -> y [M, N]."""
    check_device(x, packed, scales, offsets)
    _check_group(group_size)
    if bits not in (2, 4, 8):
        raise ValueError(f"affine kernel supports 2, 4 or 8 bits, got {bits}")
    k, n = x.shape[1], packed.shape[0]
    groups = -(-k // group_size)
    if packed.shape[1] != -(-k * bits // 8) or scales.shape != (n, groups) or offsets.shape != (n, groups):
        raise ValueError(f"affine shapes do not fit K={k}, {bits} bits, group_size={group_size}: packed "
                         f"{tuple(packed.shape)}, scales {tuple(scales.shape)}, offsets {tuple(offsets.shape)}")
    weight = (packed.contiguous(), scales.float().contiguous(), offsets.float().contiguous(), packed.shape[1], groups)
    return launch_matmul(affine_tile, x, n, weight, (group_size, bits))


# ----------------------------------------------------------------------------------------------------------------
# FP8 and FP4 (engine/formats/fp8.py, engine/formats/mx.py). Every kernel only widens low-precision codes to f32,
# which is exact (f32 -> fp8 inside a kernel is the interpreter trap above).
#   FP8 block  W[n, k] = e4m3[n, k] * s[n // B, k // B]                        (W8A16; B = 128 in checkpoints)
#   MXFP4      W[n, k] = e2m1[n, k] * 2^(e[n, k // 32] - 127)                  (E8M0 scale per 32)
#   NVFP4      W[n, k] = e2m1[n, k] * (e4m3[n, k // 16] * t)                   (E4M3 scale per 16, f32 per tensor)
# FP4 codes are two per byte, element 2j in the low nibble (the interleaved layout). A nibble is decoded by one
# gather from the format's 16-entry E2M1 table (code = sign << 3 | magnitude index).


@triton.jit
def fp8_block_tile(weight, CONSTS, n, k, ok):
    """W8A16: FP8 weight tiles are widened in registers and scaled by their block's factor."""
    w_ptr, s_ptr, K, s_cols = weight
    B: tl.constexpr = CONSTS[0]
    w = tl.load(w_ptr + n * K + k, mask=ok, other=0.0).to(tl.float32)
    return w * tl.load(s_ptr + (n // B) * s_cols + k // B, mask=ok, other=0.0)


@triton.jit
def fp8_block_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, s_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK: tl.constexpr = 128, PRECISION: tl.constexpr = "ieee"):
    """The book's W8A16 FP8 kernel, in the book's arguments: the shared tile loop with fp8_block_tile as its decoder
    (FP8 weight tiles widened in registers and scaled by their block's factor)."""
    dequant_matmul_kernel(x_ptr, y_ptr, M, N, K, (w_ptr, s_ptr, K, s_cols), None, fp8_block_tile, (BLOCK,), PRECISION,
                          BLOCK_M, BLOCK_N, BLOCK_K)


def fp8_block_matmul(x, weight, scale_inv, block_m=None, block_n=None, block_k=None, *, block=128):
    """x [M, K], weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N/block), ceil(K/block)] -> y [M, N] in x's
    dtype (accumulated in float32). block_m / block_n / block_k: the tile, the book's knobs (default: the engine's
    launch_settings for this M); block: the engine's keyword for weight blocks other than 128 x 128."""
    check_device(x, weight, scale_inv)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    if not isinstance(block, int) or block < 1 or tuple(scale_inv.shape) != (-(-n // block), -(-k // block)):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit a [{n}, {k}] weight in {block}-blocks")
    s = launch_settings(m)
    tile = [s.block_m if block_m is None else block_m, s.block_n if block_n is None else block_n,
            s.block_k if block_k is None else block_k]
    if not all(isinstance(t, int) and t >= 1 and t & (t - 1) == 0 for t in tile):
        raise ValueError(f"block_m, block_n and block_k must be powers of two, got {tile}")
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, tile[0]), triton.cdiv(n, tile[1]))
    fp8_block_kernel[grid](x.contiguous(), weight.contiguous(), scale_inv.float().contiguous(), y, m, n, k,
                           scale_inv.shape[1], BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=tile[2], BLOCK=block,
                           PRECISION=s.precision, num_warps=s.num_warps, num_stages=s.num_stages)
    return y


@triton.jit
def fp4_codes(p_ptr, n, k, ok, K):
    """The E2M1 codes of W[n, k] from bytes [N, K / 2], element 2j in the low nibble, 2j + 1 in the high one."""
    byte = tl.load(p_ptr + n * (K // 2) + k // 2, mask=ok, other=0).to(tl.int32)
    return (byte >> ((k % 2) * 4)) & 0xF


@triton.jit
def mxfp4_tile(weight, CONSTS, n, k, ok):
    b_ptr, e_ptr, lut_ptr, K = weight
    e = tl.load(e_ptr + n * (K // 32) + k // 32, mask=ok, other=0).to(tl.int32)
    # 2^(e - 127) built from its float32 bits: exponent field e; e = 0 is the subnormal 2^-127 = bit 22
    scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    return tl.load(lut_ptr + fp4_codes(b_ptr, n, k, ok, K)) * scale


def mxfp4_matmul(x, blocks, scales, table):
    """x [M, K] float32, blocks uint8 [N, K/32, 16] (interleaved), scales uint8 E8M0 [N, K/32], table: the E2M1
    value of each code float32 [16] -> y [M, N]."""
    check_device(x, blocks, scales)
    _check_table(table, "E2M1")
    k = x.shape[1]
    n = blocks.shape[0]
    if tuple(blocks.shape) != (n, k // 32, 16) or tuple(scales.shape) != (n, k // 32) or k % 32:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not fit K={k}")
    return launch_matmul(mxfp4_tile, x, n, (blocks.contiguous(), scales.contiguous(), device_table(table, x.device), k))


@triton.jit
def nvfp4_tile(weight, CONSTS, n, k, ok):
    p_ptr, s_ptr, t_ptr, lut_ptr, K = weight
    s = tl.load(s_ptr + n * (K // 16) + k // 16, mask=ok, other=0.0).to(tl.float32)
    return tl.load(lut_ptr + fp4_codes(p_ptr, n, k, ok, K)) * (s * tl.load(t_ptr))


def nvfp4_matmul(x, packed, block_scale, tensor_scale, table):
    """x [M, K] float32, packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16], tensor_scale f32, table: the
    E2M1 value of each code float32 [16] -> y [M, N]."""
    check_device(x, packed, block_scale)
    _check_table(table, "E2M1")
    k = x.shape[1]
    n = packed.shape[0]
    if tuple(packed.shape) != (n, k // 2) or tuple(block_scale.shape) != (n, k // 16) or k % 16:
        raise ValueError(f"NVFP4 packed {tuple(packed.shape)} / block_scale {tuple(block_scale.shape)} "
                         f"do not fit K={k}")
    t = torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device).reshape(1)
    return launch_matmul(nvfp4_tile, x, n, (packed.contiguous(), block_scale.contiguous(), t,
                                             device_table(table, x.device), k))


# ----------------------------------------------------------------------------------------------------------------
# EntQuant (engine/formats/entropy.py): the per-channel-scaled FP8 / Int8 matmul that reads a decoded block, and
# the NF4 baseline.
#   EntQuant matmul  W[n, k] = code[n, k] * 2^s[n]  (code E4M3 or int8; the scale is applied after the dot)
#   NF4   W[n, k] = NF4[q[n, k]] * absmax[n, k // G]  (two codes per byte, element 2j in the low nibble)


@triton.jit
def code_tile(weight, CONSTS, n, k, ok):
    q_ptr, K = weight
    return tl.load(q_ptr + n * K + k, mask=ok, other=0.0).to(tl.float32)


def entquant_matmul(x, codes, scale, fmt="float8"):
    """x [M, K] float32, codes uint8 [N, K] (E4M3 or int8 bytes), scale float32 [N] (= 2^log_scale) -> y [M, N]."""
    check_device(x, codes, scale)
    k = x.shape[1]
    n = codes.shape[0]
    if codes.shape != (n, k) or scale.shape != (n,) or fmt not in ("float8", "int8"):
        raise ValueError(f"codes must be [N, {k}] with scale [N] and fmt float8 / int8, got {tuple(codes.shape)}, "
                         f"{tuple(scale.shape)}, {fmt!r}")
    q = codes.contiguous().view(torch.float8_e4m3fn if fmt == "float8" else torch.int8)
    return launch_matmul(code_tile, x, n, (q, k), out_scale=scale.float().contiguous())


@triton.jit
def nf4_tile(weight, CONSTS, n, k, ok):
    p_ptr, a_ptr, t_ptr, p_cols, groups = weight
    GROUP: tl.constexpr = CONSTS[0]
    byte = tl.load(p_ptr + n * p_cols + k // 2, mask=ok, other=0).to(tl.int32)
    q = (byte >> ((k % 2) * 4)) & 15
    a = tl.load(a_ptr + n * groups + k // GROUP, mask=ok, other=0.0)
    return tl.load(t_ptr + q, mask=ok, other=0.0) * a


def nf4_matmul(x, packed, absmax, table, group_size=64):
    """x [M, K] float32, packed uint8 [N, ceil(K / 2)], absmax float32 [N, groups], table float32 [16] -> y [M, N]."""
    check_device(x, packed, absmax)
    _check_table(table, "NF4")
    _check_group(group_size)
    k = x.shape[1]
    n = packed.shape[0]
    if packed.shape[1] != -(-k // 2) or absmax.shape != (n, -(-k // group_size)):
        raise ValueError(f"NF4 shapes do not fit K={k}: packed {tuple(packed.shape)}, absmax {tuple(absmax.shape)}")
    weight = (packed.contiguous(), absmax.float().contiguous(), device_table(table, x.device), packed.shape[1],
              absmax.shape[1])
    return launch_matmul(nf4_tile, x, n, weight, (group_size,))


# ----------------------------------------------------------------------------------------------------------------
# Trellis codes (QTIP / EXL3 style, engine.formats.trellis): W_rot[n, k] = scale[tile] * code(s_t), where the
# state s_t is the L-bit field at bit KBITS*(T-1-t) of its tile's stream (uint8, little-endian, read circularly),
# t = (n % TH) * TW + k % TW. The activations arrive already rotated (x R^T), so no Hadamard happens here. The hash
# that turns a state into a value is the format's: its constants arrive as HASH (see trellis_matmul).


@triton.jit
def trellis_tile(weight, CONSTS, n, k, ok):
    c_ptr, s_ptr, tile_cols, mean, inv_std = weight
    L: tl.constexpr = CONSTS[0]
    KBITS: tl.constexpr = CONSTS[1]
    TH: tl.constexpr = CONSTS[2]
    TW: tl.constexpr = CONSTS[3]
    NBYTES: tl.constexpr = CONSTS[4]
    CODE: tl.constexpr = CONSTS[5]
    HASH: tl.constexpr = CONSTS[6]
    tile = (n // TH) * tile_cols + k // TW
    t = (n % TH) * TW + k % TW
    o = KBITS * (TH * TW - 1 - t)                             # bit offset of this weight's state
    word = tl.zeros(o.shape, dtype=tl.uint32)
    for j in tl.static_range(4):                              # the 4 bytes holding the L-bit field (L <= 24)
        byte = tl.load(c_ptr + tile * NBYTES + (o // 8 + j) % NBYTES, mask=ok, other=0)
        word = word | (byte.to(tl.uint32) << (8 * j))
    state = (word >> (o % 8).to(tl.uint32)) & ((1 << L) - 1)
    if CODE == "1mad":            # HASH = (a, b, centre, scale): multiply-add mod 2^32, sum of the 4 bytes
        h = state * HASH[0] + HASH[1]
        total = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255)
        raw = (total.to(tl.int32) - HASH[2]).to(tl.float32) / HASH[3]
    else:                         # "3inst", HASH = (a, b, kept bits, exponent bits): two float16 halves
        h = ((state * HASH[0] + HASH[1]) & HASH[2]) ^ HASH[3]
        hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        raw = hi + lo
    return ((raw - mean) * inv_std) * tl.load(s_ptr + tile, mask=ok, other=0.0)


def trellis_matmul(x, codes, scales, L, kbits, tile, mean, inv_std, code, hash_constants):
    """x [M, in] float32 (already rotated), codes uint8 [out / th, in / tw, nbytes], scales float32 [out / th,
    in / tw] -> y [M, out]. L: state bits, kbits: bits per weight, tile (th, tw); mean / inv_std normalize the raw
    code (engine.formats.trellis.code_stats). code "1mad": hash_constants (a, b, centre, scale), value
    (bytesum(s a + b) - centre) / scale; code "3inst": (a, b, mask, bits), value = the two float16 halves of
    ((s a + b) & mask) ^ bits, added."""
    check_device(x, codes, scales)
    th, tw = tile
    if codes.dim() != 3 or codes.dtype != torch.uint8 or tuple(scales.shape) != tuple(codes.shape[:2]):
        raise ValueError(f"codes must be uint8 [R, C, bytes] with scales [R, C], got {tuple(codes.shape)}, "
                         f"{tuple(scales.shape)}")
    if x.shape[1] != codes.shape[1] * tw or not 1 <= kbits < L <= 24 or code not in ("1mad", "3inst"):
        raise ValueError(f"x {tuple(x.shape)} / L={L}, kbits={kbits}, code={code!r} do not fit codes "
                         f"{tuple(codes.shape)}")
    if len(hash_constants) != 4:
        raise ValueError(f"hash_constants must be 4 numbers, got {hash_constants!r}")
    weight = (codes.contiguous(), scales.float().contiguous(), codes.shape[1], mean, inv_std)
    consts = (L, kbits, th, tw, codes.shape[2], code, tuple(hash_constants))
    return launch_matmul(trellis_tile, x, codes.shape[0] * th, weight, consts)
