"""HyperQuant lattice codes: closest points, normalized second moments, bit-stripping, the Triton decoder against
the CPU one, rate control, weights, and checkpoints that refuse every changed byte and field."""
import itertools
import json
import math

import pytest
import torch

from engine.formats import quantized_checkpoints as registry
from engine.coding import rice
from engine.formats import lattice as L
from engine.layers import impl, quantized_linears
from engine.kernels import stream_decoders

PAPER_RATES_21DB = {"E8": 3.74, "D4": 3.77, "A2": 3.81, "Z": 3.84}
SAVING = {"E8": 1.0, "D4": 0.25, "A2": 0.5, "Z": 0.0}
PERIOD = {"E8": 4, "D4": 2, "A2": 2, "Z": 1}          # p Z^n inside the integer realization


def axis(name):
    return torch.tensor(L.LATTICES[name].axis, dtype=torch.float64)


def gaussian_codes(name, vectors, sigma, seed=0):
    g = torch.Generator().manual_seed(seed)
    lat = L.LATTICES[name]
    return lat.closest_point(torch.randn(vectors, lat.n, generator=g, dtype=torch.float64) * sigma)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_normalized_second_moment(name):
    lat = L.LATTICES[name]
    g = torch.Generator().manual_seed(1)
    # uniform over a period box of a sublattice is uniform modulo the lattice
    x = torch.rand(400_000 // lat.n, lat.n, generator=g, dtype=torch.float64) * PERIOD[name] * axis(name)
    err = (x - lat.closest_point(x) * axis(name)).pow(2).sum(1).mean() / lat.n
    assert abs(float(err) / lat.volume ** (2 / lat.n) / lat.G - 1) < 0.01


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_closest_point_is_nearest(name):
    """Brute force: no lattice point within twice the covering radius of the decoded point is nearer."""
    lat = L.LATTICES[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, lat.n, generator=g, dtype=torch.float64) * 3 * axis(name)
    codes = lat.closest_point(x)
    assert bool(lat.is_member(codes).all())
    steps = torch.tensor(list(itertools.product((-2, -1, 0, 1, 2), repeat=lat.n)), dtype=torch.long)
    if name == "E8":          # every 2E8 vector of norm <= 4 (covering radius 2): even or all-odd steps
        odd = torch.tensor(list(itertools.product((-1, 1), repeat=8)))
        steps = torch.cat([torch.tensor(list(itertools.product((-2, 0, 2), repeat=8))),
                           4 * torch.eye(8, dtype=torch.long), -4 * torch.eye(8, dtype=torch.long), odd] +
                          [odd + 2 * odd[:, i:i + 1] * torch.eye(8, dtype=torch.long)[i] for i in range(8)])
    steps = steps[lat.is_member(steps)]               # differences of lattice points are lattice points
    cand = codes[:, None] + steps                                                   # [40, candidates, n]
    best = ((cand * axis(name) - x[:, None]) ** 2).sum(-1).min(1).values
    assert bool((((codes * axis(name) - x) ** 2).sum(-1) <= best + 1e-9).all())


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_strip_saves_exact_bits_and_round_trips(name):
    lat = L.LATTICES[name]
    # Density of the realization in Z^n, by counting members in a period box: 2^(-saving * n).
    box = torch.tensor(list(itertools.product(range(PERIOD[name]), repeat=lat.n)), dtype=torch.long)
    fraction = lat.is_member(box).float().mean()
    assert -math.log2(float(fraction)) / lat.n == SAVING[name]
    # Strip is a bijection onto all of N^n: lattice points -> symbols -> the same points ...
    codes = torch.cat([gaussian_codes(name, 3000, s) for s in (0.5, 4.0, 300.0)])
    symbols = lat.strip(codes)
    assert symbols.shape == codes.shape and int(symbols.min()) >= 0
    assert torch.equal(lat.unstrip(symbols), codes)
    assert torch.equal(lat.unstrip(symbols.reshape(3, -1, lat.n)), codes.reshape(3, -1, lat.n))   # any leading dims
    # ... and every symbol vector is a lattice point, so the stripped stream carries no pinned bit.
    g = torch.Generator().manual_seed(3)
    anything = torch.randint(0, 200, (3000, lat.n), generator=g)
    back = lat.unstrip(anything)
    assert bool(lat.is_member(back).all())
    assert torch.equal(lat.strip(back), anything)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_kernel_equals_cpu_decoder(name):
    """Short sub-streams (16 symbols) keep the interpreted kernel fast; the code path is the 512 one."""
    lat = L.LATTICES[name]
    codes = gaussian_codes(name, 72 // lat.n * 2, 4.0)
    codes[3] = lat.closest_point(torch.full((1, lat.n), -3000.0, dtype=torch.float64))      # an escape
    streams = L.encode_codes(codes, name, substream=16)
    rows = 2
    scales = torch.tensor([0.5, 2.0])
    out = decode_kernel(streams, lat, scales, streams.count // rows)
    cpu = L.decode_codes(streams, name).float() * torch.tensor(lat.axis, dtype=torch.float32)
    assert torch.equal(out.reshape(rows, -1), cpu.reshape(rows, -1) * scales[:, None])


def decode_kernel(streams, lat, scales, row_len):
    return stream_decoders.lattice_decode(streams.payload, streams.offsets, streams.rice_ks, streams.count,
                                          streams.stream_ends(), lat, scales, row_len, streams.substream,
                                          rice.ESCAPE, rice.RAW_BITS)


def test_kernel_refuses_corrupt_streams():
    lat = L.LATTICES["E8"]
    short = L.encode_codes(gaussian_codes("E8", 8, 5.0), lat, substream=16)
    moved = short.offsets.clone()
    moved[1] += 1
    for payload, offsets in ((torch.zeros_like(short.payload), short.offsets), (short.payload, moved)):
        bad = rice.RiceStreams.seal(payload, offsets, short.rice_ks, short.count, short.total_bits, 16)
        with pytest.raises(ValueError, match="boundary"):
            decode_kernel(bad, lat, torch.ones(8), 8)
    with pytest.raises(ValueError, match="format's lattices"):
        decode_kernel(short, "E8", torch.ones(8), 8)


@pytest.mark.parametrize("name", list(L.LATTICES))
def test_gaussian_rice_rate_at_21db_matches_paper(name):
    """Rate = Rice payload bits per scalar (the best rice_k per 512-symbol sub-stream); SNR = 10 log10(sigma^2 / noise)
    with the lattice scaled so that G V^(2/n) equals the target noise."""
    rate, snr = L.gaussian_rate(name, 21.0, vectors=50_000, seed=11)
    assert abs(snr - 21.0) < 0.1
    assert abs(rate - PAPER_RATES_21DB[name]) <= 0.05
    # Without the strip (zig-zag of the raw codes, same Rice coder) the rate rises by the stripped bits.
    lat = L.LATTICES[name]
    x = torch.randn(20_000, lat.n, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    codes = lat.closest_point(x / L.lattice_scale(21.0, name))
    extra = (rice.rice_bits(rice.zigzag(codes), lat.levels) - rice.rice_bits(lat.strip(codes), lat.levels)) \
        / codes.numel()
    assert abs(extra - SAVING[name]) <= 0.02


@pytest.mark.parametrize("name,bps", [("E8", 2.0), ("E8", 3.37), ("E8", 4.0), ("D4", 3.0), ("A2", 2.55),
                                      ("Z", 3.0)])
def test_rate_control_hits_target(name, bps):
    rate, _ = L.gaussian_rate(name, L.snr_for_rate(bps, name), vectors=40_000, seed=5)
    assert abs(rate - bps) <= 0.02
    with pytest.raises(ValueError, match="outside the calibrated range"):
        L.snr_for_rate(0.5, name)


def test_lattice_linear_engine_matches_torch_and_counts_storage():
    torch.manual_seed(0)
    w = torch.randn(4, 32) * 0.05                   # 128 symbols: the interpreted kernel decodes 32 steps
    layer = L.quantize_weight(w, "D4", 20.0, tile=32, seed=3, bias=torch.randn(4))
    snr = 10 * torch.log10(w.pow(2).sum() / (layer.dequantize() - w).pow(2).sum())
    assert abs(float(snr) - 20.0) < 1.0
    x = torch.randn(3, 32)
    with impl("engine"):
        y_engine = layer(x)
    y_torch = layer(x)
    assert torch.allclose(y_engine, y_torch, rtol=1e-4, atol=1e-5)
    assert torch.allclose(y_torch, x @ layer.dequantize().T + layer.bias, atol=1e-5)
    stored = L.CHECKPOINT.write(layer, L.lattice_config("D4", 3.0, 20.0, 32, 3))
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
    registry.save_quantized(tiny_model, tmp_path / "ckpt", "lattice", quantization_config=config)
    loaded = registry.load_quantized(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(ids), out)
    # Any field of the quantization_config in config.json changed, or one removed: refused.
    path = tmp_path / "ckpt" / "config.json"
    raw = json.loads(path.read_text())
    changed = {"quant_method": "gptq", "lattice": "D4", "bps": 3.5, "snr_db": 21.0, "substream": 256,
               "rice_k_max": 6, "rotation": "none", "tile": 64, "seed": 4}
    assert set(changed) == set(config)
    edits = [{**config, field: value} for field, value in changed.items()]
    for qcfg in edits + [{key: v for key, v in config.items() if key != "lattice"}]:
        path.write_text(json.dumps({**raw, "quantization_config": qcfg}))
        with pytest.raises(ValueError, match="is not the one its tensors were written with"):
            registry.load_quantized(tmp_path / "ckpt")


CORRUPT = ("stream checksum mismatch|offsets are corrupt|must start at bit 0|bits above|does not match a payload|"
           "do not fit|header says|must be|tile")


def small_layer():
    """A [8, 128] D4 layer: 1024 symbols in two sub-streams, 64-input rotation tiles."""
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(7)) * 0.05
    layer = L.quantize_weight(w, "D4", 20.0, tile=64, seed=3)
    return layer, L.lattice_config("D4", 3.0, 20.0, 64, 3)


def read(parts, config):
    """What load_quantized does with one layer: the config validated (once per checkpoint), then the layer read."""
    return L.CHECKPOINT.read(parts, L.CHECKPOINT.validate(config))


def test_every_flipped_byte_is_refused():
    layer, config = small_layer()
    parts = L.CHECKPOINT.write(layer, config)
    assert set(parts) == {"payload", "offsets", "rice_ks", "scales", "signs", "header"}
    assert torch.equal(read(parts, config).dequantize(), layer.dequantize())
    for name, tensor in parts.items():
        raw = tensor.contiguous().view(torch.uint8).reshape(-1)
        for i in range(raw.numel()):
            for mask in (0x01, 0x80):
                flipped = raw.clone()
                flipped[i] ^= mask
                bad = {**parts, name: flipped.view(tensor.dtype).reshape(tensor.shape)}
                with pytest.raises(ValueError, match=CORRUPT):
                    read(bad, config)


def test_config_fields_that_change_the_meaning_are_refused_by_the_format():
    """Below the checkpoint's config digest: what the layer itself refuses (a checkpoint without the digest, a layer
    read on its own)."""
    layer, config = small_layer()
    parts = L.CHECKPOINT.write(layer, config)
    for field, value in (("quant_method", "gptq"), ("substream", 256), ("rice_k_max", 6), ("rotation", "none"),
                         ("lattice", ["D4"]), ("tile", True), ("tile", 48)):
        with pytest.raises(ValueError, match=f"field '{field}' must be"):
            read(parts, {**config, field: value})
    for field in ("quant_method", "lattice", "tile", "substream", "rice_k_max", "rotation"):
        with pytest.raises(ValueError, match=f"field '{field}' must be"):
            read(parts, {key: v for key, v in config.items() if key != field})
    for name in ("E8", "A2", "Z"):                    # the stream's checksum covers its lattice
        with pytest.raises(ValueError, match="stream checksum mismatch"):
            read(parts, {**config, "lattice": name})
    for tile in (32, 128):
        with pytest.raises(ValueError, match="is not the config's tile"):
            read(parts, {**config, "tile": tile})
        with pytest.raises(ValueError, match="the config says D4 with tile"):
            L.CHECKPOINT.write(layer, {**config, "tile": tile})
    # bps, snr_db and seed record how the layer was made; its bits do not depend on them.
    same = read(parts, {**config, "bps": 3.5, "snr_db": 21.0, "seed": 4})
    assert torch.equal(same.dequantize(), layer.dequantize())
