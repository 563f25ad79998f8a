"""Trellis codes on i.i.d. Gaussian data: MSE per L, K and code with honest rates, and the encoder's speed.

  python benchmarks/trellis_mse.py [--L 8 10 12 16] [--K 2 3] [--sequences 256] [--threads 1 2] [--repeats 3]
                                   [--codes 1mad 3inst] [--start free tail-biting] [--compiled auto on off]
                                   [--windows 16 32 48] [--model]

Each row codes `sequences` unit-variance Gaussian sequences of T=256 with viterbi_encode. Rate = stream bits / T:
L + K(T-1) with a free start state, K T tail-biting (the per-tile f16 scale adds 16 / T = 0.0625 to either);
tail-biting codes every sequence twice (QTIP's two passes). Speed: weights per wall second and per second of this
process's CPU time summed over its threads (other jobs on the machine slow the first more), medians over `repeats` runs; `load` is the
1-minute load average when the row started. References at 2 bits: Lloyd-Max scalar 0.118, QTIP L=16 about 0.069,
rate-distortion bound 0.0625.
--compiled: viterbi's step compiled (on), eager (off) or as viterbi decides (auto); a row's first run in a process
includes the compile when it compiles (use --repeats 2 or more for the steady speed).
--windows: tail-biting with the first pass over that many steps on each side of the wrap point (viterbi_encode's
wrap_window) against the whole rotated sequence: MSE, and the share of sequences whose wrap state changes.
--model also times trellis.quantize (tail-biting) on the book's tiny Qwen3 at each L (random weights: speed only).
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats import trellis

COMPILED = {"auto": None, "on": True, "off": False}


def timed(fn, repeats):
    """(fn's first result, median wall seconds, median CPU seconds of this process)."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        out = result if out is None else out
    return out, statistics.median(walls), statistics.median(cpus)


def gaussian_rows(args, T=256):
    x = torch.randn(args.sequences, T, generator=torch.Generator().manual_seed(0))
    for L in args.L:
        for K in args.K:
            for code in args.codes:
                for start in args.start:
                    for threads, compiled in itertools.product(args.threads, args.compiled):
                        torch.set_num_threads(threads)
                        load = os.getloadavg()[0]
                        tail_biting = start == "tail-biting"
                        options = dict(tail_biting=tail_biting, compiled=COMPILED[compiled])
                        (_, recon), wall, cpu = timed(lambda: trellis.viterbi_path(x, L, K, code=code, **options),
                                                         args.repeats)
                        yield {"L": L, "K": K, "code": code, "tail_biting": tail_biting, "threads": threads,
                               "compiled": compiled,
                               "rate": round(trellis.stream_bits(L, K, T, tail_biting) / T, 5),
                               "mse": round(float((recon - x).pow(2).mean()), 5),
                               "weights_per_s": round(x.numel() / wall), "cpu_weights_per_s": round(x.numel() / cpu),
                               "load": round(load, 1)}


def window_rows(args, T=256):
    x = torch.randn(args.sequences, T, generator=torch.Generator().manual_seed(0))
    for L, K, code in itertools.product(args.L, args.K, args.codes):
        whole, recon = trellis.viterbi_path(x, L, K, code=code, tail_biting=True, wrap_window=None)
        yield {"L": L, "K": K, "code": code, "wrap_window": None, "mse": round(float((recon - x).pow(2).mean()), 5)}
        for window in args.windows:
            states, recon = trellis.viterbi_path(x, L, K, code=code, tail_biting=True, wrap_window=window)
            yield {"L": L, "K": K, "code": code, "wrap_window": window,
                   "mse": round(float((recon - x).pow(2).mean()), 5),
                   "wrap_state_differs": round(float((states[:, 0] >> K != whole[:, 0] >> K).float().mean()), 4)}


def model_rows(args):
    from engine.qwen3 import Qwen3, Qwen3Config
    for L in args.L:
        for K in args.K:
            options = {"L": L, "K": K, "tail_biting": True}
            torch.manual_seed(0)
            model = Qwen3(Qwen3Config()).eval()
            weights = sum(m.weight.numel() for n, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear) and n != "lm_head")
            load = os.getloadavg()[0]
            _, wall, cpu = timed(lambda: trellis.quantize(model, **options), 1)
            yield {"model": "tiny Qwen3 (2 layers, 256 / 768)", **options, "weights": weights,
                   "seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "weights_per_s": round(weights / wall),
                   "load": round(load, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", type=int, nargs="+", default=[6, 8, 10, 12])
    p.add_argument("--K", type=int, nargs="+", default=[2])
    p.add_argument("--codes", nargs="+", default=list(trellis.CODES), choices=trellis.CODES)
    p.add_argument("--start", nargs="+", default=["free", "tail-biting"], choices=["free", "tail-biting"])
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--compiled", nargs="+", default=["auto"], choices=list(COMPILED))
    p.add_argument("--windows", type=int, nargs="*", help="compare tail-biting's first-pass windows (no timing)")
    p.add_argument("--model", action="store_true", help="also time quantizing the book's tiny Qwen3")
    args = p.parse_args()
    print(json.dumps({"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}))
    for row in window_rows(args) if args.windows else gaussian_rows(args):
        print(json.dumps(row), flush=True)
    if args.model:
        torch.set_num_threads(max(args.threads))
        for row in model_rows(args):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
