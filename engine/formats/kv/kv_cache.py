"""KV-cache quantization: the hook every KV quantizer speaks, its bit accounting, and HyperQuant's lattice cache.

The hook (engine/qwen3.py, `model.set_kv_transform(fn, window=R)`): fn(k, v, layer, start) gets the exact K (after
RoPE) and V [B, kv_heads, n, d] of the positions start.. that it has not coded yet and returns the coded K/V of the
first m of them (n rounded down to whole blocks of `block` tokens); the model attends from query t to position s
through the exact K/V if t - s < R (the residual window of recent tokens, bf16 in a real cache), through the coded
ones otherwise. With `exact_keys` F the keys of positions < F are never coded (the first block's keys kept exact;
HyperQuant's protocol keeps both, with R = 32; the paper's text at hand names no block size, so F is a count of
tokens, 32 in the tables: one window's length). A quantizer that codes a block of tokens jointly needs R >= block - 1,
or a query would see a block holding a later token. Prefill and generate run the same arithmetic: a cache codes
each block once, when its last token arrives.

Bits, counted honestly: coded_bps = every bit stored for the coded scalars (codes, scales, zeros, stream headers)
per coded scalar. The cache of L positions at the end of a forward holds the exact K of positions < F or >= L - R and
the exact V of positions >= L - R at 16 bits (bf16), the rest coded:

    total_bps = (16 * exact + coded_bps_K * coded_K + coded_bps_V * coded_V) / (exact + coded_K + coded_V)

summed over the forwards' caches (the KL table's one forward per batch: the cache at the evaluated length, so a
window of 32 is a quarter of a 128-token cache). The exact positions hold the model's own values (float32 here);
their bits are bf16's.

HyperQuant's lattice KV: per head vector x [d] (K after RoPE, V): a rotation S drawn once per layer (none, random
signs diag(+-1), or Haar "qjl" S ~ Uniform(O(d))), a per-vector scale alpha = rms(S x) kept in f16, then x_hat = S^T
alpha beta Q(S x / (alpha beta)) with Q the lattice quantizer (engine.formats.lattice) and beta from the rate table's
SNR for the target bps. Subtractive dither (optional): x_hat = S^T (Q(y + U) - U) with U ~ Uniform(Voronoi cell)
drawn fresh on every call; by the Crypto Lemma the error -pi(y + U) is uniform on the cell and independent of x, so
E_U <q, x_hat> = <q, x> for every single x, not only on average over S. Its codes are stripped and Rice-coded
exactly as a weight's would be (engine.coding.rice.rice_bits: the bits the encoder would emit, without building the
stream), plus 40 bits per 512-symbol sub-stream and 16 bits per vector for alpha. The scale alpha beta is rounded
to float32 once and the points are codes * axis * scale in float32, what the Triton decoder computes: a cache that
stores the streams (engine/formats/kv/kv_store.py: encode / pack there, unpack / decode back) reads exactly these
values back (in the rotated basis, attention rotating each query and output instead: equal up to float rounding).

The formats real engines use (FP8, llama.cpp's q8_0 / q4_0, KIVI) are in engine/formats/kv/kv_baselines.py.
"""
import numpy as np
import torch

from ...coding.rice import ESCAPE, RAW_BITS, STREAM_META_BITS, SUBSTREAM, decode_lockstep, rice_bits, rice_encode
from ...kernels import stream_decoders
from ..lattice import lattice_scale, snr_for_rate
from ..numerics.lattices import get_lattice


# ---- the hook and its bits ---------------------------------------------------------------------------------------

EXACT_BITS = 16             # a position kept exact is stored as bf16
RESIDUAL_WINDOW = 32        # HyperQuant's protocol: the last 32 tokens in bf16


