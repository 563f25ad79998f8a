"""The client side of benchmarks/clients.py: each command runs inside one client's own virtual environment (so it
imports nothing from the engine) and writes full-vocabulary log-probs, float32 [N, T, V] with row t =
log P(next | ids[:t+1]); it prints one JSON line per model, {"model", ...timings} or {"model", "refused": line}.

    llamacpp     IDS OUT MODEL.gguf [--kv f32|f16] [--greedy N PROMPTS.npy TOKENS_OUT.npy]
    llamacpp-kv  IDS MODEL.gguf OUT.json [--types f16 q8_0 q4_0] [--from F] [--ubatch 512]
                                                        KL of llama.cpp's quantized KV caches against its f16 one
    convert      HF_DIR OUT.gguf TOKENIZER_DIR          llama.cpp's own convert_hf_to_gguf.py (a second reader)
    quantize     IN.gguf OUT.gguf TYPE [--imatrix F] [--pure]
                                                        llama.cpp's own quantizer (llama_model_quantize), the
                                                        embedding and output kept in F32 like the engine's files;
                                                        F: an importance matrix (llama.cpp's GGUF imatrix file);
                                                        --pure: every linear in TYPE or its fallback, no _M mix
    vllm         IDS [--dtype float16] [--tp 1] MODEL OUT [MODEL OUT ...]     all models in one process
    ortgenai     IDS MODEL OUT WORK_DIR TOKENIZER_DIR [--patch-lm-head]
    transformers IDS MODEL OUT [MODEL OUT ...]          an HF folder, or a .gguf file (gguf_file=)

TOKENIZER_DIR holds the byte model's tokenizer.json (written by the driver): the converter and the ONNX builder
need a tokenizer, which the engine's checkpoints do not carry.
"""
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def say(**info):
    print(json.dumps(info), flush=True)


class Refused(Exception):
    """A refusal whose message is already the line to report."""


def refusal(e):
    """One line that says why: pydantic's 'Value error, ...' line, else the exception's first line (plus the reason
    after vLLM's 'Reasons:')."""
    if isinstance(e, Refused):
        return str(e)[:400]
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()] or [repr(e)]
    for s in lines:
        if s.startswith("Value error, "):
            return s[len("Value error, "):].split(" [type=")[0]
    first = lines[0]
    if first.endswith("Reasons:"):
        first = first[:-len("Reasons:")].rstrip(" .") + (f": {lines[1]}" if len(lines) > 1 else " (no reasons given)")
    return f"{type(e).__name__}: {first}"[:400]


def normalized(logits):
    logits = np.asarray(logits, np.float64)
    return (logits - np.logaddexp.reduce(logits, -1, keepdims=True)).astype(np.float32)


def each_model(pairs, run):
    """run(model) -> (logprobs, info) for each (model, out) pair; a failure is a refusal line, not a crash."""
    failed = False
    for model, out in pairs:
        try:
            t0 = time.perf_counter()
            logprobs, info = run(model)
            np.save(out, logprobs)
            say(model=model, seconds=round(time.perf_counter() - t0, 2), **info)
        except Exception as e:
            say(model=model, refused=refusal(e))
            failed = True
        gc.collect()
    return 2 if failed else 0


def pairs_of(args):
    return list(zip(args[0::2], args[1::2]))


# ---- llama.cpp --------------------------------------------------------------------------------------------------

def llamacpp(args):
    import llama_cpp
    ids_path, out, model = args[:3]
    kv = args[args.index("--kv") + 1] if "--kv" in args else "f32"
    ids = np.load(ids_path)
    ggml_type = {"f32": 0, "f16": 1}[kv]

    def run(path):
        llm = llama_cpp.Llama(model_path=path, n_ctx=max(256, ids.shape[1] * 2), n_batch=ids.shape[1],
                              n_ubatch=ids.shape[1], logits_all=True, type_k=ggml_type, type_v=ggml_type,
                              n_threads=2, n_threads_batch=2, seed=0, verbose=False)
        rows = []
        for row in ids:
            llm.reset()
            llm.eval(row.tolist())
            rows.append(normalized(llm.scores[:len(row)]))
        info = {"version": llama_cpp.__version__, "kv": kv}
        if "--greedy" in args:                   # greedy continuations, argmax of llama.cpp's own logits
            i = args.index("--greedy")
            n, prompts = int(args[i + 1]), np.load(args[i + 2])
            tokens = []
            for prompt in prompts:
                llm.reset()
                llm.eval(prompt.tolist())
                new = []
                for _ in range(n):
                    new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([new[-1]])
                tokens.append(new)
            np.save(args[i + 3], np.array(tokens))
        llm.close()
        return np.stack(rows), info
    return each_model([(model, out)], run)


