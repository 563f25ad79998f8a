"""KL statistics: zero for identical models, positive otherwise, and the same numbers a direct formula gives; the
llama.cpp-style comparison scores the second half of each chunk, keeps per-position scalars only, and matches a
brute-force computation with llama.cpp's formulas."""
import copy
import math

import numpy as np
import pytest
import torch

from engine import evaluation
from engine.data import Corpus
from engine.evaluation import Scores, compare_models, kl_per_position, kl_stats, markdown_table, perplexity

pytestmark = pytest.mark.usefixtures("one_thread")


def test_kl_of_a_distribution_with_itself_is_zero():
    logits = torch.randn(3, 10, 256, generator=torch.Generator().manual_seed(0))
    stats = kl_stats(logits, logits.clone())
    assert stats["kl_nats"] == 0 and stats["kl_p99"] == 0 and stats["same_top_pct"] == 100


def test_kl_is_nonnegative_and_matches_the_definition():
    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    kl = kl_per_position(p, q)
    assert (kl >= 0).all()
    P, Q = p.double().softmax(-1), q.double().softmax(-1)
    assert torch.allclose(kl, (P * (P / Q).log()).sum(-1))
    stats = kl_stats(p, q)
    assert math.isclose(stats["kl_stderr"], kl.std().item() / math.sqrt(50), rel_tol=1e-9)
    assert stats["kl_p99"] >= stats["kl_nats"] > 0


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    assert math.isclose(perplexity(torch.zeros(4, 5, 256), torch.zeros(4, 5, dtype=torch.long)), 256, rel_tol=1e-9)


# ---- compare_models ---------------------------------------------------------------------------------------------

