"""Context-parallel KDA: P ranks each hold a slice of one prompt; outputs equal one rank's.

A KDA state does not add: after [A | B] it is ``M_B S(A) + C_B``, so slices compose in
rank order. Each rank runs its slice ONCE before it knows its entering state: rank 0
(which knows it: the prompt's initial state) a plain ``chunk_kda``; rank r > 0 the
affine pass ``kda.chunk_kda_affine`` -> (o0, Qt, M_r, C_r). The ranks then exchange
their transitions (bytes independent of T) by one of three schemes (:data:`SCHEMES`),
and rank r corrects its outputs ``o = o0 + Qt S_in`` -- linear in the entering state.
"""

from __future__ import annotations

import numpy as np

from kimilab.cp.comm import run_local
from kimilab.cp.split import cut_points, slices
from kimilab.kda import chunk_kda, compose_transitions
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine

__all__ = ["SCHEMES", "cp_kda_rank", "context_parallel_kda", "check_agreement", "fold_states"]

SCHEMES = {
    "sequential": "rank r waits for rank r-1's final state, then sends its own: P-1 steps in a chain",
    "allgather": "every rank all-gathers all (M, C) and folds the earlier ones itself (flash-linear-attention's)",
    "tree": "log-depth inclusive scan of transitions (recursive doubling), then one shift",
}


def check_agreement(comm, shapes: tuple, error: str | None) -> None:
    """Collective check before any data moves: every rank raises the same error, or none does.

    ``shapes`` is (H, K, V, dtype name, local T). All ranks call this first, so a bad
    input on one rank is reported on every rank instead of leaving the others waiting.
    """
    everyone = comm.allgather((shapes, error))
    for r, (_, err) in enumerate(everyone):
        if err:
            raise ValueError(f"rank {r}: {err}")
    heads = {s[:4] for s, _ in everyone}
    if len(heads) != 1:
        raise ValueError(f"ranks disagree on (H, K, V, dtype): {[s[:4] for s, _ in everyone]}")
    empty = [r for r, (s, _) in enumerate(everyone) if s[4] < 1]
    if empty:
        raise ValueError(f"ranks {empty} hold no tokens: every rank needs at least one (P larger than T?)")


def fold_states(transitions, S0=None, dtype=None):
    """States entering each of the segments whose transitions are given, in order (from S0 or 0).

    Returns P states: before segment 0, 1, .., P-1. ``dtype`` is the precision of the fold
    (default: that of the transitions); flash-linear-attention keeps this chain in fp32.
    """
    M0, C0 = transitions[0]
    dtype = np.dtype(dtype or C0.dtype)
    S = np.zeros(C0.shape, dtype) if S0 is None else np.asarray(S0, dtype)
    out = []
    for M, C in transitions:
        out.append(S)
        S = np.matmul(M.astype(dtype), S) + C.astype(dtype)
    return out


def _local(comm, q, k, v, g, beta, scale, initial_state, chunk_size):
    """This rank's pass before it knows its entering state: (transition, finish(S_in) -> (o, S_out))."""
    if comm.rank == 0:
        o, S = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
        return (np.zeros(S.shape[:-1] + (S.shape[-2],), S.dtype), S), (lambda _S_in: (o, S))
    o0, Qt, M, C = chunk_kda_affine(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    return (M, C), (lambda S_in: (apply_affine_outputs(o0, Qt, S_in), np.matmul(M, S_in) + C))


def _entering_state(comm, trans, scheme: str):
    """The state entering this rank's slice, by ``scheme`` (rank 0's transition has M = 0)."""
    r, P = comm.rank, comm.size
    if scheme == "allgather":
        everyone = comm.allgather(trans)
        return fold_states(everyone)[r]
    if scheme == "sequential":
        S_in = comm.recv(r - 1) if r > 0 else np.zeros_like(trans[1])
        if r + 1 < P:
            comm.send(np.matmul(trans[0], S_in) + trans[1], r + 1)
        return S_in
    # tree: after round d, rank r holds the composite of ranks max(0, r - 2d + 1)..r
    acc, d = trans, 1
    while d < P:
        if r + d < P:
            comm.send(acc, r + d)
        if r - d >= 0:
            acc = compose_transitions(comm.recv(r - d), acc)
        d *= 2
    # the composite of 0..r has M = 0 (rank 0's), so its C is the state after rank r
    if r + 1 < P:
        comm.send(acc[1], r + 1)
    return comm.recv(r - 1) if r > 0 else np.zeros_like(trans[1])


def cp_kda_rank(comm, q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                scheme: str = "allgather"):
    """One rank's part of context-parallel KDA over its slice ``[T_r, H, ..]``: returns (o, S_after).

    ``initial_state`` is the prompt's (used by rank 0 only). ``S_after`` is the state
    after this rank's slice; the last rank's is the prompt's final state.
    """
    error, shapes = None, (0, 0, 0, "?", 0)
    try:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r}: expected one of {sorted(SCHEMES)}")
        q, k, v, g, beta = (np.asarray(x) for x in (q, k, v, g, beta))
        if k.ndim != 3 or v.ndim != 3 or q.shape != k.shape or g.shape != k.shape or beta.shape != k.shape[:2]:
            raise ValueError(f"expected q, k, g [T, H, K], v [T, H, V], beta [T, H]; got q {q.shape}, "
                             f"k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}")
        shapes = (k.shape[1], k.shape[2], v.shape[2], k.dtype.name, k.shape[0])
    except (ValueError, TypeError) as exc:
        error = str(exc)
    check_agreement(comm, shapes, error)
    trans, finish = _local(comm, q, k, v, g, beta, scale, initial_state, chunk_size)
    return finish(_entering_state(comm, trans, scheme))


def context_parallel_kda(q, k, v, g, beta, *, ranks: int | None = None, bounds=None, scale=None,
                         initial_state=None, chunk_size: int = 64, scheme: str = "allgather"):
    """Context-parallel KDA on P in-process ranks: ``(o, final_state, comms)`` for one prompt ``[T, H, ..]``.

    Cut at ``bounds`` (P + 1 cut points) or evenly into ``ranks`` slices. ``comms`` hold
    each rank's bytes and messages sent.
    """
    bounds = cut_points(np.asarray(k).shape[0], ranks, bounds)
    parts = [tuple(np.asarray(x)[s] for x in (q, k, v, g, beta)) for s in slices(bounds)]

    def rank_fn(comm):
        return cp_kda_rank(comm, *parts[comm.rank], scale=scale, initial_state=initial_state,
                           chunk_size=chunk_size, scheme=scheme)

    results, comms = run_local(len(parts), rank_fn)
    o = np.concatenate([o for o, _ in results], axis=0)
    return o, results[-1][1], comms
