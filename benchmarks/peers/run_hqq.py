"""HQQ (half-quadratic quantization), data-free, on every decoder linear of a dense HF folder. Runs in its own venv
(benchmarks/frontier_peers.py builds it).

    python run_hqq.py MODEL_DIR OUT.safetensors NBITS GROUP

hqq.core.quantize.Quantizer.quantize with HQQLinear's settings (hqq_base_quant_config: axis=1 = groups along the
input, optimize=True = its proximal solver for scale and zero, round_zero for 4 bits, bit-packed codes), scale and
zero kept in float16 as HQQLinear keeps them (compute_dtype float16), dequantized back. OUT holds each module's W_hat
(float32) and, in its metadata, the bits of what HQQ stores: the packed W_q tensor (3-bit codes pack 10 to an int32)
plus the f16 scale and zero.
"""
import sys

import torch

from linears import decoder_linears, save, stored_bits


def main(model_dir, out, nbits, group):
    from hqq.core.quantize import Quantizer, hqq_base_quant_config
    params = hqq_base_quant_config(nbits=int(nbits), group_size=int(group))["weight_quant_params"]
    weights, bits = {}, {}
    for module, w in decoder_linears(model_dir):
        w_q, meta = Quantizer.quantize(w, device="cpu", compute_dtype=torch.float16, **params)
        meta["scale"], meta["zero"] = meta["scale"].half(), meta["zero"].half()
        bits[module] = stored_bits((w_q, meta["scale"], meta["zero"]))
        meta["scale"], meta["zero"], meta["compute_dtype"] = meta["scale"].float(), meta["zero"].float(), torch.float32
        weights[module] = Quantizer.dequantize(w_q, meta)
    save(out, weights, bits)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
