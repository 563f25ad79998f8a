"""bitsandbytes' 4-bit quantizer (QLoRA's NF4 / FP4), data-free, on every decoder linear of a dense HF folder. Runs in
its own venv (benchmarks/frontier_peers.py builds it).

    python run_bnb.py MODEL_DIR OUT.safetensors nf4|fp4 BLOCKSIZE DOUBLE_QUANT(0|1)

bitsandbytes.functional.quantize_4bit on the float32 weight (blocks of BLOCKSIZE consecutive weights of the flattened
row-major tensor = groups along a row when the row length is a multiple), dequantize_4bit back. OUT holds each
module's W_hat (float32) and, in its metadata, the bits its serialized form takes: the packed codes plus every tensor
of QuantState.as_dict(packed=True) (absmax, the 16-entry code, and with double quantization the 8-bit absmax's own
absmax, code and offset), i.e. what transformers writes for a Linear4bit.
"""
import sys

import torch

from linears import decoder_linears, save, stored_bits


def main(model_dir, out, kind, blocksize, double):
    import bitsandbytes.functional as F
    weights, bits = {}, {}
    for module, w in decoder_linears(model_dir):
        packed, state = F.quantize_4bit(w, blocksize=int(blocksize), compress_statistics=bool(int(double)),
                                        quant_type=kind)
        weights[module] = F.dequantize_4bit(packed, state).reshape(w.shape)
        bits[module] = stored_bits([packed] + [t for t in state.as_dict(packed=True).values()
                                               if isinstance(t, torch.Tensor)])
    save(out, weights, bits)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[3] not in ("nf4", "fp4"):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
