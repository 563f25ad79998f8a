"""The tables `run.py quantformats` prints: which methods, with which options, and how a row is measured.

A row is a plain (label, quantize, options): `quantize(model, calibration_ids, **options)` is the method's entry point
(engine/formats/<method>.py); a KV-cache row's quantize installs a quantizer on the model's K/V hook instead and
leaves the weights dense, and its bits are the cache's total_bps (engine/formats/kv/kv_cache.py): codes, every scale
and zero, and the positions a window (the last R tokens) or the first keys keep exact at bf16's 16 bits, averaged
over the cache at the evaluated length (128 tokens on the tiny model, --ctx on a real one). `book_rows()` is what
`run.py quantformats` prints by default: the book's table (its rows in its order) and one row for each idea the
seeds add; `rows()` is every row on the tiny byte model (`--rows all`); `real_model_rows()` is every method at about
2, 3 and 4 bits for a real model, at the group sizes real checkpoints use.
"""
import importlib.util
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .formats.numerics import affine
from .formats import awq, entropy, fp8, gptq, lattice, mx, nf4, trellis
from .formats.kv import kv_baselines, kv_cache


@dataclass
class Row:
    label: str
    quantize: Callable
    options: dict = field(default_factory=dict)
    kv_cache: bool = False      # weights stay dense; K and V are quantized as they enter the cache


GPTQ_ORDERS = {"natural order": "natural",
               "act-order": "act_order",
               "act-order, static groups (default)": "act_order_static",
               "group-aware order (GPTQModel's default)": "group_aware",
               "order search (the best of three per linear)": "search"}


def gptq_order_rows(group_size):
    """GPTQ at 4 bits in each column order it offers (see engine/formats/gptq.py's visit_order)."""
    return [Row(f"GPTQ int4, g{group_size}, {name}", gptq.quantize, dict(group_size=group_size, order=order))
            for name, order in GPTQ_ORDERS.items()]


def rows():
    """The tiny model's table: the book's rows in the book's order, then EntQuant, HyperQuant and the KV cache."""
    return [
        Row("RTN int4, g64", affine.quantize, dict(bits=4, group_size=64)),
        *gptq_order_rows(64),
        Row("AWQ int4, g64", awq.quantize, dict(group_size=64)),
        Row("AWQ int4, g64, scales only (the book's)", awq.quantize, dict(group_size=64, clip=False)),
        Row("FP8 E4M3, 128x128 blocks", fp8.quantize, dict(block=128)),
        Row("MXFP4", mx.quantize, dict(format="mxfp4")),
        Row("NVFP4", mx.quantize, dict(format="nvfp4")),
        Row("trellis (QTIP-style), L=8", trellis.quantize, dict(L=8, K=2)),
        Row("trellis (QTIP-style), L=8, K=3", trellis.quantize, dict(L=8, K=3)),
        Row("trellis (QTIP-style), L=16, tail-biting", trellis.quantize, dict(L=16, K=2, tail_biting=True)),
        Row("RTN int2, g64 (for comparison)", affine.quantize, dict(bits=2, group_size=64)),
        Row("trellis BlockLDLQ (QTIP-style), L=8, 16x16 tiles", trellis.quantize, dict(L=8, K=2, ldlq=True)),
        Row("trellis BlockLDLQ (QTIP-style), L=16, tail-biting, 16x16 tiles", trellis.quantize,
            dict(L=16, K=2, tail_biting=True, ldlq=True)),
        *[Row(f"EntQuant Float8+ANS, ~{b} bpw", entropy.quantize, dict(bpw=b, tol=0.01)) for b in (4.0, 3.0, 2.1)],
        *[Row(f"EntQuant Float8+ANS + self-Fisher, ~{b} bpw", entropy.quantize,
              dict(bpw=b, tol=0.01, sensitivity="fisher")) for b in (3.0, 2.1)],
        *[Row(f"EntQuant Float8+ANS + self-Hessian feedback, ~{b} bpw", entropy.quantize,
              dict(bpw=b, tol=0.01, feedback="self")) for b in (3.0, 2.1)],
        Row("NF4, g64", nf4.quantize, dict(group_size=64)),
        *[Row(f"lattice E8, {b} bps", lattice.quantize, dict(lattice="E8", bps=b)) for b in (2.0, 3.0, 4.0)],
        *[Row(f"lattice {name}, 3.0 bps", lattice.quantize, dict(lattice=name, bps=3.0)) for name in ("D4", "A2", "Z")],
        *[Row(f"KV cache E8, {b} bps, rotation {rot}{', dither' if dither else ''}", kv_cache.kv_quantize,
              dict(lattice="E8", bps=b, rotation=rot, dither=dither, window=0), kv_cache=True)
          for b in (2.0, 3.0) for rot in ("none", "signs", "qjl") for dither in (False, True)],
        *kv_rows(),
    ]