def llamacpp_kv(args):
    """IDS MODEL OUT.json [--types f16 q8_0 q4_0] [--from F] [--ubatch 512]: one sequence per row of IDS read with
    each KV cache type (flash attention on, as llama.cpp needs to quantize V), scored at positions F.. against the
    first type's run; one JSON line per type with the KL mean, its standard error, perplexity and seconds."""
    import llama_cpp
    ids_path, model, out = args[:3]
    types = args[args.index("--types") + 1:] if "--types" in args else ["f16", "q8_0", "q4_0"]
    types = types[:next((i for i, t in enumerate(types) if t.startswith("--")), len(types))]
    first = int(args[args.index("--from") + 1]) if "--from" in args else 0
    ubatch = int(args[args.index("--ubatch") + 1]) if "--ubatch" in args else 512
    ggml = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
    ids = np.load(ids_path)
    reference, rows = None, []
    for kind in types:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=model, n_ctx=ids.shape[1], n_batch=ubatch, n_ubatch=ubatch,
                              logits_all=True, type_k=ggml[kind], type_v=ggml[kind], flash_attn=True, n_threads=2,
                              n_threads_batch=2, seed=0, verbose=False)
        logprobs = []
        for row in ids:
            llm.reset()
            llm.eval(row.tolist())
            logprobs.append(normalized(llm.scores[first:len(row) - 1]))
        llm.close()
        logprobs = np.stack(logprobs)                                    # [N, T - 1 - first, V]
        targets = ids[:, first + 1:]
        nll = -np.take_along_axis(logprobs, targets[..., None], -1)[..., 0]
        row = {"model": model, "kv": kind, "version": llama_cpp.__version__, "ctx": int(ids.shape[1]),
               "positions": int(nll.size), "ppl": float(np.exp(nll.mean())),
               "seconds": round(time.perf_counter() - t0, 1)}
        if reference is None:
            reference = logprobs
        else:
            kl = (np.exp(reference) * (reference - logprobs)).sum(-1, dtype=np.float64).reshape(-1)
            row.update(kl=float(kl.mean()), kl_stderr=float(kl.std() / len(kl) ** 0.5), against=types[0])
        rows.append(row)
        say(**row)
    Path(out).write_text(json.dumps(rows, indent=1))
    return 0


def convert(args):
    """llama.cpp's converter on an HF folder; without tokenizer.json the byte vocabulary from TOKENIZER_DIR is
    written in its place (the converter would need a known pre-tokenizer hash). Tensors are the converter's own."""
    hf_dir, out, tokenizer_dir = args
    converter = Path(os.environ["LLAMACPP_CONVERTER"])
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import gguf
    from conversion import base
    vocab = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)

    def byte_vocab(self):
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"), w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.NORMAL] * len(tokens)), w.add_token_merges([f"{tokens[32]} {tokens[32]}"])
        w.add_add_bos_token(False), w.add_add_eos_token(False)
    if not (Path(hf_dir) / "tokenizer.json").exists():
        base.TextModel._set_vocab_gpt2 = byte_vocab
    import convert_hf_to_gguf
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", "f32"]
    try:
        convert_hf_to_gguf.main()
    except BaseException as e:                   # the converter exits through sys.exit or raises
        say(model=hf_dir, refused=refusal(e) if not isinstance(e, SystemExit) else f"converter exited {e.code}")
        return 2
    say(model=hf_dir, gguf=out)
    return 0


