"""Running one decoder layer on the calibration batches again and again, without recomputing what has not changed.

GPTQ's true-sequential walk captures a layer four times (q/k/v, then o, then gate/up, then down, each after the
step before was quantized) and then runs it once more for the next layer's inputs. Run from its input each time,
the attention would be computed five times per batch. A layer is

    h   = x + o_proj(context),   context = attention(input_layernorm(x))      (attention_residual)
    out = h + mlp(post_attention_layernorm(h))                                  (mlp_residual)

so a run can start from a kept `context` (o_proj's input) or a kept residual `h` instead of x, as long as every
module they were computed from is unchanged and none of the modules whose inputs the caller captures lies before
them. Unchanged means: the same module objects, holding the same tensors, none edited in place (torch counts a
tensor's in-place edits in its _version); the modules are held by weak reference, so a replaced linear is freed.
At most one tensor is kept per batch (the residual replaces the context): one activation buffer of the calibration
set beside the layer's inputs. The results are the same as running the layer whole (tests/test_ch39_gptq.py).

A layer that cannot resume runs whole: any other module than the engine's DecoderLayer, a KV cache or KV hook, or
forward hooks on the layer itself (EntQuant's block decoder).
"""
import weakref

import torch


class _Kept:
    """A tensor a run computed and the modules it came from, by weak reference (a replaced module is not kept
    alive by it): valid(modules) while they are the same objects holding the same, unedited tensors."""

    def __init__(self, value, modules):
        self.value, self.key = value, [(weakref.ref(t), _version(t)) for t in _state(modules)]

    def valid(self, modules):
        state = _state(modules)
        return len(state) == len(self.key) and all(r() is t and v == _version(t) for (r, v), t in zip(self.key, state))


def _state(modules):
    return [t for m in modules for t in (m, *m.parameters(), *m.buffers())]


def _version(t):
    return (t._version, t.data_ptr()) if torch.is_tensor(t) else None


class ResumingRuns:
    """layer(*args) for batch b of `batches` calibration batches, resumed from what an earlier run of the batch kept
    (module docstring). run(b, args, watched) -> the layer's output; drop_stale() after modules were replaced;
    forget(b) when batch b is done with."""

    def __init__(self, layer, batches):
        self.layer = layer
        self.kept = [{} for _ in range(batches)]          # per batch: "context" or "residual" -> _Kept

    def _sources(self, part):
        """The modules a kept part is computed from: the context from the input norm and everything of the attention
        but o_proj; the residual after it from those and o_proj."""
        attn = self.layer.self_attn
        before = [self.layer.input_layernorm, *(m for name, m in attn.named_children() if name != "o_proj")]
        return before if part == "context" else [*before, attn.o_proj]

    def _resumable(self, b, args):
        layer = self.layer
        return (b < len(self.kept) and hasattr(layer, "attention_residual") and len(args) in (3, 4)
                and (len(args) == 3 or args[3] is None)                                  # no KV cache
                and not layer._forward_pre_hooks and not layer._forward_hooks         # e.g. EntQuant's decoder
                and layer.self_attn.kv_transform is None and layer.self_attn.kv_window is None)

    def run(self, b, args, watched=()):
        """What self.layer(*args) returns for batch b, resumed from its kept context or residual where they are
        valid and no watched module lies before them; a run that computes them keeps them."""
        layer = self.layer
        if not self._resumable(b, args):
            return layer(*args)
        kept = self.kept[b]
        attn_modules = {id(m) for m in layer.input_layernorm.modules()} | {id(m) for m in layer.self_attn.modules()}
        inside = {id(m) for m in watched} & attn_modules
        residual = kept.get("residual")
        if not inside and residual is not None and residual.valid(self._sources("residual")):
            return layer.mlp_residual(residual.value)
        context = kept.get("context")
        o_proj = layer.self_attn.o_proj
        if not inside - {id(o_proj)} and context is not None and context.valid(self._sources("context")):
            h = layer.attention_residual(*args[:3], context=context.value)    # o_proj's hooks see the kept input
        else:
            def keep(module, inputs):
                kept["context"] = _Kept(inputs[0], self._sources("context"))
            handle = o_proj.register_forward_pre_hook(keep, prepend=True)     # before a capture hook stops the run
            try:
                h = layer.attention_residual(*args[:3])
            finally:
                handle.remove()
        kept["residual"] = _Kept(h, self._sources("residual"))
        kept.pop("context", None)
        return layer.mlp_residual(h)

    def drop_stale(self):
        """Free every kept tensor whose modules changed (e.g. linears just replaced by quantized ones)."""
        for kept in self.kept:
            for part in [p for p, k in kept.items() if not k.valid(self._sources(p))]:
                del kept[part]

    def forget(self, b):
        """Free what batch b kept (its last run is done)."""
        if b < len(self.kept):
            self.kept[b] = {}
