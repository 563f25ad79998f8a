"""The lossless stream decoders as Triton kernels: rANS (EntQuant, engine/coding/rans.py) and Rice sub-streams of
lattice codes (HyperQuant, engine/coding/rice.py), each beside its launcher.

Both are sequential within a lane (a symbol's state, or a codeword's start, is known only once the one before it is
decoded) and parallel across lanes, so a kernel is as many steps long as a lane has symbols, whatever the tensor.
Each launcher checks where every lane ended against the stream's own bookkeeping and raises ValueError on a
corrupted stream.
"""
import torch
import triton
import triton.language as tl

from . import INTERPRETED, check_inputs


# ----------------------------------------------------------------------------------------------------------------
# rANS (EntQuant): per lane: slot = x mod 2^P, s = sym[slot], x = f[slot] * (x >> P) + bias[slot]; if x < 2^16 it
# takes the next 16-bit word of its sub-stream, x = (x << 16) | word. Symbol i belongs to lane i mod lanes at step
# i // lanes; the lanes of one sub-stream find their word positions by a prefix sum over who reads.

# A program decodes SUBS sub-streams side by side as one [SUBS, W] tensor of lanes (W = LANES_PER_STREAM; row:
# sub-stream program * SUBS + r; rows past the last sub-stream are masked), every lane doing one step of the loop
# per symbol.
# Why SUBS: a lane's symbols must be decoded one after the other (each state comes from the one before it), so the
# kernel is n / lanes steps long (3072 for a block) whatever the block. Compiled, SUBS = 1: one sub-stream of 32
# lanes (a warp) per program, the sub-streams spread over the SMs. Under the interpreter every tl op costs about the
# same Python overhead whatever its width, so the launcher runs ONE program for all sub-streams (SUBS = next power of
# two of their count): n / lanes vector steps instead of that many per sub-stream. For the same reason a step is kept
# to few ops: its numbers are [SUBS, W] tensors made once (an op with a Python number first broadcasts it into a
# fresh array), and the prefix sum and row sum call tl.associative_scan / tl.reduce with the sum combine directly
# (tl.cumsum and tl.sum are @jit functions, whose every call re-patches triton.language under the interpreter).
# The n // lanes full steps mask nothing but the rows past the last sub-stream's stores; a last, partial step (when
# lanes does not divide n) runs the same loop body once with lanes >= n mod lanes masked: they store nothing, read
# nothing and keep their state.
# A lane's next word: last[s] (the last word sub-stream s has read) + its rank among the lanes of s reading now (a
# prefix sum along the row), clamped into the word array (a corrupt stream reads junk, never outside). final_ptr /
# read_ptr get each lane's last state and each sub-stream's end of reading (last + 1), which the launcher checks.


@triton.jit
def rans_decode_kernel(states_ptr, starts_ptr, words_ptr, sym_ptr, freq_ptr, bias_ptr, out_ptr, final_ptr,
                       read_ptr, n, n_streams, n_words, PROB_BITS: tl.constexpr, SUBS: tl.constexpr,
                       LANES_PER_STREAM: tl.constexpr):
    sub = tl.program_id(0) * SUBS + tl.arange(0, SUBS)                     # this program's sub-streams
    live_sub = sub < n_streams
    lane = sub[:, None] * LANES_PER_STREAM + tl.arange(0, LANES_PER_STREAM)[None, :]   # global lane ids [SUBS, W]
    live = live_sub[:, None] & (lane >= 0)                                  # lanes of real sub-streams
    lanes = n_streams * LANES_PER_STREAM
    full = n // lanes                                                       # steps in which every lane decodes
    rest = n - full * lanes                                                 # lanes taking part in a last step
    x = tl.load(states_ptr + lane, mask=live, other=65536).to(tl.int64)
    # The loop's numbers as [SUBS, W] tensors, made once; compiled, they are plain constants.
    zero = tl.full((SUBS, LANES_PER_STREAM), 0, tl.int64)
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
            rank = tl.associative_scan(reads, 1, tl.standard._sum_combine)  # prefix sum along a row: 1, 2, ..
            word = tl.load(words + tl.minimum(last + rank, word_cap), mask=need)
            x = tl.where(need, (y << c16) | word, y)
            last += tl.reduce(reads, 1, tl.standard._sum_combine, keep_dims=True)
            outs += stride
    tl.store(final_ptr + lane, x, mask=live)
    tl.store(read_ptr + sub, tl.max(last, axis=1) + 1, mask=live_sub)


