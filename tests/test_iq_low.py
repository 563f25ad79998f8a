"""llama.cpp's low-bit IQ types (engine/formats/llama_cpp/iq_low.py) as integer grids: codes, per-group scales and an
integer zero point that give, as (code - zero) * scale in float32, gguf-py's and libggml's own dequantize_row_iq*
values bit for bit (signed zeros included), on random blocks whose f16 scales reach zero, subnormals and 65504; the
tables against llama.cpp's declared sizes, gguf-py's copies and the header they were extracted from."""
import ctypes
import importlib.util
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.formats.llama_cpp import iq_low
from test_kquants import libggml

pytestmark = pytest.mark.usefixtures("one_thread")
gg = pytest.importorskip("gguf")

TYPES = tuple(iq_low.DECODERS)
CLIENTS = Path(os.environ.get("ENGINE_CLIENTS", Path.home() / ".cache/engine/clients")) / "llamacpp"
# f16 scales at the edges: zeros of both signs, the smallest subnormal and normal, the largest finite
EDGES = [0.0, -0.0, 2.0 ** -24, -(2.0 ** -14), 65504.0, -65504.0, 1.0, -3.140625]


def random_blocks(kind, n=64, seed=0):
    """n random blocks of `kind`, uint8 [n, bytes], every bit random but the f16 d: normal * 0.01 (finite), the
    first rows EDGES."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, iq_low.BYTES[kind]), generator=g, dtype=torch.uint8)
    d = torch.randn(n, generator=g) * 0.01
    d[:len(EDGES)] = torch.tensor(EDGES)
    bits = d.half().view(torch.int16).int() & 0xFFFF
    if kind == "IQ1_M":                                      # d's 16 bits: the top nibbles of the 4 u16 at 48
        for k in range(4):
            b[:, 49 + 2 * k] = (b[:, 49 + 2 * k] & 15) | (((bits >> 4 * k) & 15) << 4).to(torch.uint8)
    else:
        b[:, 0], b[:, 1] = (bits & 255).to(torch.uint8), (bits >> 8).to(torch.uint8)
    return b


def ours(kind, blocks):
    decode, group, zero = iq_low.DECODERS[kind]
    codes, scale, _ = decode(blocks)
    return ((codes.float().reshape(len(blocks), -1, group) - zero) * scale[..., None]).reshape(len(blocks), -1)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("kind", TYPES)
def test_codes_and_scales_are_gguf_pys_dequantized_values_bit_for_bit(kind):
    blocks = random_blocks(kind)
    theirs = gg.quants.dequantize(blocks.numpy().reshape(-1), gg.GGMLQuantizationType[kind])
    assert same_bits(ours(kind, blocks), torch.from_numpy(np.ascontiguousarray(theirs)).reshape(len(blocks), -1))


@pytest.mark.interop
@pytest.mark.skipif(libggml() is None, reason="llama.cpp's libggml-base (install the llama.cpp client: "
                    "benchmarks/clients.py)")
@pytest.mark.parametrize("kind", TYPES)
def test_codes_and_scales_are_llama_cpps_dequantize_row_bit_for_bit(kind):
    """libggml-base's exported dequantize_row_iq*(blocks, float *y, k), the C reference itself."""
    blocks = random_blocks(kind, seed=1)
    fn = getattr(libggml(), f"dequantize_row_{kind.lower()}")
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    raw = np.ascontiguousarray(blocks.numpy())
    theirs = np.zeros(len(blocks) * iq_low.QK_K, np.float32)
    fn(raw.ctypes.data, theirs.ctypes.data, theirs.size)
    assert same_bits(ours(kind, blocks), torch.from_numpy(theirs).reshape(len(blocks), -1))


