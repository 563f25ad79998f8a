"""Affine (asymmetric) integer quantization with one scale and offset per group: round-to-nearest, and the one
integer layer that RTN, GPTQ and AWQ all load into.

For a group g of `group_size` consecutive inputs of one output row, with b bits and top = 2^b - 1:

    scale = (max(w_g, 0) - min(w_g, 0)) / top        zero = round(-min(w_g, 0) / scale)
    q     = clamp(round(w / scale) + zero, 0, top)     w_hat = (q - zero) * scale

Scales are rounded to float16 when they are chosen, so that what a checkpoint stores (f16) is exactly what was used
while quantizing. Storage per weight: b bits of code + (16-bit scale + 16-bit zero or offset) / group_size, e.g.
4-bit g64 = 4.5 bits.

Two kinds of grid share one layer. GPTQ, AWQ, compressed-tensors and GGML's Q4_0 / Q8_0 / Q6_K store an integer
zero point per group (w = (q - zero) * scale); GGML's Q4_1 and the K-quants' mins store a free float offset
(w = q * scale + offset). AffineQuantLinear keeps whichever it was given, exactly, so a writer of integer zero
points reads them back as they were (never by dividing an offset by a scale), and a free offset is never forced
onto an integer grid; both compute as q * scale + offset (offset = -zero * scale).

Codes are packed little-end first: `pack_bits` puts 8 / b codes in a byte (our runtime layout), `pack_int32` puts
32 / b codes in an int32 word in any nibble order (the GPTQ, AWQ and compressed-tensors checkpoint layouts).
"""
import torch
import torch.nn.functional as F

from ...layers import QuantLinear



# ---- choosing the grid ------------------------------------------------------------------------------------------

