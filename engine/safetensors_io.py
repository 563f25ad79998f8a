""".safetensors checkpoints through the `safetensors` library, and the little it leaves to a loader.

The library reads and writes the files: `safe_open` validates a file's header in Rust (fuzzed upstream: the JSON,
every dtype and shape, offsets that fit the file, cover its data section exactly and never overlap, a header under
100 MB) and memory-maps it, so that a tensor's bytes are read only when it is asked for and its pages are dropped
when the tensor and the file are closed; `save_file` writes tensors straight from their memory. A file is

    8 bytes: N (little-endian u64)   N bytes: JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"}
    then the tensors' bytes, each at data_offsets within the data section

The engine keeps what the library does not do:
  - confinement: a file is opened only if it is a regular file whose real path stays inside the checkpoint folder
    (or, for a Hugging Face cache snapshot, inside its repository's blobs/), never a FIFO or a device;
  - the sharded index (model.safetensors.index.json), whose shards are checked and read in order;
  - integrity: safetensors has no checksum, so every file the engine writes records its writer and a SHA-256 per
    tensor in its metadata, verified as each tensor arrives (verify=False skips it): a flipped bit is a ValueError;
  - atomic writes: a temporary file in the target folder, fsynced, renamed into place (whole checkpoint folders are
    swapped into place, and output files written under a lock, by safe_writes.py);
  - errors as a ValueError naming the file (the library raises its own SafetensorError).
A loader reads every tensor's name, dtype and shape from the headers (tensor_specs) and checks them against
config.json before it reads a byte of weights, so a stray tensor declared a terabyte long is refused from its header.
"""
import contextlib
import hashlib
import json
import os
import re
import stat
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as library_save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
WRITER = "engine"
MAX_JSON_BYTES = 64 << 20                # config.json, the shard index, tokenizer.json
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


# ---- opening files safely ---------------------------------------------------------------------------------------

def _allowed_roots(directory):
    root = Path(directory).resolve()
    roots = [root]
    if root.parent.name == "snapshots":                 # a Hugging Face cache: snapshots/<rev>/f -> ../../blobs/<h>
        roots.append(root.parent.parent / "blobs")
    return roots


def checked_file(directory, name, max_bytes=None):
    """The path of `name` in `directory` if it is a regular file whose real path stays inside the folder, and (with
    max_bytes) not larger than that; ValueError naming the file otherwise. Never follows a FIFO, a device or a
    folder."""
    path = Path(directory) / name
    if not path.exists() and not path.is_symlink():
        raise ValueError(f"no {name} in {directory}")
    real = path.resolve()
    if not any(real == r or r in real.parents for r in _allowed_roots(directory)):
        raise ValueError(f"{path} is a link to {real}, outside the checkpoint folder")
    try:
        info = os.stat(real)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{path} is {info.st_size} bytes, more than the {max_bytes} such a file may hold")
    return real


def read_json(directory, name):
    """A bounded, checked JSON object file (config.json, the shard index): ValueError naming the file otherwise."""
    path = checked_file(directory, name, MAX_JSON_BYTES)
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{Path(directory) / name} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{Path(directory) / name} is nested too deeply to be a config") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{Path(directory) / name} must hold a JSON object")
    return raw


