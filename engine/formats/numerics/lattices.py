"""The lattices of HyperQuant (weights: engine/formats/lattice.py; the KV cache: engine/formats/kv/kv_cache.py):
E8, D4, A2 and Z, one class each, everything the format needs of a lattice in one place.

A lattice quantizer Q maps x in R^n to the nearest point of a lattice; its cell is rounder than the scalar interval,
so at equal rate its mean squared error is lower. The normalized second moment G = E|x - Q(x)|^2 / (n V^(2/n))
(V = cell volume) is Z 1/12, A2 0.080188, D4 0.076603, E8 0.0716821. Closest points follow Conway & Sloane
(ch. 20): round every coordinate, repair the parity constraint by moving the worst-rounded coordinate, and for E8
(and A2) also try the other coset and keep the nearer point. O(1) per scalar.

Integer realizations (what is stored), real point = code * axis (A2's y axis carries sqrt(3)):
    E8int = 2 E8 in Z^8      all c_i of one parity c, sum((c_i - c) / 2) even
    D4int = D4 in Z^4        sum(c_i) even
    A2int = (n_y, n_x)       n_y + n_x even, real point (sqrt(3) n_y, n_x)
    Z                        no constraint
Each mod-2 constraint pins one bit; Strip removes them (1.0 / 0.25 / 0.5 / 0 bits per scalar), zig-zag makes the
symbols non-negative, and E8's coset bit rides in the low bit of the halved symbol: comb = 2 zz(t) + c. Symbol order
per vector is chosen so a one-pass decoder rebuilds the dropped coordinate at the vector's last symbol:
    E8 [comb, zz s_0..s_6]   D4 [zz c_0, zz c_1, zz c_2, zz t]   A2 [zz n_x, zz t_y]   Z [zz n]
D4's t and A2's t_y have their own Rice parameter (level 1); E8's comb shares the s_i's.
"""
import math

import torch

from ...coding.rice import unzigzag, zigzag


class Lattice:
    """A lattice's integer realization. name; n (dimension); G (normalized second moment); axis [n] (real point =
    code * axis); volume (of a cell, real coordinates); period p (p Z^n, axis-scaled, is a sublattice: a box of side
    p * axis tiles space); levels [n] (which of a sub-stream's two Rice parameters codes each stripped symbol).
    A subclass gives _closest (x [..., n] float64 -> codes int64), is_member (codes [..., n] -> bool [...]),
    strip (codes [V, n] -> symbols [V, n] >= 0, a bijection onto N^n) and unstrip (its inverse for symbols [..., n],
    int32: symbols are below 2^16, so every code fits, at half int64's memory traffic where a KV cache decodes every
    step)."""
    name: str
    n: int
    G: float
    axis: tuple
    volume: float
    period: int
    levels: tuple

    @property
    def noise_unit(self):
        """Per-scalar noise variance of the unscaled lattice: G V^(2/n)."""
        return self.G * self.volume ** (2 / self.n)

    def closest_point(self, x):
        """x [..., n] real coordinates -> integer codes [..., n] (int64) of the nearest point; the point itself is
        codes * axis."""
        if x.shape[-1] != self.n:
            raise ValueError(f"{self.name} quantizes vectors of {self.n}, got last dimension {x.shape[-1]}")
        return self._closest(x.double())

    def __repr__(self):
        return f"Lattice {self.name}"


def closest_dn(x):
    """x [..., n] -> nearest point of D_n (integers with an even sum), float. Round; if the sum is odd, round the
    coordinate that was rounded worst the other way (the cheapest parity repair)."""
    f = torch.round(x)
    err = x - f
    i = err.abs().argmax(-1, keepdim=True)
    step = torch.where(err.gather(-1, i) >= 0, 1.0, -1.0).to(x.dtype)
    g = f.scatter_add(-1, i, step)
    return torch.where((f.sum(-1, keepdim=True) % 2) != 0, g, f)


def _nearer(a, b, x):
    return torch.where(((a - x) ** 2).sum(-1, keepdim=True) <= ((b - x) ** 2).sum(-1, keepdim=True), a, b)


class Z(Lattice):
    """The integers: no constraint, nothing to strip. Symbols [zz n]."""
    name, n, G, axis, volume, period, levels = "Z", 1, 1 / 12, (1.0,), 1.0, 1, (0,)

    def _closest(self, x):
        return torch.round(x).long()

    def is_member(self, codes):
        return torch.ones(codes.shape[:-1], dtype=torch.bool)

    def strip(self, codes):
        return zigzag(codes.long())

    def unstrip(self, symbols):
        return unzigzag(symbols.to(torch.int32))


