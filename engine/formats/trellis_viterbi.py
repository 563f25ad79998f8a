"""Viterbi search for the bitshift trellis: the textbook version, and a fast one for L = 16 (65536 states).

A path is L-bit states s_0 .. s_{T-1} with s_t = ((s_{t-1} << K) | b_t) mod 2^L, scored by sum_t (x_t - v[s_t])^2
(v: the code's value of each state). cost_t[s] = least score of a path ending in s at step t; s's J = 2^K
predecessors are p = j 2^(L-K) + (s >> K), j < J, so

    cost_t[s] = min_j cost_{t-1}[j 2^(L-K) + (s >> K)] + (x_t - v[s])^2,

one add-compare-select per state and step, and the best path is read back from which j won (`viterbi_reference`,
the book's listing). `viterbi` runs the same recursion on many sequences at once, with four changes:

  - the batch is the innermost axis, and the states are stored in an order (`state_layout`: the K-bit symbols
    reversed, the newest outermost) where a state's J predecessors sit next to each other and the J successors of
    a minimum are J slabs apart: all reads and writes are contiguous, no gather;
  - it carries only the minima m_t[q] = min_j cost_{t-1}[q J + j] (2^(L-K) per sequence, a quarter of the costs at
    K=2) from step to step, as cost_t = m_t + (x_t - v)^2 is one add away (`acs_step`); every step's minima
    [T, 2^(L-K), B] are kept, and the traceback recomputes the J candidates of the one state it follows, so the
    forward pass does no argmin (a slow op in torch);
  - on big searches the step is compiled (torch.compile, C++ on a CPU) into one pass over the states that never
    writes the costs at all; the eager step below computes the same numbers with a few whole-array torch ops;
  - chunks of the batch, sized to keep a chunk's arrays in cache and all minima within a memory budget, run on a
    few threads, each op on the thread that calls it (torch's pool, and OpenMP inside a compiled kernel, would wait
    for their slowest thread at every step, which stalls on a busy machine).

All of them round the same way (the square, then the sum), so they find the same paths as the textbook listing.
"""
import concurrent.futures
import contextlib
import functools
import warnings

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


CACHE_BYTES = 2 ** 23      # per thread: the arrays a chunk's step touches fit in L3 (chunk widths of 16 at L=16)
COMPILE_FROM = 2 ** 30     # state-steps (B T 2^L) from which compiling the step (seconds, once per shape) pays off


