"""EntQuant: Float8 weights pushed towards low entropy, coded losslessly with rANS, decoded block by block.

Quantization (per linear, data-free; engine/formats/entropy_scales.py). One scale per output channel, kept as its
log2 s [out]:

    Q     = E4M3(clamp(W * 2^-s, -448, 448))           (Int8: round, clamp to +-127)
    W_hat = Q * 2^s
    loss  = ||W_hat - W||_1 / ||W||_1 + lambda * R(Q),  R = 4 * mean|Q| (Float8)  or  mean|Q| / 128 (Int8)

The l1 norm of Q is a differentiable stand-in for its entropy: shrinking it pushes weights into E4M3's subnormal
range, where the grid is uniform and coarse, so fewer distinct byte values occur; L-BFGS minimizes over s, one layer
at a time. Int8 keeps a handful of "super weights" (the largest magnitudes) exact beside the codes.

Coding. The E4M3 bytes (-0 mapped to +0) of all quantized linears of one transformer block form one symbol
stream, coded by engine/coding/rans.py (the empirical entropy plus under 1% at a block's size, table and lane
states counted). The stream's checksum also covers the block's side data (block_context: the block's index,
prob_bits, and each layer's fmt, shape, log2 scales and super weights), so a checkpoint whose fmt, scales or stream
changed is refused when it loads, never decoded into another model.

Runtime. The model keeps only each block's stream; one decode buffer (uint8, the largest block) is shared by all
blocks, and a forward pre-hook on every transformer layer decodes that block into it just before the layer runs.
The matmul reads the buffer's E4M3 (or int8) bytes and applies 2^s per output channel.

Sensitivity (our addition, optional: sensitivity="fisher"). The reconstruction term becomes
sum_j phi_j / Z ||W_hat_j - W_j||^2 / n_layer, phi_j / Z the diagonal Fisher information of row j on the model's own
samples, normalized over the whole model (numerics/sensitivity.py): a second-order estimate of the KL that the
layer's error costs, so one lambda trades rate against it in every layer alike (sensitive rows get finer steps).

Error feedback (our addition, optional: feedback="self"; engine/formats/entropy_feedback.py). The same scales,
format and streams, but each row's codes are chosen column by column with GPTQ's error feedback, the Hessians
taken from text the model writes itself (still no calibration data), or with feedback="calibration" from calibration
text, block by block (data-aware; the streaming converter runs it too).

Rate control (engine/formats/entropy_rate.py). lambda -> bits per weight is close to log-linear; a shipped table
seeds a bracketing search on lambda that meets a bpw target (coded bytes of everything, scales included).
"""
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from ..console import log
from ..coding.rans import PROB_BITS
from ..coding.rans_fast import rans_encode_many
from .numerics import calibration, experts
from ..layers import QuantLinear, replace_linears
from .method import CheckpointMethod, choice_option, config_field, int_option, matrix_shape, number_option, options_for
from .entropy_decoder import BlockDecoder, block_context
from .entropy_feedback import check_damp, feedback_weight, parse_feedback, self_hessians
from .entropy_rate import lambda_for_bpw, load_lambda_table
from .entropy_scales import CODE_MAX, entquant_scales, super_weight_mask
from .numerics.minifloats import E4M3_HALF_SHIFT, E4M3_MAX, e4m3_halves
from .numerics.sensitivity import fisher_importance, parse_sensitivity, self_generated_ids


# ---- the codes ------------------------------------------------------------------------------------------------

def encode_weight(weight, log_scale, fmt="float8", keep=None):
    """weight [out, in] + log2 scales [out] -> codes uint8 [out, in] (E4M3 or int8 bytes; -0 stored as +0, so one
    symbol stands for zero). Weights marked in keep are coded as 0 (they are stored exactly beside)."""
    x = weight.detach().float() * torch.exp2(-log_scale.float())[:, None]
    if keep is not None:
        x = x.masked_fill(keep, 0.0)
    if fmt == "float8":
        codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.where(codes == 0x80, torch.zeros_like(codes), codes)
    return x.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)


def decode_weight(codes, log_scale, fmt="float8"):
    """codes uint8 [out, in] + log2 scales [out] -> weight [out, in] float32 (super weights not included)."""
    values = codes.view(torch.float8_e4m3fn if fmt == "float8" else torch.int8).float()
    return values * torch.exp2(log_scale.float())[:, None]


