"""HyperQuant weights: lattice quantization (E8, D4, A2, Z) + bit-stripping + Rice sub-streams (engine/coding/rice.py).

The lattices themselves (closest points, integer codes, the strip that drops their parity bits, the order of each
vector's symbols): engine/formats/numerics/lattices.py.

Rate control: a table (data/lattice_snr_bps.json, `python benchmarks/lattice_rate.py calibrate`) maps SNR =
10 log10(sigma^2 / sigma_q^2) (lattice scaled so that G V^(2/n) = sigma_q^2) to Rice bits per scalar on Gaussian
vectors; a target rate picks the SNR by interpolation. "bps" is the Rice payload alone, each sub-stream at its best
rice_k: that accounting reproduces the paper's 3.74 / 3.77 / 3.81 / 3.84 at 21 dB. Offsets and Rice parameters add
40 / 512 = 0.078 bps and per-row scales 16 / in; storage_bits counts them all.

Weights: random signs + Hadamard per tile of inputs, per-row alpha (rms), lattice + strip + Rice. The stream's CRC32
covers the layer's lattice, shape, tile, scales and signs too, so a changed byte, or a config naming another
lattice or tile, is refused (ValueError), never decoded into another model. The KV cache path is
engine/formats/kv/kv_cache.py.
"""
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..coding.rice import (ESCAPE, RAW_BITS, RICE_K_MAX, SUBSTREAM, RiceStreams, rice_bits, rice_decode, rice_encode,
                           stream_ends)
from .numerics.affine import pack_bits, unpack_bits
from ..layers import QuantLinear
from .method import CheckpointMethod, Option, choice_option, config_field, int_option
from .numerics.hadamard import fitting_tile, rotate, rotate_by_product, unrotate
from .numerics.lattices import LATTICES, get_lattice

TABLE_PATH = Path(__file__).resolve().parents[2] / "data" / "lattice_snr_bps.json"


# ---- a lattice's codes as Rice sub-streams ----------------------------------------------------------------------

def encode_codes(codes, lattice, substream=SUBSTREAM, context=b""):
    """Lattice codes [V, n] -> RiceStreams (strip, zig-zag, Rice)."""
    lat = get_lattice(lattice)
    return rice_encode(lat.strip(codes), lat.levels, substream, context)


def decode_codes(streams, lattice):
    """RiceStreams -> lattice codes [V, n] (Rice decode, inverse strip)."""
    lat = get_lattice(lattice)
    return lat.unstrip(rice_decode(streams, lat.levels).reshape(-1, lat.n))


# ---- rate control -----------------------------------------------------------------------------------------------

def lattice_scale(snr_db, lattice):
    """Lattice scale beta for unit-variance data: noise per scalar beta^2 G V^(2/n) = 10^(-SNR/10)."""
    return math.sqrt(10 ** (-snr_db / 10) / get_lattice(lattice).noise_unit)


def gaussian_rate(lattice, snr_db, vectors=100_000, seed=0):
    """(Rice payload bits per scalar, measured SNR in dB) for iid N(0, 1) vectors at the given SNR."""
    lat = get_lattice(lattice)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vectors, lat.n, generator=g, dtype=torch.float64)
    beta = lattice_scale(snr_db, lat)
    codes = lat.closest_point(x / beta)
    err = (codes * torch.tensor(lat.axis, dtype=torch.float64) * beta - x).pow(2).mean()
    return rice_bits(lat.strip(codes), lat.levels) / x.numel(), float(-10 * torch.log10(err))


_TABLE = None


def load_table():
    global _TABLE
    if _TABLE is None:
        if not TABLE_PATH.exists():
            raise ValueError(f"{TABLE_PATH} is missing: run `python benchmarks/lattice_rate.py calibrate`")
        _TABLE = json.loads(TABLE_PATH.read_text())
    return _TABLE


def snr_for_rate(bps, lattice):
    """Target Rice bits per scalar -> SNR in dB, by linear interpolation in the calibration table."""
    lat = get_lattice(lattice)
    table = load_table()
    snrs, rates = table["snr_db"], table["bps"][lat.name]
    if not rates[0] <= bps <= rates[-1]:
        raise ValueError(f"{lat.name} rate {bps} outside the calibrated range [{rates[0]}, {rates[-1]}]")
    return float(np.interp(bps, rates, snrs))


