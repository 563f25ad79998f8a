"""Viterbi search for the bitshift trellis: the textbook version, and a fast one for L = 16 (65536 states).

A path is L-bit states s_0 .. s_{T-1} with s_t = ((s_{t-1} << K) | b_t) mod 2^L, scored by sum_t (x_t - v[s_t])^2
(v: the code's value of each state). cost_t[s] = least score of a path ending in s at step t; s's J = 2^K
predecessors are p = j 2^(L-K) + (s >> K), j < J, so

    cost_t[s] = min_j cost_{t-1}[j 2^(L-K) + (s >> K)] + (x_t - v[s])^2,

one add-compare-select per state and step, and the best path is read back from which j won (`viterbi_reference`,
the book's listing). `viterbi` runs the same recursion on many sequences at once, with three changes:

  - the batch is the innermost axis, and the states are stored in an order (`state_layout`: the K-bit symbols
    reversed, the newest outermost) where a state's J predecessors sit next to each other and the J successors of
    a minimum are J slabs apart: a step is two elementwise minimums and one broadcast multiply-add, all on
    contiguous memory, no gather;
  - it keeps every step's minima [T, 2^(L-K), B] instead of back-pointers: the traceback recomputes the J
    candidates of the one state it follows, so the forward pass does no argmin (a slow op in torch);
  - chunks of the batch, sized to keep a chunk's costs in cache and all minima within a memory budget, run on a
    few threads, each op on the thread that calls it (torch's pool would wait for its slowest thread at every op).

The fast one adds the square with one rounding (a fused multiply-add), the reference with two, so their paths can
differ where two paths' costs agree to float32 rounding; anywhere else they are the same.
"""
import concurrent.futures
import contextlib
import functools

import torch


def _check(x, table, L, K, wrap):
    if x.dim() != 2 or table.shape != (2 ** L,) or x.shape[1] * K < L:
        raise ValueError(f"need x [B, T] with K*T >= L and table [2^L], got x {tuple(x.shape)}, "
                         f"table {tuple(table.shape)} (L={L}, K={K})")
    if not torch.isfinite(x).all():
        raise ValueError("x is not finite (NaN or inf)")
    if wrap is not None and (wrap.shape != x.shape[:1] or bool(((wrap < 0) | (wrap >= 2 ** (L - K))).any())):
        raise ValueError(f"wrap must be [B] states of L-K = {L - K} bits, got {tuple(wrap.shape)}")


@torch.no_grad()
def viterbi_reference(x, table, L, K, wrap=None):
    """The textbook Viterbi: x [B, T] -> least-squared-error state paths [B, T] int64.

    wrap [B] (optional) pins the path's ends for tail-biting: s_0 >> K == wrap and s_{T-1} mod 2^(L-K) == wrap."""
    _check(x, table, L, K, wrap)
    B, T = x.shape
    S, H = 2 ** L, 2 ** (L - K)
    states = torch.arange(S)
    preds = (states >> K)[:, None] + (torch.arange(2 ** K) << (L - K))[None, :]          # [S, 2^K]
    cost = (x[:, :1] - table) ** 2                                                        # any start state
    if wrap is not None:
        cost[(states >> K)[None, :] != wrap[:, None]] = float("inf")
    back = torch.zeros((T, B, S), dtype=torch.long)
    for t in range(1, T):
        best, which = cost[:, preds].min(-1)                                             # [B, S]
        back[t] = preds[states, which]
        cost = best + (x[:, t, None] - table) ** 2
    if wrap is not None:
        cost[(states & (H - 1))[None, :] != wrap[:, None]] = float("inf")
    path = torch.zeros((B, T), dtype=torch.long)
    path[:, -1] = cost.argmin(1)
    for t in range(T - 1, 0, -1):
        path[:, t - 1] = back[t].gather(1, path[:, t, None])[:, 0]
    return path


