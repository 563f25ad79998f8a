"""Data-free sensitivities: the diagonal Fisher information of a model's linears, estimated on text the model
writes itself (no calibration text is read).

What a model's output loses when its weights move by dW is, to second order and keeping only the diagonal F of
the Fisher information, a weighted squared error:

    KL(p || p_hat) ~ 1/2 sum_ij F_ij dW_ij^2,    F = E_x E_{y ~ p(.|x)} (d log p(y|x) / dW)^2

The inputs x are sequences the model samples itself (self_generated_ids) and the labels y are drawn from its own
predictions, so the estimate needs no data. fisher_importance averages F over each output row (phi_j, one number
per output channel) and divides by Z = sum_rows phi_j ||W_j||^2 / (weights of all listed linears), which makes
phi_j / Z a weight for a relative squared error shared by the whole model: a quantizer that minimizes
sum_j phi_j / Z ||W_hat_j - W_j||^2 / numel trades its rate against the estimated KL in every layer alike.

output_fisher keeps the Fisher's output side instead, for a quantizer that knows its layer's input Hessian H
(GPTQ): a change E of a linear's weight moves log p(y) by g^T E x (g = d log p(y) / d out), so, keeping only the
diagonal of g's second moment and taking g and x independent (K-FAC's factorization; YAQA, arXiv 2505.22988, keeps
the whole output factor),

    KL(p || p_E) ~ 1/2 E[(g^T E x)^2] ~ 1/4 sum_o G_o e_o H e_o^T,      G_o = E[g_o^2],  H = 2 E[x x^T]

a row's layer error e_o H e_o^T weighted by its G_o is in nats of the model's KL: one currency for every linear of
every layer, which the layer's own output error is not (the residual stream grows along the model, and what it is
worth at the output does not). It is measured with one backward pass one decoder layer at a time: a forward
through the layers keeps each layer's input, the head draws y ~ p (seeded) and gives d log p(y) / d hidden, then
each layer, from the last, runs again on its kept input and backpropagates that gradient to the layer below, its
linears' output gradients squared and summed on the way. Only one layer needs to be in memory at a time (`load` /
`free`: the streaming converter reads it from disk), and the layers' inputs for the calibration sequences.
"""
import torch
from tqdm import tqdm


def parse_sensitivity(sensitivity):
    """None or "none" -> None (a quantizer's plain loss); "fisher" -> "fisher" (weighted by fisher_importance)."""
    if sensitivity in (None, "none"):
        return None
    if sensitivity != "fisher":
        raise ValueError(f"sensitivity must be 'none' (the plain loss) or 'fisher', got {sensitivity!r}")
    return sensitivity


def _vocab_and_device(model):
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError("the model needs cfg.vocab_size (an engine Qwen3) to sample its own text")
    return vocab, next(model.parameters()).device


@torch.no_grad()
def self_generated_ids(model, samples=64, seq_len=128, seed=0, start=None, on_token=None):
    """ids [samples, seq_len]: what the model writes itself (temperature 1, eval mode) after a uniformly random first
    token (after `start` [samples, k], e.g. the BOS a tokenizer puts first, when given). No calibration text is
    read: this is the only input the Fisher estimate sees. Seeded on the model's device, so a run repeats on the
    same device. on_token(ids [samples, 1]) sees each generated token (a progress bar)."""
    k = 0 if start is None else start.shape[-1]
    if not (isinstance(samples, int) and isinstance(seq_len, int) and samples >= 1 and seq_len >= k + 2):
        raise ValueError(f"need integers samples >= 1 and seq_len >= {k + 2}, got {samples!r} and {seq_len!r}")
    vocab, device = _vocab_and_device(model)
    if start is not None and (start.shape != (samples, k) or int(start.min()) < 0 or int(start.max()) >= vocab):
        raise ValueError(f"start must be [samples, k] ids below {vocab}, got {tuple(start.shape)}")
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    try:
        model.eval()
        first = torch.randint(vocab, (samples, 1), generator=g, device=device)
        if start is not None:
            first = torch.cat([start.to(device), first], 1)
        return model.generate(first, seq_len - first.shape[1], temperature=1.0, generator=g, on_token=on_token)
    finally:
        model.train(was_training)


