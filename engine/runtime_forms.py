"""The run-time forms of a quantized linear (engine/runtime.py picks one per layer): each holds only what it
multiplies with, and x [..., in] -> x @ W^T (+ bias) [..., out].

  Int4Linear        4-bit affine codes through PyTorch's CPU int4 kernel
  Int8PlanesLinear  8-bit affine codes as two int4 planes, the int4 kernel twice (5-bit codes' high plane
                    held a bit a weight)
  Int8Linear        8-bit codes with group scales (a tied head, whose rows the embedding reads; groups of 16): one
                    token through int8_product compiled by torch.compile, a prompt through its decoded weight; float32
  Int8RowsLinear    int8 codes with a scale per output row (EntQuant, a lattice): the int8 kernel in one call
  DecodedLinear     rows of the weight decoded, a chunk at a time, into the Workspace the model shares, then one
                    float32 matmul per chunk: by the layer's own decode_rows, or by TableRows (a trellis's states)

The int4 and int8 kernels round x, the scales and each product's output to bf16 (8 significant bits): their error is
bounded in tests/test_runtime.py, |y - x W^T| <= 2^-7 (|x| |W|^T + the scale terms), and measured on SmolLM2 in
appendix/inference.md. Int8Linear and DecodedLinear compute in float32: the weight dequantize() gives.
"""
import functools
import warnings

import torch
from torch import nn

from .formats.numerics.affine import decode_pairs, value_pairs
from .formats.numerics.hadamard import rotate_by_product
from .kernels import compiled

CHUNK = 1 << 17                 # floats a DecodedLinear decodes at once (512 KB): still in a core's L2 cache when
                                # its matmul reads them, where a whole layer's rows come back from memory
INT4_GROUPS = (32, 64, 128, 256)          # the group sizes PyTorch's CPU int4 kernel takes
QUARTERS = torch.arange(4)[:, None]       # a bit plane's shifts (bit_plane, packed_plane)


class Workspace:
    """One float32 buffer shared by every DecodedLinear of a model, grown to the largest chunk any of them takes, and
    one int32 buffer beside it for the codes a chunk's gather reads (TableRows: index_select takes no uint8 index)."""

    def __init__(self):
        self.buffer = torch.empty(0)
        self.indices = torch.empty(0, dtype=torch.int32)

    def take(self, rows, cols):
        if self.buffer.numel() < rows * cols:
            self.buffer = _normal_empty(rows * cols, torch.float32)
        return self.buffer[:rows * cols].view(rows, cols)

    def take_indices(self, n):
        if self.indices.numel() < n:
            self.indices = _normal_empty(n, torch.int32)
        return self.indices[:n]

    def nbytes(self):
        return self.buffer.numel() * 4 + self.indices.numel() * 4


def _normal_empty(n, dtype):
    """A buffer made outside torch.inference_mode even when asked inside it: written there or under no_grad alike
    (an inference tensor refuses writes outside inference mode, so a model generating first could not eval after)."""
    with torch.inference_mode(False):
        return torch.empty(n, dtype=dtype)


class RunLinear(nn.Module):
    """A quantized linear prepared to run on the torch path: it holds only what its form multiplies with (its
    buffers), and x [..., in] -> x @ W^T (+ bias) [..., out] in the layer's dtype or the activations'."""

    def __init__(self, layer):
        super().__init__()
        self.in_features, self.out_features, self.dtype = layer.in_features, layer.out_features, layer.dtype
        self.bias = layer.bias

    def matmul(self, x2d):
        """x2d [M, in] float32 -> [M, out] float32."""
        raise NotImplementedError

    def rows(self, ids):
        """The weight's rows ids (int64 [n]) as float32 [n, in]: an embedding's lookup."""
        raise NotImplementedError(f"{type(self).__name__} cannot give rows (it is no embedding's form)")

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        shape, dtype = x.shape, x.dtype
        y = self.matmul(x.reshape(-1, self.in_features).float().contiguous())    # the kernels take no strides
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype or dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"


def int4_group(layer, bits=4):
    """The group size PyTorch's int4 kernel runs an affine layer of `bits` with: the largest of INT4_GROUPS that
    divides both its group size and its input width (a group of 128 over 576 inputs runs as groups of 64, each scale
    repeated), or None where none does or the kernel's layout cannot take its rows (a multiple of 16)."""
    if getattr(layer, "bits", None) != bits or layer.out_features % 16:
        return None
    return next((g for g in reversed(INT4_GROUPS) if layer.group_size % g == 0 and layer.in_features % g == 0), None)


