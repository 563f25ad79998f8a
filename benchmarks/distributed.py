"""Quantizing with several processes (engine/distributed.py) against one: `torchrun --nproc-per-node N run.py quantize
--model M ...` for N = 1, 2 (4 where the cores allow) on the 8-layer Qwen3-0.6B shape, each run a whole process tree,
interleaved (N=1 N=2 N=1 N=2 ...), and every output compared byte for byte with the one-process, one-thread one.

    python benchmarks/distributed.py                               # gptq and fp8, N = 1 and 2, 2 rounds
    python benchmarks/distributed.py --methods gptq --ranks 1 2 4 --rounds 3

Per run: wall time, the largest process's peak RSS (the ranks' max, from the launcher's rusage of its children),
the bytes rank 0 sent and received (what the ranks exchange: the Hessians' slot sums, each quantized linear,
data-free layers), per layer. N = 1 runs twice: with torch's default threads (what one process gets on this machine)
and with one thread (what each torchrun rank gets: OMP_NUM_THREADS=1; the byte-identity reference). Results go to
WORK/distributed.json and are printed as a table, with the load before and after.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from layerwise import CHECKPOINTS, load_average, model_view  # noqa: E402

OPTIONS = {"gptq": ["--group-size", "128"], "fp8": ["--option", "block=128"]}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def source(work):
    path, layers = CHECKPOINTS["8layers"]
    if not (path / "config.json").exists():
        log(f"writing {path} ({layers} layers, random init, bf16)")
        subprocess.run([sys.executable, str(HERE / "peers" / "make_checkpoint.py"), str(layers), str(path)], check=True)
    return model_view(path, work)


def run(method, ranks, threads, model, out, calib):
    """One quantization as a whole process tree: {wall_s, peak_rss_gb, exchanged_mb, rc}."""
    shutil.rmtree(out, ignore_errors=True)
    args = ["run.py", "quantize", "--model", str(model), "--method", method, *OPTIONS[method], *calib,
            "--out", str(out)]
    cmd = [sys.executable, *args] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                      "--nproc-per-node", str(ranks), *args]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    err = proc.stderr.read()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    exchanged = re.search(r"sent and received ([\d.]+) MB", err)
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),
            "exchanged_mb": float(exchanged.group(1)) if exchanged else 0.0}


def same_bytes(a, b):
    files = lambda p: {f.name: f.read_bytes() for f in sorted(Path(p).iterdir())}        # noqa: E731
    return files(a) == files(b)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["gptq", "fp8"], choices=list(OPTIONS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "engine" / "distributed")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    model = source(args.work)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    calib = ["--calib-samples", str(args.calib_samples), "--calib-len", str(args.calib_len)]
    before, results = load_average(), []
    configs = [(n, None if n == 1 else 1) for n in args.ranks] + [(1, 1)]
    for method in args.methods:
        reference = args.work / f"{method}-reference"
        for r in range(args.rounds):
            for ranks, threads in configs:
                out = args.work / f"{method}-n{ranks}-t{threads or 'default'}"
                record = {"method": method, "ranks": ranks, "threads": threads or "default", "round": r,
                          **run(method, ranks, threads, model, out, calib)}
                if (ranks, threads) == (1, 1) and r == 0:
                    shutil.rmtree(reference, ignore_errors=True)
                    shutil.copytree(out, reference)
                results.append(record)
                log(json.dumps(record))
        for ranks, threads in configs:
            out = args.work / f"{method}-n{ranks}-t{threads or 'default'}"
            for rec in results:
                if (rec["method"], rec["ranks"], rec["threads"]) == (method, ranks, threads or "default"):
                    rec["same_bytes_as_one_thread"] = same_bytes(out, reference)
    after = load_average()
    rows = ["| method | ranks | threads per rank | wall s (median) | largest peak RSS GB | exchanged MB per layer "
            "(rank 0) | same bytes as 1 process, 1 thread |", "|---|---:|---|---:|---:|---:|---|"]
    for method in args.methods:
        for ranks, threads in configs:
            key = (method, ranks, threads or "default")
            mine = [x for x in results if (x["method"], x["ranks"], x["threads"]) == key]
            wall = statistics.median(x["wall_s"] for x in mine)
            rows.append(f"| {method} | {ranks} | {threads or 'default'} | {wall:.1f} "
                        f"| {max(x['peak_rss_gb'] for x in mine):.2f} | {mine[0]['exchanged_mb'] / layers:.1f} | "
                        f"{mine[0]['same_bytes_as_one_thread']} |")
    table = "\n".join(rows) + f"\n\nload average before {before}, after {after}; {os.cpu_count()} cores"
    (args.work / "distributed.json").write_text(json.dumps({"runs": results, "load": [before, after]}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