class A2(Lattice):
    """A2int = {(n_y, n_x): n_y + n_x even}, real point (sqrt3 n_y, n_x): the rectangular lattice 2 sqrt3 Z x 2Z
    plus its coset shifted by (sqrt3, 1). Strip: t_y = (n_y - (n_x mod 2)) / 2; symbols [zz n_x, zz t_y]."""
    name, n, G, axis, volume, period, levels = "A2", 2, 0.080188, (math.sqrt(3), 1.0), 2 * math.sqrt(3), 2, (0, 1)

    def _closest(self, x):
        axis = torch.tensor(self.axis, dtype=x.dtype)
        u = x / axis                                                    # (n_y, n_x) as reals
        even = 2 * torch.round(u / 2)
        odd = 2 * torch.round((u - 1) / 2) + 1
        return (_nearer(even * axis, odd * axis, x) / axis).round().long()

    def is_member(self, codes):
        return codes.long().sum(-1) % 2 == 0

    def strip(self, codes):
        n_y, n_x = codes.long().unbind(1)
        return zigzag(torch.stack([n_x, (n_y - (n_x & 1)) >> 1], 1))

    def unstrip(self, symbols):
        n_x, t_y = unzigzag(symbols.to(torch.int32)).unbind(-1)
        return torch.stack([2 * t_y + (n_x & 1), n_x], -1)


class D4(Lattice):
    """D4int = D4 = {c in Z^4: sum even}. Strip: t = (c_3 - (c_0 + c_1 + c_2 mod 2)) / 2; symbols
    [zz c_0, zz c_1, zz c_2, zz t]."""
    name, n, G, axis, volume, period, levels = "D4", 4, 0.076603, (1.0,) * 4, 2.0, 2, (0, 0, 0, 1)

    def _closest(self, x):
        return closest_dn(x).long()

    def is_member(self, codes):
        return codes.long().sum(-1) % 2 == 0

    def strip(self, codes):
        c = codes.long()
        t = (c[:, 3] - (c[:, :3].sum(1) & 1)) >> 1
        return zigzag(torch.cat([c[:, :3], t[:, None]], 1))

    def unstrip(self, symbols):
        c = unzigzag(symbols.to(torch.int32))
        c[..., 3] = 2 * c[..., 3] + (c[..., :3].sum(-1, dtype=torch.int32) & 1)
        return c


class E8(Lattice):
    """E8int = 2 E8 = 2 (D8 u (D8 + 1/2)). Strip: coset c = c_0 mod 2, s_i = (c_i - c) / 2,
    t = (s_7 - (s_0 + .. + s_6 mod 2)) / 2; symbols [comb = 2 zz t + c, zz s_0 .. zz s_6], one Rice level."""
    name, n, G, axis, volume, period, levels = "E8", 8, 0.0716821, (1.0,) * 8, 2.0 ** 8, 4, (0,) * 8

    def _closest(self, x):
        h = x / 2
        return (2 * _nearer(closest_dn(h), closest_dn(h - 0.5) + 0.5, h)).round().long()

    def is_member(self, codes):
        c = codes.long()
        coset = c[..., :1] & 1
        return ((c & 1) == coset).all(-1) & (((c - coset) // 2).sum(-1) % 2 == 0)

    def strip(self, codes):
        c = codes.long()
        coset = c[:, 0] & 1
        s = (c - coset[:, None]) >> 1
        t = (s[:, 7] - (s[:, :7].sum(1) & 1)) >> 1
        return torch.cat([(2 * zigzag(t) + coset)[:, None], zigzag(s[:, :7])], 1)

    def unstrip(self, symbols):
        m = symbols.to(torch.int32)
        s = unzigzag(torch.cat([m[..., 1:], m[..., :1] >> 1], -1))                  # s_0 .. s_6, t
        s[..., 7] = 2 * s[..., 7] + (s[..., :7].sum(-1, dtype=torch.int32) & 1)    # s_7
        return s.mul_(2).add_(m[..., :1] & 1)                                        # 2 s_i + coset


LATTICES = {lat.name: lat for lat in (Z(), A2(), D4(), E8())}


def get_lattice(name):
    """A lattice by name (a Lattice passes through); ValueError for anything else."""
    if isinstance(name, Lattice):
        return name
    if not isinstance(name, str) or name not in LATTICES:
        raise ValueError(f"lattice must be one of {sorted(LATTICES)}, got {name!r}")
    return LATTICES[name]
