"""The GGUF writer against other people's readers: gguf-py (GGUFReader + gguf.quants.dequantize, llama.cpp's own
Python), transformers' GGUF loader, and llama.cpp's converter (convert_hf_to_gguf.py, run from its sources without
the build) as a second, independent reader of the engine's Hugging Face checkpoints."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoints import gguf, gguf_file, gguf_writer
from engine.checkpoints.tokenizer import BYTE_CHARS
from engine.formats.quantized_checkpoints import load_quantized, save_quantized
from engine.formats.llama_cpp import ggml
from engine.layers import quantized_linears
from engine.formats.mx import dequantize_nvfp4
from engine.qwen3 import Qwen3
from test_gguf_writer import QUANTIZERS, SMALL, logits, small_model, with_f16_offsets

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]
gg = pytest.importorskip("gguf")


def their_weights(path):
    """{GGUF name: float32 tensor} as gguf-py decodes the file (NVFP4 without its per-tensor scale)."""
    return {t.name: torch.from_numpy(np.array(gg.quants.dequantize(t.data, t.tensor_type)))
            for t in gg.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", [k for k in QUANTIZERS if k != "F32"])
def test_gguf_reader_decodes_every_type_to_the_engine_weights(tmp_path, model_type, kind):
    model = small_model(model_type, kind)
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    theirs = their_weights(tmp_path / "m.gguf")
    heads = {"attn_q": 4, "attn_k": 2}
    if kind == "Q4_1":
        with_f16_offsets(model)
    for name, layer in quantized_linears(model).items():
        key = gguf_writer.gguf_name(name + ".weight")
        w = theirs[key].reshape(layer.out_features, layer.in_features)
        part = key.split(".")[-2]
        if model_type == "llama" and part in heads:
            w = gguf.unpermute_rows(w, heads[part])
        if kind == "NVFP4":
            assert torch.equal(w, dequantize_nvfp4(layer.packed, layer.block_scale, 1.0)), name
            assert torch.equal(theirs[key.replace(".weight", ".scale")], layer.tensor_scale.reshape(1)), name
        else:
            assert torch.equal(w, layer.dequantize()), name                # == : -0 and +0 are the same value


def test_metadata_has_the_value_types_llama_cpp_reads(tmp_path):
    gguf_writer.write_gguf(small_model("qwen3", "Q4_0"), tmp_path / "m.gguf")
    reader = gg.GGUFReader(str(tmp_path / "m.gguf"))
    T = gg.GGUFValueType
    want = {"qwen3.block_count": [T.UINT32], "qwen3.attention.layer_norm_rms_epsilon": [T.FLOAT32],
            "qwen3.rope.freq_base": [T.FLOAT32], "general.file_type": [T.UINT32],
            "tokenizer.ggml.tokens": [T.ARRAY, T.STRING], "tokenizer.ggml.token_type": [T.ARRAY, T.INT32],
            "tokenizer.ggml.merges": [T.ARRAY, T.STRING], "tokenizer.ggml.add_bos_token": [T.BOOL]}
    assert {k: reader.fields[k].types for k in want} == want
    assert reader.fields["general.file_type"].contents() == gg.LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert "output.weight" not in {t.name for t in reader.tensors}                      # tied: no lm_head


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_1"])
def test_transformers_gguf_loader_reads_the_llama_export(tmp_path, kind):
    """transformers undoes the q/k permutation itself, so this checks ours against an independent inverse."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Qwen3(dataclasses.replace(SMALL, model_type="llama")).eval()
    QUANTIZERS[kind](model)
    gguf_writer.write_gguf(model, tmp_path / "m.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = with_f16_offsets(model) if kind == "Q4_1" else model
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, logits(expected), atol=1e-4, rtol=0)


# ---- llama.cpp's converter as a second reader of the engine's HF checkpoints -----------------------------------

def converter_dir():
    for candidate in (os.environ.get("LLAMA_CPP_DIR"),
                      Path(os.environ.get("ENGINE_CLIENTS", Path.home() / ".cache/engine/clients")) / "llamacpp"
                      / "converter"):
        if candidate and (Path(candidate) / "convert_hf_to_gguf.py").is_file():
            return Path(candidate)
    return None


# The byte model has no tokenizer files, which the converter needs: its vocabulary step is replaced by the byte
# vocabulary (tensors are the converter's own work). Several folders are converted in one process.
CONVERT_MANY = """import json, sys
sys.path[:0] = [".", "gguf-py"]
import convert_hf_to_gguf, gguf
from conversion import base
tokens = json.loads(sys.argv[1])
def byte_vocab(self):
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"), w.add_token_list(tokens)
    w.add_token_types([1] * 256), w.add_token_merges([tokens[32] + " " + tokens[32]]), w.add_add_bos_token(False)
def no_sentencepiece(self):
    raise FileNotFoundError
base.TextModel._set_vocab_gpt2, base.TextModel._set_vocab_sentencepiece = byte_vocab, no_sentencepiece
for source, out in zip(sys.argv[2::2], sys.argv[3::2]):
    sys.argv = ["convert_hf_to_gguf.py", source, "--outfile", out, "--outtype", "f32"]
    convert_hf_to_gguf.main()
"""
CONVERTED = [("gptq-sym", "gptq", {"sym": True, "group_size": 32}),
             ("gptq-asym", "gptq", {"group_size": 32}),
             ("ct-int4-asym", "compressed-tensors", {"symmetric": False, "group_size": 32}),
             ("fp8", "fp8", {"block": 32}),
             ("ct-nvfp4", "compressed-tensors", {"format": "nvfp4-pack-quantized"})]


@pytest.mark.slow
@pytest.mark.skipif(converter_dir() is None, reason="llama.cpp's converter: set LLAMA_CPP_DIR or install the "
                    "llama.cpp client (benchmarks/clients.py)")
def test_llama_cpp_converter_reads_the_engines_checkpoints_as_the_engine_does(tmp_path):
    """It dequantizes GPTQ / compressed-tensors int4 / FP8 to F32 (equal to our dequantize) and keeps NVFP4 as
    GGML NVFP4: bytes equal to what our writer makes of the same layer."""
    args = []
    for name, method, options in CONVERTED:
        torch.manual_seed(0)
        save_quantized(Qwen3(SMALL).eval(), tmp_path / name, method, torch.randint(0, 256, (4, 32)), force=True,
                       **options)
        args += [str(tmp_path / name), str(tmp_path / f"{name}.gguf")]
    tokens = list(BYTE_CHARS)
    done = subprocess.run([sys.executable, "-c", CONVERT_MANY, json.dumps(tokens), *args], cwd=converter_dir(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, _, _ in CONVERTED:
        model = load_quantized(tmp_path / name)               # the engine's own reading of its checkpoint
        ours = {t[0]: t[3] for t in gguf_writer.model_tensors(model)[0]} if name == "ct-nvfp4" else {}
        with gguf_file.GGUFFile(tmp_path / f"{name}.gguf") as f:
            for module, layer in quantized_linears(model).items():
                key = gguf_writer.gguf_name(module + ".weight")
                info = f.tensors[key]
                if name == "ct-nvfp4":
                    assert info.type_name == "NVFP4" and torch.equal(f.raw(key), ours[key]), key
                    scale = ggml.dequantize(f.raw(key.replace("weight", "scale")), "F32", (1,))
                    assert torch.equal(scale, layer.tensor_scale.reshape(1)), key
                else:
                    assert info.type_name == "F32", key
                    assert torch.equal(ggml.dequantize(f.raw(key), "F32", info.shape), layer.dequantize()), key