BOOK = ("RTN int4, g64", "GPTQ int4, g64, natural order", "GPTQ int4, g64, act-order", "AWQ int4, g64",
        "FP8 E4M3, 128x128 blocks", "MXFP4", "NVFP4", "trellis (QTIP-style), L=8", "trellis (QTIP-style), L=8, K=3",
        "RTN int2, g64 (for comparison)")
SEEDS = ("EntQuant Float8+ANS, ~2.1 bpw",                                   # the paper's EntQuant at ~2 bits
         "EntQuant Float8+ANS + self-Hessian feedback, ~2.1 bpw",           # with GPTQ's error feedback
         "lattice E8, 2.0 bps",                                             # HyperQuant's weights at ~2 bits
         "KV cache E8, 3.0 bps, rotation qjl, window 8 bf16")               # and its KV cache


def book_rows():
    """The book's table (seed 000's "Run it": its 10 rows in its order), then the seeds' rows: EntQuant at ~2.1
    bits without and with error feedback, the E8 lattice at 2 bits, the lattice KV cache with its window."""
    by_label = {r.label: r for r in rows()}
    return [by_label[label] for label in BOOK + SEEDS]


# Seconds a row takes on two idle cores (the tiny model, --impl torch), by label fragment, first match: the weights
# of run.py's ETA (the pace of the run so far times the rows still to come). From the default table's row times at
# load 11-15 (RTN 4 s, GPTQ 39-60, AWQ 92, EntQuant 72, with self-Hessian feedback 298, trellis L=8 27-29) scaled to
# README's idle figures (L=16 trellis 35 s, BlockLDLQ L=16 69 s, all 58 rows 2.5 minutes). Other rows: about 1 s.
EXPECTED_SECONDS = (("BlockLDLQ (QTIP-style), L=16", 70), ("L=16", 35), ("BlockLDLQ", 20), ("self-Hessian", 35),
                    ("self-Fisher", 20), ("EntQuant", 9), ("order search", 15), ("AWQ", 11), ("GPTQ", 6),
                    ("trellis", 3.5), ("lattice", 3), ("FP4", 1.6))


def expected_seconds(row):
    return next((seconds for fragment, seconds in EXPECTED_SECONDS if fragment in row.label), 1)


def kv_rows():
    """The tiny model's KV rows beyond the rotation x dither sweep, by total rate at its 128-token cache (a window
    of 8 adds ~0.9 bit there, a window of 32 ~3.5): each lattice point beside the engines' formats at about its rate."""
    return [
        lattice_kv_row(2.0, window=8),                                                      # ~3.2 bits
        lattice_kv_row(4.0), lattice_kv_row(3.0, window=8), ggml_kv_row("q4_0"),           # ~4.1-4.5
        lattice_kv_row(4.0, window=8), ggml_kv_row("q4_0", window=8), lattice_kv_row(2.0, window=32),  # ~5.1-5.8
        lattice_kv_row(6.0), kivi_kv_row(2), lattice_kv_row(3.0, window=32),               # ~6.3-6.5
        fp8_kv_row("tensor"), fp8_kv_row("head"), kivi_kv_row(4),                           # ~7.8-8.5
        lattice_kv_row(3.0, window=32, exact_keys=32), ggml_kv_row("q8_0"),
    ]


