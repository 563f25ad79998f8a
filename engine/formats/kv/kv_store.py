"""A KV cache that holds codes, not values: what `run.py generate / eval --kv-cache SPEC` run on.

kv_cache.py's hook decides, per query t and position s, whether attention reads the exact K/V (t - s < window) or
the coded ones; a plain KVCache keeps both. StoredKVCache keeps, per layer:

    exact     K and V of the last `window` positions (and of any not coded yet), in the model's dtype; the keys of
              the first `exact_keys` positions
    pages     every coded position, as the bytes of its format: Rice sub-streams + f16 scales for HyperQuant's
              lattice, GGML blocks for q8_0 / q4_0, E4M3 bytes + scales for fp8, packed codes + f16 scales and zeros
              for KIVI. Each page holds a whole number of `page_tokens` tokens (so that a lattice page is whole
              512-symbol sub-streams) and a CRC32 per array, checked on every read
    tail      the codes of the < page_tokens positions coded since the last page (as tensors, until a page fills)

Each forward codes what the hook would (the same calls, so the same codes), appends them, and reads the layer's
pages back: one lockstep Rice decode over all of a layer's sub-streams (NumPy, or the Triton decoder with
kernel=True), then the format's decode into one buffer per K and V (KVHook.decode_into: GGML blocks are dequantized
in place there). Attention then sees what the simulated hook gives: exact K/V where a query is within the window,
decoded ones elsewhere; the positions whose exact values are gone are read by no query (with no window, no exact
value is read at all, so attention gets the one buffer). A format whose decode ends in a linear map (llama.cpp's
Hadamard rotation back, the lattice's rotation S: KVHook.basis) is read without it: the window's few exact values are
put in that basis, and attention rotates each query and its output instead of every position (equal up to float
rounding). Memory is what the pages, the tail and the window hold (nbytes), against bf16_bytes, a bf16 cache of the
length.

A page never changes once written, so decoding it again each step would only repeat work (one-token steps would
cost a decode of the whole context each: quadratic). The cache keeps the decoded values of its first pages, up to
`decoded_bytes` (DECODED_BYTES by default: a 4096-token context of the book's tiny model, four times over), and
reads back only the pages past them; nbytes reports these values apart ("decoded"), a bounded copy of what the
pages hold. A kept page is read, and its CRCs checked, once.

SPEC (parse_kv_spec): NAME[:VALUE][,key=value...]
    e8:3 d4:3.5 a2:4 z:5    HyperQuant's lattice at that many Rice bits per scalar; rotation qjl (none, signs),
                            window 32, exact_keys 0, seed 0 (up to 2**32 - 1; dither is refused: its noise is
                            drawn, not stored)
    q8_0 q4_0               llama.cpp's cache types (window 0; rotation hadamard and key_order auto: as llama.cpp
                            stores them for the model; rotation=none: before its PR 21038)
    fp8 fp8:head            vLLM's fp8 (E4M3), one scale per layer's call or per KV head (window 0)
    kivi:2 kivi:4           KIVI, group 32, window 32
    bf16 f16                the values themselves, rounded (window 0)
"""
import math
import zlib
from array import array

import numpy as np
import torch

from ..numerics.lattices import LATTICES
from .kv_baselines import FP8KV, GGMLKV, KIVI, DenseKV
from .kv_cache import KVHook, KVQuantizer

PAGE_TOKENS = 64           # at least this many tokens per page (metadata and checks are per page)
DECODE_PAGES = 16          # pages' worth of tokens decoded at once
DECODED_BYTES = 32 << 20   # decoded values of the first pages kept, per cache (module docstring)


class Arena:
    """Append-only bytes, and where each page starts with its CRC32 (compact arrays: thousands of pages)."""

    def __init__(self):
        self.data, self.starts, self.crcs = bytearray(), array("q"), array("q")

    def append(self, raw):
        raw = np.ascontiguousarray(raw).view(np.uint8)
        self.starts.append(len(self.data))
        self.crcs.append(zlib.crc32(raw))
        self.data += raw.tobytes()

    def read(self, what, first=0):
        """The bytes of pages first.. (a copy), after checking each one's CRC32."""
        offset = self.starts[first]
        data = np.frombuffer(self.data, np.uint8, offset=offset).copy()
        starts = [start - offset for start in self.starts[first:]]
        for page, start, end in zip(range(first, len(self.starts)), starts, starts[1:] + [len(data)]):
            if zlib.crc32(data[start:end]) != self.crcs[page]:
                raise ValueError(f"KV cache {what}, page {page}: checksum mismatch (the stored codes are corrupt)")
        return data

    @property
    def nbytes(self):
        return len(self.data) + 8 * (len(self.starts) + len(self.crcs))


