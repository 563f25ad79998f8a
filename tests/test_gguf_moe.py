"""Qwen3-MoE as llama.cpp's `qwen3moe` GGUF: stacked experts written and read back to the same model (dense and in
GGML's block types), each expert its own layer again, and files whose stacks disagree with their metadata refused
in one line. (gguf-py reading the engine's file: tests/test_interop_moe.py.)"""
import dataclasses

import pytest
import torch

from engine.formats.llama_cpp import gguf_tokenizer
from engine.formats.llama_cpp.gguf import load_gguf
from engine.formats.llama_cpp.gguf_file import GGUFFile
from engine.formats.llama_cpp.gguf_writer import model_metadata, model_tensors, write_container, write_gguf
from engine.checkpoints.models import Source
from engine.formats.llama_cpp.ggml import GGMLLinear
from engine.formats.numerics.affine import AffineQuantLinear
from engine.qwen3 import Qwen3, Qwen3MoeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             initializer_range=0.2)


def tiny_moe(**change):
    torch.manual_seed(0)
    return Qwen3(Qwen3MoeConfig(**{**SIZES, **change})).eval()


def ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "moe.gguf"
    write_gguf(tiny_moe(), path)
    return path


@torch.no_grad()
def test_a_qwen3moe_file_reads_back_to_the_same_model(written):
    with GGUFFile(written) as f:
        assert f.metadata["general.architecture"] == "qwen3moe" and f.metadata["qwen3moe.expert_count"] == 4
        assert f.tensors["blk.1.ffn_down_exps.weight"].shape == (4, 64, 32)
        assert f.tensors["blk.1.ffn_gate_inp.weight"].shape == (4, 64)
        assert not any(".experts." in name or "exps.0" in name for name in f.tensors)
    back = load_gguf(written)
    assert dataclasses.replace(back.cfg, initializer_range=0.2) == tiny_moe().cfg   # (GGUF has no initializer)
    assert torch.equal(back(ids()), tiny_moe()(ids()))


def test_a_gguf_source_streams_each_expert_on_its_own(written):
    with Source(written) as source:
        assert source.sizes["model.layers.0.mlp.experts.3.up_proj.weight"] == 32 * 64 * 4
        one = dict(source.tensors(lambda n: n == "model.layers.0.mlp.experts.2.down_proj.weight"))
    assert torch.equal(one["model.layers.0.mlp.experts.2.down_proj.weight"],
                       tiny_moe().model.layers[0].mlp.experts[2].down_proj.weight)


@torch.no_grad()
def test_quantized_experts_are_stacked_in_their_ggml_type_and_read_as_their_own_layers(tmp_path):
    model = tiny_moe()
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                         and n != "lm_head"]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, AffineQuantLinear.from_linear(linear, 4, 32, sym=True))
    report = write_gguf(model, tmp_path / "q.gguf")
    assert report["types"] == {"Q4_0": 2 * (4 + 3 * 4)}
    with GGUFFile(tmp_path / "q.gguf") as f:
        assert f.tensors["blk.0.ffn_up_exps.weight"].type_name == "Q4_0"
        assert f.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"
    back = load_gguf(tmp_path / "q.gguf")
    assert isinstance(back.model.layers[1].mlp.experts[3].down_proj, GGMLLinear)
    assert torch.allclose(back(ids()), model(ids()), atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(mlp_only_layers=(1,)), r"layers \[1\] of this qwen3_moe model are dense .* experts in every layer"),
    (dict(norm_topk_prob=False), r"norm_topk_prob=false: llama.cpp's qwen3moe always renormalizes"),
])
def test_what_llama_cpp_would_run_differently_is_not_written(change, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        write_gguf(tiny_moe(**change), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def tampered(path, meta=None, drop=(), swap=None):
    """The tiny model's file written with metadata changes, tensors dropped or one tensor replaced."""
    model = tiny_moe()
    tensors, _ = model_tensors(model)
    metadata = {**model_metadata(model.cfg), **gguf_tokenizer.byte_tokenizer_metadata(model.cfg), **(meta or {})}
    tensors = [t for t in tensors if t[0] not in drop]
    if swap:
        tensors = [swap(t) if t[0] == "blk.1.ffn_up_exps.weight" else t for t in tensors]
    write_container(path, metadata, tensors)
    return path


@pytest.mark.parametrize("edit, match", [
    (dict(meta={"qwen3moe.expert_count": 5}),
     r"blk\.0\.ffn_gate_inp\.weight is \[4, 64\]; the metadata \(qwen3moe\.expert_count=5, "
     r"expert_feed_forward_length=32, embedding_length=64\) says \[5, 64\]"),
    (dict(meta={"qwen3moe.expert_feed_forward_length": 16}), r"blk\.0\.ffn_gate_exps\.weight is \[4, 32, 64\]"),
    (dict(drop=("blk.1.ffn_down_exps.weight",)), r"blk\.1\.ffn_down_exps\.weight is missing"),
    (dict(swap=lambda t: (t[0], t[1], (3, 32, 64), t[3][:3 * 32 * 64 * 4])), r"blk\.1\.ffn_up_exps\.weight is \[3, 32"),
    (dict(meta={"qwen3moe.expert_used_count": 5}), r"num_experts_per_tok=5 exceeds num_experts=4"),
    (dict(meta={"qwen3moe.expert_count": 0}), r"qwen3moe\.expert_count must be a positive int, got 0"),
])
def test_a_file_whose_stacks_disagree_with_its_metadata_is_refused(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        load_gguf(tampered(tmp_path / "bad.gguf", **edit))
