"""The engine's side of benchmarks/layerwise.py, one process per call (run in the engine's venv):

    python run_engine.py quantize METHOD SOURCE OUT [CALIB.pt] [KEY=VALUE ...]
        engine.checkpoints.streaming.quantize_checkpoint, the converter behind `run.py quantize --model`, given the
        calibration token ids [n, T] (a torch.save'd LongTensor) instead of text; options as run.py's --option
    python run_engine.py read SOURCE
        every tensor of SOURCE read once (safetensors_io.TensorReader) and summed: the floor a data-free conversion
        is measured against (disk speed, or page-cache speed once the file is cached)
    python run_engine.py eval SOURCE HELD_OUT.pt OUT ...
        llama.cpp's --kl-divergence statistics (engine.evaluation.compare_models) of each quantized folder OUT
        against the dense SOURCE on the held-out ids [n, T]; one JSON line per OUT
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.checkpoints.models import load_model  # noqa: E402

from engine.formats.quantized_checkpoints import METHODS, method_options  # noqa: E402
from engine.safetensors_io import TensorReader  # noqa: E402
from engine.checkpoints.streaming import quantize_checkpoint  # noqa: E402
from engine.cli_quantize import parse_value  # noqa: E402
from engine.layers import model_bits  # noqa: E402
from engine.evaluation import ReferenceLogits, compare_models  # noqa: E402


def quantize(method, source, out, *rest):
    calib = rest[0] if rest and "=" not in rest[0] else None
    accepted = method_options(method)
    options = {}
    for text in rest[1 if calib else 0:]:
        key, _, value = text.partition("=")
        options[key] = parse_value(key, value, accepted[key])
    ids = torch.load(calib) if calib and METHODS[method].calibration(options) else None
    print(json.dumps(quantize_checkpoint(source, out, method, ids, force=True, progress=False, **options)))


def read(source):
    reader = TensorReader(source)
    total = sum(float(reader.read(name).float().sum()) for name in reader.names())
    print(json.dumps({"tensors": len(reader.names()), "checksum": total}))


def evaluate(source, held_out, *outs):
    chunks = torch.load(held_out)
    reference = ReferenceLogits(load_model(source, torch.float32, dense=True), chunks)
    for out in outs:
        model = load_model(out)
        print(json.dumps({"quantized": out, "bits": model_bits(model), **compare_models(reference, model, chunks)}),
              flush=True)


if __name__ == "__main__":
    commands = {"quantize": quantize, "read": read, "eval": evaluate}
    if len(sys.argv) < 3 or sys.argv[1] not in commands:
        raise SystemExit(__doc__)
    commands[sys.argv[1]](*sys.argv[2:])
