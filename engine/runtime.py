"""Run time on the torch path: what a quantized model holds while it generates or evaluates, and how it multiplies.

A loaded checkpoint holds what its files store (a GGUF layer its blocks besides their codes). `prepare(model,
weights)` turns every quantized linear into the form it runs in, once, before the first token, and drops what that
form does not need:

  weights   a quantized linear holds                                 x @ W^T is
  compact   4-bit affine codes, groups of 32-256 (RTN, GPTQ, AWQ,    PyTorch's CPU int4 kernel: x, scales, zeros and
            GGUF Q4_0 / Q4_1 / Q4_K): int4 codes + bf16 scales       its output in bf16 (Int4Linear)
            and zeros
            8-bit affine codes (Q8_0, Q5 / IQ types, GPTQ int8):     the int4 kernel twice, q = 16 hi + lo
            two int4 planes + their bf16 scales and zeros; 5-bit     (Int8PlanesLinear); a 5-bit high plane
            codes' high plane a bit a weight                         expanded first, into the shared buffer
            8-bit codes the planes cannot take (a tied head, whose   one token: a product compiled by torch.compile
            rows the embedding reads; Q6_K's groups of 16): int8     (C++), a prompt: decoded; float32
            codes - z + float32 group scales                         (Int8Linear)
            EntQuant: its Float8 bytes, each block's stream decoded  where they are int8 multiples of one step (Int8
            once at load (or its Int8 codes), a scale per row        codes; Float8 values under 0.25, as a low-rate
                                                                     model's are): the int8 kernel, per-row scales,
                                                                     in one call (Int8RowsLinear); else decoded:
            lattice E8 / D4 / Z: its streams decoded once at load    the int8 kernel, per-row scales, the input
            into int8 codes and a scale per row                      rotated first (Int8RowsLinear)
            trellis (L <= 8): its states replayed once at load, a    decoded a few rows at a time (one gather of
            byte a weight (neighbours' pairs: int16 indices), with   value pairs, one product) into the shared
            a scale per tile                                         buffer (TableRows)
            anything else: its own codes (FP8, MXFP4, NVFP4, NF4,    decoded, a few rows at a time, into ONE float32
            A2, trellis L > 8, Q2_K, Q3_K; a GGUF F16 / BF16 linear  buffer the model shares, then one float32
            its 2 bytes a weight)                                    matmul per chunk (DecodedLinear): exact
  exact     every layer its own codes                                as above (DecodedLinear): the float32 weight
                                                                     dequantize() gives, multiplied in float32
  stream    EntQuant only: its rANS streams; one transformer block   DecodedLinear, the block decoded by its
            decoded per forward into the block buffer (the paper's)  forward pre-hook
  float32   (layers.decoded_weights) a float32 copy of every layer   one float32 matmul

The forms themselves, and the bound on the int4 and int8 kernels' bf16 rounding: engine/runtime_forms.py. `exact`
keeps every product what dequantize() says.

The embedding and a tied lm_head of a GGUF file stay in their stored type (layers.QuantEmbedding): the head is one
more quantized linear here, and the embedding reads its rows (`rows(ids)`) from the same form.
"""
import contextlib

import torch

from .formats.numerics.affine import AffineQuantLinear
from .layers import QuantEmbedding, QuantLinear, decoded_weights
from .runtime_forms import (DecodedLinear, Int4Linear, Int8Linear, Int8PlanesLinear, Int8RowsLinear, RunLinear,
                            TableRows, Workspace)

WEIGHTS = ("compact", "exact", "stream", "float32")


