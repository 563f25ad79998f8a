"""The peers of benchmarks/frontier.py: each tool in its own cached virtual environment, run on the reference's files,
its output read back as dequantized float32 weights of the decoder linears and the bits its file spends on them.

    tool           venv (~/.cache/engine/clients/<name>/venv)   runs                       output read as
    llama.cpp      llamacpp (benchmarks/clients.py builds it)    client_runners.py quantize GGUF: gguf-py's dequantize
    HQQ            hqq                                           peers/run_hqq.py           safetensors of W_hat + bits
    bitsandbytes   bnb                                           peers/run_bnb.py           safetensors of W_hat + bits
    AutoRound      autoround                                     peers/run_autoround.py     GPTQ folder / GGUF
    GPTQModel      ~/.cache/engine/peers/venv (layerwise.py)     peers/run_gptqmodel.py     GPTQ v1 folder
    llm-compressor ~/.cache/engine/peers/venv                    peers/run_llmcompressor.py compressed-tensors folder

Bits per weight, the same rule for every row: every byte a file stores for the decoder linears (codes, scales, mins,
zero points, and any index such as GPTQ's g_idx) over their weight count; embeddings, norms and lm_head excluded.
GGUF: each linear's GGML type (bytes per block / weights per block: Q4_K 144 / 256 = 4.5 bits); safetensors: the
bytes of the tensors under each linear's name; HQQ / bitsandbytes: the bytes of the packed codes and metadata tensors
their quantizers return. A GGUF tensor is dequantized by the `gguf` package (llama.cpp's own gguf-py), llama's q/k
rows unpermuted; a GPTQ or compressed-tensors folder by the engine's loaders (checked bit for bit against GPTQModel
and compressed-tensors by tests/test_interop_*).
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.checkpoints.gguf import LINEARS, hf_config, hf_name, unpermute_rows
from engine.checkpoints.gguf_file import GGUFFile
from engine.loaders import read_config
from engine.checkpoints.models import load_model
from engine.safetensors_io import DTYPE_BYTES, snapshot_tensors, tensor_specs
from engine.formats import gptq
from engine.layers import quantized_linears
from engine.formats.llama_cpp.ggml import GGML_TYPES

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import clients  # noqa: E402
import layerwise  # noqa: E402

TORCH_WHEEL = clients.TORCH_WHEEL
PIN = "-c <(echo torch==2.13.0)"
INSTALL = {   # run in ~/.cache/engine/clients/<name>; the llama.cpp build is clients.INSTALL["llamacpp"]
    "hqq": f"python3.11 -m venv venv && venv/bin/pip install {TORCH_WHEEL} && venv/bin/pip install hqq==0.2.8 {PIN}",
    "bnb": f"python3.11 -m venv venv && venv/bin/pip install {TORCH_WHEEL} && "
           f"venv/bin/pip install bitsandbytes==0.50.2 safetensors {PIN}",
    "autoround": f"python3.11 -m venv venv && venv/bin/pip install {TORCH_WHEEL} && "
                 f"venv/bin/pip install auto-round==0.16.1 transformers==4.57.6 gguf sentencepiece {PIN}",
}
IMPORTS = {"hqq": "import hqq.core.quantize", "bnb": "import bitsandbytes", "autoround": "import auto_round",
           "llamacpp": clients.LLAMA_IMPORT, "peers": "import gptqmodel, llmcompressor"}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def venv_python(name, install=True):
    """(python, None) of a peer's venv, installing it on first use; (None, why) when it cannot be had."""
    if name == "llamacpp":          # a venv that exists but does not import is never rebuilt over (a build running)
        if not (clients.CACHE / "llamacpp" / "venv" / "bin" / "python").exists():
            return clients.client_python("llamacpp", install)
        python = clients.CACHE / "llamacpp" / "venv" / "bin" / "python"
    elif name == "peers":
        python = layerwise.PEERS_VENV / "bin" / "python"
        if not python.exists() and not install:
            return None, f"not installed ({layerwise.PEERS_VENV}; run without --no-install)"
        try:
            python = layerwise.peers_python()
        except subprocess.CalledProcessError as e:
            return None, f"install failed: {e}"
    else:
        home = clients.CACHE / name
        python = home / "venv" / "bin" / "python"
        if not python.exists():
            if not install:
                return None, f"not installed ({home}; run without --no-install)"
            home.mkdir(parents=True, exist_ok=True)
            log(f"installing {name} into {home}")
            if subprocess.run(["bash", "-euo", "pipefail", "-c", INSTALL[name]], cwd=home).returncode:
                return None, f"install failed (commands: frontier_peers.INSTALL[{name!r}])"
    probe = subprocess.run([str(python), "-c", IMPORTS[name]], capture_output=True, text=True)
    if probe.returncode:
        return None, f"`{IMPORTS[name]}` fails in {python}: {(probe.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return python, None


