"""A bits budget spent where it matters: choose one option (a GGML type, a bit width) per linear so that the layers
meet a budget of bits per weight with the lowest measured error.

The error of an option is measured, not guessed. GPTQ's mix (gptq_ggml.layer_errors) runs GPTQ on the option's grid
and prices the error it leaves in one currency for the layer's linears, so that the costs of q_proj and down_proj
add up: by default what it adds to the decoder layer's output (the residual stream every linear writes into),

    cost_l(o) = sum_tokens || layer(x; W_l -> Q_o(W_l)) - layer(x) ||^2          bits_l(o) = weights_l * bpw(o)

measured once per linear for a round-to-nearest probe (output_costs) as the linear's sensitivity, which scales
GPTQ's layer error on each candidate grid; or (plan="fisher") in the model's output KL, each row's layer error
weighted by its output Fisher (numerics/sensitivity.py: output_fisher).
Then a multiple-choice knapsack, solved greedily on each linear's lower convex hull of (bits, cost): start every
linear at its cheapest option and keep taking the upgrade with the largest cost saved per bit spent while the
budget allows (on the hull the greedy choice is optimal for the budget it ends at), then spend what is left on the
single changes that save the most error while any fits. llama.cpp's `_M` mixes hand-pick such upgrades (more bits
for attn_v and ffn_down); here the calibration data picks them.
"""
import heapq

import torch


def _hull(options):
    """[(bits, cost, option)] -> the lower convex hull from the cheapest option on, the options worth taking."""
    hull = []
    for point in sorted(options, key=lambda p: (p[0], p[1])):
        if hull and point[1] >= hull[-1][1]:                   # more bits, no less error: never worth it
            continue
        while len(hull) >= 2:
            (b0, c0, _), (b1, c1, _) = hull[-2], hull[-1]
            if (c1 - c0) * (point[0] - b0) >= (point[1] - c0) * (b1 - b0):   # hull[-1] lies above the chord
                hull.pop()
            else:
                break
        hull.append(point)
    return hull


def choose(table, budget_bits):
    """table {name: {option: (bits, cost)}}, budget_bits -> {name: option}: the lowest total cost found within the
    budget (greedy on the convex hulls). ValueError if even the cheapest options exceed it."""
    hulls = {name: _hull([(b, c, o) for o, (b, c) in options.items()]) for name, options in table.items()}
    step = dict.fromkeys(hulls, 0)
    spent = sum(h[0][0] for h in hulls.values())
    if spent > budget_bits:
        total = sum(min(b for b, _ in options.values()) for options in table.values())
        raise ValueError(f"a budget of {budget_bits:.0f} bits is below the cheapest choice ({total:.0f} bits)")
    queue = []

    def offer(name):
        h, k = hulls[name], step[name]
        if k + 1 < len(h):
            (b0, c0, _), (b1, c1, _) = h[k], h[k + 1]
            heapq.heappush(queue, ((c1 - c0) / (b1 - b0), name))          # most negative: most error saved per bit

    for name in hulls:
        offer(name)
    while queue:
        _, name = heapq.heappop(queue)
        h, k = hulls[name], step[name]
        extra = h[k + 1][0] - h[k][0]
        if spent + extra <= budget_bits:
            spent += extra
            step[name] = k + 1
            offer(name)
    chosen = {name: hulls[name][step[name]][2] for name in hulls}
    # the greedy walk stops at the first hull step that does not fit; what is left buys, while anything fits, the
    # change (to any option, on or off the hull) that saves the most error
    while True:
        best = None
        for name, options in table.items():
            b0, c0 = options[chosen[name]]
            for option, (b, c) in options.items():
                if c < c0 and spent - b0 + b <= budget_bits and (best is None or c - c0 < best[0]):
                    best = (c - c0, name, option, b - b0)
        if best is None:
            return chosen
        _, name, option, extra = best
        chosen[name], spent = option, spent + extra


@torch.no_grad()
def output_costs(layer, candidates, max_sequences=4):
    """layer: a calibration.LayerCalibration; candidates {full linear name: {option: (bits, make)}}, make(linear) ->
    the quantized replacement -> {name: {option: (bits, cost)}} (cost as in the module docstring, on the first
    max_sequences calibration sequences). An MLP linear reruns only the MLP, from the attention's kept output. Every
    linear is put back as it was."""
    decoder, samples, left = layer.layer, [], max_sequences
    for args in layer.batches:
        if left > 0:
            samples.append((args[0][:left], *args[1:]))
            left -= len(samples[-1][0])
    split = hasattr(decoder, "attention_residual")               # the engine's decoder layer: attention, then MLP
    kept = [decoder.attention_residual(*args[:3]) for args in samples] if split else None

    def run(name):
        if split and name.startswith("mlp."):
            return [decoder.mlp_residual(h) for h in kept]
        return [decoder(*args) for args in samples]

    reference, table = run(""), {}
    for name, options in candidates.items():
        relative = name.removeprefix(layer.prefix)
        parent, _, child = relative.rpartition(".")
        owner = decoder.get_submodule(parent)
        original = getattr(owner, child)
        table[name] = {}
        try:
            for option, (bits, make) in options.items():
                setattr(owner, child, make(original))
                cost = sum(float((out - ref).double().pow(2).sum()) for out, ref in zip(run(relative), reference))
                table[name][option] = (bits, cost)
        finally:
            setattr(owner, child, original)
    return table
