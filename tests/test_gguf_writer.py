"""The GGUF writer: the engine's layers written in GGML's own types and read back (by the engine's reader here; by
gguf-py, transformers and llama.cpp's converter in test_interop_gguf_writer.py), the llama q/k permutation, what GGML
cannot hold, and the tokenizer metadata (the byte model's recipe, a tokenizer.json carried, a GGUF's copied)."""
import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from engine.checkpoints import gguf, gguf_file, gguf_tokenizer, gguf_writer, tokenizer
from engine.formats.numerics import affine
from engine.formats import fp8, mx, nf4
from engine.formats.llama_cpp import ggml
from engine.formats.numerics.affine import AffineQuantLinear
from engine.layers import quantized_linears
from engine.formats.mx import dequantize_nvfp4
from engine.qwen3 import Qwen3, Qwen3Config
from test_gguf import bpe_metadata, gguf_bytes, write

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=2)
QUANTIZERS = {
    "F32": lambda m: None,
    "Q4_0": lambda m: affine.quantize(m, bits=4, group_size=32, sym=True),
    "Q4_1": lambda m: affine.quantize(m, bits=4, group_size=32),
    "Q8_0": lambda m: affine.quantize(m, bits=8, group_size=32, sym=True),
    "MXFP4": lambda m: mx.quantize(m, format="mxfp4"),
    "NVFP4": lambda m: mx.quantize(m, format="nvfp4"),
}


def small_model(model_type="qwen3", kind="F32", seed=0):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(SMALL, model_type=model_type, attention_bias=model_type == "llama")
    model = Qwen3(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5)                          # so that a misplaced bias or norm shows
    QUANTIZERS[kind](model)
    return model


def logits(model, seed=0):
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


def with_f16_offsets(model):
    """What a Q4_1 file holds: the model with each offset rounded to float16 (a free offset, no longer an integer
    zero point)."""
    for name, layer in quantized_linears(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, AffineQuantLinear(
            layer.packed, layer.scales, layer.offsets.half().float(), layer.group_size, True, layer.bias,
            bits=layer.bits, in_features=layer.in_features))
    return model


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_written_model_reads_back_with_identical_logits(tmp_path, model_type, kind):
    model = small_model(model_type, kind)
    report = gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    assert report["types"] == {kind: 14} and not report["fallbacks"]
    expected = with_f16_offsets(model) if kind == "Q4_1" else model
    assert torch.equal(logits(gguf.load_gguf(tmp_path / "m.gguf")), logits(expected))


def test_symmetric_int4_g32_is_q4_0_with_the_engines_codes(tmp_path):
    model = small_model(kind="Q4_0")
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    layer = model.model.layers[1].mlp.down_proj
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        info = f.tensors["blk.1.ffn_down.weight"]
        raw = f.raw(info.name)
    assert info.type_name == "Q4_0" and info.shape == (64, 128)
    first = raw[:18]                                               # block 0: f16 d, element j low, j + 16 high
    codes = layer.weight_codes[0, :32]
    assert torch.equal(first[:2].view(torch.float16).float(), layer.scales[0, :1])
    assert torch.equal(first[2:], codes[:16] | (codes[16:] << 4))
    read = ggml.quantized_linear(raw, "Q4_0", info.shape)
    assert torch.equal(read.weight_codes, layer.weight_codes) and torch.equal(read.scales, layer.scales)


def test_q4_1_keeps_codes_and_scales_and_moves_offsets_by_under_one_percent_of_a_step(tmp_path):
    model = small_model(kind="Q4_1")
    report = gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    assert 0 < report["offset_shift"] <= 15 * 2 ** -11            # half an f16 ulp of |offset| <= 15 steps
    loaded = gguf.load_gguf(tmp_path / "m.gguf")
    for name, layer in quantized_linears(model).items():
        read = loaded.get_submodule(name)
        assert torch.equal(read.weight_codes, layer.weight_codes) and torch.equal(read.scales, layer.scales)
        assert torch.equal(read.offsets, layer.offsets.half().float())


def test_llama_q_and_k_rows_are_permuted_into_ggml_pairs(tmp_path):
    for model_type, permuted in (("llama", True), ("qwen3", False)):
        model = small_model(model_type)
        gguf_writer.write_gguf(model, tmp_path / f"{model_type}.gguf")
        with gguf_file.GGUFFile(tmp_path / f"{model_type}.gguf") as f:
            for part, heads in (("q", 4), ("k", 2)):
                stored = ggml.dequantize(f.raw(f"blk.0.attn_{part}.weight"), "F32", (heads * 16, 64))
                hf = model.get_submodule(f"model.layers.0.self_attn.{part}_proj").weight
                assert torch.equal(stored, gguf_writer.permute_rows(hf, heads) if permuted else hf)
    rows = torch.arange(48).reshape(24, 2)
    assert torch.equal(gguf.unpermute_rows(gguf_writer.permute_rows(rows, 3), 3), rows)
    assert torch.equal(gguf_writer.permute_rows(torch.arange(8), 2), torch.tensor([0, 2, 1, 3, 4, 6, 5, 7]))


