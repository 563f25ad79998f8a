"""GGUF, llama.cpp's single-file checkpoint, as a container: its header, metadata and tensor table parsed and
checked, each tensor's bytes read on demand (engine/checkpoints/gguf.py makes them the engine's model).

Container (little-endian, versions 2 and 3; strings are a u64 byte length + UTF-8):

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x   key string, u32 value type, value       (types 0-12: u8 i8 u16 i16 u32 i32 f32 bool string
                                                           array u64 i64 f64; an array is u32 type, u64 n, n values)
    tensor_count x   name string, u32 n_dims, n_dims x u64 ne (ne[0] = row length), u32 GGML type, u64 offset
    padding to `general.alignment` (default 32), then the data: each tensor at data_start + offset (aligned)

Every count, length, dimension and offset is checked against the file size before anything is allocated, so a
malformed file is a ValueError; tensor bytes are read one tensor at a time. Tensors may neither overlap nor leave
more than the alignment's padding between them: each one's span is what its type and shape say it holds.

Integrity: GGUF has no checksum. The engine's writer records, in the metadata array `engine.tensor_sha256`, one
entry per tensor in table order: "name type shape sha256" (shape in torch order, e.g. 576x1536; the SHA-256 of the
tensor's stored bytes). When the key is present every entry must describe its tensor and every tensor read must
match its digest, so a changed type, shape or offset, or a flipped bit, is a ValueError; files from other tools
have no such key and load as before. llama.cpp's quantizer copies every metadata key of its input into the file it
writes, its own tensors and `general.file_type` with them: so the writer also records the file type it wrote
(`engine.file_type`), and where the two differ the digests describe the input, not this file, and are not used.
The metadata itself (the architecture, head counts, RoPE, the tokenizer: what turns the bytes into a model) is
covered by `engine.metadata_sha256`, the SHA-256 of every other key-value entry as stored, in order.
"""
import hashlib
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats.llama_cpp.ggml import GGML_TYPES, TYPE_NAMES

MAGIC, DEFAULT_ALIGNMENT, MAX_NESTING = b"GGUF", 32, 8
DIGESTS, DIGESTS_FILE_TYPE, METADATA_DIGEST = "engine.tensor_sha256", "engine.file_type", "engine.metadata_sha256"
MAX_HEADER_BYTES = 256 << 20        # metadata + tensor table: a few MB in real files (the vocabulary is the most)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


# ---- the container ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str           # a GGML type name, e.g. "Q4_K"
    shape: tuple             # torch order: (out, in) for a linear
    offset: int              # absolute position in the file
    nbytes: int


def _shortest_f32(x):
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if abs(candidate) <= 3.4028234e38 and struct.pack("<f", candidate) == struct.pack("<f", x):
            return candidate
    return x                                            # NaN, infinities


