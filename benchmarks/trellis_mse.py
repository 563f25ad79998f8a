"""Trellis codes on i.i.d. Gaussian data: MSE per L and code at K bits, with honest rates, and encoder speed.

  python benchmarks/trellis_mse.py [--K 2] [--L 6 8 10 12] [--sequences 256] [--model]
  python benchmarks/trellis_mse.py --L 16 --sequences 16          (L=16: 65536 states, about 1000x slower per weight)

Each row codes `sequences` unit-variance Gaussian sequences of T=256 with viterbi_encode. Rate = stream bits / T:
L + K(T-1) with a free start state, K T tail-biting (the per-tile f16 scale adds 16 / T = 0.0625 to either).
References at 2 bits: Lloyd-Max scalar 0.118, QTIP L=16 about 0.069, rate-distortion bound 0.0625.
--model also times trellis.quantize on the book's tiny Qwen3 (random weights: speed only).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats import trellis


def gaussian_rows(Ls, K, sequences, T=256, seed=0):
    x = torch.randn(sequences, T, generator=torch.Generator().manual_seed(seed))
    for L in Ls:
        for code in trellis.CODES:
            for tail_biting in (False, True):
                start = time.perf_counter()
                _, _, recon = trellis.viterbi_encode(x, L, K, code, tail_biting)
                seconds = time.perf_counter() - start
                yield {"L": L, "K": K, "code": code, "tail_biting": tail_biting,
                       "rate": trellis.stream_bits(L, K, T, tail_biting) / T,
                       "mse": round(float((recon - x).pow(2).mean()), 5),
                       "weights_per_s": round(x.numel() / seconds)}


def model_rows(K):
    from engine.qwen3 import Qwen3, Qwen3Config
    for options in ({"L": 8, "K": K}, {"L": 8, "K": K, "tail_biting": True}, {"L": 8, "K": K + 1}):
        torch.manual_seed(0)
        model = Qwen3(Qwen3Config()).eval()
        weights = sum(m.weight.numel() for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and n != "lm_head")
        start = time.perf_counter()
        trellis.quantize(model, **options)
        seconds = time.perf_counter() - start
        yield {"model": "tiny Qwen3 (2 layers, 256 / 768)", **options, "weights": weights,
               "seconds": round(seconds, 1), "weights_per_s": round(weights / seconds)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--L", type=int, nargs="+", default=[6, 8, 10, 12])
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--model", action="store_true", help="also time quantizing the book's tiny Qwen3")
    args = p.parse_args()
    print(json.dumps({"torch_threads": torch.get_num_threads()}))
    for row in gaussian_rows(args.L, args.K, args.sequences):
        print(json.dumps(row), flush=True)
    if args.model:
        for row in model_rows(args.K):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
