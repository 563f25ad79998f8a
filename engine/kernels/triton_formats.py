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
# HyperQuant lattice codes (engine.formats.lattice): Rice sub-streams -> lattice points, inverse strip fused.
# A decoder lane per sub-stream: it seeks to the sub-stream's start bit and decodes its symbols in one pass. A program
# decodes STREAMS sub-streams side by side as a vector (lane i: sub-stream program * STREAMS + i, with its own bit
# position; lanes past the last sub-stream are masked), all lanes stepping through their symbols in lockstep.
# Why STREAMS: a sub-stream's symbols must be read one after the other (a codeword's start is known only once the one
# before it is decoded), so the kernel is 512 steps long whatever the layer. Compiled, a lane is a GPU thread and
# STREAMS = 32 (one warp per program) spreads the sub-streams over the SMs. Under the interpreter every tl op of
# every program costs ~0.1 ms of Python whatever its width, so the launcher runs ONE program for all sub-streams
# (STREAMS = next power of two of their count): 512 vector steps instead of 512 per sub-stream (384 sub-streams in a
# 768 x 256 layer). For the same reason a step is kept to few ops, and its numbers are tensors made once (below).
# A codeword is read through a 32-bit window, bits pos .. pos+31 MSB first, cut from one 64-bit load: the launcher
# lays the payload out as windows[i] = bytes 4i .. 4i+7 (like rice_decode's win40). The unary run is the window's
# count of leading zeros, taken from the float32 exponent of its top 24 bits (a valid codeword has its '1' among the
# first 16). Symbol orders per vector: E8 [comb, s0..s6], D4 [c0, c1, c2, t], A2 [n_x, t_y], Z [n]; the vector's
# position r is a compile-time constant (static inner loop), and the dropped coordinate is rebuilt at the vector's
# last symbol. Output: float32 code * axis * scale[row]; end_ptr gets each lane's final bit position (-1: a start
# below 0 or an invalid codeword), which the launcher checks against where each sub-stream must end.

_LATTICE_KINDS = {"Z": (0, 1), "A2": (1, 2), "D4": (2, 4), "E8": (3, 8)}