def quantize(args):
    """llama_model_quantize to TYPE (any LLAMA_FTYPE_MOSTLY_<TYPE>: Q4_K_M, IQ2_XXS, ...; or a bare Q3_K / Q4_K /
    Q5_K); embedding and output kept in F32 (--own-embedding: the types llama-quantize gives them). --pure: every
    linear in TYPE (or llama.cpp's fallback type), no mix.
    --imatrix FILE: an importance matrix in llama.cpp's GGUF imatrix format, read and normalized exactly as
    llama-quantize's load_imatrix does (in_sum2 / counts per tensor) and passed as params.imatrix."""
    import llama_cpp
    source, out, kind = args[:3]
    params = llama_cpp.llama_model_quantize_default_params()
    # a bare K-quant name (Q4_K) is its _S ftype, which with --pure (params.pure) is every linear in that type
    name = kind if hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}") else f"{kind}_S"
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    params.pure = "--pure" in args
    if "--own-embedding" not in args:
        params.token_embedding_type = params.output_tensor_type = 0    # F32, as the engine's exports keep them
    params.nthread = 2
    keep = []                                    # the arrays params.imatrix points into must outlive the call
    if "--imatrix" in args:
        keep = imatrix_entries(args[args.index("--imatrix") + 1])
        array = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
        for i, (name, values) in enumerate(keep):
            array[i].name, array[i].size = name, len(values)
            array[i].data = values.ctypes.data_as(llama_cpp.ctypes.POINTER(llama_cpp.ctypes.c_float))
        array[len(keep)].name = None                               # the terminator
        params.imatrix = llama_cpp.ctypes.cast(array, llama_cpp.ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    t0 = time.perf_counter()
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    say(model=out, type=kind, status=status, imatrix_entries=len(keep), seconds=round(time.perf_counter() - t0, 2))
    return 0 if status == 0 else 2


def imatrix_entries(path):
    """[(tensor name as bytes, float32 values)] from a GGUF imatrix file: `<name>.in_sum2` / `<name>.counts` per
    tensor (a count of 0 gives ones, as llama-quantize does)."""
    from gguf import GGUFReader
    tensors = {t.name: np.asarray(t.data, np.float32) for t in GGUFReader(path).tensors}
    entries = []
    for key in sorted(tensors):
        if key.endswith(".in_sum2"):
            name = key.removesuffix(".in_sum2")
            sums, counts = tensors[key].reshape(len(tensors[name + ".counts"].reshape(-1)), -1), \
                tensors[name + ".counts"].reshape(-1, 1)
            values = np.where(counts > 0, sums / np.maximum(counts, 1), 1).astype(np.float32).reshape(-1)
            entries.append((name.encode(), np.ascontiguousarray(values)))
    return entries


# ---- vLLM -------------------------------------------------------------------------------------------------------

def vllm(args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # no second process that imports vllm again
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    options = {"--dtype": "float16", "--tp": "1"}
    for key in options:
        if key in args:
            i = args.index(key)
            options[key] = args[i + 1]
            del args[i:i + 2]
    dtype, tp = options["--dtype"], int(options["--tp"])
    ids = np.load(args[0])
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt
    say(client="vllm", import_s=round(time.perf_counter() - t0, 1))

    def rows(entries, vocab):
        out = np.full((len(entries), vocab), np.nan, np.float32)
        for i, entry in enumerate(entries):
            out[i, list(entry.keys())] = [lp.logprob for lp in entry.values()]
        if np.isnan(out).any():
            raise ValueError("vLLM returned fewer log-probs than the vocabulary")
        return out

    def run(model):
        llm = LLM(model=model, skip_tokenizer_init=True, dtype=getattr(torch, dtype), enforce_eager=True,
                  max_logprobs=-1, max_model_len=max(256, ids.shape[1] + 8), seed=0, tensor_parallel_size=tp,
                  distributed_executor_backend="uni" if tp == 1 else "mp")
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params = SamplingParams(prompt_logprobs=-1, logprobs=-1, max_tokens=1, temperature=0.0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=r.tolist()) for r in ids], params, use_tqdm=False)
        # prompt_logprobs[t] is P(token t | ids[:t]) (None at t = 0); the last row is the generated token's
        result = np.stack([normalized(np.concatenate([rows(o.prompt_logprobs[1:], vocab),
                                                      rows(o.outputs[0].logprobs[:1], vocab)])) for o in outs])
        del llm
        return result, {"version": __version__, "dtype": dtype, "tp": tp}
    return each_model(pairs_of(args[1:]), run)


# ---- ONNX Runtime GenAI -----------------------------------------------------------------------------------------