class TableModel(torch.nn.Module):
    """Stands in for a model: chunk i (its first id is i) -> the logits [ctx, vocab] stored for it; records the batch
    sizes it was run on."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.batches = logits, []

    def forward(self, ids):
        self.batches.append(len(ids))
        return self.logits[ids[:, 0]]


def _random_case(n=3, ctx=10, vocab=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    chunks = torch.randint(0, vocab, (n, ctx), generator=g)
    chunks[:, 0] = torch.arange(n)
    ref = torch.randn(n, ctx, vocab, generator=g) * 2
    return chunks, ref, ref + torch.randn(n, ctx, vocab, generator=g) * 0.5


def _llama_cpp_statistics(chunks, ref, q):
    """perplexity.cpp's kl_divergence, position by position with running sums, in float64 numpy."""
    ctx, first = chunks.shape[1], chunks.shape[1] // 2
    s = dict.fromkeys(["nll", "nll2", "base", "base2", "cross", "kld", "kld2", "dp2", "dp4", "same", "top1",
                       "top1_ref"], 0.0)
    klds = []
    for c in range(len(chunks)):
        for j in range(first, ctx - 1):
            P, Q = (np.exp(x[c, j].double().numpy()) for x in (ref, q))
            P, Q, tok = P / P.sum(), Q / Q.sum(), int(chunks[c, j + 1])
            nll, base = -math.log(Q[tok]), -math.log(P[tok])
            kld = float((P * np.log(P / Q)).sum())
            dp = Q[tok] - P[tok]
            for key, v in (("nll", nll), ("nll2", nll * nll), ("base", base), ("base2", base * base),
                           ("cross", nll * base), ("kld", kld), ("kld2", kld * kld), ("dp2", dp * dp),
                           ("dp4", dp ** 4), ("same", float(P.argmax() == Q.argmax())),
                           ("top1", float(Q.argmax() == tok)), ("top1_ref", float(P.argmax() == tok))):
                s[key] += v
            klds.append(kld)
    n = len(klds)

    def mean_unc(total, total2):
        f = total / n
        return f, math.sqrt((total2 / n - f * f) / (n - 1))

    lq, lq_u = mean_unc(s["nll"], s["nll2"])
    lb, lb_u = mean_unc(s["base"], s["base2"])
    cov = (s["cross"] / n - lq * lb) / (n - 1)
    mse, mse_u = mean_unc(s["dp2"], s["dp4"])
    same = s["same"] / n
    klds = sorted(klds)
    return {"positions": n, "ppl": math.exp(lq), "ppl_stderr": math.exp(lq) * lq_u, "ppl_ref": math.exp(lb),
            "ppl_ref_stderr": math.exp(lb) * lb_u, "ln_ppl_ratio": lq - lb,
            "ln_ppl_ratio_stderr": math.sqrt(lq_u ** 2 + lb_u ** 2 - 2 * cov),
            "kl_nats": mean_unc(s["kld"], s["kld2"])[0], "kl_stderr": mean_unc(s["kld"], s["kld2"])[1],
            "kl_median": (klds[n // 2] + klds[n // 2 - 1]) / 2 if n % 2 == 0 else klds[n // 2],
            "kl_max": klds[-1], "dp_rms_pct": 100 * math.sqrt(mse), "dp_rms_stderr_pct": 100 * 0.5 * mse_u /
            math.sqrt(mse), "same_top_pct": 100 * same,
            "same_top_stderr_pct": 100 * math.sqrt(same * (1 - same) / (n - 1)),
            "next_token_pct": 100 * s["top1"] / n, "next_token_ref_pct": 100 * s["top1_ref"] / n}


def test_statistics_match_llama_cpp_formulas_by_brute_force():
    chunks, ref, q = _random_case()
    stats = compare_models(TableModel(ref), TableModel(q), chunks, batch_size=2)
    expected = _llama_cpp_statistics(chunks, ref, q)
    assert stats["positions"] == expected["positions"] == 3 * (10 - 1 - 5)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert stats["kl_p99"] <= stats["kl_max"] and stats["chunks"] == 3 and stats["ctx"] == 10


def test_only_the_second_half_of_each_chunk_is_scored():
    chunks, ref, q = _random_case(ctx=12)
    outside = ref.clone()
    outside[:, :6] = q[:, :6]                               # positions 0..5 differ: not scored (first = 6)
    outside[:, -1] = q[:, -1]                               # the last position predicts nothing in the chunk
    assert compare_models(TableModel(ref), TableModel(outside), chunks)["kl_max"] == 0
    inside = ref.clone()
    inside[:, 6] = q[:, 6]
    assert compare_models(TableModel(ref), TableModel(inside), chunks)["kl_max"] > 0


def test_a_model_compared_with_itself_scores_zero(tiny_model):
    chunks = Corpus.from_text(bytes(range(256)) * 20).eval_chunks(ctx=64)
    stats = compare_models(tiny_model, tiny_model, chunks, batch_size=3)
    assert stats["kl_max"] == 0 and stats["ln_ppl_ratio"] == 0 and stats["dp_rms_pct"] == 0
    assert stats["same_top_pct"] == 100 and stats["ppl"] == stats["ppl_ref"] > 1
    perturbed = copy.deepcopy(tiny_model)
    with torch.no_grad():
        perturbed.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    assert compare_models(tiny_model, perturbed, chunks)["kl_nats"] > 0


def test_memory_holds_per_position_scalars_only(monkeypatch):
    """The models see batch_size chunks at a time, the logits are reduced a slice at a time, and what is kept
    between chunks is one float64 table of 7 values per scored position, allocated once."""
    n, ctx, vocab = 10, 16, 5000
    chunks, ref, q = _random_case(n, ctx, vocab, seed=2)
    monkeypatch.setattr(evaluation, "SLICE_ELEMENTS", 3 * vocab)
    seen, position_scores = [], evaluation.position_scores
    monkeypatch.setattr(evaluation, "position_scores", lambda *a: seen.append(len(a[0])) or position_scores(*a))
    kept = []
    monkeypatch.setattr(Scores, "summary", lambda self: kept.append(self) or {})
    reference = TableModel(ref)
    compare_models(reference, TableModel(q), chunks, batch_size=4)
    assert reference.batches == [4, 4, 2] and max(seen) == 3
    scores, positions = kept[0], n * (ctx - 1 - ctx // 2)
    assert vars(scores).keys() == {"table", "count"} and scores.count == positions
    assert scores.table.shape == (7, positions) and scores.table.dtype == torch.float64


@pytest.mark.parametrize("chunks,match", [
    (torch.zeros(8, dtype=torch.long), "ids \\[n >= 1, ctx\\]"),
    (torch.zeros(2, 2, dtype=torch.long), "nothing to score"),
    (torch.full((1, 8), 256), "outside the reference model's vocabulary of 256"),
])
def test_bad_chunks_are_named(tiny_model, chunks, match):
    with pytest.raises(ValueError, match=match):
        compare_models(tiny_model, tiny_model, chunks)


def test_a_forward_pass_that_overflows_is_refused_not_scored_as_nan(tiny_model):
    """Every weight finite, but a final-norm weight of 3.4e38 overflows float32 in the forward pass: the scores
    would be NaN; they are refused, naming the model and the first chunk."""
    chunks = Corpus.from_text(bytes(range(256)) * 20).eval_chunks(ctx=64)
    overflowing = copy.deepcopy(tiny_model)
    with torch.no_grad():
        overflowing.model.norm.weight[7] = 3.4e38
    assert all(bool(torch.isfinite(p).all()) for p in overflowing.parameters())
    with pytest.raises(ValueError, match=r"the quantized model's logits are not finite \(first at chunk 0,"):
        compare_models(tiny_model, overflowing, chunks, batch_size=2)
    with pytest.raises(ValueError, match="the reference model's logits are not finite"):
        compare_models(overflowing, tiny_model, chunks)
    with torch.no_grad():
        logits = overflowing(chunks[:1])
    with pytest.raises(ValueError, match=r"quantized model's logits are not finite \(first at position \(0, 0\)\)"):
        kl_stats(logits.nan_to_num(0.0), logits)


def test_models_of_different_vocabularies_are_refused():
    chunks, ref, q = _random_case()
    with pytest.raises(ValueError, match="differ in shape"):
        compare_models(TableModel(ref), TableModel(q[..., :-1]), chunks)


def test_markdown_table_shows_each_statistic():
    chunks, ref, q = _random_case()
    stats = compare_models(TableModel(ref), TableModel(q), chunks)
    table = markdown_table([{"model": "Q4", "bits": 4.5, **stats}])
    assert table.count("\n") == 2 and "| Q4 | 4.5 |" in table
    assert f"{stats['kl_nats']:.6f} ± {stats['kl_stderr']:.6f}" in table and f"{stats['same_top_pct']:.3f}" in table


def test_markdown_table_keeps_cost_columns_and_says_why_a_row_was_refused():
    chunks, ref, q = _random_case()
    stats = compare_models(TableModel(ref), TableModel(q), chunks)
    table = markdown_table([{"model": "Q4", "bits": 4.5, **stats, "seconds": 1.5, "peak_rss_gb": 0.7},
                            {"model": "trellis", "error": "last dim 576 is not a multiple of the rotation tile 256"}])
    head, _, good, refused = table.split("\n")
    assert head.endswith("| seconds | peak RSS GB |") and good.endswith("| 1.5 | 0.7 |")
    assert "refused: last dim 576" in refused and refused.count("|") == head.count("|")