def find_params(w, bits, *, sym=False, f16=True):
    """w [rows, n] -> (scale [rows], zero [rows]) of the affine grid covering each row's range (0 included).
    sym=True puts the zero point in the middle of the grid (GPTQ's sym option). f16=False keeps the float32 scale
    (the reference GPTQ code's, which rounds it to f16 only when it writes the file)."""
    top = 2 ** bits - 1
    w = w.float()
    lo, hi = w.min(1).values.clamp(max=0), w.max(1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = hi == lo                                       # an all-zero row: any grid reproduces it
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = (hi - lo) / top
    scale = scale.half().float() if f16 else scale
    if not torch.isfinite(scale).all():
        raise ValueError(f"weights are not finite or their range exceeds what an f16 scale covers "
                         f"(|w| up to {65504 * top / 2:.3g} with {bits} bits)")
    scale = scale.clamp_min(2.0 ** -24)                    # a range so tiny its f16 scale would round to 0
    zero = torch.full_like(scale, (top + 1) / 2) if sym else (-lo / scale).round().clamp(0, top)
    return scale, zero


ONE_GROUP = -1          # a group_size configs write for one group per row (GPTQ, AutoAWQ)


def group_width(group_size, in_features):
    """A group_size as configs and options write it -> the columns each group holds: ONE_GROUP is the whole row.
    The one place that reading is made."""
    return in_features if group_size == ONE_GROUP else group_size


def grouped(weight, group_size):
    """[out, in] -> [out, groups, group_size], zero-padding a ragged last group (zeros never change a range that
    already includes 0)."""
    out_f, in_f = weight.shape
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    groups = -(-in_f // group_size)
    return F.pad(weight.float(), (0, groups * group_size - in_f)).reshape(out_f, groups, group_size)


def affine_codes(weight, bits=4, group_size=64, clip=None, sym=False):
    """weight [out, in] -> (codes uint8 [out, in], scales [out, groups], zeros [out, groups]: integers), the grid of
    an integer-zero-point checkpoint (GPTQ, AWQ, compressed-tensors).

    clip [out, groups] (optional, from choose_clip) shrinks each group's range before the grid is chosen."""
    out_f, in_f = weight.shape
    g = grouped(weight, group_size)
    fit = g if clip is None else g * clip[..., None]
    scale, zero = find_params(fit.reshape(-1, group_size), bits, sym=sym)
    scale, zero = scale.reshape(out_f, -1), zero.reshape(out_f, -1)
    q = (g / scale[..., None]).round().add(zero[..., None]).clamp(0, 2 ** bits - 1)
    codes = q.reshape(out_f, -1)[:, :in_f].to(torch.uint8)
    return codes, scale, zero


def quantize_to_affine(weight, bits=4, group_size=64, *, clip=None, sym=False):
    """The book's round-to-nearest: weight [out, in] -> (codes uint8 [out, in], scales [out, groups], offsets
    [out, groups]), w_hat = codes * scale + offset. The offsets are -zero * scale of affine_codes' integer zero
    points, so a writer can recover those exactly (affine_parts) instead of dividing an offset by a scale."""
    codes, scales, zeros = affine_codes(weight, bits, group_size, clip, sym)
    return codes, scales, -zeros * scales


def dequantize_affine(codes, scales, offsets, group_size):
    """codes [out, in] + per-group scales / offsets [out, groups] -> weight [out, in] float32 (offset = -zero *
    scale for an integer zero point)."""
    in_f = codes.shape[1]
    s = scales.float().repeat_interleave(group_size, 1)[:, :in_f]
    o = offsets.float().repeat_interleave(group_size, 1)[:, :in_f]
    return codes.float() * s + o


def fake_quantize_grouped(g, bits=4, clip=None, sym=False):
    """grouped weight [out, groups, G] -> its quantized-then-dequantized values, same shape: affine_codes then
    dequantize_affine without the codes and the per-weight copies of scales and offsets (the same float ops, so the
    same values: what the model sees)."""
    fit = g if clip is None else g * clip[..., None]
    scale, zero = find_params(fit.reshape(-1, g.shape[-1]), bits, sym=sym)
    scale, zero = scale.reshape(g.shape[:2])[..., None], zero.reshape(g.shape[:2])[..., None]
    q = (g / scale).round().add(zero).clamp(0, 2 ** bits - 1)
    return q * scale + -zero * scale


def fake_quantize(weight, bits=4, group_size=64, *, clip=None, sym=False):
    """Quantize and immediately dequantize: weight [out, in] -> what the model sees, float32 [out, in]."""
    return fake_quantize_grouped(grouped(weight, group_size), bits, clip, sym).flatten(1)[:, :weight.shape[1]]


@torch.no_grad()
def choose_clip_reference(weight, inputs, bits=4, group_size=64, grid=20, max_shrink=0.5):
    """Per-group clip ratio [out, groups] minimizing the output error on calibration inputs [tokens, in], AutoAWQ's
    auto_clip: each shrink of a grid is tried on every group at once, and err[o, g] = mean_t (x_tg . dw_og)^2.

    Clipping a group's range trades a larger error on its few extreme weights for a finer grid for all the others."""
    xg = grouped(inputs.reshape(-1, inputs.shape[-1]), group_size).double()   # [tokens, groups, G]
    wg = grouped(weight, group_size)                                      # [out, groups, G]
    best_err = torch.full(wg.shape[:2], float("inf"), dtype=torch.float64)
    best = torch.ones(wg.shape[:2])
    for ratio in torch.linspace(1.0, 1.0 - max_shrink, grid):
        clip = torch.full(wg.shape[:2], float(ratio))
        dw = (grouped(fake_quantize(weight, bits, group_size, clip=clip), group_size) - wg).double()
        err = torch.einsum("tgk,ogk->tog", xg, dw).pow(2).mean(0)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, clip, best)
    return best


def choose_clip(weight, gram, bits=4, group_size=64, grid=20, max_shrink=0.5):
    """choose_clip_reference from the inputs' Gram matrix G = X^T X / tokens [in, in] instead of the inputs:
    mean_t (x_tg . dw_og)^2 = dw_og^T G_g dw_og, G_g the g-th diagonal block of G, so each shrink costs
    out * in * group_size, not tokens * out * in, and no calibration input is kept (the same choices).

    Both compare their errors in float64: two shrinks whose errors differ in float32's last bits would otherwise be
    ordered by the summation order, which differs between the two searches and between CPUs."""
    wg = grouped(weight, group_size)                                      # [out, groups, G]
    groups, size = wg.shape[1:]
    pad = groups * size - gram.shape[0]
    blocks = F.pad(gram.double(), (0, pad, 0, pad)).reshape(groups, size, groups, size)
    blocks = blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)              # [groups, G, G]
    best_err = torch.full(wg.shape[:2], float("inf"), dtype=torch.float64)
    best = torch.ones(wg.shape[:2])
    for ratio in torch.linspace(1.0, 1.0 - max_shrink, grid):
        clip = torch.full(wg.shape[:2], float(ratio))
        dw = (fake_quantize_grouped(wg, bits, clip) - wg).transpose(0, 1).double()
        err = (torch.bmm(dw, blocks) * dw).sum(-1).T                      # [out, groups]
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, clip, best)
    return best


