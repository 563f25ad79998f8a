"""Fuzz campaign, part 1: the pristine checkpoints and their mutations (tests/fuzz/fuzz.py runs them).

From one small random Qwen3: one checkpoint per method (gptq, gptq act-order, awq, fp8, the four compressed-tensors
formats, trellis, entquant, lattice), a dense one, a sharded dense one (three shards and model.safetensors.index.json)
and two GGUF files, written by gguf-py and by the engine (Q8_0 linears both); and from one small random Qwen2-MoE
(routed experts and a shared expert), a dense checkpoint and the engine's `qwen2moe` GGUF file (Q8_0, stacked
experts). Each safetensors checkpoint exists
twice: as the engine wrote it ("engine": a SHA-256 per tensor, the quantization_config's digest) and re-saved without
the engine's metadata ("foreign", as another tool would write it), so that the checks that do not rely on digests
are reached too.

A case is a dict chosen in the parent (`checkpoint_cases`: every target in turn, every category of mutation in turn)
and applied to a copy in a worker (`mutate_checkpoint`): config.json and quantization_config fields (deleted, of
every wrong type, 0, -1, 1e300, 10^9, 2^63, NaN, Infinity, long strings, or scaled by 10), whole files (deep nesting,
truncation, non-UTF-8, empty, huge), special files (a folder, a FIFO, links to /dev/zero, outside the folder,
dangling; a missing shard, index entries naming "../x"), tensors (dropped, stray, other shapes and dtypes, NaN / Inf
/ huge / negative values), safetensors headers (length, JSON, offsets, overlaps, metadata), raw bit and byte flips;
for a GGUF file the engine wrote (a SHA-256 per tensor recorded), a tensor's type, offset or dimensions changed in
its table entry, and the same flips.
"""
import contextlib
import copy
import io
import json
import math
import os
import random
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.formats.llama_cpp import gguf, gguf_file, gguf_writer  # noqa: E402
from engine.loaders import dense_tensors, load_dense, save_dense  # noqa: E402
from engine.formats.quantized_checkpoints import load_quantized, save_quantized  # noqa: E402
from engine.safetensors_io import INDEX, read_header, save_file, write_json  # noqa: E402
from engine.formats.numerics import affine  # noqa: E402
from engine.formats.llama_cpp import ggml  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config, Qwen3MoeConfig  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_hidden_layers=2)
MOE = dict(TINY, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=64, norm_topk_prob=False)
QUANTIZED = {"gptq": ("gptq", {"group_size": 32}), "gptq-act": ("gptq", {"group_size": 32, "order": "act_order"}),
             "awq": ("awq", {"group_size": 32}), "fp8": ("fp8", {}),
             "ct-pack": ("compressed-tensors", {"format": "pack-quantized", "group_size": 32, "symmetric": False}),
             "ct-float": ("compressed-tensors", {"format": "float-quantized"}),
             "ct-nvfp4": ("compressed-tensors", {"format": "nvfp4-pack-quantized"}),
             "ct-mxfp4": ("compressed-tensors", {"format": "mxfp4-pack-quantized"}),
             "trellis": ("trellis", {"group": 64}), "entquant": ("entquant", {"lam": 14.5, "max_iter": 30}),
             "lattice": ("lattice", {"bps": 3.0, "tile": 64})}
SAFETENSORS_TARGETS = ("dense", "dense-sharded", *QUANTIZED, "dense-moe")
GGUF_TARGETS = ("gguf", "gguf-engine", "gguf-engine-moe")   # written by gguf-py (no digests), by the engine (digests)
TARGETS = (*SAFETENSORS_TARGETS, *GGUF_TARGETS)
DELETE = object()
WRONG_VALUES = {"delete": DELETE, "string": "fuzz", "true": True, "false": False, "float": 1.5, "list": [1, 2],
                "dict": {"a": 1}, "null": None, "zero": 0, "minus-one": -1, "1e300": 1e300, "1e9": 10 ** 9,
                "2^63": 2 ** 63, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "long-string": "x" * 100_000}