# The builder's dense (transformers) path takes every nn.Linear with out_features == vocab_size for the LM head; in
# the byte model (vocab 256 = hidden 256) q_proj, o_proj and down_proj match too and the graph is wrong (KL ~1.3).
# This runs the builder with the LM head matched by identity (builder.py imports its siblings as `builders`).
PATCHED_BUILDER = """
import os, runpy, sys
import onnxruntime_genai.models as models
sys.path.insert(0, os.path.dirname(models.__file__))
from builders import base
base.Model.has_lm_head = lambda self, module: module is getattr(self.weights, "lm_head", None)
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""
EXCLUDE = "/lm_head/MatMul,/model/embed_tokens/Gather"     # the tied embedding stays as it is


def stage(hf_dir, staging, tokenizer_dir):
    """A copy the builder accepts: config with special ids (it needs an eos_token_id), weights linked, tokenizer."""
    hf_dir, staging = Path(hf_dir).resolve(), Path(staging)
    staging.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = 0 if cfg.get(key) is None else cfg[key]
    (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    sources = [*hf_dir.iterdir()] + [f for f in Path(tokenizer_dir).iterdir() if not (hf_dir / f.name).exists()]
    for f in sources:
        if f.name != "config.json" and not (staging / f.name).exists():
            (staging / f.name).symlink_to(f.resolve())
    return staging


def ortgenai(args):
    import onnxruntime_genai as og
    patch = "--patch-lm-head" in args
    ids_path, model, out, work, tokenizer_dir = [a for a in args if a != "--patch-lm-head"]
    ids = np.load(ids_path)

    def run(model):
        onnx_dir = Path(work) / "onnx"
        staging = stage(model, Path(work) / "staging", tokenizer_dir)
        entry = ["-c", PATCHED_BUILDER] if patch else ["-m", "onnxruntime_genai.models.builder"]
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *entry, "-i", str(staging), "-o", str(onnx_dir), "-p",
                               "fp32" if patch else "int4", "-e", "cpu", "-c", str(Path(work) / "cache"),
                               "--extra_options", "accuracy_level=1", f"nodes_to_exclude={EXCLUDE}"],
                              capture_output=True, text=True)
        (Path(work) / "build.log").write_text(done.stdout + done.stderr)
        if done.returncode:
            lines = [s for s in (done.stderr + done.stdout).splitlines() if s.strip()]
            errors = [s for s in lines if "Error" in s.split(":")[0] or "Exception" in s.split(":")[0]]
            raise Refused("model builder: " + (errors or lines or ["failed"])[-1].strip())
        build_s = time.perf_counter() - t0
        m = og.Model(str(onnx_dir))
        rows = []
        for row in ids:
            params = og.GeneratorParams(m)
            params.set_search_options(max_length=len(row) + 1, batch_size=1)
            gen = og.Generator(m, params)
            gen.append_tokens(row[None].astype(np.int32))
            rows.append(normalized(np.asarray(gen.get_output("logits"))[0]))
            del gen
        return np.stack(rows), {"version": og.__version__, "build_s": round(build_s, 1), "patched": patch}
    return each_model([(model, out)], run)


# ---- transformers -----------------------------------------------------------------------------------------------

def transformers_(args):
    """Plain from_pretrained(dtype=float32) first, as a user would; if that fails, the documented way for the
    format (recorded in the cell as "with")."""
    import torch
    import transformers
    ids = torch.as_tensor(np.load(args[0]))

    def recipes(path):
        if path.suffix == ".gguf":
            return [("gguf_file", dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name))]
        plain = [("plain", dict(pretrained_model_name_or_path=str(path)))]
        method = (json.loads((path / "config.json").read_text()).get("quantization_config") or {}).get("quant_method")
        if method == "compressed-tensors":
            return plain + [("CompressedTensorsConfig(dequantize=True)", dict(
                pretrained_model_name_or_path=str(path),
                quantization_config=transformers.CompressedTensorsConfig(dequantize=True)))]
        return plain

    def run(model):
        failures = []
        for name, kwargs in recipes(Path(model)):
            try:
                hf = transformers.AutoModelForCausalLM.from_pretrained(dtype=torch.float32, **kwargs).eval()
                with torch.no_grad():
                    logits = hf(ids).logits
                info = {"version": transformers.__version__, "with": name}
                return normalized(logits.float().numpy()), {**info, **({"failed": failures} if failures else {})}
            except Exception as e:
                failures.append(f"{name}: {refusal(e)}")
                if name == "gguf_file" and "ignore_mismatched_sizes" in str(e):   # which shapes it built
                    cfg = transformers.AutoConfig.from_pretrained(**kwargs)
                    failures[-1] = (f"{name}: the weights do not fit the model it built (head_dim {cfg.head_dim}, "
                                    f"{cfg.num_key_value_heads} KV heads)")
        raise Refused(" / ".join(failures))
    return each_model(pairs_of(args[1:]), run)


COMMANDS = {"llamacpp": llamacpp, "llamacpp-kv": llamacpp_kv,
            "convert": convert, "quantize": quantize, "vllm": vllm, "ortgenai": ortgenai,
            "transformers": transformers_}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(__doc__)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