def run(python, script, *args, env=None, cwd=None):
    """Run a runner script in a peer's venv (in cwd: GPTQModel writes a logs/ folder there); the last line of its
    traceback is the reason when it fails."""
    t0 = time.perf_counter()
    done = subprocess.run([str(python), str(script), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd)
    if done.returncode:
        lines = ([s.strip() for s in (done.stdout + done.stderr).splitlines() if s.strip()]
                 or [f"exit {done.returncode}"])
        errors = [s for s in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", s)]    # a traceback's last line
        raise RuntimeError(f"{Path(script).name} failed: {(errors or lines)[-1][:300]}")
    return time.perf_counter() - t0


# ---- reading what a peer wrote ----------------------------------------------------------------------------------

def gguf_linears(path):
    """A GGUF file -> ({HF module name: W_hat float32 [out, in]}, {module: bits}, {GGML type: weights}); dequantized
    by gguf-py (llama.cpp's package), llama q/k rows back in HF's order."""
    import gguf
    weights, bits, types = {}, {}, {}
    with GGUFFile(path) as f:
        cfg = hf_config(f)
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        for info in f.tensors.values():
            name, kind = hf_name(info.name)
            if kind not in LINEARS or not name.endswith(".weight"):
                continue
            out_f, in_f = info.shape
            _, block, size = GGML_TYPES[info.type_name]
            raw = f.raw(info.name).numpy().reshape(out_f, -1)
            w = torch.from_numpy(np.ascontiguousarray(
                gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[info.type_name]), dtype=np.float32))
            if cfg["model_type"] == "llama" and kind in heads:
                w = unpermute_rows(w, heads[kind])
            module = name.removesuffix(".weight")
            weights[module], bits[module] = w.reshape(out_f, in_f), out_f * in_f * 8 * size / block
            types[info.type_name] = types.get(info.type_name, 0) + out_f * in_f
    return weights, bits, types


def folder_linears(path):
    """A quantized HF folder (GPTQ, compressed-tensors) -> ({module: W_hat}, {module: bits of its tensors}). GPTQ
    folders are unpacked by the engine's unpack_gptq / dequantize_gptq directly, without its loader's checks:
    AutoRound's symmetric export stores negative scales (W = s (q - z) holds for either sign; the engine's loader
    refuses them)."""
    config = read_config(path)["quantization_config"]
    if config["quant_method"] == "gptq":
        tensors = snapshot_tensors(path, verify=False)
        parts = {}
        for name, value in tensors:
            module, _, kind = name.rpartition(".")
            parts.setdefault(module, {})[kind] = value
        fmt = config.get("checkpoint_format", "gptq")
        weights = {m: gptq.dequantize_gptq(*gptq.unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"],
                                                                bits=config["bits"], checkpoint_format=fmt))
                   for m, p in parts.items() if "qweight" in p}
    else:
        model = load_model(path)
        weights = {name: layer.dequantize().float() for name, layer in quantized_linears(model).items()}
    bits = {name: 0 for name in weights}
    for tensor, (dtype, shape) in tensor_specs(path).items():
        module = tensor.rpartition(".")[0]
        if module in bits:
            bits[module] += 8 * DTYPE_BYTES[dtype] * int(np.prod(shape))
    return weights, bits


