"""A trellis layer's bitstream: each tile's state path as the integer whose L-bit field at bit K(T-1-t) is s_t (the
start state whole, then K new bits a step; tail-biting: exactly K T bits, read circularly), and the CRC32 that binds
the streams to the fields their meaning depends on."""
import json
import zlib

import torch

from .numerics.affine import pack_bits


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
    """Inverse of pack_stream: uint8 [B, nbytes] -> states [B, T]. State t is the L-bit field at bit o = K(T-1-t),
    read from four bytes starting at byte o // 8 (circularly: a tail-biting stream wraps around)."""
    nbits = stream_bits(L, K, T, tail_biting)
    nbytes = -(-nbits // 8)
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] != nbytes:
        raise ValueError(f"a stream of L={L}, K={K}, T={T} ({'tail-biting' if tail_biting else 'free start'}) "
                         f"is {nbytes} uint8 bytes per tile, got {codes.dtype} {tuple(codes.shape)}")
    if tail_biting and nbits % 8:
        raise ValueError(f"a tail-biting stream must fill whole bytes, K*T = {nbits}")
    if nbits % 8 and bool((codes[:, -1] >> (nbits % 8)).any()):
        raise ValueError("corrupted stream: padding bits after the last symbol are not zero")
    o = K * (T - 1 - torch.arange(T))
    idx = (o[:, None] // 8 + torch.arange(4)) % nbytes                       # [T, 4]
    word = (codes.long()[:, idx] << (8 * torch.arange(4))).sum(-1)           # [B, T]
    return (word >> (o % 8)) & (2 ** L - 1)


def stream_checksum(codes, scales, L, K, code, tail_biting, tile, group, seed):
    """CRC32 of a layer's codes uint8 [R, C, bytes] and scales f16 [R, C], and of the fields their meaning depends
    on."""
    head = json.dumps([L, K, code, bool(tail_biting), list(tile), group, seed, list(codes.shape)]).encode()
    crc = zlib.crc32(head)
    for t in (codes, scales):
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc
