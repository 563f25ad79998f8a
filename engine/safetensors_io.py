"""Reading and writing safetensors checkpoints without surprises.

Reading. A checkpoint folder holds config.json and model.safetensors (or the shards model.safetensors.index.json
lists). A file is opened only if it is a regular file whose real path stays inside the folder (or, for a Hugging Face
cache snapshot, inside its repository's blobs/), and its size is bounded before it is read. A safetensors file is

    8 bytes: N (little-endian u64)   N bytes: JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"}
    then the tensors' bytes, each at data_offsets within the data section

`read_header` parses and checks that header by hand (every shape, dtype and offset against the file's size), so a
loader knows every tensor's name, dtype and shape, and can check them against config.json, before it allocates
anything. `TensorReader` then reads tensors one at a time at those offsets with plain file reads (no memory map, so
a long conversion does not keep every tensor it has read resident), and `snapshot_tensors` streams them all.

Integrity. safetensors has no checksum. Every file the engine writes records its writer and a SHA-256 per tensor in
the header's metadata; `snapshot_tensors` verifies each tensor as it arrives (verify=False skips it).

Writing. `save_file` writes a temporary file in the target folder, each tensor's bytes straight from memory, fsyncs
it and renames it into place.
Whole checkpoint folders are swapped into place by safe_writes.py.
"""
import contextlib
import hashlib
import json
import os
import stat
import struct
import tempfile
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
WRITER = "engine"
MAX_JSON_BYTES = 64 << 20                # config.json, the shard index, tokenizer.json
MAX_HEADER_BYTES = 100 << 20             # the limit safetensors itself enforces
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

def read_header(path):
    """({name: (dtype, shape)}, metadata {str: str}, {name: (begin, end)} absolute byte positions) of a safetensors
    file, every entry checked against the file's size: known dtype, non-negative integer dims, offsets inside the data
    section that hold exactly dtype x shape bytes and do not overlap. ValueError naming the file and the tensor
    otherwise."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a valid safetensors file: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path} is not a valid safetensors file: header length {n} for a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{path} is not a valid safetensors file: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a valid safetensors file: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path} is not a valid safetensors file: __metadata__ must map strings to strings")
    data, specs, spans = size - 8 - n, {}, []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = dtype in DTYPE_BYTES and isinstance(shape, list) and all(
                type(d) is int and d >= 0 for d in shape) and type(begin) is int and type(end) is int
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path} is not a valid safetensors file: tensor {name!r} has a malformed header entry "
                             f"{entry!r}"[:400])
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data or end - begin != numel * DTYPE_BYTES[dtype]:
            raise ValueError(f"{path} is not a valid safetensors file: tensor {name!r} ({dtype} {shape}) does not fit "
                             f"its offsets [{begin}, {end}) in a {data}-byte data section")
        specs[name] = (dtype, tuple(shape))
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{path} is not a valid safetensors file: tensors {a!r} and {b!r} overlap")
    # safetensors' rule against polyglot files: the tensors cover the data section exactly, no holes, nothing after
    covered = sum(end - begin for begin, end, _ in spans)
    if covered != data:
        raise ValueError(f"{path} is not a valid safetensors file: its tensors cover {covered} bytes of a "
                         f"{data}-byte data section")
    return specs, metadata, {name: (8 + n + begin, 8 + n + end) for begin, end, name in spans}


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


TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "E8M0": torch.float8_e8m0fnu, "I16": torch.int16, "U16": torch.uint16,
                "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


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
    """The tensors of a checkpoint (a folder, or one safetensors file), read one at a time with plain file reads at
    the offsets read_header checked (no memory map: a converter's resident memory stays one tensor, not the pages of
    every tensor it has read). read(name) returns the tensor, checked against the SHA-256 its writer recorded (if
    the engine wrote it, unless verify=False)."""

    def __init__(self, path, verify=True):
        self.where, self.digests = {}, {}
        for file in [Path(path)] if Path(path).is_file() else checkpoint_files(path):
            specs, metadata, spans = read_header(file)
            twice = sorted(set(specs) & set(self.where))
            if twice:
                raise ValueError(f"tensor {twice[0]} appears in more than one shard ({file.name})")
            self.where.update({name: (file, specs[name], spans[name]) for name in specs})
            if verify:
                self.digests.update(recorded_digests(file, metadata))

    def names(self):
        return list(self.where)

    def read(self, name):
        path, (dtype, shape), (begin, end) = self.where[name]
        data = bytearray(end - begin)                   # read into one buffer: f.read() + bytearray() would be two
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            view, got = memoryview(data), 0
            while got < len(data) and (n := f.readinto(view[got:])):
                got += n
        if got != end - begin:
            raise ValueError(f"{path} is not a valid safetensors file: {name} is cut short (the file shrank)")
        tensor = (torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]) if data else
                  torch.empty(0, dtype=TORCH_DTYPES[dtype])).reshape(shape)
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
def atomic_file(path):
    """`with atomic_file(path) as f:` writes a binary file atomically: f is a temporary file in the same folder,
    fsynced, given the umask's mode and renamed to `path` when the block ends; removed if it raises."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_file(tensors, path, metadata=None):
    """Write tensors to a safetensors file atomically (a temporary file in the same folder, fsynced, renamed into
    place), with the engine's metadata (writer, per-tensor SHA-256). Each tensor's bytes go straight from its
    memory to the file (no serialized copy of the whole file); tensors are laid out largest element first, so that
    every one starts at a multiple of its element size. The file's mode follows the umask."""
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {"__metadata__": engine_metadata(tensors, metadata)}, 0
    for name in order:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in order:
            if tensors[name].numel():
                f.write(memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy()))


def nbytes(tensors):
    """Bytes the tensors {name: tensor} take in a safetensors file (its header aside)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_json(path, obj):
    """A JSON file written atomically (temporary file, fsync, rename), mode from the umask."""
    with atomic_file(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode())
