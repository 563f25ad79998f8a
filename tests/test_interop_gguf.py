"""The GGUF reader against llama.cpp's own Python code (gguf-py: GGUFWriter, GGUFReader, gguf.quants; with
LLAMA_CPP_DIR set, its converter convert_hf_to_gguf.py) and transformers (its Llama / Qwen2 / Qwen3 models, its
reverse of the converter's q/k permutation, its GGUF tokenizer)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.checkpoints import gguf, gguf_file, gguf_tokenizer
from engine.loaders import load_dense, save_dense
from engine.safetensors_io import snapshot_tensors
from engine.formats.llama_cpp import ggml
from engine.formats.numerics.affine import AffineQuantLinear
from engine.layers import QuantLinear
from engine.qwen3 import Qwen3, Qwen3Config
from test_gguf import K_CFG, _has_llama, _tokenizer, bpe_metadata, gguf_name, needs_smollm2, random_blocks

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]
gg = pytest.importorskip("gguf")
QUANTIZABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]       # what gguf.quants.quantize can write
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]                    # it only reads these: random blocks


def their_dequantize(raw, type_name, shape):
    rows = np.asarray(raw, dtype=np.uint8).reshape(shape[0], -1)
    return torch.from_numpy(gg.quants.dequantize(rows, gg.GGMLQuantizationType[type_name]).copy())


def converter_permute(weights, n_head, n_head_kv):
    """Verbatim from llama.cpp's converter (vendor/llama.cpp/conversion/llama.py in llama-cpp-python 0.3.36,
    LlamaModel.permute): what it does to q_proj / k_proj rows (weight and bias) of a `llama` model."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


# ---- block formats ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_decoder_equals_gguf_dequantize(type_name):
    _, block, _ = ggml.GGML_TYPES[type_name]
    shape = (6, 3 * block)
    raw = random_blocks(type_name, *shape)
    ours = ggml.dequantize(raw, type_name, shape)
    assert torch.equal(ours, their_dequantize(raw, type_name, shape))       # == (so -0 and +0 are the same)
    if type_name in QUANTIZABLE:                                             # and on what their quantizer writes
        w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        raw = torch.from_numpy(gg.quants.quantize(w, gg.GGMLQuantizationType[type_name]).reshape(-1))
        assert torch.equal(ggml.dequantize(raw, type_name, shape), their_dequantize(raw, type_name, shape))
        assert torch.equal(ggml.quantized_linear(raw, type_name, shape).dequantize(),
                           their_dequantize(raw, type_name, shape))


def test_metadata_and_tensor_table_equal_gguf_reader(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gg.GGUFWriter(str(path), "qwen3")
    writer.add_custom_alignment(64)
    writer.add_uint8("u8", 7), writer.add_int16("i16", -3), writer.add_uint64("u64", 2 ** 40)
    writer.add_float32("f32", 1e-6), writer.add_float64("f64", 0.25), writer.add_bool("flag", True)
    writer.add_string("s", "\u6771\u4eac"), writer.add_array("words", ["a", "bb"]), writer.add_array("ints", [1, -2])
    writer.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("q", gg.quants.quantize(np.ones((2, 64), np.float32), gg.GGMLQuantizationType.Q8_0),
                      raw_dtype=gg.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    reader = gg.GGUFReader(str(path))
    with gguf_file.GGUFFile(path) as f:
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                theirs, ours = field.contents(), f.metadata[key]
                assert np.array_equal(np.float32(ours), theirs) if key == "f32" else ours == theirs, key
        assert f.alignment == 64
        for t in reader.tensors:
            info = f.tensors[t.name]
            assert (info.type_name, info.shape, info.offset) == (t.tensor_type.name, tuple(reversed(t.shape.tolist())),
                                                                 t.data_offset)
            assert bytes(f.raw(t.name).numpy()) == t.data.tobytes()


# ---- files written by GGUFWriter load with the logits of their decoded weights ----------------------------------

def write_qwen3(path, model, linear_type="F32", arch="qwen3"):
    """model -> a GGUF file via gguf-py's writer (linears quantized by gguf.quants, or random K-quant blocks).
    Returns the state dict that the file decodes to according to gguf.quants.dequantize."""
    cfg, writer, state = model.cfg, gg.GGUFWriter(str(path), arch), {}
    writer.add_block_count(cfg.num_hidden_layers), writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size), writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads), writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim), writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta), writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for i, (name, p) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = p.detach().float().numpy()
        if linear_type != "F32" and gguf.hf_name(gguf_name(name))[1] in gguf.LINEARS:
            kind = gg.GGMLQuantizationType[linear_type]
            raw = (random_blocks(linear_type, *w.shape, seed=i, scale=0.002).numpy().reshape(w.shape[0], -1)
                   if linear_type in K_QUANTS else gg.quants.quantize(w, kind))
            writer.add_tensor(gguf_name(name), raw, raw_dtype=kind)
            state[name] = their_dequantize(raw, linear_type, w.shape)
        else:
            writer.add_tensor(gguf_name(name), w)
            state[name] = p.detach().float()
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_gguf_writer_file_has_the_logits_of_its_dequantized_weights(tmp_path, type_name):
    torch.manual_seed(0)
    model = Qwen3(K_CFG).eval()
    model.load_state_dict(write_qwen3(tmp_path / "m.gguf", model, type_name))
    loaded = gguf.load_gguf(tmp_path / "m.gguf")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, QuantLinear)
    ids = torch.randint(0, K_CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_engine_checkpoint_as_f32_gguf_has_identical_logits(tmp_path):
    """The book's model shape through its HF folder (save_dense, as `run.py train --out DIR` writes it)."""
    torch.manual_seed(0)
    save_dense(Qwen3(Qwen3Config()).eval(), tmp_path / "hf")
    dense = load_dense(tmp_path / "hf")
    assert set(dict(snapshot_tensors(tmp_path / "hf"))) == set(dense.state_dict()) - {"lm_head.weight"}
    write_qwen3(tmp_path / "m.gguf", dense)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(gguf.load_gguf(tmp_path / "m.gguf")(ids), dense(ids))


# ---- llama (permuted q/k) and qwen2 (biases) against transformers ----------------------------------------------

def reverse_permute(weights, n_head, n_head_kv):
    """transformers' own undoing of the converter's permutation (its GGUF loader)."""
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    return utils.LlamaTensorProcessor()._reverse_permute_weights(weights, n_head, n_head_kv)


HF_SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=256,
                tie_word_embeddings=False)


