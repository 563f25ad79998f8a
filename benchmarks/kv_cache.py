"""The stored KV cache on a real model at long contexts: quality, bytes held, peak memory and speed of `generate`,
with llama.cpp's own q8_0 / q4_0 caches run in llama.cpp on the same tokens as the anchor.

    python benchmarks/kv_cache.py [--model smollm2] [--contexts 2048 8192] [--specs bf16 e8:3 q8_0 q4_0 ...]
                                  [--llama] [--memory] [--new-tokens 16]

Text: the GNU GPL v3 followed by the GPL v2 (Debian's /usr/share/common-licenses), held out from every calibration
here; one sequence of each context's length. Quality: each SPEC's cache is filled as a prefill fills it (512
tokens at a time, kv_store.stored_logits) and its next-token log-probs at positions ctx/2 .. ctx-2 are scored
against the exact float32 cache's: KL mean +- standard error, perplexity. Bytes: what the stored cache holds at the
context's end (pages + tail + exact window), against a bf16 cache of the same positions. llama.cpp (--llama): the
same ids through llama-cpp-python (flash attention on, as llama.cpp needs to quantize V; ubatch 512) with
--cache-type-k/-v f16, q8_0, q4_0, each scored against llama.cpp's f16 run (its own arithmetic: the GGUF's Q4_1
weights, 8-bit activations). Memory (--memory): `run.py generate` on a prompt of the context's length minus
--new-tokens, peak RSS and tokens/s, with and without each SPEC (one process at a time).
"""
import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from clients import client_python, run_client  # noqa: E402
from engine.checkpoints.models import load_model  # noqa: E402
from engine.checkpoints.tokenizer import encode, load_tokenizer, token_bytes  # noqa: E402
from engine.cli_checks import model_argument  # noqa: E402
from engine.evaluation import kl_per_position  # noqa: E402
from engine.formats.kv.kv_store import parse_kv_spec, stored_logits  # noqa: E402
from engine.qwen3 import KVCache  # noqa: E402

TEXTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/GPL-2")]
CHUNK = 512


