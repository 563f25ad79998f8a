"""The ground floor: what every quantized linear layer shares, and the model walkers every method uses.

A quantized layer stores its weight in some compressed form and can always give back the dense weight it stands
for (`dequantize()`, [out, in] float32). Its forward pass has two implementations, chosen by one global switch
(`set_impl` below, or `with impl("engine"):`):

  torch   y = x @ dequantize().T            (plain PyTorch, the reference)
  engine  y = self.kernel_matmul(x)         (the layer's Triton kernel, decoding on the fly)

Both must agree to float32 rounding; the tests pin that for every format. `run.py --impl` turns the switch. Each
layer also reports its storage cost in bits per weight, metadata (scales, offsets, tables) included, because that is
what a user pays.

Decoding a layer costs far more than multiplying by it at batch 1, so generation (one token per forward pass) and
evaluation can keep each layer's decoded weight: `with decoded_weights(model):` makes the torch path decode every
layer once and reuse it (4 bytes per weight, turned on only when that fits in memory), keyed on the layer's own
buffers (their storage and version counters), so a layer whose buffers change, in place or replaced, is decoded
again; the copies are dropped when the block ends.
"""
import contextlib
import copy
import ctypes
import gc

import torch
from torch import nn
from tqdm import tqdm

IMPLS = ("torch", "engine")
_impl = "torch"


def set_impl(name: str) -> None:
    """Choose how quantized layers compute: "torch" (dequantize + matmul) or "engine" (Triton kernels)."""
    global _impl
    if name not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {name!r}")
    _impl = name


def get_impl() -> str:
    return _impl


@contextlib.contextmanager
def impl(name: str):
    """`with impl("engine"): model(ids)` runs every quantized layer through its kernel, then restores the switch."""
    previous = get_impl()
    set_impl(name)
    try:
        yield
    finally:
        set_impl(previous)


