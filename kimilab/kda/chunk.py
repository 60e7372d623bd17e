"""Chunkwise KDA: the same arithmetic as the recurrence, as batched matrix products.

The sequence is cut into chunks of C tokens. Inside a chunk the C delta steps become
a few C x C and C x K products (the UT transform, see :func:`chunk_kda`); everything
that does not depend on the state entering the chunk is computed for many chunks and
all heads at once (``_prepare_slab``), and only a short state pass walks the chunks in
order. Two numerical guards keep it exact in float64 and finite in float32:
``_block_sizes`` factors the in-chunk decays so no exponent overflows, and ``_flush``
zeroes decays too small to matter. ``kda.transition`` reuses the slab preparation for
the affine map of a whole segment.
"""

from __future__ import annotations

import math

import numpy as np

from kimilab.kda._inputs import check_sequence, resolve_scale
from kimilab.validate import check_int

__all__ = ["chunk_kda", "chunk_kda_flops"]

# Largest spread (max - min) of the cumulative gate G inside one block of a chunk; see
# _block_sizes. Every in-block gate factor then lies in [e^-limit, e^limit], and so
# does the discarded upper triangle of a diagonal block.
_EXP_LIMIT = {np.dtype(np.float32): 60.0, np.dtype(np.float64): 300.0}
# Whole decays exp(G_x - G_y) below this level are set to exactly 0 (float32: 1e-10, far
# below float32 rounding; float64: sqrt(tiny) ~ 1e-154). That changes any result by less
# than the level times |k| |v|, and keeps subnormal numbers out of the matmuls: BLAS runs
# several times slower when whole rows of tiny values meet.
_FLUSH = {np.dtype(np.float32): 1e-10, np.dtype(np.float64): float(np.sqrt(np.finfo(np.float64).tiny))}
_SOLVE_BLOCK = 16  # diagonal block size of the triangular solve (see _unit_lower_solve)
_SLAB = 32  # chunk-heads prepared together (see _slabs)


def _flush(x: np.ndarray) -> np.ndarray:
    """Set entries of the non-negative decay factor ``x`` below _FLUSH to 0, in place."""
    x *= x >= _FLUSH[x.dtype]
    return x


