"""The lossless coders against their peers, one thread, CPU time (process_time: on a shared machine, what a coder
costs without the wait for a core); medians of --repeats runs.

    python benchmarks/coders.py rans [--symbols 1048576 4194304] [--lanes 64 256] [--prob-bits 14 15] [--rev main]
                                     [--compiled 32] [--blocks 32]
        our rANS (engine.coding.rans) beside constriction's AnsCoder on the same E4M3 symbols (Laplace weights at
        about 2.1 and 4.4 bits per symbol, as EntQuant's codes look): encode / decode M symbols/s and the rate over
        the empirical entropy, ours with everything counted (header, table, lane states, word counts, checksum),
        without the header and table (constriction's table is not in its output either), and what the table's
        rounding of the frequencies alone costs. --compiled T: also our encoder with its step loop compiled by
        torch.compile (inductor's C++ backend), T steps unrolled per call: the seconds its first call takes (the
        compile: cold with an empty TORCHINDUCTOR_CACHE_DIR, warm with a filled one) and its M symbols/s after.
        --blocks K: K such blocks (seeds 0..K-1) coded side by side by rans_encode_many, each its own stream at the
        default lanes, beside constriction coding the K one after another.
    python benchmarks/coders.py lattice [--lattice E8] [--bps 3]
        the Triton lattice decode kernel (engine.kernels.stream_decoders.lattice_decode; under the interpreter when
        there is no GPU, as `--impl engine` runs it) on every linear of the tiny Qwen3 (2 layers, hidden 256,
        intermediate 768): seconds to decode them all once, Gaussian weights (the decode's cost depends on the shapes
        and the rate, not on the values).
    python benchmarks/coders.py rans-kernel [--lanes 32 64 256]
        the Triton rANS decode kernel (engine.kernels.stream_decoders.rans_decode, interpreted when there is no GPU)
        on one tiny-Qwen3 block (all 7 linears of a layer, E4M3 codes at about 2.1 bits): seconds to decode it once
        at each lane count (default: default_lanes), wall time (a GPU's work is not the process's CPU time), and the
        bytes of its stream. The kernel is n / lanes steps long, so
        fewer lanes (a better rate) cost decode time.
"""
import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats import lattice
from engine.qwen3 import Qwen3Config
from entquant_rate import synthetic_block          # benchmarks/entquant_rate.py: E4M3 codes of Laplace weights

ROOT = Path(__file__).resolve().parents[1]