@triton.jit
def lattice_decode_kernel(windows_ptr, nwords, offsets_ptr, ks_ptr, count, n_streams, vectors, scale_ptr, row_len,
                          axis0, out_ptr, end_ptr, KIND: tl.constexpr, N: tl.constexpr, S: tl.constexpr,
                          ESCAPE: tl.constexpr, STREAMS: tl.constexpr):
    sid = tl.program_id(0) * STREAMS + tl.arange(0, STREAMS)        # this program's sub-streams, one per lane
    live = sid < n_streams
    pos = tl.load(offsets_ptr + sid, mask=live, other=0).to(tl.int64)
    kb = tl.load(ks_ptr + sid, mask=live, other=0).to(tl.int64)
    k0, k1 = kb & 7, (kb >> 3) & 7
    mask0, mask1, shift0, shift1, len0, len1 = (1 << k0) - 1, (1 << k1) - 1, 31 - k0, 31 - k1, k0 + 1, k1 + 1
    worst = tl.where(live & (pos < 0), ESCAPE + 1, 0).to(tl.int64)    # largest unary run seen (> ESCAPE: invalid)
    pos = tl.maximum(pos, 0)                                          # a corrupt negative start reads from 0
    # The loop's numbers as [STREAMS] tensors, made once (cN is N): under the interpreter an op with a Python number
    # first broadcasts it into a fresh array, which about doubles the op's cost; compiled, they are plain constants.
    zero = tl.zeros((STREAMS,), dtype=tl.int64)
    c1, c2, c5, c8, c23, c31, c32 = zero + 1, zero + 2, zero + 5, zero + 8, zero + 23, zero + 31, zero + 32
    c150, low16, low32, last_word = zero + 150, zero + 0xFFFF, zero + 0xFFFFFFFF, zero + nwords
    escape, cap = zero + ESCAPE, zero + ESCAPE + 1
    stream_base = sid.to(tl.int64) * S                    # each lane's first element
    for vec in range(vectors):                            # S // N, fewer when the whole tensor is shorter
        base = stream_base + vec * N                      # this vector's first element
        act = live & (base < count)                       # vectors never straddle the end
        out_vec = out_ptr + base
        row_scale = tl.load(scale_ptr + base // row_len, mask=act, other=0.0)
        parity = tl.zeros((STREAMS,), dtype=tl.int64)
        start = pos          # a lane past its last vector decodes junk in this one: stores masked, q ignored, and
                             # pos goes back here afterwards
        for r in tl.static_range(N):
            if (KIND == 1 and r == 1) or (KIND == 2 and r == 3):        # the second Rice parameter's symbols
                k, k_mask, k_shift, k_len = k1, mask1, shift1, len1
            else:
                k, k_mask, k_shift, k_len = k0, mask0, shift0, len0
            # One Rice codeword per lane at bit pos: one load of the 64-bit window of 32-bit word pos // 32 (the
            # index is clamped and the windows end in zeros, so a corrupt stream never reads outside them).
            win = tl.load(windows_ptr + tl.minimum(pos >> c5, last_word))
            w = (win >> (c32 - (pos & c31))) & low32      # bits pos .. pos+31, MSB first
            q = c150 - ((w >> c8).to(tl.float32).to(tl.int32, bitcast=True) >> c23)  # 150 - (127 + top one's index)
            q = tl.minimum(q, cap)                        # = leading zeros of w, capped: shifts stay in range
            esc = q >= escape                             # escape: m is the 16 raw bits after the '1'
            m = tl.where(esc, w & low16, (q << k) | ((w >> (k_shift - q)) & k_mask))
            pos += tl.where(esc, c32, q + k_len)
            vec_worst = q if r == 0 else tl.maximum(vec_worst, q)   # static_range unrolls: r == 0 defines it
            if KIND == 3:                                 # E8int: [comb, s0..s6]
                if r == 0:
                    coset = m & c1
                    half = (m >> c2) ^ -((m >> c1) & c1)
                else:
                    v = (m >> c1) ^ -(m & c1)             # zig-zag back to signed
                    parity += v
                    tl.store(out_vec + (r - 1), (c2 * v + coset).to(tl.float32) * row_scale, mask=act)
                    if r == N - 1:
                        last = c2 * (c2 * half + (parity & c1)) + coset
                        tl.store(out_vec + r, last.to(tl.float32) * row_scale, mask=act)
            else:
                v = (m >> c1) ^ -(m & c1)
                if KIND == 2:                             # D4: [c0, c1, c2, t]
                    if r == 3:
                        v = c2 * v + (parity & c1)
                    else:
                        parity += v
                    tl.store(out_vec + r, v.to(tl.float32) * row_scale, mask=act)
                elif KIND == 1:                           # A2: [n_x, t_y] -> (n_y * axis0, n_x)
                    if r == 0:
                        parity = v
                        tl.store(out_vec + 1, v.to(tl.float32) * row_scale, mask=act)
                    else:
                        tl.store(out_vec, (c2 * v + (parity & c1)).to(tl.float32) * axis0 * row_scale, mask=act)
                else:
                    tl.store(out_vec, v.to(tl.float32) * row_scale, mask=act)
        worst = tl.maximum(worst, tl.where(act, vec_worst, 0))
        pos = tl.where(act, pos, start)
    tl.store(end_ptr + sid, tl.where(worst > ESCAPE, -1, pos), mask=live)


def lattice_decode(payload, offsets, ks, count, ends, lattice, scales, row_len, axis0=1.0, substream=512,
                   escape=15):
    """Rice sub-streams -> float32 [count]: element e = lattice code * axis * scales[e // row_len].

    payload uint8 [bytes], offsets int32 [streams] (start bits), ks uint8 [streams], ends int64 [streams] (where
    each sub-stream must end), scales float32 [count // row_len]. Raises ValueError if a sub-stream does not
    decode to exactly its end (a corrupt stream)."""
    check_inputs(payload[:, None], offsets, ks, scales)
    if lattice not in _LATTICE_KINDS:
        raise ValueError(f"lattice must be one of {sorted(_LATTICE_KINDS)}, got {lattice!r}")
    kind, n = _LATTICE_KINDS[lattice]
    streams = offsets.numel()
    if streams != -(-count // substream) or ks.numel() != streams or count % row_len or row_len % n or substream % n:
        raise ValueError(f"{streams} sub-streams / {ks.numel()} ks do not fit {count} symbols of rows {row_len}")
    # 64-bit windows: windows[i] = bytes 4i .. 4i+7, MSB first (what rice_decode's win40 is for every byte), so a
    # lane gets any 32 bits starting in word i with one load; zero bytes pad the end.
    nwords = -(-payload.numel() // 4)
    padded = payload.new_zeros(4 * (nwords + 2), dtype=torch.uint8)
    padded[:payload.numel()] = payload
    b = padded.view(-1, 4).long()
    words = (b[:, 0] << 24) | (b[:, 1] << 16) | (b[:, 2] << 8) | b[:, 3]
    windows = (words[:-1] << 32) | words[1:]                                  # [nwords + 1] int64
    out = torch.zeros(count, device=payload.device, dtype=torch.float32)
    found = torch.empty(streams, device=payload.device, dtype=torch.int64)
    # Interpreter: one program for all sub-streams (up to 4096 lanes); compiled: one warp's worth per program.
    per_program = min(4096, triton.next_power_of_2(streams)) if INTERPRETED else 32
    lattice_decode_kernel[(triton.cdiv(streams, per_program),)](
        windows, nwords, offsets.contiguous(), ks.contiguous(), count, streams, min(substream, count) // n,
        scales.float().contiguous(), row_len, float(axis0), out, found, KIND=kind, N=n, S=substream, ESCAPE=escape,
        STREAMS=per_program)
    wrong = found != ends.to(found.device)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        raise ValueError(f"sub-stream {i} does not decode to its boundary (ends at {int(found[i])}, expected "
                         f"{int(ends[i])}): stream is corrupt")
    return out


# ----------------------------------------------------------------------------------------------------------------
# EntQuant (engine/formats/entropy.py): rANS decoding of a block's E4M3 bytes, the per-channel-scaled FP8 / Int8
# matmul that reads them, and the NF4 baseline.
#   rANS  per lane: slot = x mod 2^P, s = sym[slot], x = f[slot] * (x >> P) + bias[slot]; if x < 2^16 it takes
#         the next 16-bit word of its sub-stream, x = (x << 16) | word. Symbol i belongs to lane i mod K at step
#         i // K; the W lanes of one sub-stream find their word positions by a prefix sum over who reads.
#   EntQuant matmul  W[n, k] = code[n, k] * 2^s[n]  (code E4M3 or int8; the scale is applied after the dot)
#   NF4   W[n, k] = NF4[q[n, k]] * absmax[n, k // G]  (two codes per byte, element 2j in the low nibble)


# rANS decoder: a program decodes SUBS sub-streams side by side as one [SUBS, W] tensor of lanes (row: sub-stream
# program * SUBS + r; rows past the last sub-stream are masked), every lane doing one step of the loop per symbol.
# Why SUBS: a lane's symbols must be decoded one after the other (each state comes from the one before it), so the
# kernel is n / K steps long (3072 for a block) whatever the block. Compiled, SUBS = 1: one sub-stream of W = 32
# lanes (a warp) per program, the sub-streams spread over the SMs. Under the interpreter every tl op costs ~0.1 ms of
# Python whatever its width, so the launcher runs ONE program for all sub-streams (SUBS = next power of two of their
# count): 3072 vector steps instead of 3072 per sub-stream. For the same reason a step is kept to few ops: its
# numbers are [SUBS, W] tensors made once (an op with a Python number first broadcasts it into a fresh array), and
# the prefix sum and row sum call tl.associative_scan / tl.reduce with the sum combine directly (tl.cumsum and
# tl.sum are @jit functions, whose every call re-patches triton.language under the interpreter: ~3x an op).
# The n // K full steps mask nothing but the rows past the last sub-stream's stores; a last, partial step (when K
# does not divide n) runs the same loop body once with lanes >= n mod K masked: they store nothing, read nothing and
# keep their state. Measured on 2 cores, one block (786,432 symbols, K = 256): 6.2 s; 16.3 s with per-step masks,
# Python-number operands and tl.cumsum / tl.sum.
# A lane's next word: last[s] (the last word sub-stream s has read) + its rank among the lanes of s reading now (a
# prefix sum along W), clamped into the word array (a corrupt stream reads junk, never outside). final_ptr / read_ptr
# get each lane's last state and each sub-stream's end of reading (last + 1), which the launcher checks.


@triton.jit
def rans_decode_kernel(states_ptr, starts_ptr, words_ptr, sym_ptr, freq_ptr, bias_ptr, out_ptr, final_ptr,
                       read_ptr, n, n_streams, n_words, PROB_BITS: tl.constexpr, SUBS: tl.constexpr,
                       W: tl.constexpr):
    sub = tl.program_id(0) * SUBS + tl.arange(0, SUBS)                     # this program's sub-streams
    live_sub = sub < n_streams
    lane = sub[:, None] * W + tl.arange(0, W)[None, :]                      # global lane ids [SUBS, W]
    live = live_sub[:, None] & (lane >= 0)                                  # [SUBS, W]: lanes of real sub-streams
    lanes = n_streams * W
    full = n // lanes                                                       # steps in which every lane decodes
    rest = n - full * lanes                                                 # lanes taking part in a last step
    x = tl.load(states_ptr + lane, mask=live, other=65536).to(tl.int64)
    # The loop's numbers as [SUBS, W] tensors, made once; compiled, they are plain constants.
    zero = tl.full((SUBS, W), 0, tl.int64)
    last = tl.load(starts_ptr + sub, mask=live_sub, other=0)[:, None] - 1 + zero
    slot_mask, shift, low, c16 = zero + ((1 << PROB_BITS) - 1), zero + PROB_BITS, zero + 65536, zero + 16
    word_cap, stride = zero + (n_words - 1), zero + lanes
    syms, freqs, biases, words = sym_ptr + zero, freq_ptr + zero, bias_ptr + zero, words_ptr + zero
    outs = out_ptr + lane                                                   # where each lane's next symbol goes
    for phase in tl.static_range(2):                    # 0: the full steps; 1: the partial last step, if any
        if phase == 0:
            count, act = full, live
        else:
            count, act = tl.minimum(rest, 1), live & (lane < rest)
        for t in range(count):
            slot = x & slot_mask
            tl.store(outs, tl.load(syms + slot), mask=act)
            y = tl.load(freqs + slot) * (x >> shift) + tl.load(biases + slot)
            need = y < low                                                  # lanes that take a word now
            if phase == 1:
                need = need & act
                y = tl.where(act, y, x)                                     # lanes past n keep their state
            reads = need.to(tl.int64)
            rank = tl.associative_scan(reads, 1, tl.standard._sum_combine)  # prefix sum along W: 1, 2, .. readers
            word = tl.load(words + tl.minimum(last + rank, word_cap), mask=need)
            x = tl.where(need, (y << c16) | word, y)
            last += tl.reduce(reads, 1, tl.standard._sum_combine, keep_dims=True)
            outs += stride
    tl.store(final_ptr + lane, x, mask=live)
    tl.store(read_ptr + sub, tl.max(last, axis=1) + 1, mask=live_sub)


def rans_decode(states, starts, words, slot_sym, slot_freq, slot_bias, out, prob_bits):
    """Decode one rANS stream into out (uint8 [n]). states int64 [S, W] (the encoder's final states), starts int64
    [S + 1] (word offsets of the sub-streams), words int64 [total], slot tables [2^prob_bits] (symbol uint8,
    frequency and slot - cumulative int64), all on out's device. Raises ValueError if any lane does not end at the
    start state 2^16 having read its sub-stream exactly to its end (a corrupted stream)."""
    check_inputs(states, starts, words, slot_sym, slot_freq, slot_bias, out)
    n_streams, w = states.shape
    n = out.numel()
    if starts.numel() != n_streams + 1 or w & (w - 1) or slot_sym.numel() != 1 << prob_bits:
        raise ValueError(f"inconsistent rANS tables: states {tuple(states.shape)}, starts {starts.numel()}, "
                         f"slot table {slot_sym.numel()} for prob_bits {prob_bits}")
    subs = triton.next_power_of_2(n_streams) if INTERPRETED else 1   # interpreter: one wide program is fastest
    final = torch.empty_like(states)
    read = torch.empty(n_streams, dtype=torch.int64, device=out.device)
    words = words if words.numel() else torch.zeros(1, dtype=torch.int64, device=out.device)
    rans_decode_kernel[(triton.cdiv(n_streams, subs),)](
        states.contiguous(), starts.contiguous(), words.contiguous(), slot_sym.contiguous(), slot_freq.contiguous(),
        slot_bias.contiguous(), out, final, read, n, n_streams, words.numel(), PROB_BITS=prob_bits, SUBS=subs, W=w)
    if bool((final != 65536).any()) or bool((read != starts[1:]).any()):
        raise ValueError("rANS stream corrupted: final states or read positions do not match")
    return out


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