def int4_parts(codes, scales, zeros, group_size, g):
    """codes 0..15 [out, in], scale and zero per group of group_size inputs [out, groups] (the last may be ragged)
    -> the int4 kernel's (packed codes, bf16 scales_zeros [in / g, out, 2]) for groups of g (g divides group_size
    and in: each scale repeated), meaning w = (code - 8) * scale + zero."""
    n = codes.shape[1] // g
    s = scales.float().repeat_interleave(group_size // g, 1)[:, :n]
    z = zeros.float().repeat_interleave(group_size // g, 1)[:, :n]
    return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1),
            torch.stack([s, z], -1).transpose(0, 1).contiguous().bfloat16())


class Int4Linear(RunLinear):
    """4-bit affine codes (w = q * s + o per group of inputs) through PyTorch's CPU int4 kernel: qweight its packed
    layout [out, in / 2], scales_zeros bf16 [in / g, out, 2] with w = (q - 8) * scale + zero, so zero = o + 8 s
    (g: int4_group). An act-order layer's inputs are permuted first."""

    def __init__(self, layer):
        super().__init__(layer)
        self.group_size = g = int4_group(layer)
        s, o = layer.scales.float(), layer.offsets.float()
        packed, scales_zeros = int4_parts(layer.weight_codes, s, o + 8 * s, layer.group_size, g)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("perm", layer.perm)

    @staticmethod
    def takes(layer):
        return int4_group(layer) is not None

    def matmul(self, x2d):
        if self.perm is not None:
            x2d = x2d[:, self.perm]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d.bfloat16(), self.qweight, self.group_size,
                                                          self.scales_zeros).float()


class Int8PlanesLinear(RunLinear):
    """8-bit affine codes (q in 0..255, w = q * s + o per group) through the int4 kernel twice: q = 16 hi + lo, so

        w = 16 s hi + (s lo + o) = [(hi - 8) * 16 s + 0] + [(lo - 8) * s + (136 s + o)]

    two int4 layers of the kernel's form (code - 8) * scale + zero, their zeros chosen so that a symmetric code's
    (Q8_0: o = -128 s) are 0 and 8 s, exact in bf16. Two kernel calls where Int8Linear makes one per group of 32.
    Held: 1 + 1/4 bytes a weight with groups of 32; 5-bit codes (Q5_0, Q5_1, Q5_K: q < 32, so hi is 0 or 1) keep
    their high plane a bit a weight (bit_plane) and expand it into the Workspace at each product, 7/8 + 1/4 bytes.
    No rows: the kernel's packed layout depends on the CPU's vector width, so a tied embedding's head stays an
    Int8Linear."""

    def __init__(self, layer, workspace):
        super().__init__(layer)
        self.workspace, self.group_size = workspace, int4_group(layer, bits=8)
        q, s, o = layer.weight_codes.to(torch.int32), layer.scales.float(), layer.offsets.float()
        hi, hi_sz = int4_parts(q >> 4, 16 * s, torch.zeros_like(s), layer.group_size, self.group_size)
        lo, lo_sz = int4_parts(q & 15, s, 136 * s + o, layer.group_size, self.group_size)
        self.hi_shape = hi.shape if int(q.max()) < 32 else None       # None: the high plane held packed
        self.register_buffer("hi", hi if self.hi_shape is None else bit_plane(hi))
        self.register_buffer("hi_scales_zeros", hi_sz)
        self.register_buffer("lo", lo)
        self.register_buffer("lo_scales_zeros", lo_sz)
        self.register_buffer("perm", layer.perm)

    @staticmethod
    def takes(layer):
        return int4_group(layer, bits=8) is not None

    def matmul(self, x2d):
        if self.perm is not None:
            x2d = x2d[:, self.perm]
        xb, mm = x2d.bfloat16(), torch.ops.aten._weight_int4pack_mm_for_cpu
        hi = self.hi if self.hi_shape is None else packed_plane(self.hi, self.workspace).view(self.hi_shape)
        y = mm(xb, hi, self.group_size, self.hi_scales_zeros).float()
        return y.add_(mm(xb, self.lo, self.group_size, self.lo_scales_zeros))     # added in float32


