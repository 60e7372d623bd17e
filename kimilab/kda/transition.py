"""What a whole segment does to the KDA state: the affine map ``S_out = M S_in + C``.

Linear attention's state is a sum (:func:`linear_attention_state`), so the states of
two halves add. KDA's decay and delta correction act on whatever state a segment
starts from, so a segment is an affine map of its input state instead:
:func:`segment_transition` computes ``(M, C)`` -- ``M [H, K, K]`` acting on the key
dimension, ``C [H, K, V]`` the state reached from zero -- and maps compose in order
(:func:`compose_transitions`), associatively but not commutatively. That is what
splitting a sequence across workers (context parallelism) and carrying a cached
prefix state forward need.
"""

from __future__ import annotations

import numpy as np

from kimilab.kda._inputs import check_sequence, float_array
from kimilab.kda.chunk import _chunk_cumsum, _prepare_slab, _slabs
from kimilab.validate import check_int

__all__ = [
    "segment_transition",
    "apply_transition",
    "compose_transitions",
    "identity_transition",
    "linear_attention_state",
]


def segment_transition(k, v, g, beta, chunk_size: int = 64):
    """The affine map a segment applies to the state: ``S_out = M @ S_in + C``.

    k, g ``[.., T, H, K]``, v ``[.., T, H, V]``, beta ``[.., T, H]``. Returns
    ``M [.., H, K, K]`` (acting on the key dimension) and ``C [.., H, K, V]`` (the state
    reached from zero). Per chunk the map is S -> (diag(exp(G_C)) - (exp(G_C - G) K)^T W) S
    + (exp(G_C - G) K)^T U; we run the chunk state pass once on the augmented state
    ``[S | M]`` starting from ``[0 | I]`` (the M columns see U = 0). Queries never
    touch the state, so none are needed.
    """
    _, k, v, g, beta, _, batched, (B, T, H, K, V), dtype = check_sequence(
        None, k, v, g, beta, None, ref="k")
    C = check_int("chunk_size", chunk_size, 1)
    N = max(1, -(-T // C))
    decaying = bool(g.size == 0 or g.max() <= 0)
    aug = np.zeros((B * H, K, V + K), dtype)
    aug[:, :, V:] = np.eye(K, dtype=dtype)
    u_aug = np.zeros((B * H, C, V + K), dtype)
    G = _chunk_cumsum(g, C)
    for c0, c1 in _slabs(N, B * H):
        prep = _prepare_slab(None, k, v, G, beta, c0, c1, C, 1.0, decaying, need_output=False)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, C, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        for j in range(n):
            u_aug[:, :, :V] = U[j]
            aug = a_last[j] * aug + np.matmul(kd[j].swapaxes(-1, -2), u_aug - np.matmul(W[j], aug))
    M = np.ascontiguousarray(aug[:, :, V:]).reshape(B, H, K, K)
    Cst = np.ascontiguousarray(aug[:, :, :V]).reshape(B, H, K, V)
    if not batched:
        return M[0], Cst[0]
    return M, Cst


def apply_transition(M, C, S):
    """``M @ S + C``: the state after a segment whose transition is (M, C), entered with S."""
    M, C, S = (np.asarray(x) for x in (M, C, S))
    if M.ndim < 3 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M: expected [.., H, K, K], got shape {M.shape}")
    if C.shape[:-1] != M.shape[:-1]:
        raise ValueError(f"C: expected [.., H, K, V] matching M {M.shape}, got shape {C.shape}")
    if S.shape != C.shape:
        raise ValueError(f"S: expected [.., H, K, V] = {C.shape} matching C, got shape {S.shape}")
    return np.matmul(M, S) + C


def compose_transitions(first, second):
    """Transition of ``first`` followed by ``second``: (M2 M1, M2 C1 + C2). Order matters."""
    M1, C1 = first
    M2, C2 = second
    return np.matmul(M2, M1), np.matmul(M2, C1) + C2


def identity_transition(H: int, K: int, V: int, dtype=np.float64):
    """The transition of an empty segment: (I, 0)."""
    return np.broadcast_to(np.eye(K, dtype=dtype), (H, K, K)).copy(), np.zeros((H, K, V), dtype)


def linear_attention_state(k, v) -> np.ndarray:
    """Plain (ungated, no delta) linear attention state ``S = sum_t k_t v_t^T`` -> [.., H, K, V]."""
    k = float_array("k", k)
    v = float_array("v", v, k.dtype, "k")
    return np.einsum("...thk,...thv->...hkv", k, v)
