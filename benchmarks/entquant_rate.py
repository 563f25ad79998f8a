"""EntQuant on the tiny trained Qwen3: the lambda -> bits-per-weight table the rate control starts from, and the
coder's and the runtime's figures.

    python benchmarks/entquant_rate.py calibrate      # rebuilds data/entquant_lambda_bpw.json (Float8 and Int8,
                                                      # the paper's loss and the Fisher-weighted one, each with
                                                      # and without error feedback)
    python benchmarks/entquant_rate.py measure        # KL rows (with NF4, RTN int2 and, if installed, HQQ),
                                                      # coder throughput, compression time, resident memory
    python benchmarks/entquant_rate.py measure --sensitivities none --feedbacks none self --bpw 3.0 2.1
                                                      # the paper's nearest codes against error feedback
    python benchmarks/entquant_rate.py coder          # rANS throughput (one thread) on synthetic E4M3 blocks of a
                                                      # block's size (786,432 symbols at ~2.1 bits) and of 15.7M

The model comes from engine.training's cache (trained on first use, as `run.py quantformats` does). bpw counts
every byte: streams (header, table, lane states, offsets, words), float16 log2 scales, Int8 super weights.
"""
import argparse
import copy
import json
import sys
import statistics
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.coding import rans, rans_fast
from engine.data import Corpus, load_corpus
from engine.evaluation import held_out_logits, kl_stats
from engine.formats.numerics import affine
from engine.formats import entropy, entropy_feedback, entropy_rate, nf4
from engine.layers import model_bits
from engine.formats.numerics.sensitivity import fisher_importance, parse_sensitivity, self_generated_ids
from engine.qwen3 import Qwen3Config
from engine.training import TrainConfig, trained_model

LAMBDAS = {None: [1.0, 2.0, 3.9, 7.5, 14.5, 29.0, 58.0, 116.0],      # the paper's loss
           "fisher": [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}        # Fisher-weighted: another lambda scale


def model_for(args):
    return trained_model(Qwen3Config(), Corpus.from_bytes(load_corpus(args.text)),
                         TrainConfig(steps=args.steps, seed=args.seed))


def calibrate(args):
    model = model_for(args)
    linears = entropy._block_linears(model)
    out = Path(args.out)                                  # the tables not asked for stay as they are
    table = {**(json.loads(out.read_text()) if out.exists() else {}),
             "model": "tiny Qwen3 (2 layers, hidden 256, intermediate 768), engine.training defaults",
             "train_steps": args.steps, "seed": args.seed}
    names = [n for named in linears.values() for n, _ in named]
    for sensitivity, feedback, fmt in [(parse_sensitivity(s), entropy_feedback.parse_feedback(f), fmt)
                                       for s in args.sensitivities for f in args.feedbacks for fmt in args.fmts]:
        importance = fisher_importance(model, names, self_generated_ids(model)) if sensitivity else None
        hessians = entropy_feedback.self_hessians(model, names, self_generated_ids(model)) if feedback else None
        key, rows = entropy_rate.table_key(fmt, sensitivity, feedback), []
        for lam in args.lambdas or LAMBDAS[sensitivity]:
            start = time.time()
            layers, bits, count = entropy.compress_blocks(linears, lam, fmt, importance=importance, hessians=hessians)
            row = {"lambda": lam, "bpw": round(bits / count, 4), "seconds": round(time.time() - start, 1),
                   "stream_bytes": sum(m.stream.numel() for m in layers.values()), "symbols": count}
            rows.append(row)
            print(json.dumps({"table": key, **row}), flush=True)
        table[key] = rows
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}")


def hqq_row(model, bits, kl_row, group_size=64):
    """The hqq package's data-free HQQ (half-quadratic zero / scale search) as fake quantization, scale and zero
    rounded to float16 as its checkpoints store them: bits + 32 / group_size per weight. Skipped without hqq."""
    try:
        from hqq.core.quantize import Quantizer
    except ImportError:
        print(json.dumps({"format": f"HQQ int{bits}, g{group_size}", "skipped": "pip install hqq termcolor"}))
        return
    m = copy.deepcopy(model)
    for linear in entropy._block_linears(m).values():
        for _, layer in linear:
            w = layer.weight.detach().float()
            q, meta = Quantizer.quantize(w, nbits=bits, group_size=group_size, axis=1, optimize=True,
                                         round_zero=False, compute_dtype=torch.float32, device="cpu")
            meta["scale"], meta["zero"] = meta["scale"].half().float(), meta["zero"].half().float()
            layer.weight.data = Quantizer.dequantize(q, meta).reshape(w.shape).float()
    kl_row(f"HQQ int{bits}, g{group_size} (hqq package)", m, bits + 32 / group_size)


def run_seconds(fn, repeats=5, clock=time.perf_counter):
    """The times of a few runs (their best: what the code costs without the machine's other work)."""
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def best_seconds(fn, repeats=5):
    return min(run_seconds(fn, repeats))