class Pages(dict):
    """{name: the bytes of pages first..} as a format's unpack reads them, with .starts {name: each page's first
    byte in them}."""

    def __init__(self, arenas, what, first=0):
        super().__init__((name, arena.read(f"{what} {name}", first)) for name, arena in arenas.items())
        self.starts = {name: np.array(arena.starts[first:], dtype=np.int64) - arena.starts[first]
                       for name, arena in arenas.items()}


class CodedPart:
    """One layer's K (which 0) or V (1): its pages, the values of the first ones decoded, and the tail not yet
    paged."""

    def __init__(self, quantizer, layer, which, page_tokens, in_basis=False):
        self.quantizer, self.layer, self.which, self.page_tokens = quantizer, layer, which, page_tokens
        self.in_basis = in_basis                     # (the kept values too)
        self.arenas, self.like, self.tail, self.tail_tokens, self.sealed = {}, None, None, 0, 0
        self.ends = array("q")                       # each page's end (tokens)
        self.kept, self.kept_pages = None, 0         # x_hat [B, kv_heads, n, d] of the first kept_pages pages

    def append(self, codes, tokens):
        self.tail = codes if self.tail is None else {k: torch.cat((self.tail[k], t), 2) for k, t in codes.items()}
        self.tail_tokens += tokens
        sealed = self.tail_tokens // self.page_tokens * self.page_tokens
        if sealed:
            page = _cut(self.tail, self.tail_tokens, 0, sealed)
            for name, raw in self.quantizer.pack(page).items():
                self.arenas.setdefault(name, Arena()).append(raw)
            self.like = self.like or {k: t[:, :, :0].clone() for k, t in page.items()}
            self.tail = {k: t.clone() for k, t in _cut(self.tail, self.tail_tokens, sealed, self.tail_tokens).items()}
            self.tail_tokens -= sealed
            self.sealed += sealed
            self.ends.append(self.sealed)

    @property
    def coded(self):
        return bool(self.arenas) or self.tail_tokens > 0

    @property
    def unread(self):
        """Pages whose values are not kept: read back on every step."""
        return len(self.ends) - self.kept_pages

    def pages(self):
        """The unread pages' bytes, and `like`."""
        return Pages(self.arenas, f"layer {self.layer} {'KV'[self.which]}", self.kept_pages), self.like

    def decoded(self, unpacked, out, room):
        """Fill out [B, kv_heads, coded positions, d] (the caller's buffer, in the model's dtype): the kept values,
        then the unread pages (unpacked: their codes, or None) decoded straight into it, DECODE_PAGES pages' worth
        of tokens at a time so that the decoders' wide temporaries stay that small whatever the context (all of
        them at once for a format whose decode needs no wide ones: quantizer.decode_at_once), then the tail. Of the
        unread pages, the first ones that `room` bytes hold are kept from now on; returns the bytes newly kept."""
        first = self.ends[self.kept_pages - 1] if self.kept_pages else 0
        if self.kept is not None:
            out[:, :, :first] = self.kept
        n = self.sealed - first
        step = max(n, 1) if self.quantizer.decode_at_once else DECODE_PAGES * self.page_tokens
        if unpacked is not None:
            for i in range(0, n, step):
                self._decode(_cut(unpacked, n, i, min(i + step, n)), out[:, :, first + i:first + min(i + step, n)])
        if self.tail_tokens:
            self._decode(self.tail, out[:, :, self.sealed:])
        if unpacked is None:
            return 0
        ends = np.frombuffer(self.ends, np.int64)[self.kept_pages:]
        per_token = out[:, :, :1].numel() * out.element_size()
        fit = int(np.count_nonzero((ends - first) * per_token <= room))      # ends grow: a prefix of the pages
        if not fit:
            return 0
        self.kept = out[:, :, :int(ends[fit - 1])].clone()          # a copy: a view would hold all of out
        self.kept_pages += fit
        return (int(ends[fit - 1]) - first) * per_token

    def _decode(self, codes, out):
        self.quantizer.decode_into(codes, out, self.layer, self.which, self.in_basis)

    @property
    def nbytes(self):
        """(pages, tail, decoded) bytes."""
        tail = 0 if self.tail is None else sum(t.numel() * t.element_size() for t in self.tail.values())
        decoded = 0 if self.kept is None else self.kept.numel() * self.kept.element_size()
        return sum(a.nbytes for a in self.arenas.values()), tail, decoded


