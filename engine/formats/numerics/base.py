"""What every quantized linear layer shares.

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
import difflib
import math
from dataclasses import dataclass, field
from typing import Callable

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

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.in_features * self.out_features)

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


def quantized_linears(model):
    """{name: module} for every QuantLinear in the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def model_bits(model):
    """Bits per weight of the model's quantized linears: every bit they store (codes, scales, offsets, indices) over
    their weights; None when nothing is quantized."""
    layers = quantized_linears(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return sum(layer.storage_bits() for layer in layers) / weights if weights else None


def linear_names(model):
    """The names of the model's nn.Linear layers that quantization replaces: all but lm_head, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


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


def config_field(config, key, default, kind, valid=None, expected=None):
    """config[key] (default when absent), required to be exactly of type `kind` (a bool is not an int, an int is
    not a str) and, if `valid` is given, to pass it; anything else is a ValueError naming the field. What a
    quantization_config says changes the meaning of the bits, so nothing in it is coerced."""
    value = config.get(key, default)
    right_type = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if not right_type or (valid is not None and not valid(value)):
        raise ValueError(f"quantization_config field {key!r} must be {expected or kind.__name__}, got {value!r}")
    return value


def matrix_shape(t, name="weight_shape"):
    """A stored (out, in) pair, integer [2], as two positive ints; ValueError naming the tensor otherwise."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or tuple(t.shape) != (2,) or not bool((t > 0).all()):
        values = t.tolist() if t.numel() <= 4 else f"shape {tuple(t.shape)}"
        raise ValueError(f"{name} must be two positive integers (out, in), got {t.dtype} {values}")
    return tuple(int(v) for v in t.tolist())


def scale_tensor(t, name="scales"):
    """A stored scale tensor: a 16- or 32-bit float (an integer or FP8 tensor is another format); ValueError
    otherwise. Returns it unchanged."""
    if not t.dtype.is_floating_point or t.element_size() < 2:
        raise ValueError(f"{name} must be a 16- or 32-bit float tensor, got {t.dtype}")
    return t


@dataclass(frozen=True)
class CheckpointMethod:
    """How one quantization method lives in a Hugging Face style checkpoint (config.json's quantization_config names
    it; each quantized linear's tensors sit under the linear's name). formats/quantized_checkpoints.py keeps the registry.

      name      quantization_config["quant_method"] (or a registry key for a sub-format)
      parts     quantization_config -> the tensor suffixes one layer needs (e.g. ("qweight", "qzeros", ...))
      read      (parts {suffix: tensor}, quantization_config) -> QuantLinear (bias, if any, arrives in parts["bias"])
      write     (layer, quantization_config) -> {suffix: tensor}
      quantize  (model, calibration_ids or None, **options) -> quantization_config; replaces the model's linears
      validate  optional quantization_config -> the same config checked (ValueError naming the field) and with its
                defaults filled in; run once per checkpoint, before parts / read / write see it
      finish    optional (model, quantization_config) -> None, run once every layer is loaded (e.g. EntQuant
                attaches its shared per-block decoder)
      quantize_layer  (calibration.LayerCalibration, **options) -> quantization_config: quantize one decoder layer
                in place; what `quantize` runs on every layer, and what the streaming converter runs on layers
                read from disk one at a time
      calibration  options -> None (data-free), "quantized" or "float": which calibration inputs each layer needs
                (those that passed through the quantized layers before it, or through the float ones)
      output_fisher  options -> bool: whether each layer needs the float model's output Fisher (sensitivity.py; the
                GPTQ mix's planner prices its candidates with it), measured once before the first layer
      options   {keyword: Option}: every option quantize / quantize_layer take, its default and the values it accepts
      rules     optional options -> None: what the options must satisfy together (ValueError naming them)
      fits      (Qwen3Config, options) -> None: what the options need of the model's shapes (ValueError), from its
                config alone, before any work (a GPTQ bits budget the row widths cannot meet)
    `checked(options)` applies both: the one check of a method's options, made by the CLI before anything loads and
    by the library (save_quantized, the converter, each method's quantize) before any work.
    """
    name: str
    parts: Callable
    read: Callable
    write: Callable
    quantize: Callable
    validate: Callable | None = None
    finish: Callable | None = None
    quantize_layer: Callable | None = None
    calibration: Callable = lambda options: None
    output_fisher: Callable = lambda options: False
    options: dict = field(default_factory=dict)
    rules: Callable | None = None
    fits: Callable = lambda cfg, options: None

    def checked(self, options):
        """options {keyword: value} -> the same, once every keyword is one this method takes and every value one it
        accepts, and the options agree (rules); a ValueError naming the keyword, the value and what it must be
        otherwise."""
        for key, value in options.items():
            if key not in self.options:
                close = difflib.get_close_matches(key.replace("-", "_"), list(self.options), 1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"method {self.name!r} takes no option {key!r}{hint}; it takes {sorted(self.options)}")
            option = self.options[key]
            if not (value is None and option.default is None) and not option.accepts(value):
                raise ValueError(f"option {key} of method {self.name!r} must be {option.expect}, got {value!r}"[:300])
        if self.rules is not None:
            self.rules(options)
        return options


@dataclass(frozen=True)
class Option:
    """One keyword a quantizer takes: its default, and the values it accepts (`accepts(value)`, described by
    `expect` in the error that refuses one). A default of None means "not given", always accepted."""
    default: object
    accepts: Callable
    expect: str


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_option(default, low, high=None, also=()):
    """An int in [low, high] (high None: no bound), or one of the values `also` (e.g. -1: one group per row)."""
    bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Option(default, lambda v: (_is_int(v) and v >= low and (high is None or v <= high)) or (
        _is_int(v) and v in also), bound + (f" (or {', '.join(map(str, also))})" if also else ""))


def number_option(default, low, high=None, open_low=False):
    """A finite number in [low, high] ((low, high] with open_low; high None: no bound)."""
    left = "(" if open_low else "["
    bound = f"a number in {left}{low}, {high}]" if high is not None else f"a number {'>' if open_low else '>='} {low}"
    return Option(default, lambda v: _is_number(v) and (v > low if open_low else v >= low) and (
        high is None or v <= high), bound)


def choice_option(default, choices):
    choices = tuple(choices)
    return Option(default, lambda v: isinstance(v, (str, bool, int)) and v in choices,
                  f"one of {', '.join(map(repr, choices))}")


def bool_option(default):
    return Option(default, lambda v: isinstance(v, bool), "true or false")
