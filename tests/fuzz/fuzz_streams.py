"""Fuzz campaign, part 2: corrupted streams (tests/fuzz/fuzz.py runs them).

The streams are those of the pristine checkpoints (tests/fuzz/fuzz_checkpoints.py): the rANS stream of each EntQuant
block (and the same symbols coded in four sub-streams), the Rice sub-streams of every lattice layer, the trellis
codes + scales of every trellis layer. A case (`stream_cases`) flips bits or bytes, truncates, extends, inserts,
deletes, swaps sub-streams, tiles, blocks or layers, or changes the side data or the config fields a stream is bound
to; the result goes through the format's public decoder (RansStream + rans_decode or the textbook decoder; the
lattice and trellis checkpoint readers, LatticeLinear and TrellisLinear) and is compared with the original decode.
"""
import json
import random
from collections import defaultdict

import numpy as np
import torch

from fuzz_checkpoints import flip, pristine  # (first: it puts the repository on sys.path)
from engine.formats.quantized_checkpoints import load_quantized
from engine.safetensors_io import snapshot_tensors
from engine.coding.rans import RansStream, rans_decode_reference
from engine.coding.rans_fast import rans_decode, rans_encode
from engine.coding.rice import RiceStreams, rice_decode_reference
from engine.formats import entropy, lattice, trellis

STREAMS = ("rans", "rice", "trellis")
STREAM_OPS = {"rans": ("bit", "byte", "truncate", "extend", "insert", "delete", "zero-range", "swap-substreams",
                       "swap-blocks", "context-bit", "context-truncate", "reference-decoder"),
              "rice": ("bit:payload", "byte:payload", "bit:offsets", "bit:rice_ks", "bit:scales", "bit:signs",
                       "bit:header", "truncate", "extend", "swap-substreams", "swap-offsets", "swap-bytes",
                       "swap-layers", "config:lattice", "config:tile", "reference-decoder"),
              "trellis": ("bit:trellis_codes", "byte:trellis_codes", "bit:trellis_scales", "byte:trellis_scales",
                          "bit:trellis_crc", "truncate", "extend", "swap-tiles", "swap-layers", "config:L",
                          "config:K", "config:code", "config:tail_biting", "config:tile", "config:group",
                          "config:seed")}