def _in_basis(x, basis, which):
    """Exact values x [B, H, n, d] as attention reads them beside pages decoded in a basis (m_k, m_v): x @ m^T."""
    return x if basis is None else x @ basis[which].T


def _cut(codes, tokens, first, last):
    """Positions first..last of codes of `tokens` positions (each tensor's axis 2 holds tokens or groups of them)."""
    return {name: t[:, :, first * t.shape[2] // tokens:last * t.shape[2] // tokens] for name, t in codes.items()}


class LayerStore:
    def __init__(self, quantizer, layer, page_tokens, basis=None):
        self.parts = [CodedPart(quantizer, layer, which, page_tokens, basis is not None) for which in (0, 1)]
        self.basis = basis
        self.exact_k = self.exact_v = self.first_k = None
        self.first_exact = self.coded = self.length = 0     # first position held exact; positions coded; seen


class StoredKVCache:
    """A KV cache for Qwen3.generate / forward that stores `quantizer`'s codes (module docstring). The model's
    windowed hook must be this quantizer (kv_store.install). decoded_bytes: how many bytes of its first pages'
    decoded values it keeps (0: every page is read back on every step)."""

    def __init__(self, num_layers, quantizer, kernel=False, page_tokens=None, decoded_bytes=DECODED_BYTES):
        if not isinstance(quantizer, KVHook):
            raise ValueError(f"a stored KV cache needs one of the engine's KV quantizers, got {type(quantizer)}")
        if getattr(quantizer, "dither", False):
            raise ValueError("a dithered lattice cache cannot be stored: its noise U is drawn, not kept")
        if kernel and not isinstance(quantizer, KVQuantizer):
            raise ValueError("kernel=True decodes lattice pages (the Triton Rice decoder); this cache is "
                             f"{type(quantizer).__name__}")
        if page_tokens is not None and (isinstance(page_tokens, bool) or not isinstance(page_tokens, int)
                                        or page_tokens < 1 or page_tokens % quantizer.block):
            raise ValueError(f"page_tokens={page_tokens!r}: must be a positive multiple of the quantizer's "
                             f"{quantizer.block}-token block")
        if isinstance(decoded_bytes, bool) or not isinstance(decoded_bytes, int) or decoded_bytes < 0:
            raise ValueError(f"decoded_bytes={decoded_bytes!r}: must be an integer >= 0")
        self.quantizer, self.kernel, self.page_tokens = quantizer, kernel, page_tokens
        self.room = decoded_bytes                     # what is left of decoded_bytes
        self.layers = [None] * num_layers

    @property
    def length(self):
        return 0 if self.layers[0] is None else self.layers[0].length

    def _pages_of(self, k):
        """Tokens per page: whole blocks, >= PAGE_TOKENS, and whole 512-symbol sub-streams (B kv_heads d scalars per
        token)."""
        b, h, _, d = k.shape
        unit = math.lcm(512 // math.gcd(512, b * h * d), self.quantizer.block)
        if self.page_tokens is None:
            return unit * -(-PAGE_TOKENS // unit)
        if isinstance(self.quantizer, KVQuantizer) and self.page_tokens % unit:
            raise ValueError(f"page_tokens={self.page_tokens}: a lattice page must hold whole 512-symbol sub-streams "
                             f"(a multiple of {unit} tokens here)")
        return self.page_tokens

    def windowed(self, index, k, v, fn, window):
        """qwen3.KVCache.windowed's contract, from the stored codes."""
        if fn is not self.quantizer:
            raise ValueError("the model's KV hook is not this cache's quantizer (kv_store.install puts it there)")
        if self.layers[index] is None:
            self.layers[index] = LayerStore(fn, index, self._pages_of(k), self._basis(k, index))
        s = self.layers[index]
        if s.exact_k is None:
            s.exact_k, s.exact_v = k[:, :, :0], v[:, :, :0]
        ek, ev = torch.cat((s.exact_k, k), 2), torch.cat((s.exact_v, v), 2)
        length = s.length + k.shape[2]
        new = s.coded - s.first_exact                       # exact positions not coded yet start here
        m, exact, k_codes, v_codes = fn.encode_call(ek[:, :, new:], ev[:, :, new:], index, s.coded)
        if exact:
            first = ek[:, :, new:new + exact]
            s.first_k = first.clone() if s.first_k is None else torch.cat((s.first_k, first), 2)
        if k_codes is not None:
            s.parts[0].append(k_codes, m - exact)
        if v_codes is not None:
            s.parts[1].append(v_codes, m)
        s.coded += m
        if length - s.coded > window:
            raise ValueError(f"the KV transform left {length - s.coded} positions uncoded, more than its window "
                             f"of {window}")
        b, h, _, d = k.shape
        k_hat, v_hat = k.new_empty(b, h, length, d), v.new_empty(b, h, length, v.shape[3])
        kept_keys = 0 if s.first_k is None else s.first_k.shape[2]
        if kept_keys:
            k_hat[:, :, :kept_keys] = _in_basis(s.first_k, s.basis, 0)
        self._read(s.parts, (k_hat[:, :, kept_keys:s.coded], v_hat[:, :, :s.coded]))
        uncoded = s.coded - s.first_exact
        bk, bv = _in_basis(ek, s.basis, 0), _in_basis(ev, s.basis, 1)   # the window's few values, as attention reads
        k_hat[:, :, s.coded:], v_hat[:, :, s.coded:] = bk[:, :, uncoded:], bv[:, :, uncoded:]
        if uncoded and window:                                # exact values the coded ones replace in k_hat
            k_all = torch.cat((k_hat[:, :, :s.first_exact], bk), 2)
            v_all = torch.cat((v_hat[:, :, :s.first_exact], bv), 2)
        else:                    # the same values, or no window (no query reads an exact value): one tensor
            k_all, v_all = k_hat, v_hat
        keep = max(0, min(s.coded, length - window))          # a later query reads exact values from here on
        s.exact_k, s.exact_v = ek[:, :, keep - s.first_exact:].clone(), ev[:, :, keep - s.first_exact:].clone()
        s.first_exact, s.length = keep, length
        return k_all, v_all, k_hat, v_hat, s.basis

    def _basis(self, k, layer):
        """(m_k, m_v) in k's dtype and device when attention reads the layer's pages in the quantizer's basis
        (KVHook.basis), else None."""
        d = k.shape[3]
        bases = [self.quantizer.basis(d, which, layer) for which in (0, 1)]
        if bases == [None, None]:
            return None
        return tuple((torch.eye(d) if m is None else m).to(k) for m in bases)

    def _read(self, parts, outs):
        """Fill each part's out (kv_store.CodedPart.decoded): the unread pages of all unpacked together (a layer's K
        and V in one Rice decode), the ones that fit what is left of decoded_bytes kept."""
        unread = [part for part in parts if part.unread]
        options = {"kernel": True} if self.kernel else {}
        unpacked = self.quantizer.unpack_many([part.pages() for part in unread], **options) if unread else []
        codes = dict(zip(map(id, unread), unpacked))
        for part, out in zip(parts, outs):
            if part.coded:
                self.room -= part.decoded(codes.get(id(part)), out, self.room)

    def nbytes(self):
        """Resident bytes: {"pages", "tail", "exact", "total"} (the codes' arrays and checks, the unpaged codes,
        the exact window and first keys: what the cache stores) and "decoded" (the kept values of its first pages,
        at most decoded_bytes: a copy of what those pages hold, apart from the total)."""
        pages = tail = exact = decoded = 0
        for s in filter(None, self.layers):
            for part in s.parts:
                p, t, d = part.nbytes
                pages, tail, decoded = pages + p, tail + t, decoded + d
            for t in (s.exact_k, s.exact_v, s.first_k):
                exact += 0 if t is None else t.numel() * t.element_size()
        return {"pages": pages, "tail": tail, "exact": exact, "total": pages + tail + exact, "decoded": decoded}

    def bf16_bytes(self):
        """What a bf16 cache of the same positions holds: 2 bytes per K and V scalar."""
        s = self.layers[0]
        if s is None:
            return 0
        b, h, _, d = s.exact_k.shape
        return 2 * 2 * b * h * d * s.length * len(self.layers)


def install(model, quantizer, kernel=False, page_tokens=None, decoded_bytes=DECODED_BYTES):
    """Put quantizer on the model's windowed KV hook and return an empty StoredKVCache for it (one per sequence)."""
    quantizer.adopt(model.cfg)
    model.set_kv_transform(quantizer, window=quantizer.window)
    return StoredKVCache(model.cfg.num_hidden_layers, quantizer, kernel, page_tokens, decoded_bytes)


@torch.no_grad()
def stored_logits(model, ids, quantizer, chunk=512, kernel=False):
    """ids [B, T] -> logits [B, T, vocab] read `chunk` tokens at a time through a StoredKVCache of quantizer, as a
    long prompt's prefill runs (the hook is removed afterwards); also returns the cache."""
    cache = install(model, quantizer, kernel)
    try:
        logits = torch.cat([model(ids[:, i:i + chunk], cache) for i in range(0, ids.shape[1], chunk)], 1)
    finally:
        model.set_kv_transform(None)
    return logits, cache


# ---- SPEC ------------------------------------------------------------------------------------------------------

OPTIONS = {"lattice": {"rotation": str, "window": int, "exact_keys": int, "seed": int},
           "ggml": {"window": int, "exact_keys": int, "key_order": str, "rotation": str},
           "fp8": {"window": int, "exact_keys": int},
           "kivi": {"group": int, "window": int, "exact_keys": int}, "dense": {"window": int}}
NAMES = {**{lat.lower(): "lattice" for lat in LATTICES}, "q8_0": "ggml", "q4_0": "ggml", "fp8": "fp8",
         "kivi": "kivi", "bf16": "dense", "f16": "dense"}


def parse_kv_spec(spec):
    """SPEC (module docstring) -> a KV quantizer; ValueError naming what is wrong (an option given twice too), and
    the SPEC."""
    try:
        return _parse(spec)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith("--kv-cache") else f"--kv-cache {spec}: {message}") from None


def _parse(spec):
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("--kv-cache needs a SPEC, e.g. e8:3, q4_0, fp8, kivi:2, bf16")
    head, *rest = spec.strip().split(",")
    name, _, value = head.partition(":")
    kind = NAMES.get(name.lower())
    if kind is None:
        raise ValueError(f"--kv-cache {spec}: unknown cache {name!r}; one of {', '.join(NAMES)}")
    options = {}
    for item in rest:
        key, eq, raw = item.partition("=")
        types = OPTIONS[kind]
        if not eq or key not in types:
            raise ValueError(f"--kv-cache {spec}: {item!r} is not an option of {name} (key=value, keys: "
                             f"{', '.join(types)})")
        if key in options:
            raise ValueError(f"--kv-cache {spec}: {key} is given twice")
        try:
            options[key] = types[key](raw)
        except ValueError:
            raise ValueError(f"--kv-cache {spec}: {key}={raw!r} is not {types[key].__name__}") from None
    if kind == "lattice":
        try:
            bps = float(value)
        except ValueError:
            raise ValueError(f"--kv-cache {spec}: {name} needs its bits per scalar, e.g. {name}:3") from None
        options.setdefault("rotation", "qjl")
        return KVQuantizer(name.upper(), bps, **options)
    if kind == "ggml":
        _no_value(spec, name, value)
        return GGMLKV(name.lower(), **options)
    if kind == "fp8":
        return FP8KV(value or "tensor", **options)
    if kind == "kivi":
        if value not in ("2", "4"):
            raise ValueError(f"--kv-cache {spec}: kivi takes 2 or 4 bits (kivi:2, kivi:4)")
        return KIVI(int(value), **options)
    _no_value(spec, name, value)
    return DenseKV(name.lower(), **options)


def _no_value(spec, name, value):
    if value:
        raise ValueError(f"--kv-cache {spec}: {name} takes no ':' value")