IDS = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1234))
GGUF_KEYS = {"block_count": ("UINT32", "num_hidden_layers"), "context_length": ("UINT32", "max_position_embeddings"),
             "embedding_length": ("UINT32", "hidden_size"), "feed_forward_length": ("UINT32", "intermediate_size"),
             "attention.head_count": ("UINT32", "num_attention_heads"),
             "attention.head_count_kv": ("UINT32", "num_key_value_heads"),
             "attention.key_length": ("UINT32", "head_dim"), "attention.value_length": ("UINT32", "head_dim"),
             "rope.freq_base": ("FLOAT32", "rope_theta"),
             "attention.layer_norm_rms_epsilon": ("FLOAT32", "rms_norm_eps"),
             "vocab_size": ("UINT32", "vocab_size")}          # qwen3.KEY: (GGUF type, Qwen3Config field)


# ---- the pristine checkpoints -------------------------------------------------------------------------------------

def pristine(root, target, flavor="engine"):
    """The folder of a pristine checkpoint (for gguf: the folder holding model.gguf)."""
    return Path(root) / "pristine" / target / ("file" if target in GGUF_TARGETS else flavor)


def safetensors_files(directory):
    return sorted(p.name for p in Path(directory).iterdir() if p.suffix == ".safetensors")


def write_sharded(model, directory, shards=3):
    """A dense checkpoint in `shards` files plus model.safetensors.index.json, as transformers writes it."""
    directory.mkdir(parents=True)
    write_json(directory / "config.json", model.cfg.to_hf())
    tensors = dense_tensors(model)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def make_foreign(engine_dir, foreign_dir):
    """The same checkpoint without the engine's metadata (no digests, no writer): what another tool would write."""
    shutil.copytree(engine_dir, foreign_dir)
    for name in safetensors_files(foreign_dir):
        path = foreign_dir / name
        tensors = safetensors.torch.load_file(str(path))
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})


