"""Reading and writing safetensors checkpoints without surprises.

`snapshot_tensors(directory)` streams (name, tensor) pairs one at a time through `safetensors.safe_open`, from
`model.safetensors` or from the shards listed in `model.safetensors.index.json`, so a loader can build each layer as
soon as its parts have arrived instead of holding the whole checkpoint twice. Any file that is not valid
safetensors (truncated, another format under the same name) raises ValueError naming it.

`save_file` writes to a temporary file in the same folder and renames it into place, and `atomic_directory` does the
same for a whole checkpoint folder: an interrupted save never leaves a half-written checkpoint behind.
"""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import safetensors
import safetensors.torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_files(directory):
    """The safetensors files of a checkpoint folder, in shard order."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{directory / INDEX} is not a valid shard index: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and Path(f).name == f
                                                       for f in weight_map.values()):
            raise ValueError(f"{directory / INDEX}: weight_map must map tensor names to file names in the folder")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise ValueError(f"shards listed in {INDEX} are missing: {missing}")
        return [directory / f for f in files]
    if (directory / SINGLE).exists():
        return [directory / SINGLE]
    raise ValueError(f"no {SINGLE} or {INDEX} in {directory}")


def snapshot_tensors(directory):
    """Yield (name, tensor) for every tensor of the checkpoint, reading one tensor at a time."""
    seen = set()
    for path in checkpoint_files(directory):
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    if name in seen:
                        raise ValueError(f"tensor {name} appears in more than one shard ({path.name})")
                    seen.add(name)
                    yield name, f.get_tensor(name)
        except safetensors.SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from None


def save_file(tensors, path, metadata=None):
    """safetensors.torch.save_file, but atomic: a temporary file in the same folder, then a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(directory):
    """Write a checkpoint folder atomically: yields a temporary sibling folder; on success it replaces `directory`
    (an older checkpoint there is removed only after the new one is complete); on any error it is deleted."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{os.getpid()}"
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
