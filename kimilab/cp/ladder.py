"""From LASP-2 to KDA in four rungs: what each rank must send, and how the pieces combine.

Every rung is a linear recurrence ``S_t = A_t S_{t-1} + w_t`` read by ``o_t = S_t^T (scale q_t)``,
so a slice of the prompt maps its entering state affinely: ``S_out = M S_in + C`` and
``o = o0 + Qt S_in``. What changes up the ladder is M:

- ``additive`` (linear attention, LASP / LASP-2): ``A_t = I``. M = I, nothing to send but C;
  the entering state is a SUM of the earlier ranks' C, in any order (LASP-2's all-gather).
- ``scalar`` (one decay per head, RetNet / Lightning-style): ``A_t = a_t I``. M is one number
  per head; ordered, but composing is scaling.
- ``channel`` (a decay per key channel, GLA-style): ``A_t = Diag(a_t)``. M is K numbers per
  head; ordered, composing is elementwise.
- ``kda``: ``A_t = (I - b_t k_t k_t^T) Diag(a_t)``. M is a dense K x K matrix per head,
  ordered, and composing is a matrix product.

On the first three rungs Qt is ``scale q_t`` times the decay so far: known without a pass,
so a rank runs its slice once from zero and corrects later for free. On KDA's rung Qt is
what the delta rule made of the entering state, and the affine pass must carry it
(``kda.chunk_kda_affine``). :func:`ladder_reference` is the token-by-token twin.
"""

from __future__ import annotations

import numpy as np

from kimilab.cp.comm import run_local
from kimilab.cp.split import cut_points, slices
from kimilab.kda import chunk_kda, recurrent_kda
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.validate import check_choice

__all__ = ["RUNGS", "ladder_reference", "ladder_local", "ladder_rank", "ladder_cp", "transition_values"]

RUNGS = {
    "additive": "linear attention (LASP-2): S += k v^T; M = I, ranks send C and sum them in any order",
    "scalar": "one decay per head: S = a S + k v^T; M = a scalar per head, composed in order",
    "channel": "a decay per key channel (GLA): S = Diag(a) S + k v^T; M = K numbers per head, in order",
    "kda": "KDA: S = (I - b k k^T) Diag(a) S + b k v^T; M = a dense K x K matrix per head, in order",
}


def _log_decay(rung: str, g):
    """Per-token log decay [.., T, H, K] of a rung (0 for additive; channel 0 for scalar)."""
    g = np.asarray(g)
    if rung == "additive":
        return np.zeros_like(g)
    if rung == "scalar":
        return np.broadcast_to(g[..., :1], g.shape)
    return g


def ladder_reference(rung: str, q, k, v, g, beta, initial_state=None, scale=None):
    """Token-by-token outputs and final state of a rung: ``(o [T, H, V], S [H, K, V])``."""
    check_choice("rung", rung, RUNGS)
    if rung == "kda":
        return recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    T, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    a = np.exp(_log_decay(rung, g))
    S = np.zeros((H, K, v.shape[-1]), k.dtype) if initial_state is None else np.array(initial_state, k.dtype)
    o = np.empty((T, H, v.shape[-1]), k.dtype)
    for t in range(T):
        S = a[t][:, :, None] * S + k[t][:, :, None] * v[t][:, None, :]
        o[t] = np.einsum("hk,hkv->hv", scale * q[t], S)
    return o, S


def ladder_local(rung: str, q, k, v, g, beta, scale=None):
    """One slice from a zero state: ``(o0, Qt, m, C)`` with ``o = o0 + Qt S_in`` and ``S_out = M S_in + C``.

    ``m`` is M in the rung's compact form: None (M = I), ``[H]``, ``[H, K]`` or ``[H, K, K]``.
    """
    check_choice("rung", rung, RUNGS)
    if rung == "kda":
        return chunk_kda_affine(q, k, v, g, beta, scale=scale)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    T, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    L = np.cumsum(_log_decay(rung, g), axis=0)  # log of the decay from the slice start to t, [T, H, K]
    gap = L[:, None] - L[None, :]  # [t, s, H, K]: log decay from s to t
    causal = (np.arange(T)[:, None] >= np.arange(T)[None, :])[:, :, None, None]
    weight = np.exp(np.where(causal, gap, -np.inf))  # masked BEFORE exp: above the diagonal gap > 0
    scores = np.einsum("thk,tshk,shk->hts", scale * q, weight, k)
    o0 = np.einsum("hts,shv->thv", scores, v)
    Qt = scale * q * np.exp(L)
    C = np.einsum("shk,shv->hkv", k * np.exp(L[-1] - L), v)
    m = None if rung == "additive" else (np.exp(L[-1, :, 0]) if rung == "scalar" else np.exp(L[-1]))
    return o0, Qt, m, C


def _apply(m, S):
    """M S for M in compact form."""
    if m is None:
        return S
    m = np.asarray(m)
    if m.ndim == 1:
        return m[:, None, None] * S
    if m.ndim == 2:
        return m[:, :, None] * S
    return np.matmul(m, S)


def transition_values(rung: str, H: int, K: int) -> int:
    """Numbers of M a rank sends beside its C (H K V numbers): 0, H, H K or H K K."""
    check_choice("rung", rung, RUNGS)
    return {"additive": 0, "scalar": H, "channel": H * K, "kda": H * K * K}[rung]


def ladder_rank(comm, rung: str, q, k, v, g, beta, *, initial_state=None, scale=None):
    """One rank of a rung's context parallelism: one pass from zero, one all-gather, a correction.

    Rank 0 knows its entering state and runs the reference form directly. The others
    all-gather (m, C) -- for ``additive`` just C, summed in any order -- fold the earlier
    ranks' in rank order and correct ``o = o0 + Qt S_in``. Returns ``(o, S_out)``.
    """
    if comm.rank == 0:
        o, S = (chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state) if rung == "kda"
                else ladder_reference(rung, q, k, v, g, beta, initial_state, scale))
        comm.allgather(S if rung == "additive" else (None, S))  # its C is its final state; None: nothing enters
        return o, S
    o0, Qt, m, C = ladder_local(rung, q, k, v, g, beta, scale)
    everyone = comm.allgather(C if rung == "additive" else (m, C))
    if rung == "additive":
        S_in = sum(reversed(everyone[:comm.rank]))  # a sum: any order will do (here: backwards)
    else:
        S_in = np.zeros_like(C)
        for m_j, C_j in everyone[:comm.rank]:
            S_in = C_j if m_j is None else _apply(m_j, S_in) + C_j  # None: rank 0, whose state is known
    return apply_affine_outputs(o0, Qt, S_in), _apply(m, S_in) + C


def ladder_cp(rung: str, q, k, v, g, beta, *, ranks: int | None = None, bounds=None, initial_state=None,
              scale=None):
    """A rung's context parallelism on in-process ranks: ``(o, final_state, comms)``."""
    check_choice("rung", rung, RUNGS)
    bounds = cut_points(np.asarray(k).shape[0], ranks, bounds)
    parts = [tuple(np.asarray(x)[s] for x in (q, k, v, g, beta)) for s in slices(bounds)]
    results, comms = run_local(len(parts), lambda comm: ladder_rank(comm, rung, *parts[comm.rank],
                                                                      initial_state=initial_state, scale=scale))
    return np.concatenate([o for o, _ in results], axis=0), results[-1][1], comms
