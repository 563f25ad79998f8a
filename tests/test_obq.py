"""The error-feedback loop (numerics/obq.py): the lazy batch equals the textbook loop, on matrices wider than
one block, for every caller (GPTQ, EntQuant's feedback, BlockLDLQ), and the feedback lowers the layer error; a
block of rows gets the bytes the whole matrix gives it (what lets the ranks split a linear's rows)."""
import pytest
import torch

from engine.formats import entropy_feedback, gptq, trellis
from engine.formats.gptq_order import visit_order
from engine.formats.llama_cpp import gptq_ggml
from engine.formats.numerics import obq

pytestmark = pytest.mark.usefixtures("one_thread")


def layer(out_f, in_f, seed, dtype=torch.float64):
    """A weight and the upper Cholesky factor U of its damped inverse Hessian, from correlated inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * in_f, in_f, generator=g) @ (torch.randn(in_f, in_f, generator=g) * 0.3 + torch.eye(in_f))
    h = (2 * x.T @ x / x.shape[0]).to(dtype)
    return torch.randn(out_f, in_f, generator=g, dtype=dtype), h, obq.inverse_cholesky(h)


def rounding(step_size=0.37):
    """A quantizer of one column (or a block of columns) to a plain grid: what the loop feeds back does not care."""
    return lambda j, current, width=1: (current(j, j + width) / step_size).round() * step_size


def output_error(w_hat, w, h):
    e = w_hat - w
    return float((e @ h * e).sum())


@pytest.mark.parametrize("step,block", [(1, 128), (1, 48), (4, 64), (4, 4)])
def test_lazy_batch_equals_the_textbook_loop(step, block):
    """300 columns: several blocks, so the update carried past each block (one matmul at its end) is exercised; a
    sign or index error there (or in the in-block update) changes the result."""
    w, _, U = layer(24, 300, 0)
    quantize = lambda j, current: rounding()(j, current, step)           # noqa: E731
    textbook = obq.error_feedback_reference(w, U, quantize, step)
    assert torch.equal(obq.error_feedback(w, U, quantize, step, block), textbook)
    assert not torch.equal(textbook, rounding()(0, lambda a, b: w[:, a:b], 300))    # the feedback moved codes


def test_a_quantizer_reading_ahead_sees_every_correction_so_far():
    """A group of 32 columns whose grid is chosen from its weights when the group is entered (GPTQ's rule), with
    blocks of 48 that cut groups in two: current() brings the pending update of the columns past the block forward,
    so the grids (and codes) are the textbook loop's."""
    w, _, U = layer(16, 160, 1)
    grids = {}

    def quantize(j, current):
        if j % 32 == 0:
            grids[j // 32] = current(j, j + 32).abs().amax(1, keepdim=True) / 7
        s = grids[j // 32]
        return (current(j, j + 1) / s).round().clamp(-8, 7) * s

    textbook = obq.error_feedback_reference(w, U, quantize)
    first = dict(grids)
    # the grids are continuous in the weights: float64 rounding of the two summation orders, nothing more
    assert torch.allclose(obq.error_feedback(w, U, quantize, block=48), textbook, rtol=0, atol=1e-12)
    assert all(torch.allclose(grids[g], first[g], rtol=0, atol=1e-12) for g in first)


def test_as_of_block_reads_the_block_as_it_began():
    """At column 40 of the block [32, 64), as_of_block gives columns 40..47 as they stood when column 32 was
    reached (the textbook loop's current() there), not as columns 32..39 have corrected them since."""
    w, _, U = layer(8, 64, 2)
    seen = {}

    def watch(at, key, **kw):
        def quantize(j, current):
            if j == at:
                seen[key] = current(40, 48, **kw).clone()
            return rounding()(j, current)
        return quantize

    obq.error_feedback(w, U, watch(40, "begun", as_of_block=True), block=32)
    obq.error_feedback(w, U, watch(40, "now"), block=32)
    obq.error_feedback_reference(w, U, watch(32, "at 32"))
    assert torch.allclose(seen["begun"], seen["at 32"], rtol=0, atol=1e-12)
    assert not torch.allclose(seen["begun"], seen["now"], rtol=0, atol=1e-6)


def test_feedback_lowers_the_layer_error_and_step_must_divide():
    w, h, U = layer(32, 128, 3)
    fed = obq.error_feedback(w, U, rounding(0.5))
    nearest = (w / 0.5).round() * 0.5
    assert output_error(fed, w, h) < 0.7 * output_error(nearest, w, h)
    with pytest.raises(ValueError, match="step must be a positive int that divides"):
        obq.error_feedback(w, U, rounding(), step=3)
    with pytest.raises(ValueError, match="block .* must be a multiple of step"):
        obq.error_feedback(w, U, rounding(), step=4, block=30)
    with pytest.raises(ValueError, match="U has shape"):
        obq.error_feedback(w, U[:64, :64], rounding())


@pytest.mark.parametrize("n", [40, 300, 701])
def test_the_factor_is_the_textbooks_upper_cholesky_of_the_damped_inverse(n):
    """One factorization of the reversed H and a triangular inverse give the factor the book's three steps give
    (float64: they agree to rounding). 300 and 701 take upper_inverse's halves (below 256 a solve), 701 odd ones; a
    wrong flip gives the lower factor or another one, a sign error in the off-diagonal block a wrong inverse."""
    _, h, U = layer(1, n, 5)
    damped = h + 0.01 * torch.diag(h).mean() * torch.eye(n, dtype=h.dtype)
    book = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    assert torch.equal(U, U.triu()) and bool((torch.diag(U) > 0).all())
    assert torch.allclose(U, book, rtol=1e-9, atol=1e-12 * float(book.abs().max()))
    assert torch.allclose(U.T @ U @ damped, torch.eye(n, dtype=h.dtype), atol=1e-9)


def test_upper_inverse_inverts_an_upper_triangle():
    g = torch.Generator().manual_seed(2)
    r = (torch.randn(600, 600, generator=g, dtype=torch.float64) / 30).triu() + torch.eye(600, dtype=torch.float64)
    inverse = obq.upper_inverse(r)
    assert torch.equal(inverse, inverse.triu())
    assert torch.allclose(inverse @ r, torch.eye(600, dtype=torch.float64), atol=1e-10)


def test_a_hessian_that_is_not_positive_definite_is_a_clear_error():
    _, h, _ = layer(1, 300, 5)
    h[7, 7] = float("nan")                                          # calibration inputs that overflowed
    with pytest.raises(ValueError, match=r"not positive definite \(it holds inf or NaN"):
        obq.inverse_cholesky(h)
    with pytest.raises(ValueError, match=r"\[3, 3\] is not positive definite: the error feedback"):
        obq.inverse_cholesky(-torch.eye(3, dtype=torch.float64), damp=0.0)


def test_dead_inputs_do_not_break_the_factorization():
    w, h, _ = layer(4, 16, 4)
    h[3, :] = h[:, 3] = 0                                           # an input that was never active
    U = obq.inverse_cholesky(h)
    assert torch.isfinite(U).all() and U[3, 4:].abs().max() == 0    # its error moves no other column


def _textbook(monkeypatch, module):
    """Run `module`'s calls of the lazy loop through the textbook loop instead."""
    monkeypatch.setattr(module, "error_feedback", lambda w, U, q, step=1, block=128:
                        obq.error_feedback_reference(w, U, q, step))


def test_gptq_wider_than_a_block_equals_the_textbook_loop(monkeypatch):
    """GPTQ on 320 columns (three blocks) in an order whose groups straddle blocks: codes and grids as the textbook
    loop's, up to float32 rounding (a code at a rounding tie may flip)."""
    w, h, _ = layer(32, 320, 5, torch.float32)
    lazy = gptq.gptq_quantize(w * 0.05, h, 4, 64, order="group_aware")
    _textbook(monkeypatch, gptq)
    textbook = gptq.gptq_quantize(w * 0.05, h, 4, 64, order="group_aware")
    assert (lazy[0] != textbook[0]).float().mean() < 1e-3
    assert gptq.layer_error(gptq.dequantize_gptq(*lazy), w * 0.05, h) == pytest.approx(
        gptq.layer_error(gptq.dequantize_gptq(*textbook), w * 0.05, h), rel=1e-3)


def test_entquant_feedback_wider_than_a_block_equals_the_textbook_loop(monkeypatch):
    w, h, _ = layer(32, 300, 6, torch.float32)
    w = w * 0.05
    log_scale = torch.log2(w.abs().amax(1) / 448) + 3               # E4M3's range, 8x finer: many small codes
    lazy = entropy_feedback.feedback_weight(w, log_scale, h)
    _textbook(monkeypatch, entropy_feedback)
    textbook = entropy_feedback.feedback_weight(w, log_scale, h)
    assert (lazy != textbook).float().mean() < 1e-3
    assert output_error(lazy.double(), w.double(), h.double()) == pytest.approx(
        output_error(textbook.double(), w.double(), h.double()), rel=1e-3)


def test_block_ldlq_wider_than_a_block_equals_the_textbook_loop(monkeypatch):
    """BlockLDLQ on 256 columns (16 steps of 16, two lazy blocks): float64 inside, so the same codes exactly."""
    w, h, _ = layer(16, 256, 7, torch.float32)
    lazy = trellis.block_ldlq(w, h, L=8, K=2)
    _textbook(monkeypatch, obq)                     # block_ldlq imports the loop from obq when it runs
    textbook = trellis.block_ldlq(w, h, L=8, K=2)
    assert all(torch.equal(a, b) for a, b in zip(lazy, textbook))


def shares(out_f):
    """Cuts of out_f rows into shares that start at multiples of obq.ROWS, as the ranks take them: one share, one
    block then the rest, three blocks then a short last share."""
    R = obq.ROWS
    return [[0, out_f], [0, R, out_f], [0, R, 3 * R, out_f]] if out_f > 3 * R else [[0, out_f], [0, R, out_f]]


def by_shares(fn, w, cuts):
    """fn on each share of w's rows, the shares' results (tensors, or tuples of them) joined along the rows."""
    parts = [fn(w[a:b]) for a, b in zip(cuts, cuts[1:])]
    if torch.is_tensor(parts[0]):
        return torch.cat(parts)
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def same(a, b):
    return torch.equal(a, b) if torch.is_tensor(a) else all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("out_f", [3 * obq.ROWS + 3, 2 * obq.ROWS + 2, obq.ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_share_of_rows_gets_the_bytes_the_whole_matrix_gives_it(step, out_f, dtype):
    """The loop's products run in fixed blocks of ROWS rows, so a share of the rows that starts at a block gives
    those rows bit for bit what the whole matrix gives them, whatever the row count (3 rows last: this machine's
    MKL sums a [3, k] @ [k, n] in another order than a taller product; unblocked, this test fails). The quantizer
    halves each column, no rounding: any other sum shows."""
    w, _, U = layer(out_f, 300, 8, dtype)
    halve = lambda j, current: current(j, j + step) * 0.5          # noqa: E731
    whole = obq.error_feedback(w, U, halve, step)
    for cuts in shares(out_f):
        assert torch.equal(by_shares(lambda rows: obq.error_feedback(rows, U, halve, step), w, cuts), whole), cuts


@pytest.mark.parametrize("out_f", [3 * obq.ROWS + 3, 2 * obq.ROWS + 16])
def test_every_per_row_method_gives_a_share_of_rows_the_whole_matrix_bytes(out_f):
    """GPTQ in each kind of visit (its grids, act-order's permutation), GPTQ on llama.cpp's grids (a K-quant's
    per-row fields, the refit of its scales), EntQuant's feedback and BlockLDLQ (tiles of 16 rows): a share of the
    rows gets the codes, grids and fields the whole matrix gives it, and what is not per row (g_idx) is the same."""
    w, h, _ = layer(out_f, 512, 9, torch.float32)
    w = w * 0.05
    methods = {order: lambda rows, order=order: gptq.gptq_quantize(rows, h, 4, 128, order=order, min_zero=1)
               for order in ("act_order_static", "group_aware", "act_order", "natural")}
    for kind in ("Q4_K", "Q6_K", "Q5_0", "IQ4_XS"):
        perm = visit_order(torch.diag(h), gptq_ggml.group_size(kind), "act_order_static")
        methods[kind] = lambda rows, kind=kind, perm=perm: gptq_ggml.gptq_ggml(rows, h, kind, perm)
    methods["entquant"] = lambda rows: entropy_feedback.feedback_weight(rows, torch.log2(rows.abs().amax(1)) - 6, h)
    for name, fn in methods.items():
        whole = fn(w)
        for cuts in shares(out_f):
            joined = by_shares(fn, w, cuts)
            if name in ("act_order_static", "group_aware", "act_order", "natural"):    # g_idx: [in], not per row
                joined = (*joined[:3], fn(w[cuts[-2]:])[3])
            assert same(joined, whole), (name, cuts)
    tall = w[:out_f // 16 * 16, :256]                                        # whole tiles of 16 rows
    whole = trellis.block_ldlq(tall, h[:256, :256], L=8, K=2)
    for cuts in shares(len(tall)):
        assert same(by_shares(lambda rows: trellis.block_ldlq(rows, h[:256, :256], L=8, K=2), tall, cuts), whole)
