"""EntQuant at inference: each transformer block's weights are one rANS stream, decoded just before the block runs
into ONE shared buffer sized to the largest block (the seed's "decoded block by block"), by the Triton decoder under
impl "engine" and the NumPy one under impl "torch". Every stream is checked against its block first (its weight count;
a CRC over the stream and block_context, the side data its meaning depends on)."""
import json

import numpy as np
import torch

from ..coding.rans import PROB_BITS, RansStream
from ..coding.rans_fast import rans_decode
from ..layers import get_impl


def block_context(index, layers, prob_bits=PROB_BITS):
    """The side data bound to block `index`'s stream by its checksum, as bytes: the index, prob_bits and, per layer
    (EntQuantLinear, module order), its fmt, (out, in), log2 scales (float16), super-weight indices (int32) and
    values (float32). A changed fmt or scale, or a stream moved to another block, is then refused on load."""
    head = json.dumps({"block": index, "prob_bits": prob_bits,
                       "layers": [[m.fmt, m.out_features, m.in_features, m.super_index.numel()] for m in layers]})
    side = [t for m in layers for t in (m.log_scale, m.super_index, m.super_value)]
    return head.encode() + b"".join(t.detach().cpu().contiguous().numpy().tobytes() for t in side)


class BlockDecoder:
    """A model's decode machinery: the blocks' EntQuant layers {block index: [EntQuantLinear, ...]} (each block's
    stream in its first layer), ONE uint8 buffer sized to the largest block, and the index of the block it holds.
    Building it checks every stream against its block (weight count; checksum over the stream and block_context)
    and binds each layer to its place in the buffer. decode(i) is what the forward pre-hook of transformer layer i
    calls: the Triton decoder under impl "engine" (on a GPU, or under the interpreter: then all lanes in one
    program), the NumPy decoder under impl "torch" (tests pin the two equal)."""

    def __init__(self, blocks, prob_bits=PROB_BITS):
        self.blocks = blocks
        self.sizes = {i: sum(m.in_features * m.out_features for m in layers) for i, layers in blocks.items()}
        self.streams, self.on_device = {}, {}                 # parsed streams; their tensors per device
        self.buffer, self.current = None, None
        for i, layers in blocks.items():
            if layers[0].stream.numel() == 0 or any(m.stream.numel() for m in layers[1:]):
                raise ValueError(f"block {i}: the block stream must sit in its first EntQuant layer, and only there")
            try:
                self.streams[i] = RansStream(layers[0].stream, self.sizes[i], block_context(i, layers, prob_bits))
            except ValueError as e:
                raise ValueError(f"EntQuant block {i} (its stream is bound to fmt, prob_bits and the layers' shapes, "
                                 f"log2 scales and super weights): {e}") from None
        for i, layers in blocks.items():                       # every stream checked: bind the layers
            stream_bits, sizes = 8 * layers[0].stream.numel(), [m.in_features * m.out_features for m in layers]
            shares = [stream_bits * s // self.sizes[i] for s in sizes]
            shares[0] += stream_bits - sum(shares)
            offsets = np.cumsum([0] + sizes[:-1]).tolist()
            for m, offset, share in zip(layers, offsets, shares):
                m.bind(self, i, offset, share)

    def decode(self, index):
        """Make the buffer hold block `index`; returns the buffer (uint8 [largest block])."""
        head = self.blocks[index][0]
        if self.buffer is None or self.buffer.device != head.stream.device:
            with torch.inference_mode(False):     # a normal tensor: written under inference_mode and no_grad alike
                self.buffer = torch.empty(max(self.sizes.values()), dtype=torch.uint8, device=head.stream.device)
            self.current = None
        if self.current != index:
            self.current = None                                 # a failed decode leaves no block marked valid
            stream, out = self.streams[index], self.buffer[:self.sizes[index]]
            if get_impl() == "engine":
                if (index, out.device) not in self.on_device:
                    self.on_device[index, out.device] = stream.tensors(out.device)
                from ..kernels import stream_decoders      # Triton: imported by the engine path only
                stream_decoders.rans_decode(*self.on_device[index, out.device], out, stream.prob_bits)
            else:
                out.copy_(rans_decode(stream))
            self.current = index
        return self.buffer

    def pre_hook(self, index, module, args):
        """Decode block `index` before its transformer layer runs, unless every one of its layers already holds its
        weight decoded (inside layers.decoded_weights): then the buffer is not read this forward."""
        if not all(getattr(m, "_keep_decoded", False) and getattr(m, "_decoded", None) is not None
                   for m in self.blocks[index]):
            self.decode(index)

    def held_bytes(self):
        """Bytes this decoder holds besides the layers' streams: its block buffer and the parsed streams' tables and
        words (NumPy)."""
        parsed = sum(a.nbytes for s in self.streams.values() for a in vars(s).values() if isinstance(a, np.ndarray))
        return (0 if self.buffer is None else self.buffer.numel()) + parsed


def hold_codes(model):
    """Decode every EntQuant block's stream once and give each layer its own codes (`held`: E4M3 or int8 bytes, 1
    byte per weight), then drop the streams, the decoder and its pre-hooks: the model decodes nothing per token after
    this (engine.runtime's compact and exact forms). Each layer's storage_bits stays its share of the stream."""
    decoder = getattr(model, "entquant_decoder", None)
    if decoder is None:
        return
    for index, layers in decoder.blocks.items():
        buffer = decoder.decode(index)
        for m in layers:
            size = m.in_features * m.out_features
            m.held = buffer[m.buffer_offset:m.buffer_offset + size].view(m.out_features, m.in_features).clone()
    for block in model.model.layers:
        if getattr(block, "_entquant_hook", None) is not None:
            block._entquant_hook.remove()
            block._entquant_hook = None
    for layers in decoder.blocks.values():
        for m in layers:
            m.stream, m.decoder = torch.zeros(0, dtype=torch.uint8), None
    del model.entquant_decoder
