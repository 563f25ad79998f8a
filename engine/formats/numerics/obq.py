"""The error-feedback loop (OBQ, GPTQ, LDLQ), written once: quantize a weight's columns in order and, after each
step, move the columns not yet quantized so that the layer's output on the calibration inputs X changes least.

    minimize tr(E H E^T),   E = W_hat - W,   H = 2 X^T X / n   (the same H for every output row)
    U = upper Cholesky factor of H^-1: row j holds [H^-1]_jk / sqrt([H^-1]_jj) for the columns k >= j still left
    for each step B (one column, or a block of columns coded together), in order:
        W_hat_B  = quantize(B)                      any rounding: an integer grid, E4M3, a trellis path
        E_B      = (W_B - W_hat_B) U_BB^-1          one column: (w_j - q_j) / U_jj
        W_later -= E_B U_B,later                    the best linear correction of the columns after B

GPTQ rounds one column at a time to its group's integer grid, EntQuant's feedback rounds to E4M3 at the row's
scale, QTIP's BlockLDLQ trellis-codes 16 columns at a time: three callers of this loop, each with its own
`quantize(j, current)`. The quantizer gets the step's first column j and `current(a, b)`, the columns a..b-1 as
corrected so far (a >= j; GPTQ reads a whole group ahead to choose its grid), and returns W_hat of the step's
columns [out, step].

`error_feedback_reference` is the textbook loop: each correction lands on every later column at once, out * in^2
work in rank-one updates. `error_feedback` is GPTQ's lazy batch: corrections land inside a block of 128 columns
at once and on the columns after the block in one matrix product when it ends, the same arithmetic in another
order (equal to float rounding, tests/test_obq.py), most of it in large matmuls.

Rows are independent given H: each row's codes depend on that row and on U alone. So that a block of rows gives
bit for bit the codes the whole matrix gives them (engine.distributed splits a linear's rows over the ranks), every
product that sums over several columns ([rows, k] @ [k, n] with k > 1: a BLAS may pick another kernel, another
summation order, for another row count; on this machine's MKL, below 8 rows) is taken in fixed blocks of ROWS rows,
counted from the first row: a share of rows that starts at a multiple of ROWS meets the same blocks. A one-column
step's update (k = 1) is left whole: each entry is one product, one rounding, whatever the kernel.
"""
import torch

ROWS = 64                   # rows per block of the products above; a share of rows starts at a multiple of it


def inverse_cholesky(hessian, damp=0.01):
    """H [in, in] -> U [in, in]: the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in H's dtype.

    An input that is never active (H_jj = 0) gets H_jj = 1 first, so H stays positive definite; its weight cannot
    change the output, whatever the caller stores for it. damp (GPTQ's 1% by default) keeps the inverse stable
    when inputs are nearly collinear.

    The reference code (and the book) factors, inverts and factors again: cholesky(cholesky_inverse(cholesky(H)),
    upper=True), about 4/3 in^3 flops. One factorization and one triangular inverse give the same U: with J the
    exchange matrix (the inputs in reverse order), J H J = M M^T makes H = R R^T with R = J M J upper triangular,
    so H^-1 = R^-T R^-1 = U^T U with U = R^-1 upper, the unique factor with a positive diagonal: about in^3 flops,
    most of them in matrix products, and U^T U H nearer I (tests/test_obq.py)."""
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H += damp * torch.diag(H).mean().clamp_min(1e-12) * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    M, info = torch.linalg.cholesky_ex(H.flip(0, 1))
    if info:
        raise ValueError(f"the damped Hessian [{len(H)}, {len(H)}] is not positive definite"
                         f"{'' if torch.isfinite(H).all() else ' (it holds inf or NaN: the calibration inputs do)'}: "
                         "the error feedback's factor cannot be made from it")
    return upper_inverse(M.flip(0, 1))


def upper_inverse(R):
    """R [n, n] upper triangular -> R^-1 (upper), by halves, in matrix products (torch has no LAPACK trtri; a
    triangular solve against I does half as much work again):

        [[A, B], [0, D]]^-1 = [[A^-1, -A^-1 B D^-1], [0, D^-1]]
    """
    n = R.shape[0]
    if n <= 256:
        return torch.linalg.solve_triangular(R, torch.eye(n, dtype=R.dtype, device=R.device), upper=True)
    h = n // 2
    a, d = upper_inverse(R[:h, :h]), upper_inverse(R[h:, h:])
    out = torch.zeros_like(R)
    out[:h, :h], out[h:, h:] = a, d
    out[:h, h:] = -(a @ R[:h, h:]) @ d
    return out


def by_rows(fn, a, *rest):
    """fn(a[r:r + ROWS], *rest) for each block of ROWS rows of a, concatenated, row-major: the same bytes for any
    share of the rows that starts at a multiple of ROWS (the module docstring). Row-major whatever fn returns (a
    LAPACK solve returns column-major): a product then reads its operand in one layout, with one kernel."""
    if a.shape[0] <= ROWS:
        return fn(a, *rest).contiguous()
    return torch.cat([fn(a[r:r + ROWS], *rest) for r in range(0, a.shape[0], ROWS)])


def _product(a, b):
    """a [rows, k] @ b [k, n], in blocks of ROWS rows (k = 1: whole, one product per entry)."""
    return a @ b if a.shape[1] == 1 else by_rows(torch.matmul, a, b)


def _subtract_product(target, a, b):
    """target -= a @ b in place, target [rows, n] a view, a block of ROWS rows at a time."""
    if a.shape[1] == 1 or a.shape[0] <= ROWS:
        target -= a @ b
        return
    for r in range(0, a.shape[0], ROWS):
        target[r:r + ROWS] -= a[r:r + ROWS] @ b