def held_out_ids(tokenizer, ctx):
    missing = [str(p) for p in TEXTS if not p.exists()]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} missing (Debian's base-files ships them)")
    ids = encode(tokenizer, b"\n\n".join(p.read_bytes() for p in TEXTS))
    if ids.numel() < ctx:
        raise SystemExit(f"error: the held-out text is {ids.numel()} tokens, shorter than a context of {ctx}")
    return ids[None, :ctx]


def scored_logprobs(logits, first):
    return logits[0, first:-1].double().log_softmax(-1)


@torch.no_grad()
def exact_logits(model, ids):
    cache = KVCache(model.cfg.num_hidden_layers)
    return torch.cat([model(ids[:, i:i + CHUNK], cache) for i in range(0, ids.shape[1], CHUNK)], 1)


def quality(model, ids, specs):
    first = ids.shape[1] // 2
    t0 = time.perf_counter()
    reference = scored_logprobs(exact_logits(model, ids), first)
    targets = ids[0, first + 1:]
    rows = [{"kv": "exact float32", "ctx": ids.shape[1], "ppl": perplexity(reference, targets),
             "seconds": round(time.perf_counter() - t0, 1)}]
    print(json.dumps(rows[0]), flush=True)
    for spec in specs:
        t0 = time.perf_counter()
        quantizer = parse_kv_spec(spec)
        logits, cache = stored_logits(model, ids, quantizer, CHUNK)
        lp = scored_logprobs(logits, first)
        del logits
        kl = kl_per_position(reference, lp)
        held = cache.nbytes()
        rows.append({"kv": spec, "ctx": ids.shape[1], "kl": float(kl.mean()),
                     "kl_stderr": float(kl.std() / len(kl) ** 0.5), "ppl": perplexity(lp, targets),
                     "bits_counted": round(quantizer.report()["total_bps"], 3), "bytes_held": held["total"],
                     "bf16_bytes": cache.bf16_bytes(), "vs_bf16": round(held["total"] / cache.bf16_bytes(), 4),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def perplexity(logprobs, targets):
    return float(torch.exp(-logprobs.gather(-1, targets[:, None]).mean()))


def llama_anchor(model_path, ids, work):
    python, why = client_python("llamacpp", install=False)
    if python is None:
        print(json.dumps({"llama.cpp": None, "why": why}), flush=True)
        return []
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "ids.npy", ids.numpy())
    out = work / f"llama-kv-{ids.shape[1]}.json"
    run_client(python, "llamacpp-kv", work / "ids.npy", model_path, out, "--types", "f16", "q8_0", "q4_0",
               "--from", ids.shape[1] // 2, "--ubatch", CHUNK)
    rows = json.loads(out.read_text()) if out.exists() else []
    for row in rows:
        print(json.dumps({"llama.cpp": True, **row}), flush=True)
    return rows


def memory(model_arg, tokenizer, ctx, new_tokens, specs, work):
    """Peak RSS and speed of run.py generate on a prompt of ctx - new_tokens tokens, without and with each SPEC."""
    work.mkdir(parents=True, exist_ok=True)
    prompt = work / f"prompt-{ctx}.txt"
    ids = held_out_ids(tokenizer, ctx - new_tokens - 8)
    prompt.write_bytes(token_bytes(tokenizer, ids[0].tolist()))
    rows = []
    for spec in [None, *specs]:
        cmd = [sys.executable, str(ROOT / "run.py"), "generate", "--model", model_arg, "--prompt-file", str(prompt),
               "--max-new-tokens", str(new_tokens)] + ([] if spec is None else ["--kv-cache", spec])
        wrapped = [sys.executable, "-c", "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], "
                   "capture_output=True, text=True); sys.stderr.write(r.stderr); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)", *cmd]
        done = subprocess.run(wrapped, capture_output=True, text=True)
        speed = re.search(r"(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)", done.stderr)
        held = re.search(r"KV cache .*: ([\d.]+) MiB held for (\d+) positions, ([\d.]+)% of a bf16 cache's ([\d.]+) "
                         r"MiB", done.stderr)
        first = re.search(r"first token ([\d.]+) s", done.stderr)
        row = {"kv": spec or "exact float32", "ctx": ctx, "peak_rss_mib": round(int(done.stdout.split()[-1]) / 1024)
               if done.stdout.strip() else None, "prefill_s": float(first.group(1)) if first else None}
        if speed and first:                              # the new tokens after the first: one decode step each
            n, total = int(speed.group(1)), float(speed.group(2))
            row["decode_tokens_per_s"] = round((n - 1) / max(total - float(first.group(1)), 1e-9), 3)
        if held:
            row.update(cache_mib=float(held.group(1)), positions=int(held.group(2)),
                       bf16_mib=float(held.group(4)))
        if not speed:
            row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--specs", nargs="+", default=["bf16", "e8:3", "e8:4", "e8:2", "q8_0", "q4_0",
                                                       "q4_0,rotation=none", "fp8", "kivi:2"])
    parser.add_argument("--llama", action="store_true", help="llama.cpp's q8_0 / q4_0 caches on the same ids")
    parser.add_argument("--memory", action="store_true", help="peak RSS and speed of run.py generate")
    parser.add_argument("--memory-specs", nargs="+", default=["bf16", "e8:3", "q4_0"])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("/tmp/engine-kv-cache"))
    parser.add_argument("--no-quality", action="store_true")
    args = parser.parse_args(argv)
    for spec in args.specs + args.memory_specs:
        parse_kv_spec(spec)                                     # a bad SPEC stops here, before any work
    torch.set_num_threads(2)
    path = model_argument(args.model)
    tokenizer = load_tokenizer(path)
    model = None if args.no_quality else load_model(path, torch.float32, dense=True)
    print(json.dumps({"load": [round(x, 2) for x in __import__("os").getloadavg()]}), flush=True)
    for ctx in args.contexts:
        ids = held_out_ids(tokenizer, ctx)
        if model is not None:
            quality(model, ids, args.specs)
        if args.llama:
            llama_anchor(path, ids, args.work)
        if args.memory:
            memory(args.model, tokenizer, ctx, args.new_tokens, args.memory_specs, args.work)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