# ---- headers ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def opened(path):
    """`with opened(path) as f:` the library's safe_open, its errors a ValueError naming the file (a file it cannot
    map, say one that declares a terabyte, included)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path} is not a valid safetensors file: {e}") from None
    except (MemoryError, RuntimeError) as e:         # the library maps the whole file before it reads the header
        if isinstance(e, RuntimeError) and "mmap" not in str(e):
            raise
        raise ValueError(f"{path}: cannot map its {os.path.getsize(path)} bytes into memory ({e})") from None


def read_header(path):
    """({name: (dtype, shape)}, metadata {str: str}) of a safetensors file, from its header alone (the library checks
    it against the file's size); ValueError naming the file otherwise."""
    with opened(path) as f:
        specs = {}
        for name in f.keys():
            part = f.get_slice(name)
            specs[name] = (part.get_dtype(), tuple(part.get_shape()))
        return specs, dict(f.metadata() or {})


def checkpoint_files(directory):
    """The safetensors files of a checkpoint folder, in shard order (each checked by checked_file)."""
    directory = Path(directory)
    if (directory / INDEX).exists() or (directory / INDEX).is_symlink():
        try:
            weight_map = read_json(directory, INDEX)["weight_map"]
        except KeyError:
            raise ValueError(f"{directory / INDEX} is not a valid shard index: no weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f and Path(f).name == f
                                                       for f in weight_map.values()):
            raise ValueError(f"{directory / INDEX}: weight_map must map tensor names to file names in the folder")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise ValueError(f"shards listed in {INDEX} are missing: {missing}")
        return [checked_file(directory, f) for f in files]
    if (directory / SINGLE).exists() or (directory / SINGLE).is_symlink():
        return [checked_file(directory, SINGLE)]
    raise ValueError(f"no {SINGLE} or {INDEX} in {directory}")


def check_records(records):
    """records (None: none) -> a dict of "engine.*" provenance strings; ValueError for anything else."""
    records = dict(records or {})
    if not all(isinstance(k, str) and k.startswith("engine.") and isinstance(v, str) for k, v in records.items()):
        raise ValueError(f"records must map 'engine.*' names to strings, got {records!r}")
    return records


def checkpoint_records(directory):
    """What the engine's writer recorded about a checkpoint as a whole ("engine.*" entries: the digest of its
    quantization_config, of the model it came from): in the shard index's metadata for a sharded checkpoint, in
    the file's header metadata otherwise. {} for checkpoints other tools wrote."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        meta = read_json(directory, INDEX).get("metadata") or {}
    else:
        meta = read_header(checkpoint_files(directory)[0])[1]
    return {k: v for k, v in meta.items() if isinstance(k, str) and k.startswith("engine.") and isinstance(v, str)}


def tensor_specs(directory):
    """{name: (dtype, shape)} of every tensor in the checkpoint, from the headers alone (no tensor is read);
    ValueError if a name appears in two shards."""
    specs = {}
    for path in checkpoint_files(directory):
        found = read_header(path)[0]
        twice = sorted(set(found) & set(specs))
        if twice:
            raise ValueError(f"tensor {twice[0]} appears in more than one shard ({path.name})")
        specs.update(found)
    return specs


# ---- streaming tensors, digests ---------------------------------------------------------------------------------

def tensor_digest(t):
    """SHA-256 (hex) of a tensor's bytes in its own dtype."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def float_digest(t, chunk=1 << 22):
    """SHA-256 (hex) of a floating-point tensor's values as float32 bytes, cast a chunk at a time (no float32 copy
    of a large embedding table): what provenance digests use, so that a lossless bf16 -> f32 load changes nothing."""
    digest, flat = hashlib.sha256(), t.detach().contiguous().cpu().reshape(-1)
    for start in range(0, flat.numel(), chunk):
        digest.update(flat[start:start + chunk].float().numpy())
    return digest.hexdigest()


def recorded_digests(path, metadata):
    """{tensor name: SHA-256} that the engine recorded in a file's metadata ({} for another writer's file)."""
    try:
        digests = json.loads(metadata.get("engine.sha256", "{}"))
    except (json.JSONDecodeError, RecursionError):
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise ValueError(f"{path}: its engine.sha256 metadata is not a map of tensor names to digests (the file is "
                         "corrupted)")
    return digests


class TensorReader:
    """The tensors of a checkpoint (a folder, or one safetensors file), `specs` {name: (dtype, shape)} from the
    headers, read one at a time: each read opens its file
    (the header is parsed again, a fraction of a millisecond), memory-maps it and returns the tensor, whose pages
    go when the tensor does, so a long conversion keeps one tensor resident, not every one it has read. read(name)
    checks the tensor against the SHA-256 its writer recorded (if the engine wrote it, unless verify=False)."""

    def __init__(self, path, verify=True):
        self.where, self.specs, self.digests = {}, {}, {}
        for file in [Path(path)] if Path(path).is_file() else checkpoint_files(path):
            specs, metadata = read_header(file)
            twice = sorted(set(specs) & set(self.where))
            if twice:
                raise ValueError(f"tensor {twice[0]} appears in more than one shard ({file.name})")
            self.where.update(dict.fromkeys(specs, file))
            self.specs.update(specs)
            if verify:
                self.digests.update(recorded_digests(file, metadata))

    def names(self):
        return list(self.where)

    def read(self, name):
        path = self.where[name]
        with opened(path) as f:
            tensor = f.get_tensor(name)
        if name in self.digests and tensor_digest(tensor) != self.digests[name]:
            raise ValueError(f"{path.name}: tensor {name} does not match its recorded SHA-256 (the file is corrupted)")
        return tensor


def snapshot_tensors(directory, verify=True):
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time, shard by shard. Files written by the
    engine carry a SHA-256 per tensor, checked here unless verify=False: a flipped bit is a ValueError, never another
    model."""
    reader = TensorReader(directory, verify)
    for name in reader.names():
        yield name, reader.read(name)


def engine_metadata(tensors, metadata=None):
    """The metadata the engine writes into every safetensors file: its writer, a SHA-256 per tensor, and the
    caller's own entries."""
    return {"format": "pt", "engine.writer": WRITER, **(metadata or {}),
            "engine.sha256": json.dumps({name: tensor_digest(t) for name, t in tensors.items()}, sort_keys=True)}


# ---- writing ----------------------------------------------------------------------------------------------------

def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path, commit=None):
    """`with atomic_path(path) as tmp:` what is written to the file `tmp` (in the same folder) is fsynced, given the
    umask's mode and renamed to `path` when the block ends (by commit(tmp, path); None: os.replace, which replaces
    what is there); removed if it raises."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        (commit or os.replace)(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_file(path, commit=None):
    """`with atomic_file(path) as f:` writes a binary file atomically (atomic_path), f open for writing."""
    with atomic_path(path, commit) as tmp, open(tmp, "wb") as f:
        yield f


def save_file(tensors, path, metadata=None):
    """Write tensors to a safetensors file with the library, atomically (atomic_path), with the engine's metadata
    (writer, per-tensor SHA-256). The library's I/O errors (a full disk ...) are raised as the OSError they wrap, as
    any other write's are."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        try:
            library_save_file(tensors, tmp, metadata=engine_metadata(tensors, metadata))
        except SafetensorError as e:             # "... I/O error: No space left on device (os error 28)"
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
        with open(tmp, "rb+") as f:
            _sort_metadata(f)


def _sort_metadata(f):
    """Put the header's __metadata__ entries in sorted order, in place. The library writes them in a random order
    per process (safetensors issue #584), so the same checkpoint written twice would differ in its bytes, and a
    resumed conversion could not be checked byte for byte against an uninterrupted one. The same entries in another
    order take the same bytes, so the data section does not move."""
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:
        raise ValueError(f"safetensors header of {n} bytes rewritten as {len(text)}: not the library's format")
    f.seek(8)
    f.write(text + b" " * (n - len(text)))


def nbytes(tensors):
    """Bytes the tensors {name: tensor} take in a safetensors file (its header aside)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_json(path, obj):
    """A JSON file written atomically (temporary file, fsync, rename), mode from the umask."""
    with atomic_file(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode())