def rans_decode(states, starts, words, slot_sym, slot_freq, slot_bias, out, prob_bits):
    """Decode one rANS stream into out (uint8 [n]). states int64 [S, W] (the encoder's final states: S sub-streams
    of W lanes), starts int64 [S + 1] (word offsets of the sub-streams), words int64 [total], slot tables
    [2^prob_bits] (symbol uint8, frequency and slot - cumulative int64), all on out's device. Raises ValueError if
    any lane does not end at the start state 2^16 having read its sub-stream exactly to its end (a corrupted
    stream)."""
    check_inputs(states, starts, words, slot_sym, slot_freq, slot_bias, out)
    n_streams, lanes_per_stream = states.shape
    n = out.numel()
    if (starts.numel() != n_streams + 1 or lanes_per_stream & (lanes_per_stream - 1)
            or slot_sym.numel() != 1 << prob_bits):
        raise ValueError(f"inconsistent rANS tables: states {tuple(states.shape)}, starts {starts.numel()}, "
                         f"slot table {slot_sym.numel()} for prob_bits {prob_bits}")
    subs = triton.next_power_of_2(n_streams) if INTERPRETED else 1   # interpreter: one wide program is fastest
    final = torch.empty_like(states)
    read = torch.empty(n_streams, dtype=torch.int64, device=out.device)
    words = words if words.numel() else torch.zeros(1, dtype=torch.int64, device=out.device)
    rans_decode_kernel[(triton.cdiv(n_streams, subs),)](
        states.contiguous(), starts.contiguous(), words.contiguous(), slot_sym.contiguous(), slot_freq.contiguous(),
        slot_bias.contiguous(), out, final, read, n, n_streams, words.numel(), PROB_BITS=prob_bits, SUBS=subs,
        LANES_PER_STREAM=lanes_per_stream)
    if bool((final != 65536).any()) or bool((read != starts[1:]).any()):
        raise ValueError("rANS stream corrupted: final states or read positions do not match")
    return out


# ----------------------------------------------------------------------------------------------------------------
# HyperQuant lattice codes (engine.formats.lattice): Rice sub-streams (engine.coding.rice) -> lattice points, inverse
# strip fused. The format passes its lattice in (name: which inverse strip; n; levels: which symbols of a vector take
# the second Rice parameter, as the bit mask LEVEL1; axis[0]: A2's sqrt3) and the Rice constants.
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
# first 16); an escaped codeword (ESCAPE zeros, a one, RAW_BITS raw bits) fills the window exactly. Symbol orders per
# vector: E8 [comb, s0..s6], D4 [c0, c1, c2, t], A2 [n_x, t_y], Z [n]; the vector's position r is a compile-time
# constant (static inner loop), and the dropped coordinate is rebuilt at the vector's last symbol. Output: float32
# code * axis * scale[row]; end_ptr gets each lane's final bit position (-1: a start below 0 or an invalid
# codeword), which the launcher checks against where each sub-stream must end.

_FUSED_UNSTRIP = ("Z", "A2", "D4", "E8")          # the lattices whose inverse strip the kernel below is written for


