"""GPTQ on llama.cpp's grids against llama.cpp's own round-to-nearest of the same types, whole models, in GGUF files.

    python benchmarks/kquants.py [--types Q4_K Q3_K ...] [--bpw 4.5 ...] [--out DIR]                   the tiny model
    python benchmarks/kquants.py --model PATH [--ctx 512 --chunks 8 --calib-samples 32 --calib-len 512] ...

For each GGML type: the engine's round-to-nearest (ggml_quants: llama.cpp's quantize_row_*_ref, bit-exact, its
fallback for rows that are not a multiple of 256 included) and GPTQ on llama.cpp's grids of the same types
(gptq_ggml.quantize with ggml_type: the scales `llama-quantize --imatrix` picks with the calibration's importance),
and for each --bpw a GPTQ mix (ggml_type="mix"). Every model is written as a GGUF file and read back, and the file is
what is scored: bits per weight of the decoder linears (the file's bytes), KL against the reference in
the engine's forward (the tiny model: every held-out window; a real model, --model a folder or .gguf whose
dequantized weights are the reference: llama.cpp's perplexity --kl-divergence chunks, second halves scored). The
calibration is run.py's: the tiny corpus' training windows, or --calib-samples x --calib-len tokens of the default
text's training part.

With the llama.cpp client installed (benchmarks/clients.py; --no-llama skips it): llama.cpp's own
llama_model_quantize of the engine's F32 export in each pure type (are its linears' bytes the engine's RTN file's?),
and every file run in llama.cpp: KL of llama.cpp's log-probs against the engine's forward of the same file on the
first --llama-windows windows (llama.cpp rounds activations to 8 bits in its quantized dot products: this is that
floor, not a quantization error) and its greedy continuations against the engine's generate().
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clients import client_python, compare, run_client  # noqa: E402

from engine.formats.llama_cpp import ggml, gguf, gguf_file  # noqa: E402
from engine.formats.llama_cpp.gguf_writer import write_gguf  # noqa: E402
from engine.checkpoints.models import load_model  # noqa: E402
from engine.checkpoints.tokenizer import load_tokenizer, tokenizer_metadata  # noqa: E402
from engine.data import Corpus, load_corpus  # noqa: E402
from engine.evaluation import ReferenceLogits, compare_models, held_out_logits, kl_stats  # noqa: E402
from engine.formats.llama_cpp import gptq_ggml  # noqa: E402
from engine.layers import linear_names  # noqa: E402
from engine.qwen3 import Qwen3Config  # noqa: E402
from engine.training import TrainConfig, trained_model  # noqa: E402


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def setup(args):
    """(reference model, calibration ids, score(model) -> stats, windows for llama.cpp, tokenizer source)."""
    if args.model is None:
        corpus = Corpus.from_bytes(load_corpus(None))
        model = trained_model(Qwen3Config(), corpus, TrainConfig(steps=300, seed=0))
        windows = corpus.eval_windows()
        reference = held_out_logits(model, windows)
        return model, corpus.calibration(), lambda m: kl_stats(reference, held_out_logits(m, windows)), \
            windows[:args.llama_windows, :-1], None
    model = load_model(args.model, torch.float32, dense=True).eval()
    corpus = Corpus.from_text(load_corpus(args.text), load_tokenizer(args.model))
    chunks = corpus.eval_chunks(args.ctx, args.chunks)
    calibration = corpus.calibration(seq_len=args.calib_len, n=args.calib_samples)
    reference = ReferenceLogits(model, chunks)                           # the reference runs once
    return model, calibration, lambda m: compare_models(reference, m, chunks), chunks[:args.llama_windows], \
        args.model


def rtn(model, kind):
    """A copy of `model` with every linear llama.cpp's round-to-nearest of `kind` (or its fallback)."""
    model = copy.deepcopy(model)
    for name in linear_names(model):
        parent, _, child = name.rpartition(".")
        linear = model.get_submodule(name)
        used = gptq_ggml.ggml_type_for(kind, linear.in_features)
        layer = gptq_ggml.ggml_layer(gptq_ggml.rtn_ggml(linear.weight, used), used, linear.in_features, linear.bias)
        setattr(model.get_submodule(parent), child, layer)
    return model