# ---- the layer, the side data of a block, the per-model block decoder --------------------------------------------

class EntQuantLinear(QuantLinear):
    """One linear of an EntQuant block: log2 scales float16 [out], Int8 super weights (flat indices int32 [k],
    exact values float32 [k]; k = 0 for Float8) and, for the FIRST linear of its block only, the whole block's rANS
    stream (uint8 [bytes]; an empty tensor for the others). Its codes [out, in] live in a BlockDecoder's shared
    buffer at buffer_offset while its block (block_index) is decoded there; the decoder sets both with bind(), and
    stream_bits, this layer's share of the block stream (by weight count; the shares add up to the stream's size).
    storage_bits: stream_bits + 16 per scale + 64 per super weight."""

    def __init__(self, in_features, out_features, log_scale, fmt="float8", stream=None, super_index=None,
                 super_value=None, bias=None):
        if fmt not in CODE_MAX:
            raise ValueError(f"fmt must be one of {sorted(CODE_MAX)}, got {fmt!r}")
        if tuple(log_scale.shape) != (out_features,):
            raise ValueError(f"log_scale has shape {tuple(log_scale.shape)}, expected ({out_features},)")
        super().__init__(in_features, out_features, bias)
        self.fmt = fmt
        idx = torch.zeros(0, dtype=torch.int32) if super_index is None else super_index.to(torch.int32)
        val = torch.zeros(0) if super_value is None else super_value.float()
        if idx.shape != val.shape or (idx.numel() and (idx.min() < 0 or idx.max() >= in_features * out_features)):
            raise ValueError("super weights: indices and values must match and lie inside the weight")
        self.register_buffer("log_scale", log_scale.to(torch.float16).contiguous())
        self.register_buffer("stream", (torch.zeros(0, dtype=torch.uint8) if stream is None
                                        else stream.to(torch.uint8).reshape(-1).contiguous()))
        self.register_buffer("super_index", idx.contiguous())
        self.register_buffer("super_value", val.contiguous())
        self.register_buffer("held", None)              # its own codes uint8 [out, in] once hold_codes decoded them
        self.decoder, self.block_index, self.buffer_offset, self.stream_bits = None, None, 0, None

    def bind(self, decoder, block_index, buffer_offset, stream_bits):
        """Make this layer's codes decoder's buffer[buffer_offset : + out * in] while block block_index is decoded
        there; stream_bits: its share of the block stream."""
        self.decoder, self.block_index, self.buffer_offset, self.stream_bits = (decoder, block_index, buffer_offset,
                                                                                stream_bits)

    def codes(self):
        """The layer's codes uint8 [out, in]: its own once hold_codes gave them, else its block's share of the
        decoder's buffer (decoding the block first if the buffer holds another one)."""
        if self.held is not None:
            return self.held
        if self.decoder is None:
            raise ValueError("EntQuantLinear is not attached to a block decoder: call "
                             "engine.formats.entropy.attach_decoder(model) after building or loading the model")
        buffer = self.decoder.decode(self.block_index)
        size = self.out_features * self.in_features
        return buffer[self.buffer_offset:self.buffer_offset + size].view(self.out_features, self.in_features)

    def dequantize(self):
        w = decode_weight(self.codes(), self.log_scale, self.fmt)
        if self.super_index.numel():
            w.view(-1)[self.super_index.long()] = self.super_value
        return w

    def decode_rows(self, out, start, stop):
        """Rows start:stop. Float8: the codes as e4m3_halves (values * 2^-8), returning the row scales 2^s * 2^8 the
        outputs still need (the products by them are dequantize's). Int8: the codes times 2^s, then the super
        weights of those rows."""
        codes, scale = self.codes()[start:stop], torch.exp2(self.log_scale[start:stop].float())
        if self.fmt == "float8":
            out.copy_(e4m3_halves(codes))
            return scale * E4M3_HALF_SHIFT
        out.copy_(codes.view(torch.int8))
        out.mul_(scale[:, None])
        if self.super_index.numel():
            first, last = start * self.in_features, stop * self.in_features
            inside = (self.super_index >= first) & (self.super_index < last)
            out.view(-1)[self.super_index[inside].long() - first] = self.super_value[inside]

    def int8_rows(self):
        """(codes int8 [out, in], row scales float32 [out]) with the weight = codes * scales[:, None] (super weights
        aside), or None: Int8 codes as they are; Float8 bytes as c = 512 v where every |v| < 0.25 (each then a
        multiple of 2^-9, E4M3's finest step, that fits an int8: a low-rate model's codes all are). What
        engine.runtime_forms.Int8RowsLinear multiplies by."""
        codes, scale = self.codes(), torch.exp2(self.log_scale.float())
        if self.fmt == "int8":
            return codes.view(torch.int8), scale
        if bool(((codes & 0x7F) > 0x27).any()):                 # 0x27 = 0.234375, 0x28 = 0.25: 128 steps of 2^-9
            return None
        return (codes.view(torch.float8_e4m3fn).float() * 512).to(torch.int8), scale / 512

    def kernel_matmul(self, x2d):
        from ..kernels import triton_formats      # Triton: imported by the engine path only
        y = triton_formats.entquant_matmul(x2d, self.codes(), torch.exp2(self.log_scale.float()), self.fmt)
        if self.super_index.numel():                            # y[:, o] += x[:, i] * (w_super - 0): codes hold 0
            rows, cols = self.super_index.long() // self.in_features, self.super_index.long() % self.in_features
            y.index_add_(1, rows, x2d[:, cols] * self.super_value)
        return y

    def storage_bits(self):
        if self.stream_bits is None:
            raise ValueError("EntQuantLinear is not attached to a block decoder (its stream share is unknown)")
        return self.stream_bits + 16 * self.out_features + 64 * self.super_index.numel()

    def extra_repr(self):
        bits = "?" if self.stream_bits is None else f"{self.bits_per_weight:.3f}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, bits={bits}"


