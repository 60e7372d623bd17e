"""The chunk pass split in two, as flash-linear-attention's context parallelism runs it.

``chunk_kda`` does two kinds of work: the state-independent preparation of every chunk
(gate factors, the UT/WY transform ``W, U``, the in-chunk scores) and a short state pass
that walks the chunks in order. flash-linear-attention's KDA context parallelism
("KCP", ``fla/ops/kda/chunk_fwd.py``) computes the preparation ONCE and runs two state
passes over it: a pre-pass that turns the slice into its transition ``(M, C)`` (no
outputs), then, after the ranks have exchanged transitions, the main pass from the true
entering state, with outputs. :func:`prepare_kda` is the shared half;
:func:`prepared_transition` and :func:`run_prepared` are the two passes. Together they
equal ``segment_transition`` and ``chunk_kda``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kimilab.kda._inputs import check_sequence, float_array, resolve_scale
from kimilab.kda.chunk import _FLUSH, _chunk_cumsum, _prepare_slab, _slabs
from kimilab.validate import check_int

__all__ = ["PreparedKDA", "prepare_kda", "prepared_transition", "run_prepared"]


@dataclass(frozen=True)
class PreparedKDA:
    """Everything in a sequence's chunk pass that does not depend on the entering state.

    ``slabs`` holds ``(c0, c1, prep)`` per slab of chunks, with ``prep`` as
    ``kda.chunk._prepare_slab`` returns it (W, U, kd, a_last, QA); memory grows with T.
    """

    slabs: tuple
    sizes: tuple  # (B, T, H, K, V)
    chunk_size: int
    batched: bool
    dtype: np.dtype

    @property
    def n_chunks(self) -> int:
        return max(1, -(-self.sizes[1] // self.chunk_size))


def prepare_kda(q, k, v, g, beta, scale=None, chunk_size: int = 64) -> PreparedKDA:
    """The shared preparation of a chunk pass (same inputs as ``chunk_kda``, no state)."""
    q, k, v, g, beta, _, batched, (B, T, H, K, V), dtype = check_sequence(q, k, v, g, beta, None)
    scale = resolve_scale(scale, K)
    Cs = check_int("chunk_size", chunk_size, 1)
    N = max(1, -(-T // Cs))
    decaying = bool(g.size == 0 or g.max() <= 0)
    G = _chunk_cumsum(g, Cs)
    slabs = tuple((c0, c1, _prepare_slab(q, k, v, G, beta, c0, c1, Cs, scale, decaying, need_output=True))
                  for c0, c1 in _slabs(N, B * H))
    return PreparedKDA(slabs, (B, T, H, K, V), Cs, batched, np.dtype(dtype))


def _views(prep: dict, n: int, F: int, K: int):
    W, U, kd = (prep[name].reshape(n, F, prep[name].shape[-2], -1) for name in ("W", "U", "kd"))
    return W, U, kd, prep["a_last"].reshape(n, F, K, 1)


def prepared_transition(prepared: PreparedKDA):
    """The pre-pass: the slice's transition ``(M [.., H, K, K], C [.., H, K, V])``, no outputs.

    One state pass on the augmented state ``[S | M]`` from ``[0 | I]`` (the M columns see
    U = 0); M's entries below the kernel's flush level are set to 0, and once M is all 0
    the remaining chunks carry only the V columns (as ``chunk_kda_affine`` does).
    """
    B, T, H, K, V = prepared.sizes
    F, dtype = B * H, prepared.dtype
    flush = _FLUSH[dtype]
    S = np.zeros((F, K, V + K), dtype)
    S[:, :, V:] = np.eye(K, dtype=dtype)
    for c0, c1, prep in prepared.slabs:
        n = c1 - c0
        W, U, kd, a_last = _views(prep, n, F, K)
        for j in range(n):
            if S.shape[-1] > V and not S[:, :, V:].any():
                S = np.ascontiguousarray(S[:, :, :V])
            v_new = -np.matmul(W[j], S)
            v_new[:, :, :V] += U[j]  # [U | 0] - W [S | M]
            S = a_last[j] * S + np.matmul(kd[j].swapaxes(-1, -2), v_new)
            if S.shape[-1] > V:
                m = S[:, :, V:]
                m *= np.abs(m) >= flush
    if S.shape[-1] == V:
        S = np.concatenate([S, np.zeros((F, K, K), dtype)], axis=-1)
    M = np.ascontiguousarray(S[:, :, V:]).reshape(B, H, K, K)
    C = np.ascontiguousarray(S[:, :, :V]).reshape(B, H, K, V)
    return (M, C) if prepared.batched else (M[0], C[0])


def run_prepared(prepared: PreparedKDA, initial_state=None):
    """The main pass from ``initial_state`` (default 0): ``(o, final_state)``, as ``chunk_kda``."""
    B, T, H, K, V = prepared.sizes
    F, dtype, Cs = B * H, prepared.dtype, prepared.chunk_size
    if initial_state is None:
        S = np.zeros((F, K, V), dtype)
    else:
        S0 = float_array("initial_state", initial_state, dtype)
        expected = (B, H, K, V) if prepared.batched else (H, K, V)
        if S0.shape != expected:
            raise ValueError(f"initial_state: expected shape {expected}, got {S0.shape}")
        S = S0.reshape(F, K, V).astype(dtype, copy=True)
    o = np.empty((B, prepared.n_chunks, Cs, H, V), dtype)
    for c0, c1, prep in prepared.slabs:
        n = c1 - c0
        W, U, kd, a_last = _views(prep, n, F, K)
        Z = np.empty((n, F, K + Cs, V), dtype)  # per chunk: [state entering it; V']
        Z[0, :, :K] = S
        for j in range(n):
            state, v_new = Z[j, :, :K], Z[j, :, K:]
            np.matmul(W[j], state, out=v_new)
            np.subtract(U[j], v_new, out=v_new)
            nxt = Z[j + 1, :, :K] if j + 1 < n else S
            np.matmul(kd[j].swapaxes(-1, -2), v_new, out=nxt)
            nxt += a_last[j] * state
        o_slab = np.matmul(prep["QA"], Z.reshape(n * F, K + Cs, V))
        o[:, c0:c1] = o_slab.reshape(n, B, H, Cs, V).transpose(1, 0, 3, 2, 4)
    o = o.reshape(B, prepared.n_chunks * Cs, H, V)[:, :T]
    S = S.reshape(B, H, K, V)
    return (o, S) if prepared.batched else (o[0], S[0])