def _small_unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I + L)^-1`` for a stack of small strictly lower ``L [M, b, b]``, by rows.

    Row i of the inverse is ``e_i - L[i, :i] X[:i]``: b - 1 batched products, each over
    all M blocks at once. Cheap for b <= 16 (what ``_unit_lower_solve`` feeds it).
    """
    M, b, _ = L.shape
    X = np.zeros_like(L)
    X.reshape(M, b * b)[:, :: b + 1] = 1
    minus_L = np.negative(L)
    for i in range(1, b):
        np.matmul(minus_L[:, i : i + 1, :i], X[:, :i, :i], out=X[:, i : i + 1, :i])
    return X


def _unit_lower_solve(L: np.ndarray, R: np.ndarray, block: int = _SOLVE_BLOCK, out=None) -> np.ndarray:
    """``X = (I + L)^-1 R`` for strictly lower-triangular ``L [..., n, n]`` and ``R [..., n, m]``.

    Only the strictly lower triangle of L is read (its upper part may hold anything finite).
    Block forward substitution: invert all the small diagonal blocks at once, then
    ``X_b = D_b^-1 (R_b - L[b, :b] X[:b])`` block row by block row -- about 2 n / block
    batched products and half the multiply-adds of forming the inverse and then
    multiplying by it. (A generic batched np.linalg.solve is far slower at this size;
    ``make bench`` times the candidates.) n is zero-padded to a multiple of the block.
    ``out`` (optional, [..., n, m]) receives X.
    """
    *lead, n, _ = L.shape
    m = R.shape[-1]
    block = max(1, min(block, n))
    nb = -(-n // block)
    X = np.empty(R.shape, np.result_type(L, R)) if out is None else out
    if nb * block != n:  # zero padding adds identity rows and leaves the first n rows of X alone
        Lp = np.zeros((*lead, nb * block, nb * block), L.dtype)
        Lp[..., :n, :n] = L
        Rp = np.zeros((*lead, nb * block, m), R.dtype)
        Rp[..., :n, :] = R
        X[...] = _unit_lower_solve(Lp, Rp, block)[..., :n, :]
        return X
    blocks = range(nb)
    diag = L.reshape(*lead, nb, block, nb, block)[..., blocks, :, blocks, :]  # [nb, *lead, block, block]
    inv_diag = _small_unit_lower_inverse(diag.reshape(-1, block, block)).reshape(diag.shape)
    rhs = np.empty((*lead, block, m), X.dtype)
    for b in blocks:
        rows = slice(b * block, (b + 1) * block)
        if b:
            np.matmul(L[..., rows, : b * block], X[..., : b * block, :], out=rhs)
            np.subtract(R[..., rows, :], rhs, out=rhs)
        np.matmul(inv_diag[b], rhs if b else R[..., rows, :], out=X[..., rows, :])
    return X


def _block_sizes(G: np.ndarray, C: int, decaying: bool) -> np.ndarray:
    """Per chunk, the largest block size s (a divisor of C) whose factored scores are safe.

    Inside a block of s rows the score exponent is split around the block's first row r:
    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j). Both factors, and the discarded
    products above the diagonal, stay within e^(+-spread), the spread being max - min of
    G over the block. We take the largest s whose every block spread is <= _EXP_LIMIT,
    so nothing overflows. Strong gates shrink s; s = 1 (spread 0) is always safe.
    ``decaying`` (all g <= 0: G falls) makes the spread just first minus last.
    G [..., C, K] (any leading chunk axes) -> int array [...].
    """
    *lead, _, K = G.shape
    limit = _EXP_LIMIT[G.dtype]
    sizes = np.ones(lead, dtype=np.int64)
    open_ = np.ones(lead, dtype=bool)
    for s in (d for d in range(C, 1, -1) if C % d == 0):
        if decaying:
            spread = G[..., ::s, :] - G[..., s - 1 :: s, :]
        else:
            blocks = G.reshape(*lead, C // s, s, K)
            spread = blocks.max(axis=-2) - blocks.min(axis=-2)
        fits = open_ & (spread.max(axis=(-2, -1), initial=0.0) <= limit)
        sizes[fits] = s
        open_ &= ~fits
        if not open_.any():
            break
    return sizes


def _buffer(work, name: str, shape: tuple, dtype) -> np.ndarray:
    """A zero-filled array of ``shape``; with ``work`` (a dict), the one kept there under ``name``.

    ``chunk_kda`` passes one ``work`` to all its slabs, so each buffer is made (zero-filled)
    once per call and then holds what the previous slab left; a shorter last slab takes
    a prefix. Without ``work`` (``prepare_kda`` keeps every slab) each call gets new arrays.
    """
    size = math.prod(shape)
    if work is None:
        return np.zeros(shape, dtype)
    flat = work.get(name)
    if flat is None or flat.size < size:
        flat = work[name] = np.zeros(size, dtype)
    return flat[:size].reshape(shape)


def _output_mask(work, C: int, K: int, scale: float, dtype) -> np.ndarray:
    """The flat [C * (K + C)] factor of QA = [exp(G) q | Aqk]: the scale, times Aqk's lower triangle."""
    key = ("mask", C, K, scale)
    if work is not None and key in work:
        return work[key]
    mask = np.concatenate([np.ones((C, K)), np.tri(C, C, 0)], axis=1).reshape(-1).astype(dtype)
    mask *= np.asarray(scale, dtype)
    if work is not None:
        work[key] = mask
    return mask


def _time_major(x: np.ndarray, c0: int, c1: int, C: int) -> np.ndarray:
    """Chunks c0..c1-1 of x [B, T, H, D] as a view [c1-c0, B, C, H, D] (zero-padded copy past T).

    Padded steps (k = v = beta = g = 0) leave the state untouched.
    """
    B, T, H, D = x.shape
    n = c1 - c0
    seg = x[:, c0 * C : c1 * C]
    if seg.shape[1] < n * C:
        seg = np.concatenate([seg, np.zeros((B, n * C - seg.shape[1], H, D), x.dtype)], axis=1)
    return seg.reshape(B, n, C, H, D).swapaxes(0, 1)


def _slab(x: np.ndarray, c0: int, c1: int, C: int) -> np.ndarray:
    """Chunks c0..c1-1 of x [B, T, H, D] as a fresh chunk-major stack [(c1-c0)*B*H, C, D]."""
    return _time_major(x, c0, c1, C).swapaxes(2, 3).copy().reshape(-1, C, x.shape[3])


