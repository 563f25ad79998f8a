"""The random Hadamard rotation shared by the trellis and lattice formats."""
import pytest
import torch

from engine.formats.numerics import hadamard


def sylvester(n):
    return torch.tensor([[(-1.0) ** (i & j).bit_count() for j in range(n)] for i in range(n)])


def test_fwht_is_the_sylvester_hadamard_product():
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hadamard.fwht(x), x @ sylvester(32), atol=1e-5)


def test_random_hadamard_is_orthogonal_and_is_what_rotate_applies():
    r = hadamard.random_hadamard(32, seed=4)
    assert torch.allclose(r @ r.T, torch.eye(32), atol=1e-6)
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    signs = hadamard.random_signs(32, 4)
    assert torch.allclose(hadamard.rotate(w, signs, 32), (w.reshape(5, 2, 32) @ r.T).reshape(5, 64), atol=1e-5)


@pytest.mark.parametrize("per_input", [False, True])
def test_unrotate_inverts_rotate_and_keeps_norms(per_input):
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    signs = hadamard.random_signs(64 if per_input else 16, 7)
    y = hadamard.rotate(x, signs, 16)
    assert torch.allclose(hadamard.unrotate(y, signs, 16), x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))


def test_sizes_that_are_not_powers_of_two_are_rejected():
    with pytest.raises(ValueError, match="power of two"):
        hadamard.random_hadamard(24)
    with pytest.raises(ValueError, match="multiple of the rotation tile"):
        hadamard.rotate(torch.zeros(2, 40), torch.ones(16), 16)
