"""EntQuant's per-channel scales (engine/formats/entropy.py's first step): for a weight W [out, in], the log2
scales s [out] that minimize

    ||Q 2^s - W||_1 / ||W||_1 + lambda * R(Q),   Q = E4M3(clamp(W 2^-s, -448, 448))  (Int8: round, clamp +-127)
    R = 4 mean|Q| (Float8)  or  mean|Q| / 128 (Int8)

The l1 norm of Q stands in for its entropy (a differentiable proxy): shrinking it pushes weights into E4M3's
subnormal range, where the grid is uniform and coarse, so fewer distinct byte values occur. Gradients reach s
through a straight-through estimator (the cast and the clamp count as identity); torch.optim.LBFGS with a
strong-Wolfe line search minimizes over s. s is rounded to float16 (what is stored) at the end.
"""
import torch

from .numerics.minifloats import E4M3_MAX, round_e4m3

CODE_MAX = {"float8": E4M3_MAX, "int8": 127.0}          # largest code magnitude


def quantize_codes(x, fmt):
    """Values in code units [...] -> the nearest code values (float): E4M3 (saturating at 448) or int8."""
    return round_e4m3(x) if fmt == "float8" else x.round().clamp(-127.0, 127.0)


def _ste_codes(x, fmt):
    """Straight-through quantizer: forward = the stored code values, backward = identity (cast and clamp alike)."""
    return x + (quantize_codes(x.detach(), fmt) - x).detach()


def entquant_scales(weight, lam, fmt="float8", max_iter=500, history=100, lr=1.0, keep=None, importance=None):
    """weight [out, in] -> log2 scales s [out] (float32 holding float16 values) minimizing
    ||Q 2^s - W||_1 / ||W||_1 + lam * R(Q) with L-BFGS (strong Wolfe). keep (bool [out, in], optional) marks
    weights stored exactly (Int8 super weights): they take no part in the loss. importance [out] (optional, from
    fisher_importance: phi_j / Z) replaces the reconstruction term by sum_j importance_j ||W_hat_j - W_j||^2 / numel."""
    if fmt not in CODE_MAX:
        raise ValueError(f"fmt must be one of {sorted(CODE_MAX)}, got {fmt!r}")
    w = weight.detach().float()
    if keep is not None:
        w = w.masked_fill(keep, 0.0)
    top = CODE_MAX[fmt]
    absmax = w.abs().amax(1).clamp(min=torch.finfo(torch.float16).tiny)
    s = torch.log2(absmax / top).requires_grad_()              # start: absmax scaling, every weight representable
    norm = w.abs().sum().clamp(min=1e-30)
    rate_weight = 4.0 if fmt == "float8" else 1.0 / 128
    if importance is not None:
        importance = torch.as_tensor(importance).detach().to(w.device, torch.float32)
        if importance.shape != (w.shape[0],) or not bool(torch.isfinite(importance).all() & (importance >= 0).all()):
            raise ValueError(f"importance must be {w.shape[0]} finite, non-negative numbers (one per output row)")
        importance = importance[:, None]

    def loss_fn():
        q = _ste_codes(w * torch.exp2(-s)[:, None], fmt)
        err = q * torch.exp2(s)[:, None] - w
        recon = (err.abs().sum() / norm if importance is None else (importance * err.square()).sum() / w.numel())
        return recon + lam * rate_weight * q.abs().mean()

    opt = torch.optim.LBFGS([s], lr=lr, max_iter=max_iter, history_size=history, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return s.detach().to(torch.float16).float()


def super_weight_mask(weight, count):
    """bool [out, in]: the `count` weights of largest magnitude (Int8's super weights, kept exact)."""
    keep = torch.zeros(weight.numel(), dtype=torch.bool)
    if count > 0:
        keep[weight.detach().abs().reshape(-1).topk(min(count, weight.numel())).indices] = True
    return keep.reshape(weight.shape)
