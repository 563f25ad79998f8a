"""Layer-by-layer quantization from disk against the peers: the engine's converter (engine.checkpoints.streaming), GPTQModel
and llm-compressor on the same checkpoint and calibration, each run as a whole process, interleaved (A B C A B C ...).

    python benchmarks/layerwise.py                                 # the 8-layer Qwen3-0.6B shape, every method, 3 rounds
    python benchmarks/layerwise.py --model full --rounds 3         # the 28-layer shape
    python benchmarks/layerwise.py --methods gptq --rounds 1 --estimate   # print the plan and its estimated time only

Per run: wall time, process CPU time (user + system, from the child's rusage), peak RSS (the child's ru_maxrss, its
own children included), output size on disk; per method and tool the medians, then the KL of each tool's last output
against the dense source (engine.evaluation.compare_models on held-out random ids, every output loaded by the
engine's load_model: GPTQ v1, AWQ GEMM and compressed-tensors folders alike), and the machine's load before and after.
Results go to WORK/layerwise.json and WORK/layerwise.md (also printed).

Methods: gptq (4 bits, groups of 128) and awq (4 bits, groups of 128) for all three tools; fp8, entquant and lattice
for the engine alone, each paired with a run that only reads the checkpoint (so the table shows them against disk, or
page-cache, speed). Calibration: --calib-samples x --calib-len token ids drawn uniformly from the vocabulary with a
fixed seed, saved once (WORK/calib-*.pt) and handed to every tool as ids (no tokenization). Each tool runs with its own
defaults otherwise (benchmarks/peers/run_*.py say which: the peers' GPTQ grid is symmetric, the engine's asymmetric).

The peers live in their own venv (PEERS_VENV, ~/.cache/engine/peers/venv unless the environment variable says
otherwise, built on first use by the commands in VENV_STEPS: torch stays at the machine's 2.13.0; GPTQModel and
llm-compressor declare other torch and transformers versions and are installed with --no-deps, then what they
import). The engine's own venv does not serve both: llm-compressor pins compressed-tensors 0.19, the engine reads
0.20 (a venv with GPTQModel alone does for --tools engine gptqmodel). The checkpoints are written by transformers (benchmarks/peers/
make_checkpoint.py) when missing; the peers get a folder of hard links to them with a byte-level tokenizer added
(both refuse a model without one, though neither tokenizes anything here).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PEERS = HERE / "peers"
CACHE = Path.home() / ".cache" / "engine" / "peers"
PEERS_VENV = Path(os.environ.get("PEERS_VENV", CACHE / "venv"))
PIN = "torch==2.13.0"
VENV_STEPS = [
    ["pip", "install", "torch==2.13.0"],
    ["pip", "install", "transformers==5.24.0"],
    ["pip", "install", "--no-deps", "gptqmodel==7.7.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0",
     "torchao==0.18.0"],
    ["pip", "install", "pypcre", "logbar", "threadpoolctl", "device-smi", "tokenicer", "defuser", "pillow",
     "accelerate", "datasets", "loguru", "pydantic", "requests", "protobuf", "nvidia-ml-py"],
]
CHECKPOINTS = {"8layers": (Path("/work/bench/qwen3-0.6b-8layers"), 8), "full": (Path("/work/bench/qwen3-0.6b-shape"), 28)}
DATA_FREE = ("fp8", "entquant", "lattice")
METHODS = ("gptq", "awq") + DATA_FREE
TOOLS = {"gptq": ("engine", "gptqmodel", "llm-compressor"), "awq": ("engine", "gptqmodel", "llm-compressor"),
         **{m: ("read", "engine") for m in DATA_FREE}}
ENGINE_OPTIONS = {"gptq": ["group_size=128"], "awq": ["group_size=128"], "fp8": ["block=128"],
                  "entquant": ["lam=14.5"], "lattice": ["bps=3.0"]}
# Only for the time estimate printed up front. CPU seconds per decoder layer = fixed + per_ktok x calibration tokens /
# 1024: fixed from this script's own runs at 8 x 128 tokens (8 layers, 1 thread, a loaded machine); per_ktok from
# FLOP counts at ~60 GFLOP/s a core (GPTQ: two layer forwards and the Hessians; the peers' AWQ: its 20-point grid
# re-runs attention and MLP forwards on every calibration token, the engine's scores each grid point on X^T X). The
# KL: per model (the dense reference and each output) and 1024 held-out tokens, 5 s (the 151,936-row lm_head) + 0.5 s
# a layer.
CPU_PER_LAYER = {("engine", "gptq"): (9, 1.8), ("gptqmodel", "gptq"): (7, 2.5), ("llm-compressor", "gptq"): (3.5, 2),
                 ("engine", "awq"): (105, 1.8), ("gptqmodel", "awq"): (100, 10), ("llm-compressor", "awq"): (1, 10),
                 ("read", "fp8"): (0.1, 0), ("engine", "fp8"): (0.6, 0), ("read", "entquant"): (0.1, 0),
                 ("engine", "entquant"): (7.2, 0), ("read", "lattice"): (0.1, 0), ("engine", "lattice"): (3.8, 0)}
STARTUP_CPU = {"engine": 5, "read": 3, "gptqmodel": 25, "llm-compressor": 20}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def load_average():
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---- what the runs need -----------------------------------------------------------------------------------------

def peers_python():
    """The peers venv's python, built when missing (VENV_STEPS, each with torch pinned by a constraint file)."""
    python = PEERS_VENV / "bin" / "python"
    if python.exists():
        return python
    log(f"building the peers venv in {PEERS_VENV} (a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    pin = PEERS_VENV / "torch-constraint.txt"
    pin.write_text(PIN + "\n")
    for step in VENV_STEPS:
        subprocess.run([str(python), "-m", *step, "-c", str(pin)], check=True)
    return python


def peer_versions(python):
    """{package: version or None} in the peers venv (a venv with GPTQModel alone serves --tools engine gptqmodel)."""
    code = ("import importlib.metadata as m, json\nv = {}\n"
            "for p in ('torch', 'transformers', 'gptqmodel', 'llmcompressor', 'compressed-tensors'):\n"
            "    try:\n        v[p] = m.version(p)\n    except m.PackageNotFoundError:\n        v[p] = None\n"
            "print(json.dumps(v))")
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def checkpoint(name):
    """The source checkpoint folder (a named one from CHECKPOINTS, written by transformers when missing, or a path)."""
    if name not in CHECKPOINTS:
        return Path(name)
    path, layers = CHECKPOINTS[name]
    if not (path / "config.json").exists():
        log(f"writing {path} ({layers} layers, random init, bf16)")
        subprocess.run([str(peers_python()), str(PEERS / "make_checkpoint.py"), str(layers), str(path)], check=True)
    return path


def model_view(source, work):
    """WORK/model: hard links to the source's config and weights (a copy where links cannot be made) plus a byte-level
    tokenizer with a pad token (GPTQModel's tokenizer check wants one). Every tool reads this same folder."""
    from engine.checkpoints.tokenizer import BYTE_CHARS, byte_tokenizer, write_tokenizer_files
    view = work / "model"
    if view.exists():
        shutil.rmtree(view)
    view.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors")) and not f.name.startswith("tokenizer"):
            try:
                os.link(f, view / f.name)
            except OSError:
                shutil.copy2(f, view / f.name)
    write_tokenizer_files(byte_tokenizer(), view, {"pad_token": BYTE_CHARS[0], "eos_token": BYTE_CHARS[0]})
    return view


def token_ids(path, n, length, vocab, seed):
    import torch
    if not path.exists():
        torch.save(torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed)), path)
    return path


