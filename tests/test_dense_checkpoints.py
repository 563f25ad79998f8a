"""Dense HF-layout checkpoints: exact round trip, sharded reading, and a clear error for every kind of bad input."""
import json
import os

import pytest
import torch

from engine.loaders import all_finite, load_dense, read_config, save_dense
from engine.safetensors_io import save_file, snapshot_tensors
from helpers import rewrite_tensors


@pytest.fixture
def saved(tiny_model, tmp_path):
    save_dense(tiny_model, tmp_path / "ck")
    return tmp_path / "ck"


def test_save_load_gives_identical_logits(tiny_model, saved):
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_dense(saved)(ids), tiny_model(ids))


def test_tied_lm_head_is_not_stored(saved):
    names = {n for n, _ in snapshot_tensors(saved)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_sharded_checkpoint_streams_every_tensor(saved, tmp_path):
    tensors = dict(snapshot_tensors(saved))
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((saved / "config.json").read_text())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, shard_dir / file)
    (shard_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
    reloaded = dict(snapshot_tensors(shard_dir))
    assert sorted(reloaded) == names and all(torch.equal(reloaded[n], tensors[n]) for n in names)
    assert torch.equal(load_dense(shard_dir).model.norm.weight, tensors["model.norm.weight"])


def test_missing_tensor(saved):
    rewrite_tensors(saved, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="lacks tensor.*mlp.up_proj"):
        load_dense(saved)


def test_unexpected_tensor(saved):
    rewrite_tensors(saved, lambda t: t.update({"model.layers.0.surprise": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.surprise"):
        load_dense(saved)


def test_wrong_shape(saved):
    rewrite_tensors(saved, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(3,\)"):
        load_dense(saved)


def test_integer_tensor_for_a_float_parameter(saved):
    rewrite_tensors(saved, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="dtype"):
        load_dense(saved)


def test_missing_config_key(saved):
    raw = read_config(saved)
    del raw["num_attention_heads"]
    (saved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_dense(saved)


def test_malformed_config(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_dense(saved)


def test_not_a_safetensors_file(saved):
    (saved / "model.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 10)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_dense(saved)


def test_truncated_safetensors_file(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_dense(saved)


def test_no_weights_at_all(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_dense(saved)


@pytest.mark.interop
def test_the_safetensors_library_reads_our_files_and_we_read_its(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {"a.weight": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4).to(torch.float8_e4m3fn), "d": torch.zeros(0, 2), "e": torch.tensor([True, False])}
    save_file(tensors, tmp_path / "ours.safetensors", {"note": "x"})
    theirs = safetensors.load_file(tmp_path / "ours.safetensors")
    assert set(theirs) == set(tensors) and all(torch.equal(theirs[k].view(torch.uint8), tensors[k].view(torch.uint8))
                                               for k in tensors if tensors[k].numel())
    safetensors.save_file(tensors, tmp_path / "theirs.safetensors")
    ours = dict(snapshot_tensors(_single(tmp_path / "theirs.safetensors")))
    assert all(ours[k].dtype == tensors[k].dtype and ours[k].shape == tensors[k].shape for k in tensors)
    assert all(torch.equal(ours[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors if tensors[k].numel())


def _single(path):
    """A folder holding `path` as its model.safetensors."""
    folder = path.parent / path.stem
    folder.mkdir()
    path.rename(folder / "model.safetensors")
    return folder


def test_bytes_no_tensor_covers_are_refused(saved):
    """safetensors' rule (no holes, nothing after the last tensor: no polyglot files), checked from the header
    alone: here a 1 TiB sparse tail."""
    os.truncate(saved / "model.safetensors", 1 << 40)
    with pytest.raises(ValueError, match=r"not a valid safetensors file: .*not fully covered"):
        load_dense(saved)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused(saved, value):
    rewrite_tensors(saved, lambda t: t["model.norm.weight"].__setitem__(3, value))
    with pytest.raises(ValueError, match="model.norm.weight: checkpoint tensor holds NaN or infinite values"):
        load_dense(saved)


@pytest.mark.parametrize("at", [0, 9, 10])
def test_finiteness_is_checked_chunk_by_chunk_to_the_last_value(at):
    t = torch.ones(2, 5, dtype=torch.bfloat16)
    assert all_finite(t, chunk=3)
    if at < t.numel():
        t.view(-1)[at] = float("nan")
    assert all_finite(t, chunk=3) == (at == t.numel())


def test_a_corrupted_digest_map_is_refused(saved):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["engine.sha256"] = header["__metadata__"]["engine.sha256"][:-5]   # no longer JSON
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n:])
    with pytest.raises(ValueError, match="engine.sha256 metadata is not a map of tensor names to digests"):
        load_dense(saved)


def test_a_stray_tensor_declared_a_terabyte_is_refused_from_its_header(saved):
    """The tensor is sparse on disk (1 TiB declared, nothing stored): refused before it is read, so no MemoryError
    and no time spent; red when the loader reads every tensor first and refuses names afterwards."""
    from fuzz_checkpoints import append_sparse_tensor
    append_sparse_tensor(saved / "model.safetensors", "model.stray_huge", 1 << 40)
    assert (saved / "model.safetensors").stat().st_size > 1 << 40
    # the header names it (unexpected tensor), or mapping a terabyte is refused first where memory is not overcommitted
    with pytest.raises(ValueError, match=r"unexpected tensor model.stray_huge \(F32 \[274877906944\]\)|cannot map"):
        load_dense(saved)


def test_the_same_tensors_written_twice_are_the_same_bytes(tmp_path):
    """Two processes write the same checkpoint: the same bytes (the library alone orders the header's metadata at
    random per process, safetensors issue #584; save_file sorts it), which is what lets a resumed conversion be
    compared byte for byte with an uninterrupted one."""
    import subprocess
    import sys
    script = ("import sys, torch; from engine.safetensors_io import save_file; "
              "save_file({'b': torch.arange(6.0), 'a': torch.ones(2, 3, dtype=torch.float16)}, sys.argv[1], "
              "{'engine.x': '1', 'engine.y': '2', 'engine.z': '3'})")
    for name in ("one", "two", "three"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], check=True)
    assert (tmp_path / "one").read_bytes() == (tmp_path / "two").read_bytes() == (tmp_path / "three").read_bytes()
    from safetensors import safe_open
    with safe_open(str(tmp_path / "one"), "pt") as f:
        assert f.metadata()["engine.y"] == "2" and torch.equal(f.get_tensor("b"), torch.arange(6.0))