# ---- packing ----------------------------------------------------------------------------------------------------

def check_bits(bits, allowed=(1, 2, 4, 8)):
    if bits not in allowed:
        raise ValueError(f"bits must be one of {allowed}, got {bits!r}")


def pack_bits(codes, bits):
    """codes [..., n] (0 <= c < 2^bits) -> uint8 [..., ceil(n * bits / 8)]: code j in byte j // (8 / bits),
    at bit (j % (8 / bits)) * bits. Low bits first, as every format here."""
    check_bits(bits)
    per = 8 // bits
    n = codes.shape[-1]
    c = F.pad(codes.to(torch.int32), (0, -n % per)).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed, bits, n):
    """Inverse of pack_bits: uint8 [..., bytes] -> codes uint8 [..., n]."""
    check_bits(bits)
    if bits == 4:                                          # (the common case, without an int32 copy)
        return torch.stack((packed & 15, packed >> 4), -1).reshape(*packed.shape[:-1], -1)[..., :n]
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)
    return c.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def pack_nibbles(codes):
    """4-bit codes [..., n] -> uint8 [..., n / 2] (even element in the low nibble)."""
    return pack_bits(codes, 4)


def unpack_nibbles(packed, n=None):
    return unpack_bits(packed, 4, packed.shape[-1] * 2 if n is None else n)


def value_pairs(first, second):
    """first, second [n] -> float64 [n] whose entry i holds first[i] and second[i] as two float32 in memory order:
    a table that decode_pairs reads two values from at once."""
    return torch.stack([first, second], -1).float().contiguous().view(torch.float64).reshape(-1)


def pair_table(levels):
    """levels float32 [16] (a 4-bit code's values) -> float64 [256] whose entry b holds levels[b & 15] and
    levels[b >> 4]: a byte of two codes, low nibble first, looked up at once."""
    b = torch.arange(256)
    return value_pairs(levels[b & 15], levels[b >> 4])


def decode_pairs(out, packed, table, indices=None):
    """out float32 [rows, 2n] (contiguous) <- table's value pairs (value_pairs) at packed [rows, n] (a byte of two
    4-bit codes, or any integer index): one gather of 8 bytes per index. indices: an int32 buffer of packed's size
    to widen the index into (index_select takes no uint8 or int16 index), instead of a new one."""
    flat = packed.reshape(-1)
    index = flat.to(torch.int32) if indices is None else indices.copy_(flat)
    torch.index_select(table, 0, index, out=out.view(torch.float64).view(-1))


CODE_PAIRS = pair_table(torch.arange(16.0))       # a byte of two 4-bit codes -> the codes as two floats


