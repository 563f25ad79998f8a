"""The KV-cache formats the engines people use, as quantizers on the model's KV hook (engine/formats/kv/kv_cache.py:
the hook, the residual window and the bit accounting).

  format  engine                                    stored                                          bits / scalar
  fp8     vLLM kv_cache_dtype="fp8" (E4M3)          E4M3 codes + an f32 scale per layer's K (V),    8 + 32 / scale
                                                    or one per KV head
  q8_0    llama.cpp --cache-type-k/-v q8_0          per 32 values along head_dim: f16 d, 32 int8    8.5
  q4_0    llama.cpp --cache-type-k/-v q4_0          per 32: f16 d, 16 B of nibbles, x = d (q - 8)   4.5
  kivi    KIVI (Liu et al., 2024), 2 or 4 bits      K per channel over G tokens, V per token over   b + 32 / G
                                                    G channels: codes + f16 scale + f16 zero

FP8: x_hat = E4M3(x / s) s with s = amax / 448. vLLM takes s from the checkpoint or calibrates it on the first batch
(calculate_kv_scales); here it is each call's own amax over the layer's K (or V), or over each head: the data-free
choice, slightly optimistic (no clipping ever happens), and in generate each step's tokens get their own scale.

q8_0 / q4_0 are llama.cpp's reference encoders (quantize_row_q8_0_ref / q4_0_ref, in float32, which its CUDA copy
kernels match; the engine's one port of them is llama_cpp/ggml_quants.py) writing GGML blocks, decoded as
llama_cpp/ggml.py decodes them (dequantize_blocks: the same arithmetic over a whole layer's blocks at once), so the
grid is GGUF's bit for bit:
    q8_0: d = amax / 127, q = roundf(x / d) (halves away from 0)
    q4_0: d = m / -8 (m the value of largest |x|), q = min(15, trunc(x / d + 8.5))
(llama.cpp quantizes V this way only with flash attention; without it V stays f16.) llama.cpp (since its PR 21038,
in the version benchmarks/clients.py builds) rotates each head before a quantized cache stores it: K in chunks of
the largest power of two >= 64 dividing head_dim, V in chunks of 64, by the orthonormal Sylvester Hadamard matrix
H / sqrt(n) (its own inverse; Q gets the same rotation, the attention output V's back), when head_dim is a multiple
of 64 (LLAMA_ATTN_ROT_DISABLE=1 turns it off): rotation "hadamard" (the default) does the same (on SmolLM2 it cuts
q4_0's KL by 2.3-2.6x, in llama.cpp and here), and a stored cache is read as llama.cpp reads it, Q and the output
rotated (GGMLKV.basis), not every position. Which 32 values share a block depends on the model's RoPE in llama.cpp:
Qwen2 / Qwen3 rotate the halves of a head (NEOX, as transformers), so a block is 32 consecutive values as here; for
Llama its converter permutes q_proj / k_proj so that each rotated pair is adjacent (element 2i = transformers' i,
2i + 1 = i + d / 2) and K's blocks are cut in that order, which keeps a pair's two values (one frequency) in one
block. key_order "interleaved" codes K that way ("auto": as llama.cpp would for the model it is installed on).

KIVI: asymmetric b-bit, x_hat = q s + z, z = min, s = (max - min) / (2^b - 1), both f16, q = clamp(round((x - z) /
s)); K grouped per channel over G consecutive tokens (so blocks of G tokens are coded together), V per token over
min(G, head_dim) channels. KIVI keeps the most recent tokens in full precision; here that is the hook's sliding
window (>= G - 1 tokens), where KIVI's own residual fills up to R tokens and is then quantized as a whole.
"""
import functools
import warnings

import torch

from ..llama_cpp import ggml_quants
from ..numerics.affine import pack_bits, unpack_bits
from ..numerics.hadamard import fwht
from ..numerics.minifloats import E4M3_MAX, round_e4m3
from .kv_cache import RESIDUAL_WINDOW, KVHook, install

FP8_SCALES = ("tensor", "head")
GGML_KV = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
GGML_KV_VALUES = {"q8_0": 34, "q4_0": 18}          # bytes of a 32-value block
KEY_ORDERS = ("auto", "halves", "interleaved")
QK = 32                    # values per GGML block
COMPILE_FROM = 1 << 20     # values decoded at once from which the compiled decode (seconds to build, once) pays


def _check_head_dim(d, multiple, what):
    if d % multiple:
        raise ValueError(f"{what} needs head_dim to be a multiple of {multiple}, got {d}")