def bit_plane(packed):
    """The int4 kernel's packed plane of codes 0 and 1 (each byte two of them: 0x00, 0x01, 0x10 or 0x11) -> uint8
    [bytes / 4]: byte i of the plane's quarter s keeps its two codes in bits s and s + 4 of byte i. Byte for byte, so
    it holds whatever order the kernel's layout puts the codes in. The plane's bytes are a multiple of 256 (int4_group:
    rows a multiple of 16, inputs of 32), so the bits are whole 64-bit words (packed_plane)."""
    quarters = packed.reshape(4, -1).to(torch.int32) & 0x11
    return (quarters << QUARTERS).sum(0).to(torch.uint8)


def packed_plane(bits, workspace):
    """bit_plane's inverse, into the Workspace: quarter s of the packed bytes is (bits >> s) & 0x11, eight bytes a
    64-bit word (a shift by s <= 3 moves no bit of a byte's neighbour into its bits 0 or 4): two passes, bits [n]
    -> uint8 [4 n]."""
    words = bits.view(torch.int64)
    out = workspace.take(4, 2 * len(words)).view(torch.int64)
    torch.bitwise_right_shift(words.expand(4, -1), QUARTERS, out=out)
    return out.bitwise_and_(0x1111111111111111).view(torch.uint8)


def int8_product(x2d, codes, scales):
    """x2d [M, groups * g] float32, codes int8 [groups, g, out], scales float32 [groups, out] -> [M, out]:

        y = sum_j  s_j * (x_j @ c_j)          (x_j: group j's g inputs, c_j its [g, out] codes)

    As written it makes an [M, groups, g, out] product; compiled (compiled_int8_product) it is one pass over the
    codes, vectorized along the outputs."""
    groups, g, out_f = codes.shape
    return ((codes.float() * x2d.view(len(x2d), groups, g, 1)).sum(2) * scales).sum(1)


@functools.cache
def compiled_int8_product():
    """int8_product compiled by torch.compile (C++ on a CPU, its shapes symbolic: one build for every layer), or
    None where it cannot be built here (no C++ compiler, say: a warning, and the layers decode their weights instead).
    Made on first use: compiling takes seconds (a few more the first time on a machine, with no inductor cache)."""
    try:
        product = compiled(int8_product, dynamic=True, fullgraph=True)
        with torch.no_grad():
            product(torch.zeros(1, 64), torch.zeros(2, 32, 48, dtype=torch.int8), torch.zeros(2, 48))
    except Exception as failure:          # the decoded product computes the same numbers
        warnings.warn(f"torch.compile cannot build the int8 product here ({failure!r:.200}): 8-bit layers decode "
                      "their weights and multiply in float32 instead (slower, the same results)")
        return None
    return product


def shared_zero(codes, scales, offsets):
    """The integer zero point z every group of an affine grid shares (offsets == -z * scales, float for float) when
    codes - z fit int8, else None. codes uint8 [out, in], scales / offsets [out, groups]."""
    s, o = scales.float(), offsets.float()
    nonzero = s != 0
    if not nonzero.any():
        return None
    z = round(float(-o[nonzero][0] / s[nonzero][0]))
    fits = 0 <= z <= 255 and int(codes.min()) - z >= -128 and int(codes.max()) - z <= 127
    return z if fits and torch.equal(-z * s, o) else None


