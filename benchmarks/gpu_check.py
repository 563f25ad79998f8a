"""The kernels on a real GPU: compile every Triton kernel, prove it equal to the torch path, measure it.

    python benchmarks/gpu_check.py                  a CUDA machine: real shapes, a few minutes on an H200
    python benchmarks/gpu_check.py --quick          any machine (Triton's interpreter on a CPU): small shapes, CI
    python benchmarks/gpu_check.py --compile-only   no GPU needed: compile every kernel for sm_90 (--arch) offline

Writes --out PREFIX.json (everything) and PREFIX.md (a summary); default benchmarks/gpu_report.{json,md}. Every
step is recorded in the report; a step that fails is recorded with its error and the run goes on.

  matmul  every dequantize-and-matmul kernel through its format's layer (kernel_matmul) at batch 1, 16 and 256 on
          [out, in] = 4096 x 4096 and 4096 x 12288 weights: the max relative error against the torch path
          (max |y - x @ dequantize().T| / max |x @ dequantize().T|), the GPU time (CUDA events around the Triton
          launch; warm-up, then the median of repeats, the L2 cache flushed before each), at batch 1 the bandwidth
          (bytes = storage_bits / 8 of the layer + x + y, over the time) as a fraction of the HBM peak, at batch
          256 TFLOP/s; beside the same shapes in bf16 F.linear and in FP8 torch._scaled_mm where the GPU has it.
  decode  the rANS decoder on a real EntQuant block and the Rice decoder on real lattice layers (of the trained
          tiny model), and each on a 4096 x 4096 layer, bit-exact against the CPU decoders: GB/s of output.
  table   run.py quantformats --impl engine with the evaluation on the GPU, against --impl torch on the CPU: each
          row's KL within 1e-3 relative (compared before run.py rounds them for printing).
"""
import argparse
import contextlib
import copy
import importlib
import io
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The engine's names this script uses, in one place (imported lazily: torch must not load before the flags are read).
NAMES = {
    "entquant_quantize": "engine.formats.entropy:quantize", "EntQuantLinear": "engine.formats.entropy:EntQuantLinear",
    "block_context": "engine.formats.entropy_decoder:block_context",
    "encode_weight": "engine.formats.entropy:encode_weight",
    "decode_weight": "engine.formats.entropy:decode_weight", "NF4Linear": "engine.formats.nf4:NF4Linear",
    "rans_encode": "engine.coding.rans_fast:rans_encode", "RansStream": "engine.coding.rans:RansStream",
    "rans_decode_cpu": "engine.coding.rans_fast:rans_decode",
    "lattice_quantize_weight": "engine.formats.lattice:quantize_weight",
    "rice_substream": "engine.coding.rice:SUBSTREAM", "rice_escape": "engine.coding.rice:ESCAPE",
    "rice_raw_bits": "engine.coding.rice:RAW_BITS", "rice_stream_ends": "engine.coding.rice:stream_ends",
}

# HBM peak in TB/s by device name (first match wins, so the specific names come first); --hbm-peak overrides.
HBM_PEAK_TBS = [("H200", 4.8), ("GH200", 4.0), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
                ("H800", 3.35), ("B200", 8.0), ("A100 80GB PCIe", 1.935), ("A100-SXM4-80GB", 2.039),
                ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3), ("A10G", 0.6), ("RTX 4090", 1.008)]

SHAPES = {"full": [(4096, 4096), (4096, 12288)], "quick": [(64, 256)], "compile": [(128, 512)]}
BATCHES = (1, 16, 256)
MATMUL_TOL = 1e-4                  # max |error| / max |y|: float32 sums in another order, tf32x3 dots
TABLE_TOL = 1e-3                   # relative, per row's KL
QUICK_ROWS = ["RTN int4"]


def log(msg):
    print(f"[{time.time() - START:6.1f} s] {msg}", file=sys.stderr, flush=True)


def lookup(key):
    """The engine object NAMES[key] names."""
    module, _, attr = NAMES[key].partition(":")
    return getattr(importlib.import_module(module), attr)


def step(report, section, record, fn):
    """Run fn() -> dict of results into record (appended to report[section]); a failure is recorded, not raised."""
    report.setdefault(section, []).append(record)
    if time.time() - START > ARGS.budget_s:
        record.update(ok=False, error=f"skipped: past the {ARGS.budget_s} s budget")
        return record
    try:
        record.update(fn())
    except Exception as e:                                      # noqa: BLE001 - the report keeps every failure
        record.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000],
                      traceback=traceback.format_exc(limit=-4)[-3000:])
    log(f"{section}: {json.dumps({k: v for k, v in record.items() if k != 'traceback'})[:300]}")
    return record