class _Cursor:
    """Reads from a buffer, checking every length against what is left before using it."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n, what):
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF: {what} ({n} bytes at {self.pos}) runs past the end of the file ({len(self.buf)})")
        self.pos += n
        return self.pos - n

    def scalar(self, fmt, what):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what):
        n = self.scalar("Q", what)
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"GGUF: {what} is not valid UTF-8") from None

    def value(self, kind, what, depth=0):
        if kind in SCALARS:
            v = self.scalar(SCALARS[kind], what)
            return _shortest_f32(v) if kind == 6 else v
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise ValueError(f"GGUF: {what} has unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise ValueError(f"GGUF: {what} nests arrays more than {MAX_NESTING} deep")
        item, n = self.scalar("I", what), self.scalar("Q", what)
        if item in SCALARS:                            # one bulk read; raw float32 (scores) stay as they are
            fmt = SCALARS[item]
            return list(struct.unpack_from(f"<{n}{fmt}", self.buf, self.take(n * struct.calcsize(fmt), what)))
        if item not in (STRING, ARRAY):
            raise ValueError(f"GGUF: {what} is an array of unknown value type {item}")
        smallest = 8 if item == STRING else 12          # a length, or an element type + a count
        if n * smallest > len(self.buf) - self.pos:
            raise ValueError(f"GGUF: {what} claims {n} elements, more than the file can hold")
        return [self.value(item, what, depth + 1) for _ in range(n)]


class GGUFFile:
    """A GGUF file: `version`, `metadata` {key: value}, `tensors` {name: TensorInfo}; `raw(name)` reads one
    tensor's bytes. Use as a context manager (the file stays open for the reads)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():                   # checked before open(): opening a FIFO would block
            raise ValueError(f"{path} is not a regular file")
        self._file = open(self.path, "rb", buffering=0)
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise ValueError(f"{path} is too short to be a GGUF file")
            # only the header is parsed from memory (a map of the whole file would take its size in address space)
            with mmap.mmap(self._file.fileno(), min(size, MAX_HEADER_BYTES), access=mmap.ACCESS_READ) as buf:
                self._parse(_Cursor(buf), size)
        except BaseException:
            self._file.close()
            raise

    def _parse(self, cur, size):
        if cur.buf[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {cur.buf[:4]!r})")
        cur.take(4, "magic")
        self.version = cur.scalar("I", "version")
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            raise ValueError(f"GGUF version {self.version} is not supported (2 and 3 are)"
                             + (": this is a big-endian file" if swapped in (1, 2, 3) else ""))
        n_tensors, n_kv = cur.scalar("Q", "tensor count"), cur.scalar("Q", "metadata count")
        header = len(cur.buf)                           # the smallest key/value and tensor entry take 13 and 32 bytes
        if n_kv * 13 > header or n_tensors * 32 > header:
            raise ValueError(f"GGUF: {n_kv} metadata entries and {n_tensors} tensors cannot fit in {header} bytes")
        self.metadata, spans = {}, {}
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string("metadata key")
            if key in self.metadata:
                raise ValueError(f"GGUF: metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(cur.scalar("I", key), key)
            spans[key] = (start, cur.pos)                                # as stored: what METADATA_DIGEST covers
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"GGUF: general.alignment must be a power of two, got {self.alignment!r}")
        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.scalar("I", name)
            if not 1 <= n_dims <= 4:
                raise ValueError(f"GGUF: tensor {name} has {n_dims} dimensions (1 to 4 allowed)")
            ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.take(8 * n_dims, name))
            type_id, offset = cur.scalar("I", name), cur.scalar("Q", name)
            infos.append((name, ne, type_id, offset))
        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = {}
        for name, ne, type_id, offset in infos:
            if type_id not in TYPE_NAMES:
                raise ValueError(f"GGUF: tensor {name} has unknown GGML type {type_id}")
            type_name = TYPE_NAMES[type_id]
            _, block, block_bytes = GGML_TYPES[type_name]
            if min(ne) < 1 or ne[0] % block:
                raise ValueError(f"GGUF: tensor {name} has dimensions {list(ne)} ({type_name} rows are whole "
                                 f"blocks of {block})")
            nbytes = math.prod(ne[1:]) * ne[0] // block * block_bytes
            if offset % self.alignment or data_start + offset + nbytes > size:
                raise ValueError(f"GGUF: tensor {name} ({nbytes} bytes at offset {offset}) is misaligned or runs "
                                 f"past the end of the file")
            if name in self.tensors:
                raise ValueError(f"GGUF: tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, type_name, tuple(reversed(ne)), data_start + offset, nbytes)
        self._check_spans()
        self.digests = self._recorded_digests(cur.buf, spans)

    def _check_spans(self):
        """No two tensors overlap, and none is followed by more than padding: each span holds exactly what its
        type and shape say (a changed type or offset shows here even where no digest was recorded)."""
        spans = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if b.offset < a.offset + a.nbytes:
                raise ValueError(f"GGUF: tensors {a.name} and {b.name} overlap")
            if b.offset - a.offset - a.nbytes >= self.alignment:
                raise ValueError(f"GGUF: tensor {a.name} ({a.type_name} {list(a.shape)}: {a.nbytes} bytes) does not "
                                 f"fill the {b.offset - a.offset} bytes before the next tensor ({b.name})")

    def _recorded_digests(self, buf, spans):
        """{tensor name: SHA-256} recorded by the engine's writer ({} for another tool's file), each entry checked
        against the tensor table; and the metadata entries (spans {key: (start, end)} in buf) against theirs."""
        entries = self.metadata.get(DIGESTS)
        written = self.metadata.get(DIGESTS_FILE_TYPE, self.metadata.get("general.file_type"))
        if entries is None or written != self.metadata.get("general.file_type"):      # requantized by llama.cpp
            return {}
        if not isinstance(entries, list) or len(entries) != len(self.tensors):
            raise ValueError(f"GGUF: {DIGESTS} must hold one entry per tensor ({len(self.tensors)})")
        recorded = self.metadata.get(METADATA_DIGEST)
        if recorded is not None:                        # (files written before it was recorded have none)
            covered = hashlib.sha256()
            for key, (start, end) in spans.items():
                if key not in (DIGESTS, DIGESTS_FILE_TYPE, METADATA_DIGEST):
                    covered.update(buf[start:end])
            if covered.hexdigest() != recorded:
                raise ValueError(f"GGUF: the metadata of {self.path} is not what its writer recorded "
                                 f"({METADATA_DIGEST} differs): the file was changed")
        digests = {}
        for entry, info in zip(entries, self.tensors.values()):
            described = f"{info.name} {info.type_name} {'x'.join(map(str, info.shape))}"
            if not isinstance(entry, str) or entry.rpartition(" ")[0] != described:
                raise ValueError(f"GGUF: tensor {described} is not the one its writer recorded ({str(entry)[:120]}): "
                                 "the file was changed")
            digests[info.name] = entry.rpartition(" ")[2]
        return digests

    def raw(self, name):
        """The stored bytes of one tensor, uint8 [nbytes]."""
        info = self.tensors[name]
        data = bytearray(info.nbytes)
        self._file.seek(info.offset)
        if self._file.readinto(data) != info.nbytes:
            raise ValueError(f"GGUF: {self.path} was truncated while reading {name}")
        if name in self.digests and hashlib.sha256(data).hexdigest() != self.digests[name]:
            raise ValueError(f"GGUF: tensor {name} of {self.path} does not match its recorded SHA-256 (the file is "
                             "corrupted)")
        return torch.frombuffer(data, dtype=torch.uint8)

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