@triton.jit
def lattice_decode_kernel(windows_ptr, nwords, offsets_ptr, rice_ks_ptr, count, n_streams, vectors, scale_ptr,
                          row_len, axis0, out_ptr, end_ptr, LATTICE: tl.constexpr, N: tl.constexpr,
                          LEVEL1: tl.constexpr, S: tl.constexpr, ESCAPE: tl.constexpr, RAW_BITS: tl.constexpr,
                          STREAMS: tl.constexpr):
    sid = tl.program_id(0) * STREAMS + tl.arange(0, STREAMS)        # this program's sub-streams, one per lane
    live = sid < n_streams
    pos = tl.load(offsets_ptr + sid, mask=live, other=0).to(tl.int64)
    packed = tl.load(rice_ks_ptr + sid, mask=live, other=0).to(tl.int64)
    rice_k0, rice_k1 = packed & 7, (packed >> 3) & 7
    mask0, mask1, shift0, shift1 = (1 << rice_k0) - 1, (1 << rice_k1) - 1, 31 - rice_k0, 31 - rice_k1
    len0, len1 = rice_k0 + 1, rice_k1 + 1
    worst = tl.where(live & (pos < 0), ESCAPE + 1, 0).to(tl.int64)    # largest unary run seen (> ESCAPE: invalid)
    pos = tl.maximum(pos, 0)                                          # a corrupt negative start reads from 0
    # The loop's numbers as [STREAMS] tensors, made once (cN is N): under the interpreter an op with a Python number
    # first broadcasts it into a fresh array, which about doubles the op's cost; compiled, they are plain constants.
    zero = tl.zeros((STREAMS,), dtype=tl.int64)
    c1, c2, c5, c8, c23, c31, c32 = zero + 1, zero + 2, zero + 5, zero + 8, zero + 23, zero + 31, zero + 32
    c150, low_raw, low32, last_word = zero + 150, zero + ((1 << RAW_BITS) - 1), zero + 0xFFFFFFFF, zero + nwords
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
            if (LEVEL1 >> r) & 1:                         # a symbol of the second Rice parameter
                rice_k, k_mask, k_shift, k_len = rice_k1, mask1, shift1, len1
            else:
                rice_k, k_mask, k_shift, k_len = rice_k0, mask0, shift0, len0
            # One Rice codeword per lane at bit pos: one load of the 64-bit window of 32-bit word pos // 32 (the
            # index is clamped and the windows end in zeros, so a corrupt stream never reads outside them).
            win = tl.load(windows_ptr + tl.minimum(pos >> c5, last_word))
            w = (win >> (c32 - (pos & c31))) & low32      # bits pos .. pos+31, MSB first
            q = c150 - ((w >> c8).to(tl.float32).to(tl.int32, bitcast=True) >> c23)  # 150 - (127 + top one's index)
            q = tl.minimum(q, cap)                        # = leading zeros of w, capped: shifts stay in range
            esc = q >= escape                             # escape: m is the raw bits after the '1'
            m = tl.where(esc, w & low_raw, (q << rice_k) | ((w >> (k_shift - q)) & k_mask))
            pos += tl.where(esc, c32, q + k_len)
            vec_worst = q if r == 0 else tl.maximum(vec_worst, q)   # static_range unrolls: r == 0 defines it
            if LATTICE == "E8":                           # E8int: [comb, s0..s6]
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
                if LATTICE == "D4":                       # D4: [c0, c1, c2, t]
                    if r == 3:
                        v = c2 * v + (parity & c1)
                    else:
                        parity += v
                    tl.store(out_vec + r, v.to(tl.float32) * row_scale, mask=act)
                elif LATTICE == "A2":                     # A2: [n_x, t_y] -> (n_y * axis0, n_x)
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


def lattice_decode(payload, offsets, rice_ks, count, ends, lattice, scales, row_len, substream, escape, raw_bits):
    """Rice sub-streams -> float32 [count]: element e = lattice code * axis * scales[e // row_len].

    payload uint8 [bytes], offsets int32 [streams] (start bits), rice_ks uint8 [streams], ends int64 [streams]
    (where each sub-stream must end), scales float32 [count // row_len]; lattice: the format's lattice (name, n,
    levels, axis: engine.formats.lattice.LATTICES); substream, escape, raw_bits: the Rice layout
    (engine.coding.rice). Raises ValueError if a sub-stream does not decode to exactly its end (a corrupt stream)."""
    check_inputs(payload[:, None], offsets, rice_ks, scales)
    if getattr(lattice, "name", None) not in _FUSED_UNSTRIP:
        raise ValueError(f"lattice must be one of the format's lattices {_FUSED_UNSTRIP}, got {lattice!r}")
    n = lattice.n
    streams = offsets.numel()
    if streams != -(-count // substream) or rice_ks.numel() != streams or count % row_len or row_len % n \
            or substream % n:
        raise ValueError(f"{streams} sub-streams / {rice_ks.numel()} Rice parameters do not fit {count} symbols of "
                         f"rows {row_len}")
    if escape + 1 + raw_bits != 32:
        raise ValueError(f"an escaped codeword must fill the 32-bit window: escape {escape}, raw_bits {raw_bits}")
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
    level1 = sum(1 << r for r, level in enumerate(lattice.levels) if level)
    lattice_decode_kernel[(triton.cdiv(streams, per_program),)](
        windows, nwords, offsets.contiguous(), rice_ks.contiguous(), count, streams, min(substream, count) // n,
        scales.float().contiguous(), row_len, float(lattice.axis[0]), out, found, LATTICE=lattice.name, N=n,
        LEVEL1=level1, S=substream, ESCAPE=escape, RAW_BITS=raw_bits, STREAMS=per_program)
    wrong = found != ends.to(found.device)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        raise ValueError(f"sub-stream {i} does not decode to its boundary (ends at {int(found[i])}, expected "
                         f"{int(ends[i])}): stream is corrupt")
    return out