def _prepare_slab(q, k, v, G_all, beta, c0, c1, C, scale, decaying: bool, need_output: bool,
                  work=None) -> dict:
    """Everything in chunks c0..c1-1 that does not depend on the state, batched over them all.

    ``G_all`` [B, N, C, H, K] is the in-chunk cumulative gate of the whole sequence (``_chunk_cumsum``).
    Returns chunk-major stacks [n*B*H, ...]: W, U (the UT transform), kd = k exp(G_C - G),
    a_last = exp(G_C) and, with queries, QA = [exp(G) q | Aqk] [n*B*H, C, K + C], so that
    the slab's output is one matmul of QA with [state entering each chunk; V'].
    ``work``: see _buffer.

    Scores are products of factors from ONE exp (both sides bounded, see _block_sizes):
    row i of block b carries E_i = exp(G_i - G_r) (r = first row of b), column j carries
    exp(G_r - G_j) = 1 / E_j inside its block and exp(G_r - G_r') / E_j for an earlier
    block (first row r'). Whole decays exp(G_x - G_y) are flushed (see _FLUSH).
    Elementwise work runs in the inputs' own time-major order [n, B, C, H, K] (long
    contiguous rows, no gathering copies); matmuls read per-head strided views, and the
    column factors are copied transposed ([K, C] per head): BLAS multiplies
    [C, K] @ [K, C] about twice as fast as [C, K] @ [C, K]^T at this size.
    """
    B, _, H, K = k.shape
    V = v.shape[-1]
    dtype = k.dtype
    n = c1 - c0
    F = n * B * H
    tm = (n, B, C, H)  # time-major slab shape, less the feature axis
    # One block size for the slab: its strongest chunk decides (gathering chunks into
    # groups of equal size costs more than it saves). With ``work``, sized once for all chunks.
    G5 = G_all[:, c0:c1].swapaxes(0, 1)  # [n, B, C, H, K]
    if work is None:
        s = int(_block_sizes(G5.reshape(n, B, C, H * K), C, decaying).min())
    else:
        if "sizes" not in work:
            work["sizes"] = _block_sizes(G_all.reshape(B, -1, C, H * K), C, decaying)
        s = int(work["sizes"][:, c0:c1].min())
    nb = C // s
    Gb = G5.reshape(n, B, nb, s, H * K)
    first = Gb[:, :, :, :1]  # G at each block's first row
    k5, b5 = _time_major(k, c0, c1, C), _time_major(beta[..., None], c0, c1, C)
    E, decay, tmp = (_buffer(work, name, tm + (K,), dtype) for name in ("E", "decay", "tmp"))
    E_b, decay_b = E.reshape(Gb.shape), decay.reshape(Gb.shape)
    np.exp(np.subtract(Gb, first, out=E_b), out=E_b)  # exp(G_i - G_r), in [e^-limit, e^limit]
    _flush(np.multiply(E_b, np.exp(first), out=decay_b))  # exp(G_i)
    rhs = _buffer(work, "rhs", tm + (K + V,), dtype)  # [beta k exp(G) | beta v]: the UT transform solves against it
    np.multiply(_time_major(v, c0, c1, C), b5, out=rhs[..., K:])
    kl = _buffer(work, "kl", tm + (K,), dtype)  # beta k, then the row factor beta k E
    np.multiply(k5, b5, out=kl)
    np.multiply(kl, decay, out=rhs[..., :K])
    kl *= E
    if need_output:
        QA = _buffer(work, "QA", (n, B, H, C, K + C), dtype)  # Aqk above the diagonal blocks: never written, 0
        q5 = _time_major(q, c0, c1, C)  # the scale comes last, with the causal mask
        np.multiply(q5, decay, out=QA[..., :K].swapaxes(2, 3))
        ql = np.multiply(q5, E, out=_buffer(work, "ql", tm + (K,), dtype))  # the row factor q E
    kd = _buffer(work, "kd", (n, B, H, C, K), dtype)  # k_j exp(G_C - G_j) = k_j exp(G_C - G_r) / E_j
    _flush(np.divide(np.exp(Gb[:, :, -1:, -1:] - first), E_b, out=decay_b))
    np.multiply(k5, decay, out=kd.swapaxes(2, 3))
    right = _buffer(work, "right", (n, B, H, K, C), dtype)  # column factors, transposed
    right_tm = right.transpose(0, 1, 4, 2, 3)  # the same memory seen as [n, B, C, H, K]
    np.divide(k5, E, out=tmp)  # k_j / E_j; per row block, the earlier columns are redone
    np.copyto(right_tm, tmp)
    L = _buffer(work, "L", (n, B, H, C, C), dtype)  # only its strictly lower triangle is read
    k_left, q_left = kl.swapaxes(2, 3), (ql.swapaxes(2, 3) if need_output else None)
    for b in range(nb):
        lo, hi = b * s, (b + 1) * s
        if b:  # earlier blocks b': k_j exp(G_r - G_r') / E_j
            _flush(np.divide(np.exp(first[:, :, b : b + 1] - first[:, :, :b]), E_b[:, :, :b], out=decay_b[:, :, :b]))
            np.multiply(k5[:, :, :lo], decay[:, :, :lo], out=tmp[:, :, :lo])
            np.copyto(right_tm[:, :, :lo], tmp[:, :, :lo])
        np.matmul(k_left[..., lo:hi, :], right[..., :hi], out=L[..., lo:hi, :hi])
        if need_output:
            np.matmul(q_left[..., lo:hi, :], right[..., :hi], out=QA[..., lo:hi, K : K + hi])
    # UT transform: T = (I + L)^-1 diag(beta), so [W | U] = (I + L)^-1 [beta exp(G) K | beta V].
    WU = _buffer(work, "WU", (n, B, H, C, K + V), dtype)
    _unit_lower_solve(L, rhs.swapaxes(2, 3), out=WU)
    WU = WU.reshape(F, C, K + V)
    a_last = _flush(np.exp(G5[:, :, -1])).reshape(F, K)
    prep = {"W": WU[:, :, :K], "U": WU[:, :, K:], "kd": kd.reshape(F, C, K), "a_last": a_last}
    if need_output:  # scale, and keep Aqk's causal part: one flat multiply beats masking diagonal blocks
        QA = QA.reshape(F, C * (K + C))
        QA *= _output_mask(work, C, K, scale, dtype)
        prep["QA"] = QA.reshape(F, C, K + C)
    return prep