# ---- one run ----------------------------------------------------------------------------------------------------

def command(tool, method, model, out, calib, python):
    if tool == "read":
        return [sys.executable, str(PEERS / "run_engine.py"), "read", str(model)]
    if tool == "engine":
        return [sys.executable, str(PEERS / "run_engine.py"), "quantize", method, str(model), str(out), str(calib),
                *ENGINE_OPTIONS[method]]
    script = {"gptqmodel": "run_gptqmodel.py", "llm-compressor": "run_llmcompressor.py"}[tool]
    return [str(python), str(PEERS / script), method, str(model), str(out), str(calib)]


def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def measure(cmd, log_path, env):
    """Run cmd as a child; its wall time, CPU time and peak RSS from os.wait4 (the child's own rusage)."""
    start = time.monotonic()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "wall_s": round(time.monotonic() - start, 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3)}


def plan(methods, rounds):
    """[(method, round, tool)]: for each method, its tools in turn, `rounds` times (A B C A B C ...)."""
    return [(m, r, tool) for m in methods for r in range(rounds) for tool in TOOLS[m]]


def estimate_s(runs, layers, tokens, tools):
    """Seconds on an idle 2-core machine (wall ~ CPU / 1.6 with 2 threads), from CPU_PER_LAYER."""
    ktok = tokens / 1024
    cpu = sum(STARTUP_CPU[t] + layers * (CPU_PER_LAYER[t, m][0] + CPU_PER_LAYER[t, m][1] * ktok)
              for m, _, t in runs if t in tools)
    return cpu / 1.6


