"""HyperQuant lattice codes: closest points, normalized second moments, bit-stripping, Rice sub-streams (CPU and
Triton), rate control, weights, KV cache with subtractive dither."""
import itertools
import math

import pytest
import torch

from engine.formats import base
from engine.formats import checkpoints
from engine.formats import lattice as L
from engine.formats.base import quantized_linears
from engine.kernels import stream_decoders

PAPER_RATES_21DB = {"E8": 3.74, "D4": 3.77, "A2": 3.81, "Z": 3.84}
SAVING = {"E8": 1.0, "D4": 0.25, "A2": 0.5, "Z": 0.0}
PERIOD = {"E8": 4, "D4": 2, "A2": 2, "Z": 1}          # k Z^n inside the integer realization


def axis(name):
    return torch.tensor(L.LATTICES[name].axis, dtype=torch.float64)


def gaussian_codes(name, vectors, sigma, seed=0):
    g = torch.Generator().manual_seed(seed)
    return L.closest_point(torch.randn(vectors, L.LATTICES[name].n, generator=g, dtype=torch.float64) * sigma, name)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_normalized_second_moment(name):
    lat = L.LATTICES[name]
    g = torch.Generator().manual_seed(1)
    # uniform over a period box of a sublattice is uniform modulo the lattice
    x = torch.rand(400_000 // lat.n, lat.n, generator=g, dtype=torch.float64) * PERIOD[name] * axis(name)
    err = (x - L.closest_point(x, name) * axis(name)).pow(2).sum(1).mean() / lat.n
    assert abs(float(err) / lat.volume ** (2 / lat.n) / lat.G - 1) < 0.01


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_closest_point_is_nearest(name):
    """Brute force: no lattice point within twice the covering radius of the decoded point is nearer."""
    lat = L.LATTICES[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, lat.n, generator=g, dtype=torch.float64) * 3 * axis(name)
    codes = L.closest_point(x, name)
    assert bool(L.is_member(codes, name).all())
    steps = torch.tensor(list(itertools.product((-2, -1, 0, 1, 2), repeat=lat.n)), dtype=torch.long)
    if name == "E8":          # every 2E8 vector of norm <= 4 (covering radius 2): even or all-odd steps
        odd = torch.tensor(list(itertools.product((-1, 1), repeat=8)))
        steps = torch.cat([torch.tensor(list(itertools.product((-2, 0, 2), repeat=8))),
                           4 * torch.eye(8, dtype=torch.long), -4 * torch.eye(8, dtype=torch.long), odd] +
                          [odd + 2 * odd[:, i:i + 1] * torch.eye(8, dtype=torch.long)[i] for i in range(8)])
    steps = steps[L.is_member(steps, name)]               # differences of lattice points are lattice points
    cand = codes[:, None] + steps                                                   # [40, candidates, n]
    best = ((cand * axis(name) - x[:, None]) ** 2).sum(-1).min(1).values
    assert bool((((codes * axis(name) - x) ** 2).sum(-1) <= best + 1e-9).all())


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_strip_saves_exact_bits_and_round_trips(name):
    lat = L.LATTICES[name]
    # Density of the realization in Z^n, by counting members in a period box: 2^(-saving * n).
    box = torch.tensor(list(itertools.product(range(PERIOD[name]), repeat=lat.n)), dtype=torch.long)
    fraction = L.is_member(box, name).float().mean()
    assert -math.log2(float(fraction)) / lat.n == SAVING[name]
    # Strip is a bijection onto all of N^n: lattice points -> symbols -> the same points ...
    codes = torch.cat([gaussian_codes(name, 3000, s) for s in (0.5, 4.0, 300.0)])
    symbols = L.strip(codes, name)
    assert symbols.shape == codes.shape and int(symbols.min()) >= 0
    assert torch.equal(L.unstrip(symbols, name), codes)
    # ... and every symbol vector is a lattice point, so the stripped stream carries no pinned bit.
    g = torch.Generator().manual_seed(3)
    anything = torch.randint(0, 200, (3000, lat.n), generator=g)
    back = L.unstrip(anything, name)
    assert bool(L.is_member(back, name).all())
    assert torch.equal(L.strip(back, name), anything)


def test_zigzag():
    n = torch.arange(-5, 6)
    assert L.zigzag(n).tolist() == [9, 7, 5, 3, 1, 0, 2, 4, 6, 8, 10]
    assert torch.equal(L.unzigzag(L.zigzag(n)), n)


def reference_bits(symbols, streams, name):
    """An independent bit-string Rice encoder using the stream's own k: the payload layout, bit for bit."""
    lat = L.LATTICES[name]
    out = []
    ks = streams.ks.tolist()
    for i, m in enumerate(symbols.reshape(-1).tolist()):
        kb = ks[i // streams.substream]
        k = (kb >> 3) & 7 if lat.levels[i % lat.n] else kb & 7
        if m >> k < L.ESCAPE:
            out.append("0" * (m >> k) + "1" + (format(m & ((1 << k) - 1), f"0{k}b") if k else ""))
        else:
            out.append("0" * L.ESCAPE + "1" + format(m, "016b"))
    return "".join(out)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_rice_round_trip_bit_exact(name):
    codes = torch.cat([gaussian_codes(name, 700, 6.0), gaussian_codes(name, 100, 0.3, seed=1)])
    codes[5] = L.closest_point(torch.full((1, L.LATTICES[name].n), 5000.0, dtype=torch.float64), name)  # escapes
    symbols = L.strip(codes, name)
    streams = L.encode_codes(codes, name)
    assert streams.streams == -(-symbols.numel() // 512) and streams.count == symbols.numel()
    bits = "".join(format(b, "08b") for b in streams.payload.tolist())[:streams.total_bits]
    assert bits == reference_bits(symbols, streams, name)
    assert streams.total_bits == L.rice_bits(symbols, name)
    assert torch.equal(L.decode_codes(streams, name), codes)
    # each sub-stream's k (per level) is the cheapest of 0..7
    flat, levels = symbols.reshape(-1), L.symbol_levels(symbols.numel(), name)
    for s in range(streams.streams):
        sl = slice(s * 512, (s + 1) * 512)
        for level, shift in ((0, 0), (1, 3)):
            m = flat[sl][levels[sl] == level]
            if m.numel():
                costs = [int(L.rice_lengths(m.numpy(), k).sum()) for k in range(8)]
                assert costs[(int(streams.ks[s]) >> shift) & 7] == min(costs)


def test_corrupt_streams_raise():
    codes = gaussian_codes("E8", 300, 5.0)
    good = L.encode_codes(codes, "E8")
    flipped = good.payload.clone()
    flipped[10] ^= 4
    cases = [
        L.RiceStreams(flipped, good.offsets, good.ks, good.count, good.total_bits, good.crc),      # checksum
        L.RiceStreams(good.payload[:-3], good.offsets, good.ks, good.count, good.total_bits, good.crc),
        L.RiceStreams(good.payload, good.offsets.flip(0), good.ks, good.count, good.total_bits, good.crc),
        L.RiceStreams.seal(good.payload, good.offsets, good.ks | 64, good.count, good.total_bits),
        L.RiceStreams.seal(good.payload, good.offsets[:-1], good.ks[:-1], good.count, good.total_bits),
    ]
    for bad in cases:
        with pytest.raises(ValueError):
            L.decode_codes(bad, "E8")
    # Structurally wrong but with a valid checksum: the decoder itself must notice.
    shifted = good.offsets.clone()
    shifted[2] += 1
    with pytest.raises(ValueError, match="boundary"):
        L.decode_codes(L.RiceStreams.seal(good.payload, shifted, good.ks, good.count, good.total_bits), "E8")
    zeros = L.RiceStreams.seal(torch.zeros_like(good.payload), good.offsets, good.ks, good.count, good.total_bits)
    with pytest.raises(ValueError):
        L.decode_codes(zeros, "E8")
    short = L.encode_codes(codes[:8], "E8", substream=16)                # kernel: short sub-streams, fast
    moved = short.offsets.clone()
    moved[1] += 1
    for payload, offsets in ((torch.zeros_like(short.payload), short.offsets), (short.payload, moved)):
        bad = L.RiceStreams.seal(payload, offsets, short.ks, short.count, short.total_bits, 16)
        with pytest.raises(ValueError, match="boundary"):
            stream_decoders.lattice_decode(bad.payload, bad.offsets, bad.ks, bad.count, bad.stream_ends(), "E8",
                                          torch.ones(8), 8, substream=16)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_kernel_equals_cpu_decoder(name):
    """Short sub-streams (16 symbols) keep the interpreted kernel fast; the code path is the 512 one."""
    lat = L.LATTICES[name]
    codes = gaussian_codes(name, 72 // lat.n * 2, 4.0)
    codes[3] = L.closest_point(torch.full((1, lat.n), -3000.0, dtype=torch.float64), name)
    streams = L.encode_codes(codes, name, substream=16)
    rows = 2
    scales = torch.tensor([0.5, 2.0])
    out = stream_decoders.lattice_decode(streams.payload, streams.offsets, streams.ks, streams.count,
                                        streams.stream_ends(), name, scales, streams.count // rows, lat.axis[0],
                                        substream=16)
    cpu = L.decode_codes(streams, name).float() * torch.tensor(lat.axis, dtype=torch.float32)
    assert torch.equal(out.reshape(rows, -1), cpu.reshape(rows, -1) * scales[:, None])


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_gaussian_rice_rate_at_21db_matches_paper(name):
    """Rate = Rice payload bits per scalar (optimal k per 512-symbol sub-stream); SNR = 10 log10(sigma^2 / noise)
    with the lattice scaled so that G V^(2/n) equals the target noise."""
    rate, snr = L.gaussian_rate(name, 21.0, vectors=50_000, seed=11)
    assert abs(snr - 21.0) < 0.1
    assert abs(rate - PAPER_RATES_21DB[name]) <= 0.05
    # Without the strip (zig-zag of the raw codes, same Rice coder) the rate rises by the stripped bits.
    x = torch.randn(20_000, L.LATTICES[name].n, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    codes = L.closest_point(x / L.lattice_scale(21.0, name), name)
    extra = (L.rice_bits(L.zigzag(codes), name) - L.rice_bits(L.strip(codes, name), name)) / codes.numel()
    assert abs(extra - SAVING[name]) <= 0.02


@pytest.mark.parametrize("name,bps", [("E8", 2.0), ("E8", 3.37), ("E8", 4.0), ("D4", 3.0), ("A2", 2.55),
                                      ("Z", 3.0)])
def test_rate_control_hits_target(name, bps):
    rate, _ = L.gaussian_rate(name, L.snr_for_rate(bps, name), vectors=40_000, seed=5)
    assert abs(rate - bps) <= 0.02
    with pytest.raises(ValueError):
        L.snr_for_rate(0.5, name)


def test_lattice_linear_engine_matches_torch_and_counts_storage():
    torch.manual_seed(0)
    w = torch.randn(4, 32) * 0.05                   # 128 symbols: the interpreted kernel decodes 32 steps
    layer = L.quantize_weight(w, "D4", 20.0, tile=32, seed=3, bias=torch.randn(4))
    snr = 10 * torch.log10(w.pow(2).sum() / (layer.dequantize() - w).pow(2).sum())
    assert abs(float(snr) - 20.0) < 1.0
    x = torch.randn(3, 32)
    with base.impl("engine"):
        y_engine = layer(x)
    y_torch = layer(x)
    assert torch.allclose(y_engine, y_torch, rtol=1e-4, atol=1e-5)
    assert torch.allclose(y_torch, x @ layer.dequantize().T + layer.bias, atol=1e-5)
    stored = L.CHECKPOINT.write(layer, {})
    assert layer.storage_bits() == sum(t.numel() * t.element_size() * 8 for t in stored.values())


def test_quantize_model_rate_and_checkpoint(tiny_model, tmp_path):
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_model(ids)
    config = L.quantize(tiny_model, None, lattice="E8", bps=3.0)
    layers = quantized_linears(tiny_model)
    assert len(layers) == 14 and config["quant_method"] == "lattice"
    payload = sum(8 * layer.payload.numel() for layer in layers.values())
    weights = sum(layer.in_features * layer.out_features for layer in layers.values())
    assert abs(payload / weights - 3.0) < 0.15           # rotated small weights are near-Gaussian
    with torch.no_grad():
        out = tiny_model(ids)
    assert float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 0.1
    checkpoints.save_quantized(tiny_model, tmp_path / "ckpt", "lattice", quantization_config=config)
    loaded = checkpoints.load_quantized(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(ids), out)


def inner_product_errors(quantizer, x, q, draws):
    x_hat = quantizer.quantize(x.expand(draws, -1).contiguous())
    return (x_hat - x) @ q


@pytest.mark.parametrize("rotation", ["none", "qjl"])
def test_dither_makes_inner_products_unbiased(rotation):
    g = torch.Generator().manual_seed(4)
    x, q = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    draws = 4000
    dithered = inner_product_errors(L.KVQuantizer("E8", 2.0, rotation, dither=True, seed=1), x, q, draws)
    bound = 4 * dithered.std() / math.sqrt(draws)
    assert abs(float(dithered.mean())) < bound
    # Without dither the error is the same on every call: a fixed bias. Measured along its own direction.
    plain = L.KVQuantizer("E8", 2.0, rotation, dither=False, seed=1)
    err = plain.quantize(x[None])[0] - x
    fixed = inner_product_errors(plain, x, err, 50)
    assert float(fixed.max() - fixed.min()) < 1e-9 and float(fixed.mean()) > bound * err.norm() / q.norm()


def test_dither_is_uniform_on_the_voronoi_cell():
    g = torch.Generator().manual_seed(6)
    for name, lat in L.LATTICES.items():
        u = L.voronoi_dither((100_000 // lat.n,), name, g)
        assert torch.equal(L.closest_point(u, name), torch.zeros_like(u, dtype=torch.long))
        second = u.pow(2).sum(1).mean() / lat.n
        assert abs(float(second) / lat.noise_unit - 1) < 0.02


def test_kv_quantizer_through_the_attention_hook(tiny_model):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_model(ids)
    kv = L.kv_quantize(tiny_model, "E8", 3.0, rotation="signs", dither=True, seed=2)
    with torch.no_grad():
        out = tiny_model(ids)
    assert 0 < float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 0.05
    report = kv.report()
    # 2 layers x (K, V) x [2, 2 kv heads, 32, 16]
    assert kv.stats["scalars"] == 2 * 2 * 2 * 2 * 32 * 16
    assert report["total_bps"] > report["payload_bps"] and report["vs_bf16"] == report["total_bps"] / 16
    with pytest.raises(ValueError):
        L.KVQuantizer("E8", 3.0, rotation="haar")
