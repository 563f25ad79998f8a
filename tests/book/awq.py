"""Chapter 39's AWQ listings, typed as a reader would (`pytest tests/test_ch39_awq.py --yours tests/book/awq.py`).
fake_quantize, quantize_to_affine, pack_nibbles and AffineQuantLinear are chapters 20 and 38's; here the engine's."""
import torch

from engine.formats.numerics.affine import AffineQuantLinear, fake_quantize, pack_nibbles, quantize_to_affine

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@torch.no_grad()
def search_scale(weights, inputs, bits=4, group_size=128, grid=20):
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    x_mean = x.abs().mean(0)
    reference = [x @ w.float().T for w in weights]
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(grid):
        alpha = step / grid
        s = x_mean.clamp_min(1e-4) ** alpha
        s = s / (s.max() * s.min()).sqrt()
        error = 0.0
        for w, ref in zip(weights, reference):
            approx = (x / s) @ fake_quantize(w.float() * s, bits, group_size).T
            error += (approx - ref).pow(2).mean().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def apply_awq(model, calibration_ids, bits=4, group_size=128):
    captured = {}

    def hook(name):
        def save(module, args, output):
            captured.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))
        return save

    handles = []
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            handles.append(layer.get_submodule(name).register_forward_hook(hook(f"{i}.{name}")))
    model(calibration_ids)
    for h in handles:
        h.remove()
    replaced = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = lambda name: torch.cat(captured[f"{i}.{name}"])                      # noqa: E731
        pairs = [(layer.input_layernorm, None, [attn.q_proj, attn.k_proj, attn.v_proj], x("self_attn.q_proj")),
                 (layer.post_attention_layernorm, None, [mlp.gate_proj, mlp.up_proj], x("mlp.gate_proj")),
                 (None, attn.v_proj, [attn.o_proj], x("self_attn.o_proj")),
                 (None, mlp.up_proj, [mlp.down_proj], x("mlp.down_proj"))]
        for norm, previous, linears, inputs in pairs:
            if previous is attn.v_proj and attn.v_proj.out_features != attn.o_proj.in_features:
                continue                                    # GQA: v's rows feed several heads' columns
            s, _ = search_scale([l.weight for l in linears], inputs, bits, group_size)  # noqa: E741
            if norm is not None:
                norm.weight.div_(s.to(norm.weight.dtype))
            else:
                previous.weight.div_(s[:, None].to(previous.weight.dtype))
            for linear in linears:
                linear.weight.mul_(s[None, :].to(linear.weight.dtype))
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, child)
            codes, scale, offset = quantize_to_affine(linear.weight, bits, group_size)
            quantized = AffineQuantLinear(pack_nibbles(codes), scale, offset, group_size, True,
                                          dtype=linear.weight.dtype)
            setattr(parent, child, quantized)
            replaced[f"model.layers.{i}.{name}"] = quantized
    return replaced


def pack_awq(codes, zeros):
    """[rows, cols] codes 0..15 -> int32 [rows, cols / 8] in AWQ's interleaved order."""
    c = codes.to(torch.int64)
    packed = torch.zeros(c.shape[0], c.shape[1] // 8, dtype=torch.int64)
    for j, o in enumerate(AWQ_ORDER):
        packed |= c[:, o::8] << (4 * j)
    return ((packed + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def unpack_awq(packed):
    out = torch.zeros(packed.shape[0], packed.shape[1] * 8, dtype=torch.uint8)
    for j, o in enumerate(AWQ_ORDER):
        out[:, o::8] = ((packed >> (4 * j)) & 0xF).to(torch.uint8)
    return out


def to_checkpoint(layer):
    """AffineQuantLinear (from apply_awq) -> AutoAWQ GEMM tensors."""
    codes = layer.weight_codes.T                                        # [in, out]
    scales = layer.scales.T                                             # [groups, out]
    zeros = (-layer.offsets / layer.scales).round().T                   # offset = -zero * scale
    return {"qweight": pack_awq(codes, None), "qzeros": pack_awq(zeros.clamp(0, 15), None),
            "scales": scales.to(torch.float16).contiguous()}


def from_checkpoint(qweight, qzeros, scales, group_size, bias=None, dtype=torch.bfloat16):
    codes = unpack_awq(qweight).T                                       # [out, in]
    zeros = unpack_awq(qzeros).T.float()                                # [out, groups]
    s = scales.T.float()
    return AffineQuantLinear(pack_nibbles(codes), s, -zeros * s, group_size, True, bias=bias, dtype=dtype)