class QuantLinear(nn.Module):
    """Base class: subclasses set in_features / out_features / bias and implement dequantize, kernel_matmul and
    storage_bits. x [..., in] -> y [..., out] in `dtype` (the book's compute dtype) or, when it is None, in the
    activations' dtype; accumulated in float32 either way."""

    def __init__(self, in_features, out_features, bias=None, dtype=None):
        super().__init__()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.in_features, self.out_features = in_features, out_features
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        if bias is not None and not bool(torch.isfinite(bias.float()).all()):
            raise ValueError("bias holds NaN or infinite values")
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """The dense weight [out, in] (float32) that this layer's codes stand for."""
        raise NotImplementedError

    def kernel_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d [M, in] float32 -> [M, out] float32 through this format's Triton kernel."""
        raise NotImplementedError

    def storage_bits(self) -> int:
        """Every bit this layer's checkpoint tensors take (codes and metadata), bias excluded."""
        raise NotImplementedError

    # ---- the run-time forms' side (engine/runtime.py) --------------------------------------------------------
    row_align = 1                    # decode_rows takes row ranges that start and end at multiples of this

    def runtime_input(self, x2d):
        """x2d [M, in] -> the input in the basis decode_rows' weight is in (a rotation, an act-order order)."""
        return x2d

    def decode_rows(self, out, start, stop):
        """Write rows start:stop of the weight runtime_input's x multiplies into out (float32 [stop - start, in], a
        view of a shared buffer), exactly dequantize()'s values; or, returning row scales [stop - start], values
        that times them (out * scales[:, None]) are exactly those (the product's outputs are scaled instead, one
        pass less). This generic one decodes the whole weight; a format overrides it with a decode of those rows."""
        out.copy_(self.dequantize()[start:stop])

    def rows(self, ids):
        """dequantize()[ids] (ids int64 [n]) -> float32 [n, in], decoding those rows alone: an embedding's lookup."""
        out = torch.empty(len(ids), self.in_features)
        for i, row in enumerate(ids.tolist()):
            scale = self.decode_rows(out[i:i + 1], row, row + 1)
            if scale is not None:
                out[i:i + 1] *= scale[:, None]
        return out

    def compact(self):
        """The layer as it runs: itself, or the same codes without what only a file needs (a GGUF layer's blocks)."""
        return self

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.in_features * self.out_features)

    ROW_BUFFERS = ()            # the buffers holding one entry per output row, first (what joined concatenates)

    @classmethod
    def joined(cls, parts):
        """Layers of this class made from consecutive shares of one weight's output rows (engine.distributed cuts a
        linear's rows over the ranks) -> the layer of all the rows: row buffers and biases concatenated in order;
        any other buffer (a column permutation) must be the same in every share."""
        if not cls.ROW_BUFFERS or any(type(p) is not cls for p in parts):
            raise ValueError(f"{cls.__name__} cannot be joined from shares of rows")
        first = parts[0]
        whole = copy.copy(first)
        whole._buffers, whole._parameters = dict(first._buffers), dict(first._parameters)
        whole.__dict__.pop("_decoded", None)                        # a share's decoded weight, if one was kept
        for name, buffer in first._buffers.items():
            if buffer is not None and name in cls.ROW_BUFFERS:
                whole._buffers[name] = torch.cat([p._buffers[name] for p in parts])
            elif any(not _same(p._buffers[name], buffer) for p in parts):
                raise ValueError(f"{cls.__name__}.{name} differs between shares of rows, but is not per row")
        if first.bias is not None:
            whole.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        whole.out_features = sum(p.out_features for p in parts)
        return whole

    def cached_weight(self):
        """dequantize(), or inside `decoded_weights` the weight decoded once and kept (float32 [out, in])."""
        if not getattr(self, "_keep_decoded", False):
            return self.dequantize()
        key = tuple((t.data_ptr(), t._version) for t in (*self._buffers.values(), self.bias) if t is not None)
        kept = getattr(self, "_decoded", None)
        if kept is None or kept[0] != key:
            self._decoded = None                         # the old copy goes before the new one is made
            self._decoded = (key, self.dequantize())
        return self._decoded[1]

    def _apply(self, fn, recurse=True):
        """model.to(torch.bfloat16) must not re-round what is stored (fp8 codes, f32 scales): a quantized layer only
        follows the device. Its forward computes in float32 and returns the activation's dtype anyway."""
        return super()._apply(lambda t: t.to(fn(t.new_empty(0)).device), recurse)

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer expects {self.in_features}")
        shape, dtype = x.shape, x.dtype
        x2d = x.reshape(-1, self.in_features).float()
        if get_impl() == "engine":
            y = self.kernel_matmul(x2d)
        else:
            y = x2d @ self.cached_weight().T
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype or dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits_per_weight:.3f}"


def available_memory():
    """Bytes of memory the system can still give (Linux /proc/meminfo's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:                                  # not glibc: the system keeps its own allocator's habits
    _LIBC = None


def release_memory():
    """Give freed memory back to the system: collect the cycles an nn.Module leaves, then ask glibc to return its
    free heap (freed tensors of a few MB stay in the heap otherwise, and resident memory creeps up: layer by layer
    in a conversion, chunk by chunk of experts in a sparse layer, whose freed statistics leave holes between the
    quantized experts kept)."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def decoded_weights(model, max_bytes=None, progress=None):
    """`with decoded_weights(model) as kept:` every quantized layer of the model decodes its weight once (now, one
    layer after another: progress, e.g. tqdm, wraps that loop) and its torch path reuses it until the block ends.
    Only under the torch implementation (the engine's kernels decode inside the kernel: nothing to keep; enter this
    inside `impl(...)`) and when the float32 copies fit in max_bytes (default: half the memory available now);
    `kept` says whether they were made."""
    layers = list(quantized_linears(model).values())
    need = sum(4 * m.in_features * m.out_features for m in layers)
    if max_bytes is None:
        available = available_memory()
        max_bytes = float("inf") if available is None else available // 2
    kept = bool(layers) and need <= max_bytes and get_impl() == "torch"
    try:
        if kept:
            for layer in progress(layers) if progress else layers:
                layer._keep_decoded = True
                layer.cached_weight()
        yield kept
    finally:
        for layer in layers:
            layer._keep_decoded, layer._decoded = False, None


