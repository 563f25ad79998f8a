"""A trellis layer's layout: its weight rotated group by group (a random Hadamard transform, stored as its seed) and
cut into tiles of T = th x tw weights, one trellis sequence each; each tile's state path as a bitstream, the integer
whose L-bit field at bit K(T-1-t) is s_t (the start state whole, then K new bits a step; tail-biting: exactly K T
bits, read circularly); and the CRC32 that binds the streams to the fields their meaning depends on."""
import json
import zlib

import torch

from .numerics import hadamard
from .numerics.affine import pack_bits


# ---- rotation -----------------------------------------------------------------------------------------------------

def rotate(x, group=256, seed=0):
    """x [..., n] -> each group of `group` columns times R^T, R = random_hadamard(group, seed): the trellis layer
    stores its rotation as this seed."""
    return hadamard.rotate(_wide(x), hadamard.random_signs(group, seed), group)


def unrotate(x, group=256, seed=0):
    """Inverse of rotate: each group times R."""
    return hadamard.unrotate(_wide(x), hadamard.random_signs(group, seed), group)


def _wide(x):
    """float32, or float64 when given (BlockLDLQ rotates its Hessian in double precision)."""
    return x if x.dtype == torch.float64 else x.float()


# ---- tiles --------------------------------------------------------------------------------------------------------

def check_tile(shape, tile):
    th, tw = tile
    if th < 1 or tw < 1 or shape[0] % th or shape[1] % tw:
        raise ValueError(f"weight {tuple(shape)} does not split into {th} x {tw} tiles")
    return th, tw


def to_tiles(w, tile):
    """[out, in] -> [out / th, in / tw, th * tw]: each tile's weights in row-major order (one trellis sequence)."""
    th, tw = check_tile(w.shape, tile)
    r, c = w.shape[0] // th, w.shape[1] // tw
    return w.reshape(r, th, c, tw).permute(0, 2, 1, 3).reshape(r, c, th * tw)


def from_tiles(seq, tile):
    """Inverse of to_tiles: [R, C, th * tw] -> [R * th, C * tw]."""
    th, tw = tile
    r, c, _ = seq.shape
    return seq.reshape(r, c, th, tw).permute(0, 2, 1, 3).reshape(r * th, c * tw)


# ---- the bitstream ------------------------------------------------------------------------------------------------

def stream_bits(L, K, T, tail_biting):
    """Bits in one tile's stream (before padding to whole bytes)."""
    return K * T if tail_biting else L + K * (T - 1)


def pack_stream(states, L, K, tail_biting):
    """states [B, T] -> uint8 [B, ceil(bits / 8)]: the integer N whose L-bit field at bit K(T-1-t) is s_t."""
    B = states.shape[0]
    sym = (states & (2 ** K - 1)).flip(-1)                   # b_{T-1} lands in the lowest bits
    if not tail_biting:
        sym = sym[:, :-1]
    bits = ((sym[..., None] >> torch.arange(K)) & 1).reshape(B, -1)
    if not tail_biting:
        bits = torch.cat((bits, (states[:, :1] >> torch.arange(L)) & 1), 1)
    return pack_bits(bits, 1)


def stream_states(codes, L, K, T, tail_biting):
    """Inverse of pack_stream: uint8 [B, nbytes] -> states int32 [B, T]. State t is the L-bit field at bit
    o = K(T-1-t), read from the three bytes from byte o // 8 on (L <= 16 bits at a shift of at most 7; circularly: a
    tail-biting stream wraps around), joined into one int32 word per byte first."""
    nbits = stream_bits(L, K, T, tail_biting)
    nbytes = -(-nbits // 8)
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != nbytes:
        raise ValueError(f"a stream of L={L}, K={K}, T={T} ({'tail-biting' if tail_biting else 'free start'}) "
                         f"is {nbytes} uint8 bytes per tile, got {codes.dtype} {tuple(codes.shape)}")
    if tail_biting and nbits % 8:
        raise ValueError(f"a tail-biting stream must fill whole bytes, K*T = {nbits}")
    if nbits % 8 and bool((codes[:, -1] >> (nbits % 8)).any()):
        raise ValueError("corrupted stream: padding bits after the last symbol are not zero")
    if L > 16:
        raise ValueError(f"trellis states of L={L} bits are not supported (at most 16)")
    wrapped = torch.cat((codes, codes[:, :2].expand(len(codes), min(2, nbytes))), 1).to(torch.int32)
    if wrapped.shape[1] < nbytes + 2:                                         # a one-byte stream: itself, thrice
        wrapped = wrapped[:, torch.arange(nbytes + 2) % nbytes]
    words = wrapped[:, :-2] | (wrapped[:, 1:-1] << 8) | (wrapped[:, 2:] << 16)   # [B, nbytes]: bytes j, j+1, j+2
    o = K * (T - 1 - torch.arange(T, dtype=torch.int32))
    if 8 % K == 0:            # byte o // 8 serves q = 8 / K states in a row: the words from the last, each q times
        q = 8 // K
        first = (nbytes - 1) * q - (T - 1) + (q - 1)                         # where state 0's run sits in them
        held = words.flip(1)[:, :, None].expand(*words.shape, q).reshape(len(words), -1)[:, first:first + T]
    else:
        held = torch.index_select(words, 1, o // 8)
    return (held >> (o % 8)) & (2 ** L - 1)


def stream_checksum(codes, scales, L, K, code, tail_biting, tile, group, seed):
    """CRC32 of a layer's codes uint8 [R, C, bytes] and scales f16 [R, C], and of the fields their meaning depends
    on."""
    head = json.dumps([L, K, code, bool(tail_biting), list(tile), group, seed, list(codes.shape)]).encode()
    crc = zlib.crc32(head)
    for t in (codes, scales):
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc
