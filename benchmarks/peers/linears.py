"""What the data-free runners (run_hqq.py, run_bnb.py) share: the decoder linears of a dense HF folder in, their
dequantized weights and bit counts out. Imports only torch and safetensors (it runs in the peers' own venvs).

    OUT.safetensors: {module name: W_hat float32 [out, in]}, metadata {"bits": JSON {module: bits its tool stores}}
"""
import json

from safetensors import safe_open
from safetensors.torch import save_file


def decoder_linears(model_dir):
    """(module name, float32 weight [out, in]) for every q/k/v/o/gate/up/down projection of model.safetensors."""
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        for name in f.keys():
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                yield name.removesuffix(".weight"), f.get_tensor(name).float()


def stored_bits(tensors):
    return 8 * sum(t.numel() * t.element_size() for t in tensors)


def save(out, weights, bits):
    save_file({k: v.float().contiguous() for k, v in weights.items()}, out, metadata={"bits": json.dumps(bits)})
