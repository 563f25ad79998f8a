"""EntQuant's rate control: a target in bits per weight -> the lambda that meets it.

lambda -> bits per weight is close to log-linear (the paper: nearly model-independent). The table measured on the
tiny model ships in data/entquant_lambda_bpw.json (benchmarks/entquant_rate.py rebuilds it), one list per loss
(table_key); it seeds a bracketing search on log lambda (regula falsi, clamped so that the bracket always shrinks)
that meets the target within a tolerance. measure(lambda) is the caller's: it compresses the model and returns the
coded bits per weight, everything counted.
"""
import json
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm


def lambda_for_bpw(target, measure, table, tol=0.05, max_evals=10):
    """Find lambda with |measure(lambda) - target| <= tol (measure: lambda -> coded bits per weight, decreasing).

    First guess: the shipped lambda -> bpw table, read as log-linear. Then bracket and bisect in log lambda, each new
    point placed where the line through the bracket's ends meets the target (regula falsi), clamped to the middle
    80% of the bracket so that it always shrinks. Returns (lambda, bpw)."""
    table = sorted(table)
    if not table:
        raise ValueError("no lambda -> bpw table to start from")
    logs = np.log([lam for lam, _ in table])
    rates = np.array([b for _, b in table])
    order = np.argsort(rates)
    log_lam = float(np.interp(target, rates[order], logs[order]))
    lo = hi = None                                              # (log lambda, bpw) with bpw above / below target
    bar = tqdm(range(max_evals), desc=f"lambda for {target} bpw", leave=False, disable=None)   # a terminal only
    for _ in bar:
        bpw = measure(math.exp(log_lam))
        bar.set_postfix(lam=f"{math.exp(log_lam):.3g}", bpw=f"{bpw:.3f}")
        if abs(bpw - target) <= tol:
            bar.close()
            return math.exp(log_lam), bpw
        if bpw > target:
            lo = (log_lam, bpw)
        else:
            hi = (log_lam, bpw)
        if lo is None or hi is None:
            log_lam += math.log(2.0) if hi is None else -math.log(2.0)
            continue
        frac = (lo[1] - target) / (lo[1] - hi[1])
        log_lam = lo[0] + min(max(frac, 0.1), 0.9) * (hi[0] - lo[0])
    raise ValueError(f"no lambda reached {target} +- {tol} bits per weight in {max_evals} tries")


LAMBDA_TABLE = Path(__file__).resolve().parents[2] / "data" / "entquant_lambda_bpw.json"


# Where no table is shipped: the paper's Float8 presets, and what the Fisher-weighted loss measured on the tiny model.
PRESETS = {None: [(3.9, 4.0), (14.5, 3.0), (58.0, 2.0)], "fisher": [(0.25, 4.04), (2.0, 3.06), (16.0, 2.16)]}


def table_key(fmt, sensitivity=None, feedback=None):
    """The lambda table's key: the format, plus "+fisher" when the Fisher-weighted loss sets the scales (its lambda
    has another scale than the paper's), plus "+feedback" when the codes come with error feedback (the same lambda
    scale, a slightly higher rate at each lambda)."""
    return fmt + (f"+{sensitivity}" if sensitivity else "") + ("+feedback" if feedback else "")


def load_lambda_table(fmt="float8", sensitivity=None, feedback=None, path=LAMBDA_TABLE):
    """[(lambda, bpw), ...] measured on the tiny trained model (benchmarks/entquant_rate.py rebuilds the file); for
    feedback without its own table, the table without feedback; without either, PRESETS (the search then brackets
    from there)."""
    path = Path(path)
    tables = json.loads(path.read_text()) if path.exists() else {}
    table = tables.get(table_key(fmt, sensitivity, feedback)) or tables.get(table_key(fmt, sensitivity))
    if not table:
        return PRESETS[sensitivity]
    return [(row["lambda"], row["bpw"]) for row in table]