def fisher_importance(model, names, ids, draws=4, batch_size=8, seed=0):
    """Per-output-row importance {name: [out]} of the listed linears: the diagonal Fisher information of their
    weights, F = E_x E_{y ~ p(.|x)} (d log p(y|x) / dW)^2, averaged over each row (phi_j), divided by
    Z = sum_rows phi_j ||W_j||^2 / (weights of all listed linears). ids [batch, T]: the inputs x (self_generated_ids).

    Labels y are sampled from the model's own predictions (draws per batch, one forward pass and `draws` backward
    passes), so no text is needed. Summing the log-likelihood over the positions of a batch before squaring keeps
    the estimate of sum_positions F unbiased: given the inputs the labels are drawn independently and each position's
    score has mean zero, so the cross terms vanish in expectation. What is accumulated is that sum over positions
    and draws, not the mean F; the scale cancels in the division by Z (a ratio: consistent, not unbiased)."""
    if not names or len(set(names)) != len(names):
        raise ValueError("fisher_importance needs a non-empty list of distinct linear names")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.numel() and not ids.is_floating_point()):
        raise ValueError(f"ids must be a non-empty [batch, T] integer tensor, got {getattr(ids, 'shape', ids)}")
    if draws < 1 or batch_size < 1:
        raise ValueError(f"draws ({draws}) and batch_size ({batch_size}) must be >= 1")
    if torch.is_inference_mode_enabled():
        raise ValueError("fisher_importance needs gradients: call it outside torch.inference_mode()")
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), torch.nn.Linear)]
    if missing:
        raise ValueError(f"fisher_importance: not linears of this model: {missing[:3]}")
    _, device = _vocab_and_device(model)
    weights = {n: modules[n].weight for n in names}
    acc = {n: torch.zeros(w.shape[0], device=w.device) for n, w in weights.items()}    # row sums of grad^2
    flags, was_training = {p: p.requires_grad for p in model.parameters()}, model.training
    g = torch.Generator(device=device).manual_seed(seed)
    try:
        model.eval()
        for p in flags:
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
        with torch.enable_grad():
            for batch in ids.to(device).split(batch_size):
                logits = model(batch).float().flatten(0, 1)
                probs = logits.detach().softmax(-1)
                for d in range(draws):
                    y = torch.multinomial(probs, 1, generator=g)[:, 0]
                    loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                    grads = torch.autograd.grad(loss, list(weights.values()), retain_graph=d + 1 < draws,
                                                allow_unused=True)          # an unused linear has Fisher 0
                    for n, grad in zip(weights, grads):
                        if grad is not None:
                            acc[n] += grad.float().square().sum(1)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)
    phi = {n: acc[n] / weights[n].shape[1] for n in weights}
    z = sum((phi[n] * weights[n].detach().float().square().sum(1)).sum() for n in weights)
    z = z / sum(w.numel() for w in weights.values())
    if not z > 0:
        raise ValueError("the Fisher estimate is zero: the model's predictions do not depend on these weights")
    return {n: (v / z).cpu() for n, v in phi.items()}


SEQUENCES = 16          # calibration sequences the Fisher is measured on (the first ones)


def output_fisher(model, batches, sequences=SEQUENCES, seed=0, load=None, free=None, progress=None):
    """{full linear name: G float32 [out]} for every linear of the decoder layers: the mean over the positions of the
    first `sequences` calibration sequences of (d log p(y) / d out_o)^2, y drawn from the model's own next-token
    distribution (a torch.Generator seeded by `seed`). batches: what the first decoder layer receives,
    [(hidden [b, T, hidden], *rope tables)] (calibration.first_layer_batches). model: an engine Qwen3 whose final
    norm and lm_head are loaded; its decoder layer i is load(i) (default: model.model.layers[i]), and free(i) is
    called when the pass is done with it. progress: a bar over the two passes (None: on a terminal only)."""
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1 or not batches:
        raise ValueError(f"output_fisher needs calibration batches and sequences >= 1, got {len(batches)} batches "
                         f"and sequences={sequences!r}")
    load, free = load or (lambda i: model.model.layers[i]), free or (lambda i: None)
    taken = []
    for h, *rope in batches:                                   # the first `sequences` only
        if sequences > 0:
            taken.append((h[:sequences], *rope))
            sequences -= len(taken[-1][0])
    batches, sums = taken, {}
    positions = sum(h.shape[0] * h.shape[1] for h, *_ in batches)
    layers, kept = model.cfg.num_hidden_layers, []            # kept: each layer's inputs, batch by batch
    bar = tqdm(total=2 * layers, desc="output Fisher", unit="layer", leave=False,
               disable=None if progress is None else not progress)
    with torch.no_grad():
        for i in range(layers):
            layer = load(i)
            kept.append([args[0] for args in batches])
            batches = [(layer(*args), *args[1:]) for args in batches]
            free(i)
            bar.update()
    generator = torch.Generator().manual_seed(seed)
    grads = []
    with torch.enable_grad():
        for h, *_ in batches:                # the head, a sequence at a time (the logits are T x vocab floats each)
            rows = []
            for row in h:                    # autograd.grad: the weights' .grad is never touched
                row = row.detach().requires_grad_()
                logp = torch.log_softmax(model.lm_head(model.model.norm(row)).float(), -1)
                y = torch.multinomial(logp.detach().exp(), 1, generator=generator)
                rows.append(torch.autograd.grad(logp.gather(1, y).sum(), row)[0])
            grads.append(torch.stack(rows))
        for i in reversed(range(layers)):
            layer = load(i)
            hooks = [m.register_forward_hook(_squared_grads(sums, f"model.layers.{i}.{n}"))
                     for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
            try:
                for b, (x, (_, *rope)) in enumerate(zip(kept[i], batches)):
                    x = x.detach().requires_grad_()
                    grads[b], = torch.autograd.grad(layer(x, *rope), x, grads[b])
            finally:
                for hook in hooks:
                    hook.remove()
            kept[i] = None
            free(i)
            bar.update()
    bar.close()
    return {name: (s / positions).float() for name, s in sums.items()}


def _squared_grads(sums, name):
    """A forward hook that adds the sum over positions of the output's gradient squared into sums[name] [out]."""
    def hook(module, args, out):
        def add(grad):
            part = grad.detach().double().pow(2).reshape(-1, grad.shape[-1]).sum(0)
            sums[name] = sums[name] + part if name in sums else part
        out.register_hook(add)
    return hook
