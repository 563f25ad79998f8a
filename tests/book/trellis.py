"""Chapter 39's trellis listings, typed as a reader would (`pytest tests/test_ch39_trellis.py --yours
tests/book/trellis.py`)."""
import math

import torch


def code_1mad(states):
    x = (states.to(torch.int64) * 34038481 + 76625530) % (2 ** 32)
    total = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return (total.double() - 510.0) / 147.8


def codebook(L):
    values = code_1mad(torch.arange(2 ** L))
    return ((values - values.mean()) / values.std()).float()            # exactly zero mean, unit variance


@torch.no_grad()
def viterbi_encode(x, L=8, K=2):
    table = codebook(L)
    states = torch.arange(2 ** L)
    T = x.shape[0]
    cost = (x[0] - table) ** 2                                          # any start state
    back = torch.zeros((T, 2 ** L), dtype=torch.long)
    preds = (states >> K)[:, None] + (torch.arange(2 ** K) << (L - K))[None, :]       # [S, 2^K]
    for t in range(1, T):
        options = cost[preds]                                           # [S, 2^K]
        best, which = options.min(-1)
        back[t] = preds[states, which]
        cost = best + (x[t] - table) ** 2
    path = torch.zeros(T, dtype=torch.long)
    path[-1] = cost.argmin()
    for t in range(T - 1, 0, -1):
        path[t - 1] = back[t, path[t]]
    symbols = path[1:] & (2 ** K - 1)                                   # the K new bits of each step
    return int(path[0]), symbols, table[path]


def random_hadamard(n, seed=0):
    if n & (n - 1):
        raise ValueError("n must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.where(torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    return h * signs[None, :] / math.sqrt(n)


@torch.no_grad()
def quantize_trellis(weight, L=8, K=2, group=256, seed=0):
    rows, cols = weight.shape
    rotation = random_hadamard(group, seed)
    x = weight.float().reshape(rows, -1, group) @ rotation.T            # incoherence processing
    scale = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    out = torch.empty_like(x)
    for r in range(rows):
        for g in range(x.shape[1]):
            _, _, recon = viterbi_encode(x[r, g] / scale[r, g], L, K)
            out[r, g] = recon * scale[r, g]
    bits = (L + K * (group - 1) + 16) / group                            # start state, symbols, an f16 scale
    return (out @ rotation).reshape(rows, cols), bits
