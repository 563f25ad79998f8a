"""A model of GPTQ's time on N machines under torchrun (engine/distributed.py), from costs measured here on one core.

    python benchmarks/distributed_model.py                       # measures the two GPTQ costs, prints the tables
    python benchmarks/distributed_model.py --one-thread-s 125.3 --startup-s 6.8 --gbit 10 --costs 3.2e-11 8e-11

A layer's time on N ranks (one rank per machine, every machine alike) is

    walk / N  +  sum over the steps (q/k/v, o, gate/up, down) of the longest rank's GPTQ work  +  exchange

walk: the calibration forwards (true-sequential captures and the outputs), split with the batches; it grows as the
tokens times the layer's weights, and is calibrated from the 8-layer Qwen3-0.6B shape's one-process, one-thread run
(benchmarks/distributed.py: its wall time less start-up, less the modelled GPTQ work). GPTQ work: obq.row_shares'
shares, each costing its rank the inverse-Hessian factor (A * in^3, whoever else also computes it) and its rows'
feedback (B * rows * in^2); A and B are measured below. exchange: the Hessian fold (each rank passes its float64
upper triangles to the next, N - 1 hops one after the other, then the last rank sends each rank the float32
triangle) at --gbit; the codes are a few percent of it and left out. Threads scale every term alike, so the ratios
hold for machines of many cores.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats import gptq  # noqa: E402
from engine.formats.numerics import obq  # noqa: E402

# (hidden, intermediate, query heads x head dim, KV heads x head dim, layers)
SHAPES = {"Qwen3-0.6B, 8 layers": (1024, 3072, 2048, 1024, 8), "Llama-3-8B": (4096, 14336, 4096, 1024, 32),
          "Llama-3-70B": (8192, 28672, 8192, 1024, 80)}


def steps(shape):
    """The layer's GPTQ steps: [{name: (rows, in)}, ...]."""
    hidden, inter, q, kv, _ = shape
    return [{"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden)}, {"o": (hidden, q)},
            {"gate": (inter, hidden), "up": (inter, hidden)}, {"down": (hidden, inter)}]


def measured_costs(rows=1024, cols=3072):
    """(A, B): seconds per in^3 of the inverse-Hessian factor, per rows * in^2 of GPTQ's feedback (int4 g128),
    one thread, medians of 3."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * cols, cols, generator=g)
    h, w = 2 * x.T @ x / len(x), torch.randn(rows, cols, generator=g) * 0.02
    factor, whole = [], []
    for _ in range(3):
        start = time.perf_counter()
        obq.inverse_cholesky(h)
        factor.append(time.perf_counter() - start)
        start = time.perf_counter()
        gptq.gptq_quantize(w, h, 4, 128)
        whole.append(time.perf_counter() - start)
    a = statistics.median(factor)
    return a / cols ** 3, (statistics.median(whole) - a) / (rows * cols * cols)


def gptq_s(shape, ranks, a, b):
    """One layer's GPTQ seconds on `ranks` ranks: each step's longest rank."""
    total = 0.0
    for step in steps(shape):
        load = [0.0] * ranks
        for name, shares in obq.row_shares(step, ranks).items():
            cols = step[name][1]
            for r, first, end in shares:
                load[r] += a * cols ** 3 + b * (end - first) * cols ** 2
        total += max(load)
    return total


def exchange_s(shape, ranks, gbit):
    if ranks == 1:
        return 0.0
    """The fold's seconds per layer: one H per step (its linears read one input), as upper triangles."""
    entries = sum(cols * (cols + 1) // 2 for cols in (next(iter(step.values()))[1] for step in steps(shape)))
    return ((ranks - 1) * 8 * entries + (ranks - 1) * 4 * entries) / (gbit * 1e9 / 8)


def weights(shape):
    hidden, inter, q, kv, _ = shape
    return 2 * hidden * q + 2 * hidden * kv + 3 * hidden * inter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one-thread-s", type=float, default=125.3, help="the 0.6B shape's 1-process 1-thread wall")
    parser.add_argument("--startup-s", type=float, default=6.8, help="start-up and I/O (fp8's 1-thread wall)")
    parser.add_argument("--tokens", type=int, default=32 * 512, help="calibration tokens of that run")
    parser.add_argument("--gbit", type=float, default=10.0, help="network between the machines, Gbit/s")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--costs", type=float, nargs=2, metavar=("A", "B"), help="A and B as measured before")
    args = parser.parse_args(argv)
    a, b = args.costs or measured_costs()
    print(f"one core: inverse-Hessian factor {a:.3g} s per in^3, feedback {b:.3g} s per rows * in^2")
    small = SHAPES["Qwen3-0.6B, 8 layers"]
    walk = (args.one_thread_s - args.startup_s) / small[4] - gptq_s(small, 1, a, b)
    per_weight_token = walk / (weights(small) * args.tokens)
    print(f"walk: {walk:.1f} s per 0.6B-shape layer at {args.tokens} tokens ({per_weight_token:.3g} s per weight "
          f"per token)")
    print("\n| model | calibration tokens | ranks | walk s/layer | GPTQ s/layer | exchange s/layer | hours "
          "| speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, shape in SHAPES.items():
        for tokens in ([args.tokens] if name.startswith("Qwen") else [args.tokens, 128 * 2048]):
            base = None
            for n in args.ranks:
                w = per_weight_token * weights(shape) * tokens / n
                g, x = gptq_s(shape, n, a, b), exchange_s(shape, n, args.gbit)
                total = (w + g + x) * shape[4] + args.startup_s
                base = base or total
                print(f"| {name} | {tokens} | {n} | {w:.0f} | {g:.1f} | {x:.1f} | {total / 3600:.2f} | "
                      f"{base / total:.2f}x |")


if __name__ == "__main__":
    main()
