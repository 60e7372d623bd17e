"""Ring attention: the global-attention layers' context parallelism, for contrast with KDA's.

Each rank keeps its queries and passes its key/value block around a ring; after P - 1
steps every rank has seen every earlier block. Partial softmax results merge with the
log-sum-exp rule (:func:`merge_partials`), which is commutative and associative -- blocks
may arrive in any order -- while KDA's slices compose only in order. The price: bytes
that grow with T (a KV block per step), where KDA's exchange is a fixed-size state.

A rank may hold several runs of positions (the zigzag layout of :mod:`~kimilab.cp.zigzag`
gives each rank two). Work is done per pair of runs (query run, key run), and a pair whose
keys all come after its queries is skipped, as a blockwise kernel skips masked tiles;
``stats["score_entries"]`` counts the (query, key) scores the rank did compute.
"""

from __future__ import annotations

import numpy as np

__all__ = ["partial_attention", "merge_partials", "ring_attention_rank", "runs"]


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


def runs(positions) -> list[slice]:
    """Slices of ``positions`` (increasing) that hold consecutive integers: [0..3, 8..11] -> 2 runs."""
    pos = np.asarray(positions)
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *breaks.tolist(), len(pos)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _attend(acc, q, k, v, q_pos, k_pos, scale, stats):
    """Merge into ``acc`` (per query run) the attention of each query run over each key run that
    is not entirely in its future."""
    q_runs, k_runs = runs(q_pos), runs(k_pos)
    for i, qs in enumerate(q_runs):
        for ks in k_runs:
            if k_pos[ks.start] > q_pos[qs.stop - 1]:  # every key after every query: a masked tile
                continue
            part = partial_attention(q[qs], k[ks], v[ks], q_pos[qs], k_pos[ks], scale)
            acc[i] = part if acc[i] is None else merge_partials(acc[i], part)
            if stats is not None:
                stats["score_entries"] = stats.get("score_entries", 0) + (qs.stop - qs.start) * (ks.stop - ks.start)
    return acc


def ring_attention_rank(comm, q, k, v, start: int | None = None, scale=None, *, positions=None, stats=None):
    """This rank's causal attention output for its rows: global positions ``start..start+T_r``,
    or ``positions`` (increasing; several runs allowed, e.g. the zigzag layout's two).

    The (k, v, positions) block travels the ring r -> r+1 for P - 1 steps. ``stats`` (a
    dict) gets ``score_entries`` added: the (query, key) scores computed (masked tiles skipped).
    """
    r, P = comm.rank, comm.size
    q = np.asarray(q)
    pos = np.arange(start, start + q.shape[0]) if positions is None else np.asarray(positions)
    acc = _attend([None] * len(runs(pos)), q, k, v, pos, pos, scale, stats)
    block = (np.asarray(k), np.asarray(v), pos)
    for _ in range(P - 1):
        block = comm.sendrecv(block, (r + 1) % P, (r - 1) % P)
        acc = _attend(acc, q, block[0], block[1], pos, block[2], scale, stats)
    return np.concatenate([o for o, _ in acc], axis=0)