def hf_model(model_type, **shape):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **{**HF_SHAPE, **shape}, rope_theta=5e4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.normal_(0, 0.5)                      # random biases and norms, so that misplacing them shows
    return model.eval()


def write_hf(path, model, model_type, linear_type="F32"):
    """A transformers checkpoint written as llama.cpp's converter writes it (permuting llama's q / k rows)."""
    cfg, writer = model.config, gg.GGUFWriter(str(path), model_type)
    writer.add_block_count(cfg.num_hidden_layers), writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size), writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads), writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim), writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps), writer.add_vocab_size(cfg.vocab_size)
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if model_type == "llama" and ".q_proj." in name:
            w = converter_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        if model_type == "llama" and ".k_proj." in name:
            w = converter_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        if linear_type != "F32" and name.endswith("proj.weight"):
            writer.add_tensor(gguf_name(name), gg.quants.quantize(w, gg.GGMLQuantizationType[linear_type]),
                              raw_dtype=gg.GGMLQuantizationType[linear_type])
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def read_into_transformers(path):
    """Our config and tensors (quantized linears as their dequantized weight) in a transformers model."""
    transformers = pytest.importorskip("transformers")
    with gguf_file.GGUFFile(path) as f:
        cfg = gguf.hf_config(f)
        state = {n: (v.dequantize() if isinstance(v, QuantLinear) else v) for n, v in gguf.hf_tensors(f)}
    state = {(n + ".weight" if not n.endswith(("weight", "bias")) else n): v for n, v in state.items()}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg, state


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_converted_transformers_model_reads_back_exactly(tmp_path, model_type):
    model = hf_model(model_type)
    write_hf(tmp_path / "m.gguf", model, model_type)
    ours, cfg, state = read_into_transformers(tmp_path / "m.gguf")
    assert cfg["model_type"] == model_type and not cfg["tie_word_embeddings"]
    for name, p in model.state_dict().items():
        assert torch.equal(state[name], p), name                       # q / k rows back in HF's order
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, model(ids).logits)