def _chunk_cumsum(g: np.ndarray, C: int) -> np.ndarray:
    """Inclusive cumsum of g [B, T, H, K] restarting at every chunk -> a view [B, N, C, H, K].

    The sums are laid out position-major ([B, C, N, H, K] in memory), so each of the C - 1
    adds runs over one contiguous [N, H, K] block: twice as fast as adding strided rows
    in time order, and far faster than np.cumsum along a strided axis.
    """
    B, T, H, K = g.shape
    N = max(1, -(-T // C))
    if N * C != T:
        g = np.concatenate([g, np.zeros((B, N * C - T, H, K), g.dtype)], axis=1)
    G = np.empty((B, C, N, H, K), g.dtype)
    np.copyto(G, g.reshape(B, N, C, H, K).swapaxes(1, 2))
    for i in range(1, C):
        G[:, i] += G[:, i - 1]
    return G.swapaxes(1, 2)


def _slabs(n_chunks: int, heads: int):
    """(c0, c1) ranges of chunks processed together: ~_SLAB chunk-heads, so that a slab's
    temporaries stay in cache (measured: ~25% faster than one pass over all chunks)."""
    step = max(1, _SLAB // max(1, heads))
    return [(c0, min(n_chunks, c0 + step)) for c0 in range(0, n_chunks, step)]


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunkwise KDA (UT transform). Same result as ``recurrent_kda``; returns ``(o, final_state)``.

    Per chunk (q scaled, G = inclusive cumsum of g in the chunk)::

        Akk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)  (j < i);  Aqk likewise with q (j <= i)
        T = (I + StrictTril(diag(beta) Akk))^-1 diag(beta);  W = T (exp(G) K);  U = T V
        V' = U - W S;  O = (exp(G) Q) S + Aqk V';  S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'

    Everything except the dependence on S is batched over many chunks and all heads at
    once (``_prepare_slab``, one slab of chunks at a time); the state pass is 2 small
    matmuls per chunk, and it stores [S; V'] per chunk so that O is one matmul per slab.
    A short last chunk is zero-padded (k = v = beta = g = 0 leaves the state untouched).
    Decays exp(G_x - G_y) below _FLUSH (float32 1e-10, float64 ~1e-154) are flushed to 0.
    """
    q, k, v, g, beta, S0, batched, (B, T, H, K, V), dtype = check_sequence(
        q, k, v, g, beta, initial_state)
    scale = resolve_scale(scale, K)
    C = check_int("chunk_size", chunk_size, 1)
    N = max(1, -(-T // C))
    decaying = bool(g.size == 0 or g.max() <= 0)
    S = (np.zeros((B * H, K, V), dtype) if S0 is None
         else S0.reshape(B * H, K, V).astype(dtype, copy=True))
    o = np.empty((B, N, C, H, V), dtype)
    G = _chunk_cumsum(g, C)
    work = {}  # buffers shared by all slabs (see _buffer)
    for c0, c1 in _slabs(N, B * H):
        prep = _prepare_slab(q, k, v, G, beta, c0, c1, C, scale, decaying, need_output=True, work=work)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, C, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        Z = _buffer(work, "Z", (n, B * H, K + C, V), dtype)  # per chunk: [state entering it; V']
        np.copyto(Z[:, :, K:], U)  # V' starts as U (one strided copy; then contiguous updates)
        WS, decayed = _buffer(work, "WS", (B * H, C, V), dtype), _buffer(work, "decayed", (B * H, K, V), dtype)
        Z[0, :, :K] = S
        for j in range(n):
            state, v_new = Z[j, :, :K], Z[j, :, K:]
            v_new -= np.matmul(W[j], state, out=WS)  # V' = U - W S
            nxt = Z[j + 1, :, :K] if j + 1 < n else S
            np.matmul(kd[j].swapaxes(-1, -2), v_new, out=nxt)
            nxt += np.multiply(a_last[j], state, out=decayed)  # S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'
        # (exp(G) Q) S + Aqk V', written straight into o
        np.matmul(prep["QA"].reshape(n, B, H, C, K + C), Z.reshape(n, B, H, K + C, V),
                  out=o[:, c0:c1].transpose(1, 0, 3, 2, 4))
    o = o.reshape(B, N * C, H, V)[:, :T]
    S = S.reshape(B, H, K, V)
    if not batched:
        return o[0], S[0]
    return o, S


def _solve_flops(n: int, m: int, block: int = _SOLVE_BLOCK) -> int:
    """FLOPs of ``_unit_lower_solve`` for one [n, n] system with m right-hand sides.

    Block forward substitution, as the code runs it: the small diagonal blocks inverted
    row by row, then per block row one product with the rows already solved, a
    subtraction, and one product with the block's inverse. n is padded to whole blocks.
    """
    b = max(1, min(block, n))
    nb = -(-n // b)
    inverses = nb * ((b - 1) * b * (2 * b - 1) // 3)  # sum over rows i < b of a [1, i] x [i, i] product
    off_diagonal = b * b * m * nb * (nb - 1) + (nb - 1) * b * m  # L[row, :row] X[:row], then R - that
    diagonal = nb * 2 * b * b * m  # D_b^-1 (R_b - ...)
    return inverses + off_diagonal + diagonal


def chunk_kda_flops(T: int, H: int, K: int, V: int, chunk: int = 64) -> int:
    """FLOPs of ``chunk_kda`` (multiply-add = 2), counted from the products it runs.

    Per chunk of length c (the last may be short; the kernel pads it to ``chunk``, and
    the padding is not counted) and head: the gate factors and beta-scaled inputs
    ~6cK + cV; Akk and Aqk as two full [c, K] x [K, c] products 2 * 2c^2K; the UT
    transform as block forward substitution on [beta exp(G) K | beta V] (c rows, K + V
    columns, ``_solve_flops``: about c^2 (K + V) multiply-adds, no inverse is formed);
    V' = U - W S 2cKV + cV; the output [exp(G) Q | Aqk] [S; V'] 2c(K + c)V; the state
    update 2cKV + 2KV. The Akk/Aqk count is for whole-chunk blocks (strong gates split
    a chunk into smaller blocks, which does less work). Masked-out work is counted
    where the code computes it (the full c x c products).
    """
    T, H, K, V, chunk = (int(x) for x in (T, H, K, V, chunk))
    total = 0
    full, rest = divmod(T, chunk)
    for c, count in ((chunk, full), (rest, 1 if rest else 0)):
        if count == 0:
            continue
        per = (
            6 * c * K + c * V  # gate factors, beta-scaled k and v
            + 2 * (2 * c * c * K)  # Akk, Aqk
            + _solve_flops(c, K + V)  # [W | U] by block forward substitution
            + 2 * c * K * V + c * V  # V' = U - W S
            + 2 * c * (K + c) * V  # O = [exp(G) Q | Aqk] [S; V']
            + 2 * c * K * V + 2 * K * V  # S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'
        )
        total += count * per
    return total * H