@functools.cache
def state_layout(L, K):
    """(position of each state [2^L], state at each position [2^L]), int64.

    State bit i goes to position bit L - K - K floor(i / K) + rot(i mod K), rot(β) = (β + K - L mod K) mod K: the
    symbols are stored in reverse order (the newest outermost). Then the predecessors of any state are the J
    positions q J + j, j < J, for one q, and the successors of those are the positions b 2^(L-K) + q, b < J: a
    step reads the costs as [2^(L-K), J] and writes them as [J, 2^(L-K)]."""
    i = torch.arange(L)
    shift = L - K - K * (i // K) + (i % K + K - L % K) % K
    position = (((torch.arange(2 ** L)[:, None] >> i) & 1) << shift).sum(1)
    state = torch.empty_like(position)
    state[position] = torch.arange(2 ** L)
    return position, state


@contextlib.contextmanager
def one_thread():
    """Each Viterbi step is a few tensor ops on one thread: torch's pool would wait for its slowest thread at every
    op, which stalls on a busy machine. Chunks of the batch run on threads of their own instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


CACHE_BYTES = 2 ** 23      # per thread: a chunk's cost arrays (2 x 4 bytes per state and sequence) fit in L3


@torch.no_grad()
def viterbi(x, table, L, K, wrap=None, threads=None, budget=2 ** 29):
    """x [B, T] -> least-squared-error state paths [B, T] int64, as viterbi_reference. wrap: as there.
    threads: default torch's thread count. budget: bytes of stored minima (4 2^(L-K) per step and sequence, 16 MiB
    per sequence of 256 at L=16, K=2) held at once over all threads."""
    B, T = x.shape
    S, H = 2 ** L, 2 ** (L - K)
    with one_thread() as default:
        _check(x, table, L, K, wrap)
        x = x.float()
        threads = threads or default
        chunk = max(1, min(CACHE_BYTES // (8 * S), budget // threads // (4 * T * H)))
        threads = max(1, min(threads, B // chunk))          # a thread only for a full chunk: small ops share the GIL
        search = functools.partial(_search, table=table.float(), L=L, K=K, chunk=chunk)

        def run(rows):
            return search(x[rows], wrap=None if wrap is None else wrap[rows])
        if threads == 1:
            return run(slice(None))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return torch.cat(list(pool.map(run, [slice(i * B // threads, (i + 1) * B // threads)
                                                 for i in range(threads)])))


def _search(x, table, L, K, wrap, chunk):
    """x [B, T] -> paths [B, T], in chunks of equal size <= chunk that share one set of buffers (fresh memory
    costs a page fault per 4 KiB on its first write)."""
    B, T = x.shape
    S, H = 2 ** L, 2 ** (L - K)
    width = -(-B // -(-B // chunk))
    buffers = (torch.empty(S * width), torch.empty(S * width), torch.empty(T * H * width))
    return torch.cat([_search_chunk(x[i:i + width], table, L, K, None if wrap is None else wrap[i:i + width],
                                    *buffers) for i in range(0, B, width)])


def _min_over_predecessors(cost, scratch, out):
    """cost [H J, B] -> out [H, B] = min over the J positions q J + j, halving J with elementwise minimums (a
    reduction over a middle axis is slower in torch)."""
    H, B = out.shape
    n = cost.shape[0] // H
    view = cost.view(H, 2, n // 2 * B)
    while n > 2:
        half = scratch[:H * n // 2].view(H, n // 2 * B)
        torch.minimum(view[:, 0], view[:, 1], out=half)
        n //= 2
        view = half.view(H, 2, n // 2 * B)
    torch.minimum(view[:, 0], view[:, 1], out=out)


def _search_chunk(x, table, L, K, wrap, cost, diff, best):
    """x [B, T] -> paths [B, T]. cost [S, B] lives in state_layout's positions; best [T, 2^(L-K), B] keeps every
    step's minima, from which the traceback recomputes the J candidates of the one state it follows."""
    B, T = x.shape
    S, H, J = 2 ** L, 2 ** (L - K), 2 ** K
    position, state = state_layout(L, K)
    values = table[state]                                            # the value at each position
    xt = x.T.contiguous()                                            # [T, B]: step t's inputs are contiguous
    cost, diff, best = cost[:S * B].view(S, B), diff[:S * B].view(S, B), best[:T * H * B].view(T, H, B)
    torch.sub(xt[0], values[:, None], out=cost).square_()
    if wrap is not None:
        cost.masked_fill_((state >> K)[:, None] != wrap[None, :], float("inf"))
    for t in range(1, T):
        _min_over_predecessors(cost, diff, best[t])                  # diff serves as scratch here
        torch.sub(xt[t], values[:, None], out=diff)
        torch.addcmul(best[t], diff.view(J, H, B), diff.view(J, H, B), out=cost.view(J, H, B))
    if wrap is not None:
        cost.masked_fill_((state & (H - 1))[:, None] != wrap[None, :], float("inf"))
    at = torch.empty((T, B), dtype=torch.int64)                      # the path's positions
    at[-1] = cost.argmin(0)
    batch = torch.arange(B)[:, None]
    for t in range(T - 1, 0, -1):
        before = ((at[t] & (H - 1)) << K)[:, None] | torch.arange(J)  # [B, J]: the J predecessors' positions
        diff = xt[t - 1][:, None] - values[before]
        if t > 1:
            candidates = torch.addcmul(best[t - 1][before & (H - 1), batch], diff, diff)
        else:
            candidates = diff.square()
            if wrap is not None:
                candidates.masked_fill_((state[before] >> K) != wrap[:, None], float("inf"))
        at[t - 1] = before.gather(1, candidates.argmin(1, keepdim=True))[:, 0]
    return state[at.T]
