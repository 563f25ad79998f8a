"""HyperQuant's rate table and Rice coder speed.

    python benchmarks/lattice_rate.py calibrate     # rebuilds data/lattice_snr_bps.json (~8 min on 2 cores)
    python benchmarks/lattice_rate.py bench         # Rice encode / CPU decode throughput per lattice

The table maps SNR = 10 log10(sigma^2 / sigma_q^2) to Rice payload bits per scalar on iid N(0, 1) vectors (10^5 per
point, the lattice scaled so that G V^(2/n) = sigma_q^2, the best rice_k per 512-symbol sub-stream; offsets and Rice
parameters excluded), for SNR 0..36 dB in steps of 0.5. engine.formats.lattice.snr_for_rate interpolates it.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.coding.rice import SUBSTREAM, rice_decode, rice_encode
from engine.formats.lattice import LATTICES, TABLE_PATH, gaussian_rate, lattice_scale, snr_for_rate


def calibrate(path=TABLE_PATH, snrs=None, vectors=100_000, seed=0):
    """Measure the SNR -> bits-per-scalar table for every lattice and write it as JSON."""
    snrs = [i / 2 for i in range(73)] if snrs is None else snrs
    table = {"snr_db": snrs, "vectors": vectors, "seed": seed, "substream": SUBSTREAM,
             "rate": "Rice payload bits per scalar, optimal k per 512-symbol sub-stream (offsets and k excluded)",
             "bps": {name: [round(gaussian_rate(name, s, vectors, seed)[0], 5) for s in snrs] for name in LATTICES}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def bench(symbols=1 << 22, bps=3.0):
    """Rice encode / CPU decode throughput (M symbols/s) on Gaussian data at `bps`, per lattice."""
    for name, lat in LATTICES.items():
        x = torch.randn(symbols // lat.n, lat.n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        stripped = lat.strip(lat.closest_point(x / lattice_scale(snr_for_rate(bps, lat), lat)))
        start = time.perf_counter()
        streams = rice_encode(stripped, lat.levels)
        encode = time.perf_counter() - start
        start = time.perf_counter()
        decoded = rice_decode(streams, lat.levels)
        decode = time.perf_counter() - start
        if not torch.equal(decoded, stripped.reshape(-1)):
            raise AssertionError(f"{name}: Rice round trip failed")
        print(f"{name}: {stripped.numel()} symbols in {streams.streams} sub-streams, "
              f"{streams.total_bits / stripped.numel():.3f} bps; encode {stripped.numel() / encode / 1e6:.1f}, "
              f"decode {stripped.numel() / decode / 1e6:.1f} M symbols/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="rebuild the SNR -> bps table")
    cal.add_argument("--out", type=Path, default=TABLE_PATH)
    cal.add_argument("--snr", type=float, nargs="+", help="SNRs in dB (default 0, 0.5 .. 36)")
    cal.add_argument("--vectors", type=int, default=100_000)
    speed = sub.add_parser("bench", help="Rice coder throughput")
    speed.add_argument("--symbols", type=int, default=1 << 22)
    speed.add_argument("--bps", type=float, default=3.0)
    args = parser.parse_args()
    if args.command == "calibrate":
        t = calibrate(args.out, args.snr, args.vectors)
        at21 = ", ".join(f"{n} {np.interp(21.0, t['snr_db'], t['bps'][n]):.3f}" for n in LATTICES)
        print(f"wrote {args.out}: {at21} bps at 21 dB")
    else:
        bench(args.symbols, args.bps)


if __name__ == "__main__":
    main()