def file_bits(path):
    """Bits per weight of the decoder linears in a GGUF file: their bytes over their weights."""
    with gguf_file.GGUFFile(path) as f:
        keys = [k for k in f.tensors if k.split(".")[-2] in gguf.LINEARS and k.endswith(".weight")]
        return sum(f.raw(k).numel() * 8 for k in keys) / sum(int(np.prod(f.tensors[k].shape)) for k in keys)


@torch.no_grad()
def llama_checks(python, path, model, ids, out, greedy):
    """llama.cpp runs the file: KL against the engine's forward of the same file, and greedy tokens."""
    np.save(out / "ids.npy", ids.numpy())
    extra = ["--greedy", greedy, out / "prompts.npy", out / "greedy.npy"] if greedy else []
    if greedy:
        np.save(out / "prompts.npy", ids[:, :16].numpy())
    done = run_client(python, "llamacpp", out / "ids.npy", out / "theirs.npy", path, *extra)[-1]
    if "refused" in done:
        return {"llama.cpp": done["refused"]}
    ours = torch.log_softmax(model(ids).double(), -1)
    row = {"llama.cpp_kl_vs_engine": compare(ours, np.load(out / "theirs.npy"))["kl"]}
    if greedy:
        mine = model.generate(ids[:, :16], greedy)[:, 16:].numpy()
        same = [bool(np.array_equal(a, b)) for a, b in zip(mine, np.load(out / "greedy.npy"))]
        row["greedy_identical"] = f"{sum(same)}/{len(same)}"
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a real model (folder or .gguf); default: the tiny Qwen3")
    parser.add_argument("--types", nargs="*", default=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--bpw", nargs="*", type=float, default=[], help="GPTQ mixes at these budgets")
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine-kquants"))
    parser.add_argument("--text", help="real model: held-out text (default: the built-in corpus)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--llama-windows", type=int, default=4)
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    reference, calibration, score, ids, tokenizer = setup(args)
    python = None if args.no_llama else client_python("llamacpp", install=False)[0]
    greedy = 32 if args.model is None else 0
    f32 = args.out / "f32.gguf"
    write_gguf(reference, f32, tokenizer=tokenizer_metadata(reference.cfg, tokenizer), force=True)
    rows = []
    plans = [(f"RTN {t}", t, None) for t in args.types] + [(f"GPTQ {t}", t, None) for t in args.types] + \
        [(f"GPTQ mix {b}", "mix", b) for b in args.bpw]
    for label, kind, bpw in plans:
        t0 = time.perf_counter()
        if label.startswith("RTN"):
            model = rtn(reference, kind)
        else:
            model = copy.deepcopy(reference)
            gptq_ggml.quantize(model, calibration, ggml_type=kind, **({"bpw": bpw} if bpw else {}))
        seconds = time.perf_counter() - t0
        path = args.out / (label.replace(" ", "-") + ".gguf")
        report = write_gguf(model, path, tokenizer=tokenizer_metadata(model.cfg, tokenizer), force=True)
        loaded = gguf.load_gguf(path)
        row = {"row": label, "bpw": round(file_bits(path), 4), "types": report["types"],
               "seconds": round(seconds, 1), **score(loaded)}
        if python is not None:
            row.update(llama_checks(python, path, loaded, ids, args.out, greedy))
            if label.startswith("RTN"):                     # llama.cpp's own quantizer: the same bytes?
                theirs = args.out / f"llama-{kind}.gguf"
                done = run_client(python, "quantize", f32, theirs, kind, "--pure")[-1]
                if "refused" in done or done.get("status"):
                    row["llama_quantize"] = done.get("refused", done)
                else:
                    with gguf_file.GGUFFile(theirs) as a, gguf_file.GGUFFile(path) as b:
                        names = [n for n, info in b.tensors.items()      # (a MoE's experts: whole stacks)
                                 if info.type_name not in ggml.DENSE
                                 and n not in ("token_embd.weight", "output.weight")]
                        row["llama_quantize_same_bytes"] = sum(n in a.tensors and torch.equal(a.raw(n), b.raw(n))
                                                               for n in names)
                        row["llama_quantize_linears"] = len(names)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | bits/weight | KL | types | llama.cpp KL vs engine (same file) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['bpw']:.3f} | {r['kl_nats']:.5f} | {r['types']} | "
              f"{r.get('llama.cpp_kl_vs_engine', 'not run')} |")


if __name__ == "__main__":
    main()
