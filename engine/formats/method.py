"""How a quantization method lives in a checkpoint (`CheckpointMethod`) and the options it takes (`Option`): what
formats/quantized_checkpoints.py's registry holds, one per method, and the one check of a method's options."""
import dataclasses
import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Callable

import torch


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
    it; each quantized linear's tensors sit under the linear's name). quantized_checkpoints.py keeps the registry.

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
      lazy_experts  bool: quantize_layer reaches a sparse layer's experts only through its captures (which read each
                as a run first needs it: LayerCalibration's load), so the streaming converter leaves them on disk until
                then and a layer's float experts are held a chunk at a time (GPTQ: numerics/experts.chunked_steps)
      rules     optional options -> None: what the options must satisfy together (ValueError naming them)
      fits      (Qwen3Config, options) -> None: what the options need of the model's shapes (ValueError), from its
                config alone, before any work (a GPTQ bits budget the row widths cannot meet)
      book_defaults  options -> {keyword: value}: what the book's save_quantized(model, dir, method, ids,
                group_size=128, act_order=False) means when a keyword is not given (GPTQ: group 128, natural
                order), for the options given
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
    lazy_experts: bool = False
    rules: Callable | None = None
    fits: Callable = lambda cfg, options: None
    book_defaults: Callable = lambda options: {}

    def checked(self, options, together=True):
        """options {keyword: value} -> the same, once every keyword is one this method takes and every value one it
        accepts, and (together=True) the options agree (rules); a ValueError naming the keyword, the value and what
        it must be otherwise."""
        for key, value in options.items():
            if key not in self.options:
                close = difflib.get_close_matches(key.replace("-", "_"), list(self.options), 1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"method {self.name!r} takes no option {key!r}{hint}; it takes {sorted(self.options)}")
            option = self.options[key]
            if not (value is None and option.default is None) and not option.accepts(value):
                raise ValueError(f"option {key} of method {self.name!r} must be {option.expect}, got {value!r}"[:300])
        if together and self.rules is not None:
            self.rules(options)
        return options


@dataclass(frozen=True)
class Option:
    """One keyword a quantizer takes: the values it accepts (`accepts(value)`, described by `expect` in the error
    that refuses one) and its default, which `options_for` reads from the quantizer's signature. A default of None
    means "not given", always accepted."""
    accepts: Callable
    expect: str
    default: object = None


def options_for(quantizer, **accepts):
    """{keyword: Option} of a quantizer (its quantize_layer, or an options class): each keyword's default read from
    its signature, the one place it is written, and what each accepts from `accepts` {keyword: Option}. Every
    keyword with a default is described, and only those (a TypeError when the file is imported otherwise)."""
    defaults = {k: p.default for k, p in inspect.signature(quantizer).parameters.items() if p.default is not p.empty}
    if defaults.keys() != accepts.keys():
        raise TypeError(f"{quantizer.__qualname__} takes {sorted(defaults)}; accepted values are given for "
                        f"{sorted(accepts)}")
    return {k: dataclasses.replace(accepts[k], default=defaults[k]) for k in defaults}


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_option(low, high=None, also=()):
    """An int in [low, high] (high None: no bound), or one of the values `also` (e.g. -1: one group per row)."""
    bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Option(lambda v: (_is_int(v) and v >= low and (high is None or v <= high)) or (
        _is_int(v) and v in also), bound + (f" (or {', '.join(map(str, also))})" if also else ""))


def number_option(low, high=None, open_low=False):
    """A finite number in [low, high] ((low, high] with open_low; high None: no bound)."""
    left = "(" if open_low else "["
    bound = f"a number in {left}{low}, {high}]" if high is not None else f"a number {'>' if open_low else '>='} {low}"
    return Option(lambda v: _is_number(v) and (v > low if open_low else v >= low) and (
        high is None or v <= high), bound)


def choice_option(choices):
    choices = tuple(choices)
    return Option(lambda v: isinstance(v, (str, bool, int)) and v in choices, f"one of {', '.join(map(repr, choices))}")


def bool_option():
    return Option(lambda v: isinstance(v, bool), "true or false")
