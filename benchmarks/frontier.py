"""The quality frontier on a real model: the engine's rows and the peers' rows (llama.cpp, HQQ, bitsandbytes,
AutoRound, GPTQModel, llm-compressor), every one scored the same way, in one table and one plot.

    python benchmarks/frontier.py [--references smollm2 tiny] [--tools engine llama.cpp HQQ ...] [--rows SUBSTR ...]
                                  [--out DIR] [--no-install] [--rerun SUBSTR ...] [--render]

Fair by construction:
- one reference per run, off every tool's grid (benchmarks/frontier_reference.py: SmolLM2-135M moved off its Q4_1
  grid by a function-preserving channel rescaling plus noise of 0.03 of a step, and the book's float tiny model),
  handed to every tool as the same files (an HF folder with its tokenizer, an F32 GGUF of the same weights);
- one calibration (ids from the first 90% of Python's pydoc topics) for every data-aware tool; llama.cpp's
  importance matrix is computed from the same ids (the reference's f32 forward, sum of x^2 per input column of each
  linear, written in llama.cpp's GGUF imatrix format and handed to llama_model_quantize as llama-quantize does);
- one scorer: each row's decoder linears (dequantized from the tool's own file) are put into the reference model and
  run by the engine's float32 forward, so no tool's runtime (llama.cpp rounds activations to 8 bits) enters, and
  llama.cpp's `perplexity --kl-divergence` statistics (engine.evaluation.compare_models) are taken against the
  reference on the same chunks of four held-out texts of different kinds (frontier_reference.TEXTS: a licence,
  Python's docs, Python source, IDLE's release notes; never calibrated on), the same scored positions;
- one bit count: every bit the file stores for the decoder linears over their weights (frontier_peers docstring);
  the engine's rows count their layers' storage_bits, the same rule (codes, every scale, offset and index). Beside
  it, the whole file a user downloads (`file_bytes`: embedding, norms, tokenizer and metadata too): a peer's file or
  folder as its tool wrote it, and for the engine's rows on llama.cpp's grids the GGUF `--target llama.cpp` writes
  (the embedding at llama-quantize's type), written once to be measured.

Each row is cached in OUT/<reference>/rows/<row>.json (a killed run resumes; --rerun recomputes matching rows); each
prints one JSON line. A row the cache lacks is taken from those kept with the repository (--kept, default
appendix/frontier_rows/<reference>/: the cache's row files, copied there by hand), so a new machine resumes. What a
row quantized is kept too (a peer's file in files/, the engine's quantized decoder layers in files/engine/), so a
text added later is scored from the cache without quantizing again (a row kept with the repository has no such
files: it is quantized again). At the end: a
markdown table per reference sorted by bits (rows that could not run say why), per rate (about 2.5, 3, 3.5, 4, 4.5,
5, 6.5 and 8 bits) the engine's best KL over the best peer's on each text with their range and geometric mean, each
text's frontier (the best peer row against the engine's best row at or below its bits), and OUT/frontier.png (KL on
a log axis against bits on the first text, every tool's points; the ratios per text). It is long on 2 cores (hours
for SmolLM2): run it under `nice -n 10`.
"""
import argparse
import copy
import json
import os
import pickle
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import frontier_peers as peers  # noqa: E402
from frontier_report import plot, reference_report  # noqa: E402
import frontier_reference as reference  # noqa: E402
from engine.checkpoints.tokenizer import tokenizer_metadata  # noqa: E402
from engine.formats.llama_cpp.gguf_writer import gguf_name, write_gguf  # noqa: E402
from engine.data import calibration_ids  # noqa: E402
from engine.evaluation import ReferenceLogits, compare_models, kl_per_position  # noqa: E402
from engine.formats.numerics import affine  # noqa: E402
from engine.formats import awq, entropy, fp8, gptq, lattice, mx, nf4, trellis  # noqa: E402
from engine.formats.llama_cpp import ggml, gptq_ggml  # noqa: E402
from engine.safe_writes import folder_size  # noqa: E402
from engine.layers import model_bits  # noqa: E402

