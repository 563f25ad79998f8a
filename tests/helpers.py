"""Small helpers several test files share."""
import torch

from engine.formats.numerics import affine
from engine.qwen3 import Qwen3
from engine.safetensors_io import save_file, snapshot_tensors


def rewrite_tensors(directory, change):
    """Apply change(dict of tensors) to a checkpoint's model.safetensors in place (to make it malformed)."""
    tensors = dict(snapshot_tensors(directory))
    change(tensors)
    save_file(tensors, directory / "model.safetensors")


@torch.no_grad()
def rtn_baseline(model, held_out, group_size=32):
    """(reference logits of model, mean squared logit error of its RTN int4 copy) on held_out ids: the bar a
    calibrated method has to clear."""
    reference = model(held_out)
    rtn = Qwen3(model.cfg).eval()
    rtn.load_state_dict(model.state_dict())
    affine.quantize(rtn, bits=4, group_size=group_size)
    return reference, (rtn(held_out) - reference).pow(2).mean()


def method_io(method):
    """(parts, read, write) of a CheckpointMethod, each validating the quantization_config it is given first."""
    return (lambda config: method.parts(method.validate(config)),
            lambda tensors, config: method.read(tensors, method.validate(config)),
            lambda layer, config: method.write(layer, method.validate(config)))


def random_ids(batch, tokens, seed=1):
    """Token ids [batch, tokens] of a 256-token vocabulary, from a seed."""
    return torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def same(got, want, name, rule):
    """Assert two tensors equal; else say where and how they differ: "name[3, 0] is 7 where rule gives 6"."""
    if got.shape != want.shape:
        raise AssertionError(f"{name} has shape {tuple(got.shape)}; {rule} has {tuple(want.shape)}")
    differ = (got != want) & ~(got.isnan() & want.isnan()) if got.is_floating_point() else got != want
    if differ.any():
        at = tuple(int(i) for i in differ.nonzero()[0])
        index = ", ".join(map(str, at))
        raise AssertionError(f"{name}[{index}] is {got[at].item():g} where {rule} gives {want[at].item():g} "
                             f"({int(differ.sum())} of {differ.numel()} differ)")