def lattice_kv_row(bps, window=0, exact_keys=0):
    """HyperQuant's KV (qjl rotation, no dither) at a coded rate, optionally with the residual window (the last
    `window` tokens in bf16) and the first `exact_keys` keys exact; the row's bits count those at 16."""
    extra = (f", window {window} bf16" if window else "") + (f" + first {exact_keys} keys exact" if exact_keys else "")
    return Row(f"KV cache E8, {bps} bps, rotation qjl{extra}", kv_cache.kv_quantize,
               dict(lattice="E8", bps=bps, rotation="qjl", window=window, exact_keys=exact_keys), kv_cache=True)


def fp8_kv_row(scale):
    """vLLM's kv_cache_dtype="fp8": E4M3 with one scale per tensor ("tensor") or per KV head ("head")."""
    return Row(f"KV cache FP8 E4M3, per-{scale} scale (vLLM fp8)", kv_baselines.kv_quantize,
               dict(format="fp8", scale=scale), kv_cache=True)


def ggml_kv_row(cache_type, window=0):
    """llama.cpp's --cache-type-k/-v q8_0 or q4_0 (no window in llama.cpp; one here to compare with the lattice's)."""
    return Row(f"KV cache {cache_type} (llama.cpp){f', window {window} bf16' if window else ''}",
               kv_baselines.kv_quantize, dict(format="ggml", cache_type=cache_type, window=window), kv_cache=True)


def kivi_kv_row(bits, group=32, window=32):
    """KIVI: keys per channel, values per token, groups of 32, the recent tokens exact."""
    return Row(f"KV cache KIVI {bits}-bit, g{group}, window {window} bf16", kv_baselines.kv_quantize,
               dict(format="kivi", bits=bits, group=group, window=window), kv_cache=True)


def real_model_rows():
    """Every method at about 4, 3 and 2 bits on a real model, then the KV cache's. A Q4_1 GGUF model (SmolLM2's) lies
    on 4-bit grids of 32 weights, but with a free f16 offset per group: the integer zero points of RTN / GPTQ / AWQ
    (whose grids must hold 0) do not reproduce it, so even g32 rows lose something."""
    return [
        Row("RTN int4, g32", affine.quantize, dict(bits=4, group_size=32)),
        Row("RTN int4, g128", affine.quantize, dict(bits=4, group_size=128)),
        *gptq_order_rows(128),
        Row("AWQ int4, g128", awq.quantize, dict(group_size=128)),
        Row("FP8 E4M3, 128x128 blocks", fp8.quantize, dict(block=128)),
        Row("MXFP4", mx.quantize, dict(format="mxfp4")),
        Row("NVFP4", mx.quantize, dict(format="nvfp4")),
        Row("NF4, g64", nf4.quantize, dict(group_size=64)),
        *[Row(f"EntQuant Float8+ANS, ~{b} bpw", entropy.quantize, dict(bpw=b, tol=0.05)) for b in (4.0, 3.0, 2.1)],
        *[Row(f"EntQuant Float8+ANS + calibration-Hessian feedback, ~{b} bpw", entropy.quantize,
              dict(bpw=b, tol=0.05, feedback="calibration")) for b in (3.0, 2.1)],
        *[Row(f"lattice E8, {b} bps", lattice.quantize, dict(lattice="E8", bps=b)) for b in (4.0, 3.0, 2.0)],
        Row("trellis (QTIP-style), L=8, K=3", trellis.quantize, dict(L=8, K=3)),
        Row("trellis (QTIP-style), L=8", trellis.quantize, dict(L=8, K=2)),
        Row("RTN int2, g64", affine.quantize, dict(bits=2, group_size=64)),
        Row("GPTQ int2, g64", gptq.quantize, dict(bits=2, group_size=64)),
        lattice_kv_row(2.0, window=32), lattice_kv_row(3.0), kivi_kv_row(2),                # KV at ~3.2-3.8 bits
        lattice_kv_row(3.0, window=32), lattice_kv_row(4.0), ggml_kv_row("q4_0"),           # ~4.1-4.5
        lattice_kv_row(3.0, window=32, exact_keys=32), lattice_kv_row(6.0),                 # ~4.9-6.3
        fp8_kv_row("head"), ggml_kv_row("q8_0"),                                            # 8-8.5
    ]


