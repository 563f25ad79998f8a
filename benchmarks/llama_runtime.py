"""Whole files in llama.cpp's own runtime: the engine's GPTQ on an IQ4 grid against llama.cpp's own file of the
same type with an importance matrix from the same calibration ids, both as llama-quantize would ship them (the
embedding in the type llama.cpp gives it), both run by llama.cpp (its 8-bit activations in quantized dot products),
scored against llama.cpp's run of the F32 reference on held-out text.

    python benchmarks/llama_runtime.py [--reference DIR] [--types IQ4_XS] [--damp 0.01] [--text gpl3]

DIR is benchmarks/frontier.py's reference folder (default ~/.cache/engine/frontier/smollm2; built if absent): its
`reference` model and `reference.gguf`, `calibration.pt` ids (the engine's GPTQ and llama.cpp's importance matrix
both come from them), `texts.pt` held-out chunks. The scored positions are the second half of each chunk, as the
frontier's. Each line: the file, its size and bits per parameter of the whole file, the linears' bits per weight,
KL mean +- its standard error, p99, and the share of positions whose top token is the reference's. Files are kept
in DIR/files (delete one to remake it).
"""
import argparse
import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import frontier  # noqa: E402
import frontier_peers as peers  # noqa: E402
import frontier_reference as reference  # noqa: E402
from clients import client_python, run_client  # noqa: E402
from engine.formats.llama_cpp.gguf_file import GGUFFile  # noqa: E402
from engine.checkpoints.tokenizer import tokenizer_metadata  # noqa: E402
from engine.formats.llama_cpp.gguf_writer import write_gguf  # noqa: E402
from engine.evaluation import kl_per_position  # noqa: E402
from engine.formats.llama_cpp import gptq_ggml  # noqa: E402


def scored(logprobs):
    """[chunks, T, V] -> the second half of each chunk's positions, [chunks * T/2, V] float64."""
    t = logprobs.shape[1]
    return torch.as_tensor(logprobs[:, t // 2:]).double().reshape(-1, logprobs.shape[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, default=frontier.OUT / "smollm2")
    parser.add_argument("--types", nargs="+", default=["IQ4_XS"])
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ's damping (the engine's default 0.01)")
    parser.add_argument("--text", default="gpl3", choices=reference.TEXTS)
    args = parser.parse_args(argv)
    python, why = client_python("llamacpp", install=True)
    if python is None:
        raise SystemExit(f"error: llama.cpp's client is not available: {why}")
    model, _, folder = reference.build(args.reference.name, args.reference.parent)
    calibration = torch.load(folder / "calibration.pt")
    ids = torch.load(folder / "texts.pt")[args.text]
    files = folder / "files"
    files.mkdir(exist_ok=True)
    np.save(files / "runtime-ids.npy", ids.numpy())
    imatrix = folder / "imatrix.gguf"
    if not imatrix.exists():
        frontier.write_imatrix(frontier.importance(model, calibration), imatrix, len(calibration),
                               calibration.shape[1])
    paths = {"F32 reference": folder / "reference.gguf"}
    for kind in args.types:
        ours = files / f"engine-gptq-{kind}-damp{args.damp}-llama-embedding.gguf"
        if not ours.exists():
            quantized = copy.deepcopy(model)
            gptq_ggml.quantize(quantized, calibration, ggml_type=kind, damp=args.damp)
            write_gguf(quantized, ours, tokenizer=tokenizer_metadata(quantized.cfg, folder / "reference.gguf"),
                       embedding_type="llama.cpp")
        theirs = files / f"llama-{kind}-imatrix-own-embedding.gguf"
        if not theirs.exists():
            run_client(python, "quantize", folder / "reference.gguf", theirs, kind, "--imatrix", imatrix,
                       "--own-embedding")
        paths[f"engine GPTQ on {kind}'s imatrix grid, damp {args.damp}"] = ours
        paths[f"llama.cpp {kind} + imatrix"] = theirs
    logprobs = {}
    for label, path in paths.items():
        out = files / f"runtime-{path.stem}.npy"
        run_client(python, "llamacpp", files / "runtime-ids.npy", out, path)
        logprobs[label] = scored(np.load(out))
    ref = logprobs.pop("F32 reference")
    for label, lp in logprobs.items():
        kl = kl_per_position(ref, lp)
        _, bits, types = peers.gguf_linears(paths[label])
        weights = sum(types.values())
        with GGUFFile(paths[label]) as f:
            parameters = sum(math.prod(info.shape) for info in f.tensors.values())
        size = paths[label].stat().st_size
        row = {"file": label, "MiB": round(size / 2 ** 20, 1), "file_bits": round(8 * size / parameters, 3),
               "linear_bits": round(sum(bits.values()) / weights, 4), "text": args.text,
               "kl": float(kl.mean()), "kl_stderr": float(kl.std() / len(kl) ** 0.5),
               "kl_p99": float(kl.quantile(0.99)),
               "same_top_pct": round(100 * float((ref.argmax(-1) == lp.argmax(-1)).double().mean()), 2)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
