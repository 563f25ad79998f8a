"""A linear's input statistics: all that the data-aware methods (GPTQ, AWQ, BlockLDLQ) keep of its calibration inputs
X [n, in], accumulated batch by batch in float64 so that the inputs themselves are never all held (the model walk
that feeds them, one decoder layer at a time: calibration.py):

    G = X^T X / n        (GPTQ's Hessian H = 2 G; AWQ's output error mean_t ||x_t dW^T||^2 = tr(dW G dW^T))
    mean_t |x_t|         (AWQ's per-channel scales)

The sums are taken in slots of the batches, in a fixed order, so that several processes (engine/distributed.py) reach
the sums of one process bit for bit.
"""
import functools

import torch


# The calibration batches are cut into SLOTS contiguous slots, each summed from zero in batch order and the slots
# folded in slot order: the same sums, bit for bit, whether one process or up to SLOTS ranks hold the slots.
SLOTS = 8


def slot_of(batch, batches):
    """Batch index -> its slot (contiguous slots, the same for any number of ranks)."""
    return batch * SLOTS // batches


class InputStats:
    """Running statistics of a linear's inputs: add(x [..., in], slot) any number of times, then read
    gram [in, in] = X^T X / n, hessian = 2 gram (GPTQ's H) and mean_abs [in] = mean_t |x_t| (all float32).

    The sums are float64 and taken in slots (engine.distributed: contiguous runs of batches, the same whatever the
    number of processes): each slot summed from zero in batch order, the slots folded left to right. A process that
    holds only some slots keeps their sums apart (keep_slots) until merge(group) folds them with the other ranks', so
    that any number of ranks reaches the sums of one process bit for bit. One process holds two float64 sums per
    statistic (the total and the open slot's), the price of that order. X^T X is symmetric, so only its upper
    triangle is summed, kept and sent (half the bytes), and G is that triangle mirrored, on any BLAS; what the
    methods read is float32, so the ranks receive the total already divided and rounded (half again)."""

    def __init__(self, in_features, keep_slots=False):
        self.in_features, self.keep_slots = in_features, keep_slots
        self.parts = []              # [slot, xtx, abs_sum, count]: closed slots (folded unless kept), then the open one
        self.merged = None           # after merge: (G's upper triangle, mean_abs, count) as the ranks computed them

    @classmethod
    def of(cls, inputs):
        """inputs: one tensor [..., in] or an iterable of such batches."""
        batches = [inputs] if torch.is_tensor(inputs) else list(inputs)
        if not batches:
            raise ValueError("need at least one batch of calibration inputs")
        stats = cls(batches[0].shape[-1])
        for x in batches:
            stats.add(x)
        return stats

    def add(self, x, slot=0):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"calibration inputs have {x.shape[-1]} features, the layer has {self.in_features}")
        x = x.detach().reshape(-1, self.in_features).float()
        if not self.parts or self.parts[-1][0] != slot:
            if len(self.parts) == 2 and not self.keep_slots:     # the open slot joins the total; its buffers reused
                total, part = self.parts
                _fold(total, part)
                part[1].zero_()
                part[2].zero_()
                part[0], part[3] = slot, 0
            else:
                self.parts.append([slot, torch.zeros(_triangle(self.in_features), dtype=torch.float64,
                                                     device=x.device),
                                   torch.zeros(self.in_features, dtype=torch.float64, device=x.device), 0])
        part = self.parts[-1]
        # one batch's X^T X in float32 (a float64 matmul costs several times more), summed over batches in float64
        # (a long calibration run sums many large squares)
        part[1] += upper_gram(x).double()
        part[2] += x.abs().sum(0, dtype=torch.float64)
        part[3] += x.shape[0]

    def merge(self, group):
        """Fold this rank's slot sums with every other rank's (engine.distributed.Group.fold): the last rank divides
        the total (_final) and sends every rank the float32 statistics, the same on every rank afterwards."""
        self.merged, self.parts = group.fold(self.parts, _fold, _final), []

    def _total(self):
        while len(self.parts) > 1:
            _fold(*self.parts[:2])
            del self.parts[1]
        return self.parts[0]

    def _statistics(self):
        final = self.merged if self.merged is not None or not self.parts else _final(self._total())
        if final is None or final[2] == 0:
            raise ValueError("no calibration inputs reached this layer")
        return final

    @property
    def count(self):
        return self._statistics()[2]

    @property
    def rows(self):
        """The input rows (tokens) added so far, 0 when none: an expert no calibration token was routed to."""
        return self.merged[2] if self.merged is not None else sum(part[3] for part in self.parts)

    @property
    def gram(self):
        return _mirrored(self._statistics()[0], self.in_features)

    @property
    def hessian(self):
        return 2 * self.gram                  # exact: (2 X^T X / n) in float32, but for subnormal entries

    @property
    def mean_abs(self):
        return self._statistics()[1]


@functools.cache
def _upper_cpu(n):
    return torch.ones(n, n, dtype=torch.bool).triu()


def _upper(n, device):
    """bool [n, n]: the upper triangle, diagonal included (X^T X[mask]: its entries row by row)."""
    return _upper_cpu(n).to(device)


def upper_gram(x, panel=512):
    """x [n, in] -> the upper triangle of X^T X, row by row [in (in + 1) / 2], float32. Row panels from the diagonal
    on: the blocks below it, the mirror of those above, are never computed ((k + 1) / 2k of the whole product's
    multiply-adds for k panels)."""
    cols = x.shape[1]
    full = x.new_empty(cols, cols)
    for i in range(0, cols, panel):
        full[i:i + panel, i:] = x[:, i:i + panel].T @ x[:, i:]
    return full[_upper(cols, x.device)]


def _triangle(n):
    return n * (n + 1) // 2


def _mirrored(upper, n):
    """An upper triangle row by row [n (n + 1) / 2] -> the symmetric matrix [n, n] (adding zeros: exact)."""
    full = torch.zeros(n, n, dtype=upper.dtype, device=upper.device)
    full[_upper(n, upper.device)] = upper
    return full + full.triu(1).T


def _final(total):
    """The folded slot sums [slot, xtx, abs_sum, count] -> (G's upper triangle, mean_abs, count), float32: what the
    statistics are read from, in one process and, sent by the last rank, on every rank."""
    _, xtx, abs_sum, n = total
    return (xtx / n).float(), (abs_sum / n).float(), n


def _fold(total, part):
    """total += part, in place, for slot sums [slot, xtx, abs_sum, count] (the later slot's index kept): the one
    addition of the left fold, the same whether the parts come from one process or from several."""
    total[1] += part[1].to(total[1].device)
    total[2] += part[2].to(total[2].device)
    total[0], total[3] = part[0], total[3] + part[3]
    return total


def hessian_from(inputs):
    """inputs: one tensor [..., in] or an iterable of such batches -> H = 2 X^T X / n [in, in] (the book's name)."""
    return InputStats.of(inputs).hessian