def _blocks_of(model):
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("EntQuant decodes per transformer block: the model needs model.model.layers")
    return model.model.layers


def attach_decoder(model, prob_bits=PROB_BITS):
    """Give every EntQuantLinear of the model one shared BlockDecoder (which checks each block's stream) and put a
    forward pre-hook on each transformer layer that has them. Called after quantizing and after loading a
    checkpoint (prob_bits: what its quantization_config says); calling it again replaces the old decoder. Returns
    the decoder."""
    blocks = {i: layers for i, block in enumerate(_blocks_of(model))
              if (layers := [m for m in block.modules() if isinstance(m, EntQuantLinear)])}
    seen = {id(m) for layers in blocks.values() for m in layers}
    strays = [n for n, m in model.named_modules() if isinstance(m, EntQuantLinear) and id(m) not in seen]
    if strays:
        raise ValueError(f"EntQuant layers outside model.model.layers: {strays[:3]}")
    decoder = BlockDecoder(blocks, prob_bits)
    for i, block in enumerate(_blocks_of(model)):
        _hook_block(block, decoder if i in blocks else None, i)
    model.entquant_decoder = decoder
    return decoder


def _hook_block(block, decoder, index):
    """Make transformer layer `block` decode block `index` with `decoder` before it runs (None: no hook), replacing
    the hook it had."""
    if getattr(block, "_entquant_hook", None) is not None:
        block._entquant_hook.remove()
    block._entquant_hook = None if decoder is None else block.register_forward_pre_hook(
        functools.partial(decoder.pre_hook, index))


# ---- whole models: quantize, rate control ------------------------------------------------------------------------