def _act_order(model):
    affine.quantize(model, bits=4, group_size=32, sym=True)
    layer = model.model.layers[0].mlp.up_proj
    model.model.layers[0].mlp.up_proj = AffineQuantLinear(layer.packed, layer.scales, None, 32, True, zeros=layer.zeros,
                                                          perm=torch.randperm(64))


@pytest.mark.parametrize("quantize,match", [
    (lambda m: affine.quantize(m, bits=4, group_size=64), "group size 64.*32 weights"),
    (_act_order, "act-order"),
    (lambda m: affine.quantize(m, bits=8, group_size=32), "8-bit asymmetric"),
    (lambda m: affine.quantize(m, bits=2, group_size=32, sym=True), "2-bit symmetric"),
    (lambda m: fp8.quantize(m, block=32), "FP8BlockLinear: GGML has no type"),
    (lambda m: nf4.quantize(m, group_size=32), "NF4Linear: GGML has no type"),
])
def test_what_ggml_cannot_hold_is_refused_naming_why(tmp_path, quantize, match):
    model = small_model()
    quantize(model)
    with pytest.raises(ValueError, match=match):
        gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())                            # nothing written, not even a temporary file


def test_fallback_is_asked_for_and_logged(tmp_path, caplog):
    model = small_model()
    fp8.quantize(model, block=32)
    with caplog.at_level(logging.WARNING, logger="engine.checkpoints.gguf_writer"):
        report = gguf_writer.write_gguf(model, tmp_path / "m.gguf", fallback="F32")
    assert report["types"] == {"F32": 14} and len(report["fallbacks"]) == 14
    assert "FP8BlockLinear" in caplog.text and "written dequantized as F32" in caplog.text
    assert torch.equal(logits(gguf.load_gguf(tmp_path / "m.gguf")), logits(model))      # FP8 in F32 is exact


def test_bad_arguments_and_existing_files_are_refused(tmp_path):
    model = small_model()
    with pytest.raises(ValueError, match="dense_type and fallback must be one of"):
        gguf_writer.write_gguf(model, tmp_path / "m.gguf", dense_type="Q4_0")
    path = write(tmp_path, b"keep me", "m.gguf")
    with pytest.raises(ValueError, match="exists"):
        gguf_writer.write_gguf(model, path)
    assert path.read_bytes() == b"keep me"
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a folder, not a file"):          # even with force: never replaced
        gguf_writer.write_gguf(model, tmp_path / "folder", force=True)
    gguf_writer.write_gguf(model, path, force=True, dense_type="F16")
    with gguf_file.GGUFFile(path) as f:
        assert f.tensors["token_embd.weight"].type_name == "F16" and f.tensors["output_norm.weight"].type_name == "F32"
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_writer.model_metadata(dataclasses.replace(SMALL, model_type="llama", rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}))


# ---- tokenizers -------------------------------------------------------------------------------------------------

def test_byte_model_gets_the_vocabulary_llama_cpp_accepts(tmp_path):
    gguf_writer.write_gguf(small_model(), tmp_path / "m.gguf")
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        meta = f.metadata
        tok, config = gguf_tokenizer.gguf_tokenizer(f)
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert len(meta["tokenizer.ggml.tokens"]) == 256 and len(meta["tokenizer.ggml.merges"]) == 1
    assert meta["tokenizer.ggml.add_bos_token"] is False and not config["add_bos_token"]
    text = "h\u00e9llo \u6771\u4eac\n\t!"
    assert tok.encode(text).ids == list(text.encode()) and tok.decode(list(text.encode())) == text
    with pytest.raises(ValueError, match="only the byte model"):
        tokenizer.tokenizer_metadata(dataclasses.replace(SMALL, vocab_size=300))


# merges that make llama.cpp's splits tell apart on its fingerprint text: digit runs, a case-insensitive contraction
DISCRIMINATING = ["3 3", "33 3", "' R", "'R E", "\u0120 3"]