def write_gguf(path, model, metadata=None, tensors=None):
    """model -> a GGUF file by gguf-py's writer (linears Q8_0, the rest F32). metadata {key: (kind, value) or
    DELETE} and tensors {gguf name: (numpy array, GGML type name of raw blocks, or None: the array's own dtype) or
    DELETE} override what is written."""
    import gguf as gg
    cfg, writer = model.cfg, gg.GGUFWriter(str(path), "qwen3")
    keys = {f"qwen3.{key}": (kind, getattr(cfg, field)) for key, (kind, field) in GGUF_KEYS.items()}
    keys.update(metadata or {})
    for key, entry in keys.items():
        if entry is not DELETE:
            kind, value = entry
            sub = gg.GGUFValueType.INT32 if kind == "ARRAY" else None
            writer.add_key_value(key, value, gg.GGUFValueType[kind], sub)
    names = {v: k for k, v in gguf.TENSOR_NAMES.items()}
    stored = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        module, _, suffix = name.rpartition(".")
        parts = module.split(".")
        if parts[1] == "layers":
            kind = names[".".join(parts[3:])]
            key = f"blk.{parts[2]}.{kind}.{suffix}"
        else:
            kind = {v: k for k, v in gguf.GLOBAL_NAMES.items()}[module]
            key = f"{kind}.{suffix}"
        w = p.detach().float().numpy()
        stored[key] = (gg.quants.quantize(w, gg.GGMLQuantizationType.Q8_0), "Q8_0") if kind in gguf.LINEARS \
            else (w, None)
    stored.update(tensors or {})
    for key, entry in stored.items():
        if entry is not DELETE:
            raw, type_name = entry
            writer.add_tensor(key, raw, raw_dtype=type_name and gg.GGMLQuantizationType[type_name])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def build(root, seed=0):
    """Write every pristine checkpoint under root/pristine; check that each loads, both flavors alike."""
    root = Path(root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                              # the same bytes whatever the machine
    try:
        _build(root, seed)
    finally:
        torch.set_num_threads(threads)


def _build(root, seed):
    torch.manual_seed(seed)
    base = Qwen3(Qwen3Config(**TINY)).eval()
    calibration = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))
    save_dense(base, pristine(root, "dense"))
    write_sharded(base, pristine(root, "dense-sharded"))
    with torch.random.fork_rng():                         # (the other checkpoints' bytes as they were)
        torch.manual_seed(seed + 1)
        moe = Qwen3(Qwen3MoeConfig(**MOE)).eval()
    save_dense(moe, pristine(root, "dense-moe"))
    with contextlib.redirect_stderr(io.StringIO()):
        for target, (method, options) in QUANTIZED.items():
            save_quantized(copy.deepcopy(base), pristine(root, target), method, calibration, **options)
    for target in SAFETENSORS_TARGETS:
        make_foreign(pristine(root, target), pristine(root, target, "foreign"))
        for flavor in ("engine", "foreign"):              # safetensors writes its header's keys in a random order
            for name in safetensors_files(pristine(root, target, flavor)):
                edit_header(pristine(root, target, flavor) / name, lambda header: None)
    pristine(root, "gguf").mkdir(parents=True)
    write_gguf(pristine(root, "gguf") / "model.gguf", base)
    pristine(root, "gguf-engine").mkdir(parents=True)
    q8 = copy.deepcopy(base)
    affine.quantize(q8, bits=8, group_size=32, sym=True)                 # Q8_0 linears, as the gguf-py file
    gguf_writer.write_gguf(q8, pristine(root, "gguf-engine") / "model.gguf")
    pristine(root, "gguf-engine-moe").mkdir(parents=True)
    affine.quantize(moe, bits=8, group_size=32, sym=True)
    gguf_writer.write_gguf(moe, pristine(root, "gguf-engine-moe") / "model.gguf")
    for target in TARGETS:
        flavors = ("file",) if target in GGUF_TARGETS else ("engine", "foreign")
        logits = [forward(load(target, pristine(root, target, f))) for f in flavors]
        if not all(torch.equal(y, logits[0]) and torch.isfinite(y).all() for y in logits):
            raise RuntimeError(f"pristine {target} checkpoints do not load to the same finite logits")


def load(target, path):
    if target in GGUF_TARGETS:
        return gguf.load_gguf(Path(path) / "model.gguf")
    return (load_dense if target.startswith("dense") else load_quantized)(path)


@torch.no_grad()
def forward(model):
    return model(IDS).float()


# ---- cases: what to mutate, chosen in the parent --------------------------------------------------------------------

FILE_OPS = {"json": ("deep-list", "deep-object", "truncated", "non-utf8", "empty", "huge", "not-object", "bom", "nul"),
            "safetensors": ("empty", "truncated", "extended", "huge-sparse")}
SPECIAL_OPS = ("directory", "fifo", "dev-zero", "outside-link", "inside-link", "dangling")
INDEX_OPS = ("missing-shard", "dotdot", "absolute", "not-object", "map-list", "value-int", "unknown-shard", "no-map")
TENSOR_OPS = ("drop", "stray", "stray-layer", "dim+1", "dim-1", "extra-dim", "zero-dim", "scalar",
              "dtype:F32", "dtype:F16", "dtype:BF16", "dtype:F8_E4M3", "dtype:I32", "dtype:I64", "dtype:U8",
              "dtype:BOOL", "poison:nan", "poison:inf", "poison:-inf", "poison:huge", "poison:negative",
              "poison:zero", "poison:int-max", "poison:int-minus-one")
HEADER_OPS = ("length-bit", "length-huge", "json-byte", "offsets-beyond", "offsets-shift", "overlap", "shape",
              "dtype", "not-object", "metadata-list", "metadata-int", "digest", "writer")
GGUF_TENSOR_OPS = ("drop", "stray", "stray-layer", "dim+1", "dim-1", "dtype:F16", "dtype:Q8_0")
GGUF_TABLE_OPS = ("type", "offset", "dims")             # one field of a tensor's entry in the table, in place


