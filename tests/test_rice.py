"""Rice sub-streams (engine/coding/rice.py): the bit layout against an independent encoder, the fast decoder equal to
the textbook one, the best rice_k per sub-stream, and the checksum over the stream and its side data."""
import dataclasses

import numpy as np
import pytest
import torch

from engine.coding import rice as R
from engine.formats.numerics.lattices import LATTICES

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS = {name: lat.levels for name, lat in LATTICES.items()}     # the four lattices' symbol layouts


def every_rice_k(levels, seed=0):
    """Symbols [8 * 512 + 200] whose sub-stream s is best coded at rice_k s on level 0 and 7 - s on level 1
    (geometric, mean 1.45 * 2^rice_k), with escapes and a partial last sub-stream."""
    g = torch.Generator().manual_seed(seed)
    level = torch.tensor(levels).repeat(512 // len(levels))
    means = [1.45 * torch.where(level == 0, 2.0 ** rice_k, 2.0 ** (7 - rice_k)) for rice_k in range(8)]
    parts = [(-torch.log(torch.rand(512, generator=g)) * mean).long() for mean in means]
    symbols = torch.cat(parts + [parts[3][:200]])
    symbols[[3, 700, 4100]] = torch.tensor([65535, 40, 9000])        # quotients >= 15 at rice_k 0, 1 and 2
    return symbols


def reference_bits(symbols, streams, levels):
    """An independent textbook encoder writing a '0'/'1' string with the stream's own Rice parameters."""
    out = []
    for i, m in enumerate(symbols.tolist()):
        rice_k = int(streams.rice_ks[i // streams.substream]) >> 3 * levels[i % len(levels)] & 7
        if m >> rice_k < R.ESCAPE:
            out.append("0" * (m >> rice_k) + "1" + (format(m & ((1 << rice_k) - 1), f"0{rice_k}b") if rice_k else ""))
        else:
            out.append("0" * R.ESCAPE + "1" + format(m, "016b"))
    return "".join(out)


def test_zigzag():
    n = torch.arange(-5, 6)
    assert R.zigzag(n).tolist() == [9, 7, 5, 3, 1, 0, 2, 4, 6, 8, 10]
    assert torch.equal(R.unzigzag(R.zigzag(n)), n)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_payload_is_the_textbook_bit_string(name):
    levels = LAYOUTS[name]
    symbols = every_rice_k(levels)
    streams = R.rice_encode(symbols, levels)
    bits = "".join(format(b, "08b") for b in streams.payload.tolist())[:streams.total_bits]
    assert bits == reference_bits(symbols, streams, levels)
    assert streams.total_bits == R.rice_bits(symbols, levels)
    assert streams.offsets.tolist() == [len(reference_bits(symbols[:s], streams, levels))
                                        for s in range(0, symbols.numel(), 512)]


@pytest.mark.parametrize("name", ["Z", "D4", "E8"])
@pytest.mark.parametrize("chunk", [512, 5000])
def test_encoding_chunk_by_chunk_changes_no_byte(name, chunk, monkeypatch):
    """Chunks of 4096 or 4608 symbols (a whole number of sub-streams, ending mid-byte) give the one-chunk stream."""
    levels = LAYOUTS[name]
    symbols = torch.cat([every_rice_k(levels, seed) for seed in range(3)])
    whole = R.rice_encode(symbols, levels, context=b"layer")
    monkeypatch.setattr(R, "ENCODE_CHUNK", chunk)
    chunked = R.rice_encode(symbols, levels, context=b"layer")
    step = 512 * max(8, chunk // 512)
    assert any(int(whole.offsets[s]) % 8 for s in range(step // 512, whole.streams, step // 512))
    for field in ("payload", "offsets", "rice_ks"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field)), field
    assert (chunked.count, chunked.total_bits, chunked.crc) == (whole.count, whole.total_bits, whole.crc)
    bits = "".join(format(b, "08b") for b in chunked.payload.tolist())[:chunked.total_bits]
    assert bits == reference_bits(symbols, chunked, levels)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fast_decoder_equals_the_reference_decoder(name):
    levels = LAYOUTS[name]
    symbols = every_rice_k(levels, seed=1)
    streams = R.rice_encode(symbols, levels)
    assert streams.streams == 9 and streams.stream_counts()[-1] == 200          # partial last sub-stream
    chosen = [(int(b) & 7, int(b) >> 3) for b in streams.rice_ks]
    assert {low for low, _ in chosen[:8]} == set(range(8))
    if 1 in levels:
        assert {high for _, high in chosen[:8]} == set(range(8))
    escapes = (symbols.numpy() >> R.symbol_rice_ks(R.choose_rice_ks(symbols, levels), symbols.numel(), levels)) >= 15
    assert escapes.sum() >= 3
    reference = R.rice_decode_reference(streams, levels)
    assert torch.equal(reference, symbols)
    assert torch.equal(R.rice_decode(streams, levels), reference)


@pytest.mark.parametrize("name", ["D4", "E8"])
def test_each_rice_k_is_the_cheapest(name):
    levels = LAYOUTS[name]
    symbols = every_rice_k(levels, seed=2)
    level = torch.tensor(levels).repeat(symbols.numel() // len(levels))
    streams = R.rice_encode(symbols, levels)
    for s in range(streams.streams):
        window = slice(s * 512, (s + 1) * 512)
        for lv, shift in ((0, 0), (1, 3)):
            m = symbols[window][level[window] == lv].numpy()
            if m.size:
                costs = [int(R.rice_lengths(m, rice_k).sum()) for rice_k in range(8)]
                assert costs[(int(streams.rice_ks[s]) >> shift) & 7] == min(costs)


def test_escapes_at_every_bit_alignment_decode_as_the_reference_does():
    """The fast decoder reads 32-bit windows (at least 25 valid bits past the bit offset) and an escape's raw value
    from a second window 16 bits on: escapes starting at each of the 8 bit offsets within a byte, at several rice_k."""
    g = torch.Generator().manual_seed(3)
    small = (-torch.log(torch.rand(8 * 512, generator=g)) * 1.45 * 2.0 ** torch.arange(8).repeat_interleave(512)).long()
    big = torch.randint(1 << 12, 1 << 16, (8 * 512,), generator=g)
    symbols = torch.where(torch.rand(8 * 512, generator=g) < 0.05, big, small)
    streams = R.rice_encode(symbols)
    rice_k = R.symbol_rice_ks(R.choose_rice_ks(symbols), symbols.numel())
    starts = np.cumsum(R.rice_lengths(symbols.numpy(), rice_k)) - R.rice_lengths(symbols.numpy(), rice_k)
    escaped = (symbols.numpy() >> rice_k) >= R.ESCAPE
    assert set(starts[escaped] % 8) == set(range(8)) and len(set(rice_k[escaped])) >= 4
    assert torch.equal(R.rice_decode(streams), R.rice_decode_reference(streams))
    assert torch.equal(R.rice_decode(streams), symbols)


@pytest.mark.parametrize("decode", [R.rice_decode, R.rice_decode_reference])
def test_corrupt_streams_raise(decode):
    levels = LAYOUTS["E8"]
    good = R.rice_encode(every_rice_k(levels)[:2048], levels)
    flipped = good.payload.clone()
    flipped[10] ^= 4
    cases = {
        "checksum": dataclasses.replace(good, payload=flipped),
        "does not match a payload": dataclasses.replace(good, payload=good.payload[:-3]),
        "must start at bit 0": dataclasses.replace(good, offsets=good.offsets.flip(0)),
        "bits above": R.RiceStreams.seal(good.payload, good.offsets, good.rice_ks | 64, good.count, good.total_bits),
        "cannot hold": R.RiceStreams.seal(good.payload, good.offsets[:-1], good.rice_ks[:-1], good.count,
                                          good.total_bits),
        "1-D torch.int32": dataclasses.replace(good, offsets=good.offsets.long()),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            decode(bad, levels)
    # Structurally plausible, with a valid checksum: the decoder itself must notice.
    shifted = good.offsets.clone()
    shifted[2] += 1
    for bad in (R.RiceStreams.seal(good.payload, shifted, good.rice_ks, good.count, good.total_bits),
                R.RiceStreams.seal(torch.zeros_like(good.payload), good.offsets, good.rice_ks, good.count,
                                   good.total_bits)):
        with pytest.raises(ValueError, match="boundary|unary run|runs past"):
            decode(bad, levels)


@pytest.mark.parametrize("decode", [R.rice_decode, R.rice_decode_reference])
def test_a_unary_run_past_the_escape_is_refused(decode):
    """16 zeros and a one: a codeword no encoder writes (m = 16 at rice_k 0 escapes), however well it fits."""
    forged = R.RiceStreams.seal(torch.tensor([0, 0, 0x80]), torch.tensor([0]), torch.tensor([0]), 1, 17)
    with pytest.raises(ValueError, match="unary run|boundary"):
        decode(forged)


def test_checksum_covers_sizes_and_context():
    levels = LAYOUTS["D4"]
    good = R.rice_encode(every_rice_k(levels)[:1024], levels, context=b"D4 layer")
    good.validate()
    changes = {"count": good.count - 4, "total_bits": good.total_bits - 1, "context": b"E8 layer",
               "crc": good.crc ^ 1 << 31}
    for field, value in changes.items():
        with pytest.raises(ValueError, match="checksum mismatch"):
            dataclasses.replace(good, **{field: value}).validate()


def test_encoder_rejects_what_it_cannot_code():
    with pytest.raises(ValueError, match="nothing to encode"):
        R.rice_encode(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 2\^16\)"):
        R.rice_encode(torch.tensor([1, 1 << 16]))
    with pytest.raises(ValueError, match=r"\[0, 2\^16\)"):
        R.rice_encode(torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="whole vectors of 4"):
        R.rice_encode(torch.arange(6), LAYOUTS["D4"])
