"""Fuzz campaign, part 4: what a user types (tests/fuzz/fuzz.py --input-cases N runs it; alone: this file).

    python tests/fuzz/fuzz_inputs.py [--cases 120] [--kinds options calib tokenizer ...] [--seed 0] [--timeout 120]

Each case is one `run.py quantize --model M` command (generate and eval for the kinds after tokenizer), in its own
process, on a small random model M (a dense Hugging Face folder with the byte tokenizer, a context of 256 tokens),
with one hostile input:
  options    one of a method's keywords (--option KEY=VALUE, or the flags --bits, --group-size, --order, --bpw)
             given a value from HOSTILE (zero, negative, 1e300, NaN, 2^63, JSON lists and objects, empty and long
             text, ...) or its default; or a key misspelled, unknown, or another method's; in 3 cases of 10 with a
             --target or --format too
  calib      --calib a file of CALIB_FILES (empty, one byte, random bytes, invalid UTF-8, NULs, a 2 GiB sparse file,
             a folder, a FIFO, /dev/zero, a dangling link, an unreadable file) or `self`, with --calib-samples and
             --calib-len from SIZES
  tokenizer  M's tokenizer.json with an added token of an id from TOKEN_IDS (the vocabulary size, 10^6, 2^31-1,
             -1, 2^63, "7", 1.5, null), an added-token list broken in another way, a charsmap the library cannot
             parse or a template naming a token it lacks (BROKEN_TOKENIZERS: the last two panic in Rust)
  prompt     `generate --prompt-file` a file of PROMPT_FILES (a 2 GiB sparse file, 16 MB of prose, text whose tail is
             not UTF-8, just under and at the context, ...) through the byte tokenizer or one that is not (a prefix
             space)
  normalizer M's tokenizer with a normalizer that replaces "a" by EXPANSIONS "a"s (2 to 100,000), then a prompt of
             3,000 "a"s to generate, or quantize calibrating on pydoc
  regex      M's tokenizer with a pre-tokenizer that splits on a BACKTRACKING regex ((a+)+$ ...), then a prompt, or a
             --calib file, of 3,000 "a"s and a "!"
  ctx        `eval --ctx` of CONTEXTS, beyond M's context of 256 and within it
  kvcache    generate's --kv-cache SPEC: a cache name of KV_NAMES with up to three options (its own, or of KV_KEYS),
             each given a value from HOSTILE or a plain one, in 1 case of 4 one key given twice; half with a
             --prefill-chunk from SIZES or 1 (a one-token-at-a-time read of the 180-token prompt)

Outcomes:
  refused        exit 1 with one `error:` line on stderr, the last (after what the run logs as it goes), or
                 argparse's usage and its error: line (exit 2); no traceback; before any of M's weights was read
  refused-late   the same, but after M's weights were read (a value checked only once the model is loaded)
  accepted       exit 0, and the checkpoint written loads with every weight finite (generate, eval: exit 0;
                 kvcache: the run reports its cache)
  broken         exit 0, but what was written does not load or holds non-finite weights (kvcache: or the SPEC
                 gives a key twice or exact_keys beyond M's context, which must be refused)
  traceback      anything else: a traceback, more lines, another exit code
  hang           no exit within the timeout
  memory         an allocation failure, or a run that did not exit 0 with its peak RSS over --memory-gib (1 by
                 default); an accepted run may use what its request needs
"""
import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.checkpoints.models import load_model  # noqa: E402
from engine.checkpoints.tokenizer import byte_tokenizer, export_tokenizer, load_tokenizer  # noqa: E402
from engine.formats.kv import kv_store  # noqa: E402
from engine.layers import QuantLinear  # noqa: E402
from engine.formats.quantized_checkpoints import method_options  # noqa: E402
from engine.loaders import save_dense  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config  # noqa: E402