def module_at(path, rev=None):
    """The self-contained module engine/<path> (e.g. "coding/rice.py") of the work tree, or as it is in git revision
    rev (to measure before a change)."""
    file = ROOT / "engine" / path
    if rev:
        file = Path(tempfile.mkdtemp()) / file.name
        file.write_text(subprocess.run(["git", "show", f"{rev}:engine/{path}"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location(f"{file.stem}_under_test", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_seconds(fn, repeats, clock=time.process_time):
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def constriction_coder(symbols):
    """(encode, decode) closures of constriction's ANS coder with the empirical distribution as its model."""
    import constriction
    counts = np.bincount(symbols, minlength=256)
    used = np.flatnonzero(counts)
    index = np.searchsorted(used, symbols).astype(np.int32)
    model = constriction.stream.model.Categorical(counts[used] / counts.sum(), perfect=False)

    def encode():
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(index, model)
        return coder.get_compressed()

    def decode(words):
        return used[constriction.stream.stack.AnsCoder(words).decode(model, symbols.size)]
    return encode, decode


def encode_steps(x, rows, f, x_max, keep, c):
    """Our encoder's step loop over T rows, last first, in torch for torch.compile to fuse into one C++ loop over the
    lanes: x float64 [lanes], rows int64 [T, lanes] symbols, tables float64 [256] -> (x, handed [T, lanes]: x mod
    2^16 before the step where a lane hands a word over, else -1). float64 is exact here: every value is an integer
    below 2^53, and floor(x / f) = x // f (x / f is >= 1 / f from the next integer, rounded by <= 2^-21)."""
    handed = []
    for t in range(rows.shape[0] - 1, -1, -1):
        s = rows[t]
        high = torch.floor(x / 65536)
        emit = x >= x_max[s]
        handed.append(torch.where(emit, x - 65536 * high, -1.0))
        x = torch.where(emit, high, x)
        x = x + torch.floor(x / f[s]) * keep[s] + c[s]
    return x, torch.stack(handed[::-1])


def compiled_encoder(ours, steps_per_call):
    """encode(symbols, lanes) -> the bytes ours.rans_encode gives, with encode_steps compiled (lanes must divide n and
    T the steps)."""
    step = torch.compile(encode_steps, dynamic=False, fullgraph=True)

    def encode(symbols, lanes):
        n, p = symbols.size, ours.PROB_BITS
        f = ours.quantize_frequencies(np.bincount(symbols, minlength=256), p)
        c = np.cumsum(f) - f
        tables = torch.from_numpy(np.stack([f, f << (32 - p), (1 << p) - f, c]).astype(np.float64))
        grid = torch.from_numpy(symbols.astype(np.int64).reshape(-1, lanes))
        assert n % lanes == 0 and grid.shape[0] % steps_per_call == 0
        x = torch.full((lanes,), float(ours.STATE_LOW), dtype=torch.float64)
        handed = torch.empty(grid.shape, dtype=torch.float64)
        for t1 in range(grid.shape[0], 0, -steps_per_call):
            x, handed[t1 - steps_per_call:t1] = step(x, grid[t1 - steps_per_call:t1], *tables)
        by_stream = (grid.shape[0], lanes // ours.LANES_PER_STREAM, ours.LANES_PER_STREAM)
        handed = handed.numpy().reshape(by_stream).transpose(1, 0, 2)
        emitted = handed >= 0
        return ours.pack_stream(p, ours.LANES_PER_STREAM, n, f, x.numpy().astype(np.int64), emitted.sum((1, 2)),
                                handed[emitted], b"")
    return encode


def table_rounding_percent(ours, symbols, prob_bits):
    """What coding with the rounded table f costs over the empirical entropy, in % (the coder's own loss aside)."""
    counts = np.bincount(symbols, minlength=256)
    f = ours.quantize_frequencies(counts, prob_bits)
    cross = -(counts[counts > 0] * np.log2(f[counts > 0] / 2 ** prob_bits)).sum()
    return 100 * (cross / ours.empirical_entropy_bits(symbols) - 1)


def bench_rans(args):
    ours = module_at("coding/rans.py", args.rev)
    compiled = compiled_encoder(ours, args.compiled) if args.compiled else None
    for n in args.symbols:
        for spread in (1 / 700, 1 / 128):
            symbols = synthetic_block(n, spread).numpy()
            bits = ours.empirical_entropy_bits(symbols)
            encode, decode = constriction_coder(symbols)
            words = encode()
            assert np.array_equal(decode(words), symbols)
            row = {"symbols": n, "bits_per_symbol": round(bits / n, 3),
                   "constriction": {"rate_over_entropy_%": round(100 * (32 * words.size / bits - 1), 3),
                                    "encode_Msym_s": round(n / median_seconds(encode, args.repeats) / 1e6, 1),
                                    "decode_Msym_s": round(n / median_seconds(lambda: decode(words), args.repeats)
                                                           / 1e6, 1)}}
            for lanes, p in [(lanes, p) for lanes in args.lanes or [None] for p in args.prob_bits or [None]]:
                options = dict(lanes=lanes, prob_bits=p or ours.PROB_BITS)
                data = ours.rans_encode(symbols, **options)
                stream = ours.RansStream(data)
                assert np.array_equal(ours.rans_decode(stream).numpy(), symbols)
                table = ours._HEADER.size + 32 + 2 * int((stream.f > 0).sum()) + ours._CRC.size
                key = f"ours{args.rev and ' at ' + args.rev or ''}, {stream.states.size} lanes, p {stream.prob_bits}"
                row[key] = {
                    "rate_over_entropy_%": round(100 * (8 * len(data) / bits - 1), 3),
                    "without_header_and_table_%": round(100 * (8 * (len(data) - table) / bits - 1), 3),
                    "table_rounding_%": round(table_rounding_percent(ours, symbols, stream.prob_bits), 4),
                    "encode_Msym_s": round(n / median_seconds(lambda: ours.rans_encode(symbols, **options),
                                                              args.repeats) / 1e6, 1),
                    "decode_Msym_s": round(n / median_seconds(lambda: ours.rans_decode(stream), args.repeats)
                                           / 1e6, 1)}
                if compiled and stream.prob_bits == ours.PROB_BITS:
                    start = time.perf_counter()
                    assert compiled(symbols, stream.states.size) == data
                    row[key]["compiled"] = {
                        "steps_per_call": args.compiled, "first_call_s": round(time.perf_counter() - start, 1),
                        "encode_Msym_s": round(n / median_seconds(lambda: compiled(symbols, stream.states.size),
                                                                  args.repeats) / 1e6, 1)}
            if args.blocks > 1:
                blocks = [synthetic_block(n, spread, seed).numpy() for seed in range(args.blocks)]
                theirs = [constriction_coder(b)[0] for b in blocks]
                row[f"{args.blocks} blocks side by side"] = {
                    "ours_encode_Msym_s": round(args.blocks * n / median_seconds(
                        lambda: ours.rans_encode_many(blocks), args.repeats) / 1e6, 1),
                    "constriction_encode_Msym_s": round(args.blocks * n / median_seconds(
                        lambda: [encode() for encode in theirs], args.repeats) / 1e6, 1)}
            print(json.dumps(row), flush=True)


def tiny_linear_shapes(config=Qwen3Config()):
    """[out, in] of every linear of the tiny Qwen3, in module order."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    h, kv, inter = config.hidden_size, config.num_key_value_heads * head_dim, config.intermediate_size
    per_layer = [(config.num_attention_heads * head_dim, h), (kv, h), (kv, h), (h, config.num_attention_heads
                                                                              * head_dim), (inter, h), (inter, h),
                 (h, inter)]
    return per_layer * config.num_hidden_layers


def bench_lattice(args):
    from engine.kernels import stream_decoders
    torch.manual_seed(0)
    snr_db = lattice.snr_for_rate(args.bps, lattice.get_lattice(args.lattice))
    layers = [lattice.quantize_weight(torch.randn(o, i), args.lattice, snr_db) for o, i in tiny_linear_shapes()]
    inputs = [torch.randn(1, layer.in_features) for layer in layers]

    def decode_all():
        for layer, x in zip(layers, inputs):
            layer.kernel_matmul(x)
    decode_all()                                          # compile / warm up once
    seconds = median_seconds(decode_all, args.repeats)
    print(json.dumps({"lattice": args.lattice, "bps": args.bps, "interpreted": stream_decoders.INTERPRETED,
                      "linears": len(layers), "weights": sum(o * i for o, i in tiny_linear_shapes()),
                      "decode_all_s_median": round(seconds, 2)}), flush=True)


def bench_rans_kernel(args):
    from engine.coding import rans, rans_fast
    from engine.kernels import stream_decoders
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = sum(o * i for o, i in tiny_linear_shapes()) // Qwen3Config().num_hidden_layers
    symbols = synthetic_block(n)
    for lanes in args.lanes or [rans.default_lanes(n)]:
        data = rans_fast.rans_encode(symbols, lanes=lanes)
        stream = rans.RansStream(data)
        tensors, out = stream.tensors(device), torch.empty(n, dtype=torch.uint8, device=device)

        def decode():
            stream_decoders.rans_decode(*tensors, out, stream.prob_bits)
            if device == "cuda":
                torch.cuda.synchronize()
        decode()                                          # compile / warm up once
        assert torch.equal(out.cpu(), symbols)
        print(json.dumps({"symbols": n, "lanes": lanes, "steps": -(-n // lanes), "bytes": len(data),
                          "interpreted": stream_decoders.INTERPRETED,
                          "decode_s_median": round(median_seconds(decode, args.repeats, time.perf_counter), 3)}),
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["rans", "rans-kernel", "lattice"])
    p.add_argument("--symbols", type=int, nargs="+", default=[1 << 20, 1 << 22])
    p.add_argument("--lanes", type=int, nargs="+", help="rans: lane counts to compare (default: default_lanes)")
    p.add_argument("--lattice", default="E8")
    p.add_argument("--bps", type=float, default=3.0)
    p.add_argument("--prob-bits", type=int, nargs="+", help="rans: table precisions to compare (default: ours)")
    p.add_argument("--compiled", type=int, metavar="T", help="rans: also the torch.compile'd encoder, T steps a call")
    p.add_argument("--blocks", type=int, default=1, metavar="K",
                   help="rans: also K blocks of each size coded side by side (rans_encode_many), as EntQuant codes a "
                        "model's blocks, beside constriction coding them one after another")
    p.add_argument("--rev", help="rans: our coder as it is in this git revision (default: the work tree)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    {"rans": bench_rans, "rans-kernel": bench_rans_kernel, "lattice": bench_lattice}[args.command](args)


if __name__ == "__main__":
    main()