def json_paths(value, prefix=()):
    """Every path (tuple of keys / indices) into a JSON value, containers and leaves."""
    paths = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        paths += json_paths(child, prefix + (key,))
    return paths


def candidates(root, target):
    """{category: [case spec, ...]} of one target; "flip" and "truncated" cases get their positions in the worker
    from the case's seed."""
    folder = pristine(root, target)
    file_cases = {"file": [dict(file="model.gguf", op=op) for op in FILE_OPS["safetensors"]],
                 "special": [dict(file="model.gguf", op=op) for op in ("directory", "fifo", "dev-zero", "dangling")],
                 "flip": [dict(file="model.gguf", op=op) for op in ("bit", "byte")]}
    if target in ("gguf-engine", "gguf-engine-moe"):    # the engine's own file: each tensor's SHA-256 recorded
        with gguf_file.GGUFFile(folder / "model.gguf") as f:
            return {"gguf-table": [dict(name=n, op=op) for n in f.tensors for op in GGUF_TABLE_OPS], **file_cases}
    if target == "gguf":
        keys = ["general.architecture", *(f"qwen3.{k}" for k in GGUF_KEYS)]
        names = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight",
                 "blk.0.attn_norm.weight", "blk.1.attn_k_norm.weight"]
        return {"gguf-metadata": [dict(key=k, op=op) for k in keys for op in [*WRONG_VALUES, "scaled"]],
                "gguf-tensor": [dict(name=n, op=op) for n in names for op in GGUF_TENSOR_OPS
                                if not (op == "dtype:Q8_0" and "k_norm" in n)],       # rows of 16: not Q8_0 blocks
                **file_cases}
    config = json.loads((folder / "config.json").read_text())
    shards = safetensors_files(folder)
    files = ["config.json", *shards] + ([INDEX] if (folder / INDEX).exists() else [])
    paths = json_paths(config)
    values = [*WRONG_VALUES, "scaled"]
    out = {"config": [dict(path=p, op=op) for p in paths if p[0] != "quantization_config" for op in values],
           "quantization_config": [dict(path=p, op=op) for p in paths if p[0] == "quantization_config"
                                   for op in values],
           "file": [dict(file=f, op=op) for f in files for op in FILE_OPS["safetensors" if f in shards else "json"]],
           "special": [dict(file=f, op=op) for f in files for op in SPECIAL_OPS]
           + ([dict(file=INDEX, op=op) for op in INDEX_OPS] if INDEX in files else []),
           "tensor": [dict(file=f, name=n, op=op) for f in shards for n in read_header(folder / f)[0]
                      for op in TENSOR_OPS],
           "header": [dict(file=f, op=op) for f in shards for op in HEADER_OPS],
           "flip": [dict(file=f, op=op) for f in files for op in ("bit", "byte")]}
    out.update(declared_input_candidates(folder, shards))
    return {k: v for k, v in out.items() if v}