def _block_linears(model):
    """{block index: [(name, nn.Linear), ...]} in module order: the linears EntQuant replaces."""
    found = {i: [(f"model.layers.{i}.{n}", m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
             for i, block in enumerate(_blocks_of(model))}
    return {i: named for i, named in found.items() if named}


def compress_blocks(linears, lam, fmt="float8", super_weights=8, max_iter=500, lanes=None, importance=None,
                    hessians=None, damp=0.01, by_rows=lambda fn, *rows: fn(*rows)):
    """{block: [(name, nn.Linear)]} -> ({name: EntQuantLinear, not yet bound to a decoder}, total bits, weight
    count). Each block's stream, bound to its block_context, sits in the block's first layer. super_weights applies
    to Int8 only; importance: {name: [out]} from fisher_importance, or None for the paper's loss; hessians:
    {name: [in, in]} from self_hessians for the error feedback (damp: its dampening), or None for the paper's nearest
    codes. by_rows(fn, *rows): how the feedback runs on the rows (LayerCalibration.by_rows: cut over the ranks)."""
    layers, bits, count, blocks, symbols = {}, 0, 0, {}, {}
    for i, named in linears.items():
        block, codes = blocks.setdefault(i, []), []
        for name, linear in named:
            w = linear.weight.detach().float()
            keep = super_weight_mask(w, super_weights) if fmt == "int8" else None
            s = entquant_scales(w, lam, fmt, max_iter=max_iter, keep=keep,
                                importance=None if importance is None else importance[name])
            if hessians is not None:                      # per row given H: the ranks may share the rows out
                [target] = by_rows(lambda w, s, keep, H=hessians[name]: (feedback_weight(w, s, H, fmt, keep, damp),),
                                   w, s, keep)
            else:
                target = w
            codes.append(encode_weight(target, s, fmt, keep).reshape(-1))
            idx = torch.zeros(0, dtype=torch.int32) if keep is None else keep.reshape(-1).nonzero()[:, 0].int()
            layers[name] = EntQuantLinear(w.shape[1], w.shape[0], s, fmt, None, idx, w.reshape(-1)[idx.long()],
                                          linear.bias)
            block.append(layers[name])
            bits += 16 * s.numel() + 64 * idx.numel()
            count += w.numel()
        symbols[i] = torch.cat(codes)
    streams = rans_encode_many(list(symbols.values()), lanes=lanes,          # coded side by side: one pass
                               contexts=[block_context(i, blocks[i]) for i in symbols])
    for i, stream in zip(symbols, streams):
        blocks[i][0].stream = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        bits += 8 * len(stream)
    return layers, bits, count


@dataclass(frozen=True)
class EntQuantOptions:
    """EntQuant's options, the one place their defaults live (OPTIONS, the CLI's checks, are made from them):
      lam / bpw        exactly one: lambda, or a target in coded bits per weight reached within tol
      fmt              "float8" (E4M3 codes) or "int8" (with super_weights largest weights kept exact)
      max_iter, lanes  L-BFGS iterations per layer's scales; rANS lanes (None: the coder's default)
      sensitivity      None or "fisher" (weights rows by the Fisher information of fisher_samples own sequences)
      feedback         None, "self" (Hessians of feedback_samples own sequences) or "calibration" (of the
                       calibration text, block by block); feedback_damp: their dampening
    """
    lam: float | None = None
    bpw: float | None = None
    fmt: str = "float8"
    super_weights: int = 8
    max_iter: int = 500
    lanes: int | None = None
    tol: float = 0.05
    sensitivity: str | None = None
    fisher_samples: int = 64
    feedback: str | None = None
    feedback_samples: int = 64
    feedback_damp: float = 0.01

    @classmethod
    def parsed(cls, options, whole_model=True, rate=True):
        """options {keyword: value} -> EntQuantOptions, every value checked (CHECKPOINT.checked: the types and
        ranges) and the knobs that go together checked together; sensitivity / feedback "none" become None.
        whole_model: False for quantize_layer, which cannot run what needs the whole model in memory; rate=False
        leaves lam / bpw unchecked (the converter asks what calibration a run needs before it has them)."""
        o = cls(**CHECKPOINT.checked(options, together=False))
        if rate and (o.lam is None) == (o.bpw is None):
            raise ValueError("give exactly one of lam (lambda) or bpw (target bits per weight)")
        o = dataclasses.replace(o, sensitivity=parse_sensitivity(o.sensitivity), feedback=parse_feedback(o.feedback))
        check_damp(o.feedback_damp)
        if not whole_model and (o.sensitivity is not None or o.feedback == "self"):
            raise ValueError("sensitivity='fisher' and feedback='self' need the whole model in memory to write "
                             "their own text (engine.formats.entropy.quantize); feedback='calibration' works block "
                             "by block")
        if o.sensitivity is not None and o.feedback == "calibration":
            raise ValueError("sensitivity='fisher' weighs the whole model's rows at once; it does not combine with "
                             "feedback='calibration', which works block by block")
        return o


def _entquant(linears, o, importance=None, hessians=None, say=None, by_rows=lambda fn, *rows: fn(*rows)):
    """The one body of quantize and quantize_layer: the blocks' linears {block: [(name, linear)]} compressed at
    lambda = o.lam, or at the lambda the shipped table and a search find for o.bpw -> (the layers {name:
    EntQuantLinear}, the quantization_config). say(text): a progress line per lambda tried."""
    found = {}

    def measure(lam_):
        start = time.time()
        found[lam_] = compress_blocks(linears, lam_, o.fmt, o.super_weights, o.max_iter, o.lanes, importance,
                                      hessians, o.feedback_damp, by_rows)
        _, bits, count = found[lam_]
        if say is not None:
            say(f"entquant: lambda {lam_:.4g} -> {bits / count:.3f} bits per weight ({time.time() - start:.1f} s)")
        return bits / count

    lam = o.lam
    if o.bpw is not None:
        lam, _ = lambda_for_bpw(o.bpw, measure, load_lambda_table(o.fmt, o.sensitivity, o.feedback), tol=o.tol)
    else:
        measure(lam)
    layers, bits, count = found[lam]
    return layers, {"quant_method": "entquant", "fmt": o.fmt, "lambda": lam, "bits_per_weight": bits / count,
                    "sensitivity": o.sensitivity, "feedback": o.feedback,
                    **({"feedback_damp": o.feedback_damp} if o.feedback else {}),
                    "coding_unit": "transformer block", "coder": "rANS", "prob_bits": PROB_BITS}


def quantize(model, calibration_ids=None, **options):
    """EntQuant, data-free (calibration_ids is used by feedback="calibration" only): replace every linear of every
    transformer block by an EntQuantLinear, IN PLACE. options: EntQuantOptions' keywords (lam or bpw, reached
    within tol by searching lambda; feedback="calibration" runs quantize_layer on each block, its lambda searched
    per block). Returns the quantization_config."""
    o = EntQuantOptions.parsed(options)
    calibration.check_unquantized(model)
    CHECKPOINT.fits(model.cfg, dict(sensitivity=o.sensitivity, feedback=o.feedback))
    if o.feedback == "calibration":                       # block by block, as GPTQ walks the model
        config = calibration.by_layer(model, CHECKPOINT, calibration_ids, **options)
        attach_decoder(model)
        return config
    linears = _block_linears(model)
    names = [n for named in linears.values() for n, _ in named]
    importance = hessians = None
    if o.sensitivity == "fisher":
        start = time.time()
        importance = fisher_importance(model, names, self_generated_ids(model, o.fisher_samples))
        log(f"entquant: Fisher sensitivities from {o.fisher_samples} self-generated sequences "
            f"({time.time() - start:.1f} s)")
    if o.feedback == "self":
        start = time.time()
        hessians = self_hessians(model, names, self_generated_ids(model, o.feedback_samples))
        log(f"entquant: Hessians from {o.feedback_samples} self-generated sequences ({time.time() - start:.1f} s)")
    layers, config = _entquant(linears, o, importance, hessians, say=log)
    replace_linears(model, lambda name, linear: layers[name], names=set(layers))
    attach_decoder(model)
    return config


@torch.no_grad()
def quantize_layer(layer, **options):
    """EntQuant one transformer block (a calibration.LayerCalibration: the coding unit) in place, for the streaming
    converter: with lam, exactly what `quantize` does to this block; with bpw, lambda is searched for this block
    alone (each block then meets the target, rather than the model on average). feedback="calibration" takes the
    error feedback's Hessians from the calibration batches that reach the block (through the quantized blocks
    before it: the block gets its own decoder and hook, so that its outputs feed the next); the Fisher-weighted loss and
    feedback="self" need the whole model (its gradients, its self-generated text) and are refused here. Returns the
    quantization_config."""
    o = EntQuantOptions.parsed(options, whole_model=False)
    linears = {layer.index: [(name, layer.module(name)) for name in layer.linear_names()]}
    hessians = None
    if o.feedback == "calibration":
        stats = layer.capture([name.removeprefix(layer.prefix) for name, _ in linears[layer.index]])
        hessians = {name: s.hessian for name, s in stats.items()}
    layers, config = _entquant(linears, o, hessians=hessians, by_rows=layer.by_rows)
    placed = layer.replace(lambda name, linear: layers[name], names=set(layers))
    if o.feedback == "calibration":               # the next block's inputs pass through this one, quantized
        # the modules now in the block (with several processes, copies sent by the rank that made each)
        named = [placed[name.removeprefix(layer.prefix)] for name, _ in linears[layer.index]]
        _hook_block(layer.layer, BlockDecoder({layer.index: named}), layer.index)
    return config


def _calibration(options):
    """The calibration inputs quantize_layer needs with these options: those the blocks quantized before it pass on
    (feedback='calibration') or none (data-free); what it cannot run is refused here, before any work."""
    o = EntQuantOptions.parsed(options, whole_model=False, rate=False)
    return "quantized" if o.feedback == "calibration" else None


def resident_bytes(model):
    """What an EntQuant model keeps for its quantized linears at run time vs dense float32 and bfloat16:
    {"compressed", "buffer", "resident", "dense_f32", "dense_bf16"} in bytes."""
    decoder = getattr(model, "entquant_decoder", None)
    if decoder is None:
        raise ValueError("model has no EntQuant decoder (quantize or attach_decoder first)")
    layers = [m for ms in decoder.blocks.values() for m in ms]
    packed = sum(m.stream.numel() + 2 * m.log_scale.numel() + 8 * m.super_index.numel() for m in layers)
    buffer, weights = max(decoder.sizes.values()), sum(decoder.sizes.values())
    return {"compressed": packed, "buffer": buffer, "resident": packed + buffer,
            "dense_f32": 4 * weights, "dense_bf16": 2 * weights}


# ---- checkpoint --------------------------------------------------------------------------------------------------
# The coding unit is a block but the registry stores tensors per linear: each block's stream is stored under its
# FIRST linear (`model.layers.{i}.self_attn.q_proj.weight_stream`), the other linears of the block store an empty
# one. Once all layers are read, attach_decoder (`finish`) links them to the shared buffer again, checking each
# stream's size and its checksum over the stream, the config's fmt and prob_bits, and the block's scales.

_PARTS = ("weight_stream", "weight_log_scale", "weight_shape", "super_index", "super_value")


def _write(layer, quantization_config):
    return {"weight_stream": layer.stream, "weight_log_scale": layer.log_scale,
            "weight_shape": torch.tensor([layer.out_features, layer.in_features], dtype=torch.int64),
            "super_index": layer.super_index, "super_value": layer.super_value}


def validate(quantization_config):
    """An EntQuant quantization_config, checked once: the code format and the table precision (both also bound to
    the streams by their checksum)."""
    fmt = config_field(quantization_config, "fmt", "float8", str, lambda f: f in CODE_MAX, f"one of {sorted(CODE_MAX)}")
    prob_bits = config_field(quantization_config, "prob_bits", PROB_BITS, int, lambda p: 1 <= p <= 15, "in 1..15")
    return {**quantization_config, "fmt": fmt, "prob_bits": prob_bits}


def _read(parts, quantization_config):
    out_f, in_f = matrix_shape(parts["weight_shape"])
    return EntQuantLinear(in_f, out_f, parts["weight_log_scale"], quantization_config.get("fmt", "float8"),
                          parts["weight_stream"], parts["super_index"], parts["super_value"], parts.get("bias"))


def finish_loading(model, quantization_config):
    """After every layer of a checkpoint is in place: rebuild the shared decoder and the pre-hooks."""
    attach_decoder(model, quantization_config.get("prob_bits", PROB_BITS))


BPW_RANGE = (1.5, 6.0)            # the bits a lambda in the shipped table reaches
OPTIONS = options_for(EntQuantOptions, lam=number_option(0, 1e6, open_low=True), bpw=number_option(*BPW_RANGE),
                      fmt=choice_option(CODE_MAX), super_weights=int_option(0, 1 << 16),
                      max_iter=int_option(1, 100_000), lanes=int_option(1, 1 << 16),
                      tol=number_option(0, 1, open_low=True), sensitivity=choice_option(("none", "fisher")),
                      fisher_samples=int_option(1, 1 << 16), feedback=choice_option(("none", "self", "calibration")),
                      feedback_samples=int_option(1, 1 << 16), feedback_damp=number_option(0, 1))
CHECKPOINT = CheckpointMethod(name="entquant", parts=lambda quantization_config: _PARTS, read=_read, write=_write,
                              quantize=quantize, validate=validate, finish=finish_loading,
                              quantize_layer=quantize_layer, calibration=_calibration, options=OPTIONS,
                              rules=EntQuantOptions.parsed,
                              fits=lambda cfg, options: (options.get("feedback") or options.get("sensitivity")) and
                              experts.refuse(cfg, "EntQuant's feedback and sensitivity", "an expert that saw few "
                                             "calibration tokens has no Hessian or Fisher to weight it by"))
