"""A chunk pass that keeps its dependence on the entering state: outputs and state as affine maps.

``chunk_kda`` from a state S gives outputs and a final state that are affine in S:
``o = o0 + Qt S`` and ``S_out = M S + C``. :func:`chunk_kda_affine` runs the chunk
state pass ONCE on the augmented state ``[S | M]`` from ``[0 | I]`` (the M columns see
V-inputs of zero), so one pass returns ``o0`` (outputs from a zero state), ``Qt`` (what
each output reads from the entering state) and the segment transition ``(M, C)``.
Context parallelism uses it: a rank runs its slice before it knows the state entering
it, and corrects later with :func:`apply_affine_outputs` -- no second pass. Entries of
M below the chunk kernel's flush level (float32 1e-10) are set to 0, as decays are; once
all of M is 0 the rest of the pass runs at plain ``chunk_kda`` cost (Qt = 0 there).
"""

from __future__ import annotations

import numpy as np

from kimilab.kda._inputs import check_sequence, resolve_scale
from kimilab.kda.chunk import _FLUSH, _chunk_cumsum, _prepare_slab, _slabs
from kimilab.validate import check_int

__all__ = ["chunk_kda_affine", "apply_affine_outputs"]


def chunk_kda_affine(q, k, v, g, beta, scale=None, chunk_size: int = 64):
    """Outputs and final state of a chunk pass as affine functions of the entering state.

    Same inputs as ``chunk_kda`` (no initial state). Returns ``(o0, Qt, M, C)``: o0
    ``[.., T, H, V]`` the outputs from a zero state, Qt ``[.., T, H, K]`` with
    ``o = o0 + Qt S`` per head, M ``[.., H, K, K]`` and C ``[.., H, K, V]`` with
    ``S_out = M S + C`` (the same (M, C) as ``segment_transition``).
    """
    q, k, v, g, beta, _, batched, (B, T, H, K, V), dtype = check_sequence(q, k, v, g, beta, None)
    scale = resolve_scale(scale, K)
    Cs = check_int("chunk_size", chunk_size, 1)
    N = max(1, -(-T // Cs))
    decaying = bool(g.size == 0 or g.max() <= 0)
    D = V + K
    flush = _FLUSH[np.dtype(dtype)]
    S = np.zeros((B * H, K, D), dtype)
    S[:, :, V:] = np.eye(K, dtype=dtype)
    o0 = np.empty((B, N, Cs, H, V), dtype)
    Qt = np.zeros((B, N, Cs, H, K), dtype)  # rows after M flushed stay 0 (pages untouched)
    G = _chunk_cumsum(g, Cs)
    for c0, c1 in _slabs(N, B * H):
        if S.shape[-1] == D and not S[:, :, V:].any():  # M flushed: later chunks don't see S_in
            S = np.ascontiguousarray(S[:, :, :V])
        d = S.shape[-1]
        prep = _prepare_slab(q, k, v, G, beta, c0, c1, Cs, scale, decaying, need_output=True)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, Cs, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        Z = np.empty((n, B * H, K + Cs, d), dtype)  # per chunk: [augmented state entering it; V']
        Z[0, :, :K] = S
        for j in range(n):
            state, v_new = Z[j, :, :K], Z[j, :, K:]
            np.matmul(W[j], state, out=v_new)
            # not np.negative(v, out=v): numpy 2.4 writes the wrong elements of views like this one
            v_new *= -1
            v_new[:, :, :V] += U[j]  # V' = [U | 0] - W [S | M]
            if d > V:
                vm = v_new[:, :, V:]
                vm *= np.abs(vm) >= flush
            nxt = Z[j + 1, :, :K] if j + 1 < n else S
            np.matmul(kd[j].swapaxes(-1, -2), v_new, out=nxt)
            nxt += a_last[j] * state
            if d > V:
                # M decays towards 0: flush it before it turns subnormal (BLAS slows ~10x)
                m = nxt[:, :, V:]
                m *= np.abs(m) >= flush
        o_slab = np.matmul(prep["QA"], Z.reshape(n * B * H, K + Cs, d)).reshape(n, B, H, Cs, d)
        o0[:, c0:c1] = o_slab[..., :V].transpose(1, 0, 3, 2, 4)
        if d > V:
            Qt[:, c0:c1] = o_slab[..., V:].transpose(1, 0, 3, 2, 4)
    if S.shape[-1] < D:
        S = np.concatenate([S, np.zeros((B * H, K, K), dtype)], axis=-1)
    o0, Qt = o0.reshape(B, N * Cs, H, V)[:, :T], Qt.reshape(B, N * Cs, H, K)[:, :T]
    S = S.reshape(B, H, K, D)
    M, C = np.ascontiguousarray(S[..., V:]), np.ascontiguousarray(S[..., :V])
    if not batched:
        return o0[0], Qt[0], M[0], C[0]
    return o0, Qt, M, C


def apply_affine_outputs(o0, Qt, S):
    """``o0 + Qt S`` per head: the outputs of a pass entered with state S ``[.., H, K, V]``."""
    o0, Qt, S = (np.asarray(x) for x in (o0, Qt, S))
    if Qt.shape[:-1] != o0.shape[:-1] or S.shape[-3:] != (Qt.shape[-2], Qt.shape[-1], o0.shape[-1]):
        raise ValueError(f"shapes do not match: o0 {o0.shape}, Qt {Qt.shape}, S {S.shape}")
    # Rows after M flushed read nothing of S (their Qt is exactly 0): correct only the rows before.
    T = Qt.shape[-3]
    nonzero = np.flatnonzero(np.moveaxis(Qt, -3, 0).reshape(T, -1).any(axis=1)) if T else np.zeros(0, int)
    live = int(nonzero[-1]) + 1 if nonzero.size else 0
    o = np.array(o0, dtype=np.result_type(o0, Qt, S), copy=True)
    if live:
        # one batched matmul per head ([.., H, t, K] @ [.., H, K, V]): BLAS, ~3x faster than the einsum
        head = np.matmul(np.swapaxes(Qt[..., :live, :, :], -3, -2), S).swapaxes(-3, -2)
        o[..., :live, :, :] += head
    return o
