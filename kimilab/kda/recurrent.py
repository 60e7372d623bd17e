"""KDA token by token: the reference loop over a sequence, the one-token decode step, their costs.

Per head the state ``S`` is a K x V matrix. Each token first decays every key-row of
``S`` by its own gate ``exp(g_t)`` (a vector, one value per key channel), then applies
a delta-rule correction with strength ``beta_t``; the output reads the updated state::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

:func:`recurrent_kda` is the slow, obvious form every other kernel is tested against;
:func:`kda_step` is the same update for one decode token. Both share
:func:`kda_update`, so prefill-by-loop and decode cannot drift apart.
"""

from __future__ import annotations

import numpy as np

from kimilab.kda._inputs import check_sequence, check_step, resolve_scale

__all__ = ["kda_update", "recurrent_kda", "kda_step", "recurrent_kda_flops", "state_bytes"]


def kda_update(S, q_t, k_t, v_t, decay_t, beta_t, scale):
    """One token, in place on S [B, H, K, V] (decay_t = exp(g_t)); returns o [B, H, V].

    Shared by the sequence loop and the decode step; no argument checks (they are theirs).
    """
    S *= decay_t[..., :, None]
    kS = np.matmul(k_t[..., None, :], S)[..., 0, :]  # S^T k   [B, H, V]
    S += (beta_t[..., None] * k_t)[..., :, None] * (v_t - kS)[..., None, :]
    return np.matmul((scale * q_t)[..., None, :], S)[..., 0, :]


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token KDA (the reference). Returns ``(o [.., T, H, V], final_state [.., H, K, V])``.

    Vectorised over batch and heads; the only Python loop is over time.
    """
    q, k, v, g, beta, S0, batched, (B, T, H, K, V), dtype = check_sequence(
        q, k, v, g, beta, initial_state)
    scale = resolve_scale(scale, K)
    S = np.zeros((B, H, K, V), dtype) if S0 is None else S0.astype(dtype, copy=True)
    decay = np.exp(g)
    o = np.empty((B, T, H, V), dtype)
    for t in range(T):
        o[:, t] = kda_update(S, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], scale)
    if not batched:
        return o[0], S[0]
    return o, S


def kda_step(q, k, v, g, beta, state, scale=None):
    """One decode token. q, k, g ``[H, K]``; v ``[H, V]``; beta ``[H]``; state ``[H, K, V]``
    (or all with a leading B). Returns ``(o [.., H, V], new_state)``; ``state`` is not modified.
    """
    (q, k, v, g, beta, state), batched = check_step(q, k, v, g, beta, state)
    scale = resolve_scale(scale, q.shape[-1])
    S = state.astype(q.dtype, copy=True)
    o = kda_update(S, q, k, v, np.exp(g), beta, scale)
    if not batched:
        return o[0], S[0]
    return o, S


def state_bytes(H: int, K: int, V: int, itemsize: int = 4) -> int:
    """Bytes of one layer's KDA state: H x K x V elements, independent of context length."""
    return int(H) * int(K) * int(V) * int(itemsize)


def recurrent_kda_flops(T: int, H: int, K: int, V: int) -> int:
    """FLOPs of ``recurrent_kda`` per the update above (multiply-add = 2).

    Per token and head: decay K*V, S^T k 2KV, v - S^T k V, beta k K,
    rank-1 update 2KV, output 2KV (+ K for scaling q).
    """
    per = 7 * K * V + V + 2 * K
    return int(T) * int(H) * per