@torch.no_grad()
def viterbi(x, table, L, K, wrap=None, threads=None, budget=2 ** 29, compiled=None):
    """x [B, T] -> least-squared-error state paths [B, T] int64, as viterbi_reference. wrap: as there.
    threads: default torch's thread count. budget: bytes of stored minima (4 2^(L-K) per step and sequence, 16 MiB
    per sequence of 256 at L=16, K=2) held at once over all threads. compiled: True / False forces the compiled /
    eager step; None compiles searches of COMPILE_FROM state-steps and more, and runs eager where it cannot."""
    with one_thread() as default:
        _check(x, table, L, K, wrap)
        B, T = x.shape
        S, H = 2 ** L, 2 ** (L - K)
        threads = threads or default
        step = _compiled_step() if compiled or (compiled is None and B * T * S >= COMPILE_FROM) else None
        per_sequence = 8 * H + (0 if step else 6 * S)      # bytes a step touches: minima in and out, eager costs
        chunk = max(1, min(CACHE_BYTES // per_sequence, budget // threads // (4 * T * H)))
        threads = max(1, min(threads, B // chunk))          # a thread only for a full chunk: small ops share the GIL
        width = min(chunk, -(-B // threads))
        n = -(-B // width) * width                           # equal chunks: one shape to compile
        x = torch.cat((x.float(), x.new_zeros(n - B, T, dtype=torch.float32)))
        wrap = None if wrap is None else torch.cat((wrap, wrap.new_zeros(n - B)))
        failure = step and _compiles(H, S, width)
        if failure:
            if compiled:
                raise RuntimeError("torch.compile cannot build the Viterbi step here") from failure
            warnings.warn(f"torch.compile cannot build the Viterbi step here ({failure!r:.200}): it runs eager")
            step = None
        search = functools.partial(_search, table=table.float(), L=L, K=K, width=width, step=step)
        rows = -(-n // width // threads) * width
        parts = [slice(i, i + rows) for i in range(0, n, rows)]

        @torch.no_grad()                                     # grad mode is per thread (and in the step's guards)
        def run(part):
            return search(x[part], wrap=None if wrap is None else wrap[part])
        if len(parts) == 1:
            return run(parts[0])[:B]
        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            return torch.cat(list(pool.map(run, parts)))[:B]


def acs_step(prev, x, values):
    """One add-compare-select step on the minima alone: prev [2^(L-K), B] = m_{t-1}, x [B] = x_{t-1}, values [2^L]
    (v at each position) -> m_t [2^(L-K), B]. The successors of minimum q sit at positions b 2^(L-K) + q, so
    cost_{t-1}[p] = prev[p mod 2^(L-K)] + (x - values[p])^2, and m_t[q] = min_j cost_{t-1}[q J + j]."""
    H, B = prev.shape
    cost = prev.repeat(values.shape[0] // H, 1) + (x - values[:, None]) ** 2
    return cost.view(H, -1, B).amin(1)


def _acs_into(prev, x, values, out):
    out.copy_(acs_step(prev, x, values))


@functools.cache
def _compiled_step():
    """acs_step compiled (writing into out): one pass over the states that never writes the costs. The C++ wrapper
    (cpp_wrapper) runs it without the GIL, so that chunks on several Python threads run at once; one torch thread
    each keeps inductor from adding an OpenMP team (and its barrier at every step). Made on first use: importing
    torch.compile's machinery takes seconds."""
    from ..kernels import compiled                  # torch.compile's machinery: imported by big searches only
    return compiled(_acs_into, dynamic=False, options={"cpp_wrapper": True})


@functools.cache
def _compiles(H, S, width):
    """Compile the step for one chunk shape on this thread (before the workers call it), on zeros: None where it
    works, the exception where it does not (no C++ compiler, say)."""
    try:
        _compiled_step()(torch.zeros(H, width), torch.zeros(width), torch.zeros(S), torch.empty(H, width))
    except Exception as error:      # the eager step computes the same numbers
        return error
    return None


def _acs_eager(prev, x, values, out, cost, scratch):
    """acs_step(prev, x, values) into out, with whole-array ops on preallocated buffers cost [2^L, B], scratch
    [2^(L-1), B] (fresh memory costs a page fault per 4 KiB on its first write)."""
    H, B = prev.shape
    view = cost.view(-1, H, B)
    torch.sub(x, values.view(-1, H, 1), out=view).square_()
    view += prev
    _min_over_predecessors(cost, scratch, out)


def _search(x, table, L, K, wrap, width, step):
    """x [B, T] -> paths [B, T], in chunks of `width` sequences that share one set of buffers. step: the compiled
    step, or None for the eager one."""
    B, T = x.shape
    S, H = 2 ** L, 2 ** (L - K)
    best = torch.empty(T, H, width)
    step = step or functools.partial(_acs_eager, cost=torch.empty(S, width), scratch=torch.empty(S // 2, width))
    return torch.cat([_search_chunk(x[i:i + width], table, L, K, None if wrap is None else wrap[i:i + width], best,
                                    step) for i in range(0, B, width)])


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


def _search_chunk(x, table, L, K, wrap, best, step):
    """x [B, T] -> paths [B, T]. best [T, 2^(L-K), B] holds every step's minima m_t in state_layout's positions
    (m_0: 0, or inf off the pinned start), from which the traceback recomputes the J candidates of the one state it
    follows."""
    B, T = x.shape
    H, J = 2 ** (L - K), 2 ** K
    position, state = state_layout(L, K)
    values = table[state]                                            # the value at each position
    xt = x.T.contiguous()                                            # [T, B]: step t's inputs are contiguous
    best[0] = 0
    if wrap is not None:                                             # s >> K is a function of position mod H
        best[0].masked_fill_((state[:H] >> K)[:, None] != wrap[None, :], float("inf"))
    for t in range(1, T):
        step(best[t - 1], xt[t - 1], values, best[t])
    cost = best[T - 1].repeat(J, 1) + (xt[T - 1] - values[:, None]) ** 2
    if wrap is not None:
        cost.masked_fill_((state & (H - 1))[:, None] != wrap[None, :], float("inf"))
    at = torch.empty((T, B), dtype=torch.int64)                      # the path's positions
    at[-1] = cost.argmin(0)
    j = torch.arange(J)[:, None]
    for t in range(T - 1, 0, -1):
        before = ((at[t] & (H - 1)) << K) | j                         # [J, B]: the J predecessors' positions
        candidates = best[t - 1].gather(0, before & (H - 1)) + (xt[t - 1] - values[before]) ** 2
        at[t - 1] = before.gather(0, candidates.argmin(0, keepdim=True))[0]
    return state[at.T]