class Int8Linear(RunLinear):
    """8-bit affine codes with a scale per group of g inputs (Q8_0, Q5_0 / Q5_1 / Q6_K held a byte a code, IQ4,
    GPTQ int8): c = q - z int8 [groups, g, out], z the grid's shared_zero (Q8_0 128, Q6_K 32, Q5_0 16), scales
    float32 [groups, out]; a grid with free offsets keeps them, c = q - 128 and o' = o + 128 s [groups, out]:

        y = sum_j  s_j (x_j @ c_j)  +  sum_j (x_j summed) o'_j

    One row of x (a decode step): compiled_int8_product, in float32. More rows (a prompt): the weight decoded a few
    outputs at a time into the model's Workspace, each chunk one float32 matmul (_decoded_product). Both are the
    dequantized weight's product up to float32 rounding, and the rows an embedding reads are dequantize()'s, float
    for float. Held: a byte a weight and 4 bytes a group (8 with offsets)."""

    def __init__(self, layer, workspace):
        super().__init__(layer)
        self.workspace, g = workspace, layer.group_size
        q, s, o = layer.weight_codes, layer.scales.float(), layer.offsets.float()
        self.zero = shared_zero(q, s, o)
        zero = 128 if self.zero is None else self.zero
        c = (q - zero).view(torch.int8)             # uint8 arithmetic wraps: q - z itself where it fits a byte
        self.register_buffer("codes", c.view(self.out_features, -1, g).permute(1, 2, 0).contiguous())
        self.register_buffer("scales", s.T.contiguous())
        self.register_buffer("offsets", None if self.zero is not None else o.T.contiguous())
        self.register_buffer("perm", layer.perm)
        self.chunk = max(1, CHUNK // self.in_features)

    @staticmethod
    def takes(layer):
        return getattr(layer, "bits", None) == 8 and layer.in_features % layer.group_size == 0

    @torch.no_grad()
    def build(self):
        """Build the compiled product for this layer's kind before the first token (seconds, once per process;
        runtime.prepare calls it): for activations made under torch.inference_mode (generate's) and under no_grad
        outside it (eval's), which torch.compile builds apart."""
        product = compiled_int8_product()
        if product is not None:
            product(torch.zeros(1, self.in_features), self.codes, self.scales)
            with torch.inference_mode():
                product(torch.zeros(1, self.in_features), self.codes, self.scales)

    def matmul(self, x2d):
        if self.perm is not None:
            x2d = x2d[:, self.perm]
        product = compiled_int8_product() if len(x2d) == 1 else None
        y = product(x2d, self.codes, self.scales) if product is not None else self._decoded_product(x2d)
        if self.offsets is not None:
            xsum = x2d.view(len(x2d), -1, self.codes.shape[1]).sum(-1)
            y += xsum @ (self.offsets + 128 * self.scales)
        return y

    def _decoded_product(self, x2d):
        """sum_j s_j (x_j @ c_j) as x2d @ W'^T, W'^T [in, out] = the codes (in their order already) times the scales,
        decoded `chunk` outputs at a time into the Workspace: columns of W^T, not DecodedLinear's rows of W, since a
        column block of the codes as they are held is a contiguous copy where rows would be a strided one."""
        groups, g, out_f = self.codes.shape
        codes = self.codes.view(self.in_features, out_f)
        y = x2d.new_empty(len(x2d), out_f)
        for start in range(0, out_f, self.chunk):
            stop = min(start + self.chunk, out_f)
            w = self.workspace.take(self.in_features, stop - start)
            w.copy_(codes[:, start:stop]).view(groups, g, -1).mul_(self.scales[:, None, start:stop])
            y[:, start:stop] = x2d @ w
        return y

    def rows(self, ids):
        """dequantize()'s rows, q * s + o float for float: q = c + z, o = -z s where every group shares z."""
        s = self.scales[:, ids, None]
        o = -self.zero * s if self.offsets is None else self.offsets[:, ids, None]
        w = (self.codes[..., ids].permute(0, 2, 1).float() + (128 if self.zero is None else self.zero)) * s + o
        return w.transpose(0, 1).reshape(len(ids), -1)


class Int8RowsLinear(RunLinear):
    """int8 codes with one scale per output row (layer.int8_rows: EntQuant's, a lattice's) through PyTorch's int8
    kernel in one call: its scales 1 (exact in bf16; x and its output are bf16), the row scales applied to the
    output in float32, Int8 EntQuant's super weights added beside (their codes hold 0), exactly. Codes in a rotated
    basis (a lattice's) come with their rotation, (signs [in], tile): the input is rotated first."""

    def __init__(self, layer, codes, scales, rotation=None):
        super().__init__(layer)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("ones", torch.ones(self.out_features, dtype=torch.bfloat16))
        signs, self.tile = rotation or (None, None)              # (signs float32 [in], tile) or None
        self.register_buffer("signs", signs)
        index = getattr(layer, "super_index", torch.zeros(0, dtype=torch.int64)).long()
        rows, cols = index // self.in_features, index % self.in_features
        self.register_buffer("super_rows", rows if len(rows) else None)
        self.register_buffer("super_cols", cols if len(rows) else None)
        self.register_buffer("super_values", layer.super_value.float() if len(rows) else None)

    def matmul(self, x2d):
        if self.signs is not None:
            x2d = rotate_by_product(x2d, self.signs, self.tile)
        y = torch.ops.aten._weight_int8pack_mm(x2d.bfloat16(), self.codes, self.ones).float().mul_(self.scales)
        if self.super_rows is not None:
            y.index_add_(1, self.super_rows, x2d[:, self.super_cols] * self.super_values)
        return y


class TableRows(nn.Module):
    """Codes that index a table of values, decoded once at load (layer.table_rows: a trellis's states), as a layer
    DecodedLinear multiplies through: table float32 [n], indices uint8 [out, in], scales float32 [out / th, in / tw]
    (one per tile of th x tw), and the rotation (signs, tile) the input takes. decode_rows is one gather and one
    product, the decode's own: exact. The codes are widened into the Workspace's indices, not a new tensor a chunk.

    Codes that are a shift register (`shift`: a trellis's, s_{t+1} = (s_t << K | b) mod n) are gathered two at a
    time (affine.decode_pairs): the pair (s_t, s_{t+1}) is the index s_t << K | b into a table of the n 2^K value
    pairs (8 KB for L = 8, K = 2: in L1), held as int16 [out, in / 2], still a byte a weight; half the gathers."""

    def __init__(self, layer, workspace, table, indices, scales, tile, rotation, shift=None):
        super().__init__()
        self.workspace = workspace
        self.in_features, self.out_features, self.dtype, self.bias = (layer.in_features, layer.out_features,
                                                                       layer.dtype, layer.bias)
        paired = shift_pairs(table, indices, shift) if shift else None
        table, indices = paired or (table, indices)
        self.register_buffer("table", table)                     # float32 [n] values, or float64 [n 2^K] pairs
        self.register_buffer("indices", indices.contiguous())
        self.register_buffer("scales", scales.contiguous())
        signs, self.rotation_tile = rotation
        self.register_buffer("signs", signs)
        self.tile, self.row_align = tile, tile[0]

    def runtime_input(self, x2d):
        return rotate_by_product(x2d, self.signs, self.rotation_tile)

    def decode_rows(self, out, start, stop):
        (th, tw), rows = self.tile, self.indices[start:stop]
        codes = self.workspace.take_indices(rows.numel())
        if self.table.dtype == torch.float64:                    # value pairs
            decode_pairs(out, rows, self.table, codes)
        else:
            torch.index_select(self.table, 0, codes.copy_(rows.view(-1)), out=out.view(-1))
        out.view(-1, th, self.in_features // tw, tw).mul_(self.scales[start // th:stop // th, None, :, None])


def shift_pairs(table, states, shift):
    """table float32 [n] (n a power of two), states [out, in] of a shift register of `shift` bits a step ->
    (value pairs float64 [n 2^shift] (affine.value_pairs), pair indices int16 [out, in / 2]): entry s_t << shift | b
    holds the values of s_t and of (s_t << shift | b) mod n, the state after it. None where the pairs are not the register's neighbours
    (odd rows, a tile order that breaks them) or the index outgrows int16: then one value a gather."""
    n = len(table)
    if states.shape[1] % 2 or n & (n - 1) or n << shift > 1 << 15:
        return None
    first, second = states[:, 0::2].to(torch.int16), states[:, 1::2].to(torch.int16)   # int16: n 2^shift fits
    index = (first << shift) | (second & ((1 << shift) - 1))
    if not torch.equal(index & (n - 1), second):
        return None
    every = torch.arange(n << shift)
    return value_pairs(table[every >> shift], table[every & (n - 1)]), index


class DecodedLinear(RunLinear):
    """A layer that keeps its own codes (`layer`, a QuantLinear) and multiplies through its decode: rows of the
    weight, as many as fit CHUNK floats (a multiple of layer.row_align), are decoded into the model's shared
    Workspace (layer.decode_rows) and multiplied in float32, the input first put in the basis the codes are in
    (layer.runtime_input: a rotation, an act-order permutation), the outputs scaled where decode_rows left a row
    scale to them. Exact: the weight dequantize() gives (up to the order of float32 rounding)."""

    def __init__(self, layer, workspace):
        super().__init__(layer)
        self.layer, self.workspace = layer, workspace
        align = layer.row_align
        self.chunk = max(align, CHUNK // layer.in_features // align * align)

    def matmul(self, x2d):
        x2d = self.layer.runtime_input(x2d)
        out_f, cols = self.out_features, x2d.shape[1]
        if self.chunk >= out_f:
            w = self.workspace.take(out_f, cols)
            scale = self.layer.decode_rows(w, 0, out_f)
            return x2d @ w.T if scale is None else (x2d @ w.T).mul_(scale)
        y = x2d.new_empty(len(x2d), out_f)
        for start in range(0, out_f, self.chunk):
            stop = min(start + self.chunk, out_f)
            w = self.workspace.take(stop - start, cols)
            scale = self.layer.decode_rows(w, start, stop)
            y[:, start:stop] = x2d @ w.T
            if scale is not None:
                y[:, start:stop] *= scale
        return y

    def rows(self, ids):
        return self.layer.rows(ids)