KINDS = ("options", "calib", "tokenizer", "prompt", "normalizer", "regex", "ctx", "kvcache")
OUTCOMES = ("refused", "refused-late", "accepted", "broken", "traceback", "hang", "memory")
FAILURES = ("refused-late", "broken", "traceback", "hang", "memory")
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, max_position_embeddings=256)
# What makes each method's accepted runs cheap on M; a fuzzed keyword replaces its entry here.
CHEAP = {"rtn": {"group_size": "32"}, "gptq": {"group_size": "32"}, "awq": {"group_size": "32"},
         "fp8": {"block": "32"}, "mxfp4": {}, "nvfp4": {}, "nf4": {}, "bitsandbytes": {},
         "compressed-tensors": {"group_size": "32"}, "trellis": {"L": "6", "group": "64"},
         "entquant": {"lam": "14.5", "max_iter": "20"}, "lattice": {"tile": "64"}}
FLAGS = {"bits": "--bits", "group_size": "--group-size", "order": "--order", "bpw": "--bpw"}
HOSTILE = ("0", "-1", "1", "2", "3", "7", "9", "48", "65536", "1e300", "-1e300", "nan", "inf", "-inf", "1e-45",
           "5e-324", "1.5", "9223372036854775808", "18446744073709551616", "10" * 40, "", " ", "x", "true",
           "false", "null", "[]", "[1]", '["Q4_K"]', '{"a": 1}', '"Q4_K"', "Q4_K", "Q3_K", "E9", "bogus", "x" * 10_000,
           "\u00e9\u00e8", "\u0664", "1_000", "0x10")
OTHER_FLAGS = {"--target": ("vllm", "transformers", "llama.cpp", "onnx", "bogus", ""),
               "--format": ("safetensors", "gguf", "bogus")}
SIZES = ("0", "-1", "1", "2", "4", "255", "256", "257", "1000000000", "1e3", "nan", "", "x",
         "9223372036854775808")       # (a valid but large size would only make a long run: not what this looks for)
CALIB_FILES = ("empty", "one-byte", "random", "invalid-utf8", "nuls", "sparse-2g", "folder", "fifo", "dev-zero",
               "dangling", "unreadable", "prose", "self", "self+prose")
TOKEN_IDS = (256, 255, 1_000_000, 2 ** 31 - 1, 2 ** 31, -1, 2 ** 63, "7", 1.5, None)
BROKEN_TOKENIZERS = ("duplicate-id", "no-content", "not-a-list", "not-json", "empty-content", "huge-content",
                     "charsmap", "template")
PROMPT_FILES = ("sparse-2g", "prose-16m", "one-line-4m", "utf8-tail", "at-context", "under-context", "invalid-utf8",
                "empty")
EXPANSIONS = (2, 10, 100, 10_000, 100_000)
BACKTRACKING = ("(a+)+$", "(a|aa)+$", "(a*)*$", "(a+)+b", "(.*a){20}")
CONTEXTS = ("255", "256", "257", "512", "16384", "1000000000")
AAA = "a" * 3000 + "!"
KV_NAMES = ("e8:3", "d4:2.5", "z:4", "e8", "e9:3", "q4_0", "fp8", "fp8:head", "kivi:2", "kivi:3", "bf16", "")
KV_KEYS = ("window", "exact_keys", "seed", "rotation", "group", "key_order", "bogus")
KV_PLAIN = ("0", "4", "8", "32", "288", "none", "signs", "qjl")          # 288: beyond M's context
# Runs run.py with TensorReader.read (every read of a safetensors tensor) first touching $FUZZ_READ.
WATCH = """import os, runpy, sys
from engine import safetensors_io
real = safetensors_io.TensorReader.read
def read(self, name):
    open(os.environ["FUZZ_READ"], "a").close()
    return real(self, name)
safetensors_io.TensorReader.read = read
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# ---- cases ----------------------------------------------------------------------------------------------------------

def input_cases(n, kinds=KINDS, seed=0):
    """n cases, the kinds in turn, each a dict: kind, method, options {key: text}, flags [argv], calib, tokenizer."""
    rng = random.Random(seed)
    methods = sorted(CHEAP)
    cases = []
    for i in range(n):
        kind, method = kinds[i % len(kinds)], rng.choice(methods)
        case = dict(kind=kind, method=method, options=dict(CHEAP[method]), flags=[], calib=None, tokenizer=None,
                    seed=rng.randrange(1 << 30))
        if kind == "options":
            _fuzz_option(case, rng)
        elif kind == "calib":
            case["method"] = method = rng.choice(("gptq", "awq", "entquant"))
            case["options"] = dict(CHEAP[method], **({"feedback": "calibration"} if method == "entquant" else {}))
            case["calib"] = rng.choice(CALIB_FILES)
            for flag in ("--calib-samples", "--calib-len"):
                case["flags"] += [flag, rng.choice(SIZES) if rng.random() < 0.5 else {"--calib-samples": "4",
                                                                                    "--calib-len": "32"}[flag]]
        elif kind == "tokenizer":
            case["tokenizer"] = rng.choice([*TOKEN_IDS, *BROKEN_TOKENIZERS])
        else:
            _fuzz_kv_cache(case, rng) if kind == "kvcache" else _fuzz_text(case, rng)
        cases.append(case)
    return cases


def _fuzz_text(case, rng):
    """A case of the kinds that read text: generate's prompt, a tokenizer that multiplies or backtracks, eval --ctx."""
    kind = case["kind"]
    case["command"] = "eval" if kind == "ctx" else "generate" if kind == "prompt" else rng.choice(
        ("generate", "quantize"))
    if case["command"] == "quantize":
        case["method"], case["options"] = "gptq", dict(CHEAP["gptq"])
    if kind == "prompt":
        case["prompt"], case["tokenizer"] = rng.choice(PROMPT_FILES), rng.choice(("bytes", "prefix-space"))
    elif kind == "normalizer":
        case["tokenizer"] = ("expand", rng.choice(EXPANSIONS))
    elif kind == "regex":
        case["tokenizer"] = ("split", rng.choice(BACKTRACKING))
    else:
        case["flags"] = ["--ctx", rng.choice(CONTEXTS), "--chunks", "1"]


