"""The chunkwise KDA algorithm written out plainly: one head, float64, explicit loops.

:func:`naive_chunk_kda` is the readable twin of :func:`kimilab.kda.chunk_kda`. It does
the same algebra -- per chunk: the key-key scores ``Akk``, the matrix ``T`` by forward
substitution, ``W = T (exp(G) K)``, ``U = T V``, the corrected values ``V' = U - W S``,
the outputs and the state update -- one chunk, one row at a time, with nothing batched
and no numerical guards. Chapter 2 derives it by unrolling the delta rule inside a
chunk; the tests hold it equal to :func:`kimilab.kda.recurrent_kda`.
"""

from __future__ import annotations

import numpy as np

from kimilab.kda._inputs import resolve_scale
from kimilab.validate import check_int

__all__ = ["naive_chunk_kda"]


def _one_head(name: str, x, shape: tuple) -> np.ndarray:
    """``x`` as a float64 array of ``shape`` (None entries: any size), or a ValueError naming it."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, arr.shape)):
        layout = "[" + ", ".join("?" if n is None else str(n) for n in shape) + "]"
        raise ValueError(f"{name}: expected one head, shape {layout}, got {arr.shape}")
    return arr


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunkwise KDA for ONE head, in float64. Returns ``(o [T, V], final_state [K, V])``.

    q, k, g ``[T, K]``; v ``[T, V]``; beta ``[T]``; initial_state ``[K, V]`` (default 0).
    Same result as ``recurrent_kda`` on the same head, up to float64 rounding.
    """
    k = _one_head("k", k, (None, None))
    T, K = k.shape
    q, g = _one_head("q", q, (T, K)), _one_head("g", g, (T, K))
    v = _one_head("v", v, (T, None))
    V = v.shape[1]
    beta = _one_head("beta", beta, (T,))
    S = np.zeros((K, V)) if initial_state is None else \
        _one_head("initial_state", initial_state, (K, V)).copy()
    scale = resolve_scale(scale, K)
    C = check_int("chunk_size", chunk_size, 1)
    o = np.zeros((T, V))
    for start in range(0, T, C):
        rows = slice(start, start + C)
        Q, Kc, Vc, b = scale * q[rows], k[rows], v[rows], beta[rows]
        G = np.cumsum(g[rows], axis=0)  # G[i] = g_0 + ... + g_i: decay from chunk start to row i
        c = len(Kc)

        # Akk[i, j] = sum_d k_id k_jd exp(G_id - G_jd) for j < i: what row j's write shows at row i
        Akk = np.zeros((c, c))
        for i in range(c):
            for j in range(i):
                Akk[i, j] = np.sum(Kc[i] * Kc[j] * np.exp(G[i] - G[j]))

        # T = (I + diag(beta) Akk)^-1 diag(beta), row by row (forward substitution):
        # T[i] = beta_i (e_i - sum_{j<i} Akk[i, j] T[j])
        Tm = np.zeros((c, c))
        for i in range(c):
            row = np.eye(c)[i]
            for j in range(i):
                row = row - Akk[i, j] * Tm[j]
            Tm[i] = b[i] * row

        W = Tm @ (np.exp(G) * Kc)  # [c, K]: how the state entering the chunk shifts each write
        U = Tm @ Vc  # [c, V]: the writes if the chunk started from a zero state
        V_new = U - W @ S  # [c, V]: the values actually written, the rows u_i

        # o_i = S_i^T q_i = (exp(G_i) q_i)^T S + sum_{j<=i} Aqk[i, j] V'_j
        for i in range(c):
            o_i = (np.exp(G[i]) * Q[i]) @ S
            for j in range(i + 1):
                o_i = o_i + np.sum(Q[i] * Kc[j] * np.exp(G[i] - G[j])) * V_new[j]
            o[start + i] = o_i

        # S <- diag(exp(G_last)) S + sum_j (exp(G_last - G_j) k_j) V'_j^T
        S = np.exp(G[-1])[:, None] * S + (np.exp(G[-1] - G) * Kc).T @ V_new
    return o, S