def estimate_eval_s(outputs, layers, tokens):
    return (outputs + 1) * tokens / 1024 * (5 + 0.5 * layers) / 1.6


# ---- the table --------------------------------------------------------------------------------------------------

def summarize(records, evals):
    rows = []
    for method in dict.fromkeys(r["method"] for r in records):
        reads = [r["wall_s"] for r in records if r["method"] == method and r["tool"] == "read" and r["rc"] == 0]
        for tool in dict.fromkeys(r["tool"] for r in records if r["method"] == method):
            ok = [r for r in records if r["method"] == method and r["tool"] == tool and r["rc"] == 0]
            failed = sum(1 for r in records if r["method"] == method and r["tool"] == tool and r["rc"] != 0)
            row = {"method": method, "tool": tool, "runs": len(ok), "failed": failed}
            if ok:
                for key in ("wall_s", "cpu_s", "peak_rss_gb", "output_mb"):
                    row[key] = round(statistics.median(r[key] for r in ok), 2)
                row["wall_all"] = [r["wall_s"] for r in ok]
                if tool == "engine" and method in DATA_FREE and reads:
                    row["x_read"] = round(row["wall_s"] / statistics.median(reads), 1)
            row.update(evals.get(f"{method}-{tool}", {}))
            rows.append(row)
    return rows