@pytest.mark.parametrize("kind", TYPES)
def test_codes_lie_in_zero_to_twice_zero_with_one_scale_and_offset_per_group(kind):
    decode, group, zero = iq_low.DECODERS[kind]
    codes, scale, offset = decode(random_blocks(kind, n=256, seed=2))
    assert codes.dtype == torch.uint8 and codes.shape == (256, iq_low.QK_K)
    assert int(codes.max()) <= 2 * zero and int(codes.max()) == 2 * zero and int(codes.min()) == 0
    assert scale.dtype == torch.float32 and scale.shape == offset.shape == (256, iq_low.QK_K // group)
    assert torch.equal(offset, -zero * scale)


@pytest.mark.parametrize("kind", TYPES)
def test_codes_times_scale_plus_offset_is_exact_too(kind):
    """The engine's affine layer computes code * scale + offset: equal as numbers (+0 where C has -0)."""
    blocks = random_blocks(kind, seed=3)
    decode, group, _ = iq_low.DECODERS[kind]
    codes, scale, offset = decode(blocks)
    w = codes.float().reshape(len(blocks), -1, group) * scale[..., None] + offset[..., None]
    assert torch.equal(w.reshape(len(blocks), -1), ours(kind, blocks))


def test_grid_tables_have_the_sizes_and_levels_llama_cpp_declares():
    """ggml-common.h: GGML_TABLE_BEGIN(uint64_t, iq2xxs_grid, 256) ...; each grid uses only its type's levels."""
    t = iq_low.tables()
    sizes = {"iq2xxs_grid": (256, 8), "iq2xs_grid": (512, 8), "iq2s_grid": (1024, 8), "iq3xxs_grid": (256, 4),
             "iq3s_grid": (512, 4), "iq1s_grid": (2048, 8), "ksigns_iq2xs": (128, 1), "kmask_iq2xs": (8, 1)}
    assert {name: tuple(x.shape) for name, x in t.items()} == sizes
    levels = {"iq2xxs_grid": {8, 25, 43}, "iq2xs_grid": {8, 25, 43}, "iq2s_grid": {8, 25, 43}, "iq1s_grid": {-1, 0, 1},
              "iq3xxs_grid": {4, 12, 20, 28, 36, 44, 52, 62}, "iq3s_grid": set(range(1, 16, 2))}
    for name, values in levels.items():
        assert set(t[name].unique().tolist()) == values, name
    assert t["kmask_iq2xs"][:, 0].tolist() == [1 << j for j in range(8)]
    i = torch.arange(128)
    parity = sum((i >> j) & 1 for j in range(7)) & 1                 # bit 7: an even count of minus signs
    assert torch.equal(t["ksigns_iq2xs"][:, 0].long(), i | (parity << 7))


@pytest.mark.parametrize("kind", TYPES)
def test_grid_tables_are_gguf_pys_copies(kind):
    """gguf-py keeps its own packed copy of each grid (grid_hex, grid_map): the same levels, entry for entry."""
    quant = gg.quants._type_traits[gg.GGMLQuantizationType[kind]]
    quant.init_grid()
    name = {"IQ2_XXS": "iq2xxs_grid", "IQ2_XS": "iq2xs_grid", "IQ2_S": "iq2s_grid", "IQ3_XXS": "iq3xxs_grid",
            "IQ3_S": "iq3s_grid", "IQ1_S": "iq1s_grid", "IQ1_M": "iq1s_grid"}[kind]
    theirs = torch.from_numpy(np.ascontiguousarray(quant.grid)).reshape(iq_low.tables()[name].shape)
    assert torch.equal(iq_low.tables()[name].float(), theirs)


def test_the_extract_script_reproduces_the_shipped_tables_from_llama_cpps_header(tmp_path):
    """scripts/extract_ggml_iq_grids.py on the ggml-common.h of the llama-cpp-python sdist (benchmarks/clients.py)
    gives the shipped JSON's tables byte for byte."""
    sdists = sorted(CLIENTS.glob("sdist/llama_cpp_python-*.tar.gz"))
    if not sdists:
        pytest.skip("the llama-cpp-python sdist (install the llama.cpp client: benchmarks/clients.py)")
    with tarfile.open(sdists[-1]) as tar:
        member = next((m for m in tar if m.name.endswith("vendor/llama.cpp/ggml/src/ggml-common.h")), None)
        if member is None:
            pytest.skip(f"no ggml-common.h in {sdists[-1].name}")
        header = tar.extractfile(member).read().decode()
    path = Path(__file__).resolve().parents[1] / "scripts" / "extract_ggml_iq_grids.py"
    spec = importlib.util.spec_from_file_location("extract_ggml_iq_grids", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    made = script.to_json(script.parse(header), "ggml/src/ggml-common.h")["tables"]
    shipped = json.loads(iq_low.GRIDS.read_text())["tables"]
    assert made == shipped