# ---- weights ----------------------------------------------------------------------------------------------------

def rotation_tile(in_features, tile=128):
    """The largest power of two <= tile that divides in_features (the rotation itself: engine.formats.hadamard)."""
    check_tile(tile)
    return fitting_tile([in_features], tile)


def check_tile(tile):
    if type(tile) is not int or tile < 2 or tile & (tile - 1):
        raise ValueError(f"tile must be a power-of-two int >= 2, got {tile!r}")


def layer_context(lattice, in_features, out_features, tile, scales, signs):
    """The side data a layer's stream checksum covers (engine.coding.rice): what its bits mean (lattice, shape,
    rotation tile) and the f16 row scales and sign bits they are decoded with."""
    head = json.dumps([get_lattice(lattice).name, in_features, out_features, tile]).encode()
    return head + scales.numpy().tobytes() + signs.numpy().tobytes()


class LatticeLinear(QuantLinear):
    """A weight stored as Rice sub-streams of stripped lattice codes.

    W' = W R^T (R = H D / sqrt(tile) per tile of inputs, engine.formats.hadamard); row o of W' is cut into vectors
    of n and quantized as scales[o] * code * axis. Stored: the stream (payload, offsets, rice_ks), scales f16 [out],
    signs (1 bit per input), header int64 [in, out, tile, total_bits, crc]; the crc covers all of them. Forward:
    y = (x R^T) W'^T, W' decoded on the fly (CPU lockstep decoder for impl torch, the Triton decoder for engine).
    """

    def __init__(self, streams, scales, signs, lattice, in_features, tile, bias=None):
        lat = get_lattice(lattice)
        check_tile(tile)
        if type(in_features) is not int or in_features <= 0 or in_features % lat.n or in_features % 8 \
                or in_features % tile:
            raise ValueError(f"in_features {in_features!r} must be a positive multiple of 8, of {lat.name}'s "
                             f"n={lat.n} and of the tile {tile}")
        if scales.dtype != torch.float16 or scales.dim() != 1 or signs.dtype != torch.uint8 or signs.dim() != 1:
            raise ValueError(f"scales must be 1-D float16 and signs 1-D uint8, got {scales.dtype} "
                             f"{tuple(scales.shape)} and {signs.dtype} {tuple(signs.shape)}")
        out_f = scales.numel()
        if streams.count != out_f * in_features or signs.numel() * 8 != in_features:
            raise ValueError(f"stream of {streams.count} symbols / {signs.numel() * 8} signs do not fit a "
                             f"[{out_f}, {in_features}] weight")
        if streams.substream != SUBSTREAM:
            raise ValueError(f"a LatticeLinear stores {SUBSTREAM}-symbol sub-streams, got {streams.substream}")
        if not bool((scales.float() > 0).all() & scales.isfinite().all()):
            raise ValueError("lattice row scales must be finite and positive")
        replace(streams, context=layer_context(lat, in_features, out_f, tile, scales, signs)).validate()
        super().__init__(in_features, out_features=out_f, bias=bias)
        self.lattice, self.tile = lat, tile
        self.register_buffer("payload", streams.payload)
        self.register_buffer("offsets", streams.offsets)
        self.register_buffer("rice_ks", streams.rice_ks)
        self.register_buffer("scales", scales)
        self.register_buffer("signs", signs)
        self.register_buffer("header", torch.tensor([in_features, out_f, self.tile, streams.total_bits, streams.crc]))

    def streams(self):
        """The RiceStreams (on the CPU, with this layer's context)."""
        scales, signs = self.scales.cpu(), self.signs.cpu()
        return RiceStreams(self.payload.cpu(), self.offsets.cpu(), self.rice_ks.cpu(), self.in_features *
                           self.out_features, int(self.header[3]), int(self.header[4]), SUBSTREAM,
                           layer_context(self.lattice, self.in_features, self.out_features, self.tile, scales, signs))

    def _signs(self):
        """uint8 [in / 8] (bit set = -1, affine.pack_bits layout) -> signs float32 [in]."""
        return 1.0 - 2.0 * unpack_bits(self.signs, 1, self.in_features).float()

    def rotated_weight(self):
        """W' [out, in] float32 decoded on the CPU."""
        lat = self.lattice
        codes = decode_codes(self.streams(), lat).float() * torch.tensor(lat.axis, dtype=torch.float32)
        w = codes.reshape(self.out_features, self.in_features) * self.scales.cpu().float()[:, None]
        return w.to(self.scales.device)

    def dequantize(self):
        return unrotate(self.rotated_weight(), self._signs(), self.tile)

    @property
    def row_align(self):                    # the Rice sub-streams run across rows: decode_rows decodes all of them
        return self.out_features

    def runtime_input(self, x2d):
        return rotate_by_product(x2d, self._signs().to(x2d.device), self.tile)

    def decode_rows(self, out, start, stop):
        out.copy_(self.rotated_weight()[start:stop])

    def int8_rows(self):
        """(codes int8 [out, in], row scales float32 [out], (signs [in], tile)) with W' = codes * scales[:, None],
        the streams decoded once, W' multiplying the input rotated by (signs, tile) (runtime_forms.Int8RowsLinear);
        or None: A2's two axes differ (sqrt(3) and 1), or a code lies outside int8 (an escaped outlier)."""
        if len(set(self.lattice.axis)) != 1:
            return None
        codes = decode_codes(self.streams(), self.lattice).reshape(self.out_features, self.in_features)
        if bool((codes.abs() > 127).any()):
            return None
        return codes.to(torch.int8), self.scales.cpu().float() * self.lattice.axis[0], (self._signs(), self.tile)

    def kernel_matmul(self, x2d):
        count, ends = self.in_features * self.out_features, stream_ends(self.offsets, int(self.header[3]))
        from ..kernels import stream_decoders      # Triton: imported by the engine path only
        w = stream_decoders.lattice_decode(self.payload, self.offsets, self.rice_ks, count, ends, self.lattice,
                                           self.scales.float(), self.in_features, SUBSTREAM, ESCAPE, RAW_BITS)
        return rotate(x2d, self._signs().to(x2d.device), self.tile) @ w.reshape(self.out_features, -1).T

    def storage_bits(self):
        return 8 * (self.payload.numel() + self.rice_ks.numel() + self.signs.numel()) + 32 * self.offsets.numel() \
            + 16 * self.scales.numel() + 64 * self.header.numel()