def dequantized_file(path):
    """What run_hqq.py / run_bnb.py write: a safetensors of W_hat per module, bits per module in its metadata."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        bits = json.loads(f.metadata()["bits"])
        return {name: f.get_tensor(name) for name in f.keys()}, bits


# ---- the peers' rows --------------------------------------------------------------------------------------------

LLAMA_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_1", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_XS", "Q3_K_M",
               "Q3_K_S", "Q2_K")
IMATRIX_TYPES = ("Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "IQ4_XS", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XXS",
                 "Q2_K", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS")
HQQ = ((4, 128), (4, 64), (3, 128), (3, 64), (2, 32), (2, 16))
BNB = (("nf4", 64, False), ("nf4", 64, True), ("fp4", 64, False))
AUTOROUND = (("gptq", 4, 128), ("gguf:q4_k_m", 4, 32), ("gguf:q2_k_s", 2, 16))


def peer_rows():
    """[(tool, label, venv, produce)], produce(ctx) -> ({module: W_hat}, {module: bits}, how the bits were counted,
    the file or folder a user would download, or None where the tool's export is not its own file (HQQ's and
    bitsandbytes' tensors are saved here by our runner))."""
    rows = []
    for kind in LLAMA_TYPES:
        rows.append(("llama.cpp", kind, "llamacpp", lambda c, k=kind: llama(c, k, False)))
    for kind in IMATRIX_TYPES:
        rows.append(("llama.cpp", f"{kind} + imatrix", "llamacpp", lambda c, k=kind: llama(c, k, True)))
    for bits, group in HQQ:
        rows.append(("HQQ", f"int{bits} g{group}", "hqq", lambda c, b=bits, g=group: hqq(c, b, g)))
    for kind, group, double in BNB:
        rows.append(("bitsandbytes", f"{kind.upper()} g{group}{' double-quant' if double else ''}", "bnb",
                     lambda c, k=kind, g=group, d=double: bnb(c, k, g, d)))
    rows.append(("GPTQModel", "GPTQ int4 g128 (sym, its defaults)", "peers", lambda c: gptqmodel(c)))
    rows.append(("llm-compressor", "GPTQ W4A16 g128 (sym)", "peers", lambda c: llmcompressor(c)))
    for fmt, bits, group in AUTOROUND:
        label = f"int{bits} g{group} sym -> GPTQ" if fmt == "gptq" else fmt.split(":")[1].upper()
        rows.append(("AutoRound", label, "autoround", lambda c, f=fmt, b=bits, g=group: autoround(c, f, b, g)))
    return rows


def llama(c, kind, imatrix):
    """llama-quantize's file, whole: the embedding at the type it gives it (its size is the size users download)."""
    out = c.files / f"llama-{kind}{'-imatrix' if imatrix else ''}.gguf"
    if not out.exists():
        extra = ["--imatrix", c.imatrix()] if imatrix else []
        run(c.python, clients.RUNNERS, "quantize", c.folder / "reference.gguf", out, kind, "--own-embedding", *extra)
    weights, bits, types = gguf_linears(out)
    total = sum(types.values())
    mix = ", ".join(f"{t} {100 * n / total:.0f}%" for t, n in sorted(types.items(), key=lambda x: -x[1]))
    return weights, bits, f"GGUF types: {mix}", out


def hqq(c, bits, group):
    out = c.files / f"hqq-int{bits}-g{group}.safetensors"
    if not out.exists():
        run(c.python, HERE / "peers" / "run_hqq.py", c.folder / "reference", out, bits, group)
    return *dequantized_file(out), "bytes of W_q (packed) + f16 scale, zero", None


def bnb(c, kind, group, double):
    out = c.files / f"bnb-{kind}-g{group}{'-dq' if double else ''}.safetensors"
    if not out.exists():
        run(c.python, HERE / "peers" / "run_bnb.py", c.folder / "reference", out, kind, group, int(double))
    return *dequantized_file(out), "bytes of the codes + QuantState.as_dict", None


def gptqmodel(c):
    out = c.files / "gptqmodel-gptq"
    if not (out / "config.json").exists():
        run(c.python, HERE / "peers" / "run_gptqmodel.py", "gptq", c.folder / "reference", out,
            c.folder / "calibration.pt", env={"GPTQMODEL_CPU_WORKERS": "2"}, cwd=c.files)
    return *folder_linears(out), "bytes of qweight, qzeros, scales, g_idx", out


def llmcompressor(c):
    out = c.files / "llmcompressor-gptq"
    if not (out / "config.json").exists():
        run(c.python, HERE / "peers" / "run_llmcompressor.py", "gptq", c.folder / "reference", out,
            c.folder / "calibration.pt")
    return *folder_linears(out), "bytes of weight_packed, weight_scale, weight_shape", out


def autoround(c, fmt, bits, group):
    out = c.files / f"autoround-{fmt.replace(':', '-')}-int{bits}-g{group}-iters{c.settings['autoround_iters']}"
    done = out / "done.json"
    if not done.exists():
        run(c.python, HERE / "peers" / "run_autoround.py", c.folder / "reference", out, c.folder / "calibration.pt",
            fmt, bits, group, c.settings["autoround_iters"])
    path = Path(json.loads(done.read_text())["path"])
    if path.suffix == ".gguf":
        weights, bits_, types = gguf_linears(path)
        return weights, bits_, f"GGUF types: {', '.join(sorted(types))}", path
    return *folder_linears(path), "bytes of qweight, qzeros, scales, g_idx", path
