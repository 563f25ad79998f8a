"""Chapter 39's GPTQ listings, typed as a reader would (`pytest tests/test_ch39_gptq.py --yours tests/book/gptq.py`),
with chapter 20's find_params written out as a reader would (the engine's is engine.formats.numerics.affine's)."""
import torch


def find_params(x, bits=4):
    """x [rows, n] -> (scale, zero) [rows]: an asymmetric grid of 2^bits levels over each row's [min, max] (with 0)."""
    lo, hi = x.min(1).values.clamp(max=0), x.max(1).values.clamp(min=0)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8)
    return scale, (-lo / scale).round()


@torch.no_grad()
def gptq_quantize(weight, hessian, bits=4, group_size=128, act_order=False, damp=0.01, block=128):
    W = weight.float().clone()
    H = hessian.float().clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0                     # inputs that are never active: their weights don't matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(cols)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros_like(W)
    groups = -(-cols // group_size)
    scales, zeros = torch.zeros(W.shape[0], groups), torch.zeros(W.shape[0], groups)
    top = 2 ** bits - 1
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, Err = W[:, i1:i2].clone(), torch.zeros(W.shape[0], i2 - i1)
        H1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:              # a new group: its range from the CURRENT (corrected) weights
                g = col // group_size
                ahead = torch.cat((W1[:, i:], W[:, i2:]), 1)[:, :group_size]
                scales[:, g], zeros[:, g] = find_params(ahead, bits)
            g = col // group_size
            q = (W1[:, i] / scales[:, g] + zeros[:, g]).round().clamp(0, top)
            codes[:, col] = q
            error = (W1[:, i] - scales[:, g] * (q - zeros[:, g])) / H1[i, i]
            W1[:, i:] -= error[:, None] * H1[i, i:][None, :]           # correct the rest of the block
            Err[:, i] = error
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]                             # and everything after it
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(cols) // group_size)[inverse]                 # group of each ORIGINAL column
    return codes[:, inverse].to(torch.uint8), scales, zeros, g_idx.to(torch.int32)


def pack_gptq(codes, scales, zeros, g_idx):
    """Our [out, in] codes -> the checkpoint tensors (4-bit)."""
    q = codes.T.to(torch.int64)                                   # [in, out]
    qweight = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for j in range(8):
        qweight |= q[j::8] << (4 * j)
    z = (zeros.T.to(torch.int64) - 1) & 0xF                       # [groups, out], stored minus 1
    qzeros = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scales.T.to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def as_int32(t):
    """32 packed bits held in an int64 -> int32 with the same bits (two's complement)."""
    return ((t + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def unpack_gptq(qweight, qzeros, scales, g_idx):
    """Checkpoint tensors -> (codes [out, in], scales [out, groups], zeros [out, groups], g_idx)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF                  # [in/8, 8, out]
    codes = q.reshape(-1, qweight.shape[1]).T                                # [out, in]
    z = (qzeros[:, :, None] >> shifts[None, None, :]) & 0xF                  # [groups, out/8, 8]
    zeros = (z.reshape(qzeros.shape[0], -1) + 1).T.float()                   # stored minus 1
    return codes.to(torch.uint8), scales.T.float(), zeros, g_idx
