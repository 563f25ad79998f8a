"""HyperQuant's KV cache (engine/formats/kv_cache.py): subtractive dither makes every inner product unbiased, the
dither is uniform on the Voronoi cell, and the quantizer works through the model's attention hook with its bits
counted."""
import math

import pytest
import torch

from engine.coding import rice
from engine.formats import kv_cache
from engine.formats.lattice import LATTICES


def inner_product_errors(quantizer, x, q, draws):
    x_hat = quantizer.quantize(x.expand(draws, -1).contiguous())
    return (x_hat - x) @ q


@pytest.mark.parametrize("rotation", ["none", "qjl"])
def test_dither_makes_inner_products_unbiased(rotation):
    g = torch.Generator().manual_seed(4)
    x, q = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    draws = 4000
    dithered = inner_product_errors(kv_cache.KVQuantizer("E8", 2.0, rotation, dither=True, seed=1), x, q, draws)
    bound = 4 * dithered.std() / math.sqrt(draws)
    assert abs(float(dithered.mean())) < bound
    # Without dither the error is the same on every call: a fixed bias. Measured along its own direction.
    plain = kv_cache.KVQuantizer("E8", 2.0, rotation, dither=False, seed=1)
    err = plain.quantize(x[None])[0] - x
    fixed = inner_product_errors(plain, x, err, 50)
    assert float(fixed.max() - fixed.min()) < 1e-9 and float(fixed.mean()) > bound * err.norm() / q.norm()


def test_haar_rotation_is_orthogonal_and_not_a_sign_flip():
    s = kv_cache.haar_orthogonal(16, torch.Generator().manual_seed(0))
    assert torch.allclose(s @ s.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    assert float((s.abs() > 1e-6).sum()) > 16 * 8


@pytest.mark.parametrize("name", list(LATTICES))
def test_dither_is_uniform_on_the_voronoi_cell(name):
    lat = LATTICES[name]
    u = kv_cache.voronoi_dither((100_000 // lat.n,), name, torch.Generator().manual_seed(6))
    assert torch.equal(lat.closest_point(u), torch.zeros_like(u, dtype=torch.long))
    second = u.pow(2).sum(1).mean() / lat.n
    assert abs(float(second) / lat.noise_unit - 1) < 0.02


def test_kv_quantizer_through_the_attention_hook(tiny_model):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_model(ids)
    kv = kv_cache.kv_quantize(tiny_model, "E8", 3.0, rotation="signs", dither=True, seed=2)
    with torch.no_grad():
        out = tiny_model(ids)
    assert 0 < float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 0.05
    report = kv.report()
    # 2 layers x (K, V), each [2, 2 kv heads, 32, 16]: 2048 scalars in 4 sub-streams, 128 vectors with an alpha
    assert kv.stats["scalars"] == 4 * 2048
    assert kv.stats["metadata_bits"] == 4 * (4 * rice.STREAM_META_BITS + 128 * 16)
    assert 2.9 < report["payload_bps"] < 3.3 and report["vs_bf16"] == report["total_bps"] / 16
    assert report["total_bps"] == report["payload_bps"] + kv.stats["metadata_bits"] / kv.stats["scalars"]


def test_kv_quantizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rotation must be one of"):
        kv_cache.KVQuantizer("E8", 3.0, rotation="haar")
    with pytest.raises(ValueError, match="lattice must be one of"):
        kv_cache.KVQuantizer("E7", 3.0)
    with pytest.raises(ValueError, match="not a multiple of E8's dimension 8"):
        kv_cache.KVQuantizer("E8", 3.0).quantize(torch.zeros(2, 12))
