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

from . import INTERPRETED, check_device


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
    check_device(states, starts, words, slot_sym, slot_freq, slot_bias, out)
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
# A program decodes STREAMS sub-streams side by side (lane i: sub-stream program * STREAMS + i; lanes past the last
# sub-stream are masked), in two phases:
# 1. Where each codeword starts: the only sequential part (a codeword's start is known once the one before it is
#    read), so the kernel is 512 steps long whatever the layer, and a step is kept to ~11 tl ops: a lane stores its
#    bit position and adds the codeword's length, looked up as lengths[rice_k, next 16 bits] (a valid codeword has its
#    '1' among its first 16 bits: q + 1 + rice_k bits, or ESCAPE + 1 + RAW_BITS = 32 for an escape; a run of 16
#    zeros, no codeword, also reads as 32, so a corrupt lane moves at most 32 bits a step). The 16 bits come from
#    one 64-bit load: the launcher lays the payload out as windows[i] = bytes 4i .. 4i+7 (like rice_decode's win40).
# 2. Everything else, vectorized over [STREAMS, CHUNK] symbols: each codeword's value from the 32 bits at its start
#    (the unary run is their count of leading zeros, from the float32 exponent of their top 24 bits; an escape's raw
#    bits fill the window's end), zig-zag, the inverse strip, scales, and the store. Symbol orders per vector: E8
#    [comb, s0..s6], D4 [c0, c1, c2, t], A2 [n_x, t_y], Z [n]. Output coordinate r decodes symbol (r + ROT) mod n
#    (ROT = 1 for E8 and A2, whose first symbol rebuilds their last coordinate); the "special" coordinate (E8 7, D4 3,
#    A2 0) adds the parity of the others (a sum per vector: a reshape to [STREAMS, CHUNK / n, n]), and E8 adds its
#    coset (the comb's low bit) to all.
# Why two phases: under the interpreter every tl op costs ~0.1 ms of Python whatever its width, so only the position
# chain is paid per step; compiled, phase 1 is one thread per sub-stream (a warp of them per program) with two loads
# per step, and phase 2 is plain parallel work. The launcher runs ONE program for all sub-streams under the
# interpreter (STREAMS = next power of two of their count, CHUNK = a whole sub-stream), STREAMS = 32 compiled.
# The starts are kept in the output itself (an int32 view of the float32 result) until phase 2 replaces them by
# values: barriers order phase 1's stores before phase 2's loads, and in phase 2 a chunk's loads before its stores
# (a coordinate reads its neighbour's start). Every lane runs the same number of steps: the last, shorter sub-stream
# runs on into the output's padding, so its end is the start it stored after its last symbol. end_ptr gets each
# lane's end (-1: a start outside the payload or an invalid codeword), which the launcher checks against where each
# sub-stream must end.

_FUSED_UNSTRIP = ("Z", "A2", "D4", "E8")          # the lattices whose inverse strip the kernel below is written for
_ROTATION = {"Z": 0, "A2": 1, "D4": 0, "E8": 1}    # output coordinate r decodes symbol (r + ROT) mod n
_SPECIAL = {"Z": -1, "A2": 0, "D4": 3, "E8": 7}    # the coordinate rebuilt from the others' parity
_GROUP = 8                                         # phase 1 stores every 8th start: a multiple of every n