def _fuzz_option(case, rng):
    method, options = case["method"], case["options"]
    keys = list(method_options(method))
    roll = rng.random()
    if roll < 0.15:                                   # a key misspelled, unknown, or another method's
        key = rng.choice(keys or ["bits"])
        other = rng.choice([k for m in CHEAP for k in method_options(m)])
        options[rng.choice((key.replace("_", "-"), key.upper(), key + "s", "bogus", other))] = rng.choice(HOSTILE)
    elif keys:
        key = rng.choice(keys)
        default = method_options(method)[key].default
        options.pop(key, None)
        value = rng.choice(HOSTILE) if rng.random() < 0.85 or default is None else json.dumps(default)
        if key in FLAGS and rng.random() < 0.5:
            case["flags"] += [FLAGS[key], value]
        else:
            options[key] = value
    if rng.random() < 0.3:                            # with a target: the combinations it refuses
        flag = rng.choice(list(OTHER_FLAGS))
        case["flags"] += [flag, rng.choice(OTHER_FLAGS[flag])]


def _fuzz_kv_cache(case, rng):
    name = rng.choice(KV_NAMES)
    kind = kv_store.NAMES.get(name.partition(":")[0])
    keys = list(kv_store.OPTIONS[kind]) if kind and rng.random() < 0.8 else list(KV_KEYS)     # mostly its own
    items = [f"{key}={rng.choice(HOSTILE if rng.random() < 0.5 else KV_PLAIN)}"
             for key in rng.sample(keys, min(len(keys), rng.randint(0, 3)))]
    if items and rng.random() < 0.25:                 # one key twice
        items.append(items[0].partition("=")[0] + "=" + rng.choice(KV_PLAIN))
    case["kv_cache"] = ",".join([name, *items])
    if rng.random() < 0.5:
        case["flags"] += ["--prefill-chunk", rng.choice(("1", *SIZES))]


