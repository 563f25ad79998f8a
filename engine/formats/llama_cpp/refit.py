"""GPTQ's codes kept, each GGML block's f16 fields refit to them (gptq_ggml.py's last step, refit=True).

llama.cpp's quantizer fits a block's scales to the weights before GPTQ chooses the codes; once the codes are fixed,
the f16 fields that best reproduce the weights through them are a least-squares solution in H's norm (the layer
error GPTQ minimizes), found per row and rounded to f16, kept only where they lower that row's error.
"""
import torch

from ..numerics.obq import ROWS
from . import ggml


def _sub_scales(f):
    return f["sc"].float()


def _k_mins(f):
    return -f["m"].float()


# the types whose grid is linear in a block's f16 fields: w = d * s_g * (code - zero) + c * o_g on sub-block g, with
# d the block's (super-block's) f16 scale and c its f16 offset field ("m" of Q4_1 / Q5_1, "dmin" of the K-quants with
# mins; absent where the zero point is fixed), s_g and o_g the fixed integer sub-block scales and mins of the stored
# fields (1 where there are none): type -> (s from the fields, (c's field, o from the fields) or None)
REFIT = {"Q4_0": (None, None), "Q5_0": (None, None), "Q8_0": (None, None), "IQ4_NL": (None, None),
         "Q3_K": (lambda f: f["sc"].float() - 32, None), "Q6_K": (_sub_scales, None),
         "IQ4_XS": (lambda f: f["l"].float() - 32, None),
         "Q4_1": (None, ("m", None)), "Q5_1": (None, ("m", None)),
         "Q2_K": (_sub_scales, ("dmin", _k_mins)), "Q4_K": (_sub_scales, ("dmin", _k_mins)),
         "Q5_K": (_sub_scales, ("dmin", _k_mins))}


REFIT_SCALARS = 2 ** 24          # refit_scales' working set (float32s): 64 MiB, whatever the layer's size


def refit_scales(weight, hessian, type_name, codes, fields):
    """GPTQ's codes kept, each block's f16 fields refit to them: per row, the x = (d [blocks], c [blocks]) minimizing
    the layer error (w_hat - w) H (w_hat - w)^T with w_hat = sum_b d_b u_b + c_b v_b, u_b the row's
    (code - zero) * s_g on block b and v_b its o_g there (REFIT), is the solution of A x = r, A = P H P^T and
    r = P H w^T over the basis P = (u, v). Rounded to f16, it replaces a row's fields only where that lowers the row's
    error. weight [out, in], codes [out, in] -> fields with the new d (and c) (the same dict otherwise)."""
    out_f, cols = weight.shape
    _, block, _ = ggml.GGML_TYPES[type_name]
    group, zero, nb = ggml.AFFINE[type_name][1], ggml.AFFINE[type_name][3] or 0, cols // block
    scales, offset = REFIT[type_name]

    def per_weight(values):                      # [out, sub-blocks] -> [out, blocks, block]
        return values.reshape(out_f, -1).repeat_interleave(group, 1).reshape(out_f, nb, block)

    basis = [(codes.float() - zero).reshape(out_f, nb, block)]
    if scales is not None:
        basis[0] = basis[0] * per_weight(scales(fields))
    keys = ["d"] + ([offset[0]] if offset else [])
    if offset:
        basis.append(torch.ones(out_f, nb, block) if offset[1] is None else per_weight(offset[1](fields)))
    P, W = torch.stack(basis, 1), weight.float().reshape(out_f, nb, block)     # P [out, k, blocks, block]
    Hb, k = hessian.float().reshape(nb, block, nb, block), len(keys)
    old = torch.cat([fields[key].reshape(out_f, nb).float() for key in keys], 1)
    # rows at a time (T is rows x k x blocks x in): a power of two up to obq.ROWS, so that a share of the rows that
    # starts at a multiple of ROWS (engine.distributed) meets the same products, and gets the same bytes
    chosen, rows_at_once = [], min(ROWS, 1 << (max(1, REFIT_SCALARS // (k * nb * cols))).bit_length() - 1)
    for at in range(0, out_f, rows_at_once):
        rows = slice(at, at + rows_at_once)
        # the k kinds of basis folded into the rows: the same products, in the same order, for every k
        n, Pk = len(P[rows]), P[rows].reshape(-1, nb, block)
        T = torch.einsum("rai,aibj->rabj", Pk, Hb)                   # [n * k, blocks, blocks, block]
        A = torch.stack([torch.einsum("rabj,rbj->rab", T, P[rows, kind].repeat_interleave(k, 0))
                         for kind in range(k)], 2)
        A = A.reshape(n, k, nb, k, nb).reshape(n, k * nb, k * nb)     # [row, (kind, block), (kind, block)]
        r = torch.einsum("rabj,rbj->ra", T, W[rows].repeat_interleave(k, 0)).reshape(n, k * nb)
        ridge = 1e-6 * A.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-30)[:, None, None] * torch.eye(k * nb)
        new = torch.linalg.solve(A + ridge, r).half().float()

        better = torch.isfinite(new).all(1) & (row_errors(new, P[rows], W[rows], hessian)
                                                < row_errors(old[rows], P[rows], W[rows], hessian))
        chosen.append(torch.where(better[:, None], new, old[rows]))
    x = torch.cat(chosen)
    return {**fields, **{key: x[:, i * nb:(i + 1) * nb].reshape(fields[key].shape).to(fields[key].dtype)
                         for i, key in enumerate(keys)}}


def row_errors(x, P, W, hessian):
    """Each row's layer error (w_hat - w) H (w_hat - w)^T, in float64, for the fields x [rows, (kind, block)] over the
    basis P [rows, k, blocks, block] (w_hat = sum over kinds of x * P) and the weights W [rows, blocks, block].

    Computed from w_hat - w, not from the solve's x A x^T - 2 x.r: that form leaves out the constant w H w^T, so both
    of its terms are about w H w^T and a difference between two x is a small remainder of large numbers, which
    another CPU's float32 sums can flip (a refit kept where it raised the error on an AMD EPYC, not on a Xeon)."""
    n, k, nb, block = P.shape
    w_hat = (x.double().reshape(n, k, nb, 1) * P.double()).sum(1)      # f16 fields x small integers: exact
    e = (w_hat - W.double()).reshape(n, nb * block)
    errors = torch.zeros(n, dtype=torch.float64)
    step = max(1, REFIT_SCALARS // (2 * nb * block))                  # H's columns in float64, a slice at a time
    for at in range(0, nb * block, step):
        cols = slice(at, at + step)
        errors += ((e @ hessian[:, cols].double()) * e[:, cols]).sum(1)
    return errors