def checkpoint_cases(root, n, seed=0):
    """n checkpoint cases: targets in turn, and within a target its categories in turn, each category's candidates
    in a shuffled order (cycled when used up). Each case carries its own seed."""
    rng = random.Random(seed)
    pools = {}
    for target in TARGETS:
        pools[target] = {}
        for category, specs in candidates(root, target).items():
            rng.shuffle(specs)
            pools[target][category] = specs
    cases = []
    for i in range(n):
        target = TARGETS[i % len(TARGETS)]
        categories = sorted(pools[target])
        category = categories[(i // len(TARGETS)) % len(categories)]
        specs = pools[target][category]
        spec = specs[(i // len(TARGETS) // len(categories)) % len(specs)]
        flavor = "file" if target in GGUF_TARGETS else (
            "foreign" if category == "quantization_config" and rng.random() < 0.8 else rng.choice(("engine",
                                                                                                  "foreign")))
        cases.append(dict(kind="checkpoint", target=target, flavor=flavor, category=category, seed=rng.getrandbits(32),
                          **spec))
    return cases


# ---- applying a checkpoint mutation (in the worker) ---------------------------------------------------------------

def wrong_value(op, old):
    if op == "scaled":
        return old * 10 if isinstance(old, (int, float)) and not isinstance(old, bool) else (
            not old if isinstance(old, bool) else f"{old}-fuzz" if isinstance(old, str) else old)
    return DELETE if op == "delete" else copy.deepcopy(WRONG_VALUES[op])


def set_path(obj, path, op):
    for key in path[:-1]:
        obj = obj[key]
    value = wrong_value(op, obj[path[-1]])
    if value is DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


def flip(data, rng, op):
    """A bit or a whole byte (xor 1..255) flipped at a random position: (new bytes, description)."""
    if not data:
        return data, "empty file"
    pos = rng.randrange(len(data))
    mask = 1 << rng.randrange(8) if op == "bit" else rng.randrange(1, 256)
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out), f"byte {pos} of {len(data)} ^ {mask:#04x}"


def mutate_file(path, op, rng):
    data = path.read_bytes()
    if op == "deep-list":
        path.write_bytes(b"[" * 100_000)
    elif op == "deep-object":
        path.write_bytes(b'{"a":' * 100_000)
    elif op == "truncated":
        path.write_bytes(data[:rng.randrange(len(data))])
    elif op == "non-utf8":
        pos = rng.randrange(len(data))
        path.write_bytes(data[:pos] + b"\xff\xfe" + data[pos:])
    elif op == "empty":
        path.write_bytes(b"")
    elif op == "huge":
        os.truncate(path, 100 << 20)                                   # sparse: 100 MiB of zeros after the JSON
    elif op == "not-object":
        path.write_bytes(b"[1, 2, 3]")
    elif op == "bom":
        path.write_bytes(b"\xef\xbb\xbf" + data)
    elif op == "nul":
        path.write_bytes(data + b"\x00")
    elif op == "extended":
        path.write_bytes(data + rng.randbytes(rng.randrange(1, 4096)))
    elif op == "huge-sparse":
        os.truncate(path, 1 << 40)
    else:
        raise KeyError(op)


def mutate_special(folder, file, op, outside):
    path = folder / file
    if op == "directory":
        path.unlink()
        path.mkdir()
        (path / "x").write_text("{}")
    elif op == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif op == "dev-zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    elif op == "outside-link":
        outside.mkdir(exist_ok=True)
        shutil.move(path, outside / file)
        path.symlink_to(outside / file)
    elif op == "inside-link":                                             # legitimate: must load unchanged
        path.rename(folder / f"real-{file}")
        path.symlink_to(f"real-{file}")
    elif op == "dangling":
        path.unlink()
        path.symlink_to(folder / "nowhere")
    else:
        raise KeyError(op)


def mutate_index(folder, op):
    index = json.loads((folder / INDEX).read_text())
    weight_map = index["weight_map"]
    name = next(iter(weight_map))
    if op == "missing-shard":
        (folder / weight_map[name]).unlink()
    elif op in ("dotdot", "absolute", "value-int", "unknown-shard"):
        weight_map[name] = {"dotdot": "../x.safetensors", "absolute": "/etc/passwd", "value-int": 3,
                            "unknown-shard": "model-00009-of-00009.safetensors"}[op]
    elif op == "not-object":
        index = [index]
    elif op == "map-list":
        index["weight_map"] = list(weight_map.items())
    elif op == "no-map":
        del index["weight_map"]
    (folder / INDEX).write_text(json.dumps(index))


def rewrite_tensors(path, change, flavor):
    """Load a safetensors file, change(tensors), save it again: with recomputed digests for the engine flavor (a
    writer that wrote bad tensors), without the engine's metadata for the foreign one."""
    metadata = read_header(path)[1]
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    if flavor == "engine":
        save_file(tensors, path, metadata)
    else:
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})


TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}