def quantized_linears(model, heads=False):
    """{name: module} for every QuantLinear in the model but a quantized lm_head and the layer of a QuantEmbedding
    (what the methods quantize; heads=True: those too)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)
            and (heads or not (name == "lm_head" or name.endswith("embed_tokens.layer")))}


class QuantEmbedding(nn.Module):
    """An embedding kept in its stored quantized type: `layer`, a QuantLinear [vocab, hidden] (a tied lm_head is
    that same module), whose rows are decoded as the ids ask for them. ids [...] -> float32 [..., hidden]."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, ids):
        return self.layer.rows(ids.reshape(-1)).reshape(*ids.shape, self.layer.in_features)


def model_bits(model):
    """Bits per weight of the model's quantized linears: every bit they store (codes, scales, offsets, indices) over
    their weights; None when nothing is quantized."""
    layers = quantized_linears(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return sum(layer.storage_bits() for layer in layers) / weights if weights else None


# The linears of a decoder layer, in forward order, grouped into the steps whose members read the same input.
SEQUENTIAL_STEPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                    ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def moe_config(cfg):
    """Whether a model's config is a MoE one (config.Qwen3MoeConfig, the one that counts experts; asked by its
    fields, so that a method's module need not import the model's config nor list its model types)."""
    return getattr(cfg, "num_experts", None) is not None


def model_cfg(module):
    """The model's config, from the model or one of its decoder layers."""
    return getattr(module, "cfg", None) or getattr(getattr(module, "self_attn", None), "cfg", None)


def is_moe(module):
    """Whether a model, or a decoder layer of one (a dense layer included), is a MoE model's."""
    return moe_config(model_cfg(module))


def experts_of(layer):
    """A decoder layer's experts (an nn.ModuleList), None for a dense layer."""
    return getattr(getattr(layer, "mlp", None), "experts", None)


def sequential_steps(layer):
    """A decoder layer's SEQUENTIAL_STEPS; in a sparse (MoE) layer the two MLP steps hold the shared expert's linears
    where there is one (mlp.shared_expert.gate_proj ...), then every expert's (mlp.experts.E.gate_proj and up_proj,
    then each down_proj), each expert reading its own tokens."""
    mlp, experts = getattr(layer, "mlp", None), experts_of(layer)
    if experts is None:
        return SEQUENTIAL_STEPS
    owners = ["mlp.shared_expert."] * hasattr(mlp, "shared_expert") + [f"mlp.experts.{e}." for e in range(len(experts))]
    return SEQUENTIAL_STEPS[:2] + tuple(tuple(owner + name.removeprefix("mlp.") for owner in owners for name in step)
                                        for step in SEQUENTIAL_STEPS[2:])


def input_owner(name):
    """The linear whose input `name` reads: the first of its sequential step within its own module (k_proj and
    v_proj read q_proj's; up_proj its own MLP's or expert's gate_proj's); any other linear its own."""
    parent, _, leaf = name.rpartition(".")
    for step in SEQUENTIAL_STEPS:
        leaves = [n.rpartition(".")[2] for n in step]
        if leaf in leaves:
            return f"{parent}.{leaves[0]}" if parent else leaves[0]
    return name


def linear_names(model):
    """The names of the model's nn.Linear layers that quantization replaces: all but lm_head, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


def _same(a, b):
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def replace_linears(model, make_layer, names=None):
    """Replace the model's nn.Linear layers (all but lm_head, or those in `names`) by make_layer(name, linear).

    Returns {name: new layer}. This is how every method quantizes a whole model: embeddings, norms and the
    (tied) lm_head stay dense.
    """
    replaced = {}
    chosen = [name for name in linear_names(model) if names is None or name in names]
    # a bar only where it takes long (delay) and only on a terminal (disable=None): trellis and lattice rows
    for name in tqdm(chosen, desc="linears", unit="linear", leave=False, delay=2, disable=None):
        linear = model.get_submodule(name)
        layer = make_layer(name, linear)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        replaced[name] = layer
    return replaced