def argv(case, model, out, calib_file, prompt_file=None):
    if case["kind"] == "kvcache":
        return ["generate", "--model", str(model), "--prompt-file", str(prompt_file), "--max-new-tokens", "2",
                "--kv-cache", case["kv_cache"], *case["flags"]]
    if case.get("command") == "generate":
        return ["generate", "--model", str(model), "--prompt-file", str(prompt_file), "--max-new-tokens", "2"]
    if case.get("command") == "eval":
        return ["eval", "--model", str(model), "--quantized", str(model), *case["flags"]]
    if case["kind"] == "regex":
        return ["quantize", "--model", str(model), "--method", "gptq", "--out", str(out), "--calib", str(prompt_file),
                "--calib-samples", "1", "--calib-len", "32"]
    if {"llama.cpp", "gguf"} & set(case["flags"]):
        out = out.with_suffix(".gguf")
    args = ["quantize", "--model", str(model), "--method", case["method"], "--out", str(out)]
    for key, value in case["options"].items():
        args += ["--option", f"{key}={value}"]
    if case["calib"] is not None:
        args += ["--calib", *calib_file]
    elif case["method"] in ("gptq", "awq"):
        args += ["--calib", "pydoc", "--calib-samples", "4", "--calib-len", "32"]
    return args + case["flags"]


# ---- inputs on disk -------------------------------------------------------------------------------------------------

def make_model(folder, seed=0):
    """M: a small random Qwen3 with the byte tokenizer, as a dense Hugging Face folder."""
    torch.manual_seed(seed)
    save_dense(Qwen3(Qwen3Config(**CONFIG)).eval(), folder)
    export_tokenizer(None, folder)
    return folder


def calib_source(name, where, rng):
    """The --calib argument(s) of CALIB_FILES' `name`, made under `where`."""
    if name == "self":
        return ["self"]
    path = where / "calib.txt"
    prose = ("The quick brown fox jumps over the lazy dog. " * 200).encode()
    if name == "self+prose":
        path.write_bytes(prose)
        return ["self", str(path)]
    if name in ("empty", "one-byte", "random", "invalid-utf8", "nuls", "prose", "unreadable"):
        path.write_bytes({"empty": b"", "one-byte": b"a", "random": rng.randbytes(100_000),
                          "invalid-utf8": b"\xff\xfe\xc3(" * 10_000, "nuls": b"\0" * 1_000_000}.get(name, prose))
        if name == "unreadable":
            path.chmod(0)
    elif name == "sparse-2g":
        with open(path, "wb") as f:
            f.truncate(2 << 30)
    elif name == "folder":
        path.mkdir()
    elif name == "fifo":
        os.mkfifo(path)
    elif name == "dev-zero":
        path.symlink_to("/dev/zero")
    elif name == "dangling":
        path.symlink_to(where / "missing")
    return [str(path)]