@torch.no_grad()
def measure(args):
    corpus = Corpus.from_bytes(load_corpus(args.text))
    model = model_for(args)
    windows = corpus.eval_windows()
    ref = held_out_logits(model, windows)

    def kl_row(label, m, bits, **extra):
        stats = kl_stats(ref, held_out_logits(m, windows))
        print(json.dumps({"format": label, "bits": round(bits, 3), "kl_nats": round(stats["kl_nats"], 6),
                          "same_top_pct": round(stats["same_top_pct"], 2), **extra}), flush=True)

    for label, quantize in (("NF4, g64", nf4.quantize),
                            ("RTN int2, g64", lambda m: affine.quantize(m, bits=2, group_size=64))):
        m = copy.deepcopy(model)
        quantize(m)
        kl_row(label, m, model_bits(m))
    for bits in (4, 3, 2):
        hqq_row(model, bits, kl_row)
    for sensitivity, feedback, target in [(s, f, b) for s in args.sensitivities for f in args.feedbacks
                                          for b in args.bpw]:
        sensitivity, feedback = parse_sensitivity(sensitivity), entropy_feedback.parse_feedback(feedback)
        m = copy.deepcopy(model)
        start = time.time()
        qcfg = entropy.quantize(m, bpw=target, sensitivity=sensitivity, tol=args.tol, feedback=feedback)
        seconds = time.time() - start
        block0 = m.entquant_decoder.blocks[0]
        raw, context = block0[0].stream.numpy().tobytes(), entropy.block_context(0, block0)
        stream = rans.RansStream(raw, context=context)
        symbols = rans_fast.rans_decode(stream)
        enc = best_seconds(lambda: rans_fast.rans_encode(symbols, context=context))
        dec = best_seconds(lambda: rans_fast.rans_decode(raw, context=context))
        h = rans.empirical_entropy_bits(symbols) / 8
        label = (f"EntQuant Float8+ANS{' + self-Fisher' if sensitivity else ''}"
                 f"{' + self-Hessian feedback' if feedback else ''} (bpw={target})")
        kl_row(label, m, qcfg["bits_per_weight"], **{
            "lambda": round(qcfg["lambda"], 3), "compress_seconds": round(seconds, 1), "block0_symbols": stream.n,
            "lanes": stream.states.size, "block0_bytes": len(raw), "block0_entropy_bytes": round(h),
            "rate_over_entropy": round(len(raw) / h, 4), "encode_Msym_s": round(stream.n / enc / 1e6, 2),
            "decode_Msym_s": round(stream.n / dec / 1e6, 2), **entropy.resident_bytes(m)})


def synthetic_block(n, spread=1 / 700, seed=0):
    """E4M3 bytes of Laplace weights pushed into the subnormal range (spread 1/700: about 2.1 bits per symbol), as
    EntQuant codes look."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, generator=g).log() * torch.sign(torch.rand(n, generator=g) - 0.5) * spread
    return entropy.encode_weight(w[None], torch.zeros(1)).reshape(-1)


def coder(args):
    """Throughput in the process's CPU time (one thread): on a shared machine, what the coder costs without the
    wait for a core."""
    for n in args.symbols:
        symbols = synthetic_block(n)
        data = rans_fast.rans_encode(symbols)
        stream = rans.RansStream(data)
        assert torch.equal(rans_fast.rans_decode(stream), symbols)
        dec = run_seconds(lambda: rans_fast.rans_decode(stream), args.repeats, time.process_time)
        enc = run_seconds(lambda: rans_fast.rans_encode(symbols), max(1, args.repeats // 2), time.process_time)
        print(json.dumps({"symbols": n, "bits_per_symbol": round(rans.empirical_entropy_bits(symbols) / n, 3),
                          "lanes": stream.states.size, "rate_over_entropy": round(
                              8 * len(data) / rans.empirical_entropy_bits(symbols), 4),
                          "decode_Msym_s_median": round(n / statistics.median(dec) / 1e6, 2),
                          "decode_Msym_s_best": round(n / min(dec) / 1e6, 2),
                          "encode_Msym_s_median": round(n / statistics.median(enc) / 1e6, 2)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["calibrate", "measure", "coder"])
    p.add_argument("--text", default=None)
    p.add_argument("--steps", type=int, default=TrainConfig().steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lambdas", type=float, nargs="+", help="default: LAMBDAS of each sensitivity")
    p.add_argument("--sensitivities", nargs="+", choices=["none", "fisher"], default=["none", "fisher"])
    p.add_argument("--feedbacks", nargs="+", choices=["none", "self"], default=["none", "self"])
    p.add_argument("--fmts", nargs="+", default=["float8", "int8"])
    p.add_argument("--bpw", type=float, nargs="+", default=[4.0, 3.0, 2.1])
    p.add_argument("--tol", type=float, default=0.01, help="measure: bpw tolerance of the lambda search")
    p.add_argument("--out", default=str(entropy_rate.LAMBDA_TABLE))
    p.add_argument("--symbols", type=int, nargs="+", default=[786_432, 15_728_640], help="coder: block sizes")
    p.add_argument("--repeats", type=int, default=7, help="coder: timed decodes per block (median and best)")
    args = p.parse_args()
    torch.set_num_threads(1)                    # timings: one thread, no contention between threads
    {"calibrate": calibrate, "measure": measure, "coder": coder}[args.command](args)


if __name__ == "__main__":
    main()
