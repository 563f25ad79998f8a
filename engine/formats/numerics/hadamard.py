"""Random Hadamard rotations ("incoherence processing"), shared by the trellis and lattice formats.

    R = H D / sqrt(n)        H: Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]), D: random signs

R is orthogonal, so a layer can keep W R^T and rotate its activations instead: y = (x R^T)(W R^T)^T = x W^T. The
rotation spreads every outlier over all n coordinates of a tile, which then look like i.i.d. Gaussian samples:
what trellis codebooks and lattice rate tables are built for (QuIP#, QTIP, HyperQuant). x H costs n log2(n) adds with
the fast Walsh-Hadamard transform (`fwht`), no stored matrix; D is stored as its seed or as one bit per input.
"""
import functools
import math

import torch


def check_power_of_two(n):
    if n < 2 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two >= 2, got {n}")


def fitting_tile(widths, largest):
    """The largest power of two <= largest that divides every width: a rotation tile that fits them all (SmolLM2's
    576 and 1536 take 64)."""
    tile = largest
    while tile > 1 and any(w % tile for w in widths):
        tile //= 2
    return tile


def fwht(x):
    """Fast Walsh-Hadamard transform over the last dim (a power of two), unnormalized, Sylvester order:
    fwht(x) = x @ H. log2(n) butterfly stages, each one tensor op."""
    n = x.shape[-1]
    check_power_of_two(n)
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), 2)
        h *= 2
    return y.reshape(x.shape)


def random_signs(n, seed):
    """n signs +-1 (float32) drawn from `seed`: the D of R = H D / sqrt(n). A copy: callers may modify it."""
    return _signs(n, seed).clone()


@functools.cache
def _signs(n, seed):
    return torch.where(torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)


def random_hadamard(n, seed=0):
    """The orthogonal n x n matrix R = H D / sqrt(n) (for reading and testing; rotate() never builds it)."""
    check_power_of_two(n)
    return fwht(torch.eye(n)) * random_signs(n, seed)[None, :] / math.sqrt(n)


@functools.cache
def _scaled_hadamard(n):
    return fwht(torch.eye(n)) / math.sqrt(n)


def rotate_by_product(x, signs, tile):
    """rotate() as a product with the tile's Hadamard matrix H / sqrt(tile) (symmetric, built once per tile): two
    ops where fwht takes a few per stage, which is what a batch of one pays at run time (engine/runtime.py); the
    same rotation up to float rounding."""
    check_power_of_two(tile)
    g = x.reshape(*x.shape[:-1], -1, tile) * signs.to(x.device, x.dtype).reshape(-1, tile)
    return (g @ _scaled_hadamard(tile).to(x.device, x.dtype)).reshape(x.shape)


def rotate(x, signs, tile):
    """x [..., in] -> x R^T per tile of `tile` inputs, R = H D / sqrt(tile). signs: [tile] (the same D for every
    tile) or [in] (one D per tile)."""
    check_power_of_two(tile)
    if x.shape[-1] % tile:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the rotation tile {tile}")
    g = x.reshape(*x.shape[:-1], -1, tile) * signs.to(x.device, x.dtype).reshape(-1, tile)
    return (fwht(g) / math.sqrt(tile)).reshape(x.shape)


def unrotate(x, signs, tile):
    """Inverse of rotate: x R per tile."""
    check_power_of_two(tile)
    g = fwht(x.reshape(*x.shape[:-1], -1, tile)) / math.sqrt(tile)
    return (g * signs.to(x.device, x.dtype).reshape(-1, tile)).reshape(x.shape)