def reshaped(t, shape):
    """A tensor of `shape` holding t's leading values (zeros past them)."""
    out = torch.zeros(shape, dtype=t.dtype)
    n = min(out.numel(), t.numel())
    out.reshape(-1)[:n] = t.reshape(-1)[:n]
    return out


def change_tensor(tensors, name, op, rng):
    t = tensors[name]
    if op == "drop":
        del tensors[name]
    elif op == "stray":
        tensors["model.fuzz.weight"] = torch.ones(4)
    elif op == "stray-layer":
        tensors[f"model.layers.{TINY['num_hidden_layers']}.input_layernorm.weight"] = torch.ones(TINY["hidden_size"])
    elif op in ("dim+1", "dim-1", "zero-dim", "extra-dim", "scalar"):
        shape = list(t.shape)
        d = rng.randrange(len(shape)) if shape else None
        if op == "extra-dim":
            shape.insert(rng.randrange(len(shape) + 1), rng.choice((1, 2)))
        elif op == "scalar":
            shape = []
        elif d is not None:
            shape[d] = {"dim+1": shape[d] + 1, "dim-1": max(shape[d] - 1, 0), "zero-dim": 0}[op]
        tensors[name] = reshaped(t, shape)
    elif op.startswith("dtype:"):
        dtype = TORCH_DTYPES[op[6:]]
        source = t.float() if dtype == torch.float8_e4m3fn or t.dtype == torch.float8_e4m3fn else t
        tensors[name] = source.clamp(-448, 448).to(dtype) if dtype == torch.float8_e4m3fn else source.to(dtype)
    elif op.startswith("poison:"):
        kind, t = op[7:], t.clone()
        flat = t.reshape(-1)
        if flat.numel() == 0:
            return
        i = rng.randrange(flat.numel())
        if t.dtype.is_floating_point:
            value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 1e30 if t.element_size() >= 4
                     else float(torch.finfo(t.dtype).max), "negative": -abs(float(flat[i])) - 1.0, "zero": 0.0,
                     "int-max": float(torch.finfo(t.dtype).max), "int-minus-one": -1.0}[kind]
            flat[i] = value
        elif t.dtype != torch.bool:
            info = torch.iinfo(t.dtype)
            flat[i] = {"int-max": info.max, "int-minus-one": -1 if info.min < 0 else info.max, "negative": info.min,
                       "huge": info.max, "zero": 0}.get(kind, info.max)
        tensors[name] = t
    else:
        raise KeyError(op)


def edit_header(path, change):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header = change(header) or header
    new = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])


def mutate_header(path, op, rng):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    if op == "length-bit":
        out = bytearray(data)
        out[rng.randrange(8)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(out))
        return
    if op == "length-huge":
        path.write_bytes(struct.pack("<Q", 2 ** 63) + data[8:])
        return
    if op == "json-byte":
        out = bytearray(data)
        out[8 + rng.randrange(n)] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(out))
        return
    size = len(data) - 8 - n

    def change(header):
        names = sorted(k for k in header if k != "__metadata__")
        a, b = rng.sample(names, 2) if len(names) > 1 else (names[0], names[0])
        entry = header[a]
        begin, end = entry["data_offsets"]
        if op == "offsets-beyond":
            entry["data_offsets"] = [size + 8, size + 8 + end - begin]
        elif op == "offsets-shift":
            entry["data_offsets"] = [begin + 1, end + 1]
        elif op == "overlap":
            other = header[b]["data_offsets"]
            entry["data_offsets"] = [other[0], other[0] + end - begin]
        elif op == "shape":
            entry["shape"] = entry["shape"][::-1] + [1] if rng.random() < 0.5 else [s + 1 for s in entry["shape"]]
        elif op == "dtype":
            entry["dtype"] = rng.choice(("F64", "I8", "U16", "XX", 7))
        elif op == "not-object":
            return [header]
        elif op == "metadata-list":
            header["__metadata__"] = ["format", "pt"]
        elif op == "metadata-int":
            header.setdefault("__metadata__", {})["format"] = 1
        elif op == "digest":
            meta = header.setdefault("__metadata__", {})
            digests = json.loads(meta.get("engine.sha256", "{}")) or {a: "0" * 64}
            digests[a] = "f" * 64
            meta["engine.sha256"] = json.dumps(digests)
        elif op == "writer":
            header.setdefault("__metadata__", {})["engine.writer"] = "someone else"
        else:
            raise KeyError(op)
    edit_header(path, change)