def markdown(rows, header):
    head = ["method", "tool", "runs", "wall s (median; all)", "CPU s", "peak RSS GB", "output MB", "bits/weight",
            "KL mean ± SE", "same top %"]
    lines = header + ["", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        if not r["runs"]:
            lines.append(f"| {r['method']} | {r['tool']} | 0 ({r['failed']} failed) |" + " |" * (len(head) - 3))
            continue
        wall = f"{r['wall_s']:.1f} ({', '.join(f'{w:.0f}' for w in r['wall_all'])})"
        if "x_read" in r:
            wall += f"; {r['x_read']}x read"
        kl = f"{r['kl_nats']:.5f} ± {r['kl_stderr']:.5f}" if "kl_nats" in r else ""
        top = f"{r['same_top_pct']:.1f}" if "same_top_pct" in r else ""
        bits = f"{r['bits']:.3f}" if r.get("bits") else ""
        lines.append(f"| {r['method']} | {r['tool']} | {r['runs']} | {wall} | {r['cpu_s']:.0f} | "
                     f"{r['peak_rss_gb']:.2f} | {r['output_mb']:.0f} | {bits} | {kl} | {top} |")
    return "\n".join(lines)


def evaluate(model, held_out, outputs, work, env):
    """{name: compare_models statistics and bits per weight} for each output folder, in one engine process."""
    if not outputs:
        return {}
    proc = subprocess.run([sys.executable, str(PEERS / "run_engine.py"), "eval", str(model), str(held_out),
                           *map(str, outputs.values())], capture_output=True, text=True, env=env, cwd=work)
    (work / "logs" / "eval.log").write_text(proc.stdout + proc.stderr)
    results = {}
    by_path = {str(path): name for name, path in outputs.items()}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[by_path[r["quantized"]]] = {k: r[k] for k in ("kl_nats", "kl_stderr", "same_top_pct", "bits")}
    if proc.returncode:
        log(f"eval failed (rc {proc.returncode}); see {work / 'logs' / 'eval.log'}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8layers", help="8layers, full, or a Qwen3 checkpoint folder")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--tools", nargs="+", default=["engine", "gptqmodel", "llm-compressor"],
                   choices=["engine", "gptqmodel", "llm-compressor"])
    p.add_argument("--rounds", type=int, default=3, help="runs of each tool per method, interleaved (3)")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--eval-chunks", type=int, default=4, help="held-out sequences for the KL (4)")
    p.add_argument("--eval-ctx", type=int, default=512)
    p.add_argument("--work", type=Path, default=CACHE / "work")
    p.add_argument("--estimate", action="store_true", help="print the plan and its estimated time, run nothing")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calib_samples < 1 or args.calib_len < 2 or args.eval_chunks < 1 or args.eval_ctx < 3:
        p.error("--rounds, --calib-samples, --eval-chunks must be >= 1, --calib-len >= 2, --eval-ctx >= 3")
    tools = set(args.tools) | {"read"}
    python = peers_python() if tools & {"gptqmodel", "llm-compressor"} else None
    source = checkpoint(args.model)
    config = json.loads((source / "config.json").read_text())
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    runs = [r for r in plan(args.methods, args.rounds) if r[2] in tools]
    total = estimate_s(runs, layers, args.calib_samples * args.calib_len, tools) + estimate_eval_s(
        len({(m, t) for m, _, t in runs if t != "read"}), layers, args.eval_chunks * args.eval_ctx)
    log(f"{len(runs)} runs on {source} ({layers} layers); estimated {total / 60:.0f} min on an idle 2-core machine "
        f"(longer under load: now {load_average()})")
    if args.estimate:
        for method, r, tool in runs:
            log(f"  {method:9s} round {r + 1}  {tool}")
        return
    work = args.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    view = model_view(source, work)
    calib = token_ids(work / f"calib-{args.calib_samples}x{args.calib_len}-seed0.pt", args.calib_samples,
                      args.calib_len, vocab, 0)
    held_out = token_ids(work / f"heldout-{args.eval_chunks}x{args.eval_ctx}-seed1.pt", args.eval_chunks,
                         args.eval_ctx, vocab, 1)
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    header = [f"Source: `{source}` ({layers} layers, {folder_bytes(source) / 1e6:.0f} MB); calibration "
              f"{args.calib_samples} x {args.calib_len} random ids (seed 0); KL on {args.eval_chunks} x {args.eval_ctx} "
              f"held-out random ids (seed 1), second half of each sequence scored.",
              f"Load average before: {load_average()} (2 cores); {datetime.datetime.now():%Y-%m-%d %H:%M}."]
    records, outputs, started = [], {}, time.monotonic()
    for k, (method, r, tool) in enumerate(runs):
        out = work / "out" / f"{method}-{tool}"
        shutil.rmtree(out, ignore_errors=True)
        rec = {"method": method, "tool": tool, "round": r + 1, "load_before": load_average(),
               "command": command(tool, method, view, out, calib, python)}
        rec.update(measure(rec["command"], work / "logs" / f"{method}-{tool}-{r + 1}.log", env))
        rec["output_mb"] = round(folder_bytes(out) / 1e6, 1)
        records.append(rec)
        if rec["rc"] == 0 and tool != "read":
            outputs[f"{method}-{tool}"] = out
        left = estimate_s(runs[k + 1:], layers, args.calib_samples * args.calib_len, tools)
        log(f"[{k + 1}/{len(runs)}] {method} {tool} round {r + 1}: rc {rec['rc']}, {rec['wall_s']:.1f} s wall, "
            f"{rec['cpu_s']:.1f} s CPU, {rec['peak_rss_gb']:.2f} GB, {rec['output_mb']:.0f} MB "
            f"(load {rec['load_before']}); ~{left / 60:.0f} min left if idle")
    evals = evaluate(view, held_out, outputs, work, env)
    header.append(f"Load average after: {load_average()}; {(time.monotonic() - started) / 60:.0f} min in all.")
    rows = summarize(records, evals)
    result = {"source": str(source), "layers": layers, "calibration": [args.calib_samples, args.calib_len],
              "peers": peer_versions(python) if python else None, "header": header, "runs": records, "rows": rows}
    (work / "layerwise.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(rows, header)
    (work / "layerwise.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
