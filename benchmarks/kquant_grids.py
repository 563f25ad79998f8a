"""Which grid GPTQ should round on, measured where it matters: one decoder layer's linears of a real model, each
quantized on llama.cpp's grid of a GGML type, plain (quantize_row_*_ref) or with an importance matrix
(quantize_row_*_impl, importance = each input's mean x^2 on the calibration), by round-to-nearest or GPTQ, and
scored by the layer error tr(E H E^T) with H from HELD-OUT text, not from the calibration GPTQ fitted.

    python benchmarks/kquant_grids.py [--reference DIR] [--layers 1] [--linears ...] [--types Q5_K Q4_K]
                                      [--damps 0.1 0.3] [--samples 32]

DIR is benchmarks/frontier.py's reference folder (default ~/.cache/engine/frontier/smollm2: its `reference` model,
`calibration.pt` ids and `texts.pt` held-out chunks; run frontier.py once to make it). Each line: a linear, the type
it gets (llama.cpp's fallback for rows that are not a multiple of 256), then each method's held-out error over that
of llama.cpp's plain round-to-nearest, and last GPTQ's gain on the calibration's own inputs. What it shows on
SmolLM2 (appendix/frontier.md): GPTQ on the plain grid overfits the calibration's Hessian on some linears; the
importance-weighted grid does less, and a damping of 0.1-0.3 less still.
"""
import argparse
from pathlib import Path

import torch

from engine.checkpoints.models import load_model
from engine.formats.llama_cpp import ggml
from engine.formats import gptq
from engine.formats.llama_cpp import gptq_ggml
from engine.formats.numerics.calibration import capture


@torch.no_grad()
def input_hessians(model, names, ids):
    """{name: H = 2 X^T X / n} of the named linears' inputs over the sequences ids [B, T], one at a time (the
    engine's one calibration capture)."""
    stats = capture({n: model.get_submodule(n) for n in names}, [row[None] for row in ids],
                    lambda b, batch: model(batch))
    return {name: s.hessian for name, s in stats.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, default=Path.home() / ".cache/engine/frontier/smollm2")
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--linears", nargs="+", default=["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                         "mlp.down_proj"])
    parser.add_argument("--types", nargs="+", default=["Q5_K", "Q4_K"])
    parser.add_argument("--damps", type=float, nargs="*", default=[],
                        help="also GPTQ on the imatrix grid with each of these dampings (the rows above use 0.01)")
    parser.add_argument("--samples", type=int, default=32, help="calibration sequences (of calibration.pt)")
    args = parser.parse_args(argv)
    if not (args.reference / "reference").is_dir():
        raise SystemExit(f"error: {args.reference} has no reference model: run benchmarks/frontier.py first")
    model = load_model(args.reference / "reference", torch.float32, dense=True).eval()
    names = [f"model.layers.{i}.{n}" for i in args.layers for n in args.linears]
    fitted = input_hessians(model, names, torch.load(args.reference / "calibration.pt")[:args.samples])
    held_out = input_hessians(model, names, torch.load(args.reference / "texts.pt")["gpl3"])
    for name in names:
        w, H = model.get_submodule(name).weight.detach().float(), fitted[name]
        for asked in args.types:
            kind = gptq_ggml.ggml_type_for(asked, w.shape[1])
            order = gptq.visit_order(torch.diag(H), gptq_ggml.group_size(kind), "act_order_static")

            def error(raw, on=held_out[name], kind=kind):
                return gptq.layer_error(ggml.dequantize(raw.reshape(-1), kind, tuple(w.shape)), w, on)

            plain_rtn, plain_gptq = gptq_ggml.rtn_ggml(w, kind), gptq_ggml.gptq_ggml(w, H, kind, order, imatrix=False)
            base = error(plain_rtn)
            rows = {"RTN imatrix": error(gptq_ggml.rtn_ggml(w, kind, torch.diag(H) / 2)),
                    "GPTQ plain": error(plain_gptq),
                    "GPTQ imatrix": error(gptq_ggml.gptq_ggml(w, H, kind, order, refit=False)),
                    "+ refit": error(gptq_ggml.gptq_ggml(w, H, kind, order)),
                    **{f"damp {d}": error(gptq_ggml.gptq_ggml(w, H, kind, order, damp=d)) for d in args.damps}}
            fitted_gain = error(plain_gptq, H) / error(plain_rtn, H)        # on the calibration's own inputs
            print(f"{name.removeprefix('model.layers.'):20s} {kind}  " +
                  "  ".join(f"{k} {v / base:.2f}x" for k, v in rows.items()) +
                  f"  (GPTQ plain on the calibration's inputs: {fitted_gain:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