def mutate_checkpoint(folder, case, outside, dense_model=None):
    """Apply one checkpoint case to the copy in `folder`; returns what was done, in words."""
    rng = random.Random(case["seed"])
    category, op, file = case["category"], case["op"], case.get("file")
    if category in ("config", "quantization_config"):
        config = json.loads((folder / "config.json").read_text())
        set_path(config, case["path"], op)
        (folder / "config.json").write_text(json.dumps(config))
    elif category == "file":
        mutate_file(folder / file, op, rng)
    elif category == "special":
        (mutate_index(folder, op) if op in INDEX_OPS else mutate_special(folder, file, op, outside))
    elif category == "tensor":
        rewrite_tensors(folder / file, lambda t: change_tensor(t, case["name"], op, rng), case["flavor"])
    elif category == "header":
        mutate_header(folder / file, op, rng)
    elif category == "flip":
        data, where = flip((folder / file).read_bytes(), rng, op)
        (folder / file).write_bytes(data)
        return where
    elif category == "gguf-metadata":
        kinds = {"string": "STRING", "true": "BOOL", "false": "BOOL", "float": "FLOAT32", "list": "ARRAY",
                 "zero": "UINT32", "minus-one": "INT32", "1e300": "FLOAT64", "1e9": "UINT32", "2^63": "UINT64",
                 "nan": "FLOAT32", "inf": "FLOAT32", "-inf": "FLOAT32", "long-string": "STRING"}
        if op == "delete":
            entry = DELETE
        elif op == "scaled":
            old = gguf_value(dense_model.cfg, case["key"])
            entry = ("STRING", old + "-fuzz") if isinstance(old, str) else (
                "FLOAT32" if isinstance(old, float) else "UINT32", old * 10)
        elif op in ("dict", "null"):
            entry = ("STRING", json.dumps(WRONG_VALUES[op]))
        else:
            entry = (kinds[op], WRONG_VALUES[op])
        write_gguf(folder / "model.gguf", dense_model, metadata={case["key"]: entry})
    elif category == "gguf-table":
        return mutate_gguf_table(folder / "model.gguf", case["name"], op, rng)
    elif category == "gguf-tensor":
        write_gguf(folder / "model.gguf", dense_model, tensors=gguf_tensor_change(dense_model, case["name"], op))
    elif category in DECLARED_INPUT_CATEGORIES:
        mutate_declared_input(folder, case)
    else:
        raise KeyError(category)
    return ""


def _table_entry(data, name, n_dims):
    """Positions of tensor `name`'s dimensions, type and offset fields in a GGUF file's tensor table."""
    at = data.index(len(name).to_bytes(8, "little") + name.encode()) + 8 + len(name) + 4
    return at, at + 8 * n_dims, at + 8 * n_dims + 4


def mutate_gguf_table(path, name, op, rng):
    """Change one field of tensor `name`'s table entry in place: its GGML type (another known one), its offset
    (another tensor's), or its dimensions (reversed, or the first one doubled)."""
    data = bytearray(path.read_bytes())
    with gguf_file.GGUFFile(path) as f:
        dims = {n: len(info.shape) for n, info in f.tensors.items()}
    dims_at, type_at, offset_at = _table_entry(data, name, dims[name])
    if op == "type":
        old = int.from_bytes(data[type_at:type_at + 4], "little")
        new = rng.choice(sorted({type_id for type_id, _, _ in ggml.GGML_TYPES.values()} - {old}))
        data[type_at:type_at + 4] = new.to_bytes(4, "little")
    elif op == "offset":
        other = rng.choice(sorted(set(dims) - {name}))
        at = _table_entry(data, other, dims[other])[2]
        data[offset_at:offset_at + 8] = data[at:at + 8]
    else:
        ne = [int.from_bytes(data[dims_at + 8 * k:dims_at + 8 * k + 8], "little") for k in range(dims[name])]
        ne = ne[::-1] if len(ne) > 1 and rng.random() < 0.5 else [2 * ne[0], *ne[1:]]
        data[dims_at:dims_at + 8 * len(ne)] = b"".join(d.to_bytes(8, "little") for d in ne)
    path.write_bytes(bytes(data))
    return f"{name}: {op}"


