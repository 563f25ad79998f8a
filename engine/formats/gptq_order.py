"""GPTQ's column orders: in which order the error-feedback loop visits a layer's columns, and which columns share a
grid (shared by plain GPTQ, gptq.py, and GPTQ on llama.cpp's grids, llama_cpp/gptq_ggml.py).

The column order, one name of ORDERS (as in AutoGPTQ / GPTQModel configs), and what each costs the checkpoint:

    natural                0, 1, 2, ...                              g_idx = i // G (sorted)   loads everywhere
    act_order              by decreasing H_ii ("desc_act"); groups   g_idx permuted, and a     vLLM refuses it
                           are ranges of the visit                   runtime permutation       (desc_act=True)
    act_order_static       the same visit, but each group is a       g_idx = i // G, no perm   loads everywhere
      (the default)        range of ORIGINAL columns whose grid is   (a plain file)
                           chosen from the weights before the loop
    group_aware            groups of original columns by decreasing  g_idx = i // G, no perm   loads everywhere
                           max H_ii, each group's columns by         ("GAR")
                           decreasing H_ii; the grid when the group
                           is entered
    group_aware_sum        the same, groups ranked by total H_ii     g_idx = i // G, no perm
    group_aware_reference  group_aware with the reference code's     g_idx = i // G, no perm   GPTQModel's default
                           grid: read from the weights as they stood                           since 2025
                           when the 128-column block began, scales
                           rounded to f16 only for the file
    search                 per linear, the lowest tr(E H E^T) of     g_idx = i // G, no perm   one GPTQ per
                           SEARCHED (search_order)                                             candidate

Visiting the most activated columns first leaves the most freedom to compensate their errors. Plain act-order
minimizes the layer error best but needs its permutation; act-order with static groups comes close, below the
group-aware order on most layers (benchmarks/gptq_order.py), at no cost in the file: the default. No single
plain-file order is lowest on every layer, hence search. The config's desc_act is true only for the permuted layout
(vLLM ignores g_idx when it is false); `order` records the visit.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Order:
    """How GPTQ walks a layer: visit "natural", "act_order" (by decreasing H_ii) or "group_aware" (groups by their
    score, then their columns by H_ii); static: grids from the weights before the loop, groups = ranges of the
    original columns; score: the group-aware rank ("amax" or "sum" of H_ii); reference_grid: the reference code's
    grid rule (module docstring)."""
    visit: str = "natural"
    static: bool = False
    score: str = "amax"
    reference_grid: bool = False

    @property
    def permuted(self):
        """Whether the file needs a permuted g_idx (desc_act=true): groups are ranges of an act-order visit."""
        return self.visit == "act_order" and not self.static


ORDERS = {"natural": Order(),
          "act_order": Order("act_order"),
          "act_order_static": Order("act_order", static=True),
          "group_aware": Order("group_aware"),
          "group_aware_sum": Order("group_aware", score="sum"),
          "group_aware_reference": Order("group_aware", reference_grid=True)}
SEARCHED = ("act_order_static", "group_aware_sum", "group_aware_reference")   # all write a plain file
SEARCH = "search"
DEFAULT = "act_order_static"                     # the engine's default visit (the book's: natural)


def check_order(order):
    """A name of ORDERS (or an Order itself, for a walk without a name) -> its Order; ValueError otherwise."""
    if isinstance(order, Order):
        return order
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be one of {tuple(ORDERS)}, got {order!r}")
    return ORDERS[order]


def visit_order(diag, group_size, order="natural"):
    """diag [in] = diag(H) -> the permutation [in] in which GPTQ visits the columns.

    natural: 0, 1, 2, ...;  act_order: by decreasing H_ii;  group_aware (GPTQModel's "GAR"): the groups of
    consecutive columns by decreasing score (their max H_ii, or with group_aware_sum their total: a group of many
    moderately active inputs can outrank one with a single outlier), and within each group its columns by
    decreasing H_ii, so that a group is still visited as one contiguous run."""
    spec = check_order(order)
    cols = diag.shape[0]
    if spec.visit == "act_order":
        return torch.argsort(diag, descending=True, stable=True)
    if spec.visit == "natural":
        return torch.arange(cols, device=diag.device)
    group = torch.arange(cols, device=diag.device) // group_size
    score = torch.zeros(int(group[-1]) + 1, device=diag.device).scatter_reduce(0, group, diag, spec.score,
                                                                              include_self=False)
    rank = torch.argsort(torch.argsort(score, descending=True, stable=True))      # each group's place in the visit
    within = torch.argsort(diag, descending=True, stable=True)
    return within[torch.argsort(rank[group[within]], stable=True)]