def pack_int32(values, bits=4, order=None):
    """values [..., n] (n % (32 / bits) == 0) -> int32 [..., n / (32 / bits)].

    Field j of each word (bits j*b .. j*b + b-1) holds element order[j] of its run of 32 / b elements; order=None
    is the natural order. This one packer writes GPTQ's qweight/qzeros, AWQ's interleaved words and
    compressed-tensors' weight_packed."""
    per = 32 // bits
    if values.shape[-1] % per:
        raise ValueError(f"cannot pack {values.shape[-1]} values into int32 words of {per}")
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    return as_int32((v << (torch.arange(per, device=v.device) * bits)).sum(-1))


def as_int32(t):
    """32 packed bits held in an int64 -> int32 with the same bits (two's complement)."""
    return (t - (t >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def unpack_int32(packed, bits=4, order=None):
    """Inverse of pack_int32: int32 [..., words] -> uint8 [..., words * 32 / bits]."""
    per = 32 // bits
    fields = (packed.to(torch.int64)[..., None] >> (torch.arange(per, device=packed.device) * bits)) & (2 ** bits - 1)
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order, device=packed.device))]
    return fields.reshape(*packed.shape[:-1], -1).to(torch.uint8)


# ---- the layer --------------------------------------------------------------------------------------------------