class FP8KV(KVHook):
    """E4M3 K/V with one f32 scale per call for the layer's K (V) ("tensor") or for each KV head ("head")."""
    decode_at_once = True

    def __init__(self, scale="tensor", window=0, exact_keys=0):
        if scale not in FP8_SCALES:
            raise ValueError(f"fp8 scale must be one of {FP8_SCALES}, got {scale!r}")
        super().__init__(window, exact_keys)
        self.scale = scale

    def encode(self, x, layer=0, which=0):
        """x [B, kv_heads, n, d] -> {"e4m3": float8_e4m3fn codes of x / s, "scale": s float32 [B, kv_heads, n, 1]}
        with s = amax / 448 over the tensor or over each head (kept with each token: a stored cache's calls each
        have their own)."""
        dims = (0, 1, 2, 3) if self.scale == "tensor" else (0, 2, 3)
        amax = x.float().abs().amax(dims, keepdim=True)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        self.count(which, x.numel(), 8 * x.numel() + 32 * s.numel())
        return {"e4m3": round_e4m3(x.float() / s).to(torch.float8_e4m3fn),
                "scale": s.expand(*x.shape[:-1], 1).contiguous()}

    def decode(self, codes, layer=0, which=0):
        return codes["e4m3"].float() * codes["scale"]


