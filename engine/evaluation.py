"""How much did quantization hurt? Statistics of the next-token distributions, as llama.cpp reports them.

For each scored position t, with P the reference model's distribution, Q the quantized one's and y the next token:

    KL_t = sum_v P_t(v) (log P_t(v) - log Q_t(v))        (nats; >= 0, = 0 iff P_t = Q_t)
    nll_t = -log Q_t(y),  nll_ref_t = -log P_t(y),  dp_t = Q_t(y) - P_t(y)

We report the mean with its standard error, the median and the tail (p99, p99.9, max: the bad positions a mean
hides), PPL = exp(mean nll) for both models, mean ln(PPL(Q)/PPL(ref)) = mean(nll - nll_ref), the RMS of dp, how
often both models put the same token on top, and (a downstream measure) how often each one's top token is the
text's next token y: next-token accuracy. KL, unlike perplexity, cannot be improved by noise: an overfit
model's held-out perplexity sometimes drops when quantization perturbs it, which says nothing about quality.

`compare_models` is llama.cpp's `perplexity --kl-divergence` (tools/perplexity/perplexity.cpp, kl_divergence) in one
process: both models run on the same chunks of ctx tokens (consecutive, non-overlapping, the first token replaced by
BOS where the tokenizer adds one: Corpus.eval_chunks), and only the second half of each chunk is scored (the logits
at positions ctx/2 .. ctx-2 predicting tokens ctx/2+1 .. ctx-1: ctx - 1 - ctx/2 positions, so that every scored
token has at least ctx/2 tokens of context). Its standard errors are llama.cpp's: sqrt(var / (n - 1)) of each
per-position quantity (var the population variance: the sample std / sqrt(n)), ln(PPL ratio) from the per-position
difference (= llama.cpp's sqrt(se^2 + se_ref^2 - 2 cov)), PPL's as PPL * se(nll), RMS dp's as se(dp^2) / (2 RMS),
same-top's binomial. Percentiles interpolate linearly, as llama.cpp's do. Two differences: P is exact, in float64
(llama.cpp reads it back from a file of 16-bit log-probabilities that drops P(v) < e^-16, which bounds how small a
KL it resolves), and nothing of the vocabulary's size outlives a chunk, so no logits file is written (llama.cpp's
takes 2 x (vocabulary + 4) bytes per scored token).
"""
import math

import numpy as np
import torch

from .layers import impl as use_impl

SLICE_ELEMENTS = 1 << 20          # float64 log-probabilities are computed this many at a time (8 MB per buffer)


def _kl(logp, logq):
    return (logp.exp() * (logp - logq)).sum(-1).clamp_min(0)         # exactly 0 where P = Q; P(v) = 0 adds 0


def kl_per_position(ref_logits, logits):
    """[..., vocab] x2 -> KL(P_ref || P) per position [...], in nats, computed in float64."""
    return _kl(torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1))


def check_finite(logits, which, first_chunk=None):
    """Refuse logits [..., vocab] with a NaN or an infinity: every statistic computed from them would be NaN (or a
    KL of inf), a silent wrong answer. A model can hold only finite weights and still overflow float32 in its
    forward pass (a norm weight of 1e38 does), so this is checked where the logits are scored, not only when weights
    load. first_chunk: the chunk index of logits[0], when they are [chunks, positions, vocab]."""
    bad = ~torch.isfinite(logits)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0][:-1]]
        where = (f"chunk {first_chunk + at[0]}, scored position {at[1]}" if first_chunk is not None
                 else f"position {tuple(at)}")
        raise ValueError(f"the {which} model's logits are not finite (first at {where}): its forward pass "
                         "overflowed float32 or computed with a NaN; no statistic is reported")


