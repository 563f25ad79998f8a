"""GPTQModel on CPU: its layer-by-layer quantizer (each decoder layer calibrated on the outputs of the quantized
layers before it), writing a GPTQ (v1) or AWQ (GEMM) checkpoint. Runs in the peers venv (benchmarks/layerwise.py
builds it).

    GPTQMODEL_CPU_WORKERS=2 python run_gptqmodel.py gptq|awq MODEL_DIR OUT_DIR CALIB.pt

gptq: GPTQConfig(bits=4, group_size=128) with GPTQModel's defaults (symmetric, no act-order, its act-group-aware
ordering, damp 0.05 growing on failure); awq: AWQConfig(bits=4, group_size=128, sym=False) (GEMM layout; sym=False
asks for AWQ's own asymmetric grid, with zero points: GPTQModel's default is symmetric, zero_point false). The
calibration is token ids [n, T] (a torch.save'd LongTensor) given as input_ids / attention_mask rows, never text
(GPTQModel still loads MODEL_DIR's tokenizer). GPTQMODEL_CPU_WORKERS: its CPU thread pool otherwise sizes itself
from the core count and stalls on a 2-core machine.
"""
import os
import sys

import torch


def main(method, model_dir, out_dir, calib):
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig, GPTQConfig
    config = GPTQConfig(bits=4, group_size=128) if method == "gptq" else AWQConfig(bits=4, group_size=128, sym=False)
    ids = torch.load(calib)
    rows = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in ids]
    model = GPTQModel.load(model_dir, config, device="cpu")
    model.quantize(rows)
    model.save(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in ("gptq", "awq"):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