def stream_cases(n, seed=0):
    """n stream corruptions, the three coders in turn, each coder's operations in turn."""
    rng = random.Random(seed + 1)
    cases = []
    for i in range(n):
        target = STREAMS[i % len(STREAMS)]
        ops = STREAM_OPS[target]
        cases.append(dict(kind="stream", target=target, op=ops[(i // len(STREAMS)) % len(ops)],
                          seed=rng.getrandbits(32)))
    return cases

# ---- streams (in the worker) ----------------------------------------------------------------------------------------

def layer_parts(directory, suffixes):
    """{layer name: {suffix: tensor}} of a checkpoint's quantized layers."""
    layers = defaultdict(dict)
    for name, value in snapshot_tensors(directory):
        module, _, part = name.rpartition(".")
        if part in suffixes:
            layers[module][part] = value
    return dict(layers)


def pristine_streams(root, kind):
    """The streams one kind of case corrupts, with what they decode to."""
    if kind == "rans":
        model = load_quantized(pristine(root, "entquant"))
        decoder = model.entquant_decoder
        items = []
        for i, layers in decoder.blocks.items():
            context = entropy.block_context(i, layers, model.quantization_config.get("prob_bits", 15))
            data = layers[0].stream.numpy().tobytes()
            items.append(dict(data=data, n=decoder.sizes[i], context=context, block=i))
        symbols = rans_decode(items[0]["data"], items[0]["n"], items[0]["context"])
        items.append(dict(items[0], data=rans_encode(symbols, lanes=128, context=items[0]["context"])))
        for item in items:
            item["symbols"] = rans_decode(item["data"], item["n"], item["context"])
        return items
    method = {"rice": lattice, "trellis": trellis}[kind]
    folder = pristine(root, "lattice" if kind == "rice" else "trellis")
    config = method.validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    layers = layer_parts(folder, method.CHECKPOINT.parts(config))
    return [dict(name=name, parts=parts, config=config, decoded=decode_layer(kind, parts, config))
            for name, parts in layers.items()]


def decode_layer(kind, parts, config, reference=False):
    if kind == "rice":
        if reference:
            layer_in, layer_out, tile, total_bits, crc = parts["header"].tolist()
            context = lattice.layer_context(config["lattice"], layer_in, layer_out, tile, parts["scales"],
                                            parts["signs"])
            streams = RiceStreams(parts["payload"], parts["offsets"], parts["rice_ks"], layer_in * layer_out,
                                          total_bits, crc, context=context)
            return rice_decode_reference(streams, lattice.get_lattice(config["lattice"]).levels)
        return lattice.CHECKPOINT.read(parts, config).rotated_weight()
    return trellis.CHECKPOINT.read(parts, config).dequantize()


def flip_tensor(t, rng, op):
    data, where = flip(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes(), rng, op)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype).reshape(t.shape), where


def swap_rans_substreams(data, rng):
    """Two sub-streams of a stream swapped (states, word counts, words), the checksum left as it was."""
    s = RansStream(data)
    subs, width = s.states.shape
    a, b = rng.sample(range(subs), 2)
    order = list(range(subs))
    order[a], order[b] = b, a
    counts = np.diff(s.starts)
    table = 16 + 32 + 2 * int((s.f > 0).sum())
    words = [s.words[s.starts[i]:s.starts[i + 1]] for i in order]
    body = b"".join([data[:table], s.states[order].astype("<u4").tobytes(), counts[order].astype("<u4").tobytes(),
                     np.concatenate(words).astype("<u2").tobytes()])
    return body + data[-4:], f"sub-streams {a} and {b} swapped"


def swap_rice_substreams(parts, rng):
    """Two sub-streams of a Rice payload cut and pasted into each other's place (bits, Rice parameters, offsets
    recomputed): structurally valid, only the checksum can tell."""
    offsets = parts["offsets"].long().tolist()
    total = int(parts["header"][3])
    ends = offsets[1:] + [total]
    a, b = sorted(rng.sample(range(len(offsets) - 1), 2))            # not the last (it holds fewer symbols)
    bits = np.unpackbits(parts["payload"].numpy())[:total]
    pieces = [bits[o:e] for o, e in zip(offsets, ends)]
    pieces[a], pieces[b] = pieces[b], pieces[a]
    lengths = [len(p) for p in pieces]
    ks = parts["rice_ks"].clone()
    ks[a], ks[b] = parts["rice_ks"][b], parts["rice_ks"][a]
    new = dict(parts, payload=torch.from_numpy(np.packbits(np.concatenate(pieces))), rice_ks=ks,
               offsets=torch.tensor(np.cumsum([0] + lengths[:-1]), dtype=torch.int32))
    return new, f"sub-streams {a} and {b} swapped"


def corrupt_rans(items, op, rng):
    pool = items[-1:] if op == "swap-substreams" else items
    item = dict(rng.choice(pool))
    data, context = item["data"], item["context"]
    pos = rng.randrange(len(data))
    if op in ("bit", "byte", "reference-decoder"):
        data, where = flip(data, rng, "byte" if op == "reference-decoder" else op)
    elif op == "truncate":
        data, where = data[:pos], f"cut at {pos} of {len(data)}"
    elif op == "extend":
        extra = rng.randbytes(rng.randrange(1, 64))
        data, where = data + extra, f"{len(extra)} bytes appended"
    elif op == "insert":
        extra = rng.randbytes(rng.randrange(1, 16))
        data, where = data[:pos] + extra + data[pos:], f"{len(extra)} bytes inserted at {pos}"
    elif op == "delete":
        k = rng.randrange(1, 16)
        data, where = data[:pos] + data[pos + k:], f"{k} bytes deleted at {pos}"
    elif op == "zero-range":
        k = rng.randrange(1, 64)
        data, where = data[:pos] + bytes(len(data[pos:pos + k])) + data[pos + k:], f"{k} bytes zeroed at {pos}"
    elif op == "swap-substreams":
        data, where = swap_rans_substreams(data, rng)
    elif op == "swap-blocks":
        other = next(i for i in items if i["block"] != item["block"])
        context, where = other["context"], f"block {item['block']}'s stream with block {other['block']}'s side data"
    elif op == "context-bit":
        context, where = flip(context, rng, "bit")
    elif op == "context-truncate":
        context, where = context[:-rng.randrange(1, 32)], "side data cut"
    else:
        raise KeyError(op)
    decoder = rans_decode_reference if op == "reference-decoder" else rans_decode
    out = decoder(RansStream(data, item["n"], context))
    return torch.equal(out, item["symbols"]), where


def corrupt_layer(kind, items, op, rng):
    item = rng.choice(items)
    parts, config, where = dict(item["parts"]), dict(item["config"]), ""
    codes = "payload" if kind == "rice" else "trellis_codes"
    if op.startswith(("bit:", "byte:")) or op == "reference-decoder":
        name = codes if op == "reference-decoder" else op.split(":")[1]
        parts[name], where = flip_tensor(parts[name], rng, "byte" if op == "reference-decoder" else op[:op.index(":")])
        where = f"{name}: {where}"
    elif op == "truncate":
        t = parts[codes]
        parts[codes] = t[:-rng.randrange(1, 8)] if kind == "rice" else t[..., :-1].contiguous()
    elif op == "extend":
        t = parts[codes]
        parts[codes] = torch.cat([t, torch.randint(0, 256, (rng.randrange(1, 8),), dtype=torch.uint8)]) \
            if kind == "rice" else torch.cat([t, torch.zeros(*t.shape[:-1], 1, dtype=torch.uint8)], -1)
    elif op == "swap-substreams":
        parts, where = swap_rice_substreams(parts, rng)
    elif op == "swap-offsets":
        offsets = parts["offsets"].clone()
        a, b = rng.sample(range(len(offsets)), 2)
        offsets[a], offsets[b] = parts["offsets"][b], parts["offsets"][a]
        parts["offsets"], where = offsets, f"offsets {a} and {b} swapped"
    elif op == "swap-bytes":
        payload = parts["payload"].clone()
        k = rng.randrange(1, 16)
        a, b = rng.sample(range(len(payload) - k), 2)
        payload[a:a + k], payload[b:b + k] = parts["payload"][b:b + k], parts["payload"][a:a + k]
        parts["payload"], where = payload, f"{k} bytes at {a} and {b} swapped"
    elif op == "swap-tiles":
        t, s = parts["trellis_codes"].clone(), parts["trellis_scales"].clone()
        rows, cols = t.shape[:2]
        a, b = rng.sample(range(rows * cols), 2)
        (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
        t[ra, ca], t[rb, cb] = parts["trellis_codes"][rb, cb], parts["trellis_codes"][ra, ca]
        s[ra, ca], s[rb, cb] = parts["trellis_scales"][rb, cb], parts["trellis_scales"][ra, ca]
        parts.update(trellis_codes=t, trellis_scales=s)
        where = f"tiles {a} and {b} swapped (codes and scales)"
    elif op == "swap-layers":
        shape = (lambda i: tuple(i["parts"]["header"][:2].tolist())) if kind == "rice" else (
            lambda i: i["parts"][codes].shape)
        same = [i for i in items if i is not item and shape(i) == shape(item)]
        if not same:
            return True, "no layer of the same shape"
        other = rng.choice(same)
        moved = ("payload", "offsets", "rice_ks", "header") if kind == "rice" else ("trellis_codes",)
        parts.update({k: other["parts"][k] for k in moved})
        where = f"{moved} of {other['name']}"
    elif op.startswith("config:"):
        key = op[7:]
        alternatives = {"lattice": ["E8", "D4", "A2", "Z"], "tile": [32, 128] if kind == "rice" else [[2, 32], [1, 32]],
                        "L": [7, 9, 10], "K": [1, 3], "code": ["1mad", "3inst"], "tail_biting": [True, False],
                        "group": [32, 128], "seed": [1, 2, 12345]}[key]
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
        config[key] = rng.choice([v for v in alternatives if v != config[key]])
        config = (lattice if kind == "rice" else trellis).validate(config)
        where = f"{key} = {config[key]}"
    else:
        raise KeyError(op)
    reference = op == "reference-decoder"
    expected = decode_layer(kind, item["parts"], item["config"], reference) if reference else item["decoded"]
    return torch.equal(decode_layer(kind, parts, config, reference), expected), where