ROWS_PER_CHUNK = 1 << 22          # weights whose closest points are found at once (float64 temporaries: ~10x)


def quantize_weight(weight, lattice="E8", snr_db=21.0, tile=128, seed=0, bias=None):
    """weight [out, in] -> LatticeLinear at the given SNR (per row: noise = rms(W' row)^2 10^(-SNR/10))."""
    lat = get_lattice(lattice)
    out_f, in_f = weight.shape
    tile = rotation_tile(in_f, tile)
    g = torch.Generator().manual_seed(seed)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (in_f,), generator=g).float()
    beta = lattice_scale(snr_db, lat)
    scales, codes = [], []
    for rows in weight.detach().split(max(1, ROWS_PER_CHUNK // in_f)):      # bounded memory on large layers
        w = rotate(rows.float(), signs, tile).double()
        s = (w.pow(2).mean(1).sqrt() * beta).half()
        s = torch.where(s > 0, s, torch.ones_like(s))                         # an all-zero row codes to zeros
        codes.append(lat.closest_point((w / s.double()[:, None]).reshape(-1, lat.n)).to(torch.int32))
        scales.append(s)
    scales, codes = torch.cat(scales), torch.cat(codes)
    packed = pack_bits((signs < 0).to(torch.uint8), 1)
    streams = encode_codes(codes, lat, context=layer_context(lat, in_f, out_f, tile, scales, packed))
    return LatticeLinear(streams, scales, packed, lat, in_f, tile, bias)


def lattice_config(lattice, bps, snr_db, tile, seed):
    """The quantization_config of a lattice checkpoint (bps, snr_db and seed record how it was made)."""
    return {"quant_method": "lattice", "lattice": get_lattice(lattice).name, "bps": bps, "snr_db": snr_db,
            "substream": SUBSTREAM, "rice_k_max": RICE_K_MAX, "rotation": "hadamard", "tile": tile, "seed": seed}


def quantize_layer(layer, lattice="E8", bps=3.0, tile=128, seed=0):
    """Quantize the layer's linears (a calibration.LayerCalibration) in place. The target `bps` is the Rice payload
    rate of the Gaussian calibration table; layers report their full storage in bits_per_weight. Each linear gets its
    own rotation: seed + its position among the model's linears in module order (decoder layer i, linear j of n:
    seed + i n + j, the same whether the model is quantized whole or layer by layer). Returns the
    quantization_config."""
    lat = get_lattice(lattice)
    check_tile(tile)
    snr = snr_for_rate(bps, lat)
    names = layer.linear_names()
    seeds = {name: seed + layer.index * len(names) + j for j, name in enumerate(names)}
    layer.replace(lambda name, linear: quantize_weight(linear.weight, lat, snr, tile, seeds[name], linear.bias))
    return lattice_config(lat, bps, snr, tile, seed)


def quantize(model, calibration_ids=None, **options):
    """Quantize every linear but lm_head in place (data-free: calibration_ids is unused)."""
    from .numerics.calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **CHECKPOINT.checked(options))


def validate(config):
    """A lattice quantization_config, checked once per checkpoint: the fields that fix what the bits mean, present
    with their exact types, and this format's constants. Returns it unchanged."""
    config_field(config, "quant_method", None, str, lambda m: m == "lattice", "'lattice'")
    config_field(config, "lattice", None, str, lambda name: name in LATTICES, f"one of {sorted(LATTICES)}")
    config_field(config, "tile", None, int, lambda t: t >= 2 and not t & (t - 1), "a power of two >= 2")
    config_field(config, "substream", None, int, lambda v: v == SUBSTREAM, str(SUBSTREAM))
    config_field(config, "rice_k_max", None, int, lambda v: v == RICE_K_MAX, str(RICE_K_MAX))
    config_field(config, "rotation", None, str, lambda r: r == "hadamard", "'hadamard'")
    return config


_PARTS = ("payload", "offsets", "rice_ks", "scales", "signs", "header")


def _write(layer, config):
    if layer.lattice.name != config["lattice"] or layer.tile != rotation_tile(layer.in_features, config["tile"]):
        raise ValueError(f"layer is {layer.lattice.name} with tile {layer.tile}, the config says {config['lattice']} "
                         f"with tile {config['tile']}")
    return {name: getattr(layer, name) for name in _PARTS}


def _read(parts, config):
    header = parts["header"]
    if header.dtype != torch.int64 or tuple(header.shape) != (5,):
        raise ValueError(f"header must be int64 [5], got {header.dtype} {tuple(header.shape)}")
    in_f, out_f, layer_tile, total_bits, crc = header.tolist()
    if parts["scales"].numel() != out_f:
        raise ValueError(f"header says {out_f} rows, scales has {parts['scales'].numel()}")
    streams = RiceStreams(parts["payload"], parts["offsets"], parts["rice_ks"], in_f * out_f, total_bits, crc)
    layer = LatticeLinear(streams, parts["scales"], parts["signs"], config["lattice"], in_f, layer_tile,
                          parts.get("bias"))
    if layer_tile != rotation_tile(in_f, config["tile"]):
        raise ValueError(f"header tile {layer_tile} is not the config's tile {config['tile']} for {in_f} inputs")
    return layer


def _rules(options):
    check_tile(options.get("tile", 128))
    snr_for_rate(options.get("bps", 3.0), options.get("lattice", "E8"))        # the rate each lattice's table covers


OPTIONS = {"lattice": choice_option("E8", LATTICES), "tile": int_option(128, 2, 1 << 16),
           "bps": Option(3.0, lambda b: isinstance(b, (int, float)) and not isinstance(b, bool),
                         "a number of bits per scalar in the lattice's calibrated range"),
           "seed": int_option(0, 0, (1 << 63) - 1)}
CHECKPOINT = CheckpointMethod(name="lattice", parts=lambda config: _PARTS, read=_read, write=_write,
                              quantize=quantize, validate=validate, quantize_layer=quantize_layer, options=OPTIONS,
                              rules=_rules)