def saved_tokenizer(tmp_path, pre, merges=DISCRIMINATING):
    """A tokenizer.json (+ tokenizer_config.json with specials and a chat template) with llama.cpp's `pre` splits."""
    meta = {k: v[1] if t == 9 else v for k, t, v in bpe_metadata(pre)}
    extra = sorted({a + b for a, b in (m.split(" ") for m in merges)} - set(meta["tokenizer.ggml.tokens"]))
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:-1] + extra + ["<|end|>"]
    meta["tokenizer.ggml.token_type"] = [1] * (len(meta["tokenizer.ggml.tokens"]) - 1) + [3]
    meta["tokenizer.ggml.merges"] += merges
    meta["tokenizer.ggml.eos_token_id"] = len(meta["tokenizer.ggml.tokens"]) - 1
    tok, config = gguf_tokenizer.gguf_tokenizer(SimpleNamespace(metadata=meta))
    folder = tmp_path / pre
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, meta


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
def test_tokenizer_json_is_carried_with_the_pre_tokenizer_that_splits_like_it(tmp_path, pre):
    folder, meta = saved_tokenizer(tmp_path, pre)
    ours = tokenizer.hf_tokenizer_metadata(folder, len(meta["tokenizer.ggml.tokens"]) + 2)
    n = len(meta["tokenizer.ggml.tokens"])
    assert ours["tokenizer.ggml.pre"] == pre
    assert ours["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"] + ["[PAD%d]" % n, "[PAD%d]" % (n + 1)]
    assert ours["tokenizer.ggml.token_type"] == meta["tokenizer.ggml.token_type"] + [5, 5]
    assert ours["tokenizer.ggml.merges"] == meta["tokenizer.ggml.merges"]
    assert ours["tokenizer.ggml.eos_token_id"] == n - 1 and ours["tokenizer.chat_template"] == "{{ messages }}"


def test_gguf_tokenizer_is_copied_unchanged(tmp_path):
    meta = bpe_metadata("smollm")
    source = write(tmp_path, gguf_bytes(meta), "source.gguf")
    cfg = dataclasses.replace(SMALL, vocab_size=260)
    torch.manual_seed(0)
    gguf_writer.write_gguf(Qwen3(cfg).eval(), tmp_path / "m.gguf", tokenizer=source)
    with gguf_file.GGUFFile(source) as a, gguf_file.GGUFFile(tmp_path / "m.gguf") as b:
        assert {k: v for k, v in b.metadata.items() if k.startswith("tokenizer.")} == a.metadata


def test_nvfp4_dequantized_by_the_reader_includes_the_tensor_scale(tmp_path):
    model = small_model(kind="NVFP4")
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        dense = dict(gguf.hf_tensors(f, dense=True))
    layer = model.model.layers[0].self_attn.o_proj
    expected = dequantize_nvfp4(layer.packed, layer.block_scale, 1.0) * layer.tensor_scale     # llama.cpp's order
    assert torch.equal(dense["model.layers.0.self_attn.o_proj.weight"], expected)
    assert torch.allclose(expected, layer.dequantize(), rtol=1e-6, atol=0)


# ---- integrity: a SHA-256 per tensor -----------------------------------------------------------------------------

def _table_entry(path, name):
    """Byte position of tensor `name`'s (type u32, offset u64) fields in the file's tensor table."""
    data = path.read_bytes()
    with gguf_file.GGUFFile(path) as f:
        n_dims = len(f.tensors[name].shape)
    at = data.index(len(name).to_bytes(8, "little") + name.encode())
    return at + 8 + len(name) + 4 + 8 * n_dims


def test_every_tensor_is_recorded_with_its_sha256_and_gguf_py_reads_it(tmp_path):
    gguf_py = pytest.importorskip("gguf")
    import hashlib
    gguf_writer.write_gguf(small_model(kind="Q4_0"), tmp_path / "m.gguf")
    reader = gguf_py.GGUFReader(str(tmp_path / "m.gguf"))             # gguf-py's own reader takes the new key
    field = reader.fields[gguf_file.DIGESTS]
    entries = [bytes(field.parts[i]).decode() for i in field.data]
    assert len(entries) == len(reader.tensors) > 0
    for entry, t in zip(entries, reader.tensors):
        name, kind, shape, digest = entry.split(" ")
        assert (name, kind) == (t.name, t.tensor_type.name)
        assert shape == "x".join(str(int(d)) for d in reversed(t.shape)) and \
            digest == hashlib.sha256(bytes(t.data.reshape(-1).view("uint8"))).hexdigest()


