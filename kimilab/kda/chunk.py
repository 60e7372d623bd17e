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
_SLAB = 64  # chunk-heads prepared together (see _slabs)


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


def _unit_lower_solve(L: np.ndarray, R: np.ndarray, block: int = _SOLVE_BLOCK) -> np.ndarray:
    """``X = (I + L)^-1 R`` for strictly lower-triangular ``L [F, n, n]`` and ``R [F, n, m]``.

    Block forward substitution: invert all the small diagonal blocks at once, then
    ``X_b = D_b^-1 (R_b - L[b, :b] X[:b])`` block row by block row -- about 2 n / block
    batched products and half the multiply-adds of forming the inverse and then
    multiplying by it. (A generic batched np.linalg.solve is far slower at this size;
    ``make bench`` times the candidates.) n is zero-padded to a multiple of the block.
    """
    F, n, _ = L.shape
    block = max(1, min(block, n))
    nb = -(-n // block)
    if nb * block != n:  # zero padding adds identity rows and leaves the first n rows of X alone
        Lp = np.zeros((F, nb * block, nb * block), L.dtype)
        Lp[:, :n, :n] = L
        Rp = np.zeros((F, nb * block, R.shape[-1]), R.dtype)
        Rp[:, :n] = R
        return _unit_lower_solve(Lp, Rp, block)[:, :n]
    blocks = range(nb)
    diag = L.reshape(F, nb, block, nb, block)[:, blocks, :, blocks]  # [nb, F, block, block]
    inv_diag = _small_unit_lower_inverse(diag.reshape(nb * F, block, block)).reshape(nb, F, block, block)
    X = np.empty(R.shape, np.result_type(L, R))
    for b in blocks:
        rows = slice(b * block, (b + 1) * block)
        rhs = R[:, rows]
        if b:
            rhs = rhs - np.matmul(L[:, rows, : b * block], X[:, : b * block])
        np.matmul(inv_diag[b], rhs, out=X[:, rows])
    return X


def _block_sizes(G: np.ndarray, C: int, decaying: bool) -> np.ndarray:
    """Per chunk, the largest block size s (a divisor of C) whose factored scores are safe.

    Inside a block of s rows the score exponent is split around the block's first row r:
    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j). Both factors, and the discarded
    products above the diagonal, stay within e^(+-spread), the spread being max - min of
    G over the block. We take the largest s whose every block spread is <= _EXP_LIMIT,
    so nothing overflows. Strong gates shrink s; s = 1 (spread 0) is always safe.
    ``decaying`` (all g <= 0: G falls) makes the spread just first minus last.
    G [F, C, K] -> int array [F].
    """
    F, _, K = G.shape
    limit = _EXP_LIMIT[G.dtype]
    sizes = np.ones(F, dtype=np.int64)
    open_ = np.ones(F, dtype=bool)
    for s in (d for d in range(C, 1, -1) if C % d == 0):
        if decaying:
            spread = G[:, ::s] - G[:, s - 1 :: s]
        else:
            blocks = G.reshape(F, C // s, s, K)
            spread = blocks.max(axis=2) - blocks.min(axis=2)
        fits = open_ & (spread.max(axis=(1, 2), initial=0.0) <= limit)
        sizes[fits] = s
        open_ &= ~fits
        if not open_.any():
            break
    return sizes


def _chunk_terms(kc, kb, qc, G, s: int, out: dict) -> None:
    """The state-independent terms of chunks sharing block size s, written into ``out``.

    kc = k, kb = beta k, qc = scaled q (None: no queries), G [F, C, K]. Fills
    "L" ~ diag(beta) Akk and "Aqk" [F, C, C] on and below the diagonal blocks (zero-
    initialised; the caller masks them to strictly lower / lower); "kg" = beta k exp(G),
    "qg" = q exp(G), "kd" = k exp(G_C - G) [F, C, K]; "a_last" = exp(G_C) [F, K].

    Scores are products of factors from ONE full-size exp: row i of block b carries
    exp(G_i - G_r) (r = first row of b), column j carries exp(G_r - G_j), which is
    1 / exp(G_j - G_r) inside the block and exp(G_r - G_r') exp(G_r' - G_j) for an
    earlier block b' (first row r'). Each row block is then one batched matmul over
    all its causal columns. Whole decays exp(G_x - G_y) are flushed (see _FLUSH).
    """
    F, C, K = G.shape
    nb = C // s
    blocks = G.reshape(F, nb, s, K)
    first = blocks[:, :, :1]  # [F, nb, 1, K]
    left = np.subtract(blocks, first).reshape(F, C, K)
    np.exp(left, out=left)  # exp(G_i - G_r), in [e^-limit, e^limit]
    own = np.reciprocal(left)  # exp(G_r - G_j)

    def decay(factor_full, factor_block, rows=slice(None)):
        """factor_full * factor_block (broadcast over each block's rows), flushed: a whole decay."""
        n = factor_full[:, rows].shape[1] // s
        return _flush(np.multiply(factor_full[:, rows].reshape(F, n, s, K), factor_block).reshape(F, n * s, K))

    exp_G = decay(left, np.exp(first))  # exp(G_i)
    np.multiply(kb, exp_G, out=out["kg"])
    np.multiply(kc, decay(own, np.exp(G[:, None, -1:] - first)), out=out["kd"])  # k_j exp(G_C - G_j)
    _flush(np.exp(G[:, -1], out=out["a_last"]))
    k_left, k_own = kb * left, kc * own
    q_left = None
    if qc is not None:
        np.multiply(qc, exp_G, out=out["qg"])
        q_left = qc * left
    for b in range(nb):
        lo, hi = b * s, (b + 1) * s
        if b == 0:
            right = k_own[:, :hi]
        else:  # earlier blocks b': k_j exp(G_r' - G_j) exp(G_r - G_r')
            right = np.empty((F, hi, K), G.dtype)
            np.multiply(kc[:, :lo], decay(own, np.exp(first[:, b : b + 1] - first[:, :b]), slice(0, lo)),
                        out=right[:, :lo])
            right[:, lo:] = k_own[:, lo:hi]
        right_T = right.swapaxes(-1, -2)
        np.matmul(k_left[:, lo:hi], right_T, out=out["L"][:, lo:hi, :hi])
        if qc is not None:
            np.matmul(q_left[:, lo:hi], right_T, out=out["Aqk"][:, lo:hi, :hi])


def _slab(x: np.ndarray, c0: int, c1: int, C: int) -> np.ndarray:
    """Chunks c0..c1-1 of x [B, T, H, D] as a chunk-major stack [(c1-c0)*B*H, C, D].

    Zero-padded past T (padded steps: k = v = beta = g = 0 leave the state untouched).
    """
    B, T, H, D = x.shape
    n = c1 - c0
    seg = x[:, c0 * C : c1 * C]
    if seg.shape[1] < n * C:
        seg = np.concatenate([seg, np.zeros((B, n * C - seg.shape[1], H, D), x.dtype)], axis=1)
    # Always a fresh copy (callers work on it in place, and must never touch the inputs).
    return seg.reshape(B, n, C, H, D).transpose(1, 0, 3, 2, 4).copy().reshape(n * B * H, C, D)


def _prepare_slab(q, k, v, G_all, beta, c0, c1, C, scale, decaying: bool, need_output: bool) -> dict:
    """Everything in chunks c0..c1-1 that does not depend on the state, batched over them all.

    ``G_all`` is the in-chunk cumulative gate for the whole sequence (``_chunk_cumsum``).
    Returns chunk-major stacks [n*B*H, ...]: W, U (the UT transform), kd = k exp(G_C - G),
    a_last = exp(G_C) and, with queries, QA = [exp(G) q | Aqk] [n*B*H, C, K + C], so that
    the slab's output is one matmul of QA with [state entering each chunk; V'].
    """
    K, V = k.shape[-1], v.shape[-1]
    dtype = k.dtype
    kc = _slab(k, c0, c1, C)
    F = kc.shape[0]
    G = _slab(G_all, c0, c1, C)
    beta_c = _slab(beta[..., None], c0, c1, C)
    kb = kc * beta_c
    qc = None
    if need_output:
        qc = _slab(q, c0, c1, C)
        qc *= np.asarray(scale, dtype)
    rhs = np.empty((F, C, K + V), dtype)  # [beta k exp(G) | beta v]; the UT transform solves against it
    np.multiply(_slab(v, c0, c1, C), beta_c, out=rhs[:, :, K:])
    out = {"L": np.zeros((F, C, C), dtype), "kg": rhs[:, :, :K], "kd": np.empty((F, C, K), dtype),
           "a_last": np.empty((F, K), dtype)}
    if need_output:
        QA = np.zeros((F, C, K + C), dtype)
        out["qg"], out["Aqk"] = QA[:, :, :K], QA[:, :, K:]
    # One block size for the slab: its strongest chunk decides (gathering chunks into
    # groups of equal size costs more than it saves).
    s = int(_block_sizes(G, C, decaying).min())
    _chunk_terms(kc, kb, qc, G, s, out)
    # Keep the causal parts (the dropped upper triangle is bounded, see _EXP_LIMIT); flat
    # contiguous multiplies are several times faster than broadcasting a [C, C] mask.
    L = out["L"]
    L.reshape(F, C * C)[...] *= np.tri(C, C, -1, dtype=dtype).reshape(C * C)
    # UT transform: T = (I + L)^-1 diag(beta), so [W | U] = (I + L)^-1 [beta exp(G) K | beta V].
    WU = _unit_lower_solve(L, rhs)
    prep = {"W": WU[:, :, :K], "U": WU[:, :, K:], "kd": out["kd"], "a_last": out["a_last"]}
    if need_output:
        keep = np.concatenate([np.ones((C, K), dtype), np.tri(C, C, 0, dtype=dtype)], axis=1)
        QA.reshape(F, C * (K + C))[...] *= keep.reshape(C * (K + C))
        prep["QA"] = QA
    return prep


def _chunk_cumsum(g: np.ndarray, C: int) -> np.ndarray:
    """Inclusive cumsum of g [B, T, H, K] restarting at every chunk, in time-major order.

    C vectorised adds over the whole sequence (each on contiguous [H, K] rows) beat both
    np.cumsum along a strided axis and C adds per slab.
    """
    B, T, H, K = g.shape
    N = max(1, -(-T // C))
    G = np.zeros((B, N * C, H, K), g.dtype)
    G[:, :T] = g
    chunks = G.reshape(B, N, C, H, K)
    for i in range(1, C):
        chunks[:, :, i] += chunks[:, :, i - 1]
    return G


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
    for c0, c1 in _slabs(N, B * H):
        prep = _prepare_slab(q, k, v, G, beta, c0, c1, C, scale, decaying, need_output=True)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, C, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        Z = np.empty((n, B * H, K + C, V), dtype)  # per chunk: [state entering it; V']
        Z[0, :, :K] = S
        for j in range(n):
            state, v_new = Z[j, :, :K], Z[j, :, K:]
            np.matmul(W[j], state, out=v_new)
            np.subtract(U[j], v_new, out=v_new)  # V' = U - W S
            nxt = Z[j + 1, :, :K] if j + 1 < n else S
            np.matmul(kd[j].swapaxes(-1, -2), v_new, out=nxt)
            nxt += a_last[j] * state  # S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'
        o_slab = np.matmul(prep["QA"], Z.reshape(n * B * H, K + C, V))  # (exp(G) Q) S + Aqk V'
        o[:, c0:c1] = o_slab.reshape(n, B, H, C, V).transpose(1, 0, 3, 2, 4)
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
