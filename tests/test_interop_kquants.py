"""llama.cpp itself on the engine's GGML files: its own quantizer (llama_model_quantize of the engine's F32 export,
pure types, IQ4 included) writes the bytes of the engine's round-to-nearest, and it runs the engine's GPTQ K-quant
and IQ4 files as the engine does: greedy continuations equal, KL against the engine's forward of the same file at
llama.cpp's activation-rounding floor (it rounds activations to 8 bits in quantized dot products); the engine reads
llama.cpp's files of every IQ type as llama.cpp runs them, and gives the embedding the type llama-quantize does.
llama.cpp runs in its client venv (benchmarks/clients.py installs it); skipped without it."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from clients import client_python, compare, run_client  # noqa: E402

from engine.formats.llama_cpp import gguf, gguf_file, gguf_writer  # noqa: E402
from engine.formats.llama_cpp import ggml  # noqa: E402
from engine.formats.llama_cpp import gptq_ggml  # noqa: E402
from engine.layers import linear_names, quantized_linears  # noqa: E402
from engine.qwen3 import Qwen3, Qwen3Config  # noqa: E402

PYTHON = client_python("llamacpp", install=False)[0]
pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(PYTHON is None, reason="the llama.cpp client (benchmarks/clients.py installs it)")]

# rows of 256 for six linears, of 288 (a multiple of 32, not of 256) for down_proj: llama.cpp's fallback too
CFG = Qwen3Config(hidden_size=256, intermediate_size=288, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_hidden_layers=2)
FLOOR = 2e-3          # KL llama.cpp vs the engine on the same file; f32 weights give ~1e-9, 8-bit activations ~1e-5


def model(seed=0):
    torch.manual_seed(seed)
    m = Qwen3(CFG).eval()
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(20)                 # peaked next-token distributions: greedy is no coin toss
    return m


def ids(n=4, length=48, seed=1):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def test_llama_cpp_quantizer_writes_the_engines_round_to_nearest(tmp_path):
    dense = model()
    gguf_writer.write_gguf(dense, tmp_path / "f32.gguf")
    for kind in (*ggml.INTEGER, *ggml.IQ4):
        out = tmp_path / f"{kind}.gguf"
        done = run_client(PYTHON, "quantize", tmp_path / "f32.gguf", out, kind, "--pure")[-1]
        assert done.get("status") == 0, done
        with gguf_file.GGUFFile(out) as f:
            for name in linear_names(dense):
                linear = dense.get_submodule(name)
                used = gptq_ggml.ggml_type_for(kind, linear.in_features)
                key = gguf_writer.gguf_name(name + ".weight")
                assert f.tensors[key].type_name == used, (kind, key)
                assert torch.equal(f.raw(key), gptq_ggml.rtn_ggml(linear.weight, used).reshape(-1)), (kind, key)


@pytest.mark.parametrize("kind", [*ggml.K_QUANTS, *ggml.IQ4, "mix"])
def test_llama_cpp_runs_the_engines_gptq_files_as_the_engine_does(tmp_path, kind):
    m = model()
    gptq_ggml.quantize(m, ids(8, 64, seed=2), ggml_type=kind, **({"bpw": 4.0} if kind == "mix" else {}))
    path = tmp_path / "m.gguf"
    gguf_writer.write_gguf(m, path)
    x = ids()
    np.save(tmp_path / "ids.npy", x.numpy())
    np.save(tmp_path / "prompts.npy", x[:, :8].numpy())
    done = run_client(PYTHON, "llamacpp", tmp_path / "ids.npy", tmp_path / "theirs.npy", path,
                      "--greedy", 24, tmp_path / "prompts.npy", tmp_path / "greedy.npy")[-1]
    assert "refused" not in done, done
    loaded = gguf.load_gguf(path)                            # the engine reads the file it wrote
    assert {layer.ggml_type for layer in quantized_linears(loaded).values()} == \
        {layer.ggml_type for layer in quantized_linears(m).values()}
    with torch.no_grad():
        ours = torch.log_softmax(loaded(x).double(), -1)
        greedy = loaded.generate(x[:, :8], 24)[:, 8:].numpy()
    assert compare(ours, np.load(tmp_path / "theirs.npy"))["kl"] < FLOOR
    assert np.array_equal(greedy, np.load(tmp_path / "greedy.npy"))


def test_the_dense_export_runs_in_llama_cpp_at_float32_agreement(tmp_path):
    """The reference point of FLOOR: with no quantized weights llama.cpp computes in float32 throughout."""
    gguf_writer.write_gguf(model(), tmp_path / "f32.gguf")
    x = ids()
    np.save(tmp_path / "ids.npy", x.numpy())
    done = run_client(PYTHON, "llamacpp", tmp_path / "ids.npy", tmp_path / "theirs.npy", tmp_path / "f32.gguf")[-1]
    assert "refused" not in done, done
    with torch.no_grad():
        ours = torch.log_softmax(gguf.load_gguf(tmp_path / "f32.gguf")(x).double(), -1)
    assert compare(ours, np.load(tmp_path / "theirs.npy"))["kl"] < 1e-6



@pytest.mark.parametrize("ftype,kind", [(t, t) for t in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S",
                                                         "IQ4_NL", "IQ4_XS")] + [("IQ2_M", "IQ2_S")])
def test_the_engine_reads_llama_cpps_iq_files_as_llama_cpp_runs_them(tmp_path, ftype, kind):
    """llama-quantize --pure --imatrix of an F32 file into each IQ type (its IQ2_M file type is made of IQ2_S): the
    engine's layers hold exactly gguf-py's dequantized weights, and its forward agrees with llama.cpp's run."""
    import frontier
    dense = model()
    gguf_writer.write_gguf(dense, tmp_path / "f32.gguf")
    frontier.write_imatrix(frontier.importance(dense, ids(8, 64, seed=2)), tmp_path / "imatrix.gguf", 8, 64)
    path = tmp_path / f"{kind}.gguf"
    done = run_client(PYTHON, "quantize", tmp_path / "f32.gguf", path, ftype, "--pure",
                      "--imatrix", tmp_path / "imatrix.gguf")[-1]
    assert done.get("status") == 0, done
    loaded = gguf.load_gguf(path)
    gg = pytest.importorskip("gguf")
    with gguf_file.GGUFFile(path) as f:
        types = set()
        for name, layer in quantized_linears(loaded).items():
            info = f.tensors[gguf_writer.gguf_name(name + ".weight")]
            theirs = gg.quants.dequantize(f.raw(info.name).numpy(), gg.GGMLQuantizationType[info.type_name])
            theirs = torch.from_numpy(np.array(theirs)).reshape(layer.out_features, -1)
            assert torch.equal(layer.dequantize(), theirs), name
            types.add(info.type_name)
    assert kind in types
    x = ids()
    np.save(tmp_path / "ids.npy", x.numpy())
    done = run_client(PYTHON, "llamacpp", tmp_path / "ids.npy", tmp_path / "theirs.npy", path)[-1]
    assert "refused" not in done, done
    with torch.no_grad():
        ours = torch.log_softmax(loaded(x).double(), -1)
    assert compare(ours, np.load(tmp_path / "theirs.npy"))["kl"] < FLOOR


@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS", "Q8_0"])
def test_embedding_types_are_the_ones_llama_quantize_chooses(tmp_path, ftype):
    from collections import Counter
    gguf_writer.write_gguf(model(), tmp_path / "f32.gguf")
    done = run_client(PYTHON, "quantize", tmp_path / "f32.gguf", tmp_path / "q.gguf", ftype, "--own-embedding")[-1]
    assert done.get("status") == 0, done
    with gguf_file.GGUFFile(tmp_path / "q.gguf") as f:
        linears = Counter(i.type_name for n, i in f.tensors.items() if n.startswith("blk.") and len(i.shape) == 2)
        assert f.tensors["token_embd.weight"].type_name == \
            gguf_writer.embedding_types(linears, CFG.hidden_size, tied=True)[0], linears