def gguf_value(cfg, key):
    return "qwen3" if key == "general.architecture" else getattr(cfg, GGUF_KEYS[key.removeprefix("qwen3.")][1])


def gguf_tensor_change(model, name, op):
    import gguf as gg
    hf = gguf.hf_name(name)[0]
    w = model.state_dict()[hf].detach().float().numpy()
    if op == "drop":
        return {name: DELETE}
    if op == "stray":
        return {"blk.0.fuzz.weight": (np.ones(4, np.float32), None)}
    if op == "stray-layer":
        return {f"blk.{TINY['num_hidden_layers']}.attn_norm.weight": (np.ones(TINY["hidden_size"], np.float32), None)}
    if op in ("dim+1", "dim-1"):
        shape = list(w.shape)
        shape[0] += 1 if op == "dim+1" else -1
        return {name: (reshaped(torch.from_numpy(w), shape).numpy(), None)}
    if op == "dtype:F16":
        return {name: (w.astype(np.float16), None)}
    w2 = w.reshape(-1, w.shape[-1])
    return {name: (gg.quants.quantize(w2, gg.GGMLQuantizationType.Q8_0).reshape(*w.shape[:-1], -1), "Q8_0")}


# ---- inputs whose header or tokenizer declares what the model cannot hold (issue 25) ------------------------------
# A stray tensor declared huge must be refused from its header, before a byte is read (the file is sparse: the
# declared size costs no disk); a tokenizer.json whose added token has an id beyond the model's vocabulary must be
# refused when it loads (fuzz.py's worker loads the folder's tokenizer for these cases).

DECLARED_INPUT_CATEGORIES = ("stray-huge", "tokenizer")
STRAY_SIZES = {"1GiB": 1 << 30, "1TiB": 1 << 40}
TOKEN_IDS = {"vocab": 256, "1e6": 1_000_000, "2^31": 2 ** 31 - 1}


def declared_input_candidates(folder, shards):
    return {"stray-huge": [dict(file=f, op=op, name=name) for f in shards for op in STRAY_SIZES
                           for name in ("model.stray_huge", "model.layers.0.self_attn.q_proj.stray_huge")],
            "tokenizer": [dict(op=op) for op in TOKEN_IDS]}


def append_sparse_tensor(path, name, nbytes):
    """Declare one more F32 tensor `name` of nbytes at the end of a safetensors file's data, the file extended to
    match by a sparse truncate (its header and size are consistent: only reading it would cost nbytes)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = len(data) - 8 - n
    header[name] = {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [end, end + nbytes]}
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])
    os.truncate(path, 8 + len(new) + end + nbytes)


def tokenizer_with_added_token(folder, token_id):
    """The byte tokenizer written into folder, plus one added token "<|fuzz|>" with id token_id."""
    from engine.checkpoints.tokenizer import byte_tokenizer
    spec = json.loads(byte_tokenizer().to_str())
    spec["added_tokens"] = [{"id": token_id, "content": "<|fuzz|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}]
    (Path(folder) / "tokenizer.json").write_text(json.dumps(spec))


def mutate_declared_input(folder, case):
    if case["category"] == "stray-huge":
        append_sparse_tensor(folder / case["file"], case["name"], STRAY_SIZES[case["op"]])
    else:
        tokenizer_with_added_token(folder, TOKEN_IDS[case["op"]])
