"""Peak memory of rice_encode (engine/coding/rice.py) on an 8B-sized linear: 4096 x 14336 = 58.7M symbols in E8's
layout (zig-zagged rounded Gaussians, ~3.4 bits each, made chunk by chunk so that making them costs no peak).

    python benchmarks/coders_memory.py [--rev main]

--rev: encode with rice.py as it is in that git revision instead (the memory before a change). Prints the peak
resident set size (ru_maxrss) before and after the encode, the extra, the time, and the stream's crc (equal crcs:
equal payload, offsets, Rice parameters and sizes)."""
import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coders import module_at                      # benchmarks/coders.py
from engine.formats.numerics.lattices import LATTICES


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", help="git revision of engine/coding/rice.py to measure instead of the work tree's")
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 14336])
    args = p.parse_args()
    torch.set_num_threads(1)
    rice = module_at("coding/rice.py", args.rev)
    count = args.shape[0] * args.shape[1]
    g = torch.Generator().manual_seed(0)
    symbols = torch.empty(count, dtype=torch.int64)
    for part in symbols.split(1 << 20):
        part.copy_(rice.zigzag(torch.round(torch.randn(part.numel(), generator=g) * 3).long()))
    before = peak_mib()
    start = time.time()
    streams = rice.rice_encode(symbols, LATTICES["E8"].levels)
    seconds = time.time() - start
    after = peak_mib()
    print(json.dumps({"rev": args.rev or "work tree", "symbols": count, "input_MiB": round(8 * count / 2 ** 20),
                      "bits_per_symbol": round(streams.total_bits / count, 3), "peak_before_MiB": round(before),
                      "peak_after_MiB": round(after), "extra_MiB": round(after - before),
                      "encode_s": round(seconds, 1), "crc": streams.crc}), flush=True)


if __name__ == "__main__":
    main()
