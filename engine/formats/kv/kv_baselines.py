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
kernels match; the engine's one port of them is llama_cpp/ggml_quants.py) writing GGML blocks, decoded by
llama_cpp/ggml.py, so the grid is GGUF's bit for bit:
    q8_0: d = amax / 127, q = roundf(x / d) (halves away from 0)
    q4_0: d = m / -8 (m the value of largest |x|), q = min(15, trunc(x / d + 8.5))
(llama.cpp quantizes V this way only with flash attention; without it V stays f16.)

KIVI: asymmetric b-bit, x_hat = q s + z, z = min, s = (max - min) / (2^b - 1), both f16, q = clamp(round((x - z) /
s)); K grouped per channel over G consecutive tokens (so blocks of G tokens are coded together), V per token over
min(G, head_dim) channels. KIVI keeps the most recent tokens in full precision; here that is the hook's sliding
window (>= G - 1 tokens), where KIVI's own residual fills up to R tokens and is then quantized as a whole.
"""
import torch

from ..llama_cpp import ggml_quants
from ..llama_cpp.ggml import dequantize
from ..numerics.minifloats import E4M3_MAX, round_e4m3
from .kv_cache import RESIDUAL_WINDOW, KVHook, install

FP8_SCALES = ("tensor", "head")
GGML_KV = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
QK = 32                    # values per GGML block


def _check_head_dim(x, multiple, what):
    if x.shape[-1] % multiple:
        raise ValueError(f"{what} needs head_dim to be a multiple of {multiple}, got {x.shape[-1]}")


class FP8KV(KVHook):
    """E4M3 K/V with one f32 scale per call for the layer's K (V) ("tensor") or for each KV head ("head")."""

    def __init__(self, scale="tensor", window=0, exact_keys=0):
        if scale not in FP8_SCALES:
            raise ValueError(f"fp8 scale must be one of {FP8_SCALES}, got {scale!r}")
        super().__init__(window, exact_keys)
        self.scale = scale

    def quantize(self, x, layer=0, which=0):
        """x [B, kv_heads, n, d] -> E4M3(x / s) s, s = amax / 448 over the tensor or over each head."""
        dims = (0, 1, 2, 3) if self.scale == "tensor" else (0, 2, 3)
        amax = x.float().abs().amax(dims, keepdim=True)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        self.count(which, x.numel(), 8 * x.numel() + 32 * s.numel())
        return (round_e4m3(x.float() / s) * s).to(x.dtype)


class GGMLKV(KVHook):
    """llama.cpp's quantized cache types: every run of 32 values along head_dim one GGML block."""

    def __init__(self, cache_type="q8_0", window=0, exact_keys=0):
        if cache_type not in GGML_KV:
            raise ValueError(f"cache_type must be one of {list(GGML_KV)}, got {cache_type!r}")
        super().__init__(window, exact_keys)
        self.cache_type = cache_type

    def quantize(self, x, layer=0, which=0):
        """x [..., d] (d a multiple of 32) -> the values its GGML blocks decode to."""
        _check_head_dim(x, QK, self.cache_type)
        kind = GGML_KV[self.cache_type]
        raw = ggml_quants.blocks(kind, *ggml_quants.quantize(kind, x.reshape(-1, x.shape[-1])))
        self.count(which, x.numel(), 8 * raw.numel())
        return dequantize(raw.reshape(-1), kind, x.shape).to(x.dtype)


def min_max_grid(groups, bits, dim):
    """groups [...] -> their values on KIVI's grid over `dim`: z = min, s = (max - min) / (2^b - 1), both f16."""
    top = 2 ** bits - 1
    g = groups.float()
    z = g.amin(dim, keepdim=True).half().float()
    s = ((g.amax(dim, keepdim=True) - z) / top).half().float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((g - z) / s).round().clamp(0, top) * s + z


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

    def quantize(self, x, layer=0, which=0):
        """x [B, kv_heads, n, d] (n a multiple of group for K) -> x_hat."""
        b, h, n, d = x.shape
        if which == 0:
            if n % self.group:
                raise ValueError(f"KIVI keys come in groups of {self.group} tokens, got {n}")
            x_hat = min_max_grid(x.reshape(b, h, n // self.group, self.group, d), self.bits, 3)
            groups = n // self.group * d
        else:
            g = min(self.group, d)
            _check_head_dim(x, g, "KIVI values")
            x_hat = min_max_grid(x.reshape(b, h, n, d // g, g), self.bits, 4)
            groups = n * (d // g)
        self.count(which, x.numel(), self.bits * x.numel() + 32 * b * h * groups)         # + f16 scale and zero
        return x_hat.reshape(x.shape).to(x.dtype)


KV_FORMATS = {"fp8": FP8KV, "ggml": GGMLKV, "kivi": KIVI}


def kv_quantize(model, format="fp8", **options):
    """Install one of KV_FORMATS (options: its class's) on the model's KV hook; returns it (see .report())."""
    if format not in KV_FORMATS:
        raise ValueError(f"KV format must be one of {list(KV_FORMATS)}, got {format!r}")
    return install(model, KV_FORMATS[format](**options))
