"""The fast rANS coder (rans.py has the format and the textbook coder): the same bytes as rans_encode_reference and
rans_decode_reference, computed with NumPy over all lanes at once, and over the lanes of many blocks at once
(rans_encode_many: a model's blocks in one pass); tests pin them equal."""
import numpy as np
import torch

from .rans import (DECODE_CHUNK, ENCODE_BATCH, ENCODE_CHUNK, LANES_PER_STREAM, PROB_BITS, RansStream, STATE_LOW,
                   check_encode_arguments, check_final, pack_stream, quantize_frequencies, slot_tables)


def rans_encode(symbols, lanes=None, lanes_per_stream=LANES_PER_STREAM, prob_bits=PROB_BITS, context=b""):
    """uint8 symbols [n] (array or tensor) -> the stream's bytes, `context` bound to them by the checksum. lanes:
    default_lanes(n) if None. What rans_encode_reference computes, one step (all lanes) at a time, backwards."""
    return rans_encode_many([symbols], lanes, lanes_per_stream, prob_bits, [context])[0]


def rans_encode_many(blocks, lanes=None, lanes_per_stream=LANES_PER_STREAM, prob_bits=PROB_BITS, contexts=None):
    """[uint8 symbols [n_b]] -> [the bytes rans_encode(symbols_b, lanes, ..., context=contexts[b]) gives], each
    block its own stream (table, lanes, checksum). The blocks are coded side by side, up to ENCODE_BATCH symbols at
    a time: their lanes form one row of a step, so a model's blocks cost one pass of wide NumPy calls instead of
    one pass of narrow ones per block (a call's overhead, not its arithmetic, bounds a narrow step)."""
    contexts = [b""] * len(blocks) if contexts is None else list(contexts)
    if len(contexts) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks but {len(contexts)} contexts")
    checked = [check_encode_arguments(b, lanes, lanes_per_stream, prob_bits, c) for b, c in zip(blocks, contexts)]
    batches, size = [[]], 0
    for i, (symbols, _) in enumerate(checked):
        if batches[-1] and size + symbols.size > ENCODE_BATCH:
            batches, size = batches + [[]], 0
        batches[-1].append(i)
        size += symbols.size
    return [stream for batch in batches if batch for stream in _encode_side_by_side(
        [checked[i] for i in batch], [contexts[i] for i in batch], lanes_per_stream, prob_bits)]