@pytest.mark.parametrize("change", ["a flipped bit", "a changed type", "an offset into another tensor"])
def test_a_changed_engine_file_is_refused(tmp_path, change):
    path = tmp_path / "m.gguf"
    gguf_writer.write_gguf(small_model(), path, dense_type="F16")
    data = bytearray(path.read_bytes())
    with gguf_file.GGUFFile(path) as f:
        a, b = f.tensors["blk.0.attn_q.weight"], f.tensors["blk.0.attn_k.weight"]
    if change == "a flipped bit":
        data[a.offset + 5] ^= 0x10
        match = "blk.0.attn_q.weight of .* does not match its recorded SHA-256"
    elif change == "a changed type":                                  # F16 -> BF16: the same byte count
        at = _table_entry(path, a.name)
        data[at:at + 4] = ggml.GGML_TYPES["BF16"][0].to_bytes(4, "little")
        match = "tensor blk.0.attn_q.weight BF16 .* is not the one its writer recorded"
    else:
        at = _table_entry(path, b.name) + 4
        offset = int.from_bytes(data[_table_entry(path, a.name) + 4:][:8], "little")
        data[at:at + 8] = offset.to_bytes(8, "little")
        match = "overlap"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=match):
        gguf.load_gguf(path)


@pytest.mark.parametrize("key,skip", [("llama.attention.head_count_kv", 0), ("llama.rope.freq_base", 0),
                                      ("tokenizer.ggml.model", 8)])            # a string: its length, then its text
def test_a_changed_metadata_value_of_an_engine_file_is_refused(tmp_path, key, skip):
    """The tensors' digests cannot see a changed head count (it changes how llama's q / k rows are unpermuted: other
    weights from the same bytes), RoPE base or tokenizer: the metadata digest does."""
    torch.manual_seed(0)
    model = Qwen3(Qwen3Config(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_hidden_layers=1)).eval()
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    at = data.index(key.encode()) + len(key) + 4 + skip             # the value, after the key and its type
    data[at] ^= 1
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="metadata .* is not what its writer recorded"):
        gguf.load_gguf(tmp_path / "m.gguf")


def test_embedding_types_follow_llama_quantizes_rule():
    """llama-quant.cpp: the output (and a tied embedding) Q6_K, Q8_0 in a Q8_0 file or where a row is not a multiple
    of 256; an untied embedding the file's type, with the linears' fallback."""
    from collections import Counter
    rule = gguf_writer.embedding_types
    assert rule(Counter({"IQ4_XS": 5, "IQ4_NL": 9}), 576, tied=True) == ("Q8_0", None)      # SmolLM2
    assert rule(Counter({"Q4_K": 7}), 2048, tied=True) == ("Q6_K", None)
    assert rule(Counter({"Q8_0": 7}), 2048, tied=True) == ("Q8_0", None)
    assert rule(Counter({"Q4_K": 7}), 4096, tied=False) == ("Q4_K", "Q6_K")                # Llama
    assert rule(Counter({"Q4_K": 7}), 576, tied=False) == ("Q5_0", "Q8_0")
    assert rule(Counter({"MXFP4": 7}), 4096, tied=False) == ("Q6_K", "Q6_K")
    assert rule(Counter(), 4096, tied=True) == (None, None)                              # a dense model


@pytest.mark.parametrize("embedding_type,expected", [("llama.cpp", "Q6_K"), ("Q8_0", "Q8_0"), ("IQ4_NL", "IQ4_NL"),
                                                     (None, "F32"), ("F16", "F16")])
def test_the_embedding_is_written_in_its_type_and_reads_back_as_its_blocks_decode(tmp_path, embedding_type,
                                                                                   expected):
    torch.manual_seed(0)
    model = Qwen3(dataclasses.replace(SMALL, hidden_size=256, head_dim=64)).eval()
    affine.quantize(model, bits=4, group_size=32, sym=True)
    gguf_writer.write_gguf(model, tmp_path / "m.gguf", embedding_type=embedding_type)
    loaded = gguf.load_gguf(tmp_path / "m.gguf")
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        info = f.tensors["token_embd.weight"]
        assert info.type_name == expected
        stored = ggml.dequantize(f.raw(info.name), info.type_name, info.shape).float()
    assert torch.equal(loaded.model.embed_tokens.weight, stored)
    if expected not in ("F32", "F16"):
        assert not torch.equal(stored, model.model.embed_tokens.weight)          # it really is quantized
    with pytest.raises(ValueError, match="embedding_type must be one of"):
        gguf_writer.write_gguf(model, tmp_path / "x.gguf", embedding_type="Q7_K")


def test_an_embedding_type_the_hidden_size_cannot_hold_falls_back_as_llama_quantize_does(tmp_path, caplog):
    model = small_model(kind="Q4_0")                                       # hidden 64: no room for Q6_K's 256
    with caplog.at_level(logging.WARNING):
        gguf_writer.write_gguf(model, tmp_path / "m.gguf", embedding_type="Q6_K")
    with gguf_file.GGUFFile(tmp_path / "m.gguf") as f:
        assert f.tensors["token_embd.weight"].type_name == "Q8_0"
    assert "Q6_K needs rows of a multiple of 256, got 64; written as Q8_0" in caplog.text