class AffineQuantLinear(QuantLinear):
    """Integer codes with a scale and a free offset, or an integer zero point, per group of inputs (chapter 38's
    layer, which RTN, GPTQ, AWQ and GGUF's integer blocks all load into).

        AffineQuantLinear(weight_codes, scales, offsets, group_size, packed=False, bias=None, dtype=None)

    weight_codes uint8 [out, in] (packed=True: already packed, pack_bits' layout [out, ceil(in * bits / 8)], which
    for 4 bits is pack_nibbles'), scales [out, groups] and
        offsets [out, groups], any finite floats:           W[o, i] = q[o, i] * scales[o, g] + offsets[o, g]
    or, keyword zeros= with offsets None,
        zeros   [out, groups], integers in [0, 2^bits - 1]:   W[o, i] = (q[o, i] - zeros[o, g]) * scales[o, g]
    with g = i // G -> y = x @ W^T. An integer grid keeps its zero points exactly (`zeros`; None for free offsets),
    so a writer reads them back as they were; `offsets` (= -zeros * scales there) is what the kernels compute with.
    dtype: the dtype the layer returns (the book's compute dtype; the engine accumulates in float32 either way);
    None returns the activations' dtype.

    Keywords beyond the book's: bits (default 4), in_features (when packed codes leave it ambiguous), perm
    (int [in]: the columns were stored in the order perm, as a GPTQ act-order checkpoint sorted by g_idx so that
    groups are contiguous; the layer then multiplies x[:, perm]; dequantize() returns the original column order).
    """

    ROW_BUFFERS = ("packed", "scales", "zeros", "offsets")

    def __init__(self, weight_codes, scales, offsets, group_size, packed=False, bias=None, dtype=None, *, bits=4,
                 zeros=None, in_features=None, perm=None):
        check_bits(bits)
        if not isinstance(packed, bool):
            raise ValueError(f"packed (the 5th argument) says whether weight_codes are packed: True or False, "
                             f"got {packed!r}")
        out_f, groups = scales.shape
        if packed:
            in_f = in_features if in_features is not None else weight_codes.shape[1] * (8 // bits)
        else:
            if weight_codes.dim() != 2 or (in_features is not None and in_features != weight_codes.shape[1]):
                raise ValueError(f"weight_codes must be [out, in] codes, got {tuple(weight_codes.shape)}")
            in_f = weight_codes.shape[1]
            if bool((weight_codes.to(torch.int64) >= 2 ** bits).any() | (weight_codes.to(torch.int64) < 0).any()):
                raise ValueError(f"codes must lie in [0, {2 ** bits - 1}] for {bits} bits")
            weight_codes = pack_bits(weight_codes, bits)
        if (zeros is None) == (offsets is None):
            raise ValueError("give an affine layer either free offsets or integer zero points (zeros=), not both")
        grid = zeros if zeros is not None else offsets
        if weight_codes.shape != (out_f, -(-in_f * bits // 8)) or grid.shape != scales.shape:
            raise ValueError(f"inconsistent shapes: packed codes {tuple(weight_codes.shape)}, scales "
                             f"{tuple(scales.shape)}, {'zeros' if zeros is not None else 'offsets'} "
                             f"{tuple(grid.shape)} for in={in_f}, {bits} bits")
        if groups != -(-in_f // group_size):
            raise ValueError(f"{groups} scale groups do not fit in_features={in_f} with group_size={group_size}")
        if zeros is not None:
            zeros = zeros.float()
            if not bool(((zeros == zeros.round()) & (zeros >= 0) & (zeros <= 2 ** bits - 1)).all()):
                raise ValueError(f"zero points must be integers in [0, {2 ** bits - 1}]")
            offsets = -zeros * scales.float()
        # finite, and so is every weight they decode to: |scale| * (2^bits - 1) + |offset|
        if not torch.isfinite(scales.float().abs() * (2 ** bits - 1) + offsets.float().abs()).all():
            raise ValueError("scales and offsets must be finite, and so must the weights they decode to (a NaN or "
                             "infinite scale decodes to garbage)")
        super().__init__(in_f, out_f, bias, dtype)
        self.group_size, self.bits = group_size, bits
        self.register_buffer("packed", weight_codes.to(torch.uint8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("zeros", None if zeros is None else zeros.to(torch.uint8).contiguous())
        self.register_buffer("offsets", offsets.float().contiguous())
        if perm is not None:
            perm = torch.as_tensor(perm, dtype=torch.long)
            if sorted(perm.tolist()) != list(range(in_f)):
                raise ValueError("perm must be a permutation of the input columns")
        self.register_buffer("perm", perm)

    @classmethod
    def from_codes(cls, codes, scales, group_size, bits=4, *, zeros=None, offsets=None, perm=None, bias=None):
        """codes [out, in] (0 <= q < 2^bits) -> the layer; grid as in the class docstring."""
        return cls(codes, scales, offsets, group_size, bias=bias, bits=bits, zeros=zeros, perm=perm)

    @classmethod
    def from_weight(cls, weight, bits=4, group_size=64, sym=False, clip=None, perm=None, bias=None):
        """Round-to-nearest of a weight [out, in] (clip [out, groups]: optional range shrink from choose_clip)."""
        codes, scales, zeros = affine_codes(weight.detach(), bits, group_size, clip, sym)
        return cls.from_codes(codes, scales, group_size, bits, zeros=zeros, perm=perm, bias=bias)

    @classmethod
    def from_linear(cls, linear, bits=4, group_size=64, sym=False, clip=None):
        """Round-to-nearest of an nn.Linear."""
        return cls.from_weight(linear.weight, bits, group_size, sym, clip, bias=linear.bias)

    @property
    def weight_codes(self):
        """The stored codes uint8 [out, in] (in stored column order)."""
        return self.packed if self.bits == 8 else unpack_bits(self.packed, self.bits, self.in_features)

    def dequantize(self):
        w = dequantize_affine(self.weight_codes, self.scales, self.offsets, self.group_size)
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm)]
        return w

    def runtime_input(self, x2d):
        return x2d if self.perm is None else x2d[:, self.perm]

    def decode_rows(self, out, start, stop):
        """Rows start:stop in stored column order: the codes widened to float32, times each group's scale, plus its
        offset (dequantize_affine's two roundings)."""
        packed, g = self.packed[start:stop], self.group_size
        if self.bits == 8:
            out.copy_(packed)
        elif self.bits == 4 and self.in_features % 2 == 0:
            decode_pairs(out, packed, CODE_PAIRS)         # a byte's two codes as floats, in one gather
        else:
            out.copy_(unpack_bits(packed, self.bits, self.in_features))
        scales, offsets = self.scales[start:stop], self.offsets[start:stop]
        if self.in_features % g:                           # a ragged last group
            out.mul_(scales.repeat_interleave(g, 1)[:, :self.in_features])
            out.add_(offsets.repeat_interleave(g, 1)[:, :self.in_features])
        else:
            out.view(len(out), -1, g).mul_(scales[..., None]).add_(offsets[..., None])

    def compact(self):
        """The same codes and grid, as a plain layer of free offsets: without the integer zero points (and a GGUF
        layer's blocks) that only a checkpoint writer reads."""
        if type(self) is AffineQuantLinear and self.zeros is None:
            return self
        return AffineQuantLinear(self.packed, self.scales, self.offsets, self.group_size, True, self.bias, self.dtype,
                                 bits=self.bits, in_features=self.in_features, perm=self.perm)

    def rows(self, ids):
        w = dequantize_affine(unpack_bits(self.packed[ids], self.bits, self.in_features), self.scales[ids],
                              self.offsets[ids], self.group_size)
        return w if self.perm is None else w[:, torch.argsort(self.perm)]

    def kernel_matmul(self, x2d):
        if self.perm is not None:
            x2d = x2d[:, self.perm]
        from ...kernels import triton_formats      # Triton: imported by the engine path only
        return triton_formats.affine_matmul(x2d, self.packed, self.scales, self.offsets, self.group_size, self.bits)

    def storage_bits(self):
        bits = self.out_features * self.in_features * self.bits + self.scales.numel() * 32
        return bits + (self.in_features * 32 if self.perm is not None else 0)


def affine_parts(layer):
    """AffineQuantLinear -> (codes [out, in] in ORIGINAL column order, scales, zeros [out, groups], g_idx [in]): what
    an integer-zero-point checkpoint (GPTQ, AWQ, compressed-tensors) stores. A layer of free offsets has no integer
    zero points, and a layer whose scales are not float16 values would change in an f16 file: both are refused."""
    if not isinstance(layer, AffineQuantLinear):
        raise TypeError(f"expected an AffineQuantLinear, got {type(layer).__name__}")
    if layer.zeros is None:
        raise ValueError("this layer's grid has free offsets (a GGUF Q4_1 / K-quant min), not integer zero points: "
                         "GPTQ, AWQ and compressed-tensors files cannot store it exactly")
    scales = layer.scales
    if not torch.equal(scales.half().float(), scales):
        raise ValueError("scales are not float16 values; writing them as f16 would change the model")
    group_of_stored = torch.arange(layer.in_features) // layer.group_size
    codes, zeros = layer.weight_codes, layer.zeros.float()
    if layer.perm is None:
        return codes, scales, zeros, group_of_stored.to(torch.int32)
    inverse = torch.argsort(layer.perm)
    return codes[:, inverse], scales, zeros, group_of_stored[inverse].to(torch.int32)


def quantize_layer(layer, bits=4, group_size=64, sym=False):
    """Round-to-nearest: replace the layer's linears (a calibration.LayerCalibration) by AffineQuantLinears, in
    place. Returns a quantization_config describing them (gptq and compressed-tensors checkpoints can store them)."""
    check_bits(bits)
    layer.replace(lambda name, linear: AffineQuantLinear.from_linear(linear, bits, group_size, sym))
    return {"quant_method": "rtn", "bits": bits, "group_size": group_size, "sym": sym}


def quantize(model, calibration_ids=None, **options):
    """Round-to-nearest every linear but lm_head, in place (data-free: calibration_ids is not used)."""
    from .calibration import whole_model      # the whole model as one layer (data-free)
    return quantize_layer(whole_model(model), **options)