OUT = Path(os.environ.get("ENGINE_FRONTIER", Path.home() / ".cache" / "engine" / "frontier"))
KEPT = ROOT / "appendix" / "frontier_rows"     # rows kept with the repository: <reference>/<row>.json
ENGINE_ROWS = [   # (label, quantize(model, calibration, **options), options): cheap rows first
    ("FP8 E4M3, 128x128 blocks", fp8.quantize, dict(block=128)),
    ("RTN int8, g128", affine.quantize, dict(bits=8, group_size=128)),
    ("RTN int4, g128", affine.quantize, dict(bits=4, group_size=128)),
    ("RTN int4, g32", affine.quantize, dict(bits=4, group_size=32)),
    ("MXFP4", mx.quantize, dict(format="mxfp4")),
    ("NVFP4", mx.quantize, dict(format="nvfp4")),
    ("NF4, g64", nf4.quantize, dict(group_size=64)),
    ("GPTQ int8, g128", gptq.quantize, dict(bits=8, group_size=128)),
    ("GPTQ int4, g128", gptq.quantize, dict(group_size=128)),
    ("GPTQ int4, g32", gptq.quantize, dict(group_size=32)),
    ("AWQ int4, g128", awq.quantize, dict(group_size=128)),
    ("AWQ int4, g32", awq.quantize, dict(group_size=32)),
    ("GPTQ int2, g32", gptq.quantize, dict(bits=2, group_size=32)),
    # GPTQ's codes on llama.cpp's own grids (the scales llama-quantize --imatrix picks with the calibration's
    # importance, its blocks; a row not a multiple of 256 gets llama.cpp's fallback type, as the GGUF file would),
    # and a mix of those types at a bits budget picked by measured error
    *[(f"GPTQ on llama.cpp's {t} imatrix grid", gptq_ggml.quantize, dict(ggml_type=t))
      for t in ("Q6_K", "Q5_K", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")],
    *[(f"GPTQ on llama.cpp's IQ4_XS imatrix grid, damp {d}", gptq_ggml.quantize, dict(ggml_type="IQ4_XS", damp=d))
      for d in (0.1, 0.3)],
    *[(f"GPTQ on llama.cpp's {t} imatrix grid, damp 0.1", gptq_ggml.quantize, dict(ggml_type=t, damp=0.1))
      for t in ("Q5_K", "Q4_K")],
    ("GPTQ on llama.cpp's imatrix grids, IQ4_NL, down_proj Q3_K, damp 0.1", gptq_ggml.quantize,
     dict(damp=0.1, ggml_type={**dict.fromkeys(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"], "IQ4_NL"),
                               "mlp.down_proj": "Q3_K"})),
    # 6.03 and 4.43: budgets at the size of llama.cpp's Q5_K_M and IQ4_XS + imatrix files of SmolLM2 (6.035, 4.4375)
    *[(f"GPTQ K-quant mix, imatrix grids, --bpw {b}", gptq_ggml.quantize, dict(bpw=b))
      for b in (6.03, 6.0, 5.5, 4.5, 4.4, 3.5)],
    *[(f"GPTQ K-quant mix, imatrix grids, --bpw {b}, damp 0.1", gptq_ggml.quantize, dict(bpw=b, damp=0.1))
      for b in (4.5, 4.43, 4.25)],
    # the same mixes planned in the model's output KL (plan="fisher": each row's error weighted by its output Fisher)
    *[(f"GPTQ K-quant mix, imatrix grids, --bpw {b}, Fisher plan", gptq_ggml.quantize, dict(bpw=b, plan="fisher"))
      for b in (6.0, 5.5)],
    *[(f"GPTQ K-quant mix, imatrix grids, --bpw {b}, damp 0.1, Fisher plan", gptq_ggml.quantize,
       dict(bpw=b, damp=0.1, plan="fisher")) for b in (4.5, 4.25)],
    *[(f"lattice E8, {b} bps", lattice.quantize, dict(lattice="E8", bps=b)) for b in (4.0, 3.0, 2.0)],
    *[(f"EntQuant Float8+ANS, ~{b} bpw", entropy.quantize, dict(bpw=b, tol=0.05)) for b in (4.0, 3.0, 2.1)],
    *[(f"EntQuant + calibration-Hessian feedback, ~{b} bpw", entropy.quantize,
       dict(bpw=b, tol=0.05, feedback="calibration")) for b in (4.0, 3.0, 2.1)],
    *[(f"EntQuant + calibration-Hessian feedback, ~{b} bpw, damp 0.1", entropy.quantize,
       dict(bpw=b, tol=0.05, feedback="calibration", feedback_damp=0.1)) for b in (4.5, 4.2, 4.0)],
    ("trellis BlockLDLQ, L=8, K=4", trellis.quantize, dict(L=8, K=4, ldlq=True)),
    ("trellis BlockLDLQ, L=8, K=3", trellis.quantize, dict(L=8, K=3, ldlq=True)),
    ("trellis BlockLDLQ, L=8, K=2", trellis.quantize, dict(L=8, K=2, ldlq=True)),
    # a remedy for a lead that depends on the text: the same rows calibrated on half pydoc, half text the reference
    # writes itself (`--calib pydoc self`), so less of the calibration is the docs' domain
    *[(f"{label}, calibration pydoc + self", fn, dict(options, calib=("pydoc", "self"))) for label, fn, options in (
        ("GPTQ on llama.cpp's IQ4_XS imatrix grid, damp 0.1", gptq_ggml.quantize, dict(ggml_type="IQ4_XS", damp=0.1)),
        ("GPTQ K-quant mix, imatrix grids, --bpw 5.5, Fisher plan", gptq_ggml.quantize, dict(bpw=5.5, plan="fisher")),
        ("GPTQ int4, g128", gptq.quantize, dict(group_size=128)))],
]
TOOLS = ("engine", "llama.cpp", "HQQ", "bitsandbytes", "GPTQModel", "llm-compressor", "AutoRound")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Unavailable(RuntimeError):
    """The tool's venv is missing or broken: the row says why and is not cached."""


def slug(tool, label):
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{tool}-{label}").strip("_")


class Context:
    """What a row needs: the reference's folder and files, the peer's python, the importance matrix (made once)."""

    def __init__(self, folder, model, calibration, settings):
        self.folder, self.model, self.calibration, self.settings = folder, model, calibration, settings
        self.files, self.python = folder / "files", None
        self.files.mkdir(exist_ok=True)

    def calibration_for(self, sources):
        """Calibration ids from `sources` (engine.data.calibration_ids: "pydoc", "self") of the reference's size,
        made once and kept beside the reference."""
        path = self.folder / f"calibration-{'+'.join(sources)}.pt"
        if not path.exists():
            ids = calibration_ids(sources, reference.tokenizer_of(self.folder.name), self.settings["calib_len"],
                                  self.settings["calib_samples"], model=lambda: self.model).ids
            torch.save(ids, path)
        return torch.load(path)

    def imatrix(self):
        path = self.folder / "imatrix.gguf"
        if not path.exists():
            write_imatrix(importance(self.model, self.calibration), path, len(self.calibration),
                          self.calibration.shape[1])
        return path


@torch.no_grad()
def importance(model, calibration):
    """{module: (sum over calibration tokens of x^2 per input column [in], tokens)} for every decoder linear: what
    llama-imatrix accumulates (tools/imatrix/imatrix.cpp: acc[j] += x[j] * x[j], counts += rows), on the reference's
    float32 forward."""
    sums, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            def hook(mod, args, out, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                s, n = sums.get(name, (0, 0))
                sums[name] = (s + x.square().sum(0), n + x.shape[0])
            hooks.append(module.register_forward_hook(hook))
    try:
        for row in calibration:
            model(row[None])
    finally:
        for h in hooks:
            h.remove()
    return sums


def write_imatrix(sums, path, chunks, chunk_size):
    """llama.cpp's GGUF imatrix file (common/imatrix-loader.cpp reads it): general.type "imatrix", imatrix.datasets,
    imatrix.chunk_count, imatrix.chunk_size, and per weight `<gguf name>.in_sum2` F32 [in] and `.counts` F32 [1]."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["pydoc_data.topics (first 90%)"])
    w.add_uint32("imatrix.chunk_count", chunks)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, (s, n) in sorted(sums.items()):
        stem = gguf_name(name + ".weight").removesuffix(".weight")
        w.add_tensor(f"{stem}.weight.in_sum2", s.float().numpy()[None])
        w.add_tensor(f"{stem}.weight.counts", torch.tensor([[float(n)]]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def with_weights(model, weights):
    """A copy of the dense reference with its decoder linears' weights replaced by `weights` {module: [out, in]}."""
    model = copy.deepcopy(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.")}
    if set(weights) != set(linears):
        missing, extra = sorted(set(linears) - set(weights))[:3], sorted(set(weights) - set(linears))[:3]
        raise ValueError(f"the file's linears do not match the model's (missing {missing}, unexpected {extra})")
    for name, w in weights.items():
        if tuple(w.shape) != tuple(linears[name].weight.shape):
            raise ValueError(f"{name}: {tuple(w.shape)} in the file, {tuple(linears[name].weight.shape)} in the model")
        linears[name].weight.data = w.float().contiguous()
    return model


def engine_row(model, calibration, quantize, options):
    """Quantize a copy of the reference with the engine; -> (model, bits, how)."""
    model = copy.deepcopy(model)
    quantize(model, calibration, **options)
    return model, model_bits(model), "its layers' storage_bits"


def layers_path(ctx, label):
    """Where an engine row's quantized decoder layers are kept (pickled modules: the codes, every scale, and what a
    method folded into the norms), so that a text added later is scored without quantizing again."""
    return ctx.files / "engine" / f"{slug('engine', label)}.pt"


def keep_layers(model, path):
    path.parent.mkdir(exist_ok=True)
    part = path.with_name(path.name + ".part")
    torch.save(model.model.layers, part)
    os.replace(part, path)


def kept_model(ctx, label):
    """The reference with an engine row's kept decoder layers, or None where none are kept or they no longer load
    (the engine's classes changed since: the row is quantized again)."""
    path = layers_path(ctx, label)
    if not path.exists():
        return None
    try:
        layers = torch.load(path, weights_only=False)             # our own cache, written by keep_layers
    except (AttributeError, ImportError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        log(f"{path.name} does not load ({type(e).__name__}: {e}); quantizing the row again")
        return None
    model = copy.deepcopy(ctx.model)
    model.model.layers = layers
    return model


def file_bytes(path):
    """The size of what a user downloads, a file or a folder's files, in bytes (None: no file of the tool's own)."""
    if path is None or not Path(path).exists():
        return None
    return Path(path).stat().st_size if Path(path).is_file() else folder_size(path)


def engine_gguf_bytes(model, ctx):
    """An engine row whose linears are all GGML blocks (GPTQ on llama.cpp's grids) as the GGUF file `--target
    llama.cpp` writes (its tokenizer, the embedding at llama-quantize's type): its size in bytes, the file removed
    (it is measured, not kept). None for other rows."""
    linears = [m for n, m in model.named_modules() if n.startswith("model.layers.") and hasattr(m, "dequantize")]
    if not linears or not all(isinstance(m, ggml.GGMLLinear) for m in linears):
        return None
    path = ctx.files / f"engine-row-{os.getpid()}.gguf"                 # two runs at once write apart
    try:
        write_gguf(model, path, tokenizer=tokenizer_metadata(model.cfg, ctx.folder / "reference"),
                   embedding_type="llama.cpp", force=True)
        return file_bytes(path)
    finally:
        path.unlink(missing_ok=True)


def all_rows(tools, substrings):
    rows = [("engine", label, None, (fn, options)) for label, fn, options in ENGINE_ROWS]
    rows += [(tool, label, venv, produce) for tool, label, venv, produce in peers.peer_rows()]
    return [r for r in rows if r[0] in tools and (not substrings or any(matches(s, r) for s in substrings))]


def matches(pattern, row):
    """--rows / --rerun: a substring of "tool label" (case-insensitive), or "=tool label" for that row alone."""
    name = f"{row[0]} {row[1]}".lower()
    return name == pattern[1:].lower() if pattern.startswith("=") else pattern.lower() in name


def measure(row, ctx, refs, texts, install, cached=None):
    """One row -> its result dict (an "error" with the reason when the tool cannot run it). cached: the row's
    earlier result, lacking some of `texts`: its figures stay and only those texts are scored, on the row's model
    read back (a peer's file, the engine's kept layers), not quantized again. An engine row with no kept layers is
    quantized again and scored on every text (old scores of another quantization are not mixed in)."""
    tool, label, venv, work = row
    model = kept_model(ctx, label) if tool == "engine" and cached else None
    result = cached if model is not None or (cached and tool != "engine") else {"tool": tool, "row": label}
    t0 = time.perf_counter()
    try:
        if tool == "engine" and model is None:
            quantize, options = work
            sources = options.get("calib")
            calibration = ctx.calibration_for(sources) if sources else ctx.calibration
            model, bits, how = engine_row(ctx.model, calibration, quantize,
                                          {k: v for k, v in options.items() if k != "calib"})
            seconds = time.perf_counter() - t0
            keep_layers(model, layers_path(ctx, label))
            size = engine_gguf_bytes(model, ctx)
        elif tool != "engine":
            ctx.python, missing = peers.venv_python(venv, install)
            if missing:
                raise Unavailable(f"{tool}: {missing}")
            weights, per_module, how, path = work(ctx)        # the tool runs only where its file is missing
            model = with_weights(ctx.model, weights)
            weights_n = sum(w.numel() for w in weights.values())
            bits, seconds, size = sum(per_module.values()) / weights_n, time.perf_counter() - t0, file_bytes(path)
        if "bits" not in result:
            result.update(bits=round(bits, 4), bits_counted=how, seconds=round(seconds, 1))
            if size is not None:
                result["file_bytes"] = size
        scores = result.setdefault("texts", {})
        scores.update({t: compare_models(refs[t], model, texts[t]) for t in texts if t not in scores})
    except (RuntimeError, ValueError, OSError, KeyError) as e:
        result["error"] = f"{type(e).__name__}: {e}"[:400]
    return result


def cached_row(path):
    """A row's cached result, or None where there is none or it does not parse (a run killed while writing it: the
    row is measured again)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        log(f"{path.name} does not parse ({e}); measuring the row again")
        return None


def run_reference(name, args):
    model, info, folder = reference.build(name, args.out)
    texts = {t: ids for t, ids in torch.load(folder / "texts.pt").items() if t in args.texts}
    ctx = Context(folder, model, torch.load(folder / "calibration.pt"), reference.SETTINGS[name])
    (folder / "rows").mkdir(exist_ok=True)
    refs, results = None, []
    for row in all_rows(args.tools, args.rows):
        path = folder / "rows" / f"{slug(row[0], row[1])}.json"
        rerun = args.rerun and any(matches(s, row) for s in args.rerun)
        cached = (cached_row(path) or cached_row(args.kept / name / path.name)) if not rerun else None
        if cached and ("error" in cached or set(texts) <= set(cached["texts"])):
            results.append(cached)
            continue
        if args.render:
            if cached:                       # the texts it has; the report leaves the others blank
                results.append(cached)
            continue
        if refs is None:
            refs = {t: ReferenceLogits(model, ids) for t, ids in texts.items()}
        log(f"{name}: {row[0]} {row[1]}" + (f" (scoring {', '.join(sorted(set(texts) - set(cached['texts'])))})"
                                            if cached else ""))
        result = {"reference": name, **measure(row, ctx, refs, texts, not args.no_install, cached)}
        print(json.dumps(result), flush=True)
        if not result.get("error", "").startswith("Unavailable"):      # an absent tool is asked again next run
            path.write_text(json.dumps(result, indent=1))
        results.append(result)
    if "llama.cpp" in args.tools:
        info["cross_check"] = cross_check(ctx, texts, run=not args.render)
    return info, results


def cross_check(ctx, texts, kind="Q4_K_M", run=True):
    """llama.cpp's own run of its `kind` file against the engine's f32 forward of the same dequantized weights, on the
    first text's first 2 chunks: the KL llama.cpp's runtime adds (its 8-bit activations), which this scorer leaves
    out. The file keeps the reference's F32 embedding (the row's own file has llama-quantize's), so that only the
    runtime differs. Cached in cross_check.json; None when llama.cpp is missing."""
    path = ctx.folder / "cross_check.json"
    if path.exists():
        return json.loads(path.read_text())
    python, missing = peers.venv_python("llamacpp", install=False) if run else (None, "not asked")
    if missing:
        return None
    gguf_file = ctx.files / f"llama-{kind}-f32-embedding.gguf"         # only the linears differ from the reference
    if not gguf_file.exists():
        peers.run(python, peers.clients.RUNNERS, "quantize", ctx.folder / "reference.gguf", gguf_file, kind)
    import numpy as np
    ids = next(iter(texts.values()))[:2]
    np.save(ctx.files / "cross_check_ids.npy", ids.numpy())
    out = ctx.files / "cross_check_logprobs.npy"
    peers.run(python, peers.clients.RUNNERS, "llamacpp", ctx.files / "cross_check_ids.npy", out, gguf_file)
    model = with_weights(ctx.model, peers.gguf_linears(gguf_file)[0])
    with torch.no_grad():
        ours = model(ids)
    first = ids.shape[1] // 2
    theirs = torch.from_numpy(np.load(out))[:, first:-1]
    kl_ = kl_per_position(ours[:, first:-1], theirs.double())
    result = {"file": f"llama.cpp {kind}", "positions": kl_.numel(), "kl_engine_vs_llama.cpp": float(kl_.mean())}
    path.write_text(json.dumps(result))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--references", nargs="+", default=["smollm2", "tiny"], choices=list(reference.SETTINGS))
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--texts", nargs="+", default=list(reference.TEXTS), choices=reference.TEXTS,
                        help="held-out texts to score (default all: legal, docs, code, notes; the first one's KL "
                        "is the plot's); a cached row is scored on the texts it lacks, not quantized again")
    parser.add_argument("--rows", nargs="*", help="only rows whose 'tool label' contains one of these substrings "
                        "(or is '=tool label')")
    parser.add_argument("--rerun", nargs="*", help="recompute the cached rows matching these substrings")
    parser.add_argument("--out", type=Path, default=OUT, help=f"cache and outputs (default {OUT})")
    parser.add_argument("--kept", type=Path, default=KEPT, help="rows kept with the repository, used where the cache "
                        f"has none (default {KEPT}; copied there from OUT/<reference>/rows by hand)")
    parser.add_argument("--no-install", action="store_true", help="a missing peer venv is a row's reason, not built")
    parser.add_argument("--render", action="store_true", help="only the tables and plot of the cached rows")
    parser.add_argument("--plot", type=Path, help="the plot's path (default OUT/frontier.png)")
    args = parser.parse_args(argv)
    if args.kept.exists() and not args.kept.is_dir():
        parser.error(f"--kept {args.kept} is not a folder")
    torch.set_num_threads(1)      # on a shared 2-core machine a second thread made the forward 8x slower (spinning)
    reports = [run_reference(name, args) for name in args.references]
    report = "\n\n".join(reference_report(info, results, args.texts) for info, results in reports)
    print("\n" + report)
    (args.out / "frontier.md").write_text(report + "\n")
    plot(reports, args.texts, args.plot or args.out / "frontier.png")
    log(f"wrote {args.out / 'frontier.md'} and {args.plot or args.out / 'frontier.png'}")

if __name__ == "__main__":
    main()