def calibrated(rows):
    """Whether any row reads calibration ids: its quantize is a method's whose CheckpointMethod.calibration says so
    for its options (the others are data-free), so that a table of data-free rows samples no calibration text."""
    methods = {m.CHECKPOINT.quantize: m.CHECKPOINT for m in (affine, awq, entropy, fp8, gptq, lattice, mx, nf4, trellis)
               if hasattr(m, "CHECKPOINT")}
    return any(not r.kv_cache and r.quantize in methods and methods[r.quantize].calibration(r.options) for r in rows)


def select(all_rows, substrings):
    """The rows whose label contains one of the substrings (case-insensitive); all rows when none are given."""
    chosen = [r for r in all_rows if not substrings or any(s.lower() in r.label.lower() for s in substrings)]
    if not chosen:
        raise ValueError(f"--rows {substrings} matches no row; rows are: {[r.label for r in all_rows]}")
    return chosen


def markdown(results):
    """The tiny model's table: KL mean, its standard error, p99 and same-top %."""
    lines = ["| format | bits | KL (nats) | ± | p99 | same top % |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "kl_nats" in r:
            lines.append(f"| {r['format']} | {r['bits']} | {r['kl_nats']:.5f} | {r['kl_stderr']:.5f} | "
                         f"{r['kl_p99']:.4f} | {r['same_top_pct']:.1f} |")
        else:
            lines.append(f"| {r['format']} | {r['bits']} | (perplexity {r['held_out_perplexity']}) | | | |")
    return "\n".join(lines)


def resident_bytes():
    """This process's resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class MemoryWatch:
    """`with MemoryWatch() as m: ...` samples the process's resident memory every 20 ms; m.peak is the largest seen
    (the whole process: the reference model held for the table included)."""

    def __init__(self, every=0.02):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.every)

    def __enter__(self):
        self.peak = resident_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


FAMILIES = {"RTN": "o", "GPTQ": "s", "AWQ": "D", "FP8": "P", "MXFP4": "v", "NVFP4": "^", "NF4": "X", "EntQuant": "*",
            "lattice": "h", "trellis": "p", "KV": "x"}


def check_plot(path):
    """Before any work: --plot needs matplotlib (an optional extra) and a folder to write the .png into."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")
    if not Path(path).resolve().parent.is_dir():
        raise ValueError(f"--plot {path}: no folder {Path(path).resolve().parent} to write it into")


def plot_rate_distortion(results, path, title=""):
    """KL (log scale) against bits per weight, one marker per method family, into a .png (matplotlib, an optional
    extra: `pip install matplotlib`)."""
    check_plot(path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for family, marker in FAMILIES.items():
        points = [(r["bits"], r["kl_nats"]) for r in results if r["format"].startswith(family) and r["kl_nats"] > 0]
        if points:
            ax.scatter(*zip(*points), marker=marker, s=60, label=family)
    ax.set(xscale="linear", yscale="log", xlabel="bits per weight (all metadata counted)",
           ylabel="KL(P_ref || P_quant), nats per token", title=f"rate and distortion: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
