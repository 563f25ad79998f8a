"""EntQuant with error feedback (our addition, optional: feedback="self"): the same codes, scales and streams, but
each weight's code is chosen knowing the errors already made in its row, as GPTQ / OBS does.

The paper rounds every weight to its nearest E4M3 value at its row's scale. With the inputs' second moment
H = 2 X^T X / n of a linear, the output error of a weight error E is tr(E H E^T) / 2; quantizing the columns in
order and, after each column i, spreading its error over the columns not yet quantized,

    W[:, j] -= (W[:, i] - Q[:, i]) * U[i, j] / U[i, i]   for j > i,   U = upper Cholesky factor of H^-1,

leaves the later columns to cancel what column i got wrong (Frantar et al., GPTQ; the loop is obq.py's). The
quantizer is EntQuant's own (E4M3 or int8 at the row's fixed scale 2^s), so the format, the storage and the decoder
stay exactly the paper's; only which code each weight gets changes, and the entropy of the codes with it (the lambda
search then meets the rate). To stay data-free, X is text the model writes itself (numerics/sensitivity.py's self_generated_ids):
no calibration text is read. The Hessians are those of the float model, all captured in one pass.

feedback="calibration" gives up data-freedom for Hessians of real text: X is calibration text, the hidden states that
reach each block through the blocks quantized before it (GPTQ's walk, block by block, so that each block's codes
also answer the errors of those before; each block's lambda is then searched for that block alone, as the
streaming converter does, which runs it too).
"""
import torch

from .numerics.calibration import capture
from .entropy_scales import quantize_codes
from .numerics.obq import error_feedback, inverse_cholesky


def parse_feedback(feedback):
    """None or "none" -> None (the paper's nearest codes); "self" (error feedback, the Hessians from self-generated
    text) or "calibration" (error feedback, the Hessians from calibration text, block by block) as they are."""
    if feedback in (None, "none"):
        return None
    if feedback not in ("self", "calibration"):
        raise ValueError(f"feedback must be 'none' (nearest codes), 'self' (error feedback with Hessians from "
                         f"self-generated text) or 'calibration' (Hessians from calibration text), got {feedback!r}")
    return feedback


def check_damp(feedback_damp):
    """feedback_damp, refused unless a finite number >= 0."""
    if not (isinstance(feedback_damp, (int, float)) and not isinstance(feedback_damp, bool)
            and 0 <= feedback_damp < float("inf")):
        raise ValueError(f"feedback_damp must be a finite number >= 0 (a fraction of the Hessian's mean diagonal), "
                         f"got {feedback_damp!r}")


def self_hessians(model, names, ids, batch_size=8):
    """{name: H [in, in] = 2 X^T X / n} of the named linears' inputs on ids [batch, T] (self_generated_ids), from
    one forward pass of the (float) model per batch."""
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), torch.nn.Linear)]
    if missing:
        raise ValueError(f"self_hessians: not linears of this model: {missing[:3]}")
    with torch.no_grad():
        stats = capture({n: modules[n] for n in names}, ids.split(batch_size), lambda b, batch: model(batch))
    return {n: s.hessian for n, s in stats.items()}


@torch.no_grad()
def feedback_weight(weight, log_scale, hessian, fmt="float8", keep=None, damp=0.01, block=128):
    """weight [out, in], log2 scales [out], hessian [in, in] -> W_hat [out, in] float32, every entry a code value
    times its row's 2^s (encode_weight(W_hat, log_scale) gives its codes exactly), chosen column by column in
    obq.error_feedback's loop (the module docstring's feedback). keep (bool [out, in], Int8 super weights): stored
    exactly, so their error is zero and their W_hat is 0 (the code beside the exact value). damp: added to H's
    diagonal, times its mean (GPTQ's dampening); block: the loop's lazy batch."""
    out_f, cols = weight.shape
    if hessian.shape != (cols, cols) or log_scale.shape != (out_f,):
        raise ValueError(f"hessian {tuple(hessian.shape)} and log_scale {tuple(log_scale.shape)} do not fit a "
                         f"weight of shape {tuple(weight.shape)}")
    W, H = weight.detach().float(), hessian.float()
    dead = torch.diag(H) == 0                                 # inputs never active: their weights cannot matter
    step, inv = torch.exp2(log_scale.float()), torch.exp2(-log_scale.float())
    exact = torch.zeros_like(W, dtype=torch.bool) if keep is None else keep

    def quantize(j, current):
        q = torch.where(dead[j] | exact[:, j], 0.0, quantize_codes(current(j, j + 1)[:, 0] * inv, fmt) * step)
        # a super weight's stored value is its original one: what remains of the feedback there is its error
        return torch.where(exact[:, j], W[:, j], q)[:, None]

    stored = error_feedback(W, inverse_cholesky(H, damp), quantize, block=block)
    return torch.where(exact, 0.0, stored)