@triton.jit
def lattice_decode_kernel(windows_ptr, nwords, offsets_ptr, rice_ks_ptr, lengths_ptr, count, n_streams, steps,
                          scale_ptr, row_len, axis0, starts_ptr, out_ptr, end_ptr, LATTICE: tl.constexpr,
                          N: tl.constexpr, LEVEL1: tl.constexpr, ROT: tl.constexpr, SPECIAL: tl.constexpr,
                          S: tl.constexpr, ESCAPE: tl.constexpr, RAW_BITS: tl.constexpr, STREAMS: tl.constexpr,
                          CHUNK: tl.constexpr, GROUP: tl.constexpr):
    sid = tl.program_id(0) * STREAMS + tl.arange(0, STREAMS)        # this program's sub-streams, one per lane
    live = sid < n_streams
    pos = tl.load(offsets_ptr + sid, mask=live, other=0).to(tl.int64)
    packed = tl.load(rice_ks_ptr + sid, mask=live, other=0).to(tl.int64)
    rice_k0, rice_k1 = packed & 7, (packed >> 3) & 7
    bad = live & ((pos < 0) | (pos > 32 * nwords))       # a start outside the payload, later an invalid codeword
    pos = tl.minimum(tl.maximum(pos, 0), 32 * nwords)     # ... which is then read inside it
    first = sid.to(tl.int64) * S                          # each lane's first element (the buffers cover every lane)
    starts = starts_ptr + first                           # where its codewords' starts go
    lane_count = tl.minimum(count - first, S)             # symbols of each sub-stream

    # Phase 1: the start of every GROUP-th codeword (storing every start would cost two ops a step). The loop's
    # numbers as [STREAMS] tensors, made once: under the interpreter an op with a Python number first broadcasts it
    # into a fresh array, which about doubles the op's cost; compiled, they are plain constants.
    zero = tl.zeros((STREAMS,), dtype=tl.int64)
    c5, c31, c48, c_group = zero + 5, zero + 31, zero + 48, zero + GROUP
    # A table row is indexed by the 16 bits read as a signed number (an arithmetic shift leaves them so).
    lengths0, lengths1 = lengths_ptr + (rice_k0 << 16) + 32768, lengths_ptr + (rice_k1 << 16) + 32768
    groups = tl.cdiv(steps, GROUP)                        # steps: S, fewer when the whole tensor is shorter
    at = starts
    for g in range(groups):
        tl.store(at, pos)
        at += c_group
        for r in tl.static_range(GROUP):
            win = tl.load(windows_ptr + (pos >> c5))
            top = (win << (pos & c31)) >> c48             # bits pos .. pos+15, MSB first
            if (LEVEL1 >> (r % N)) & 1:                   # a symbol of the second Rice parameter
                pos += tl.load(lengths1 + top)
            else:
                pos += tl.load(lengths0 + top)
    tl.debug_barrier()
    # The starts in between, every group at once.
    in_group = tl.arange(0, S // GROUP)[None, :]
    group_starts = starts[:, None] + in_group * GROUP                                     # [STREAMS, S / GROUP]
    p = tl.load(group_starts, mask=in_group < groups, other=0)
    for r in tl.static_range(GROUP - 1):
        shifted = tl.load(windows_ptr + (p >> 5)) << (p & 31)
        if (LEVEL1 >> (r % N)) & 1:
            p += tl.load(lengths1[:, None] + (shifted >> 48))
        else:
            p += tl.load(lengths0[:, None] + (shifted >> 48))
        tl.store(group_starts + (r + 1), p)
    tl.debug_barrier()
    partial = live & (lane_count < groups * GROUP)        # a sub-stream that ends early: its end was stored
    end = tl.where(partial, tl.load(starts + lane_count, mask=partial, other=0), pos)

    # Phase 2, CHUNK symbols of every lane at a time (vectors never straddle a chunk: CHUNK is a multiple of N).
    col = tl.arange(0, CHUNK)
    r = col % N
    source = col - r + (r + ROT) % N                      # the symbol each output coordinate decodes
    special = (r == SPECIAL)[None, :]
    level = ((LEVEL1 >> ((r + ROT) % N)) & 1)[None, :]
    rice_k = tl.where(level == 1, rice_k1[:, None], rice_k0[:, None])                    # [STREAMS, CHUNK]
    lengths, k1, k_mask = lengths_ptr + (rice_k << 16) + 32768, rice_k + 1, (1 << rice_k) - 1
    for c0 in range(0, steps, CHUNK):
        j = c0 + col
        # (a name used nowhere before the loop: reusing one of another type makes it a loop-carried variable that
        # changes type, which the GPU compiler refuses and the interpreter does not notice)
        bit_at = tl.load(starts[:, None] + (c0 + source)[None, :]).to(tl.int64)
        shifted = tl.load(windows_ptr + (bit_at >> 5)) << (bit_at & 31)
        top = shifted >> 48                               # bits bit_at .. +15 (signed), as in phase 1
        w = (shifted >> 32) & 0xFFFFFFFF                  # bits bit_at .. +31, MSB first
        length = tl.load(lengths + top)
        # length - 1 - rice_k leading zeros, a one, then rice_k bits; an escape: the window's last RAW_BITS bits.
        m = tl.where(length == ESCAPE + 1 + RAW_BITS, w & ((1 << RAW_BITS) - 1),
                     ((length - k1) << rice_k) | ((w >> (32 - length)) & k_mask))
        real = live[:, None] & (j[None, :] < lane_count[:, None])
        bad |= tl.max((real & (top == 0)).to(tl.int32), axis=1) > 0          # 16 zeros: no codeword
        if LATTICE == "E8":                               # the comb: the coset bit, then the zig-zagged t
            v = _unzigzag(tl.where(special, m >> 1, m))
            both = _per_vector_sum(tl.where(special, m & 1, 2 * v), STREAMS, CHUNK, N)   # coset + 2 sum(s_i)
            v = 2 * tl.where(special, 2 * v + ((both >> 1) & 1), v) + (both & 1)
        else:
            v = _unzigzag(m)
            if SPECIAL >= 0:                              # D4's t, A2's t_y: the parity of the others added
                parity = _per_vector_sum(tl.where(special, 0, v), STREAMS, CHUNK, N)
                v = tl.where(special, 2 * v + (parity & 1), v)
        x = v.to(tl.float32)
        if LATTICE == "A2":                               # [n_x, t_y] -> (n_y * axis0, n_x)
            x = tl.where(special, x * axis0, x)
        elem = first[:, None] + j[None, :]
        value = x * tl.load(scale_ptr + elem // row_len)
        tl.debug_barrier()                                # every start of the chunk read before any is replaced
        tl.store(out_ptr + elem, value.to(tl.int32, bitcast=True))
    tl.store(end_ptr + sid, tl.where(bad, -1, end), mask=live)


@triton.jit
def _unzigzag(m):
    return (m >> 1) ^ -(m & 1)


@triton.jit
def _per_vector_sum(x, STREAMS: tl.constexpr, CHUNK: tl.constexpr, N: tl.constexpr):
    """x [STREAMS, CHUNK] -> each vector's sum (N consecutive columns), repeated over its N columns."""
    per_vector = tl.reshape(x, (STREAMS, CHUNK // N, N))
    total = tl.reduce(per_vector, 2, tl.standard._sum_combine, keep_dims=True)
    return tl.reshape(tl.broadcast_to(total, (STREAMS, CHUNK // N, N)), (STREAMS, CHUNK))


_LENGTHS = {}


def rice_lengths_table(escape, raw_bits, device):
    """uint8 [8 * 2^16] on device (made once): entry rice_k * 2^16 + t is the length of a Rice codeword of parameter
    rice_k whose first 16 bits are t: q + 1 + rice_k for q = t's leading zeros below escape, else escape + 1 +
    raw_bits (an escape; and a run of 16 zeros, which no encoder writes)."""
    key = (escape, raw_bits, str(device))
    if key not in _LENGTHS:
        t = torch.arange(-32768, 32768) & 0xFFFF                   # row order: the 16 bits as a signed number
        q = 16 - torch.frexp(t.double()).exponent.long()          # leading zeros of t in 16 bits (16 for t = 0)
        rice_k = torch.arange(8)[:, None]
        lengths = torch.where(q < escape, q + 1 + rice_k, escape + 1 + raw_bits)
        # Compiled, one rice_k's row (64 KB of uint8) stays in L1; interpreted, int64 saves a cast (an op) a step.
        _LENGTHS[key] = lengths.to(torch.int64 if INTERPRETED else torch.uint8).reshape(-1).to(device)
    return _LENGTHS[key]


def lattice_decode(payload, offsets, rice_ks, count, ends, lattice, scales, row_len, substream, escape, raw_bits):
    """Rice sub-streams -> float32 [count]: element e = lattice code * axis * scales[e // row_len].

    payload uint8 [bytes], offsets int32 [streams] (start bits), rice_ks uint8 [streams], ends int64 [streams]
    (where each sub-stream must end), scales float32 [count // row_len]; lattice: the format's lattice (name, n,
    levels, axis: engine.formats.numerics.lattices.LATTICES); substream, escape, raw_bits: the Rice layout
    (engine.coding.rice). Raises ValueError if a sub-stream does not decode to exactly its end (a corrupt stream)."""
    check_device(payload[:, None], offsets, rice_ks, scales)
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
    if substream % _GROUP:
        raise ValueError(f"sub-streams of {substream} symbols are not whole groups of {_GROUP}")
    # 64-bit windows: windows[i] = bytes 4i .. 4i+7, MSB first (what rice_decode's win40 is for every byte), so a
    # lane gets any 32 bits starting in word i with one load. Zero bytes pad the end, past where a corrupt lane can
    # get: a start inside the payload, then at most 32 bits a step.
    nwords = -(-payload.numel() // 4)
    device = payload.device
    padded = payload.new_zeros(4 * (nwords + substream + 2), dtype=torch.uint8)
    padded[:payload.numel()] = payload
    b = padded.view(-1, 4).long()
    words = (b[:, 0] << 24) | (b[:, 1] << 16) | (b[:, 2] << 8) | b[:, 3]
    windows = (words[:-1] << 32) | words[1:]                                  # [nwords + substream + 1] int64
    # Interpreter: one program for all sub-streams (up to 4096 lanes), a whole sub-stream per chunk; compiled: one
    # warp's worth per program.
    per_program = min(4096, triton.next_power_of_2(streams)) if INTERPRETED else 32
    grid = triton.cdiv(streams, per_program)
    steps = min(substream, count)
    chunk = max(n, triton.next_power_of_2(steps) if INTERPRETED else min(64, triton.next_power_of_2(steps)))
    # The output, the starts and the scales cover every lane of every program, so that no load or store needs a
    # mask (under the interpreter a mask costs about as much as the access); the extra lanes decode zeros, unread.
    out = torch.empty(grid * per_program * substream, device=device, dtype=torch.int32)
    starts = torch.empty(out.numel(), device=device, dtype=torch.int64) if INTERPRETED else out   # int64: no cast
    rows = scales.numel()
    scales = torch.cat([scales.float(), scales.new_zeros(out.numel() // row_len + 1 - rows, dtype=torch.float32)])
    found = torch.empty(streams, device=device, dtype=torch.int64)
    level1 = sum(1 << r for r, level in enumerate(lattice.levels) if level)
    lattice_decode_kernel[(grid,)](
        windows, nwords, offsets.contiguous(), rice_ks.contiguous(), rice_lengths_table(escape, raw_bits, device),
        count, streams, steps, scales, row_len, float(lattice.axis[0]), starts, out, found, LATTICE=lattice.name,
        N=n, LEVEL1=level1, ROT=_ROTATION[lattice.name], SPECIAL=_SPECIAL[lattice.name], S=substream,
        ESCAPE=escape, RAW_BITS=raw_bits, STREAMS=per_program, CHUNK=chunk, GROUP=_GROUP)
    wrong = found != ends.to(found.device)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        raise ValueError(f"sub-stream {i} does not decode to its boundary (ends at {int(found[i])}, expected "
                         f"{int(ends[i])}): stream is corrupt")
    return out.view(torch.float32)[:count]