class KVHook:
    """The windowed KV hook and its bit accounting, shared by every KV quantizer. A subclass sets `block` (tokens
    coded jointly) and gives encode(x, layer, which) -> codes (a dict of tensors [B, kv_heads, n', ...] whose axis 2
    runs over tokens, n' = n or n / block: what a cache stores; it calls self.count(which, scalars, bits) with every
    bit of them) and decode(codes, layer, which) -> x_hat [B, kv_heads, n, d], for x [B, kv_heads, n, d] (n a
    multiple of block; which 0 for K, 1 for V). quantize is decode(encode(x)). pack / unpack turn codes into the
    bytes of a stored cache's pages and back (engine/formats/kv/kv_store.py): by default each tensor's bytes, token
    by token, so that pages append along the token axis. decode_at_once: decode's temporaries are a few bytes per
    value, so a stored cache decodes all of a layer's pages in one call (else a bounded number at a time)."""
    block = 1
    decode_at_once = False

    def __init__(self, window=0, exact_keys=0):
        for name, value in (("window", window), ("exact_keys", exact_keys)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if exact_keys % self.block:
            raise ValueError(f"exact_keys={exact_keys} must be a multiple of the {self.block}-token block")
        self.window, self.exact_keys = window, exact_keys
        self.coded = [[0, 0], [0, 0]]            # K, V: [scalars coded, bits stored for them]
        self.cache = [0, 0, 0]                   # scalars in the forwards' final caches: exact, coded K, coded V

    def adopt(self, cfg):
        """Called when installed on a model (its Qwen3Config): a format whose layout depends on it settles it."""

    def check_head_dim(self, d):
        """ValueError if heads of d values cannot be coded (checked from a model's config before it loads)."""

    def basis(self, d, which, layer=0):
        """None, or m [d, d] orthogonal float32 with decode(codes) = decode_in_basis(codes) @ m for heads of d values
        (a linear map after the codes are read, such as a rotation back): a stored cache then reads its pages with
        decode_in_basis, puts its few exact values in the basis too (x @ m^T), and attention rotates each query and
        output by m instead of each position."""
        return None

    def decode_into(self, codes, out, layer=0, which=0, in_basis=False):
        """out[...] = decode(codes) (decode_in_basis with in_basis): how a stored cache reads its pages into its
        buffer. A format that can write its values straight into out overrides it (one pass over a long cache, not
        two)."""
        out.copy_((self.decode_in_basis if in_basis else self.decode)(codes, layer, which))

    def count(self, which, scalars, bits):
        self.coded[which][0] += scalars
        self.coded[which][1] += bits

    def quantize(self, x, layer=0, which=0):
        """x [B, kv_heads, n, d] -> the values its codes decode to (x's dtype)."""
        return self.decode(self.encode(x, layer, which), layer, which).to(x.dtype)

    def encode_call(self, k, v, layer, start):
        """One call of the hook on k, v [B, kv_heads, n, d] of positions start.. -> (m, exact, k_codes, v_codes): the
        first m = n // block * block positions are coded, the keys of the first `exact` of them kept exact (those
        before exact_keys); k_codes covers positions start + exact .. start + m, v_codes start .. start + m (None
        when empty)."""
        b, h, n, d = k.shape
        self._count_cache(b * h * d, start + n)
        m = n // self.block * self.block
        exact = min(max(self.exact_keys - start, 0), m)
        k_codes = self.encode(k[:, :, exact:m], layer, 0) if m > exact else None
        return m, exact, k_codes, self.encode(v[:, :, :m], layer, 1) if m else None

    def __call__(self, k, v, layer_index, start):
        """k, v [B, kv_heads, n, d] of positions start..start+n-1 -> coded k, v of the first n // block * block."""
        m, exact, k_codes, v_codes = self.encode_call(k, v, layer_index, start)
        k_hat = k[:, :, exact:m] if k_codes is None else self.decode(k_codes, layer_index, 0).to(k.dtype)
        v_hat = v[:, :, :m] if v_codes is None else self.decode(v_codes, layer_index, 1).to(v.dtype)
        return torch.cat((k[:, :, :exact], k_hat), 2), v_hat

    def _count_cache(self, per_position, length):
        exact_k, exact_v = min(length, self.window + self.exact_keys), min(length, self.window)
        self.cache[0] += per_position * (exact_k + exact_v)
        self.cache[1] += per_position * (length - exact_k)
        self.cache[2] += per_position * (length - exact_v)

    def pack(self, codes):
        """codes -> {name: uint8 array}: the bytes one page of the stored cache holds."""
        return {name: _token_major(t) for name, t in codes.items()}

    def unpack(self, pages, like):
        """{name: uint8 array of every page's bytes}, like (codes of one page: dtypes and shapes) -> the codes."""
        return {name: _from_token_major(pages[name], t) for name, t in like.items()}

    def unpack_many(self, items, **options):
        """unpack for several parts [(pages, like)]: a format whose parts decode faster together merges them."""
        return [self.unpack(pages, like, **options) for pages, like in items]

    def report(self):
        """coded_bps (bits per coded scalar, everything stored with the codes included), total_bps (the caches'
        average with the exact positions at 16 bits; = coded_bps when quantize was called directly), vs_bf16, and
        exact_fraction (of the cache's scalars)."""
        (n_k, bits_k), (n_v, bits_v) = self.coded
        coded = (bits_k + bits_v) / max(n_k + n_v, 1)
        exact, c_k, c_v = self.cache
        stored = exact + c_k + c_v
        total = coded if stored == 0 else (EXACT_BITS * exact + bits_k / max(n_k, 1) * c_k
                                           + bits_v / max(n_v, 1) * c_v) / stored
        return {"coded_bps": coded, "total_bps": total, "vs_bf16": total / 16,
                "exact_fraction": exact / max(stored, 1)}


def _token_major(t):
    """[B, H, n', ...] -> its bytes with the token axis first (uint8 NumPy), so that pages concatenate."""
    return t.movedim(2, 0).contiguous().reshape(-1).view(torch.uint8).numpy()


def _from_token_major(data, like):
    """Inverse of _token_major for tensors shaped as `like` but for the token axis (a copy, not a view of data)."""
    flat = torch.from_numpy(data.copy()).view(like.dtype)
    return flat.reshape(-1, like.shape[0], like.shape[1], *like.shape[3:]).movedim(0, 2)


def install(model, quantizer):
    """Put a KVHook on the model's attention (weights untouched); returns it (see .report())."""
    quantizer.adopt(model.cfg)
    model.set_kv_transform(quantizer, window=quantizer.window)
    return quantizer


# ---- HyperQuant's lattice KV ----------------------------------------------------------------------------------

ROTATIONS = ("none", "signs", "qjl")
SEEDS = 2 ** 32             # seeds 0 .. 2^32 - 1: what they derive (seed * 1009 + layer...) fits torch's generator


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


class KVQuantizer(KVHook):
    """HyperQuant's lattice KV (see the module docstring): every head vector (last dim) is rotated (none / signs /
    Haar "qjl", drawn once per layer from `seed`), scaled by its rms alpha (kept in f16), quantized to the lattice at
    the SNR of the target rate (optionally with subtractive dither, fresh each call) and rotated back. `stats`
    counts coded scalars and bits (Rice payload, sub-stream metadata, alphas). window (default the paper's 32 recent
    tokens in bf16; 0 codes every position) / exact_keys: see KVHook."""

    def __init__(self, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0, window=RESIDUAL_WINDOW,
                 exact_keys=0):
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS:
            raise ValueError(f"seed={seed!r}: must be an integer from 0 to 2**32 - 1")
        super().__init__(window, exact_keys)
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

    def _scale(self, alpha):
        """alpha (f16) -> the float32 scale alpha beta (1 where alpha is 0) that codes are multiplied by."""
        return torch.where(alpha > 0, alpha.double() * self.beta, torch.ones_like(alpha, dtype=torch.float64)).float()

    def check_head_dim(self, d):
        if d % self.lat.n:
            raise ValueError(f"head_dim {d} is not a multiple of {self.lat.name}'s dimension {self.lat.n}")

    def encode(self, x, layer=0, which=0):
        """x [B, H, n, d] -> {"symbols": int16 (int32 if one needs it) [B, H, n, d] (the lattice codes stripped to
        the Rice coder's symbols), "alpha": f16 [B, H, n, 1]} (+ "dither": the noise U, float64, never stored); d
        must be a multiple of the lattice dimension."""
        d, n = x.shape[-1], self.lat.n
        self.check_head_dim(d)
        s = self._rotation(layer, which, d)
        y = x.double() if s is None else x.double() @ s.T
        alpha = y.pow(2).mean(-1, keepdim=True).sqrt().half()
        z = (y / self._scale(alpha).double()).reshape(*y.shape[:-1], d // n, n)
        codes = {"alpha": alpha}
        if self.dither:
            codes["dither"] = voronoi_dither(z.shape[:-1], self.lat, self.noise)
            z = z + codes["dither"]
        symbols = self.lat.strip(self.lat.closest_point(z).reshape(-1, n))
        self._count_codes(symbols, d, which)
        small = symbols.numel() == 0 or int(symbols.max()) < 1 << 15          # nearly always: half the tail's bytes
        codes["symbols"] = symbols.reshape(x.shape).to(torch.int16 if small else torch.int32)
        return codes

    def basis(self, d, which, layer=0):
        """The layer's rotation S (float32; None unrotated): decode is decode_in_basis(codes) @ S. A dithered cache
        has none (its noise is subtracted in float64 before the rotation)."""
        s = None if self.dither else self._rotation(layer, which, d)
        return None if s is None else s.float()

    def decode_in_basis(self, codes, layer=0, which=0):
        """codes (encode's, or unpack's with "points" already decoded by the kernel) -> y_hat [B, H, n, d], the
        rotated vector's estimate (float64 when dithered, else float32): points = codes * axis * scale in float32,
        as the Triton decoder computes them."""
        if "points" in codes:
            return codes["points"]
        scale = self._scale(codes["alpha"])
        shape = codes["symbols"].shape
        points = self.lat.unstrip(codes["symbols"].unflatten(-1, (-1, self.lat.n))).flatten(-2)
        axis = torch.tensor(self.lat.axis * (shape[-1] // self.lat.n))
        if "dither" in codes:
            return (points * axis.double() - codes["dither"].reshape(shape)) * scale.double()
        if set(self.lat.axis) == {1.0}:                        # E8, D4, Z: x * 1.0 is x, a pass over the values saved
            return points.float() * scale
        return points.float() * axis * scale

    def decode(self, codes, layer=0, which=0):
        """codes -> x_hat [B, H, n, d] (float64 when rotated or dithered, else float32): decode_in_basis, rotated
        back by S^T in float64."""
        y_hat = self.decode_in_basis(codes, layer, which)
        s = self._rotation(layer, which, y_hat.shape[-1])
        return y_hat if s is None else y_hat.double() @ s

    def _count_codes(self, symbols, d, which):
        scalars = symbols.numel()
        payload = rice_bits(symbols, self.lat.levels)
        metadata = STREAM_META_BITS * -(-scalars // SUBSTREAM) + 16 * (scalars // d)        # + alphas
        self.stats["scalars"] += scalars
        self.stats["payload_bits"] += payload
        self.stats["metadata_bits"] += metadata
        self.count(which, scalars, payload + metadata)

    def pack(self, codes):
        """A page: the symbols as Rice sub-streams (page-local start bits, the page's bit count), the alphas."""
        if "dither" in codes:
            raise ValueError("a dithered lattice cache cannot be stored: its noise U is drawn, not kept")
        if codes["symbols"].numel() % SUBSTREAM:
            raise ValueError(f"a page of {codes['symbols'].numel()} symbols is not whole {SUBSTREAM}-symbol "
                             "sub-streams")
        streams = rice_encode(codes["symbols"].reshape(-1), self.lat.levels)
        return {"payload": streams.payload.numpy(), "offsets": streams.offsets.numpy().view(np.uint8),
                "rice_ks": streams.rice_ks.numpy(), "bits": np.array([streams.total_bits], np.int64).view(np.uint8),
                "alpha": _token_major(codes["alpha"])}

    def unpack(self, pages, like, kernel=False):
        """Every page's sub-streams decoded in one lockstep (NumPy, or the Triton decoder with kernel=True, which
        also multiplies the points out: "points" instead of "symbols")."""
        return self.unpack_many([(pages, like)], kernel)[0]

    def unpack_many(self, items, kernel=False):
        """unpack for several parts [(pages, like)] (a layer's K and V) in ONE lockstep: its 512 steps cost the same
        for one sub-stream as for thousands, so parts decoded together cost what one does."""
        payloads, offsets, ends, rice_ks, scales, shapes, per_pages, alphas, bit = [], [], [], [], [], [], [], [], 0
        for pages, like in items:
            first_bit = bit + 8 * pages.starts["payload"]
            starts = pages["offsets"].view(np.int32).astype(np.int64)
            per_page = np.diff(pages.starts["offsets"] // 4, append=starts.size)      # sub-streams of each page
            starts += np.repeat(first_bit, per_page)                                   # bits in the whole payload
            stops = np.append(starts[1:], 0)                                           # the next sub-stream's start,
            stops[np.cumsum(per_page) - 1] = first_bit + pages["bits"].view(np.int64)  # or the page's end
            alpha = _from_token_major(pages["alpha"], like["alpha"])
            shape = (*alpha.shape[:-1], like["symbols"].shape[-1])
            if kernel:                                  # the scales in the streams' order: page after page
                tokens = (per_page * SUBSTREAM // (shape[0] * shape[1] * shape[-1])).tolist()
                scales += [page.reshape(-1) for page in self._scale(alpha).split(tokens, 2)]
            payloads.append(pages["payload"])
            offsets.append(starts)
            ends.append(stops)
            rice_ks.append(pages["rice_ks"])
            shapes.append(shape)
            per_pages.append(per_page)
            alphas.append(alpha)
            bit += 8 * pages["payload"].size
        payload, offsets, ends = np.concatenate(payloads), np.concatenate(offsets), np.concatenate(ends)
        count = sum(int(p.sum()) for p in per_pages) * SUBSTREAM
        if kernel:
            flat = stream_decoders.lattice_decode(
                torch.from_numpy(payload), torch.from_numpy(offsets.astype(np.int32)),
                torch.from_numpy(np.concatenate(rice_ks)), count, torch.from_numpy(ends), self.lat, torch.cat(scales),
                shapes[0][-1], SUBSTREAM, ESCAPE, RAW_BITS)
        else:
            flat = decode_lockstep(payload, offsets, ends, np.concatenate(rice_ks), count, SUBSTREAM, self.lat.levels,
                                   np.int32)
        key = "points" if kernel else "symbols"
        parts = flat.split([int(p.sum()) * SUBSTREAM for p in per_pages])
        return [{"alpha": alpha, key: _pages_to_tokens(part, per_page, shape)}
                for part, per_page, shape, alpha in zip(parts, per_pages, shapes, alphas)]

    def report(self):
        """KVHook's report and payload_bps (the Rice payload alone, per coded scalar)."""
        return {"payload_bps": self.stats["payload_bits"] / max(self.stats["scalars"], 1), **super().report()}


def _pages_to_tokens(flat, per_page, shape):
    """flat [count]: pages one after another, each [B, H, n_page, d] -> [B, H, n, d] (shape)."""
    b, h, _, d = shape
    sizes = (per_page * SUBSTREAM).tolist()
    return torch.cat([part.reshape(b, h, -1, d) for part in flat.split(sizes)], 2)


def kv_quantize(model, lattice="E8", bps=3.0, rotation="none", dither=False, seed=0, window=RESIDUAL_WINDOW,
                exact_keys=0):
    """Install a KVQuantizer on the model's attention hook (weights untouched); returns it (see .report())."""
    return install(model, KVQuantizer(lattice, bps, rotation, dither, seed, window, exact_keys))