def dequantize_blocks(raw, cache_type, out=None, compiled=None):
    """q8_0 / q4_0 blocks uint8 [..., k * block bytes] -> float32 [..., 32 k], the values llama_cpp/ggml.py's
    dequantize (the textbook decoder of every GGML type) gives, in a few tensor ops over all blocks at once, with no
    int64 or per-type machinery (a stored cache reads back a whole layer's pages per step). q4_0 as it computes
    them, bit for bit: code * d - 8 d in float32 (the nibbles, low ones first). q8_0 as q * d for its int8 q, one
    pass fewer than its (q + 128) * d - 128 d: the same value, as q * d is exact in float32 (8 bits times an f16's
    11), only a zero's sign may differ (-0 where d < 0, which no encoder writes: d = amax / 127).
    out: a float32 tensor of that shape (a view of a cache's buffer: rows of 32 k contiguous) to write into, so
    that a long cache is not written twice, once here and once where it goes.
    compiled (q4_0): True / False forces q4_0_into compiled by torch.compile (one pass that reads the codes and
    writes out once, where these ops make five) / these ops; None compiles from COMPILE_FROM values (a long cache),
    and runs these ops where it cannot."""
    size = GGML_KV_VALUES[cache_type]
    blocks = raw.unflatten(-1, (-1, size))                          # [..., k, block bytes]
    if out is None:
        out = torch.empty(*raw.shape[:-1], raw.shape[-1] // size * QK)
    x = out.unflatten(-1, (-1, QK))                                 # [..., k, 32], a view of out
    d = blocks.view(torch.float16)[..., :1].float()                 # the f16 at bytes 0-1: [..., k, 1]
    fast = cache_type == "q4_0" and (compiled or (compiled is None and x.numel() >= COMPILE_FROM))
    if fast and (into := compiled_q4_0_into()) is not None:
        into(x, blocks[..., 2:], d)
        return out
    if cache_type == "q4_0":                          # value j < 16: byte j's low nibble, 16 + j its high one
        words = blocks[..., 2:].contiguous().view(torch.int32)      # (four bytes per op: uint8 ops are slower)
        x[..., :QK // 2] = (words & 0x0F0F0F0F).view(torch.uint8)
        x[..., QK // 2:] = (words >> 4 & 0x0F0F0F0F).view(torch.uint8)
        x.mul_(d).add_(-8 * d)
    else:
        x.copy_(blocks[..., 2:].view(torch.int8)).mul_(d)
    return out


def q4_0_into(x, codes, d):
    """x float32 [..., k, 32] (a view of the output) <- code * d - 8 d, the low nibbles first: codes uint8
    [..., k, 16] (two a byte), d float32 [..., k, 1], as dequantize_blocks' ops compute them. Eager, a temporary
    per op; compiled, one pass that writes x once."""
    halves = x.unflatten(-1, (2, QK // 2))
    halves[..., 0, :] = (codes & 15).float() * d - 8 * d
    halves[..., 1, :] = (codes >> 4).float() * d - 8 * d


@functools.cache
def compiled_q4_0_into():
    """q4_0_into compiled (C++ on a CPU; shapes symbolic), or None where it cannot be built here (no C++ compiler,
    say: a warning, and dequantize_blocks' ops run instead). Made on first use: it takes seconds, which a long
    cache's first steps repay. Not fullgraph: past dynamo's limit of builds for new layouts or grad modes (8), it
    runs q4_0_into eager (the same values)."""
    from ...kernels import compiled               # torch.compile's machinery: imported by long caches only
    try:
        into = compiled(q4_0_into, dynamic=True)
        blocks = torch.zeros(1, 2, 2, 2, GGML_KV_VALUES["q4_0"], dtype=torch.uint8)    # [B, kv_heads, n, k, 18]
        into(torch.empty(1, 2, 2, 2, QK), blocks[..., 2:], blocks.view(torch.float16)[..., :1].float())
    except Exception as failure:      # dequantize_blocks' ops compute the same values
        warnings.warn(f"torch.compile cannot build the KV cache's block decode here ({failure!r:.200}): it runs "
                      "as separate tensor ops (slower, the same values)")
        return None
    return into


@functools.cache
def hadamard_matrix(n):
    """H / sqrt(n) [n, n] float32 (Sylvester order, symmetric, its own inverse): fwht's rotation as one matrix
    (cached and shared: never modified)."""
    return fwht(torch.eye(n)) / n ** 0.5


class GGMLKV(KVHook):
    """llama.cpp's quantized cache types: every run of 32 values along head_dim one GGML block."""
    decode_at_once = True

    def __init__(self, cache_type="q8_0", window=0, exact_keys=0, key_order="auto", rotation="hadamard"):
        if cache_type not in GGML_KV:
            raise ValueError(f"cache_type must be one of {list(GGML_KV)}, got {cache_type!r}")
        if key_order not in KEY_ORDERS:
            raise ValueError(f"key_order must be one of {KEY_ORDERS}, got {key_order!r}")
        if rotation not in ("hadamard", "none"):
            raise ValueError(f"rotation must be 'hadamard' (llama.cpp's) or 'none', got {rotation!r}")
        super().__init__(window, exact_keys)
        self.cache_type, self.key_order, self.rotation = cache_type, key_order, rotation

    def adopt(self, cfg):
        """On a model: "auto" becomes llama.cpp's order for it (interleaved for Llama, halves for Qwen)."""
        if self.key_order == "auto":
            self.key_order = "interleaved" if cfg.model_type == "llama" else "halves"

    def check_head_dim(self, d):
        _check_head_dim(d, QK, self.cache_type)

    def _interleaved(self, which):
        return which == 0 and self.key_order == "interleaved"

    def _chunk(self, d, which):
        """The rotation's chunk: V 64, K the largest power of two dividing d (0: no rotation)."""
        return 0 if self.rotation == "none" or d % 64 else 64 if which == 1 else d & -d

    def _rotate(self, x, which):
        """x [..., d] -> x H / sqrt(n) per chunk of n (llama.cpp's rotation; its own inverse), or x: the fast
        Walsh-Hadamard transform's butterflies."""
        n = self._chunk(x.shape[-1], which)
        return (fwht(x.float().unflatten(-1, (-1, n))) / n ** 0.5).flatten(-2) if n else x

    def _rotate_back(self, x, which):
        """_rotate as one matmul with H / sqrt(n) (equal up to float rounding; as llama.cpp's ggml_mul_mat does it),
        which reads a long cache back several times faster than the butterflies' log2(n) passes over it."""
        n = self._chunk(x.shape[-1], which)
        return (x.unflatten(-1, (-1, n)) @ hadamard_matrix(n)).flatten(-2) if n else x

    def encode(self, x, layer=0, which=0):
        """x [..., d] (d a multiple of 32) -> {"blocks": uint8 [..., d / 32 * block bytes]}: its GGML blocks."""
        self.check_head_dim(x.shape[-1])
        if self._interleaved(which):                  # [x_0, x_{d/2}, x_1, x_{d/2+1}, ...]
            x = x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        x = self._rotate(x, which)
        kind = GGML_KV[self.cache_type]
        raw = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, x.reshape(-1, x.shape[-1])))
        self.count(which, x.numel(), 8 * raw.numel())
        return {"blocks": raw.reshape(*x.shape[:-1], -1)}

    def basis(self, d, which, layer=0):
        """What decode does after dequantizing (the rotation back, then the interleaved keys' order) as a matrix;
        None where that is nothing."""
        return None if self._read_as_stored(d, which) else self._to_values(torch.eye(d), which)

    def _read_as_stored(self, d, which):
        """Whether decode is the blocks' values as they are (no rotation back, no reordered keys)."""
        return not (self._chunk(d, which) or self._interleaved(which))

    def decode_in_basis(self, codes, layer=0, which=0):
        return dequantize_blocks(codes["blocks"], self.cache_type)

    def decode(self, codes, layer=0, which=0):
        return self._to_values(self.decode_in_basis(codes), which)

    def decode_into(self, codes, out, layer=0, which=0, in_basis=False):
        """Blocks dequantized straight into out where nothing follows (in the basis, or no rotation nor reorder)
        and out is float32."""
        if out.dtype == torch.float32 and (in_basis or self._read_as_stored(out.shape[-1], which)):
            dequantize_blocks(codes["blocks"], self.cache_type, out=out)
        else:
            super().decode_into(codes, out, layer, which, in_basis)

    def _to_values(self, x, which):
        x = self._rotate_back(x, which)
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) if self._interleaved(which) else x


def min_max_codes(groups, bits, dim):
    """groups [...] -> KIVI's codes over `dim`: q uint8 = clamp(round((x - z) / s), 0, 2^b - 1), z = min and
    s = (max - min) / (2^b - 1) (1 where that is 0), both f16 (keepdim)."""
    top = 2 ** bits - 1
    g = groups.float()
    z = g.amin(dim, keepdim=True).half()
    s = ((g.amax(dim, keepdim=True) - z.float()) / top).half()
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((g - z.float()) / s.float()).round().clamp(0, top).to(torch.uint8), s, z


class KIVI(KVHook):
    """KIVI: keys per channel over groups of `group` tokens, values per token over min(group, head_dim) channels,
    `bits` bits asymmetric with an f16 scale and zero per group; window >= group - 1 recent tokens exact."""

    def __init__(self, bits=2, group=32, window=RESIDUAL_WINDOW, exact_keys=0):
        if bits not in (2, 4):
            raise ValueError(f"KIVI bits must be 2 or 4, got {bits!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"KIVI group must be a positive integer, got {group!r}")
        self.block = group
        super().__init__(window, exact_keys)
        if window < group - 1:
            raise ValueError(f"KIVI codes keys over {group} tokens: window={window} would let a query see a group "
                             f"holding later tokens (need window >= {group - 1})")
        self.bits, self.group = bits, group

    def check_head_dim(self, d):
        _check_head_dim(d, min(self.group, d), "KIVI values")

    def encode(self, x, layer=0, which=0):
        """x [B, kv_heads, n, d] (n a multiple of group for K) -> {"q": the codes, bits-packed along d, "scale",
        "zero": f16 [B, kv_heads, n / group, d] for K, [B, kv_heads, n, d / min(group, d)] for V}."""
        b, h, n, d = x.shape
        if which == 0:
            if n % self.group:
                raise ValueError(f"KIVI keys come in groups of {self.group} tokens, got {n}")
            q, s, z = min_max_codes(x.reshape(b, h, n // self.group, self.group, d), self.bits, 3)
        else:
            g = min(self.group, d)
            self.check_head_dim(d)
            q, s, z = min_max_codes(x.reshape(b, h, n, d // g, g), self.bits, 4)
        s, z = s.reshape(b, h, s.shape[2], -1), z.reshape(b, h, z.shape[2], -1)      # drop the group's axis
        self.count(which, x.numel(), self.bits * x.numel() + 32 * s.numel())             # + f16 scale and zero
        return {"q": pack_bits(q.reshape(x.shape), self.bits), "scale": s, "zero": z}

    def decode(self, codes, layer=0, which=0):
        q, s, z = codes["q"], codes["scale"], codes["zero"]
        b, h, n = q.shape[:3]
        d = q.shape[-1] * 8 // self.bits
        q = unpack_bits(q, self.bits, d).float()
        if which == 0:
            x = q.reshape(b, h, n // self.group, self.group, d) * s.float()[:, :, :, None] + z.float()[:, :, :, None]
        else:
            g = min(self.group, d)
            x = q.reshape(b, h, n, d // g, g) * s.float()[..., None] + z.float()[..., None]
        return x.reshape(b, h, n, d)


class DenseKV(KVHook):
    """The values themselves in bf16 or f16 (vLLM's and llama.cpp's default caches): the stored cache's baseline."""
    decode_at_once = True
    DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}

    def __init__(self, dtype="bf16", window=0):
        if dtype not in self.DTYPES:
            raise ValueError(f"dense KV dtype must be one of {list(self.DTYPES)}, got {dtype!r}")
        super().__init__(window)
        self.dtype = self.DTYPES[dtype]

    def encode(self, x, layer=0, which=0):
        self.count(which, x.numel(), 16 * x.numel())
        return {"values": x.to(self.dtype)}

    def decode(self, codes, layer=0, which=0):
        return codes["values"].float()


KV_FORMATS = {"fp8": FP8KV, "ggml": GGMLKV, "kivi": KIVI, "dense": DenseKV}


def kv_quantize(model, format="fp8", **options):
    """Install one of KV_FORMATS (options: its class's) on the model's KV hook; returns it (see .report())."""
    if format not in KV_FORMATS:
        raise ValueError(f"KV format must be one of {list(KV_FORMATS)}, got {format!r}")
    return install(model, KV_FORMATS[format](**options))
