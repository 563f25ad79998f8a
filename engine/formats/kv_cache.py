"""HyperQuant's KV cache: every head vector lattice-quantized as it enters the cache (weights untouched).

Per head vector x [d] (K after RoPE, V): a rotation S drawn once per layer (none, random signs diag(+-1), or Haar
"qjl" S ~ Uniform(O(d))), a per-vector scale alpha = rms(S x) kept in f16, then x_hat = S^T alpha beta Q(S x / (alpha
beta)) with Q the lattice quantizer (engine.formats.lattice) and beta from the rate table's SNR for the target bps.
Subtractive dither (optional): x_hat = S^T (Q(y + U) - U) with U ~ Uniform(Voronoi cell) drawn fresh on every call;
by the Crypto Lemma the error -pi(y + U) is uniform on the cell and independent of x, so E_U <q, x_hat> = <q, x> for
every single x, not only on average over S.

Rate: each call's codes are stripped and Rice-coded exactly as a weight would be (engine.coding.rice.rice_bits:
the bits the encoder would emit, without building the stream), plus 40 bits per 512-symbol sub-stream and 16 bits
per vector for alpha; `report()` gives payload and total bits per scalar.
"""
import torch

from ..coding.rice import STREAM_META_BITS, SUBSTREAM, rice_bits
from .lattice import get_lattice, lattice_scale, snr_for_rate

ROTATIONS = ("none", "signs", "qjl")


def haar_orthogonal(n, generator):
    """A Haar-uniform orthogonal matrix [n, n]: QR of a Gaussian matrix with R's diagonal signs moved into Q."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def voronoi_dither(shape, lattice, generator):
    """U [..., n] ~ Uniform(Voronoi cell of the unscaled lattice, real coordinates): uniform in a box of side
    period * axis (it tiles space by a sublattice), then reduced mod the lattice."""
    lat = get_lattice(lattice)
    axis = torch.tensor(lat.axis, dtype=torch.float64)
    u = torch.rand(*shape, lat.n, generator=generator, dtype=torch.float64) * lat.period * axis
    return u - lat.closest_point(u) * axis


class KVQuantizer:
    """fn(k, v, layer_index) -> (k_hat, v_hat) for `model.set_kv_transform`: every head vector (last dim) is
    rotated (none / signs / Haar "qjl", drawn once per layer from `seed`), scaled by its rms alpha (kept in f16),
    quantized to the lattice at the SNR of the target rate (optionally with subtractive dither, fresh each call)
    and rotated back. `stats` counts scalars and coded bits (Rice payload, sub-stream metadata, alphas)."""

    def __init__(self, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0):
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
        self.lat = get_lattice(lattice)
        self.bps, self.rotation, self.dither, self.seed = bps, rotation, dither, seed
        self.beta = lattice_scale(snr_for_rate(bps, self.lat), self.lat)
        self.rotations = {}
        self.noise = torch.Generator().manual_seed(seed + 1_000_003)
        self.stats = {"scalars": 0, "payload_bits": 0, "metadata_bits": 0}

    def _rotation(self, layer, which, d):
        key = (layer, which)
        if key not in self.rotations:
            g = torch.Generator().manual_seed(self.seed * 1009 + 2 * layer + which)
            if self.rotation == "qjl":
                self.rotations[key] = haar_orthogonal(d, g)
            elif self.rotation == "signs":
                self.rotations[key] = torch.diag(1.0 - 2.0 * torch.randint(0, 2, (d,), generator=g).double())
            else:
                self.rotations[key] = None
        return self.rotations[key]

    def quantize(self, x, layer=0, which=0):
        """x [..., d] -> x_hat [..., d] (same dtype); d must be a multiple of the lattice dimension."""
        d, n = x.shape[-1], self.lat.n
        if d % n:
            raise ValueError(f"head_dim {d} is not a multiple of {self.lat.name}'s dimension {n}")
        s = self._rotation(layer, which, d)
        y = x.double() if s is None else x.double() @ s.T
        alpha = y.pow(2).mean(-1, keepdim=True).sqrt().half().double()
        scale = torch.where(alpha > 0, alpha * self.beta, torch.ones_like(alpha))
        axis = torch.tensor(self.lat.axis, dtype=torch.float64)
        z = (y / scale).reshape(*y.shape[:-1], d // n, n)
        u = voronoi_dither(z.shape[:-1], self.lat, self.noise) if self.dither else torch.zeros_like(z)
        codes = self.lat.closest_point(z + u)
        y_hat = (codes * axis - u).reshape(y.shape) * scale
        self._count(codes, d)
        x_hat = y_hat if s is None else y_hat @ s
        return x_hat.to(x.dtype)

    def _count(self, codes, d):
        scalars = codes.numel()
        self.stats["scalars"] += scalars
        self.stats["payload_bits"] += rice_bits(self.lat.strip(codes.reshape(-1, self.lat.n)), self.lat.levels)
        self.stats["metadata_bits"] += STREAM_META_BITS * -(-scalars // SUBSTREAM) + 16 * (scalars // d)  # + alphas

    def __call__(self, k, v, layer_index):
        return self.quantize(k, layer_index, 0), self.quantize(v, layer_index, 1)

    def report(self):
        """Coded KV rate: payload and total bits per scalar, and the total as a fraction of bf16."""
        n = max(self.stats["scalars"], 1)
        total = (self.stats["payload_bits"] + self.stats["metadata_bits"]) / n
        return {"payload_bps": self.stats["payload_bits"] / n, "total_bps": total, "vs_bf16": total / 16}


def kv_quantize(model, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0):
    """Install a KVQuantizer on the model's attention hook (weights untouched); returns it (see .report())."""
    fn = KVQuantizer(lattice, bps, rotation, dither, seed)
    model.set_kv_transform(fn)
    return fn