def prompt_source(name, where):
    """The --prompt-file of PROMPT_FILES' `name` (M's context: 256 tokens), made under `where`."""
    path = where / "prompt.txt"
    prose = b"The quick brown fox jumps over the lazy dog. "
    if name == "sparse-2g":
        with open(path, "wb") as f:
            f.truncate(2 << 30)                       # NULs: valid UTF-8
    else:
        path.write_bytes({"prose-16m": prose * ((16 << 20) // len(prose)), "one-line-4m": b"x" * (4 << 20),
                          "utf8-tail": prose * 20_000 + b"\xff" * 1000, "at-context": b"x" * 256,
                          "under-context": b"x" * 200, "invalid-utf8": b"\xff\xfe" * 100, "empty": b""}[name])
    return path


def text_tokenizer(folder, how):
    """M's tokenizer.json changed as the text kinds need: "bytes" (unchanged), "prefix-space" (a space put before
    the text: no longer the byte tokenizer, so read as UTF-8 text, piece by piece), ("expand", n): a normalizer
    that replaces "a" by n "a"s, ("split", pattern): a pre-tokenizer that first splits on the regex pattern."""
    spec = json.loads(byte_tokenizer().to_str())
    if how == "prefix-space":
        spec["pre_tokenizer"]["add_prefix_space"] = True
    elif how[0] == "expand":
        spec["normalizer"] = {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * how[1]}
    elif how[0] == "split":
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": how[1]}, "behavior": "Isolated", "invert": False},
            spec["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def break_tokenizer(folder, how):
    """M's tokenizer.json with an added token "<|fuzz|>" of id `how` (TOKEN_IDS) or broken as BROKEN_TOKENIZERS."""
    path = folder / "tokenizer.json"
    spec = json.loads(byte_tokenizer().to_str())
    token = {"id": 256, "content": "<|fuzz|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
    if how in BROKEN_TOKENIZERS:
        spec["added_tokens"] = {"duplicate-id": [token, {**token, "content": "<|fuzz2|>"}],
                                "no-content": [{k: v for k, v in token.items() if k != "content"}],
                                "not-a-list": {"a": token}, "empty-content": [{**token, "content": ""}],
                                "huge-content": [{**token, "content": "x" * 1_000_000}]}.get(how, [])
        if how == "charsmap":
            spec["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAA"}
        if how == "template":
            spec["post_processor"] = {"type": "TemplateProcessing", "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [], "special_tokens": {}}
        path.write_text("{not json" if how == "not-json" else json.dumps(spec))
    else:
        spec["added_tokens"] = [{**token, "id": how}]
        path.write_text(json.dumps(spec))


# ---- running one case -----------------------------------------------------------------------------------------------

def weights_finite(model):
    decoded = [m.dequantize() for m in model.modules() if isinstance(m, QuantLinear)]
    return all(bool(torch.isfinite(t).all()) for t in [*model.parameters(), *decoded])


def run_case(case, model, scratch, timeout=120.0, memory_gib=1.0):
    """(outcome, detail, seconds, peak RSS in bytes) of one case, run in `scratch` (emptied first)."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    source = model
    if case["kind"] in ("tokenizer", "prompt", "normalizer", "regex"):
        source = scratch / "model"
        shutil.copytree(model, source)
        (break_tokenizer if case["kind"] == "tokenizer" else text_tokenizer)(source, case["tokenizer"])
    calib = calib_source(case["calib"], scratch, random.Random(case["seed"])) if case["calib"] else None
    prompt = prompt_source(case["prompt"], scratch) if case["kind"] == "prompt" else scratch / "prompt.txt"
    if case["kind"] in ("normalizer", "regex"):
        prompt.write_text(AAA)
    if case["kind"] == "kvcache":
        prompt.write_text("The quick brown fox jumps over the lazy dog. " * 4)     # 180 tokens
    out, marker = scratch / "out", scratch / "read"
    env = dict(os.environ, FUZZ_READ=str(marker), PYTHONPATH=str(ROOT), TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    limit = int(4 * memory_gib * (1 << 30)) + (3 << 30)     # address space: torch maps far more than it touches

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", WATCH, str(ROOT / "run.py"),
                                *argv(case, source, out, calib, prompt)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=scratch,
                               preexec_fn=cap)
    stderr = []
    reader = threading.Thread(target=lambda: stderr.append(process.stderr.read()))
    reader.start()
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    _, status, usage = os.wait4(process.pid, 0)
    timer.cancel()
    reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds, peak = time.perf_counter() - start, usage.ru_maxrss * 1024
    text = stderr[0].decode(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    detail = lines[-1][:300] if lines else f"exit {process.returncode}"
    if seconds >= timeout and process.returncode < 0:
        return "hang", f"no exit in {timeout:.0f} s", seconds, peak
    if "can't allocate memory" in text or "MemoryError" in text:
        return "memory", detail, seconds, peak
    if process.returncode == 0:
        accepted = _kv_accepted(case, text) if case["kind"] == "kvcache" else "accepted" if case.get(
            "command") in ("generate", "eval") else _accepted(out, case)
        return accepted, detail, seconds, peak
    if peak > memory_gib * (1 << 30):                     # what a refusal or a failure may cost
        return "memory", f"peak RSS {peak / 2 ** 30:.2f} GiB; {detail}", seconds, peak
    usage_error = process.returncode == 2 and lines and lines[0].startswith("usage:") and "error:" in lines[-1]
    one_line = process.returncode == 1 and lines and lines[-1].startswith("error:") and sum(
        line.startswith("error:") for line in lines) == 1          # after the lines a run logs as it goes
    if "Traceback" in text or not (one_line or usage_error):
        return "traceback", " | ".join(lines[-3:])[:300] or detail, seconds, peak
    return ("refused-late" if marker.exists() else "refused"), detail, seconds, peak


def _accepted(out, case):
    """A checkpoint that loads with finite weights and, when written from a mutated tokenizer, with a tokenizer
    whose every token id is one the model has."""
    target = out if out.is_dir() else next(iter(out.parent.glob("out*.gguf")), out)
    try:
        model = load_model(target)
        ids = load_tokenizer(target).get_vocab().values() if case["kind"] == "tokenizer" else [0]
    except ValueError:
        return "broken"
    return "accepted" if weights_finite(model) and max(ids) < model.cfg.vocab_size else "broken"


def _kv_accepted(case, stderr):
    """A generate run that reports its cache, for a SPEC that gives no key twice and no exact_keys beyond M's
    context (the value it cannot mean)."""
    items = [item.partition("=") for item in case["kv_cache"].split(",")[1:]]
    keys = [key for key, _, _ in items]
    beyond = any(key == "exact_keys" and _number(value) > CONFIG["max_position_embeddings"] for key, _, value in items)
    reported = f"KV cache {case['kv_cache']}: " in stderr
    return "accepted" if reported and len(set(keys)) == len(keys) and not beyond else "broken"


def _number(text):
    """int(text) as the SPEC parser reads it; -1 for what it does not read as an integer."""
    try:
        return int(text)
    except ValueError:
        return -1


def campaign(root, n, kinds=KINDS, seed=0, timeout=120.0, memory_gib=1.0, workers=2, progress=None):
    """M made under root, then n cases through `workers` processes at a time -> [(case, outcome, detail, s, peak)]."""
    root = Path(root)
    model = make_model(root / "M", seed)
    cases = input_cases(n, kinds, seed)
    results, lock, todo = [None] * n, threading.Lock(), list(range(n))[::-1]

    def serve(slot):
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            results[i] = (cases[i], *run_case(cases[i], model, root / f"slot{slot}", timeout, memory_gib))
            if progress:
                progress(results[i])

    threads = [threading.Thread(target=serve, args=(s,)) for s in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def describe(case):
    what = {"options": " ".join([*(f"{k}={v[:40]!r}" for k, v in case["options"].items()), *case["flags"]]),
            "calib": f"--calib {case['calib']} {' '.join(case['flags'])}",
            "tokenizer": f"added token {case['tokenizer']!r}", "prompt": f"--prompt-file {case.get('prompt')}",
            "normalizer": "", "regex": "", "ctx": " ".join(case["flags"]),
            "kvcache": f"--kv-cache {case.get('kv_cache', '')[:80]!r} {' '.join(case['flags'])}"}[case["kind"]]
    if case["kind"] in ("prompt", "normalizer", "regex"):
        what += f" tokenizer {case['tokenizer']!r}"
    if case["kind"] == "kvcache":
        return f"{case['kind']} {what}"
    if case.get("command") in ("generate", "eval"):
        return f"{case['kind']} {case['command']} {what}"
    return f"{case['kind']} {case['method']} {what}"


def report(results):
    lines = []
    for kind in KINDS:
        mine = [r for r in results if r[0]["kind"] == kind]
        if mine:
            counts = Counter(r[1] for r in mine)
            slowest = max(r[3] for r in mine if r[1] in ("refused", "refused-late")) if any(
                r[1] in ("refused", "refused-late") for r in mine) else 0
            lines.append(f"{kind:10s} {len(mine):4d} cases: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES
                                                                         if counts[o]) +
                         f"; slowest refusal {slowest:.1f} s; peak RSS {max(r[4] for r in mine) / 2 ** 30:.2f} GiB")
    failures = [r for r in results if r[1] in FAILURES]
    lines += [f"  {r[1]:12s} {describe(r[0])}: {r[2]}" for r in failures[:40]]
    return "\n".join(lines)


def main(argv_=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=120)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--memory-gib", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv_)
    with tempfile.TemporaryDirectory(prefix="fuzz-inputs-") as root:
        done = []

        def progress(result):
            done.append(result)
            print(f"[{len(done)}/{args.cases}] {result[1]:12s} {result[3]:5.1f} s  {describe(result[0])[:110]}",
                  file=sys.stderr)

        results = campaign(root, args.cases, tuple(args.kinds), args.seed, args.timeout, args.memory_gib,
                           args.workers, progress)
    print(report(results))
    return 1 if any(r[1] in FAILURES for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