def _encode_side_by_side(blocks, contexts, lanes_per_stream, prob_bits):
    """[(symbols [n_b], lanes_b)] -> [bytes]: every block's lanes in one row [C = sum lanes_b] per step.

    Block b's symbol i sits at step i // lanes_b of its lanes; steps past a block's end (and the lanes past n_b in
    its last step, coded first) take an identity entry of the tables: f = 2^p and c = 0, so that x' = x and no word
    is handed over. Arithmetic is in uint32, exact because every x' < 2^32."""
    p = prob_bits
    sizes = [symbols.size for symbols, _ in blocks]
    widths = [lanes for _, lanes in blocks]
    steps = [-(-n // lanes) for n, lanes in zip(sizes, widths)]
    f = [quantize_frequencies(torch.bincount(torch.from_numpy(symbols), minlength=256).numpy(), p)
         for symbols, _ in blocks]
    # Block b's entries in the table: 257 b + s holds c[s] << 16 | f[s] (one lookup for both), 257 b + 256 the
    # identity; index [step, lane] says which entry each lane codes at each step.
    table = np.concatenate([np.append((np.cumsum(f_b) - f_b) << 16 | f_b, 1 << p) for f_b in f]).astype(np.uint32)
    first = np.cumsum([0] + widths)
    index = np.empty((max(steps), first[-1]), np.min_scalar_type(table.size))
    for b, ((symbols, lanes), t) in enumerate(zip(blocks, steps)):
        part, full, offset = index[:, first[b]:first[b + 1]], (t - 1) * lanes, index.dtype.type(257 * b)
        part.fill(offset + 256)
        if t:
            part[:t - 1] = symbols[:full].reshape(-1, lanes) + offset
            part[t - 1, :symbols.size - full] = symbols[full:] + offset
    x, emits, low = _encode_steps(index, table, p, lanes_per_stream)
    counts = np.count_nonzero(emits.reshape(len(emits), -1), axis=1)       # steps past a block's end emit nothing
    words = np.compress(emits.reshape(-1), low.reshape(-1))   # every block's words, sub-stream after sub-stream
    starts, streams = np.concatenate([[0], np.cumsum(counts)]), []
    for b in range(len(blocks)):
        s0, s1 = first[b] // lanes_per_stream, first[b + 1] // lanes_per_stream     # the block's sub-streams
        streams.append(pack_stream(p, lanes_per_stream, sizes[b], f[b], x[first[b]:first[b + 1]], counts[s0:s1],
                                   words[starts[s0]:starts[s1]], contexts[b]))
    return streams


def _encode_steps(index, table, p, width):
    """The step loop, last step first, over the lanes of every block side by side: index [T, C] (table entries),
    table uint32 [E] (c << 16 | f) -> (final states [C], emits bool [S, T, W], low uint16 [S, T, W]: x mod 2^16
    before each step, the word where the lane emits), C = S W lanes in sub-streams of W = width. [sub-stream, step,
    lane] is the order in which a decoder reads a sub-stream's words; a chunk of steps is made [step, lane] (a
    step's lanes side by side) and then copied there, while in cache."""
    rows, columns = index.shape
    emits, low = np.empty((columns // width, rows, width), bool), np.empty((columns // width, rows, width), np.uint16)
    x = np.full(columns, STATE_LOW, np.uint32)
    q, high, shift = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    top, sixteen = np.uint32(32 - p), np.uint32(16)
    chunk = max(1, ENCODE_CHUNK // columns)                    # steps whose lookups are made at once
    entry = np.empty((chunk, columns), np.uint32)
    emit_chunk, low_chunk = np.empty((chunk, columns), bool), np.empty((chunk, columns), np.uint16)
    for t1 in range(rows, 0, -chunk):
        t0 = max(0, t1 - chunk)
        np.take(table, index[t0:t1], out=entry[:t1 - t0], mode="clip")
        f_t, cum_t = entry[:t1 - t0] & np.uint32(0xFFFF), entry[:t1 - t0] >> sixteen
        keep_t = np.uint32(1 << p) - f_t                       # x' = x + (x // f)(2^p - f) + c: no modulo
        for t in range(t1 - t0 - 1, -1, -1):
            np.copyto(low_chunk[t], x, casting="unsafe")         # the low 16 bits
            emit = emit_chunk[t]
            np.right_shift(x, top, out=high)                     # hand a word over first when x >= f 2^(32 - p):
            np.greater_equal(high, f_t[t], out=emit)             # then x' < 2^32 (f = 2^p, identity: never)
            np.multiply(emit, sixteen, out=shift)                # a shift by 0 or 16: cheaper than a masked one
            np.right_shift(x, shift, out=x)
            np.floor_divide(x, f_t[t], out=q)
            q *= keep_t[t]
            x += q
            x += cum_t[t]
        for chunk_of, whole in ((emit_chunk, emits), (low_chunk, low)):
            whole[:, t0:t1] = chunk_of[:t1 - t0].reshape(t1 - t0, -1, width).transpose(1, 0, 2)
    return x, emits, low


def rans_decode(data, n=None, context=b""):
    """bytes (or a uint8 tensor) from rans_encode, or a RansStream (checked when it was parsed) -> torch.uint8 [n]
    (n: the count expected, checked against the header before any work). What rans_decode_reference computes, with
    a Python loop over the n / lanes steps and NumPy over the [S, W] lanes of each step."""
    stream = data if isinstance(data, RansStream) else RansStream(data, n, context)
    if n is not None and stream.n != n:
        raise ValueError(f"rANS stream holds {stream.n} symbols, expected {n}")
    n, shape, lanes = stream.n, stream.states.shape, stream.states.size
    out = np.empty(n, dtype=np.uint8)
    full, partial = divmod(n, lanes)                  # steps in which every lane decodes; lanes in the last one
    p = stream.prob_bits
    symbol_of, freq_of, bias_of = slot_tables(stream.f, p) if n else np.zeros((3, 1 << p), np.int64)
    symbol_of = symbol_of.astype(np.uint8)
    # The step scaled by 2^16: z = F[slot] x + D[slot] = (f (x >> p) + bias) << 16 = y << 16, with
    # F = f << (16 - p) and D = ((bias << p) - f slot) << (16 - p) (D may be negative, z is not). Why: it saves the
    # shift of x, and a lane that reads already holds y << 16 for its word to fill: x = z | word, else z >> 16.
    scaled_freq = freq_of << (16 - p)
    scaled_bias = ((bias_of << p) - freq_of * np.arange(1 << p)) << (16 - p)
    # 0-d arrays, not Python numbers: a ufunc converts a number on every call.
    mask, reads_below, sixteen = np.array((1 << p) - 1), np.array(STATE_LOW << 16), np.array(16)
    words = stream.words if len(stream.words) else np.zeros(1, np.int64)
    # Each step is ~13 NumPy calls on [S, W] arrays of a few hundred lanes, where a call's overhead outweighs its
    # arithmetic: so every call writes into a buffer made once (out=), and takes use mode "clip" (the cheapest; a
    # corrupted stream then reads a wrong word, which check_final catches).
    x = stream.states.copy()
    z, gathered = np.empty(shape, np.int64), np.empty(shape, np.int64)
    reads = np.empty(shape, bool)
    # word_index [S, W + 1]: column 0 holds the index of the word each sub-stream read last; a step puts `reads`
    # (0 / 1) in the W columns after it, and a running sum along the row turns them into each reader's word (the
    # last one + its rank among the sub-stream's readers). The last column then becomes the next step's column 0.
    word_index = np.empty((shape[0], shape[1] + 1), np.int64)
    word_index[:, 0] = stream.starts[:-1] - 1
    last_read, lane_words, next_last = word_index[:, :1], word_index[:, 1:], word_index[:, -1:]
    # A step's symbols are looked up once per chunk of steps, from their slots: one call per chunk, not per step.
    chunk = max(1, min(full, DECODE_CHUNK // lanes))
    slots = np.empty((chunk,) + shape, np.int64)
    rows = out[:full * lanes].reshape((full,) + shape)
    for t0 in range(0, full, chunk):
        steps = min(chunk, full - t0)
        for slot in slots[:steps]:
            np.bitwise_and(x, mask, out=slot)
            scaled_freq.take(slot, out=gathered, mode="clip")
            np.multiply(gathered, x, out=z)
            scaled_bias.take(slot, out=gathered, mode="clip")
            z += gathered                                       # z = y << 16
            np.less(z, reads_below, out=reads)                  # y < 2^16: these lanes take a word
            np.copyto(lane_words, reads)
            np.add.accumulate(word_index, axis=1, out=word_index)
            words.take(lane_words, out=gathered, mode="clip")
            np.right_shift(z, sixteen, out=x)                   # x = y for the lanes that do not read,
            z |= gathered
            np.putmask(x, reads, z)                             # (y << 16) | word for those that do
            np.copyto(last_read, next_last)
        symbol_of.take(slots[:steps], out=rows[t0:t0 + steps], mode="clip")
    last = last_read[:, 0]
    if partial:                                       # the last step: lanes [0, partial) decode, the rest wait
        active = (np.arange(lanes) < partial).reshape(shape)
        slot = x & mask
        out[full * lanes:] = symbol_of[slot].reshape(-1)[:partial]
        y = freq_of[slot] * (x >> p) + bias_of[slot]
        reading = (y < STATE_LOW) & active
        index = last[:, None] + reading.cumsum(1)
        x = np.where(reading, y << 16 | words.take(index, mode="clip"), np.where(active, y, x))
        last = index[:, -1]
    check_final(stream, x, last + 1 - stream.starts[:-1])
    return torch.from_numpy(out)
