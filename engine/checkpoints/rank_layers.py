"""A decoder layer calibrated by several processes (torchrun; engine/distributed.py's Group), for the streaming
converter: every method's quantize_layer runs unchanged on it, and every rank ends the layer holding the same
quantized linears, byte for byte those one process makes.

- Each rank runs the layer on its own share of the calibration batches, global batches first .. first + len - 1 of
  `total`; the input statistics are summed in the batches' calibration slots and folded over the ranks in a fixed
  order (InputStats.merge), so every rank holds the sums one process would have.
- replace: each linear is made by one rank and sent to the others, turn about; where the method quantizes each
  output row on its own given the statistics (rows=True: error feedback), a large linear is cut into shares of
  rows by their measured cost (obq.row_shares), each rank makes its shares, and the shares' layers are joined
  (QuantLinear.joined) on every rank. by_rows splits a method's own row-wise work the same way.
"""
import torch

from ..formats.numerics.calibration import LayerCalibration
from ..formats.numerics.obq import ROWS, row_shares
from ..layers import linear_names, replace_linears


def _rows(linear, first, end):
    """An nn.Linear holding rows first .. end - 1 of `linear` (views of its weight and bias), the whole one as it
    is."""
    if first == 0 and end == linear.out_features:
        return linear
    share = torch.nn.Linear(linear.in_features, end - first, bias=linear.bias is not None, device="meta")
    share.weight = torch.nn.Parameter(linear.weight[first:end], requires_grad=False)
    if linear.bias is not None:
        share.bias = torch.nn.Parameter(linear.bias[first:end], requires_grad=False)
    return share


class RankLayerCalibration(LayerCalibration):
    """calibration.LayerCalibration on one rank of `group`: `batches` are this rank's share, global batches first ..
    first + len - 1 of `total` (module docstring)."""

    def __init__(self, layer, index, batches, method, group, first, total, **options):
        super().__init__(layer, index, batches, method, **options)
        self.group, self.first = group, first
        self.total = self.total if total is None else total

    def _statistics(self, watched, keep_slots=True):          # each rank's slots apart until they are folded
        stats = super()._statistics(watched, keep_slots)
        for one in stats.values():
            one.merge(self.group)
        return stats

    def replace(self, make, names=None, rows=False):
        """As LayerCalibration.replace, each linear (or share of its rows, rows=True) made by one rank and sent."""
        names = None if names is None else {n.removeprefix(self.prefix) for n in names}
        chosen = [n for n in linear_names(self.layer) if names is None or n in names]
        linears = {n: self.layer.get_submodule(n) for n in chosen}
        if rows:
            shares = row_shares({n: (m.out_features, m.in_features) for n, m in linears.items()}, self.group.world,
                                ROWS)
        else:                                           # whole linears, turn about
            shares = {n: [((self.index + k) % self.group.world, 0, m.out_features)]
                      for k, (n, m) in enumerate(linears.items())}
        made = {(n, a): make(self.prefix + n, _rows(linears[n], a, b))
                for n in chosen for r, a, b in shares[n] if r == self.group.rank}

        def gathered(name, linear):
            parts = [self.group.broadcast(made.get((name, a)), r, f"sharing {self.prefix}{name}")
                     for r, a, _ in shares[name]]
            return parts[0] if len(parts) == 1 else type(parts[0]).joined(parts)
        replaced = replace_linears(self.layer, gathered, set(chosen))
        self.runs.drop_stale()                          # what the replaced linears made is freed now
        return replaced

    def by_rows(self, fn, *rows):
        """As LayerCalibration.by_rows: each rank runs fn on its share of the rows (obq.row_shares) and the shares'
        results are joined on every rank."""
        shares = row_shares({"weight": tuple(rows[0].shape[:2])}, self.group.world, ROWS)["weight"]
        mine = [fn(*(t if t is None else t[a:b] for t in rows)) for r, a, b in shares if r == self.group.rank]
        parts = [self.group.broadcast(mine[0] if r == self.group.rank else None, r,
                                      f"sharing rows {first}-{end - 1} of a weight of {self.prefix[:-1]}")
                 for r, first, end in shares]
        return tuple(torch.cat(joined) for joined in zip(*parts))
