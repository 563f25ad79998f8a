"""Our rANS coder against constriction's ANS coder (a real, independently written entropy-coding library) on the
same symbols: both within 1% of each other, so ours loses nothing measurable to a production coder even with all of
its metadata (table, lane states, sub-stream offsets, header) counted and constriction's table not counted."""
import numpy as np
import pytest
import torch

from engine.coding import rans as R
from engine.coding import rans_fast as F
from engine.formats import entropy as E

pytestmark = pytest.mark.interop


def _weights_as_codes(n, spread, seed):
    """E4M3 bytes of Laplace weights around EntQuant's operating points (about 2.3 and 3.7 bits per symbol)."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, generator=g).log() * torch.sign(torch.rand(n, generator=g) - 0.5) * spread
    return E.encode_weight(w[None], torch.zeros(1)).reshape(-1).numpy()


@pytest.mark.parametrize("spread", [1 / 512, 1 / 128])
def test_rate_matches_constriction_ans(spread):
    constriction = pytest.importorskip("constriction")
    symbols = _weights_as_codes(1 << 20, spread, seed=3)
    counts = np.bincount(symbols, minlength=256)
    used = np.flatnonzero(counts)                       # constriction codes indices into its probability table
    index = np.searchsorted(used, symbols).astype(np.int32)
    model = constriction.stream.model.Categorical(counts[used] / counts.sum(), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(index, model)
    theirs = 4 * coder.get_compressed().size           # uint32 words
    decoded = constriction.stream.stack.AnsCoder(coder.get_compressed()).decode(model, symbols.size)
    assert np.array_equal(used[decoded], symbols)      # their round trip: the comparison is on a working coder

    data = F.rans_encode(symbols)
    ours = len(data)
    assert np.array_equal(F.rans_decode(data).numpy(), symbols)
    assert ours <= 1.01 * theirs and theirs <= 1.01 * ours
    entropy = R.empirical_entropy_bits(symbols) / 8
    assert entropy <= theirs <= 1.01 * entropy
