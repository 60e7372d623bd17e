"""Ring attention: the global-attention layers' context parallelism, for contrast with KDA's.

Each rank keeps its queries and passes its key/value block around a ring; after P - 1
steps every rank has seen every earlier block. Partial softmax results merge with the
log-sum-exp rule (:func:`merge_partials`), which is commutative and associative -- blocks
may arrive in any order -- while KDA's slices compose only in order. The price: bytes
that grow with T (a KV block per step), where KDA's exchange is a fixed-size state.
"""

from __future__ import annotations

import numpy as np

__all__ = ["partial_attention", "merge_partials", "ring_attention_rank"]


def partial_attention(q, k, v, q_pos, k_pos, scale=None):
    """Softmax attention of q ``[Tq, H, D]`` over one block k, v ``[Tk, H, D|Dv]``, causal by position.

    Returns (o ``[Tq, H, Dv]`` normalised within the block, lse ``[Tq, H]``); rows that
    see no key get lse = -inf and o = 0.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = np.einsum("thd,shd->hts", q, k) * scale
    s = np.where(np.asarray(k_pos)[None, None, :] <= np.asarray(q_pos)[None, :, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - safe)
    z = p.sum(axis=-1, keepdims=True)
    o = np.einsum("hts,shv->thv", p / np.where(z > 0, z, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(z) + safe)[..., 0].T
    return o, lse


def merge_partials(a, b):
    """Merge two (o, lse) partial results over disjoint key blocks: order does not matter."""
    (oa, la), (ob, lb) = a, b
    m = np.maximum(la, lb)
    safe = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(la - safe), np.exp(lb - safe)
    z = wa + wb
    o = (oa * wa[..., None] + ob * wb[..., None]) / np.where(z > 0, z, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        return o, np.log(z) + safe


def ring_attention_rank(comm, q, k, v, start: int, scale=None):
    """This rank's causal attention output for its slice (global positions start..start+T_r).

    The (k, v, positions) block travels the ring r -> r+1 for P - 1 steps.
    """
    r, P = comm.rank, comm.size
    pos = np.arange(start, start + np.asarray(q).shape[0])
    acc = partial_attention(q, k, v, pos, pos, scale)
    block = (np.asarray(k), np.asarray(v), pos)
    for _ in range(P - 1):
        block = comm.sendrecv(block, (r + 1) % P, (r - 1) % P)
        acc = merge_partials(acc, partial_attention(q, block[0], block[1], pos, block[2], scale))
    return acc[0]