# ---- timing -------------------------------------------------------------------------------------------------------

class GPUTimer:
    """GPU time of a call with CUDA events: around the whole call, and around each Triton launch inside it (Triton's
    launch hooks record an event pair right at the launch). Before each repeat a 256 MB write evicts the weights
    from L2, and a sleep kernel keeps the GPU busy while Python enqueues the call, so times hold no host overhead."""

    def __init__(self, torch):
        self.torch = torch
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, reps, warmup=3):
        import triton
        torch, knobs = self.torch, triton.knobs.runtime
        event = lambda: torch.cuda.Event(enable_timing=True)    # noqa: E731
        for _ in range(warmup):
            fn()
        runs = []
        for _ in range(reps):
            self.flush.zero_()
            torch.cuda._sleep(2_000_000)                       # ~1 ms at 2 GHz
            launches, start, end = [], event(), event()

            def enter(_):
                launches.append((event(), event()))
                launches[-1][0].record()
            knobs.launch_enter_hook, knobs.launch_exit_hook = enter, lambda _: launches[-1][1].record()
            try:
                start.record()
                fn()
                end.record()
            finally:
                knobs.launch_enter_hook = knobs.launch_exit_hook = None
            runs.append((start, end, launches))
        torch.cuda.synchronize()
        call = statistics.median(s.elapsed_time(e) for s, e, _ in runs)
        kernel = statistics.median(sum(a.elapsed_time(b) for a, b in ls) for _, _, ls in runs) if runs[0][2] else None
        return {"call_ms": call, "kernel_ms": kernel}


def cpu_timer(fn, reps, warmup=0):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return {"call_ms": statistics.median(times), "kernel_ms": None}


def rates(timing, bytes_read, flops, peak_tbs):
    ms = timing["kernel_ms"] or timing["call_ms"]
    out = {k: round(v, 5) for k, v in timing.items() if v is not None}
    gbs = bytes_read / ms / 1e6
    out.update(gb_s=float(f"{gbs:.4g}"), tflop_s=float(f"{flops / ms / 1e9:.4g}"))
    if peak_tbs:
        out["hbm_fraction"] = round(gbs / (1000 * peak_tbs), 3)
    return out


# ---- the matmul kernels ------------------------------------------------------------------------------------------

class EntQuantMatmul:
    """EntQuant's matmul on a decoded block's codes with its per-row power-of-two scales (an EntQuantLinear itself
    needs a whole model's block decoder); the scales here are absmax ones rather than the optimized ones."""

    def __init__(self, w):
        import torch
        self.log_scale = torch.log2(w.abs().amax(1).clamp_min(1e-12) / 448).half()
        self.codes = lookup("encode_weight")(w, self.log_scale)

    def to(self, device):
        self.codes, self.log_scale = self.codes.to(device), self.log_scale.to(device)
        return self

    def dequantize(self):
        return lookup("decode_weight")(self.codes, self.log_scale)

    def kernel_matmul(self, x):
        import torch
        from engine.kernels import triton_formats
        return triton_formats.entquant_matmul(x, self.codes, torch.exp2(self.log_scale.float()))

    def storage_bits(self):
        return 8 * self.codes.numel() + 16 * self.log_scale.numel()


