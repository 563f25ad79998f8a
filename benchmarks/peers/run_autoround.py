"""AutoRound (Intel's auto-round) on CPU, writing a GPTQ-format folder or a GGUF file. Runs in its own venv
(benchmarks/frontier_peers.py builds it).

    python run_autoround.py MODEL_DIR OUT_DIR CALIB.pt FORMAT BITS GROUP ITERS

FORMAT: gptq (AutoRound(bits, group_size, sym=True) then quantize_and_save(format="auto_gptq")) or a GGUF scheme such
as gguf:q4_k_m (its K-quant search, format="gguf:q4_k_m"). The calibration is token ids [n, T] (a torch.save'd
LongTensor) handed over as a list of [1, T] tensors, never text; ITERS: SignRound's tuning steps per block (0 = its
RTN path, with its optimized-RTN scale search). Writes OUT_DIR/done.json {"path": the folder or .gguf file}.
"""
import json
import sys
from pathlib import Path

import torch


def main(model_dir, out_dir, calib, fmt, bits, group, iters):
    from auto_round import AutoRound
    torch.set_num_threads(1)
    ids = torch.load(calib)
    options = dict(dataset=[row[None] for row in ids], nsamples=len(ids), seqlen=ids.shape[1], iters=int(iters),
                   device_map="cpu")
    if fmt == "gptq":
        ar = AutoRound(model_dir, scheme="W4A16" if int(bits) == 4 else f"W{bits}A16", bits=int(bits),
                       group_size=int(group), sym=True, **options)
        save_format = "auto_gptq"
    else:
        ar = AutoRound(model_dir, scheme=fmt.upper(), **options)
        save_format = fmt
    out = Path(out_dir)
    ar.quantize_and_save(str(out / "model"), format=save_format)
    ggufs = sorted((out / "model").rglob("*.gguf"))
    path = ggufs[0] if ggufs else next(p.parent for p in (out / "model").rglob("config.json"))
    (out / "done.json").write_text(json.dumps({"path": str(path.resolve())}))


if __name__ == "__main__":
    if len(sys.argv) != 8:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