def form(layer, weights, workspace, rows=False):
    """The run-time form of one quantized layer for `weights` (see the module docstring); rows=True: it must give
    rows too (a tied embedding's head), which the int4 kernel's layout cannot."""
    layer = layer.compact()
    if weights == "compact" and Int4Linear.takes(layer) and not rows:
        return Int4Linear(layer)
    if weights == "compact" and Int8PlanesLinear.takes(layer) and not rows:
        return Int8PlanesLinear(layer, workspace)
    if weights == "compact" and Int8Linear.takes(layer):
        return Int8Linear(layer, workspace)
    parts = layer.int8_rows() if weights == "compact" and hasattr(layer, "int8_rows") else None
    if parts is not None:
        return Int8RowsLinear(layer, *parts)
    parts = layer.table_rows() if weights == "compact" and hasattr(layer, "table_rows") else None
    if parts is not None:
        return DecodedLinear(TableRows(layer, workspace, *parts), workspace)
    return DecodedLinear(layer, workspace)


def check_weights(model, weights):
    """The `weights` a model can take, or ValueError (one line): 'stream' is EntQuant's."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "stream" and getattr(model, "entquant_decoder", None) is None:
        raise ValueError("--weights stream keeps EntQuant's rANS streams resident and decodes one block per forward; "
                         "this model has no EntQuant layers (use compact, exact or float32)")


@torch.no_grad()
def prepare(model, weights="compact"):
    """Turn every quantized linear of the model (lm_head and a stored embedding's too) into its run-time form for
    `weights` ('compact', 'exact' or 'stream'; 'float32' is layers.decoded_weights), in place and once: the layers
    it replaces are dropped, and with them what the form does not hold. Returns the model."""
    check_weights(model, weights)
    if weights == "float32":
        raise ValueError("float32 copies are layers.decoded_weights(model), not a run-time form")
    if weights != "stream" and getattr(model, "entquant_decoder", None) is not None:
        from .formats.entropy_decoder import hold_codes
        hold_codes(model)                          # each block's stream decoded once, to its Float8 bytes
    workspace = model.runtime_workspace = Workspace()
    for block in getattr(getattr(model, "model", None), "layers", ()):
        _fuse(block.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv", weights, workspace)
        _fuse(block.mlp, ("gate_proj", "up_proj"), "gate_up", weights, workspace)
        _give_back_memory()                                 # what the block's old layers held, before the next
    tied = {id(m.layer) for m in model.modules() if isinstance(m, QuantEmbedding)}
    made = {}                  # id of a layer -> its form (a tied head is one module in two places: one form)
    parents = [m for m in model.modules() if not isinstance(m, (RunLinear, QuantLinear))]   # a form's layer stays
    for module in parents:                                  # (each old layer goes as soon as its form is made)
        for name, child in list(module.named_children()):
            if isinstance(child, QuantLinear):
                if id(child) not in made:
                    made[id(child)] = form(child, weights, workspace, rows=id(child) in tied)
                setattr(module, name, made[id(child)])
        _give_back_memory()
    if hasattr(model, "set_fast"):
        model.set_fast()
    kinds = {m.codes.shape[0] == 1: m for m in model.modules() if isinstance(m, Int8Linear)}
    for layer in kinds.values():            # the product's shapes are symbolic, but torch.compile builds a size of
        layer.build()                       # 1 apart: one build for the layers of one group, one for the others
    _give_back_memory()
    return model


def _give_back_memory():
    """Hand the memory the dropped layers held back to the system (glibc keeps freed heap pages otherwise, and the
    process's resident size would stay what loading needed)."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)                    # the process's own symbols: glibc's, where it is glibc
    except (OSError, AttributeError, TypeError):           # not glibc: nothing to trim
        pass


def _fuse(module, names, fused, weights, workspace):
    """Linears of one input (q, k, v; gate, up) as ONE run-time form of their outputs stacked, `module.<fused>`
    (qwen3.Attention.qkv, MLP.gate_up), where they are all affine layers of one grid: one product instead of
    three. The separate linears are dropped."""
    layers = [getattr(module, name, None) for name in names]
    if not all(isinstance(layer, QuantLinear) for layer in layers):
        return
    layers = [layer.compact() for layer in layers]
    first = layers[0]
    if not all(type(layer) is AffineQuantLinear and layer.perm is None and layer.dtype == first.dtype and
               (layer.bits, layer.group_size, layer.in_features) == (first.bits, first.group_size, first.in_features)
               for layer in layers):
        return
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([torch.zeros(layer.out_features) if layer.bias is None else layer.bias for layer in layers])
    stacked = AffineQuantLinear(torch.cat([layer.packed for layer in layers]),
                                torch.cat([layer.scales for layer in layers]),
                                torch.cat([layer.offsets for layer in layers]), first.group_size, True, bias,
                                first.dtype, bits=first.bits, in_features=first.in_features)
    setattr(module, fused, form(stacked, weights, workspace))
    for name in names:
        setattr(module, name, None)


def held_bytes(model):
    """{"weights": bytes of every parameter and buffer the model holds and of the float32 copies decoded_weights
    keeps (each storage once: a tied head is counted once), "workspace": the shared decode buffers' bytes (and an
    EntQuant decoder's block buffer and parsed streams)}: what the model keeps for its weights, counted, not
    measured."""
    seen, weights = set(), 0
    copies = [m._decoded[1] for m in model.modules() if getattr(m, "_decoded", None) is not None]   # float32
    for t in [*model.parameters(), *model.buffers(), *copies]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            weights += storage.nbytes()
    workspace = getattr(model, "runtime_workspace", None)
    extra = 0 if workspace is None else workspace.nbytes()
    decoder = getattr(model, "entquant_decoder", None)
    if decoder is not None:
        extra += decoder.held_bytes()
    return {"weights": weights, "workspace": extra}


# ---- the command line's side: --weights, checked before anything loads, and what the model then holds -------------

def choose(weights, impl_name, path):
    """--weights (None: not given) under --impl, for the model at `path` (None: the tiny model) -> the run-time
    choice: 'compact' by default on the torch path; None under impl engine (its kernels read each layer's stored
    codes, so --weights there is an error); 'stream' only for an EntQuant checkpoint. One ValueError line."""
    if impl_name == "engine":
        if weights is not None:
            raise ValueError(f"--weights {weights} chooses what the torch path holds; --impl engine runs each layer's "
                             "Triton kernel on its stored codes (leave --weights out)")
        return None
    weights = weights or "compact"
    if weights == "stream":
        from .loaders import read_config
        config = {} if path is None or str(path).endswith(".gguf") else read_config(path)
        method = (config.get("quantization_config") or {}).get("quant_method")
        if method != "entquant":
            what = f"a {method} checkpoint, not an EntQuant one" if method else "not an EntQuant checkpoint"
            raise ValueError(f"--weights stream keeps EntQuant's rANS streams resident and decodes one block per "
                             f"forward; {path or 'the tiny model'} is {what} (use compact, exact or float32)")
    return weights


@contextlib.contextmanager
def running(model, weights, progress=None):
    """`with running(model, weights) as kept:` the model ready to run: its run-time forms (prepare) for 'compact',
    'exact' and 'stream'; float32 copies of its layers (layers.decoded_weights, progress wrapping their decode) for
    'float32', kept = whether they were made; nothing for None (impl engine)."""
    if weights == "float32":
        with decoded_weights(model, progress=progress) as kept:
            yield kept
        return
    if weights is not None:
        prepare(model, weights)
    yield False


def memory_line(model, path, held=None):
    """One line: the bytes the model's weights hold (held_bytes, or `held` counted earlier) beside the file's tensor
    bytes, and the process's peak resident memory so far."""
    import resource
    held = held or held_bytes(model)
    line = f"weights held {held['weights'] / 1e6:.1f} MB"
    if held["workspace"]:
        line += f" + {held['workspace'] / 1e6:.1f} MB decode buffers"
    if path is not None:
        from .checkpoints.models import file_tensor_bytes
        line += f" (the file's tensors: {file_tensor_bytes(path) / 1e6:.1f} MB)"
    return line + f", peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20:.2f} GB"