def test_quantized_llama_q_rows_are_unpermuted(tmp_path):
    model = hf_model("llama")
    write_hf(tmp_path / "m.gguf", model, "llama", "Q8_0")
    reader = gg.GGUFReader(str(tmp_path / "m.gguf"))
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        layers = {n: v for n, v in gguf.hf_tensors(f) if isinstance(v, QuantLinear)}
    for t in reader.tensors:
        if t.name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight"):
            heads = 4 if "attn_q" in t.name else 2
            expected = reverse_permute(gg.quants.dequantize(t.data, t.tensor_type), 4, heads)
            layer = layers[gguf.hf_name(t.name)[0].removesuffix(".weight")]
            assert isinstance(layer, AffineQuantLinear)
            assert torch.equal(layer.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


def test_unpermute_inverts_the_converter_and_equals_transformers():
    w = np.random.default_rng(0).standard_normal((6 * 16, 5)).astype(np.float32)
    for heads, kv in ((6, 6), (6, 3)):
        rows = w[:kv * 16]
        stored = converter_permute(rows, heads, kv)
        ours = gguf.unpermute_rows(torch.from_numpy(stored), kv).numpy()
        assert np.array_equal(ours, rows) and np.array_equal(ours, reverse_permute(stored, heads, kv))


@pytest.mark.skipif(not _has_llama(), reason="the engine model has no Llama / Qwen2 support yet")
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_engine_logits_equal_transformers_on_converted_file(tmp_path, model_type):
    model = hf_model(model_type)
    write_hf(tmp_path / "m.gguf", model, model_type)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(gguf.load_gguf(tmp_path / "m.gguf")(ids), model(ids).logits, atol=1e-4, rtol=0)


CONVERTER = """import sys
sys.path.insert(0, ".")
import convert_hf_to_gguf, conversion.base
# our toy vocabulary has no pre-tokenizer fingerprint registered with the converter (and transformers 5 swaps in
# each model's own tokenizer class, which changes the fingerprint): name one
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", sys.argv[1], "--outfile", sys.argv[2], "--outtype", "f32"]
convert_hf_to_gguf.main()
"""


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (a llama.cpp source tree, e.g. "
                    "llama-cpp-python's sdist vendor/llama.cpp) runs its converter")
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_llama_cpp_converter_output_reads_back_exactly(tmp_path, model_type):
    if model_type == "llama":
        pytest.importorskip("sentencepiece")            # the converter's llama path imports it first
    model = hf_model(model_type, vocab_size=260)
    model.save_pretrained(tmp_path / "hf")
    tok, config = _tokenizer(tmp_path, bpe_metadata("gpt-2"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-c", CONVERTER, str(tmp_path / "hf"), str(tmp_path / "m.gguf")],
                          cwd=os.environ["LLAMA_CPP_DIR"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, _, state = read_into_transformers(tmp_path / "m.gguf")
    for name, p in model.state_dict().items():
        assert torch.equal(state[name], p), name
    ids = torch.randint(0, 260, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, model(ids).logits)
        if model_type == "qwen3":
            assert torch.allclose(gguf.load_gguf(tmp_path / "m.gguf")(ids), model(ids).logits, atol=1e-4, rtol=0)


# ---- the real model ---------------------------------------------------------------------------------------------

@needs_smollm2
@pytest.mark.slow                                           # gguf.GGUFReader takes ~2.5 s to parse the vocabulary
def test_smollm2_tensors_equal_gguf_reader():
    """Every tensor (the first and last 128 rows of each, so the check stays fast) and every scalar key."""
    reader = gg.GGUFReader(str(gguf.smollm2_path()))
    theirs = {t.name: t for t in reader.tensors}
    with gguf_file.GGUFFile(gguf.smollm2_path()) as f:
        for key, field in reader.fields.items():
            if not key.startswith("GGUF.") and len(field.types) == 1:
                cast = np.float32 if field.types[0] == gg.GGUFValueType.FLOAT32 else (lambda v: v)
                assert cast(f.metadata[key]) == cast(field.contents()), key
        names = {gguf.hf_name(n)[0]: n for n in f.tensors}
        seen = 0
        for name, value in gguf.hf_tensors(f):
            t = theirs[names.get(name) or names[name + ".weight"]]
            ours = value.dequantize() if isinstance(value, QuantLinear) else value
            data = t.data if t.data.ndim == 1 else np.concatenate([t.data[:128], t.data[-128:]])
            expected = gg.quants.dequantize(data, t.tensor_type)
            if t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = len(expected) // 64                 # the sampled rows are whole heads
                expected = reverse_permute(expected, heads, heads)
            rows = ours if t.data.ndim == 1 else torch.cat([ours[:128], ours[-128:]])
            assert torch.equal(rows.float(), torch.from_numpy(expected.copy())), t.name
            seen += 1
    assert seen == 272


@needs_smollm2
def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer():
    """transformers splits SmolLM2 text with GPT-2's pattern (it knows no 'smollm' pre-tokenizer), llama.cpp and we
    split digits first: on text without digits the two must agree token for token."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    arch, tokenizer_dict, _ = mapping.get_gguf_tokenizer(str(gguf.smollm2_path()))
    theirs, _ = mapping.convert_gguf_tokenizer(arch, tokenizer_dict)
    with gguf_file.GGUFFile(gguf.smollm2_path()) as f:
        ours, _ = gguf_tokenizer.gguf_tokenizer(f)
    text = ("The quick brown fox jumps over the lazy dog.\n\nIt's a naïve café, isn't it?  Indeed:\t"
            "<|im_start|>assistant\n\u6771\u4eac and \U0001F600 emoji; don't, won't, we'll.")
    assert ours.encode(text).ids == theirs.encode(text, add_special_tokens=False).ids