def matmul_cases():
    """name -> build(w [out, in] float32) -> a layer (kernel_matmul, dequantize, storage_bits, to)."""
    import torch
    from torch import nn
    from engine.formats.numerics import affine
    from engine.formats import fp8, mx, trellis

    def linear(w):
        lin = nn.utils.skip_init(nn.Linear, w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w
        return lin

    def trellis_layer(code):
        def build(w):                              # any bytes are a valid tail-biting stream: no Viterbi needed
            g = torch.Generator().manual_seed(0)
            codes = torch.randint(0, 256, (w.shape[0] // 16, w.shape[1] // 16, 64), dtype=torch.uint8, generator=g)
            scales = (w.reshape(w.shape[0] // 16, 16, -1, 16).std((1, 3)) + 1e-3).half()
            return trellis.TrellisLinear(codes, scales, 16, 2, code, True, (16, 16), 256, 0)
        return build

    return {
        "int4 (RTN, g64)": lambda w: affine.AffineQuantLinear.from_linear(linear(w), 4, 64),
        "int2 (RTN, g64)": lambda w: affine.AffineQuantLinear.from_linear(linear(w), 2, 64),
        "FP8 W8A16 (128x128)": lambda w: fp8.FP8BlockLinear.from_linear(linear(w), 128),
        "MXFP4": lambda w: mx.MXFP4Linear.from_linear(linear(w)),
        "NVFP4": lambda w: mx.NVFP4Linear.from_linear(linear(w)),
        "NF4 (g64)": lambda w: lookup("NF4Linear").from_weight(w, 64),
        "EntQuant FP8 matmul": EntQuantMatmul,
        "trellis 1MAD (L16 K2)": trellis_layer("1mad"),
        "trellis 3INST (L16 K2)": trellis_layer("3inst"),
    }


def check_matmuls(report, torch, device, timer, peak):
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES[ARGS.size]:
        w = torch.randn(n, k, generator=g) * 0.02
        for name, build in matmul_cases().items():
            if ARGS.only and not any(s.lower() in name.lower() for s in ARGS.only):
                continue
            state = {}

            def prepare():
                layer = build(w)
                state["w_ref"] = layer.dequantize().to(device)            # the torch path, on the CPU
                state["layer"] = layer.to(device)
                return {"ok": True, "storage_bytes": layer.storage_bits() // 8}
            prep = step(report, "prepare", {"kernel": name, "shape": [n, k]}, prepare)
            for m in BATCHES:
                if not prep.get("ok"):
                    continue
                x = torch.randn(m, k, device=device, generator=torch.Generator(device).manual_seed(m))

                def run():
                    layer, y_ref = state["layer"], x @ state["w_ref"].T
                    y = layer.kernel_matmul(x)
                    err = float((y - y_ref).abs().max() / y_ref.abs().max())
                    result = {"ok": err <= MATMUL_TOL, "max_rel_err": err}
                    result.update(rates(timer(lambda: layer.kernel_matmul(x), ARGS.reps),
                                        prep["storage_bytes"] + 4 * m * (n + k), 2 * m * n * k, peak))
                    return result
                step(report, "matmul", {"kernel": name, "shape": [n, k], "batch": m}, run)
            state.clear()
        if device == "cuda":
            check_baselines(report, torch, w, timer, peak)


def check_baselines(report, torch, w, timer, peak):
    import torch.nn.functional as F
    n, k = w.shape
    wb = w.to("cuda", torch.bfloat16)
    w8 = w.to("cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda")
        xb = x.bfloat16()
        step(report, "baseline", {"kernel": "bf16 F.linear", "shape": [n, k], "batch": m},
             lambda: {"ok": True, **rates(timer(lambda: F.linear(xb, wb), ARGS.reps), 2 * (n * k + m * (n + k)),
                                          2 * m * n * k, peak)})
        x8 = torch.randn(max(16, m), k, device="cuda").to(torch.float8_e4m3fn)  # _scaled_mm: rows % 16 == 0
        step(report, "baseline", {"kernel": "FP8 torch._scaled_mm (W8A8)", "shape": [n, k], "batch": m},
             lambda: {"ok": True, **rates(timer(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                                          out_dtype=torch.bfloat16), ARGS.reps),
                                          n * k + m * (k + 2 * n), 2 * m * n * k, peak)})


# ---- the stream decoders -----------------------------------------------------------------------------------------

def source_model(torch):
    """The trained tiny model (from the training cache, as run.py trains it), or under --quick a small untrained
    one: either way the weights a real checkpoint would hold."""
    from engine.qwen3 import Qwen3, Qwen3Config
    if ARGS.quick or ARGS.compile_only:
        torch.manual_seed(0)
        return Qwen3(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=32))
    from engine.data import Corpus, load_corpus
    from engine.training import TrainConfig, trained_model
    return trained_model(Qwen3Config(), Corpus.from_bytes(load_corpus(None)), TrainConfig(steps=ARGS.table_steps))


def decode_rans(torch, device, timer, stream, n, context=b""):
    from engine.kernels import stream_decoders
    parsed = lookup("RansStream")(stream, n, context)
    ref = lookup("rans_decode_cpu")(parsed)
    tables = parsed.tensors(device)
    out = torch.empty(n, dtype=torch.uint8, device=device)
    run = lambda: stream_decoders.rans_decode(*tables, out, parsed.prob_bits)    # noqa: E731
    run()
    ok = torch.equal(out.cpu(), ref)
    t = timer(run, ARGS.decode_reps)
    ms = t["kernel_ms"] or t["call_ms"]
    return {"ok": ok, "bit_exact": ok, "symbols": n, **{k: round(v, 4) for k, v in t.items() if v is not None},
            "gb_s_out": float(f"{n / ms / 1e6:.4g}")}


def decode_lattice(torch, device, timer, layer):
    from engine.kernels import stream_decoders
    count = layer.in_features * layer.out_features
    ref = layer.rotated_weight().reshape(-1)
    args = [t.to(device) for t in (layer.payload, layer.offsets, layer.rice_ks)]
    ends = lookup("rice_stream_ends")(layer.offsets, int(layer.header[3])).to(device)
    scales = layer.scales.float().to(device)
    run = lambda: stream_decoders.lattice_decode(*args, count, ends, layer.lattice, scales, layer.in_features,  # noqa: E731
                                                 lookup("rice_substream"), lookup("rice_escape"),
                                                 lookup("rice_raw_bits"))
    ok = torch.equal(run().cpu(), ref)
    t = timer(run, ARGS.decode_reps)
    ms = t["kernel_ms"] or t["call_ms"]
    return {"ok": ok, "bit_exact": ok, "symbols": count, "bits_per_weight": round(layer.bits_per_weight, 3),
            **{k: round(v, 4) for k, v in t.items() if v is not None}, "gb_s_out": float(f"{4 * count / ms / 1e6:.4g}")}


def check_decoders(report, torch, device, timer):
    state = {}

    def model():
        state["model"] = source_model(torch)
        return {"ok": True}
    if not step(report, "decode", {"decoder": "source model"}, model).get("ok"):
        return

    def entquant_block():
        m = copy.deepcopy(state["model"])
        lookup("entquant_quantize")(m, lam=14.5, max_iter=20 if ARGS.quick else 500)
        layers = [x for x in m.model.layers[0].modules() if isinstance(x, lookup("EntQuantLinear"))]
        return decode_rans(torch, device, timer, layers[0].stream, sum(x.in_features * x.out_features for x in layers),
                           lookup("block_context")(0, layers))
    step(report, "decode", {"decoder": "rANS", "source": "EntQuant block 0 of the tiny model"}, entquant_block)
    down = state["model"].model.layers[0].mlp.down_proj.weight.detach()
    for name in ("E8", "D4", "A2", "Z"):                        # every lattice's branch of the decoder
        step(report, "decode", {"decoder": f"Rice lattice {name}", "source": "tiny model layers.0.mlp.down_proj"},
             lambda: decode_lattice(torch, device, timer, lookup("lattice_quantize_weight")(down, name)))
    if ARGS.quick:
        return
    n, k = SHAPES["full"][0]                                    # throughput at a real layer's size
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02

    def big_stream():
        codes = EntQuantMatmul(w).codes.reshape(-1)
        return decode_rans(torch, device, timer, lookup("rans_encode")(codes), codes.numel())
    step(report, "decode", {"decoder": "rANS", "source": f"{n}x{k} Gaussian weight, E4M3 codes"}, big_stream)
    step(report, "decode", {"decoder": "Rice lattice E8", "source": f"{n}x{k} Gaussian weight"},
         lambda: decode_lattice(torch, device, timer, lookup("lattice_quantize_weight")(w, "E8")))


# ---- run.py's table ----------------------------------------------------------------------------------------------

def quantformats(torch, impl, device, rows):
    """run.py quantformats --impl IMPL for these rows, its evaluation on `device`: {label: raw KL stats}."""
    import run
    from engine import evaluation, quantformats
    from engine.layers import impl as use_impl
    recorded = []
    evaluate, kl_stats = quantformats.evaluate, quantformats.kl_stats

    def on_device(model, windows, impl_name):
        with use_impl(impl_name):
            return evaluation.held_out_logits(model.to(device), windows.to(device)).float().cpu()

    def keep(ref, logits):
        recorded.append(kl_stats(ref, logits))
        return recorded[-1]
    quantformats.evaluate, quantformats.kl_stats = on_device, keep
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            run.main(["quantformats", "--impl", impl, "--steps", str(ARGS.table_steps), "--rows", *rows])
    finally:
        quantformats.evaluate, quantformats.kl_stats = evaluate, kl_stats
    labels = [json.loads(line)["format"] for line in out.getvalue().splitlines() if line.startswith("{")][1:]
    return dict(zip(labels, recorded))


def check_table(report, torch, device):
    from engine import tables
    rows = ARGS.table_rows or (QUICK_ROWS if ARGS.quick else
                               [r.label for r in tables.rows() if not r.label.startswith("KV cache")])
    tables = {}
    for impl, dev in (("torch", "cpu"), ("engine", device)):
        step(report, "table_runs", {"impl": impl, "device": dev, "rows": len(rows)},
             lambda: {"ok": bool(tables.setdefault(impl, quantformats(torch, impl, dev, rows)))})
    if len(tables) < 2:
        return
    for label, ref in tables["torch"].items():
        def compare():
            got = tables["engine"][label]
            diff = abs(got["kl_nats"] - ref["kl_nats"]) / max(ref["kl_nats"], 1e-12)
            return {"ok": diff <= TABLE_TOL, "kl_torch_cpu": ref["kl_nats"], "kl_engine": got["kl_nats"],
                    "rel_diff": diff}
        step(report, "table", {"row": label}, compare)


# ---- offline compilation -----------------------------------------------------------------------------------------

def check_compile(report, torch, compiled):
    """Every kernel through its public launcher, the matmuls with the compiled launch settings of each batch regime;
    compiled: offline_compiler's list."""
    from engine.kernels import triton_formats
    n, k = SHAPES["compile"][0]
    w = torch.randn(n, k) * 0.02
    down = source_model(torch).model.layers[0].mlp.down_proj.weight.detach()
    runs = [(name, m, lambda build=build, m=m: build(w).kernel_matmul(torch.randn(m, k)))
            for name, build in matmul_cases().items() for m in BATCHES]
    runs.append(("rANS", None, lambda: decode_rans(torch, "cpu", cpu_timer, lookup("rans_encode")(
        EntQuantMatmul(down).codes.reshape(-1)), down.numel())))
    runs += [(f"Rice lattice {lattice}", None, lambda lattice=lattice: decode_lattice(
        torch, "cpu", cpu_timer, lookup("lattice_quantize_weight")(down, lattice))) for lattice in ("E8", "A2")]
    for name, m, run in runs:
        def compile_one():
            compiled.clear()
            with contextlib.suppress(ValueError):               # nothing ran: the decoders' end checks fail
                run()
            return {"ok": bool(compiled) and all(c["ok"] for c in compiled), "compiled": list(compiled)}
        settings = {} if m is None else {"batch": m, "settings": triton_formats.launch_settings(m)._asdict()}
        step(report, "compile", {"kernel": name, **settings}, compile_one)


# ---- report ------------------------------------------------------------------------------------------------------

def md_table(header, rows):
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows), ""]


def markdown(report):
    dev, summary = report["device"], report["summary"]
    lines = [f"# GPU check: {dev['name']}", "", f"mode {report['mode']}, HBM peak {dev['hbm_peak_tbs']} TB/s "
             f"({dev['hbm_peak_source']}), torch {dev['torch']}, triton {dev['triton']}, {report['elapsed_s']:.0f} s. "
             f"**{summary['passed']} of {summary['checks']} checks passed.**", ""]
    ms = lambda r: r.get("kernel_ms") or r.get("call_ms")     # noqa: E731
    if report.get("matmul") or report.get("baseline"):
        lines += ["## Matmul kernels (y = x @ W^T, W decoded in the kernel; baselines plain torch)", ""]
        lines += md_table(["kernel", "W [out, in]", "batch", "ok", "max rel err", "ms", "GB/s", "of HBM peak",
                           "TFLOP/s"],
                          [(r["kernel"], "x".join(map(str, r["shape"])), r["batch"], r.get("ok"),
                            r.get("max_rel_err") and f"{r['max_rel_err']:.1e}", ms(r), r.get("gb_s"),
                            r.get("hbm_fraction"), r.get("tflop_s")) for r in report.get("matmul", []) +
                           report.get("baseline", [])])
    if report.get("decode"):
        lines += ["## Stream decoders (bit-exact against the CPU decoders)", ""]
        lines += md_table(["decoder", "source", "symbols", "bit-exact", "ms", "GB/s of output"],
                          [(r["decoder"], r["source"], r.get("symbols"), r.get("bit_exact"), ms(r), r.get("gb_s_out"))
                           for r in report["decode"] if "source" in r])
    if report.get("table"):
        lines += ["## run.py quantformats: engine on the device vs torch on the CPU", ""]
        lines += md_table(["row", "KL torch (CPU)", "KL engine", "rel diff"],
                          [(r["row"], r.get("kl_torch_cpu"), r.get("kl_engine"), r.get("rel_diff", r.get("error")))
                           for r in report["table"]])
    if report.get("compile"):
        lines += [f"## Offline compilation for sm_{ARGS.arch}", ""]
        lines += md_table(["kernel", "batch", "ok", "warps / stages", "shared KB", "registers", "stack bytes"],
                          [(r["kernel"], r.get("batch"), r.get("ok"), f"{c.get('num_warps')} / {c.get('num_stages')}",
                            c.get("shared_bytes", 0) // 1024, c.get("registers"), c.get("stack_bytes"))
                           for r in report["compile"] for c in r.get("compiled", [{}])])
    if summary["failed"]:
        lines += ["## Failures", "", *(f"- {f}" for f in summary["failed"])]
    return "\n".join(lines) + "\n"


def finish(report):
    checks = [(section, r) for section in ("prepare", "matmul", "baseline", "decode", "table_runs", "table", "compile")
              for r in report.get(section, [])]
    failed = [f"{section}: {({k: v for k, v in r.items() if k not in ('traceback', 'compiled')})}"[:400]
              for section, r in checks if not r.get("ok")]
    report["elapsed_s"] = round(time.time() - START, 1)
    report["summary"] = {"checks": len(checks), "passed": len(checks) - len(failed), "failed": failed,
                         "ok": not failed}
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(report))


def main(argv=None):
    global ARGS, START
    START = time.time()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu_report"), help="report path prefix (.json, .md)")
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats, a subset of the table's rows")
    p.add_argument("--compile-only", action="store_true", help="compile every kernel for --arch offline, run nothing")
    p.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only (default 90)")
    p.add_argument("--hbm-peak", type=float, help="HBM peak in TB/s (default: from the device name)")
    p.add_argument("--reps", type=int, help="timed repeats per kernel (default 20; --quick 1)")
    p.add_argument("--only", nargs="*", help="only matmul kernels whose name contains one of these")
    p.add_argument("--skip", nargs="*", default=[], choices=["matmul", "decode", "table"], help="sections to skip")
    p.add_argument("--table-rows", nargs="*", help="run.py rows to compare (default: every weight row)")
    p.add_argument("--table-steps", type=int, default=300, help="training steps of the tiny model (run.py --steps)")
    p.add_argument("--budget-s", type=float, default=450, help="skip what is left after this many seconds")
    ARGS = p.parse_args(argv)
    if ARGS.compile_only:
        os.environ["TRITON_INTERPRET"] = "0"                    # before engine.kernels imports triton
    sys.path.insert(0, str(ROOT))
    import engine.kernels                                       # first: it sets TRITON_INTERPRET before triton loads
    import torch
    import triton
    torch.backends.cuda.matmul.allow_tf32 = False               # the torch path in full float32
    cuda = torch.cuda.is_available() and not ARGS.compile_only
    ARGS.size = "full" if cuda and not ARGS.quick else "quick"
    ARGS.reps = ARGS.reps or (20 if cuda and not ARGS.quick else 1)
    ARGS.decode_reps = 5 if cuda and not ARGS.quick else 1
    name = torch.cuda.get_device_name() if cuda else f"CPU ({'interpreter' if engine.kernels.INTERPRETED else '?'})"
    peak = ARGS.hbm_peak or next((tbs for key, tbs in HBM_PEAK_TBS if key in name), None) if cuda else None
    report = {"mode": "compile-only" if ARGS.compile_only else ("quick" if ARGS.quick else "full"),
              "device": {"name": name, "hbm_peak_tbs": peak,
                         "hbm_peak_source": "--hbm-peak" if ARGS.hbm_peak else "table by device name",
                         "torch": torch.__version__, "triton": triton.__version__,
                         "interpreted": engine.kernels.INTERPRETED}}
    log(f"{report['mode']} run on {name}")
    try:
        if ARGS.compile_only:
            from offline_compile import offline_compiler
            check_compile(report, torch, offline_compiler(ARGS.arch))
        else:
            device = "cuda" if cuda else "cpu"
            timer = GPUTimer(torch) if cuda else cpu_timer
            if "matmul" not in ARGS.skip:
                check_matmuls(report, torch, device, timer, peak)
                finish(report)
            if "decode" not in ARGS.skip:
                check_decoders(report, torch, device, timer)
                finish(report)
            if "table" not in ARGS.skip:
                check_table(report, torch, device)
    finally:
        finish(report)
    log(f"{report['summary']['passed']} of {report['summary']['checks']} checks passed; wrote "
        f"{Path(ARGS.out).with_suffix('.json')} and .md")
    return 0 if report["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
