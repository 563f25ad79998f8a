"""The rANS coder (engine/coding/rans.py): exact, the fast coder equal to the textbook one, near the entropy, the
Triton decoder equal to NumPy, every corrupted byte of a stream or of its side data refused, and input its decoders
would refuse refused at encode time."""
import struct

import numpy as np
import pytest
import torch

from engine.coding import rans as R
from engine.coding import rans_fast as F
from engine.formats.entropy import encode_weight
from engine.kernels import stream_decoders

pytestmark = pytest.mark.usefixtures("one_thread")


def _fp8_like(n, spread, seed=0):
    """E4M3 bytes of Laplace weights pushed into the subnormal range (-0 as +0): what EntQuant codes look like."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, generator=g).log() * torch.sign(torch.rand(n, generator=g) - 0.5) * spread
    return encode_weight(w[None], torch.zeros(1)).reshape(-1).numpy()


STREAMS = {
    "empty": np.zeros(0, np.uint8),
    "one symbol once": np.array([42], np.uint8),
    "one symbol only": np.full(5000, 7, np.uint8),
    "all 256 symbols": np.random.default_rng(1).permutation(np.repeat(np.arange(256), 20)).astype(np.uint8),
    "uniform random": np.random.default_rng(2).integers(0, 256, 7001).astype(np.uint8),
    "very skewed": np.concatenate([np.zeros(20000, np.uint8), np.arange(1, 256, dtype=np.uint8)]),
    "weights": _fp8_like(5049, 0.01),
}


def _reseal(data, context=b""):
    """The same bytes with a freshly computed checksum: a stream that lies consistently (a buggy writer)."""
    body = bytes(data[:-4])
    return body + struct.pack("<I", R._checksum(body, context))


@pytest.mark.parametrize("name", sorted(STREAMS))
@pytest.mark.parametrize("lanes", [None, 96])
def test_round_trip_is_exact(name, lanes):
    symbols = STREAMS[name]
    data = F.rans_encode(symbols, lanes=lanes, context=b"side data")
    assert np.array_equal(F.rans_decode(data, context=b"side data").numpy(), symbols)


@pytest.mark.parametrize("name, lanes, lanes_per_stream, prob_bits", [
    ("weights", 32, 32, 15),             # 157 full steps and a partial one of 25 lanes
    ("weights", 64, 32, 15),             # 2 sub-streams
    ("uniform random", 96, 32, 15),      # 3 sub-streams, a partial last step of 89 lanes
    ("all 256 symbols", 256, 64, 15),    # lanes divide n: full steps only
    ("very skewed", 16, 8, 12),          # a coarser table, narrow sub-streams
    ("weights", 4, 4, 8),
    ("one symbol only", 32, 32, 15),     # f = 2^15: no word is ever written
    ("one symbol once", 64, 32, 15),     # one lane of 64 decodes, once
    ("empty", 32, 32, 15),
])
def test_fast_coder_equals_the_textbook_coder(name, lanes, lanes_per_stream, prob_bits):
    symbols = STREAMS[name]
    options = dict(lanes=lanes, lanes_per_stream=lanes_per_stream, prob_bits=prob_bits, context=b"ctx")
    data = F.rans_encode(symbols, **options)
    assert data == R.rans_encode_reference(symbols, **options)
    reference = R.rans_decode_reference(data, context=b"ctx")
    assert np.array_equal(reference.numpy(), symbols)
    assert torch.equal(F.rans_decode(data, context=b"ctx"), reference)


@pytest.mark.parametrize("chunk", [32, 96, 160, 1 << 15])
def test_fast_decoder_is_exact_for_every_chunk_of_deferred_lookups(chunk, monkeypatch):
    monkeypatch.setattr(R, "DECODE_CHUNK", chunk)         # 1, 3, 5 or all of the 157 full steps per batch
    symbols = STREAMS["weights"]
    assert np.array_equal(F.rans_decode(F.rans_encode(symbols, lanes=32)).numpy(), symbols)


@pytest.mark.parametrize("chunk", [32, 96, 160])
@pytest.mark.parametrize("lanes", [32, 64])
def test_fast_encoder_is_exact_for_every_chunk_of_lookups(chunk, lanes, monkeypatch):
    monkeypatch.setattr(R, "ENCODE_CHUNK", chunk)         # 1 to 5 steps per batch, after the partial last one
    symbols = STREAMS["weights"]
    assert F.rans_encode(symbols, lanes=lanes) == R.rans_encode_reference(symbols, lanes=lanes)


@pytest.mark.parametrize("batch", [1 << 24, 6000])
@pytest.mark.parametrize("lanes", [None, 64])
def test_blocks_coded_side_by_side_give_each_block_its_own_stream(batch, lanes, monkeypatch):
    monkeypatch.setattr(R, "ENCODE_BATCH", batch)         # all blocks in one pass, or a pass per block or two
    names = ["weights", "empty", "one symbol only", "very skewed", "uniform random", "one symbol once"]
    blocks, contexts = [STREAMS[n] for n in names], [n.encode() for n in names]
    streams = F.rans_encode_many(blocks, lanes=lanes, contexts=contexts)
    assert streams == [F.rans_encode(b, lanes=lanes, context=c) for b, c in zip(blocks, contexts)]
    assert streams[0] == R.rans_encode_reference(blocks[0], lanes=lanes, context=contexts[0])
    for symbols, data, context in zip(blocks, streams, contexts):
        assert np.array_equal(F.rans_decode(data, context=context).numpy(), symbols)


def test_more_blocks_side_by_side_than_a_uint16_table_index_holds():
    blocks = [STREAMS["weights"][i:i + 100 + i % 7] for i in range(300)]       # 300 x 257 table entries
    assert F.rans_encode_many(blocks) == [F.rans_encode(b) for b in blocks]


def test_side_by_side_coding_refuses_contexts_that_do_not_match_the_blocks():
    with pytest.raises(ValueError, match="2 blocks but 1 contexts"):
        F.rans_encode_many([STREAMS["weights"]] * 2, contexts=[b""])


def test_frequency_table_sums_to_precision_and_keeps_every_symbol():
    counts = np.zeros(256, np.int64)
    counts[:200] = 1                               # 200 symbols seen once: each still needs f >= 1
    counts[200] = 10 ** 7
    f = R.quantize_frequencies(counts)
    assert f.sum() == 1 << R.PROB_BITS and (f[:201] >= 1).all() and (f[201:] == 0).all()
    f = R.quantize_frequencies(np.arange(256) ** 2)
    assert f.sum() == 1 << R.PROB_BITS and f[0] == 0 and (f[1:] >= 1).all()
    f = R.quantize_frequencies(np.r_[np.ones(16), np.zeros(240)], prob_bits=4)     # exactly one slot each
    assert (f[:16] == 1).all() and f.sum() == 16


@pytest.mark.parametrize("spread", [1 / 512, 1 / 64])     # about 2.3 and 5.3 bits per symbol
def test_rate_within_one_percent_of_entropy_all_metadata_counted(spread):
    symbols = _fp8_like(1 << 20, spread)
    data = F.rans_encode(symbols)
    entropy_bytes = R.empirical_entropy_bits(symbols) / 8
    assert 1.5 < 8 * entropy_bytes / symbols.size < 6.0
    assert entropy_bytes <= len(data) <= 1.01 * entropy_bytes
    assert np.array_equal(F.rans_decode(data).numpy(), symbols)


def test_thirty_two_lanes_code_a_million_symbols_within_a_tenth_of_a_percent():
    """Fewer lanes, fewer ~25-bit lane states: at 32 lanes a 1M block's states, word counts and words (what
    constriction's +0.00% counts: its output has no table) stay within 0.1% of the empirical entropy, and every
    byte within 0.12%; the default 256 lanes pay about 0.3%."""
    symbols = _fp8_like(1 << 20, 1 / 512)
    bits = R.empirical_entropy_bits(symbols)
    data = F.rans_encode(symbols, lanes=32)
    stream = R.RansStream(data)
    table = R._HEADER.size + 32 + 2 * int((stream.f > 0).sum()) + R._CRC.size
    assert 8 * (len(data) - table) <= 1.001 * bits and 8 * len(data) <= 1.0012 * bits
    assert 8 * len(F.rans_encode(symbols)) > 1.003 * bits
    assert np.array_equal(F.rans_decode(stream).numpy(), symbols)


@pytest.mark.parametrize("spread", [1 / 512, 1 / 64])
def test_the_default_precision_codes_tighter_than_one_bit_more_or_less(spread):
    """p = 15 loses more to the state's rounding (x // f at x >= 2^16) than it gains in the table, p = 13 the other
    way round."""
    symbols = _fp8_like(1 << 18, spread)
    size = {p: len(F.rans_encode(symbols, lanes=32, prob_bits=p)) for p in (13, 14, 15)}
    assert R.PROB_BITS == 14 and size[14] < min(size[13], size[15])


def test_more_distinct_symbols_than_table_slots_are_refused_at_encode_time():
    symbols = np.arange(17, dtype=np.uint8)
    with pytest.raises(ValueError, match="17 distinct symbols do not fit the 2\\^4 = 16 slots"):
        F.rans_encode(symbols, prob_bits=4)
    with pytest.raises(ValueError, match="17 distinct symbols"):
        R.rans_encode_reference(symbols, prob_bits=4)
    assert np.array_equal(F.rans_decode(F.rans_encode(symbols[:16], prob_bits=4)).numpy(), symbols[:16])


@pytest.mark.parametrize("options, match", [
    ({"lanes": 0}, "lanes"), ({"lanes": 48}, "multiple of lanes_per_stream"), ({"lanes": 32.0}, "lanes"),
    ({"lanes": R.LANES_LIMIT * 2}, "at most"), ({"lanes_per_stream": 3, "lanes": 3}, "power of two"),
    ({"lanes_per_stream": 1 << 16}, "power of two"), ({"prob_bits": 0}, "prob_bits"), ({"prob_bits": 16}, "prob_bits"),
    ({"prob_bits": True}, "prob_bits"), ({"prob_bits": 15.0}, "prob_bits"), ({"context": "text"}, "context"),
    ({"symbols": STREAMS["weights"].astype(np.int32)}, "uint8"),
])
def test_arguments_its_decoders_would_refuse_are_refused_at_encode_time(options, match):
    options = dict(options)
    symbols = options.pop("symbols", STREAMS["weights"])
    for encode in (F.rans_encode, R.rans_encode_reference):
        with pytest.raises(ValueError, match=match):
            encode(symbols, **options)


def test_every_flipped_byte_of_the_stream_or_of_its_context_is_refused():
    symbols = np.random.default_rng(3).integers(0, 9, 300).astype(np.uint8)
    context = b"fmt=float8; shapes; log2 scales"
    data = F.rans_encode(symbols, lanes=64, context=context)
    assert len(data) > 300                                # header, table, 64 states, 2 counts, words, crc
    for pos in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            broken = bytearray(data)
            broken[pos] ^= flip
            match = "bad magic" if pos < 4 else "version" if pos == 4 else "checksum mismatch"
            with pytest.raises(ValueError, match=match):
                F.rans_decode(bytes(broken), context=context)
    for pos in range(len(context)):
        broken = bytearray(context)
        broken[pos] ^= 0x20
        with pytest.raises(ValueError, match="checksum mismatch"):
            R.RansStream(data, context=bytes(broken))
    for other in (b"", context[:-1], context + b"\0"):
        with pytest.raises(ValueError, match="checksum mismatch"):
            R.RansStream(data, context=other)
    for cut in range(len(data)):
        with pytest.raises(ValueError, match="truncated|checksum mismatch"):
            R.RansStream(data[:cut], context=context)
    with pytest.raises(ValueError, match="checksum mismatch"):
        R.RansStream(data + b"\0\0", context=context)


def test_a_stream_of_the_older_format_is_refused_as_such():
    old = bytearray(F.rans_encode(STREAMS["weights"]))
    old[4] = 1
    with pytest.raises(ValueError, match="version 1 was written by an older engine"):
        F.rans_decode(bytes(old))


def test_a_consistent_but_lying_header_is_refused_before_decoding():
    data = bytearray(F.rans_encode(np.random.default_rng(0).integers(0, 7, 10000).astype(np.uint8)))
    magic, version, prob_bits, lanes_per_stream, n, streams = R._HEADER.unpack_from(data)
    R._HEADER.pack_into(data, 0, magic, version, prob_bits, lanes_per_stream, 300_000_000, streams)
    with pytest.raises(ValueError, match="claims 300000000 symbols"):
        F.rans_decode(_reseal(data))
    R._HEADER.pack_into(data, 0, magic, version, prob_bits, 3, n, streams)
    with pytest.raises(ValueError, match="bad rANS header"):
        F.rans_decode(_reseal(data))
    one = bytearray(F.rans_encode(np.zeros(10000, np.uint8)))            # one symbol: its words bound nothing
    magic, version, prob_bits, lanes_per_stream, n, streams = R._HEADER.unpack_from(one)
    R._HEADER.pack_into(one, 0, magic, version, prob_bits, lanes_per_stream, 1 << 40, streams)
    with pytest.raises(ValueError, match="pass the n you expect"):
        F.rans_decode(_reseal(one))
    with pytest.raises(ValueError, match="holds 1099511627776 symbols, expected 10000"):
        F.rans_decode(_reseal(one), n=10000)
    states = bytearray(F.rans_encode(STREAMS["all 256 symbols"]))
    first = R._HEADER.size + 32 + 2 * 256                                 # all 256 symbols occur: 256 frequencies
    states[first:first + 4] = b"\0\0\0\0"                                 # first lane's state 0: below 2^16
    with pytest.raises(ValueError, match="start state out of range"):
        F.rans_decode(_reseal(states))


def test_corrupted_words_under_a_valid_checksum_fail_the_final_state_check():
    data = F.rans_encode(STREAMS["uniform random"], lanes=64)
    stream = R.RansStream(data)
    words_at = len(data) - 4 - 2 * len(stream.words)
    for pos in (words_at, words_at + 101, len(data) - 5):
        broken = bytearray(data)
        broken[pos] ^= 0x5A
        for decode in (F.rans_decode, R.rans_decode_reference):
            with pytest.raises(ValueError, match="corrupted"):
                decode(_reseal(broken))
    counts_at = words_at - 4 * 2                                          # 2 sub-streams: move one word across
    swapped = bytearray(data)
    a, b = struct.unpack_from("<II", swapped, counts_at)
    struct.pack_into("<II", swapped, counts_at, a + 1, b - 1)
    for decode in (F.rans_decode, R.rans_decode_reference):
        with pytest.raises(ValueError, match="corrupted"):
            decode(_reseal(swapped))


@pytest.mark.parametrize("symbols, lanes", [
    (np.concatenate([STREAMS["very skewed"][::7], STREAMS["uniform random"][:500]]), 64),  # partial last step
    (STREAMS["uniform random"], 96),                # 3 sub-streams: one program of 4 rows, the last masked
    (_fp8_like(1 << 15, 0.02), 128),                # lanes divide n: full steps only
    (STREAMS["one symbol once"], 32),
    (STREAMS["empty"], 32),
])
def test_triton_decoder_equals_numpy_decoder(symbols, lanes):
    stream = R.RansStream(F.rans_encode(symbols, lanes=lanes))
    out = torch.empty(stream.n, dtype=torch.uint8)
    stream_decoders.rans_decode(*stream.tensors("cpu"), out, stream.prob_bits)
    assert torch.equal(out, F.rans_decode(stream)) and np.array_equal(out.numpy(), symbols)
    if stream.n < 100:
        return
    for tensor, change in ((2, lambda t: t.__setitem__(3, t[3] ^ 0x1234)),        # a flipped word
                           (0, lambda t: t.__setitem__((-1, -1), t[-1, -1] + 1)),  # the last lane's start state
                           (1, lambda t: t.__setitem__(1, t[1] - 1))):             # a sub-stream ends a word early
        bad = list(stream.tensors("cpu"))
        change(bad[tensor])
        with pytest.raises(ValueError, match="corrupted"):
            stream_decoders.rans_decode(*bad, out, stream.prob_bits)