def _scaled_error(diff, U_BB):
    """(W_B - W_hat_B) U_BB^-1 for a step's columns diff [out, step]; for one column a division by U_jj."""
    if U_BB.shape[0] == 1:
        return diff / U_BB[0, 0]
    return by_rows(lambda d: torch.linalg.solve_triangular(U_BB, d, upper=True, left=False), diff)


def _check(weight, U, step):
    cols = weight.shape[1]
    if U.shape != (cols, cols):
        raise ValueError(f"U has shape {tuple(U.shape)}, expected ({cols}, {cols}) for a weight of {cols} columns")
    if not isinstance(step, int) or step < 1 or cols % step:
        raise ValueError(f"step must be a positive int that divides the {cols} columns, got {step!r}")


@torch.no_grad()
def error_feedback_reference(weight, U, quantize, step=1):
    """The textbook loop. weight [out, in] (columns in the order they are visited), U [in, in] from
    inverse_cholesky, quantize(j, current) -> W_hat[:, j:j+step] -> W_hat [out, in]."""
    _check(weight, U, step)
    W = weight.clone()
    W_hat = torch.empty_like(W)

    def current(a, b, as_of_block=False):
        if as_of_block:
            raise ValueError("as_of_block: the textbook loop has no blocks (error_feedback has)")
        return W[:, a:b]

    for j in range(0, W.shape[1], step):
        B, later = slice(j, j + step), slice(j + step, None)
        W_hat[:, B] = quantize(j, current)
        E = _scaled_error(W[:, B] - W_hat[:, B], U[B, B])
        W[:, later] -= E @ U[B, later]
    return W_hat


@torch.no_grad()
def error_feedback(weight, U, quantize, step=1, block=128):
    """The lazy-batch loop, the same result as error_feedback_reference to float rounding (arguments as there).
    block: how many columns a batch holds, a multiple of step. current(a, b, as_of_block=True) gives the columns as
    they stood when the block began instead (the reference GPTQ code's grid rule; the textbook loop has no blocks)."""
    _check(weight, U, step)
    if block % step:
        raise ValueError(f"block ({block}) must be a multiple of step ({step})")
    W = weight.clone()
    out_f, cols = W.shape
    W_hat = torch.empty_like(W)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        W1 = W[:, b0:b1].clone()                          # the block's columns, corrected as the block goes
        errors = torch.zeros_like(W1)                     # E of the block's steps so far (zero for those to come)

        def current(a, b, as_of_block=False):
            if as_of_block:
                return W[:, a:b]
            inside = W1[:, a - b0:min(b, b1) - b0]
            if b <= b1:
                return inside
            pending = W[:, b1:b] - _product(errors, U[b0:b1, b1:b])   # past the block, their update brought forward
            return torch.cat((inside, pending), 1)

        for j in range(b0, b1, step):
            B, local = slice(j, j + step), slice(j - b0, j - b0 + step)
            W_hat[:, B] = quantize(j, current)
            E = _scaled_error(W1[:, local] - W_hat[:, B], U[B, B])
            errors[:, local] = E
            _subtract_product(W1[:, local.stop:], E, U[B, j + step:b1])
        _subtract_product(W[:, b1:], errors, U[b0:b1, b1:])
    return W_hat


def layer_error(w_hat, weight, hessian):
    """tr(E H E^T), E = W_hat - W [out, in]: the layer's output error on the calibration inputs (GPTQ's objective,
    measured with the undamped H), in float64."""
    e = (w_hat - weight).double()
    return float((e @ hessian.double() * e).sum())


def row_shares(linears, world, unit=ROWS):
    """{name: (rows, in_features)} of one step's linears (the step's order) -> {name: [(rank, first row, end row),
    ...]}: who runs each linear's error feedback, on which of its output rows.

    Rows are independent given H, so a linear's rows can be cut among the ranks, but every rank with a share pays
    the whole inverse-Hessian factor and an exchange. On one core the factor costs about in^3 * 2e-11 s and the
    feedback rows * in^2 * 8e-11 s (in = 3072: 0.55 s, and 0.75 s for 1024 rows), so the plans are priced in integer
    units of in^2 * (4 rows + in) (every rank reaches the same plan): the j largest linears cut into world shares
    of whole blocks of `unit` rows (ROWS: a share that starts on a block gets the bytes the whole matrix gives it),
    the others whole, largest first, each on the rank with the least work so far (the lowest on a tie), for j = 0, 1,
    ...; the plan whose longest rank is shortest wins, the fewer cuts on a tie. On 2 ranks that cuts
    o_proj and down_proj (alone in their steps) and keeps q/k/v and gate/up whole; on 8, gate/up are cut too."""
    cost = {n: cols * cols * (4 * rows + cols) for n, (rows, cols) in linears.items()}
    order = sorted(linears, key=lambda n: -cost[n])                     # stable: the step's order on a tie

    def placed(cut):
        load, shares = [0] * world, {}
        for name in order:
            rows, cols = linears[name]
            blocks = -(-rows // unit)
            if name in cut and blocks > 1:
                ends = [min(rows, r * blocks // world * unit) for r in range(world + 1)]
                shares[name] = [(r, a, b) for r, (a, b) in enumerate(zip(ends, ends[1:])) if b > a]
            else:
                shares[name] = [(min(range(world), key=lambda r: load[r]), 0, rows)]
            for r, a, b in shares[name]:
                load[r] += cols * cols * (4 * (b - a) + cols)
        return max(load), {name: shares[name] for name in linears}

    plans = [placed(set(order[:j])) for j in range(len(order) + 1 if world > 1 else 1)]
    return min(plans, key=lambda p: p[0])[1]