def kl_stats(ref_logits, logits):
    """{'kl_nats', 'kl_stderr', 'kl_p99', 'same_top_pct'} over all positions (the tiny model's table)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    check_finite(ref_logits, "reference")
    check_finite(logits, "quantized")
    kl = kl_per_position(ref_logits, logits).flatten()
    same = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return {"kl_nats": kl.mean().item(),
            "kl_stderr": (kl.std().item() / math.sqrt(kl.numel())) if kl.numel() > 1 else 0.0,
            "kl_p99": torch.quantile(kl, 0.99).item(),
            "same_top_pct": 100.0 * same}


def perplexity(logits, targets):
    """exp(mean cross-entropy) of next-token targets [...] under logits [..., vocab]."""
    nll = torch.nn.functional.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return math.exp(nll.item())


@torch.no_grad()
def held_out_logits(model, windows, batch_size=16):
    """Logits [n, seq_len, vocab] (float32) for held-out windows [n, seq_len + 1] (the last id is only a target)."""
    return torch.cat([model(windows[i:i + batch_size, :-1]).float() for i in range(0, len(windows), batch_size)])


# ---- llama.cpp's perplexity --kl-divergence ---------------------------------------------------------------------

def position_scores(ref_logits, logits, targets):
    """[n, vocab] x2, targets [n] -> {'kl', 'nll_ref', 'nll', 'dp', 'same_top', 'top1_ref', 'top1'}, float64 [n]
    each (top1: whether the model's most likely token is the text's next one)."""
    logp = torch.log_softmax(ref_logits.double(), -1)
    logq = torch.log_softmax(logits.double(), -1)
    nll_ref = -logp.gather(-1, targets[:, None])[:, 0]
    nll = -logq.gather(-1, targets[:, None])[:, 0]
    return {"kl": _kl(logp, logq), "nll_ref": nll_ref, "nll": nll, "dp": (-nll).exp() - (-nll_ref).exp(),
            "same_top": (logp.argmax(-1) == logq.argmax(-1)).double(),
            "top1_ref": (logp.argmax(-1) == targets).double(), "top1": (logq.argmax(-1) == targets).double()}


class Scores:
    """Per-position scalars for up to `capacity` scored positions, filled chunk by chunk: 56 bytes per position,
    allocated once (small tensors kept between chunks would pin the freed logits buffers in the C heap and grow it
    by hundreds of MB per chunk); logits are reduced SLICE_ELEMENTS at a time and dropped."""

    FIELDS = ("kl", "nll_ref", "nll", "dp", "same_top", "top1_ref", "top1")

    def __init__(self, capacity):
        self.table = torch.empty(len(self.FIELDS), capacity, dtype=torch.float64)
        self.count = 0

    def add(self, ref_logits, logits, targets):
        """ref_logits, logits [..., vocab], targets [...] (the ids those logits predict)."""
        if ref_logits.shape != logits.shape or ref_logits.shape[:-1] != targets.shape:
            raise ValueError(f"logits {tuple(ref_logits.shape)} and {tuple(logits.shape)} do not match targets "
                             f"{tuple(targets.shape)}")
        if self.count + targets.numel() > self.table.shape[1]:
            raise ValueError(f"{self.count} + {targets.numel()} positions exceed the capacity {self.table.shape[1]}")
        vocab = ref_logits.shape[-1]
        ref_logits, logits, targets = ref_logits.reshape(-1, vocab), logits.reshape(-1, vocab), targets.reshape(-1)
        rows = max(1, SLICE_ELEMENTS // vocab)
        for i in range(0, len(targets), rows):
            scores = position_scores(ref_logits[i:i + rows], logits[i:i + rows], targets[i:i + rows])
            for k, name in enumerate(self.FIELDS):
                self.table[k, self.count:self.count + len(scores[name])] = scores[name]
            self.count += len(scores["kl"])

    def values(self):
        return {name: self.table[k, :self.count] for k, name in enumerate(self.FIELDS)}

    def summary(self):
        """The statistics (module docstring), JSON-able floats; dp and same_top in percent."""
        v, n = self.values(), self.count
        if n == 0:
            raise ValueError("no position was scored")

        def mean_se(x):
            return x.mean().item(), (x.std().item() / math.sqrt(n)) if n > 1 else 0.0

        nll, nll_se = mean_se(v["nll"])
        nll_ref, nll_ref_se = mean_se(v["nll_ref"])
        ratio, ratio_se = mean_se(v["nll"] - v["nll_ref"])
        kl, kl_se = mean_se(v["kl"])
        mse, mse_se = mean_se(v["dp"].square())
        rms = math.sqrt(mse)
        same = v["same_top"].mean().item()
        median, p99, p999 = np.quantile(v["kl"].numpy(), [0.5, 0.99, 0.999])
        return {"positions": n,
                "ppl": math.exp(nll), "ppl_stderr": math.exp(nll) * nll_se,
                "ppl_ref": math.exp(nll_ref), "ppl_ref_stderr": math.exp(nll_ref) * nll_ref_se,
                "ln_ppl_ratio": ratio, "ln_ppl_ratio_stderr": ratio_se,
                "kl_nats": kl, "kl_stderr": kl_se, "kl_median": float(median), "kl_p99": float(p99),
                "kl_p999": float(p999), "kl_max": v["kl"].max().item(),
                "dp_rms_pct": 100 * rms, "dp_rms_stderr_pct": 100 * (0.5 * mse_se / rms if rms > 0 else 0.0),
                "same_top_pct": 100 * same,
                "same_top_stderr_pct": 100 * (math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0),
                "next_token_pct": 100 * v["top1"].mean().item(),
                "next_token_ref_pct": 100 * v["top1_ref"].mean().item()}


def _vocab_size(model):
    return getattr(getattr(model, "cfg", None), "vocab_size", None)


class ReferenceLogits:
    """The reference model's scored logits for a set of chunks, computed once and kept in float32, so that a table
    comparing many quantized copies against one reference runs the reference once: n * ctx/2 * vocab * 4 bytes
    (8 chunks of 512 over a 49,152 vocabulary: 0.4 GB). Pass it to compare_models as the reference."""

    def __init__(self, model, chunks, batch_size=1):
        first = chunks.shape[1] // 2
        with torch.no_grad():
            self.logits = torch.cat([model(chunks[s:s + batch_size])[:, first:-1].float()
                                     for s in range(0, len(chunks), batch_size)])
        self.chunks, self.vocab_size = chunks, self.logits.shape[-1]

    def scored(self, start, ids):
        if not torch.equal(self.chunks[start:start + len(ids)], ids):
            raise ValueError("ReferenceLogits were computed for other chunks")
        return self.logits[start:start + len(ids)]


@torch.no_grad()
def compare_models(reference, quantized, chunks, batch_size=1, impl="torch", progress=None):
    """llama.cpp's `perplexity --kl-divergence` for two models in one process (module docstring).

    reference, quantized: ids [b, ctx] -> logits [b, ctx, vocab] (the reference may be a ReferenceLogits of these
    chunks); chunks: ids [n, ctx] (Corpus.eval_chunks), run
    batch_size at a time; impl: "torch" or "engine" for every quantized layer of both models; progress: e.g.
    tqdm.tqdm, wrapped around the batches. Returns {'chunks', 'ctx', **Scores.summary()}."""
    if chunks.dim() != 2 or chunks.dtype != torch.long or len(chunks) == 0:
        raise ValueError(f"chunks must be ids [n >= 1, ctx] (torch.long), got {chunks.dtype} {tuple(chunks.shape)}")
    n, ctx = chunks.shape
    if ctx < 3:
        raise ValueError(f"chunks of {ctx} tokens leave nothing to score (ctx >= 3)")
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    for name, model in (("reference", reference), ("quantized", quantized)):
        vocab = _vocab_size(model)
        if vocab is not None and not 0 <= int(chunks.min()) <= int(chunks.max()) < vocab:
            raise ValueError(f"the chunks hold token ids up to {int(chunks.max())}, outside the {name} model's "
                             f"vocabulary of {vocab}: another tokenizer?")
    first = ctx // 2
    scores = Scores(n * (ctx - 1 - first))
    starts = range(0, n, batch_size)
    for s in progress(starts) if progress else starts:
        ids = chunks[s:s + batch_size]
        with use_impl(impl):
            ref_logits = reference.scored(s, ids) if isinstance(reference, ReferenceLogits) else \
                reference(ids)[:, first:-1]
            logits = quantized(ids)[:, first:-1]
        if ref_logits.shape != logits.shape:
            raise ValueError(f"the models' logits differ in shape: {tuple(ref_logits.shape)} vs "
                             f"{tuple(logits.shape)} (different vocabularies?)")
        check_finite(ref_logits, "reference", s)
        check_finite(logits, "quantized", s)
        scores.add(ref_logits, logits, ids[:, first + 1:])
        del ref_logits, logits
    return {"chunks": n, "ctx": ctx, **scores.summary()}


def markdown_table(results, label="model"):
    """Results of compare_models (each with a results[label] name and optionally 'bits', 'seconds', 'peak_rss_gb')
    -> a markdown table, one row per result, in llama.cpp's terms; a result with an 'error' is a row saying why."""
    bits = any("bits" in r for r in results)
    cost = any("seconds" in r for r in results)
    head = [label] + ["bits"] * bits + ["PPL(Q)", "PPL(ref)", "ln(PPL(Q)/PPL(ref))", "KLD", "KLD median",
                                        "KLD p99", "KLD p99.9", "KLD max", "RMS Δp %", "same top %"] + \
        ["seconds", "peak RSS GB"] * cost
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        if "error" in r:
            lines.append("| " + " | ".join([str(r.get(label, ""))] + [""] * bits + [f"refused: {r['error']}"] +
                                          [""] * (len(head) - 2 - bits)) + " |")
            continue
        cells = [str(r.get(label, ""))] + ["" if r.get("bits") is None else str(r["bits"])] * bits + [
            f"{r['ppl']:.4f} ± {r['ppl_stderr']:.4f}", f"{r['ppl_ref']:.4f}",
            f"{r['ln_ppl_ratio']:.5f} ± {r['ln_ppl_ratio_stderr']:.5f}",
            f"{r['kl_nats']:.6f} ± {r['kl_stderr']:.6f}", f"{r['kl_median']:.6f}", f"{r['kl_p99']:.5f}",
            f"{r['kl_p999']:.5f}", f"{r['kl_max']:.4f}", f"{r['dp_rms_pct']:.3f} ± {r['dp_rms_stderr_pct']:.3f}",
            f"{r['same_top_pct']:.3f} ± {r['same_top_stderr_pct']:.3f}"] + \
            [str(r.get("seconds", "")), str(r.get("peak_rss_gb", ""))] * cost
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
